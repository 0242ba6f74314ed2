"""GRPO's sampler/trainer mismatch correction (TIS, masking) on constructed mismatches.

A small vocabulary, a trainer distribution p = softmax(theta) and a perturbed
sampler distribution q: every token is enumerated with its sampler probability
q(v) as weight, so sum_v q(v) * grad loss(v) is the exact expected gradient of
a batch sampled from q, compared in float64 numpy with the on-policy gradient
under p (TIS with a cap above every ratio) and with the biased values that
truncation, masking and the uncorrected PPO clip give. The default (no
correction) is checked bit for bit against the loss as it was before the
correction existed.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import transformer
from rl import batch as batch_lib
from rl import grpo
from rl import train_step as train_lib

V = 6


def _dists(seed=0, scale=0.8):
  """theta [V] (p = softmax(theta)), log q [V] of a perturbed sampler, advantages A [V]."""
  rng = np.random.default_rng(seed)
  theta = rng.normal(size=V)
  log_p = theta - np.log(np.exp(theta).sum())
  noisy = theta + rng.normal(scale=scale, size=V)
  log_q = noisy - np.log(np.exp(noisy).sum())
  return theta, log_p, log_q, rng.normal(size=V)


def _one_token(v, log_q_v, a):
  """A batch of one row whose one loss token is v, sampled with log-prob log_q_v."""
  one = lambda x, dt: np.array([[x]], dt)
  return batch_lib.TrainBatch(
      tokens=one(0, np.int32), positions=one(0, np.int32), segment_ids=one(1, np.int32),
      targets=one(v, np.int32), loss_mask=one(1.0, np.float32),
      old_logprobs=one(log_q_v, np.float32), advantages=np.array([a], np.float32))


def _expected_grad(cfg, theta, log_q, adv):
  """sum_v q(v) * d loss(v) / d theta: the exact expected gradient over samples from q."""
  out = np.zeros(V)
  for v in range(V):
    batch = _one_token(v, log_q[v], adv[v])
    f = lambda th: grpo.grpo_loss(jax.nn.log_softmax(th)[v].reshape(1, 1), batch, cfg)[0]
    out += np.exp(log_q[v]) * np.asarray(jax.grad(f)(jnp.asarray(theta, jnp.float32)), np.float64)
  return out


def _reference(weight, log_p, log_q, adv):
  """float64: sum_v q(v) * weight(v) * (-A(v)) * grad log p(v), grad log p(v) = e_v - p."""
  p = np.exp(log_p)
  return sum(np.exp(log_q[v]) * weight[v] * -adv[v] * (np.eye(V)[v] - p) for v in range(V))


def test_the_constructed_mismatch_is_wide():
  _, log_p, log_q, _ = _dists()
  rho = np.exp(log_p - log_q)
  assert rho.min() < 0.5 and rho.max() > 2.0, rho     # outside the default band on both sides


def test_tis_with_a_large_cap_is_the_on_policy_gradient_in_expectation():
  theta, log_p, log_q, adv = _dists()
  p = np.exp(log_p)
  on_policy = -(p * (adv - p @ adv))         # d/dtheta of -E_p[A]
  got = _expected_grad(grpo.GrpoConfig(tis_cap=1e4), theta, log_q, adv)
  np.testing.assert_allclose(got, on_policy, rtol=1e-5, atol=1e-6)
  # Uncorrected, the sampler's tokens give another gradient (what TIS removes).
  plain = _reference(np.ones(V), log_p, log_q, adv)
  assert np.abs(plain - on_policy).max() > 0.05


def test_the_uncorrected_clip_drops_positive_and_keeps_unbounded_negative_mismatched_tokens():
  """Off (the default), r = p / q is the PPO ratio: tokens with A > 0 and r > 1 + eps get no
  gradient; tokens with A < 0 keep theirs, weighted by r however large."""
  theta, log_p, log_q, adv = _dists()
  r = np.exp(log_p - log_q)
  kept = ~(((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8)))
  assert not kept.all() and ((adv < 0) & (r > 1.2)).any()
  got = _expected_grad(grpo.GrpoConfig(), theta, log_q, adv)
  np.testing.assert_allclose(got, _reference(r * kept, log_p, log_q, adv), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('cap', [1.0, 1.5, 3.0])
def test_truncation_gives_the_capped_weights(cap):
  theta, log_p, log_q, adv = _dists()
  rho = np.exp(log_p - log_q)
  got = _expected_grad(grpo.GrpoConfig(tis_cap=cap), theta, log_q, adv)
  np.testing.assert_allclose(got, _reference(np.minimum(rho, cap), log_p, log_q, adv),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('tis_cap', [None, 2.0])
def test_token_masking_drops_tokens_outside_the_band(tis_cap):
  """Masking alone weights kept tokens by 1; with a cap at the band's top it is masked
  importance sampling (IcePop: rho inside the band, 0 outside)."""
  theta, log_p, log_q, adv = _dists()
  rho = np.exp(log_p - log_q)
  keep = (rho >= 0.5) & (rho <= 2.0)
  assert 0 < keep.sum() < V
  cfg = grpo.GrpoConfig(mismatch_mask='token', tis_cap=tis_cap)
  got = _expected_grad(cfg, theta, log_q, adv)
  weight = keep * (1.0 if tis_cap is None else rho)
  np.testing.assert_allclose(got, _reference(weight, log_p, log_q, adv), rtol=1e-5, atol=1e-6)


def test_sequence_masking_judges_the_geometric_mean_of_a_sequence():
  """Two-token sequences, each position its own p_t and q_t: every one of the V^2 sequences
  weighted by q_1 q_2; a sequence is kept iff sqrt(rho_1 rho_2) is in the band."""
  rng = np.random.default_rng(1)
  theta = rng.normal(size=(2, V))
  noisy = theta + rng.normal(scale=0.8, size=(2, V))
  log_p = theta - np.log(np.exp(theta).sum(1, keepdims=True))
  log_q = noisy - np.log(np.exp(noisy).sum(1, keepdims=True))
  adv = rng.normal(size=(V, V))
  lo, hi = 0.6, 1.5
  cfg = grpo.GrpoConfig(mismatch_mask='sequence', mismatch_mask_low=lo, mismatch_mask_high=hi)
  got, want, kept = np.zeros((2, V)), np.zeros((2, V)), []
  for v1, v2 in itertools.product(range(V), repeat=2):
    vs = (v1, v2)
    q = np.exp(log_q[0, v1] + log_q[1, v2])
    batch = batch_lib.TrainBatch(
        tokens=np.zeros((1, 2), np.int32), positions=np.array([[0, 1]], np.int32),
        segment_ids=np.ones((1, 2), np.int32), targets=np.array([vs], np.int32),
        loss_mask=np.ones((1, 2), np.float32),
        old_logprobs=np.array([[log_q[0, v1], log_q[1, v2]]], np.float32),
        advantages=np.array([adv[vs]], np.float32))
    f = lambda th, batch=batch, vs=vs: grpo.grpo_loss(
        jnp.stack([jax.nn.log_softmax(th[t])[vs[t]] for t in range(2)]).reshape(1, 2),
        batch, cfg)[0]
    got += q * np.asarray(jax.grad(f)(jnp.asarray(theta, jnp.float32)), np.float64)
    g = np.exp((log_p[0, v1] - log_q[0, v1] + log_p[1, v2] - log_q[1, v2]) / 2)
    keep = lo <= g <= hi
    kept.append(keep)
    for t in range(2):                       # token loss: 1/2 per token, grad log p = e_v - p
      want[t] += q * keep * -adv[vs] / 2 * (np.eye(V)[vs[t]] - np.exp(log_p[t]))
  assert 0 < sum(kept) < V * V
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- batches

def _random_batch(seed=0, b=6, l=9, gap=0.5):
  rng = np.random.default_rng(seed)
  mask = (rng.random((b, l)) < 0.7).astype(np.float32)
  mask[2] = 0.0                                                          # a padding row
  old = -rng.random((b, l)).astype(np.float32) * 3
  new = old + rng.normal(scale=gap, size=(b, l)).astype(np.float32)     # the trainer's
  batch = batch_lib.TrainBatch(
      tokens=np.zeros((b, l), np.int32), positions=np.zeros((b, l), np.int32),
      segment_ids=np.ones((b, l), np.int32), targets=np.zeros((b, l), np.int32),
      loss_mask=mask, old_logprobs=old * mask, advantages=rng.normal(size=b).astype(np.float32),
      truncated=np.array([False, True, False, False, True, False])[:b],
      ref_logprobs=old + rng.normal(scale=0.3, size=(b, l)).astype(np.float32))
  return batch, new, rng.random((b, l)).astype(np.float32) * 2


def _loss_before_correction(logprobs, batch, cfg, norm=None, entropy=None):
  """`rl.grpo.grpo_loss` as it was before the mismatch correction, verbatim."""
  if norm is None:
    norm = grpo.normalizers(batch, cfg)
  mask = grpo.loss_mask(batch, cfg)
  on = mask > 0
  log_ratio = jnp.where(on, logprobs - batch.old_logprobs, 0.0)
  ratio = jnp.exp(log_ratio)
  adv = jnp.asarray(batch.advantages, jnp.float32)
  if adv.ndim == 2:            # per token: a packed batch (`rl.batch.pack`)
    if cfg.loss_agg != 'token':
      raise ValueError(f'GrpoConfig.loss_agg={cfg.loss_agg!r}: a packed batch (several '
                       "sequences per row) needs loss_agg='token'")
  else:
    adv = adv[:, None]
  lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
  pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
  per_token = pg
  tok_mean = lambda x: jnp.sum(x * mask) / norm['tokens']
  metrics = {}
  if cfg.kl_coef > 0:
    if batch.ref_logprobs is None:
      raise ValueError(f'GrpoConfig.kl_coef={cfg.kl_coef} needs batch.ref_logprobs '
                       '(fill it with rl.batch.compute_logprobs on the reference params)')
    kl = grpo.kl_penalty(logprobs, batch.ref_logprobs, cfg.kl_estimator)
    per_token = per_token + cfg.kl_coef * kl
    metrics['kl'] = tok_mean(kl)
  if cfg.entropy_coef > 0:
    if entropy is None:
      raise ValueError(f'GrpoConfig.entropy_coef={cfg.entropy_coef} needs the entropy argument')
    per_token = per_token - cfg.entropy_coef * entropy
    metrics['entropy_full'] = tok_mean(entropy)
  loss = grpo.aggregate(per_token, mask, norm, cfg.loss_agg)
  clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
  metrics.update(
      pg_loss=grpo.aggregate(pg, mask, norm, cfg.loss_agg),
      ratio_mean=tok_mean(ratio),
      ratio_max=jnp.max(jnp.where(on, ratio, 0.0)),
      clip_frac=tok_mean(clipped.astype(jnp.float32)),
      entropy=tok_mean(-logprobs),
      logprob_gap=tok_mean(jnp.abs(log_ratio)),
      tokens=mask.sum(),
  )
  return loss, metrics


OFF = [
    grpo.GrpoConfig(),
    grpo.GrpoConfig(loss_agg='seq_mean_token_mean', clip_eps_high=0.28),
    grpo.GrpoConfig(kl_coef=0.1, kl_estimator='k1', entropy_coef=0.01),
    grpo.GrpoConfig(mask_truncated=True, loss_agg='seq_mean_token_mean', kl_coef=0.2),
]


@pytest.mark.parametrize('cfg', OFF, ids=lambda c: repr(c)[len('GrpoConfig('):-1][:60])
@pytest.mark.parametrize('seed', [0, 1])
def test_the_default_is_the_loss_before_the_correction_bit_for_bit(cfg, seed):
  """Loss, metrics and gradient, jitted as a train step jits them, on random inputs."""
  batch, new, entropy = _random_batch(seed)
  run = lambda fn: jax.jit(jax.value_and_grad(
      lambda lp: fn(lp, batch, cfg, entropy=jnp.asarray(entropy)), has_aux=True))(
          jnp.asarray(new))
  (loss, metrics), grad = run(grpo.grpo_loss)
  (old_loss, old_metrics), old_grad = run(_loss_before_correction)
  assert np.asarray(loss).tobytes() == np.asarray(old_loss).tobytes()
  assert np.asarray(grad).tobytes() == np.asarray(old_grad).tobytes()
  # The gap's max and band share were added since (`rl.grpo.gap_metrics`); the rest is as it was.
  assert metrics.keys() == old_metrics.keys() | {'logprob_gap_max', 'logprob_gap_outside_frac'}
  for k in old_metrics:
    assert np.asarray(metrics[k]).tobytes() == np.asarray(old_metrics[k]).tobytes(), k


def test_a_packed_default_batch_is_unchanged_too():
  batch, new, _ = _random_batch(3)
  packed = batch._replace(advantages=np.broadcast_to(batch.advantages[:, None],
                                                     new.shape).copy())
  a = jax.jit(lambda lp: grpo.grpo_loss(lp, packed, grpo.GrpoConfig()))(jnp.asarray(new))
  b = jax.jit(lambda lp: _loss_before_correction(lp, packed, grpo.GrpoConfig()))(
      jnp.asarray(new))
  np.testing.assert_array_equal(a[0], b[0])
  for k in b[1]:               # the metrics added since (the gap's max and band share) aside
    np.testing.assert_array_equal(a[1][k], b[1][k])


def _ref_corrected(new, batch, cfg, trainer):
  """float64 per-token loop: r against the trainer's old log-probs, weight of rho."""
  mask = batch.loss_mask.astype(np.float64)
  lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
  total, rhos, over, masked = 0.0, [], [], []
  for i, t in zip(*np.nonzero(mask)):
    a = float(batch.advantages[i])
    r = np.exp(float(new[i, t]) - float(trainer[i, t]))
    rho = np.exp(float(trainer[i, t]) - float(batch.old_logprobs[i, t]))
    w = 1.0 if cfg.tis_cap is None else min(rho, cfg.tis_cap)
    out = not cfg.mismatch_mask_low <= rho <= cfg.mismatch_mask_high
    if cfg.mismatch_mask == 'token' and out:
      w = 0.0
    total += -min(r * a, min(max(r, lo), hi) * a) * w
    rhos.append(rho)
    over.append(cfg.tis_cap is not None and rho > cfg.tis_cap)
    masked.append(cfg.mismatch_mask == 'token' and out)
  return total / mask.sum(), dict(mismatch_ratio_mean=np.mean(rhos),
                                  mismatch_ratio_max=np.max(rhos),
                                  mismatch_ratio_min=np.min(rhos),
                                  mismatch_over_cap_frac=np.mean(over),
                                  mismatch_masked_frac=np.mean(masked))


