"""The per-domain validation ledger: every scored checkpoint of a run, and each domain's best.

An entry is one policy of the run scored on a domain set:

  {'stage': name, 'index': stage index (-1: the starting policy), 'step': its step,
   'set': 'validation' | 'probe', 'scores': {domain: points}, 'stderr': {domain: points},
   'ckpt': whether the step has a checkpoint, 'final': the stage's end (its matrix row),
   'within': (probes) whether every protected domain was within its guard's bound,
   'prompt_scores': (probes) {domain: {prompt id: points}}, each prompt's score (at most
   MAX_PROMPT_SCORES per domain, rounded to 4 decimals), so the guard compares two probes
   prompt by prompt (`cascade.guard.paired_stderr`); an entry kept before they were recorded
   has none}

The stage ends are the matrix rows' validation scores (progress.json "rows", read here, so a
row is never written twice); the steps in between are the validation a stage scores every
`eval_every` steps (`cascade.kinds.loop`) and the regression guards' probes (`cascade.guard`),
kept in progress.json "ledger" as they are scored, so the ledger survives a resume. A resumed
stage forgets what it had scored after the step it resumes at (`discard_after`: the steps are
done again and score the same), as does a rolled-back one.

`best` is what MOPD's `teachers='best'` chooses from (a domain's best validation checkpoint,
stage ends and intermediate steps alike, ties: the earliest); a checkpoint that is some
domain's best is never deleted by the checkpoint rotation (`pinned`, `StageCheckpoints`).
Probes are scored on a few prompts of each validation set, so they are compared only with
probes (`set`), never with the full validation scores.
"""

from __future__ import annotations

from typing import Mapping, Sequence

VALIDATION = 'validation'
PROBE = 'probe'
# The most per-prompt scores an entry keeps of one domain (its first; a probe scores
# config.guard.prompts): progress.json holds every probe of the run.
MAX_PROMPT_SCORES = 512


def _order(e: Mapping) -> tuple:
  """Entries in run order: by stage, then step (a stage end whose step is unknown last)."""
  step = e.get('step')
  return (e.get('index', -1), float('inf') if step is None else step)


