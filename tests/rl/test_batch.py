"""TrainBatch layout from sampler output, and on-policy alignment with the real sampler."""

import jax
import numpy as np
from flax import nnx

from models import config as config_lib
from models import transformer
from rl import batch as batch_lib
from rl import sampler


def test_from_samples_layout():
  out = sampler.SampleOutput(
      prompt_tokens=np.array([[0, 5, 6, 7], [8, 9, 10, 11]], np.int32),
      prompt_mask=np.array([[0, 1, 1, 1], [1, 1, 1, 1]], np.int32),
      tokens=np.array([[20, 21, 22], [30, 31, 0]], np.int32),
      mask=np.array([[1, 1, 1], [1, 1, 0]], np.int32),
      logprobs=np.array([[-1, -2, -3], [-4, -5, 0]], np.float32),
      sampling_logprobs=np.zeros((2, 3), np.float32),
      lengths=np.array([3, 2], np.int32), truncated=np.array([True, False]))
  b = batch_lib.from_samples(out, [0.5, -0.5], valid=[True, False], teacher_index=[1, 0])
  np.testing.assert_array_equal(b.tokens, [[0, 5, 6, 7, 20, 21, 22], [8, 9, 10, 11, 30, 31, 0]])
  np.testing.assert_array_equal(b.segment_ids, [[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
  np.testing.assert_array_equal(b.positions, [[0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 0]])
  # Column 3 (last prompt token) predicts completion token 0.
  np.testing.assert_array_equal(b.targets, [[0, 0, 0, 20, 21, 22, 0], [0, 0, 0, 30, 31, 0, 0]])
  np.testing.assert_array_equal(b.loss_mask, [[0, 0, 0, 1, 1, 1, 0], [0] * 7])
  np.testing.assert_array_equal(b.old_logprobs, [[0, 0, 0, -1, -2, -3, 0], [0, 0, 0, -4, -5, 0, 0]])
  np.testing.assert_array_equal(b.advantages, [0.5, -0.5])
  np.testing.assert_array_equal(b.truncated, [True, False])
  np.testing.assert_array_equal(b.teacher_index, [1, 0])


def test_positions_from_segments():
  seg = np.array([[1, 1, 2, 2, 2, 0], [3, 3, 3, 0, 0, 0]])
  np.testing.assert_array_equal(batch_lib.positions_from_segments(seg),
                                [[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 0, 0]])


def test_trainer_logprobs_equal_sampler_logprobs():
  """Sampler -> from_samples -> training forward reproduces the sampler's log-probs."""
  cfg = config_lib.ModelConfig.tiny()
  graphdef, params = nnx.split(transformer.create(cfg, seed=2))
  s = sampler.Sampler(graphdef, cfg, eos_ids=(1,), pad_id=0)
  prompts = [[5, 6, 7], [9], [3, 4, 5, 6, 7, 8]]
  out = s.generate(params, prompts, jax.random.key(0),
                   sampler.SamplingParams(temperature=1.0, max_new_tokens=8), num_samples=2)
  b = batch_lib.from_samples(out, np.zeros(6))
  lp = np.asarray(batch_lib.compute_logprobs(graphdef, params, b))
  assert b.loss_mask.sum() == out.mask.sum() > 0
  np.testing.assert_allclose(lp * b.loss_mask, b.old_logprobs, atol=1e-4)
  # And the same as a forward pass over each row's unpadded tokens.
  model = nnx.merge(graphdef, params)
  for r in (0, 3):
    real = b.tokens[r][b.segment_ids[r] > 0]
    logits = model(real[None])
    row = np.asarray(batch_lib.token_logprobs(logits, np.roll(real, -1)[None]))[0, :-1]
    k = len(prompts[r // 2])
    np.testing.assert_allclose(row[k - 1:k - 1 + out.lengths[r]], out.logprobs[r, :out.lengths[r]],
                               atol=1e-4)
