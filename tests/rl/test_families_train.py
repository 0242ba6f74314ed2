"""The training losses on the mixture-of-experts families: GRPO with a KL reference, SFT with the
routers' auxiliary losses, DPO's sequence log-probs, a reward model on a hybrid backbone, and
MOPD's teacher log-probs, each against the plain forward pass of the same model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import transformer
from rl import batch as batch_lib
from rl import distill
from rl import dpo
from rl import grpo
from rl import reward_model
from rl import sampler
from rl import sft
from rl import train_step as ts

HYBRID = config_lib.ModelConfig.tiny_hybrid()
MOE = config_lib.ModelConfig.tiny_moe()
OPT = ts.make_optimizer(ts.OptimizerConfig(lr=1e-3, clip_norm=0.0))


@functools.cache
def _policy(cfg, seed=0):
  return nnx.split(transformer.create(cfg, seed=seed))


def _rollouts(graphdef, params, b=6, p=5, n=7, seed=0):
  """Left-padded prompts and early-stopped completions, old log-probs the policy's own."""
  rng = np.random.default_rng(seed)
  pm = np.sort((rng.random((b, p)) < 0.8).astype(np.int32), 1)
  pm[:, -1] = 1
  lengths = rng.integers(1, n + 1, b)
  mask = (np.arange(n)[None] < lengths[:, None]).astype(np.int32)
  out = sampler.SampleOutput(
      prompt_tokens=rng.integers(2, 256, (b, p)).astype(np.int32) * pm, prompt_mask=pm,
      tokens=rng.integers(2, 256, (b, n)).astype(np.int32) * mask, mask=mask,
      logprobs=np.zeros((b, n), np.float32), sampling_logprobs=np.zeros((b, n), np.float32),
      lengths=lengths.astype(np.int32), truncated=lengths == n)
  batch = batch_lib.from_samples(out, rng.normal(size=b))
  return batch._replace(old_logprobs=np.asarray(
      batch_lib.compute_logprobs(graphdef, params, batch)) * batch.loss_mask)


def _forward_logprobs(graphdef, params, batch):
  """log p(targets) from one plain forward pass over the rows."""
  logits = jax.jit(lambda p, *row: nnx.merge(graphdef, p)(*row))(
      params, jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
      jnp.asarray(batch.segment_ids))
  logp = jax.nn.log_softmax(logits.astype(jnp.float64) if jax.config.jax_enable_x64
                            else logits, -1)
  return np.take_along_axis(np.asarray(logp), np.asarray(batch.targets)[..., None], -1)[..., 0]


@pytest.mark.parametrize('cfg', [HYBRID, MOE], ids=['hybrid', 'moe'])
def test_grpo_step_with_a_kl_reference_runs_and_changes_the_policy(cfg):
  graphdef, params = _policy(cfg)
  _, ref_params = _policy(cfg, seed=1)
  batch = _rollouts(graphdef, params)
  lp = _forward_logprobs(graphdef, params, batch) * batch.loss_mask
  np.testing.assert_allclose(batch.old_logprobs, lp, atol=1e-5)
  ref = np.asarray(batch_lib.compute_logprobs(graphdef, ref_params, batch)) * batch.loss_mask
  batch = batch._replace(ref_logprobs=ref)
  spec = ts.LossSpec(grpo.GrpoConfig, grpo.loss_fn, grpo.normalizers)
  step = ts.make_train_step(graphdef, spec, grpo.GrpoConfig(kl_coef=0.05), OPT)
  state, m = step(ts.init_state(jax.tree.map(jnp.copy, params), OPT), batch)
  assert np.isfinite(float(m['loss'])) and float(m['grad_norm']) > 0 and int(state.step) == 1
  assert float(m['kl']) > 0                      # the reference is another model
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.abs(a - b).max(), state.params, params))
  assert max(float(x) for x in moved) > 0
  # The routers' losses are logged (weights 0: the loss is GRPO's alone).
  assert float(m['router_aux_loss']) > 0 and float(m['router_z_loss']) > 0


