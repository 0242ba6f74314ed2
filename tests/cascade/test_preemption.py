"""Preemption: SIGTERM and SIGINT stop a run at the next step boundary with a checkpoint, in one
line with exit status 75, and the same command resumes at that step (not the stage's start).

The stage here checkpoints only at its end (`ckpt.every_n_steps=0`, as the tiny configs nearly
do), so a resume at the signalled step shows the signal's own checkpoint. The end-to-end tests
run the command line on the toy copy cascade (heavy: each compiles a run).
"""

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from cascade import preemption

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(REPO, 'tests', 'faults.py')   # cascade.main with a test's signal hook


def test_a_signal_becomes_a_stop_request_and_the_handlers_come_back():
  before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with preemption.watch():
    assert preemption.stop_requested() is None
    os.kill(os.getpid(), signal.SIGINT)      # no KeyboardInterrupt: a request
    assert preemption.signalled() == 'SIGINT' and preemption.stop_requested() == 'SIGINT'
  assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
  assert preemption.signalled() is None


def test_a_second_signal_leaves_at_once_with_the_preemption_status():
  code = ('import os, signal, time\n'
          'from cascade import preemption\n'
          'with preemption.watch():\n'
          '  os.kill(os.getpid(), signal.SIGTERM)\n'
          '  os.kill(os.getpid(), signal.SIGTERM)\n'
          '  time.sleep(30)\n')
  proc = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == preemption.EXIT_CODE == 75
  lines = proc.stderr.strip().splitlines()
  assert lines[0] == ('SIGTERM: stopping at the next step boundary, with a checkpoint (or before '
                      'the next batch of an evaluation, keeping what it evaluated)')
  assert lines[1].startswith('SIGTERM again: leaving now without waiting')
  assert 'Traceback' not in proc.stderr


def _cmd(config, workdir, *overrides, signal_at=None):
  main = [FAULTS, f'--signal_at={signal_at}'] if signal_at else ['-m', 'cascade.main']
  return [sys.executable, *main, f'--config={config}', f'--workdir={workdir}', '--verbosity=-1',
          '--config.ckpt.every_n_steps=0', *overrides]


def _run(config, workdir, signal_at=None):
  return subprocess.run(_cmd(config, workdir, signal_at=signal_at), cwd=REPO,
                        capture_output=True, text=True, timeout=600)


def _lines(stderr):
  """stderr without the progress bars' redraws."""
  return [l for l in stderr.replace('\r', '\n').splitlines() if l.strip() and '|' not in l]


def _signal_on(proc, signals):
  """Reads the process's stderr as it comes and sends it `signals`, [(text, signal)] in order,
  each once its text has appeared. Returns a function giving all of stderr once the process
  has ended."""
  got = []

  def read():
    pending = list(signals)
    buf = ''
    while True:
      ch = proc.stderr.read(1)
      if not ch:
        break
      buf += ch
      while pending and pending[0][0] in buf:
        proc.send_signal(pending.pop(0)[1])
    got.append(buf)

  t = threading.Thread(target=read)
  t.start()

  def result():
    t.join(600)
    return got[0]
  return result


@pytest.fixture(scope='module')
def world(tmp_path_factory, copy_cascade):
  root = tmp_path_factory.mktemp('preemption')
  return copy_cascade(root, train=16, eval_=8, sft=32, sft_steps=6, rl_steps=2)


def _sft_steps(work):
  recs = [json.loads(l) for l in (work / 'metrics.jsonl').read_text().splitlines()]
  return [r['step'] for r in recs if r.get('stage') == 'sft']


@pytest.mark.heavy
def test_sigterm_mid_stage_checkpoints_that_step_and_the_rerun_resumes_there(world, tmp_path):
  work = tmp_path / 'run'
  proc = _run(world, work, signal_at='sft:3:SIGTERM')
  assert proc.returncode == preemption.EXIT_CODE == 75, proc.stderr[-3000:]
  lines = _lines(proc.stderr)
  assert lines[-1] == ("SIGTERM: stopped at stage 0 'sft' step 3/6, checkpoint saved; rerun "
                       'the same command to resume there'), lines
  assert 'Traceback' not in proc.stderr
  assert sorted(os.listdir(work / 'stages' / '00_sft' / 'ckpt')) == ['3']
  assert _sft_steps(work) == [1, 2, 3]           # logged for good before the stop
  again = _run(world, work)
  assert again.returncode == 0, again.stderr[-3000:]
  assert '[0] sft: resuming at step 3/6' in again.stdout
  assert _sft_steps(work) == [1, 2, 3, 4, 5, 6]  # steps 1-3 are not redone
  assert json.loads((work / 'results.json').read_text())['stages'] == ['sft', 'copy_rl']


