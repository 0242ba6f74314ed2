"""Multi-host on one machine: two JAX processes (4 CPU devices each, gloo) run a sharded cascade.

Both processes run the same SFT -> GRPO cascade over one (2, 2, 2) mesh that
spans them, save Orbax checkpoints collectively into one workdir, restore the
final one, and must agree: the same results and the same parameter checksum.
Only process 0 writes the logs and the matrix files.

Marked slow as well: two JAX processes compiling on a shared 2-core machine
took 165 s wall (about 60 s of CPU), over the default suite's budget.
"""

import json
import os
import random
import socket
import subprocess
import sys

import pytest

from models import chat
from models import tokenizer as tokenizer_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, 'tests', 'launch', 'multihost_worker.py')

CONFIG = '''
import ml_collections

def get_config(arg=None):
  root = {root!r}
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny', overrides=dict(vocab_size=320, embed_dim=32, num_layers=1,
                 num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64, max_seq_len=128))
  c.tokenizer = dict(path=root + '/tok.model')
  c.mesh = dict(shape=(2, 2, 2))
  c.sampler = dict(prompt_buckets=(64,), new_token_buckets=(8,))
  c.ckpt = dict(every_n_steps=1, keep=2)
  c.eval = dict(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=6,
                max_prompt_len=64, num_prompts=8, batch_size=8, thinking=False)
  c.datasets = dict(sft=dict(path=root + '/sft.jsonl', format='sft'),
                    copy_train=dict(path=root + '/copy_train.jsonl', format='prompt',
                                    domain='copy'),
                    copy_eval=dict(path=root + '/copy_eval.jsonl', format='prompt',
                                   domain='copy'))
  c.domains = dict(copy=dict(verifier='math', verifier_options=dict(workers=1),
                             train='copy_train', eval='copy_eval'))
  c.stages = [
      dict(name='sft', kind='sft', domains=['copy'], datasets=['sft'], steps=6, batch_size=8,
           max_len=64, optimizer=dict(lr=1e-2)),
      dict(name='copy_rl', kind='grpo', domains=['copy'], steps=2, optimizer=dict(lr=1e-3),
           prompts_per_step=4, group_size=4, max_prompt_len=64, max_response_len=6,
           thinking_fraction=0.0, dynamic_filter=False)]
  c.allow_config_change = False
  return c
'''


def _messages(a):
  return [{'role': 'user', 'content': f'Copy {a}.'}]


@pytest.fixture(scope='module')
def world(tmp_path_factory):
  root = tmp_path_factory.mktemp('multihost')
  rng = random.Random(0)
  texts = []
  for split, n in (('train', 32), ('eval', 8)):
    with open(root / f'copy_{split}.jsonl', 'w') as f:
      for i in range(n):
        a = rng.randint(0, 9)
        f.write(json.dumps({'id': f'{split}-{i}', 'messages': _messages(a),
                            'metadata': {'answer': str(a)}}) + '\n')
  with open(root / 'sft.jsonl', 'w') as f:
    for i in range(64):
      a = rng.randint(0, 9)
      rec = {'domain': 'copy', 'messages': _messages(a), 'response': f'\\boxed{{{a}}}'}
      f.write(json.dumps(rec) + '\n')
      for mode in (False, None):
        texts.append(chat.render(rec['messages'], thinking=mode)
                     + chat.render_response(rec['response'], None))
  tokenizer_lib.train_sentencepiece(texts, str(root / 'tok'), vocab_size=300)
  (root / 'cfg.py').write_text(CONFIG.format(root=str(root)))
  return root


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_run_a_sharded_cascade_and_agree(world, tmp_path):
  workdir, out = tmp_path / 'run', tmp_path / 'out'
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  env.pop('XLA_FLAGS', None)
  coordinator = f'127.0.0.1:{_free_port()}'
  procs = [subprocess.Popen([sys.executable, WORKER, coordinator, '2', str(i),
                             str(world / 'cfg.py'), str(workdir), str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=400)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  codes = [p.returncode for p in procs]
  assert codes == [0, 0], '\n'.join(f'--- process {i} exited {c}:\n{log[-4000:]}'
                                     for i, (c, log) in enumerate(zip(codes, logs)))

  r0, r1 = (json.loads((out / f'{i}.json').read_text()) for i in range(2))
  assert (r0['processes'], r0['devices'], r0['local_devices']) == (2, 8, 4)
  assert r0['results'] == r1['results']
  assert r0['results']['stages'] == ['sft', 'copy_rl']
  assert r0['step'] == r1['step'] == 2
  assert r0['checksum'] == r1['checksum'] and r0['checksum'] > 0
  assert json.loads((workdir / 'results.json').read_text()) == r0['results']
  # Only process 0 logs: one line per step of each stage, not two.
  metrics = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [m['step'] for m in metrics if m.get('stage') == 'copy_rl'] == [1, 2]
  assert (workdir / 'stages' / '01_copy_rl' / 'hf' / 'model.safetensors').exists()
  # Process 1 prints no matrix (process 0 does).
  assert '| copy_rl |' in logs[0] and '| copy_rl |' not in logs[1]
