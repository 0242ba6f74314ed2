"""The forecast of forgetting (`cascade.forecast`, `cascade.guard`): the weighted line and its
standard errors equal numpy's float64 fit, a guard acts on a forecast past its bound only with
`config.guard.forecast_confidence` and at that confidence, and results.json / results.md carry
forecast against outcome."""

import json
import math
import statistics
import types

import numpy as np
import pytest

from cascade import checkpoint
from cascade import config as config_lib
from cascade import evaluation
from cascade import forecast as forecast_lib
from cascade import guard as guard_lib
from cascade import ledger as ledger_lib
from cascade import runner

GUARDED = dict(name='sft_b', kind='sft', domains=['b'], datasets=['sft'], steps=6, batch_size=4,
               max_len=16, optimizer=dict(lr=1e-2))


def _reference(t, s, e, floor=forecast_lib.STDERR_FLOOR):
  """np.polyfit's weighted line (weights 1/sigma) and its unscaled covariance, widened by the
  reduced chi-square when it exceeds 1 (n > 2)."""
  t, s, e = (np.asarray(x, np.float64) for x in (t, s, e))
  sig = np.maximum(e, floor)
  coef, cov = np.polyfit(t, s, 1, w=1.0 / sig, cov='unscaled')
  slope, icpt = coef
  if len(t) > 2:
    chi2 = np.sum(((s - icpt - slope * t) / sig) ** 2)
    cov = cov * max(1.0, chi2 / (len(t) - 2))
  return icpt, slope, cov          # cov is over (slope, intercept)


@pytest.mark.parametrize('seed,n', [(0, 2), (1, 3), (2, 5), (3, 6)])
def test_the_fit_and_its_standard_errors_equal_numpys_weighted_polyfit(seed, n):
  rng = np.random.default_rng(seed)
  t = np.sort(rng.choice(np.arange(0, 30), n, replace=False)).astype(float)
  e = rng.uniform(0.0, 8.0, n)          # some below the floor
  s = 60.0 - 0.8 * t + rng.normal(0, 1, n) * np.maximum(e, 1.0) * rng.uniform(0.5, 3.0)
  f = forecast_lib.fit(t, s, e)
  icpt, slope, cov = _reference(t, s, e)
  assert math.isclose(f.intercept, icpt, rel_tol=1e-9, abs_tol=1e-9)
  assert math.isclose(f.slope, slope, rel_tol=1e-9, abs_tol=1e-9)
  np.testing.assert_allclose(np.asarray(f.cov), cov[::-1, ::-1], rtol=1e-9, atol=1e-12)
  horizon = 40
  fc = forecast_lib.forecast(t, s, e, horizon)
  span = horizon - t.min()
  assert math.isclose(fc['change'], round(slope * span, 4), abs_tol=1e-4)
  assert math.isclose(fc['change_stderr'], round(span * math.sqrt(cov[0, 0]), 4), abs_tol=1e-4)
  x = np.array([horizon, 1.0])
  assert math.isclose(fc['end'], round(icpt + slope * horizon, 4), abs_tol=1e-4)
  assert math.isclose(fc['end_stderr'], round(math.sqrt(x @ cov @ x), 4), abs_tol=1e-4)
  assert fc['at_step'] == int(t.max()) and fc['steps'] == horizon and fc['points'] == n


def test_two_probes_extrapolate_their_difference_with_both_errors():
  # From 60 ± 2 at step 0 to 55 ± 3 at step 5, extrapolated to step 20: -20 ± 4 sqrt(13).
  fc = forecast_lib.forecast([0, 5], [60.0, 55.0], [2.0, 3.0], 20)
  assert fc['change'] == -20.0 and math.isclose(fc['change_stderr'], 4 * math.sqrt(13), rel_tol=1e-6)


@pytest.mark.parametrize('steps,scores,errs,want', [
    ([3, 3], [1.0, 2.0], [1.0, 1.0], 'needs probes at two distinct steps'),
    ([0, 1], [1.0], [1.0, 1.0], 'differ in shape'),
])
def test_a_fit_without_two_steps_says_why(steps, scores, errs, want):
  with pytest.raises(ValueError, match=want):
    forecast_lib.fit(steps, scores, errs)


