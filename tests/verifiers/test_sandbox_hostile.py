"""Hostile candidates: each is contained while the rest of its batch is scored correctly.

Runs on the bubblewrap path (skipped only where bwrap is not installed; a
bwrap that is installed but unusable fails these tests, see conftest).
Classes: escapes (files, network to a listener this test starts, processes,
namespaces and mounts, /etc), resource exhaustion (per process and in total),
exit-code and completion-proof forgeries, comparison objects, worker
poisoning (paths past PATH_MAX, full tmpfs, planted files) and pathological
text for the host-side parsers.
"""

import os
import secrets
import socket
import time

import psutil
import pytest

import verifiers
from verifiers import base

pytestmark = pytest.mark.usefixtures('bwrap_sandbox')

PROMPT = 'def add(a, b):\n    """Adds two numbers."""\n'
TEST = 'def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n'
HE = {'prompt': PROMPT, 'test': TEST, 'entry_point': 'add'}
GOOD = '    return a + b\n'
WRONG = 'def add(a, b):\n    return 0\n'
RIGHT = 'def add(a, b):\n    return a + b\n'


def _hostile(tag, host_dir, port):
  """(name, completion, metadata, expected reward) for the corpus."""
  secret = os.path.join(host_dir, 'secret.txt')
  outside = _outside(tag, host_dir)
  repo_file = os.path.join(base.PACKAGE_PARENT, 'verifiers', '__init__.py')
  stdio = {'inputs': ['1 2\n'], 'outputs': ['3\n']}
  return [
      ('comparison object', 'class E:\n    def __eq__(self, o):\n        return True\n'
                            '    __ne__ = lambda self, o: False\n'
                            'def add(a, b):\n    return E()\n', HE, 0.0),
      ('int subclass that equals everything', 'class I(int):\n    def __eq__(self, o):\n'
                                              '        return True\n'
                                              'def add(a, b):\n    return I(0)\n', HE, 0.0),
      ('list subclass', 'class L(list):\n    __eq__ = lambda s, o: True\n'
                        'def add(a, b):\n    return L()\n', HE, 0.0),
      ('fake __class__', 'class F:\n    __class__ = int\n    __eq__ = lambda s, o: True\n'
                         'def add(a, b):\n    return F()\n', HE, 0.0),
      ('patched builtins', 'import builtins\nbuiltins.isinstance = lambda *a: True\n'
                           'builtins.int = type("X", (), {"__eq__": lambda s, o: True})\n'
                           + WRONG, HE, 0.0),
      ('steal a proof from the frames', 'import sys, os\n'
       'f = sys._getframe()\nfound = []\nwhile f is not None:\n'
       '    found += [v for v in f.f_locals.values() if isinstance(v, (str, bytes))]\n'
       '    f = f.f_back\n'
       'for fd in range(3, 64):\n    for v in found:\n        try:\n'
       '            os.write(fd, v if isinstance(v, bytes) else v.encode())\n'
       '        except Exception:\n            pass\n' + WRONG, HE, 0.0),
      ('forge a verdict frame on every descriptor', 'import json, os, struct, glob\n'
       'def frame(o):\n    b = json.dumps(o).encode()\n    return struct.pack(">I", len(b)) + b\n'
       'fakes = [frame({"passed": True}), frame(["v", ["i", "0x5"]]), frame(["v", None])]\n'
       'paths = glob.glob("/proc/[0-9]*/fd/*")\n'
       'for p in paths:\n    try:\n        fd = os.open(p, os.O_WRONLY)\n'
       '        for x in fakes:\n            os.write(fd, x)\n    except OSError:\n'
       '        pass\n'
       'for fd in range(0, 64):\n    for x in fakes:\n        try:\n'
       '            os.write(fd, x)\n        except OSError:\n            pass\n'
       + WRONG, HE, 0.0),
      ('trace the judge', 'import ctypes, os, glob\nlibc = ctypes.CDLL(None, use_errno=True)\n'
       'for p in glob.glob("/proc/[0-9]*"):\n    pid = int(p.rsplit("/", 1)[1])\n'
       '    if pid != os.getpid():\n        assert libc.ptrace(16, pid, 0, 0) == -1\n'
       '        try:\n            open(p + "/mem", "r+b")\n            raise SystemError(p)\n'
       '        except (PermissionError, FileNotFoundError, ProcessLookupError):\n'
       '            pass\n' + RIGHT, HE, 1.0),  # A listed process may exit before it is opened.
      ('answer for the harness by hand', 'import os, sys\n'
       'os.write(4, b"")\n'
       'def add(a, b):\n    return 0\n', HE, 0.0),
      ('return an unencodable giant', 'def add(a, b):\n    x = []\n'
                                      '    for _ in range(10000):\n        x = [x]\n'
                                      '    return x\n', HE, 0.0),
      ('infinite loop', 'def add(a, b):\n    while True:\n        pass\n', HE, 0.0),
      ('fork bomb', 'import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n'
                    '        pass\n', HE, 0.0),
      ('fork limit holds', 'import os, time\nn = 0\ntry:\n    for _ in range(200):\n'
                           '        if os.fork() == 0:\n            time.sleep(60)\n'
                           '            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\n'
                           'assert 0 < n < 16, n\n' + RIGHT, HE, 1.0),
      ('memory bomb', 'blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 26))\n', HE, 0.0),
      ('memory bomb, one allocation', 'x = bytearray(1 << 40)\n' + RIGHT, HE, 0.0),
      ('huge output (stdio)', 'import sys\nwhile True:\n    sys.stdout.write("x" * 65536)\n',
       stdio, 0.0),
      ('huge output (function)', 'import sys\nfor _ in range(10**4):\n    print("y" * 4096)\n'
                                 + RIGHT, HE, 1.0),
      ('write outside the work dir', 'for p in %r:\n    try:\n        open(p, "w").write("x")\n'
                                     '    except OSError:\n        pass\n' % (outside,) + RIGHT,
       HE, 1.0),
      ('read a file outside the sandbox', f'data = open({secret!r}).read()\n' + RIGHT, HE, 0.0),
      ('read the repository', f'data = open({repo_file!r}).read()\n' + RIGHT, HE, 0.0),
      ('read /etc/passwd', 'data = open("/etc/passwd").read()\n' + RIGHT, HE, 0.0),
      ('read /etc/hostname', 'data = open("/etc/hostname").read()\n' + RIGHT, HE, 0.0),
      ('/etc holds only what Python needs', 'import os\n'
       'assert set(os.listdir("/etc")) <= {"ld.so.cache", "localtime"}, os.listdir("/etc")\n'
       + RIGHT, HE, 1.0),
      ('host mount table', 'text = open("/proc/self/mountinfo").read()\n'
       'assert "cgroup" not in text and "/sys" not in text, text\n' + RIGHT,
       HE, 1.0),
      ('user namespace refused', 'import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n'
       'assert libc.unshare(0x10000000 | 0x20000) == -1\n'
       'assert libc.unshare(0x20000) == -1\n' + RIGHT, HE, 1.0),
      ('user namespace, then a big tmpfs', 'import ctypes, os\n'
       'libc = ctypes.CDLL(None, use_errno=True)\n'
       'if libc.unshare(0x10000000 | 0x20000) == 0:\n'
       '    os.makedirs("m", exist_ok=True)\n'
       '    libc.mount(b"none", b"m", b"tmpfs", 0, b"size=2g")\n'
       '    with open("m/big", "wb") as f:\n'
       '        for _ in range(40):\n'
       '            f.write(b"x" * (16 << 20))\n' + WRONG, HE, 0.0),
      ('unshare command', 'import subprocess\n'
       'r = subprocess.run(["unshare", "-Urm", "true"], capture_output=True)\n'
       'assert r.returncode != 0\n' + RIGHT, HE, 1.0),
      ('memory in total over many processes', 'import os, time\nkids = []\n'
       'for _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n'
       '        x = b"x" * (400 << 20)\n        time.sleep(1.5)\n        os._exit(0)\n'
       '    kids.append(pid)\n'
       'assert all(os.waitpid(k, 0)[1] == 0 for k in kids)\n' + RIGHT, HE, 0.0),
      ('read /etc/shadow', 'data = open("/etc/shadow").read()\n' + RIGHT, HE, 0.0),
      ('network to the host', f'import socket\nsocket.create_connection(("127.0.0.1", {port}), '
                              'timeout=2)\n' + RIGHT, HE, 0.0),
      ('network to the internet', 'import socket\nsocket.create_connection(("1.1.1.1", 53), '
                                  'timeout=2)\n' + RIGHT, HE, 0.0),
      ('kill the parent', 'import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n' + RIGHT,
       HE, 0.0),
      ('kill everything', 'import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\n'
                          'except OSError:\n    pass\n' + WRONG, HE, 0.0),
      ('daemon left behind', 'import os, time\nif os.fork() == 0:\n    os.setsid()\n'
                             '    if os.fork() == 0:\n        time.sleep(300)\n    os._exit(0)\n'
                             + RIGHT, HE, 1.0),
      ('recursion bomb', 'import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\n'
                         'f(0)\n', HE, 0.0),
      ('C stack recursion bomb', 'import sys\nsys.setrecursionlimit(10**8)\n'
                                 'def f(n):\n    return list(map(f, [n]))\nf(0)\n', HE, 0.0),
      ('os._exit(0) at import', 'import os\nos._exit(0)\n', HE, 0.0),
      ('close the channel and exit 0', 'import os\nos.close(3)\nos.close(4)\n' + RIGHT,
       HE, 0.0),
      ('os._exit(0) when called', 'import os\ndef add(a, b):\n    os._exit(0)\n', HE, 0.0),
      ('sys.exit(0) before the tests', 'import sys\nsys.exit(0)\n', HE, 0.0),
      ('exit() before the tests', 'exit()\n', HE, 0.0),
      ('patch os._exit and os.write', 'import os\nos._exit = lambda c: None\n'
                                      'os.write = lambda fd, b: len(b)\n' + WRONG, HE, 0.0),
      ('atexit exit(0)', 'import atexit, os\natexit.register(os._exit, 0)\n' + WRONG, HE, 0.0),
      ('exit(0) from a thread', 'import os, threading, time\n'
                                'threading.Thread(target=lambda: (time.sleep(0.05), os._exit(0)))'
                                '.start()\ndef add(a, b):\n    time.sleep(0.5)\n    return 0\n',
       HE, 0.0),
      ('swallow exceptions', 'import sys\nsys.excepthook = lambda *a: None\n' + WRONG, HE, 0.0),
      ('redefine AssertionError', 'import builtins\n'
                                  'builtins.AssertionError = type("E", (Exception,), {})\n'
                                  + WRONG, HE, 0.0),
  ]


