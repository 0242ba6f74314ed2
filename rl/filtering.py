"""Dynamic filtering: batches of groups with signal, by refill rounds or by streaming.

A group is the G samples of one prompt; a group whose G rewards are all
equal has zero advantage everywhere and teaches nothing, so it is dropped and
more prompts are sampled in its place:

* `filter_groups(rewards, G)`: the keep mask of a batch of groups.
* `fill_groups(draw, K, G)`: rounds of `draw(n)` (sample and score n prompts)
  until K groups have signal or a cap of rounds is hit, padded with invalid
  groups so the train step keeps one shape.
* `StreamFill` / `stream_fill`: the same batch from one streaming call of the
  paged engine, scoring each group as it ends (on a thread while decoding goes
  on) and cancelling what still runs once the batch is known.

Host-side numpy and threads only; the losses in `rl.grpo` never see a group
that was dropped.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from rl import batch as batch_lib


def as_groups(rewards, group_size: int) -> np.ndarray:
  """[B] prompt-major rewards as float64 [B // G, G]; refuses a B that G does not divide."""
  r = np.asarray(rewards, np.float64).reshape(-1)
  if group_size < 1 or r.size % group_size:
    raise ValueError(f'{r.size} rewards do not split into groups of group_size={group_size}')
  return r.reshape(-1, group_size)



def filter_groups(rewards, group_size: int) -> np.ndarray:
  """Which groups carry signal: False for a group whose G rewards are all equal.

  Args:
    rewards: [B] prompt-major rewards.
    group_size: G.

  Returns:
    [B // G] bool keep mask.
  """
  r = as_groups(rewards, group_size)
  return np.any(r != r[:, :1], axis=1)


class Filled(NamedTuple):
  """A batch of groups collected by `fill_groups`.

  Attributes:
    rows: the draws' row pytree restricted to the chosen groups, [K * G] rows.
    rewards: [K * G] rewards of those rows.
    valid: [K * G] bool, False for all-equal groups used only as padding when
      the round cap was hit before the batch filled (give them no loss).
    prompts_drawn: prompts sampled in all rounds together.
    rounds: sampling rounds used.
    groups_kept: groups with signal in the batch (<= K).
  """
  rows: Any
  rewards: np.ndarray
  valid: np.ndarray
  prompts_drawn: int
  rounds: int
  groups_kept: int


def fill_groups(draw: Callable[[int], tuple[Any, np.ndarray]], num_groups: int,
                group_size: int, *, max_rounds: int = 4,
                draw_size: Optional[int] = None) -> Filled:
  """Dynamic filtering with refill: keeps sampling prompts until `num_groups` groups have signal.

  Each round calls `draw(n)`, which samples and scores n new prompts and
  returns (rows, rewards): rows is any pytree whose leaves (or
  `SampleOutput`s, which may differ in width between rounds) have n * G
  prompt-major rows, rewards is [n * G]. Groups with all-equal rewards are
  dropped. After `max_rounds` rounds a batch still short is padded with
  dropped groups marked invalid, so the train step keeps a fixed shape.

  Args:
    draw: host callback sampling and scoring n prompts.
    num_groups: groups (prompts) wanted in the batch.
    group_size: G.
    max_rounds: cap on sampling rounds (>= 1).
    draw_size: prompts per round (default: num_groups).

  Returns:
    A `Filled` with exactly num_groups * G rows.
  """
  if max_rounds < 1:
    raise ValueError(f'fill_groups: max_rounds={max_rounds} must be >= 1')
  n = num_groups if draw_size is None else draw_size
  if n < 1 or num_groups < 1:
    raise ValueError(f'fill_groups: num_groups={num_groups} and draw_size={n} must be >= 1')
  kept, spare = [], []        # (rows chunk, rewards chunk, groups in chunk)
  have, drawn, rounds = 0, 0, 0
  while have < num_groups and rounds < max_rounds:
    rows, rewards = draw(n)
    rewards = np.asarray(rewards, np.float32).reshape(-1)
    if rewards.size != n * group_size:
      raise ValueError(f'fill_groups: draw({n}) returned {rewards.size} rewards, '
                       f'expected {n * group_size}')
    rounds += 1
    drawn += n
    keep = filter_groups(rewards, group_size)
    take = np.flatnonzero(keep)[:num_groups - have]
    drop = np.flatnonzero(~keep)
    for groups, out in ((take, kept), (drop, spare)):
      if groups.size:
        idx = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
        out.append((batch_lib.take_rows(rows, idx), rewards[idx], groups.size))
    have += take.size
  return _filled(kept, spare, num_groups, group_size, prompts_drawn=drawn, rounds=rounds)


def _filled(kept: list, spare: list, num_groups: int, group_size: int, **counts) -> Filled:
  """The batch of `kept` chunks, padded past a shortfall with `spare` (all-equal) groups.

  Chunks are (rows, rewards, groups); padding reuses the spare groups cyclically
  (or the kept ones, with none spare) and is marked invalid.
  """
  have = sum(c[2] for c in kept)
  chunks = list(kept)
  short = num_groups - have
  if short:
    pad = spare or kept
    pad_rows = batch_lib.concat_rows([c[0] for c in pad])
    pad_rewards = np.concatenate([c[1] for c in pad])
    avail = sum(c[2] for c in pad)
    groups = np.arange(short) % avail
    idx = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
    chunks.append((batch_lib.take_rows(pad_rows, idx), pad_rewards[idx], short))
  valid = np.concatenate([np.full(c[2] * group_size, i < len(kept)) for i, c in enumerate(chunks)])
  return Filled(rows=batch_lib.concat_rows([c[0] for c in chunks]),
                rewards=np.concatenate([c[1] for c in chunks]), valid=valid,
                groups_kept=have, **counts)


class StreamFill:
  """Dynamic filtering over groups that arrive one by one (oversampling, no refill rounds).

  Prompts are fed in batches of `batch_prompts`; their groups are scored as
  they finish, in any order, and `add`ed. The batch is the first `num_groups`
  groups with signal *in feed order*, so it does not depend on which group
  finished first: it equals `fill_groups` given every fed prompt in one round
  (padding included when even the last allowed batch leaves it short). It is
  `settled` as soon as those groups are known: every earlier group has been
  scored, so the rest can be cancelled.

  Args:
    num_groups: groups wanted (K).
    group_size: G.
    batch_prompts: prompts per feed.
    max_batches: the most feeds (>= 1).
  """

  def __init__(self, num_groups: int, group_size: int, batch_prompts: int, max_batches: int):
    if min(num_groups, group_size, batch_prompts, max_batches) < 1:
      raise ValueError(f'StreamFill: num_groups={num_groups}, group_size={group_size}, '
                       f'batch_prompts={batch_prompts} and max_batches={max_batches} must be '
                       '>= 1')
    self.num_groups, self.group_size = num_groups, group_size
    self.batch_prompts, self.max_batches = batch_prompts, max_batches
    self.fed = self.batches = 0
    self._rows: dict[int, tuple] = {}      # group -> (rows pytree of G rows, rewards [G])
    self._signal: dict[int, bool] = {}

  def add(self, group: int, rows, rewards) -> None:
    """Group `group` (its index in feed order) with its G rows and rewards."""
    rewards = np.asarray(rewards, np.float32).reshape(-1)
    if rewards.size != self.group_size:
      raise ValueError(f'StreamFill.add: group {group} has {rewards.size} rewards, '
                       f'expected {self.group_size}')
    if not 0 <= group < self.fed or group in self._rows:
      raise ValueError(f'StreamFill.add: group {group} was not fed or was added twice')
    self._rows[group] = (rows, rewards)
    self._signal[group] = bool(filter_groups(rewards, self.group_size)[0])

  @property
  def scored(self) -> int:
    return len(self._rows)

  def may_be_kept(self, group: int) -> bool:
    """Whether group `group` can still be in the batch: fewer than `num_groups` groups before
    it have signal or are not scored yet (if as many are, it is needed only once one of
    them turns out flat)."""
    return sum(self._signal.get(h, True) for h in range(group)) < self.num_groups

  @property
  def kept(self) -> int:
    """Groups with signal scored so far (any position)."""
    return sum(self._signal.values())

  def settled(self) -> bool:
    """The batch is known: `num_groups` groups with signal and every group before them."""
    found = 0
    for g in range(self.fed):
      if g not in self._signal:
        return False
      found += self._signal[g]
      if found == self.num_groups:
        return True
    return False

  def want_more(self) -> bool | None:
    """Whether to feed another batch now (call with every finished group added).

    None: no more ever (settled, or the last batch fed and fully scored would
    not change that); True: feed; False: not yet (the groups still running
    are expected to fill the batch at the keep rate seen so far).
    """
    if self.settled() or self.batches >= self.max_batches:
      return None
    unknown = self.fed - self.scored
    rate = self.kept / self.scored if self.scored else 1.0
    return self.kept + rate * unknown < self.num_groups

  def feed(self) -> range:
    """Records one more batch fed; returns its group indices."""
    if self.batches >= self.max_batches:
      raise ValueError(f'StreamFill.feed: max_batches={self.max_batches} already fed')
    start = self.fed
    self.fed += self.batch_prompts
    self.batches += 1
    return range(start, self.fed)

  def result(self) -> Filled:
    """The batch: `settled`, or every fed group scored (then padded if short)."""
    if not self.settled() and self.scored < self.fed:
      raise ValueError(f'StreamFill.result: {self.fed - self.scored} fed groups are not scored '
                       'and the batch is not settled')
    kept, spare, have = [], [], 0
    for g in range(self.fed):
      if have == self.num_groups:
        break
      rows, rewards = self._rows[g]
      (kept if self._signal[g] else spare).append((rows, rewards, 1))
      have += self._signal[g]
    return _filled(kept, spare, self.num_groups, self.group_size, prompts_drawn=self.fed,
                   rounds=self.batches)


class Streamed(NamedTuple):
  """What `stream_fill` measured: seconds the sampler waited for scores (`wait_s`), seconds
  spent scoring (`score_s`, on the thread or not), rows cancelled while running or waiting,
  and rows that ended but were never scored (the batch filled without their groups)."""
  wait_s: float
  score_s: float
  rows_cancelled: int
  rows_unscored: int


def stream_fill(sampler, params, rng, sp, fill: StreamFill,
                next_prompts: Callable[[], list], score: Callable[[list, Any], Any],
                book: Callable[[list, Any], tuple[Any, np.ndarray]], *, max_prompt_len: int,
                rows: int, thread: bool = True, record_routing: bool = False) -> Streamed:
  """Fills `fill` from one streaming sampler call (dynamic filtering by oversampling).

  Whenever the sampler's queue runs dry and `fill.want_more()`, the next batch
  of `fill.batch_prompts` prompts (`next_prompts()`) is fed. Each group that
  ends is scored (`score(groups, samples)`, on a thread while decoding goes on
  when `thread`, else at once between decode calls) if it may still be in the
  batch (`fill.may_be_kept`); a group behind enough groups that have signal or
  are unscored is held back until one of those turns out flat, and never
  scored if none does. Scores are booked in the order they were submitted
  (`book(groups, scored)` -> (rows pytree of len(groups) * G rows, rewards),
  in the calling thread), which depends only on hand-over order and earlier
  scores, not on scoring times. The call stops, cancelling what still runs,
  once `fill.settled()`.

  Args:
    sampler: an `rl.sampler.Sampler` with engine='paged'.
    params, rng, sp: as `Sampler.stream`.
    fill: a fresh StreamFill (its group size is G).
    next_prompts: the next batch's token-id lists (or (lists, row limits), see
      `Sampler.stream`).
    score, book: see above.
    max_prompt_len, rows: as `Sampler.stream`.
    thread: score on a thread (one host); False when scoring is a collective
      every host must run in the same order.

  Returns:
    Streamed. `fill` then holds the batch (`fill.result()`).
  """
  g = fill.group_size
  jobs: list = []          # (groups, future), in submission order
  held: list = []          # (group, its G rows): ended, scored only once it may be kept
  pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='score')
          if thread else None)
  clock = {'wait': 0.0, 'score': 0.0}

  def timed(groups, samples):
    t0 = time.perf_counter()
    try:
      return score(groups, samples)
    finally:
      clock['score'] += time.perf_counter() - t0

  def drain(block: bool):
    while jobs and (block or jobs[0][1].done()):
      groups, fut = jobs.pop(0)
      t0 = time.perf_counter()
      scored = fut.result()
      clock['wait'] += time.perf_counter() - t0
      got_rows, rewards = book(groups, scored)
      rewards = np.asarray(rewards, np.float32).reshape(-1)
      for j, grp in enumerate(groups):
        idx = np.arange(j * g, (j + 1) * g)
        fill.add(grp, batch_lib.take_rows(got_rows, idx), rewards[idx])

  def submit(groups, samples):
    if pool is None:
      fut = concurrent.futures.Future()
      fut.set_result(timed(groups, samples))
    else:
      fut = pool.submit(timed, groups, samples)
    jobs.append((groups, fut))

  def release() -> bool:
    """Submits the held groups that may now be kept (earlier ones turned out flat); whether
    it submitted any."""
    ready = [x for x in held if fill.may_be_kept(x[0])]
    for x in ready:
      held.remove(x)
      submit([x[0]], x[1])
    return bool(ready)

  def settle():
    """Books every submitted score, and those of held groups they make needed."""
    drain(block=True)
    while release():
      drain(block=True)

  class Source:
    def more(self):
      settle()
      want = fill.want_more()
      if not want:
        return None if want is None else []
      got = next_prompts()
      prompts = got[0] if isinstance(got, tuple) else got
      if len(prompts) != fill.batch_prompts:
        raise ValueError(f'stream_fill: next_prompts gave {len(prompts)} prompts, expected '
                         f'{fill.batch_prompts}')
      fill.feed()
      return got

    def finished(self, groups, samples):
      now = [j for j, grp in enumerate(groups) if fill.may_be_kept(grp)]
      if len(now) == len(groups):
        submit(list(groups), samples)
        return
      if now:
        submit([groups[j] for j in now], batch_lib.take_rows(
            samples, np.concatenate([np.arange(j * g, (j + 1) * g) for j in now])))
      held.extend((grp, batch_lib.take_rows(samples, np.arange(j * g, (j + 1) * g)))
                  for j, grp in enumerate(groups) if j not in now)

    def stop(self):
      drain(block=False)
      release()
      return fill.settled()

  try:
    sampler.stream(params, rng, sp, g, Source(), max_prompt_len, rows=rows,
                   **(dict(record_routing=True) if record_routing else {}))
    settle()
  finally:
    if pool is not None:
      pool.shutdown(wait=True, cancel_futures=True)
  return Streamed(wait_s=clock['wait'], score_s=clock['score'],
                  rows_cancelled=(fill.fed - fill.scored - len(held)) * g,
                  rows_unscored=len(held) * g)
