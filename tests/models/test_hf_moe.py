"""HF interop of the mixture-of-experts families (Nemotron-H, Qwen3-MoE): parity with
transformers both ways, the checkpoint layouts, config translation and errors."""

import copy
import json
import pathlib
import shutil
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from flax import nnx

from models import config as config_lib
from models import hf
from models import sharding
from models import transformer

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

VOCAB = 96
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 19)).astype(np.int32)
MASK = np.ones((2, 19), np.int32)
MASK[1, :5] = 0    # a left-padded row
REAL = MASK.astype(bool)

_NEMOTRON = dict(
    vocab_size=VOCAB, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    intermediate_size=40, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
    conv_kernel=4, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, time_step_min=0.01)
_QWEN = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=16)
# Group-limited sigmoid routing (2 groups, 1 chosen), routed scaling 2.5 and a shared expert
# in every Nemotron-H; GQA everywhere; Qwen3-MoE with an mlp-only layer, both norm_topk_prob.
HF_CONFIGS = {
    'nemotron_h_all_kinds': lambda: transformers.NemotronHConfig(
        **_NEMOTRON, layers_block_type=['linear_attention', 'moe', 'full_attention', 'mlp',
                                        'moe', 'linear_attention']),
    'nemotron_h_attention_first': lambda: transformers.NemotronHConfig(
        **{**_NEMOTRON, 'num_key_value_heads': 1, 'use_conv_bias': False,
           'norm_topk_prob': False},
        layers_block_type=['full_attention', 'moe', 'linear_attention', 'mlp']),
    'qwen3_moe_norm_topk': lambda: transformers.Qwen3MoeConfig(
        **_QWEN, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True,
        rope_parameters={'rope_type': 'default', 'rope_theta': 5_000.0}),
    'qwen3_moe_sparse_step_tied': lambda: transformers.Qwen3MoeConfig(
        **_QWEN, num_hidden_layers=3, decoder_sparse_step=2, norm_topk_prob=False,
        tie_word_embeddings=True),
}
NEMOTRON, QWEN = 'nemotron_h_all_kinds', 'qwen3_moe_norm_topk'


class Ckpt(NamedTuple):
  path: pathlib.Path
  model: Any = None
  logits: np.ndarray = None
  masked: np.ndarray = None


def _torch_logits(model, mask=None) -> np.ndarray:
  with torch.no_grad():
    out = model(torch.tensor(TOKENS, dtype=torch.long),
                attention_mask=None if mask is None else torch.tensor(mask, dtype=torch.long))
  return out.logits.float().numpy()


@nnx.jit
def _forward(model, tokens, segment_ids):
  return model(tokens, segment_ids=segment_ids)


def _logits(model, mask=None) -> np.ndarray:
  seg = np.ones_like(TOKENS) if mask is None else mask
  return np.asarray(_forward(model, jnp.asarray(TOKENS), jnp.asarray(seg)))


def _params(model) -> dict:
  return {k: np.asarray(v.get_value())
          for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope='module')
def ckpts(tmp_path_factory):
  """name -> Ckpt of a randomly initialised, perturbed transformers model and its logits."""
  out = {}
  for i, (name, make_cfg) in enumerate(HF_CONFIGS.items()):
    torch.manual_seed(i)
    model = transformers.AutoModelForCausalLM.from_config(make_cfg()).eval()
    # HF initialises norms, D and A_log to fixed values and the correction bias to 0;
    # perturb every tensor so a swapped or mis-laid-out one changes the logits.
    with torch.no_grad():
      for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
      for n, b in model.named_buffers():
        if n.endswith('e_score_correction_bias'):
          b.add_(torch.randn_like(b) * 0.5)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    out[name] = Ckpt(path, model, _torch_logits(model), _torch_logits(model, MASK))
  return out


def _perturb(model, seed: int):
  """Adds noise to every parameter (more to the router's correction bias)."""
  rng = np.random.RandomState(seed)
  flat = []
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    value = np.asarray(var.get_value())
    scale = 0.5 if path[-1] == 'router_bias' else 0.1
    flat.append((path, var.replace(jnp.asarray(value + scale * rng.randn(*value.shape),
                                               value.dtype))))
  nnx.update(model, nnx.from_flat_state(flat))


def _tensors(path: pathlib.Path) -> dict:
  with safetensors.safe_open(str(path / 'model.safetensors'), 'numpy') as fh:
    return {k: fh.get_tensor(k) for k in fh.keys()}


# ---- parity with transformers ----


