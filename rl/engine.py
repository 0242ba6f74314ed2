"""Rollout engine v2: continuous batching over a paged KV cache.

The one-call sampler (`rl.sampler.sample`) decodes every row of a call in one
loop that runs until the longest row stops, each row holding a cache of the
full length throughout. With long-tailed response lengths (most reasoning
rollouts end far below the cap, a few reach it) most of those decode slots
and cache slots are idle. This engine keeps a fixed number of decode *slots*
busy instead:

* The KV cache is a pool of fixed-size pages ([L, K, pages, page_size, H], or
  with the unrolled decode one [K, pages, page_size, H] array per layer, kept
  so between calls); each slot has a row of the page table and its own length,
  so rows of any prompt length sit side by side without left padding.
* When a slot's row stops (a stop token or its length limit), the host puts
  the next pending row in it: the decode runs in device calls of at most
  `chunk_steps` steps, and a call returns early once enough slots are free
  for the rows still waiting. The loop ends when no row is pending or live.
* The G samples of a prompt share its prefill: the prompt's first `len - 1`
  tokens are prefilled once into pages that every sample's page table points
  at; the page those samples go on writing (the prompt's last, partly
  filled page) is copied for each of them. Each sample's first decode step
  feeds the prompt's last token, so every slot runs the same step.
* Pages are allocated as rows grow, a chunk ahead. Should the pool run out,
  the most recently admitted row is preempted (its pages freed, the row put
  back at the head of the queue) and later recomputed: sampling is a pure
  function of (key, row, step), so the recomputed row is the same row.

* A decode call carries only the live slots, packed into the smallest power
  of two of rows that holds them: a slot is a page-table row and a few
  host-side integers, so moving it costs nothing, and the last long rows of
  a call do not pay for every slot.
* On a mesh the slots and the pool are split evenly over the batch shards: a
  slot's pages, and its prompt's shared pages, come from its own shard's part
  (the host keeps a free list per shard, and admits, preempts and packs per
  shard), so each device holds only its part of the pool.

Exactly on-policy, whatever slot a row runs in and whatever runs beside it:
row r (= prompt i * G + sample g) draws token n with the key
`fold_in(fold_in(rng, r), n)`, as `rl.sampler.sample` does, and log-probs are
those of the unmodified policy; tokens equal the one-call sampler's, log-probs
equal to float32 rounding (another layout sums in another order). Shapes are
static per (rows of a call, chunk steps) and per prefill bucket, so compiles
are bounded by the buckets; how many pages attention reads is a loop bound
(`models.attention.paged_attend`), not a shape.

Across calls (an agentic episode's turns) a `Session` keeps each row's pages
under a key: the next call's prompt with that key (the episode's stream so
far) prefills only the tokens after what the kept pages hold, gathering
those pages as the context of a chunked prefill (`_extend`), instead of
prefilling the whole stream again.

The host loop, its page accounting and the jitted device functions live here;
`rl.sampler.Sampler(engine='paged')` drives it behind the usual `generate`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import config as config_lib
from models import sharding
from models import transformer
from rl import buckets
from rl import sampling


_BLOCK_PAGES = 8   # models.attention.paged_attend's default pages_per_compute_block
KEY_DTYPE = jax.eval_shape(lambda: jax.random.key(0)).dtype   # a typed PRNG key's


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineOptions:
  """Shapes of the paged engine (all static: each distinct value compiles once).

  Attributes:
    slots: rows decoded at once.
    page_size: tokens per KV page.
    pages: pages in the pool; None = enough for every slot's longest row
      (no preemption). The pool's memory is pages x page_size token slots.
    chunk_steps: the most decode steps per device call; between calls the
      host refills free slots.
    prefill_prompts: prompts prefilled per device call.
  """
  slots: int
  page_size: int = 16
  pages: int | None = None
  chunk_steps: int = 32
  prefill_prompts: int = 8

  def __post_init__(self):
    for name in ('slots', 'page_size', 'chunk_steps', 'prefill_prompts'):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f'engine {name}={v!r} must be an int >= 1')
    if self.pages is not None and (not isinstance(self.pages, (int, np.integer))
                                   or self.pages < 1):
      raise ValueError(f'engine pages={self.pages!r} must be an int >= 1 (or None)')


class Rows(NamedTuple):
  """Per-row results of one engine call, in row order (row i * G + g)."""
  tokens: list          # np.int32 arrays, each row's generated tokens
  logprobs: list        # np.float32, unmodified-policy log-probs
  sampling_logprobs: list
  stopped: np.ndarray   # [R] bool, ended on a stop token


class _Entry(NamedTuple):
  """A session's kept cache of one key: `pages` hold the keys/values of `tokens`, in order."""
  pages: list
  tokens: np.ndarray
  shard: int


