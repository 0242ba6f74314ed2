"""Nemotron-H / Nemotron-3 (Cascade 2's base): each layer is one mixer, 'mamba' (Mamba-2),
'attention' (grouped-query, no RoPE), 'mlp' (squared-ReLU MLP) or 'moe' (sigmoid-routed
experts and a shared expert); run as a sublayer pattern (models/hybrid.py)."""

import math
import re
from typing import Any, Collection, Mapping

from models import hf_tables
from models.families import base

HF_ARCH = 'NemotronHForCausalLM'

# Nemotron-H's pattern letters (its config's `hybrid_override_pattern`).
PATTERN_LETTERS = {'M': 'mamba', '*': 'attention', '-': 'mlp', 'E': 'moe'}
NEMOTRON_3_NANO_PATTERN = 'MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME'


def sublayers(cfg) -> tuple[str, ...]:
  """One sublayer per layer: the pattern itself."""
  return cfg.layer_types


def _layers(pattern: str) -> tuple[str, ...]:
  return tuple(PATTERN_LETTERS[c] for c in pattern)


# Nemotron-H's layer type names (transformers 5's, and the older ones it remaps) -> ours.
_NEMOTRON_LAYERS = {'linear_attention': 'mamba', 'mamba': 'mamba', 'full_attention': 'attention',
                    'attention': 'attention', 'mlp': 'mlp', 'moe': 'moe'}
_TO_HF_LAYER = {'mamba': 'linear_attention', 'attention': 'full_attention', 'mlp': 'mlp',
                'moe': 'moe'}
_LETTERS = {kind: letter for letter, kind in PATTERN_LETTERS.items()}
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


def _hf_layer_types(hf: Mapping[str, Any]) -> tuple[str, ...]:
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
    return FAMILY.parse_letters(pattern)
  except ValueError as e:
    raise ValueError(f'HF config: hybrid_override_pattern: {e}') from None


