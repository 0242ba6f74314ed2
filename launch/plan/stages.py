"""A stage's plan (`plan_stage`: its programs compiled, their fit with what stays resident, its
step-time bound) and the plan of a whole config on a target (`run_plan`, `time_plan`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from cascade import config as config_lib
from cascade import kinds
from cascade import policies
from launch.plan import collectives
from launch.plan import compiler
from launch.plan import evaluation
from launch.plan import flops as flops_lib
from launch.plan import judges as judges_lib
from launch.plan import memory
from launch.plan import programs as programs_lib
from launch.plan import results
from launch.plan import step_time as step_time_lib
from launch.plan import targets
from rl import reward_model


def plan_stage(stage, model_cfg, mesh, rules, sampler_cfg: dict,
               limit_bytes: int, with_sampler: bool = True, count_mesh=None,
               with_train: bool = True, rm_stages=(), hardware=None, judges=(),
               loaded=None, judge_programs: bool = True,
               with_frozen: bool = True) -> results.StageReport:
  """Compiles a training stage's train step (and, for RL, its sampler) for `mesh`.

  Args:
    stage: the resolved stage.
    model_cfg: the policy's ModelConfig.
    mesh: the target mesh.
    rules: logical sharding rules.
    sampler_cfg: config.sampler (bucket sizes).
    limit_bytes: per-device memory limit (0 = none).
    with_sampler: compile an RL stage's sampler too.
    count_mesh: a mesh of the same shape whose backend counts FLOPs on lowered
      programs (the TPU topology's does not; CPU devices do); default `mesh`.
    with_train: compile the train step.
    rm_stages: reward_model stages whose models score this stage's rollouts.
    hardware: config.hardware (peak_tflops, hbm_gbps for the time bound).
    judges: the judge models its training verifiers call (`judges.judge_calls`): their programs are
      compiled and their scoring is in the time bound.
    loaded: {source: (ModelConfig, generates)}: the judges resident while it runs
      (`judges.loaded_judges`), counted beside every program.
    judge_programs: compile the judges' programs (else `judges` count in the time bound only).
    with_frozen: compile the frozen passes (a KL/DPO reference, MOPD teachers) and the reward
      models' scoring too (else they count only in what stays resident and in the time bound's
      FLOPs, not its collectives).

  Returns:
    The StageReport.
  """
  count_mesh = mesh if count_mesh is None else count_mesh
  programs = []
  kind = kinds.get(stage.kind)
  # XLA counts a loop body once: FLOPs are counted on a twin lowered (never
  # compiled) with the layers unrolled and the batch in one microbatch. The
  # mixture-of-experts families' are counted from the config instead (`flops.counted_flops`).
  unrolled = dataclasses.replace(model_cfg, scan_layers=False)

  def add(name: str, lowering: Callable[..., Any], *args, suffix: str = '', twin_kwargs=None,
          count: Callable[[], tuple[float, str]] | None = None, options=None):
    """lowering(model_cfg, mesh, *args) -> (() -> Lowered, shapes); count() -> (FLOPs, how);
    options: compiler options (default `compiler.compiler_options(mesh)`)."""
    lower, what = lowering(model_cfg, mesh, *args)
    options = compiler.compiler_options(mesh) if options is None else options
    if model_cfg.flops_from_config:
      flops, how = count()
      programs.append(compiler.compile_program(name, what + suffix, lower, flops=flops,
                                               flops_from=how, limit_bytes=limit_bytes,
                                               compiler_options=options))
      return
    twin = lowering(unrolled, count_mesh, *args, **(twin_kwargs or {}))[0]
    programs.append(compiler.compile_program(name, what + suffix, lower, twin,
                                             limit_bytes=limit_bytes, compiler_options=options))

  if with_train and kind.abstract_batch is not None:
    add('train step', lambda cfg, m, **k: programs_lib.train_lowering(stage, cfg, m, rules, **k),
        twin_kwargs={'microbatches': 1},
        count=lambda: (flops_lib.train_flops(stage, model_cfg, mesh, rules), flops_lib.COUNTED))
  sizes = (kind.sampler_sizes(stage) if with_sampler and kind.sampler_sizes is not None
           else None)
  if sizes is not None:
    for program, name in programs_lib.sampler_programs(sampler_cfg):
      add(name, lambda cfg, m, program=program: programs_lib.sampler_lowering(
          cfg, m, rules, sampler_cfg, **sizes, program=program,
          record_routing=getattr(stage, 'records_routing', False)),
          count=lambda: flops_lib.sampler_flops(model_cfg, mesh, rules, sampler_cfg, **sizes),
          options=compiler.sampling_options(mesh))
  frozen = kind.frozen_forwards(stage) if kind.frozen_forwards is not None else []
  for ff in (frozen if with_frozen else ()):
    copies = f'cop{"y" if ff.copies == 1 else "ies"}'
    add(ff.name, lambda cfg, m, ff=ff: programs_lib.forward_lowering(cfg, 'policy', m, rules,
                                                                     ff.rows, ff.length),
        suffix=(f' per call, {ff.calls} calls' if ff.calls > 1 else '')
        + (f'; {ff.copies} {copies} in host memory' if ff.on_host
           else f'; {ff.copies} resident {copies}'),
        count=lambda ff=ff: flops_lib.forward_flops(model_cfg, 'policy', mesh, rules, ff.rows,
                                                    ff.length))
  rm = list(rm_stages or ())
  for rm_stage in (rm if with_frozen else ()):
    rows, length = rm_scoring_call(stage, rm_stage)
    add(f'reward model scoring ({rm_stage.name})',
        lambda cfg, m, rows=rows, length=length: programs_lib.forward_lowering(
            cfg, 'reward_model', m, rules, rows, length),
        count=lambda rows=rows, length=length: flops_lib.forward_flops(
            model_cfg, 'reward_model', mesh, rules, rows, length))
  if judge_programs:
    programs += judges_lib.judge_programs(judges, mesh, rules, sampler_cfg, limit_bytes,
                                          model_cfg)
  hardware = hardware or config_lib.Hardware()
  programs = list(collectives.priced(programs, mesh, hardware))
  copy, sampler = 0, None
  if sizes is not None:
    sampler, given = programs_lib.sampler_for(model_cfg, mesh, rules, sampler_cfg)
    copy = memory.rollout_copy_bytes(sampler, given)
  resident = memory.resident(stage, model_cfg, mesh, rules, programs, frozen, rm,
                             rollout_copy=copy > 0, judges=judges, loaded=loaded,
                             sampler_cfg=sampler_cfg, copy_bytes=copy)
  time = step_time_lib.step_time(stage, kind, model_cfg, mesh, rules, hardware, sampler_cfg,
                                 rm_stages=rm, judges=judges)
  time = step_time_lib.with_collectives(time, programs, stage, kind, sampler)
  return results.StageReport(stage.index, stage.name, stage.kind, tuple(programs), limit_bytes,
                             mesh.size, resident=resident, time=time,
                             steps=getattr(stage, 'steps', 0))


def rm_scoring_call(stage, rm_stage) -> tuple[int, int]:
  """(rows, padded length) of the largest call in which `rm_stage`'s reward model scores
  `stage`'s rollouts: their longest row (prompt, response and EOS, cut to its score_max_len)
  in its length bucket, as many rows as `cascade.policies.scoring_call_tokens` allows."""
  length = reward_model.row_length(stage.max_prompt_len + stage.longest_response + 1,
                                   rm_stage.score_len)
  return (reward_model.rows_per_call(length, rm_stage.batch_size,
                                     policies.scoring_call_tokens(rm_stage)), length)


def scoring_rm_stages(plan, stage) -> list:
  """The reward_model stages whose models score a sampling stage's rollouts."""
  import verifiers  # pylint: disable=g-import-not-at-top
  if not stage.SAMPLES:
    return []
  names = []
  for d in stage.domains:
    dom = plan.domains[d]
    if dom.reward_model_stage and verifiers.cls(dom.verifier).reward_model_option:
      names.append(dom.reward_model_stage)
  return [plan.stage(n) for n in dict.fromkeys(names)]


