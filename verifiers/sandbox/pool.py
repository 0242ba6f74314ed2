"""A pool of long-lived worker processes with per-request wall-clock limits.

Workers speak `framing` (length-prefixed JSON) on their
stdin/stdout: first a `{'ready': true}` message, then one answer per request.
The pool keeps every worker busy with one request at a time, kills a worker
whose request overruns its deadline (the only reliable way to stop runaway
Python such as a pathological sympy simplification) and starts a fresh one
in its place, as it does for a worker whose answer says it must not be
reused (`restart_if`, e.g. a sandbox left unclean by a candidate). Workers start lazily on the first `run` and live until `close`;
a finaliser kills them if the pool is garbage-collected or the interpreter
exits, so no process outlives its owner.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import select
import signal
import subprocess
import time
import weakref
from typing import Any, Callable, Sequence

from verifiers.sandbox import framing

# Consecutive failed starts after which the pool gives up: the worker
# command is broken, and scoring every sample 0 would hide that.
_MAX_FAILED_STARTS = 3


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What became of one request.

  Attributes:
    ok: the worker answered.
    value: the worker's answer (a JSON value) when ok.
    error: why there is no answer ('timeout after 2.0s', 'worker died ...').
  """
  ok: bool
  value: Any = None
  error: str = ''


class _Worker:
  """One process and its bookkeeping."""

  def __init__(self, proc: subprocess.Popen, startup_deadline: float):
    self.proc = proc
    self.reader = framing.FrameReader()
    self.state = 'starting'          # 'starting' | 'idle' | 'busy' | 'dead'
    self.deadline = startup_deadline  # of the start or of the current request
    self.job = -1
    self.timeout = 0.0
    os.set_blocking(proc.stdout.fileno(), False)

  @property
  def fd(self) -> int:
    return self.proc.stdout.fileno()


