"""A forecast of forgetting: each protected domain's change by a stage's end, from its first probes.

The regression guards (`cascade.guard`) probe every protected domain at a stage's first step
and every `guard.every` steps. From the probes a stage has taken so far (at least two steps),
the forecast fits a straight line to each domain's probe score against the step, by weighted
least squares with the probes' own standard errors as the weights (each floored at
`STDERR_FLOOR` points, so a probe that scored 0 or 100 on every sample does not weigh
infinitely), and extrapolates it to the stage's last step:

  score(t) = a + b t,   (a, b) = argmin sum_i ((s_i - a - b t_i) / sigma_i)^2
  cov(a, b) = (X^T W X)^-1 * max(1, chi2 / (n - 2))   (n > 2: widened when the points scatter
                                                       more than their standard errors say)
  change = b (T - t_0),              its standard error |T - t_0| sqrt(var b)
  end    = a + b T,                  its standard error sqrt([1, T] cov [1, T]^T)

with t_0 the stage's first probed step (its start) and T its step count. The `change` is what
results.json's "forecast" compares with the outcome (the last probe's score minus the first's).

A forecast crosses a guard's bound with confidence c when the domain's best probe so far
(`best`, standard error `se_best`) lies more than `max_drop` points above the forecast end with
probability at least c under a normal error:

  (best - end - max_drop) / sqrt(se_end^2 + se_best^2) >= z_c,   z_c = Phi^-1(c)

(`crosses`). The guard acts on it only when `config.guard.forecast_confidence` is set.

With `config.guard.signals` (`cascade.signals`), each forecast also carries the domain's KL
drift from the stage's starting policy ('kl') and the cosine between the stage's update and the
domain's probe-reward gradient ('grad_cos') at its probe. The change stays the slope's; the
signals decide the forecast's sign where the slope cannot (`predicts_fall`, its "falls"):

  falls = change < 0                          where |change| > change_stderr (the slope speaks)
        = grad_cos < 0 and kl > kl_before     otherwise, both signals known (kl_before: the
                                              stage's previous probe's, 0 at its start)
        = change < 0                          otherwise

`accuracy` reports the sign of each predictor (the slope, grad_cos alone, the combined
"falls") on the big falls, and the mean KL drift of the falls and of the rest (docs/config.md,
the guard section).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Mapping, Sequence

import numpy as np

# The smallest standard error (points) a probe's score is weighted with.
STDERR_FLOOR = 1.0


@dataclasses.dataclass(frozen=True)
class Fit:
  """A weighted straight line through a domain's probes: score = intercept + slope * step."""
  intercept: float
  slope: float
  cov: tuple[tuple[float, float], tuple[float, float]]   # of (intercept, slope)
  points: int
  scale: float        # sqrt(max(1, chi2 / (n - 2))): how far the covariance was widened

  def at(self, step: float) -> tuple[float, float]:
    """(the line's value at `step`, its standard error)."""
    x = np.array([1.0, float(step)])
    var = float(x @ np.asarray(self.cov) @ x)
    return self.intercept + self.slope * step, math.sqrt(max(var, 0.0))


def fit(steps: Sequence[float], scores: Sequence[float], stderrs: Sequence[float],
        floor: float = STDERR_FLOOR) -> Fit:
  """The weighted least-squares line through (steps, scores) with standard errors `stderrs`.

  Raises:
    ValueError: fewer than two distinct steps, or the three sequences differ in length.
  """
  t = np.asarray(steps, np.float64)
  s = np.asarray(scores, np.float64)
  e = np.asarray(stderrs, np.float64)
  if not t.shape == s.shape == e.shape or t.ndim != 1:
    raise ValueError(f'forecast.fit: steps, scores and stderrs differ in shape '
                     f'({t.shape}, {s.shape}, {e.shape})')
  if len(np.unique(t)) < 2:
    raise ValueError(f'forecast.fit: needs probes at two distinct steps, got {t.tolist()}')
  w = 1.0 / np.maximum(e, floor) ** 2
  x = np.stack([np.ones_like(t), t], axis=1)
  cov = np.linalg.inv(x.T @ (w[:, None] * x))
  coef = cov @ (x.T @ (w * s))
  n = len(t)
  scale2 = 1.0
  if n > 2:
    chi2 = float(np.sum(w * (s - x @ coef) ** 2))
    scale2 = max(1.0, chi2 / (n - 2))
  cov = cov * scale2
  return Fit(intercept=float(coef[0]), slope=float(coef[1]),
             cov=((float(cov[0, 0]), float(cov[0, 1])), (float(cov[1, 0]), float(cov[1, 1]))),
             points=n, scale=math.sqrt(scale2))


