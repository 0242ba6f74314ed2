"""Ahead-of-time plan: compile every stage's programs for the config's mesh, without weights.

The target devices, the abstract inputs, the compiling, the co-resident and
time accounting and the command line are the steps of one command and share its
report types, so they live in one module.

    python -m launch.plan --config=configs/nemotron_cascade_14b.py
    python -m launch.plan --config=configs/tiny.py --stages=sft,math_rl --backend=cpu
    python -m launch.plan --config=configs/tiny.py:smoke --config.mesh.shape=1,2,1 \
        --config.stages.math_rl.group_size=8 --stages=math_rl --noeval

`--config` takes the overrides `python -m cascade.main` takes (stages by name,
fields the config leaves unset; cascade/overrides.py), so a plan is of the
config the same command line would run.

For every training stage it lowers and compiles, for the config's mesh and
with abstract shapes only (`nnx.eval_shape` for the model,
`jax.ShapeDtypeStruct`s with shardings for the state and the batch):

* the jitted train step (`rl.train_step.make_train_step`) for the stage's
  largest batch: SFT rows of `max_len`, reward-model pairs, RL rows of
  `max_prompt_len` + the longest phase's `max_response_len`;
* for RL stages, the jitted sampler (`rl.sampler.sample`) with the shapes
  the stage loop feeds it: prompts x G rows in one call, the prompt and
  new-token buckets and decode phases of `config.sampler` (default:
  rl.sampler's);

plus the held-out evaluation's sampler once. It prints per-device memory
(arguments, outputs, temporaries, total = arguments + outputs + temporaries
- donated aliases, from `compiled.memory_analysis()`; for a program over the
limit by itself, its largest arrays) and XLA's FLOP count
(`cost_analysis()`; XLA counts a loop body once, so FLOPs are counted on a
twin lowered with the layers unrolled and the batch in one microbatch; a
sampler's prefill and one step per decode loop), and exits with status 1 naming every stage
that does not fit the per-device memory in `config.hardware`.

The mixture-of-experts families (hybrid Mamba / MoE / attention stacks, the
mesh's 'expert' axis) compile the same way, but their FLOPs are counted from
the config (`counted_flops`: the active parameters, `num_params(active=True)`,
and attention scores): XLA:CPU lowers the routed experts' ragged_dot as a
dense dot of all of a shard's experts over all token-expert pairs and counts
a shard_map body once, so XLA's number is no measure of their work; a
sampler's FLOPs are then the whole call's.

Target devices: with `libtpu` importable (`pip install "jax[tpu]"`, not a
dependency of cascade) the real TPU compiler runs against
`config.hardware.topology` (e.g. 'v5p:4x4x4') on this CPU host, and an
over-HBM program fails at compile time. Without it, simulated CPU devices of
the same count stand in: argument sizes are exact, temporaries are XLA:CPU's
(its fusion and layouts differ from the TPU's), and the limit is checked
here. The output says which.

For a GPU target (`config.hardware.platform='gpu'`) with jax's CUDA plugin importable
(`pip install "jax[cuda12]"` in its own environment, docs/planning.md) and
`config.hardware.gpu_target` naming a GpuTargetConfigProto text file (e.g.
launch/gpu_targets/h200.txtpb), XLA:GPU compiles deviceless on this CPU host for as many
of those GPUs, 8 per host (`--backend=gpu`): its memory is XLA:GPU's own, but it compiles
a program over the GPU's memory without complaint, so the limit is checked here, and it
returns no cost analysis, so FLOPs are counted on CPU devices as for a TPU topology.

    python -m launch.plan --config=configs/nemotron_cascade_14b.py:hardware=h200x8 --backend=gpu

plus the frozen passes a step runs (the kind's `frozen_forwards`: a KL or DPO
reference, MOPD teachers) and the reward model's scoring pass for stages whose
domains are scored by one. Each program's fit is checked with what stays
resident beside it (the optimizer state beside the sampler, frozen references,
teachers and reward models beside everything): the co-resident peak. With
`hardware.peak_tflops` and `hardware.hbm_gbps` it prints a bound on each
step's time by part and per stage in chip-hours (`step_time`, counted from the
config, with its `TIME_ASSUMPTIONS`): sampling per device call, each decode
step the larger of its reads (the weights in the sampler's layout,
`decode_read_bytes`; the KV cache over the keys each row attends; Mamba
states) at HBM bandwidth and its FLOPs at peak, the prefill, the refill
rounds' worst case; reward-model scoring; the update's and the frozen passes'
FLOPs at peak. `--time_only` prints just that, compiling nothing. Not
compiled: the per-phase variants shorter than a stage's longest phase (they
need less memory).

    python -m launch.plan --config=configs/nemotron_cascade_14b.py --time_only
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
import re
import sys
import time
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
from etils import epath
from flax import nnx

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
import numpy as np

from cascade import config as config_lib
from cascade import kinds
from cascade import overrides
from cascade import policies
from cascade.kinds import loop
from models import flops
from models import sharding
from models import topology
from rl import sampler as sampler_lib
from rl import train_step as train_lib

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Target:
  """Where the programs are compiled for.

  Attributes:
    devices: the devices the mesh is built from (TPU topology devices or CPU).
    kind: 'tpu' (libtpu's compiler, real HBM limit), 'gpu' (XLA:GPU deviceless, the limit
      checked here) or 'cpu' (simulated).
    description: one line for the output.
    device_memory_bytes: the per-device limit checked against (0 = none).
    count_devices: CPU devices of the same count to count FLOPs on (the TPU
      topology client and XLA:GPU deviceless return no cost analysis); empty
      when `devices` themselves count.
  """
  devices: tuple
  kind: str
  description: str
  device_memory_bytes: int
  count_devices: tuple = ()


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
  # How `flops` was counted when not by XLA ('' = XLA's HLO count; see `counted_flops`).
  flops_from: str = ''
  # A program whose own total exceeds the limit: its largest arrays, e.g.
  # '126.00 GiB f32[786432,43008] (copy_bitcast_fusion.11)' (`largest_arrays`).
  largest: tuple[str, ...] = ()

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
  `time` is the bound on one step's time and its parts (`step_time`; None when
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


# ---------------------------------------------------------------- target devices

def mesh_shape(plan: config_lib.Plan) -> tuple:
  """The mesh the plan compiles for: config.mesh.shape, or (1, 1, 1) for a config without a
  mesh (a run on one device, whose programs are those of the one-device mesh)."""
  return (1, 1, 1) if plan.mesh_shape is None else tuple(plan.mesh_shape)


def num_devices(plan: config_lib.Plan) -> int:
  """Devices the plan's mesh needs (product of config.mesh.shape; no -1 allowed here)."""
  shape = mesh_shape(plan)
  if shape is None or len(shape) not in (3, 4, 5) or any(int(s) < 1 for s in shape):
    raise ValueError(f'config.mesh.shape={shape}: the plan needs explicit sizes of (data, '
                     'fsdp, tensor), (data, fsdp, expert, tensor) or (data, fsdp, expert, '
                     'sequence, tensor), no -1')
  return int(np.prod(shape))


def have_libtpu() -> bool:
  return importlib.util.find_spec('libtpu') is not None


# jax's CUDA plugins (`pip install "jax[cuda12]"`): any of them compiles for a GPU target.
CUDA_PLUGINS = ('jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13')

# GPUs per host of a GPU target: a mesh of more is planned over hosts of this many.
GPUS_PER_HOST = 8


def have_cuda_plugin() -> bool:
  """Whether a CUDA plugin of jax is importable (XLA:GPU can compile here, deviceless)."""
  for name in CUDA_PLUGINS:
    try:
      if importlib.util.find_spec(name) is not None:
        return True
    except ModuleNotFoundError:      # no jax_plugins package at all
      return False
  return False


def gpu_topology(n: int) -> str:
  """XLA:GPU's topology string for `n` GPUs: partitions x hosts x GPUs per host, one
  partition, hosts of `GPUS_PER_HOST` (one host when `n` is at most that)."""
  if n <= GPUS_PER_HOST:
    return f'1x1x{n}'
  if n % GPUS_PER_HOST:
    raise ValueError(f'config.mesh.shape needs {n} GPUs: a mesh over several hosts needs a '
                     f'multiple of {GPUS_PER_HOST} (GPUs per host)')
  return f'1x{n // GPUS_PER_HOST}x{GPUS_PER_HOST}'


def target(plan: config_lib.Plan, backend: str = 'auto',
           device_memory_gib: float | None = None) -> Target:
  """The devices to compile for, per `backend` ('auto', 'tpu', 'gpu' or 'cpu').

  For 'cpu' the JAX CPU backend must have exactly the mesh's device count
  (`use_simulated_cpu_devices` before any JAX work, or XLA_FLAGS); 'tpu' and 'gpu' need
  as many CPU devices to count FLOPs on.
  """
  n = num_devices(plan)
  hw = plan.hardware
  gib = device_memory_gib if device_memory_gib is not None else hw.device_memory_gib
  limit = int(float(gib or 0) * GIB)
  if backend == 'auto':
    backend = default_backend(plan)
  if backend == 'tpu':
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    topo = hw.topology
    if not topo:
      raise ValueError('config.hardware.topology: needed for --backend=tpu (e.g. v5p:4x4x4)')
    slices = mesh_slices(plan)
    # libtpu describes several slices of one topology joined over DCN (`num_slices`); each
    # device then carries its `slice_index`, which `models.topology` lays the mesh out by.
    extra = {'num_slices': slices} if slices > 1 else {}
    devices = tuple(topologies.get_topology_desc(platform='tpu', topology_name=topo,
                                                 **extra).devices)
    if len(devices) != n:
      where = f'{slices} slices of ' if slices > 1 else ''
      raise ValueError(f'config.hardware.topology={topo!r}: {where}it has {len(devices)} chips; '
                       f'config.mesh.shape needs {n}')
    what = f'{slices} slices of topology {topo} (DCN between them)' if slices > 1 else (
        f'topology {topo}')
    desc = (f'{hw.name or topo}: {what} from libtpu, compiled by the TPU '
            f'compiler ({devices[0].device_kind}); over-HBM programs fail to compile')
    return Target(devices, 'tpu', desc, limit, _counting_devices(n))
  if backend == 'gpu':
    return _gpu_target(plan, n, limit)
  if backend != 'cpu':
    raise ValueError(f'--backend={backend!r}: expected auto, tpu, gpu or cpu')
  devices = tuple(jax.devices('cpu'))
  if len(devices) != n:
    raise ValueError(f'{len(devices)} CPU devices, the mesh needs {n}: call '
                     'launch.plan.use_simulated_cpu_devices(n) before any JAX work')
  why = {'tpu': ' (libtpu not installed: pip install "jax[tpu]")',
         'gpu': f' ({_no_gpu_compiler(hw)})'}.get(hw.platform, '')
  desc = (f'{n} simulated CPU devices standing in for {hw.name or "the target"}{why}; '
          'XLA:CPU memory estimates (sampling programs without while-loop-invariant code '
          'motion: `CPU_SAMPLING_OPTIONS`), limit checked here')
  return Target(devices, 'cpu', desc, limit)


