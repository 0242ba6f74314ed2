"""benchmarks.compile_bound's stand-ins: the real parts' shapes and dtypes, every input used.

A stand-in that dropped an input would let the compiler drop what computes it (a projection,
its gradient), and the bound would claim that saving for the part: each float input must reach
an output through the gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from benchmarks import compile_bound as cb
from models import config as config_lib
from models import mamba

B, T, H, P, G, N, K, L = 2, 8, 4, 2, 2, 3, 4, 4


def _x(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


RUN = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
REAL = jnp.asarray([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], bool)


def _cases():
  """(part, function name, float args, other args, kwargs): each real call a stand-in replaces."""
  ssd = (_x((B, T, H, P), 0), jnp.abs(_x((B, T, H), 1)), -jnp.abs(_x((H,), 2)),
         _x((B, T, G, N), 3), _x((B, T, G, N), 4))
  parts = (_x((B, T, H, P), 5), _x((B, T, G, N), 6), _x((B, T, G, N), 7))
  convs = lambda bias: tuple((_x((K,) + u.shape[2:], 8 + i),
                              _x(u.shape[2:], 20 + i) if bias else None)
                             for i, u in enumerate(parts))
  prefix = tuple(_x((B, K - 1) + u.shape[2:], 30 + i) for i, u in enumerate(parts))
  s = 3
  tails = tuple(_x((s, B, K - 1) + u.shape[2:], 40 + i) for i, u in enumerate(parts))
  ints = jnp.ones((s, B), jnp.int32)
  return [
      ('scan', '_ssd', (*ssd, _x((B, H, P, N), 9)), (RUN,), dict(chunk=L)),
      ('scan', '_ssd', (*ssd, _x((B, H, P, N), 9)), (RUN,), dict(chunk=L, cumulative=True)),
      ('conv', '_conv_scan', (parts, convs(True)), (None, REAL, RUN), dict(want_state=False)),
      ('conv', '_conv_scan', (parts, convs(False), prefix), (REAL, RUN), dict(want_state=True)),
      ('conv_tail', '_conv_tail', (parts,), (REAL, RUN), dict(k=K)),
      ('folds', '_fold_windows', (tails,), (ints, ints, ints, ints > 0), {}),
      ('folds', '_fold_states', (_x((s, B, H), 50), _x((s, B, H, P, N), 51)),
       (ints > 0, ints < 0), {}),
      ('gated_norm', '_gated_norm', (_x((B, T, H, P), 60), _x((B, T, H, P), 61), _x((H, P), 62)),
       (), dict(groups=G, eps=1e-5)),
  ]


def _call(fn, name, floats, others, kwargs):
  if name == '_ssd':       # (x, dt, a, bm, cm, run, h0)
    return fn(*floats[:5], others[0], floats[5], **kwargs)
  return fn(*floats, *others, **kwargs)


@pytest.mark.parametrize('case', _cases(), ids=lambda c: f'{c[1]}-{sorted(c[4].items())}')
def test_a_stand_in_has_the_parts_shapes_and_uses_every_input(case):
  part, name, floats, others, kwargs = case
  stand_in = cb.STAND_INS[part][name]
  want = jax.eval_shape(lambda *f: _call(getattr(mamba, name), name, f, others, kwargs), *floats)
  got = jax.eval_shape(lambda *f: _call(stand_in, name, f, others, kwargs), *floats)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert (g.shape, g.dtype) == (w.shape, w.dtype), (name, g, w)

  def total(*f):
    out = _call(stand_in, name, f, others, kwargs)
    return sum(jnp.sum(jnp.asarray(o, jnp.float32) ** 2)
               for o in jax.tree.leaves(out) if jnp.issubdtype(o.dtype, jnp.floating))
  grads = jax.grad(total, argnums=tuple(range(len(floats))))(*floats)
  for i, g in enumerate(grads):
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g)), (name, 'input', i)


def test_freed_replaces_the_parts_and_restores_them():
  real = mamba._ssd, mamba._fold_states, mamba._gated_norm
  with cb.freed(('scan', 'folds')):
    assert mamba._ssd is cb._ssd and mamba._fold_states is cb._fold_states
    assert mamba._gated_norm is real[2]
  assert (mamba._ssd, mamba._fold_states, mamba._gated_norm) == real
  with pytest.raises(RuntimeError), cb.freed(('conv',)):
    raise RuntimeError('a failed plan')
  assert mamba._conv_scan is not cb._conv_scan


def test_free_parts_are_checked():
  assert cb.parse_free('scan, folds') == ('scan', 'folds')
  with pytest.raises(ValueError, match="unknown part.*'ssm'.*choose from scan"):
    cb.parse_free('scan,ssm')
  with pytest.raises(ValueError, match='none given'):
    cb.parse_free(' , ')


def test_the_report_pairs_the_runs_by_program():
  line = lambda name, lower, comp: dict(program=name, lower_s=lower, compile_s=comp, cpu_s=2 * comp)
  text = '\n'.join(['noise', cb._LINE + '{"program": "train step", "lower_s": 3.0, '
                    '"compile_s": 87.0, "cpu_s": 160.0}'])
  assert cb.read_lines(text) == [line('train step', 3.0, 87.0) | dict(cpu_s=160.0)]
  rows = cb.report({'as is': [line('train step', 3.0, 87.0)],
                    'scan+conv': [line('train step', 2.0, 68.0)],
                    'mixer': [line('train step', 2.0, 48.0)]})
  assert rows[0].count('bound on the saving') == 2 and rows[1].count('---:') == 5
  assert rows[2] == ('| train step | 3.0 + 87.0 s (174 s) | 2.0 + 68.0 s (136 s) | '
                     '20.0 s (22 %) | 2.0 + 48.0 s (96 s) | 40.0 s (44 %) |')
  with pytest.raises(ValueError, match='different programs'):
    cb.report({'as is': [line('a', 1, 1)], 'scan': [line('b', 1, 1)]})
  assert cb.parse_sets('scan,conv/mixer') == (('scan', 'conv'), ('mixer',))
  with pytest.raises(ValueError, match='none given'):
    cb.parse_sets('scan/')

@pytest.mark.parametrize('with_state', [False, True])
def test_the_mixer_stand_in_has_its_shapes_and_reaches_every_parameter(with_state):
  cfg = config_lib.ModelConfig.tiny_hybrid()
  mixer = mamba.Mamba2Mixer(cfg, nnx.Rngs(0))
  x = _x((B, T, cfg.embed_dim), 70).astype(cfg.jnp_dtype)
  seg = jnp.ones((B, T), jnp.int32)
  state = mamba.init_state(cfg, B) if with_state else None
  want = jax.eval_shape(lambda x: mixer(x, seg, state), x)
  with cb.freed(('mixer',)):
    assert mamba.Mamba2Mixer.__call__ is cb._mixer
    got = jax.eval_shape(lambda x: mixer(x, seg, state), x)
    graphdef, params = nnx.split(mixer)
    grads = jax.grad(lambda p, x: jnp.sum(
        nnx.merge(graphdef, p)(x, seg, state)[0].astype(jnp.float32) ** 2), argnums=(0, 1))(
            params, x)
  assert mamba.Mamba2Mixer.__call__ is not cb._mixer
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert (g.shape, g.dtype) == (w.shape, w.dtype)
  leaves = jax.tree.leaves(grads)
  assert len(leaves) == len(jax.tree.leaves(params)) + 1
  assert all(float(jnp.abs(g).max()) > 0 for g in leaves)


@pytest.mark.parametrize('load, warned', [(0.5, False), (9.0, True)])
def test_main_plans_once_per_set_in_a_child_and_writes_the_page(monkeypatch, tmp_path, capsys,
                                                                load, warned):
  """main() without libtpu or a plan: the children are faked; what each is asked to free, the
  page (the command, the loads, the warning above a busy host's table) is checked."""
  import os
  import subprocess
  import sys
  import types
  monkeypatch.setitem(sys.modules, 'libtpu', types.ModuleType('libtpu'))
  monkeypatch.setattr(os, 'getloadavg', lambda: (load, load, load))
  asked = []

  def fake_run(cmd, env, **kw):
    del kw
    asked.append((cmd[-2:], env[cb.FREE_ENV]))
    secs = {'-': 80.0, 'scan,conv': 70.0, 'mixer': 50.0}[env[cb.FREE_ENV]]
    out = cb._LINE + '{"program": "train step (x)", "lower_s": 2.0, "compile_s": %s, ' \
        '"cpu_s": 1.0}\n' % secs
    return subprocess.CompletedProcess(cmd, 0, stdout='plan output\n' + out, stderr='')
  monkeypatch.setattr(subprocess, 'run', fake_run)
  page = tmp_path / 'bound.md'
  cb.main(['--config=c.py', '--stages=sft', '--free=scan,conv/mixer', f'--out={page}'])
  assert asked == [(['--config=c.py', '--stages=sft'], e) for e in ('-', 'scan,conv', 'mixer')]
  text = page.read_text()
  assert text.startswith('# Compile bound: `python -m benchmarks.compile_bound --config=c.py '
                         '--stages=sft --free=scan,conv/mixer --out=')
  assert text.count(' run (1, 5, 15 min)') == 3
  assert ('WARNING: the host was loaded' in text) == warned
  assert ('WARNING: the host was loaded' in capsys.readouterr().out) == warned
  assert '| train step (x) | 2.0 + 80.0 s (1 s) | 2.0 + 70.0 s (1 s) | 10.0 s (12 %) | ' \
         '2.0 + 50.0 s (1 s) | 30.0 s (37 %) |' in text

  def failing(cmd, env, **kw):
    del env, kw
    return subprocess.CompletedProcess(cmd, 1, stdout='', stderr='RESOURCE_EXHAUSTED')
  monkeypatch.setattr(subprocess, 'run', failing)
  with pytest.raises(SystemExit, match="(?s)the 'as is' plan failed .exit 1.*RESOURCE_EXHAUSTED"):
    cb.main(['--config=c.py'])
  with pytest.raises(SystemExit, match='unknown part'):
    cb.main(['--free=ssm'])
