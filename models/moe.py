"""Mixture-of-experts layer: a router, dropless routed experts and an optional shared expert.

Shape letters: B batch, T length, D embed, E experts, K experts per token (top-k),
F a routed expert's width, S the shared expert's width, N = B * T tokens,
M = N * K (token, choice) pairs.

    out = model(x, token_mask, routing)     # MoEOutput(y [B, T, D], indices [B, T, K], aux, z,
                                            #           mismatched, differs [B, T])

Routing (ModelConfig.router), in float32 whatever the compute dtype:

* 'softmax' (Qwen3-MoE): p = softmax(logits) over the E experts; the K largest p
  are chosen; the weights are the chosen p, renormalised to sum to one with
  `router_norm_topk`.
* 'sigmoid' (Nemotron-H, DeepSeek-V3): s = sigmoid(logits); the choice ranks
  s + router_bias, a score-correction bias that only steers the choice; the
  weights are the chosen s, divided by (their sum + 1e-20) with `router_norm_topk`.

With `router_groups` G > 1 the choice is group-limited (for either kind): the
experts form G contiguous groups, a group scores the sum of its two best choice
scores (its one score if it holds one expert), and the K experts are chosen
within the `router_topk_groups` best groups only. The weights are then
multiplied by `routed_scaling`. A `routing` argument (routing replay) replaces
the choice, never the weights: those stay the router's differentiable weights
of the replayed experts, normalised and scaled as above. The layer then also
counts the real tokens whose replayed expert set differs from the one its
own router picks from the same scores (`MoEOutput.mismatched`, and which tokens:
`MoEOutput.differs`); with
`replay=False` it routes on its own and only counts (how far a sampler's
recorded routing is from the trainer's).

Routed experts are dropless (no capacity, no token ever dropped): the M
(token, choice) pairs are put in expert order (stably; `_dispatch` counts each
pair's row instead of sorting) and each expert's consecutive rows go through
its own weights in one grouped matmul (`grouped_matmul`: `jax.lax.ragged_dot`;
on TPU the Pallas megablox kernel; on GPU `tiled_matmul`, loops over row tiles,
since XLA:GPU expands ragged_dot densely), then unsorted and summed over the K
choices with their weights.

Expert parallelism. Under a mesh of more than one device the routed experts
run under `jax.shard_map`: each shard holds the experts of its index along the
mesh axes the 'experts' rule names (E / ep of them; 'expert' by default) and
the slice of every expert's F along the 'moe_mlp' ones ('tensor'). The rows
are split over the 'batch' axes as everywhere else, 'expert' included, and
each row's tokens over the 'length' ones ('sequence' under context
parallelism: a sequence shard routes and computes only its own T / n tokens,
never the whole row), so the shards of one expert group hold different
tokens: each all-gathers its group's tokens (and their routing), runs only
its local experts over the pairs routed to them, and a reduce-scatter
(`psum_scatter`) over 'expert' sums every token's K contributions back onto
the shard that owns the token; a psum over 'tensor' adds up the F slices. This is the all-to-all's
equivalent for a dropless layer with static shapes: an all-to-all would need
buffers sized for the worst case (every pair to one shard, K times the
tokens), while the gather moves each token once.

With `moe_dispatch='all_to_all'` (ModelConfig) a shard instead sends each of its
own (token, choice) pairs to the shard holding the pair's expert and gets the
outputs back by the inverse exchange (`_exchanged_experts`), as MaxText and
Megatron do: dropless, the receive buffer sized for the worst case ([G x M, D],
G the expert shards, as large as the gather path's sorted pairs), but only the
routed pairs move: per shard about (G - 1) / G x N x K rows each way, against
the gather's (G - 1) x N rows out and a reduce-scatter of as many back. On TPU
and GPU `jax.lax.ragged_all_to_all` moves the rows; XLA:CPU has none, so there
every slot is padded to M rows and sent by `jax.lax.all_to_all` (the same
numbers, more bytes). It runs where every expert axis splits the tokens; where
one does not (a decode step of fewer rows than shards) the gather path runs.
The experts' 'embed' dim
(split over 'fsdp') is gathered on entry as every FSDP weight is. A mesh
'expert' axis that does not divide `num_experts` is a ValueError.

Parameters, with the Hugging Face tensors they hold (an HF Linear weight is
[out, in], so each 2-D projection here is its transpose; `experts.{e}.*` is
the per-expert layout `save_pretrained` writes, the fused 3-D one is what
transformers 5 holds in memory). Qwen3-MoE names are under a layer's `mlp.`,
Nemotron-H names under its `mixer.`:

  router [D, E] float32         ('embed', None)
      Qwen3-MoE  mlp.gate.weight [E, D], transposed.
      Nemotron-H mixer.gate.weight [E, D], transposed.
  router_bias [E] float32       (None,)      sigmoid router only; not trained by gradient
      Nemotron-H mixer.gate.e_score_correction_bias [E].
      (a stop_gradient in the forward pass: it only steers the choice.)
  gate [E, D, F]                ('experts', 'embed', 'moe_mlp')   swiglu only
      Qwen3-MoE  mlp.experts.{e}.gate_proj.weight [F, D], transposed, stacked over e;
                 fused mlp.experts.gate_up_proj [E, 2F, D]: rows [:F] (gate rows come first),
                 gate_up_proj[:, :F].swapaxes(1, 2).
  up [E, D, F]                  ('experts', 'embed', 'moe_mlp')
      Qwen3-MoE  mlp.experts.{e}.up_proj.weight [F, D], transposed, stacked;
                 fused gate_up_proj[:, F:].swapaxes(1, 2).
      Nemotron-H mixer.experts.{e}.up_proj.weight [F, D], transposed, stacked;
                 fused mixer.experts.up_proj [E, F, D], .swapaxes(1, 2).
  down [E, F, D]                ('experts', 'moe_mlp', 'embed')
      Qwen3-MoE  mlp.experts.{e}.down_proj.weight [D, F], transposed, stacked;
                 fused mlp.experts.down_proj [E, D, F], .swapaxes(1, 2).
      Nemotron-H mixer.experts.{e}.down_proj.weight [D, F], transposed, stacked;
                 fused mixer.experts.down_proj [E, D, F], .swapaxes(1, 2).
  shared_gate [D, S]            ('embed', 'mlp')   swiglu with a shared expert only
      (neither family above has a gated shared expert.)
  shared_up [D, S]              ('embed', 'mlp')
      Nemotron-H mixer.shared_experts.up_proj.weight [S, D], transposed.
  shared_down [S, D]            ('mlp', 'embed')
      Nemotron-H mixer.shared_experts.down_proj.weight [D, S], transposed.

HF's router weight follows the model's dtype in Qwen3-MoE; here it is always
float32 (cast on import). The layer holds no training logic: `aux_loss` and
`z_loss` come back unweighted (`router_aux_loss` and `router_z_loss` are the
trainer's to apply).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import config as config_lib
from models import sharding
from models.layers import _param

GROUPED_MATMUL_IMPLS = ('ragged_dot', 'gmm', 'tiled')
# Rows per tile of the 'tiled' grouped matmul (`tiled_matmul`).
TILE_ROWS = 512


class MoEOutput(NamedTuple):
  """What a mixture-of-experts layer returns; a pytree.

  Attributes:
    y: [B, T, D] the layer's output (compute dtype).
    indices: [B, T, K] int32, the experts each token went to (the router's
      choice, or the replayed `routing`); the sampler records them for replay.
    aux_loss: [] float32 load-balancing loss E * sum_e f_e * p_e over the real
      tokens (Switch / Qwen style): f_e the fraction of tokens that chose
      expert e (summed over the K choices, so sum_e f_e = K), p_e the mean
      router probability of e (softmax; for the sigmoid router the scores
      normalised to sum to one per token). K when perfectly balanced.
    z_loss: [] float32 mean over the real tokens of logsumexp(logits)^2.
    mismatched: [] float32 real tokens whose router's own top-K set differs from the
      `routing` given (order within the K ignored); None without `routing`.
    differs: [B, T] bool which real tokens those are (padding False); None without
      `routing`.
  """
  y: jax.Array
  indices: jax.Array
  aux_loss: jax.Array
  z_loss: jax.Array
  mismatched: jax.Array | None = None
  differs: jax.Array | None = None


def _dense(x: jax.Array, w: jax.Array) -> jax.Array:
  """[..., I] x [I, O] -> [..., O], contracting I only: no reshape that merges the leading
  axes, which made GSPMD all-gather a sequence-sharded [B, T, D] before the router."""
  return jnp.einsum('...I,IO->...O', x, w)


def _activate(cfg: config_lib.ModelConfig, up: jax.Array, gate: jax.Array | None) -> jax.Array:
  """silu(gate) * up ('swiglu') or relu(up)^2 ('relu2')."""
  if cfg.mlp_activation == 'swiglu':
    return jax.nn.silu(gate) * up
  return jnp.square(jax.nn.relu(up))


class MoE(nnx.Module):
  """Router + dropless routed experts (+ a shared expert when `shared_expert_dim` > 0)."""

  def __init__(self, cfg: config_lib.ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, e, f, s = cfg.embed_dim, cfg.num_experts, cfg.moe_dim, cfg.shared_expert_dim
    pd = cfg.jnp_param_dtype
    swiglu = cfg.mlp_activation == 'swiglu'
    self.router = _param(rngs, (d, e), ('embed', None), jnp.float32)
    if cfg.router == 'sigmoid':
      # Steers the choice only and is not trained by gradient (stop_gradient in the forward
      # pass). DeepSeek-V3 moves it by a load-balancing rule outside the optimizer; cascade has
      # no such rule, so it keeps its loaded value, unless an optimizer's weight decay (which
      # ignores gradients) is applied to it.
      self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
    expert_in, expert_out = ('experts', 'embed', 'moe_mlp'), ('experts', 'moe_mlp', 'embed')
    if swiglu:
      self.gate = _param(rngs, (e, d, f), expert_in, pd)
    self.up = _param(rngs, (e, d, f), expert_in, pd)
    self.down = _param(rngs, (e, f, d), expert_out, pd)
    if s:
      if swiglu:
        self.shared_gate = _param(rngs, (d, s), ('embed', 'mlp'), pd)
      self.shared_up = _param(rngs, (d, s), ('embed', 'mlp'), pd)
      self.shared_down = _param(rngs, (s, d), ('mlp', 'embed'), pd)

  def __call__(self, x: jax.Array, token_mask: jax.Array | None = None,
               routing: jax.Array | None = None, replay: bool = True, *,
               rules: sharding.Rules = sharding.DEFAULT_RULES) -> MoEOutput:
    """Routes each token to K experts and sums their weighted outputs (+ the shared expert's).

    Args:
      x: [B, T, D] input.
      token_mask: [B, T], 1 for a real token; padding is left out of `aux_loss`,
        `z_loss` and `mismatched` (its output is computed all the same). Default: every
        token real.
      routing: optional [B, T, K] int expert ids to use instead of the router's choice
        (routing replay). Out-of-range ids are a ValueError when concrete and are clipped
        into [0, E) when traced.
      replay: with `routing`, use it (True) or only compare the router's own choice with
        it (False: the layer routes as without it; `mismatched` is still counted).
      rules: the logical rules the caller traces with (`models.sharding`).

    Returns:
      A MoEOutput.
    """
    cfg = self.cfg
    b, t, _ = x.shape
    if routing is not None:
      routing = _check_routing(routing, (b, t, cfg.experts_per_token), cfg.num_experts)
    logits = _dense(x.astype(jnp.float32), self.router.value.astype(jnp.float32))  # [B, T, E]
    bias = (jax.lax.stop_gradient(self.router_bias.value.astype(jnp.float32))
            if cfg.router == 'sigmoid' else None)
    indices, weights, probs = route(cfg, logits, bias, routing if replay else None)
    aux_loss, z_loss = router_losses(logits, probs, indices, token_mask)
    mismatched = token_differs = None
    if routing is not None:
      own = indices if not replay else own_choice(cfg, logits, bias)
      token_differs = differs(own, routing)
      if token_mask is not None:
        token_differs = token_differs & (token_mask > 0)
      mismatched = jnp.sum(token_differs.astype(jnp.float32))

    dt = cfg.jnp_dtype
    x = x.astype(dt)
    experts = ((self.gate.value.astype(dt),) if cfg.mlp_activation == 'swiglu' else ()) + (
        self.up.value.astype(dt), self.down.value.astype(dt))
    y = _routed(cfg, x, indices, weights, experts, rules)
    if cfg.shared_expert_dim:
      gate = (_dense(x, self.shared_gate.value.astype(dt))
              if cfg.mlp_activation == 'swiglu' else None)
      h = _activate(cfg, _dense(x, self.shared_up.value.astype(dt)), gate)
      h = sharding.constrain(h, ('batch', 'length', 'mlp'), rules)
      y = y + _dense(h, self.shared_down.value.astype(dt))
    return MoEOutput(sharding.constrain(y, ('batch', 'length', 'embed'), rules), indices,
                     aux_loss, z_loss, mismatched, token_differs)


def _check_routing(routing, shape: tuple[int, int, int], num_experts: int) -> jax.Array:
  """Replayed expert ids as int32 [B, T, K]: a ValueError for a wrong shape or dtype, or for
  ids outside [0, num_experts) when they are concrete; traced ids are clipped into range."""
  try:
    routing = np.asarray(routing)
  except jax.errors.TracerArrayConversionError:
    pass
  else:
    if routing.size and np.issubdtype(routing.dtype, np.integer) and (
        routing.min() < 0 or routing.max() >= num_experts):
      raise ValueError(f'routing replay expert ids span [{routing.min()}, {routing.max()}], '
                       f'outside [0, num_experts={num_experts})')
  if tuple(routing.shape) != shape:
    raise ValueError(f'routing has shape {tuple(routing.shape)}; expected [B, T, K] = {shape}')
  if not jnp.issubdtype(routing.dtype, jnp.integer):
    raise ValueError(f'routing must hold integer expert ids, got dtype {routing.dtype}')
  return jnp.clip(jnp.asarray(routing), 0, num_experts - 1).astype(jnp.int32)


def route(cfg: config_lib.ModelConfig, logits: jax.Array, bias: jax.Array | None = None,
          routing: jax.Array | None = None):
  """The router's choice and weights (see the module docstring), all in float32.

  Args:
    cfg: the model config (router kind, K, groups, normalisation, scaling).
    logits: [..., E] float32 router logits.
    bias: [E] the sigmoid router's score-correction bias (None for softmax).
    routing: optional [..., K] int32 expert ids replacing the choice.

  Returns:
    (indices [..., K] int32, weights [..., K] float32, probs [..., E] float32: the
    per-token distribution over experts the load-balancing loss averages).
  """
  scores, choice, probs = _scores(cfg, logits, bias)
  indices = _choose(cfg, jax.lax.stop_gradient(choice)) if routing is None else routing
  # A one-hot contraction, not take_along_axis: the gather's gradient is a scatter-add, which
  # the TPU compiler builds as a sort and takes seconds to compile; this selects exactly.
  hot = indices[..., None] == jnp.arange(scores.shape[-1], dtype=indices.dtype)  # [..., K, E]
  weights = jnp.sum(jnp.where(hot, scores[..., None, :], 0.0), axis=-1)
  if cfg.router_norm_topk:
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / (total + 1e-20 if cfg.router == 'sigmoid' else total)
  return indices, weights * cfg.routed_scaling, probs


def _scores(cfg: config_lib.ModelConfig, logits: jax.Array, bias: jax.Array | None):
  """(scores that weight the experts, scores that rank them, probs for the aux loss),
  each [..., E] float32."""
  if cfg.router == 'softmax':
    scores = jax.nn.softmax(logits, axis=-1)
    return scores, scores, scores
  scores = jax.nn.sigmoid(logits)
  return scores, scores + bias, scores / jnp.sum(scores, axis=-1, keepdims=True)


def own_choice(cfg: config_lib.ModelConfig, logits: jax.Array,
               bias: jax.Array | None = None) -> jax.Array:
  """The K experts [..., K] int32 the router picks from `logits` [..., E] (`route`'s choice
  without a replayed `routing`)."""
  return _choose(cfg, jax.lax.stop_gradient(_scores(cfg, logits, bias)[1]))


def differs(a: jax.Array, b: jax.Array) -> jax.Array:
  """[...] bool: whether the expert sets a [..., K] and b [..., K] differ (order ignored)."""
  a, b = jnp.sort(a.astype(jnp.int32), axis=-1), jnp.sort(b.astype(jnp.int32), axis=-1)
  return jnp.any(a != b, axis=-1)


def _choose(cfg: config_lib.ModelConfig, choice: jax.Array) -> jax.Array:
  """The K experts of highest `choice` [..., E], within the best groups when group-limited."""
  e, g = cfg.num_experts, cfg.router_groups
  if g > 1 and cfg.router_topk_groups < g:
    per = e // g
    grouped = choice.reshape(*choice.shape[:-1], g, per)
    group_score = jnp.sum(jax.lax.top_k(grouped, min(2, per))[0], axis=-1)     # [..., G]
    best = jax.lax.top_k(group_score, cfg.router_topk_groups)[1]
    keep = jnp.any(best[..., None] == jnp.arange(g), axis=-2)                     # [..., G]
    choice = jnp.where(jnp.repeat(keep, per, axis=-1), choice, -jnp.inf)
  return jax.lax.top_k(choice, cfg.experts_per_token)[1].astype(jnp.int32)


def router_losses(logits: jax.Array, probs: jax.Array, indices: jax.Array,
                  token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(aux_loss, z_loss) over the real tokens (see `MoEOutput`).

  Args:
    logits: [B, T, E] float32 router logits.
    probs: [B, T, E] float32 per-token distribution over experts (`route`).
    indices: [B, T, K] experts used.
    token_mask: [B, T], 1 for a real token (default: all real).
  """
  e = logits.shape[-1]
  mask = (jnp.ones(logits.shape[:-1], jnp.float32) if token_mask is None
          else token_mask.astype(jnp.float32))
  n = jnp.maximum(jnp.sum(mask), 1.0)
  chosen = jnp.sum(jax.nn.one_hot(indices, e, dtype=jnp.float32), axis=-2)        # [B, T, E]
  frac = jnp.einsum('BT,BTE->E', mask, chosen) / n
  prob = jnp.einsum('BT,BTE->E', mask, probs) / n
  aux = e * jnp.sum(frac * prob)
  z = jnp.sum(mask * jnp.square(jax.nn.logsumexp(logits, axis=-1))) / n
  return aux, z


def _default_impl() -> str:
  platform = sharding.mesh_platform()
  return {'tpu': 'gmm', 'gpu': 'tiled', 'cuda': 'tiled', 'rocm': 'tiled'}.get(platform,
                                                                             'ragged_dot')


def _visits(group_sizes: jax.Array, m: int, t: int):
  """The (row tile, group) pairs a grouped matmul over m rows in tiles of t visits: every tile
  once per group with rows in it, in row order (megablox's schedule).

  Returns (tile [V] int32, group [V] int32, starts [G], ends [G], valid [V] bool) for
  V = m / t + G - 1 visits, enough for any sizes (a tile is shared by two groups only at
  a boundary between them); the visits past the real ones are marked invalid."""
  g = group_sizes.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  first, last = starts // t, (ends - 1) // t
  n = jnp.where(group_sizes > 0, last - first + 1, 0)
  done = jnp.cumsum(n)                                   # visits up to and including group g
  v = jnp.arange(m // t + g - 1, dtype=jnp.int32)
  group = jnp.minimum(jnp.sum(done[None, :] <= v[:, None], axis=1, dtype=jnp.int32), g - 1)
  tile = first[group] + v - (done - n)[group]
  valid = v < done[-1]
  return jnp.where(valid, tile, 0).astype(jnp.int32), group, starts, ends, valid


def _tile_rows(x: jax.Array, r0, t: int, starts, ends, group, valid):
  """(rows r0 .. r0 + t of x, which of them belong to `group`)."""
  rows = r0 + jnp.arange(t, dtype=jnp.int32)
  mine = valid & (rows >= starts[group]) & (rows < ends[group])
  return jax.lax.dynamic_slice_in_dim(x, r0, t), mine


def _gmm_loop(lhs, rhs, group_sizes, t: int, transpose_rhs: bool):
  """[M, I] x [G, I, O] (or [G, O, I] contracted on its last dim) -> [M, O]: a loop over the
  visits, each one tile of rows through its group's matrix, accumulated in at least float32."""
  m = lhs.shape[0]
  tile, group, starts, ends, valid = _visits(group_sizes, m, t)
  o = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  acc = jnp.promote_types(lhs.dtype, jnp.float32)
  dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

  def body(i, out):
    r0 = tile[i] * t
    x, mine = _tile_rows(lhs, r0, t, starts, ends, group[i], valid[i])
    w = jax.lax.dynamic_index_in_dim(rhs, group[i], keepdims=False)
    y = jax.lax.dot_general(x, w, dims, preferred_element_type=acc).astype(out.dtype)
    cur = jax.lax.dynamic_slice_in_dim(out, r0, t)
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None], y, cur), r0, 0)

  return jax.lax.fori_loop(0, tile.shape[0], body, jnp.zeros((m, o), lhs.dtype))


