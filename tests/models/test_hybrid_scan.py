"""The mixture-of-experts families' scanned layer stack (models/hybrid.py): the cut of a
pattern into repeated segments (`plan`, `Repeat`) or its fold into one stack per kind of
sublayer (`folds`, `Fold`: one scan over the pattern switching on each step's kind), the
stacked parameters, and both scans against the unrolled loop and a plain per-sublayer loop
(logits, gradients, cached prefill and decode, the paged step, routing replay and MoE
statistics), the fold's backward residuals, and HF interop of the stacked layouts."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention
from models import config as config_lib
from models import hf
from models import hybrid
from models import sharding
from models import transformer

# A period (M * E) twice, then leftovers: an mlp and a moe sublayer of their own. Its segments
# need 5 bodies, its kinds 4: it is folded (one stack per kind, one scan over the pattern).
PATTERN = 'M*EM*E-E'
CFG = config_lib.ModelConfig.tiny_hybrid(num_layers=8, layer_types=PATTERN, scan_layers=True)
# The same period and one leftover: 4 bodies as segments, no fewer folded, so segments.
SEGMENTS = config_lib.ModelConfig.tiny_hybrid(num_layers=7, layer_types='M*EM*E-',
                                              scan_layers=True)
# The default tier's: a leftover before and after a period (M *) twice (segments, 4 bodies).
SMALL = config_lib.ModelConfig.tiny_hybrid(num_layers=6, layer_types='EM*M*-', scan_layers=True)
# The default tier's folded one: tiny_hybrid's six sublayers, no repeats, 4 kinds.
FOLDED = config_lib.ModelConfig.tiny_hybrid(num_layers=6, layer_types='ME*EM-', scan_layers=True)
BOTH = pytest.mark.parametrize('cfg', [CFG, SEGMENTS], ids=['fold', 'segments'])
TOKENS = jax.random.randint(jax.random.key(1), (2, 12), 0, 256, dtype=jnp.int32)
SEG = jnp.array([[1] * 12, [0] * 3 + [1] * 9], jnp.int32)   # the second row left-padded
POS = jnp.maximum(jnp.cumsum(SEG, axis=1) - 1, 0)


def _bodies(segments) -> int:
  return sum(len(s.unit) for s in segments)


def _brute_force(mixers) -> tuple[int, int]:
  """(bodies, segments) of the best cut of `mixers`, over every cut into runs."""
  n, best = len(mixers), None
  for cuts in itertools.product([False, True], repeat=n - 1):
    bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
    bodies = segments = 0
    for a, b in zip(bounds, bounds[1:]):
      run = mixers[a:b]
      period = min(p for p in range(1, len(run) + 1)
                   if len(run) % p == 0 and run == run[:p] * (len(run) // p))
      # A run that is not a repeat is that many single sublayers.
      single = len(run) // period < 2
      bodies += len(run) if single else period
      segments += len(run) if single else 1
    cost = (bodies, segments)
    best = cost if best is None or cost < best else best
  return best


def test_plan_cuts_patterns_into_fewest_bodies():
  nemotron = config_lib.ModelConfig.nemotron_3_nano_30b_a3b()
  segs = hybrid.plan(nemotron.mixers)
  assert _bodies(segs) == 14 and len(segs) == 6
  letter = {kind: c for c, kind in config_lib.PATTERN_LETTERS.items()}
  assert [(s.start, ''.join(letter[m] for m in s.unit), s.repeats) for s in segs] == [
      (0, 'M', 1), (1, 'EMEM*EM', 5), (36, 'EM', 3), (42, '*', 1), (43, 'E', 1), (44, 'ME', 4)]
  qwen = hybrid.plan(config_lib.ModelConfig.qwen3_30b_a3b().mixers)
  assert qwen == (hybrid.Segment(0, ('attention', 'moe'), 48),)
  assert all(s.repeats == 1 for s in hybrid.plan(config_lib.ModelConfig.tiny_hybrid().mixers))
  rng = np.random.RandomState(0)
  for _ in range(60):   # against every cut of short random patterns
    mixers = tuple(str(m) for m in rng.choice(['mamba', 'moe', 'attention'], size=rng.randint(1, 10),
                              p=[0.45, 0.45, 0.1]))
    segs = hybrid.plan(mixers)
    assert sum((s.unit * s.repeats for s in segs), ()) == mixers
    assert all(s.repeats >= 2 or len(s.unit) == 1 for s in segs)
    assert (_bodies(segs), len(segs)) == _brute_force(mixers), mixers


def _assert_sublayers_built_in_turn(cfg, model):
  """hybrid.sublayer(model, i) holds the values sublayer i gets as the i-th of a plain list."""
  rngs = nnx.Rngs(0)
  rngs.params()  # The embedding's draw comes first.
  for i, kind in enumerate(cfg.mixers):
    want = hybrid.Sublayer(cfg, kind, rngs)
    got = dict(nnx.to_flat_state(nnx.state(hybrid.sublayer(model, i))))
    for path, v in nnx.to_flat_state(nnx.state(want)):
      np.testing.assert_array_equal(got[path].get_value(), v.get_value(), err_msg=f'{i} {path}')


def test_stacked_init_equals_sublayers_built_in_turn():
  model = transformer.create(SMALL, seed=0)
  assert [type(b).__name__ for b in model.blocks] == ['Sublayer', 'Repeat', 'Sublayer']
  _assert_sublayers_built_in_turn(SMALL, model)
  q = model.blocks[1].unit[1].mixer.q_proj
  assert q.get_value().shape == (2, 64, 4, 16)
  assert q.get_metadata()['logical_axes'] == ('layers', 'embed', 'heads', 'head_dim')
  assert hybrid.locate(SMALL, 3) == (('blocks', 1, 'unit', 0), 1)
  assert hybrid.locate(SMALL, 5) == (('blocks', 2), None)
  up = nnx.eval_shape(lambda: transformer.create(SEGMENTS, seed=0)).blocks[0].unit[2].mixer.up
  assert up.get_metadata()['logical_axes'][:2] == ('layers', 'experts')


def test_fold_layout_and_stacked_init():
  """Which patterns fold, the per-step kind and index, one stack per kind, locate."""
  nemotron = config_lib.ModelConfig.nemotron_3_nano_30b_a3b().mixers
  assert hybrid.folds(nemotron)
  kinds, kind_of, within = hybrid.fold_steps(nemotron)
  assert kinds == ('mamba', 'moe', 'attention') and len(kind_of) == 52
  assert [within[i] for i in range(52) if nemotron[i] == 'moe'] == list(range(23))
  assert not hybrid.folds(config_lib.ModelConfig.qwen3_30b_a3b().mixers)   # 2 bodies either way
  assert not hybrid.folds(SMALL.mixers) and not hybrid.folds(SEGMENTS.mixers)
  assert hybrid.folds(CFG.mixers)
  assert hybrid.fold_steps(FOLDED.mixers) == (('mamba', 'moe', 'attention', 'mlp'),
                                              (0, 1, 2, 1, 0, 3), (0, 0, 0, 1, 1, 0))
  model = transformer.create(FOLDED, seed=0)
  assert [type(b).__name__ for b in model.blocks] == ['Fold']
  up = model.blocks[0].moe.mixer.up
  assert up.get_value().shape[0] == 2
  assert up.get_metadata()['logical_axes'][:2] == ('layers', 'experts')
  assert hybrid.locate(FOLDED, 3) == (('blocks', 0, 'moe'), 1)
  assert hybrid.locate(FOLDED, 5) == (('blocks', 0, 'mlp'), 0)
  assert model.blocks[0].mlp.norm.scale.get_value().shape == (1, 64)
  _assert_sublayers_built_in_turn(FOLDED, model)
  with pytest.raises(IndexError, match='sublayer 6'):
    hybrid.locate(FOLDED, 6)


def _model(cfg, params=None):
  model = transformer.create(cfg, seed=0)
  if params is not None:
    nnx.update(model, params)
  return model


def _perturbed(cfg=CFG):
  """The parameters, scaled up so the logits and routing are far from uniform."""
  params = nnx.state(transformer.create(cfg, seed=0), nnx.Param)
  return jax.tree.map(lambda x: x * 2 if x.ndim >= 2 else x + 0.1, params)


@nnx.jit
def _logits(model, tokens, positions, segment_ids):
  return model(tokens, positions, segment_ids)


def _reference(model, tokens, positions, segment_ids):
  """A plain Python loop over the sublayers, each sliced out of its stack."""
  x = jnp.take(model.embed.get_value(), tokens, axis=0)
  mask = attention.MaskInfo(segment_ids, segment_ids)
  for i in range(model.cfg.num_layers):
    x, _, _ = hybrid.sublayer(model, i)(x, positions, mask, segment_ids)
  return model.logits_from_hidden(model.final_norm(x))


def _assert_scan_equals_unrolled(cfg, reference: bool):
  params = _perturbed(cfg)
  scanned, looped = _model(cfg, params), _model(cfg.replace(scan_layers=False), params)
  a = np.asarray(_logits(scanned, TOKENS, POS, SEG))
  b = np.asarray(_logits(looped, TOKENS, POS, SEG))
  real = np.asarray(SEG, bool)
  np.testing.assert_allclose(a[real], b[real], atol=2e-5, rtol=0)
  assert np.abs(a[real]).max() > 0.5   # not a degenerate comparison
  if reference:
    ref = np.asarray(jax.jit(_reference)(scanned, TOKENS, POS, SEG))
    np.testing.assert_allclose(a[real], ref[real], atol=2e-5, rtol=0)


def test_scan_equals_unrolled():
  _assert_scan_equals_unrolled(SMALL, reference=False)


def test_fold_equals_unrolled_and_per_sublayer_loop():
  """The folded scan (one switch over the kinds) against the same stacks looped and against
  each sublayer sliced out by `hybrid.sublayer`: a wrong per-step index fails here."""
  jaxpr = jax.make_jaxpr(lambda m, t: m(t))(_model(FOLDED), TOKENS)
  scans = [e for e in jaxpr.eqns if e.primitive.name == 'scan']
  assert len(scans) == 1 and scans[0].params['length'] == 6
  conds = [e for e in scans[0].params['jaxpr'].eqns if e.primitive.name == 'cond']
  assert len(conds) == 1 and len(conds[0].params['branches']) == 4
  _assert_scan_equals_unrolled(FOLDED, reference=True)


def test_fold_backward_keeps_no_parameters_per_step():
  """Remat'd folded scan with autodiff's backward: the forward scan's per-step outputs (the backward's residuals) are
  activations and indices only, no stack or slice of one; the backward scan carries one
  gradient accumulator per stack (stack-shaped), nothing per step of parameter shape."""
  model = _model(FOLDED.replace(remat='full'))
  model.accumulate_fold_backward = False     # autodiff's backward
  graphdef, params = nnx.split(model)
  loss = lambda p: _loss(nnx.merge(graphdef, p), TOKENS, POS, SEG)
  jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
  scans = [e for e in jaxpr.eqns if e.primitive.name == 'scan']
  assert len(scans) == 2    # the forward and the backward
  leaves = [v.get_value() for v in jax.tree.leaves(
      nnx.state(_model(FOLDED).blocks, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))]
  per_step = ({(6,) + a.shape for a in leaves} | {(6,) + a.shape[1:] for a in leaves})
  for eqn in scans:
    shapes = [tuple(v.aval.shape) for v in eqn.outvars]
    assert not set(shapes) & per_step, set(shapes) & per_step
  forward, backward = scans
  assert sorted(tuple(v.aval.shape) for v in forward.outvars) == sorted(
      [(2, 12, 64), (6, 2, 12, FOLDED.experts_per_token), (6,), (6,), (6, 2, 12, 64)])
  trained = [v.get_value().shape for path, v in nnx.to_flat_state(
      nnx.state(_model(FOLDED).blocks, nnx.Param)) if path[-1] != 'router_bias']  # stop_gradient
  stacks = sorted(trained)
  carried = sorted(tuple(v.aval.shape) for v in backward.outvars)
  assert all(carried.count(s) >= stacks.count(s) for s in stacks)


def _loss_with_router_losses(model, tokens, positions, segment_ids):
  """_loss plus the MoE reports' auxiliary losses, so their cotangents flow back too."""
  _, _, stats = model.hidden(tokens, positions, segment_ids, None, return_stats=True)
  return _loss(model, tokens, positions, segment_ids) + stats.aux_loss + 0.1 * stats.z_loss


