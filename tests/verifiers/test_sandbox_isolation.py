"""What a candidate can read, leave behind or raise: the answer key, other samples, IPC, control flow.

Candidates that know nothing about their task but look for the answer where
the sandbox might leave it: their own frames and callers' frames, every
object `gc` tracks and every readable byte of their own process
(its heap and anonymous mappings, read in place). Each secret below is a fresh random token that only the
hidden test, the expected output or another sample's program holds, so a
candidate that finds one passes (or shows it) and one that does not fails.
Then System V IPC and POSIX message queues (objects of the IPC namespace,
which outlive the process that made them) and control-flow exceptions that
would end a judge's loop early. Runs on the bubblewrap path (see conftest).
"""

import os
import secrets

import pytest

import envs
from foundation import chat
from verifiers import sandbox
import verifiers

pytestmark = pytest.mark.usefixtures('bwrap_sandbox')

S = verifiers.Sample
# Finds every secret ('SECRET-' and 16 hex digits) this process can reach, frames first; the
# pattern is split so that the program text itself never matches.
SNOOP = r'''
import ctypes, gc, re, sys
_PAT = re.compile('SECR' + 'ET-[0-9a-f]{16}')
_BPAT = re.compile(b'SECR' + b'ET-[0-9a-f]{16}')


def _strings(x, depth=0):
    if isinstance(x, str):
        yield x
    elif isinstance(x, (bytes, bytearray)):
        yield bytes(x).decode('latin-1')
    elif depth < 6 and isinstance(x, dict):
        for k, v in list(x.items()):
            yield from _strings(k, depth + 1)
            yield from _strings(v, depth + 1)
    elif depth < 6 and isinstance(x, (list, tuple, set, frozenset)):
        for v in list(x):
            yield from _strings(v, depth + 1)


def snoop():
    found = []
    def add(texts):
        for t in texts:
            if t not in found:
                found.append(t)
    f = sys._getframe()
    while f is not None:
        for v in list(f.f_locals.values()):
            for s in _strings(v):
                add(_PAT.findall(s))
        f = f.f_back
    for o in gc.get_objects():
        for s in _strings(o, 5):
            add(_PAT.findall(s))
    with open('/proc/self/maps') as maps:  # The heap and anonymous memory, read in place.
        regions = [line.split() for line in maps.read().splitlines()]
    for fields in regions:
        if 'r' not in fields[1] or (len(fields) > 5 and fields[5] not in ('[heap]', '[stack]')):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split('-'))
        for at in range(lo, hi, 1 << 24):
            add(m.decode() for m in _BPAT.findall(ctypes.string_at(at, min(hi - at, 1 << 24))))
    return found


HITS = snoop()
'''


def _secret():
  return 'SECRET-' + secrets.token_hex(8)


def _answer_record(secret):
  """A HumanEval-shaped task whose only answer is a list holding `secret`."""
  return {'prompt': 'def answer():\n    """The list of secrets."""\n',
          'test': f'def check(candidate):\n    assert {secret!r} in candidate()\n',
          'entry_point': 'answer'}


def test_code_candidates_cannot_read_the_answer_key_or_other_samples():
  """check and stdio: frames, gc and /proc/self/mem hold neither this nor another sample's key."""
  keys = [_secret() for _ in range(4)]
  honest = S('p', f'def answer():\n    return [{keys[0]!r}]\n', _answer_record(keys[0]))
  snoop_check = S('p', SNOOP + 'def answer():\n    return HITS\n', _answer_record(keys[1]))
  stdio = {'inputs': ['1\n'], 'outputs': [keys[2] + '\n']}
  snoop_stdio = S('p', SNOOP + 'print(HITS[0] if HITS else "")\n', stdio)
  # The key of an earlier sample (the honest program above) is no help either.
  snoop_other = S('p', SNOOP + 'def answer():\n    return HITS\n', _answer_record(keys[0]))
  honest_stdio = S('p', f'print({keys[3]!r})\n', {'inputs': ['1\n'], 'outputs': [keys[3] + '\n']})
  with verifiers.get('code', workers=1, timeout_s=10.0) as v:
    results = v.score([honest, snoop_check, snoop_stdio, snoop_other, honest_stdio])
  report = [(r.reward, r.info['reason'][-200:]) for r in results]
  assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0, 1.0], report


