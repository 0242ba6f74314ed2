"""The stage x domain matrix: held-out evaluation of every domain, and results.{json,md,png}.

After every policy stage (and, when the cascade starts with RL, for the
starting policy as row 0) each domain's held-out prompts are sampled
`num_samples` times with the config's evaluation settings and scored by the
domain's evaluation verifier. A domain's score is pass@1 averaged over the k
samples, in percent: 100 * mean over prompts and samples of the reward
clipped to [0, 1] (so a -1 "unparsable" reward counts as a failure). An
agentic domain's samples are whole episodes in its environment
(`cascade.episodes`), `max_new_tokens` bounding each episode's tokens after
the opening prompt. After the domains, the row's policy is scored on
config.eval.suites (`score_suites`: the papers' benchmarks, or a world's own, each
by its own protocol: avg@k with its standard error, pass@k; `cascade.suites`).

results.json is

  {"domains": [...], "stages": [...], "stage_domains": [[...], ...], "scores": [[...], ...]}

plus "isolation" ({verifier: 'bwrap' | 'none'}) once a verifier that runs code
has been used, "validation" and "best" when domains have validation sets
(`results`), "suites" and "suite_scores" (per row and suite: value, stderr, k, n,
samples, metric, the protocol's hash, pass@k) when config.eval.suites names any,
"scores_by_mode" when config.eval.thinking is 'both', "ledger" (each domain's best
validation checkpoint, intermediate steps included: `cascade.ledger`), "teachers" (each MOPD
stage's teacher checkpoint per domain), "guards" (what the regression guards saw and did,
`cascade.guard`) and "inserted" (row by row, what a stage the guards inserted repairs and the
drops that made it run; results.md marks its row);
with `stages[i]` the row's stage name ('init' for the starting policy),
`stage_domains[i]` the domains that stage trains on, and `scores[i][j]` the
score of domain j after stage i; results.md is the same table with deltas
against the previous row; results.png draws one line per domain across the
stages (the picture of the Nemotron-Cascade paper's Figure 1).

An evaluation can stop between two batches and go on later from what it kept
(`evaluate`'s `stop` and `done`, `Stopped`): a run preempted while it evaluates
keeps that in `workdir/eval_partial.json` (cascade.runner), and the rerun
samples only the batches not yet done; batch b of a domain uses the same key
whenever it runs, so the row equals an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
import zlib
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from cascade import checkpoint
from cascade import episodes
from cascade import rollout
from cascade import suites as suites_lib
from cascade import verifier_errors
from cascade.data import readers
from cascade.suites import base as suites_base
from cascade.suites import run as suites_run
from cascade.suites import table as suites_table
from foundation import paths
from rl import sampler as sampler_lib


def sampling_params(ev) -> sampler_lib.SamplingParams:
  """The evaluation's SamplingParams from the plan's `config.Eval`."""
  return sampler_lib.SamplingParams(temperature=ev.temperature, top_p=ev.top_p, top_k=ev.top_k,
                                    greedy=ev.greedy, max_new_tokens=ev.max_new_tokens)


MODE_NAMES = {True: 'think', False: 'no_think', None: 'default'}


# Called after each batch an evaluation samples: hook(domain, batch, batches), batch from 1.
# Empty in a run: it is the seam where tests inject faults (tests/faults.py: a signal once a
# chosen batch is scored).
BATCH_END_HOOKS: list[Callable[[str, int, int], None]] = []


class Stopped(Exception):
  """`evaluate` stopped at a batch boundary because its `stop` asked it to.

  Attributes:
    why: what `stop` returned (e.g. 'SIGTERM').
    where: where it stopped, e.g. "domain 'code' before batch 3/8".
    done: what it had evaluated (JSON): `evaluate(..., done=)` goes on from it.
  """

  def __init__(self, why: str, where: str, done: dict):
    super().__init__(f'{why}: stopped at {where}')
    self.why, self.where, self.done = why, where, done


class _Stop(Exception):
  """A batch loop's stop (`_one_mode`): the batch it stopped before, of how many."""

  def __init__(self, why: str, batch: int, batches: int):
    super().__init__(why)
    self.why, self.batch, self.batches, self.mode = why, batch, batches, ''


