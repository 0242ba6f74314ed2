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


def _mlp_matrices(cfg: config_lib.ModelConfig) -> int:
  """Matrices of an MLP or an expert: gate, up and down (SwiGLU) or up and down (relu2)."""
  return 3 if cfg.mlp_activation == 'swiglu' else 2


def _step_work(cfg: config_lib.ModelConfig, mixer: str) -> tuple[int, int]:
  """(matmul weights a token multiplies in one sublayer, other FLOPs per token).

  Routed experts count `experts_per_token` of them (the active parameters), attention its
  projections (the scores over the cache are counted by the caller), a Mamba-2 mixer its in-
  and out-projections plus, besides the matmuls, its convolution step (2 K C) and its state
  update and readout: decay h by exp(dt A), add the outer product dt x B^T, read out h C
  (5 H P N per token, the recurrent form; the chunked form of a long prefill does more).
  Norms, activations and biases are left out, as for the dense families."""
  d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if mixer == 'attention':
    return d * n * h * 2 + d * k * h * 2, 0
  if mixer == 'mlp':
    return _mlp_matrices(cfg) * d * cfg.mlp_dim, 0
  if mixer == 'moe':
    return (d * cfg.num_experts + _mlp_matrices(cfg) * d * (
        cfg.experts_per_token * cfg.moe_dim + cfg.shared_expert_dim)), 0
  hp, gn = cfg.mamba_heads * cfg.mamba_head_dim, cfg.mamba_groups * cfg.mamba_state
  return (d * (2 * hp + 2 * gn + cfg.mamba_heads) + hp * d,
          2 * cfg.mamba_conv * cfg.mamba_conv_dim + 5 * hp * cfg.mamba_state)


def experts_read(cfg: config_lib.ModelConfig, tokens: int) -> int:
  """Routed experts of one 'moe' sublayer whose weights a step over `tokens` tokens reads.

  The floor uses the most a step can touch, min(E, tokens x K) for E experts and top-K: what
  a router that spreads tokens reaches once tokens x K >> E (balanced routing touches
  E (1 - (1 - K / E)^tokens) in expectation: 7.999 of 8 for 32 rows of the tiny presets'
  top-2; 5.5 for 4 rows, where this bound overstates), and what XLA:CPU's grouped matmul
  reads whatever the routing (it multiplies by every expert). The strict lower bound, K
  (every token choosing the same experts), would be a floor no real router comes near."""
  return min(cfg.num_experts, tokens * cfg.experts_per_token)


def _weight_bytes(cfg: config_lib.ModelConfig, tokens: int) -> int:
  """Bytes of the parameters a step over `tokens` tokens reads (float32): all of them but
  the routed experts it does not touch (`experts_read`) and, when the output projection is
  its own matrix, the input embedding's rows it does not look up."""
  unread = 0
  if 'moe' in cfg.mixers:
    unread = cfg.mixers.count('moe') * (cfg.num_experts - experts_read(cfg, tokens)) * (
        _mlp_matrices(cfg) * cfg.embed_dim * cfg.moe_dim)
  if not cfg.tie_embeddings:
    unread += max(cfg.vocab_size - tokens, 0) * cfg.embed_dim
  return 4 * (cfg.num_params() - unread)


