"""The sandbox's pieces: framing, plain data, seccomp, command line, isolation choice, cleanup."""

import math
import os
import shutil
import stat
import subprocess
import textwrap

import psutil
import pytest

from verifiers import base
from verifiers import sandbox
from verifiers.sandbox import bridge
from verifiers.sandbox import framing
from verifiers.sandbox import seccomp
from verifiers.sandbox import server


def test_frames_round_trip_in_pieces_and_reject_oversize_nan_and_deep_nesting():
  data = framing.encode_frame({'a': [1, 'é']}) + framing.encode_frame(None)
  reader = framing.FrameReader()
  got = []
  for k in range(len(data)):
    got += reader.feed(data[k:k + 1])
  assert got == [{'a': [1, 'é']}, None]
  with pytest.raises(ValueError, match='exceeds'):
    framing.FrameReader().feed(b'\xff\xff\xff\xff')
  r, w = os.pipe()
  framing.write_frame(w, {'x': 1})
  os.close(w)
  assert framing.read_frame(r) == {'x': 1}
  assert framing.read_frame(r) is None
  os.close(r)
  with pytest.raises(ValueError):
    framing.encode_frame(float('nan'))
  for body in (b'NaN', b'[Infinity]', b'[' * 100_000 + b']' * 100_000, b'\xff'):
    with pytest.raises(ValueError):
      framing.FrameReader().feed(len(body).to_bytes(4, 'big') + body)


def test_framing_is_standard_library_only():
  """It runs inside the sandbox next to the server: no package imports."""
  for module in (framing, bridge, seccomp, server):
    text = open(module.__file__).read()
    assert 'import verifiers' not in text.replace('from verifiers.sandbox import', 'x')


class _Sneaky(int):

  def __eq__(self, other):
    return True


@pytest.mark.parametrize('value', [
    None, True, 0, -5, 10**5000, 1.5, float('inf'), -0.0, 1 + 2j, 'é\ud800', b'\x00\xff',
    [1, (2, 3)], {'a': [1], (1, 2): frozenset({3})}, frozenset({1, 'x'}), set(), ()],
    ids=lambda v: type(v).__name__)
def test_plain_data_round_trips_exactly(value):
  got = bridge.decode(framing.FrameReader().feed(framing.encode_frame(bridge.encode(value)))[0])
  assert type(got) is type(value) and got == value
  assert type(value) is not float or repr(got) == repr(value)


@pytest.mark.parametrize('value', [_Sneaky(3), [1, _Sneaky(2)], {'k': object()}, len, iter([1])],
                         ids=lambda v: type(v).__name__)
def test_plain_data_rejects_everything_else(value):
  with pytest.raises(bridge.NotPlain):
    bridge.encode(value)


@pytest.mark.parametrize('name', ['StopIteration', 'StopAsyncIteration', 'GeneratorExit',
                                  'KeyboardInterrupt', 'SystemExit', 'BaseExceptionGroup'])
def test_the_judge_turns_control_flow_exceptions_into_failures(name):
  """Whatever frame the candidate writes: a RuntimeError in the judge, and the link remembers."""
  link = bridge.Link(-1, -1)
  with pytest.raises(ValueError):  # An ordinary exception passes as itself, unmarked.
    link.result(['e', 'ValueError', 'ValueError: bad'])
  assert link.control_flow == ''
  with pytest.raises(RuntimeError, match=f'candidate raised {name}'):
    link.result(['e', name, f'{name}: x'])
  link.result(['v', None])
  assert link.control_flow == name  # The verdict fails even if the test caught the error.


def test_plain_data_nan_and_deep_values():
  assert math.isnan(bridge.decode(bridge.encode(float('nan'))))
  deep = []
  for _ in range(bridge.MAX_DEPTH + 5):
    deep = [deep]
  with pytest.raises(bridge.NotPlain):
    bridge.encode(deep)
  with pytest.raises(ValueError):
    bridge.decode(['l', [['q', 'x']]])


@pytest.mark.parametrize('got, expected, tol, ok', [
    ('3\n', '3', 0.0, True),
    ('1  2\n3 \n\n', '1 2\n3', 0.0, True),
    ('3', '4', 0.0, False),
    ('1 2', '1 2 3', 0.0, False),
    ('0.3333', '0.333333', 1e-3, True),
    ('0.3333', '0.333333', 0.0, False),
    ('1000001', '1000000', 1e-5, True),   # Relative for large values.
    ('abc', '0.5', 1e-3, False),
])
def test_outputs_match(got, expected, tol, ok):
  assert server.outputs_match(got, expected, tol) is ok


