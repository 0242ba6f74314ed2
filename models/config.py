"""Model configuration: one frozen dataclass for every family cascade builds.

Dense decoders (Llama-3 / Qwen2 / Qwen3) differ only in switches here: Qwen2
adds biases to the q/k/v projections, Qwen3 adds an RMSNorm on each query and
key head, and embeddings are tied or not per checkpoint.

Two mixture-of-experts families are built from a per-layer pattern
(`layer_types`) of residual sublayers, each `x + mixer(norm(x))`:

* 'nemotron_h' (Nemotron-H / Nemotron-3, Cascade 2's base): each layer is one
  mixer, 'mamba' (a Mamba-2 mixer), 'attention' (grouped-query, no RoPE),
  'mlp' (squared-ReLU MLP) or 'moe' (sigmoid-routed experts and a shared
  expert);
* 'qwen3_moe': each layer is Qwen3's attention followed by 'moe'
  (softmax-routed SwiGLU experts) or, for `mlp_only` layers, 'mlp'.

Presets carry the real shapes of the papers' base models.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models import families
from models import rope
from models.families import nemotron_h

MLP_ACTIVATIONS = ('swiglu', 'relu2')
ROUTERS = ('softmax', 'sigmoid')
REMAT_POLICIES = ('none', 'full', 'save_attention_out', 'offload')
# Implementations of models/attention.attend.
ATTENTION_IMPLS = ('auto', 'dense', 'blockwise', 'splash', 'gpu_flash')


# Nemotron-H's pattern letters, kept here for the callers that spell patterns with them.
PATTERN_LETTERS = nemotron_h.PATTERN_LETTERS
NEMOTRON_3_NANO_PATTERN = nemotron_h.NEMOTRON_3_NANO_PATTERN


def parse_pattern(pattern: str) -> tuple[str, ...]:
  """A Nemotron-H pattern string ('M' mamba, '*' attention, '-' mlp, 'E' moe) as layer types."""
  return nemotron_h.FAMILY.parse_letters(pattern)


# How expert parallelism moves tokens to their experts (ModelConfig.moe_dispatch).
MOE_DISPATCH = ('gather', 'all_to_all')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only transformer.

  Attributes:
    family: a registered family (models/families): 'llama', 'qwen2', 'qwen3' (dense),
      'qwen3_moe' or 'nemotron_h' (see the module docstring), or one a user registered;
      HF export's architecture follows it.
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
      tiny shape). `scans_layers` is the resolved choice. The mixture-of-experts
      families scan each run of a repeated unit of their pattern
      (models/hybrid.py `plan`) and run the other sublayers one by one, or,
      where that needs fewer bodies, scan the whole pattern with one body per
      kind of sublayer (`hybrid.folds`).
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
    layer_types: the mixture-of-experts families' per-layer pattern (one entry per
      layer, `num_layers` of them): 'nemotron_h' layers are 'mamba', 'attention',
      'mlp' or 'moe' (or a string of Nemotron-H's letters, 'M' mamba, '*' attention,
      '-' mlp, 'E' moe, as its `hybrid_override_pattern`); 'qwen3_moe' layers are
      'moe' or 'mlp' (the feed-forward part after each layer's attention). None for the
      dense families.
    mlp_activation: 'swiglu' (down(silu(gate x) * up x)) or 'relu2' (down(relu(up x)^2),
      Nemotron-H's MLPs and experts).
    use_rope: rotary positions in the attention layers (Nemotron-H's have none).
    mamba_heads: Mamba-2 heads (its inner width is mamba_heads * mamba_head_dim).
    mamba_head_dim: width of a Mamba-2 head.
    mamba_groups: groups sharing one B and one C (heads % groups == 0).
    mamba_state: state size N of each head.
    mamba_conv: width of the causal depthwise convolution.
    mamba_chunk: chunk length of the state-space scan in passes over many positions
      (memory linear in length; the numbers do not depend on it beyond float rounding).
    mamba_conv_bias: the convolution has a bias.
    mamba_dt_min: lower clamp of the softplus'ed time step (the reference's time_step_limit).
    mamba_dt_max: upper clamp of the time step (inf: none).
    num_experts: routed experts of each 'moe' layer.
    experts_per_token: experts each token is routed to (top-k).
    moe_dim: hidden width of a routed expert.
    shared_expert_dim: hidden width of the shared expert every token also passes
      through (0: none).
    router: 'softmax' (Qwen3-MoE: softmax over experts, then top-k) or 'sigmoid'
      (Nemotron-H: sigmoid scores, top-k chosen on score + a learned correction bias,
      within the `router_topk_groups` best of `router_groups` groups).
    router_norm_topk: the chosen experts' weights are renormalised to sum to one.
    router_groups: expert groups of the group-limited choice (1: no groups).
    router_topk_groups: groups a token may choose experts from.
    routed_scaling: factor on the routed experts' combined output weights.
    router_aux_loss: weight of the load-balancing auxiliary loss added to a training
      objective (0: off, the RL default).
    router_z_loss: weight of the router z-loss (mean squared logsumexp of the router
      logits; 0: off).
    moe_chunk: a shard's routed experts take its tokens (with expert parallelism, its
      expert group's gathered tokens) this many at a time, one chunk after another, each
      recomputed in the backward pass, so the [tokens x experts_per_token, width]
      dispatch buffers are never whole for a long microbatch; 0 never chunks. The same
      numbers up to float rounding.
    moe_dispatch: how expert parallelism brings tokens to their experts (models/moe.py):
      'gather' (every shard all-gathers its expert group's tokens, a reduce-scatter
      returns the outputs) or 'all_to_all' (each shard sends only its routed (token,
      choice) pairs to the shards holding their experts, and an inverse exchange returns
      them). The same numbers up to float rounding.
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
  layer_types: tuple[str, ...] | None = None
  mlp_activation: str = 'swiglu'
  use_rope: bool = True
  mamba_heads: int = 0
  mamba_head_dim: int = 64
  mamba_groups: int = 1
  mamba_state: int = 128
  mamba_conv: int = 4
  mamba_chunk: int = 128
  mamba_conv_bias: bool = True
  mamba_dt_min: float = 0.0
  mamba_dt_max: float = float('inf')
  num_experts: int = 0
  experts_per_token: int = 0
  moe_dim: int = 0
  shared_expert_dim: int = 0
  router: str = 'softmax'
  router_norm_topk: bool = True
  router_groups: int = 1
  router_topk_groups: int = 1
  routed_scaling: float = 1.0
  router_aux_loss: float = 0.0
  router_z_loss: float = 0.0
  moe_chunk: int = 0
  moe_dispatch: str = 'gather'

  def __post_init__(self):
    families.get(self.family)   # an unknown family is refused, naming the field
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
    if self.moe_chunk < 0:
      raise ValueError(f'ModelConfig.moe_chunk={self.moe_chunk} must be >= 0 (0: never chunk)')
    if self.moe_dispatch not in MOE_DISPATCH:
      raise ValueError(f'ModelConfig.moe_dispatch={self.moe_dispatch!r}: expected one of '
                       f'{MOE_DISPATCH}')
    if self.mlp_chunk < 0:
      raise ValueError(f'ModelConfig.mlp_chunk={self.mlp_chunk} must be >= 0 (0: never chunk)')
    for name in ('param_dtype', 'dtype'):
      if getattr(self, name) not in ('float32', 'bfloat16', 'float16'):
        raise ValueError(f'ModelConfig.{name}={getattr(self, name)!r} is not a float dtype name')
    self._check_layer_pattern()

  def _check_layer_pattern(self):
    """Validates the mixture-of-experts families' fields (the dense ones take none of them)."""
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f'ModelConfig.mlp_activation={self.mlp_activation!r}: expected one of '
                       f'{MLP_ACTIVATIONS}')
    spec = self.spec
    if spec.layer_types is None:
      if self.layer_types is not None:
        patterned = tuple(sorted(f.name for f in families.FAMILIES.values() if f.layer_types))
        raise ValueError(f'ModelConfig.layer_types is for the families {patterned}; '
                         f'family={self.family!r} is a dense decoder (every layer attention + '
                         'MLP)')
      return
    if self.layer_types is None:
      raise ValueError(f'ModelConfig(family={self.family!r}) needs layer_types: one of '
                       f'{spec.layer_types} per layer')
    if isinstance(self.layer_types, str) and spec.pattern_letters:   # e.g. Nemotron-H's 'M*EM-'
      try:
        object.__setattr__(self, 'layer_types', spec.parse_letters(self.layer_types))
      except ValueError as e:
        raise ValueError(f'ModelConfig.layer_types: {e}') from None
    object.__setattr__(self, 'layer_types', tuple(self.layer_types))
    known = spec.layer_types
    for i, t in enumerate(self.layer_types):
      if t not in known:
        raise ValueError(f'ModelConfig.layer_types[{i}]={t!r}: unknown layer type for '
                         f'family={self.family!r}; expected one of {known}')
    if len(self.layer_types) != self.num_layers:
      raise ValueError(f'ModelConfig.layer_types has {len(self.layer_types)} entries, '
                       f'num_layers={self.num_layers}')
    if 'mamba' in self.layer_types:
      for name in ('mamba_heads', 'mamba_head_dim', 'mamba_groups', 'mamba_state',
                   'mamba_conv', 'mamba_chunk'):
        if getattr(self, name) <= 0:
          raise ValueError(f'ModelConfig.{name}={getattr(self, name)} must be > 0 '
                           '(the pattern has mamba layers)')
      if self.mamba_heads % self.mamba_groups:
        raise ValueError(f'ModelConfig.mamba_heads={self.mamba_heads} is not a multiple of '
                         f'mamba_groups={self.mamba_groups}')
      if not 0 <= self.mamba_dt_min <= self.mamba_dt_max:
        raise ValueError(f'ModelConfig.mamba_dt_min={self.mamba_dt_min}, mamba_dt_max='
                         f'{self.mamba_dt_max}: need 0 <= min <= max')
    if 'moe' in self.layer_types:
      for name in ('num_experts', 'experts_per_token', 'moe_dim'):
        if getattr(self, name) <= 0:
          raise ValueError(f'ModelConfig.{name}={getattr(self, name)} must be > 0 '
                           '(the pattern has moe layers)')
      if self.router not in ROUTERS:
        raise ValueError(f'ModelConfig.router={self.router!r}: expected one of {ROUTERS}')
      if self.shared_expert_dim < 0:
        raise ValueError(f'ModelConfig.shared_expert_dim={self.shared_expert_dim} must be >= 0')
      if self.router_groups <= 0 or self.num_experts % self.router_groups:
        raise ValueError(f'ModelConfig.router_groups={self.router_groups} must divide '
                         f'num_experts={self.num_experts}')
      if not 1 <= self.router_topk_groups <= self.router_groups:
        raise ValueError(f'ModelConfig.router_topk_groups={self.router_topk_groups} must be in '
                         f'[1, router_groups={self.router_groups}]')
      per_group = self.num_experts // self.router_groups
      if self.experts_per_token > self.router_topk_groups * per_group:
        raise ValueError(f'ModelConfig.experts_per_token={self.experts_per_token} exceeds the '
                         f'{self.router_topk_groups * per_group} experts of the chosen groups')
      if self.router_aux_loss < 0 or self.router_z_loss < 0:
        raise ValueError('ModelConfig.router_aux_loss and router_z_loss must be >= 0')

  @property
  def spec(self) -> families.base.Family:
    """The family's registry entry (models/families): what models/ asks about the family."""
    return families.get(self.family)

  @property
  def mixers(self) -> tuple[str, ...]:
    """The residual sublayers in order, each `x + mixer(norm(x))`: 'attention', 'mamba',
    'mlp' or 'moe' (Qwen3-MoE's layer i is sublayers 2i and 2i + 1)."""
    return self.spec.sublayers(self)

  @property
  def kv_stacked(self) -> bool:
    """The cache layout `Transformer.hidden` takes without `layers`: True, one stacked
    [L, B, K, S, H] key (and value) array (paged: [L, K, P, page_size, H]); False, a tuple of
    one buffer per attention sublayer (and Mamba states beside them)."""
    return self.spec.stack == 'blocks'

  @property
  def flops_from_config(self) -> bool:
    """Whether a program's FLOPs are counted from this config (`launch.plan.flops`) rather
    than by XLA on a twin with the layers unrolled: the sublayer patterns, whose scanned
    segments and loops XLA counts once."""
    return self.spec.stack == 'pattern'

  @property
  def has_experts(self) -> bool:
    """Some sublayer is a mixture of experts ('moe')."""
    return 'moe' in self.mixers

  @property
  def attention_layers(self) -> int:
    """Sublayers that keep a KV cache."""
    return self.mixers.count('attention')

  @property
  def mamba_layers(self) -> int:
    """Sublayers that carry a recurrent (conv, ssm) state."""
    return self.mixers.count('mamba')

  @property
  def mamba_conv_dim(self) -> int:
    """Channels of the Mamba-2 convolution: x (heads * head_dim), B and C (groups * state each)."""
    return self.mamba_heads * self.mamba_head_dim + 2 * self.mamba_groups * self.mamba_state

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def scans_layers(self) -> bool:
    """Whether the blocks run as one scan: `scan_layers`, 'auto' resolved by JAX's default
    backend (a Python loop on the CPU, a scan elsewhere). For the mixture-of-experts families
    the scan covers the repeated runs of their pattern (models/hybrid.py `plan`)."""
    if self.scan_layers == 'auto':
      return jax.default_backend() != 'cpu'
    return self.scan_layers

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  def replace(self, **kwargs) -> 'ModelConfig':
    return dataclasses.replace(self, **kwargs)

  def _sublayer_params(self, mixer: str, active: bool = False) -> int:
    """Parameters of one residual sublayer (its norm included); `active`: those a token uses."""
    d, n, k, h = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim
    mlp = lambda f: (3 if self.mlp_activation == 'swiglu' else 2) * d * f
    if mixer == 'attention':
      p = d * n * h * 2 + d * k * h * 2
      if self.qkv_bias:
        p += n * h + 2 * k * h
      if self.qk_norm:
        p += 2 * h
    elif mixer == 'mlp':
      p = mlp(self.mlp_dim)
    elif mixer == 'moe':
      experts = self.experts_per_token if active else self.num_experts
      p = d * self.num_experts + experts * mlp(self.moe_dim)
      if self.router == 'sigmoid':
        p += self.num_experts    # the score-correction bias
      if self.shared_expert_dim:
        p += mlp(self.shared_expert_dim)
    else:   # mamba
      inner = self.mamba_heads * self.mamba_head_dim
      conv = self.mamba_conv_dim
      p = (d * (inner + conv + self.mamba_heads) + conv * self.mamba_conv
           + (conv if self.mamba_conv_bias else 0) + 3 * self.mamba_heads + inner + inner * d)
    return p + d

  def num_params(self, active: bool = False) -> int:
    """Number of parameters, counted from the shapes; `active`: those one token's forward
    pass uses (only `experts_per_token` of each layer's routed experts)."""
    emb = self.vocab_size * self.embed_dim * (1 if self.tie_embeddings else 2)
    return (sum(self._sublayer_params(m, active) for m in self.mixers) + emb
            + self.embed_dim)

  # Presets: their shapes live in the family modules (models/families), each the real shapes
  # of the model's published config.json.

  @classmethod
  def tiny(cls, **kw) -> 'ModelConfig':
    """A few-thousand-parameter Qwen3-like model for unit tests."""
    return cls.preset('tiny', **kw)

  @classmethod
  def qwen3_0_6b(cls, **kw) -> 'ModelConfig':
    return cls.preset('qwen3_0_6b', **kw)

  @classmethod
  def qwen3_8b(cls, **kw) -> 'ModelConfig':
    return cls.preset('qwen3_8b', **kw)

  @classmethod
  def qwen3_14b(cls, **kw) -> 'ModelConfig':
    return cls.preset('qwen3_14b', **kw)

  @classmethod
  def llama3_8b(cls, **kw) -> 'ModelConfig':
    return cls.preset('llama3_8b', **kw)

  @classmethod
  def nemotron_3_nano_30b_a3b(cls, **kw) -> 'ModelConfig':
    """Nemotron-3-Nano-30B-A3B (Cascade 2's base): 23 Mamba-2, 23 MoE (128 experts, top-6, a
    shared expert) and 6 attention layers; 31.6B parameters, 3.6B active."""
    return cls.preset('nemotron_3_nano_30b_a3b', **kw)

  @classmethod
  def qwen3_30b_a3b(cls, **kw) -> 'ModelConfig':
    """Qwen3-30B-A3B: 48 layers of Qwen3 attention + 128 SwiGLU experts (top-8)."""
    return cls.preset('qwen3_30b_a3b', **kw)

  @classmethod
  def tiny_hybrid(cls, **kw) -> 'ModelConfig':
    """A tiny Nemotron-H-like model for tests: mamba, moe, attention and mlp layers."""
    return cls.preset('tiny_hybrid', **kw)

  @classmethod
  def tiny_moe(cls, **kw) -> 'ModelConfig':
    """A tiny Qwen3-MoE-like model for tests (its second layer an `mlp_only` one)."""
    return cls.preset('tiny_moe', **kw)

  @classmethod
  def preset(cls, name: str, **kw) -> 'ModelConfig':
    """Looks a preset up by name ('tiny', 'qwen3_8b', ...; '-' and '_' alike) among every
    registered family's (models/families)."""
    name = name.replace('-', '_')
    presets = families.presets()
    if name not in presets:
      raise ValueError(f'unknown model preset {name!r}; known: {sorted(presets)}')
    return cls(**{**presets[name], **kw})
