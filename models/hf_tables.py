"""Hugging Face tensor tables: which HF tensor fills which of our parameters, and how.

A table entry is one HF tensor and the parameters (or slices of them) it fills
(`Tensor`, `Part`): most fill one parameter whole; Nemotron-H's Mamba `in_proj.weight`,
`conv1d.weight` and `conv1d.bias` are several of our parameters concatenated
(layouts in models/mamba.py's docstring); a per-expert tensor fills one expert's slice of
a stacked [E, ...] parameter, and Qwen3-MoE's fused `gate_up_proj` fills two (layouts in
models/moe.py's docstring).

The builders here (`single`, `linear`, `attention`, `mlp`, `mamba`, `moe`) are what each
family's module (models/families) writes its table from; models/hf.py reads, places and
writes the tensors a family's table describes. Layouts (ours <- HF, torch Linear weights
are [out, in]):
  embed [V, D] <- embed_tokens [V, D];   lm_head [D, V] <- lm_head [V, D]
  q/k/v_proj [D, N|K, H] <- [N|K * H, D]; o_proj [N, H, D] <- [D, N * H]
  q/k/v_bias [N|K, H] <- [N|K * H];        gate/up [D, F] <- [F, D]; down [F, D] <- [D, F]
  norm scales [D] or [H] unchanged.

This module imports nothing of the project's (a family module imports it, and
`models.config` imports the families): the configs it reads are duck-typed `ModelConfig`s.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Collection, Mapping

import numpy as np

ModelConfig = Any   # models.config.ModelConfig, not imported (see the module docstring)

EXPERT_INDEX = re.compile(r'\.experts\.(\d+)\.')


@dataclasses.dataclass(frozen=True)
class Part:
  """A parameter, or one slice of a stacked one, that an HF tensor fills.

  Attributes:
    path: the parameter's nnx flat-state path, e.g. ('blocks', 3, 'mixer', 'up').
    from_hf: the HF tensor -> this parameter's value (or slice).
    index: None for the whole parameter; else the slice of its leading axis (a
      layer of the dense blocks' [L, ...] stack, an expert of an [E, ...] one), or a
      tuple of indices into its leading axes (a sublayer of a repeated segment's
      [repeats, ...] stack, then maybe an expert: models/hybrid.py `locate`).
  """
  path: tuple
  from_hf: Callable[[np.ndarray], np.ndarray]
  index: int | tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One HF tensor: its name and shape, what it fills, and how it is rebuilt.

  Attributes:
    name: the HF tensor name.
    shape: its shape.
    parts: the parameters (or slices) it fills.
    to_hf: the parts' values (or slices), in `parts` order -> the HF tensor.
  """
  name: str
  shape: tuple[int, ...]
  parts: tuple[Part, ...]
  to_hf: Callable[..., np.ndarray]


def _same(x):
  return x


def _transpose(x):
  return x.T


def _swap(x):  # [E, a, b] <-> [E, b, a]
  return x.swapaxes(1, 2)


def single(path: tuple, name: str, shape, from_hf=_same, to_hf=_same,
           index: int | None = None) -> Tensor:
  """An HF tensor that fills one parameter (or slice) whole."""
  return Tensor(name, tuple(shape), (Part(path, from_hf, index),), to_hf)


def linear(path: tuple, name: str, out_dim: int, in_dim: int, index: int | None = None) -> Tensor:
  """A torch Linear weight [out, in] <-> our [in, out]."""
  return single(path, name, (out_dim, in_dim), _transpose, _transpose, index)


def concat(name: str, shape, pieces, axis: int = 0) -> Tensor:
  """An HF tensor that is several parameters concatenated along `axis`.

  `pieces` are (path, width along axis, HF slice -> ours, ours -> HF slice).
  """
  parts, to_pieces, start = [], [], 0
  for path, width, from_piece, to_piece in pieces:
    where = (slice(None),) * axis + (slice(start, start + width),)
    parts.append(Part(path, lambda x, where=where, f=from_piece: f(x[where])))
    to_pieces.append(to_piece)
    start += width
  if start != shape[axis]:
    raise AssertionError(f'{name}: pieces span {start} of {shape[axis]}')
  return Tensor(name, tuple(shape), tuple(parts), lambda *values: np.concatenate(
      [f(v) for f, v in zip(to_pieces, values)], axis=axis))


def attention(cfg: ModelConfig, path: tuple, prefix: str,
              index: int | None = None) -> list[Tensor]:
  """Grouped-query attention: q/k/v_proj [D, N|K, H] <- [N|K * H, D], o_proj [N, H, D] <-
  [D, N * H], biases [N|K, H] <- [N|K * H] (qkv_bias), q/k_norm [H] (qk_norm)."""
  d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def proj(heads):  # [heads * H, D] <-> [D, heads, H]
    return (lambda x: x.reshape(heads, h, d).transpose(2, 0, 1),
            lambda x: x.transpose(1, 2, 0).reshape(heads * h, d))

  out = []
  for name, heads in (('q', n), ('k', k), ('v', k)):
    out.append(single(path + (f'{name}_proj',), f'{prefix}{name}_proj.weight', (heads * h, d),
                      *proj(heads), index=index))
    if cfg.qkv_bias:
      out.append(single(path + (f'{name}_bias',), f'{prefix}{name}_proj.bias', (heads * h,),
                        lambda x, heads=heads: x.reshape(heads, h),
                        lambda x, heads=heads: x.reshape(heads * h), index))
  out.append(single(path + ('o_proj',), prefix + 'o_proj.weight', (d, n * h),
                    lambda x: x.reshape(d, n, h).transpose(1, 2, 0),   # [D, N*H] <-> [N, H, D]
                    lambda x: x.transpose(2, 0, 1).reshape(d, n * h), index))
  if cfg.qk_norm:
    for name in ('q', 'k'):
      out.append(single(path + (f'{name}_norm', 'scale'), f'{prefix}{name}_norm.weight', (h,),
                        index=index))
  return out


def mlp(cfg: ModelConfig, path: tuple, prefix: str, dim: int,
        index: int | None = None, names=('gate_proj', 'up_proj', 'down_proj')) -> list[Tensor]:
  """An MLP of width `dim`: gate/up [D, F] <- [F, D] (no gate for relu2), down [F, D] <- [D, F].

  `names` are our parameters' names for gate, up and down (HF's are always
  gate_proj, up_proj, down_proj)."""
  d = cfg.embed_dim
  out = []
  if cfg.mlp_activation == 'swiglu':
    out.append(linear(path + (names[0],), prefix + 'gate_proj.weight', dim, d, index))
  out.append(linear(path + (names[1],), prefix + 'up_proj.weight', dim, d, index))
  out.append(linear(path + (names[2],), prefix + 'down_proj.weight', d, dim, index))
  return out


def mamba(cfg: ModelConfig, path: tuple, prefix: str) -> list[Tensor]:
  """A Mamba-2 mixer (models/mamba.py's docstring gives each layout)."""
  d, h, p = cfg.embed_dim, cfg.mamba_heads, cfg.mamba_head_dim
  g, n, k = cfg.mamba_groups, cfg.mamba_state, cfg.mamba_conv
  hp, gn = h * p, g * n

  def rows(*shape):  # in_proj rows [W, D] <-> [D, *shape]
    return lambda x: x.T.reshape(d, *shape), lambda x: x.reshape(d, -1).T

  def taps(*shape):  # conv1d.weight rows [W, 1, K] <-> [K, *shape]
    return lambda x: x[:, 0, :].T.reshape(k, *shape), lambda x: x.reshape(k, -1).T[:, None, :]

  def flat(*shape):  # conv1d.bias [W] <-> [*shape]
    return lambda x: x.reshape(shape), lambda x: x.reshape(-1)

  at = lambda name: path + (name,)
  out = [
      concat(prefix + 'in_proj.weight', (2 * hp + 2 * gn + h, d), [
          (at('z_proj'), hp, *rows(h, p)), (at('x_proj'), hp, *rows(h, p)),
          (at('b_proj'), gn, *rows(g, n)), (at('c_proj'), gn, *rows(g, n)),
          (at('dt_proj'), h, *rows(h))]),
      concat(prefix + 'conv1d.weight', (hp + 2 * gn, 1, k), [
          (at('conv_x'), hp, *taps(h, p)), (at('conv_b'), gn, *taps(g, n)),
          (at('conv_c'), gn, *taps(g, n))]),
  ]
  if cfg.mamba_conv_bias:
    out.append(concat(prefix + 'conv1d.bias', (hp + 2 * gn,), [
        (at('conv_x_bias'), hp, *flat(h, p)), (at('conv_b_bias'), gn, *flat(g, n)),
        (at('conv_c_bias'), gn, *flat(g, n))]))
  out += [single(at(name), prefix + name, (h,)) for name in ('dt_bias', 'A_log', 'D')]
  out.append(single(at('norm'), prefix + 'norm.weight', (hp,), *flat(h, p)))
  out.append(single(at('out_proj'), prefix + 'out_proj.weight', (d, hp),
                    lambda x: x.T.reshape(h, p, d), lambda x: x.reshape(hp, d).T))
  return out


def moe(cfg: ModelConfig, path: tuple, prefix: str, fused: bool) -> list[Tensor]:
  """Routed experts (per-expert or fused tensors), router and shared expert (models/moe.py),
  in the order of transformers' modules."""
  e, d, f = cfg.num_experts, cfg.embed_dim, cfg.moe_dim
  swiglu = cfg.mlp_activation == 'swiglu'
  at = lambda name: path + (name,)
  out = []
  experts = prefix + 'experts.'
  if fused:
    if swiglu:   # gate_up_proj [E, 2F, D]: gate rows first.
      out.append(Tensor(experts + 'gate_up_proj', (e, 2 * f, d),
                        (Part(at('gate'), lambda x: _swap(x[:, :f])),
                         Part(at('up'), lambda x: _swap(x[:, f:]))),
                        lambda gate, up: np.concatenate([_swap(gate), _swap(up)], axis=1)))
    else:
      out.append(single(at('up'), experts + 'up_proj', (e, f, d), _swap, _swap))
    out.append(single(at('down'), experts + 'down_proj', (e, d, f), _swap, _swap))
  else:
    for j in range(e):
      out += mlp(cfg, path, f'{experts}{j}.', f, index=j, names=('gate', 'up', 'down'))
  out.append(linear(at('router'), prefix + 'gate.weight', e, d))
  if cfg.router == 'sigmoid':
    out.append(single(at('router_bias'), prefix + 'gate.e_score_correction_bias', (e,)))
  if cfg.shared_expert_dim:
    out += mlp(cfg, path, prefix + 'shared_experts.', cfg.shared_expert_dim,
               names=('shared_gate', 'shared_up', 'shared_down'))
  return out



def dense_tensors(cfg: ModelConfig, names: Collection[str] | None = None) -> list[Tensor]:
  """The dense decoders' table (Llama, Qwen2, Qwen3): HF's `model.layers.{i}.*` tensors
  fill layer i of the blocks' parameters stacked on a leading 'layers' axis [L, ...]."""
  del names   # one layout
  d, v = cfg.embed_dim, cfg.vocab_size
  out = [single(('embed',), 'model.embed_tokens.weight', (v, d))]
  for i in range(cfg.num_layers):   # layer i of the stacked [L, ...] block parameters
    p = f'model.layers.{i}.'
    out.append(single(('layers', 'input_norm', 'scale'), p + 'input_layernorm.weight',
                      (d,), index=i))
    out += attention(cfg, ('layers', 'attn'), p + 'self_attn.', index=i)
    out += mlp(cfg, ('layers', 'mlp'), p + 'mlp.', cfg.mlp_dim, index=i)
    out.append(single(('layers', 'post_attn_norm', 'scale'),
                      p + 'post_attention_layernorm.weight', (d,), index=i))
  out.append(single(('final_norm', 'scale'), 'model.norm.weight', (d,)))
  if not cfg.tie_embeddings:
    out.append(linear(('lm_head',), 'lm_head.weight', v, d))
  return out


def fused_experts(names: Collection[str], prefix: str) -> bool:
  """Whether a checkpoint's tensor `names` hold the experts under `prefix` fused
  (`...experts.down_proj` [E, D, F], transformers 5's in-memory layout) or per expert."""
  return prefix + 'experts.down_proj' in names


def require(hf: Mapping[str, Any], key: str):
  """hf[key], or a one-line error naming the missing config.json field."""
  if hf.get(key) is None:
    raise ValueError(f'HF config: required field {key!r} is missing')
  return hf[key]


def refuse(cfg: ModelConfig, arch: str, bad: Mapping[str, bool]) -> None:
  """Raises for the first setting in `bad` (description -> is set) that `arch` lacks."""
  for what, is_bad in bad.items():
    if is_bad:
      raise ValueError(f'ModelConfig(family={cfg.family!r}) with {what} has no HF equivalent '
                       f'({arch})')


def expert_count_note(cfg: ModelConfig, names: Collection[str], field: str) -> str:
  """For a missing / unexpected tensor error: a note when the checkpoint's per-expert tensors
  count a different number of experts per layer than the config (`field`: the config.json
  field that counts them); else ''."""
  found = [int(m.group(1)) for x in names if (m := EXPERT_INDEX.search(x))]
  if not found or max(found) + 1 == cfg.num_experts:
    return ''
  return (f'; the expert count differs: the checkpoint holds {max(found) + 1} experts per '
          f'layer, the config {cfg.num_experts} ({field})')
