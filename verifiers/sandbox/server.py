"""Fork server for untrusted Python inside the sandbox; one per worker, one request at a time.

Runs as a script inside bubblewrap (or as a plain process with
isolation='none') next to `framing`, `bridge` and `seccomp`, so it imports
only the standard library. It pre-imports modules candidates commonly use
and then, before it reads any request, forks a *zygote*: a process that
never holds request data. Candidates come from the zygote, never from the
server, whose heap holds the current request's hidden test or expected
outputs and remnants of earlier requests. On the server's 'next' the zygote
forks a *spare*, its own child, and hands the server the spare's pid and
its end of the spare's channel (a unix socket pair, SCM_RIGHTS); on
'wait <pid>', sent once a run's processes are killed, it reaps that spare
and relays its wait status (a word and a pid are all the zygote is ever
told; the spare's orphans go to the server, a subreaper). A run sends
the spare only its limits, its role and its descriptors; the spare
sandboxes itself and then reads its own program and visible files from a
pipe the server writes. So a candidate that walks its frames, scans `gc` or
reads its own memory finds its own program only: no answer key, no other
sample. The next spare is forked while a run runs, so a run waits on no
fork of its own. (A fresh interpreter per run would hold as well but costs
15-30 ms of start-up and imports per run, against ~1 ms of forks.)

Each candidate takes the sandbox identity (the dedicated uid when the
server is root, rlimits, the `seccomp` filter, oom_score_adj 1000) before it
reads its program. Every run gets a new work dir, made here (the trusted
side) just before it: a directory a candidate owned would keep its extended
attributes, POSIX ACLs, times and mode for the next. After every run all
processes of that identity are killed (never the zygote or the spare), and
the work dir is emptied with fd-relative removal and removed; the io files
go after every request. Then the health check: a request that leaves
anything behind (files; the mode, owner, extended attributes or entries of
any path outside the work dir a candidate could change; System V IPC
objects; abstract unix socket names; data on another writable mount; a
process; a dead zygote) or moved a counter every later sample reads (the
PID namespace's next pid, the tmpfs's next inode number: a candidate that
made a process, a thread or a file) answers with 'restart': true so the
host replaces this server; the times of those paths, which the server's own
work moves, are reset. What a candidate could leave that outlives its processes
otherwise (extended attributes and ACLs, file times, descriptors in flight
holding locks or socket names, TCP state, other processes' limits) the
`seccomp` filter refuses; locks, timers and sockets die with the processes
that hold them. Bubblewrap runs this
file as one script beside its three standard-library helpers, with nothing
else of the project in reach, so the identity switch, the limits, the
zygote, the run loop and the cleanup all live here: what a sandboxed run
does from its fork to its verdict is in this file and those three.

Request (JSON):
  mode: 'check' -- two processes: the *candidate* executes `program` as
      module 'solution' and then serves requests (see `bridge`); the
      *judge*, forked from this server (it is trusted and holds the test),
      executes the trusted `test` with imports of 'solution' and of
      `importable` routed to the candidate. Pass iff the judge's `test` runs
      to its end without an exception (SystemExit included) and no
      control-flow exception came from the candidate (see `bridge`). The verdict
      travels on a pipe only the judge holds; the judge is not ptraceable
      and every value it gets from the candidate is plain data, so neither
      comparison objects nor anything in the candidate's memory can fake a
      pass.
    'stdio' -- run `program` once per case with the case's stdin; pass iff it
      exits normally (or with status 0) and its stdout, compared here in the
      server, matches `expected` token by token (floats within
      `float_tolerance` when it is > 0).
    'run' -- run `program` once with an empty stdin, as one 'stdio' case is
      run (same fork, identity, limits and cleanup), and answer with the
      last `output_bytes` bytes of its stdout and stderr; pass iff it
      exits normally (or with status 0). For tools that show a program's
      output (`envs.tool_use`).
  program: candidate Python source.
  test: judge Python source ('check' only).
  importable: top-level module names of the work dir the judge may import
      from the candidate ('check' only).
  cases: [{'stdin': str, 'expected': str}] (stdio only).
  files: {relative path: text} written into the work dir before each run
      (paths by `normalize_path`).
  wall_s: wall-clock budget for the whole request.
  cpu_s, memory_mb, nproc, fsize_mb: rlimits of each process of a run.
  float_tolerance: see above.
  output_bytes: bytes of stdout and of stderr a 'run' answers with (the
      tails; default and cap MAX_OUTPUT_BYTES).
Response: {'passed': bool, 'status': str, 'detail': str, 'case': int,
  'cases_run': int, 'restart': bool}; 'run' adds 'stdout' and 'stderr' (the
  tails) and 'stdout_bytes' (the whole stdout's size).
"""

import argparse
import builtins
import ctypes
import errno
import fcntl
import functools
import io
import json
import os
import resource
import select
import signal
import socket
import stat
import sys
import time
import traceback
import types

try:  # On the host, as part of the package.
  from verifiers.sandbox import bridge
  from verifiers.sandbox import framing
  from verifiers.sandbox import seccomp
except ImportError:  # In the sandbox: the harness files sit next to this one.
  sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # Appended: never shadows stdlib.
  import bridge  # pylint: disable=g-import-not-at-top
  import framing  # pylint: disable=g-import-not-at-top
  import seccomp  # pylint: disable=g-import-not-at-top

_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))

# Saved before any candidate runs: the child's own harness must not be
# fooled by a candidate that patches `os._exit` or `os.write`.
_exit = os._exit
_write = os.write

# Imported once here so that forked children find them already loaded.
_PRELOAD = ('array', 'bisect', 'cmath', 'collections', 'copy', 'dataclasses', 'datetime',
            'decimal', 'fractions', 'functools', 'hashlib', 'heapq', 'itertools', 'json', 'math',
            'operator', 'queue', 'random', 're', 'statistics', 'string', 'textwrap', 'typing',
            'unittest')
# Largest stdout/stderr tail a 'run' answers with: what a tool shows, not a bulk channel.
MAX_OUTPUT_BYTES = 1 << 16
# The files a request keeps in the io dir: removed after it (`Server._is_clean`).
_IO_FILES = ('stdin', 'stdout', 'stderr', 'judge_stderr')
# The limits of a run: what a spare is told before it has its program.
_LIMITS = ('cpu_s', 'memory_mb', 'nproc', 'fsize_mb')
# Seconds the server waits for the zygote's answer before it declares the zygote broken.
_ZYGOTE_TIMEOUT_S = 10.0
# Spares held or being forked at any time: two hide the zygote's fork chain behind a run.
_SPARES = 2
# Bounds of a path under the work dir (`normalize_path`): a name's UTF-8 bytes (the kernel's
# NAME_MAX) and the whole path's (well under PATH_MAX with the work dir in front).
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 1024
_SIGNAL_STATUS = {signal.SIGXCPU: ('cpu_limit', 'CPU time limit'),
                  signal.SIGXFSZ: ('output_limit', 'file size limit (output too large)'),
                  signal.SIGSEGV: ('crashed', 'segmentation fault (stack overflow?)')}


