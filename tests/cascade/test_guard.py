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
from cascade import evaluation
from cascade import forecast as forecast_lib
from cascade import guard as guard_lib
from cascade import kinds
from cascade import ledger as ledger_lib
from cascade import policies as policies_lib
from cascade.data import readers
from cascade.kinds import base
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


def _run(fakes, tmp_path, monkeypatch, action, probe_by_step, every=2, keep=1, repairing=False,
         ckpt_every=100, ctx_fields=None, **guard):
  """Stage 'sft_b' (6 steps, after 'a_rl' trained 'a') through the real loop with a guard on
  'a' probing every `every` steps; the probe of step s scores `probe_by_step[s]` (stderr 1; a
  dict: the probe's whole result, e.g. with 'prompt_scores').
  `repairing`: the loop sees the stage as a repair stage (of 'a'), as an inserted MOPD one.
  `ctx_fields`: more of the run context (a sampler, verifiers... for config.guard.signals)."""
  if repairing:
    init = guard_lib.StageGuard.__init__

    def as_repair(self, ctx, stage):
      init(self, ctx, stage)
      self.repairing = True
    monkeypatch.setattr(guard_lib.StageGuard, '__init__', as_repair)
  plan = fakes.toy_config(_stages(fakes), every=ckpt_every, validation=True,
                          guard=dict(domains=['a'], every=every, action=action, max_drop=3.0,
                                     stderrs=2.0, prompts=4, **guard))
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
  for k, v in (ctx_fields or {}).items():
    setattr(ctx, k, v)
  probed = {}

  def fake_probe(ctx_, params, prompts, domains):
    assert ctx_ is ctx and prompts == 4 and tuple(domains) == ('a',)
    step = sorted(probe_by_step)[len(probed)]
    probed[step] = _digest(params)
    got = probe_by_step[step]
    return {'a': dict(got) if isinstance(got, dict) else {'score': got, 'stderr': 1.0}}
  monkeypatch.setattr(evaluation, 'probe_results', fake_probe)
  seen = {}

  def maker_fn(state):
    del state
    loader = readers.Loader([{'id': k} for k in range(8)], 0, stage.batch_size)

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
  except _Killed:
    res, steps = None, pol.checkpoints(stage).steps()
  finally:
    pol.close()
  return types.SimpleNamespace(res=res, logged=logged, probed=probed, seen=seen, steps=steps,
                               ledger=led, progress=progress)


class _Killed(Exception):
  pass


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


@pytest.mark.heavy                    # the real loop: one compiled SFT step, Orbax saves (~20 s)
def test_stop_acts_on_a_forecast_past_its_bound_before_the_fall(
    fakes, tmp_path, monkeypatch, capsys):
  # Step 2's probe (57) is within its observed bound, but the line through 60 and 57 ends at
  # 51 ± 3.6 by step 6: past the bound with confidence 0.945 >= 0.9 (test_guard_forecast.py).
  r = _run(fakes, tmp_path, monkeypatch, 'stop', {0: 60.0, 2: 57.0, 4: 40.0, 6: 0.0},
           forecast_confidence=0.9)
  assert sorted(r.probed) == [0, 2] and r.res.steps_run == 2 and r.res.final_step == 6
  assert _digest(r.res.params) == r.probed[2]          # the policy of the probe that foresaw it
  info = r.res.info['guard']
  assert info['stopped'] == {'at': 2, 'kept': 2} and info['breaches'] == []
  assert [c['step'] for c in info['forecast_crossings']] == [2]
  assert info['forecast']['a']['change'] == -9.0 and info['forecast']['a']['outcome'] is None
  assert r.logged[2]['forecast/a'] == -9.0
  err = capsys.readouterr().err
  assert '[1] sft_b: guard: a is forecast at 51.0 ± 3.6 by step 6' in err
  assert '[1] sft_b: guard: stopping the stage at step 2/6; its policy is that of step 2' in err
  assert r.steps == [2, 6]


