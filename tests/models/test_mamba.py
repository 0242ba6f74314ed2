"""Mamba-2 mixer: a float64 per-token reference, segments, prefill/decode, gradients,
context parallelism (sequence-sharded rows), HF parity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import config as config_lib
from models import context
from models import mamba
from models import sharding

PARAMS = ('z_proj', 'x_proj', 'b_proj', 'c_proj', 'dt_proj', 'conv_x', 'conv_b', 'conv_c',
          'conv_x_bias', 'conv_b_bias', 'conv_c_bias', 'dt_bias', 'A_log', 'D', 'norm',
          'out_proj')


def _cfg(**kw):
  return config_lib.ModelConfig.tiny_hybrid(**{'mamba_chunk': 8, **kw})


def _mixer(cfg, seed=0):
  """A mixer with every parameter random (numpy) at a scale where each one matters.

  Built abstractly, then filled: eager initialisers compile one program per shape."""
  m = nnx.eval_shape(lambda: mamba.Mamba2Mixer(cfg, nnx.Rngs(seed)))
  rng = np.random.default_rng(seed)
  d, h, hp = cfg.embed_dim, cfg.mamba_heads, cfg.mamba_heads * cfg.mamba_head_dim
  draw = dict(z_proj=(0, d ** -0.5), x_proj=(0, d ** -0.5), b_proj=(0, d ** -0.5),
              c_proj=(0, d ** -0.5), dt_proj=(0, 0.5 * d ** -0.5), conv_x=(0, 0.5),
              conv_b=(0, 0.5), conv_c=(0, 0.5), conv_x_bias=(0, 0.2), conv_b_bias=(0, 0.2),
              conv_c_bias=(0, 0.2), out_proj=(0, hp ** -0.5), D=(1.0, 0.5), norm=(1.0, 0.3))
  for name in PARAMS:
    if not hasattr(m, name):
      continue
    p = getattr(m, name)
    shape, dtype = p.value.shape, p.value.dtype
    if name == 'dt_bias':
      v = rng.uniform(-4.0, 1.0, h)
    elif name == 'A_log':
      v = rng.uniform(-3.0, 1.0, h)
    else:
      v = rng.normal(*draw[name], shape)
    p.value = jnp.asarray(v, dtype)
  return m


@jax.jit(static_argnums=0)
def _jit_call(graphdef, params, x, seg, state):
  return nnx.merge(graphdef, params)(x, seg, state)


def _apply(m, x, seg, state=None):
  """m(x, seg, state), compiled once per configuration and shape (eager is slower)."""
  graphdef, params = nnx.split(m)
  return _jit_call(graphdef, params, x, jnp.asarray(seg, jnp.int32), state)


def _np_params(m):
  return {k: np.asarray(getattr(m, k).value, np.float64) for k in PARAMS if hasattr(m, k)}


def _silu(v):
  return v / (1.0 + np.exp(-v))


def _reference(cfg, p, x, seg, conv0=None, ssm0=None):
  """The mixer token by token in float64, straight from the definitions.

  Returns (y [B, T, D], conv state [B, K-1, conv_dim], ssm state [B, H, P, N])."""
  x = np.asarray(x, np.float64)
  seg = np.asarray(seg)
  b, t, _ = x.shape
  h, hp, g, n, k = (cfg.mamba_heads, cfg.mamba_heads * cfg.mamba_head_dim, cfg.mamba_groups,
                    cfg.mamba_state, cfg.mamba_conv)
  w = np.concatenate([p['conv_x'].reshape(k, -1), p['conv_b'].reshape(k, -1),
                      p['conv_c'].reshape(k, -1)], axis=1)
  bias = (np.concatenate([p['conv_x_bias'].ravel(), p['conv_b_bias'].ravel(),
                          p['conv_c_bias'].ravel()]) if 'conv_x_bias' in p else 0.0)
  a = -np.exp(p['A_log'])
  conv = (np.zeros((b, k - 1, w.shape[1])) if conv0 is None
          else np.array(conv0, np.float64))
  ssm = (np.zeros((b, h, cfg.mamba_head_dim, n)) if ssm0 is None
         else np.array(ssm0, np.float64))
  y = np.zeros_like(x)
  for r in range(b):
    prev = 0
    for i in range(t):
      s = seg[r, i]
      if s == 0:
        continue
      if prev not in (0, s):
        conv[r] = 0.0
        ssm[r] = 0.0
      prev = s
      z = x[r, i] @ p['z_proj'].reshape(x.shape[-1], -1)
      u = np.concatenate([x[r, i] @ p[nm].reshape(x.shape[-1], -1)
                          for nm in ('x_proj', 'b_proj', 'c_proj')])
      dt = np.log1p(np.exp(x[r, i] @ p['dt_proj'] + p['dt_bias']))
      dt = np.clip(dt, cfg.mamba_dt_min, cfg.mamba_dt_max)
      window = np.concatenate([conv[r], u[None]], axis=0)
      conv[r] = window[1:]
      v = _silu((window * w).sum(0) + bias)
      xs = v[:hp].reshape(h, -1)
      bb, cc = v[hp:hp + g * n].reshape(g, n), v[hp + g * n:].reshape(g, n)
      out = np.zeros((h, cfg.mamba_head_dim))
      for j in range(h):
        grp = j // (h // g)
        ssm[r, j] = np.exp(dt[j] * a[j]) * ssm[r, j] + dt[j] * np.outer(xs[j], bb[grp])
        out[j] = ssm[r, j] @ cc[grp] + p['D'][j] * xs[j]
      gated = (out.ravel() * _silu(z)).reshape(g, -1)
      gated = gated / np.sqrt((gated ** 2).mean(-1, keepdims=True) + cfg.norm_eps)
      y[r, i] = (gated.ravel() * p['norm'].ravel()) @ p['out_proj'].reshape(hp, -1)
  return y, conv, ssm


# Rows: unpadded; left padding; right padding; packed with padding between and after;
# a segment with padding inside it (transparent); packing with a repeated id after another;
# a last segment shorter than the conv window (the returned conv state is part zeros); no
# real token (the state passes through).
SEGMENTS = np.array([
    [1] * 21,
    [0] * 6 + [1] * 15,
    [1] * 13 + [0] * 8,
    [1] * 7 + [0, 0] + [2] * 9 + [0] * 3,
    [1] * 5 + [0] * 4 + [1] * 8 + [0] * 4,
    [3] * 6 + [5] * 6 + [3] * 9,
    [1] * 15 + [2] * 2 + [0] * 4,
    [0] * 21,
], np.int32)


# Test data is numpy: an eager jnp op compiles a program per shape and index, which made
# up most of this file's run time.
def _inputs(cfg, b, t, seed=1):
  return np.random.default_rng(seed).standard_normal((b, t, cfg.embed_dim), np.float32)


def _zero_state(cfg, b):
  h, p, n = cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_state
  return mamba.MambaState(conv=np.zeros((b, cfg.mamba_conv - 1, cfg.mamba_conv_dim), np.float32),
                          ssm=np.zeros((b, h, p, n), np.float32))


def _random_state(cfg, b, seed=2):
  rng, s = np.random.default_rng(seed), _zero_state(cfg, b)
  return mamba.MambaState(conv=rng.standard_normal(s.conv.shape, np.float32),
                          ssm=rng.standard_normal(s.ssm.shape, np.float32))


def _close(a, b, tol=1e-5):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  np.testing.assert_allclose(a, b, atol=tol * max(1.0, np.abs(b).max()), rtol=0)


# T = 21: chunk 5 pads the last of five chunks, 64 pads the only one, 1 is the recurrence
# itself. The last case also clamps dt, has no conv bias and starts without a state.
CASES = {
    'chunk1': dict(mamba_chunk=1),
    'chunk5': dict(mamba_chunk=5),
    'chunk64_clamped_stateless': dict(mamba_chunk=64, mamba_dt_min=0.05, mamba_dt_max=0.5,
                                      mamba_conv_bias=False),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_matches_float64_reference(case):
  cfg = _cfg(**CASES[case])
  m = _mixer(cfg)
  p = _np_params(m)
  x = _inputs(cfg, *SEGMENTS.shape)
  stateless = 'stateless' in case
  state = None if stateless else _random_state(cfg, SEGMENTS.shape[0])
  y, new = _apply(m, x, SEGMENTS, state)
  ref_y, ref_conv, ref_ssm = _reference(cfg, p, x, SEGMENTS, *(state or (None, None)))
  assert np.abs(ref_y).max() > 0.5                     # the comparison is not vacuous
  _close(y, ref_y)
  assert not np.any(np.asarray(y)[SEGMENTS == 0])      # padding outputs are zero
  if stateless:
    assert new is None and not hasattr(m, 'conv_x_bias')
    # The clamp matters: unclamped, the reference differs.
    free = _reference(_cfg(mamba_conv_bias=False), p, x, SEGMENTS)[0]
    assert np.abs(free - ref_y).max() > 1e-2
  else:
    _close(new.conv, ref_conv)
    _close(new.ssm, ref_ssm)


def test_padded_and_packed_rows_equal_their_segments_alone():
  cfg = _cfg(mamba_chunk=4)
  m = _mixer(cfg)
  x = _inputs(cfg, 2, 7)
  a, b = x[:1], x[1:]
  alone, _ = _apply(m, x, np.ones((2, 7), np.int32))
  alone = np.asarray(alone)
  pad = _inputs(cfg, 1, 4, seed=9)        # padding inputs are ignored, whatever they are
  rows = np.concatenate([
      np.concatenate([a, b, pad], 1),     # packed, then padding
      np.concatenate([pad, a, b], 1),     # left padding, then packed
      np.concatenate([a, pad, b], 1),     # padding between the segments
      np.concatenate([a, b, pad], 1),     # one segment over both: no restart
  ])
  seg = np.array([[1] * 7 + [2] * 7 + [0] * 4, [0] * 4 + [1] * 7 + [2] * 7,
                  [1] * 7 + [0] * 4 + [2] * 7, [1] * 14 + [0] * 4], np.int32)
  y = np.asarray(_apply(m, rows, seg)[0])
  for r, (ia, ib) in enumerate([(0, 7), (4, 11), (0, 11)]):
    _close(y[r, ia:ia + 7], alone[0])
    _close(y[r, ib:ib + 7], alone[1])
  assert not np.any(np.asarray(y)[seg == 0])
  # Not vacuous: without the restart, b's outputs depend on a.
  assert np.abs(y[3, 7:14] - alone[1]).max() > 1e-3


def test_prefill_then_decode_equals_full_forward():
  # The full forward is the float64 reference's (test_matches_float64_reference ties ours
  # to it), which saves compiling two more programs.
  cfg = _cfg(mamba_chunk=4)
  m = _mixer(cfg)
  p = _np_params(m)
  x = _inputs(cfg, 2, 14)
  # Row 0's prompt is 5 tokens, right-padded to row 1's 9; both then decode 5 tokens.
  prompt = x[:, :9].copy()
  prompt[0, 5:] = 7.0                    # padding inputs are ignored, whatever they are
  seg = np.array([[1] * 5 + [0] * 4, [1] * 9], np.int32)
  y, state = _apply(m, prompt, seg, _zero_state(cfg, 2))
  # The right-padded row's state is the state of its unpadded prompt.
  _, conv0, ssm0 = _reference(cfg, p, x[:1, :5], np.ones((1, 5), np.int32))
  _close(np.asarray(state.conv)[:1], conv0)
  _close(np.asarray(state.ssm)[:1], ssm0)
  outs = []
  for i in range(9, 14):
    tok = np.stack([x[0, i - 4], x[1, i]])[:, None]
    out, state = _apply(m, tok, np.ones((2, 1), np.int32), state)
    outs.append(out)
    # A padding step leaves the state as it was and outputs zeros.
    pad_out, same = _apply(m, tok, np.zeros((2, 1), np.int32), state)
    assert not np.any(np.asarray(pad_out))
    np.testing.assert_array_equal(same.ssm, state.ssm)
    np.testing.assert_array_equal(same.conv, state.conv)
  dec = np.concatenate(outs, 1)
  full0 = _reference(cfg, p, x[:1, :10], np.ones((1, 10), np.int32))[0][0]
  full1 = _reference(cfg, p, x[1:], np.ones((1, 14), np.int32))[0][0]
  _close(np.asarray(y)[0, :5], full0[:5])
  _close(np.asarray(y)[1], full1[:9])
  _close(dec[0], full0[5:])
  _close(dec[1], full1[9:])


def test_two_prefill_calls_equal_one():
  # Row 1's second call starts with padding (transparent: the conv window reaches back into
  # the carried state); row 2's second segment starts in the first call.
  cfg = _cfg(mamba_chunk=4)
  m = _mixer(cfg)
  x = _inputs(cfg, 3, 22)
  seg = np.array([[1] * 22, [1] * 11 + [0] * 3 + [1] * 8, [1] * 8 + [2] * 14], np.int32)
  state = _random_state(cfg, 3)
  y, whole = _apply(m, x, seg, state)
  y1, mid = _apply(m, x[:, :11], seg[:, :11], state)
  y2, end = _apply(m, x[:, 11:], seg[:, 11:], mid)
  _close(np.concatenate([y1, y2], 1), y)
  _close(end.conv, whole.conv)
  _close(end.ssm, whole.ssm)


@jax.jit(static_argnums=(0, 4))
def _loss_grads(graphdef, params, x, seg, stepwise, weight):
  def loss(params, x):
    m = nnx.merge(graphdef, params)
    if not stepwise:
      return jnp.sum(m(x, seg)[0] * weight)
    # One-token steps continue the state: restart it by hand where a segment changes.
    prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))
    restart = (seg != prev) & (prev != 0)

    def step(state, inp):
      xt, st, rt, wt = inp
      state = jax.tree.map(lambda v: jnp.where(rt.reshape(-1, *[1] * (v.ndim - 1)), 0, v),
                           state)
      out, state = m(xt[:, None], st[:, None], state)
      return state, jnp.sum(out[:, 0] * wt)

    steps = jax.tree.map(lambda v: jnp.moveaxis(v, 1, 0), (x, seg, restart, weight))
    return jnp.sum(jax.lax.scan(step, mamba.init_state(m.cfg, x.shape[0]), steps)[1])

  return jax.grad(loss, argnums=(0, 1))(params, x)


def _grad_inputs(cfg):
  x = _inputs(cfg, 2, 9)
  seg = np.array([[1] * 4 + [2] * 5, [0] * 3 + [1] * 6], np.int32)
  return x, seg, _inputs(cfg, 2, 9, seed=5)


def _grads(cfg, chunk, stepwise):
  x, seg, weight = _grad_inputs(cfg)
  graphdef, params = nnx.split(_mixer(cfg.replace(mamba_chunk=chunk)))
  return jax.tree.leaves(_loss_grads(graphdef, params, x, seg, stepwise, weight))


def test_grads_finite_and_equal_across_chunk_sizes():
  cfg = _cfg()
  g2, g16 = _grads(cfg, 2, False), _grads(cfg, 16, False)
  assert all(np.isfinite(np.asarray(v)).all() for v in g2)
  assert all(np.abs(np.asarray(v)).max() > 0 for v in g2)    # every parameter, and x
  for u, v in zip(g2, g16):
    _close(u, v, 2e-5)


def test_joined_channels_equal_the_three_parts(monkeypatch):
  # x, B and C projected and convolved as one tensor (`_joins_channels`, what an unsplit
  # mixer runs) give what the three separate parts give: prefill with a state, a decode
  # step from it, and the gradients of every parameter and of x.
  cfg = _cfg(mamba_chunk=4)
  m = _mixer(cfg)
  graphdef, params = nnx.split(m)
  x, seg, weight = _grad_inputs(cfg)
  state = _random_state(cfg, 2)
  tok = _inputs(cfg, 2, 1, seed=3)

  def run(joined):
    monkeypatch.setattr(mamba, '_joins_channels', lambda cfg, rules: joined)
    # Traced anew: the jitted helpers are keyed on their arguments, not on this switch.
    call = jax.jit(lambda p, x, seg, st: nnx.merge(graphdef, p)(x, seg, st))
    y, mid = call(params, x, jnp.asarray(seg), state)
    step, end = call(params, tok, jnp.ones((2, 1), jnp.int32), mid)
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(
        nnx.merge(graphdef, p)(x, jnp.asarray(seg))[0] * weight), argnums=(0, 1)))(params, x)
    return [np.asarray(v) for v in jax.tree.leaves((y, mid, step, end, grads))]

  joined, parts = run(True), run(False)
  assert len(joined) == len(parts)
  for u, v in zip(joined, parts):
    assert np.abs(v).max() > 0
    _close(u, v, 2e-5)


def test_joined_channels_follow_the_mesh(monkeypatch):
  # Joined where neither heads nor groups are split; three parts where 'tensor' splits heads,
  # and on GPUs.
  cfg, rules = _cfg(), sharding.DEFAULT_RULES
  assert mamba._joins_channels(cfg, rules)                # no mesh
  for shape, joined in (((2, 1, 1, 2, 1), True), ((1, 1, 1, 2, 2), False)):
    with sharding.use_mesh(sharding.make_mesh(shape, jax.devices()[:4])):
      assert mamba._joins_channels(cfg, rules) == joined, shape
      # The caller's rules decide: heads kept whole join even where 'tensor' has 2 devices.
      whole = sharding.override_rules(rules, [('mamba_heads', None)])
      assert mamba._joins_channels(cfg, whole)
  monkeypatch.setattr(sharding, 'mesh_platform', lambda: 'gpu')
  assert not mamba._joins_channels(cfg, rules)


def test_a_decode_step_keeps_the_projections_apart():
  # Joining copies the five in-projection weights into one [D, 2HP + 2GN + H]: worth it for a
  # pass over many positions, not on every decode step (one token).
  cfg = _cfg()
  m = _mixer(cfg)
  graphdef, params = nnx.split(m)
  width = 2 * cfg.mamba_heads * cfg.mamba_head_dim + 2 * cfg.mamba_groups * cfg.mamba_state
  width += cfg.mamba_heads

  def joins(t):
    jaxpr = jax.make_jaxpr(lambda p, x, seg, st: nnx.merge(graphdef, p)(x, seg, st))(
        params, _inputs(cfg, 2, t), jnp.ones((2, t), jnp.int32), _random_state(cfg, 2))
    eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == 'concatenate']
    return any(e.outvars[0].aval.shape == (cfg.embed_dim, width) for e in eqns)
  assert mamba._joins_channels(cfg, sharding.DEFAULT_RULES)
  assert joins(8) and not joins(1)


@pytest.mark.heavy
def test_grads_equal_the_decode_steps_grads():
  # The same loss through one-token steps (the plain recurrence, no chunks, no gathers).
  cfg = _cfg()
  for u, v in zip(_grads(cfg, 2, False), _grads(cfg, 2, True)):
    _close(u, v, 2e-5)


def test_long_decay_is_stable():
  # Large dt * |A| (decays of exp(-100) a step) and a near-zero A in one chunk: no NaN and
  # still the reference, in the output, the state and the gradient.
  cfg = _cfg(mamba_chunk=16)
  m = _mixer(cfg)
  m.A_log.value = jnp.asarray(np.log([1.0, 100.0, 1e-3, 30.0]), jnp.float32)
  m.dt_bias.value = jnp.asarray([3.0, 2.0, -6.0, 0.0], jnp.float32)
  x, seg, weight = _grad_inputs(cfg)
  y, state = _apply(m, x, seg, _zero_state(cfg, 2))
  ref_y, _, ref_ssm = _reference(cfg, _np_params(m), x, seg)
  _close(y, ref_y)
  _close(state.ssm, ref_ssm)
  graphdef, params = nnx.split(m)
  g = _loss_grads(graphdef, params, x, seg, False, weight)
  assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(g))


def test_bf16_compute_runs_and_tracks_float32():
  cfg = _cfg(mamba_chunk=4)
  m32 = _mixer(cfg)
  m16 = _mixer(cfg.replace(dtype='bfloat16'))
  x = _inputs(cfg, 2, 10)
  seg = np.array([[1] * 10, [0] * 2 + [1] * 8], np.int32)
  zero = _zero_state(cfg, 2)
  y16, s16 = _apply(m16, x, seg, zero._replace(conv=zero.conv.astype(jnp.bfloat16)))
  assert y16.dtype == jnp.bfloat16 and s16.conv.dtype == jnp.bfloat16
  assert s16.ssm.dtype == jnp.float32
  step, s16 = _apply(m16, x[:, :1], seg[:, :1], s16)
  assert step.dtype == jnp.bfloat16
  for v in (y16, step, s16.ssm):
    assert np.isfinite(np.asarray(v, np.float32)).all()
  y32 = _reference(cfg, _np_params(m32), x, seg)[0]
  err = np.abs(np.asarray(y16, np.float32) - np.asarray(y32)).max()
  assert err < 0.05 * np.abs(np.asarray(y32)).max()


def test_init_and_param_axes():
  cfg = _cfg()
  # 'rbg' keys: threefry's initialisers took 7 s of CPU to compile here.
  make = lambda: mamba.Mamba2Mixer(cfg, nnx.Rngs(jax.random.key(0, impl='rbg')))
  abstract = nnx.eval_shape(make)
  m = nnx.merge(nnx.graphdef(abstract), jax.jit(lambda: nnx.state(make()))())
  h, p, g, n, k, d = (cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_groups, cfg.mamba_state,
                      cfg.mamba_conv, cfg.embed_dim)
  shapes = dict(z_proj=(d, h, p), x_proj=(d, h, p), b_proj=(d, g, n), c_proj=(d, g, n),
                dt_proj=(d, h), conv_x=(k, h, p), conv_b=(k, g, n), conv_c=(k, g, n),
                conv_x_bias=(h, p), conv_b_bias=(g, n), conv_c_bias=(g, n), dt_bias=(h,),
                A_log=(h,), D=(h,), norm=(h, p), out_proj=(h, p, d))
  assert set(shapes) == set(PARAMS)
  for name, shape in shapes.items():
    param = getattr(m, name)
    assert param.value.shape == shape, name
    assert len(param.logical_axes) == len(shape), name
  assert 0.015 < np.std(np.asarray(m.x_proj.value)) < 0.025
  np.testing.assert_allclose(m.A_log.value, np.log(np.arange(1, h + 1)), rtol=1e-6)
  np.testing.assert_array_equal(m.D.value, 1.0)
  np.testing.assert_array_equal(m.norm.value, 1.0)
  np.testing.assert_array_equal(m.conv_x_bias.value, 0.0)
  dt = np.log1p(np.exp(np.asarray(m.dt_bias.value, np.float64)))
  assert np.all(dt >= mamba.DT_INIT_MIN * 0.999) and np.all(dt <= mamba.DT_INIT_MAX * 1.001)
  assert len(set(dt.tolist())) == h
  s = mamba.init_state(cfg, 3)
  assert s.conv.shape == (3, k - 1, cfg.mamba_conv_dim) and s.ssm.shape == (3, h, p, n)
  assert s.conv.dtype == cfg.jnp_dtype and s.ssm.dtype == jnp.float32


@pytest.mark.heavy
def test_sharded_over_heads_matches_unsharded():
  assert jax.device_count() >= 8
  cfg = _cfg(mamba_chunk=4)
  ref = _mixer(cfg)
  x = _inputs(cfg, 2, 9)
  seg = jnp.array([[1] * 9, [0] * 2 + [1] * 7], jnp.int32)
  want, want_state = ref(x, seg, mamba.init_state(cfg, 2))
  mesh = sharding.make_mesh((2, 1, 4))
  graphdef, state = nnx.split(ref)
  state = sharding.shard_state(state, mesh)
  assert state['x_proj'].value.sharding.spec[1] == 'tensor'      # heads split 4 ways
  with sharding.use_mesh(mesh):
    got, got_state = jax.jit(lambda s, x, seg, st: nnx.merge(graphdef, s)(x, seg, st))(
        state, x, seg, mamba.init_state(cfg, 2))
  _close(got, want)
  _close(got_state.ssm, want_state.ssm)


# ---- context parallelism: a row split along T over the sequence axis (models.context) ----


def _cp_segments(layout, t=64):
  """Two rows of segment ids for a T = 64 row split 2 ways (pieces of 16 tokens) or 4 ways
  (pieces of 8); shard i holds pieces i and 2n - 1 - i."""
  seg = np.ones((2, t), np.int32)
  if layout == 'mid_and_boundary':
    seg[0, 21:] = 2                   # starts inside piece 1 (shard 1 of 2)
    seg[0, 48:] = 3                   # at piece 3's start: shard 0's second piece (of 2)
    seg[1, :3] = 0                    # left padding
    seg[1, 16:] = 2                   # at shard 1's first piece (of 2 and of 4)
    seg[1, 37:39] = 0                 # padding between segments 2 and 3
    seg[1, 39:] = 3
  elif layout == 'boundaries':        # every start on a piece boundary of both splits
    seg[0, 16:] = 2
    seg[0, 32:] = 3
    seg[1, 8:] = 2
    seg[1, 40:] = 1
    seg[1, 56:] = 0
  elif layout == 'sparse':
    # A piece with one real token: the window of token 30 reaches back to tokens 20, 9, 8
    # over two pieces of padding; a repeated id after another restarts.
    seg[0, 10:30] = 0
    seg[0, 20] = 1
    seg[0, 50:60] = 2
    seg[0, 60:] = 0
    seg[1, 12:26] = 5
    seg[1, 26:] = 3
    seg[1, :12] = 3
    seg[1, 40:43] = 0                 # padding inside a segment: transparent
  else:
    assert layout == 'none'
  return seg


def _cp_forward_grads(m, x, seg, weight, mesh=None):
  """(y [B, T, D], grads of sum(y * weight) wrt the parameters and x) with the row in
  zig-zag order under `mesh` (context parallel), or plainly without one."""
  graphdef, params = nnx.split(m)
  names = ('batch', 'length', 'embed')

  def loss(params, x):
    mixer = nnx.merge(graphdef, params)
    rules = sharding.DEFAULT_RULES
    zz_seg = context.to_zigzag(jnp.asarray(seg), names[:2], rules)
    y = mixer(context.to_zigzag(x, names, rules), zz_seg)[0]
    y = context.from_zigzag(y, names, rules)
    return jnp.sum(y * weight), y

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  if mesh is None:
    (_, y), grads = f(params, x)
  else:
    with sharding.use_mesh(mesh):
      assert context.shards(x.shape[1], sharding.DEFAULT_RULES) == mesh.shape['sequence']
      (_, y), grads = f(sharding.shard_state(params, mesh), x)
  return np.asarray(y), [np.asarray(g) for g in jax.tree.leaves(grads)]


def _check_context_parallel(layout, sequence, tensor, monkeypatch, reference=False):
  cfg = _cfg()                                    # chunk 8; 4 heads in 2 groups; conv 4
  m = _mixer(cfg)
  seg = _cp_segments(layout)
  x, weight = _inputs(cfg, 2, 64), _inputs(cfg, 2, 64, seed=5)
  want_y, want_g = _cp_forward_grads(m, x, seg, weight)
  calls = []
  monkeypatch.setattr(mamba, '_context_parallel',
                      lambda *a, f=mamba._context_parallel: (calls.append(1), f(*a))[1])
  mesh = sharding.make_mesh((8 // (sequence * tensor), 1, 1, sequence, tensor))
  y, g = _cp_forward_grads(m, x, seg, weight, mesh)
  assert calls                                    # the mixer ran context-parallel
  assert np.abs(want_y).max() > 0.5
  _close(y, want_y)
  assert not np.any(y[seg == 0])
  for got, want in zip(g, want_g):
    assert np.abs(want).max() > 0
    _close(got, want)
  if reference:
    _close(y, _reference(cfg, _np_params(m), x, seg)[0])


def test_context_parallel_forward_and_grads_equal_unsharded_and_float64(monkeypatch):
  # Two sequence shards x two tensor shards (heads with their groups) x two batch shards;
  # segments start inside a shard and at shard boundaries.
  _check_context_parallel('mid_and_boundary', 2, 2, monkeypatch, reference=True)


def test_context_parallel_with_joined_channels_equals_unsharded(monkeypatch):
  # No tensor axis: x, B and C go through the shards as one joined tensor.
  joined = []
  monkeypatch.setattr(mamba, '_joins_channels',
                      lambda cfg, rules, f=mamba._joins_channels: (
                          joined.append(f(cfg, rules)), f(cfg, rules))[1])
  _check_context_parallel('sparse', 4, 1, monkeypatch)
  assert joined and all(joined)


@pytest.mark.heavy
@pytest.mark.parametrize('sequence,tensor', [(2, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize('layout', ['none', 'mid_and_boundary', 'boundaries', 'sparse'])
def test_context_parallel_equals_unsharded(layout, sequence, tensor, monkeypatch):
  # (2, 4): 4 tensor shards do not divide the 2 groups, so each shard scans all heads.
  _check_context_parallel(layout, sequence, tensor, monkeypatch, reference=layout == 'sparse')


# ---- transformers' NemotronHMamba2Mixer ----


def _hf_mixer(cfg):
  transformers_cfg = pytest.importorskip('transformers.models.nemotron_h.configuration_nemotron_h')
  modeling = pytest.importorskip('transformers.models.nemotron_h.modeling_nemotron_h')
  hf_cfg = transformers_cfg.NemotronHConfig(
      hidden_size=cfg.embed_dim, mamba_num_heads=cfg.mamba_heads,
      mamba_head_dim=cfg.mamba_head_dim, n_groups=cfg.mamba_groups,
      ssm_state_size=cfg.mamba_state, conv_kernel=cfg.mamba_conv, chunk_size=cfg.mamba_chunk,
      use_conv_bias=cfg.mamba_conv_bias, time_step_min=cfg.mamba_dt_min,
      layer_norm_epsilon=cfg.norm_eps, layers_block_type=['linear_attention'], vocab_size=32,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
      moe_shared_expert_intermediate_size=16)
  return modeling.NemotronHMamba2Mixer(hf_cfg, layer_idx=0).eval()


def _to_hf(cfg, p):
  """Our parameters (numpy) as the HF mixer's state dict (numpy), per the module docstring."""
  d, k = cfg.embed_dim, cfg.mamba_conv
  rows = lambda w: w.reshape(d, -1).T
  out = {
      'in_proj.weight': np.concatenate([rows(p['z_proj']), rows(p['x_proj']), rows(p['b_proj']),
                                        rows(p['c_proj']), p['dt_proj'].T]),
      'conv1d.weight': np.concatenate([p['conv_x'].reshape(k, -1), p['conv_b'].reshape(k, -1),
                                       p['conv_c'].reshape(k, -1)], axis=1).T[:, None, :],
      'dt_bias': p['dt_bias'], 'A_log': p['A_log'], 'D': p['D'],
      'norm.weight': p['norm'].ravel(),
      'out_proj.weight': p['out_proj'].reshape(-1, d).T,
  }
  if cfg.mamba_conv_bias:
    out['conv1d.bias'] = np.concatenate([p['conv_x_bias'].ravel(), p['conv_b_bias'].ravel(),
                                         p['conv_c_bias'].ravel()])
  return out


