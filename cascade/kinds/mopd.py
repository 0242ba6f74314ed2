"""Kind 'mopd': multi-domain on-policy distillation from per-domain teachers (Cascade 2).

  dict(name='mopd', kind='mopd', domains=['math', 'code'], teachers='best', steps=50,
       optimizer=dict(lr=2e-6), prompts_per_step=128, group_size=4, ...)

The student samples its own completions; each row is routed to its domain's
teacher, and the per-token advantage is log pi_teacher(y_t) - log
pi_student(y_t) with a truncated importance weight (`rl.distill`).
`teachers='best'` picks, per domain, the checkpoint of the run with the best
validation score so far (ties: the earliest) from the run's validation ledger
(`cascade.ledger`): the earlier stages' ends and, where `eval.eval_every`
scores them, their intermediate checkpoints (kept while they are a domain's
best), as the Cascade 2 paper takes its teachers. It needs each domain's
`validation` set (disjoint from the held-out set the matrix reports: choosing
on the reported numbers would be selecting on the test); a mapping names a
stage or a checkpoint path per domain. The choice is printed and recorded in
progress.json and results.json ("teachers": stage, step, validation score and
its standard error per domain). `teachers_on_host=True` keeps the teachers in pinned host
memory and brings each onto the devices only for its forward pass (one
teacher's weights on the devices at a time instead of all of them beside the
training state; a host-to-device copy of each teacher per step). Rollout,
curriculum and filtering fields: `cascade.kinds.rl` (dynamic filtering is
off by default: every prompt carries signal here).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from cascade import guard as guard_lib
from cascade import ledger as ledger_lib
from cascade import verifier_errors
from cascade.data import readers
from cascade.kinds import base
from cascade.kinds import loop
from cascade.kinds import rl
from rl import batch as batch_lib
from rl import distill
from rl import train_step as train_lib

INIT_ROW = base.INIT_ROW


def _teachers_ok(v) -> bool:
  return v == 'best' or isinstance(v, Mapping) or hasattr(v, 'to_dict')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(rl.RLStageConfig):
  dynamic_filter: bool = base.field(False, check=base.BOOL)
  teachers: Any = base.field('best', check=(
      _teachers_ok, "must be 'best' or a mapping domain -> stage name or path"))
  teachers_on_host: bool = base.field(False, check=base.BOOL)
  # The stage this one repairs (config.guard's action='repair' inserts it; '' = none): it runs
  # only where a guard probe of that stage crossed its bound, on the domains that fell (each
  # taught by its best validation checkpoint in the ledger) and that stage's own (taught by its
  # final policy), and ends once every one of them is back within bounds (`cascade.guard`).
  repairs: str = base.field('', check=((lambda v: isinstance(v, str)), 'must be a stage name'))

  def resolve(self, refs, fail):
    out = super().resolve(refs, fail)
    teachers = self.teachers
    own = ()
    if self.repairs:
      src = refs.stage(self.repairs)
      if src is None or not src.trains_policy:
        fail('repairs', 'must name an earlier stage that trains the policy')
      if teachers != 'best':
        fail('teachers', "a repair stage's teachers are the ledger's ('best')")
      own = src.domains
    if teachers == 'best':
      if not any(s.ROW and s.evaluate for s in refs.earlier):
        fail('teachers', "'best' needs an earlier evaluated policy stage to choose from")
      missing = [d for d in self.domains if not refs.domains[d].validation and d not in own]
      if missing:
        fail('teachers', f"'best' chooses on validation scores, and domain {missing[0]!r} has "
                         f'no validation set (config.domains.{missing[0]}.validation: a '
                         'prompt dataset disjoint from its eval set)')
      return out
    teachers = dict(teachers)
    for d in self.domains:
      if d not in teachers:
        fail('teachers', f'no teacher for domain {d!r}')
    for d, ref in teachers.items():
      if d not in self.domains:
        fail('teachers', f"domain {d!r} is not one of this stage's domains {list(self.domains)}")
      if not isinstance(ref, str) or not ref:
        fail('teachers', f'teacher of {d!r} must be a stage name or a path')
      if not base.looks_like_path(ref):
        src = refs.stage(ref)
        if src is None:
          fail('teachers', f'teacher {ref!r} of {d!r} names no earlier stage')
        if not src.trains_policy:
          fail('teachers', f'teacher {ref!r} of {d!r} is a {src.kind} stage, not a trained policy')
    return dataclasses.replace(out, teachers=teachers)


LOSS = train_lib.LossSpec(distill.MopdConfig, distill.loss_fn, distill.normalizers)


def loss(stage: Config):
  return LOSS, distill.MopdConfig(replay_routing=stage.routing_replay != 'measure')


def abstract_batch(stage: Config, mesh, rules):
  return rl.abstract_batch(stage, mesh, rules, teacher_index=('row', jnp.int32),
                           teacher_logprobs=('token', jnp.float32))


def choose_teachers(ctx, stage: Config, records: dict | None = None,
                    domains=None) -> dict[str, tuple[tuple, str]]:
  """domain -> (policy source, why) for each of the stage's domains (or of `domains`);
  `records` (when given) receives domain -> what results.json says of the teacher
  (`cascade.ledger.teacher_record`, or the stage or path a mapping named). A repair stage's
  own domains (those of the stage it repairs) are taught by that stage's final policy."""
  pol, plan = ctx.policies, ctx.plan
  ledger = getattr(ctx, 'ledger', None) or ledger_lib.Ledger(ctx.progress)
  entries = ledger.entries(ledger_lib.VALIDATION)
  chosen, records = {}, {} if records is None else records
  repaired = plan.stage(stage.repairs) if stage.repairs else None
  for d in (stage.domains if domains is None else domains):
    ref = stage.teachers if stage.teachers == 'best' else stage.teachers[d]
    if repaired is not None and d in repaired.domains:
      chosen[d] = (pol.source_after(repaired.index), f'the policy {repaired.name} left')
      records[d] = {'stage': repaired.name, 'step': repaired.steps, 'final': True}
      continue
    if ref == 'best':
      best = ledger.best(d, before=stage.index, entries=entries)
      if best is None:
        raise base.StageError(f'{stage.where}: no earlier policy has a validation score of '
                              f'{d!r} to pick its teacher from')
      score = f'{best["scores"][d]:.1f}'
      if best['stderr'].get(d) is not None:
        score += f' ± {best["stderr"][d]:.1f}'
      if best.get('final'):
        src = (('initial',) if best['stage'] == INIT_ROW
               else pol.source_after(plan.stage(best['stage']).index))
        why = f'best {d} validation score {score} after {best["stage"]}'
      else:
        src = ('ckpt', best['stage'], best['step'])
        why = (f'best {d} validation score {score} at {best["stage"]} step {best["step"]}/'
               f'{plan.stage(best["stage"]).steps}')
      records[d] = ledger_lib.teacher_record(best, d)
    elif base.looks_like_path(ref):
      src, why = ('hf', ref), 'explicit path'
      records[d] = {'path': ref}
    else:
      src, why = pol.source_after(plan.stage(ref).index), f'explicit stage {ref}'
      records[d] = {'stage': ref}
    chosen[d] = (src, why)
  return chosen


