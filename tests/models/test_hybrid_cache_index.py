"""A cached call of the scanned hybrid stack hands each sublayer its own cache.

With a cache, a repeated segment runs as a Python loop over its repeats and sublayer (kind, n)
reads and writes cache n of its kind: n = (first of its kind in the unit) + repeat x (how many
of that kind the unit holds). A unit whose kinds occur unequally often (Nemotron-3-Nano's
(E M E M * E M) x 5: three Mamba, one attention) catches an index taken with another kind's
count: the attention of repeat 1 would read a cache past the last one, a Mamba sublayer
another's state.
"""

import jax
import numpy as np
from flax import nnx

from models import config as config_lib
from models import hybrid
from models import transformer
from rl import batch as batch_lib
from rl import sampler as sampler_lib

# (M E M *) x 2: per unit two Mamba, one MoE, one attention.
CFG = config_lib.ModelConfig.tiny_hybrid(num_layers=8, layer_types='MEM*MEM*', scan_layers=True)


def test_the_pattern_repeats_a_unit_of_unequal_kind_counts():
  [seg] = hybrid.plan(CFG.mixers)
  assert seg.repeats == 2 and seg.unit.count('mamba') == 2 and seg.unit.count('attention') == 1


def test_sampled_logprobs_equal_the_full_forward_on_unequal_units():
  graphdef, params = nnx.split(transformer.create(CFG, seed=0))
  samp = sampler_lib.Sampler(graphdef, CFG, eos_ids=(), prompt_buckets=(16,),
                             new_token_buckets=(8,))
  out = samp.generate(params, [[5, 9, 2, 7, 11], [3, 4]], jax.random.key(1),
                      sampler_lib.SamplingParams(max_new_tokens=8, temperature=1.0),
                      num_samples=2)
  batch = batch_lib.from_samples(out, np.zeros(4, np.float32))
  full = np.asarray(batch_lib.compute_logprobs(graphdef, params, batch))
  mask = np.asarray(batch.loss_mask) > 0
  assert mask.sum() == 4 * 8
  np.testing.assert_allclose(np.asarray(batch.old_logprobs)[mask], full[mask], atol=2e-4)
