"""Launches a config's sweep through XManager (optional extra: `pip install -e .[xm]`).

    xmanager launch launch/xm_launch.py -- --config=configs/nemotron_cascade_14b.py \
        --executor=vertex --workdir_root=gs://b/runs

Every point of the config's `get_hyper(h)` (or the config alone when it has
none) becomes one job running `python -m cascade.main` with that point's
`--config.<key>=<value>` overrides and its own workdir. The job's machine
comes from `config.hardware`: a TPU `topology` such as 'v5p:4x4x4' asks for
that slice (accelerator 'tpu_v5p', topology 4x4x4 = 64 chips), which runs
one process per host (16 hosts of 4 chips), every process the same command
with `CASCADE_DISTRIBUTED=auto`, so each joins the run through
`jax.distributed.initialize()` (cascade/distributed.py). A config without
`hardware` is one CPU process. `--executor=local` runs the jobs as local
processes (xm_local.Local); `vertex` submits them to Vertex AI. Either way the
jobs run in the image launch/Dockerfile builds from the repository root
(`.[tpu]` installed, bubblewrap for the sandbox, `python -m cascade.main` its
entry point).

`--config` takes cascade.main's overrides (stages by name, unset fields;
cascade/overrides.py), checked here with every point's keys and passed on to
every job; the machine comes from the overridden config:

    xmanager launch launch/xm_launch.py -- --config=configs/nemotron_cascade_14b.py \
        --executor=vertex --workdir_root=gs://b/runs \
        --config.hardware.topology=v5p:4x4x8 --config.stages.math_rl.steps=200

`job_specs` builds the jobs as plain data (no XManager needed: the tests
check them); only `main` imports `xmanager`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Any, Mapping, Sequence

from absl import app
from absl import flags

from cascade import overrides
from launch import hyper
from launch import sweep

FLAGS = flags.FLAGS

# The image's build context (the repository root) and its Dockerfile.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, 'launch', 'Dockerfile')

# TPU chips per host (one JAX process each) by generation. v5e/v6e slices of up
# to 8 chips are one host.
CHIPS_PER_HOST = {'v2': 4, 'v3': 4, 'v4': 4, 'v5p': 4, 'v5e': 4, 'v6e': 4}
SINGLE_HOST_MAX = {'v5e': 8, 'v6e': 8}


@dataclasses.dataclass(frozen=True)
class Machine:
  """What one job runs on.

  Attributes:
    accelerator: the XManager resource name ('tpu_v5p'), or None (CPU).
    topology: the slice's chip grid ('4x4x4'), or None.
    chips: accelerator chips in the job.
    hosts: hosts in the job; one `cascade.main` process runs on each.
  """
  accelerator: str | None = None
  topology: str | None = None
  chips: int = 0
  hosts: int = 1


@dataclasses.dataclass(frozen=True)
class JobSpec:
  """One sweep point's job: its name, machine, and the command every host runs."""
  name: str
  machine: Machine
  args: tuple[str, ...]
  env: Mapping[str, str]


