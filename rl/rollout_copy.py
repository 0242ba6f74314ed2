"""The sampler's copy of the policy's weights: each weight in the dtype its programs compute with.

A stage trains float32 master weights (`cascade.policies.master_dtype`) of a
model whose matmuls run in bfloat16: every matmul weight is converted to the
compute dtype where it is used, norms, routers and state-space constants are
read in float32. Handing the sampler the masters makes every decode step read 4
bytes per weight where 2 would do, and doubles the rollout layout's copy.

`cast_dtypes` finds, from the traced sampler programs themselves, the weights
whose every use is a conversion to one narrower dtype (reached through layout
operations only: reshapes, transposes, slices, gathers, sharding constraints,
and into loop, scan, remat, jit, shard_map and cond bodies). Casting exactly those
leaves once, before the programs run, gives the programs bit-identical inputs to
the conversions they would have made themselves, so the samples and log-probs
are unchanged; every other leaf (used in float32, or in a way the analysis does
not know) is left as it is. Knowing nothing of any model family, it covers a
user's own model the same way.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Primitives whose output is their first operand's values rearranged: a conversion after
# them equals the same conversion before them.
_LAYOUT = frozenset({
    'reshape', 'transpose', 'squeeze', 'expand_dims', 'broadcast_in_dim', 'slice',
    'dynamic_slice', 'gather', 'copy', 'copy_p', 'sharding_constraint', 'mesh_cast',
    'reshard', 'rev', 'device_put', 'optimization_barrier_p',
})

_UNSAFE = None


def _jaxpr(x):
  return getattr(x, 'jaxpr', x)


def _is_jaxpr(x) -> bool:
  return isinstance(x, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))


def _inner(eqn, i: int):
  """How operand `i` of `eqn` enters its inner programs: [(inner jaxpr, its invar, map from the
  inner jaxpr's outputs to `eqn`'s outputs the value may leave through)], or None if unknown."""
  p, name = eqn.params, eqn.primitive.name
  if name == 'while':
    cn, bn = p['cond_nconsts'], p['body_nconsts']
    cond, body = _jaxpr(p['cond_jaxpr']), _jaxpr(p['body_jaxpr'])
    if i < cn:
      return [(cond, cond.invars[i], {})]
    if i < cn + bn:
      return [(body, body.invars[i - cn], {})]   # leaving through the carry is not a layout
    return None
  if name == 'cond':
    if i == 0:
      return None
    return [(_jaxpr(b), _jaxpr(b).invars[i - 1], {k: k for k in range(len(eqn.outvars))})
            for b in p['branches']]
  if name == 'scan':
    body, carry = _jaxpr(p['jaxpr']), p['num_carry']
    return [(body, body.invars[i], {k: k for k in range(carry, len(eqn.outvars))})]
  subs = [v for v in p.values() if _is_jaxpr(v)]
  if len(subs) == 1 and len(_jaxpr(subs[0]).invars) == len(eqn.invars):
    sub = _jaxpr(subs[0])
    if len(sub.outvars) != len(eqn.outvars):
      return None
    return [(sub, sub.invars[i], {k: k for k in range(len(eqn.outvars))})]
  return None


def _sinks(jaxpr, var, seen: dict):
  """What becomes of `var` in `jaxpr`: (the dtypes it is converted to, the indices of the
  outputs it leaves through, rearranged only), or None if anything else uses it."""
  key = (id(jaxpr), id(var))
  if key in seen:
    return seen[key]
  seen[key] = _UNSAFE          # a cycle would be a bug in the jaxpr; be safe
  dtypes, leaves = set(), {k for k, v in enumerate(jaxpr.outvars) if v is var}
  for eqn in jaxpr.eqns:
    for i, x in enumerate(eqn.invars):
      if x is not var:
        continue
      name = eqn.primitive.name
      if name == 'convert_element_type':
        dtypes.add(np.dtype(eqn.params['new_dtype']))
        continue
      if name in _LAYOUT and i == 0:
        inner = [(jaxpr, eqn.outvars[0], None)]
      else:
        inner = _inner(eqn, i)
        if inner is None:
          return _UNSAFE
      for sub, v, out_map in inner:
        got = _sinks(sub, v, seen)
        if got is _UNSAFE:
          return _UNSAFE
        dtypes |= got[0]
        if out_map is None:           # the same jaxpr: already followed
          leaves |= got[1]
          continue
        for k in got[1]:              # left the inner program: follow it out here
          if k not in out_map:
            return _UNSAFE
          after = _sinks(jaxpr, eqn.outvars[out_map[k]], seen)
          if after is _UNSAFE:
            return _UNSAFE
          dtypes |= after[0]
          leaves |= after[1]
  seen[key] = (frozenset(dtypes), frozenset(leaves))
  return seen[key]


def cast_dtypes(programs: Sequence, leaves: Sequence) -> list:
  """Per leaf of the params: the dtype to store it in for these programs, or None to keep it.

  Args:
    programs: traced programs (ClosedJaxprs) whose first `len(leaves)` inputs are the params'
      leaves in `jax.tree.leaves` order.
    leaves: the params' leaves (arrays or ShapeDtypeStructs).

  A floating leaf is cast when, in every program, each of its uses is a conversion to the
  same dtype, narrower than its own; a leaf no program reads is kept.
  """
  out = []
  for n, leaf in enumerate(leaves):
    dtype = np.dtype(leaf.dtype)
    target = set()
    for prog in programs:
      j = _jaxpr(prog)
      got = _sinks(j, j.invars[n], {})
      if got is _UNSAFE or got[1]:     # a program output is the weight itself: keep it
        target = None
        break
      target |= got[0]
    ok = (target is not None and len(target) == 1 and jnp.issubdtype(dtype, jnp.floating))
    if ok:
      (t,) = target
      ok = jnp.issubdtype(t, jnp.floating) and t.itemsize < dtype.itemsize
    out.append(next(iter(target)) if ok else None)
  return out
