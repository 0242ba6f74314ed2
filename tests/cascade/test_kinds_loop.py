"""The shared training loop (`cascade.kinds.loop.train_stage`): a stopped stage resumes exactly.

A stub batch maker drives the real loop (real Policies, Orbax checkpoints, SFT train step on
a tiny model): each step's batch is built from the records the stage's loader hands out, and
the maker logs (step, rng, record ids). A run stopped after a checkpoint and resumed by a
fresh loop must log the same steps with the same data and keys, and end with bit-identical
params, as a run that was never stopped. The kill hook of tests/faults.py (installed in the
loop's `STEP_END_HOOKS`) fires right after the named step's checkpoint is on disk.
"""

import itertools
import os
import types

import jax
import numpy as np
import pytest

from cascade import checkpoint
from cascade import kinds
from cascade import policies as policies_lib
from cascade import verifier_errors
from cascade.data import readers
from cascade.kinds import base
from cascade.kinds import loop
from foundation import step_clock
from rl import sft as sft_lib
from rl import train_step as train_lib

_BUILD = loop.build_train_step        # the real one (the fixture below caches it)


class _Stop(Exception):
  pass


def _ctx(plan, workdir, clock=None):
  writer = types.SimpleNamespace(write=lambda stage, step, m: None)
  return types.SimpleNamespace(plan=plan, workdir=str(workdir), mesh=None, rules=plan.rules,
                               writer=writer, clock=clock,
                               policies=policies_lib.Policies(plan, str(workdir), None, plan.rules))


RECORDS = [{'id': k} for k in range(10)]


def _run(plan, workdir, log, stop_at=None, bug_at=None, clock=None):
  """Runs the plan's SFT stage with a stub maker; `stop_at`: raise before building that step;
  `bug_at`: a verifier's own bug stops that step once its records are drawn; `clock`: the
  context's step clock."""
  ctx = _ctx(plan, workdir, clock)
  stage = plan.stages[0]

  def maker_fn(state):
    del state
    loader = readers.Loader(RECORDS, base.stage_seed(plan.seed, stage.index), stage.batch_size)

    def make(step, rng, state):
      if step == stop_at:
        raise _Stop(step)
      ids = [r['id'] for r in loader.next()]
      if step == bug_at:
        raise verifier_errors.VerifierBug(f'step {step + 1}: a verifier raised in its own code')
      log.append((step, tuple(np.asarray(jax.random.key_data(rng)).ravel().tolist()), ids,
                  int(state.step)))
      ex = [([2 + (7 * k + j) % 250 for j in range(8)], [0, 0] + [1] * 6) for k in ids]
      return [sft_lib.pack(ex, stage.max_len, num_rows=4)], {'examples': len(ex)}
    return loop.BatchMaker(loader, make)

  try:
    return loop.train_stage(ctx, kinds.get('sft'), stage, maker_fn)
  finally:
    ctx.policies.close()


def _plan(fakes):
  return fakes.toy_config([fakes.SFT_STAGE], every=2)


@pytest.fixture(scope='module', autouse=True)
def _one_compiled_step():
  """Every run here builds the same train step: compile it once (the loop still asks for it)."""
  built = {}
  build = loop.build_train_step

  def cached(kind, stage, *args, **kw):
    if stage.name not in built:
      built[stage.name] = build(kind, stage, *args, **kw)
    return built[stage.name]

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(loop, 'build_train_step', cached)
    yield


def test_a_stage_builds_its_optimizer_once(tmp_path, fakes, monkeypatch):
  """The loop builds the stage's optimizer once: its train state and its train step share it
  (stopped before the first batch: nothing is compiled)."""
  built = []
  make = train_lib.make_optimizer
  monkeypatch.setattr(train_lib, 'make_optimizer', lambda cfg: built.append(cfg) or make(cfg))
  monkeypatch.setattr(loop, 'build_train_step', _BUILD)
  with pytest.raises(_Stop):
    _run(_plan(fakes), tmp_path, [], stop_at=0)
  assert len(built) == 1


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, fakes):
  plan = _plan(fakes)
  log = []
  res = _run(plan, tmp_path_factory.mktemp('a'), log)
  return plan, log, res


