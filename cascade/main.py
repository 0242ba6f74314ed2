"""Command line: run (or resume) a cascade.

  python -m cascade.main --config=configs/tiny.py --workdir=runs/tiny
  python -m cascade.main --config=configs/tiny.py:seed=1 --workdir=runs/tiny_s1 \
      --config.stages.math_rl.steps=10 --config.eval.num_prompts=64

`--workdir` (and any path in the config) may be `gs://bucket/...` (models/paths.py).
`--config` is a Python file whose `get_config(arg)` returns the ConfigDict
(`configs/x.py:arg` passes `arg`); `--config.a.b=v` overrides any field, list
entries by index, stages by name or index (`stages.math_rl`, `stages[4]`), and
a field the config leaves unset with the type its schema declares
(`--config.mesh.shape=1,2,1`; cascade/overrides.py). Rerunning the same command
in the same `--workdir` resumes at the exact stage and step; a workdir that ran a
different config refuses to start unless `--config.allow_config_change=True`
(one whose run stopped before its first step is taken over).

Exit status: 0 done; 2 a config, data, workdir or storage problem, or a verifier that raises
in its own code (one line); 3 a stage
diverged (cascade/divergence.py); 75 stopped by SIGTERM or SIGINT at a step boundary with a
checkpoint (cascade/preemption.py): rerun the same command to resume.

Output: a start banner (config, workdir, devices and mesh, the stages, the resume
point, each verifier's isolation), then one line per event (stage i of N with the
cascade's ETA, each domain evaluated, each export; cascade/report.py). Logs:
warnings and errors only; `--verbosity=0` adds the libraries' INFO lines (JAX,
Orbax, the compilation cache).

Multi-host: `jax.distributed.initialize()` runs first when the environment
asks for it (see cascade/distributed.py).
"""

import logging
import os
import sys

from absl import app
from absl import flags
from absl import logging as absl_logging

from cascade import overrides

# config_flags.DEFINE_config_file(lock_config=True), whose overrides also name stages and unset
# fields (cascade/overrides.py).
_CONFIG = overrides.define_config_file('config', 'Config file (configs/x.py or configs/x.py:arg).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; an existing one is resumed.')
_FORK_FROM = flags.DEFINE_string(
    'fork_from', None, "Another run's workdir: the leading stages this config shares with it "
    '(identical stages, identical other sections) are copied from there, not rerun.')
_FORCE_LOCK = flags.DEFINE_bool(
    'force_lock', False, "Take the workdir's lock over even from a run that looks alive.")
_LOCK_STALE_S = flags.DEFINE_float(
    'lock_stale_s', 600.0, 'A workdir lock with no heartbeat for this many seconds is taken over.')
flags.mark_flags_as_required(['config', 'workdir'])


# absl's flag parsing; a bad config file, argument or override is one line (exit 2).
parse_flags = overrides.flags_parser(_CONFIG)


_STORAGE_MARKERS = ('RESOURCE_EXHAUSTED', 'No space left', 'Read-only file system',
                    'Failed writing', 'Error writing')


def storage_error(e: BaseException) -> bool:
  """Whether an exception is the storage failing (full, read-only, unwritable), from Python's
  file calls (OSError) or from tensorstore under Orbax (a ValueError naming the write)."""
  return isinstance(e, OSError) or (isinstance(e, (ValueError, RuntimeError)) and any(
      m in str(e) for m in _STORAGE_MARKERS))


class _QuietStorageErrors(logging.Filter):
  """Background savers (Orbax threads) log a storage error with its traceback before the run
  stops with one line about it; keep their message, drop the traceback."""

  def filter(self, record):
    if record.exc_info and record.exc_info[1] is not None and storage_error(record.exc_info[1]):
      record.exc_info, record.exc_text = None, None
    return True


def quiet_library_logs() -> None:
  """Library INFO logs (JAX probing for a TPU, the compilation cache, Orbax's checkpoint
  manager: hundreds of lines a run) off, unless --verbosity (-v) was given: absl's app.run
  raises an unset verbosity to INFO. Warnings (cascade's, e.g. an unsandboxed verifier, and the
  libraries') always show."""
  if not flags.FLAGS['verbosity'].present:
    absl_logging.set_verbosity(absl_logging.WARNING)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  quiet_library_logs()
  for handler in logging.getLogger().handlers:
    handler.addFilter(_QuietStorageErrors())
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize()         # before any other JAX work (gloo on CPU)
  from cascade import checkpoint  # pylint: disable=g-import-not-at-top
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade import data  # pylint: disable=g-import-not-at-top
  from cascade import divergence  # pylint: disable=g-import-not-at-top
  from cascade import lock  # pylint: disable=g-import-not-at-top
  from cascade import preemption  # pylint: disable=g-import-not-at-top
  from cascade import runner  # pylint: disable=g-import-not-at-top
  from cascade import verifier_set  # pylint: disable=g-import-not-at-top
  from cascade.kinds import base as kinds_base  # pylint: disable=g-import-not-at-top
  from models import paths  # pylint: disable=g-import-not-at-top
  from verifiers import sandbox  # pylint: disable=g-import-not-at-top
  try:
    runner.run(_CONFIG.value, _WORKDIR.value, fork_from=_FORK_FROM.value,
               force_lock=_FORCE_LOCK.value, lock_stale_s=_LOCK_STALE_S.value,
               command=overrides.described(_CONFIG, sys.argv))
  except (config_lib.ConfigError, data.DataError, checkpoint.WorkdirError, lock.WorkdirBusy,
          checkpoint.CheckpointError, kinds_base.StageError, paths.PathError,
          sandbox.SandboxUnavailable, verifier_set.VerifierBug) as e:
    # Expected user errors: one clear line, no traceback.
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(2)
  except divergence.Diverged as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(divergence.EXIT_CODE)
  except preemption.Preempted as e:
    print(e, file=sys.stderr, flush=True)
    sys.exit(preemption.EXIT_CODE)
  except Exception as e:  # pylint: disable=broad-except
    if not storage_error(e):
      raise
    # A full disk, a read-only or unusable workdir: what was written stays valid (every
    # file is written to a temporary name and renamed; checkpoints are finalised atomically).
    if isinstance(e, OSError):
      where, why = e.filename or _WORKDIR.value, f'{e.strerror or e} (errno {e.errno})'
    else:
      where, why = _WORKDIR.value, str(e).strip().splitlines()[0][:200]
    print(f'error: {where}: {why}; nothing already written was changed: free the space or '
          'fix the path and rerun the same command to resume', file=sys.stderr, flush=True)
    # Leave at once: background savers and writers would only repeat the same error
    # (in tracebacks) on their way out; every file already finalised stays valid.
    os._exit(2)  # pylint: disable=protected-access


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