def test_seccomp_refuses_user_namespaces_but_not_fork_or_threads():
  if seccomp.supported():
    pytest.skip(seccomp.supported())
  script = textwrap.dedent('''
      import ctypes, os, threading
      from verifiers.sandbox import seccomp
      seccomp.install()
      libc = ctypes.CDLL(None, use_errno=True)
      assert libc.unshare(0x10000000) == -1 and ctypes.get_errno() == 1
      assert libc.unshare(0x00020000) == -1
      t = threading.Thread(target=lambda: None); t.start(); t.join()
      pid = os.fork()
      if pid == 0:
          os._exit(7)
      assert os.waitpid(pid, 0)[1] >> 8 == 7
      print('ok')
  ''')
  out = subprocess.run([os.sys.executable, '-c', script], capture_output=True, text=True,
                       timeout=60, cwd=base.PACKAGE_PARENT)
  assert out.stdout.strip() == 'ok', out.stderr


def test_seccomp_refuses_what_would_outlive_the_sample_but_not_its_own_work(tmp_path):
  """Extended attributes (ACLs too), file times, descriptors in flight, network sockets and other
  processes' limits are refused; the same calls on the caller itself, reads and unix sockets
  work."""
  if seccomp.supported():
    pytest.skip(seccomp.supported())
  script = textwrap.dedent('''
      import errno, os, resource, socket, sys
      from verifiers.sandbox import seccomp
      os.chdir(sys.argv[1])
      open('f', 'w').write('x')
      other = os.fork()
      if other == 0:
          os.read(os.open('/dev/zero', os.O_RDONLY), 1)
          import time; time.sleep(30)
      seccomp.install()
      def refused(call, *args, err=errno.EPERM):
          try:
              call(*args)
          except OSError as e:
              assert e.errno == err, (call, e)
          else:
              raise AssertionError(f'{call.__name__}{args} was allowed')
      acl = (2).to_bytes(4, 'little') + b''.join(
          t.to_bytes(2, 'little') + bytes(2) + b'\\xff' * 4 for t in (1, 4, 0x20))
      for path in ('.', 'f'):
          refused(os.setxattr, path, 'user.left', b'data')
          refused(os.setxattr, path, 'system.posix_acl_default', acl)
          refused(os.removexattr, path, 'user.left')
          refused(os.utime, path)
          refused(os.utime, path, (1, 2))
          assert os.listxattr(path) == []  # Reading stays allowed.
      fd = os.open('f', os.O_RDONLY)
      refused(os.setxattr, fd, 'user.left', b'data')
      refused(os.utime, fd)
      a, b = socket.socketpair()
      refused(socket.send_fds, b, [b'x'], [fd])
      refused(b.sendmsg, [b'x'])
      b.send(b'plain')
      assert a.recv(5) == b'plain'
      refused(socket.socket, socket.AF_INET, err=errno.EAFNOSUPPORT)
      refused(socket.socket, socket.AF_INET6, err=errno.EAFNOSUPPORT)
      socket.socket(socket.AF_UNIX).bind(b'\\0cascade-own')
      refused(resource.prlimit, other, resource.RLIMIT_NOFILE, (64, 64))
      refused(os.setpriority, os.PRIO_PROCESS, other, 5)
      refused(os.setpriority, os.PRIO_USER, os.getuid(), 5)
      refused(os.sched_setaffinity, other, {0})
      resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
      os.setpriority(os.PRIO_PROCESS, 0, 1)
      os.sched_setaffinity(0, os.sched_getaffinity(0))
      os.kill(other, 9)
      print('ok')
  ''')
  out = subprocess.run([os.sys.executable, '-c', script, str(tmp_path)], capture_output=True,
                       text=True, timeout=60, cwd=base.PACKAGE_PARENT)
  assert out.stdout.strip() == 'ok', out.stderr


