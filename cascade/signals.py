"""Signals of forgetting beside the probe slope: a protected domain's KL drift and gradient cosine.

With `config.guard.signals` naming them, a guarded stage (`cascade.guard`) measures at each of
its forecasting probes, for every protected domain, on that domain's probe prompts (the first
`guard.prompts` of its validation set):

- 'kl': the policy's KL drift from the stage's starting policy pi_0 (nats per response token).
  Once per process, pi_0 samples `guard.signal_samples` responses to each probe prompt at
  temperature 1 (a fixed key: a resumed stage draws the same), scored by the domain's
  evaluation verifier; their per-token log-probs under pi_0 are kept (`Anchor`). At a probe of
  the policy pi_t, one forward pass gives the same tokens' log-probs under pi_t and, with
  d = log pi_t - log pi_0 per response token, the k3 estimator of KL(pi_0 || pi_t) from pi_0's
  own samples (unbiased, never negative: E_pi0[exp(d)] = 1):

    kl = sum_tokens (exp(d) - 1 - d) / tokens                                    (`kl_k3`)

- 'grad_cos': the cosine between the stage's update so far, delta = theta_t - theta_0 (the
  parameters since the stage's start), and the gradient of the domain's probe reward at
  theta_t, estimated by the score function on pi_0's scored responses with their mean reward as
  the baseline:

    g = grad_theta sum_i (R_i - mean R) log pi_theta(y_i | x_i) / n              (`reward_grad`)
    grad_cos = <delta, g> / (|delta| |g|)                                        (`tree_cosine`)

  To first order the stage's motion raises the domain's expected probe reward when grad_cos > 0
  and lowers it when grad_cos < 0. It is undefined (None) where the responses all scored the
  same (g = 0) or at the stage's start (delta = 0). At theta_0 g is the policy gradient of the
  probe reward; later it weighs pi_0's responses without importance ratios, a first-order
  estimate that holds while the KL drift is small (which 'kl' reports beside it).

How the forecast uses them (`cascade.forecast.predicts_fall`): its change stays the probe
slope's extrapolation; its sign ("falls") is the slope's where the slope is at least one
standard error from flat, and otherwise a fall exactly when grad_cos < 0 and the KL drift grew
since the stage's previous probe (the policy still moves on the domain's prompts, against its
reward). The cost per probe and domain: one forward pass and one gradient over
`prompts x signal_samples` rows, and a copy of theta_0 held while the stage trains ('grad_cos').
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Mapping, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from cascade import episodes
from cascade import rollout
from models import sharding
from rl import batch as batch_lib
from rl import sampler as sampler_lib

# What config.guard.signals may name (`cascade.config.GUARD_SIGNALS`, the same names).
SIGNALS = ('kl', 'grad_cos')

# The key of pi_0's anchor responses (a fixed subset of each validation set, like the probes').
ANCHOR_FOLD = 1_000_039


def kl_k3(logprobs, ref_logprobs, mask) -> float:
  """The k3 estimate of KL(ref || policy) per masked token from the reference's own samples:
  mean over mask of exp(d) - 1 - d, d = logprobs - ref_logprobs (0.0: no masked token)."""
  lp = np.asarray(logprobs, np.float64)
  ref = np.asarray(ref_logprobs, np.float64)
  m = np.asarray(mask, np.float64)
  if not lp.shape == ref.shape == m.shape:
    raise ValueError(f'signals.kl_k3: logprobs, ref_logprobs and mask differ in shape '
                     f'({lp.shape}, {ref.shape}, {m.shape})')
  tokens = float(m.sum())
  if tokens == 0.0:
    return 0.0
  d = lp - ref
  return float(np.sum(m * (np.expm1(d) - d)) / tokens)


def reward_weights(rewards) -> np.ndarray:
  """Each response's weight in the probe-reward gradient: (R_i - mean R) / n."""
  r = np.asarray(rewards, np.float64).ravel()
  return ((r - r.mean()) / max(r.size, 1)).astype(np.float32)


def _floats(tree) -> list:
  """The floating leaves of `tree`, in its leaf order."""
  return [x for x in jax.tree.leaves(tree)
          if jnp.issubdtype(np.result_type(getattr(x, 'dtype', type(x))), jnp.floating)]


@jax.jit
def _dot_norms(a, b):
  """(<a, b>, |a|^2, |b|^2) over two pytrees' leaves, in float32."""
  dot = sum(jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32)) for x, y in zip(a, b))
  na = sum(jnp.vdot(x.astype(jnp.float32), x.astype(jnp.float32)) for x in a)
  nb = sum(jnp.vdot(y.astype(jnp.float32), y.astype(jnp.float32)) for y in b)
  return dot, na, nb


@jax.jit
def _difference(a, b):
  return [x.astype(jnp.float32) - y.astype(jnp.float32) for x, y in zip(a, b)]


def tree_cosine(a, b) -> float | None:
  """The cosine between two pytrees of the same structure, as flat vectors of their floating
  leaves (None: either is zero)."""
  la, lb = _floats(a), _floats(b)
  if len(la) != len(lb) or any(x.shape != y.shape for x, y in zip(la, lb)):
    raise ValueError('signals.tree_cosine: the two trees differ in their floating leaves')
  dot, na, nb = (float(v) for v in _dot_norms(la, lb))
  if na == 0.0 or nb == 0.0:
    return None
  return max(-1.0, min(1.0, dot / math.sqrt(na * nb)))


def tree_delta(new, old) -> list:
  """new - old leaf by leaf (floating leaves, float32): a stage's update so far."""
  return _difference(_floats(new), _floats(old))