def _pack(a) -> dict:
  """A batch's array as JSON that `_unpack` turns back into the same array (dtype included)."""
  a = np.asarray(a)
  return {'dtype': a.dtype.str, 'values': a.tolist()}


def _unpack(x: Mapping) -> np.ndarray:
  return np.asarray(x['values'], np.dtype(x['dtype']))


def _one_mode(sampler, params, tokenizer, recs, verifier_of, sample_cls, ev, mode, key,
              batches: list, stop: Callable[[], str | None] | None,
              per_prompt: bool = False) -> dict:
  """Scores one domain's records in one thinking mode (batches of ev.batch_size prompts).

  `batches` holds the batches evaluated so far (JSON; each one is appended as it ends): those a
  stopped evaluation kept are not sampled again. `stop` is asked before each batch still to
  sample; when it answers, `_Stop` is raised there. `per_prompt`: the result also holds
  'per_prompt', each record's score (`prompt_points`), in record order."""
  sp = sampling_params(ev)
  k = 1 if sp.greedy else ev.num_samples      # greedy samples would all agree
  bs = ev.batch_size
  agent = verifier_of(recs[0]['domain']) if recs else None
  own_errors = verifier_errors.VerifierErrors(
      f'evaluation of domain {recs[0]["domain"]!r}' if recs else 'evaluation')
  starts = range(0, len(recs), bs)
  for b, start in enumerate(starts):
    if b < len(batches):
      continue
    why = stop() if stop is not None else None
    if why:
      raise _Stop(why, b, len(starts))
    chunk = recs[start:start + bs]
    if isinstance(agent, episodes.Agent):
      # An agentic domain: whole episodes, `max_new_tokens` bounding each one's tokens.
      turn = min(agent.max_turn_tokens or sp.max_new_tokens, sp.max_new_tokens)
      ro = episodes.generate(sampler, params, tokenizer, agent.env, chunk, [mode] * len(chunk),
                             jax.random.fold_in(key, b),
                             dataclasses.replace(sp, max_new_tokens=turn), k,
                             max_turns=agent.max_turns, max_tokens=sp.max_new_tokens,
                             render_tools=agent.render_tools)
      r, infos = ro.rewards, ro.infos
    else:
      ro = rollout.generate(sampler, params, tokenizer, chunk, [mode] * len(chunk),
                            jax.random.fold_in(key, b), sp, k)
      r, infos = rollout.score(ro, verifier_of, sample_cls)
    own_errors.count(ro.records, infos)
    batches.append({'rewards': _pack(r), 'lengths': _pack(ro.samples.lengths),
                    'truncated': _pack(ro.samples.truncated)})
    for hook in BATCH_END_HOOKS:
      hook(chunk[0]['domain'], b + 1, len(starts))
  r, lens, trunc = (np.concatenate([_unpack(x[f]) for x in batches])
                    for f in ('rewards', 'lengths', 'truncated'))
  out = {'score': float(100.0 * np.mean(np.clip(r, 0.0, 1.0))),
         'stderr': stderr(r, len(recs)),
         'prompts': len(recs), 'samples': int(r.size),
         'mean_reward': float(np.mean(r)),
         'mean_len': float(np.mean(lens)),
         'truncated': float(np.mean(trunc))}
  if per_prompt:
    out['per_prompt'] = prompt_points(r, len(recs))
  return out


def prompt_points(rewards, prompts: int) -> list[float]:
  """Each prompt's score in points (100 x the mean clipped reward of its k samples; rows are
  prompt-major, k per prompt), whose mean is the score `_one_mode` reports."""
  r = np.clip(np.asarray(rewards, np.float64).ravel(), 0.0, 1.0)
  if prompts <= 0 or r.size % prompts:
    raise ValueError(f'{r.size} rewards are not k samples of each of {prompts} prompts')
  return [float(x) for x in 100.0 * r.reshape(prompts, -1).mean(axis=1)]


