"""The run's records: every dataset loaded and checked once, the held-out and validation sets,
each stage's share.

Loading happens before the first step, so a malformed record (named by file
and line) stops the run before anything trains. Prompts too long for a stage
or the evaluation are dropped with a warning that counts them; a stage left
with no records is an error.
"""

from __future__ import annotations

import json
from typing import Callable

from cascade import config as config_lib
from cascade import data as data_lib
from cascade import rollout


def _prompt_key(record: dict) -> str:
  return json.dumps(record['messages'], sort_keys=True, ensure_ascii=True)


def _check_disjoint(domain: str, dom, validation: list, held_out: list) -> None:
  """A validation prompt that is also a held-out prompt would make selection peek at the test."""
  seen = {_prompt_key(r) for r in held_out}
  shared = [r for r in validation if _prompt_key(r) in seen]
  if shared:
    raise data_lib.DataError(
        f'config.domains.{domain}.validation={dom.validation!r}: {len(shared)} of its '
        f'{len(validation)} prompts are also held-out prompts of {dom.eval!r} (e.g. record '
        f'{shared[0]["id"]!r}); the validation set must be disjoint from it')


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
    self.validation_sets: dict[str, list] = {}

  def load(self) -> None:
    """Loads and checks every dataset the config uses (errors name file and line)."""
    plan = self.plan
    for name, spec in sorted(plan.datasets.items()):
      used = (any(name in s.datasets for s in plan.stages)
              or any(name in (d.train, d.eval, d.validation) for d in plan.domains.values()))
      if used:
        self._records[name] = data_lib.load(spec, domains=list(plan.domains),
                                            check_metadata=self._check_metadata)
    for d, dom in sorted(plan.domains.items()):
      ev = plan.eval_of(d)
      self.eval_sets[d] = self._prompts(dom.eval, d, ev, ev.num_prompts, 'eval set')
      if dom.validation:
        self.validation_sets[d] = self._prompts(dom.validation, d, ev, ev.validation_prompts,
                                                'validation set')
        _check_disjoint(d, dom, self.validation_sets[d], self.eval_sets[d])
    for st in plan.stages:
      if st.datasets:
        self.stage_records(st)

  def _prompts(self, dataset: str, domain: str, ev, n: int, what: str) -> list:
    """The domain's records of `dataset` that fit `ev.max_prompt_len` in every eval mode, cut to n."""
    modes = tuple(m for e in ev.modes
                  for m in rollout.stage_modes(None if e is None else float(e)))
    recs = [r for r in self._records[dataset] if r['domain'] == domain]
    recs = _fit(recs, lambda r: rollout.longest_prompt_len(r, self.tokenizer, modes)
                <= ev.max_prompt_len, f'{what} of domain {domain!r}',
                f'prompts longer than config.eval.max_prompt_len={ev.max_prompt_len}')
    return recs[:n] if n else recs

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
