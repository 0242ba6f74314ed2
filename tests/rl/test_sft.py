"""SFT: packing layout, packed == unpacked per-example loss, and learning on a synthetic corpus."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import transformer
from rl import batch as batch_lib
from rl import sft
from rl import train_step as ts


def _example(rng, start=None, length=None):
  """A prompt [2, x] (not learned) and a learned response x+1, x+2, ..., then EOS=1."""
  x = int(rng.integers(10, 200)) if start is None else start
  k = int(rng.integers(2, 8)) if length is None else length
  toks = [2, x] + [10 + (x - 10 + i) % 190 for i in range(1, k + 1)] + [1]
  return toks, [0, 0] + [1] * (k + 1)


def test_pack_layout():
  ex = [([5, 6, 7], [0, 1, 1]), ([8, 9], [0, 1]), ([3, 4, 5, 6], [0, 0, 1, 1])]
  b = sft.pack(ex, row_len=6)
  # First fit: [ex0, ex1] in row 0 (5 tokens), ex2 does not fit there -> row 1.
  np.testing.assert_array_equal(b.tokens, [[5, 6, 7, 8, 9, 0], [3, 4, 5, 6, 0, 0]])
  np.testing.assert_array_equal(b.segment_ids, [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(b.positions, [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
  np.testing.assert_array_equal(b.targets, [[6, 7, 0, 9, 0, 0], [4, 5, 6, 0, 0, 0]])
  # No target crosses from example 0 into example 1.
  np.testing.assert_array_equal(b.loss_mask, [[1, 1, 0, 1, 0, 0], [0, 1, 1, 0, 0, 0]])
  assert sft.pack(ex, row_len=6, num_rows=3).tokens.shape == (3, 6)
  with pytest.raises(ValueError, match='example 1 has 2 tokens but 1 mask'):
    sft.pack([([1], [0]), ([1, 2], [1])], row_len=4)
  with pytest.raises(ValueError, match='example 0 has 7 tokens'):
    sft.pack([([1] * 7, [1] * 7)], row_len=6)
  with pytest.raises(ValueError, match='need 2 rows'):
    sft.pack(ex, row_len=6, num_rows=1)


def test_loss_accuracy_and_normaliser_against_a_hand_count(monkeypatch):
  """loss_fn's accuracy counts learned tokens whose argmax is the target, over the whole
  batch's learned tokens; the loss is their mean NLL (one learned token: divided by 1)."""
  batch = sft.pack([([5, 6, 7, 8], [0, 1, 1, 1]), ([9, 3], [0, 1])], row_len=6)
  # Learned targets: 6, 7, 8 (the first example) and 3 (the second).
  logprobs = np.full(batch.targets.shape, -2.0, np.float32)
  argmax = np.where(batch.targets == 7, 7, 0) + np.where(batch.targets == 3, 1, 0)
  monkeypatch.setattr(batch_lib, 'policy_stats', lambda model, b, argmax=False: {
      'logprobs': jnp.asarray(logprobs), 'argmax': jnp.asarray(argmax_values)})
  argmax_values = argmax
  norm = sft.normalizers(batch, sft.SftConfig())
  assert float(norm['tokens']) == batch.loss_mask.sum() == 4
  loss, metrics = sft.loss_fn(None, batch, sft.SftConfig(), norm)
  assert float(loss) == pytest.approx(2.0)
  # Right: the target 7 only (3 is predicted as 1, the others as 0).
  assert float(metrics['accuracy']) == pytest.approx(1 / 4)
  one = sft.pack([([4, 2], [0, 1])], row_len=4)
  assert float(sft.normalizers(one, None)['tokens']) == 1.0
  assert float(sft.sft_loss(jnp.full((1, 4), -3.0), one, sft.SftConfig())[0]) == 3.0
  none = one._replace(loss_mask=np.zeros_like(one.loss_mask))
  assert float(sft.normalizers(none, None)['tokens']) == 1.0


def test_packed_loss_equals_unpacked_per_example():
  cfg = config_lib.ModelConfig.tiny()
  graphdef, params = nnx.split(transformer.create(cfg, seed=1))
  rng = np.random.default_rng(0)
  examples = [_example(rng) for _ in range(7)]
  packed = sft.pack(examples, row_len=24)
  assert packed.tokens.shape[0] < len(examples)             # really packed
  lp = np.asarray(batch_lib.compute_logprobs(graphdef, params, packed))
  nll_packed = {}
  for r in range(packed.tokens.shape[0]):
    for s in range(1, packed.segment_ids[r].max() + 1):
      sel = packed.segment_ids[r] == s
      nll_packed[(r, s)] = -np.sum(lp[r][sel] * packed.loss_mask[r][sel])
  singles = [sft.pack([e], row_len=24) for e in examples]
  nll_single = []
  for one in singles:
    lp1 = np.asarray(batch_lib.compute_logprobs(graphdef, params, one))
    nll_single.append(-float(np.sum(lp1 * one.loss_mask)))
  np.testing.assert_allclose(sorted(nll_packed.values()), sorted(nll_single), rtol=1e-5)
  # The mean loss is the token-weighted mean over examples.
  loss, metrics = sft.sft_loss(jnp.asarray(lp), packed, sft.SftConfig())
  n_tok = sum(float(o.loss_mask.sum()) for o in singles)
  np.testing.assert_allclose(float(loss), sum(nll_single) / n_tok, rtol=1e-5)
  assert float(metrics['tokens']) == n_tok


@pytest.mark.heavy
def test_sft_reduces_held_out_loss():
  cfg = config_lib.ModelConfig.tiny()
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  opt_cfg = ts.OptimizerConfig(lr=3e-3, warmup_steps=5)
  opt = ts.make_optimizer(opt_cfg)
  state = ts.init_state(params, opt)
  loss = ts.LossSpec(sft.SftConfig, sft.loss_fn, sft.normalizers)
  step = ts.make_train_step(graphdef, loss, None, opt, microbatches=2)
  rng = np.random.default_rng(1)
  held_out = sft.pack([_example(rng) for _ in range(32)], row_len=64, num_rows=8)
  evaluate = jax.jit(lambda p: sft.loss_fn(nnx.merge(graphdef, p), held_out, sft.SftConfig(),
                                           sft.normalizers(held_out, None)))
  before, m0 = evaluate(state.params)
  for _ in range(40):
    batch = sft.pack([_example(rng) for _ in range(32)], row_len=64, num_rows=8)
    state, metrics = step(state, batch)
  after, m1 = evaluate(state.params)
  assert int(state.step) == 40 and np.isfinite(float(metrics['loss']))
  print('held-out nll', float(before), '->', float(after), 'accuracy', float(m0['accuracy']),
        '->', float(m1['accuracy']))
  assert float(after) < 0.5 * float(before), (float(before), float(after))
  assert float(m1['accuracy']) > float(m0['accuracy']) + 0.3
