"""What a run prints about itself: the start banner and one line per progress event.

  from cascade import report
  rep = report.Reporter(plan)                 # prints on process 0 only
  rep.say(report.banner(plan, workdir=..., ...))
  rep.stage_started(stage)                    # stage 3 of 7: [2] rlhf (grpo), 2 steps on chat
  rep.evaluated(label, i, n, domain, result, seconds)   # [2] rlhf: eval 1/5 chat 25.0 (...)
  rep.exported(stage, path, seconds)          # [2] rlhf: exported to .../hf in 0.7 s
  rep.stage_ended(stage, steps_run, seconds, step_s)   # ... done in 12 s; cascade ETA ~1 min ...

The banner says, before anything compiles: the config (file, overrides, hash), the
workdir, the devices and the mesh, every stage in order with its kind, steps and
domains, where a resumed run picks up (the stages done, the step its current stage
restarts at), the isolation each verifier's code runs under, each reward that stands
in for a paper's (`config.domains.<d>.stand_in`, also results.json's "substitutions"),
and the compilation cache. Progress lines follow as things happen: stage i of N starting and ending
(with an estimate of the time the cascade has left), each domain of an evaluation,
the data-making step and each HF export. One line per event on stdout, flushed,
so a log file reads like the terminal; with several hosts only process 0 prints.

The cascade's ETA adds up, over the stages not done, what each will cost as this
run measured it (`estimate`): its steps left times the steady time per step
(after the first) of the last stage of its kind this run ran; its start (the
rest of such a stage's time: compiling its programs, restoring, the first
step's extra); its evaluation, if it is evaluated, timed as the last evaluation;
its HF export, if it trains the policy, timed as the last export. A stage of a
kind this run has not run yet is timed as the last stage of any kind, and the
line says so ("a guess"), as it does for an evaluation or export not yet seen.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax

from cascade.suites import table as suites_table


def _steps(stage) -> int:
  """A stage's training steps (0: a stage that does not train, e.g. an eval stage)."""
  return int(getattr(stage, 'steps', 0) or 0)


def _what(stage) -> str:
  """'1 step', '40 steps' or 'no training'."""
  n = _steps(stage)
  return f'{n} step{"" if n == 1 else "s"}' if n else 'no training'


def duration(seconds: float) -> str:
  """'42 s', '3 min 05 s', '2 h 07 min'."""
  s = int(round(max(0.0, seconds)))
  if s < 60:
    return f'{s} s'
  if s < 3600:
    return f'{s // 60} min {s % 60:02d} s'
  return f'{s // 3600} h {s % 3600 // 60:02d} min'


def stage_line(stage) -> str:
  """'[2] rlhf (grpo): 2 steps on chat; evaluated after' ([index] as config.stages[index] and
  the run's other lines name it)."""
  what = _what(stage)
  if stage.domains:
    what += ' on ' + ', '.join(stage.domains)
  if stage.ROW and stage.evaluate:
    what += '; evaluated after'
  return f'[{stage.index}] {stage.name} ({stage.kind}): {what}'


def mesh_line(mesh, slices: int | None = None) -> str:
  """The mesh's axis sizes ('data=2 fsdp=2 tensor=2'), or that there is none."""
  if mesh is None:
    return 'mesh: none (config.mesh.shape=None: one device, no sharding)'
  axes = ' '.join(f'{name}={size}' for name, size in mesh.shape.items())
  return f'mesh: {axes}' + (f' over {slices} slices' if slices else '')


def devices_line() -> str:
  """'devices: 8 cpu (cpu), 1 process (8 local devices)'."""
  devs = jax.devices()
  kinds = sorted({d.device_kind for d in devs})
  n, procs = len(devs), jax.process_count()
  return (f'devices: {n} {devs[0].platform} ({", ".join(kinds)}), {procs} '
          f'process{"es" if procs > 1 else ""} ({jax.local_device_count()} local '
          f'device{"s" if jax.local_device_count() > 1 else ""})')