def stderr(rewards, prompts: int) -> float:
  """The standard error, in points, of a score (`_one_mode`: 100 x the mean clipped reward).

  The k samples of one prompt are not independent draws, so the error is that of the mean of
  the per-prompt means (rows are prompt-major, k per prompt); one prompt: 0 (no spread)."""
  r = np.clip(np.asarray(rewards, np.float64).ravel(), 0.0, 1.0)
  if prompts > 0 and r.size % prompts == 0:
    r = r.reshape(prompts, -1).mean(axis=1)
  if r.size < 2:
    return 0.0
  return float(100.0 * np.std(r, ddof=1) / np.sqrt(r.size))


def evaluate(sampler, params, tokenizer, eval_sets: Mapping[str, Sequence[dict]],
             verifier_of: Callable[[str], object], sample_cls, ev,
             rng, report: Callable[[int, int, str, dict, float], None] | None = None,
             done: Mapping | None = None, stop: Callable[[], str | None] | None = None,
             per_prompt: bool = False) -> dict[str, dict]:
  """Scores a policy on every domain's prompts (held-out or validation).

  It can stop at a batch boundary and go on later: `stop` is asked before every batch it
  samples, and when it answers (e.g. 'SIGTERM') `Stopped` carries what was evaluated;
  `evaluate(..., done=that)` of the same policy and settings then samples only the rest and
  returns what one uninterrupted call returns (batch b's key is the same whenever it runs).

  Args:
    sampler: an `rl.sampler.Sampler` for the policy's architecture.
    params: the policy's params.
    tokenizer: the tokenizer.
    eval_sets: domain -> prompt records (already cut to num_prompts).
    verifier_of: domain -> its evaluation verifier.
    sample_cls: `verifiers.Sample`.
    ev: a `cascade.config.Eval` for every domain, or a mapping domain -> Eval
      (the plan's `eval_settings`: num_samples, temperature, top_p, top_k,
      greedy, max_new_tokens, batch_size, thinking).
    rng: PRNG key; batch b of domain d uses fold_in(fold_in(rng, crc32(d)), b),
      so a domain's samples do not depend on which other domains are scored;
      with thinking='both' mode i's batches fold in i first.
    report: called after each domain it evaluates with (i, n, domain, its result, seconds),
      i from 1: the run's progress line.
    done: what a stopped call had evaluated (`Stopped.done`): its domains and batches are kept.
    stop: asked before each batch; an answer stops the call there (`Stopped`).
    per_prompt: each result also holds 'per_prompt': every prompt's score in points
      (`prompt_points`; with thinking='both' the mean of its two modes'), in `eval_sets` order.

  Returns:
    domain -> {'score' in [0, 100], 'stderr' (its standard error, `stderr`), 'prompts',
    'samples', 'mean_reward', 'mean_len', 'truncated'}; with thinking='both' these are the means over
    the two modes, and 'modes' holds {'think': {...}, 'no_think': {...}}.

  Raises:
    Stopped: `stop` answered (before a batch; what was evaluated is in it).
  """
  # domain -> {'result': ...} once evaluated, else {'modes': {mode: [batch, ...]}} (JSON).
  state = {d: json.loads(json.dumps(v)) for d, v in (done or {}).items() if d in eval_sets}
  out = {}
  prepare = getattr(sampler, 'prepare', None)   # the rollout copy, made once for every domain
  for i, domain in enumerate(sorted(eval_sets), 1):
    if 'result' in state.get(domain, {}):
      out[domain] = state[domain]['result']
      continue
    if prepare is not None:
      params, prepare = prepare(params), None
    t0 = time.perf_counter()
    modes = state.setdefault(domain, {'modes': {}})['modes']
    try:
      out[domain] = _one_domain(sampler, params, tokenizer, eval_sets[domain], verifier_of,
                                sample_cls, ev[domain] if isinstance(ev, Mapping) else ev,
                                jax.random.fold_in(rng, zlib.crc32(domain.encode()) & 0x7FFFFFFF),
                                modes, stop, per_prompt)
    except _Stop as e:
      mode = f' ({e.mode} mode)' if e.mode else ''
      raise Stopped(e.why, f'domain {domain!r}{mode} before batch {e.batch + 1}/{e.batches}',
                    state) from None
    state[domain] = {'result': out[domain]}
    if report is not None:
      report(i, len(eval_sets), domain, out[domain], time.perf_counter() - t0)
  return out


