"""The cascade's config schema and its validation, done once before the first step.

A config is an `ml_collections.ConfigDict` (see README, "Config format"):

  config.seed, config.model, config.tokenizer, config.mesh, config.sampler,
  config.ckpt, config.eval, config.datasets, config.domains,
  config.stages (a list of plain stage dicts), config.allow_config_change.

`validate(config)` checks the whole thing and returns a `Plan`: frozen
dataclasses with every default filled in, which is all the stage loop reads.
Every problem is a `ConfigError` naming the stage (index and name) and the
field, e.g. `stages[2] 'math_rl': group_size=1: grpo needs G >= 2`.

Stages are data: the loop dispatches on `kind` through a registry and never on
a domain's name.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

KINDS = ('sft', 'reward_model', 'grpo', 'mopd', 'eval')
RL_KINDS = ('grpo', 'mopd')
# Kinds whose product is the policy (and so a row of the evaluation matrix).
POLICY_KINDS = ('sft', 'grpo', 'mopd', 'eval')
# Record types a dataset format yields, and which stage kinds read which.
RECORD_TYPES = {'sft': 'sft', 'reward_model': 'preference', 'grpo': 'prompt',
                'mopd': 'prompt', 'eval': 'prompt'}
SCHEDULES = ('constant', 'cosine')
ADVANTAGES = ('grpo', 'dr_grpo', 'rloo')
LOSS_AGGS = ('token', 'seq_mean_token_mean')
KL_ESTIMATORS = ('k1', 'k3')
# Verifiers that take a reward model, and the option its scorer is passed in
# (a domain's `reward_model_stage` supplies it). The training verifier gets it
# whenever it takes one; the evaluation verifier only when it cannot score
# without one (RM_SCORER_REQUIRED), so e.g. IF held-out stays plain IFEval.
RM_SCORER_OPTION = {'reward_model': 'scorer', 'instruction_following': 'rm_scorer'}
RM_SCORER_REQUIRED = ('reward_model',)
_NAME_RE = re.compile(r'^[A-Za-z0-9_.-]+$')
_REQUIRED = object()


class ConfigError(ValueError):
  """A config problem; the message names the stage/section and the field."""


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """AdamW with linear warm-up, then constant or cosine (to min_lr_ratio * lr at the stage's
  end), and global-norm clipping (clip_norm 0 = none); weight decay on matrices only."""
  lr: float
  schedule: str = 'constant'
  warmup_steps: int = 0
  min_lr_ratio: float = 0.0
  clip_norm: float = 1.0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8


@dataclasses.dataclass(frozen=True)
class Phase:
  """A curriculum phase of an RL stage: applies to steps [previous until_step, until_step)."""
  until_step: int
  max_response_len: int
  temperature: float
  filter_overlong: bool


@dataclasses.dataclass(frozen=True)
class Stage:
  """One resolved stage; fields that a kind does not use keep their defaults."""
  index: int
  name: str
  kind: str
  domains: tuple[str, ...] = ()
  datasets: tuple[str, ...] = ()
  init_from: str = ''
  reset_optimizer: bool = True
  evaluate: bool = True
  steps: int = 0
  optimizer: Optimizer | None = None
  microbatches: int = 1
  # sft / reward_model
  batch_size: int = 0
  max_len: int = 0
  thinking_switch: bool = True
  # grpo / mopd
  prompts_per_step: int = 0
  group_size: int = 0
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_prompt_len: int = 0
  max_response_len: int = 0
  phases: tuple[Phase, ...] = ()
  thinking_fraction: float | None = None
  dynamic_filter: bool = True
  refill_cap: int = 4
  filter_overlong: bool = False
  loss_agg: str = 'token'
  advantage: str = 'grpo'
  kl_coef: float = 0.0
  kl_estimator: str = 'k3'
  teachers: Any = 'best'

  def phase_at(self, step: int) -> Phase:
    """The curriculum phase in force at `step` (the last phase past its end)."""
    for p in self.phases:
      if step < p.until_step:
        return p
    return self.phases[-1]

  @property
  def trains_policy(self) -> bool:
    return self.kind in ('sft', 'grpo', 'mopd')

  @property
  def is_policy_stage(self) -> bool:
    return self.kind in POLICY_KINDS


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A named dataset: a file (JSONL/Parquet) or a prepared TFDS dataset, and its format."""
  name: str
  format: str
  record_type: str
  path: str = ''
  tfds_name: str = ''
  split: str = 'train'
  data_dir: str = ''
  domain: str = ''
  limit: int = 0


