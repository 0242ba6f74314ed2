"""One writer per workdir: the lock refuses a second run naming its holder, is taken over from a
holder that is gone or when forced, notices a takeover, and is released however the run ends."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from cascade import lock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plant(workdir, **fields):
  """A lock record as another run would leave it (defaults: a live run on another host)."""
  now = time.time()
  rec = dict(owner='theirs', host='other-host', pid=4242, since=now - 60, heartbeat=now, **{})
  rec.update(fields)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, lock.LOCK_FILE), 'w') as f:
    json.dump(rec, f)
  return rec


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
  held = lock.take(str(tmp_path))
  try:
    with pytest.raises(lock.WorkdirBusy) as e:
      lock.take(str(tmp_path))
    msg = str(e.value)
    assert '\n' not in msg and 'in use by another run' in msg
    assert f'host {socket.gethostname()}, pid {os.getpid()}, since ' in msg
    assert '--force_lock' in msg
  finally:
    held.release()
  assert not (tmp_path / lock.LOCK_FILE).exists()
  lock.take(str(tmp_path)).release()                # free again once released


def test_a_stale_or_dead_holder_is_taken_over_and_force_overrides(tmp_path, capsys):
  _plant(tmp_path, heartbeat=time.time() - 1000)    # another host, silent for 1000 s
  held = lock.take(str(tmp_path), stale_s=600)
  assert 'taking over the workdir lock of host other-host, pid 4242' in capsys.readouterr().out
  rec = json.loads((tmp_path / lock.LOCK_FILE).read_text())
  assert rec['pid'] == os.getpid() and rec['host'] == socket.gethostname()
  held.release()

  dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'],
                        capture_output=True, text=True, check=True)
  _plant(tmp_path, host=socket.gethostname(), pid=int(dead.stdout))   # killed (SIGKILL) here
  lock.take(str(tmp_path)).release()
  assert 'its process is gone' in capsys.readouterr().out

  _plant(tmp_path)                                   # alive and beating: refused ...
  with pytest.raises(lock.WorkdirBusy, match='host other-host, pid 4242'):
    lock.take(str(tmp_path))
  lock.take(str(tmp_path), force=True).release()     # ... unless forced
  assert 'asked to (--force_lock)' in capsys.readouterr().out


def _next_beat(path, after, timeout=10.0):
  """The lock record once its heartbeat has moved past `after` (the holder just wrote it)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    rec = json.loads(path.read_text())
    if rec.get('heartbeat', 0) > after:
      return rec
    time.sleep(0.01)
  pytest.fail('the heartbeat did not advance')


def test_a_takeover_is_noticed_before_the_next_write(tmp_path):
  held = lock.take(str(tmp_path), stale_s=600)      # beats every 30 s: none during this test
  path = tmp_path / lock.LOCK_FILE
  held.check()                                       # ours: a write may go ahead
  _plant(tmp_path)                                   # another run takes it over (--force_lock)
  # The very next check (each write makes one) rereads the record: no heartbeat is waited for.
  with pytest.raises(lock.WorkdirBusy, match=r'another run took this workdir over \(host '
                                             r'other-host, pid 4242.*stopped before writing more'):
    held.check()
  assert held.lost
  held.release()
  assert json.loads(path.read_text())['owner'] == 'theirs'   # not ours, not removed
  # The first half of a takeover (the record removed, the new one not yet made) stops it too.
  held = lock.take(str(tmp_path), force=True)
  path.unlink()
  with pytest.raises(lock.WorkdirBusy):
    held.check()
  held.release()
  assert not path.exists()


def test_a_takeover_is_noticed_by_the_heartbeat(tmp_path, capsys):
  held = lock.take(str(tmp_path), stale_s=2.0)      # beats every 0.5 s
  path = tmp_path / lock.LOCK_FILE
  rec = _next_beat(path, json.loads(path.read_text())['heartbeat'])
  held.check()
  # Another run takes the lock over. It plants its record just after one of this run's beats,
  # so the holder's next beat reads it. (A beat that read the old record before the plant and
  # writes after it overwrites the plant: the documented race in which the newcomer is the one
  # that stops. On a loaded host that can happen here; the plant is then repeated.)
  for _ in range(5):
    _plant(tmp_path)
    deadline = time.time() + 5
    while time.time() < deadline and not held.lost:          # no check: the heartbeat's own
      if json.loads(path.read_text())['owner'] != 'theirs':   # overwritten by that race
        break
      time.sleep(0.05)
    if held.lost:
      break
    if time.time() >= deadline:
      pytest.fail('the takeover went unnoticed')
    rec = _next_beat(path, rec['heartbeat'])
  else:
    pytest.fail('every plant was overwritten by a racing beat')
  with pytest.raises(lock.WorkdirBusy, match='another run took this workdir over'):
    held.check()
  time.sleep(0.6)                                    # a beat's time: it writes no more
  assert json.loads(path.read_text())['owner'] == 'theirs'
  held.release()
  assert json.loads(path.read_text())['owner'] == 'theirs'   # not ours
  assert 'belongs to another run' in capsys.readouterr().out