def check_stages(plan: config_lib.Plan, stages: Sequence[str]) -> None:
  unknown = [s for s in stages if s not in [st.name for st in plan.stages]]
  if unknown:
    raise ValueError(f'--stages: unknown stage(s) {unknown}; the config has '
                     f'{[st.name for st in plan.stages]}')


def time_plan(plan: config_lib.Plan, tgt: targets.Target, *, stages: Sequence[str] = (),
              report: Callable[[results.StageReport], None] | None = None
              ) -> list[results.StageReport]:
  """Every selected training stage's step-time bound (`step_time.step_time`), compiling
  nothing: the FLOP and byte counts come from the config, the sampler's traced (not compiled)
  programs and abstract shapes. Each StageReport has no programs."""
  model_cfg, rules, sampler_cfg = targets.for_target(plan, tgt)
  mesh = targets.make_mesh(plan, tgt.devices)
  check_stages(plan, stages)
  out = []
  for st in plan.stages:
    if (stages and st.name not in stages) or st.MODEL is None:
      continue
    model_for = lambda c: targets.target_model(plan, tgt, c)
    time = step_time_lib.step_time(st, kinds.get(st.kind), model_cfg, mesh, rules, plan.hardware,
                                   sampler_cfg, rm_stages=scoring_rm_stages(plan, st),
                                   judges=judges_lib.judge_calls(plan, st, model_for))
    out.append(results.StageReport(st.index, st.name, st.kind, (), tgt.device_memory_bytes,
                                   mesh.size, time=time, steps=getattr(st, 'steps', 0)))
    if report:
      report(out[-1])
  return out


