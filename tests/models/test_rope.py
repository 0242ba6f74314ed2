"""RoPE scaling: frequencies and logits equal transformers', HF round trips, config errors."""

import importlib
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from models import config as config_lib
from models import hf
from models import rope

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
rope_utils = pytest.importorskip('transformers.modeling_rope_utils')

YARN_QWEN3 = {'rope_type': 'yarn', 'factor': 2.0, 'original_max_position_embeddings': 32_768}
LLAMA31 = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
           'original_max_position_embeddings': 8192}

# (HF config class, head_dim, theta, max_position_embeddings, rope parameters). Real
# checkpoints' settings (Qwen3 + the Nemotron-Cascade YaRN, Llama-3.1) and small ones
# whose ramps fall inside a 16-wide head.
FREQ_CASES = {
    'default_qwen3': ('Qwen3Config', 128, 1e6, 40_960, {'rope_type': 'default'}),
    'default_small': ('LlamaConfig', 16, 1e4, 512, {'rope_type': 'default'}),
    'linear': ('LlamaConfig', 128, 5e5, 8192, {'rope_type': 'linear', 'factor': 2.5}),
    'yarn_qwen3': ('Qwen3Config', 128, 1e6, 65_536, YARN_QWEN3),
    'yarn_no_truncate': ('Qwen3Config', 128, 1e6, 131_072,
                         {'rope_type': 'yarn', 'factor': 4.0, 'beta_fast': 16, 'beta_slow': 2,
                          'truncate': False, 'original_max_position_embeddings': 32_768}),
    'yarn_mscale': ('Qwen3Config', 64, 1e4, 6144,
                    {'rope_type': 'yarn', 'factor': 3.0, 'mscale': 0.707, 'mscale_all_dim': 1.0,
                     'original_max_position_embeddings': 2048}),
    'yarn_attention_factor': ('Qwen3Config', 64, 1e4, 6144,
                              {'rope_type': 'yarn', 'factor': 3.0, 'attention_factor': 1.3,
                               'original_max_position_embeddings': 2048}),
    'yarn_small': ('Qwen3Config', 16, 1e4, 256,
                   {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 64}),
    'llama31': ('LlamaConfig', 128, 5e5, 131_072, LLAMA31),
    'llama3_small': ('LlamaConfig', 16, 1e4, 1024,
                     {'rope_type': 'llama3', 'factor': 4.0, 'low_freq_factor': 1.0,
                      'high_freq_factor': 4.0, 'original_max_position_embeddings': 64}),
}


def _hf_config(cls_name, head_dim, theta, max_positions, params):
  return getattr(transformers, cls_name)(
      hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
      max_position_embeddings=max_positions, rope_parameters={**params, 'rope_theta': theta})


