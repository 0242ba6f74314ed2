"""The two expert dispatches compared (`python -m launch.plan --compare_dispatch`).

`ModelConfig.moe_dispatch` says how expert parallelism brings a routed token to its experts
(models/moe.py): 'gather' all-gathers the expert group's tokens to every expert shard and
reduce-scatters the outputs; 'all_to_all' sends each token only to the shards of its experts
and back (ragged all-to-all under shard_map on TPU/GPU). They compute the same thing; what
differs is the bytes the compiled programs move and the memory they hold. `compare` compiles
each selected stage's train step and sampler calls (the frozen passes, reward-model scoring and
judges left out: the same for both) once per dispatch, prices their collectives on the
target's interconnect (`collectives.priced`) and puts them into the stage's step-time bound
(`step_time.with_collectives`). Everything but the collectives is the same for both (FLOPs and
reads are counted from the config), so the serial bound orders them by collective seconds.

A dispatch is *eligible* for a stage when every compared program fits with `HEADROOM` of the
per-device memory to spare (its co-resident peak, `StageReport.peak`); the *cheaper* one is the
eligible one with the lower serial bound (collectives added, not hidden), the config's current
dispatch on a tie. `choose` does the same over the stages, weighting each by its steps.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from cascade import config as config_lib
from launch.plan import collectives
from launch.plan import results
from launch.plan import stages as stages_lib
from launch.plan import targets
from models import config as model_config
from models import sharding

# The share of per-device memory a recipe keeps free (v5p: 9.5 of 95 GiB).
HEADROOM = 0.10


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One stage planned with each dispatch: `reports[dispatch]` (`StageReport`)."""
  stage: str
  steps: int
  reports: Mapping[str, results.StageReport]


def expert_shards(model_cfg, mesh, rules) -> int:
  """How many shards the routed experts are split over on `mesh` (0 for a model without
  experts)."""
  if not model_cfg.num_experts:
    return 0
  return sharding.split_ways(model_cfg.num_experts, 'experts', mesh, rules)


def fits_with_headroom(report: results.StageReport, headroom: float = HEADROOM) -> bool:
  """Every program compiled and its co-resident peak within (1 - headroom) of the limit."""
  if any(p.error for p in report.programs):
    return False
  limit = report.limit_bytes
  return not limit or all(report.peak(p) <= (1 - headroom) * limit for p in report.programs)


def stage_seconds(report: results.StageReport) -> float:
  """The serial step-time bound (collectives added), or the collectives' seconds alone where
  the hardware gives no peak."""
  if report.time is not None:
    return report.time.serial
  return sum(p.collective_s for p in report.programs)


def cheaper(reports: Mapping[str, results.StageReport], current: str,
            headroom: float = HEADROOM) -> str | None:
  """The eligible dispatch with the lower `stage_seconds` (`current` on a tie), or None when
  neither fits with the headroom."""
  ok = {d: r for d, r in reports.items() if fits_with_headroom(r, headroom)}
  if not ok:
    return None
  return min(ok, key=lambda d: (stage_seconds(ok[d]), d != current))


def choose(comparisons: Sequence[Comparison], current: str,
           headroom: float = HEADROOM) -> str | None:
  """The dispatch for the whole config: eligible in every compared stage, the fewest seconds
  over the stages (each stage's serial bound times its steps; `current` on a tie), or None when
  no dispatch is eligible everywhere."""
  dispatches = set.intersection(*(set(c.reports) for c in comparisons)) if comparisons else set()
  ok = [d for d in sorted(dispatches)
        if all(fits_with_headroom(c.reports[d], headroom) for c in comparisons)]
  if not ok:
    return None
  total = lambda d: sum(stage_seconds(c.reports[d]) * max(c.steps, 1) for c in comparisons)
  return min(ok, key=lambda d: (total(d), d != current))


