"""The mixture-of-experts families' layer stack: residual sublayers chosen by a pattern.

`ModelConfig.mixers` lists the sublayers in order; each is `x + mixer(norm(x))`
with its own RMSNorm, the mixer one of

* 'attention': grouped-query attention (models/layers.py), with RoPE and q/k
  norms as the family has them (Qwen3-MoE: both; Nemotron-H: neither);
* 'mamba': a Mamba-2 mixer (models/mamba.py) carrying a (conv, ssm) state;
* 'mlp': an MLP (SwiGLU, or Nemotron-H's squared ReLU);
* 'moe': routed experts and an optional shared expert (models/moe.py).

Unlike the dense decoders' stacked blocks, the sublayers differ in kind, so
they run as an unrolled Python loop over their own parameters, and a cache is
per sublayer: a [B, K, S, H] key and value buffer per attention sublayer (the
dense cache's `unstack_cache` layout) and a `mamba.MambaState` per Mamba
sublayer. `models.transformer.Transformer` builds and calls this stack when
the config's family is not dense; its calling convention is unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models import config as config_lib
from models import layers
from models import mamba
from models import moe
from models import sharding


_collect = threading.local()


@contextlib.contextmanager
def collecting_stats():
  """Within it (at trace time), a mixture-of-experts model's `hidden` sows its `MoEStats` as an
  nnx.Intermediate 'moe_stats' for `moe_stats` to pop: the train step traces its loss so.
  Nowhere else: a sampler's decode loop calls the model inside a loop whose trace may not
  write the module's state."""
  old = getattr(_collect, 'on', False)
  _collect.on = True
  try:
    yield
  finally:
    _collect.on = old


def collecting() -> bool:
  return getattr(_collect, 'on', False)


class MoEStats(NamedTuple):
  """What a forward pass's 'moe' sublayers report (`Transformer.hidden` sows it as an
  nnx.Intermediate named 'moe_stats' within `collecting_stats`).

  Attributes:
    indices: [M, B, T, k] int32 experts each token chose in each of the M 'moe'
      sublayers (routing replay feeds these back).
    aux_loss: [] float32 load-balancing loss, the mean over the sublayers.
    z_loss: [] float32 router z-loss, the mean over the sublayers.
    mismatched: [] float32 (real token, 'moe' sublayer) pairs whose router's own expert set
      differs from the `routing` given (replayed or only compared); None without one.
    compared: [] float32 (real token, 'moe' sublayer) pairs compared; None without routing.
  """
  indices: jax.Array
  aux_loss: jax.Array
  z_loss: jax.Array
  mismatched: jax.Array | None = None
  compared: jax.Array | None = None


class Sublayer(nnx.Module):
  """x + mixer(norm(x)) for one entry of `cfg.mixers`."""

  def __init__(self, cfg: config_lib.ModelConfig, kind: str, rngs: nnx.Rngs):
    self.kind = kind
    self.norm = layers.RMSNorm(cfg.embed_dim, cfg.norm_eps, cfg.jnp_param_dtype)
    if kind == 'attention':
      self.mixer = layers.Attention(cfg, rngs)
    elif kind == 'mamba':
      self.mixer = mamba.Mamba2Mixer(cfg, rngs)
    elif kind == 'mlp':
      self.mixer = layers.MLP(cfg, rngs)
    elif kind == 'moe':
      self.mixer = moe.MoE(cfg, rngs)
    else:
      raise ValueError(f'unknown sublayer kind {kind!r}')

  def __call__(self, x, positions, mask, segment_ids, part=None, routing=None, replay=True):
    """One sublayer.

    Args:
      x: [B, T, D] residual stream.
      positions, mask: as the attention takes them (attention only).
      segment_ids: [B, T] int32, 0 = padding (Mamba resets and MoE statistics).
      part: this sublayer's cache: an attention's (k, v, None, index) own buffers or
        a `layers._PagedStep`; a Mamba mixer's MambaState; None otherwise.
      routing: [B, T, k] experts to use instead of the router's choice (moe only).
      replay: with `routing`, replay it (True) or only compare with it (moe only).

    Returns:
      (x, the written cache part or None, a moe.MoEOutput without y or None).
    """
    h = self.norm(x)
    report = None
    if self.kind == 'attention':
      h, part = self.mixer(h, positions, mask, part)
    elif self.kind == 'mamba':
      h, part = self.mixer(h, segment_ids, part)
    elif self.kind == 'mlp':
      h = self.mixer(h)
    else:
      out = self.mixer(h, token_mask=segment_ids > 0, routing=routing, replay=replay)
      h, report = out.y, out._replace(y=None)
    x = x + h.astype(x.dtype)
    return sharding.constrain(x, ('batch', 'length', 'embed')), part, report


def build(cfg: config_lib.ModelConfig, rngs: nnx.Rngs) -> nnx.List:
  """The sublayers of `cfg.mixers`, made one after another."""
  return nnx.List([Sublayer(cfg, kind, rngs) for kind in cfg.mixers])


