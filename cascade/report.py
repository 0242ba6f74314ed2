"""What a run prints about itself: the start banner and one line per progress event.

  from cascade import report
  rep = report.Reporter(plan)                 # prints on process 0 only
  rep.say(report.banner(plan, workdir=..., ...))
  rep.stage_started(stage)                    # stage 3 of 7: [2] rlhf (grpo), 2 steps on chat
  rep.stage_ended(stage, steps_run, seconds)  # ... done in 12 s; cascade ETA ~1 min 04 s ...

The banner says, before anything compiles: the config (file, overrides, hash), the
workdir, the devices and the mesh, every stage in order with its kind, steps and
domains, where a resumed run picks up (the stages done, the step its current stage
restarts at), the isolation each verifier's code runs under, and the compilation
cache. Progress lines follow as things happen: stage i of N starting and ending
(with an estimate of the time the cascade has left), each domain of an evaluation,
the data-making step and each HF export. One line per event on stdout, flushed,
so a log file reads like the terminal; with several hosts only process 0 prints.

The cascade's ETA is an estimate: the training steps left (the stages not done,
less what a resumed stage already ran) times this run's wall time per step so
far, over the stages it ran, their compiles, evaluations and exports included. A
stage whose steps cost more than the average (an RL stage after SFT) makes it
optimistic; it gets better as stages finish.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax


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
  lines.append(cache_line or 'compilation cache: off')
  return '\n'.join(lines)


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
    self._left = {st.name: _steps(st) for st in plan.stages if st.name not in done}
    first = next((st.name for st in plan.stages if st.name not in done), None)
    if first is not None and resume_step:
      self._left[first] = max(0, self._left[first] - resume_step)
    self.steps_run = 0
    self.seconds = 0.0

  def say(self, line: str) -> None:
    if self.enabled:
      print(line, flush=True)

  def stage_started(self, stage) -> None:
    what = _what(stage)
    on = f' on {", ".join(stage.domains)}' if stage.domains else ''
    self.say(f'stage {stage.index + 1} of {self.count}: [{stage.index}] {stage.name} '
             f'({stage.kind}), {what}{on}')

  def eta(self) -> tuple[float, int] | None:
    """(seconds, steps) the cascade has left, estimated; None before a step has run."""
    if not self.steps_run:
      return None
    left = sum(self._left.values())
    return left * self.seconds / self.steps_run, left

  def stage_ended(self, stage, steps_run: int, seconds: float) -> None:
    """Counts a stage this run ran (`seconds`: its wall time, evaluation and export included)."""
    self.steps_run += steps_run
    self.seconds += seconds
    self._left.pop(stage.name, None)
    line = (f'stage {stage.index + 1} of {self.count} done: [{stage.index}] {stage.name} '
            f'({stage.kind}) in {duration(seconds)}')
    eta = self.eta()
    if not self._left:
      line += f'; the cascade is done ({duration(self.seconds)} in this run)'
    elif eta is not None:
      secs, left = eta
      line += (f'; cascade ETA ~{duration(secs)} (estimate: {left} steps left x '
               f'{self.seconds / self.steps_run:.2f} s, this run\'s wall time per step so far)')
    self.say(line)

  def evaluated(self, label: str, i: int, n: int, domain: str, result: Mapping,
                seconds: float) -> None:
    """One domain of an evaluation: '[3] rlhf: eval 2/5 code 31.0 (8 samples, 1.2 s)'."""
    self.say(f'{label}: eval {i}/{n} {domain} {result["score"]:.1f} '
             f'({result["samples"]} samples, {seconds:.1f} s)')
