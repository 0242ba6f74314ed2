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
