"""The per-domain validation ledger (`cascade.ledger`): stage ends and intermediate steps, each
domain's best checkpoint kept by the rotation, persisted in progress.json, and MOPD's
`teachers='best'` choosing a domain's best *checkpoint* (an intermediate step where that is the
best)."""

import dataclasses
import json
import types

import jax
import numpy as np
import pytest

from cascade import checkpoint
from cascade import evaluation
from cascade import kinds
from cascade import ledger as ledger_lib
from cascade import policies as policies_lib
from cascade.data import readers
from cascade.kinds import loop
from cascade.kinds import mopd
from rl import sft as sft_lib


def _stage(name, index):
  return types.SimpleNamespace(name=name, index=index)


def _res(**scores):
  return {d: {'score': v, 'stderr': 1.0} for d, v in scores.items()}


def test_best_entries_ties_pins_and_discards(tmp_path):
  progress = checkpoint.Progress(str(tmp_path))
  led = ledger_lib.Ledger(progress)
  progress.add_row({'stage': 'init', 'index': -1, 'domains': [], 'scores': {},
                    'validation': {'a': 10.0, 'b': 5.0}})
  led.record(_stage('rl', 0), 2, _res(a=30.0, b=5.0))
  led.record(_stage('rl', 0), 4, _res(a=30.0, b=1.0))              # a ties step 2: earliest wins
  led.record(_stage('rl', 0), 6, _res(a=90.0), ckpt=False)         # no checkpoint: no candidate
  led.record(_stage('rl', 0), 3, _res(a=99.0), kind=ledger_lib.PROBE, within=True)
  # While the stage runs, the rotation keeps a's best (step 2; the probe's 99 is another set)
  # and the newest in-bounds probe step (3: where a guard's stop goes back to).
  assert led.pinned('rl') == {2, 3}
  progress.mark_done('rl', {'final_step': 8})
  progress.add_row({'stage': 'rl', 'index': 0, 'domains': ['a'], 'scores': {},
                    'validation': {'a': 20.0, 'b': 7.0}, 'validation_stderr': {'b': 0.5}})
  assert led.best('a')['step'] == 2 and led.best('a')['stage'] == 'rl'
  assert led.best('b') == dict(led.best('b'), stage='rl', step=8, final=True)
  assert led.best('a', before=0)['stage'] == 'init'          # only stages before index 0
  # Once it is done, only a's best (b's best is the stage's end, never rotated away).
  assert led.pinned('rl') == {2}
  assert led.summary(['a', 'b']) == {
      'a': {'stage': 'rl', 'step': 2, 'validation': 30.0, 'stderr': 1.0, 'final': False},
      'b': {'stage': 'rl', 'step': 8, 'validation': 7.0, 'stderr': 0.5, 'final': True}}
  # A new best beats every checkpointed entry; a tie is not new.
  assert led.new_best(_stage('rl', 0), _res(a=30.0, b=7.5)) == ['b']
  # Persisted: a fresh read of progress.json has the same ledger; a resume forgets past step.
  again = ledger_lib.Ledger(checkpoint.Progress(str(tmp_path)))
  assert again.entries() == led.entries()
  again.discard_after('rl', 2)
  assert [e['step'] for e in again.entries() if not e.get('final')] == [2]
  assert [e['step'] for e in ledger_lib.Ledger(checkpoint.Progress(str(tmp_path))).entries()
          if not e.get('final')] == [2]


def test_stderr_is_that_of_the_per_prompt_means():
  # 2 prompts x 2 samples: per-prompt means 1.0 and 0.0 -> std 0.707, / sqrt(2) = 0.5.
  assert evaluation.stderr(np.array([1.0, 1.0, 0.0, -1.0]), 2) == pytest.approx(50.0)
  assert evaluation.stderr(np.array([1.0, 0.0]), 1) == 0.0


MOPD = dict(name='mopd', kind='mopd', domains=['a', 'b'], teachers='best', steps=2,
            optimizer=dict(lr=1e-4), prompts_per_step=4, group_size=2, max_prompt_len=100,
            max_response_len=8)


