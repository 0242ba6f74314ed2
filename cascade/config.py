"""The cascade's config: one typed section per concern, and `validate`, done once at the door.

A config is an `ml_collections.ConfigDict` (see docs/config.md):

  config.seed, config.model, config.tokenizer, config.mesh, config.sampler,
  config.ckpt, config.eval, config.datasets, config.domains,
  config.stages (a list of plain stage dicts), config.allow_config_change,
  optionally config.divergence (when a stage has diverged; defaults below),
  config.hardware (what `launch.plan` compiles for), config.prepare (a
  step that makes the data the config names, run before it is read),
  config.compilation_cache (where JAX keeps compiled programs across runs) and
  config.logging (where metrics go besides TensorBoard) and config.guard (regression
  guards: probes of earlier domains while a stage trains, `cascade.guard`; absent: none).

Every section is a frozen dataclass here (`Model`, `Tokenizer`, `Mesh`,
`Sampler`, `Hardware`, `CompilationCache`, `Logging`, `Prepare`, `Eval`, `Ckpt`,
`Divergence`, `Guard`, `Dataset`, `Domain`; the stages are their kinds' typed configs,
`cascade.kinds`) that checks its own fields (`cascade.schema`). `validate(config)` builds each
section, checks what refers across sections (a domain's datasets, a stage's
domains, a reward model's stage) and returns a `Plan`: the sections, the
resolved model and sharding rules, and the config's plain-dict form (what
config.json records and the config hash covers). Nothing after `validate`
reads the ConfigDict. Every problem is a `ConfigError` naming the section or
the stage (index and name) and the field, e.g.
`stages[2] 'math_rl': group_size=1: grpo needs G >= 2`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Any, ClassVar, Mapping

from cascade import schema
from cascade.data import released
from cascade.schema import ConfigError
from foundation import chat_template as chat_template_lib
from foundation import paths
from rl import engine_options

SECTIONS = ('seed', 'model', 'tokenizer', 'mesh', 'sampler', 'ckpt', 'eval', 'datasets',
            'domains', 'stages', 'allow_config_change', 'hardware', 'prepare', 'divergence',
            'compilation_cache', 'data_cache', 'logging', 'guard')
_REQUIRED_SECTIONS = ('model', 'tokenizer', 'mesh', 'sampler', 'ckpt', 'eval', 'domains',
                      'datasets', 'stages')


def _section(cls, raw, name: str):
  """`cls` from `config.<name>` (absent: its defaults); an unknown field is named with the
  nearest known ones."""
  return schema.from_mapping(cls, raw or {}, f'config.{name}', sep='.')


def _mapping_ok(v) -> bool:
  return isinstance(schema.plain(v), Mapping)


_MAPPING = (_mapping_ok, 'must be a mapping')
_STRING = ((lambda v: isinstance(v, str)), 'must be a string')
# The repository root (the folder holding cascade/): config.hardware.gpu_target resolves here.
_REPOSITORY = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------ model, tokenizer, mesh, sampler, hardware

@dataclasses.dataclass(frozen=True, kw_only=True)
class Model:
  """config.model: the policy's architecture, from a preset or an HF checkpoint (one of them)."""
  # A `models.config.ModelConfig` preset, e.g. 'tiny' or 'qwen3_14b' ('' = none: hf_path).
  preset: str = schema.field('')
  # ModelConfig fields that replace the preset's, e.g. {'max_seq_len': 256}.
  overrides: Mapping[str, Any] | None = schema.field(None, check=_MAPPING, convert=dict)
  # An HF checkpoint directory: its config.json is the architecture and its weights the
  # starting policy ('' = none: preset, randomly initialised).
  hf_path: str = schema.field('')

  def check(self, fail):
    del fail
    if not self.preset and not self.hf_path:
      raise ConfigError("config.model: needs 'preset' (e.g. 'tiny') or 'hf_path'")
    if self.preset and self.hf_path:
      raise ConfigError("config.model: give 'preset' or 'hf_path', not both")
    if self.hf_path and self.overrides:
      raise ConfigError(f'config.model.overrides: {sorted(self.overrides)} would not reach the '
                        "model: with 'hf_path' its config.json is the architecture (edit it there, "
                        'e.g. max_position_embeddings for a longer YaRN context)')

  def resolve(self):
    """The `models.config.ModelConfig` this section names (an HF checkpoint's config.json is
    read here)."""
    from models import config as model_config  # pylint: disable=g-import-not-at-top
    from models import hf  # pylint: disable=g-import-not-at-top
    if self.hf_path:
      path = paths.join(self.hf_path, 'config.json')
      try:
        return hf.config_from_hf(json.loads(paths.read_text(path)))
      except (OSError, ValueError, KeyError) as e:   # paths.PathError is a ValueError
        raise ConfigError(f'config.model.hf_path: {path}: {type(e).__name__}: {e}') from None
    try:
      return model_config.ModelConfig.preset(self.preset, **dict(self.overrides or {}))
    except (ValueError, TypeError) as e:
      raise ConfigError(f'config.model: {e}') from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tokenizer:
  """config.tokenizer: the run's tokenizer."""
  # A SentencePiece model file or an HF tokenizer directory (local or gs://).
  path: str = schema.field('')
  # Which chat template renders the policy's prompts: 'builtin' (foundation.chat: Qwen3 ChatML,
  # ' /think' / ' /no_think') or 'checkpoint' (the tokenizer directory's own template, its
  # chat_template.jinja or tokenizer_config.json `chat_template`, rendered as transformers
  # does; foundation/chat_template.py). Verifiers and reward models read the built-in rendering.
  chat_template: str = schema.field('builtin', check=schema.one_of(chat_template_lib.CHOICES,
                                                                      'chat template'))

  def check(self, fail):
    del fail
    if not self.path:
      raise ConfigError('config.tokenizer.path: missing (a SentencePiece model or HF '
                        'tokenizer dir)')

  def template(self):
    """The chat template the policy's prompts are rendered with (read from the tokenizer's
    directory for 'checkpoint')."""
    if self.chat_template == 'builtin':
      return chat_template_lib.BUILTIN
    try:
      return chat_template_lib.read(self.path)
    except (OSError, ValueError) as e:   # paths.PathError is a ValueError
      raise ConfigError(f"config.tokenizer.chat_template='checkpoint': {e}") from None


def _mesh_shape_ok(shape) -> bool:
  return (isinstance(shape, (list, tuple)) and len(shape) in (3, 4, 5)
          and all(schema.is_int(s) and (s >= 1 or s == -1) for s in shape)
          and list(shape).count(-1) <= 1)


def _check_expert_axis(shape, model) -> None:
  """A mesh with an expert axis splits the experts of every 'moe' layer evenly over it."""
  if shape is None or len(shape) < 4 or shape[2] in (1, -1):
    return
  if model is None or not model.has_experts:
    raise ConfigError(f'config.mesh.shape={tuple(shape)}: an expert axis of {shape[2]} devices, '
                      'but the model has no mixture-of-experts layers')
  if model.num_experts % shape[2]:
    raise ConfigError(f'config.mesh.shape={tuple(shape)}: model num_experts='
                      f'{model.num_experts} does not split over the expert axis of {shape[2]} '
                      'devices')


def _check_positions(model) -> None:
  """A YaRN model's max_seq_len (the longest length a stage may ask) stays within the positions
  its scaling is made for."""
  scaling = model.rope_scaling if model.use_rope else None
  covered = scaling.covered_positions() if scaling is not None else None
  if covered is not None and model.max_seq_len > covered:
    raise ConfigError(
        f'config.model: max_seq_len={model.max_seq_len} exceeds the {covered} positions its '
        f'YaRN scaling covers (original_max_position_embeddings='
        f'{scaling.original_max_position_embeddings} x factor={scaling.factor:g}): raise '
        'rope_scaling.factor or lower max_seq_len')