def test_the_lock_is_released_when_the_run_fails(tmp_path):
  import ml_collections  # pylint: disable=g-import-not-at-top
  from cascade import checkpoint  # pylint: disable=g-import-not-at-top
  from cascade import runner  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(REPO, 'configs'))
  import tiny  # pylint: disable=g-import-not-at-top
  c = tiny.get_config('smoke')
  checkpoint.guard_config(str(tmp_path), ml_collections.ConfigDict({'seed': 99}))
  checkpoint.Progress(str(tmp_path)).mark_done('sft', {'index': 0})   # that run took its steps
  with pytest.raises(checkpoint.WorkdirError, match='different config'):
    runner.run(c, str(tmp_path))
  assert not (tmp_path / lock.LOCK_FILE).exists()


def test_the_command_line_refuses_a_held_workdir_in_one_line(tmp_path):
  rec = _plant(tmp_path / 'w')
  proc = subprocess.run(
      [sys.executable, '-m', 'cascade.main', '--config=configs/tiny.py:smoke',
       f'--workdir={tmp_path / "w"}'], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f'error: {tmp_path / "w"} is in use by another '
                                                 'run: host other-host, pid 4242, since '), lines
  assert os.listdir(tmp_path / 'w') == [lock.LOCK_FILE]               # nothing written
  assert json.loads((tmp_path / 'w' / lock.LOCK_FILE).read_text()) == rec
  # --force_lock takes the lock over (with a warning) even from a live holder: here the run
  # then stops at the workdir's config guard (its config.json is not one a run wrote), in one
  # line, releasing the lock.
  (tmp_path / 'w' / 'config.json').write_text(json.dumps({'seed': -1}))
  proc = subprocess.run(
      [sys.executable, '-m', 'cascade.main', '--config=configs/tiny.py:smoke',
       f'--workdir={tmp_path / "w"}', '--force_lock'], cwd=REPO, capture_output=True,
      text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert 'taking over the workdir lock of host other-host' in proc.stdout
  assert len(proc.stderr.strip().splitlines()) == 1 and 'config.json' in proc.stderr
  assert not (tmp_path / 'w' / lock.LOCK_FILE).exists()


def _snapshot(root):
  """Every file and directory under `root`: relative path -> (size, mtime in ns), or None for
  a directory."""
  out = {}
  for d, dirs, files in os.walk(root):
    for name in dirs:
      out[os.path.relpath(os.path.join(d, name), root)] = None
    for name in files:
      st = os.stat(os.path.join(d, name))
      out[os.path.relpath(os.path.join(d, name), root)] = (st.st_size, st.st_mtime_ns)
  return out


@pytest.mark.heavy
def test_a_run_whose_lock_is_taken_over_writes_nothing_more(tmp_path, copy_cascade, monkeypatch):
  from cascade import runner  # pylint: disable=g-import-not-at-top
  from cascade.kinds import loop  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location('cfg', copy_cascade(
      tmp_path, train=16, eval_=8, sft=32, sft_steps=4, rl_steps=2))
  cfg = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cfg)
  work = tmp_path / 'run'
  seen = {}

  def take_over(stage, step, saved, ckpts):
    del saved
    if (stage, step) == ('sft', 2):
      ckpts.wait()                           # none of this run's writes is still under way
      (work / lock.LOCK_FILE).unlink()       # --force_lock of a live run elsewhere: the record
      _plant(work)                           # removed, then the new run's own made
      seen['files'] = _snapshot(work)

  # Every step of this config checkpoints and logs: the run would write at once.
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [take_over])
  with pytest.raises(lock.WorkdirBusy, match=r'another run took this workdir over \(host '
                                             r'other-host, pid 4242'):
    runner.run(cfg.get_config(), str(work))
  assert seen and _snapshot(work) == seen['files']   # not one byte, file or directory more
  assert json.loads((work / lock.LOCK_FILE).read_text())['owner'] == 'theirs'
