"""LiveCodeBench suites (v5, v6): the released rows read in their windows, the pickled private
tests read by a restricted unpickler, LCB's prompts, and LCB's verdicts on fixture problems
from right, wrong and too-slow solutions run in the sandbox."""

import base64
import dataclasses
import json
import os
import pickle
import zlib

import pytest

from cascade import suites
from cascade.suites import base
from cascade.suites import livecodebench as lcb
from verifiers import code

FIXTURES = os.path.join(os.path.dirname(__file__), '..', '..', 'fixtures', 'suites')


def _read(name):
  return suites.get(name).read(os.path.join(FIXTURES, name))


def _fence(src):
  return f'Here it is.\n```python\n{src}\n```\n'


def test_registered_and_windowed_by_contest_date():
  assert suites.get('lcb_v5') is lcb.lcb_v5 and suites.get('lcb_v6') is lcb.lcb_v6
  assert (lcb.lcb_v5.start, lcb.lcb_v5.end) == ('2024-08-01', '2025-02-01')
  assert (lcb.lcb_v6.start, lcb.lcb_v6.end) == ('2025-02-01', '2025-05-01')
  # test6.jsonl holds a November 2024 row, test5.jsonl a June 2024 one: both left out.
  assert [r['id'] for r in _read('lcb_v6')] == ['abc395_a', '3720', 'abc398_b']
  assert [r['id'] for r in _read('lcb_v5')] == ['abc384_a']
  assert [r['id'] for r in lcb.lcb_v5.read(os.path.join(FIXTURES, 'lcb_v6'))] == ['abc380_a']


def test_public_and_decoded_private_tests_with_func_name():
  stdin, functional, _ = _read('lcb_v6')
  assert stdin['metadata']['tests'] == [
      {'input': '3 4\n', 'output': '7\n', 'testtype': 'stdin'},
      {'input': '1000000000 1000000000\n', 'output': '2000000000\n', 'testtype': 'stdin'},
      {'input': '0 0\n', 'output': '0\n', 'testtype': 'stdin'}]
  assert functional['metadata']['func_name'] == 'twoSum'
  assert [t['testtype'] for t in functional['metadata']['tests']] == ['functional'] * 3
  assert functional['metadata']['time_limit_s'] == 6.0


def test_prompts_are_lcbs_with_and_without_starter_code():
  stdin, functional, _ = _read('lcb_v6')
  assert stdin['messages'][0] == {'role': 'system', 'content': lcb.SYSTEM}
  assert stdin['messages'][1]['content'] == (
      '### Question:\nYou are given integers A and B. Print A+B.\n\nInput\n\nA B\n\nOutput\n\n'
      'Print the answer.\n\n### Format: ' + lcb.WITHOUT_STARTER +
      '\n```python\n# YOUR CODE HERE\n```\n\n### Answer: (use the provided format with '
      'backticks)\n\n')
  assert functional['messages'][1]['content'].endswith(
      '### Format: ' + lcb.WITH_STARTER + '\n```python\nclass Solution:\n    def twoSum(self, '
      'nums: List[int], target: int) -> List[int]:\n        \n```\n\n### Answer: (use the '
      'provided format with backticks)\n\n')