def _outside(tag, host_dir):
  """Paths outside the sandbox a candidate must not be able to create."""
  return [os.path.join(host_dir, f'pwned_{tag}'), f'/tmp/pwned_{tag}',
          os.path.join(base.PACKAGE_PARENT, f'pwned_{tag}'),
          os.path.join(os.path.expanduser('~'), f'pwned_{tag}'),
          os.path.join(os.getcwd(), f'pwned_{tag}')]


def _sandbox_uid_processes(uids):
  out = []
  for p in psutil.process_iter(['uids']):
    try:
      if p.info['uids'] and p.info['uids'].real in uids:
        out.append(p.pid)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
      pass
  return out


def test_hostile_corpus_is_contained(tmp_path):
  tag = secrets.token_hex(4)
  (tmp_path / 'secret.txt').write_text('the secret')
  listener = socket.socket()
  listener.bind(('127.0.0.1', 0))
  listener.listen(5)
  listener.setblocking(False)
  port = listener.getsockname()[1]
  corpus = _hostile(tag, str(tmp_path), port)
  # Good samples interleaved with the hostile ones must still score 1.
  samples, expected, names = [], [], []
  for name, completion, md, reward in corpus:
    samples += [verifiers.Sample('p', completion, md), verifiers.Sample('p', GOOD, HE)]
    expected += [reward, 1.0]
    names += [name, 'good']
  me = psutil.Process()
  rss_before = me.memory_info().rss
  with verifiers.get('code', timeout_s=3.0, workers=2) as v:
    assert v.isolation == 'bwrap'
    total_memory_bound = v.sandbox.limits != 'rlimit'
    if not total_memory_bound:  # Then only nproc x memory_mb holds (see verifiers.sandbox).
      expected[names.index('memory in total over many processes')] = 1.0
    start = time.monotonic()
    results = v.score(samples)
    elapsed = time.monotonic() - start
    got = [r.reward for r in results]
    report = [(n, r.reward, r.info.get('reason', '')[-120:]) for n, r in zip(names, results)]
    assert got == expected, "\n".join(map(str, report))
    # Nothing a candidate started survives its run, even before close().
    assert not _sandbox_uid_processes(set(v.sandbox.uids))
    servers = v.sandbox.server_pids
    assert servers
    assert not any(r.info.get('sandbox_error') for n, r in zip(names, results)
                   if n == 'good')
  assert elapsed < 90, elapsed
  # Containment after the batch: no strays, no files, no connection, memory.
  assert not _sandbox_uid_processes(set(v.sandbox.uids))
  assert not [p for p in servers if psutil.pid_exists(p)
              and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
  assert not me.children(recursive=True)
  leaked = [p for p in _outside(tag, str(tmp_path)) if os.path.exists(p)]
  assert not leaked
  with pytest.raises(BlockingIOError):
    listener.accept()
  listener.close()
  # The memory bombs hit their own address-space limit, not the host's memory.
  assert me.memory_info().rss - rss_before < 300 << 20
  # A killed-parent or crashed server was replaced, and the replacement works.
  by_name = dict(zip(names, results))
  assert 'runtime_error' in by_name['read a file outside the sandbox'].info['reason']
  assert by_name['sys.exit(0) before the tests'].info['status'] == 'runtime_error'
  assert by_name['os._exit(0) at import'].info['status'] == 'exited_early'
  assert by_name['close the channel and exit 0'].info['status'] in ('exited_early', 'runtime_error')
  assert by_name['kill the parent'].info['status'] in ('runtime_error', 'sandbox_error')
  if total_memory_bound:
    # The cgroup's OOM killer takes candidate processes (never the server).
    assert by_name['memory in total over many processes'].info['status'] in (
        'runtime_error', 'timeout', 'sandbox_error')
  assert by_name['infinite loop'].info['status'] == 'timeout', by_name['infinite loop'].info['reason']
  assert by_name['recursion bomb'].info['status'] in ('crashed', 'memory_limit', 'timeout')
  assert by_name['C stack recursion bomb'].info['status'] == 'crashed'
  assert by_name['huge output (stdio)'].info['status'] == 'output_limit'
  assert by_name['memory bomb, one allocation'].info['status'] == 'memory_limit'


_POISON = '''
import os
fd = os.open(".", os.O_RDONLY)
for i in range(60):  # 60 x 250 characters: far past PATH_MAX.
    os.mkdir("p" * 250, dir_fd=fd)
    child = os.open("p" * 250, os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = child
with open(os.open("planted.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
    f.write("SECRET")
try:  # Fill the tmpfs from the bottom of the deep tree (files under the 64 MB size limit).
    for k in range(100):
        with open(os.open(f"fill{k}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as f:
            for _ in range(6):
                f.write(b"z" * (8 << 20))
except OSError:
    pass
full = os.statvfs(".").f_bavail < 64
os.fchmod(fd, 0)
os.chmod("p" * 250, 0)
raise SystemError(f"poisoned, tmpfs full: {full}")
'''
_READER = '''
import os, shutil
assert os.listdir(".") == [], os.listdir(".")
assert shutil.disk_usage(".").free > (200 << 20), shutil.disk_usage(".")
with open("probe.bin", "wb") as f:
    f.write(b"y" * (60 << 20))
os.remove("probe.bin")
'''


def test_poisoned_worker_is_cleaned_or_replaced_and_later_samples_score():
  """Paths past PATH_MAX, a full tmpfs and planted files do not reach the next sample."""
  samples = []
  for _ in range(3):
    samples += [verifiers.Sample('p', _POISON, HE),
                verifiers.Sample('p', _READER + RIGHT, HE),
                verifiers.Sample('p', GOOD, HE)]
  with verifiers.get('code', timeout_s=20.0, workers=1) as v:  # One worker: same tmpfs.
    results = v.score(samples)
    report = [(r.reward, r.info['status'], r.info['reason'][-300:]) for r in results]
    assert [r.reward for r in results] == [0.0, 1.0, 1.0] * 3, report
    assert not any(r.info['sandbox_error'] for r in results), report
    assert all('poisoned, tmpfs full: True' in r.info['reason'] for r in results[::3]), report


def test_comparison_objects_do_not_pass_swe_execution():
  repo = {'calc.py': 'def add(a, b):\n    return a - b\n'}
  test = 'from calc import add\nassert add(2, 3) == 5\nassert add(-1, 1) == 0\n'
  md = {'repo': repo, 'test': test}

  def patch(body):
    lines = ''.join(f'+{x}\n' for x in body.splitlines())
    return (f'--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,{len(body.splitlines())} @@\n'
            f'-def add(a, b):\n-    return a - b\n{lines}')
  good = patch('def add(a, b):\n    return a + b')
  eq = patch('class E:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n'
             '    return E()')
  steal = patch('import os\nfor fd in range(64):\n    try:\n'
                '        os.write(fd, b"\\x00\\x00\\x00\\x0f{\\"passed\\":true}")\n'
                '    except OSError:\n        pass\ndef add(a, b):\n    return 0')
  with verifiers.get('swe', execution=True, workers=2, timeout_s=10) as v:
    assert v.isolation == 'bwrap'
    r = v.score([verifiers.Sample('p', x, md) for x in (good, eq, steal, good)])
  assert [x.reward for x in r] == [1.0, 0.0, 0.0, 1.0], [x.info for x in r]


def test_pathological_text_costs_the_trainer_little():
  """Host-side parsing is linear: 300 KB of fences or hunks cost the trainer's process well
  under a second of CPU each.

  The bound is on this process's CPU time, which other jobs on a loaded host do not inflate
  (a wall-clock bound failed once at 3.3 s under CI load for work that takes 0.1 s idle); the
  wall clock is only asked not to hang.
  """
  texts = ['```' * 100_000, '```python\n' * 30_000, ('```python\ndef add(a, b):\n' + ' ' * 50) * 5_000,
           'def add' + ' ' * 300_000 + '(']
  with verifiers.get('code', timeout_s=2.0, workers=2) as v:
    v.score([verifiers.Sample('p', GOOD, HE)])  # Start the workers outside the timing.
    for text in texts:
      start, cpu = time.monotonic(), time.process_time()
      r = v.score([verifiers.Sample('p', text, HE)])
      assert r[0].reward == 0.0
      assert time.process_time() - cpu < 1.0, text[:40]
      assert time.monotonic() - start < 2.0 + 30.0, text[:40]
  repo = {'a.py': '\n'.join(['x'] * 3000)}
  hunks = ''.join('@@ -1,1 +1,2 @@\n x\n+y\n' for _ in range(20_000))
  with verifiers.get('swe', execution=True, workers=1, timeout_s=2.0) as v:
    start, cpu = time.monotonic(), time.process_time()
    r = v.score([verifiers.Sample('p', f'--- a/a.py\n+++ b/a.py\n{hunks}',
                                  {'repo': repo, 'test': 'pass'})])
    assert time.process_time() - cpu < 1.0
    assert time.monotonic() - start < 30.0
    assert r[0].reward == 0.0 and 'too costly' in r[0].info['reason']
