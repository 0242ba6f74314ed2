"""Tokenizers: one interface over SentencePiece `.model` files and HF `tokenizer.json`.

Host-only (no jax import), so data loaders and verifiers can use it.

  tok = tokenizer.load('/ckpt/Qwen3-8B')            # tokenizer.json (+ tokenizer_config.json)
  tok = tokenizer.load('/data/tiny.model')          # SentencePiece
  ids = tok.encode(chat.render(messages))           # special tokens are single ids
  text = tok.decode(ids, skip_special=True)

`load` reads local or `gs://` paths (`foundation.paths`; both backends load
from bytes). `encode` never adds BOS/EOS: callers add `bos_id` where their format wants
it. `eos_id` is the id that ends a generation: `<|im_end|>` when the
vocabulary has it (ChatML), else the tokenizer's own end-of-sequence token.

`train_sentencepiece` trains the tiny demo's tokenizer from a corpus: chat
special tokens stay single pieces, digits are split one per token, bytes
fall back for unseen characters, and text round-trips exactly (newlines,
indentation and repeated spaces are kept).
"""

from __future__ import annotations

import abc
import json
import os
import pathlib
import re
from typing import Iterable, Sequence

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
import tokenizers

from foundation import chat
from foundation import paths

# Names of end-of-sequence / beginning / padding tokens in common vocabularies,
# used when no tokenizer_config.json says which is which.
_EOS_NAMES = ('<|endoftext|>', '<|end_of_text|>', '</s>', '<eos>')
_BOS_NAMES = ('<|begin_of_text|>', '<s>', '<bos>')
_PAD_NAMES = ('<pad>', '<|pad|>', '<|endoftext|>')


class Tokenizer(abc.ABC):
  """Text <-> token ids, with the ids of the special tokens.

  Attributes:
    vocab_size: number of ids (including added / special tokens).
    bos_id: beginning-of-sequence id, or None when the vocabulary has none.
    eos_id: the id that ends a generation (`<|im_end|>` when present), or None.
    pad_id: padding id; the eos id when the vocabulary has no padding token
      (padding is masked by segment ids, so any valid id serves), else 0.
    special_ids: frozenset of ids `decode(..., skip_special=True)` drops.
    added_tokens: every token `encode` reads whole from text (special or
      not: chat markers, tool markers, `<|fim_prefix|>`, reserved tokens...),
      the ones text from outside the policy must never spell
      (`chat.defuse`).
  """

  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  pad_id: int
  special_ids: frozenset[int]
  added_tokens: tuple[str, ...]

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; special tokens written in the text become single ids."""

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """`encode` of each of `texts`, in one call of the library on all of the host's cores (the
    same ids as one `encode` per text)."""
    return [self.encode(t) for t in texts]

  def encode_text(self, text: str) -> list[int]:
    """Token ids of `text` read as plain text: an added token written in it is not its id.

    Each occurrence of an added token is cut after its first character and
    the pieces encoded apart, so `decode` gives `text` back but no added
    token's id appears (for text the policy wrote, scored by a reward model:
    its `<|im_end|>` must not end the turn there).

    Args:
      text: any text.

    Returns:
      The ids.
    """
    markers = [m for m in self.added_tokens if len(m) > 1]
    if not any(m in text for m in markers):
      return self.encode(text)
    # Every start of every marker, overlapping ones included (a lookahead consumes nothing).
    starts = re.finditer('(?=' + '|'.join(map(re.escape, markers)) + ')', text)
    cuts = sorted({m.start() + 1 for m in starts})
    ids, last = [], 0
    for cut in [*cuts, len(text)]:
      if cut > last:
        ids += self.encode(text[last:cut])
        last = cut
    return ids

  @abc.abstractmethod
  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    """The text of `ids`; with skip_special, ids in `special_ids` are left out."""

  @abc.abstractmethod
  def _lookup(self, token: str) -> int | None:
    """The id of `token`, or None when it is not in the vocabulary."""

  def token_to_id(self, token: str) -> int:
    """The id of a single token (e.g. '<|im_end|>').

    Raises:
      KeyError: `token` is not one token of the vocabulary.
    """
    i = self._lookup(token)
    if i is None:
      raise KeyError(f'token {token!r} is not in the vocabulary')
    return i

  def _first(self, names: Iterable[str]) -> int | None:
    for name in names:
      i = self._lookup(name)
      if i is not None:
        return i
    return None

  def _set_ids(self, bos, eos, pad):
    chat_eos = self._lookup(chat.IM_END)
    self.bos_id = bos
    self.eos_id = chat_eos if chat_eos is not None else eos
    self.pad_id = pad if pad is not None else self.eos_id if self.eos_id is not None else 0


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model. Control pieces (bos/eos/pad) decode to ''."""

  def __init__(self, path: str | os.PathLike):
    self.path = paths.path(path)
    proto = paths.read_bytes(self.path)
    self._sp = spm.SentencePieceProcessor(model_proto=proto)
    self.vocab_size = self._sp.get_piece_size()
    sp_id = lambda i: i if i >= 0 else None
    self._set_ids(sp_id(self._sp.bos_id()), sp_id(self._sp.eos_id()), sp_id(self._sp.pad_id()))
    # User-defined pieces are plain text that is never split; of those only
    # the chat tokens count as special.
    chat_ids = {self._lookup(t) for t in chat.SPECIAL_TOKENS} - {None}
    self.special_ids = frozenset(
        chat_ids | {i for i in range(self.vocab_size)
                    if self._sp.is_control(i) or self._sp.is_unknown(i)})
    # User-defined pieces are the ones encoding reads whole from text (control pieces such as
    # <s> never come out of text); the processor does not say which they are, the model does.
    model = sp_pb2.ModelProto()
    model.ParseFromString(proto)
    self.added_tokens = tuple(p.piece for p in model.pieces
                              if p.type == sp_pb2.ModelProto.SentencePiece.USER_DEFINED)

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    if type(self).encode is not SentencePieceTokenizer.encode:  # A subclass's own encode.
      return super().encode_batch(texts)
    return self._sp.encode(list(texts), out_type=int, num_threads=os.cpu_count() or 1)

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    ids = [int(i) for i in ids]
    if skip_special:
      ids = [i for i in ids if i not in self.special_ids]
    return self._sp.decode(ids)

  def _lookup(self, token: str) -> int | None:
    i = self._sp.piece_to_id(token)
    # piece_to_id answers unk_id for unknown pieces.
    return i if self._sp.id_to_piece(i) == token else None


