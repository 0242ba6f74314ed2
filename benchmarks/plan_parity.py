"""Plan parity across a merge: `launch.plan` of the same config before and after, compared.

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 TPU_VENV/bin/python -m benchmarks.plan_parity \\
      --merges=7c27f6d,9e51889 --cases=c2_train,c14b,c8b --repeats=2 \\
      --workdir=/tmp/plan_parity --page=docs/plans/wing_parity.md

For each merge commit M it plans each case on M's first parent (before) and on M (after), each
tree a detached git worktree under --workdir, each plan a process of its own running that
tree's own `launch.plan` (the Python of this command: the TPU compiler's environment,
docs/planning.md), before and after alternating (before, after, then after, before, ...) so a
change of the host's load falls on both sides alike. Each plan leaves a JSON file of its stage
reports (`launch.plan.results`: every program's memory, FLOPs, collectives and compile seconds;
each stage's step-time bound); a rerun skips the plans whose JSON is there.

`differences` sets the before and after JSON side by side: per program the memory
(arguments, outputs, temporaries, aliases, total), FLOPs, collective seconds, collectives and
error, per stage the resident bytes and the step-time bound (overlapped and serial). Any
difference is written on the page and the command exits 1. Compile seconds are not compared:
they are measured, per program and repeat, wall and CPU, beside the load average before and
after each plan.

A case is a label and `launch.plan` flags (`CASES`; --cases picks them). A behaviour-preserving
change must give equal plans; a change of a recipe (a stage's batch, TIS, routing replay) is not
one, so --merges names only merges that claim to preserve behaviour.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Sequence

from absl import app
from absl import flags

from benchmarks import host

# label -> launch.plan flags. The paper configs, each restricted to what a 2-core host compiles
# in minutes: Cascade 2's train steps (and its frozen passes) first, then its code-RL sampler,
# then the dense recipes' math-RL programs (train step, sampler, prefill).
CASES = {
    'c2_train': ['--config=configs/nemotron_cascade2.py', '--stages=sft,code_rl',
                 '--nosampler', '--noeval', '--backend=tpu'],
    'c2_mopd_train': ['--config=configs/nemotron_cascade2.py', '--stages=mopd',
                      '--nosampler', '--noeval', '--backend=tpu'],
    'c2_sampler': ['--config=configs/nemotron_cascade2.py', '--stages=code_rl', '--notrain',
                   '--noeval', '--backend=tpu'],
    # Every stage's step-time bound, nothing compiled (seconds): FLOPs and bytes counted from
    # the config and the sampler's traced programs.
    'c2_time': ['--config=configs/nemotron_cascade2.py', '--time_only'],
    'c14b_time': ['--config=configs/nemotron_cascade_14b.py', '--time_only'],
    'c14b_moe_time': ['--config=configs/nemotron_cascade_14b.py:model=qwen3_30b_a3b',
                      '--time_only'],
    'c8b_time': ['--config=configs/nemotron_cascade_8b.py', '--time_only'],
    'c14b': ['--config=configs/nemotron_cascade_14b.py', '--stages=math_rl', '--noeval',
             '--backend=tpu'],
    'c8b': ['--config=configs/nemotron_cascade_8b.py', '--stages=math_rl', '--noeval',
            '--backend=tpu'],
}

_MERGES = flags.DEFINE_list('merges', ['7c27f6d', '9e51889'],
                            'Merge commits: each is planned against its first parent.')
_CASES = flags.DEFINE_list('cases', ['c2_train'], f'Which of {sorted(CASES)} to plan.')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Plans per side (alternating before/after).')
_WORKDIR = flags.DEFINE_string('workdir', '/tmp/plan_parity', 'Worktrees and JSON files.')
_PAGE = flags.DEFINE_string('page', None, 'Write the Markdown page here.')
_PLAN_ONLY = flags.DEFINE_bool('plan', True, 'Run the plans missing (--noplan: page only).')

# Fields that must be equal before and after (compile seconds are measured, not compared).
PROGRAM_FIELDS = ('argument_bytes', 'output_bytes', 'temp_bytes', 'alias_bytes', 'total_bytes',
                  'flops', 'flops_from', 'error', 'collective_s', 'collective_step_s')
STAGE_FIELDS = ('resident', 'steps', 'limit_bytes')
TIME_FIELDS = ('bound', 'serial', 'worst', 'weights_only')
_GIB = 2 ** 30


def collectives(program: dict) -> list[str]:
  """A program's collectives (kind, bytes, device groups, count, loop), sorted, without their HLO
  instruction names (numbering that any edit of the program renumbers)."""
  return sorted(json.dumps({k: v for k, v in c.items() if k != 'name'}, sort_keys=True)
                for c in program.get('collectives') or [])

# Runs in the planned tree (its own launch.plan on PYTHONPATH): plans with the flags after the
# output path and writes the stage reports as JSON there.
_CHILD = r'''
import dataclasses, json, os, sys, time
from launch.plan import cli, stages
out, argv = sys.argv[1], sys.argv[2:]
captured = []
def capturing(original):
  def run(*args, **kwargs):
    reports = original(*args, **kwargs)
    captured.extend(reports)
    return reports
  return run
stages.run_plan, stages.time_plan = capturing(stages.run_plan), capturing(stages.time_plan)
PROPS = ('total_bytes', 'bound', 'serial', 'worst', 'collective')
def plain(x):
  if dataclasses.is_dataclass(x):
    d = {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    d.update({p: plain(getattr(x, p)) for p in PROPS if isinstance(getattr(type(x), p, None), property)})
    return d
  if isinstance(x, (list, tuple)):
    return [plain(v) for v in x]
  if isinstance(x, dict):
    return {str(k): plain(v) for k, v in x.items()}
  return x if isinstance(x, (int, float, str, bool, type(None))) else str(x)
load, start, code = os.getloadavg(), time.time(), 0
sys.argv = ['launch.plan', *argv]
try:
  cli.run()
except SystemExit as e:
  code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
with open(out + '.tmp', 'w') as f:
  json.dump(dict(argv=argv, exit=code, load_before=load, load_after=os.getloadavg(),
                 wall_s=time.time() - start, stages=plain(captured)), f, indent=1)
os.replace(out + '.tmp', out)
'''


def worktree(repo: str, commit: str, path: pathlib.Path) -> pathlib.Path:
  """A detached worktree of `commit` at `path` (made once; reused when it is there)."""
  if not (path / '.git').exists():
    subprocess.run(['git', '-C', repo, 'worktree', 'add', '--detach', str(path), commit],
                   check=True, capture_output=True)
  return path


def resolve(repo: str, rev: str) -> str:
  return subprocess.run(['git', '-C', repo, 'rev-parse', rev], check=True, capture_output=True,
                        text=True).stdout.strip()


def plan_once(tree: pathlib.Path, case: str, out: pathlib.Path) -> dict:
  """Plans `case` with `tree`'s launch.plan in a process of its own (niced), unless `out` is
  there; returns the JSON."""
  if not out.exists():
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tree), ALLOW_MULTIPLE_LIBTPU_LOAD='1')
    # Its output to a file beside the JSON, not a pipe: a plan outlives this process if it is
    # stopped (the JSON is written by the plan itself, and a rerun skips it).
    log = out.with_suffix('.log')
    with open(log, 'w', encoding='utf-8') as f:
      proc = subprocess.run(['nice', '-n', '19', sys.executable, '-c', _CHILD, str(out),
                             *CASES[case]], cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT,
                            check=False)
    if not out.exists():
      raise SystemExit(f'plan {case} in {tree} wrote nothing (exit {proc.returncode}):\n'
                       f'{log.read_text(encoding="utf-8")[-3000:]}')
  run = json.loads(out.read_text())
  # When it started (UTC): the file was written when it ended.
  run.setdefault('started', time.strftime(
      '%H:%M', time.gmtime(out.stat().st_mtime - run.get('wall_s', 0.0))))
  return run


def programs(run: dict) -> dict[tuple[str, str], dict]:
  """(stage, program name + shapes) -> the program's report."""
  return {(s['name'], f"{p['name']} ({p['shapes']})" if p.get('shapes') else p['name']): p
          for s in run['stages'] for p in s['programs']}