def _calc_patch(body):
  lines = ''.join(f'+{x}\n' for x in body.splitlines())
  return (f'--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,{len(body.splitlines())} @@\n'
          f'-def answer():\n-    return None\n{lines}')


def test_swe_patch_cannot_read_the_hidden_test():
  key = _secret()
  md = {'repo': {'calc.py': 'def answer():\n    return None\n'},
        'test': f'from calc import answer\nassert {key!r} in answer()\n'}
  honest = _calc_patch(f'def answer():\n    return [{key!r}]')
  snoop = _calc_patch(SNOOP + 'def answer():\n    return HITS')
  with verifiers.get('swe', execution=True, workers=1, timeout_s=10) as v:
    r = v.score([S('p', x, md) for x in (honest, snoop)])
  assert [x.reward for x in r] == [1.0, 0.0], [x.info for x in r]


def test_agentic_swe_neither_run_tests_nor_scoring_sees_a_hidden_test():
  """run_tests shows the candidate's stderr, yet no hidden test (its own or another's) is in it."""
  victim_key, own_key = _secret(), _secret()
  repo = {'calc.py': 'def answer():\n    return None\n'}

  def record(key):
    return {'id': 'r', 'domain': 'swe_agent',
            'metadata': {'repo': repo, 'test': f'from calc import answer\nassert {key!r} in answer()\n',
                         'visible_test': 'from calc import answer\nassert answer() is None\n'},
            'messages': [{'role': 'user', 'content': 'Make answer() return the secrets.'}]}

  def call(name, **arguments):
    return chat.render_tool_call(name, arguments)

  module = SNOOP + 'print("HITS", HITS, file=sys.stderr)\ndef answer():\n    return HITS\n'
  with envs.get('swe_agent', workers=1, timeout_s=10) as env:
    victim, attacker = env.reset([record(victim_key), record(own_key)])
    env.step([victim], [call('edit', path='calc.py', old='return None', new='return []')])
    assert env.step([victim], ['done'])[0].reward == 0.0  # Its hidden test ran: the key was sent.
    env.step([attacker], [call('edit', path='calc.py', old='def answer():\n    return None\n',
                               new=module)])
    (step,) = env.step([attacker], [call('run_tests')])
    shown = step.messages[0]['content']
    assert 'HITS' in shown, shown  # The candidate's stderr reaches the policy...
    assert victim_key not in shown and own_key not in shown, shown  # ...but no hidden test.
    (final,) = env.step([attacker], ['done'])
  assert final.reward == 0.0, final.info


def test_run_mode_cannot_see_other_episodes_programs():
  """Tool use's python calls: a program's text never reaches a later program on the same server."""
  key = _secret()
  victim = {'mode': 'run', 'program': f'note = {key!r}\nprint("ok")\n' + '# padding\n' * 100}
  snoop = {'mode': 'run', 'program': SNOOP + 'print(HITS)\n'}
  with sandbox.Sandbox(1) as sb:
    first = sb.run([victim, snoop], [10.0, 10.0])
    later = sb.run([snoop], [10.0])
  assert first[0]['stdout'] == 'ok\n'
  for ans in (first[1], later[0]):
    assert ans['passed'], ans
    assert ans['stdout'] == '[]\n', ans['stdout']