@pytest.mark.parametrize('name', sorted(HF_CONFIGS))
def test_load_matches_transformers(ckpts, name):
  c = ckpts[name]
  model = hf.load_model(c.path)
  assert model.cfg.family == json.loads((c.path / 'config.json').read_text())['model_type']
  np.testing.assert_allclose(_logits(model), c.logits, atol=1e-4, rtol=0)
  # The left-padded row: padding changes the real tokens' logits in neither model.
  assert not np.allclose(c.masked[1, 5:], c.logits[1, 5:], atol=1e-2)
  np.testing.assert_allclose(_logits(model, MASK)[REAL], c.masked[REAL], atol=1e-4, rtol=0)


@pytest.mark.parametrize('name', sorted(HF_CONFIGS))
def test_save_model_loads_in_transformers(ckpts, name, tmp_path):
  cfg = hf.config_from_hf(json.loads((ckpts[name].path / 'config.json').read_text()))
  model = transformer.create(cfg, seed=3)
  _perturb(model, seed=4)
  hf.save_model(model, tmp_path)
  back, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, output_loading_info=True)
  assert not (info['missing_keys'] or info['unexpected_keys'] or info['mismatched_keys'])
  assert type(back).__name__ == type(ckpts[name].model).__name__
  back.eval()
  np.testing.assert_allclose(_torch_logits(back), _logits(model), atol=1e-4, rtol=0)
  np.testing.assert_allclose(_torch_logits(back, MASK)[REAL], _logits(model, MASK)[REAL],
                             atol=1e-4, rtol=0)


def test_fixtures_routing_options_matter(ckpts):
  """The Nemotron-H fixture's group limit, scaling and correction bias, and Qwen3-MoE's
  norm_topk_prob, each change transformers' logits (so the parity tests cover them)."""
  c = ckpts[NEMOTRON]
  changes = [('topk_group', 2), ('routed_scaling_factor', 1.0),
             ('e_score_correction_bias', torch.zeros(8))]
  for attr, value in changes:
    model = copy.deepcopy(c.model)
    for layer in model.model.layers:
      if layer.block_type == 'moe':
        setattr(layer.mixer.gate, attr, value)
    assert np.abs(_torch_logits(model) - c.logits).max() > 1e-2, attr
  c = ckpts[QWEN]
  model = copy.deepcopy(c.model)
  for layer in model.model.layers:
    if hasattr(layer.mlp, 'gate'):
      layer.mlp.gate.norm_topk_prob = False
  assert np.abs(_torch_logits(model) - c.logits).max() > 1e-2


# ---- layouts ----


@pytest.mark.parametrize('name', sorted(HF_CONFIGS))
def test_load_save_round_trip_writes_the_hub_layout(ckpts, name, tmp_path):
  """save_pretrained writes the hub layout (per-expert, Nemotron-H under backbone.); our
  export of its import writes the same tensors, bit for bit, and an equal config."""
  path = ckpts[name].path
  hf.save_model(hf.load_model(path), tmp_path)
  want, got = _tensors(path), _tensors(tmp_path)
  assert any('.experts.7.' in k for k in want)
  if name.startswith('nemotron'):
    assert all(k.startswith('backbone.') or k == 'lm_head.weight' for k in want)
  assert sorted(got) == sorted(want)
  for k in want:
    assert got[k].dtype == want[k].dtype, k
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  read = lambda p: hf.config_from_hf(json.loads((p / 'config.json').read_text()))
  assert read(tmp_path) == read(path)


def _write_fused(ckpt: Ckpt, dst: pathlib.Path, **extra) -> pathlib.Path:
  """The transformers model's in-memory tensors (prefix model., fused experts) as a checkpoint."""
  dst.mkdir()
  shutil.copy(ckpt.path / 'config.json', dst / 'config.json')
  tensors = {k: v.detach().numpy().copy() for k, v in ckpt.model.state_dict().items()}
  tensors.update(extra)
  safetensors.numpy.save_file(tensors, str(dst / 'model.safetensors'), metadata={'format': 'pt'})
  return dst


@pytest.mark.parametrize('name', [NEMOTRON, QWEN])
def test_fused_layout_loads(ckpts, name, tmp_path):
  c = ckpts[name]
  extra = {}
  if name == NEMOTRON:   # multi-token-prediction heads are skipped, as transformers does
    extra['mtp.layers.0.norm.weight'] = np.ones(48, np.float32)
  ckpt = _write_fused(c, tmp_path / 'fused', **extra)
  names = set(_tensors(ckpt))
  assert any(k.endswith(('experts.up_proj', 'experts.gate_up_proj')) for k in names)
  assert not any('.experts.0.' in k or k.startswith('backbone.') for k in names)
  want, got = _params(hf.load_model(c.path)), _params(hf.load_model(ckpt))
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


