"""Attention backends (models/attention.py) equal the dense reference; blockwise memory is linear.

The Pallas kernels run interpreted on CPU ('splash' is the TPU kernel,
'gpu_flash' the Triton one), so these tests check their masking, padding,
grouped-query layout and sharding, not their speed.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models import attention
from models import config as config_lib
from models import sharding
from models import transformer

TOL = 1e-5


def _qkv(b, t, s, n, kh, h, seed=0):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.normal(size=(b, t, n, h)), jnp.float32)
  k = jnp.asarray(r.normal(size=(b, kh, s, h)), jnp.float32)
  v = jnp.asarray(r.normal(size=(b, kh, s, h)), jnp.float32)
  return q, k, v


def _segments(t):
  """Row 0: 37 left-padding tokens, then one sequence; row 1: three packed sequences + padding."""
  seg = np.ones((2, t), np.int32)
  seg[0, :37] = 0
  seg[1, 60:120], seg[1, 120:] = 2, 3
  seg[1, t - 9:] = 0
  return jnp.asarray(seg)


def _max_err(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _outputs_and_grads(impl, q, k, v, mask, w, **kw):
  """attend's output and the gradients of sum(out * w) with respect to q, k, v."""
  f = lambda q, k, v: attention.attend(q, k, v, mask, impl=impl, **kw)
  out = jax.jit(f)(q, k, v)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), (0, 1, 2)))(q, k, v)
  return out, grads


@pytest.mark.parametrize('impl', ['blockwise', 'splash', 'gpu_flash'])
def test_backend_equals_dense(impl):
  # T = 200 is not a multiple of the 128 tiles: every backend pads; N=4 query heads share K=2.
  b, t, n, kh, h = 2, 200, 4, 2, 16
  q, k, v = _qkv(b, t, t, n, kh, h)
  seg = _segments(t)
  mask = attention.MaskInfo(seg, seg)
  real = (seg != 0)[:, :, None, None]
  # Padding queries' outputs are backend-defined: the loss reads real rows only.
  w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32) * real
  ref, ref_grads = _outputs_and_grads('dense', q, k, v, mask, w)
  out, grads = _outputs_and_grads(impl, q, k, v, mask, w, block_q=128, block_kv=128)
  assert _max_err(jnp.where(real, out, 0), jnp.where(real, ref, 0)) <= TOL
  assert _max_err(grads, ref_grads) <= TOL
  # Padding queries stay finite: their keys and values feed later layers, where a NaN
  # would survive masking (0 * NaN).
  assert bool(jnp.all(jnp.isfinite(out)))


def _copies_of(jaxpr, tainted, found):
  """Walks `jaxpr` (a core.Jaxpr) forward from the variables in `tainted` (K and V) through every
  equation but a kernel call or a dot product, recursing into sub-jaxprs (jit, custom VJP), and
  appends to `found` the sizes of the tainted values it makes: copies, broadcasts, reshapes of
  K or V. Returns which outputs are tainted."""
  from jax.extend import core
  for eqn in jaxpr.eqns:
    ins = [isinstance(x, core.Var) and x in tainted for x in eqn.invars]
    if not any(ins) or eqn.primitive.name in ('pallas_call', 'dot_general'):
      continue
    subs = [v for v in eqn.params.values() if isinstance(v, (core.Jaxpr, core.ClosedJaxpr))]
    if subs:
      sub = subs[0].jaxpr if isinstance(subs[0], core.ClosedJaxpr) else subs[0]
      inner = {v for v, t in zip(sub.invars[-len(ins):], ins) if t}
      outs = _copies_of(sub, inner, found)
      marked = [o for o, t in zip(eqn.outvars, outs) if t]
    else:
      marked = eqn.outvars
    for o in marked:
      tainted.add(o)
      found.append(int(np.prod(o.aval.shape)))
  return [isinstance(x, core.Var) and x in tainted for x in jaxpr.outvars]


