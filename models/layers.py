"""The layers every model family shares: RMSNorm, rotary embedding, grouped-query attention
and the MLP, in Flax NNX (models/transformer.py stacks them into the dense decoders,
models/hybrid.py into the mixture-of-experts families).

Shape letters: B batch, T query length, S key length (cache slots), D embed,
N query heads, K kv heads, H head_dim, F mlp.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models import attention
from models import config as config_lib
from models import rope
from models import sharding


def _matmul(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
  """x's last `contract` axes contracted with w's first `contract` axes, as one matmul
  over x's leading axes flattened into rows: [*lead, *in] x [*in, *out] -> [*lead, *out].

  With the leading axes kept apart (an einsum over B and T), the weight gradient
  contracts two axes and XLA:CPU first transposed the activations' gradients element
  by element: 1.4x the forward + backward time of an MLP block in a probe."""
  split = x.ndim - contract
  k = math.prod(x.shape[split:])
  return (x.reshape(-1, k) @ w.reshape(k, -1)).reshape(*x.shape[:split], *w.shape[contract:])


def _param(rngs: nnx.Rngs, shape, axes, dtype, std=0.02) -> nnx.Param:
  init = jax.nn.initializers.normal(std)
  return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * scale, computed in float32."""

  def __init__(self, dim: int, eps: float, param_dtype, axes=('norm',)):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=axes)

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale.value.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float,
               scaling: rope.RopeScaling | None = None) -> jax.Array:
  """Rotary embedding, HF 'rotate_half' layout. x: [B, T, N, H]; positions: [B, T].

  `scaling` (linear / YaRN / Llama-3, see models/rope.py) changes the
  frequencies; YaRN also scales cos and sin by its attention factor, as HF does.
  """
  h = x.shape[-1]
  if scaling is None:
    # Plain RoPE computes its frequencies in the graph, as it always has: XLA's float32 pow
    # and numpy's differ by an ulp for some exponents, and a deterministic run's numbers
    # (the tiny demo's table) must not move.
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    attention_factor = 1.0
  else:
    inv_freq, attention_factor = rope.inv_freq(h, theta, scaling)
  ang = positions.astype(jnp.float32)[..., None] * inv_freq          # [B, T, H/2]
  sin, cos = jnp.sin(ang)[:, :, None, :], jnp.cos(ang)[:, :, None, :]
  if attention_factor != 1.0:
    sin, cos = sin * attention_factor, cos * attention_factor
  # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], as x * [cos, cos] - [x2, x1] * [sin, -sin]:
  # the same products and differences (bit for bit, fused multiply-adds included), where
  # splitting x and concatenating the halves made a loop XLA:CPU ran several times slower
  # (about 7 % of a tiny decode step).
  xf = x.astype(jnp.float32)
  swapped = jnp.flip(xf.reshape(*x.shape[:-1], 2, h // 2), -2).reshape(x.shape)
  return (xf * jnp.concatenate([cos, cos], -1)
          - swapped * jnp.concatenate([sin, -sin], -1)).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query attention with optional q/k/v bias (Qwen2) and q/k norm (Qwen3)."""

  def __init__(self, cfg: config_lib.ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = cfg.jnp_param_dtype
    self.q_proj = _param(rngs, (d, n, h), ('embed', 'heads', 'head_dim'), pd)
    self.k_proj = _param(rngs, (d, k, h), ('embed', 'kv_heads', 'head_dim'), pd)
    self.v_proj = _param(rngs, (d, k, h), ('embed', 'kv_heads', 'head_dim'), pd)
    self.o_proj = _param(rngs, (n, h, d), ('heads', 'head_dim', 'embed'), pd)
    if cfg.qkv_bias:
      self.q_bias = nnx.Param(jnp.zeros((n, h), pd), logical_axes=('heads', 'head_dim'))
      self.k_bias = nnx.Param(jnp.zeros((k, h), pd), logical_axes=('kv_heads', 'head_dim'))
      self.v_bias = nnx.Param(jnp.zeros((k, h), pd), logical_axes=('kv_heads', 'head_dim'))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.norm_eps, pd, axes=('head_dim',))
      self.k_norm = RMSNorm(h, cfg.norm_eps, pd, axes=('head_dim',))

  def __call__(self, x, positions, mask, kv_cache=None, *,
               rules: sharding.Rules = sharding.DEFAULT_RULES):
    """x: [B, T, D]; mask: an attention.MaskInfo; kv_cache: (k, v, layer, index) or None;
    rules: the logical rules the caller traces with (`models.sharding`).

    With a cache (k, v: every layer's [L, B, K, S, H]) the new keys/values are
    written in place at layer `layer`, slots [index, index + T), and the
    queries attend to that layer's slots. With layer None, k and v are this
    layer's own [B, K, S, H] buffers.

    Returns:
      (out [B, T, D], (k, v) written cache arrays or None).
    """
    cfg = self.cfg
    dt = cfg.jnp_dtype
    q = _matmul(x, self.q_proj.value.astype(dt))                      # [B, T, N, H]
    k = _matmul(x, self.k_proj.value.astype(dt))                      # [B, T, K, H]
    v = _matmul(x, self.v_proj.value.astype(dt))
    if cfg.qkv_bias:
      q = q + self.q_bias.value.astype(dt)
      k = k + self.k_bias.value.astype(dt)
      v = v + self.v_bias.value.astype(dt)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    own_buffers = kv_cache is not None and kv_cache[2] is None     # no layer index
    if not cfg.use_rope:   # Nemotron-H: positions come from its Mamba layers
      pass
    elif own_buffers:
      # One rotation for q and k: rotated apart, XLA:CPU fuses k's rotation into the cache
      # write, which then copies the layer's whole cache instead of writing T slots in place.
      n = q.shape[2]
      qk = apply_rope(jnp.concatenate([q, k], axis=2), positions, cfg.rope_theta,
                      cfg.rope_scaling)
      q, k = qk[:, :, :n], qk[:, :, n:]
    else:
      q = apply_rope(q, positions, cfg.rope_theta, cfg.rope_scaling)
      k = apply_rope(k, positions, cfg.rope_theta, cfg.rope_scaling)
    q = sharding.constrain(q, ('batch', 'length', 'heads', 'head_dim'), rules)
    k = sharding.constrain(k, ('batch', 'length', 'kv_heads', 'head_dim'), rules)
    v = sharding.constrain(v, ('batch', 'length', 'kv_heads', 'head_dim'), rules)

    if isinstance(kv_cache, _PagedStep):
      return self._paged(q, k, v, kv_cache, rules)
    new_kv = None
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)            # [B, K, T, H]
    if kv_cache is not None:
      ck, cv, layer, index = kv_cache
      if own_buffers:
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, 0, index, 0))
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, 0, index, 0))
        new_kv, k, v = (ck, cv), ck, cv
      else:
        start = (layer, 0, 0, index, 0)
        ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), start)
        cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), start)
        new_kv = (ck, cv)
        # The stacks are updated in place and only this layer is read: no
        # per-layer copy that is written and then put back.
        k = jax.lax.dynamic_index_in_dim(ck, layer, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(cv, layer, keepdims=False)

    out = attention.attend(q, k, v, mask, impl=cfg.attention, block_q=cfg.attention_block_q,
                           block_kv=cfg.attention_block_kv, rules=rules)   # [B, T, N, H]
    out = _matmul(out, self.o_proj.value.astype(dt), contract=2)      # [B, T, D]
    return sharding.constrain(out, ('batch', 'length', 'embed'), rules), new_kv


  def _paged(self, q, k, v, step: '_PagedStep', rules: sharding.Rules):
    """One decode token per slot (q [S, 1, N, H], k/v [S, 1, K, H]) through a paged cache.

    `step.k`/`step.v`: every layer's pool [L, K, P, page_size, H], or with `step.layer`
    None this layer's own pool [K, P, page_size, H]."""
    ck, cv, layer, cache = step
    num_pages, ps = ck.shape[-3], ck.shape[-2]
    # Slot s writes its token at position lengths[s]; a slot that is not live writes past the
    # pool's last page, which the scatter drops.
    page = jnp.take_along_axis(cache.page_table, (cache.lengths // ps)[:, None], axis=1)[:, 0]
    page = jnp.where(cache.live, page, num_pages)
    off = cache.lengths % ps
    if layer is None:
      # [K, P, page_size, H] indexed [:, page, off] is [K, S, H]: heads lead the slots.
      ck = ck.at[:, page, off].set(k[:, 0].swapaxes(0, 1).astype(ck.dtype), mode='drop')
      cv = cv.at[:, page, off].set(v[:, 0].swapaxes(0, 1).astype(cv.dtype), mode='drop')
      k_pages, v_pages = ck, cv
    else:
      ck = ck.at[layer, :, page, off].set(k[:, 0].astype(ck.dtype), mode='drop')
      cv = cv.at[layer, :, page, off].set(v[:, 0].astype(cv.dtype), mode='drop')
      k_pages = jax.lax.dynamic_index_in_dim(ck, layer, keepdims=False)
      v_pages = jax.lax.dynamic_index_in_dim(cv, layer, keepdims=False)
    out = attention.paged_attend(q[:, 0], k_pages, v_pages, cache.lengths + 1,
                                 cache.page_table, impl=self.cfg.attention, rules=rules)
    out = jnp.einsum('BNH,NHD->BD', out, self.o_proj.value.astype(self.cfg.jnp_dtype))
    return sharding.constrain(out[:, None], ('batch', 'length', 'embed'), rules), (ck, cv)


class _PagedStep(NamedTuple):
  """What a block's attention needs for one paged decode step (see `Transformer.decode_paged`)."""
  k: jax.Array
  v: jax.Array
  layer: jax.Array
  cache: PagedCache


class MLP(nnx.Module):
  """SwiGLU, down(silu(gate(x)) * up(x)), or with cfg.mlp_activation 'relu2' (Nemotron-H)
  down(relu(up(x))^2); hidden width `dim` (default cfg.mlp_dim)."""

  def __init__(self, cfg: config_lib.ModelConfig, rngs: nnx.Rngs, dim: int | None = None):
    self.cfg = cfg
    d, pd = cfg.embed_dim, cfg.jnp_param_dtype
    f = cfg.mlp_dim if dim is None else dim
    if cfg.mlp_activation == 'swiglu':
      self.gate_proj = _param(rngs, (d, f), ('embed', 'mlp'), pd)
    self.up_proj = _param(rngs, (d, f), ('embed', 'mlp'), pd)
    self.down_proj = _param(rngs, (f, d), ('mlp', 'embed'), pd)

  def __call__(self, x, *, rules: sharding.Rules = sharding.DEFAULT_RULES):
    """x [B, T, D] -> [B, T, D]; `rules`: the logical rules the caller traces with."""
    dt = self.cfg.jnp_dtype
    if self.cfg.mlp_activation == 'swiglu':
      w = (self.gate_proj.value.astype(dt), self.up_proj.value.astype(dt),
           self.down_proj.value.astype(dt))
      fn = functools.partial(_swiglu, rules=rules)
    else:
      w = (self.up_proj.value.astype(dt), self.down_proj.value.astype(dt))
      fn = functools.partial(_relu2, rules=rules)
    b, t, d = x.shape
    c = self.cfg.mlp_chunk
    if not c or t <= c:
      return fn(w, x)
    # Position-wise, so chunks of the sequence are independent: a loop over them whose
    # body saves nothing holds one chunk's [B, c, F] at a time in both passes.
    n = -(-t // c)
    xs = jnp.moveaxis(jnp.pad(x, ((0, 0), (0, n * c - t), (0, 0))).reshape(b, n, c, d), 1, 0)
    body = jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    ys = jax.lax.map(lambda xc: body(w, xc), xs)
    return jnp.moveaxis(ys, 0, 1).reshape(b, n * c, d)[:, :t]


def _swiglu(w, x, *, rules: sharding.Rules):
  """down(silu(gate(x)) * up(x)) with w = (gate [D, F], up [D, F], down [F, D]).

  The matmuls run over [B * T] rows (`_matmul`)."""
  h = jax.nn.silu(_matmul(x, w[0])) * _matmul(x, w[1])
  h = sharding.constrain(h, ('batch', 'length', 'mlp'), rules)
  return _matmul(h, w[2])


def _relu2(w, x, *, rules: sharding.Rules):
  """down(relu(up(x))^2) with w = (up [D, F], down [F, D])."""
  h = jnp.square(jax.nn.relu(_matmul(x, w[0])))
  h = sharding.constrain(h, ('batch', 'length', 'mlp'), rules)
  return _matmul(h, w[1])
