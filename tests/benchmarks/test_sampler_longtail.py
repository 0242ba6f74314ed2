"""benchmarks.sampler: every side of the longtail and turns workloads runs the same rows; the
fixed workload times the scanned decode, a bare loop of the same work and transformers generate
beside the sampler."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args):
  """benchmarks.sampler's stdout and its last line's JSON."""
  out = subprocess.run([sys.executable, '-m', 'benchmarks.sampler', *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, check=True).stdout
  return out, json.loads(out.strip().splitlines()[-1])


def test_longtail_workload_reports_useful_tokens_for_every_side():
  out, result = _run('--workload=longtail', '--mode=sample', '--new_tokens=32', '--prompts=4',
                     '--group=4', '--batch=8', '--repeats=1', '--slots=1,2', '--page_size=8',
                     '--chunk_steps=8')
  sides = result['sides']
  assert set(sides) == {'one-call sampler', 'paged engine, 8 slots', 'paged engine, 16 slots'}
  # The benchmark asserts every side generated exactly the target lengths; the rates follow.
  assert result['rows'] == 16 and 16 <= result['useful_tokens'] <= 16 * 32
  assert all(s['compile_count'] >= 1 and s['median_s'] > 0 for s in sides.values())
  assert result['engine_vs_one_call'] == max(
      sides[k]['speedup_vs_one_call'] for k in sides if k.startswith('paged'))
  assert 'long-tail workload' in out and result['floor_s'] > 0


def test_turns_workload_prefills_only_new_tokens_with_a_session():
  out, result = _run('--workload=turns', '--mode=sample', '--prompt_len=20', '--obs_len=10',
                     '--new_tokens=8', '--turns=3', '--prompts=2', '--repeats=1',
                     '--page_size=8', '--chunk_steps=8')
  sides = result['sides']
  # Re-prefilling: every turn's prompt but its last token, (20 - 1) + (38 - 1) + (56 - 1) per
  # episode. With the session: the opening, then per later turn the last sampled token and the
  # observation but its last token (the first decode step feeds that): 19 + 10 + 10.
  assert sides['paged engine, re-prefill']['prefilled_tokens'] == 2 * (19 + 37 + 55)
  assert sides['one-call sampler, re-prefill']['prefilled_tokens'] == 2 * (19 + 37 + 55)
  assert sides['paged engine + KV session']['prefilled_tokens'] == 2 * (19 + 10 + 10)
  assert result['session_vs_reprefill'] == sides['paged engine, re-prefill']['median_s'] / sides[
      'paged engine + KV session']['median_s']
  assert 'turns workload' in out and result['floor_s'] > 0


def test_fixed_workload_times_the_scanned_layers_beside_the_unrolled():
  out, result = _run('--mode=greedy', '--new_tokens=8', '--batch=4', '--repeats=1',
                     '--scaling=', '--compare_scan', '--compare_hf')
  assert result['decode_layers'] == 'unrolled'                  # 'auto' on these CPUs
  assert result['speedup_vs_scan'] == pytest.approx(
      result['tokens_per_s'] / result['scan_tokens_per_s'])
  assert 'layers scanned' in out and result['floor_s'] > 0
  assert 0 < result['xla_matmuls_s'] and 0 < result['xla_loop_s']
  assert "this backend's bare loop of the same work" in out
  # transformers generate on the same weights (the interop extra `make test` installs).
  assert result['hf_logits_max_abs_diff'] < 1e-4 and result['speedup_vs_hf'] > 0
  # Greedy mode: the timed programs' tokens themselves, equal on every row.
  assert result['family'] == 'dense' and result['greedy_rows'] == 4
  assert result['greedy_rows_agree'] == 4 and result['greedy_tokens_agree'] == 4 * 8
