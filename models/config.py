"""Model configuration: one frozen dataclass for the Llama-3 / Qwen2 / Qwen3 families.

The three families differ only in switches here: Qwen2 adds biases to the
q/k/v projections, Qwen3 adds an RMSNorm on each query and key head, and
embeddings are tied or not per checkpoint. Presets carry the real shapes of
the paper's base models.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models import rope

FAMILIES = ('llama', 'qwen2', 'qwen3')
REMAT_POLICIES = ('none', 'full', 'save_attention_out', 'offload')
# Implementations of models/attention.attend.
ATTENTION_IMPLS = ('auto', 'dense', 'blockwise', 'splash', 'gpu_flash')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only transformer.

  Attributes:
    family: 'llama', 'qwen2' or 'qwen3' (used for HF export's architecture).
    vocab_size: number of token ids.
    embed_dim: residual width D.
    num_layers: number of transformer blocks.
    num_heads: query heads N.
    num_kv_heads: key/value heads K (N % K == 0; K < N is grouped-query).
    head_dim: per-head width H.
    mlp_dim: hidden width F of the SwiGLU MLP.
    rope_theta: RoPE base frequency.
    rope_scaling: None (plain RoPE) or a `rope.RopeScaling` ('linear', 'yarn',
      'llama3'); an HF-style mapping such as {'rope_type': 'yarn', 'factor': 2.0,
      'original_max_position_embeddings': 32768} (e.g. a config override) is
      parsed into one.
    norm_eps: epsilon of every RMSNorm.
    qkv_bias: biases on the q/k/v projections (Qwen2).
    qk_norm: RMSNorm over head_dim on queries and keys (Qwen3).
    tie_embeddings: the output projection is the transposed embedding.
    max_seq_len: longest position the model is meant for (HF export only).
    param_dtype: dtype the parameters are stored in ('float32', 'bfloat16').
    dtype: compute dtype of matmuls; norms, softmax and logits stay float32.
    remat: the blocks' rematerialisation policy in the backward pass: 'none',
      'full' (save only each block's input), 'save_attention_out' (also keep
      the attention sublayer's output) or 'offload' (block inputs to pinned
      host memory; 'full' where the backend has none). True and False, as
      older configs wrote it, mean 'full' and 'none'.
    scan_layers: True runs the blocks as one `lax.scan` body over parameters
      stacked on a leading 'layers' axis (compile time independent of depth);
      False unrolls the same body in a Python loop (same parameters, the same
      numbers up to float rounding); 'auto' (the default) scans except where
      JAX's default backend is the CPU, whose scan copies every layer's
      weights out of the stacks and every saved activation into stacked
      buffers it first fills with zeros (a GRPO update 1.2x slower on the
      tiny shape). `scans_layers` is the resolved choice.
    attention: attention implementation of every pass without a cache and of
      a prefill into one (models/attention.py): 'auto' (TPU splash, GPU flash,
      else dense below attention.DENSE_MAX_LEN keys and blockwise from there),
      'dense', 'blockwise', 'splash' or 'gpu_flash'. Decode steps are dense.
    attention_block_q: query tile of 'splash' and 'blockwise' (a multiple of 128).
    attention_block_kv: key tile of 'splash' and 'blockwise' (a multiple of 128).
    mlp_chunk: a pass over more than this many positions runs the MLP over
      chunks of this many positions, one after another, each recomputed in
      the backward pass, so no [T, mlp_dim] activation is ever whole (long
      sequences); 0 never chunks. The same numbers up to float rounding.
  """

  family: str = 'qwen3'
  vocab_size: int = 256
  embed_dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  mlp_dim: int = 128
  rope_theta: float = 10_000.0
  rope_scaling: rope.RopeScaling | None = None
  norm_eps: float = 1e-6
  qkv_bias: bool = False
  qk_norm: bool = True
  tie_embeddings: bool = True
  max_seq_len: int = 4096
  param_dtype: str = 'float32'
  dtype: str = 'float32'
  remat: str = 'none'
  scan_layers: bool | str = 'auto'
  attention: str = 'auto'
  attention_block_q: int = 512
  attention_block_kv: int = 512
  mlp_chunk: int = 0

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f'ModelConfig.family={self.family!r}: expected one of {FAMILIES}')
    for name in ('vocab_size', 'embed_dim', 'num_layers', 'num_heads',
                 'num_kv_heads', 'head_dim', 'mlp_dim'):
      if getattr(self, name) <= 0:
        raise ValueError(f'ModelConfig.{name}={getattr(self, name)} must be > 0')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'ModelConfig.num_heads={self.num_heads} is not a multiple of '
          f'num_kv_heads={self.num_kv_heads}')
    if self.head_dim % 2:
      raise ValueError(f'ModelConfig.head_dim={self.head_dim} must be even (RoPE)')
    if isinstance(self.remat, bool):  # Frozen: normalise the older bool in place.
      object.__setattr__(self, 'remat', 'full' if self.remat else 'none')
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f'ModelConfig.remat={self.remat!r}: expected one of {REMAT_POLICIES} '
                       '(or a bool)')
    try:  # Frozen: normalise a mapping into the hashable dataclass in place.
      object.__setattr__(self, 'rope_scaling', rope.parse(self.rope_scaling))
    except ValueError as e:
      raise ValueError(f'ModelConfig.rope_scaling: {e}') from None
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f'ModelConfig.attention={self.attention!r}: expected one of '
                       f'{ATTENTION_IMPLS}')
    for name in ('attention_block_q', 'attention_block_kv'):
      if getattr(self, name) <= 0 or getattr(self, name) % 128:
        raise ValueError(f'ModelConfig.{name}={getattr(self, name)} must be a positive '
                         'multiple of 128')
    if not isinstance(self.scan_layers, bool) and self.scan_layers != 'auto':
      raise ValueError(f'ModelConfig.scan_layers={self.scan_layers!r}: expected True, False '
                       "or 'auto'")
    if self.mlp_chunk < 0:
      raise ValueError(f'ModelConfig.mlp_chunk={self.mlp_chunk} must be >= 0 (0: never chunk)')
    for name in ('param_dtype', 'dtype'):
      if getattr(self, name) not in ('float32', 'bfloat16', 'float16'):
        raise ValueError(f'ModelConfig.{name}={getattr(self, name)!r} is not a float dtype name')

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def scans_layers(self) -> bool:
    """Whether the blocks run as one scan: `scan_layers`, 'auto' resolved by JAX's default
    backend (a Python loop on the CPU, a scan elsewhere)."""
    if self.scan_layers == 'auto':
      return jax.default_backend() != 'cpu'
    return self.scan_layers

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  def replace(self, **kwargs) -> 'ModelConfig':
    return dataclasses.replace(self, **kwargs)

  def num_params(self) -> int:
    """Number of parameters, counted from the shapes."""
    d, n, k, h, f = (self.embed_dim, self.num_heads, self.num_kv_heads,
                     self.head_dim, self.mlp_dim)
    attn = d * n * h * 2 + d * k * h * 2
    if self.qkv_bias:
      attn += n * h + 2 * k * h
    if self.qk_norm:
      attn += 2 * h
    block = attn + 3 * d * f + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * block + emb + d

  # Presets. Real shapes from the models' published config.json files.

  @classmethod
  def tiny(cls, **kw) -> 'ModelConfig':
    """A few-thousand-parameter Qwen3-like model for unit tests."""
    return cls(**{**dict(family='qwen3', vocab_size=256, embed_dim=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                         rope_theta=10_000.0, qk_norm=True, tie_embeddings=True,
                         max_seq_len=1024), **kw})

  @classmethod
  def qwen3_0_6b(cls, **kw) -> 'ModelConfig':
    return cls(**{**dict(family='qwen3', vocab_size=151_936, embed_dim=1024,
                         num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                         mlp_dim=3072, rope_theta=1_000_000.0, norm_eps=1e-6,
                         qk_norm=True, tie_embeddings=True, max_seq_len=40_960,
                         param_dtype='bfloat16', dtype='bfloat16'), **kw})

  @classmethod
  def qwen3_8b(cls, **kw) -> 'ModelConfig':
    return cls(**{**dict(family='qwen3', vocab_size=151_936, embed_dim=4096,
                         num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                         mlp_dim=12_288, rope_theta=1_000_000.0, norm_eps=1e-6,
                         qk_norm=True, tie_embeddings=False, max_seq_len=40_960,
                         param_dtype='bfloat16', dtype='bfloat16'), **kw})

  @classmethod
  def qwen3_14b(cls, **kw) -> 'ModelConfig':
    return cls(**{**dict(family='qwen3', vocab_size=151_936, embed_dim=5120,
                         num_layers=40, num_heads=40, num_kv_heads=8, head_dim=128,
                         mlp_dim=17_408, rope_theta=1_000_000.0, norm_eps=1e-6,
                         qk_norm=True, tie_embeddings=False, max_seq_len=40_960,
                         param_dtype='bfloat16', dtype='bfloat16'), **kw})

  @classmethod
  def llama3_8b(cls, **kw) -> 'ModelConfig':
    return cls(**{**dict(family='llama', vocab_size=128_256, embed_dim=4096,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                         mlp_dim=14_336, rope_theta=500_000.0, norm_eps=1e-5,
                         qk_norm=False, qkv_bias=False, tie_embeddings=False,
                         max_seq_len=8192, param_dtype='bfloat16',
                         dtype='bfloat16'), **kw})

  @classmethod
  def preset(cls, name: str, **kw) -> 'ModelConfig':
    """Looks a preset up by name ('tiny', 'qwen3_8b', ...)."""
    presets = {'tiny': cls.tiny, 'qwen3_0_6b': cls.qwen3_0_6b, 'qwen3_8b': cls.qwen3_8b,
               'qwen3_14b': cls.qwen3_14b, 'llama3_8b': cls.llama3_8b}
    if name not in presets:
      raise ValueError(f'unknown model preset {name!r}; known: {sorted(presets)}')
    return presets[name](**kw)
