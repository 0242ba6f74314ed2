"""End to end: a 3-stage cascade (SFT -> GRPO -> GRPO) on two toy domains, killed and resumed.

The command line runs in subprocesses sharing a persistent compilation cache,
so only the first run pays for compiling. A run killed with SIGKILL at a chosen
point (tests/faults.py's `--kill_at=<stage>:<step>` hook, right after that
step's checkpoint: mid-SFT, mid-RL past a curriculum phase, at a stage's last
step) and rerun must resume there and end with the same stage x domain matrix,
and the same final weights, as the run that was never interrupted.

All `slow` (minutes): the fast suite covers the same wiring in-process
(test_kinds_loop.py: resume of data position, RNG and params, the kill hook;
test_golden_matrix.py: a tiny SFT -> GRPO -> MOPD -> eval cascade's pinned matrix).
"""

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from foundation import chat
from foundation import tokenizer as tokenizer_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(REPO, 'tests', 'faults.py')   # cascade.main with a test's kill hook

CONFIG = '''
import ml_collections

def get_config(arg=None):
  root = {root!r}
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny', overrides=dict(vocab_size=384, embed_dim=32, num_layers=1,
                 num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=128))
  c.tokenizer = dict(path=root + '/tok.model')
  c.mesh = dict(shape=None)
  c.sampler = dict(prompt_buckets=(32,), new_token_buckets=(16,))
  c.ckpt = dict(every_n_steps=2, keep=2)
  c.eval = dict(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=10,
                max_prompt_len=32, num_prompts=8, batch_size=8, thinking=False)
  c.datasets = dict(sft=dict(path=root + '/sft.jsonl', format='sft'))
  c.domains = dict()
  for d in ('copy', 'next'):
    c.datasets[d + '_train'] = dict(path=root + '/' + d + '_train.jsonl', format='prompt', domain=d)
    c.datasets[d + '_eval'] = dict(path=root + '/' + d + '_eval.jsonl', format='prompt', domain=d)
    c.domains[d] = dict(verifier='math', verifier_options=dict(workers=1),
                        train=d + '_train', eval=d + '_eval')
  rl = lambda name, doms: dict(
      name=name, kind='grpo', domains=doms, steps=6, optimizer=dict(lr=3e-4),
      prompts_per_step=4, group_size=4, max_prompt_len=32, max_response_len=10,
      thinking_fraction=0.5, refill_cap=1,
      phases=[dict(until_step=3, max_response_len=10, filter_overlong=True),
              dict(until_step=6, temperature=0.9)])
  c.stages = [dict(name='sft', kind='sft', domains=['copy', 'next'], datasets=['sft'], steps=24,
                   batch_size=16, max_len=48, optimizer=dict(lr=1e-2, warmup_steps=2)),
              rl('copy_rl', ['copy']), rl('next_rl', ['next'])]
  if arg == 'full':
    # The other kinds: a reward model, a blended two-domain GRPO stage with a KL term that
    # keeps the SFT optimizer state, MOPD from the per-domain best rows, an eval stage.
    c.datasets.prefs = dict(path=root + '/prefs.jsonl', format='preference', domain='copy')
    # 'copy' is trained on the reward model's score and measured by the math verifier.
    c.domains.copy = dict(verifier='reward_model', eval_verifier='math',
                          eval_verifier_options=dict(workers=1), reward_model_stage='rm',
                          train='copy_train', eval='copy_eval')
    blend = rl('blend', ['copy', 'next'])
    del blend['phases']
    blend.update(steps=3, kl_coef=0.05, reset_optimizer=False)
    c.stages[1:] = [
        dict(name='rm', kind='reward_model', domains=['copy'], datasets=['prefs'], steps=3,
             batch_size=8, max_len=48, optimizer=dict(lr=1e-3), init_from='sft'),
        blend,
        dict(name='distill', kind='mopd', domains=['copy', 'next'], steps=2,
             optimizer=dict(lr=1e-4), prompts_per_step=4, group_size=4, max_prompt_len=32,
             max_response_len=10),
        dict(name='sft_again', kind='eval', init_from='set by --config.stages[4].init_from'),
    ]
  c.allow_config_change = False
  return c
'''


