"""Writes the step-time page: every stage's time bound for several configs.

    python -m launch.step_time_page --compile   # the paper configs -> docs/plans/step_time_model.md
    python -m launch.step_time_page --configs=configs/tiny.py --out=/tmp/tiny_time.md

Per config (`file[:arg]`, on its own `config.hardware` and mesh): its hardware, mesh and model
(`launch.plan.plan_header`) and one row per training stage (`launch.plan.time_table`): the
step's bound by part (sampling's weights, KV cache, Mamba state, compute and prefill; scoring;
update; frozen passes; the collectives of each), overlapped and serial, per stage in
chip-hours, the worst case of its refill rounds, and the weights-only bound it replaces; then
the assumptions once. Without `--compile` the numbers are those of `launch.plan --time_only`
(`launch.plan.time_plan`): FLOPs and bytes counted from the config, the sampler's traced
programs and abstract shapes, no program compiled (one to two minutes per paper config on a
2-core host), and no collectives. With `--compile` each stage's train step, sampler calls,
frozen passes and reward-model scoring are compiled for the config's target (the TPU compiler
with libtpu installed, XLA:GPU with a CUDA plugin, else XLA:CPU on simulated devices:
`--compiler`, `launch.plan.collective_plan`) and their collectives, read from the optimized HLO,
join the bound; the page is rewritten after each stage (hours for the paper configs).
"""

from __future__ import annotations

import sys
import time

from absl import app
from absl import flags
from etils import epath
import jax

from cascade import config as config_lib
from launch import sweep
from launch.plan import report as plan_report
from launch.plan import stages as plan_stages
from launch.plan import step_time as plan_step_time
from launch.plan import targets as plan_targets

# The paper configs on their own hardware (a TPU v5p-128 slice), then the dense two on one
# 8-GPU node.
PAPER_CONFIGS = ('configs/nemotron_cascade_14b.py', 'configs/nemotron_cascade_8b.py',
                 'configs/nemotron_cascade2.py', 'configs/nemotron_cascade_14b.py:hardware=h200x8',
                 'configs/nemotron_cascade_8b.py:hardware=h200x8')

_CONFIGS = flags.DEFINE_list('configs', list(PAPER_CONFIGS), 'Config files (file[:arg]).')
_OUT = flags.DEFINE_string('out', 'docs/plans/step_time_model.md', 'The page to write.')
_COMPILE = flags.DEFINE_bool('compile', False, 'Compile each stage\'s programs for their '
                             'collectives (launch.plan.collective_plan).')
_BACKEND = flags.DEFINE_enum('compiler', 'auto', ['auto', 'tpu', 'gpu', 'cpu'],
                             'With --compile: the compiler per config (auto: its target\'s '
                             'where installed, else XLA:CPU on simulated devices).')


def load(spec: str) -> config_lib.Plan:
  """The validated config of `file[:arg]`."""
  arg = spec.split(':', 1)[1] if ':' in spec else None
  return config_lib.validate(sweep.load_module(spec).get_config(arg))


def _target(p: config_lib.Plan, compile_: bool, backend: str) -> plan_targets.Target:
  """The devices a config is timed (and with `compile_` compiled) for: its own target's where
  `backend` names one or 'auto' finds its compiler installed, else the first of this process's
  CPU devices."""
  n = plan_targets.num_devices(p)
  if compile_ and backend != 'cpu' and (backend != 'auto'
                                        or plan_targets.default_backend(p) != 'cpu'):
    return plan_targets.target(p, backend, device_memory_gib=0)
  cpus = tuple(jax.devices('cpu')[:n])
  return plan_targets.Target(cpus, 'cpu', f'{n} simulated CPU devices', 0)