def _rules(rules) -> tuple:
  """Logical sharding rules as (logical axis, mesh axes) pairs, mesh axes lists as tuples."""
  return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mesh:
  """config.mesh: the device mesh and how logical axes map onto it."""
  # (data, fsdp, tensor) device counts, (data, fsdp, expert, tensor) with an expert axis
  # (mixture-of-experts models: experts split over it), or (data, fsdp, expert, sequence,
  # tensor) with a context-parallel axis too (activations split along their length); each
  # >= 1, at most one -1 (the devices left over); None: one device, no mesh.
  shape: tuple[int, ...] | None = schema.field(
      None, check=(_mesh_shape_ok, 'must be None, three sizes (data, fsdp, tensor), four '
                                   '(data, fsdp, expert, tensor) or five (data, fsdp, expert, '
                                   'sequence, tensor), each >= 1, at most one -1'),
      convert=lambda shape: tuple(int(s) for s in shape))
  # (logical axis, mesh axes) pairs; empty or None: `models.sharding.DEFAULT_RULES`.
  rules: tuple | None = schema.field(None)
  # TPU slices (joined over the data-center network, DCN) the mesh spans: the data axis
  # (shape's first entry) is split over them, every other axis stays inside one slice
  # (`foundation.topology`); None: as many as the devices span (1 on CPU and GPU).
  slices: int | None = schema.field(None, check=schema.int_at_least(1))

  def check(self, fail):
    data = None if self.shape is None else self.shape[0]
    if self.slices and self.slices > 1 and data is None:
      fail('slices', 'needs a mesh (config.mesh.shape is None: one device)')
    if self.slices and data not in (None, -1) and data % self.slices:
      fail('slices', f'does not divide the data axis (config.mesh.shape[0]={data}): each '
           'slice holds an equal share of it')

  def logical_rules(self) -> tuple:
    """The rules the run shards by."""
    if self.rules:
      return _rules(self.rules)
    from models import sharding  # pylint: disable=g-import-not-at-top
    return sharding.DEFAULT_RULES


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampler(schema.settings(engine_options.SamplerOptions, unset=True)):
  """config.sampler: options of the policy's `rl.sampler.Sampler` (see its docstring).

  Its fields are `rl.engine_options.SamplerOptions`', with their checks: the sampler's own
  (buckets, decode phases, the cache budget, rollout rules, the engine, decode layers, the
  rollout copy) and the paged engine's (slots, page_size, pages, chunk_steps,
  prefill_prompts, decode_rows). A field left None takes the Sampler's own default;
  `options()` are the keyword arguments the run and `launch.plan` build it with. The Sampler
  checks what only it can (its ids against the model, rollout_rules against the logical
  axes) when it is built.
  """

  def options(self) -> dict[str, Any]:
    """The keyword arguments of `rl.sampler.Sampler` this section sets."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None}


_NONNEG = schema.num_in(0, what='must be a finite number >= 0')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
  """config.hardware: the machine a config targets; read by `launch.plan` and `launch.xm_launch`,
  and by the run only for a logged metric (peak_tflops: `cascade.metrics`' model FLOP
  utilisation), never for what it computes (so it is left out of the config hash)."""
  # A name for the printed plan, e.g. 'TPU v5p-128 (64 chips)'.
  name: str = schema.field('', check=_STRING)
  # 'tpu', 'gpu' or 'cpu' (None: unnamed): on 'tpu' with libtpu installed, launch.plan
  # compiles with the TPU compiler; on 'tpu' and 'gpu' the planned programs scan their layers.
  platform: str | None = schema.field(None, check=schema.one_of(('tpu', 'gpu', 'cpu'),
                                                                'platform'))
  # libtpu's topology name, e.g. 'v5p:4x4x4' (launch.plan --backend=tpu, XManager's slice).
  topology: str = schema.field('', check=_STRING)
  # How many slices of `topology` the job spans, joined over DCN (launch.plan compiles for
  # all of them; config.mesh.slices must agree where it is set).
  slices: int = schema.field(1, check=schema.int_at_least(1))
  # Memory per device the plan checks every program against (0: no limit).
  device_memory_gib: float = schema.field(0.0, check=_NONNEG, convert=float)
  # Peak matmul TFLOP/s and HBM GB/s per device: launch.plan's step-time lower bound
  # (0: none printed); the peak also gives a run's logged 'mfu' (0: none logged).
  peak_tflops: float = schema.field(0.0, check=_NONNEG, convert=float)
  hbm_gbps: float = schema.field(0.0, check=_NONNEG, convert=float)
  # The GPU as XLA:GPU's deviceless compiler sees it: a GpuTargetConfigProto text file, a path
  # relative to the repository root or absolute (e.g. 'launch/gpu_targets/h200.txtpb');
  # launch.plan --backend=gpu compiles for it ('': none, and --backend=gpu refuses).
  gpu_target: str = schema.field('', check=_STRING)

  def gpu_target_path(self) -> pathlib.Path | None:
    """`gpu_target` as an absolute path (None when unset)."""
    if not self.gpu_target:
      return None
    return _REPOSITORY / self.gpu_target

  def check(self, fail):
    if not self.gpu_target:
      return
    if self.platform not in (None, 'gpu'):
      fail('gpu_target', f"describes a GPU, but config.hardware.platform={self.platform!r}")
    if not self.gpu_target_path().is_file():
      fail('gpu_target', f'no such file: {self.gpu_target_path()}')


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompilationCache:
  """config.compilation_cache: JAX's persistent compilation cache (`cascade.compile_cache`).

  A restarted or resumed run loads the programs an earlier run compiled
  instead of compiling them again. Where they are kept does not change what a
  run computes, so this section is left out of the config hash.
  """
  # The cache directory, local or gs:// (through etils.epath); '' turns the cache off. None:
  # JAX's own setting (JAX_COMPILATION_CACHE_DIR) if it has one, else <workdir>/compilation_cache.
  dir: str | None = schema.field(None, check=_STRING)
  # Only programs that took at least this many seconds to compile are written (JAX's
  # jax_persistent_cache_min_compile_time_secs). None: JAX's own setting (1 s unless
  # JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise).
  min_compile_secs: float | None = schema.field(None, check=_NONNEG, convert=float)

  def check(self, fail):
    if self.dir:
      try:
        paths.path(self.dir)
      except paths.PathError as e:
        fail('dir', str(e).partition(': ')[2])


_PROJECT_RE = re.compile(r'^[A-Za-z0-9_.-]{1,128}$')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Logging:
  """config.logging: where a run's metrics go besides TensorBoard and metrics.jsonl
  (`cascade.metrics`). It changes no result, so it is left out of the config hash."""
  # A Weights & Biases project: every scalar and text TensorBoard gets goes to a W&B run there
  # too, under the same tags (docs/metrics.md); the `wandb` extra installs the library, and
  # its own settings apply (WANDB_MODE=offline keeps the run in <workdir>/wandb). None: off.
  wandb: str | None = schema.field(None, check=(
      lambda v: isinstance(v, str) and bool(_PROJECT_RE.match(v)),
      'must be a W&B project name (letters, digits, _ . -)'))


# ---------------------------------------------------- evaluation, checkpoints, divergence

def _thinking_ok(v) -> bool:
  return v is None or isinstance(v, bool) or v == 'both'


# config.eval fields a domain may set for itself (config.eval.domains.<name>.<field>).
EVAL_DOMAIN_FIELDS = ('num_samples', 'max_new_tokens', 'max_prompt_len', 'num_prompts',
                      'temperature', 'top_p', 'top_k', 'greedy', 'thinking')


def _domains_ok(v) -> bool:
  v = schema.plain(v)
  return v is None or (isinstance(v, Mapping) and all(
      isinstance(k, str) and isinstance(schema.plain(o), Mapping) for k, o in v.items()))


def _names_ok(v) -> bool:
  return isinstance(v, (list, tuple)) and all(isinstance(x, str) and x for x in v)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eval:
  """config.eval: how every row of the matrix samples the held-out (and validation) prompts.

  `thinking`: None (no /think switch), True, False, or 'both' (each domain is
  scored in both modes; its score is their mean, each mode's is kept beside it).
  `domains`: per-domain overrides of the sampling fields (EVAL_DOMAIN_FIELDS),
  e.g. a longer `max_new_tokens` for math; `Plan.eval_settings` holds the result.
  `validation_prompts`: prompts of each domain's validation set scored (0 = all);
  `eval_every`: inside every stage that trains the policy, its validation sets
  are scored every N steps (0 = at stage ends only), logged as `val/<domain>`.
  `log_samples`: samples of every RL step logged to samples.jsonl and TensorBoard (0 = off).
  `suites`: evaluation suites (`cascade.suites`: the papers' benchmarks, or a world's own)
  scored after every row beside the domains, each by its own protocol (docs/evaluation.md);
  `suite_options` gives their graders' options (ArenaHard's judge).
  """
  # Completions sampled per prompt (a domain's score is their mean).
  num_samples: int = schema.field(check=schema.int_at_least(1))
  # The longest completion, and the longest prompt (longer ones are dropped), in tokens.
  max_new_tokens: int = schema.field(check=schema.int_at_least(1))
  max_prompt_len: int = schema.field(check=schema.int_at_least(1))
  # Held-out prompts scored per domain (0 = all of them).
  num_prompts: int = schema.field(check=schema.int_at_least(0))
  # Prompts per sampler call.
  batch_size: int = schema.field(check=schema.int_at_least(1))
  # Sampling: temperature (> 0 unless greedy), nucleus top_p, top_k (0 = off), greedy decoding.
  temperature: float = schema.field(check=schema.num_in(0, what='must be a number >= 0'),
                                    convert=float)
  top_p: float = schema.field(check=schema.num_in(0, 1, lo_open=True, what='must be in (0, 1]'),
                              convert=float)
  top_k: int = schema.field(0, check=(lambda v: schema.is_int(v) and v >= 0,
                                      'must be an int >= 0 (0 = off)'))
  greedy: bool = schema.field(False, check=schema.BOOL)
  # The /think switch: None (none), True, False, or 'both' (scored in both modes).
  thinking: Any = schema.field(None, check=(
      _thinking_ok, "must be None (no /think switch), True (/think), False (/no_think) or "
                    "'both'"))
  # Evaluate the starting policy first (row 'init'); 'auto': when the first row is an RL stage's.
  initial: Any = schema.field('auto', check=((lambda v: v in ('auto', True, False)),
                                             "expected 'auto', True or False"))
  # Samples of every RL step logged to samples.jsonl and TensorBoard (0 = off).
  log_samples: int = schema.field(2, check=schema.int_at_least(0))
  # Prompts of each domain's validation set scored (0 = all).
  validation_prompts: int = schema.field(0, check=schema.int_at_least(0))
  # Score the validation sets every N steps inside a stage that trains the policy (0 = never).
  eval_every: int = schema.field(0, check=schema.int_at_least(0))
  # domain -> {field: value} overriding the fields above in EVAL_DOMAIN_FIELDS for that domain.
  domains: Any = schema.field(None, check=(
      _domains_ok, 'must be a mapping domain -> {field: value}'))
  # Evaluation suites scored after every row, by name (`cascade.suites.names()`); () = none.
  suites: tuple[str, ...] = schema.field((), check=(_names_ok, 'must be a list of suite names'),
                                         convert=tuple)
  # Where their data lives (local or gs://): suite S reads <suite_data>/S (a generated world's
  # suites: the world's directory itself); '' = nowhere (only suites that generate their own).
  suite_data: str = schema.field('', check=_STRING)
  # Prompts of each suite scored, the first N of its files (0 = all of them).
  suite_prompts: int = schema.field(0, check=schema.int_at_least(0))
  # Prompts per sampler call of a suite (each sampled as many times as its protocol says).
  suite_batch_size: int = schema.field(64, check=schema.int_at_least(1))
  # suite -> {protocol field: value} replacing its paper protocol's (e.g. a smaller
  # max_new_tokens for a small model); its protocol hash in results.json changes with it.
  suite_protocol: Any = schema.field(None, check=(
      _domains_ok, 'must be a mapping suite -> {protocol field: value}'))
  # suite -> {grader option: value}: its grader's options (`Suite.grader`), e.g. ArenaHard's
  # judge {'url': 'http://judge:8000/v1', 'cache_dir': ...} or {'judge': HF_DIR}.
  suite_options: Any = schema.field(None, check=(
      _domains_ok, 'must be a mapping suite -> {grader option: value}'))

  @property
  def modes(self) -> tuple:
    """The thinking modes a domain is scored in."""
    return (True, False) if self.thinking == 'both' else (self.thinking,)

  def check(self, fail):
    if not self.greedy and self.temperature <= 0:
      fail('temperature', 'must be > 0 unless config.eval.greedy')
    if self.suites or self.suite_protocol or self.suite_options:
      from cascade import suites as suites_lib  # pylint: disable=g-import-not-at-top
      known = suites_lib.names()
      for name in self.suites:
        if name not in known and suites_lib.refusal(name):
          fail('suites', f'suite {name!r} is not available: {suites_lib.refusal(name)}')
        if name not in known:
          fail('suites', f'unknown suite {name!r} (known: {", ".join(known) or "none"}; a '
                         "world's or a user's own suites exist once their package is imported)")
      if len(set(self.suites)) != len(self.suites):
        fail('suites', 'names a suite twice')
      for name, fields in (schema.plain(self.suite_protocol) or {}).items():
        if name not in self.suites:
          fail('suite_protocol', f'names suite {name!r}, which config.eval.suites does not '
                                 'list', schema.HIDE)
        try:
          self.suite_settings(name)
        except ValueError as e:
          fail(f'suite_protocol.{name}', str(e), dict(schema.plain(fields)))
      options = schema.plain(self.suite_options) or {}
      for name in options:
        if name not in self.suites:
          fail('suite_options', f'names suite {name!r}, which config.eval.suites does not '
                                'list', schema.HIDE)
      for name in self.suites:
        if name in known:
          try:
            suites_lib.get(name).check_grader_options(self.grader_options(name))
          except ValueError as e:
            fail(f'suite_options.{name}', str(e), schema.HIDE)

  def grader_options(self, name: str) -> dict:
    """Suite `name`'s grader options (`suite_options`; {} when none)."""
    return dict(schema.plain((schema.plain(self.suite_options) or {}).get(name)) or {})

  def suite_settings(self, name: str):
    """Suite `name`'s protocol with this config's overrides (`suite_protocol`)."""
    from cascade import suites as suites_lib  # pylint: disable=g-import-not-at-top
    over = dict(schema.plain((schema.plain(self.suite_protocol) or {}).get(name)) or {})
    return suites_lib.get(name).protocol.replaced(**over)


