"""Context parallelism: zig-zag layout, and sequence-sharded forwards, log-probs and train-step
gradients equal to the unsharded ones (dense Qwen3-like, MoE and hybrid Mamba-2 / MoE /
attention; packed rows with padding)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import attention
from models import config as config_lib
from models import context
from models import mamba
from models import moe
from models import sharding
from models import transformer
from rl import batch as batch_lib
from rl import sft
from rl import train_step as ts

SFT = ts.LossSpec(sft.SftConfig, sft.loss_fn, sft.normalizers)
TOL = 2e-6


def _mesh(sequence: int, data: int = 1, tensor: int = 1):
  shape = (data, 1, 1, sequence, tensor)
  return sharding.make_mesh(shape, jax.devices()[:int(np.prod(shape))])


def _packed_rows(b: int, t: int, seed: int = 0, vocab: int = 256) -> batch_lib.TrainBatch:
  """Rows of several packed segments with padding between and after them: segments cross
  every shard boundary of a 2- or 4-way split."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((b, t), np.int32)
  for r in range(b):
    cuts = np.sort(rng.choice(np.arange(1, t - 2), 3, replace=False))
    seg[r, :cuts[0]] = 1
    seg[r, cuts[0] + 1:cuts[1]] = 2       # one padding token between segments 1 and 2
    seg[r, cuts[1]:cuts[2]] = 3
  tokens = (rng.integers(3, vocab, (b, t)) * (seg > 0)).astype(np.int32)
  same_next = np.concatenate([seg[:, 1:] == seg[:, :-1], np.zeros((b, 1), bool)], 1)
  targets = np.where(same_next & (seg > 0),
                     np.concatenate([tokens[:, 1:], np.zeros((b, 1), np.int32)], 1), 0)
  return batch_lib.TrainBatch(
      tokens=tokens, positions=batch_lib.positions_from_segments(seg), segment_ids=seg,
      targets=targets.astype(np.int32),
      loss_mask=(same_next & (seg > 0)).astype(np.float32))


def _forward(graphdef, params, batch, mesh=None, chunk=batch_lib.LOGITS_CHUNK):
  """(logits [B, T, V], log-probs [B, T]) of the model, traced under `mesh`."""
  def f(params, batch):
    model = nnx.merge(graphdef, params)
    h, _ = model.hidden(batch.tokens, batch.positions, batch.segment_ids)
    lp = batch_lib.stats_from_hidden(model, h, batch.targets, chunk=chunk)['logprobs']
    return model.logits_from_hidden(h), lp
  if mesh is None:
    return jax.jit(f)(params, batch)
  with sharding.use_mesh(mesh):
    return jax.jit(f)(params, batch)


def _init(cfg):
  """(graphdef, params) of a fresh model, initialised in one jitted program (eager init of
  the tiny models takes seconds on a loaded host)."""
  make = lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, _ = nnx.split(nnx.eval_shape(make))
  return graphdef, jax.jit(lambda: nnx.state(make()))()


def _real(batch):
  return np.asarray(batch.segment_ids) > 0


# ---------------------------------------------------------------- layout