def _from_hf(cfg, sd):
  """The HF mixer's state dict (numpy) as our parameters, per the module docstring."""
  d, h, p, g, n, k = (cfg.embed_dim, cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_groups,
                      cfg.mamba_state, cfg.mamba_conv)
  hp, gn = h * p, g * n
  w = sd['in_proj.weight']
  cw = sd['conv1d.weight'][:, 0, :]
  out = dict(
      z_proj=w[:hp].T.reshape(d, h, p), x_proj=w[hp:2 * hp].T.reshape(d, h, p),
      b_proj=w[2 * hp:2 * hp + gn].T.reshape(d, g, n),
      c_proj=w[2 * hp + gn:2 * hp + 2 * gn].T.reshape(d, g, n),
      dt_proj=w[2 * hp + 2 * gn:].T,
      conv_x=cw[:hp].T.reshape(k, h, p), conv_b=cw[hp:hp + gn].T.reshape(k, g, n),
      conv_c=cw[hp + gn:].T.reshape(k, g, n),
      dt_bias=sd['dt_bias'], A_log=sd['A_log'], D=sd['D'], norm=sd['norm.weight'].reshape(h, p),
      out_proj=sd['out_proj.weight'].T.reshape(h, p, d))
  if cfg.mamba_conv_bias:
    cb = sd['conv1d.bias']
    out.update(conv_x_bias=cb[:hp].reshape(h, p), conv_b_bias=cb[hp:hp + gn].reshape(g, n),
               conv_c_bias=cb[hp + gn:].reshape(g, n))
  return out


