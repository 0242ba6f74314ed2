"""The forecast's signals (`cascade.signals`, `cascade.forecast.predicts_fall`): the KL drift
equals the exact KL of hand-made distributions in float64, the cosine equals numpy's on small
pytrees, the probe-reward gradient equals a finite difference of the forward pass, and a guard
with config.guard.signals records them beside each forecast, in its metrics and results rows."""

import math
import types

import jax
import numpy as np
import pytest

from cascade import checkpoint
from cascade import config as config_lib
from cascade import evaluation
from cascade import forecast as forecast_lib
from cascade import guard as guard_lib
from cascade import ledger as ledger_lib
from cascade import signals as signals_lib
from rl import batch as batch_lib

GUARDED = dict(name='sft_b', kind='sft', domains=['b'], datasets=['sft'], steps=6, batch_size=4,
               max_len=16, optimizer=dict(lr=1e-2))


# ------------------------------------------------------------------ KL drift

def test_kl_drift_from_the_references_own_samples_is_the_exact_kl_in_float64():
  # pi_0 = (1/2, 1/4, 1/8, 1/8) sampled in exact proportions (8 draws); pi_t = (0.1, 0.2, 0.3,
  # 0.4): the mean of exp(d) - 1 - d over them is KL(pi_0 || pi_t) exactly. Padding is masked.
  p = np.array([0.5, 0.25, 0.125, 0.125])
  q = np.array([0.1, 0.2, 0.3, 0.4])
  draws = np.array([0, 0, 0, 0, 1, 1, 2, 3])
  ref = np.log(p)[draws].reshape(2, 4)
  cur = np.log(q)[draws].reshape(2, 4)
  pad = np.full((2, 3), 7.0)                     # nonsense log-probs where the mask is 0
  ref, cur = np.concatenate([ref, pad], 1), np.concatenate([cur, -pad], 1)
  mask = np.concatenate([np.ones((2, 4)), np.zeros((2, 3))], 1)
  exact = float(np.sum(p * np.log(p / q)))
  got = signals_lib.kl_k3(cur.astype(np.float32), ref.astype(np.float32), mask)
  assert math.isclose(got, exact, rel_tol=1e-6), (got, exact)
  assert signals_lib.kl_k3(ref, ref, mask) == 0.0
  assert signals_lib.kl_k3(cur, ref, np.zeros_like(mask)) == 0.0
  with pytest.raises(ValueError, match='differ in shape'):
    signals_lib.kl_k3(cur[:, :2], ref, mask)


# ------------------------------------------------------------------ cosine

def _tree(rng):
  return {'w': rng.normal(size=(3, 4)).astype(np.float32),
          'b': {'x': rng.normal(size=(5,)).astype(np.float32),
                'count': np.arange(3, dtype=np.int32)}}     # not floating: left out


@pytest.mark.parametrize('seed', [0, 1])
def test_the_cosine_of_two_pytrees_is_numpys_of_their_flat_floats(seed):
  rng = np.random.default_rng(seed)
  a, b = _tree(rng), _tree(rng)
  flat = [np.concatenate([t['b']['x'].ravel(), t['w'].ravel()]).astype(np.float64)
          for t in (a, b)]
  want = flat[0] @ flat[1] / (np.linalg.norm(flat[0]) * np.linalg.norm(flat[1]))
  assert math.isclose(signals_lib.tree_cosine(a, b), want, rel_tol=1e-5, abs_tol=1e-6)
  neg = jax.tree.map(lambda x: -x, b)
  assert math.isclose(signals_lib.tree_cosine(a, neg), -want, rel_tol=1e-5, abs_tol=1e-6)
  delta = signals_lib.tree_delta(a, b)
  np.testing.assert_allclose(np.concatenate([np.ravel(x) for x in delta]), flat[0] - flat[1],
                             rtol=1e-6, atol=1e-6)
  zero = jax.tree.map(np.zeros_like, a)
  assert signals_lib.tree_cosine(a, zero) is None
  with pytest.raises(ValueError, match='differ'):
    signals_lib.tree_cosine(a, {'w': a['w']})