def outputs_match(got: str, expected: str, float_tolerance: float = 0.0) -> bool:
  """Judge-style comparison: equal whitespace-separated tokens.

  Args:
    got: the program's stdout.
    expected: the reference output.
    float_tolerance: when > 0, tokens that both parse as floats may differ by
      this much, absolutely or relatively.

  Returns:
    Whether the outputs match.
  """
  a, b = got.split(), expected.split()
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x == y:
      continue
    if float_tolerance <= 0:
      return False
    try:
      fx, fy = float(x), float(y)
    except ValueError:
      return False
    if not abs(fx - fy) <= float_tolerance * max(1.0, abs(fy)):
      return False
  return True


@functools.lru_cache(maxsize=None)
def _libc():
  """The C library, loaded once (before the server forks, so no child loads it again)."""
  return ctypes.CDLL(None, use_errno=True)


class Server:
  """Runs requests; one instance per sandboxed worker process."""

  def __init__(self, root: str, drop_uid: int | None, kill_all: bool):
    """Sets up the server's directories.

    Args:
      root: a private directory the server owns (a tmpfs in bubblewrap).
      drop_uid: run children as this uid/gid (the server is root); None keeps
        the server's own uid.
      kill_all: the server is alone in its PID namespace, so every process but
        itself, its ancestors and the zygote is a candidate's and is killed
        after each run; without it only the runs' sessions are killed.

    With either drop_uid or kill_all the server runs in bubblewrap's private
    mount, IPC, network and PID namespaces on a tmpfs of its own, so the
    health check also covers System V IPC objects, abstract socket names, the
    other writable mounts, devpts and the pid and inode counters; in
    isolation 'none' those are the host's, shared with other processes.
    """
    self.drop_uid = drop_uid
    self.kill_all = kill_all
    self.root = root
    self.io_dir = os.path.join(root, '.io')
    # Made afresh for every run by `_make_case_dir` and removed after it by `_cleanup`: nothing
    # of a run's work dir (entries, mode, times, extended attributes, ACLs) reaches the next.
    self.case_dir = os.path.join(root, 'case')
    # Candidates inherit it: the modes of the files they write do not depend on the host's.
    os.umask(0o022)
    os.makedirs(self.io_dir, mode=0o700, exist_ok=True)
    if drop_uid is not None:
      # Children reach the case dir through root but may not list root.
      os.chmod(root, 0o711)
    self.private = drop_uid is not None or kill_all
    libc = _libc()
    libc.prctl(4, 0, 0, 0, 0)    # PR_SET_DUMPABLE 0: children cannot ptrace us.
    self._zygote_sock, self.zygote_pid = self._start_zygote()
    self._zygote_fd = os.pidfd_open(self.zygote_pid)
    self._zygote_ok = True
    # Spares: candidate processes forked ahead by the zygote, waiting for their
    # runs, as (server's end of the channel, pid); _SPARES are held or asked
    # for at any time, so that a run seldom waits on a fork.
    self._spares = []
    self._asked = 0
    # Spares that became candidates and are not yet reaped (by the zygote, `_wait_spare`).
    self._unreaped = set()
    # The kernel's counters a candidate could move for the next one (`_counters_moved`), where
    # the server has a pid namespace and a tmpfs of its own: the pids made since the request
    # began (by the server and the zygote) and the next inode number of the root's tmpfs.
    self._counted = self.private
    self._made_pids = []
    self._pid_mark = 0
    self._alive = set()
    self._next_ino = None
    self._ino_moved = False
    self._top_up()
    libc.prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER: orphans come to us.
    # Processes in our session are ours (zygote, spares): a candidate calls setsid()
    # before anything else, and no process can join another's session.
    self._sid = os.getsid(0)
    self._ancestors = _ancestors()
    self._mounts = _writable_mounts(root) if self.private else []
    self.baseline_free = self._free_blocks()
    self.baseline_residue = self._residue()
    # What every path a candidate could change outside its work dir looked like at start (see
    # `_pristine_paths`): its metadata, its (atime, mtime) and, for a directory, its entries.
    self._pristine = {path: _metadata(path) for path in self._pristine_paths()}
    if self._counted:
      self._probe_ino()

  def _free_blocks(self):
    st = os.statvfs(self.root)
    return st.f_bfree, st.f_ffree

  def _pristine_paths(self):
    """Paths outside the work dir whose metadata a candidate could change, as the health check
    compares them.

    The root's tree on its own filesystem: the root, the io dir and the
    directories bubblewrap made for read-only binds below the root's path (a
    venv under /tmp), but not those mounts, which are read-only; where
    candidates share the server's uid (kill_all, isolation 'none') they own
    all of it. In bubblewrap also the private devpts's root and its ptmx,
    which every candidate may open. Bubblewrap's own tmpfs mounts ('/' and
    /dev) are read-only (`verifiers.sandbox.bwrap_argv`), and the host's
    device nodes bound into /dev change only by the calls `seccomp` refuses.
    """
    dev = os.lstat(self.root).st_dev
    out, todo = [], [self.root]
    while todo:
      d = todo.pop()
      out.append(d)
      if d == self.io_dir:
        continue
      for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        st = os.lstat(path)
        if st.st_dev != dev:  # A mount point: a read-only bind.
          continue
        if stat.S_ISDIR(st.st_mode):
          todo.append(path)
        else:
          out.append(path)
    if self.private:
      out += [p for p in ('/dev/pts', '/dev/pts/ptmx') if os.path.lexists(p)]
    return out

  def _residue(self):
    """What a run could leave outside the work dir (private namespaces only; see __init__).

    System V IPC objects (the seccomp filter refuses them; this is the check
    that it did), the names of abstract-namespace unix sockets (they die with
    their last descriptor, which cannot outlive the candidates' processes:
    the filter refuses sendmsg, so none is left in flight), and the free
    blocks and inodes of every other writable mount (none where bubblewrap
    remounts '/' and /dev read-only).
    """
    if not self.private:
      return ()
    out = [('unix', _abstract_sockets())]
    for kind in ('shm', 'sem', 'msg'):
      try:
        with open(f'/proc/sysvipc/{kind}', encoding='ascii') as f:
          out.append((kind, tuple(line.split()[1] for line in f.read().splitlines()[1:])))
      except OSError:  # No System V IPC in this kernel.
        pass
    for mount in self._mounts:
      st = os.statvfs(mount)
      out.append((mount, st.f_bfree, st.f_ffree))
    return tuple(out)

  # -- the zygote and its spares ----------------------------------------------

  def _start_zygote(self):
    """Forks the zygote (before any request); the server's socket to it and its pid."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
      try:
        ours.close()
        self._zygote(theirs)
      finally:
        _exit(1)
    theirs.close()
    ours.settimeout(_ZYGOTE_TIMEOUT_S)
    return ours, pid

  def _zygote(self, sock):
    """The zygote's loop: a spare per 'next', a relayed status per 'wait <pid>'; never returns.

    The answer to 'next' is the spare's pid with the server's end of its
    channel (SCM_RIGHTS), or b'error' when the fork failed; to 'wait <pid>'
    it is 'status <wait status>' ('status -' for no child of that pid).
    """
    _libc().prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the server.
    keep = sock.fileno()
    os.closerange(3, keep)  # The request protocol above all: the zygote never reads it.
    os.closerange(keep + 1, os.sysconf('SC_OPEN_MAX'))
    reaped = {}  # Spares that exited before the server asked: pid -> wait status.
    while True:
      try:
        msg = sock.recv(32)
        if not msg:  # The server is gone.
          _exit(0)
        if msg != b'next':
          sock.send(_spare_status(msg, reaped))
          continue
        _reap_spares(reaped)
        try:
          channel, pid = self._fork_spare(sock)
        except OSError:
          sock.send(b'error')
          continue
        socket.send_fds(sock, [str(pid).encode()], [channel.fileno()])
        channel.close()
      except OSError:
        _exit(0)

  def _fork_spare(self, sock):
    """In the zygote: forks a spare, the zygote's child; (server's channel end, its pid).

    One fork per spare: the zygote reaps it when the server says 'wait' and
    relays its status, and its orphans go to the server (the subreaper).
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
      pid = os.fork()
    except OSError:
      ours.close()
      theirs.close()
      raise
    if pid == 0:
      ours.close()
      sock.close()
      self._run_spare(theirs)
    theirs.close()
    return ours, pid

  def _run_spare(self, channel):
    """In a spare: waits for its run (limits, role, descriptors), becomes the candidate; never returns.

    The last descriptor is a pipe that brings the payload after the spare is
    sandboxed; the end of the channel (the server let the spare go, or is
    gone) ends the spare.
    """
    try:
      msg, fds, _, _ = socket.recv_fds(channel, 1 << 12, 16)
      if not msg:
        _exit(0)
      spawn = json.loads(msg)
      self._become_sandboxed(spawn, fds, judge=False)
      payload_fd = len(fds) - 1
      payload = framing.read_frame(payload_fd)
      os.close(payload_fd)
      _write_files(self.case_dir, payload.get('files') or {})
      if spawn['role'] == 'script':
        _run_script(payload['program'], self.case_dir)
      else:
        _run_candidate(payload['program'], payload['importable'], self.case_dir)
    except BaseException:  # pylint: disable=broad-except
      _exit_with_traceback()
    _exit(120)

  def _top_up(self):
    """Asks the zygote for spares until _SPARES are held or asked for."""
    while len(self._spares) + self._asked < _SPARES:
      self._zygote_sock.send(b'next')
      self._asked += 1

  def _receive_spare(self):
    """Waits for one spare asked for; an answer without one (a failed fork) adds none."""
    self._asked -= 1
    msg, fds, _, _ = socket.recv_fds(self._zygote_sock, 64, 1)
    if len(fds) == 1 and msg.isdigit():
      self._spares.append((socket.socket(fileno=fds[0]), int(msg)))
      self._made_pids.append(int(msg))
    else:
      for fd in fds:
        os.close(fd)

  def _wait_spare(self, pid):
    """The wait status of spare `pid`, which the zygote reaps once it has exited (None: the zygote
    had no such child or is broken)."""
    self._unreaped.discard(pid)
    try:
      self._sync_zygote()  # Its answers come in order: the spares asked for first.
      self._zygote_sock.send(b'wait %d' % pid)
      msg = self._zygote_sock.recv(64).split()
      if len(msg) != 2 or msg[0] != b'status':
        raise ValueError(f'zygote answered {msg!r}')
    except (OSError, ValueError):
      self._zygote_ok = False
      return None
    return None if msg[1] == b'-' else int(msg[1])

  def _sync_zygote(self):
    """Receives every spare asked for, so that the zygote's forks precede what the server does
    next (see `_counters_moved`)."""
    try:
      while self._asked:
        self._receive_spare()
    except (OSError, ValueError):
      self._zygote_ok = False
      raise

  def _spawn(self, req, fds, role, payload):
    """Makes the spare a candidate with `fds` as its 0, 1, 2, ...; sends it `payload`.

    Args:
      req: the request (only its limits go to the spare).
      fds: the candidate's descriptors, in order.
      role: 'script' (`_run_script`) or 'candidate' (`_run_candidate`).
      payload: {'program', 'files', 'importable'}: what the candidate may see.

    Returns:
      The candidate's pid (a child of the zygote: `_wait_spare` collects it).
    """
    spawn = json.dumps(dict({k: req[k] for k in _LIMITS}, role=role)).encode()
    self._make_case_dir()
    if self._next_ino is not None:  # The files the harness writes in the candidate.
      self._next_ino += _inodes_written(payload.get('files') or {})
    payload_r, payload_w = os.pipe()
    try:
      pid = None
      for _ in range(_SPARES + 1):  # A spare may have died meanwhile (a candidate killed it).
        try:
          self._top_up()
          if not self._spares:
            self._receive_spare()
        except (OSError, ValueError):
          self._zygote_ok = False
          raise
        if not self._spares:
          continue
        channel, spare_pid = self._spares.pop(0)
        self._unreaped.add(spare_pid)
        try:
          socket.send_fds(channel, [spawn], [*fds, payload_r])
          pid = spare_pid
          break
        except OSError:
          pass
        finally:
          channel.close()
      if pid is None:
        self._zygote_ok = False
        raise RuntimeError('the zygote gave no live spare')
      os.close(payload_r)
      payload_r = -1
      self._top_up()  # The next spares are forked while this run runs.
      try:
        framing.write_frame(payload_w, payload)
      except OSError:  # The candidate died before reading it; its status says why.
        pass
      return pid
    finally:
      for fd in (payload_r, payload_w):
        if fd >= 0:
          os.close(fd)

  def _make_case_dir(self):
    """Makes the work dir of the next run: new, empty, the candidates' (`_cleanup` removes it).

    Made here, by the trusted side, for every run: a directory the last run
    owned could carry its extended attributes, a default ACL (which would set
    the mode of every file the next run's harness writes), its times or mode.
    """
    os.mkdir(self.case_dir, 0o755)
    self._created(os.lstat(self.case_dir).st_ino)
    if self.drop_uid is not None:
      os.chown(self.case_dir, self.drop_uid, self.drop_uid)

  # -- counters ----------------------------------------------------------------

  def _counters_moved(self):
    """Whether anything but the server, its zygote and the harness made a process, a thread or a
    file on the root's tmpfs during the request (then the server is replaced).

    The next pid of a PID namespace and the next inode number of a tmpfs
    are counters every sample sees (its pid, its threads', the inode numbers
    of its work dir and files) and none can reset: a candidate that made k
    processes or files would move them by k for the next. So a request's
    pids must be exactly the ones the server knows it made (the judge, the
    cleanup helpers, the zygote's forks; every other pid in the span is one
    that was alive before), and the inodes exactly the server's own and the
    ones the harness writes for `files`. The zygote's forks are waited for
    before each cleanup, so the order of every pid made is fixed too.
    """
    self._sync_zygote()
    self._probe_ino()
    span = set(range(self._pid_mark + 1, _last_pid() + 1))
    made = set(self._made_pids)
    return self._ino_moved or not made <= span or bool(span - made - self._alive)

  def _created(self, ino):
    """Notes an inode the server made on the root's tmpfs: a candidate made one if its number is
    not the one after the last inode the server knows of."""
    if not self._counted:
      return
    if self._next_ino is not None and ino != self._next_ino:
      self._ino_moved = True
    self._next_ino = ino + 1

  def _probe_ino(self):
    """Makes and removes a directory on the root's tmpfs to read the inode counter (`_created`)."""
    probe = os.path.join(self.root, '.probe')
    os.mkdir(probe)
    try:
      self._created(os.lstat(probe).st_ino)
    finally:
      os.rmdir(probe)

  def _zygote_alive(self):
    return self._zygote_ok and not select.select([self._zygote_fd], [], [], 0)[0]

  def handle(self, req: dict) -> dict:
    """Runs one request (see the module docstring); never raises."""
    try:
      if self._counted:
        self._sync_zygote()
        self._made_pids = []
        self._pid_mark = _last_pid()
        self._alive = {self.zygote_pid, *(pid for _, pid in self._spares), *self._ancestors}
      out = self._handle(req)
      if out['passed'] and not self._zygote_alive():
        # Where candidates share the zygote's uid, one can kill its parent: no pass for it.
        out.update(passed=False, status='crashed', case=0,
                   detail="the sandbox's zygote (the candidate's parent) died during the run")
    except Exception as e:  # pylint: disable=broad-except
      self._cleanup(())
      out = {'passed': False, 'status': 'sandbox_error', 'detail': f'{type(e).__name__}: {e}',
             'case': -1, 'cases_run': 0}
    out['restart'] = not self._is_clean()
    return out

  def _is_clean(self):
    """Nothing of the last request is left (see `_residue`, `_pristine_paths`); the zygote lives.

    The io dir's files of the request are removed here (the next request's
    are new), after checking that they are still the server's own plain files
    (where candidates share the server's uid they could have made one a FIFO
    that would block the next run, or a link that would show its output
    elsewhere); the run's work dir is gone already (`_cleanup`). Then every
    pristine path must hold the mode, owner, group, extended attributes (ACLs
    among them) and entries it had at start, and gets its atime and mtime
    back: the server's own changes (a work dir made and removed, io files)
    move them, so they are reset after every request, not compared.
    """
    try:
      if self._counted and self._counters_moved():
        return False
      for name in os.listdir(self.io_dir):
        path = os.path.join(self.io_dir, name)
        st = os.lstat(path)
        if name not in _IO_FILES or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
          return False
        os.unlink(path)
      for path, (meta, times, entries) in self._pristine.items():
        now, _, listing = _metadata(path)
        if now != meta or listing != entries:
          return False
        os.utime(path, ns=times, follow_symlinks=False)
      blocks, inodes = self._free_blocks()
      if blocks + 8 < self.baseline_free[0] or inodes + 16 < self.baseline_free[1]:
        return False
      if self._residue() != self.baseline_residue:
        return False
    except (OSError, ValueError):
      return False
    if not self._zygote_alive():
      return False
    if self.drop_uid is not None:
      return not self._sandbox_uid_running()
    return not (self.kill_all and self._strays())

  def _handle(self, req):
    mode = req['mode']
    if mode not in ('check', 'stdio', 'run'):
      raise ValueError(f'unknown mode {mode!r}')
    deadline = time.monotonic() + float(req['wall_s'])
    if mode == 'run':
      return self._run_once(req, float(req['wall_s']))
    if mode == 'check':
      status, detail = self._run_check(req, float(req['wall_s']))
      if status != 'passed':
        return {'passed': False, 'status': status, 'detail': detail, 'case': 0, 'cases_run': 1}
      return {'passed': True, 'status': 'passed', 'detail': '', 'case': -1, 'cases_run': 1}
    cases = req['cases']
    for k, case in enumerate(cases):
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return {'passed': False, 'status': 'timeout', 'detail': 'wall-clock budget used up',
                'case': k, 'cases_run': k}
      status, detail = self._run_stdio(req, case, remaining)
      if status != 'passed':
        return {'passed': False, 'status': status, 'detail': detail, 'case': k, 'cases_run': k + 1}
    return {'passed': True, 'status': 'passed', 'detail': '', 'case': -1, 'cases_run': len(cases)}

  # -- runs ------------------------------------------------------------------

  def _fork_judge(self, req, fds, body):
    """Forks a judge with the sandbox identity, `fds` as its 0, 1, 2, ...; runs body().

    The judge is trusted (it holds the test) and runs only trusted code, so
    it comes from this server, not the zygote; it works in '/' (read-only),
    not in the candidate's work dir.
    """
    pid = os.fork()
    if pid == 0:
      try:
        self._become_sandboxed(req, fds, judge=True)
        body()
      except BaseException:  # pylint: disable=broad-except
        _exit_with_traceback()
      _exit(120)
    self._made_pids.append(pid)
    return pid

  def _run_script_once(self, req, stdin, wall_s):
    """Runs `program` once as a script with `stdin`; (status, detail) of a failure, else None.

    Its stdout and stderr stay in the io dir (files 'stdout' and 'stderr')
    until the next run or the request's end.
    """
    stdin_fd = self._stdin_file(stdin)
    out_fd = self._io_file('stdout')
    err_fd = self._io_file('stderr')
    try:
      pid = self._spawn(req, (stdin_fd, out_fd, err_fd), 'script',
                        {'program': req['program'], 'files': req.get('files') or {}})
    finally:
      for fd in (stdin_fd, out_fd, err_fd):
        os.close(fd)
    timed_out = not _wait_exit(pid, wall_s)
    status = self._finish([pid], timed_out)[0]
    if timed_out:
      return 'timeout', f'killed after {wall_s:.2f}s wall clock'
    return _failure(status, _tail(os.path.join(self.io_dir, 'stderr')))

  def _run_once(self, req, wall_s):
    """'run' mode: the program once, answered with its status and output tails."""
    limit = max(0, min(int(req.get('output_bytes', MAX_OUTPUT_BYTES)), MAX_OUTPUT_BYTES))
    failure = self._run_script_once(req, '', wall_s)
    status, detail = failure or ('passed', '')
    stdout_path = os.path.join(self.io_dir, 'stdout')
    return {'passed': failure is None, 'status': status, 'detail': detail,
            'case': -1 if failure is None else 0, 'cases_run': 1,
            'stdout': _tail(stdout_path, limit, strip=False),
            'stderr': _tail(os.path.join(self.io_dir, 'stderr'), limit, strip=False),
            'stdout_bytes': os.path.getsize(stdout_path)}

  def _run_stdio(self, req, case, wall_s):
    failure = self._run_script_once(req, case.get('stdin', ''), wall_s)
    if failure:
      return failure
    with open(os.path.join(self.io_dir, 'stdout'), 'rb') as f:
      got = f.read().decode('utf-8', errors='replace')
    if outputs_match(got, case.get('expected', ''), float(req.get('float_tolerance', 0.0))):
      return 'passed', ''
    return 'wrong_answer', f'expected {case.get("expected", "")[:200]!r}, got {got[:200]!r}'

  def _run_check(self, req, wall_s):
    to_judge_r, to_judge_w = os.pipe()
    to_cand_r, to_cand_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    null = os.open(os.devnull, os.O_RDWR)
    cand_err = self._io_file('stderr')
    judge_err = self._io_file('judge_stderr')
    importable = [n for n in req.get('importable') or () if isinstance(n, str)]
    try:
      # The judge first: it sets itself up while the zygote forks the candidate.
      test = req['test']
      judge = self._fork_judge(req, (null, null, judge_err, to_judge_r, to_cand_w, verdict_w),
                               lambda: _run_judge(test, ['solution'] + importable))
      cand = self._spawn(req, (null, null, cand_err, to_cand_r, to_judge_w), 'candidate',
                         {'program': req['program'], 'files': req.get('files') or {},
                          'importable': importable})
    except BaseException:
      os.close(verdict_r)
      raise
    finally:
      for fd in (to_judge_r, to_judge_w, to_cand_r, to_cand_w, verdict_w, null, cand_err,
                 judge_err):
        os.close(fd)
    try:
      timed_out = not _wait_exit(judge, wall_s)
      verdict = None
      if not timed_out:
        os.set_blocking(verdict_r, False)
        try:
          verdict = framing.FrameReader().feed(os.read(verdict_r, 1 << 16))
        except (OSError, ValueError):
          verdict = None
        if not (isinstance(verdict, list) and len(verdict) == 1 and isinstance(verdict[0], dict)):
          verdict = None
        else:
          verdict = verdict[0]
        if not (verdict and verdict.get('passed') is True):
          _wait_exit(cand, 0.2)  # A dying candidate is what failed the judge: let it finish.
      judge_status, cand_status = self._finish([judge, cand], timed_out)
    finally:
      os.close(verdict_r)
    if timed_out:
      return 'timeout', f'killed after {wall_s:.2f}s wall clock'
    if verdict and verdict.get('passed') is True and judge_status == 0:
      return 'passed', ''
    cand_tail = _tail(os.path.join(self.io_dir, 'stderr'))
    failure = _failure(cand_status, cand_tail)
    if failure:
      return failure
    if verdict is None:
      return 'crashed', f'the judge process died ({_describe(judge_status)}); ' + cand_tail[-500:]
    if verdict.get('status') == 'candidate_exited':
      return 'exited_early', 'the candidate exited or closed its channel before the tests finished'
    detail = str(verdict.get('detail', ''))
    last = detail.strip().splitlines()[-1:]
    status = 'memory_limit' if last and 'MemoryError' in last[0] else 'runtime_error'
    if cand_tail:
      detail += '\ncandidate stderr:\n' + cand_tail[-1500:]
    return status, detail

  def _stdin_file(self, text):
    with open(self._io_file('stdin'), 'w', encoding='utf-8') as f:
      f.write(text)
    return os.open(os.path.join(self.io_dir, 'stdin'), os.O_RDONLY)

  def _io_file(self, name):
    """A new io file of this run (one of `_IO_FILES`), open for writing."""
    path = os.path.join(self.io_dir, name)
    try:
      os.unlink(path)
    except FileNotFoundError:
      pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    self._created(os.fstat(fd).st_ino)
    return fd

  def _become_sandboxed(self, limits, fds, judge):
    """In a forked child: session, descriptors, limits, identity, seccomp, work dir, environment.

    Args:
      limits: a mapping with the `_LIMITS` keys.
      fds: the descriptors that become 0, 1, 2, ... (all others are closed).
      judge: work in '/' (read-only) instead of the work dir.
    """
    os.setsid()
    # Above every target first: moving one must not overwrite another not yet moved.
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, len(fds)) for fd in fds]
    for target, fd in enumerate(moved):
      os.dup2(fd, target)
    os.closerange(len(fds), os.sysconf('SC_OPEN_MAX'))
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU, signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, signal.SIG_DFL)
    try:  # The kernel's OOM killer takes candidates first, never the server.
      with open('/proc/self/oom_score_adj', 'w') as f:
        f.write('1000')
    except OSError:
      pass
    cpu = max(1, int(float(limits['cpu_s'])))
    mem = int(limits['memory_mb']) << 20
    fsize = int(limits['fsize_mb']) << 20
    for lim, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
                       (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_CORE, (0, 0)),
                       (resource.RLIMIT_NOFILE, (256, 256))):
      resource.setrlimit(lim, value)
    nproc = int(limits['nproc'])
    if self.drop_uid is not None:
      resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
      os.setgroups([])
      os.setgid(self.drop_uid)
      os.setuid(self.drop_uid)
    else:
      # Same uid as other processes: leave room for those already running.
      hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
      limit = nproc + _count_own_processes()
      if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
      resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    _libc().prctl(4, 0, 0, 0, 0)  # Not dumpable: no other sandbox process may trace or read us.
    if not seccomp.supported():
      seccomp.install()
    workdir = '/' if judge else self.case_dir
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(HOME=workdir, TMPDIR=workdir, PATH='/usr/local/bin:/usr/bin:/bin',
                      LANG='C.UTF-8', PYTHONHASHSEED='0', OMP_NUM_THREADS='1',
                      OPENBLAS_NUM_THREADS='1', MKL_NUM_THREADS='1')
    if _HARNESS_DIR in sys.path:
      sys.path.remove(_HARNESS_DIR)

  # -- cleanup ---------------------------------------------------------------

  def _finish(self, pids, timed_out):
    """Kills everything a run left, reaps `pids`: their wait statuses (None: we killed it).

    One kill for all: those of `pids` still running are noted, everything is
    killed and the work dir emptied (one helper where there is a sandbox
    uid: the server may not signal that uid itself, no CAP_KILL), and then
    each of `pids` is collected: the judge by this server, the candidate
    through the zygote, its parent.
    """
    del timed_out  # Whatever still runs is killed alike.
    if self._counted and self.drop_uid is not None:
      # The zygote's forks before the cleanup helper's: a fixed order of pids. (A zygote of
      # another uid, no candidate can stop; where they share its uid, no helper forks.)
      self._sync_zygote()
    running = {pid for pid in pids if not _exited(pid)}
    self._kill_and_empty(pids)
    statuses = []
    for pid in pids:
      status = self._collect(pid)
      killed = (status is not None and os.WIFSIGNALED(status)
                and os.WTERMSIG(status) == signal.SIGKILL)
      statuses.append(None if pid in running and killed else status)
    self._remove_case_dir()
    return statuses

  def _collect(self, pid):
    """The wait status of a run's process once it has exited (None: none to collect)."""
    if pid in self._unreaped:
      return self._wait_spare(pid)
    try:
      return os.waitpid(pid, 0)[1]
    except ChildProcessError:
      return None

  def _kill_sessions(self, pids, kills):
    """Without a sandbox uid: the strays (alone in a PID namespace), then `pids` by each of
    `kills` (os.killpg for their sessions, os.kill for themselves)."""
    if self.kill_all:
      self._kill_strays()
    for pid in pids:
      for kill in kills:
        try:
          kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass

  def _cleanup(self, pids):
    """Kills every process of the sandbox identity, collects the candidates, empties the work
    dir and removes it (after a request that failed in the server itself)."""
    self._kill_and_empty(pids)
    for pid in sorted(self._unreaped):
      self._wait_spare(pid)
    self._remove_case_dir()

  def _kill_and_empty(self, pids):
    """Kills every process of the sandbox identity (or, without one, the runs' sessions and the
    strays) and empties the work dir."""
    if self.drop_uid is not None:
      # A helper with the candidates' uid: kill(-1) reaches exactly them.
      self._as_sandbox_uid(lambda: empty_dir(self.case_dir))
    else:
      self._kill_sessions(pids, (os.killpg,))
      empty_dir(self.case_dir)
      # Candidates share our uid here: one may have stopped the zygote or a spare.
      for pid in {self.zygote_pid} | {pid for _, pid in self._spares} | set(self._ours()):
        try:
          os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
          pass

  def _remove_case_dir(self):
    """Removes the emptied work dir and reaps every child left.

    A work dir that cannot be removed (a candidate sharing our uid put
    something else in its place) stays, and the health check, which finds it
    among the root's entries, replaces this server.
    """
    try:
      os.rmdir(self.case_dir)
    except OSError:
      pass
    # Everything but an escaped session (isolation 'none') was killed, so
    # waiting for all children ends promptly and leaves no zombie behind.
    self._reap(block=self.drop_uid is not None or self.kill_all)

  def _strays(self):
    """Live processes of this PID namespace outside our session and ancestry: what kill_all kills."""
    return [pid for pid, (state, _, sid) in _processes() if state not in 'ZX'
            and sid != self._sid and pid not in self._ancestors]

  def _ours(self):
    """The live processes of our session but us under kill_all (the zygote, spares, forks)."""
    if not self.kill_all:
      return []
    me = os.getpid()
    return [pid for pid, (state, _, sid) in _processes() if state not in 'ZX'
            and sid == self._sid and pid != me]

  def _kill_strays(self):
    """`kill(-1)` that spares our session: kills strays until none is left (or 2 s pass).

    A process forked between two scans is found by the next one; the
    health check restarts a server that still has strays.
    """
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
      strays = self._strays()
      if not strays:
        return
      for pid in strays:
        try:
          os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass

  def _reap(self, block=False):
    """Collects exited children (we are a subreaper, so orphans are ours too).

    Args:
      block: wait (up to 2 s) until no child outside our session (the
        zygote and spares) is left, not just for exited ones.
    """
    deadline = time.monotonic() + 2.0
    while True:
      try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        return
      if pid == 0:
        if not block or time.monotonic() > deadline or not self._children():
          return
        time.sleep(0.0005)

  def _children(self):
    """Our children outside our session: candidates and their orphans (dying ones included)."""
    me = os.getpid()
    return [pid for pid, (_, ppid, sid) in _processes() if ppid == me and sid != self._sid]

  def _as_sandbox_uid(self, then):
    helper = os.fork()
    if helper == 0:
      try:
        os.setgroups([])
        os.setgid(self.drop_uid)
        os.setuid(self.drop_uid)
        _kill_minus_one()
        then()
      finally:
        _exit(0)
    self._made_pids.append(helper)
    os.waitpid(helper, 0)

  def _sandbox_uid_running(self):
    for name in os.listdir('/proc'):
      if name.isdigit():
        try:
          if os.stat(f'/proc/{name}').st_uid == self.drop_uid:
            return True
        except OSError:  # Exited meanwhile.
          pass
    return False


