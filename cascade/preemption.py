"""Preemption: SIGTERM and SIGINT stop a run at the next step boundary, with a checkpoint.

A preempted TPU VM or a scheduler sends SIGTERM (then SIGKILL after a grace
period); Ctrl-C sends SIGINT. While `watch()` is active (`cascade.runner.run`
holds it) either signal only sets a flag: the stage loop asks `stop_requested()`
at every step boundary and, once it is set, saves that step's checkpoint, waits
for the write and raises `Preempted`; a matrix row's evaluation asks before
each batch and, once it is set, keeps what it evaluated for the rerun
(`cascade.runner.evaluate_row`) and raises `Preempted`; `cascade.runner.run`
asks again before each stage. The command line prints the exception's one line
and exits with EXIT_CODE (75, EX_TEMPFAIL: a temporary failure, rerun to resume).

Several hosts must stop at the same step: their checkpoint saves are
collective, so one host saving while another steps on would hang both.
`stop_requested()` is therefore itself a collective: every process's flag is
all-gathered (one int per process) and all stop when any was signalled, so a
signal sent to one host or to all stops every host at the same boundary. (JAX's
own `multihost_utils.reached_preemption_sync_point` would do this for SIGTERM
only, and only where `jax.distributed` runs: not for Ctrl-C nor in one process.)

A second signal while stopping leaves at once, without waiting for the save:
nothing written is damaged (an unfinished Orbax save is a temporary directory
the next run removes; every JSON file is written whole), and the rerun resumes
from the newest finished checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

# The exit status of a run stopped by a signal (BSD sysexits' EX_TEMPFAIL: retry later).
EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received: list[str] = []     # names of the signals received while watching, in order


class Preempted(Exception):
  """The run stopped at a step boundary on a signal; the message is one line (what was saved)."""


def _handle(signum, frame) -> None:
  del frame
  name = signal.Signals(signum).name
  _received.append(name)
  # os.write, not print: the main thread may be inside a print to stderr (tqdm's bar) when the
  # handler runs, and a re-entrant buffered write raises.
  if len(_received) == 1:
    os.write(2, f'\n{name}: stopping at the next step boundary, with a checkpoint (or before the '
                'next batch of an evaluation, keeping what it evaluated)\n'.encode())
  else:
    os.write(2, f'{name} again: leaving now without waiting for the checkpoint being written; '
                'the newest finished one stays valid: rerun the same command to resume\n'.encode())
    os._exit(EXIT_CODE)  # pylint: disable=protected-access


@contextlib.contextmanager
def watch():
  """Turns SIGTERM and SIGINT into a stop request for the duration (main thread only: Python
  installs handlers there; elsewhere, e.g. a run in a notebook's worker thread, nothing
  changes). The previous handlers come back afterwards."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  _received.clear()
  previous = {s: signal.signal(s, _handle) for s in SIGNALS}
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
    _received.clear()


def signalled() -> str | None:
  """The first signal this process received while watching (e.g. 'SIGTERM'), or None."""
  return _received[0] if _received else None


def stop_requested() -> str | None:
  """Whether any process was signalled: this process's first signal ('SIGTERM'), 'a signal to
  process N' when only another one was, or None. A collective in a multi-process run: every
  process calls it at the same points (each step boundary, each evaluation batch, each
  stage's start)."""
  mine = signalled()
  if jax.process_count() == 1:
    return mine
  flags = np.asarray(multihost_utils.process_allgather(np.array([mine is not None], np.int32)))
  if mine is None and flags.any():
    return f'a signal to process {int(np.flatnonzero(flags.reshape(-1))[0])}'
  return mine
