"""benchmarks.sampler --family: the hybrid family's fixed workload beside transformers generate on
the same weights (greedy tokens compared) and its floor; flags that do not apply are refused."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The tiny_hybrid preset's own widths (embed 64, 4 x 16 heads, 2 kv, MLP 96): seconds per call.
TINY = ('--embed=64', '--heads=4', '--head_dim=16', '--kv_heads=2', '--mlp=96')


def _run(*args, check=True):
  return subprocess.run([sys.executable, '-m', 'benchmarks.sampler', *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600, check=check)


def test_hybrid_fixed_workload_matches_transformers_and_prints_its_floor():
  # Sample mode: the timed programs sample, and one more greedy call per side is compared. The
  # bare loop is left out to stay fast (tests/benchmarks/test_floor.py runs it for the family).
  out = _run('--family=hybrid', '--compare_hf', '--mode=sample', '--new_tokens=8', '--batch=4',
             '--repeats=1', '--scaling=', '--xla_reference=false', *TINY).stdout
  result = json.loads(out.strip().splitlines()[-1])
  assert result['family'] == 'hybrid' and result['model_family'] == 'nemotron_h'
  assert result['mode'] == 'sample'
  assert result['embed'] == 64 and result['layers'] == 6
  assert 0 < result['active_params'] < result['params']
  # The same work on both sides: identical prompt logits and identical greedy tokens.
  assert result['hf_logits_max_abs_diff'] < 1e-4
  assert result['greedy_rows'] == 4 and result['greedy_tokens_agree'] == 4 * 8
  assert result['greedy_rows_agree'] == 4 and result['greedy_first_divergence'] == []
  assert 'greedy tokens, ours vs transformers: 4/4 rows identical' in out
  assert result['floor_s'] > 0 and 'floor counts' in out and '8 of 8 routed experts' in out


@pytest.mark.parametrize('flag', ['--layers=4', '--compare_scan'])
def test_flags_that_do_not_apply_to_a_family_are_refused(flag):
  proc = _run('--family=moe', flag, check=False)
  assert proc.returncode != 0
  assert f'{flag.split("=")[0]} does not apply to --family=moe' in proc.stderr
