"""launch.plan on a multi-slice target: config.hardware.slices copies of hardware.topology.

The default tier checks the plan's mesh and header on simulated CPU devices.
The heavy tier runs docs/topology.md's command with the real TPU compiler:
it needs a Python whose JAX has libtpu (`pip install "jax[tpu]"` in a venv of
its own, with cascade's dependencies), named by CASCADE_TPU_PYTHON or this
interpreter itself; without one it is skipped.
"""

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

from cascade import config as config_lib
from launch import xm_launch
from launch.plan import report as plan_report
from launch.plan import targets as plan_targets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny(mesh, hardware):
  spec = importlib.util.spec_from_file_location('tiny_cfg', os.path.join(ROOT, 'configs/tiny.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.mesh.update(mesh)
  config.hardware = hardware
  return config_lib.validate(config)


def test_two_slices_on_simulated_devices():
  plan = _tiny(dict(shape=(2, 2, 2)), dict(platform='tpu', topology='v5p:2x2x1', slices=2))
  assert plan_targets.mesh_slices(plan) == 2          # config.mesh.slices unset: the hardware's
  tgt = plan_targets.target(plan, 'cpu')              # 8 simulated CPU devices (tests/conftest.py)
  mesh = plan_targets.make_mesh(plan, tgt.devices)
  assert mesh.devices.shape == (2, 2, 2)
  assert plan_targets.slices_line(plan, tgt) == (
      "slices: 2, simulated as 2 consecutive blocks of CPU devices along mesh axis 'data' "
      '(no DCN here)')
  assert plan_targets.slices_line(plan, tgt) in plan_report.plan_header(plan, tgt)
  one = _tiny(dict(shape=(2, 2, 2)), dict(platform='tpu', topology='v5p:2x2x2'))
  assert not any(l.startswith('slices:') for l in plan_report.plan_header(one, tgt))


def test_mesh_and_hardware_slices_must_agree():
  plan = _tiny(dict(shape=(2, 2, 2), slices=2), dict(platform='tpu', topology='v5p:2x2x2'))
  with pytest.raises(ValueError, match=r'^config.mesh.slices=2 but config.hardware.slices=1: '):
    plan_targets.mesh_slices(plan)


def test_xm_launch_refuses_several_slices_in_one_line():
  hw = {'platform': 'tpu', 'topology': 'v5p:4x4x4'}
  assert xm_launch.machine({**hw, 'slices': 1}) == xm_launch.machine(hw)
  with pytest.raises(ValueError, match=r'^config.hardware.slices=2: an XManager job here asks '
                     'for one slice'):
    xm_launch.machine({**hw, 'slices': 2})


def _tpu_python():
  named = os.environ.get('CASCADE_TPU_PYTHON')
  if named:
    return named
  return sys.executable if importlib.util.find_spec('libtpu') else None


def doc_command():
  """The multi-slice plan command of docs/topology.md (one `python -m launch.plan` line)."""
  with open(os.path.join(ROOT, 'docs', 'topology.md'), encoding='utf-8') as f:
    text = f.read()
  [command] = [line for line in text.splitlines()
               if line.startswith('python -m launch.plan') and "'slices': 2" in line]
  return shlex.split(command)


@pytest.mark.heavy
def test_doc_command_compiles_two_tpu_slices():
  python = _tpu_python()
  if python is None:
    pytest.skip('no Python with libtpu: set CASCADE_TPU_PYTHON')
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  env.pop('XLA_FLAGS', None)
  argv = doc_command()
  assert argv[:3] == ['python', '-m', 'launch.plan']
  proc = subprocess.run([python, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
  out = proc.stdout
  assert proc.returncode == 0, out + proc.stderr[-3000:]
  # libtpu's start-up lines on this host without TPU chips are held back (targets.native_
  # stderr_held), JAX's INFO lines off (cascade.exits.quiet_library_logs): nothing on stderr.
  assert proc.stderr == '', proc.stderr[-3000:]
  assert '2 slices of topology v5p:2x2x1 (DCN between them) from libtpu' in out
  assert ("slices: 2 slices joined over DCN: mesh axis 'data' (1 per slice x 2 slices) crosses "
          'them, the others stay in a slice') in out
  assert re.search(r'train step: .*\n.*fits', out) and 'every planned program fits' in out
