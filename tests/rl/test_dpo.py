"""DPO: loss and gradient vs numpy, pair layout, reference log-probs, microbatching, learning."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import config as config_lib
from models import sharding
from models import transformer
from rl import dpo
from rl import train_step as ts

CFG = config_lib.ModelConfig.tiny()


class _ByteTokenizer:
  """Bytes shifted past the special ids: pad 0, eos 1."""
  pad_id = 0
  eos_id = 1

  def encode(self, text):
    return [b % 250 + 3 for b in text.encode()]


TOK = _ByteTokenizer()


# ---------------------------------------------------------------- the loss vs numpy

def _numpy_dpo(pc, pr, rc, rr, valid, beta, eps, loss_type):
  """Loss and its gradient w.r.t. (pc, pr) in float64, written from the papers."""
  h = (pc - rc) - (pr - rr)
  n = max(valid.sum(), 1.0)
  sig = lambda x: 1.0 / (1.0 + np.exp(-x))
  if loss_type == 'sigmoid':
    z = beta * h
    per = -(1 - eps) * np.log(sig(z)) - eps * np.log(sig(-z))
    dh = beta * (-(1 - eps) * sig(-z) + eps * sig(z))
  else:
    per = (h - 1 / (2 * beta)) ** 2
    dh = 2 * (h - 1 / (2 * beta))
  return np.sum(per * valid) / n, dh * valid / n, -dh * valid / n


@pytest.mark.parametrize('beta,eps,loss_type', [(0.1, 0.0, 'sigmoid'), (0.5, 0.0, 'sigmoid'),
                                                (0.1, 0.2, 'sigmoid'), (0.3, 0.0, 'ipo')])
def test_loss_and_gradient_match_numpy(beta, eps, loss_type):
  rng = np.random.default_rng(0)
  pc, pr, rc, rr = (-rng.uniform(5, 40, 12) for _ in range(4))
  pc[:8] = rc[:8] + 1.0         # most pairs ranked right: an accuracy far from 1/2
  pr[:8] = rr[:8] - 1.0
  valid = np.ones(12)
  valid[[3, 7]] = 0
  cfg = dpo.DpoConfig(beta=beta, label_smoothing=eps, loss_type=loss_type)
  f32 = lambda x: jnp.asarray(x, jnp.float32)

  def loss(pc, pr):
    return dpo.dpo_loss(pc, pr, f32(rc), f32(rr), cfg, valid=f32(valid))

  (got, metrics), (gc, gr) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(f32(pc), f32(pr))
  want, wc, wr = _numpy_dpo(pc, pr, rc, rr, valid, beta, eps, loss_type)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  np.testing.assert_allclose(gc, wc, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(gr, wr, rtol=1e-5, atol=1e-7)
  on = valid > 0
  cr, rj = beta * (pc - rc), beta * (pr - rr)
  assert np.mean(cr[on] > rj[on]) >= 0.6
  np.testing.assert_allclose(float(metrics['accuracy']), np.mean(cr[on] > rj[on]), rtol=1e-6)
  np.testing.assert_allclose(float(metrics['margin']), np.mean(cr[on] - rj[on]), rtol=1e-5)
  np.testing.assert_allclose(float(metrics['chosen_reward']), np.mean(cr[on]), rtol=1e-5)
  np.testing.assert_allclose(float(metrics['rejected_reward']), np.mean(rj[on]), rtol=1e-5)
  assert float(metrics['pairs']) == 10


def test_beta_scales_rewards_and_the_gradient_at_the_reference():
  rng = np.random.default_rng(1)
  pc, pr = jnp.asarray(-rng.uniform(5, 20, (2, 6)), jnp.float32)
  shift = jnp.asarray(rng.normal(size=6), jnp.float32)
  margins = []
  for beta in (0.1, 0.4):
    cfg = dpo.DpoConfig(beta=beta)
    # At the reference (h = 0) the loss is log 2 and d loss / d log pi(y_c) = -beta / 2B.
    g = jax.grad(lambda c: dpo.dpo_loss(c, pr, pc, pr, cfg)[0])(pc)
    np.testing.assert_allclose(g, np.full(6, -beta / 12), rtol=1e-6)
    assert float(dpo.dpo_loss(pc, pr, pc, pr, cfg)[0]) == pytest.approx(math.log(2), rel=1e-6)
    margins.append(float(dpo.dpo_loss(pc + shift, pr, pc, pr, cfg)[1]['margin']))
  assert margins[1] == pytest.approx(4 * margins[0], rel=1e-5)


def test_label_smoothing_makes_a_finite_margin_optimal():
  """cDPO's loss is minimised at beta h = log((1 - eps) / eps), where it equals H(eps)."""
  eps, beta = 0.1, 0.2
  cfg = dpo.DpoConfig(beta=beta, label_smoothing=eps)
  loss = lambda h: dpo.dpo_loss(h, jnp.zeros_like(h), jnp.zeros_like(h), jnp.zeros_like(h),
                                cfg)[0]
  h_star = math.log((1 - eps) / eps) / beta
  g = jax.grad(loss)(jnp.full(4, h_star, jnp.float32))
  np.testing.assert_allclose(g, 0.0, atol=1e-7)
  entropy = -(eps * math.log(eps) + (1 - eps) * math.log(1 - eps))
  assert float(loss(jnp.full(4, h_star, jnp.float32))) == pytest.approx(entropy, rel=1e-5)
  # Beyond the optimum the gradient pushes the margin back; plain DPO never does.
  assert float(jax.grad(loss)(jnp.full(4, 2 * h_star, jnp.float32))[0]) > 0
  plain = dpo.DpoConfig(beta=beta)
  assert float(jax.grad(lambda h: dpo.dpo_loss(h, 0 * h, 0 * h, 0 * h, plain)[0])(
      jnp.full(4, 2 * h_star, jnp.float32))[0]) < 0