@pytest.mark.heavy                    # the real loop, plus the signals' forward and gradient (~40 s)
def test_the_forecast_signals_are_measured_through_the_loop(fakes, tmp_path, monkeypatch):
  # config.guard.signals (cascade/signals.py) on the live policy of every forecasting probe:
  # the SFT stage moves it away from a_rl's (KL > 0), and each forecast carries both signals.
  recs = [fakes.record('a', i, 10 + i) for i in range(4)]
  extra = dict(sampler=fakes.OwnAnswerSampler(right=lambda n, g: g == 0),
               tokenizer=fakes.CharTokenizer(),
               data=types.SimpleNamespace(validation_sets={'a': recs}),
               verifiers=types.SimpleNamespace(can_evaluate=lambda d: True,
                                               eval_verifier=fakes.ValueVerifier),
               sample_cls=fakes.Sample)
  r = _run(fakes, tmp_path, monkeypatch, 'warn', {0: 60.0, 2: 59.0, 4: 58.0, 6: 50.0},
           ctx_fields=extra, signals=['kl', 'grad_cos'], signal_samples=2)
  assert r.res.steps_run == 6 and 'forecast/a/kl' not in r.logged[1]
  kls = [r.logged[s]['forecast/a/kl'] for s in (2, 4, 6)]
  assert all(k > 0 for k in kls), kls
  assert all(-1.0 <= r.logged[s]['forecast/a/grad_cos'] <= 1.0 for s in (2, 4, 6))
  first = r.res.info['guard']['forecast']['a']
  assert first['kl'] == kls[0] and first['outcome'] == -10.0
  assert first['falls'] is forecast_lib.predicts_fall(first['change'], first['change_stderr'],
                                                       first['kl'], 0.0, first['grad_cos'])
  # pi_0 sampled 2 responses to each of the 4 probe prompts once, at temperature 1.
  (call,) = extra['sampler'].calls
  assert call['num_samples'] == 2 and len(call['prompts']) == 4 and not call['sp'].greedy


# ------------------------------------------------------------------ repair

REPAIR = dict(steps=3, optimizer=dict(lr=1e-4), prompts_per_step=4, group_size=2,
              max_prompt_len=100, max_response_len=8)


@pytest.mark.parametrize('guard,want', [
    (dict(domains=['a'], action='repair'), "config.guard.repair: action='repair' needs"),
    (dict(domains=['a'], repair=REPAIR), "config.guard.repair: is the MOPD stage"),
    (dict(domains=['a'], action='repair', repair=dict(REPAIR, teachers='best')),
     'config.guard.repair.teachers: is set by the guard'),
    (dict(domains=['a'], action='repair', repair=dict(REPAIR, group_size=0)),
     "stages[2] 'sft_b_repair': group_size=0: must be an int >= 1"),
])
def test_a_bad_repair_is_one_config_error_line(fakes, guard, want):
  with pytest.raises(config_lib.ConfigError) as e:
    fakes.toy_config(_stages(fakes), validation=True, guard=guard)
  assert str(e.value).startswith(want) and '\n' not in str(e.value), str(e.value)


def _repair_plan(fakes):
  return fakes.toy_config(_stages(fakes) + [fakes.rl_stage('a_rl2', ['a'])], validation=True,
                          guard=dict(domains=['a', 'b'], action='repair', repair=REPAIR))


def test_repair_inserts_a_mopd_stage_after_every_guarded_stage(fakes):
  plan = _repair_plan(fakes)
  # a_rl guards nothing (nothing trained before it); sft_b guards a; a_rl2 guards b.
  assert [(s.index, s.name, s.kind) for s in plan.stages] == [
      (0, 'a_rl', 'grpo'), (1, 'sft_b', 'sft'), (2, 'sft_b_repair', 'mopd'),
      (3, 'a_rl2', 'grpo'), (4, 'a_rl2_repair', 'mopd')]
  rep = plan.stages[2]
  assert (rep.repairs, rep.domains, rep.teachers, rep.steps) == ('sft_b', ('a', 'b'), 'best', 3)
  assert plan.stages[4].domains == ('b', 'a') and plan.stages[4].repairs == 'a_rl2'
  # The config's own list is what the hash covers.
  assert [s['name'] for s in plan.source['stages']] == ['a_rl', 'sft_b', 'a_rl2']



