"""The plan in words: each stage's block as printed, the step-time table, the header lines, the
Markdown page `--report` writes, and the failures that make the command exit 1."""

from __future__ import annotations

import os
import platform
from typing import Sequence

from cascade import config as config_lib
from launch.plan import collectives as collectives_lib
from launch.plan import compiler
from launch.plan import flops as flops_lib
from launch.plan import results
from launch.plan import step_time as step_time_lib
from launch.plan import targets
from models import sharding


def format_stage(r: results.StageReport) -> str:
  """A stage's block of the printed plan."""
  head = f'[{r.index}] {r.name} ({r.kind})' if r.index >= 0 else f'{r.name}'
  lines = [head]
  for p in r.programs:
    lines.append(f'  {p.name}: {p.shapes}')
    if p.error:
      lines.append(f'    DOES NOT COMPILE: {p.error} (after {p.compile_s:.1f} s, '
                   f'{p.compile_cpu_s:.1f} s of CPU)')
      continue
    peak = r.peak(p)
    status = 'fits' if r.fits_program(p) else 'DOES NOT FIT'
    if r.limit_bytes:
      status += f' ({peak / r.limit_bytes:.0%} of {r.limit_bytes / results.GIB:.0f} GiB)'
    size = results.size_text
    lines.append(f'    per device: arguments {size(p.argument_bytes)}, outputs '
                 f'{size(p.output_bytes)}, temporaries {size(p.temp_bytes)}, aliased '
                 f'{size(p.alias_bytes)}; total {size(p.total_bytes)}'
                 + (f' + resident beside it {size(peak - p.total_bytes)} = '
                    f'{size(peak)}' if peak != p.total_bytes else '') + f': {status}')
    for a in p.largest:
      lines.append(f'    largest array: {a}')
    sampler = p.name.split(' (')[0] in ('sampler', 'eval sampler', 'suite sampler')
    per = ('per step' if p.name == 'train step' else
           'for one decode step' if p.shapes.startswith('paged engine:') else
           'per call (its prefill and every decode step)' if sampler and p.flops_from else
           'for the prefill and one decode step per decode phase' if sampler else 'per call')
    if p.flops_from and not p.flops:
      flops = f'FLOPs {p.flops_from}'
    else:
      flops = (f'FLOPs {per}' + (f' ({p.flops_from})' if p.flops_from else '')
               + f': {p.flops:.3e} in all, {p.flops / r.num_devices:.3e} per device')
    lines.append(f'    {flops}; compiled in {p.compile_s:.1f} s ({p.compile_cpu_s:.1f} s of '
                 'CPU)')
    if p.collectives:
      lines.append(f'    {collective_text(p)}')
  if r.time is not None:
    lines += ['  ' + line for line in time_lines(r)]
  return '\n'.join(lines)


def collective_text(p: results.ProgramReport) -> str:
  """A program's collectives in words: per device, the ring algorithm's bytes by kind per call
  and per iteration of its decode loop (a loop of unknown trip count), and their seconds."""
  size = lambda b: results.size_text(int(b))
  once = [c for c in p.collectives if not c.loop]
  looped = [c for c in p.collectives if c.loop]
  def kinds_text(found):
    counts: dict = {}
    for c in found:
      counts[c.kind] = counts.get(c.kind, 0) + c.count
    return ', '.join(f'{k} {size(b)} ({counts[k]}x)'
                     for k, b in sorted(collectives_lib.by_kind(found).items()))
  out = f'collectives per device per call: {kinds_text(once) or "none"}'
  if looped:
    out += (f'; per iteration of a loop the compiler cannot count (decode): '
            f'{kinds_text(looped)}')
  if p.collective_s or p.collective_step_s:
    out += f'; {_secs(p.collective_s)} per call' + (
        f' + {_secs(p.collective_step_s)} per decode step' if p.collective_step_s else '')
  return out


def _num(x: float) -> str:
  """3 significant digits, whole numbers from 100 up (1,234 rather than 1.23e+03)."""
  return f'{x:,.0f}' if abs(x) >= 100 else f'{x:.3g}'


