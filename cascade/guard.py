"""Regression guards: probes of the earlier domains while a stage trains, and what a fall does.

`config.guard` (`cascade.config.Guard`) names the protected domains. While a stage that trains
the policy runs (`cascade.kinds.loop.train_stage`), the protected domains an earlier stage
trained and this one does not are probed at its first step (the policy it starts from),
every `guard.every` steps and at its last: the first `guard.prompts` prompts of each one's
validation set, sampled with the domain's evaluation settings by the evaluation code
(`evaluation.probe_results`, a fixed key) and scored by its evaluation verifier. Each probe is
an entry of the validation ledger (`cascade.ledger`, set 'probe'), so it survives a resume.

A domain has fallen past its bound when

  best - score > max_drop + stderrs * se

with `best` its best probe so far in the ledger (any earlier stage or step) and `se` the
standard error of the drop. Every probe scores the same prompts with the same key, so two
probes are paired: `se` is the standard error of the mean of the per-prompt differences
(`paired_stderr`, over the prompts both scored; the ledger keeps each probe's per-prompt
scores), far below what the two probes' own errors give when the policies still agree on most
prompts. Where either entry has no per-prompt scores (kept before they were recorded) or they
share fewer than two prompts, `se` is sqrt(stderr_best^2 + stderr^2), as if independent, and
the breach record says so ("paired": false, "se_from"). Then:

- 'warn': one line on stderr and the step's metrics `guard/<domain>` (the drop) and
  `guard/breaches` (domains past their bound);
- 'stop': the stage ends at its newest probed step within every bound (each such step is
  checkpointed and kept by the rotation; step 0: the policy it started from), saved as the
  stage's last step, saying so; the matrix row then scores that policy;
- 'repair': as 'warn' while the stage trains; the MOPD stage config.guard inserted after it
  (`<name>_repair`, `repairs=<name>`: `cascade.config.Guard.repair_stages`) then runs if a
  domain is past its bound at the stage's last probe (`fallen`), on those domains (each
  taught by its best validation checkpoint in the ledger) and the stage's own (taught by
  its final policy), probing the fallen domains as it trains and ending once every one is
  back within bounds, or when its steps (the budget) are spent; else it is skipped (no
  checkpoint, no matrix row; the next stage starts from the repaired stage's policy).

Every probe past a bound is kept in its ledger entry ("breached"), and the stage's record in
progress.json and results.json ("guards") lists them with what was done.

From a stage's second probed step on, each probe also forecasts every protected domain's score
at the stage's last step (`cascade.forecast`: a weighted straight line through the stage's
probes so far, weighted by each probe's own standard error; the pairing is left out there: a
stage's probes have near-equal errors, so the weights hardly change, and the probes' shared
prompts and key make their errors positively correlated, which the line's slope largely
cancels, so the independent end error it reports is if anything too wide, never too narrow),
kept in its ledger entry ("forecast") and the step's metrics
`forecast/<domain>` (the forecast change over the stage). With
`config.guard.forecast_confidence` set, a forecast end more than `max_drop` points below the
domain's best probe with that confidence ("forecast_crossed") acts as an observed fall would
before it happens: 'warn' says so, 'stop' ends the stage at that probe (within every observed
bound, so it is checkpointed and kept); 'repair' says so (its repair is decided by the stage's
last probe, where forecast and observation meet). Repair stages make no forecast. The stage's
record ("guards" -> "forecast") keeps each domain's first forecast beside the outcome (its
last probe's score minus its first; results.json "forecast").

With `config.guard.signals`, each forecast also carries the domain's KL drift and gradient
cosine at its probe (`cascade.signals`: "kl", "grad_cos", the metrics
`forecast/<domain>/kl` and `forecast/<domain>/grad_cos`) and the sign they give it ("falls",
`cascade.forecast.predicts_fall`). They are recorded and reported; the guard's actions still
follow the observed drops and the slope's forecast.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Mapping

import tqdm

from cascade import checkpoint
from cascade import evaluation
from cascade import forecast as forecast_lib
from cascade import ledger as ledger_lib
from cascade import signals as signals_lib


def paired_stderr(best: Mapping[str, float] | None,
                  now: Mapping[str, float] | None) -> tuple[float, int] | None:
  """(the standard error of the mean per-prompt drop `best[p] - now[p]` over the prompts p
  both score, that count), in points; None when either is missing or they share fewer than two
  prompts. The variance is the sample variance (n - 1)."""
  if not best or not now:
    return None
  common = [p for p in best if p in now]
  n = len(common)
  if n < 2:
    return None
  d = [float(best[p]) - float(now[p]) for p in common]
  mean = math.fsum(d) / n
  var = math.fsum((x - mean) ** 2 for x in d) / (n - 1)
  return math.sqrt(var / n), n


def drop_stderr(best: Mapping, domain: str, result: Mapping) -> tuple[float, dict]:
  """The standard error of `domain`'s drop from ledger entry `best` to probe `result`
  (`evaluate`'s, with 'prompt_scores'), and what it came from (the breach record's): paired
  when both have per-prompt scores sharing two prompts or more, else as if independent."""
  paired = paired_stderr((best.get('prompt_scores') or {}).get(domain),
                         result.get('prompt_scores'))
  if paired is not None:
    return paired[0], {'paired': True, 'pairs': paired[1]}
  why = ('the best probe has no per-prompt scores' if not (best.get('prompt_scores') or {})
         .get(domain) else 'this probe has no per-prompt scores'
         if not result.get('prompt_scores') else 'fewer than 2 prompts in common')
  return (math.hypot(best['stderr'].get(domain, 0.0), result.get('stderr', 0.0)),
          {'paired': False, 'se_from': f'independent: {why}'})


def fallen(ledger, stage_name: str) -> dict[str, dict]:
  """domain -> what crossed its bound at stage `stage_name`'s last probe (its end; {}: none,
  or the stage was not probed)."""
  probes = [e for e in ledger.entries(ledger_lib.PROBE) if e['stage'] == stage_name]
  return dict(probes[-1].get('breached') or {}) if probes else {}


class StageGuard:
  """The guards of one stage (`active` False: nothing to probe). A repair stage
  (`repairs`) probes the domains that fell in the stage it repairs (`repairing`)."""

  def __init__(self, ctx, stage):
    self.ctx, self.stage = ctx, stage
    self.forecast: dict[str, dict] = {}
    self.forecast_crossed: dict[str, dict] = {}
    self.cfg = getattr(ctx.plan, 'guard', None)
    self.ledger = getattr(ctx, 'ledger', None)
    earlier = {d for s in ctx.plan.stages[:stage.index] if s.trains_policy for d in s.domains}
    self.protected: tuple[str, ...] = ()
    self.repairing = bool(getattr(stage, 'repairs', ''))
    if (self.cfg is not None and self.ledger is not None and stage.MODEL == 'policy'
        and stage.trains_policy):
      if self.repairing:
        self.protected = tuple(sorted(fallen(self.ledger, stage.repairs)))
      else:
        self.protected = tuple(d for d in self.cfg.domains
                               if d in earlier and d not in stage.domains)
    self.tracker = None
    if self.forecasts and self.cfg.signals:
      self.tracker = signals_lib.Tracker(ctx, stage, self.protected, self.cfg.signals,
                                         self.cfg.prompts, self.cfg.signal_samples)

  @property
  def active(self) -> bool:
    return bool(self.protected)

  @property
  def stops(self) -> bool:
    return self.active and self.cfg.action == 'stop'

  @property
  def forecasts(self) -> bool:
    """Whether this stage forecasts (a guarded stage that is no repair)."""
    return self.active and not self.repairing

  @property
  def acts_on_forecast(self) -> bool:
    """Whether a forecast crossing a bound acts (config.guard.forecast_confidence set)."""
    return self.forecasts and bool(self.cfg.forecast_confidence)

  def forecast_stops(self, crossed: Mapping) -> bool:
    """Whether a probe's forecast crossings (`probe`'s) end the stage ('stop')."""
    return bool(crossed) and self.stops and self.acts_on_forecast

  def due(self, step: int) -> bool:
    """Whether `step` (steps taken) is probed."""
    return self.active and (step == 0 or step == self.stage.steps or step % self.cfg.every == 0)

  def probe(self, step: int, params) -> tuple[dict, dict, dict]:
    """Scores the protected domains on `params` (the policy after `step` steps).

    Returns:
      (results: domain -> `evaluate`'s result, breached: domain -> what crossed its bound,
       metrics: the step's `probe/*`, `guard/*` and `forecast/*` metrics). The forecasts and
       the forecast crossings of this probe are kept in `self.forecast` and
       `self.forecast_crossed` (domain -> ..., {} before the stage's second probed step) until
       `record`.
    """
    t0 = time.perf_counter()
    results = evaluation.probe_results(self.ctx, params, self.cfg.prompts, self.protected)
    entries = [e for e in self.ledger.entries(ledger_lib.PROBE)
               if not (e['stage'] == self.stage.name and e['step'] >= step)]
    breached, m = {}, {}
    for d, r in sorted(results.items()):
      m[f'probe/{d}'] = r['score']
      best = max((e for e in entries if d in e['scores']), key=lambda e: e['scores'][d],
                 default=None)
      if best is None:
        continue
      drop = best['scores'][d] - r['score']
      sigma, how = drop_stderr(best, d, r)
      bound = self.cfg.max_drop + self.cfg.stderrs * sigma
      m[f'guard/{d}'] = drop
      m[f'guard/{d}/se'] = sigma
      if drop > bound:
        breached[d] = {'drop': round(drop, 4), 'bound': round(bound, 4),
                       'se': round(sigma, 4), **how,
                       'score': round(r['score'], 4), 'best': round(best['scores'][d], 4),
                       'best_stage': best['stage'], 'best_step': best['step']}
    m['guard/breaches'] = float(len(breached))
    self.forecast, self.forecast_crossed = self._forecast(step, results, entries)
    if self.tracker is not None and self.forecast:
      self._add_signals(step, params, entries)
    m.update({f'forecast/{d}': f['change'] for d, f in self.forecast.items()})
    m.update(signals_lib.metrics({d: {k: f[k] for k in signals_lib.SIGNALS if k in f}
                                  for d, f in self.forecast.items()}))
    m['probe_s'] = time.perf_counter() - t0
    return results, breached, m

  def _forecast(self, step: int, results: Mapping, entries) -> tuple[dict, dict]:
    """(domain -> its forecast at the stage's last step from this stage's probes before `step`
    and `results`, domain -> what its forecast crossed: a bound crossed with
    config.guard.forecast_confidence, only when that is set)."""
    if not self.forecasts:
      return {}, {}
    mine = [e for e in entries if e['stage'] == self.stage.name and e['step'] < step]
    out, crossed = {}, {}
    for d, r in sorted(results.items()):
      pts = [(e['step'], e['scores'][d], e['stderr'].get(d, 0.0)) for e in mine
             if d in e['scores']] + [(step, r['score'], r.get('stderr', 0.0))]
      if len({p[0] for p in pts}) < 2:
        continue
      fc = forecast_lib.forecast(*zip(*pts), horizon=self.stage.steps)
      out[d] = fc
      best = max((e for e in entries if d in e['scores']), key=lambda e: e['scores'][d],
                 default=None)
      if (best is not None and self.acts_on_forecast and step < self.stage.steps
          and forecast_lib.crosses(fc, best['scores'][d], best['stderr'].get(d, 0.0),
                                   self.cfg.max_drop, self.cfg.forecast_confidence)):
        crossed[d] = {'end': fc['end'], 'end_stderr': fc['end_stderr'],
                      'best': round(best['scores'][d], 4), 'max_drop': self.cfg.max_drop,
                      'confidence': self.cfg.forecast_confidence}
    return out, crossed

  def _add_signals(self, step: int, params, entries) -> None:
    """Adds config.guard.signals (`cascade.signals`) of `params` to this probe's forecasts,
    with the sign they give it ("falls": `cascade.forecast.predicts_fall`, the KL drift compared
    with the stage's previous probe's)."""
    measured = self.tracker.measure(params)
    before = [e for e in entries if e['stage'] == self.stage.name and e['step'] < step]
    for d, fc in self.forecast.items():
      fc.update(measured.get(d, {}))
      prev = (before[-1].get('forecast') or {}).get(d, {}) if before else {}
      fc['falls'] = forecast_lib.predicts_fall(fc['change'], fc['change_stderr'], fc.get('kl'),
                                               prev.get('kl'), fc.get('grad_cos'))

  def record(self, step: int, results: Mapping, breached: Mapping, ckpt: bool) -> None:
    """Keeps the probe in the ledger (with its breaches) and says what crossed a bound."""
    extra = {}
    if breached:
      extra['breached'] = dict(breached)
    if self.forecast:
      extra['forecast'] = dict(self.forecast)
    if self.forecast_crossed:
      extra['forecast_crossed'] = dict(self.forecast_crossed)
    self.ledger.record(self.stage, step, results, kind=ledger_lib.PROBE, ckpt=ckpt,
                       within=not breached, **extra)
    if self.forecast_crossed and checkpoint.is_writer():
      for d, f in sorted(self.forecast_crossed.items()):
        tqdm.tqdm.write(
            f'[{self.stage.index}] {self.stage.name}: guard: {d} is forecast at '
            f'{f["end"]:.1f} ± {f["end_stderr"]:.1f} by step {self.stage.steps} (from its probes '
            f'up to step {step}), more than {f["max_drop"]:.1f} below its best probe '
            f'{f["best"]:.1f} with confidence {f["confidence"]:g}; {self.cfg.action}',
            file=sys.stderr)
    self.forecast, self.forecast_crossed = {}, {}
    if breached and checkpoint.is_writer():
      for d, b in sorted(breached.items()):
        tqdm.tqdm.write(
            f'[{self.stage.index}] {self.stage.name}: guard: {d} fell {b["drop"]:.1f} points at '
            f'step {step}/{self.stage.steps} ({b["score"]:.1f} vs its best probe {b["best"]:.1f} '
            f'at {b["best_stage"]} step {b["best_step"]}), past its bound of {b["bound"]:.1f}; '
            f'{self.cfg.action}', file=sys.stderr)

  def breached_at(self, step: int) -> bool | None:
    """Whether the ledger's probe of `step` of this stage crossed a bound (None: no probe
    there): a stage resumed at a step whose probe decided its end, before it could end."""
    for e in self.ledger.entries(ledger_lib.PROBE):
      if e['stage'] == self.stage.name and e['step'] == step:
        return bool(e.get('breached')
                    or (self.stops and self.acts_on_forecast and e.get('forecast_crossed')))
    return None

  def stop_step(self) -> int:
    """Where a 'stop' goes back to: the stage's newest probed checkpoint within every bound
    (0: none, the policy the stage started from)."""
    within = [e['step'] for e in self.ledger.entries(ledger_lib.PROBE)
              if e['stage'] == self.stage.name and e.get('within') and e.get('ckpt')
              and e['step'] > 0]
    return within[-1] if within else 0

  def info(self, stopped: Mapping | None = None) -> dict:
    """The stage's guard record (progress.json, results.json "guards"): the protected domains,
    its probes, each probe past a bound and, after a stop (or a repair's early end), where."""
    probes = [e for e in self.ledger.entries(ledger_lib.PROBE) if e['stage'] == self.stage.name]
    action = 'repairing' if self.repairing else self.cfg.action
    out = {'protected': list(self.protected), 'action': action, 'probes': len(probes),
           'breaches': [{'step': e['step'], 'domains': dict(e['breached'])}
                        for e in probes if e.get('breached')]}
    forecasts = [e for e in probes if e.get('forecast_crossed')]
    if forecasts:
      out['forecast_crossings'] = [{'step': e['step'], 'domains': dict(e['forecast_crossed'])}
                                   for e in forecasts]
    first = self.first_forecasts(probes)
    if first:
      out['forecast'] = first
    if stopped:
      out['stopped'] = dict(stopped)
    return out

  def first_forecasts(self, probes) -> dict[str, dict]:
    """domain -> the stage's first forecast of it (`cascade.forecast.forecast`'s) with its
    'outcome': the last probe's score minus the first's when the stage was probed at its last
    step (else None: it ended early)."""
    out = {}
    last = probes[-1] if probes and probes[-1]['step'] == self.stage.steps else None
    for e in probes:
      for d, f in sorted((e.get('forecast') or {}).items()):
        if d in out:
          continue
        start = probes[0]['scores'].get(d)
        end = None if last is None else last['scores'].get(d)
        out[d] = dict(f, outcome=None if start is None or end is None
                      else round(end - start, 4))
    return out