class Session:
  """KV pages kept between engine calls, per key (e.g. per agentic episode).

  Given to successive `Engine.run` calls (`Sampler.generate(..., session=, keys=)`),
  a session owns the page pool, and after each call keeps every row's cache
  (its prompt and every sampled token but the last: what its pages hold)
  under the row's key. A later prompt with that key prefills only the tokens
  after the longest common prefix of the kept tokens and the prompt: an
  episode's next turn (its stream so far, then the observation) costs the
  turn's new tokens, not the whole stream again. Sampling is unchanged:
  tokens equal a call without the session, log-probs to float32 rounding.

  A call frees the entries of keys it does not name (episodes that ended)
  before it starts; when the pool runs short, rows still waiting give up
  their kept pages first (those rows then prefill in full). One row per
  prompt (G = 1), no stream. `close()` frees everything; a call that raises
  once it has started closes the session (the next call starts from an empty
  pool); one refused by its checks keeps it.

  Attributes:
    row_tokens: the bound of every row's cache tokens across the session's
      calls (sizes the page table and the pool, so every call shares them).
    reused_tokens: prompt tokens taken from kept pages, not prefilled (cumulative).
    prefilled_tokens: prompt tokens prefilled (cumulative).
    evicted: kept caches given up for lack of pages (cumulative).
  """

  def __init__(self, row_tokens: int):
    if not isinstance(row_tokens, (int, np.integer)) or row_tokens < 1:
      raise ValueError(f'session row_tokens={row_tokens!r} must be an int >= 1')
    self.row_tokens = int(row_tokens)
    self.reused_tokens = self.prefilled_tokens = self.evicted = 0
    self.close()

  def close(self) -> None:
    """Frees the pool and every kept entry."""
    self.pool = None                      # (k, v) between calls
    self.shards = 0
    self.free: list[list[int]] = []       # per batch shard, as in Engine.run
    self.entries: dict = {}

  @property
  def pages_held(self) -> int:
    """Pages the kept entries hold."""
    return sum(len(e.pages) for e in self.entries.values())


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common prefix of two int arrays."""
  m = min(a.size, b.size)
  differ = np.flatnonzero(a[:m] != b[:m])
  return int(differ[0]) if differ.size else m


class Stream(Protocol):
  """What feeds one streaming `Engine.run` and consumes its groups as they finish.

  The engine calls `more` when no row is waiting and a slot is idle, `finished`
  after each decode call with the prompts whose G rows all ended during it, and
  then `stop`; once `stop` is True the rows still live or waiting are cancelled
  (their pages freed, their tokens dropped).
  """

  def more(self) -> tuple[Sequence[np.ndarray], np.ndarray] | None:
    """The next prompts and their rows' limits ([len * G] ints); no prompts: none yet (ask
    again after the next decode call; not allowed when no row is live); None: no more."""

  def finished(self, prompts: list[int], rows: Rows) -> None:
    """`prompts` (indices in feed order) have all their rows ended; `rows` are theirs, in
    order."""

  def stop(self) -> bool:
    """True: cancel everything still live or waiting and return."""


class _Slots(NamedTuple):
  """Device state of the decode slots (a pytree)."""
  k: jax.Array            # [L, K, pages, page_size, H]
  v: jax.Array
  lengths: jax.Array      # [S] tokens in each slot's cache
  last: jax.Array         # [S] the token to feed next
  n: jax.Array            # [S] tokens generated so far
  live: jax.Array         # [S] bool


def _pool_layer(pool) -> jax.Array:
  """An array of a pool, stacked [L, K, P, page_size, H] or per layer (a tuple of
  [K, P, page_size, H]): its last three axes are pages, page_size and H, as are its dtype's."""
  return pool[0] if isinstance(pool, tuple) else pool


def _pool_get(pool, index: tuple) -> jax.Array:
  """pool[:, :, *index] as one [L, K, ...] array, from either layout."""
  if isinstance(pool, tuple):
    return jnp.stack([p[(slice(None),) + index] for p in pool])
  return pool[(slice(None), slice(None)) + index]


def _pool_set(pool, index: tuple, values: jax.Array):
  """pool[:, :, *index] = values [L, K, ...] (a page index past the pool is dropped), in the
  pool's layout, each array constrained to its page layout (`transformer.PAGE_AXES`)."""
  if isinstance(pool, tuple):
    return tuple(sharding.constrain(
        p.at[(slice(None),) + index].set(values[i].astype(p.dtype), mode='drop'),
        transformer.PAGE_AXES[1:]) for i, p in enumerate(pool))
  pool = pool.at[(slice(None), slice(None)) + index].set(values.astype(pool.dtype), mode='drop')
  return sharding.constrain(pool, transformer.PAGE_AXES)


def _init_pool(cfg: config_lib.ModelConfig, num_pages: int, page_size: int, per_layer: bool):
  """Empty (k, v) pools: stacked, or per layer (the unrolled decode's layout)."""
  k, v = transformer.init_pages(cfg, num_pages, page_size)
  if per_layer:
    k, v = (transformer.split_layers(x, transformer.PAGE_AXES) for x in (k, v))
  return k, v


