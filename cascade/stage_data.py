"""The run's records: every dataset loaded and checked once, the held-out sets, each stage's share.

Loading happens before the first step, so a malformed record (named by file
and line) stops the run before anything trains. Prompts too long for a stage
or the evaluation are dropped with a warning that counts them; a stage left
with no records is an error.
"""

from __future__ import annotations

from typing import Callable

from cascade import config as config_lib
from cascade import data as data_lib
from cascade import rollout


def _fit(recs: list, ok: Callable[[dict], bool], what: str, why: str) -> list:
  kept = [r for r in recs if ok(r)]
  if len(kept) < len(recs):
    print(f'WARNING: {what}: dropped {len(recs) - len(kept)} of {len(recs)} records ({why})',
          flush=True)
  if not kept:
    raise ValueError(f'{what}: no records left after dropping {why}')
  return kept


class StageData:
  """Records by dataset, the evaluation sets, and each stage's records.

  Args:
    plan: the validated plan.
    tokenizer: the run's tokenizer (prompt lengths).
    check_metadata: (domain, metadata, where) -> None, raising on records a
      domain's verifiers cannot score.
  """

  def __init__(self, plan: config_lib.Plan, tokenizer, check_metadata):
    self.plan, self.tokenizer = plan, tokenizer
    self._check_metadata = check_metadata
    self._records: dict[str, list] = {}
    self._stage_records: dict[str, list] = {}
    self.eval_sets: dict[str, list] = {}

  def load(self) -> None:
    """Loads and checks every dataset the config uses (errors name file and line)."""
    plan = self.plan
    for name, spec in sorted(plan.datasets.items()):
      used = (any(name in s.datasets for s in plan.stages)
              or any(name in (d.train, d.eval) for d in plan.domains.values()))
      if used:
        self._records[name] = data_lib.load(spec, domains=list(plan.domains),
                                            check_metadata=self._check_metadata)
    ev = plan.eval
    modes = rollout.stage_modes(None if ev.thinking is None else float(ev.thinking))
    for d, dom in sorted(plan.domains.items()):
      recs = [r for r in self._records[dom.eval] if r['domain'] == d]
      recs = _fit(recs, lambda r: rollout.longest_prompt_len(r, self.tokenizer, modes)
                  <= ev.max_prompt_len, f'eval set of domain {d!r}',
                  f'prompts longer than config.eval.max_prompt_len={ev.max_prompt_len}')
      self.eval_sets[d] = recs[:ev.num_prompts] if ev.num_prompts else recs
    for st in plan.stages:
      if st.datasets:
        self.stage_records(st)

  def stage_records(self, stage) -> list:
    """The stage's records (its datasets; its domains' for prompt data), filtered by the kind."""
    if stage.name not in self._stage_records:
      recs = [r for ds in stage.datasets for r in self._records[ds]
              if not stage.BY_DOMAIN or r['domain'] in stage.domains]
      keep = stage.record_filter(self.tokenizer)
      if keep is not None:
        recs = _fit(recs, keep[0], stage.where, keep[1])
      self._stage_records[stage.name] = recs
    return self._stage_records[stage.name]