def compare(plan: config_lib.Plan, tgt: targets.Target, *, stages: Sequence[str] = (),
            with_sampler: bool = True, with_train: bool = True,
            report: Callable[[Comparison], None] | None = None) -> list[Comparison]:
  """Each selected stage's train step and sampler calls compiled with every dispatch
  (`model_config.MOE_DISPATCH`) on `tgt`: one Comparison per stage that has such a program.

  Raises:
    ValueError: the policy has no routed experts, or they are not split over several shards
      (both dispatches are then the same program).
  """
  model_cfg, rules, sampler_cfg = targets.for_target(plan, tgt)
  mesh = targets.make_mesh(plan, tgt.devices)
  shards = expert_shards(model_cfg, mesh, rules)
  if shards <= 1:
    raise ValueError(
        f'--compare_dispatch: model {model_cfg.family!r} has '
        + (f'{model_cfg.num_experts} experts on 1 expert shard of mesh {tuple(mesh.shape.values())}'
           if model_cfg.num_experts else 'no routed experts')
        + ': both dispatches compile to the same program')
  count_mesh = targets.make_mesh(plan, tgt.count_devices) if tgt.count_devices else mesh
  stages_lib.check_stages(plan, stages)
  out = []
  for st in plan.stages:
    if (stages and st.name not in stages) or st.MODEL is None:
      continue
    reports = {}
    for d in model_config.MOE_DISPATCH:
      cfg = dataclasses.replace(model_cfg, moe_dispatch=d)
      reports[d] = stages_lib.plan_stage(
          st, cfg, mesh, rules, sampler_cfg, tgt.device_memory_bytes, with_sampler, count_mesh,
          with_train, rm_stages=stages_lib.scoring_rm_stages(plan, st), hardware=plan.hardware,
          judge_programs=False, with_frozen=False)
    if not any(r.programs for r in reports.values()):
      continue
    out.append(Comparison(st.name, getattr(st, 'steps', 0), reports))
    if report:
      report(out[-1])
  return out


def _gib(n: float) -> str:
  return f'{n / results.GIB:.2f}'


def _secs(x: float) -> str:
  return f'{x:.3g}' if x else '0'


def table(comparisons: Sequence[Comparison], current: str,
          headroom: float = HEADROOM) -> list[str]:
  """Markdown rows: per stage, program and dispatch the co-resident peak per device and its
  share of the limit, the bytes its collectives send per device (per call; per iteration of a
  decode loop) and their seconds; per stage the step-time bound (overlapped, serial) and the
  cheaper dispatch."""
  lines = ['| stage | program | dispatch | peak per device (GiB) | of limit | collective bytes '
           'per call (per loop iteration) | collective s per call (per loop iteration) |',
           '|---|---|---|---:|---:|---:|---:|']
  for c in comparisons:
    names = list(dict.fromkeys(p.name for r in c.reports.values() for p in r.programs))
    for name in names:
      for d, r in c.reports.items():
        p = next((p for p in r.programs if p.name == name), None)
        if p is None:
          continue
        if p.error:
          lines.append(f'| {c.stage} | {name} | {d} | does not compile | | | |')
          continue
        share = f'{100 * r.peak(p) / r.limit_bytes:.0f} %' if r.limit_bytes else ''
        lines.append(
            f'| {c.stage} | {name} | {d} | {_gib(r.peak(p))} | {share} | '
            f'{results.size_text(int(collectives.moved_bytes(p.collectives)))} '
            f'({results.size_text(int(collectives.moved_bytes(p.collectives, True)))}) | '
            f'{_secs(p.collective_s)} ({_secs(p.collective_step_s)}) |')
  lines += ['', '| stage | steps | dispatch | fits with '
            f'{100 * headroom:.0f} % free | collectives (s / step) | bound (s / step) | '
            'serial bound (s / step) | cheaper |', '|---|---:|---|---|---:|---:|---:|---|']
  for c in comparisons:
    best = cheaper(c.reports, current, headroom)
    for d, r in c.reports.items():
      t = r.time
      lines.append(
          f'| {c.stage} | {c.steps} | {d} | {"yes" if fits_with_headroom(r, headroom) else "no"} '
          f'| {_secs(t.collective) if t else "-"} | {_secs(t.bound) if t else "-"} | '
          f'{_secs(stage_seconds(r))} | {"**yes**" if d == best else ""} |')
  return lines


def summary(comparisons: Sequence[Comparison], current: str,
            headroom: float = HEADROOM) -> str:
  """One line: the dispatch `choose` picks for the config, against the current one."""
  best = choose(comparisons, current, headroom)
  if best is None:
    return (f'no dispatch fits every compared stage with {100 * headroom:.0f} % of memory '
            'free')
  totals = {d: sum(stage_seconds(c.reports[d]) * max(c.steps, 1) for c in comparisons)
            for d in comparisons[0].reports} if comparisons else {}
  said = ', '.join(f'{d} {s / 3600:,.1f} h' for d, s in totals.items())
  return (f'cheaper dispatch over the compared stages: {best} (serial bound x steps: {said}; '
          f'the config has {current})')
