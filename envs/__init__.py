"""Multi-turn environments for agentic rollouts, chosen by name (see `envs.base`).

    env = envs.get('tool_use', workers=2)

Environment modules are imported on first use, so importing this package is
cheap (no jax).
"""

from __future__ import annotations

from typing import Any

from envs.base import Environment
from envs.base import Episode
from envs.base import Step
from foundation import registry

_BUILTIN = {
    'tool_use': 'envs.tool_use:ToolUseEnv',
    'swe_agent': 'envs.swe_agent:SweAgentEnv',
}
_registry = registry.Registry('environment', Environment, _BUILTIN)

__all__ = ['Environment', 'Episode', 'Step', 'get', 'names', 'register', 'cls']


def register(name: str, env_cls: type[Environment]) -> None:
  """Adds an Environment subclass under `name`.

  Raises:
    ValueError: the name is taken or `env_cls` is not an Environment subclass.
  """
  _registry.register(name, env_cls)


def names() -> list[str]:
  """Registered environment names."""
  return _registry.names()


def cls(name: str) -> type[Environment]:
  """The class registered under `name` (imported on first use)."""
  return _registry.cls(name)


def get(name: str, **options: Any) -> Environment:
  """Builds the environment registered under `name` with its keyword options."""
  return cls(name)(**options)
