"""rl.buckets: sizes rounded up to a few shapes, checked against a direct count."""

import pytest

from rl import buckets


def _next_pow2(n):
  p = 1
  while p < n:
    p *= 2
  return p


@pytest.mark.parametrize('n', [0, 1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 1000, 1024, 1025, 65_537])
def test_pow2_is_the_next_power_of_two(n):
  assert buckets.pow2(n) == _next_pow2(n)


def test_pow2_bounds_then_rounds_to_a_multiple():
  assert buckets.pow2(5, lo=16) == 16 and buckets.pow2(20, lo=16) == 32
  assert buckets.pow2(100, hi=64) == 64 and buckets.pow2(3, hi=64) == 4
  assert buckets.pow2(100, lo=16, hi=48) == 48             # a cap need not be a power of two
  assert buckets.pow2(12, multiple=8) == 16 and buckets.pow2(5, multiple=6) == 12
  assert buckets.pow2(100, hi=48, multiple=5) == 50        # rounding comes after the cap
  assert buckets.pow2(1, lo=3, multiple=2) == 4
  for n in range(1, 200):
    b = buckets.pow2(n, lo=16, hi=128, multiple=3)
    assert b % 3 == 0 and b >= min(n, 128) and b - 3 < max(16, min(_next_pow2(n), 128))


def test_smallest_fit_picks_the_smallest_bucket_that_holds_n():
  assert buckets.smallest_fit((128, 64), 64, 'x') == 64      # order given does not matter
  assert buckets.smallest_fit((128, 64), 65, 'x') == 128
  assert buckets.smallest_fit((8,), 1, 'x') == 8
  with pytest.raises(ValueError, match=r'prompt length=129 exceeds the largest bucket 128; add'):
    buckets.smallest_fit((64, 128), 129, 'prompt length')
