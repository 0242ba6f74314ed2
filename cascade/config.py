"""The cascade's top-level config sections and `validate`, done once before the first step.

A config is an `ml_collections.ConfigDict` (see README, "Config format"):

  config.seed, config.model, config.tokenizer, config.mesh, config.sampler,
  config.ckpt, config.eval, config.datasets, config.domains,
  config.stages (a list of plain stage dicts), config.allow_config_change,
  optionally config.divergence (when a stage has diverged; defaults below),
  and optionally config.hardware (for launch.plan) and config.prepare (a
  step that makes the data the config names, run before it is read).

`validate(config)` checks the whole thing and returns a `Plan`: the model
config resolved, the sharding rules, the sampler and evaluation settings,
and every stage as its kind's typed config (`cascade.kinds`), which is all the
stage loop and `launch.plan` read. Every problem is a `ConfigError` naming the
section or the stage (index and name) and the field, e.g.
`stages[2] 'math_rl': group_size=1: grpo needs G >= 2`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from cascade import config_data
from cascade import paths
from cascade import schema
from cascade.config_data import Dataset, Domain  # pylint: disable=unused-import
from cascade.schema import ConfigError

SECTIONS = ('seed', 'model', 'tokenizer', 'mesh', 'sampler', 'ckpt', 'eval', 'datasets',
            'domains', 'stages', 'allow_config_change', 'hardware', 'prepare', 'divergence')
_REQUIRED_SECTIONS = ('model', 'tokenizer', 'mesh', 'sampler', 'ckpt', 'eval', 'domains',
                      'datasets', 'stages')


def _thinking_ok(v) -> bool:
  return v is None or isinstance(v, bool) or v == 'both'


# config.eval fields a domain may set for itself (config.eval.domains.<name>.<field>).
EVAL_DOMAIN_FIELDS = ('num_samples', 'max_new_tokens', 'max_prompt_len', 'num_prompts',
                      'temperature', 'top_p', 'top_k', 'greedy', 'thinking')


def _domains_ok(v) -> bool:
  v = schema.plain(v)
  return v is None or (isinstance(v, Mapping) and all(
      isinstance(k, str) and isinstance(schema.plain(o), Mapping) for k, o in v.items()))


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
  """
  num_samples: int = schema.field(check=schema.int_at_least(1))
  max_new_tokens: int = schema.field(check=schema.int_at_least(1))
  max_prompt_len: int = schema.field(check=schema.int_at_least(1))
  num_prompts: int = schema.field(check=schema.int_at_least(0))
  batch_size: int = schema.field(check=schema.int_at_least(1))
  temperature: float = schema.field(check=schema.num_in(0, what='must be a number >= 0'),
                                    convert=float)
  top_p: float = schema.field(check=schema.num_in(0, 1, lo_open=True, what='must be in (0, 1]'),
                              convert=float)
  top_k: int = schema.field(0, check=(lambda v: schema.is_int(v) and v >= 0,
                                      'must be an int >= 0 (0 = off)'))
  greedy: bool = schema.field(False, check=schema.BOOL)
  thinking: Any = schema.field(None, check=(
      _thinking_ok, "must be None (no /think switch), True (/think), False (/no_think) or "
                    "'both'"))
  initial: Any = schema.field('auto', check=((lambda v: v in ('auto', True, False)),
                                             "expected 'auto', True or False"))
  log_samples: int = schema.field(2, check=schema.int_at_least(0))
  validation_prompts: int = schema.field(0, check=schema.int_at_least(0))
  eval_every: int = schema.field(0, check=schema.int_at_least(0))
  domains: Any = schema.field(None, check=(
      _domains_ok, 'must be a mapping domain -> {field: value}'))

  @property
  def modes(self) -> tuple:
    """The thinking modes a domain is scored in."""
    return (True, False) if self.thinking == 'both' else (self.thinking,)

  def check(self, fail):
    if not self.greedy and self.temperature <= 0:
      fail('temperature', 'must be > 0 unless config.eval.greedy')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ckpt:
  """config.ckpt: checkpoint every N steps (0: only at stage ends), keep the newest `keep`."""
  every_n_steps: int = schema.field(0, check=schema.int_at_least(0))
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
  learning rate leaves), or when its loss or its gradient norm (before
  clipping) leaves the band set here. Every bad step is reported as it happens
  (stderr, TensorBoard, metrics.jsonl `bad_steps`); a stage whose bad steps
  run past `max_bad_steps` in a row has diverged: it rolls back (`rollbacks`)
  or the run stops without exporting or evaluating its policy
  (`cascade.divergence`).
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
  # Times a diverged stage goes back to its newest checkpoint from before its bad steps and
  # goes on with its learning rate times `rollback_lr_factor` (0: a diverged stage stops the run).
  rollbacks: int = schema.field(0, check=schema.int_at_least(0))
  rollback_lr_factor: float = schema.field(
      0.5, check=schema.num_in(0, 1, lo_open=True, hi_open=True), convert=float)

  def check(self, fail):
    if self.min_loss is not None and self.max_loss is not None and self.min_loss >= self.max_loss:
      fail('min_loss', f'must be below max_loss={self.max_loss:g}')