@pytest.mark.parametrize('cfg', [grpo.GrpoConfig(tis_cap=1.5),
                                 grpo.GrpoConfig(mismatch_mask='token'),
                                 grpo.GrpoConfig(tis_cap=2.0, mismatch_mask='token',
                                                 mismatch_mask_low=0.7, clip_eps_high=0.28)])
def test_later_updates_take_ratios_against_the_trainers_old_logprobs(cfg):
  """With several updates per rollout batch the trainer's old log-probs come with the batch:
  the PPO ratio (and its clip) is against them, rho = their ratio to the sampler's."""
  batch, new, _ = _random_batch(4)
  trainer = (batch.old_logprobs + np.random.default_rng(9).normal(
      scale=0.5, size=new.shape).astype(np.float32))
  loss, metrics = grpo.grpo_loss(jnp.asarray(new), batch._replace(trainer_logprobs=trainer), cfg)
  ref, ref_m = _ref_corrected(new, batch, cfg, trainer)
  np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-6)
  for k, v in metrics.items():
    if k.startswith('mismatch_'):
      np.testing.assert_allclose(float(v), ref_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert float(metrics['clip_frac']) > 0            # the clip acts against pi_old_train
  assert ref_m['mismatch_ratio_min'] < 0.5 and ref_m['mismatch_ratio_max'] > 2


def test_the_first_update_needs_no_trainer_logprobs():
  """One update per batch: pi_old_train is the forward's own log-probs (stop-gradient), the
  same loss and gradient as handing them over, the PPO ratio exactly 1, the sampler gap logged."""
  batch, new, _ = _random_batch(5)
  cfg = grpo.GrpoConfig(tis_cap=2.0, mismatch_mask='sequence')
  f = lambda b: jax.value_and_grad(lambda lp: grpo.grpo_loss(lp, b, cfg), has_aux=True)
  (loss, m), g = f(batch)(jnp.asarray(new))
  (loss2, m2), g2 = f(batch._replace(trainer_logprobs=new))(jnp.asarray(new))
  np.testing.assert_allclose(float(loss), float(loss2), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g2), rtol=1e-6, atol=1e-9)
  assert float(m['ratio_max']) == 1.0 and float(m['clip_frac']) == 0.0
  assert float(m['logprob_gap']) > 0.1 and float(m['mismatch_ratio_max']) > 1.0