def test_inserted_stages_move_no_other_stages_randomness(fakes):
  """The config's own stages draw their data order, keys and modes from their place among the
  config's own stages, so a guarded run whose repairs all skip trains what an unguarded one
  does; each inserted stage has a seed of its own."""
  plan = _repair_plan(fakes)
  bare = fakes.toy_config(_stages(fakes) + [fakes.rl_stage('a_rl2', ['a'])], validation=True)
  assert [s.seeds_from for s in bare.stages] == [(0,), (1,), (2,)]
  own = [s for s in plan.stages if not getattr(s, 'repairs', '')]
  assert [s.seeds_from for s in own] == [s.seeds_from for s in bare.stages]
  assert plan.stages[3].index == 3 and plan.stages[3].seeds_from == (2,)
  assert plan.stages[2].seeds_from == (1, base.INSERTED)
  seeds = [base.stage_seed(7, s.seeds_from) for s in plan.stages]
  assert len(set(seeds)) == len(seeds)
  # Own stages' seeds are what they were before stages could be inserted: a bare index.
  assert [base.stage_seed(7, s.seeds_from) for s in own] == [base.stage_seed(7, i)
                                                            for i in range(3)]

def _probe(ledger, stage, step, breached=None):
  ledger.record(stage, step, {'a': {'score': 50.0, 'stderr': 1.0}}, kind=ledger_lib.PROBE,
                within=not breached, ckpt=False,
                **({'breached': breached} if breached else {}))


def _repair_ctx(fakes, tmp_path):
  """A repair plan's context whose ledger says sft_b's last probe left 'a' past its bound,
  and a_rl's step 2 is a's best validation checkpoint."""
  from cascade.kinds import mopd  # pylint: disable=g-import-not-at-top
  plan = _repair_plan(fakes)
  progress = checkpoint.Progress(str(tmp_path))
  led = ledger_lib.Ledger(progress)
  recs = [fakes.record(d, i, 10 + i) for d in 'ab' for i in range(4)]
  ctx = types.SimpleNamespace(plan=plan, progress=progress, ledger=led,
                              policies=policies_lib.Policies(plan, str(tmp_path), None,
                                                             plan.rules),
                              data=types.SimpleNamespace(stage_records=lambda st: list(recs)))
  rep = plan.stages[2]
  fell = {'a': {'drop': 9.0, 'bound': 5.8, 'score': 41.0, 'best': 50.0, 'best_stage': 'sft_b',
                'best_step': 0}}
  # Past the bound mid-stage but back within it at the stage's end: nothing to repair.
  _probe(led, plan.stages[1], 2, fell)
  _probe(led, plan.stages[1], 6)
  assert mopd.run(ctx, rep).info == {'skipped': 'nothing to repair after sft_b'}
  assert guard_lib.fallen(led, 'sft_b') == {}
  # Past it at the end: the repair trains a (taught by its best validation checkpoint, a_rl's
  # step 2) and b (sft_b's own, taught by sft_b's final policy), on those domains' prompts.
  _probe(led, plan.stages[1], 6, fell)
  progress.add_row({'stage': 'a_rl', 'index': 0, 'domains': ['a'], 'scores': {},
                    'validation': {'a': 30.0, 'b': 1.0}})
  led.record(plan.stages[0], 2, {'a': {'score': 40.0, 'stderr': 2.0}})
  picked = {}
  chosen = mopd.choose_teachers(ctx, rep, picked, ('a', 'b'))
  assert {d: src for d, (src, _) in chosen.items()} == {'a': ('ckpt', 'a_rl', 2),
                                                        'b': ('stage', 'sft_b')}
  assert picked['b'] == {'stage': 'sft_b', 'step': 6, 'final': True}
  return ctx, plan, rep


def test_a_repair_runs_only_where_its_stage_ended_past_a_bound_with_the_ledgers_teachers(
    fakes, tmp_path):
  ctx, plan, _ = _repair_ctx(fakes, tmp_path)
  # A repair of a stage whose guard saw nothing: skipped, and the next stage starts from the
  # repaired stage's policy.
  done = {'sft_b_repair': {'skipped': 'nothing'}}
  pol = policies_lib.Policies(plan, str(tmp_path), None, plan.rules,
                              skipped=lambda name: 'skipped' in done.get(name, {}))
  assert pol.source_before(3) == ('stage', 'sft_b')
  assert ctx.policies.source_before(3) == ('stage', 'sft_b_repair')


