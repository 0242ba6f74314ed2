"""The paged engine's host-side scheduler: which row runs in which slot, on which pages.

One `Scheduler` lives for one `rl.engine.Engine.run` call and holds every
host decision of it; the engine only moves what it decides to and from the
device:

* **Queue.** Rows (prompt i, sample g) = row i * G + g wait in order; a
  `Stream` may append prompts whenever no row waits and a slot is idle.
* **Admission.** A waiting row takes an idle slot once its shard's free
  pages (`rl.page_pool`) cover its prompt (prefilled once for the G rows,
  in pages they share) and its first chunk, on top of the next chunk of
  every row already running there. A prompt's rows run on the shard that
  holds its pages; a prompt without pages goes to the shard with the most
  idle slots. The row's last partly filled prompt page is copied for it.
* **Preemption.** Before each decode call every live row gets the pages of
  its next chunk, oldest row first; a shard short of pages first frees
  prefilled prompts whose rows all wait and pages a session keeps, then
  preempts its newest row (its pages freed, the row put back at the head of
  the queue, recomputed later: sampling is a pure function of (key, row,
  step)), so the oldest row always advances.
* **Packing.** A decode call carries only the live slots, per shard, in the
  smallest power of two of rows that holds the fullest shard's.
* **Sessions.** A `Session` keeps each row's pages after a call, under its
  key; the next call's prompt with that key is lent those pages up to where
  the kept tokens and the prompt part, and prefills only the rest.
* **Row states.** With `row_states` (a model with recurrent Mamba layers) each
  row also starts from its prompt's recurrent state, which lives in its slot:
  every admitted row is paired with a prefill (or extend) entry whose final
  state its slot receives. A prompt prefilled earlier in the call (its pages
  are already written) gets an entry with no pages, recomputing only the
  state; a session keeps a row's final state beside its pages and lends it
  only to a prompt that continues every kept token (a state cannot be rewound).

Host-only (numpy): testable without JAX or a device.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator, NamedTuple, Protocol, Sequence

import numpy as np

from rl import buckets
from rl import page_pool


class Rows(NamedTuple):
  """Per-row results of one engine call, in row order (row i * G + g)."""
  tokens: list          # np.int32 arrays, each row's generated tokens
  logprobs: list        # np.float32, unmodified-policy log-probs
  sampling_logprobs: list
  stopped: np.ndarray   # [R] bool, ended on a stop token
  # Recording routing: each row's experts [prompt + generated tokens, M, k] (the compact dtype
  # of `rl.paged_programs.routing_dtype`), else None.
  routing: list | None = None


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


class _Entry(NamedTuple):
  """A session's kept cache of one key: `pages` hold the keys/values of `tokens`, in order;
  `state` is the recurrent state after them (row states only; opaque here)."""
  pages: list
  tokens: np.ndarray
  shard: int
  state: Any = None
  routing: Any = None     # recording: the experts of `tokens` [n, M, k]


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
  their kept pages first (those rows then prefill in full). With row states
  (Mamba layers) an entry also keeps its row's final recurrent state (device
  memory beside the page pool), lent only to a prompt that continues every
  kept token; any other prompt of that key is prefilled in full. One row per
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
    self.pool = None                      # the device pools (k, v) between calls
    self.shards = 0
    self.pages: page_pool.PagePool | None = None   # their free pages, between calls
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


def batch_rows(live: int, slots: int, shards: int) -> int:
  """Rows of a decode call whose fullest batch shard has `live` live slots: a power of two
  per shard, times the shards, at most `slots`."""
  return min(slots, buckets.pow2(live) * shards)


class _Prompt:
  """A prompt's prefilled pages, shared by its rows."""
  __slots__ = ('pages', 'waiting', 'live', 'prefilled', 'ended', 'shard', 'reused', 'state')

  def __init__(self, waiting: int):
    self.pages: list[int] = []
    self.reused = 0           # leading tokens its pages hold from a session (not prefilled)
    self.state = None         # row states: the session's state after those tokens
    self.shard = -1           # the batch shard holding its pages (its rows run there)
    self.waiting = waiting    # rows of this prompt not yet finished
    self.live = 0             # rows of this prompt in a slot
    self.prefilled = False
    self.ended = 0            # rows of this prompt that ran to their end


