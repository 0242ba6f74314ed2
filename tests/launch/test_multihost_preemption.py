"""Preemption on two hosts: a SIGTERM to one process stops both at the same step boundary, with
one collective checkpoint, and the rerun resumes both there and ends as an uninterrupted run.

Two local JAX processes (4 CPU devices each, gloo) run the command line on one (2, 2, 2) mesh
over a shared workdir, an SFT stage of 4 steps checkpointed only at its end. Process 1 alone is
sent SIGTERM at the end of step 2 (tests/faults.py's `--signal_at` hook); the stop flag
all-gathered at each step boundary stops process 0 there too.

Marked slow: three two-process runs compiling on a shared 2-core machine take minutes.
"""

import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(REPO, 'tests', 'faults.py')   # cascade.main with a test's signal hook


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def config(tmp_path_factory, copy_cascade, derived_config):
  root = tmp_path_factory.mktemp('multihost_preemption')
  copy_cascade(root, train=16, eval_=8, sft=32, mesh_shape=(2, 2, 2), keep=2, sft_steps=4,
               rl_steps=1)
  (root / 'sft_only.py').write_text(derived_config(
      '  c.stages = c.stages[:1]\n  c.ckpt.every_n_steps = 0\n'))
  return root / 'sft_only.py'


def _run_two(config, workdir, signal_at=None):
  """Both processes of one run; `signal_at`: process -> its `--signal_at` hook. Returns
  [(exit status, stdout, stderr)] by process."""
  coordinator = f'127.0.0.1:{_free_port()}'
  procs = []
  for i in range(2):
    env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO, JAX_COORDINATOR_ADDRESS=coordinator,
               JAX_NUM_PROCESSES='2', JAX_PROCESS_ID=str(i),
               XLA_FLAGS='--xla_force_host_platform_device_count=4')
    main = ([FAULTS, f'--signal_at={signal_at[i]}'] if signal_at and i in signal_at
            else ['-m', 'cascade.main'])
    procs.append(subprocess.Popen(
        [sys.executable, *main, f'--config={config}', f'--workdir={workdir}', '--verbosity=-1'],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  out = []
  try:
    for p in procs:
      o, e = p.communicate(timeout=500)
      out.append((p.returncode, o, e))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return out


def _last_line(stderr):
  return [l for l in stderr.replace('\r', '\n').splitlines() if l.strip() and '|' not in l][-1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_one_host_stops_both_at_the_same_step_and_they_resume_identically(
    config, tmp_path):
  work = tmp_path / 'run'
  stopped = _run_two(config, work, signal_at={1: 'sft:2:SIGTERM'})
  assert [c for c, _, _ in stopped] == [75, 75], '\n'.join(e[-3000:] for _, _, e in stopped)
  assert _last_line(stopped[0][2]) == ("a signal to process 1: stopped at stage 0 'sft' step "
                                       '2/4, checkpoint saved; rerun the same command to resume '
                                       'there')
  assert _last_line(stopped[1][2]).startswith("SIGTERM: stopped at stage 0 'sft' step 2/4")
  assert all('Traceback' not in e for _, _, e in stopped)
  assert sorted(os.listdir(work / 'stages' / '00_sft' / 'ckpt')) == ['2']

  resumed = _run_two(config, work)
  assert [c for c, _, _ in resumed] == [0, 0], '\n'.join(e[-3000:] for _, _, e in resumed)
  assert all('[0] sft: resuming at step 2/4' in o for _, o, _ in resumed)

  reference = tmp_path / 'reference'
  assert [c for c, _, _ in _run_two(config, reference)] == [0, 0]
  export = lambda w: (w / 'stages' / '00_sft' / 'hf' / 'model.safetensors').read_bytes()
  assert export(work) == export(reference)
