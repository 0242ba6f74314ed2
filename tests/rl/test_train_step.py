"""Train step: schedule, sharded == unsharded, microbatched == full batch, skips, master weights."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import config as config_lib
from models import sharding
from models import transformer
from rl import batch as batch_lib
from rl import grpo
from rl import sampler
from rl import sft
from rl import train_step as ts

CFG = config_lib.ModelConfig.tiny()


def _grpo_batch(graphdef, params, b=8, p=5, n=7, seed=0, ref=False):
  """Hand-built rollouts (padded prompts, early stops) whose old log-probs are the policy's."""
  rng = np.random.default_rng(seed)
  pm = np.sort((rng.random((b, p)) < 0.8).astype(np.int32), 1)
  pm[:, -1] = 1
  lengths = rng.integers(1, n + 1, b)
  mask = (np.arange(n)[None] < lengths[:, None]).astype(np.int32)
  out = sampler.SampleOutput(
      prompt_tokens=rng.integers(2, 256, (b, p)).astype(np.int32) * pm, prompt_mask=pm,
      tokens=rng.integers(2, 256, (b, n)).astype(np.int32) * mask, mask=mask,
      logprobs=np.zeros((b, n), np.float32), sampling_logprobs=np.zeros((b, n), np.float32),
      lengths=lengths.astype(np.int32), truncated=lengths == n)
  batch = batch_lib.from_samples(out, rng.normal(size=b))
  lp = np.asarray(batch_lib.compute_logprobs(graphdef, params, batch)) * batch.loss_mask
  batch = batch._replace(old_logprobs=lp)
  if ref:
    batch = batch._replace(ref_logprobs=lp + rng.normal(scale=0.1, size=lp.shape).astype(np.float32))
  return batch


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


OPT_CFG = ts.OptimizerConfig(lr=1e-3, eps=1e-6, weight_decay=0.1, warmup_steps=2)
GRPO_CFG = grpo.GrpoConfig(kl_coef=0.05)
GRPO = ts.LossSpec(grpo.GrpoConfig, grpo.loss_fn, grpo.normalizers)
SFT = ts.LossSpec(sft.SftConfig, sft.loss_fn, sft.normalizers)


@functools.cache
def _setup():
  """One model, optimizer and compiled unsharded GRPO step shared by several tests."""
  graphdef, params = nnx.split(transformer.create(CFG, seed=0))
  opt = ts.make_optimizer(OPT_CFG)
  step = ts.make_train_step(graphdef, GRPO, GRPO_CFG, opt, lr_schedule=ts.make_schedule(OPT_CFG))
  return graphdef, params, opt, step


def _max_diff(a, b):
  return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _schedule_formula(cfg: ts.OptimizerConfig, count: int) -> float:
  """The schedule's definition in float64: linear warm-up from lr / W, then constant or cosine."""
  lr = cfg.lr
  if cfg.warmup_steps:
    lr *= min(1.0, (count + 1) / cfg.warmup_steps)
  if cfg.schedule == 'cosine':
    t = min(max((count - cfg.warmup_steps) / cfg.decay_steps, 0.0), 1.0)
    lr *= cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
  return lr


