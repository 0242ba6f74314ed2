"""Parsing of `python -m cascade.evaluate`'s option items (--sampler's KEY=VALUE and
--suite_option's SUITE.KEY=VALUE), apart from the flags so that any program can use them."""

from __future__ import annotations

import json


def scalar(text: str):
  """A --sampler value: an int, a float, true / false / none, else the text."""
  low = text.lower()
  if low in ('true', 'false', 'none'):
    return {'true': True, 'false': False, 'none': None}[low]
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return text


def _value(text: str):
  """A --suite_option value: JSON for an object or a list, else as a --sampler value."""
  if text[:1] in '{[':
    from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
    try:
      return json.loads(text)
    except json.JSONDecodeError as e:
      raise config_lib.ConfigError(f'--suite_option: {text!r} is not JSON ({e.msg})') from None
  return scalar(text)


def suite_options(items) -> dict[str, dict]:
  """suite -> {option: value} of --suite_option's SUITE.KEY=VALUE items.

  Raises:
    cascade.config.ConfigError: an item of another form (one line quoting it).
  """
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  out: dict[str, dict] = {}
  for item in items:
    head, eq, value = item.partition('=')
    suite, dot, key = head.partition('.')
    if not (eq and dot and suite and key):
      raise config_lib.ConfigError(f'--suite_option: {item!r} is not SUITE.KEY=VALUE (e.g. '
                                   'arena_hard_v2.url=http://host:8000/v1)')
    out.setdefault(suite, {})[key] = _value(value)
  return out
