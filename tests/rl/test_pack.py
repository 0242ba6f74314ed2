"""Packed RL updates (rl.batch.pack): the same loss and gradients as the padded batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import transformer
from rl import batch as batch_lib
from rl import grpo
from rl import sampler

CFG = config_lib.ModelConfig.tiny()


def _rollouts(seed=0):
  """Sampled rows with mixed prompt and completion lengths (one completion at the cap)."""
  graphdef, params = nnx.split(transformer.create(CFG, seed=0))
  rs = np.random.RandomState(seed)
  prompts = [list(rs.randint(1, CFG.vocab_size, size=n)) for n in (3, 11, 6, 20)]
  limits = np.array([2, 30, 5, 1, 9, 17, 3, 30])
  samp = sampler.Sampler(graphdef, CFG, eos_ids=(), prompt_buckets=(32,),
                         new_token_buckets=(32,))
  out = samp.generate(params, prompts, jax.random.key(seed), sampler.SamplingParams(
      max_new_tokens=30, temperature=1.0), num_samples=2, row_limits=limits)
  adv = rs.normal(size=8).astype(np.float32)
  valid = np.ones(8, bool)
  valid[3] = False                                   # a row without loss is left out
  batch = batch_lib.from_samples(out, adv, valid=valid)
  # Sampler log-probs nudged, so the importance ratio is not 1 and clipping happens.
  batch = batch._replace(old_logprobs=batch.old_logprobs + rs.normal(
      size=batch.old_logprobs.shape).astype(np.float32) * 0.3 * batch.loss_mask,
      ref_logprobs=batch.old_logprobs - 0.1 * batch.loss_mask)
  return graphdef, params, batch


def _loss_and_grads(graphdef, params, batch, cfg):
  norm = grpo.normalizers(batch, cfg)

  def f(p):
    return grpo.loss_fn(nnx.merge(graphdef, p), batch, cfg, norm)

  (loss, metrics), grads = jax.value_and_grad(f, has_aux=True)(params)
  return loss, metrics, grads


@pytest.mark.heavy
@pytest.mark.parametrize('row_tokens', [64, 16], ids=['several_per_row', 'longer_than_budget'])
def test_packed_update_equals_the_padded_one(row_tokens):
  graphdef, params, batch = _rollouts()
  batch = batch._replace(truncated=np.array([0, 1, 0, 0, 0, 0, 0, 1], bool))
  packed = batch_lib.pack(batch, row_tokens, rows_multiple=2)
  real = lambda b: int(np.sum(np.asarray(b.segment_ids) > 0))
  lengths = np.asarray(batch.segment_ids).sum(1)
  # Rows without loss are gone; every other token is there once.
  assert real(packed) == lengths.sum() - lengths[3]
  assert packed.tokens.shape[0] % 2 == 0
  if row_tokens == 16:       # a 50-token row does not fit 16: the width grows to hold it
    assert packed.tokens.shape[1] == 64
  else:
    assert packed.tokens.shape[1] == 64 and packed.tokens.shape[0] < batch.tokens.shape[0]
    assert np.max(np.asarray(packed.segment_ids)) >= 2
  configs = [grpo.GrpoConfig(kl_coef=0.05, mask_truncated=True, clip_eps_high=0.28)]
  if row_tokens == 64:
    configs.append(grpo.GrpoConfig())
  for cfg in configs:
    want_loss, want_m, want_g = _loss_and_grads(graphdef, params, batch, cfg)
    got_loss, got_m, got_g = _loss_and_grads(graphdef, params, packed, cfg)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for k in ('pg_loss', 'ratio_mean', 'clip_frac', 'tokens'):
      np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 got_g, want_g)
    assert float(got_m['clip_frac']) > 0


def test_pack_refuses_what_it_cannot_keep():
  _, _, batch = _rollouts()
  with pytest.raises(ValueError, match='teacher_index'):
    batch_lib.pack(batch._replace(teacher_index=np.zeros(8, np.int32)), 64)
  packed = batch_lib.pack(batch, 64)
  with pytest.raises(ValueError, match='already packed'):
    batch_lib.pack(packed, 64)
  with pytest.raises(ValueError, match="aggregation='token'"):
    grpo.grpo_loss(jnp.zeros(packed.tokens.shape), packed,
                   grpo.GrpoConfig(aggregation='seq_mean_token_mean'))
