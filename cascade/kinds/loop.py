"""The training loop every training kind runs: resume, batches, jitted updates, checkpoints.

`train_stage(ctx, kind, stage, maker_fn)` restores the stage's newest good checkpoint
(or builds a fresh state from the stage's starting policy), then for each
step asks the kind's `BatchMaker` for the step's batches (one per optimizer
update: one for on-policy RL, SFT and reward models; `updates_per_batch`
mini-batches of one rollout batch for PPO-style reuse), runs the jitted train
step on each, logs, scores the validation sets every `eval.eval_every` steps
(a policy-training stage whose domains have validation sets; logged as
`val/<domain>` and kept in the run's validation ledger, `cascade.ledger`; a step that is
some domain's best so far is checkpointed, and its checkpoint kept while it is), probes
the earlier protected domains where config.guard asks (`cascade.guard`: a 'stop' ends the
stage at its newest probed checkpoint within bounds), and checkpoints every
`ckpt.every_n_steps` steps and at the end.

Randomness: step s of stage i uses `fold_in(state.rng, s)` where `state.rng`
is `PRNGKey(stage_seed(seed, stage.seeds_from))`, saved in every checkpoint with the state;
its data comes from a grain iterator whose position is in every checkpoint's
metadata. A resumed stage therefore repeats exactly what an uninterrupted one
does.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
import tqdm

from cascade import checkpoint
from cascade import divergence
from cascade import evaluation
from cascade import guard as guard_lib
from cascade import metrics as metrics_lib
from cascade import preemption
from cascade import verifier_errors
from cascade.data import readers
from cascade.kinds import base
from foundation import step_clock
from models import sharding
from rl import train_step as train_lib


class BatchMaker(NamedTuple):
  """A kind's per-step batch builder.

  Attributes:
    loader: the stage's data iterator (its state is checkpointed).
    make: (step, rng, state) -> (list of train batches, one per update; host metrics).
  """
  loader: readers.Loader
  make: Callable[[int, jax.Array, train_lib.TrainState], tuple[Sequence[Any], dict]]


def record_batches(ctx, stage, batches: Callable[[list[dict]], tuple[Sequence[Any], dict]]):
  """The batch maker of a stage that trains on `stage.batch_size` records per step, drawn in
  the stage's seeded order: `batches(records)` -> (train batches, host metrics).

  Returns:
    maker(state) -> BatchMaker, what `train_stage` takes.
  """
  records = ctx.data.stage_records(stage)

  def maker(state):
    del state
    loader = readers.Loader(records, base.stage_seed(ctx.plan.seed, stage.seeds_from),
                             stage.batch_size)

    def make(step, rng, state):
      del step, rng, state
      return batches(loader.next())
    return BatchMaker(loader, make)
  return maker


def build_train_step(kind: base.Kind, stage, graphdef, state, mesh, rules,
                     optimizer: base.StageOptimizer, microbatches: int | None = None):
  """The jitted train step of a stage (what the runner runs and `launch.plan` compiles), with
  the stage's optimizer (`base.make_optimizer`, the one its state was made with).

  A stage that packs its updates (`microbatch_rows`, e.g. GRPO's `pack_tokens`) accumulates
  over as many microbatches of that many rows as a batch has, unless `microbatches` fixes the
  count (`launch.plan`'s one-microbatch FLOP-counting twin)."""
  loss, loss_cfg = kind.loss(stage)
  rows = None if microbatches else getattr(stage, 'microbatch_rows', None)
  return train_lib.make_train_step(
      graphdef, loss, loss_cfg, optimizer.tx, mesh=mesh, rules=rules, state=state,
      microbatches=microbatches or stage.microbatches, microbatch_rows=rows,
      lr_schedule=optimizer.schedule)


# Called at the end of every step, once its checkpoint (if one is due) is saved and before the
# loop asks whether to stop: hook(stage name, step, saved, stage checkpoints). Empty in a run: it
# is the seam where tests inject faults (tests/faults.py: a kill once a chosen step's checkpoint
# is on disk, a signal at a chosen step).
STEP_END_HOOKS: list[Callable[[str, int, bool, Any], None]] = []

# Per-step metrics summed into a stage's accounting (progress.json, results.json "accounting").
ACCOUNTED = ('step_s', 'sample_s', 'score_s', 'update_s', 'sample_idle_s', 'validation_s',
             'probe_s', 'decode_slots', 'generated_tokens', 'update_tokens', 'update_slots')


def accounting(totals: dict, steps: int) -> dict:
  """A stage's accounting from its summed step metrics: seconds per part of a step, the part of
  step time the verifiers took, and the waste of decode slots (paid for, no token generated)
  and of update token slots (rows x width holding padding)."""
  if not steps:
    return {}
  out = {'steps': steps, **{k: round(v, 3) for k, v in totals.items()}}
  if totals.get('step_s'):
    known = sum(totals.get(k, 0.0)
                for k in ('sample_s', 'score_s', 'update_s', 'validation_s', 'probe_s'))
    out['other_s'] = round(max(0.0, totals['step_s'] - known), 3)
    if 'score_s' in totals:
      out['verifier_share'] = round(totals['score_s'] / totals['step_s'], 4)
  if totals.get('decode_slots'):
    out['decode_waste'] = round(1 - totals['generated_tokens'] / totals['decode_slots'], 4)
  if totals.get('update_slots'):
    out['update_waste'] = round(1 - totals['update_tokens'] / totals['update_slots'], 4)
  return out


def _merge(ms: Sequence[dict]) -> dict:
  """One step's metrics from its updates: the mean of each, the last `skipped`, the largest
  `update_ratio` (one update that blew the weights up is the step's)."""
  if len(ms) == 1:
    return ms[0]
  out = {k: float(np.mean([m[k] for m in ms])) for k in ms[0]}
  out['skipped'] = ms[-1]['skipped']
  if 'update_ratio' in out:
    out['update_ratio'] = max(float(m['update_ratio']) for m in ms)
  out['updates'] = float(len(ms))
  return out


def train_stage(ctx, kind: base.Kind, stage,
                maker_fn: Callable[[Any], BatchMaker]) -> base.StageResult:
  """Runs (or resumes) a training stage to its last step.

  Every step is judged by the run's divergence policy (`cascade.divergence`:
  a stage whose last step is bad has diverged too, so no final checkpoint or
  export holds an unrecovered policy); a periodic checkpoint waits for a good
  step, so the newest one before a run of bad steps survives Orbax's `keep`
  rotation for a rollback. At every step
  boundary the loop asks whether a signal asked the run to stop
  (`cascade.preemption`, agreed by every host): then it checkpoints that step
  and raises `Preempted`. A stop raised while a step's batch is made or the
  policy validated (`verifier_errors.VerifierBug`, a `StageError` such as a failing
  sandbox) also checkpoints the steps taken before it passes on.

  Args:
    ctx: the run's `cascade.runner.RunContext`.
    kind: the stage's Kind.
    stage: the stage's config.
    maker_fn: (state) -> BatchMaker, called once the state exists.

  Returns:
    The StageResult (its params are the final TrainState's).

  Raises:
    cascade.divergence.Diverged: the stage diverged and has no rollback left.
    cascade.preemption.Preempted: a signal stopped the run (the step is checkpointed).
    cascade.verifier_errors.VerifierBug: a verifier raised in its own code (the steps before it
      are checkpointed).
  """
  pol = ctx.policies
  opt = base.make_optimizer(stage)
  optimizer = opt.tx
  ckpts = pol.checkpoints(stage)
  abstract = pol.abstract_state(stage.MODEL, optimizer)
  restored = ckpts.restore(abstract)
  seed = base.stage_seed(ctx.plan.seed, stage.seeds_from)
  if restored is not None:
    step, state, meta = restored
    print(f'[{stage.index}] {stage.name}: resuming at step {step}/{stage.steps}', flush=True)
  else:
    step, meta = 0, None
    state = pol.initial_state(stage, optimizer, seed)
  ledger = getattr(ctx, 'ledger', None)
  if ledger is not None:          # what was scored past the resumed step is scored again
    ledger.discard_after(stage.name, step)
  maker = maker_fn(state)
  start_data = maker.loader.get_state()
  if meta is not None:
    maker.loader.set_state(meta['data'])
  watch = divergence.Watch(ctx.plan.divergence, stage, (meta or {}).get('divergence'))
  if watch.lr_scale != 1.0:       # resumed after a rollback: at the rate it left off with
    opt = base.make_optimizer(stage, watch.lr_scale)
  step_fn = _step_fn(ctx, kind, stage, state, opt)
  every = ctx.plan.ckpt.every_n_steps
  # In-stage validation (the stage's eval_every, else config.eval.eval_every) of a policy; the
  # stage's end is its matrix row.
  val_every = ctx.plan.eval.eval_every if stage.eval_every is None else stage.eval_every
  if val_every and (stage.MODEL != 'policy' or not ctx.data.validation_sets):
    val_every = 0
  bar = metrics_lib.StageBar(stage, step)
  # Where each step's time goes (`foundation.step_clock`; a context with none times nothing).
  clock = getattr(ctx, 'clock', None) or step_clock.NULL
  start, ran = time.time(), 0
  totals: dict[str, float] = {}

  def save(step, state, **extra):
    ckpts.save(step, state, {'step': step, 'stage_index': stage.index, 'stage': stage.name,
                             'data': maker.loader.get_state(), 'divergence': watch.state(),
                             **extra})

  last_saved = step if restored is not None else None

  def keep(step, state, data):
    """Before a stop that is no divergence (a verifier's own bug, a failing sandbox): the
    steps taken so far are checkpointed, the data position as it was at that step."""
    if step and step != last_saved:
      maker.loader.set_state(data)
      save(step, state)
    ckpts.wait()
    bar.close()

  stops = (base.StageError, verifier_errors.VerifierBug)
  guard = guard_lib.StageGuard(ctx, stage)
  stopped = (meta or {}).get('guard_stop')

  def guard_stop(at):
    """A guard's 'stop' at step `at`: the stage's newest probed checkpoint within every bound
    (or its starting policy) is saved as its last step. Returns that state."""
    nonlocal stopped
    back = guard.stop_step()
    if back:
      _, kept, _ = ckpts.restore(abstract, step=back)
    else:
      kept = pol.initial_state(stage, optimizer, seed)
    stopped = {'at': at, 'kept': back}
    if checkpoint.is_writer():
      tqdm.tqdm.write(f'[{stage.index}] {stage.name}: guard: stopping the stage at step '
                      f'{at}/{stage.steps}; its policy is that of step {back} (the newest '
                      'probed within every bound), saved as its last step', file=sys.stderr)
    ckpts.delete(stage.steps)
    save(stage.steps, kept, guard_stop=stopped)
    return kept

  def repaired(at):
    """A repair stage whose domains are all back within bounds at step `at` ends there."""
    nonlocal stopped
    stopped = {'repaired_at': at}
    if checkpoint.is_writer():
      tqdm.tqdm.write(f'[{stage.index}] {stage.name}: guard: every repaired domain is back '
                      f'within its bound at step {at}/{stage.steps}; the stage ends here',
                      file=sys.stderr)
    save(stage.steps, state, guard_stop=stopped)

  if guard.active and step == 0:
    results, breached, _ = guard.probe(0, state.params)
    guard.record(0, results, breached, ckpt=False)
  elif guard.active and step < stage.steps:
    # Resumed at a step whose probe decided the stage's end before it could end.
    crossed = guard.breached_at(step)
    if crossed and guard.stops:
      state, step = guard_stop(step), stage.steps
    elif crossed is False and guard.repairing:
      repaired(step)
      step = stage.steps
  while step < stage.steps:
    clock.start()
    t0 = time.perf_counter()
    with clock.part('step rng'):
      rng = jax.random.fold_in(state.rng, step)
    data_at = maker.loader.get_state()
    try:
      with clock.part('batch'):
        batches, host = maker.make(step, rng, state)
    except stops:
      keep(step, state, data_at)
      raise
    ms = []
    for batch in batches:
      state, m = train_lib.run_step(step_fn, state, batch, clock=clock)
      m['update_s'] = m.pop('step_s')
      ms.append(m)
    m = _merge(ms)
    m.update(host, step_s=time.perf_counter() - t0)
    step += 1
    ran += 1
    with clock.part('divergence check'):
      diverged = watch.see(step, m)
    validated = {}
    if val_every and step % val_every == 0 and step < stage.steps and not diverged:
      t1 = time.perf_counter()
      try:
        with clock.part('validation'):
          validated = evaluation.validation_results(ctx, state.params)
      except stops:
        keep(step, state, maker.loader.get_state())
        raise
      m.update({f'val/{d}': r['score'] for d, r in validated.items()})
      m['validation_s'] = time.perf_counter() - t1
    probed, breached, foreseen = None, {}, False
    if guard.due(step) and not diverged:
      try:
        with clock.part('guard probe'):
          probed, breached, gm = guard.probe(step, state.params)
      except stops:
        keep(step, state, maker.loader.get_state())
        raise
      m.update(gm)
      # A forecast past a bound (config.guard.forecast_confidence) stops as a fall would.
      foreseen = guard.forecast_stops(guard.forecast_crossed)
    with clock.part('metrics log'):
      ctx.writer.write(stage, step, m)
      bar.update(m)
    for k in ACCOUNTED:
      if k in m:
        totals[k] = totals.get(k, 0.0) + float(m[k])
    if diverged:
      back = watch.rollback_step([s for s in ckpts.steps() if s < step])
      if not watch.can_roll_back:
        ckpts.wait()
        bar.close()
        raise watch.diverged(step, back)
      step, state = _roll_back(ctx, stage, ckpts, abstract, optimizer, seed, maker, start_data,
                               watch, back, step)
      last_saved = step or None
      opt = base.make_optimizer(stage, watch.lr_scale)
      step_fn = _step_fn(ctx, kind, stage, state, opt)
      bar.rewind(step)
      continue
    saved = step == stage.steps or (every and step % every == 0 and not watch.streak)
    if validated and ledger is not None:
      # A domain's best validation so far is checkpointed (a MOPD teacher candidate).
      best = ledger.new_best(stage, validated)
      saved = saved or bool(best and not watch.streak)
      ledger.record(stage, step, validated, ckpt=saved)
    if probed is not None:
      # With 'stop', every probe within bounds is a checkpoint the stage can end at.
      saved = saved or bool(guard.stops and not breached and not watch.streak)
      guard.record(step, probed, breached, ckpt=saved)
    if saved:
      with clock.part('checkpoint'):
        save(step, state)
      last_saved = step
    with clock.outside():           # test hooks are no part of the step
      for hook in STEP_END_HOOKS:
        hook(stage.name, step, saved, ckpts)
    if (breached or foreseen) and guard.stops:
      state, step = guard_stop(step), stage.steps
      break
    if probed is not None and guard.repairing and not breached and step < stage.steps:
      repaired(step)        # a repair stage ends once every domain it repairs is back
      step = stage.steps
      break
    with clock.part('preemption check'):
      why = preemption.stop_requested()
    clock.stop()
    if why:
      if not saved:
        save(step, state)
      ckpts.wait()
      bar.close()
      raise preemption.Preempted(
          f'{why}: stopped at stage {stage.index} {stage.name!r} step {step}/{stage.steps}, '
          'checkpoint saved; rerun the same command to resume there')
  ckpts.wait()
  bar.close()
  info = {'accounting': accounting(totals, ran)}
  if watch.bad_steps:
    info['bad_steps'] = watch.bad_steps
  if watch.rollbacks:
    info['rollbacks'], info['lr_scale'] = watch.rollbacks, watch.lr_scale
  if guard.active:
    info['guard'] = guard.info(stopped)
  # Accounting covers the steps this process ran (after a resume, the resumed part).
  return base.StageResult(params=state.params, final_step=stage.steps, steps_run=ran,
                          seconds=time.time() - start, first=bar.first, last=bar.last, info=info)


def _step_fn(ctx, kind: base.Kind, stage, state, optimizer: base.StageOptimizer):
  """The stage's jitted train step with `optimizer` (the stage's, its learning rate scaled
  after rollbacks)."""
  step_fn = build_train_step(kind, stage, ctx.policies.graphdef(stage.MODEL), state, ctx.mesh,
                             ctx.rules, optimizer)
  if ctx.mesh is not None and jax.process_count() > 1:
    step_fn = _with_global_batch(step_fn, ctx.mesh, ctx.rules)
  return step_fn


def _roll_back(ctx, stage, ckpts, abstract, optimizer, seed, maker, start_data, watch,
               back: int, step: int):
  """Restores step `back` (0: the stage's fresh start) for a diverged stage, its data position
  included, and counts the rollback. Returns (step, state)."""
  watch.rolled_back()
  ckpts.discard_after(back)
  if getattr(ctx, 'ledger', None) is not None:
    ctx.ledger.discard_after(stage.name, back)
  if back:
    _, state, meta = ckpts.restore(abstract, step=back)
    maker.loader.set_state(meta['data'])
  else:
    state = ctx.policies.initial_state(stage, optimizer, seed)
    maker.loader.set_state(start_data)
  if checkpoint.is_writer():
    tqdm.tqdm.write(f'[{stage.index}] {stage.name}: diverged at step {step}/{stage.steps}; '
                    f'rolled back to step {back}, learning rate x{watch.lr_scale:g} (rollback '
                    f'{watch.rollbacks} of {watch.policy.rollbacks})', file=sys.stderr)
  return back, state


def _with_global_batch(step_fn, mesh, rules):
  """Wraps a train step so its host batch becomes global arrays split over 'batch'.

  In a multi-process run every process builds the same host batch (same data
  order, same seeds), but jit refuses host numpy inputs with a sharding that
  spans other processes' devices; each process contributes its own rows.
  """
  rows = jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(('batch',), None, mesh, rules))

  def to_global(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, rows, lambda index: x[index])

  return lambda state, batch: step_fn(state, jax.tree.map(to_global, batch))