@pytest.mark.parametrize('remat', ['full', pytest.param('save_attention_out',
                                                        marks=pytest.mark.heavy)])
def test_fold_accumulating_backward_equals_autodiff(remat):
  """The folded scan's written-out backward (`hybrid._accumulating_scan`, the default: each
  step recomputed from its input, its parameter gradient added into its kind's stack in
  place) gives autodiff's loss and gradients, router losses included."""
  cfg = FOLDED.replace(remat=remat)
  params = _perturbed(cfg)
  grads = {}
  for on in (False, True):
    model = _model(cfg)
    model.accumulate_fold_backward = on
    graphdef, _ = nnx.split(model)
    loss = lambda p, g=graphdef: _loss_with_router_losses(nnx.merge(g, p), TOKENS, POS, SEG)
    grads[on] = jax.jit(jax.value_and_grad(loss))(params)
    text = str(jax.make_jaxpr(jax.grad(loss))(params))
    assert ('custom_vjp_call' in text) == on
  np.testing.assert_allclose(grads[True][0], grads[False][0], rtol=1e-6)
  flat = [dict(nnx.to_flat_state(grads[on][1])) for on in (True, False)]
  assert flat[0].keys() == flat[1].keys()
  for path in flat[1]:
    a, b = flat[0][path].get_value(), flat[1][path].get_value()
    np.testing.assert_allclose(a, b, atol=1e-6 + 1e-4 * float(np.abs(b).max()), rtol=0,
                               err_msg=str(path))
  router = flat[0][('blocks', 0, 'moe', 'mixer', 'router')].get_value()
  assert np.abs(router[1]).max() > 0       # the second moe's router gets its own gradient