def test_reward_weights_center_the_rewards_over_the_rows():
  np.testing.assert_allclose(signals_lib.reward_weights([1.0, 0.0, 0.0, 1.0]),
                             [0.125, -0.125, -0.125, 0.125])
  assert not signals_lib.reward_weights([1.0, 1.0]).any()


# ------------------------------------------------------------------ the combined sign

@pytest.mark.parametrize('change,se,kl,kl_before,cos,want', [
    (-9.0, 4.0, None, None, None, True),       # the slope speaks
    (-9.0, 4.0, 0.2, 0.1, 0.5, True),          # ... whatever the signals say
    (9.0, 4.0, 0.2, 0.1, -0.5, False),
    (-1.0, 4.0, None, None, -0.5, True),       # flat slope, no signals: still its sign
    (1.0, 4.0, 0.2, 0.1, -0.5, True),          # flat slope: against the reward, KL growing
    (1.0, 4.0, 0.2, None, -0.5, True),         # the stage's start: KL 0 before
    (-1.0, 4.0, 0.2, 0.1, 0.5, False),         # with the reward
    (-1.0, 4.0, 0.1, 0.2, -0.5, False),        # KL no longer growing
])
def test_the_forecasts_sign_takes_the_signals_where_the_slope_is_flat(
    change, se, kl, kl_before, cos, want):
  assert forecast_lib.predicts_fall(change, se, kl, kl_before, cos) is want


def test_accuracy_reports_each_predictor_and_stays_as_it_was_without_signals():
  plain = [dict(forecast=-10.0, outcome=-12.0), dict(forecast=1.0, outcome=-6.0)]
  assert set(forecast_lib.accuracy(plain)) == {'n', 'mean_abs_error', 'falls',
                                               'falls_sign_right'}
  rows = [dict(forecast=-10.0, outcome=-12.0, kl=0.3, grad_cos=0.2, falls=True),
          dict(forecast=1.0, outcome=-6.0, kl=0.5, grad_cos=-0.4, falls=True),
          dict(forecast=1.0, outcome=-8.0, kl=0.1, grad_cos=None, falls=False),
          dict(forecast=-2.0, outcome=1.0, kl=0.02, grad_cos=0.1, falls=False),
          dict(forecast=-3.0, outcome=None, kl=0.9, grad_cos=-1.0, falls=True)]
  acc = forecast_lib.accuracy(rows)
  assert acc == {'n': 4, 'mean_abs_error': round((2 + 7 + 9 + 3) / 4, 4), 'falls': 3,
                 'falls_sign_right': 1, 'falls_grad_cos': 2, 'falls_sign_right_grad_cos': 1,
                 'falls_combined': 3, 'falls_sign_right_combined': 2,
                 'kl_mean_falls': 0.3, 'kl_mean_rest': 0.02}


# ------------------------------------------------------------------ the guard

def _signal_guard(fakes, tmp_path, monkeypatch, scores, measured, **guard):
  """A StageGuard of 'sft_b' (6 steps, protecting 'a', signals on) whose probe of each step
  scores `scores[step]` (stderr 1) and whose signals there are `measured[step]`."""
  plan = fakes.toy_config([fakes.rl_stage('a_rl', ['a']), GUARDED], validation=True,
                          guard=dict(domains=['a'], every=2, max_drop=3.0, stderrs=2.0,
                                     prompts=4, signals=['kl', 'grad_cos'], **guard))
  led = ledger_lib.Ledger(checkpoint.Progress(str(tmp_path)))
  ctx = types.SimpleNamespace(plan=plan, ledger=led)
  at = {}
  monkeypatch.setattr(evaluation, 'probe_results',
                      lambda ctx_, params, prompts, domains: {'a': {'score': scores[at['s']],
                                                                    'stderr': 1.0}})
  monkeypatch.setattr(signals_lib.Tracker, 'measure', lambda self, params: measured[at['s']])
  g = guard_lib.StageGuard(ctx, plan.stages[1])

  def probe(step):
    at['s'] = step
    results, breached, m = g.probe(step, None)
    g.record(step, results, breached, ckpt=True)
    return m
  return g, probe


