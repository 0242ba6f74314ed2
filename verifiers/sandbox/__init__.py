"""Verifiers' own processes: the worker pool, and bubblewrap fork servers that fail closed.

The package holds every process a verifier runs apart from the trainer:
`pool` (long-lived workers with wall-clock limits, used by every verifier,
sandboxed or not), `worker` (the main of a plain verifier worker), `framing`
(the length-prefixed JSON they all speak), and the sandbox built on the pool:
this module (the host side), `server` with `bridge` and `seccomp` (the
script bubblewrap runs and its standard-library helpers, bound together as
the harness) and `cgroups`.

Each sandbox worker is one `server` process that lives for the whole stage;
candidates come from its zygote, a process forked before the first request
that never holds one (each candidate forked ahead, while the previous run
runs), so a run costs forks, not an interpreter start, and no candidate
process ever held an answer key or another sample's program. With bubblewrap (isolation='bwrap', the default)
the server sits in new PID, network, IPC, UTS and mount namespaces and sees
a read-only root assembled from the system directories, the Python
installation and the four harness files only: no home, no repository, no
host /tmp, and a private /etc holding only the dynamic loader's cache and the
time zone. It writes only to a private size-capped tmpfs at /tmp (mounted
first, so an interpreter that lives under the host's /tmp is bound on top of
it and stays visible; bubblewrap's own '/' and /dev are remounted read-only)
and dies with its parent. Every child gets rlimits, a wall-clock limit and a
seccomp filter that refuses namespaces, mounts, tracing, System V / POSIX IPC
objects and what else would outlive the sample (extended attributes and
ACLs, file times, descriptors in flight, network sockets, other processes'
limits; see `seccomp`). Each run gets a new work dir from the server, and the
server's health check replaces it when a run left anything (see `server`).

Limits that hold per sample in total (a worker runs one sample at a time):
  * with a cgroup (`cgroups`, where the host allows one; see
    `Sandbox.limits`): memory of all processes and tmpfs files together
    <= memory_mb + 128 MiB (the server's share), processes <= nproc + 16;
  * always: per process RLIMIT_AS memory_mb, RLIMIT_CPU, RLIMIT_FSIZE; tmpfs
    <= tmpfs_mb; processes <= nproc (RLIMIT_NPROC of a uid of its own as
    root, or counted inside bubblewrap's user namespace otherwise). Without
    a cgroup the memory total is thus bounded by nproc x memory_mb plus the
    tmpfs, not by memory_mb.

When the host runs as root, the children run as an unprivileged uid unique
to their server: the kernel never limits the process count of root, and that
uid lets the server kill every leftover process with one `kill(-1)`. (This
is also why bubblewrap's own user namespace is left out as root: inside one,
the sandbox uid maps back to host root.) As a normal user, bubblewrap runs
unprivileged with `--unshare-all`.

Without a working bubblewrap a Sandbox refuses to start. isolation='none' is
an explicit opt-out for trusted code only: the servers run as plain
subprocesses in a temp dir, the children as the host user with the rlimits,
seccomp filter and cgroup but no filesystem, network or PID isolation, and
nothing keeps a root candidate from reading or forging its own verdict.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import weakref
from typing import Sequence

from verifiers.sandbox import bridge
from verifiers.sandbox import cgroups
from verifiers.sandbox import framing
from verifiers.sandbox import pool as pool_lib
from verifiers.sandbox import seccomp
from verifiers.sandbox import server

ISOLATIONS = ('bwrap', 'none')
# Files of the harness, bound read-only at /sandbox inside bubblewrap.
_HARNESS = {os.path.basename(m.__file__): os.path.abspath(m.__file__)
            for m in (server, framing, bridge, seccomp)}
_HARNESS_DIR = '/sandbox'
# Host directories the sandbox sees read-only (when they exist).
_SYSTEM_DIRS = ('/usr', '/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32')
# The only /etc entries the sandbox sees: the loader's cache and the time zone.
_ETC_FILES = ('/etc/ld.so.cache', '/etc/localtime')
_ENV = {'PATH': '/usr/local/bin:/usr/bin:/bin', 'LANG': 'C.UTF-8', 'HOME': '/tmp',
        'PYTHONHASHSEED': '0', 'PYTHONDONTWRITEBYTECODE': '1'}
# Seconds the host waits beyond a request's budget before it kills the
# server itself (the server enforces the budget; this is the backstop).
_GRACE_S = 5.0
# The server's share of its cgroup, on top of the sample's memory_mb.
_SERVER_MB = 128
_SERVER_PIDS = 16
_UID_BASE = 2_000_000
_slots = itertools.count()


def refusal(why: str) -> str:
  """The one-line error of a sandbox that cannot isolate."""
  return (f'verifiers.sandbox: bubblewrap is unusable ({why}); install it '
          f"(apt-get install bubblewrap, or `make sysdeps` as root) or set the verifier option "
          f"isolation='none' to run untrusted code without isolation")


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
  # The tmpfs first: later binds below /tmp (an interpreter there) stay visible.
  argv += ['--size', str(tmpfs_mb << 20), '--tmpfs', '/tmp']
  for d in _SYSTEM_DIRS:
    if os.path.islink(d):
      argv += ['--symlink', os.readlink(d), d]
    elif os.path.isdir(d):
      argv += ['--ro-bind', d, d]
  argv += ['--perms', '0755', '--dir', '/etc']
  for f in _ETC_FILES:
    if os.path.exists(f):
      argv += ['--ro-bind', f, f]
  made = {'/tmp', '/etc'}
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
  argv += ['--perms', '0755', '--dir', _HARNESS_DIR]
  for name, path in sorted(_HARNESS.items()):
    argv += ['--ro-bind', path, f'{_HARNESS_DIR}/{name}']
  argv += ['--proc', '/proc', '--dev', '/dev', '--chdir', '/tmp']
  # Once built, the root and /dev (tmpfs mounts of their own, where a candidate sharing the
  # server's uid could write, and any candidate's reads could move directory atimes) are
  # read-only: the server's tmpfs at /tmp is all that stays writable. The device nodes and
  # devpts are mounts of their own and stay usable.
  argv += ['--remount-ro', '/dev', '--remount-ro', '/']
  return argv


def _server_cmd(root: str) -> list[str]:
  # -P: the server's own directory must not shadow the standard library.
  return [sys.executable, '-s', '-B', '-P', f'{_HARNESS_DIR}/server.py', '--root', root]


@functools.lru_cache(maxsize=None)
def probe_bwrap(bwrap: str | None) -> str:
  """Checks that bubblewrap starts the sandbox server here and its seccomp filter holds.

  Args:
    bwrap: path or name of the bwrap binary; None or '' means none.

  Returns:
    '' when it works, else why not (one line).
  """
  path = shutil.which(bwrap) if bwrap else None
  if not path:
    return f'no bwrap binary ({bwrap!r} not found)'
  why = seccomp.supported()
  if why:
    return why
  as_root = os.geteuid() == 0
  argv = bwrap_argv(path, as_root=as_root, tmpfs_mb=16) + _server_cmd('/tmp') + ['--self-test']
  if as_root:
    argv += ['--drop-uid', str(_sandbox_uid(511))]
  try:
    res = subprocess.run(argv, env=_ENV, capture_output=True, timeout=60, cwd='/')
  except (OSError, subprocess.TimeoutExpired) as e:
    return f'{path} failed to run: {e}'
  if res.returncode != 0:
    err = ' '.join(res.stderr.decode(errors='replace').split())[-300:]
    return f'{path} exited with {res.returncode}: {err}'
  return ''


class SandboxUnavailable(RuntimeError):
  """The sandbox cannot isolate (bubblewrap missing or unusable): a setup error a run reports
  in one line (`cascade.main`), not a failure of any sample."""


class _Spawner:
  """Starts one sandbox server (kept apart from Sandbox so the pool holds no cycle)."""

  def __init__(self, bwrap: str | None, tmpfs_mb: int, hierarchy, memory_mb: int, nproc: int):
    self.bwrap = bwrap
    self.tmpfs_mb = tmpfs_mb
    self.as_root = os.geteuid() == 0
    self.hierarchy = hierarchy
    self.cgroup_memory = (memory_mb + _SERVER_MB) << 20
    self.cgroup_pids = nproc + _SERVER_PIDS
    self.uids: list[int] = []
    self.tmpdirs: list[str] = []
    self.cgroups: dict[int, cgroups.Cgroup] = {}

  def __call__(self, index: int) -> subprocess.Popen:
    server_args = []
    if self.bwrap:
      argv = bwrap_argv(self.bwrap, as_root=self.as_root, tmpfs_mb=self.tmpfs_mb)
      argv += _server_cmd('/tmp')
      if self.as_root:
        uid = _sandbox_uid(next(_slots))
        self.uids.append(uid)
        server_args += ['--drop-uid', str(uid)]
      else:
        argv += ['--kill-all']
    else:
      root = tempfile.mkdtemp(prefix='cascade-sandbox-')
      self.tmpdirs.append(root)
      argv = [sys.executable, '-s', '-B', '-P', _HARNESS['server.py'], '--root', root]
    argv += server_args
    if self.hierarchy is not None:
      if index not in self.cgroups:
        self.cgroups[index] = cgroups.Cgroup(self.hierarchy, f'cascade-sandbox-{os.getpid()}-'
                                             f'{next(_slots)}', self.cgroup_memory,
                                             self.cgroup_pids)
      # Enter the cgroup (and shield the server from the OOM killer, which
      # then takes candidates first) before bubblewrap starts.
      enter = ' && '.join(f'echo $$ > {shlex.quote(f)}' for f in self.cgroups[index].procs_files)
      oom = 'echo -1000 > /proc/self/oom_score_adj 2>/dev/null; ' if self.as_root else ''
      argv = ['/bin/sh', '-c', f'{enter} && {oom}exec "$@"', 'sh'] + argv
    return subprocess.Popen(argv, env=_ENV, cwd='/', **pool_lib.popen_kwargs())


def _release(tmpdirs: list, groups: dict) -> None:
  for d in tmpdirs:
    shutil.rmtree(d, ignore_errors=True)
  tmpdirs.clear()
  for g in groups.values():
    g.remove()
  groups.clear()


class Sandbox:
  """A pool of sandboxed fork servers; runs requests of `server`."""

  def __init__(self, workers: int, *, isolation: str = 'bwrap', bwrap: str = 'bwrap',
               memory_mb: int = 1024, nproc: int = 16, fsize_mb: int = 64, tmpfs_mb: int = 256):
    """Checks the isolation and prepares (but does not start) the servers.

    Args:
      workers: number of servers, i.e. runs in parallel.
      isolation: 'bwrap' (refuse to start without a working bubblewrap) or
        'none' (no isolation: trusted code only, see the module docstring).
      bwrap: the bubblewrap binary.
      memory_mb: memory of a sample: per process (RLIMIT_AS) and, with a
        cgroup, of all its processes together.
      nproc: processes and threads of a sample.
      fsize_mb: largest file (and stdout) a run may write.
      tmpfs_mb: size of the private /tmp of each server (bubblewrap only).

    Raises:
      SandboxUnavailable: isolation='bwrap' and bubblewrap is unusable (one line).
      ValueError: an unknown isolation.
    """
    if isolation not in ISOLATIONS:
      raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == 'bwrap':
      why = probe_bwrap(bwrap)
      if why:
        raise SandboxUnavailable(refusal(why))
    else:
      logging.warning("verifiers.sandbox: isolation='none': untrusted code runs as this user "
                      'without filesystem, network or PID isolation')
    self._isolation = isolation
    hierarchy, self.cgroup_why = cgroups.detect()
    self._limits = dict(memory_mb=int(memory_mb), nproc=int(nproc), fsize_mb=int(fsize_mb))
    self._spawner = _Spawner(shutil.which(bwrap) if isolation == 'bwrap' else None,
                             int(tmpfs_mb), hierarchy, int(memory_mb), int(nproc))
    self._finalizer = weakref.finalize(self, _release, self._spawner.tmpdirs,
                                       self._spawner.cgroups)
    self._pool = pool_lib.ProcessPool(self._spawner, workers, name=f'sandbox[{isolation}]',
                                      restart_if=_needs_restart)

  @property
  def isolation(self) -> str:
    """'bwrap' or 'none': the isolation candidates actually run under."""
    return self._isolation

  @property
  def limits(self) -> str:
    """What bounds a sample's total memory and processes: 'cgroup2', 'cgroup1' or 'rlimit'."""
    return self._spawner.hierarchy.kind if self._spawner.hierarchy else 'rlimit'

  @property
  def uids(self) -> list[int]:
    """Sandbox uids handed out so far (root hosts with bubblewrap; empty otherwise)."""
    return list(self._spawner.uids)

  @property
  def server_pids(self) -> list[int]:
    """Host pids of the running servers (bwrap or Python processes)."""
    return self._pool.pids

  @property
  def restarts(self) -> int:
    """Servers replaced so far because a run left them unclean, timed out or crashed them."""
    return self._pool.restarts

  def run(self, requests: Sequence[dict], budgets: Sequence[float]) -> list[dict]:
    """Runs requests (see `server`) in parallel.

    Args:
      requests: dicts with mode ('check', 'stdio' or 'run'), program and
        optionally test, importable, cases, files, float_tolerance and
        output_bytes; limits are filled in here.
      budgets: wall-clock seconds per request (all its runs together).

    Returns:
      One server response per request; failures of the sandbox itself come
      back as {'passed': False, 'status': 'sandbox_error', 'detail': why}.
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
    """Stops the servers, removes their cgroups and temp dirs."""
    self._pool.close()
    _release(self._spawner.tmpdirs, self._spawner.cgroups)

  def __enter__(self) -> Sandbox:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _needs_restart(answer) -> bool:
  return not isinstance(answer, dict) or answer.get('restart') is not False


def result_info(answer: dict, isolation: str) -> dict:
  """The Result.info fields every sandboxed verifier reports for one server answer.

  'sandbox_error' is True when the sandbox itself failed (not the
  candidate), so the stage loop can count those per step.
  """
  return {'status': answer['status'], 'isolation': isolation,
          'sandbox_error': answer['status'] == 'sandbox_error'}