def test_sequence_masking_in_a_packed_row_judges_each_sequence():
  """Two sequences packed in one row are masked exactly as the same two in rows of their own."""
  rng = np.random.default_rng(6)
  old = -rng.random((2, 5)).astype(np.float32) * 3
  # Per-token ratios on both sides of the band; geometric means ~1 (row 0) and e^0.5 (row 1).
  noise = rng.normal(scale=0.6, size=(2, 5))
  new = (old + noise - noise.mean(1, keepdims=True) + [[0.0], [0.5]]).astype(np.float32)
  batch = batch_lib.TrainBatch(
      tokens=np.zeros((2, 5), np.int32), positions=np.tile(np.arange(5, dtype=np.int32), (2, 1)),
      segment_ids=np.ones((2, 5), np.int32), targets=np.zeros((2, 5), np.int32),
      loss_mask=np.ones((2, 5), np.float32), old_logprobs=old,
      advantages=np.array([1.0, -1.0], np.float32))
  cfg = grpo.GrpoConfig(mismatch_mask='sequence', mismatch_mask_low=0.8, mismatch_mask_high=1.25)
  norm = grpo.normalizers(batch, cfg)
  cat = lambda x: np.concatenate(list(x))[None]
  packed = batch_lib.TrainBatch(
      tokens=cat(batch.tokens), positions=cat(batch.positions),
      segment_ids=np.array([[1] * 5 + [2] * 5], np.int32), targets=cat(batch.targets),
      loss_mask=cat(batch.loss_mask), old_logprobs=cat(batch.old_logprobs),
      advantages=np.repeat(batch.advantages, 5)[None])
  rows = grpo.mismatch_weights(jnp.asarray(new), batch, jnp.asarray(batch.loss_mask), cfg, norm)
  one = grpo.mismatch_weights(jnp.asarray(cat(new)), packed, jnp.asarray(packed.loss_mask), cfg,
                              norm)
  np.testing.assert_allclose(np.asarray(one[0]), cat(np.asarray(rows[0])), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(rows[0]), [[1.0] * 5, [0.0] * 5])   # whole rows
  rho = np.exp(new - old)
  assert rho.min() < 0.8 and rho[0].max() > 1.25      # row 0 kept though some tokens are out
  for k in rows[1]:
    np.testing.assert_allclose(float(one[1][k]), float(rows[1][k]), rtol=1e-6, err_msg=k)