@dataclasses.dataclass(frozen=True)
class Domain:
  """A domain: its verifiers (training and held-out), datasets, and optional RM stage.

  `eval_verifier` (default: `verifier`) scores the held-out set, so a domain
  trained on a learned reward can be measured by a ground-truth rule.
  """
  name: str
  verifier: str
  verifier_options: Mapping[str, Any]
  train: str
  eval: str
  eval_verifier: str = ''
  eval_verifier_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  reward_model_stage: str = ''


@dataclasses.dataclass(frozen=True)
class Plan:
  """The validated config: what the stage loop runs."""
  stages: tuple[Stage, ...]
  domains: Mapping[str, Domain]
  datasets: Mapping[str, Dataset]
  initial_eval: bool

  def stage(self, name: str) -> Stage:
    return next(s for s in self.stages if s.name == name)


# Fields each stage kind accepts: name -> default (or _REQUIRED).
_COMMON = dict(name=_REQUIRED, kind=_REQUIRED, init_from='', evaluate=True)
_TRAIN = dict(steps=_REQUIRED, optimizer=_REQUIRED, microbatches=1, reset_optimizer=True,
              domains=_REQUIRED, datasets=None)
_RL = dict(prompts_per_step=_REQUIRED, group_size=_REQUIRED, temperature=1.0, top_p=1.0,
           top_k=0, max_prompt_len=_REQUIRED, max_response_len=_REQUIRED, phases=None,
           thinking_fraction=None, dynamic_filter=True, refill_cap=4, filter_overlong=False,
           loss_agg='token')
_FIELDS = {
    'sft': {**_COMMON, **_TRAIN, 'batch_size': _REQUIRED, 'max_len': _REQUIRED,
            'thinking_switch': True},
    'reward_model': {**_COMMON, **_TRAIN, 'batch_size': _REQUIRED, 'max_len': _REQUIRED,
                     'evaluate': False},
    'grpo': {**_COMMON, **_TRAIN, **_RL, 'advantage': 'grpo', 'kl_coef': 0.0,
             'kl_estimator': 'k3'},
    'mopd': {**_COMMON, **_TRAIN, **_RL, 'teachers': 'best', 'dynamic_filter': False},
    'eval': dict(_COMMON),
}
_OPT_FIELDS = {f.name: (f.default if f.default is not dataclasses.MISSING else _REQUIRED)
               for f in dataclasses.fields(Optimizer)}
_PHASE_FIELDS = ('until_step', 'max_response_len', 'temperature', 'filter_overlong')
_DATASET_FIELDS = ('path', 'tfds', 'split', 'data_dir', 'format', 'domain', 'limit')
_DOMAIN_FIELDS = ('verifier', 'verifier_options', 'train', 'eval', 'eval_verifier',
                  'eval_verifier_options', 'reward_model_stage')


def _as_dict(x) -> dict:
  if hasattr(x, 'to_dict'):
    return x.to_dict()
  return dict(x)


def _get(cfg, key, default=None):
  try:
    return cfg[key] if key in cfg else default
  except TypeError:
    return default


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def looks_like_path(ref: str) -> bool:
  """An `init_from` / teacher reference that is a path rather than a stage name."""
  return '/' in ref or ref.startswith('.') or ref.startswith('~') or '://' in ref