def _only_domains(records, domains):
  """A stage's records (a `data.Stream`, or a list) of `domains` only."""
  if not isinstance(records, readers.Stream):
    return [r for r in records if r['domain'] in domains]
  keep = records.keep

  def only(i, item):
    item = item if keep is None else keep(i, item)
    return item if item is not None and item['domain'] in domains else None
  why = f'records of domains other than {", ".join(sorted(domains))} (nothing to repair there)'
  return dataclasses.replace(records, keep=only, why='; '.join(filter(None, [records.why, why])))


def run(ctx, stage: Config) -> base.StageResult:
  records = ctx.data.stage_records(stage)
  picked: dict[str, dict] = {}
  domains, inserted = stage.domains, None
  if stage.repairs:
    ledger = getattr(ctx, 'ledger', None) or ledger_lib.Ledger(ctx.progress)
    fell = guard_lib.fallen(ledger, stage.repairs)
    if not fell:
      print(f'[{stage.index}] {stage.name}: skipped: no protected domain is past its bound '
            f'after {stage.repairs}', flush=True)
      return base.StageResult(info={'skipped': f'nothing to repair after {stage.repairs}'})
    own = ctx.plan.stage(stage.repairs).domains
    domains = tuple(d for d in stage.domains if d in fell or d in own)
    records = _only_domains(records, domains)
    inserted = {'repairs': stage.repairs,
                'drops': {d: b['drop'] for d, b in sorted(fell.items())}}
    print(f'[{stage.index}] {stage.name}: repairing ' + ', '.join(
        f'{d} (fell {b["drop"]:.1f} points, bound {b["bound"]:.1f})'
        for d, b in sorted(fell.items())) + f' after {stage.repairs}', flush=True)
  chosen = choose_teachers(ctx, stage, picked, domains)
  sources = sorted({src for src, _ in chosen.values()})
  teachers = [ctx.policies.compute_copy(ctx.policies.params_of(s, keep=False))
              for s in sources]
  if stage.teachers_on_host:
    teachers = [distill.to_memory(t, 'pinned_host') for t in teachers]
  teacher_of_domain = np.full(len(ctx.domain_index), -1, np.int32)
  for d, (src, why) in chosen.items():
    teacher_of_domain[ctx.domain_index[d]] = sources.index(src)
    print(f'[{stage.index}] {stage.name}: teacher for {d}: {src} ({why})', flush=True)
  graphdef = ctx.policies.graphdef('policy')
  [teacher_pass] = frozen_forwards(stage)      # what launch.plan compiles, as run here

  def maker(state):
    del state
    loader = readers.Loader(records, base.stage_seed(ctx.plan.seed, stage.seeds_from),
                             stage.prompts_per_step)
    own_errors = verifier_errors.VerifierErrors(stage.where)   # over the stage's steps

    def make(step, rng, state):
      draws = rl.Draws(ctx, stage, loader, step, rng, state.params, own_errors)
      rows, _, valid, fill = draws.collect()
      valid = rl.loss_valid(stage, step, rows, valid)
      idx = teacher_of_domain[rows['domain']]
      batch = batch_lib.from_samples(rows['samples'], np.zeros(idx.shape, np.float32),
                                     valid=valid, teacher_index=idx)
      lp = distill.teacher_logprobs(graphdef, teachers, idx, batch, mesh=ctx.mesh,
                                    rules=ctx.rules, rows_per_call=teacher_pass.rows)
      batch = batch._replace(teacher_logprobs=lp)
      return rl.split_updates(stage, step, ctx.plan.seed, batch), {
          **draws.metrics(), **fill, **rl.update_accounting(batch)}
    return loop.BatchMaker(loader, make)

  result = loop.train_stage(ctx, KIND, stage, maker)
  return result._replace(info={**result.info,
                               'teachers': {d: list(src) for d, (src, _) in chosen.items()},
                               'teacher_checkpoints': picked,
                               **({'inserted': inserted} if inserted else {})})


def frozen_forwards(stage: Config) -> list:
  # One teacher per distinct source; 'best' may pick a different stage for every domain.
  copies = (len(stage.domains) if stage.teachers == 'best'
            else len(set(stage.teachers.values())))
  rows = stage.prompts_per_step * stage.group_size
  return [base.FrozenForward('teacher forward', base.frozen_rows_per_call(rows, stage.microbatches),
                             stage.max_prompt_len + stage.longest_response, copies,
                             calls=stage.microbatches, on_host=stage.teachers_on_host)]


KIND = base.Kind('mopd', Config, run, loss=loss, abstract_batch=abstract_batch,
                 sampler_sizes=rl.sampler_sizes, frozen_forwards=frozen_forwards)
