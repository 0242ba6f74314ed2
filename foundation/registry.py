"""A registry of classes by name whose built-in entries are imported on first use.

Both `verifiers` and `envs` choose a class by a config string; their built-ins
are named as 'module:Class' so that importing either package stays cheap (no
jax, no sympy) and safe in worker processes, and a user's class is added with
`register` like a built-in one.
"""

from __future__ import annotations

import importlib


class Registry:
  """Name -> subclass of `base`; string entries ('module:Class') import lazily.

  Args:
    what: the kind of thing registered, for messages ('verifier').
    base: the class every entry must subclass.
    builtin: name -> 'module:Class' of the built-in entries.
  """

  def __init__(self, what: str, base: type, builtin: dict[str, str]):
    self.what, self.base = what, base
    self._entries: dict[str, type | str] = dict(builtin)

  def register(self, name: str, cls: type) -> None:
    """Adds `cls` under `name`.

    Raises:
      ValueError: the name is taken or `cls` is not a subclass of the base.
    """
    if name in self._entries:
      raise ValueError(f'{self.what} {name!r} is already registered')
    if not (isinstance(cls, type) and issubclass(cls, self.base)):
      raise ValueError(f'{self.what} {name!r}: {cls!r} is not a {self.base.__name__} subclass')
    self._entries[name] = cls

  def names(self) -> list[str]:
    """Registered names, sorted."""
    return sorted(self._entries)

  def cls(self, name: str) -> type:
    """The class registered under `name` (imported on first use).

    Raises:
      ValueError: no such name (the message lists the known ones).
    """
    if name not in self._entries:
      raise ValueError(f'unknown {self.what} {name!r}; known: {", ".join(self.names())}')
    entry = self._entries[name]
    if isinstance(entry, str):
      module, attr = entry.split(':')
      entry = self._entries[name] = getattr(importlib.import_module(module), attr)
    return entry