def collective_plan(plan: config_lib.Plan, tgt: targets.Target, *, stages: Sequence[str] = (),
                    report: Callable[[results.StageReport], None] | None = None
                    ) -> list[results.StageReport]:
  """Every selected training stage's step-time bound (`time_plan`'s) with the collectives of
  its compiled programs (`step_time.with_collectives`): the train step, the sampler's calls, the
  frozen passes and reward-model scoring, compiled for `tgt` without a memory limit (a program
  two stages share is compiled once); the judges' programs and the evaluation are not
  compiled."""
  model_cfg, rules, sampler_cfg = targets.for_target(plan, tgt)
  mesh = targets.make_mesh(plan, tgt.devices)
  count_mesh = targets.make_mesh(plan, tgt.count_devices) if tgt.count_devices else mesh
  check_stages(plan, stages)
  out = []
  for st in plan.stages:
    if (stages and st.name not in stages) or st.MODEL is None:
      continue
    model_for = lambda c: targets.target_model(plan, tgt, c)
    out.append(plan_stage(st, model_cfg, mesh, rules, sampler_cfg, 0, True, count_mesh,
                          rm_stages=scoring_rm_stages(plan, st), hardware=plan.hardware,
                          judges=judges_lib.judge_calls(plan, st, model_for),
                          judge_programs=False))
    if report:
      report(out[-1])
  return out


def run_plan(plan: config_lib.Plan, tgt: targets.Target, *, stages: Sequence[str] = (),
             with_sampler: bool = True, with_eval: bool = True, with_train: bool = True,
             report: Callable[[results.StageReport], None] | None = None
             ) -> list[results.StageReport]:
  """Compiles every selected stage for the config's mesh on `tgt`'s devices.

  Args:
    plan: the validated config (`cascade.config.validate`).
    tgt: from `targets.target`.
    stages: stage names to plan (default: every training stage).
    with_sampler: compile RL stages' samplers too.
    with_eval: compile the evaluation's sampler too.
    with_train: compile the train steps.
    report: called with each StageReport as soon as it is ready.

  Returns:
    One StageReport per planned stage (and 'evaluation' last).
  """
  model_cfg, rules, sampler_cfg = targets.for_target(plan, tgt)
  hw = plan.hardware
  mesh = targets.make_mesh(plan, tgt.devices)
  count_mesh = targets.make_mesh(plan, tgt.count_devices) if tgt.count_devices else mesh
  check_stages(plan, stages)
  out = []
  for st in plan.stages:
    if stages and st.name not in stages:
      continue
    model_for = lambda c: targets.target_model(plan, tgt, c)
    rep = plan_stage(st, model_cfg, mesh, rules, sampler_cfg, tgt.device_memory_bytes,
                     with_sampler, count_mesh, with_train, rm_stages=scoring_rm_stages(plan, st),
                     hardware=hw, judges=judges_lib.judge_calls(plan, st, model_for) if with_sampler
                     else (), loaded=judges_lib.loaded_judges(plan, st.index, model_for))
    if not rep.programs:         # e.g. an SFT stage with --notrain
      continue
    out.append(rep)
    if report:
      report(rep)
  if with_eval:
    out.append(evaluation.plan_eval(plan, model_cfg, mesh, rules, sampler_cfg,
                                    tgt.device_memory_bytes, count_mesh,
                                    model_for=lambda c: targets.target_model(plan, tgt, c)))
    if report:
      report(out[-1])
  return out
