"""The guard's paired comparison (`cascade.guard.paired_stderr`, `drop_stderr`): two probes score
the same prompts with the same key, so a drop's standard error is that of the per-prompt
differences; the per-prompt scores round-trip through the ledger's progress.json, and an entry
kept without them falls back to the independent bound, saying so."""

import math
import types

import numpy as np
import pytest

from cascade import checkpoint
from cascade import evaluation
from cascade import guard as guard_lib
from cascade import ledger as ledger_lib
from tests.cascade.test_guard import GUARDED


def _reference(best: dict, now: dict) -> tuple[float, int]:
  """numpy float64: the standard error of the mean per-prompt difference (ddof=1)."""
  common = [p for p in best if p in now]
  d = np.array([best[p] - now[p] for p in common], np.float64)
  return float(np.std(d, ddof=1) / np.sqrt(d.size)), d.size


def _independent(best: dict, now: dict) -> float:
  se = lambda x: float(np.std(np.array(list(x.values()), np.float64), ddof=1) / np.sqrt(len(x)))
  return math.hypot(se(best), se(now))


def test_paired_stderr_matches_numpy_and_is_far_below_the_independent_one():
  rng = np.random.default_rng(0)
  # 32 prompts, 2 samples each (0, 50, 100 points); the later probe loses 50 on 11 prompts and
  # gains 50 on 1: the policies agree on the rest, as two probes of one stage mostly do.
  base = rng.choice([0.0, 50.0, 100.0], 32)
  now = base.copy()
  falls = [i for i in range(32) if base[i] >= 50][:11]
  now[falls] -= 50.0
  rise = next(i for i in range(32) if base[i] < 100 and i not in falls)
  now[rise] += 50.0
  best = {f'p{i}': float(x) for i, x in enumerate(base)}
  cur = {f'p{i}': float(x) for i, x in enumerate(now)}
  se, n = guard_lib.paired_stderr(best, cur)
  want, want_n = _reference(best, cur)
  assert n == want_n == 32 and math.isclose(se, want, rel_tol=1e-12)
  independent = _independent(best, cur)
  assert se < 0.5 * independent, (se, independent)
  # The drop (15.6 points) is past 3 + 2 se paired, but far inside the independent bound.
  drop = float(np.mean(base) - np.mean(now))
  assert 3 + 2 * se < drop < 3 + 2 * independent


def test_paired_stderr_uses_the_prompts_both_probes_scored():
  best = {'a': 100.0, 'b': 50.0, 'c': 0.0, 'd': 100.0, 'e': 50.0}
  now = {'b': 0.0, 'c': 50.0, 'd': 50.0, 'e': 50.0, 'f': 0.0, 'g': 100.0}
  se, n = guard_lib.paired_stderr(best, now)
  want, want_n = _reference(best, now)
  assert n == want_n == 4 and math.isclose(se, want, rel_tol=1e-12)
  # Identical differences: no spread, se 0 (the bound is then max_drop itself).
  assert guard_lib.paired_stderr({'a': 50.0, 'b': 100.0}, {'a': 0.0, 'b': 50.0}) == (0.0, 2)
  # Fewer than two shared prompts, or none recorded: no paired error.
  assert guard_lib.paired_stderr({'a': 1.0, 'b': 2.0}, {'b': 1.0, 'c': 3.0}) is None
  assert guard_lib.paired_stderr(None, now) is None and guard_lib.paired_stderr(best, {}) is None


def test_drop_stderr_falls_back_to_the_independent_bound_and_says_why():
  res = {'score': 50.0, 'stderr': 4.0, 'prompt_scores': {'a': 50.0, 'b': 50.0}}
  old = {'scores': {'x': 60.0}, 'stderr': {'x': 3.0}}               # kept before they existed
  se, how = guard_lib.drop_stderr(old, 'x', res)
  assert se == 5.0 and how == {
      'paired': False, 'se_from': 'independent: the best probe has no per-prompt scores'}
  new = dict(old, prompt_scores={'x': {'a': 100.0, 'b': 50.0}})
  se, how = guard_lib.drop_stderr(new, 'x', res)
  assert se == 25.0 and how == {'paired': True, 'pairs': 2}
  se, how = guard_lib.drop_stderr(new, 'x', {'score': 50.0, 'stderr': 4.0})
  assert se == 5.0 and how['se_from'] == 'independent: this probe has no per-prompt scores'


