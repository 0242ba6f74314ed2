"""Two tiny-world recipes compared over seeds: by default Cascade RL vs one blended RL stage.

  .venv/bin/python -m benchmarks.cascade_vs_blended                       # seeds 0,1,2
  .venv/bin/python -m benchmarks.cascade_vs_blended --config_arg=world=hetero,eval_every=10
  .venv/bin/python -m benchmarks.cascade_vs_blended --compare=tiny,tiny:drop=rlhf
  .venv/bin/python -m benchmarks.cascade_vs_blended --seeds=0,1 --workdir_root=/tmp/cvb
  .venv/bin/python -m benchmarks.cascade_vs_blended --compare=tiny:fast_path,tiny \
      --workdir_root=/tmp/fpcmp --doc=docs/benchmarks/fast_path_tiny.md

`--compare=A,B` names the two sides, each `config` or `config:argument` of a
configs/ module (default configs/tiny.py, the cascade, against
configs/tiny_blended.py: the same SFT and reward model, then one GRPO stage
over all five domains with the cascade's rollouts). `--config_arg` is added
to both sides' arguments (e.g. `world=hetero` for the heterogeneous world,
`eval_every=10` for validation curves, `smoke` to check the plumbing in a few
minutes; the numbers then mean nothing). Each side runs once per seed,
`--parallel` runs at a time (each a `python -m cascade.main` subprocess; a
finished workdir is resumed, i.e. read back, not rerun; each seed's world is
built here first, by the configs' `prepare` step, so concurrent runs only
read it). Keep `--parallel` at 1 on a 2-core machine: three runs at a time
each went ~4x slower than one alone (XLA's thread pools oversubscribe the
cores), and two single-threaded processes gave only ~1.1x the throughput of
one; on a larger machine, one run per two cores. Side B's run forks from side
A's of the same seed (`--fork`, on by default: the stages both configs begin
with, SFT and the reward model, are copied, not rerun; with `--parallel` > 1
it copies what A has finished when B starts). A fork needs every config section but the
stages to be the same (`cascade.checkpoint.fork`); where the sides differ elsewhere (e.g.
`tiny:fast_path` against `tiny`: the sampler), B runs whole and the summary says why.
`--doc=PATH` also writes the printed summary to a markdown page with the command, date,
machine and load average (docs/benchmarks/fast_path_tiny.md).

Prints, over the seeds (mean ± sample standard deviation):
  * per domain, the final row's held-out score of both sides, the SFT row, and
    the paired difference A - B with its standard error; a difference within
    two standard errors is called a tie;
  * training wall time after SFT (the sum of every later stage's step times:
    compiles included, evaluation excluded), split into sampling, scoring,
    update and the rest, with the decode-slot and update-padding waste and
    the verifiers' share of step time (`kinds.loop.accounting`), and the sampling seconds
    split into each stage's first step (compiles), later steps over 5x their stage's median
    (another program shape compiled) and the rest (`sampling_split`);
  * how soon A reaches B's final mean held-out score: the first of A's stage
    ends whose mean is at least B's final mean, as a fraction of B's wall time
    (none: A never does), per seed and on the means over seeds (A's stage
    ends, wall and score, averaged over seeds, against B's mean final score
    and mean wall time);
  * at equal wall time (the shorter side's), each side's latest mean score by
    then: validation scores when the runs have them (`eval_every`), else the
    held-out stage ends;
  * every stage's effect on the domains it does not train (interference),
    and side A's per-stage check (smallest own-domain gain, largest drop);
  * one JSON line with everything; `--plot` (default <root>/curve.png) draws
    mean score against wall time for both sides, one line per seed.
"""

from __future__ import annotations

import datetime
import importlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent import futures
from typing import Sequence

from absl import app
from absl import flags

from benchmarks import host

_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'World and model seeds.')
_WORKDIR_ROOT = flags.DEFINE_string('workdir_root', 'runs/cascade_vs_blended',
                                    'Each run goes to <root>/<side>_s<seed>.')
_CONFIG_ARG = flags.DEFINE_string('config_arg', '',
                                  "Extra config argument of both sides, e.g. 'world=hetero'.")
_COMPARE = flags.DEFINE_list('compare', ['tiny', 'tiny_blended'],
                             'The two sides: config or config:argument (configs/<config>.py).')
_PARALLEL = flags.DEFINE_integer('parallel', 1, 'Runs at a time (one per two cores).')
_FORK = flags.DEFINE_bool('fork', True, "Side B's run starts from side A's run of the same "
                          'seed (`--fork_from`): the stages they share (SFT, the reward model) '
                          'are copied, not rerun.')