def _metadata(path):
  """What a candidate could change of a path, not following a final symbolic link.

  Returns:
    ((mode with type, owner, group, extended attributes as sorted (name,
    value) pairs: user attributes and POSIX ACLs alike), (atime, mtime) in
    ns, the entries of a directory as a frozenset or None for any other file).
  """
  st = os.lstat(path)
  try:
    names = os.listxattr(path, follow_symlinks=False)
  except OSError as e:
    if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
      raise
    names = []
  xattrs = tuple((n, os.getxattr(path, n, follow_symlinks=False)) for n in sorted(names))
  entries = frozenset(os.listdir(path)) if stat.S_ISDIR(st.st_mode) else None
  return (st.st_mode, st.st_uid, st.st_gid, xattrs), (st.st_atime_ns, st.st_mtime_ns), entries


def _kill_minus_one():
  try:
    os.kill(-1, signal.SIGKILL)
  except ProcessLookupError:  # Nothing left to kill.
    pass


def _proc_stat(pid):
  """(state, parent pid, session id) of a process, or None once it is gone."""
  try:
    with open(f'/proc/{pid}/stat', 'rb') as f:
      data = f.read()
  except OSError:
    return None
  fields = data[data.rindex(b')') + 2:].split()  # The name in parentheses may hold anything.
  return fields[0].decode(), int(fields[1]), int(fields[3])


