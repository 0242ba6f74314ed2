"""A generative judge's sampler on a sequence mesh: it keeps the run's rollout rules that move no
weight (its rows split as many ways as the policy's), drops those that do, and samples with its
params as they are (issue #36; rl.judge.run_sampler_options, rl.sampler.Sampler.rollout_params,
models.sharding.ACTIVATION_AXES)."""

import types

import jax
import numpy as np
import pytest
from flax import nnx

from cascade import policies
from launch.plan import memory as plan_memory
from models import config as config_lib
from models import sharding
from models import transformer
from rl import judge
from rl import sampler

DENSE = config_lib.ModelConfig.tiny()
BIG = config_lib.ModelConfig.tiny(num_layers=6, num_kv_heads=4)    # 6x the policy's KV bytes
SEQUENCE_ROWS = ('batch', ('data', 'fsdp', 'expert', 'sequence'))  # configs/_recipes.py's rule
RUN = dict(engine='paged', page_size=16, pages=100 * 4, cache_tokens_per_device=6000,
           prompt_buckets=(64,), new_token_buckets=(32,),
           rollout_rules=(('embed', None), SEQUENCE_ROWS))


@pytest.fixture(scope='module')
def mesh():
  assert jax.device_count() >= 8
  return sharding.make_mesh((1, 1, 2, 2, 2))       # (data, fsdp, expert, sequence, tensor)


@pytest.mark.parametrize('cfg', [DENSE, config_lib.ModelConfig.tiny_hybrid(),
                                 config_lib.ModelConfig.tiny_moe()],
                         ids=['dense', 'hybrid', 'moe'])
@pytest.mark.parametrize('kind', ['policy', 'reward_model'])
def test_no_parameter_carries_an_activation_axis(cfg, kind):
  _, params = policies.abstract_model(cfg, kind)
  named = set()
  for _, v in nnx.to_flat_state(params):
    axes = v.get_metadata().get('logical_axes')
    assert axes is not None and len(axes) == len(v.get_value().shape), v
    named.update(a for a in axes if a is not None)
  assert named and not named & set(sharding.ACTIVATION_AXES), named & set(sharding.ACTIVATION_AXES)
  assert named <= {k for k, _ in sharding.DEFAULT_RULES}
  assert set(sharding.ACTIVATION_AXES) <= {k for k, _ in sharding.DEFAULT_RULES}


def test_a_judge_keeps_the_runs_row_split_and_drops_weight_moves(mesh):
  out = judge.run_sampler_options(RUN, BIG, DENSE, mesh)
  assert out['rollout_rules'] == (SEQUENCE_ROWS,)           # ('embed', None) moves weights
  assert RUN['rollout_rules'] == (('embed', None), SEQUENCE_ROWS)    # the run's untouched
  policy = sampler.Sampler(None, DENSE, eos_ids=(1,), mesh=mesh, **RUN)
  judge_sampler = sampler.Sampler(None, BIG, eos_ids=(1,), mesh=mesh, **out)
  shards = sharding.batch_shards(mesh, judge_sampler.rules)
  assert shards == sharding.batch_shards(mesh, policy.rules) == 8 // 2   # all but 'tensor'
  assert shards > sharding.batch_shards(mesh)                            # the bare rules: 2
  assert judge_sampler.chunk_rows(1, 96) % shards == 0
  # Pages are per batch shard: the policy's 100 per shard hold 1/6 as many of the judge's tokens
  # (the bare rules' 2 shards would give 2 x (200 // 6) = 66).
  theirs, mine = sampler.kv_token_bytes(DENSE, mesh), sampler.kv_token_bytes(BIG, mesh)
  assert (theirs, mine) == (2 * 2 * 1 * 16 * 4, 6 * 2 * 2 * 16 * 4)   # kv heads over 'tensor'
  assert out['pages'] == (100 * theirs // mine) * shards == 16 * 4
  assert out['cache_tokens_per_device'] == 6000 * theirs // mine
  # Without a row rule there is nothing to keep, and nothing is added.
  bare = judge.run_sampler_options(dict(RUN, rollout_rules=(('embed', None),)), BIG, DENSE, mesh)
  assert 'rollout_rules' not in bare


def test_a_judge_samples_with_its_params_themselves(mesh):
  graphdef, params = nnx.split(_model(mesh))
  tokenizer = types.SimpleNamespace(eos_id=1, pad_id=0, vocab_size=DENSE.vocab_size)
  jm = judge.JudgeModel(graphdef, params, DENSE, tokenizer, mesh=mesh, sampler_options=RUN,
                        policy_cfg=DENSE)
  assert jm.sampler.rollout_rules == (SEQUENCE_ROWS,)
  assert jm.sampler.rollout_params(params) is params
  assert jm.sampler.prepare(params).params is params
  # The same for abstract params (launch.plan counts the judge's rollout copy as 0 bytes).
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          params)
  assert jm.sampler.rollout_params(abstract) is abstract
  assert plan_memory.judge_bytes(DENSE, True, mesh, None, RUN, DENSE)[1] == 0


def test_a_rule_that_moves_weights_still_copies_them(mesh):
  graphdef, params = nnx.split(_model(mesh))
  s = sampler.Sampler(graphdef, DENSE, eos_ids=(1,), mesh=mesh, rollout_rules=(('mlp', None),))
  rolled = s.rollout_params(params)
  assert rolled is not params
  moved = [(a.sharding.spec, b.sharding.spec) for a, b in
           zip(jax.tree.leaves(params), jax.tree.leaves(rolled))
           if not a.sharding.is_equivalent_to(b.sharding, a.ndim)]
  # The MLP's three matrices (tiny: no bias), their 'mlp' dimension no longer over 'tensor'.
  assert len(moved) == 3 and all('tensor' in tuple(old) and
                                 'tensor' not in tuple(new) for old, new in moved), moved
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(rolled)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # ('embed', None) moves nothing on this mesh ('fsdp' is 1 wide): no copy.
  s = sampler.Sampler(graphdef, DENSE, eos_ids=(1,), mesh=mesh, rollout_rules=(('embed', None),))
  assert s.rollout_params(params) is params


def test_a_row_rule_samples_as_the_bare_rules_do(mesh):
  graphdef, params = nnx.split(_model(mesh))
  kw = dict(eos_ids=(1,), pad_id=0, mesh=mesh, prompt_buckets=(16,), new_token_buckets=(16,))
  rows = sampler.Sampler(graphdef, DENSE, rollout_rules=(SEQUENCE_ROWS,), **kw)
  bare = sampler.Sampler(graphdef, DENSE, **kw)
  prompts = [[5, 6, 7], [11, 12], [20, 21, 22, 23], [40]]
  sp = sampler.SamplingParams(max_new_tokens=8, greedy=True)
  out = rows.generate(params, prompts, jax.random.key(0), sp)
  ref = bare.generate(params, prompts, jax.random.key(0), sp)
  assert out.tokens.shape[0] % 4 == 0 and ref.tokens.shape[0] % 2 == 0
  np.testing.assert_array_equal(np.asarray(out.tokens)[:4], np.asarray(ref.tokens)[:4])
  np.testing.assert_allclose(np.asarray(out.logprobs)[:4], np.asarray(ref.logprobs)[:4],
                             atol=1e-4)


def _model(mesh):
  """The tiny dense model, born sharded on `mesh` with the default rules."""
  return transformer.create(DENSE, seed=0, mesh=mesh)
