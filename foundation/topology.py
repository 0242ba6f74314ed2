"""Where each device sits in a mesh: ICI-aware placement inside a slice, slices over DCN.

    arr = topology.device_array((4, 2, 8), jax.devices(), slices=2)
    mesh = jax.sharding.Mesh(arr, ('data', 'fsdp', 'tensor'))

A mesh's axes run from the least to the most communicating one (data first,
tensor last; `models.sharding` names them). Chips of a TPU slice are linked to
their neighbours on a 2-D or 3-D torus (ICI). `jax.devices()` lists them host
by host, so reshaping that list puts a host's 2x2 block of chips on the tensor
axis, and its ring then takes a diagonal hop. `mesh_utils.create_device_mesh`
instead maps each mesh axis, innermost first, onto whole axes of the physical
torus (splitting one only where the sizes leave no other way), so the tensor
axis's collectives run between neighbouring chips.

A multi-slice job joins several slices through the data-center network (DCN),
much slower than ICI. The mesh's outermost axis ('data', whose only collective
is the once-a-step gradient reduction) is split over the slices: each slice
holds `data / slices` of it and every other axis stays inside one slice.
`mesh_utils.create_hybrid_device_mesh` builds each slice's mesh as above and
lays the slices out along that axis, grouping devices by their `slice_index`.

Where those helpers do not apply, the devices are reshaped in the order given
(the arrangement `models.sharding.make_mesh` always had):

* devices without torus coordinates: CPU devices (simulated ones included)
  and GPUs (`create_device_mesh` itself only sorts those by id);
* TPU devices that do not fill a cuboid of the torus (a subset of a slice);
* several slices of devices that carry no `slice_index` (CPU, GPU): a slice
  is then a consecutive block of the list (`jax.devices()` lists each
  process's devices together), which the reshape already keeps in one block
  of the data axis.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Sequence

import numpy as np
from jax.experimental import mesh_utils


class SliceError(ValueError):
  """The slice count does not fit the devices or the mesh shape."""


def slice_of(device: Any) -> int | None:
  """The slice a device belongs to (its `slice_index`), None when it names none (CPU, GPU)."""
  index = getattr(device, 'slice_index', None)
  return None if index is None else int(index)


def num_slices(devices: Sequence[Any]) -> int:
  """How many slices `devices` span (distinct `slice_index`; 1 when they name none)."""
  indices = {slice_of(d) for d in devices} - {None}
  return max(len(indices), 1)


def _on_torus(devices: Sequence[Any]) -> bool:
  """TPU devices whose coordinates fill a cuboid of the torus (what mesh_utils arranges)."""
  if any(getattr(d, 'platform', None) != 'tpu' or getattr(d, 'coords', None) is None
         for d in devices):
    return False
  coords = np.asarray([tuple(d.coords) for d in devices], dtype=np.int64)
  if coords.ndim != 2 or coords.shape[1] != 3:
    return False
  cores = {int(getattr(d, 'core_on_chip', 0)) for d in devices}
  places = {(tuple(c), getattr(d, 'core_on_chip', 0)) for c, d in zip(coords, devices)}
  extent = int(np.prod(coords.max(0) - coords.min(0) + 1)) * (max(cores) - min(cores) + 1)
  return len(places) == len(devices) == extent


def check_slices(shape: Sequence[int], devices: Sequence[Any], slices: int | None) -> int:
  """The slice count to lay the mesh out for, checked against the shape and the devices.

  Args:
    shape: the mesh's axis sizes (no -1), outermost (data) first.
    devices: the devices of the mesh.
    slices: the slice count asked for, or None for as many as the devices span.

  Returns:
    The slice count (>= 1).

  Raises:
    SliceError: a count < 1, one that differs from the devices' own (when they carry a
      `slice_index`), or one that does not divide the devices or the data axis.
  """
  found = num_slices(devices)
  named = any(slice_of(d) is not None for d in devices)
  if slices is None:
    slices = found
  if isinstance(slices, bool) or not isinstance(slices, (int, np.integer)) or slices < 1:
    raise SliceError(f'slices={slices!r}: must be an int >= 1')
  slices = int(slices)
  if named and slices != found:
    raise SliceError(f'slices={slices}, but the {len(devices)} devices span {found} slice(s) '
                     '(their slice_index)')
  if len(devices) % slices:
    raise SliceError(f'slices={slices} does not divide the {len(devices)} devices')
  if shape[0] % slices:
    raise SliceError(f'slices={slices} does not divide the data axis (size {shape[0]}, the '
                     'mesh shape\'s first entry): each slice holds an equal share of it')
  if named and slices > 1:
    sizes = collections.Counter(slice_of(d) for d in devices)
    if len(set(sizes.values())) != 1:
      raise SliceError(f'slices={slices}: the slices hold unequal device counts '
                       f'{dict(sorted(sizes.items()))}')
  return slices


def device_array(shape: Sequence[int], devices: Sequence[Any],
                 slices: int | None = None) -> np.ndarray:
  """The devices arranged as a mesh of `shape`: neighbours on the innermost axes, slices outermost.

  Args:
    shape: the mesh's axis sizes (no -1), least communicating first (data, ..., tensor).
    devices: the devices, as many as the shape's product.
    slices: slices the mesh spans (split over the data axis, the first); None: as many
      as the devices span (1 for devices without a `slice_index`).

  Returns:
    An object array of `shape` holding the devices (see the module docstring for
    which helper arranged them).

  Raises:
    ValueError: the shape's product is not the device count; SliceError (a
      ValueError) for a slice count that does not fit.
  """
  shape = tuple(int(s) for s in shape)
  devices = list(devices)
  if math.prod(shape) != len(devices):
    raise ValueError(f'mesh shape {shape} needs {math.prod(shape)} devices, have {len(devices)}')
  slices = check_slices(shape, devices, slices)
  named = any(slice_of(d) is not None for d in devices)
  if slices == 1:
    if _on_torus(devices):
      return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    if all(getattr(d, 'platform', None) == 'gpu' for d in devices):
      return mesh_utils.create_device_mesh(shape, devices)
    return np.asarray(devices, dtype=object).reshape(shape)
  if named:
    groups = collections.defaultdict(list)
    for d in devices:
      groups[slice_of(d)].append(d)
    if all(_on_torus(g) for g in groups.values()):
      ici = (shape[0] // slices,) + shape[1:]
      dcn = (slices,) + (1,) * (len(shape) - 1)
      return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                  allow_split_physical_axes=True)
    # Slices whose devices are not whole cuboids: each slice a block of the data axis, in
    # slice order, its devices in the order given.
    devices = [d for i in sorted(groups) for d in groups[i]]
  return np.asarray(devices, dtype=object).reshape(shape)


def dcn_axes(arr: np.ndarray, axis_names: Sequence[str]) -> tuple[str, ...]:
  """The mesh axes along which the devices of `arr` change slice (those that cross DCN)."""
  index = np.vectorize(lambda d: -1 if slice_of(d) is None else slice_of(d),
                       otypes=[np.int64])(arr)
  return tuple(name for i, name in enumerate(axis_names)
               if (np.diff(index, axis=i) != 0).any())


def describe(arr: np.ndarray, axis_names: Sequence[str]) -> str:
  """One line on how a mesh spans slices, e.g. for launch.plan's header."""
  n = num_slices(arr.ravel())
  if n == 1:
    return 'one slice (every mesh axis over ICI)'
  crossing = dcn_axes(arr, axis_names)
  sizes = dict(zip(axis_names, arr.shape))
  over = ', '.join(f'{a!r} ({sizes[a] // n} per slice x {n} slices)' if a == axis_names[0]
                   else repr(a) for a in crossing)
  return f'{n} slices joined over DCN: mesh axis {over} crosses them, the others stay in a slice'
