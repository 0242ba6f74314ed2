"""How much of a planned program's TPU compile time parts of the Mamba-2 mixer account for.

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 TPU_VENV/bin/python -m benchmarks.compile_bound \\
      --config=configs/nemotron_cascade2.py --stages=sft,mopd,code_rl --nosampler --noeval \\
      --backend=tpu [--free=scan,conv,conv_tail,folds] [--out=docs/benchmarks/compile_bound.md]

It runs `launch.plan` with the given flags twice, each in a process of its own (the TPU
compiler for the config's topology, in the separate libtpu environment docs/planning.md
describes): once as the model is, once with the `--free` parts of models/mamba.py replaced by
stand-ins that cost next to nothing to compile, and prints each program's lowering and compile
seconds side by side. The stand-ins keep every shape and dtype, and every input reaches an
output (so nothing upstream of a part, a projection or its gradient, is dropped as dead code),
but they compute nothing of the mixer: the second run's programs are wrong, and only their
compile times mean anything. The difference is therefore a bound on what any rewrite of those
parts, a fused kernel included, could take off the compile: such a rewrite still costs
something to build. Compile times are only comparable near a load average of 0: the load is
printed before and after each run.

`--free` names the parts, comma-separated, and several sets of them, '/' between sets: one
more plan per set, each with its own columns. The parts:
  scan        `_ssd`: the chunked state-space scan (within-chunk quadratic form, chunk states).
  conv        `_conv_scan`: the segment-aware causal convolution + SiLU over T > 1 positions.
  conv_tail   `_conv_tail`: each row's last K - 1 convolution inputs (context parallelism).
  folds       `_fold_windows`, `_fold_states`: folding the pieces' windows and states in
              sequence order (context parallelism).
  gated_norm  `_gated_norm`: y * silu(z), RMS-normalised per group.
  mixer       `Mamba2Mixer.__call__`: the whole mixer, its projections and segment bookkeeping
              too (the others are then moot): the mixer's whole share.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Iterator, Sequence

FREE_ENV = 'CASCADE_COMPILE_BOUND_FREE'
_LINE = 'COMPILE_BOUND '


def _f32(u):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return u.astype(jnp.float32)


def _ssd(x, dt, a, bm, cm, run, h0, chunk: int, cumulative: bool = False):
  """`mamba._ssd`'s shapes from every float input, with none of its work."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  del run, chunk
  la = dt * a                                                          # [B, T, H]
  y = x * la[..., None] + jnp.sum(bm * cm, axis=(-2, -1))[..., None, None]
  h = h0 + jnp.sum(y, axis=1)[..., None]                               # [B, H, P, N]
  return (y, h, la) if cumulative else (y, h)


def _conv_scan(parts, convs, prefix, real, run, want_state: bool):
  """`mamba._conv_scan`'s shapes from every float input (the convolution's first tap only)."""
  import jax  # pylint: disable=g-import-not-at-top
  del real, run
  outs, states = [], []
  for i, (u, (w, bias)) in enumerate(zip(parts, convs)):
    v = _f32(u) * w[0] + (0.0 if bias is None else bias)
    if prefix is not None:
      v = v + _f32(prefix[i])[:, -1:]
    outs.append(jax.nn.silu(v))
    if want_state:
      states.append(u[:, -(w.shape[0] - 1):])
  return tuple(outs), (tuple(states) if want_state else None)


def _conv_tail(parts, real, run, k: int):
  """`mamba._conv_tail`'s shapes: each part's first K - 1 inputs."""
  del real, run
  return tuple(u[:, :k - 1] for u in parts)


def _fold_windows(tails, counts, first_seg, last_seg, restart):
  """`mamba._fold_windows`'s shapes: the tails themselves, every piece kept."""
  del first_seg, last_seg, restart
  return tails, counts >= 0


def _fold_states(log_decay, final, keep, restart):
  """`mamba._fold_states`'s shape from both float inputs."""
  del keep, restart
  return final + log_decay[..., None, None]


