"""Chunked log-probs / entropy / argmax: equal to the full-logits computation, without [B, L, V]."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as model_config
from models import transformer
from rl import batch as batch_lib


def _model(vocab=96, layers=1):
  cfg = model_config.ModelConfig.tiny(vocab_size=vocab, embed_dim=32, num_layers=layers,
                                      num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                                      max_seq_len=4096)
  return transformer.create(cfg, seed=3)


def _rows(b, l, vocab, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, vocab, (b, l)).astype(np.int32)
  seg = np.ones((b, l), np.int32)
  seg[0, :3] = 0                                  # left padding in one row
  positions = np.maximum(np.cumsum(seg, 1) - 1, 0) * seg
  targets = np.concatenate([tokens[:, 1:], np.zeros((b, 1), np.int32)], 1)
  return tokens, positions.astype(np.int32), seg, targets


@pytest.mark.heavy
@pytest.mark.parametrize('chunk', [4, 13])
def test_chunked_stats_and_gradients_equal_the_full_logits(chunk):
  model = _model()
  graphdef, params = nnx.split(model)
  tokens, positions, seg, targets = _rows(3, 13, 96)
  weights = jnp.asarray(np.random.default_rng(1).normal(size=(3, 13)), jnp.float32)

  def objective(p, c):
    m = nnx.merge(graphdef, p)
    st = batch_lib.token_stats(m, tokens, positions, seg, targets, entropy=True, argmax=True,
                               chunk=c)
    return jnp.sum(weights * (st['logprobs'] + 0.1 * st['entropy'])), st

  (full, st_full), g_full = jax.value_and_grad(objective, has_aux=True)(params, 10_000)
  (part, st_part), g_part = jax.value_and_grad(objective, has_aux=True)(params, chunk)
  logits = model(tokens, positions, seg)
  np.testing.assert_allclose(st_full['logprobs'], batch_lib.token_logprobs(logits, targets),
                             atol=1e-6)
  for k in ('logprobs', 'entropy'):
    np.testing.assert_allclose(st_part[k], st_full[k], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(st_part['argmax'], st_full['argmax'])
  assert abs(float(part) - float(full)) < 1e-4
  for a, b in zip(jax.tree.leaves(g_part), jax.tree.leaves(g_full)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_a_long_row_never_holds_full_length_logits():
  """Compiled loss-and-gradient memory of the output projection: chunked stays far below one
  [B, L, V] float32 buffer, the one-shot path holds several."""
  vocab, b, l = 8192, 2, 4096
  model = _model(vocab=vocab)
  graphdef, params = nnx.split(model)
  h = jax.ShapeDtypeStruct((b, l, model.cfg.embed_dim), jnp.float32)
  targets = jax.ShapeDtypeStruct((b, l), jnp.int32)

  def loss(p, hidden, tgt, chunk):
    m = nnx.merge(graphdef, p)
    return jnp.sum(batch_lib.stats_from_hidden(m, hidden, tgt, entropy=True,
                                               chunk=chunk)['logprobs'])

  def temp_bytes(chunk):
    f = jax.jit(jax.grad(functools.partial(loss, chunk=chunk), argnums=(0, 1)))
    return f.lower(params, h, targets).compile().memory_analysis().temp_size_in_bytes

  full_logits = b * l * vocab * 4
  chunked, full = temp_bytes(256), temp_bytes(10_000)
  assert full >= full_logits                 # the one-shot path holds them (at least once)
  assert chunked < full_logits / 4, (chunked, full_logits)
  # Memory follows the chunk, not the row length: twice the chunk, about twice the temps.
  assert temp_bytes(512) < 3 * chunked