def resume_line(stages: Sequence, done: Sequence[str], resume_step: int | None) -> str:
  """Where the run picks up: a new run, the stages done and the step the next one resumes at."""
  done = [st.name for st in stages if st.name in set(done)]
  left = [st for st in stages if st.name not in set(done)]
  if not done and not resume_step:
    return 'resume: none, a new run'
  if not left:
    return f'resume: all {len(stages)} stages done ({", ".join(done)}); nothing left to run'
  nxt = left[0]
  at = (f'{nxt.name} resumes at step {resume_step}/{_steps(nxt)} (its newest checkpoint)'
        if resume_step else f'{nxt.name} starts from its beginning')
  return f'resume: done {", ".join(done) or "none"}; {at}'


def isolation_line(isolation: Mapping[str, str]) -> str:
  """'isolation: code=bwrap; no code run: math, swe' from verifier -> isolation ('n/a': none)."""
  runs = [f'{k}={v}' for k, v in sorted(isolation.items()) if v != 'n/a']
  none = sorted(k for k, v in isolation.items() if v == 'n/a')
  parts = [', '.join(runs) if runs else 'no verifier runs code']
  if none and runs:
    parts.append(f'no code run: {", ".join(none)}')
  return 'isolation: ' + '; '.join(parts)


def banner(plan, *, workdir: str, command: str, config_hash: str, mesh: Any,
           done: Sequence[str], resume_step: int | None, isolation: Mapping[str, str],
           cache_line: str | None) -> str:
  """The run's start banner (several lines).

  Args:
    plan: the validated plan.
    workdir: the run's directory.
    command: the config file and its overrides as given ('' when run from Python).
    config_hash: the config's hash (config.json's).
    mesh: the run's mesh (None: one device).
    done: the stages progress.json marks done.
    resume_step: the step the first stage not done restarts at (None or 0: its beginning).
    isolation: verifier (or environment) -> the isolation its code runs under ('n/a': none).
    cache_line: the compilation cache's line (`compile_cache.Cache.banner`), or None (off).
  """
  config = f'{command} ' if command else 'from Python, '
  lines = [f'cascade: config {config}(hash {config_hash})',
           f'workdir: {workdir}',
           devices_line() + '; ' + mesh_line(mesh, plan.mesh_slices),
           f'stages: {len(plan.stages)}, '
           f'{sum(_steps(st) for st in plan.stages)} training steps in all']
  lines += ['  ' + stage_line(st) for st in plan.stages]
  lines.append(resume_line(plan.stages, done, resume_step))
  if isolation:
    lines.append(isolation_line(isolation))
  lines += [f'stand-in reward: {d}: {text}' for d, text in plan.substitutions.items()]
  lines.append(cache_line or 'compilation cache: off')
  return '\n'.join(lines)


def steady_step_s(first: Mapping | None, accounting: Mapping | None) -> float | None:
  """A stage's seconds per step once compiled: its steps' time less the first step's (which
  compiles), over the other steps; one step: that step's time. None: no step timed.

  Args:
    first: the first step's metrics ('step_s').
    accounting: the stage's `kinds.loop.accounting` ('steps', 'step_s': the steps' total).
  """
  steps = int((accounting or {}).get('steps') or 0)
  total = (accounting or {}).get('step_s')
  if not steps or total is None:
    return None
  first_s = (first or {}).get('step_s')
  if steps == 1 or first_s is None:
    return float(total) / steps
  return max(0.0, float(total) - float(first_s)) / (steps - 1)


