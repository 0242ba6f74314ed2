"""README's numbers, from the commands that print them: the demo's matrix and the recipes'.

  python -m benchmarks.readme_numbers                  # the recipes, then the demo; seeds 0,1,2
  python -m benchmarks.readme_numbers --parts=recipe --seeds=0,1,2 --workdir=runs/readme_numbers
  python -m benchmarks.readme_numbers --render_only    # README's blocks from RESULTS, no run

Run from the repository root. What it runs, once per seed:
  * recipe: README's "Your own verifier and dataset" as written (its three files into
    <workdir>/recipe_s<N>/, `python make_data.py`, then its command), with `--config.seed=N`
    added to the command; rows sft, reverse_rl;
  * from_export: "Your own model"'s command in the same directory (RL from that seed's exported
    SFT policy), `--config.seed=N` added; rows init, reverse_rl;
  * demo: `make demo`'s command with `configs/tiny.py:seed=N` (<workdir>/demo_s<N>/run).
Each run leaves <workdir>/<dir>/<variant>.json (its matrix, wall time, the load average at its
start and end, the CPU, the date, the command); a rerun skips the runs that left theirs, so a
killed or partial call goes on seed by seed (a run the killed call left half done starts afresh,
so that every wall time is a whole run's). Every finished run is merged into RESULTS
(benchmarks/results/readme_numbers.json), and README's blocks between
`<!-- readme_numbers:NAME begin -->` and `<!-- readme_numbers:NAME end -->` (NAME: demo, recipe,
from_export) are rendered from RESULTS alone (`render_blocks`): seed 0's matrix as the demo
prints it, the range over seeds, wall times, the machine and the targets below, each checked on
every seed. tests/benchmarks/test_readme_numbers.py checks that README's blocks are the
rendering of RESULTS and have the rows and columns the configs give.

Targets (stated in the blocks with the seeds that miss them): the demo's RL stages each gain at
least DEMO_OWN_GAIN points on the domain they train and cost no other domain more than
DEMO_OFF_DROP; RL gains at least RECIPE_GAIN over the policy it starts from in both recipes.
Exit status: 0; 1 when a target is missed on some seed (README says so; WARNING lines name
each miss); 2 when a run fails (one line naming its log) or a README marker is missing.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Mapping, Sequence

from benchmarks import host

RESULTS = 'benchmarks/results/readme_numbers.json'
VARIANTS = ('recipe', 'from_export', 'demo')
PARTS = {'recipe': ('recipe', 'from_export'), 'demo': ('demo',)}
# README blocks: each variant's block, in the order the page shows them.
BLOCKS = ('demo', 'recipe', 'from_export')
VERIFIER_SECTION = 'Your own verifier and dataset'
MODEL_SECTION = 'Your own model'
DEMO_CONFIG = 'configs/tiny.py'
DEMO_OWN_GAIN = 10.0
DEMO_OFF_DROP = 3.0
RECIPE_GAIN = 5.0
WIDTH = 95
MISSES_SHOWN = 3
_FILE_LINE = re.compile(r'#\s*([\w.-]+\.py):')


def marker(name: str, end: str) -> str:
  """A block's begin or end marker in README (an HTML comment: the page shows nothing)."""
  return f'<!-- readme_numbers:{name} {end} -->'


# --- README: the recipe it shows, and its generated blocks -------------------------------------

def section(readme: str, heading: str) -> str:
  """The text under README's `### heading`, up to the next heading of any level (a `#` line
  inside a code block is no heading)."""
  lines = readme.split('\n')
  if f'### {heading}' not in lines:
    raise SystemExit(f'README has no section "### {heading}"')
  start = lines.index(f'### {heading}')
  fenced, end = False, len(lines)
  for i in range(start + 1, len(lines)):
    if lines[i].startswith('```'):
      fenced = not fenced
    elif not fenced and re.match(r'#{1,3} ', lines[i]):
      end = i
      break
  return '\n'.join(lines[start:end])


