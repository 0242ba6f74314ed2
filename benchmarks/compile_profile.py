"""Where the TPU compiler spends a planned program's compile time: per compiled unit, by source.

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 TPU_VENV/bin/python -m benchmarks.compile_profile \\
      --config=configs/nemotron_cascade2.py --stages=sft --noeval [--top=15] [--out=PAGE.md]

It runs `launch.plan` with the given flags (the TPU compiler for the config's topology, in
the separate libtpu environment docs/planning.md describes) and asks libtpu to dump, for every
unit its backend compiles (a fusion, a collective, a sort, ...), one small file of the unit's
final code: `<start>-<unit>-00-final_hlo-...` in a scratch directory, whose name starts with
the time in nanoseconds the unit's compilation began and whose modification time is when it
ended. The units run in parallel over the host's cores, so their seconds add up to about the
program's CPU time, not its wall time. Each unit is joined by name to the program's optimized
HLO (`compiled.as_text()`, captured around `launch.plan.compiler.compile_program`) for the Python
stack that built it (the module's StackFrames table), its `op_name` and opcode, and assigned
to the program whose compile window holds its start.

Printed per program: the compile's wall and CPU seconds (the dump roughly doubles both; the
shares hold), the units' seconds by part (a collective; else the innermost file of this
repository on its stack past the shared helpers, e.g. models/mamba.py or models/moe.py; or
'unattributed' where the HLO carries no stack), and the `--top` slowest units. Compile
times are only comparable near a load average of 0: the load is printed before and after.
--out writes the same as a Markdown page; --hlo_dir each program's optimized HLO text.

The dump flags are libtpu's own (`xla_jf_dump_to`, `xla_jf_dump_llo_text`,
`xla_jf_dump_llo_pass_label_regex`), not a stable interface: without libtpu, or if a libtpu
drops them, the run stops with that said.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import os
import pathlib
import re
import sys
import tempfile
import time

DUMP_ENV = 'CASCADE_COMPILE_PROFILE_DIR'
# The whole-program entries of the dump: each spans the compile, so none is a unit of work.
WHOLE_PROGRAM = ('TLP', '<late-initialization>', '<late-finalization>')
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
               'collective-permute', 'psum')
_UNIT_FILE = re.compile(r'^(\d+)-(.+)-\d\d-final_hlo')
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+([\w\-]+)\(')


@dataclasses.dataclass(frozen=True)
class Unit:
  name: str         # the HLO instruction's name (fusion.12, all-reduce.3, ...)
  start: float      # seconds since the epoch
  end: float

  @property
  def seconds(self) -> float:
    return max(0.0, self.end - self.start)


@dataclasses.dataclass(frozen=True)
class Source:
  opcode: str
  files: tuple[str, ...]   # the source files of its stack, innermost first ('' none known)
  op_name: str
  lines: tuple[int, ...] = ()   # the line in each of `files` (0: none known)
  shape: str = ''               # the instruction's result type, e.g. f32[8,128]{1,0}


def libtpu_args(dump_dir: str) -> str:
  """LIBTPU_INIT_ARGS that make libtpu dump each unit's final code stats to `dump_dir`."""
  return (f'--xla_jf_dump_to={dump_dir} --xla_jf_dump_llo_text=true '
          '--xla_jf_dump_llo_pass_label_regex=^final_hlo')


def read_units(dump_dir: str | os.PathLike) -> list[Unit]:
  """The units of a dump directory: name, start (from the file name) and end (its mtime)."""
  units = []
  for path in pathlib.Path(dump_dir).iterdir():
    m = _UNIT_FILE.match(path.name)
    if m and m.group(2) not in WHOLE_PROGRAM:
      units.append(Unit(m.group(2), int(m.group(1)) / 1e9, path.stat().st_mtime))
  return sorted(units, key=lambda u: u.start)


def _section(hlo_text: str, name: str) -> dict[int, str]:
  """A numbered table of the module's header (FileNames, FileLocations, StackFrames)."""
  m = re.search(rf'^{name}\n((?:\d+ .*\n?)*)', hlo_text, re.M)
  rows = {}
  for line in (m.group(1).splitlines() if m else ()):
    key, _, value = line.partition(' ')
    rows[int(key)] = value
  return rows


def _stacks(hlo_text: str):
  """stack_frame_id -> its (source file, line) pairs, innermost first, from the module's
  header tables (a frame's printed parent_frame_id is its parent's id + 1; 0: none)."""
  files = {k: v.strip('"') for k, v in _section(hlo_text, 'FileNames').items()}
  locs, lines = {}, {}
  for k, v in _section(hlo_text, 'FileLocations').items():
    locs[k] = int(re.search(r'file_name_id=(\d+)', v).group(1))
    line = re.search(r'\bline=(\d+)', v)
    lines[k] = int(line.group(1)) if line else 0
  frames = {}
  for k, v in _section(hlo_text, 'StackFrames').items():
    loc, parent = (int(x) for x in re.findall(r'(?:file_location_id|parent_frame_id)=(\d+)', v))
    frames[k] = (loc, parent - 1)

  @functools.lru_cache(maxsize=None)
  def chain(frame: int) -> tuple[tuple[str, int], ...]:
    out, seen = [], set()
    while frame in frames and frame not in seen:
      seen.add(frame)
      loc, frame = frames[frame]
      out.append((files.get(locs.get(loc, -1), ''), lines.get(loc, 0)))
    return tuple(out)
  return chain


