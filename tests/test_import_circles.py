"""No import circle among the project's modules: an import, at module level or inside a function,
of one module by another never leads back to the first (a package importing its own submodules
aside)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ('cascade', 'foundation', 'models', 'rl', 'verifiers', 'envs', 'launch', 'tiny_world')


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for pkg in PACKAGES:
    for f in sorted((ROOT / pkg).rglob('*.py')) if (ROOT / pkg).is_dir() else ():
      name = '.'.join(f.relative_to(ROOT).with_suffix('').parts)
      out[name.removesuffix('.__init__')] = f
  return out


def import_graph() -> dict[str, set[str]]:
  """module -> the project modules it imports (`from a import b` counts a.b when that is one)."""
  mods = _modules()

  def owner(name):
    while name and name not in mods:
      name = name.rpartition('.')[0]
    return name

  graph = {}
  for m, f in mods.items():
    deps = set()
    for node in ast.walk(ast.parse(f.read_text())):
      if isinstance(node, ast.Import):
        deps.update(owner(a.name) for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        deps.update(owner(f'{node.module}.{a.name}') for a in node.names)
    graph[m] = {d for d in deps if d and d != m and not d.startswith(m + '.')}
  return graph


def circles(graph) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while not comp or comp[-1] != v:
        comp.append(stack.pop())
        on.discard(comp[-1])
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_the_check_finds_a_circle():
  assert circles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [['a', 'b', 'c']]


def test_no_import_circle():
  graph = import_graph()
  assert 'cascade.config' in graph and 'cascade.verifier_set' in graph
  assert circles(graph) == []
