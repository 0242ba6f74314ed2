"""RoPE frequencies with the scalings long-context checkpoints use: linear, YaRN, Llama-3.

  scaling = rope.RopeScaling.from_dict({'rope_type': 'yarn', 'factor': 2.0,
                                        'original_max_position_embeddings': 32_768})
  inv_freq, attention_factor = rope.inv_freq(head_dim=128, theta=1e6, scaling=scaling)

The rotation angle of pair i at position p is `p * inv_freq[i]`; YaRN also
multiplies cos and sin by `attention_factor` (HF applies it there, so q·k
grows by its square). Everything follows transformers' `modeling_rope_utils`
(`ROPE_INIT_FUNCTIONS`) term by term: scalars in Python floats, arrays in
float32, in the same order (`s / x` as torch does it: `1 / x * s`), so the
frequencies equal torch's bit for bit except where numpy's and torch's float32
`pow` differ by an ulp (a few exponents of some bases; YaRN's blend can make
that 2 ulps). `scaling=None` is plain RoPE ('default').

Supported: 'linear' (positions / factor), 'yarn' (Peng et al. 2023: per-band
blend of interpolated and original frequencies, attention temperature) and
'llama3' (Llama-3.1: low frequencies / factor, high ones kept, a smooth ramp
in between). 'dynamic' and 'longrope' change with the sequence length and
are not supported.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

TYPES = ('linear', 'yarn', 'llama3')
# Fields each type reads (besides `type`); the first ones listed are required.
_REQUIRED = {'linear': ('factor',),
             'yarn': ('factor', 'original_max_position_embeddings'),
             'llama3': ('factor', 'original_max_position_embeddings', 'low_freq_factor',
                        'high_freq_factor')}
_OPTIONAL = {'linear': (),
             'yarn': ('beta_fast', 'beta_slow', 'mscale', 'mscale_all_dim', 'attention_factor',
                      'truncate'),
             'llama3': ()}


def _is_number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A RoPE scaling: its type and the parameters that type reads (frozen, hashable).

  Attributes:
    type: 'linear', 'yarn' or 'llama3'.
    factor: context extension factor (>= 1).
    original_max_position_embeddings: the pre-training context (yarn, llama3).
    beta_fast: yarn: rotations below which a band is interpolated (None = 32).
    beta_slow: yarn: rotations above which a band is kept (None = 1).
    mscale: yarn: numerator scale of the attention factor (with mscale_all_dim).
    mscale_all_dim: yarn: denominator scale of the attention factor.
    attention_factor: yarn: the cos/sin multiplier; None = 0.1 ln(factor) + 1.
    truncate: yarn: round the correction range to whole dims (None = True).
    low_freq_factor: llama3: wavelengths above original / this are divided by factor.
    high_freq_factor: llama3: wavelengths below original / this are kept.

  Unset optional fields stay None, so `to_dict` writes back exactly what was read.
  """

  type: str
  factor: float
  original_max_position_embeddings: int | None = None
  beta_fast: float | None = None
  beta_slow: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool | None = None
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None

  def __post_init__(self):
    if self.type not in TYPES:
      raise ValueError(f'rope scaling type {self.type!r} is not supported (supported: '
                       f"'default', {', '.join(map(repr, TYPES))})")
    allowed = _REQUIRED[self.type] + _OPTIONAL[self.type]
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name == 'type':
        continue
      if v is None:
        if f.name in _REQUIRED[self.type]:
          raise ValueError(f'rope scaling {self.type!r} needs {f.name!r}')
        continue
      if f.name not in allowed:
        raise ValueError(f'rope scaling {self.type!r} does not take {f.name!r} '
                         f'(it takes {", ".join(allowed)})')
      if f.name == 'truncate':
        if not isinstance(v, bool):
          raise ValueError(f'rope scaling truncate={v!r} must be a bool')
      elif f.name == 'original_max_position_embeddings':
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
          raise ValueError(f'rope scaling original_max_position_embeddings={v!r} must be an '
                           'int > 0')
      elif not _is_number(v) or not math.isfinite(v):
        raise ValueError(f'rope scaling {f.name}={v!r} must be a finite number')
    if self.factor < 1:
      raise ValueError(f'rope scaling {self.type!r}: factor={self.factor} must be >= 1')
    if self.type == 'yarn':
      if (self.beta_fast or 32) <= (self.beta_slow or 1):
        raise ValueError(f'rope scaling yarn: beta_fast={self.beta_fast} must exceed '
                         f'beta_slow={self.beta_slow} (None = 32 and 1)')
      if self.attention_factor is not None and self.attention_factor <= 0:
        raise ValueError(f'rope scaling yarn: attention_factor={self.attention_factor} '
                         'must be > 0')
    if self.type == 'llama3' and not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ValueError(f'rope scaling llama3: needs 0 < low_freq_factor '
                       f'({self.low_freq_factor}) < high_freq_factor ({self.high_freq_factor})')

  @classmethod
  def from_dict(cls, params: Any) -> 'RopeScaling | None':
    """Parses an HF-style dict: {'rope_type' (or 'type'): ..., 'factor': ..., ...}.

    The base frequency is not part of it (ModelConfig.rope_theta); type
    'default' is None.

    Raises:
      ValueError: not a mapping, an unknown type or field, or a bad value.
    """
    try:
      d = dict(params)
    except (TypeError, ValueError):
      raise ValueError(f'rope scaling {params!r} is not a mapping') from None
    kind = d.pop('rope_type', None)
    legacy = d.pop('type', None)
    kind = kind if kind is not None else legacy
    if kind is None:
      raise ValueError(f'rope scaling {params!r} has no rope_type')
    if kind == 'default':
      if d:
        raise ValueError(f"rope scaling 'default' takes no parameters, got {sorted(d)}")
      return None
    if kind not in TYPES:
      raise ValueError(f'rope scaling type {kind!r} is not supported (supported: '
                       f"'default', {', '.join(map(repr, TYPES))})")
    names = {f.name for f in dataclasses.fields(cls)} - {'type'}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f'rope scaling {kind!r}: unknown field(s) {unknown}')
    return cls(type=kind, **d)

  def covered_positions(self) -> int | None:
    """The positions a YaRN scaling is made for (original_max_position_embeddings x factor:
    Qwen3's 32,768 x 4 = 131,072); None for the others (a 'linear' scaling names no original
    context, and Llama-3's keeps its high frequencies, so checkpoints use it past that product).
    """
    if self.type != 'yarn':
      return None
    return int(self.original_max_position_embeddings * self.factor)

  def to_dict(self) -> dict[str, Any]:
    """The HF form: {'rope_type': type, 'factor': ..., ...} with only the fields that are set."""
    out = {'rope_type': self.type}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name != 'type' and v is not None:
        out[f.name] = v
    return out


