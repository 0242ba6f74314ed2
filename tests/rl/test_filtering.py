"""Dynamic filtering: the keep mask, refill rounds, and streaming equal to one round."""

import time

import numpy as np
import pytest

from rl import filtering
from rl import sampler


# ---------------------------------------------------------------- filter_groups

def test_filter_groups():
  r = np.array([1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.25])
  np.testing.assert_array_equal(filtering.filter_groups(r, 4), [True, False, False, True])
  # A group of one sample has no spread: never kept (and not an error).
  np.testing.assert_array_equal(filtering.filter_groups(r[:3], 1), [False] * 3)
  with pytest.raises(ValueError):
    filtering.filter_groups(r[:3], 2)


def test_fill_groups_pads_with_whole_dropped_groups_of_any_size():
  """G = 3 (not a power of two): padding repeats whole dropped groups, in order, cyclically."""
  g = 3
  r = np.array([5, 5, 5, 0, 1, 2, 7, 7, 7.])       # groups 0 and 2 flat, group 1 has signal

  out = filtering.fill_groups(lambda n: (np.arange(n * g) + 10, r), num_groups=4, group_size=g,
                         max_rounds=1, draw_size=3)
  assert out.groups_kept == 1 and out.rounds == 1
  np.testing.assert_array_equal(out.rows, [13, 14, 15, 10, 11, 12, 16, 17, 18, 10, 11, 12])
  np.testing.assert_array_equal(out.rewards, [0, 1, 2, 5, 5, 5, 7, 7, 7, 5, 5, 5])
  np.testing.assert_array_equal(out.valid, [True] * 3 + [False] * 9)


def test_fill_groups_refuses_a_draw_of_the_wrong_size():
  for rewards in (np.zeros(7), np.zeros(9)):
    with pytest.raises(ValueError, match=f'returned {rewards.size} rewards, expected 8'):
      filtering.fill_groups(lambda n, r=rewards: (None, r), num_groups=2, group_size=4)


# ---------------------------------------------------------------- fill_groups

def _fake_samples(rows, p, n, start):
  ids = np.arange(start, start + rows)
  return sampler.SampleOutput(
      prompt_tokens=np.tile(ids[:, None], (1, p)).astype(np.int32),
      prompt_mask=np.ones((rows, p), np.int32),
      tokens=np.tile(ids[:, None], (1, n)).astype(np.int32),
      mask=np.ones((rows, n), np.int32),
      logprobs=np.zeros((rows, n), np.float32), sampling_logprobs=np.zeros((rows, n), np.float32),
      lengths=np.full(rows, n, np.int32), truncated=np.zeros(rows, bool))


def test_fill_groups_refills_until_full():
  g = 2
  # Round 1: groups 0, 2 have signal; round 2: groups 0, 1, 3 do (only 1 more is needed).
  round_rewards = [np.array([0, 1, 1, 1, 1, 0, 0, 0.]), np.array([1, 0, 0, 1, 1, 1, 0, 1.])]
  calls = []

  def draw(n):
    k = len(calls)
    calls.append(n)
    # Widths differ between rounds (different sampler buckets).
    return (_fake_samples(n * g, 3 + k, 5 - k, 100 * k), np.arange(n * g) + 100 * k), round_rewards[k]

  out = filtering.fill_groups(draw, num_groups=3, group_size=g, max_rounds=5, draw_size=4)
  assert calls == [4, 4] and out.prompts_drawn == 8 and out.rounds == 2 and out.groups_kept == 3
  samples, row_ids = out.rows
  np.testing.assert_array_equal(row_ids, [0, 1, 4, 5, 100, 101])
  np.testing.assert_array_equal(out.rewards, [0, 1, 1, 0, 1, 0])
  assert out.valid.all()
  assert samples.prompt_tokens.shape == (6, 4) and samples.tokens.shape == (6, 5)
  # Round-1 prompts (3 wide) are left-padded; round-2 completions (4 wide) right-padded.
  np.testing.assert_array_equal(samples.prompt_mask[0], [0, 1, 1, 1])
  np.testing.assert_array_equal(samples.mask[4], [1, 1, 1, 1, 0])
  np.testing.assert_array_equal(samples.tokens[4, :4], 100)


def test_fill_groups_pads_with_invalid_groups_at_the_cap():
  g = 4

  def draw(n):
    r = np.zeros(n * g)
    r[:g] = [1, 0, 0, 0]                # only the first group of each round has signal
    return np.arange(n * g), r

  out = filtering.fill_groups(draw, num_groups=4, group_size=g, max_rounds=2, draw_size=2)
  assert out.rounds == 2 and out.prompts_drawn == 4 and out.groups_kept == 2
  assert out.rows.shape == (16,)
  np.testing.assert_array_equal(out.valid, [True] * 8 + [False] * 8)
  np.testing.assert_array_equal(out.rows[:8], [0, 1, 2, 3, 0, 1, 2, 3])
  assert np.all(out.rewards[8:] == 0)


