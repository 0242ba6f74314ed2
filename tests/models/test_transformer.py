"""Transformer: KV-cache equivalence, packing isolation, families, sharding on 8 CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import sharding
from models import transformer

FAMILIES = {
    'qwen3': config_lib.ModelConfig.tiny(),
    'qwen2': config_lib.ModelConfig.tiny(family='qwen2', qk_norm=False, qkv_bias=True,
                                         tie_embeddings=False),
    'llama': config_lib.ModelConfig.tiny(family='llama', qk_norm=False, num_kv_heads=1,
                                         rope_theta=500_000.0, tie_embeddings=False),
}


def _tokens(b=2, t=12, seed=1, vocab=256):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab, dtype=jnp.int32)


@pytest.mark.parametrize('family', [
    pytest.param(f, marks=() if f == 'qwen3' else pytest.mark.heavy) for f in sorted(FAMILIES)])
def test_prefill_then_decode_equals_full_forward(family):
  cfg = FAMILIES[family]
  model = transformer.create(cfg, seed=0)
  # Give the biases non-zero values so the Qwen2 path is really exercised.
  for path, v in nnx.iter_graph(model):
    if isinstance(v, nnx.Param) and 'bias' in str(path[-1]):
      v.value = jax.random.normal(jax.random.key(3), v.value.shape) * 0.1
  tokens = _tokens()
  full = model(tokens)
  cache = transformer.init_cache(cfg, 2, 20)
  logits, cache = model(tokens[:, :7], cache=cache)
  outs = [logits]
  for i in range(7, tokens.shape[1]):
    logits, cache = model(tokens[:, i:i + 1], cache=cache)
    outs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5, rtol=0)
  assert int(cache.index) == tokens.shape[1]


@pytest.mark.parametrize('family', [
    pytest.param(f, marks=() if f == 'qwen3' else pytest.mark.heavy) for f in sorted(FAMILIES)])
def test_unrolled_layers_over_per_layer_caches_equal_the_stack(family):
  # The unrolled decode layout (each block's sliced weights, one cache buffer per layer)
  # computes what the scanned stack does, and writes the same keys and values.
  cfg = FAMILIES[family].replace(scan_layers=True)
  model = transformer.create(cfg, seed=0)
  tokens = _tokens()
  cache = transformer.init_cache(cfg, 2, 16)
  _, cache = model(tokens[:, :7], cache=cache)
  stacked, split, layers = cache, transformer.unstack_cache(cache), model.layer_states()
  assert len(split.k) == cfg.num_layers and split.k[0].shape == cache.k.shape[1:]
  for i in range(7, 12):
    want, stacked = model(tokens[:, i:i + 1], cache=stacked)
    got, split = model(tokens[:, i:i + 1], cache=split, layers=layers)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  np.testing.assert_allclose(jnp.stack(split.k), stacked.k, atol=1e-6, rtol=0)
  np.testing.assert_allclose(jnp.stack(split.v), stacked.v, atol=1e-6, rtol=0)
  assert int(split.index) == 12
  with pytest.raises(ValueError, match='unstack_cache layout'):
    model(tokens[:, :1], cache=stacked, layers=layers)


@pytest.mark.heavy
def test_left_padded_prefill_matches_unpadded():
  cfg = config_lib.ModelConfig.tiny()
  model = transformer.create(cfg, seed=0)
  tokens = _tokens(1, 6)
  ref = model(tokens)
  pad = 3
  padded = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), tokens], 1)
  seg = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), jnp.ones((1, 6), jnp.int32)], 1)
  pos = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), jnp.arange(6)[None]], 1)
  cache = transformer.init_cache(cfg, 1, 16)
  logits, cache = model(padded, pos, seg, cache=cache)
  np.testing.assert_allclose(logits[:, pad:], ref, atol=1e-5, rtol=0)
  nxt, _ = model(tokens[:, :1], jnp.array([[6]]), cache=cache)
  ref2 = model(jnp.concatenate([tokens, tokens[:, :1]], 1))[:, -1:]
  np.testing.assert_allclose(nxt, ref2, atol=1e-5, rtol=0)


@pytest.mark.heavy
def test_packed_segments_do_not_attend_across():
  cfg = config_lib.ModelConfig.tiny()
  model = transformer.create(cfg, seed=0)
  a, b = _tokens(1, 5, seed=4), _tokens(1, 7, seed=5)
  packed = jnp.concatenate([a, b, jnp.zeros((1, 4), jnp.int32)], 1)
  seg = jnp.array([[1] * 5 + [2] * 7 + [0] * 4])
  pos = jnp.array([list(range(5)) + list(range(7)) + [0] * 4])
  out = model(packed, pos, seg)
  np.testing.assert_allclose(out[:, :5], model(a), atol=1e-5, rtol=0)
  np.testing.assert_allclose(out[:, 5:12], model(b), atol=1e-5, rtol=0)
  # Changing segment b's tokens leaves segment a untouched.
  packed2 = packed.at[:, 6].set((packed[0, 6] + 1) % 256)
  np.testing.assert_allclose(model(packed2, pos, seg)[:, :5], out[:, :5], atol=0, rtol=0)


def test_param_count_and_presets():
  cfg = config_lib.ModelConfig.tiny()
  model = transformer.create(cfg)
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == cfg.num_params()
  # Published sizes: Qwen3-8B ~8.2B, Qwen3-14B ~14.8B, Llama-3-8B ~8.0B.
  assert 8.1e9 < config_lib.ModelConfig.qwen3_8b().num_params() < 8.3e9
  assert 14.7e9 < config_lib.ModelConfig.qwen3_14b().num_params() < 14.9e9
  assert 7.9e9 < config_lib.ModelConfig.llama3_8b().num_params() < 8.1e9
  assert 0.5e9 < config_lib.ModelConfig.qwen3_0_6b().num_params() < 0.65e9
  with pytest.raises(ValueError, match='num_kv_heads'):
    config_lib.ModelConfig.tiny(num_heads=4, num_kv_heads=3)


@pytest.mark.heavy
def test_bf16_compute_and_remat_gradients_match():
  cfg = config_lib.ModelConfig.tiny()
  tokens = _tokens()

  def loss(model):
    return jnp.mean(model(tokens) ** 2)

  g_plain = nnx.grad(loss)(transformer.create(cfg))
  g_remat = nnx.grad(loss)(transformer.create(cfg.replace(remat=True)))
  for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  bf = transformer.create(cfg.replace(dtype='bfloat16'))
  out = bf(tokens)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, transformer.create(cfg)(tokens), atol=0.05)


@pytest.mark.parametrize('remat', ['none', 'full'])
def test_chunked_mlp_equals_whole(remat):
  # 29 positions in chunks of 8: three full chunks and a padded one; packed rows.
  cfg = config_lib.ModelConfig.tiny(remat=remat)
  tokens = _tokens(2, 29)
  seg = jnp.ones((2, 29), jnp.int32).at[1, 11:].set(2).at[0, :3].set(0)

  def loss_and_logits(model):
    logits = model(tokens, segment_ids=seg)
    return jnp.sum(jnp.where(seg[..., None] != 0, logits, 0.) ** 2), logits

  outs = {}
  for chunk in (0, 8):
    model = transformer.create(cfg.replace(mlp_chunk=chunk), seed=0)
    (_, logits), grads = nnx.value_and_grad(loss_and_logits, has_aux=True)(model)
    outs[chunk] = (logits, grads)
  np.testing.assert_allclose(outs[8][0], outs[0][0], atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(outs[8][1]), jax.tree.leaves(outs[0][1])):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)
  # A pass no longer than the chunk is not chunked; a bad chunk is refused by name.
  with pytest.raises(ValueError, match='mlp_chunk=-1'):
    cfg.replace(mlp_chunk=-1)


def test_chunked_mlp_holds_no_whole_activation():
  # The chunk loop is what bounds memory: no [B, T, mlp_dim] buffer in the program
  # (B=3, T=80 and mlp_dim=96 appear in no parameter's shape).
  cfg = config_lib.ModelConfig.tiny(mlp_dim=96, mlp_chunk=16, remat='full')
  tokens = _tokens(3, 80)
  whole = re.compile(r'\[(3,80|240),96\]')

  def program(chunk):
    graphdef, params = nnx.split(transformer.create(cfg.replace(mlp_chunk=chunk), seed=0))
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
    return jax.jit(jax.grad(loss)).lower(params).compile().as_text()

  assert not whole.search(program(16))
  assert whole.search(program(0))          # the check can fail


@pytest.mark.heavy
@pytest.mark.parametrize('shape', [(8, 1, 1), (1, 8, 1), (2, 2, 2)])
def test_sharded_forward_matches_unsharded(shape):
  assert jax.device_count() >= 8
  cfg = config_lib.ModelConfig.tiny(num_heads=8, num_kv_heads=4, embed_dim=64, mlp_dim=128)
  ref_model = transformer.create(cfg, seed=0)
  tokens = _tokens(8, 12)
  ref = ref_model(tokens)
  mesh = sharding.make_mesh(shape)
  model = transformer.create(cfg, seed=0, mesh=mesh)
  graphdef, state = nnx.split(model)
  with sharding.use_mesh(mesh):
    out = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)

  sizes = dict(zip(sharding.MESH_AXES, shape))
  mlp = model.layers.mlp.gate_proj.value   # ('layers', 'embed', 'mlp') -> (None, 'fsdp', 'tensor')
  q = model.layers.attn.q_proj.value       # ('layers', 'embed', 'heads', 'head_dim')
  emb = model.embed.value                  # ('vocab', 'embed') -> ('tensor', 'fsdp')
  exp = jax.sharding.PartitionSpec
  assert mlp.sharding.spec == exp(None, 'fsdp', 'tensor')
  assert q.sharding.spec == exp(None, 'fsdp', 'tensor', None)
  assert emb.sharding.spec == exp('tensor', 'fsdp')
  split = sizes['fsdp'] * sizes['tensor']
  shard_shape = mlp.addressable_shards[0].data.shape
  assert shard_shape[0] == cfg.num_layers
  assert np.prod(shard_shape) * split == mlp.size
  np.testing.assert_allclose(np.asarray(mlp), np.asarray(ref_model.layers.mlp.gate_proj.value),
                             atol=1e-6)


def test_indivisible_axis_is_replicated():
  mesh = sharding.make_mesh((1, 1, 8))
  spec = sharding.logical_to_spec(('kv_heads', 'head_dim'), (2, 16), mesh)
  assert spec == jax.sharding.PartitionSpec(None, None)
  spec = sharding.logical_to_spec(('batch', 'embed'), (16, 64), sharding.make_mesh((2, 4, 1)))
  assert spec == jax.sharding.PartitionSpec(('data', 'fsdp'), None)
