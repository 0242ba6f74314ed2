"""The paged engine's host page pool (rl.page_pool): per-shard free lists, on the host only."""

import subprocess
import sys

import pytest

from rl import page_pool


def test_host_modules_import_without_jax():
  # The pool and the scheduler are host logic: importing them must not pull in JAX.
  code = ('import sys; import rl.page_pool, rl.scheduler; '
          'assert "jax" not in sys.modules, sorted(m for m in sys.modules if "jax" in m)')
  subprocess.run([sys.executable, '-c', code], check=True, timeout=60)


def test_a_fresh_pool_hands_out_each_shards_low_pages_first():
  pool = page_pool.PagePool(12, 3)
  assert [pool.available(sh) for sh in range(3)] == [4, 4, 4] and pool.in_use == 0
  assert pool.take(0, 2) == [0, 1]
  assert pool.take(1, 1) == [4]
  assert pool.take(2, 4) == [8, 9, 10, 11]
  assert pool.in_use == 7 and pool.available(2) == 0
  with pytest.raises(RuntimeError, match='1 pages asked of shard 2, 0 free'):
    pool.take(2, 1)


def test_released_pages_are_taken_again_first_in_their_order():
  pool = page_pool.PagePool(8, 1)
  held = pool.take(0, 5)
  pool.release(0, [held[3], held[1]])
  assert pool.take(0, 3) == [held[3], held[1], 5]
  pool.release(0, [])
  assert pool.in_use == 6


def test_grow_takes_all_or_nothing():
  pool = page_pool.PagePool(6, 2)
  row = [0]
  pool.take(0, 1)
  assert not pool.grow(0, row, 3) and row == [0] and pool.available(0) == 2
  assert pool.grow(0, row, 2) and row == [0, 1, 2] and pool.available(0) == 0
  assert pool.grow(0, row, 0) and pool.grow(0, row, -1) and row == [0, 1, 2]


def test_reclaim_draws_victims_only_while_the_shard_is_short():
  pool = page_pool.PagePool(4, 1)
  held = [pool.take(0, 1) for _ in range(4)]
  drawn = []

  def victims():
    for pages in held:
      drawn.append(pages)
      yield lambda pages=pages: pool.release(0, pages)

  assert pool.reclaim(0, 2, victims())
  assert len(drawn) == 3 and pool.available(0) == 2   # the third is drawn, not called
  assert pool.reclaim(0, 1, iter(())) and not pool.reclaim(0, 3, iter(()))
  assert not pool.reclaim(0, 5, (lambda pages=p: pool.release(0, pages) for p in held[2:]))
  assert pool.available(0) == 4


@pytest.mark.parametrize('pages,shards', [(7, 2), (1, 2), (4, 0)])
def test_a_pool_splits_evenly_over_its_shards(pages, shards):
  with pytest.raises(ValueError, match='must split evenly'):
    page_pool.PagePool(pages, shards)