@dataclasses.dataclass(frozen=True)
class Prepare:
  """config.prepare: `fn` ('package.module:function') called with `kwargs` before data loads."""
  fn: str
  kwargs: Mapping[str, Any]

  def call(self) -> None:
    import importlib  # pylint: disable=g-import-not-at-top
    module, _, attr = self.fn.partition(':')
    getattr(importlib.import_module(module), attr)(**dict(self.kwargs))


@dataclasses.dataclass(frozen=True)
class Plan:
  """The validated config: what the stage loop and launch.plan run.

  Attributes:
    seed: the run's seed.
    model: the policy's `models.config.ModelConfig`.
    hf_path: the HF checkpoint the initial policy loads from ('' = random init).
    tokenizer_path: the tokenizer.
    mesh_shape: (data, fsdp, tensor) or None (one device, no mesh).
    rules: logical sharding rules.
    sampler: keyword options of `rl.sampler.Sampler` (buckets, decode phases).
    eval: the evaluation settings.
    eval_settings: domain -> its evaluation settings (config.eval with the
      domain's overrides from config.eval.domains).
    ckpt: checkpointing.
    divergence: when a training stage has diverged (`cascade.divergence`).
    stages: each stage's typed config (`cascade.kinds`).
    domains, datasets: by name.
    initial_eval: evaluate the starting policy first (row 'init').
    prepare: the data-making step, or None.
  """
  seed: int
  model: Any
  hf_path: str
  tokenizer_path: str
  mesh_shape: tuple | None
  rules: tuple
  sampler: Mapping[str, Any]
  eval: Eval
  ckpt: Ckpt
  divergence: Divergence
  stages: tuple
  domains: Mapping[str, Domain]
  datasets: Mapping[str, Dataset]
  initial_eval: bool
  prepare: Prepare | None = None
  eval_settings: Mapping[str, Eval] = dataclasses.field(default_factory=dict)

  def eval_of(self, domain: str) -> Eval:
    """The evaluation settings of `domain`."""
    return self.eval_settings.get(domain, self.eval)

  def stage(self, name: str):
    return next(s for s in self.stages if s.name == name)


def _get(cfg, key, default=None):
  try:
    return cfg[key] if key in cfg else default
  except TypeError:
    return default


