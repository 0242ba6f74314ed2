"""The jitted train step: one function per loss kind, donated state, explicit shardings.

  optimizer = train_step.make_optimizer(train_step.OptimizerConfig(lr=2e-6))
  graphdef, params = nnx.split(model)
  state = train_step.init_state(params, optimizer, seed=0, mesh=mesh)
  loss = train_step.LossSpec(grpo.GrpoConfig, grpo.loss_fn, grpo.normalizers)
  step = train_step.make_train_step(graphdef, loss, grpo.GrpoConfig(), optimizer,
                                    state=state, mesh=mesh, microbatches=4)
  state, metrics = step(state, batch)       # or run_step(step, state, batch) for tokens/s

A loss is handed to the step as a `LossSpec` (its config class, loss function and
normalizers; a stage kind owns its own, `cascade.kinds.<kind>.LOSS`); the loss is a pure
function `loss(model, batch, cfg, norm) -> (loss, metrics)` whose denominators `norm`
are computed once over the whole batch, so the microbatches of a
`lax.scan` gradient accumulation add up to exactly the full-batch loss and
gradient. Loss metrics add up across microbatches, except '_max' and '_min'
keys, which take the maximum and the minimum. A batch that carries a
mixture-of-experts policy's recorded routing (`rl.batch.TrainBatch.routing`)
adds 'routing_mismatch': the fraction of its sampled tokens (the completion
tokens the loss learns) whose recorded experts the trainer's own routers would
not have picked, in that forward, in at least one 'moe' sublayer; and
'routing_mismatch_pairs': the fraction of its (real token, 'moe' sublayer)
pairs, prompt tokens included, where they would not.

A step whose loss or gradient norm is not finite leaves params, optimizer
state and step unchanged and adds one to `skipped` (a metric). Every step
reports 'update_ratio': the norm of the change it made to the parameters over
their norm before it (0 for a skipped step; a healthy step changes them by
well under 1 %: `cascade.divergence` flags one that multiplies them). Compute runs
in the model config's `dtype`; `init_state(master_dtype='float32')` keeps
float32 master weights for a bfloat16 model. Rematerialisation is the model
config's `remat`.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import dataclasses
import math
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from foundation import step_clock
from models import hybrid
from models import sharding
from rl import fields


class TrainState(NamedTuple):
  """Everything a step changes; a pytree (checkpointed by the stage loop).

  Attributes:
    params: nnx.State of the model's parameters (the master copy).
    opt_state: optax state, sharded like the params.
    step: [] int32 updates applied.
    rng: [2] uint32 key the stage loop derives per-step keys from (fold_in).
    skipped: [] int32 steps skipped for a non-finite loss or gradient.
  """
  params: Any
  opt_state: Any
  step: jax.Array
  rng: jax.Array
  skipped: jax.Array


class LossSpec(NamedTuple):
  """A loss as the train step takes it, e.g.
  `LossSpec(grpo.GrpoConfig, grpo.loss_fn, grpo.normalizers)`.

  Attributes:
    config: its frozen config dataclass.
    loss: (model, batch, cfg, norm) -> (loss, metrics), pure.
    normalizers: (batch, cfg) -> the whole batch's denominators (`norm`).
  """
  config: type
  loss: Callable
  normalizers: Callable


def _as_config(cls: type, cfg, what: str):
  """A frozen config dataclass from an instance, a dict, a ConfigDict or None."""
  if cfg is None:
    return cls()
  if isinstance(cfg, cls):
    return cfg
  fields = cfg.to_dict() if hasattr(cfg, 'to_dict') else dict(cfg)
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f'{what}: unknown field(s) {unknown}; known: {sorted(known)}')
  return cls(**fields)


def loss_config(loss: LossSpec, cfg=None):
  """The typed config of a loss from a dict / ConfigDict / instance / None."""
  return _as_config(loss.config, cfg, f'{loss.config.__name__} (loss config)')


# ---------------------------------------------------------------- optimizer

SCHEDULES = ('constant', 'cosine', 'linear')


@dataclasses.dataclass(frozen=True)
class _Optimizer:
  """An optimizer by name: its optax constructor and which `OptimizerConfig` fields it takes.

  Attributes:
    make: the optax function (its first argument the learning rate or schedule).
    takes: the fields of OptimizerConfig passed to `make` under the same names, when set.
    decay: the names `make` gives decoupled weight decay and its mask (None: it has none;
      decay is added to the gradient before `make`, `optax.add_decayed_weights`).
  """
  make: Callable[..., optax.GradientTransformation]
  takes: tuple[str, ...]
  decay: tuple[str, str] | None

  def args(self) -> tuple[str, ...]:
    """The keyword arguments `OptimizerConfig.args` may pass (`make`'s others)."""
    covered = {'learning_rate', *self.takes, *(self.decay or ())}
    return tuple(n for n in inspect.signature(self.make).parameters if n not in covered)


# Optimizers by name. b1 / b2 / eps left unset (None) take optax's default of each.
OPTIMIZERS = {
    'adamw': _Optimizer(optax.adamw, ('b1', 'b2', 'eps'), ('weight_decay', 'mask')),
    'adafactor': _Optimizer(optax.adafactor, ('eps',), ('weight_decay_rate', 'weight_decay_mask')),
    'lion': _Optimizer(optax.lion, ('b1', 'b2'), ('weight_decay', 'mask')),
    'sgd': _Optimizer(optax.sgd, (), None),
}


def _plain_args(v) -> bool:
  """Keyword arguments of an optax function: a dict (or (name, value) pairs) of plain values."""
  if isinstance(v, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2
                                          for p in v):
    v = dict(v)
  return isinstance(v, dict) and all(
      isinstance(k, str) and (x is None or isinstance(x, (bool, int, float, str)))
      for k, x in v.items())


def _sorted_args(v) -> tuple:
  return tuple(sorted(dict(v).items()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """An optax optimizer by name with global-norm clipping, warm-up, then a schedule.

  Each field is declared once, with its default and check (`rl.fields`): a stage's
  `optimizer` section takes them from here (`cascade.kinds.base.Optimizer`), under the same
  names, all but `decay_steps` (which the stage derives from its length).

  Attributes:
    lr: the peak learning rate.
    name: the optimizer, a key of OPTIMIZERS ('adamw', 'adafactor', 'lion', 'sgd').
    schedule: after warm-up, 'constant', 'cosine' (to min_lr_ratio * lr) or 'linear' (the same
      ends) over decay_steps.
    warmup_steps: linear warm-up from lr / warmup_steps to lr over this many steps.
    min_lr_ratio: the floor of cosine and linear as a fraction of lr.
    clip_norm: clip the global gradient norm to this; 0 = no clipping.
    weight_decay: decay on matrices (ndim >= 2) only: decoupled for adamw, lion and adafactor
      (its weight_decay_rate), added to the gradient for sgd.
    b1: first-moment decay (adamw, lion); None: optax's default.
    b2: second-moment decay (adamw, lion); None: optax's default.
    eps: adamw's epsilon, adafactor's; None: optax's default.
    args: other keyword arguments of the optax function (e.g. sgd's momentum, adafactor's
      factored), as a dict or (name, value) pairs; kept as sorted pairs.
    decay_steps: cosine and linear: steps from the end of warm-up to the floor.
  """
  lr: float = fields.field(check=fields.num_in(0, lo_open=True, what='must be > 0'),
                           convert=float)
  name: str = fields.field('adamw', check=None)
  schedule: str = fields.field('constant', check=fields.one_of(SCHEDULES, 'schedule'))
  warmup_steps: int = fields.field(0, check=fields.int_at_least(0))
  min_lr_ratio: float = fields.field(0.0, check=fields.num_in(0, 1), convert=float)
  clip_norm: float = fields.field(1.0, check=fields.num_in(
      0, what='must be >= 0 (0 = no clipping)'), convert=float)
  weight_decay: float = fields.field(0.0, check=fields.num_in(0, what='must be >= 0'),
                                     convert=float)
  b1: float | None = fields.field(None, check=fields.num_in(0, 1, hi_open=True), convert=float)
  b2: float | None = fields.field(None, check=fields.num_in(0, 1, hi_open=True), convert=float)
  eps: float | None = fields.field(None, check=fields.num_in(0, lo_open=True,
                                                             what='must be > 0'), convert=float)
  args: Any = fields.field((), check=(_plain_args, 'must be a dict of name: plain value'),
                           convert=_sorted_args)
  decay_steps: int = fields.field(0, check=fields.int_at_least(0))

  def __post_init__(self):
    fields.check(self)
    object.__setattr__(self, 'args', _sorted_args(self.args))
    problem = self.problem()
    if problem:
      raise ValueError(f'OptimizerConfig.{problem[0]}: {problem[1]}')

  def problem(self) -> tuple[str, str] | None:
    """What is wrong between the fields (each field's own check aside): (the field as given,
    why), or None. A stage's optimizer section runs the same check."""
    if self.schedule != 'constant' and self.decay_steps < 1:
      return 'decay_steps', f'must be >= 1 for the {self.schedule} schedule'
    return optimizer_problem(self.name, {k: getattr(self, k) for k in ('b1', 'b2', 'eps')},
                             dict(self.args))


def optimizer_problem(name: str, moments: dict[str, Any],
                      args: dict[str, Any]) -> tuple[str, str] | None:
  """What is wrong with an optimizer choice: (the field as given, why), or None.

  Args:
    name: the optimizer's name (a key of OPTIMIZERS).
    moments: b1, b2, eps as given (None = unset).
    args: the other keyword arguments for its optax function.

  Returns:
    e.g. ("name='adamx'", 'unknown optimizer (known: ...)'), ('b1=0.9', 'sgd takes no b1 ...'),
    ('args.momentm', 'not an argument of optax.sgd (nearest: momentum)'); None if all is well.
  """
  opt = OPTIMIZERS.get(name)
  if opt is None:
    return f'name={name!r}', f'unknown optimizer (known: {", ".join(sorted(OPTIMIZERS))})'
  for field, value in moments.items():
    if value is not None and field not in opt.takes:
      return f'{field}={value!r}', f'{name} takes no {field} (of b1, b2, eps it takes: ' + (
          ', '.join(opt.takes) or 'none') + ')'
  known = opt.args()
  for key in args:
    if key not in known:
      near = difflib.get_close_matches(str(key), known, n=3, cutoff=0.6)
      what = f'nearest: {", ".join(near)}' if near else f'known: {", ".join(known) or "none"}'
      return f'args.{key}', f'not an argument of optax.{name} ({what})'
  return None


def make_schedule(cfg) -> optax.Schedule:
  """Learning rate as a function of the update count (an `optax.Schedule`).

  rate(c) = lr * min(1, (c + 1) / warmup_steps) during warm-up (the
  first update already gets lr / warmup_steps, the last warm-up update the
  full lr), then constant, or a cosine (or a straight line) from lr
  at c = warmup_steps down to min_lr_ratio * lr at c = warmup_steps
  + decay_steps.

  Why not `optax.linear_schedule` / `cosine_decay_schedule` joined: they are
  the same functions but associate the float32 arithmetic differently, so 127
  of the tiny demo's 600 SFT learning rates differ by one ulp, which changes
  every later result of a deterministic run; this formula keeps runs
  bit-identical to the ones already recorded (tests check it against the
  optax composition to float32 rounding).
  """
  cfg = _as_config(OptimizerConfig, cfg, 'optimizer config')

  def schedule(count):
    count = jnp.asarray(count, jnp.float32)
    lr = jnp.asarray(cfg.lr, jnp.float32)
    if cfg.warmup_steps:
      lr = lr * jnp.minimum(1.0, (count + 1.0) / cfg.warmup_steps)
    if cfg.schedule == 'cosine':
      t = jnp.clip((count - cfg.warmup_steps) / cfg.decay_steps, 0.0, 1.0)
      lr = lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + jnp.cos(math.pi * t)))
    elif cfg.schedule == 'linear':
      t = jnp.clip((count - cfg.warmup_steps) / cfg.decay_steps, 0.0, 1.0)
      lr = lr * (1 - (1 - cfg.min_lr_ratio) * t)
    return lr

  return schedule


def optax_schedule(cfg) -> optax.Schedule:
  """`make_schedule` composed from optax's schedules (equal to float32 rounding)."""
  cfg = _as_config(OptimizerConfig, cfg, 'optimizer config')
  lr = cfg.lr
  if cfg.schedule == 'cosine':
    after = optax.cosine_decay_schedule(lr, cfg.decay_steps, alpha=cfg.min_lr_ratio)
  elif cfg.schedule == 'linear':
    after = optax.linear_schedule(lr, lr * cfg.min_lr_ratio, cfg.decay_steps)
  else:
    after = optax.constant_schedule(lr)
  if cfg.warmup_steps == 0:
    return after
  # Linear from lr / W at c = 0 to lr at c = W - 1 is lr * (c + 1) / W (W = 1: lr from the
  # start); the decay starts at c = W either way.
  warmup = (optax.constant_schedule(lr) if cfg.warmup_steps == 1 else
            optax.linear_schedule(lr / cfg.warmup_steps, lr, cfg.warmup_steps - 1))
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def make_optimizer(cfg) -> optax.GradientTransformation:
  """The optax chain: global-norm clipping, then `optax.<cfg.name>` on `make_schedule(cfg)`."""
  cfg = _as_config(OptimizerConfig, cfg, 'optimizer config')
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  opt = OPTIMIZERS[cfg.name]
  kwargs = {k: getattr(cfg, k) for k in opt.takes if getattr(cfg, k) is not None}
  parts = []
  if opt.decay:
    rate, mask = opt.decay
    # Passed when set, or when optax's default would decay (lion's 1e-3; adamw's 1e-4).
    if cfg.weight_decay or inspect.signature(opt.make).parameters[rate].default is not None:
      kwargs.update({rate: cfg.weight_decay, mask: decay_mask})
  elif cfg.weight_decay:
    parts.append(optax.add_decayed_weights(cfg.weight_decay, decay_mask))
  tx = opt.make(make_schedule(cfg), **kwargs, **dict(cfg.args))
  if cfg.clip_norm > 0:
    parts.insert(0, optax.clip_by_global_norm(cfg.clip_norm))
  return optax.chain(*parts, tx) if parts else tx


# ---------------------------------------------------------------- state

def state_shardings(state: TrainState, optimizer: optax.GradientTransformation,
                    mesh, rules=None) -> TrainState:
  """NamedShardings for a TrainState (concrete or abstract) on `mesh`.

  Params follow their logical axes; every params-shaped part of the optax
  state (Adam moments, ...) is sharded like its parameter; the rest
  (counters, step, rng) is replicated.
  """
  replicated = NamedSharding(mesh, P())
  params = sharding.state_shardings(state.params, mesh, rules)
  opt = optax.tree_map_params(optimizer, lambda _, s: s, state.opt_state, params,
                              transform_non_params=lambda _: replicated)
  return TrainState(params=params, opt_state=opt, step=replicated, rng=replicated,
                    skipped=replicated)


def init_state(params, optimizer: optax.GradientTransformation, *, seed: int = 0,
               master_dtype: Optional[str] = None, mesh=None, rules=None) -> TrainState:
  """A fresh TrainState (optimizer state born sharded like the params on `mesh`).

  Args:
    params: nnx.State of the model (from nnx.split).
    optimizer: the optax transformation.
    seed: seeds `rng`.
    master_dtype: e.g. 'float32' to keep master weights in float32 for a
      model whose params are bfloat16 (compute stays in the config's dtype).
    mesh: shard params and optimizer state over this mesh.
    rules: logical rules for the mesh.

  Returns:
    TrainState with step = skipped = 0. Its params may share buffers with
    `params`, and the train step donates the state: keep using
    `state.params`, or pass `jax.tree.map(jnp.copy, params)` to keep the
    originals alive.
  """
  if master_dtype is not None:
    dt = jnp.dtype(master_dtype)
    params = jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                          params)
  scalars = dict(step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(seed),
                 skipped=jnp.zeros((), jnp.int32))
  if mesh is None:
    return TrainState(params=params, opt_state=optimizer.init(params), **scalars)
  abstract = jax.eval_shape(lambda p: TrainState(p, optimizer.init(p), **scalars), params)
  shard = state_shardings(abstract, optimizer, mesh, rules)
  params = jax.device_put(params, shard.params)
  opt_state = jax.jit(optimizer.init, out_shardings=shard.opt_state)(params)
  scalars = {k: jax.device_put(v, getattr(shard, k)) for k, v in scalars.items()}
  return TrainState(params=params, opt_state=opt_state, **scalars)


