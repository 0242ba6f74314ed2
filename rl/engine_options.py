"""The paged engine's options (`rl.engine`), declared once: host data without JAX, so a config
(`cascade.config.Sampler`) takes its fields from here without importing the engine."""

from __future__ import annotations

import dataclasses

from rl import fields

DECODE_ROWS = ('live', 'all')


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