def _secs(x: float) -> str:
  return f'{_num(x)} s'


def time_lines(r: results.StageReport) -> list[str]:
  """A stage's step-time bound in words: per step with its parts, the worst case of its
  rounds, and per stage in chip-hours beside the weights-only bound it replaces."""
  t = r.time
  parts = []
  if t.sampling:
    parts.append(f'sampling {_secs(t.sampling)} (weights {_secs(t.weights)}, KV cache '
                 f'{_secs(t.kv)}, Mamba state {_secs(t.state)}, compute beyond the reads '
                 f'{_secs(t.compute)}, prefill {_secs(t.prefill)}; {t.decode_steps} decode '
                 'steps)')
    parts.append('scoring ' + ('not estimated (verifiers on the hosts)' if t.scoring is None
                               else f'{_secs(t.scoring)} (reward model)'))
    if t.judge:
      parts.append(f'judge models {_secs(t.judge)}')
  parts.append(f'update {_secs(t.update)}')
  if t.frozen:
    parts.append(f'frozen passes {_secs(t.frozen)}')
  out = [f'step time bound: {_secs(t.bound)} per step = ' + ' + '.join(parts)]
  if t.collective:
    out.append(f'collectives {_secs(t.collective)} per step (sampling '
               f'{_secs(t.collective_sampling)}, update {_secs(t.collective_update)}, frozen '
               f'{_secs(t.collective_frozen)}, scoring {_secs(t.collective_scoring)}): overlapped '
               f'with each part (the bound) {_secs(t.bound)}, serial {_secs(t.serial)} per step')
  if t.rounds > 1:
    out.append(f'worst case, {t.rounds} sampling rounds (1 + refill_cap): {_secs(t.worst)} '
               'per step')
  out.append(f'{r.steps} steps = {_num(r.chip_hours(t.bound))} chip-hours'
             + (f' (worst case {_num(r.chip_hours(t.worst))})' if t.rounds > 1 else '')
             + f'; the weights-only bound it replaces: {_secs(t.weights_only)} per step, '
             f'{_num(r.chip_hours(t.weights_only))} chip-hours')
  return out