def test_matches_transformers_nemotron_h_mixer():
  torch = pytest.importorskip('torch')
  cfg = _cfg(mamba_chunk=16)          # HF's time_step_limit is (time_step_min, inf)
  hf = _hf_mixer(cfg)
  ours = _mixer(cfg)
  p = _np_params(ours)
  # Ours -> HF, then HF -> ours round-trips exactly.
  hf.load_state_dict({k: torch.tensor(v, dtype=torch.float32)
                      for k, v in _to_hf(cfg, p).items()})
  sd = {k: v.detach().numpy().astype(np.float64) for k, v in hf.state_dict().items()}
  back = _from_hf(cfg, sd)
  assert set(back) == set(p)
  for name in p:
    np.testing.assert_array_equal(back[name], p[name], err_msg=name)

  x = _inputs(cfg, 2, 37)             # two chunks and a bit
  with torch.no_grad():
    want = hf(torch.tensor(np.asarray(x))).numpy()
  got, _ = _apply(ours, x, np.ones((2, 37), np.int32))
  assert np.abs(want).max() > 0.5
  _close(got, want, 1e-4)

  mask = np.ones((2, 37), np.int64)
  mask[1, :9] = 0                     # left padding
  with torch.no_grad():
    want = hf(torch.tensor(np.asarray(x)), attention_mask=torch.tensor(mask)).numpy()
  got, _ = _apply(ours, x, mask)
  _close(got, want, 1e-4)


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_real_first_is_the_stable_argsort(seed):
  """`mamba._real_first` counts the real-tokens-first order; numpy's stable argsort of ~real is
  the reference, and inv is its inverse. Rows with no real token and with all real included."""
  rng = np.random.default_rng(seed)
  real = rng.random((5, 23)) < 0.6
  real[0], real[1] = False, True
  perm, inv = jax.jit(mamba._real_first)(jnp.asarray(real))
  want = np.argsort(~real, axis=1, kind='stable')
  np.testing.assert_array_equal(np.asarray(perm), want)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(inv), want, 1),
                                np.broadcast_to(np.arange(23), (5, 23)))