def test_prompt_points_and_ids():
  # Prompt-major rewards, k=2; -1 (unparsable) counts as 0.
  pts = evaluation.prompt_points([1.0, -1.0, 0.5, 1.0, 0.0, 0.0], 3)
  assert pts == [50.0, 75.0, 0.0] and math.isclose(np.mean(pts), 125 / 3)
  with pytest.raises(ValueError):
    evaluation.prompt_points([1.0, 0.0, 1.0], 2)
  assert evaluation.prompt_ids([{'id': 'a'}, {'id': 'a'}, {'id': 'a#1'}, {}]) == [
      'a', 'a#1', 'a#1#1', '3']


def _guard(fakes, tmp_path, monkeypatch, probes):
  """A StageGuard of 'sft_b' protecting 'a' (max_drop 3, 2 stderrs) over a real progress.json;
  the probe of step s returns `probes[s]`."""
  plan = fakes.toy_config([fakes.rl_stage('a_rl', ['a']), GUARDED], validation=True,
                          guard=dict(domains=['a'], every=2, max_drop=3.0, stderrs=2.0,
                                     prompts=4))
  led = ledger_lib.Ledger(checkpoint.Progress(str(tmp_path)))
  at = {}
  monkeypatch.setattr(evaluation, 'probe_results',
                      lambda ctx_, params, prompts, domains: {'a': dict(probes[at['s']])})
  g = guard_lib.StageGuard(types.SimpleNamespace(plan=plan, ledger=led), plan.stages[1])

  def probe(step):
    at['s'] = step
    results, breached, m = g.probe(step, None)
    g.record(step, results, breached, ckpt=True)
    return breached, m
  return probe, led, plan


def _probe(scores):
  pts = {f'v:{i}': float(x) for i, x in enumerate(scores)}
  arr = np.array(scores, np.float64)
  return {'score': float(arr.mean()), 'stderr': float(np.std(arr, ddof=1) / np.sqrt(arr.size)),
          'prompt_scores': pts}


def test_a_paired_fall_crosses_the_bound_and_round_trips_through_the_ledger(
    fakes, tmp_path, monkeypatch):
  first = [100.0, 0.0, 50.0, 100.0, 50.0, 0.0, 100.0, 50.0] * 2
  later = list(first)
  for i in (0, 3, 6, 8, 11, 14):      # six prompts fall 50 points: 18.75 points
    later[i] -= 50.0
  probe, led, plan = _guard(fakes, tmp_path, monkeypatch, {0: _probe(first), 2: _probe(later)})
  assert probe(0)[0] == {}
  breached, m = probe(2)
  se, n = _reference(_probe(first)['prompt_scores'], _probe(later)['prompt_scores'])
  assert math.isclose(m['guard/a/se'], se, rel_tol=1e-12) and n == 16
  indep = math.hypot(_probe(first)['stderr'], _probe(later)['stderr'])
  assert 3 + 2 * se < m['guard/a'] == 18.75 < 3 + 2 * indep     # only the paired bound sees it
  b = breached['a']
  assert b['paired'] and b['pairs'] == 16 and b['bound'] == round(3 + 2 * se, 4)
  # The per-prompt scores survive progress.json (a resume reads them back).
  again = ledger_lib.Ledger(checkpoint.Progress(str(tmp_path)))
  entries = again.entries(ledger_lib.PROBE)
  assert [e['prompt_scores']['a'] for e in entries] == [
      _probe(first)['prompt_scores'], _probe(later)['prompt_scores']]
  assert entries[-1]['breached']['a']['paired']


def test_a_ledger_entry_without_prompt_scores_uses_the_independent_bound(
    fakes, tmp_path, monkeypatch):
  first = [100.0, 0.0, 50.0, 100.0, 50.0, 0.0, 100.0, 50.0] * 2
  later = [x - 50.0 if x else x for x in first]
  probe, led, plan = _guard(fakes, tmp_path, monkeypatch, {2: _probe(later)})
  # A probe of step 0 as an older run kept it: score and stderr, no per-prompt scores.
  led.record(plan.stages[1], 0, {'a': {'score': 56.25, 'stderr': 0.5}}, kind=ledger_lib.PROBE,
             within=True)
  breached, m = probe(2)
  assert math.isclose(m['guard/a/se'], math.hypot(0.5, _probe(later)['stderr']), rel_tol=1e-12)
  assert breached['a']['paired'] is False
  assert breached['a']['se_from'] == 'independent: the best probe has no per-prompt scores'
