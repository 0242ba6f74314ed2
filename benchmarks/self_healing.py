"""The self-healing cascade on the tiny world: guards off against `guard=repair`, over seeds.

  .venv/bin/python -m benchmarks.self_healing                         # hybrid and dense, seeds 0,1,2
  .venv/bin/python -m benchmarks.self_healing --models=hybrid --seeds=0
  .venv/bin/python -m benchmarks.self_healing --render_only          # the page from the record
  .venv/bin/python -m benchmarks.self_healing --config_arg=smoke --doc=/tmp/smoke.md \
      --results=/tmp/smoke.json                                       # plumbing
  .venv/bin/python -m benchmarks.self_healing --signals=kl,grad_cos  # the forecast's signals too

Each (model, seed) runs `configs/tiny.py:model=<model>,seed=<seed>` twice, once as it is (no
guard) and once with `guard=repair` (cascade/guard.py: probes of the earlier domains between
steps, a MOPD stage inserted after a stage that left one past its bound, and the forecast of
forgetting, cascade/forecast.py), each a `python -m cascade.main` subprocess into
<workdir_root>/tiny_model-<model>[-guard-repair]_s<seed>, one at a time (two at a time on a
2-core host slow each other down, so their wall times would not compare; `--sides` picks which
of the two this call runs).

Every finished run is kept in `--results` (benchmarks/results/self_healing.json, committed: a
host's run directories do not outlive it), one record per run name: the model, side, seed,
its `cascade.main` command, the code fingerprint (`fingerprint`: the command and the tracked
.py files of CODE_DIRS) and commit it ran, its start, wall seconds (as this script timed them,
wall.json in the workdir), training seconds (every stage's step times, probes and inserted
stages included: results.json "accounting"), load average before and after, host, results.json's
matrix, validation, ledger, inserted stages, guards and forecasts, and each guarded stage's
deciding probe (`probe_stats`: its drop and the drop's paired and independent standard
errors). A run recorded under the fingerprint it would run now is not run again; a finished
workdir is read back, not rerun (one that ran other code is recorded under its own fingerprint
and commit: remove it to rerun); `--norun` runs nothing (it records what has finished). `--isolation=none` runs code rewards and the code suite without the bubblewrap
sandbox (a host without `bwrap`; recorded in each results.json).

`--doc` (docs/self_healing.md) is rendered from the record file alone (`page`, `--render_only`
reads nothing else): per run its command, fingerprint, commit, start, wall and load (with the
load warning where the host was busier than its cores), its held-out matrix (inserted stages
marked, with the drops that made them run) and, for a repair run, its deciding probes; per pair:
  * each domain's final held-out score off and with repair, and how far below its best row
    (any stage's) the run ended (the repair run's validation ledger best too);
  * every RL stage's own-domain gain off and with repair;
  * training and wall seconds, with the repair / off ratio of each;
and over all repair runs the forecast's accuracy (results.json "forecast": each guarded
stage's forecast of each protected domain's change from its first probes, against the
outcome): the mean absolute error and, for every outcome that fell more than 5 points,
whether the forecast's sign was right. With `--signals` the repair runs also measure the
forecast's signals (`--config.guard.signals`, cascade/signals.py: KL drift and gradient
cosine; their workdirs end in `-signals`), and the page adds each predictor's sign accuracy
(the gradient cosine alone, the combined sign) and the mean KL drift of the falls and of the
rest; results without the signals' keys read as before. The runs missing from the grid
(both models, both sides, seeds 0-2) are named.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Mapping, Sequence

from absl import app
from absl import flags

from benchmarks import host

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ('hybrid', 'dense')
SIDES = ('off', 'repair')
# A forecast's sign is checked on every outcome that fell more than this many points.
BIG_FALL = 5.0
WALL = 'wall.json'

_MODELS = flags.DEFINE_list('models', list(MODELS), 'Tiny policies (configs/tiny.py model=).')
_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Run seeds (and worlds).')
_WORKDIR_ROOT = flags.DEFINE_string('workdir_root', 'runs/self_healing',
                                    'Each run goes to <root>/tiny_model-<model>[-guard-repair]'
                                    '_s<seed>.')
_DOC = flags.DEFINE_string('doc', 'docs/self_healing.md', 'The page written.')
_RUN = flags.DEFINE_bool('run', True, 'Run what has not finished (else only read back).')
_CONFIG_ARG = flags.DEFINE_string('config_arg', '', "Extra config argument of every run, e.g. "
                                  "'smoke' (the plumbing in minutes; the numbers mean nothing).")
_SIDES = flags.DEFINE_list('sides', list(SIDES), "Which of each pair's runs this call may run "
                          "('off', 'repair'); the page shows every finished one.")
_SIGNALS = flags.DEFINE_list('signals', [], "The forecast's signals the repair runs measure "
                             "(config.guard.signals: kl, grad_cos); [] none.")
_ISOLATION = flags.DEFINE_string('isolation', '', "Code rewards' sandbox, e.g. 'none' (a host "
                                 "without bwrap); '' keeps the config's.")
_RESULTS = flags.DEFINE_string('results', 'benchmarks/results/self_healing.json',
                               'The record of every finished run the page is rendered from.')
_RENDER_ONLY = flags.DEFINE_bool('render_only', False, 'Run and read nothing: write --doc from '
                                 '--results alone.')


def run_name(model: str, side: str, seed: int, extra: str | None = None,
             signals: bool | None = None) -> str:
  """'hybrid', 'repair', 0 -> 'tiny_model-hybrid-guard-repair_s0' (with --config_arg=smoke:
  'tiny_smoke_model-hybrid-guard-repair_s0'); `extra` and `signals` default to the flags'."""
  extra = _CONFIG_ARG.value if extra is None else extra
  signals = bool(_SIGNALS.value) if signals is None else signals
  extra = re.sub(r'[^A-Za-z0-9]+', '-', extra).strip('-')
  return (f'tiny{"_" + extra if extra else ""}_model-{model}'
          + ('-guard-repair' if side == 'repair' else '')
          + ('-signals' if side == 'repair' and signals else '') + f'_s{seed}')


