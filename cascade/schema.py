"""Typed configs that check themselves: one field declaration carries its default and its check.

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Eval:
    num_samples: int = schema.field(check=schema.int_at_least(1))

  ev = schema.from_mapping(Eval, raw_dict, 'config.eval', prefix='')

`from_mapping` rejects unknown fields (naming the nearest: a typo in a config
file gets the hint a command-line override gets), names missing ones, runs every field's
check (numbers must be finite: `inf` and `nan` are refused) and then the
class's own `check(fail)` for relations between fields; every problem is one
`ConfigError` line naming where and the field. Used by every section of the
config (`cascade.config`) and by every stage kind (`cascade.kinds`); `as_dict`
is the one conversion of a ConfigDict to plain data.

The check vocabulary (`num_in`, `one_of`, ...) is `rl.fields`', which the
library's option dataclasses declare their fields with (`rl.grpo.GrpoConfig`,
`rl.engine_options.EngineOptions`): `settings` makes a config section's fields of such a
dataclass's, each with the library's own default and check.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Callable, Mapping, Sequence

from rl import fields as fields_lib


class ConfigError(ValueError):
  """A config problem; the message names the stage/section and the field."""


# Passed as the value to a check's `fail(field, message, value)`: the message names no value.
HIDE = object()

# The check vocabulary (predicates and (predicate, message) pairs), the library's.
is_int = fields_lib.is_int
is_num = fields_lib.is_num
int_at_least = fields_lib.int_at_least
num_in = fields_lib.num_in
one_of = fields_lib.one_of
BOOL = fields_lib.BOOL


def field(default: Any = dataclasses.MISSING, *, check: tuple[Callable, str] | None = None,
          convert: Callable | None = None, user: bool = True, none_is_a_value: bool = False):
  """A config field: its default (none = required), check (predicate, message), conversion.

  `user=False` marks a field the validator sets (index, kind); a stage dict
  may not hold it. A None the user gives means "the default", unless
  `none_is_a_value` (a field whose None is one of its choices, with another
  default).
  """
  return fields_lib.field(default, check=check, convert=convert, user=user,
                      none_is_a_value=none_is_a_value)


def settings(cls, *, only: tuple[str, ...] | None = None, leave_out: tuple[str, ...] = (),
             unset: bool = False) -> type:
  """A frozen, keyword-only dataclass with the fields of the library dataclass `cls` (`only`
  those, or all but `leave_out`), each with `cls`'s own default, check and conversion
  (`rl.fields`): the base a config section or stage config takes them from, so each is
  declared once.

    class Config(rl.RLStageConfig, schema.settings(grpo.GrpoConfig, leave_out=(...))):

  Args:
    cls: a dataclass whose fields were declared with `rl.fields.field`.
    only: the fields to take (None: all).
    leave_out: fields the config does not set (the library's default holds, or the config
      derives the value from fields of its own).
    unset: every field defaults to None, "the library's default" (a section whose set fields
      are passed on as keyword arguments); its check applies to a value given.

  Returns:
    The dataclass, for a config class to inherit from.
  """
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(only or ()).union(leave_out) - names)
  if unknown:
    raise TypeError(f'{cls.__name__} has no fields {unknown}')
  specs = []
  for f in dataclasses.fields(cls):
    if f.name in leave_out or (only is not None and f.name not in only):
      continue
    if 'check' not in f.metadata:
      raise TypeError(f'{cls.__name__}.{f.name}: not declared with rl.fields.field')
    default = None if unset else f.default
    kind = hints[f.name] | None if unset else hints[f.name]
    specs.append((f.name, kind, dataclasses.field(default=default, metadata=f.metadata)))
  return dataclasses.make_dataclass(
      f'{cls.__name__}Settings', specs, frozen=True, kw_only=True,
      namespace={'__module__': __name__,
                 '__doc__': f'The fields of `{cls.__module__}.{cls.__name__}` a config sets.'})


def failer(where: str, obj: Any = None, *, sep: str = ': ', prefix: str = ''):
  """`fail(field, message, value=<obj.field>)`: raises one ConfigError line naming where and field.

  Pass `HIDE` as the value for a message that names no value (unknown or missing fields).
  """
  def fail(name: str, msg: str, value: Any = dataclasses.MISSING):
    if value is HIDE:
      raise ConfigError(f'{where}{sep}{prefix}{name}: {msg}')
    value = getattr(obj, name, None) if value is dataclasses.MISSING else value
    if isinstance(value, tuple):
      value = list(value)
    raise ConfigError(f'{where}{sep}{prefix}{name}={value!r}: {msg}')
  return fail


def nearest(key, names: Sequence) -> str:
  """The hint after an unknown name: 'nearest: a, b' (the close matches), else 'known: ...'."""
  names = sorted(set(map(str, names)))
  near = difflib.get_close_matches(str(key), names, n=3, cutoff=0.6)
  if near:
    return 'nearest: ' + ', '.join(near)
  return 'known: ' + (', '.join(names[:24]) + (', ...' if len(names) > 24 else '') or 'none')


def as_dict(x) -> dict:
  """A ConfigDict (or any mapping) as a plain dict: the one conversion of a config to data
  (`ConfigDict.to_dict` converts the nested ones; a plain dict is copied at its top level)."""
  return x.to_dict() if hasattr(x, 'to_dict') else dict(x)


def plain(x):
  """A config value as plain data: a ConfigDict as a dict (`as_dict`), anything else as it is."""
  return as_dict(x) if hasattr(x, 'to_dict') else x


def from_mapping(cls, raw: Mapping, where: str, *, fixed: Mapping | None = None,
                 unknown: str = 'unknown field', prefix: str = '', sep: str = ': '):
  """Builds the frozen config dataclass `cls` from a raw mapping, checking every field.

  Args:
    cls: a dataclass whose fields were declared with `field(...)`.
    raw: the user's dict (or ConfigDict).
    where: the error prefix, e.g. "stages[2] 'math_rl'".
    fixed: values for non-user fields (e.g. index, kind).
    unknown: the message for a field `cls` does not have (the nearest field names follow).
    prefix: prepended to field names in messages (e.g. 'optimizer.').

  Returns:
    The instance; `check(fail)` has already run.

  Raises:
    ConfigError: the first problem, as "<where>: <prefix><field>=<value>: <message>".
  """
  fixed = dict(fixed or {})
  raw = dict(plain(raw))
  fields = {f.name: f for f in dataclasses.fields(cls)}
  for k in raw:
    f = fields.get(k)
    if f is None or not f.metadata.get('user', True):
      users = [n for n, g in fields.items() if g.metadata.get('user', True)]
      raise ConfigError(f'{where}{sep}{prefix}{k}: {unknown} ({nearest(k, users)})')
  values = {}
  for name, f in fields.items():
    if name in fixed:
      values[name] = fixed[name]
      continue
    if not f.metadata.get('user', True):
      continue
    if name in raw and (raw[name] is not None or f.metadata.get('none_is_a_value')):
      v = plain(raw[name])
    elif f.default is not dataclasses.MISSING:
      v = f.default
    else:
      raise ConfigError(f'{where}{sep}{prefix}{name}: missing field')
    why = fields_lib.problem(f, v)
    if why is not None:
      raise ConfigError(f'{where}{sep}{prefix}{name}={v!r}: {why}')
    convert = f.metadata.get('convert')
    values[name] = convert(v) if convert is not None and v is not None else v
  obj = cls(**values)

  check_fn = getattr(obj, 'check', None)
  if check_fn is not None:
    check_fn(failer(where, obj, sep=sep, prefix=prefix))
  return obj