def _one_domain(sampler, params, tokenizer, recs, verifier_of, sample_cls, dev,
                domain_key, batches: dict, stop, per_prompt: bool = False) -> dict:
  """`evaluate` of one domain: its one mode, or the mean of its two; `batches`: mode name ->
  the batches evaluated so far (`_one_mode`)."""
  recs = list(recs)
  modes = dev.modes

  def one(m, key):
    try:
      return _one_mode(sampler, params, tokenizer, recs, verifier_of, sample_cls, dev, m, key,
                       batches.setdefault(MODE_NAMES[m], []), stop, per_prompt)
    except _Stop as e:
      e.mode = MODE_NAMES[m] if len(modes) > 1 else ''
      raise

  if len(modes) == 1:
    return one(modes[0], domain_key)
  per = {MODE_NAMES[m]: one(m, jax.random.fold_in(domain_key, i)) for i, m in enumerate(modes)}
  means = {k: float(np.mean([p[k] for p in per.values()]))
           for k in ('score', 'mean_reward', 'mean_len', 'truncated')}
  # The mean of the two modes' scores (same prompts, sampled independently per mode).
  means['stderr'] = float(np.sqrt(sum(p['stderr'] ** 2 for p in per.values())) / len(per))
  if per_prompt:    # each prompt's mean over the two modes, as the score is
    means['per_prompt'] = [float(x) for x in
                           np.mean([p.pop('per_prompt') for p in per.values()], axis=0)]
  return {**means, 'prompts': len(recs),
          'samples': sum(p['samples'] for p in per.values()), 'modes': per}


# Keys of the held-out and the validation evaluations (fold_in of PRNGKey(seed)): one key for
# every row, so rows differ by their policy only, not by sampling noise.
HELD_OUT_FOLD = 1_000_003
VALIDATION_FOLD = 1_000_033


def score_sets(ctx, params, sets: Mapping[str, Sequence[dict]], fold: int,
               report: Callable[[int, int, str, dict, float], None] | None = None,
               done: Mapping | None = None, stop: Callable[[], str | None] | None = None,
               per_prompt: bool = False) -> dict[str, dict]:
  """`evaluate` of a run's policy on `sets` (domains whose eval verifier is ready), per domain;
  `report`, `done`, `stop` and `per_prompt` as `evaluate`'s."""
  ready = {d: recs for d, recs in sets.items() if ctx.verifiers.can_evaluate(d)}
  if not ready:
    return {}
  key = jax.random.fold_in(jax.random.PRNGKey(ctx.plan.seed), fold)
  return evaluate(ctx.sampler, params, ctx.tokenizer, ready, ctx.verifiers.eval_verifier,
                  ctx.sample_cls, {d: ctx.plan.eval_of(d) for d in ready}, key, report,
                  done=done, stop=stop, per_prompt=per_prompt)


def validation_results(ctx, params, done: Mapping | None = None,
                       stop: Callable[[], str | None] | None = None) -> dict[str, dict]:
  """domain -> `evaluate`'s result of `params` on its validation set (score, stderr, ...;
  empty when no domain has a validation set); `done` and `stop` as `evaluate`'s."""
  out = score_sets(ctx, params, ctx.data.validation_sets, VALIDATION_FOLD, done=done, stop=stop)
  return {d: out[d] for d in sorted(out)}


