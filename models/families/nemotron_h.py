"""Nemotron-H / Nemotron-3 (Cascade 2's base): each layer is one mixer, 'mamba' (Mamba-2),
'attention' (grouped-query, no RoPE), 'mlp' (squared-ReLU MLP) or 'moe' (sigmoid-routed
experts and a shared expert); run as a sublayer pattern (models/hybrid.py)."""

from models.families import base

# Nemotron-H's pattern letters (its config's `hybrid_override_pattern`).
PATTERN_LETTERS = {'M': 'mamba', '*': 'attention', '-': 'mlp', 'E': 'moe'}
NEMOTRON_3_NANO_PATTERN = 'MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME'


def sublayers(cfg) -> tuple[str, ...]:
  """One sublayer per layer: the pattern itself."""
  return cfg.layer_types


def _layers(pattern: str) -> tuple[str, ...]:
  return tuple(PATTERN_LETTERS[c] for c in pattern)


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
    hf_architecture='NemotronHForCausalLM',
)