def _processes():
  """(pid, `_proc_stat`) of every process visible here."""
  out = []
  for name in os.listdir('/proc'):
    if name.isdigit():
      info = _proc_stat(int(name))
      if info is not None:
        out.append((int(name), info))
  return out


def _ancestors():
  """This process and its ancestors' pids."""
  out, pid = set(), os.getpid()
  while pid > 0 and pid not in out:
    out.add(pid)
    info = _proc_stat(pid)
    pid = info[1] if info else 0
  return out


def _last_pid():
  """The last pid this PID namespace handed out."""
  with open('/proc/sys/kernel/ns_last_pid', 'rb') as f:
    return int(f.read())


def _inodes_written(files):
  """The inodes `_write_files` makes for `files` in an empty work dir: a file per path and a
  directory per parent (a path it refuses fails the run, and the count then replaces the server)."""
  paths, dirs = set(), set()
  for rel in files:
    try:
      parts = normalize_path(rel).split('/')
    except ValueError:
      continue
    paths.add('/'.join(parts))
    dirs.update('/'.join(parts[:k]) for k in range(1, len(parts)))
  return len(paths) + len(dirs)


def _abstract_sockets():
  """The names of this network namespace's abstract-namespace unix sockets, from /proc/net/unix."""
  with open('/proc/net/unix', encoding='utf-8', errors='replace') as f:
    rows = [line.split(None, 7) for line in f.read().splitlines()[1:]]
  return tuple(sorted(r[7] for r in rows if len(r) == 8 and r[7].startswith('@')))


