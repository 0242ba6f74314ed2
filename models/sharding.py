"""Logical-axis sharding: parameters and activations name their axes, rules map names to a mesh.

Every parameter carries `logical_axes` metadata (e.g. ('embed', 'mlp')) and
the main activations are constrained with `constrain(x, ('batch', 'length',
'embed'), rules)`. Only the rules, which come from the config, say which mesh axis
('data', 'fsdp', 'tensor', and 'expert' on a mixture-of-experts mesh) a
logical name is split over. They are a value (`as_rules`: a hashable tuple of
pairs), handed by each caller to what it calls: the model holds the ones its trace
uses (`Transformer.rules`), the programs outside it take them as a static argument;
no thread-local or other ambient state carries them (docs/model_families.md,
"Sharding rules"). The mesh is JAX's (`jax.set_mesh`, `use_mesh`). A mesh axis that
does not divide an array dimension, or that the mesh lacks, is dropped for that
array (replicated), so small models run on large meshes and one set of rules
serves both kinds of mesh.

Meshes have three axes ('data', 'fsdp', 'tensor'), four ('data', 'fsdp',
'expert', 'tensor') for expert parallelism, or five ('data', 'fsdp', 'expert',
'sequence', 'tensor') for context parallelism. On the expert axis the routed experts
are split over 'expert' (rule 'experts') and every other layer's rows are
data-parallel over it too (rule 'batch'), as in MaxText: the expert axis
holds different tokens outside the mixture-of-experts layers, and
`models.moe` gathers an expert group's tokens for its experts. The sequence axis
splits activations along their length (rule 'length'): `models.context` lays
a row's tokens out in zig-zag chunks over it and runs attention with the keys
and values gathered over it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from foundation import topology

MESH_AXES = ('data', 'fsdp', 'tensor')
# A mesh with an expert-parallel axis (a 4-entry `make_mesh` shape).
EXPERT_MESH_AXES = ('data', 'fsdp', 'expert', 'tensor')
# A mesh with a context-parallel axis too (a 5-entry `make_mesh` shape).
SEQUENCE_MESH_AXES = ('data', 'fsdp', 'expert', 'sequence', 'tensor')


def mesh_axes(rank: int) -> tuple[str, ...]:
  """The axis names of a mesh shape with `rank` (3, 4 or 5) sizes."""
  axes = {3: MESH_AXES, 4: EXPERT_MESH_AXES, 5: SEQUENCE_MESH_AXES}.get(rank)
  if axes is None:
    raise ValueError(f'a mesh shape has 3 sizes (data, fsdp, tensor), 4 (data, fsdp, expert, '
                     f'tensor) or 5 (data, fsdp, expert, sequence, tensor), not {rank}')
  return axes


# logical name -> mesh axis, tuple of mesh axes, or None (replicated).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ('batch', ('data', 'fsdp', 'expert')),   # 'expert': only on a mesh that has one
    ('length', 'sequence'),   # only on a mesh that has one (context parallelism)
    ('embed', 'fsdp'),
    ('vocab', 'tensor'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('head_dim', None),
    ('norm', None),
    ('cache_length', None),
    ('layers', None),   # the stacked blocks' leading axis (scanned over)
    # Mixture-of-experts layers: experts over the 'expert' mesh axis (where the mesh has
    # one), each expert's hidden width over 'tensor'.
    ('experts', 'expert'),
    ('moe_mlp', 'tensor'),
    # Mamba-2 mixers: heads over 'tensor'; the groups' B and C, each head's width and
    # state, and the convolution's taps whole.
    ('mamba_heads', 'tensor'),
    ('mamba_head_dim', None),
    ('mamba_groups', None),
    ('mamba_state', None),
    ('mamba_conv', None),
)

# The logical axes no parameter carries: only activations and KV caches name them. A rule
# for one of these moves no weight, so a sampler that changes only them (e.g. rows split over
# 'sequence' too) samples with the weights in the layout they were loaded in.
ACTIVATION_AXES = ('batch', 'length', 'cache_length')

# Logical rules as every traced function takes them: (logical name, mesh axes) pairs, a tuple
# of tuples, so hashable (a static argument of a jitted function).
Rules = tuple


def as_rules(rules: Iterable | None) -> Rules:
  """`rules` ((logical name, axes) pairs, the axes a mesh axis name, a list or tuple of
  them, or None), or DEFAULT_RULES for None, as the hashable tuple `constrain` and the
  model take."""
  if rules is None:
    return DEFAULT_RULES
  return tuple((str(k), tuple(v) if isinstance(v, list) else v) for k, v in rules)


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices=None, slices: int | None = None) -> Mesh:
  """Builds a ('data', 'fsdp', 'tensor'), ('data', 'fsdp', 'expert', 'tensor') or
  ('data', 'fsdp', 'expert', 'sequence', 'tensor') mesh.

  Args:
    shape: sizes of (data, fsdp, tensor), of (data, fsdp, expert, tensor) for a
      mesh with an expert-parallel axis, or of (data, fsdp, expert, sequence,
      tensor) for one with a context-parallel axis too; one -1 entry takes the
      remaining devices.
    devices: devices to use (default: all of `jax.devices()`).
    slices: slices (joined over DCN) the data axis is split over; None: as many as
      the devices span. `foundation.topology.device_array` arranges the devices (ICI
      neighbours on the inner axes; a plain reshape for CPU devices).

  Returns:
    A Mesh with Auto axis types (GSPMD propagation, the classic behaviour).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = list(shape)
  if len(shape) not in (3, 4, 5):
    raise ValueError(f'mesh shape {shape} must have 3 entries (data, fsdp, tensor), 4 '
                     '(data, fsdp, expert, tensor) or 5 (data, fsdp, expert, sequence, tensor)')
  axes = mesh_axes(len(shape))
  if shape.count(-1) > 1:
    raise ValueError(f'mesh shape {shape}: at most one -1')
  if -1 in shape:
    known = int(np.prod([s for s in shape if s != -1]))
    if len(devices) % known:
      raise ValueError(f'mesh shape {shape} does not divide {len(devices)} devices')
    shape[shape.index(-1)] = len(devices) // known
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f'mesh shape {tuple(shape)} needs {int(np.prod(shape))} devices, '
                     f'have {len(devices)}')
  arr = topology.device_array(shape, devices, slices)
  return Mesh(arr, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def override_rules(rules, changes) -> tuple:
  """`rules` (None: DEFAULT_RULES) with the logical axes in `changes` (pairs) mapped anew;
  names not in `rules` are added."""
  merged = dict(DEFAULT_RULES if rules is None else rules)
  merged.update((str(k), tuple(v) if isinstance(v, list) else v) for k, v in changes)
  return tuple(merged.items())


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None):
  """Sets the mesh to trace for (jax.set_mesh); nothing for None. The logical rules are no part
  of it: they travel as a value, `constrain`'s argument and the model's `rules` attribute."""
  if mesh is None:
    yield
  else:
    with jax.set_mesh(mesh):
      yield