def run(blocks: Sequence[Sublayer], cfg: config_lib.ModelConfig, x, positions, mask,
        segment_ids, *, kv=None, states=None, paged=None, routing=None, replay=True,
        remat: Callable | None = None):
  """x through every sublayer.

  Args:
    blocks: the sublayers (`build`).
    cfg: the model config.
    x: [B, T, D] embedded tokens.
    positions, mask: as attention takes them (mask None for a paged step).
    segment_ids: [B, T] int32.
    kv: None, or (ks, vs, index): a tuple of [B, K, S, H] buffers per attention sublayer
      and the slot the new tokens are written from.
    states: None, or a tuple of MambaState per Mamba sublayer (carried and returned).
    paged: a PagedCache whose k/v are tuples of per-attention-sublayer pools (a paged
      decode step; then `states` holds the slots' Mamba states).
    routing: None, or [M, B, T, k] int experts per 'moe' sublayer (routing replay).
    replay: with `routing`: replay it (True), or route on the routers' own choice and only
      count where it differs (`MoEStats.mismatched`).
    remat: wraps a sublayer's function for the backward pass (no cache only).

  Returns:
    (x, ks, vs, states, MoEStats or None): the written buffers / pools and states
    (tuples; empty without a cache).
  """
  ks = list(kv[0]) if kv is not None else list(paged.k) if paged is not None else []
  vs = list(kv[1]) if kv is not None else list(paged.v) if paged is not None else []
  states = list(states) if states is not None else None
  reports = []
  ai = mi = ei = 0
  for block in blocks:
    kind = block.kind
    part = None
    if kind == 'attention':
      if kv is not None:
        part = (ks[ai], vs[ai], None, kv[2])
      elif paged is not None:
        part = layers._PagedStep(ks[ai], vs[ai], None, paged)
    elif kind == 'mamba' and states is not None:
      part = states[mi]
    route = routing[ei] if (kind == 'moe' and routing is not None) else None
    if remat is not None and kv is None and paged is None and states is None:
      graphdef, params = nnx.split(block)

      def body(params, x, route, graphdef=graphdef):
        y, _, report = nnx.merge(graphdef, params)(x, positions, mask, segment_ids,
                                                   None, route, replay)
        return y, report
      x, report = remat(body)(params, x, route)
      part = None
    else:
      x, part, report = block(x, positions, mask, segment_ids, part, route, replay)
    if kind == 'attention':
      if part is not None:
        ks[ai], vs[ai] = part
      ai += 1
    elif kind == 'mamba':
      if states is not None:
        states[mi] = part
      mi += 1
    elif kind == 'moe':
      reports.append(report)
      ei += 1
  stats = None
  if reports:
    stats = MoEStats(indices=jnp.stack([r.indices for r in reports]),
                     aux_loss=jnp.mean(jnp.stack([r.aux_loss for r in reports])),
                     z_loss=jnp.mean(jnp.stack([r.z_loss for r in reports])))
    if routing is not None:
      real = jnp.sum((segment_ids > 0).astype(jnp.float32))
      stats = stats._replace(mismatched=sum(r.mismatched for r in reports),
                             compared=len(reports) * real)
  return x, tuple(ks), tuple(vs), None if states is None else tuple(states), stats


def init_kv(cfg: config_lib.ModelConfig, batch: int, length: int, dtype) -> tuple[tuple, tuple]:
  """Empty key and value buffers, one [B, K, S, H] per attention sublayer."""
  shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
  axes = ('batch', 'kv_heads', 'cache_length', 'head_dim')
  zeros = lambda: sharding.constrain(jnp.zeros(shape, dtype), axes)
  n = cfg.attention_layers
  return tuple(zeros() for _ in range(n)), tuple(zeros() for _ in range(n))


def init_states(cfg: config_lib.ModelConfig, batch: int, dtype=None) -> tuple:
  """Zero Mamba states, one per Mamba sublayer."""
  return tuple(mamba.init_state(cfg, batch, dtype) for _ in range(cfg.mamba_layers))


def repeat_rows(tree: Any, group: int) -> Any:
  """Every array of `tree` (per-sublayer buffers or states, batch first) with each row
  repeated `group` times."""
  return jax.tree.map(lambda x: jnp.repeat(x, group, axis=0), tree)


def moe_stats(model: nnx.Module) -> MoEStats | None:
  """Pops the 'moe_stats' intermediates sown by the model's forward passes since the last
  pop: their losses averaged over the passes, their routing mismatch counts summed over those
  that compared (None if none did), indices of the last pass; None if none."""
  found = nnx.pop(model, nnx.Intermediate)
  sown = []
  for path, var in nnx.to_flat_state(found):
    if path and path[-1] == 'moe_stats':
      value = var.get_value() if hasattr(var, 'get_value') else var.value
      sown.extend(value if isinstance(value, tuple) and value and
                  isinstance(value[0], MoEStats) else [value])
  if not sown:
    return None
  compared = [s for s in sown if s.mismatched is not None]
  return MoEStats(indices=sown[-1].indices,
                  aux_loss=jnp.mean(jnp.stack([s.aux_loss for s in sown])),
                  z_loss=jnp.mean(jnp.stack([s.z_loss for s in sown])),
                  mismatched=sum(s.mismatched for s in compared) if compared else None,
                  compared=sum(s.compared for s in compared) if compared else None)