def validate(config, known_verifiers=None, known_formats=None) -> Plan:
  """Checks the whole config and resolves the stage list.

  Args:
    config: the ConfigDict (or a mapping with the same structure).
    known_verifiers: verifier names that exist (default: `verifiers.names()`).
    known_formats: dataset format name -> record type (default:
      `cascade.data.FORMATS`).

  Returns:
    The `Plan`.

  Raises:
    ConfigError: the first problem found, naming stage and field.
  """
  if known_verifiers is None:
    import verifiers  # pylint: disable=g-import-not-at-top
    known_verifiers = verifiers.names()
  if known_formats is None:
    from cascade import data  # pylint: disable=g-import-not-at-top
    known_formats = {k: v.record_type for k, v in data.FORMATS.items()}

  _check_top(config)
  datasets = _check_datasets(_as_dict(_get(config, 'datasets', {}) or {}), known_formats)
  domains = _check_domains(_as_dict(_get(config, 'domains', {}) or {}), datasets,
                           set(known_verifiers))
  raw = list(_get(config, 'stages', []) or [])
  if not raw:
    raise ConfigError('config.stages: the stage list is empty')
  all_names = [_as_dict(s).get('name') for s in raw]
  stages = []
  for i, s in enumerate(raw):
    stages.append(_check_stage(i, _as_dict(s), stages, all_names, domains, datasets))
  max_seq = _model_max_seq_len(config)
  for st in stages:
    _check_lengths(st, max_seq)
  for d in domains.values():
    if d.reward_model_stage:
      _check_rm_reference(d, stages)
  ev = _as_dict(config.eval)
  initial = ev.get('initial', 'auto')
  if initial not in ('auto', True, False):
    raise ConfigError(f"config.eval.initial={initial!r}: expected 'auto', True or False")
  first_policy = next((s for s in stages if s.is_policy_stage), None)
  if initial == 'auto':
    initial = first_policy is not None and first_policy.kind in RL_KINDS
  return Plan(stages=tuple(stages), domains=domains, datasets=datasets,
              initial_eval=bool(initial))


def _check_top(config):
  for section in ('model', 'tokenizer', 'mesh', 'sampler', 'ckpt', 'eval', 'domains',
                  'datasets', 'stages'):
    if _get(config, section) is None:
      raise ConfigError(f'config.{section}: missing section')
  seed = _get(config, 'seed')
  if not _is_int(seed):
    raise ConfigError(f'config.seed={seed!r}: must be an int')
  model = _as_dict(config.model)
  if not model.get('preset') and not model.get('hf_path'):
    raise ConfigError("config.model: needs 'preset' (e.g. 'tiny') or 'hf_path'")
  if model.get('preset') and model.get('hf_path'):
    raise ConfigError("config.model: give 'preset' or 'hf_path', not both")
  if model.get('preset'):
    from models import config as model_config  # pylint: disable=g-import-not-at-top
    try:
      model_config.ModelConfig.preset(model['preset'], **dict(model.get('overrides') or {}))
    except (ValueError, TypeError) as e:
      raise ConfigError(f'config.model: {e}') from None
  tok = _as_dict(config.tokenizer)
  if not tok.get('path'):
    raise ConfigError('config.tokenizer.path: missing (a SentencePiece model or HF tokenizer dir)')
  ckpt = _as_dict(config.ckpt)
  every = ckpt.get('every_n_steps', 0)
  if not _is_int(every) or every < 0:
    raise ConfigError(f'config.ckpt.every_n_steps={every!r}: must be an int >= 0')
  keep = ckpt.get('keep', 2)
  if not _is_int(keep) or keep < 1:
    raise ConfigError(f'config.ckpt.keep={keep!r}: must be an int >= 1')
  ev = _as_dict(config.eval)
  for key, check, what in (('num_samples', lambda v: _is_int(v) and v >= 1, 'an int >= 1'),
                           ('max_new_tokens', lambda v: _is_int(v) and v >= 1, 'an int >= 1'),
                           ('max_prompt_len', lambda v: _is_int(v) and v >= 1, 'an int >= 1'),
                           ('num_prompts', lambda v: _is_int(v) and v >= 0, 'an int >= 0'),
                           ('batch_size', lambda v: _is_int(v) and v >= 1, 'an int >= 1'),
                           ('temperature', lambda v: _is_num(v) and v >= 0, 'a number >= 0'),
                           ('top_p', lambda v: _is_num(v) and 0 < v <= 1, 'in (0, 1]')):
    if key not in ev:
      raise ConfigError(f'config.eval.{key}: missing field')
    if not check(ev[key]):
      raise ConfigError(f'config.eval.{key}={ev[key]!r}: must be {what}')
  top_k = ev.get('top_k', 0)
  if not _is_int(top_k) or top_k < 0:
    raise ConfigError(f'config.eval.top_k={top_k!r}: must be an int >= 0 (0 = off)')
  if not ev.get('greedy', False) and ev['temperature'] <= 0:
    raise ConfigError('config.eval.temperature must be > 0 unless config.eval.greedy')
  if ev.get('thinking') not in (None, True, False):
    raise ConfigError(f'config.eval.thinking={ev.get("thinking")!r}: must be None (no /think '
                      'switch), True (/think) or False (/no_think)')
  if not isinstance(ev.get('greedy', False), bool):
    raise ConfigError(f'config.eval.greedy={ev.get("greedy")!r}: must be a bool')


