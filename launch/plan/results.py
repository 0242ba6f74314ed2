"""What a plan finds, shared by every room of `launch.plan`: one program's memory and FLOPs, one
stage's programs and its step-time bound, and the byte units they are printed in."""

from __future__ import annotations

import dataclasses

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class ProgramReport:
  """One compiled program's per-device memory (bytes) and its FLOPs over all devices.

  `error` is set (and the sizes are 0) when compilation itself failed, e.g.
  the TPU compiler's RESOURCE_EXHAUSTED for a program over HBM.
  """
  name: str
  shapes: str
  argument_bytes: int = 0
  output_bytes: int = 0
  temp_bytes: int = 0
  alias_bytes: int = 0
  flops: float = 0.0          # the whole program over all devices (XLA's HLO count)
  compile_s: float = 0.0
  # CPU seconds this process spent lowering and compiling it (all threads): on a shared host
  # a steadier measure than the wall-clock `compile_s`.
  compile_cpu_s: float = 0.0
  error: str = ''
  # How `flops` was counted when not by XLA ('' = XLA's HLO count; see `flops.counted_flops`).
  flops_from: str = ''
  # A program whose own total exceeds the limit: its largest arrays, e.g.
  # '126.00 GiB f32[786432,43008] (copy_bitcast_fusion.11)' (`compiler.largest_arrays`).
  largest: tuple[str, ...] = ()
  # Its collectives as the compiler emitted them (`collectives.parse` of the optimized HLO).
  collectives: tuple = ()
  # Seconds they take on the target's interconnect per call (`collectives.seconds`; outside
  # loops of unknown trip count) and per iteration of its heaviest such loop (a decode step).
  collective_s: float = 0.0
  collective_step_s: float = 0.0

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

  def fits(self, limit_bytes: int) -> bool:
    return not self.error and (not limit_bytes or self.total_bytes <= limit_bytes)


@dataclasses.dataclass(frozen=True)
class StageReport:
  """The programs of one stage (or of the evaluation) and whether they all fit.

  `resident` maps a program name to the per-device bytes that stay in memory
  beside it while it runs without being its arguments (the optimizer state
  beside the sampler, frozen references / teachers / reward models beside
  everything): a program's co-resident peak is its total plus that.
  `time` is the bound on one step's time and its parts (`step_time.step_time`; None when
  the hardware names no peak), and `steps` the stage's step count.
  """
  index: int
  name: str
  kind: str
  programs: tuple[ProgramReport, ...]
  limit_bytes: int
  num_devices: int
  resident: tuple[tuple[str, int], ...] = ()
  time: StepTime | None = None
  steps: int = 0

  @property
  def seconds(self) -> float:
    """The bound on one step (0 without one)."""
    return self.time.bound if self.time is not None else 0.0

  def chip_hours(self, seconds: float) -> float:
    return seconds * self.steps / 3600 * self.num_devices

  def peak(self, p: ProgramReport) -> int:
    return p.total_bytes + dict(self.resident).get(p.name, 0)

  def fits_program(self, p: ProgramReport) -> bool:
    return not p.error and (not self.limit_bytes or self.peak(p) <= self.limit_bytes)

  @property
  def fits(self) -> bool:
    return all(self.fits_program(p) for p in self.programs)


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A bound on one step's time in seconds, by part (`step_time.step_time`, with its
  `TIME_ASSUMPTIONS`).

  Sampling is one round's: `weights`, `kv` and `state` the decode steps' reads of the weights,
  the KV cache and the Mamba states at HBM bandwidth; `compute` what the decode steps' FLOPs
  at peak add where they exceed those reads (each step costs the larger); `prefill` the
  prefill calls. `scoring` is None where it is not estimated (verifiers on the hosts).
  `rounds`: the most sampling rounds a step may run (the worst case). `weights_only`: the
  bound this model replaces (one read of the weights per new token of each chunk, the rest
  FLOPs at peak).

  `collective_*`: the seconds the compiled programs' collectives take per step on the target's
  interconnect (`step_time.with_collectives`; 0 where nothing was compiled) for sampling, the
  update, the frozen passes and reward-model scoring. `bound` overlaps each part's collectives
  with its compute and reads (a part takes the larger); `serial` adds them.
  """
  weights: float = 0.0
  kv: float = 0.0
  state: float = 0.0
  compute: float = 0.0
  prefill: float = 0.0
  scoring: float | None = None
  update: float = 0.0
  frozen: float = 0.0
  judge: float = 0.0
  rounds: int = 1
  weights_only: float = 0.0
  decode_steps: int = 0
  collective_sampling: float = 0.0
  collective_update: float = 0.0
  collective_frozen: float = 0.0
  collective_scoring: float = 0.0

  @property
  def sampling(self) -> float:
    return self.weights + self.kv + self.state + self.compute + self.prefill

  @property
  def collective(self) -> float:
    """The collectives' seconds per step (one sampling round), all parts."""
    return (self.collective_sampling + self.collective_update + self.collective_frozen
            + self.collective_scoring)

  def _round(self, overlap: bool) -> float:
    """One round of sampling and scoring, each part with its collectives."""
    join = max if overlap else (lambda a, b: a + b)
    return (join(self.sampling, self.collective_sampling)
            + join(self.scoring or 0.0, self.collective_scoring) + self.judge)

  def _once(self, overlap: bool) -> float:
    """The update and the frozen passes, each with its collectives."""
    join = max if overlap else (lambda a, b: a + b)
    return join(self.update, self.collective_update) + join(self.frozen, self.collective_frozen)

  @property
  def bound(self) -> float:
    """One round: sampling, scoring where estimated, the update and the frozen passes, each
    part's collectives overlapped with it (the part takes the larger)."""
    return self._round(True) + self._once(True)

  @property
  def serial(self) -> float:
    """`bound` with every collective added after the compute and reads it could hide behind."""
    return self._round(False) + self._once(False)

  @property
  def worst(self) -> float:
    """`rounds` rounds of sampling and scoring, one update (collectives overlapped)."""
    return self.rounds * self._round(True) + self._once(True)


def size_text(n: int) -> str:
  """Bytes in the largest binary unit that keeps the number >= 1."""
  for unit, scale in (('GiB', GIB), ('MiB', 2 ** 20), ('KiB', 2 ** 10)):
    if abs(n) >= scale:
      return f'{n / scale:.2f} {unit}'
  return f'{n} B'