def _writable_mounts(root):
  """Mount points of writable tmpfs mounts other than `root`'s, from /proc/self/mountinfo."""
  out = []
  with open('/proc/self/mountinfo', encoding='utf-8', errors='replace') as f:
    for line in f:
      left, _, right = line.partition(' - ')
      fields, fstype = left.split(), right.split()[:1]
      if fstype == ['tmpfs'] and 'rw' in fields[5].split(',') and fields[4] != root:
        out.append(fields[4])
  return out


def _exit_with_traceback():
  """In a forked child whose setup or body raised: the traceback's tail on fd 2, exit 120."""
  try:
    _write(2, traceback.format_exc()[-4000:].encode('utf-8', 'replace'))
  except BaseException:  # pylint: disable=broad-except  # stderr closed or full
    pass
  _exit(120)


def _wait_exit(pid, timeout_s):
  """Waits until `pid` exits (not reaped); False on timeout."""
  try:
    pidfd = os.pidfd_open(pid)
  except ProcessLookupError:
    return True
  try:
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(max(1, int(timeout_s * 1000))))
  finally:
    os.close(pidfd)


def _exited(pid):
  """Whether `pid` has exited (reaped or not), without waiting or reaping."""
  try:
    pidfd = os.pidfd_open(pid)
  except ProcessLookupError:
    return True
  try:
    return bool(select.select([pidfd], [], [], 0)[0])
  finally:
    os.close(pidfd)