GUARD_ACTIONS = ('warn', 'stop', 'repair')
# The signals config.guard.signals may name (cascade/signals.py).
GUARD_SIGNALS = ('kl', 'grad_cos')


def _signal_names(v):
  """config.guard.signals as a tuple: a comma-separated string (the command line's
  `--config.guard.signals=kl,grad_cos` arrives as ('kl,grad_cos',)) split into names."""
  if isinstance(v, str):
    v = (v,)
  if not isinstance(v, (list, tuple)):
    return v
  return tuple(p.strip() for x in v for p in (x.split(',') if isinstance(x, str) else [x]))


def _signals_ok(v) -> bool:
  """Whether config.guard.signals is a list of GUARD_SIGNALS (or their comma-separated
  string), none twice."""
  v = _signal_names(v)
  return (isinstance(v, tuple) and all(s in GUARD_SIGNALS for s in v)
          and len(set(v)) == len(v))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Guard:
  """config.guard: regression guards on earlier domains while a stage trains (`cascade.guard`).

  While a policy-training stage trains, every `every` steps (and at its first and last) the
  protected domains an earlier stage trained (and this one does not) are probed: the first
  `prompts` prompts of each one's validation set, sampled with its evaluation settings and
  scored by its evaluation verifier. A probe whose score lies more than `max_drop` points +
  `stderrs` standard errors of the difference below the domain's best probe so far in the
  validation ledger has crossed the bound (the error paired prompt by prompt over the prompts
  both scored: `cascade.guard.paired_stderr`; for a ledger entry without per-prompt scores,
  the two probes' errors as if independent); then `action`:
  'warn' (a line and the `guard/*` metrics), 'stop' (the stage ends at its newest probed
  checkpoint within every bound, saying so; each probe within bounds is checkpointed) or
  'repair' (as 'warn' while the stage trains; then the MOPD stage inserted after it, from
  `repair`, runs: `repair_stages`). Each probe from a stage's second on also forecasts every
  domain's score at the stage's end (`cascade.forecast`); with `forecast_confidence` a forecast
  past the bound acts before the fall is seen.
  """
  # The protected domains (config.domains names, each with a validation set).
  domains: tuple[str, ...] = schema.field(check=(
      lambda v: _names_ok(v) and len(v) > 0, 'must be a non-empty list of domain names'),
      convert=tuple)
  # The drop (points of a 0..100 score) a domain may take below its best probe.
  max_drop: float = schema.field(3.0, check=schema.num_in(
      0, 100, hi_open=True, what='must be in [0, 100): a drop below 0 is a rise, and no '
                                 'score can fall 100 points or more'), convert=float)
  # Standard errors of the drop (paired prompt by prompt) added to max_drop, so probe noise
  # does not cross it.
  stderrs: float = schema.field(2.0, check=schema.num_in(0, what='must be a finite number >= 0'),
                                convert=float)
  # Prompts of each protected domain's validation set a probe scores (the first N).
  prompts: int = schema.field(16, check=schema.int_at_least(1))
  # Probe every N steps (and at a stage's first and last step).
  every: int = schema.field(10, check=schema.int_at_least(1))
  # What a probe past the bound does: 'warn', 'stop' or 'repair'.
  action: str = schema.field('warn', check=schema.one_of(GUARD_ACTIONS, 'action'))
  # Act on a forecast (cascade/forecast.py: a weighted line through the stage's probes so far,
  # extrapolated to its last step) that puts a domain more than max_drop below its best probe
  # with this confidence, as on an observed fall ('stop' stops there); 0: off, only observed
  # drops act (the forecasts are still recorded).
  forecast_confidence: float = schema.field(0.0, check=(
      lambda v: schema.is_num(v) and (float(v) == 0.0 or 0.5 <= float(v) < 1.0),
      'must be 0 (off) or a probability in [0.5, 1)'), convert=float)
  # Signals measured beside each forecast (cascade/signals.py), each protected domain on its
  # probe prompts: 'kl' (the KL drift from the stage's starting policy) and 'grad_cos' (the
  # cosine between the stage's update so far and the domain's probe-reward gradient; holds a
  # copy of the starting policy). They sharpen the forecast's sign; (): none.
  signals: tuple[str, ...] = schema.field((), check=(
      _signals_ok, f'must be a list naming each of {", ".join(GUARD_SIGNALS)} at most once'),
      convert=_signal_names)
  # Responses the stage's starting policy samples per probe prompt for the signals.
  signal_samples: int = schema.field(4, check=schema.int_at_least(1))
  # action='repair': the fields of the MOPD stage inserted after every guarded stage (a mopd
  # stage dict without name, kind, domains and teachers; its `steps` are the repair's budget).
  repair: Any = schema.field(None, check=_MAPPING, convert=dict)

  def check(self, fail):
    if self.action == 'repair' and not self.repair:
      fail('repair', "action='repair' needs the inserted MOPD stage's fields, e.g. "
                     "dict(steps=10, optimizer=dict(lr=1e-5), prompts_per_step=16, "
                     "group_size=4, max_prompt_len=96, max_response_len=48)", schema.HIDE)
    if self.repair and self.action != 'repair':
      fail('repair', f"is the MOPD stage action='repair' inserts; action={self.action!r}",
           schema.HIDE)
    for k in ('name', 'kind', 'domains', 'teachers', 'repairs'):
      if k in (self.repair or {}):
        fail(f'repair.{k}', 'is set by the guard', schema.HIDE)

  def repair_stages(self, stages, raw: list[dict]) -> list[dict]:
    """`raw` (the stage dicts of `stages`, parsed) with, after each stage that trains the policy
    and has protected domains an earlier stage trained, the MOPD stage that repairs it:
    `<name>_repair`, on those domains and its own, marked `repairs=<name>` (it runs only where
    a probe of that stage crossed a bound, `cascade.kinds.mopd`)."""
    out = []
    for st, r in zip(stages, raw):
      out.append(r)
      earlier = {d for s in stages[:st.index] if s.trains_policy for d in s.domains}
      guarded = [d for d in self.domains if d in earlier and d not in st.domains]
      if st.MODEL == 'policy' and st.trains_policy and guarded:
        out.append(dict(schema.as_dict(self.repair), name=f'{st.name}_repair', kind='mopd',
                        domains=guarded + [d for d in st.domains if d not in guarded],
                        teachers='best', repairs=st.name))
    return out

  def check_domains(self, domains) -> None:
    """Each protected domain exists and has a validation set to probe (one ConfigError line)."""
    for d in self.domains:
      if d not in domains:
        raise ConfigError(f'config.guard.domains: unknown domain {d!r} (known: '
                          f'{", ".join(sorted(domains))})')
      if not domains[d].validation:
        raise ConfigError(f'config.guard.domains: domain {d!r} has no validation set to probe '
                          f'(config.domains.{d}.validation: a prompt dataset disjoint from its '
                          'eval set)')
    if len(set(self.domains)) != len(self.domains):
      raise ConfigError('config.guard.domains: names a domain twice')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ckpt:
  """config.ckpt: checkpoint every N steps (0: only at stage ends), keep the newest `keep`."""
  # Save a checkpoint every N steps of a stage (0: only at its end).
  every_n_steps: int = schema.field(0, check=schema.int_at_least(0))
  # Checkpoints kept per stage, newest first (the stage's final one is always among them), besides
  # those the validation ledger keeps (a domain's best, a guard's stop target: cascade.ledger).
  keep: int = schema.field(2, check=schema.int_at_least(1))
  # Seal every checkpoint step and HF export with sha256s and check them before a resume or a
  # reuse (`cascade.checksums`: each is read once more, about 1 s per GB).
  checksums: bool = schema.field(True, check=schema.BOOL)