def _gpu_target(plan: config_lib.Plan, n: int, limit: int) -> Target:
  """`target`'s 'gpu' branch: `n` GPUs of `config.hardware.gpu_target` from XLA:GPU's
  deviceless topology, and as many CPU devices to count FLOPs on."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  hw = plan.hardware
  if not have_cuda_plugin():
    raise ValueError('--backend=gpu: no CUDA plugin of jax is installed here (one of '
                     f'{", ".join(CUDA_PLUGINS)}): pip install "jax[cuda12]" in its own '
                     'environment (docs/planning.md)')
  path = hw.gpu_target_path()
  if path is None:
    raise ValueError('config.hardware.gpu_target: needed for --backend=gpu (a '
                     'GpuTargetConfigProto text file, e.g. launch/gpu_targets/h200.txtpb)')
  if mesh_slices(plan) > 1:
    raise ValueError(f'config.hardware.slices={hw.slices}: TPU slices; a GPU plan spans hosts '
                     f'of {GPUS_PER_HOST} GPUs (config.mesh.shape), with slices=1')
  try:
    text = path.read_text()
  except OSError as e:
    raise ValueError(f'config.hardware.gpu_target={hw.gpu_target!r}: cannot read {path}: '
                     f'{e.strerror or e}') from e
  topo = gpu_topology(n)
  devices = tuple(topologies.get_topology_desc(platform='cuda', target_config=text,
                                               topology=topo).devices)
  if len(devices) != n:
    raise ValueError(f'XLA:GPU topology {topo} of {hw.gpu_target} has {len(devices)} GPUs; '
                     f'config.mesh.shape needs {n}')
  hosts = int(topo.split('x')[1])
  where = f'{hosts} hosts of {GPUS_PER_HOST}' if hosts > 1 else 'one host'
  desc = (f'{hw.name or "GPU"}: {n} x {devices[0].device_kind} ({where}) as {hw.gpu_target} '
          'describes them, compiled by XLA:GPU deviceless on this CPU host (topology '
          f'{topo}); XLA:GPU compiles over-memory programs, so the limit is checked here')
  return Target(devices, 'gpu', desc, limit, _counting_devices(n))


def _counting_devices(n: int) -> tuple:
  """The n CPU devices a TPU or GPU target's FLOPs are counted on (its compiler returns no
  cost analysis)."""
  cpus = tuple(jax.devices('cpu'))
  if len(cpus) != n:
    raise ValueError(f'{len(cpus)} CPU devices: counting FLOPs needs {n}; call '
                     'launch.plan.use_simulated_cpu_devices(n) before any JAX work')
  return cpus


def _no_gpu_compiler(hw) -> str:
  """Why a GPU target is planned on simulated CPU devices (`default_backend` chose 'cpu')."""
  if not have_cuda_plugin():
    return 'no CUDA plugin of jax installed: pip install "jax[cuda12]", docs/planning.md'
  return 'config.hardware.gpu_target not set: no GPU description for XLA:GPU'


def mesh_slices(plan: config_lib.Plan) -> int:
  """The slices the plan's mesh spans: config.hardware.slices, which config.mesh.slices (where
  set) must equal."""
  hw_slices = plan.hardware.slices
  if plan.mesh_slices is not None and plan.mesh_slices != hw_slices:
    raise ValueError(f'config.mesh.slices={plan.mesh_slices} but config.hardware.slices='
                     f'{hw_slices}: the mesh must span the slices the plan targets')
  return hw_slices


def make_mesh(plan: config_lib.Plan, devices):
  """The plan's mesh on `devices` (`sharding.make_mesh`, over `mesh_slices(plan)` slices)."""
  return sharding.make_mesh(mesh_shape(plan), devices=devices, slices=mesh_slices(plan))


def slices_line(plan: config_lib.Plan, tgt: Target) -> str | None:
  """For a multi-slice target, how the mesh spans the slices (None for one slice)."""
  n = mesh_slices(plan)
  if n == 1:
    return None
  mesh = make_mesh(plan, tgt.devices)
  if tgt.kind == 'tpu':
    return 'slices: ' + topology.describe(mesh.devices, mesh.axis_names)
  return (f"slices: {n}, simulated as {n} consecutive blocks of CPU devices along mesh axis "
          f"{mesh.axis_names[0]!r} (no DCN here)")


def default_backend(plan: config_lib.Plan) -> str:
  """'tpu' when libtpu is installed and the config targets a TPU; 'gpu' when a CUDA plugin of
  jax is installed and the config targets a GPU it describes (`hardware.gpu_target`); else
  'cpu'."""
  hw = plan.hardware
  if hw.platform == 'tpu' and have_libtpu():
    return 'tpu'
  if hw.platform == 'gpu' and hw.gpu_target and have_cuda_plugin():
    return 'gpu'
  return 'cpu'


def use_simulated_cpu_devices(n: int) -> None:
  """Makes the CPU backend expose n devices; must run before JAX initialises a backend."""
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', n)


# ---------------------------------------------------------------- abstract inputs

def _with_shardings(abstract, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def abstract_params(model_cfg, model_kind: str, mesh, rules):
  """(graphdef, params as sharded ShapeDtypeStructs) of the policy or the reward model."""
  graphdef, params = policies.abstract_model(model_cfg, model_kind)
  return graphdef, _with_shardings(params, sharding.state_shardings(params, mesh, rules))


# ---------------------------------------------------------------- compiling

def _flops(lowered) -> float:
  cost = lowered.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
    cost = cost[0] if cost else {}
  return float((cost or {}).get('flops', 0.0))


# XLA:CPU has no bfloat16 dot: it converts a bfloat16 dot's operands to float32 and computes in
# float32, and its while-loop-invariant code motion then hoists the conversion of a whole stacked
# operand out of the decode loop and the layer scan. On 8 simulated devices standing in for one
# H200 node a 14B decode call held float32 copies of every layer's MLP weights (3 x 13.28 GiB) and
# of the KV pool (2 x 16 GiB): 88 GiB of temporaries where a TPU or GPU, which compute bfloat16 dots
# natively, make none. A sampler holds no float32 masters to convert, so its programs are compiled
# on simulated CPU devices without that pass (`sampling_options`); train steps keep it (their
# float32 -> bfloat16 weight casts are the target's too).
CPU_SAMPLING_OPTIONS = {'xla_disable_hlo_passes': 'while-loop-invariant-code-motion'}

# XLA:GPU options for every program compiled for a GPU target. Deviceless, XLA:GPU failed a
# tiny hybrid model's evaluation sampler with "Couldn't find output tile sizes" while fusing a
# matmul into a Triton GEMM (jaxlib 0.10.2, 8 x H200); with Triton GEMM fusions off its dots
# are cuBLAS calls, which it compiles.
GPU_OPTIONS = {'xla_gpu_enable_triton_gemm': False}
GPU_NOTE = ('XLA:GPU compiles with Triton GEMM fusions off (`GPU_OPTIONS`; deviceless it '
            'failed to tile one): its dots are cuBLAS calls.')


def compiler_options(mesh) -> dict | None:
  """Compiler options for any program on `mesh`: GPU_OPTIONS on GPU devices, else None."""
  return dict(GPU_OPTIONS) if mesh.devices.flat[0].platform == 'gpu' else None


def sampling_options(mesh) -> dict | None:
  """Compiler options for a sampling program on `mesh`: CPU_SAMPLING_OPTIONS on CPU devices
  (simulated stand-ins for the target), else the target's (`compiler_options`)."""
  if mesh.devices.flat[0].platform == 'cpu':
    return dict(CPU_SAMPLING_OPTIONS)
  return compiler_options(mesh)


def compile_program(name: str, shapes: str, lower: Callable[[], Any],
                    lower_for_flops: Callable[[], Any] | None = None,
                    flops: float | None = None, flops_from: str = '',
                    limit_bytes: int = 0, compiler_options: dict | None = None) -> ProgramReport:
  """Lowers and compiles one program and reads its memory and FLOP counts.

  Args:
    name: the program's name in the output.
    shapes: what it was compiled for, in words.
    lower: () -> a `jax.stages.Lowered`.
    lower_for_flops: () -> the Lowered to count FLOPs on (default: `lower`'s).
      XLA counts a loop body once, so a train step with microbatches counts
      FLOPs on its single-microbatch twin (lowered only, never compiled).
    flops: the FLOPs when they are not XLA's to count (then nothing is lowered
      for them), with `flops_from` saying how they were counted.
    limit_bytes: per-device limit; a program whose own total exceeds it reports
      its largest arrays.
    compiler_options: XLA options for this compile (`compiler_options`,
      `sampling_options`).

  Returns:
    The report; a compile error (e.g. RESOURCE_EXHAUSTED from the TPU
    compiler) becomes its `error` rather than an exception.
  """
  start, cpu = time.perf_counter(), time.process_time()
  try:
    lowered = lower()
    compiled = lowered.compile(compiler_options=compiler_options)
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ProgramReport(name, shapes, compile_s=time.perf_counter() - start,
                         compile_cpu_s=time.process_time() - cpu,
                         error=f'{type(e).__name__}: {first[:300]}')
  elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
  mem = compiled.memory_analysis()
  get = lambda attr: int(getattr(mem, attr, 0) or 0) if mem is not None else 0
  if flops is None:
    flops, flops_from = _flops(lower_for_flops() if lower_for_flops else lowered), ''
  report = ProgramReport(name, shapes, argument_bytes=get('argument_size_in_bytes'),
                         output_bytes=get('output_size_in_bytes'),
                         temp_bytes=get('temp_size_in_bytes'),
                         alias_bytes=get('alias_size_in_bytes'), flops=flops, compile_s=elapsed,
                         compile_cpu_s=cpu, flops_from=flops_from)
  if limit_bytes and report.total_bytes > limit_bytes:
    report = dataclasses.replace(report, largest=largest_arrays(compiled.as_text()))
  return report


# dtype -> bytes per element, as optimized HLO text spells array types.
_HLO_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 's16': 2, 'u16': 2,
              'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8}
_HLO_ARRAY = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]')


def largest_arrays(hlo_text: str, n: int = 3) -> tuple[str, ...]:
  """The `n` largest distinct array types an optimized HLO module's instructions produce
  outside fusion bodies (a fusion's inner values are never whole in memory), each as
  'SIZE TYPE[SHAPE] (the first instruction that produces one and how many more do)'. A
  pointer to what dominates a program's temporaries: XLA's memory analysis gives totals only."""
  found: dict[tuple[str, str], list] = {}
  skip = False
  for line in hlo_text.splitlines():
    if line and not line[0].isspace():       # a computation's header, or its closing brace
      name = line.split()[0].lstrip('%')
      skip = name.startswith(('fused', 'wrapped')) or 'fusion' in name
      continue
    m = None if skip else _HLO_ARRAY.match(line)
    if m is None or m.group(2) not in _HLO_BYTES:
      continue
    key = (m.group(2), m.group(3))
    if key in found:
      found[key][1] += 1
    else:
      size = int(np.prod([int(d) for d in m.group(3).split(',') if d])) * _HLO_BYTES[key[0]]
      found[key] = [size, 1, m.group(1)]
  top = sorted(found.items(), key=lambda kv: -kv[1][0])[:n]
  return tuple(f'{_size(size)} {dt}[{shape}] ({first}'
               + (f' and {count - 1} more' if count > 1 else '') + ')'
               for (dt, shape), (size, count, first) in top)


# ---------------------------------------------------------------- FLOPs counted from the config