@pytest.mark.heavy
@BOTH
def test_scan_equals_unrolled_and_per_sublayer_loop(cfg):
  _assert_scan_equals_unrolled(cfg, reference=True)


def _loss(model, tokens, positions, segment_ids):
  model.collect_moe_stats = True
  logits = model(tokens, positions, segment_ids)
  return jnp.mean(jax.nn.log_softmax(logits) ** 2)


@pytest.mark.heavy
@BOTH
@pytest.mark.parametrize('remat', ['full', 'none'])
def test_scan_gradients_equal_unrolled(cfg, remat):
  params = _perturbed(cfg)
  grads = []
  for c in (cfg.replace(remat=remat), cfg.replace(remat=remat, scan_layers=False)):
    graphdef, _ = nnx.split(_model(c))
    loss = lambda p, graphdef=graphdef: _loss(nnx.merge(graphdef, p), TOKENS, POS, SEG)
    grads.append(jax.jit(jax.grad(loss))(params))
  flat = [dict(nnx.to_flat_state(g)) for g in grads]
  assert flat[0].keys() == flat[1].keys()
  for path in flat[0]:
    a, b = flat[0][path].get_value(), flat[1][path].get_value()
    np.testing.assert_allclose(a, b, atol=1e-6 + 1e-4 * float(np.abs(b).max()), rtol=0,
                               err_msg=str(path))
  path = ('blocks', 0, 'moe') if hybrid.folds(cfg.mixers) else ('blocks', 0, 'unit', 2)
  moe_up = flat[0][path + ('mixer', 'up')].get_value()
  assert np.abs(moe_up[1]).max() > 0   # the second repeat / moe gets its own gradient