def _reap_spares(reaped):
  """In the zygote: collects every spare that has exited into `reaped` (pid -> wait status)."""
  while True:
    try:
      pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    reaped[pid] = status


def _spare_status(msg, reaped):
  """In the zygote: the answer to b'wait <pid>': the spare's wait status once it has exited."""
  parts = msg.split()
  if len(parts) != 2 or parts[0] != b'wait' or not parts[1].isdigit():
    return b'error'
  pid = int(parts[1])
  if pid in reaped:
    return b'status %d' % reaped.pop(pid)
  try:
    return b'status %d' % os.waitpid(pid, 0)[1]
  except ChildProcessError:
    return b'status -'


def _failure(status, stderr_tail):
  """(status, detail) of a child that did not exit 0, else None."""
  if status is None:
    return None
  if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    return _SIGNAL_STATUS.get(sig, ('crashed', f'killed by signal {signal.Signals(sig).name}'))
  code = os.WEXITSTATUS(status)
  if code != 0:
    kind = 'memory_limit' if 'MemoryError' in stderr_tail else 'runtime_error'
    return kind, stderr_tail or f'exit status {code}'
  return None


def _describe(status):
  if status is None:
    return 'killed'
  if os.WIFSIGNALED(status):
    return f'signal {signal.Signals(os.WTERMSIG(status)).name}'
  return f'exit status {os.WEXITSTATUS(status)}'