def differences(before: dict, after: dict) -> list[str]:
  """Every field of PROGRAM_FIELDS, STAGE_FIELDS and TIME_FIELDS that differs between two plans'
  JSON (and every stage or program only one of them has), one line each; [] when equal."""
  out = []
  sb = {s['name']: s for s in before['stages']}
  sa = {s['name']: s for s in after['stages']}
  for name in sorted(set(sb) ^ set(sa)):
    out.append(f'stage {name}: only {"before" if name in sb else "after"}')
  for name in sorted(set(sb) & set(sa)):
    for field in STAGE_FIELDS:
      if sb[name].get(field) != sa[name].get(field):
        out.append(f'stage {name} {field}: {sb[name].get(field)} -> {sa[name].get(field)}')
    tb, ta = sb[name].get('time') or {}, sa[name].get('time') or {}
    for field in TIME_FIELDS:
      if tb.get(field) != ta.get(field):
        out.append(f'stage {name} step time {field}: {tb.get(field)} -> {ta.get(field)}')
  pb, pa = programs(before), programs(after)
  for key in sorted(set(pb) ^ set(pa)):
    out.append(f'{key[0]} / {key[1]}: only {"before" if key in pb else "after"}')
  for key in sorted(set(pb) & set(pa)):
    for field in PROGRAM_FIELDS:
      if pb[key].get(field) != pa[key].get(field):
        out.append(f'{key[0]} / {key[1]} {field}: {pb[key].get(field)} -> {pa[key].get(field)}')
    cb, ca = collectives(pb[key]), collectives(pa[key])
    if cb != ca:
      only = lambda x, y: len([c for c in x if c not in y])
      out.append(f'{key[0]} / {key[1]} collectives: {len(cb)} -> {len(ca)} ({only(cb, ca)} only '
                 f'before, {only(ca, cb)} only after)')
  return out


