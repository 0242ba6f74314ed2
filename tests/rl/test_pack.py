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
  with pytest.raises(ValueError, match="loss_agg='token'"):
    grpo.grpo_loss(jnp.zeros(packed.tokens.shape), packed,
                   grpo.GrpoConfig(loss_agg='seq_mean_token_mean'))


# ------------------------------------------------------------------ the layout, without a model

def _numpy_batch(lengths, prompt_lens, width, seed, *, losses=None):
  """A left-padded one-sequence-per-row TrainBatch with recognisable values per token."""
  rs = np.random.RandomState(seed)
  b = len(lengths)
  seg = np.zeros((b, width), np.int32)
  for i, n in enumerate(lengths):
    seg[i, width - n:] = 1
  tokens = rs.randint(1, 99, (b, width)).astype(np.int32) * seg
  loss = np.zeros((b, width), np.float32)
  for i, (n, p) in enumerate(zip(lengths, prompt_lens)):
    if n and (losses is None or losses[i]):
      loss[i, width - n + p - 1:width - 1] = 1
  return batch_lib.TrainBatch(
      tokens=tokens, positions=np.maximum(np.cumsum(seg, 1) - 1, 0) * seg,
      segment_ids=seg, targets=np.roll(tokens, -1, 1) * seg, loss_mask=loss,
      old_logprobs=-rs.random((b, width)).astype(np.float32) * loss,
      advantages=rs.normal(size=b).astype(np.float32),
      truncated=rs.random(b) < 0.5, ref_logprobs=-rs.random((b, width)).astype(np.float32))


@pytest.mark.parametrize('seed', range(12))
def test_pack_places_every_sequence_with_loss_once_whole_and_in_its_own_segment(seed):
  rs = np.random.RandomState(seed)
  b, width = int(rs.randint(1, 30)), 40
  lengths = rs.randint(0, width + 1, b)
  prompt_lens = np.minimum(rs.randint(1, 8, b), np.maximum(lengths, 1))
  losses = rs.random(b) < 0.8
  batch = _numpy_batch(lengths, prompt_lens, width, seed, losses=losses)
  row_tokens, multiple = int(rs.choice([8, 24, 48, 64])), int(rs.choice([1, 2, 3]))
  packed = batch_lib.pack(batch, row_tokens, rows_multiple=multiple)
  kept = [i for i in range(b) if lengths[i] and batch.loss_mask[i].sum() > 0]
  longest = int(max([lengths[i] for i in kept] + [1]))
  want_width = row_tokens if longest <= row_tokens else 1 << (longest - 1).bit_length()
  assert packed.tokens.shape[1] == want_width
  rows = packed.tokens.shape[0]
  assert rows % multiple == 0
  # Every kept sequence appears exactly once, whole, as one segment of one row.
  found = []
  for r in range(rows):
    ids = packed.segment_ids[r]
    used = int((ids > 0).sum())
    assert used <= want_width and np.all(ids[used:] == 0), 'segments are not left-aligned'
    for s in np.unique(ids[ids > 0]):
      cols = np.flatnonzero(ids == s)
      assert np.array_equal(cols, np.arange(cols[0], cols[0] + cols.size)), 'a split segment'
      src = [i for i in kept if lengths[i] == cols.size and np.array_equal(
          batch.tokens[i, width - cols.size:], packed.tokens[r, cols])
          and np.array_equal(batch.old_logprobs[i, width - cols.size:],
                             packed.old_logprobs[r, cols])]
      assert src, 'a packed segment matches no sequence'
      i = src[0]
      span = slice(width - cols.size, width)
      for name in ('positions', 'targets', 'loss_mask', 'ref_logprobs'):
        np.testing.assert_array_equal(getattr(packed, name)[r, cols],
                                      getattr(batch, name)[i, span], err_msg=name)
      np.testing.assert_array_equal(packed.advantages[r, cols], batch.advantages[i])
      np.testing.assert_array_equal(packed.truncated[r, cols], batch.truncated[i])
      found.append(i)
    pad = ids == 0
    assert not packed.loss_mask[r, pad].any() and not packed.advantages[r, pad].any()
    assert not packed.tokens[r, pad].any() and not packed.truncated[r, pad].any()
  assert sorted(found) == sorted(kept)
  # Row count: first-fit rows, rounded up to 1, 2, 3, 4, 6, 8, 12, 16, ... then the multiple.
  assert rows == _bucket(_first_fit_rows([lengths[i] for i in kept], want_width), multiple)
  assert packed.loss_mask.sum() == batch.loss_mask[kept].sum()


def _first_fit_rows(lengths, width):
  free = []
  for n in sorted(lengths, reverse=True):
    for j, room in enumerate(free):
      if room >= n:
        free[j] -= n
        break
    else:
      free.append(width - n)
  return max(1, len(free))


def _bucket(count, multiple):
  sizes = sorted({1 << k for k in range(12)} | {3 << k for k in range(11)})
  b = next(s for s in sizes if s >= count)
  return -(-b // multiple) * multiple


@pytest.mark.parametrize('count,want', [(1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (6, 6), (7, 8),
                                        (9, 12), (12, 12), (13, 16), (17, 24), (25, 32)])
def test_packed_row_counts_are_powers_of_two_or_three_quarters_of_one(count, want):
  batch = _numpy_batch([8] * count, [2] * count, 8, 0)     # one full row per sequence
  assert batch_lib.pack(batch, 8).tokens.shape[0] == want
  assert batch_lib.pack(batch, 8, rows_multiple=5).tokens.shape[0] == -(-want // 5) * 5


@pytest.mark.parametrize('longest,row_tokens,width', [(16, 8, 16), (17, 8, 32), (8, 8, 8),
                                                      (5, 8, 8)])
def test_a_sequence_longer_than_the_budget_widens_rows_to_a_power_of_two(longest, row_tokens,
                                                                          width):
  batch = _numpy_batch([longest, 3], [2, 1], 20, 0)
  assert batch_lib.pack(batch, row_tokens).tokens.shape[1] == width


def test_pack_refuses_a_row_whose_tokens_are_not_one_span():
  batch = _numpy_batch([7, 3], [2, 1], 10, 0)
  seg = batch.segment_ids.copy()
  seg[0, 8] = 0                      # row 0: tokens at 3..9 with a hole at 8
  with pytest.raises(ValueError, match='not one contiguous span'):
    batch_lib.pack(batch._replace(segment_ids=seg), 8)
  with pytest.raises(ValueError, match='row_tokens=0 and rows_multiple=1 must be >= 1'):
    batch_lib.pack(batch, 0)
  with pytest.raises(ValueError, match='rows_multiple=0 must be >= 1'):
    batch_lib.pack(batch, 8, rows_multiple=0)