def validation_scores(ctx, params, done: Mapping | None = None,
                      stop: Callable[[], str | None] | None = None) -> dict[str, float]:
  """domain -> validation score of `params` (`validation_results`' scores)."""
  return {d: r['score'] for d, r in validation_results(ctx, params, done, stop).items()}


# The key of the guards' probes (`cascade.guard`): a fixed subset of each validation set, the
# same key at every probe, so two probes differ by their policy only.
PROBE_FOLD = 1_000_037


def probe_results(ctx, params, prompts: int, domains) -> dict[str, dict]:
  """domain -> `evaluate`'s result of `params` on the first `prompts` prompts of each of
  `domains`' validation sets (a regression guard's probe, `cascade.guard`), with
  'prompt_scores': prompt id -> its score in points (`prompt_ids`), so two probes of the same
  prompts compare prompt by prompt."""
  sets = {d: list(ctx.data.validation_sets[d])[:prompts] for d in domains
          if d in ctx.data.validation_sets}
  out = score_sets(ctx, params, sets, PROBE_FOLD, per_prompt=True)
  for d, r in out.items():
    r['prompt_scores'] = dict(zip(prompt_ids(sets[d]), r.pop('per_prompt')))
  return out


def prompt_ids(recs: Sequence[Mapping]) -> list[str]:
  """Each record's id ('id'; else its position), one already taken suffixed '#<n>' (the
  smallest n free), so every prompt of a set has its own key."""
  used: set[str] = set()
  out = []
  for i, rec in enumerate(recs):
    base = rid = str(rec.get('id') or i)
    n = 0
    while rid in used:
      n += 1
      rid = f'{base}#{n}'
    used.add(rid)
    out.append(rid)
  return out


def suite_sets(plan, tokenizer=None) -> list[tuple[suites_base.Suite, list[dict]]]:
  """config.eval.suites, each with its protocol (config.eval.suite_protocol applied) and its
  records (the first config.eval.suite_prompts of them); a suite whose records depend on the
  policy's tokenizer (RULER's) reads them with `tokenizer`, the run's.

  Raises:
    cascade.data.readers.DataError: a suite's data is missing or malformed (one line naming the
      suite and the file).
  """
  ev, out = plan.eval, []
  for name in ev.suites:
    suite = dataclasses.replace(suites_lib.get(name), protocol=ev.suite_settings(name))
    if tokenizer is not None:
      suite = suite.for_tokenizer(tokenizer)
    try:
      recs = suite.read(suite.directory(ev.suite_data) if ev.suite_data else '')
    except (suites_base.DataMissing, suites_base.BadRecord) as e:
      unset = '' if ev.suite_data else ' (config.eval.suite_data names no directory)'
      raise readers.DataError(f'config.eval.suites: {e}{unset}') from None
    out.append((suite, recs[:ev.suite_prompts] if ev.suite_prompts else recs))
  return out


def score_suites(ctx, params, row: str,
                 report: Callable[[int, int, dict, float], None] | None = None,
                 stop: Callable[[], str | None] | None = None) -> dict[str, dict]:
  """config.eval.suites scored on a row's policy (`cascade.suites.run`), each batch's grades
  kept in workdir/suites/<row>/<suite>/grades.jsonl, so a stopped evaluation goes on where it
  stopped (the grades of this config's row `row` are reused, nothing else's).

  Args:
    ctx: the run context (plan, sampler, tokenizer, workdir, before_write, config_hash).
    params: the row's policy.
    row: the row's name.
    report: called after each suite with (i, n, its result, seconds), i from 1.
    stop: asked before each batch; an answer stops the call there (`Stopped`).

  Returns:
    suite -> its result (`cascade.suites.run.run_suite`); {} when the config names none.

  Raises:
    Stopped: `stop` answered (what was graded is kept in the suites' files).
  """
  sets = suite_sets(ctx.plan, ctx.tokenizer)
  if not sets:
    return {}
  prepare = getattr(ctx.sampler, 'prepare', None)   # the rollout copy, made once for all
  policy = suites_run.Policy(ctx.sampler, prepare(params) if prepare is not None else params,
                             ctx.tokenizer, identity=f'config {ctx.config_hash}, row {row}')
  out = {}
  for i, (suite, recs) in enumerate(sets, 1):
    t0 = time.perf_counter()
    try:
      out[suite.name] = suites_run.run_suite(
          suite, recs, policy, paths.join(ctx.workdir, 'suites', row), seed=ctx.plan.seed,
          batch_size=ctx.plan.eval.suite_batch_size,
          grader_options=suites_run.with_judge_loader(
              suite, ctx.plan.eval.grader_options(suite.name),
              lambda path: ctx.policies.judge_model(('hf', path), ctx.tokenizer)), stop=stop,
          before_write=ctx.before_write, say=print)
    except suites_run.Stopped as e:
      raise Stopped(e.why, e.where, {}) from None
    if report is not None:
      report(i, len(sets), out[suite.name], time.perf_counter() - t0)
  return out


