"""GRPO: group advantages and the clipped policy-gradient loss.

The Cascade RL default is strictly on-policy GRPO: one update per rollout
batch, no KL, token-level loss, advantages normalised within each prompt's
group of G samples. Every piece is a pure function chosen by name from a
`GrpoConfig`:

* advantages: `ADVANTAGES[kind](rewards [P, G]) -> [P, G]` with kinds 'grpo'
  ((r - mean) / (std + eps)), 'dr_grpo' (r - mean, no std division) and
  'rloo' (leave-one-out baseline). Groups without signal are dropped
  before this, by `rl.filtering`.
* `grpo_loss(logprobs, batch, cfg)`: PPO-clipped surrogate with separate low
  and high clip (clip-higher), KL to a reference (k1 / k3), entropy bonus,
  overlong masking, and token-level or sequence-mean-token-mean aggregation.

By default the importance ratio exp(logprobs - old_logprobs) is computed from the
sampler's log-probs, never assumed to be 1: on-policy its value is 1 up to
numerics (its mean/max are logged), and its gradient equals the plain
REINFORCE gradient, so one formula covers on-policy and multi-minibatch use.

Sampler/trainer mismatch correction (off by default). The sampler's and the
trainer's probabilities of the same token differ (bf16 kernels, mixture-of-experts
routing), and a PPO clip against the sampler's log-probs drops the gradient of
tokens with A > 0 whose ratio is above 1 + eps and leaves tokens with A < 0
weighted by their ratio, however large. With `tis_cap` or
`mismatch_mask` set, the loss is decoupled as verl, NeMo-RL and slime do it:

* the PPO ratio r is taken against the trainer's own old log-probs
  (pi_old_train): `batch.trainer_logprobs` when the batch carries them (several
  updates per rollout batch: a forward under the params that sampled it, before
  the first update), else the forward's own log-probs under stop_gradient (exact
  for the one update of a strictly on-policy step: r == 1, no extra forward);
* the mismatch ratio rho = pi_old_train / pi_sampler, per token, weights the
  policy-gradient term (stop-gradient; the KL and entropy terms are not weighted):
  truncated importance sampling (TIS) w = min(rho, tis_cap), and/or masking
  (`mismatch_mask`): w = 0 for tokens whose rho ('token', as IcePop masks) or
  whose sequence's geometric-mean rho ('sequence', verl's geometric rejection)
  falls outside [mismatch_mask_low, mismatch_mask_high]. Masking alone weights
  kept tokens by 1; 'token' with `tis_cap` >= mismatch_mask_high is masked
  importance sampling (IcePop: w = rho inside the band, 0 outside).

With a large cap, E_sampler[w * A * grad log pi] is the on-policy gradient
E_trainer[A * grad log pi]; truncation and masking trade that for bounded
variance (tests/rl/test_mismatch_correction.py enumerates both). A masked token
keeps its place in the loss's denominator (like a token with zero advantage):
the denominators are the whole batch's, fixed before the forward that decides
the mask, so microbatches still add up to the full-batch loss.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rl import batch as batch_lib
from rl import fields
from rl import filtering


# ---------------------------------------------------------------- advantages

def _grpo(r: np.ndarray, eps: float) -> np.ndarray:
  # Unbiased (ddof=1) std, as verl and TRL compute it.
  return (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + eps)


def _dr_grpo(r: np.ndarray, eps: float) -> np.ndarray:
  del eps
  return r - r.mean(1, keepdims=True)


def _rloo(r: np.ndarray, eps: float) -> np.ndarray:
  del eps
  g = r.shape[1]
  return r - (r.sum(1, keepdims=True) - r) / (g - 1)


ADVANTAGES: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    'grpo': _grpo,
    'dr_grpo': _dr_grpo,
    'rloo': _rloo,
}


def advantages(rewards, group_size: int, kind: str = 'grpo', eps: float = 1e-6) -> np.ndarray:
  """Per-sample advantages from per-sample rewards, normalised within each group.

  Args:
    rewards: [B] rewards, prompt-major (row i * G + g is sample g of prompt i).
    group_size: G, samples per prompt (>= 2).
    kind: a key of ADVANTAGES: 'grpo', 'dr_grpo' or 'rloo'.
    eps: added to the std in 'grpo' (a group with equal rewards gets 0).

  Returns:
    [B] float32 advantages.
  """
  if kind not in ADVANTAGES:
    raise ValueError(f'unknown advantage kind {kind!r}; known: {sorted(ADVANTAGES)}')
  if group_size < 2:
    raise ValueError(f'group_size={group_size}: group advantages need G >= 2')
  r = filtering.as_groups(rewards, group_size)
  return ADVANTAGES[kind](r, eps).reshape(-1).astype(np.float32)


# ---------------------------------------------------------------- loss

AGGREGATIONS = ('token', 'seq_mean_token_mean')
KL_ESTIMATORS = ('k1', 'k3')
# mismatch_mask modes: no masking; per token; per sequence (its geometric-mean ratio).
MISMATCH_MASKS = ('off', 'token', 'sequence')
_NONNEG = fields.num_in(0, what='must be >= 0')


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  """GRPO loss settings (defaults: the Cascade RL recipe).

  Each field is declared once, with its default and check (`rl.fields`): a GRPO stage's
  config takes its loss fields from here (`cascade.kinds.grpo`), under the same names.

  Attributes:
    advantage: key of ADVANTAGES used by the stage loop ('grpo').
    adv_eps: eps added to the group std.
    loss_agg: 'token' (1 / sum|o_i| * sum_i sum_t) or 'seq_mean_token_mean'.
    clip_eps_low: ratio clipped below at 1 - clip_eps_low.
    clip_eps_high: ratio clipped above at 1 + clip_eps_high (clip-higher: > low).
    kl_coef: weight of the KL to the reference policy; 0 = no reference at all.
    kl_estimator: 'k1' (log pi - log ref) or 'k3' (exp(ref - pi) - (ref - pi) - 1).
    entropy_coef: weight of the entropy bonus (full-distribution entropy).
    mask_truncated: give truncated (overlong) completions no loss.
    replay_routing: when the batch carries the sampler's recorded experts (`routing`, a
      mixture-of-experts policy): replay them in the policy's forward (True), or let its
      routers choose and only measure the mismatch (False; logged either way).
    tis_cap: truncated importance sampling: weight each token's policy-gradient term by
      min(pi_old_train / pi_sampler, tis_cap); None = off. At least 1 (a cap below 1
      would shrink even the tokens sampler and trainer agree on).
    mismatch_mask: 'off', 'token' (drop tokens whose pi_old_train / pi_sampler is outside
      [mismatch_mask_low, mismatch_mask_high]) or 'sequence' (drop whole sequences whose
      geometric-mean ratio is outside it).
    mismatch_mask_low: the band's lower end, in [0, 1).
    mismatch_mask_high: the band's upper end, finite and > 1.
  """
  advantage: str = fields.field('grpo', check=fields.one_of(ADVANTAGES, 'advantage estimator'))
  adv_eps: float = fields.field(1e-6, check=_NONNEG, convert=float)
  loss_agg: str = fields.field('token', check=fields.one_of(AGGREGATIONS, 'loss aggregation'))
  clip_eps_low: float = fields.field(0.2, check=fields.num_in(0, 1, hi_open=True), convert=float)
  clip_eps_high: float = fields.field(0.2, check=_NONNEG, convert=float)
  kl_coef: float = fields.field(0.0, check=_NONNEG, convert=float)
  kl_estimator: str = fields.field('k3', check=fields.one_of(KL_ESTIMATORS, 'KL estimator'))
  entropy_coef: float = fields.field(0.0, check=_NONNEG, convert=float)
  mask_truncated: bool = fields.field(False)
  replay_routing: bool = fields.field(True)
  tis_cap: Optional[float] = fields.field(None, check=fields.num_in(
      1, what='must be None (off) or a finite number >= 1'), convert=float)
  mismatch_mask: str = fields.field('off', check=fields.one_of(MISMATCH_MASKS,
                                                               'mismatch mask mode'))
  mismatch_mask_low: float = fields.field(0.5, check=fields.num_in(0, 1, hi_open=True),
                                          convert=float)
  mismatch_mask_high: float = fields.field(2.0, check=fields.num_in(1, lo_open=True),
                                           convert=float)

  def __post_init__(self):
    fields.check(self)

  @property
  def corrects_mismatch(self) -> bool:
    """Whether the loss corrects the sampler/trainer mismatch (TIS or masking)."""
    return self.tis_cap is not None or self.mismatch_mask != 'off'


def loss_mask(batch: batch_lib.TrainBatch, cfg: GrpoConfig) -> jax.Array:
  """[B, L] float32 tokens that carry loss (overlong rows removed when asked)."""
  mask = jnp.asarray(batch.loss_mask, jnp.float32)
  if cfg.mask_truncated:
    if batch.truncated is None:
      raise ValueError('GrpoConfig.mask_truncated needs batch.truncated')
    truncated = jnp.asarray(batch.truncated, jnp.float32)
    # [B] per row, or [B, L] per token in a packed batch (`rl.batch.pack`).
    mask = mask * (1.0 - (truncated if truncated.ndim == 2 else truncated[:, None]))
  return mask


def normalizers(batch: batch_lib.TrainBatch, cfg) -> dict[str, jax.Array]:
  """Whole-batch denominators, so microbatches sum to the full-batch loss.

  Returns:
    {'tokens': loss tokens in the batch, 'seqs': rows with >= 1 loss token},
    each at least 1.
  """
  mask = loss_mask(batch, cfg)
  return {'tokens': jnp.maximum(mask.sum(), 1.0),
          'seqs': jnp.maximum((mask.sum(1) > 0).sum().astype(jnp.float32), 1.0)}


def aggregate(x: jax.Array, mask: jax.Array, norm: dict, aggregation: str) -> jax.Array:
  """Token-level `sum(x * mask) / tokens` or sequence-mean-token-mean of x [B, L]."""
  if aggregation == 'token':
    return jnp.sum(x * mask) / norm['tokens']
  per_seq = jnp.sum(x * mask, 1) / jnp.maximum(mask.sum(1), 1.0)
  return jnp.sum(per_seq) / norm['seqs']


def _sequence_mean(x: jax.Array, mask: jax.Array, segment_ids) -> jax.Array:
  """Per token, the mean of x [B, L] over the loss tokens of its sequence: its row, or its
  segment of a packed row (`rl.batch.pack`; a loss token's target is in its input's segment)."""
  seg = jnp.asarray(segment_ids, jnp.int32)
  sums = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=x.shape[1] + 1))
  mean = sums(x * mask, seg) / jnp.maximum(sums(mask, seg), 1.0)
  return jnp.take_along_axis(mean, seg, 1)


def mismatch_weights(trainer_logprobs: jax.Array, batch: batch_lib.TrainBatch, mask: jax.Array,
                     cfg: GrpoConfig, norm: dict) -> tuple[jax.Array, dict]:
  """The sampler/trainer mismatch correction's per-token weights and the ratio's metrics.

  Args:
    trainer_logprobs: [B, L] the trainer's old log-probs pi_old_train (no gradient flows).
    batch: its old_logprobs are the sampler's; segment_ids delimit sequences.
    mask: [B, L] loss tokens (`loss_mask`).
    cfg: a GrpoConfig with `tis_cap` and / or `mismatch_mask` set.
    norm: whole-batch denominators.

  Returns:
    ([B, L] stop-gradient weights of the policy-gradient term, metrics): of
    rho = pi_old_train / pi_sampler over the loss tokens 'mismatch_ratio_mean',
    '_max', '_min' (+inf for a batch without loss tokens), 'mismatch_over_cap_frac'
    (with tis_cap) and 'mismatch_masked_frac' (with mismatch_mask).
  """
  on = mask > 0
  log_rho = jnp.where(on, trainer_logprobs - batch.old_logprobs, 0.0)
  rho = jnp.exp(log_rho)
  tok_mean = lambda x: jnp.sum(x * mask) / norm['tokens']
  metrics = dict(mismatch_ratio_mean=tok_mean(rho),
                 mismatch_ratio_max=jnp.max(jnp.where(on, rho, 0.0)),
                 mismatch_ratio_min=jnp.min(jnp.where(on, rho, jnp.inf)))
  weight = jnp.ones_like(rho)
  if cfg.tis_cap is not None:
    weight = jnp.minimum(rho, cfg.tis_cap)
    metrics['mismatch_over_cap_frac'] = tok_mean((rho > cfg.tis_cap).astype(jnp.float32))
  if cfg.mismatch_mask != 'off':
    judged = rho if cfg.mismatch_mask == 'token' else jnp.exp(
        _sequence_mean(log_rho, mask, batch.segment_ids))
    keep = (judged >= cfg.mismatch_mask_low) & (judged <= cfg.mismatch_mask_high)
    weight = jnp.where(keep, weight, 0.0)
    metrics['mismatch_masked_frac'] = tok_mean((~keep).astype(jnp.float32))
  return jax.lax.stop_gradient(weight), metrics


def gap_metrics(trainer_logprobs: jax.Array, sampler_logprobs: jax.Array, mask: jax.Array,
                norm: dict, band: tuple[float, float]) -> dict[str, jax.Array]:
  """The sampler/trainer log-prob gap over the loss tokens, logged by every RL loss.

  Args:
    trainer_logprobs, sampler_logprobs: [B, L] the trainer's and the sampler's log-probs of
      the same tokens.
    mask: [B, L] loss tokens.
    norm: whole-batch denominators ('tokens').
    band: (low, high) of the ratio pi_trainer / pi_sampler the loss's correction keeps
      (`mismatch_band`; MOPD's importance-weight band).

  Returns:
    'logprob_gap' (mean |delta| over the loss tokens), 'logprob_gap_max' (max |delta|; 0
    without loss tokens) and 'logprob_gap_outside_frac' (the share of loss tokens whose ratio
    is outside `band`); microbatch values add up (the max: the largest).
  """
  on = mask > 0
  gap = jnp.where(on, jax.lax.stop_gradient(trainer_logprobs) - sampler_logprobs, 0.0)
  lo, hi = band
  # log(0) = -inf: a band from 0 has no lower end.
  outside = (gap > np.log(hi)) | ((gap < np.log(lo)) if lo > 0 else False)
  return {'logprob_gap': jnp.sum(jnp.abs(gap) * mask) / norm['tokens'],
          'logprob_gap_max': jnp.max(jnp.abs(gap)),
          'logprob_gap_outside_frac': jnp.sum((outside & on) * mask) / norm['tokens']}


def mismatch_band(cfg: GrpoConfig) -> tuple[float, float]:
  """The ratio band `logprob_gap_outside_frac` counts against: the mask's band when masking
  is on, [0, tis_cap] with TIS alone (the tokens it truncates), else the mask's default band
  (what masking would drop)."""
  if cfg.mismatch_mask == 'off' and cfg.tis_cap is not None:
    return 0.0, cfg.tis_cap
  return cfg.mismatch_mask_low, cfg.mismatch_mask_high


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(pi || ref) from sampled tokens: 'k1' or 'k3'."""
  if estimator == 'k1':
    return logprobs - ref_logprobs
  d = ref_logprobs - logprobs
  return jnp.exp(d) - d - 1.0


def grpo_loss(logprobs: jax.Array, batch: batch_lib.TrainBatch, cfg: GrpoConfig,
              norm: Optional[dict] = None, entropy: Optional[jax.Array] = None):
  """The GRPO / PPO-clip loss over a batch.

  per-token: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
             + kl_coef * KL_est(pi, ref) - entropy_coef * H,
  with r = exp(logprobs - old_logprobs), aggregated by `cfg.loss_agg`. With a
  mismatch correction (`cfg.corrects_mismatch`), r = exp(logprobs - pi_old_train)
  and the first term is weighted by `mismatch_weights` (module docstring).

  Args:
    logprobs: [B, L] trainer log-probs of batch.targets (differentiable).
    batch: a TrainBatch with loss_mask, old_logprobs, advantages (and
      truncated, ref_logprobs when the config asks; trainer_logprobs, the trainer's
      old log-probs, when a mismatch-corrected update is not the batch's first).
    cfg: GrpoConfig.
    norm: whole-batch denominators (default: `normalizers(batch, cfg)`).
    entropy: [B, L] full-distribution entropy; required iff entropy_coef > 0.

  Returns:
    (loss scalar, metrics dict). Metrics are sums over this batch divided by
    the whole-batch `norm` (so microbatch values add up), except keys ending
    in '_max' and '_min'.
  """
  if norm is None:
    norm = normalizers(batch, cfg)
  mask = loss_mask(batch, cfg)
  on = mask > 0
  gap = jnp.where(on, logprobs - batch.old_logprobs, 0.0)       # trainer vs sampler
  if cfg.corrects_mismatch:
    old_train = (jax.lax.stop_gradient(logprobs) if batch.trainer_logprobs is None
                 else jnp.asarray(batch.trainer_logprobs, jnp.float32))
    log_ratio = jnp.where(on, logprobs - old_train, 0.0)
  else:
    log_ratio = gap
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
  metrics = {}
  if cfg.corrects_mismatch:
    weight, metrics = mismatch_weights(old_train, batch, mask, cfg, norm)
    pg = pg * weight
  per_token = pg
  tok_mean = lambda x: jnp.sum(x * mask) / norm['tokens']
  if cfg.kl_coef > 0:
    if batch.ref_logprobs is None:
      raise ValueError(f'GrpoConfig.kl_coef={cfg.kl_coef} needs batch.ref_logprobs '
                       '(fill it with rl.batch.compute_logprobs on the reference params)')
    kl = kl_penalty(logprobs, batch.ref_logprobs, cfg.kl_estimator)
    per_token = per_token + cfg.kl_coef * kl
    metrics['kl'] = tok_mean(kl)
  if cfg.entropy_coef > 0:
    if entropy is None:
      raise ValueError(f'GrpoConfig.entropy_coef={cfg.entropy_coef} needs the entropy argument')
    per_token = per_token - cfg.entropy_coef * entropy
    metrics['entropy_full'] = tok_mean(entropy)
  loss = aggregate(per_token, mask, norm, cfg.loss_agg)
  clipped = ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))
  metrics.update(
      pg_loss=aggregate(pg, mask, norm, cfg.loss_agg),
      ratio_mean=tok_mean(ratio),
      ratio_max=jnp.max(jnp.where(on, ratio, 0.0)),
      clip_frac=tok_mean(clipped.astype(jnp.float32)),
      entropy=tok_mean(-logprobs),
      tokens=mask.sum(),
      **gap_metrics(logprobs, batch.old_logprobs, mask, norm, mismatch_band(cfg)),
  )
  return loss, metrics


def loss_fn(model, batch: batch_lib.TrainBatch, cfg: GrpoConfig, norm: dict):
  """GRPO loss of an NNX policy on a batch: one forward pass, then `grpo_loss`."""
  stats = batch_lib.policy_stats(model, batch, entropy=cfg.entropy_coef > 0,
                                 replay=cfg.replay_routing)
  return grpo_loss(stats['logprobs'], batch, cfg, norm, stats.get('entropy'))
