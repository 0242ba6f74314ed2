"""Master weights: a bfloat16 model trains on float32 master weights and moments by default."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import optax
from flax import nnx

from cascade import policies
from models import config as model_config
from models import transformer
from rl import sft
from rl import train_step as train_lib


def test_master_dtype_is_float32_exactly_when_params_are_lower():
  assert policies.master_dtype(model_config.ModelConfig.tiny()) is None
  assert policies.master_dtype(model_config.ModelConfig.tiny(param_dtype='bfloat16',
                                                             dtype='bfloat16')) == 'float32'
  assert policies.master_dtype(model_config.ModelConfig.qwen3_14b()) == 'float32'


def test_abstract_state_counts_float32_master_weights_and_moments():
  cfg = model_config.ModelConfig.tiny(param_dtype='bfloat16', dtype='bfloat16')
  _, params = policies.abstract_model(cfg, 'policy')
  opt = train_lib.make_optimizer(train_lib.OptimizerConfig(lr=2e-6))
  state = policies.abstract_state(params, opt, None, None, policies.master_dtype(cfg))
  floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and all(x.dtype == jnp.float32 for x in floats)
  n = cfg.num_params()
  nbytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in floats)
  assert nbytes >= 12 * n          # weights + two Adam moments, 4 bytes each


def _batch(tokens):
  b, t = tokens.shape
  return sft.pack([(list(map(int, row)), [0] + [1] * (t - 1)) for row in tokens], t,
                  num_rows=b)


@pytest.mark.heavy
def test_bf16_model_moves_at_the_paper_learning_rate_only_with_float32_master():
  cfg = model_config.ModelConfig.tiny(param_dtype='bfloat16', dtype='bfloat16')
  model = transformer.create(cfg, seed=0)
  graphdef, params = nnx.split(model)
  opt = train_lib.make_optimizer(train_lib.OptimizerConfig(lr=2e-6))
  tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, (4, 16))
  batch = _batch(tokens)
  moved = {}
  for master in (None, 'float32'):
    state = train_lib.init_state(jax.tree.map(jnp.copy, params), opt, master_dtype=master)
    step = train_lib.make_train_step(
        graphdef, train_lib.LossSpec(sft.SftConfig, sft.loss_fn, sft.normalizers), None, opt)
    losses = []
    for _ in range(5):
      state, m = step(state, batch)
      losses.append(float(m['loss']))
    before = jax.tree.leaves(params)
    after = jax.tree.leaves(state.params)
    delta = np.concatenate([np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).ravel()
                            for a, b in zip(after, before)])
    moved[master] = (float(np.median(delta)), float(np.mean(delta > 0)), losses)
  # bf16 weights: a ~2e-6 Adam step is below half an ulp of almost every weight and rounds
  # away (only weights very close to 0 move); float32 master weights keep every update.
  assert moved[None][0] == 0.0 and moved[None][1] < 0.05, moved[None][:2]
  assert moved['float32'][0] > 5e-6 and moved['float32'][1] > 0.95, moved['float32'][:2]
  assert moved['float32'][2][-1] < moved['float32'][2][0]
