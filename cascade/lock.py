"""One writer per workdir: `workdir/lock.json`, taken before a run writes anything else.

  held = lock.take(workdir, stale_s=600, force=False)   # WorkdirBusy: one line naming the holder
  try: ...run...
  finally: held.release()

Two runs on one workdir would clear each other's in-progress checkpoints and lose
progress.json updates, so the second one refuses. The lock is one small JSON
record (owner token, host, pid, since, heartbeat), created only if absent
(`paths.create_new`: a hard link locally, an `ifGenerationMatch=0` upload on
gs://) and rewritten by a heartbeat thread every `stale_s / 4` seconds (at most
30 s). A lock is taken over, with a one-line warning, when its holder is gone:
it names this host and a pid that no longer runs (a run killed with SIGKILL
reruns at once), or its heartbeat is older than `stale_s` (another host's run
that died; the hosts' clocks are assumed to agree to well within `stale_s`), or
the new run is told to (`force`, the `--force_lock` flag).

A run whose lock was taken over (`--force_lock` against a live run, or either
race below) stops before its next write: `Held.check` rereads the record (one
small read: a local file, or one object on gs://) and raises WorkdirBusy once
it names another owner or is gone, and the run calls it before every write to
the workdir (each checkpoint save, progress.json and results.*, each export,
each metrics.jsonl / samples.jsonl line written locally or upload to gs://,
each TensorBoard flush: `cascade.runner` wires it in). It is a read per write,
never a read per step that writes nothing. A write already under way when the
record changes (an Orbax save in flight) is not cut short; the loser then
leaves without closing its checkpoints (sealing would be a write) and drops
what its logs had not yet written. Outside the check: entries JAX adds to the
compilation cache (content-addressed: the other run writes the same bytes) and
the token cache a run builds as it loads its data, before its first step.

What is not atomic: a takeover removes the stale record and then creates its
own, so two runs taking over the same stale lock at the same moment can both
start; and a holder paused for longer than `stale_s` can rewrite a record that
another run took over meanwhile. Each run rereads the record before each write
and at every heartbeat, so such a loser finds at its next write that the record
names another owner, says so, and stops there.

Only process 0 of a multi-process run holds the lock; every process learns
whether it was taken, so they all refuse together.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

import jax
import numpy as np
from jax.experimental import multihost_utils

from foundation import paths

LOCK_FILE = 'lock.json'
# A heartbeat older than this (seconds) marks a holder as gone (runner.run's `lock_stale_s`).
DEFAULT_STALE_S = 600.0


class WorkdirBusy(RuntimeError):
  """Another run holds the workdir (or took it over from this one)."""


def _when(t: float) -> str:
  return time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))


def _pid_gone(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return True
  except (PermissionError, ValueError, TypeError, OverflowError):
    return False
  return False


def describe(rec: dict) -> str:
  """'host H, pid P, since T (last heartbeat N s ago)' of a lock record."""
  beat = rec.get('heartbeat')
  ago = f'{time.time() - beat:.0f} s ago' if isinstance(beat, (int, float)) else 'unknown'
  since = rec.get('since')
  return (f'host {rec.get("host", "?")}, pid {rec.get("pid", "?")}, since '
          f'{_when(since) if isinstance(since, (int, float)) else "?"} (last heartbeat {ago})')


def _read(path: str) -> dict | None:
  """The lock record, {} when it is unreadable (damaged), None when there is none."""
  try:
    rec = json.loads(paths.read_text(path))
  except FileNotFoundError:
    return None
  except (ValueError, UnicodeDecodeError):
    return {}
  return rec if isinstance(rec, dict) else {}


def gone_why(rec: dict, stale_s: float) -> str:
  """Why the holder of `rec` is gone ('' when it may still be running)."""
  if not rec:
    return 'its lock record is unreadable'
  if rec.get('host') == socket.gethostname() and _pid_gone(rec.get('pid')):
    return 'its process is gone'
  beat = rec.get('heartbeat')
  if not isinstance(beat, (int, float)) or time.time() - beat > stale_s:
    return f'no heartbeat for over {stale_s:g} s'
  return ''


class Held:
  """A lock this process holds (or, on processes other than 0, stands for the one process 0
  holds): a heartbeat thread keeps it fresh until `release`."""

  def __init__(self, path: str | None, rec: dict | None, stale_s: float):
    self.path, self._rec = path, rec
    self._stop = threading.Event()
    self._lost: dict | None = None
    self._thread = None
    if path is not None:
      self._thread = threading.Thread(target=self._beat, args=(min(30.0, stale_s / 4),),
                                      name='cascade-workdir-lock', daemon=True)
      self._thread.start()

  def _beat(self, every: float) -> None:
    while not self._stop.wait(every):
      if self._lost is not None:          # `check` found it taken over: never write it again
        return
      try:
        now = _read(self.path)
        if not now or now.get('owner') != self._rec['owner']:
          self._lost = now or {}
          print(f'WARNING: {self.path}: the workdir lock now belongs to another run '
                f'({describe(self._lost)}); this run stops before its next write', flush=True)
          return
        self._rec['heartbeat'] = time.time()
        paths.write_json(self.path, self._rec)
      except (OSError, ValueError) as e:   # a storage hiccup: the next beat tries again
        print(f'WARNING: {self.path}: heartbeat failed ({type(e).__name__}: '
              f'{str(e).splitlines()[0][:200] if str(e) else ""})', flush=True)

  @property
  def lost(self) -> bool:
    """Whether this run found its lock taken over (by `check` or the heartbeat)."""
    return self._lost is not None

  def check(self) -> None:
    """The check before a write: raises WorkdirBusy when the lock record no longer names this
    run (it rereads the record: one small read; a no-op on processes other than 0, which hold
    no record)."""
    if self._lost is None and self.path is not None:
      now = _read(self.path)
      if not now or now.get('owner') != self._rec['owner']:
        self._lost = now or {}
    if self._lost is not None:
      raise WorkdirBusy(f'{self.path}: another run took this workdir over '
                        f'({describe(self._lost)}); this run stopped before writing more')

  def release(self) -> None:
    """Stops the heartbeat and removes the lock if it is still this run's."""
    if self._thread is None:
      return
    self._stop.set()
    self._thread.join()
    self._thread = None
    if self._lost is None:
      now = _read(self.path)
      if now and now.get('owner') == self._rec['owner']:
        paths.remove(self.path)