def _matrix(rows, domains, key):
  return [[round(float(r[key][d]), 4) if d in (r.get(key) or {}) else None for d in domains]
          for r in rows]


def best_on_validation(rows: Sequence[Mapping], domain: str, before: int | None = None):
  """The row with the best validation score of `domain` (ties: the earliest), or None.

  `before`: only rows of stages with a smaller index (the initial row's index is -1).
  """
  rows = [r for r in rows if (r.get('validation') or {}).get(domain) is not None
          and (before is None or r.get('index', -1) < before)]
  return max(rows, key=lambda r: r['validation'][domain]) if rows else None


def results(rows: Sequence[Mapping], domains: Sequence[str]) -> dict:
  """results.json's object from progress rows ({'stage', 'domains', 'scores': {d: s}}).

  Rows that carry 'validation' scores add a "validation" matrix (same layout)
  and "best": per domain the policy with the best validation score (ties: the
  earliest): its stage, validation and held-out scores, and its HF export
  ('hf', when the row names one: a checkpoint to start from); rows whose
  details hold per-mode scores (thinking='both') add "scores_by_mode"; "configs" names, row by
  row, the hash of the config each row was computed with (config.json, or config.<hash>.json
  for one a later allow_config_change replaced; None for a row from before hashes were kept).
  """
  out = {'domains': list(domains),
         'stages': [r['stage'] for r in rows],
         'stage_domains': [list(r['domains']) for r in rows],
         'scores': _matrix(rows, domains, 'scores')}
  if any(r.get('config') for r in rows):
    out['configs'] = [r.get('config') for r in rows]
  if any(r.get('inserted') for r in rows):
    # Row by row, what a stage the regression guards inserted repairs and the drops that made
    # it run (None: a stage of the config's own list).
    out['inserted'] = [r.get('inserted') for r in rows]
  if any(r.get('validation') for r in rows):
    out['validation'] = _matrix(rows, domains, 'validation')
    out['best'] = {}
    for d in domains:
      best = best_on_validation(rows, d)
      if best is not None:
        out['best'][d] = {'stage': best['stage'],
                          'validation': round(float(best['validation'][d]), 4),
                          'held_out': round(float(best['scores'][d]), 4)
                                      if d in best['scores'] else None,
                          'hf': best.get('hf') or None}
  names = list(dict.fromkeys(n for r in rows for n in (r.get('suites') or {})))
  if names:
    out['suites'] = names
    out['suite_scores'] = [[suites_table.matrix_cell(r['suites'][n])
                            if n in (r.get('suites') or {}) else None for n in names]
                           for r in rows]
  modes = sorted({m for r in rows for det in (r.get('details') or {}).values()
                  for m in (det.get('modes') or {})})
  if modes:
    out['scores_by_mode'] = {
        m: [[round(float(r['details'][d]['modes'][m]['score']), 4)
             if m in ((r.get('details') or {}).get(d) or {}).get('modes', {}) else None
             for d in domains] for r in rows] for m in modes}
  return out


