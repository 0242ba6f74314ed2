"""A deterministic tiny cascade's stage x domain matrix equals the checked-in one.

The toy 'copy a digit' world (conftest.write_copy_cascade) runs in-process through every
policy-training kind the copy world can feed: SFT -> GRPO (KL to its starting policy,
optimizer state carried over from SFT, overlong filter in its first phase) -> MOPD (teachers
chosen on a validation set of two-digit copies) -> an eval stage re-reading the SFT policy. The matrix and each RL
step's mean reward are pinned in tests/cascade/golden/copy_cascade*.json: a change in data
order, pairing of records and rewards, filtering, the optimizer or the evaluation moves them.

When a change is deliberate, regenerate this machine's file and review its diff:

  CASCADE_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q -m heavy tests/cascade/test_golden_matrix.py

It is exact on one CPU type and JAX version (XLA:CPU picks kernels by the CPU, so float
rounding, and then sampled tokens, differ between CPU types): each file records the machine it
was made on, the comparison uses the file of this machine, and where none is pinned it is
skipped with that reason (regenerating there adds a file for it; a deliberate change needs
every pinned machine's file regenerated, or the files of machines it cannot reach removed).
"""

import hashlib
import importlib.util
import json
import os
import pathlib
import platform

import jax
import pytest

from cascade import runner

pytestmark = pytest.mark.heavy

GOLDEN_DIR = pathlib.Path(__file__).parent / 'golden'


def machine() -> str:
  """What the pinned numbers depend on: JAX's version and the CPU's model and features."""
  model, flags = '', ''
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      for line in f:
        if line.startswith('model name') and not model:
          model = line.split(':', 1)[1].strip()
        elif line.startswith('flags') and not flags:
          flags = line.split(':', 1)[1].strip()
  except OSError:
    pass
  feature_hash = hashlib.sha256(' '.join(sorted(flags.split())).encode()).hexdigest()[:12]
  return f'jax {jax.__version__}, {platform.machine()}, {model or "unknown CPU"}, ' \
         f'features {feature_hash}'


def pinned() -> dict[str, pathlib.Path]:
  """The pinned files by the machine each records."""
  return {json.loads(f.read_text())['machine']: f
          for f in sorted(GOLDEN_DIR.glob('copy_cascade*.json'))}


def golden_path(this_machine: str, pins: dict[str, pathlib.Path]) -> pathlib.Path:
  """This machine's file: the one pinned for it, else a new name from the machine's hash."""
  name = hashlib.sha256(this_machine.encode()).hexdigest()[:8]
  return pins.get(this_machine, GOLDEN_DIR / f'copy_cascade-{name}.json')


def _config(path):
  # A validation set MOPD's teachers='best' chooses on: two-digit copies, disjoint from the
  # held-out one-digit prompts the matrix reports.
  with open(path.parent / 'copy_val.jsonl', 'w') as f:
    for a in range(10, 26):
      f.write(json.dumps({'id': f'val-{a}', 'messages': [{'role': 'user', 'content': f'Copy {a}.'}],
                          'metadata': {'answer': str(a)}}) + '\n')
  spec = importlib.util.spec_from_file_location('copy_cfg', path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  # '\\boxed{7}<|im_end|>' is 10 tokens of the toy tokenizer: room for it, so scores move.
  c.sampler.new_token_buckets = (16,)
  c.eval.max_new_tokens = 12
  c.eval.num_prompts = 32    # sampled: 64 answers per row, so a row is not all-or-nothing
  c.datasets.copy_val = dict(path=str(path.parent / 'copy_val.jsonl'), format='prompt',
                             domain='copy')
  c.domains.copy.validation = 'copy_val'
  rl = dict(c.stages[1])
  rl.update(steps=4, kl_coef=0.05, reset_optimizer=False, max_response_len=12,
            phases=[dict(until_step=2, max_response_len=10, filter_overlong=True),
                    dict(until_step=4, temperature=0.8)])
  mopd = dict(name='distill', kind='mopd', domains=['copy'], steps=2, optimizer=dict(lr=1e-4),
              prompts_per_step=2, group_size=4, max_prompt_len=64, max_response_len=12,
              thinking_fraction=0.0)
  c.stages = [c.stages[0], rl, mopd, dict(name='sft_again', kind='eval', init_from='sft')]
  return c


def test_tiny_cascade_matrix_equals_the_checked_in_one(tmp_path, copy_cascade):
  path = copy_cascade(tmp_path, train=64, eval_=32, sft=64, sft_steps=30, rl_steps=4)
  res = runner.run(_config(path), str(tmp_path / 'run'))
  # Where step time went is timing, not a result: checked for shape, then left out.
  acc = res.pop('accounting')
  assert sorted(acc) == ['copy_rl', 'distill', 'sft']
  assert acc['copy_rl']['steps'] == 4 and 0 < acc['copy_rl']['decode_waste'] < 1
  assert acc['copy_rl']['generated_tokens'] > 0 and 'verifier_share' in acc['copy_rl']
  # Each row names the hash of the config it was computed with: one config here. The hash covers
  # this test's paths, so it is checked for shape and left out.
  configs = res.pop('configs')
  assert len(configs) == len(res['scores']) and len(set(configs)) == 1 and configs[0]
  # The best policies' HF exports are named by their path in this test's directory.
  res = json.loads(json.dumps(res).replace(str(tmp_path), '<tmp>'))
  metrics = [json.loads(l) for l in open(tmp_path / 'run' / 'metrics.jsonl')]
  got = {'results': res,
         'reward_mean': {st: [m['reward_mean'] for m in metrics if m.get('stage') == st]
                         for st in ('copy_rl', 'distill')},
         'rows_with_loss': [m['rows_with_loss'] for m in metrics if m.get('stage') == 'copy_rl'],
         'teachers': json.load(open(tmp_path / 'run' / 'progress.json'))['done']['distill'][
             'teachers']}
  # What holds whatever the numbers: the shape, and the eval stage re-reads the SFT policy.
  assert res['stages'] == ['sft', 'copy_rl', 'distill', 'sft_again']
  assert res['scores'][3] == res['scores'][0]
  assert any(v > 0 for row in res['scores'] for v in row)          # not a trivial matrix
  assert [len(v) for v in got['reward_mean'].values()] == [4, 2]
  here, pins = machine(), pinned()
  if os.environ.get('CASCADE_REGEN_GOLDEN'):
    path = golden_path(here, pins)
    path.write_text(json.dumps({'machine': here, **got}, indent=1) + '\n')
    pytest.skip(f'regenerated {path}')
  if here not in pins:
    pytest.skip(f'the pinned matrices were made on {sorted(pins)}, this is {here}: '
                'regenerate it here (see the module docstring) to compare')
  want = json.loads(pins[here].read_text())
  assert got['results'] == want['results']
  assert got['teachers'] == want['teachers']
  assert got['rows_with_loss'] == want['rows_with_loss']
  for st, rs in want['reward_mean'].items():
    assert got['reward_mean'][st] == pytest.approx(rs, rel=1e-6, abs=1e-7), st
