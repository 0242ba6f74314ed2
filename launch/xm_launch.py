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

FLAGS = flags.FLAGS


def define_flags():
  """Defines the CLI flags (only when run as a program, so importing stays side-effect free)."""
  flags.DEFINE_string('config', None, 'Config file, optionally with :arg.')
  flags.DEFINE_string('workdir_root', None, 'Root of the per-point workdirs.')
  flags.DEFINE_enum('executor', 'local', ['local', 'vertex'], 'Where jobs run.')
  flags.DEFINE_string('accelerator', None,
                      'xm.ResourceType name, e.g. tpu_v5p, tpu_v4, a100, h100.')
  flags.DEFINE_integer('accelerator_count', 1, 'Chips per job.')
  flags.DEFINE_string('base_image', 'python:3.11', 'Container base image (vertex).')
  flags.DEFINE_string('title', None, 'Experiment title (default: the config name).')


def job_args(config_spec: str, workdir: str, point: dict) -> list[str]:
  """Arguments of `python -m cascade.main` for one sweep point."""
  return sweep.point_command(config_spec, workdir, point)[3:]


def _executor():
  if FLAGS.executor == 'local':
    return xm_local.Local(), xm_local.Local.Spec()
  requirements = {}
  if FLAGS.accelerator:
    requirements[FLAGS.accelerator] = FLAGS.accelerator_count
  return (xm_local.Vertex(requirements=xm.JobRequirements(**requirements)),
          xm_local.Vertex.Spec())


def main(_):
  config, root = FLAGS.config, FLAGS.workdir_root
  if not config or not root:
    raise app.UsageError('--config and --workdir_root are required')
  try:
    points = sweep.load_points(config)
  except ValueError:
    points = [{}]
  executor, spec = _executor()
  title = FLAGS.title or os.path.basename(config.split(':')[0])
  with xm_local.create_experiment(experiment_title=title) as experiment:
    [executable] = experiment.package([
        xm.python_container(executor_spec=spec, path='.', base_image=FLAGS.base_image,
                            entrypoint=xm.ModuleName('cascade.main'),
                            use_deep_module=True),
    ])
    for i, point in enumerate(points):
      workdir = os.path.join(root, f'{i:03d}_{hyper.point_name(point)}')
      experiment.add(xm.Job(executable=executable, executor=executor,
                            args=job_args(config, workdir, point)))


if __name__ == '__main__':
  define_flags()
  app.run(main)