def _tgmm_loop(lhs, grad, group_sizes, t: int, g: int):
  """sum over group g's rows of lhs^T grad: [M, I], [M, O] -> [G, I, O] (at least float32), by
  the same visits (the weight gradient of `_gmm_loop`)."""
  m = lhs.shape[0]
  tile, group, starts, ends, valid = _visits(group_sizes, m, t)
  dtype = jnp.promote_types(lhs.dtype, jnp.float32)

  def body(i, acc):
    r0 = tile[i] * t
    x, mine = _tile_rows(lhs, r0, t, starts, ends, group[i], valid[i])
    x = jnp.where(mine[:, None], x, 0)
    dy = jax.lax.dynamic_slice_in_dim(grad, r0, t)
    upd = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=dtype)
    cur = jax.lax.dynamic_index_in_dim(acc, group[i], keepdims=True)
    return jax.lax.dynamic_update_index_in_dim(acc, cur + upd[None], group[i], 0)

  return jax.lax.fori_loop(0, tile.shape[0], body,
                           jnp.zeros((g, lhs.shape[1], grad.shape[1]), dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tiled_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: int) -> jax.Array:
  """The grouped matmul as loops over row tiles in plain XLA, forward and backward: the rows
  of group g times rhs[g], [M, I] x [G, I, O] -> [M, O] (M a multiple of `tile`).

  XLA:GPU (jaxlib 0.10) rewrites `ragged_dot` into dense dots over every group, forward and
  both gradients: a zero-padded [M, G, I] operand, 15.75 GiB per expert matmul of a Cascade-2
  train step on one H200, three per layer (its cuDNN grouped fusion, behind an experimental
  flag, covers the forward and the input gradient only). This computes all three as one
  [tile, I] x [I, O] matmul per (tile, group) visit (`_visits`: about M / tile + G of them,
  megablox's schedule in a `fori_loop`), holding only the outputs."""
  return _gmm_loop(lhs, rhs, group_sizes, tile, False)


def _tiled_fwd(lhs, rhs, group_sizes, tile):
  return _gmm_loop(lhs, rhs, group_sizes, tile, False), (lhs, rhs, group_sizes)


def _tiled_bwd(tile, res, g):
  lhs, rhs, group_sizes = res
  dlhs = _gmm_loop(g, rhs, group_sizes, tile, True)
  drhs = _tgmm_loop(lhs, g, group_sizes, tile, rhs.shape[0]).astype(rhs.dtype)
  return dlhs, drhs, None


tiled_matmul.defvjp(_tiled_fwd, _tiled_bwd)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                   impl: str | None = None) -> jax.Array:
  """Rows of group g (consecutive, groups in order) times rhs[g]: [M, I] x [G, I, O] -> [M, O].

  Rows past sum(group_sizes) belong to no group: their output is zero and no gradient
  flows through them (the megablox kernel leaves them unwritten).

  Args:
    lhs: [M, I] rows sorted by group.
    rhs: [G, I, O] one matrix per group.
    group_sizes: [G] int32 rows of each group.
    impl: 'ragged_dot' (`jax.lax.ragged_dot`), 'gmm' (Pallas megablox; off TPU it runs
      in interpret mode, for tests) or 'tiled' (`tiled_matmul`: loops over row tiles in
      plain XLA); None: by the platform traced for (the mesh's, `sharding.mesh_platform`:
      also a TPU topology or GPU target planned from a CPU host): 'gmm' on TPU, 'tiled' on
      GPU (XLA:GPU expands ragged_dot densely), else 'ragged_dot'.
  """
  impl = _default_impl() if impl is None else impl
  if impl not in GROUPED_MATMUL_IMPLS:
    raise ValueError(f'grouped_matmul impl={impl!r}: expected one of {GROUPED_MATMUL_IMPLS}')
  m = lhs.shape[0]
  group_sizes = group_sizes.astype(jnp.int32)
  valid = (jnp.arange(m) < jnp.sum(group_sizes))[:, None]
  lhs = jnp.where(valid, lhs, 0)
  if impl == 'ragged_dot':
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes)
  elif impl == 'tiled':
    t = min(TILE_ROWS, -(-m // 8) * 8)
    pad = -m % t
    out = tiled_matmul(jnp.pad(lhs, ((0, pad), (0, 0))), rhs, group_sizes, t)[:m]
  else:
    # Imported here: only this path needs Pallas's TPU kernels.
    from jax.experimental.pallas.ops.tpu import megablox  # pylint: disable=g-import-not-at-top
    tm = min(128, -(-m // 16) * 16)
    pad = -m % tm
    tiling = (tm, min(128, lhs.shape[1]), min(128, rhs.shape[2]))
    out = megablox.gmm(jnp.pad(lhs, ((0, pad), (0, 0))), rhs, group_sizes, lhs.dtype, tiling,
                       interpret=sharding.mesh_platform() != 'tpu')[:m]
  return jnp.where(valid, out, 0)


def _experts(cfg: config_lib.ModelConfig, x, indices, weights, run):
  """`run(x, indices, weights)` (`_local_experts` or `_exchanged_experts` with their other
  arguments bound) over the N tokens `cfg.moe_chunk` at a time (all at once for 0 or
  N <= moe_chunk): a loop whose body saves nothing, so one chunk's dispatch buffers
  ([chunk x K, D] sorted tokens, [chunk x K, F] hidden) are live at a time in both passes."""
  n, d = x.shape
  c = cfg.moe_chunk
  if not c or n <= c:
    return run(x, indices, weights)
  m = -(-n // c)
  pad = lambda a: jnp.pad(a, ((0, m * c - n),) + ((0, 0),) * (a.ndim - 1)).reshape(
      m, c, *a.shape[1:])
  # Padded tokens carry zero weight: their output is zero and they cost one chunk's work.
  body = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)
  ys = jax.lax.map(lambda a: body(*a), (pad(x), pad(indices), pad(weights)))
  return ys.reshape(m * c, d)[:n]


# Local experts (+1) up to which `_dispatch` counts rather than sorts.
COUNTED_DISPATCH_MAX = 64


def _dispatch(key: jax.Array, e_loc: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Where each (token, choice) pair goes in the pairs sorted by expert, stably.

  Args:
    key: int32 [M], each pair's local expert (e_loc: another shard's, sorted last).
    e_loc: the local experts.

  Returns:
    (dest int32 [M]: pair p's row in the sorted order; order int32 [M]: the pair at each
    row, dest's inverse; sizes int32 [e_loc]: each local expert's pairs), the permutation a
    stable argsort of `key` gives. It is counted, not sorted: a pair's row is its expert's
    offset plus how many pairs before it chose that expert (a cumulative sum over a
    [M, e_loc + 1] one-hot), so the program holds no sort and no scatter-add, which the
    TPU compiler takes seconds each to build (a whole MoE train step spent most of its
    compile time on them). With more than COUNTED_DISPATCH_MAX - 1 local experts the
    [M, e_loc + 1] int32 counts would outweigh that, and a stable argsort finds the same rows.
  """
  m = key.shape[0]
  if e_loc + 1 > COUNTED_DISPATCH_MAX:
    # The one-hot would hold more than the sort costs: sort (same permutation).
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    dest = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32),
                                                   unique_indices=True)
    return dest, order, jnp.bincount(key, length=e_loc + 1)[:e_loc].astype(jnp.int32)
  hot = key[:, None] == jnp.arange(e_loc + 1, dtype=key.dtype)   # [M, e_loc + 1]
  seen = jnp.cumsum(hot, axis=0, dtype=jnp.int32)                # inclusive counts
  counts = seen[-1]
  offsets = jnp.cumsum(counts) - counts
  dest = jnp.sum(jnp.where(hot, seen - 1 + offsets, 0), axis=1, dtype=jnp.int32)
  order = jnp.zeros((m,), jnp.int32).at[dest].set(jnp.arange(m, dtype=jnp.int32),
                                                 unique_indices=True)
  return dest, order, counts[:e_loc]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_tokens(x: jax.Array, order: jax.Array, dest: jax.Array, n: int) -> jax.Array:
  """x [N, D]'s token of each sorted pair, the pairs in choice-major order: x[order % N],
  [M, D].

  Its gradient gathers too (`dest` is `order`'s inverse, each token's K pairs summed), where
  autodiff of a gather scatter-adds."""
  return x[order % n]


def _gather_tokens_fwd(x, order, dest, n):
  return x[order % n], (order, dest)


def _gather_tokens_bwd(n, res, g):
  order, dest = res
  k = dest.shape[0] // n
  gx = g[dest].reshape(k, n, -1).sum(axis=0, dtype=jnp.float32).astype(g.dtype)
  return gx, None, None


_gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


@jax.custom_vjp
def _permute_rows(y: jax.Array, idx: jax.Array, inverse: jax.Array) -> jax.Array:
  """y[idx] for a permutation idx with inverse `inverse`; its gradient is g[inverse]."""
  return y[idx]


def _permute_rows_fwd(y, idx, inverse):
  return y[idx], (idx, inverse)


def _permute_rows_bwd(res, g):
  idx, inverse = res
  return g[inverse], None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _local_experts(cfg: config_lib.ModelConfig, x, indices, weights, experts, first):
  """The routed experts held here over the pairs routed to them.

  Args:
    cfg: the model config.
    x: [N, D] tokens (compute dtype).
    indices: [N, K] global expert ids.
    weights: [N, K] float32 routing weights.
    experts: ([gate,] up, down) of the local experts [E_loc, D, F], [E_loc, F, D].
    first: global id of the first local expert (0, or traced under shard_map).

  Returns:
    [N, D]: sum over each token's choices of weight * expert(x) for the local experts
    (zero for choices whose expert lives elsewhere).
  """
  n, k = indices.shape
  e_loc = experts[-1].shape[0]
  # Pairs in choice-major order (pair j * N + i is token i's j-th choice): flattening [K, N]
  # is a plain copy, where flattening [N, K] relayouts a K-wide minor dimension, which the
  # TPU compiler took tens of seconds to build for K = 6.
  local = indices.T - first                                     # [K, N]
  mine = (local >= 0) & (local < e_loc)
  key = jnp.where(mine, local, e_loc).reshape(-1)              # [M]: others' pairs sort last
  dest, order, sizes = _dispatch(key, e_loc)
  xs = _gather_tokens(x, order, dest, n)                        # [M, D] sorted by expert
  out = _expert_mlp(cfg, xs, sizes, experts)                    # [M, D]
  out = _permute_rows(out, dest, order).reshape(k, n, -1)       # [K, N, D] in pair order
  weights = jnp.where(mine, weights.T, 0.0)
  # Summed in float32 without a float32 copy of the [K, N, D] expert outputs.
  return jnp.einsum('KN,KND->ND', weights.astype(out.dtype), out,
                    preferred_element_type=jnp.float32).astype(x.dtype)


def _expert_mlp(cfg: config_lib.ModelConfig, xs, sizes, experts):
  """Rows [R, D] sorted by local expert, `sizes` [E_loc] of them each (rows past their sum
  give zero), through their experts' MLPs: [R, D]."""
  gate = grouped_matmul(xs, experts[0], sizes) if len(experts) == 3 else None
  h = _activate(cfg, grouped_matmul(xs, experts[-2], sizes), gate)
  return grouped_matmul(h, experts[-1], sizes)


def _send(rows, send, start, recv, axes, shards: int, ragged: bool):
  """Rows [M, ...] sorted by destination shard (`send` [G] of them to each, from `start` [G])
  to their shards: [G * M, ...], the rows from shard s in slot s (its first recv[s] rows; the
  rest zero). `ragged`: `jax.lax.ragged_all_to_all` moves only the rows; else (XLA:CPU has
  no ragged all-to-all) every slot is padded to M rows and sent by `jax.lax.all_to_all`."""
  m = rows.shape[0]
  if ragged:
    out = jnp.zeros((shards * m,) + rows.shape[1:], rows.dtype)
    here = jnp.full((shards,), jax.lax.axis_index(axes) * m, jnp.int32)
    return jax.lax.ragged_all_to_all(rows, out, start, send, here, recv, axis_name=axes)
  r = jnp.arange(m, dtype=jnp.int32)
  idx = jnp.clip(start[:, None] + r[None, :], 0, m - 1)               # [G, M]
  mask = (r[None, :] < send[:, None]).reshape((shards, m) + (1,) * (rows.ndim - 1))
  buf = jnp.where(mask, rows[idx], 0).reshape((shards * m,) + rows.shape[1:])
  return jax.lax.all_to_all(buf, axes, 0, 0, tiled=True)


def _send_back(slots, dest_shard, send, start, recv, axes, shards: int, ragged: bool):
  """`_send`'s inverse: the slots [G * M, ...] (slot s: the rows shard s sent here, processed)
  back to their senders, each shard's rows in the order it sent them: [M, ...].
  `dest_shard` [M]: the shard each of this shard's sorted rows went to."""
  m = slots.shape[0] // shards
  if ragged:
    out = jnp.zeros((m,) + slots.shape[1:], slots.dtype)
    theirs = jax.lax.all_to_all(start, axes, 0, 0, tiled=True)   # where they began at each
    slot = jnp.arange(shards, dtype=jnp.int32) * m
    return jax.lax.ragged_all_to_all(slots, out, slot, recv, theirs, send, axis_name=axes)
  back = jax.lax.all_to_all(slots, axes, 0, 0, tiled=True)       # slot s: my rows, from s
  p = jnp.arange(m, dtype=jnp.int32)
  return back[dest_shard * m + p - start[dest_shard]]


def _exchanged_experts(cfg: config_lib.ModelConfig, x, indices, weights, experts, axes,
                       shards: int, ragged: bool):
  """The routed experts over this shard's own tokens, by all-to-all over the expert axes
  `axes` (G = `shards` shards, each holding E / G experts in order): each (token, choice)
  pair goes to the shard of its expert, runs there with the pairs other shards sent, and
  comes back by the inverse exchange, to be summed with its weight.

  Args:
    cfg: the model config.
    x: [N, D] this shard's tokens (compute dtype).
    indices: [N, K] global expert ids.
    weights: [N, K] float32 routing weights.
    experts: ([gate,] up, down) of the local experts.
    axes: the mesh axes the experts are split over.
    shards: G.
    ragged: exchange with `jax.lax.ragged_all_to_all` (else padded slots, `_send`).

  Returns:
    [N, D]: sum over each token's K choices of weight * expert(x).
  """
  n, k = indices.shape
  e_loc = experts[-1].shape[0]
  ids = indices.T.reshape(-1)                                   # [M] choice-major, global ids
  dest, order, _ = _dispatch(ids, cfg.num_experts)
  xs = _gather_tokens(x, order, dest, n)                        # [M, D] by expert, so by shard
  sorted_ids = ids[order]
  shard = sorted_ids // e_loc                                   # [M] the shard of each row
  send = jnp.sum(shard[None, :] == jnp.arange(shards, dtype=shard.dtype)[:, None], axis=1,
                 dtype=jnp.int32)                               # [G] pairs to each shard
  start = jnp.cumsum(send) - send
  recv = jax.lax.all_to_all(send, axes, 0, 0, tiled=True)       # [G] pairs from each shard
  got = _send(xs, send, start, recv, axes, shards, ragged)      # [G * M, D] in slots
  local = _send(sorted_ids - shard * e_loc, send, start, recv, axes, shards, ragged)
  real = (jnp.arange(n * k)[None, :] < recv[:, None]).reshape(-1)
  dest2, order2, sizes = _dispatch(jnp.where(real, local, e_loc), e_loc)
  out = _expert_mlp(cfg, _permute_rows(got, order2, dest2), sizes, experts)
  out = _permute_rows(out, dest2, order2)                       # back in slots
  out = _send_back(out, shard, send, start, recv, axes, shards, ragged)   # [M, D] sorted
  out = _permute_rows(out, dest, order).reshape(k, n, -1)       # [K, N, D] in pair order
  return jnp.einsum('KN,KND->ND', weights.T.astype(out.dtype), out,
                    preferred_element_type=jnp.float32).astype(x.dtype)


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _check_expert_axis(num_experts: int, mesh, rules: sharding.Rules) -> None:
  """A ValueError when the mesh's 'expert' axis (under the 'experts' rule of `rules`) does
  not divide E."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  ep = sizes.get('expert', 1)
  if ep > 1 and 'expert' in _axes(dict(rules).get('experts')) and (
      num_experts % ep):
    raise ValueError(f'num_experts={num_experts} is not divisible by the mesh\'s expert axis '
                     f'size {ep}: expert parallelism gives each shard num_experts / {ep} '
                     'experts')


def _shard_map(f, mesh, in_specs, out_specs):
  # Without varying-manual-axes checks: the megablox kernel's pallas_call declares outputs with
  # no manual axis types, which the check refuses (the collectives below are explicit, and the
  # sharded = unsharded tests check forward and every gradient).
  if hasattr(jax, 'shard_map'):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  from jax.experimental.shard_map import shard_map  # pylint: disable=g-import-not-at-top
  return shard_map(f, mesh, in_specs, out_specs, check_rep=False)


def _routed(cfg: config_lib.ModelConfig, x, indices, weights, experts,
            rules: sharding.Rules) -> jax.Array:
  """The routed experts' output [B, T, D]: whole without a mesh, else per shard as `rules`
  split it (module docstring: gather the expert group's tokens, local experts, reduce-scatter
  back)."""
  b, t, d = x.shape
  k = cfg.experts_per_token
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    run = functools.partial(_local_experts, cfg, experts=experts, first=0)
    y = _experts(cfg, x.reshape(b * t, d), indices.reshape(b * t, k),
                 weights.reshape(b * t, k), run)
    return y.reshape(b, t, d)
  _check_expert_axis(cfg.num_experts, mesh, rules)
  spec = sharding.logical_to_spec(('experts', 'embed', 'moe_mlp'), experts[-2].shape, mesh,
                                  rules)
  ep, tp = _axes(spec[0]), _axes(spec[2])
  # Rows over the batch axes and each row's tokens over the length axes (context
  # parallelism: a sequence shard routes only its own tokens), except any axis that also
  # splits F (its slices must see the same tokens to be summed).
  tokens = sharding.logical_to_spec(('batch', 'length'), (b, t), mesh, rules)
  rows, cols = ([a for a in _axes(entry) if a not in tp] for entry in tokens)
  gather = tuple(a for a in rows + cols if a in ep)  # the expert group's tokens come together
  spread = tuple(a for a in ep if a not in gather)   # tokens already whole across these
  row_spec = P(tuple(rows) or None, tuple(cols) or None, None)
  w_in, w_out = P(ep or None, None, tp or None), P(ep or None, tp or None, None)
  shards = int(np.prod([dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in ep]))
  e_loc = experts[-1].shape[0] // shards
  # All-to-all where every expert axis splits the tokens (else, e.g. a decode step of fewer
  # rows than shards, some shards hold the same tokens and the gather path runs).
  exchange = cfg.moe_dispatch == 'all_to_all' and ep and not spread
  ragged = sharding.mesh_platform() != 'cpu'

  def local(x, indices, weights, *experts):
    bl, tl = x.shape[:2]
    x, indices, weights = (x.reshape(bl * tl, d), indices.reshape(bl * tl, k),
                           weights.reshape(bl * tl, k))
    if exchange:
      run = functools.partial(_exchanged_experts, cfg, experts=experts, axes=ep,
                              shards=shards, ragged=ragged)
      y = _experts(cfg, x, indices, weights, run)
      if tp:
        y = jax.lax.psum(y, tp)
      return y.reshape(bl, tl, d)
    if gather:
      x, indices, weights = (jax.lax.all_gather(a, gather, axis=0, tiled=True)
                             for a in (x, indices, weights))
    first = jax.lax.axis_index(ep) * e_loc if ep else 0
    y = _experts(cfg, x, indices, weights,
                 functools.partial(_local_experts, cfg, experts=experts, first=first))
    if gather:
      y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
    if tp + spread:
      y = jax.lax.psum(y, tp + spread)
    return y.reshape(bl, tl, d)

  w_specs = (w_in,) * (len(experts) - 1) + (w_out,)
  return _shard_map(local, mesh, (row_spec, row_spec, row_spec) + w_specs, row_spec)(
      x, indices, weights, *experts)