_IPC = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
KEY = 0x5ca1ab1e
made = {
    'shm': libc.shmget(KEY, 64 << 20, 0o1666),
    'sem': libc.semget(KEY, 4, 0o1666),
    'msg': libc.msgget(KEY, 0o1666),
    'mq': libc.mq_open(b'/cascade-leftover', os.O_CREAT | os.O_RDWR, 0o666, None),
}
'''
# Every call refused (EPERM), so nothing is left for a later sample.
_REFUSED = _IPC + ('assert all(v == -1 for v in made.values()), made\n'
                   'assert ctypes.get_errno() == 1\n')
# A leaver fills and keeps what it can; the IPC namespace holds it after the run.
_LEAVER = _IPC + (
    'if made["shm"] >= 0:\n'
    '    libc.shmat.restype = ctypes.c_void_p\n'
    '    at = libc.shmat(made["shm"], None, 0)\n'
    '    ctypes.memset(at, 120, 64 << 20)\n'
    '    libc.shmdt(ctypes.c_void_p(at))\n')
# A later sample whose score depends on what earlier ones left.
_READER = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for kind in ('shm', 'sem', 'msg'):
    with open(f'/proc/sysvipc/{kind}') as f:
        assert len(f.read().splitlines()) == 1, kind
assert libc.shmget(0x5ca1ab1e, 0, 0) == -1
assert libc.mq_open(b'/cascade-leftover', os.O_RDONLY) == -1
'''
_ADD = {'prompt': 'def add(a, b):\n    """Adds two numbers."""\n',
        'test': 'def check(candidate):\n    assert candidate(2, 3) == 5\n', 'entry_point': 'add'}
_RIGHT = 'def add(a, b):\n    return a + b\n'
_WRONG = 'def add(a, b):\n    return a - b\n'


def test_ipc_objects_are_refused_and_change_no_later_score():
  samples = [S('p', _REFUSED + _RIGHT, _ADD), S('p', _LEAVER + _RIGHT, _ADD),
             S('p', _READER + _RIGHT, _ADD), S('p', _RIGHT, _ADD)]
  with verifiers.get('code', workers=1, timeout_s=10.0) as v:  # One worker: one IPC namespace.
    results = v.score(samples)
  report = [(r.reward, r.info['reason'][-300:]) for r in results]
  assert [r.reward for r in results] == [1.0] * 4, report
  assert not any(r.info['sandbox_error'] for r in results), report