def _std_streams():
  stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, 'r', closefd=False)), encoding='utf-8',
                           errors='replace')
  stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, 'w', closefd=False)), encoding='utf-8',
                            errors='backslashreplace')
  stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, 'w', closefd=False)), encoding='utf-8',
                            errors='backslashreplace', line_buffering=True)
  sys.stdin, sys.stdout, sys.stderr = stdin, stdout, stderr
  sys.__stdin__, sys.__stdout__, sys.__stderr__ = stdin, stdout, stderr
  return stdout, stderr


def _write_traceback(e, skip_frames=1):
  try:
    tb = e.__traceback__
    for _ in range(skip_frames):
      tb = tb.tb_next if tb is not None else None
    lines = traceback.format_exception(type(e), e, tb)
    _write(2, ''.join(lines)[-4000:].encode('utf-8', 'replace'))
  except BaseException:  # pylint: disable=broad-except  # Unformattable, or stderr full.
    pass


def _run_script(program, workdir):
  """stdio mode: the candidate as __main__ in this (child) process; never returns."""
  stdout, stderr = _std_streams()
  sys.argv = ['solution.py']
  sys.path.insert(0, workdir)
  module = types.ModuleType('__main__')
  module.__dict__.update(__builtins__=builtins, __file__=os.path.join(workdir, 'solution.py'))
  sys.modules['__main__'] = module
  ok = False
  try:
    exec(compile(program, 'solution.py', 'exec'), module.__dict__)  # pylint: disable=exec-used
    ok = True
  except SystemExit as e:
    ok = e.code in (None, 0)
    if not ok:
      _write(2, f'SystemExit({e.code!r})\n'.encode())
  except BaseException as e:  # pylint: disable=broad-except
    _write_traceback(e)
  # Output counts here, so a failed flush fails the run.
  for stream in (stdout, sys.stdout, stderr, sys.stderr):
    try:
      stream.flush()
    except BaseException:  # pylint: disable=broad-except
      if stream is not stderr and stream is not sys.stderr:
        ok = False
  _exit(0 if ok else 1)


def _run_candidate(program, importable, workdir):
  """check mode, candidate side: runs `program`, then serves the judge (fds 3 in, 4 out)."""
  _std_streams()
  sys.argv = ['solution.py']
  sys.path.insert(0, workdir)
  module = types.ModuleType('solution')
  module.__dict__.update(__builtins__=builtins, __file__=os.path.join(workdir, 'solution.py'))
  sys.modules['solution'] = module
  server = bridge.Server({'solution': module}, importable)
  try:
    exec(compile(program, 'solution.py', 'exec'), module.__dict__)  # pylint: disable=exec-used
    ready = ['v', None]
  except BaseException as e:  # pylint: disable=broad-except
    _write_traceback(e)
    ready = bridge.encode_error(e)
  framing.write_all(4, framing.encode_frame(ready))
  server.serve(3, 4)
  _exit(0)


def _run_judge(test, remote_names):
  """check mode, judge side: trusted `test` with candidate modules as proxies; never returns."""
  link = bridge.Link(3, 4)
  verdict = {'passed': False, 'status': 'runtime_error', 'detail': ''}
  try:
    try:
      ready = framing.read_frame(3)
    except (OSError, EOFError, ValueError):
      ready = None
    if ready is None:
      verdict.update(status='candidate_exited', detail='the candidate exited before it was ready')
    else:
      link.result(ready)  # Raises what the candidate's module raised.
      bridge.install_finder(link, remote_names)
      module = types.ModuleType('__main__')
      module.__dict__.update(__builtins__=builtins)
      sys.modules['__main__'] = module
      exec(compile(test, 'test.py', 'exec'), module.__dict__)  # pylint: disable=exec-used
      verdict = {'passed': True}
  except bridge.CandidateFailed as e:
    verdict.update(status='candidate_exited', detail=str(e))
  except BaseException as e:  # pylint: disable=broad-except
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # Not this frame.
    text = ''.join(traceback.format_exception(type(e), e, tb))
    verdict.update(detail=text[-4000:])
  if link.control_flow:  # Even where the test caught it: see `bridge`.
    verdict = {'passed': False, 'status': 'runtime_error',
               'detail': f'the candidate raised {link.control_flow}, a control-flow exception'}
  try:
    framing.write_frame(5, verdict)
  except OSError:
    _exit(1)
  _exit(0)


