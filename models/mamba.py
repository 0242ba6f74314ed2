"""Mamba-2 mixer (Nemotron-H's), in Flax NNX: chunked SSD scan, segments, recurrent decode.

Shape letters: B batch, T length, D embed, H = mamba_heads, P = mamba_head_dim,
G = mamba_groups (R = H // G heads share one group's B and C; head h uses group
h // R), N = mamba_state, K = mamba_conv, L = mamba_chunk, Q = T / L chunks.

Computation (as transformers' `NemotronHMamba2Mixer` computes it):

  z, x, B, C, dt_raw = in-projections of the input
  x, B, C = silu(causal depthwise conv over the last K positions of [x, B, C] + bias)
  dt = clip(softplus(dt_raw + dt_bias), mamba_dt_min, mamba_dt_max);  A = -exp(A_log)
  h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        (per head, state [P, N])
  y_t = h_t C_t + D x_t
  y = gated RMSNorm(y, z): y * silu(z), RMS-normalised over each of the G groups of
      H * P / G channels in float32, times `norm` (HF's norm_before_gate=False)
  out = y @ out_proj

State and scan math run in float32, the projections in the compute dtype. A pass
over T > 1 positions uses the chunked state-space-duality form: within each chunk
of L positions a masked quadratic form, across chunks a `lax.scan` carrying the
[B, H, P, N] state, so memory is linear in T. A pass over one position (decode)
is the plain recurrence on the carried `MambaState`. Both clamp dt alike (HF's
one-token path does not clamp; its chunked path clamps to (time_step_min, inf),
so a converted Nemotron-H sets mamba_dt_min = time_step_min).

Segments (`segment_ids` int32 [B, T], 0 = padding): a padding token is
transparent: it changes no state (dt = 0, no x/B/C input, and it is skipped in
the convolution's window) and its output is zero. A token sees (through the
convolution and the state) only earlier tokens of its own segment: where a
nonzero segment follows a different nonzero segment (padding between them or
not), convolution window and state restart from zero; the first nonzero segment
of a row continues the incoming state. With a state, a call returns the state
after each row's last nonzero-segment token (a right-padded batched prefill's
per-row state); a row with no such token keeps its incoming state.

Context parallelism (`models.context`): a call without a state on a row that the
active mesh splits along T over the sequence axis takes the row in zig-zag chunk
order (as `models.transformer` lays it out) and scans each shard's two chunks
from a zero start; per-chunk summaries (the last K - 1 real conv inputs, the
segments at the chunk's ends, its summed log decay per head and its final state)
are all-gathered over the axis and folded in sequence order into the conv
window and state entering each chunk (nothing crosses a segment start); the
entering state's part of a chunk's outputs is added after its scan
(`_context_parallel`). Equal to the unsharded mixer, forward and backward.

Parameters and HF's tensors (a mixer's `in_proj.weight` [2HP + 2GN + H, D],
rows ordered [z (HP), x (HP), B (GN), C (GN), dt (H)]; torch Linear weights are
[out, in]; a flat channel index of a head axis and its width is h * P + p, of a
group axis and the state g * N + n; W.T is the transpose):

  z_proj  [D, H, P]  = in_proj.weight[0 : HP].T.reshape(D, H, P)
  x_proj  [D, H, P]  = in_proj.weight[HP : 2HP].T.reshape(D, H, P)
  b_proj  [D, G, N]  = in_proj.weight[2HP : 2HP + GN].T.reshape(D, G, N)
  c_proj  [D, G, N]  = in_proj.weight[2HP + GN : 2HP + 2GN].T.reshape(D, G, N)
  dt_proj [D, H]     = in_proj.weight[2HP + 2GN : 2HP + 2GN + H].T
  conv1d.weight [HP + 2GN, 1, K], channels ordered [x (HP), B (GN), C (GN)]:
  conv_x  [K, H, P]  = conv1d.weight[0 : HP, 0, :].T.reshape(K, H, P)
  conv_b  [K, G, N]  = conv1d.weight[HP : HP + GN, 0, :].T.reshape(K, G, N)
  conv_c  [K, G, N]  = conv1d.weight[HP + GN : HP + 2GN, 0, :].T.reshape(K, G, N)
  (tap k multiplies the input k - (K - 1) positions away: tap K - 1 is the current one)
  conv_x_bias [H, P] = conv1d.bias[0 : HP].reshape(H, P)      (if mamba_conv_bias)
  conv_b_bias [G, N] = conv1d.bias[HP : HP + GN].reshape(G, N)
  conv_c_bias [G, N] = conv1d.bias[HP + GN : HP + 2GN].reshape(G, N)
  dt_bias [H] = dt_bias;  A_log [H] = A_log;  D [H] = D        (the same vectors)
  norm    [H, P]     = norm.weight.reshape(H, P)
  out_proj [H, P, D] = out_proj.weight.T.reshape(H, P, D)      (out_proj.weight [D, HP])

HF's `use_bias` (biases on in_proj / out_proj; False in Nemotron-H) has no
counterpart here. `MambaState.conv` keeps the conv inputs time-major, [B, K - 1,
HP + 2GN], channels in conv1d's order (HF's cache keeps them channels-first).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import config as config_lib
from models import context
from models import sharding
from models.layers import _matmul, _param

# dt_bias initialisation (HF's time_step_min / time_step_max / time_step_floor): a time
# step drawn log-uniformly in [DT_INIT_MIN, DT_INIT_MAX], floored, inverse-softplus'ed.
DT_INIT_MIN = 0.001
DT_INIT_MAX = 0.1
DT_INIT_FLOOR = 1e-4

_HEADS = ('batch', 'length', 'mamba_heads', 'mamba_head_dim')
_GROUPS = ('batch', 'length', 'mamba_groups', 'mamba_state')
_CHANNELS = ('batch', 'length', None)   # x, B and C joined (`_joins_channels`)


class MambaState(NamedTuple):
  """A Mamba-2 mixer's recurrent state; a pytree.

  Attributes:
    conv: [B, K - 1, H * P + 2 * G * N] the last K - 1 convolution inputs (oldest
      first), channels ordered [x, B, C], in the compute dtype.
    ssm: [B, H, P, N] float32 state of each head.
  """
  conv: jax.Array
  ssm: jax.Array


STATE_AXES = MambaState(conv=('batch', None, None),
                        ssm=('batch', 'mamba_heads', 'mamba_head_dim', 'mamba_state'))


def init_state(cfg: config_lib.ModelConfig, batch: int, dtype=None,
               rules: sharding.Rules = sharding.DEFAULT_RULES) -> MambaState:
  """A zero state for `batch` rows (conv in `dtype`, default the compute dtype; ssm float32),
  laid out by `rules`."""
  dtype = cfg.jnp_dtype if dtype is None else dtype
  conv = jnp.zeros((batch, cfg.mamba_conv - 1, cfg.mamba_conv_dim), dtype)
  ssm = jnp.zeros((batch, cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_state), jnp.float32)
  return MambaState(conv=sharding.constrain(conv, STATE_AXES.conv, rules),
                    ssm=sharding.constrain(ssm, STATE_AXES.ssm, rules))


class Mamba2Mixer(nnx.Module):
  """Nemotron-H's Mamba-2 mixer: [B, T, D] -> [B, T, D] (see the module docstring)."""

  def __init__(self, cfg: config_lib.ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h, p = cfg.embed_dim, cfg.mamba_heads, cfg.mamba_head_dim
    g, n, k = cfg.mamba_groups, cfg.mamba_state, cfg.mamba_conv
    pd = cfg.jnp_param_dtype
    self.z_proj = _param(rngs, (d, h, p), ('embed', 'mamba_heads', 'mamba_head_dim'), pd)
    self.x_proj = _param(rngs, (d, h, p), ('embed', 'mamba_heads', 'mamba_head_dim'), pd)
    self.b_proj = _param(rngs, (d, g, n), ('embed', 'mamba_groups', 'mamba_state'), pd)
    self.c_proj = _param(rngs, (d, g, n), ('embed', 'mamba_groups', 'mamba_state'), pd)
    self.dt_proj = _param(rngs, (d, h), ('embed', 'mamba_heads'), pd)
    self.conv_x = _param(rngs, (k, h, p), ('mamba_conv', 'mamba_heads', 'mamba_head_dim'), pd)
    self.conv_b = _param(rngs, (k, g, n), ('mamba_conv', 'mamba_groups', 'mamba_state'), pd)
    self.conv_c = _param(rngs, (k, g, n), ('mamba_conv', 'mamba_groups', 'mamba_state'), pd)
    if cfg.mamba_conv_bias:
      self.conv_x_bias = nnx.Param(jnp.zeros((h, p), pd),
                                   logical_axes=('mamba_heads', 'mamba_head_dim'))
      self.conv_b_bias = nnx.Param(jnp.zeros((g, n), pd),
                                   logical_axes=('mamba_groups', 'mamba_state'))
      self.conv_c_bias = nnx.Param(jnp.zeros((g, n), pd),
                                   logical_axes=('mamba_groups', 'mamba_state'))
    u = jax.random.uniform(rngs.params(), (h,), jnp.float32)
    dt = jnp.exp(u * (math.log(DT_INIT_MAX) - math.log(DT_INIT_MIN)) + math.log(DT_INIT_MIN))
    dt = jnp.maximum(dt, DT_INIT_FLOOR)
    inv_softplus = dt + jnp.log(-jnp.expm1(-dt))
    self.dt_bias = nnx.Param(inv_softplus.astype(pd), logical_axes=('mamba_heads',))
    self.A_log = nnx.Param(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)).astype(pd),
                           logical_axes=('mamba_heads',))
    self.D = nnx.Param(jnp.ones((h,), pd), logical_axes=('mamba_heads',))
    self.norm = nnx.Param(jnp.ones((h, p), pd), logical_axes=('mamba_heads', 'mamba_head_dim'))
    self.out_proj = _param(rngs, (h, p, d), ('mamba_heads', 'mamba_head_dim', 'embed'), pd)

  def __call__(self, x: jax.Array, segment_ids: jax.Array, state: MambaState | None = None, *,
               rules: sharding.Rules = sharding.DEFAULT_RULES
               ) -> tuple[jax.Array, MambaState | None]:
    """Mixes a sequence.

    Args:
      x: [B, T, D] input (cast to the compute dtype).
      segment_ids: int32 [B, T]; 0 = padding (see the module docstring).
      state: the incoming recurrent state, or None (zeros, and no state is returned).
      rules: the logical rules the caller traces with (`models.sharding`).

    Returns:
      (y [B, T, D] in the compute dtype, zero at padding; the state after each row's
      last nonzero-segment token, or None when `state` is None).
    """
    cfg = self.cfg
    cd = cfg.jnp_dtype
    x = x.astype(cd)
    # Over T > 1 positions (training, prefill), where neither heads nor groups are split: one
    # matmul for z, x, B, C and dt (in_proj's own layout), and x, B and C convolved as one
    # [B, T, HP + 2GN] tensor. A fifth of the projections' matmuls and a third of the
    # convolution's gathers and selects, forward and backward: less for the TPU compiler to
    # build per sublayer. A decode step keeps the parts: joining would copy the five weights
    # into one on every step, for one token's matmul.
    joined = x.shape[1] > 1 and _joins_channels(cfg, rules)
    if joined:
      hp, gn = cfg.mamba_heads * cfg.mamba_head_dim, cfg.mamba_groups * cfg.mamba_state
      w = jnp.concatenate([p.value.reshape(p.value.shape[0], -1).astype(cd) for p in (
          self.z_proj, self.x_proj, self.b_proj, self.c_proj, self.dt_proj)], axis=1)
      zxbcdt = _matmul(x, w)                                          # [B, T, 2HP + 2GN + H]
      z = sharding.constrain(zxbcdt[..., :hp].reshape(*x.shape[:2], cfg.mamba_heads,
                                                      cfg.mamba_head_dim), _HEADS, rules)
      parts = (sharding.constrain(zxbcdt[..., hp:2 * hp + 2 * gn], _CHANNELS, rules),)
      dt_raw = zxbcdt[..., 2 * hp + 2 * gn:]
    else:
      z = sharding.constrain(_matmul(x, self.z_proj.value.astype(cd)), _HEADS, rules)
      parts = (sharding.constrain(_matmul(x, self.x_proj.value.astype(cd)), _HEADS, rules),
               sharding.constrain(_matmul(x, self.b_proj.value.astype(cd)), _GROUPS, rules),
               sharding.constrain(_matmul(x, self.c_proj.value.astype(cd)), _GROUPS, rules))
      dt_raw = _matmul(x, self.dt_proj.value.astype(cd))              # [B, T, H]
    dt_raw = sharding.constrain(dt_raw, ('batch', 'length', 'mamba_heads'), rules)
    split = (lambda u: _split_conv(cfg, u[0])) if joined else tuple
    if x.shape[1] == 1:
      real, run = segment_ids != 0, None
    else:
      real, run = _runs(segment_ids)

    if state is None:
      prefix = None
      h0 = jnp.zeros((x.shape[0], cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_state),
                     jnp.float32)
    else:
      conv = state.conv.astype(cd)
      prefix = (conv,) if joined else _split_conv(cfg, conv)
      h0 = state.ssm.astype(jnp.float32)
    convs = self._conv_params(joined)

    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + self.dt_bias.value.astype(jnp.float32))
    dt = jnp.where(real[..., None], jnp.clip(dt, cfg.mamba_dt_min, cfg.mamba_dt_max), 0.0)
    a = -jnp.exp(self.A_log.value.astype(jnp.float32))

    if run is None:  # One position: the recurrence itself.
      outs, conv_state = _conv_step(parts, convs, prefix, real[:, 0])
      xs, bs, cs = split(outs)
      h = (jnp.exp(dt[:, 0] * a)[:, :, None, None] * h0
           + _outer(xs[:, 0] * dt[:, 0, :, None], bs[:, 0], cfg.mamba_groups))
      y = _contract_state(cs[:, 0], h, cfg.mamba_groups)[:, None]      # [B, 1, H, P]
    elif state is None and context.shards(x.shape[1], rules) > 1:
      # Context parallel: the row arrives split along T in zig-zag order (models.context).
      xs, y = _context_parallel(parts, convs, dt, a, segment_ids, cfg.mamba_chunk, split,
                                rules)
    else:
      outs, conv_state = _conv_scan(parts, convs, prefix, real, run,
                                    want_state=state is not None)
      xs, bs, cs = split(outs)
      xs = sharding.constrain(xs, _HEADS, rules)
      y, h = _ssd(xs, dt, a, bs, cs, run, h0, cfg.mamba_chunk)
    y = y + self.D.value.astype(jnp.float32)[:, None] * xs
    y = sharding.constrain(y, _HEADS, rules)

    y = _gated_norm(y, z, self.norm.value, cfg.mamba_groups, cfg.norm_eps).astype(cd)
    y = sharding.constrain(y, _HEADS, rules)
    out = _matmul(y, self.out_proj.value.astype(cd), contract=2)
    out = jnp.where(real[..., None], out, jnp.zeros((), cd))
    out = sharding.constrain(out, ('batch', 'length', 'embed'), rules)
    if state is None:
      return out, None
    new_state = MambaState(
        conv=sharding.constrain(_join_conv(conv_state), STATE_AXES.conv, rules),
        ssm=sharding.constrain(h, STATE_AXES.ssm, rules))
    return out, new_state

  def _conv_params(self, joined: bool):
    """((weight [K, ...] float32, bias [...] float32 or None) for x, B and C), or for the
    three joined as [K, HP + 2GN] (`joined`)."""
    f32 = lambda p: p.value.astype(jnp.float32)
    out = []
    for w, bias in (('conv_x', 'conv_x_bias'), ('conv_b', 'conv_b_bias'),
                    ('conv_c', 'conv_c_bias')):
      out.append((f32(getattr(self, w)),
                  f32(getattr(self, bias)) if self.cfg.mamba_conv_bias else None))
    if not joined:
      return tuple(out)
    k = out[0][0].shape[0]
    weight = jnp.concatenate([w.reshape(k, -1) for w, _ in out], axis=1)
    bias = (None if out[0][1] is None
            else jnp.concatenate([b.reshape(-1) for _, b in out], axis=0))
    return ((weight, bias),)