def generation_floor(cfg: config_lib.ModelConfig, batch: int, prompt: int, new: int,
                     flops_rate: float, bandwidth: float) -> dict:
  """Lower bound on the generation time on this machine, from first principles.

  Counts the FLOPs of the prefill and of every decode step: the matmuls of the active
  parameters (a 'moe' sublayer's router, shared expert and `experts_per_token` routed
  experts), the attention sublayers' scores over the filled part of their cache, the Mamba
  sublayers' convolution and state update (`_step_work`), and the output projection; and
  the bytes each step must read, float32: the parameters it touches (`_weight_bytes`: every
  routed expert some row chose, `experts_read`), the attention sublayers' filled KV cache,
  and the Mamba sublayers' state, read and written back. A step cannot be faster than the
  larger of flops / rate and bytes / bandwidth. For the dense families (every layer
  attention + MLP) the same sums as before the mixture-of-experts families came.

  Returns:
    A dict: flops, bytes, flops_s, bytes_s, floor_s (the sum over steps of each step's
    larger time), step_weight_bytes (a decode step's parameter reads), step_state_bytes (its
    Mamba state reads and writes) and experts_read (its routed experts per 'moe' sublayer, 0
    without any).
  """
  d, n, k, h, v = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.vocab_size)
  work = [_step_work(cfg, m) for m in cfg.mixers]
  weights = sum(w for w, _ in work)
  other = sum(o for _, o in work)
  attn = cfg.attention_layers
  kv_bytes_per_slot = 4 * attn * 2 * k * h
  state_bytes = 4 * cfg.mamba_layers * (
      cfg.mamba_heads * cfg.mamba_head_dim * cfg.mamba_state
      + (cfg.mamba_conv - 1) * cfg.mamba_conv_dim)
  # Prefill: every prompt token through the sublayers (causal attention), logits at the last
  # position only; each row's Mamba state written once.
  fl = batch * ((2 * weights + other) * prompt + 2 * d * v
                + attn * 4 * n * h * prompt * (prompt + 1) / 2)
  by = (_weight_bytes(cfg, batch * prompt) + batch * prompt * kv_bytes_per_slot
        + batch * state_bytes)
  total_flops, total_bytes, floor = fl, by, max(fl / flops_rate, by / bandwidth)
  step_weights = _weight_bytes(cfg, batch)
  for t in range(1, new):          # the first token comes from the prefill's logits
    slots = prompt + t
    fl = batch * (2 * (weights + d * v) + other + attn * 4 * n * h * slots)
    by = step_weights + batch * (slots * kv_bytes_per_slot + 2 * state_bytes)
    total_flops += fl
    total_bytes += by
    floor += max(fl / flops_rate, by / bandwidth)
  return dict(flops=total_flops, bytes=total_bytes, flops_s=total_flops / flops_rate,
              bytes_s=total_bytes / bandwidth, floor_s=floor, step_weight_bytes=step_weights,
              step_state_bytes=batch * 2 * state_bytes,
              experts_read=experts_read(cfg, batch) if 'moe' in cfg.mixers else 0)


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
  """Random float32 weights of the model's shapes, 2-D with heads flattened: the embedding,
  the output projection when it is its own matrix, and per entry of `cfg.mixers` an
  attention's q, k, v and o, an MLP's (gate,) up and down, a 'moe' sublayer's router, its
  routed experts side by side ([D, E F] up (and gate), [E F, D] down) and its shared
  expert's, or a Mamba-2 mixer's fused in-projection [D, 2HP + 2GN + H] (z, x, B, C, dt),
  convolution [K, HP + 2GN], per-head A, dt bias and skip D, and out-projection."""
  d, n, k, h, f = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim)
  w = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
  swiglu = cfg.mlp_activation == 'swiglu'

  def mlp(width):
    return dict(up=w(d, width), down=w(width, d), **({'gate': w(d, width)} if swiglu else {}))

  def sublayer(kind):
    if kind == 'attention':
      return dict(q=w(d, n * h), k=w(d, k * h), v=w(d, k * h), o=w(n * h, d))
    if kind == 'mlp':
      return mlp(f)
    if kind == 'moe':
      ef = cfg.num_experts * cfg.moe_dim
      return dict(router=w(d, cfg.num_experts), experts=mlp(ef),
                  shared=mlp(cfg.shared_expert_dim) if cfg.shared_expert_dim else None)
    hp, heads = cfg.mamba_heads * cfg.mamba_head_dim, cfg.mamba_heads
    return dict(in_proj=w(d, hp + cfg.mamba_conv_dim + heads),
                conv=w(cfg.mamba_conv, cfg.mamba_conv_dim), out=w(hp, d),
                a=-jnp.arange(1, heads + 1, dtype=jnp.float32), dt_bias=w(heads), skip=w(heads))

  return dict(embed=w(cfg.vocab_size, d),
              head=None if cfg.tie_embeddings else w(d, cfg.vocab_size),
              layers=[sublayer(kind) for kind in cfg.mixers])


def _bare_mlp(cfg, x, p):
  """down(silu(gate x) * up x) or down(relu(up x)^2)."""
  up = x @ p['up']
  act = jax.nn.silu(x @ p['gate']) * up if 'gate' in p else jnp.square(jax.nn.relu(up))
  return act @ p['down']


def _bare_moe(cfg, x, p):
  """The router's top-k (weights: a softmax over the chosen logits), every routed expert over
  every row as two products with the experts side by side, each expert's hidden rows scaled
  by the row's weight for it (zero where not chosen), and the shared expert."""
  e, kk = cfg.num_experts, cfg.experts_per_token
  top, idx = jax.lax.top_k(x @ p['router'], kk)
  comb = jnp.sum(jax.nn.one_hot(idx, e) * jax.nn.softmax(top)[..., None], axis=-2)  # [R, E]
  hp = p['experts']
  up = x @ hp['up']
  act = jax.nn.silu(x @ hp['gate']) * up if 'gate' in hp else jnp.square(jax.nn.relu(up))
  act = (act.reshape(x.shape[0], e, -1) * comb[..., None]).reshape(x.shape[0], -1)
  out = act @ hp['down']
  return out if p['shared'] is None else out + _bare_mlp(cfg, x, p['shared'])