@nnx.jit(static_argnames=('return_stats', 'replay'))
def _hidden(model, tokens, positions, segment_ids, cache, routing=None, return_stats=False,
            replay=True):
  return model.hidden(tokens, positions, segment_ids, cache, routing=routing, replay=replay,
                      return_stats=return_stats)


@pytest.mark.heavy
@BOTH
def test_scan_routing_and_moe_stats_equal_unrolled(cfg):
  params = _perturbed(cfg)
  stats = {}
  for name, c in (('scan', cfg), ('loop', cfg.replace(scan_layers=False))):
    model = _model(c, params)
    _, _, own = _hidden(model, TOKENS, POS, SEG, None, return_stats=True)
    # Replay every sublayer's choice shifted by one expert; and only compare with it.
    shifted = (own.indices + 1) % cfg.num_experts
    _, _, replayed = _hidden(model, TOKENS, POS, SEG, None, shifted, return_stats=True)
    _, _, compared = _hidden(model, TOKENS, POS, SEG, None, shifted, return_stats=True,
                             replay=False)
    stats[name] = (own, replayed, compared)
  moe = cfg.mixers.count('moe')
  real = float(np.sum(np.asarray(SEG) > 0))
  for (a, b) in zip(stats['scan'], stats['loop']):
    assert a.indices.shape == (moe, 2, 12, cfg.experts_per_token)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_allclose(a.aux_loss, b.aux_loss, rtol=1e-5)
    np.testing.assert_allclose(a.z_loss, b.z_loss, rtol=1e-5)
    if a.mismatched is not None:
      assert float(a.mismatched) == float(b.mismatched)
      assert float(a.compared) == float(b.compared) == moe * real
      np.testing.assert_array_equal(a.token_differs, b.token_differs)
  own, replayed, compared = stats['scan']
  np.testing.assert_array_equal(replayed.indices, (own.indices + 1) % cfg.num_experts)
  assert float(compared.mismatched) == moe * real   # every set differs from the shifted one
  np.testing.assert_array_equal(compared.token_differs, np.asarray(SEG) > 0)