@pytest.mark.parametrize('cfg', [
    ts.OptimizerConfig(lr=1e-3, warmup_steps=4),
    ts.OptimizerConfig(lr=2e-6, warmup_steps=30),
    ts.OptimizerConfig(lr=1e-3, warmup_steps=1),
    # One warm-up step: full lr from the start, yet the decay starts only at c = 1.
    ts.OptimizerConfig(lr=1e-3, warmup_steps=1, schedule='cosine', decay_steps=5,
                       min_lr_ratio=0.2),
    ts.OptimizerConfig(lr=1.0, warmup_steps=2, schedule='cosine', decay_steps=10,
                       min_lr_ratio=0.1),
    ts.OptimizerConfig(lr=1e-3, warmup_steps=20, schedule='cosine', decay_steps=580,
                       min_lr_ratio=0.1),
    ts.OptimizerConfig(lr=5e-5, schedule='cosine', decay_steps=7),
    ts.OptimizerConfig(lr=5e-5, schedule='cosine', decay_steps=1),   # the shortest
])
@pytest.mark.parametrize('make', [ts.make_schedule, ts.optax_schedule])
def test_schedule_matches_its_formula_at_every_step(cfg, make):
  schedule = make(cfg)
  counts = np.arange(cfg.warmup_steps + cfg.decay_steps + 5)
  got = np.asarray(jax.jit(jax.vmap(schedule))(jnp.asarray(counts, jnp.int32)))
  want = np.array([_schedule_formula(cfg, int(c)) for c in counts])
  # float32 rounding of values of size <= learning_rate.
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-7 * cfg.lr)


def test_constant_schedule_without_warmup_is_exactly_the_learning_rate():
  for lr in (1e-3, 2e-6, 3.7e-5):
    schedule = ts.make_schedule(ts.OptimizerConfig(lr=lr))
    assert all(schedule(jnp.int32(c)) == lr for c in (0, 1, 1000))
    assert float(jax.jit(schedule)(jnp.int32(5))) == float(np.float32(lr))


def test_loss_configs_and_clear_errors():
  cfg = ts.loss_config(GRPO, ml_collections.ConfigDict({'clip_eps_high': 0.28}))
  assert cfg == grpo.GrpoConfig(clip_eps_high=0.28)
  with pytest.raises(ValueError, match=r"unknown field\(s\) \['clip'\]"):
    ts.loss_config(GRPO, {'clip': 0.2})
  with pytest.raises(TypeError, match="the loss is a LossSpec .* got 'ppo'"):
    ts.make_train_step(None, 'ppo', None, optax.sgd(1.0))
  with pytest.raises(ValueError, match=r'OptimizerConfig.lr=0.0: must be > 0'):
    ts.make_optimizer({'lr': 0.0})
  with pytest.raises(ValueError, match='decay_steps'):
    ts.OptimizerConfig(lr=1.0, schedule='cosine')


def _adam_mu(state):
  """Adam's first moment after one step: (1 - b1) * (clipped) gradient."""
  return optax.tree_utils.tree_get(state.opt_state, 'mu')


@pytest.mark.heavy
def test_microbatched_and_remat_gradients_equal_full_batch():
  graphdef, params, opt, step = _setup()
  remat_graphdef, _ = nnx.split(transformer.create(CFG.replace(remat=True), seed=0))
  batch = _grpo_batch(graphdef, params, ref=True)
  full, m1 = step(ts.init_state(_copy(params), opt), batch)
  micro, m4 = ts.make_train_step(graphdef, GRPO, GRPO_CFG, opt, microbatches=4)(
      ts.init_state(_copy(params), opt), batch)
  remat, _ = ts.make_train_step(remat_graphdef, GRPO, GRPO_CFG, opt)(
      ts.init_state(_copy(params), opt), batch)
  assert jax.tree.structure(full.opt_state) == jax.tree.structure(micro.opt_state)
  mu = _adam_mu(full)
  assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(mu)) > 1e-4
  # Gradients (Adam's mu) agree to float32 rounding; so do the metrics.
  assert _max_diff(mu, _adam_mu(micro)) < 1e-8
  assert _max_diff(mu, _adam_mu(remat)) < 1e-8
  for k in ('loss', 'grad_norm', 'ratio_max', 'tokens', 'kl', 'entropy', 'clip_frac'):
    np.testing.assert_allclose(float(m4[k]), float(m1[k]), rtol=1e-5, atol=1e-7, err_msg=k)


