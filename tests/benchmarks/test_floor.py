"""benchmarks.floor: the generation floor counts the active parameters, attention in the attention
sublayers only and the Mamba state; the dense sums are the ones the benchmarks always printed;
the bare loop's mixture-of-experts sublayer computes the routed experts exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import floor
from models import config as config_lib

RATE, BANDWIDTH = 5e10, 1e10


def _dense_sums(cfg, batch, prompt, new):
  """The dense floor as written before the mixture-of-experts families: (flops, bytes)."""
  d, n, k, h, f, v, l = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.mlp_dim, cfg.vocab_size, cfg.num_layers)
  block = l * (d * n * h * 2 + d * k * h * 2 + 3 * d * f)
  kv = 4 * l * 2 * k * h
  flops = batch * (2 * block * prompt + 2 * d * v + l * 4 * n * h * prompt * (prompt + 1) / 2)
  nbytes = 4 * cfg.num_params() + batch * prompt * kv
  for t in range(1, new):
    flops += batch * (2 * (block + d * v) + l * 4 * n * h * (prompt + t))
    nbytes += 4 * cfg.num_params() + batch * (prompt + t) * kv
  return flops, nbytes


def test_dense_floor_is_unchanged():
  cfg = config_lib.ModelConfig(embed_dim=192, num_layers=2, num_heads=6, num_kv_heads=6,
                               head_dim=32, mlp_dim=768)
  fl = floor.generation_floor(cfg, 32, 16, 64, RATE, BANDWIDTH)
  assert (fl['flops'], fl['bytes']) == _dense_sums(cfg, 32, 16, 64)
  assert fl['experts_read'] == 0 and fl['step_state_bytes'] == 0


def test_routed_experts_count_only_the_chosen_ones_in_flops():
  cfg = config_lib.ModelConfig.tiny_moe()
  top4 = cfg.replace(experts_per_token=4)
  batch, prompt, new = 2, 8, 5
  extra = (floor.generation_floor(top4, batch, prompt, new, RATE, BANDWIDTH)['flops']
           - floor.generation_floor(cfg, batch, prompt, new, RATE, BANDWIDTH)['flops'])
  # Two more SwiGLU experts per token in each of the 2 moe sublayers, prompt and decode tokens.
  per_expert = 2 * 3 * cfg.embed_dim * cfg.moe_dim
  assert extra == 2 * 2 * per_expert * batch * (prompt + new - 1)


def test_weight_bytes_read_every_touched_expert():
  cfg = config_lib.ModelConfig.tiny_moe()
  expert = 4 * 3 * cfg.embed_dim * cfg.moe_dim
  one_row = floor.generation_floor(cfg, 1, 4, 3, RATE, BANDWIDTH)
  many = floor.generation_floor(cfg, 32, 4, 3, RATE, BANDWIDTH)
  assert (one_row['experts_read'], many['experts_read']) == (2, 8)
  # Untied: the input embedding's rows looked up, not the table.
  unread_rows = (cfg.vocab_size - 1) * cfg.embed_dim * 4
  assert one_row['step_weight_bytes'] == 4 * cfg.num_params() - 2 * 6 * expert - unread_rows
  assert many['step_weight_bytes'] == 4 * cfg.num_params() - (cfg.vocab_size - 32) * 64 * 4


def test_hybrid_floor_counts_attention_in_attention_sublayers_and_the_mamba_state():
  cfg = config_lib.ModelConfig.tiny_hybrid()
  batch, prompt = 3, 8
  steps = [floor.generation_floor(cfg, batch, prompt, new, RATE, BANDWIDTH) for new in (4, 5)]
  flops = steps[1]['flops'] - steps[0]['flops']        # the decode step at slot prompt + 4
  bytes_ = steps[1]['bytes'] - steps[0]['bytes']
  d, n, h = cfg.embed_dim, cfg.num_heads, cfg.head_dim
  hp, gn = cfg.mamba_heads * cfg.mamba_head_dim, cfg.mamba_groups * cfg.mamba_state
  matmuls = (2 * (d * n * h * 2 + d * cfg.num_kv_heads * h * 2)                   # attention
             + 2 * 2 * (d * (2 * hp + 2 * gn + cfg.mamba_heads) + hp * d)          # 2 mamba
             + 2 * (2 * (d * 8 + 2 * d * (2 * cfg.moe_dim + cfg.shared_expert_dim)))  # 2 moe
             + 2 * 2 * d * cfg.mlp_dim + 2 * d * cfg.vocab_size)                   # mlp, logits
  mamba_other = 2 * (2 * cfg.mamba_conv * cfg.mamba_conv_dim + 5 * hp * cfg.mamba_state)
  attention = 4 * n * h * (prompt + 4)                                             # 1 sublayer
  assert flops == batch * (matmuls + mamba_other + attention)
  state = 4 * 2 * (hp * cfg.mamba_state + (cfg.mamba_conv - 1) * cfg.mamba_conv_dim)
  kv = 4 * 2 * cfg.num_kv_heads * h * (prompt + 4)
  assert bytes_ == steps[0]['step_weight_bytes'] + batch * (kv + 2 * state)
  assert steps[0]['step_state_bytes'] == batch * 2 * state


def test_bare_moe_is_the_routed_experts_exactly():
  cfg = config_lib.ModelConfig.tiny_moe()
  weights = floor._bare_weights(cfg, np.random.default_rng(0))
  p = weights['layers'][cfg.mixers.index('moe')]
  x = jnp.asarray(np.random.default_rng(1).standard_normal((5, cfg.embed_dim), np.float32))
  got = floor._bare_moe(cfg, x, p)
  top, idx = jax.lax.top_k(x @ p['router'], cfg.experts_per_token)
  w = jax.nn.softmax(top)
  e, f = cfg.num_experts, cfg.moe_dim
  gate = p['experts']['gate'].reshape(-1, e, f)
  up = p['experts']['up'].reshape(-1, e, f)
  down = p['experts']['down'].reshape(e, f, -1)
  want = np.zeros_like(np.asarray(got))
  for r in range(x.shape[0]):
    for j in range(cfg.experts_per_token):
      i = int(idx[r, j])
      want[r] += float(w[r, j]) * np.asarray(
          (jax.nn.silu(x[r] @ gate[:, i]) * (x[r] @ up[:, i])) @ down[i])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.heavy
@pytest.mark.parametrize('preset', ['tiny_hybrid', 'tiny_moe'])
def test_bare_loop_runs_the_families(preset):
  cfg = getattr(config_lib.ModelConfig, preset)()
  for attention in (True, False):
    assert floor.xla_decode_loop(cfg, 2, 4, 3, attention=attention, repeats=1) > 0
