"""GRPO: advantages and the loss against a float64 numpy reference; a learning test."""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import batch as batch_lib
from rl import filtering
from rl import grpo
from rl import sampler


# ---------------------------------------------------------------- advantages

def _ref_advantages(rewards, g, kind, eps=1e-6):
  out = []
  for i in range(0, len(rewards), g):
    grp = [float(x) for x in rewards[i:i + g]]
    mean = statistics.fmean(grp)
    for j, r in enumerate(grp):
      if kind == 'grpo':
        out.append((r - mean) / (statistics.stdev(grp) + eps))
      elif kind == 'dr_grpo':
        out.append(r - mean)
      else:
        out.append(r - statistics.fmean(grp[:j] + grp[j + 1:]))
  return np.array(out)


@pytest.mark.parametrize('kind', ['grpo', 'dr_grpo', 'rloo'])
def test_advantages_match_reference(kind):
  rewards = np.random.default_rng(0).normal(size=24)
  rewards[8:12] = 0.5                                      # one all-equal group
  got = grpo.advantages(rewards, 4, kind)
  np.testing.assert_allclose(got, _ref_advantages(rewards, 4, kind), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[8:12], 0.0)
  assert got.dtype == np.float32 and got.shape == (24,)


def test_advantages_bad_input():
  with pytest.raises(ValueError, match='group_size'):
    grpo.advantages(np.zeros(10), 4)
  with pytest.raises(ValueError, match='unknown advantage kind'):
    grpo.advantages(np.zeros(8), 4, 'ppo')
  with pytest.raises(ValueError, match='G >= 2'):
    grpo.advantages(np.zeros(8), 1)


# ---------------------------------------------------------------- loss

def _random_batch(seed=0, b=6, l=9):
  rng = np.random.default_rng(seed)
  mask = (rng.random((b, l)) < 0.7).astype(np.float32)
  mask[2] = 0.0                                          # a padding row
  old = -rng.random((b, l)).astype(np.float32) * 3
  new = old + rng.normal(scale=0.4, size=(b, l)).astype(np.float32)   # ratios beyond the clip
  ref = old + rng.normal(scale=0.3, size=(b, l)).astype(np.float32)
  batch = batch_lib.TrainBatch(
      tokens=np.zeros((b, l), np.int32), positions=np.zeros((b, l), np.int32),
      segment_ids=np.ones((b, l), np.int32), targets=np.zeros((b, l), np.int32),
      loss_mask=mask, old_logprobs=old * mask, advantages=rng.normal(size=b).astype(np.float32),
      truncated=np.array([False, True, False, False, True, False]), ref_logprobs=ref)
  entropy = rng.random((b, l)).astype(np.float32) * 2
  return batch, new, entropy


