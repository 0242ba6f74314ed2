"""Adding a model family is one module and one registry line: a Llama variant whose MLPs are
GeGLU (down(gelu(gate x) * up x)) is registered from this test module, with no edit elsewhere,
and the one-call sampler, the paged engine and a train step run on it; its Hugging Face
format (architecture name, config.json entries, a skipped tensor) is declared here too."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from models import config as config_lib
from models import families
from models import hf
from models import layers
from models import transformer
from models.families import base
from rl import batch as batch_lib
from rl import grpo
from rl import sampler
from rl import train_step as ts


class GeGLU(layers.MLP):
  """down(gelu(gate(x)) * up(x)): the parameters of a SwiGLU MLP, another activation."""

  def __call__(self, x, *, rules=None):
    del rules           # no constraint of its own: the block constrains its output
    dt = self.cfg.jnp_dtype
    gate, up, down = (p.value.astype(dt) for p in (self.gate_proj, self.up_proj,
                                                    self.down_proj))
    return (jax.nn.gelu(x @ gate) * (x @ up)) @ down


SHAPE = dict(vocab_size=256, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, mlp_dim=128, qk_norm=False, tie_embeddings=False, max_seq_len=256)


def _toy_hf_entries(cfg) -> dict:
  """What the toy's config.json adds to Llama's."""
  return {'toy_mlp': 'geglu', 'mlp_layers': cfg.num_layers}


TOY = base.Family(name='toy_geglu', mlp=GeGLU,
                  presets={'toy_geglu_tiny': dict(family='toy_geglu', **SHAPE)},
                  hf_architecture='ToyGegluForCausalLM', hf_switches=(False, False),
                  hf_write_extra=_toy_hf_entries,
                  hf_ignored=lambda name: name.startswith('toy_probe.'))


def test_an_unregistered_family_is_refused():
  with pytest.raises(ValueError, match=r"ModelConfig.family='toy_geglu'"):
    config_lib.ModelConfig(family='toy_geglu', **SHAPE)


@pytest.fixture(scope='module')
def toy():
  families.register(TOY)
  yield config_lib.ModelConfig.preset('toy_geglu_tiny')
  families.unregister(TOY.name)


def test_a_registered_family_is_a_config_whose_blocks_hold_its_mlp(toy):
  assert toy.family == 'toy_geglu' and toy.mixers == ('attention', 'mlp') * 2
  assert toy.kv_stacked and not toy.flops_from_config and not toy.has_experts
  with pytest.raises(ValueError, match='already registered'):
    families.register(TOY)
  model = nnx.eval_shape(lambda: transformer.Transformer(toy, rngs=nnx.Rngs(0)))
  assert isinstance(model.layers.mlp, GeGLU)


def test_its_hf_format_is_declared_in_its_module(toy, tmp_path):
  assert hf.architectures()['ToyGegluForCausalLM'] == 'toy_geglu'
  model = transformer.create(toy, seed=0)
  hf.save_model(model, tmp_path)
  written = json.loads((tmp_path / 'config.json').read_text())
  assert written['architectures'] == ['ToyGegluForCausalLM'] and written['toy_mlp'] == 'geglu'
  assert hf.config_from_hf(written) == toy
  # A tensor the family skips (its `hf_ignored`) loads; one it does not is refused.
  weights = safetensors.numpy.load_file(tmp_path / hf.SINGLE_FILE)
  safetensors.numpy.save_file({**weights, 'toy_probe.w': np.ones(2, np.float32)},
                              tmp_path / hf.SINGLE_FILE)
  back = hf.load_model(tmp_path)
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), nnx.state(model, nnx.Param),
                      nnx.state(back, nnx.Param))
  assert all(jax.tree.leaves(same))
  safetensors.numpy.save_file({**weights, 'other_probe.w': np.ones(2, np.float32)},
                              tmp_path / hf.SINGLE_FILE)
  with pytest.raises(ValueError, match='unexpected tensor'):
    hf.load_model(tmp_path)


@pytest.mark.heavy
def test_its_mlp_is_what_sets_it_apart_from_llama(toy):
  model = transformer.create(toy, seed=0)
  llama = transformer.create(config_lib.ModelConfig(family='llama', **SHAPE), seed=0)
  assert not isinstance(llama.layers.mlp, GeGLU)
  # The same parameters (same shapes, same draws): only the MLP's activation differs.
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), nnx.state(model, nnx.Param),
                      nnx.state(llama, nnx.Param))
  assert all(jax.tree.leaves(same))
  tokens = jnp.arange(1, 9, dtype=jnp.int32)[None]
  forward = jax.jit(lambda g, p: nnx.merge(g, p)(tokens), static_argnums=0)
  assert not np.allclose(forward(*nnx.split(model)), forward(*nnx.split(llama)), atol=1e-4)


@pytest.mark.heavy
def test_the_sampler_the_engine_and_a_train_step_run_on_it(toy):
  graphdef, params = nnx.split(transformer.create(toy, seed=0))
  params = jax.tree.map(lambda x: x * 4, params)     # peaked: real stop tokens
  prompts = [[5, 9, 11], list(range(20, 33)), [7]]
  sp = sampler.SamplingParams(max_new_tokens=12, greedy=True)
  kw = dict(eos_ids=(3,), pad_id=0, prompt_buckets=(16,), new_token_buckets=(16,))
  one_call = sampler.Sampler(graphdef, toy, **kw).generate(params, prompts, jax.random.key(1),
                                                           sp, num_samples=2)
  paged = sampler.Sampler(graphdef, toy, engine='paged', page_size=8, slots=4,
                          **kw).generate(params, prompts, jax.random.key(1), sp, num_samples=2)
  for name in ('tokens', 'mask', 'lengths'):
    np.testing.assert_array_equal(getattr(paged, name), getattr(one_call, name), err_msg=name)
  np.testing.assert_allclose(paged.logprobs, one_call.logprobs, atol=1e-4)

  batch = batch_lib.from_samples(one_call, np.linspace(-1., 1., len(one_call.lengths)))
  batch = batch._replace(old_logprobs=np.asarray(
      batch_lib.compute_logprobs(graphdef, params, batch)) * batch.loss_mask)
  opt = ts.make_optimizer(ts.OptimizerConfig(lr=1e-3, clip_norm=0.0))
  step = ts.make_train_step(graphdef, ts.LossSpec(grpo.GrpoConfig, grpo.loss_fn,
                                                  grpo.normalizers), grpo.GrpoConfig(), opt)
  state, m = step(ts.init_state(jax.tree.map(jnp.copy, params), opt), batch)
  assert np.isfinite(float(m['loss'])) and float(m['grad_norm']) > 0 and int(state.step) == 1
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.abs(a - b).max(), state.params, params))
  assert max(float(x) for x in moved) > 0
