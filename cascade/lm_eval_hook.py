"""`lm_eval --model cascade`: registers cascade's lm-eval backend in every lm-eval process.

lm-eval (0.4.13) finds a model only in its registry (`lm_eval.api.registry.model_registry`),
which it fills from its own `lm_eval.models.MODEL_MAPPING`; it reads no entry points. So the
install puts `cascade-lm-eval.pth` (its one line is `PTH_LINE`) at the root of site-packages,
where Python's `site` runs it at start-up; that line calls `install()`, which puts a finder at
the front of `sys.meta_path`. The finder does nothing until `lm_eval.api.registry` is imported;
then it lets the module load as usual and registers the name 'cascade' in its model registry as
the lazy target 'cascade.harness:CascadeLM' (lm-eval's own lazy form), and leaves
`sys.meta_path`. `cascade.harness`, and jax with it, is imported only when lm-eval looks the
model up.

At start-up the line imports nothing new: it runs this file by its path (the `cascade` package
itself is not imported, see `PTH_LINE`), which imports only `sys`, and it swallows every
error: a missing lm-eval, a `cascade` that is gone, a changed registry leave `python` as it was
(a registry that refuses the name warns, once lm-eval is imported). The name is registered once
however often `install()` runs, and `cascade.harness` turns the placeholder into its class when
it is imported (lm-eval's placeholder upgrade).
"""

import sys

MODEL = 'cascade'
TARGET = 'cascade.harness:CascadeLM'
WATCHED = 'lm_eval.api.registry'
PTH_NAME = 'cascade-lm-eval.pth'
# What the .pth file's line runs: this file, found under the installed package's directory
# (a finder's `find_spec` locates a top-level package without importing it) and run as a module
# of its own, with only what start-up has loaded already; not `import cascade`: importing the
# package at start-up would pin `cascade` to the installed copy for the whole process, so
# `python -m cascade.main` in another checkout (its cwd first on sys.path) would run the
# installed code instead of its own. `site` runs a line that starts with `import`, and prints
# the traceback of one that raises, so the line catches everything itself.
PTH_LINE = ('import sys; exec(\'try:\\n'
            ' import os\\n'
            ' for f in sys.meta_path:\\n'
            '  s = getattr(f, "find_spec", None) and f.find_spec("cascade", None)\\n'
            '  if s: break\\n'
            ' p = os.path.join(s.submodule_search_locations[0], "lm_eval_hook.py")\\n'
            ' m = type(sys)("cascade_lm_eval_hook")\\n'
            ' m.__file__ = p\\n'
            ' exec(compile(open(p, encoding="utf-8").read(), p, "exec"), m.__dict__)\\n'
            ' m.install()\\n'
            'except Exception:\\n'
            ' pass\')')


def register(registry) -> bool:
  """Registers 'cascade' in lm-eval's model `registry` (lazily) unless a model of that name is
  there; returns whether it registered."""
  if MODEL in registry:
    return False
  registry.register(MODEL, target=TARGET)
  return True


class _Loader:
  """The registry module's own loader, then `register` on the loaded module."""

  def __init__(self, loader):
    self._loader = loader

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    self._loader.exec_module(module)
    _uninstall()
    try:
      register(module.model_registry)
    except Exception as e:  # pylint: disable=broad-except
      import warnings  # pylint: disable=g-import-not-at-top
      warnings.warn(f'cascade: could not register the lm-eval model {MODEL!r} '
                    f'({type(e).__name__}: {e}); `python -m cascade.harness run ...` still '
                    'runs it', RuntimeWarning, stacklevel=2)

  def __getattr__(self, name):
    # get_source, get_filename, is_package, ...: tracebacks and inspect read them.
    return getattr(self._loader, name)


class _Finder:
  """A `sys.meta_path` finder that answers only for `WATCHED`: the spec the other finders give,
  with its loader wrapped by `_Loader`."""

  cascade_lm_eval_hook = True   # how install() and _uninstall() know a finder of this module

  @classmethod
  def find_spec(cls, fullname, path=None, target=None):
    if fullname != WATCHED:
      return None
    try:
      for finder in sys.meta_path:
        if getattr(finder, 'cascade_lm_eval_hook', False):
          continue
        find = getattr(finder, 'find_spec', None)
        spec = find(fullname, path, target) if find is not None else None
        if spec is not None:
          if spec.loader is not None and hasattr(spec.loader, 'exec_module'):
            spec.loader = _Loader(spec.loader)
          return spec
    except Exception:  # pylint: disable=broad-except
      pass
    return None


def _uninstall() -> None:
  sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, 'cascade_lm_eval_hook', False)]


def install() -> None:
  """Registers 'cascade' now if lm-eval's registry is loaded, else once it is; a second call
  adds nothing."""
  module = sys.modules.get(WATCHED)
  if module is not None:
    register(module.model_registry)
  elif not any(getattr(f, 'cascade_lm_eval_hook', False) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder)