def test_crossing_is_the_normal_quantile_of_the_margin():
  fc = {'end': 51.0, 'end_stderr': 3.0}
  # margin 60 - 51 - 3 = 6 over sd 5: z = 1.2, i.e. confidence Phi(1.2) = 0.885.
  at = statistics.NormalDist().cdf(1.2)
  assert forecast_lib.crosses(fc, 60.0, 4.0, 3.0, at - 1e-6)
  assert not forecast_lib.crosses(fc, 60.0, 4.0, 3.0, at + 1e-6)
  assert not forecast_lib.crosses(fc, 53.9, 4.0, 3.0, 0.5)     # forecast within the bound
  assert forecast_lib.crosses({'end': 10.0, 'end_stderr': 0.0}, 20.0, 0.0, 3.0, 0.99)


def test_accuracy_counts_the_signs_of_the_big_falls_and_the_mean_error():
  rows = [dict(forecast=-10.0, outcome=-12.0), dict(forecast=1.0, outcome=-6.0),
          dict(forecast=-2.0, outcome=-1.0), dict(forecast=-3.0, outcome=None)]
  assert forecast_lib.accuracy(rows) == {'n': 3, 'mean_abs_error': round((2 + 7 + 1) / 3, 4),
                                         'falls': 2, 'falls_sign_right': 1}


# ------------------------------------------------------------------ the guard

def _guard(fakes, tmp_path, monkeypatch, scores, **guard):
  """A StageGuard of 'sft_b' (6 steps, protecting 'a') whose probe of each step scores
  `scores[step]` (stderr 1), its ledger over a real progress.json."""
  plan = fakes.toy_config([fakes.rl_stage('a_rl', ['a']), GUARDED], validation=True,
                          guard=dict(domains=['a'], every=2, max_drop=3.0, stderrs=2.0,
                                     prompts=4, **guard))
  led = ledger_lib.Ledger(checkpoint.Progress(str(tmp_path)))
  ctx = types.SimpleNamespace(plan=plan, ledger=led)
  at = {}
  monkeypatch.setattr(evaluation, 'probe_results',
                      lambda ctx_, params, prompts, domains: {'a': {'score': scores[at['s']],
                                                                    'stderr': 1.0}})
  g = guard_lib.StageGuard(ctx, plan.stages[1])

  def probe(step):
    at['s'] = step
    results, breached, m = g.probe(step, None)
    crossed = dict(g.forecast_crossed)
    g.record(step, results, breached, ckpt=True)
    return breached, crossed, m
  return g, probe, led


@pytest.mark.parametrize('confidence,acts', [(0.0, False), (0.9, True), (0.95, False)])
def test_a_guard_acts_on_a_forecast_past_its_bound_at_its_confidence(
    fakes, tmp_path, monkeypatch, capsys, confidence, acts):
  # 60 at step 0, 57 at step 2 (an observed drop of 3, within 3 + 2 sqrt(2)): the line ends at
  # 51 ± sqrt(13) by step 6; against the best 60 ± 1 the margin 6 is 1.60 sd (Phi: 0.945).
  g, probe, led = _guard(fakes, tmp_path, monkeypatch, {0: 60.0, 2: 57.0}, action='stop',
                         forecast_confidence=confidence)
  assert probe(0)[1] == {} and g.forecast == {}
  breached, crossed, m = probe(2)
  assert breached == {} and m['forecast/a'] == -9.0 and m['guard/a'] == 3.0
  assert bool(crossed) == acts and g.forecast_stops(crossed) == acts
  entry = led.entries(ledger_lib.PROBE)[-1]
  assert entry['within'] and entry['forecast']['a']['end'] == 51.0
  assert math.isclose(entry['forecast']['a']['end_stderr'], math.sqrt(13), abs_tol=1e-4)
  assert bool(entry.get('forecast_crossed')) == acts
  assert g.breached_at(2) == acts          # a resume at step 2 stops as the run did
  err = capsys.readouterr().err
  assert ('[1] sft_b: guard: a is forecast at 51.0 ± 3.6 by step 6 (from its probes up to step 2), '
          'more than 3.0 below its best probe 60.0 with confidence 0.9; stop' in err) == acts
  if acts:
    assert crossed['a']['confidence'] == 0.9 and g.stop_step() == 2