def _prefill(graphdef, params, k_pool, v_pool, tokens, segment_ids, dst_pages, copy_src,
             copy_dst):
  """Prefills right-padded prompts into pages, then copies pages (a prompt's partial page).

  Args:
    k_pool, v_pool: the pools, stacked or per layer (tuples; see `_decode`).
    tokens: [A, T] int32, each prompt's tokens from position 0 (T a multiple
      of the page size), padding after them.
    segment_ids: [A, T] int32, 1 = a real token.
    dst_pages: [A, T / page_size] int32 page receiving each page of a row;
      an index past the pool drops it (padding and pages a row does not use).
    copy_src, copy_dst: [C] int32 pages copied after the prefill (dst past the
      pool: no copy).

  Returns:
    (k_pool, v_pool).
  """
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  a, t = tokens.shape
  num_pages, ps = _pool_layer(k_pool).shape[-3:-1]
  if t:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (a, t))
    dtype = _pool_layer(k_pool).dtype
    _, cache = model.hidden(tokens, positions, segment_ids,
                            cache=transformer.init_cache(cfg, a, t, dtype=dtype))
    # [L, A, K, T, H] -> [L, K, A * T / ps, ps, H]: whole pages, scattered by page id.
    as_pages = lambda x: x.transpose(0, 2, 1, 3, 4).reshape(
        cfg.num_layers, cfg.num_kv_heads, a * (t // ps), ps, cfg.head_dim)
    dst = (dst_pages.reshape(-1),)
    k_pool = _pool_set(k_pool, dst, as_pages(cache.k))
    v_pool = _pool_set(v_pool, dst, as_pages(cache.v))
  src = (jnp.minimum(copy_src, num_pages - 1),)
  k_pool = _pool_set(k_pool, (copy_dst,), _pool_get(k_pool, src))
  v_pool = _pool_set(v_pool, (copy_dst,), _pool_get(v_pool, src))
  return k_pool, v_pool


def _extend(graphdef, params, k_pool, v_pool, tokens, segment_ids, starts, page_table, *,
            context_pages: int):
  """Continues rows whose first `starts[a]` tokens are in their pages (a chunked prefill).

  Each row's first `context_pages` pages are gathered into a dense cache, the
  new tokens attend to its first `starts[a]` tokens and to each other
  (causally), and their keys/values are written to the pages at positions
  starts[a], starts[a] + 1, ...

  Args:
    tokens: [A, T] int32 new tokens, padding after them.
    segment_ids: [A, T] int32, 1 = a real token.
    starts: [A] int32 tokens already in each row's pages (<= context_pages * page_size).
    page_table: [A, M] int32 each row's pages (covering starts + its new tokens).
    context_pages: pages gathered as context (static).

  Returns:
    (k_pool, v_pool).
  """
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  a, t = tokens.shape
  num_pages, ps = _pool_layer(k_pool).shape[-3:-1]
  c = context_pages * ps
  ctx = jnp.minimum(page_table[:, :context_pages], num_pages - 1)   # past a row's pages: masked

  def gathered(pool):   # [L, K, A, W, ps, H] -> [L, A, K, W * ps + T, H]
    x = _pool_get(pool, (ctx,)).reshape(cfg.num_layers, cfg.num_kv_heads, a, c, cfg.head_dim)
    x = jnp.pad(x.transpose(0, 2, 1, 3, 4), ((0, 0), (0, 0), (0, 0), (0, t), (0, 0)))
    return sharding.constrain(x, transformer.CACHE_AXES)

  seg = jnp.concatenate([(jnp.arange(c)[None] < starts[:, None]).astype(jnp.int32),
                         jnp.zeros((a, t), jnp.int32)], axis=1)
  cache = transformer.Cache(k=gathered(k_pool), v=gathered(v_pool), segment_ids=seg,
                            index=jnp.asarray(c, jnp.int32))
  positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  _, cache = model.hidden(tokens, positions, segment_ids, cache=cache)
  col = jnp.minimum(positions // ps, page_table.shape[1] - 1)
  page = jnp.where(segment_ids > 0, jnp.take_along_axis(page_table, col, axis=1), num_pages)
  off = positions % ps
  # [L, A, K, T, H] -> [L, K, A, T, H], the indexed region of pool[:, :, page, off].
  new = lambda x: x[:, :, :, c:].transpose(0, 2, 1, 3, 4)
  return _pool_set(k_pool, (page, off), new(cache.k)), _pool_set(v_pool, (page, off), new(cache.v))


def _decode(graphdef, params, state: _Slots, page_table, rows, limits, rng, temperature,
            top_p, top_k, refill_at, *, chunk: int, eos_ids: tuple[int, ...], pad_id: int,
            greedy: bool, filtered: bool):
  """Up to `chunk` decode steps of every live slot.

  Stops early once every slot is idle, or once `refill_at` slots are idle
  (the host then puts waiting rows in them).

  Args:
    state: the slots (pools, lengths, last tokens, counts, live flags).
    page_table: [S, M] int32 pages viewed (M covers every live slot's
      tokens to the end of the call).
    rows: [S] int32 row index of each slot (its noise stream).
    limits: [S] int32 the most tokens each slot's row may generate.
    rng: the call's PRNG key.
    temperature, top_p, top_k: traced sampling scalars.
    refill_at: [] int32 idle slots that end the call early.

  Returns:
    (state, steps run [], tokens [S, chunk], logprobs, sampling_logprobs):
    column i holds step i's token of each slot live at that step (pad_id / 0
    elsewhere).
  """
  model = nnx.merge(graphdef, params)
  s = rows.shape[0]
  eos = jnp.asarray(eos_ids, jnp.int32)
  is_stop = lambda tok: (jnp.any(tok[:, None] == eos, axis=-1) if eos_ids
                         else jnp.zeros(tok.shape, bool))
  row_keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, rows)
  pick = functools.partial(sampling.pick, temperature=temperature, top_p=top_p,
                           top_k=top_k, greedy=greedy, filtered=filtered)
  batch_only = ('batch', None)
  buf = lambda fill, dt: sharding.constrain(jnp.full((s, chunk), fill, dt), batch_only)
  # Pools kept per layer (tuples of [K, P, page_size, H], the Sampler's
  # decode_layers='unrolled'): the blocks run unrolled over their weights, sliced once for
  # the call, and over their own pools.
  layers = model.layer_states() if isinstance(state.k, tuple) else None

  def body(carry):
    i, st, toks, lps, slps = carry
    cache = transformer.PagedCache(k=st.k, v=st.v, page_table=page_table,
                                   lengths=st.lengths, live=st.live)
    logits, cache = model.decode_paged(st.last, st.lengths, cache, layers=layers)
    keys = jax.vmap(jax.random.fold_in)(row_keys, st.n)
    tok, lp, slp = pick(logits, keys)
    live = st.live
    tok = jnp.where(live, tok, pad_id)
    col = lambda a, x: jax.lax.dynamic_update_slice(a, x[:, None], (0, i))
    n = st.n + live
    stop = is_stop(tok) | (n >= limits)
    st = _Slots(k=cache.k, v=cache.v, lengths=st.lengths + live,
                last=jnp.where(live, tok, st.last), n=n, live=live & ~stop)
    return (i + 1, st, col(toks, tok), col(lps, jnp.where(live, lp, 0.)),
            col(slps, jnp.where(live, slp, 0.)))

  def cond(carry):
    i, st = carry[0], carry[1]
    idle = s - jnp.sum(st.live)
    return (i < chunk) & jnp.any(st.live) & (idle < refill_at)

  init = (jnp.zeros((), jnp.int32), state, buf(pad_id, jnp.int32), buf(0, jnp.float32),
          buf(0, jnp.float32))
  steps, state, toks, lps, slps = jax.lax.while_loop(cond, body, init)
  return state, steps, toks, lps, slps


_DECODE_STATIC = ('chunk', 'eos_ids', 'pad_id', 'greedy', 'filtered')


def _rows(out_tok, out_lp, out_slp, stopped, rows) -> Rows:
  """`Rows` of the given row indices from the host loop's per-row chunk lists."""
  cat = lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt)
  return Rows(tokens=[cat(out_tok[r], np.int32) for r in rows],
              logprobs=[cat(out_lp[r], np.float32) for r in rows],
              sampling_logprobs=[cat(out_slp[r], np.float32) for r in rows],
              stopped=np.array([stopped[r] for r in rows], bool))


class _Prompt:
  """A prompt's prefilled pages, shared by its rows."""
  __slots__ = ('pages', 'waiting', 'live', 'prefilled', 'ended', 'shard', 'reused')

  def __init__(self, waiting: int):
    self.pages: list[int] = []
    self.reused = 0           # leading tokens its pages hold from a session (not prefilled)
    self.shard = -1           # the batch shard holding its pages (its rows run there)
    self.waiting = waiting    # rows of this prompt not yet finished
    self.live = 0             # rows of this prompt in a slot
    self.prefilled = False
    self.ended = 0            # rows of this prompt that ran to their end


class Engine:
  """The host loop of continuous batching (one per Sampler; see the module docstring).

  Attributes:
    compile_count: distinct compilations of the device functions so far.
    decode_slots: slot-steps paid for (slots x decode steps run), cumulative.
    generated_tokens: tokens of the rows returned, cumulative (a preempted row's
      discarded tokens are not counted, nor, in a stream, those of groups cancelled
      before all their rows ended).
    preemptions: rows evicted for lack of pages and recomputed, cumulative.
  """

  def __init__(self, graphdef, cfg: config_lib.ModelConfig, options: EngineOptions, *,
               eos_ids: Sequence[int], pad_id: int, mesh=None, rules=None,
               prompt_buckets: Sequence[int], unroll: bool = False):
    self.graphdef, self.cfg, self.opt = graphdef, cfg, options
    # Decode calls run the blocks unrolled, and the pools are kept per layer (see _decode).
    self.unroll = bool(unroll)
    self.eos_ids, self.pad_id = tuple(eos_ids), int(pad_id)
    self.mesh, self.rules = mesh, rules
    self.prompt_buckets = tuple(prompt_buckets)
    self.compile_count = 0
    self.decode_slots = self.generated_tokens = self.preemptions = 0
    self.pages_in_use = 0       # after a call: 0, or pages leaked
    slots = options.slots
    shards = self.shards = sharding.batch_shards(mesh, rules)
    if slots % shards:
      raise ValueError(f'engine slots={slots} must split over the {shards} batch shards')

    def counted(fn):
      @functools.wraps(fn)
      def wrapped(*args, **kwargs):
        self.compile_count += 1
        return fn(*args, **kwargs)
      return wrapped

    self._prefill = jax.jit(counted(_prefill), static_argnums=0, donate_argnums=(2, 3))
    self._decode = jax.jit(counted(_decode), static_argnums=0, static_argnames=_DECODE_STATIC,
                           donate_argnums=(2,))
    # Compiled once per pool size (not counted: it runs no model).
    self._init_pool = jax.jit(_init_pool, static_argnums=(0, 1, 2, 3))
    self._extend = jax.jit(counted(_extend), static_argnums=0,
                           static_argnames=('context_pages',), donate_argnums=(2, 3))

  def table_pages(self, row_tokens: int) -> int:
    """Page-table columns for rows of `row_tokens` tokens: a multiple of the attention's pages
    per block (the TPU kernel's rule)."""
    return -(-row_tokens // (self.opt.page_size * _BLOCK_PAGES)) * _BLOCK_PAGES

  def pool_pages(self, longest: int, row_tokens: int) -> int:
    """Pages in the pool for a call whose longest row holds `longest` cache tokens, of a bucket
    of `row_tokens` (which sizes the default pool: one shape per bucket). The pool is split
    evenly over the batch shards (a slot's pages live on its own shard)."""
    ps, shards = self.opt.page_size, self.shards
    if self.opt.pages is None:   # a power of two per slot, plus a partial copy per shard
      return (self.opt.slots // shards * buckets.pow2(-(-row_tokens // ps)) + 1) * shards
    per_row = -(-longest // ps)
    if self.opt.pages % shards:
      raise ValueError(f'engine pages={self.opt.pages} must split evenly over the {shards} '
                       'batch shards (a slot\'s pages live on its own shard)')
    if self.opt.pages // shards < per_row + 1:
      raise ValueError(f'engine pages={self.opt.pages} cannot hold one row of {longest} '
                       f'tokens ({per_row} pages of {ps}, plus a partial copy)'
                       + (f' on each of {shards} batch shards' if shards > 1 else ''))
    return self.opt.pages

  def batch_rows(self, live: int) -> int:
    """Rows of a decode call whose fullest batch shard has `live` live slots: a power of two
    per shard, times the shards, at most `slots`."""
    return min(self.opt.slots, buckets.pow2(live) * self.shards)

  def _sds(self, shape, dt, axes):
    """An abstract array, sharded by logical `axes` on the engine's mesh (if any)."""
    sh = None
    if self.mesh is not None:
      sh = jax.sharding.NamedSharding(self.mesh, sharding.logical_to_spec(
          axes, shape, self.mesh, self.rules))
    return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

  def _abstract_pool(self, row_tokens: int):
    """(pool pages, k pool, v pool) of a call whose rows hold `row_tokens` tokens, abstract."""
    cfg, ps = self.cfg, self.opt.page_size
    num_pages = self.pool_pages(row_tokens, row_tokens)
    pool = (cfg.num_layers, cfg.num_kv_heads, num_pages, ps, cfg.head_dim)
    if self.unroll:
      one = lambda: tuple(self._sds(pool[1:], cfg.jnp_dtype, transformer.PAGE_AXES[1:])
                          for _ in range(cfg.num_layers))
    else:
      one = lambda: self._sds(pool, cfg.jnp_dtype, transformer.PAGE_AXES)
    return num_pages, one(), one()

  def abstract_decode(self, graphdef, params, row_tokens: int, greedy: bool, filtered: bool):
    """The arguments of a decode call with every slot live, abstract (for `launch.plan`).

    Args:
      graphdef, params: the policy (params as ShapeDtypeStructs in the rollout layout).
      row_tokens: the bucketed cache tokens of the longest row (sizes the table and pool).
      greedy, filtered: as in SamplingParams.

    Returns:
      (positional args, keyword args, description) for `self._decode.lower`.
    """
    s, ps = self.opt.slots, self.opt.page_size
    num_pages, k_pool, v_pool = self._abstract_pool(row_tokens)
    view = self.table_pages(row_tokens)
    vec = lambda dt: self._sds((s,), dt, ('batch',))
    scalar = lambda dt: self._sds((), dt, ())
    state = _Slots(k=k_pool, v=v_pool, lengths=vec(jnp.int32), last=vec(jnp.int32),
                   n=vec(jnp.int32), live=vec(jnp.bool_))
    args = (graphdef, params, state, self._sds((s, view), jnp.int32, ('batch', None)),
            vec(jnp.int32), vec(jnp.int32), self._sds((), KEY_DTYPE, ()),
            scalar(jnp.float32), scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.int32))
    kw = dict(chunk=self.opt.chunk_steps, eos_ids=self.eos_ids, pad_id=self.pad_id,
              greedy=greedy, filtered=filtered)
    what = (f'paged engine: {s} slots, a pool of {num_pages} pages x {ps} tokens '
            f'({num_pages * ps} cache slots), decode calls of {self.opt.chunk_steps} steps')
    return args, kw, what

  def prefill_tokens(self, prompt_len: int) -> int:
    """Tokens per row of the prefill call for prompts of up to `prompt_len` tokens (all but a
    prompt's last token are prefilled: its bucket, in whole pages)."""
    ps = self.opt.page_size
    t = buckets.smallest_fit(self.prompt_buckets, max(1, prompt_len - 1), 'prompt length')
    return -(-t // ps) * ps

  def abstract_prefill(self, graphdef, params, row_tokens: int, prompt_len: int):
    """The arguments of a prefill call of `prefill_prompts` prompts of the longest prompt's
    bucket into the pool, abstract (for `launch.plan`).

    Returns:
      (positional args, keyword args, description) for `self._prefill.lower`.
    """
    a, ps, s = self.opt.prefill_prompts, self.opt.page_size, self.opt.slots
    num_pages, k_pool, v_pool = self._abstract_pool(row_tokens)
    t = self.prefill_tokens(prompt_len)
    rows = lambda dt, width: self._sds((a, width), dt, ('batch', None))
    pairs = lambda: self._sds((s,), jnp.int32, (None,))
    args = (graphdef, params, k_pool, v_pool, rows(jnp.int32, t), rows(jnp.int32, t),
            rows(jnp.int32, t // ps), pairs(), pairs())
    what = (f'paged engine prefill: {a} prompts x {t} tokens into a pool of {num_pages} pages '
            f'x {ps} tokens')
    return args, {}, what

  def _put(self, x, spec):
    if self.mesh is None:
      return jnp.asarray(x)
    ps = sharding.logical_to_spec(spec, np.shape(x), self.mesh, self.rules)
    return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, ps))

  def _host(self, x):
    return sharding.to_host(x)

  def run(self, params, prompts: Sequence[np.ndarray], num_samples: int, limits: np.ndarray,
          rng, scalars, *, greedy: bool, filtered: bool, row_tokens: int | None = None,
          stream: Stream | None = None, session: Session | None = None,
          keys: Sequence | None = None) -> Rows:
    """Generates every row (prompt i, sample g) = row i * G + g.

    With a `stream`, prompts also come from `stream.more()` whenever no row
    waits (numbered on after the ones given, which may be none), finished
    groups go to `stream.finished` after each decode call, and the call ends
    early once `stream.stop()`. A row's tokens are those of a call given every
    prompt at once (its noise depends only on the key, its index and the step).

    Args:
      params: the policy's params in the sampler's layout.
      prompts: non-empty int arrays.
      num_samples: G.
      limits: [len(prompts) * G] int, the most tokens each row generates (>= 1).
      rng: PRNG key.
      scalars: (temperature, top_p, top_k) as numpy scalars.
      greedy, filtered: as in SamplingParams.
      row_tokens: the bucketed cache tokens of the longest row (prompt bucket
        + new-token bucket), which sizes the page table and the pool so calls
        of one bucket share their programs; None = this call's longest row.
        Required with a stream (it bounds every row the stream may add).
      stream: optional, see `Stream`.
      session: optional, see `Session` (G must be 1; no stream; its row_tokens
        replaces `row_tokens`).
      keys: with a session, one hashable key per prompt (distinct).

    Returns:
      Rows (with a stream: of every prompt fed; a row cancelled while it ran is empty).

    Raises:
      ValueError: a streamed prompt's row would not fit `row_tokens`, or a
        session's call is malformed (a row longer than its row_tokens, keys
        missing or repeated, G > 1, a stream, another mesh).
    """
    if session is None:
      return self._run(params, prompts, num_samples, limits, rng, scalars, greedy=greedy,
                       filtered=filtered, row_tokens=row_tokens, stream=stream)
    keys = list(keys) if keys is not None else []
    if num_samples != 1 or stream is not None:
      raise ValueError('engine: a session runs one row per prompt (num_samples=1), no stream')
    if len(keys) != len(prompts) or len(set(keys)) != len(keys):
      raise ValueError(f'engine: a session call needs one distinct key per prompt (got '
                       f'{len(keys)} keys, {len(set(keys))} distinct, for {len(prompts)} '
                       'prompts)')
    if session.pool is not None and session.shards != self.shards:
      raise ValueError(f'engine: the session\'s pool is split over {session.shards} batch '
                       f'shards, this engine\'s over {self.shards}')
    if session.pool is not None and isinstance(session.pool[0], tuple) != self.unroll:
      layout = lambda per_layer: 'per layer' if per_layer else 'stacked'
      raise ValueError(f'engine: the session\'s pool is {layout(not self.unroll)}, this '
                       f'engine keeps it {layout(self.unroll)} (decode_layers)')
    longest = max(np.size(q) for q in prompts) - 1 + int(np.max(limits))
    if longest > session.row_tokens:   # refused before the pool is touched: the session stays
      raise ValueError(f'engine: a row of {longest} cache tokens does not fit the session\'s '
                       f'row_tokens={session.row_tokens}')
    try:
      return self._run(params, prompts, num_samples, limits, rng, scalars, greedy=greedy,
                       filtered=filtered, row_tokens=session.row_tokens, session=session,
                       keys=keys)
    except BaseException:
      session.close()       # its pool was donated to the calls; nothing kept is trusted
      raise

  def _run(self, params, prompts, num_samples, limits, rng, scalars, *, greedy, filtered,
           row_tokens, stream=None, session=None, keys=()) -> Rows:
    """`run` (a session's call already checked)."""
    opt, ps, s = self.opt, self.opt.page_size, self.opt.slots
    prompts = list(prompts)
    n_rows = len(prompts) * num_samples
    plen = [q.size for q in prompts]
    limits = [int(x) for x in np.asarray(limits).reshape(-1)]
    if stream is None:
      longest = int(max(plen) - 1 + max(limits))
    elif row_tokens is None:
      raise ValueError('engine: a streaming run needs row_tokens (the bound of every row)')
    else:
      longest = max([int(row_tokens)] + [q - 1 + x for q, x in
                                          zip(np.repeat(plen, num_samples), limits)])
    max_tokens = longest if row_tokens is None else max(longest, int(row_tokens))
    full_view = self.table_pages(max_tokens)
    # The pool and the slots are split evenly over the batch shards; a slot's pages (and the
    # shared pages of its prompt) come from its own shard's part. Each part's free pages are
    # a stack, low pages first. A session keeps its pool (and its free lists) across calls.
    shards = self.shards
    shard_slots = s // shards
    slot_shard = np.arange(s) // shard_slots
    if session is not None and session.pool is not None:
      (k_pool, v_pool), free = session.pool, session.free
      num_pages = _pool_layer(k_pool).shape[-3]
      session.pool = None                               # donated to this call's programs
    else:
      num_pages = self.pool_pages(max_tokens if session else longest, max_tokens)
      per_shard = num_pages // shards
      free = [list(range((sh + 1) * per_shard - 1, sh * per_shard - 1, -1))
              for sh in range(shards)]
      with sharding.use_mesh(self.mesh, self.rules):
        k_pool, v_pool = self._init_pool(self.cfg, num_pages, ps, self.unroll)
      if session is not None:
        session.free, session.shards = free, shards
    drop = num_pages                                    # a page index the scatters drop
    table = np.zeros((s, full_view), np.int32)
    own: list[list[int]] = [[] for _ in range(s)]       # each slot's private pages
    slot_row = np.full(s, -1, np.int64)
    admitted_at = np.zeros(s, np.int64)
    host_len = np.zeros(s, np.int64)                    # cache tokens per slot
    host_n = np.zeros(s, np.int64)
    host_live = np.zeros(s, bool)
    last = np.zeros(s, np.int32)
    prompts_state = [_Prompt(num_samples) for _ in prompts]
    pending = collections.deque(range(n_rows))
    out_tok = [[] for _ in range(n_rows)]
    out_lp = [[] for _ in range(n_rows)]
    out_slp = [[] for _ in range(n_rows)]
    stopped = [False] * n_rows
    complete = [False] * n_rows
    feeding = stream is not None
    ended_groups: list[int] = []      # prompts whose rows all ended in this decode call
    counter = [0]
    rows_dev = np.zeros(s, np.int32)
    lim_dev = np.ones(s, np.int32)
    temperature, top_p, top_k = scalars

    def pages_for(tokens):
      return -(-int(tokens) // ps)

    def need(slot, steps):
      """Pages slot `slot` needs to run `steps` more steps."""
      r = slot_row[slot]
      cap = plen[r // num_samples] - 1 + limits[r]
      return pages_for(min(host_len[slot] + steps, cap))

    def shared_count(r):
      return (plen[r // num_samples] - 1) // ps

    def grow(slot, steps):
      """Allocates the slot's pages for `steps` more steps; False if its shard is short."""
      r = slot_row[slot]
      have = shared_count(r) + len(own[slot])
      want = need(slot, steps)
      pool = free[slot_shard[slot]]
      if want - have > len(pool):
        return False
      for j in range(have, want):
        page = pool.pop()
        own[slot].append(page)
        table[slot, j] = page
      return True

    def drop_prompt(pr):
      free[pr.shard].extend(reversed(pr.pages))
      pr.pages, pr.prefilled, pr.shard, pr.reused = [], False, -1, 0

    def keep_in_session(slot):
      """A session's row ended: its pages (prompt and own) become the entry of its key."""
      r = slot_row[slot]
      pi = r // num_samples
      pr = prompts_state[pi]
      pages = pr.pages[:shared_count(r)] + own[slot]
      held = pages_for(host_len[slot])
      free[slot_shard[slot]].extend(reversed(pages[held:] + pr.pages[shared_count(r):]))
      tokens = np.concatenate([prompts[pi]] + out_tok[r]).astype(np.int64)[:host_len[slot]]
      session.entries[keys[pi]] = _Entry(pages[:held], tokens, int(slot_shard[slot]))
      own[slot], pr.pages, pr.prefilled, pr.shard, pr.reused = [], [], False, -1, 0

    def release(slot, ended=False):
      r = slot_row[slot]
      pr = prompts_state[r // num_samples]
      if ended and session is not None:
        keep_in_session(slot)
      free[slot_shard[slot]].extend(reversed(own[slot]))
      own[slot] = []
      pr.waiting -= 1
      pr.live -= 1
      if pr.waiting == 0 and pr.pages:
        drop_prompt(pr)
      slot_row[slot] = -1
      host_live[slot] = False
      table[slot] = 0

    def add_prompts(new_prompts, new_limits):
      new_prompts = [np.asarray(q, np.int64).reshape(-1) for q in new_prompts]
      new_limits = [int(x) for x in np.asarray(new_limits).reshape(-1)]
      if len(new_limits) != len(new_prompts) * num_samples:
        raise ValueError(f'engine: stream.more gave {len(new_prompts)} prompts and '
                         f'{len(new_limits)} limits (expected {num_samples} per prompt)')
      for j, q in enumerate(new_prompts):
        top = max(new_limits[j * num_samples:(j + 1) * num_samples])
        if q.size < 1 or q.size - 1 + top > max_tokens:
          raise ValueError(f'engine: streamed prompt of {q.size} tokens with rows of up to '
                           f'{top} new tokens does not fit row_tokens={max_tokens}')
      first = len(out_tok)
      prompts.extend(new_prompts)
      plen.extend(q.size for q in new_prompts)
      limits.extend(new_limits)
      prompts_state.extend(_Prompt(num_samples) for _ in new_prompts)
      added = len(new_limits)
      pending.extend(range(first, first + added))
      for lst in (out_tok, out_lp, out_slp):
        lst.extend([] for _ in range(added))
      stopped.extend([False] * added)
      complete.extend([False] * added)

    def cancel():
      """Drops every live and waiting row (a stream stopped): their pages go back."""
      for slot in np.flatnonzero(host_live):
        r = int(slot_row[slot])
        self.generated_tokens -= sum(x.size for x in out_tok[r])
        out_tok[r], out_lp[r], out_slp[r] = [], [], []
        free[slot_shard[slot]].extend(reversed(own[slot]))
        own[slot] = []
        slot_row[slot], host_live[slot] = -1, False
      pending.clear()
      for pi, pr in enumerate(prompts_state):
        if pr.pages:
          drop_prompt(pr)
        if 0 < pr.ended < num_samples:   # rows that ended in a group never handed over
          self.generated_tokens -= sum(x.size for r in range(pi * num_samples,
                                                             (pi + 1) * num_samples)
                                       if complete[r] for x in out_tok[r])

    def preempt(slot):
      r = int(slot_row[slot])
      prompts_state[r // num_samples].waiting += 1      # release() takes it back off
      release(slot)
      # Its tokens are recomputed: paid for (decode_slots) but not generated twice.
      self.generated_tokens -= sum(x.size for x in out_tok[r])
      out_tok[r], out_lp[r], out_slp[r] = [], [], []
      pending.appendleft(r)
      self.preemptions += 1

    def reclaim(shard, pages, keep=-1):
      """Frees prefilled prompts of `shard` no slot uses (their rows wait), then a session's
      entries kept in this call (oldest first), until `pages` of its pages are free."""
      for pi, pr in enumerate(prompts_state):
        if len(free[shard]) >= pages:
          break
        if pr.pages and pr.live == 0 and pi != keep and pr.shard == shard:
          if pr.reused and session is not None:
            session.evicted += 1
          drop_prompt(pr)     # prefilled, or pages a session lent it
      if session is not None:
        for key in [key for key, e in session.entries.items() if e.shard == shard]:
          if len(free[shard]) >= pages:
            break
          free[shard].extend(reversed(session.entries.pop(key).pages))
          session.evicted += 1
      return len(free[shard]) >= pages

    if session is not None:
      # Entries of keys this call does not name are freed; the others lend their pages to
      # their prompt (up to where the kept tokens and the prompt part).
      named = {key: i for i, key in enumerate(keys)}
      for key in [key for key in session.entries if key not in named]:
        e = session.entries.pop(key)
        free[e.shard].extend(reversed(e.pages))
      for key, e in list(session.entries.items()):
        del session.entries[key]
        pi = named[key]
        reuse = _common_prefix(e.tokens, prompts[pi][:-1])
        lent = pages_for(reuse)
        free[e.shard].extend(reversed(e.pages[lent:]))
        if reuse:
          pr = prompts_state[pi]
          pr.pages, pr.shard, pr.reused = list(e.pages[:lent]), e.shard, reuse

    while pending or host_live.any() or feeding:
      if feeding and not pending and not host_live.all():
        got = stream.more()
        if got is None:
          feeding = False
          if stream.stop():
            cancel()
        else:
          add_prompts(*got)
        if not pending and not host_live.any():
          if feeding:
            raise RuntimeError('engine: stream.more() gave no prompts while no row is live or '
                               'waiting (it must then give prompts or None)')
          continue
      # 1. Admit waiting rows into idle slots while the pool has room for them. A prompt's
      # rows run on the shard holding its pages; a prompt with none goes to the shard with the
      # most idle slots.
      reserve = np.zeros(shards, np.int64)
      for x in np.flatnonzero(host_live):
        reserve[slot_shard[x]] += (need(x, opt.chunk_steps) - shared_count(slot_row[x])
                                   - len(own[x]))
      to_prefill, to_extend, copies, admitted = [], [], [], []
      while pending:
        r = pending[0]
        pi = r // num_samples
        pr = prompts_state[pi]
        idle = ~host_live
        if pr.shard >= 0:
          sh = pr.shard
        else:
          sh = int(np.argmax(np.bincount(slot_shard[idle], minlength=shards)))
        slot = next((x for x in range(sh * shard_slots, (sh + 1) * shard_slots)
                     if not host_live[x]), None)
        if slot is None:
          break
        prompt_pages = 0 if pr.prefilled else pages_for(plen[pi] - 1) - len(pr.pages)
        first = pages_for(min(plen[pi] - 1 + opt.chunk_steps, plen[pi] - 1 + limits[r]))
        if not reclaim(sh, prompt_pages + first - shared_count(r) + reserve[sh], keep=pi):
          break
        pending.popleft()
        if not pr.prefilled and pr.reused:
          pr.pages += [free[sh].pop() for _ in range(prompt_pages)]
          to_extend.append(pi)
        elif prompt_pages:
          pr.pages = [free[sh].pop() for _ in range(prompt_pages)]
          pr.shard = sh
          to_prefill.append(pi)
        pr.live += 1
        slot_row[slot] = r
        counter[0] += 1
        admitted_at[slot] = counter[0]
        host_len[slot], host_n[slot], host_live[slot] = plen[pi] - 1, 0, True
        last[slot] = prompts[pi][-1]
        table[slot] = 0
        table[slot, :shared_count(r)] = pr.pages[:shared_count(r)]
        if (plen[pi] - 1) % ps:                          # the partial page: a private copy
          page = free[sh].pop()
          own[slot].append(page)
          table[slot, shared_count(r)] = page
          copies.append((pr.pages[-1], page))
        reserve[sh] += first - shared_count(r) - len(own[slot])
        rows_dev[slot], lim_dev[slot] = r, limits[r]
        admitted.append(slot)
      if to_extend:
        k_pool, v_pool = self._extend_calls(params, k_pool, v_pool, prompts, to_extend,
                                            prompts_state, full_view, drop, session)
      if to_prefill or copies:
        if session is not None:
          session.prefilled_tokens += sum(plen[pi] - 1 for pi in to_prefill)
        k_pool, v_pool = self._prefill_calls(params, k_pool, v_pool, prompts, to_prefill,
                                             prompts_state, copies, drop)
      for pi in to_prefill + to_extend:
        prompts_state[pi].prefilled = True

      # 2. Pages for the next chunk, preempting the newest rows of a shard short of pages.
      for slot in sorted(np.flatnonzero(host_live), key=lambda x: admitted_at[x]):
        sh = slot_shard[slot]
        while host_live[slot] and not grow(slot, opt.chunk_steps):
          if reclaim(sh, need(slot, opt.chunk_steps) - shared_count(slot_row[slot])
                     - len(own[slot])):
            continue
          # The newest row goes (this one, if it is the newest): the oldest always advances.
          mine = np.flatnonzero(host_live & (slot_shard == sh))
          victim = max(mine, key=lambda x: admitted_at[x])
          if victim == slot and mine.size == 1:
            raise RuntimeError('engine: the page pool cannot hold one row (a bug: pool_pages '
                               'checks this)')
          preempt(victim)
      if not host_live.any():
        if pending and not admitted:   # would spin: nothing runs, nothing can start
          raise RuntimeError('engine: no waiting row fits the free pages while none runs (a bug: '
                             'pool_pages and reclaim guarantee one)')
        continue

      # 3. Decode up to a chunk; return early when enough rows are done for waiting ones to
      # start. Only the live slots go to the device, packed into the smallest power-of-two
      # batch that holds them (a slot is just a page-table row and a few host-side ints), so a
      # long row finishing alone does not pay for every slot. Packed per shard: row j of the
      # call is on shard j // (k / shards), as its slot's pages are.
      act = np.flatnonzero(host_live)
      per = [act[slot_shard[act] == sh] for sh in range(shards)]
      k = self.batch_rows(max(x.size for x in per))
      width = k // shards
      # Padding repeats one of the shard's slots (not live in the call: it writes nothing).
      idx = np.concatenate([np.concatenate([x, np.full(width - x.size, sh * shard_slots)])
                            for sh, x in enumerate(per)]).astype(np.int64)
      live_k = np.concatenate([np.arange(width) < x.size for x in per])
      act = np.concatenate(per)                      # the live slots, in the call's row order
      more = len(pending) if pending else (s if feeding else 0)
      want = min(more, max(1, s // 8)) if more else k + 1
      with sharding.use_mesh(self.mesh, self.rules):
        state = _Slots(k=k_pool, v=v_pool,
                       lengths=self._put(host_len[idx].astype(np.int32), ('batch',)),
                       last=self._put(last[idx], ('batch',)),
                       n=self._put(host_n[idx].astype(np.int32), ('batch',)),
                       live=self._put(live_k, ('batch',)))
        state, steps, toks, lps, slps = self._decode(
            self.graphdef, params, state, self._put(table[idx], ('batch', None)),
            self._put(rows_dev[idx], ('batch',)), self._put(lim_dev[idx], ('batch',)), rng,
            temperature, top_p, top_k, np.int32(k - act.size + want),
            chunk=opt.chunk_steps, eos_ids=self.eos_ids, pad_id=self.pad_id,
            greedy=greedy, filtered=filtered)
      k_pool, v_pool = state.k, state.v
      steps = int(self._host(steps))
      toks, lps, slps = self._host(toks), self._host(lps), self._host(slps)
      new_n, new_live = self._host(state.n).astype(np.int64), self._host(state.live)
      self.decode_slots += k * steps
      for j, slot in zip(np.flatnonzero(live_k), act):
        r = slot_row[slot]
        made = int(new_n[j] - host_n[slot])
        out_tok[r].append(toks[j, :made])
        out_lp[r].append(lps[j, :made])
        out_slp[r].append(slps[j, :made])
        host_len[slot] += made
        host_n[slot] = new_n[j]
        last[slot] = toks[j, made - 1] if made else last[slot]
        self.generated_tokens += made
        if not new_live[j]:
          stopped[r] = made > 0 and int(toks[j, made - 1]) in self.eos_ids
          complete[r] = True
          pr = prompts_state[r // num_samples]
          pr.ended += 1
          if pr.ended == num_samples:
            ended_groups.append(r // num_samples)
          release(slot, ended=True)
      if stream is not None:
        if ended_groups:
          ended_groups.sort()
          rows = [g * num_samples + i for g in ended_groups for i in range(num_samples)]
          stream.finished(list(ended_groups), _rows(out_tok, out_lp, out_slp, stopped, rows))
          ended_groups.clear()
        if stream.stop():
          cancel()
          feeding = False
    self.pages_in_use = num_pages - sum(map(len, free))
    if session is not None:
      session.pool = (k_pool, v_pool)
      self.pages_in_use -= session.pages_held
    return _rows(out_tok, out_lp, out_slp, stopped, range(len(out_tok)))

  def _extend_calls(self, params, k_pool, v_pool, prompts, to_extend, prompts_state, view: int,
                    drop: int, session: Session):
    """Prefills the rest of `to_extend` (prompts whose leading `reused` tokens a session's pages
    hold) in calls of `prefill_prompts`, each gathering the pages up to its longest start (a
    power of two of pages) as context; shapes: (power-of-two new tokens, context pages)."""
    ps, a = self.opt.page_size, self.opt.prefill_prompts
    for i in range(0, len(to_extend), a):
      batch = to_extend[i:i + a]
      starts = [prompts_state[pi].reused for pi in batch]
      new = [prompts[pi][st:-1] for pi, st in zip(batch, starts)]
      session.reused_tokens += sum(starts)
      session.prefilled_tokens += sum(q.size for q in new)
      longest = max(q.size for q in new)
      if not longest:
        continue
      t = buckets.pow2(longest)
      width = min(buckets.pow2(-(-max(starts) // ps)), view)
      tokens = np.full((a, t), self.pad_id, np.int32)
      seg = np.zeros((a, t), np.int32)
      start = np.zeros(a, np.int32)
      table = np.full((a, view), drop, np.int32)
      for j, (pi, q) in enumerate(zip(batch, new)):
        tokens[j, :q.size], seg[j, :q.size], start[j] = q, 1, starts[j]
        pages = prompts_state[pi].pages
        table[j, :len(pages)] = pages
      with sharding.use_mesh(self.mesh, self.rules):
        k_pool, v_pool = self._extend(
            self.graphdef, params, k_pool, v_pool, self._put(tokens, ('batch', None)),
            self._put(seg, ('batch', None)), self._put(start, ('batch',)),
            self._put(table, ('batch', None)), context_pages=width)
    return k_pool, v_pool

  def _prefill_calls(self, params, k_pool, v_pool, prompts, to_prefill, prompts_state, copies,
                     drop):
    """Prefills `to_prefill` (prompt indices) in calls of `prefill_prompts`, then the copies."""
    ps, a = self.opt.page_size, self.opt.prefill_prompts
    batches = [to_prefill[i:i + a] for i in range(0, len(to_prefill), a)] or [[]]
    for bi, batch in enumerate(batches):
      longest = max([prompts[pi].size - 1 for pi in batch] + [0])
      t = self.prefill_tokens(longest + 1) if longest else 0
      tokens = np.full((a, t), self.pad_id, np.int32)
      seg = np.zeros((a, t), np.int32)
      dst = np.full((a, t // ps), drop, np.int32)
      for j, pi in enumerate(batch):
        q = prompts[pi][:-1]
        tokens[j, :q.size], seg[j, :q.size] = q, 1
        pages = prompts_state[pi].pages
        dst[j, :len(pages)] = pages
      # The copies ride on the last call (they read pages this call has just written).
      last = bi == len(batches) - 1
      pairs = copies if last else []
      # One copy per admitted row at most: a fixed size, so no compile per count.
      src = np.zeros(self.opt.slots, np.int32)
      tgt = np.full(self.opt.slots, drop, np.int32)
      for j, (x, y) in enumerate(pairs):
        src[j], tgt[j] = x, y
      if not t and not pairs:
        continue
      with sharding.use_mesh(self.mesh, self.rules):
        k_pool, v_pool = self._prefill(
            self.graphdef, params, k_pool, v_pool, self._put(tokens, ('batch', None)),
            self._put(seg, ('batch', None)), self._put(dst, ('batch', None)),
            jnp.asarray(src), jnp.asarray(tgt))
    return k_pool, v_pool
