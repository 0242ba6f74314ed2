"""No ambient state in models/: the logical rules travel as a value.

A traced program must not depend on hidden Python state of our own, so no module under
models/ keeps a thread-local (`threading.local`, a subclass of it) or a context variable, and
every `sharding.constrain` in the model and the programs that trace it is given its rules by
its caller. Read from the source with `ast`, so the checks cost nothing at run time.
"""

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from models import config as config_lib
from models import sharding
from models import transformer

REPO = pathlib.Path(__file__).resolve().parents[2]
# Where `constrain` is called: the model and the programs that trace it.
CONSTRAINING = ('models', 'rl')


def _dotted(node) -> str:
  """'a.b.c' for a Name/Attribute chain, else ''."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    parts.append(node.id)
    return '.'.join(reversed(parts))
  return ''


def ambient_state(source: str) -> list[tuple[int, str]]:
  """(line, what) for every thread-local or context variable a module makes or subclasses:
  `threading.local`, `local` imported from threading, `contextvars.ContextVar`."""
  tree = ast.parse(source)
  banned = {'threading.local', 'contextvars.ContextVar', '_threading_local.local'}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module in ('threading', 'contextvars',
                                                            '_threading_local'):
      for alias in node.names:
        if alias.name in ('local', 'ContextVar'):
          banned.add(alias.asname or alias.name)
  found = []
  for node in ast.walk(tree):
    refs = []
    if isinstance(node, ast.Call):
      refs.append(node.func)
    if isinstance(node, ast.ClassDef):
      refs.extend(node.bases)
    found.extend((node.lineno, _dotted(r)) for r in refs if _dotted(r) in banned)
  return found


def constrains_without_rules(source: str) -> list[int]:
  """Lines of `sharding.constrain(...)` calls that pass no rules (a third argument or
  `rules=`)."""
  out = []
  for node in ast.walk(ast.parse(source)):
    if (isinstance(node, ast.Call) and _dotted(node.func) in ('sharding.constrain', 'constrain')
        and len(node.args) < 3 and not any(k.arg == 'rules' for k in node.keywords)):
      out.append(node.lineno)
  return out


def _sources(*packages):
  for pkg in packages:
    for f in sorted((REPO / pkg).rglob('*.py')):
      yield f.relative_to(REPO), f.read_text()


def test_no_thread_local_or_context_variable_in_models():
  found = [f'{path}:{line} {what}' for path, text in _sources('models')
           for line, what in ambient_state(text)]
  assert not found, found


def test_every_constrain_is_given_its_rules():
  found = [f'{path}:{line}' for path, text in _sources(*CONSTRAINING)
           for line in constrains_without_rules(text)]
  assert not found, found


@pytest.mark.parametrize('source,hits', [
    ('import threading\n_state = threading.local()\n', 1),
    ('from threading import local as L\nclass S(L):\n  pass\n', 1),
    ('import contextvars\nv = contextvars.ContextVar("rules")\n', 1),
    ('import threading\nlock = threading.Lock()\n', 0),
])
def test_the_ambient_check_sees_each_kind_of_thread_local(source, hits):
  assert len(ambient_state(source)) == hits


def test_the_constrain_check_sees_a_call_without_rules():
  assert constrains_without_rules('sharding.constrain(x, names)\n') == [1]
  assert not constrains_without_rules('sharding.constrain(x, names, rules)\n'
                                      'sharding.constrain(x, names, rules=r)\n')


def test_the_models_rules_are_the_ones_its_trace_uses():
  # Two rules for one model, one graphdef: each trace lays the activations out by the rules
  # set on the model it calls, and nothing else decides.
  cfg = config_lib.ModelConfig.tiny()
  graphdef, params = nnx.split(nnx.eval_shape(lambda: transformer.Transformer(
      cfg, rngs=nnx.Rngs(0))))
  mesh = sharding.make_mesh((2, 2, 2), jax.devices()[:8])
  tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)

  def hidden_spec(rules):
    def f(params, tokens):
      model = nnx.merge(graphdef, params)
      model.rules = rules
      return model.hidden(tokens)[0]
    with sharding.use_mesh(mesh):
      jaxpr = jax.make_jaxpr(f)(params, tokens)
    return [e.params['sharding'].spec for e in jaxpr.jaxpr.eqns
            if e.primitive.name == 'sharding_constraint']

  default = hidden_spec(sharding.DEFAULT_RULES)
  moved = hidden_spec(sharding.override_rules(None, [('batch', 'fsdp'), ('embed', 'data')]))
  assert default and len(default) == len(moved) and default != moved
  assert jax.sharding.PartitionSpec(('data', 'fsdp'), None, None) in default
  assert jax.sharding.PartitionSpec('fsdp', None, 'data') in moved