_FINITE = schema.num_in(what='must be a finite number')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Divergence:
  """config.divergence: which training steps are bad, and when a stage has diverged.

  A step is bad when its loss or gradient norm is not finite (the train step
  skipped it), when its gradient is exactly zero while its loss is not (a
  saturated model that can no longer learn: the finite garbage a far too high
  learning rate leaves), when its update changed the weights by orders of
  magnitude (`max_update_ratio`), or when its loss or its gradient norm
  (before clipping) leaves the band set here. Every bad step is reported as it
  happens (stderr, TensorBoard, metrics.jsonl `bad_steps`); a stage whose bad
  steps run past `max_bad_steps` in a row, or that ends on a bad step, has
  diverged: it rolls back (`rollbacks`) or the run stops without exporting or
  evaluating its policy (`cascade.divergence`).
  """
  # Bad steps in a row a stage tolerates (a sporadic overflow is skipped and reported); one more
  # and the stage has diverged.
  max_bad_steps: int = schema.field(3, check=schema.int_at_least(0))
  # The band of a good step's loss (None: unbounded on that side), e.g. max_loss=20 for SFT.
  min_loss: float | None = schema.field(None, check=_FINITE, convert=float)
  max_loss: float | None = schema.field(None, check=_FINITE, convert=float)
  # The largest gradient norm (before clipping) of a good step (None: unbounded).
  max_grad_norm: float | None = schema.field(
      None, check=schema.num_in(0, lo_open=True, what='must be > 0'), convert=float)
  # The largest change one step may make to the weights, as |new - old| / |old| over all
  # parameters (the step's 'update_ratio'; a healthy step stays far below 0.01): above it the
  # update multiplied the weights, e.g. x1e37 before the NaN steps it causes (None: unchecked).
  max_update_ratio: float | None = schema.field(
      1e3, check=schema.num_in(0, lo_open=True, what='must be > 0'), convert=float)
  # Times a diverged stage goes back to its newest checkpoint from before its bad steps and
  # goes on with its learning rate times `rollback_lr_factor` (0: a diverged stage stops the run).
  rollbacks: int = schema.field(0, check=schema.int_at_least(0))
  rollback_lr_factor: float = schema.field(
      0.5, check=schema.num_in(0, 1, lo_open=True, hi_open=True), convert=float)

  def check(self, fail):
    if self.min_loss is not None and self.max_loss is not None and self.min_loss >= self.max_loss:
      fail('min_loss', f'must be below max_loss={self.max_loss:g}')


