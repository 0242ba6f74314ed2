"""The sampler's rollout copy (`rollout_cast`): which weights the traced programs allow to be
stored in the compute dtype, and that sampling with the copy is bit-identical on every family."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import transformer
from rl import rollout_copy
from rl import sampler

PROMPTS = [[5, 6, 7, 8, 9], [11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40, 41]]
BF16 = np.dtype(jnp.bfloat16)


def _plan(fn, *args):
  prog = jax.make_jaxpr(fn)(*args)
  return rollout_copy.cast_dtypes([prog], jax.tree.leaves(args))


W = jnp.ones((4, 4), jnp.float32)
X = jnp.ones((2, 4), jnp.bfloat16)


@pytest.mark.parametrize('name, fn, want', [
    ('converted only', lambda w, x: x @ w.astype(jnp.bfloat16), BF16),
    ('through layout ops', lambda w, x: x @ w.T.reshape(4, 4)[:, ::1].astype(jnp.bfloat16), BF16),
    ('gathered rows', lambda w, x: jnp.take(w, jnp.array([0, 2]), axis=0).astype(jnp.bfloat16)
     + x, BF16),
    ('in a jit', lambda w, x: jax.jit(lambda a: x @ a.astype(jnp.bfloat16))(w), BF16),
    ('in a remat', lambda w, x: jax.checkpoint(lambda a: x @ a.astype(jnp.bfloat16))(w), BF16),
    ('scan over a stack', lambda w, x: jax.lax.scan(
        lambda c, a: (c @ a.astype(jnp.bfloat16), None), x, jnp.broadcast_to(w, (2, 4, 4)))[0],
     BF16),
    ('while body constant', lambda w, x: jax.lax.fori_loop(
        0, 3, lambda i, c: c @ w.astype(jnp.bfloat16), x), BF16),
    ('cond branches', lambda w, x: jax.lax.cond(
        x.sum() > 0, lambda: x @ w.astype(jnp.bfloat16), lambda: x @ w.T.astype(jnp.bfloat16)),
     BF16),
    ('returned by a jit, then converted', lambda w, x: x @ jax.jit(lambda a: a.T)(w).astype(
        jnp.bfloat16), BF16),
    ('also read in float32', lambda w, x: x @ w.astype(jnp.bfloat16) + w.sum(), None),
    ('float32 arithmetic first', lambda w, x: x @ (w * 2).astype(jnp.bfloat16), None),
    ('two target dtypes', lambda w, x: (x @ w.astype(jnp.bfloat16)).sum()
     + w.astype(jnp.float16).sum(), None),
    ('a program output', lambda w, x: (x @ w.astype(jnp.bfloat16), w), None),
    ('a scan carry', lambda w, x: jax.lax.scan(lambda c, _: (c.T, None), w, None, length=3)[0]
     .astype(jnp.bfloat16), None),
    ('unused', lambda w, x: x, None),
])
def test_cast_only_what_is_only_converted(name, fn, want):
  del name
  assert _plan(fn, W, X) == [want, None]


def _policy(family: str):
  cfg = getattr(config_lib.ModelConfig, family)(param_dtype='bfloat16', dtype='bfloat16')
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  # float32 masters, as a stage hands the sampler; matrices scaled up so rows stop and
  # experts differ.
  params = jax.tree.map(lambda x: (x * 3 if x.ndim >= 2 else x).astype(jnp.float32), params)
  return cfg, graphdef, params


def _sampler(cfg, graphdef, **kw):
  return sampler.Sampler(graphdef, cfg, eos_ids=(3,), pad_id=0, prompt_buckets=(16,),
                         new_token_buckets=(16,), batch_buckets=(8,), **kw)


HEAVY = pytest.mark.heavy


# The hybrid (Mamba-2, experts, attention) on the one-call sampler runs by default; the rest
# of the matrix in the heavy tier.
@pytest.mark.parametrize('family, engine', [
    ('tiny_hybrid', 'one_call'), pytest.param('tiny_moe', 'paged', marks=HEAVY),
    pytest.param('tiny', 'one_call', marks=HEAVY), pytest.param('tiny', 'paged', marks=HEAVY),
    pytest.param('tiny_moe', 'one_call', marks=HEAVY),
    pytest.param('tiny_hybrid', 'paged', marks=HEAVY)])
def test_copy_samples_bit_identically(family, engine):
  cfg, graphdef, params = _policy(family)
  sp = sampler.SamplingParams(max_new_tokens=10, temperature=0.8)
  cast = _sampler(cfg, graphdef, engine=engine)
  plain = _sampler(cfg, graphdef, engine=engine, rollout_cast=False)
  assert plain.rollout_params(params) is params
  a = plain.generate(params, PROMPTS, jax.random.key(1), sp, num_samples=2)
  b = cast.generate(params, PROMPTS, jax.random.key(1), sp, num_samples=2)
  c = cast.generate(cast.prepare(params), PROMPTS, jax.random.key(1), sp, num_samples=2)
  for out in (b, c):
    np.testing.assert_array_equal(out.tokens, a.tokens)
    np.testing.assert_array_equal(out.logprobs, a.logprobs)
  assert a.mask.sum() > len(PROMPTS) * 2

  # Which weights: every matmul weight is copied in bfloat16 (about half the bytes), every
  # norm, router, bias and state-space constant read in float32 is left as it is.
  flat = {'/'.join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(params)}
  rolled = {'/'.join(map(str, k)): v.get_value()
            for k, v in nnx.to_flat_state(cast.rollout_params(params))}
  kept32 = ('scale', 'router', 'router_bias', 'A_log', 'D', 'dt_bias', 'norm', 'conv_x', 'conv_b',
            'conv_c', 'conv_x_bias', 'conv_b_bias', 'conv_c_bias')
  for path, x in flat.items():
    last = path.rsplit('/', 1)[-1]
    want = jnp.float32 if last in kept32 else jnp.bfloat16
    assert rolled[path].dtype == want, (path, rolled[path].dtype)
    np.testing.assert_array_equal(np.asarray(rolled[path], np.float32),
                                  np.asarray(x.astype(want), np.float32))
  size = lambda t: sum(v.nbytes for v in t.values())
  assert size(rolled) < 0.55 * size(flat)


def test_float32_compute_makes_no_copy():
  cfg = config_lib.ModelConfig.tiny()
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  s = _sampler(cfg, graphdef)
  assert s.cast_dtypes(params) is None
  assert s.rollout_params(params) is params
  assert s.prepare(params).params is params


def test_prepared_copy_passes_through_and_abstract_params_get_its_dtypes():
  cfg, graphdef, params = _policy('tiny')
  s = _sampler(cfg, graphdef)
  prepared = s.prepare(params)
  assert s.prepare(prepared) is prepared
  assert s.rollout_params(prepared) is prepared.params
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  got = jax.tree.map(lambda a: a.dtype, s.rollout_params(abstract))
  assert got == jax.tree.map(lambda a: a.dtype, prepared.params)
  with pytest.raises(TypeError):       # not a pytree: it cannot pass for the params
    jax.tree.map(lambda x: x + 1, prepared)


@pytest.mark.heavy
def test_copy_on_a_mesh_in_the_rollout_layout():
  """On a (data, fsdp, tensor) mesh with rollout_rules: the copy is cast and laid out as the
  rollout rules say in one program, and the samples are those of the uncast run."""
  from models import sharding        # pylint: disable=g-import-not-at-top
  cfg, graphdef, params = _policy('tiny_moe')
  mesh = sharding.make_mesh((2, 2, 2))
  params = jax.device_put(params, sharding.state_shardings(params, mesh))
  sp = sampler.SamplingParams(max_new_tokens=8, greedy=True)
  outs = []
  for cast in (False, True):
    s = _sampler(cfg, graphdef, mesh=mesh, rollout_rules=(('embed', None),), rollout_cast=cast)
    rolled = s.rollout_params(params)
    want = sharding.state_shardings(params, mesh, s.rules)
    for (path, got), (_, sh), (_, x) in zip(nnx.to_flat_state(rolled),
                                            nnx.to_flat_state(want), nnx.to_flat_state(params)):
      got = got.get_value()
      assert got.sharding.is_equivalent_to(sh.get_value(), got.ndim), path
      # A weight's own rank: a folded or scanned stack's 'layers' axes do not make a stacked
      # norm scale (or any vector) a matrix.
      own_rank = x.get_value().ndim - sum(
          a == 'layers' for a in (getattr(x, 'logical_axes', None) or ()))
      assert (got.dtype == jnp.bfloat16) == (cast and own_rank >= 2
                                            and path[-1] != 'router'), path
    outs.append(s.generate(params, PROMPTS, jax.random.key(2), sp, num_samples=2))
  np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
  np.testing.assert_array_equal(outs[0].logprobs, outs[1].logprobs)