def _joins_channels(cfg: config_lib.ModelConfig, rules: sharding.Rules) -> bool:
  """Whether the mixer projects and convolves x, B and C as one tensor of HP + 2GN channels:
  where the mesh traced for, under `rules`, splits neither the heads nor the groups (else
  x's channels would be split by head and B's and C's by group, which one channel axis
  cannot hold), and not on GPUs."""
  if sharding.mesh_platform() == 'gpu':
    # XLA:GPU kept the joined projection's output alive longer: Cascade 2's MOPD train step
    # on one H200 needed 1.26 GiB more (118.66 GiB, over 90 %), where the join's gain, fewer
    # programs for the TPU compiler to build, is not needed (launch.plan).
    return False
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return True
  return (sharding.split_ways(cfg.mamba_heads, 'mamba_heads', mesh, rules) == 1
          and sharding.split_ways(cfg.mamba_groups, 'mamba_groups', mesh, rules) == 1)


def _split_conv(cfg: config_lib.ModelConfig, conv: jax.Array):
  """[B, K - 1, HP + 2GN] -> (x [B, K-1, H, P], B [B, K-1, G, N], C [B, K-1, G, N])."""
  h, p, g, n = cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_groups, cfg.mamba_state
  lead = conv.shape[:2]
  return (conv[..., :h * p].reshape(*lead, h, p),
          conv[..., h * p:h * p + g * n].reshape(*lead, g, n),
          conv[..., h * p + g * n:].reshape(*lead, g, n))


