"""Multi-turn environments for agentic rollouts, chosen by name (see `envs.base`).

    env = envs.get('tool_use', workers=2)

Environment modules are imported on first use, so importing this package is
cheap (no jax).
"""

from __future__ import annotations

import importlib
from typing import Any

from envs.base import Environment
from envs.base import Episode
from envs.base import Step

_BUILTIN = {
    'tool_use': 'envs.tool_use:ToolUseEnv',
    'swe_agent': 'envs.swe_agent:SweAgentEnv',
}
_registry: dict[str, type[Environment] | str] = dict(_BUILTIN)

__all__ = ['Environment', 'Episode', 'Step', 'get', 'names', 'register', 'cls']


def register(name: str, env_cls: type[Environment]) -> None:
  """Adds an Environment subclass under `name`.

  Raises:
    ValueError: the name is taken or `env_cls` is not an Environment subclass.
  """
  if name in _registry:
    raise ValueError(f'environment {name!r} is already registered')
  if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
    raise ValueError(f'environment {name!r}: {env_cls!r} is not an Environment subclass')
  _registry[name] = env_cls


def names() -> list[str]:
  """Registered environment names."""
  return sorted(_registry)


def cls(name: str) -> type[Environment]:
  """The class registered under `name` (imported on first use)."""
  if name not in _registry:
    raise ValueError(f'unknown environment {name!r}; known: {", ".join(names())}')
  entry = _registry[name]
  if isinstance(entry, str):
    module, attr = entry.split(':')
    entry = getattr(importlib.import_module(module), attr)
    _registry[name] = entry
  return entry


def get(name: str, **options: Any) -> Environment:
  """Builds the environment registered under `name` with its keyword options."""
  return cls(name)(**options)
