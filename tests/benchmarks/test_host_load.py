"""A benchmark run on a loaded host says so (issue #40): `benchmarks.host.load_warning`, every
benchmark's main prints its line above the summary, and the verifier benchmark's table and page
carry it."""

import ast
import json
import os
import pathlib
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
def test_print_load_warning_prints_the_line_when_loaded(monkeypatch, capsys, load, warned):
  monkeypatch.setattr(os, 'getloadavg', lambda: (load, load, load))
  line = host.print_load_warning((0.0, 0.0, 0.0))
  out = capsys.readouterr().out
  assert (line is not None) == warned
  assert out == (line + '\n' if warned else ''), out


_BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / 'benchmarks'
# Benchmarks with a main that time nothing, so a load warning would not apply.
_TIME_NOTHING = {
    'ifbench_agreement.py': 'counts agreements of our instruction checkers with the reference '
                            'implementations; it prints no seconds or throughputs',
}


def _warns(node) -> bool:
  return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == 'host'
             and n.func.attr in ('print_load_warning', 'load_warning') for n in ast.walk(node))


def _prints_a_summary(stmt) -> bool:
  """`print(json.dumps(...))` or `print(name)`: a benchmark's closing summary line."""
  if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
          and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == 'print'
          and len(stmt.value.args) == 1):
    return False
  arg = stmt.value.args[0]
  return isinstance(arg, ast.Name) or (isinstance(arg, ast.Call) and ast.unparse(
      arg.func) == 'json.dumps')


def test_every_benchmark_main_prints_the_load_warning():
  """Static: every benchmarks/*.py run by `app.run` calls host.print_load_warning (or
  host.load_warning), and each of its functions that ends in a summary line calls it before."""
  mains = sorted(p for p in _BENCHMARKS.glob('*.py') if 'app.run(' in p.read_text())
  assert len(mains) >= 9, [p.name for p in mains]
  missing = []
  for path in mains:
    if path.name in _TIME_NOTHING:
      continue
    tree = ast.parse(path.read_text())
    if not _warns(tree):
      missing.append(f'{path.name}: no call of host.print_load_warning')
    for fn in ast.walk(tree):
      if (isinstance(fn, ast.FunctionDef) and _prints_a_summary(fn.body[-1])
          and not any(_warns(s) for s in fn.body[:-1])):
        missing.append(f'{path.name}:{fn.body[-1].lineno}: {fn.name} prints its summary without '
                       'host.print_load_warning before it')
  assert not missing, missing
  assert set(_TIME_NOTHING) <= {p.name for p in mains}, 'stale _TIME_NOTHING entry'


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
