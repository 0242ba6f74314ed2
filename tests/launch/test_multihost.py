"""Multi-host on one machine: two JAX processes (4 CPU devices each, gloo) run a sharded cascade.

Both processes run the same SFT -> GRPO cascade over one (2, 2, 2) mesh that
spans them, save Orbax checkpoints collectively into one workdir, restore the
final one, and must agree: the same results and the same parameter checksum.
Only process 0 writes the logs and the matrix files.

Marked slow as well: two JAX processes compiling on a shared 2-core machine
took 165 s wall (about 60 s of CPU), over the default suite's budget.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, 'tests', 'launch', 'multihost_worker.py')

@pytest.fixture(scope='module')
def world(tmp_path_factory, copy_cascade):
  root = tmp_path_factory.mktemp('multihost')
  copy_cascade(root, train=32, eval_=8, sft=64, mesh_shape=(2, 2, 2), keep=2, sft_steps=6,
               rl_steps=2, prompts_per_step=4)
  return root


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize('engine', ['one_call', 'paged'])
def test_two_processes_run_a_sharded_cascade_and_agree(world, tmp_path, engine, derived_config):
  """Either sampler engine: the paged one's host loop runs in lockstep on both processes."""
  workdir, out = tmp_path / 'run', tmp_path / 'out'
  config = world / 'cfg.py'
  if engine == 'paged':
    config = world / 'cfg_paged.py'
    config.write_text(derived_config(
        "  c.sampler.update(engine='paged', slots=8, page_size=8, chunk_steps=3)\n"))
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  env.pop('XLA_FLAGS', None)
  coordinator = f'127.0.0.1:{_free_port()}'
  procs = [subprocess.Popen([sys.executable, WORKER, coordinator, '2', str(i),
                             str(config), str(workdir), str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=400)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  codes = [p.returncode for p in procs]
  assert codes == [0, 0], '\n'.join(f'--- process {i} exited {c}:\n{log[-4000:]}'
                                     for i, (c, log) in enumerate(zip(codes, logs)))

  r0, r1 = (json.loads((out / f'{i}.json').read_text()) for i in range(2))
  assert (r0['processes'], r0['devices'], r0['local_devices']) == (2, 8, 4)
  # Each process times its own steps: "accounting" differs, everything else is shared.
  matrix = lambda res: {k: v for k, v in res.items() if k != 'accounting'}
  assert matrix(r0['results']) == matrix(r1['results'])
  assert r0['results']['stages'] == ['sft', 'copy_rl']
  assert r0['step'] == r1['step'] == 2
  assert r0['checksum'] == r1['checksum'] and r0['checksum'] > 0
  assert json.loads((workdir / 'results.json').read_text()) == r0['results']   # process 0's
  # Only process 0 logs: one line per step of each stage, not two.
  metrics = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [m['step'] for m in metrics if m.get('stage') == 'copy_rl'] == [1, 2]
  assert (workdir / 'stages' / '01_copy_rl' / 'hf' / 'model.safetensors').exists()
  # Process 1 prints no matrix (process 0 does).
  assert '| copy_rl |' in logs[0] and '| copy_rl |' not in logs[1]
