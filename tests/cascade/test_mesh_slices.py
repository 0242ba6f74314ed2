"""config.mesh.slices and config.hardware.slices: parsed, checked in one line, used by the run."""

import importlib.util
import os

import pytest

from cascade import config as config_lib
from cascade import runner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny(**mesh):
  spec = importlib.util.spec_from_file_location('tiny_cfg', os.path.join(ROOT, 'configs/tiny.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.mesh.update(mesh)
  return config


def test_slices_parse_and_reach_the_mesh():
  plan = config_lib.validate(_tiny(shape=(2, 2, 2), slices=2))
  assert plan.mesh_slices == 2 and plan.hardware.slices == 1
  mesh = runner._mesh(plan)
  assert mesh.devices.shape == (2, 2, 2)
  assert config_lib.validate(_tiny(shape=(2, 2, 2))).mesh_slices is None


@pytest.mark.parametrize('mesh,message', [
    (dict(shape=(2, 2, 2), slices=4),
     'config.mesh.slices=4: does not divide the data axis (config.mesh.shape[0]=2)'),
    (dict(shape=None, slices=2), 'config.mesh.slices=2: needs a mesh'),
    (dict(shape=(2, 2, 2), slices=0), 'config.mesh.slices=0: must be an int >= 1'),
])
def test_config_refuses(mesh, message):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(_tiny(**mesh))
  assert str(e.value).startswith(message) and '\n' not in str(e.value)


def test_run_refuses_slices_the_devices_cannot_make():
  plan = config_lib.validate(_tiny(shape=(-1, 1, 1), slices=3))   # 8 simulated devices
  with pytest.raises(config_lib.ConfigError, match=r'^config.mesh.slices=3: slices=3 does not '
                     'divide the 8 devices$'):
    runner._mesh(plan)