def test_config_is_validated():
  assert ts.loss_config(DPO, {'beta': 0.2}) == dpo.DpoConfig(beta=0.2)
  for bad in (dict(beta=0.0), dict(label_smoothing=0.5), dict(label_smoothing=-0.1),
              dict(loss_type='hinge'), dict(loss_type='ipo', label_smoothing=0.1)):
    with pytest.raises(ValueError, match='DpoConfig'):
      dpo.DpoConfig(**bad)


# ---------------------------------------------------------------- pairs and log-probs

def test_pair_layout_learns_only_response_tokens():
  b = dpo.make_batch(TOK, ['ab', 'x'], ['cd', 'yz'], ['e', 'w'], max_len=64)
  a, bb, c, d, e = (TOK.encode(ch)[0] for ch in 'abcde')
  assert b.chosen_tokens.shape == b.rejected_tokens.shape == (2, 16)
  np.testing.assert_array_equal(b.chosen_tokens[0, :6], [a, bb, c, d, 1, 0])
  np.testing.assert_array_equal(b.chosen_targets[0, :6], [bb, c, d, 1, 0, 0])
  # The prompt's only target inside the prompt ('a' -> 'b') carries no loss.
  np.testing.assert_array_equal(b.chosen_loss_mask[0, :6], [0, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(b.rejected_tokens[0, :5], [a, bb, e, 1, 0])
  np.testing.assert_array_equal(b.rejected_loss_mask[0, :5], [0, 1, 1, 0, 0])
  np.testing.assert_array_equal(b.chosen_segment_ids[0, :6], [1, 1, 1, 1, 1, 0])
  np.testing.assert_array_equal(b.chosen_positions[0, :6], [0, 1, 2, 3, 4, 0])
  assert b.chosen_loss_mask[1].sum() == 3 and b.rejected_loss_mask[1].sum() == 2
  np.testing.assert_array_equal(b.ref_chosen_logps, [0, 0])
  # An EOS already at the end of a response is not doubled.
  assert dpo.encode(TOK, 'p', 'q')[1] == dpo.encode(TOK, 'p', 'q' + chr(254))[1][:1] + [1]


def test_long_pairs_lose_the_prompt_start_first_then_the_response_end():
  b = dpo.make_batch(TOK, ['0123456789'], ['abc'], ['abcdef'], max_len=12)
  # 7 response tokens (6 + EOS) leave 5 prompt tokens: '56789'.
  assert b.chosen_tokens.shape == (1, 12)
  np.testing.assert_array_equal(b.rejected_tokens[0], TOK.encode('56789abcdef') + [1])
  np.testing.assert_array_equal(b.chosen_tokens[0, :9], TOK.encode('56789abc') + [1])
  assert b.chosen_loss_mask.sum() == 4 and b.rejected_loss_mask.sum() == 7
  b = dpo.make_batch(TOK, ['01'], ['abcdefgh'], ['x'], max_len=4)
  np.testing.assert_array_equal(b.chosen_tokens[0], TOK.encode('1abc'))
  np.testing.assert_array_equal(b.chosen_loss_mask[0], [1, 1, 1, 0])
  b = dpo.make_batch(TOK, ['p'], ['c'], ['r'], max_len=64, num_pairs=4)
  assert b.chosen_tokens.shape[0] == 4
  np.testing.assert_array_equal(dpo.pair_valid(b), [1, 0, 0, 0])
  with pytest.raises(ValueError, match='pair 1 has an empty prompt'):
    dpo.make_batch(TOK, ['p', ''], ['c', 'c'], ['r', 'r'], max_len=64)
  with pytest.raises(ValueError, match='2 prompts, 1 chosen'):
    dpo.make_batch(TOK, ['p', 'q'], ['c'], ['r', 'r'], max_len=64)


def test_sequence_and_reference_logps_are_response_only():
  model = transformer.create(CFG, seed=3)
  graphdef, params = nnx.split(model)
  prompts, chosen, rejected = ['Say hi:', 'Q?'], ['hi', 'yes it is'], ['bye now', 'no']
  batch = dpo.make_batch(TOK, prompts, chosen, rejected, max_len=32, num_pairs=3)
  # By hand: each unpadded row's log pi(response | prompt), indexed from its own forward pass.
  rows = [dpo.encode(TOK, p, x) for xs in (chosen, rejected) for p, x in zip(prompts, xs)]
  tokens = np.zeros((4, 32), np.int32)
  for i, (p, r) in enumerate(rows):
    tokens[i, :len(p) + len(r)] = p + r
  positions = np.broadcast_to(np.arange(32, dtype=np.int32), (4, 32))
  logp = jax.nn.log_softmax(jax.jit(model.__call__)(tokens, positions, np.ones_like(tokens)), -1)
  want = [sum(float(logp[i, len(p) - 1 + j, t]) for j, t in enumerate(r))
          for i, (p, r) in enumerate(rows)]
  got_c, got_r = jax.jit(lambda p: dpo.sequence_logps(nnx.merge(graphdef, p), batch))(params)
  np.testing.assert_allclose(np.concatenate([got_c[:2], got_r[:2]]), want, rtol=1e-5)
  assert float(got_c[2]) == float(got_r[2]) == 0.0            # the padding pair
  for rows_per_call in (None, 2):                              # chunked: padded last chunk
    ref_c, ref_r = dpo.reference_logps(graphdef, params, batch, rows_per_call=rows_per_call)
    np.testing.assert_allclose(ref_c, np.asarray(got_c), rtol=1e-5)
    np.testing.assert_allclose(ref_r, np.asarray(got_r), rtol=1e-5)


# ---------------------------------------------------------------- the train step

def _random_pairs(rng, n):
  word = lambda: ''.join(chr(c) for c in rng.integers(97, 123, int(rng.integers(1, 9))))
  return [word() + ':' for _ in range(n)], [word() for _ in range(n)], [word() for _ in range(n)]


def _with_reference(graphdef, params, batch):
  ref_c, ref_r = dpo.reference_logps(graphdef, params, batch)
  return batch._replace(ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)


OPT = ts.make_optimizer(ts.OptimizerConfig(lr=1e-3, clip_norm=0.0))
DPO_CFG = dpo.DpoConfig(beta=0.2, label_smoothing=0.1)
DPO = ts.LossSpec(dpo.DpoConfig, dpo.loss_fn, dpo.normalizers)


@functools.cache
def _full_batch_step():
  """A policy, a batch scored by a different reference, and one unsharded full-batch step."""
  graphdef, policy = nnx.split(transformer.create(CFG, seed=0))
  _, reference = nnx.split(transformer.create(CFG, seed=1))
  batch = _with_reference(graphdef, reference,
                          dpo.make_batch(TOK, *_random_pairs(np.random.default_rng(0), 8), 32))
  state, metrics = ts.make_train_step(graphdef, DPO, DPO_CFG, OPT)(_init(policy), batch)
  return graphdef, policy, batch, state, metrics


def _init(params, mesh=None):
  return ts.init_state(jax.tree.map(jnp.copy, params), OPT, mesh=mesh)


def _adam_mu(state):
  """Adam's first moment after one step: (1 - b1) * gradient (no clipping)."""
  return optax.tree_utils.tree_get(state.opt_state, 'mu')


def _max_diff(a, b):
  return max(float(jnp.max(jnp.abs(jnp.asarray(x) - jnp.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# Slow: microbatching is one code path for every loss (test_train_step checks it by default).
@pytest.mark.slow
def test_microbatched_step_equals_full_batch_step():
  graphdef, policy, batch, full, m1 = _full_batch_step()
  mu = _adam_mu(full)
  assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(mu)) > 1e-4
  assert 0 < float(m1['accuracy']) < 1 and float(m1['pairs']) == 8
  for m in (2, 4):
    micro, mm = ts.make_train_step(graphdef, DPO, DPO_CFG, OPT, microbatches=m)(
        _init(policy), batch)
    assert _max_diff(mu, _adam_mu(micro)) < 1e-8, m
    for k in ('loss', 'accuracy', 'margin', 'chosen_reward', 'rejected_reward', 'chosen_logps',
              'rejected_logps', 'pairs', 'grad_norm'):
      np.testing.assert_allclose(float(mm[k]), float(m1[k]), rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.heavy
def test_sharded_step_equals_unsharded():
  graphdef, policy, batch, full, m1 = _full_batch_step()
  mesh = sharding.make_mesh((2, 2, 2))
  state = _init(policy, mesh)
  step = ts.make_train_step(graphdef, DPO, DPO_CFG, OPT, mesh=mesh, state=state,
                            microbatches=2)
  state, metrics = step(state, batch)
  assert _max_diff(_adam_mu(full), _adam_mu(state)) < 1e-7
  np.testing.assert_allclose(float(metrics['loss']), float(m1['loss']), rtol=1e-5)


# ---------------------------------------------------------------- learning

_LETTERS = 'abcdefghijklmnopqrstuvwxyz'


def _runs(rng, n, starts):
  """'+k:' prefers the 4 letters after k (ascending), '-k:' the 4 before it; the other is rejected."""
  prompts, chosen, rejected = [], [], []
  for _ in range(n):
    s = int(rng.choice(starts))
    up = ''.join(_LETTERS[(s + i) % 26] for i in range(1, 5))
    down = ''.join(_LETTERS[(s - i) % 26] for i in range(1, 5))
    sign = rng.integers(2)
    prompts.append(f'{"+-"[sign]}{_LETTERS[s]}:')
    chosen.append((up, down)[sign])
    rejected.append((down, up)[sign])
  return prompts, chosen, rejected


@pytest.mark.heavy
def test_dpo_raises_held_out_preference_accuracy_and_margin():
  graphdef, params = nnx.split(transformer.create(CFG, seed=0))
  reference = jax.tree.map(jnp.copy, params)
  cfg = dpo.DpoConfig(beta=0.1)
  opt = ts.make_optimizer(ts.OptimizerConfig(lr=3e-3, warmup_steps=5))
  state = ts.init_state(params, opt)
  step = ts.make_train_step(graphdef, DPO, cfg, opt)
  rng = np.random.default_rng(0)
  train_starts = [s for s in range(26) if s % 4]
  held_out = _with_reference(graphdef, reference,
                             dpo.make_batch(TOK, *_runs(rng, 64, [0, 4, 8, 12, 16, 20, 24]), 16))
  evaluate = jax.jit(lambda p: dpo.loss_fn(nnx.merge(graphdef, p), held_out, cfg,
                                           dpo.normalizers(held_out, cfg)))
  before, m0 = evaluate(state.params)
  # The reference is the initial policy: every implicit reward is 0, the loss log 2.
  assert float(before) == pytest.approx(math.log(2), abs=1e-5)
  assert abs(float(m0['margin'])) < 1e-5
  for _ in range(40):
    batch = _with_reference(graphdef, reference,
                            dpo.make_batch(TOK, *_runs(rng, 16, train_starts), 16))
    state, metrics = step(state, batch)
  after, m1 = evaluate(state.params)
  print('held-out loss', float(before), '->', float(after), 'accuracy', float(m0['accuracy']),
        '->', float(m1['accuracy']), 'margin', float(m1['margin']))
  assert int(state.step) == 40
  assert float(m1['accuracy']) >= 0.9
  assert float(m1['margin']) > 1.0
  assert float(after) < 0.5 * math.log(2)
