"""TrainBatch layout from sampler output, and on-policy alignment with the real sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import sharding
from models import transformer
from rl import batch as batch_lib
from rl import sampler


def _two_rows(**extra):
  fields = dict(
      prompt_tokens=np.array([[0, 5, 6, 7], [8, 9, 10, 11]], np.int32),
      prompt_mask=np.array([[0, 1, 1, 1], [1, 1, 1, 1]], np.int32),
      tokens=np.array([[20, 21, 22], [30, 31, 0]], np.int32),
      mask=np.array([[1, 1, 1], [1, 1, 0]], np.int32),
      logprobs=np.array([[-1, -2, -3], [-4, -5, 0]], np.float32),
      sampling_logprobs=np.zeros((2, 3), np.float32),
      lengths=np.array([3, 2], np.int32), truncated=np.array([True, False]))
  return sampler.SampleOutput(**{**fields, **extra})


def test_from_samples_layout():
  out = _two_rows()
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


def test_from_samples_learns_only_the_policys_tokens_of_an_episode():
  """Multi-turn rows: observation tokens (policy_mask 0) are context, never loss."""
  import collections  # pylint: disable=g-import-not-at-top
  out = _two_rows()
  episode = collections.namedtuple('Episode', out._fields + ('policy_mask',))(
      *out, policy_mask=np.array([[1, 0, 1], [0, 1, 1]], np.int32))
  b = batch_lib.from_samples(episode, [0.5, -0.5])
  # Row 1's third token is padding (mask 0): no loss even where policy_mask says 1.
  np.testing.assert_array_equal(b.loss_mask, [[0, 0, 0, 1, 0, 1, 0], [0, 0, 0, 0, 1, 0, 0]])
  np.testing.assert_array_equal(b.segment_ids, [[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
  with pytest.raises(ValueError, match=r'policy_mask has shape \(2, 2\), expected \(2, 3\)'):
    batch_lib.from_samples(episode._replace(policy_mask=np.ones((2, 2), np.int32)), [0, 0])


@pytest.mark.parametrize('adv', [[0.5], [0.5, 0.1, 0.2], [[0.5, 0.1]] * 2])
def test_from_samples_refuses_advantages_of_another_shape(adv):
  with pytest.raises(ValueError, match=r'advantages has shape .*expected \(2,\)'):
    batch_lib.from_samples(_two_rows(), adv)


def test_from_samples_refuses_completion_fields_of_another_shape():
  out = _two_rows()
  for name, bad in (('mask', np.ones((2, 2), np.int32)), ('logprobs', np.zeros((2, 4))),
                    ('tokens', np.zeros((3, 3), np.int32))):
    with pytest.raises(ValueError, match='shapes disagree'):
      batch_lib.from_samples(out._replace(**{name: bad}), [0.5, -0.5])


class _Head:
  """A stand-in policy head: logits = h @ w (for stats_from_hidden)."""

  def __init__(self, w):
    self.w = jnp.asarray(w)
    self.rules = sharding.DEFAULT_RULES

  def logits_from_hidden(self, h):
    return h @ self.w


@pytest.mark.parametrize('chunk', [16, 3], ids=['one_shot', 'chunked'])
def test_stats_from_hidden_equal_float64_reference(chunk):
  rng = np.random.default_rng(1)
  b, l, d, v = 2, 7, 5, 11
  h, w = rng.normal(size=(b, l, d)), rng.normal(size=(d, v))
  targets = rng.integers(0, v, (b, l))
  got = batch_lib.stats_from_hidden(_Head(w.astype(np.float32)), jnp.asarray(h, jnp.float32),
                                    jnp.asarray(targets), entropy=True, argmax=True,
                                    chunk=chunk)
  logits = h @ w
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  np.testing.assert_allclose(got['logprobs'], np.take_along_axis(logp, targets[..., None],
                                                                 -1)[..., 0], atol=1e-5)
  np.testing.assert_allclose(got['entropy'], -(np.exp(logp) * logp).sum(-1), atol=1e-5)
  np.testing.assert_array_equal(got['argmax'], logits.argmax(-1))


def test_token_entropy_equals_float64_reference():
  logits = np.random.default_rng(0).normal(size=(2, 3, 7)) * 3
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  want = -(np.exp(logp) * logp).sum(-1)
  np.testing.assert_allclose(batch_lib.token_entropy(jnp.asarray(logits, jnp.float32)), want,
                             rtol=1e-5, atol=1e-6)


def test_concatenated_rounds_pad_prompts_left_and_completions_right():
  """Round 1: 2-token prompts, 6-token completions; round 2: 4 and 3 (widths 2 -> 4 and
  3 -> 6 are padded by different amounts)."""
  wide = a = _two_rows()
  short = a._replace(
      prompt_tokens=a.prompt_tokens[:, 2:], prompt_mask=a.prompt_mask[:, 2:],
      tokens=np.pad(a.tokens, ((0, 0), (0, 3))), mask=np.pad(a.mask, ((0, 0), (0, 3))),
      logprobs=np.pad(a.logprobs, ((0, 0), (0, 3))),
      sampling_logprobs=np.pad(a.sampling_logprobs, ((0, 0), (0, 3))))
  both = batch_lib.concat_rows([short, wide])
  assert both.prompt_tokens.shape == (4, 4) and both.tokens.shape == (4, 6)
  np.testing.assert_array_equal(both.prompt_tokens[:2], [[0, 0, 6, 7], [0, 0, 10, 11]])
  np.testing.assert_array_equal(both.prompt_mask[:2], [[0, 0, 1, 1], [0, 0, 1, 1]])
  np.testing.assert_array_equal(both.tokens[2:], np.pad(a.tokens, ((0, 0), (0, 3))))
  np.testing.assert_array_equal(both.lengths, [3, 2, 3, 2])


def test_positions_from_segments():
  seg = np.array([[1, 1, 2, 2, 2, 0], [3, 3, 3, 0, 0, 0]])
  np.testing.assert_array_equal(batch_lib.positions_from_segments(seg),
                                [[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 0, 0]])


@pytest.mark.heavy
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


def test_frozen_logprobs_in_calls_of_a_few_rows_equal_one_call():
  """compute_logprobs(rows_per_call=k) runs ceil(B/k) calls of exactly k rows (the last padded
  by repeating a row) and returns what one call over all B rows does."""
  cfg = config_lib.ModelConfig.preset('tiny', vocab_size=64, embed_dim=32, num_layers=1,
                                      num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                                      max_seq_len=32)
  graphdef, params = nnx.split(transformer.create(cfg, seed=2))
  rng = np.random.default_rng(0)
  b, l = 7, 12
  tokens = rng.integers(1, 64, (b, l)).astype(np.int32)
  batch = batch_lib.TrainBatch(tokens=tokens, positions=np.tile(np.arange(l), (b, 1)),
                               segment_ids=np.ones((b, l), np.int32),
                               targets=np.roll(tokens, -1, axis=1),
                               loss_mask=np.ones((b, l), np.float32), advantages=None)
  calls = []
  jit = batch_lib._logprobs_jit                                  # pylint: disable=protected-access
  batch_lib._logprobs_jit = lambda *a, **kw: calls.append(a[2].shape) or jit(*a, **kw)
  try:
    whole = np.asarray(batch_lib.compute_logprobs(graphdef, params, batch))
    for k in (3, 4, 1):
      calls.clear()
      parts = batch_lib.compute_logprobs(graphdef, params, batch, rows_per_call=k)
      assert calls == [(k, l)] * -(-b // k), k
      np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-5)
  finally:
    batch_lib._logprobs_jit = jit
  assert np.abs(whole).max() > 0.1
  with pytest.raises(ValueError, match='rows_per_call=0'):
    batch_lib.compute_logprobs(graphdef, params, batch, rows_per_call=0)
