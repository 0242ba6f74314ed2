"""A cached call slices each sublayer out of its stack at an index the compiler cannot fold.

Unrolled (a cache, or scan=False), the hybrid stack loops over its sublayers in Python. At
static indices each sublayer's code differs from its siblings' by its slice's offset, and the
TPU compiler built every copy (Cascade 2's 52-sublayer prefill); at `hybrid.layer_indices`
(behind an optimization barrier) the copies are identical and built once. These tests pin the
mechanism and that it computes what the static slices compute.
"""

import jax
import numpy as np
from flax import nnx

from models import config as config_lib
from models import hybrid
from models import sharding
from models import transformer
from rl import sampler as sampler_lib

# (M E M *) x 2, scanned in training: as a Fold (one stack per kind) and as segments (a Repeat
# of the unit, one stack per position).
CFG = config_lib.ModelConfig.tiny_hybrid(num_layers=8, layer_types='MEM*MEM*', scan_layers=True)


def test_indices_are_opaque_except_on_gpu(monkeypatch):
  text = jax.jit(lambda: hybrid.layer_indices(3)).lower().as_text()
  assert 'optimization_barrier' in text
  np.testing.assert_array_equal(jax.jit(lambda: hybrid.layer_indices(3))(), [0, 1, 2])
  monkeypatch.setattr(sharding, 'mesh_platform', lambda: 'gpu')
  assert hybrid.layer_indices(3) == range(3)


def _sample(cfg, layout):
  graphdef, params = nnx.split(transformer.create(cfg, seed=0, layout=layout))
  samp = sampler_lib.Sampler(graphdef, cfg, eos_ids=(), prompt_buckets=(16,),
                             new_token_buckets=(8,))
  out = samp.generate(params, [[5, 9, 2, 7, 11], [3, 4]], jax.random.key(1),
                      sampler_lib.SamplingParams(max_new_tokens=8, temperature=1.0),
                      num_samples=2)
  return np.asarray(out.tokens), np.asarray(out.logprobs)


def _check_same_as_static(cfg, monkeypatch, layout):
  seen = []
  take = hybrid._take
  monkeypatch.setattr(hybrid, '_take', lambda tree, i: seen.append(i) or take(tree, i))
  tokens, logprobs = _sample(cfg, layout)
  # Every slice of a cached call (prefill and decode) took a traced index.
  assert seen and all(isinstance(i, jax.Array) for i in seen)
  monkeypatch.setattr(hybrid, 'layer_indices', range)
  static_tokens, static_logprobs = _sample(cfg, layout)
  np.testing.assert_array_equal(tokens, static_tokens)
  np.testing.assert_allclose(logprobs, static_logprobs, rtol=1e-6, atol=1e-6)


def test_folded_cached_calls_equal_static_slices(monkeypatch):
  assert hybrid.folds(CFG.mixers, 'fold')
  assert hybrid.is_folded(transformer.create(CFG, layout='fold').blocks)
  _check_same_as_static(CFG, monkeypatch, 'fold')


def test_repeated_cached_calls_equal_static_slices(monkeypatch):
  assert not hybrid.folds(CFG.mixers, 'segments') and hybrid.plan(CFG.mixers)[0].repeats == 2
  assert not hybrid.is_folded(transformer.create(CFG, layout='segments').blocks)
  _check_same_as_static(CFG, monkeypatch, 'segments')