@pytest.mark.heavy                    # builds the teachers' copies of a tiny model (~20 s loaded)
def test_a_repair_trains_on_the_fallen_and_its_stages_own_domains_and_is_marked_inserted(
    fakes, tmp_path, monkeypatch):
  from cascade.kinds import mopd  # pylint: disable=g-import-not-at-top
  ctx, plan, rep = _repair_ctx(fakes, tmp_path)
  got = []
  monkeypatch.setattr(loop, 'train_stage', lambda ctx_, kind, st, maker_fn: got.append(st)
                      or kinds.base.StageResult(final_step=st.steps))
  monkeypatch.setattr(ctx.policies, 'params_of', lambda src, keep=True: nnx_params(plan))
  ctx.domain_index = {'a': 0, 'b': 1}
  ctx.mesh, ctx.rules = None, plan.rules
  res = mopd.run(ctx, rep)
  assert got == [rep]
  assert res.info['inserted'] == {'repairs': 'sft_b', 'drops': {'a': 9.0}}
  assert res.info['teacher_checkpoints']['a']['step'] == 2


@pytest.mark.heavy                    # the real loop: one compiled SFT step, Orbax saves (~20 s)
def test_a_repair_stage_ends_once_every_repaired_domain_is_back_within_bounds(
    fakes, tmp_path, monkeypatch, capsys):
  # a's best probe is 60; it starts repaired at 40 (past the bound), is at 50 after step 2
  # (still past 3 + 2.83) and back at 58 after step 4: the stage ends there, keeping step 4.
  r = _run(fakes, tmp_path, monkeypatch, 'warn', {0: 60.0, 2: 50.0, 4: 58.0, 6: 0.0},
           repairing=True)
  assert sorted(r.probed) == [0, 2, 4] and r.res.steps_run == 4 and r.res.final_step == 6
  assert _digest(r.res.params) == r.probed[4]
  assert r.res.info['guard']['stopped'] == {'repaired_at': 4}
  assert r.res.info['guard']['action'] == 'repairing'
  assert ('[1] sft_b: guard: every repaired domain is back within its bound at step 4/6'
          in capsys.readouterr().err)
  assert r.steps == [6]


@pytest.mark.heavy                    # the real loop twice: compiled SFT steps, Orbax saves (~40 s)
def test_a_run_killed_after_a_probe_crossed_resumes_into_the_stop(fakes, tmp_path, monkeypatch):
  """Killed right after step 4's checkpoint (a periodic one) and its probe past the bound,
  before the stop: the rerun resumes at step 4, probes nothing again, and stops as the
  uninterrupted run would, at step 2's policy."""
  probes = {0: 60.0, 2: 61.0, 4: 40.0}

  def kill(stage, step, saved, ckpts):
    if step == 4:
      raise _Killed()
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [kill])
  first = _run(fakes, tmp_path, monkeypatch, 'stop', probes, ckpt_every=2, keep=2)
  assert first.res is None and first.steps == [2, 4] and sorted(first.probed) == [0, 2, 4]
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [])
  again = _run(fakes, tmp_path, monkeypatch, 'stop', {}, ckpt_every=2, keep=2)
  assert again.probed == {} and again.res.steps_run == 0
  assert _digest(again.res.params) == first.probed[2]
  assert again.res.info['guard']['stopped'] == {'at': 4, 'kept': 2}
  assert [b['step'] for b in again.res.info['guard']['breaches']] == [4]


