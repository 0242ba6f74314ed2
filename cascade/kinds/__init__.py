"""Stage kinds: one module per kind, one registry.

  kind = kinds.get('grpo')            # a base.Kind: config class, runner, loss, abstract batch
  stage = kinds.parse(i, raw, refs)   # a typed, checked stage config

Adding a kind is one module (see `base` for what it defines) and one line in
`KINDS` below; the loop, the config validator and `launch.plan` ask the kind
and never branch on its name.
"""

from __future__ import annotations

from cascade import schema
from cascade.kinds import agentic
from cascade.kinds import base
from cascade.kinds import dpo
from cascade.kinds import eval as eval_kind
from cascade.kinds import grpo
from cascade.kinds import mopd
from cascade.kinds import reward_model
from cascade.kinds import sft

KINDS: dict[str, base.Kind] = {k.name: k for k in (
    sft.KIND, reward_model.KIND, grpo.KIND, mopd.KIND, eval_kind.KIND, dpo.KIND,
    agentic.KIND)}


def get(name: str) -> base.Kind:
  return KINDS[name]


def parse(index: int, raw: dict, refs: base.Refs,
          seed_key: tuple | None = None) -> base.StageConfig:
  """A stage dict as its kind's typed config, checked against the stages before it
  (`seed_key`: `StageConfig.seed_key`; None: (index,)).

  Raises:
    config.ConfigError: naming the stage and the field.
  """
  name = raw.get('name')
  where = f'stages[{index}]' + (f' {name!r}' if isinstance(name, str) and name else '')
  if not isinstance(name, str) or not name:
    raise base.ConfigError(f'{where}: name: missing field')
  if not base._name_ok(name):  # pylint: disable=protected-access
    raise base.ConfigError(f'{where}: name: may hold only letters, digits, _ . -')
  if refs.stage(name) is not None:
    raise base.ConfigError(f'{where}: name: duplicate stage name')
  kind = raw.get('kind')
  if kind not in KINDS:
    raise base.ConfigError(f'{where}: kind={kind!r}: unknown kind (known: '
                           f'{", ".join(KINDS)})')
  cls = KINDS[kind].config
  body = {k: v for k, v in raw.items() if k not in ('name', 'kind')}
  if 'optimizer' in body and body['optimizer'] is not None:
    body['optimizer'] = base.parse_optimizer(body['optimizer'], where)
  stage = base.from_mapping(cls, body, where, fixed=dict(index=index, kind=kind, name=name,
                                       seed_key=(index,) if seed_key is None else seed_key),
                            unknown=f'unknown field for a {kind} stage')
  return stage.resolve(refs, schema.failer(where, stage))
