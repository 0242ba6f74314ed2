"""Shape buckets: sizes rounded up to a few values, so a run compiles a bounded number of programs.

  buckets.pow2(37)                       -> 64
  buckets.pow2(5, lo=16, hi=64)          -> 16
  buckets.pow2(12, multiple=8)           -> 16
  buckets.smallest_fit((64, 128), 100, 'prompt length') -> 128
"""

from __future__ import annotations

from typing import Sequence


def pow2(n: int, *, lo: int = 1, hi: int | None = None, multiple: int = 1) -> int:
  """The next power of two >= n (at least `lo`, at most `hi`), rounded up to a multiple.

  Args:
    n: the size (>= 0; 0 and 1 give 1 before the bounds).
    lo: smallest result before rounding to `multiple`.
    hi: largest result before rounding to `multiple` (None: no cap).
    multiple: the result is a multiple of this (e.g. microbatches x batch shards).

  Returns:
    The bucket.
  """
  b = max(lo, 1 << max(0, n - 1).bit_length())
  if hi is not None:
    b = min(hi, b)
  return -(-b // multiple) * multiple


def smallest_fit(buckets: Sequence[int], n: int, what: str) -> int:
  """The smallest of `buckets` that holds n.

  Raises:
    ValueError: n exceeds every bucket (the message names `what`).
  """
  for b in sorted(buckets):
    if b >= n:
      return b
  raise ValueError(f'{what}={n} exceeds the largest bucket {max(buckets)}; '
                   'add a larger bucket to the Sampler')