def test_zigzag_layout_is_balanced_and_moves_there_and_back():
  n, t = 4, 32
  order = context.zigzag_order(t, n)
  assert sorted(order) == list(range(t))
  c = t // (2 * n)
  for i in range(n):
    local = np.asarray(context.zigzag_index(t, n, i))
    np.testing.assert_array_equal(local, order[i * 2 * c:(i + 1) * 2 * c])
    assert set(local // c) == {i, 2 * n - 1 - i}
    # Causal work of the shard's queries, in (query, key) pairs: the same on every shard.
    assert int((local + 1).sum()) == t * (t + 1) // (2 * n)

  mesh = _mesh(n, data=2)
  x = jnp.arange(2 * t * 3, dtype=jnp.float32).reshape(2, t, 3)
  rules = sharding.DEFAULT_RULES
  with sharding.use_mesh(mesh):
    zz = jax.jit(lambda x: context.to_zigzag(x, ('batch', 'length', None), rules))(x)
    back = jax.jit(lambda x: context.from_zigzag(x, ('batch', 'length', None), rules))(zz)
  np.testing.assert_array_equal(np.asarray(zz), np.asarray(x)[:, order])
  np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
  # A length that 2n does not divide is not split context-parallel; nor is any row under
  # rules without a 'length' axis.
  with sharding.use_mesh(mesh):
    assert context.shards(t, rules) == n and context.shards(t + 4, rules) == 1
    assert context.shards(t, sharding.override_rules(rules, [('length', None)])) == 1
  assert context.shards(t, rules) == 1              # no mesh


def test_dense_forward_and_chunked_logprobs_on_two_sequence_shards_equal_unsharded():
  cfg = config_lib.ModelConfig.tiny()
  batch = _packed_rows(2, 32)
  graphdef, params = _init(cfg)
  ref_logits, ref_lp = _forward(graphdef, params, batch, chunk=8)
  mesh = _mesh(2, data=2, tensor=2)
  sparams = sharding.shard_state(params, mesh)
  calls = []
  orig = attention._context_parallel
  try:
    attention._context_parallel = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
    logits, lp = _forward(graphdef, sparams, batch, mesh, chunk=8)
  finally:
    attention._context_parallel = orig
  assert calls                                       # attention ran context-parallel
  assert logits.sharding.spec[1] == 'sequence' and lp.sharding.spec[1] == 'sequence'
  real = _real(batch)
  np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref_logits)[real],
                             atol=TOL, rtol=0)
  np.testing.assert_allclose(np.asarray(lp)[real], np.asarray(ref_lp)[real], atol=TOL, rtol=0)


def test_hybrid_forward_and_logprobs_on_two_sequence_shards_equal_unsharded(monkeypatch):
  # Mamba-2, MoE and attention sublayers (the preset's first three: a shorter compile; the
  # heavy tests run all six); packed segments cross the shard boundaries, so the Mamba scan
  # passes its state and conv window across them.
  cfg = config_lib.ModelConfig.tiny_hybrid(num_layers=3,
                                           layer_types=config_lib.parse_pattern('ME*'))
  batch = _packed_rows(2, 32, seed=3)
  graphdef, params = _init(cfg)
  ref_logits, ref_lp = _forward(graphdef, params, batch, chunk=8)
  calls, rows = [], []
  monkeypatch.setattr(mamba, '_context_parallel',
                      lambda *a, f=mamba._context_parallel: (calls.append(1), f(*a))[1])
  monkeypatch.setattr(moe, 'grouped_matmul', lambda lhs, *a, f=moe.grouped_matmul, **k: (
      rows.append(lhs.shape[0]), f(lhs, *a, **k))[1])
  mesh = _mesh(2, data=2, tensor=2)
  logits, lp = _forward(graphdef, sharding.shard_state(params, mesh), batch, mesh, chunk=8)
  assert calls                                       # the mixers ran context-parallel
  # Each sequence shard routed only its own tokens: K * B * T / (data * sequence) pairs.
  assert set(rows) == {cfg.experts_per_token * 2 * 32 // 4}, rows
  real = _real(batch)
  np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref_logits)[real],
                             atol=TOL, rtol=0)
  np.testing.assert_allclose(np.asarray(lp)[real], np.asarray(ref_lp)[real], atol=TOL, rtol=0)


# ---------------------------------------------------------------- heavy parity


