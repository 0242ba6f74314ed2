"""Runs a config's `get_hyper(h)` sweep locally, one workdir per point, and summarises.

    python -m launch.sweep --config=configs/tiny.py --workdir_root=runs/sweep --parallel=2
    python -m launch.sweep --config=configs/tiny.py:smoke --workdir_root=/tmp/sw --points=0,11
    python -m launch.sweep --config=configs/tiny.py:smoke --workdir_root=/tmp/sw \
        --config.stages.math_rl.steps=10 --dry_run

Each point runs `python -m cascade.main --config=<file[:arg]> --workdir=<root>/<i>_<name>
--config.<key>=<value> ...` in its own process (so each has its own JAX
runtime) after the config's `prepare` step has run once (the points share
its output, e.g. the tiny world); rerunning the sweep resumes every point
where it stopped (the cascade's own resume). `--points` runs some of the
points, by index. `--config` takes cascade.main's overrides (stages by name,
unset fields; cascade/overrides.py): they are checked here, once, with every
point's keys (a typo is one line before anything runs), and passed on to every
point; a key both set on the command line and swept is refused. At the end `<root>/summary.md` and `summary.json` hold
every point's final row of the stage x domain matrix (and the mean over the
domains), and `summary.png` draws those rows: one row of cells per point.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import io
import json
import os
import subprocess
import sys
from typing import Any, Sequence

from absl import app
from absl import flags
from absl import logging

from cascade import overrides
from foundation import paths
from launch import hyper

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS,
                 argv: Sequence[str] | None = None) -> flags.FlagHolder:
  """Defines the CLI flags (only when run as a program, so importing stays side-effect free).

  Returns:
    The `--config` flag (cascade.main's: overrides name stages and unset fields).
  """
  holder = overrides.define_config_file(
      'config', 'Config file (configs/x.py or configs/x.py:arg).', flag_values=flag_values,
      argv=argv)
  flags.DEFINE_string('workdir_root', None, 'Directory holding one workdir per point.',
                      flag_values=flag_values)
  flags.DEFINE_integer('parallel', 1, 'Points run at the same time.', flag_values=flag_values)
  flags.DEFINE_list('points', None, 'Indices of the points to run (default: all).',
                    flag_values=flag_values)
  flags.DEFINE_bool('dry_run', False, 'Print the commands, run nothing.',
                    flag_values=flag_values)
  return holder


def config_flag(flag_values: flags.FlagValues = FLAGS,
                argv: Sequence[str] | None = None) -> tuple[str, Any, list[str]]:
  """The parsed `--config`: its `file[:arg]`, the config (overrides applied) and the override
  arguments as given (`argv`, default sys.argv)."""
  flag = flag_values['config']
  return (flag.config_filename, flag.value,
          overrides.given_overrides(sys.argv if argv is None else argv, 'config'))


def check_points(config_spec: str, points: Sequence[dict[str, Any]],
                 given: Sequence[str] = ()) -> None:
  """Every point's keys name fields of the config (stages by name or position, unset fields as
  their schema declares them), and none is also set on the command line (`given`).

  Raises:
    overrides.OverrideError: one line naming the first key that is neither (and the nearest
      names).
  """
  keys = list(dict.fromkeys(k for p in points for k in p))
  twice = sorted(set(keys) & set(overrides.override_paths(given)))
  if twice:
    raise overrides.OverrideError(
        f'--config.{twice[0]} is set on the command line and swept by get_hyper: drop one')
  config = overrides.load(config_spec)
  if config is not None:
    try:
      overrides.prepare(config, keys)
    except overrides.OverrideError as e:
      raise overrides.OverrideError(f'get_hyper of {config_spec}: {e}') from None


def load_module(config_spec: str):
  """The config file of `file[:arg]`, imported."""
  path = config_spec.split(':', 1)[0]
  if not os.path.isfile(path):
    raise FileNotFoundError(f'--config: no such file {path!r}')
  spec = importlib.util.spec_from_file_location('_sweep_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_points(config_spec: str) -> list[dict[str, Any]]:
  """Imports the config file and expands its get_hyper(h) into sweep points."""
  path = config_spec.split(':', 1)[0]
  module = load_module(config_spec)
  if not hasattr(module, 'get_hyper'):
    raise ValueError(f'{path} defines no get_hyper(h): nothing to sweep')
  points = module.get_hyper(hyper)
  if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
    raise ValueError(f'{path}: get_hyper(h) must return a list of dicts (use h.sweep/h.product)')
  return points


def point_command(config_spec: str, workdir: str, point: dict[str, Any],
                  extra: Sequence[str] = (), given: Sequence[str] = ()) -> list[str]:
  """`python -m cascade.main` of one point: the command line's `--config.` overrides (`given`),
  then the point's, then `extra` arguments."""
  return ([sys.executable, '-m', 'cascade.main', f'--config={config_spec}',
           f'--workdir={workdir}', *given]
          + [hyper.format_override(k, v) for k, v in point.items()] + list(extra))


def run_point(cmd: list[str], workdir: str) -> int:
  """Runs one point; its output goes to `workdir`/sweep.log (on gs://: uploaded when it ends)."""
  paths.makedirs(workdir)
  log_path = paths.join(workdir, 'sweep.log')
  if paths.is_remote(log_path):
    with paths.local_target(log_path) as local, open(local, 'ab') as log:
      return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
  with open(log_path, 'ab') as log:
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode


def select(points: list[dict[str, Any]], which: Sequence[str] | None) -> list[int]:
  """The indices `--points` names (all when None)."""
  if not which:
    return list(range(len(points)))
  try:
    idx = [int(w) for w in which]
  except ValueError:
    raise ValueError(f'--points: expected indices, got {list(which)}') from None
  bad = [i for i in idx if not 0 <= i < len(points)]
  if bad:
    raise ValueError(f'--points: {bad} out of range (the sweep has {len(points)} points)')
  return sorted(set(idx))


def prepare(config) -> None:
  """Runs the config's `prepare` step once, so parallel points do not build its output at once.

  Args:
    config: the config as the command line gives it (its overrides applied).
  """
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  plan = config_lib.validate(config)
  if plan.prepare is not None:
    plan.prepare.call()
    logging.info('prepare step %s done', plan.prepare.fn)


def summarise(root: str, names: Sequence[str], points: Sequence[dict[str, Any]],
              codes: Sequence[int]) -> dict[str, Any]:
  """Collects each point's final results row into summary.json / summary.md / summary.png."""
  rows, domains = [], []
  for name, point, code in zip(names, points, codes):
    res = paths.read_json(paths.join(root, name, 'results.json'), default=None)
    final = None
    if res:
      if res.get('scores'):
        final = dict(zip(res['domains'], res['scores'][-1]))
        domains += [d for d in res['domains'] if d not in domains]
    rows.append({'name': name, 'point': point, 'returncode': code, 'final': final})
  summary = {'domains': domains, 'points': rows}
  paths.write_text(paths.join(root, 'summary.json'), json.dumps(summary, indent=1, default=str))
  lines = ['| point | ' + ' | '.join(domains) + ' | mean | status |',
           '|' + '---|' * (len(domains) + 3)]
  for r in rows:
    vals = [r['final'].get(d) if r['final'] else None for d in domains]
    got = [v for v in vals if v is not None]
    mean = f'{sum(got) / len(got):.1f}' if got else '-'
    cells = [f'{v:.1f}' if v is not None else '-' for v in vals]
    status = 'ok' if r['returncode'] == 0 else f'exit {r["returncode"]}'
    lines.append(f'| {r["name"]} | ' + ' | '.join(cells) + f' | {mean} | {status} |')
  paths.write_text(paths.join(root, 'summary.md'), '\n'.join(lines) + '\n')
  plot(summary, paths.join(root, 'summary.png'))
  return summary


def plot(summary: dict[str, Any], path: str) -> None:
  """The final matrix row of every point as a heat map: points down, domains (and mean) across."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  domains, rows = summary['domains'], summary['points']
  cols = list(domains) + ['mean']
  vals = np.full((len(rows), len(cols)), np.nan)
  for i, r in enumerate(rows):
    got = [r['final'].get(d) for d in domains] if r['final'] else []
    for j, v in enumerate(got):
      vals[i, j] = np.nan if v is None else v
    if any(v is not None for v in got):
      vals[i, -1] = np.mean([v for v in got if v is not None])
  fig, ax = plt.subplots(figsize=(1.3 * len(cols) + 3.5, 0.45 * len(rows) + 1.8))
  im = ax.imshow(vals, cmap='viridis', vmin=0, vmax=100, aspect='auto')
  for i in range(len(rows)):
    for j in range(len(cols)):
      text = '-' if np.isnan(vals[i, j]) else f'{vals[i, j]:.1f}'
      ax.text(j, i, text, ha='center', va='center', fontsize=8,
              color='white' if np.isnan(vals[i, j]) or vals[i, j] < 60 else 'black')
  ax.set_xticks(range(len(cols)), cols, rotation=30, ha='right')
  ax.set_yticks(range(len(rows)), [r['name'] + ('' if r['returncode'] == 0 else
                                                f' (exit {r["returncode"]})') for r in rows],
                fontsize=8)
  ax.set_title('Held-out score after the last stage, per sweep point')
  fig.colorbar(im, ax=ax, label='score (%)')
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format='png', dpi=110)
  plt.close(fig)
  paths.write_bytes(path, buf.getvalue())      # whole (temp + rename locally, one upload remote)


def main(argv):
  root = FLAGS.workdir_root
  if not FLAGS['config'].present or not root:
    raise app.UsageError('--config and --workdir_root are required')
  spec, config, given = config_flag()
  try:
    all_points = load_points(spec)
    check_points(spec, all_points, given)
    chosen = select(all_points, FLAGS.points)
  except (ValueError, overrides.OverrideError) as e:
    print(f'error: {overrides.one_line(e)}', file=sys.stderr, flush=True)
    sys.exit(2)
  points = [all_points[i] for i in chosen]
  names = [f'{i:03d}_{hyper.point_name(all_points[i])}' for i in chosen]
  cmds = [point_command(spec, paths.join(root, n), p, argv[1:], given)
          for n, p in zip(names, points)]
  if FLAGS.dry_run:
    for c in cmds:
      print(' '.join(c))
    return
  paths.makedirs(root)
  prepare(config)
  with concurrent.futures.ThreadPoolExecutor(max(1, FLAGS.parallel)) as pool:
    futures = [pool.submit(run_point, c, paths.join(root, n)) for c, n in zip(cmds, names)]
    codes = [f.result() for f in futures]
  summary = summarise(root, names, points, codes)
  print(paths.read_text(paths.join(root, 'summary.md')))
  print(f'summary: {paths.join(root, "summary.md")}, summary.json, summary.png', flush=True)
  failed = [r['name'] for r in summary['points'] if r['returncode'] != 0]
  if failed:
    logging.error('%d point(s) failed: %s (see their sweep.log)', len(failed), failed)
    sys.exit(1)


if __name__ == '__main__':
  app.run(main, flags_parser=overrides.flags_parser(define_flags()))