# How the mixture-of-experts families' FLOPs are counted (`counted_flops`), in the output,
# what that means and why (printed once per plan).
COUNTED = 'counted from the config'
WHY_COUNTED = ("FLOPs counted from the config: matmuls of the active parameters and attention "
               "scores, Mamba's scan left out (a lower bound). XLA's count does not apply to the "
               'routed experts: on TPU their grouped matmul is a Pallas kernel, whose work XLA '
               'does not count; XLA:CPU lowers ragged_dot as a dense dot of every expert of a '
               'shard over every token-expert pair; and a shard_map body is counted once, not '
               'once per device.')
NOT_COUNTED = "not counted (the paged engine's calls of a mixture-of-experts model)"


# Matmul FLOPs counted from the model config (models/flops.py).
counted_flops = flops.counted_flops


def _train_flops(stage, model_cfg, mesh, rules) -> float:
  """A train step's counted FLOPs: every '*tokens' field of its largest batch, causal."""
  batch, _ = kinds.get(stage.kind).abstract_batch(stage, mesh, rules)
  tokens = [v for k, v in batch._asdict().items() if k.endswith('tokens')]
  length = tokens[0].shape[1]
  return counted_flops(model_cfg, stage.MODEL, sum(int(np.prod(t.shape)) for t in tokens),
                       (length + 1) / 2, train=True)


def _sampler_flops(model_cfg, mesh, rules, sampler_cfg: dict, *, rows: int, prompt_len: int,
                   max_new_tokens: int, num_samples: int = 1, frozen: bool = False,
                   **_) -> tuple[float, str]:
  """(counted FLOPs, how) of one one-call sampler call: its prefill (a prompt once for the rows
  that share it) and every decode step over the filled part of the cache. The paged engine's
  calls are left uncounted."""
  if sampler_cfg.get('engine', 'one_call') != 'one_call':
    return 0.0, NOT_COUNTED
  sampler, _ = sampler_for(model_cfg, mesh, rules, sampler_cfg, frozen=frozen)
  p, nb, b = sampler.call_shape(rows, prompt_len, max_new_tokens)
  u = b // sampler.prefill_group(b, num_samples)
  return (counted_flops(model_cfg, 'policy', u * p, (p + 1) / 2, head_tokens=u)
          + counted_flops(model_cfg, 'policy', b * nb, p + (nb + 1) / 2)), COUNTED


_SAMPLERS: dict = {}


def sampler_for(model_cfg, mesh, rules, sampler_cfg: dict, frozen: bool = False):
  """(the Sampler the plan lowers, the policy's abstract params as a stage hands them to it:
  the train state's, in the master dtype, in the training layout; `frozen`: a frozen model's
  (a judge's), in the model's own dtype).

  The Sampler turns them into its rollout copy (`rollout_cast`, `rollout_rules`) as a run's
  does, so the plan lowers the weights the run samples with. One Sampler per model, mesh and
  options (it traces its programs once to find the copy's dtypes).
  """
  try:
    key = (model_cfg, mesh, rules, tuple(sorted(sampler_cfg.items())), frozen)
    hash(key)
  except TypeError:
    key = None
  if key is not None and key in _SAMPLERS:
    return _SAMPLERS[key]
  got = _new_sampler(model_cfg, mesh, rules, sampler_cfg, frozen)
  if key is not None:
    if len(_SAMPLERS) > 16:
      _SAMPLERS.clear()
    _SAMPLERS[key] = got
  return got


def _new_sampler(model_cfg, mesh, rules, sampler_cfg: dict, frozen: bool = False):
  graphdef, params = abstract_params(model_cfg, 'policy', mesh, rules)
  master = None if frozen else policies.master_dtype(model_cfg)
  if master is not None:
    dt = jnp.dtype(master)
    params = jax.tree.map(
        lambda a: (jax.ShapeDtypeStruct(a.shape, dt, sharding=a.sharding)
                   if jnp.issubdtype(a.dtype, jnp.floating) else a), params)
  return sampler_lib.Sampler(graphdef, model_cfg, eos_ids=(0,), pad_id=0, mesh=mesh,
                             rules=rules, **sampler_cfg), params


def rollout_copy_bytes(sampler, params) -> int:
  """Per-device bytes of the sampler's own copy of the weights while it runs (0: it samples
  with the train state's params as they are)."""
  rolled = sampler.rollout_params(params)
  return 0 if rolled is params else _tree_bytes(rolled)


def decode_read_bytes(model_cfg, sampler, rows: int) -> float:
  """Per-device bytes of weights one decode step over `rows` rows reads, in the sampler's layout.

  Every weight the device holds (the rollout layout when `rollout_rules` reshards them),
  except that of its routed experts only those the step's tokens reach count: a
  shard's expert group sees R tokens (its batch shard's rows, times the 'expert' axes the
  rows are gathered over, as models/moe.py does), each choosing K of the E experts; with
  choices spread evenly an expert is reached with probability 1 - (1 - K/E)^R.
  """
  mesh, rules = sampler.mesh, sampler.rules
  reached = _experts_reached(model_cfg, mesh, rules, rows) if model_cfg.num_experts else 1.0
  _, params = policies.abstract_model(model_cfg, 'policy')
  _, given = sampler_for(model_cfg, mesh, rules, {})
  rolled = jax.tree.leaves(sampler.rollout_params(given))   # the dtypes the sampler reads
  flat = nnx.to_flat_state(params)
  assert len(rolled) == len(flat), (len(rolled), len(flat))
  total = 0.0
  for (_, v), leaf in zip(flat, rolled):
    shape = v.get_value().shape
    axes = v.get_metadata().get('logical_axes') or (None,) * len(shape)
    spec = sharding.logical_to_spec(axes, shape, mesh, rules)
    shard = NamedSharding(mesh, spec).shard_shape(shape)
    total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize * (
        reached if 'experts' in axes else 1.0)
  return total


def _experts_reached(cfg, mesh, rules, rows: int) -> float:
  """The expected fraction of a shard's routed experts that one decode step over `rows` rows
  reaches (see `decode_read_bytes`)."""
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  axes = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
  spec = sharding.logical_to_spec(('experts', 'embed', 'moe_mlp'),
                                  (cfg.num_experts, cfg.embed_dim, cfg.moe_dim), mesh, rules)
  ep, tp = axes(spec[0]), axes(spec[2])
  split = [a for a in axes(sharding.logical_to_spec(('batch',), (rows,), mesh, rules)[0])
           if a not in tp]
  seen = rows / np.prod([sizes[a] for a in split]) * np.prod([sizes[a] for a in split
                                                              if a in ep])
  return float(1 - (1 - cfg.experts_per_token / cfg.num_experts) ** seen)


def sampler_lowering(model_cfg, mesh, rules, sampler_cfg: dict, *, rows: int, prompt_len: int,
                     max_new_tokens: int, top_p: float, top_k: int, num_samples: int = 1,
                     program: str = 'decode', frozen: bool = False):
  """The sampler for one `Sampler.generate` call of these sizes, on `mesh` (`program`: the
  paged engine's 'decode' or 'prefill' call, see `Sampler.abstract_args`).

  Returns:
    (() -> Lowered, description of the shapes).
  """
  sampler, params = sampler_for(model_cfg, mesh, rules, sampler_cfg, frozen=frozen)
  sp = sampler_lib.SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k,
                                  max_new_tokens=max_new_tokens)
  _, _, what = sampler.abstract_args(params, rows, prompt_len, sp, num_samples, program)
  if model_cfg.mamba_layers and sampler_cfg.get('engine', 'one_call') == 'one_call':
    what += '; ' + row_state_note(model_cfg, sampler, rows, prompt_len, max_new_tokens)
  return (lambda: sampler.lower(params, rows, prompt_len, sp, num_samples, program)), what


def row_state_note(model_cfg, sampler, rows: int, prompt_len: int, max_new_tokens: int) -> str:
  """What a one-call sampler chunk keeps per device for its rows: the attention sublayers'
  KV cache and the Mamba sublayers' state (which the Sampler charges each row in KV slots,
  `rl.sampler.state_slots`), e.g. 'per device 128 rows x (KV cache 108.00 MiB + Mamba state 46.79 MiB)'.
  """
  mesh, rules = sampler.mesh, sampler.rules
  p, nb, b = sampler.call_shape(rows, prompt_len, max_new_tokens)
  per_device = b // sharding.batch_shards(mesh, rules)
  kv = kv_token_bytes(model_cfg, mesh, rules) * (p + nb)
  state = state_row_bytes(model_cfg, mesh, rules)
  return f'per device {per_device} rows x (KV cache {_size(kv)} + Mamba state {_size(state)})'


def sampler_programs(sampler_cfg: dict) -> tuple[tuple[str, str], ...]:
  """(program, report name) of each call the configured sampler compiles."""
  programs = sampler_lib.PROGRAMS[sampler_cfg.get('engine', 'one_call')]
  return tuple((p, 'sampler' if p == 'decode' else f'sampler {p}') for p in programs)


def train_lowering(stage, model_cfg, mesh, rules, microbatches: int | None = None):
  """The stage's train step (as its runner builds it) for its largest batch, on `mesh`.

  Returns:
    (() -> Lowered, description of the batch).
  """
  kind = kinds.get(stage.kind)
  graphdef, params = abstract_params(model_cfg, stage.MODEL, mesh, rules)
  optimizer = train_lib.make_optimizer(kinds.base.optimizer_config(stage))
  state = policies.abstract_state(params, optimizer, mesh, rules,
                                  policies.master_dtype(model_cfg))
  step = loop.build_train_step(kind, stage, graphdef, state, mesh, rules,
                               microbatches=microbatches)
  batch, what = kind.abstract_batch(stage, mesh, rules)
  if not model_cfg.scans_layers:
    what += ', layers unrolled'
  packed = None if microbatches else getattr(stage, 'microbatch_rows', None)
  rows = packed or jax.tree.leaves(batch)[0].shape[0] // (microbatches or stage.microbatches)
  shards, split = sharding.batch_shards(mesh, rules), _split(rows, 'batch', mesh, rules)
  if split < shards:
    what += (f'; {rows} rows per microbatch over {shards} batch shards: each row on '
             f'{shards // split} devices')
  return (lambda: step.lower(state, batch)), what


def _split(n: int, name: str, mesh, rules) -> int:
  """How many ways a dimension of `n` along logical axis `name` splits over `mesh`."""
  return sharding.split_ways(n, name, mesh, rules)


