"""benchmarks.verifiers: every domain scores its batch, HumanEval passes both harnesses, --doc."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_domains_and_humaneval_side_by_side_are_reported_and_written(tmp_path):
  doc = tmp_path / 'docs' / 'verifiers.md'
  out = subprocess.run(
      [sys.executable, '-m', 'benchmarks.verifiers', '--domains=math,structured,code',
       '--samples=32', '--repeats=1', f'--doc={doc}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  summary = json.loads(out.strip().splitlines()[-1])
  assert summary['math_samples_per_s'] > 0 and summary['structured_samples_per_s'] > 0
  # Both harnesses passed all 164 canonical solutions (the benchmark asserts it), timed.
  assert summary['humaneval_sandbox_s'] > 0 and summary['humaneval_reference_s'] > 0
  assert summary['sandbox_speedup'] == pytest.approx(
      summary['humaneval_reference_s'] / summary['humaneval_sandbox_s'], rel=0.02)
  page = doc.read_text()
  assert '--domains=math,structured,code' in page and 'load average' in page
  assert json.dumps(summary) in page


def test_compare_tree_times_an_older_sandbox_alternately(tmp_path):
  """--compare_tree=git:REV: that commit's sandbox, extracted by the benchmark, timed batch by
  batch beside this tree's (here the same commit, so the ratio is about 1)."""
  out = subprocess.run(
      [sys.executable, '-m', 'benchmarks.verifiers', '--domains=code', '--repeats=1',
       '--compare_tree=git:HEAD'],
      cwd=ROOT, capture_output=True, text=True, timeout=900, check=True).stdout
  summary = json.loads(out.strip().splitlines()[-1])
  assert summary['compare_ours_s'] > 0 and summary['compare_theirs_s'] > 0
  assert summary['compare_ratio'] == pytest.approx(
      summary['compare_ours_s'] / summary['compare_theirs_s'], rel=0.01)
  assert 'this tree vs git:HEAD' in out
