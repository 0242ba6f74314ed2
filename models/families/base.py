"""What a model family is: the one place its name is looked up (`models.families`).

A `Family` holds what sets one family of decoders apart: its presets, how its
`ModelConfig.layer_types` spell its layers, its sublayer pattern, which stack runs it, the
module its MLP sublayers are, and its Hugging Face architecture. `ModelConfig` asks it, and
everything outside models/ asks the `ModelConfig` (its `mixers`, `kv_stacked`,
`flops_from_config`, ...), never the family's name.

This module imports nothing of the project's model code but the tensor-table builders
(`models.hf_tables`, which import nothing of the project's), so `models.config` can check a
config against the registry without an import circle.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from models import hf_tables

# The stacks a family can run on (both run by models/hybrid.py's `run`): 'blocks' is the
# pattern ('attention', 'mlp') x L as L identical fused Blocks stacked on a 'layers' axis
# and scanned, with one [L, B, K, S, H] KV cache per side; 'pattern' is any sublayer
# pattern, with one KV buffer per attention sublayer and a Mamba state per Mamba sublayer.
STACKS = ('blocks', 'pattern')


def _nothing_ignored(name: str) -> bool:
  """No checkpoint tensor is skipped."""
  del name
  return False


def dense_sublayers(cfg) -> tuple[str, ...]:
  """('attention', 'mlp') per layer: a dense decoder."""
  return ('attention', 'mlp') * cfg.num_layers


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family.

  Attributes:
    name: the `ModelConfig.family` value that selects it.
    stack: 'blocks' or 'pattern' (`STACKS`).
    sublayers: cfg -> its residual sublayers in order, each `x + mixer(norm(x))`:
      'attention', 'mamba', 'mlp' or 'moe' (`ModelConfig.mixers`).
    layer_types: what an entry of `ModelConfig.layer_types` may be; None: the family
      takes no `layer_types` (every layer the same).
    pattern_letters: letters a `layer_types` string may be written in (letter -> type),
      or None.
    presets: preset name -> `ModelConfig` keyword arguments (`ModelConfig.preset`).
    mlp: the module class of its 'mlp' sublayers, made as `mlp(cfg, rngs)` and called as
      `module(x, rules=rules)` (the caller's logical rules, `models.sharding`); None: the
      default `models.layers.MLP` (SwiGLU, or squared ReLU by `mlp_activation`).
    hf_architecture: its Hugging Face `architectures` entry, or None (no HF format).
    hf_switches: (qkv_bias, qk_norm) its HF class computes (None: checked elsewhere).
    hf_max_positions: transformers' default `max_position_embeddings` for it.
    hf_head_dim: transformers' default head_dim (None: hidden_size // heads).
    hf_constants: the constant entries its exported config.json carries.
    hf_read: (config.json dict, dtype name) -> all its `ModelConfig` keyword arguments, for a
      family whose config.json is not Llama's; None: models/hf.py's Llama-style reader
      (then `hf_read_extra`).
    hf_read_extra: (config.json dict, num_layers) -> the `ModelConfig` keyword arguments
      its config.json adds to Llama's (Qwen3-MoE's experts); None: none.
    hf_write: (cfg, dtype name) -> its whole config.json dict; None: models/hf.py's
      Llama-style writer (then `hf_write_extra`).
    hf_write_extra: cfg -> the config.json entries it adds to Llama's; None: none.
    hf_tensors: (cfg, a checkpoint's tensor names or None) -> its `hf_tables.Tensor`s in HF's
      order; a sublayer's parameters at ('blocks', i, ...), which models/hf.py points at
      where the model keeps sublayer i (default: the dense decoders' table).
    hf_ignored: a checkpoint tensor name -> whether the model skips it (transformers does).
    hf_experts_field: the config.json field counting its experts (for error messages).
  """

  name: str
  stack: str = 'blocks'
  sublayers: Callable[[Any], tuple[str, ...]] = dense_sublayers
  layer_types: tuple[str, ...] | None = None
  pattern_letters: Mapping[str, str] | None = None
  presets: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  mlp: Callable[..., Any] | None = None
  hf_architecture: str | None = None
  hf_switches: tuple[bool, bool] | None = None
  hf_max_positions: int = 32768
  hf_head_dim: int | None = None
  hf_constants: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  hf_read: Callable[[Mapping[str, Any], str], dict] | None = None
  hf_read_extra: Callable[[Mapping[str, Any], int], dict] | None = None
  hf_write: Callable[[Any, str], dict] | None = None
  hf_write_extra: Callable[[Any], dict] | None = None
  hf_tensors: Callable[..., list] = hf_tables.dense_tensors
  hf_ignored: Callable[[str], bool] = _nothing_ignored
  hf_experts_field: str = 'num_experts'

  def __post_init__(self):
    if self.stack not in STACKS:
      raise ValueError(f'Family({self.name!r}).stack={self.stack!r}: expected one of {STACKS}')
    if self.stack == 'pattern' and self.layer_types is None:
      raise ValueError(f'Family({self.name!r}): a pattern family needs layer_types')

  def parse_letters(self, pattern: str) -> tuple[str, ...]:
    """A string of `pattern_letters` as layer types (Nemotron-H's 'M*E-')."""
    letters = self.pattern_letters or {}
    out = []
    for i, c in enumerate(pattern):
      if c not in letters:
        raise ValueError(f'layer pattern {pattern!r}: unknown letter {c!r} at {i}; expected one '
                         f'of {sorted(letters)} ({dict(letters)})')
      out.append(letters[c])
    return tuple(out)
