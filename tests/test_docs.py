"""The docs pages name the tests that show their claims: every named test exists."""

import ast
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, 'docs')
# `tests/a/test_b.py::test_c` (a parametrized id's brackets are not part of the name).
_NODE = re.compile(r'`(tests/[\w/]+\.py)::(\w+)')


def _pages():
  return sorted(n for n in os.listdir(DOCS) if n.endswith('.md'))


def _tests_in(path):
  with open(os.path.join(REPO, path), encoding='utf-8') as f:
    tree = ast.parse(f.read())
  return {n.name for n in ast.walk(tree)
          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith('test')}


@pytest.mark.parametrize('page', _pages())
def test_every_test_a_docs_page_names_exists(page):
  with open(os.path.join(DOCS, page), encoding='utf-8') as f:
    named = _NODE.findall(f.read())
  missing = [f'{path}::{name}' for path, name in named
             if not os.path.exists(os.path.join(REPO, path)) or name not in _tests_in(path)]
  assert not missing, f'docs/{page} names tests that do not exist: {missing}'


def test_the_survival_page_names_tests():
  with open(os.path.join(DOCS, 'what_a_run_survives.md'), encoding='utf-8') as f:
    assert len(_NODE.findall(f.read())) >= 40


def test_every_docs_page_the_readme_links_exists():
  """README points to pages the scripts that measure write (docs/plans/, docs/benchmarks/):
  each is in the repository."""
  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    linked = set(re.findall(r'\]\((docs/[\w/.-]+\.md)\)', f.read()))
  assert any(p.startswith('docs/plans/') for p in linked)
  missing = sorted(p for p in linked if not os.path.exists(os.path.join(REPO, p)))
  assert not missing, f'README links pages that do not exist: {missing}'


# What a plan page's `target:` line says made its numbers (launch/plan/targets.py `target`).
_COMPILERS = ('compiled by the TPU compiler', 'compiled by XLA:GPU deviceless',
              'simulated CPU devices standing in for')


def test_every_plan_page_says_which_compiler_made_it():
  """docs/plans/: each page `launch.plan --report` wrote has its `target:` line (markdown_report
  refuses a header without one), naming the TPU compiler, XLA:GPU or XLA:CPU on simulated
  devices; docs/planning.md says which to trust."""
  plans = os.path.join(DOCS, 'plans')
  pages = [n for n in sorted(os.listdir(plans)) if n.endswith('.md')]
  written = {n: open(os.path.join(plans, n), encoding='utf-8').read() for n in pages}
  written = {n: t for n, t in written.items() if 'Written by `launch.plan --report`' in t}
  assert len(written) >= 8, sorted(written)
  for name, text in written.items():
    targets = [l for l in text.splitlines() if l.startswith('- target: ')]
    assert len(targets) == 1, f'docs/plans/{name}: {len(targets)} target lines'
    assert sum(c in targets[0] for c in _COMPILERS) == 1, f'docs/plans/{name}: {targets[0]}'


def test_the_project_is_apache_2_licensed():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'LICENSE')) as f:
    text = f.read()
  assert 'Apache License' in text and 'Version 2.0, January 2004' in text
  with open(os.path.join(root, 'setup.py')) as f:
    assert "license='Apache-2.0'" in f.read()