def _check_datasets(raw: dict, known_formats) -> dict[str, Dataset]:
  out = {}
  for name, spec in raw.items():
    where = f'config.datasets.{name}'
    if not _NAME_RE.match(name):
      raise ConfigError(f'{where}: a dataset name may hold only letters, digits, _ . -')
    spec = _as_dict(spec)
    for k in spec:
      if k not in _DATASET_FIELDS:
        raise ConfigError(f'{where}.{k}: unknown field (known: {", ".join(_DATASET_FIELDS)})')
    fmt = spec.get('format')
    if fmt not in known_formats:
      raise ConfigError(f'{where}.format={fmt!r}: unknown format (known: '
                        f'{", ".join(sorted(known_formats))})')
    path, tfds_name = spec.get('path', ''), spec.get('tfds', '')
    if bool(path) == bool(tfds_name):
      raise ConfigError(f"{where}: give exactly one of 'path' (JSONL/Parquet) or 'tfds'")
    limit = spec.get('limit', 0)
    if not _is_int(limit) or limit < 0:
      raise ConfigError(f'{where}.limit={limit!r}: must be an int >= 0')
    out[name] = Dataset(name=name, format=fmt, record_type=known_formats[fmt], path=path,
                        tfds_name=tfds_name, split=spec.get('split', 'train'),
                        data_dir=spec.get('data_dir', ''), domain=spec.get('domain', ''),
                        limit=limit)
  return out