def _ref_loss(new, batch, cfg, entropy):
  """Float64 numpy GRPO loss with explicit per-row, per-token loops."""
  new = new.astype(np.float64)
  mask = batch.loss_mask.astype(np.float64).copy()
  if cfg.mask_truncated:
    mask[batch.truncated] = 0
  per_row_sum, per_row_len = [], []
  ratios, clipped, kls = [], [], []
  for i in range(new.shape[0]):
    a = float(batch.advantages[i])
    s = 0.0
    for t in range(new.shape[1]):
      if not mask[i, t]:
        continue
      r = np.exp(new[i, t] - float(batch.old_logprobs[i, t]))
      rc = min(max(r, 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high)
      x = -min(r * a, rc * a)
      ratios.append(r)
      clipped.append((a > 0 and r > 1 + cfg.clip_eps_high) or (a < 0 and r < 1 - cfg.clip_eps_low))
      d = float(batch.ref_logprobs[i, t]) - new[i, t]
      kl = -d if cfg.kl_estimator == 'k1' else np.exp(d) - d - 1
      kls.append(kl)
      x += cfg.kl_coef * kl - cfg.entropy_coef * float(entropy[i, t])
      s += x
    per_row_sum.append(s)
    per_row_len.append(mask[i].sum())
  if cfg.loss_agg == 'token':
    loss = sum(per_row_sum) / sum(per_row_len)
  else:
    seqs = [s / n for s, n in zip(per_row_sum, per_row_len) if n > 0]
    loss = sum(seqs) / len(seqs)
  return loss, dict(ratio_mean=np.mean(ratios), ratio_max=np.max(ratios),
                    clip_frac=np.mean(clipped), kl=np.mean(kls), tokens=mask.sum())


CONFIGS = [
    grpo.GrpoConfig(),
    grpo.GrpoConfig(loss_agg='seq_mean_token_mean'),
    grpo.GrpoConfig(clip_eps_low=0.2, clip_eps_high=0.28),
    grpo.GrpoConfig(kl_coef=0.1, kl_estimator='k1'),
    grpo.GrpoConfig(kl_coef=0.05, kl_estimator='k3', loss_agg='seq_mean_token_mean'),
    grpo.GrpoConfig(entropy_coef=0.01),
    grpo.GrpoConfig(mask_truncated=True, clip_eps_high=0.3),
    grpo.GrpoConfig(mask_truncated=True, loss_agg='seq_mean_token_mean', kl_coef=0.2,
                    entropy_coef=0.02),
]


@pytest.mark.parametrize('cfg', CONFIGS, ids=lambda c: repr(c)[len('GrpoConfig('):-1][:60])
def test_grpo_loss_matches_float64_reference(cfg):
  batch, new, entropy = _random_batch()
  loss, metrics = grpo.grpo_loss(jnp.asarray(new), batch, cfg, entropy=jnp.asarray(entropy))
  ref, ref_m = _ref_loss(new, batch, cfg, entropy)
  np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-6)
  for k in ('ratio_mean', 'ratio_max', 'clip_frac', 'tokens'):
    np.testing.assert_allclose(float(metrics[k]), ref_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
  if cfg.kl_coef:
    np.testing.assert_allclose(float(metrics['kl']), ref_m['kl'], rtol=1e-5, atol=1e-6)
  else:
    assert 'kl' not in metrics
  assert 0 < ref_m['clip_frac'] < 1         # the test really exercises clipping


def test_on_policy_ratio_is_one_and_gradient_is_reinforce():
  batch, _, _ = _random_batch(seed=3)
  new = jnp.asarray(batch.old_logprobs)
  cfg = grpo.GrpoConfig()
  loss, metrics = grpo.grpo_loss(new, batch, cfg)
  assert float(metrics['ratio_mean']) == 1.0 and float(metrics['ratio_max']) == 1.0
  assert float(metrics['logprob_gap']) == 0.0 and float(metrics['clip_frac']) == 0.0
  grad = jax.grad(lambda lp: grpo.grpo_loss(lp, batch, cfg)[0])(new)
  # d/dlogp of -1/sum|o| sum A_i logp_it.
  expect = -batch.advantages[:, None] * batch.loss_mask / batch.loss_mask.sum()
  np.testing.assert_allclose(grad, expect, rtol=1e-6, atol=1e-8)
  value = -np.sum(batch.advantages[:, None] * batch.loss_mask) / batch.loss_mask.sum()
  np.testing.assert_allclose(float(loss), value, rtol=1e-6)


@pytest.mark.parametrize('loss_agg', grpo.AGGREGATIONS)
def test_microbatches_add_up_with_whole_batch_normalizers(loss_agg):
  batch, new, entropy = _random_batch(seed=5)
  cfg = grpo.GrpoConfig(loss_agg=loss_agg, kl_coef=0.1)
  full, _ = grpo.grpo_loss(jnp.asarray(new), batch, cfg)
  norm = grpo.normalizers(batch, cfg)
  halves = [jax.tree.map(lambda x: x[s], batch) for s in (slice(0, 3), slice(3, 6))]
  parts = [grpo.grpo_loss(jnp.asarray(new[s]), h, cfg, norm)[0]
           for s, h in zip((slice(0, 3), slice(3, 6)), halves)]
  np.testing.assert_allclose(float(parts[0] + parts[1]), float(full), rtol=1e-6)


def test_per_token_truncation_masks_as_per_row_truncation():
  """A packed batch marks truncation per token ([B, L]); it masks exactly as the row flag."""
  batch, new, _ = _random_batch(seed=7)
  cfg = grpo.GrpoConfig(mask_truncated=True)
  per_token = batch._replace(truncated=np.repeat(batch.truncated[:, None], new.shape[1], 1))
  np.testing.assert_array_equal(grpo.loss_mask(per_token, cfg), grpo.loss_mask(batch, cfg))
  a, _ = grpo.grpo_loss(jnp.asarray(new), batch, cfg)
  b, _ = grpo.grpo_loss(jnp.asarray(new), per_token, cfg)
  assert float(a) == float(b)
  assert not np.array_equal(grpo.loss_mask(batch, cfg), grpo.loss_mask(batch, grpo.GrpoConfig()))


@pytest.mark.parametrize('entropy_coef', [0.0, 0.01])
def test_loss_fn_computes_the_entropy_exactly_when_it_is_weighted(monkeypatch, entropy_coef):
  batch, new, entropy = _random_batch(seed=8)
  asked = []

  def fake_stats(model, b, entropy=False, replay=True):
    assert model == 'model' and b is batch and replay    # replay: the config's default
    asked.append(entropy)
    out = {'logprobs': jnp.asarray(new)}
    if entropy:
      out['entropy'] = jnp.asarray(entropy_values)
    return out

  entropy_values = entropy
  monkeypatch.setattr(batch_lib, 'policy_stats', fake_stats)
  cfg = grpo.GrpoConfig(entropy_coef=entropy_coef)
  loss, _ = grpo.loss_fn('model', batch, cfg, grpo.normalizers(batch, cfg))
  assert asked == [entropy_coef > 0]
  want, _ = grpo.grpo_loss(jnp.asarray(new), batch, cfg,
                           entropy=jnp.asarray(entropy) if entropy_coef else None)
  assert float(loss) == float(want)


def test_missing_inputs_are_clear_errors():
  batch, new, _ = _random_batch()
  with pytest.raises(ValueError, match='ref_logprobs'):
    grpo.grpo_loss(jnp.asarray(new), batch._replace(ref_logprobs=None), grpo.GrpoConfig(kl_coef=0.1))
  with pytest.raises(ValueError, match='entropy'):
    grpo.grpo_loss(jnp.asarray(new), batch, grpo.GrpoConfig(entropy_coef=0.1))
  with pytest.raises(ValueError, match='loss_agg'):
    grpo.GrpoConfig(loss_agg='sum')
  with pytest.raises(ValueError, match='kl_estimator'):
    grpo.GrpoConfig(kl_estimator='k2')


# ---------------------------------------------------------------- learning

@pytest.mark.heavy
def test_grpo_learns_to_emit_a_target_token():
  """Reward 1 iff the completion contains token 7: from ~2% to >= 90% with the real sampler."""
  from flax import nnx
  from models import config as config_lib
  from models import transformer
  from rl import train_step as ts

  cfg = config_lib.ModelConfig.tiny()
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  opt = ts.make_optimizer(ts.OptimizerConfig(lr=3e-3))
  state = ts.init_state(params, opt)
  loss = ts.LossSpec(grpo.GrpoConfig, grpo.loss_fn, grpo.normalizers)
  step = ts.make_train_step(graphdef, loss, grpo.GrpoConfig(), opt)
  samp = sampler.Sampler(graphdef, cfg, eos_ids=(1,), pad_id=0)
  sp = sampler.SamplingParams(temperature=1.0, max_new_tokens=8)
  rng = np.random.default_rng(0)
  keys = iter(jax.random.split(jax.random.key(0), 1000))
  g = 8

  def reward(out):
    return ((out.tokens == 7) & (out.mask > 0)).any(1).astype(np.float32)

  history = []

  def draw(n):
    out = samp.generate(state.params, [list(rng.integers(10, 200, 4)) for _ in range(n)],
                        next(keys), sp, num_samples=g)
    history.append(reward(out).mean())
    return out, reward(out)

  for i in range(150):
    filled = filtering.fill_groups(draw, num_groups=16, group_size=g, max_rounds=2)
    batch = batch_lib.from_samples(filled.rows, grpo.advantages(filled.rewards, g),
                                   valid=filled.valid)
    state, metrics = step(state, batch)
    assert abs(float(metrics['ratio_mean']) - 1) < 1e-4      # strictly on-policy
    if np.mean(history[-3:]) >= 0.97:
      break
  held_out = samp.generate(state.params, [list(rng.integers(10, 200, 4)) for _ in range(64)],
                           next(keys), sp, num_samples=2)
  print(f'GRPO: reward {history[0]:.3f} -> {reward(held_out).mean():.3f} held-out after {i + 1} steps')
  assert history[0] < 0.2
  assert reward(held_out).mean() >= 0.9
  assert int(state.skipped) == 0 and int(state.step) == i + 1
