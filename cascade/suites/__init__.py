"""Evaluation suites: the papers' benchmarks with their protocols, one module each, by name.

  suite = suites.get('aime25')        # a base.Suite: reader, prompts, protocol, metric
  suites.names()                      # every registered suite
  suites.register(my_suite)           # a user's own, like a built-in one

Built-in suites are named as 'module:attribute' and imported on first use, so
importing this package is cheap. Adding a suite is one module defining a
`base.Suite` and one line in `_BUILTIN`.
"""

from __future__ import annotations

import importlib

from cascade.suites import base

_BUILTIN: dict[str, str] = {
    'ifeval': 'cascade.suites.instruction:ifeval',
    'ifbench': 'cascade.suites.instruction:ifbench',
    'gpqa_diamond': 'cascade.suites.mcqa:gpqa_diamond',
    'mmlu_pro': 'cascade.suites.mcqa:mmlu_pro',
    'aime24': 'cascade.suites.math:aime24',
    'aime25': 'cascade.suites.math:aime25',
    'hmmt_feb25': 'cascade.suites.math:hmmt_feb25',
    'arena_hard_v1': 'cascade.suites.arena_hard:arena_hard_v1',
    'arena_hard_v2': 'cascade.suites.arena_hard:arena_hard_v2',
    'lcb_v5': 'cascade.suites.livecodebench:lcb_v5',
    'lcb_v6': 'cascade.suites.livecodebench:lcb_v6',
    'swe_bench_verified': 'cascade.suites.swe_bench:swe_bench_verified',
    'swe_bench_verified_agentic': 'cascade.suites.swe_bench_agentic:swe_bench_verified_agentic',
    'bfcl_v3_simple': 'cascade.suites.bfcl:bfcl_v3_simple',
    'bfcl_v3_multiple': 'cascade.suites.bfcl:bfcl_v3_multiple',
    'bfcl_v3_parallel': 'cascade.suites.bfcl:bfcl_v3_parallel',
    'bfcl_v3_parallel_multiple': 'cascade.suites.bfcl:bfcl_v3_parallel_multiple',
    'bfcl_v3_irrelevance': 'cascade.suites.bfcl:bfcl_v3_irrelevance',
    'bfcl_v3_live_simple': 'cascade.suites.bfcl:bfcl_v3_live_simple',
    'bfcl_v3_live_multiple': 'cascade.suites.bfcl:bfcl_v3_live_multiple',
    'bfcl_v3_live_parallel': 'cascade.suites.bfcl:bfcl_v3_live_parallel',
    'bfcl_v3_live_parallel_multiple': 'cascade.suites.bfcl:bfcl_v3_live_parallel_multiple',
    'bfcl_v3_live_irrelevance': 'cascade.suites.bfcl:bfcl_v3_live_irrelevance',
    'bfcl_v3_live_relevance': 'cascade.suites.bfcl:bfcl_v3_live_relevance',
    'ruler_niah_single_8k': 'cascade.suites.ruler:niah_single_8k',
    'ruler_niah_single_16k': 'cascade.suites.ruler:niah_single_16k',
    'ruler_niah_single_32k': 'cascade.suites.ruler:niah_single_32k',
    'ruler_niah_single_64k': 'cascade.suites.ruler:niah_single_64k',
    'ruler_niah_single_128k': 'cascade.suites.ruler:niah_single_128k',
    'ruler_niah_multikey_8k': 'cascade.suites.ruler:niah_multikey_8k',
    'ruler_niah_multikey_16k': 'cascade.suites.ruler:niah_multikey_16k',
    'ruler_niah_multikey_32k': 'cascade.suites.ruler:niah_multikey_32k',
    'ruler_niah_multikey_64k': 'cascade.suites.ruler:niah_multikey_64k',
    'ruler_niah_multikey_128k': 'cascade.suites.ruler:niah_multikey_128k',
    'ruler_vt_8k': 'cascade.suites.ruler:vt_8k',
    'ruler_vt_16k': 'cascade.suites.ruler:vt_16k',
    'ruler_vt_32k': 'cascade.suites.ruler:vt_32k',
    'ruler_vt_64k': 'cascade.suites.ruler:vt_64k',
    'ruler_vt_128k': 'cascade.suites.ruler:vt_128k',
    'ruler_qa_8k': 'cascade.suites.ruler:qa_8k',
    'ruler_qa_16k': 'cascade.suites.ruler:qa_16k',
    'ruler_qa_32k': 'cascade.suites.ruler:qa_32k',
    'ruler_qa_64k': 'cascade.suites.ruler:qa_64k',
    'ruler_qa_128k': 'cascade.suites.ruler:qa_128k',
}

_entries: dict[str, base.Suite | str] = dict(_BUILTIN)

# Modules whose REFUSED dict names benchmarks that are not suites, each with why (e.g. BFCL's
# multi-turn categories): asking for one is that one line rather than 'unknown suite'.
_REFUSALS = ('cascade.suites.bfcl:REFUSED',)


def refusal(name: str) -> str:
  """Why `name`, a benchmark cascade knows of, is not a suite ('' for any other name)."""
  for entry in _REFUSALS:
    module, attr = entry.split(':')
    why = getattr(importlib.import_module(module), attr).get(name)
    if why:
      return why
  return ''


def register(suite: base.Suite) -> None:
  """Adds `suite` under its name.

  Raises:
    ValueError: the name is taken or `suite` is not a `base.Suite`.
  """
  if not isinstance(suite, base.Suite):
    raise ValueError(f'suites.register: {suite!r} is not a cascade.suites.base.Suite')
  if suite.name in _entries:
    raise ValueError(f'suite {suite.name!r} is already registered')
  _entries[suite.name] = suite


def builtin_names() -> list[str]:
  """The suites that ship with cascade (not those a program registered), sorted."""
  return sorted(_BUILTIN)


def names() -> list[str]:
  """Registered suite names, sorted."""
  return sorted(_entries)


def get(name: str) -> base.Suite:
  """The suite registered under `name` (its module imported on first use).

  Raises:
    ValueError: no such suite (the message lists the known ones), or one that cannot be had
      (`refusal`: the message says why).
  """
  if name not in _entries:
    why = refusal(name)
    if why:
      raise ValueError(f'suite {name!r} is not available: {why}')
    raise ValueError(f'unknown suite {name!r}; known: {", ".join(names()) or "(none)"}')
  entry = _entries[name]
  if isinstance(entry, str):
    module, attr = entry.split(':')
    entry = _entries[name] = getattr(importlib.import_module(module), attr)
  return entry