def test_load_onto_expert_mesh_is_sharded_and_equal(ckpts, tmp_path):
  path = ckpts[NEMOTRON].path
  mesh = sharding.make_mesh((1, 2, 2, 2))   # data, fsdp, expert, tensor
  model = hf.load_model(path, mesh=mesh)
  up = model.blocks[0].moe.mixer.up.get_value()   # [moe sublayers, E, D, F]: the folded stack
  assert up.sharding.spec[1] == 'expert'
  assert up.addressable_shards[0].data.shape[1] == 4
  want = _params(hf.load_model(path))
  for k, v in _params(model).items():
    np.testing.assert_array_equal(v, want[k], err_msg=str(k))
  hf.save_model(model, tmp_path)   # gathers the shards back into the HF tensors
  a, b = _tensors(path), _tensors(tmp_path)
  for k in a:
    np.testing.assert_array_equal(b[k], a[k], err_msg=k)


# ---- config translation ----


@pytest.mark.parametrize('preset', ['tiny_hybrid', 'tiny_moe', 'nemotron_3_nano_30b_a3b',
                                    'qwen3_30b_a3b'])
def test_config_round_trip(preset, tmp_path):
  cfg = config_lib.ModelConfig.preset(preset)
  want = cfg.replace(dtype=cfg.param_dtype)
  written = hf.config_to_hf(cfg)
  assert hf.config_from_hf(written) == want
  # transformers reads it, and what it writes back reads the same.
  (tmp_path / 'config.json').write_text(json.dumps(written))
  hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
  assert hf_cfg.model_type == cfg.family
  hf_cfg.save_pretrained(tmp_path / 'again')
  assert hf.config_from_hf(json.loads((tmp_path / 'again' / 'config.json').read_text())) == want
  if preset == 'nemotron_3_nano_30b_a3b':
    assert written['hybrid_override_pattern'] == config_lib.NEMOTRON_3_NANO_PATTERN
    assert hf_cfg.layers_block_type[:3] == ['linear_attention', 'moe', 'linear_attention']


def test_nemotron_h_config_older_fields():
  cfg = config_lib.ModelConfig.tiny_hybrid()
  new = hf.config_to_hf(cfg)
  # 4.x / hub style: the pattern string, mamba_* names, num_local_experts.
  old = {k: v for k, v in new.items() if k not in (
      'layers_block_type', 'n_groups', 'conv_kernel', 'chunk_size', 'n_routed_experts')}
  old.update(mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=16, num_local_experts=8,
             num_nextn_predict_layers=1)
  assert hf.config_from_hf(old) == cfg
  # A list with the older layer names wins over the pattern, as in transformers.
  listed = {**new, 'hybrid_override_pattern': 'MMMMMM',
            'layers_block_type': ['mamba', 'moe', 'attention', 'moe', 'mamba', 'mlp']}
  assert hf.config_from_hf(listed) == cfg
  assert hf.config_from_hf({**new, 'n_shared_experts': 0}).shared_expert_dim == 0


def test_qwen3_moe_layer_types():
  base = hf.config_to_hf(config_lib.ModelConfig.tiny_moe(num_layers=4,
                                                         layer_types=('moe',) * 4))
  layers = lambda **kw: hf.config_from_hf({**base, **kw}).layer_types
  assert layers() == ('moe',) * 4
  assert layers(mlp_only_layers=[0, 2]) == ('mlp', 'moe', 'mlp', 'moe')
  assert layers(decoder_sparse_step=2) == ('mlp', 'moe', 'mlp', 'moe')
  assert layers(decoder_sparse_step=2, mlp_only_layers=[3]) == ('mlp', 'moe', 'mlp', 'mlp')
  assert layers(num_experts=0) == ('mlp',) * 4


@pytest.mark.parametrize('preset, change, match', [
    ('tiny_hybrid', dict(layers_block_type=None, hybrid_override_pattern='ME*X'),
     "unknown letter 'X' at 3"),
    ('tiny_hybrid', dict(layers_block_type=['mamba', 'moe', 'gdn', 'moe', 'mamba', 'mlp']),
     r"layers_block_type\[2\]='gdn'"),
    ('tiny_hybrid', dict(layers_block_type=None, hybrid_override_pattern=None),
     'no layer pattern'),
    ('tiny_hybrid', dict(moe_latent_size=32), 'moe_latent_size=32'),
    ('tiny_hybrid', dict(use_bias=True), 'use_bias'),
    ('tiny_hybrid', dict(mlp_bias=True), 'mlp_bias'),
    ('tiny_hybrid', dict(attention_bias=True), 'attention_bias'),
    ('tiny_hybrid', dict(mlp_hidden_act='silu'), 'mlp_hidden_act'),
    ('tiny_hybrid', dict(mamba_hidden_act='gelu'), 'mamba_hidden_act'),
    ('tiny_hybrid', dict(tie_word_embeddings=True), 'tie_word_embeddings'),
    ('tiny_hybrid', dict(n_shared_experts=2), 'n_shared_experts'),
    ('tiny_hybrid', dict(vocab_size=None), 'vocab_size'),
    ('tiny_moe', dict(use_sliding_window=True), 'sliding'),
    ('tiny_moe', dict(decoder_sparse_step=0), 'decoder_sparse_step'),
    ('tiny_moe', dict(attention_bias=True), 'attention_bias'),
    ('tiny_moe', dict(hidden_act='gelu'), 'gelu'),
])
def test_config_from_hf_errors(preset, change, match):
  cfg = hf.config_to_hf(config_lib.ModelConfig.preset(preset))
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf({**cfg, **change})