def test_a_guard_with_signals_records_them_beside_each_forecast(fakes, tmp_path, monkeypatch):
  # Flat probes (60, 60.5, 60): the slope cannot tell; the update points against a's reward
  # and the KL grows from step 2 to 4, so the combined sign is a fall at both.
  scores = {0: 60.0, 2: 60.5, 4: 60.0, 6: 50.0}
  measured = {2: {'a': {'kl': 0.01, 'grad_cos': -0.3}}, 4: {'a': {'kl': 0.04, 'grad_cos': -0.2}},
              6: {'a': {'kl': 0.03, 'grad_cos': None}}}
  g, probe = _signal_guard(fakes, tmp_path, monkeypatch, scores, measured)
  assert g.tracker is not None and g.tracker.signals == ('kl', 'grad_cos')
  assert not any(k.startswith('forecast/') for k in probe(0))
  m = probe(2)
  assert m['forecast/a/kl'] == 0.01 and m['forecast/a/grad_cos'] == -0.3
  m = probe(4)
  assert m['forecast/a/kl'] == 0.04
  m = probe(6)
  assert 'forecast/a/grad_cos' not in m          # undefined: left out of the metrics
  fcs = [e.get('forecast', {}).get('a') for e in g.ledger.entries(ledger_lib.PROBE)]
  assert fcs[0] is None
  assert [(f['kl'], f['grad_cos'], f['falls']) for f in fcs[1:]] == [
      (0.01, -0.3, True), (0.04, -0.2, True), (0.03, None, True)]   # the last: the slope's
  info = g.info()
  assert info['forecast']['a']['falls'] is True and info['forecast']['a']['outcome'] == -10.0
  rows = forecast_lib.outcome_rows({'sft_b': info})
  assert rows[0]['kl'] == 0.01 and rows[0]['grad_cos'] == -0.3 and rows[0]['falls'] is True


def test_the_config_names_the_signals_this_module_measures():
  assert config_lib.GUARD_SIGNALS == signals_lib.SIGNALS


def test_a_guard_without_signals_measures_none(fakes, tmp_path, monkeypatch):
  plan = fakes.toy_config([fakes.rl_stage('a_rl', ['a']), GUARDED], validation=True,
                          guard=dict(domains=['a']))
  assert plan.guard.signals == () and plan.guard.signal_samples == 4
  ctx = types.SimpleNamespace(plan=plan, ledger=ledger_lib.Ledger(
      checkpoint.Progress(str(tmp_path))))
  assert guard_lib.StageGuard(ctx, plan.stages[1]).tracker is None
  assert 'signals' not in plan.source['guard']        # absent: the config hashes as before


@pytest.mark.parametrize('value,want', [
    (['kl', 'entropy'], 'config.guard.signals='), (['kl', 'kl'], 'config.guard.signals='),
    (3, 'config.guard.signals='), (0, 'config.guard.signal_samples=')])
def test_bad_signals_are_one_config_error_line(fakes, value, want):
  key = 'signal_samples' if want.endswith('signal_samples=') else 'signals'
  with pytest.raises(config_lib.ConfigError) as e:
    fakes.toy_config([fakes.rl_stage('a_rl', ['a']), GUARDED], validation=True,
                     guard={'domains': ['a'], key: value})
  msg = str(e.value)
  assert msg.startswith(want) and '\n' not in msg, msg


# ------------------------------------------------------------------ on a real tiny policy