class Admission(NamedTuple):
  """What the device must write before the next decode call (`Scheduler.admit`)."""
  prefill: list     # (tokens [n], pages): prompts prefilled from position 0 into their pages
  extend: list      # (new tokens [n], start, pages): a session's pages hold the first `start`
  copies: list      # (source page, destination page): each admitted row's partial prompt page
  slots: list       # the slots admitted
  # Row states only (else empty): (entry, slot) pairs, entry an index into prefill + extend
  # (prefill's first): the slot's row starts from the state after that entry's tokens; and
  # the kept state each extend entry continues.
  row_states: tuple = ()
  resume: tuple = ()
  # The prompt index of each entry (prefill's, then extend's).
  prompts: tuple = ()


class Batch(NamedTuple):
  """One decode call: the live slots packed per shard, and the device's view of each row.

  Row j of the call is on shard j // (k / shards), as its slot's pages are;
  padding rows repeat one of their shard's slots, not live, so they write nothing.
  Shapes: k = the call's rows (a power of two per shard), M = page-table columns.
  """
  slots: np.ndarray        # [live] the live slots, in the call's row order
  live: np.ndarray         # [k] bool, a real row
  lengths: np.ndarray      # [k] int32 tokens in each row's cache
  last: np.ndarray         # [k] int32 the token each row feeds next
  n: np.ndarray            # [k] int32 tokens each row has generated
  page_table: np.ndarray   # [k, M] int32
  rows: np.ndarray         # [k] int32 row index (the noise stream)
  limits: np.ndarray       # [k] int32 the most tokens each row generates
  refill_at: np.int32      # idle rows that end the call early