def test_microbatch_rows_take_the_count_from_each_batchs_rows():
  """microbatch_rows (packed updates): a batch of R rows runs R / rows microbatches, the count
  read from its shape when traced, with the gradient of the whole batch; a row count that is
  not a whole number of microbatches is refused."""
  graphdef, params, opt, step = _setup()
  real_split = ts._split_microbatches
  by_rows_step = ts.make_train_step(graphdef, GRPO, GRPO_CFG, opt, microbatch_rows=2,
                                    microbatches=7)
  for b in (4, 8):
    batch = _grpo_batch(graphdef, params, b=b, seed=b, ref=True)
    counts = []

    def spy(batch, m):
      counts.append(m)
      return real_split(batch, m)
    ts._split_microbatches = spy
    try:
      by_rows, m2 = by_rows_step(ts.init_state(_copy(params), opt), batch)
    finally:
      ts._split_microbatches = real_split
    assert counts == [b // 2]                  # the count follows the rows, not microbatches=7
    if b == 4:     # the gradient check once (each batch size is a compile of every step)
      continue
    full, m1 = step(ts.init_state(_copy(params), opt), batch)
    fixed, _ = ts.make_train_step(graphdef, GRPO, GRPO_CFG, opt, microbatches=b // 2)(
        ts.init_state(_copy(params), opt), batch)
    assert _max_diff(_adam_mu(by_rows), _adam_mu(fixed)) < 1e-9
    assert _max_diff(_adam_mu(by_rows), _adam_mu(full)) < 1e-8
    np.testing.assert_allclose(float(m2['loss']), float(m1['loss']), rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match='not a whole number of microbatches'):
    ts.make_train_step(graphdef, GRPO, GRPO_CFG, opt, microbatch_rows=3)(
        ts.init_state(_copy(params), opt), _grpo_batch(graphdef, params, b=4))
  with pytest.raises(ValueError, match='microbatch_rows=0'):
    ts.make_train_step(graphdef, GRPO, GRPO_CFG, opt, microbatch_rows=0)


def test_sharded_step_equals_unsharded_after_three_steps():
  graphdef, params, opt, step = _setup()
  batches = [_grpo_batch(graphdef, params, seed=s, ref=True) for s in range(3)]
  state = ts.init_state(_copy(params), opt)
  for b in batches:
    state, _ = step(state, b)

  mesh = sharding.make_mesh((2, 2, 2))
  sstate = ts.init_state(_copy(params), opt, mesh=mesh)
  sstep = ts.make_train_step(graphdef, GRPO, GRPO_CFG, opt, mesh=mesh, state=sstate,
                             microbatches=2, lr_schedule=ts.make_schedule(OPT_CFG))
  expect = ts.state_shardings(sstate, opt, mesh)
  for b in batches:
    sstate, metrics = sstep(sstate, b)
  assert int(sstate.step) == 3 and float(metrics['lr']) == pytest.approx(1e-3)
  assert _max_diff(state.params, sstate.params) <= 1e-5
  assert _max_diff(state.opt_state, sstate.opt_state) <= 1e-5
  # Params and Adam moments stay laid out by their logical axes.
  got = jax.tree.map(lambda x: x.sharding, sstate)
  assert jax.tree.leaves(got) == jax.tree.leaves(expect)
  assert sstate.params['embed'][...].sharding.spec == P('tensor', 'fsdp')


def test_the_step_donates_the_state_it_replaces_and_keeps_the_batch():
  graphdef, params, opt, step = _setup()
  state = ts.init_state(_copy(params), opt)
  batch = jax.tree.map(jnp.asarray, _grpo_batch(graphdef, params, ref=True))
  new, _ = step(state, batch)
  assert all(x.is_deleted() for x in jax.tree.leaves(state.params))
  assert not any(x.is_deleted() for x in jax.tree.leaves(batch))
  assert not any(x.is_deleted() for x in jax.tree.leaves(new.params))


def test_non_finite_step_is_skipped_and_counted():
  graphdef, params, opt, step = _setup()
  state = ts.init_state(_copy(params), opt)
  good = _grpo_batch(graphdef, params, ref=True)
  bad = good._replace(advantages=good.advantages.copy())
  bad.advantages[3] = np.nan
  before = _copy(state)
  state, metrics = step(state, bad)
  assert not np.isfinite(float(metrics['loss']))
  assert int(state.skipped) == 1 and int(metrics['skipped']) == 1 and int(state.step) == 0
  assert _max_diff(state.params, before.params) == 0
  assert _max_diff(state.opt_state, before.opt_state) == 0
  assert float(metrics['update_ratio']) == 0.0           # nothing changed
  state, metrics = step(state, good)
  assert int(state.step) == 1 and int(state.skipped) == 1 and np.isfinite(float(metrics['loss']))
  assert _max_diff(state.params, before.params) > 0
  # update_ratio = |new - old| / |old| over every parameter (cascade.divergence judges it).
  norm = lambda tree: np.sqrt(sum(float(jnp.sum(jnp.asarray(x, jnp.float32) ** 2))
                                  for x in jax.tree.leaves(tree)))
  change = jax.tree.map(lambda a, b: jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32),
                        state.params, before.params)
  assert float(metrics['update_ratio']) == pytest.approx(norm(change) / norm(before.params),
                                                         rel=1e-4)
  assert 0 < float(metrics['update_ratio']) < 0.01