def _write_files(root, files):
  """Writes {relative path: text} under `root` (in the candidate, as the sandbox uid)."""
  for rel, text in files.items():
    path = os.path.join(root, normalize_path(rel))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
      f.write(text)


def normalize_path(path: str, where: str = 'the work dir') -> str:
  """The one rule for a file path relative to a directory: the sandbox's and the SWE domains'.

  The server writes a request's `files` under the work dir by it, and the
  agentic SWE environment (`envs.swe_agent`) and the SWE verifier
  (`verifiers.swe`) confine the policy's paths by it, so a path one accepts
  the other never refuses. Empty and '.' components fall away ('./a//b.py'
  is 'a/b.py'); every other component is a file name, '..notes.txt' and
  '...' included. Refused: an empty path or one that names the directory
  itself; an absolute path; '..' as a component anywhere ('a/../b' too); NUL
  and other control characters; text that is not valid Unicode; a name
  longer than MAX_NAME_BYTES or a path longer than MAX_PATH_BYTES in UTF-8.

  Args:
    path: the path as given (a request's `files` key, a tool's argument, a
      patch's file name).
    where: what the path is relative to, as error messages name it.

  Returns:
    The normalised path: its components joined by '/'.

  Raises:
    ValueError: one line naming the path and the rule it breaks.
  """
  if not isinstance(path, str):
    raise ValueError(f'a path must be a string, got {type(path).__name__}')
  if not path:
    raise ValueError('empty path')
  shown = repr(path[:80])
  if any(ord(ch) < 32 or ord(ch) == 127 for ch in path):
    raise ValueError(f'path {shown} holds a NUL or control character')
  try:
    size = len(path.encode('utf-8'))
  except UnicodeEncodeError as e:
    raise ValueError(f'path {shown} is not valid Unicode text ({e.reason} at {e.start})') from None
  if path.startswith('/'):
    raise ValueError(f'absolute path {shown}: paths are relative to {where}')
  if size > MAX_PATH_BYTES:
    raise ValueError(f'path {shown} is longer than {MAX_PATH_BYTES} bytes')
  parts = [p for p in path.split('/') if p not in ('', '.')]
  if '..' in parts:
    raise ValueError(f"path {shown} leaves {where} ('..' is not a file name)")
  if not parts:
    raise ValueError(f'{shown} is {where} itself, not a file')
  for part in parts:
    if len(part.encode('utf-8')) > MAX_NAME_BYTES:
      raise ValueError(f'path {shown} has a name longer than {MAX_NAME_BYTES} bytes')
  return '/'.join(parts)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _scan(fd):
  """Unlinks the non-directories in the directory open at fd; returns its subdirectory names."""
  subdirs = []
  with os.scandir(fd) as it:
    entries = list(it)
  for entry in entries:
    try:
      if entry.is_dir(follow_symlinks=False):
        os.chmod(entry.name, 0o700, dir_fd=fd)  # A real dir (not a link), ours: make it listable.
        subdirs.append(entry.name)
      else:
        os.unlink(entry.name, dir_fd=fd)
    except OSError:
      pass
  return subdirs


def empty_dir(root):
  """Removes everything under `root`, at any depth and path length, with bounded descriptors.

  Every step is relative to an open directory descriptor (so paths longer
  than PATH_MAX are no obstacle) and only one directory is open at a time;
  the walk climbs back with '..', which is safe because no process of the
  tree's owner is alive while it runs. Directories made unreadable are
  chmod-ed first (the caller runs as their owner).
  """
  try:
    os.chmod(root, 0o755)
    fd = os.open(root, _DIR_FLAGS)
  except OSError:
    return
  try:
    names, frames = [], [_scan(fd)]
    while frames:
      if frames[-1]:
        name = frames[-1].pop()
        try:
          child = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError:
          continue
        os.close(fd)
        fd = child
        names.append(name)
        frames.append(_scan(fd))
        continue
      frames.pop()
      if not frames:
        break
      parent = os.open('..', _DIR_FLAGS, dir_fd=fd)
      os.close(fd)
      fd = parent
      try:
        os.rmdir(names.pop(), dir_fd=fd)
      except OSError:
        pass
  finally:
    os.close(fd)


def _tail(path, limit=2000, strip=True):
  """The last `limit` bytes of a file, decoded ('' when it cannot be read)."""
  try:
    with open(path, 'rb') as f:
      f.seek(0, os.SEEK_END)
      size = f.tell()
      f.seek(max(0, size - limit))
      text = f.read().decode('utf-8', errors='replace')
  except OSError:
    return ''
  return text.strip() if strip else text


def _count_own_processes():
  uid, n = os.getuid(), 0
  for name in os.listdir('/proc'):
    if name.isdigit():
      try:
        if os.stat(f'/proc/{name}').st_uid == uid:
          n += 1
      except OSError:
        pass
  return n


def self_test(root, drop_uid):
  """Checks the sandbox identity here: seccomp refuses a user namespace; 0 if it holds."""
  why = seccomp.supported()
  if why:
    print(why, file=sys.stderr)
    return 1
  pid = os.fork()
  if pid == 0:
    try:
      os.chdir(root)
      if drop_uid is not None:
        os.setgroups([])
        os.setgid(drop_uid)
        os.setuid(drop_uid)
      seccomp.install()
      libc = _libc()
      if libc.unshare(0x10000000) == 0 or ctypes.get_errno() != errno.EPERM:
        _write(2, b'seccomp did not refuse unshare(CLONE_NEWUSER)\n')
        _exit(1)
      _exit(0)
    except BaseException:  # pylint: disable=broad-except
      _write(2, traceback.format_exc().encode())
      _exit(1)
  _, status = os.waitpid(pid, 0)
  return 0 if status == 0 else 1


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--root', required=True, help='private work directory')
  parser.add_argument('--drop-uid', type=int, default=None, help='uid/gid for children')
  parser.add_argument('--kill-all', action='store_true', help='alone in a PID namespace')
  parser.add_argument('--self-test', action='store_true', help='check the sandbox and exit')
  args = parser.parse_args(argv)
  if args.self_test:
    sys.exit(self_test(args.root, args.drop_uid))
  # The protocol moves to private descriptors; 0 and 1 become /dev/null so
  # that nothing printed by accident can corrupt it.
  proto_in, proto_out = os.dup(0), os.dup(1)
  null = os.open(os.devnull, os.O_RDWR)
  os.dup2(null, 0)
  os.dup2(null, 1)
  os.close(null)
  for name in _PRELOAD:
    __import__(name)
  seccomp.prepare()  # Built once here: every child installs the same filter.
  server = Server(args.root, args.drop_uid, args.kill_all)
  framing.write_frame(proto_out, {'ready': True, 'pid': os.getpid()})
  while True:
    try:
      req = framing.read_frame(proto_in)
    except (EOFError, ValueError, OSError) as e:
      if isinstance(e, OSError) and e.errno not in (errno.EBADF, errno.EPIPE):
        raise
      return
    if req is None:
      return
    framing.write_frame(proto_out, server.handle(req))


if __name__ == '__main__':
  main()