@pytest.mark.parametrize('seed', range(40))
def test_stream_fill_keeps_what_one_round_of_every_fed_prompt_keeps(seed):
  """Groups added in any order, the stream feeding by `want_more`: the batch is `fill_groups`
  over one round of every fed prompt, settled exactly when its groups and every earlier one are
  known, and never feeding past the cap."""
  rng = np.random.default_rng(seed)
  g, k, per = int(rng.integers(2, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 6))
  cap = int(rng.integers(1, 4))
  p_signal = rng.uniform(0, 1)
  total = per * cap
  signal = rng.random(total) < p_signal
  rewards = np.where(signal[:, None], rng.integers(0, 3, (total, g)), 1.0)
  rewards[signal, 0], rewards[signal, 1] = 0.0, 1.0        # signal for sure
  fill = filtering.StreamFill(k, g, per, cap)
  running: list[int] = []
  while True:
    want = fill.want_more()
    if want is None or (not want and not running):
      assert want is None or fill.scored < fill.fed, 'nothing runs yet nothing is fed'
      break
    if want:
      running += list(fill.feed())
    # Some of the running groups end, in a random order.
    rng.shuffle(running)
    for grp in running[:int(rng.integers(1, len(running) + 1))]:
      fill.add(grp, np.arange(grp * g, (grp + 1) * g), rewards[grp])
      running.remove(grp)
      if fill.settled():
        break
    if fill.settled():
      break
  fed = fill.fed
  assert fed <= total and fill.batches <= cap
  expect = filtering.fill_groups(lambda n: (np.arange(n * g), rewards[:n].reshape(-1)), k, g,
                            max_rounds=1, draw_size=fed)
  if not fill.settled():
    for grp in running:     # the stream ran to its end: every fed group is scored
      fill.add(grp, np.arange(grp * g, (grp + 1) * g), rewards[grp])
  out = fill.result()
  np.testing.assert_array_equal(out.rows, expect.rows)
  np.testing.assert_array_equal(out.rewards, expect.rewards)
  np.testing.assert_array_equal(out.valid, expect.valid)
  assert out.groups_kept == expect.groups_kept and out.prompts_drawn == fed
  # Short only when every allowed batch was fed.
  assert out.groups_kept == k or fill.batches == cap
  # Settled exactly when the first k signal groups and all before them are scored.
  first = np.flatnonzero(signal[:fed])
  assert fill.settled() == (first.size >= k)


def test_stream_fill_feeds_only_when_the_running_groups_are_not_expected_to_fill():
  fill = filtering.StreamFill(4, 2, 4, 3)
  assert fill.want_more() is True              # nothing fed
  fill.feed()
  assert fill.want_more() is False             # 4 running, none scored: expected to fill
  fill.add(0, None, [0, 1])
  fill.add(1, None, [1, 1])                    # keep rate 1/2: 1 + 2 * 1/2 < 4
  assert fill.want_more() is True
  fill.feed()
  fill.add(2, None, [0, 1])
  fill.add(3, None, [0, 1])                    # 3 kept of 4 scored; 4 running * 3/4 >= 1
  assert fill.want_more() is False
  fill.add(5, None, [1, 0])                    # group 4 still runs: not settled
  assert not fill.settled() and fill.want_more() is False
  fill.add(4, None, [1, 1])
  assert fill.settled() and fill.want_more() is None
  assert fill.result().groups_kept == 4


class _FakeStreamingSampler:
  """`Sampler.stream` without a model: asks for prompts whenever none waits and a slot is free,
  and each "decode call" ends a random few of the running groups (whole groups, handed over
  sorted, as the engine does); rows are numbered 100 * prompt + sample."""

  def __init__(self, seed, slots=3, per_call=2):
    self.rng = np.random.default_rng(seed)
    self.slots, self.per_call = slots, per_call
    self.handed: list[list[int]] = []

  def stream(self, params, rng, sp, g, source, max_prompt_len, rows):
    del params, rng, sp, max_prompt_len, rows
    waiting, running, fed, feeding = [], [], 0, True
    while waiting or running or feeding:
      if feeding and not waiting and len(running) < self.slots:
        got = source.more()
        if got is None:
          feeding = False
          if source.stop():
            return fed
        else:
          waiting += list(range(fed, fed + len(got)))
          fed += len(got)
        if not waiting and not running:
          assert not feeding, 'more() gave nothing while nothing runs'
          continue
      while waiting and len(running) < self.slots:
        running.append(waiting.pop(0))
      ended = sorted(self.rng.choice(running, min(self.per_call, len(running)), replace=False))
      running = [x for x in running if x not in ended]
      self.handed.append([int(x) for x in ended])
      ids = np.array([100 * x + i for x in ended for i in range(g)])
      source.finished([int(x) for x in ended], ids)
      if source.stop():
        return fed
    return fed