# ---------------------------------------------------------------- the step

def _reduce(name: str, acc, x):
  if name.endswith('_max'):
    return jnp.maximum(acc, x)
  return jnp.minimum(acc, x) if name.endswith('_min') else acc + x


def _reduce_start(name: str) -> float:
  """What `_reduce` starts a metric's accumulation from."""
  return -jnp.inf if name.endswith('_max') else jnp.inf if name.endswith('_min') else 0.0


def _split_microbatches(batch, m: int):
  """[B, ...] -> [m, B / m, ...], microbatch j = rows j, m + j, 2m + j, ...

  Strided rows keep every microbatch spread evenly over the batch shards.
  """
  def split(x):
    if x.shape[0] % m:
      raise ValueError(f'batch of {x.shape[0]} rows does not split into {m} microbatches')
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


# Counts `_with_router_losses` logs when the batch carried recorded routing; they add up over
# microbatches and the step turns them into the 'routing_mismatch' (sampled tokens) and
# 'routing_mismatch_pairs' ((real token, 'moe' sublayer) pairs) fractions.
_MISMATCH_COUNTS = ('routing_mismatched', 'routing_compared',
                    'routing_mismatched_tokens', 'routing_sampled_tokens')


def sampled_tokens(loss_mask: jax.Array) -> jax.Array:
  """[B, L] bool: the input columns holding a token the loss learns (a sampled completion
  token): `loss_mask` is target-aligned (column t learns tokens[:, t + 1]), routing is
  input-aligned (rl/batch.py), so the mask moves one column right."""
  return jnp.pad(loss_mask[:, :-1] > 0, ((0, 0), (1, 0)))