@dataclasses.dataclass(frozen=True)
class StageTime:
  """Where the wall time of a stage this run ran went.

  Attributes:
    kind: the stage's kind.
    step_s: seconds per step once compiled (`steady_step_s`; 0 for a stage without steps).
    start_s: the rest of its time but evaluation and export: compiles, restoring, setup.
  """
  kind: str
  step_s: float
  start_s: float


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The time the cascade has left, and of what it is made (each part in seconds).

  Attributes:
    seconds: the total.
    steps: training steps left; steps_s their time.
    starts: stages left; starts_s their starts (compiles, setup).
    evals: evaluations left; evals_s their time.
    exports: HF exports left; exports_s their time.
    guesses: what is not measured yet, timed as something else (empty: all measured).
  """
  seconds: float
  steps: int
  steps_s: float
  starts: int
  starts_s: float
  evals: int
  evals_s: float
  exports: int
  exports_s: float
  guesses: tuple

  def describe(self) -> str:
    """'~5 min 10 s (12 steps ~2 min 00 s, 2 stage starts ~1 min 30 s, ...; measured ...)'."""
    plural = lambda n, what: f'{n} {what}{"" if n == 1 else "s"}'
    parts = [f'{plural(self.steps, "step")} ~{duration(self.steps_s)}',
             f'{plural(self.starts, "stage start")} (compiles, setup) ~{duration(self.starts_s)}']
    if self.evals:
      parts.append(f'{plural(self.evals, "evaluation")} ~{duration(self.evals_s)}')
    if self.exports:
      parts.append(f'{plural(self.exports, "export")} ~{duration(self.exports_s)}')
    how = ('a guess: ' + '; '.join(self.guesses) if self.guesses
           else "each part as this run's stages measured it")
    return f'~{duration(self.seconds)} ({", ".join(parts)}; {how})'


def estimate(left: Sequence[tuple[Any, int]], times: Sequence[StageTime],
             evals: Sequence[float], exports: Sequence[float]) -> Estimate | None:
  """The time the stages not done will take, from what this run measured (module docstring).

  Args:
    left: (stage, its steps left) of every stage not done, in order.
    times: the stages this run ran, in order.
    evals: the seconds of each whole evaluation this run ran, in order.
    exports: the seconds of each HF export this run wrote, in order.

  Returns:
    The Estimate; None before a stage has run (nothing measured).
  """
  if not times:
    return None
  last = times[-1]
  by_kind = {t.kind: t for t in times}               # the last of each kind
  steps = starts = n_evals = n_exports = 0
  steps_s = starts_s = 0.0
  unmeasured: list[str] = []
  for st, n in left:
    t = by_kind.get(st.kind)
    if t is None:
      t = last
      if st.kind not in unmeasured:
        unmeasured.append(st.kind)
    steps += n
    steps_s += n * t.step_s
    starts += 1
    starts_s += t.start_s
    n_evals += bool(st.ROW and st.evaluate)
    n_exports += bool(st.trains_policy)
  evals_s = n_evals * (evals[-1] if evals else 0.0)
  exports_s = n_exports * (exports[-1] if exports else 0.0)
  guesses = []
  if unmeasured:
    guesses.append(f'no {", ".join(unmeasured)} stage ran yet, timed as {last.kind}')
  if n_evals and not evals:
    guesses.append('no evaluation ran yet, counted as 0 s')
  if n_exports and not exports:
    guesses.append('no export ran yet, counted as 0 s')
  return Estimate(seconds=steps_s + starts_s + evals_s + exports_s, steps=steps,
                  steps_s=steps_s, starts=starts, starts_s=starts_s, evals=n_evals,
                  evals_s=evals_s, exports=n_exports, exports_s=exports_s,
                  guesses=tuple(guesses))


class Reporter:
  """Prints the run's progress lines (process 0 only) and keeps the cascade's clock.

  Args:
    plan: the validated plan.
    done: the stages already done when the run started (a resume).
    resume_step: the step the first stage not done restarts at.
    enabled: print (default: this is process 0).
  """

  def __init__(self, plan, done: Sequence[str] = (), resume_step: int | None = None,
               enabled: bool | None = None):
    self.count = len(plan.stages)
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    done = set(done)
    self._stages = {st.name: st for st in plan.stages}
    self._left = {st.name: _steps(st) for st in plan.stages if st.name not in done}
    first = next((st.name for st in plan.stages if st.name not in done), None)
    if first is not None and resume_step:
      self._left[first] = max(0, self._left[first] - resume_step)
    self.seconds = 0.0
    self.times: list[StageTime] = []
    self.evals: list[float] = []         # each whole evaluation's seconds
    self.exports: list[float] = []       # each HF export's seconds
    self._eval_s = 0.0                   # the evaluation going on
    self._stage_evals = self._stage_exports = 0.0   # the current stage's

  def say(self, line: str) -> None:
    if self.enabled:
      print(line, flush=True)

  def stage_started(self, stage) -> None:
    self._stage_evals = self._stage_exports = 0.0
    what = _what(stage)
    on = f' on {", ".join(stage.domains)}' if stage.domains else ''
    self.say(f'stage {stage.index + 1} of {self.count}: [{stage.index}] {stage.name} '
             f'({stage.kind}), {what}{on}')

  def eta(self) -> Estimate | None:
    """The time the cascade has left, estimated (`estimate`); None before a stage has ended."""
    left = [(self._stages[name], n) for name, n in self._left.items()]
    return estimate(left, self.times, self.evals, self.exports)

  def exported(self, stage, path: str, seconds: float) -> None:
    """A stage's policy exported: '[2] rlhf: exported to .../hf in 0.7 s'."""
    self.exports.append(seconds)
    self._stage_exports += seconds
    self.say(f'[{stage.index}] {stage.name}: exported to {path} in {seconds:.1f} s')

  def stage_ended(self, stage, steps_run: int, seconds: float,
                  step_s: float | None = None) -> None:
    """Counts a stage this run ran.

    Args:
      stage: the stage.
      steps_run: the steps this run ran of it.
      seconds: its wall time, evaluation and export included.
      step_s: its seconds per step once compiled (`steady_step_s`; None: the stage's seconds
        over its steps, compiles included).
    """
    self.seconds += seconds
    self._left.pop(stage.name, None)
    rest = seconds - self._stage_evals - self._stage_exports
    if step_s is None:
      step_s = max(0.0, rest) / steps_run if steps_run else 0.0
    rest -= steps_run * step_s
    self.times.append(StageTime(stage.kind, step_s, max(0.0, rest)))
    line = (f'stage {stage.index + 1} of {self.count} done: [{stage.index}] {stage.name} '
            f'({stage.kind}) in {duration(seconds)}')
    eta = self.eta()
    if not self._left:
      line += f'; the cascade is done ({duration(self.seconds)} in this run)'
    elif eta is not None:
      line += f'; cascade ETA {eta.describe()}'
    self.say(line)

  def evaluated(self, label: str, i: int, n: int, domain: str, result: Mapping,
                seconds: float) -> None:
    """One domain of an evaluation: '[3] rlhf: eval 2/5 code 31.0 (8 samples, 1.2 s)'; the
    last one (i == n) times the whole evaluation."""
    self._eval_s += seconds
    if i == n:
      self.evals.append(self._eval_s)
      self._stage_evals += self._eval_s
      self._eval_s = 0.0
    self.say(f'{label}: eval {i}/{n} {domain} {result["score"]:.1f} '
             f'({result["samples"]} samples, {seconds:.1f} s)')

  def suite_evaluated(self, label: str, i: int, n: int, result: Mapping, seconds: float) -> None:
    """One suite of an evaluation, after its domains: '[3] rlhf: suite 1/5 tiny_math avg@4
    53.0 ± 2.1, pass@4 70.0 (800 samples, 3.1 s)'; its time counts in the evaluation's."""
    if self.evals:
      self.evals[-1] += seconds
    self._stage_evals += seconds
    self.say(f'{label}: suite {i}/{n} {result["suite"]} {suites_table.summary(result)} '
             f'({result["samples"]} samples, {seconds:.1f} s)')