def _config_token(config: dict, key: str) -> str | None:
  value = config.get(key)
  return value.get('content') if isinstance(value, dict) else value


class HFTokenizer(Tokenizer):
  """An HF `tokenizer.json` through the `tokenizers` library.

  bos / eos / pad come from a `tokenizer_config.json` next to the file when
  there is one, else from well-known token names.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = paths.path(path)
    self._tok = tokenizers.Tokenizer.from_str(paths.read_text(self.path))
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    added = self._tok.get_added_tokens_decoder()
    self.special_ids = frozenset(i for i, t in added.items() if t.special)
    self.added_tokens = tuple(t.content for _, t in sorted(added.items()))
    config_file = self.path.parent / 'tokenizer_config.json'
    config = paths.read_json(config_file, {})

    def pick(key, names):
      name = _config_token(config, key)
      if name is not None:
        i = self._lookup(name)
        if i is None:
          raise ValueError(f'{config_file}: {key}={name!r} is not in {self.path}')
        return i
      return self._first(names)

    # A config that names its bos as null (Qwen) means: no bos.
    bos = pick('bos_token', () if 'bos_token' in config else _BOS_NAMES)
    self._set_ids(bos, pick('eos_token', _EOS_NAMES), pick('pad_token', _PAD_NAMES))

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    if type(self).encode is not HFTokenizer.encode:  # A subclass's own encode.
      return super().encode_batch(texts)
    # The library's own thread pool (RAYON_NUM_THREADS, default all cores).
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def _lookup(self, token: str) -> int | None:
    return self._tok.token_to_id(token)


class TokenizerNotFound(paths.PathError, FileNotFoundError):
  """Nothing loadable at a tokenizer path: a user's error (`cascade.main` says it in one line, as
  for every `paths.PathError`), not the storage failing; still a FileNotFoundError."""


def encode_batch(tokenizer, texts: Sequence[str]) -> list[list[int]]:
  """`tokenizer.encode_batch(texts)`, or one `encode` per text for a tokenizer without it."""
  batch = getattr(tokenizer, 'encode_batch', None)
  return batch(texts) if batch is not None else [tokenizer.encode(t) for t in texts]


def load(path: str | os.PathLike) -> Tokenizer:
  """Loads a tokenizer, choosing the backend from the path.

  Args:
    path: a SentencePiece `.model` file, an HF `tokenizer.json`, or a
      directory (local or gs://) holding `tokenizer.json` (preferred), `tokenizer.model`, or a
      single `*.model` file.

  Returns:
    The Tokenizer.

  Raises:
    TokenizerNotFound (a FileNotFoundError): nothing loadable at `path`.
    ValueError: a file of an unknown kind.
  """
  p = paths.path(path)
  if paths.isdir(p):
    names = paths.listdir(p)
    models = [n for n in names if n.endswith('.model')]
    if 'tokenizer.json' in names:
      p = p / 'tokenizer.json'
    elif 'tokenizer.model' in names:
      p = p / 'tokenizer.model'
    elif len(models) == 1:
      p = p / models[0]
    else:
      raise TokenizerNotFound(f'{p}: no tokenizer.json, tokenizer.model or single *.model file '
                              f'(found {models})')
  if not paths.exists(p):
    raise TokenizerNotFound(f'tokenizer file {p} does not exist')
  if p.suffix == '.model':
    return SentencePieceTokenizer(p)
  if p.suffix == '.json':
    return HFTokenizer(p)
  raise ValueError(f'{p}: expected a SentencePiece .model file or an HF tokenizer.json')


def train_sentencepiece(texts: Iterable[str], model_prefix: str | os.PathLike, vocab_size: int,
                        *, model_type: str = 'bpe',
                        user_defined_symbols: Sequence[str] = chat.SPECIAL_TOKENS,
                        max_sentence_length: int = 1 << 16) -> SentencePieceTokenizer:
  """Trains a SentencePiece model on `texts` and writes `{model_prefix}.model` / `.vocab`.

  The model keeps `user_defined_symbols` (by default the chat special tokens)
  as single pieces, splits digits one per token, falls back to UTF-8 bytes
  for characters it has not seen, and normalises nothing: newlines,
  indentation and repeated spaces round-trip exactly and no space is
  prepended. Ids 0..3 are unk, bos (`<s>`), eos (`</s>`) and pad (`<pad>`).

  Args:
    texts: the training corpus, one document per item (newlines allowed).
    model_prefix: output path prefix (local: SentencePiece writes local files).
    vocab_size: number of pieces, including 4 control pieces, the
      user-defined symbols and 256 byte pieces (so > 260 + symbols).
    model_type: 'bpe' or 'unigram'.
    user_defined_symbols: strings that are always single tokens; e.g.
      `chat.SPECIAL_TOKENS + chat.TOOL_TOKENS` also keeps the tool markers
      whole (they are not special ids: decoding keeps them).
    max_sentence_length: longest document in bytes; longer ones are skipped.

  Returns:
    The trained tokenizer.

  Raises:
    ValueError: a bad model_type or a vocab_size too small for the byte pieces
      and symbols.
  """
  if model_type not in ('bpe', 'unigram'):
    raise ValueError(f"model_type={model_type!r}: expected 'bpe' or 'unigram'")
  minimum = 4 + 256 + len(user_defined_symbols)
  if vocab_size <= minimum:
    raise ValueError(f'vocab_size={vocab_size} leaves no room for learned pieces: 4 control, '
                     f'256 byte and {len(user_defined_symbols)} user-defined pieces need '
                     f'{minimum}')
  prefix = pathlib.Path(model_prefix)
  prefix.parent.mkdir(parents=True, exist_ok=True)
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts),
      model_prefix=str(prefix),
      vocab_size=vocab_size,
      model_type=model_type,
      user_defined_symbols=list(user_defined_symbols),
      byte_fallback=True,
      split_digits=True,
      normalization_rule_name='identity',
      remove_extra_whitespaces=False,
      add_dummy_prefix=False,  # No spurious leading space on a separately encoded response.
      allow_whitespace_only_pieces=True,  # Indentation runs can be pieces.
      character_coverage=1.0,
      max_sentence_length=max_sentence_length,
      unk_id=0, bos_id=1, eos_id=2, pad_id=3,
      hard_vocab_limit=False,  # A small corpus may not fill the vocabulary.
      minloglevel=2)
  return SentencePieceTokenizer(f'{prefix}.model')