def _prompt(domain, a):
  return [{'role': 'user', 'content': f'Copy {a}.' if domain == 'copy' else f'After {a}?'}]


def _answer(domain, a):
  return str(a if domain == 'copy' else a + 1)


@pytest.fixture(scope='module')
def world(tmp_path_factory):
  root = tmp_path_factory.mktemp('world')
  rng = random.Random(0)
  texts = []
  for d in ('copy', 'next'):
    for split, n in (('train', 64), ('eval', 8)):
      with open(root / f'{d}_{split}.jsonl', 'w') as f:
        for i in range(n):
          a = rng.randint(0, 9)
          f.write(json.dumps({'id': f'{d}-{split}-{i}', 'messages': _prompt(d, a),
                              'metadata': {'answer': _answer(d, a)}}) + '\n')
  prefs = []
  with open(root / 'sft.jsonl', 'w') as f:
    for i in range(256):
      d, a = rng.choice(('copy', 'next')), rng.randint(0, 9)
      rec = {'domain': d, 'messages': _prompt(d, a), 'response': f'\\boxed{{{_answer(d, a)}}}'}
      if i % 2:
        rec['thinking'] = f'{a}'
      f.write(json.dumps(rec) + '\n')
      if d == 'copy':
        prefs.append({'messages': rec['messages'], 'chosen': rec['response'],
                      'rejected': f'\\boxed{{{(a + 3) % 10}}}'})
      for mode in (True, False, None):
        texts.append(chat.render(rec['messages'], thinking=mode)
                     + chat.render_response(rec['response'], rec.get('thinking')))
  with open(root / 'prefs.jsonl', 'w') as f:
    f.writelines(json.dumps(p) + '\n' for p in prefs)
  tokenizer_lib.train_sentencepiece(texts, str(root / 'tok'), vocab_size=320)
  (root / 'cfg.py').write_text(CONFIG.format(root=str(root)))
  return root


def _env(cache):
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)                      # one CPU device, no mesh
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=REPO, JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='-1')
  return env


def _cmd(world, workdir, *extra, arg='', kill_at=None):
  main = [FAULTS, f'--kill_at={kill_at}'] if kill_at else ['-m', 'cascade.main']
  return [sys.executable, *main, f'--config={world / "cfg.py"}{arg}', f'--workdir={workdir}',
          *extra]


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp('jax_cache')


def _run(world, workdir, cache, *extra, check=True, arg=''):
  p = subprocess.run(_cmd(world, workdir, *extra, arg=arg), env=_env(cache), cwd=REPO,
                     capture_output=True, text=True, timeout=600)
  if check and p.returncode:
    raise AssertionError(f'exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}')
  return p


def _final_weights(workdir):
  return (workdir / 'stages' / '02_next_rl' / 'hf' / 'model.safetensors').read_bytes()


@pytest.fixture(scope='module')
def uninterrupted(world, cache, tmp_path_factory):
  a = tmp_path_factory.mktemp('a')
  return a, _run(world, a, cache)