def code_blocks(text: str, lang: str) -> list[str]:
  """The ```lang fenced blocks' texts in `text`."""
  return re.findall(rf'```{lang}\n(.*?)```', text, re.S)


def recipe_files(readme: str) -> dict[str, str]:
  """{file name: text} of the verifier recipe's python blocks (each names its file first)."""
  out = {}
  for block in code_blocks(section(readme, VERIFIER_SECTION), 'python'):
    m = _FILE_LINE.match(block)
    if not m:
      raise SystemExit(f'README, {VERIFIER_SECTION}: a python block names no file: '
                       f'{block[:60]!r}')
    out[m.group(1)] = block
  return out


def commands(readme: str, heading: str) -> list[str]:
  """The commands of the section's bash blocks, comments and blank lines dropped."""
  return [line.strip() for block in code_blocks(section(readme, heading), 'bash')
          for line in block.splitlines() if line.strip() and not line.strip().startswith('#')]


def _span_re(name: str) -> re.Pattern:
  return re.compile(re.escape(marker(name, 'begin')) + r'\n(.*?)' + re.escape(marker(name, 'end')),
                    re.S)


def blocks(readme: str) -> dict[str, str]:
  """{name: the text between its begin marker's line and its end marker} for each of BLOCKS
  (the end marker closes the block's last line, so that it adds no line to the page)."""
  out = {}
  for name in BLOCKS:
    begin, end = marker(name, 'begin'), marker(name, 'end')
    found = _span_re(name).search(readme)
    if readme.count(begin) != 1 or readme.count(end) != 1 or not found:
      raise SystemExit(f'README: expected one {begin} line and, after it, one {end}')
    out[name] = found.group(1)
  return out


def rewrite(readme: str, new: Mapping[str, str]) -> str:
  """README with each block of `new` replaced (the markers kept)."""
  blocks(readme)
  for name, text in new.items():
    readme = _span_re(name).sub(
        lambda _, name=name, text=text: f'{marker(name, "begin")}\n{text}{marker(name, "end")}',
        readme)
  return readme


def matrix_rows(config) -> list[str]:
  """The rows of the matrix a run of `config` prints: 'init' first when the cascade starts with
  an RL stage (config.eval.initial 'auto'), then each stage whose kind gets a row and that is
  evaluated, read from the stage kinds as `cascade.config.validate` reads them."""
  from cascade import kinds  # pylint: disable=g-import-not-at-top
  shown = [dict(s) for s in config.stages if kinds.get(s['kind']).config.ROW]
  initial = dict(config.get('eval') or {}).get('initial', 'auto')
  if initial == 'auto':
    initial = bool(shown) and kinds.get(shown[0]['kind']).config.SAMPLES
  return ['init'] * bool(initial) + [s['name'] for s in shown if s.get('evaluate', True)]


# The tiny world's root in the demo's fingerprint: the config names files under it, and where a
# checkout sits must not change what its numbers depend on.
PINNED_ROOT = '/pinned/world'


def fingerprint(variant: str, seed: int, readme: str) -> str:
  """What a run's numbers depend on besides the code: the demo config's hash at the seed
  (`checkpoint.config_hash`, with the world's root fixed so the checkout's path does not
  count), or the sha256 of README's recipe files (16 hex digits)."""
  if variant == 'demo':
    from cascade import checkpoint  # pylint: disable=g-import-not-at-top
    from configs import tiny  # pylint: disable=g-import-not-at-top
    return checkpoint.config_hash(tiny.get_config(f'seed={seed},root={PINNED_ROOT}'))
  files = recipe_files(readme)
  text = '\n'.join(f'{name}\n{files[name]}' for name in sorted(files))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- Running: one (variant, seed) at a time, each leaving its record ---------------------------

def run_dir(workdir: str, variant: str, seed: int) -> str:
  return os.path.join(workdir, f'{"demo" if variant == "demo" else "recipe"}_s{seed}')


