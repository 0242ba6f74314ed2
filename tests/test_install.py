"""The package installs cleanly: setup.py's editable and wheel builds (what `pip install -e .` and
`pip install .` run) raise no warning, the wheel ships the GPU descriptions launch.plan reads
(launch/gpu_targets, data inside the launch package), and both put cascade's lm-eval hook
(cascade-lm-eval.pth, `lm_eval --model cascade`) in site-packages."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from cascade import lm_eval_hook

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('cascade', 'foundation', 'models', 'rl', 'verifiers', 'envs', 'configs', 'launch',
            'tiny_world')

# The PEP 517/660 hooks pip calls (`build_editable`, `build_wheel`), one per process.
_BUILD = ('import sys; from setuptools import build_meta; '
          'print(getattr(build_meta, sys.argv[1])(sys.argv[2]))')


@pytest.mark.heavy
def test_the_builds_warn_nothing_and_the_wheel_has_the_gpu_targets(tmp_path):
  src = tmp_path / 'src'
  files = subprocess.run(['git', 'ls-files', 'setup.py', 'LICENSE', *PACKAGES], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
  for f in files:
    os.makedirs(src / os.path.dirname(f), exist_ok=True)
    shutil.copy(os.path.join(REPO, f), src / f)
  out = tmp_path / 'dist'
  out.mkdir()
  # Every warning is an error: setuptools' warnings (a data folder missing from `packages`,
  # deprecated options) would fail the build instead of printing a box.
  env = {k: v for k, v in os.environ.items() if not k.startswith('PYTHONWARN')}
  wheels = {}
  for hook in ('build_editable', 'build_wheel'):
    proc = subprocess.run([sys.executable, '-W', 'error', '-c', _BUILD, hook, str(out)], cwd=src,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (hook, proc.stderr[-3000:])
    wheels[hook] = zipfile.ZipFile(out / proc.stdout.strip().splitlines()[-1])
  # Both put cascade-lm-eval.pth at the root (site-packages), its line the hook's own, sorted
  # after the editable install's finder .pth whose import it needs.
  for hook, wheel in wheels.items():
    pths = sorted(n for n in wheel.namelist() if n.endswith('.pth'))
    assert lm_eval_hook.PTH_NAME in pths, (hook, pths)
    assert wheel.read(lm_eval_hook.PTH_NAME).decode() == lm_eval_hook.PTH_LINE + '\n'
    assert pths[-1] == lm_eval_hook.PTH_NAME, pths
  names = wheels['build_wheel'].namelist()
  assert 'launch/gpu_targets/h200.txtpb' in names
  assert 'launch/plan/cli.py' in names and 'cascade/main.py' in names
  assert 'models/families/qwen3.py' in names and 'cascade/suites/math.py' in names
  assert 'foundation/paths.py' in names and 'cascade/data/readers.py' in names