def test_last_real_matches_numpy_and_differentiates():
  """`mamba._last_real`: each row's last k1 real positions, oldest first, zero-filled in front,
  as a numpy loop gives; its gradient puts each slot's cotangent back on its token."""
  rng = np.random.default_rng(4)
  real = rng.random((4, 17)) < 0.5
  real[0], real[1, :] = False, False
  real[1, 5] = True                                         # one real token: two zero slots
  u = rng.normal(size=(4, 17, 2, 3)).astype(np.float32)
  got = np.asarray(mamba._last_real(jnp.asarray(u), jnp.asarray(real), 3))
  want = np.zeros((4, 3, 2, 3), np.float32)
  for b in range(4):
    idx = np.flatnonzero(real[b])[-3:]
    want[b, 3 - len(idx):] = u[b, idx]
  np.testing.assert_array_equal(got, want)
  w = rng.normal(size=want.shape).astype(np.float32)
  g = np.asarray(jax.grad(lambda x: jnp.sum(mamba._last_real(x, jnp.asarray(real), 3) * w))(
      jnp.asarray(u)))
  gw = np.zeros_like(u)
  for b in range(4):
    idx = np.flatnonzero(real[b])[-3:]
    gw[b, idx] = w[b, 3 - len(idx):]
  np.testing.assert_array_equal(g, gw)