def _mesh_axis_sizes(mesh) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes if hasattr(mesh, 'axis_sizes')
                  else mesh.devices.shape))


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh=None, rules=None) -> P:
  """Maps logical axis names to a PartitionSpec.

  Args:
    names: one logical name (or None) per array dimension.
    shape: the array shape; with `mesh`, mesh axes that do not divide a
      dimension are dropped for it.
    mesh: a Mesh or AbstractMesh (for divisibility).
    rules: logical rules (None: DEFAULT_RULES).

  Returns:
    The PartitionSpec; each mesh axis is used at most once.
  """
  table = dict(DEFAULT_RULES if rules is None else rules)
  sizes = _mesh_axis_sizes(mesh) if mesh is not None else None
  used: set[str] = set()
  out = []
  for i, name in enumerate(names):
    axes = table.get(name) if name is not None else None
    if axes is None:
      out.append(None)
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    keep = []
    for a in axes:
      if a in used:
        continue
      if sizes is not None:
        if a not in sizes:
          continue
        prod = int(np.prod([sizes[x] for x in keep + [a]]))
        if shape is not None and shape[i] % prod:
          continue
      keep.append(a)
    used.update(keep)
    out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
  return P(*out)


def mesh_platform() -> str:
  """The platform of the devices of the mesh being traced for (`jax.set_mesh`), else of the
  default backend: a TPU topology planned from a CPU host is 'tpu', so kernels chosen by it
  (splash, paged attention, the megablox grouped matmul) compile as real kernels there."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, 'abstract_device', None) if mesh is not None and not mesh.empty else None
  return getattr(device, 'platform', None) or jax.default_backend()


def batch_leaf_names(ndim: int) -> tuple:
  """The logical axes of a train batch's leaf of rank `ndim`: rows ('batch'), then the tokens
  along a row ('length'; every [B, L, ...] field of a batch is token-aligned), then whole."""
  return ('batch',) if ndim < 2 else ('batch', 'length') + (None,) * (ndim - 2)


def batch_leaf_sharding(shape: Sequence[int], mesh, rules=None) -> NamedSharding:
  """Where a train batch's leaf of `shape` lives on `mesh`: rows over the 'batch' rule's axes
  and, on a mesh with a sequence axis, its length over 'sequence' (`batch_leaf_names`), so no
  device holds a whole [rows, length, ...] field; an axis that does not divide stays whole."""
  shape = tuple(shape)
  return NamedSharding(mesh, logical_to_spec(batch_leaf_names(len(shape)), shape, mesh, rules))


def split_ways(n: int, name: str, mesh: Mesh | None, rules=None) -> int:
  """How many ways a dimension of `n` along logical axis `name` splits over `mesh` (a Mesh or
  AbstractMesh: the mesh axes of its rule that divide it; 1 without a mesh)."""
  if mesh is None:
    return 1
  spec = logical_to_spec((name,), (n,), mesh, rules)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  sizes = _mesh_axis_sizes(mesh)
  return int(np.prod([sizes[a] for a in axes]))


def batch_shards(mesh: Mesh | None, rules=None) -> int:
  """How many ways the 'batch' rule splits rows on `mesh` (1 without a mesh)."""
  if mesh is None:
    return 1
  spec = logical_to_spec(('batch',), None, mesh, rules)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  return int(np.prod([sizes[a] for a in axes]))


def constrain(x: jax.Array, names: Sequence[str | None], rules: Rules) -> jax.Array:
  """with_sharding_constraint by logical names under `rules` (the caller's: the model's
  `rules`, a program's own); a no-op when no mesh is set."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh, rules))


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def state_specs(state, mesh=None, rules=None):
  """PartitionSpecs for an nnx.State (or abstract state), from `logical_axes` metadata."""
  def spec(v):
    names = v.get_metadata().get('logical_axes')
    shape = v.value.shape
    if names is None:
      names = (None,) * len(shape)
    return v.replace(logical_to_spec(names, shape, mesh, rules))
  return jax.tree.map(spec, state, is_leaf=_is_var)


def state_shardings(state, mesh: Mesh, rules=None):
  """NamedShardings (same tree as `state`) for the parameters in `state`."""
  specs = state_specs(state, mesh, rules)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def create_sharded(make_model, mesh: Mesh | None, rules=None):
  """Creates an NNX module with its parameters born sharded on `mesh`.

  Args:
    make_model: zero-argument callable returning the module.
    mesh: target mesh, or None for a plain (single-device) module.
    rules: logical rules (None: DEFAULT_RULES).

  Returns:
    The module; no full unsharded copy is ever materialised.
  """
  if mesh is None:
    return make_model()
  abstract = nnx.eval_shape(make_model)
  graphdef, abs_state = nnx.split(abstract)
  shardings = state_shardings(abs_state, mesh, rules)

  init = jax.jit(lambda: nnx.state(make_model()), out_shardings=shardings)
  with use_mesh(mesh):
    state = init()
  return nnx.merge(graphdef, state)


def shard_state(state, mesh: Mesh, rules=None):
  """device_puts every leaf of an nnx.State to its logical sharding on `mesh`."""
  return jax.device_put(state, state_shardings(state, mesh, rules))


def to_host(x) -> np.ndarray:
  """A device array as one host numpy array, gathered over processes when it spans several."""
  if getattr(x, 'is_fully_addressable', True):
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
