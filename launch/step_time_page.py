"""Writes the step-time page: every stage's time bound for several configs, compiling nothing.

    python -m launch.step_time_page      # the paper configs -> docs/plans/step_time_model.md
    python -m launch.step_time_page --configs=configs/tiny.py --out=/tmp/tiny_time.md

Per config (`file[:arg]`, on its own `config.hardware` and mesh): its hardware, mesh and model
(`launch.plan.plan_header`) and one row per training stage (`launch.plan.time_table`): the
step's bound by part (sampling's weights, KV cache, Mamba state, compute and prefill; scoring;
update; frozen passes), per stage in chip-hours, the worst case of its refill rounds, and the
weights-only bound it replaces; then the assumptions once. The numbers are those of
`launch.plan --time_only` (`launch.plan.time_plan`): FLOPs and bytes counted from the config,
the sampler's traced programs and abstract shapes, no program compiled; one to two minutes
per paper config on a 2-core host.
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


def load(spec: str) -> config_lib.Plan:
  """The validated config of `file[:arg]`."""
  arg = spec.split(':', 1)[1] if ':' in spec else None
  return config_lib.validate(sweep.load_module(spec).get_config(arg))


def page(plans: dict[str, config_lib.Plan], *, command: str, date: str) -> str:
  """The Markdown page for `plans` (spec -> validated config), each timed stage by stage.

  Each config's mesh is made of the first of this process's CPU devices (there must be as
  many as the largest mesh needs: `launch.plan.use_simulated_cpu_devices`); nothing runs on
  them.
  """
  out = [f'# Step-time model: `{command}`', '',
         f'Written by `launch.step_time_page` on {date}, on {plan_report.cpu_model()}; nothing '
         'compiled. Seconds per step by part and chip-hours per stage of each config on its own '
         'hardware (`launch.plan.step_time`). The weights-only bound is the one `launch.plan` '
         'printed before (per new token of each chunk one read of the weights a decode step '
         'reads, the rest FLOPs at peak; here with every FLOP counted from the config). The '
         'worst case runs 1 + refill_cap sampling and scoring rounds per step.']
  for spec, p in plans.items():
    n = plan_targets.num_devices(p)
    tgt = plan_targets.Target(tuple(jax.devices('cpu')[:n]), 'cpu', f'{n} CPU devices', 0)
    reports = plan_stages.time_plan(p, tgt)
    hw = p.hardware
    total = lambda f, reports=reports: sum(r.chip_hours(f(r.time)) for r in reports
                                           if r.time is not None)
    out += ['', f'## `{spec}`', '',
            *[f'- {h}' for h in plan_report.plan_header(p, tgt, time_only=True)[1:2]],
            f'- {hw.name}: {hw.peak_tflops:g} TFLOP/s and {hw.hbm_gbps:g} GB/s per chip', '',
            *plan_report.time_table(reports, assumptions=False), '',
            f'All stages: {total(lambda t: t.bound):,.0f} chip-hours (worst case '
            f'{total(lambda t: t.worst):,.0f}); the weights-only bound: '
            f'{total(lambda t: t.weights_only):,.0f}.']
  out += ['', 'The bound assumes:', '', *[f'- {a}' for a in plan_step_time.TIME_ASSUMPTIONS]]
  return '\n'.join(out) + '\n'


def main(argv):
  del argv
  plans = {spec: load(spec) for spec in _CONFIGS.value}   # touches no device
  plan_targets.use_simulated_cpu_devices(max(plan_targets.num_devices(p) for p in plans.values()))
  command = 'python -m launch.step_time_page ' + ' '.join(sys.argv[1:])
  date = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
  text = page(plans, command=command.strip(), date=date)
  path = epath.Path(_OUT.value)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  print(text + f'\nwrote {path}')


if __name__ == '__main__':
  app.run(main)