def _with_router_losses(model, loss, metrics, microbatches: int, loss_mask=None):
  """The loss plus the mixture-of-experts routers' auxiliary losses of the forward passes the
  loss made (weights `router_aux_loss` / `router_z_loss` of the model config; both 0 by
  default, as RL wants), their values logged ('router_aux_loss', 'router_z_loss'), each a
  microbatch's share so the metrics add up to the batch's mean. A forward that was given the
  sampler's recorded routing (replayed or only compared) also logs how many (real token,
  'moe' sublayer) pairs it compared and how many its routers' own choice differed on, and of
  the batch's sampled tokens (`sampled_tokens` of its `loss_mask`) how many there are and on
  how many its routers differed in any 'moe' sublayer (the step makes 'routing_mismatch_pairs'
  and 'routing_mismatch' of them). A model without experts returns the loss and metrics as
  they are."""
  stats = hybrid.moe_stats(model)
  if stats is None:
    return loss, metrics
  mcfg = getattr(model, 'cfg', None) or getattr(getattr(model, 'backbone', None), 'cfg')
  aux, z = stats.aux_loss / microbatches, stats.z_loss / microbatches
  loss = loss + mcfg.router_aux_loss * aux + mcfg.router_z_loss * z
  metrics = dict(metrics, router_aux_loss=aux, router_z_loss=z)
  if stats.mismatched is not None:
    if loss_mask is None or loss_mask.shape != stats.token_differs.shape:
      raise ValueError(f'train step: the batch\'s loss_mask '
                       f'{None if loss_mask is None else loss_mask.shape} does not cover the '
                       f'tokens whose routing was compared {stats.token_differs.shape}')
    sampled = sampled_tokens(loss_mask)
    metrics.update(zip(_MISMATCH_COUNTS, (
        stats.mismatched, stats.compared,
        jnp.sum((stats.token_differs & sampled).astype(jnp.float32)),
        jnp.sum(sampled.astype(jnp.float32)))))
  return loss, metrics


