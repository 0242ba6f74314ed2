"""XManager-style hyperparameter sweeps for configs' optional `get_hyper(h)`.

A config file may define

    def get_hyper(h):
      return h.product([
          h.sweep('seed', [0, 1, 2]),
          h.zipit([h.sweep('stages[2].optimizer.lr', [1e-6, 2e-6]),
                   h.sweep('stages[2].steps', [200, 100])]),
      ])

where keys are config paths as `--config.<key>=value` accepts them (list
items by `[i]`). Each sweep point is a dict {key: value}.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Sequence

Point = dict[str, Any]


def sweep(key: str, values: Iterable[Any]) -> list[Point]:
  """One point per value of `key`."""
  if not isinstance(key, str) or not key:
    raise ValueError(f'sweep key must be a non-empty string, got {key!r}')
  values = list(values)
  if not values:
    raise ValueError(f'sweep({key!r}, ...) got no values')
  return [{key: v} for v in values]


def product(sweeps: Sequence[list[Point]]) -> list[Point]:
  """Cartesian product of several sweeps (later sweeps vary fastest)."""
  out = []
  for combo in itertools.product(*sweeps):
    point: Point = {}
    for p in combo:
      clash = set(point) & set(p)
      if clash:
        raise ValueError(f'product(): key(s) {sorted(clash)} appear in more than one sweep')
      point.update(p)
    out.append(point)
  return out


def zipit(sweeps: Sequence[list[Point]]) -> list[Point]:
  """Zips sweeps of equal length point by point."""
  lengths = {len(s) for s in sweeps}
  if len(lengths) > 1:
    raise ValueError(f'zipit(): sweeps have different lengths {sorted(lengths)}')
  out = []
  for row in zip(*sweeps):
    point: Point = {}
    for p in row:
      point.update(p)
    out.append(point)
  return out


def fixed(key: str, value: Any) -> list[Point]:
  """A single-point sweep: sets `key` in every point when used inside product()."""
  return [{key: value}]


def point_name(point: Point) -> str:
  """A short, filesystem-safe name for a sweep point."""
  if not point:
    return 'default'
  parts = []
  for k, v in point.items():
    leaf = k.split('.')[-1].replace('[', '').replace(']', '')
    parts.append(f'{leaf}={v}')
  name = ','.join(parts)
  safe = ''.join(c if c.isalnum() or c in '=.,-_' else '_' for c in name)
  return safe[:120]


def format_override(key: str, value: Any) -> str:
  """The `--config.<key>=<value>` flag for a sweep point entry."""
  if isinstance(value, bool):
    text = 'True' if value else 'False'
  elif isinstance(value, (list, tuple)):
    text = repr(tuple(value))
  else:
    text = str(value)
  return f'--config.{key}={text}'
