"""The package's layers, read from the source: imports point down, and no import circle.

From the bottom: foundation/ (the path layer, device topology, tokenizers, chat templates, the
name registry) imports nothing else of the project; models/ imports only foundation/; rl/ and
verifiers/ import only those two; envs/ imports those four; cascade/ may import all of them; on top, launch/ and tiny_world/ (the demo's world, a user of the framework
like a user's own package) may import any of those and not each other. So a lower layer never
imports `cascade`, the framework never imports `tiny_world`, and every module can be read and
tested without the layers above it.

Imports are read with `ast` (every `import` and `from ... import`, at the top of a module or
inside a function: a deferred import is still an arrow), each resolved to the project module it
names. A circle is a set of modules that reach one another through such arrows; a package's
`__init__` is entered only when named (`from cascade.kinds import base` names
cascade.kinds.base, not cascade/kinds/__init__).
"""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ('foundation', 'models', 'rl', 'verifiers', 'envs', 'cascade', 'launch', 'tiny_world')
# Package -> its layer; a module imports only from its own package or a lower layer.
LAYER = {'foundation': 0, 'models': 1, 'rl': 2, 'verifiers': 2, 'envs': 3, 'cascade': 4,
         'launch': 5, 'tiny_world': 5}


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of the project's packages."""
  out = {}
  for pkg in PACKAGES:
    for f in sorted((REPO / pkg).rglob('*.py')):
      parts = list(f.relative_to(REPO).with_suffix('').parts)
      if parts[-1] == '__init__':
        parts.pop()
      out['.'.join(parts)] = f
  return out


def _imports(name: str, path: pathlib.Path, modules) -> set[tuple[str, int]]:
  """(project module imported, line) for every import in the file."""

  def resolve(dotted):
    while dotted and dotted not in modules:
      dotted = dotted.rpartition('.')[0]
    return dotted or None

  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [resolve(a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        pkg = name if path.name == '__init__.py' else name.rpartition('.')[0]
        for _ in range(node.level - 1):
          pkg = pkg.rpartition('.')[0]
        base = f'{pkg}.{base}'.rstrip('.')
      targets = [f'{base}.{a.name}' if f'{base}.{a.name}' in modules else resolve(base)
                 for a in node.names]
    else:
      continue
    out.update((t, node.lineno) for t in targets if t and t != name)
  return out


def _graph():
  modules = _modules()
  return modules, {m: _imports(m, f, modules) for m, f in modules.items()}


def _circles(graph) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan, iterative)."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []
  for root in graph:
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      v, it = work[-1]
      for w, _ in it:
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(graph[w]))))
          break
        if w in on_stack:
          low[v] = min(low[v], index[w])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[v])
        if low[v] == index[v]:
          comp = []
          while True:
            w = stack.pop()
            on_stack.discard(w)
            comp.append(w)
            if w == v:
              break
          if len(comp) > 1:
            out.append(sorted(comp))
  return out


def test_lower_layers_import_only_lower_layers():
  modules, graph = _graph()
  bad = []
  for m, deps in sorted(graph.items()):
    pkg = m.split('.')[0]
    if pkg not in LAYER:
      continue
    for dep, line in sorted(deps):
      dpkg = dep.split('.')[0]
      if dpkg != pkg and not LAYER.get(dpkg, 99) < LAYER[pkg]:
        bad.append(f'{modules[m].relative_to(REPO)}:{line} imports {dep}')
  assert not bad, 'imports up the layers:\n' + '\n'.join(bad)


def test_no_import_circle():
  _, graph = _graph()
  circles = _circles(graph)
  assert not circles, f'import circles: {circles}'


def test_the_checks_see_every_kind_of_import_and_a_circle(tmp_path):
  modules = _modules()
  src = tmp_path / 'x.py'
  src.write_text('from cascade import runner\nimport rl.grpo as g\n\n\ndef f():\n'
                 '  from . import sharding\n  from cascade.kinds import base, loop\n')
  assert _imports('models.x', src, modules) == {
      ('cascade.runner', 1), ('rl.grpo', 2), ('models.sharding', 6),
      ('cascade.kinds.base', 7), ('cascade.kinds.loop', 7)}
  graph = {'a': {('b', 1)}, 'b': {('c', 1)}, 'c': {('a', 3)}, 'd': {('a', 1)}}
  assert _circles(graph) == [['a', 'b', 'c']]
