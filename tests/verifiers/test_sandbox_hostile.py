"""Hostile candidates: each is contained while the rest of its batch is scored correctly."""

import os
import secrets
import socket
import time

import psutil
import pytest

import verifiers
from verifiers import sandbox

pytestmark = pytest.mark.skipif(sandbox.probe_bwrap('bwrap') != '', reason='needs bubblewrap')

PROMPT = 'def add(a, b):\n    """Adds two numbers."""\n'
TEST = 'def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n'
HE = {'prompt': PROMPT, 'test': TEST, 'entry_point': 'add'}
GOOD = '    return a + b\n'
WRONG = 'def add(a, b):\n    return 0\n'
RIGHT = 'def add(a, b):\n    return a + b\n'


def _hostile(tag, host_dir, port):
  """(name, completion, metadata, expected reward) for the corpus."""
  secret = os.path.join(host_dir, 'secret.txt')
  outside = [os.path.join(host_dir, f'pwned_{tag}'), f'/tmp/pwned_{tag}',
             f'/work/pwned_{tag}', f'/root/pwned_{tag}', os.path.join(os.getcwd(), f'pwned_{tag}')]
  stdio = {'inputs': ['1 2\n'], 'outputs': ['3\n']}
  return [
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
      ('read the repository', 'data = open("/work/main/setup.py").read()\n' + RIGHT, HE, 0.0),
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
  with verifiers.get('code', timeout_s=3.0, workers=2, strict_isolation=True) as v:
    assert v.sandbox.isolation == 'bwrap'
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
  assert elapsed < 60, elapsed
  # Containment after the batch: no strays, no files, no connection, memory.
  assert not _sandbox_uid_processes(set(v.sandbox.uids))
  assert not [p for p in servers if psutil.pid_exists(p)
              and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
  assert not me.children(recursive=True)
  leaked = [p for p in (tmp_path / f'pwned_{tag}', f'/tmp/pwned_{tag}', f'/work/pwned_{tag}',
                        f'/root/pwned_{tag}', os.path.join(os.getcwd(), f'pwned_{tag}'))
            if os.path.exists(p)]
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
  assert by_name['os._exit(0) at import'].info['status'] == 'no_completion_proof'
  assert by_name['infinite loop'].info['status'] == 'timeout'
  assert by_name['recursion bomb'].info['status'] in ('crashed', 'memory_limit', 'timeout')
  assert by_name['C stack recursion bomb'].info['status'] == 'crashed'
  assert by_name['huge output (stdio)'].info['status'] == 'output_limit'
  assert by_name['memory bomb, one allocation'].info['status'] == 'memory_limit'