# ---------------------------------------------------------------- the data-making step

def _prepare_fn_ok(fn) -> bool:
  return isinstance(fn, str) and fn.count(':') == 1 and all(fn.split(':'))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepare:
  """config.prepare: the step that makes the data the config names, run before it is read."""
  # 'package.module:function', called with `kwargs` (e.g. the tiny world's builder).
  fn: str | None = schema.field(None, check=(_prepare_fn_ok, "must be 'package.module:function'"))
  # Its keyword arguments.
  kwargs: Mapping[str, Any] | None = schema.field(None, check=_MAPPING, convert=dict)

  def check(self, fail):
    if self.fn is None:
      fail('fn', "must be 'package.module:function'")

  def call(self) -> None:
    import importlib  # pylint: disable=g-import-not-at-top
    module, _, attr = self.fn.partition(':')
    getattr(importlib.import_module(module), attr)(**dict(self.kwargs or {}))


# ---------------------------------------------------------------- datasets and domains

_NAME_RE = re.compile(r'^[A-Za-z0-9_.-]+$')


def _entry(cls, section: str, name, spec):
  """`cls` from `config.<section>.<name>` (`schema.from_mapping`: every field checked, an unknown
  one named with the nearest known ones), its name checked; (where, the entry)."""
  where = f'config.{section}.{name}'
  if not (isinstance(name, str) and _NAME_RE.match(name)):
    raise ConfigError(f'{where}: a {section[:-1]} name may hold only letters, digits, _ . -')
  if not _mapping_ok(spec):
    raise ConfigError(f'{where}: must be a mapping of its fields, got {type(spec).__name__}')
  return where, schema.from_mapping(cls, spec, where, fixed=dict(name=name), sep='.')


def _format_domains(fmt: str, domain: str) -> tuple | None:
  """The domains a dataset of format `fmt` (and config `domain`) can hold; None: any."""
  if fmt in released.FORMAT_DOMAINS:
    return released.FORMAT_DOMAINS[fmt]
  if fmt in released.DATASET_DOMAIN_FORMATS and domain:
    return (domain,)
  return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dataset:
  """config.datasets.<name>: a file (JSONL/Parquet) or a prepared TFDS dataset, and its format.

  `path` or `tfds` (exactly one) and `format` are required. `parse` builds it from the config
  (`schema.from_mapping`) and `resolve` checks the format against the known ones and sets
  what follows from it (`record_type`, `domains`). The tokenize-once cache spells it in its key
  (`cascade.data.token_cache.spelling`).
  """
  # The dataset's name (its key in config.datasets).
  name: str = schema.field(user=False)
  # A `cascade.data.readers.FORMATS` name: how its records are read.
  format: str = schema.field(check=_STRING)
  # A file or glob of shards, local or gs:// ('' = a TFDS dataset).
  path: str = schema.field('', check=_STRING)
  # A prepared TFDS dataset's name ('' = a file), its split and its data directory.
  tfds: str = schema.field('', check=_STRING)
  split: str = schema.field('train', check=_STRING)
  data_dir: str = schema.field('', check=_STRING)
  # The domain of records that name none.
  domain: str = schema.field('', check=_STRING)
  # Keep the first `limit` records (0 = all) after skipping the first `skip`.
  limit: int = schema.field(0, check=schema.int_at_least(0))
  skip: int = schema.field(0, check=schema.int_at_least(0))
  # Set from `format` (`resolve`): the record type it yields ('prompt', 'sft', 'preference'),
  # and the only domains its records can hold where the format says so (a released Cascade-2
  # subset: `released.FORMAT_DOMAINS`); None: any (records may name their own).
  record_type: str = schema.field('', user=False)
  domains: tuple | None = schema.field(None, user=False)

  def check(self, fail):
    if bool(self.path) == bool(self.tfds):
      fail('tfds' if self.path else 'path',
           "give exactly one of 'path' (JSONL/Parquet) or 'tfds'", schema.HIDE)

  @classmethod
  def parse(cls, name: str, spec, known_formats: Mapping[str, str]) -> 'Dataset':
    """`config.datasets.<name>`, checked; `known_formats`: format name -> record type."""
    where, ds = _entry(cls, 'datasets', name, spec)
    return ds.resolve(known_formats, schema.failer(where, ds, sep='.'))

  def resolve(self, known_formats: Mapping[str, str], fail) -> 'Dataset':
    """The dataset with `record_type` and `domains` set from its format (one of
    `known_formats`: format name -> record type)."""
    if self.format not in known_formats:
      fail('format', f'unknown format (known: {", ".join(sorted(known_formats))})')
    return dataclasses.replace(self, record_type=known_formats[self.format],
                               domains=_format_domains(self.format, self.domain))

  def lacks(self, domain: str) -> bool:
    """Whether the dataset can hold no record of `domain` (its format says which it holds)."""
    return self.domains is not None and domain not in self.domains

  def lacks_message(self, domain: str) -> str:
    """Why the dataset has no rows of `domain` (one clause, for `lacks`)."""
    if self.format in released.DATASET_DOMAIN_FORMATS:
      why = f'records of format {self.format!r} are all of the dataset\'s domain {self.domain!r}'
    else:
      why = f'its format {self.format!r} holds only {", ".join(self.domains)}'
    return f'dataset {self.name!r} has no rows of domain {domain!r} ({why})'


def _reward_model_option(verifier: str) -> str:
  """The option a verifier takes its reward model's scorer in ('' = none: it takes none)."""
  import verifiers  # pylint: disable=g-import-not-at-top
  if verifier not in verifiers.names():
    return ''
  return verifiers.cls(verifier).reward_model_option