def validate(config, known_verifiers=None, known_formats=None) -> Plan:
  """Checks the whole config and resolves it into a `Plan`.

  Args:
    config: the ConfigDict (or a mapping with the same structure).
    known_verifiers: verifier names that exist (default: `verifiers.names()`).
    known_formats: dataset format name -> record type (default:
      `cascade.data.FORMATS`).

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
    from cascade import data  # pylint: disable=g-import-not-at-top
    known_formats = {k: v.record_type for k, v in data.FORMATS.items()}

  for key in (config.keys() if hasattr(config, 'keys') else ()):
    if key not in SECTIONS:
      raise ConfigError(f'config.{key}: unknown section (known: {", ".join(SECTIONS)})')
  for section in _REQUIRED_SECTIONS:
    if _get(config, section) is None:
      raise ConfigError(f'config.{section}: missing section')
  seed = _get(config, 'seed')
  if not schema.is_int(seed):
    raise ConfigError(f'config.seed={seed!r}: must be an int')
  model, hf_path = _model(config_data.as_dict(config.model))
  tok = config_data.as_dict(config.tokenizer)
  if not tok.get('path'):
    raise ConfigError('config.tokenizer.path: missing (a SentencePiece model or HF tokenizer dir)')
  mesh_shape, rules = _mesh(config_data.as_dict(config.mesh))
  ckpt = schema.from_mapping(Ckpt, config_data.as_dict(config.ckpt), 'config.ckpt', sep='.')
  divergence = schema.from_mapping(Divergence, config_data.as_dict(
      _get(config, 'divergence', {}) or {}), 'config.divergence', sep='.')
  raw_eval = config_data.as_dict(config.eval)
  ev = schema.from_mapping(Eval, raw_eval, 'config.eval', sep='.')
  sampler = _sampler(config_data.as_dict(config.sampler))
  section = lambda key: config_data.as_dict(_get(config, key, {}) or {})
  datasets = config_data.check_datasets(section('datasets'), known_formats)
  domains = config_data.check_domains(section('domains'), datasets, set(known_verifiers))
  raw = list(_get(config, 'stages', []) or [])
  if not raw:
    raise ConfigError('config.stages: the stage list is empty')
  raw = [config_data.as_dict(s) for s in raw]
  all_names = tuple(s.get('name') for s in raw)
  stages = []
  for i, s in enumerate(raw):
    refs = kinds.base.Refs(tuple(stages), all_names, domains, datasets)
    stages.append(kinds.parse(i, s, refs))
  for st in stages:
    st.check_lengths(model.max_seq_len, schema.failer(st.where, st))
  for d in domains.values():
    if d.reward_model_stage:
      config_data.check_rm_reference(d, stages)
  eval_settings = _eval_settings(raw_eval, ev, domains)
  initial = ev.initial
  if initial == 'auto':
    first = next((s for s in stages if s.ROW), None)
    initial = first is not None and first.SAMPLES
  allow = _get(config, 'allow_config_change', False)
  if not isinstance(allow, bool):
    raise ConfigError(f'config.allow_config_change={allow!r}: must be a bool')
  return Plan(seed=int(seed), model=model, hf_path=hf_path, tokenizer_path=str(tok['path']),
              mesh_shape=mesh_shape, rules=rules, sampler=sampler, eval=ev, ckpt=ckpt,
              divergence=divergence,
              stages=tuple(stages), domains=domains, datasets=datasets,
              initial_eval=bool(initial), prepare=_prepare(_get(config, 'prepare')),
              eval_settings=eval_settings)


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


def _model(m: dict):
  from models import config as model_config  # pylint: disable=g-import-not-at-top
  from models import hf  # pylint: disable=g-import-not-at-top
  for k in m:
    if k not in ('preset', 'overrides', 'hf_path'):
      raise ConfigError(f'config.model.{k}: unknown field (known: preset, overrides, hf_path)')
  if not m.get('preset') and not m.get('hf_path'):
    raise ConfigError("config.model: needs 'preset' (e.g. 'tiny') or 'hf_path'")
  if m.get('preset') and m.get('hf_path'):
    raise ConfigError("config.model: give 'preset' or 'hf_path', not both")
  if m.get('hf_path'):
    path = paths.join(m['hf_path'], 'config.json')
    try:
      return hf.config_from_hf(json.loads(paths.read_text(path))), m['hf_path']
    except (OSError, ValueError, KeyError) as e:   # paths.PathError is a ValueError
      raise ConfigError(f'config.model.hf_path: {path}: {type(e).__name__}: {e}') from None
  try:
    return model_config.ModelConfig.preset(m['preset'], **dict(m.get('overrides') or {})), ''
  except (ValueError, TypeError) as e:
    raise ConfigError(f'config.model: {e}') from None


def _mesh(m: dict):
  from models import sharding  # pylint: disable=g-import-not-at-top
  for k in m:
    if k not in ('shape', 'rules'):
      raise ConfigError(f'config.mesh.{k}: unknown field (known: shape, rules)')
  shape = m.get('shape')
  if shape is not None:
    if (not isinstance(shape, (list, tuple)) or len(shape) != 3
        or not all(schema.is_int(s) and (s >= 1 or s == -1) for s in shape)
        or list(shape).count(-1) > 1):
      raise ConfigError(f'config.mesh.shape={shape!r}: must be None or three sizes (data, '
                        'fsdp, tensor), each >= 1, at most one -1')
    shape = tuple(int(s) for s in shape)
  rules = m.get('rules')
  if rules:
    rules = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules)
  else:
    rules = sharding.DEFAULT_RULES
  return shape, rules


def _sampler(s: dict) -> dict:
  from rl import sampler as sampler_lib  # pylint: disable=g-import-not-at-top
  known = ('prompt_buckets', 'new_token_buckets', 'batch_buckets', 'decode_phases',
           'cache_tokens_per_device', 'rollout_rules', 'engine', 'slots', 'page_size', 'pages',
           'chunk_steps', 'prefill_prompts', 'decode_layers')
  for k, v in s.items():
    if k not in known:
      raise ConfigError(f'config.sampler.{k}: unknown field (known: {", ".join(known)})')
    if k == 'decode_layers':
      if v not in sampler_lib.DECODE_LAYERS:
        raise ConfigError(f'config.sampler.decode_layers={v!r}: expected one of '
                          f'{sampler_lib.DECODE_LAYERS}')
      continue
    if k == 'engine':
      if v not in sampler_lib.ENGINES:
        raise ConfigError(f'config.sampler.engine={v!r}: expected one of {sampler_lib.ENGINES}')
      continue
    if k in ('slots', 'page_size', 'pages', 'chunk_steps', 'prefill_prompts'):
      if not (schema.is_int(v) and v >= 1) and not (k in ('slots', 'pages') and v is None):
        raise ConfigError(f'config.sampler.{k}={v!r}: must be an int >= 1')
      continue
    if k == 'rollout_rules':
      pairs = list(v.items()) if isinstance(v, Mapping) else v
      if v is not None and (not isinstance(pairs, (list, tuple)) or not all(
          isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], str)
          for r in pairs)):
        raise ConfigError(f'config.sampler.rollout_rules={v!r}: must be (logical axis, mesh '
                          'axes) pairs, e.g. (("embed", None),)')
      continue
    if k in ('decode_phases', 'cache_tokens_per_device'):
      if not (schema.is_int(v) and v >= 1) and not (k == 'cache_tokens_per_device' and v is None):
        raise ConfigError(f'config.sampler.{k}={v!r}: must be an int >= 1')
    elif v is not None and (not isinstance(v, (list, tuple)) or not v
                            or not all(schema.is_int(x) and x >= 1 for x in v)):
      raise ConfigError(f'config.sampler.{k}={v!r}: must be a non-empty list of ints >= 1')
  del sampler_lib
  out = {k: (tuple(v) if isinstance(v, list) else v) for k, v in s.items()}
  if isinstance(out.get('rollout_rules'), Mapping):
    out['rollout_rules'] = tuple(out['rollout_rules'].items())
  return out


def _prepare(p) -> Prepare | None:
  if p is None:
    return None
  p = config_data.as_dict(p)
  for k in p:
    if k not in ('fn', 'kwargs'):
      raise ConfigError(f'config.prepare.{k}: unknown field (known: fn, kwargs)')
  fn = p.get('fn')
  if not isinstance(fn, str) or fn.count(':') != 1 or not all(fn.split(':')):
    raise ConfigError(f"config.prepare.fn={fn!r}: must be 'package.module:function'")
  return Prepare(fn=fn, kwargs=dict(config_data.as_dict(p.get('kwargs') or {})))