def variant_command(variant: str, seed: int, readme: str) -> str:
  """The command a user runs for `variant`, with the seed: README's own for the recipes."""
  if variant == 'demo':
    return f'python -m cascade.main --config={DEMO_CONFIG}:seed={seed} --workdir=run'
  heading = VERIFIER_SECTION if variant == 'recipe' else MODEL_SECTION
  shown = [c for c in commands(readme, heading) if c.startswith('python -m cascade.main')]
  if len(shown) != 1:
    raise SystemExit(f'README, {heading}: expected one `python -m cascade.main` command, '
                     f'found {len(shown)}')
  return f'{shown[0]} --config.seed={seed}'


def unsandboxed() -> list[str]:
  """The demo's override that runs the code verifier without its sandbox where bubblewrap is
  missing (`make demo` installs it as root; the scores are the same either way)."""
  return [] if shutil.which('bwrap') else ['--config.domains.code.verifier_options.isolation=none']


def _env(repo: str) -> dict[str, str]:
  """A user's shell with the venv active (its `python` first), on the CPU, this checkout's
  packages importable from any directory."""
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env.get('PATH', '')
  env['PYTHONPATH'] = repo + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def _shell(command: str, cwd: str, log: str, repo: str) -> None:
  """Runs `command` with the shell in `cwd`, its output to `log`; a failure is one line."""
  with open(log, 'w', encoding='utf-8') as f:
    p = subprocess.run(command, shell=True, cwd=cwd, env=_env(repo), stdout=f,
                       stderr=subprocess.STDOUT, check=False)
  if p.returncode:
    raise SystemExit(f'`{command}` in {cwd} exited {p.returncode}: see {log}')


def _prepare_recipe(where: str, readme: str, repo: str) -> None:
  """Writes README's recipe files into `where` and runs its data script there (once)."""
  os.makedirs(where, exist_ok=True)
  if os.path.exists(os.path.join(where, 'data', 'tok.model')):
    return
  for name, text in recipe_files(readme).items():
    with open(os.path.join(where, name), 'w', encoding='utf-8') as f:
      f.write(text)
  data = [c for c in commands(readme, VERIFIER_SECTION) if not c.startswith('python -m')]
  for command in data:
    _shell(command, where, os.path.join(where, 'make_data.log'), repo)


def run_variant(variant: str, seed: int, workdir: str, readme: str, repo: str) -> dict:
  """Runs one variant at one seed unless its record exists; returns the record.

  The record: variant, seed, command, added (arguments added to it: `unsandboxed`),
  fingerprint, the results.json fields of the matrix (domains, stages, stage_domains, scores),
  wall_s of the command, load_before / load_after (one-, five-, fifteen-minute), cpu, cores,
  finished (UTC, ISO).
  """
  where = run_dir(workdir, variant, seed)
  path = os.path.join(where, f'{variant}.json')
  if os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
    if record.get('fingerprint') != fingerprint(variant, seed, readme):
      raise SystemExit(f'{path}: a run of another config or recipe than the one shown now: '
                       f'remove {where} or pass another --workdir')
    return record
  if variant == 'demo':
    os.makedirs(where, exist_ok=True)
  else:
    _prepare_recipe(where, readme, repo)
  if variant == 'from_export':
    run_variant('recipe', seed, workdir, readme, repo)    # the export it starts from
  command = variant_command(variant, seed, readme)
  cwd = repo if variant == 'demo' else where
  shown = command if variant != 'demo' else command.replace(
      '--workdir=run', f'--workdir={os.path.join(where, "run")}') + ''.join(
          f' {a}' for a in unsandboxed())
  run = os.path.join(cwd, re.search(r'--workdir=(\S+)', shown).group(1))
  if os.path.exists(run):     # a killed call's run: resumed, its wall time would be a part
    print(f'{variant} seed {seed}: {run} is a run a killed call left: starting it afresh',
          flush=True)
    shutil.rmtree(run)
  print(f'{variant} seed {seed}: {shown}', flush=True)
  before, t0 = os.getloadavg(), time.time()
  _shell(shown, cwd, os.path.join(where, f'{variant}.log'), repo)
  wall, after = time.time() - t0, os.getloadavg()
  with open(os.path.join(run, 'results.json'), encoding='utf-8') as f:
    res = json.load(f)
  record = {'variant': variant, 'seed': seed, 'command': command,
            'added': [a for a in shown.split() if a not in command.split()
                      and not a.startswith('--workdir=')],
            'fingerprint': fingerprint(variant, seed, readme),
            **{k: res[k] for k in ('domains', 'stages', 'stage_domains', 'scores')},
            'wall_s': round(wall, 1), 'load_before': [round(x, 2) for x in before],
            'load_after': [round(x, 2) for x in after], 'cpu': host.cpu_name(),
            'cores': os.cpu_count(),
            'finished': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=1)
  os.replace(path + '.tmp', path)
  print(f'{variant} seed {seed}: {record["stages"]} {record["scores"]} in {wall:.0f} s',
        flush=True)
  return record


