"""tests/conftest.py keeps a user's XLA_FLAGS and adds the 8 simulated devices the sharding tests
need, unless the user already chose a device count."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = ('import os, runpy; runpy.run_path("tests/conftest.py"); import jax; '
         'print(jax.device_count(), os.environ["XLA_FLAGS"])')


@pytest.mark.parametrize('user,devices,flags', [
    (None, 8, '--xla_force_host_platform_device_count=8'),
    ('--xla_dump_hlo_as_text', 8, '--xla_dump_hlo_as_text --xla_force_host_platform_device_count=8'),
    ('--xla_force_host_platform_device_count=2', 2, '--xla_force_host_platform_device_count=2'),
])
def test_user_xla_flags_are_kept_and_the_device_count_added(user, devices, flags):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env.update(JAX_PLATFORMS='cpu')
  if user is not None:
    env['XLA_FLAGS'] = user
  out = subprocess.run([sys.executable, '-c', PROBE], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=300, check=True).stdout.strip().splitlines()[-1]
  assert out == f'{devices} {flags}'