def _rdiv(scalar: float, x: np.ndarray) -> np.ndarray:
  """scalar / x the way torch computes it for a float32 tensor: reciprocal, then multiply."""
  return (np.float32(1) / x * np.float32(scalar)).astype(np.float32)


def _default(dim: int, theta: float) -> np.ndarray:
  """1 / theta^(2i/dim), float32 [dim/2] (the exponent computed in float32 as HF does)."""
  exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  return _rdiv(1.0, np.float32(theta) ** exponent)


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
  factor = s.factor

  def get_mscale(scale, mscale=1):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

  attention_factor = s.attention_factor
  if attention_factor is None:
    if s.mscale and s.mscale_all_dim:
      attention_factor = float(get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim))
    else:
      attention_factor = get_mscale(factor)
  beta_fast = s.beta_fast or 32
  beta_slow = s.beta_slow or 1
  original = s.original_max_position_embeddings

  def correction_dim(num_rotations):  # The dim whose wavelength fits num_rotations in `original`.
    return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if s.truncate is None or s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # HF's guard against a zero-width ramp.
  pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
  extrapolation = _rdiv(1.0, pos_freqs)
  interpolation = _rdiv(1.0, np.float32(factor) * pos_freqs)
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                 / np.float32(high - low), 0, 1).astype(np.float32)
  extrapolation_weight = np.float32(1) - ramp
  inv = (interpolation * (np.float32(1) - extrapolation_weight)
         + extrapolation * extrapolation_weight)
  return inv.astype(np.float32), float(attention_factor)


def _llama3(dim: int, theta: float, s: RopeScaling) -> np.ndarray:
  inv = _default(dim, theta)
  factor = np.float32(s.factor)
  low_ff, high_ff = s.low_freq_factor, s.high_freq_factor
  old_context = s.original_max_position_embeddings
  low_freq_wavelen = np.float32(old_context / low_ff)
  high_freq_wavelen = np.float32(old_context / high_ff)
  wavelen = _rdiv(2 * math.pi, inv)
  scaled = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
  smooth = ((_rdiv(old_context, wavelen) - np.float32(low_ff))
            / np.float32(high_ff - low_ff))
  smoothed = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


@functools.lru_cache(maxsize=64)
def inv_freq(head_dim: int, theta: float,
             scaling: RopeScaling | None = None) -> tuple[np.ndarray, float]:
  """The inverse frequencies and the cos/sin multiplier of a RoPE.

  Args:
    head_dim: the rotated width H (even); pairs are (i, i + H/2), HF's rotate_half.
    theta: the RoPE base.
    scaling: None for plain RoPE, else the scaling.

  Returns:
    (inv_freq float32 [H/2] read-only, attention_factor): angle = position * inv_freq;
    cos and sin are multiplied by attention_factor (1.0 except for YaRN).
  """
  if scaling is None:
    inv, attention = _default(head_dim, theta), 1.0
  elif scaling.type == 'linear':
    inv, attention = (_default(head_dim, theta) / np.float32(scaling.factor)).astype(
        np.float32), 1.0
  elif scaling.type == 'yarn':
    inv, attention = _yarn(head_dim, theta, scaling)
  else:
    inv, attention = _llama3(head_dim, theta, scaling), 1.0
  inv.flags.writeable = False  # Shared through the cache.
  return inv, attention


def parse(value: Any) -> RopeScaling | None:
  """None, a RopeScaling or an HF-style mapping (e.g. a ConfigDict) -> RopeScaling | None."""
  if value is None or isinstance(value, RopeScaling):
    return value
  return RopeScaling.from_dict(value)