def hf_read(hf: Mapping[str, Any], dtype: str) -> dict[str, Any]:
  """The ModelConfig fields of a NemotronHForCausalLM config.json.

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
  layer_types = _hf_layer_types(hf)
  n = int(get('num_attention_heads'))
  kv = hf.get('num_key_value_heads', _NEMOTRON_H_DEFAULTS['num_key_value_heads'])  # null: n
  return dict(
      family='nemotron_h',
      vocab_size=int(hf_tables.require(hf, 'vocab_size')),
      embed_dim=int(hf_tables.require(hf, 'hidden_size')),
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


def hf_write(cfg, dtype: str) -> dict[str, Any]:
  """The config.json dict of a 'nemotron_h' ModelConfig (transformers 5, and 4.x's
  `hybrid_override_pattern`); `dtype` is the name written as its dtype."""
  moe = 'moe' in cfg.layer_types
  hf_tables.refuse(cfg, HF_ARCH, {
      f'mlp_activation={cfg.mlp_activation!r}': cfg.mlp_activation != 'relu2',
      'use_rope=True': cfg.use_rope, 'qk_norm=True': cfg.qk_norm, 'qkv_bias=True': cfg.qkv_bias,
      'tie_embeddings=True': cfg.tie_embeddings,
      f'mamba_dt_max={cfg.mamba_dt_max}': cfg.mamba_dt_max != math.inf,
      f'router={cfg.router!r}': moe and cfg.router != 'sigmoid',
      # transformers' NemotronHMoE always has a shared expert.
      'shared_expert_dim=0': moe and not cfg.shared_expert_dim,
  })
  return {
      'architectures': [HF_ARCH],
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


def hf_tensors(cfg, names: Collection[str] | None = None) -> list[hf_tables.Tensor]:
  """Every parameter as HF tensors in HF's order, sublayer i's at ('blocks', i, ...)
  (models/hf.py points them at where the model keeps it).

  `names`: a checkpoint's tensor names, whose prefix (`backbone.` or `model.`, transformers
  5's in-memory names) and experts (fused or per expert, per layer) the table follows; None:
  the hub layout (`backbone.`, per expert) an export writes.
  """
  names = frozenset(names or ())
  d, v = cfg.embed_dim, cfg.vocab_size
  top = 'model.' if names and not any(x.startswith('backbone.') for x in names) else 'backbone.'
  out = [hf_tables.single(('embed',), top + 'embeddings.weight', (v, d))]
  for i, kind in enumerate(cfg.layer_types):
    path, p = ('blocks', i, 'mixer'), f'{top}layers.{i}.mixer.'
    out.append(hf_tables.single(('blocks', i, 'norm', 'scale'), f'{top}layers.{i}.norm.weight',
                                (d,)))
    if kind == 'mamba':
      out += hf_tables.mamba(cfg, path, p)
    elif kind == 'attention':
      out += hf_tables.attention(cfg, path, p)
    elif kind == 'mlp':
      out += hf_tables.mlp(cfg, path, p, cfg.mlp_dim)
    else:
      out += hf_tables.moe(cfg, path, p, hf_tables.fused_experts(names, p))
  out.append(hf_tables.single(('final_norm', 'scale'), top + 'norm_f.weight', (d,)))
  out.append(hf_tables.linear(('lm_head',), 'lm_head.weight', v, d))
  return out


def hf_ignored(name: str) -> bool:
  """A checkpoint tensor the model does not use and transformers skips too (the
  multi-token-prediction `mtp.*` layers)."""
  return bool(_IGNORED.match(name))


FAMILY = base.Family(
    name='nemotron_h',
    stack='pattern',
    sublayers=sublayers,
    layer_types=('mamba', 'attention', 'mlp', 'moe'),
    pattern_letters=PATTERN_LETTERS,
    presets={
        # Nemotron-3-Nano-30B-A3B (Cascade 2's base): 23 Mamba-2, 23 MoE (128 experts, top-6,
        # a shared expert) and 6 attention layers; 31.6B parameters, 3.6B active.
        'nemotron_3_nano_30b_a3b': dict(
            family='nemotron_h', vocab_size=131_072, embed_dim=2688, num_layers=52,
            layer_types=_layers(NEMOTRON_3_NANO_PATTERN), num_heads=32, num_kv_heads=2,
            head_dim=128, mlp_dim=1856, mlp_activation='relu2', use_rope=False,
            qk_norm=False, norm_eps=1e-5, tie_embeddings=False, max_seq_len=262_144,
            mamba_heads=64, mamba_head_dim=64, mamba_groups=8, mamba_state=128, mamba_conv=4,
            mamba_chunk=128, mamba_dt_min=0.001, num_experts=128, experts_per_token=6,
            moe_dim=1856, shared_expert_dim=3712, router='sigmoid', router_norm_topk=True,
            router_groups=1, router_topk_groups=1, routed_scaling=2.5,
            param_dtype='bfloat16', dtype='bfloat16'),
        # A tiny Nemotron-H-like model for tests: mamba, moe, attention and mlp layers.
        'tiny_hybrid': dict(
            family='nemotron_h', vocab_size=256, embed_dim=64, num_layers=6,
            layer_types=_layers('ME*EM-'), num_heads=4, num_kv_heads=2, head_dim=16,
            mlp_dim=96, mlp_activation='relu2', use_rope=False, qk_norm=False, norm_eps=1e-5,
            tie_embeddings=False, max_seq_len=1024, mamba_heads=4, mamba_head_dim=16,
            mamba_groups=2, mamba_state=8, mamba_conv=4, mamba_chunk=16, mamba_dt_min=0.001,
            num_experts=8, experts_per_token=2, moe_dim=32, shared_expert_dim=48,
            router='sigmoid', router_groups=2, router_topk_groups=1, routed_scaling=2.5),
    },
    hf_architecture=HF_ARCH,
    hf_read=hf_read,
    hf_write=hf_write,
    hf_tensors=hf_tensors,
    hf_ignored=hf_ignored,
    hf_experts_field='n_routed_experts',
)