@functools.partial(jax.jit, static_argnums=0, static_argnames=('rules',))
def _reward_grad_jit(graphdef, params, tokens, positions, segment_ids, targets, mask, weights, *,
                     rules: sharding.Rules = sharding.DEFAULT_RULES):
  def objective(p):
    model = nnx.merge(graphdef, p)
    model.rules = rules
    lp = batch_lib.token_stats(model, tokens, positions, segment_ids, targets)['logprobs']
    return jnp.sum(weights[:, None] * mask * lp)
  return jax.grad(objective)(params)


def reward_grad(graphdef, params, batch, weights, mesh=None, rules=None):
  """grad_theta sum_i weights_i log pi_theta(y_i | x_i) over `batch`'s rows (a pytree like
  `params`); `weights` from `reward_weights`."""
  fields = (batch.tokens, batch.positions, batch.segment_ids, batch.targets)
  with sharding.use_mesh(mesh):
    return _reward_grad_jit(graphdef, params, *(jnp.asarray(f) for f in fields),
                            jnp.asarray(batch.loss_mask, jnp.float32),
                            jnp.asarray(weights, jnp.float32), rules=sharding.as_rules(rules))


@dataclasses.dataclass
class Anchor:
  """pi_0's scored responses to one domain's probe prompts and their log-probs under pi_0."""
  batch: batch_lib.TrainBatch
  ref_logprobs: np.ndarray
  rewards: np.ndarray


class Tracker:
  """The signals of one guarded stage (`config.guard.signals`), measured by `measure`."""

  def __init__(self, ctx, stage, domains: Sequence[str], signals: Sequence[str], prompts: int,
               samples: int):
    self.ctx, self.stage = ctx, stage
    self.domains, self.signals = tuple(domains), tuple(signals)
    self.prompts, self.samples = prompts, samples
    self.anchors: dict[str, Anchor] | None = None
    self.start = None

  def _anchor(self, domain: str, start, prepared, key) -> Anchor | None:
    """pi_0's anchor for `domain` (None: no validation set, no ready verifier, or an agentic
    domain, whose episodes are no single response)."""
    ctx = self.ctx
    recs = list(ctx.data.validation_sets.get(domain) or [])[:self.prompts]
    if not recs or not ctx.verifiers.can_evaluate(domain):
      return None
    verifier_of = ctx.verifiers.eval_verifier
    if isinstance(verifier_of(domain), episodes.Agent):
      return None
    ev = ctx.plan.eval_of(domain)
    sp = sampler_lib.SamplingParams(max_new_tokens=ev.max_new_tokens)   # pi_0 itself: T = 1
    ro = rollout.generate(ctx.sampler, prepared, ctx.tokenizer, recs, [ev.modes[0]] * len(recs),
                          key, sp, self.samples)
    rewards, _ = rollout.score(ro, verifier_of, ctx.sample_cls)
    batch = batch_lib.from_samples(ro.samples, np.zeros(len(ro.records), np.float32))
    ref = np.asarray(batch_lib.compute_logprobs(ctx.policies.graphdef('policy'), start, batch,
                                                ctx.mesh, ctx.rules))
    return Anchor(batch, ref, np.asarray(rewards, np.float64))

  def _ensure(self) -> None:
    """Draws the anchors from the stage's starting policy (once per process)."""
    if self.anchors is not None:
      return
    start = self.ctx.policies.start_params(self.stage)
    prepare = getattr(self.ctx.sampler, 'prepare', None)
    prepared = prepare(start) if prepare is not None else start
    key = jax.random.fold_in(jax.random.PRNGKey(self.ctx.plan.seed), ANCHOR_FOLD)
    key = jax.random.fold_in(key, self.stage.index)
    self.anchors = {}
    for d in self.domains:
      fold = zlib.crc32(d.encode()) & 0x7FFFFFFF
      a = self._anchor(d, start, prepared, jax.random.fold_in(key, fold))
      if a is not None:
        self.anchors[d] = a
    self.start = start if 'grad_cos' in self.signals else None

  def measure(self, params) -> dict[str, dict]:
    """domain -> {'kl': ..., 'grad_cos': ... (None where undefined)} of the policy `params`
    (only the configured signals)."""
    self._ensure()
    ctx = self.ctx
    graphdef = ctx.policies.graphdef('policy')
    delta = tree_delta(params, self.start) if self.start is not None else None
    out = {}
    for d, a in sorted(self.anchors.items()):
      sig = {}
      if 'kl' in self.signals:
        lp = batch_lib.compute_logprobs(graphdef, params, a.batch, ctx.mesh, ctx.rules)
        sig['kl'] = _sig6(kl_k3(np.asarray(lp), a.ref_logprobs, a.batch.loss_mask))
      if delta is not None:
        g = reward_grad(graphdef, params, a.batch, reward_weights(a.rewards), ctx.mesh,
                        ctx.rules)
        cos = tree_cosine(delta, g)
        sig['grad_cos'] = None if cos is None else _sig6(cos)
      out[d] = sig
    return out


def _sig6(x: float) -> float:
  """`x` to 6 significant digits (a drift of 1e-6 nats per token stays visible)."""
  return float(f'{x:.6g}')


def metrics(signals: Mapping[str, Mapping]) -> dict[str, float]:
  """The step's `forecast/<domain>/<signal>` metrics (undefined values left out)."""
  return {f'forecast/{d}/{k}': float(v) for d, s in sorted(signals.items())
          for k, v in sorted(s.items()) if v is not None}
