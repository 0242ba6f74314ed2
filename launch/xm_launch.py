"""Launches a config's sweep through XManager (optional extra: `pip install -e .[xm]`).

    xmanager launch launch/xm_launch.py -- --config=configs/nemotron_cascade_14b.py \
        --executor=vertex --accelerator=tpu_v5p --accelerator_count=64 --workdir_root=gs://b/runs

Every point of the config's `get_hyper(h)` (or the config alone when it has
none) becomes one job running `python -m cascade.main` with that point's
`--config.<key>=<value>` overrides and its own workdir. `--executor=local`
runs the jobs in local Docker-less processes (xm_local.Local); `vertex`
submits to Vertex AI with the named accelerator.
"""

from __future__ import annotations

import os

from absl import app
from absl import flags
from xmanager import xm
from xmanager import xm_local

from launch import hyper
from launch import sweep

_CONFIG = flags.DEFINE_string('config', None, 'Config file, optionally with :arg.')
_ROOT = flags.DEFINE_string('workdir_root', None, 'Root of the per-point workdirs.')
_EXECUTOR = flags.DEFINE_enum('executor', 'local', ['local', 'vertex'], 'Where jobs run.')
_ACCEL = flags.DEFINE_string('accelerator', None,
                             'xm.ResourceType name, e.g. tpu_v5p, tpu_v4, a100, h100.')
_ACCEL_COUNT = flags.DEFINE_integer('accelerator_count', 1, 'Chips per job.')
_IMAGE = flags.DEFINE_string('base_image', 'python:3.11', 'Container base image (vertex).')
_TITLE = flags.DEFINE_string('title', None, 'Experiment title (default: the config name).')


def job_args(config_spec: str, workdir: str, point: dict) -> list[str]:
  """Arguments of `python -m cascade.main` for one sweep point."""
  return sweep.point_command(config_spec, workdir, point)[3:]


def _executor():
  if _EXECUTOR.value == 'local':
    return xm_local.Local(), xm_local.Local.Spec()
  requirements = {}
  if _ACCEL.value:
    requirements[_ACCEL.value] = _ACCEL_COUNT.value
  return (xm_local.Vertex(requirements=xm.JobRequirements(**requirements)),
          xm_local.Vertex.Spec())


def main(_):
  if not _CONFIG.value or not _ROOT.value:
    raise app.UsageError('--config and --workdir_root are required')
  try:
    points = sweep.load_points(_CONFIG.value)
  except ValueError:
    points = [{}]
  executor, spec = _executor()
  title = _TITLE.value or os.path.basename(_CONFIG.value.split(':')[0])
  with xm_local.create_experiment(experiment_title=title) as experiment:
    [executable] = experiment.package([
        xm.python_container(executor_spec=spec, path='.', base_image=_IMAGE.value,
                            entrypoint=xm.ModuleName('cascade.main'),
                            use_deep_module=True),
    ])
    for i, point in enumerate(points):
      workdir = os.path.join(_ROOT.value, f'{i:03d}_{hyper.point_name(point)}')
      experiment.add(xm.Job(executable=executable, executor=executor,
                            args=job_args(_CONFIG.value, workdir, point)))


if __name__ == '__main__':
  app.run(main)