def _run_sft(fakes, tmp_path, monkeypatch, val_by_step):
  """The toy SFT stage (6 steps) through the real loop with validation every 2 steps scoring
  `val_by_step[step]`, a real progress.json and ledger, keep=1 and no periodic checkpoint."""
  plan = fakes.toy_config([fakes.SFT_STAGE, MOPD], every=100, validation=True)
  plan = dataclasses.replace(plan, eval=dataclasses.replace(plan.eval, eval_every=2),
                             ckpt=dataclasses.replace(plan.ckpt, keep=1))
  stage = plan.stages[0]
  progress = checkpoint.Progress(str(tmp_path))
  led = ledger_lib.Ledger(progress)
  writer = types.SimpleNamespace(write=lambda st, step, m: None)
  ctx = types.SimpleNamespace(
      plan=plan, workdir=str(tmp_path), mesh=None, rules=plan.rules, writer=writer,
      data=types.SimpleNamespace(validation_sets={'a': [1], 'b': [1]}), progress=progress,
      ledger=led, policies=policies_lib.Policies(plan, str(tmp_path), None, plan.rules,
                                                 pinned=led.pinned))
  digests = {}
  digest = lambda params: float(sum(np.abs(np.asarray(x, np.float64)).sum()
                                    for x in jax.tree.leaves(params)))

  def fake_validation(ctx_, params):
    step = len(digests) * 2 + 2
    digests[step] = digest(params)
    return _res(**val_by_step[step])
  monkeypatch.setattr(evaluation, 'validation_results', fake_validation)

  def maker_fn(state):
    del state
    loader = readers.Loader([{'id': k} for k in range(8)], 0, stage.batch_size)

    def make(step, rng, state):
      del step, rng, state
      ex = [([2 + (7 * r['id'] + j) % 250 for j in range(8)], [0, 0] + [1] * 6)
            for r in loader.next()]
      return [sft_lib.pack(ex, stage.max_len, num_rows=4)], {}
    return loop.BatchMaker(loader, make)

  res = loop.train_stage(ctx, kinds.get('sft'), stage, maker_fn)
  digests[6] = digest(res.params)
  progress.mark_done('sft', {'index': 0, 'final_step': 6})
  progress.add_row({'stage': 'sft', 'index': 0, 'domains': ['a', 'b'], 'scores': {},
                    'validation': val_by_step[6], 'validation_stderr': {'a': 2.0, 'b': 2.0}})
  return ctx, digests, digest


@pytest.mark.heavy                    # the real loop: one compiled SFT step, Orbax saves (~20 s)
def test_mopd_best_teacher_is_the_intermediate_checkpoint_where_that_is_best(
    fakes, tmp_path, monkeypatch):
  # a is best at step 4 (of 6), b at the stage's end; step 2 was a's best until step 4.
  ctx, digests, digest = _run_sft(fakes, tmp_path, monkeypatch, {
      2: {'a': 30.0, 'b': 1.0}, 4: {'a': 50.0, 'b': 2.0}, 6: {'a': 40.0, 'b': 3.0}})
  try:
    ckpts = ctx.policies.checkpoints(ctx.plan.stages[0])
    # keep=1 and no periodic checkpoint: only the end (6) and a's best (4) are kept; step 2,
    # checkpointed while it was a's best, went once step 4 beat it.
    assert ckpts.steps() == [4, 6]
    saved = json.load(open(tmp_path / 'progress.json'))['ledger']
    assert [(e['step'], e['ckpt']) for e in saved] == [(2, True), (4, True)]
    picked = {}
    chosen = mopd.choose_teachers(ctx, ctx.plan.stages[1], picked)
    assert chosen['a'][0] == ('ckpt', 'sft', 4) and chosen['b'][0] == ('stage', 'sft')
    assert 'step 4/6' in chosen['a'][1]
    assert picked == {'a': {'stage': 'sft', 'step': 4, 'validation': 50.0, 'stderr': 1.0,
                            'final': False},
                      'b': {'stage': 'sft', 'step': 6, 'validation': 3.0, 'stderr': 2.0,
                            'final': True}}
    # The teacher's weights are step 4's.
    assert digest(ctx.policies.params_of(chosen['a'][0], keep=False)) == digests[4] != digests[6]
  finally:
    ctx.policies.close()


def test_the_rotation_keeps_a_pinned_step_until_it_is_no_longer_pinned(tmp_path):
  pins = {1}
  ckpts = checkpoint.StageCheckpoints(str(tmp_path / 'ckpt'), keep=1, async_save=False,
                                      pinned=lambda: pins)
  try:
    for step in (1, 2, 3):
      ckpts.save(step, {'x': np.full(2, step, np.float32)}, {'step': step})
    assert ckpts.steps() == [1, 3]          # 2 rotated away, 1 pinned
    ckpts.rotate()
    assert ckpts.steps() == [1, 3]
    pins.clear()                            # no longer some domain's best
    ckpts.rotate()
    assert ckpts.steps() == [3]
  finally:
    ckpts.close()
