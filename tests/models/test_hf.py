"""HF interop: parity with transformers' PyTorch models, export, round trips, mesh load, errors."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from flax import nnx

from models import config as config_lib
from models import hf
from models import sharding

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

_COMMON = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
               num_attention_heads=4)
# GQA everywhere; head_dim 16 != hidden/heads (12) for Qwen3; non-default thetas.
FAMILIES = {
    'qwen3_tied': lambda: transformers.Qwen3Config(
        **_COMMON, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_parameters={'rope_type': 'default', 'rope_theta': 5_000.0}),
    'qwen2_untied': lambda: transformers.Qwen2Config(
        **_COMMON, num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={'rope_type': 'default', 'rope_theta': 20_000.0}),
    'llama_untied': lambda: transformers.LlamaConfig(
        **_COMMON, num_key_value_heads=1, tie_word_embeddings=False,
        rope_parameters={'rope_type': 'default', 'rope_theta': 500_000.0}),
}
TOKENS = np.random.RandomState(0).randint(0, 96, (2, 11)).astype(np.int32)


def _torch_logits(model) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()


def _logits(model) -> np.ndarray:
  return np.asarray(model(jnp.asarray(TOKENS)))


@pytest.fixture(scope='module')
def ckpts(tmp_path_factory):
  """family -> (checkpoint dir, reference logits) of a randomly initialised HF model."""
  out = {}
  for i, (name, make_cfg) in enumerate(FAMILIES.items()):
    torch.manual_seed(i)
    model = transformers.AutoModelForCausalLM.from_config(make_cfg()).eval()
    # HF initialises norms to 1 and biases to 0; perturb every parameter so a
    # swapped or mis-laid-out tensor changes the logits.
    with torch.no_grad():
      for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    out[name] = (path, _torch_logits(model))
  return out


def _params(model) -> dict:
  return {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_load_matches_transformers(ckpts, family):
  path, ref = ckpts[family]
  model = hf.load_model(path)
  hf_cfg = json.loads((path / 'config.json').read_text())
  assert model.cfg.rope_theta == hf_cfg['rope_parameters']['rope_theta']
  assert model.cfg.tie_embeddings == hf_cfg['tie_word_embeddings']
  assert model.cfg.num_kv_heads < model.cfg.num_heads
  np.testing.assert_allclose(_logits(model), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_save_model_loads_in_transformers(ckpts, family, tmp_path):
  path, ref = ckpts[family]
  hf.save_model(hf.load_model(path), tmp_path)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  assert type(back).__name__ == json.loads((path / 'config.json').read_text())['architectures'][0]
  np.testing.assert_allclose(_torch_logits(back), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_load_save_load_is_bit_identical(ckpts, family, tmp_path):
  path, _ = ckpts[family]
  first = _params(hf.load_model(path))
  hf.save_model(hf.load_model(path), tmp_path)
  second = _params(hf.load_model(tmp_path))
  assert first.keys() == second.keys()
  for k in first:
    assert first[k].dtype == second[k].dtype
    np.testing.assert_array_equal(first[k], second[k], err_msg=str(k))
  # The HF tensors themselves survive unchanged too.
  with safetensors.safe_open(str(path / 'model.safetensors'), 'numpy') as a, \
       safetensors.safe_open(str(tmp_path / 'model.safetensors'), 'numpy') as b:
    assert set(a.keys()) == set(b.keys())
    for k in a.keys():
      np.testing.assert_array_equal(a.get_tensor(k), b.get_tensor(k), err_msg=k)


def test_transformers_sharded_checkpoint_loads(ckpts, tmp_path):
  path, ref = ckpts['qwen2_untied']
  model = transformers.AutoModelForCausalLM.from_pretrained(path)
  model.save_pretrained(tmp_path, max_shard_size='40KB')
  shards = sorted(p.name for p in tmp_path.glob('model-*.safetensors'))
  assert len(shards) > 2 and (tmp_path / hf.INDEX_FILE).exists()
  np.testing.assert_allclose(_logits(hf.load_model(tmp_path)), ref, atol=1e-4, rtol=0)


def test_save_model_shards_and_replaces_stale_files(ckpts, tmp_path):
  path, ref = ckpts['llama_untied']
  model = hf.load_model(path)
  hf.save_model(model, tmp_path, max_shard_size=30_000)
  shards = sorted(tmp_path.glob('model-*-of-*.safetensors'))
  assert len(shards) > 2
  assert all(p.stat().st_size < 30_000 + 1024 for p in shards)  # + the JSON header.
  index = json.loads((tmp_path / hf.INDEX_FILE).read_text())
  assert set(index['weight_map'].values()) == {p.name for p in shards}
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  np.testing.assert_allclose(_torch_logits(back), ref, atol=1e-4, rtol=0)
  np.testing.assert_allclose(_logits(hf.load_model(tmp_path)), ref, atol=1e-4, rtol=0)
  # A single-file save into the same directory must not leave the old index behind.
  hf.save_model(model, tmp_path)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['config.json', 'model.safetensors']


def test_bfloat16_saved_as_bfloat16(ckpts, tmp_path):
  path, ref = ckpts['qwen3_tied']
  model = hf.load_model(path, dtype=jnp.bfloat16)
  assert model.cfg.param_dtype == 'bfloat16' and model.embed.get_value().dtype == jnp.bfloat16
  hf.save_model(model, tmp_path)
  with safetensors.safe_open(str(tmp_path / 'model.safetensors'), 'numpy') as fh:
    assert {fh.get_slice(k).get_dtype() for k in fh.keys()} == {'BF16'}
  assert json.loads((tmp_path / 'config.json').read_text())['dtype'] == 'bfloat16'
  again = hf.load_model(tmp_path)  # Default dtype: the checkpoint's.
  assert again.cfg.param_dtype == 'bfloat16'
  for k, v in _params(again).items():
    np.testing.assert_array_equal(v, _params(model)[k], err_msg=str(k))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
  assert back.dtype == torch.bfloat16
  np.testing.assert_allclose(_torch_logits(back), ref, atol=0.1, rtol=0)


def test_load_onto_mesh_is_sharded_and_equal(ckpts, tmp_path):
  path, ref = ckpts['llama_untied']
  mesh = sharding.make_mesh((2, 2, 2))
  model = hf.load_model(path, mesh=mesh)
  spec = jax.sharding.PartitionSpec
  q = model.layers.attn.q_proj.get_value()     # [L, D, N, H], the layers' stack
  assert q.sharding.spec == spec(None, 'fsdp', 'tensor', None)
  assert q.addressable_shards[0].data.shape == (q.shape[0], 48 // 2, 4 // 2, 12)
  head = model.lm_head.get_value()
  assert head.sharding.spec == spec('fsdp', 'tensor')
  assert head.addressable_shards[0].data.size * 4 == head.size
  assert len(head.sharding.device_set) == 8
  with sharding.use_mesh(mesh):
    logits = jax.jit(lambda m, t: m(t))(model, jnp.asarray(TOKENS))
  np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)
  # Saving gathers the shards back into the original HF tensors.
  hf.save_model(model, tmp_path)
  with safetensors.safe_open(str(path / 'model.safetensors'), 'numpy') as a, \
       safetensors.safe_open(str(tmp_path / 'model.safetensors'), 'numpy') as b:
    for k in a.keys():
      np.testing.assert_array_equal(a.get_tensor(k), b.get_tensor(k), err_msg=k)


@pytest.mark.parametrize('preset', ['tiny', 'qwen3_0_6b', 'qwen3_8b', 'llama3_8b'])
def test_config_round_trip(preset):
  cfg = config_lib.ModelConfig.preset(preset)
  assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg.replace(dtype=cfg.param_dtype)


def test_config_from_hf_defaults_and_legacy_fields():
  cfg = hf.config_from_hf({
      'architectures': ['LlamaForCausalLM'], 'vocab_size': 10, 'hidden_size': 64,
      'intermediate_size': 8, 'num_hidden_layers': 1, 'num_attention_heads': 8,
      'rope_theta': 1234.0, 'rope_scaling': None, 'torch_dtype': 'bfloat16'})
  assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == (8, 8, 1234.0)
  assert (cfg.param_dtype, cfg.tie_embeddings, cfg.max_seq_len) == ('bfloat16', False, 2048)


def _base_cfg(**kw):
  return {**hf.config_to_hf(config_lib.ModelConfig.tiny(family='llama', qk_norm=False)), **kw}


@pytest.mark.parametrize('change, match', [
    (dict(architectures=['MistralForCausalLM']), 'MistralForCausalLM'),
    (dict(rope_parameters={'rope_type': 'dynamic', 'rope_theta': 5e5, 'factor': 8.0}),
     "'dynamic' is not supported"),
    (dict(rope_parameters=None, rope_scaling={'type': 'longrope', 'factor': 4.0}), 'longrope'),
    (dict(rope_parameters={'rope_type': 'llama3', 'rope_theta': 5e5, 'factor': 8.0}),
     "'llama3' needs 'low_freq_factor'"),
    (dict(attention_bias=True), 'o_proj'),
    (dict(use_sliding_window=True), 'sliding'),
    (dict(hidden_act='gelu'), 'gelu'),
    (dict(vocab_size=None), 'vocab_size'),
    (dict(dtype='int8', torch_dtype=None), 'int8'),
])
def test_config_from_hf_errors(change, match):
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(_base_cfg(**change))


def test_config_to_hf_rejects_unrepresentable():
  with pytest.raises(ValueError, match='qk_norm'):
    hf.config_to_hf(config_lib.ModelConfig.tiny(family='llama', qk_norm=True))


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
  shutil.copytree(src, dst)
  return dst


def _rewrite(ckpt: pathlib.Path, edit):
  f = ckpt / 'model.safetensors'
  with safetensors.safe_open(str(f), 'numpy') as fh:
    tensors = {k: fh.get_tensor(k) for k in fh.keys()}
  edit(tensors)
  safetensors.numpy.save_file(tensors, str(f), metadata={'format': 'pt'})


def test_error_unsupported_architecture(ckpts, tmp_path):
  ckpt = _copy(ckpts['qwen3_tied'][0], tmp_path / 'c')
  cfg = json.loads((ckpt / 'config.json').read_text())
  cfg['architectures'] = ['GPT2LMHeadModel']
  (ckpt / 'config.json').write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match='GPT2LMHeadModel'):
    hf.load_model(ckpt)


def test_error_shape_mismatch_names_tensor_and_shapes(ckpts, tmp_path):
  ckpt = _copy(ckpts['qwen2_untied'][0], tmp_path / 'c')
  cfg = json.loads((ckpt / 'config.json').read_text())
  cfg['intermediate_size'] = 64
  (ckpt / 'config.json').write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
                                       r'\(80, 48\), but the config needs \(64, 48\)'):
    hf.load_model(ckpt)


def test_error_missing_shard_file(ckpts, tmp_path):
  model = hf.load_model(ckpts['qwen2_untied'][0])
  hf.save_model(model, tmp_path, max_shard_size=30_000)
  victim = sorted(tmp_path.glob('model-*-of-*.safetensors'))[1]
  victim.unlink()
  with pytest.raises(FileNotFoundError, match=victim.name):
    hf.load_model(tmp_path)


def test_error_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match='config.json'):
    hf.load_model(tmp_path)
  (tmp_path / 'config.json').write_text(json.dumps(_base_cfg()))
  with pytest.raises(FileNotFoundError, match='model.safetensors'):
    hf.load_model(tmp_path)


def test_error_missing_key(ckpts, tmp_path):
  ckpt = _copy(ckpts['llama_untied'][0], tmp_path / 'c')
  _rewrite(ckpt, lambda t: t.pop('model.layers.1.self_attn.v_proj.weight'))
  with pytest.raises(ValueError, match=r'missing.*model\.layers\.1\.self_attn\.v_proj\.weight'):
    hf.load_model(ckpt)


def test_error_unexpected_key(ckpts, tmp_path):
  ckpt = _copy(ckpts['llama_untied'][0], tmp_path / 'c')
  _rewrite(ckpt, lambda t: t.update({'model.layers.0.self_attn.o_proj.bias':
                                     np.zeros(48, np.float32)}))
  with pytest.raises(ValueError, match=r'unexpected.*o_proj\.bias'):
    hf.load_model(ckpt)


def test_tied_checkpoint_with_lm_head(ckpts, tmp_path):
  path, ref = ckpts['qwen3_tied']
  ckpt = _copy(path, tmp_path / 'c')
  _rewrite(ckpt, lambda t: t.update({'lm_head.weight': t['model.embed_tokens.weight'].copy()}))
  np.testing.assert_allclose(_logits(hf.load_model(ckpt)), ref, atol=1e-4, rtol=0)
  _rewrite(ckpt, lambda t: t.update({'lm_head.weight': t['lm_head.weight'] + 1}))
  with pytest.raises(ValueError, match='lm_head.weight differs'):
    hf.load_model(ckpt)
