"""launch.plan's analytic FLOP count (`counted_flops`) against XLA's own count where XLA's is
exact: dense attention (the whole [T, T] score matrix, so every key counts), layers unrolled
(XLA counts a loop body once), a training step's forward and backward."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from cascade import policies
from launch.plan import compiler as plan_compiler
from launch.plan import flops as plan_flops
from models import config as model_config


def _xla_train_flops(cfg, rows, length):
  graphdef, params = policies.abstract_model(cfg, 'policy')

  def loss(params, tokens):
    logits = nnx.merge(graphdef, params)(tokens)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), -1))

  tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
  return plan_compiler.xla_flops(jax.jit(jax.grad(loss)).lower(params, tokens))


@pytest.mark.parametrize('length,remat', [
    pytest.param(64, 'none', marks=pytest.mark.heavy), (256, 'none'),
    pytest.param(64, 'full', marks=pytest.mark.heavy)])
def test_counted_train_flops_match_xlas_count(length, remat):
  cfg = model_config.ModelConfig.tiny(
      embed_dim=256, mlp_dim=1024, num_heads=8, num_kv_heads=4, head_dim=32, vocab_size=512,
      num_layers=3, tie_embeddings=False, attention='dense', scan_layers=False, remat=remat,
      max_seq_len=1024)
  rows = 4
  xla = _xla_train_flops(cfg, rows, length)
  # Dense attention scores every key: the count's context is the whole row here (a causal
  # kernel's is (T + 1) / 2, which `step_time` uses).
  counted = plan_flops.counted_flops(cfg, 'policy', rows * length, length, train=True)
  if remat == 'none':
    # The count leaves out softmax, norms and elementwise work: XLA's is a little larger.
    assert 1.0 <= xla / counted < 1.02, xla / counted
  else:
    # The count recomputes every sublayer's forward; XLA may leave out what its backward uses
    # at once (the last layer's), so its count is at most the analytic one.
    assert 0.9 < xla / counted <= 1.0, xla / counted
  # The causal count is below XLA's dense one by the scores of the keys a causal kernel skips.
  assert plan_flops.counted_flops(cfg, 'policy', rows * length, (length + 1) / 2,
                                  train=True) < counted