def test_gpu_flash_never_repeats_kv_heads():
  """'gpu_flash' is grouped-query native: in its forward and its gradient no value computed
  from K or V (outside the kernel and dot products) is larger than K padded to the kernel's
  tile: no [B, T, N, H] copy of K/V repeated to the query heads. `jnp.repeat` would make one
  (checked below, so the walk can find one)."""
  b, t, n, kh, h = 1, 128, 6, 2, 16         # G = 3; T a whole tile, so nothing is padded
  q, k, v = _qkv(b, t, t, n, kh, h)
  seg = jnp.ones((b, t), jnp.int32)
  f = lambda q, k, v: attention.attend(q, k, v, attention.MaskInfo(seg, seg), impl='gpu_flash')
  loss = lambda q, k, v: jnp.sum(f(q, k, v))
  repeat = lambda q, k, v: f(q, jnp.repeat(k, n // kh, 1)[:, :kh], v)
  for fn, expect in ((f, False), (jax.grad(loss, (0, 1, 2)), False), (repeat, True)):
    closed = jax.make_jaxpr(fn)(q, k, v)
    found = []
    _copies_of(closed.jaxpr, set(closed.jaxpr.invars[1:]), found)
    assert (max(found, default=0) > k.size) is expect, (fn, found)


@pytest.mark.parametrize('t,s', [(100, 200), (300, 400)])
def test_blockwise_cached_prefill_equals_dense(t, s):
  # t queries written at slot 24 of an s-slot cache (not a multiple of the 128-slot
  # tiles; 300 queries are three query tiles, some wholly above the diagonal);
  # earlier slots hold a left-padded prompt, later ones are empty.
  b, n, kh, h = 2, 4, 2, 16
  q, k, v = _qkv(b, t, s, n, kh, h, seed=2)
  offset = jnp.asarray(24, jnp.int32)
  q_seg = jnp.ones((b, t), jnp.int32).at[1, 50:].set(2)
  kv_seg = jnp.zeros((b, s), jnp.int32).at[:, 5:24].set(1)
  kv_seg = jax.lax.dynamic_update_slice(kv_seg, q_seg, (0, 24))
  mask = attention.MaskInfo(q_seg, kv_seg, offset)
  w = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)
  ref, ref_grads = _outputs_and_grads('dense', q, k, v, mask, w)
  out, grads = _outputs_and_grads('blockwise', q, k, v, mask, w, block_q=128, block_kv=128)
  assert _max_err(out, ref) <= TOL
  assert _max_err(grads, ref_grads) <= TOL


def test_blockwise_skips_exactly_the_tiles_above_the_diagonal():
  # Query tile [q_offset, q_offset + 128) against key tiles starting at k_start.
  visited = lambda q_offset, k_start: bool(attention._visited(q_offset + 127, k_start))
  assert visited(0, 0) and visited(128, 0) and visited(128, 128)
  assert visited(1, 128)             # its last query (slot 128) sees the tile's first key
  assert not visited(0, 128)         # its last query is slot 127
  assert not visited(0, 256)
  # A cached prefill's tile starts at its traced offset.
  assert bool(attention._visited(jnp.asarray(24) + 127, 128)) and not visited(24, 256)


def test_resolve():
  r = attention.resolve
  assert r('auto', 512, 512, self_attention=True, platform='tpu') == 'splash'
  assert r('auto', 512, 512, self_attention=True, platform='gpu') == 'gpu_flash'
  # CPU: dense (today's numerics) below DENSE_MAX_LEN keys, blockwise from there.
  n = attention.DENSE_MAX_LEN
  assert r('auto', n - 1, n - 1, self_attention=True, platform='cpu') == 'dense'
  assert r('auto', n, n, self_attention=True, platform='cpu') == 'blockwise'
  # A decode step is dense; a prefill into a cache cannot use the kernels.
  assert r('splash', 1, 4096, self_attention=False) == 'dense'
  assert r('auto', 64, 4096, self_attention=False, platform='tpu') == 'blockwise'
  assert r('gpu_flash', 64, 4096, self_attention=False) == 'blockwise'
  assert r('blockwise', 1, 8, self_attention=False) == 'dense'
  with pytest.raises(ValueError, match='flash'):
    r('flash', 8, 8, self_attention=True)


def test_config_validates_attention():
  assert config_lib.ModelConfig.tiny().attention == 'auto'
  with pytest.raises(ValueError, match='attention'):
    config_lib.ModelConfig.tiny(attention='xla')
  with pytest.raises(ValueError, match='multiple of 128'):
    config_lib.ModelConfig.tiny(attention_block_kv=100)


@pytest.mark.heavy
@pytest.mark.parametrize('impl', ['blockwise', 'splash', 'gpu_flash'])
def test_sharded_equals_unsharded(impl):
  # Rows split 2 ways ('data'), kv heads 4 ways ('tensor'): the kernels run in a shard_map.
  b, t, n, kh, h = 2, 128, 8, 4, 16
  q, k, v = _qkv(b, t, t, n, kh, h, seed=4)
  seg = jnp.ones((b, t), jnp.int32).at[0, :10].set(0).at[1, 70:].set(2)
  mask = attention.MaskInfo(seg, seg)
  w = jnp.asarray(np.random.default_rng(5).normal(size=q.shape), jnp.float32)
  w = w * (seg != 0)[:, :, None, None]
  ref, ref_grads = _outputs_and_grads(impl, q, k, v, mask, w, block_q=128, block_kv=128)

  mesh = sharding.make_mesh((2, 1, 4))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  qs, ks, vs = (put(q, P('data', None, 'tensor', None)), put(k, P('data', 'tensor', None, None)),
                put(v, P('data', 'tensor', None, None)))
  mask_s = attention.MaskInfo(put(seg, P('data', None)), put(seg, P('data', None)))
  with sharding.use_mesh(mesh):
    out, grads = _outputs_and_grads(impl, qs, ks, vs, mask_s, put(w, P('data')),
                                    block_q=128, block_kv=128)
    jaxpr = str(jax.make_jaxpr(lambda *a: attention.attend(*a, mask_s, impl=impl))(qs, ks, vs))
  assert ('shard_map' in jaxpr) == (impl != 'blockwise')
  assert _max_err(out, ref) <= TOL
  assert _max_err(grads, ref_grads) <= TOL


def _tiny(attention_impl, **kw):
  return config_lib.ModelConfig.tiny(attention=attention_impl, attention_block_kv=128, **kw)


@pytest.mark.heavy
def test_transformer_blockwise_equals_dense():
  t = 200
  seg = _segments(t)
  tokens = jax.random.randint(jax.random.key(0), (2, t), 0, 256)
  pos = jnp.asarray(np.maximum(np.cumsum(np.asarray(seg) != 0, 1) - 1, 0), jnp.int32)
  target = jnp.roll(tokens, -1, 1)

  def run(impl):
    model = transformer.Transformer(_tiny(impl), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def loss(params):
      logits = nnx.merge(graphdef, params)(tokens, pos, seg)
      lp = jnp.take_along_axis(jax.nn.log_softmax(logits), target[..., None], -1)[..., 0]
      return -jnp.sum(jnp.where(seg != 0, lp, 0.)), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (loss_d, logits_d), grads_d = run('dense')
  (loss_b, logits_b), grads_b = run('blockwise')
  assert _max_err(logits_b, logits_d) <= TOL
  assert abs(float(loss_b - loss_d)) <= TOL * abs(float(loss_d))
  assert _max_err(grads_b, grads_d) <= TOL


@pytest.mark.heavy
def test_transformer_blockwise_prefill_and_decode_equal_dense():
  tokens = jax.random.randint(jax.random.key(1), (2, 150), 0, 256)
  seg = jnp.ones((2, 150), jnp.int32).at[0, :30].set(0)           # left-padded prompts
  pos = jnp.maximum(jnp.cumsum(seg, 1) - 1, 0)
  outs = {}
  for impl in ('dense', 'blockwise'):
    model = transformer.Transformer(_tiny(impl), rngs=nnx.Rngs(0))
    cache = transformer.init_cache(model.cfg, 2, 160)
    prefill, cache = model(tokens, pos, seg, cache=cache)
    step, _ = model(tokens[:, -1:], pos[:, -1:] + 1, jnp.ones((2, 1), jnp.int32), cache=cache)
    outs[impl] = (jnp.where(seg[..., None] != 0, prefill, 0), step)
  assert _max_err(outs['blockwise'], outs['dense']) <= TOL


def _train_step_memory(impl, t):
  """Compiled temp bytes and HLO text of a loss+gradient step at length t (tiny dims)."""
  cfg = config_lib.ModelConfig.tiny(vocab_size=64, embed_dim=32, num_layers=2, num_heads=2,
                                    num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=t,
                                    attention=impl)
  graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))

  def loss(params, tokens, seg):
    logits = nnx.merge(graphdef, params)(tokens, segment_ids=seg)
    lp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], -1))

  rows = jax.ShapeDtypeStruct((1, t), jnp.int32)
  compiled = jax.jit(jax.value_and_grad(loss)).lower(params, rows, rows).compile()
  return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()