@pytest.mark.heavy
@pytest.mark.parametrize('sequence', [2, 4])
@pytest.mark.parametrize('impl,t', [('dense', 64), ('blockwise', 512)])
@pytest.mark.parametrize('family', ['tiny', 'tiny_moe', 'tiny_hybrid'])
def test_forward_and_logprobs_equal_unsharded(family, impl, t, sequence):
  cfg = getattr(config_lib.ModelConfig, family)(attention=impl)
  batch = _packed_rows(2, t, seed=sequence)
  graphdef, params = _init(cfg)
  ref_logits, ref_lp = _forward(graphdef, params, batch, chunk=t // 8)
  mesh = _mesh(sequence, data=2 if sequence == 2 else 1, tensor=2)
  sparams = sharding.shard_state(params, mesh)
  logits, lp = _forward(graphdef, sparams, batch, mesh, chunk=t // 8)
  real = _real(batch)
  np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref_logits)[real],
                             atol=TOL, rtol=0)
  np.testing.assert_allclose(np.asarray(lp)[real], np.asarray(ref_lp)[real], atol=TOL, rtol=0)


def _one_step(cfg, batch, mesh):
  graphdef, params = _init(cfg)
  if mesh is not None:
    params = sharding.shard_state(params, mesh)
  opt = ts.make_optimizer(ts.OptimizerConfig(lr=1e-3, eps=1e-6))
  state = ts.init_state(params, opt, mesh=mesh)
  step = ts.make_train_step(graphdef, SFT, None, opt, mesh=mesh,
                            state=None if mesh is None else state)
  state, metrics = step(state, batch)
  return optax.tree_utils.tree_get(state.opt_state, 'mu'), metrics


@pytest.mark.heavy
@pytest.mark.parametrize('sequence', [2, 4])
@pytest.mark.parametrize('family', ['tiny', 'tiny_moe', 'tiny_hybrid'])
def test_train_step_gradients_equal_unsharded(family, sequence, monkeypatch):
  # Rows longer than the log-probs chunk: the sequence-sharded chunked path's backward.
  monkeypatch.setattr(batch_lib, 'policy_stats',
                      functools.partial(batch_lib.policy_stats, chunk=16))
  cfg = getattr(config_lib.ModelConfig, family)(attention='blockwise', remat='full',
                                                scan_layers=True)
  batch = _packed_rows(2, 128, seed=7)
  ref_mu, ref_m = _one_step(cfg, batch, None)
  mu, m = _one_step(cfg, batch, _mesh(sequence, data=2, tensor=4 // sequence))
  assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(ref_mu)) > 1e-5
  for a, b in zip(jax.tree.leaves(ref_mu), jax.tree.leaves(mu)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-7, rtol=1e-5)
  np.testing.assert_allclose(float(m['loss']), float(ref_m['loss']), rtol=1e-6)


@pytest.mark.heavy
def test_prefill_into_a_cache_and_decode_on_a_sequence_mesh_equal_unsharded():
  # A prefill into a cache is not context-parallel (its attention is left to GSPMD) but its
  # activations are split along T by the 'length' rule: it and the decode steps after it
  # give the unsharded logits.
  cfg = config_lib.ModelConfig.tiny()
  graphdef, params = _init(cfg)
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 256, (2, 20)), jnp.int32)

  def run(params):
    model = nnx.merge(graphdef, params)
    cache = transformer.init_cache(cfg, 2, 24)
    logits, cache = model(tokens[:, :16], cache=cache)
    outs = [logits]
    for i in range(16, 20):
      logits, cache = model(tokens[:, i:i + 1], cache=cache)
      outs.append(logits)
    return model(tokens), jnp.concatenate(outs, 1)

  ref_full, ref_steps = jax.jit(run)(params)
  mesh = _mesh(2, data=2, tensor=2)
  with sharding.use_mesh(mesh):
    full, steps = jax.jit(run)(sharding.shard_state(params, mesh))
  np.testing.assert_allclose(np.asarray(full), np.asarray(ref_full), atol=TOL, rtol=0)
  np.testing.assert_allclose(np.asarray(steps), np.asarray(ref_steps), atol=TOL, rtol=0)
  np.testing.assert_allclose(np.asarray(steps), np.asarray(ref_full), atol=1e-5, rtol=0)
