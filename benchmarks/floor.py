"""This machine's floor: its measured matmul rate and memory bandwidth (benchmarks print it)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from models import config as config_lib


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


def generation_floor(cfg: config_lib.ModelConfig, batch: int, prompt: int, new: int,
                     flops_rate: float, bandwidth: float) -> dict:
  """Lower bound on the generation time on this machine, from first principles.

  Counts the matmul FLOPs of the prefill and of every decode step (attention
  over the filled part of the cache only) and the bytes each step must read
  (all weights once, the filled KV cache), float32. A step cannot be faster
  than the larger of flops / rate and bytes / bandwidth.
  """
  d, n, k, h, f, v, l = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.mlp_dim, cfg.vocab_size, cfg.num_layers)
  block_weights = l * (d * n * h * 2 + d * k * h * 2 + 3 * d * f)
  param_bytes = 4 * cfg.num_params()
  kv_bytes_per_slot = 4 * l * 2 * k * h
  # Prefill: every prompt token through the blocks (causal attention), logits
  # at the last position only.
  fl = batch * (2 * block_weights * prompt + 2 * d * v + l * 4 * n * h * prompt * (prompt + 1) / 2)
  by = param_bytes + batch * prompt * kv_bytes_per_slot
  total_flops, total_bytes, floor = fl, by, max(fl / flops_rate, by / bandwidth)
  for t in range(1, new):          # the first token comes from the prefill's logits
    slots = prompt + t
    fl = batch * (2 * (block_weights + d * v) + l * 4 * n * h * slots)
    by = param_bytes + batch * slots * kv_bytes_per_slot
    total_flops += fl
    total_bytes += by
    floor += max(fl / flops_rate, by / bandwidth)
  return dict(flops=total_flops, bytes=total_bytes, flops_s=total_flops / flops_rate,
              bytes_s=total_bytes / bandwidth, floor_s=floor)


def update_flops(cfg, rows: int, width: int, tokens: int | None = None) -> float:
  """Matmul FLOPs of one training update (forward + backward, 3x the forward) over `rows` rows
  of `width` positions: the blocks and the output projection per real token (`tokens`, default
  rows x width) and causal attention within each row."""
  d, n, k, h, f, v, l = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.mlp_dim, cfg.vocab_size, cfg.num_layers)
  block_weights = l * (d * n * h * 2 + d * k * h * 2 + 3 * d * f)
  tokens = rows * width if tokens is None else tokens
  forward = 2 * (block_weights + d * v) * tokens + rows * l * 4 * n * h * width * (width + 1) / 2
  return 3 * forward


def _bare_weights(cfg: config_lib.ModelConfig, rng: np.random.Generator) -> dict:
  """Random float32 weights of the model's shapes: the tied embedding and every block's q, k,
  v, o, gate, up and down matrices (2-D, heads flattened)."""
  d, n, k, h, f = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim)
  w = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
  return dict(embed=w(cfg.vocab_size, d), blocks=[
      dict(q=w(d, n * h), k=w(d, k * h), v=w(d, k * h), o=w(n * h, d), gate=w(d, f),
           up=w(d, f), down=w(f, d)) for _ in range(cfg.num_layers)])


def _bare_block(x, p, groups: int, att=None):
  """x + o(att) then + the MLP, with `att` (default: q plus v repeated over the query `groups`,
  standing in for attention) the attention's output rows."""
  if att is None:
    att = x @ p['q'] + jnp.tile(x @ p['k'] + x @ p['v'], (1, groups))
  x = x + att @ p['o']
  return x + (jax.nn.silu(x @ p['gate']) * (x @ p['up'])) @ p['down']


