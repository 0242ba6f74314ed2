"""Smoke test of the demo: configs/tiny.py:smoke runs the whole cascade from the command line.

Two steps per stage and a one-block model: this checks that every stage of
the tiny cascade runs on the generated world and that the results come out in
the expected shape, not that anything learns (that is `make demo`'s job; the
README's Quickstart has the table it gives).
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOMAINS = ['chat', 'code', 'instruction_following', 'math', 'swe']
STAGES = ['sft', 'rlhf', 'if_rl', 'math_rl', 'code_rl', 'swe_rl']


# Slow (2-3 minutes): the in-process golden-matrix cascade covers the stage
# loop in the default run; this one covers the command line end to end.
@pytest.mark.slow
def test_tiny_cascade_smoke(tmp_path):
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)                        # one CPU device, as `make demo` runs
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  workdir = tmp_path / 'run'
  cmd = [sys.executable, '-m', 'cascade.main',
         f'--config={REPO}/configs/tiny.py:smoke,root={tmp_path / "world"}',
         f'--workdir={workdir}']
  p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, f'{p.stdout[-3000:]}\n{p.stderr[-5000:]}'

  res = json.loads((workdir / 'results.json').read_text())
  assert res['domains'] == DOMAINS
  assert res['stages'] == STAGES                    # the reward model adds no row
  assert res['stage_domains'] == [
      ['chat', 'instruction_following', 'math', 'code', 'swe'], ['chat'],
      ['instruction_following'], ['math'], ['code'], ['swe']]
  assert len(res['scores']) == len(STAGES)
  assert all(len(row) == len(DOMAINS) and all(0 <= v <= 100 for v in row)
             for row in res['scores'])
  md = (workdir / 'results.md').read_text()
  assert '| swe_rl | swe |' in md
  assert (workdir / 'results.png').stat().st_size > 0
  # The run ends by printing the table and where the results are.
  assert '| swe_rl | swe |' in p.stdout
  assert f'{workdir / "results.png"}' in p.stdout
  # The run's `prepare` step built the world where the config argument said,
  # with its mixed-mode SFT file.
  assert (tmp_path / 'world' / 'seed0' / 'sft_mixed.jsonl').stat().st_size > 0
  assert (workdir / 'stages' / '06_swe_rl' / 'hf' / 'model.safetensors').exists()
