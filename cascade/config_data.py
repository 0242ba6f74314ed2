"""config.datasets and config.domains: the records a run reads and the domains that score them.

Part of `cascade.config.validate` (which re-exports `Dataset` and `Domain`): each
problem is one `ConfigError` naming the dataset or domain and the field.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from cascade import schema
from cascade.schema import ConfigError

_NAME_RE = re.compile(r'^[A-Za-z0-9_.-]+$')


def as_dict(x) -> dict:
  """A ConfigDict (or mapping) as a plain dict."""
  if hasattr(x, 'to_dict'):
    return x.to_dict()
  return dict(x)


def _entry(section: str, name: str, spec, fields: tuple) -> tuple[str, dict]:
  """(where, spec as a dict) of `config.<section>.<name>`, its name and field names checked."""
  where = f'config.{section}.{name}'
  if not _NAME_RE.match(name):
    raise ConfigError(f'{where}: a {section[:-1]} name may hold only letters, digits, _ . -')
  spec = as_dict(spec)
  for k in spec:
    if k not in fields:
      raise ConfigError(f'{where}.{k}: unknown field (known: {", ".join(fields)})')
  return where, spec


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
  skip: int = 0


@dataclasses.dataclass(frozen=True)
class Domain:
  """A domain: its verifiers (training and held-out), datasets, and optional RM stage.

  `eval_verifier` (default: `verifier`) scores the held-out set, so a domain
  trained on a learned reward can be measured by a ground-truth rule.
  `validation` (optional) names a prompt dataset disjoint from `eval`: the
  selection set that in-stage validation and MOPD's `teachers='best'` read,
  so that nothing is chosen on the held-out numbers the matrix reports.

  An agentic domain names an environment (`env`, see `envs`) instead of a
  verifier: its rollouts are multi-turn episodes in that environment
  (`cascade.episodes`), which scores them, in training and evaluation alike;
  `max_turns` bounds an episode's assistant turns, `max_turn_tokens` one turn's
  tokens in evaluation (0: the episode's whole budget, `eval.max_new_tokens`),
  and `render_tools` lists the tools' schemas in the opening system turn.
  """
  name: str
  verifier: str
  verifier_options: Mapping[str, Any]
  train: str
  eval: str
  eval_verifier: str = ''
  eval_verifier_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  reward_model_stage: str = ''
  validation: str = ''
  env: str = ''
  env_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  max_turns: int = 8
  max_turn_tokens: int = 0
  render_tools: bool = True

  @property
  def agentic(self) -> bool:
    """Rollouts of this domain are episodes in an environment."""
    return bool(self.env)


_DATASET_FIELDS = ('path', 'tfds', 'split', 'data_dir', 'format', 'domain', 'limit', 'skip')
_DOMAIN_FIELDS = ('verifier', 'verifier_options', 'train', 'eval', 'eval_verifier',
                  'eval_verifier_options', 'reward_model_stage', 'validation', 'env',
                  'env_options', 'max_turns', 'max_turn_tokens', 'render_tools')
_VERIFIER_FIELDS = ('verifier', 'verifier_options', 'eval_verifier', 'eval_verifier_options',
                    'reward_model_stage')



def check_datasets(raw: dict, known_formats) -> dict[str, Dataset]:
  out = {}
  for name, spec in raw.items():
    where, spec = _entry('datasets', name, spec, _DATASET_FIELDS)
    fmt = spec.get('format')
    if fmt not in known_formats:
      raise ConfigError(f'{where}.format={fmt!r}: unknown format (known: '
                        f'{", ".join(sorted(known_formats))})')
    path, tfds_name = spec.get('path', ''), spec.get('tfds', '')
    if bool(path) == bool(tfds_name):
      raise ConfigError(f"{where}: give exactly one of 'path' (JSONL/Parquet) or 'tfds'")
    limit, skip = spec.get('limit', 0), spec.get('skip', 0)
    for k, v in (('limit', limit), ('skip', skip)):
      if not schema.is_int(v) or v < 0:
        raise ConfigError(f'{where}.{k}={v!r}: must be an int >= 0')
    out[name] = Dataset(name=name, format=fmt, record_type=known_formats[fmt], path=path,
                        tfds_name=tfds_name, split=spec.get('split', 'train'),
                        data_dir=spec.get('data_dir', ''), domain=spec.get('domain', ''),
                        limit=limit, skip=skip)
  return out


def _check_env(where: str, spec: dict) -> dict:
  """The agentic fields of a domain that names an environment (its verifier fields are refused)."""
  import envs  # pylint: disable=g-import-not-at-top
  name = spec['env']
  if name not in envs.names():
    raise ConfigError(f'{where}.env={name!r}: unknown environment (known: '
                      f'{", ".join(envs.names())})')
  given = [k for k in _VERIFIER_FIELDS if spec.get(k)]
  if given:
    raise ConfigError(f'{where}.{given[0]}: a domain with an env is scored by its environment; '
                      'give the scoring options in env_options')
  turns = spec.get('max_turns', 8)
  if not schema.is_int(turns) or turns < 1:
    raise ConfigError(f'{where}.max_turns={turns!r}: must be an int >= 1')
  turn_tokens = spec.get('max_turn_tokens', 0)
  if not schema.is_int(turn_tokens) or turn_tokens < 0:
    raise ConfigError(f'{where}.max_turn_tokens={turn_tokens!r}: must be an int >= 0 '
                      "(0 = the episode's whole budget)")
  tools = spec.get('render_tools', True)
  if not isinstance(tools, bool):
    raise ConfigError(f'{where}.render_tools={tools!r}: must be a bool')
  return dict(env=name, env_options=dict(as_dict(spec.get('env_options') or {})),
              max_turns=int(turns), max_turn_tokens=int(turn_tokens), render_tools=tools)


def check_domains(raw: dict, datasets, verifier_names) -> dict[str, Domain]:
  from cascade import verifier_set  # pylint: disable=g-import-not-at-top
  rm_option = verifier_set.RM_SCORER_OPTION
  if not raw:
    raise ConfigError('config.domains: no domains')
  out = {}
  for name, spec in raw.items():
    where, spec = _entry('domains', name, spec, _DOMAIN_FIELDS)
    agent = {}
    if spec.get('env'):
      agent = _check_env(where, spec)
    else:
      for k in ('env_options', 'max_turns', 'max_turn_tokens', 'render_tools'):
        if k in spec:
          raise ConfigError(f'{where}.{k}: only a domain with an env takes it')
    ver = spec.get('verifier')
    if agent:
      ver = ''
    eval_ver = spec.get('eval_verifier') or ver
    for field, vname in (('verifier', ver), ('eval_verifier', eval_ver)):
      if not agent and vname not in verifier_names:
        raise ConfigError(f'{where}.{field}={vname!r}: unknown verifier (known: '
                          f'{", ".join(sorted(verifier_names))})')
    for split in ('train', 'eval', 'validation'):
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
    if rm_stage and ver not in rm_option and eval_ver not in rm_option:
      raise ConfigError(f'{where}.reward_model_stage={rm_stage!r}: neither verifier {ver!r} nor '
                        f'eval_verifier {eval_ver!r} takes a reward model (those that do: '
                        f'{", ".join(sorted(rm_option))})')
    if not rm_stage and 'reward_model' in (ver, eval_ver):
      raise ConfigError(f"{where}.reward_model_stage: missing field (the 'reward_model' "
                        'verifier scores with the reward model a reward_model stage trains)')
    opts = dict(as_dict(spec.get('verifier_options') or {}))
    eval_opts = spec.get('eval_verifier_options')
    eval_opts = opts if eval_opts is None and eval_ver == ver else dict(as_dict(eval_opts or {}))
    out[name] = Domain(name=name, verifier=ver, verifier_options=opts,
                       train=spec.get('train', ''), eval=spec['eval'], eval_verifier=eval_ver,
                       eval_verifier_options=eval_opts, reward_model_stage=rm_stage,
                       validation=spec.get('validation', '') or '', **agent)
    if out[name].validation and out[name].validation == out[name].eval:
      raise ConfigError(f'{where}.validation={out[name].validation!r}: is the held-out set '
                        '(eval); selecting on it would be selecting on the reported numbers')
  return out


def check_rm_reference(d: Domain, stages) -> None:
  """A domain scored by a reward model names an earlier reward_model stage."""
  rm = next((s for s in stages if s.name == d.reward_model_stage), None)
  if rm is None or rm.MODEL != 'reward_model':
    raise ConfigError(f'config.domains.{d.name}.reward_model_stage={d.reward_model_stage!r}: '
                      'names no reward_model stage')
  for s in stages:
    if d.name in s.domains and s.SAMPLES and s.index < rm.index:
      raise ConfigError(f'stages[{s.index}] {s.name!r}: domains: domain {d.name!r} is scored by '
                        f'reward model stage {rm.name!r}, which comes later')
