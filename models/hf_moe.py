"""Hugging Face interop for the mixture-of-experts families: Nemotron-H and Qwen3-MoE.

The config translation of `NemotronHForCausalLM` (model_type nemotron_h) and
`Qwen3MoeForCausalLM` (qwen3_moe), and the tables that map each HF tensor to
the parameters it fills. models/hf.py reads, places and writes the tensors
these tables describe (and builds its dense families' tables from the same
entries: `Tensor`, `Part`, `attention`, `mlp`); this module does no I/O.

A table entry is one HF tensor and the parameters (or slices of them) it
fills: most fill one parameter whole; Nemotron-H's Mamba `in_proj.weight`,
`conv1d.weight` and `conv1d.bias` are several of our parameters concatenated
(layouts in models/mamba.py's docstring); a per-expert tensor fills one
expert's slice of a stacked [E, ...] parameter, and Qwen3-MoE's fused
`gate_up_proj` fills two (layouts in models/moe.py's docstring).

Checkpoint layouts, told apart by the tensor names present:
  Nemotron-H   prefix `backbone.` (the hub's, and what save_pretrained writes)
               or `model.` (transformers 5 in-memory names);
  experts      per-expert `...experts.{e}.{up,down}_proj.weight` (Qwen3-MoE also
               gate_proj; the hub's and save_pretrained's) or fused
               `...experts.up_proj` [E, F, D] (Nemotron-H), `...experts.gate_up_proj`
               [E, 2F, D] (Qwen3-MoE; gate rows first) and `...experts.down_proj`
               [E, D, F] (transformers 5 in-memory), chosen per layer.
`tensors(cfg)` without names is the hub layout (`backbone.`, per-expert), the
one an export writes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Collection, Mapping

import numpy as np

from models import config as config_lib
from models import hybrid

NEMOTRON_H_ARCH = 'NemotronHForCausalLM'
QWEN3_MOE_ARCH = 'Qwen3MoeForCausalLM'

# Nemotron-H's layer type names (transformers 5's, and the older ones it remaps) -> ours.
_NEMOTRON_LAYERS = {'linear_attention': 'mamba', 'mamba': 'mamba', 'full_attention': 'attention',
                    'attention': 'attention', 'mlp': 'mlp', 'moe': 'moe'}
_TO_HF_LAYER = {'mamba': 'linear_attention', 'attention': 'full_attention', 'mlp': 'mlp',
                'moe': 'moe'}
_LETTERS = {kind: letter for letter, kind in config_lib.PATTERN_LETTERS.items()}
# transformers' NemotronHConfig defaults, for the fields a config.json may leave out.
_NEMOTRON_H_DEFAULTS = {
    'num_attention_heads': 32, 'num_key_value_heads': 8, 'head_dim': 128,
    'max_position_embeddings': 4096, 'intermediate_size': 21504, 'mlp_hidden_act': 'relu2',
    'mamba_num_heads': 128, 'mamba_head_dim': 64, 'n_groups': 8, 'ssm_state_size': 128,
    'conv_kernel': 4, 'chunk_size': 128, 'use_conv_bias': True, 'time_step_min': 0.001,
    'mamba_hidden_act': 'silu', 'n_routed_experts': 8, 'n_shared_experts': 1,
    'num_experts_per_tok': 2, 'moe_intermediate_size': 7688,
    'moe_shared_expert_intermediate_size': 7688, 'routed_scaling_factor': 1.0, 'n_group': 1,
    'topk_group': 1, 'norm_topk_prob': True, 'layer_norm_epsilon': 1e-5,
}
# Older names (and an alias) NemotronHConfig still reads; the older name wins when present.
_NEMOTRON_H_OLD_NAMES = {'n_groups': 'mamba_n_groups', 'conv_kernel': 'mamba_d_conv',
                         'time_step_min': 'mamba_dt_min', 'use_conv_bias': 'mamba_conv_bias',
                         'chunk_size': 'mamba_chunk_size', 'n_routed_experts': 'num_local_experts'}
# Multi-token-prediction heads, which transformers also skips on load.
_IGNORED = re.compile(r'^(backbone\.|model\.)?mtp\.')
_EXPERT_INDEX = re.compile(r'\.experts\.(\d+)\.')


# ---- table entries ----


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


def _concat(name: str, shape, pieces, axis: int = 0) -> Tensor:
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


def attention(cfg: config_lib.ModelConfig, path: tuple, prefix: str,
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


def mlp(cfg: config_lib.ModelConfig, path: tuple, prefix: str, dim: int,
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


def _mamba(cfg: config_lib.ModelConfig, path: tuple, prefix: str) -> list[Tensor]:
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
      _concat(prefix + 'in_proj.weight', (2 * hp + 2 * gn + h, d), [
          (at('z_proj'), hp, *rows(h, p)), (at('x_proj'), hp, *rows(h, p)),
          (at('b_proj'), gn, *rows(g, n)), (at('c_proj'), gn, *rows(g, n)),
          (at('dt_proj'), h, *rows(h))]),
      _concat(prefix + 'conv1d.weight', (hp + 2 * gn, 1, k), [
          (at('conv_x'), hp, *taps(h, p)), (at('conv_b'), gn, *taps(g, n)),
          (at('conv_c'), gn, *taps(g, n))]),
  ]
  if cfg.mamba_conv_bias:
    out.append(_concat(prefix + 'conv1d.bias', (hp + 2 * gn,), [
        (at('conv_x_bias'), hp, *flat(h, p)), (at('conv_b_bias'), gn, *flat(g, n)),
        (at('conv_c_bias'), gn, *flat(g, n))]))
  out += [single(at(name), prefix + name, (h,)) for name in ('dt_bias', 'A_log', 'D')]
  out.append(single(at('norm'), prefix + 'norm.weight', (hp,), *flat(h, p)))
  out.append(single(at('out_proj'), prefix + 'out_proj.weight', (d, hp),
                    lambda x: x.T.reshape(h, p, d), lambda x: x.reshape(hp, d).T))
  return out


def _moe(cfg: config_lib.ModelConfig, path: tuple, prefix: str, fused: bool) -> list[Tensor]:
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


# ---- tables ----


def tensors(cfg: config_lib.ModelConfig, names: Collection[str] | None = None) -> list[Tensor]:
  """Every parameter of a Nemotron-H or Qwen3-MoE model, as HF tensors in HF's order.

  Args:
    cfg: the model config (family 'nemotron_h' or 'qwen3_moe').
    names: a checkpoint's tensor names, whose layout the table follows (Nemotron-H's
      prefix; fused or per-expert tensors, per layer); None: the hub layout.

  The table is written per sublayer (('blocks', i, ...)) and then pointed at where the
  model keeps sublayer i: a block of its own, or one repeat of a stacked segment
  (models/hybrid.py `locate`), the repeat prefixed to the part's index.
  """
  return [_relocate(cfg, t) for t in _per_sublayer(cfg, names)]


def _relocate(cfg: config_lib.ModelConfig, t: Tensor) -> Tensor:
  """`t` with its ('blocks', i, ...) parts pointed at where the model keeps sublayer i."""
  parts = []
  for part in t.parts:
    if part.path[0] == 'blocks':
      prefix, r = hybrid.locate(cfg, part.path[1])
      index = part.index
      if r is not None:
        index = (r,) if index is None else (r,) + (index if isinstance(index, tuple) else (index,))
      part = dataclasses.replace(part, path=prefix + part.path[2:], index=index)
    parts.append(part)
  return dataclasses.replace(t, parts=tuple(parts))


def _per_sublayer(cfg: config_lib.ModelConfig, names: Collection[str] | None) -> list[Tensor]:
  """`tensors`' table with sublayer i's parameters at ('blocks', i, ...)."""
  names = frozenset(names or ())
  fused = lambda prefix: prefix + 'experts.down_proj' in names
  d, v = cfg.embed_dim, cfg.vocab_size
  if cfg.family == 'nemotron_h':
    top = 'model.' if names and not any(x.startswith('backbone.') for x in names) else 'backbone.'
    out = [single(('embed',), top + 'embeddings.weight', (v, d))]
    for i, kind in enumerate(cfg.layer_types):
      path, p = ('blocks', i, 'mixer'), f'{top}layers.{i}.mixer.'
      out.append(single(('blocks', i, 'norm', 'scale'), f'{top}layers.{i}.norm.weight', (d,)))
      if kind == 'mamba':
        out += _mamba(cfg, path, p)
      elif kind == 'attention':
        out += attention(cfg, path, p)
      elif kind == 'mlp':
        out += mlp(cfg, path, p, cfg.mlp_dim)
      else:
        out += _moe(cfg, path, p, fused(p))
    out.append(single(('final_norm', 'scale'), top + 'norm_f.weight', (d,)))
    out.append(linear(('lm_head',), 'lm_head.weight', v, d))
    return out
  if cfg.family != 'qwen3_moe':
    raise ValueError(f'hf_moe.tensors: family={cfg.family!r} is not a mixture-of-experts family')
  out = [single(('embed',), 'model.embed_tokens.weight', (v, d))]
  for i, kind in enumerate(cfg.layer_types):   # layer i: sublayers 2i (attention), 2i + 1
    p, attn, ffn = f'model.layers.{i}.', 2 * i, 2 * i + 1
    out.append(single(('blocks', attn, 'norm', 'scale'), p + 'input_layernorm.weight', (d,)))
    out += attention(cfg, ('blocks', attn, 'mixer'), p + 'self_attn.')
    out.append(single(('blocks', ffn, 'norm', 'scale'), p + 'post_attention_layernorm.weight',
                      (d,)))
    if kind == 'moe':
      out += _moe(cfg, ('blocks', ffn, 'mixer'), p + 'mlp.', fused(p + 'mlp.'))
    else:
      out += mlp(cfg, ('blocks', ffn, 'mixer'), p + 'mlp.', cfg.mlp_dim)
  out.append(single(('final_norm', 'scale'), 'model.norm.weight', (d,)))
  if not cfg.tie_embeddings:
    out.append(linear(('lm_head',), 'lm_head.weight', v, d))
  return out


def ignored(cfg: config_lib.ModelConfig, name: str) -> bool:
  """A checkpoint tensor the model does not use and transformers skips too (Nemotron-H's
  multi-token-prediction `mtp.*` layers)."""
  return cfg.family == 'nemotron_h' and bool(_IGNORED.match(name))


def expert_count_note(cfg: config_lib.ModelConfig, names: Collection[str]) -> str:
  """For a missing / unexpected tensor error: a note when the checkpoint's per-expert tensors
  count a different number of experts per layer than the config; else ''."""
  found = [int(m.group(1)) for x in names if (m := _EXPERT_INDEX.search(x))]
  if not found or max(found) + 1 == cfg.num_experts:
    return ''
  field = 'n_routed_experts' if cfg.family == 'nemotron_h' else 'num_experts'
  return (f'; the expert count differs: the checkpoint holds {max(found) + 1} experts per '
          f'layer, the config {cfg.num_experts} ({field})')


# ---- configs ----


def _require(hf: Mapping[str, Any], key: str):
  if hf.get(key) is None:
    raise ValueError(f'HF config: required field {key!r} is missing')
  return hf[key]


def _nemotron_layer_types(hf: Mapping[str, Any]) -> tuple[str, ...]:
  """The pattern from `layers_block_type` / `layer_types` (a list, which wins, as in
  transformers) or `hybrid_override_pattern` (letters M * - E)."""
  for key in ('layers_block_type', 'layer_types'):
    names = hf.get(key)
    if names is None:
      continue
    if isinstance(names, str) or not all(isinstance(x, str) for x in names):
      raise ValueError(f'HF config: {key}={names!r} is not a list of layer type names')
    for i, x in enumerate(names):
      if x not in _NEMOTRON_LAYERS:
        raise ValueError(f'HF config: {key}[{i}]={x!r} is not a Nemotron-H layer type; '
                         f'expected one of {sorted(_NEMOTRON_LAYERS)}')
    return tuple(_NEMOTRON_LAYERS[x] for x in names)
  pattern = hf.get('hybrid_override_pattern')
  if pattern is None:
    raise ValueError('HF config: no layer pattern (layers_block_type, layer_types or '
                     'hybrid_override_pattern)')
  try:
    return config_lib.parse_pattern(pattern)
  except ValueError as e:
    raise ValueError(f'HF config: hybrid_override_pattern: {e}') from None


def nemotron_h_config(hf: Mapping[str, Any], dtype: str) -> config_lib.ModelConfig:
  """The ModelConfig of a NemotronHForCausalLM config.json.

  Args:
    hf: the parsed config.json.
    dtype: the parameter and compute dtype name (the checkpoint's).

  Raises:
    ValueError: a feature transformers computes and we cannot (moe_latent_size,
      biases, an activation other than relu2 / silu, a tied head, several shared
      experts), an unknown layer type or pattern letter, or a missing field.
  """
  def get(key):
    old = _NEMOTRON_H_OLD_NAMES.get(key)
    if old is not None and hf.get(old) is not None:
      return hf[old]
    value = hf.get(key)
    return _NEMOTRON_H_DEFAULTS[key] if value is None else value

  if hf.get('moe_latent_size') is not None:
    raise ValueError(f"HF config: moe_latent_size={hf['moe_latent_size']} (latent projections "
                     'around the experts) is not supported')
  for key in ('use_bias', 'mlp_bias', 'attention_bias'):
    if hf.get(key):
      raise ValueError(f'HF config: {key}=true is not supported (no biases on the '
                       'projections)')
  if hf.get('tie_word_embeddings'):
    raise ValueError('HF config: tie_word_embeddings=true is not supported for Nemotron-H '
                     "(transformers' NemotronHForCausalLM does not tie its head)")
  for key, want in (('mlp_hidden_act', 'relu2'), ('mamba_hidden_act', 'silu')):
    if get(key) != want:
      raise ValueError(f'HF config: {key}={get(key)!r}; only {want!r} is supported')
  shared = int(get('n_shared_experts'))
  if shared not in (0, 1):
    raise ValueError(f'HF config: n_shared_experts={shared}; only 0 or 1 is supported')
  layer_types = _nemotron_layer_types(hf)
  n = int(get('num_attention_heads'))
  kv = hf.get('num_key_value_heads', _NEMOTRON_H_DEFAULTS['num_key_value_heads'])  # null: n
  return config_lib.ModelConfig(
      family='nemotron_h',
      vocab_size=int(_require(hf, 'vocab_size')),
      embed_dim=int(_require(hf, 'hidden_size')),
      num_layers=len(layer_types),
      layer_types=layer_types,
      num_heads=n,
      num_kv_heads=int(n if kv is None else kv),
      head_dim=int(get('head_dim')),
      mlp_dim=int(get('intermediate_size')),
      mlp_activation='relu2',
      use_rope=False,
      qk_norm=False,
      qkv_bias=False,
      norm_eps=float(get('layer_norm_epsilon')),
      tie_embeddings=False,
      max_seq_len=int(get('max_position_embeddings')),
      mamba_heads=int(get('mamba_num_heads')),
      mamba_head_dim=int(get('mamba_head_dim')),
      mamba_groups=int(get('n_groups')),
      mamba_state=int(get('ssm_state_size')),
      mamba_conv=int(get('conv_kernel')),
      mamba_chunk=int(get('chunk_size')),
      mamba_conv_bias=bool(get('use_conv_bias')),
      # transformers' mixer clamps dt to (time_step_min, inf) whatever time_step_limit says.
      mamba_dt_min=float(get('time_step_min')),
      mamba_dt_max=math.inf,
      num_experts=int(get('n_routed_experts')),
      experts_per_token=int(get('num_experts_per_tok')),
      moe_dim=int(get('moe_intermediate_size')),
      shared_expert_dim=int(get('moe_shared_expert_intermediate_size')) if shared else 0,
      router='sigmoid',
      router_norm_topk=bool(get('norm_topk_prob')),
      router_groups=int(get('n_group')),
      router_topk_groups=int(get('topk_group')),
      routed_scaling=float(get('routed_scaling_factor')),
      param_dtype=dtype,
      dtype=dtype)


def _refuse(cfg: config_lib.ModelConfig, arch: str, bad: Mapping[str, bool]):
  for what, is_bad in bad.items():
    if is_bad:
      raise ValueError(f'ModelConfig(family={cfg.family!r}) with {what} has no HF equivalent '
                       f'({arch})')


def nemotron_h_to_hf(cfg: config_lib.ModelConfig, dtype: str) -> dict[str, Any]:
  """The config.json dict of a 'nemotron_h' ModelConfig (transformers 5, and 4.x's
  `hybrid_override_pattern`); `dtype` is the name written as its dtype."""
  moe = 'moe' in cfg.layer_types
  _refuse(cfg, NEMOTRON_H_ARCH, {
      f'mlp_activation={cfg.mlp_activation!r}': cfg.mlp_activation != 'relu2',
      'use_rope=True': cfg.use_rope, 'qk_norm=True': cfg.qk_norm, 'qkv_bias=True': cfg.qkv_bias,
      'tie_embeddings=True': cfg.tie_embeddings,
      f'mamba_dt_max={cfg.mamba_dt_max}': cfg.mamba_dt_max != math.inf,
      f'router={cfg.router!r}': moe and cfg.router != 'sigmoid',
      # transformers' NemotronHMoE always has a shared expert.
      'shared_expert_dim=0': moe and not cfg.shared_expert_dim,
  })
  return {
      'architectures': [NEMOTRON_H_ARCH],
      'model_type': 'nemotron_h',
      'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.embed_dim,
      'num_hidden_layers': cfg.num_layers,
      'layers_block_type': [_TO_HF_LAYER[t] for t in cfg.layer_types],
      'hybrid_override_pattern': ''.join(_LETTERS[t] for t in cfg.layer_types),
      'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim,
      'attention_bias': False,
      'intermediate_size': cfg.mlp_dim,
      'mlp_hidden_act': 'relu2',
      'mlp_bias': False,
      'use_bias': False,
      'mamba_num_heads': cfg.mamba_heads,
      'mamba_head_dim': cfg.mamba_head_dim,
      'n_groups': cfg.mamba_groups,
      'ssm_state_size': cfg.mamba_state,
      'conv_kernel': cfg.mamba_conv,
      'chunk_size': cfg.mamba_chunk,
      'use_conv_bias': cfg.mamba_conv_bias,
      'time_step_min': cfg.mamba_dt_min,
      'mamba_hidden_act': 'silu',
      'n_routed_experts': cfg.num_experts,
      'num_experts_per_tok': cfg.experts_per_token,
      'moe_intermediate_size': cfg.moe_dim,
      'n_shared_experts': 1 if cfg.shared_expert_dim else 0,
      'moe_shared_expert_intermediate_size': cfg.shared_expert_dim,
      'moe_latent_size': None,
      'routed_scaling_factor': cfg.routed_scaling,
      'n_group': cfg.router_groups,
      'topk_group': cfg.router_topk_groups,
      'norm_topk_prob': cfg.router_norm_topk,
      'num_nextn_predict_layers': 0,
      'layer_norm_epsilon': cfg.norm_eps,
      'max_position_embeddings': cfg.max_seq_len,
      'tie_word_embeddings': False,
      'dtype': dtype,
      'torch_dtype': dtype,
  }


def qwen3_moe_fields(hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
  """The ModelConfig fields a Qwen3MoeForCausalLM config.json adds to Qwen3's: the experts,
  and which layers are 'moe' (as transformers decides: not in `mlp_only_layers`, experts
  present, and (i + 1) % decoder_sparse_step == 0) or 'mlp'."""
  def get(key, default):   # transformers' Qwen3MoeConfig defaults
    return default if hf.get(key) is None else hf[key]

  experts = int(get('num_experts', get('num_local_experts', 128)))
  step = int(get('decoder_sparse_step', 1))
  if step < 1:
    raise ValueError(f'HF config: decoder_sparse_step={step} must be >= 1')
  mlp_only = set(get('mlp_only_layers', ()))
  layer_types = tuple('moe' if i not in mlp_only and experts > 0 and (i + 1) % step == 0
                      else 'mlp' for i in range(num_layers))
  return dict(layer_types=layer_types, num_experts=experts,
              experts_per_token=int(get('num_experts_per_tok', 8)),
              moe_dim=int(get('moe_intermediate_size', 768)), router='softmax',
              router_norm_topk=bool(get('norm_topk_prob', False)))


def qwen3_moe_to_hf(cfg: config_lib.ModelConfig) -> dict[str, Any]:
  """The config.json fields a 'qwen3_moe' ModelConfig adds to Qwen3's."""
  moe = 'moe' in cfg.layer_types
  _refuse(cfg, QWEN3_MOE_ARCH, {
      f'router={cfg.router!r}': moe and cfg.router != 'softmax',
      f'routed_scaling={cfg.routed_scaling}': moe and cfg.routed_scaling != 1.0,
      f'router_groups={cfg.router_groups}': moe and cfg.router_groups != 1,
      f'shared_expert_dim={cfg.shared_expert_dim}': moe and cfg.shared_expert_dim != 0,
  })
  return {
      'num_experts': cfg.num_experts,
      'num_experts_per_tok': cfg.experts_per_token,
      'moe_intermediate_size': cfg.moe_dim,
      'norm_topk_prob': cfg.router_norm_topk,
      'decoder_sparse_step': 1,
      'mlp_only_layers': [i for i, t in enumerate(cfg.layer_types) if t == 'mlp'],
  }
