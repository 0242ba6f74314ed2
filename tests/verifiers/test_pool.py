"""The worker pool: deadlines, crashes, protocol errors, restarts, no leaked processes."""

import gc
import os
import subprocess
import sys
import time

import psutil
import pytest

from verifiers import base
from verifiers.sandbox import pool as pool_lib

WORKER = r'''
import os, sys, time
from verifiers.sandbox import framing as s
s.write_frame(1, {'ready': True})
while True:
  req = s.read_frame(0)
  if req is None:
    break
  if req.get('sleep'):
    time.sleep(req['sleep'])
  if req.get('exit') is not None:
    os._exit(req['exit'])
  if req.get('garbage'):
    os.write(1, b'\xff\xff\xff\xff')
  s.write_frame(1, {'echo': req.get('echo'), 'pid': os.getpid()})
'''


def _spawn(_):
  env = dict(os.environ, PYTHONPATH=base.PACKAGE_PARENT)
  return subprocess.Popen([sys.executable, '-c', WORKER], env=env, **pool_lib.popen_kwargs())


def test_answers_in_order_across_workers():
  p = pool_lib.ProcessPool(_spawn, 2, name='t')
  try:
    out = p.run([{'echo': i, 'sleep': 0.2} for i in range(8)], [10.0] * 8)
    assert [o.value['echo'] for o in out] == list(range(8))
    assert len({o.value['pid'] for o in out}) == 2
    assert len(p.pids) == 2
  finally:
    p.close()


def test_timeout_crash_and_protocol_error_do_not_block_the_batch():
  p = pool_lib.ProcessPool(_spawn, 2, name='t')
  try:
    reqs = [{'sleep': 30, 'echo': 0}, {'exit': 3}, {'garbage': True}] + [{'echo': i} for i in range(3, 9)]
    start = time.monotonic()
    out = p.run(reqs, [0.5] + [10.0] * 8)
    assert time.monotonic() - start < 8
    assert not out[0].ok and 'timeout after 0.5s' in out[0].error
    assert not out[1].ok and 'exit status 3' in out[1].error
    assert not out[2].ok and 'protocol error' in out[2].error
    assert [o.value['echo'] for o in out[3:]] == list(range(3, 9))
    # Killed workers were replaced; the pool keeps working.
    assert [o.value['echo'] for o in p.run([{'echo': 'x'}], [10.0])] == ['x']
    assert len(p.pids) == 2
  finally:
    p.close()


def test_workers_that_cannot_start_raise():
  def broken(_):
    return subprocess.Popen([sys.executable, '-c', 'import sys; sys.exit(7)'],
                            **pool_lib.popen_kwargs())
  p = pool_lib.ProcessPool(broken, 1, name='broken')
  with pytest.raises(RuntimeError, match='fail to start'):
    p.run([{'echo': 1}], [10.0])
  p.close()


def test_close_and_garbage_collection_leave_no_process():
  p = pool_lib.ProcessPool(_spawn, 2, name='t')
  p.run([{'echo': 1}, {'echo': 2}], [10.0, 10.0])
  pids = p.pids
  p.close()
  assert not any(psutil.pid_exists(pid) for pid in pids)
  p = pool_lib.ProcessPool(_spawn, 2, name='t')
  p.run([{'echo': 1}], [10.0])
  pids = p.pids
  del p
  gc.collect()
  assert not any(psutil.pid_exists(pid) for pid in pids)


def test_workers_outlive_the_thread_that_first_ran_the_pool():
  """A worker dies with the thread that started it (PR_SET_PDEATHSIG in
  verifiers/sandbox/worker.py): the pool starts its workers on a thread of its own, so a batch
  run from a short-lived thread (a step's scoring thread) leaves them alive for the next one."""
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  import functools  # pylint: disable=g-import-not-at-top
  p = pool_lib.ProcessPool(functools.partial(base.worker_popen, 'json:dumps'), 1, name='t')
  try:
    with concurrent.futures.ThreadPoolExecutor(1) as scoring:
      first = scoring.submit(p.run, [{'x': 1}], [30.0]).result()
    assert first[0].ok and first[0].value == '{"x": 1}'
    pids = p.pids
    time.sleep(0.5)                        # the scoring thread has ended
    assert all(psutil.pid_exists(pid) for pid in pids)
    again = p.run([{'x': 2}], [30.0])
    assert again[0].ok and again[0].value == '{"x": 2}' and p.restarts == 0 and p.pids == pids
  finally:
    p.close()
  assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != 'zombie'
                 for pid in pids)