@pytest.mark.heavy
def test_ctrl_c_stops_at_the_next_step_boundary_without_a_traceback(world, tmp_path):
  work = tmp_path / 'run'
  proc = subprocess.Popen(_cmd(world, work), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  # The stage's progress bar appears before its first step: Ctrl-C then stops after step 1.
  stderr = _signal_on(proc, [('[0] sft (sft)', signal.SIGINT)])
  proc.wait(600)
  err = stderr()
  assert proc.returncode == 75, err[-3000:]
  assert _lines(err)[-1].startswith("SIGINT: stopped at stage 0 'sft' step 1/6, checkpoint saved")
  assert 'Traceback' not in err and 'KeyboardInterrupt' not in err
  assert sorted(os.listdir(work / 'stages' / '00_sft' / 'ckpt')) == ['1']


@pytest.mark.heavy
def test_a_second_signal_while_saving_damages_nothing(world, tmp_path):
  work = tmp_path / 'run'
  proc = subprocess.Popen(_cmd(world, work, signal_at='sft:3:SIGTERM'), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  # The first SIGTERM (the hook's, at step 3) starts the stop's save; a second one lands on it.
  stderr = _signal_on(proc, [('stopping at the next step boundary', signal.SIGTERM)])
  proc.wait(600)
  err = stderr()
  assert proc.returncode == 75, err[-3000:]
  assert 'SIGTERM again: leaving now' in err and 'Traceback' not in err
  again = _run(world, work)
  assert again.returncode == 0, again.stderr[-3000:]
  resumed = '[0] sft: resuming at step 3/6' in again.stdout
  assert _sft_steps(work)[-6 + 3 * resumed:] == list(range(1 + 3 * resumed, 7))
  assert json.loads((work / 'results.json').read_text())['stages'] == ['sft', 'copy_rl']


def _rows(work):
  """progress.json's matrix rows without their config stamps and export paths (what an
  evaluation computed)."""
  rows = json.loads((work / 'progress.json').read_text())['rows']
  return [{k: v for k, v in r.items() if k not in ('config', 'hf')} for r in rows]


@pytest.mark.heavy
def test_sigterm_during_an_evaluation_stops_at_a_batch_and_the_rerun_completes_it(
    world, tmp_path, derived_config):
  config = tmp_path / 'batched.py'        # beside a copy of cfg.py: 8 held-out prompts, 4 batches
  (tmp_path / 'cfg.py').write_text((world.parent / 'cfg.py').read_text())
  config.write_text(derived_config('  c.eval.batch_size = 2\n'))
  whole = tmp_path / 'whole'
  assert _run(config, whole).returncode == 0
  # SIGTERM once the second batch of the first evaluation (the row after 'sft') is scored.
  work = tmp_path / 'run'
  proc = subprocess.run([sys.executable, FAULTS, '--signal_after_batch=copy:2:SIGTERM',
                         *_cmd(config, work)[3:]], cwd=REPO, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == preemption.EXIT_CODE, proc.stderr[-3000:]
  last = _lines(proc.stderr)[-1]
  assert last.startswith("SIGTERM: stopped evaluating [0] sft at its held-out domain 'copy' "
                         'before batch 3/4 (0 domain(s) and 2 batch(es) kept in '), last
  assert last.endswith('rerun the same command to resume there') and 'Traceback' not in proc.stderr
  assert json.loads((work / 'progress.json').read_text())['rows'] == []
  kept = json.loads((work / 'eval_partial.json').read_text())
  assert kept['row'] == 'sft' and len(kept['held_out']['copy']['modes']['no_think']) == 2
  again = _run(config, work)
  assert again.returncode == 0, again.stderr[-3000:]
  assert ('[0] sft: resuming its stopped evaluation (0 domain(s) and 2 batch(es) kept)'
          in again.stdout)
  assert '[0] sft: resuming at step 6/6' in again.stdout and _sft_steps(work) == list(range(1, 7))
  assert not (work / 'eval_partial.json').exists()
  # The same rows as the run that was never stopped, to the last digit of every detail.
  assert _rows(work) == _rows(whole) and len(_rows(work)) == 2
  assert (json.loads((work / 'results.json').read_text())['scores']
          == json.loads((whole / 'results.json').read_text())['scores'])
