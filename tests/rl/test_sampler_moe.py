"""The one-call sampler on the mixture-of-experts families (a Nemotron-H-like hybrid with Mamba-2
state, and Qwen3-MoE): the log-probs it reports are the training forward's of the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import transformer
from rl import sampler

PROMPTS = [[5, 6, 7, 8, 9], [11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40, 41]]
EOS = (3, 17)
CONFIGS = {'hybrid': config_lib.ModelConfig.tiny_hybrid(),
           'moe': config_lib.ModelConfig.tiny_moe()}


@pytest.fixture(scope='module', params=sorted(CONFIGS))
def setup(request):
  cfg = CONFIGS[request.param]
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  # Matrices scaled up: peaked distributions, so stop tokens and distinct experts occur.
  params = jax.tree.map(lambda x: x * 3 if x.ndim >= 2 else x, params)
  samp = sampler.Sampler(graphdef, cfg, eos_ids=EOS, pad_id=0, prompt_buckets=(16,),
                         new_token_buckets=(16,), batch_buckets=(8,))
  return cfg, graphdef, params, samp


def _forward_logp(graphdef, params, out):
  tokens = np.concatenate([out.prompt_tokens, out.tokens], 1)
  seg = np.concatenate([out.prompt_mask, out.mask], 1)
  pos = np.maximum(np.cumsum(seg, 1) - 1, 0)
  logits = nnx.merge(graphdef, params)(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg))
  p = out.prompt_tokens.shape[1]
  x = np.asarray(logits, np.float64)[:, p - 1:-1]
  m = x.max(-1, keepdims=True)
  return x, x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize('sp', [sampler.SamplingParams(max_new_tokens=12, greedy=True),
                                sampler.SamplingParams(max_new_tokens=12, temperature=0.8)],
                         ids=['greedy', 'sampled'])
def test_logprobs_equal_training_forward(setup, sp):
  cfg, graphdef, params, samp = setup
  out = samp.generate(params, PROMPTS, jax.random.key(1), sp, num_samples=2)
  logits, logp = _forward_logp(graphdef, params, out)
  ref = np.take_along_axis(logp, out.tokens[..., None], -1)[..., 0] * out.mask
  np.testing.assert_allclose(out.logprobs, ref, atol=1e-4, rtol=0)
  if sp.greedy:
    np.testing.assert_array_equal(np.where(out.mask > 0, out.tokens, 0),
                                  np.where(out.mask > 0, logits.argmax(-1), 0))
  assert out.mask.sum() > len(PROMPTS) * 2


def test_group_rows_share_the_prompt_state(setup):
  """A prompt's G samples start from one prefill (its cache and Mamba state repeated): each
  row equals the same prompt sampled alone with the same row index."""
  cfg, graphdef, params, samp = setup
  sp = sampler.SamplingParams(max_new_tokens=10, temperature=1.0)
  both = samp.generate(params, PROMPTS[:2], jax.random.key(3), sp, num_samples=3)
  alone = samp.generate(params, [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3, jax.random.key(3), sp,
                        num_samples=1)
  np.testing.assert_array_equal(both.tokens, alone.tokens)
  np.testing.assert_allclose(both.logprobs, alone.logprobs, atol=1e-5)