def _bare_mamba_step(cfg, x, p, state):
  """One position of the Mamba-2 mixer, rows x [R, D]: the in-projection, the convolution over
  the last K inputs, dt = softplus(. + bias), h = exp(dt A) h + dt x B^T, y = h C + D x,
  y silu(z) (no norm) and the out-projection; state (conv [R, K - 1, C], ssm [R, G, H / G, P,
  N]: the heads by group)."""
  hp, gn, heads, pdim = (cfg.mamba_heads * cfg.mamba_head_dim,
                         cfg.mamba_groups * cfg.mamba_state, cfg.mamba_heads,
                         cfg.mamba_head_dim)
  g, r = cfg.mamba_groups, heads // cfg.mamba_groups
  rows = x.shape[0]
  u = x @ p['in_proj']
  z, xbc, dt = u[:, :hp], u[:, hp:2 * hp + 2 * gn], u[:, 2 * hp + 2 * gn:]
  window = jnp.concatenate([state[0], xbc[:, None]], axis=1)            # [R, K, C]
  xbc = jax.nn.silu(jnp.sum(window * p['conv'], axis=1))
  xs = xbc[:, :hp].reshape(rows, g, r, pdim)
  bm = xbc[:, hp:hp + gn].reshape(rows, g, -1)
  cm = xbc[:, hp + gn:].reshape(rows, g, -1)
  dt = jax.nn.softplus(dt + p['dt_bias']).reshape(rows, g, r)
  ssm = (jnp.exp(dt * p['a'].reshape(g, r))[..., None, None] * state[1]
         + jnp.einsum('bgrp,bgn->bgrpn', xs * dt[..., None], bm))
  y = jnp.einsum('bgn,bgrpn->bgrp', cm, ssm) + p['skip'].reshape(g, r, 1) * xs
  y = y.reshape(rows, hp) * jax.nn.silu(z)
  return y @ p['out'], (window[:, 1:], ssm)


def _bare_sublayer(cfg, kind, x, p):
  """A sublayer's matmuls alone on rows x [R, D]: an attention's output projection takes q
  plus k + v repeated over the query groups (standing in for attention), a Mamba mixer's the
  z and x channels plus the sum of its B, C and dt ones (standing in for the convolution and
  the scan); the MLP and the 'moe' sublayer are whole."""
  if kind == 'attention':
    groups = cfg.num_heads // cfg.num_kv_heads
    return (x @ p['q'] + jnp.tile(x @ p['k'] + x @ p['v'], (1, groups))) @ p['o']
  if kind == 'mlp':
    return _bare_mlp(cfg, x, p)
  if kind == 'moe':
    return _bare_moe(cfg, x, p)
  hp = cfg.mamba_heads * cfg.mamba_head_dim
  u = x @ p['in_proj']
  return (u[:, :hp] + u[:, hp:2 * hp] + jnp.sum(u[:, 2 * hp:], -1, keepdims=True)) @ p['out']


def _bare_logits(weights, x):
  return x @ (weights['embed'].T if weights['head'] is None else weights['head'])


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
  """Median seconds of a bare jitted generation with the model's shapes on this backend
  (`xla_decode_loop_fn`'s program)."""
  return _median_seconds(xla_decode_loop_fn(cfg, batch, prompt, new, attention=attention),
                         repeats)