@pytest.mark.heavy                    # the real loop twice: compiled SFT steps, Orbax saves (~40 s)
def test_a_resumed_stage_pairs_its_probes_with_those_before_the_kill(fakes, tmp_path,
                                                                     monkeypatch):
  """Killed after step 2's probe; the rerun's probe of step 4 is compared prompt by prompt
  with the probes before the kill (their per-prompt scores read back from progress.json): 6 of
  16 prompts fall 50 points, 18.75 points, past 3 + 2 x 6.25 (the paired error) though inside
  3 + 2 x sqrt(10^2 + 10^2) (the independent one), so the stage stops at step 2's policy."""
  base = [100.0, 50.0, 0.0, 100.0] * 4
  fell = [x - 50.0 if i in (0, 1, 3, 4, 5, 7) else x for i, x in enumerate(base)]
  probe = lambda xs: {'score': float(np.mean(xs)), 'stderr': 10.0,
                      'prompt_scores': {f'v{i}': x for i, x in enumerate(xs)}}

  def kill(stage, step, saved, ckpts):
    if step == 2:
      raise _Killed()
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [kill])
  first = _run(fakes, tmp_path, monkeypatch, 'stop', {0: probe(base), 2: probe(base)},
               ckpt_every=2, keep=2)
  assert first.res is None and sorted(first.probed) == [0, 2]
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [])
  again = _run(fakes, tmp_path, monkeypatch, 'stop', {4: probe(fell)}, ckpt_every=2, keep=2)
  assert sorted(again.probed) == [4] and _digest(again.res.params) == first.probed[2]
  info = again.res.info['guard']
  assert info['stopped'] == {'at': 4, 'kept': 2}
  b = info['breaches'][0]['domains']['a']
  assert b['paired'] and b['pairs'] == 16 and b['drop'] == 18.75 and b['se'] == 6.25
  assert b['bound'] == 15.5 and b['best_step'] == 0


def test_a_repair_draws_only_the_domains_it_repairs(fakes):
  from cascade.kinds import mopd  # pylint: disable=g-import-not-at-top
  recs = [fakes.record(d, i, 10 + i) for d in 'ab' for i in range(4)]
  stream = readers.Stream(recs, keep=lambda i, r: None if i == 0 else r, why='first dropped')
  only = mopd._only_domains(stream, ('b',))  # pylint: disable=protected-access
  kept = [only.keep(i, r) for i, r in enumerate(recs)]
  assert [r['id'] for r in kept if r is not None] == ['b0', 'b1', 'b2', 'b3']
  assert only.why.startswith('first dropped; records of domains other than b')
  assert [r['id'] for r in mopd._only_domains(recs, ('a',))] == ['a0', 'a1', 'a2', 'a3']  # pylint: disable=protected-access


def test_an_inserted_rows_matrix_marks_it_with_the_drops_that_made_it_run():
  rows = [{'stage': 'sft', 'index': 0, 'domains': ['a', 'b'], 'scores': {'a': 50.0, 'b': 50.0}},
          {'stage': 'b_rl', 'index': 1, 'domains': ['b'], 'scores': {'a': 30.0, 'b': 70.0}},
          {'stage': 'b_rl_repair', 'index': 2, 'domains': ['a', 'b'],
           'scores': {'a': 49.0, 'b': 69.0},
           'inserted': {'repairs': 'b_rl', 'drops': {'a': 20.0}}}]
  res = evaluation.results(rows, ['a', 'b'])
  assert res['inserted'] == [None, None, {'repairs': 'b_rl', 'drops': {'a': 20.0}}]
  lines = evaluation.markdown(res).splitlines()
  assert lines[4].startswith('| b_rl_repair (inserted) | a, b | 49.0 (+19.0) |')
  assert 'inserted' not in evaluation.results(rows[:2], ['a', 'b'])


@pytest.mark.heavy                    # the real loop twice: compiled SFT steps, Orbax saves (~40 s)
def test_a_repair_killed_after_its_domains_came_back_resumes_into_its_end(
    fakes, tmp_path, monkeypatch):
  def kill(stage, step, saved, ckpts):
    if step == 2:
      raise _Killed()
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [kill])
  first = _run(fakes, tmp_path, monkeypatch, 'warn', {0: 60.0, 2: 59.0}, ckpt_every=2,
               keep=2, repairing=True)
  assert first.res is None and first.steps == [2]
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [])
  again = _run(fakes, tmp_path, monkeypatch, 'warn', {}, ckpt_every=2, keep=2, repairing=True)
  assert again.probed == {} and again.res.steps_run == 0
  assert _digest(again.res.params) == first.probed[2]
  assert again.res.info['guard']['stopped'] == {'repaired_at': 2}
  assert again.steps == [2, 6]