# ---------------------------------------------------------------- the train step

class _Bigram(nnx.Module):
  """The smallest policy `grpo.loss_fn` can train: next-token logits from the current token."""

  def __init__(self, vocab=16, dim=8):
    rngs = nnx.Rngs(0)
    self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim)))
    self.out = nnx.Param(jax.random.normal(rngs.params(), (dim, vocab)))

  def hidden(self, tokens, positions, segment_ids):
    del positions, segment_ids
    return self.embed[...][tokens], None

  def logits_from_hidden(self, h):
    return h @ self.out[...]


def test_microbatches_add_up_and_the_ratio_extremes_reduce_as_min_and_max():
  """A policy through the jitted train step: 1 and 2 microbatches give the same update and
  ratio metrics (min over microbatches, not a sum); off, the loss logs none of them."""
  graphdef, params = nnx.split(_Bigram())
  rng = np.random.default_rng(0)
  b, l = 4, 8
  tokens = rng.integers(0, 16, (b, l)).astype(np.int32)
  batch = batch_lib.TrainBatch(
      tokens=tokens, positions=np.tile(np.arange(l, dtype=np.int32), (b, 1)),
      segment_ids=np.ones((b, l), np.int32),
      targets=np.concatenate([tokens[:, 1:], np.zeros((b, 1), np.int32)], 1),
      loss_mask=np.concatenate([np.zeros((b, 3)), np.ones((b, l - 4)), np.zeros((b, 1))],
                               1).astype(np.float32),
      old_logprobs=np.zeros((b, l), np.float32), advantages=rng.normal(size=b).astype(np.float32))
  lp = np.asarray(batch_lib.compute_logprobs(graphdef, params, batch))
  batch = batch._replace(old_logprobs=(lp + rng.normal(scale=0.6, size=lp.shape)).astype(
      np.float32) * batch.loss_mask)
  opt = train_lib.make_optimizer(train_lib.OptimizerConfig(lr=1e-3))
  spec = train_lib.LossSpec(grpo.GrpoConfig, grpo.loss_fn, grpo.normalizers)
  out = {}
  for name, cfg, micro in (('tis1', dict(tis_cap=1.5, mismatch_mask='token'), 1),
                           ('tis2', dict(tis_cap=1.5, mismatch_mask='token'), 2)):
    step = train_lib.make_train_step(graphdef, spec, cfg, opt, microbatches=micro, donate=False)
    state = train_lib.init_state(jax.tree.map(jnp.copy, params), opt)
    out[name] = jax.device_get(step(state, batch)[1])
  one, two = out['tis1'], out['tis2']
  for k in ('loss', 'grad_norm', 'mismatch_ratio_mean', 'mismatch_ratio_max',
            'mismatch_ratio_min', 'mismatch_over_cap_frac', 'mismatch_masked_frac'):
    np.testing.assert_allclose(two[k], one[k], rtol=2e-5, atol=1e-7, err_msg=k)
  assert 0 < one['mismatch_ratio_min'] < 1 < one['mismatch_ratio_max']
  assert 0 < one['mismatch_masked_frac'] < 1 and 0 < one['mismatch_over_cap_frac'] < 1
  _, off = grpo.grpo_loss(jnp.asarray(lp), batch, grpo.GrpoConfig())
  assert not any(k.startswith('mismatch_') for k in off)


