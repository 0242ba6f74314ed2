"""`run(config, workdir)`: the cascade — every stage in order, checkpoints, resume, the matrix.

  from cascade import runner
  results = runner.run(config, '/tmp/runs/tiny')     # or cascade.run(config, workdir)

1. Validate the whole config into a `Plan` (`cascade.config.validate`; nothing
   after this reads the ConfigDict) and refuse a workdir that holds a
   different config (`checkpoint.guard_config` of `plan.source`), then point
   JAX's persistent compilation cache at `config.compilation_cache.dir`
   (default `<workdir>/compilation_cache`; `cascade.compile_cache`), so a
   restart loads what an earlier run compiled. Each stage's line and the run's
   last line say how many programs were loaded and how many compiled.
2. Run the config's `prepare` step if it names one (e.g. build the tiny
   world), then build the mesh, tokenizer, sampler, verifiers, print the start
   banner (`cascade.report`: config, workdir, devices and mesh, the stages, the
   resume point, each verifier's isolation, the compilation cache), and load and
   check every dataset (a malformed record stops the run here, before any step),
   then score fixed probe answers on a few records of every domain
   (`VerifierSet.dry_run`: a verifier that raises in its own code stops it here).
3. Evaluate the starting policy when the cascade starts with RL (row 'init').
4. For each stage not yet complete in progress.json: run it through its
   kind (`cascade.kinds.KINDS[stage.kind].run(ctx, stage)`, resuming from its
   newest good checkpoint, only on the data files it started with:
   `StageData.pin`, checked before any data loads for the stage the run resumes
   in), export its policy as HF safetensors, evaluate every
   domain and config.eval.suites (a row of the matrix), mark it complete; rewrite
   results.{json,md,png}.

A stage that diverges (`cascade.divergence`) stops the run before its export
and evaluation; SIGTERM or SIGINT stops it at the next step boundary with a
checkpoint, before the next batch of an evaluation (keeping what it scored:
`evaluate_row`), or before the next stage (`cascade.preemption`). Every write
to the workdir first checks the workdir lock (`cascade.lock`: a run whose
lock was taken over writes nothing more).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
from jax.experimental import multihost_utils

from cascade import checkpoint
from cascade import compile_cache
from cascade import config as config_lib
from cascade import evaluation
from cascade import forecast as forecast_lib
from cascade import kinds
from cascade import ledger as ledger_lib
from cascade import lock
from cascade import metrics
from cascade import policies as policies_lib
from cascade import preemption
from cascade import report as report_lib
from cascade import rollout
from cascade import verifier_errors
from cascade import verifier_set
from cascade.data import stage_data
from foundation import chat_template
from foundation import paths
from foundation import tokenizer as tokenizer_lib
from foundation import topology
from models import sharding
from rl import sampler as sampler_lib

INIT_ROW = kinds.base.INIT_ROW


@dataclasses.dataclass(frozen=True)
class RunContext:
  """The run context: what a stage runner may use, built once per run (`ctx`; the RL
  environments a domain names are `envs.Environment`s, a different thing).

  Attributes:
    plan: the validated plan.
    workdir: the run's directory.
    mesh, rules: the device mesh (None: one device) and logical sharding rules.
    batch_shards: how many ways the mesh splits rows (fixed batches must divide).
    tokenizer: the run's tokenizer.
    sampler: the policy sampler (`rl.sampler.Sampler`).
    policies: model structures, checkpoints and policy sources.
    data: the records.
    verifiers: the domains' verifiers.
    sample_cls: `verifiers.Sample`.
    domain_index: domain name -> index (sorted names), e.g. MOPD's teacher table.
    writer: the metrics writer.
    progress: progress.json (done stages, matrix rows).
    before_write: the workdir lock's check, called before every write to the workdir (the
      writer, checkpoints and progress.json call it themselves).
    config_hash: the hash of the config the run computes with.
    ledger: the per-domain validation ledger (`cascade.ledger`, over `progress`).
  """
  plan: config_lib.Plan
  workdir: str
  mesh: Any
  rules: tuple
  batch_shards: int
  tokenizer: Any
  sampler: sampler_lib.Sampler
  policies: policies_lib.Policies
  data: stage_data.StageData
  verifiers: verifier_set.VerifierSet
  sample_cls: type
  domain_index: dict
  writer: metrics.Writer
  progress: checkpoint.Progress
  before_write: Callable[[], None] = lambda: None
  config_hash: str = ''
  ledger: Any = None


def _mesh(plan: config_lib.Plan):
  if plan.mesh_shape is None:
    return None
  try:
    return sharding.make_mesh(plan.mesh_shape, slices=plan.mesh_slices)
  except topology.SliceError as e:
    raise config_lib.ConfigError(f'config.mesh.slices={plan.mesh_slices!r}: {e}') from None
  except ValueError as e:
    raise config_lib.ConfigError(f'config.mesh.shape={list(plan.mesh_shape)!r}: {e}') from None


def make_context(plan: config_lib.Plan, workdir: str,
                 before_write: Callable[[], None] | None = None,
                 config_hash: str = '') -> RunContext:
  """Builds the run context (no data loaded yet: `ctx.data.load()`); `before_write` (the
  workdir lock's check) runs before every write to the workdir, and the matrix rows it adds
  carry `config_hash`.

  Before every checkpoint save and progress.json write the isolation of the code the
  verifiers built so far ran under is noted in progress.json (`Progress.record_isolation`),
  so a resumed run's results keep it even where the resume builds none of them."""
  gate = before_write or (lambda: None)
  mesh = _mesh(plan)
  shards = sharding.batch_shards(mesh, plan.rules)
  for st in plan.stages:
    rows = st.rows_per_step()
    if rows is not None and rows[0] % (st.microbatches * shards):
      raise config_lib.ConfigError(
          f'{st.where}: {rows[1]} = {rows[0]} rows do not split over {st.microbatches} '
          f'microbatches x {shards} batch shards of the mesh')
  tokenizer = chat_template.attach(tokenizer_lib.load(plan.tokenizer_path), plan.chat_template)
  if tokenizer.vocab_size > plan.model.vocab_size:
    raise config_lib.ConfigError(f'config.tokenizer: {tokenizer.vocab_size} tokens do not '
                                 f"fit the model's vocab_size={plan.model.vocab_size}")
  if tokenizer.eos_id is None:
    raise config_lib.ConfigError('config.tokenizer: the tokenizer has no end-of-sequence token')
  writer = metrics.Writer(workdir, plan=plan, before_write=before_write)

  def before_progress():
    gate()
    progress.record_isolation(verifiers.isolation())

  def before_checkpoint():
    gate()
    if progress.record_isolation(verifiers.isolation()):
      progress.save()
    writer.flush()

  policies = policies_lib.Policies(
      plan, workdir, mesh, plan.rules, before_save=before_checkpoint,
      pinned=lambda name: ledger.pinned(name),
      skipped=lambda name: bool((progress.done.get(name) or {}).get('skipped')))
  sampler = sampler_lib.Sampler(policies.graphdef('policy'), plan.model,
                                eos_ids=[tokenizer.eos_id], pad_id=tokenizer.pad_id, mesh=mesh,
                                rules=plan.rules, **plan.sampler.options())
  progress = checkpoint.Progress(workdir, before_save=before_progress, config_hash=config_hash)
  ledger = ledger_lib.Ledger(progress)
  verifiers = verifier_set.VerifierSet(
      plan, rm_scorer=lambda st: policies.reward_scorer(st, tokenizer),
      rm_ready=lambda name: name in progress.done,
      judge_model=lambda src: policies.judge_model(src, tokenizer),
      judge_tokenizer=lambda src: tokenizer if src[0] == 'stage' else tokenizer_lib.load(src[1]))
  return RunContext(plan=plan, workdir=workdir, mesh=mesh, rules=plan.rules, batch_shards=shards,
                    tokenizer=tokenizer, sampler=sampler, policies=policies,
                    data=stage_data.StageData(
                        plan, tokenizer, verifiers.check_metadata,
                        cache_dir=plan.data_cache or paths.join(workdir, 'data_cache'),
                        hosts=rollout.processes()),
                    verifiers=verifiers, sample_cls=verifiers.sample_cls,
                    domain_index={d: i for i, d in enumerate(sorted(plan.domains))},
                    writer=writer, progress=progress, before_write=gate,
                    config_hash=config_hash, ledger=ledger)


# What a stopped evaluation of a matrix row kept (`evaluate_row`): {'row', 'config', 'held_out',
# 'validation'}, the last two `evaluation.Stopped.done` or finished domains' results.
EVAL_PARTIAL = 'eval_partial.json'


def evaluate_row(ctx: RunContext, name: str, index: int, trains_on, params, hf: str = '',
                 reporter: report_lib.Reporter | None = None, inserted=None) -> dict:
  """Evaluates a policy on every domain (held-out and validation sets) and on config.eval.suites;
  appends its row to progress.json. `hf`: where the policy is exported (named by results.json's
  "best"); `reporter`: prints a line per domain and suite evaluated; `inserted`: a stage the
  guards inserted (what it repairs and the drops that made it run: the row is marked).

  SIGTERM or SIGINT (`cascade.preemption`) stops it at the next batch boundary: what it
  evaluated is kept in workdir/eval_partial.json (with the row's name and the config's hash)
  and `Preempted` raised; the rerun's evaluation of the same row samples only the rest, and
  its row is the one an uninterrupted evaluation makes (the suites keep their graded batches
  in workdir/suites/<row>: `evaluation.score_suites`).
  """
  label = f'[{index}] {name}' if index >= 0 else name
  report = None if reporter is None else (
      lambda i, n, domain, res, secs: reporter.evaluated(label, i, n, domain, res, secs))
  suite_report = None if reporter is None else (
      lambda i, n, res, secs: reporter.suite_evaluated(label, i, n, res, secs))
  path = paths.join(ctx.workdir, EVAL_PARTIAL)
  kept = _kept_evaluation(ctx, path, name)
  if kept and checkpoint.is_writer():
    print(f'{label}: resuming its stopped evaluation ({_kept_count(kept)} kept)', flush=True)
  part = 'held_out'
  try:
    out = evaluation.score_sets(ctx, params, ctx.data.eval_sets, evaluation.HELD_OUT_FOLD, report,
                                done=kept.get(part), stop=preemption.stop_requested)
    kept[part] = {d: {'result': r} for d, r in out.items()}
    part = 'validation'
    validation = evaluation.validation_results(ctx, params, done=kept.get(part),
                                               stop=preemption.stop_requested)
    kept[part] = {d: {'result': r} for d, r in validation.items()}
    part = 'suites'
    suites = evaluation.score_suites(ctx, params, name, suite_report,
                                     stop=preemption.stop_requested)
  except evaluation.Stopped as e:
    kept[part] = e.done
    ctx.before_write()
    checkpoint.atomic_write_json(path, {'row': name, 'config': ctx.config_hash, **kept})
    where, also = f'its {part.replace("_", "-")} {e.where}', ''
    if part == 'suites':
      where, also = e.where, f', graded suite batches in {paths.join(ctx.workdir, "suites")}'
    raise preemption.Preempted(
        f'{e.why}: stopped evaluating {label} at {where} ({_kept_count(kept)} kept in {path}'
        f'{also}); rerun the same command to resume there') from None
  row = {'stage': name, 'index': index, 'domains': list(trains_on),
         'scores': {d: out[d]['score'] for d in sorted(out)}, 'details': out}
  if validation:
    row['validation'] = {d: r['score'] for d, r in validation.items()}
    # Its standard errors (the ledger's, `cascade.ledger`; a row kept from before they were
    # measured has none).
    row['validation_stderr'] = {d: r['stderr'] for d, r in validation.items() if 'stderr' in r}
  if suites:
    row['suites'] = suites
  if hf:
    row['hf'] = hf
  if inserted:
    row['inserted'] = dict(inserted)
  row = ctx.progress.add_row(row)
  if checkpoint.is_writer() and paths.exists(path):
    paths.remove(path)            # after add_row's lock check
  ctx.writer.write_scores(name, index, row['scores'], row.get('validation'))
  return row


def _kept_evaluation(ctx: RunContext, path: str, name: str) -> dict:
  """What a stopped evaluation of row `name` under this config kept ({} when none)."""
  try:
    rec = checkpoint.read_json(path)
  except ValueError:              # a damaged file: the evaluation is simply redone
    return {}
  if not isinstance(rec, dict) or rec.get('row') != name or rec.get('config') != ctx.config_hash:
    return {}
  return {k: rec[k] for k in ('held_out', 'validation') if isinstance(rec.get(k), dict)}


def _kept_count(kept: dict) -> str:
  """'2 domains and 5 batches' of what a stopped evaluation kept."""
  parts = [v for part in kept.values() for v in part.values()]
  domains = sum('result' in v for v in parts)
  batches = sum(len(b) for v in parts for b in (v.get('modes') or {}).values())
  return f'{domains} domain(s) and {batches} batch(es)'


def _prepare(plan: config_lib.Plan) -> None:
  """Runs the config's data-making step on the writer process; the others wait for it."""
  if plan.prepare is None:
    return
  if checkpoint.is_writer():
    what = f'{plan.prepare.fn}(' + ', '.join(
        f'{k}={v!r}' for k, v in sorted((plan.prepare.kwargs or {}).items())) + ')'
    print(f'prepare: {what} ...', flush=True)
    t0 = time.perf_counter()
    plan.prepare.call()
    print(f'prepare: done in {time.perf_counter() - t0:.1f} s', flush=True)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('cascade.prepare')


def run(config, workdir: str, fork_from: str | None = None, force_lock: bool = False,
        lock_stale_s: float = lock.DEFAULT_STALE_S, command: str = '') -> dict:
  """Runs (or resumes) the cascade a config describes in `workdir`.

  Args:
    config: the ConfigDict (docs/config.md: every section and stage field).
    workdir: the run's directory, local or `gs://...` (`foundation.paths`); rerunning with the
      same config resumes.
    fork_from: another run's workdir whose leading stages this config shares
      (`checkpoint.fork`: e.g. the cascade an ablation changes later stages of); those
      stages are copied instead of rerun.
    force_lock: take the workdir's lock over even from a run that looks alive (`cascade.lock`).
    lock_stale_s: a lock whose heartbeat is older than this many seconds is taken over.
    command: the config file and overrides the command line gave, for the start banner.

  Returns:
    The results.json object (domains, stages, stage_domains, scores).

  Raises:
    cascade.config.ConfigError: the config is invalid (before anything runs).
    cascade.data.readers.DataError: a malformed record (before the first step).
    cascade.checkpoint.WorkdirError: the workdir holds a different config (unless allowed).
    cascade.lock.WorkdirBusy: another run holds the workdir (before anything is written), or
      took it over (before this run's next write).
    cascade.divergence.Diverged: a stage diverged (its policy is not exported or evaluated).
    cascade.preemption.Preempted: SIGTERM or SIGINT stopped the run at a step boundary, with a
      checkpoint (a rerun resumes there).
    cascade.verifier_errors.VerifierBug: a verifier (or environment) raised in its own code,
      whatever the answer (before the first step, or mid-stage with its steps checkpointed).
  """
  plan = config_lib.validate(config)
  try:
    paths.makedirs(workdir)
    held = lock.take(workdir, lock_stale_s, force_lock)
  except (OSError, paths.PathError):
    # An unwritable workdir (read-only disk, a bucket this account may only read): a finished
    # run of this config is read and printed, nothing written; anything else is the error.
    res = _finished_results(plan, workdir)
    if res is None:
      raise
    _print_results(workdir, res)
    return res
  try:
    with preemption.watch():      # SIGTERM / SIGINT: stop at the next step boundary
      return _run(plan, workdir, fork_from, held, command)
  finally:
    compile_cache.restore()
    held.release()


def _run(plan: config_lib.Plan, workdir: str, fork_from: str | None,
         held: lock.Held, command: str = '') -> dict:
  """`run` once the workdir's lock is held."""
  config_hash = checkpoint.guard_config(workdir, plan.source,
                                        allow_change=plan.allow_config_change)
  cache = compile_cache.enable(plan.compilation_cache.dir,
                               default=paths.join(workdir, 'compilation_cache'),
                               min_compile_secs=plan.compilation_cache.min_compile_secs)
  if fork_from:
    forked = checkpoint.fork(fork_from, workdir, plan.source)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('cascade.fork')
    print(f'{workdir}: resuming its own progress; --fork_from={fork_from} ignored'
          if forked is None else f'forked from {fork_from}: '
          + (', '.join(forked) if forked else 'no stage shared'), flush=True)
  _prepare(plan)
  ctx = make_context(plan, workdir, before_write=held.check, config_hash=config_hash)
  domains = sorted(plan.domains)
  try:
    _check_exports(ctx)
    isolation = ctx.verifiers.check_options()
    done = [st.name for st in plan.stages if st.name in ctx.progress.done]
    resume_step = _resume_step(ctx)
    reporter = report_lib.Reporter(plan, done, resume_step)
    if reporter.enabled:        # process 0 (the cache's line lists its directory)
      reporter.say(report_lib.banner(
          plan, workdir=workdir, command=command, config_hash=config_hash, mesh=ctx.mesh,
          done=done, resume_step=resume_step, isolation=isolation,
          cache_line=cache.banner() if cache is not None else None))
    _pin_data(ctx, next((st for st in plan.stages if st.name not in ctx.progress.done), None))
    ctx.data.load()
    # A suite's missing or malformed data stops the run here.
    evaluation.suite_sets(plan, ctx.tokenizer)
    ctx.verifiers.dry_run(ctx.data.eval_sets)   # a verifier's own bug stops the run here
    if plan.initial_eval and ctx.progress.row(INIT_ROW) is None:
      row = evaluate_row(ctx, INIT_ROW, -1, [], ctx.policies.params_of(('initial',)),
                         hf=plan.hf_path, reporter=reporter)
      _write_results(ctx, domains)
      print('initial policy: ' + ', '.join(f'{d} {v:.1f}' for d, v in row['scores'].items()),
            flush=True)
    for stage in plan.stages:
      if stage.name not in ctx.progress.done:
        why = preemption.stop_requested()
        if why:
          raise preemption.Preempted(f'{why}: stopped before stage {stage.index} {stage.name!r}; '
                                     'rerun the same command to resume there')
        _run_stage(ctx, stage, domains, cache, reporter)
  finally:
    ctx.verifiers.close()
    held_still = _still_held(held)
    if held_still:                # closing finishes and seals checkpoints: writes
      ctx.policies.close()
    ctx.writer.close(discard=not held_still)
    if cache is not None and checkpoint.is_writer():
      print(f'compilation cache {cache.dir}: {cache.since().describe()} in this run', flush=True)
  res = _write_results(ctx, domains)
  _print_results(workdir, res)
  return res


def _still_held(held: lock.Held) -> bool:
  """Whether the workdir lock is still this run's (a run that lost it writes nothing more)."""
  try:
    held.check()
  except lock.WorkdirBusy:
    return False
  return True


def _write_results(ctx: RunContext, domains) -> dict:
  """results.{json,md,png} of the rows so far (`evaluation.write`), after the lock's check."""
  ctx.before_write()
  return evaluation.write(ctx.workdir, ctx.progress.rows, domains, _isolation(ctx.progress),
                          _accounting(ctx.progress), extra=_results_extra(ctx, domains))


def _results_extra(ctx: RunContext, domains) -> dict:
  """results.json's "substitutions" (domain -> the reward that stood in for a paper's,
  `config.Plan.substitutions`), "ledger" (each domain's best validation checkpoint,
  `cascade.ledger`), "teachers" (stage -> domain -> the checkpoint a MOPD stage distilled
  from), "guards" (stage -> what its regression guards saw, `cascade.guard`) and "forecast"
  (each guarded stage's first forecast of each protected domain beside the outcome,
  `cascade.forecast.outcome_rows`), where there are any."""
  out = {}
  if ctx.plan.substitutions:
    out['substitutions'] = dict(sorted(ctx.plan.substitutions.items()))
  best = ctx.ledger.summary(domains) if ctx.ledger is not None else {}
  if best:
    out['ledger'] = best
  for key, field in (('teachers', 'teacher_checkpoints'), ('guards', 'guard')):
    got = {name: info[field] for name, info in ctx.progress.done.items() if info.get(field)}
    if got:
      out[key] = got
  fc = forecast_lib.outcome_rows(out.get('guards') or {})
  if fc:
    out['forecast'] = fc
  return out


def _print_results(workdir: str, res: dict) -> None:
  if checkpoint.is_writer():
    print(evaluation.markdown(res), flush=True)
    print(f'results: {paths.join(workdir, "results.md")}, '
          f'{paths.join(workdir, "results.png")}', flush=True)


def _finished_results(plan: config_lib.Plan, workdir: str) -> dict | None:
  """results.json of a finished run of this config in `workdir`, read without writing (None when
  the run there is not that, or its files cannot be read)."""
  try:
    rec = checkpoint.read_json(paths.join(workdir, 'config.json'))
    if not rec or rec.get('hash') != checkpoint.config_hash(plan.source):
      return None
    done = (checkpoint.read_json(paths.join(workdir, 'progress.json')) or {}).get('done') or {}
    if any(st.name not in done for st in plan.stages):
      return None
    return checkpoint.read_json(paths.join(workdir, 'results.json'))
  except (OSError, ValueError, AttributeError):   # PathError and JSONDecodeError are ValueErrors
    return None


def _check_exports(ctx: RunContext) -> None:
  """Exports again, from its final checkpoint, a finished stage whose HF export is gone or no
  longer matches its checksums (`Policies.damaged_export` moves a damaged one aside)."""
  for stage in ctx.plan.stages:
    info = ctx.progress.done.get(stage.name)
    if not stage.trains_policy or not info or not info.get('hf'):
      continue
    out = paths.join(checkpoint.stage_dir(ctx.workdir, stage), 'hf')
    ctx.before_write()            # a damaged export is moved aside, a missing one written
    if not policies_lib.exported(out) or ctx.policies.damaged_export(stage, out):
      ctx.policies.export_hf(stage, ctx.policies.final_state(stage).params)


def _resume_step(ctx: RunContext) -> int | None:
  """The newest checkpoint's step of the first stage not done (None: it has none)."""
  stage = next((st for st in ctx.plan.stages if st.name not in ctx.progress.done), None)
  if stage is None or stage.MODEL is None:
    return None
  ckpt = paths.join(checkpoint.stage_dir(ctx.workdir, stage), 'ckpt')
  if not paths.exists(ckpt):
    return None
  steps = ctx.policies.checkpoints(stage).sealed_steps()
  return steps[-1] if steps else None


def _pin_data(ctx: RunContext, stage) -> None:
  """Records in progress.json the identity of `stage`'s data files as it starts, or, when it
  resumes from a checkpoint, refuses it if they changed since (`StageData.pin`)."""
  if stage is None or not stage.datasets:
    return
  ckpt = paths.join(checkpoint.stage_dir(ctx.workdir, stage), 'ckpt')
  resuming = (stage.MODEL is not None and paths.exists(ckpt)
              and bool(ctx.policies.checkpoints(stage).sealed_steps()))
  ctx.progress.record_data(stage.name, ctx.data.pin(stage, ctx.progress.data.get(stage.name),
                                                    resuming))


def _accounting(progress: checkpoint.Progress) -> dict[str, dict]:
  """stage -> where its step time went (`kinds.loop.accounting`), for the stages that train."""
  return {name: info['accounting'] for name, info in progress.done.items()
          if info.get('accounting')}


def _isolation(progress: checkpoint.Progress) -> dict[str, str]:
  """verifier -> every isolation its code ran under in this workdir (several: 'a, b'): what
  progress.json noted as code ran, and what the finished stages recorded."""
  out: dict[str, set] = {k: set(v) for k, v in progress.isolation.items()}
  for info in progress.done.values():
    for name, iso in (info.get('isolation') or {}).items():
      out.setdefault(name, set()).update(x.strip() for x in iso.split(',') if x.strip())
  return {k: ', '.join(sorted(v)) for k, v in out.items()}


def _run_stage(ctx: RunContext, stage, domains, cache: compile_cache.Cache | None,
               reporter: report_lib.Reporter) -> None:
  mark = compile_cache.counts()
  t0 = time.perf_counter()
  reporter.stage_started(stage)
  _pin_data(ctx, stage)
  result = kinds.get(stage.kind).run(ctx, stage)
  info = {'index': stage.index, 'kind': stage.kind, **dict(result.info)}
  params = result.params
  if info.get('skipped'):         # a repair stage with nothing to repair: no export, no row
    ctx.progress.mark_done(stage.name, info)
    reporter.stage_ended(stage, 0, time.perf_counter() - t0, None)
    return
  if stage.trains_policy:
    ctx.policies.remember(('stage', stage.name), params)
    t1 = time.perf_counter()
    reporter.say(f'[{stage.index}] {stage.name}: exporting the policy (HF safetensors) ...')
    ctx.before_write()
    info['hf'] = ctx.policies.export_hf(stage, params)
    reporter.exported(stage, info['hf'], time.perf_counter() - t1)
  if result.final_step is not None:
    info['final_step'] = result.final_step
  isolation = ctx.verifiers.isolation()
  if isolation:
    info['isolation'] = isolation
    print(f'[{stage.index}] {stage.name}: code ran under isolation ' +
          ', '.join(f'{k}={v}' for k, v in isolation.items()), flush=True)
  row = ctx.progress.row(stage.name)
  if stage.ROW and stage.evaluate and row is None:
    if params is None:
      params = ctx.policies.params_of(ctx.policies.source_after(stage.index))
    # An inserted repair stage trains on the domains it repairs and its stage's own.
    trains_on = (list(info['teachers']) if info.get('inserted')
                 else stage.domains if stage.trains_policy else [])
    row = evaluate_row(ctx, stage.name, stage.index, trains_on, params,
                       hf=info.get('hf', ''), reporter=reporter, inserted=info.get('inserted'))
  ctx.progress.mark_done(stage.name, info)
  if ctx.progress.ledger:
    # A checkpoint kept as a domain's best that this stage's row (or steps) beat goes now.
    ctx.before_write()
    ctx.policies.rotate([st.name for st in ctx.plan.stages[:stage.index]
                         if st.name in ctx.progress.done])
  _write_results(ctx, domains)
  rows = ctx.progress.rows
  prev = rows[rows.index(row) - 1]['scores'] if row is not None and rows.index(row) else None
  if checkpoint.is_writer():
    print(metrics.summary_line(stage, result.steps_run, result.seconds, result.first,
                               result.last, row['scores'] if row else None, prev), flush=True)
    if cache is not None:
      print(f'[{stage.index}] {stage.name}: compilation cache: {cache.since(mark).describe()}',
            flush=True)
  reporter.stage_ended(stage, result.steps_run, time.perf_counter() - t0,
                       report_lib.steady_step_s(result.first, result.info.get('accounting')))