def _needs_reward_model(verifier: str) -> bool:
  import verifiers  # pylint: disable=g-import-not-at-top
  return verifier in verifiers.names() and verifiers.cls(verifier).needs_reward_model


def _judge_window(verifier: str, options: Mapping[str, Any]) -> int | None:
  """The most tokens of a policy answer a verifier's judge model reads (None: no judge, or
  nothing cut)."""
  import verifiers  # pylint: disable=g-import-not-at-top
  if verifier not in verifiers.names():
    return None
  use = verifiers.cls(verifier).judge_use(options, 1)
  return None if use is None else use.answer_tokens


def _one_line(v) -> bool:
  return isinstance(v, str) and '\n' not in v


@dataclasses.dataclass(frozen=True, kw_only=True)
class Domain:
  """config.domains.<name>: its verifiers (training and held-out), datasets, optional RM stage.

  `eval_verifier` (default: `verifier`) scores the held-out set, so a domain
  trained on a learned reward can be measured by a ground-truth rule.
  `validation` (optional) names a prompt dataset disjoint from `eval`: the
  selection set that in-stage validation and MOPD's `teachers='best'` read,
  so that nothing is chosen on the held-out numbers the matrix reports.

  An agentic domain names an environment (`env`, see `envs`) instead of a
  verifier: its rollouts are multi-turn episodes in that environment
  (`cascade.episodes`), which scores them, in training and evaluation alike.

  `parse` builds it from the config (`schema.from_mapping`) and `resolve` checks it against
  the datasets, verifiers and environments and sets the held-out verifier and its options.
  """
  # The domain's name (its key in config.domains).
  name: str = schema.field(user=False)
  # The training verifier (a `verifiers` name; '' for an agentic domain) and its options (None:
  # none; `resolve` makes every options field a dict).
  verifier: str = schema.field('', check=_STRING)
  verifier_options: Mapping[str, Any] | None = schema.field(None, check=_MAPPING, convert=dict)
  # Prompt datasets: training ('' = none) and held-out (every domain has one).
  train: str = schema.field('', check=_STRING)
  eval: str = schema.field('', check=_STRING)
  # The held-out verifier ('' = `verifier`) and its options (None: the training verifier's when
  # it is the same verifier, else none); `resolve` sets both.
  eval_verifier: str = schema.field('', check=_STRING)
  eval_verifier_options: Mapping[str, Any] | None = schema.field(None, check=_MAPPING,
                                                                 convert=dict)
  # The reward_model stage whose model scores this domain, for a verifier that takes one.
  reward_model_stage: str = schema.field('', check=_STRING)
  # A prompt dataset disjoint from `eval` that selections read ('' = none).
  validation: str = schema.field('', check=_STRING)
  # Agentic: the environment (an `envs` name) and its options.
  env: str = schema.field('', check=_STRING)
  env_options: Mapping[str, Any] | None = schema.field(None, check=_MAPPING, convert=dict)
  # Agentic: an episode's assistant turns; one turn's tokens in evaluation (0: the episode's
  # whole budget, eval.max_new_tokens); list the tools' schemas in the opening system turn.
  max_turns: int = schema.field(8, check=schema.int_at_least(1))
  max_turn_tokens: int = schema.field(0, check=(
      lambda v: schema.is_int(v) and v >= 0, "must be an int >= 0 (0 = the episode's whole "
                                             'budget)'))
  render_tools: bool = schema.field(True, check=schema.BOOL)
  # A recipe's reward that stands in for the paper's, in words ('' = none): the run's start
  # banner announces it and results.json records it under "substitutions".
  stand_in: str = schema.field('', check=(
      _one_line, "must be one line of text (what stands in for the paper's reward)"))

  # Fields only an agentic domain takes (given to another: refused), and the scoring fields an
  # agentic domain's environment replaces (given to one: refused).
  AGENTIC_FIELDS: ClassVar[tuple[str, ...]] = ('env_options', 'max_turns', 'max_turn_tokens',
                                               'render_tools')
  VERIFIER_FIELDS: ClassVar[tuple[str, ...]] = ('verifier', 'verifier_options', 'eval_verifier',
                                                'eval_verifier_options', 'reward_model_stage')

  @property
  def agentic(self) -> bool:
    """Rollouts of this domain are episodes in an environment."""
    return bool(self.env)

  def check(self, fail):
    if not self.eval:
      fail('eval', 'missing field (every domain needs a held-out set)', schema.HIDE)
    if self.validation and self.validation == self.eval:
      fail('validation', 'is the held-out set (eval); selecting on it would be selecting on the '
                         'reported numbers')
    given = [k for k in self.VERIFIER_FIELDS if self.env and getattr(self, k)]
    if given:
      fail(given[0], 'a domain with an env is scored by its environment; give the scoring '
                     'options in env_options', schema.HIDE)

  @classmethod
  def parse(cls, name: str, spec, datasets: Mapping[str, Dataset],
            verifier_names) -> 'Domain':
    """`config.domains.<name>`, checked against the datasets and the known verifier names."""
    where, dom = _entry(cls, 'domains', name, spec)
    fail = schema.failer(where, dom, sep='.')
    for k in cls.AGENTIC_FIELDS:
      if not dom.env and k in schema.plain(spec):
        fail(k, 'only a domain with an env takes it', schema.HIDE)
    return dom.resolve(datasets, verifier_names, fail)

  def resolve(self, datasets: Mapping[str, Dataset], verifier_names, fail) -> 'Domain':
    """The domain checked against the datasets (name -> `Dataset`), the known verifier names
    and environments, with its held-out verifier and options set (and its options as dicts)."""
    if self.env:
      import envs  # pylint: disable=g-import-not-at-top
      if self.env not in envs.names():
        fail('env', f'unknown environment (known: {", ".join(envs.names())})')
    else:
      self._check_verifiers(verifier_names, fail)
    for split in ('train', 'eval', 'validation'):
      ds = getattr(self, split)
      if ds and ds not in datasets:
        fail(split, f'unknown dataset (known: {", ".join(sorted(datasets))})')
      if ds and datasets[ds].record_type != 'prompt':
        fail(split, f'format {datasets[ds].format!r} holds {datasets[ds].record_type} records, '
                    'a domain needs prompts')
      if ds and datasets[ds].lacks(self.name):
        fail(split, datasets[ds].lacks_message(self.name))
    opts = dict(self.verifier_options or {})
    eval_ver = self.eval_verifier or self.verifier
    eval_opts = self.eval_verifier_options
    eval_opts = opts if eval_opts is None and eval_ver == self.verifier else dict(eval_opts or {})
    return dataclasses.replace(self, verifier_options=opts, eval_verifier=eval_ver,
                               eval_verifier_options=eval_opts,
                               env_options=dict(self.env_options or {}))

  def _check_verifiers(self, verifier_names, fail) -> None:
    """A verifier domain's verifiers exist and its reward model stage is given where one of
    them scores with one (and only then)."""
    ver, eval_ver = self.verifier, self.eval_verifier or self.verifier
    if not ver:
      fail('verifier', 'missing field (a `verifiers` name; an agentic domain names an env)',
           schema.HIDE)
    for field, vname in (('verifier', ver), ('eval_verifier', eval_ver)):
      if vname not in verifier_names:
        fail(field, f'unknown verifier (known: {", ".join(sorted(verifier_names))})', vname)
    rm_stage = self.reward_model_stage
    if rm_stage and not (_reward_model_option(ver) or _reward_model_option(eval_ver)):
      takers = [v for v in sorted(verifier_names) if _reward_model_option(v)]
      fail('reward_model_stage', f'neither verifier {ver!r} nor eval_verifier {eval_ver!r} takes '
                                 f'a reward model (those that do: {", ".join(takers)})')
    needs = [v for v in (ver, eval_ver) if _needs_reward_model(v)]
    if not rm_stage and needs:
      fail('reward_model_stage', f'missing field (the {needs[0]!r} verifier scores with the '
                                 'reward model a reward_model stage trains)', schema.HIDE)

  def check_reward_model(self, stages, eval_setting: Eval) -> None:
    """The domain's reward_model_stage names an earlier reward_model stage whose scorer sees
    every row it scores whole: a stage's longest prompt and rollout, and (when the evaluation
    scores with it) the held-out prompt and generation budget."""
    rm = next((s for s in stages if s.name == self.reward_model_stage), None)
    if rm is None or rm.MODEL != 'reward_model':
      raise ConfigError(f'config.domains.{self.name}.reward_model_stage='
                        f'{self.reward_model_stage!r}: names no reward_model stage')
    window = (f'the scorer of reward model stage {rm.name!r} (score_max_len={rm.score_len}, '
              'its max_len when 0): raise it, or shorten the rows, so that no rollout is cut')
    for s in stages:
      if self.name in s.domains and s.SAMPLES and s.index < rm.index:
        raise ConfigError(f'stages[{s.index}] {s.name!r}: domains: domain {self.name!r} is '
                          f'scored by reward model stage {rm.name!r}, which comes later')
      if self.name in s.domains and s.SAMPLES and _reward_model_option(self.verifier):
        rows = s.max_prompt_len + s.max_response_len
        if rows > rm.score_len:
          raise ConfigError(f'stages[{s.index}] {s.name!r}: max_prompt_len + max_response_len '
                            f'= {rows} tokens of domain {self.name!r} do not fit {window}')
    if _reward_model_option(self.eval_verifier or self.verifier):
      rows = eval_setting.max_prompt_len + eval_setting.max_new_tokens
      if rows > rm.score_len:
        raise ConfigError(f'config.eval: max_prompt_len + max_new_tokens = {rows} tokens of '
                          f'domain {self.name!r} do not fit {window}')

  def check_judge(self, stages, eval_setting: Eval) -> None:
    """A judge model that scores this domain reads every answer whole: no stage sampling it
    writes more tokens than the judge's window on an answer (`JudgeUse.answer_tokens`), nor
    does the evaluation when its verifier is a judge (text past the window would never be
    read, so the reward could not depend on it)."""
    if self.agentic:
      return
    window = _judge_window(self.verifier, self.verifier_options)
    for s in stages:
      if window is not None and self.name in s.domains and s.SAMPLES and (
          s.max_response_len > window):
        raise ConfigError(f'stages[{s.index}] {s.name!r}: max_response_len='
                          f'{s.max_response_len} tokens of domain {self.name!r} exceed its '
                          f"judge's window (config.domains.{self.name}.verifier_options."
                          f'max_field_tokens={window}): raise it or shorten the responses')
    window = _judge_window(self.eval_verifier or self.verifier, self.eval_verifier_options)
    if window is not None and eval_setting.max_new_tokens > window:
      field = ('verifier_options' if self.eval_verifier_options == self.verifier_options
               else 'eval_verifier_options')
      raise ConfigError(f'config.eval: max_new_tokens={eval_setting.max_new_tokens} tokens of '
                        f"domain {self.name!r} exceed its judge's window (config.domains."
                        f'{self.name}.{field}.max_field_tokens={window}): raise it or shorten '
                        'the generations')