@pytest.mark.parametrize('case', sorted(FREQ_CASES))
def test_inv_freq_matches_transformers(case):
  cls_name, head_dim, theta, max_positions, params = FREQ_CASES[case]
  cfg = _hf_config(cls_name, head_dim, theta, max_positions, params)
  if params['rope_type'] == 'default':  # Computed by each model's rotary class.
    rotary = (transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding
              if cls_name == 'Qwen3Config' else
              transformers.models.llama.modeling_llama.LlamaRotaryEmbedding)
    ref, ref_factor = rotary.compute_default_rope_parameters(cfg)
  else:
    ref, ref_factor = rope_utils.ROPE_INIT_FUNCTIONS[params['rope_type']](cfg, 'cpu')
  ours, factor = rope.inv_freq(head_dim, theta, rope.RopeScaling.from_dict(params))
  ref = ref.numpy()
  assert ours.dtype == np.float32 and ours.shape == ref.shape == (head_dim // 2,)
  # Bit-exact except where numpy's and torch's float32 pow differ (an ulp, 2 after YaRN's blend).
  ulps = np.abs(ours.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
  assert ulps.max() <= 2, (case, ulps)
  assert factor == pytest.approx(ref_factor, rel=1e-15)
  if params['rope_type'] != 'default':  # The scaling really changes the frequencies.
    assert not np.allclose(ours, rope.inv_freq(head_dim, theta)[0], rtol=1e-3)


_COMMON = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
               num_attention_heads=4)
# Tiny models whose scaled bands fall inside their heads: pre-training context 64,
# positions up to ~200 in the second row.
MODELS = {
    'qwen3_yarn': lambda: transformers.Qwen3Config(
        **_COMMON, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_parameters={'rope_type': 'yarn', 'rope_theta': 10_000.0, 'factor': 4.0,
                         'original_max_position_embeddings': 64}),
    'llama_llama3': lambda: transformers.LlamaConfig(
        **_COMMON, num_key_value_heads=1, tie_word_embeddings=False, max_position_embeddings=512,
        rope_parameters={'rope_type': 'llama3', 'rope_theta': 10_000.0, 'factor': 4.0,
                         'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                         'original_max_position_embeddings': 64}),
    'qwen2_linear': lambda: transformers.Qwen2Config(
        **_COMMON, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512,
        rope_parameters={'rope_type': 'linear', 'rope_theta': 10_000.0, 'factor': 3.0}),
}
TOKENS = np.random.RandomState(0).randint(0, 96, (2, 24)).astype(np.int32)
POSITIONS = np.stack([np.arange(24), 180 + np.arange(24)]).astype(np.int32)


def _torch_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(TOKENS, dtype=torch.long),
                 position_ids=torch.tensor(POSITIONS, dtype=torch.long)).logits.float().numpy()


def _logits(model) -> np.ndarray:
  return np.asarray(model(jnp.asarray(TOKENS), jnp.asarray(POSITIONS)))


@pytest.fixture(scope='module')
def ckpts(tmp_path_factory):
  """name -> (checkpoint dir, reference logits) of a randomly initialised HF model."""
  out = {}
  for i, (name, make_cfg) in enumerate(MODELS.items()):
    torch.manual_seed(i)
    model = transformers.AutoModelForCausalLM.from_config(make_cfg()).eval()
    with torch.no_grad():  # Perturb norms and biases too (HF starts them at 1 and 0).
      for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    out[name] = (path, _torch_logits(model))
  return out


def _rope_parameters(path) -> dict:
  return json.loads((path / 'config.json').read_text())['rope_parameters']


@pytest.mark.parametrize('name', sorted(MODELS))
def test_scaled_logits_match_transformers(ckpts, name, tmp_path):
  path, ref = ckpts[name]
  model = hf.load_model(path)
  params = _rope_parameters(path)
  assert model.cfg.rope_scaling.type == params['rope_type'] != 'default'
  np.testing.assert_allclose(_logits(model), ref, atol=1e-4, rtol=0)
  # The same weights under plain RoPE are far off: the scaling is what matches.
  plain = shutil.copytree(path, tmp_path / 'plain')
  cfg = json.loads((plain / 'config.json').read_text())
  cfg['rope_parameters'] = {'rope_type': 'default', 'rope_theta': params['rope_theta']}
  (plain / 'config.json').write_text(json.dumps(cfg))
  assert np.abs(_logits(hf.load_model(plain)) - ref).max() > 1e-2


@pytest.mark.parametrize('name', sorted(MODELS))
def test_import_export_keeps_rope_scaling(ckpts, name, tmp_path):
  path, ref = ckpts[name]
  model = hf.load_model(path)
  hf.save_model(model, tmp_path)
  assert _rope_parameters(tmp_path) == _rope_parameters(path)
  assert hf.load_model(tmp_path).cfg == model.cfg
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert back.config.rope_parameters == _rope_parameters(path)
  np.testing.assert_allclose(_torch_logits(back), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize('scaling', [
    None, {'rope_type': 'linear', 'factor': 2.0}, YARN_QWEN3, LLAMA31,
    {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32_768,
     'beta_fast': 16.0, 'beta_slow': 2.0, 'mscale': 0.7, 'mscale_all_dim': 1.0,
     'truncate': False},
])
def test_config_round_trip(scaling):
  cfg = config_lib.ModelConfig.qwen3_8b(rope_scaling=scaling)
  assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg.replace(dtype=cfg.param_dtype)


def test_transformers_4_style_config():
  """4.x writes `rope_scaling` (legacy 'type') next to a top-level `rope_theta`."""
  cfg = hf.config_from_hf({
      'architectures': ['Qwen3ForCausalLM'], 'vocab_size': 10, 'hidden_size': 64,
      'intermediate_size': 8, 'num_hidden_layers': 1, 'num_attention_heads': 4,
      'max_position_embeddings': 40_960, 'rope_theta': 1e6,
      'rope_scaling': {'type': 'yarn', 'factor': 4.0}})
  # As transformers does, the original context defaults to max_position_embeddings.
  assert cfg.rope_theta == 1e6
  assert cfg.rope_scaling == rope.RopeScaling('yarn', 4.0, original_max_position_embeddings=40_960)
  out = hf.config_to_hf(cfg)
  assert out['rope_scaling'] == {'rope_type': 'yarn', 'factor': 4.0,
                                 'original_max_position_embeddings': 40_960}
  assert out['rope_parameters'] == {**out['rope_scaling'], 'rope_theta': 1e6}


@pytest.mark.parametrize('params', [
    {'rope_type': 'longrope', 'factor': 4.0, 'short_factor': [1.0], 'long_factor': [2.0]},
    {'rope_type': 'dynamic', 'factor': 2.0},
    {'rope_type': 'su', 'factor': 2.0},
])
def test_unknown_type_refused_in_one_line(params):
  hf_cfg = {**hf.config_to_hf(config_lib.ModelConfig.tiny()),
            'rope_parameters': {**params, 'rope_theta': 1e4}}
  with pytest.raises(ValueError) as e:
    hf.config_from_hf(hf_cfg)
  msg = str(e.value)
  assert '\n' not in msg
  assert msg == (f"HF config: rope scaling type {params['rope_type']!r} is not supported "
                 "(supported: 'default', 'linear', 'yarn', 'llama3')")


@pytest.mark.parametrize('scaling, match', [
    ({'rope_type': 'yarn', 'factor': 2.0}, "'yarn' needs 'original_max_position_embeddings'"),
    ({'rope_type': 'llama3', 'factor': 8.0, 'original_max_position_embeddings': 8192,
      'low_freq_factor': 1.0}, "'llama3' needs 'high_freq_factor'"),
    ({'rope_type': 'linear', 'factor': 2.0, 'beta_fast': 8}, "'linear' does not take 'beta_fast'"),
    ({'rope_type': 'linear', 'factor': 2.0, 'scale': 2}, r"unknown field\(s\) \['scale'\]"),
    ({'rope_type': 'linear', 'factor': 0.5}, 'factor=0.5 must be >= 1'),
    ({'rope_type': 'linear', 'factor': '2'}, "factor='2' must be a finite number"),
    ({'rope_type': 'yarn', 'factor': 2.0, 'original_max_position_embeddings': 4096.5},
     'must be an int > 0'),
    ({'rope_type': 'yarn', 'factor': 2.0, 'original_max_position_embeddings': 64,
      'beta_fast': 1, 'beta_slow': 2}, 'beta_fast=1 must exceed beta_slow=2'),
    ({'rope_type': 'llama3', 'factor': 8.0, 'original_max_position_embeddings': 8192,
      'low_freq_factor': 4.0, 'high_freq_factor': 1.0}, 'low_freq_factor'),
    ({'rope_type': 'default', 'factor': 2.0}, "'default' takes no parameters"),
    ({'factor': 2.0}, 'has no rope_type'),
    ([('rope_type', 'yarn'), 3], 'is not a mapping'),
])
def test_model_config_rejects_bad_scaling(scaling, match):
  with pytest.raises(ValueError, match='ModelConfig.rope_scaling: .*' + match):
    config_lib.ModelConfig.tiny(rope_scaling=scaling)


def test_model_config_takes_a_mapping():
  """A config override (dict or ConfigDict) becomes the frozen, hashable dataclass."""
  ml_collections = pytest.importorskip('ml_collections')
  cfg = config_lib.ModelConfig.tiny(rope_scaling=ml_collections.ConfigDict(YARN_QWEN3))
  assert isinstance(cfg.rope_scaling, rope.RopeScaling)
  assert cfg.rope_scaling.to_dict() == YARN_QWEN3
  assert hash(cfg) == hash(config_lib.ModelConfig.tiny(rope_scaling=dict(YARN_QWEN3)))
  assert config_lib.ModelConfig.tiny(rope_scaling={'rope_type': 'default'}).rope_scaling is None


@pytest.mark.parametrize('name', ['nemotron_cascade_14b', 'nemotron_cascade_8b',
                                  'nemotron_cascade2'])
def test_paper_configs_use_yarn_over_their_longest_length(name):
  c = importlib.import_module(f'configs.{name}').get_config()
  cfg = config_lib.ModelConfig.preset(c.model.preset, **c.model.overrides)
  longest = int(c.eval.max_prompt_len + c.eval.max_new_tokens)
  for st in c.stages:
    longest = max(longest, st.get('max_len', 0))
    for ph in [st, *(st.get('phases') or [])]:
      if 'max_response_len' in ph:
        longest = max(longest, st['max_prompt_len'] + ph['max_response_len'])
  assert longest > 40_960
  if not cfg.use_rope:   # Cascade 2's Nemotron-H: attention without positions, no RoPE limit
    assert cfg.family == 'nemotron_h' and cfg.max_seq_len >= longest
    return
  scaling = cfg.rope_scaling
  assert scaling.type == 'yarn'
  assert scaling.original_max_position_embeddings * scaling.factor >= cfg.max_seq_len >= longest


@pytest.mark.parametrize('scaling', [None, {'rope_type': 'yarn', 'factor': 4.0,
                                            'original_max_position_embeddings': 1024}])
def test_apply_rope_is_the_split_and_concatenate_rotation_bit_for_bit(scaling):
  # The rotation is written without splitting x (XLA:CPU ran the split-and-concatenate form as
  # a slow loop); compiled, it rounds exactly as that form does, and both match float64 numpy.
  import jax  # pylint: disable=g-import-not-at-top
  from models import transformer  # pylint: disable=g-import-not-at-top
  scaling = rope.parse(scaling)
  rs = np.random.RandomState(0)
  x = jnp.asarray(rs.normal(size=(3, 40, 6, 32)), jnp.float32)
  positions = jnp.asarray(rs.randint(0, 4096, size=(3, 40)), jnp.int32)

  def split_form(x, positions):
    if scaling is None:
      inv = 1.0 / (10_000.0 ** (jnp.arange(0, 32, 2, dtype=jnp.float32) / 32))
      factor = 1.0
    else:
      inv, factor = rope.inv_freq(32, 10_000.0, scaling)
    ang = positions.astype(jnp.float32)[..., None] * inv
    sin, cos = jnp.sin(ang)[:, :, None] * factor, jnp.cos(ang)[:, :, None] * factor
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

  got = jax.jit(lambda x, p: transformer.apply_rope(x, p, 10_000.0, scaling))(x, positions)
  np.testing.assert_array_equal(got, jax.jit(split_form)(x, positions))
  # float64 numpy from the same float32 angles.
  inv, factor = ((1.0 / (10_000.0 ** (np.arange(0, 32, 2, dtype=np.float32) / 32)), 1.0)
                 if scaling is None else rope.inv_freq(32, 10_000.0, scaling))
  ang = (np.asarray(positions, np.float32)[..., None] * np.asarray(inv, np.float32))
  ang = ang.astype(np.float64)
  sin, cos = np.sin(ang)[:, :, None] * factor, np.cos(ang)[:, :, None] * factor
  x1, x2 = np.split(np.asarray(x, np.float64), 2, axis=-1)
  want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)   # float32 sin and cos at ~4K rad
