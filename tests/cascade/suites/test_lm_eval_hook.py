"""cascade/lm_eval_hook.py, the start-up hook behind `lm_eval --model cascade`: in a Python whose
site-packages holds cascade-lm-eval.pth (conftest's `hooked_python`), importing lm-eval's
registry registers 'cascade' as a lazy placeholder (nothing of cascade.harness or jax imported),
once however often the hook runs; without lm-eval, or with a broken cascade or lm-eval, start-up
is untouched, and start-up imports no module (not even `cascade`). That the line is in the wheels is
tests/test_install.py's; that `lm_eval --model cascade` then runs is test_harness.py's."""

import contextlib
import json
import os
import pathlib
import re
import subprocess
import textwrap

import pytest

from cascade import lm_eval_hook

REPO = pathlib.Path(__file__).resolve().parents[3]

_PROBE = textwrap.dedent("""\
    import json, sys
    out = {'finders': sum(bool(getattr(f, 'cascade_lm_eval_hook', False)) for f in sys.meta_path),
           'loaded_at_start': sorted(m for m in ('lm_eval', 'jax', 'cascade.harness')
                                     if m in sys.modules)}
    import lm_eval.api.registry as registry
    out['placeholder'] = dict(registry.model_registry.items()).get('cascade')
    out['finders_after'] = sum(bool(getattr(f, 'cascade_lm_eval_hook', False))
                               for f in sys.meta_path)
    import lm_eval.models
    from cascade import lm_eval_hook
    out['again'] = lm_eval_hook.register(registry.model_registry)
    lm_eval_hook.install()
    out['hf'] = dict(registry.model_registry.items()).get('hf')
    out['placeholder_after_models'] = dict(registry.model_registry.items()).get('cascade')
    out['loaded_at_end'] = sorted(m for m in ('jax', 'cascade.harness') if m in sys.modules)
    print(json.dumps(out))
    """)


def _run(python, code, *, pythonpath=(), args=()):
  env = {k: v for k, v in os.environ.items() if not k.startswith('PYTHON')}
  env['PYTHONPATH'] = os.pathsep.join([*map(str, pythonpath), str(REPO)])
  return subprocess.run([str(python), *args, '-c', code], env=env, capture_output=True, text=True,
                        timeout=120, check=False)


def _site(python) -> pathlib.Path:
  return pathlib.Path(_run(python, 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
                           ).stdout.strip())


@contextlib.contextmanager
def _pth_moved(python, name: str | None):
  """The hooked Python with its cascade-lm-eval.pth renamed to `name` (a second copy made by
  that name) or set aside (None) for the block."""
  pth = _site(python) / lm_eval_hook.PTH_NAME
  text = pth.read_text()
  other = pth.with_name(name) if name else pth.with_suffix('.off')
  other.write_text(text)
  if name is None:
    pth.unlink()
  try:
    yield
  finally:
    other.unlink()
    pth.write_text(text)


def test_lm_evals_registry_gets_cascade_as_a_lazy_placeholder_once(hooked_python):
  # A second copy of the line: install() runs twice at start-up and must add one finder.
  with _pth_moved(hooked_python, 'cascade-lm-eval-copy.pth'):
    proc = _run(hooked_python, _PROBE)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  assert out['finders'] == 1 and out['loaded_at_start'] == []
  assert out['placeholder'] == 'cascade.harness:CascadeLM'
  assert out['finders_after'] == 0 and out['again'] is False
  assert out['hf'] == 'lm_eval.models.huggingface:HFLM'           # lm-eval's own, untouched
  assert out['placeholder_after_models'] == 'cascade.harness:CascadeLM'
  assert out['loaded_at_end'] == []                               # lazy: nothing loaded
  assert proc.stderr == ''


def test_without_the_pth_nothing_registers(hooked_python):
  """The control: the same Python with the .pth set aside registers nothing until asked."""
  with _pth_moved(hooked_python, None):
    proc = _run(hooked_python, _PROBE)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  assert out['finders'] == 0 and out['placeholder'] is None
  assert out['again'] is True                                     # register() itself did it
  assert out['placeholder_after_models'] == 'cascade.harness:CascadeLM'


def _package(root: pathlib.Path, name: str, files: dict[str, str]) -> pathlib.Path:
  for rel, text in files.items():
    path = root / name / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return root


def test_start_up_survives_a_missing_lm_eval_and_a_broken_cascade(hooked_python, tmp_path):
  # lm-eval made unimportable: start-up is silent, the finder stays, lm-eval's own error shows.
  gone = _package(tmp_path / 'gone', 'lm_eval', {'__init__.py': 'raise ImportError("no lm_eval")'})
  proc = _run(hooked_python, textwrap.dedent("""\
      import json, sys
      finders = sum(bool(getattr(f, 'cascade_lm_eval_hook', False)) for f in sys.meta_path)
      try:
        import lm_eval.api.registry
      except ImportError as e:
        err = str(e)
      import json as j2, email.message   # other imports are untouched
      print(json.dumps({'finders': finders, 'err': err}))
      """), pythonpath=[gone])
  assert proc.returncode == 0 and proc.stderr == '', proc.stderr[-3000:]
  assert json.loads(proc.stdout) == {'finders': 1, 'err': 'no lm_eval'}
  # A cascade that raises on import (a broken or half-removed install): start-up is silent.
  broken = _package(tmp_path / 'broken', 'cascade', {'__init__.py': 'raise RuntimeError("x")'})
  proc = _run(hooked_python, 'import sys; print(len(sys.meta_path))', pythonpath=[broken])
  assert proc.returncode == 0 and proc.stderr == '' and proc.stdout.strip().isdigit()
  # A registry this hook cannot use (lm-eval changed): lm-eval still imports, with a warning.
  odd = _package(tmp_path / 'odd', 'lm_eval', {'__init__.py': '', 'api/__init__.py': '',
                                               'api/registry.py': 'model_registry = None\n'})
  proc = _run(hooked_python, 'import lm_eval.api.registry as r; print(r.model_registry)',
              pythonpath=[odd])
  assert proc.returncode == 0 and proc.stdout.strip() == 'None'
  assert 'could not register the lm-eval model' in proc.stderr


def _imported(importtime: str) -> dict[str, int]:
  """`-X importtime`'s report: module -> cumulative microseconds."""
  out = {}
  for line in importtime.splitlines():
    m = re.match(r'import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)', line)
    if m:
      out[m.group(3)] = int(m.group(2))
  return out


def test_start_up_imports_nothing_not_even_the_package(hooked_python):
  """`python -X importtime -c pass` with the hook imports no module more than without it: the
  hook's file runs as a module of its own, and the `cascade` package stays unimported, so a
  checkout's own `cascade` (cwd first on sys.path) is what `python -m cascade.main` runs there."""
  with_hook = _imported(_run(hooked_python, 'pass', args=['-X', 'importtime']).stderr)
  with _pth_moved(hooked_python, None):
    without = _imported(_run(hooked_python, 'pass', args=['-X', 'importtime']).stderr)
  assert 'site' in without
  assert set(with_hook) - set(without) == set(), set(with_hook) - set(without)
  proc = _run(hooked_python, textwrap.dedent("""\
      import sys
      print(sorted(m for m in sys.modules if m.split('.')[0] == 'cascade'),
            sum(bool(getattr(f, 'cascade_lm_eval_hook', False)) for f in sys.meta_path))
      """))
  assert proc.stdout.split() == ['[]', '1'], (proc.stdout, proc.stderr[-2000:])
