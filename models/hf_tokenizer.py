"""The tokenizer files of an HF export, so `transformers.AutoTokenizer` encodes our prompts as we do.

Host-only (no jax import).

  hf.save_model(model, '/out', tokenizer=tokenizer.load(path))   # writes `files(tok)`
  tok = transformers.AutoTokenizer.from_pretrained('/out')
  tok.apply_chat_template(messages, add_generation_prompt=True, thinking=False)  # chat.render's

`files` gives (and models.hf.save_model writes):
  tokenizer.json           an HF tokenizer's own file, unchanged; a SentencePiece model
                           rebuilt as the same tokenizer in HF's format (below).
  tokenizer_config.json    the class (PreTrainedTokenizerFast), the eos / pad / bos tokens that
                           are read whole from text, and `chat_template`: foundation.chat.TEMPLATE,
                           `chat.render` in Jinja.
  special_tokens_map.json  the same special tokens.
  generation_config.json   the ids that end a generation (eos_id, and `<|endoftext|>` when the
                           vocabulary has it), for servers' stop conditions.

A SentencePiece BPE model becomes an HF `BPE` model over the same pieces and
ids. SentencePiece merges the adjacent pair whose union is the best-scoring
piece, leftmost first; HF merges the adjacent pair of lowest merge rank, leftmost
first; so every split of a piece into two pieces is a merge, ranked by the
piece's score. Spaces are written as '▁' (no dummy prefix), characters outside
the vocabulary fall back to `<0xXX>` byte pieces, and the user-defined pieces
(chat and tool markers) are read whole before the model runs, the chat tokens
(`chat.SPECIAL_TOKENS`) as special ones. Control pieces (`<s>`, `</s>`, `<pad>`)
and byte pieces are in no merge and are not read whole: SentencePiece never
reads them from text. Only BPE models with the normalisation
`tokenizer.train_sentencepiece` trains with (identity, no dummy prefix,
whitespace kept, byte fallback) are converted; another is refused, naming the
setting (a unigram model too: HF's lattice would read a byte or control piece
from text, which SentencePiece never does).
"""

from __future__ import annotations

import json

import tokenizers
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import decoders
from tokenizers import models as tok_models
from tokenizers import normalizers

from foundation import chat
from foundation import paths
from foundation import tokenizer as tokenizer_lib

# Every file `files` gives (an export replacing an earlier one removes them first).
FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
         'generation_config.json')
_SPACE = '\u2581'
_Piece = sp_pb2.ModelProto.SentencePiece


def _from_sentencepiece(proto: bytes, where: str) -> tokenizers.Tokenizer:
  """The HF tokenizer that encodes as the SentencePiece model `proto` does."""
  model = sp_pb2.ModelProto()
  model.ParseFromString(proto)
  norm, kind = model.normalizer_spec, model.trainer_spec.model_type
  unsupported = [
      f'{name}={value!r}' for name, value, ok in (
          ('normalization_rule_name', norm.name, norm.name == 'identity'
           and not norm.precompiled_charsmap),
          ('add_dummy_prefix', norm.add_dummy_prefix, not norm.add_dummy_prefix),
          ('remove_extra_whitespaces', norm.remove_extra_whitespaces,
           not norm.remove_extra_whitespaces),
          ('byte_fallback', model.trainer_spec.byte_fallback, model.trainer_spec.byte_fallback),
          ('model_type', sp_pb2.TrainerSpec.ModelType.Name(kind), kind == sp_pb2.TrainerSpec.BPE))
      if not ok]
  if unsupported:
    raise ValueError(f'{where}: a SentencePiece model with {", ".join(unsupported)} has no HF '
                     'tokenizer.json here (models/hf_tokenizer.py converts the settings '
                     'tokenizer.train_sentencepiece uses)')
  pieces = list(model.pieces)
  unk = next(i for i, p in enumerate(pieces) if p.type == _Piece.UNKNOWN)
  vocab = {p.piece: i for i, p in enumerate(pieces)}
  normal = {p.piece for p in pieces if p.type == _Piece.NORMAL}
  merges = []
  for _, i in sorted((-p.score, i) for i, p in enumerate(pieces) if p.type == _Piece.NORMAL):
    s = pieces[i].piece
    merges += [(s[:k], s[k:]) for k in range(1, len(s)) if s[:k] in normal and s[k:] in normal]
  tok = tokenizers.Tokenizer(tok_models.BPE(vocab=vocab, merges=merges,
                                            unk_token=pieces[unk].piece, byte_fallback=True,
                                            fuse_unk=True))
  tok.normalizer = normalizers.Replace(' ', _SPACE)
  tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, ' '), decoders.ByteFallback(),
                                   decoders.Fuse()])
  user = [p.piece for p in pieces if p.type == _Piece.USER_DEFINED]
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in user if t in chat.SPECIAL_TOKENS])
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                  for t in user if t not in chat.SPECIAL_TOKENS])
  return tok


def tokenizer_json(tok: tokenizer_lib.Tokenizer) -> str:
  """The HF `tokenizer.json` text of `tok`.

  Raises:
    ValueError: a SentencePiece model whose settings are not converted (named).
  """
  if isinstance(tok, tokenizer_lib.HFTokenizer):
    return paths.read_text(tok.path)
  if isinstance(tok, tokenizer_lib.SentencePieceTokenizer):
    return _from_sentencepiece(paths.read_bytes(tok.path), str(tok.path)).to_str()
  raise TypeError(f'no HF tokenizer.json for a {type(tok).__name__}')


def files(tok: tokenizer_lib.Tokenizer) -> dict[str, str]:
  """The HF tokenizer files of `tok`: file name (FILES) -> text.

  Args:
    tok: the run's tokenizer.

  Raises:
    ValueError: a SentencePiece model whose settings are not converted (named).
  """
  text = tokenizer_json(tok)
  hf_tok = tokenizers.Tokenizer.from_str(text)
  stops = [tok.eos_id] + [i for i in [hf_tok.token_to_id(chat.ENDOFTEXT)]
                          if i is not None and i != tok.eos_id]
  # transformers reads every special token it is told of whole from text: name only those
  # the tokenizer already reads whole (a SentencePiece model's <s> and <pad> are not).
  whole = {t.content for t in hf_tok.get_added_tokens_decoder().values()}
  specials = {key: hf_tok.id_to_token(i) for key, i in (
      ('bos_token', tok.bos_id), ('eos_token', tok.eos_id), ('pad_token', tok.pad_id))
              if i is not None and hf_tok.id_to_token(i) in whole}
  config = {'tokenizer_class': 'PreTrainedTokenizerFast', **specials,
            'clean_up_tokenization_spaces': False, 'chat_template': chat.TEMPLATE}
  dump = lambda obj: json.dumps(obj, indent=2, ensure_ascii=False)
  return {'tokenizer.json': text, 'tokenizer_config.json': dump(config),
          'special_tokens_map.json': dump(specials),
          'generation_config.json': dump({'bos_token_id': tok.bos_id, 'eos_token_id': stops,
                                          'pad_token_id': tok.pad_id})}
