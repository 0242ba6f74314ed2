"""The self-healing cascade on the tiny world: guards off against `guard=repair`, over seeds.

  .venv/bin/python -m benchmarks.self_healing                         # hybrid and dense, seeds 0,1,2
  .venv/bin/python -m benchmarks.self_healing --models=hybrid --seeds=0
  .venv/bin/python -m benchmarks.self_healing --norun                 # the page from finished runs
  .venv/bin/python -m benchmarks.self_healing --config_arg=smoke --doc=/tmp/smoke.md  # plumbing
  .venv/bin/python -m benchmarks.self_healing --signals=kl,grad_cos  # the forecast's signals too

Each (model, seed) runs `configs/tiny.py:model=<model>,seed=<seed>` twice, once as it is (no
guard) and once with `guard=repair` (cascade/guard.py: probes of the earlier domains between
steps, a MOPD stage inserted after a stage that left one past its bound, and the forecast of
forgetting, cascade/forecast.py), each a `python -m cascade.main` subprocess into
<workdir_root>/tiny_model-<model>[-guard-repair]_s<seed>, one at a time (two at a time on a
2-core host slow each other down, so their wall times would not compare; `--sides` picks which
of the two this call runs, so two calls can run them side by side under the same load: the page
gives each run's start and load). A workdir whose run
finished is read back, not rerun; `--norun` runs nothing and writes the page from what has
finished, naming the runs that are missing. `--isolation=none` runs code rewards and the code
suite without the bubblewrap sandbox (a host without `bwrap`; recorded in each results.json).

Writes `--doc` (docs/self_healing.md): the command, date, host and load average; per run its
held-out matrix (inserted stages marked, with the drops that made them run); per pair:
  * each domain's final held-out score off and with repair, and how far below its best row
    (any stage's) the run ended (the repair run's validation ledger best too);
  * every RL stage's own-domain gain off and with repair;
  * wall time: the run's seconds as this script timed it (`wall.json` in the workdir), and
    its training seconds (every stage's step times, probes and inserted stages included:
    results.json "accounting"), with the repair / off ratio of each;
and over all repair runs the forecast's accuracy (results.json "forecast": each guarded
stage's forecast of each protected domain's change from its first probes, against the
outcome): the mean absolute error and, for every outcome that fell more than 5 points,
whether the forecast's sign was right. With `--signals` the repair runs also measure the
forecast's signals (`--config.guard.signals`, cascade/signals.py: KL drift and gradient
cosine; their workdirs end in `-signals`), and the page adds each predictor's sign accuracy
(the gradient cosine alone, the combined sign) and the mean KL drift of the falls and of the
rest; results without the signals' keys read as before.
"""

from __future__ import annotations

import datetime
import hashlib
import json
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


def run_name(model: str, side: str, seed: int) -> str:
  """'hybrid', 'repair', 0 -> 'tiny_model-hybrid-guard-repair_s0' (with --config_arg=smoke:
  'tiny_smoke_model-hybrid-guard-repair_s0')."""
  extra = re.sub(r'[^A-Za-z0-9]+', '-', _CONFIG_ARG.value).strip('-')
  return (f'tiny{"_" + extra if extra else ""}_model-{model}'
          + ('-guard-repair' if side == 'repair' else '')
          + ('-signals' if side == 'repair' and _SIGNALS.value else '') + f'_s{seed}')


def config_arg(model: str, side: str, seed: int) -> str:
  return ','.join([f'model={model}'] + (['guard=repair'] if side == 'repair' else [])
                  + ([_CONFIG_ARG.value] if _CONFIG_ARG.value else []) + [f'seed={seed}'])


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
  """{'results': results.json, 'wall': wall.json or None} of a finished run (None: none)."""
  try:
    with open(os.path.join(workdir, 'results.json'), encoding='utf-8') as f:
      res = json.load(f)
  except (OSError, ValueError):
    return None
  try:
    with open(os.path.join(workdir, WALL), encoding='utf-8') as f:
      wall = json.load(f)
  except (OSError, ValueError):
    wall = None
  return {'results': res, 'wall': wall}