@pytest.mark.parametrize('length,chunk', [(1, 4), (7, 4), (16, 4), (300, 128)])
def test_cumsums_by_matmul_equal_float64_cumsum(length, chunk):
  """`_chunk_cumsum` (a triangular matmul) and the scan's cumulative log decays over a whole
  row (`_ssd(..., cumulative=True)`: each chunk's, plus the chunks' totals before it) equal
  numpy's float64 cumulative sum, with their gradients (reversed sums); the log decays
  dt * A are negative, with magnitudes up to a few units."""
  rng = np.random.default_rng(length)
  h, p, g, n = 3, 2, 1, 2
  dt = rng.uniform(0.0, 2.0, size=(2, length, h))
  dt[0, length // 2] = 0.0                                   # a padding position: no decay
  a = -rng.uniform(0.5, 2.0, size=h)
  ref = np.cumsum(dt * a, axis=1)
  atol = 1e-5 * max(1, length / 64)
  got = mamba._chunk_cumsum(jnp.asarray(np.moveaxis(dt * a, 1, -1), jnp.float32))
  np.testing.assert_allclose(got, np.moveaxis(ref, 1, -1), rtol=1e-6, atol=atol)
  x = jnp.asarray(rng.normal(size=(2, length, h, p)), jnp.float32)
  bm = cm = jnp.asarray(rng.normal(size=(2, length, g, n)), jnp.float32)
  run = jnp.zeros((2, length), jnp.int32)
  h0 = jnp.zeros((2, h, p, n), jnp.float32)

  def cum(dt):
    return mamba._ssd(x, dt, jnp.asarray(a, jnp.float32), bm, cm, run, h0, chunk,
                      cumulative=True)[2]

  got = cum(jnp.asarray(dt, jnp.float32))
  np.testing.assert_allclose(got, ref, rtol=1e-6, atol=atol)
  w = rng.normal(size=ref.shape)
  grad = jax.grad(lambda v: jnp.sum(cum(v) * w))(jnp.asarray(dt, jnp.float32))
  want = np.cumsum(w[:, ::-1], axis=1)[:, ::-1] * a
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-4 * max(1, length / 64))
