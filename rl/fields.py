"""Option fields that carry their own default and check, declared once for a library dataclass
and for the config field that sets it.

  @dataclasses.dataclass(frozen=True)
  class GrpoConfig:
    kl_coef: float = fields.field(0.0, check=fields.num_in(0, what='must be >= 0'),
                                  convert=float)

    def __post_init__(self):
      fields.check(self)

A field's check is a (predicate, message) pair; `check` runs every field's in the library's
`__post_init__`, and `cascade.schema` runs the same pair when a config sets the field (its
`settings` derives a config section's fields from such a dataclass), so a knob has one
declaration, one default, one check and one name from the config to the library. `convert`
is what the config applies to a value it reads (e.g. an int given for a float).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np


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
          convert: Callable | None = None, **metadata):
  """A dataclass field with its default (none = required), its check (predicate, message) and
  the conversion a config applies to the value it reads; `metadata` adds keys of its own
  (`cascade.schema.field`'s)."""
  if isinstance(default, (list, dict)):
    raise TypeError('use tuples / None for option defaults')
  return dataclasses.field(default=default,
                           metadata=dict(check=check, convert=convert, **metadata))


def problem(f: dataclasses.Field, value) -> str | None:
  """What is wrong with `value` for field `f` (its check's message), or None. None passes a
  field whose default is None (None is then "off" or "unset")."""
  check = f.metadata.get('check')
  if check is None or (value is None and f.default is None) or check[0](value):
    return None
  return check[1]


def check(obj) -> None:
  """Runs the check of every field of the dataclass instance `obj`.

  Raises:
    ValueError: the first failing field, as '<Class>.<field>=<value>: <message>'.
  """
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    why = problem(f, value)
    if why is not None:
      raise ValueError(f'{type(obj).__name__}.{f.name}={value!r}: {why}')