def _prefill_decode(model, cfg):
  """Logits of a 7-token chunked prefill (4 + 3) then 5 one-token decode steps."""
  cache = transformer.init_cache(cfg, 2, 16, jnp.float32)
  seg = jnp.ones_like(TOKENS)
  out = []
  for a, b in ((0, 4), (4, 7)) + tuple((t, t + 1) for t in range(7, 12)):
    x, cache = _hidden(model, TOKENS[:, a:b], None, seg[:, a:b], cache)
    out.append(model.logits_from_hidden(x))
  return np.asarray(jnp.concatenate(out, axis=1)), cache


@pytest.mark.heavy
@BOTH
def test_scan_prefill_decode_equal_unrolled_and_full_forward(cfg):
  params = _perturbed(cfg)
  loop = cfg.replace(scan_layers=False)
  scanned, looped = _model(cfg, params), _model(loop, params)
  a, cache_a = _prefill_decode(scanned, cfg)
  b, cache_b = _prefill_decode(looped, loop)
  full = np.asarray(_logits(scanned, TOKENS, None, jnp.ones_like(TOKENS)))
  np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
  np.testing.assert_allclose(a, full, atol=1e-4, rtol=0)
  assert len(cache_a.k) == cfg.attention_layers and len(cache_a.state) == cfg.mamba_layers
  for x, y in zip(jax.tree.leaves(cache_a), jax.tree.leaves(cache_b)):
    np.testing.assert_allclose(x, y, atol=2e-5, rtol=0)


@nnx.jit
def _paged_step(model, tokens, positions, cache):
  return model.decode_paged(tokens, positions, cache)


