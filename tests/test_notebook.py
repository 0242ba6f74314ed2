"""notebooks/quickstart.ipynb runs top to bottom (nbclient, the venv's python3 kernel), tiny.

The notebook reads CASCADE_NOTEBOOK_CONFIG / _STEPS / _WORKDIR. The default
test runs a two-stage cascade (SFT -> GRPO) on a toy 'copy' domain written by
the test, two steps per stage; the slow one runs configs/tiny.py:smoke (the
notebook's default config: the tiny world's seven stages). Both must show the
matrix, the plot and a sample.
"""

import json
import os
import random

import nbformat
import pytest
from nbclient import NotebookClient

from models import chat
from models import tokenizer as tokenizer_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, 'notebooks', 'quickstart.ipynb')

CONFIG = '''
"""A toy cascade for the notebook test: SFT then GRPO on copying a digit."""
import ml_collections

def get_config(arg=None):
  root = {root!r}
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny', overrides=dict(vocab_size=320, embed_dim=32, num_layers=1,
                 num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64, max_seq_len=128))
  c.tokenizer = dict(path=root + '/tok.model')
  c.mesh = dict(shape=None)
  c.sampler = dict(prompt_buckets=(64,), new_token_buckets=(8,))
  c.ckpt = dict(every_n_steps=1, keep=1)
  c.eval = dict(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=6,
                max_prompt_len=64, num_prompts=8, batch_size=8, thinking=False)
  c.datasets = dict(sft=dict(path=root + '/sft.jsonl', format='sft'),
                    copy_train=dict(path=root + '/copy_train.jsonl', format='prompt', domain='copy'),
                    copy_eval=dict(path=root + '/copy_eval.jsonl', format='prompt', domain='copy'))
  c.domains = dict(copy=dict(verifier='math', verifier_options=dict(workers=1),
                             train='copy_train', eval='copy_eval'))
  c.stages = [
      dict(name='sft', kind='sft', domains=['copy'], datasets=['sft'], steps=20, batch_size=8,
           max_len=64, optimizer=dict(lr=1e-2)),
      dict(name='copy_rl', kind='grpo', domains=['copy'], steps=20, optimizer=dict(lr=1e-3),
           prompts_per_step=2, group_size=4, max_prompt_len=64, max_response_len=6,
           thinking_fraction=0.0, dynamic_filter=False)]
  c.allow_config_change = False
  return c
'''


@pytest.fixture()
def toy_config(tmp_path):
  rng = random.Random(0)
  msgs = lambda a: [{'role': 'user', 'content': f'Copy {a}.'}]
  for split, n in (('train', 16), ('eval', 4)):
    with open(tmp_path / f'copy_{split}.jsonl', 'w') as f:
      for i in range(n):
        a = rng.randint(0, 9)
        f.write(json.dumps({'id': f'{split}-{i}', 'messages': msgs(a),
                            'metadata': {'answer': str(a)}}) + '\n')
  texts = []
  with open(tmp_path / 'sft.jsonl', 'w') as f:
    for _ in range(32):
      a = rng.randint(0, 9)
      rec = {'domain': 'copy', 'messages': msgs(a), 'response': f'\\boxed{{{a}}}'}
      f.write(json.dumps(rec) + '\n')
      for mode in (False, None):
        texts.append(chat.render(rec['messages'], thinking=mode)
                     + chat.render_response(rec['response'], None))
  tokenizer_lib.train_sentencepiece(texts, str(tmp_path / 'tok'), vocab_size=300)
  path = tmp_path / 'toy_config.py'
  path.write_text(CONFIG.format(root=str(tmp_path)))
  return path


def _execute(monkeypatch, config: str, workdir) -> str:
  """Runs the notebook with `config` and 2 steps per stage; returns its printed text."""
  monkeypatch.setenv('CASCADE_NOTEBOOK_CONFIG', config)
  monkeypatch.setenv('CASCADE_NOTEBOOK_STEPS', '2')
  monkeypatch.setenv('CASCADE_NOTEBOOK_WORKDIR', str(workdir))
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  monkeypatch.delenv('XLA_FLAGS', raising=False)     # the kernel uses the one CPU device
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(nb, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': os.path.join(REPO, 'notebooks')}})
  client.execute()
  outputs = [o for cell in nb.cells if cell.cell_type == 'code' for o in cell.outputs]
  shown = [o for o in outputs if o.output_type == 'display_data']
  assert any('image/png' in o.data for o in shown)
  text = ''.join(o.get('text', '') for o in outputs if o.output_type == 'stream')
  text += ''.join(o.data.get('text/markdown', '') for o in shown)
  assert 'cascade checkout: ' + REPO in text
  assert 'policy: ' in text and 'sample 1:' in text
  return text


def _rl_steps(workdir, stage) -> int:
  metrics = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  return max(m['step'] for m in metrics if m.get('stage') == stage)


def test_quickstart_notebook_runs(toy_config, tmp_path, monkeypatch):
  workdir = tmp_path / 'run'
  text = _execute(monkeypatch, str(toy_config), workdir)
  assert 'copy_rl  grpo          steps=2' in text
  assert '| copy_rl |' in text                        # the matrix is displayed
  res = json.loads((workdir / 'results.json').read_text())
  assert res['stages'] == ['sft', 'copy_rl'] and res['domains'] == ['copy']
  assert _rl_steps(workdir, 'copy_rl') == 2


@pytest.mark.slow
def test_quickstart_notebook_runs_the_tiny_config(tmp_path, monkeypatch):
  workdir = tmp_path / 'run'
  text = _execute(monkeypatch, f'configs/tiny.py:smoke,root={tmp_path / "world"}', workdir)
  res = json.loads((workdir / 'results.json').read_text())
  assert res['stages'][-1] == 'swe_rl' and '| swe_rl |' in text
  assert _rl_steps(workdir, 'swe_rl') == 2
