"""MOPD: loss and gradient against a float64 reference, per-row teacher routing, learning."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import transformer
from rl import batch as batch_lib
from rl import distill
from rl import sampler
from rl import train_step as ts

CFG = config_lib.ModelConfig.tiny()


def _batch(seed=0, b=5, l=8):
  rng = np.random.default_rng(seed)
  mask = (rng.random((b, l)) < 0.75).astype(np.float32)
  mask[1] = 0
  new = -rng.random((b, l)).astype(np.float32) * 3
  old = new + rng.uniform(-1.2, 1.2, (b, l)).astype(np.float32)   # weights in [0.3, 3.3]
  teacher = new + rng.normal(size=(b, l)).astype(np.float32)
  batch = batch_lib.TrainBatch(
      tokens=np.zeros((b, l), np.int32), positions=np.zeros((b, l), np.int32),
      segment_ids=np.ones((b, l), np.int32), targets=np.zeros((b, l), np.int32),
      loss_mask=mask, old_logprobs=old * mask, teacher_logprobs=teacher * mask)
  return batch, new


def _ref(new, batch, lo=0.5, hi=2.0):
  num, n, kept = 0.0, 0.0, 0
  grad = np.zeros(new.shape)
  for i in range(new.shape[0]):
    for t in range(new.shape[1]):
      if not batch.loss_mask[i, t]:
        continue
      w = np.exp(float(new[i, t]) - float(batch.old_logprobs[i, t]))
      a = float(batch.teacher_logprobs[i, t]) - float(new[i, t])
      keep = lo <= w <= hi
      kept += keep
      num += w * a if keep else 0.0
      grad[i, t] = -(w * a if keep else 0.0)
      n += 1
  return -num / n, grad / n, kept / n


def test_mopd_loss_and_gradient_match_reference():
  batch, new = _batch()
  cfg = distill.MopdConfig()
  loss, m = distill.mopd_loss(jnp.asarray(new), batch, cfg)
  ref_loss, ref_grad, ref_kept = _ref(new, batch)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  np.testing.assert_allclose(float(m['is_kept_frac']), ref_kept, rtol=1e-6)
  assert 0.2 < ref_kept < 0.95                          # truncation really happens
  on = np.asarray(batch.loss_mask) > 0
  w = np.exp(new - np.asarray(batch.old_logprobs))
  np.testing.assert_allclose(float(m['ratio_max']), w[on].max(), rtol=1e-5)
  # Every ratio below 1: the maximum is still over real tokens only (masked ones are not 1).
  low = batch._replace(old_logprobs=(new + 0.5) * batch.loss_mask)
  _, m_low = distill.mopd_loss(jnp.asarray(new), low, cfg)
  np.testing.assert_allclose(float(m_low['ratio_max']), np.exp(-0.5), rtol=1e-5)
  # Stop-gradient on a_t and w_t: the gradient is -w a / N on kept tokens only.
  grad = jax.grad(lambda lp: distill.mopd_loss(lp, batch, cfg)[0])(jnp.asarray(new))
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_mopd_config_and_missing_teacher():
  with pytest.raises(ValueError, match='is_low'):
    distill.MopdConfig(is_low=1.5)
  batch, new = _batch()
  with pytest.raises(ValueError, match='teacher_logprobs'):
    distill.mopd_loss(jnp.asarray(new), batch._replace(teacher_logprobs=None), distill.MopdConfig())


def test_teacher_logprobs_route_rows_to_their_teacher():
  graphdef, t0 = nnx.split(transformer.create(CFG, seed=1))
  _, t1 = nnx.split(transformer.create(CFG, seed=2))
  rng = np.random.default_rng(0)
  b = batch_lib.TrainBatch(
      tokens=rng.integers(0, 256, (5, 6)).astype(np.int32), positions=np.tile(np.arange(6), (5, 1)),
      segment_ids=np.ones((5, 6), np.int32), targets=rng.integers(0, 256, (5, 6)).astype(np.int32),
      loss_mask=np.ones((5, 6), np.float32))
  idx = np.array([0, 1, 1, 0, 1])
  got = distill.teacher_logprobs(graphdef, [t0, t1], idx, b)
  full = [np.asarray(batch_lib.compute_logprobs(graphdef, t, b)) for t in (t0, t1)]
  expect = np.where(idx[:, None] == 0, full[0], full[1])
  np.testing.assert_allclose(got, expect, atol=1e-5)
  assert np.abs(full[0] - full[1]).max() > 0.01
  with pytest.raises(ValueError, match='2 teachers'):
    distill.teacher_logprobs(graphdef, [t0, t1], np.array([0, 1, 2, 0, 0]), b)
  # Teachers kept in host memory give the same log-probs and stay there.
  on_host = [distill.to_memory(t, 'pinned_host') for t in (t0, t1)]
  kinds = lambda t: {x.sharding.memory_kind for x in jax.tree.leaves(t)}
  assert kinds(on_host[0]) == {'pinned_host'} and kinds(t0) == {'device'}
  np.testing.assert_array_equal(distill.teacher_logprobs(graphdef, on_host, idx, b), got)
  assert kinds(on_host[1]) == {'pinned_host'}
  back = distill.to_memory(on_host[1], 'device')
  assert kinds(back) == {'device'}
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(t1)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.heavy
def test_mopd_moves_student_toward_teacher():
  # A 16-token vocabulary, so sampled-token advantages cover the distribution quickly.
  cfg = config_lib.ModelConfig.tiny(vocab_size=16)
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  # A sharper teacher: scaled tied embeddings sharpen every next-token distribution.
  teacher = jax.tree.map(lambda x: x, params)
  teacher['embed'][...] = params['embed'][...] * 4.0
  opt = ts.make_optimizer(ts.OptimizerConfig(lr=1e-2))
  state = ts.init_state(jax.tree.map(jnp.copy, params), opt)
  loss = ts.LossSpec(distill.MopdConfig, distill.loss_fn, distill.normalizers)
  step = ts.make_train_step(graphdef, loss, None, opt)
  samp = sampler.Sampler(graphdef, cfg, eos_ids=(), pad_id=0)
  sp = sampler.SamplingParams(temperature=1.0, max_new_tokens=8)
  prompts = [[3 + i, 4 + (5 * i) % 12] for i in range(8)]
  kls = []
  for i in range(25):
    out = samp.generate(state.params, prompts, jax.random.key(i), sp, num_samples=2)
    batch = batch_lib.from_samples(out, np.zeros(16), teacher_index=np.zeros(16, np.int32))
    batch = batch._replace(teacher_logprobs=distill.teacher_logprobs(
        graphdef, [teacher], batch.teacher_index, batch))
    state, m = step(state, batch)
    kls.append(-float(m['advantage']))            # reverse KL estimate on student samples
    assert abs(float(m['ratio_mean']) - 1) < 1e-3 and float(m['is_kept_frac']) == 1.0
  print('reverse KL(student || teacher):', [round(k, 2) for k in kls[::4]])
  assert np.mean(kls[-5:]) < 0.3 * np.mean(kls[:3])
