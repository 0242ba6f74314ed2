"""A workdir that fills up: one line naming it, and the same command resumes once there is room.

The disk fills at a different write depending on its size: at 300 KB early (the first
TensorBoard events, compiled programs, metric lines), at 600 KB inside Orbax's asynchronous save
of the first checkpoint (its threads and event loop fail first). Either way stderr holds that
one line and nothing else (progress bars aside): no traceback, no library error log."""

import errno
import logging
import os
import shutil
import subprocess
import sys

import pytest

from cascade import exits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mount(target, size):
  return subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(target)],
                        capture_output=True, text=True)


def _record(msg, path='/x/cascade/y.py', exc=None, level=logging.ERROR):
  return logging.LogRecord('absl', level, path, 1, msg, None,
                           (type(exc), exc, None) if exc is not None else None)


def test_what_libraries_log_about_a_full_disk_is_dropped_and_nothing_else():
  quiet = exits.QuietStorageErrors()
  orbax = '/venv/site-packages/orbax/checkpoint/checkpoint_manager.py'
  assert quiet.filter(_record('Save Finalize thread (save_finalize) failed.', orbax))
  # Orbax's save threads and event loop: the error (as text, or as an exception with its
  # traceback), then every report that the save failed because of it.
  assert not quiet.filter(_record('_SignalingThread.run() raised an exception: RESOURCE_EXHAUSTED:'
                                  ' Error writing "params" in OCDBT database', orbax))
  assert not quiet.filter(_record('Task exception was never retrieved',
                                  exc=OSError(errno.ENOSPC, 'No space left on device')))
  assert not quiet.filter(_record('Save Finalize thread (save_finalize) failed.', orbax))
  # Anything else still shows.
  assert quiet.filter(_record('Save Finalize thread (save_finalize) failed.', orbax,
                              level=logging.WARNING))
  assert quiet.filter(_record('unrelated failure', '/venv/site-packages/jax/x.py'))
  assert quiet.filter(_record('no such file', exc=FileNotFoundError(errno.ENOENT, 'gone')))


@pytest.mark.slow
@pytest.mark.parametrize('size', ['300k', '600k'])
def test_full_disk_is_one_line_and_the_rerun_resumes(tmp_path, copy_cascade, size):
  if os.geteuid() != 0 or shutil.which('mount') is None:
    pytest.skip('needs root to mount a small tmpfs as the workdir')
  disk = tmp_path / 'disk'
  disk.mkdir()
  if _mount(disk, size).returncode:
    pytest.skip('cannot mount a tmpfs here (no mount permission in this container)')
  try:
    path = copy_cascade(tmp_path, train=16, eval_=8, sft=32, sft_steps=4, rl_steps=2)
    cmd = [sys.executable, '-m', 'cascade.main', f'--config={path}',
           f'--workdir={disk / "run"}', '--verbosity=-1']
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [l for l in proc.stderr.replace('\r', '\n').splitlines() if l.strip() and '|' not in l]
    assert len(err) == 1, proc.stderr[-3000:]         # the one line, on a line of its own
    assert err[0].startswith(f'error: {disk / "run"}') and 'No space left' in err[0], err
    subprocess.run(['mount', '-o', 'remount,size=256m', str(disk)], check=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (disk / 'run' / 'results.json').exists()
  finally:
    subprocess.run(['umount', '-l', str(disk)], capture_output=True)