def config_arg(model: str, side: str, seed: int, extra: str | None = None) -> str:
  """The run's configs/tiny.py argument; `extra` defaults to --config_arg."""
  extra = _CONFIG_ARG.value if extra is None else extra
  return ','.join([f'model={model}'] + (['guard=repair'] if side == 'repair' else [])
                  + ([extra] if extra else []) + [f'seed={seed}'])


def command(model: str, side: str, seed: int, workdir: str) -> list[str]:
  """The `cascade.main` command of one run."""
  cmd = [sys.executable, '-m', 'cascade.main',
         f'--config={REPO}/configs/tiny.py:{config_arg(model, side, seed)}',
         f'--workdir={workdir}', '--verbosity=-1']
  if side == 'repair' and _SIGNALS.value:
    cmd.append(f'--config.guard.signals={",".join(_SIGNALS.value)}')
  if _ISOLATION.value:
    # The code domain's verifier and the world's code suite (graded after every row).
    iso = json.dumps({'tiny_code': {'isolation': _ISOLATION.value}})
    cmd += [f'--config.domains.code.verifier_options.isolation={_ISOLATION.value}',
            f'--config.eval.suite_options={iso}']
  return cmd


# What a run's numbers depend on: the code of these packages (their tracked .py files) and
# the run's command line (`fingerprint`).
CODE_DIRS = ('cascade', 'configs', 'envs', 'foundation', 'models', 'rl', 'tiny_world',
             'verifiers')


def code_files(repo: str = REPO) -> list[str]:
  """The tracked .py files of CODE_DIRS (repository-relative, sorted)."""
  out = subprocess.run(['git', 'ls-files', '--', *CODE_DIRS], cwd=repo, capture_output=True,
                       text=True, check=True).stdout.split()
  return sorted(f for f in out if f.endswith('.py'))