def _tiny_ctx(fakes):
  """A run context of the toy plan with a real tiny policy, the own-answer sampler (rows
  alternate right and wrong, so their rewards differ) and the value verifier."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from models import transformer  # pylint: disable=g-import-not-at-top
  plan = fakes.toy_config([fakes.rl_stage('a_rl', ['a']), GUARDED], validation=True,
                          guard=dict(domains=['a'], prompts=3, signal_samples=2,
                                     signals=['kl', 'grad_cos']))
  graphdef, p0 = nnx.split(transformer.create(plan.model, 7))
  recs = [fakes.record('a', i, 10 + i) for i in range(5)]
  ctx = types.SimpleNamespace(
      plan=plan, sampler=fakes.OwnAnswerSampler(right=lambda n, g: g == 0),
      tokenizer=fakes.CharTokenizer(), data=types.SimpleNamespace(validation_sets={'a': recs}),
      verifiers=types.SimpleNamespace(can_evaluate=lambda d: True,
                                      eval_verifier=fakes.ValueVerifier),
      sample_cls=fakes.Sample, mesh=None, rules=None,
      policies=types.SimpleNamespace(start_params=lambda stage: p0,
                                     graphdef=lambda model: graphdef))
  return ctx, graphdef, p0


@pytest.mark.heavy        # compiles a tiny model's forward and gradient (~20 s on a loaded host)
def test_the_signals_of_a_tiny_policy_against_a_finite_difference(fakes):
  ctx, graphdef, p0 = _tiny_ctx(fakes)
  tr = signals_lib.Tracker(ctx, ctx.plan.stages[1], ('a',), ('kl', 'grad_cos'), 3, 2)
  assert tr.measure(p0) == {'a': {'kl': 0.0, 'grad_cos': None}}     # at the start: no drift
  a = tr.anchors['a']
  assert a.batch.tokens.shape[0] == 6 and sorted(set(a.rewards)) == [-1.0, 1.0, 2.0, 3.0]
  w = signals_lib.reward_weights(a.rewards)
  g = signals_lib.reward_grad(graphdef, p0, a.batch, w)

  def objective(params):       # the same sum through the forward pass alone, in float64
    lp = np.asarray(batch_lib.compute_logprobs(graphdef, params, a.batch), np.float64)
    return float(np.sum(w[:, None] * a.batch.loss_mask * lp))
  # A unit direction half along the gradient, half random (a pure random one is nearly
  # orthogonal to it in ~30K dimensions, its derivative lost in float32 noise).
  rng = np.random.default_rng(0)
  r = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), p0)
  norm = lambda t: math.sqrt(sum(float(np.vdot(x, x)) for x in jax.tree.leaves(t)))
  gn, rn = norm(g), norm(r)
  v = jax.tree.map(lambda x, y: np.asarray(x) / gn + y / rn, g, r)
  eps = 1e-3
  fd = (objective(jax.tree.map(lambda x, y: x + eps * y, p0, v))
        - objective(jax.tree.map(lambda x, y: x - eps * y, p0, v))) / (2 * eps)
  dot = sum(float(np.vdot(np.asarray(x, np.float64), np.asarray(y, np.float64)))
            for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(v)))
  assert math.isclose(dot, fd, rel_tol=1e-2), (dot, fd)
  # A small step along the probe-reward gradient raises it (cosine near 1), against it lowers
  # it (near -1); either way the policy drifted (KL > 0), the same on both sides to first order.
  up = tr.measure(jax.tree.map(lambda x, y: x + 1e-3 * y, p0, g))['a']
  down = tr.measure(jax.tree.map(lambda x, y: x - 1e-3 * y, p0, g))['a']
  assert up['grad_cos'] > 0.99 and down['grad_cos'] < -0.99, (up, down)
  assert up['kl'] > 0 and down['kl'] > 0


def test_results_md_gives_the_signals_columns_only_where_rows_have_them():
  row = {'stage': 'sft_b', 'domain': 'a', 'at_step': 2, 'steps': 6, 'forecast': -9.0,
         'stderr': 10.8, 'outcome': -15.0}
  plain = evaluation.forecast_markdown([row])
  assert '| sft_b | a | 2 of 6 | -9.0 ± 10.8 | -15.0 |\n' in plain and 'grad cos' not in plain
  md = evaluation.forecast_markdown([dict(row, kl=0.0123, grad_cos=-0.25, falls=True),
                                     dict(row, domain='b', kl=0.5, grad_cos=None, falls=False)])
  assert '| stage | domain | from steps 0..k | forecast | outcome | KL | grad cos | sign |' in md
  assert '| sft_b | a | 2 of 6 | -9.0 ± 10.8 | -15.0 | 0.0123 | -0.25 | fall |' in md
  assert '| sft_b | b | 2 of 6 | -9.0 ± 10.8 | -15.0 | 0.5 | - | no fall |' in md
