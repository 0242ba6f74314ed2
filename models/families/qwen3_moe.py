"""Qwen3-MoE: each layer is Qwen3's attention followed by 'moe' (softmax-routed SwiGLU
experts) or, for `mlp_only` layers, 'mlp'; run as a sublayer pattern (models/hybrid.py)."""

from typing import Any, Collection, Mapping

from models import hf_tables
from models.families import base

HF_ARCH = 'Qwen3MoeForCausalLM'


def sublayers(cfg) -> tuple[str, ...]:
  """Layer i is sublayers 2i (attention) and 2i + 1 (its layer type)."""
  return tuple(m for t in cfg.layer_types for m in ('attention', t))


def hf_tensors(cfg, names: Collection[str] | None = None) -> list[hf_tables.Tensor]:
  """Every parameter as HF tensors in HF's order, sublayer i's at ('blocks', i, ...)
  (models/hf.py points them at where the model keeps it); `names`: a checkpoint's tensor
  names, whose experts (fused or per expert, per layer) the table follows; None: per expert
  (the hub layout an export writes)."""
  names = frozenset(names or ())
  d, v = cfg.embed_dim, cfg.vocab_size
  out = [hf_tables.single(('embed',), 'model.embed_tokens.weight', (v, d))]
  for i, kind in enumerate(cfg.layer_types):   # layer i: sublayers 2i (attention), 2i + 1
    p, attn, ffn = f'model.layers.{i}.', 2 * i, 2 * i + 1
    out.append(hf_tables.single(('blocks', attn, 'norm', 'scale'), p + 'input_layernorm.weight',
                                (d,)))
    out += hf_tables.attention(cfg, ('blocks', attn, 'mixer'), p + 'self_attn.')
    out.append(hf_tables.single(('blocks', ffn, 'norm', 'scale'),
                                p + 'post_attention_layernorm.weight', (d,)))
    if kind == 'moe':
      out += hf_tables.moe(cfg, ('blocks', ffn, 'mixer'), p + 'mlp.',
                           hf_tables.fused_experts(names, p + 'mlp.'))
    else:
      out += hf_tables.mlp(cfg, ('blocks', ffn, 'mixer'), p + 'mlp.', cfg.mlp_dim)
  out.append(hf_tables.single(('final_norm', 'scale'), 'model.norm.weight', (d,)))
  if not cfg.tie_embeddings:
    out.append(hf_tables.linear(('lm_head',), 'lm_head.weight', v, d))
  return out


def hf_read_extra(hf: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
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


def hf_write_extra(cfg) -> dict[str, Any]:
  """The config.json fields a 'qwen3_moe' ModelConfig adds to Qwen3's."""
  moe = 'moe' in cfg.layer_types
  hf_tables.refuse(cfg, HF_ARCH, {
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


FAMILY = base.Family(
    name='qwen3_moe',
    stack='pattern',
    sublayers=sublayers,
    layer_types=('moe', 'mlp'),
    presets={
        # Qwen3-30B-A3B: 48 layers of Qwen3 attention + 128 SwiGLU experts (top-8).
        'qwen3_30b_a3b': dict(family='qwen3_moe', vocab_size=151_936, embed_dim=2048,
                              num_layers=48, layer_types=('moe',) * 48, num_heads=32,
                              num_kv_heads=4, head_dim=128, mlp_dim=6144,
                              rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True,
                              tie_embeddings=False, max_seq_len=40_960, num_experts=128,
                              experts_per_token=8, moe_dim=768, router='softmax',
                              router_norm_topk=True, param_dtype='bfloat16',
                              dtype='bfloat16'),
        # A tiny Qwen3-MoE-like model for tests (its second layer an `mlp_only` one).
        'tiny_moe': dict(family='qwen3_moe', vocab_size=256, embed_dim=64, num_layers=3,
                         layer_types=('moe', 'mlp', 'moe'), num_heads=4, num_kv_heads=2,
                         head_dim=16, mlp_dim=96, rope_theta=10_000.0, qk_norm=True,
                         tie_embeddings=False, max_seq_len=1024, num_experts=8,
                         experts_per_token=2, moe_dim=32, router='softmax',
                         router_norm_topk=True),
    },
    hf_architecture=HF_ARCH,
    hf_read_extra=hf_read_extra,
    hf_write_extra=hf_write_extra,
    hf_tensors=hf_tensors,
    hf_switches=(False, True),
    hf_constants={'attention_bias': False, 'use_sliding_window': False},
)
