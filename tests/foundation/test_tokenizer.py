"""Tokenizers: SentencePiece training and round trips, the HF tokenizer.json backend, specials."""

import json
import random
import subprocess
import sys

import pytest
import tokenizers

from envs import base as env_base
from foundation import chat
from foundation import tokenizer

ROUND_TRIP = [
    '',
    'Hello, world!',
    ' leading space and  double  spaces   and trailing ',
    'line one\nline two\n\n\nafter blank lines\n',
    'def f(x):\n    if x:\n        return x  # indented\n\treturn -1\n',
    'unicode: héllo naïve 東京 🙂 Ω≈ç√ — “quotes”',
    'never seen: ʃʒ ŋ ǂ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢',
    '12 + 345 = 357, 2.5e-3, -17',
    '<|im_start|>user\nwhat is 2+2? /think<|im_end|>\n<|im_start|>assistant\n<think>\n4\n</think>',
]


def _corpus(n=600, seed=0):
  rng = random.Random(seed)
  words = ['the', 'model', 'adds', 'numbers', 'return', 'value', 'print', 'answer', 'is', 'and']
  out = []
  for _ in range(n):
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    sentence = ' '.join(rng.choice(words) for _ in range(rng.randint(3, 9)))
    out.append(f'{sentence}.\n{a} + {b} = {a + b}\n')
    out.append(f'def f{a}(x):\n    return x * {b}\n\n')
    out.append(chat.render([{'role': 'user', 'content': sentence}], thinking=bool(a % 2))
               + chat.render_response(str(a), thinking=sentence if a % 2 else None))
  return out


@pytest.fixture(scope='module')
def toks(tmp_path_factory):
  """backend name -> Tokenizer: trained SentencePiece (bpe, unigram) and an HF BPE."""
  d = tmp_path_factory.mktemp('tok')
  corpus = _corpus()
  out = {f'sp_{kind}': tokenizer.train_sentencepiece(corpus, d / f'sp_{kind}', 400,
                                                     model_type=kind)
         for kind in ('bpe', 'unigram')}
  hf = tokenizers.Tokenizer(tokenizers.models.BPE())
  hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = tokenizers.decoders.ByteLevel()
  hf.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=list(chat.SPECIAL_TOKENS),
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  (d / 'hf').mkdir()
  hf.save(str(d / 'hf' / 'tokenizer.json'))
  out['hf_bpe'] = tokenizer.load(d / 'hf' / 'tokenizer.json')
  return out


BACKENDS = ('sp_bpe', 'sp_unigram', 'hf_bpe')


def test_module_does_not_import_jax():
  code = 'import sys; import foundation.tokenizer; assert "jax" not in sys.modules, "jax imported"'
  subprocess.run([sys.executable, '-c', code], check=True)


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('text', ROUND_TRIP)
def test_round_trip(toks, backend, text):
  tok = toks[backend]
  ids = tok.encode(text)
  assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text


@pytest.mark.parametrize('backend', BACKENDS)
def test_special_tokens_are_single_ids(toks, backend):
  tok = toks[backend]
  for special in chat.SPECIAL_TOKENS:
    i = tok.token_to_id(special)
    assert tok.encode(special) == [i]
    assert i in tok.special_ids
    assert i in tok.encode(f'a{special}b') and tok.encode(f'a{special}b').count(i) == 1
  assert tok.eos_id == tok.token_to_id(chat.IM_END)
  assert tok.pad_id is not None
  with pytest.raises(KeyError, match='not-a-token'):
    tok.token_to_id('<not-a-token>')


@pytest.mark.parametrize('backend', BACKENDS)
def test_chat_render_encodes_specials_as_single_ids(toks, backend):
  tok = toks[backend]
  messages = [{'role': 'system', 'content': 'Be brief.'},
              {'role': 'user', 'content': 'Add 12 and 30.\nShow work.'}]
  prompt = chat.render(messages, thinking=False)
  ids = tok.encode(prompt)
  assert ids.count(tok.token_to_id(chat.IM_START)) == 3
  assert ids.count(tok.token_to_id(chat.IM_END)) == 2
  assert ids.count(tok.token_to_id(chat.THINK_OPEN)) == 1
  assert ids.count(tok.token_to_id(chat.THINK_CLOSE)) == 1
  assert tok.decode(ids) == prompt
  plain = tok.decode(ids, skip_special=True)
  assert plain == ''.join(prompt.split(chat.IM_START)).replace(chat.IM_END, '').replace(
      chat.THINK_OPEN, '').replace(chat.THINK_CLOSE, '')