def _gib(n: Any) -> str:
  return f'{n / _GIB:.2f} GiB' if isinstance(n, (int, float)) else str(n)


def _flops(x: Any) -> str:
  return f'{x:.3e}' if isinstance(x, (int, float)) and x else '-'


def _load(v: Sequence[float]) -> str:
  return ', '.join(f'{x:.2f}' for x in v)


def case_table(runs_before: list[dict], runs_after: list[dict]) -> list[str]:
  """One row per program (memory, FLOPs, equal?, compile seconds of each repeat) and one per
  stage's step-time bound, the first repeat of each side compared."""
  b0, a0 = runs_before[0], runs_after[0]
  pb, pa = programs(b0), programs(a0)
  lines = ['| stage | program | total per device before / after | FLOPs before / after | '
           'collectives (s) before / after | equal | compile s before (CPU s) | '
           'compile s after (CPU s) |', '|---|---|---:|---:|---:|---|---:|---:|']
  for key in sorted(set(pb) | set(pa), key=lambda k: (k[0], k[1])):
    p, q = pb.get(key, {}), pa.get(key, {})
    equal = (all(p.get(f) == q.get(f) for f in PROGRAM_FIELDS)
             and collectives(p) == collectives(q) and p and q)
    secs = lambda runs: ', '.join(
        f"{programs(r)[key]['compile_s']:.1f} ({programs(r)[key]['compile_cpu_s']:.0f})"
        for r in runs if key in programs(r))
    lines.append(f"| {key[0]} | {key[1]} | {_gib(p.get('total_bytes'))} / "
                 f"{_gib(q.get('total_bytes'))} | {_flops(p.get('flops'))} / "
                 f"{_flops(q.get('flops'))} | {p.get('collective_s', 0):.4g} / "
                 f"{q.get('collective_s', 0):.4g} | {'yes' if equal else '**NO**'} | "
                 f'{secs(runs_before)} | {secs(runs_after)} |')
  sb = {s['name']: s for s in b0['stages']}
  sa = {s['name']: s for s in a0['stages']}
  for name in sorted(set(sb) & set(sa)):
    tb, ta = sb[name].get('time') or {}, sa[name].get('time') or {}
    equal = all(tb.get(f) == ta.get(f) for f in TIME_FIELDS)
    lines.append(f"| {name} | step-time bound (s / step, serial) | "
                 f"{tb.get('bound', 0):.4g}, {tb.get('serial', 0):.4g} / "
                 f"{ta.get('bound', 0):.4g}, {ta.get('serial', 0):.4g} |  |  | "
                 f"{'yes' if equal else '**NO**'} |  |  |")
  return lines


def train_compile_seconds(runs: list[dict], field: str = 'compile_s') -> list[float]:
  """Each run's compile seconds of its train steps, summed: wall ('compile_s') or the
  process's CPU ('compile_cpu_s', less swayed by the host's load than wall seconds)."""
  return [sum(p.get(field, 0.0) for (_, name), p in programs(r).items()
              if name.startswith('train step')) for r in runs]


