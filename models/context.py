"""Context parallelism: a row's tokens split along their length over the mesh's sequence axis.

Where the logical rules (the caller's, `models.sharding`) map 'length' to mesh axes (the
'sequence' axis of a 5-axis mesh) of n > 1 devices and a row's length T is a multiple of
2n, a forward without a cache runs context-parallel:

  * the row is cut into 2n chunks of C = T / (2n) tokens and laid out in
    zig-zag order: shard i holds chunks i and 2n - 1 - i. Under causal
    attention chunk c has c + 1 chunks of keys to look at, so every shard does
    (i + 1) + (2n - i) = 2n + 1 chunk-pairs of work, where a contiguous split
    gives the last shard 2n - 1 and the first 1;
  * `models.transformer` moves the embedded tokens, positions and segment ids
    into that order once (`to_zigzag`) and the final hidden states back
    (`from_zigzag`), so everything after the model (chunked log-probs, losses)
    sees rows in their own order, still split along T;
  * `models.attention` runs each shard's queries against keys and values
    all-gathered over the axis, its causal rule on the zig-zag token indices
    (`zigzag_index`, `zigzag_order`).

Per-token layers (norms, MLPs, routed experts) do not care where a token sits.
A Mamba-2 mixer does: `models.mamba` scans each shard's two chunks from a zero
state, all-gathers small per-chunk summaries (conv tail, decay, final state),
folds them in the chunks' sequence order into the state and conv window entering
each chunk, and adds their part to the chunk's outputs.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models import sharding


def axis(length: int, rules: sharding.Rules):
  """The mesh axis (a name or a tuple of names) that splits a row of `length` tokens
  context-parallel under the mesh traced for and `rules`, or None when none does (no mesh, no
  'length' rule, an axis of one device, or a length that is not a multiple of 2n)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return None
  spec = sharding.logical_to_spec(('length',), (length,), mesh, rules)[0]
  if spec is None:
    return None
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  names = (spec,) if isinstance(spec, str) else tuple(spec)
  n = int(np.prod([sizes[a] for a in names]))
  if n == 1 or length % (2 * n):
    return None
  return spec


def shards(length: int, rules: sharding.Rules) -> int:
  """How many context-parallel shards a row of `length` tokens is split over under `rules`
  (1: none)."""
  spec = axis(length, rules)
  if spec is None:
    return 1
  mesh = jax.sharding.get_abstract_mesh()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  return int(np.prod([sizes[a] for a in ((spec,) if isinstance(spec, str) else spec)]))


def _chunks_of(shard, n: int):
  """The two chunks shard `shard` (int or traced) of n holds: (shard, 2n - 1 - shard)."""
  return shard, 2 * n - 1 - shard


def zigzag_order(length: int, n: int) -> np.ndarray:
  """[length] int32: the row's token index at each place of the zig-zag layout (shard 0's
  two chunks, then shard 1's, ...)."""
  c = length // (2 * n)
  chunks = np.asarray([k for i in range(n) for k in _chunks_of(i, n)])
  return (chunks[:, None] * c + np.arange(c)[None]).reshape(-1).astype(np.int32)


def zigzag_index(length: int, n: int, shard) -> jax.Array:
  """[length / n] int32: the token indices shard `shard` (traced, e.g. `axis_index`) holds."""
  c = length // (2 * n)
  first, second = _chunks_of(shard, n)
  local = jnp.arange(c, dtype=jnp.int32)
  return jnp.concatenate([first * c + local, second * c + local]).astype(jnp.int32)


def _permute(x, names: Sequence[str | None], to_zigzag: bool, rules: sharding.Rules):
  """x moved between contiguous and zig-zag layout along its 'length' dimension.

  Contiguous shard d holds chunks 2d and 2d + 1; zig-zag shard i holds chunks i and
  2n - 1 - i, one even and one odd. The even chunks form one permutation of the shards and
  the odd ones another (chunk c's zig-zag shard is c or 2n - 1 - c, distinct over the even
  c and over the odd c), so the move is two `ppermute`s of half a shard each.
  """
  dim = list(names).index('length')
  length = x.shape[dim]
  spec_axis = axis(length, rules)
  n = shards(length, rules)
  mesh = jax.sharding.get_abstract_mesh()
  spec = list(sharding.logical_to_spec(names, x.shape, mesh, rules))
  spec[dim] = spec_axis
  spec = P(*spec)
  home = lambda c: c if c < n else 2 * n - 1 - c           # chunk c's zig-zag shard
  even = [(home(2 * d), d) for d in range(n)]             # (source, destination) pairs
  odd = [(home(2 * d + 1), d) for d in range(n)]
  if to_zigzag:
    even, odd = [(b, a) for a, b in even], [(b, a) for a, b in odd]

  def local(x):
    first, second = jnp.split(x, 2, axis=dim)
    parity = jax.lax.axis_index(spec_axis) % 2
    if to_zigzag:                  # holding chunks 2d (even), 2d + 1 (odd)
      e = jax.lax.ppermute(first, spec_axis, even)
      o = jax.lax.ppermute(second, spec_axis, odd)
      # Shard i's first chunk is i itself: even on an even shard.
      return jnp.where(parity == 0, jnp.concatenate([e, o], dim), jnp.concatenate([o, e], dim))
    e = jnp.where(parity == 0, first, second)
    o = jnp.where(parity == 0, second, first)
    return jnp.concatenate([jax.lax.ppermute(e, spec_axis, even),
                            jax.lax.ppermute(o, spec_axis, odd)], dim)

  return jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=spec,
                       check_vma=False)(x)


def to_zigzag(x: jax.Array, names: Sequence[str | None], rules: sharding.Rules) -> jax.Array:
  """x (logical axes `names`, one of them 'length') in zig-zag layout; x itself when the
  row is not split context-parallel under `rules`."""
  if shards(x.shape[list(names).index('length')], rules) == 1:
    return x
  return _permute(x, names, True, rules)


def from_zigzag(x: jax.Array, names: Sequence[str | None], rules: sharding.Rules) -> jax.Array:
  """The inverse of `to_zigzag`."""
  if shards(x.shape[list(names).index('length')], rules) == 1:
    return x
  return _permute(x, names, False, rules)