# A sample that tries to leave state for the next one: extended attributes, a default ACL (mode
# 000 for every file made later in the directory), times and modes on every path it can name
# outside its own files, an flock and an abstract socket name held by descriptors in flight in
# a unix socket's queue (SCM_RIGHTS: they outlive their process until the kernel's garbage
# collection), a TCP TIME_WAIT, other processes' limits and priority (the spare, forked ahead,
# is the next sample's process where candidates share the server's uid), and timers. Each try
# may fail: what it does not manage is what the sandbox refused.
LEAVER = r"""
import fcntl, os, resource, signal, socket, struct, time
TOKEN = b'LEFT-' + b'7' * 16
ACL = struct.pack('<I', 2) + b''.join(struct.pack('<HHI', t, 0, 0xFFFFFFFF) for t in (1, 4, 32))


def attempt(call, *args):
    try:
        call(*args)
    except (OSError, ValueError):
        pass


for path in ('.', '/tmp', '/tmp/.io', '/dev', '/dev/null', '/dev/pts', '/dev/pts/ptmx',
             '/proc/self/fd/1'):
    attempt(os.setxattr, path, 'user.left', TOKEN)
    attempt(os.setxattr, path, 'system.posix_acl_default', ACL)
    attempt(os.setxattr, path, 'system.posix_acl_access', ACL)
    attempt(os.utime, path)
    attempt(os.utime, path, (1, 2))
    attempt(os.chmod, path, 0o700)
try:
    a, b = socket.socketpair()
    lock = os.open(os.__file__, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    name = socket.socket(socket.AF_UNIX)
    name.bind(b'\0cascade-left')
    socket.send_fds(b, [b'x'], [a.fileno(), lock, name.fileno()])
except OSError:
    pass
try:
    server = socket.create_server(('127.0.0.1', 0))
    client = socket.create_connection(server.getsockname())
    server.accept()[0].close()
    client.close()  # The side that closes first keeps the connection in TIME_WAIT.
except OSError:
    pass
for pid in [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:
    attempt(resource.prlimit, pid, resource.RLIMIT_MSGQUEUE, (12345, 12345))
    attempt(os.setpriority, os.PRIO_PROCESS, pid, 7)
attempt(os.setpriority, os.PRIO_USER, os.getuid(), 7)
if os.fork() == 0:  # A child with a timer (alarm's), killed with the sample.
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    time.sleep(30)
"""
# A later sample that looks for all of it (and outlives the leaver's timers); it raises, and so
# fails, if it finds any.
READER = r"""
import fcntl, os, resource, socket, stat, time
found = []
for path in ('.', '/tmp', '/tmp/.io', '/dev', '/dev/null', '/dev/pts', '/dev/pts/ptmx'):
    try:
        names = os.listxattr(path)
    except OSError:
        names = []
    if names:
        found.append((path, names))
st = os.stat('.')
if stat.S_IMODE(st.st_mode) != 0o755 or min(st.st_atime, st.st_mtime) < time.time() - 60:
    found.append(('work dir mode or times', oct(st.st_mode), st.st_atime, st.st_mtime))
with open('probe.txt', 'w') as f:
    f.write('x')
if stat.S_IMODE(os.stat('probe.txt').st_mode) != 0o644:
    found.append(('mode of a new file', oct(os.stat('probe.txt').st_mode)))
try:
    fcntl.flock(os.open(os.__file__, os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    found.append('a lock')
try:
    socket.socket(socket.AF_UNIX).bind(b'\0cascade-left')
except OSError:
    found.append('an abstract socket name')
for table in ('tcp', 'tcp6'):
    with open(f'/proc/net/{table}') as f:
        if f.read().splitlines()[1:]:
            found.append(f'a {table} socket')
if resource.getrlimit(resource.RLIMIT_MSGQUEUE) == (12345, 12345):
    found.append('a limit')
if os.getpriority(os.PRIO_PROCESS, 0) == 7:
    found.append('a priority')
time.sleep(0.4)  # Past the leaver's timer.
assert not found, found
"""


def test_nothing_a_sample_leaves_reaches_the_next():
  """On one worker: a sample that tries to leave state for its successor gets nothing through,
  and the next samples (one that looks for it, a plain right one) score as they would alone."""
  host_null = os.stat('/dev/null')
  samples = [S('p', LEAVER + _WRONG, _ADD), S('p', READER + _RIGHT, _ADD), S('p', _RIGHT, _ADD)]
  with verifiers.get('code', workers=1, timeout_s=10.0) as v:
    results = v.score(samples)
  report = [(r.reward, r.info['reason'][-400:]) for r in results]
  assert [r.reward for r in results] == [0.0, 1.0, 1.0], report
  assert not any(r.info['sandbox_error'] for r in results), report
  # /dev/null is the host's own node: its times are no channel either (to any sample anywhere).
  assert os.stat('/dev/null').st_mtime_ns == host_null.st_mtime_ns


# What a sample reads of the kernel's counters without moving them: the PID namespace's last pid
# (its next thread's or child's is the one after), its own pid and the inode number of its work
# dir (a new file's is the one after). It waits first, so that the spare the server asks for
# meanwhile is forked.
_COUNTERS = r"""
import os, time
time.sleep(0.1)
with open('/proc/sys/kernel/ns_last_pid') as f:
    print(f.read().strip(), os.getpid(), os.stat('.').st_ino)
"""


def _counter_mover(k):
  """A sample that makes k files and k threads: it moves both counters by k."""
  return (f'import threading\nfor i in range({k}):\n    open(f"f{{i}}", "w").close()\n'
          '    t = threading.Thread(target=lambda: None)\n    t.start()\n    t.join()\n')


