"""The metrics of an evaluation protocol and their uncertainty, in float64 numpy.

A suite samples k completions of each of P prompts and grades each one
(`grades[p, i]` in [0, 1], 1 = right). What the papers report from that:

  avg@k     the mean grade over prompts and samples (pass@1 estimated from k
            samples), with the standard error of the mean over prompts (the
            prompts are the sample; a prompt's k grades are averaged first);
  pass@k    the chance that at least one of k samples is right, by the
            unbiased estimator 1 - C(n - c, k) / C(n, k) of the Codex paper
            (n samples per prompt, c right), averaged over prompts;
  maj@k     the grade of the most frequent extracted answer among k samples
            (ties: the earliest sample), averaged over prompts.

`bootstrap` gives a percentile interval of any statistic over resampled
rows (prompts; ArenaHard's battles), `bootstrap_replicates` the resampled
statistics themselves (ArenaHard v2 reports their mean).
"""

from __future__ import annotations

import collections
from typing import Callable, Hashable, Sequence

import numpy as np


def _grades(grades) -> np.ndarray:
  g = np.asarray(grades, np.float64)
  if g.ndim != 2 or g.shape[0] == 0 or g.shape[1] == 0:
    raise ValueError(f'grades must be [prompts, samples] with both > 0, got shape {g.shape}')
  if not np.all(np.isfinite(g)):
    raise ValueError('grades must be finite')
  return g


def avg_at_k(grades) -> tuple[float, float]:
  """(mean, standard error) of the grades [P, k], in the grades' units.

  The standard error is the sample standard deviation of the P per-prompt means
  over sqrt(P) (0 for a single prompt): the uncertainty of the benchmark score
  from its finite set of prompts and samples.
  """
  g = _grades(grades)
  per_prompt = g.mean(axis=1)
  p = per_prompt.size
  se = float(per_prompt.std(ddof=1) / np.sqrt(p)) if p > 1 else 0.0
  return float(per_prompt.mean()), se


def pass_at_k_one(n: int, c: int, k: int) -> float:
  """The unbiased pass@k of one prompt with n samples of which c are right.

  1 - C(n - c, k) / C(n, k), computed as a product so that large n stays exact
  in float64 (the Codex paper's form).
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f'pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}')
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k(grades, k: int) -> float:
  """pass@k averaged over prompts; a sample counts as right when its grade is 1."""
  g = _grades(grades)
  n = g.shape[1]
  right = (g >= 1.0).sum(axis=1)
  return float(np.mean([pass_at_k_one(n, int(c), k) for c in right]))


def maj_at_k(grades, answers: Sequence[Sequence[Hashable | None]]) -> float:
  """maj@k: per prompt, the grade of a sample carrying the most frequent answer.

  Args:
    grades: [P, k] grades.
    answers: [P][k] each sample's extracted, normalised answer (None: no
      answer, never the majority unless every sample has none).

  Returns:
    The mean over prompts of the majority answer's grade (ties between
    answers: the one whose first sample comes first).
  """
  g = _grades(grades)
  if len(answers) != g.shape[0] or any(len(a) != g.shape[1] for a in answers):
    raise ValueError(f'answers must be [{g.shape[0]}][{g.shape[1]}] like the grades')
  out = []
  for row, ans in zip(g, answers):
    counts = collections.Counter(a for a in ans if a is not None)
    if not counts:
      out.append(0.0)
      continue
    top = max(counts.values())
    first = next(i for i, a in enumerate(ans) if a is not None and counts[a] == top)
    out.append(float(row[first]))
  return float(np.mean(out))


def bootstrap_replicates(values, statistic: Callable[[np.ndarray], float], rounds: int = 1000,
                         seed: int = 0) -> np.ndarray:
  """`statistic` of each of `rounds` resamples of `values`' rows, [rounds] float64.

  Round r resamples with the r-th draw `rng.integers(0, n, n)` of
  `np.random.default_rng(seed)` (n rows), so the replicates are reproducible.

  Args:
    values: an array whose first axis is resampled with replacement.
    statistic: array -> float.
    rounds: number of resamples.
    seed: the resampling seed.
  """
  v = np.asarray(values)
  if v.shape[0] == 0:
    raise ValueError('bootstrap needs at least one row')
  rng = np.random.default_rng(seed)
  return np.array([statistic(v[rng.integers(0, v.shape[0], v.shape[0])])
                   for _ in range(rounds)], np.float64)


def bootstrap(values, statistic: Callable[[np.ndarray], float], rounds: int = 1000,
              seed: int = 0, level: float = 0.95) -> tuple[float, float]:
  """A percentile interval of `statistic` over `rounds` resamples of `values`' rows
  (`bootstrap_replicates`).

  Args:
    values: an array whose first axis is resampled with replacement.
    statistic: array -> float.
    rounds: number of resamples.
    seed: the resampling seed (the interval is reproducible).
    level: the interval's coverage.

  Returns:
    (low, high).
  """
  stats = bootstrap_replicates(values, statistic, rounds, seed)
  tail = (1.0 - level) / 2
  return float(np.quantile(stats, tail)), float(np.quantile(stats, 1.0 - tail))
