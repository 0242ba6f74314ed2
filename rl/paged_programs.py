"""The paged engine's device programs: jitted prefill, chunked prefill and decode over a page pool.

The KV cache is a pool of fixed-size pages, [L, K, pages, page_size, H], or
with the unrolled decode one [K, pages, page_size, H] array per layer (kept
so between calls; the mixture-of-experts families' layout, one per attention
sublayer); a row's cache is the pages its page-table row names. A model with
Mamba layers also keeps a state pool, one recurrent state per decode slot
(a tuple of `mamba.MambaState`, [slots, ...] each). The host
(`rl.scheduler`) decides which pages, rows and slots; these functions only
read and write them:

* `prefill` writes right-padded prompts into their pages from position 0 and
  copies pages (each sample's private copy of its prompt's last, partly
  filled page), and puts each prompt's final recurrent state in the slots of
  its rows;
* `extend` continues rows whose first tokens their pages already hold (a
  session's kept cache), attending to those pages as context, and from their
  kept recurrent state;
* `decode` runs up to a chunk of decode steps of every live slot, each slot
  drawing token n of row r with `fold_in(fold_in(rng, r), n)`, and stops
  early once enough slots are idle for the rows still waiting; its rows'
  recurrent states are gathered from their slots and scattered back (the
  padding rows of a packed call write nothing).

Pure functions of (graphdef, params, pools, host arrays); `rl.engine.Engine`
jits them with the pools donated.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models import config as config_lib
from models import hybrid
from models import mamba
from models import sharding
from models import transformer
from rl import sampling


class Slots(NamedTuple):
  """Device state of the decode slots (a pytree)."""
  k: jax.Array            # [L, K, pages, page_size, H]
  v: jax.Array
  lengths: jax.Array      # [S] tokens in each slot's cache
  last: jax.Array         # [S] the token to feed next
  n: jax.Array            # [S] tokens generated so far
  live: jax.Array         # [S] bool
  state: Any = None       # the rows' Mamba states (tuple of MambaState [S, ...]), or None


def pool_layer(pool) -> jax.Array:
  """An array of a pool, stacked [L, K, P, page_size, H] or per layer (a tuple of
  [K, P, page_size, H]): its last three axes are pages, page_size and H, as are its dtype's."""
  return pool[0] if isinstance(pool, tuple) else pool


def _pool_get(pool, index: tuple) -> jax.Array:
  """pool[:, :, *index] as one [L, K, ...] array, from either layout."""
  if isinstance(pool, tuple):
    return jnp.stack([p[(slice(None),) + index] for p in pool])
  return pool[(slice(None), slice(None)) + index]


def _pool_set(pool, index: tuple, values: jax.Array, rules: sharding.Rules):
  """pool[:, :, *index] = values [L, K, ...] (a page index past the pool is dropped), in the
  pool's layout, each array constrained to its page layout (`transformer.PAGE_AXES` under
  `rules`)."""
  if isinstance(pool, tuple):
    return tuple(sharding.constrain(
        p.at[(slice(None),) + index].set(values[i].astype(p.dtype), mode='drop'),
        transformer.PAGE_AXES[1:], rules) for i, p in enumerate(pool))
  pool = pool.at[(slice(None), slice(None)) + index].set(values.astype(pool.dtype), mode='drop')
  return sharding.constrain(pool, transformer.PAGE_AXES, rules)


def init_pool(cfg: config_lib.ModelConfig, num_pages: int, page_size: int, per_layer: bool,
              rules: sharding.Rules = sharding.DEFAULT_RULES):
  """Empty (k, v) pools laid out by `rules`: stacked, or per layer (the unrolled decode's
  layout); one array per attention sublayer for the mixture-of-experts families."""
  k, v = transformer.init_pages(cfg, num_pages, page_size, rules=rules)
  if per_layer:
    k, v = (transformer.split_layers(x, transformer.PAGE_AXES, rules) for x in (k, v))
  return k, v


def _constrain_states(states, rules: sharding.Rules):
  """Each MambaState of a tuple constrained to its layout under `rules` (rows on 'batch')."""
  return tuple(mamba.MambaState(*(sharding.constrain(x, ax, rules) for x, ax in
                                  zip(st, mamba.STATE_AXES))) for st in states)