class Ledger:
  """The ledger of one run, over its `checkpoint.Progress` (rows and "ledger")."""

  def __init__(self, progress):
    self.progress = progress

  # ------------------------------------------------------------ reading

  def _final(self, row: Mapping) -> dict:
    info = (getattr(self.progress, 'done', None) or {}).get(row['stage']) or {}
    step = 0 if row.get('index', -1) < 0 else info.get('final_step')
    return {'stage': row['stage'], 'index': row.get('index', -1), 'step': step,
            'set': VALIDATION, 'scores': dict(row['validation']),
            'stderr': dict(row.get('validation_stderr') or {}), 'ckpt': True, 'final': True}

  def entries(self, kind: str | None = None) -> list[dict]:
    """Every entry (of set `kind` when given), in run order."""
    rows = [self._final(r) for r in self.progress.rows if r.get('validation')]
    out = rows + [dict(e) for e in getattr(self.progress, 'ledger', None) or []]
    return sorted((e for e in out if kind is None or e['set'] == kind), key=_order)

  def best(self, domain: str, before: int | None = None, kind: str = VALIDATION,
           entries: Sequence[Mapping] | None = None) -> dict | None:
    """The entry with a checkpoint and the best score of `domain` in set `kind` (ties: the
    earliest), or None; `before`: only stages with a smaller index (the start's is -1)."""
    cands = [e for e in (self.entries(kind) if entries is None else entries)
             if e.get('ckpt') and domain in e['scores']
             and (before is None or e.get('index', -1) < before)]
    return max(cands, key=lambda e: e['scores'][domain]) if cands else None

  def bests(self, domains: Sequence[str], kind: str = VALIDATION) -> dict[str, dict]:
    """domain -> its best entry (`best`), for the domains that have one."""
    entries = self.entries(kind)
    out = {d: self.best(d, kind=kind, entries=entries) for d in domains}
    return {d: e for d, e in out.items() if e is not None}

  def pinned(self, stage_name: str) -> set[int]:
    """The steps of stage `stage_name` the checkpoint rotation must keep: each that is some
    domain's best validation checkpoint, and, while the stage runs, its newest probe step
    within every guard bound (where a guard's `stop` goes back to)."""
    entries = self.entries(VALIDATION)
    domains = {d for e in entries for d in e['scores']}
    out = {e['step'] for d in domains for e in [self.best(d, entries=entries)]
           if e is not None and e['stage'] == stage_name and not e.get('final')}
    within = [e for e in self.entries(PROBE)
              if e['stage'] == stage_name and e.get('within') and e.get('ckpt') and e['step']]
    if within and stage_name not in (getattr(self.progress, 'done', None) or {}):
      out.add(within[-1]['step'])
    return out

  # ------------------------------------------------------------ writing

  def record(self, stage, step: int, results: Mapping[str, Mapping], kind: str = VALIDATION,
             ckpt: bool = True, **extra) -> dict:
    """Adds (or replaces) stage `stage`'s entry of `step` in set `kind` from `evaluate`'s
    results (domain -> {'score', 'stderr', ...}; a probe's also 'prompt_scores', kept) and saves
    progress.json; returns it."""
    e = {'stage': stage.name, 'index': stage.index, 'step': int(step), 'set': kind,
         'scores': {d: float(r['score']) for d, r in sorted(results.items())},
         'stderr': {d: float(r.get('stderr', 0.0)) for d, r in sorted(results.items())},
         'ckpt': bool(ckpt), **extra}
    per = {d: dict(list(r['prompt_scores'].items())[:MAX_PROMPT_SCORES])
           for d, r in sorted(results.items()) if r.get('prompt_scores')}
    if per:
      e['prompt_scores'] = {d: {str(k): round(float(v), 4) for k, v in ps.items()}
                            for d, ps in per.items()}
    kept = [x for x in self.progress.ledger
            if (x['stage'], x['step'], x['set']) != (e['stage'], e['step'], kind)]
    self.progress.ledger = sorted(kept + [e], key=_order)
    self.progress.save()
    return e

  def new_best(self, stage, results: Mapping[str, Mapping]) -> list[str]:
    """The domains for which `results` (a validation of `stage`'s policy) beat every earlier
    validation checkpoint of the run."""
    out = []
    for d, r in sorted(results.items()):
      best = self.best(d)
      if best is None or r['score'] > best['scores'][d]:
        out.append(d)
    return out

  def discard_after(self, stage_name: str, step: int) -> None:
    """Forgets stage `stage_name`'s entries after `step` (a resumed or rolled-back stage
    scores them again)."""
    kept = [e for e in self.progress.ledger
            if e['stage'] != stage_name or e['step'] <= step]
    if len(kept) != len(self.progress.ledger):
      self.progress.ledger = kept
      self.progress.save()

  # ------------------------------------------------------------ results.json

  def summary(self, domains: Sequence[str]) -> dict[str, dict]:
    """results.json "ledger": domain -> its best validation checkpoint (stage, step, score and
    standard error, whether it is a stage end)."""
    return {d: {'stage': e['stage'], 'step': e['step'],
                'validation': round(float(e['scores'][d]), 4),
                'stderr': round(float(e['stderr'].get(d, 0.0)), 4),
                'final': bool(e.get('final'))}
            for d, e in self.bests(domains).items()}


def teacher_record(entry: Mapping, domain: str) -> dict:
  """What results.json says of a MOPD teacher chosen from the ledger (`entry`) for `domain`."""
  return {'stage': entry['stage'], 'step': entry['step'],
          'validation': round(float(entry['scores'][domain]), 4),
          'stderr': round(float(entry['stderr'].get(domain, 0.0)), 4),
          'final': bool(entry.get('final'))}
