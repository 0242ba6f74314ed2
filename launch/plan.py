"""Ahead-of-time plan: compile every stage's programs for the config's mesh, without weights.

The target devices, the abstract inputs, the compiling, the co-resident and
time accounting and the command line are the steps of one command and share its
report types, so they live in one module.

    python -m launch.plan --config=configs/nemotron_cascade_14b.py
    python -m launch.plan --config=configs/tiny.py --stages=sft,math_rl --backend=cpu

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
- donated aliases, from `compiled.memory_analysis()`) and XLA's FLOP count
(`cost_analysis()`; XLA counts a loop body once, so FLOPs are counted on a
twin lowered with the layers unrolled and the batch in one microbatch; a
sampler's prefill and one step per decode loop), and exits with status 1 naming every stage
that does not fit the per-device memory in `config.hardware`.

Target devices: with `libtpu` importable (`pip install "jax[tpu]"`, not a
dependency of cascade) the real TPU compiler runs against
`config.hardware.topology` (e.g. 'v5p:4x4x4') on this CPU host, and an
over-HBM program fails at compile time. Without it, simulated CPU devices of
the same count stand in: argument sizes are exact, temporaries are XLA:CPU's
(its fusion and layouts differ from the TPU's), and the limit is checked
here. The output says which.

plus the frozen passes a step runs (the kind's `frozen_forwards`: a KL or DPO
reference, MOPD teachers) and the reward model's scoring pass for stages whose
domains are scored by one. Each program's fit is checked with what stays
resident beside it (the optimizer state beside the sampler, frozen references,
teachers and reward models beside everything): the co-resident peak. With
`hardware.peak_tflops` and `hardware.hbm_gbps` it prints a lower bound per
step (compute at peak; one read of the weights per new token while sampling)
and per stage in chip-hours. Not compiled: the per-phase variants shorter than
a stage's longest phase (they need less memory).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
from ml_collections import config_flags

import jax
import numpy as np

from cascade import config as config_lib
from cascade import kinds
from cascade import policies
from cascade.kinds import loop
from models import sharding
from rl import sampler as sampler_lib
from rl import train_step as train_lib

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Target:
  """Where the programs are compiled for.

  Attributes:
    devices: the devices the mesh is built from (TPU topology devices or CPU).
    kind: 'tpu' (libtpu's compiler, real HBM limit) or 'cpu' (simulated).
    description: one line for the output.
    device_memory_bytes: the per-device limit checked against (0 = none).
    count_devices: CPU devices of the same count to count FLOPs on (the TPU
      topology client returns no cost analysis for lowered programs); empty
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
  error: str = ''

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
  `seconds` is a lower bound on one step's time from the programs' FLOPs and
  weight reads against the chip's peak (0 when the hardware names none), and
  `steps` the stage's step count.
  """
  index: int
  name: str
  kind: str
  programs: tuple[ProgramReport, ...]
  limit_bytes: int
  num_devices: int
  resident: tuple[tuple[str, int], ...] = ()
  seconds: float = 0.0
  steps: int = 0

  def peak(self, p: ProgramReport) -> int:
    return p.total_bytes + dict(self.resident).get(p.name, 0)

  def fits_program(self, p: ProgramReport) -> bool:
    return not p.error and (not self.limit_bytes or self.peak(p) <= self.limit_bytes)

  @property
  def fits(self) -> bool:
    return all(self.fits_program(p) for p in self.programs)


# ---------------------------------------------------------------- target devices

def num_devices(plan: config_lib.Plan) -> int:
  """Devices the plan's mesh needs (product of config.mesh.shape; no -1 allowed here)."""
  shape = plan.mesh_shape
  if shape is None or len(shape) not in (3, 4) or any(int(s) < 1 for s in shape):
    raise ValueError(f'config.mesh.shape={shape}: the plan needs explicit sizes of (data, '
                     'fsdp, tensor) or (data, fsdp, expert, tensor), no -1')
  return int(np.prod(shape))


def have_libtpu() -> bool:
  return importlib.util.find_spec('libtpu') is not None


def target(plan: config_lib.Plan, backend: str = 'auto',
           device_memory_gib: float | None = None) -> Target:
  """The devices to compile for, per `backend` ('auto', 'tpu' or 'cpu').

  For 'cpu' the JAX CPU backend must have exactly the mesh's device count
  (`use_simulated_cpu_devices` before any JAX work, or XLA_FLAGS).
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
    devices = tuple(topologies.get_topology_desc(platform='tpu', topology_name=topo).devices)
    if len(devices) != n:
      raise ValueError(f'config.hardware.topology={topo!r} has {len(devices)} chips; '
                       f'config.mesh.shape needs {n}')
    desc = (f'{hw.name or topo}: topology {topo} from libtpu, compiled by the TPU '
            f'compiler ({devices[0].device_kind}); over-HBM programs fail to compile')
    cpus = tuple(jax.devices('cpu'))
    if len(cpus) != n:
      raise ValueError(f'{len(cpus)} CPU devices: counting FLOPs needs {n}; call '
                       'launch.plan.use_simulated_cpu_devices(n) before any JAX work')
    return Target(devices, 'tpu', desc, limit, cpus)
  if backend != 'cpu':
    raise ValueError(f'--backend={backend!r}: expected auto, tpu or cpu')
  devices = tuple(jax.devices('cpu'))
  if len(devices) != n:
    raise ValueError(f'{len(devices)} CPU devices, the mesh needs {n}: call '
                     'launch.plan.use_simulated_cpu_devices(n) before any JAX work')
  why = '' if hw.platform != 'tpu' else ' (libtpu not installed: pip install "jax[tpu]")'
  desc = (f'{n} simulated CPU devices standing in for {hw.name or "the target"}{why}; '
          'XLA:CPU memory estimates, limit checked here')
  return Target(devices, 'cpu', desc, limit)


def default_backend(plan: config_lib.Plan) -> str:
  """'tpu' when libtpu is installed and the config targets a TPU, else 'cpu'."""
  return 'tpu' if have_libtpu() and plan.hardware.platform == 'tpu' else 'cpu'


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


def compile_program(name: str, shapes: str, lower: Callable[[], Any],
                    lower_for_flops: Callable[[], Any] | None = None) -> ProgramReport:
  """Lowers and compiles one program and reads its memory and FLOP counts.

  Args:
    name: the program's name in the output.
    shapes: what it was compiled for, in words.
    lower: () -> a `jax.stages.Lowered`.
    lower_for_flops: () -> the Lowered to count FLOPs on (default: `lower`'s).
      XLA counts a loop body once, so a train step with microbatches counts
      FLOPs on its single-microbatch twin (lowered only, never compiled).

  Returns:
    The report; a compile error (e.g. RESOURCE_EXHAUSTED from the TPU
    compiler) becomes its `error` rather than an exception.
  """
  start = time.perf_counter()
  try:
    lowered = lower()
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ProgramReport(name, shapes, compile_s=time.perf_counter() - start,
                         error=f'{type(e).__name__}: {first[:300]}')
  elapsed = time.perf_counter() - start
  mem = compiled.memory_analysis()
  get = lambda attr: int(getattr(mem, attr, 0) or 0) if mem is not None else 0
  flops = _flops(lower_for_flops() if lower_for_flops else lowered)
  return ProgramReport(name, shapes, argument_bytes=get('argument_size_in_bytes'),
                       output_bytes=get('output_size_in_bytes'),
                       temp_bytes=get('temp_size_in_bytes'),
                       alias_bytes=get('alias_size_in_bytes'), flops=flops, compile_s=elapsed)


def sampler_lowering(model_cfg, mesh, rules, sampler_cfg: dict, *, rows: int, prompt_len: int,
                     max_new_tokens: int, top_p: float, top_k: int, num_samples: int = 1,
                     program: str = 'decode'):
  """The sampler for one `Sampler.generate` call of these sizes, on `mesh` (`program`: the
  paged engine's 'decode' or 'prefill' call, see `Sampler.abstract_args`).

  Returns:
    (() -> Lowered, description of the shapes).
  """
  graphdef, params = abstract_params(model_cfg, 'policy', mesh, rules)
  sampler = sampler_lib.Sampler(graphdef, model_cfg, eos_ids=(0,), pad_id=0, mesh=mesh,
                                rules=rules, **sampler_cfg)
  sp = sampler_lib.SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k,
                                  max_new_tokens=max_new_tokens)
  _, _, what = sampler.abstract_args(params, rows, prompt_len, sp, num_samples, program)
  return (lambda: sampler.lower(params, rows, prompt_len, sp, num_samples, program)), what


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
  return (lambda: step.lower(state, batch)), what


def plan_stage(stage, model_cfg, mesh, rules, sampler_cfg: dict,
               limit_bytes: int, with_sampler: bool = True, count_mesh=None,
               with_train: bool = True, rm_stages=(), hardware=None) -> StageReport:
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

  Returns:
    The StageReport.
  """
  count_mesh = mesh if count_mesh is None else count_mesh
  programs = []
  kind = kinds.get(stage.kind)
  # XLA counts a loop body once: FLOPs are counted on a twin lowered (never
  # compiled) with the layers unrolled and the batch in one microbatch.
  unrolled = dataclasses.replace(model_cfg, scan_layers=False)

  def add(name: str, lowering: Callable[..., Any], *args, suffix: str = '', twin_kwargs=None):
    """lowering(model_cfg, mesh, *args) -> (() -> Lowered, shapes)."""
    lower, what = lowering(model_cfg, mesh, *args)
    twin = lowering(unrolled, count_mesh, *args, **(twin_kwargs or {}))[0]
    programs.append(compile_program(name, what + suffix, lower, twin))

  if with_train and kind.abstract_batch is not None:
    add('train step', lambda cfg, m, **k: train_lowering(stage, cfg, m, rules, **k),
        twin_kwargs={'microbatches': 1})
  sizes = (kind.sampler_sizes(stage) if with_sampler and kind.sampler_sizes is not None
           else None)
  if sizes is not None:
    for program, name in sampler_programs(sampler_cfg):
      add(name, lambda cfg, m, program=program: sampler_lowering(
          cfg, m, rules, sampler_cfg, **sizes, program=program))
  frozen = kind.frozen_forwards(stage) if kind.frozen_forwards is not None else []
  for ff in frozen:
    copies = f'cop{"y" if ff.copies == 1 else "ies"}'
    add(ff.name, lambda cfg, m, ff=ff: forward_lowering(cfg, 'policy', m, rules, ff.rows,
                                                          ff.length),
        suffix=(f' per call, {ff.calls} calls' if ff.calls > 1 else '')
        + (f'; {ff.copies} {copies} in host memory' if ff.on_host
           else f'; {ff.copies} resident {copies}'))
  rm = list(rm_stages or ())
  for rm_stage in rm:
    add(f'reward model scoring ({rm_stage.name})',
        lambda cfg, m, s=rm_stage: forward_lowering(cfg, 'reward_model', m, rules, s.batch_size,
                                                    s.max_len))
  resident = _resident(stage, model_cfg, mesh, rules, programs, frozen, rm,
                       rollout_layout=bool(sampler_cfg.get('rollout_rules')))
  calls = {ff.name: ff.calls for ff in frozen}
  if sizes is not None:   # the engine's prefill call runs once per `prefill_prompts` prompts
    prompts = -(-sizes['rows'] // sizes.get('num_samples', 1))
    calls['sampler prefill'] = -(-prompts // sampler_cfg.get('prefill_prompts', 8))
  seconds = _step_seconds(stage, kind, model_cfg, mesh, rules, programs,
                          hardware or config_lib.Hardware(),
                          calls=calls)
  return StageReport(stage.index, stage.name, stage.kind, tuple(programs), limit_bytes,
                     mesh.size, resident=resident, seconds=seconds,
                     steps=getattr(stage, 'steps', 0))


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
              rollout_layout: bool = False):
  """Per program: what stays in device memory beside it without being its argument."""
  if stage.MODEL is None:
    return ()
  optimizer = train_lib.make_optimizer(kinds.base.optimizer_config(stage))
  _, params = abstract_params(model_cfg, stage.MODEL, mesh, rules)
  state = _tree_bytes(policies.abstract_state(params, optimizer, mesh, rules,
                                              policies.master_dtype(model_cfg)))
  master = policies.master_dtype(model_cfg)
  policy_params = _params_bytes(model_cfg, 'policy', mesh, rules, master and np.float32)
  # Frozen copies kept in host memory are on the devices only as their own pass's arguments.
  one_copy = _params_bytes(model_cfg, 'policy', mesh, rules)
  frozen_bytes = sum(ff.copies for ff in frozen if not ff.on_host) * one_copy
  on_device = {ff.name: not ff.on_host for ff in frozen}
  rm_bytes = len(rm_stages) * _params_bytes(model_cfg, 'reward_model', mesh, rules)
  out = []
  for p in programs:
    if p.name == 'train step':
      extra = frozen_bytes + rm_bytes
    elif p.name.startswith('sampler'):   # the state, minus the params it is given unless it
                                          # resharded them
      extra = (state if rollout_layout else state - policy_params) + frozen_bytes + rm_bytes
    elif p.name.startswith('reward model scoring'):
      extra = state + frozen_bytes + rm_bytes - rm_bytes // max(1, len(rm_stages))
    else:                                         # a frozen forward: its params are arguments
      extra = state + rm_bytes + frozen_bytes - (one_copy if on_device.get(p.name) else 0)
    out.append((p.name, extra))
  return tuple(out)


def _step_seconds(stage, kind, model_cfg, mesh, rules, programs, hw,
                  calls: dict | None = None) -> float:
  """A lower bound on one step: compute at the chip's peak, each decode step reading the weights.

  Uses `hardware.peak_tflops` (per chip, the compute dtype) and
  `hardware.hbm_gbps`; the train step and frozen forwards are bound by their
  FLOPs, the sampler by one read of the (per-device) weights per new token
  (KV-cache reads and the prefill only add to it). 0 when the hardware gives
  no peak. `calls`: program name -> calls per step (a frozen pass in chunks).
  """
  calls = calls or {}
  peak = hw.peak_tflops * 1e12
  bw = hw.hbm_gbps * 1e9
  if not peak or not bw:
    return 0.0
  n = mesh.size
  t = 0.0
  for p in programs:
    if p.error:
      continue
    if p.name == 'sampler':
      new = kind.sampler_sizes(stage)['max_new_tokens']
      t += new * _params_bytes(model_cfg, 'policy', mesh, rules) / bw
    else:
      t += calls.get(p.name, 1) * p.flops / (n * peak)
  return t


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
  rows = -(-rows // sharding.batch_shards(mesh, rules)) * sharding.batch_shards(mesh, rules)
  row_sh = NamedSharding(mesh, sharding.logical_to_spec(('batch', None), (rows, length), mesh,
                                                        rules))
  mat = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=row_sh)

  def lower():
    with sharding.use_mesh(mesh, rules):
      if model_kind == 'reward_model':
        return reward_model.score.lower(graphdef, params, mat, mat)
      return batch_lib._logprobs_jit.lower(graphdef, params, mat, mat, mat, mat)  # pylint: disable=protected-access
  return lower, f'{rows} rows x {length} tokens'



def plan_eval(plan, model_cfg, mesh, rules, sampler_cfg: dict, limit_bytes: int,
              count_mesh=None) -> StageReport:
  """Compiles the evaluation's largest sampler call (batch_size prompts x num_samples, the
  longest prompt and response any domain's settings allow; an agentic domain's last turn has
  the opening prompt and the whole episode budget as its prompt)."""
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
    # Counted on a twin with the layers unrolled (XLA counts a scan body once).
    twin = sampler_lowering(dataclasses.replace(model_cfg, scan_layers=False),
                            mesh if count_mesh is None else count_mesh, rules, sampler_cfg,
                            **sizes, program=program)[0]
    progs.append(compile_program(f'eval {name}', what, lower, twin))
  return StageReport(-1, 'evaluation', 'eval', tuple(progs), limit_bytes, mesh.size)


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
  model_cfg, rules, sampler_cfg = plan.model, plan.rules, plan.sampler.options()
  if tgt.kind == 'tpu' and model_cfg.attention == 'auto':
    # 'auto' resolves by the backend JAX runs on (this CPU host); the TPU programs use splash.
    model_cfg = model_cfg.replace(attention='splash')
  hw = plan.hardware
  if tgt.kind == 'tpu' or hw.platform in ('tpu', 'gpu'):
    # Both 'auto's resolve by the devices compiled for (these CPUs when simulated); the
    # accelerator's programs scan their layers.
    if sampler_cfg.get('decode_layers', 'auto') == 'auto':
      sampler_cfg['decode_layers'] = 'scan'
    if model_cfg.scan_layers == 'auto':
      model_cfg = model_cfg.replace(scan_layers=True)
  mesh = sharding.make_mesh(plan.mesh_shape, devices=tgt.devices)
  count_mesh = (sharding.make_mesh(plan.mesh_shape, devices=tgt.count_devices)
                if tgt.count_devices else mesh)
  unknown = [s for s in stages if s not in [st.name for st in plan.stages]]
  if unknown:
    raise ValueError(f'--stages: unknown stage(s) {unknown}; the config has '
                     f'{[st.name for st in plan.stages]}')
  out = []
  for st in plan.stages:
    if stages and st.name not in stages:
      continue
    rep = plan_stage(st, model_cfg, mesh, rules, sampler_cfg, tgt.device_memory_bytes,
                     with_sampler, count_mesh, with_train, rm_stages=_rm_stages(plan, st),
                     hardware=hw)
    if not rep.programs:         # e.g. an SFT stage with --notrain
      continue
    out.append(rep)
    if report:
      report(rep)
  if with_eval:
    out.append(plan_eval(plan, model_cfg, mesh, rules, sampler_cfg, tgt.device_memory_bytes,
                         count_mesh))
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
      lines.append(f'    DOES NOT COMPILE: {p.error}')
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
    per = ('per step' if p.name == 'train step' else
           'for one decode step' if p.shapes.startswith('paged engine:') else
           'for the prefill and one decode step per decode phase'
           if p.name in ('sampler', 'eval sampler') else 'per call')
    lines.append(f'    FLOPs {per}: {p.flops:.3e} in all, {p.flops / r.num_devices:.3e} per '
                 f'device; compiled in {p.compile_s:.1f} s')
  if r.seconds:
    hours = r.seconds * r.steps / 3600
    lines.append(f'  lower bound: {r.seconds:.3g} s per step (compute at peak, one weight read '
                 f'per new token); {r.steps} steps = {hours:.3g} h = '
                 f'{hours * r.num_devices:.3g} chip-hours')
  return '\n'.join(lines)


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


_CONFIG = config_flags.DEFINE_config_file('config', None, 'Cascade config file.',
                                          lock_config=True)
_BACKEND = flags.DEFINE_enum('backend', 'auto', ['auto', 'tpu', 'cpu'],
                             'tpu: libtpu topology; cpu: simulated CPU devices; auto: tpu when '
                             'libtpu is installed and the config targets a TPU.')
_STAGES = flags.DEFINE_list('stages', [], 'Stage names to plan (default: all).')
_MEMORY = flags.DEFINE_float('device_memory_gib', None,
                             'Per-device memory limit (default: config.hardware).')
_TRAIN = flags.DEFINE_bool('train', True, "Compile the stages' train steps.")
_SAMPLER = flags.DEFINE_bool('sampler', True, "Compile RL stages' samplers.")
_EVAL = flags.DEFINE_bool('eval', True, "Compile the evaluation's sampler.")


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None:
    raise app.UsageError('--config is required')
  plan = config_lib.validate(config)     # touches no device
  backend = _BACKEND.value
  if backend == 'auto':
    backend = default_backend(plan)
  # Backends start lazily: this takes effect as long as nothing has touched a
  # device yet (the config file only imports modules). The TPU path needs the
  # CPU devices too: FLOPs are counted on CPU lowerings of the same mesh.
  use_simulated_cpu_devices(num_devices(plan))
  tgt = target(plan, backend, _MEMORY.value)
  model_cfg = plan.model
  print(f'target: {tgt.description}')
  print(f'mesh (data, fsdp, tensor) = {plan.mesh_shape}; model {plan.model_name}: '
        f'{model_cfg.num_params() / 1e9:.2f}B parameters in {model_cfg.param_dtype}, compute '
        f'{model_cfg.dtype}, remat={model_cfg.remat}')
  print('memory is per device; total = arguments + outputs + temporaries - aliased '
        "(donated) buffers. FLOPs are XLA's HLO count: a train step's over the whole batch; a "
        "sampler's for its prefill and one step per decode loop (XLA counts a loop body "
        "once)\n",
        flush=True)
  reports = run_plan(plan, tgt, stages=_STAGES.value, with_sampler=_SAMPLER.value,
                     with_eval=_EVAL.value, with_train=_TRAIN.value,
                     report=lambda r: print(format_stage(r), flush=True))
  bad = failures(reports)
  if bad:
    print('\nPLAN FAILED:\n  ' + '\n  '.join(bad), file=sys.stderr, flush=True)
    sys.exit(1)
  print(f'\nevery planned program fits ({len(reports)} stage(s) planned).')


if __name__ == '__main__':
  app.run(main)
