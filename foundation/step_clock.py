"""Where a training step's wall time goes: jitted programs vs host work, by part.

  clock = step_clock.StepClock()
  clock.start()
  with clock.part('score'):              # host work (Python, numpy, files)
    ...
  with clock.program('update'):          # a jitted program: its dispatch and the wait for it
    state, m = train_step(state, batch)
    m = jax.device_get(m)
  step = clock.stop()                    # this step's {part: seconds}, see `stop`

The step's host time is its wall time minus the time spent in `program` parts: the Python
between dispatches, the numpy that builds batches, the checks and logs, each `part` named. A
sync that waits for a program's result belongs to that program's `program` part; a sync that
waits early (where nothing needed the value yet) shows up as program time spent where host
work could have overlapped it. Parts nest: time in an inner part is its own, not its outer
part's, so the parts add up to the wall time; time in no part is 'other'.

The clock is handed to what it times (`cascade.kinds.loop.train_stage` takes it from its
context, `rl.train_step.run_step` and `rl.sampler.Sampler.generate` as an argument); code given
none times nothing (`NULL`, whose parts cost one attribute lookup).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

OTHER = 'other'


class StepClock:
  """Per-step seconds by part, split into program time and host time; steps are summed.

  Attributes:
    steps: the steps stopped so far.
    totals: part -> seconds summed over those steps (program parts named as given).
    program_parts: the names given to `program`.
    history: each stopped step's dict (`stop`), in order.
  """

  def __init__(self):
    self.steps = 0
    self.totals: dict[str, float] = {}
    self.program_parts: set[str] = set()
    self._step: dict[str, float] | None = None
    self._stack: list[list] = []       # [name, start, seconds of inner parts]
    self._t0 = 0.0
    self._outside = 0.0
    self.history: list[dict[str, float]] = []

  @property
  def running(self) -> bool:
    return self._step is not None

  def start(self) -> None:
    """Starts a step (a step still running is dropped)."""
    self._step, self._stack, self._outside = {}, [], 0.0
    self._t0 = time.perf_counter()

  @contextlib.contextmanager
  def part(self, name: str) -> Iterator[None]:
    """Times host work as part `name` of the running step (nothing when none runs)."""
    if self._step is None:
      yield
      return
    entry = [name, time.perf_counter(), 0.0]
    self._stack.append(entry)
    try:
      yield
    finally:
      self._stack.pop()
      dt = time.perf_counter() - entry[1]
      self._step[name] = self._step.get(name, 0.0) + dt - entry[2]
      if self._stack:
        self._stack[-1][2] += dt

  @contextlib.contextmanager
  def outside(self) -> Iterator[None]:
    """Time that is no part of the running step (left out of its wall time): test hooks, a
    benchmark's reference programs run between steps. Not inside a part."""
    t = time.perf_counter()
    try:
      yield
    finally:
      self._outside += time.perf_counter() - t

  def program(self, name: str):
    """Times a jitted program as part `name`: its dispatch and the wait for its result."""
    self.program_parts.add(name)
    return self.part(name)

  def stop(self) -> dict[str, float]:
    """Ends the running step: {part: seconds, 'other': untimed, 'step_s': wall, 'program_s',
    'host_s': wall - program_s}, also added to `totals`. ({} when no step runs.)"""
    if self._step is None:
      return {}
    wall = time.perf_counter() - self._t0 - self._outside
    out = dict(self._step)
    out[OTHER] = max(0.0, wall - sum(out.values()))
    program = sum(v for k, v in out.items() if k in self.program_parts)
    out.update(step_s=wall, program_s=program, host_s=wall - program)
    for k, v in out.items():
      self.totals[k] = self.totals.get(k, 0.0) + v
    self.steps += 1
    self._step = None
    self.history.append(out)
    return out

  def means(self) -> dict[str, float]:
    """Seconds per step of each part (and step_s, program_s, host_s) over the stopped steps."""
    return {k: v / self.steps for k, v in self.totals.items()} if self.steps else {}

  def host_parts(self) -> dict[str, float]:
    """Seconds per step of each host part (program parts and the sums left out), largest first."""
    m = self.means()
    parts = {k: v for k, v in m.items()
             if k not in self.program_parts and k not in ('step_s', 'program_s', 'host_s')}
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))


_NOTHING = contextlib.nullcontext()


class _Null:
  """A clock that times nothing (code given no clock)."""

  running = False

  def part(self, name: str):
    del name
    return _NOTHING

  program = part

  def outside(self):
    return _NOTHING

  def start(self) -> None:
    pass

  def stop(self) -> dict:
    return {}


NULL = _Null()
