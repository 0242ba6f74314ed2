"""LiveCodeBench's verdicts (verifiers/code.py `lines_match`, `call_matches`) against the official
runner's own grading code, where its source is at hand: the runner is not a dependency (the
`nvidia-livecodebench` package is LiveCodeBench's code as NVIDIA packages it), so the test reads
an unpacked wheel named by LCB_SRC (`pip download nvidia-livecodebench --no-deps -d /tmp/lcb &&
cd /tmp/lcb && python -m zipfile -e nvidia_livecodebench-*.whl src`, then LCB_SRC=/tmp/lcb/src)
and loads only its `livecodebench/evaluation/testing_util.py`. Its `grade_stdio` runs a program
that writes a generated output (equal numbers written otherwise, spaces, tabs, blank lines,
case, a changed or missing token) and compares it with an expected one; its `grade_call_based`
calls a `Solution` method returning a generated value and compares it with an expected JSON
value. Each verdict must be ours."""

import importlib.util
import itertools
import json
import os
import random

import pytest

from verifiers import code

SRC = os.environ.get('LCB_SRC', '')


def _reference():
  path = os.path.join(SRC, 'livecodebench', 'evaluation', 'testing_util.py')
  if not SRC or not os.path.isfile(path):
    pytest.skip('LCB_SRC names no unpacked nvidia-livecodebench wheel (see the module docstring)')
  spec = importlib.util.spec_from_file_location('lcb_testing_util', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# Tokens and the other ways of writing each that are equal as decimals.
_EQUAL = {'1': ['1.0', '1.00', '01', '+1', '1e0'], '100': ['1e2', '100.0', '1E+2'],
          '0': ['-0', '0.0', '.0', '0e5'], '0.5': ['.5', '0.50', '5e-1', '0.5000'],
          '-3': ['-3.0', '-03'], '12345678901234567890': ['12345678901234567890.0']}
_OTHER = ['2', '0.5000001', '1.01', 'Yes', 'yes', 'NO', 'abc', '1,2', '-', '', 'inf', 'nan']


def _line(rng) -> list[str]:
  return [rng.choice(list(_EQUAL) + _OTHER[:6]) for _ in range(rng.randint(1, 4))]


def _mutate(lines: list[list[str]], rng) -> str:
  lines = [list(x) for x in lines]
  kind = rng.choice(['same', 'equal', 'spaces', 'tab', 'blank_inner', 'blank_edge', 'case',
                     'change', 'drop_line', 'join', 'drop_token', 'other'])
  i = rng.randrange(len(lines))
  j = rng.randrange(len(lines[i]))
  sep = ' '
  if kind == 'equal' and lines[i][j] in _EQUAL:
    lines[i][j] = rng.choice(_EQUAL[lines[i][j]])
  elif kind == 'case':
    lines[i][j] = lines[i][j].swapcase()
  elif kind == 'change':
    lines[i][j] = rng.choice(_OTHER)
  elif kind == 'drop_token' and len(lines[i]) > 1:
    del lines[i][j]
  elif kind == 'other':
    return '\n'.join(' '.join(_line(rng)) for _ in lines)
  elif kind == 'spaces':
    sep = '  '
  elif kind == 'tab':
    sep = '\t'
  text = [sep.join(x) for x in lines]
  if kind == 'spaces':
    text = [f' {t}  ' for t in text]
  if kind == 'blank_inner' and len(text) > 1:
    text.insert(1, '')
  if kind == 'drop_line' and len(text) > 1:
    del text[i]
  if kind == 'join' and len(text) > 1:
    text[0:2] = [text[0] + ' ' + text[1]]
  out = '\n'.join(text)
  return f'\n{out}\n\n' if kind == 'blank_edge' else out + rng.choice(['', '\n'])


@pytest.mark.heavy
def test_stdout_verdicts_equal_the_official_runners():
  util = _reference()
  rng = random.Random(0)
  tally = {True: 0, False: 0}
  for _ in range(1500):
    expected_lines = [_line(rng) for _ in range(rng.randint(1, 3))]
    expected = '\n'.join(' '.join(x) for x in expected_lines) + '\n'
    got = _mutate(expected_lines, rng)
    results, _ = util.grade_stdio(f'import sys\nsys.stdout.write({got!r})', [''], [expected], 5)
    theirs = results[-1] is True
    assert code.lines_match(got, expected) == theirs, (got, expected, results)
    tally[theirs] += 1
  assert min(tally.values()) >= 300, tally            # both verdicts, often


@pytest.mark.heavy
def test_functional_verdicts_equal_the_official_runners():
  util = _reference()
  returned = ['[0, 1]', '(0, 1)', '[1, 0]', '((0, 1),)', '[[0, 1]]', 'True', '1', '2', '2.0',
              '"2"', 'None', '[]', '()', '{"a": 1}', '{"a": 1.0}', '[1, [2, (3,)]]', '0.1 + 0.2']
  expected = ['[0, 1]', '[1, 0]', '[[0, 1]]', 'true', '1', '2', '2.0', '"2"', 'null', '[]',
              '{"a": 1}', '[1, [2, [3]]]', '0.3']
  agree = 0
  for ret, want in itertools.product(returned, expected):
    solution = f'class Solution:\n    def f(self, x):\n        return {ret}\n'
    results, _ = util.grade_call_based(solution, ['0'], [want], 'f', 5)
    theirs = results[-1] is True
    ours = code.call_matches(eval(ret), json.loads(want))  # pylint: disable=eval-used
    assert ours == theirs, (ret, want, results)
    agree += 1
  assert agree == len(returned) * len(expected)