def test_bwrap_command_line():
  root = sandbox.bwrap_argv('/usr/bin/bwrap', as_root=True, tmpfs_mb=64)
  for flag in ('--unshare-pid', '--unshare-net', '--unshare-ipc', '--die-with-parent',
               '--new-session', '--cap-drop'):
    assert flag in root
  assert '--unshare-all' not in root  # See sandbox's docstring: no user namespace as root.
  assert root[root.index('--tmpfs') - 1] == str(64 << 20)
  user = sandbox.bwrap_argv('/usr/bin/bwrap', as_root=False, tmpfs_mb=64)
  assert '--unshare-all' in user and '--cap-add' not in user
  # Only system dirs, the interpreter and the harness files are visible: not
  # the repository, not /etc as a whole.
  binds = [user[i + 1] for i, a in enumerate(user) if a == '--ro-bind']
  assert base.PACKAGE_PARENT not in binds and '/' not in binds and '/etc' not in binds
  assert [b for b in binds if b.startswith('/etc/')] == [
      f for f in sandbox._ETC_FILES if os.path.exists(f)]
  # The tmpfs comes before every bind, so binds under /tmp stay visible.
  assert user.index('--tmpfs') < user.index('--ro-bind')


def test_refuses_without_bubblewrap_in_one_line_unless_opted_out():
  with pytest.raises(RuntimeError) as e:
    sandbox.Sandbox(1, bwrap='/nonexistent/bwrap')
  msg = str(e.value)
  assert '\n' not in msg and 'apt-get install bubblewrap' in msg and "isolation='none'" in msg
  with pytest.raises(ValueError, match='isolation'):
    sandbox.Sandbox(1, isolation='rlimit')
  with sandbox.Sandbox(1, isolation='none', bwrap='/nonexistent/bwrap') as sb:
    assert sb.isolation == 'none'
    res = sb.run([{'mode': 'check', 'program': 'def f():\n    return 2\n',
                   'test': 'from solution import f\nassert f() == 2\n'}], [10.0])
    assert res[0]['passed'], res


# (path, what the rule makes of it: the normalised path, or a word of its refusal).
_PATHS = [
    ('..notes.txt', '..notes.txt'), ('...', '...'), ('a/..b/c..', 'a/..b/c..'),
    ('./a//b.py', 'a/b.py'), ('a/./b/', 'a/b'), ('.hidden', '.hidden'), ('é/ü.py', 'é/ü.py'),
    ('x' * 255, 'x' * 255),
    ('..', ValueError('leaves')), ('../a', ValueError('leaves')), ('a/..', ValueError('leaves')),
    ('a/../b', ValueError('leaves')), ('/etc/passwd', ValueError('absolute')),
    ('', ValueError('empty')), ('.', ValueError('itself')), ('./', ValueError('itself')),
    ('a\x00b', ValueError('control')), ('a\nb', ValueError('control')),
    ('\ud800.py', ValueError('Unicode')), ('x' * 256, ValueError('name longer')),
    ('é' * 128, ValueError('name longer')), ('a/' * 600, ValueError('longer than 1024'))]


@pytest.mark.parametrize('path, norm', _PATHS)
def test_one_path_rule_for_the_sandbox_and_the_swe_domains(path, norm):
  """`server.normalize_path` is the rule the server writes `files` by; the agentic SWE env's tools
  and the SWE verifier's patches use it, so a path one takes the other never refuses."""
  from envs import base as envs_base  # pylint: disable=g-import-not-at-top
  from envs import swe_agent  # pylint: disable=g-import-not-at-top
  short = len(path) <= swe_agent.MAX_PATH_CHARS  # The env's own bound on top of the rule.
  if isinstance(norm, str):
    assert server.normalize_path(path) == norm
    if short:
      assert swe_agent.normalize_path(path) == norm
    return
  with pytest.raises(ValueError, match=str(norm)):
    server.normalize_path(path)
  with pytest.raises(envs_base.ToolError, match=str(norm) if short else 'longer than 200'):
    swe_agent.normalize_path(path)


