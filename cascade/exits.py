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

import errno
import logging
import os
import sys
import threading
import warnings
from typing import Callable

_STORAGE_MARKERS = ('RESOURCE_EXHAUSTED', 'No space left', 'Read-only file system',
                    'Failed writing', 'Error writing')
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def storage_error(e: BaseException) -> bool:
  """Whether an exception is the storage failing (full, read-only, unwritable), from Python's
  file calls (OSError) or from tensorstore under Orbax (a ValueError naming the write)."""
  return isinstance(e, OSError) or (isinstance(e, (ValueError, RuntimeError)) and any(
      m in str(e) for m in _STORAGE_MARKERS))


def _full(e: BaseException | None) -> bool:
  """Whether an exception is storage that is full or read-only (narrower than storage_error:
  what a background writer's failure is quietened for)."""
  if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
    return True
  return isinstance(e, Exception) and any(m in str(e) for m in _STORAGE_MARKERS)


class QuietStorageErrors(logging.Filter):
  """A full or read-only disk ends the run with one line (`run`); what the libraries'
  background writers log about it on their way is dropped instead of burying that line: the
  error itself, with or without its traceback (Orbax's save threads and event loops), and,
  once one was seen, Orbax's reports that the save therefore failed."""

  def __init__(self):
    super().__init__()
    self._seen = False

  def filter(self, record):
    exc = record.exc_info[1] if record.exc_info else None
    try:
      text = record.getMessage()
    except Exception:  # pylint: disable=broad-except
      text = str(record.msg)
    if _full(exc) or any(m in text for m in _STORAGE_MARKERS):
      self._seen = True
      return False
    return not (self._seen and record.levelno >= logging.ERROR and 'orbax' in record.pathname)


def quiet_library_logs() -> None:
  """The libraries' INFO logs off, unless --verbosity (-v) was given: JAX probing for a TPU
  ("Unable to initialize backend 'tpu'", on every host without one), the compilation cache,
  Orbax's checkpoint manager (hundreds of lines a run). absl's app.run raises an unset
  verbosity to INFO; this sets it back to WARNING, so warnings and errors (cascade's, e.g. an
  unsandboxed verifier, and the libraries') still show. Called first in the `main` of every
  command whose output is its own lines (cascade.main, cascade.evaluate, cascade.prepare,
  cascade.device_check, launch.plan), after absl parsed the flags and before JAX starts a
  backend."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS['verbosity'].present:
    absl_logging.set_verbosity(absl_logging.WARNING)


def quiet_storage_errors() -> None:
  """Makes a full or read-only disk one line: every log handler gets `QuietStorageErrors`, a
  thread that dies of it prints no traceback, and a warning about it (JAX's compilation cache
  failing to write an entry) is not shown; the run itself stops on the error with its line."""
  for handler in logging.getLogger().handlers:
    handler.addFilter(QuietStorageErrors())
  default = threading.excepthook

  def hook(args):
    if not _full(args.exc_value):
      default(args)
  threading.excepthook = hook
  warnings.filterwarnings('ignore', message='.*(' + '|'.join(_STORAGE_MARKERS) + ')')


def run(fn: Callable[[], object], workdir: str) -> None:
  """Calls `fn` (the run), turning each way it can stop into its exit status and one line.

  Args:
    fn: the run.
    workdir: the run's directory, named by a storage error that names no file.
  """
  # pylint: disable=g-import-not-at-top  (JAX starts only after the flags are parsed)
  from cascade import checkpoint
  from cascade import config as config_lib
  from cascade.data import readers
  from cascade import divergence
  from cascade import lock
  from cascade import preemption
  from cascade import verifier_errors
  from cascade.kinds import base as kinds_base
  from foundation import paths
  from verifiers import sandbox
  from cascade import metrics
  # pylint: enable=g-import-not-at-top
  try:
    fn()
  except (config_lib.ConfigError, readers.DataError, checkpoint.WorkdirError, lock.WorkdirBusy,
          checkpoint.CheckpointError, kinds_base.StageError, paths.PathError,
          sandbox.SandboxUnavailable, verifier_errors.VerifierBug) as e:
    metrics.close_bars()          # the line starts a line of its own, not a progress bar's
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(2)
  except divergence.Diverged as e:
    metrics.close_bars()
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(divergence.EXIT_CODE)
  except preemption.Preempted as e:
    metrics.close_bars()
    print(e, file=sys.stderr, flush=True)
    sys.exit(preemption.EXIT_CODE)
  except Exception as e:  # pylint: disable=broad-except
    if not storage_error(e):
      raise
    # A full disk, a read-only or unusable workdir: what was written stays valid (every
    # file is written to a temporary name and renamed; checkpoints are finalised atomically).
    if isinstance(e, OSError):
      where, why = e.filename or workdir, f'{e.strerror or e} (errno {e.errno})'
    elif 'No space left' in str(e):     # tensorstore's, inside a long message about the write
      where, why = workdir, f'No space left on device (errno {errno.ENOSPC})'
    else:
      where, why = workdir, str(e).strip().splitlines()[0][:200]
    metrics.close_bars()
    print(f'error: {where}: {why}; nothing already written was changed: free the space or '
          'fix the path and rerun the same command to resume', file=sys.stderr, flush=True)
    # Leave at once: background savers and writers would only repeat the same error
    # (in tracebacks) on their way out; every file already finalised stays valid.
    os._exit(2)  # pylint: disable=protected-access