def load_results(path: str) -> dict:
  """RESULTS as {variant: {seed (str): record}} ({} when there is none yet)."""
  if not os.path.exists(path):
    return {}
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def merge(results: dict, records: Sequence[dict]) -> dict:
  """RESULTS with `records` in, each replacing the run of its variant and seed."""
  out = {v: dict(results.get(v, {})) for v in VARIANTS if results.get(v) or any(
      r['variant'] == v for r in records)}
  for r in records:
    out[r['variant']][str(r['seed'])] = r
  return out


# --- Targets ------------------------------------------------------------------------------------

def demo_misses(record: Mapping) -> list[str]:
  """The demo's target misses in one run: 'stage: domain +x.x' for an RL stage's own domain
  gaining under DEMO_OWN_GAIN, or another domain dropping more than DEMO_OFF_DROP."""
  out = []
  rows, domains = record['scores'], record['domains']
  for i in range(1, len(rows)):
    trained = set(record['stage_domains'][i])
    for j, d in enumerate(domains):
      delta = rows[i][j] - rows[i - 1][j]
      if (d in trained and delta < DEMO_OWN_GAIN) or (
          d not in trained and -delta > DEMO_OFF_DROP):
        out.append(f'{record["stages"][i]}: {d} {delta:+.1f}')
  return out


def gain(record: Mapping) -> float:
  """A recipe run's RL gain: its last row minus its first, on its one domain."""
  return record['scores'][-1][0] - record['scores'][0][0]


def misses(results: Mapping) -> list[str]:
  """Every target miss: 'variant seed N: what'."""
  out = []
  for variant, runs in results.items():
    for seed, r in sorted(runs.items(), key=lambda kv: int(kv[0])):
      found = demo_misses(r) if variant == 'demo' else (
          [f'RL gain {gain(r):+.1f}'] if gain(r) < RECIPE_GAIN else [])
      out += [f'{variant} seed {seed}: {m}' for m in found]
  return out


# --- Rendering ----------------------------------------------------------------------------------

def _duration(seconds: float) -> str:
  s = int(round(seconds))
  return f'{s} s' if s < 60 else f'{s // 60} min {s % 60:02d} s'


def _span(values: Sequence[float], fmt: str = '{:.1f}', sep: str = '-') -> str:
  """'lo-hi' (or 'lo to hi' with sep=' to ', for signed numbers), or the one value."""
  lo, hi = min(values), max(values)
  return fmt.format(lo) if lo == hi else f'{fmt.format(lo)}{sep}{fmt.format(hi)}'


def _walls(runs: Sequence[Mapping]) -> str:
  walls = [r['wall_s'] for r in runs]
  if min(walls) == max(walls):
    return _duration(walls[0])
  return f'{_duration(min(walls))} to {_duration(max(walls))}'


def _seeds(runs: Mapping) -> list[dict]:
  return [runs[k] for k in sorted(runs, key=int)]


def _seed_words(runs: Sequence[Mapping]) -> str:
  seeds = [str(r['seed']) for r in runs]
  return f'seed {seeds[0]}' if len(seeds) == 1 else 'seeds ' + ', '.join(seeds)


