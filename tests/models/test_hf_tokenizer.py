"""HF exports a user can serve: `AutoTokenizer` and `apply_chat_template` give our prompts' tokens.

For the tiny world's SentencePiece tokenizer and an HF tokenizer.json,
`hf.save_model(..., tokenizer=tok)` writes files that transformers loads and that encode
a set of conversations (system, multi-turn, both thinking modes and none, tools, tool
calls and results) to exactly the ids of `tok.encode(chat.render(...))`; the weights
still load back with `hf.load_model`, the tokenizer with `tokenizer.load`; a sharded
model's export equals the unsharded one's, and so does the export of a model sharded over
two JAX processes, which only process 0 writes (tests/models/hf_export_worker.py).
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import safetensors
import tokenizers

from foundation import chat
from foundation import tokenizer as tokenizer_lib
from models import config as config_lib
from models import hf
from models import sharding
from models import transformer
from tiny_world import world

transformers = pytest.importorskip('transformers')

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER = os.path.join(_REPO, 'tests', 'models', 'hf_export_worker.py')

_TOOLS = [{'type': 'function', 'function': {
    'name': 'search', 'description': 'Looks it up (never spells <|im_end|> or </tool_call>) é',
    'parameters': {'type': 'object', 'properties': {'query': {'type': 'string'}}}}}]
CONVERSATIONS = [
    [{'role': 'user', 'content': 'Tom has 3 apples and buys 4 more. How many now?'}],
    [{'role': 'system', 'content': 'Answer briefly.'},
     {'role': 'user', 'content': 'Write about the lake.'},
     {'role': 'assistant', 'content': '<think>\nshort\n</think>\n\n  The lake is calm.  <|im_end|>'},
     {'role': 'user', 'content': 'Now the  hill,\n\tindented   and 東京 🙂 <s> </s> <pad>'}],
    [{'role': 'user', 'content': 'first'}, {'role': 'assistant', 'content': 'no thinking here'},
     {'role': 'user', 'content': 'second'},
     {'role': 'assistant', 'content': '<think>\nnever closed'}, {'role': 'user', 'content': '3rd'}],
    [{'role': 'system', 'content': ''}, {'role': 'user', 'content': 'Find the tides.'},
     {'role': 'assistant', 'content': '<think>\nsearch\n</think>\n\nLet me look.',
      'tool_calls': [{'name': 'search', 'arguments': {'query': 'tides <|im_start|>'}}]},
     {'role': 'tool', 'content': 'high at 6'}, {'role': 'tool', 'content': 'low at 12'},
     {'role': 'assistant', 'content': '', 'tool_calls': [{'name': 'search', 'arguments': {}}]},
     {'role': 'tool', 'content': 'none'}],
    [{'role': 'user', 'content': 'sampled turn'},
     {'role': 'assistant', 'content': 'ok\n<tool_call>\n{"name": "search", "arguments": {}}\n'
                                      '</tool_call><|im_end|>', 'tool_calls': [
                                          {'name': 'search', 'arguments': {}}]},
     {'role': 'tool', 'content': 'r'}],
]
TEXTS = ['', 'a  b   c\n\n  d', ' lead', '東京 🙂 ʃʒ', '<s> x </s> <pad> <unk> <0x41>',
         '12345 x1y2', '\t\ttab', 'ababababa aaaaaaa', '<|im_start|>user\nhi<|im_end|>']


def _corpus():
  out = []
  for conv in CONVERSATIONS:
    for mode in (True, False, None):
      out.append(chat.render(conv, thinking=mode, tools=_TOOLS))
  return out * 20 + [f'{a} + {a + 1} = {2 * a + 1}. The model adds numbers.\n' for a in range(300)]


@pytest.fixture(scope='module')
def toks(tmp_path_factory):
  """name -> Tokenizer: the tiny world's SentencePiece BPE, one with tool markers, an HF BPE."""
  d = tmp_path_factory.mktemp('toks')
  paths = world.write(str(d / 'world'), 0, sft=40, rl=40, heldout=10, preference=40,
                      preference_heldout=10)
  out = {'tiny_world': tokenizer_lib.load(paths['tokenizer']),
         'sp_tools': tokenizer_lib.train_sentencepiece(
             _corpus(), d / 'tools', 600,
             user_defined_symbols=chat.SPECIAL_TOKENS + chat.TOOL_TOKENS)}
  hf_tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  hf_tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf_tok.decoder = tokenizers.decoders.ByteLevel()
  hf_tok.train_from_iterator(_corpus(), tokenizers.trainers.BpeTrainer(
      vocab_size=600, special_tokens=list(chat.SPECIAL_TOKENS),
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  (d / 'hf').mkdir()
  hf_tok.save(str(d / 'hf' / 'tokenizer.json'))
  (d / 'hf' / 'tokenizer_config.json').write_text(json.dumps({'bos_token': None}))
  out['hf_bpe'] = tokenizer_lib.load(d / 'hf')
  return out


@pytest.fixture(scope='module')
def model():
  return transformer.create(config_lib.ModelConfig.tiny(vocab_size=1024, num_layers=1))


@pytest.fixture(scope='module')
def exports(toks, model, tmp_path_factory):
  """name -> (Tokenizer, export directory)."""
  out = {}
  for name, tok in toks.items():
    d = tmp_path_factory.mktemp(name)
    hf.save_model(model, d, tokenizer=tok)
    out[name] = (tok, d)
  return out


def _ids(encoded):
  return list(encoded['input_ids'] if hasattr(encoded, 'keys') else encoded)


@pytest.mark.parametrize('name', ['tiny_world', 'sp_tools', 'hf_bpe'])
def test_auto_tokenizer_reproduces_our_prompts(exports, name):
  tok, d = exports[name]
  auto = transformers.AutoTokenizer.from_pretrained(d)
  assert auto.eos_token_id == tok.eos_id and auto.eos_token == chat.IM_END
  for conv in CONVERSATIONS:
    for mode in (True, False, None):
      for tools in (None, _TOOLS):
        for prompt in (True, False):
          want = chat.render(conv, thinking=mode, tools=tools, add_generation_prompt=prompt)
          kw = {} if mode is None else {'thinking': mode}
          args = dict(tools=tools, add_generation_prompt=prompt, **kw)
          assert auto.apply_chat_template(conv, tokenize=False, **args) == want
          assert _ids(auto.apply_chat_template(conv, tokenize=True, **args)) == tok.encode(want)
  for text in TEXTS:
    ids = tok.encode(text)
    assert auto.encode(text) == ids, text     # no BOS added, no special token invented
    assert auto.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_thinking_aliases_and_openai_tool_calls(exports):
  _, d = exports['tiny_world']
  auto = transformers.AutoTokenizer.from_pretrained(d)
  conv = CONVERSATIONS[3]
  for mode in (True, False):   # Qwen3's name for the switch, as servers pass it
    assert (auto.apply_chat_template(conv, tokenize=False, add_generation_prompt=True,
                                     enable_thinking=mode)
            == chat.render(conv, thinking=mode))
  openai = [dict(m, tool_calls=[{'type': 'function', 'function': c} for c in m['tool_calls']])
            if m.get('tool_calls') else m for m in conv]
  assert (auto.apply_chat_template(openai, tokenize=False, add_generation_prompt=True)
          == chat.render(conv))
  as_text = [dict(m, tool_calls=[{'function': dict(c, arguments=json.dumps(c['arguments']))}
                                 for c in m['tool_calls']]) if m.get('tool_calls') else m
             for m in conv if 'tides' not in json.dumps(m)]   # arguments JSON text, no markers
  assert (auto.apply_chat_template(as_text, tokenize=False)
          == chat.render([m for m in conv if 'tides' not in json.dumps(m)],
                         add_generation_prompt=False))


@pytest.mark.parametrize('name', ['tiny_world', 'hf_bpe'])
def test_export_round_trips(exports, model, name):
  tok, d = exports[name]
  files = sorted(p.name for p in d.iterdir())
  assert files == ['config.json', 'generation_config.json', 'model.safetensors',
                   'special_tokens_map.json', 'tokenizer.json', 'tokenizer_config.json']
  gen = json.loads((d / 'generation_config.json').read_text())
  assert gen['eos_token_id'] == [tok.eos_id, tok.token_to_id(chat.ENDOFTEXT)]
  assert transformers.GenerationConfig.from_pretrained(d).eos_token_id == gen['eos_token_id']
  back = tokenizer_lib.load(d)
  assert (back.eos_id, back.pad_id, back.bos_id) == (tok.eos_id, tok.pad_id, tok.bos_id)
  for text in TEXTS + _corpus()[:15]:
    assert back.encode(text) == tok.encode(text)
  loaded = hf.load_model(d)
  np.testing.assert_array_equal(np.asarray(loaded.embed.get_value()),
                                np.asarray(model.embed.get_value()))


def test_unconverted_sentencepiece_is_refused_before_writing(model, tmp_path):
  tok = tokenizer_lib.train_sentencepiece(_corpus(), tmp_path / 'uni', 600, model_type='unigram')
  with pytest.raises(ValueError, match=r"model_type='UNIGRAM' has no HF tokenizer\.json"):
    hf.save_model(model, tmp_path / 'out', tokenizer=tok)
  assert not (tmp_path / 'out').exists()


def test_sharded_export_equals_unsharded(exports, tmp_path):
  _, one = exports['tiny_world']
  mesh = hf.load_model(one, mesh=sharding.make_mesh((2, 2, 2)))
  assert len(mesh.embed.get_value().sharding.device_set) == 8
  hf.save_model(mesh, tmp_path, tokenizer=exports['tiny_world'][0], max_shard_size=200_000)
  for p in one.iterdir():
    if p.suffix != '.safetensors':
      assert (tmp_path / p.name).read_bytes() == p.read_bytes(), p.name
  index = json.loads((tmp_path / hf.INDEX_FILE).read_text())['weight_map']
  with safetensors.safe_open(str(one / hf.SINGLE_FILE), 'numpy') as whole:
    assert sorted(whole.keys()) == sorted(index)
    for k in whole.keys():
      with safetensors.safe_open(str(tmp_path / index[k]), 'numpy') as shard:
        np.testing.assert_array_equal(whole.get_tensor(k), shard.get_tensor(k), err_msg=k)


@pytest.mark.heavy
@pytest.mark.multiprocess
def test_two_processes_export_from_process_0(exports, tmp_path):
  """A model sharded over two JAX processes: both gather tensor by tensor, only process 0
  writes, and what it writes equals the one-process export. Heavy: two JAX processes
  starting on a shared 2-core machine took 50 s."""
  _, source = exports['tiny_world']
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    coordinator = f'127.0.0.1:{s.getsockname()[1]}'
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=_REPO)
  env.pop('XLA_FLAGS', None)
  procs = [subprocess.Popen([sys.executable, _WORKER, coordinator, str(i), str(source),
                             str(tmp_path)], cwd=_REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    logs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], '\n'.join(log[-3000:] for log in logs)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['p0']     # process 1 wrote nothing
  out = tmp_path / 'p0'
  for p in source.iterdir():
    if p.suffix != '.safetensors':
      assert (out / p.name).read_bytes() == p.read_bytes(), p.name
  index = json.loads((out / hf.INDEX_FILE).read_text())['weight_map']
  assert len(set(index.values())) > 2
  with safetensors.safe_open(str(source / hf.SINGLE_FILE), 'numpy') as whole:
    assert sorted(whole.keys()) == sorted(index)
    for k in whole.keys():
      with safetensors.safe_open(str(out / index[k]), 'numpy') as shard:
        np.testing.assert_array_equal(whole.get_tensor(k), shard.get_tensor(k), err_msg=k)