@pytest.mark.heavy
def test_blockwise_train_step_memory_is_linear_in_length():
  mem = {}
  for t in (2048, 4096):
    mem[t], hlo = _train_step_memory('blockwise', t)
    # No buffer anywhere in the program has two length-T dimensions.
    assert not re.search(rf'\b{t},(\d+,)*{t}\b', hlo), f'a [{t}, {t}] buffer at T={t}'
  assert mem[4096] / mem[2048] < 2.3, mem
  # The check can fail: the dense program holds [T, T] logits and grows ~4x.
  dense = {t: _train_step_memory('dense', t)[0] for t in (1024, 2048)}
  assert dense[2048] / dense[1024] > 3.5, dense


def test_splash_causal_mask_blocks_equal_splashs_own():
  """The block-shortcut causal mask (faster kernel builds) gives splash's CausalMask's blocks."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  rng = np.random.default_rng(0)
  for n in (256, 640):
    fast, ref = attention._causal_mask_cls()((n, n)), sm.CausalMask((n, n))
    slices = [(slice(i, i + b), slice(j, j + b)) for b in (64, 128)
              for i in range(0, n, b) for j in range(0, n, b)]
    for _ in range(200):
      q0, q1 = sorted(int(x) for x in rng.integers(0, n + 1, 2))
      k0, k1 = sorted(int(x) for x in rng.integers(0, n + 1, 2))
      slices.append((slice(q0, q1), slice(k0, k1)))
    slices += [(slice(None), slice(None)), (slice(None), slice(3, None))]
    for idx in slices:
      np.testing.assert_array_equal(fast[idx], ref[idx], err_msg=str(idx))
    assert fast[:64, :64].sum() == 64 * 65 // 2 and fast[:64, 64:128].sum() == 0


@pytest.mark.parametrize('platform', ['tpu', 'cpu'])
def test_kernels_compile_as_kernels_for_the_mesh_platform(platform, pallas_interpret_flags):
  """Planning for a TPU topology from a CPU host traces under a TPU mesh: splash and the paged
  kernel are then real Mosaic kernels, not interpreted loops (and the paged kernel is chosen at
  all); under a CPU mesh splash is interpreted and paged attention takes the XLA path."""
  device = jax.sharding.AbstractDevice(device_kind=platform, num_cores=None, platform=platform)
  mesh = jax.sharding.AbstractMesh((1, 1, 1), ('data', 'fsdp', 'tensor'),
                                   axis_types=(jax.sharding.AxisType.Auto,) * 3,
                                   abstract_device=device)
  q, k, v = _qkv(1, 256, 256, 4, 2, 128)
  seg = jnp.ones((1, 256), jnp.int32)
  splash = lambda q, k, v: attention.attend(q, k, v, attention.MaskInfo(seg, seg),
                                            impl='splash', block_q=128, block_kv=128)
  pages = jnp.zeros((2, 16, 16, 128), jnp.float32)
  paged = lambda q, kp: attention.paged_attend(q, kp, kp, jnp.full((4,), 20, jnp.int32),
                                               jnp.zeros((4, 8), jnp.int32), impl='splash')
  with jax.sharding.use_abstract_mesh(mesh):
    assert pallas_interpret_flags(splash, q, k, v) == [platform != 'tpu']
    assert pallas_interpret_flags(paged, q[0, :4], pages) == ([False] if platform == 'tpu'
                                                               else [])
