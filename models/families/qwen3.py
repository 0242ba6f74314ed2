"""Qwen3: a dense decoder with an RMSNorm on each query and key head."""

from models.families import base

_BIG = dict(family='qwen3', vocab_size=151_936, num_kv_heads=8, head_dim=128,
            rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True, max_seq_len=40_960,
            param_dtype='bfloat16', dtype='bfloat16')

FAMILY = base.Family(
    name='qwen3',
    presets={
        # A few-thousand-parameter Qwen3-like model for unit tests.
        'tiny': dict(family='qwen3', vocab_size=256, embed_dim=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, mlp_dim=128, rope_theta=10_000.0,
                     qk_norm=True, tie_embeddings=True, max_seq_len=1024),
        'qwen3_0_6b': dict(_BIG, embed_dim=1024, num_layers=28, num_heads=16, mlp_dim=3072,
                           tie_embeddings=True),
        'qwen3_8b': dict(_BIG, embed_dim=4096, num_layers=36, num_heads=32, mlp_dim=12_288,
                         tie_embeddings=False),
        'qwen3_14b': dict(_BIG, embed_dim=5120, num_layers=40, num_heads=40, mlp_dim=17_408,
                          tie_embeddings=False),
    },
    hf_architecture='Qwen3ForCausalLM',
    hf_switches=(False, True),
    hf_head_dim=128,
    hf_constants={'attention_bias': False, 'use_sliding_window': False},
)
