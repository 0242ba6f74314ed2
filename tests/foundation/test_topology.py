"""foundation.topology: ICI neighbours on the inner mesh axes, slices over the data axis.

No TPU here: fake TPU device objects carry what `jax.experimental.mesh_utils`
reads (`platform`, `device_kind`, `coords`, `core_on_chip`, `slice_index`),
listed host by host as `jax.devices()` lists a TPU slice, so a plain reshape
would put a host's 2x2 block of chips on the tensor axis.
"""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from foundation import topology
from models import sharding


@dataclasses.dataclass(frozen=True)
class FakeTpu:
  id: int
  coords: tuple
  slice_index: int | None = None
  core_on_chip: int = 0
  process_index: int = 0
  platform: str = 'tpu'
  device_kind: str = 'TPU v4'


def fake_slice(grid=(4, 4, 4), host=(2, 2, 1), slice_index=None, first_id=0):
  """The chips of one slice of `grid`, listed host by host (each host a `host` block of chips)."""
  hosts = [range(0, g, h) for g, h in zip(grid, host)]
  out = []
  for p, (hz, hy, hx) in enumerate(itertools.product(*reversed(hosts))):
    for z, y, x in itertools.product(range(host[2]), range(host[1]), range(host[0])):
      out.append(FakeTpu(first_id + len(out), (hx + x, hy + y, hz + z), slice_index,
                         process_index=p))
  return out


def neighbours_along(arr, axis, grid):
  """Whether consecutive devices along `axis` are torus neighbours (one hop on one axis)."""
  moved = np.moveaxis(arr, axis, -1).reshape(-1, arr.shape[axis])
  for line in moved:
    for a, b in zip(line[:-1], line[1:]):
      hops = [min(abs(p - q), g - abs(p - q)) for p, q, g in zip(a.coords, b.coords, grid)]
      if sorted(hops) != [0, 0, 1]:
        return False
  return True


def test_inner_axis_on_neighbouring_chips():
  devices = fake_slice()
  for shape in [(4, 4, 4), (1, 16, 4), (2, 8, 4)]:
    arr = topology.device_array(shape, devices)
    assert arr.shape == shape and sorted(d.id for d in arr.ravel()) == list(range(64))
    assert neighbours_along(arr, 2, (4, 4, 4)), shape
    # What make_mesh did before: jax.devices() reshaped, a host's 2x2 chips on 'tensor'.
    assert not neighbours_along(np.asarray(devices, dtype=object).reshape(shape), 2, (4, 4, 4))
  # A 16-way tensor axis takes a whole 4x4 plane of the torus: its chips share one coordinate.
  arr = topology.device_array((1, 4, 16), devices)
  for row in arr.reshape(-1, 16):
    assert any(len({d.coords[k] for d in row}) == 1 for k in range(3))


def test_slices_over_the_data_axis():
  # Two 2x2x2 slices, listed interleaved: placement follows slice_index, not the list order.
  a = fake_slice((2, 2, 2), slice_index=0)
  b = fake_slice((2, 2, 2), slice_index=1, first_id=100)
  devices = [d for pair in zip(a, b) for d in pair]
  arr = topology.device_array((4, 2, 2), devices, slices=2)
  index = np.vectorize(lambda d: d.slice_index)(arr)
  assert (index[:2] == 0).all() and (index[2:] == 1).all()
  assert neighbours_along(arr, 2, (2, 2, 2)) and neighbours_along(arr, 1, (2, 2, 2))
  assert topology.dcn_axes(arr, sharding.MESH_AXES) == ('data',)
  assert topology.describe(arr, sharding.MESH_AXES).startswith(
      "2 slices joined over DCN: mesh axis 'data' (2 per slice x 2 slices)")
  # slices=None: as many as the devices span.
  assert (topology.device_array((4, 2, 2), devices) == arr).all()
  # The plain reshape of that list would mix the slices along every axis.
  plain = np.asarray(devices, dtype=object).reshape(4, 2, 2)
  assert set(topology.dcn_axes(plain, sharding.MESH_AXES)) == {'tensor'}


@pytest.mark.parametrize('shape,slices,message', [
    ((1, 4, 4), None, 'slices=2 does not divide the data axis (size 1'),
    ((4, 2, 2), 1, 'slices=1, but the 16 devices span 2 slice(s)'),
    ((4, 2, 2), 0, 'slices=0: must be an int >= 1'),
])
def test_slice_errors(shape, slices, message):
  devices = fake_slice((2, 2, 2), slice_index=0) + fake_slice((2, 2, 2), slice_index=1)
  with pytest.raises(topology.SliceError) as e:
    topology.device_array(shape, devices, slices)
  assert message in str(e.value) and '\n' not in str(e.value)


def test_cpu_devices_keep_the_plain_order():
  devices = jax.devices()
  assert len(devices) == 8
  for shape in [(2, 2, 2), (1, 2, 2, 2), (8, 1, 1)]:
    mesh = sharding.make_mesh(shape)
    assert mesh.devices.shape == shape
    assert list(mesh.devices.ravel()) == devices
  # Two slices of simulated devices: consecutive blocks, each half of the data axis.
  mesh = sharding.make_mesh((2, 2, 2), slices=2)
  assert list(mesh.devices.ravel()) == devices
  with pytest.raises(topology.SliceError, match='slices=4 does not divide the data axis'):
    sharding.make_mesh((2, 2, 2), slices=4)
  with pytest.raises(ValueError, match='needs 16 devices, have 8'):
    sharding.make_mesh((2, 4, 2))


_LIBTPU_CHECK = '''
import numpy as np
from jax.experimental import topologies
from foundation import topology
from models import sharding
devices = topologies.get_topology_desc(platform='tpu', topology_name='v5p:4x4x4',
                                       num_slices=2).devices
def far_steps(arr):  # steps along the last axis that are not one ICI hop
  out = 0
  for line in arr.reshape(-1, arr.shape[-1]):
    for a, b in zip(line[:-1], line[1:]):
      out += sorted(min(abs(p - q), 4 - abs(p - q)) for p, q in zip(a.coords, b.coords)) != [0, 0, 1]
  return out
arr = topology.device_array((2, 16, 4), devices)
plain = np.asarray(devices, dtype=object).reshape(2, 16, 4)
print(far_steps(arr), far_steps(plain), topology.dcn_axes(arr, sharding.MESH_AXES),
      sorted({d.slice_index for d in arr[0].ravel()}), sorted({d.slice_index for d in arr[1].ravel()}))
'''


@pytest.mark.heavy
def test_libtpu_topology_devices():
  """The AOT devices of two v5p:4x4x4 slices (libtpu: CASCADE_TPU_PYTHON, else skipped)."""
  import importlib.util
  import os
  import subprocess
  import sys
  python = os.environ.get('CASCADE_TPU_PYTHON') or (
      sys.executable if importlib.util.find_spec('libtpu') else None)
  if python is None:
    pytest.skip('no Python with libtpu: set CASCADE_TPU_PYTHON')
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=root)
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run([python, '-c', _LIBTPU_CHECK], cwd=root, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The tensor axis of 4: every step one hop (host-by-host reshape: 32 are not); the data
  # axis across the two slices, slice 0 then slice 1.
  assert proc.stdout.strip().splitlines()[-1] == "0 32 ('data',) [0] [1]"
