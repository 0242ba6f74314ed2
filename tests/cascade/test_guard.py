"""Regression guards (`cascade.guard`, config.guard): a bad guard is a one-line config error;
while a stage trains, the earlier protected domains are probed between steps into the ledger;
'warn' says so and logs it, 'stop' ends the stage at its newest probed checkpoint within every
bound; an absent section leaves a config's hash as it was."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from cascade import checkpoint
from cascade import config as config_lib
from cascade import data as data_lib
from cascade import evaluation
from cascade import guard as guard_lib
from cascade import kinds
from cascade import ledger as ledger_lib
from cascade import policies as policies_lib
from cascade.kinds import loop
from models import transformer
from rl import sft as sft_lib

GUARDED = dict(name='sft_b', kind='sft', domains=['b'], datasets=['sft'], steps=6, batch_size=4,
               max_len=16, optimizer=dict(lr=1e-2))


def _stages(fakes):
  return [fakes.rl_stage('a_rl', ['a']), GUARDED]


@pytest.mark.parametrize('guard,validation,want', [
    (dict(domains=['zz']), True, "config.guard.domains: unknown domain 'zz' (known: a, b)"),
    (dict(domains=['a']), False, "config.guard.domains: domain 'a' has no validation set"),
    (dict(domains=['a'], max_drop=-1), True, 'config.guard.max_drop=-1: must be in [0, 100)'),
    (dict(domains=['a'], max_drop=100), True, 'config.guard.max_drop=100: must be in [0, 100)'),
    (dict(domains=['a'], stderrs=-2), True, 'config.guard.stderrs=-2: must be a finite number'),
    (dict(domains=['a'], prompts=0), True, 'config.guard.prompts=0: must be an int >= 1'),
    (dict(domains=['a'], action='pray'), True, "config.guard.action='pray': unknown action"),
    (dict(domains=[]), True, 'config.guard.domains=[]: must be a non-empty list'),
    (dict(domains=['a'], drop=3), True, 'config.guard.drop: unknown field'),
])
def test_a_bad_guard_is_one_config_error_line(fakes, guard, validation, want):
  with pytest.raises(config_lib.ConfigError) as e:
    fakes.toy_config(_stages(fakes), validation=validation, guard=guard)
  assert str(e.value).startswith(want) and '\n' not in str(e.value), str(e.value)


def test_guarded_domains_are_the_earlier_stages_own_and_an_absent_guard_hashes_as_before(fakes):
  plan = fakes.toy_config(_stages(fakes), validation=True, guard=dict(domains=['a', 'b']))
  assert plan.guard.action == 'warn' and plan.guard.max_drop == 3.0
  ledger = ledger_lib.Ledger(types.SimpleNamespace(rows=[], ledger=[]))
  ctx = types.SimpleNamespace(plan=plan, ledger=ledger)
  # 'b' is the guarded stage's own domain and 'a' is trained before it; nothing precedes a_rl.
  assert guard_lib.StageGuard(ctx, plan.stages[1]).protected == ('a',)
  assert not guard_lib.StageGuard(ctx, plan.stages[0]).active
  assert [s for s in range(7) if guard_lib.StageGuard(ctx, plan.stages[1]).due(s)] == [0, 6]
  plain = fakes.toy_config(_stages(fakes), validation=True)
  assert plain.guard is None and 'guard' not in plain.source
  assert checkpoint.config_hash(plain.source) == checkpoint.config_hash(
      {k: v for k, v in plan.source.items() if k != 'guard'})


def _digest(params):
  return float(sum(np.abs(np.asarray(x, np.float64)).sum() for x in jax.tree.leaves(params)))


def _run(fakes, tmp_path, monkeypatch, action, probe_by_step, every=2, keep=1):
  """Stage 'sft_b' (6 steps, after 'a_rl' trained 'a') through the real loop with a guard on
  'a' probing every `every` steps; the probe of step s scores `probe_by_step[s]` (stderr 1)."""
  plan = fakes.toy_config(_stages(fakes), every=100, validation=True,
                          guard=dict(domains=['a'], every=every, action=action, max_drop=3.0,
                                     stderrs=2.0, prompts=4))
  plan = dataclasses.replace(plan, ckpt=dataclasses.replace(plan.ckpt, keep=keep))
  stage = plan.stages[1]
  progress = checkpoint.Progress(str(tmp_path))
  led = ledger_lib.Ledger(progress)
  logged = {}
  writer = types.SimpleNamespace(write=lambda st, step, m: logged.__setitem__(step, dict(m)))
  pol = policies_lib.Policies(plan, str(tmp_path), None, plan.rules, pinned=led.pinned)
  pol.remember(('stage', 'a_rl'), nnx_params(plan))
  ctx = types.SimpleNamespace(plan=plan, workdir=str(tmp_path), mesh=None, rules=plan.rules,
                              writer=writer, data=types.SimpleNamespace(validation_sets={}),
                              progress=progress, ledger=led, policies=pol)
  probed = {}

  def fake_probe(ctx_, params, prompts, domains):
    assert ctx_ is ctx and prompts == 4 and tuple(domains) == ('a',)
    step = sorted(probe_by_step)[len(probed)]
    probed[step] = _digest(params)
    return {'a': {'score': probe_by_step[step], 'stderr': 1.0}}
  monkeypatch.setattr(evaluation, 'probe_results', fake_probe)
  seen = {}

  def maker_fn(state):
    del state
    loader = data_lib.Loader([{'id': k} for k in range(8)], 0, stage.batch_size)

    def make(step, rng, state):
      del rng
      seen[step] = _digest(state.params)
      ex = [([2 + (7 * r['id'] + j) % 250 for j in range(8)], [0, 0] + [1] * 6)
            for r in loader.next()]
      return [sft_lib.pack(ex, stage.max_len, num_rows=4)], {}
    return loop.BatchMaker(loader, make)

  try:
    res = loop.train_stage(ctx, kinds.get('sft'), stage, maker_fn)
    steps = pol.checkpoints(stage).steps()
  finally:
    pol.close()
  return types.SimpleNamespace(res=res, logged=logged, probed=probed, seen=seen, steps=steps,
                               ledger=led, progress=progress)


def nnx_params(plan):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.split(transformer.create(plan.model, 7))[1]


@pytest.mark.heavy                    # the real loop: one compiled SFT step, Orbax saves (~20 s)
def test_warn_probes_between_steps_into_the_ledger_and_says_what_fell(
    fakes, tmp_path, monkeypatch, capsys):
  # Probes at 0 (the start), 2, 4, 6; a falls 5 points at step 4: within 3 + 2 * sqrt(2) = 5.83
  # points of noise, so no breach; 20 points at step 6: past it.
  r = _run(fakes, tmp_path, monkeypatch, 'warn', {0: 60.0, 2: 61.0, 4: 56.0, 6: 41.0})
  assert sorted(r.probed) == [0, 2, 4, 6] and r.res.steps_run == 6
  # Each probe scored the live policy: step s's probe saw the params step s's batch trained on.
  assert r.probed[0] == r.seen[0] and r.probed[2] == r.seen[2] and r.probed[4] == r.seen[4]
  assert r.logged[2]['probe/a'] == 61.0 and r.logged[2]['guard/a'] == -1.0   # a rise
  assert r.logged[4]['guard/a'] == 5.0 and r.logged[4]['guard/breaches'] == 0.0
  assert r.logged[6]['guard/a'] == 20.0 and r.logged[6]['guard/breaches'] == 1.0
  assert 'probe/a' not in r.logged[3]
  err = capsys.readouterr().err
  assert ('[1] sft_b: guard: a fell 20.0 points at step 6/6 (41.0 vs its best probe 61.0 at '
          'sft_b step 2), past its bound of 5.8; warn') in err
  entries = r.ledger.entries(ledger_lib.PROBE)
  assert [(e['step'], e['within']) for e in entries] == [
      (0, True), (2, True), (4, True), (6, False)]
  info = r.res.info['guard']
  assert info['protected'] == ['a'] and info['probes'] == 4 and 'stopped' not in info
  assert [b['step'] for b in info['breaches']] == [6]
  assert info['breaches'][0]['domains']['a']['best_step'] == 2
  assert r.res.info['accounting']['probe_s'] > 0
  assert r.steps == [6]                         # warn checkpoints nothing more


@pytest.mark.heavy                    # the real loop: one compiled SFT step, Orbax saves (~20 s)
def test_stop_ends_the_stage_at_its_newest_probed_checkpoint_within_bounds(
    fakes, tmp_path, monkeypatch, capsys):
  r = _run(fakes, tmp_path, monkeypatch, 'stop', {0: 60.0, 2: 61.0, 4: 40.0, 6: 0.0})
  # Step 4's probe crossed the bound: the stage ends there, its policy step 2's.
  assert sorted(r.probed) == [0, 2, 4] and r.res.steps_run == 4 and r.res.final_step == 6
  assert _digest(r.res.params) == r.probed[2] != r.probed[4]
  assert r.res.info['guard']['stopped'] == {'at': 4, 'kept': 2}
  assert ('[1] sft_b: guard: stopping the stage at step 4/6; its policy is that of step 2'
          in capsys.readouterr().err)
  # Step 2 was checkpointed for being within bounds and kept (keep=1) as the stop's target; the
  # stage's last step holds that policy, and says why.
  assert r.steps == [2, 6]
  plan = fakes.toy_config(_stages(fakes), every=100, validation=True,
                          guard=dict(domains=['a'], every=2, action='stop'))
  plan = dataclasses.replace(plan, ckpt=dataclasses.replace(plan.ckpt, keep=1))
  pol = policies_lib.Policies(plan, str(tmp_path), None, plan.rules)
  try:
    _, state, meta = pol.checkpoints(plan.stages[1]).restore(
        pol.abstract_state('policy', kinds.base.make_optimizer(plan.stages[1]).tx), step=6)
  finally:
    pol.close()
  assert _digest(state.params) == r.probed[2] and meta['guard_stop'] == {'at': 4, 'kept': 2}
