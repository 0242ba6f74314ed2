"""A known sampler/trainer gap, forced on CPU: bf16 rollout log-probs against fp32 training.

The trainer's logits z [B, L, V] are the parameters (the gradient of any model reaches its
weights through them). The sampler's log-probs of the same tokens are the log-softmax of z
rounded to bfloat16 and computed in bfloat16, as a bf16 rollout kernel would, on logits large
enough (tens) that the rounding moves ratios past PPO's clip. The gap is then known exactly,
from the same bf16 values in float64: the logged metrics (`rl.grpo.gap_metrics`) are checked
against it, and the gradient of the GRPO loss with respect to z, uncorrected and with TIS, is
checked against a float64 numpy reference of the (TIS-weighted) clipped policy gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import batch as batch_lib
from rl import grpo

B, L, V = 6, 7, 11


def _case(seed=0, scale=40.0):
  """(z fp32 [B, L, V], targets, loss mask, advantages [B], sampler log-probs fp32)."""
  rng = np.random.default_rng(seed)
  z = (rng.normal(size=(B, L, V)) * scale).astype(np.float32)
  targets = rng.integers(0, V, (B, L)).astype(np.int32)
  mask = (rng.random((B, L)) < 0.8).astype(np.float32)
  adv = rng.normal(size=B).astype(np.float32)
  bf = jax.nn.log_softmax(jnp.asarray(z, jnp.bfloat16), axis=-1)
  sampler = np.take_along_axis(np.asarray(bf.astype(jnp.float32)), targets[..., None], -1)[..., 0]
  return z, targets, mask, adv, (sampler * mask).astype(np.float32)


def _batch(targets, mask, adv, sampler):
  return batch_lib.TrainBatch(
      tokens=np.zeros((B, L), np.int32), positions=np.tile(np.arange(L, dtype=np.int32), (B, 1)),
      segment_ids=np.ones((B, L), np.int32), targets=targets, loss_mask=mask,
      old_logprobs=sampler, advantages=adv)


def _loss_grad(z, batch, cfg):
  """(gradient of the GRPO loss with respect to z, its metrics), in float32 as training runs."""
  def loss(zz):
    lp = jnp.take_along_axis(jax.nn.log_softmax(zz, -1), batch.targets[..., None], -1)[..., 0]
    return grpo.grpo_loss(lp, batch, cfg)
  (_, metrics), g = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(z))
  return np.asarray(g, np.float64), {k: float(v) for k, v in metrics.items()}


def _reference(z, targets, mask, adv, sampler, cfg):
  """float64: d loss / d z of the token-mean clipped policy gradient on a strictly on-policy
  step. Per loss token, grad log p(v) = e_v - p; uncorrected the PPO ratio is rho = p / q (q
  the sampler's) and the clip drops A > 0 above 1 + eps and A < 0 below 1 - eps; with TIS the
  ratio is 1 (against the trainer's own old log-probs) and the term is weighted by
  min(rho, cap)."""
  z = z.astype(np.float64)
  logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(
      -1, keepdims=True)
  p = np.exp(logp)
  lp = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  rho = np.exp(lp - sampler.astype(np.float64))
  a = adv.astype(np.float64)[:, None] * np.ones((1, L))
  if cfg.tis_cap is None:
    lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
    live = ~(((a > 0) & (rho > hi)) | ((a < 0) & (rho < lo)))
    weight = rho * live
  else:
    weight = np.minimum(rho, cfg.tis_cap)
  onehot = np.eye(V)[targets]
  coef = -(weight * a * mask) / max(mask.sum(), 1.0)
  return coef[..., None] * (onehot - p), rho


def test_the_bf16_gap_is_measured_exactly():
  z, targets, mask, adv, sampler = _case()
  cfg = grpo.GrpoConfig(tis_cap=2.0)
  _, metrics = _loss_grad(z, _batch(targets, mask, adv, sampler), cfg)
  _, rho = _reference(z, targets, mask, adv, sampler, cfg)
  gap = np.abs(np.log(rho))[mask > 0]
  assert gap.max() > 0.2                       # bf16 rounding of logits in the tens
  assert metrics['logprob_gap'] == pytest.approx(gap.mean(), rel=1e-3)
  assert metrics['logprob_gap_max'] == pytest.approx(gap.max(), rel=1e-3)
  # TIS alone: the band is [0, cap]; tokens above it are the ones it truncates.
  assert metrics['logprob_gap_outside_frac'] == pytest.approx(
      np.mean(rho[mask > 0] > 2.0), abs=1e-6)
  # The mask's band (default [0.5, 2]) when no correction is on: what masking would drop.
  _, off = _loss_grad(z, _batch(targets, mask, adv, sampler), grpo.GrpoConfig(
      mismatch_mask_low=0.9, mismatch_mask_high=1.1))
  frac = np.mean((rho[mask > 0] < 0.9) | (rho[mask > 0] > 1.1))
  assert 0 < frac < 1
  assert off['logprob_gap_outside_frac'] == pytest.approx(frac, abs=1e-6)


@pytest.mark.parametrize('cfg', [grpo.GrpoConfig(), grpo.GrpoConfig(tis_cap=2.0),
                                 grpo.GrpoConfig(tis_cap=1.1)],
                         ids=['uncorrected', 'tis_2', 'tis_1.1'])
def test_the_gradient_matches_the_float64_reference(cfg):
  z, targets, mask, adv, sampler = _case()
  got, _ = _loss_grad(z, _batch(targets, mask, adv, sampler), cfg)
  want, _ = _reference(z, targets, mask, adv, sampler, cfg)
  np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max(), rtol=1e-4)


def test_the_correction_changes_the_gradient_where_the_clip_dropped_tokens():
  """Uncorrected, tokens with A > 0 whose bf16 ratio passed 1 + eps lose their gradient; TIS
  keeps them (weighted by min(rho, cap)): the two gradients differ by exactly those tokens'
  terms, and agree on the others."""
  z, targets, mask, adv, sampler = _case()
  batch = _batch(targets, mask, adv, sampler)
  plain, _ = _loss_grad(z, batch, grpo.GrpoConfig())
  tis, _ = _loss_grad(z, batch, grpo.GrpoConfig(tis_cap=2.0))
  _, rho = _reference(z, targets, mask, adv, sampler, grpo.GrpoConfig())
  a = adv[:, None] * np.ones((1, L))
  dropped = (((a > 0) & (rho > 1.2)) | ((a < 0) & (rho < 0.8))) & (mask > 0)
  assert dropped.any()
  # Elsewhere both weight the term by rho (as the PPO ratio, or as TIS's weight): float32
  # rounding apart, the same.
  moved = np.abs(tis - plain).max(-1) > 1e-4 * np.abs(tis).max(-1)
  np.testing.assert_array_equal(moved & (mask > 0), dropped)