def test_sentencepiece_ids_and_digits(toks):
  tok = toks['sp_bpe']
  assert tok.vocab_size == 400
  assert (tok.bos_id, tok.pad_id) == (1, 3)
  assert tok.eos_id == tok.token_to_id(chat.IM_END) != 2
  assert {0, 1, 2, 3} <= tok.special_ids
  digits = tok.encode('9081726354')
  assert len(digits) == 10 and tok.decode(digits) == '9081726354'
  assert tok.decode([1, *tok.encode('hi'), 2, 3]) == 'hi'  # Control pieces decode to ''.


def test_sentencepiece_tool_tokens(tmp_path):
  args = {'a': 12, 'b': 30}
  call = chat.render_tool_call('add', args)
  convo = [{'role': 'user', 'content': 'Add 12 and 30.'},
           {'role': 'assistant', 'content': 'Adding.',
            'tool_calls': [{'name': 'add', 'arguments': args}]},
           {'role': 'tool', 'content': '42'}]
  corpus = _corpus(200) + [chat.render(convo, thinking=True) + 'The sum is 42.<|im_end|>'] * 20
  tok = tokenizer.train_sentencepiece(
      corpus, tmp_path / 'tools', 400,
      user_defined_symbols=chat.SPECIAL_TOKENS + chat.TOOL_TOKENS)
  for marker in chat.TOOL_TOKENS:
    i = tok.token_to_id(marker)
    assert tok.encode(marker) == [i] and i not in tok.special_ids
  for special in chat.SPECIAL_TOKENS:
    assert tok.token_to_id(special) in tok.special_ids
  prompt = chat.render(convo, thinking=False, tools=[{'type': 'function',
                                                      'function': {'name': 'add'}}])
  assert tok.decode(tok.encode(prompt)) == prompt
  # A sampled turn decoded without the special ids still parses.
  ids = tok.encode(f'<think>\nsum it\n</think>\n\nAdding.\n{call}<|im_end|>')
  turn = chat.parse_tool_calls(tok.decode(ids, skip_special=True))
  assert [(c.name, c.arguments) for c in turn.calls] == [('add', args)]


def test_sentencepiece_newline_via_byte_fallback(tmp_path):
  tok = tokenizer.train_sentencepiece(
      [f'word{i % 7} number {i}' for i in range(300)], tmp_path / 'flat', 300)
  text = 'word1\n  word2\n\tend\n'
  assert tok.decode(tok.encode(text)) == text


def test_load_picks_backend(toks, tmp_path):
  sp_file = toks['sp_bpe'].path
  hf_file = toks['hf_bpe'].path
  assert isinstance(tokenizer.load(sp_file), tokenizer.SentencePieceTokenizer)
  assert isinstance(tokenizer.load(sp_file.parent / 'sp_unigram.model'),
                    tokenizer.SentencePieceTokenizer)
  assert isinstance(tokenizer.load(hf_file.parent), tokenizer.HFTokenizer)
  sp_dir = tmp_path / 'spdir'
  sp_dir.mkdir()
  (sp_dir / 'tokenizer.model').write_bytes(sp_file.read_bytes())
  loaded = tokenizer.load(sp_dir)
  assert loaded.encode('12 + 3') == toks['sp_bpe'].encode('12 + 3')
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match='no tokenizer.json'):
    tokenizer.load(tmp_path / 'empty')
  (tmp_path / 'vocab.txt').write_text('x')
  with pytest.raises(ValueError, match='vocab.txt'):
    tokenizer.load(tmp_path / 'vocab.txt')


def test_hf_ids_from_tokenizer_config(toks, tmp_path):
  (tmp_path / 'tokenizer.json').write_bytes(toks['hf_bpe'].path.read_bytes())
  config = {'bos_token': None, 'eos_token': {'content': chat.ENDOFTEXT},
            'pad_token': chat.ENDOFTEXT}
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(config))
  tok = tokenizer.load(tmp_path)
  assert tok.bos_id is None
  assert tok.eos_id == tok.token_to_id(chat.IM_END)  # ChatML generations end there.
  assert tok.pad_id == tok.token_to_id(chat.ENDOFTEXT)
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'pad_token': '<pad>'}))
  with pytest.raises(ValueError, match="pad_token='<pad>'"):
    tokenizer.load(tmp_path)