# ---------------------------------------------------------------- options

@pytest.mark.parametrize('kw,message', [
    (dict(tis_cap=0.5), 'GrpoConfig.tis_cap=0.5: must be None'),
    (dict(tis_cap=float('inf')), 'GrpoConfig.tis_cap=inf'),
    (dict(tis_cap=True), 'GrpoConfig.tis_cap=True'),
    (dict(mismatch_mask='icepop'), 'GrpoConfig.mismatch_mask=.icepop.: unknown mismatch mask'),
    (dict(mismatch_mask_low=1.0), r'GrpoConfig.mismatch_mask_low=1.0: must be in \[0, 1\)'),
    (dict(mismatch_mask_low=-0.1), 'GrpoConfig.mismatch_mask_low=-0.1'),
    (dict(mismatch_mask_high=1.0), 'GrpoConfig.mismatch_mask_high=1.0: must be a finite number > 1'),
    (dict(mismatch_mask_high=float('nan')), 'GrpoConfig.mismatch_mask_high=nan'),
])
def test_bad_options_are_refused_naming_the_field(kw, message):
  with pytest.raises(ValueError, match=message):
    grpo.GrpoConfig(**kw)


def test_the_options_are_off_by_default_and_accept_their_boundaries():
  assert not grpo.GrpoConfig().corrects_mismatch
  assert grpo.GrpoConfig(tis_cap=1).corrects_mismatch
  assert grpo.GrpoConfig(mismatch_mask='sequence', mismatch_mask_low=0.0,
                         mismatch_mask_high=1.0001).corrects_mismatch


