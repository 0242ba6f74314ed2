"""Optimizers and schedules by name (rl.train_step.OPTIMIZERS, SCHEDULES; a stage's
`optimizer=dict(name=..., schedule=..., args=...)`): each optimizer's updates equal a float64
numpy implementation of its rule (adafactor: optax's own, built directly), with clipping,
warm-up, the schedule and the matrices-only weight decay; the default stays the AdamW it was,
bit for bit; bad choices are one line naming the field."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cascade import config as config_lib
from cascade import overrides
from cascade.kinds import base
from cascade.schema import ConfigError
from rl import train_step as ts

STEPS = 6


def _params():
  rng = np.random.default_rng(0)
  return {'w': rng.normal(size=(4, 3)).astype(np.float32),     # a matrix: decayed
          'b': rng.normal(size=(3,)).astype(np.float32)}       # a vector: never decayed


def _grads():
  rng = np.random.default_rng(1)
  return [{'w': rng.normal(size=(4, 3)) * s, 'b': rng.normal(size=(3,)) * s}
          for s in np.linspace(0.2, 3.0, STEPS)]   # the later ones are clipped


def _run(cfg):
  """Params after STEPS updates of make_optimizer(cfg), as float64."""
  tx = ts.make_optimizer(cfg)
  params = jax.tree.map(jnp.asarray, _params())
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in _grads():
    g = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
    u, state = update(g, state, params)
    params = optax.apply_updates(params, u)
  return {k: np.asarray(v, np.float64) for k, v in params.items()}


def _lr(cfg, c):
  """The schedule's definition (float64): warm-up lr * (c + 1) / W, then constant, cosine or
  linear from lr down to min_lr_ratio * lr over decay_steps."""
  lr = cfg.lr
  if cfg.warmup_steps:
    lr *= min(1.0, (c + 1) / cfg.warmup_steps)
  t = min(max((c - cfg.warmup_steps) / max(cfg.decay_steps, 1), 0.0), 1.0)
  if cfg.schedule == 'cosine':
    lr *= cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
  elif cfg.schedule == 'linear':
    lr *= 1 - (1 - cfg.min_lr_ratio) * t
  return lr


def _reference(cfg):
  """The same STEPS updates in float64 numpy, from each optimizer's published rule."""
  p = {k: v.astype(np.float64) for k, v in _params().items()}
  decays = {'w': 1.0, 'b': 0.0}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v2 = {k: np.zeros_like(v) for k, v in p.items()}
  args = dict(cfg.args)
  for c, g in enumerate(_grads()):
    norm = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
    if cfg.clip_norm and norm > cfg.clip_norm:
      g = {k: x * cfg.clip_norm / norm for k, x in g.items()}
    lr, wd = _lr(cfg, c), cfg.weight_decay
    for k in p:
      if cfg.name == 'adamw':
        b1, b2, eps = cfg.b1 or 0.9, cfg.b2 or 0.999, cfg.eps or 1e-8
        m[k] = b1 * m[k] + (1 - b1) * g[k]
        v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
        mhat, vhat = m[k] / (1 - b1 ** (c + 1)), v2[k] / (1 - b2 ** (c + 1))
        u = mhat / (np.sqrt(vhat) + eps) + wd * decays[k] * p[k]
      elif cfg.name == 'lion':
        b1, b2 = cfg.b1 or 0.9, cfg.b2 or 0.99
        u = np.sign(b1 * m[k] + (1 - b1) * g[k]) + wd * decays[k] * p[k]
        m[k] = b2 * m[k] + (1 - b2) * g[k]
      elif cfg.name == 'sgd':
        gk = g[k] + wd * decays[k] * p[k]           # decay added to the gradient
        mom = args.get('momentum')
        if mom is None:
          u = gk
        else:
          m[k] = gk + mom * m[k]
          u = gk + mom * m[k] if args.get('nesterov') else m[k]
      p[k] = p[k] - lr * u
  return p