def _kill(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      proc.kill()
  for stream in (proc.stdin, proc.stdout):
    try:
      stream.close()
    except OSError:
      pass
  proc.wait()


def _kill_all(procs: list) -> None:
  for proc in list(procs):
    _kill(proc)
  procs.clear()


class ProcessPool:
  """Long-lived workers answering framed JSON requests under deadlines."""

  def __init__(self, spawn: Callable[[int], subprocess.Popen], size: int, *, name: str,
               startup_timeout_s: float = 120.0,
               restart_if: Callable[[Any], bool] | None = None):
    """Creates the pool; no process starts before the first `run`.

    Args:
      spawn: starts worker number i; must return a Popen with stdin and
        stdout pipes, in its own session (start_new_session=True).
      size: number of workers (>= 1).
      name: shown in errors.
      startup_timeout_s: how long a worker may take to report ready.
      restart_if: called with each answer; True replaces the worker that gave
        it (the answer still counts).
    """
    if size < 1:
      raise ValueError(f'{name}: pool size must be >= 1, got {size}')
    self._spawn = spawn
    self._size = size
    self._name = name
    self._startup_timeout_s = startup_timeout_s
    self._workers: list[_Worker | None] = [None] * size
    self._procs: list[subprocess.Popen] = []
    self._failed_starts = 0
    self._restart_if = restart_if
    self.restarts = 0
    # Workers are started on a thread of the pool's own: a worker dies with the *thread* that
    # started it (PR_SET_PDEATHSIG, verifiers/sandbox/worker.py), so workers started by a
    # short-lived caller (a step's scoring thread) were killed when it ended, and the next
    # batch lost a request to a worker that was dying ('worker exited (exit status -9)').
    self._spawner: concurrent.futures.ThreadPoolExecutor | None = None
    self._finalizer = weakref.finalize(self, _kill_all, self._procs)

  @property
  def pids(self) -> list[int]:
    """Process ids of the running workers."""
    return [w.proc.pid for w in self._workers if w is not None and w.state != 'dead']

  def close(self) -> None:
    """Stops every worker: closes its stdin, then kills what is left."""
    for w in self._workers:
      if w is not None:
        try:
          w.proc.stdin.close()
        except OSError:
          pass
    deadline = time.monotonic() + 1.0
    for proc in self._procs:
      try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
    _kill_all(self._procs)
    self._workers = [None] * self._size
    if self._spawner is not None:
      self._spawner.shutdown(wait=False)
      self._spawner = None

  def _start(self, i: int) -> None:
    if self._spawner is None:
      self._spawner = concurrent.futures.ThreadPoolExecutor(
          1, thread_name_prefix=f'{self._name}-spawner')
    proc = self._spawner.submit(self._spawn, i).result()
    self._procs.append(proc)
    self._workers[i] = _Worker(proc, time.monotonic() + self._startup_timeout_s)

  def _retire(self, i: int, why: str) -> None:
    """Kills worker i and starts its replacement."""
    w = self._workers[i]
    was_starting = w.state == 'starting'
    _kill(w.proc)
    if w.proc in self._procs:
      self._procs.remove(w.proc)
    w.state = 'dead'
    self.restarts += 0 if was_starting else 1
    if was_starting:
      self._failed_starts += 1
    if self._failed_starts >= _MAX_FAILED_STARTS:
      raise RuntimeError(f'{self._name}: workers fail to start ({why}); '
                         f'last exit status {w.proc.returncode}')
    self._start(i)

  def run(self, payloads: Sequence[Any], timeouts: Sequence[float]) -> list[Outcome]:
    """Answers every request; a stuck or crashed request never blocks the rest.

    Args:
      payloads: JSON-serialisable requests.
      timeouts: wall-clock seconds each request may take, once a worker has
        picked it up (worker start-up is not counted).

    Returns:
      One Outcome per payload, in order.

    Raises:
      RuntimeError: workers cannot be started at all.
    """
    results: list[Outcome | None] = [None] * len(payloads)
    queue = collections.deque(range(len(payloads)))
    for i, w in enumerate(self._workers):
      if w is None:
        self._start(i)
      elif w.proc.poll() is not None:  # Died between batches.
        w.state = 'idle'
        self._retire(i, 'worker exited')
    while queue or any(w.state == 'busy' for w in self._workers):
      for i, w in enumerate(self._workers):
        while w.state == 'idle' and queue:
          job = queue.popleft()
          try:
            frame = framing.encode_frame(payloads[job])
          except (TypeError, ValueError) as e:  # NaN, too large, not JSON.
            results[job] = Outcome(False, error=f'request cannot be sent: {e}')
            continue
          try:
            w.proc.stdin.write(frame)
            w.proc.stdin.flush()
          except (BrokenPipeError, OSError):
            queue.appendleft(job)
            self._failed_starts += 1  # Ready, then gone before serving: a bad start.
            self._retire(i, 'stdin closed')
            w = self._workers[i]
            continue
          w.state, w.job, w.timeout = 'busy', job, float(timeouts[job])
          w.deadline = time.monotonic() + w.timeout
      waiting = {w.fd: i for i, w in enumerate(self._workers) if w.state in ('starting', 'busy')}
      if not waiting:
        continue
      wait_s = min(self._workers[i].deadline for i in waiting.values()) - time.monotonic()
      poller = select.poll()
      for fd in waiting:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
      events = poller.poll(max(0, int(wait_s * 1000) + 1))
      for fd, _ in events:
        i = waiting[fd]
        w = self._workers[i]
        try:
          data = os.read(fd, 1 << 20)
          messages = w.reader.feed(data) if data else None
        except BlockingIOError:
          continue
        except (OSError, ValueError) as e:
          data, messages = b'', None
          why = f'protocol error: {e}'
        else:
          why = 'worker exited'
        if messages is None:
          if w.state == 'busy':
            try:  # Its stdout is closed, so it is exiting: wait for the status.
              status = w.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
              status = None
            results[w.job] = Outcome(False, error=f'{why} (exit status {status})')
          self._retire(i, why)
          continue
        for msg in messages:
          if w.state == 'starting':
            w.state = 'idle'
          elif w.state == 'busy':
            results[w.job] = Outcome(True, value=msg)
            w.state, w.job = 'idle', -1
            self._failed_starts = 0
            if self._restart_if is not None and self._restart_if(msg):
              self._retire(i, 'worker asked to be replaced')
              break
      now = time.monotonic()
      for i, w in enumerate(self._workers):
        if w.state in ('starting', 'busy') and now > w.deadline:
          if w.state == 'busy':
            results[w.job] = Outcome(False, error=f'timeout after {w.timeout:g}s')
          self._retire(i, 'start-up timed out' if w.state == 'starting' else 'request timed out')
    return results


def popen_kwargs() -> dict:
  """Keyword arguments every worker Popen needs (pipes, own session)."""
  return dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, bufsize=-1)
