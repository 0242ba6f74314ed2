"""Qwen2: a dense decoder whose q/k/v projections carry biases."""

from models.families import base

FAMILY = base.Family(
    name='qwen2',
    hf_architecture='Qwen2ForCausalLM',
    hf_switches=(True, False),
    hf_constants={'use_sliding_window': False},
)