def _acquire(workdir: str, stale_s: float, force: bool) -> Held:
  path = paths.join(workdir, LOCK_FILE)
  for _ in range(5):
    now = time.time()
    rec = {'owner': uuid.uuid4().hex, 'host': socket.gethostname(), 'pid': os.getpid(),
           'since': now, 'heartbeat': now}
    if paths.create_new(path, (json.dumps(rec, indent=1) + '\n').encode()):
      # A store that ignores the create precondition lets a racing run overwrite the record.
      mine = _read(path)
      if mine and mine.get('owner') == rec['owner']:
        return Held(path, rec, stale_s)
      continue
    holder = _read(path)
    if holder is None:            # released between the two calls: try again
      continue
    why = 'asked to (--force_lock)' if force else gone_why(holder, stale_s)
    if not why:
      raise WorkdirBusy(
          f'{workdir} is in use by another run: {describe(holder)}; wait for it to finish, or '
          f'if it is gone pass --force_lock (a lock with no heartbeat for {stale_s:g} s is '
          'taken over without it)')
    print(f'WARNING: {path}: taking over the workdir lock of {describe(holder)}: {why}',
          flush=True)
    paths.remove(path)
    force = False                 # override the holder we saw, not one that starts meanwhile
  raise WorkdirBusy(f'{path}: could not take the workdir lock (other runs keep taking it)')


def take(workdir: str, stale_s: float = DEFAULT_STALE_S, force: bool = False) -> Held:
  """Takes `workdir`'s lock on process 0; every process learns the outcome.

  Args:
    workdir: the run's directory (it exists).
    stale_s: a holder whose heartbeat is older than this many seconds is gone.
    force: take the lock over whatever its holder.

  Returns:
    The Held lock (on processes other than 0, a stand-in with nothing to release).

  Raises:
    WorkdirBusy: another run holds the workdir (one line naming its host, pid and start).
  """
  held, err = None, None
  if jax.process_index() == 0:
    try:
      held = _acquire(workdir, stale_s, force)
    except WorkdirBusy as e:
      err = e
  if jax.process_count() > 1:
    ok = multihost_utils.broadcast_one_to_all(np.int32(err is None))
    if not ok and err is None:
      err = WorkdirBusy(f'{workdir} is in use by another run (named on process 0)')
  if err is not None:
    raise err
  return held if held is not None else Held(None, None, stale_s)