def _killed_and_resumed(world, cache, workdir, stage, index, step, res_a):
  """Kills a run right after `stage`'s checkpoint `step`, reruns it; checks it resumed there."""
  p = subprocess.run(_cmd(world, workdir, kill_at=f'{stage}:{step}'), env=_env(cache), cwd=REPO,
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
  progress = json.loads((workdir / 'progress.json').read_text())
  assert stage not in progress['done']                           # killed mid-cascade
  out = _run(world, workdir, cache)
  assert f'[{index}] {stage}: resuming at step {step}/' in out.stdout, out.stdout[-3000:]
  assert _matrix(json.loads((workdir / 'results.json').read_text())) == _matrix(res_a)
  return workdir


def _matrix(res):
  """results.json without "accounting" (where the step time went: timings differ by run)."""
  return {k: v for k, v in res.items() if k != 'accounting'}


@pytest.mark.slow
@pytest.mark.parametrize('stage,index,step', [('sft', 0, 12), ('next_rl', 2, 6)])
def test_cascade_killed_at_other_points_resumes_there(world, cache, uninterrupted, tmp_path,
                                                      stage, index, step):
  a, _ = uninterrupted
  res_a = json.loads((a / 'results.json').read_text())
  b = _killed_and_resumed(world, cache, tmp_path / 'b', stage, index, step, res_a)
  assert _final_weights(b) == _final_weights(a)


@pytest.mark.slow
def test_cascade_killed_and_resumed_matches_uninterrupted(world, cache, uninterrupted, tmp_path):
  a, out = uninterrupted
  res_a = json.loads((a / 'results.json').read_text())
  assert res_a['stages'] == ['sft', 'copy_rl', 'next_rl']
  assert res_a['domains'] == ['copy', 'next']
  assert res_a['stage_domains'] == [['copy', 'next'], ['copy'], ['next']]
  assert all(0 <= v <= 100 for row in res_a['scores'] for v in row)
  assert any(v > 0 for row in res_a['scores'] for v in row), res_a   # not a trivial matrix
  assert '| next_rl | next |' in (a / 'results.md').read_text()
  assert (a / 'results.png').stat().st_size > 0
  assert '[1] copy_rl (grpo): 6 steps in' in out.stdout
  for st in ('00_sft', '01_copy_rl', '02_next_rl'):
    assert (a / 'stages' / st / 'hf' / 'config.json').exists()
    assert '6' in os.listdir(a / 'stages' / st / 'ckpt') or st == '00_sft'
  metrics = [json.loads(l) for l in (a / 'metrics.jsonl').read_text().splitlines()]
  rl = [m for m in metrics if m.get('stage') == 'copy_rl']
  assert [m['step'] for m in rl] == [1, 2, 3, 4, 5, 6]
  assert [m['max_response_len'] for m in rl] == [10] * 6
  assert [m['temperature'] for m in rl] == [1.0, 1.0, 1.0, 0.9, 0.9, 0.9]
  assert any(f.startswith('events.out.tfevents') for f in os.listdir(a / 'tb'))

  # The same command, killed (SIGKILL, by tests/faults.py's kill hook right after the named
  # step's checkpoint) and rerun, ends with the same matrix and weights.
  b = _killed_and_resumed(world, cache, tmp_path / 'b', 'copy_rl', 1, 4, res_a)
  assert _final_weights(b) == _final_weights(a)

  # The same workdir with a different config refuses to start (no traceback, exit 2) ...
  bad = _run(world, b, cache, '--config.stages[1].steps=7', check=False)
  assert bad.returncode == 2 and 'different config' in bad.stderr, bad.stderr[-2000:]
  assert 'Traceback' not in bad.stderr


@pytest.mark.heavy
def test_a_forked_run_copies_the_shared_stages_and_ends_as_the_uninterrupted_run(
    world, cache, uninterrupted, tmp_path):
  """`--fork_from`: a run killed inside its last stage lends its two finished stages to a new
  workdir of the same config, which runs only the last stage and ends with the uninterrupted
  run's matrix and weights; rerunning the forked command resumes; a source whose other
  sections differ is refused in one line."""
  a, _ = uninterrupted
  res_a = json.loads((a / 'results.json').read_text())
  src = tmp_path / 'src'
  p = subprocess.run(_cmd(world, src, kill_at='next_rl:2'), env=_env(cache), cwd=REPO,
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-3000:])
  fork = tmp_path / 'fork'
  out = _run(world, fork, cache, f'--fork_from={src}')
  assert f'forked from {src}: sft, copy_rl' in out.stdout, out.stdout[-3000:]
  assert '[2] next_rl (grpo): 6 steps in' in out.stdout
  assert not any(l.startswith(('[0] sft (sft): ', '[1] copy_rl (grpo): '))
                 for l in out.stdout.splitlines())          # the banner's stage lines are indented
  assert 'stage 1 of 3' not in out.stdout and 'stage 2 of 3' not in out.stdout
  assert _matrix(json.loads((fork / 'results.json').read_text())) == _matrix(res_a)
  assert _final_weights(fork) == _final_weights(a)
  progress = json.loads((fork / 'progress.json').read_text())
  assert progress['done']['copy_rl']['forked_from'] == str(src)
  assert progress['done']['copy_rl']['hf'].startswith(str(fork))
  again = _run(world, fork, cache, f'--fork_from={src}')
  assert 'resuming its own progress' in again.stdout
  bad = _run(world, tmp_path / 'bad', cache, f'--fork_from={src}',
             '--config.eval.num_prompts=4', check=False)
  assert bad.returncode == 2 and 'its config differs in eval' in bad.stderr, bad.stderr[-2000:]