def _gated_norm(y, z, scale, groups: int, eps: float):
  """`mamba._gated_norm`'s shape and dtype from every input, without the normalisation."""
  del groups, eps
  return _f32(y) * _f32(z) * _f32(scale)


def _mixer(self, x, segment_ids, state=None):
  """`Mamba2Mixer.__call__`'s shapes from x and every parameter, with none of its work (not
  even the projections): what the mixer's whole share of a compile is."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  del segment_ids
  params = jax.tree.leaves(nnx.state(self, nnx.Param))
  gain = 1.0 + sum(jnp.mean(_f32(p)) for p in params)
  return (x * gain).astype(self.cfg.jnp_dtype), state


STAND_INS = {
    'scan': {'_ssd': _ssd},
    'conv': {'_conv_scan': _conv_scan},
    'conv_tail': {'_conv_tail': _conv_tail},
    'folds': {'_fold_windows': _fold_windows, '_fold_states': _fold_states},
    'gated_norm': {'_gated_norm': _gated_norm},
    'mixer': {'Mamba2Mixer.__call__': _mixer},
}


def parse_free(text: str) -> tuple[str, ...]:
  """The `--free` parts, checked against STAND_INS."""
  parts = tuple(p.strip() for p in text.split(',') if p.strip())
  unknown = [p for p in parts if p not in STAND_INS]
  if unknown or not parts:
    raise ValueError(f'--free={text!r}: unknown part(s) {unknown or "(none given)"}; choose '
                     f'from {", ".join(STAND_INS)}')
  return parts


@contextlib.contextmanager
def freed(parts: Sequence[str]) -> Iterator[None]:
  """models/mamba.py with `parts` replaced by their stand-ins, restored on exit."""
  from models import mamba  # pylint: disable=g-import-not-at-top
  saved = []
  try:
    for part in parts:
      for name, fn in STAND_INS[part].items():
        *owner, attr = name.split('.')
        where = getattr(mamba, owner[0]) if owner else mamba
        saved.append((where, attr, where.__dict__[attr] if owner else getattr(mamba, attr)))
        setattr(where, attr, fn)
    yield
  finally:
    for where, attr, fn in reversed(saved):
      setattr(where, attr, fn)


def _child(argv: list[str], parts: Sequence[str]) -> None:
  """Plans with `parts` freed (none: the model as it is), printing one JSON line per program."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from launch.plan import cli as plan_cli  # pylint: disable=g-import-not-at-top
  from launch.plan import compiler as plan_compiler  # pylint: disable=g-import-not-at-top
  original = plan_compiler.compile_program

  def compile_program(name, shapes, lower, *args, **kwargs):
    lower_s = []

    def timed_lower():
      start = time.perf_counter()
      lowered = lower()
      lower_s.append(time.perf_counter() - start)
      return lowered
    # The plan's own compile (its report times lowering + compiling, wall and CPU).
    report = original(name, shapes, timed_lower, *args, **kwargs)
    lowered_in = lower_s[0] if lower_s else 0.0       # 0: lowering itself failed
    print(_LINE + json.dumps(dict(program=f'{name} ({shapes})' if shapes else name,
                                  lower_s=round(lowered_in, 2),
                                  compile_s=round(report.compile_s - lowered_in, 2),
                                  cpu_s=round(report.compile_cpu_s, 2))), flush=True)
    return report

  plan_compiler.compile_program = compile_program
  with freed(parts):
    try:
      app.run(plan_cli.main, argv=[sys.argv[0], *argv])
    except SystemExit as e:
      if e.code not in (0, None):
        raise


def read_lines(text: str) -> list[dict]:
  """The programs a child printed, in order."""
  return [json.loads(line[len(_LINE):]) for line in text.splitlines()
          if line.startswith(_LINE)]


def parse_sets(text: str) -> tuple[tuple[str, ...], ...]:
  """`--free`'s sets of parts ('/' between sets, ',' between a set's parts), each checked."""
  return tuple(parse_free(t) for t in text.split('/'))