_DOC = flags.DEFINE_string('doc', None, 'Also write the printed summary to this markdown page, '
                           'with the command, date, machine and load average.')
_PLOT = flags.DEFINE_string('plot', None, 'Where to draw the score-vs-wall-time plot '
                            '(default <workdir_root>/curve.png; empty: no plot).')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ('tiny', 'tiny_blended')


def split_side(side: str) -> tuple[str, str]:
  """'tiny:drop=rlhf' -> ('tiny', 'drop=rlhf'); 'tiny' -> ('tiny', '')."""
  config, _, arg = side.partition(':')
  if not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', config):
    raise app.UsageError(f'--compare side {side!r}: expected config or config:argument')
  return config, arg


def config_arg(seed: int, extra: str = '') -> str:
  """The config argument of a run: the side's argument, --config_arg, then the seed."""
  return ','.join(filter(None, [extra, _CONFIG_ARG.value, f'seed={seed}']))


def run_name(side: str) -> str:
  """The workdir name of a side: 'tiny:drop=rlhf' -> 'tiny_drop-rlhf'."""
  config, arg = split_side(side)
  return config + (('_' + re.sub(r'[^A-Za-z0-9]+', '-', arg).strip('-')) if arg else '')


def prepare(config: str, seed: int, extra: str = '') -> str:
  """Runs the `prepare` step of one config at one seed (builds or reuses its world).

  Args:
    config: a configs/ module name.
    seed: the seed.
    extra: the side's own config argument.

  Returns:
    What the step returned (the world's directory).
  """
  c = importlib.import_module(f'configs.{config}').get_config(config_arg(seed, extra))
  module, _, fn = c.prepare.fn.partition(':')
  return getattr(importlib.import_module(module), fn)(**c.prepare.kwargs)


def workdir_of(side: str, seed: int) -> str:
  return os.path.join(_WORKDIR_ROOT.value, f'{run_name(side)}_s{seed}')


def run_one(side: str, seed: int, fork_from: str | None = None
            ) -> tuple[dict, list[dict], float]:
  """Runs (or resumes) one side at one seed, forked from `fork_from` when given; returns
  (results.json, metrics.jsonl records, wall seconds of this call)."""
  config, extra = split_side(side)
  arg = config_arg(seed, extra)
  workdir = workdir_of(side, seed)
  cmd = [sys.executable, '-m', 'cascade.main', f'--config={REPO}/configs/{config}.py:{arg}',
         f'--workdir={workdir}', '--verbosity=-1'] + (
             [f'--fork_from={fork_from}'] if fork_from else [])
  print(f'running {side} seed {seed} -> {workdir}', flush=True)
  t0 = time.time()
  p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  if p.returncode:
    raise RuntimeError(f'{" ".join(cmd)} exited {p.returncode}:\n{p.stderr[-4000:]}')
  with open(os.path.join(workdir, 'results.json'), encoding='utf-8') as f:
    res = json.load(f)
  from cascade import metrics  # pylint: disable=g-import-not-at-top
  records = metrics.read_records(os.path.join(workdir, 'metrics.jsonl'))   # skips damaged lines
  return res, records, time.time() - t0


def fork_blocker(a: str, b: str, seed: int) -> str:
  """Why side b's run cannot fork from side a's (`checkpoint.fork` copies shared stages only
  when every other config section is the same), or '' when it can."""
  from cascade import checkpoint  # pylint: disable=g-import-not-at-top
  sections = []
  for side in (a, b):
    config, extra = split_side(side)
    c = importlib.import_module(f'configs.{config}').get_config(config_arg(seed, extra))
    sections.append({k: v for k, v in json.loads(json.dumps(
        checkpoint.config_for_hash(c), default=str)).items() if k != 'stages'})
  differ = sorted(k for k in set(sections[0]) | set(sections[1])
                  if sections[0].get(k) != sections[1].get(k))
  return f'their configs differ in {", ".join(differ)}' if differ else ''


