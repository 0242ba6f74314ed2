"""Kind 'eval': trains nothing; its policy (init_from, or the current one) gets a matrix row.

  dict(name='final', kind='eval', init_from='math_rl')
"""

from __future__ import annotations

import dataclasses

from cascade.kinds import base


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(base.StageConfig):
  """Only the common fields: name, init_from, evaluate."""


def run(ctx, stage: Config) -> base.StageResult:
  del ctx, stage
  return base.StageResult()


KIND = base.Kind('eval', Config, run)
