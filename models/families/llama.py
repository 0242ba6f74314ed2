"""Llama-3: a dense decoder, RoPE attention without biases or q/k norms, SwiGLU MLPs."""

from models.families import base

FAMILY = base.Family(
    name='llama',
    presets={
        'llama3_8b': dict(family='llama', vocab_size=128_256, embed_dim=4096, num_layers=32,
                          num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14_336,
                          rope_theta=500_000.0, norm_eps=1e-5, qk_norm=False, qkv_bias=False,
                          tie_embeddings=False, max_seq_len=8192, param_dtype='bfloat16',
                          dtype='bfloat16'),
    },
    hf_architecture='LlamaForCausalLM',
    hf_switches=(False, False),
    hf_max_positions=2048,
    hf_constants={'attention_bias': False, 'mlp_bias': False},
)