def xla_decode_loop_fn(cfg: config_lib.ModelConfig, batch: int, prompt: int, new: int, *,
                       attention: bool = True):
  """A bare jitted generation with the model's shapes on this backend, as a function of no
  arguments that runs it once (compiled at its first call; wait for its result to time it).

  What the compiler itself reaches for the work the floor counts, with none of the
  model's other parts (no norms, RoPE, sampling or bookkeeping): random float32
  weights of the model's shapes (`_bare_weights`), one pass of the prompt through every
  sublayer's matmuls (`_bare_sublayer`), then `new - 1` steps of a `while_loop`, each
  through every sublayer of `cfg.mixers` in turn, unrolled over their own weights and
  states, and the output projection. With `attention`, an attention sublayer writes its
  key and value slot into its own [B, K, S, H] cache (S = prompt + new) and attends over
  the whole cache (two batched einsums and a softmax), and a Mamba sublayer runs its
  convolution and state update on its carried state (`_bare_mamba_step`); without, both
  are their matmuls alone. MLPs are whole; a 'moe' sublayer runs every routed expert
  over every row (`_bare_moe`): E / experts_per_token times the routed FLOPs the floor
  counts, but with a small batch every expert's weights are read anyway, and on the CPU
  it was the fastest exact form (0.4x the time of `jax.lax.ragged_dot`, which XLA:CPU
  runs as a masked product over every expert for each (token, choice) pair, and 0.1x a
  gather of each row's experts, in a probe at 32 rows, D 192, F 256, 8 experts, top-2).
  A step cannot beat its matmuls: when this loop without attention is above a target,
  no change to the model's code reaches the target on this backend.
  """
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  s = prompt + new

  def attend(x, p, cache, slot):
    slot_of = lambda y: y.reshape(batch, k, 1, h)
    kc = jax.lax.dynamic_update_slice(cache[0], slot_of(x @ p['k']), (0, 0, slot, 0))
    vc = jax.lax.dynamic_update_slice(cache[1], slot_of(x @ p['v']), (0, 0, slot, 0))
    logits = jnp.einsum('BKGH,BKSH->BKGS', (x @ p['q']).reshape(batch, k, n // k, h), kc)
    out = jnp.einsum('BKGS,BKSH->BKGH', jax.nn.softmax(logits, -1), vc)
    return out.reshape(batch, n * h) @ p['o'], (kc, vc)

  def sublayer(kind, x, p, state, slot):
    if attention and kind == 'attention':
      y, state = attend(x, p, state, slot)
    elif attention and kind == 'mamba':
      y, state = _bare_mamba_step(cfg, x, p, state)
    else:
      y = _bare_sublayer(cfg, kind, x, p)
    return x + y, state

  def zero_state(kind):
    if kind == 'attention' and attention:
      return jnp.zeros((batch, k, s, h)), jnp.zeros((batch, k, s, h))
    if kind == 'mamba' and attention:
      return (jnp.zeros((batch, cfg.mamba_conv - 1, cfg.mamba_conv_dim)),
              jnp.zeros((batch, cfg.mamba_groups, cfg.mamba_heads // cfg.mamba_groups,
                         cfg.mamba_head_dim, cfg.mamba_state)))
    return None

  @jax.jit
  def run(weights, tokens):
    x = weights['embed'][tokens.reshape(-1)]                          # the prefill's matmuls
    for kind, p in zip(cfg.mixers, weights['layers']):
      x = x + _bare_sublayer(cfg, kind, x, p)
    last = _bare_logits(weights, x.reshape(batch, prompt, -1)[:, -1])
    states = tuple(zero_state(kind) for kind in cfg.mixers)

    def body(carry):
      step, logits, states = carry
      x = weights['embed'][jnp.argmax(logits, -1)]
      states = list(states)
      for i, (kind, p) in enumerate(zip(cfg.mixers, weights['layers'])):
        x, states[i] = sublayer(kind, x, p, states[i], prompt + step - 1)
      return step + 1, _bare_logits(weights, x), tuple(states)

    return jax.lax.while_loop(lambda c: c[0] < new, body, (1, last, states))[1]

  weights = _bare_weights(cfg, np.random.default_rng(0))
  tokens = jnp.zeros((batch, prompt), jnp.int32)
  return lambda: run(weights, tokens)


def xla_update(cfg: config_lib.ModelConfig, rows: int, width: int, *, repeats: int = 3) -> float:
  """Median seconds of a bare jitted forward + backward of the model's matmuls on this backend
  (`xla_update_fn`'s program)."""
  return _median_seconds(xla_update_fn(cfg, rows, width), repeats)


def xla_update_fn(cfg: config_lib.ModelConfig, rows: int, width: int):
  """A bare jitted forward + backward of the model's matmuls on this backend, as a function of
  no arguments that runs it once (compiled at its first call).

  The update's work without the model's other parts: random float32 weights of the
  model's shapes, `rows` x `width` tokens through every sublayer's matmuls
  (`_bare_sublayer`, with its stand-in for attention, which `update_flops` counts
  besides) and the output projection, a log-softmax loss, and the gradient of every
  weight (no optimizer). When this is above a target, no change to the update's code
  reaches the target on this backend.
  """
  rng = np.random.default_rng(0)
  weights = _bare_weights(cfg, rng)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows * width,)), jnp.int32)

  def loss(weights, tokens):
    x = weights['embed'][tokens]
    for kind, p in zip(cfg.mixers, weights['layers']):
      x = x + _bare_sublayer(cfg, kind, x, p)
    logp = jax.nn.log_softmax(_bare_logits(weights, x))
    return -jnp.mean(jnp.take_along_axis(logp, jnp.roll(tokens, -1)[:, None], 1))

  grad = jax.jit(jax.grad(loss))
  return lambda: grad(weights, tokens)