def hlo_sources(hlo_text: str) -> dict[str, Source]:
  """Each instruction of an optimized HLO module's text: its opcode, the source files of the
  Python stack that built it (the module's StackFrames table, or an inline source_file) and
  its op_name, with each file's line and the instruction's result type."""
  chain = _stacks(hlo_text)
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    frame = re.search(r'stack_frame_id=(\d+)', line)
    inline = re.search(r'source_file="([^"]*)"', line)
    inline_line = re.search(r'source_line=(\d+)', line)
    sites = (chain(int(frame.group(1))) if frame else
             ((inline.group(1), int(inline_line.group(1)) if inline_line else 0),) if inline
             else ())
    op = re.search(r'op_name="([^"]*)"', line)
    out[m.group(1)] = Source(m.group(3), tuple(f for f, _ in sites), op.group(1) if op else '',
                             tuple(n for _, n in sites), m.group(2))
  return out


# The repository's top-level packages: a source file under one is named from there.
PACKAGES = ('foundation', 'models', 'rl', 'cascade', 'launch', 'verifiers', 'benchmarks', 'configs')
# Helpers every model part calls: a unit is attributed to the part that called them.
HELPERS = ('models/layers.py', 'models/sharding.py', 'models/context.py')


def _repo_file(path: str) -> str | None:
  parts = path.replace('\\', '/').split('/')
  for i in range(len(parts) - 2, -1, -1):
    if parts[i] in PACKAGES:
      return '/'.join(parts[i:])
  return None


def _repo_site(source: Source | None) -> tuple[str, int] | None:
  """The innermost frame of this repository on a unit's stack that is not a shared helper
  (HELPERS; the innermost helper if only those): (file from the package, line); None if none."""
  if not source:
    return None
  lines = source.lines or (0,) * len(source.files)
  pairs = [(r, n) for r, n in zip(map(_repo_file, source.files), lines) if r]
  return next(((r, n) for r, n in pairs if r not in HELPERS), pairs[0]) if pairs else None


def part(name: str, source: Source | None) -> str:
  """Which part of the program a unit belongs to: 'collective'; else the innermost file of the
  repository on its stack that is not a shared helper (HELPERS; the innermost helper if only
  those), e.g. models/mamba.py; else its innermost file's base name; else 'unattributed'."""
  opcode = source.opcode if source else ''
  if any(name.startswith(c) or opcode.startswith(c) for c in COLLECTIVES):
    return 'collective'
  files = [f for f in (source.files if source else ()) if f]
  if not files:
    return 'unattributed'
  repo = _repo_site(source)
  return repo[0] if repo else files[0].replace('\\', '/').rsplit('/', 1)[-1]


def site(source: Source | None) -> str:
  """Where a unit was built: `part`'s file with its line (models/mamba.py:489), or ''."""
  repo = _repo_site(source)
  if not repo:
    return ''
  return f'{repo[0]}:{repo[1]}' if repo[1] else repo[0]


def by_part(units: list[Unit], sources: dict[str, Source]) -> list[tuple[str, float, int]]:
  """(part, seconds, units) over `units`, most seconds first."""
  secs, count = collections.Counter(), collections.Counter()
  for u in units:
    p = part(u.name, sources.get(u.name))
    secs[p] += u.seconds
    count[p] += 1
  return [(p, s, count[p]) for p, s in secs.most_common()]


@dataclasses.dataclass
class Program:
  name: str
  start: float
  end: float
  wall_s: float
  cpu_s: float
  hlo: str


def assign(units: list[Unit], programs: list[Program]) -> dict[str, list[Unit]]:
  """Each program's units: those that started within its compile window."""
  out = {p.name: [] for p in programs}
  for u in units:
    for p in programs:
      if p.start <= u.start <= p.end:
        out[p.name].append(u)
        break
  return out


def report(programs: list[Program], units: list[Unit], top: int) -> list[str]:
  """The Markdown lines for every program: totals, seconds by part, the slowest units."""
  lines = []
  for prog, mine in assign(units, programs).items():
    p = next(x for x in programs if x.name == prog)
    sources = hlo_sources(p.hlo)
    total = sum(u.seconds for u in mine)
    lines += [f'## {prog}', '',
              f'compile {p.wall_s:.1f} s wall, {p.cpu_s:.1f} s CPU (with the dump); '
              f'{len(mine)} units, {total:.1f} s in all', '',
              '| part | seconds | share | units |', '|---|---:|---:|---:|']
    for name, secs, n in by_part(mine, sources):
      lines.append(f'| {name} | {secs:.1f} | {100 * secs / max(total, 1e-9):.1f} % | {n} |')
    lines += ['', f'The {min(top, len(mine))} slowest units:', '',
              '| unit | seconds | part | line | shape | op_name |',
              '|---|---:|---|---|---|---|']
    for u in sorted(mine, key=lambda u: -u.seconds)[:top]:
      src = sources.get(u.name)
      op = (src.op_name if src else '')[-90:].replace('|', '\\|')
      shape = (src.shape if src else '')[:60].replace('|', '\\|')
      lines.append(f'| {u.name} | {u.seconds:.2f} | {part(u.name, src)} | {site(src)} | '
                   f'{shape} | {op} |')
    lines.append('')
  return lines


