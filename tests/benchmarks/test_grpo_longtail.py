"""benchmarks.grpo_step: the fixed step through the stage loop beside its floor and bare programs,
its host time by part; --workload=longtail: padded against engine + packed steps."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_longtail_grpo_steps_report_both_sides():
  out = subprocess.run(
      [sys.executable, '-m', 'benchmarks.grpo_step', '--workload=longtail', '--prompts=2',
       '--group_size=4', '--new_tokens=32', '--steps=1', '--chunk_rows=4'],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  result = json.loads(out.strip().splitlines()[-1])
  padded, packed = (result['sides'][k] for k in ('padded (one-call sampler)',
                                                 'engine + packed update'))
  assert result['rows'] == 8 and result['generated_tokens'] >= 8
  # The padded update holds every row at prompt + cap; the packed one only what it needs.
  assert padded['update_token_slots'] == 8 * (16 + 32)
  assert packed['update_token_slots'] < padded['update_token_slots']
  assert result['engine_speedup'] == padded['s_per_step'] / packed['s_per_step']


@pytest.mark.parametrize('scan', ['auto', 'true'])
def test_fixed_grpo_step_reports_its_floor_and_the_bare_programs(scan):
  # --scan_layers: 'auto' loops the blocks on these CPUs, 'true' scans them.
  out = subprocess.run(
      [sys.executable, '-m', 'benchmarks.grpo_step', '--prompts=2', '--group_size=4',
       '--new_tokens=16', '--steps=1', f'--scan_layers={scan}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  result = json.loads(out.strip().splitlines()[-1])
  assert result['layers_scanned'] == (scan == 'true')
  assert ('layers scanned' if scan == 'true' else 'layers looped') in out.splitlines()[0]
  assert result['floor_s'] == pytest.approx(result['floor_sample_s'] + result['floor_update_s'])
  assert result['xla_sample_s'] > 0 and result['xla_update_s'] > 0
  assert "this backend's bare programs of the same work" in out
  # The step ran through the stage loop, its host time split from its programs by part.
  assert result['step'] == 'loop' and 'host time by part' in out
  assert set(result['program_parts']) == {'sampling', 'update'}
  assert {'batch', 'divergence check', 'metrics log', 'preemption check'} <= set(
      result['parts_s'])
  assert 0 < result['host_s'] < result['s_per_step']
  assert result['x_bare'] == pytest.approx(result['s_per_step'] / result['bare_s'])
