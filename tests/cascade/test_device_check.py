"""cascade.device_check: what JAX finds, one train step and one sampler call on a mesh."""

import jax
import pytest


@pytest.mark.heavy
def test_check_runs_on_a_mesh_and_reports():
  from cascade import device_check  # pylint: disable=g-import-not-at-top
  report = device_check.devices_report()
  assert report['backend'] == jax.default_backend()
  assert len(report['devices']) == jax.device_count()
  out = device_check.run_check('tiny', ['1', '-1', '1'], rows=4, prompt_len=8, seq=16)
  assert out['mesh']['fsdp'] == jax.device_count()
  # Rows round up to whole groups on every batch shard.
  assert out['sampler']['rows'] % jax.device_count() == 0
  assert out['sampler']['logprob_gap_vs_training_forward'] < 1e-4      # float32 on CPU
  assert out['train_step']['grad_norm'] > 0
  assert out['attention']['train'] in ('dense', 'blockwise', 'splash', 'gpu_flash')


@pytest.mark.slow      # a second compile of the sampler (~25 s)
def test_a_failed_check_is_one_line(monkeypatch):
  from cascade import device_check  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(device_check._TOLERANCE, 'float32', -1.0)   # nothing can pass
  with pytest.raises(device_check.CheckError, match='sampler log-probs differ from a training '
                     'forward by'):
    device_check.run_check('tiny', ['1', '1', '1'], rows=2, prompt_len=8, seq=16)