def test_metrics_of_a_grpo_step():
  graphdef, params, opt, step = _setup()
  batch = _grpo_batch(graphdef, params, ref=True)
  _, m = ts.run_step(step, ts.init_state(_copy(params), opt), batch)
  for k in ('loss', 'grad_norm', 'lr', 'ratio_mean', 'ratio_max', 'clip_frac', 'kl', 'entropy',
            'logprob_gap', 'logprob_gap_max', 'logprob_gap_outside_frac', 'skipped', 'tokens',
            'tokens_per_s', 'step_s'):
    assert k in m and np.isfinite(m[k]), k
  assert m['lr'] == pytest.approx(5e-4)            # first of two warm-up steps
  assert m['ratio_mean'] == pytest.approx(1.0, abs=1e-5) and m['logprob_gap'] < 1e-5
  assert m['logprob_gap_max'] < 1e-4 and m['logprob_gap_outside_frac'] == 0.0
  assert m['tokens'] == batch.loss_mask.sum()
  # Real tokens through the model (prompt and completion) per second of this step.
  assert m['tokens_per_s'] * m['step_s'] == pytest.approx(np.count_nonzero(batch.segment_ids))
  lp = batch.old_logprobs[batch.loss_mask > 0]
  assert m['entropy'] == pytest.approx(-lp.mean(), rel=1e-4)
  assert m['kl'] > 0


# Slow: tests/cascade/test_policies_precision.py checks fp32 masters at the paper lr by default.
@pytest.mark.slow
def test_fp32_master_weights_keep_updates_a_bf16_copy_would_lose():
  graphdef32, params32, _, _ = _setup()
  cfg = CFG.replace(param_dtype='bfloat16', dtype='bfloat16')
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  batch = _grpo_batch(graphdef32, params32, ref=True)
  lr = 1e-5
  opt = ts.make_optimizer(ts.OptimizerConfig(lr=lr))
  step = ts.make_train_step(graphdef, GRPO, GRPO_CFG, opt)
  state, m = step(ts.init_state(_copy(params), opt, master_dtype='float32'), batch)
  w0 = np.asarray(params['layers']['mlp']['up_proj'][...].astype(jnp.float32))
  w = state.params['layers']['mlp']['up_proj'][...]
  assert params['layers']['mlp']['up_proj'][...].dtype == jnp.bfloat16
  assert w.dtype == jnp.float32
  # Adam's first step moves a weight by lr * |g| / (|g| + eps) = lr (to 1%) wherever the
  # gradient is not tiny: the float32 master keeps that move on (nearly) every weight.
  moved = np.abs(np.asarray(w) - w0)
  assert np.mean(np.abs(moved - lr) < 0.01 * lr) > 0.99, np.mean(np.abs(moved - lr) < 0.01 * lr)
  # A bfloat16 copy loses it exactly wherever half of bf16's spacing below |w0| exceeds lr
  # (round to nearest goes back to w0); that is most weights.
  lost = 2.0 ** (np.floor(np.log2(np.abs(w0))) - 8) > 2 * lr
  assert lost.mean() > 0.5
  as_bf16 = np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(as_bf16[lost], w0[lost])
  assert (np.asarray(w)[lost] != w0[lost]).all()
  # The forward pass computes in bf16 from the master: the loss is the bf16 model's, exactly.
  _, m_bf16 = step(ts.init_state(_copy(params), opt), batch)
  assert float(m['loss']) == float(m_bf16['loss'])