def forecast(steps: Sequence[float], scores: Sequence[float], stderrs: Sequence[float],
             horizon: int) -> dict:
  """A domain's forecast at a stage's step `horizon` (its last) from its probes so far.

  Returns:
    {'at_step': the newest probe's step, 'steps': horizon, 'change': the forecast change from
     the first probe's step to `horizon`, 'change_stderr', 'end': the forecast score at
     `horizon`, 'end_stderr', 'points': probes used}.
  """
  f = fit(steps, scores, stderrs)
  span = float(horizon) - float(min(steps))
  end, end_se = f.at(horizon)
  return {'at_step': int(max(steps)), 'steps': int(horizon),
          'change': round(f.slope * span, 4) + 0.0,            # + 0.0: no -0.0
          'change_stderr': round(abs(span) * math.sqrt(max(f.cov[1][1], 0.0)), 4),
          'end': round(end, 4) + 0.0, 'end_stderr': round(end_se, 4), 'points': f.points}


def z_of(confidence: float) -> float:
  """The standard normal quantile of `confidence` (in (0, 1))."""
  return statistics.NormalDist().inv_cdf(confidence)


def crosses(fc: Mapping, best: float, best_stderr: float, max_drop: float,
            confidence: float) -> bool:
  """Whether forecast `fc` (`forecast`'s) puts the domain's end more than `max_drop` points
  below `best` with probability at least `confidence`."""
  sd = math.hypot(fc['end_stderr'], best_stderr)
  margin = best - fc['end'] - max_drop
  if sd == 0.0:
    return margin > 0.0
  return margin / sd >= z_of(confidence)


def predicts_fall(change: float, change_stderr: float, kl: float | None = None,
                  kl_before: float | None = None, grad_cos: float | None = None) -> bool:
  """The forecast's sign with the signals (module docstring): the slope's where it is more than
  one standard error from flat, else (both signals known) a fall when the stage's update points
  against the domain's reward (grad_cos < 0) while its KL drift grows."""
  if abs(change) > change_stderr or kl is None or grad_cos is None:
    return change < 0
  return grad_cos < 0 and kl > (kl_before or 0.0)


def outcome_rows(guards: Mapping[str, Mapping]) -> list[dict]:
  """results.json "forecast": per stage and protected domain, the stage's first forecast (from
  its first two probed steps) beside the outcome (the last probe's score minus the first's;
  None where the stage did not run to its last step, e.g. a guard's stop).

  Args:
    guards: stage -> its guard record (`StageGuard.info`), in run order.
  """
  out = []
  for stage, info in guards.items():
    for d, f in sorted((info.get('forecast') or {}).items()):
      row = {'stage': stage, 'domain': d, 'at_step': f['at_step'], 'steps': f['steps'],
             'forecast': f['change'], 'stderr': f['change_stderr'], 'outcome': f.get('outcome')}
      row.update({k: f[k] for k in SIGNAL_KEYS if k in f})
      out.append(row)
  return out


# What a forecast with signals carries beside the slope's (`cascade.guard`), kept in its row.
SIGNAL_KEYS = ('kl', 'grad_cos', 'falls')


def _mean(xs) -> float | None:
  return float(f'{float(np.mean(xs)):.6g}') if xs else None


def accuracy(rows: Sequence[Mapping], big: float = 5.0) -> dict:
  """How the forecasts of `rows` (`outcome_rows`' with an outcome) did: the mean absolute error
  (points), and, over the outcomes that fell more than `big` points, how many forecasts had
  the right sign (a fall). Rows with signals (`SIGNAL_KEYS`; results without them have none)
  add, per predictor, the falls it could judge and those it called: 'grad_cos' (< 0), the
  combined 'falls' (`predicts_fall`), and the mean KL drift of the falls and of the rest."""
  done = [r for r in rows if r.get('outcome') is not None]
  falls = [r for r in done if r['outcome'] < -big]
  out = {'n': len(done),
         'mean_abs_error': (round(float(np.mean([abs(r['forecast'] - r['outcome'])
                                                 for r in done])), 4) if done else None),
         'falls': len(falls),
         'falls_sign_right': sum(1 for r in falls if r['forecast'] < 0)}
  if not any(k in r for r in done for k in SIGNAL_KEYS):
    return out
  cos = [r for r in falls if r.get('grad_cos') is not None]
  comb = [r for r in falls if r.get('falls') is not None]
  out.update({'falls_grad_cos': len(cos),
              'falls_sign_right_grad_cos': sum(1 for r in cos if r['grad_cos'] < 0),
              'falls_combined': len(comb),
              'falls_sign_right_combined': sum(1 for r in comb if r['falls']),
              'kl_mean_falls': _mean([r['kl'] for r in falls if r.get('kl') is not None]),
              'kl_mean_rest': _mean([r['kl'] for r in done
                                     if r['outcome'] >= -big and r.get('kl') is not None])})
  return out