def _section(spec: str, p: config_lib.Plan, tgt: plan_targets.Target,
             reports: list, compile_: bool) -> list[str]:
  """A config's part of the page: its header lines, table and chip-hours."""
  hw = p.hardware
  total = lambda f: sum(r.chip_hours(f(r.time)) for r in reports if r.time is not None)
  net = plan_targets.interconnect(hw)
  head = [f'- {h}' for h in plan_report.plan_header(p, tgt, time_only=True)[1:2]]
  head.append(f'- {hw.name}: {hw.peak_tflops:g} TFLOP/s and {hw.hbm_gbps:g} GB/s per chip')
  if compile_:
    head.append(f'- compiled by: {tgt.description}')
    head.append(f'- collectives priced on: {net.name}: {net.link_gbps:g} GB/s per link each way, '
                f'{net.network_gbps:g} GB/s per device between {net.domain}s ({net.source})'
                if net else '- collectives: no interconnect known for this hardware, not timed')
  return ['', f'## `{spec}`', '', *head, '', *plan_report.time_table(reports, assumptions=False),
          '', f'All stages: {total(lambda t: t.bound):,.0f} chip-hours, collectives overlapped '
          f'(serial {total(lambda t: t.serial):,.0f}; worst case {total(lambda t: t.worst):,.0f})'
          f'; the weights-only bound: {total(lambda t: t.weights_only):,.0f}.']


def page(plans: dict[str, config_lib.Plan], *, command: str, date: str, compile_: bool = False,
         backend: str = 'auto', write=None) -> str:
  """The Markdown page for `plans` (spec -> validated config), each timed stage by stage.

  Without `compile_` each config's mesh is made of the first of this process's CPU devices
  (there must be as many as the largest mesh needs: `launch.plan.use_simulated_cpu_devices`);
  nothing runs on them. With it each stage's programs are compiled for the config's target
  (`_target`) and their collectives priced; `write` (the page so far) is called after each
  stage.
  """
  how = ("each stage's programs compiled for their collectives (`launch.plan.collective_plan`)"
         if compile_ else 'nothing compiled')
  out = [f'# Step-time model: `{command}`', '',
         f'Written by `launch.step_time_page` on {date}, on {plan_report.cpu_model()}; {how}. '
         'Seconds per step by part and chip-hours per stage of each config on its own '
         'hardware (`launch.plan.step_time`). The weights-only bound is the one `launch.plan` '
         'printed before (per new token of each chunk one read of the weights a decode step '
         'reads, the rest FLOPs at peak; here with every FLOP counted from the config). The '
         'worst case runs 1 + refill_cap sampling and scoring rounds per step.']
  tail = ['', 'The bound assumes:', '', *[f'- {a}' for a in plan_step_time.TIME_ASSUMPTIONS]]
  for spec, p in plans.items():
    tgt = _target(p, compile_, backend)
    reports = []

    def done(rep, spec=spec, p=p, tgt=tgt, reports=reports):
      reports.append(rep)
      if write is not None:
        write('\n'.join(out + _section(spec, p, tgt, reports, compile_) + [
            '', f'Unfinished: written after stage {rep.name!r} of `{spec}`.'] + tail) + '\n')

    if compile_:
      plan_stages.collective_plan(p, tgt, report=done)
    else:
      plan_stages.time_plan(p, tgt, report=done)
    out += _section(spec, p, tgt, reports, compile_)
  return '\n'.join(out + tail) + '\n'


def main(argv):
  del argv
  plans = {spec: load(spec) for spec in _CONFIGS.value}   # touches no device
  plan_targets.use_simulated_cpu_devices(max(plan_targets.num_devices(p) for p in plans.values()))
  command = 'python -m launch.step_time_page ' + ' '.join(sys.argv[1:])
  date = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
  path = epath.Path(_OUT.value)
  path.parent.mkdir(parents=True, exist_ok=True)
  text = page(plans, command=command.strip(), date=date, compile_=_COMPILE.value,
              backend=_BACKEND.value, write=path.write_text)
  path.write_text(text)
  print(text + f'\nwrote {path}')


if __name__ == '__main__':
  app.run(main)
