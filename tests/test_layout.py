"""docs/layout.md says where things live, and the tree agrees: every package and module the page
names exists, and every package of the repository is named there.

The page's text block has one entry per top-level folder (`name/` at the start of a line,
its description on the indented lines below). In an entry, `x.py` names a module and `x/` a
folder, both inside the entry's folder; `x/ (...)` opens that folder, so the names in the
parentheses are inside it (`data/ (shards.py, ...)` is cascade/data/shards.py).
"""

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, 'docs', 'layout.md')
# A module (`x.py`), a folder (`x/`), or a parenthesis; `gs://` and dotted names are neither.
_TOKEN = re.compile(r'(?<![\w./:-])([a-z_][a-z0-9_]*(?:\.py|/)(?![\w/]))|([()])')


def _block(text: str) -> str:
  """The page's first ```text block."""
  m = re.search(r'```text\n(.*?)```', text, re.S)
  assert m, 'docs/layout.md has no ```text block'
  return m.group(1)


def _entries(block: str) -> dict[str, str]:
  """Top-level folder -> its description (the lines up to the next entry)."""
  out, name = {}, None
  for line in block.splitlines():
    m = re.match(r'([a-z_]+)/\s', line + ' ')
    if m and not line.startswith(' '):
      name = m.group(1)
      out[name] = line[len(name) + 1:]
    elif name is not None:
      out[name] += '\n' + line
  return out


def named(text: str) -> set[str]:
  """Every path the page names, relative to the repository ('cascade/data/shards.py',
  'cascade/data/'); top-level folders end in '/'."""
  out = set()
  for top, desc in _entries(_block(text)).items():
    out.add(top + '/')
    # The folders the names are inside; the last folder named and where its name ended.
    stack, last_dir, last_end = [top], None, -1
    for m in _TOKEN.finditer(desc):
      tok, paren = m.groups()
      if paren == '(':
        opens = last_dir is not None and not desc[last_end:m.start()].strip()
        stack.append(last_dir if opens else stack[-1])
      elif paren == ')':
        stack.pop()
      else:
        out.add(f'{stack[-1]}/{tok}')
        last_dir, last_end = f'{stack[-1]}/{tok}'.rstrip('/'), m.end()
        continue
      last_dir = None
  return out


def _tracked() -> list[str]:
  return subprocess.run(['git', 'ls-files'], cwd=REPO, capture_output=True, text=True,
                        check=True).stdout.split()


def packages(files) -> set[str]:
  """Folders of the repository that are Python packages (an __init__.py; tests aside), and
  every top-level folder, each as 'a/b/'."""
  out = {f.split('/')[0] + '/' for f in files if '/' in f and not f.startswith('.')}
  out |= {f.rpartition('/')[0] + '/' for f in files
          if f.endswith('/__init__.py') and not f.startswith('tests/')}
  return out


def test_the_parser_reads_entries_nested_folders_and_modules():
  page = ('```text\nfoo/  a: bar.py, gs://x, docs/planning.md and\n'
          '      sub/ (one.py, deep/ (two.py)), three.py, x/\n```\n')
  assert named(page) == {'foo/', 'foo/bar.py', 'foo/sub/', 'foo/sub/one.py', 'foo/sub/deep/',
                         'foo/sub/deep/two.py', 'foo/three.py', 'foo/x/'}
  assert packages(['a/__init__.py', 'a/b/__init__.py', 'a/c/x.txt', 'tests/t/__init__.py',
                   '.ci/run', 'README.md']) == {'a/', 'a/b/', 'tests/'}


@pytest.fixture(scope='module')
def page_names():
  with open(PAGE, encoding='utf-8') as f:
    return named(f.read())


def test_every_package_and_module_the_page_names_exists(page_names):
  missing = sorted(p for p in page_names if not os.path.exists(os.path.join(REPO, p)))
  assert not missing, f'docs/layout.md names what is not in the tree: {missing}'


def test_every_package_of_the_repository_is_named(page_names):
  unnamed = sorted(packages(_tracked()) - page_names)
  assert not unnamed, f'docs/layout.md does not name these packages: {unnamed}'


def test_the_page_points_to_adding_a_model_family():
  with open(PAGE, encoding='utf-8') as f:
    text = f.read()
  assert '(model_families.md), "Adding a model family"' in text
  with open(os.path.join(REPO, 'docs', 'model_families.md'), encoding='utf-8') as f:
    assert '\n## Adding a model family\n' in f.read()