def _machine(runs: Sequence[Mapping]) -> str:
  """'2026-12-07, 2 cores of CPU, load average 0.8-6.0' over the runs (one-minute averages at
  their starts and ends)."""
  loads = [x for r in runs for x in (r['load_before'][0], r['load_after'][0])]
  cpus = sorted({f'{r["cores"]} cores of {r["cpu"]}' for r in runs})
  days = sorted({r['finished'][:10] for r in runs})
  return f'{" and ".join(days)}, {"; ".join(cpus)}, load average {_span(loads)}'


def _wrap(text: str) -> str:
  """`text` in lines of at most WIDTH characters, none starting as a Markdown list item would
  ('+5 or more' may; '1. ' or '- ' may not: such a line joins the one before it)."""
  lines = textwrap.wrap(text, WIDTH, break_on_hyphens=False, break_long_words=False)
  out = lines[:1]
  for line in lines[1:]:
    if re.match(r'(\d{1,9}[.)]|[-+*])(\s|$)', line):
      out[-1] += ' ' + line
    else:
      out.append(line)
  return '\n'.join(out)


def _outcome(found: Sequence[str], seeds: int) -> str:
  """'met on every seed' ('met' for one), or the misses: the first MISSES_SHOWN of them and how
  many more (the call's WARNING lines and RESULTS have them all)."""
  if not found:
    return 'met on every seed' if seeds > 1 else 'met'
  more = len(found) - MISSES_SHOWN
  return 'missed: ' + '; '.join(found[:MISSES_SHOWN]) + (f'; {more} more' if more > 0 else '')


def matrix(record: Mapping) -> str:
  """The matrix as `cascade.main` prints it (results.md's table)."""
  from cascade import evaluation  # pylint: disable=g-import-not-at-top
  return evaluation.markdown(record, extra=False).strip()


def render_demo(runs: Mapping) -> str:
  rs = _seeds(runs)
  first = rs[0]
  last = ', '.join(f'{d} {_span([r["scores"][-1][j] for r in rs])}'
                   for j, d in enumerate(first['domains']))
  found = [f'seed {r["seed"]} {m}' for r in rs for m in demo_misses(r)]
  head = (f'`python -m benchmarks.readme_numbers` ran it: seed {first["seed"]} printed this in '
          f'{_duration(first["wall_s"])} ({_machine(rs)}; another CPU prints a nearby table):')
  runs_words = (f'Seed {first["seed"]} ends at' if len(rs) == 1 else
                f'{_seed_words(rs).capitalize()} (`{DEMO_CONFIG}:seed=N`, {_walls(rs)} each) end at')
  tail = (f'{runs_words} {last}. Target: each RL stage gains its own domain '
          f'+{DEMO_OWN_GAIN:.0f} or more, no other drops over {DEMO_OFF_DROP:.0f}; '
          f'{_outcome(found, len(rs))}.')
  return '\n'.join([_wrap(head), '', matrix(first), '', _wrap(tail)])


def _recipe_words(rs: Sequence[Mapping], first_row: str, how: str) -> str:
  r0 = rs[0]
  a, b = r0['scores'][0][0], r0['scores'][-1][0]
  found = [f'seed {r["seed"]} {gain(r):+.1f}' for r in rs if gain(r) < RECIPE_GAIN]
  seeds = '' if len(rs) == 1 else (
      f'{_seed_words(rs)}{how}: {_span([r["scores"][0][0] for r in rs])} {first_row}, '
      f'{_span([r["scores"][-1][0] for r in rs])} after RL, gain '
      f'{_span([gain(r) for r in rs], "{:+.1f}", " to ")}; ')
  return (f'seed {r0["seed"]} printed {a:.1f} {first_row}, {b:.1f} after RL ({b - a:+.1f}); '
          f'{seeds}target: +{RECIPE_GAIN:.0f} or more, {_outcome(found, len(rs))}')


def render_recipe(runs: Mapping) -> str:
  rs = _seeds(runs)
  return _wrap(f'It ends with the matrix, one `{rs[0]["domains"][0]}` column: '
               + _recipe_words(rs, 'after SFT', ' (`--config.seed=N` added)')
               + f'; {_walls(rs)} a run ({_machine(rs)}).')