def fingerprint(cmd: Sequence[str], repo: str = REPO) -> str:
  """sha256 (16 hex digits) of a run's command (the interpreter, checkout path and workdir
  left out) and the contents of `code_files` in the working tree: two runs with the same
  fingerprint ran the same code on the same config."""
  h = hashlib.sha256()
  args = [a.replace(repo, '<repo>') for a in cmd[1:] if not a.startswith('--workdir=')]
  h.update('\0'.join(args).encode())
  for f in code_files(repo):
    h.update(f'\0{f}\0'.encode())
    with open(os.path.join(repo, f), 'rb') as fh:
      h.update(fh.read())
  return h.hexdigest()[:16]


def read_run(workdir: str) -> dict | None:
  """{'results': results.json, 'wall': wall.json} of a finished run: one whose command this
  script saw exit 0 (it writes wall.json then; results.json alone is written after every row,
  so a killed run has one too); None: none."""
  try:
    with open(os.path.join(workdir, WALL), encoding='utf-8') as f:
      wall = json.load(f)
    with open(os.path.join(workdir, 'results.json'), encoding='utf-8') as f:
      res = json.load(f)
  except (OSError, ValueError):
    return None
  return {'results': res, 'wall': wall}


def run_one(model: str, side: str, seed: int, workdir: str) -> dict:
  """Runs one cascade (resuming its workdir), times it into <workdir>/wall.json, reads it."""
  cmd = command(model, side, seed, workdir)
  print(f'running {run_name(model, side, seed)} -> {workdir}', flush=True)
  fp, commit = fingerprint(cmd), _commit()      # the code it starts with
  load, t0 = os.getloadavg(), time.time()
  p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
  if p.returncode:
    raise RuntimeError(f'{" ".join(cmd)} exited {p.returncode}:\n{p.stderr[-4000:]}')
  wall = {'seconds': round(time.time() - t0, 1),
          'started': f'{datetime.datetime.fromtimestamp(t0, datetime.timezone.utc):%H:%M} UTC',
          'load_before': list(load),
          'load_after': list(os.getloadavg()), 'command': ' '.join(cmd[1:]),
          'fingerprint': fp, 'commit': commit}
  with open(os.path.join(workdir, WALL), 'w', encoding='utf-8') as f:
    json.dump(wall, f, indent=1)
  return read_run(workdir)


