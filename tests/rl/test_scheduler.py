"""The paged engine's host scheduler (rl.scheduler) driven by a fake decode, without JAX.

The fake decode gives row r the token `_token(r, n)` at step n (a pure function
of row and step, as the real sampler's noise is) and stops the row after
`ends[r]` tokens, the last a stop token when that is before its limit; so a
preempted and recomputed row must come out the same.
"""

import numpy as np
import pytest

from rl import page_pool
from rl import scheduler

EOS = 1
PS = 4


def _token(r, n):
  return 10 + (7 * r + 3 * n) % 50


def _check_pages(sched):
  """No page is both free and held, and no two slots own the same page."""
  free = [set(f) for f in sched.pages.free]
  owned = set()
  for slot in np.flatnonzero(sched.live):
    sh = sched.slot_shard[slot]
    pr = sched.prompts_state[sched.slot_row[slot] // sched.num_samples]
    mine = set(sched.own[slot])
    assert not mine & owned and not mine & free[sh] and not set(pr.pages) & free[sh]
    per = sched.pages.num_pages // sched.shards
    assert all(sh * per <= p < (sh + 1) * per for p in mine | set(pr.pages))
    owned |= mine


def _drive(sched, ends, log=None):
  """Runs `sched` as `rl.engine.Engine` does, decoding with the fake model; returns its rows."""
  while sched.busy:
    if not sched.feed():
      continue
    admitted = sched.admit()
    if log is not None:
      log.append(admitted)
    sched.allocate()
    _check_pages(sched)
    if not sched.live.any():
      assert not (sched.pending and not admitted.slots)
      continue
    batch = sched.batch()
    k = batch.live.size
    tokens = np.zeros((k, sched.chunk), np.int32)
    lps = -np.ones((k, sched.chunk), np.float32)
    n, live = batch.n.astype(np.int64), batch.live.copy()
    for j, slot in zip(np.flatnonzero(batch.live), batch.slots):
      r, start = int(batch.rows[j]), int(batch.n[j])
      # The row's pages hold every token this chunk writes (its prompt + generated so far).
      have = sched._shared(r) + len(sched.own[slot])
      made = min(sched.chunk, ends[r] - start)
      assert have * PS >= batch.lengths[j] + made
      tokens[j, :made] = [_token(r, start + i) for i in range(made)]
      if start + made == ends[r]:
        if ends[r] < batch.limits[j]:
          tokens[j, made - 1] = EOS
        live[j] = False
      n[j] = start + made
    sched.advance(batch, tokens, lps, lps, n, live)
    sched.hand_over()
  return sched.rows()


def _expected(r, end, limit):
  want = [_token(r, i) for i in range(end)]
  if end < limit:
    want[-1] = EOS
  return want


def _sched(prompts, g, limits, *, slots=2, pages=12, shards=1, chunk=4, pool=None, **kw):
  pool = pool or page_pool.PagePool(pages, shards)
  return scheduler.Scheduler([np.asarray(q, np.int64) for q in prompts], g, limits,
                             slots=slots, page_size=PS, chunk_steps=chunk, pages=pool,
                             table_pages=16, max_tokens=64, eos_ids=(EOS,), **kw)


PROMPTS = [[5] * 6, [6] * 9, [7], [8] * 3]
G = 2
LIMITS = [12, 30, 5, 9, 20, 3, 16, 16]
ENDS = [12, 25, 5, 2, 20, 3, 9, 16]   # some rows stop early (a stop token), others at limit


@pytest.mark.parametrize('slots,pages,shards,chunk,preempts', [
    (4, 64, 1, 4, False),    # room for everything
    (2, 10, 1, 3, True),     # tight: rows preempted and recomputed
    (4, 22, 2, 4, True),     # two shards, each with its own free list
    (3, 9, 1, 1, True)])     # one step per call
def test_rows_come_out_whole_and_every_page_comes_back(slots, pages, shards, chunk, preempts):
  sched = _sched(PROMPTS, G, LIMITS, slots=slots, pages=pages, shards=shards, chunk=chunk)
  rows = _drive(sched, ENDS)
  for r, toks in enumerate(rows.tokens):
    assert toks.tolist() == _expected(r, ENDS[r], LIMITS[r]), r
  np.testing.assert_array_equal(rows.stopped, np.array(ENDS) < np.array(LIMITS))
  assert sched.pages.in_use == 0
  assert sched.generated_tokens == sum(ENDS)
  assert (sched.preemptions > 0) == preempts


def test_a_prompts_rows_share_its_pages_and_copy_the_partial_one():
  sched = _sched([[5] * 10], 3, [4, 4, 4], slots=3, pages=30)
  admitted = sched.admit()
  # Nine tokens prefilled (the last one is fed by each row's first step): two whole pages
  # shared, the third (one token) copied for each row.
  [(tokens, shared)] = admitted.prefill
  assert tokens.size == 9 and shared == [0, 1, 2] and admitted.slots == [0, 1, 2]
  assert [src for src, _ in admitted.copies] == [2, 2, 2]
  own = [sched.own[s] for s in range(3)]
  assert [o[0] for o in own] == [dst for _, dst in admitted.copies]
  np.testing.assert_array_equal(sched.table[:, :2], [[0, 1]] * 3)


def test_the_newest_row_is_preempted_and_requeued_first():
  # One shard of 7 pages, rows of 1 prompt token and 20 new ones (5 pages each at the end):
  # both start, then the pool runs short and the second (newest) row goes back to the queue.
  sched = _sched([[5], [6]], 1, [20, 20], slots=2, pages=7, chunk=4)
  assert sched.admit().slots == [0, 1]
  for _ in range(3):
    sched.allocate()
    batch = sched.batch()
    n = batch.n + batch.live * 4
    toks = np.full((batch.live.size, 4), 20, np.int32)
    sched.advance(batch, toks, toks * 0., toks * 0., n, batch.live.copy())
  assert sched.preemptions == 0
  sched.allocate()
  assert sched.preemptions == 1 and list(sched.pending) == [1]
  assert sched.live.tolist() == [True, False] and sched.out_tok[1] == []
  assert sched.generated_tokens == 12    # the preempted row's 12 tokens are taken back


class _Feed:
  def __init__(self, batches, stop_after=None):
    self.batches, self.stop_after, self.groups = list(batches), stop_after, []

  def more(self):
    if not self.batches:
      return None
    b = self.batches.pop(0)
    return [PROMPTS[i] for i in b], np.array([LIMITS[i * G + g] for i in b for g in range(G)])

  def finished(self, groups, rows):
    self.groups.append((groups, [t.tolist() for t in rows.tokens]))

  def stop(self):
    return self.stop_after is not None and len(self.groups) >= self.stop_after


def test_a_stream_feeds_prompts_and_gets_each_group_once_in_order():
  feed = _Feed([[0, 1], [2], [3]])
  sched = _sched([], G, [], slots=2, pages=20, stream=feed)
  rows = _drive(sched, ENDS)
  handed = [g for groups, _ in feed.groups for g in groups]
  assert sorted(handed) == [0, 1, 2, 3] and len(rows.tokens) == 8
  for groups, tokens in feed.groups:
    assert groups == sorted(groups)
    for i, g in enumerate(groups):
      for s in range(G):
        r = g * G + s
        assert tokens[i * G + s] == _expected(r, ENDS[r], LIMITS[r])
  assert sched.pages.in_use == 0


def test_a_stopped_stream_cancels_rows_and_frees_their_pages():
  feed = _Feed([[0, 1, 2, 3]], stop_after=1)
  sched = _sched([], G, [], slots=2, pages=20, stream=feed)
  _drive(sched, ENDS)
  ended = {g for groups, _ in feed.groups for g in groups}
  assert 1 <= len(ended) < 4 and sched.pages.in_use == 0 and not sched.pending
  assert sched.generated_tokens == sum(ENDS[g * G + s] for g in ended for s in range(G))


def test_a_stream_that_gives_nothing_while_nothing_runs_is_refused():
  class Empty(_Feed):
    def more(self):
      return [], np.zeros(0, np.int64)
  with pytest.raises(RuntimeError, match='gave no prompts while no row is live'):
    _drive(_sched([], G, [], stream=Empty([])), ENDS)


def test_a_session_lends_kept_pages_and_frees_unnamed_keys():
  session = scheduler.Session(64)
  pool = page_pool.PagePool(40, 1)
  session.pages = pool
  first = [[5] * 7, [6] * 3]
  sched = _sched(first, 1, [6, 6], slots=2, pool=pool, session=session, keys=['a', 'b'])
  rows = _drive(sched, [6, 6])
  # Each key keeps its prompt and every sampled token but the last: what its pages hold.
  kept = {k: e.tokens.tolist() for k, e in session.entries.items()}
  assert kept == {'a': first[0] + rows.tokens[0].tolist()[:-1],
                  'b': first[1] + rows.tokens[1].tolist()[:-1]}
  assert session.pages_held == pool.in_use == 3 + 2
  # The next turn names only 'a', its prompt the kept stream plus an observation.
  turn = kept['a'] + [rows.tokens[0][-1], 30, 31]
  log = []
  sched = _sched([turn], 1, [4], slots=2, pool=pool, session=session, keys=['a'])
  _drive(sched, [4], log)
  [(new, start, pages)] = log[0].extend
  assert start == 12 and new.tolist() == turn[12:-1] and not log[0].prefill
  assert session.reused_tokens == 12 and session.prefilled_tokens == 6 + 2 + 2
  assert set(session.entries) == {'a'} and pool.in_use == session.pages_held


# ------------------------------------------------------------------ recording routing


def _route(tokens, start):
  """The fake model's experts of tokens at positions start, start + 1, ...: [n, 1, 2] (a pure
  function of token and position, as a real router's choice is of its input)."""
  tokens = np.asarray(tokens, np.int64)
  pos = start + np.arange(tokens.size)
  return np.stack([tokens % 100, 100 + pos % 100], -1)[:, None].astype(np.uint8)


def _drive_recording(sched, ends):
  """`_drive` with routing recorded as `rl.engine.Engine` records it: each prefill or extend
  entry's tokens routed, then each decode call's fed tokens (a row's tail included)."""
  while sched.busy:
    if not sched.feed():
      continue
    admitted = sched.admit()
    routed = [_route(q, 0) if q.size else None for q, _ in admitted.prefill]
    routed += [_route(q, start) if q.size else None for q, start, _ in admitted.extend]
    sched.prompt_routing(admitted, routed)
    sched.allocate()
    _check_pages(sched)
    if not sched.live.any():
      continue
    batch = sched.batch()
    k = batch.live.size
    tokens = np.zeros((k, sched.chunk + 1), np.int32)
    lps = -np.ones((k, sched.chunk + 1), np.float32)
    route = np.zeros((k, sched.chunk + 1, 1, 2), np.uint8)
    fed = np.zeros(k, np.int64)
    n, live = batch.n.astype(np.int64), batch.live.copy()
    for j, slot in zip(np.flatnonzero(batch.live), batch.slots):
      r, start = int(batch.rows[j]), int(batch.n[j])
      made = min(sched.chunk, ends[r] - start)
      tokens[j, :made] = [_token(r, start + i) for i in range(made)]
      ended = start + made == ends[r]
      if ended:
        if ends[r] < batch.limits[j]:
          tokens[j, made - 1] = EOS
        live[j] = False
      n[j] = start + made
      fed[j] = made + ended                       # the tail: the last token's forward
      stream = np.concatenate([[batch.last[j]], tokens[j, :made]])[:fed[j]]
      route[j, :fed[j]] = _route(stream, batch.lengths[j])
      # The row's pages hold every token it feeds, its tail's included.
      have = sched._shared(r) + len(sched.own[slot])
      assert have * PS >= batch.lengths[j] + fed[j]
    sched.advance(batch, tokens, lps, lps, n, live, routed=(route, fed))
    sched.hand_over()
  return sched.rows()


@pytest.mark.parametrize('slots,pages,shards,chunk', [(4, 64, 1, 4), (2, 10, 1, 3),
                                                      (4, 22, 2, 4), (3, 9, 1, 1)])
def test_each_rows_routing_is_its_whole_streams_through_sharing_and_preemption(
    slots, pages, shards, chunk):
  sched = _sched(PROMPTS, G, LIMITS, slots=slots, pages=pages, shards=shards, chunk=chunk,
                 record=True)
  rows = _drive_recording(sched, ENDS)
  for r, toks in enumerate(rows.tokens):
    assert toks.tolist() == _expected(r, ENDS[r], LIMITS[r]), r
    stream = np.concatenate([PROMPTS[r // G], toks])
    np.testing.assert_array_equal(rows.routing[r], _route(stream, 0), err_msg=str(r))
  assert sched.pages.in_use == 0
  if pages < 20:
    assert sched.preemptions > 0


def test_a_session_lends_its_kept_routing_with_its_pages():
  """A second call whose prompts continue the first's rows: the kept pages' tokens keep the
  first call's routing (marked here, so it shows it is carried, not recomputed), the rest is
  routed by the extend; the kept cache holds each row's last token too (its tail), so only
  the new tokens are prefilled."""
  session = scheduler.Session(64)
  session.pages = page_pool.PagePool(40, 1)
  first = [[5] * 6, [6] * 3]
  ends = [4, 7]
  sched = _sched(first, 1, [8, 8], pages=40, pool=session.pages, session=session,
                 keys=['a', 'b'], record=True)
  rows = _drive_recording(sched, ends)
  for key, r in (('a', 0), ('b', 1)):
    e = session.entries[key]
    assert e.tokens.size == len(first[r]) + ends[r]          # the tail's token is kept
    np.testing.assert_array_equal(e.routing, rows.routing[r])
    session.entries[key] = e._replace(routing=e.routing + 1)    # marked
  second = [np.concatenate([first[r], rows.tokens[r], [30, 31, 32]]) for r in range(2)]
  sched = _sched(second, 1, [3, 3], pages=40, pool=session.pages, session=session,
                 keys=['a', 'b'], record=True)
  before = session.prefilled_tokens
  again = _drive_recording(sched, [2, 3])
  assert session.prefilled_tokens - before == 2 * 2          # [30, 31]: the last one is fed
  for r in range(2):
    stream = np.concatenate([second[r], again.tokens[r]])
    kept = len(first[r]) + ends[r]
    np.testing.assert_array_equal(again.routing[r][:kept], _route(stream[:kept], 0) + 1)
    np.testing.assert_array_equal(again.routing[r][kept:], _route(stream, 0)[kept:])