def _same_params(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_uninterrupted_stage_draws_fresh_batches_with_per_step_keys(uninterrupted):
  plan, log, res = uninterrupted
  stage = plan.stages[0]
  assert [s for s, *_ in log] == list(range(stage.steps)) and res.steps_run == stage.steps
  assert [opt_step for *_, opt_step in log] == list(range(stage.steps))
  # The loader walks a seeded permutation of the records, epoch after epoch.
  want = readers.Loader(RECORDS, base.stage_seed(plan.seed, stage.index), stage.batch_size)
  assert [ids for _, _, ids, _ in log] == [[r['id'] for r in want.next()]
                                          for _ in range(stage.steps)]
  # Step s's key is fold_in(PRNGKey(stage seed), s).
  key = jax.random.PRNGKey(base.stage_seed(plan.seed, stage.index))
  for s, k, _, _ in log:
    assert k == tuple(np.asarray(jax.random.fold_in(key, s)).ravel().tolist()), s


@pytest.mark.parametrize('stop_at', [3])
def test_a_stage_stopped_mid_way_resumes_with_its_data_position_and_rng(
    uninterrupted, tmp_path, capsys, monkeypatch, stop_at):
  plan, log_a, res_a = uninterrupted
  log_b = []
  with pytest.raises(_Stop):
    _run(plan, tmp_path, log_b, stop_at=stop_at)
  assert log_b == log_a[:stop_at]
  resumed = []
  # A clock that advances one second per reading: a step spans at least three (its own start,
  # the update's start and end), whatever the machine's speed.
  ticks = itertools.count(1_000_000)
  monkeypatch.setattr(loop.time, 'perf_counter', lambda: float(next(ticks)))
  res_b = _run(plan, tmp_path, resumed)
  monkeypatch.undo()
  start = stop_at - stop_at % 2          # the newest checkpoint (every 2 steps)
  assert f'[0] sft: resuming at step {start}/6' in capsys.readouterr().out
  assert res_b.steps_run == 6 - start
  # The accounting covers the resumed part: its steps and their seconds.
  acc = res_b.info['accounting']
  assert acc['steps'] == 6 - start
  assert acc['step_s'] >= 2 * acc['steps'] and acc['update_s'] >= acc['steps']
  assert acc['step_s'] > acc['update_s']
  # The same steps, record ids, keys and optimizer steps as the run never stopped.
  assert resumed == log_a[start:]
  _same_params(res_b.params, res_a.params)


def test_kill_point_fires_after_that_steps_checkpoint_and_the_run_resumes(
    uninterrupted, tmp_path, capsys, monkeypatch, faults):
  plan, log_a, res_a = uninterrupted
  killed = []

  def kill(pid, sig):
    ckpt_dir = os.path.join(checkpoint.stage_dir(str(tmp_path), plan.stages[0]), 'ckpt')
    on_disk = checkpoint.StageCheckpoints(ckpt_dir, async_save=False)
    killed.append((pid, sig, on_disk.steps()))
    on_disk.close()
    raise _Stop('killed')

  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [faults.kill_at('sft:4')])
  monkeypatch.setattr(faults.os, 'kill', kill)
  log_b = []
  with pytest.raises(_Stop):
    _run(plan, tmp_path, log_b)
  import signal  # pylint: disable=g-import-not-at-top
  assert killed == [(os.getpid(), signal.SIGKILL, [2, 4])]   # step 4 is complete on disk
  assert [s for s, *_ in log_b] == [0, 1, 2, 3]
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [])
  resumed = []
  res_b = _run(plan, tmp_path, resumed)
  assert '[0] sft: resuming at step 4/6' in capsys.readouterr().out
  assert resumed == log_a[4:]
  _same_params(res_b.params, res_a.params)


def test_a_verifiers_own_bug_stops_the_stage_with_every_step_before_it_checkpointed(
    uninterrupted, tmp_path, capsys):
  """Stopped at step 3 (checkpoints every 2), the stage keeps steps 0-2 in a checkpoint at step 3
  whose data position is that step's start: the rerun redoes step 3 alone, as it was."""
  plan, log_a, res_a = uninterrupted
  log_b = []
  with pytest.raises(verifier_errors.VerifierBug, match='step 4: a verifier raised'):
    _run(plan, tmp_path, log_b, bug_at=3)
  assert log_b == log_a[:3]
  resumed = []
  res_b = _run(plan, tmp_path, resumed)
  assert '[0] sft: resuming at step 3/6' in capsys.readouterr().out
  assert resumed == log_a[3:]
  _same_params(res_b.params, res_a.params)


def test_accounting_sums_splits_and_rounds_a_stages_step_metrics():
  totals = {'step_s': 10.0, 'sample_s': 4.12345, 'score_s': 2.5, 'update_s': 1.25,
            'validation_s': 0.5, 'decode_slots': 300.0, 'generated_tokens': 200.0}
  acc = loop.accounting(totals, steps=4)
  assert acc == {'steps': 4, 'step_s': 10.0, 'sample_s': 4.123, 'score_s': 2.5,
                 'update_s': 1.25, 'validation_s': 0.5, 'decode_slots': 300.0,
                 'generated_tokens': 200.0, 'other_s': 1.627, 'verifier_share': 0.25,
                 'decode_waste': 0.3333}
  # Parts that add up to more than the step (clock skew) leave no negative remainder.
  assert loop.accounting({'step_s': 1.0, 'sample_s': 2.0}, steps=1)['other_s'] == 0.0
  assert loop.accounting(totals, steps=0) == {}


def test_a_context_clock_splits_every_step_into_program_and_host_parts(tmp_path, fakes,
                                                                       monkeypatch):
  """With a step clock on its context the loop times each step by part: the update as a
  program, the batch, the divergence and preemption checks, the log and the checkpoints due as
  host parts; a step-end hook's time is no part of the step."""
  plan = _plan(fakes)
  stage = plan.stages[0]
  # A clock that advances one second per reading; each step-end hook adds 1000 s.
  now = [0.0]

  def tick():
    now[0] += 1.0
    return now[0]

  monkeypatch.setattr(step_clock.time, 'perf_counter', tick)
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [lambda *a: now.__setitem__(0, now[0] + 1000)])
  clock = step_clock.StepClock()
  _run(plan, tmp_path, [], clock=clock)
  monkeypatch.undo()
  assert clock.steps == stage.steps
  assert clock.program_parts == {'update'}
  for i, step in enumerate(clock.history, 1):
    assert {'step rng', 'batch', 'update', 'update batch', 'divergence check', 'metrics log',
            'preemption check', 'other'} <= set(step), step
    assert ('checkpoint' in step) == (i % 2 == 0), (i, step)     # every 2 steps and the end
    assert step['program_s'] == step['update'] >= 1
    parts = sum(v for k, v in step.items() if k not in ('step_s', 'program_s', 'host_s'))
    assert parts == pytest.approx(step['step_s'])
    assert step['host_s'] == step['step_s'] - step['program_s']
    assert step['step_s'] < 1000, step                               # the hook is outside