def test_router_losses_enter_the_loss_with_their_weights():
  graphdef0, params = _policy(HYBRID)
  rows = [([5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 1, 1, 1, 1]), ([12, 13, 14, 15, 16], [0, 0, 1, 1, 1])]
  batch = sft.pack(rows, 16, num_rows=2)
  spec = ts.LossSpec(sft.SftConfig, sft.loss_fn, sft.normalizers)
  out = {}
  for w in (0.0, 0.5):
    cfg = HYBRID.replace(router_aux_loss=w, router_z_loss=2 * w)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda cfg=cfg: transformer.create(cfg)))
    _, m = ts.make_train_step(graphdef, spec, sft.SftConfig(), OPT)(
        ts.init_state(jax.tree.map(jnp.copy, params), OPT), batch)
    out[w] = m
  aux, z = float(out[0.0]['router_aux_loss']), float(out[0.0]['router_z_loss'])
  assert aux > 0 and z > 0
  np.testing.assert_allclose(float(out[0.5]['loss']) - float(out[0.0]['loss']),
                             0.5 * aux + 1.0 * z, rtol=1e-4)


class _Bytes:
  pad_id = 0
  eos_id = 1

  def encode(self, text):
    return [b % 250 + 3 for b in text.encode()]

  encode_text = encode


def test_dpo_sequence_logps_are_the_forward_pass():
  graphdef, params = _policy(HYBRID)
  model = nnx.merge(graphdef, params)
  prompts, chosen, rejected = ['Say hi:', 'Q?'], ['hi', 'yes it is'], ['bye now', 'no']
  batch = dpo.make_batch(_Bytes(), prompts, chosen, rejected, max_len=32, num_pairs=2)
  rows = [dpo.encode(_Bytes(), p, x) for xs in (chosen, rejected) for p, x in zip(prompts, xs)]
  # The reference: each row alone, padded to one length (segment 0) so one compile serves all.
  forward = jax.jit(lambda tokens, seg: jax.nn.log_softmax(model(tokens, segment_ids=seg), -1))
  want = []
  for p, r in rows:
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :len(p + r)] = p + r
    logp = forward(tokens, (np.arange(32) < len(p + r)).astype(np.int32)[None])[0]
    want.append(sum(float(logp[len(p) - 1 + j, t]) for j, t in enumerate(r)))
  got_c, got_r = jax.jit(lambda p: dpo.sequence_logps(nnx.merge(graphdef, p), batch))(params)
  np.testing.assert_allclose(np.concatenate([got_c, got_r]), want, rtol=1e-5)


def test_reward_model_on_a_hybrid_backbone_learns_a_preference():
  rm = reward_model.create(HYBRID, seed=0)
  graphdef, params = nnx.split(rm)
  tok = _Bytes()
  batch = reward_model.make_pair_batch(tok, ['a:', 'b:', 'c:', 'd:'], ['good'] * 4,
                                       ['bad'] * 4, max_len=16)
  spec = ts.LossSpec(reward_model.RewardModelConfig, reward_model.loss_fn,
                     reward_model.normalizers)
  step = ts.make_train_step(graphdef, spec, None, OPT)
  state = ts.init_state(params, OPT)
  losses = []
  for _ in range(4):
    state, m = step(state, batch)
    losses.append(float(m['loss']))
  assert losses[-1] < losses[0] - 0.05, losses


def test_mopd_teacher_logprobs_of_a_hybrid_teacher_are_its_forward_pass():
  graphdef, student = _policy(HYBRID)
  _, teacher = _policy(HYBRID, seed=2)
  batch = _rollouts(graphdef, student)
  batch = batch._replace(teacher_index=np.zeros(batch.tokens.shape[0], np.int32))
  got = np.asarray(distill.teacher_logprobs(graphdef, [teacher], batch.teacher_index, batch))
  want = _forward_logprobs(graphdef, teacher, batch) * batch.loss_mask
  np.testing.assert_allclose(got * batch.loss_mask, want, atol=1e-5)
