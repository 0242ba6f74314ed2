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
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np


class ConfigError(ValueError):
  """A config problem; the message names the stage/section and the field."""


# Passed as the value to a check's `fail(field, message, value)`: the message names no value.
HIDE = object()


def is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_num(v) -> bool:
  """A finite real number (bools, inf and nan are not)."""
  return (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
          and math.isfinite(float(v)))


def int_at_least(lo: int) -> tuple[Callable, str]:
  return (lambda v: is_int(v) and v >= lo), f'must be an int >= {lo}'


def num_in(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False, what: str = '') -> tuple[Callable, str]:
  """A finite-number check with optional (open or closed) bounds."""
  def ok(v):
    if not is_num(v):
      return False
    v = float(v)
    if lo is not None and (v <= lo if lo_open else v < lo):
      return False
    return hi is None or (v < hi if hi_open else v <= hi)
  if what:
    return ok, what
  if lo is not None and hi is None:
    return ok, f'must be a finite number {">" if lo_open else ">="} {lo:g}'
  return ok, (f'must be in {"(" if lo_open else "["}{lo:g}, {hi:g}{")" if hi_open else "]"}')


def one_of(names: Sequence[str], what: str) -> tuple[Callable, str]:
  names = tuple(names)
  return (lambda v: v in names), f'unknown {what} (known: {", ".join(names)})'


BOOL = ((lambda v: isinstance(v, (bool, np.bool_))), 'must be a bool')


def field(default: Any = dataclasses.MISSING, *, check: tuple[Callable, str] | None = None,
          convert: Callable | None = None, user: bool = True, none_is_a_value: bool = False):
  """A config field: its default (none = required), check (predicate, message), conversion.

  `user=False` marks a field the validator sets (index, kind); a stage dict
  may not hold it. A None the user gives means "the default", unless
  `none_is_a_value` (a field whose None is one of its choices, with another
  default).
  """
  meta = dict(check=check, convert=convert, user=user, none_is_a_value=none_is_a_value)
  if isinstance(default, (list, dict)):
    raise TypeError('use tuples / None for config defaults')
  return dataclasses.field(default=default, metadata=meta)


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
    check = f.metadata.get('check')
    if check is not None and not (v is None and f.default is None) and not check[0](v):
      raise ConfigError(f'{where}{sep}{prefix}{name}={v!r}: {check[1]}')
    convert = f.metadata.get('convert')
    values[name] = convert(v) if convert is not None and v is not None else v
  obj = cls(**values)

  check_fn = getattr(obj, 'check', None)
  if check_fn is not None:
    check_fn(failer(where, obj, sep=sep, prefix=prefix))
  return obj
