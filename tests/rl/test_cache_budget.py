"""The sampler's cache budget counts a hybrid row's Mamba states, and a judge's budget is the
run's in the same bytes (rl.sampler.state_slots, rl.judge.run_sampler_options)."""

import jax
import numpy as np
import pytest

from models import config as config_lib
from models import sharding
from rl import judge
from rl import paged_programs
from rl import sampler

HYBRID = config_lib.ModelConfig.tiny_hybrid()
DENSE = config_lib.ModelConfig.tiny()


def _bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _sampler(cfg, **kw):
  return sampler.Sampler(None, cfg, eos_ids=(1,), **kw)


def test_row_state_bytes_are_the_engines_state_pool_per_slot():
  pool = jax.eval_shape(lambda: paged_programs.init_states(HYBRID, 3))
  assert sampler.row_state_bytes(HYBRID) * 3 == _bytes(pool) > 0
  assert sampler.row_state_bytes(DENSE) == 0 and sampler.state_slots(DENSE) == 0
  kv = sampler.kv_token_bytes(HYBRID)
  assert kv == HYBRID.attention_layers * 2 * HYBRID.num_kv_heads * HYBRID.head_dim * (
      HYBRID.jnp_dtype.itemsize) > 0
  assert sampler.state_slots(HYBRID) == -(-_bytes(pool) // (3 * kv))


def test_a_hybrid_rows_states_come_out_of_the_budget():
  extra = sampler.state_slots(HYBRID)
  assert extra > 0
  # 5 rows of 64 KV slots plus their states fit: a power of two, 4.
  assert _sampler(HYBRID, cache_tokens_per_device=5 * (64 + extra)).chunk_rows(100, 64) == 4
  # 5 rows' KV slots alone leave no room for their states: 320 // (64 + extra) rows, 2.
  rows = 5 * 64 // (64 + extra)
  assert _sampler(HYBRID, cache_tokens_per_device=5 * 64).chunk_rows(100, 64) == (
      1 << (rows.bit_length() - 1)) < 4
  assert _sampler(DENSE, cache_tokens_per_device=5 * 64).chunk_rows(100, 64) == 4


@pytest.mark.parametrize('cfg', [HYBRID, DENSE], ids=['hybrid', 'dense'])
def test_paged_pool_is_the_budget_left_after_the_slots_states(cfg):
  budget, page = 4096, 16
  s = _sampler(cfg, engine='paged', page_size=page, cache_tokens_per_device=budget)
  slots = s.chunk_rows(64, 128)
  eng = s._rollout.engine(slots)  # pylint: disable=protected-access
  want = (budget - slots * sampler.state_slots(cfg)) // page
  assert eng.opt.pages == want
  # What the pool and the states take together stays within the budget's bytes.
  kv = sampler.kv_token_bytes(cfg)
  used = eng.opt.pages * page * kv + slots * sampler.row_state_bytes(cfg)
  assert used <= budget * kv
  fixed = _sampler(cfg, engine='paged', page_size=page, pages=7, cache_tokens_per_device=budget)
  assert fixed._rollout.engine(slots).opt.pages == 7   # pylint: disable=protected-access


def test_a_judges_options_keep_the_runs_bytes():
  big = config_lib.ModelConfig.tiny(num_layers=6, num_kv_heads=4)
  run = dict(cache_tokens_per_device=6000, pages=800, page_size=16, engine='paged',
             prompt_buckets=(64,), new_token_buckets=(32,), rollout_rules=(('embed', None),))
  out = judge.run_sampler_options(run, big, DENSE)
  ratio = sampler.kv_token_bytes(DENSE) / sampler.kv_token_bytes(big)
  assert ratio < 1
  assert out['cache_tokens_per_device'] == int(6000 * ratio)
  assert out['pages'] == int(800 * ratio)
  assert out['engine'] == 'paged' and out['page_size'] == 16
  assert not {'prompt_buckets', 'new_token_buckets', 'rollout_rules'} & set(out)
  assert run['cache_tokens_per_device'] == 6000               # the run's options untouched
  same = judge.run_sampler_options(run, DENSE, DENSE)
  assert same['cache_tokens_per_device'] == 6000 and same['pages'] == 800


def test_a_judges_pages_stay_a_multiple_of_the_batch_shards():
  mesh = sharding.make_mesh((2, 2, 2))
  big = config_lib.ModelConfig.tiny(num_layers=6)
  shards = sharding.batch_shards(mesh)
  out = judge.run_sampler_options(dict(pages=100 * shards, cache_tokens_per_device=999), big,
                                  DENSE, mesh)
  assert out['pages'] % shards == 0 and 0 < out['pages'] < 100 * shards
