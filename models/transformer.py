"""The policy model, in Flax NNX: embeddings, a decoder stack, the output projection. Every
family's stack (the dense Llama-3 / Qwen2 / Qwen3 decoders' stacked Blocks, the
mixture-of-experts families' sublayer patterns) is run by models/hybrid.py's `run`.

Shape letters: B batch, T query length, S key length (cache slots), D embed,
N query heads, K kv heads, G = N // K, H head_dim, F mlp, V vocab.

Calling convention (the contract the rest of cascade relies on):

  logits = model(tokens)                                   # [B, T, V] float32
  logits = model(tokens, positions, segment_ids)           # packed rows
  logits, cache = model(tokens, positions, segment_ids, cache=cache)

`segment_ids` (int32 [B, T]) separate packed sequences: a token attends only
to earlier tokens of its own segment; id 0 marks padding, which nothing
attends to. With a cache, the new keys/values are written at slots
[cache.index, cache.index + T) and the queries attend to every earlier slot of
their own segment, so prefill followed by one-token decode steps equals the
full forward pass. The model holds no training logic and does no I/O.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models import attention
from models import config as config_lib
from models import context
from models import hybrid
from models import sharding
from models.layers import (MLP, Attention, RMSNorm, _matmul, _PagedStep, _param,  # noqa: F401
                           apply_rope)


class Cache(NamedTuple):
  """Preallocated KV cache; a pytree.

  Attributes:
    k: keys of every layer [L, B, K, S, H] (RoPE already applied), or in the
      unrolled decode's layout (`unstack_cache`) a tuple of L [B, K, S, H].
    v: values of every layer, likewise.
    segment_ids: [B, S] int32 segment of each slot; 0 = empty or padding.
    index: [] int32, the next slot to write.
    state: the mixture-of-experts families' Mamba states, a tuple of
      `mamba.MambaState` (one per Mamba sublayer, [B, ...] each); None for the dense
      families. Their k and v are tuples of one [B, K, S, H] buffer per attention
      sublayer (models/hybrid.py).

  One stacked array per side, so the layer scan carries it and writes only
  the new tokens' slots of each layer in place (no per-step restacking).
  Slots are the fourth axis so both attention einsums have (B, K) as leading
  batch dims: with [B, S, K, H], XLA:CPU transposed every layer's whole cache
  on every decode step (3x slower decoding at 1K slots in a probe).
  """
  k: jax.Array
  v: jax.Array
  segment_ids: jax.Array
  index: jax.Array
  state: Any = None


CACHE_AXES = ('layers', 'batch', 'kv_heads', 'cache_length', 'head_dim')


class PagedCache(NamedTuple):
  """A KV cache of fixed-size pages shared by decode slots; a pytree.

  Attributes:
    k: keys of every layer [L, K, P, page_size, H] (RoPE applied): P pages.
    v: values, likewise.
    page_table: [S, M] int32, slot s's token j lives in page
      page_table[s, j // page_size] at offset j % page_size.
    lengths: [S] int32 tokens already in each slot's cache: a decode step
      writes its token at position `lengths[s]`.
    live: [S] bool; a slot that is not live writes nothing.
    state: the slots' Mamba states (a tuple of `mamba.MambaState`, [S, ...] each) for
      the mixture-of-experts families, whose k and v are tuples of per-attention-sublayer
      pools [K, P, page_size, H]; None for the dense families.

  Pages lead the layer's kv heads, the layout of TPU's paged-attention kernel.
  """
  k: jax.Array
  v: jax.Array
  page_table: jax.Array
  lengths: jax.Array
  live: jax.Array
  state: Any = None


# A paged KV pool: [layers, kv heads, pages, page_size, head_dim], its pages split over the
# batch shards as the slots are (rl.engine gives a slot pages of its own shard only).
PAGE_AXES = ('layers', 'kv_heads', 'batch', None, 'head_dim')


def init_pages(cfg: config_lib.ModelConfig, pages: int, page_size: int, dtype=None,
               rules: sharding.Rules = sharding.DEFAULT_RULES):
  """Empty key and value page pools [L, K, pages, page_size, H] (dtype: the compute dtype),
  laid out by `rules`."""
  dtype = cfg.jnp_dtype if dtype is None else dtype
  shape = (cfg.attention_layers, cfg.num_kv_heads, pages, page_size, cfg.head_dim)
  zeros = lambda: sharding.constrain(jnp.zeros(shape, dtype), PAGE_AXES, rules)
  return zeros(), zeros()


def init_cache(cfg: config_lib.ModelConfig, batch: int, length: int,
               dtype=None, rules: sharding.Rules = sharding.DEFAULT_RULES) -> Cache:
  """An empty cache of `length` slots for `batch` rows (dtype: the compute dtype), laid out by
  `rules`; for the mixture-of-experts families per-sublayer buffers and zero Mamba states
  (models/hybrid.py)."""
  dtype = cfg.jnp_dtype if dtype is None else dtype
  if not cfg.kv_stacked:
    k, v = hybrid.init_kv(cfg, batch, length, dtype, rules)
    return Cache(k=k, v=v, segment_ids=jnp.zeros((batch, length), jnp.int32),
                 index=jnp.zeros((), jnp.int32), state=hybrid.init_states(cfg, batch,
                                                                          rules=rules))
  shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
  zeros = lambda: sharding.constrain(jnp.zeros(shape, dtype), CACHE_AXES, rules)
  return Cache(k=zeros(), v=zeros(),
               segment_ids=jnp.zeros((batch, length), jnp.int32),
               index=jnp.zeros((), jnp.int32))


def split_layers(x: jax.Array, axes: tuple,
                 rules: sharding.Rules = sharding.DEFAULT_RULES) -> tuple[jax.Array, ...]:
  """A stacked [L, ...] array (logical `axes`, 'layers' first) as L arrays (copies), laid out
  by `rules`."""
  return tuple(sharding.constrain(x[i], axes[1:], rules) for i in range(x.shape[0]))


def unstack_cache(cache: Cache, rules: sharding.Rules = sharding.DEFAULT_RULES) -> Cache:
  """`cache` with one [B, K, S, H] array per layer (a copy), the layout `Transformer.hidden`
  takes with `layers`: each layer then writes and reads its own buffer, where a stacked
  cache costs a slice of the layer's keys and values on every step on XLA:CPU. A cache
  already per layer (the mixture-of-experts families') is returned as it is."""
  if isinstance(cache.k, tuple):
    return cache
  return cache._replace(k=split_layers(cache.k, CACHE_AXES, rules),
                        v=split_layers(cache.v, CACHE_AXES, rules))


# The dense families' unit lives with the stack runner (models/hybrid.py).
Block = hybrid.Block


def _host_offload_supported() -> bool:
  """Whether the default backend has a pinned host memory space (TPU, GPU and CPU do)."""
  try:
    return 'pinned_host' in {m.kind for m in jax.devices()[0].addressable_memories()}
  except (AttributeError, NotImplementedError):
    return False


def _remat(body, cfg: config_lib.ModelConfig, prevent_cse: bool | None = None):
  """`body` (one block) under the checkpoint policy `cfg.remat` names.

  'full' saves nothing but the block's input (the carry); 'save_attention_out'
  also keeps the attention sublayer's output [B, T, D], so the backward pass
  recomputes only what the attention's own gradient needs; 'offload' moves the
  block inputs to pinned host memory between the passes, and behaves as
  'full' on a backend without one.
  """
  names = jax.checkpoint_policies
  if cfg.remat == 'none':
    return body
  if cfg.remat == 'save_attention_out':
    policy = names.save_only_these_names('attention_out')
  elif cfg.remat == 'offload' and _host_offload_supported():
    policy = names.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=('block_input',),
        offload_src='device', offload_dst='pinned_host')
  else:
    policy = names.nothing_saveable
  # Inside a scan the body cannot be CSE'd with its recomputation anyway.
  prevent_cse = not cfg.scans_layers if prevent_cse is None else prevent_cse
  return jax.checkpoint(body, policy=policy, prevent_cse=prevent_cse)


class Transformer(nnx.Module):
  """The policy: embeddings, `num_layers` blocks, final norm, output projection.

  Attributes (plain, static; set them on the instance a trace calls):
    collect_moe_stats: `hidden` sows the 'moe' sublayers' `hybrid.MoEStats` as an
      nnx.Intermediate 'moe_stats' for `hybrid.moe_stats` to pop (default False): the train
      step sets it on the model its loss traces. Nowhere else: a sampler's decode loop calls
      the model inside a loop whose trace may not write the module's state.
    accumulate_fold_backward: a rematerialised Fold's backward pass is
      `hybrid._accumulating_scan`'s (True, the default) or autodiff's (False; tests compare
      the two).
    rules: the logical rules (`models.sharding`, a tuple of pairs) the model's activations
      and caches are laid out by on the mesh traced for (default DEFAULT_RULES). Whoever
      traces the model sets its own: a train step its rules, a sampler its (which may move
      only `sharding.ACTIVATION_AXES`). Every method hands them on, as an argument, to each
      sublayer and function below; nothing reads them from anywhere else.
  """

  def __init__(self, cfg: config_lib.ModelConfig, *, rngs: nnx.Rngs, layout: str | None = None):
    """`layout`: a sublayer pattern kept as a 'fold' or as 'segments' whatever the pattern
    (`hybrid.folds`; None: by the pattern), for comparing the two layouts of one pattern."""
    self.cfg = cfg
    self.collect_moe_stats = False
    self.accumulate_fold_backward = True
    self.rules = sharding.DEFAULT_RULES
    pd = cfg.jnp_param_dtype
    self.embed = _param(rngs, (cfg.vocab_size, cfg.embed_dim), ('vocab', 'embed'), pd)
    if cfg.spec.stack == 'blocks':
      self.layers = hybrid.stack_blocks([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    else:   # the mixture-of-experts families: a pattern of sublayers (models/hybrid.py)
      self.blocks = hybrid.build(cfg, rngs, layout)
    self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pd)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.embed_dim, cfg.vocab_size), ('embed', 'vocab'), pd)

  def layer_states(self) -> list[nnx.State]:
    """Each block's parameters, sliced out of the stack (copies): `hidden`'s `layers`; None
    for the mixture-of-experts families (their repeated segments' stacks are run by
    models/hybrid.py, scanned or looped by `scan_layers`)."""
    if not self.cfg.kv_stacked:
      return None
    state = nnx.state(self.layers)
    return [jax.tree.map(lambda a, i=i: a[i], state) for i in range(self.cfg.num_layers)]

  def hidden(self, tokens, positions=None, segment_ids=None, cache=None, layers=None,
             routing=None, *, replay=True, return_stats=False):
    """Final-normed hidden states [B, T, D] and the updated cache (None without one); with
    `return_stats`, (hidden, cache, stats).

    `layers` (with a cache in the `unstack_cache` layout): the blocks' parameters as
    `layer_states` gives them, run as an unrolled loop; a decode loop slices them once
    outside its body, where the stacked blocks are sliced on every step (on XLA:CPU a
    copy of every weight per token).

    The mixture-of-experts families take `routing` ([M, B, T, k] int experts per 'moe'
    sublayer: routing replay; with `replay=False` only compared with the routers' own
    choice, `hybrid.MoEStats.mismatched`) and, where `collect_moe_stats` is set, sow what
    their 'moe' sublayers report as an nnx.Intermediate 'moe_stats' (`hybrid.moe_stats` pops
    it). `return_stats` hands that `hybrid.MoEStats` back instead (None for the dense
    families): the way a sampler's decode loop, whose trace may not write the module's state,
    records each token's experts.
    """
    cfg, rules = self.cfg, self.rules
    b, t = tokens.shape
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    if positions is None:
      start = 0 if cache is None else cache.index
      positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))

    # Context parallelism (models.context): a row split along T over the sequence axis runs
    # in zig-zag chunk order, entered here once and left after the last block. Attention and
    # the Mamba-2 mixers see that order (their shard_maps know it); a call with a cache
    # (prefill, decode) is not context-parallel.
    cp = cache is None and context.shards(t, rules) > 1
    if cp:
      zz = lambda a: context.to_zigzag(a, ('batch', 'length'), rules)
      segment_ids, positions = zz(segment_ids), zz(positions)
      if routing is not None:
        routing = context.to_zigzag(routing, (None, 'batch', 'length', None), rules)

    # Who sees whom, as segment ids (attention.py never needs a [T, S] mask).
    if cache is None:
      mask = attention.MaskInfo(segment_ids, segment_ids)
    else:
      k_seg = jax.lax.dynamic_update_slice(cache.segment_ids, segment_ids, (0, cache.index))
      mask = attention.MaskInfo(segment_ids, k_seg, cache.index)

    # Gather the fsdp shards of the table first (the FSDP pattern): a lookup into a
    # table split along 'embed' cannot produce batch-split activations without
    # a full rematerialisation.
    table = sharding.constrain(self.embed.value, ('vocab', None), rules)
    x = jnp.take(table, tokens, axis=0).astype(cfg.jnp_dtype)
    x = sharding.constrain(x, ('batch', 'length', 'embed'), rules)
    if cp:
      x = context.to_zigzag(x, ('batch', 'length', 'embed'), rules)
    unzz = lambda a: context.from_zigzag(a, ('batch', 'length', 'embed'), rules) if cp else a
    kv = None if cache is None else (cache.k, cache.v, cache.index)
    x, ks, vs, states, stats = hybrid.run(
        self._stack(), cfg, x, positions, mask, segment_ids, kv=kv,
        states=None if cache is None else cache.state, routing=routing, replay=replay,
        remat=None if cfg.remat == 'none' else lambda body, cse: _remat(body, cfg, cse),
        accumulate=self.accumulate_fold_backward, layer_states=layers, rules=rules)
    if stats is not None and cp:
      # Per-token reports back in the rows' own order (token_differs too: the train step ands
      # it with the loss mask).
      stats = stats._replace(indices=context.from_zigzag(
          stats.indices, (None, 'batch', 'length', None), rules))
      if stats.token_differs is not None:
        stats = stats._replace(token_differs=context.from_zigzag(
            stats.token_differs, ('batch', 'length'), rules))
    if stats is not None and self.collect_moe_stats and not return_stats:
      self.sow(nnx.Intermediate, 'moe_stats', stats)
    x = self.final_norm(unzz(x))
    new_cache = None if cache is None else Cache(k=ks, v=vs, segment_ids=k_seg,
                                                 index=cache.index + t, state=states)
    return (x, new_cache, stats) if return_stats else (x, new_cache)

  def _stack(self):
    """The decoder stack `hybrid.run` runs: the dense families' stacked Block, or the
    blocks of a sublayer pattern."""
    return self.layers if self.cfg.spec.stack == 'blocks' else self.blocks

  def decode_paged(self, tokens, positions, cache: PagedCache, layers=None, *,
                   return_stats=False):
    """One decode step for every slot of a paged cache.

    Args:
      tokens: [S] int32, each slot's newest token (the one to write).
      positions: [S] int32 its RoPE position.
      cache: the PagedCache; slot s's token goes to position `cache.lengths[s]`.
      layers: the blocks' parameters as `layer_states` gives them, with the pools as
        tuples of per-layer [K, P, page_size, H] (`split_layers`): the blocks run
        unrolled (see `hidden`).

      return_stats: also return the step's `hybrid.MoEStats` (the mixture-of-experts
        families; None for the others): how the paged engine records routing.

    Returns:
      (logits [S, V] float32, cache with k/v written; page_table, lengths and
      live unchanged: the caller advances them), and the stats with `return_stats`.
    """
    cfg, rules = self.cfg, self.rules
    table = sharding.constrain(self.embed.value, ('vocab', None), rules)
    x = jnp.take(table, tokens[:, None], axis=0).astype(cfg.jnp_dtype)
    x = sharding.constrain(x, ('batch', 'length', 'embed'), rules)
    x, ks, vs, states, stats = hybrid.run(self._stack(), cfg, x, positions, None, None,
                                          states=cache.state, paged=cache, layer_states=layers,
                                          rules=rules)
    logits = self.logits_from_hidden(self.final_norm(x))[:, 0]
    out = logits, cache._replace(k=ks, v=vs, state=states)
    return out + (stats,) if return_stats else out

  def logits_from_hidden(self, x):
    """Output projection in float32: [B, T, D] -> [B, T, V]."""
    dt = self.cfg.jnp_dtype
    if self.cfg.tie_embeddings:
      logits = _matmul(x, self.embed.value.astype(dt).T)
    else:
      logits = _matmul(x, self.lm_head.value.astype(dt))
    return sharding.constrain(logits.astype(jnp.float32), ('batch', 'length', 'vocab'),
                              self.rules)

  def __call__(self, tokens, positions=None, segment_ids=None, cache=None, layers=None,
               routing=None):
    """Logits [B, T, V] float32; with a cache, (logits, updated cache).

    Args:
      tokens: int32 [B, T].
      positions: int32 [B, T] RoPE positions (default: 0.., or from cache.index).
      segment_ids: int32 [B, T]; 0 = padding (default: all ones).
      cache: a `Cache` to read and extend, or None.
      layers: per-layer parameters for an unrolled pass (see `hidden`).
      routing: experts per 'moe' sublayer (routing replay; see `hidden`).
    """
    x, new_cache = self.hidden(tokens, positions, segment_ids, cache, layers, routing)
    logits = self.logits_from_hidden(x)
    return logits if cache is None else (logits, new_cache)


def create(cfg: config_lib.ModelConfig, seed: int = 0, mesh=None, rules=None,
           layout: str | None = None) -> Transformer:
  """A freshly initialised Transformer, born sharded on `mesh` when one is given (`layout`:
  see `Transformer`)."""
  return sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(seed), layout=layout),
                                 mesh, rules)