def _check_domains(raw: dict, datasets, verifier_names) -> dict[str, Domain]:
  if not raw:
    raise ConfigError('config.domains: no domains')
  out = {}
  for name, spec in raw.items():
    where = f'config.domains.{name}'
    if not _NAME_RE.match(name):
      raise ConfigError(f'{where}: a domain name may hold only letters, digits, _ . -')
    spec = _as_dict(spec)
    for k in spec:
      if k not in _DOMAIN_FIELDS:
        raise ConfigError(f'{where}.{k}: unknown field (known: {", ".join(_DOMAIN_FIELDS)})')
    ver = spec.get('verifier')
    eval_ver = spec.get('eval_verifier') or ver
    for field, vname in (('verifier', ver), ('eval_verifier', eval_ver)):
      if vname not in verifier_names:
        raise ConfigError(f'{where}.{field}={vname!r}: unknown verifier (known: '
                          f'{", ".join(sorted(verifier_names))})')
    for split in ('train', 'eval'):
      ds = spec.get(split, '')
      if split == 'eval' and not ds:
        raise ConfigError(f'{where}.eval: missing field (every domain needs a held-out set)')
      if ds and ds not in datasets:
        raise ConfigError(f'{where}.{split}={ds!r}: unknown dataset (known: '
                          f'{", ".join(sorted(datasets))})')
      if ds and datasets[ds].record_type != 'prompt':
        raise ConfigError(f'{where}.{split}={ds!r}: format {datasets[ds].format!r} holds '
                          f'{datasets[ds].record_type} records, a domain needs prompts')
    rm_stage = spec.get('reward_model_stage', '') or ''
    if rm_stage and ver not in RM_SCORER_OPTION and eval_ver not in RM_SCORER_OPTION:
      raise ConfigError(f'{where}.reward_model_stage={rm_stage!r}: neither verifier {ver!r} nor '
                        f'eval_verifier {eval_ver!r} takes a reward model (those that do: '
                        f'{", ".join(sorted(RM_SCORER_OPTION))})')
    if not rm_stage and 'reward_model' in (ver, eval_ver):
      raise ConfigError(f"{where}.reward_model_stage: missing field (the 'reward_model' "
                        'verifier scores with the reward model a reward_model stage trains)')
    opts = dict(_as_dict(spec.get('verifier_options') or {}))
    eval_opts = spec.get('eval_verifier_options')
    eval_opts = opts if eval_opts is None and eval_ver == ver else dict(_as_dict(eval_opts or {}))
    out[name] = Domain(name=name, verifier=ver, verifier_options=opts,
                       train=spec.get('train', ''), eval=spec['eval'], eval_verifier=eval_ver,
                       eval_verifier_options=eval_opts, reward_model_stage=rm_stage)
  return out


