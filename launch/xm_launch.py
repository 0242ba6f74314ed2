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
processes (xm_local.Local); `vertex` submits them to Vertex AI.

`job_specs` builds the jobs as plain data (no XManager needed: the tests
check them); only `main` imports `xmanager`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping, Sequence

from absl import app
from absl import flags

from launch import hyper
from launch import sweep

FLAGS = flags.FLAGS

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
    ValueError: a topology that is not 'generation:AxBxC'.
  """
  hardware = dict(hardware or {})
  topo = hardware.get('topology')
  if hardware.get('platform', 'tpu') != 'tpu' or not topo:
    return Machine(accelerator=accelerator)
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


def job_args(config_spec: str, workdir: str, point: dict) -> list[str]:
  """Arguments of `python -m cascade.main` for one sweep point."""
  return sweep.point_command(config_spec, workdir, point)[3:]


def job_specs(config_spec: str, root: str, points: Sequence[dict], hardware=None,
              accelerator: str | None = None) -> list[JobSpec]:
  """One JobSpec per point, each with its own workdir under `root`.

  Args:
    config_spec: `file[:arg]`.
    root: the root of the per-point workdirs (a gs:// bucket for multi-host jobs:
      every host writes to it).
    points: the sweep points ([{}]: the config alone).
    hardware: `config.hardware` (see `machine`).
    accelerator: overrides the XManager resource name.

  Returns:
    The jobs, in point order.
  """
  mach = machine(hardware, accelerator)
  env = {'CASCADE_DISTRIBUTED': 'auto'} if mach.hosts > 1 else {}
  out = []
  for i, point in enumerate(points):
    name = f'{i:03d}_{hyper.point_name(point)}'
    out.append(JobSpec(name=name, machine=mach, env=dict(env),
                       args=tuple(job_args(config_spec, os.path.join(root, name), point))))
  return out


def define_flags():
  """Defines the CLI flags (only when run as a program, so importing stays side-effect free)."""
  flags.DEFINE_string('config', None, 'Config file, optionally with :arg.')
  flags.DEFINE_string('workdir_root', None, 'Root of the per-point workdirs.')
  flags.DEFINE_enum('executor', 'local', ['local', 'vertex'], 'Where jobs run.')
  flags.DEFINE_string('accelerator', None,
                      'XManager resource name overriding the one config.hardware implies '
                      '(e.g. tpu_v5p).')
  flags.DEFINE_string('base_image', 'python:3.11', 'Container base image (vertex).')
  flags.DEFINE_string('title', None, 'Experiment title (default: the config name).')


def _hardware(config_spec: str):
  path, _, arg = config_spec.partition(':')
  del path
  config = sweep.load_module(config_spec).get_config(arg or None)
  return dict(config.hardware) if config and 'hardware' in config else None


def main(_):
  config, root = FLAGS.config, FLAGS.workdir_root
  if not config or not root:
    raise app.UsageError('--config and --workdir_root are required')
  from xmanager import xm  # pylint: disable=g-import-not-at-top
  from xmanager import xm_local  # pylint: disable=g-import-not-at-top
  try:
    points = sweep.load_points(config)
  except ValueError:
    points = [{}]
  specs = job_specs(config, root, points, _hardware(config), FLAGS.accelerator)
  local = FLAGS.executor == 'local'
  spec = xm_local.Local.Spec() if local else xm_local.Vertex.Spec()
  title = FLAGS.title or os.path.basename(config.split(':')[0])
  with xm_local.create_experiment(experiment_title=title) as experiment:
    [executable] = experiment.package([
        xm.python_container(executor_spec=spec, path='.', base_image=FLAGS.base_image,
                            entrypoint=xm.ModuleName('cascade.main'),
                            use_deep_module=True),
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
  define_flags()
  app.run(main)