def plan_stage(stage, model_cfg, mesh, rules, sampler_cfg: dict,
               limit_bytes: int, with_sampler: bool = True, count_mesh=None,
               with_train: bool = True, rm_stages=(), hardware=None, judges=(),
               loaded=None) -> StageReport:
  """Compiles a training stage's train step (and, for RL, its sampler) for `mesh`.

  Args:
    stage: the resolved stage.
    model_cfg: the policy's ModelConfig.
    mesh: the target mesh.
    rules: logical sharding rules.
    sampler_cfg: config.sampler (bucket sizes).
    limit_bytes: per-device memory limit (0 = none).
    with_sampler: compile an RL stage's sampler too.
    count_mesh: a mesh of the same shape whose backend counts FLOPs on lowered
      programs (the TPU topology's does not; CPU devices do); default `mesh`.
    with_train: compile the train step.
    rm_stages: reward_model stages whose models score this stage's rollouts.
    hardware: config.hardware (peak_tflops, hbm_gbps for the time bound).
    judges: the judge models its training verifiers call (`judge_calls`): their programs are
      compiled and their scoring is in the time bound.
    loaded: {source: (ModelConfig, generates)}: the judges resident while it runs
      (`loaded_judges`), counted beside every program.

  Returns:
    The StageReport.
  """
  count_mesh = mesh if count_mesh is None else count_mesh
  programs = []
  kind = kinds.get(stage.kind)
  # XLA counts a loop body once: FLOPs are counted on a twin lowered (never
  # compiled) with the layers unrolled and the batch in one microbatch. The
  # mixture-of-experts families' are counted from the config instead (`counted_flops`).
  unrolled = dataclasses.replace(model_cfg, scan_layers=False)

  def add(name: str, lowering: Callable[..., Any], *args, suffix: str = '', twin_kwargs=None,
          count: Callable[[], tuple[float, str]] | None = None, options=None):
    """lowering(model_cfg, mesh, *args) -> (() -> Lowered, shapes); count() -> (FLOPs, how);
    options: compiler options (default `compiler_options(mesh)`)."""
    lower, what = lowering(model_cfg, mesh, *args)
    options = compiler_options(mesh) if options is None else options
    if not model_cfg.is_dense:
      flops, how = count()
      programs.append(compile_program(name, what + suffix, lower, flops=flops, flops_from=how,
                                      limit_bytes=limit_bytes, compiler_options=options))
      return
    twin = lowering(unrolled, count_mesh, *args, **(twin_kwargs or {}))[0]
    programs.append(compile_program(name, what + suffix, lower, twin, limit_bytes=limit_bytes,
                                    compiler_options=options))

  if with_train and kind.abstract_batch is not None:
    add('train step', lambda cfg, m, **k: train_lowering(stage, cfg, m, rules, **k),
        twin_kwargs={'microbatches': 1},
        count=lambda: (_train_flops(stage, model_cfg, mesh, rules), COUNTED))
  sizes = (kind.sampler_sizes(stage) if with_sampler and kind.sampler_sizes is not None
           else None)
  if sizes is not None:
    for program, name in sampler_programs(sampler_cfg):
      add(name, lambda cfg, m, program=program: sampler_lowering(
          cfg, m, rules, sampler_cfg, **sizes, program=program),
          count=lambda: _sampler_flops(model_cfg, mesh, rules, sampler_cfg, **sizes),
          options=sampling_options(mesh))
  frozen = kind.frozen_forwards(stage) if kind.frozen_forwards is not None else []
  for ff in frozen:
    copies = f'cop{"y" if ff.copies == 1 else "ies"}'
    add(ff.name, lambda cfg, m, ff=ff: forward_lowering(cfg, 'policy', m, rules, ff.rows,
                                                          ff.length),
        suffix=(f' per call, {ff.calls} calls' if ff.calls > 1 else '')
        + (f'; {ff.copies} {copies} in host memory' if ff.on_host
           else f'; {ff.copies} resident {copies}'),
        count=lambda ff=ff: _forward_flops(model_cfg, 'policy', mesh, rules, ff.rows, ff.length))
  rm = list(rm_stages or ())
  for rm_stage in rm:
    rows, length = rm_scoring_call(stage, rm_stage)
    add(f'reward model scoring ({rm_stage.name})',
        lambda cfg, m, rows=rows, length=length: forward_lowering(cfg, 'reward_model', m, rules,
                                                                  rows, length),
        count=lambda rows=rows, length=length: _forward_flops(model_cfg, 'reward_model', mesh,
                                                              rules, rows, length))
  programs += judge_programs(judges, mesh, rules, sampler_cfg, limit_bytes, model_cfg)
  copy = 0
  if sizes is not None:
    sampler, given = sampler_for(model_cfg, mesh, rules, sampler_cfg)
    copy = rollout_copy_bytes(sampler, given)
  resident = _resident(stage, model_cfg, mesh, rules, programs, frozen, rm,
                       rollout_copy=copy > 0, judges=judges, loaded=loaded,
                       sampler_cfg=sampler_cfg, copy_bytes=copy)
  time = step_time(stage, kind, model_cfg, mesh, rules, hardware or config_lib.Hardware(),
                   sampler_cfg, rm_stages=rm, judges=judges)
  return StageReport(stage.index, stage.name, stage.kind, tuple(programs), limit_bytes,
                     mesh.size, resident=resident, time=time, steps=getattr(stage, 'steps', 0))