def time_table(reports: Sequence[results.StageReport], assumptions: bool = True) -> list[str]:
  """Markdown lines: one row per stage with a time bound (seconds per step by part, and per
  stage in chip-hours beside the weights-only bound it replaces), then (`assumptions`) what
  the bound assumes."""
  timed = [r for r in reports if r.time is not None]
  if not timed:
    return []
  g = _num
  out = ['| stage | steps | sampling: weights / KV / state / compute / prefill (s) | scoring (s) '
         '| update (s) | frozen (s) | collectives: sampling / update / frozen / scoring (s) '
         '| bound, collectives overlapped (s / step) | serial bound (s / step) | chip-hours '
         '(overlapped, serial) | worst case: rounds, chip-hours | weights-only bound (s / step, '
         'chip-hours) |',
         '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
  for r in timed:
    t = r.time
    sampling = (' / '.join(g(x) for x in (t.weights, t.kv, t.state, t.compute, t.prefill))
                if t.sampling else '')
    scoring = '' if not t.sampling else 'not estimated' if t.scoring is None else g(t.scoring)
    if t.judge:
      scoring = f'{scoring} + judge {g(t.judge)}' if t.scoring is not None else (
          f'judge {g(t.judge)}')
    coll = ('not compiled' if not r.programs else
            ' / '.join(g(x) for x in (t.collective_sampling, t.collective_update,
                                      t.collective_frozen, t.collective_scoring)))
    out.append(f'| {r.name} | {r.steps} | {sampling} | {scoring} | {g(t.update)} | '
               f'{g(t.frozen)} | {coll} | {g(t.bound)} | {g(t.serial)} | '
               f'{g(r.chip_hours(t.bound))}, {g(r.chip_hours(t.serial))} | {t.rounds}, '
               f'{g(r.chip_hours(t.worst))} | {g(t.weights_only)}, '
               f'{g(r.chip_hours(t.weights_only))} |')
  if assumptions:
    out += ['', 'The bound assumes:', '', *[f'- {a}' for a in step_time_lib.TIME_ASSUMPTIONS]]
  return out


def model_notes(model_cfg, tgt: targets.Target) -> list[str]:
  """Lines on what the plan's numbers mean for this model on this target (none where XLA
  counts its FLOPs)."""
  if not model_cfg.flops_from_config:
    return []
  out = [flops_lib.WHY_COUNTED]
  if not model_cfg.num_experts:
    return out
  if tgt.kind == 'tpu':
    out.append('routed experts: compiled with the megablox grouped-matmul kernel (Pallas, a '
               'real Mosaic kernel: models/moe.py chooses it by the mesh\'s platform).')
  elif tgt.kind == 'gpu':
    out.append("routed experts: compiled as models/moe.py's 'tiled' grouped matmul, chosen by "
               "the mesh's platform: tile loops (fori_loops in plain XLA, every row tile once "
               'per group with rows in it, forward and both gradients), where XLA:GPU would '
               'expand ragged_dot into dense [rows, experts, width] arrays.')
  else:
    out.append('routed experts: XLA:CPU turns each ragged_dot into a dense dot over '
               '[experts per shard, token-expert pairs, width] (XLA\'s generic '
               'RaggedDotRewriter); where they dominate, the largest arrays of a program '
               'that does not fit are listed.')
  return out


def markdown_report(reports: Sequence[results.StageReport], *, command: str, header: Sequence[str],
                    hosts: Sequence[str], date: str, failed: Sequence[str] = (),
                    finished: bool = True) -> str:
  """The plan as a Markdown page: how it was made (command, date, this host's CPUs and load
  before and after, which set the compile times), the header lines `cli.main` prints, one row per
  program (per-device peak beside what stays resident, its share of the device, compile time,
  FLOPs; none with --time_only) and each stage's step-time bound by part with the
  assumptions (`time_table`); `finished` False marks a page written part-way (after each
  stage), which says so instead of a result. `header` must hold the `target: ` line
  (`plan_header` writes it): a page always says which compiler made its numbers (the TPU
  compiler, XLA:GPU deviceless or XLA:CPU on simulated devices)."""
  if not any(h.startswith('target: ') for h in header):
    raise ValueError("markdown_report: the header has no 'target: ' line (plan_header writes "
                     'it): a plan page must say which compiler made its numbers')
  limit = next((r.limit_bytes for r in reports if r.limit_bytes), 0)
  cell = lambda text: text.replace('|', '\\|')        # a table cell's own bars, escaped
  out = [f'# Plan: `{command}`', '',
         f'Written by `launch.plan --report` on {date}, on {cpu_model()}.', '',
         *[f'- {h}' for h in (hosts[0] + ' (before)', hosts[-1] + ' (after)', *header)]]
  if any(r.programs for r in reports):
    out += ['', '| stage | program | shapes | per device | '
            + (f'of {results.size_text(limit)} | ' if limit else '') + 'compile (CPU) | FLOPs | '
            'collectives per device (ring bytes; seconds on the interconnect) |',
            '|---|---|---|---:|' + ('---:|' if limit else '') + '---:|---:|---|']
  for r in reports:
    for p in r.programs:
      if p.error:
        out.append(f'| {r.name} | {p.name} | {cell(p.shapes)} | DOES NOT COMPILE: '
                   f'{cell(p.error)} |' + (' |' if limit else '')
                   + f' {p.compile_s:.0f} s ({p.compile_cpu_s:.0f} s) | | |')
        continue
      peak = r.peak(p)
      share = (f' {100 * peak / r.limit_bytes:.0f} %' + ('' if r.fits_program(p) else
                                                         ' DOES NOT FIT') + ' |'
               if limit else '')
      flops = ('not counted' if p.flops_from and not p.flops else f'{p.flops:.3g}')
      out.append(f'| {r.name} | {p.name} | {cell(p.shapes)} | {results.size_text(peak)} |{share} '
                 f'{p.compile_s:.0f} s ({p.compile_cpu_s:.0f} s) | {flops} | '
                 f'{cell(collective_text(p)) if p.collectives else "none"} |')
  if any(r.time is not None for r in reports):
    out += ['', 'Step-time bound per stage (`launch.plan.step_time`; seconds per step by part, '
            'chip-hours per stage):', '', *time_table(reports)]
  if not finished:
    out += ['', f'Unfinished: the plan was still running (or was stopped) after '
            f'{len(reports)} stage(s); the rows above are the stages it had planned.']
  else:
    out += ['', 'Result: ' + ('PLAN FAILED: ' + '; '.join(failed) if failed else
                              'every planned program fits.' if any(r.programs for r in reports)
                              else 'step times only, nothing compiled.')]
  return '\n'.join(out) + '\n'


def failures(reports: Sequence[results.StageReport]) -> list[str]:
  """One message per stage that does not fit, naming the stage and the program."""
  out = []
  for r in reports:
    for p in r.programs:
      if r.fits_program(p):
        continue
      what = p.error or (f'needs {r.peak(p) / results.GIB:.2f} GiB per device (with what stays '
                         f'resident beside it) > {r.limit_bytes / results.GIB:.2f} GiB')
      out.append(f'stage {r.name!r} (index {r.index}): {p.name} does not fit: {what}')
  return out


def cpu_model() -> str:
  """This host's CPU, e.g. 'AMD EPYC 7B13 (x86_64)'."""
  try:
    with open('/proc/cpuinfo') as f:
      names = [l.split(':', 1)[1].strip() for l in f if l.startswith('model name')]
  except OSError:
    names = []
  return f'{names[0] if names else platform.processor() or "a CPU"} ({platform.machine()})'


def host_load() -> str:
  """This host's CPU count and load average: compile times depend on what else runs."""
  load = ', '.join(f'{x:.2f}' for x in os.getloadavg())
  return f'host: {os.cpu_count()} CPUs, load average {load} (1, 5, 15 min)'


def plan_header(plan: config_lib.Plan, tgt: targets.Target, time_only: bool = False) -> list[str]:
  """The lines a plan starts with: the target, the mesh and model, how FLOPs and memory are
  counted, and (with a time bound) what it assumes."""
  model_cfg = plan.model
  axes = ', '.join(sharding.mesh_axes(len(targets.mesh_shape(plan))))
  active = (f' ({model_cfg.num_params(active=True) / 1e9:.2f}B active per token)'
            if model_cfg.num_experts else '')
  hw = plan.hardware
  out = [f'target: {hw.name or hw.platform}: step times only (--time_only), '
         'nothing compiled: FLOPs and bytes counted from the config and abstract shapes'
         if time_only else f'target: {tgt.description}',
         f'mesh ({axes}) = {targets.mesh_shape(plan)}'
         + (' (no mesh: one device)' if plan.mesh_shape is None else '')
         + f'; model {plan.model_name}: {model_cfg.num_params() / 1e9:.2f}B parameters{active} in '
         f'{model_cfg.param_dtype}, compute {model_cfg.dtype}, remat={model_cfg.remat}']
  slices = None if time_only else targets.slices_line(plan, tgt)
  if slices:
    out.append(slices)
  if not time_only:
    out += [*model_notes(model_cfg, tgt), *([compiler.GPU_NOTE] if tgt.kind == 'gpu' else []),
            'memory is per device; total = arguments + outputs + temporaries - aliased '
            '(donated) buffers. ' + (
                "FLOPs are XLA's HLO count: a train step's over the whole batch; a sampler's "
                'for its prefill and one step per decode loop (XLA counts a loop body once)'
                if not model_cfg.flops_from_config else "FLOPs: a train step's over the whole batch; a "
                "sampler's for the whole call")]
  if hw.peak_tflops and hw.hbm_gbps:
    out.append(f'step-time bound at {hw.peak_tflops:g} TFLOP/s and {hw.hbm_gbps:g} GB/s per '
               'chip; it assumes: ' + '; '.join(step_time_lib.TIME_ASSUMPTIONS) + '.')
  return out
