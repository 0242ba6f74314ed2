"""Isolated execution of untrusted Python: bubblewrap fork servers, or a loud rlimit fallback.

Each worker is one `sandbox_server` process that lives for the whole stage
and forks a child per test run, so a run costs a fork, not an interpreter
start. With bubblewrap the server sits in new PID, network, IPC, UTS and
mount namespaces, sees a read-only root assembled from the system directories
and the Python installation only (no home, no repository, no host /tmp),
writes only to a private size-capped tmpfs, and dies with its parent.
Children additionally get rlimits on CPU time, address space, processes and
file size, and a wall-clock limit.

When the host runs as root, the children run as an unprivileged uid unique
to their server: the kernel never limits the process count of root, so a
fork bomb is only stopped by a real unprivileged uid, and that uid also lets
the server kill every leftover process with one `kill(-1)`. (This is also why
the user namespace of `--unshare-all` is left out as root: inside one, the
sandbox uid maps back to host root.) As a normal user, bubblewrap runs
unprivileged with `--unshare-all`, and the process limit counts inside its
user namespace.

Without a working bubblewrap the servers run as plain subprocesses in a temp
dir with the same rlimits, after a loud warning; `strict_isolation=True`
refuses instead.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import weakref
from typing import Sequence

from verifiers import pool as pool_lib
from verifiers import sandbox_server

SERVER_PATH = os.path.abspath(sandbox_server.__file__)
# Host directories the sandbox sees read-only (when they exist).
_SYSTEM_DIRS = ('/usr', '/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32', '/etc')
_ENV = {'PATH': '/usr/local/bin:/usr/bin:/bin', 'LANG': 'C.UTF-8', 'HOME': '/tmp',
        'PYTHONHASHSEED': '0', 'PYTHONDONTWRITEBYTECODE': '1'}
# Seconds the host waits beyond a request's budget before it kills the
# server itself (the server enforces the budget; this is the backstop).
_GRACE_S = 5.0
_UID_BASE = 2_000_000
_slots = itertools.count()

_FALLBACK_WARNING = (
    '\n' + '!' * 78 + '\n'
    'verifiers.sandbox: bubblewrap is unavailable ({why}).\n'
    'Untrusted code will run in rlimited subprocesses in a temp dir WITHOUT\n'
    'filesystem, network or PID isolation. Install bubblewrap (`make sysdeps`,\n'
    'or apt-get install bubblewrap) or pass strict_isolation=True to refuse.\n' + '!' * 78)


def _sandbox_uid(slot: int) -> int:
  """A uid no other live sandbox server uses: derived from our pid and a slot."""
  return _UID_BASE + ((os.getpid() % (1 << 22)) << 9) + slot % 512


def _python_dirs() -> list[str]:
  """Directories the interpreter needs: installation, venv, real binary."""
  dirs = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), sys.prefix,
          os.path.dirname(os.path.realpath(sys.executable))}
  out = []
  for d in sorted(dirs):
    if not any(d == s or d.startswith(s + '/') for s in _SYSTEM_DIRS if os.path.isdir(s)):
      out.append(d)
  # Bind only outermost dirs; nested ones are already visible.
  return [d for d in out if not any(d != o and d.startswith(o + '/') for o in out)]


def bwrap_argv(bwrap: str, *, as_root: bool, tmpfs_mb: int) -> list[str]:
  """The bubblewrap command line up to (not including) the command to run.

  Args:
    bwrap: path of the bwrap binary.
    as_root: the host runs as root (privileged bwrap, no user namespace).
    tmpfs_mb: size of the private /tmp.

  Returns:
    argv list.
  """
  if as_root:
    argv = [bwrap, '--unshare-ipc', '--unshare-pid', '--unshare-net', '--unshare-uts',
            '--unshare-cgroup-try', '--cap-drop', 'ALL', '--cap-add', 'CAP_SETUID',
            '--cap-add', 'CAP_SETGID', '--cap-add', 'CAP_CHOWN']
  else:
    argv = [bwrap, '--unshare-all']
  argv += ['--die-with-parent', '--new-session']
  for d in _SYSTEM_DIRS:
    if os.path.islink(d):
      argv += ['--symlink', os.readlink(d), d]
    elif os.path.isdir(d):
      argv += ['--ro-bind', d, d]
  made = set()
  for d in _python_dirs():
    parts = d.strip('/').split('/')
    for k in range(1, len(parts)):
      parent = '/' + '/'.join(parts[:k])
      if parent not in made:
        # Parents bwrap creates are private by default; the sandbox uid must
        # traverse them to reach the interpreter.
        argv += ['--perms', '0755', '--dir', parent]
        made.add(parent)
    argv += ['--ro-bind', d, d]
  argv += ['--ro-bind', SERVER_PATH, '/sandbox_server.py', '--proc', '/proc', '--dev', '/dev',
           '--size', str(tmpfs_mb << 20), '--tmpfs', '/tmp', '--chdir', '/tmp']
  return argv


@functools.lru_cache(maxsize=None)
def probe_bwrap(bwrap: str | None) -> str:
  """Checks that bubblewrap can start a Python here.

  Args:
    bwrap: path or name of the bwrap binary; None or '' means none.

  Returns:
    '' when it works, else why not.
  """
  path = shutil.which(bwrap) if bwrap else None
  if not path:
    return f'no bwrap binary ({bwrap!r} not found)'
  argv = bwrap_argv(path, as_root=os.geteuid() == 0, tmpfs_mb=16)
  try:
    res = subprocess.run(argv + [sys.executable, '-s', '-c', 'import json'], env=_ENV,
                         capture_output=True, timeout=60)
  except (OSError, subprocess.TimeoutExpired) as e:
    return f'{path} failed to run: {e}'
  if res.returncode != 0:
    return f'{path} exited with {res.returncode}: {res.stderr.decode(errors="replace").strip()[:300]}'
  return ''


def _remove_dirs(dirs: list) -> None:
  for d in dirs:
    shutil.rmtree(d, ignore_errors=True)
  dirs.clear()


class _Spawner:
  """Starts one sandbox server (kept apart from Sandbox so the pool holds no cycle)."""

  def __init__(self, bwrap: str | None, tmpfs_mb: int):
    self.bwrap = bwrap
    self.tmpfs_mb = tmpfs_mb
    self.as_root = os.geteuid() == 0
    self.uids: list[int] = []
    self.tmpdirs: list[str] = []

  def __call__(self, index: int) -> subprocess.Popen:
    del index
    # -P: the server's own directory must not shadow the standard library
    # (verifiers/ holds a math.py).
    server_args = []
    if self.as_root:
      uid = _sandbox_uid(next(_slots))
      self.uids.append(uid)
      server_args += ['--drop-uid', str(uid)]
    if self.bwrap:
      argv = bwrap_argv(self.bwrap, as_root=self.as_root, tmpfs_mb=self.tmpfs_mb)
      argv += [sys.executable, '-s', '-B', '-P', '/sandbox_server.py', '--root', '/tmp']
      if not self.as_root:
        argv += ['--kill-all']
    else:
      root = tempfile.mkdtemp(prefix='cascade-sandbox-')
      self.tmpdirs.append(root)
      argv = [sys.executable, '-s', '-B', '-P', SERVER_PATH, '--root', root]
    return subprocess.Popen(argv + server_args, env=_ENV, cwd='/', **pool_lib.popen_kwargs())


class Sandbox:
  """A pool of sandboxed fork servers; runs requests of `sandbox_server`."""

  def __init__(self, workers: int, *, strict_isolation: bool = False, bwrap: str | None = 'bwrap',
               memory_mb: int = 1024, nproc: int = 16, fsize_mb: int = 64, tmpfs_mb: int = 256):
    """Picks the isolation and prepares (but does not start) the servers.

    Args:
      workers: number of servers, i.e. runs in parallel.
      strict_isolation: refuse to run without bubblewrap.
      bwrap: the bubblewrap binary; None or '' forces the fallback.
      memory_mb: address-space limit of each run.
      nproc: process limit of each run (its own processes and threads).
      fsize_mb: largest file (and stdout) a run may write.
      tmpfs_mb: size of the private /tmp of each server (bubblewrap only).

    Raises:
      RuntimeError: strict_isolation and bubblewrap is unusable.
    """
    why = probe_bwrap(bwrap)
    if why and strict_isolation:
      raise RuntimeError(f'strict_isolation=True but bubblewrap is unusable: {why}')
    if why:
      warnings.warn(_FALLBACK_WARNING.format(why=why), RuntimeWarning, stacklevel=2)
      logging.warning(_FALLBACK_WARNING.format(why=why))
    self.isolation = 'rlimit' if why else 'bwrap'
    self._limits = dict(memory_mb=int(memory_mb), nproc=int(nproc), fsize_mb=int(fsize_mb))
    self._spawner = _Spawner(None if why else shutil.which(bwrap), int(tmpfs_mb))
    self._finalizer = weakref.finalize(self, _remove_dirs, self._spawner.tmpdirs)
    self._pool = pool_lib.ProcessPool(self._spawner, workers, name=f'sandbox[{self.isolation}]')

  @property
  def uids(self) -> list[int]:
    """Sandbox uids handed out so far (root hosts; empty otherwise)."""
    return list(self._spawner.uids)

  @property
  def server_pids(self) -> list[int]:
    """Host pids of the running servers (bwrap or Python processes)."""
    return self._pool.pids

  def run(self, requests: Sequence[dict], budgets: Sequence[float]) -> list[dict]:
    """Runs requests (see `sandbox_server`) in parallel.

    Args:
      requests: dicts with mode, program and optionally cases, files and
        float_tolerance; limits are filled in here.
      budgets: wall-clock seconds per request (all its runs together).

    Returns:
      One server response per request; sandbox failures come back as
      {'passed': False, 'status': 'sandbox_error', 'detail': why}.
    """
    payloads = []
    for req, budget in zip(requests, budgets):
      payloads.append(dict(req, wall_s=float(budget), cpu_s=float(budget) + 1.0, **self._limits))
    outcomes = self._pool.run(payloads, [b + _GRACE_S for b in budgets])
    out = []
    for o in outcomes:
      if o.ok and isinstance(o.value, dict) and isinstance(o.value.get('passed'), bool):
        out.append(o.value)
      else:
        out.append({'passed': False, 'status': 'sandbox_error', 'case': -1, 'cases_run': 0,
                    'detail': o.error or f'malformed server answer {str(o.value)[:200]}'})
    return out

  def close(self) -> None:
    """Stops the servers and removes fallback temp dirs."""
    self._pool.close()
    _remove_dirs(self._spawner.tmpdirs)

  def __enter__(self) -> Sandbox:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