def _tree_bytes(tree) -> int:
  """Per-device bytes of a pytree of sharded ShapeDtypeStructs."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shape)) * x.dtype.itemsize
  return total


def _params_bytes(model_cfg, model_kind, mesh, rules, dtype=None) -> int:
  _, params = abstract_params(model_cfg, model_kind, mesh, rules)
  if dtype is not None:
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype, sharding=a.sharding),
                          params)
  return _tree_bytes(params)


def _resident(stage, model_cfg, mesh, rules, programs, frozen, rm_stages,
              rollout_copy: bool = False, judges=(), loaded=None, sampler_cfg=None,
              copy_bytes: int = 0):
  """Per program: what stays in device memory beside it without being its argument.

  Loaded judges (`loaded`) stay beside every program. A judge's own program runs while the
  stage collects: beside it the whole train state, the policy's rollout copy
  (`copy_bytes`), and with `stream_filter` the policy sampler's arguments (its engine's
  pools: scoring overlaps decoding).
  """
  if stage.MODEL is None:
    return ()
  held = {src: judge_bytes(cfg, gen, mesh, rules, sampler_cfg or {}, model_cfg)
          for src, (cfg, gen) in (loaded or {}).items()}
  judge_total = sum(a + b for a, b in held.values())
  by_name = {}
  for jc in judges:
    params, jcopy = held.get(jc.source) or judge_bytes(
        jc.model_cfg, jc.use.score_by == 'generate', mesh, rules, sampler_cfg or {}, model_cfg)
    passed = jcopy if (jc.use.score_by == 'generate' and jcopy) else params
    by_name[jc.domain] = passed if jc.source in held else 0
  decoding = (max((p.argument_bytes for p in programs if p.name.startswith('sampler')),
                  default=0) if getattr(stage, 'stream_filter', False) else 0)
  optimizer = train_lib.make_optimizer(kinds.base.optimizer_config(stage))
  _, params = abstract_params(model_cfg, stage.MODEL, mesh, rules)
  state = _tree_bytes(policies.abstract_state(params, optimizer, mesh, rules,
                                              policies.master_dtype(model_cfg)))
  master = policies.master_dtype(model_cfg)
  policy_params = _params_bytes(model_cfg, 'policy', mesh, rules, master and np.float32)
  # The policy sampler's arguments hold the params it samples with, already counted: its
  # rollout copy (copy_bytes) or else the train state's own params.
  decoding = max(0, decoding - (copy_bytes or policy_params)) if decoding else 0
  # Frozen copies kept in host memory are on the devices only as their own pass's arguments.
  one_copy = _params_bytes(model_cfg, 'policy', mesh, rules)
  frozen_bytes = sum(ff.copies for ff in frozen if not ff.on_host) * one_copy
  on_device = {ff.name: not ff.on_host for ff in frozen}
  rm_bytes = len(rm_stages) * _params_bytes(model_cfg, 'reward_model', mesh, rules)
  out = []
  for p in programs:
    if p.name.startswith('judge'):
      domain = p.name[p.name.rindex('(') + 1:-1]
      extra = (state + frozen_bytes + rm_bytes + judge_total - by_name.get(domain, 0) + copy_bytes
               + decoding)
      out.append((p.name, extra))
      continue
    if p.name == 'train step':
      extra = frozen_bytes + rm_bytes
    elif p.name.startswith('sampler'):   # the state, minus the params it is given unless it
                                          # samples with its own copy (cast or resharded)
      extra = (state if rollout_copy else state - policy_params) + frozen_bytes + rm_bytes
    elif p.name.startswith('reward model scoring'):
      extra = state + frozen_bytes + rm_bytes - rm_bytes // max(1, len(rm_stages))
    else:                                         # a frozen forward: its params are arguments
      extra = state + rm_bytes + frozen_bytes - (one_copy if on_device.get(p.name) else 0)
    out.append((p.name, extra + judge_total))
  return tuple(out)


# ---------------------------------------------------------------- the step-time model

# What the step-time bound (`step_time`) assumes, printed with it.
TIME_ASSUMPTIONS = (
    'every device call (a decode step, a prefill) takes max(the bytes it reads per device / '
    'hardware.hbm_gbps, its FLOPs per device / hardware.peak_tflops): reads and compute '
    'overlap perfectly, and collectives, host syncs, launches and sampling itself are free',
    "every row of a round generates the longest phase's max_response_len tokens: a one-call "
    "chunk runs to the cap, the paged engine's slots turn over in whole waves",
    "a decode step reads per device the weights in the sampler's layout (of routed experts, "
    'those its tokens reach); for each of its rows the K and V of every attention sublayer '
    "over the keys it attends (one-call: the decode phase's cache extent, every row of the "
    "chunk; paged: the row's filled pages); each Mamba sublayer's state, read and written. "
    'A prefill call reads the weights once; its KV writes are left out',
    'FLOPs counted from the config (`counted_flops`: matmuls and attention scores; Mamba\'s '
    'scan, norms and the embedding gather left out), for the prefill, the update (each of '
    'updates_per_batch), the frozen passes and reward-model scoring, all at peak',
    'one sampling round per step (the bound); dynamic filtering runs up to 1 + refill_cap '
    "rounds, stream_filter feeds up to 1 + refill_cap batches (the worst case: sampling and "
    'scoring that many times)',
    'scoring by verifiers on the hosts is not estimated (host CPU time, partly hidden behind '
    'sampling); a reward model\'s scoring pass is, every row of the round at its full length '
    "up to the reward-model stage's max_len",
    "a judge model's scoring is: every sample of the round judged (pairwise: both orders; "
    'round robin: G - 1 rows per sample), every judge row at the judge\'s longest row '
    "(rl.judge.MAX_LEN tokens, within its positions); 'logits': one forward per batch of rl.judge.BATCH_SIZE rows, "
    "each max(reading the judge's weights, its FLOPs at peak); 'generate': one greedy sampler "
    "call of max_new_tokens per row, bounded as the policy's sampling is",
    "an agentic episode: one call per turn, the turns' prompts growing by the turns before "
    '(observations left out); with the paged engine a KV session holds them',
)


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A bound on one step's time in seconds, by part (`step_time`; `TIME_ASSUMPTIONS`).

  Sampling is one round's: `weights`, `kv` and `state` the decode steps' reads of the weights,
  the KV cache and the Mamba states at HBM bandwidth; `compute` what the decode steps' FLOPs
  at peak add where they exceed those reads (each step costs the larger); `prefill` the
  prefill calls. `scoring` is None where it is not estimated (verifiers on the hosts).
  `rounds`: the most sampling rounds a step may run (the worst case). `weights_only`: the
  bound this model replaces (one read of the weights per new token of each chunk, the rest
  FLOPs at peak).
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

  @property
  def sampling(self) -> float:
    return self.weights + self.kv + self.state + self.compute + self.prefill

  @property
  def bound(self) -> float:
    """One round: sampling, scoring where estimated, the update and the frozen passes."""
    return self.sampling + (self.scoring or 0.0) + self.judge + self.update + self.frozen

  @property
  def worst(self) -> float:
    """`rounds` rounds of sampling and scoring, one update."""
    return (self.rounds * (self.sampling + (self.scoring or 0.0) + self.judge) + self.update
            + self.frozen)


kv_token_bytes = sampler_lib.kv_token_bytes
state_row_bytes = sampler_lib.row_state_bytes


def sampling_time(model_cfg, sampler, hw, *, rows: int, prompt_len: int, max_new_tokens: int,
                  num_samples: int = 1, continued: bool = False, **_) -> dict:
  """One `Sampler.generate` call's time bound in parts (`StepTime`'s sampling fields, seconds)
  and its decode steps, every row generating `max_new_tokens` (`TIME_ASSUMPTIONS`).

  One-call: per chunk of rows, a prefill of its distinct prompts (`prefill_group`) over the
  prompt bucket, then max_new_tokens - 1 decode steps, the step s of decode phase i (ends[i-1]
  <= s < ends[i], `decode_phases`) attending the cache extent prompt bucket + ends[i] for every
  row of the chunk. Paged: the prompts' first len - 1 tokens prefilled once per prompt in calls
  of `prefill_prompts` (none when `continued`), then per wave of `slots` rows max_new_tokens
  decode steps, step j attending the prompt_len + j keys of each row in whole pages.

  Returns:
    dict(weights, kv, state, compute, prefill, decode_steps).
  """
  peak, bw = hw.peak_tflops * 1e12, hw.hbm_gbps * 1e9
  cfg, mesh, rules = model_cfg, sampler.mesh, sampler.rules
  n, shards = mesh.size, sharding.batch_shards(mesh, rules)
  p, nb, chunk = sampler.call_shape(rows, prompt_len, max_new_tokens)
  m = min(max_new_tokens, nb)
  prefills = []      # (calls, tokens per call, keys per token on average)
  if sampler.engine == 'one_call':
    slots = chunk
    keys, count, lo = [], [], 1
    ends = sampler_lib._phase_ends(nb, sampler.decode_phases)  # pylint: disable=protected-access
    for end in ends:
      hi = min(m, end)
      if hi > lo:
        keys.append(p + end)
        count.append(hi - lo)
      lo = max(lo, hi)
    keys, count = np.asarray(keys, float), np.asarray(count, float)
    u = chunk // sampler.prefill_group(chunk, num_samples)
    prefills.append((-(-rows // chunk), u * p, (p + 1) / 2, u))
  else:
    eng = sampler._rollout.engine(chunk)  # pylint: disable=protected-access
    slots, ps = eng.opt.slots, eng.opt.page_size
    keys = np.ceil((prompt_len + np.arange(m)) / ps) * ps
    count = np.ones(m)
    if not continued:
      a, t = eng.opt.prefill_prompts, eng.prefill_tokens(prompt_len)
      prompts = -(-rows // num_samples)               # each prompt once, for its G rows
      prefills.append((-(-prompts // a), a * t, (t + 1) / 2, 0))
  waves = -(-rows // slots)
  rows_dev = slots // shards
  weights = decode_read_bytes(cfg, sampler, slots)
  kv = rows_dev * keys * kv_token_bytes(cfg, mesh, rules)
  state = rows_dev * 2 * state_row_bytes(cfg, mesh, rules)       # read and written
  f0 = counted_flops(cfg, 'policy', slots, 0.0)
  flops = f0 + (counted_flops(cfg, 'policy', slots, 1.0) - f0) * keys     # linear in the keys
  reads = (weights + kv + state) / bw
  out = dict(weights=float(waves * count.sum() * weights / bw),
             kv=waves * float((count * kv).sum()) / bw,
             state=float(waves * count.sum() * state / bw),
             compute=waves * float((count * np.maximum(0.0, flops / (n * peak) - reads)).sum()),
             prefill=0.0, decode_steps=int(waves * count.sum()))
  for calls, tokens, context, head in prefills:
    f = counted_flops(cfg, 'policy', tokens, context, head_tokens=head)
    out['prefill'] += calls * max(decode_read_bytes(cfg, sampler, tokens) / bw, f / (n * peak))
  return out


def step_time(stage, kind, model_cfg, mesh, rules, hw, sampler_cfg: dict,
              rm_stages=(), judges=()) -> StepTime | None:
  """The time bound of one step of `stage` and its parts, from the config alone (nothing is
  compiled; `TIME_ASSUMPTIONS`), on `hw` (`peak_tflops`, `hbm_gbps`); None when it names
  neither.

  Args:
    stage, kind: the resolved stage and its kind.
    model_cfg, mesh, rules: the policy, the target mesh and its logical rules.
    hw: config.hardware.
    sampler_cfg: config.sampler's options.
    rm_stages: the reward_model stages whose models score this stage's rows.
    judges: the judge models its verifiers call (`judge_calls`).

  Returns:
    The StepTime.
  """
  peak, bw = hw.peak_tflops * 1e12, hw.hbm_gbps * 1e9
  if not peak or not bw:
    return None
  at_peak = lambda flops: flops / (mesh.size * peak)
  parts = dict(weights=0.0, kv=0.0, state=0.0, compute=0.0, prefill=0.0, decode_steps=0)
  old = 0.0
  sizes = kind.sampler_sizes(stage) if kind.sampler_sizes is not None else None
  if sizes is not None:
    sampler, _ = sampler_for(model_cfg, mesh, rules, sampler_cfg)
    for call in (kind.sampler_calls(stage) if kind.sampler_calls is not None else [sizes]):
      for k, v in sampling_time(model_cfg, sampler, hw, **call).items():
        parts[k] += v
    # The bound this replaces: per new token of each chunk of the largest call, one read of
    # the weights a decode step reads; the paged engine's prefill calls at peak.
    chunk = sampler.call_shape(sizes['rows'], sizes['prompt_len'], sizes['max_new_tokens'])[2]
    old += (-(-sizes['rows'] // chunk) * sizes['max_new_tokens']
            * decode_read_bytes(model_cfg, sampler, chunk) / bw)
    if sampler.engine == 'paged':
      eng = sampler._rollout.engine(chunk)  # pylint: disable=protected-access
      a, t = eng.opt.prefill_prompts, eng.prefill_tokens(sizes['prompt_len'])
      prompts = -(-sizes['rows'] // sizes.get('num_samples', 1))
      old += -(-prompts // a) * at_peak(counted_flops(model_cfg, 'policy', a * t, (t + 1) / 2,
                                                      head_tokens=0))
  update = 0.0
  if kind.abstract_batch is not None:
    one = at_peak(_train_flops(stage, model_cfg, mesh, rules))
    update, old = getattr(stage, 'updates_per_batch', 1) * one, old + one
  frozen = sum(ff.calls * at_peak(_forward_flops(model_cfg, 'policy', mesh, rules, ff.rows,
                                                 ff.length)[0])
               for ff in (kind.frozen_forwards(stage) if kind.frozen_forwards else []))
  old += frozen
  scoring = None
  if sizes is not None and rm_stages:
    rows, length = sizes['rows'], stage.max_prompt_len + stage.longest_response
    scoring = sum(at_peak(counted_flops(model_cfg, 'reward_model', rows * min(length, s.score_len),
                                        (min(length, s.score_len) + 1) / 2)) for s in rm_stages)
    old += sum(at_peak(_forward_flops(model_cfg, 'reward_model', mesh, rules, s.batch_size,
                                      s.max_len)[0]) for s in rm_stages)
  judge = (judge_time(judges, mesh, rules, hw, sampler_cfg, model_cfg) if sizes is not None
           else 0.0)
  rounds = 1 + stage.refill_cap if getattr(stage, 'dynamic_filter', False) else 1
  steps = parts.pop('decode_steps')
  return StepTime(**parts, scoring=scoring, judge=judge, update=update, frozen=frozen,
                  rounds=rounds,
                  weights_only=old, decode_steps=steps)


def _forward_rows(rows: int, mesh, rules) -> int:
  """A frozen pass's rows per call, rounded up to whole batch shards."""
  return -(-rows // sharding.batch_shards(mesh, rules)) * sharding.batch_shards(mesh, rules)


def _forward_flops(model_cfg, model_kind, mesh, rules, rows, length) -> tuple[float, str]:
  """(counted FLOPs, how) of one call of a frozen pass (log-probs or scores of every row)."""
  n = _forward_rows(rows, mesh, rules)
  return counted_flops(model_cfg, model_kind, n * length, (length + 1) / 2), COUNTED


def forward_lowering(model_cfg, model_kind: str, mesh, rules, rows: int, length: int):
  """A frozen model's scoring pass (policy log-probs, or reward-model scores), on `mesh`.

  Returns:
    (() -> Lowered, description of the shapes).
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from rl import batch as batch_lib  # pylint: disable=g-import-not-at-top
  from rl import reward_model  # pylint: disable=g-import-not-at-top
  graphdef, params = abstract_params(model_cfg, model_kind, mesh, rules)
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, model_cfg.jnp_param_dtype
                                                       if jnp.issubdtype(a.dtype, jnp.floating)
                                                       else a.dtype, sharding=a.sharding), params)
  rows = _forward_rows(rows, mesh, rules)
  row_sh = NamedSharding(mesh, sharding.logical_to_spec(('batch', None), (rows, length), mesh,
                                                        rules))
  mat = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=row_sh)

  def lower():
    with sharding.use_mesh(mesh, rules):
      if model_kind == 'reward_model':
        return reward_model.score.lower(graphdef, params, mat, mat)
      return batch_lib._logprobs_jit.lower(graphdef, params, mat, mat, mat, mat)  # pylint: disable=protected-access
  return lower, f'{rows} rows x {length} tokens'




# ---------------------------------------------------------------- judge models

@dataclasses.dataclass(frozen=True)
class JudgeCall:
  """A judge model one domain's verifier calls (`Verifier.judge_use`), as the plan counts it.

  Attributes:
    source: ('hf', path) or ('stage', name), as `cascade.verifier_set` names it.
    where: the config field naming it.
    domain: the domain it scores.
    model_cfg: the judge's ModelConfig as the run loads it (an HF judge: its config.json;
      a stage's: the policy's, in the model's dtype).
    use: how the verifier calls it (`verifiers.base.JudgeUse`).
    rows: judge rows of one scoring call (the samples scored x rows_per_sample).
  """
  source: tuple
  where: str
  domain: str
  model_cfg: Any
  use: Any
  rows: int


def _judge_model_cfg(plan, source: tuple, where: str):
  """The judge's ModelConfig, read from its config.json (an HF judge) without its weights."""
  import json  # pylint: disable=g-import-not-at-top
  from models import hf  # pylint: disable=g-import-not-at-top
  from models import paths  # pylint: disable=g-import-not-at-top
  if source[0] == 'stage':
    return plan.model
  path = paths.join(source[1], 'config.json')
  try:
    return hf.config_from_hf(json.loads(paths.read_text(path)))
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{where}={source[1]!r}: launch.plan reads the judge's architecture from "
                     f'{path}: {type(e).__name__}: {e}') from None


def _judge_uses(plan, domains, field: str, group_size, samples: int, model_for):
  """JudgeCalls of `domains`' verifiers (field 'verifier_options' or 'eval_verifier_options')."""
  import verifiers  # pylint: disable=g-import-not-at-top
  from cascade import verifier_set  # pylint: disable=g-import-not-at-top
  vs = verifier_set.VerifierSet(plan, rm_scorer=None, rm_ready=None)
  out = []
  for d in domains:
    dom = plan.domains[d]
    if dom.agentic:
      continue
    name = dom.verifier if field == 'verifier_options' else dom.eval_verifier
    opts = dict(getattr(dom, field))
    source = vs.judge_source(d, field, opts)
    if source is None:
      continue
    use = verifiers.cls(name).judge_use(opts, group_size)
    if use is None:
      continue
    where = f'config.domains.{d}.{field}.{verifiers.cls(name).judge_option}'
    out.append(JudgeCall(source, where, d, model_for(_judge_model_cfg(plan, source, where)),
                         use, samples * use.rows_per_sample))
  return out


