"""First-hour breaks of issue #40 that no other test file covers.

A missing tokenizer was reported through cascade.main's storage-error path ("... nothing already
written was changed: free the space or fix the path"), because `foundation.tokenizer.load` raised a
plain FileNotFoundError (an OSError, which that path takes for the disk failing).
"""

import os
import subprocess
import sys

import pytest

from foundation import paths
from foundation import tokenizer as tokenizer_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize('kind', ['file', 'directory'])
def test_a_missing_tokenizer_is_a_path_error_not_a_storage_failure(tmp_path, kind):
  """What cascade.main says in one line (a paths.PathError) and still a FileNotFoundError for
  callers that catch that."""
  target = tmp_path / 'nothing' / 'tok.model' if kind == 'file' else tmp_path
  with pytest.raises(tokenizer_lib.TokenizerNotFound) as e:
    tokenizer_lib.load(target)
  assert isinstance(e.value, paths.PathError) and isinstance(e.value, FileNotFoundError)
  assert str(target) in str(e.value) and '\n' not in str(e.value)


@pytest.mark.heavy
def test_a_run_with_a_missing_tokenizer_stops_with_one_line(copy_cascade, tmp_path):
  """The command line: exit 2 and one line naming the tokenizer file, not the storage advice."""
  config = copy_cascade(tmp_path, train=8, eval_=4, sft=8)
  config.write_text(config.read_text().replace("root + '/tok.model'", "root + '/no/tok.model'"))
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run([sys.executable, '-m', 'cascade.main', f'--config={config}',
                         f'--workdir={tmp_path / "w"}'], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert lines == [f'error: tokenizer file {tmp_path}/no/tok.model does not exist'], lines


@pytest.mark.heavy
@pytest.mark.multiprocess
def test_a_stage_export_on_two_hosts_gathers_one_tensor_at_a_time(copy_cascade, tmp_path):
  """Policies.export_hf of a policy spanning two processes: every process joins gathers of one
  tensor each (never the whole policy onto every host, as the export once did), and process 0
  writes an export equal to the policy."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import socket  # pylint: disable=g-import-not-at-top

  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from models import hf  # pylint: disable=g-import-not-at-top
  from models import transformer  # pylint: disable=g-import-not-at-top
  config = copy_cascade(tmp_path, train=4, eval_=2, sft=8)
  spec = importlib.util.spec_from_file_location('export_config', config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  plan = config_lib.validate(module.get_config())
  model = transformer.create(plan.model, 3)
  source = tmp_path / 'source'
  hf.save_model(model, source)
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    coordinator = f'127.0.0.1:{s.getsockname()[1]}'
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  env.pop('XLA_FLAGS', None)
  worker = os.path.join(REPO, 'tests', 'cascade', 'export_hosts_worker.py')
  procs = [subprocess.Popen([sys.executable, worker, coordinator, str(i), str(config),
                             str(source), str(tmp_path / 'run')], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    logs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], '\n'.join(log[-3000:] for log in logs)
  reports = [json.loads(log.strip().splitlines()[-1]) for log in logs]
  tensors = len(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for r in reports:
    # One call per HF tensor (at least one per parameter), none larger than the largest
    # parameter (the old export gathered the whole policy, every parameter, in one call).
    assert len(r['gathered']) >= tensors, (len(r['gathered']), tensors)
    assert max(r['gathered']) <= r['largest'] < r['whole'], r
  back = nnx.to_flat_state(nnx.state(hf.load_model(reports[0]['out']), nnx.Param))
  want = nnx.to_flat_state(nnx.state(model, nnx.Param))
  assert len(back) == len(want)
  for (k, a), (k2, b) in zip(sorted(back, key=lambda kv: str(kv[0])),
                             sorted(want, key=lambda kv: str(kv[0]))):
    assert k == k2
    np.testing.assert_array_equal(np.asarray(a.get_value(), np.float32),
                                  np.asarray(b.get_value(), np.float32))


# Slow: every program of the smoke cascade compiled, 507 s at load 20 on 2 cores (the default
# tier's tests/launch/test_plan.py::test_a_config_without_a_mesh_is_planned_on_one_device checks
# the same mesh choice without compiling).
@pytest.mark.slow
def test_the_plan_of_the_one_device_smoke_config_runs_as_typed():
  """`python -m launch.plan --config=configs/tiny.py:smoke`, the first command the issue typed
  (it ended in `TypeError: 'NoneType' object is not iterable`): every program of the one-device
  config planned on the one-device mesh."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run([sys.executable, '-m', 'launch.plan', '--config=configs/tiny.py:smoke'],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert '(1, 1, 1) (no mesh: one device)' in proc.stdout, proc.stdout[:3000]
  assert 'every planned program fits' in proc.stdout, proc.stdout[-3000:]
