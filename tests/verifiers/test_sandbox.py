"""The sandbox's pieces: framing, output comparison, work-dir hygiene, unprivileged bubblewrap."""

import os
import shutil
import subprocess
import textwrap

import psutil
import pytest

from verifiers import base
from verifiers import sandbox
from verifiers import sandbox_server

needs_bwrap = pytest.mark.skipif(sandbox.probe_bwrap('bwrap') != '', reason='needs bubblewrap')


def test_frames_round_trip_in_pieces_and_reject_oversize():
  data = sandbox_server.encode_frame({'a': [1, 'é']}) + sandbox_server.encode_frame(None)
  reader = sandbox_server.FrameReader()
  got = []
  for k in range(len(data)):
    got += reader.feed(data[k:k + 1])
  assert got == [{'a': [1, 'é']}, None]
  with pytest.raises(ValueError, match='exceeds'):
    sandbox_server.FrameReader().feed(b'\xff\xff\xff\xff')
  r, w = os.pipe()
  sandbox_server.write_frame(w, {'x': 1})
  os.close(w)
  assert sandbox_server.read_frame(r) == {'x': 1}
  assert sandbox_server.read_frame(r) is None
  os.close(r)


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
  assert sandbox_server.outputs_match(got, expected, tol) is ok


def test_bwrap_command_line():
  root = sandbox.bwrap_argv('/usr/bin/bwrap', as_root=True, tmpfs_mb=64)
  for flag in ('--unshare-pid', '--unshare-net', '--unshare-ipc', '--die-with-parent',
               '--new-session', '--cap-drop'):
    assert flag in root
  assert '--unshare-all' not in root  # See sandbox's docstring: no user namespace as root.
  assert root[root.index('--tmpfs') - 1] == str(64 << 20)
  user = sandbox.bwrap_argv('/usr/bin/bwrap', as_root=False, tmpfs_mb=64)
  assert '--unshare-all' in user and '--cap-add' not in user
  # Only system dirs and the interpreter are visible: not the repository.
  binds = [user[i + 1] for i, a in enumerate(user) if a == '--ro-bind']
  assert base.PACKAGE_PARENT not in binds and '/' not in binds


@needs_bwrap
def test_runs_leave_no_files_or_processes_for_the_next_run():
  with sandbox.Sandbox(1, strict_isolation=True) as sb:
    first = ('import os, time\nopen("left.txt", "w").write("x")\nos.makedirs("d/e")\n'
             'os.chmod("d", 0)\nos.chmod(".", 0)\nif os.fork() == 0:\n    time.sleep(60)\n')
    second = ('import os\nassert not os.path.exists("left.txt"), os.listdir(".")\n'
              'assert open("pkg/data.txt").read() == "hello"\n')
    escape = {'mode': 'check', 'program': 'pass', 'files': {'../escape.txt': 'x'}}
    big = 'x' * (1 << 20)
    res = sb.run([{'mode': 'check', 'program': first},
                  {'mode': 'check', 'program': second, 'files': {'pkg/data.txt': 'hello'}},
                  escape,
                  {'mode': 'stdio', 'program': 'import sys\nprint(len(sys.stdin.read()))',
                   'cases': [{'stdin': big, 'expected': str(len(big))}]}],
                 [5.0] * 4)
    assert [r['passed'] for r in res] == [True, True, False, True], res
    assert 'must be relative' in res[2]['detail']


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which('setpriv')
                    or not os.access('/usr/bin/python3', os.X_OK),
                    reason='needs root (to become another user), setpriv and /usr/bin/python3')
def test_unprivileged_bubblewrap_contains_fork_bombs_and_daemons():
  """As a normal user: bwrap --unshare-all, the process limit counts in its user namespace."""
  uid = 61_234
  script = textwrap.dedent('''
      import os
      from verifiers import sandbox
      with sandbox.Sandbox(1, strict_isolation=True, nproc=8) as sb:
        assert sb.isolation == 'bwrap' and not sb.uids
        bomb = 'import os, time\\nn = 0\\ntry:\\n    for _ in range(100):\\n' \\
               '        if os.fork() == 0:\\n            time.sleep(30)\\n            os._exit(0)\\n' \\
               '        n += 1\\nexcept OSError:\\n    pass\\nassert 0 < n < 20, n\\n'
        daemon = 'import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(60)\\n'
        res = sb.run([{'mode': 'check', 'program': 'assert 1 + 1 == 2'},
                      {'mode': 'check', 'program': bomb},
                      {'mode': 'check', 'program': daemon},
                      {'mode': 'check', 'program': 'import os\\nos.kill(os.getppid(), 9)'},
                      {'mode': 'check', 'program': 'assert 2 + 2 == 4'}], [10.0] * 5)
        print([r['status'] for r in res])
        print(res)
  ''')
  env = {'PATH': '/usr/bin:/bin', 'HOME': '/tmp', 'PYTHONPATH': base.PACKAGE_PARENT}
  out = subprocess.run(['setpriv', f'--reuid={uid}', f'--regid={uid}', '--clear-groups',
                        '/usr/bin/python3', '-c', script], env=env, capture_output=True,
                       text=True, timeout=120, cwd='/')
  assert out.returncode == 0, out.stderr[-2000:]
  statuses = eval(out.stdout.strip().splitlines()[-2])  # pylint: disable=eval-used
  # Forks fail at the limit; killing the server loses only that run.
  assert statuses[:3] == ['passed'] * 3 and statuses[4] == 'passed', out.stdout
  assert statuses[3] in ('runtime_error', 'sandbox_error')
  # Exited bwrap processes may wait a moment for the host's init to reap them.
  left = [p.pid for p in psutil.process_iter(['uids', 'status'])
          if p.info['uids'].real == uid and p.info['status'] != psutil.STATUS_ZOMBIE]
  assert not left