def test_empty_dir_removes_trees_deeper_than_path_max(tmp_path):
  root = tmp_path / 'case'
  root.mkdir()
  fd = os.open(root, os.O_RDONLY)
  for _ in range(40):  # 40 x 250 characters: far past PATH_MAX (4096).
    name = 'd' * 250
    os.mkdir(name, dir_fd=fd)
    with open(os.open('f', os.O_WRONLY | os.O_CREAT, dir_fd=fd), 'w') as f:
      f.write('x')
    os.symlink('/', 'link', dir_fd=fd)
    child = os.open(name, os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = child
  os.fchmod(fd, 0)
  os.close(fd)
  os.chmod(root / ('d' * 250), 0)
  server.empty_dir(str(root))
  assert os.listdir(root) == []
  assert stat.S_IMODE(os.stat(root).st_mode) & 0o700 == 0o700


def test_runs_leave_no_files_or_processes_for_the_next_run(bwrap_sandbox):
  with sandbox.Sandbox(1) as sb:
    first = ('import os, time\nopen("left.txt", "w").write("x")\nos.makedirs("d/e")\n'
             'os.chmod("d", 0)\nos.chmod(".", 0)\nif os.fork() == 0:\n    time.sleep(60)\n')
    second = ('import os\nassert not os.path.exists("left.txt"), os.listdir(".")\n'
              'assert open("pkg/data.txt").read() == "hello"\n')
    escape = {'mode': 'check', 'program': 'pass', 'test': 'pass', 'files': {'../escape.txt': 'x'}}
    big = 'x' * (1 << 20)
    res = sb.run([{'mode': 'check', 'program': first, 'test': 'import solution'},
                  {'mode': 'check', 'program': second, 'test': 'import solution',
                   'files': {'pkg/data.txt': 'hello'}},
                  escape,
                  {'mode': 'stdio', 'program': 'import sys\nprint(len(sys.stdin.read()))',
                   'cases': [{'stdin': big, 'expected': str(len(big))}]}],
                 [5.0] * 4)
    assert [r['passed'] for r in res] == [True, True, False, True], res
    assert 'leaves the work dir' in res[2]['detail']
    # The first made a process and files: it moved counters every later sample would see (the
    # next pid, the next inode number), so its server is replaced; the others leave it clean.
    assert [r['restart'] for r in res] == [True, False, False, False], res


def test_a_checkout_under_tmp_leaves_runs_clean(bwrap_sandbox, monkeypatch):
  # An interpreter (a venv, a clean clone) under /tmp is bound below the sandbox's /tmp, the
  # server's root, where bubblewrap makes its mount points: they are there from the start, and
  # a run that leaves the root as it found it is clean (no restart).
  import tempfile  # pylint: disable=g-import-not-at-top
  outside = tempfile.mkdtemp(prefix='cascade-venv-', dir='/tmp')
  os.chmod(outside, 0o755)
  dirs = sandbox._python_dirs  # pylint: disable=protected-access
  monkeypatch.setattr(sandbox, '_python_dirs', lambda: [*dirs(), outside])
  try:
    with sandbox.Sandbox(1) as sb:
      res = sb.run([{'mode': 'run', 'program': 'print(1)'},
                    {'mode': 'check', 'program': 'x = 2', 'test': 'import solution'}], [10.0] * 2)
  finally:
    shutil.rmtree(outside)
  assert [r['passed'] for r in res] == [True, True], res
  assert not any(r['restart'] for r in res), res


def _checkout_readable_by_others():
  path = base.PACKAGE_PARENT
  while path != '/':
    if not os.stat(path).st_mode & stat.S_IXOTH:
      return False
    path = os.path.dirname(path)
  return bool(os.stat(os.path.join(base.PACKAGE_PARENT, 'verifiers')).st_mode & stat.S_IROTH)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which('setpriv')
                    or not os.access('/usr/bin/python3', os.X_OK),
                    reason='needs root (to become another user), setpriv and /usr/bin/python3')
@pytest.mark.skipif(not _checkout_readable_by_others(),
                    reason='the checkout is not readable by other users (e.g. under a mode-700 '
                           'home), so an unprivileged uid cannot import verifiers from it')