# ---------------------------------------------------------------- the plan

@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """The validated config: what the stage loop, the workdir's bookkeeping and launch.plan read.

  Attributes:
    seed: the run's seed.
    model: the policy's `models.config.ModelConfig` (config.model resolved).
    model_name: config.model's preset, or its HF checkpoint (for messages).
    hf_path: the HF checkpoint the initial policy loads from ('' = random init).
    tokenizer_path: the tokenizer.
    chat_template: what renders the policy's prompts (`foundation.chat_template`: BUILTIN, or
      the tokenizer directory's own template for config.tokenizer.chat_template='checkpoint').
    mesh_shape: (data, fsdp, tensor) or None (one device, no mesh).
    mesh_slices: slices the mesh's data axis is split over (None: as the devices say).
    rules: logical sharding rules.
    sampler: config.sampler (`Sampler.options()` builds the policy's sampler).
    eval: the evaluation settings.
    eval_settings: domain -> its evaluation settings (config.eval with the
      domain's overrides from config.eval.domains).
    ckpt: checkpointing.
    divergence: when a training stage has diverged (`cascade.divergence`).
    guard: the regression guards (`cascade.guard`), or None (config.guard absent).
    stages: each stage's typed config (`cascade.kinds`).
    domains, datasets: by name.
    initial_eval: evaluate the starting policy first (row 'init').
    prepare: the data-making step, or None.
    hardware: the machine the config targets (launch.plan).
    compilation_cache: where the run keeps its compiled programs (`cascade.compile_cache`).
    logging: where its metrics go besides TensorBoard (`cascade.metrics`).
    allow_config_change: a workdir of another config may go on with this one.
    data_cache: where stages' tokenized data are kept (`cascade.data.token_cache`; local or
      gs://); '' = <workdir>/data_cache.
    source: the config as a plain dict (`schema.as_dict`): what config.json records, what
      the config hash covers (`checkpoint.config_hash`) and what a fork compares.
  """
  seed: int
  model: Any
  model_name: str
  hf_path: str
  tokenizer_path: str
  mesh_shape: tuple | None
  rules: tuple
  sampler: Sampler
  eval: Eval
  ckpt: Ckpt
  divergence: Divergence
  stages: tuple
  domains: Mapping[str, Domain]
  datasets: Mapping[str, Dataset]
  initial_eval: bool
  prepare: Prepare | None = None
  mesh_slices: int | None = None
  eval_settings: Mapping[str, Eval] = dataclasses.field(default_factory=dict)
  guard: Guard | None = None
  hardware: Hardware = Hardware()
  compilation_cache: CompilationCache = CompilationCache()
  logging: Logging = Logging()
  allow_config_change: bool = False
  data_cache: str = ''
  source: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  chat_template: Any = chat_template_lib.BUILTIN

  @property
  def substitutions(self) -> dict[str, str]:
    """domain -> its reward's stand-in for the paper's (`Domain.stand_in`), the ones set."""
    return {d: self.domains[d].stand_in for d in sorted(self.domains)
            if self.domains[d].stand_in}

  def eval_of(self, domain: str) -> Eval:
    """The evaluation settings of `domain`."""
    return self.eval_settings.get(domain, self.eval)

  def stage(self, name: str):
    return next(s for s in self.stages if s.name == name)


