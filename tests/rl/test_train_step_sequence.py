"""The train step on a mesh with a sequence axis lays its batch out along the tokens: every
[rows, length, ...] field (tokens, masks, advantages, old log-probs, recorded routing) is split
over 'sequence', so no device holds the whole update batch (a GPU node's mesh (1, 1, 1, 8, 1)
has no other split), and a GRPO step with recorded routing replayed, accumulated over
microbatches, gives the unsharded step's loss, metrics and gradients on 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import config as config_lib
from models import hybrid
from models import sharding
from models import transformer
from rl import batch as batch_lib
from rl import grpo
from rl import train_step as ts

GRPO = ts.LossSpec(grpo.GrpoConfig, grpo.loss_fn, grpo.normalizers)


def _mesh(sequence: int = 8):
  shape = (1, 1, 1, sequence, 1)
  return sharding.make_mesh(shape, jax.devices()[:sequence])


def _init(cfg):
  make = lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, _ = nnx.split(nnx.eval_shape(make))
  return graphdef, jax.jit(lambda: nnx.state(make()))()


def _own_routing(graphdef, params, batch) -> np.ndarray:
  """[B, L, M, k] uint8: the experts the model's routers pick for the batch's tokens."""
  @jax.jit
  def run(params, batch):
    model = nnx.merge(graphdef, params)
    model.collect_moe_stats = True
    batch_lib.policy_stats(model, batch)
    return hybrid.moe_stats(model).indices
  return np.moveaxis(np.asarray(run(params, batch)), 0, 2).astype(np.uint8)


def _grpo_batch(graphdef, params, cfg, b: int, t: int, seed: int = 0) -> batch_lib.TrainBatch:
  """Packed-style rows (several segments, padding between and after them: segments cross the
  8 shards' boundaries) with per-token advantages, old log-probs, and recorded routing: the
  routers' own choice with a tenth of the (token, sublayer) pairs changed to other experts, so
  replay differs from the trainer's own routing."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((b, t), np.int32)
  for r in range(b):
    cuts = np.sort(rng.choice(np.arange(1, t - 2), 3, replace=False))
    seg[r, :cuts[0]] = 1
    seg[r, cuts[0] + 1:cuts[1]] = 2
    seg[r, cuts[1]:cuts[2]] = 3
  tokens = (rng.integers(3, cfg.vocab_size, (b, t)) * (seg > 0)).astype(np.int32)
  same_next = np.concatenate([seg[:, 1:] == seg[:, :-1], np.zeros((b, 1), bool)], 1)
  targets = np.where(same_next & (seg > 0),
                     np.concatenate([tokens[:, 1:], np.zeros((b, 1), np.int32)], 1), 0)
  mask = (same_next & (seg > 0) & (rng.random((b, t)) < 0.8)).astype(np.float32)
  batch = batch_lib.TrainBatch(
      tokens=tokens, positions=batch_lib.positions_from_segments(seg), segment_ids=seg,
      targets=targets.astype(np.int32), loss_mask=mask,
      old_logprobs=(-rng.random((b, t)) * 3 * mask).astype(np.float32),
      advantages=(rng.normal(size=(b, t)) * mask).astype(np.float32))
  routing = _own_routing(graphdef, params, batch)
  experts, k = cfg.num_experts, routing.shape[-1]
  change = rng.random(routing.shape[:3]) < 0.1
  for i in zip(*np.nonzero(change)):
    routing[i] = rng.permutation(experts)[:k]
  routing[seg == 0] = 0
  return batch._replace(routing=routing)


def _step(graphdef, params, batch, mesh, microbatches):
  if mesh is not None:
    params = sharding.shard_state(params, mesh)
  opt = optax.sgd(1.0)
  state = ts.init_state(params, opt, mesh=mesh)
  step = ts.make_train_step(graphdef, GRPO, grpo.GrpoConfig(clip_eps_low=0.2, clip_eps_high=0.3),
                            opt, mesh=mesh, state=None if mesh is None else state,
                            microbatches=microbatches, donate=False)
  new, metrics = step(state, batch)
  grads = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                       state.params, new.params)     # sgd(1): params - new params = gradient
  return grads, {k: float(v) for k, v in metrics.items()}, step


def test_the_batch_is_split_along_its_tokens_on_a_sequence_mesh():
  mesh = _mesh()
  sh = lambda shape: sharding.batch_leaf_sharding(shape, mesh, None)
  assert sh((4, 64)).shard_shape((4, 64)) == (4, 8)
  assert sh((4, 64, 3, 2)).shard_shape((4, 64, 3, 2)) == (4, 8, 3, 2)
  assert sh((4,)).shard_shape((4,)) == (4,)
  assert sh((4, 12)).shard_shape((4, 12)) == (4, 12)       # 8 does not divide 12: whole
  # Without a sequence axis rows alone are split (the classic layout).
  flat = sharding.make_mesh((8, 1, 1), jax.devices()[:8])
  assert sharding.batch_leaf_sharding((8, 64), flat).shard_shape((8, 64)) == (1, 64)


@pytest.mark.heavy
@pytest.mark.parametrize('family', ['tiny_moe', 'tiny_hybrid'])
def test_grpo_step_with_replayed_routing_on_8_sequence_shards_equals_unsharded(family):
  cfg = getattr(config_lib.ModelConfig, family)(attention='blockwise', remat='full',
                                                scan_layers=True, dtype='float32')
  graphdef, params = _init(cfg)
  batch = _grpo_batch(graphdef, params, cfg, b=4, t=64, seed=3)
  ref_g, ref_m, _ = _step(graphdef, params, batch, None, microbatches=2)
  mesh = _mesh()
  g, m, step = _step(graphdef, params, batch, mesh, microbatches=2)
  # The compiled step takes every token-aligned field split 8 ways along its length.
  shardings = step.batch_shardings(batch)
  for name in ('tokens', 'loss_mask', 'advantages', 'old_logprobs', 'routing'):
    x, sh = getattr(batch, name), getattr(shardings, name)
    assert sh.shard_shape(x.shape)[1] == x.shape[1] // 8, name
  assert 0 < ref_m['routing_mismatch'] < 1
  assert set(m) == set(ref_m)
  for k in ref_m:
    np.testing.assert_allclose(m[k], ref_m[k], rtol=2e-5, atol=1e-7, err_msg=k)
  assert max(float(np.abs(x).max()) for x in jax.tree.leaves(ref_g)) > 1e-5
  for a, b in zip(jax.tree.leaves(ref_g), jax.tree.leaves(g)):
    np.testing.assert_allclose(b, a, atol=2e-7, rtol=2e-5)
