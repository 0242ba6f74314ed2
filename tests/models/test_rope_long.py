"""RoPE past 64K positions: Qwen3's 131,072 (YaRN factor 4 over 32,768) against transformers.

Frequencies against `ROPE_INIT_FUNCTIONS`, cos and sin at positions 65,536 ..
131,071 against transformers' rotary embedding and an independent float64
YaRN, a tiny Qwen3 checkpoint's logits at positions near 131,072 through
`hf.load_model`, and the lengths a config may ask of such a model.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import config as config_lib
from models import hf
from models import layers
from models import rope

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
rope_utils = pytest.importorskip('transformers.modeling_rope_utils')

# Qwen3's long-context setting (its model card): YaRN, factor 4 over the 32,768 positions
# it was trained on, 131,072 in all.
QWEN3_128K = {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32_768}
THETA, HEAD_DIM = 1_000_000.0, 128
LONG = np.arange(65_536, 131_072, 61)          # 1,075 positions over the upper half


def _hf_config(max_positions=131_072, head_dim=HEAD_DIM, **kw):
  return transformers.Qwen3Config(
      hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
      max_position_embeddings=max_positions,
      rope_parameters={**QWEN3_128K, 'rope_theta': THETA}, **kw)


def yarn_float64(dim, theta, factor, original, beta_fast=32.0, beta_slow=1.0):
  """YaRN (Peng et al. 2023) in float64 from its definition: per-pair wavelengths, the
  interpolated/extrapolated blend over the pairs between the beta_fast and beta_slow
  rotation counts (rounded outwards to whole pairs), and the attention factor."""
  base = theta ** -(np.arange(0, dim, 2, dtype=np.float64) / dim)
  # The pair index whose wavelength makes `rot` rotations over the original context.
  pair = lambda rot: dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))
  lo, hi = max(math.floor(pair(beta_fast)), 0), min(math.ceil(pair(beta_slow)), dim - 1)
  keep = 1 - np.clip((np.arange(dim // 2) - lo) / (hi - lo), 0, 1)   # 1: original frequency
  return base / factor * (1 - keep) + base * keep, 0.1 * math.log(factor) + 1


def test_qwen3_128k_frequencies_match_transformers():
  ref, ref_factor = rope_utils.ROPE_INIT_FUNCTIONS['yarn'](_hf_config(), 'cpu')
  ours, factor = rope.inv_freq(HEAD_DIM, THETA, rope.RopeScaling.from_dict(QWEN3_128K))
  ulps = np.abs(ours.view(np.int32).astype(np.int64) - ref.numpy().view(np.int32).astype(np.int64))
  assert ulps.max() <= 2
  assert factor == pytest.approx(ref_factor, rel=1e-15) == 0.1 * math.log(4) + 1
  want, want_factor = yarn_float64(HEAD_DIM, THETA, 4.0, 32_768)
  np.testing.assert_allclose(ours, want, rtol=5e-7, atol=0)
  assert factor == pytest.approx(want_factor, rel=1e-15)
  # Not the factor-2 setting of 65,536 positions: the low frequencies are a quarter.
  plain = rope.inv_freq(HEAD_DIM, THETA)[0]
  assert ours[-1] == pytest.approx(plain[-1] / 4, rel=1e-6) and ours[0] == plain[0]


def _ours_cos_sin(positions):
  """cos and sin (times the attention factor) as the model applies them: apply_rope on a
  vector whose first half is 1 gives [cos, sin] per pair."""
  x = jnp.concatenate([jnp.ones((1, len(positions), 1, HEAD_DIM // 2)),
                       jnp.zeros((1, len(positions), 1, HEAD_DIM // 2))], -1)
  out = jax.jit(layers.apply_rope, static_argnums=(2, 3))(
      x, jnp.asarray(positions, jnp.int32)[None], THETA, rope.RopeScaling.from_dict(QWEN3_128K))
  out = np.asarray(out)[0, :, 0]
  return out[:, :HEAD_DIM // 2], out[:, HEAD_DIM // 2:]


def test_cos_sin_at_64k_to_128k_positions():
  cos, sin = _ours_cos_sin(LONG)
  rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(_hf_config())
  with torch.no_grad():
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32),
                            torch.tensor(LONG[None], dtype=torch.long))
  hf_cos, hf_sin = hf_cos.numpy()[0, :, :HEAD_DIM // 2], hf_sin.numpy()[0, :, :HEAD_DIM // 2]
  inv64, factor = yarn_float64(HEAD_DIM, THETA, 4.0, 32_768)
  ang64 = LONG[:, None].astype(np.float64) * inv64
  cos64, sin64 = np.cos(ang64) * factor, np.sin(ang64) * factor
  # float32 angles: position x frequency rounds to a relative 2^-24 (0.004 rad at position
  # 131,071 on the top pair), and the float32 frequency is within 5e-7 of the exact one
  # (numpy's and torch's float32 pow can differ by an ulp), so cos and sin are off by up to
  # about angle x 6e-7: 0.009 measured.
  bound = factor * (ang64 * 6e-7 + 1e-6)
  ours_inv = rope.inv_freq(HEAD_DIM, THETA, rope.RopeScaling.from_dict(QWEN3_128K))[0]
  same = ours_inv == rotary.inv_freq.numpy()        # bit-equal float32 frequencies
  assert same.sum() >= 48
  for ours, ref, exact in ((cos, hf_cos, cos64), (sin, hf_sin, sin64)):
    # Ours is judged against float64.
    assert (np.abs(ours - exact) <= bound).all(), np.abs(ours - exact).max()
    # transformers' numbers come from torch's CPU kernels, which vary by machine: on one CI
    # machine its cos at position 65,536 was 7e-5 off float64 on the lowest-frequency pairs
    # (ours and float64 agreed). Parity with it is therefore asked to 2e-4 beyond the two
    # float32 roundings; a wrong YaRN setting (factor, original length, attention factor) moves these
    # values by 1e-2 or more.
    np.testing.assert_array_less(np.abs(ours - ref), 2 * bound + 2e-4)
    # The low-frequency pairs (YaRN's interpolated ones) are float64-exact.
    np.testing.assert_allclose(ours[:, -8:], exact[:, -8:], atol=1e-5, rtol=0)
  # The factor-4 frequencies, not plain RoPE's, drive those angles.
  plain = np.cos(LONG[:, None] * rope.inv_freq(HEAD_DIM, THETA)[0].astype(np.float64))
  assert np.abs(cos - plain * factor).max() > 1


_TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
TOKENS = np.random.RandomState(1).randint(0, 96, (2, 16)).astype(np.int32)
POSITIONS = np.stack([65_536 + np.arange(16), 131_056 + np.arange(16)]).astype(np.int32)


@pytest.mark.heavy
def test_checkpoint_logits_at_128k_positions(tmp_path):
  torch.manual_seed(0)
  cfg = transformers.Qwen3Config(**_TINY, max_position_embeddings=131_072,
                                 rope_parameters={**QWEN3_128K, 'rope_theta': THETA})
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
    ref = model(torch.tensor(TOKENS, dtype=torch.long),
                position_ids=torch.tensor(POSITIONS, dtype=torch.long)).logits.float().numpy()
  model.save_pretrained(tmp_path)
  ours = hf.load_model(tmp_path)
  assert ours.cfg.rope_scaling == rope.RopeScaling('yarn', 4.0,
                                                   original_max_position_embeddings=32_768)
  assert ours.cfg.max_seq_len == 131_072
  got = np.asarray(ours(jnp.asarray(TOKENS), jnp.asarray(POSITIONS)))
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
  # And its export writes the scaling back as transformers reads it.
  out = tmp_path / 'export'
  hf.save_model(ours, out)
  params = json.loads((out / 'config.json').read_text())['rope_parameters']
  assert params == {**QWEN3_128K, 'rope_theta': THETA}
  assert transformers.AutoConfig.from_pretrained(out).max_position_embeddings == 131_072


def test_transformers_4_style_qwen3_128k_config():
  """Qwen3's model card: add rope_scaling (yarn, 4.0, 32,768) to a 4.x-style config.json."""
  cfg = hf.config_from_hf({
      'architectures': ['Qwen3ForCausalLM'], 'vocab_size': 10, 'hidden_size': 64,
      'intermediate_size': 8, 'num_hidden_layers': 1, 'num_attention_heads': 4,
      'head_dim': 16, 'max_position_embeddings': 131_072, 'rope_theta': THETA,
      'rope_scaling': dict(QWEN3_128K)})
  assert cfg.rope_scaling.to_dict() == QWEN3_128K and cfg.max_seq_len == 131_072
  assert cfg.rope_scaling.covered_positions() == 131_072


def test_nemotron_h_has_no_rope_to_scale():
  """The hybrid family's attention layers take no positions (Mamba-2 layers order the
  tokens): its HF config carries no rope fields, and its length is max_position_embeddings."""
  hf_cfg = transformers.NemotronHConfig().to_dict()
  assert not [k for k in hf_cfg if 'rope' in k]
  preset = config_lib.ModelConfig.preset('nemotron_3_nano_30b_a3b')
  assert not preset.use_rope and preset.max_seq_len == 262_144
