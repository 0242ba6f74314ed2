"""Cascade RL vs one blended RL stage on the tiny world, over seeds.

  .venv/bin/python -m benchmarks.cascade_vs_blended                       # seeds 0,1,2
  .venv/bin/python -m benchmarks.cascade_vs_blended --seeds=0,1 --workdir_root=/tmp/cvb

Runs configs/tiny.py (SFT -> RM -> RLHF -> IF -> math -> code -> SWE) and
configs/tiny_blended.py (the same SFT and RM, then one GRPO stage over all
five domains with the same number of rollouts) once per seed, `--parallel`
runs at a time (each is a `python -m cascade.main` subprocess; a finished
workdir is resumed, i.e. read back, not rerun; each seed's world is built
once, here, by the configs' `prepare` step before any run starts, so
concurrent runs only read it). Keep
`--parallel` at 1 on a 2-core machine: three runs at a time each went ~4x
slower than one alone (XLA's thread pools oversubscribe the cores), and two
single-threaded processes gave only ~1.1x the throughput of one; on a larger
machine, one run per two cores. Prints, per domain, the final row's
held-out score as mean ± sample standard deviation over the seeds for both,
side by side, the SFT row for reference, and one JSON line with everything.
Each run takes as long as `make demo` (minutes on 2 cores), so this is a
benchmark, not a test. `--config_arg=smoke` checks the plumbing in a few
minutes (the numbers then mean nothing).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent import futures
from typing import Sequence

from absl import app
from absl import flags

_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'World and model seeds.')
_WORKDIR_ROOT = flags.DEFINE_string('workdir_root', 'runs/cascade_vs_blended',
                                    'Each run goes to <root>/<config>_s<seed>.')
_CONFIG_ARG = flags.DEFINE_string('config_arg', '', "Extra config argument, e.g. 'smoke'.")
_PARALLEL = flags.DEFINE_integer('parallel', 1, 'Runs at a time (one per two cores).')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ('tiny', 'tiny_blended')


def config_arg(seed: int) -> str:
  """The config argument of a run: --config_arg plus the seed."""
  return ','.join(filter(None, [_CONFIG_ARG.value, f'seed={seed}']))


def prepare(config: str, seed: int) -> str:
  """Runs the `prepare` step of one config at one seed (builds or reuses its world).

  Args:
    config: a name in CONFIGS.
    seed: the seed.

  Returns:
    What the step returned (the world's directory).
  """
  c = importlib.import_module(f'configs.{config}').get_config(config_arg(seed))
  module, _, fn = c.prepare.fn.partition(':')
  return getattr(importlib.import_module(module), fn)(**c.prepare.kwargs)


def run_one(config: str, seed: int) -> tuple[dict, float]:
  """Runs (or resumes) one config at one seed; returns (results.json, wall seconds)."""
  arg = config_arg(seed)
  workdir = os.path.join(_WORKDIR_ROOT.value, f'{config}_s{seed}')
  cmd = [sys.executable, '-m', 'cascade.main', f'--config={REPO}/configs/{config}.py:{arg}',
         f'--workdir={workdir}', '--verbosity=-1']
  print(f'running {config} seed {seed} -> {workdir}', flush=True)
  t0 = time.time()
  p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  if p.returncode:
    raise RuntimeError(f'{" ".join(cmd)} exited {p.returncode}:\n{p.stderr[-4000:]}')
  with open(os.path.join(workdir, 'results.json'), encoding='utf-8') as f:
    return json.load(f), time.time() - t0


def stage_checks(res: dict) -> tuple[float, float, str]:
  """Issue 7's per-stage targets on one cascade's results.json.

  Args:
    res: results.json's object (rows: SFT then one per later policy stage).

  Returns:
    (smallest gain of a stage on a domain it trains, largest drop of a domain
    it does not train relative to the row before, where that drop happened as
    'stage: domain').
  """
  domains, rows = res['domains'], res['scores']
  gains, drops = [], [(0.0, '')]
  for i in range(1, len(rows)):
    trained = set(res['stage_domains'][i])
    for j, d in enumerate(domains):
      delta = rows[i][j] - rows[i - 1][j]
      if d in trained:
        gains.append(delta)
      elif delta < 0:
        drops.append((-delta, f'{res["stages"][i]}: {d}'))
  worst = max(drops)
  return (min(gains) if gains else float('nan')), worst[0], worst[1]


def mean_spread(xs: Sequence[float]) -> tuple[float, float]:
  """(mean, sample standard deviation; 0 for one value)."""
  return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main(argv: Sequence[str]) -> None:
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  if _PARALLEL.value < 1:
    raise app.UsageError(f'--parallel={_PARALLEL.value}: must be >= 1')
  sys.path.insert(0, REPO)
  for seed in seeds:
    for config in CONFIGS:      # both name the same world: the second call reuses it
      print(f'world of seed {seed}: {prepare(config, seed)}', flush=True)
  final = {c: {} for c in CONFIGS}      # config -> domain -> [score per seed]
  sft = {}                              # domain -> [score per seed] (both configs share SFT)
  walls = {c: [] for c in CONFIGS}
  domains = None
  jobs = [(config, seed) for seed in seeds for config in CONFIGS]
  with futures.ThreadPoolExecutor(_PARALLEL.value) as pool:
    done = list(pool.map(lambda job: run_one(*job), jobs))
  for (config, seed), (res, wall) in zip(jobs, done):
    walls[config].append(wall)
    domains = res['domains']
    for j, d in enumerate(domains):
      final[config].setdefault(d, []).append(res['scores'][-1][j])
      if config == CONFIGS[0]:
        sft.setdefault(d, []).append(res['scores'][res['stages'].index('sft')][j])
  fmt = lambda xs: '{:5.1f} ± {:4.1f}'.format(*mean_spread(xs))
  print(f'\nheld-out score after the last stage, mean ± std over seeds {seeds}')
  print(f'{"domain":22s} {"after SFT":>13s} {"cascade":>13s} {"blended":>13s}')
  for d in domains:
    print(f'{d:22s} {fmt(sft[d]):>13s} {fmt(final["tiny"][d]):>13s} '
          f'{fmt(final["tiny_blended"][d]):>13s}')
  avg = {c: [statistics.fmean(final[c][d][i] for d in domains) for i in range(len(seeds))]
         for c in CONFIGS}
  print(f'{"mean of domains":22s} {"":>13s} {fmt(avg["tiny"]):>13s} '
        f'{fmt(avg["tiny_blended"]):>13s}')
  checks = {}
  print('\ncascade per seed: smallest own-domain gain of an RL stage (target >= 10), '
        'largest drop of another domain (target <= 3)')
  for (config, seed), (res, _) in zip(jobs, done):
    if config == CONFIGS[0]:
      gain, drop, where = stage_checks(res)
      checks[seed] = {'min_gain': gain, 'max_drop': drop, 'where': where}
      print(f'  seed {seed}: min gain {gain:+.1f}, max drop {drop:.1f}'
            + (f' ({where})' if where else ''))
  print(json.dumps({'seeds': seeds, 'sft': sft, 'final': final, 'wall_s': walls,
                    'stage_checks': checks}))


if __name__ == '__main__':
  app.run(main)