def _check_stage(i: int, raw: dict, earlier: list[Stage], all_names, domains,
                 datasets) -> Stage:
  name = raw.get('name')
  where = f'stages[{i}]' + (f' {name!r}' if name else '')
  if not isinstance(name, str) or not name:
    raise ConfigError(f'{where}: name: missing field')
  if not _NAME_RE.match(name):
    raise ConfigError(f'{where}: name: may hold only letters, digits, _ . -')
  if any(s.name == name for s in earlier):
    raise ConfigError(f'{where}: name: duplicate stage name')
  kind = raw.get('kind')
  if kind not in KINDS:
    raise ConfigError(f'{where}: kind={kind!r}: unknown kind (known: {", ".join(KINDS)})')
  fields = _FIELDS[kind]
  for k in raw:
    if k not in fields:
      raise ConfigError(f'{where}: {k}: unknown field for a {kind} stage')
  v = {}
  for k, default in fields.items():
    if k in raw and raw[k] is not None:
      v[k] = raw[k]
    elif default is _REQUIRED:
      raise ConfigError(f'{where}: {k}: missing field')
    else:
      v[k] = default

  def fail(field, msg):
    raise ConfigError(f'{where}: {field}={v.get(field)!r}: {msg}')

  def need(field, ok, msg):
    if not ok(v[field]):
      fail(field, msg)

  need('evaluate', lambda x: isinstance(x, bool), 'must be a bool')
  init = v['init_from']
  if not isinstance(init, str):
    fail('init_from', 'must be a string (an earlier stage name or a path)')
  if init and not looks_like_path(init):
    if init == name:
      fail('init_from', 'a stage cannot start from itself')
    if not any(s.name == init for s in earlier):
      what = 'a later stage' if init in all_names else 'an unknown stage'
      fail('init_from', f'names {what}; it must name an earlier stage (or be a path '
                        'with a / to a checkpoint or HF directory)')
    src = next(s for s in earlier if s.name == init)
    if src.kind == 'reward_model':
      fail('init_from', 'is a reward_model stage; stages (reward models too) start from a policy')
  if kind == 'eval':
    return Stage(index=i, name=name, kind=kind, init_from=init, evaluate=v['evaluate'])

  need('steps', lambda x: _is_int(x) and x >= 1, 'must be an int >= 1')
  need('microbatches', lambda x: _is_int(x) and x >= 1, 'must be an int >= 1')
  need('reset_optimizer', lambda x: isinstance(x, bool), 'must be a bool')
  doms = v['domains']
  if isinstance(doms, str) or not isinstance(doms, (list, tuple)) or not doms:
    fail('domains', 'must be a non-empty list of domain names')
  for d in doms:
    if d not in domains:
      fail('domains', f'unknown domain {d!r} (known: {", ".join(sorted(domains))})')
  doms = tuple(doms)
  dsets = v['datasets']
  if dsets is None:
    if kind not in RL_KINDS:
      fail('datasets', f'missing field (a {kind} stage names its datasets)')
    missing = [d for d in doms if not domains[d].train]
    if missing:
      fail('datasets', f'not given, and domain {missing[0]!r} has no train dataset')
    dsets = tuple(domains[d].train for d in doms)
  if isinstance(dsets, str) or not isinstance(dsets, (list, tuple)) or not dsets:
    fail('datasets', 'must be a non-empty list of dataset names')
  for ds in dsets:
    if ds not in datasets:
      fail('datasets', f'unknown dataset {ds!r} (known: {", ".join(sorted(datasets))})')
    want = RECORD_TYPES[kind]
    if datasets[ds].record_type != want:
      fail('datasets', f'dataset {ds!r} holds {datasets[ds].record_type} records; a {kind} '
                       f'stage reads {want} records')
  opt = _check_optimizer(where, v['optimizer'])
  common = dict(index=i, name=name, kind=kind, domains=doms, datasets=tuple(dsets),
                init_from=init, reset_optimizer=v['reset_optimizer'],
                evaluate=v['evaluate'], steps=v['steps'], optimizer=opt,
                microbatches=v['microbatches'])
  if kind in ('sft', 'reward_model'):
    need('batch_size', lambda x: _is_int(x) and x >= 1, 'must be an int >= 1')
    need('max_len', lambda x: _is_int(x) and x >= 2, 'must be an int >= 2')
    if kind == 'reward_model' and v['batch_size'] % v['microbatches']:
      fail('microbatches', f'must divide batch_size={v["batch_size"]}')
    switch = v.get('thinking_switch', True)
    if not isinstance(switch, bool):
      fail('thinking_switch', 'must be a bool')
    return Stage(**common, batch_size=v['batch_size'], max_len=v['max_len'],
                 thinking_switch=switch)

  need('prompts_per_step', lambda x: _is_int(x) and x >= 1, 'must be an int >= 1')
  need('group_size', lambda x: _is_int(x) and x >= 1, 'must be an int >= 1')
  if kind == 'grpo' and v['group_size'] < 2:
    fail('group_size', 'grpo needs G >= 2 (a group of one has no baseline)')
  if (v['prompts_per_step'] * v['group_size']) % v['microbatches']:
    fail('microbatches', 'must divide prompts_per_step * group_size')
  need('temperature', lambda x: _is_num(x) and x > 0, 'must be > 0')
  need('top_p', lambda x: _is_num(x) and 0 < x <= 1, 'must be in (0, 1]')
  need('top_k', lambda x: _is_int(x) and x >= 0, 'must be an int >= 0 (0 = off)')
  need('max_prompt_len', lambda x: _is_int(x) and x >= 1, 'must be an int >= 1')
  need('max_response_len', lambda x: _is_int(x) and x >= 1, 'must be an int >= 1')
  need('thinking_fraction', lambda x: x is None or (_is_num(x) and 0 <= x <= 1),
       'must be None (no /think switch) or a fraction in [0, 1]')
  need('dynamic_filter', lambda x: isinstance(x, bool), 'must be a bool')
  need('refill_cap', lambda x: _is_int(x) and x >= 0, 'must be an int >= 0')
  need('filter_overlong', lambda x: isinstance(x, bool), 'must be a bool')
  need('loss_agg', lambda x: x in LOSS_AGGS, f'unknown loss aggregation (known: {LOSS_AGGS})')
  phases = _check_phases(where, v, v['phases'])
  rl = dict(prompts_per_step=v['prompts_per_step'], group_size=v['group_size'],
            temperature=float(v['temperature']), top_p=float(v['top_p']), top_k=v['top_k'],
            max_prompt_len=v['max_prompt_len'],
            max_response_len=v['max_response_len'], phases=phases,
            thinking_fraction=(None if v['thinking_fraction'] is None
                               else float(v['thinking_fraction'])),
            dynamic_filter=v['dynamic_filter'], refill_cap=v['refill_cap'],
            filter_overlong=v['filter_overlong'], loss_agg=v['loss_agg'])
  if kind == 'grpo':
    need('advantage', lambda x: x in ADVANTAGES,
         f'unknown advantage estimator (known: {ADVANTAGES})')
    need('kl_coef', lambda x: _is_num(x) and x >= 0, 'must be >= 0')
    need('kl_estimator', lambda x: x in KL_ESTIMATORS,
         f'unknown KL estimator (known: {KL_ESTIMATORS})')
    return Stage(**common, **rl, advantage=v['advantage'], kl_coef=float(v['kl_coef']),
                 kl_estimator=v['kl_estimator'])
  teachers = v['teachers']
  if teachers != 'best':
    if not isinstance(teachers, Mapping):
      teachers = _as_dict(teachers) if hasattr(teachers, 'to_dict') else teachers
    if not isinstance(teachers, Mapping):
      fail('teachers', "must be 'best' or a mapping domain -> stage name or path")
    for d in doms:
      if d not in teachers:
        fail('teachers', f'no teacher for domain {d!r}')
    for d, ref in teachers.items():
      if d not in doms:
        fail('teachers', f'domain {d!r} is not one of this stage\'s domains {list(doms)}')
      if not isinstance(ref, str) or not ref:
        fail('teachers', f'teacher of {d!r} must be a stage name or a path')
      if not looks_like_path(ref):
        src = next((s for s in earlier if s.name == ref), None)
        if src is None:
          fail('teachers', f'teacher {ref!r} of {d!r} names no earlier stage')
        if not src.trains_policy:
          fail('teachers', f'teacher {ref!r} of {d!r} is a {src.kind} stage, not a trained policy')
    teachers = dict(teachers)
  elif not any(s.is_policy_stage and s.evaluate for s in earlier):
    fail('teachers', "'best' needs an earlier evaluated policy stage to choose from")
  return Stage(**common, **rl, teachers=teachers)


