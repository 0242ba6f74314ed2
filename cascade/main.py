"""Command line: run (or resume) a cascade.

  python -m cascade.main --config=configs/tiny.py --workdir=runs/tiny
  python -m cascade.main --config=configs/tiny.py:seed=1 --workdir=runs/tiny_s1 \
      --config.stages[2].steps=10 --config.eval.num_prompts=64

`--config` is a Python file whose `get_config(arg)` returns the ConfigDict
(`configs/x.py:arg` passes `arg`); `--config.a.b=v` overrides any field,
list entries by index. Rerunning the same command in the same `--workdir`
resumes at the exact stage and step; a workdir that ran a different config
refuses to start unless `--config.allow_config_change=True`.

Multi-host: `jax.distributed.initialize()` runs first when the environment
asks for it (see cascade/distributed.py).
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Config file (configs/x.py or configs/x.py:arg).', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; an existing one is resumed.')
flags.mark_flags_as_required(['config', 'workdir'])


def parse_flags(argv):
  """absl's flag parsing, with a config override that names no field as one line (exit 2)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(2)
  except IndexError as e:
    culprit = [a for a in argv[1:] if a.startswith('--config.') and '[' in a.partition('=')[0]]
    print(f'error: a --config override indexes past the end of a list ({e}): '
          f'{" ".join(culprit)}', file=sys.stderr, flush=True)
    sys.exit(2)
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    key = str(e).strip('"\'')
    culprit = next((a for a in argv[1:] if a.startswith('--config.')
                    and key and key in a.partition('=')[0]), None)
    where = f' ({culprit})' if culprit else ''
    print(f'error: a --config override names no field of the config: {key!r}{where}',
          file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize()         # before any other JAX work (gloo on CPU)
  from cascade import checkpoint  # pylint: disable=g-import-not-at-top
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade import data  # pylint: disable=g-import-not-at-top
  from cascade import train  # pylint: disable=g-import-not-at-top
  from cascade.kinds import base as kinds_base  # pylint: disable=g-import-not-at-top
  try:
    train.run(_CONFIG.value, _WORKDIR.value)
  except (config_lib.ConfigError, data.DataError, checkpoint.WorkdirError,
          checkpoint.CheckpointError, kinds_base.StageError) as e:
    # Expected user errors: one clear line, no traceback.
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(2)
  except OSError as e:
    # A full disk, a read-only or unusable workdir: what was written stays valid (every
    # file is written to a temporary name and renamed; checkpoints are finalised atomically).
    where = f'{e.filename}: ' if e.filename else ''
    print(f'error: {where}{e.strerror or e} (errno {e.errno}); nothing already written was '
          'changed: free the space or fix the path and rerun the same command to resume',
          file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