def _sft_batch(seed=0, rows=4, length=16):
  """Random SFT rows: a 3-token prompt (not learned), then learned tokens."""
  rng = np.random.default_rng(seed)
  ex = [(list(rng.integers(2, 256, length)), [0, 0, 0] + [1] * (length - 3)) for _ in range(rows)]
  return sft.pack(ex, row_len=length)


def test_applied_update_is_lr_times_the_clipped_adamw_direction():
  """Four steps against AdamW written out in numpy: clipping, schedule, bias correction, decay mask."""
  cfg = ts.OptimizerConfig(lr=1e-2, warmup_steps=2, schedule='cosine', decay_steps=2,
                           min_lr_ratio=0.25, b1=0.8, b2=0.9, eps=1e-4, weight_decay=0.3,
                           clip_norm=0.05)
  graphdef, params = nnx.split(transformer.create(CFG, seed=0))
  opt = ts.make_optimizer(cfg)
  step = ts.make_train_step(graphdef, SFT, None, opt, lr_schedule=ts.make_schedule(cfg),
                            donate=False)
  grad = jax.jit(jax.grad(lambda p, b: sft.loss_fn(nnx.merge(graphdef, p), b, sft.SftConfig(),
                                                   sft.normalizers(b, None))[0]))
  state = ts.init_state(params, opt)
  leaves = lambda tree: [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
  m = [np.zeros_like(p) for p in leaves(params)]
  v = [np.zeros_like(p) for p in leaves(params)]
  lrs = [1e-2 / 2, 1e-2, 1e-2, 1e-2 * (0.25 + 0.75 * 0.5)]    # warm-up, then cosine
  for k, lr in enumerate(lrs, start=1):
    batch = _sft_batch(seed=k)
    p0, g = leaves(state.params), leaves(grad(state.params, batch))
    norm = math.sqrt(sum(float(np.sum(x ** 2)) for x in g))
    assert norm > 4 * cfg.clip_norm                   # clipping is active
    g = [x * cfg.clip_norm / norm for x in g]
    m = [cfg.b1 * a + (1 - cfg.b1) * x for a, x in zip(m, g)]
    v = [cfg.b2 * a + (1 - cfg.b2) * x ** 2 for a, x in zip(v, g)]
    direction = [(a / (1 - cfg.b1 ** k)) / (np.sqrt(b / (1 - cfg.b2 ** k)) + cfg.eps)
                 + (cfg.weight_decay * p if p.ndim >= 2 else 0.0)
                 for a, b, p in zip(m, v, p0)]
    state, metrics = step(state, batch)
    assert float(metrics['lr']) == pytest.approx(lr, rel=1e-6)
    applied = [p1 - p for p1, p in zip(leaves(state.params), p0)]
    for got, d in zip(applied, direction):
      np.testing.assert_allclose(got, -lr * d, rtol=0, atol=1e-4 * lr, err_msg=f'step {k}')
    np.testing.assert_allclose(np.concatenate([x.ravel() for x in leaves(_adam_mu(state))]),
                               np.concatenate([x.ravel() for x in m]), rtol=1e-4, atol=1e-9)