def finished_results(side: str, seed: int) -> dict | None:
  """The results.json of a run's workdir as it is now (None: none yet)."""
  try:
    with open(os.path.join(workdir_of(side, seed), 'results.json'), encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def write_doc(path: str, lines: Sequence[str], load_before: Sequence[float],
              read_back: int, runs: int) -> None:
  """Writes the printed summary to a markdown page with the command, date, machine and load.

  Args:
    path: the page.
    lines: the summary as printed.
    load_before: os.getloadavg() when this call started (the after-load is taken here).
    read_back: runs already finished before this call (read back from their workdirs, not
      run: their wall times were measured under an earlier load).
    runs: all runs of the comparison.
  """
  after = os.getloadavg()
  command = 'python -m benchmarks.cascade_vs_blended ' + ' '.join(sys.argv[1:])
  loads = lambda x: '/'.join(f'{v:.2f}' for v in x)
  page = ['# ' + ' vs '.join(_COMPARE.value) + ' on the tiny world', '',
          f'Written by `benchmarks/cascade_vs_blended.py` on '
          f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: `{command}` on '
          f'{os.cpu_count()} cores of {host.cpu_name()}; load average (1/5/15 min) '
          f'{loads(load_before)} before and {loads(after)} after.'
          + (f' {read_back} of the {runs} runs had finished before this call and were read '
             'back from their workdirs, so their seconds were measured under an earlier load.'
             if read_back else ''), '',
          'Wall times are step times after SFT (compiles included, evaluation excluded); on a '
          'shared host their ratio is approximate (host.load_warning).', '',
          '```text', *[x for line in lines for x in line.split('\n')], '```', '']
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write('\n'.join(page))
  print(f'wrote {path}')


def stage_checks(res: dict) -> tuple[float, float, str]:
  """The per-stage targets on one cascade's results.json.

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


def interference(res: dict) -> dict[str, float]:
  """'stage -> domain' -> the stage's change of a domain it does not train (row minus the row
  before)."""
  domains, rows = res['domains'], res['scores']
  out = {}
  for i in range(1, len(rows)):
    trained = set(res['stage_domains'][i])
    for j, d in enumerate(domains):
      if d not in trained:
        out[f'{res["stages"][i]} -> {d}'] = rows[i][j] - rows[i - 1][j]
  return out


def sampling_split(res: dict, records: Sequence[dict]) -> dict[str, float]:
  """A run's sampling seconds after its first stage, split to tell compiles from decoding.

  A stage's first step compiles its sampler programs; a later step several times slower than
  the stage's typical one (over 5x its median) most likely compiled another shape (the paged
  engine compiles one decode program per power of two of live rows, the first time a call
  that small happens).

  Args:
    res: results.json's object.
    records: metrics.jsonl's records.

  Returns:
    {'first_s': the stages' first steps, 'slow_s': the later steps over 5x their stage's
     median, 'rest_s': the other steps, 'median_s': the median of those other steps}.
  """
  per: dict[str, dict[int, float]] = {}
  for r in records:
    if 'sample_s' in r and r.get('stage') not in (None, res['stages'][0]):
      per.setdefault(r['stage'], {})[r['step']] = float(r['sample_s'])   # a resume re-logs
  out = {'first_s': 0.0, 'slow_s': 0.0, 'rest_s': 0.0}
  rest = []
  for by_step in per.values():
    steps = sorted(by_step)
    out['first_s'] += by_step[steps[0]]
    later = [by_step[k] for k in steps[1:]]
    typical = statistics.median(later) if later else 0.0
    for x in later:
      if x > 5 * typical:
        out['slow_s'] += x
      else:
        out['rest_s'] += x
        rest.append(x)
  out['median_s'] = statistics.median(rest) if rest else math.nan
  return out


def timeline(res: dict, records: Sequence[dict]) -> dict:
  """Where a run's wall time went and what it scored when.

  Wall time counts every stage after the first (SFT, shared by the sides) by
  its step times (`step_s`: compiles included; evaluation and in-stage
  validation excluded).

  Args:
    res: results.json's object.
    records: metrics.jsonl's records (steps, and evaluation rows 'eval').

  Returns:
    {'wall_s': total, 'stage_ends': [(stage, wall at its end, mean held-out score)],
     'curve': [(wall, mean score)] from validation scores (in-stage and stage ends) when
     the run has them, else the held-out stage ends,
     'accounting': the later stages' accounting summed, with waste fractions}.
  """
  first = res['stages'][0]
  steps: dict[tuple, dict] = {}       # (stage, step) -> the last record (a resume re-logs)
  order: list = []
  for r in records:
    if 'step' in r and 'stage' in r:
      key = (r['stage'], r['step'])
      if key not in steps:
        order.append(('step', key))
      steps[key] = r
    elif 'eval' in r:
      order.append(('eval', r))
  wall, ends, val_curve = 0.0, [], []
  mean = lambda scores: statistics.fmean(scores.values())
  for what, item in order:
    if what == 'step':
      r = steps[item]            # `order` holds each (stage, step) once
      if r['stage'] == first:
        continue
      wall += float(r.get('step_s', 0.0))
      vals = {k[4:]: v for k, v in r.items() if k.startswith('val/')}
      if vals:
        val_curve.append((wall, mean(vals)))
    elif item['eval'] in res['stages'] and item['eval'] != first:
      ends.append((item['eval'], wall, mean(item['scores'])))
      if item.get('validation'):
        val_curve.append((wall, mean(item['validation'])))
  acc: dict[str, float] = {}
  for stage, a in (res.get('accounting') or {}).items():
    if stage != first:
      for k, v in a.items():
        if isinstance(v, (int, float)) and not k.endswith(('_share', '_waste')):
          acc[k] = acc.get(k, 0.0) + float(v)
  if acc.get('step_s') and 'score_s' in acc:
    acc['verifier_share'] = acc['score_s'] / acc['step_s']
  if acc.get('decode_slots'):
    acc['decode_waste'] = 1 - acc.get('generated_tokens', 0.0) / acc['decode_slots']
  if acc.get('update_slots'):
    acc['update_waste'] = 1 - acc.get('update_tokens', 0.0) / acc['update_slots']
  curve = val_curve or [(w, s) for _, w, s in ends]
  return {'wall_s': wall, 'stage_ends': ends, 'curve': curve, 'accounting': acc}


def reach_fraction(a: dict, b_final: float, b_wall: float) -> float:
  """The wall time of the first of A's stage ends whose mean held-out score is at least
  `b_final`, as a fraction of `b_wall` (inf when A never reaches it)."""
  for _, wall, score in a['stage_ends']:
    if score >= b_final - 1e-9:
      return wall / b_wall
  return math.inf


def seed_mean_ends(per_seed: Sequence[Sequence[tuple]]) -> list[tuple]:
  """The stage ends of a side averaged over seeds: [(stage, mean wall, mean score)], or []
  when the seeds' runs did not end the same stages."""
  names = [tuple(n for n, _, _ in ends) for ends in per_seed]
  if not per_seed or len(set(names)) != 1:
    return []
  return [(n, statistics.fmean(e[i][1] for e in per_seed),
           statistics.fmean(e[i][2] for e in per_seed)) for i, n in enumerate(names[0])]


def score_at(curve: Sequence[tuple], wall: float) -> float:
  """The latest score of a curve at or before `wall` (nan before its first point)."""
  got = [s for w, s in curve if w <= wall + 1e-9]
  return got[-1] if got else math.nan


def mean_spread(xs: Sequence[float]) -> tuple[float, float]:
  """(mean, sample standard deviation; 0 for one value)."""
  return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def paired(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, str]:
  """(mean of a - b over seeds, its standard error, verdict): the verdict names the higher
  side only when the difference exceeds two standard errors, else 'tie' (one seed: 'tie')."""
  diff = [x - y for x, y in zip(a, b)]
  m = statistics.fmean(diff)
  se = statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else math.inf
  verdict = 'tie' if not abs(m) > 2 * se else ('A higher' if m > 0 else 'B higher')
  return m, se, verdict


def plot(path: str, sides: Sequence[str], lines: dict) -> None:
  """Mean score against wall time after SFT, one line per side and seed."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for color, side in zip(('tab:blue', 'tab:orange'), sides):
    for i, (seed, tl) in enumerate(sorted(lines[side].items())):
      xs, ys = zip(*tl['curve']) if tl['curve'] else ((), ())
      ax.plot(xs, ys, '-o', color=color, ms=3, alpha=0.8,
              label=side if i == 0 else None)
      if tl['stage_ends']:
        ax.plot([tl['stage_ends'][-1][1]], [tl['stage_ends'][-1][2]], '*', color=color, ms=11,
                alpha=0.8)
  ax.set_xlabel('wall time after SFT (s; step times, evaluation excluded)')
  ax.set_ylabel('mean score over domains')
  ax.set_title('lines: validation scores when logged, else held-out stage ends; '
               '★: final held-out', fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: Sequence[str]) -> None:
  del argv
  load_before = os.getloadavg()
  summary = []                        # what is printed below, for --doc

  def say(line: str) -> None:
    print(line, flush=True)
    summary.append(line)

  seeds = [int(s) for s in _SEEDS.value]
  if _PARALLEL.value < 1:
    raise app.UsageError(f'--parallel={_PARALLEL.value}: must be >= 1')
  sides = list(_COMPARE.value)
  if len(sides) != 2 or len(set(map(run_name, sides))) != 2:
    raise app.UsageError(f'--compare={",".join(sides)}: expected two different sides')
  sys.path.insert(0, REPO)
  for seed in seeds:
    for side in sides:      # sides of the same world: the second call reuses it
      config, extra = split_side(side)
      print(f'world of seed {seed}: {prepare(config, seed, extra)}', flush=True)
  final = {s: {} for s in sides}      # side -> domain -> [score per seed]
  sft = {}                            # domain -> [score per seed] (side A's SFT row)
  lines = {s: {} for s in sides}      # side -> seed -> timeline
  jobs = [(side, seed) for seed in seeds for side in sides]
  before = {job: finished_results(*job) for job in jobs}
  fork = {}                           # seed -> side A's workdir, where B can fork from it
  for seed in seeds:
    blocker = fork_blocker(*sides, seed) if _FORK.value else 'off (--nofork)'
    if blocker:
      say(f'seed {seed}: {sides[1]} does not fork from {sides[0]}: {blocker}')
    else:
      fork[seed] = workdir_of(sides[0], seed)
  with futures.ThreadPoolExecutor(_PARALLEL.value) as pool:
    done = list(pool.map(lambda job: run_one(*job, fork_from=(
        fork.get(job[1]) if job[0] == sides[1] else None)), jobs))
  read_back = sum(before[job] is not None and before[job] == res
                  for job, (res, _, _) in zip(jobs, done))
  domains = done[0][0]['domains']
  for (side, seed), (res, records, _) in zip(jobs, done):
    if res['domains'] != domains:
      raise RuntimeError(f'{side} seed {seed}: domains {res["domains"]} != {domains}')
    lines[side][seed] = timeline(res, records)
    for j, d in enumerate(domains):
      final[side].setdefault(d, []).append(res['scores'][-1][j])
      if side == sides[0]:
        sft.setdefault(d, []).append(res['scores'][0][j])
  a, b = sides
  fmt = lambda xs: '{:5.1f} ± {:4.1f}'.format(*mean_spread(xs))
  say(f'\nheld-out score after the last stage, mean ± std over seeds {seeds}; '
      f'A = {a}, B = {b}')
  say(f'{"domain":22s} {"after SFT":>13s} {"A":>13s} {"B":>13s} {"A - B (± se)":>16s}  verdict')
  diffs = {}
  mean_of = lambda side: [statistics.fmean(final[side][d][i] for d in domains)
                          for i in range(len(seeds))]
  for d in domains + ['mean of domains']:
    xa, xb = (mean_of(a), mean_of(b)) if d == 'mean of domains' else (final[a][d], final[b][d])
    m, se, verdict = paired(xa, xb)
    diffs[d] = {'diff': m, 'se': se, 'verdict': verdict}
    first = fmt(sft[d]) if d in sft else ''
    say(f'{d:22s} {first:>13s} {fmt(xa):>13s} {fmt(xb):>13s} {m:+7.1f} (± {se:4.1f})  '
        f'{verdict}')
  say(f'per seed ({", ".join(map(str, seeds))}), A | B: ' + '; '.join(
      f'{d} {" ".join(f"{x:.1f}" for x in final[a][d])} | '
      f'{" ".join(f"{x:.1f}" for x in final[b][d])}' for d in domains))
  walls = {s: [lines[s][x]['wall_s'] for x in seeds] for s in sides}
  say('\nwall time after SFT (s) and where it went, mean over seeds')
  keys = ('sample_s', 'score_s', 'update_s', 'other_s', 'verifier_share', 'decode_waste',
          'update_waste')
  acct = {s: {k: statistics.fmean(lines[s][x]['accounting'].get(k, math.nan) for x in seeds)
              for k in keys} for s in sides}
  for s in sides:
    parts = ', '.join(f'{k} {acct[s][k]:.3g}' for k in keys)
    say(f'  {s}: {fmt(walls[s])} s; {parts}')
  split = {s: [sampling_split(res, records) for (side, _), (res, records, _) in zip(jobs, done)
               if side == s] for s in sides}
  say('sampling seconds split, mean over seeds: first step of each stage (compiles), later '
      'steps over 5x their stage\'s median (another shape compiled), the rest (median step)')
  for s in sides:
    m = {k: statistics.fmean(x[k] for x in split[s]) for k in split[s][0]}
    say(f'  {s}: first {m["first_s"]:.0f}, slow {m["slow_s"]:.0f}, rest {m["rest_s"]:.0f} '
        f'(median step {m["median_s"]:.2f})')
  reach = [reach_fraction(lines[a][x], statistics.fmean(final[b][d][i] for d in domains),
                          lines[b][x]['wall_s']) for i, x in enumerate(seeds)]
  finite = [r for r in reach if math.isfinite(r)]
  say(f'\nA reaches B\'s final mean held-out score at this fraction of B\'s wall time, per '
      f'seed: {", ".join(f"{r:.2f}" for r in reach)}'
      + (f' (mean {statistics.fmean(reach):.2f})' if len(finite) == len(reach) else
         f' ({len(reach) - len(finite)} seed(s) never)'))
  mean_ends = seed_mean_ends([lines[a][x]['stage_ends'] for x in seeds])
  b_final = statistics.fmean(mean_of(b))
  reach_of_means = (reach_fraction({'stage_ends': mean_ends}, b_final,
                                   statistics.fmean(walls[b])) if mean_ends else math.nan)
  if mean_ends:
    say(f'on the means over seeds: A\'s stage ends (wall s, mean score) '
        + ', '.join(f'{n} ({w:.0f}, {v:.1f})' for n, w, v in mean_ends)
        + f'; B ends at ({statistics.fmean(walls[b]):.0f}, {b_final:.1f}): A reaches it at '
        f'{reach_of_means:.2f} of B\'s wall time')
  equal = {}
  for x in seeds:
    w = min(lines[a][x]['wall_s'], lines[b][x]['wall_s'])
    equal[x] = {'wall_s': w, a: score_at(lines[a][x]['curve'], w),
                b: score_at(lines[b][x]['curve'], w)}
  eq_a, eq_b = [equal[x][a] for x in seeds], [equal[x][b] for x in seeds]
  m, se, verdict = paired(eq_a, eq_b)
  say(f'at equal wall time (the shorter run\'s), latest mean score: A {fmt(eq_a)}, '
      f'B {fmt(eq_b)}; A - B {m:+.1f} (± {se:.1f}) {verdict}')
  inter = {}
  for s in sides:
    per = [interference(res) for (side, _), (res, _, _) in zip(jobs, done) if side == s]
    inter[s] = {k: [p[k] for p in per] for k in per[0]}
  say('\neffect of each stage on the domains it does not train (mean ± std over seeds)')
  for s in sides:
    say(f'  {s}: ' + '; '.join(f'{k} {fmt(v).replace(" ", "")}' for k, v in inter[s].items()))
  checks = {}
  say(f'\n{a} per seed: smallest own-domain gain of an RL stage, largest drop of another '
      'domain')
  for (side, seed), (res, _, _) in zip(jobs, done):
    if side == a:
      gain, drop, where = stage_checks(res)
      checks[seed] = {'min_gain': gain, 'max_drop': drop, 'where': where}
      say(f'  seed {seed}: min gain {gain:+.1f}, max drop {drop:.1f}'
          + (f' ({where})' if where else ''))
  path = _PLOT.value if _PLOT.value is not None else os.path.join(_WORKDIR_ROOT.value,
                                                                  'curve.png')
  if path:
    plot(path, sides, lines)
    say(f'plot: {path}')
  finite_or_none = lambda o: (
      {k: finite_or_none(v) for k, v in o.items()} if isinstance(o, dict) else
      [finite_or_none(v) for v in o] if isinstance(o, (list, tuple)) else
      None if isinstance(o, float) and not math.isfinite(o) else o)
  warning = host.print_load_warning(load_before)
  if _DOC.value:
    write_doc(_DOC.value, summary + ([warning] if warning else []), load_before, read_back,
              len(jobs))
  print(json.dumps(finite_or_none({'seeds': seeds, 'sides': sides, 'sft': sft, 'final': final,
                    'differences': diffs, 'wall_s': walls, 'accounting': acct,
                    'reach_fraction': reach, 'reach_fraction_of_means': reach_of_means,
                    'sampling_split': split, 'equal_wall': equal, 'interference': inter,
                    'stage_checks': checks, 'run_s': {s: [d[2] for (side, _), d in
                                                          zip(jobs, done) if side == s]
                                                      for s in sides}})))


if __name__ == '__main__':
  app.run(main)