def test_unprivileged_bubblewrap_contains_fork_bombs_and_daemons(bwrap_sandbox):
  """As a normal user: bwrap --unshare-all, the process limit counts in its user namespace.

  There the candidates share the server's uid, so they own every directory
  bubblewrap made (/, /etc, /dev, /dev/shm, /tmp) and the processes forked
  for the next runs: what one leaves there (files, modes, extended
  attributes, other processes' limits and priority) must not reach the next
  (refused, or the health check replaces the server).
  """
  uid = 61_234
  script = textwrap.dedent('''
      import os
      from verifiers import sandbox
      with sandbox.Sandbox(1, nproc=8) as sb:
        assert sb.isolation == 'bwrap' and not sb.uids
        bomb = 'import os, time\\nn = 0\\ntry:\\n    for _ in range(100):\\n' \\
               '        if os.fork() == 0:\\n            time.sleep(30)\\n            os._exit(0)\\n' \\
               '        n += 1\\nexcept OSError:\\n    pass\\nassert 0 < n < 20, n\\n'
        daemon = 'import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(60)\\n'
        userns = 'import ctypes\\nassert ctypes.CDLL(None).unshare(0x10000000) == -1\\n'
        dirs = ('/', '/etc', '/dev', '/dev/shm', '/tmp', '/tmp/.io', '/sandbox')
        leave = f'import os\\nfor d in {dirs!r}:\\n    try:\\n' \\
                '        open(os.path.join(d, "left.txt"), "w").write("x")\\n' \\
                '    except OSError:\\n        pass\\n'
        look = f'import os\\nleft = [d for d in {dirs!r} if os.path.exists(d + "/left.txt")]\\n' \\
               'assert not left, left\\n'
        # Metadata of what they share with the server, and the limits and priority of the
        # processes forked ahead for the next runs (the zygote's, the spares').
        paths = ('/tmp', '/tmp/.io', '/dev/pts', '/dev/pts/ptmx')
        meta = 'import os, resource\\nfor p in %r:\\n' \\
               '    for call, args in ((os.chmod, (0o777,)), ' \\
               '(os.setxattr, ("user.left", b"x")), (os.utime, ((1, 2),))):\\n' \\
               '        try:\\n            call(p, *args)\\n        except OSError:\\n' \\
               '            pass\\n' \\
               'for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:\\n' \\
               '    for call, args in ((resource.prlimit, (pid, resource.RLIMIT_MSGQUEUE, ' \\
               '(12345, 12345))), (os.setpriority, (os.PRIO_PROCESS, pid, 7)), ' \\
               '(os.setpriority, (os.PRIO_USER, os.getuid(), 7))):\\n        try:\\n' \\
               '            call(*args)\\n        except OSError:\\n            pass\\n' % (paths,)
        seen = 'import os, resource\\nprint([(oct(os.stat(p).st_mode), os.listxattr(p)) ' \\
               'for p in %r])\\nprint(os.getpriority(os.PRIO_PROCESS, 0), ' \\
               'resource.getrlimit(resource.RLIMIT_MSGQUEUE))\\n' % (paths,)
        res = sb.run([{'mode': 'check', 'program': 'assert 1 + 1 == 2', 'test': 'import solution'},
                      {'mode': 'check', 'program': bomb, 'test': 'import solution'},
                      {'mode': 'check', 'program': daemon, 'test': 'import solution'},
                      {'mode': 'check', 'program': 'import os\\nos.kill(os.getppid(), 9)',
                       'test': 'import solution'},
                      {'mode': 'check', 'program': userns, 'test': 'import solution'},
                      {'mode': 'check', 'program': 'assert 2 + 2 == 4', 'test': 'import solution'},
                      {'mode': 'run', 'program': leave}, {'mode': 'run', 'program': look},
                      {'mode': 'run', 'program': seen}, {'mode': 'run', 'program': meta},
                      {'mode': 'run', 'program': seen}],
                     [10.0] * 11)
        print([r['status'] for r in res])
        print(res)
  ''')
  env = {'PATH': '/usr/bin:/bin', 'HOME': '/tmp', 'PYTHONPATH': base.PACKAGE_PARENT}
  out = subprocess.run(['setpriv', f'--reuid={uid}', f'--regid={uid}', '--clear-groups',
                        '/usr/bin/python3', '-c', script], env=env, capture_output=True,
                       text=True, timeout=120, cwd='/')
  assert out.returncode == 0, out.stderr[-2000:]
  statuses = eval(out.stdout.strip().splitlines()[-2])  # pylint: disable=eval-used
  # Forks fail at the limit; killing the parent fails only that run.
  assert statuses[:3] == ['passed'] * 3 and statuses[4:] == ['passed'] * 7, out.stdout
  assert statuses[3] != 'passed'
  answers = eval(out.stdout.strip().splitlines()[-1])  # pylint: disable=eval-used
  assert answers[-1]['stdout'] == answers[-3]['stdout'], (answers[-3], answers[-1])
  # Exited bwrap processes may wait a moment for the host's init to reap them.
  left = [p.pid for p in psutil.process_iter(['uids', 'status'])
          if p.info['uids'].real == uid and p.info['status'] != psutil.STATUS_ZOMBIE]
  assert not left