def judge_calls(plan, stage, model_for=lambda cfg: cfg) -> list:
  """The judges a sampling stage's training verifiers call, one JudgeCall per domain; every
  sample of the stage's largest round is scored (`sampler_sizes`' rows)."""
  kind = kinds.get(stage.kind)
  if not stage.SAMPLES or kind.sampler_sizes is None:
    return []
  sizes = kind.sampler_sizes(stage)
  return _judge_uses(plan, stage.domains, 'verifier_options', sizes.get('num_samples', 1),
                     sizes['rows'], model_for)


def eval_judge_calls(plan, model_for=lambda cfg: cfg) -> list:
  """The judges the evaluation's verifiers call (each domain's batch of samples at once)."""
  out = []
  settings = dict(plan.eval_settings or {})
  for d in plan.domains:
    ev = settings.get(d, plan.eval)
    n = 1 if ev.greedy else ev.num_samples
    out += _judge_uses(plan, [d], 'eval_verifier_options', n, ev.batch_size * n, model_for)
  return out


def loaded_judges(plan, index: int, model_for=lambda cfg: cfg) -> dict:
  """{source: (ModelConfig, whether it generates)} of the judges resident while stage `index`
  runs (index None: during the last evaluation). The run loads a judge at its first use and
  keeps it (`cascade.verifier_set`): a stage at or before `index` whose training verifier
  calls it, or an evaluation before that stage (one follows every stage; one precedes the
  first with config.initial_eval). A stage's judge is used only after that stage has run."""
  last = len(plan.stages)
  index = last if index is None else index
  out = {}
  first: dict = {}
  for st in plan.stages:
    for jc in judge_calls(plan, st, model_for):
      if st.index <= index:
        first.setdefault(jc.source, []).append(jc)
  evals = eval_judge_calls(plan, model_for)
  for jc in evals:
    after = (plan.stage(jc.source[1]).index if jc.source[0] == 'stage'
             else (-1 if plan.initial_eval else 0))
    if after < index:
      first.setdefault(jc.source, []).append(jc)
  for source, calls in first.items():
    out[source] = (calls[0].model_cfg, any(c.use.score_by == 'generate' for c in calls))
  return out


def judge_sampler_options(sampler_cfg: dict, judge_cfg, policy_cfg, mesh, rules) -> dict:
  """A judge's Sampler options from the run's, as `cascade.policies.judge_model` builds it
  (`rl.judge.run_sampler_options`; policy_cfg None: the run's options count the judge's own
  KV slots)."""
  from rl import judge as judge_lib  # pylint: disable=g-import-not-at-top
  return judge_lib.run_sampler_options(sampler_cfg, judge_cfg, policy_cfg or judge_cfg, mesh,
                                       rules)


def judge_bytes(judge_cfg, generates: bool, mesh, rules, sampler_cfg: dict,
                policy_cfg=None) -> tuple[int, int]:
  """(per-device bytes of a loaded judge's params, of its rollout copy, made once when it
  generates; 0 when it samples with its params as they are)."""
  params = _params_bytes(judge_cfg, 'policy', mesh, rules)
  if not generates:
    return params, 0
  sampler, given = sampler_for(
      judge_cfg, mesh, rules,
      judge_sampler_options(sampler_cfg, judge_cfg, policy_cfg, mesh, rules), frozen=True)
  return params, rollout_copy_bytes(sampler, given)


def judge_row_len(judge_cfg, new_tokens: int = 0) -> int:
  """A judge row's longest prompt: `rl.judge.MAX_LEN`, within the judge's positions."""
  from rl import judge as judge_lib  # pylint: disable=g-import-not-at-top
  return max(1, min(judge_lib.MAX_LEN, judge_cfg.max_seq_len - new_tokens))


def judge_forward_lowering(judge_cfg, mesh, rules):
  """A 'logits' judge's forward (`rl.judge.choice_logprobs_fn`) over one batch of its longest
  rows, on `mesh`.

  Returns:
    (() -> Lowered, description of the shapes, rows).
  """
  from rl import judge as judge_lib  # pylint: disable=g-import-not-at-top
  graphdef, params = abstract_params(judge_cfg, 'policy', mesh, rules)
  rows, length = _forward_rows(judge_lib.BATCH_SIZE, mesh, rules), judge_row_len(judge_cfg)
  row_sh = NamedSharding(mesh, sharding.logical_to_spec(('batch', None), (rows, length), mesh,
                                                        rules))
  mat = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=row_sh)
  ids = jax.ShapeDtypeStruct((2,), jnp.int32)

  def lower():
    with sharding.use_mesh(mesh, rules):
      return judge_lib.choice_logprobs_fn.lower(graphdef, params, mat, mat, ids)
  return lower, f'{rows} rows x {length} tokens per forward', rows


