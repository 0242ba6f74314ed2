"""Model families: one module per family, one registry.

  family = families.get('qwen3')        # a base.Family: presets, layer pattern, HF name, ...
  families.register(my_family.FAMILY)   # a family defined outside this package (a test's)

Adding a family is one module (see `base.Family` for what it holds) and one line in
`FAMILIES` below; `ModelConfig` asks the family, and nothing outside models/ branches on
its name (docs/model_families.md, "Adding a model family").
"""

from __future__ import annotations

from models.families import base
from models.families import llama
from models.families import nemotron_h
from models.families import qwen2
from models.families import qwen3
from models.families import qwen3_moe

FAMILIES: dict[str, base.Family] = {f.name: f for f in (
    llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, nemotron_h.FAMILY)}


def get(name: str) -> base.Family:
  """The family named `name`.

  Raises:
    ValueError: naming the field and the known families.
  """
  if name not in FAMILIES:
    raise ValueError(f'ModelConfig.family={name!r}: expected one of {tuple(FAMILIES)}')
  return FAMILIES[name]


def register(family: base.Family) -> base.Family:
  """Adds `family` to the registry (a name already taken is refused); returns it."""
  if family.name in FAMILIES:
    raise ValueError(f'model family {family.name!r} is already registered')
  FAMILIES[family.name] = family
  return family


def unregister(name: str) -> None:
  """Removes a family `register` added (a test's, when it is done)."""
  FAMILIES.pop(name)


def presets() -> dict[str, dict]:
  """Every family's presets: name -> `ModelConfig` keyword arguments."""
  return {name: dict(kw) for f in FAMILIES.values() for name, kw in f.presets.items()}