def _check_optimizer(where: str, raw) -> Optimizer:
  if not isinstance(raw, Mapping) and not hasattr(raw, 'to_dict'):
    raise ConfigError(f'{where}: optimizer: must be a dict with at least lr')
  raw = _as_dict(raw)
  for k in raw:
    if k not in _OPT_FIELDS:
      raise ConfigError(f'{where}: optimizer.{k}: unknown field (known: {", ".join(_OPT_FIELDS)})')
  v = {}
  for k, default in _OPT_FIELDS.items():
    if k in raw:
      v[k] = raw[k]
    elif default is _REQUIRED:
      raise ConfigError(f'{where}: optimizer.{k}: missing field')
    else:
      v[k] = default
  checks = (
      ('lr', lambda x: _is_num(x) and x > 0, 'must be > 0'),
      ('schedule', lambda x: x in SCHEDULES, f'unknown schedule (known: {SCHEDULES})'),
      ('warmup_steps', lambda x: _is_int(x) and x >= 0, 'must be an int >= 0'),
      ('min_lr_ratio', lambda x: _is_num(x) and 0 <= x <= 1, 'must be in [0, 1]'),
      ('clip_norm', lambda x: _is_num(x) and x >= 0, 'must be >= 0 (0 = no clipping)'),
      ('weight_decay', lambda x: _is_num(x) and x >= 0, 'must be >= 0'),
      ('b1', lambda x: _is_num(x) and 0 <= x < 1, 'must be in [0, 1)'),
      ('b2', lambda x: _is_num(x) and 0 <= x < 1, 'must be in [0, 1)'),
      ('eps', lambda x: _is_num(x) and x > 0, 'must be > 0'))
  for k, ok, msg in checks:
    if not ok(v[k]):
      raise ConfigError(f'{where}: optimizer.{k}={v[k]!r}: {msg}')
  return Optimizer(**v)