def test_the_next_sample_cannot_count_what_the_last_one_made():
  """The next pid and the next inode number outlive every sample and cannot be reset: a sample that
  moves them (makes processes, threads or files) gets its server replaced, so what the next one
  reads of them does not depend on how far it moved them; one that does not keeps its server."""
  runs = [_counter_mover(3), _COUNTERS, _counter_mover(40), _COUNTERS]
  with sandbox.Sandbox(1) as sb:
    res = sb.run([{'mode': 'run', 'program': p} for p in runs], [10.0] * len(runs))
  assert all(r['passed'] for r in res), res
  assert res[1]['stdout'] == res[3]['stdout'], (res[1]['stdout'], res[3]['stdout'])
  assert [r['restart'] for r in res] == [True, False, True, False], res


def test_a_default_acl_left_by_a_patch_changes_no_later_score():
  """SWE execution on one worker: a patch that sets a default ACL on its work dir (which made
  every file the harness wrote there later mode 000) scores on its own merit, and right patches
  after it still score 1."""
  md = {'repo': {'calc.py': 'def answer():\n    return None\n'},
        'test': 'from calc import answer\nassert answer() == 42\n'}
  poison = ('import os, struct\ntry:\n    os.setxattr(".", "system.posix_acl_default", '
            'struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, 0, 0xFFFFFFFF) '
            'for t in (1, 4, 32)))\nexcept OSError:\n    pass\n')
  right, wrong = 'def answer():\n    return 42', 'def answer():\n    return 41'
  patches = [poison + wrong, right, poison + right, right]
  with verifiers.get('swe', execution=True, workers=1, timeout_s=10) as v:
    r = v.score([S('p', _calc_patch(x), md) for x in patches])
  assert [x.reward for x in r] == [0.0, 1.0, 1.0, 1.0], [x.info['reason'][-300:] for x in r]


def _control_flow_cases():
  """(name, completion, test): each test passes if the exception reaches it as raised."""
  cases = []
  for name in ('StopIteration', 'StopAsyncIteration', 'GeneratorExit', 'KeyboardInterrupt',
               'SystemExit'):
    cases.append((f'{name} caught by the test', f'def inc(x):\n    raise {name}\n',
                  f'def check(candidate):\n    try:\n        candidate(1)\n'
                  f'    except {name}:\n        return\n    assert False\n'))
  return cases + [
      ('StopIteration ends a map() loop', 'def inc(x):\n    raise StopIteration\n',
       'def check(candidate):\n    for got, want in zip(map(candidate, [1, 2]), [2, 3]):\n'
       '        assert got == want\n'),
      ('StopIteration ends iter(candidate, sentinel)', 'def inc(x=0):\n    raise StopIteration\n',
       'def check(candidate):\n    for got in iter(candidate, None):\n        assert False\n'),
      ('StopIteration from a method of a returned object',
       'class It:\n    def step(self):\n        raise StopIteration\n'
       'def inc(x):\n    return It()\n',
       'def check(candidate):\n    it = candidate(1)\n'
       '    for got in iter(it.step, None):\n        assert False\n'),
      ('StopIteration from __len__ through the proxy',
       'class L:\n    def __len__(self):\n        raise StopIteration\n'
       'def inc(x):\n    return L()\n',
       'def check(candidate):\n    for n in map(len, [candidate(1)]):\n        assert n == 2\n'),
  ]


@pytest.fixture(scope='module')
def code_verifier():
  with verifiers.get('code', workers=1, timeout_s=10.0) as v:
    yield v


@pytest.mark.parametrize('completion,test', [c[1:] for c in _control_flow_cases()],
                         ids=[c[0] for c in _control_flow_cases()])
def test_control_flow_exceptions_from_the_candidate_fail(code_verifier, completion, test):
  md = {'prompt': 'def inc(x):\n    """x + 1."""\n', 'test': test, 'entry_point': 'inc'}
  (r,) = code_verifier.score([S('p', completion, md)])
  assert r.reward == 0.0, r.info
