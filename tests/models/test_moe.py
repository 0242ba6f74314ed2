"""models/moe.py against a float64 numpy dense reference (every expert on every token), against
transformers' Qwen3-MoE and Nemotron-H blocks, and sharded (expert and tensor parallel) against
unsharded; plus models/sharding.py's optional 'expert' mesh axis."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import moe
from models import sharding

D, E, K, F, S = 16, 8, 2, 12, 10


def _cfg(**kw):
  base = dict(embed_dim=D, num_experts=E, experts_per_token=K, moe_dim=F, shared_expert_dim=0)
  return config_lib.ModelConfig.tiny_moe(**{**base, **kw})


def _model(cfg, seed=0, scale=0.4):
  """(graphdef, params) of a MoE with O(1) random weights and a random score-correction bias
  (distinct routes), built from numpy: no eager op-by-op initialisation."""
  gd, st = nnx.split(nnx.eval_shape(lambda: moe.MoE(cfg, nnx.Rngs(0))))
  rng = np.random.default_rng(seed)
  return gd, {n: jnp.asarray(rng.normal(size=v.shape) * (0.3 if n == 'router_bias' else scale),
                             v.dtype)
              for n, v in sorted(nnx.to_pure_dict(st).items())}


@functools.cache
def _jitted(gd):
  return jax.jit(lambda p, x, token_mask, routing: nnx.merge(gd, p)(x, token_mask, routing))


def _call(m, x, token_mask=None, routing=None):
  """The layer (graphdef, params) on x, jitted."""
  return _jitted(m[0])(m[1], x, token_mask, routing)


def _params(m):
  return m[1]


def _x(b=3, t=5, seed=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(b, t, D)), jnp.float32)


def _np_route(cfg, p, x):
  """float64: (logits [N, E], scores [N, E], chosen [N, K]) without replay."""
  logits = x @ p['router']
  if cfg.router == 'softmax':
    z = np.exp(logits - logits.max(-1, keepdims=True))
    scores = z / z.sum(-1, keepdims=True)
    choice = scores.copy()
  else:
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + p['router_bias']
  g = cfg.router_groups
  if g > 1 and cfg.router_topk_groups < g:
    grouped = choice.reshape(len(x), g, E // g)
    group_score = -np.sort(-grouped, axis=-1)[..., :2].sum(-1)
    best = np.argsort(-group_score, axis=-1)[:, :cfg.router_topk_groups]
    keep = np.zeros_like(group_score, bool)
    np.put_along_axis(keep, best, True, axis=-1)
    choice = np.where(np.repeat(keep, E // g, axis=-1), choice, -np.inf)
  return logits, scores, np.argsort(-choice, axis=-1)[:, :cfg.experts_per_token]


def _np_mlp(cfg, x, up, down, gate=None):
  h = x @ up
  h = (gate_h := x @ gate) / (1 + np.exp(-gate_h)) * h if cfg.mlp_activation == 'swiglu' else (
      np.maximum(h, 0) ** 2)
  return h @ down


def np_moe(cfg, params, x, routing=None):
  """Dense float64 reference: every expert on every token, masked by the top-k choice.

  Returns (y [B, T, D], chosen [B, T, K])."""
  p = {n: np.asarray(v, np.float64) for n, v in params.items()}
  b, t, _ = x.shape
  xf = np.asarray(x, np.float64).reshape(b * t, D)
  _, scores, chosen = _np_route(cfg, p, xf)
  if routing is not None:
    chosen = np.asarray(routing).reshape(b * t, -1)
  w = np.take_along_axis(scores, chosen, -1)
  if cfg.router_norm_topk:
    w = w / (w.sum(-1, keepdims=True) + (1e-20 if cfg.router == 'sigmoid' else 0))
  w = w * cfg.routed_scaling
  combine = np.zeros((b * t, E))
  for j in range(chosen.shape[1]):
    np.add.at(combine, (np.arange(b * t), chosen[:, j]), w[:, j])
  every = np.stack([_np_mlp(cfg, xf, p['up'][e], p['down'][e],
                            p['gate'][e] if 'gate' in p else None) for e in range(E)])
  y = np.einsum('NE,END->ND', combine, every)
  if cfg.shared_expert_dim:
    y = y + _np_mlp(cfg, xf, p['shared_up'], p['shared_down'], p.get('shared_gate'))
  return y.reshape(b, t, D), chosen.reshape(b, t, -1)


CONFIGS = {
    'softmax_swiglu_norm': dict(router='softmax', mlp_activation='swiglu'),
    'softmax_swiglu_nonorm_shared_scaled': dict(router='softmax', router_norm_topk=False,
                                                shared_expert_dim=S, routed_scaling=2.0),
    'softmax_relu2_groups': dict(router='softmax', mlp_activation='relu2', router_groups=4,
                                 router_topk_groups=2, experts_per_token=3),
    'sigmoid_relu2_groups_shared': dict(router='sigmoid', mlp_activation='relu2',
                                        shared_expert_dim=S, router_groups=2,
                                        router_topk_groups=1, routed_scaling=2.5),
    'sigmoid_relu2_nonorm': dict(router='sigmoid', mlp_activation='relu2',
                                 router_norm_topk=False),
    'sigmoid_swiglu_groups_shared': dict(router='sigmoid', router_groups=2, router_topk_groups=1,
                                         shared_expert_dim=S),
}


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_matches_dense_reference(name):
  cfg = _cfg(**CONFIGS[name])
  m, x = _model(cfg), _x()
  out = _call(m, x)
  ref, chosen = np_moe(cfg, _params(m), x)
  np.testing.assert_array_equal(np.sort(np.asarray(out.indices), -1), np.sort(chosen, -1))
  assert out.indices.dtype == jnp.int32 and out.y.shape == x.shape
  np.testing.assert_allclose(out.y, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('name', ['sigmoid_relu2_groups_shared', 'softmax_relu2_groups'])
def test_group_limit_changes_the_choice(name):
  """The group limit is tested for real: without it the same weights choose other experts."""
  cfg = _cfg(**CONFIGS[name])
  m, x = _model(cfg), _x()
  free = _cfg(**{**CONFIGS[name], 'router_groups': 1, 'router_topk_groups': 1})
  ungrouped = (_model(free)[0], _params(m))
  a, b = np.sort(_call(m, x).indices, -1), np.sort(_call(ungrouped, x).indices, -1)
  assert (a != b).any()
  np.testing.assert_array_equal(a, np.sort(np_moe(cfg, _params(m), x)[1], -1))


def test_router_bias_steers_the_choice_not_the_weights():
  cfg = _cfg(**CONFIGS['sigmoid_relu2_nonorm'])
  m, x = _model(cfg), _x()
  params = _params(m)
  params['router_bias'] = jnp.zeros(E).at[3].set(10.0)      # expert 3 always chosen
  out = _call((m[0], params), x)
  assert (np.asarray(out.indices) == 3).any(-1).all()
  np.testing.assert_allclose(out.y, np_moe(cfg, params, x)[0], atol=1e-5, rtol=1e-5)
  grads = jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(m[0], p)(x).y)))(params)
  assert not np.asarray(grads['router_bias']).any()           # no gradient reaches the bias
  assert np.asarray(grads['router']).any()


def _torch_block(kind, cfg, params):
  torch = pytest.importorskip('torch')
  t = lambda a: torch.tensor(np.asarray(a, np.float32))
  if kind == 'qwen3_moe':
    from transformers.models.qwen3_moe import configuration_qwen3_moe, modeling_qwen3_moe
    hf_cfg = configuration_qwen3_moe.Qwen3MoeConfig(
        hidden_size=D, num_experts=E, num_experts_per_tok=cfg.experts_per_token,
        moe_intermediate_size=F, norm_topk_prob=cfg.router_norm_topk)
    block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(hf_cfg).float()
    sd = {'gate.weight': t(params['router']).T,
          'experts.gate_up_proj': torch.cat([t(params['gate']).transpose(1, 2),
                                             t(params['up']).transpose(1, 2)], dim=1),
          'experts.down_proj': t(params['down']).transpose(1, 2)}
  else:
    from transformers.models.nemotron_h import configuration_nemotron_h, modeling_nemotron_h
    hf_cfg = configuration_nemotron_h.NemotronHConfig(
        hidden_size=D, n_routed_experts=E, num_experts_per_tok=cfg.experts_per_token,
        moe_intermediate_size=F, moe_shared_expert_intermediate_size=S,
        n_group=cfg.router_groups, topk_group=cfg.router_topk_groups,
        routed_scaling_factor=cfg.routed_scaling, norm_topk_prob=cfg.router_norm_topk,
        mlp_hidden_act='relu2')
    block = modeling_nemotron_h.NemotronHMoE(hf_cfg).float()
    sd = {'gate.weight': t(params['router']).T,
          'gate.e_score_correction_bias': t(params['router_bias']),
          'experts.up_proj': t(params['up']).transpose(1, 2),
          'experts.down_proj': t(params['down']).transpose(1, 2),
          'shared_experts.up_proj.weight': t(params['shared_up']).T,
          'shared_experts.down_proj.weight': t(params['shared_down']).T}
  missing, unexpected = block.load_state_dict(sd, strict=False)
  assert not unexpected and not [n for n in missing if 'latent' not in n], (missing, unexpected)
  return block


@pytest.mark.parametrize('kind,overrides', [
    ('qwen3_moe', dict(router='softmax', mlp_activation='swiglu')),
    ('qwen3_moe', dict(router='softmax', mlp_activation='swiglu', router_norm_topk=False)),
    ('nemotron_h', dict(router='sigmoid', mlp_activation='relu2', shared_expert_dim=S,
                        router_groups=2, router_topk_groups=1, routed_scaling=2.5)),
])
def test_matches_transformers(kind, overrides):
  torch = pytest.importorskip('torch')
  cfg = _cfg(**overrides)
  m, x = _model(cfg), _x()
  block = _torch_block(kind, cfg, _params(m))
  with torch.no_grad():
    ref = block(torch.tensor(np.asarray(x))).numpy()
  np.testing.assert_allclose(_call(m, x).y, ref, atol=1e-5, rtol=1e-5)


def test_aux_loss_matches_transformers_load_balancing():
  pytest.importorskip('torch')
  import torch
  from transformers.models.qwen3_moe import modeling_qwen3_moe
  cfg = _cfg(router='softmax')
  m, x = _model(cfg), _x()
  mask = np.ones((3, 5), np.int32)
  mask[0, 3:] = 0
  mask[2, :1] = 0
  out = _call(m, x, jnp.asarray(mask))
  logits = np.asarray(x).reshape(-1, D) @ np.asarray(_params(m)['router'])
  ref = modeling_qwen3_moe.load_balancing_loss_func(
      (torch.tensor(logits),), E, K, attention_mask=torch.tensor(mask))
  np.testing.assert_allclose(out.aux_loss, float(ref), rtol=1e-5)


@pytest.mark.parametrize('router', ['softmax', 'sigmoid'])
def test_aux_and_z_loss_match_numpy(router):
  cfg = _cfg(router=router)
  m, x = _model(cfg), _x()
  mask = np.ones((3, 5), np.float32)
  mask[1, 2:] = 0
  out = _call(m, x, jnp.asarray(mask))
  p = {n: np.asarray(v, np.float64) for n, v in _params(m).items()}
  xf, real = np.asarray(x, np.float64).reshape(-1, D), mask.reshape(-1) > 0
  logits, scores, chosen = _np_route(cfg, p, xf)
  probs = scores / scores.sum(-1, keepdims=True)
  frac = np.zeros(E)
  for row in chosen[real]:
    frac[row] += 1
  frac /= real.sum()
  aux = E * np.sum(frac * probs[real].mean(0))
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(out.aux_loss, aux, rtol=1e-5)
  np.testing.assert_allclose(out.z_loss, np.mean(lse[real] ** 2), rtol=1e-5)
  # Padding is left out: masking changes both statistics.
  whole = _call(m, x)
  assert abs(float(whole.aux_loss) - aux) > 1e-4 and abs(float(whole.z_loss) - out.z_loss) > 1e-4


def test_routing_replay():
  cfg = _cfg(**CONFIGS['sigmoid_relu2_groups_shared'])
  m, x = _model(cfg), _x()
  gd, params = m
  own = _call(m, x)
  replay = _call(m, x, routing=own.indices)
  np.testing.assert_array_equal(replay.y, own.y)
  np.testing.assert_array_equal(replay.indices, own.indices)

  other = (own.indices + 1) % E
  changed = _call(m, x, routing=other)
  assert np.abs(np.asarray(changed.y - own.y)).max() > 1e-3
  np.testing.assert_array_equal(changed.indices, other)
  np.testing.assert_allclose(changed.y, np_moe(cfg, params, x, routing=other)[0], atol=1e-5,
                             rtol=1e-5)
  # The replayed experts' weights are the router's: gradients reach it, and differ from the
  # gradients of the router's own routing.
  grad = jax.jit(jax.grad(lambda p, r: jnp.sum(nnx.merge(gd, p)(x, routing=r).y ** 2)))
  g_other, g_own = grad(params, other), grad(params, own.indices)
  assert np.abs(np.asarray(g_other['router'])).max() > 1e-4
  assert np.abs(np.asarray(g_other['router'] - g_own['router'])).max() > 1e-4


def test_routing_replay_bad_ids():
  cfg = _cfg()
  m, x = _model(cfg), _x()
  ids = np.zeros((3, 5, K), np.int32)
  layer = nnx.merge(*m)     # eager: concrete ids are checked before any computation
  with pytest.raises(ValueError, match=r'outside \[0, num_experts=8\)'):
    layer(x, routing=ids + E)
  with pytest.raises(ValueError, match=r'outside \[0, num_experts=8\)'):
    layer(x, routing=ids - 1)
  with pytest.raises(ValueError, match='expected'):
    layer(x, routing=ids[:, :, :1])
  with pytest.raises(ValueError, match='integer'):
    layer(x, routing=ids.astype(np.float32))
  # Traced: clipped into range.
  traced = _call(m, x, routing=jnp.asarray(ids + 100))
  np.testing.assert_array_equal(traced.indices, ids + E - 1)
  np.testing.assert_allclose(traced.y, _call(m, x, routing=jnp.asarray(ids + E - 1)).y,
                             atol=1e-6)


def _dense_jax(cfg, p, x, indices, mask):
  """float32 jax dense reference of the layer and its losses, given the experts chosen."""
  xf = x.reshape(-1, D)
  idx = indices.reshape(-1, indices.shape[-1])
  logits = xf @ p['router']
  if cfg.router == 'softmax':
    scores = jax.nn.softmax(logits)
    probs = scores
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / scores.sum(-1, keepdims=True)
  w = jnp.take_along_axis(scores, idx, -1)
  if cfg.router_norm_topk:
    w = w / (w.sum(-1, keepdims=True) + (1e-20 if cfg.router == 'sigmoid' else 0))
  combine = jnp.einsum('NK,NKE->NE', w * cfg.routed_scaling, jax.nn.one_hot(idx, E))

  def mlp(x, up, down, gate=None):
    h = x @ up
    h = jax.nn.silu(x @ gate) * h if cfg.mlp_activation == 'swiglu' else jax.nn.relu(h) ** 2
    return h @ down

  every = jax.vmap(lambda *w: mlp(xf, *w))(p['up'], p['down'], *(
      [p['gate']] if 'gate' in p else []))
  y = jnp.einsum('NE,END->ND', combine, every)
  if cfg.shared_expert_dim:
    y = y + mlp(xf, p['shared_up'], p['shared_down'], p.get('shared_gate'))
  real = mask.reshape(-1)
  frac = jnp.einsum('N,NE->E', real, jax.nn.one_hot(idx, E).sum(1)) / real.sum()
  aux = E * jnp.sum(frac * jnp.einsum('N,NE->E', real, probs) / real.sum())
  z = jnp.sum(real * jax.nn.logsumexp(logits, -1) ** 2) / real.sum()
  return y.reshape(x.shape), aux, z


def _loss(out_y, aux, z):
  return jnp.sum(jnp.sin(out_y)) + 0.3 * aux + 0.1 * z


@pytest.mark.parametrize('name,chunk', [('softmax_swiglu_nonorm_shared_scaled', 0),
                                        ('sigmoid_relu2_groups_shared', 0),
                                        # 15 tokens in chunks of 4: the last one padded
                                        ('sigmoid_relu2_groups_shared', 4)])
def test_gradients_match_dense(name, chunk):
  cfg = _cfg(**CONFIGS[name], moe_chunk=chunk)
  m, x = _model(cfg), _x()
  gd, params = m
  mask = jnp.ones((3, 5)).at[0, 4].set(0.0)
  indices = _call(m, x).indices

  def model_loss(p, x):
    out = nnx.merge(gd, p)(x, token_mask=mask)
    return _loss(out.y, out.aux_loss, out.z_loss)

  def dense_loss(p, x):
    p = dict(p, router_bias=jax.lax.stop_gradient(p['router_bias'])) if 'router_bias' in p else p
    return _loss(*_dense_jax(cfg, p, x, indices, mask))

  got = jax.jit(jax.value_and_grad(model_loss, (0, 1)))(params, x)
  want = jax.jit(jax.value_and_grad(dense_loss, (0, 1)))(params, x)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  got, want = got[1], want[1]
  for name_, g in got[0].items():
    np.testing.assert_allclose(g, want[0][name_], atol=1e-5, rtol=1e-4, err_msg=name_)
  np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=1e-4)


def test_compute_dtype_bfloat16():
  """bfloat16 compute: the router stays float32, the output is bfloat16 and close."""
  cfg = _cfg(**CONFIGS['sigmoid_swiglu_groups_shared'], dtype='bfloat16')
  m, x = _model(cfg), _x()
  out = _call(m, x)
  assert m[1]['router'].dtype == jnp.float32 and out.y.dtype == jnp.bfloat16
  ref, chosen = np_moe(cfg, _params(m), x)
  np.testing.assert_array_equal(np.sort(np.asarray(out.indices), -1), np.sort(chosen, -1))
  np.testing.assert_allclose(np.asarray(out.y, np.float32), ref, atol=0.1, rtol=0.05)


def test_grouped_matmul_gmm_kernel_interpret():
  """The megablox kernel (interpret mode off TPU) equals ragged_dot, rows past the groups
  included (zero output, no gradient)."""
  lhs = jax.random.normal(jax.random.key(0), (40, D))
  rhs = jax.random.normal(jax.random.key(1), (4, D, F))
  sizes = jnp.array([5, 0, 17, 9], jnp.int32)           # 31 of 40 rows in groups
  ref = np.zeros((40, F))
  start = 0
  for g, n in enumerate(np.asarray(sizes)):
    ref[start:start + n] = np.asarray(lhs[start:start + n]) @ np.asarray(rhs[g])
    start += n

  @jax.jit
  def run(lhs, rhs):
    out = {impl: moe.grouped_matmul(lhs, rhs, sizes, impl) for impl in moe.GROUPED_MATMUL_IMPLS}
    grads = {impl: jax.grad(lambda a, b: jnp.sum(jnp.sin(moe.grouped_matmul(a, b, sizes, impl))),
                            (0, 1))(lhs, rhs) for impl in moe.GROUPED_MATMUL_IMPLS}
    return out, grads

  out, grads = run(lhs, rhs)
  for impl in moe.GROUPED_MATMUL_IMPLS:
    np.testing.assert_allclose(out[impl], ref, atol=1e-5)
  g_gmm, g_ref = grads['gmm'], grads['ragged_dot']
  for a, b in zip(g_gmm, g_ref):
    assert np.isfinite(np.asarray(a)).all()
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert not np.asarray(g_gmm[0][31:]).any()
  with pytest.raises(ValueError, match='impl'):
    moe.grouped_matmul(lhs, rhs, sizes, 'dense')


def _grouped_reference(lhs, rhs, sizes, gy):
  """numpy float64: the grouped product, its input and weight gradients for cotangent gy."""
  lhs, rhs, gy = (np.asarray(a, np.float64) for a in (lhs, rhs, gy))
  out, dl, dr = np.zeros((lhs.shape[0], rhs.shape[2])), np.zeros_like(lhs), np.zeros_like(rhs)
  start = 0
  for g, n in enumerate(np.asarray(sizes)):
    rows = slice(start, start + n)
    out[rows], dl[rows], dr[g] = lhs[rows] @ rhs[g], gy[rows] @ rhs[g].T, lhs[rows].T @ gy[rows]
    start += n
  return out, dl, dr


@pytest.mark.parametrize('tile', [1, 3, 8, 64])
def test_tiled_matmul_equals_float64_forward_and_both_gradients(tile):
  """The GPU path's tile loops (`tiled_matmul`): any group sizes (empty groups, groups
  sharing a tile, rows past the groups), tiles of one row to all of them, against numpy in
  float64: the output, the input gradient and the weight gradient."""
  rng = np.random.default_rng(tile)
  for _ in range(6):
    g = int(rng.integers(1, 7))
    sizes = rng.integers(0, 14, g) * rng.integers(0, 2, g)
    m = -(-(int(sizes.sum()) + int(rng.integers(0, 9)) or 1) // tile) * tile
    lhs = rng.normal(size=(m, 5)).astype(np.float32)
    rhs = rng.normal(size=(g, 5, 7)).astype(np.float32)
    gy = rng.normal(size=(m, 7)).astype(np.float32)
    out, vjp = jax.vjp(lambda a, b: moe.tiled_matmul(a, b, jnp.asarray(sizes, jnp.int32), tile),
                       lhs, rhs)
    got = (out, *vjp(jnp.asarray(gy)))
    for a, b in zip(got, _grouped_reference(lhs, rhs, sizes, gy)):
      np.testing.assert_allclose(np.asarray(a), b, atol=2e-5, rtol=2e-5)


def test_tiled_matmul_visits_each_tile_once_per_group_in_it():
  """The schedule: every (tile, group) intersection exactly once, in row order, within the
  static bound of M / tile + G - 1 visits."""
  sizes, t = np.array([5, 0, 3, 8, 0, 1]), 4           # rows 0-4 | 5-7 | 8-15 | 16; M = 20
  tile, group, _, _, valid = (np.asarray(a) for a in moe._visits(jnp.asarray(sizes), 20, t))
  assert len(tile) == 20 // t + len(sizes) - 1
  got = [(int(a), int(b)) for a, b, ok in zip(tile, group, valid) if ok]
  assert got == [(0, 0), (1, 0), (1, 2), (2, 3), (3, 3), (4, 5)]


@pytest.mark.parametrize('platform', ['tpu', 'gpu', 'cpu'])
def test_grouped_matmul_is_chosen_by_the_mesh_platform(platform, pallas_interpret_flags):
  """Tracing for a TPU mesh (a TPU topology planned from a CPU host, as launch.plan does) picks
  the megablox kernel as a real Mosaic kernel, forward and backward; a GPU mesh the tile loops,
  with no ragged_dot in either pass (XLA:GPU would expand it densely); a CPU mesh picks
  ragged_dot (no kernel)."""
  device = jax.sharding.AbstractDevice(device_kind=platform, num_cores=None, platform=platform)
  mesh = jax.sharding.AbstractMesh((1, 1, 1), ('data', 'fsdp', 'tensor'),
                                   axis_types=(jax.sharding.AxisType.Auto,) * 3,
                                   abstract_device=device)
  lhs, rhs = jnp.ones((256, 128)), jnp.ones((4, 128, 128))
  sizes = jnp.array([64, 64, 64, 64], jnp.int32)
  loss = lambda a, b: jnp.sum(moe.grouped_matmul(a, b, sizes))
  with jax.sharding.use_abstract_mesh(mesh):
    forward = pallas_interpret_flags(lambda a, b: moe.grouped_matmul(a, b, sizes), lhs, rhs)
    backward = pallas_interpret_flags(jax.grad(loss, (0, 1)), lhs, rhs)
  if platform == 'tpu':
    assert forward == [False] and backward and not any(backward)
  else:
    assert forward == backward == []
  with jax.sharding.use_abstract_mesh(mesh):
    text = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(lhs, rhs))
  assert ('ragged_dot' in text) == (platform == 'cpu')
  if platform != 'tpu':      # (megablox has loops of its own)
    assert ('scan' in text) == (platform == 'gpu')     # fori_loop with static bounds


@pytest.mark.parametrize('impl', ['gmm', 'tiled'])
def test_layer_with_gmm_kernel(monkeypatch, impl):
  """The layer through the TPU kernel's path, or the GPU's tile loops (what those backends
  pick), equals ragged_dot's, forward and the parameters' gradient."""
  cfg = _cfg(**CONFIGS['softmax_swiglu_nonorm_shared_scaled'])
  m, x = _model(cfg), _x(2, 4)
  loss = lambda p, x: jnp.sum(jnp.sin(nnx.merge(m[0], p)(x).y))
  ref, ref_grad = _call(m, x).y, jax.grad(loss)(m[1], x)
  calls = []
  monkeypatch.setattr(moe, '_default_impl', lambda: calls.append(1) or impl)
  fresh = jax.jit(lambda p, x: nnx.merge(m[0], p)(x).y)     # traced anew, with the kernel
  np.testing.assert_allclose(fresh(m[1], x), ref, atol=1e-5)
  assert calls
  if impl == 'tiled':     # (the megablox kernel's gradient: test_grouped_matmul_gmm_kernel)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
                 jax.jit(jax.grad(loss))(m[1], x), ref_grad)


def test_params_shapes_axes_dtypes():
  """The layout the HF converter relies on (module docstring)."""
  def layout(**kw):
    layer = nnx.eval_shape(lambda: moe.MoE(_cfg(param_dtype='bfloat16', **kw), nnx.Rngs(0)))
    return {n: (v.shape, v.dtype, v.get_metadata()['logical_axes'])
            for n, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))
            for n in ['.'.join(map(str, n))]}
  bf, f32 = jnp.bfloat16, jnp.float32
  assert layout(router='softmax', mlp_activation='swiglu') == {
      'router': ((D, E), f32, ('embed', None)),
      'gate': ((E, D, F), bf, ('experts', 'embed', 'moe_mlp')),
      'up': ((E, D, F), bf, ('experts', 'embed', 'moe_mlp')),
      'down': ((E, F, D), bf, ('experts', 'moe_mlp', 'embed'))}
  assert layout(router='sigmoid', mlp_activation='relu2', shared_expert_dim=S) == {
      'router': ((D, E), f32, ('embed', None)),
      'router_bias': ((E,), f32, (None,)),
      'up': ((E, D, F), bf, ('experts', 'embed', 'moe_mlp')),
      'down': ((E, F, D), bf, ('experts', 'moe_mlp', 'embed')),
      'shared_up': ((D, S), bf, ('embed', 'mlp')),
      'shared_down': ((S, D), bf, ('mlp', 'embed'))}
  assert set(layout(router='softmax', shared_expert_dim=S)) == {
      'router', 'gate', 'up', 'down', 'shared_gate', 'shared_up', 'shared_down'}


# Sharded: 8 simulated CPU devices (tests/conftest.py).

def test_mesh_axes():
  assert sharding.make_mesh((2, 2, 2)).axis_names == ('data', 'fsdp', 'tensor')
  mesh = sharding.make_mesh((1, 2, 2, 2))
  assert mesh.axis_names == ('data', 'fsdp', 'expert', 'tensor')
  assert sharding.make_mesh((2, -1, 2, 1)).devices.shape == (2, 2, 2, 1)
  # Five entries add the context-parallel 'sequence' axis; other lengths are refused.
  assert sharding.make_mesh((1, 2, 1, 2, 2)).axis_names == ('data', 'fsdp', 'expert',
                                                            'sequence', 'tensor')
  with pytest.raises(ValueError, match='3 entries'):
    sharding.make_mesh((1, 2, 2, 1, 2, 1))
  # Rows split over the expert axis too; a 3-entry mesh keeps its old specs.
  spec = lambda names, shape, mesh: sharding.logical_to_spec(names, shape, mesh)
  assert spec(('batch', 'embed'), (8, 16), mesh) == jax.sharding.PartitionSpec(
      ('data', 'fsdp', 'expert'), None)
  assert sharding.batch_shards(mesh) == 4
  assert spec(('batch', 'embed'), (8, 16), sharding.make_mesh((2, 2, 2))) == (
      jax.sharding.PartitionSpec(('data', 'fsdp'), None))
  assert spec(('experts', 'embed', 'moe_mlp'), (E, D, F), mesh) == jax.sharding.PartitionSpec(
      'expert', 'fsdp', 'tensor')
  assert spec(('experts', 'embed', 'moe_mlp'), (E, D, F), sharding.make_mesh((2, 2, 2))) == (
      jax.sharding.PartitionSpec(None, 'fsdp', 'tensor'))


def _shard(m, mesh, rules=None):
  """The params of (graphdef, params) laid out on `mesh` by their logical axes (`rules`)."""
  return nnx.to_pure_dict(sharding.shard_state(nnx.split(nnx.merge(*m))[1], mesh, rules))


def _assert_same_run(run0, run1):
  """Two `_sharded_run` results agree: routing exactly; output, loss and every gradient to
  1e-5."""
  ((loss0, out0), grads0), ((loss1, out1), grads1) = run0, run1
  np.testing.assert_array_equal(out1.indices, out0.indices)
  close = functools.partial(np.testing.assert_allclose, atol=1e-5, rtol=1e-5)
  close(out1.y, out0.y)
  close(loss1, loss0)
  for n, g in grads0[0].items():
    close(grads1[0][n], g, err_msg=n)
  close(grads1[1], grads0[1])


def _sharded_run(m, x, mask, mesh, probe_scale=1.0, rules=None):
  gd, params = m

  # A linear probe of y (a fixed cotangent), so the comparison sees only the layer's own
  # rounding, not its amplification by a nonlinear loss.
  probe = jnp.asarray(np.random.default_rng(7).normal(size=x.shape) * probe_scale, jnp.float32)

  rules = sharding.as_rules(rules)

  def loss(p, x):
    out = nnx.merge(gd, p)(x, token_mask=mask, rules=rules)
    return jnp.sum(out.y * probe) + 0.3 * out.aux_loss + 0.1 * out.z_loss, out

  step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
  if mesh is None:
    return step(params, x), None
  with sharding.use_mesh(mesh):
    sharded = _shard(m, mesh, rules)
    x = jax.device_put(x, jax.sharding.NamedSharding(
        mesh, sharding.logical_to_spec(('batch', 'length', 'embed'), x.shape, mesh, rules)))
    compiled = step.lower(sharded, x).compile()
    return compiled(sharded, x), (sharded, compiled.as_text())


@pytest.mark.parametrize('shape,name', [
    ((1, 2, 2, 2), 'sigmoid_relu2_groups_shared'),         # expert, tensor and fsdp at once
    ((2, 1, 4, 1), 'softmax_swiglu_nonorm_shared_scaled'),
    # Compile-bound: in the heavy run only, keeping the default run of this file short.
    pytest.param((1, 1, 8, 1), 'sigmoid_relu2_groups_shared',      # one expert per shard
                 marks=pytest.mark.heavy),
    pytest.param((2, 2, 2), 'softmax_swiglu_nonorm_shared_scaled',  # 3 entries: no expert axis
                 marks=pytest.mark.heavy),
    # The megablox kernel's path (interpreted here) under the expert shard_map, as on TPU.
    pytest.param((1, 2, 2, 2), 'sigmoid_relu2_groups_shared:gmm', marks=pytest.mark.heavy),
    # A shard's 12 gathered tokens through its experts 5 at a time (the last chunk padded).
    ((1, 2, 2, 2), 'sigmoid_relu2_groups_shared:chunk'),
])
def test_sharded_matches_unsharded(shape, name, monkeypatch):
  assert jax.device_count() >= 8
  name, _, how = name.partition(':')
  if how == 'gmm':
    monkeypatch.setattr(moe, '_default_impl', lambda: how)
  cfg = _cfg(**CONFIGS[name], moe_chunk=5 if how == 'chunk' else 0)
  m, x = _model(cfg, scale=0.25), _x(8, 3)
  mask = jnp.ones((8, 3)).at[1, 2].set(0.0)
  ((loss0, out0), grads0), _ = _sharded_run(m, x, mask, None)
  mesh = sharding.make_mesh(shape)
  ((loss1, out1), grads1), (sharded, hlo) = _sharded_run(m, x, mask, mesh)
  _assert_same_run(((loss0, out0), grads0), ((loss1, out1), grads1))
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  ep = sizes.get('expert', 1)
  up = sharded['up']
  assert up.addressable_shards[0].data.shape[0] == E // ep       # each shard: E / ep experts
  if ep > 1:
    assert 'reduce-scatter' in hlo      # the expert group's tokens summed back to their shard


@pytest.mark.parametrize('shape,name', [
    ((1, 2, 2, 2), 'sigmoid_relu2_groups_shared'),         # expert, tensor and fsdp at once
    ((2, 1, 4, 1), 'softmax_relu2_groups'),                # K = 3 over 4 expert shards
    # Compile-bound: in the heavy run only.
    pytest.param((1, 1, 8, 1), 'softmax_swiglu_norm', marks=pytest.mark.heavy),
    pytest.param((1, 2, 2, 2), 'sigmoid_relu2_groups_shared:chunk', marks=pytest.mark.heavy),
])
def test_all_to_all_dispatch_matches_unsharded(shape, name):
  """moe_dispatch='all_to_all': each shard sends its routed pairs to their experts' shards
  and back (padded slots on XLA:CPU, which has no ragged all-to-all): the unsharded layer's
  output, losses and every gradient, with all-to-alls in place of the gather and the
  reduce-scatter."""
  assert jax.device_count() >= 8
  name, _, how = name.partition(':')
  cfg = _cfg(**CONFIGS[name], moe_dispatch='all_to_all', moe_chunk=5 if how == 'chunk' else 0)
  m, x = _model(cfg, scale=0.25), _x(8, 3)
  mask = jnp.ones((8, 3)).at[1, 2].set(0.0)
  ((loss0, out0), grads0), _ = _sharded_run(m, x, mask, None)
  ((loss1, out1), grads1), (_, hlo) = _sharded_run(m, x, mask, sharding.make_mesh(shape))
  _assert_same_run(((loss0, out0), grads0), ((loss1, out1), grads1))
  assert 'all-to-all' in hlo and 'reduce-scatter' not in hlo


def test_moe_dispatch_is_checked():
  with pytest.raises(ValueError, match=r'moe_dispatch=.ring.'):
    _cfg(moe_dispatch='ring')


def _all_gathers(hlo: str, d: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
  """(result shape, gathered dims) of every all-gather in a compiled program whose result is
  [..., d] (activations or their gradients, per device after the gather)."""
  out = []
  for line in hlo.splitlines():
    m = re.search(r'= \w+\[([\d,]+)\]\S* all-gather\(.*?dimensions=\{([\d,]+)\}', line)
    if m:
      shape = tuple(int(n) for n in m.group(1).split(','))
      if shape[-1] == d:
        out.append((shape, tuple(int(n) for n in m.group(2).split(','))))
  return out


@pytest.mark.parametrize('preset,shape', [
    ('tiny_hybrid', (1, 1, 2, 2, 2)),   # expert, sequence and tensor at once
    # Compile-bound: in the heavy run only (one case each preset in the default run).
    pytest.param('tiny_moe', (1, 1, 2, 2, 2), marks=pytest.mark.heavy),
    pytest.param('tiny_moe', (2, 1, 1, 4, 1), marks=pytest.mark.heavy),    # no expert axis
    pytest.param('tiny_hybrid', (1, 1, 1, 8, 1), marks=pytest.mark.heavy),
    pytest.param('tiny_hybrid', (1, 2, 2, 2, 1), marks=pytest.mark.heavy),  # fsdp too
])
def test_context_parallel_routes_only_own_tokens(preset, shape, monkeypatch):
  """On a mesh with a sequence axis the layer (the preset's MoE: router, routed experts,
  shared expert) gives the unsharded forward and gradients, and each sequence shard routes
  only its own tokens: the grouped matmuls see K * B * T / (data * fsdp * sequence) rows per
  device (its expert group's tokens, gathered over 'expert' only), and no all-gather in the
  compiled program brings more tokens together than that (before, the shard_map took whole
  rows and every sequence shard routed all T tokens)."""
  cfg = getattr(config_lib.ModelConfig, preset)()
  b, t, d, k = 4, 64, cfg.embed_dim, cfg.experts_per_token
  # O(1) outputs and gradients (the probe scaled by 1 / sqrt(tokens): the parameters'
  # gradients sum over 256 tokens), so 1e-5 compares at float32's rounding.
  m = _model(cfg, scale=0.1)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(b, t, d)), jnp.float32)
  mask = jnp.ones((b, t)).at[1, 5:9].set(0.0)
  run = functools.partial(_sharded_run, probe_scale=(b * t) ** -0.5)
  rows = []
  orig = moe.grouped_matmul
  monkeypatch.setattr(moe, 'grouped_matmul', lambda lhs, *a, **kw: (
      rows.append(lhs.shape[0]), orig(lhs, *a, **kw))[1])
  ((loss0, out0), grads0), _ = run(m, x, mask, None)
  assert set(rows) == {b * t * k}
  rows.clear()
  mesh = sharding.make_mesh(shape)
  ((loss1, out1), grads1), (_, hlo) = run(m, x, mask, mesh)
  _assert_same_run(((loss0, out0), grads0), ((loss1, out1), grads1))
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  group = b * t // (sizes['data'] * sizes['fsdp'] * sizes['sequence'])
  assert set(rows) == {group * k}, (rows, group * k)
  if sizes['fsdp'] == 1:
    # (Over 'fsdp' the weights' embed dim is gathered too: [E / ep, F, D] would count here.)
    gathers = _all_gathers(hlo, d)
    # No [B, T, D] activation gathered along T (before the router, or into the experts) ...
    assert not [g for g in gathers if len(g[0]) == 3 and 1 in g[1]], gathers
    # ... and no gather brings more tokens together than the expert group's.
    rows = [int(np.prod(g[0][:-1])) for g in gathers]
    assert max(rows, default=0) <= group, (gathers, group)
    if sizes['expert'] > 1:
      assert group in rows                # the expert group's tokens, and no more


@pytest.mark.heavy
def test_experts_over_the_sequence_axis_match_unsharded():
  """The H200 nodes' layout (configs/_recipes.py SEQUENCE_MESH, no expert axis): the routed
  experts split over 'sequence', which also splits each row, and the rows over 'fsdp'. The
  layer gives the unsharded forward and gradients; each shard holds E / 4 experts, and the
  tokens gathered over 'sequence' are summed back by a reduce-scatter."""
  from configs import _recipes
  cfg = config_lib.ModelConfig.tiny_hybrid()
  b, t, d = 4, 64, cfg.embed_dim
  m = _model(cfg, scale=0.1)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(b, t, d)), jnp.float32)
  mask = jnp.ones((b, t)).at[1, 5:9].set(0.0)
  run = functools.partial(_sharded_run, probe_scale=(b * t) ** -0.5)
  ((loss0, out0), grads0), _ = run(m, x, mask, None)
  mesh = sharding.make_mesh((1, 2, 1, 4, 1))
  rules = sharding.override_rules(None, _recipes.SEQUENCE_MESH['2xh200x8'][1])
  ((loss1, out1), grads1), (sharded, hlo) = run(m, x, mask, mesh, rules=rules)
  _assert_same_run(((loss0, out0), grads0), ((loss1, out1), grads1))
  assert sharded['up'].addressable_shards[0].data.shape[0] == cfg.num_experts // 4
  assert 'reduce-scatter' in hlo


def test_experts_not_divisible_by_expert_axis():
  cfg = _cfg(num_experts=6, router_groups=1)
  m, x = _model(cfg), _x(4, 2)
  forward = jax.jit(lambda p, x: nnx.merge(m[0], p)(x).y)
  mesh = sharding.make_mesh((1, 2, 4, 1))
  with sharding.use_mesh(mesh), pytest.raises(ValueError, match=r'num_experts=6.*size 4'):
    forward(_shard(m, mesh), x)
  # Divisible (6 over 2) runs.
  mesh = sharding.make_mesh((1, 4, 2, 1))
  with sharding.use_mesh(mesh):
    y = forward(_shard(m, mesh), x)
  np.testing.assert_allclose(y, _call(m, x).y, atol=1e-5)


@pytest.mark.parametrize('e_loc,m,seed', [(4, 37, 0), (16, 600, 1), (1, 9, 2), (100, 900, 4)])
def test_dispatch_is_the_stable_argsort(e_loc, m, seed):
  """`_dispatch` counts each pair's row (or sorts, past COUNTED_DISPATCH_MAX experts: e_loc
  100); numpy's stable argsort of the keys is the reference (others' pairs, key e_loc, last;
  ties in pair order)."""
  key = np.random.default_rng(seed).integers(0, e_loc + 1, m).astype(np.int32)
  dest, order, sizes = jax.jit(moe._dispatch, static_argnums=1)(jnp.asarray(key), e_loc)
  want = np.argsort(key, kind='stable')
  np.testing.assert_array_equal(np.asarray(order), want)
  np.testing.assert_array_equal(np.asarray(dest)[want], np.arange(m))
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(key, minlength=e_loc + 1)[:e_loc])


def test_dispatch_gathers_differentiate_as_plain_gathers():
  """The custom gradients of the token gather and the un-permutation equal autodiff's of
  the plain gathers (a scatter-add), in float64 terms within fp32 rounding; the traced
  train-direction program holds no sort and no scatter-add."""
  rng = np.random.default_rng(3)
  n, k, d, e_loc = 11, 3, 5, 4
  key = jnp.asarray(rng.integers(0, e_loc + 1, n * k).astype(np.int32))
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(n * k, d)), jnp.float32)

  def ours(x):
    dest, order, _ = moe._dispatch(key, e_loc)
    xs = moe._gather_tokens(x, order, dest, n) * w
    return (moe._permute_rows(jnp.sin(xs), dest, order) ** 2).sum()

  def plain(x):
    order = jnp.argsort(key, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    xs = x[order % n] * w                 # pairs in choice-major order: token p % n
    return (jnp.sin(xs)[inverse] ** 2).sum()

  np.testing.assert_allclose(ours(x), plain(x), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(plain)(x), rtol=1e-5, atol=1e-6)
  hlo = jax.jit(jax.grad(ours)).lower(x).as_text()
  # One scatter: `order` set from `dest` (a plain set, no add); autodiff's would add two more.
  assert hlo.count('stablehlo.sort') == 0 and hlo.count('"stablehlo.scatter"') == 1, (
      hlo.count('stablehlo.sort'), hlo.count('"stablehlo.scatter"'))
