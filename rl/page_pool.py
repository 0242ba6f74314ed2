"""The paged engine's page accounting on the host: which KV pages of the pool are free.

The device pool (`rl.paged_programs`) is an array of fixed-size pages; this
module knows only page ids. The pool is split evenly over the mesh's batch
shards, and a row's pages all come from its own shard's part (each device
holds only its part of the pool), so every shard has its own free list. A
free list is a stack with the low pages on top: a fresh pool hands out
pages 0, 1, 2, ... of its part in order, and pages given back are taken
again first, most recently freed first, so allocation is deterministic
for a given sequence of requests.

Pure Python: no JAX, testable and reasoned about without a device.
"""

from __future__ import annotations

from typing import Callable, Iterable


class PagePool:
  """Free pages of a pool of `num_pages` pages split evenly over `shards` batch shards.

  Shard `sh` owns pages [sh * num_pages / shards, (sh + 1) * num_pages / shards).

  Attributes:
    num_pages: pages in the pool.
    shards: batch shards the pool is split over.
    free: per shard, its free pages as a stack (the next page taken is last).
  """

  def __init__(self, num_pages: int, shards: int):
    if shards < 1 or num_pages < shards or num_pages % shards:
      raise ValueError(f'page pool of {num_pages} pages must split evenly over {shards} shards')
    self.num_pages, self.shards = int(num_pages), int(shards)
    per_shard = self.num_pages // self.shards
    self.free: list[list[int]] = [list(range((sh + 1) * per_shard - 1, sh * per_shard - 1, -1))
                                  for sh in range(self.shards)]

  def available(self, shard: int) -> int:
    """Free pages of `shard`."""
    return len(self.free[shard])

  @property
  def in_use(self) -> int:
    """Pages not free, over every shard."""
    return self.num_pages - sum(map(len, self.free))

  def take(self, shard: int, count: int) -> list[int]:
    """`count` free pages of `shard`, lowest first (the caller has checked they are there)."""
    if count > len(self.free[shard]):
      raise RuntimeError(f'page pool: {count} pages asked of shard {shard}, '
                         f'{len(self.free[shard])} free')
    stack = self.free[shard]
    return [stack.pop() for _ in range(count)]

  def release(self, shard: int, pages: Iterable[int]) -> None:
    """Gives `pages` back to `shard`; the next `take` returns them first, in their order."""
    self.free[shard].extend(reversed(list(pages)))

  def grow(self, shard: int, pages: list[int], count: int) -> bool:
    """Extends `pages` (a row's list, in place) by `count` pages of `shard`, all or none.

    Returns:
      False (nothing taken) when the shard has fewer than `count` free pages.
    """
    if count > len(self.free[shard]):
      return False
    pages.extend(self.take(shard, max(0, count)))
    return True

  def reclaim(self, shard: int, count: int, victims: Iterable[Callable[[], object]]) -> bool:
    """Frees pages of `shard` until `count` are free, one victim at a time.

    Args:
      shard: the shard short of pages.
      count: free pages wanted.
      victims: callables that each give some pages of `shard` back, in the order
        they should go; drawn lazily, and only while the shard is short (a
        generator decides each victim when it is asked for it).

    Returns:
      Whether `count` pages of `shard` are free.
    """
    for victim in victims:
      if len(self.free[shard]) >= count:
        break
      victim()
    return len(self.free[shard]) >= count
