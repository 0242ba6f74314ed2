"""Rollout engine v2: continuous batching over a paged KV cache.

The one-call sampler (`rl.sampler.sample`) decodes every row of a call in one
loop that runs until the longest row stops, each row holding a cache of the
full length throughout. With long-tailed response lengths (most reasoning
rollouts end far below the cap, a few reach it) most of those decode slots
and cache slots are idle. This engine keeps a fixed number of decode *slots*
busy instead:

* The KV cache is a pool of fixed-size pages ([L, K, pages, page_size, H], or
  with the unrolled decode one [K, pages, page_size, H] array per layer, kept
  so between calls; the mixture-of-experts families always keep one per
  attention sublayer); each slot has a row of the page table and its own
  length, so rows of any prompt length sit side by side without left padding.
* A model with Mamba layers (Nemotron-H) also carries each row's recurrent
  state, which no page can share: a pool of one state per slot lives beside
  the pages for the call. Every admitted row is prefilled (its prompt's
  pages written once, as above; a row admitted after its prompt's pages
  were written runs the prompt again for its state only) and its slot gets
  the state after prompt[:-1]; a decode call gathers its rows' states from
  their slots and scatters them back.
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
  the most recently admitted row is preempted and later recomputed: sampling
  is a pure function of (key, row, step), so the recomputed row is the same row.
* A decode call carries only the live slots, packed into the smallest power
  of two of rows that holds them, so the last long rows of a call do not pay
  for every slot (`engine_options.EngineOptions.decode_rows='live'`; 'all' runs every slot in
  every call: one decode program instead of one per power of two).
* On a mesh the slots and the pool are split evenly over the batch shards: a
  slot's pages, and its prompt's shared pages, come from its own shard's part,
  so each device holds only its part of the pool.

Exactly on-policy, whatever slot a row runs in and whatever runs beside it:
row r (= prompt i * G + sample g) draws token n with the key
`fold_in(fold_in(rng, r), n)`, as `rl.sampler.sample` does, and log-probs are
those of the unmodified policy; tokens equal the one-call sampler's, log-probs
equal to float32 rounding (another layout sums in another order). Shapes are
static per (rows of a call, chunk steps) and per prefill bucket, so compiles
are bounded by the buckets; how many pages attention reads is a loop bound
(`models.attention.paged_attend`), not a shape.

Across calls (an agentic episode's turns) a `rl.scheduler.Session` keeps each
row's pages under a key: the next call's prompt with that key prefills only
the tokens after what the kept pages hold. With Mamba layers it also keeps the
row's final state, and continues it only for a prompt that starts with every
kept token (else the prompt is prefilled in full).

Recording routing (a mixture-of-experts policy, `run(record_routing=True)`),
each row also returns the experts every token of it went to: its prompt's from
the prefill (or a session's kept routing and the extend), each fed token's
from its decode step, and its last token's from one more forward, its *tail*
(`paged_programs.decode`; its pages cover that token too).

The engine in parts: `rl.page_pool` counts free pages per shard;
`rl.scheduler` decides, on the host, which row runs in which slot on which
pages (queue, admission, preemption, sessions, the stream, packing);
`rl.paged_programs` holds the jitted device programs; this module's `Engine`
sizes the pool and the page table, compiles the programs, turns the
scheduler's decisions into device arrays, and runs the loop that composes
them. `rl.sampler.Sampler(engine='paged')` drives it behind the usual
`generate`.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import config as config_lib
from models import mamba
from models import sharding
from models import transformer
from rl import buckets
from rl import engine_options
from rl import page_pool
from rl import paged_programs
from rl import scheduler


_BLOCK_PAGES = 8   # models.attention.paged_attend's default pages_per_compute_block
KEY_DTYPE = jax.eval_shape(lambda: jax.random.key(0)).dtype   # a typed PRNG key's


class Engine:
  """Continuous batching for one slot count: sizes the pool and the page table, compiles the
  device programs, and runs the loop that composes the scheduler and them (module docstring).

  Attributes:
    compile_count: distinct compilations of the device functions so far.
    decode_slots: slot-steps paid for (slots x decode steps run), cumulative.
    generated_tokens: tokens of the rows returned, cumulative (a preempted row's
      discarded tokens are not counted, nor, in a stream, those of groups cancelled
      before all their rows ended).
    preemptions: rows evicted for lack of pages and recomputed, cumulative.
  """

  def __init__(self, graphdef, cfg: config_lib.ModelConfig, options: engine_options.EngineOptions, *,
               eos_ids: Sequence[int], pad_id: int, mesh=None, rules=None,
               prompt_buckets: Sequence[int], unroll: bool = False):
    self.graphdef, self.cfg, self.opt = graphdef, cfg, options
    # Decode calls run the blocks unrolled, and the pools are kept per layer (see
    # paged_programs.decode); a model whose cache is not stacked (a sublayer pattern's)
    # keeps its pools per attention sublayer always.
    self.unroll = bool(unroll) or not cfg.kv_stacked
    # Each slot carries its row's Mamba states (paged_programs.init_states).
    self.row_states = cfg.mamba_layers > 0
    self.eos_ids, self.pad_id = tuple(eos_ids), int(pad_id)
    # The rules every program traces with (their static `rules`) and the host arrays' layout.
    self.mesh, self.rules = mesh, sharding.as_rules(rules)
    self.prompt_buckets = tuple(prompt_buckets)
    self.compile_count = 0
    self.decode_slots = self.generated_tokens = self.preemptions = 0
    self.pages_in_use = 0       # after a call: 0, or pages leaked
    slots = options.slots
    if slots is None:
      raise ValueError('Engine: EngineOptions.slots must be set (rows decoded at once)')
    shards = self.shards = sharding.batch_shards(mesh, rules)
    if slots % shards:
      raise ValueError(f'engine slots={slots} must split over the {shards} batch shards')

    def counted(fn):
      @functools.wraps(fn)
      def wrapped(*args, **kwargs):
        self.compile_count += 1
        return fn(*args, **kwargs)
      return wrapped

    # The same programs uncounted and without donation, to trace (`rl.rollout_copy`).
    self.traceable = {
        'prefill': jax.jit(paged_programs.prefill, static_argnums=0,
                           static_argnames=('record', 'rules')),
        'decode': jax.jit(paged_programs.decode, static_argnums=0,
                          static_argnames=paged_programs.DECODE_STATIC)}
    self._prefill = jax.jit(counted(paged_programs.prefill), static_argnums=0,
                            static_argnames=('record', 'rules'), donate_argnums=(2, 3, 9))
    self._decode = jax.jit(counted(paged_programs.decode), static_argnums=0,
                           static_argnames=paged_programs.DECODE_STATIC, donate_argnums=(2, 11))
    # Compiled once per pool size (not counted: they run no model).
    self._init_pool = jax.jit(paged_programs.init_pool, static_argnums=(0, 1, 2, 3, 4))
    self._init_states = jax.jit(paged_programs.init_states, static_argnums=(0, 1, 2))
    self._take_state = jax.jit(paged_programs.take_state)
    self._extend = jax.jit(counted(paged_programs.extend), static_argnums=0,
                           static_argnames=('context_pages', 'record', 'rules'),
                           donate_argnums=(2, 3, 8))

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
    pool = (cfg.attention_layers, cfg.num_kv_heads, num_pages, ps, cfg.head_dim)
    if self.unroll:
      one = lambda: tuple(self._sds(pool[1:], cfg.jnp_dtype, transformer.PAGE_AXES[1:])
                          for _ in range(cfg.attention_layers))
    else:
      one = lambda: self._sds(pool, cfg.jnp_dtype, transformer.PAGE_AXES)
    return num_pages, one(), one()

  def _abstract_states(self):
    """The slots' state pool, abstract (None without Mamba layers)."""
    if not self.row_states:
      return None
    shapes = jax.eval_shape(lambda: paged_programs.init_states(self.cfg, self.opt.slots,
                                                               self.rules))
    return tuple(mamba.MambaState(*(self._sds(x.shape, x.dtype, axes)
                                    for x, axes in zip(st, mamba.STATE_AXES)))
                 for st in shapes)

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
    state = paged_programs.Slots(k=k_pool, v=v_pool, lengths=vec(jnp.int32),
                                 last=vec(jnp.int32), n=vec(jnp.int32), live=vec(jnp.bool_))
    states = self._abstract_states()
    args = (graphdef, params, state, self._sds((s, view), jnp.int32, ('batch', None)),
            vec(jnp.int32), vec(jnp.int32), self._sds((), KEY_DTYPE, ()),
            scalar(jnp.float32), scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.int32),
            states, None if states is None else vec(jnp.int32))
    kw = dict(chunk=self.opt.chunk_steps, eos_ids=self.eos_ids, pad_id=self.pad_id,
              greedy=greedy, filtered=filtered, rules=self.rules)
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
    states = self._abstract_states()
    args = (graphdef, params, k_pool, v_pool, rows(jnp.int32, t), rows(jnp.int32, t),
            rows(jnp.int32, t // ps), pairs(), pairs(), states,
            *((None, None) if states is None else (pairs(), pairs())))
    what = (f'paged engine prefill: {a} prompts x {t} tokens into a pool of {num_pages} pages '
            f'x {ps} tokens')
    return args, {'rules': self.rules}, what

  def _put(self, x, spec):
    if self.mesh is None:
      return jnp.asarray(x)
    ps = sharding.logical_to_spec(spec, np.shape(x), self.mesh, self.rules)
    return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, ps))

  def _host(self, x):
    return sharding.to_host(x)


  def run(self, params, prompts: Sequence[np.ndarray], num_samples: int, limits: np.ndarray,
          rng, scalars, *, greedy: bool, filtered: bool, row_tokens: int | None = None,
          stream: scheduler.Stream | None = None, session: scheduler.Session | None = None,
          keys: Sequence | None = None, record_routing: bool = False) -> scheduler.Rows:
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
      stream: optional, see `rl.scheduler.Stream`.
      session: optional, see `rl.scheduler.Session` (G must be 1; no stream; its
        row_tokens replaces `row_tokens`).
      keys: with a session, one hashable key per prompt (distinct).
      record_routing: also return every prompt and generated token's experts
        (`Rows.routing`; the model must have 'moe' sublayers): each from the pass that
        forwarded it (a prompt's prefill, shared by its rows; a session's earlier call for
        the tokens its pages keep; the decode step that fed it; a row's last token from one
        more forward, its tail, `paged_programs.decode`).

    Returns:
      Rows (with a stream: of every prompt fed; a row cancelled while it ran is empty).

    Raises:
      ValueError: a streamed prompt's row would not fit `row_tokens`, or a
        session's call is malformed (a row longer than its row_tokens, keys
        missing or repeated, G > 1, a stream, another mesh).
    """
    if session is not None:   # refused before the pool is touched: the session stays
      keys = self._check_session(session, prompts, num_samples, limits, stream, keys,
                                 record_routing)
      row_tokens = session.row_tokens
    try:
      return self._run(params, prompts, num_samples, limits, rng, scalars, greedy=greedy,
                       filtered=filtered, row_tokens=row_tokens, stream=stream,
                       session=session, keys=keys or (), record=bool(record_routing))
    except BaseException:
      if session is not None:
        session.close()     # its pool was donated to the calls; nothing kept is trusted
      raise

  def _check_session(self, session: scheduler.Session, prompts, num_samples, limits, stream,
                     keys, record: bool = False) -> list:
    """Refuses a malformed session call; returns its keys as a list."""
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
    # Recording, a row's last token is forwarded too (its tail), so its cache holds it.
    longest = max(np.size(q) for q in prompts) - 1 + int(np.max(limits)) + int(record)
    if longest > session.row_tokens:
      raise ValueError(f'engine: a row of {longest} cache tokens does not fit the session\'s '
                       f'row_tokens={session.row_tokens}')
    return keys

  def _pools(self, longest: int, max_tokens: int, session: scheduler.Session | None):
    """(k pool, v pool, free pages) of a call: a session's kept ones, or a fresh empty pool
    (which a session then keeps)."""
    if session is not None and session.pool is not None:
      (k_pool, v_pool), pages = session.pool, session.pages
      session.pool = None                               # donated to this call's programs
      return k_pool, v_pool, pages
    num_pages = self.pool_pages(max_tokens if session else longest, max_tokens)
    pages = page_pool.PagePool(num_pages, self.shards)
    with sharding.use_mesh(self.mesh):
      k_pool, v_pool = self._init_pool(self.cfg, num_pages, self.opt.page_size, self.unroll,
                                       self.rules)
    if session is not None:
      session.pages, session.shards = pages, self.shards
    return k_pool, v_pool, pages

  def _run(self, params, prompts, num_samples, limits, rng, scalars, *, greedy, filtered,
           row_tokens, stream, session, keys, record=False) -> scheduler.Rows:
    """The loop of `run`: admit rows (writing their prompts' pages), allocate the next chunk's
    pages, decode a chunk of the live rows, hand finished groups over, until none is left."""
    prompts = list(prompts)
    plen = [q.size for q in prompts]
    limits = [int(x) for x in np.asarray(limits).reshape(-1)]
    tail = int(record)        # recording: a row's last token is forwarded (and cached) too
    if record and 'moe' not in self.cfg.mixers:
      raise ValueError(f"record_routing: the model (family {self.cfg.family!r}) has no 'moe' "
                       'sublayers, so there is no routing to record')
    if stream is None:
      longest = int(max(plen) - 1 + max(limits)) + tail
    elif row_tokens is None:
      raise ValueError('engine: a streaming run needs row_tokens (the bound of every row)')
    else:
      longest = max([int(row_tokens)] + [q - 1 + x + tail for q, x in
                                          zip(np.repeat(plen, num_samples), limits)])
    max_tokens = longest if row_tokens is None else max(longest, int(row_tokens))
    view = self.table_pages(max_tokens)
    k_pool, v_pool, pages = self._pools(longest, max_tokens, session)
    states = None
    if self.row_states:   # the slots' states live for this call only
      with sharding.use_mesh(self.mesh):
        states = self._init_states(self.cfg, self.opt.slots, self.rules)
    sched = scheduler.Scheduler(
        prompts, num_samples, limits, slots=self.opt.slots, page_size=self.opt.page_size,
        chunk_steps=self.opt.chunk_steps, pages=pages, table_pages=view, max_tokens=max_tokens,
        eos_ids=self.eos_ids, stream=stream, session=session, keys=keys,
        row_states=self.row_states, all_rows=self.opt.decode_rows == 'all', record=record)
    try:
      while sched.busy:
        if not sched.feed():
          continue
        admitted = sched.admit()
        k_pool, v_pool, states = self._write_prompts(params, k_pool, v_pool, states, admitted,
                                                     view, pages.num_pages, sched)
        sched.allocate()
        if not sched.live.any():
          if sched.pending and not admitted.slots:   # would spin: nothing runs or can start
            raise RuntimeError('engine: no waiting row fits the free pages while none runs (a '
                               'bug: pool_pages and reclaim guarantee one)')
          continue
        k_pool, v_pool, states = self._decode_batch(params, k_pool, v_pool, states, sched, rng,
                                                    scalars, greedy=greedy, filtered=filtered)
        sched.hand_over()
    finally:
      self.generated_tokens += sched.generated_tokens
      self.preemptions += sched.preemptions
    self.pages_in_use = pages.in_use
    if session is not None:
      session.pool = (k_pool, v_pool)
      self.pages_in_use -= session.pages_held
    return sched.rows()

  def _decode_batch(self, params, k_pool, v_pool, states, sched: scheduler.Scheduler, rng,
                    scalars, *, greedy: bool, filtered: bool):
    """One decode call of the scheduler's packed live rows; it takes their new tokens.

    Returns:
      (k_pool, v_pool, the slots' states).
    """
    batch = sched.batch()
    k = batch.live.size
    temperature, top_p, top_k = scalars
    vec = lambda x: self._put(x, ('batch',))
    state_slots = None
    if states is not None:   # each row's slot; a padding row's past the pool (never written)
      state_slots = np.full(k, self.opt.slots, np.int32)
      state_slots[np.flatnonzero(batch.live)] = batch.slots
      state_slots = vec(state_slots)
    with sharding.use_mesh(self.mesh):
      state = paged_programs.Slots(k=k_pool, v=v_pool, lengths=vec(batch.lengths),
                                   last=vec(batch.last), n=vec(batch.n), live=vec(batch.live))
      out = self._decode(
          self.graphdef, params, state, self._put(batch.page_table, ('batch', None)),
          vec(batch.rows), vec(batch.limits), rng, temperature, top_p, top_k, batch.refill_at,
          states, state_slots, chunk=self.opt.chunk_steps, eos_ids=self.eos_ids,
          pad_id=self.pad_id, greedy=greedy, filtered=filtered, rules=self.rules,
          **({'record': True} if sched.record else {}))
    state, steps, toks, lps, slps, states = out[:6]
    routed = None
    if sched.record:     # (routing [k, C, M, k], tokens fed [k])
      routed = self._host(out[6]), self._host(out[7]).astype(np.int64)
    steps = int(self._host(steps))
    toks, lps, slps = self._host(toks), self._host(lps), self._host(slps)
    new_n, new_live = self._host(state.n).astype(np.int64), self._host(state.live)
    self.decode_slots += k * steps
    slot_state = None
    if states is not None and sched.session is not None:   # an ended row's key keeps it
      slot_state = lambda slot: self._take_state(states, jnp.int32(slot))
    sched.advance(batch, toks, lps, slps, new_n, new_live, slot_state=slot_state, routed=routed)
    return state.k, state.v, states

  def _write_prompts(self, params, k_pool, v_pool, states, admitted: scheduler.Admission,
                     view: int, drop: int, sched: scheduler.Scheduler | None = None):
    """Writes the admitted prompts' pages: the session-continued ones, then the prefilled ones
    and the partial-page copies; and the admitted rows' states (`states` not None).

    Args:
      view: page-table columns of the call.
      drop: a page index past the pool (the device's scatters drop it).
      sched: the scheduler, recording routing (`Scheduler.record`): it gets each prefill and
        extend entry's routing (`Scheduler.prompt_routing`).

    Returns:
      (k_pool, v_pool, states).
    """
    n = len(admitted.prefill)
    record = sched is not None and sched.record
    routed, extended = [None] * n, [None] * len(admitted.extend)
    if admitted.extend:
      k_pool, v_pool, states = self._extend_calls(
          params, k_pool, v_pool, states, admitted.extend, view, drop,
          [(e - n, slot) for e, slot in admitted.row_states if e >= n], admitted.resume,
          extended if record else None)
    if admitted.prefill or admitted.copies:
      k_pool, v_pool, states = self._prefill_calls(
          params, k_pool, v_pool, states, admitted.prefill, admitted.copies, drop,
          [(e, slot) for e, slot in admitted.row_states if e < n],
          routed if record else None)
    if record:
      sched.prompt_routing(admitted, routed + extended)
    return k_pool, v_pool, states

  def _state_pairs(self, pairs: list, first: int, count: int):
    """(source entries, destination slots) [slots] int32 of a call of entries [first,
    first + count): (entry, slot) `pairs` in it, then none (a slot past the pool)."""
    src = np.zeros(self.opt.slots, np.int32)
    dst = np.full(self.opt.slots, self.opt.slots, np.int32)
    mine = [(e - first, slot) for e, slot in pairs if first <= e < first + count]
    for j, (e, slot) in enumerate(mine):
      src[j], dst[j] = e, slot
    return jnp.asarray(src), jnp.asarray(dst), bool(mine)

  def _extend_calls(self, params, k_pool, v_pool, states, extend: list, view: int, drop: int,
                    state_pairs: list, resume: tuple, routed: list | None = None):
    """Prefills the rest of prompts whose leading tokens a session's pages hold (`extend`:
    (new tokens, start, pages)) in calls of `prefill_prompts`, each gathering the pages up to
    its longest start (a power of two of pages) as context; shapes: (power-of-two new tokens,
    context pages). With states, each entry continues its kept state (`resume`) and its row's
    slot (`state_pairs`: (entry, slot)) gets the state after it. `routed` (recording): a list
    of an entry each, filled with each entry's new tokens' routing [n, M, k]."""
    ps, a = self.opt.page_size, self.opt.prefill_prompts
    for i in range(0, len(extend), a):
      batch = extend[i:i + a]
      longest = max(q.size for q, _, _ in batch)
      if not longest and states is None:
        continue
      t = buckets.pow2(longest) if longest else 0
      width = min(buckets.pow2(-(-max(start for _, start, _ in batch) // ps)), view)
      tokens = np.full((a, t), self.pad_id, np.int32)
      seg = np.zeros((a, t), np.int32)
      starts = np.zeros(a, np.int32)
      table = np.full((a, view), drop, np.int32)
      for j, (q, start, pages) in enumerate(batch):
        tokens[j, :q.size], seg[j, :q.size], starts[j] = q, 1, start
        table[j, :len(pages)] = pages
      incoming = src = dst = None
      if states is not None:
        src, dst, _ = self._state_pairs(state_pairs, i, len(batch))
        incoming = self._stack_states(resume[i:i + a], a)
      with sharding.use_mesh(self.mesh):
        out = self._extend(
            self.graphdef, params, k_pool, v_pool, self._put(tokens, ('batch', None)),
            self._put(seg, ('batch', None)), self._put(starts, ('batch',)),
            self._put(table, ('batch', None)), states, incoming, src, dst,
            context_pages=width, rules=self.rules,
            **({'record': True} if routed is not None else {}))
      k_pool, v_pool, states = out[:3]
      if routed is not None:
        got = self._host(out[3])
        for j, (q, _, _) in enumerate(batch):
          routed[i + j] = got[j, :q.size]
    return k_pool, v_pool, states

  @staticmethod
  def _stack_states(kept: Sequence, rows: int):
    """Kept states ([1, ...] each, `paged_programs.take_state`; at least one) as one
    [rows, ...] tuple, zeros after them."""
    pad = lambda x: jnp.zeros((rows - len(kept),) + x.shape[1:], x.dtype)
    return jax.tree.map(lambda *xs: jnp.concatenate(xs + (pad(xs[0]),)), *kept)

  def _prefill_calls(self, params, k_pool, v_pool, states, prefill: list, copies: list,
                     drop: int, state_pairs: list, routed: list | None = None):
    """Prefills prompts (`prefill`: (tokens, pages)) in calls of `prefill_prompts`, then the
    page copies ((source, destination) pairs); with states, each (entry, slot) of
    `state_pairs` puts the state after prompt `entry` in that slot. `routed` (recording): a
    list of an entry each (prefill's first), filled with each prompt's routing [n, M, k]."""
    ps, a = self.opt.page_size, self.opt.prefill_prompts
    batches = [prefill[i:i + a] for i in range(0, len(prefill), a)] or [[]]
    for bi, batch in enumerate(batches):
      longest = max([q.size for q, _ in batch] + [0])
      t = self.prefill_tokens(longest + 1) if longest else 0
      tokens = np.full((a, t), self.pad_id, np.int32)
      seg = np.zeros((a, t), np.int32)
      dst = np.full((a, t // ps), drop, np.int32)
      for j, (q, pages) in enumerate(batch):
        tokens[j, :q.size], seg[j, :q.size] = q, 1
        dst[j, :len(pages)] = pages
      # The copies ride on the last call (they read pages this call has just written).
      pairs = copies if bi == len(batches) - 1 else []
      # One copy per admitted row at most: a fixed size, so no compile per count.
      src = np.zeros(self.opt.slots, np.int32)
      tgt = np.full(self.opt.slots, drop, np.int32)
      for j, (x, y) in enumerate(pairs):
        src[j], tgt[j] = x, y
      state_src = state_dst = None
      put_states = False
      if states is not None:
        state_src, state_dst, put_states = self._state_pairs(state_pairs, bi * a, len(batch))
      if not t and not pairs and not put_states:
        continue
      record = routed is not None and t > 0
      with sharding.use_mesh(self.mesh):
        out = self._prefill(
            self.graphdef, params, k_pool, v_pool, self._put(tokens, ('batch', None)),
            self._put(seg, ('batch', None)), self._put(dst, ('batch', None)),
            jnp.asarray(src), jnp.asarray(tgt), states, state_src, state_dst, rules=self.rules,
            **({'record': True} if record else {}))
      k_pool, v_pool, states = out[:3]
      if record:
        got = self._host(out[3])
        for j, (q, _) in enumerate(batch):
          routed[bi * a + j] = got[j, :q.size]
    return k_pool, v_pool, states