def test_the_old_policy_forward_replays_recorded_routing_as_the_update_does():
  """`compute_logprobs(replay_routing=True)` is the training forward with the batch's recorded
  experts replayed; without it the routers choose (the other models' forwards)."""
  cfg = config_lib.ModelConfig.tiny_moe(num_layers=1, layer_types=('moe',))
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  rng = np.random.default_rng(0)
  b, l = 2, 6
  tokens = rng.integers(1, 200, (b, l)).astype(np.int32)
  experts = np.stack([rng.permutation(8)[:2] for _ in range(b * l)]).reshape(b, l, 1, 2)
  batch = batch_lib.TrainBatch(
      tokens=tokens, positions=np.tile(np.arange(l, dtype=np.int32), (b, 1)),
      segment_ids=np.ones((b, l), np.int32),
      targets=np.concatenate([tokens[:, 1:], np.zeros((b, 1), np.int32)], 1),
      loss_mask=np.ones((b, l), np.float32), routing=experts.astype(np.uint8))
  replayed = jax.jit(lambda p: batch_lib.policy_stats(
      nnx.merge(graphdef, p), batch, replay=True)['logprobs'])(params)
  got = batch_lib.compute_logprobs(graphdef, params, batch, rows_per_call=1, replay_routing=True)
  np.testing.assert_allclose(got, replayed, atol=1e-6)
  own = batch_lib.compute_logprobs(graphdef, params, batch)
  assert np.abs(np.asarray(own) - got).max() > 1e-3