def _commit() -> str:
  """HEAD's commit ('+' when the working tree differs from it), or '' outside git."""
  try:
    head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(['git', 'status', '--porcelain', '--', *CODE_DIRS], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return ''
  return head + ('+' if dirty else '')


def training_seconds(res: Mapping) -> float:
  """Every stage's step seconds (results.json "accounting": probes and inserted stages in)."""
  return float(sum(a.get('step_s', 0.0) for a in (res.get('accounting') or {}).values()))


def rl_gains(res: Mapping) -> dict[str, float]:
  """stage -> its own-domain gain (mean over the domains it trains) against the row before,
  for the stages that are neither the first row nor inserted."""
  inserted = res.get('inserted') or [None] * len(res['stages'])
  out = {}
  for i in range(1, len(res['stages'])):
    if inserted[i]:
      continue
    js = [res['domains'].index(d) for d in res['stage_domains'][i]]
    if not js or len(js) == len(res['domains']):
      continue
    row, prev = res['scores'][i], res['scores'][i - 1]
    out[res['stages'][i]] = sum(row[j] - prev[j] for j in js) / len(js)
  return out


def below_best(res: Mapping) -> dict[str, float]:
  """domain -> how far the final held-out row lies below the domain's best row."""
  out = {}
  for j, d in enumerate(res['domains']):
    col = [r[j] for r in res['scores'] if r[j] is not None]
    if col:
      out[d] = max(col) - col[-1]
  return out


def below_ledger(res: Mapping) -> dict[str, float]:
  """domain -> how far the final validation row lies below the ledger's best validation (runs
  with validation sets: the guarded ones)."""
  val, led = res.get('validation'), res.get('ledger') or {}
  if not val:
    return {}
  return {d: led[d]['validation'] - val[-1][j] for j, d in enumerate(res['domains'])
          if d in led and val[-1][j] is not None}


def inserted_stages(res: Mapping) -> list[str]:
  """'<stage> (repairs <stage>: <domain> -<drop>, ...)' for each inserted row."""
  out = []
  for name, ins in zip(res['stages'], res.get('inserted') or []):
    if ins:
      drops = ', '.join(f'{d} -{v:.1f}' for d, v in sorted((ins.get('drops') or {}).items()))
      out.append(f'{name} (repairs {ins.get("repairs")}: probe drops {drops})')
  return out


def forecast_accuracy(rows: Sequence[Mapping]) -> dict:
  """`cascade.forecast.accuracy` over `rows` (results.json "forecast" rows, pooled)."""
  from cascade import forecast as forecast_lib  # pylint: disable=g-import-not-at-top
  return forecast_lib.accuracy(rows, BIG_FALL)


def signal_sentence(acc: Mapping) -> str:
  """The page's per-signal accuracy (`forecast_accuracy`'s keys of rows with signals; '' for
  results without them)."""
  if 'falls_grad_cos' not in acc:
    return ''
  return (f' With the signals (cascade/signals.py): the gradient cosine\'s sign was right on '
          f'{acc["falls_sign_right_grad_cos"]} of the {acc["falls_grad_cos"]} falls it was '
          f'defined on, the combined sign on {acc["falls_sign_right_combined"]} of '
          f'{acc["falls_combined"]}; mean KL drift (nats per token) of the falls '
          f'{_f(acc["kl_mean_falls"], "{:.3g}")}, of the rest {_f(acc["kl_mean_rest"], "{:.3g}")}.')


def forecast_table(rows: Sequence[Mapping]) -> list[str]:
  """The page's forecast rows; with the signals' columns where some row has them."""
  from cascade import evaluation  # pylint: disable=g-import-not-at-top
  sig = any('falls' in r for r in rows)
  head = '| run | stage | domain | from steps 0..k | forecast | outcome |'
  rule = '|---|---|---|---:|---:|---:|'
  if sig:
    head += ' KL | grad cos | sign with signals |'
    rule += '---:|---:|---|'
  out = [head, rule]
  for r in rows:
    line = (f'| {r["run"]} | {r["stage"]} | {r["domain"]} | {r["at_step"]} of {r["steps"]} | '
            f'{r["forecast"]:+.1f} ± {r["stderr"]:.1f} | {_f(r.get("outcome"))} |')
    if sig:
      line += f' {evaluation.signal_cells(r)} |'
    out.append(line)
  return out


def matrix(res: Mapping) -> str:
  from cascade import evaluation  # pylint: disable=g-import-not-at-top
  return evaluation.markdown(res, extra=False)


def _f(x, fmt='{:+.1f}') -> str:
  return '-' if x is None else fmt.format(x)


def pair_lines(model: str, seed: int, off: Mapping | None, rep: Mapping | None) -> list[str]:
  """The page's section of one (model, seed): what finished of its two runs."""
  out = [f'## {model}, seed {seed}', '']
  for side, run in (('off', off), ('repair', rep)):
    if run is None:
      out += [f'`guard={side}`: not recorded (missing).', '']
      continue
    res = run['results']
    out += [f'`{run["record"]["config_arg"]}`:', ''] + run_header(run['record'])
    out += ['Held-out matrix:', '', matrix(res)]
    if side == 'repair':
      ins = inserted_stages(res)
      out += ['Inserted: ' + ('; '.join(ins) if ins else 'none') + '.', '']
      out += probe_lines(run['record'])
  if off is None or rep is None:
    return out
  a, b = off['results'], rep['results']
  ba, bb, bl = below_best(a), below_best(b), below_ledger(b)
  out += ['| domain | final off | final repair | below best row, off | below best row, repair '
          '| below ledger best (validation), repair |', '|---|---:|---:|---:|---:|---:|']
  for j, d in enumerate(a['domains']):
    out.append(f'| {d} | {a["scores"][-1][j]:.1f} | {b["scores"][-1][j]:.1f} | '
               f'{ba.get(d, 0):.1f} | {bb.get(d, 0):.1f} | {_f(bl.get(d), "{:.1f}")} |')
  ga, gb = rl_gains(a), rl_gains(b)
  out += ['', '| RL stage | own-domain gain off | with repair | difference |',
          '|---|---:|---:|---:|']
  for st in ga:
    out.append(f'| {st} | {ga[st]:+.1f} | {_f(gb.get(st))} | '
               f'{_f(None if st not in gb else gb[st] - ga[st])} |')
  ta, tb = training_seconds(a), training_seconds(b)
  wa, wb = ((r['wall'] or {}).get('seconds') for r in (off, rep))
  out += ['', f'Training seconds (step times of every stage): off {ta:.0f}, repair {tb:.0f}'
          + (f', ratio {tb / ta:.2f}' if ta else '') + '. Wall seconds (this script\'s timing): '
          + (f'off {wa:.0f}, repair {wb:.0f}, ratio {wb / wa:.2f}' if wa and wb
             else 'not timed by this script for both runs') + '.', '']
  return out


# --- The record of finished runs (benchmarks/results/self_healing.json) -------------------------

# results.json's fields a record keeps: what the page shows.
KEPT = ('domains', 'stages', 'stage_domains', 'scores', 'inserted', 'validation', 'ledger',
        'forecast', 'guards')
# The grid the page names missing runs of.
GRID_SEEDS = (0, 1, 2)


def load_results(path: str) -> dict:
  """The record file as {run name: record} ({} when there is none yet)."""
  if not os.path.exists(path):
    return {}
  try:
    with open(path, encoding='utf-8') as f:
      data = json.load(f)
    return dict(data['runs'])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise SystemExit(f'{path}: not a self_healing record file ({e})') from None


def save_results(path: str, records: Mapping[str, Mapping]) -> None:
  """Writes the record file (atomically: a killed call leaves the old one)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    json.dump({'runs': {k: records[k] for k in sorted(records)}}, f, indent=1, sort_keys=True)
    f.write('\n')
  os.replace(path + '.tmp', path)


def probe_stats(workdir: str) -> list[dict]:
  """Each guarded stage's last probe of each protected domain (the one that decides a repair),
  from the run's progress.json ledger: its drop below the domain's best earlier probe, the
  drop's paired standard error (`cascade.guard.drop_stderr`, with the prompts it paired) and the
  independent one (sqrt(se_best^2 + se^2)); [] for a run without probes."""
  from cascade import guard as guard_lib  # pylint: disable=g-import-not-at-top
  try:
    with open(os.path.join(workdir, 'progress.json'), encoding='utf-8') as f:
      ledger = json.load(f).get('ledger') or []
  except (OSError, ValueError):
    return []
  probes = [e for e in ledger if e.get('set') == 'probe']
  out = []
  for stage in dict.fromkeys(e['stage'] for e in probes):
    if stage.endswith('_repair'):
      continue
    mine = [e for e in probes if e['stage'] == stage]
    last = mine[-1]
    earlier = [e for e in probes if e is not last and (e['index'], e['step']) < (last['index'],
                                                                                 last['step'])]
    for d in sorted(last['scores']):
      best = max((e for e in earlier if d in e['scores']), key=lambda e: e['scores'][d],
                 default=None)
      if best is None:
        continue
      now = {'score': last['scores'][d], 'stderr': last['stderr'].get(d, 0.0),
             'prompt_scores': (last.get('prompt_scores') or {}).get(d)}
      se, how = guard_lib.drop_stderr(best, d, now)
      out.append({'stage': stage, 'domain': d, 'step': last['step'],
                  'drop': round(best['scores'][d] - last['scores'][d], 4),
                  'se_paired': round(se, 4) if how['paired'] else None,
                  'pairs': how.get('pairs', 0),
                  'se_independent': round(math.hypot(best['stderr'].get(d, 0.0),
                                                     now['stderr']), 4),
                  'breached': d in (last.get('breached') or {})})
  return out


def record_of(model: str, side: str, seed: int, workdir: str, run: Mapping) -> dict:
  """The record of one finished run (its workdir's results.json and wall.json)."""
  res, w = run['results'], run['wall'] or {}
  wall_path = os.path.join(workdir, WALL)
  finished = (datetime.datetime.fromtimestamp(os.path.getmtime(wall_path), datetime.timezone.utc)
              if os.path.exists(wall_path) else None)
  started = (finished - datetime.timedelta(seconds=w['seconds'])
             if finished is not None and w.get('seconds') else None)
  shown = ' '.join(a.replace(REPO + '/', '') for a in w.get('command', '').split()
                   if not a.startswith('--workdir='))
  return {'name': os.path.basename(os.path.normpath(workdir)), 'model': model, 'side': side,
          'seed': seed, 'config_arg': config_arg(model, side, seed),
          'command': f'python {shown}' if shown else '',
          'fingerprint': w.get('fingerprint', ''), 'commit': w.get('commit', ''),
          'started': f'{started:%Y-%m-%d %H:%M} UTC' if started else '',
          'wall_s': w.get('seconds'), 'training_s': round(training_seconds(res), 1),
          'load_before': [round(x, 2) for x in w.get('load_before') or []],
          'load_after': [round(x, 2) for x in w.get('load_after') or []],
          'cpu': host.cpu_name(), 'cores': os.cpu_count(),
          'results': {k: res[k] for k in KEPT if k in res},
          'accounting': {k: {'step_s': v.get('step_s', 0.0)}
                         for k, v in (res.get('accounting') or {}).items()},
          'probes': probe_stats(workdir), 'guard': guard_settings(workdir)}


def guard_settings(workdir: str) -> dict:
  """The run's config.guard probe settings (config.json: prompts, every, max_drop, stderrs,
  action); {} for a run without a guard."""
  try:
    with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
      guard = json.load(f)['config'].get('guard') or {}
  except (OSError, ValueError, KeyError, AttributeError):
    return {}
  if not guard:
    return {}
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  fields = config_lib.Guard.__dataclass_fields__      # a field the config left out: its default
  return {k: guard.get(k, fields[k].default)
          for k in ('action', 'prompts', 'every', 'max_drop', 'stderrs')}


def as_run(rec: Mapping) -> dict:
  """A record as the page's run: {'results': results.json's kept fields (and its step
  seconds), 'wall': its timing}."""
  return {'results': {**rec['results'], 'accounting': rec.get('accounting') or {}},
          'wall': {'seconds': rec.get('wall_s'), 'started': rec.get('started'),
                   'load_before': rec.get('load_before'), 'load_after': rec.get('load_after')},
          'record': rec}


def record_runs(models, seeds, root: str, path: str, run: bool) -> dict[str, dict]:
  """Records every (model, side, seed) of the call not yet recorded under the code it would
  run now (its `fingerprint`): a finished workdir is read back (one that ran other code is
  recorded under the fingerprint and commit it ran with, once; remove it to rerun), else (`run`
  and a side of --sides) the cascade runs; each record is written to `path` as it is taken.
  Returns the records."""
  records = load_results(path)
  for seed in seeds:
    for model in models:
      for side in SIDES:
        name = run_name(model, side, seed)
        workdir = os.path.join(root, name)
        fp = fingerprint(command(model, side, seed, workdir))
        if records.get(name, {}).get('fingerprint') == fp:
          print(f'{name}: recorded for this code ({fp}), not rerun', flush=True)
          continue
        got = read_run(workdir)
        if got is not None:
          was = got['wall'].get('fingerprint')
          if was != fp:
            if records.get(name, {}).get('fingerprint') == was:
              print(f'{name}: {workdir} finished with other code (fingerprint {was}, now {fp}), '
                    'recorded as that; remove it to rerun', flush=True)
              continue
            print(f'{name}: {workdir} finished with other code (fingerprint {was}, now {fp}): '
                  'recorded under its own fingerprint and commit', flush=True)
        elif run and side in _SIDES.value:
          got = run_one(model, side, seed, workdir)
        else:
          continue
        records[name] = record_of(model, side, seed, workdir, got)
        save_results(path, records)
        print(f'{name}: recorded in {path}', flush=True)
  return records


def runs_from(records: Mapping[str, Mapping]) -> dict[tuple, dict | None]:
  """(model, side, seed) -> the recorded run, None for the grid's (MODELS x SIDES x GRID_SEEDS,
  and every recorded seed) unrecorded ones."""
  seeds = sorted(set(GRID_SEEDS) | {int(r['seed']) for r in records.values()})
  by_key = {(r['model'], r['side'], int(r['seed'])): as_run(r) for r in records.values()}
  return {(m, side, seed): by_key.get((m, side, seed))
          for seed in seeds for m in MODELS for side in SIDES}


def summary(runs: Mapping[tuple, dict | None]) -> dict:
  """The JSON summary: per pair the largest final drop below the best row, the time ratios;
  the pooled forecast accuracy; the missing runs."""
  out = {'pairs': {}, 'missing': sorted(run_name(*k, extra='', signals=False)
                                        for k, v in runs.items() if v is None)}
  fc = []
  for (model, side, seed), run in sorted(runs.items()):
    if run is None:
      continue
    res = run['results']
    if side == 'repair':
      fc += res.get('forecast') or []
    key = f'{model}_s{seed}'
    p = out['pairs'].setdefault(key, {})
    p[side] = {'worst_below_best': round(max(below_best(res).values(), default=0.0), 2),
               'training_s': round(training_seconds(res), 1),
               'wall_s': (run['wall'] or {}).get('seconds'),
               'inserted': inserted_stages(res)}
  out['forecast'] = forecast_accuracy(fc)
  return out


def probe_lines(rec: Mapping) -> list[str]:
  """The page's table of a guarded run's deciding probes (`probe_stats`), with the bound each
  standard error gives at the run's max_drop and stderrs."""
  rows = rec.get('probes') or []
  if not rows:
    return []
  g = rec.get('guard') or {}
  md, k = float(g.get('max_drop', 3.0)), float(g.get('stderrs', 2.0))
  out = ['Each guarded stage\'s last probe (it decides a repair): the drop below the domain\'s '
         'best earlier probe, its standard error paired prompt by prompt (the guard\'s) and as '
         f'if the probes were independent, and the bound `{md:g} + {k:g} se` each gives:', '',
         '| stage | domain | step | drop | se paired (prompts) | bound paired | se independent | '
         'bound independent | breached |', '|---|---|---:|---:|---:|---:|---:|---:|---|']
  for r in rows:
    paired = r.get('se_paired')
    out.append(f'| {r["stage"]} | {r["domain"]} | {r["step"]} | {r["drop"]:+.1f} | '
               + (f'{paired:.1f} ({r["pairs"]}) | {md + k * paired:.1f}' if paired is not None
                  else '- | -')
               + f' | {r["se_independent"]:.1f} | {md + k * r["se_independent"]:.1f} | '
               f'{"yes" if r.get("breached") else "no"} |')
  return out + ['']


def run_header(rec: Mapping) -> list[str]:
  """A run's command (a text block: an output sample, not a command the page asks to run),
  fingerprint, commit, start, wall and load (with the load warning)."""
  loads = lambda x: '/'.join(f'{v:.2f}' for v in x) if x else '?'
  out = ['```text', rec['command'] or '?', '```', '',
         f'Code fingerprint {rec.get("fingerprint") or "?"}, commit '
         f'{rec.get("commit") or "?"}; started {rec.get("started") or "?"} on '
         f'{rec.get("cores")} cores of {rec.get("cpu")}, {_f(rec.get("wall_s"), "{:.0f}")} s wall, '
         f'load average (1/5/15 min) {loads(rec.get("load_before"))} before and '
         f'{loads(rec.get("load_after"))} after.', '']
  g = rec.get('guard') or {}
  if g:
    out += [f'Guard: {g.get("action")}, probes of {g.get("prompts")} prompts every '
            f'{g.get("every")} steps, bound {g.get("max_drop")} points + {g.get("stderrs")} '
            'standard errors.', '']
  if rec.get('load_before'):
    warn = host.load_warning(rec['load_before'], rec.get('load_after') or None, rec.get('cores'))
    if warn:
      out += [warn, '']
  return out


def page(records: Mapping[str, Mapping]) -> str:
  """docs/self_healing.md's text: a function of the record file alone."""
  runs = runs_from(records)
  s = summary(runs)
  acc = s['forecast']
  lines = ['# The self-healing cascade on the tiny world', '',
           'Written by `benchmarks/self_healing.py` from its record of every finished run, '
           'benchmarks/results/self_healing.json (`python -m benchmarks.self_healing '
           '--render_only` writes this page again from it; a run is redone only when its code '
           'fingerprint changes). Each run\'s command, code fingerprint, commit, start, wall time, '
           'host and load average are in its section.', '',
           'Missing runs (not recorded): '
           + (', '.join(s['missing']) if s['missing'] else 'none') + '.', '',
           'Forecast of forgetting (cascade/forecast.py: each guarded stage\'s forecast of each '
           'protected domain\'s probe change by its end, from its first probes, against the '
           f'outcome; pooled over the repair runs): {acc["n"]} forecasts, mean absolute error '
           f'{_f(acc["mean_abs_error"], "{:.1f}")} points; outcomes falling more than '
           f'{BIG_FALL:g} points: {acc["falls"]}, forecast sign right on '
           f'{acc["falls_sign_right"]}.' + signal_sentence(acc), '']
  fc_rows = [dict(r, run=v['record']['name']) for k, v in sorted(runs.items())
             if v and k[1] == 'repair'
             for r in v['results'].get('forecast') or []]
  if fc_rows:
    lines += forecast_table(fc_rows) + ['']
  seeds = list(dict.fromkeys(k[2] for k in runs))
  for seed in seeds:
    for model in MODELS:
      off, rep = runs.get((model, 'off', seed)), runs.get((model, 'repair', seed))
      if off is None and rep is None:
        continue
      lines += pair_lines(model, seed, off, rep)
  return '\n'.join(lines).rstrip() + '\n'


def main(argv: Sequence[str]) -> None:
  del argv
  load_before = os.getloadavg()
  for m in _MODELS.value:
    if m not in MODELS:
      raise app.UsageError(f'--models: {m!r} is not one of {", ".join(MODELS)}')
  try:
    seeds = [int(s) for s in _SEEDS.value]
  except ValueError:
    raise app.UsageError(f'--seeds: {",".join(_SEEDS.value)!r} is not a list of ints') from None
  if _RENDER_ONLY.value:
    records = load_results(_RESULTS.value)
  else:
    records = record_runs(_MODELS.value, seeds, _WORKDIR_ROOT.value, _RESULTS.value,
                          _RUN.value)
  text = page(records)
  host.print_load_warning(load_before)
  os.makedirs(os.path.dirname(os.path.abspath(_DOC.value)), exist_ok=True)
  with open(_DOC.value, 'w', encoding='utf-8') as f:
    f.write(text)
  print(f'wrote {_DOC.value}')
  print(json.dumps(summary(runs_from(records))))


if __name__ == '__main__':
  app.run(main)