@pytest.mark.heavy
@BOTH
def test_scan_paged_decode_equals_unrolled_and_full_forward(cfg):
  params = _perturbed(cfg)
  ps, pages_per_slot, slots = 4, 3, 2
  full = np.asarray(_logits(_model(cfg, params), TOKENS, None, jnp.ones_like(TOKENS)))
  for cfg in (cfg, cfg.replace(scan_layers=False)):
    model = _model(cfg, params)
    pool = lambda: jnp.zeros((cfg.num_kv_heads, slots * pages_per_slot, ps, cfg.head_dim))
    n = cfg.attention_layers
    cache = transformer.PagedCache(
        k=tuple(pool() for _ in range(n)), v=tuple(pool() for _ in range(n)),
        page_table=jnp.arange(slots * pages_per_slot, dtype=jnp.int32).reshape(slots, -1)[::-1],
        lengths=jnp.zeros((slots,), jnp.int32), live=jnp.ones((slots,), bool),
        state=hybrid.init_states(cfg, slots))
    got = []
    for t in range(TOKENS.shape[1]):
      logits, cache = _paged_step(model, TOKENS[:, t], jnp.full((slots,), t, jnp.int32), cache)
      cache = cache._replace(lengths=cache.lengths + 1)
      got.append(np.asarray(logits))
    np.testing.assert_allclose(np.stack(got, axis=1), full, atol=1e-4, rtol=0,
                               err_msg=f'scan_layers={cfg.scan_layers}')


@pytest.mark.heavy
@pytest.mark.parametrize('cfg', [
    CFG, config_lib.ModelConfig.tiny_moe(num_layers=4, layer_types=('moe',) * 3 + ('mlp',))],
    ids=['nemotron_h', 'qwen3_moe'])
def test_hf_round_trip_of_stacked_layout(cfg, tmp_path):
  """Saved per layer as HF names them, loaded back into the stacks, slice for slice."""
  assert hybrid.folds(cfg.mixers) or any(s.repeats > 1 for s in hybrid.plan(cfg.mixers))
  model = transformer.create(cfg, seed=0)
  params = jax.tree.map(lambda x: x + jax.random.normal(jax.random.key(x.size), x.shape)
                        * 0.1, nnx.state(model, nnx.Param))
  nnx.update(model, params)
  hf.save_model(model, tmp_path)
  back = hf.load_model(tmp_path, dtype='float32')
  want = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  got = dict(nnx.to_flat_state(nnx.state(back, nnx.Param)))
  assert want.keys() == got.keys()
  for path in want:
    np.testing.assert_array_equal(got[path].get_value(), want[path].get_value(), str(path))
  # Layer i's HF tensors are sublayer i's parameters, wherever its stack keeps them.
  import safetensors.numpy  # pylint: disable=g-import-not-at-top
  tensors = safetensors.numpy.load_file(str(tmp_path / 'model.safetensors'))
  if cfg.family == 'nemotron_h':
    i = 4   # the second repeat's attention
    name = f'backbone.layers.{i}.mixer.o_proj.weight'
    o = hybrid.sublayer(model, i).mixer.o_proj.get_value()   # [N, H, D]
    np.testing.assert_array_equal(tensors[name], o.reshape(-1, o.shape[-1]).T)
  else:
    i = 2   # layer 2's experts: sublayer 5
    up = hybrid.sublayer(model, 5).mixer.up.get_value()     # [E, D, F]
    np.testing.assert_array_equal(tensors[f'model.layers.{i}.mlp.experts.3.up_proj.weight'],
                                  up[3].T)


@pytest.mark.parametrize('cfg', [SMALL, FOLDED], ids=['segments', 'fold'])
def test_a_cached_step_updates_each_sublayers_cache_in_place(cfg):
  """With a cache, a repeated segment loops over its repeats and a fold over the pattern: no
  array in the decode step's program stacks the KV buffers or Mamba states over the
  sublayers (a scan would, a copy of them on every decode step), and its logits equal the
  looped model's."""
  model = _model(cfg)
  cache = transformer.init_cache(cfg, 2, 16, jnp.float32)
  seg = jnp.ones((2, 1), jnp.int32)
  step = lambda m, t, c: m.hidden(t, None, seg, c)
  jaxpr = jax.make_jaxpr(lambda t, c: step(model, t, c))(TOKENS[:, :1], cache)
  k = cache.k[0].shape                                        # [B, K, S, H]
  conv = cache.state[0].conv.shape
  stacked = {(cfg.attention_layers,) + tuple(k), (cfg.mamba_layers,) + tuple(conv)}
  shapes = {tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars
            if hasattr(v.aval, 'shape')}
  assert not shapes & stacked, shapes & stacked
  assert not any(eqn.primitive.name == 'scan' for eqn in jaxpr.eqns)
  a, _ = step(model, TOKENS[:, :1], cache)
  b, _ = step(_model(cfg.replace(scan_layers=False)), TOKENS[:, :1], cache)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.heavy
