"""A workdir that fills up: one line naming it, and the same command resumes once there is room."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mount(target, size):
  return subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(target)],
                        capture_output=True, text=True)


@pytest.mark.slow
def test_full_disk_is_one_line_and_the_rerun_resumes(tmp_path, copy_cascade):
  if os.geteuid() != 0 or shutil.which('mount') is None:
    pytest.skip('needs root to mount a small tmpfs as the workdir')
  disk = tmp_path / 'disk'
  disk.mkdir()
  if _mount(disk, '300k').returncode:
    pytest.skip('cannot mount a tmpfs here (no mount permission in this container)')
  try:
    path = copy_cascade(tmp_path, train=16, eval_=8, sft=32, sft_steps=4, rl_steps=2)
    cmd = [sys.executable, '-m', 'cascade.main', f'--config={path}',
           f'--workdir={disk / "run"}', '--verbosity=-1']
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith(f'error: {disk / "run"}: ') and (
        'No space left' in err[-1] or 'RESOURCE_EXHAUSTED' in err[-1]), err[-3:]
    assert 'Traceback' not in proc.stderr and len(err) < 8, proc.stderr
    subprocess.run(['mount', '-o', 'remount,size=256m', str(disk)], check=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (disk / 'run' / 'results.json').exists()
  finally:
    subprocess.run(['umount', '-l', str(disk)], capture_output=True)