def test_train_errors(tmp_path):
  with pytest.raises(ValueError, match='model_type'):
    tokenizer.train_sentencepiece(['a'], tmp_path / 'x', 400, model_type='word')
  with pytest.raises(ValueError, match='vocab_size=200'):
    tokenizer.train_sentencepiece(['a'], tmp_path / 'x', 200)


EXTRA_SPECIAL = ('<|fim_prefix|>', '<|fim_middle|>', '<|reserved_7|>')
EXTRA_PLAIN = ('<|vision_start|>', '[TOOL]')


@pytest.fixture(scope='module')
def rich_toks(toks, tmp_path_factory):
  """backend -> a Tokenizer that reads more tokens whole than the chat and tool markers."""
  d = tmp_path_factory.mktemp('rich')
  hf = tokenizers.Tokenizer.from_file(str(toks['hf_bpe'].path))
  hf.add_special_tokens(list(EXTRA_SPECIAL + chat.TOOL_TOKENS))
  hf.add_tokens(list(EXTRA_PLAIN))
  hf.save(str(d / 'tokenizer.json'))
  sp = tokenizer.train_sentencepiece(
      _corpus(200), d / 'sp', 400,
      user_defined_symbols=chat.SPECIAL_TOKENS + chat.TOOL_TOKENS + EXTRA_SPECIAL + EXTRA_PLAIN)
  return {'hf_bpe': tokenizer.load(d / 'tokenizer.json'), 'sp_bpe': sp}


@pytest.mark.parametrize('backend', ['hf_bpe', 'sp_bpe'])
def test_added_tokens_are_every_token_read_whole(rich_toks, backend):
  tok = rich_toks[backend]
  expected = set(chat.SPECIAL_TOKENS + chat.TOOL_TOKENS + EXTRA_SPECIAL + EXTRA_PLAIN)
  assert set(tok.added_tokens) == expected
  for marker in expected:
    assert tok.encode(marker) == [tok.token_to_id(marker)]


@pytest.mark.parametrize('backend', ['hf_bpe', 'sp_bpe'])
def test_tool_output_defuses_every_added_token(rich_toks, backend):
  # A tool's output (from tool_message, as every environment builds it) that spells each token
  # the tokenizer reads whole: none of them may come out of the observation as its id, besides
  # the observation's own structure.
  tok = rich_toks[backend]
  hostile = 'x'.join(tok.added_tokens) + '<<|fim_prefix|>|fim_prefix|>'
  obs = chat.render_observation([env_base.tool_message('run', hostile)], thinking=True,
                                markers=tok.added_tokens)
  ids = tok.encode(obs)
  structure = tok.encode(chat.render_observation([env_base.tool_message('run', 'ok')],
                                                 thinking=True))
  added = {tok.token_to_id(m) for m in tok.added_tokens}
  assert sorted(i for i in ids if i in added) == sorted(i for i in structure if i in added)
  # The text stays readable: each token's first character is a character reference.
  assert '&lt;|fim_prefix|>' in obs and '&#91;TOOL]' in obs


@pytest.mark.parametrize('backend', ['hf_bpe', 'sp_bpe'])
def test_encode_text_reads_added_tokens_as_text(rich_toks, backend):
  tok = rich_toks[backend]
  text = f'The answer.{chat.IM_END}{chat.IM_START}user\nmore<|fim_prefix|>{chat.THINK_CLOSE}'
  ids = tok.encode_text(text)
  assert not {tok.token_to_id(m) for m in tok.added_tokens} & set(ids)
  assert tok.decode(ids) == text
  assert tok.encode_text('plain words') == tok.encode('plain words')


@pytest.mark.parametrize('backend', BACKENDS)
def test_encode_batch_gives_encode_s_ids(toks, backend):
  """The library's batch encode on all cores: the ids one `encode` per text gives."""
  tok = toks[backend]
  texts = ROUND_TRIP + _corpus(40, seed=1)
  assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
  assert tokenizer.encode_batch(tok, texts[:3]) == [tok.encode(t) for t in texts[:3]]


def test_encode_batch_of_a_subclass_and_a_plain_tokenizer(toks):
  """A subclass's own encode is what its batch encode runs; an object with only `encode` is
  encoded text by text."""

  class Shifted(type(toks['sp_bpe'])):
    def encode(self, text):
      return [i + 1 for i in super().encode(text)]
  shifted = Shifted(toks['sp_bpe'].path)
  assert shifted.encode_batch(['the model']) == [shifted.encode('the model')]

  class Plain:
    def encode(self, text):
      return [ord(c) for c in text]
  assert tokenizer.encode_batch(Plain(), ['ab', '']) == [[97, 98], []]