def init_states(cfg: config_lib.ModelConfig, slots: int,
                rules: sharding.Rules = sharding.DEFAULT_RULES):
  """The slots' state pool: zero Mamba states, a tuple of MambaState [slots, ...], laid out
  by `rules`."""
  return _constrain_states(hybrid.init_states(cfg, slots, rules=rules), rules)


def take_state(states, slot):
  """Slot `slot`'s ([] int32) states, [1, ...] each (a copy, kept by a session)."""
  return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1), states)


def _gather_rows(states, index, rules: sharding.Rules):
  """states[index] for every array (an index past the pool gives zeros)."""
  return _constrain_states(jax.tree.map(
      lambda x: x.at[index].get(mode='fill', fill_value=0), states), rules)


def _scatter_rows(states, index, rows, rules: sharding.Rules):
  """states[index[j]] = rows[j] for every array (an index past the pool is dropped)."""
  return _constrain_states(jax.tree.map(
      lambda x, y: x.at[index].set(y.astype(x.dtype), mode='drop'), states, rows), rules)


def _to_pages(cache_kv, cfg, a: int, t: int, ps: int):
  """A prefill cache's keys (or values) as whole pages: stacked [L, A, K, T, H] ->
  [L, K, A * T / ps, ps, H], or per layer [A, K, T, H] -> [K, A * T / ps, ps, H] each."""
  if isinstance(cache_kv, tuple):
    return tuple(x.transpose(1, 0, 2, 3).reshape(cfg.num_kv_heads, a * (t // ps), ps,
                                                 cfg.head_dim) for x in cache_kv)
  return cache_kv.transpose(0, 2, 1, 3, 4).reshape(
      cfg.num_layers, cfg.num_kv_heads, a * (t // ps), ps, cfg.head_dim)


def _unpack(graphdef, params, tokens, k_pool, rules: sharding.Rules):
  """(model, its config, tokens' [A, T], the pool's (pages, page size)) of a paged program;
  the model traces with `rules`."""
  model = nnx.merge(graphdef, params)
  model.rules = rules
  return model, model.cfg, tokens.shape, pool_layer(k_pool).shape[-3:-1]


def routing_dtype(num_experts: int):
  """The compact dtype recorded expert ids take: uint8 up to 256 experts, else uint16/int32."""
  if num_experts <= 256:
    return jnp.uint8
  return jnp.uint16 if num_experts <= 65536 else jnp.int32


def _routed(stats, rows: int, width: int, cfg, record: bool, rules: sharding.Rules):
  """With `record`, a pass's experts [M, A, T, k] as [A, T, M, k] in `routing_dtype` (zeros
  where the pass ran no tokens: `width` 0), rows laid out by `rules`; else None."""
  if not record:
    return None
  dt = routing_dtype(cfg.num_experts)
  if stats is None:
    return jnp.zeros((rows, width, cfg.mixers.count('moe'), cfg.experts_per_token), dt)
  return sharding.constrain(jnp.moveaxis(stats.indices, 0, 2).astype(dt),
                            ('batch', None, None, None), rules)


def prefill(graphdef, params, k_pool, v_pool, tokens, segment_ids, dst_pages, copy_src,
             copy_dst, states=None, state_src=None, state_dst=None, *, record: bool = False,
             rules: sharding.Rules = sharding.DEFAULT_RULES):
  """Prefills right-padded prompts into pages, then copies pages (a prompt's partial page);
  with Mamba layers, puts each prompt's final state in its rows' slots.

  Args:
    k_pool, v_pool: the pools, stacked or per layer (tuples; see `decode`).
    tokens: [A, T] int32, each prompt's tokens from position 0 (T a multiple
      of the page size, or 0: copies only), padding after them.
    segment_ids: [A, T] int32, 1 = a real token.
    dst_pages: [A, T / page_size] int32 page receiving each page of a row;
      an index past the pool drops it (padding and pages a row does not use).
    copy_src, copy_dst: [C] int32 pages copied after the prefill (dst past the
      pool: no copy).
    states: the slots' state pool (`init_states`), or None (no Mamba layers).
    state_src, state_dst: [C] int32: slot state_dst[j] gets the state after prompt
      state_src[j]'s tokens (a zero state for a prompt without tokens); a slot past the
      pool: none.
    record: static; also return each token's experts (routing replay).
    rules: static; the logical rules the program traces with (`models.sharding`).

  Returns:
    (k_pool, v_pool, states), and with `record` the prompts' routing [A, T, M, k].
  """
  model, cfg, (a, t), (num_pages, ps) = _unpack(graphdef, params, tokens, k_pool, rules)
  final = stats = None
  if t:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (a, t))
    dtype = pool_layer(k_pool).dtype
    _, cache, stats = model.hidden(tokens, positions, segment_ids, return_stats=True,
                                   cache=transformer.init_cache(cfg, a, t, dtype=dtype,
                                                                rules=rules))
    # Whole pages, scattered by page id.
    dst = (dst_pages.reshape(-1),)
    k_pool = _pool_set(k_pool, dst, _to_pages(cache.k, cfg, a, t, ps), rules)
    v_pool = _pool_set(v_pool, dst, _to_pages(cache.v, cfg, a, t, ps), rules)
    final = cache.state      # after each row's last real token
  src = (jnp.minimum(copy_src, num_pages - 1),)
  k_pool = _pool_set(k_pool, (copy_dst,), _pool_get(k_pool, src), rules)
  v_pool = _pool_set(v_pool, (copy_dst,), _pool_get(v_pool, src), rules)
  if states is not None:
    if final is None:
      final = hybrid.init_states(cfg, a, rules=rules)
    states = _scatter_rows(states, state_dst, _gather_rows(final, state_src, rules), rules)
  out = k_pool, v_pool, states
  return out + (_routed(stats, a, t, cfg, True, rules),) if record else out


def extend(graphdef, params, k_pool, v_pool, tokens, segment_ids, starts, page_table,
            states=None, incoming=None, state_src=None, state_dst=None, *,
            context_pages: int, record: bool = False,
            rules: sharding.Rules = sharding.DEFAULT_RULES):
  """Continues rows whose first `starts[a]` tokens are in their pages (a chunked prefill).

  Each row's first `context_pages` pages are gathered into a dense cache, the
  new tokens attend to its first `starts[a]` tokens and to each other
  (causally), and their keys/values are written to the pages at positions
  starts[a], starts[a] + 1, ... With Mamba layers the new tokens continue
  each row's `incoming` state, and the state after them goes to its slots.

  Args:
    tokens: [A, T] int32 new tokens, padding after them (T = 0: states only).
    segment_ids: [A, T] int32, 1 = a real token.
    starts: [A] int32 tokens already in each row's pages (<= context_pages * page_size).
    page_table: [A, M] int32 each row's pages (covering starts + its new tokens).
    states: the slots' state pool (`init_states`), or None (no Mamba layers).
    incoming: with states, each row's state after its first `starts[a]` tokens (a tuple of
      MambaState [A, ...]).
    state_src, state_dst: [C] int32: slot state_dst[j] gets row state_src[j]'s final state
      (a slot past the pool: none).
    context_pages: pages gathered as context (static).
    record: static; also return each new token's experts (routing replay).
    rules: static; the logical rules the program traces with (`models.sharding`).

  Returns:
    (k_pool, v_pool, states), and with `record` the new tokens' routing [A, T, M, k].
  """
  model, cfg, (a, t), (num_pages, ps) = _unpack(graphdef, params, tokens, k_pool, rules)
  final, stats = incoming, None
  if t:
    k_pool, v_pool, final, stats = _extend_pages(model, cfg, k_pool, v_pool, tokens,
                                                 segment_ids, starts, page_table, incoming,
                                                 context_pages, ps, num_pages)
  if states is not None:
    states = _scatter_rows(states, state_dst, _gather_rows(final, state_src, rules), rules)
  out = k_pool, v_pool, states
  return out + (_routed(stats, a, t, cfg, True, rules),) if record else out


def _extend_pages(model, cfg, k_pool, v_pool, tokens, segment_ids, starts, page_table,
                  incoming, context_pages, ps, num_pages):
  """`extend`'s model pass and page writes; returns (k_pool, v_pool, final states, the
  pass's MoEStats or None). The model's `rules` lay the gathered context out."""
  a, t = tokens.shape
  rules = model.rules
  c = context_pages * ps
  ctx = jnp.minimum(page_table[:, :context_pages], num_pages - 1)   # past a row's pages: masked

  def gathered(pool):   # [L, K, A, W, ps, H] -> [L, A, K, W * ps + T, H]
    x = _pool_get(pool, (ctx,)).reshape(cfg.num_layers, cfg.num_kv_heads, a, c, cfg.head_dim)
    x = jnp.pad(x.transpose(0, 2, 1, 3, 4), ((0, 0), (0, 0), (0, 0), (0, t), (0, 0)))
    return sharding.constrain(x, transformer.CACHE_AXES, rules)

  def gathered_layer(pool):   # [K, A, W, ps, H] -> [A, K, W * ps + T, H]
    x = pool[:, ctx].reshape(cfg.num_kv_heads, a, c, cfg.head_dim)
    x = jnp.pad(x.transpose(1, 0, 2, 3), ((0, 0), (0, 0), (0, t), (0, 0)))
    return sharding.constrain(x, transformer.CACHE_AXES[1:], rules)

  seg = jnp.concatenate([(jnp.arange(c)[None] < starts[:, None]).astype(jnp.int32),
                         jnp.zeros((a, t), jnp.int32)], axis=1)
  if cfg.kv_stacked:   # the model takes one stacked [L, ...] cache per side
    k, v = gathered(k_pool), gathered(v_pool)
  else:   # one buffer per attention sublayer (models/hybrid.py)
    k, v = tuple(map(gathered_layer, k_pool)), tuple(map(gathered_layer, v_pool))
  cache = transformer.Cache(k=k, v=v, segment_ids=seg, index=jnp.asarray(c, jnp.int32),
                            state=incoming)
  positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  _, cache, stats = model.hidden(tokens, positions, segment_ids, cache=cache,
                                 return_stats=True)
  col = jnp.minimum(positions // ps, page_table.shape[1] - 1)
  page = jnp.where(segment_ids > 0, jnp.take_along_axis(page_table, col, axis=1), num_pages)
  off = positions % ps
  # [L, A, K, T, H] -> [L, K, A, T, H] (per layer [A, K, T, H] -> [K, A, T, H]), the indexed
  # region of pool[:, :, page, off].
  if cfg.kv_stacked:
    new = lambda x: x[:, :, :, c:].transpose(0, 2, 1, 3, 4)
  else:
    new = lambda xs: tuple(x[:, :, c:].transpose(1, 0, 2, 3) for x in xs)
  return (_pool_set(k_pool, (page, off), new(cache.k), rules),
          _pool_set(v_pool, (page, off), new(cache.v), rules), cache.state, stats)


def decode(graphdef, params, state: Slots, page_table, rows, limits, rng, temperature,
            top_p, top_k, refill_at, states=None, state_slots=None, *, chunk: int,
            eos_ids: tuple[int, ...], pad_id: int, greedy: bool, filtered: bool,
            record: bool = False, rules: sharding.Rules = sharding.DEFAULT_RULES):
  """Up to `chunk` decode steps of every live slot.

  Stops early once every slot is idle, or once `refill_at` slots are idle
  (the host then puts waiting rows in them).

  With `record` (routing replay) each step also returns the experts of the token each row
  fed, and a row that ends (a stop token or its limit) runs one more forward, of its last
  token, sampling nothing: its *tail*. The tail writes that token's keys/values (its pages
  cover it: `rl.scheduler`) and advances its recurrent state, so every token of a row is
  forwarded once, as the one-call sampler's last-step forward does. A call whose steps end
  with tails pending runs one step more for them alone (`chunk + 1` columns).

  Args:
    state: the slots (pools, lengths, last tokens, counts, live flags; its `state`
      unused: the rows' Mamba states come from `states`).
    page_table: [S, M] int32 pages viewed (M covers every live slot's
      tokens to the end of the call).
    rows: [S] int32 row index of each slot (its noise stream).
    limits: [S] int32 the most tokens each slot's row may generate.
    rng: the call's PRNG key.
    temperature, top_p, top_k: traced sampling scalars.
    refill_at: [] int32 idle slots that end the call early.
    states: the slots' state pool (`init_states`), or None (no Mamba layers).
    state_slots: with states, [S] int32 each row's slot in the pool (a padding row's is
      past the pool: it reads zeros and writes nothing).
    record: static; record the fed tokens' experts and run the tails.
    rules: static; the logical rules the program traces with (`models.sharding`).

  Returns:
    (state, steps run [], tokens [S, C], logprobs, sampling_logprobs, states), and with
    `record` the routing [S, C, M, k] (`routing_dtype`; column i: the experts of the token each row fed
    at step i; zeros where it fed none) and fed [S] int32 (tokens each row fed, its tail
    included). C = chunk (+ 1 with `record`). Column i holds step i's token of each slot
    live at that step (pad_id / 0 elsewhere); the rows' states written back to their slots.
  """
  model = nnx.merge(graphdef, params)
  model.rules = rules
  cfg = model.cfg
  s = rows.shape[0]
  cols = chunk + int(record)
  eos = jnp.asarray(eos_ids, jnp.int32)
  is_stop = lambda tok: (jnp.any(tok[:, None] == eos, axis=-1) if eos_ids
                         else jnp.zeros(tok.shape, bool))
  row_keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, rows)
  pick = functools.partial(sampling.pick, temperature=temperature, top_p=top_p,
                           top_k=top_k, greedy=greedy, filtered=filtered)
  batch_only = ('batch', None)
  buf = lambda fill, dt: sharding.constrain(jnp.full((s, cols), fill, dt), batch_only, rules)
  # Pools kept per layer (tuples of [K, P, page_size, H], the Sampler's
  # decode_layers='unrolled'): the blocks run unrolled over their weights, sliced once for
  # the call, and over their own pools.
  layers = model.layer_states() if isinstance(state.k, tuple) else None
  sampling_on = lambda i, st: (i < chunk) & (s - jnp.sum(st.live) < refill_at)

  def body(carry):
    i, st, toks, lps, slps, tail, route = carry
    # Rows that sample this step (none once the call's steps are over: tails only).
    act = st.live & sampling_on(i, st)
    fed = act | tail
    cache = transformer.PagedCache(k=st.k, v=st.v, page_table=page_table,
                                   lengths=st.lengths, live=fed, state=st.state)
    logits, cache, stats = model.decode_paged(st.last, st.lengths, cache, layers=layers,
                                              return_stats=True)
    keys = jax.vmap(jax.random.fold_in)(row_keys, st.n)
    tok, lp, slp = pick(logits, keys)
    tok = jnp.where(act, tok, pad_id)
    col = lambda a, x: jax.lax.dynamic_update_slice(a, x[:, None], (0, i))
    n = st.n + act
    stop = act & (is_stop(tok) | (n >= limits))
    if record:
      got = jnp.where(fed[:, None, None], _routed(stats, s, 1, cfg, True, rules)[:, 0], 0)
      route = jax.lax.dynamic_update_slice(route, got[:, None], (0, i, 0, 0))
      tail = stop
    st = Slots(k=cache.k, v=cache.v, lengths=st.lengths + fed,
               last=jnp.where(act, tok, st.last), n=n, live=st.live & ~stop, state=cache.state)
    return (i + 1, st, col(toks, tok), col(lps, jnp.where(act, lp, 0.)),
            col(slps, jnp.where(act, slp, 0.)), tail, route)

  def cond(carry):
    i, st, tail = carry[0], carry[1], carry[5]
    return (sampling_on(i, st) & jnp.any(st.live)) | jnp.any(tail)

  # A non-live row is padding to the Mamba mixers: its state stays as gathered.
  state = state._replace(state=None if states is None
                         else _gather_rows(states, state_slots, rules))
  route = None
  if record:
    route = sharding.constrain(
        jnp.zeros((s, cols, cfg.mixers.count('moe'), cfg.experts_per_token),
                  routing_dtype(cfg.num_experts)),
        ('batch', None, None, None), rules)
  lengths0 = state.lengths
  init = (jnp.zeros((), jnp.int32), state, buf(pad_id, jnp.int32), buf(0, jnp.float32),
          buf(0, jnp.float32), jnp.zeros((s,), bool), route)
  steps, state, toks, lps, slps, _, route = jax.lax.while_loop(cond, body, init)
  if states is not None:
    states = _scatter_rows(states, state_slots, state.state, rules)
  out = state._replace(state=None), steps, toks, lps, slps, states
  return out + (route, state.lengths - lengths0) if record else out


DECODE_STATIC = ('chunk', 'eos_ids', 'pad_id', 'greedy', 'filtered', 'record', 'rules')