def test_the_stage_record_keeps_the_first_forecast_beside_the_outcome(
    fakes, tmp_path, monkeypatch):
  g, probe, _ = _guard(fakes, tmp_path, monkeypatch, {0: 60.0, 2: 57.0, 4: 50.0, 6: 45.0},
                       action='warn')
  for s in (0, 2, 4, 6):
    probe(s)
  info = g.info()
  assert info['forecast']['a']['change'] == -9.0 and info['forecast']['a']['at_step'] == 2
  assert info['forecast']['a']['outcome'] == -15.0 and 'forecast_crossings' not in info
  rows = forecast_lib.outcome_rows({'sft_b': info})
  assert rows == [{'stage': 'sft_b', 'domain': 'a', 'at_step': 2, 'steps': 6, 'forecast': -9.0,
                   'stderr': info['forecast']['a']['change_stderr'], 'outcome': -15.0}]


def test_a_stage_that_ended_early_has_no_outcome(fakes, tmp_path, monkeypatch):
  g, probe, _ = _guard(fakes, tmp_path, monkeypatch, {0: 60.0, 2: 57.0, 4: 50.0})
  for s in (0, 2, 4):
    probe(s)
  assert g.info()['forecast']['a']['outcome'] is None


@pytest.mark.parametrize('value', [0.3, 1.0, -0.1, 'x'])
def test_a_bad_forecast_confidence_is_one_config_error_line(fakes, value):
  with pytest.raises(config_lib.ConfigError) as e:
    fakes.toy_config([fakes.rl_stage('a_rl', ['a']), GUARDED], validation=True,
                     guard=dict(domains=['a'], forecast_confidence=value))
  msg = str(e.value)
  assert msg.startswith('config.guard.forecast_confidence=') and '\n' not in msg, msg
  assert 'must be 0 (off) or a probability in [0.5, 1)' in msg


def test_results_json_and_md_carry_forecast_against_outcome(tmp_path, monkeypatch):
  info = {'protected': ['a'], 'action': 'warn', 'probes': 4, 'breaches': [],
          'forecast': {'a': {'at_step': 2, 'steps': 6, 'change': -9.0, 'change_stderr': 10.8,
                             'end': 51.0, 'end_stderr': 3.6, 'points': 2, 'outcome': -15.0}}}
  progress = types.SimpleNamespace(done={'sft': {}, 'sft_b': {'guard': info}}, rows=[],
                                   ledger=[])
  plan = types.SimpleNamespace(substitutions={})
  ctx = types.SimpleNamespace(plan=plan, progress=progress, ledger=None)
  extra = runner._results_extra(ctx, ['a', 'b'])   # pylint: disable=protected-access
  assert extra['forecast'] == [{'stage': 'sft_b', 'domain': 'a', 'at_step': 2, 'steps': 6,
                                'forecast': -9.0, 'stderr': 10.8, 'outcome': -15.0}]
  rows = [{'stage': 'sft', 'index': 0, 'domains': ['a', 'b'], 'scores': {'a': 60.0, 'b': 10.0}},
          {'stage': 'sft_b', 'index': 1, 'domains': ['b'], 'scores': {'a': 44.0, 'b': 30.0}}]
  plotted = []
  monkeypatch.setattr(evaluation, 'plot', lambda res, path: plotted.append(res))   # matplotlib: slow
  res = evaluation.write(str(tmp_path), rows, ['a', 'b'], extra=extra)
  assert res['forecast'] == extra['forecast'] and plotted[0]['forecast'] == extra['forecast']
  assert json.loads((tmp_path / 'results.json').read_text())['forecast'] == extra['forecast']
  md = (tmp_path / 'results.md').read_text()
  assert 'Forecast of forgetting' in md and '| sft_b | a | 2 of 6 | -9.0 ± 10.8 | -15.0 |' in md
  # The plot marks the forecast beside the matrix: the row before plus the forecast change.
  ax = types.SimpleNamespace(bars=[])
  ax.errorbar = lambda x, y, **kw: ax.bars.append((x, y, kw['yerr'], kw['label']))
  evaluation._plot_forecasts(ax, res, np.arange(2.0), {'a': 'C0', 'b': 'C1'})  # pylint: disable=protected-access
  assert ax.bars == [(1.08, 51.0, 10.8, 'forecast from the first probes (± s.e.)')]