def test_fold_on_an_expert_mesh_equals_unsharded():
  """The folded stacks sharded by their logical axes ([layers, experts, ...] on a (data, fsdp,
  expert, tensor) = (1, 2, 2, 2) mesh): loss and gradients equal the unsharded model's."""
  assert jax.device_count() >= 8
  cfg = FOLDED.replace(remat='full')

  def loss(model):
    return _loss(model, TOKENS, POS, SEG)
  ref = _model(cfg)
  l0, g0 = nnx.jit(nnx.value_and_grad(loss))(ref)
  mesh = sharding.make_mesh((1, 2, 2, 2))
  with sharding.use_mesh(mesh):
    model = transformer.create(cfg, seed=0, mesh=mesh)
    up = model.blocks[0].moe.mixer.up.get_value()     # [moe sublayers, E, D, F]
    assert up.sharding.spec[:2] == (None, 'expert')
    l1, g1 = nnx.jit(nnx.value_and_grad(loss))(model)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  flat0, flat1 = dict(nnx.to_flat_state(nnx.state(g0))), dict(nnx.to_flat_state(nnx.state(g1)))
  assert flat0.keys() == flat1.keys()
  for path, v in flat0.items():
    np.testing.assert_allclose(np.asarray(flat1[path].get_value()), np.asarray(v.get_value()),
                               atol=1e-6, rtol=1e-5, err_msg=str(path))


def test_a_fold_prefills_fresh_buffers_in_one_scan():
  """A prefill into buffers of exactly its tokens (the paged engine's) runs a Fold as one scan
  over the pattern with the caches stacked per kind; its hidden states, written buffers and
  Mamba states equal the looped model's, and so do the decode steps that continue from them.
  Longer buffers keep the in-place loop (no scan). (CFG: two attention and two Mamba
  sublayers, so a slice mixed up between them shows.)"""
  assert hybrid.folds(CFG.mixers) and CFG.attention_layers == CFG.mamba_layers == 2
  params = _perturbed(CFG)
  folded, looped = _model(CFG, params), _model(CFG.replace(scan_layers=False), params)
  t = 7
  seg = SEG[:, :t]
  prefill = lambda m, c: m.hidden(TOKENS[:, :t], None, seg, c)
  fresh = transformer.init_cache(CFG, 2, t, jnp.float32)
  scans = lambda c: [e for e in jax.make_jaxpr(lambda c: prefill(folded, c))(c).eqns
                     if e.primitive.name == 'scan' and e.params['length'] == CFG.num_layers]
  assert len(scans(fresh)) == 1
  assert not scans(transformer.init_cache(CFG, 2, 16, jnp.float32))
  (xa, ca), (xb, cb) = (jax.jit(lambda c, m=m: prefill(m, c))(fresh) for m in (folded, looped))
  np.testing.assert_allclose(np.asarray(xa), np.asarray(xb), atol=2e-5, rtol=0)
  assert len(ca.k) == CFG.attention_layers and len(ca.state) == CFG.mamba_layers
  for x, y in zip(jax.tree.leaves(ca), jax.tree.leaves(cb)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5, rtol=0)
  # The written buffers and states carry on: a longer cache holding them, then one decode step.
  def grow(c):
    pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, 4), (0, 0)))
    return c._replace(k=tuple(map(pad, c.k)), v=tuple(map(pad, c.v)),
                      segment_ids=jnp.pad(c.segment_ids, ((0, 0), (0, 4))))
  step = lambda m, c: m.hidden(TOKENS[:, t:t + 1], None, jnp.ones((2, 1), jnp.int32), c)
  (da, _), (db, _) = (jax.jit(lambda c, m=m: step(m, c))(grow(c)) for m, c in ((folded, ca),
                                                                               (looped, cb)))
  np.testing.assert_allclose(np.asarray(da), np.asarray(db), atol=2e-5, rtol=0)