class _Boom:
  """Unpickling this would run a shell command (it never must)."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (os.system, (f'touch {self.path}',))


def _write_row(path, private):
  row = {'question_title': 't', 'question_content': 'q', 'platform': 'atcoder',
         'question_id': 'x1', 'contest_id': 'c', 'contest_date': '2025-03-01T00:00:00',
         'starter_code': '', 'difficulty': 'easy',
         'public_test_cases': json.dumps([{'input': '1\n', 'output': '1\n',
                                           'testtype': 'stdin'}]),
         'private_test_cases': private, 'metadata': '{}'}
  path.write_text(json.dumps({**row, 'question_id': 'x0'}) + '\n' + json.dumps(row) + '\n')


def _packed(value):
  return base64.b64encode(zlib.compress(pickle.dumps(value))).decode()


def test_a_pickle_that_would_run_code_is_refused_unrun(tmp_path):
  pwned = tmp_path / 'pwned'
  evil = pickle.dumps(_Boom(str(pwned)))
  with pytest.raises(pickle.UnpicklingError, match='refused global'):
    lcb.restricted_loads(evil)
  assert not pwned.exists()
  # The same pickle as a row's private tests: a BadRecord naming file:line; nothing ran.
  (tmp_path / 'data').mkdir()
  _write_row(tmp_path / 'data' / 'test6.jsonl',
             base64.b64encode(zlib.compress(evil)).decode())
  with pytest.raises(base.BadRecord, match=r'test6\.jsonl:1: private_test_cases is not '
                                           r'base64\(zlib\(pickle\)\) of plain data '
                                           r'\(UnpicklingError: refused global'):
    lcb.lcb_v6.read(str(tmp_path / 'data'))
  assert not pwned.exists()


def test_plain_pickles_are_read_and_bad_ones_are_one_line_errors(tmp_path):
  nested = {'a': [1, 2.5, (True, None)], 'b': b'x'}
  assert lcb.restricted_loads(pickle.dumps(nested)) == nested
  with pytest.raises(pickle.UnpicklingError):   # a set is built through a global (builtins.set)
    lcb.restricted_loads(pickle.dumps({1, 2}, protocol=2))
  tests = [{'input': '2\n', 'output': '2\n', 'testtype': 'stdin'}]
  _write_row(tmp_path / 'test6.jsonl', _packed(json.dumps(tests)))
  assert lcb.lcb_v6.read(str(tmp_path))[0]['metadata']['tests'][1:] == tests
  _write_row(tmp_path / 'test6.jsonl', 'not base64!')
  with pytest.raises(base.BadRecord, match=r'test6\.jsonl:1: private_test_cases is not'):
    lcb.lcb_v6.read(str(tmp_path))
  _write_row(tmp_path / 'test6.jsonl', _packed(json.dumps([{'input': 1}])))
  with pytest.raises(base.BadRecord, match=r'test6\.jsonl:1: private_test_cases\[0\] must be'):
    lcb.lcb_v6.read(str(tmp_path))
  with pytest.raises(base.DataMissing, match=r"suite 'lcb_v6': no test\*\.jsonl under"):
    lcb.lcb_v6.read(str(tmp_path / 'missing'))


@pytest.mark.parametrize('got, expected, same', [
    ('7\n', '7', True),                       # the whole output stripped
    ('  1 2  \n3\n', '1 2\n3\n', True),       # each line stripped
    ('1.0 2\n', '1.00 2.0\n', True),          # decimals equal as numbers
    ('1e2\n', '100\n', True),                 # Decimal('1e2') == 100
    ('0.5000001\n', '0.5\n', False),          # no tolerance
    ('1 2\n', '1\n2\n', False),               # lines count: the tokens alone are not enough
    ('1  2\n', '1 2\n', True),                # inner whitespace splits tokens as decimals
    ('Yes\n', 'yes\n', False),                # text is compared exactly
    ('\n1\n\n2\n', '1\n2\n', False),          # inner blank lines count
])
def test_stdout_comparison_is_lcbs(got, expected, same):
  assert code.lines_match(got, expected) is same


def test_functional_comparison_is_lcbs():
  assert code.call_matches((0, 1), [0, 1])
  assert code.call_matches(True, True) and not code.call_matches([1, 0], [0, 1])
  assert code.call_matches(2, 2.0)          # Python equality, as LCB's `==`


_RIGHT = {
    'abc395_a': 'a, b = map(int, input().split())\nprint(a + b)',
    '3720': ('class Solution:\n    def twoSum(self, nums: List[int], target: int) -> '
             'List[int]:\n        seen = {}\n        for i, x in enumerate(nums):\n'
             '            if target - x in seen:\n                return (seen[target - x], i)\n'
             '            seen[x] = i'),
    # Prints 0.750 / 0.500: equal as decimals.
    'abc398_b': 'import sys\nn, *a = map(int, sys.stdin.buffer.read().split())\n'
                'print(f"{sum(a) / n / 2:.3f}")\nexit()',
}
_WRONG = {
    'abc395_a': 'a, b = map(int, input().split())\nprint(a + b if a < 10**9 else 0)',
    '3720': 'class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]',
    'abc398_b': 'n = int(input())\na = list(map(int, input().split()))\nprint(sum(a) / n / 2 + 1e-9)',
}


@pytest.mark.usefixtures('bwrap_sandbox')
def test_verdicts_in_the_sandbox_right_wrong_and_too_slow():
  suite = dataclasses.replace(lcb.lcb_v6, time_limit_s=0.5)
  records = suite.read(os.path.join(FIXTURES, 'lcb_v6'))
  slow = 'import time\na, b = map(int, input().split())\ntime.sleep(0.8)\nprint(a + b)'
  with suite.grader(workers=2) as grader:
    grades = grader.grade_batch(
        records, [[_fence(_RIGHT[r['id']]), _fence(_WRONG[r['id']])] for r in records]
)
    slow_grade, = grader.grade(records[0], [_fence(slow)])
  assert [[g.score for g in row] for row in grades] == [[1.0, 0.0]] * 3, grades
  assert 'wrong answer' in grades[1][1].info['reason']
  assert slow_grade.score == 0.0 and 'time limit exceeded' in slow_grade.info['reason']
  summary = suite.summarize(records, grades)
  assert summary['value'] == pytest.approx(50.0) and summary['n'] == 3 and summary['k'] == 2
