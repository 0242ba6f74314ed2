"""A benchmark run on a loaded host says so (issue #40): `benchmarks.host.load_warning`, and the
verifier benchmark's table and page carry its line above the summary."""

import json
import os
import sys

from absl import flags
import pytest

from benchmarks import host


def test_the_warning_is_given_above_the_cores_only():
  assert host.load_warning((2.0, 1.0, 1.0), (1.5, 1, 1), cpus=2) is None
  line = host.load_warning((2.0, 1.0, 1.0), (12.25, 5, 3), cpus=2)
  assert line.startswith('WARNING: the host was loaded (one-minute load average 2.00 -> 12.25 on '
                         '2 cores)') and '\n' not in line
  assert '3.10 on 2 cores' in host.load_warning(3.1, cpus=2)
  assert host.load_warning(0.5, cpus=None) is None


@pytest.mark.parametrize('load, warned', [(0.0, False), (1e3, True)])
def test_the_verifier_benchmark_prints_it_above_its_summary(monkeypatch, capsys, tmp_path, load,
                                                            warned):
  from benchmarks import verifiers as bench  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(os, 'getloadavg', lambda: (load, load, load))
  doc = tmp_path / 'v.md'
  flags.FLAGS.unparse_flags()
  flags.FLAGS(['verifiers', '--domains=math', '--samples=8', '--repeats=1', '--workers=1',
               f'--doc={doc}'])
  monkeypatch.setattr(sys, 'argv', ['verifiers', '--domains=math'])
  try:
    bench.main([])
  finally:
    flags.FLAGS.unparse_flags()
  out = capsys.readouterr().out.strip().splitlines()
  assert json.loads(out[-1])['math_samples_per_s'] > 0
  assert out[-2].startswith('WARNING: the host was loaded') == warned, out[-3:]
  assert ('WARNING: the host was loaded' in doc.read_text()) == warned