@pytest.mark.parametrize('make, match', [
    (lambda: config_lib.ModelConfig.tiny_hybrid(use_rope=True), 'use_rope'),
    (lambda: config_lib.ModelConfig.tiny_hybrid(shared_expert_dim=0), 'shared_expert_dim'),
    (lambda: config_lib.ModelConfig.tiny_hybrid(tie_embeddings=True), 'tie_embeddings'),
    (lambda: config_lib.ModelConfig.tiny_hybrid(mamba_dt_max=1.0), 'mamba_dt_max'),
    (lambda: config_lib.ModelConfig.tiny_moe(router='sigmoid'), 'router'),
    (lambda: config_lib.ModelConfig.tiny_moe(routed_scaling=2.0), 'routed_scaling'),
    (lambda: config_lib.ModelConfig.tiny_moe(shared_expert_dim=8), 'shared_expert_dim'),
    (lambda: config_lib.ModelConfig.tiny_moe(use_rope=False), 'use_rope'),
    (lambda: config_lib.ModelConfig.tiny(mlp_activation='relu2'), 'mlp_activation'),
])
def test_config_to_hf_rejects_unrepresentable(make, match):
  with pytest.raises(ValueError, match=match):
    hf.config_to_hf(make())


# ---- checkpoint errors ----


def _with_config(src: pathlib.Path, dst: pathlib.Path, **change) -> pathlib.Path:
  if not dst.exists():
    shutil.copytree(src, dst)
  cfg = json.loads((dst / 'config.json').read_text())
  cfg.update(change)
  (dst / 'config.json').write_text(json.dumps(cfg))
  return dst


def test_error_expert_count_per_expert_layout(ckpts, tmp_path):
  path = ckpts[NEMOTRON].path
  with pytest.raises(ValueError, match=r'unexpected tensor.*experts\.4\..*the expert count '
                                       r'differs: the checkpoint holds 8 experts per layer, '
                                       r'the config 4 \(n_routed_experts\)'):
    hf.load_model(_with_config(path, tmp_path / 'fewer', n_routed_experts=4))
  with pytest.raises(ValueError, match=r'missing.*experts\.8\..*the checkpoint holds 8 '
                                       r'experts per layer, the config 16'):
    hf.load_model(_with_config(path, tmp_path / 'more', n_routed_experts=16))


@pytest.mark.parametrize('name, match', [
    (NEMOTRON, r"'model\.layers\.1\.mixer\.experts\.up_proj' has shape \(8, 16, 48\), "
               r'but the config needs \(4, 16, 48\)'),
    (QWEN, r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' has shape \(8, 32, 48\), "
           r'but the config needs \(4, 32, 48\)'),
])
def test_error_expert_count_fused_layout(ckpts, tmp_path, name, match):
  ckpt = _write_fused(ckpts[name], tmp_path / 'fused')
  key = 'n_routed_experts' if name == NEMOTRON else 'num_local_experts'
  assert key in json.loads((ckpt / 'config.json').read_text())
  with pytest.raises(ValueError, match=match):
    hf.load_model(_with_config(ckpt, ckpt, **{key: 4}))


def test_error_unexpected_and_missing_tensors(ckpts, tmp_path):
  path = ckpts[NEMOTRON].path
  ckpt = tmp_path / 'c'
  shutil.copytree(path, ckpt)
  tensors = _tensors(path)
  tensors.pop('backbone.layers.0.mixer.conv1d.bias')
  safetensors.numpy.save_file(tensors, str(ckpt / 'model.safetensors'),
                              metadata={'format': 'pt'})
  with pytest.raises(ValueError, match=r'missing.*backbone\.layers\.0\.mixer\.conv1d\.bias'):
    hf.load_model(ckpt)
  # The same checkpoint under a config without conv biases has one tensor too many.
  bias_free = _with_config(path, tmp_path / 'd', use_conv_bias=False)
  with pytest.raises(ValueError, match=r'unexpected.*conv1d\.bias'):
    hf.load_model(bias_free)