def _check_phases(where: str, v: dict, raw) -> tuple[Phase, ...]:
  """Resolves the curriculum; without phases, one phase covering the stage."""
  base = dict(max_response_len=v['max_response_len'], temperature=float(v['temperature']),
              filter_overlong=v['filter_overlong'])
  if not raw:
    return (Phase(until_step=v['steps'], **base),)
  if isinstance(raw, (str, Mapping)) or not isinstance(raw, (list, tuple)):
    raise ConfigError(f'{where}: phases: must be a list of dicts')
  out, prev = [], 0
  for j, p in enumerate(raw):
    p = _as_dict(p)
    for k in p:
      if k not in _PHASE_FIELDS:
        raise ConfigError(f'{where}: phases[{j}].{k}: unknown field (known: {_PHASE_FIELDS})')
    if 'until_step' not in p:
      raise ConfigError(f'{where}: phases[{j}].until_step: missing field')
    until = p['until_step']
    if not _is_int(until) or until <= prev:
      raise ConfigError(f'{where}: phases[{j}].until_step={until!r}: phases must end at '
                        f'strictly increasing steps (previous {prev})')
    ph = {**base, **{k: p[k] for k in p if k != 'until_step'}}
    if not _is_int(ph['max_response_len']) or ph['max_response_len'] < 1:
      raise ConfigError(f'{where}: phases[{j}].max_response_len={ph["max_response_len"]!r}: '
                        'must be an int >= 1')
    if ph['max_response_len'] > v['max_response_len']:
      raise ConfigError(f'{where}: phases[{j}].max_response_len={ph["max_response_len"]}: '
                        f'exceeds the stage\'s max_response_len={v["max_response_len"]}')
    if not _is_num(ph['temperature']) or ph['temperature'] <= 0:
      raise ConfigError(f'{where}: phases[{j}].temperature={ph["temperature"]!r}: must be > 0')
    if not isinstance(ph['filter_overlong'], bool):
      raise ConfigError(f'{where}: phases[{j}].filter_overlong: must be a bool')
    out.append(Phase(until_step=until, max_response_len=ph['max_response_len'],
                     temperature=float(ph['temperature']),
                     filter_overlong=ph['filter_overlong']))
    prev = until
  return tuple(out)


def _model_max_seq_len(config) -> int | None:
  model = _as_dict(config.model)
  if not model.get('preset'):
    return None
  from models import config as model_config  # pylint: disable=g-import-not-at-top
  return model_config.ModelConfig.preset(model['preset'],
                                         **dict(model.get('overrides') or {})).max_seq_len


def _check_lengths(st: Stage, max_seq: int | None):
  where = f'stages[{st.index}] {st.name!r}'
  if st.kind in RL_KINDS:
    total = st.max_prompt_len + st.max_response_len
    if max_seq is not None and total > max_seq:
      raise ConfigError(f'{where}: max_response_len={st.max_response_len}: max_prompt_len + '
                        f'max_response_len = {total} exceeds the model\'s max_seq_len={max_seq}')
  if st.kind in ('sft', 'reward_model') and max_seq is not None and st.max_len > max_seq:
    raise ConfigError(f'{where}: max_len={st.max_len}: exceeds the model\'s max_seq_len={max_seq}')


def _check_rm_reference(d: Domain, stages: list[Stage]):
  """A domain scored by a reward model names an earlier reward_model stage."""
  rm = next((s for s in stages if s.name == d.reward_model_stage), None)
  if rm is None or rm.kind != 'reward_model':
    raise ConfigError(f'config.domains.{d.name}.reward_model_stage={d.reward_model_stage!r}: '
                      'names no reward_model stage')
  for s in stages:
    if d.name in s.domains and s.kind in RL_KINDS and s.index < rm.index:
      raise ConfigError(f'stages[{s.index}] {s.name!r}: domains: domain {d.name!r} is scored by '
                        f'reward model stage {rm.name!r}, which comes later')