def machine(hardware: Mapping[str, Any] | None, accelerator: str | None = None) -> Machine:
  """The job's machine from `config.hardware` ({'platform': 'tpu', 'topology': 'v5p:4x4x4'}).

  Args:
    hardware: the config's hardware dict, or None.
    accelerator: overrides the XManager resource name (e.g. 'tpu_v5p').

  Returns:
    The Machine; CPU (one host) when the hardware names no TPU topology.

  Raises:
    ValueError: a topology that is not 'generation:AxBxC'; several slices
      (`hardware.slices` > 1): a job here asks for one slice.
  """
  hardware = dict(hardware or {})
  topo = hardware.get('topology')
  if hardware.get('platform', 'tpu') != 'tpu' or not topo:
    return Machine(accelerator=accelerator)
  slices = hardware.get('slices') or 1
  if slices != 1:
    raise ValueError(f'config.hardware.slices={slices}: an XManager job here asks for one slice '
                     '(launch.plan plans several; launching them is not built)')
  m = re.fullmatch(r'(v\d+[a-z]*):(\d+(?:x\d+)*)', str(topo))
  if not m:
    raise ValueError(f"config.hardware.topology={topo!r}: expected e.g. 'v5p:4x4x4'")
  gen, grid = m.groups()
  chips = 1
  for d in grid.split('x'):
    chips *= int(d)
  per_host = CHIPS_PER_HOST.get(gen, 4)
  hosts = 1 if chips <= SINGLE_HOST_MAX.get(gen, per_host) else -(-chips // per_host)
  return Machine(accelerator=accelerator or f'tpu_{gen}', topology=grid, chips=chips,
                 hosts=hosts)


def job_args(config_spec: str, workdir: str, point: dict, given: Sequence[str] = ()) -> list[str]:
  """Arguments of `python -m cascade.main` for one sweep point (after the command line's
  `--config.` overrides, `given`)."""
  return sweep.point_command(config_spec, workdir, point, given=given)[3:]


def job_specs(config_spec: str, root: str, points: Sequence[dict], hardware=None,
              accelerator: str | None = None, given: Sequence[str] = ()) -> list[JobSpec]:
  """One JobSpec per point, each with its own workdir under `root`.

  Args:
    config_spec: `file[:arg]`.
    root: the root of the per-point workdirs (a gs:// bucket for multi-host jobs:
      every host writes to it).
    points: the sweep points ([{}]: the config alone).
    hardware: `config.hardware` (see `machine`).
    accelerator: overrides the XManager resource name.
    given: the command line's `--config.<path>=<value>` overrides, passed to every job.

  Returns:
    The jobs, in point order.
  """
  mach = machine(hardware, accelerator)
  env = {'CASCADE_DISTRIBUTED': 'auto'} if mach.hosts > 1 else {}
  out = []
  for i, point in enumerate(points):
    name = f'{i:03d}_{hyper.point_name(point)}'
    out.append(JobSpec(name=name, machine=mach, env=dict(env),
                       args=tuple(job_args(config_spec, os.path.join(root, name), point,
                                           given))))
  return out


def define_flags(flag_values: flags.FlagValues = FLAGS,
                 argv: Sequence[str] | None = None) -> flags.FlagHolder:
  """Defines the CLI flags (only when run as a program, so importing stays side-effect free).

  Returns:
    The `--config` flag (cascade.main's: overrides name stages and unset fields).
  """
  holder = overrides.define_config_file(
      'config', 'Config file (configs/x.py or configs/x.py:arg).', flag_values=flag_values,
      argv=argv)
  fv = dict(flag_values=flag_values)
  flags.DEFINE_string('workdir_root', None, 'Root of the per-point workdirs.', **fv)
  flags.DEFINE_enum('executor', 'local', ['local', 'vertex'], 'Where jobs run.', **fv)
  flags.DEFINE_string('accelerator', None,
                      'XManager resource name overriding the one config.hardware implies '
                      '(e.g. tpu_v5p).', **fv)
  flags.DEFINE_string('title', None, 'Experiment title (default: the config name).', **fv)
  return holder


def _hardware(config):
  return dict(config.hardware) if config and 'hardware' in config else None


def main(argv, flag_values: flags.FlagValues | None = None):
  fv = FLAGS if flag_values is None else flag_values
  root = fv.workdir_root
  if not fv['config'].present or not root:
    raise app.UsageError('--config and --workdir_root are required')
  del argv      # the overrides are read from the whole command line (sys.argv), as the flag does
  spec, config, given = sweep.config_flag(fv)
  from xmanager import xm  # pylint: disable=g-import-not-at-top
  from xmanager import xm_local  # pylint: disable=g-import-not-at-top
  try:
    points = sweep.load_points(spec)
  except ValueError:
    points = [{}]
  try:
    sweep.check_points(spec, points, given)
  except overrides.OverrideError as e:
    print(f'error: {overrides.one_line(e)}', file=sys.stderr, flush=True)
    sys.exit(2)
  specs = job_specs(spec, root, points, _hardware(config), fv.accelerator, given)
  local = fv.executor == 'local'
  executor_spec = xm_local.Local.Spec() if local else xm_local.Vertex.Spec()
  title = fv.title or os.path.basename(spec.split(':')[0])
  with xm_local.create_experiment(experiment_title=title) as experiment:
    # The image of launch/Dockerfile: `.[tpu]` installed, `python -m cascade.main` its entry
    # point (xmanager's default Python image installs a requirements.txt this project lacks).
    [executable] = experiment.package([
        xm.dockerfile_container(executor_spec=executor_spec, path=ROOT, dockerfile=DOCKERFILE),
    ])
    for job in specs:
      m = job.machine
      if local:
        executor = xm_local.Local()
      else:
        resources = ({m.accelerator: xm.Topology(m.topology)} if m.topology
                     else {m.accelerator: 1} if m.accelerator else {})
        executor = xm_local.Vertex(requirements=xm.JobRequirements(**resources))
      experiment.add(xm.Job(executable=executable, executor=executor, args=list(job.args),
                            env_vars=dict(job.env)))


if __name__ == '__main__':
  app.run(main, flags_parser=overrides.flags_parser(define_flags()))