def markdown(res: Mapping, extra: bool = True) -> str:
  """The matrix as a Markdown table; each cell after the first row carries its delta.

  With `extra`, the validation matrix and the per-mode matrices follow when present.
  """
  domains = res['domains']
  lines = ['| stage | trains on | ' + ' | '.join(domains) + ' |',
           '|---|---|' + '---:|' * len(domains)]
  prev = None
  inserted = res.get('inserted') or [None] * len(res['stages'])
  for name, trains, row, ins in zip(res['stages'], res['stage_domains'], res['scores'],
                                    inserted):
    if ins:
      name = f'{name} (inserted)'
    cells = []
    for j, v in enumerate(row):
      if v is None:
        cells.append('-')
      elif prev is None or prev[j] is None:
        cells.append(f'{v:.1f}')
      else:
        cells.append(f'{v:.1f} ({v - prev[j]:+.1f})')
    lines.append(f'| {name} | {", ".join(trains) or "-"} | ' + ' | '.join(cells) + ' |')
    prev = row
  text = '\n'.join(lines) + '\n'
  if not extra:
    return text
  if res.get('substitutions'):
    text += '\nStand-in rewards (not the paper\'s): ' + '; '.join(
        f'{d}: {t}' for d, t in res['substitutions'].items()) + '\n'
  if res.get('suites'):
    text += ('\nSuites (value ± standard error, in percent; each by its protocol: '
             'docs/evaluation.md):\n\n'
             + suites_table.matrix_markdown(res['stages'], res['suites'], res['suite_scores']))
  if res.get('forecast'):
    text += '\n' + forecast_markdown(res['forecast'])
  if 'validation' in res:
    text += ('\nValidation (the selection set):\n\n'
             + markdown({**res, 'scores': res['validation']}, extra=False))
  for mode, matrix in sorted((res.get('scores_by_mode') or {}).items()):
    text += f'\nHeld-out, {mode} mode:\n\n' + markdown({**res, 'scores': matrix}, extra=False)
  return text


def forecast_markdown(rows: Sequence[Mapping]) -> str:
  """results.json "forecast" as a table: each guarded stage's first forecast of each protected
  domain's change by the stage's end (`cascade.forecast`) beside the outcome; with the
  signals' columns (config.guard.signals, `cascade.signals`) where some row has them."""
  sig = any('falls' in r for r in rows)
  lines = ['Forecast of forgetting (probe points: the change over the stage forecast from its '
           'first probes, a weighted line extrapolated to its last step, ± standard error, '
           'against the outcome, last probe minus first'
           + ('; KL drift in nats per token, the gradient cosine and the sign they give it, '
              'cascade/signals.py' if sig else '') + '):', '',
           '| stage | domain | from steps 0..k | forecast | outcome |'
           + (' KL | grad cos | sign |' if sig else ''),
           '|---|---|---:|---:|---:|' + ('---:|---:|---|' if sig else '')]
  for r in rows:
    out = '-' if r.get('outcome') is None else f'{r["outcome"]:+.1f}'
    line = (f'| {r["stage"]} | {r["domain"]} | {r["at_step"]} of {r["steps"]} | '
            f'{r["forecast"]:+.1f} ± {r["stderr"]:.1f} | {out} |')
    if sig:
      line += f' {signal_cells(r)} |'
    lines.append(line)
  return '\n'.join(lines) + '\n'


def signal_cells(r: Mapping) -> str:
  """A forecast row's KL, gradient cosine and sign cells ('-' where absent)."""
  kl, cos, falls = r.get('kl'), r.get('grad_cos'), r.get('falls')
  return ' | '.join(['-' if kl is None else f'{kl:.3g}', '-' if cos is None else f'{cos:+.2f}',
                     '-' if falls is None else ('fall' if falls else 'no fall')])