CASES = [
    ts.OptimizerConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2),
    ts.OptimizerConfig(lr=3e-2, b1=0.8, b2=0.95, eps=1e-6, schedule='cosine',
                       decay_steps=4, min_lr_ratio=0.1, clip_norm=2.0),
    ts.OptimizerConfig(name='lion', lr=1e-2, weight_decay=0.5, schedule='linear',
                       decay_steps=5, min_lr_ratio=0.2, warmup_steps=1),
    ts.OptimizerConfig(name='lion', lr=1e-2, b1=0.95, b2=0.98, clip_norm=0.0),
    ts.OptimizerConfig(name='sgd', lr=0.1, schedule='linear', decay_steps=6),
    ts.OptimizerConfig(name='sgd', lr=0.1, weight_decay=0.3,
                       args={'momentum': 0.9}, warmup_steps=3),
    ts.OptimizerConfig(name='sgd', lr=0.05, args={'momentum': 0.8, 'nesterov': True},
                       schedule='cosine', decay_steps=3),
]


@pytest.mark.parametrize('cfg', CASES, ids=lambda c: f'{c.name}-{c.schedule}')
def test_updates_equal_the_float64_rule(cfg):
  got, want = _run(cfg), _reference(cfg)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=k)
  moved = sum(float(np.abs(want[k] - v).max()) for k, v in _params().items())
  assert moved > 1e-3                                # the test would see a no-op optimizer


def test_adafactor_is_optaxs_with_the_configs_choices():
  cfg = ts.OptimizerConfig(name='adafactor', lr=1e-2, weight_decay=0.1,
                           schedule='linear', decay_steps=6, warmup_steps=2,
                           args={'factored': True, 'min_dim_size_to_factor': 2,
                                 'multiply_by_parameter_scale': False})
  mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  direct = optax.chain(optax.clip_by_global_norm(1.0), optax.adafactor(
      ts.optax_schedule(cfg), factored=True, min_dim_size_to_factor=2,
      multiply_by_parameter_scale=False, weight_decay_rate=0.1, weight_decay_mask=mask))
  got = _run(cfg)
  params = jax.tree.map(jnp.asarray, _params())
  state, update = direct.init(params), jax.jit(direct.update)
  for g in _grads():
    u, state = update(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g), state, params)
    params = optax.apply_updates(params, u)
  for k in got:
    np.testing.assert_allclose(got[k], np.asarray(params[k], np.float64), rtol=1e-5, atol=1e-6)
  # Factored: the (4, 3) matrix keeps a row and a column second moment, not a full one.
  shapes = {tuple(x.shape) for x in jax.tree.leaves(ts.make_optimizer(cfg).init(_params()))}
  assert (4,) in shapes and (3,) in shapes and (4, 3) not in shapes


def test_the_default_is_the_adamw_it_was_bit_for_bit():
  cfg = ts.OptimizerConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2)
  mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  before = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      ts.make_schedule(cfg), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, mask=mask))
  now = ts.make_optimizer(cfg)
  params = jax.tree.map(jnp.asarray, _params())
  s0, s1 = before.init(params), now.init(params)
  assert jax.tree.structure(s0) == jax.tree.structure(s1)    # old checkpoints still restore
  up0, up1 = jax.jit(before.update), jax.jit(now.update)
  for g in _grads():
    g = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
    (u0, s0), (u1, s1) = up0(g, s0, params), up1(g, s1, params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(u0), jax.tree.leaves(u1)))


@pytest.mark.parametrize('make', [ts.make_schedule, ts.optax_schedule])
@pytest.mark.parametrize('cfg', [
    ts.OptimizerConfig(lr=1e-3, schedule='linear', decay_steps=10),
    ts.OptimizerConfig(lr=2e-6, schedule='linear', decay_steps=7, warmup_steps=5,
                       min_lr_ratio=0.25),
    ts.OptimizerConfig(lr=1.0, schedule='linear', decay_steps=1, warmup_steps=1),
])
def test_the_linear_schedule_matches_its_formula_at_every_step(cfg, make):
  counts = np.arange(cfg.warmup_steps + cfg.decay_steps + 4)
  got = np.asarray(jax.vmap(make(cfg))(jnp.asarray(counts, jnp.int32)))
  want = np.array([_lr(cfg, int(c)) for c in counts])
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-7 * cfg.lr)
  assert want[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio)