def report(runs: dict[str, list[dict]]) -> list[str]:
  """The table: each program's lowering + compile seconds as it is (`runs['as is']`) and with
  each other run's parts free (its key: the parts joined by '+'), with the saving each bounds."""
  base = runs['as is']
  sets = [k for k in runs if k != 'as is']
  lines = ['| program | as is: lower + compile (CPU) | ' +
           ' | '.join(f'{k} free: lower + compile (CPU) | bound on the saving' for k in sets) +
           ' |', '|---|---:|' + '---:|---:|' * len(sets)]
  total = lambda r: r['lower_s'] + r['compile_s']
  cell = lambda r: f'{r["lower_s"]:.1f} + {r["compile_s"]:.1f} s ({r["cpu_s"]:.0f} s)'
  for k in sets:
    if [r['program'] for r in runs[k]] != [r['program'] for r in base]:
      raise ValueError(f'the runs planned different programs: {[r["program"] for r in base]} '
                       f'as is, {[r["program"] for r in runs[k]]} with {k} free')
  for i, a in enumerate(base):
    row = [a['program'], cell(a)]
    for k in sets:
      b = runs[k][i]
      row += [cell(b), f'{total(a) - total(b):.1f} s '
                       f'({100 * (1 - total(b) / max(total(a), 1e-9)):.0f} %)']
    lines.append('| ' + ' | '.join(row) + ' |')
  return lines


def main(argv: list[str]) -> None:
  free_arg, out, rest = 'scan,conv,conv_tail,folds', None, []
  for arg in argv:
    if arg.startswith('--free='):
      free_arg = arg.split('=', 1)[1]
    elif arg.startswith('--out='):
      out = arg.split('=', 1)[1]
    else:
      rest.append(arg)
  try:
    sets = parse_sets(free_arg)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  try:
    import libtpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise SystemExit('benchmarks.compile_bound needs libtpu (the TPU compiler): run it from the '
                     'separate environment docs/planning.md describes') from None
  loads, runs = [], {}
  for label, env_parts in (('as is', '-'), *(('+'.join(p), ','.join(p)) for p in sets)):
    before = os.getloadavg()
    proc = subprocess.run([sys.executable, '-m', 'benchmarks.compile_bound', *rest],
                          env=dict(os.environ, **{FREE_ENV: env_parts}),
                          capture_output=True, text=True, check=False)
    runs[label] = read_lines(proc.stdout)
    loads.append((label, before, os.getloadavg()))
    if proc.returncode or not runs[label]:
      raise SystemExit(f'the {label!r} plan failed (exit {proc.returncode}):\n'
                       f'{proc.stderr[-3000:]}')
  from benchmarks import host  # pylint: disable=g-import-not-at-top
  # The busiest start of any run: a warning above the table when it exceeded the cores.
  warning = host.print_load_warning(max((b for _, b, _ in loads), key=lambda v: v[0]))
  date = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')
  fmt = lambda v: ', '.join(f'{x:.2f}' for x in v)
  page = [f'# Compile bound: `python -m benchmarks.compile_bound {" ".join(argv)}`', '',
          f'Written by `benchmarks.compile_bound` on {date}, host: {os.cpu_count()} CPUs. '
          'Each run after the first replaces the named parts of models/mamba.py by stand-ins '
          'that keep shapes and data dependences but compute nothing (its programs are wrong; '
          'only the compile times count): its saving bounds what any rewrite of those parts '
          'could save. Every run is a process of its own, one after another.', '',
          *[f'- load average {fmt(b)} before, {fmt(a)} after the {label!r} run (1, 5, 15 min)'
            for label, b, a in loads], *([f'- {warning}'] if warning else []), '',
          *report(runs), '']
  print('\n'.join(page))
  if out:
    pathlib.Path(out).write_text('\n'.join(page))


if __name__ == '__main__':
  if os.environ.get(FREE_ENV):
    spec = os.environ[FREE_ENV]
    _child(sys.argv[1:], () if spec == '-' else parse_free(spec))
  else:
    main(sys.argv[1:])