@pytest.mark.slow
def test_reward_model_blended_grpo_mopd_and_eval_stages(world, cache, uninterrupted, tmp_path):
  a, _ = uninterrupted
  res_a = json.loads((a / 'results.json').read_text())
  c = tmp_path / 'c'
  out = _run(world, c, cache, f'--config.stages[4].init_from={a / "stages" / "00_sft" / "hf"}',
             arg=':full')
  res = json.loads((c / 'results.json').read_text())
  # The reward model trains no policy, so it adds no row.
  assert res['stages'] == ['sft', 'blend', 'distill', 'sft_again']
  assert res['stage_domains'] == [['copy', 'next'], ['copy', 'next'], ['copy', 'next'], []]
  assert res['scores'][0] == res_a['scores'][0]          # the same SFT stage, the same row
  # The eval stage re-reads the SFT policy from its HF export: the same scores again.
  assert res['scores'][3] == res_a['scores'][0]
  progress = json.loads((c / 'progress.json').read_text())
  assert progress['done']['rm']['final_step'] == 3
  teachers = progress['done']['distill']['teachers']
  for j, d in enumerate(res['domains']):                 # each domain's best earlier row
    best = max(range(2), key=lambda i: (res['scores'][i][j], -i))
    want = ['stage', res['stages'][best]]
    assert teachers[d] == want, (d, teachers, res)
  assert 'teacher for copy' in out.stdout
  metrics = [json.loads(l) for l in (c / 'metrics.jsonl').read_text().splitlines()]
  rm = [m for m in metrics if m.get('stage') == 'rm']
  assert len(rm) == 3 and all('accuracy' in m for m in rm)
  blend = [m for m in metrics if m.get('stage') == 'blend']
  assert any('reward_mean/copy' in m and 'reward_mean/next' in m for m in blend)  # mixed
  # 'copy' rows got the reward model's real-valued scores, 'next' rows 0/1 from math.
  assert any(m['reward_mean/copy'] not in (0.0, 1.0) for m in blend if 'reward_mean/copy' in m)
  assert len(blend) == 3 and all('kl' in m for m in blend)
  assert not (c / 'stages' / '01_rm' / 'hf').exists()          # no policy to export
  assert (c / 'stages' / '03_distill' / 'hf' / 'model.safetensors').exists()


@pytest.mark.slow
def test_full_cascade_on_a_2x2x2_mesh(world, tmp_path):
  """Every stage kind sharded over 8 simulated devices (data, fsdp, tensor) = (2, 2, 2)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.device_count() < 8:
    pytest.skip('needs 8 (simulated) devices')
  import cascade  # pylint: disable=g-import-not-at-top
  ns = {}
  exec(CONFIG.format(root=str(world)), ns)  # pylint: disable=exec-used
  c = ns['get_config']('full')
  c.mesh.shape = (2, 2, 2)
  c.stages[0]['steps'] = 4
  c.stages[4]['init_from'] = 'sft'
  res = cascade.run(c, str(tmp_path / 'mesh'))
  assert res['stages'] == ['sft', 'blend', 'distill', 'sft_again']
  assert res['scores'][3] == res['scores'][0]      # the eval stage re-reads the SFT policy
  assert (tmp_path / 'mesh' / 'stages' / '03_distill' / 'hf' / 'model.safetensors').exists()