def _mismatch_fraction(metrics: dict) -> dict:
  """In place of the counts: 'routing_mismatch', the fraction of the batch's sampled tokens
  whose recorded expert set the trainer's routers would not have picked in at least one 'moe'
  sublayer, and 'routing_mismatch_pairs', the fraction of its compared (real token, 'moe'
  sublayer) pairs where they would not (metrics without them are returned as they are)."""
  if _MISMATCH_COUNTS[0] not in metrics:
    return metrics
  metrics = dict(metrics)
  pairs, compared, tokens, sampled = (metrics.pop(k) for k in _MISMATCH_COUNTS)
  metrics['routing_mismatch'] = tokens / jnp.maximum(sampled, 1.0)
  metrics['routing_mismatch_pairs'] = pairs / jnp.maximum(compared, 1.0)
  return metrics


def make_train_step(graphdef, loss: LossSpec, loss_cfg, optimizer: optax.GradientTransformation,
                    *, mesh=None, rules=None, state: Optional[TrainState] = None,
                    microbatches: int = 1, microbatch_rows: int | None = None,
                    lr_schedule: Optional[optax.Schedule] = None, donate: bool = True):
  """Builds the jitted `train_step(state, batch) -> (state, metrics)`.

  Args:
    graphdef: nnx GraphDef of the model (Transformer, or RewardModel for
      the reward-model loss).
    loss: the loss (config class, loss function, normalizers).
    loss_cfg: its config (instance, dict, ConfigDict or None).
    optimizer: the optax transformation the state was initialised with.
    mesh: run sharded on this mesh: params/optimizer state by logical axes,
      every batch leaf split over 'batch' on its first dimension and, where the mesh has a
      sequence axis, over 'sequence' on its second (its tokens; `_ShardedStep`).
    rules: logical rules (None: DEFAULT_RULES): the model's `rules` in the traced loss and
      the layout of the state and batch.
    state: a TrainState (or its eval_shape) giving the state's structure;
      required with a mesh.
    microbatches: accumulate gradients over this many microbatches (rows
      must divide; with a mesh, rows / microbatches should divide the batch
      shards for an even spread).
    microbatch_rows: instead of a fixed count, microbatches of this many rows: a batch of
      R rows (R a multiple of it) accumulates over R / microbatch_rows microbatches, the
      count taken from the batch's shape when the step is traced (a new row count is a new
      trace). For batches whose row count varies while each row's memory is fixed (packed
      RL updates, `rl.batch.pack`): the memory of one microbatch stays the same however
      many rows a step packs. Overrides `microbatches`.
    lr_schedule: reported as the 'lr' metric when given.
    donate: donate the input state's buffers.

  Returns:
    A jax.jit-ed function, or with a mesh one jit per batch shape (`_ShardedStep`); either
    has `.lower` for ahead-of-time compilation.
  """
  if not isinstance(loss, LossSpec):
    raise TypeError(f'make_train_step: the loss is a LossSpec (config class, loss function, '
                    f'normalizers), got {loss!r}')
  spec = loss
  cfg = loss_config(spec, loss_cfg)
  if microbatches < 1:
    raise ValueError(f'make_train_step: microbatches={microbatches} must be >= 1')
  if microbatch_rows is not None and microbatch_rows < 1:
    raise ValueError(f'make_train_step: microbatch_rows={microbatch_rows} must be >= 1')
  rules = sharding.as_rules(rules)

  def count(batch) -> int:
    """The batch's microbatch count (static: from its shape at trace time)."""
    if microbatch_rows is None:
      return microbatches
    rows = jax.tree.leaves(batch)[0].shape[0]
    if rows % microbatch_rows:
      raise ValueError(f'train step: a batch of {rows} rows is not a whole number of '
                       f'microbatches of microbatch_rows={microbatch_rows}')
    return rows // microbatch_rows

  def compute(params, batch, norm, microbatches):
    model = nnx.merge(graphdef, params)
    model.collect_moe_stats = True     # its 'moe' sublayers' reports, for the router losses
    model.rules = rules
    loss, metrics = spec.loss(model, batch, cfg, norm)
    return _with_router_losses(model, loss, metrics, microbatches,
                               getattr(batch, 'loss_mask', None))

  grad_fn = jax.value_and_grad(compute, has_aux=True)

  def accumulate(params, batch, norm):
    microbatches = count(batch)
    if microbatches == 1:
      return grad_fn(params, batch, norm, 1)
    mbs = _split_microbatches(batch, microbatches)
    first = jax.tree.map(lambda x: x[0], mbs)
    (_, m_shape), _ = jax.eval_shape(lambda p, b, n: grad_fn(p, b, n, microbatches),
                                     params, first, norm)
    zeros_m = {k: jnp.full(v.shape, _reduce_start(k), v.dtype) for k, v in m_shape.items()}
    zeros_g = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def body(carry, mb):
      g_acc, l_acc, m_acc = carry
      mb = jax.tree.map(lambda x: sharding.constrain(x, sharding.batch_leaf_names(x.ndim),
                                                     rules), mb)
      (l, m), g = grad_fn(params, mb, norm, microbatches)
      g_acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), g_acc, g)
      m_acc = {k: _reduce(k, m_acc[k], m[k]) for k in m_acc}
      return (g_acc, l_acc + l, m_acc), None

    (g, loss, metrics), _ = jax.lax.scan(body, (zeros_g, jnp.zeros((), jnp.float32), zeros_m), mbs)
    g = jax.tree.map(lambda x, p: x.astype(p.dtype), g, params)
    return (loss, metrics), g

  def step(state: TrainState, batch):
    with contextlib.ExitStack() as stack:
      if mesh is not None:
        # Trace under the mesh (set_mesh is not allowed inside jit); the rules are the model's.
        stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
      norm = spec.normalizers(batch, cfg)
      (loss, metrics), grads = accumulate(state.params, batch, norm)
      grad_norm = optax.global_norm(grads)
      # Not optax.apply_if_finite: it checks only the gradient (not the loss),
      # applies the non-finite update after max_consecutive_errors, and wraps
      # the optimizer state in a new structure (old checkpoints would not
      # restore); `step` and `skipped` would still need this flag.
      ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
      new_state = TrainState(params=keep(params, state.params),
                             opt_state=keep(opt_state, state.opt_state),
                             step=state.step + ok.astype(jnp.int32), rng=state.rng,
                             skipped=state.skipped + (~ok).astype(jnp.int32))
      f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
      change = optax.global_norm(jax.tree.map(jnp.subtract, f32(new_state.params),
                                              f32(state.params)))
      size = optax.global_norm(f32(state.params))
      metrics = dict(_mismatch_fraction(metrics), loss=loss, grad_norm=grad_norm,
                     skipped=new_state.skipped,
                     update_ratio=change / jnp.maximum(size, jnp.finfo(jnp.float32).tiny))
      if lr_schedule is not None:
        metrics['lr'] = lr_schedule(state.step)
    return new_state, metrics

  donate_argnums = (0,) if donate else ()
  if mesh is None:
    return jax.jit(step, donate_argnums=donate_argnums)
  if state is None:
    raise ValueError('make_train_step: with a mesh, pass state= (a TrainState or its '
                     'eval_shape) so its shardings can be fixed')
  state_sh = state_shardings(state, optimizer, mesh, rules)
  return _ShardedStep(step, state_sh, mesh, rules, donate_argnums)