def test_a_failed_sandbox_is_flagged_in_the_result_and_replaced(bwrap_sandbox):
  """A server that dies mid-sample gives info['sandbox_error'] (what the stage loop counts)."""
  import threading  # pylint: disable=g-import-not-at-top

  import verifiers  # pylint: disable=g-import-not-at-top
  md = {'prompt': 'def f():\n', 'test': 'def check(c):\n    assert c() == 1\n',
        'entry_point': 'f'}
  with verifiers.get('code', workers=1, timeout_s=20) as v:
    assert v.score([verifiers.Sample('p', '    return 1\n', md)])[0].reward == 1.0
    pids = v.sandbox.server_pids
    threading.Timer(1.0, lambda: [os.kill(p, 9) for p in pids]).start()
    slow = 'import time\ntime.sleep(10)\ndef f():\n    return 1\n'
    res = v.score([verifiers.Sample('p', slow, md), verifiers.Sample('p', '    return 1\n', md)])
  assert res[0].reward == 0.0 and res[0].info['sandbox_error'] is True, res[0].info
  assert res[1].reward == 1.0 and res[1].info['sandbox_error'] is False


def test_interpreter_under_tmp_works_in_the_sandbox(bwrap_sandbox, tmp_path):
  """A venv under /tmp (a fresh clone there) stays visible: the private /tmp is mounted first."""
  import sys  # pylint: disable=g-import-not-at-top
  venv = tmp_path / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True,
                 timeout=120)
  assert str(venv).startswith('/tmp/')
  script = textwrap.dedent('''
      from verifiers import sandbox
      print(repr(sandbox.probe_bwrap('bwrap')))
      with sandbox.Sandbox(1) as sb:
        r = sb.run([{'mode': 'check', 'program': 'import sys\\nP = sys.prefix\\n',
                     'test': 'from solution import P\\nassert P.startswith("/tmp/"), P\\n'}], [20.0])
        print(r[0]['passed'], r[0]['detail'][-300:])
  ''')
  env = dict(os.environ, PYTHONPATH=base.PACKAGE_PARENT)
  out = subprocess.run([str(venv / 'bin' / 'python'), '-c', script], env=env, capture_output=True,
                       text=True, timeout=120, cwd='/')
  assert out.stdout.splitlines()[:2] == ["''", 'True '], (out.stdout, out.stderr[-2000:])


def test_run_mode_answers_with_output_tails_and_status(bwrap_sandbox):
  """'run': stdout/stderr tails and the status of one run, under the same limits and cleanup."""
  with sandbox.Sandbox(1) as sb:
    loud = 'import sys\nfor i in range(10000):\n    print(i)\nprint("to stderr", file=sys.stderr)\n'
    res = sb.run([{'mode': 'run', 'program': 'print("hello")\nprint(6 * 7)\n'},
                  {'mode': 'run', 'program': loud, 'output_bytes': 20},
                  {'mode': 'run', 'program': 'print("partial")\nraise KeyError("boom")\n'},
                  {'mode': 'run', 'program': 'while True:\n    pass\n'},
                  {'mode': 'run', 'program': 'open("left.txt", "w").write("x")\nprint(1)\n'},
                  {'mode': 'run', 'program': 'import os\nprint(sorted(os.listdir(".")))\n'
                                             'print(os.path.exists("/etc/passwd"))\n'}],
                 [5.0, 5.0, 5.0, 1.0, 5.0, 5.0])
  ok, loud_r, err, loop, write, look = res
  assert ok['passed'] and ok['status'] == 'passed' and ok['stdout'] == 'hello\n42\n', ok
  assert ok['stdout_bytes'] == len('hello\n42\n') and ok['stderr'] == ''
  assert loud_r['passed'] and loud_r['stdout'] == '9996\n9997\n9998\n9999\n', loud_r['stdout']
  assert loud_r['stdout_bytes'] == sum(len(f'{i}\n') for i in range(10000))
  assert loud_r['stderr'] == 'to stderr\n'
  assert not err['passed'] and err['status'] == 'runtime_error' and err['stdout'] == 'partial\n'
  assert "KeyError: 'boom'" in err['stderr'] and "KeyError: 'boom'" in err['detail']
  assert not loop['passed'] and loop['status'] == 'timeout', loop
  assert write['passed'] and look['stdout'] == '[]\nFalse\n', look
  # Only the run that made a file leaves its server to be replaced (see above).
  assert [r['restart'] for r in res] == [False] * 4 + [True, False], res
