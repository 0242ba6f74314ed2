"""What every stage kind shares: typed stage configs that check themselves, and the Kind record.

A stage kind is one module under `cascade/kinds/` that defines

* `Config`: a frozen, keyword-only dataclass (a subclass of `StageConfig`)
  whose fields are exactly what a stage dict of that kind may hold; each
  field's metadata carries its check and message, so `from_mapping` builds it
  from a raw dict with one-line errors that name the stage and the field
  (`stages[2] 'math_rl': group_size=1: grpo needs G >= 2`), rejecting unknown
  fields and naming missing ones. Class-level facts (`MODEL`, `RECORDS`,
  `LEAVES`, ...) say what the kind trains and reads, so nothing outside the
  kind's module branches on its name;
* `KIND = Kind(...)`: its runner `run(ctx, stage) -> StageResult`, its loss
  `(stage) -> (rl.train_step.LossSpec, the loss's config for the stage)`, and its
  abstract train batch for a mesh (what `launch.plan` compiles).

`cascade.kinds.KINDS` is the one registry of kinds.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, ClassVar, Mapping, NamedTuple

import numpy as np

from cascade import schema
from rl import buckets
from rl import train_step as train_lib
# The field vocabulary, re-exported for the kind modules.
from cascade.schema import BOOL, HIDE, ConfigError, field, from_mapping  # pylint: disable=unused-import
from cascade.schema import int_at_least, is_int, is_num, num_in, one_of, plain  # pylint: disable=unused-import
_NAME_RE = re.compile(r'^[A-Za-z0-9_.-]+$')
# The matrix row of the starting policy (evaluated first when the cascade starts with RL).
INIT_ROW = 'init'


# ---------------------------------------------------------------- optimizer and phases

@dataclasses.dataclass(frozen=True, kw_only=True)
class Optimizer(schema.settings(train_lib.OptimizerConfig, leave_out=('decay_steps',))):
  """An optax optimizer by name (`rl.train_step.OPTIMIZERS`: adamw, adafactor, lion, sgd) with
  linear warm-up, then a constant, cosine or linear schedule (down to min_lr_ratio * lr at the
  stage's end), and global-norm clipping (clip_norm 0 = none); weight decay on matrices only.
  Its fields are `rl.train_step.OptimizerConfig`'s, with their defaults and checks (lr has
  none: a stage names it); the stage's length gives `decay_steps`.

    optimizer=dict(lr=3e-6)                                # AdamW, as before
    optimizer=dict(name='lion', lr=3e-7, b2=0.98, schedule='linear', warmup_steps=10)
    optimizer=dict(name='sgd', lr=1e-2, args=dict(momentum=0.9, nesterov=True))
  """

  def check(self, fail):
    problem = train_lib.optimizer_problem(
        self.name, {'b1': self.b1, 'b2': self.b2, 'eps': self.eps}, dict(self.args))
    if problem:
      fail(*problem, value=HIDE)


def parse_optimizer(raw, where: str) -> Optimizer:
  if not isinstance(schema.plain(raw), Mapping):
    raise ConfigError(f'{where}: optimizer: must be a dict with at least lr')
  return from_mapping(Optimizer, raw, where, prefix='optimizer.')


@dataclasses.dataclass(frozen=True)
class Phase:
  """A curriculum phase of an RL stage: applies to steps [previous until_step, until_step)."""
  until_step: int
  max_response_len: int
  temperature: float
  filter_overlong: bool


# ---------------------------------------------------------------- stage configs

def _name_ok(v) -> bool:
  return isinstance(v, str) and bool(_NAME_RE.match(v))


def _names(v) -> bool:
  return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(x, str) for x in v)


def looks_like_path(ref: str) -> bool:
  """An `init_from` / teacher reference that is a path rather than a stage name."""
  return '/' in ref or ref.startswith('.') or ref.startswith('~') or '://' in ref


class Refs(NamedTuple):
  """What a stage's references are checked against while the stage list is resolved."""
  earlier: tuple           # the resolved StageConfigs before this one
  all_names: tuple         # every stage name in the list
  domains: Mapping         # name -> config.Domain
  datasets: Mapping        # name -> config.Dataset

  def stage(self, name: str):
    return next((s for s in self.earlier if s.name == name), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageConfig:
  """Fields every stage has. Subclasses add theirs; class attributes describe the kind.

  Class attributes:
    MODEL: the model the stage trains ('policy', 'reward_model') or None.
    RECORDS: the record type its datasets hold ('sft', 'preference', 'prompt') or None.
    LEAVES: the policy the stage leaves behind: 'own' (it trains one), 'start'
      (its starting policy: eval), 'previous' (the one before it: a reward model).
    ROW: the stage's policy gets a row of the evaluation matrix (when `evaluate`).
    SAMPLES: the stage samples from the policy (an RL stage: the cascade's
      starting policy is evaluated first when one of these comes first).
    BY_DOMAIN: keep only records of the stage's domains (prompt datasets mix domains).
  """
  MODEL: ClassVar[str | None] = None
  RECORDS: ClassVar[str | None] = None
  LEAVES: ClassVar[str] = 'start'
  ROW: ClassVar[bool] = True
  SAMPLES: ClassVar[bool] = False
  BY_DOMAIN: ClassVar[bool] = False

  # Set by the validator: the stage's position in config.stages, its kind and its name.
  index: int = field(user=False)
  kind: str = field(user=False)
  name: str = field(user=False)
  # Set by the validator: what the stage's randomness is seeded from (`stage_seed`): (i,) for
  # the config's own i-th stage, (i, INSERTED) for a stage the guard inserted after it, so an
  # inserted stage (run or skipped) moves no other stage's data order or sampling keys.
  seed_key: tuple = field((), user=False)
  # The policy the stage starts from: an earlier stage's name, or a checkpoint / HF directory
  # path ('' = the policy the previous stage left).
  init_from: str = field('', check=((lambda v: isinstance(v, str)),
                                    'must be a string (an earlier stage name or a path)'))
  # Evaluate every domain after the stage (a row of the matrix).
  evaluate: bool = field(True, check=BOOL)
  # The domains and datasets the stage trains on (set by the kinds that train).
  domains: tuple = field((), user=False)
  datasets: tuple = field((), user=False)

  @property
  def trains_policy(self) -> bool:
    return self.LEAVES == 'own'

  @property
  def seeds_from(self) -> tuple:
    """`seed_key`, or (index,) for a stage built without the validator."""
    return tuple(self.seed_key) or (self.index,)

  @property
  def where(self) -> str:
    return f'stages[{self.index}] {self.name!r}'

  def resolve(self, refs: Refs, fail) -> 'StageConfig':
    """Checks references to other stages, domains and datasets; may fill defaults."""
    init = self.init_from
    if init and not looks_like_path(init):
      if init == self.name:
        fail('init_from', 'a stage cannot start from itself')
      src = refs.stage(init)
      if src is None:
        what = 'a later stage' if init in refs.all_names else 'an unknown stage'
        fail('init_from', f'names {what}; it must name an earlier stage (or be a path '
                          'with a / to a checkpoint or HF directory)')
      if src.MODEL == 'reward_model':
        fail('init_from', f'is a {src.kind} stage; stages (reward models too) start from a '
                          'policy')
    return self

  def check_lengths(self, max_seq: int | None, fail) -> None:
    """Checks the stage's sequence lengths against the model's."""

  def with_model(self, model, sampler, fail) -> 'StageConfig':
    """Checks the stage against the run's policy (`models.config.ModelConfig`) and sampler
    settings (`cascade.config.Sampler`); returns it, with what follows from them filled in."""
    del model, sampler, fail
    return self

  def rows_per_step(self) -> tuple[int, str] | None:
    """(rows, what) of a fixed-size train batch that must split over the mesh, or None."""
    return None

  def record_filter(self, tokenizer) -> tuple[Callable[[Any], bool], str] | None:
    """(keep(item), why others are dropped) for the stage's items (its records, or what
    `tokenize` makes of them), or None."""
    del tokenizer
    return None

  def tokenize(self, tokenizer) -> Callable[[dict], tuple] | None:
    """record -> the tuple of token arrays the stage's batches take instead of the record
    (made once per record and cached: `cascade.data.token_cache`), or None: they take records."""
    del tokenizer
    return None

  def tokenize_batch(self, tokenizer) -> Callable[[list], list] | None:
    """records -> `tokenize`'s item of each, the same arrays, made in one call (the token
    cache's preparation: the tokenizer library's batch encode on all cores), or None."""
    del tokenizer
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainStageConfig(StageConfig):
  """A stage that trains a model: its data, steps and optimizer."""
  LEAVES: ClassVar[str] = 'own'
  MODEL: ClassVar[str | None] = 'policy'

  # The domains the stage trains on (config.domains names).
  domains: tuple = field(check=(_names, 'must be a non-empty list of domain names'),
                         convert=tuple)
  # The datasets it reads (config.datasets names; None: the kind's default, e.g. an RL stage's
  # domains' train sets).
  datasets: tuple | None = field(None, check=(_names, 'must be a non-empty list of dataset names'),
                                 convert=tuple)
  # Optimizer updates in the stage.
  steps: int = field(check=int_at_least(1))
  # The stage's optimizer (config.stages[i].optimizer, an `Optimizer`).
  optimizer: Optimizer = field()
  # Each update's batch runs in this many sequential microbatches (gradients accumulated).
  microbatches: int = field(1, check=int_at_least(1))
  # Start from a fresh optimizer state (False: carry on the one of the stage it starts from).
  reset_optimizer: bool = field(True, check=BOOL)
  # In-stage validation of this stage every N steps (None: config.eval.eval_every; 0: none),
  # e.g. a score curve through the RL stages without scoring a long SFT every N steps.
  eval_every: int | None = field(None, check=int_at_least(0))

  def resolve(self, refs: Refs, fail) -> 'TrainStageConfig':
    super().resolve(refs, fail)
    for d in self.domains:
      if d not in refs.domains:
        fail('domains', f'unknown domain {d!r} (known: {", ".join(sorted(refs.domains))})')
    dsets = self.datasets
    if dsets is None:
      dsets = self.default_datasets(refs, fail)
    for ds in dsets:
      if ds not in refs.datasets:
        fail('datasets', f'unknown dataset {ds!r} (known: {", ".join(sorted(refs.datasets))})',
             list(dsets))
      if refs.datasets[ds].record_type != self.RECORDS:
        fail('datasets', f'dataset {ds!r} holds {refs.datasets[ds].record_type} records; a '
                         f'{self.kind} stage reads {self.RECORDS} records', list(dsets))
    if self.BY_DOMAIN:
      # A domain none of the stage's datasets can hold gets no prompts (e.g. a MOPD teacher's
      # domain missing from the released MOPD subset): refused, naming domain and datasets.
      for d in self.domains:
        lacking = [refs.datasets[ds] for ds in dsets]
        if all(ds.lacks(d) for ds in lacking):
          fail('domains', f'domain {d!r} gets no rows: '
                          + '; '.join(ds.lacks_message(d) for ds in lacking))
    return dataclasses.replace(self, datasets=tuple(dsets))

  def default_datasets(self, refs: Refs, fail) -> tuple:
    del refs
    fail('datasets', f'missing field (a {self.kind} stage names its datasets)')

  @property
  def decay_steps(self) -> int:
    """Optimizer updates the learning-rate schedule spans."""
    return self.steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairStageConfig(TrainStageConfig):
  """A stage that trains on `batch_size` preference pairs of at most `max_len` tokens each."""
  RECORDS: ClassVar[str] = 'preference'

  # Preference pairs per update, and the longest pair member in tokens.
  batch_size: int = field(check=int_at_least(1))
  max_len: int = field(check=int_at_least(2))

  def check(self, fail):
    if self.batch_size % self.microbatches:
      fail('microbatches', f'must divide batch_size={self.batch_size}')

  def check_lengths(self, max_seq, fail):
    if max_seq is not None and self.max_len > max_seq:
      fail('max_len', f"exceeds the model's max_seq_len={max_seq}")

  def rows_per_step(self):
    return self.batch_size, 'batch_size'


def optimizer_config(stage: TrainStageConfig, lr_scale: float = 1.0):
  """The stage's optimizer in rl.train_step's terms, field by field (cosine decays over the
  stage's updates), its learning rate times `lr_scale` (after rollbacks, `cascade.divergence`)."""
  o = stage.optimizer
  values = {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
  return train_lib.OptimizerConfig(**{
      **values, 'lr': o.lr * lr_scale,
      'decay_steps': max(1, stage.decay_steps - o.warmup_steps)})


class StageOptimizer(NamedTuple):
  """A stage's optimizer, built once (`make_optimizer`): its optax transformation (what the
  train state's optimizer state is made by and the train step applies) and its learning-rate
  schedule (the step's 'lr' metric)."""
  tx: Any
  schedule: Callable[[Any], Any]


def make_optimizer(stage: TrainStageConfig, lr_scale: float = 1.0) -> StageOptimizer:
  """The stage's optimizer (`optimizer_config`): a stage builds it once, and once more only
  when a rollback changes its learning rate."""
  cfg = optimizer_config(stage, lr_scale)
  return StageOptimizer(train_lib.make_optimizer(cfg), train_lib.make_schedule(cfg))


# The second entry of an inserted stage's `seed_key` (larger than any step count, so its
# streams are not a stage's own).
INSERTED = 0xFFFFFFFF


def stage_seed(seed: int, key: int | tuple) -> int:
  """A 31-bit seed for a stage's data order and its TrainState's PRNG key.

  Args:
    seed: the run's seed.
    key: the stage's `seed_key` ((i,) for the config's own i-th stage; (i, INSERTED) for the
      stage the guard inserted after it), or a bare i for (i,).
  """
  i, *rest = (key,) if isinstance(key, int) else tuple(key)
  return int(np.random.SeedSequence([seed, i + 1, *rest]).generate_state(1)[0] >> 1)


# ---------------------------------------------------------------- the kind record

class StageError(RuntimeError):
  """A stage cannot go on (e.g. its verifiers' sandbox fails); one line naming the stage."""


class StageResult(NamedTuple):
  """What a runner hands back to the loop.

  Attributes:
    params: the policy the stage leaves (None: the loop looks it up by source).
    final_step: the stage's last step (None for stages that do not train).
    steps_run: steps this process ran (fewer than the stage's after a resume).
    seconds: wall time of those steps.
    first: metrics of the first step run; last: of the last.
    info: extra facts for progress.json (e.g. MOPD's teachers).
  """
  params: Any = None
  final_step: int | None = None
  steps_run: int = 0
  seconds: float = 0.0
  first: Mapping = {}
  last: Mapping = {}
  info: Mapping = {}


class Kind(NamedTuple):
  """A stage kind: its config class, runner, loss and abstract train batch.

  Attributes:
    name: the `kind` string of a stage dict.
    config: the StageConfig subclass.
    run: (ctx, stage) -> StageResult.
    loss: (stage) -> (the kind's `rl.train_step.LossSpec`, its config for the stage);
      None for kinds that do not train.
    abstract_batch: (stage, mesh, rules) -> (train batch of ShapeDtypeStructs
      for the stage's largest step, description); None for kinds that do not train.
    sampler_sizes: (stage) -> dict(rows, prompt_len, max_new_tokens, top_p,
      top_k, num_samples) of the stage's largest sampler call; None if it does
      not sample.
    frozen_forwards: (stage) -> list of FrozenForward: the scoring passes of
      frozen policies (KL reference, DPO reference, MOPD teachers) a step runs.
    sampler_calls: (stage) -> the sampler calls one sampling round of a step runs, one after
      another, each a dict like `sampler_sizes`' (plus `continued`: a paged KV session holds
      the call's prompt, so nothing is prefilled), for `launch.plan`'s step-time model; None =
      one call of `sampler_sizes`.
  """
  name: str
  config: type
  run: Callable
  loss: Callable | None = None
  abstract_batch: Callable | None = None
  sampler_sizes: Callable | None = None
  frozen_forwards: Callable | None = None
  sampler_calls: Callable | None = None


class FrozenForward(NamedTuple):
  """A frozen policy's log-prob pass a step runs (what launch.plan compiles and keeps resident).

  Attributes:
    name: e.g. 'reference forward'.
    rows, length: the batch of one jitted call.
    copies: how many such frozen parameter sets stay resident beside the state.
    calls: calls per step (rows go through in chunks of `rows`).
    on_host: the copies stay in host memory; one is on the devices only during its pass.
  """
  name: str
  rows: int
  length: int
  copies: int = 1
  calls: int = 1
  on_host: bool = False


def frozen_rows_per_call(rows: int, microbatches: int) -> int:
  """Rows per call of a frozen pass over a step's `rows`: the train step's microbatch, so the
  pass never holds more activations at once than an update does."""
  return max(1, rows // microbatches)


def rows_bucket(n: int, multiple: int) -> int:
  """Rows padded to a power of two and a multiple of `multiple` (few compiled shapes)."""
  return buckets.pow2(n, multiple=multiple)
