"""How `python -m cascade.main` ends: each way a run stops, its exit status and its one line.

  0   done (or a finished run's results printed)
  2   a problem the user fixes: the config, the data, the workdir (another run's, its lock,
      full or unwritable storage), no usable sandbox, a verifier that raises in its own code
  3   a stage diverged (cascade/divergence.py)
  75  stopped by SIGTERM or SIGINT at a step boundary with a checkpoint (cascade/preemption.py)

Each of these prints one line on stderr, no traceback; anything else is a bug of cascade's
and keeps its traceback (exit 1).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

_STORAGE_MARKERS = ('RESOURCE_EXHAUSTED', 'No space left', 'Read-only file system',
                    'Failed writing', 'Error writing')


def storage_error(e: BaseException) -> bool:
  """Whether an exception is the storage failing (full, read-only, unwritable), from Python's
  file calls (OSError) or from tensorstore under Orbax (a ValueError naming the write)."""
  return isinstance(e, OSError) or (isinstance(e, (ValueError, RuntimeError)) and any(
      m in str(e) for m in _STORAGE_MARKERS))


class QuietStorageErrors(logging.Filter):
  """Background savers (Orbax threads) log a storage error with its traceback before the run
  stops with one line about it; keep their message, drop the traceback."""

  def filter(self, record):
    if record.exc_info and record.exc_info[1] is not None and storage_error(record.exc_info[1]):
      record.exc_info, record.exc_text = None, None
    return True


def run(fn: Callable[[], object], workdir: str) -> None:
  """Calls `fn` (the run), turning each way it can stop into its exit status and one line.

  Args:
    fn: the run.
    workdir: the run's directory, named by a storage error that names no file.
  """
  # pylint: disable=g-import-not-at-top  (JAX starts only after the flags are parsed)
  from cascade import checkpoint
  from cascade import config as config_lib
  from cascade import data
  from cascade import divergence
  from cascade import lock
  from cascade import preemption
  from cascade import verifier_errors
  from cascade.kinds import base as kinds_base
  from models import paths
  from verifiers import sandbox
  # pylint: enable=g-import-not-at-top
  try:
    fn()
  except (config_lib.ConfigError, data.DataError, checkpoint.WorkdirError, lock.WorkdirBusy,
          checkpoint.CheckpointError, kinds_base.StageError, paths.PathError,
          sandbox.SandboxUnavailable, verifier_errors.VerifierBug) as e:
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
      where, why = e.filename or workdir, f'{e.strerror or e} (errno {e.errno})'
    else:
      where, why = workdir, str(e).strip().splitlines()[0][:200]
    print(f'error: {where}: {why}; nothing already written was changed: free the space or '
          'fix the path and rerun the same command to resume', file=sys.stderr, flush=True)
    # Leave at once: background savers and writers would only repeat the same error
    # (in tracebacks) on their way out; every file already finalised stays valid.
    os._exit(2)  # pylint: disable=protected-access
