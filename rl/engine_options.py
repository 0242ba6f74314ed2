"""The sampler's options and its paged engine's (`rl.sampler`, `rl.engine`), declared once: host
data without JAX, so a config (`cascade.config.Sampler`) takes its fields from here without
importing the sampler."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from rl import fields

DECODE_ROWS = ('live', 'all')
ENGINES = ('one_call', 'paged')
DECODE_LAYERS = ('auto', 'scan', 'unrolled')
# Up to 262,144 tokens: Nemotron-H's positions, and past Qwen3's 131,072 under YaRN (factor 4).
DEFAULT_PROMPT_BUCKETS = tuple(2 ** i for i in range(5, 19))       # 32 ... 262144
DEFAULT_NEW_TOKEN_BUCKETS = tuple(2 ** i for i in range(4, 19))    # 16 ... 262144
DEFAULT_DECODE_PHASES = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineOptions:
  """Shapes of the paged engine, `rl.engine.Engine` (all static: each distinct value compiles
  once).

  Each option is declared here once, with its default and check (`rl.fields`): a
  `rl.sampler.Sampler` takes them as keyword arguments and a config sets them in
  config.sampler (`cascade.config.Sampler`).

  Attributes:
    slots: rows decoded at once (an `Engine` needs it set; a Sampler's None: the rows of one
      one-call chunk).
    page_size: tokens per KV page.
    pages: pages in the pool; None = enough for every slot's longest row
      (no preemption). The pool's memory is pages x page_size token slots.
    chunk_steps: the most decode steps per device call; between calls the
      host refills free slots.
    prefill_prompts: prompts prefilled per device call.
    decode_rows: the rows of a decode call. 'live': the live slots packed into
      the smallest power of two per batch shard that holds them (a long row
      finishing alone does not pay for every slot; up to log2(slots / shards)
      + 1 decode programs, each compiled the first time its size occurs).
      'all': every slot in every call, free ones masked (one decode program,
      the one `launch.plan` compiles; on an accelerator, where a decode step
      is bound by reading the weights and each row's own pages, the idle rows
      cost little). The same tokens either way.
  """
  slots: int | None = fields.field(None, check=fields.int_at_least(1))
  page_size: int = fields.field(16, check=fields.int_at_least(1))
  pages: int | None = fields.field(None, check=fields.int_at_least(1))
  chunk_steps: int = fields.field(32, check=fields.int_at_least(1))
  prefill_prompts: int = fields.field(8, check=fields.int_at_least(1))
  decode_rows: str = fields.field('live', check=((lambda v: v in DECODE_ROWS),
                                                 f'expected one of {DECODE_ROWS}'))

  def __post_init__(self):
    fields.check(self)


def _buckets_ok(v) -> bool:
  return isinstance(v, (list, tuple)) and bool(v) and all(fields.is_int(x) and x >= 1 for x in v)


def _sorted_ints(v) -> tuple[int, ...]:
  return tuple(sorted(int(x) for x in v))


def _pairs(v) -> list:
  return list(v.items()) if isinstance(v, Mapping) else v


def _pairs_ok(v) -> bool:
  pairs = _pairs(v)
  return isinstance(pairs, (list, tuple)) and all(
      isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], str) for r in pairs)


def _rule_pairs(v) -> tuple:
  """(logical axis, mesh axes) pairs as a tuple of tuples (a list of mesh axes as a tuple)."""
  return tuple((str(k), tuple(a) if isinstance(a, list) else a) for k, a in _pairs(v))


_BUCKETS = dict(check=(_buckets_ok, 'must be a non-empty list of ints >= 1'),
                convert=_sorted_ints)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerOptions(EngineOptions):
  """Every option of `rl.sampler.Sampler`: the paged engine's (`EngineOptions`) and the
  sampler's own, each declared here once with its default and check (`rl.fields`); the
  Sampler takes them as keyword arguments and config.sampler sets them
  (`cascade.config.Sampler`). What needs the model or the mesh (ids within the vocabulary,
  rollout rules on known logical axes) the Sampler checks when it is built.

  Attributes:
    prompt_buckets: allowed padded prompt lengths (kept sorted).
    new_token_buckets: allowed cache extents for the new tokens (kept sorted).
    batch_buckets: allowed padded batch sizes; None = powers of two.
    decode_phases: decode loops whose cache extent doubles (1 = one cache throughout).
    cache_tokens_per_device: the most KV-cache slots one device may hold at once; None =
      one call, unchunked.
    rollout_rules: (logical axis, mesh axes) pairs overriding the rules while sampling;
      None = the training layout.
    engine: 'one_call' or 'paged' (continuous batching over a paged KV cache).
    decode_layers: how a decode step runs the blocks: 'scan', 'unrolled' or 'auto' (by the
      devices).
    rollout_cast: sample with a copy of the weights stored in their compute dtype.
  (See `rl.sampler.Sampler` for what each one does.)
  """
  prompt_buckets: tuple[int, ...] = fields.field(DEFAULT_PROMPT_BUCKETS, **_BUCKETS)
  new_token_buckets: tuple[int, ...] = fields.field(DEFAULT_NEW_TOKEN_BUCKETS, **_BUCKETS)
  batch_buckets: tuple[int, ...] | None = fields.field(None, **_BUCKETS)
  decode_phases: int = fields.field(DEFAULT_DECODE_PHASES, check=fields.int_at_least(1))
  cache_tokens_per_device: int | None = fields.field(None, check=fields.int_at_least(1))
  rollout_rules: tuple | None = fields.field(
      None, check=(_pairs_ok, 'must be (logical axis, mesh axes) pairs, e.g. (("embed", None),)'),
      convert=_rule_pairs)
  engine: str = fields.field('one_call', check=((lambda v: v in ENGINES),
                                                f'expected one of {ENGINES}'))
  decode_layers: str = fields.field('auto', check=((lambda v: v in DECODE_LAYERS),
                                                   f'expected one of {DECODE_LAYERS}'))
  rollout_cast: bool = fields.field(True, check=fields.BOOL)

  def __post_init__(self):
    super().__post_init__()
    for f in dataclasses.fields(self):
      convert = f.metadata.get('convert')
      value = getattr(self, f.name)
      if convert is not None and value is not None:
        object.__setattr__(self, f.name, convert(value))

  def engine_options(self) -> EngineOptions:
    """The paged engine's part of these options."""
    return EngineOptions(**{f.name: getattr(self, f.name)
                            for f in dataclasses.fields(EngineOptions)})