class _ShardedStep:
  """The train step on a mesh: one `jax.jit` per batch structure and shapes, each with the
  batch's leaves laid out by `models.sharding.batch_leaf_sharding` (rows over 'batch' and, on a
  mesh with a sequence axis, tokens over 'sequence': on a node whose only split is that axis no
  device holds the whole update batch, its recorded routing included). Called like the jitted
  function; `lower` for ahead-of-time compilation."""

  def __init__(self, step, state_sh, mesh, rules, donate_argnums):
    self._step, self._state_sh, self._mesh, self._rules = step, state_sh, mesh, rules
    self._donate = donate_argnums
    self._jits: dict = {}

  def batch_shardings(self, batch):
    """The batch's leaves' NamedShardings (a tree like `batch`)."""
    return jax.tree.map(lambda x: sharding.batch_leaf_sharding(np.shape(x), self._mesh,
                                                               self._rules), batch)

  def _jit(self, batch):
    """(the jitted step for `batch`'s structure and shapes, its leaves' shardings), made once
    per structure and shapes, so a step's call does not lay its batch out again."""
    leaves, tree = jax.tree.flatten(batch)
    key = (tree, tuple(tuple(np.shape(x)) for x in leaves))
    hit = self._jits.get(key)
    if hit is None:
      batch_sh = self.batch_shardings(batch)
      hit = self._jits[key] = (jax.jit(
          self._step, in_shardings=(self._state_sh, batch_sh),
          out_shardings=(self._state_sh, NamedSharding(self._mesh, P())),
          donate_argnums=self._donate), batch_sh)
    return hit

  def __call__(self, state, batch):
    # A batch already on the devices in another layout (e.g. rows only) moves to this one.
    fn, batch_sh = self._jit(batch)
    batch = jax.tree.map(
        lambda x, sh: jax.device_put(x, sh) if isinstance(x, jax.Array) and x.committed
        and not x.sharding.is_equivalent_to(sh, x.ndim) else x, batch, batch_sh)
    return fn(state, batch)

  def lower(self, state, batch):
    """The step lowered for `batch` (arrays or ShapeDtypeStructs): its leaves take the step's
    layout whatever sharding they carry."""
    fn, batch_sh = self._jit(batch)
    batch = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        if isinstance(x, jax.ShapeDtypeStruct) else x, batch, batch_sh)
    return fn.lower(state, batch)


def _batch_tokens(batch) -> int:
  """Real (non-padding) tokens a batch feeds the model: every *segment_ids field counted."""
  return int(sum(np.count_nonzero(np.asarray(getattr(batch, f)))
                 for f in batch._fields if f.endswith('segment_ids')))


def run_step(train_step, state: TrainState, batch, clock=step_clock.NULL
             ) -> tuple[TrainState, dict]:
  """Calls a train step, waits for it, and returns host metrics with timing.

  Adds 'step_s' (wall time) and 'tokens_per_s' (real tokens through the
  model per second) to the step's metrics. `clock` (a `foundation.step_clock.StepClock`)
  times the program (its dispatch and the wait for its metrics) as 'update'.

  Returns:
    (new state, {name: float}).
  """
  with clock.part('update batch'):
    tokens = _batch_tokens(batch)
  start = time.perf_counter()
  with clock.program('update'):
    state, metrics = train_step(state, batch)
    metrics = jax.device_get(metrics)
  metrics = {k: float(v) for k, v in metrics.items()}
  dt = time.perf_counter() - start
  metrics['step_s'] = dt
  metrics['tokens_per_s'] = tokens / dt
  return state, metrics