@pytest.mark.parametrize('kw,message', [
    (dict(name='adamx'), "name='adamx': unknown optimizer (known: adafactor, adamw, lion, sgd)"),
    (dict(name='sgd', b1=0.9), 'b1=0.9: sgd takes no b1'),
    (dict(name='lion', eps=1e-8), 'eps=1e-08: lion takes no eps'),
    (dict(name='sgd', args={'momentm': 0.9}),
     'args.momentm: not an argument of optax.sgd (nearest: momentum)'),
    (dict(args={'learning_rate': 1.0}), 'args.learning_rate: not an argument of optax.adamw'),
    (dict(schedule='linear'), 'decay_steps: must be >= 1 for the linear schedule'),
])
def test_a_bad_choice_is_one_line_naming_the_field(kw, message):
  with pytest.raises(ValueError) as e:
    ts.OptimizerConfig(lr=1.0, **kw)
  assert message in str(e.value) and '\n' not in str(e.value)


WHERE = "stages[4] 'math_rl'"


@pytest.mark.parametrize('raw,message', [
    (dict(lr=1e-3, name='adamx'), f"{WHERE}: optimizer.name='adamx': unknown optimizer"),
    (dict(lr=1e-3, name='sgd', b2=0.9), f'{WHERE}: optimizer.b2=0.9: sgd takes no b2'),
    (dict(lr=1e-3, name='sgd', args=dict(momentm=0.9)),
     f'{WHERE}: optimizer.args.momentm: not an argument of optax.sgd (nearest: momentum)'),
    (dict(lr=1e-3, args=[0.9]), f'{WHERE}: optimizer.args=[0.9]: must be a dict'),
    (dict(lr=1e-3, schedule='linea'),
     f"{WHERE}: optimizer.schedule='linea': unknown schedule (known: constant, cosine, linear)"),
    (dict(lr=1e-3, b1=1.5), f'{WHERE}: optimizer.b1=1.5: must be in [0, 1)'),
])
def test_a_stages_bad_optimizer_is_one_config_error_line(raw, message):
  with pytest.raises(ConfigError) as e:
    base.parse_optimizer(raw, WHERE)
  assert str(e.value).startswith(message) and '\n' not in str(e.value)


def test_a_stage_chooses_its_optimizer_and_schedule_from_the_command_line():
  from absl import flags  # pylint: disable=g-import-not-at-top
  argv = ['prog', '--config=configs/tiny.py:smoke', '--config.stages.math_rl.optimizer.name=sgd',
          '--config.stages.math_rl.optimizer.schedule=linear',
          "--config.stages.math_rl.optimizer.args={'momentum': 0.9}"]
  fv = flags.FlagValues()
  holder = overrides.define_config_file('config', '', flag_values=fv, argv=argv)
  fv(argv)
  overrides.finish(holder.value)
  plan = config_lib.validate(holder.value)
  stage = next(s for s in plan.stages if s.name == 'math_rl')
  cfg = base.optimizer_config(stage)
  assert (cfg.name, cfg.schedule, cfg.args) == ('sgd', 'linear', (('momentum', 0.9),))
  assert cfg.decay_steps == stage.decay_steps >= 1
  # The other stages keep the default AdamW, constant after warm-up.
  other = base.optimizer_config(next(s for s in plan.stages if s.name == 'code_rl'))
  assert (other.name, other.b1, other.args) == ('adamw', None, ())
  # The stage's optimizer state is sgd's momentum trace: one params-shaped tree.
  state = ts.make_optimizer(cfg).init(_params())
  assert 'TraceState' in str(jax.tree.structure(state)) and 'ScaleByAdam' not in str(
      jax.tree.structure(state))


def test_the_docstrings_examples_build_their_optimizers():
  import re  # pylint: disable=g-import-not-at-top
  examples = re.findall(r'optimizer=(dict\(.*\))', base.Optimizer.__doc__)
  assert len(examples) == 3
  names = []
  for text in examples:
    opt = base.parse_optimizer(eval(text), 'doc')  # pylint: disable=eval-used
    cfg = ts.OptimizerConfig(lr=opt.lr, schedule=opt.schedule, name=opt.name,
                             warmup_steps=opt.warmup_steps, decay_steps=10, b1=opt.b1,
                             b2=opt.b2, eps=opt.eps, args=opt.args or ())
    ts.make_optimizer(cfg).init(_params())
    names.append(opt.name)
  assert names == ['adamw', 'lion', 'sgd']