def validate(config, known_verifiers=None, known_formats=None) -> Plan:
  """Checks the whole config and resolves it into a `Plan`.

  Each section checks itself; what is checked here is what refers across
  sections (stages to domains and datasets, domains to datasets and reward
  model stages, lengths to the model).

  Args:
    config: the ConfigDict (or a mapping with the same structure).
    known_verifiers: verifier names that exist (default: `verifiers.names()`).
    known_formats: dataset format name -> record type (default:
      `cascade.data.readers.FORMATS`).

  Returns:
    The `Plan`.

  Raises:
    ConfigError: the first problem found, naming section or stage and field.
  """
  from cascade import kinds  # pylint: disable=g-import-not-at-top
  if known_verifiers is None:
    import verifiers  # pylint: disable=g-import-not-at-top
    known_verifiers = verifiers.names()
  if known_formats is None:
    from cascade.data import readers  # pylint: disable=g-import-not-at-top
    known_formats = {k: v.record_type for k, v in readers.FORMATS.items()}

  # The one conversion of the ConfigDict: plain data from here on (nested sections too).
  cfg = schema.plain(config)
  if not isinstance(cfg, Mapping):
    raise ConfigError(f'config: must be a ConfigDict or a mapping, got {type(config).__name__}')
  cfg = dict(cfg)
  for key in cfg:
    if key not in SECTIONS:
      raise ConfigError(f'config.{key}: unknown section ({schema.nearest(key, SECTIONS)})')
  for section in _REQUIRED_SECTIONS:
    if cfg.get(section) is None:
      raise ConfigError(f'config.{section}: missing section')
  seed = cfg.get('seed')
  if not schema.is_int(seed):
    raise ConfigError(f'config.seed={seed!r}: must be an int')
  model_section = _section(Model, cfg['model'], 'model')
  model = model_section.resolve()
  _check_positions(model)
  tok = _section(Tokenizer, cfg['tokenizer'], 'tokenizer')
  mesh = _section(Mesh, cfg['mesh'], 'mesh')
  _check_expert_axis(mesh.shape, model)
  ckpt = _section(Ckpt, cfg['ckpt'], 'ckpt')
  divergence = _section(Divergence, cfg.get('divergence'), 'divergence')
  raw_eval = cfg['eval']
  ev = _section(Eval, raw_eval, 'eval')
  sampler = _section(Sampler, cfg['sampler'], 'sampler')
  hardware = _section(Hardware, cfg.get('hardware'), 'hardware')
  compilation_cache = _section(CompilationCache, cfg.get('compilation_cache'),
                               'compilation_cache')
  logging = _section(Logging, cfg.get('logging'), 'logging')
  prepare = cfg.get('prepare')
  if prepare is not None:
    prepare = _section(Prepare, prepare, 'prepare')
  datasets = {name: Dataset.parse(name, spec, known_formats)
              for name, spec in (cfg.get('datasets') or {}).items()}
  raw_domains = cfg.get('domains') or {}
  if not raw_domains:
    raise ConfigError('config.domains: no domains')
  names = set(known_verifiers)
  domains = {name: Domain.parse(name, spec, datasets, names)
             for name, spec in raw_domains.items()}
  guard = cfg.get('guard')
  if guard is not None:
    guard = _section(Guard, guard, 'guard')
    guard.check_domains(domains)
  raw = list(cfg.get('stages', []) or [])
  if not raw:
    raise ConfigError('config.stages: the stage list is empty')
  raw = [schema.as_dict(s) for s in raw]
  stages = _parse_stages(kinds, raw, domains, datasets)
  if guard is not None and guard.action == 'repair':
    # The inserted repair stages are stages of the plan (indices, directories, launch.plan's
    # worst case); the config's own list was checked above at its own positions.
    raw = guard.repair_stages(stages, raw)
    stages = _parse_stages(kinds, raw, domains, datasets, own=[st.name for st in stages])
  for st in stages:
    st.check_lengths(model.max_seq_len, schema.failer(st.where, st))
  stages = [st.with_model(model, sampler, schema.failer(st.where, st)) for st in stages]
  eval_settings = _eval_settings(raw_eval, ev, domains)
  _check_suites(ev, model, sampler)
  for d in domains.values():
    if d.reward_model_stage:
      d.check_reward_model(stages, eval_settings[d.name])
    d.check_judge(stages, eval_settings[d.name])
  initial = ev.initial
  if initial == 'auto':
    first = next((s for s in stages if s.ROW), None)
    initial = first is not None and first.SAMPLES
  allow = cfg.get('allow_config_change', False)
  if not isinstance(allow, bool):
    raise ConfigError(f'config.allow_config_change={allow!r}: must be a bool')
  data_cache = cfg.get('data_cache', '') or ''
  if not isinstance(data_cache, str):
    raise ConfigError(f'config.data_cache={data_cache!r}: must be a directory (str)')
  template = tok.template()
  agentic = sorted(d.name for d in domains.values() if d.env)
  if template is not chat_template_lib.BUILTIN and agentic:
    raise ConfigError(f"config.tokenizer.chat_template='checkpoint': domain(s) {agentic} are "
                      'agentic (env=...), whose episodes are rendered turn by turn with the '
                      "built-in template's tool turns; use chat_template='builtin'")
  return Plan(seed=int(seed), model=model,
              model_name=model_section.preset or model_section.hf_path,
              hf_path=model_section.hf_path,
              tokenizer_path=str(tok.path), mesh_shape=mesh.shape, mesh_slices=mesh.slices,
              rules=mesh.logical_rules(),
              sampler=sampler, eval=ev, ckpt=ckpt, divergence=divergence, stages=tuple(stages),
              domains=domains, datasets=datasets, initial_eval=bool(initial), prepare=prepare,
              eval_settings=eval_settings, guard=guard, hardware=hardware,
              compilation_cache=compilation_cache, logging=logging, allow_config_change=allow,
              data_cache=data_cache, source=cfg, chat_template=template)


def _parse_stages(kinds, raw: list[dict], domains, datasets, own=None) -> list:
  """The stage dicts as their kinds' typed configs, each checked against those before it.

  `own`: the names of the config's own stages when `raw` also holds stages the guard inserted
  (None: all are its own); each is seeded by its place among the own ones
  (`StageConfig.seed_key`), so inserting stages changes no other stage's randomness.
  """
  all_names = tuple(s.get('name') for s in raw)
  stages, place = [], -1
  for i, s in enumerate(raw):
    refs = kinds.base.Refs(tuple(stages), all_names, domains, datasets)
    if own is None or s.get('name') in own:
      place += 1
      key = (place,)
    else:
      key = (place, kinds.base.INSERTED)
    stages.append(kinds.parse(i, s, refs, seed_key=key))
  return stages


def _check_suites(ev: Eval, model, sampler: Sampler) -> None:
  """Each suite's completions must fit the model's positions and the sampler's buckets."""
  for name in ev.suites:
    want = ev.suite_settings(name).max_new_tokens
    fix = (f'set config.eval.suite_protocol.{name}.max_new_tokens (results then name the '
           'changed protocol)')
    if want >= model.max_seq_len:
      raise ConfigError(f'config.eval.suites: suite {name!r} samples up to {want} new tokens, '
                        f"more than the model's max_seq_len={model.max_seq_len} holds: {fix}")
    if sampler.new_token_buckets and want > max(sampler.new_token_buckets):
      raise ConfigError(f'config.eval.suites: suite {name!r} samples up to {want} new tokens, '
                        'past config.sampler.new_token_buckets (largest '
                        f'{max(sampler.new_token_buckets)}): add a bucket, or {fix}')


def _eval_settings(raw: dict, ev: Eval, domains) -> dict[str, Eval]:
  """domain -> config.eval with the domain's overrides (checked like config.eval itself)."""
  overrides = dict(schema.plain(ev.domains) or {})
  for d, o in overrides.items():
    where = f'config.eval.domains.{d}'
    if d not in domains:
      raise ConfigError(f'{where}: unknown domain (known: {", ".join(sorted(domains))})')
    for k in schema.plain(o):
      if k not in EVAL_DOMAIN_FIELDS:
        raise ConfigError(f'{where}.{k}: not a per-domain field (those are: '
                          f'{", ".join(EVAL_DOMAIN_FIELDS)})')
  base = {k: v for k, v in raw.items() if k != 'domains'}
  out = {}
  for d in sorted(domains):
    if d in overrides:
      merged = {**base, **dict(schema.plain(overrides[d]))}
      out[d] = schema.from_mapping(Eval, merged, f'config.eval.domains.{d}', sep='.')
    else:
      out[d] = dataclasses.replace(ev, domains=None)
  return out