class Scheduler:
  """The host state of one engine call: queue, slots, pages, outputs (module docstring).

  Attributes:
    live: [slots] bool, a slot runs a row.
    pending: rows waiting for a slot, next first.
    generated_tokens: tokens of this call's rows kept (preempted and cancelled ones
      taken back off).
    preemptions: rows preempted in this call.
  """

  def __init__(self, prompts: Sequence[np.ndarray], num_samples: int, limits, *, slots: int,
               page_size: int, chunk_steps: int, pages: page_pool.PagePool, table_pages: int,
               max_tokens: int, eos_ids: Sequence[int], stream: Stream | None = None,
               session: Session | None = None, keys: Sequence = (), row_states: bool = False,
               all_rows: bool = False, record: bool = False):
    """Starts a call.

    Args:
      prompts: non-empty int arrays.
      num_samples: G.
      limits: [len(prompts) * G] the most tokens each row generates.
      slots: rows decoded at once, split evenly over the pool's shards.
      page_size: tokens per page.
      chunk_steps: the most decode steps per device call.
      pages: the free pages (a session's, or a fresh pool's).
      table_pages: page-table columns per slot.
      max_tokens: the bound of every row's cache tokens (a streamed prompt's too).
      eos_ids: stop tokens (a row ending on one is `stopped`).
      stream: optional, see `Stream`.
      session: optional, see `Session`; its kept pages are lent to their keys' prompts.
      keys: with a session, one key per prompt.
      row_states: each row starts from its prompt's recurrent state (module docstring).
      all_rows: every decode call carries every slot (`batch`), instead of the live ones
        packed into a power of two per shard.
      record: keep each row's routing (`Rows.routing`): its prompt's, from the prompt's
        prefill or extend (`prompt_routing`; a session's kept routing for the tokens its
        pages hold), then the decode's for each token the row fed, its last token's from
        its tail (one more forward, so its pages cover one token more).
    """
    self.row_states, self.all_rows = row_states, all_rows
    self.record, self.tail = record, int(record)
    self.num_samples, self.ps, self.chunk, self.slots = num_samples, page_size, chunk_steps, slots
    self.pages, self.max_tokens, self.eos_ids = pages, max_tokens, tuple(eos_ids)
    self.stream, self.session, self.keys = stream, session, keys
    self.feeding = stream is not None
    self.shards = pages.shards
    self.shard_slots = slots // self.shards
    self.slot_shard = np.arange(slots) // self.shard_slots
    self.prompts = list(prompts)
    self.plen = [q.size for q in self.prompts]
    self.limits = [int(x) for x in np.asarray(limits).reshape(-1)]
    n_rows = len(self.prompts) * num_samples
    self.table = np.zeros((slots, table_pages), np.int32)
    self.own: list[list[int]] = [[] for _ in range(slots)]   # each slot's private pages
    self.slot_row = np.full(slots, -1, np.int64)
    self.admitted_at = np.zeros(slots, np.int64)
    self.host_len = np.zeros(slots, np.int64)                # cache tokens per slot
    self.host_n = np.zeros(slots, np.int64)
    self.live = np.zeros(slots, bool)
    self.last = np.zeros(slots, np.int32)
    self.rows_dev = np.zeros(slots, np.int32)
    self.lim_dev = np.ones(slots, np.int32)
    self.prompts_state = [_Prompt(num_samples) for _ in self.prompts]
    self.pending = collections.deque(range(n_rows))
    self.out_tok = [[] for _ in range(n_rows)]
    self.out_lp = [[] for _ in range(n_rows)]
    self.out_slp = [[] for _ in range(n_rows)]
    self.out_route = [[] for _ in range(n_rows)]    # recording: per decode call, [fed, M, k]
    self.row_route: list = [None] * n_rows          # recording: an ended row's whole routing
    self.prompt_route: list = [None] * len(self.prompts)   # [plen - 1, M, k] each
    self.lent_route: dict = {}      # prompt -> routing of the tokens a session lends it
    self.stopped = [False] * n_rows
    self.complete = [False] * n_rows
    self.ended_groups: list[int] = []   # prompts whose rows all ended in this decode call
    self.admissions = 0
    self.generated_tokens = self.preemptions = 0
    if session is not None:
      self._lend_session_pages()

  @property
  def busy(self) -> bool:
    """A row waits or runs, or the stream may feed more."""
    return bool(self.pending or self.live.any() or self.feeding)

  # ------------------------------------------------------------------ page arithmetic

  def _pages_for(self, tokens) -> int:
    return -(-int(tokens) // self.ps)

  def _need(self, slot, steps) -> int:
    """Pages slot `slot` needs to run `steps` more steps."""
    r = self.slot_row[slot]
    cap = self.plen[r // self.num_samples] - 1 + self.limits[r] + self.tail
    return self._pages_for(min(self.host_len[slot] + steps + self.tail, cap))

  def _shared(self, r) -> int:
    """Whole prompt pages row `r` shares with its prompt's other rows."""
    return (self.plen[r // self.num_samples] - 1) // self.ps

  def _grow(self, slot, steps) -> bool:
    """Allocates the slot's pages for `steps` more steps; False if its shard is short."""
    own = self.own[slot]
    have = self._shared(self.slot_row[slot]) + len(own)
    before = len(own)
    if not self.pages.grow(self.slot_shard[slot], own, self._need(slot, steps) - have):
      return False
    self.table[slot, have:have + len(own) - before] = own[before:]
    return True

  # ------------------------------------------------------------------ freeing

  def _drop_prompt(self, pr: _Prompt) -> None:
    self.pages.release(pr.shard, pr.pages)
    pr.pages, pr.prefilled, pr.shard, pr.reused, pr.state = [], False, -1, 0, None

  def _keep_in_session(self, slot, state) -> None:
    """A session's row ended: its pages (prompt and own) and `state` (its recurrent state, or
    None) become the entry of its key."""
    r = self.slot_row[slot]
    pi = r // self.num_samples
    pr = self.prompts_state[pi]
    shared = self._shared(r)
    pages = pr.pages[:shared] + self.own[slot]
    held = self._pages_for(self.host_len[slot])
    self.pages.release(self.slot_shard[slot], pages[held:] + pr.pages[shared:])
    tokens = np.concatenate([self.prompts[pi]] + self.out_tok[r]).astype(
        np.int64)[:self.host_len[slot]]
    routing = None
    if self.record:
      routing = self.row_route[r][:self.host_len[slot]]
    self.session.entries[self.keys[pi]] = _Entry(pages[:held], tokens,
                                                 int(self.slot_shard[slot]), state, routing)
    self.own[slot], pr.pages, pr.prefilled, pr.shard, pr.reused = [], [], False, -1, 0
    pr.state = None

  def _release(self, slot, ended: bool = False, state=None) -> None:
    """Empties a slot: its own pages go back, and its prompt's once no row of it waits (a
    session's ended row keeps them, and `state`, under its key)."""
    r = self.slot_row[slot]
    pr = self.prompts_state[r // self.num_samples]
    if ended and self.session is not None:
      self._keep_in_session(slot, state)
    self.pages.release(self.slot_shard[slot], self.own[slot])
    self.own[slot] = []
    pr.waiting -= 1
    pr.live -= 1
    if pr.waiting == 0 and pr.pages:
      self._drop_prompt(pr)
    self.slot_row[slot] = -1
    self.live[slot] = False
    self.table[slot] = 0

  def _forget(self, r) -> None:
    """Drops row `r`'s tokens so far (it is recomputed or cancelled): not generated."""
    self.generated_tokens -= sum(x.size for x in self.out_tok[r])
    self.out_tok[r], self.out_lp[r], self.out_slp[r], self.out_route[r] = [], [], [], []

  def _preempt(self, slot) -> None:
    r = int(self.slot_row[slot])
    self.prompts_state[r // self.num_samples].waiting += 1      # _release takes it back off
    self._release(slot)
    # Its tokens are recomputed: paid for (decode slots) but not generated twice.
    self._forget(r)
    self.pending.appendleft(r)
    self.preemptions += 1

  def _cancel(self) -> None:
    """Drops every live and waiting row (a stream stopped): their pages go back."""
    g = self.num_samples
    for slot in np.flatnonzero(self.live):
      self._forget(int(self.slot_row[slot]))
      self.pages.release(self.slot_shard[slot], self.own[slot])
      self.own[slot] = []
      self.slot_row[slot], self.live[slot] = -1, False
    self.pending.clear()
    for pi, pr in enumerate(self.prompts_state):
      if pr.pages:
        self._drop_prompt(pr)
      if 0 < pr.ended < g:   # rows that ended in a group never handed over
        self.generated_tokens -= sum(x.size for r in range(pi * g, (pi + 1) * g)
                                     if self.complete[r] for x in self.out_tok[r])

  def _victims(self, shard, keep) -> Iterator[Callable[[], None]]:
    """What `shard` may give up for pages, in order: prefilled prompts no slot uses (their rows
    wait; not prompt `keep`), then a session's entries kept in this call, oldest first."""
    for pi, pr in enumerate(self.prompts_state):
      if pr.pages and pr.live == 0 and pi != keep and pr.shard == shard:
        yield lambda pr=pr: self._give_up_prompt(pr)
    if self.session is not None:
      for key in [key for key, e in self.session.entries.items() if e.shard == shard]:
        yield lambda key=key: self._evict(key)

  def _give_up_prompt(self, pr: _Prompt) -> None:
    if pr.reused and self.session is not None:
      self.session.evicted += 1
    self._drop_prompt(pr)     # prefilled, or pages a session lent it

  def _evict(self, key) -> None:
    e = self.session.entries.pop(key)
    self.pages.release(e.shard, e.pages)
    self.session.evicted += 1

  def _reclaim(self, shard, count, keep=-1) -> bool:
    """Frees what `shard` may give up until `count` of its pages are free (see `_victims`)."""
    return self.pages.reclaim(shard, count, self._victims(shard, keep))

  def _lend_session_pages(self) -> None:
    """Entries of keys this call does not name are freed; the others lend their pages to their
    prompt (up to where the kept tokens and the prompt part; with row states, only to a
    prompt that continues every kept token, with the kept state)."""
    session = self.session
    named = {key: i for i, key in enumerate(self.keys)}
    for key in [key for key in session.entries if key not in named]:
      e = session.entries.pop(key)
      self.pages.release(e.shard, e.pages)
    for key, e in list(session.entries.items()):
      del session.entries[key]
      pi = named[key]
      reuse = _common_prefix(e.tokens, self.prompts[pi][:-1])
      if self.row_states and reuse < e.tokens.size:
        reuse = 0                     # the state holds every kept token: it cannot be rewound
      if self.record and e.routing is None:
        reuse = 0                     # kept without its routing: prefilled again to record it
      lent = self._pages_for(reuse)
      self.pages.release(e.shard, e.pages[lent:])
      if reuse:
        pr = self.prompts_state[pi]
        pr.pages, pr.shard, pr.reused = list(e.pages[:lent]), e.shard, reuse
        pr.state = e.state
        if self.record:
          self.lent_route[pi] = e.routing[:reuse]

  # ------------------------------------------------------------------ the stream

  def _add_prompts(self, new_prompts, new_limits) -> None:
    g = self.num_samples
    new_prompts = [np.asarray(q, np.int64).reshape(-1) for q in new_prompts]
    new_limits = [int(x) for x in np.asarray(new_limits).reshape(-1)]
    if len(new_limits) != len(new_prompts) * g:
      raise ValueError(f'engine: stream.more gave {len(new_prompts)} prompts and '
                       f'{len(new_limits)} limits (expected {g} per prompt)')
    for j, q in enumerate(new_prompts):
      top = max(new_limits[j * g:(j + 1) * g])
      if q.size < 1 or q.size - 1 + top + self.tail > self.max_tokens:
        raise ValueError(f'engine: streamed prompt of {q.size} tokens with rows of up to '
                         f'{top} new tokens does not fit row_tokens={self.max_tokens}')
    first = len(self.out_tok)
    self.prompts.extend(new_prompts)
    self.plen.extend(q.size for q in new_prompts)
    self.limits.extend(new_limits)
    self.prompts_state.extend(_Prompt(g) for _ in new_prompts)
    self.prompt_route.extend(None for _ in new_prompts)
    added = len(new_limits)
    self.pending.extend(range(first, first + added))
    for lst in (self.out_tok, self.out_lp, self.out_slp, self.out_route):
      lst.extend([] for _ in range(added))
    self.row_route.extend(None for _ in range(added))
    self.stopped.extend([False] * added)
    self.complete.extend([False] * added)

  def feed(self) -> bool:
    """Asks the stream for prompts when no row waits and a slot is idle.

    Returns:
      False when no row waits or runs after it (the caller asks `busy` again).

    Raises:
      RuntimeError: the stream gave no prompts while no row is live or waiting.
    """
    if not (self.feeding and not self.pending and not self.live.all()):
      return True
    got = self.stream.more()
    if got is None:
      self.feeding = False
      if self.stream.stop():
        self._cancel()
    else:
      self._add_prompts(*got)
    if not self.pending and not self.live.any():
      if self.feeding:
        raise RuntimeError('engine: stream.more() gave no prompts while no row is live or '
                           'waiting (it must then give prompts or None)')
      return False
    return True

  def hand_over(self) -> None:
    """Gives the stream the groups that ended in the last decode call; cancels what runs and
    waits once it says stop."""
    if self.stream is None:
      return
    g = self.num_samples
    if self.ended_groups:
      self.ended_groups.sort()
      rows = [p * g + i for p in self.ended_groups for i in range(g)]
      self.stream.finished(list(self.ended_groups), self.rows(rows))
      self.ended_groups.clear()
    if self.stream.stop():
      self._cancel()
      self.feeding = False

  # ------------------------------------------------------------------ one round

  def admit(self) -> Admission:
    """Admits waiting rows into idle slots while their shard has pages for them.

    The returned prompts count as prefilled from here on (and in the session's
    counters): the caller writes them to the device before the next decode call. With row
    states every admitted row is paired with an entry (`Admission.row_states`): its prompt's
    prefill or extend in this call, or else one more prefill entry without pages (the prompt's
    pages are written; only its state is recomputed).
    """
    g, ps, chunk = self.num_samples, self.ps, self.chunk
    reserve = np.zeros(self.shards, np.int64)
    for x in np.flatnonzero(self.live):
      reserve[self.slot_shard[x]] += (self._need(x, chunk) - self._shared(self.slot_row[x])
                                      - len(self.own[x]))
    to_prefill, to_extend, copies, admitted = [], [], [], []
    recompute, row_entry = [], []       # row states: prompts recomputed, (slot, kind, index)
    while self.pending:
      r = self.pending[0]
      pi = r // g
      pr = self.prompts_state[pi]
      idle = ~self.live
      if pr.shard >= 0:
        sh = pr.shard
      else:
        sh = int(np.argmax(np.bincount(self.slot_shard[idle], minlength=self.shards)))
      slot = next((x for x in range(sh * self.shard_slots, (sh + 1) * self.shard_slots)
                   if not self.live[x]), None)
      if slot is None:
        break
      plen = self.plen[pi]
      shared = self._shared(r)
      prompt_pages = 0 if pr.prefilled else self._pages_for(plen - 1) - len(pr.pages)
      first = self._pages_for(min(plen - 1 + chunk, plen - 1 + self.limits[r]) + self.tail)
      if not self._reclaim(sh, prompt_pages + first - shared + reserve[sh], keep=pi):
        break
      self.pending.popleft()
      if not pr.prefilled and pr.reused:
        pr.pages += self.pages.take(sh, prompt_pages)
        to_extend.append(pi)
      elif prompt_pages:
        pr.pages = self.pages.take(sh, prompt_pages)
        pr.shard = sh
        to_prefill.append(pi)
      pr.live += 1
      self.slot_row[slot] = r
      self.admissions += 1
      self.admitted_at[slot] = self.admissions
      self.host_len[slot], self.host_n[slot], self.live[slot] = plen - 1, 0, True
      self.last[slot] = self.prompts[pi][-1]
      self.table[slot] = 0
      self.table[slot, :shared] = pr.pages[:shared]
      if (plen - 1) % ps:                          # the partial page: a private copy
        [page] = self.pages.take(sh, 1)
        self.own[slot].append(page)
        self.table[slot, shared] = page
        copies.append((pr.pages[-1], page))
      reserve[sh] += first - shared - len(self.own[slot])
      self.rows_dev[slot], self.lim_dev[slot] = r, self.limits[r]
      admitted.append(slot)
      if self.row_states:
        if pi in to_extend:
          row_entry.append((slot, 'extend', to_extend.index(pi)))
        elif pi in to_prefill:
          row_entry.append((slot, 'prefill', to_prefill.index(pi)))
        else:
          if pi not in recompute:
            recompute.append(pi)
          row_entry.append((slot, 'recompute', recompute.index(pi)))
    extend = [(self.prompts[pi][self.prompts_state[pi].reused:-1],
               self.prompts_state[pi].reused, self.prompts_state[pi].pages) for pi in to_extend]
    prefill = ([(self.prompts[pi][:-1], self.prompts_state[pi].pages) for pi in to_prefill]
               + [(self.prompts[pi][:-1], []) for pi in recompute])
    if self.session is not None:
      self.session.reused_tokens += sum(start for _, start, _ in extend)
      self.session.prefilled_tokens += (sum(q.size for q, _, _ in extend)
                                        + sum(q.size for q, _ in prefill))
    base = {'prefill': 0, 'recompute': len(to_prefill), 'extend': len(prefill)}
    row_states = tuple((base[kind] + i, slot) for slot, kind, i in row_entry)
    resume = tuple(self.prompts_state[pi].state for pi in to_extend) if self.row_states else ()
    for pi in to_prefill + to_extend:
      self.prompts_state[pi].prefilled = True
      self.prompts_state[pi].state = None     # handed to the extend entry
    return Admission(prefill=prefill, extend=extend, copies=copies, slots=admitted,
                     row_states=row_states, resume=resume,
                     prompts=tuple(to_prefill + recompute + to_extend))

  def prompt_routing(self, admission: Admission, routed: Sequence) -> None:
    """Takes the routing the device computed for an admission's entries (recording): each
    entry's tokens' [n, M, k] (None: no tokens), in `Admission.prompts` order. A prefilled
    prompt's routing is its prefill's; an extended one's, what the session lent, then the
    extend's; a recomputed one (its state only) keeps the routing of the pass that wrote its
    pages, which its rows' keys and values come from."""
    m = len(admission.prefill)
    written = sum(1 for _, pages in admission.prefill if pages)   # the others: recomputed
    for e, pi in enumerate(admission.prompts):
      got = routed[e]
      if e >= m:                                   # an extend entry
        lent = self.lent_route.pop(pi)
        self.prompt_route[pi] = lent if got is None else np.concatenate([lent, got])
      elif e < written or self.prompt_route[pi] is None:
        self.prompt_route[pi] = got

  def allocate(self) -> None:
    """Pages for every live row's next chunk, oldest row first, preempting the newest rows of
    a shard short of pages (the oldest always advances).

    Raises:
      RuntimeError: one row alone does not fit its shard's pages (the pool's size checks this).
    """
    chunk = self.chunk
    for slot in sorted(np.flatnonzero(self.live), key=lambda x: self.admitted_at[x]):
      sh = self.slot_shard[slot]
      while self.live[slot] and not self._grow(slot, chunk):
        if self._reclaim(sh, self._need(slot, chunk) - self._shared(self.slot_row[slot])
                         - len(self.own[slot])):
          continue
        # The newest row goes (this one, if it is the newest).
        mine = np.flatnonzero(self.live & (self.slot_shard == sh))
        victim = max(mine, key=lambda x: self.admitted_at[x])
        if victim == slot and mine.size == 1:
          raise RuntimeError('engine: the page pool cannot hold one row (a bug: pool_pages '
                             'checks this)')
        self._preempt(victim)

  def batch(self) -> Batch:
    """The next decode call's rows: the live slots, packed per shard (a slot is just a
    page-table row and a few integers, so a long row finishing alone does not pay for every
    slot); it returns early once enough rows are done for the waiting ones to start."""
    s, shards = self.slots, self.shards
    act = np.flatnonzero(self.live)
    per = [act[self.slot_shard[act] == sh] for sh in range(shards)]
    k = s if self.all_rows else batch_rows(max(x.size for x in per), s, shards)
    width = k // shards
    idx = np.concatenate([np.concatenate([x, np.full(width - x.size, sh * self.shard_slots)])
                          for sh, x in enumerate(per)]).astype(np.int64)
    live = np.concatenate([np.arange(width) < x.size for x in per])
    act = np.concatenate(per)
    more = len(self.pending) if self.pending else (s if self.feeding else 0)
    want = min(more, max(1, s // 8)) if more else k + 1
    return Batch(slots=act, live=live, lengths=self.host_len[idx].astype(np.int32),
                 last=self.last[idx], n=self.host_n[idx].astype(np.int32),
                 page_table=self.table[idx], rows=self.rows_dev[idx],
                 limits=self.lim_dev[idx], refill_at=np.int32(k - act.size + want))

  def advance(self, batch: Batch, tokens: np.ndarray, logprobs: np.ndarray,
              sampling_logprobs: np.ndarray, n: np.ndarray, live: np.ndarray,
              slot_state: Callable[[int], Any] | None = None, routed=None) -> None:
    """Takes a decode call's results: each row's new tokens, and the slots of rows that ended.

    Args:
      batch: the call's `Batch`.
      tokens, logprobs, sampling_logprobs: [k, chunk] column i = step i's.
      n: [k] tokens each row has generated after the call.
      live: [k] bool, the row runs on.
      slot_state: with row states and a session, a slot's recurrent state after the call
        (opaque here): an ended row's key keeps it beside its pages.
      routed: recording, (routing [k, C, M, k], fed [k]): the experts of the tokens each row
        fed (its tail's included), and how many it fed (what its cache grew by).
    """
    for j, slot in zip(np.flatnonzero(batch.live), batch.slots):
      r = self.slot_row[slot]
      made = int(n[j] - self.host_n[slot])
      self.out_tok[r].append(tokens[j, :made])
      self.out_lp[r].append(logprobs[j, :made])
      self.out_slp[r].append(sampling_logprobs[j, :made])
      fed = made
      if routed is not None:
        fed = int(routed[1][j])
        self.out_route[r].append(routed[0][j, :fed])
      self.host_len[slot] += fed
      self.host_n[slot] = n[j]
      self.last[slot] = tokens[j, made - 1] if made else self.last[slot]
      self.generated_tokens += made
      if not live[j]:
        self.stopped[r] = made > 0 and int(tokens[j, made - 1]) in self.eos_ids
        self.complete[r] = True
        pr = self.prompts_state[r // self.num_samples]
        if self.record:
          self.row_route[r] = self._whole_routing(r)
        pr.ended += 1
        if pr.ended == self.num_samples:
          self.ended_groups.append(r // self.num_samples)
        keep = self.session is not None and slot_state is not None
        self._release(slot, ended=True, state=slot_state(slot) if keep else None)

  def _whole_routing(self, r: int) -> np.ndarray:
    """Row r's routing so far: its prompt's (but the last token), then every token it fed."""
    pi = r // self.num_samples
    parts = [x for x in [self.prompt_route[pi]] + self.out_route[r] if x is not None]
    return np.concatenate(parts)

  def rows(self, rows: Sequence[int] | None = None) -> Rows:
    """`Rows` of the given row indices (default: every row so far)."""
    if rows is None:
      rows = range(len(self.out_tok))
    rows = list(rows)
    cat = lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt)
    routing = None
    if self.record:
      routing = [self.row_route[r] if self.row_route[r] is not None
                 else np.zeros((0,), np.uint8) for r in rows]
    return Rows(tokens=[cat(self.out_tok[r], np.int32) for r in rows],
                logprobs=[cat(self.out_lp[r], np.float32) for r in rows],
                sampling_logprobs=[cat(self.out_slp[r], np.float32) for r in rows],
                stopped=np.array([self.stopped[r] for r in rows], bool), routing=routing)