def _plot_forecasts(ax, res: Mapping, x, colors: Mapping[str, str]) -> None:
  """On the matrix panel: each forecast change (results.json "forecast") added to the domain's
  score before its stage, a hollow marker with its standard error."""
  stages, domains, scores = res['stages'], res['domains'], res['scores']
  shown = False
  for r in res.get('forecast') or []:
    if r['stage'] not in stages or r['domain'] not in domains:
      continue
    i, j = stages.index(r['stage']), domains.index(r['domain'])
    if i == 0 or scores[i - 1][j] is None:
      continue
    ax.errorbar(x[i] + 0.08, scores[i - 1][j] + r['forecast'], yerr=r['stderr'], marker='D',
                ms=5, mfc='none', ls='none', capsize=2, color=colors[r['domain']],
                label=None if shown else 'forecast from the first probes (± s.e.)')
    shown = True


def plot(res: Mapping, path: str) -> None:
  """One line per domain across the stages; markers on the stages that train that domain; with
  suites, a second panel: each suite's value with its standard error as a bar."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  stages, domains, scores = res['stages'], res['domains'], res['scores']
  names = res.get('suites') or []
  width = max(6.0, 1.1 * len(stages) + 2)
  fig, axes = plt.subplots(1, 2 if names else 1, figsize=(width * (2 if names else 1), 4.2),
                           squeeze=False)
  ax = axes[0, 0]
  x = np.arange(len(stages))
  if names:
    sax = axes[0, 1]
    for j, n in enumerate(names):
      cells = [row[j] for row in res['suite_scores']]
      y = np.array([np.nan if c is None else c['value'] for c in cells], float)
      err = np.array([0.0 if c is None else c['stderr'] for c in cells], float)
      sax.errorbar(x, y, yerr=err, marker='o', ms=4, lw=1.8, capsize=3, label=n)
    sax.set_xticks(x, stages, rotation=30, ha='right')
    sax.set_ylabel('suite value (%) ± standard error')
    sax.set_xlabel('after stage')
    sax.set_title('Every suite after every stage')
    sax.grid(alpha=0.3)
    sax.legend(fontsize=8, loc='best')
  colors = {}
  for j, d in enumerate(domains):
    y = np.array([np.nan if row[j] is None else row[j] for row in scores], float)
    (line,) = ax.plot(x, y, marker='o', ms=4, lw=1.8, label=d)
    colors[d] = line.get_color()
    trained = [i for i, ds in enumerate(res['stage_domains']) if d in ds]
    ax.plot(x[trained], y[trained], ls='none', marker='*', ms=12, color=line.get_color())
  _plot_forecasts(ax, res, x, colors)
  ax.set_xticks(x, stages, rotation=30, ha='right')
  ax.set_ylabel('held-out score (%)')
  ax.set_xlabel('after stage (a star marks the stage that trains the domain)')
  ax.set_title('Every domain after every stage')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc='best')
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format='png', dpi=120)
  plt.close(fig)
  paths.write_bytes(path, buf.getvalue())


def write(workdir: str, rows: Sequence[Mapping], domains: Sequence[str],
          isolation: Mapping[str, str] | None = None,
          accounting: Mapping[str, Mapping] | None = None,
          extra: Mapping | None = None) -> dict:
  """Writes results.json, results.md and results.png (atomically; process 0 only).

  `isolation` (verifier name -> the isolation its code ran under) is added to
  results.json as "isolation" when given, so a table says whether its code
  rewards came from sandboxed runs; `accounting` (stage -> where its step time
  went, `kinds.loop.accounting`) as "accounting"; `extra`'s keys as they are (the runner's
  "substitutions", "ledger", "teachers" and "guards").
  """
  res = results(rows, domains)
  if isolation:
    res['isolation'] = dict(sorted(isolation.items()))
  if accounting:
    res['accounting'] = {k: dict(v) for k, v in accounting.items() if v}
  res.update(extra or {})
  if not checkpoint.is_writer():
    return res
  checkpoint.atomic_write_text(paths.join(workdir, 'results.json'),
                               json.dumps(res, indent=1) + '\n')
  checkpoint.atomic_write_text(paths.join(workdir, 'results.md'), markdown(res))
  if rows:
    plot(res, paths.join(workdir, 'results.png'))
  return res
