"""This machine's floor: its measured matmul rate and memory bandwidth (benchmarks print it)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def best_seconds(fn, repeats: int) -> float:
  """Best wall time of `fn` (its result waited for) over `repeats` runs after a warm-up."""
  fn()
  best = float('inf')
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t)
  return best


def measure_machine(matmul_shapes) -> tuple[float, float]:
  """(float32 matmul FLOP/s, memory read bytes/s) of this machine, best of a few runs.

  The matmul rate is the best over a 1024^3 product and `matmul_shapes` (the
  model's own [M, K] x [K, N] products): skinny decode matmuls ran faster than
  the square one here, and the floor should use the best rate seen.
  """
  flops = 0.0
  for m, k, n in ((1024, 1024, 1024),) + tuple(matmul_shapes):
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    flops = max(flops, 2 * m * k * n / best_seconds(lambda: matmul(a, w), 10))
  x = jnp.ones((64 * 2 ** 20,), jnp.float32)                 # 256 MiB, far beyond caches
  read = jax.jit(jnp.sum)
  bandwidth = x.nbytes / best_seconds(lambda: read(x), 5)
  return flops, bandwidth


def longtail_limits(rows: int, cap: int, seed: int) -> np.ndarray:
  """Per-row target lengths: lognormal with median cap / 8 (sigma 1), clipped to [1, cap],
  and one row in 32 (at least one) at the cap."""
  rng = np.random.default_rng(seed + 1)
  lim = np.clip(np.round(rng.lognormal(np.log(cap / 8), 1.0, rows)), 1, cap).astype(np.int64)
  lim[rng.choice(rows, max(1, rows // 32), replace=False)] = cap
  return lim