def run_one(model: str, side: str, seed: int, workdir: str) -> dict:
  """Runs one cascade (resuming its workdir), times it into <workdir>/wall.json, reads it."""
  cmd = command(model, side, seed, workdir)
  print(f'running {run_name(model, side, seed)} -> {workdir}', flush=True)
  fp = fingerprint(cmd)
  load, t0 = os.getloadavg(), time.time()
  p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
  if p.returncode:
    raise RuntimeError(f'{" ".join(cmd)} exited {p.returncode}:\n{p.stderr[-4000:]}')
  wall = {'seconds': round(time.time() - t0, 1),
          'started': f'{datetime.datetime.fromtimestamp(t0, datetime.timezone.utc):%H:%M} UTC',
          'load_before': list(load),
          'load_after': list(os.getloadavg()), 'command': ' '.join(cmd[1:]),
          'fingerprint': fp, 'commit': _commit()}
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
      out += [f'`guard={side}`: not run (missing).', '']
      continue
    res = run['results']
    w = run['wall'] or {}
    timed = (f' (run by this script from {w.get("started", "?")}, {w["seconds"]:.0f} s, one-minute '
             f'load {w["load_before"][0]:.1f} -> {w["load_after"][0]:.1f})'
             if w.get('seconds') and w.get('load_before') and w.get('load_after') else '')
    out += [f'`{config_arg(model, side, seed)}`{timed} held-out matrix:', '', matrix(res)]
    if side == 'repair':
      ins = inserted_stages(res)
      out += ['Inserted: ' + ('; '.join(ins) if ins else 'none') + '.', '']
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


def summary(runs: Mapping[tuple, dict | None]) -> dict:
  """The JSON summary: per pair the largest final drop below the best row, the time ratios;
  the pooled forecast accuracy; the missing runs."""
  out = {'pairs': {}, 'missing': sorted(run_name(*k) for k, v in runs.items() if v is None)}
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


def runs_of(models, seeds, root: str, run: bool) -> dict[tuple, dict | None]:
  """(model, side, seed) -> the run (run here when `run` and unfinished), None when missing."""
  out = {}
  for seed in seeds:
    for model in models:
      for side in SIDES:
        workdir = os.path.join(root, run_name(model, side, seed))
        got = read_run(workdir)
        if got is None and run and side in _SIDES.value:
          got = run_one(model, side, seed, workdir)
        out[(model, side, seed)] = got
  return out


def page(runs, load_before, warning: str | None, argv: Sequence[str]) -> str:
  """docs/self_healing.md's text."""
  loads = lambda x: '/'.join(f'{v:.2f}' for v in x)
  s = summary(runs)
  acc = s['forecast']
  lines = ['# The self-healing cascade on the tiny world', '',
           f'Written by `benchmarks/self_healing.py` on '
           f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: '
           f'`python -m benchmarks.self_healing {" ".join(argv)}` on {os.cpu_count()} cores of '
           f'{host.cpu_name()}; load average (1/5/15 min) {loads(load_before)} before and '
           f'{loads(os.getloadavg())} after (each run\'s own load is in its wall.json).', '']
  if warning:
    lines += [warning, '']
  lines += ['Missing runs (not finished when this page was written): '
            + (', '.join(s['missing']) if s['missing'] else 'none') + '.', '',
            'Forecast of forgetting (cascade/forecast.py: each guarded stage\'s forecast of each '
            'protected domain\'s probe change by its end, from its first probes, against the '
            f'outcome; pooled over the repair runs): {acc["n"]} forecasts, mean absolute error '
            f'{_f(acc["mean_abs_error"], "{:.1f}")} points; outcomes falling more than '
            f'{BIG_FALL:g} points: {acc["falls"]}, forecast sign right on '
            f'{acc["falls_sign_right"]}.' + signal_sentence(acc), '']
  fc_rows = [dict(r, run=run_name(*k)) for k, v in sorted(runs.items()) if v and k[1] == 'repair'
             for r in v['results'].get('forecast') or []]
  if fc_rows:
    lines += forecast_table(fc_rows) + ['']
  models = list(dict.fromkeys(k[0] for k in runs))
  seeds = list(dict.fromkeys(k[2] for k in runs))
  for seed in seeds:
    for model in models:
      lines += pair_lines(model, seed, runs.get((model, 'off', seed)),
                          runs.get((model, 'repair', seed)))
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
  runs = runs_of(_MODELS.value, seeds, _WORKDIR_ROOT.value, _RUN.value)
  warning = host.print_load_warning(load_before)
  text = page(runs, load_before, warning, sys.argv[1:])
  os.makedirs(os.path.dirname(os.path.abspath(_DOC.value)), exist_ok=True)
  with open(_DOC.value, 'w', encoding='utf-8') as f:
    f.write(text)
  print(f'wrote {_DOC.value}')
  print(json.dumps(summary(runs)))


if __name__ == '__main__':
  app.run(main)