def render_from_export(runs: Mapping) -> str:
  rs = _seeds(runs)
  return _wrap('With no SFT stage the matrix gets a first row `init`, the checkpoint as '
               'loaded: ' + _recipe_words(rs, 'at init', '') + '.')


RENDER = {'demo': render_demo, 'recipe': render_recipe, 'from_export': render_from_export}


def render_blocks(results: Mapping) -> dict[str, str]:
  """README's blocks from RESULTS: each variant that has runs."""
  return {v: RENDER[v](results[v]) for v in BLOCKS if results.get(v)}


def collect(workdir: str, parts: Sequence[str], seeds: Sequence[int]) -> list[dict]:
  """The records of the runs under `workdir` that have finished, for `parts` at `seeds`."""
  out = []
  for part in parts:
    for seed in seeds:
      for variant in PARTS[part]:
        path = os.path.join(run_dir(workdir, variant, seed), f'{variant}.json')
        if os.path.exists(path):
          with open(path, encoding='utf-8') as f:
            out.append(json.load(f))
  return out


# --- Main ---------------------------------------------------------------------------------------

def _save(results: Mapping, results_path: str, readme: str, readme_path: str) -> None:
  os.makedirs(os.path.dirname(results_path) or '.', exist_ok=True)
  with open(results_path, 'w', encoding='utf-8') as f:
    json.dump(results, f, indent=1, sort_keys=True)
    f.write('\n')
  with open(readme_path, 'w', encoding='utf-8') as f:
    f.write(rewrite(readme, render_blocks(results)))


def current(results: Mapping, readme: str) -> dict:
  """RESULTS without the runs of another recipe or demo config than the ones shown now."""
  out = {}
  for variant, runs in results.items():
    kept = {seed: r for seed, r in runs.items()
            if r.get('fingerprint') == fingerprint(variant, int(seed), readme)}
    for seed in sorted(set(runs) - set(kept), key=int):
      print(f'{variant} seed {seed}: dropped, it ran another config or recipe', flush=True)
    if kept:
      out[variant] = kept
  return out


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog='python -m benchmarks.readme_numbers',
                              description=__doc__.split('\n\n')[0])
  p.add_argument('--parts', default='recipe,demo',
                 help='what to run, in order: recipe (with from_export), demo')
  p.add_argument('--seeds', default='0,1,2', help='seeds, comma-separated')
  p.add_argument('--workdir', default='runs/readme_numbers', help='where the runs go')
  p.add_argument('--readme', default='README.md')
  p.add_argument('--results', default=RESULTS)
  p.add_argument('--render_only', action='store_true',
                 help='run nothing: README from RESULTS and the runs finished under --workdir')
  args = p.parse_args(argv)
  parts = [x for x in args.parts.split(',') if x]
  bad = [x for x in parts if x not in PARTS]
  if bad:
    p.error(f'--parts: unknown {bad} (known: {", ".join(PARTS)})')
  try:
    seeds = [int(x) for x in args.seeds.split(',') if x]
  except ValueError:
    p.error(f'--seeds={args.seeds!r}: expected integers, comma-separated')
  repo, workdir, load = os.path.abspath('.'), os.path.abspath(args.workdir), os.getloadavg()
  with open(args.readme, encoding='utf-8') as f:
    readme = f.read()
  blocks(readme)                                   # every marker is there before anything runs
  results = current(load_results(args.results), readme)
  results = current(merge(results, collect(workdir, parts, seeds)), readme)
  if not args.render_only:
    for part in parts:
      for seed in seeds:
        for variant in PARTS[part]:
          results = merge(results, [run_variant(variant, seed, workdir, readme, repo)])
          _save(results, args.results, readme, args.readme)   # as far as it got, each time
  _save(results, args.results, readme, args.readme)
  print(f'wrote {args.readme} from {args.results}')
  host.print_load_warning(load)
  found = misses(results)
  for m in found:
    print(f'WARNING: target missed: {m}', flush=True)
  return 1 if found else 0


if __name__ == '__main__':
  sys.exit(main())
