"""XManager-style hyperparameter sweeps for configs' optional `get_hyper(h)`.

A config file may define

    def get_hyper(h):
      return h.product([
          h.sweep('seed', [0, 1, 2]),
          h.zipit([h.sweep('stages[2].optimizer.lr', [1e-6, 2e-6]),
                   h.sweep('stages[2].steps', [200, 100])]),
      ])

where keys are config paths as `--config.<key>=value` accepts them (list
items by `[i]`, stages also by name: `stages.math_rl.steps`). Each sweep point
is a dict {key: value}. `stages` sweeps one field of every stage of some kinds
at once (the RL stages' learning rates scaled together, their group size),
from the config's own stage list, addressing each stage by its name (a name
stays with its stage when a config argument such as `drop=` moves positions).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Sequence

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


def stages(config, field: str, values: Sequence[Any] | Callable[[dict], Sequence[Any]],
           kinds: Sequence[str] = ('grpo',)) -> list[Point]:
  """One point per value, each setting `field` in every stage of `kinds` (zipped).

  Args:
    config: the config (its `stages` list names the stages and their indices).
    field: a path inside a stage dict, e.g. 'group_size' or 'optimizer.lr'.
    values: the values (the same in every stage), or stage dict -> its values
      (e.g. `lambda st: [st['optimizer']['lr'] * f for f in (0.5, 1, 2)]`),
      the same number for every stage.
    kinds: the stage kinds swept.

  Returns:
    Points {'stages.<name>.<field>': value, ...} over the matching stages.
  """
  found = [dict(st) for st in config.stages if st['kind'] in kinds]
  if not found:
    raise ValueError(f'stages(): the config has no stage of kind {list(kinds)}')
  return zipit([sweep(f'{stage_path(st["name"])}.{field}',
                      values(st) if callable(values) else values) for st in found])


def stage_path(name: str) -> str:
  """The config path of the stage named `name`: 'stages.math_rl', 'stages["math-rl"]'."""
  return f'stages.{name}' if name.isidentifier() else f'stages["{name}"]'



def point_name(point: Point) -> str:
  """A short, filesystem-safe name for a sweep point (keys with one leaf name share a part)."""
  if not point:
    return 'default'
  by_leaf: dict[str, list[str]] = {}
  for k, v in point.items():
    leaf = k.split('.')[-1].replace('[', '').replace(']', '')
    vals = by_leaf.setdefault(leaf, [])
    if str(v) not in vals:
      vals.append(str(v))
  name = ",".join(f"{leaf}={'_'.join(vals)}" for leaf, vals in by_leaf.items())
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
