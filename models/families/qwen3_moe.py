"""Qwen3-MoE: each layer is Qwen3's attention followed by 'moe' (softmax-routed SwiGLU
experts) or, for `mlp_only` layers, 'mlp'; run as a sublayer pattern (models/hybrid.py)."""

from models.families import base


def sublayers(cfg) -> tuple[str, ...]:
  """Layer i is sublayers 2i (attention) and 2i + 1 (its layer type)."""
  return tuple(m for t in cfg.layer_types for m in ('attention', t))


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
    hf_architecture='Qwen3MoeForCausalLM',
    hf_switches=(False, True),
    hf_constants={'attention_bias': False, 'use_sliding_window': False},
)