@pytest.mark.parametrize('seed', range(6))
def test_stream_fill_books_in_hand_over_order_and_equals_one_round(seed):
  g, k, per, cap = 3, 4, 3, 4
  flat = np.random.default_rng(seed + 100).random(per * cap) < 0.5
  results = {}
  for thread in (True, False):
    fake = _FakeStreamingSampler(seed)
    fill = filtering.StreamFill(k, g, per, cap)
    booked = []
    score_calls = []

    def score(groups, ids):
      time.sleep(0.002 * len(groups))
      score_calls.append(list(groups))
      return ids, np.where(np.repeat(flat[groups], g), 1.0, ids % 2).astype(np.float32)

    def book(groups, scored):
      booked.append(list(groups))
      return scored

    t0 = time.perf_counter()
    got = filtering.stream_fill(fake, None, None, None, fill, lambda: [[1]] * per, score, book,
                           max_prompt_len=4, rows=per * g, thread=thread)
    wall = time.perf_counter() - t0
    # Booked in the order submitted (whatever order scoring finished in), all of them; a
    # group is submitted when handed over, or later once it may be kept.
    assert booked == score_calls
    handed = [x for batch in fake.handed for x in batch]
    flat_booked = [x for batch in booked for x in batch]
    assert len(set(flat_booked)) == len(flat_booked) and set(flat_booked) <= set(handed)
    held = [x for x in handed if x not in flat_booked]
    assert got.rows_unscored == len(held) * g
    assert got.rows_cancelled == (fill.fed - fill.scored) * g - got.rows_unscored
    # Held back only behind k groups with signal (what made the batch), never needed.
    kept = [x for x in range(fill.fed) if x in flat_booked and not flat[x]]
    assert all(sum(1 for y in kept if y < x) >= k for x in held)
    if not thread:
      SEEDS_UNSCORED[seed] = len(held)
    assert fill.scored == sum(map(len, booked))
    assert 0.002 * fill.scored <= got.score_s <= wall and 0 <= got.wait_s <= wall
    out = fill.result()
    ids = np.arange(fill.fed)[:, None] * 100 + np.arange(g)
    rewards = np.where(np.repeat(flat[:fill.fed], g), 1.0, ids.reshape(-1) % 2)
    expect = filtering.fill_groups(lambda n: (ids.reshape(-1), rewards), k, g, max_rounds=1,
                              draw_size=fill.fed)
    np.testing.assert_array_equal(out.rows, expect.rows)
    np.testing.assert_array_equal(out.valid, expect.valid)
    results[thread] = (out.rows.tolist(), fill.fed)
  assert results[True] == results[False]


SEEDS_UNSCORED = {}


def test_stream_fill_leaves_groups_unscored_over_the_seeds():
  """Over the seeds above, some groups ended behind a full batch and were never scored."""
  for seed in range(6):
    if seed not in SEEDS_UNSCORED:       # run alone (e.g. -k): run its seeds here
      test_stream_fill_books_in_hand_over_order_and_equals_one_round(seed)
  assert sum(SEEDS_UNSCORED.values()) > 0, SEEDS_UNSCORED


def test_stream_fill_refuses_a_short_feed():
  fill = filtering.StreamFill(2, 2, 3, 1)
  with pytest.raises(ValueError, match='next_prompts gave 2 prompts, expected 3'):
    filtering.stream_fill(_FakeStreamingSampler(0), None, None, None, fill, lambda: [[1], [2]],
                     lambda g, s: s, lambda g, s: s, max_prompt_len=4, rows=6)


def test_stream_fill_errors():
  fill = filtering.StreamFill(2, 2, 2, 1)
  with pytest.raises(ValueError, match='group 0 was not fed'):
    fill.add(0, None, [0, 1])
  fill.feed()
  with pytest.raises(ValueError, match='max_batches=1 already fed'):
    fill.feed()
  with pytest.raises(ValueError, match='has 3 rewards, expected 2'):
    fill.add(0, None, [0, 1, 1])
  fill.add(0, np.arange(2), [0, 1])
  with pytest.raises(ValueError, match='added twice'):
    fill.add(0, np.arange(2), [0, 1])
  with pytest.raises(ValueError, match='1 fed groups are not scored'):
    fill.result()
  with pytest.raises(ValueError, match='must be >= 1'):
    filtering.StreamFill(0, 2, 2, 1)