def judge_programs(calls, mesh, rules, sampler_cfg: dict, limit_bytes: int,
                   policy_cfg=None) -> list:
  """Compiles each judge call's programs: a 'logits' judge's forward; a 'generate' judge's
  sampler for all its rows at its longest prompt (`judge_row_len`)."""
  out = []
  for jc in calls:
    cfg = jc.model_cfg
    if jc.use.score_by == 'logits':
      lower, what, rows = judge_forward_lowering(cfg, mesh, rules)
      calls_n, length = -(-jc.rows // rows), judge_row_len(cfg)
      flops = counted_flops(cfg, 'policy', rows * length, (length + 1) / 2, head_tokens=rows)
      out.append(compile_program(f'judge ({jc.domain})', f'{what}, {calls_n} forwards', lower,
                                 flops=flops, flops_from=COUNTED, limit_bytes=limit_bytes,
                                 compiler_options=compiler_options(mesh)))
      continue
    opts = judge_sampler_options(sampler_cfg, cfg, policy_cfg, mesh, rules)
    sizes = dict(rows=jc.rows, prompt_len=judge_row_len(cfg, jc.use.max_new_tokens),
                 max_new_tokens=jc.use.max_new_tokens, top_p=1.0, top_k=0, num_samples=1)
    for program, name in sampler_programs(opts):
      lower, what = sampler_lowering(cfg, mesh, rules, opts, **sizes, program=program,
                                     frozen=True)
      flops, how = _sampler_flops(cfg, mesh, rules, opts, **sizes, frozen=True)
      out.append(compile_program(f'judge {name} ({jc.domain})', what, lower, flops=flops,
                                 flops_from=how, limit_bytes=limit_bytes,
                                 compiler_options=sampling_options(mesh)))
  return out


def judge_time(calls, mesh, rules, hw, sampler_cfg: dict, policy_cfg=None) -> float:
  """Seconds of one scoring call of every judge (`TIME_ASSUMPTIONS`)."""
  from rl import judge as judge_lib  # pylint: disable=g-import-not-at-top
  peak, bw = hw.peak_tflops * 1e12, hw.hbm_gbps * 1e9
  total = 0.0
  for jc in calls:
    cfg = jc.model_cfg
    if jc.use.score_by == 'logits':
      rows, length = _forward_rows(judge_lib.BATCH_SIZE, mesh, rules), judge_row_len(cfg)
      flops = counted_flops(cfg, 'policy', rows * length, (length + 1) / 2, head_tokens=rows)
      reads = _params_bytes(cfg, 'policy', mesh, rules)
      total += -(-jc.rows // rows) * max(reads / bw, flops / (mesh.size * peak))
      continue
    sampler, _ = sampler_for(cfg, mesh, rules,
                             judge_sampler_options(sampler_cfg, cfg, policy_cfg, mesh, rules),
                             frozen=True)
    parts = sampling_time(cfg, sampler, hw, rows=jc.rows,
                          prompt_len=judge_row_len(cfg, jc.use.max_new_tokens),
                          max_new_tokens=jc.use.max_new_tokens)
    parts.pop('decode_steps')
    total += sum(parts.values())
  return total


def plan_eval(plan, model_cfg, mesh, rules, sampler_cfg: dict, limit_bytes: int,
              count_mesh=None, model_for=lambda cfg: cfg) -> StageReport:
  """Compiles the evaluation's largest sampler call (batch_size prompts x num_samples, the
  longest prompt and response any domain's settings allow; an agentic domain's last turn has
  the opening prompt and the whole episode budget as its prompt) and the programs of the
  judges its verifiers call; the judges loaded by then stay beside every program."""
  settings = dict(plan.eval_settings or {})
  evs = list(settings.values()) or [plan.eval]
  agentic = lambda d: d in plan.domains and plan.domains[d].agentic
  longest = [e.max_prompt_len + (e.max_new_tokens if agentic(d) else 0)
             for d, e in settings.items()] or [plan.eval.max_prompt_len]
  sizes = dict(rows=max(e.batch_size * (1 if e.greedy else e.num_samples) for e in evs),
               prompt_len=max(longest),
               max_new_tokens=max(e.max_new_tokens for e in evs),
               top_p=min(e.top_p for e in evs), top_k=max(e.top_k for e in evs),
               num_samples=min(1 if e.greedy else e.num_samples for e in evs))
  progs = []
  for program, name in sampler_programs(sampler_cfg):
    lower, what = sampler_lowering(model_cfg, mesh, rules, sampler_cfg, **sizes, program=program)
    if not model_cfg.is_dense:     # counted from the config (`counted_flops`)
      flops, how = _sampler_flops(model_cfg, mesh, rules, sampler_cfg, **sizes)
      progs.append(compile_program(f'eval {name}', what, lower, flops=flops, flops_from=how,
                                   limit_bytes=limit_bytes,
                                   compiler_options=sampling_options(mesh)))
      continue
    # Counted on a twin with the layers unrolled (XLA counts a scan body once).
    twin = sampler_lowering(dataclasses.replace(model_cfg, scan_layers=False),
                            mesh if count_mesh is None else count_mesh, rules, sampler_cfg,
                            **sizes, program=program)[0]
    progs.append(compile_program(f'eval {name}', what, lower, twin, limit_bytes=limit_bytes,
                                 compiler_options=sampling_options(mesh)))
  calls = eval_judge_calls(plan, model_for)
  progs += judge_programs(calls, mesh, rules, sampler_cfg, limit_bytes, model_cfg)
  held = {src: sum(judge_bytes(cfg, gen, mesh, rules, sampler_cfg, model_cfg))
          for src, (cfg, gen) in loaded_judges(plan, None, model_for).items()}
  total = sum(held.values())
  passed = {}
  for jc in calls:
    params, copy = judge_bytes(jc.model_cfg, jc.use.score_by == 'generate', mesh, rules,
                               sampler_cfg, model_cfg)
    passed[jc.domain] = (copy or params) if jc.source in held else 0
  resident = tuple((p.name, total - passed[p.name[p.name.rindex('(') + 1:-1]]
                    if p.name.startswith('judge') else total) for p in progs)
  return StageReport(-1, 'evaluation', 'eval', tuple(progs), limit_bytes, mesh.size,
                     resident=resident)


def rm_scoring_call(stage, rm_stage) -> tuple[int, int]:
  """(rows, padded length) of the largest call in which `rm_stage`'s reward model scores
  `stage`'s rollouts: their longest row (prompt, response and EOS, cut to its score_max_len)
  in its length bucket, as many rows as `cascade.policies.scoring_call_tokens` allows."""
  from cascade import policies  # pylint: disable=g-import-not-at-top
  from rl import reward_model  # pylint: disable=g-import-not-at-top
  length = reward_model.row_length(stage.max_prompt_len + stage.longest_response + 1,
                                   rm_stage.score_len)
  return (reward_model.rows_per_call(length, rm_stage.batch_size,
                                     policies.scoring_call_tokens(rm_stage)), length)


def _rm_stages(plan, stage) -> list:
  """The reward_model stages whose models score a sampling stage's rollouts."""
  import verifiers  # pylint: disable=g-import-not-at-top
  if not stage.SAMPLES:
    return []
  names = []
  for d in stage.domains:
    dom = plan.domains[d]
    if dom.reward_model_stage and verifiers.cls(dom.verifier).reward_model_option:
      names.append(dom.reward_model_stage)
  return [plan.stage(n) for n in dict.fromkeys(names)]


def for_target(plan: config_lib.Plan, tgt: Target) -> tuple[Any, Any, dict]:
  """(the policy's ModelConfig, the logical rules, config.sampler's options) as the target's
  programs run them."""
  rules, sampler_cfg = plan.rules, plan.sampler.options()
  if tgt.kind in ('tpu', 'gpu') or plan.hardware.platform in ('tpu', 'gpu'):
    # 'auto' resolves by the devices compiled for (these CPUs when simulated); the
    # accelerator's programs scan their layers.
    if sampler_cfg.get('decode_layers', 'auto') == 'auto':
      sampler_cfg['decode_layers'] = 'scan'
  return target_model(plan, tgt, plan.model), rules, sampler_cfg


def target_model(plan: config_lib.Plan, tgt: Target, model_cfg):
  """A ModelConfig (the policy's, a judge's) as the target's programs run it."""
  if tgt.kind in ('tpu', 'gpu') and model_cfg.attention == 'auto':
    # 'auto' resolves by the backend JAX runs on (this CPU host); the TPU programs use splash,
    # the GPU programs the Pallas (Triton) flash kernel, as 'auto' picks on those devices.
    model_cfg = model_cfg.replace(attention={'tpu': 'splash', 'gpu': 'gpu_flash'}[tgt.kind])
  if (tgt.kind in ('tpu', 'gpu') or plan.hardware.platform in ('tpu', 'gpu')) and (
      model_cfg.scan_layers == 'auto'):
    model_cfg = model_cfg.replace(scan_layers=True)
  return model_cfg


def _check_stages(plan: config_lib.Plan, stages: Sequence[str]) -> None:
  unknown = [s for s in stages if s not in [st.name for st in plan.stages]]
  if unknown:
    raise ValueError(f'--stages: unknown stage(s) {unknown}; the config has '
                     f'{[st.name for st in plan.stages]}')


def time_plan(plan: config_lib.Plan, tgt: Target, *, stages: Sequence[str] = (),
              report: Callable[[StageReport], None] | None = None) -> list[StageReport]:
  """Every selected training stage's step-time bound (`step_time`), compiling nothing: the
  FLOP and byte counts come from the config, the sampler's traced (not compiled) programs
  and abstract shapes. Each StageReport has no programs."""
  model_cfg, rules, sampler_cfg = for_target(plan, tgt)
  mesh = make_mesh(plan, tgt.devices)
  _check_stages(plan, stages)
  out = []
  for st in plan.stages:
    if (stages and st.name not in stages) or st.MODEL is None:
      continue
    time = step_time(st, kinds.get(st.kind), model_cfg, mesh, rules, plan.hardware,
                     sampler_cfg, rm_stages=_rm_stages(plan, st),
                     judges=judge_calls(plan, st, lambda c: target_model(plan, tgt, c)))
    out.append(StageReport(st.index, st.name, st.kind, (), tgt.device_memory_bytes, mesh.size,
                           time=time, steps=getattr(st, 'steps', 0)))
    if report:
      report(out[-1])
  return out


def run_plan(plan: config_lib.Plan, tgt: Target, *, stages: Sequence[str] = (),
             with_sampler: bool = True, with_eval: bool = True, with_train: bool = True,
             report: Callable[[StageReport], None] | None = None) -> list[StageReport]:
  """Compiles every selected stage for the config's mesh on `tgt`'s devices.

  Args:
    plan: the validated config (`cascade.config.validate`).
    tgt: from `target`.
    stages: stage names to plan (default: every training stage).
    with_sampler: compile RL stages' samplers too.
    with_eval: compile the evaluation's sampler too.
    with_train: compile the train steps.
    report: called with each StageReport as soon as it is ready.

  Returns:
    One StageReport per planned stage (and 'evaluation' last).
  """
  model_cfg, rules, sampler_cfg = for_target(plan, tgt)
  hw = plan.hardware
  mesh = make_mesh(plan, tgt.devices)
  count_mesh = make_mesh(plan, tgt.count_devices) if tgt.count_devices else mesh
  _check_stages(plan, stages)
  out = []
  for st in plan.stages:
    if stages and st.name not in stages:
      continue
    model_for = lambda c: target_model(plan, tgt, c)
    rep = plan_stage(st, model_cfg, mesh, rules, sampler_cfg, tgt.device_memory_bytes,
                     with_sampler, count_mesh, with_train, rm_stages=_rm_stages(plan, st),
                     hardware=hw, judges=judge_calls(plan, st, model_for) if with_sampler
                     else (), loaded=loaded_judges(plan, st.index, model_for))
    if not rep.programs:         # e.g. an SFT stage with --notrain
      continue
    out.append(rep)
    if report:
      report(rep)
  if with_eval:
    out.append(plan_eval(plan, model_cfg, mesh, rules, sampler_cfg, tgt.device_memory_bytes,
                         count_mesh, model_for=lambda c: target_model(plan, tgt, c)))
    if report:
      report(out[-1])
  return out


# ---------------------------------------------------------------- output

def _size(n: int) -> str:
  """Bytes in the largest binary unit that keeps the number >= 1."""
  for unit, scale in (('GiB', GIB), ('MiB', 2 ** 20), ('KiB', 2 ** 10)):
    if abs(n) >= scale:
      return f'{n / scale:.2f} {unit}'
  return f'{n} B'


def format_stage(r: StageReport) -> str:
  """A stage's block of the printed plan."""
  head = f'[{r.index}] {r.name} ({r.kind})' if r.index >= 0 else f'{r.name}'
  lines = [head]
  for p in r.programs:
    lines.append(f'  {p.name}: {p.shapes}')
    if p.error:
      lines.append(f'    DOES NOT COMPILE: {p.error} (after {p.compile_s:.1f} s, '
                   f'{p.compile_cpu_s:.1f} s of CPU)')
      continue
    peak = r.peak(p)
    status = 'fits' if r.fits_program(p) else 'DOES NOT FIT'
    if r.limit_bytes:
      status += f' ({peak / r.limit_bytes:.0%} of {r.limit_bytes / GIB:.0f} GiB)'
    lines.append(f'    per device: arguments {_size(p.argument_bytes)}, outputs '
                 f'{_size(p.output_bytes)}, temporaries {_size(p.temp_bytes)}, aliased '
                 f'{_size(p.alias_bytes)}; total {_size(p.total_bytes)}'
                 + (f' + resident beside it {_size(peak - p.total_bytes)} = '
                    f'{_size(peak)}' if peak != p.total_bytes else '') + f': {status}')
    for a in p.largest:
      lines.append(f'    largest array: {a}')
    sampler = p.name in ('sampler', 'eval sampler')
    per = ('per step' if p.name == 'train step' else
           'for one decode step' if p.shapes.startswith('paged engine:') else
           'per call (its prefill and every decode step)' if sampler and p.flops_from else
           'for the prefill and one decode step per decode phase' if sampler else 'per call')
    if p.flops_from and not p.flops:
      flops = f'FLOPs {p.flops_from}'
    else:
      flops = (f'FLOPs {per}' + (f' ({p.flops_from})' if p.flops_from else '')
               + f': {p.flops:.3e} in all, {p.flops / r.num_devices:.3e} per device')
    lines.append(f'    {flops}; compiled in {p.compile_s:.1f} s ({p.compile_cpu_s:.1f} s of '
                 'CPU)')
  if r.time is not None:
    lines += ['  ' + line for line in time_lines(r)]
  return '\n'.join(lines)


def _num(x: float) -> str:
  """3 significant digits, whole numbers from 100 up (1,234 rather than 1.23e+03)."""
  return f'{x:,.0f}' if abs(x) >= 100 else f'{x:.3g}'


def _secs(x: float) -> str:
  return f'{_num(x)} s'


def time_lines(r: StageReport) -> list[str]:
  """A stage's step-time bound in words: per step with its parts, the worst case of its
  rounds, and per stage in chip-hours beside the weights-only bound it replaces."""
  t = r.time
  parts = []
  if t.sampling:
    parts.append(f'sampling {_secs(t.sampling)} (weights {_secs(t.weights)}, KV cache '
                 f'{_secs(t.kv)}, Mamba state {_secs(t.state)}, compute beyond the reads '
                 f'{_secs(t.compute)}, prefill {_secs(t.prefill)}; {t.decode_steps} decode '
                 'steps)')
    parts.append('scoring ' + ('not estimated (verifiers on the hosts)' if t.scoring is None
                               else f'{_secs(t.scoring)} (reward model)'))
    if t.judge:
      parts.append(f'judge models {_secs(t.judge)}')
  parts.append(f'update {_secs(t.update)}')
  if t.frozen:
    parts.append(f'frozen passes {_secs(t.frozen)}')
  out = [f'step time bound: {_secs(t.bound)} per step = ' + ' + '.join(parts)]
  if t.rounds > 1:
    out.append(f'worst case, {t.rounds} sampling rounds (1 + refill_cap): {_secs(t.worst)} '
               'per step')
  out.append(f'{r.steps} steps = {_num(r.chip_hours(t.bound))} chip-hours'
             + (f' (worst case {_num(r.chip_hours(t.worst))})' if t.rounds > 1 else '')
             + f'; the weights-only bound it replaces: {_secs(t.weights_only)} per step, '
             f'{_num(r.chip_hours(t.weights_only))} chip-hours')
  return out


def time_table(reports: Sequence[StageReport], assumptions: bool = True) -> list[str]:
  """Markdown lines: one row per stage with a time bound (seconds per step by part, and per
  stage in chip-hours beside the weights-only bound it replaces), then (`assumptions`) what
  the bound assumes."""
  timed = [r for r in reports if r.time is not None]
  if not timed:
    return []
  g = _num
  out = ['| stage | steps | sampling: weights / KV / state / compute / prefill (s) | scoring (s) '
         '| update (s) | frozen (s) | bound (s / step) | chip-hours | worst case: rounds, '
         'chip-hours | weights-only bound (s / step, chip-hours) |',
         '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
  for r in timed:
    t = r.time
    sampling = (' / '.join(g(x) for x in (t.weights, t.kv, t.state, t.compute, t.prefill))
                if t.sampling else '')
    scoring = '' if not t.sampling else 'not estimated' if t.scoring is None else g(t.scoring)
    if t.judge:
      scoring = f'{scoring} + judge {g(t.judge)}' if t.scoring is not None else (
          f'judge {g(t.judge)}')
    out.append(f'| {r.name} | {r.steps} | {sampling} | {scoring} | {g(t.update)} | '
               f'{g(t.frozen)} | {g(t.bound)} | {g(r.chip_hours(t.bound))} | {t.rounds}, '
               f'{g(r.chip_hours(t.worst))} | {g(t.weights_only)}, '
               f'{g(r.chip_hours(t.weights_only))} |')
  if assumptions:
    out += ['', 'The bound assumes:', '', *[f'- {a}' for a in TIME_ASSUMPTIONS]]
  return out


def model_notes(model_cfg, tgt: Target) -> list[str]:
  """Lines on what the plan's numbers mean for this model on this target (none for a dense one)."""
  if model_cfg.is_dense:
    return []
  out = [WHY_COUNTED]
  if not model_cfg.num_experts:
    return out
  if tgt.kind == 'tpu':
    out.append('routed experts: compiled with the megablox grouped-matmul kernel (Pallas, a '
               'real Mosaic kernel: models/moe.py chooses it by the mesh\'s platform).')
  elif tgt.kind == 'gpu':
    out.append("routed experts: compiled as models/moe.py's 'tiled' grouped matmul, chosen by "
               "the mesh's platform: tile loops (fori_loops in plain XLA, every row tile once "
               'per group with rows in it, forward and both gradients), where XLA:GPU would '
               'expand ragged_dot into dense [rows, experts, width] arrays.')
  else:
    out.append('routed experts: XLA:CPU turns each ragged_dot into a dense dot over '
               '[experts per shard, token-expert pairs, width] (XLA\'s generic '
               'RaggedDotRewriter); where they dominate, the largest arrays of a program '
               'that does not fit are listed.')
  return out


def markdown_report(reports: Sequence[StageReport], *, command: str, header: Sequence[str],
                    hosts: Sequence[str], date: str, failed: Sequence[str] = (),
                    finished: bool = True) -> str:
  """The plan as a Markdown page: how it was made (command, date, this host's CPUs and load
  before and after, which set the compile times), the header lines `main` prints, one row per
  program (per-device peak beside what stays resident, its share of the device, compile time,
  FLOPs; none with --time_only) and each stage's step-time bound by part with the
  assumptions (`time_table`); `finished` False marks a page written part-way (after each
  stage), which says so instead of a result."""
  limit = next((r.limit_bytes for r in reports if r.limit_bytes), 0)
  cell = lambda text: text.replace('|', '\\|')        # a table cell's own bars, escaped
  out = [f'# Plan: `{command}`', '',
         f'Written by `launch.plan --report` on {date}, on {cpu_model()}.', '',
         *[f'- {h}' for h in (hosts[0] + ' (before)', hosts[-1] + ' (after)', *header)]]
  if any(r.programs for r in reports):
    out += ['', '| stage | program | shapes | per device | '
            + (f'of {_size(limit)} | ' if limit else '') + 'compile (CPU) | FLOPs |',
            '|---|---|---|---:|' + ('---:|' if limit else '') + '---:|---:|']
  for r in reports:
    for p in r.programs:
      if p.error:
        out.append(f'| {r.name} | {p.name} | {cell(p.shapes)} | DOES NOT COMPILE: '
                   f'{cell(p.error)} |' + (' |' if limit else '')
                   + f' {p.compile_s:.0f} s ({p.compile_cpu_s:.0f} s) | |')
        continue
      peak = r.peak(p)
      share = (f' {100 * peak / r.limit_bytes:.0f} %' + ('' if r.fits_program(p) else
                                                         ' DOES NOT FIT') + ' |'
               if limit else '')
      flops = ('not counted' if p.flops_from and not p.flops else f'{p.flops:.3g}')
      out.append(f'| {r.name} | {p.name} | {cell(p.shapes)} | {_size(peak)} |{share} '
                 f'{p.compile_s:.0f} s ({p.compile_cpu_s:.0f} s) | {flops} |')
  if any(r.time is not None for r in reports):
    out += ['', 'Step-time bound per stage (`launch.plan.step_time`; seconds per step by part, '
            'chip-hours per stage):', '', *time_table(reports)]
  if not finished:
    out += ['', f'Unfinished: the plan was still running (or was stopped) after '
            f'{len(reports)} stage(s); the rows above are the stages it had planned.']
  else:
    out += ['', 'Result: ' + ('PLAN FAILED: ' + '; '.join(failed) if failed else
                              'every planned program fits.' if any(r.programs for r in reports)
                              else 'step times only, nothing compiled.')]
  return '\n'.join(out) + '\n'


def failures(reports: Sequence[StageReport]) -> list[str]:
  """One message per stage that does not fit, naming the stage and the program."""
  out = []
  for r in reports:
    for p in r.programs:
      if r.fits_program(p):
        continue
      what = p.error or (f'needs {r.peak(p) / GIB:.2f} GiB per device (with what stays '
                         f'resident beside it) > {r.limit_bytes / GIB:.2f} GiB')
      out.append(f'stage {r.name!r} (index {r.index}): {p.name} does not fit: {what}')
  return out


# config_flags.DEFINE_config_file(lock_config=True) whose overrides also name stages and unset
# fields, as cascade.main's (cascade/overrides.py).
_CONFIG = overrides.define_config_file('config', 'Config file (configs/x.py or configs/x.py:arg).')
_BACKEND = flags.DEFINE_enum('backend', 'auto', ['auto', 'tpu', 'gpu', 'cpu'],
                             'tpu: libtpu topology; gpu: XLA:GPU deviceless for '
                             'config.hardware.gpu_target (needs a CUDA plugin of jax); cpu: '
                             'simulated CPU devices; auto: tpu when libtpu is installed and the '
                             'config targets a TPU, gpu when a CUDA plugin is and it targets a '
                             'GPU it describes, else cpu.')
_STAGES = flags.DEFINE_list('stages', [], 'Stage names to plan (default: all).')
_MEMORY = flags.DEFINE_float('device_memory_gib', None,
                             'Per-device memory limit (default: config.hardware).')
_TRAIN = flags.DEFINE_bool('train', True, "Compile the stages' train steps.")
_SAMPLER = flags.DEFINE_bool('sampler', True, "Compile RL stages' samplers.")
_EVAL = flags.DEFINE_bool('eval', True, "Compile the evaluation's sampler.")
_TIME_ONLY = flags.DEFINE_bool(
    'time_only', False, "Only each stage's step-time bound and its parts (`step_time`), "
    'compiling nothing (seconds, even for the paper configs); --backend, --train, --sampler '
    'and --eval do not apply.')
_REPORT = flags.DEFINE_string(
    'report', None, 'Also write the plan as a Markdown page here (any etils.epath path, e.g. '
    'docs/plans/x.md or gs://bucket/plans/x.md): the command, date, host and its load, the '
    "target, and one table row per program (`markdown_report`).")


def cpu_model() -> str:
  """This host's CPU, e.g. 'AMD EPYC 7B13 (x86_64)'."""
  try:
    with open('/proc/cpuinfo') as f:
      names = [l.split(':', 1)[1].strip() for l in f if l.startswith('model name')]
  except OSError:
    names = []
  return f'{names[0] if names else platform.processor() or "a CPU"} ({platform.machine()})'


def _host_load() -> str:
  """This host's CPU count and load average: compile times depend on what else runs."""
  load = ', '.join(f'{x:.2f}' for x in os.getloadavg())
  return f'host: {os.cpu_count()} CPUs, load average {load} (1, 5, 15 min)'


def plan_header(plan: config_lib.Plan, tgt: Target, time_only: bool = False) -> list[str]:
  """The lines a plan starts with: the target, the mesh and model, how FLOPs and memory are
  counted, and (with a time bound) what it assumes."""
  model_cfg = plan.model
  axes = ', '.join(sharding.mesh_axes(len(mesh_shape(plan))))
  active = (f' ({model_cfg.num_params(active=True) / 1e9:.2f}B active per token)'
            if model_cfg.num_experts else '')
  hw = plan.hardware
  out = [f'target: {hw.name or hw.platform}: step times only (--time_only), '
         'nothing compiled: FLOPs and bytes counted from the config and abstract shapes'
         if time_only else f'target: {tgt.description}',
         f'mesh ({axes}) = {mesh_shape(plan)}'
         + (' (no mesh: one device)' if plan.mesh_shape is None else '')
         + f'; model {plan.model_name}: {model_cfg.num_params() / 1e9:.2f}B parameters{active} in '
         f'{model_cfg.param_dtype}, compute {model_cfg.dtype}, remat={model_cfg.remat}']
  slices = None if time_only else slices_line(plan, tgt)
  if slices:
    out.append(slices)
  if not time_only:
    out += [*model_notes(model_cfg, tgt), *([GPU_NOTE] if tgt.kind == 'gpu' else []),
            'memory is per device; total = arguments + outputs + temporaries - aliased '
            '(donated) buffers. ' + (
                "FLOPs are XLA's HLO count: a train step's over the whole batch; a sampler's "
                'for its prefill and one step per decode loop (XLA counts a loop body once)'
                if model_cfg.is_dense else "FLOPs: a train step's over the whole batch; a "
                "sampler's for the whole call")]
  if hw.peak_tflops and hw.hbm_gbps:
    out.append(f'step-time bound at {hw.peak_tflops:g} TFLOP/s and {hw.hbm_gbps:g} GB/s per '
               'chip; it assumes: ' + '; '.join(TIME_ASSUMPTIONS) + '.')
  return out


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None:
    raise app.UsageError('--config is required')
  plan = config_lib.validate(config)     # touches no device
  time_only = _TIME_ONLY.value
  backend = 'cpu' if time_only else _BACKEND.value
  if backend == 'auto':
    backend = default_backend(plan)
  # Backends start lazily: this takes effect as long as nothing has touched a
  # device yet (the config file only imports modules). The TPU and GPU paths need
  # the CPU devices too: FLOPs are counted on CPU lowerings of the same mesh (and with
  # jax_platforms 'cpu' the CUDA plugin looks for no GPU: it only compiles).
  use_simulated_cpu_devices(num_devices(plan))
  tgt = target(plan, backend, _MEMORY.value)
  header = plan_header(plan, tgt, time_only)
  load_before = _host_load()
  print('\n'.join([header[0], load_before, *header[1:]]) + '\n', flush=True)
  command = 'python -m launch.plan ' + ' '.join(sys.argv[1:])
  started = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
  done: list[StageReport] = []

  def write_page(final: bool, bad=()):
    """The --report page, rewritten after every stage (a long plan interrupted keeps what it
    planned, marked unfinished) and once at the end."""
    if not _REPORT.value:
      return
    path = epath.Path(_REPORT.value)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown_report(
        done, command=command, header=header, hosts=(load_before, _host_load()),
        date=started, failed=bad, finished=final))
    if final:
      print(f'wrote {path}')

  def on_stage(r: StageReport):
    print(format_stage(r), flush=True)
    done.append(r)
    write_page(final=False)

  if time_only:
    reports = time_plan(plan, tgt, stages=_STAGES.value, report=on_stage)
  else:
    reports = run_plan(plan, tgt, stages=_STAGES.value, with_sampler=_SAMPLER.value,
                       with_eval=_EVAL.value, with_train=_TRAIN.value, report=on_stage)
  print(f'\n{_host_load()}')
  bad = failures(reports)
  done[:] = reports
  write_page(final=True, bad=bad)
  if bad:
    print('\nPLAN FAILED:\n  ' + '\n  '.join(bad), file=sys.stderr, flush=True)
    sys.exit(1)
  print(f'\nstep times of {len(reports)} stage(s), nothing compiled.' if time_only else
        f'\nevery planned program fits ({len(reports)} stage(s) planned).')