def _median_seconds(fn, repeats: int) -> float:
  """Median wall time of `fn` (its result waited for) over `repeats` runs after a warm-up."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def xla_decode_loop(cfg: config_lib.ModelConfig, batch: int, prompt: int, new: int, *,
                    attention: bool = True, repeats: int = 3) -> float:
  """Median seconds of a bare jitted generation with the model's shapes on this backend.

  What the compiler itself reaches for the work the floor counts, with none of the
  model's other parts (no norms, RoPE, sampling or bookkeeping): random float32
  weights of the model's shapes, one pass of the prompt through every matmul, then
  `new - 1` steps of a `while_loop`, each through every block's q, k, v, o, gate,
  up and down matmuls and the output projection, the blocks unrolled over their own
  weights and their own [B, K, S, H] caches (S = prompt + new); with `attention`,
  each block writes its key and value slot and attends over its whole cache (two
  batched einsums and a softmax), else the value goes straight to the output
  projection. A step cannot beat its matmuls: when this loop without attention is
  above a target, no change to the model's code reaches the target on this backend.
  """
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  s = prompt + new

  def block(x, p, cache, slot):
    if not attention:
      return _bare_block(x, p, n // k), cache
    slot_of = lambda y: y.reshape(batch, k, 1, h)
    kc = jax.lax.dynamic_update_slice(cache[0], slot_of(x @ p['k']), (0, 0, slot, 0))
    vc = jax.lax.dynamic_update_slice(cache[1], slot_of(x @ p['v']), (0, 0, slot, 0))
    logits = jnp.einsum('BKGH,BKSH->BKGS', (x @ p['q']).reshape(batch, k, n // k, h), kc)
    out = jnp.einsum('BKGS,BKSH->BKGH', jax.nn.softmax(logits, -1), vc)
    return _bare_block(x, p, n // k, out.reshape(batch, n * h)), (kc, vc)

  @jax.jit
  def run(weights, tokens):
    embed = weights['embed']
    x = embed[tokens.reshape(-1)]                                      # the prefill's matmuls
    for p in weights['blocks']:
      x = _bare_block(x, p, n // k)
    last = x.reshape(batch, prompt, -1)[:, -1] @ embed.T
    caches = tuple((jnp.zeros((batch, k, s, h)), jnp.zeros((batch, k, s, h)))
                   for _ in weights['blocks'])

    def body(carry):
      step, logits, caches = carry
      x = embed[jnp.argmax(logits, -1)]
      caches = list(caches)
      for i, p in enumerate(weights['blocks']):
        x, caches[i] = block(x, p, caches[i], prompt + step - 1)
      return step + 1, x @ embed.T, tuple(caches)

    return jax.lax.while_loop(lambda c: c[0] < new, body, (1, last, caches))[1]

  weights = _bare_weights(cfg, np.random.default_rng(0))
  tokens = jnp.zeros((batch, prompt), jnp.int32)
  return _median_seconds(lambda: run(weights, tokens), repeats)


def xla_update(cfg: config_lib.ModelConfig, rows: int, width: int, *, repeats: int = 3) -> float:
  """Median seconds of a bare jitted forward + backward of the model's matmuls on this backend.

  The update's work without the model's other parts: random float32 weights of the
  model's shapes, `rows` x `width` tokens through every block's q, k, v, o, gate, up
  and down matmuls (the value standing in for attention, which `update_flops` counts
  besides) and the tied output projection, a log-softmax loss, and the gradient of
  every weight (no optimizer). When this is above a target, no change to the
  update's code reaches the target on this backend.
  """
  groups = cfg.num_heads // cfg.num_kv_heads
  rng = np.random.default_rng(0)
  weights = _bare_weights(cfg, rng)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows * width,)), jnp.int32)

  def loss(weights, tokens):
    x = weights['embed'][tokens]
    for p in weights['blocks']:
      x = _bare_block(x, p, groups)
    logp = jax.nn.log_softmax(x @ weights['embed'].T)
    return -jnp.mean(jnp.take_along_axis(logp, jnp.roll(tokens, -1)[:, None], 1))

  grad = jax.jit(jax.grad(loss))
  return _median_seconds(lambda: grad(weights, tokens), repeats)