def write_hlo(programs: list[Program], hlo_dir: str | os.PathLike) -> list[pathlib.Path]:
  """Each program's optimized HLO text as `hlo_dir`/NN_<program>.hlo.txt (NN its order);
  the paths written."""
  out = []
  for i, p in enumerate(programs):
    name = re.sub(r'\W+', '_', p.name.split(' (')[0]).strip('_')
    path = pathlib.Path(hlo_dir) / f'{i:02d}_{name}.hlo.txt'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(p.hlo)
    out.append(path)
  return out


def _reexec_with_dump() -> str:
  """The dump directory, re-executing this program with libtpu's dump flags set first
  (they are read when libtpu starts, before any of this module's JAX work)."""
  dump = os.environ.get(DUMP_ENV)
  if dump:
    return dump
  dump = tempfile.mkdtemp(prefix='compile_profile_')
  env = dict(os.environ, **{DUMP_ENV: dump})
  env['LIBTPU_INIT_ARGS'] = (env.get('LIBTPU_INIT_ARGS', '') + ' ' + libtpu_args(dump)).strip()
  os.execve(sys.executable, [sys.executable, '-m', 'benchmarks.compile_profile',
                             *sys.argv[1:]], env)
  raise AssertionError('unreachable')


def main(argv, top: int, out: str | None, hlo_dir: str | None = None):
  from absl import app  # pylint: disable=g-import-not-at-top
  from benchmarks import host  # pylint: disable=g-import-not-at-top
  from launch.plan import cli as plan_cli  # pylint: disable=g-import-not-at-top
  from launch.plan import compiler as plan_compiler  # pylint: disable=g-import-not-at-top
  from launch.plan import report as plan_report  # pylint: disable=g-import-not-at-top
  try:
    import libtpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise app.UsageError('benchmarks.compile_profile needs libtpu (the TPU compiler): run it '
                         'from the separate environment docs/planning.md describes') from None
  dump = _reexec_with_dump()
  programs = []
  original = plan_compiler.compile_program

  def compile_program(name, shapes, lower, *args, **kwargs):
    start, cpu = time.time(), time.process_time()
    lowered = lower()
    compiled = lowered.compile(compiler_options=kwargs.get('compiler_options'))
    end = time.time()
    programs.append(Program(f'{name} ({shapes})' if shapes else name, start, end,
                            end - start, time.process_time() - cpu, compiled.as_text() or ''))
    return original(name, shapes, lambda: lowered, *args, **kwargs)

  before, load_before = plan_report.host_load(), os.getloadavg()
  plan_compiler.compile_program = compile_program
  code = 0
  try:
    plan_cli.main(argv)
  except SystemExit as e:   # a program that does not fit: profile what compiled, then exit so
    code = e.code
  finally:
    plan_compiler.compile_program = original
  units = read_units(dump)
  if programs and not units:
    raise SystemExit(f'libtpu wrote no unit files to {dump}: this libtpu does not take the '
                     f'dump flags ({libtpu_args(dump)})')
  date = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')
  after = plan_report.host_load()
  warning = host.print_load_warning(load_before)
  del argv
  command = ' '.join(sys.argv[1:])
  page = [f'# Compile profile: `python -m benchmarks.compile_profile {command}`', '',
          f'Written by `benchmarks.compile_profile` on {date}.', '',
          f'- {before} (before)', f'- {after} (after)', *([f'- {warning}'] if warning else []),
          '',
          *report(programs, units, top)]
  print('\n'.join(page))
  print(f'(the dump: {dump}; remove it when done)')
  if out:
    pathlib.Path(out).write_text('\n'.join(page) + '\n')
  if hlo_dir:
    for path in write_hlo(programs, hlo_dir):
      print(f'optimized HLO: {path}')
  if code:
    sys.exit(code)


if __name__ == '__main__':
  from absl import app as _app  # pylint: disable=g-import-not-at-top
  from absl import flags as _flags  # pylint: disable=g-import-not-at-top
  _TOP = _flags.DEFINE_integer('top', 15, 'The slowest units listed per program.')
  _OUT = _flags.DEFINE_string('out', None, 'Also write the profile to this Markdown page.')
  _HLO = _flags.DEFINE_string('hlo_dir', None,
                              "Also write each program's optimized HLO text to this directory.")
  from launch.plan import cli as _plan_cli  # noqa: F401  (defines the planning flags it passes on)
  _app.run(lambda argv: main(argv, _TOP.value, _OUT.value, _HLO.value))