def page(results: list[tuple[str, str, str, str, list[dict], list[dict]]], command: str,
         date: str) -> tuple[list[str], bool]:
  """The Markdown page and whether every compared plan was equal.

  `results`: (merge, its first parent, case, the case's flags, before runs, after runs).
  """
  lines = [f'# Plan parity: `{command}`', '',
           f'Written by `benchmarks.plan_parity` on {date}, host: {host.cpu_name()}, '
           f'{os.cpu_count()} CPUs, shared with other engineers\' work (every plan ran under '
           '`nice -n 19`; the load average before and after each plan is listed, and compile '
           'seconds are only comparable between plans at similar load). Each side is the '
           "merge's first parent (before) or the merge (after) in a detached worktree, planned "
           'by its own `launch.plan` (with the TPU compiler; a `--time_only` case compiles '
           'nothing and compares the step-time bounds alone) in a process of its own (the script '
           'alternates before and after; a plan may also have run beside another, as each '
           "plan's start time and load below say). "
           'Equal means every program\'s memory (arguments, outputs, temporaries, aliases, '
           'total), FLOPs, collective seconds, collectives (each one\'s kind, bytes, device '
           'groups, count and loop; not its HLO name) and error, and every stage\'s resident '
           'bytes and step-time bound (overlapped, serial, worst case) are identical in the '
           'JSON.', '']
  all_equal = True
  for merge, parent, case, argv, before, after in results:
    diffs = [d for b, a in zip(before, after) for d in differences(b, a)]
    diffs += [f'repeat: {d}' for runs in (before, after) for r in runs[1:]
              for d in differences(runs[0], r)]
    all_equal &= not diffs
    tb, ta = train_compile_seconds(before), train_compile_seconds(after)
    cb, ca = (train_compile_seconds(before, 'compile_cpu_s'),
              train_compile_seconds(after, 'compile_cpu_s'))
    lines += [f'## {merge} ({case})', '',
              f'`launch.plan {argv}`; before = {parent[:7]}, after = {merge[:7]}.', '']
    for side, runs in (('before', before), ('after', after)):
      for i, r in enumerate(runs):
        lines.append(f"- {side} #{i + 1}: from {r.get('started', '?')} UTC, load "
                     f"{_load(r['load_before'])} -> "
                     f"{_load(r['load_after'])}, {r['wall_s']:.0f} s, exit {r['exit']}")
    lines += ['', *case_table(before, after), '']
    if any(tb) or any(ta):
      ratio = lambda b, a: (sum(a) / len(a)) / max(sum(b) / len(b), 1e-9)
      each = lambda wall, cpu: ', '.join(f'{x:.1f} ({y:.0f})' for x, y in zip(wall, cpu))
      lines += [f'Train steps\' compile, seconds summed per plan, wall (CPU): before '
                f'{each(tb, cb)}; after {each(ta, ca)}; after / before (means) '
                f'{ratio(tb, ta):.3f} wall, {ratio(cb, ca):.3f} CPU.', '']
    lines += [f'**{"Equal." if not diffs else "DIFFERENT:"}**', '',
              *[f'- {d}' for d in diffs], *([''] if diffs else [])]
  return lines, all_equal


def main(argv: Sequence[str]) -> None:
  del argv
  load = os.getloadavg()
  unknown = [c for c in _CASES.value if c not in CASES]
  if unknown:
    raise app.UsageError(f'--cases: unknown {unknown}; choose from {sorted(CASES)}')
  repo = str(pathlib.Path(__file__).resolve().parent.parent)
  work = pathlib.Path(_WORKDIR.value)
  results, missing = [], []
  for merge_rev in _MERGES.value:
    merge = resolve(repo, merge_rev)
    parent = resolve(repo, merge + '^1')
    commits = {'before': parent, 'after': merge}
    for case in _CASES.value:
      runs = {'before': [], 'after': []}
      for rep in range(_REPEATS.value):
        order = ('before', 'after') if rep % 2 == 0 else ('after', 'before')
        for side in order:
          out = work / 'json' / merge[:10] / case / f'{side}-{rep}.json'
          if not _PLAN_ONLY.value and not out.exists():
            missing.append(f'{merge[:7]} {case} {side} #{rep + 1}')
            continue
          print(f'{time.strftime("%H:%M:%S")} {merge[:7]} {case} {side} #{rep + 1}', flush=True)
          # A worktree only for a plan to run (a plan done is its JSON: none for --noplan).
          tree = work / f'pj-{commits[side][:10]}'
          runs[side].append(plan_once(tree if out.exists() else worktree(repo, commits[side], tree),
                                      case, out))
      if runs['before'] and runs['after']:
        results.append((merge, parent, case, ' '.join(CASES[case]), runs['before'],
                        runs['after']))
  # The measuring command: --noplan only renders the page from the JSON files it left.
  command = 'python -m benchmarks.plan_parity ' + ' '.join(
      a for a in sys.argv[1:] if a not in ('--noplan', '--plan=false'))
  date = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')
  lines, equal = page(results, command, date)
  if missing:
    lines += ['**Not planned.**', '', 'The page was rendered (`--noplan`) before these plans had '
              'run; the command above runs them (and skips those done):', '',
              *[f'- {m}' for m in missing], '']
  host.print_load_warning(load)   # each plan's own load is on the page too
  print('\n'.join(lines))
  if _PAGE.value:
    pathlib.Path(_PAGE.value).write_text('\n'.join(lines))
  if not equal:
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