def _join_conv(parts) -> jax.Array:
  """The inverse of `_split_conv`."""
  return jnp.concatenate([u.reshape(*u.shape[:2], -1) for u in parts], axis=-1)


def _runs(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Which tokens are real, and each token's run: int32 [B, T] counting the restarts so far.

  A real token restarts (bumps the run) where the last real token before it had a different
  nonzero segment. Runs never decrease, so two tokens share a run iff no restart lies
  between them; the first real segment has run 0, the incoming state's."""
  real = segment_ids != 0
  t = jnp.arange(segment_ids.shape[1])
  last = jax.lax.cummax(jnp.where(real, t, -1), axis=1)               # last real index <= t
  last_seg = jnp.where(last >= 0, jnp.take_along_axis(segment_ids, jnp.maximum(last, 0), 1), 0)
  prev_seg = jnp.pad(last_seg[:, :-1], ((0, 0), (1, 0)))
  restart = real & (prev_seg != 0) & (segment_ids != prev_seg)
  return real, jnp.cumsum(restart, axis=1, dtype=jnp.int32)


def _take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x [B, T, ...] with positions reordered per row: out[b, t] = x[b, idx[b, t]]."""
  return jnp.take_along_axis(x, idx.reshape(*idx.shape, *([1] * (x.ndim - 2))), axis=1)


def _real_first(real: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(perm, inv) int32 [B, T]: per row, the stable order putting real tokens first (what a
  stable argsort of ~real gives: perm[b, i] is the token at place i) and its inverse (token
  t's place). Counted, not sorted: a real token's place is how many real tokens precede it, a
  padding token's the row's real count plus the padding before it; the TPU compiler takes
  seconds to build a sort."""
  r = real.astype(jnp.int32)
  inv = jnp.where(real, jnp.cumsum(r, axis=1) - 1,
                  jnp.sum(r, axis=1, keepdims=True) + jnp.cumsum(1 - r, axis=1) - 1)
  t = real.shape[1]
  perm = jax.vmap(lambda d: jnp.zeros((t,), jnp.int32).at[d].set(
      jnp.arange(t, dtype=jnp.int32), unique_indices=True))(inv)
  return perm, inv


def _last_real(u: jax.Array, real: jax.Array, k1: int) -> jax.Array:
  """u [B, T, ...]'s last k1 real positions per row, oldest first, zero where the row has
  fewer: [B, k1, ...]. A one-hot contraction over T (each slot sums one term, so it is exact),
  whose gradient is another: no gather, whose gradient would scatter-add."""
  r = real.astype(jnp.int32)
  rank = jnp.cumsum(r, axis=1) - 1                                   # [B, T]
  want = jnp.sum(r, axis=1, keepdims=True) - k1 + jnp.arange(k1)     # [B, k1]
  hot = (real[:, None, :] & (rank[:, None, :] == want[..., None])).astype(u.dtype)
  out = jnp.einsum('bst,bt...->bs...', hot, u, preferred_element_type=jnp.float32)
  return out.astype(u.dtype)


@jax.custom_vjp
def _permute(x: jax.Array, perm: jax.Array, inv: jax.Array) -> jax.Array:
  """`_take_rows(x, perm)` for a per-row permutation `perm` with inverse `inv`.

  Its gradient is the inverse gather, where autodiff of a gather would scatter-add."""
  return _take_rows(x, perm)


def _permute_fwd(x, perm, inv):
  return _take_rows(x, perm), (perm, inv)


def _permute_bwd(res, g):
  _, inv = res
  return _take_rows(g, inv), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _conv_scan(parts, convs, prefix, real, run, want_state: bool):
  """The causal depthwise convolution + SiLU over T > 1 positions, segment-aware.

  Real tokens are first gathered to the front of each row (stable), so a window holds the
  last K - 1 real inputs; a tap counts only where its input shares the token's run (the
  incoming state's rows, in front, have run 0).

  Args:
    parts: (x [B, T, H, P], B [B, T, G, N], C [B, T, G, N]) conv inputs (compute dtype).
    convs: ((weight [K, ...], bias or None) float32) for each part.
    prefix: the incoming conv inputs, parts of [B, K - 1, ...], or None (zeros).
    real: bool [B, T]; run: int32 [B, T] (`_runs`).
    want_state: also return the conv inputs ending at each row's last real token.

  Returns:
    (outputs float32 in the parts' shapes, zero at padding; conv-state parts or None).
  """
  b, t = real.shape
  k = convs[0][0].shape[0]
  perm, inv = _real_first(real)                                       # real tokens first
  run_ext = jnp.concatenate([jnp.zeros((b, k - 1), run.dtype), _take_rows(run, perm)], axis=1)
  tail, tail_ok = _window_tail(real, run_ext, k)
  outs, states = [], []
  for i, (u, (w, bias)) in enumerate(zip(parts, convs)):
    pre = (jnp.zeros((b, k - 1, *u.shape[2:]), u.dtype) if prefix is None
           else prefix[i].astype(u.dtype))
    ext = jnp.concatenate([pre, _permute(u, perm, inv)], axis=1)      # [B, K - 1 + T, ...]
    feat = (1,) * (u.ndim - 2)
    acc = jnp.zeros(u.shape, jnp.float32) if bias is None else jnp.broadcast_to(bias, u.shape)
    for j in range(k):
      same = (run_ext[:, j:j + t] == run_ext[:, k - 1:]).reshape(b, t, *feat)
      acc = acc + jnp.where(same, ext[:, j:j + t].astype(jnp.float32), 0.0) * w[j]
    out = _permute(jax.nn.silu(acc), inv, perm)
    outs.append(jnp.where(real.reshape(b, t, *feat), out, 0.0))
    if want_state:
      st = _take_rows(ext, tail)
      states.append(jnp.where(tail_ok.reshape(b, k - 1, *feat), st, jnp.zeros((), st.dtype)))
  return tuple(outs), (tuple(states) if want_state else None)


def _window_tail(real, run_ext, k: int):
  """The K - 1 window slots ending at each row's last real token, in the compact order of
  `_conv_scan` (K - 1 incoming slots, then the real tokens): (int32 [B, K - 1] indices
  into that order, bool [B, K - 1] whether the slot shares the last real token's run)."""
  n_real = jnp.sum(real, axis=1, dtype=jnp.int32)
  tail = n_real[:, None] + jnp.arange(k - 1)
  ok = jnp.take_along_axis(run_ext, tail, axis=1) == jnp.take_along_axis(
      run_ext, n_real[:, None] + k - 2, axis=1)
  return tail, ok


def _conv_tail(parts, real, run, k: int):
  """Each row's last K - 1 real conv inputs of its last run, from a zero window.

  Args:
    parts: conv inputs [B, T, ...] (x, B, C); real: bool [B, T]; run: int32 [B, T].
    k: the conv width K.

  Returns:
    parts of [B, K - 1, ...], oldest first, zero where no real input of the last run
    fills a slot: the conv state a zero-state `_conv_scan` of the row would return.
  """
  b = real.shape[0]
  perm, _ = _real_first(real)
  run_ext = jnp.concatenate([jnp.zeros((b, k - 1), run.dtype), _take_rows(run, perm)], axis=1)
  _, ok = _window_tail(real, run_ext, k)
  out = []
  for u in parts:
    feat = (1,) * (u.ndim - 2)
    out.append(jnp.where(ok.reshape(b, k - 1, *feat), _last_real(u, real, k - 1),
                         jnp.zeros((), u.dtype)))
  return tuple(out)


def _conv_step(parts, convs, prefix, real):
  """The convolution + SiLU for one position: parts [B, 1, ...], real bool [B].

  Returns (outputs float32 [B, 1, ...], zero for padding; the new conv-state parts, the
  incoming ones for a padding row)."""
  outs, states = [], []
  for i, (u, (w, bias)) in enumerate(zip(parts, convs)):
    b, k = u.shape[0], w.shape[0]
    pre = (jnp.zeros((b, k - 1, *u.shape[2:]), u.dtype) if prefix is None
           else prefix[i].astype(u.dtype))
    window = jnp.concatenate([pre, u], axis=1)                        # [B, K, ...]
    acc = jnp.sum(window.astype(jnp.float32) * w, axis=1, keepdims=True)
    if bias is not None:
      acc = acc + bias
    feat = (1,) * (u.ndim - 2)
    outs.append(jnp.where(real.reshape(b, 1, *feat), jax.nn.silu(acc), 0.0))
    states.append(jnp.where(real.reshape(b, 1, *feat), window[:, 1:], pre))
  return tuple(outs), tuple(states)


def _outer(xdt: jax.Array, bvec: jax.Array, groups: int) -> jax.Array:
  """Each head's x dt B^T: xdt [B, H, P], bvec [B, G, N] -> [B, H, P, N]."""
  bsz, h, p = xdt.shape
  out = jnp.einsum('bgrp,bgn->bgrpn', xdt.reshape(bsz, groups, h // groups, p), bvec)
  return out.reshape(bsz, h, p, -1)


def _contract_state(cvec: jax.Array, state: jax.Array, groups: int) -> jax.Array:
  """Each head's state h C: cvec [B, G, N], state [B, H, P, N] -> [B, H, P]."""
  bsz, h, p, n = state.shape
  out = jnp.einsum('bgn,bgrpn->bgrp', cvec, state.reshape(bsz, groups, h // groups, p, n))
  return out.reshape(bsz, h, p)


def _chunk_cumsum(x: jax.Array) -> jax.Array:
  """Inclusive cumulative sum over the last axis (a chunk of L positions) as one float32 matmul
  with a triangular ones matrix at full precision. jnp.cumsum lowers to a reduce-window, whose
  code (and its gradient's) the TPU compiler took seconds per Mamba sublayer to build; a
  matmul and its gradient are plain dots."""
  n = x.shape[-1]
  upper = jnp.triu(jnp.ones((n, n), x.dtype))                         # [j, i]: j <= i
  return jnp.einsum('...j,ji->...i', x, upper, precision=jax.lax.Precision.HIGHEST)


def _ssd(x, dt, a, bm, cm, run, h0, chunk: int, cumulative: bool = False):
  """The selective state-space recurrence over T positions, chunk by chunk (float32).

  Within a chunk the outputs are a masked quadratic form; across chunks a `lax.scan`
  carries the state. A restart (a new run) zeroes the state before its token.

  Args:
    x: [B, T, H, P] inputs (after the convolution).
    dt: [B, T, H] time steps (0 at padding).
    a: [H] negative decay rates A.
    bm, cm: [B, T, G, N] the B and C inputs.
    run: int32 [B, T] (`_runs`).
    h0: [B, H, P, N] the incoming state (run 0's).
    chunk: positions per chunk L.
    cumulative: also return the log decays summed from position 0 through each position,
      [B, T, H], from the chunks' own cumulative sums and their totals.

  Returns:
    (y [B, T, H, P] without the D skip; the state after the last position [B, H, P, N]
    [; the cumulative log decays]).
  """
  bsz, t, h, p = x.shape
  g, n = bm.shape[2:]
  r = h // g
  q = -(-t // chunk)
  pad = q * chunk - t
  # Padded positions are transparent: dt = 0 (no decay) and no input; they continue the run.
  padt = lambda v: jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
  chunks = lambda v: padt(v).reshape(bsz, q, chunk, *v.shape[2:])
  xdt = chunks(x * dt[..., None]).reshape(bsz, q, chunk, g, r, p)     # [B, Q, L, G, R, P]
  bm, cm = chunks(bm), chunks(cm)                                     # [B, Q, L, G, N]
  la = jnp.moveaxis(chunks(dt * a), 2, -1)                            # [B, Q, H, L] log decays
  run = jnp.pad(run, ((0, 0), (0, pad)), mode='edge').reshape(bsz, q, chunk)

  # seg[..., i, j] = sum of la over (j, i] = cs_i - cs_j, the chunk's cumulative log decays
  # (as the reference's fused chunk-scan kernels compute it): a difference of sums over at
  # most L terms, not of sums along T.
  cs = _chunk_cumsum(la)                                              # [B, Q, H, L]
  same = (run[..., :, None] == run[..., None, :]) & jnp.tri(chunk, dtype=bool)
  seg = jnp.where(same[:, :, None], cs[..., :, None] - cs[..., None, :], -jnp.inf)
  decay = jnp.exp(seg)                                                # 0 off the mask
  decay = decay.reshape(bsz, q, g, r, chunk, chunk)

  # Within chunks: y_i = sum_{j <= i, same run} (C_i . B_j) exp(seg_ij) dt_j x_j.
  cb = jnp.einsum('bqlgn,bqsgn->bqgls', cm, bm)
  y_diag = jnp.einsum('bqgrls,bqsgrp->bqlgrp', cb[:, :, :, None] * decay, xdt)

  # Each chunk's own contribution to the state at its end (the last row of `decay`).
  s_chunk = jnp.einsum('bqgrs,bqsgrp,bqsgn->bqgrpn', decay[..., -1, :], xdt, bm)
  # Decay from the chunk's start to each position, zero past a restart in the chunk.
  run_prev = jnp.pad(run[:, :-1, -1], ((0, 0), (1, 0)))               # run 0 before chunk 0
  cont = run == run_prev[..., None]                                   # [B, Q, L]
  decay_in = jnp.where(cont[:, :, None], jnp.exp(cs), 0.0)          # [B, Q, H, L]

  def step(carry, inp):
    d, s = inp
    return d[..., None, None] * carry + s, carry

  s_chunk = jnp.moveaxis(s_chunk.reshape(bsz, q, h, p, n), 1, 0)
  h_last, h_start = jax.lax.scan(step, h0, (jnp.moveaxis(decay_in[..., -1], 1, 0), s_chunk))
  h_start = jnp.moveaxis(h_start, 0, 1).reshape(bsz, q, g, r, p, n)   # state at chunk starts
  y_off = jnp.einsum('bqlgn,bqgrpn->bqlgrp', cm, h_start)
  y_off = y_off * jnp.moveaxis(decay_in, 3, 2).reshape(bsz, q, chunk, g, r, 1)
  y = (y_diag + y_off).reshape(bsz, q * chunk, h, p)[:, :t]
  if not cumulative:
    return y, h_last
  # Each chunk's cumulative sums plus the chunks' totals before it: one cumulative sum over
  # Q totals instead of a second one over every position.
  totals = cs[..., -1]                                                # [B, Q, H]
  before = jnp.moveaxis(_chunk_cumsum(jnp.moveaxis(totals, 1, -1)), -1, 1) - totals
  cum = jnp.moveaxis(cs + before[..., None], 3, 2).reshape(bsz, q * chunk, h)[:, :t]
  return y, h_last, cum


# ---------------------------------------------------------------- context parallelism


def _pieces(v: jax.Array) -> jax.Array:
  """A shard's [B, 2C, ...] (its two zig-zag chunks) as [2B, C, ...]: the first chunks of
  all rows, then the second ones, each piece scanned as a row of its own."""
  b, t = v.shape[:2]
  v = v.reshape(b, 2, t // 2, *v.shape[2:])
  return jnp.moveaxis(v, 1, 0).reshape(2 * b, t // 2, *v.shape[3:])


def _unpieces(v: jax.Array) -> jax.Array:
  """The inverse of `_pieces`."""
  b2, c = v.shape[:2]
  v = v.reshape(2, b2 // 2, c, *v.shape[2:])
  return jnp.moveaxis(v, 0, 1).reshape(b2 // 2, 2 * c, *v.shape[3:])


def _edge_segments(seg: jax.Array, real: jax.Array) -> tuple[jax.Array, jax.Array]:
  """int32 [B] each: the segment of each row's first and of its last real token (0: none)."""
  t = seg.shape[1]
  first = jnp.argmax(real, axis=1)
  last = t - 1 - jnp.argmax(real[:, ::-1], axis=1)
  any_real = jnp.any(real, axis=1)
  pick = lambda i: jnp.where(any_real, jnp.take_along_axis(seg, i[:, None], 1)[:, 0], 0)
  return pick(first), pick(last)


def _fold_windows(tails, counts, first_seg, last_seg, restart):
  """The conv window and last segment entering each piece, pieces in sequence order.

  Args:
    tails: parts of [S, B, K - 1, ...], each piece's `_conv_tail`.
    counts: int32 [S, B] real tokens per piece; first_seg, last_seg: int32 [S, B]
      (`_edge_segments`); restart: bool [S, B] whether the piece restarts within itself.

  Returns:
    (parts of [S, B, K - 1, ...]: the window entering each piece, zero where the piece's
    first real token starts a new segment; bool [S, B] keep: whether the piece continues
    what came before it).
  """
  k1 = tails[0].shape[2]
  slots = jnp.arange(k1)

  def step(carry, piece):
    window, prev_seg = carry
    tail, m, first, last, inner = piece
    keep = (prev_seg == 0) | (first == 0) | (first == prev_seg)
    feat = lambda u: (slice(None), None) + (None,) * (u.ndim - 2)
    entering = tuple(jnp.where(keep[feat(w)], w, jnp.zeros((), w.dtype)) for w in window)
    # Last K - 1 of [what entered (if the piece keeps it), the piece's m real inputs].
    m = jnp.minimum(m, k1)
    src = jnp.minimum(m[:, None] + slots, k1 - 1)                    # [B, K - 1]
    own = slots[None] >= k1 - m[:, None]
    new = []
    for w, u in zip(entering, tail):
      w = jnp.where((~inner)[feat(w)], w, jnp.zeros((), w.dtype))
      # w[b, src[b, s]] as a select over the K - 1 sources (a gather's gradient would
      # scatter-add).
      pick = lambda j: (src == j).reshape(*src.shape, *([1] * (w.ndim - 2)))
      shifted = sum(jnp.where(pick(j), w[:, j:j + 1], jnp.zeros((), w.dtype))
                    for j in range(k1))
      new.append(jnp.where(own.reshape(*own.shape, *([1] * (w.ndim - 2))), u, shifted))
    seg = jnp.where(last != 0, last, prev_seg)
    return (tuple(new), seg), (entering, keep)

  zeros = tuple(jnp.zeros_like(u[0]) for u in tails)
  _, (windows, keep) = jax.lax.scan(
      step, (zeros, jnp.zeros_like(last_seg[0])), (tails, counts, first_seg, last_seg, restart))
  return windows, keep


def _fold_states(log_decay, final, keep, restart):
  """The SSM state entering each piece, pieces in sequence order.

  Args:
    log_decay: [S, B, H] each piece's summed dt A (its decay over the piece, log).
    final: [S, B, H, P, N] each piece's state at its end from a zero start.
    keep, restart: bool [S, B] (`_fold_windows`; a piece restarting within itself
      passes nothing of what entered it on).

  Returns:
    [S, B, H, P, N] float32, zero where the piece does not continue what came before.
  """
  def step(h, piece):
    ld, s, kp, inner = piece
    h_in = jnp.where(kp[:, None, None, None], h, 0.0)
    decay = jnp.where(inner[:, None], 0.0, jnp.exp(ld))
    return decay[..., None, None] * h_in + s, h_in

  _, entering = jax.lax.scan(step, jnp.zeros_like(final[0]), (log_decay, final, keep, restart))
  return entering


def _context_parallel(parts, convs, dt, a, segment_ids, chunk: int, split, rules):
  """The convolution and scan of a row split along T over the sequence axis (zig-zag).

  Each shard holds two pieces of the row (chunks i and 2n - 1 - i of 2n, `models.context`)
  and scans each from a zero start. Small summaries of every piece are all-gathered over the
  axis and folded in sequence order 0 .. 2n - 1 on every shard: first the conv inputs (each
  piece's last K - 1 real inputs, its segments at both ends), giving the window that enters
  each piece, with which the shard then runs its convolution; then the scan's (a piece's
  summed log decay per head and its final state), giving the state h_in that enters each
  piece. The state's part of the output is linear in h_in, so it is added afterwards:
  y_t += exp(sum of dt A from the piece's start to t) C_t h_in for each token t of the
  piece's first run. A piece whose first real token starts a new segment keeps nothing of
  what came before it, and one with a restart inside it passes nothing of it on.

  Args:
    parts: (x [B, T, H, P], B [B, T, G, N], C [B, T, G, N]) conv inputs, zig-zag order, or
      the three joined, ([B, T, HP + 2GN],) (`_joins_channels`: heads and groups unsplit).
    convs: ((weight [K, ...], bias or None) float32) for each part.
    dt: [B, T, H] time steps (0 at padding); a: [H] decay rates.
    segment_ids: int32 [B, T] in zig-zag order.
    chunk: the scan's chunk length L.
    split: the conv outputs (as `parts`) -> (x, B, C).
    rules: the logical rules that split the row over the sequence axis.

  Returns:
    (x after the convolution [B, T, H, P], y [B, T, H, P] without the D skip), float32,
    zig-zag order, split along T as the inputs are.
  """
  mesh = jax.sharding.get_abstract_mesh()
  b, t, h = dt.shape
  n = context.shards(t, rules)
  axis = context.axis(t, rules)
  batch, length, heads = sharding.logical_to_spec(
      ('batch', 'length', 'mamba_heads'), (b, t, h), mesh, rules)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  tp = int(np.prod([sizes[x] for x in ((heads,) if isinstance(heads, str) else heads or ())]))
  if len(parts) == 1 or parts[1].shape[2] % tp:
    heads = None         # groups cannot follow the heads' split: scan all heads per shard
  # Head h reads group h // (H / G): heads and groups split over the same axis keep each
  # shard's heads with their groups.
  head_spec = P(batch, length, heads, None)
  if len(parts) == 1:         # x, B and C joined: heads and groups unsplit
    part_specs = (P(batch, length, None),)
    conv_specs = tuple((P(None, None), None if bias is None else P(None)) for _, bias in convs)
  else:
    part_specs = (head_spec,) * 3
    conv_specs = tuple((P(None, heads, None), None if bias is None else P(heads, None))
                       for _, bias in convs)
  # Piece c of the sequence lives at [shard, half] of an all-gather: (c, 0) or (2n-1-c, 1).
  order = np.asarray([2 * c if c < n else 2 * (2 * n - 1 - c) + 1 for c in range(2 * n)])

  def gather(v):
    v = jax.lax.all_gather(v, axis, axis=0, tiled=False)            # [n, 2B, ...]
    v = v.reshape(2 * n, v.shape[1] // 2, *v.shape[2:])              # [2n, B, ...]
    return jnp.concatenate([v[i:i + 1] for i in order], axis=0)   # static: slices

  def mine(v, shard):
    """This shard's two pieces of a [2n, B, ...] fold, as [2B, ...]."""
    v = jnp.stack([v[shard], v[2 * n - 1 - shard]])
    return v.reshape(-1, *v.shape[2:])

  def local(parts, dt, a, seg, convs):
    shard = jax.lax.axis_index(axis)
    k = convs[0][0].shape[0]
    parts = tuple(_pieces(u) for u in parts)
    dt, seg = _pieces(dt), _pieces(seg)
    real, run = _runs(seg)
    restart = run[:, -1] > 0
    first, last = _edge_segments(seg, real)
    count = jnp.sum(real, axis=1, dtype=jnp.int32)
    tails, counts, firsts, lasts, restarts = jax.tree.map(
        gather, (_conv_tail(parts, real, run, k), count, first, last, restart))
    windows, keep = _fold_windows(tails, counts, firsts, lasts, restarts)
    prefix = tuple(mine(w, shard) for w in windows)
    outs, _ = _conv_scan(parts, convs, prefix, real, run, want_state=False)
    xs, bs, cs = split(outs)
    b2, c, hl, p = xs.shape
    gl, ns = bs.shape[2:]
    y, final, cum = _ssd(xs, dt, a, bs, cs, run, jnp.zeros((b2, hl, p, ns), jnp.float32),
                         chunk, cumulative=True)
    # A piece's summed log decay is its cumulative sum's last entry.
    h_in = mine(_fold_states(gather(cum[:, -1]), gather(final), keep, restarts),
                shard)                                                # [2B, H, P, N]
    decay = jnp.where((run == 0)[..., None], jnp.exp(cum), 0.0)
    y_in = jnp.einsum('btgn,bgrpn->btgrp', cs, h_in.reshape(b2, gl, hl // gl, p, ns))
    y = y + decay[..., None] * y_in.reshape(b2, c, hl, p)
    return _unpieces(xs), _unpieces(y)

  seg_spec = P(batch, length)
  return jax.shard_map(
      local, mesh=mesh,
      in_specs=(part_specs, P(batch, length, heads), P(heads), seg_spec, conv_specs),
      out_specs=(head_spec, head_spec), check_vma=False)(parts, dt, a, segment_ids, convs)


def _gated_norm(y, z, scale, groups: int, eps: float) -> jax.Array:
  """y * silu(z), RMS-normalised over each of `groups` groups of heads, times scale (float32).

  y, z: [B, T, H, P]; scale: [H, P]. Returns float32 [B, T, H, P]."""
  v = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
  shape = v.shape
  vg = v.reshape(*shape[:-2], groups, -1)
  vg = vg * jax.lax.rsqrt(jnp.mean(vg * vg, axis=-1, keepdims=True) + eps)
  return vg.reshape(shape) * scale.astype(jnp.float32)
