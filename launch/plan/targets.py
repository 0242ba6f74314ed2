"""The devices a plan compiles for: a TPU topology from libtpu, GPUs from XLA:GPU deviceless, or
simulated CPU devices; the plan's mesh on them; the model and sampler options as the target's
programs run them."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
import tempfile
from typing import Any

import jax
import numpy as np

from cascade import config as config_lib
from foundation import topology
from launch.plan import results
from models import sharding


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


@dataclasses.dataclass(frozen=True)
class Interconnect:
  """How a target's devices exchange data, for pricing collectives (`launch.plan.collectives`).

  Attributes:
    name: in words, for the output.
    link_gbps: GB/s one way over one link of a TPU torus, or from one GPU to its node's switch.
    switched: True where every device of a domain reaches every other at `link_gbps` (NVLink
      through NVSwitch); False for a torus, where a group's ring runs along the axes it spans,
      both ways, and an all-to-all is bound by the ring's bisection.
    network_gbps: GB/s one way per device between domains (DCN between TPU slices, the
      inter-node network between GPU hosts); a group spanning domains runs at this rate.
    domain: what the fast links reach: 'slice' or 'node'.
    source: where the numbers come from.
  """
  name: str
  link_gbps: float
  switched: bool
  network_gbps: float
  domain: str
  source: str


# Interconnects by chip, looked up by `interconnect` from config.hardware.
INTERCONNECTS = {
    'v5p': Interconnect(
        'TPU v5p ICI, 3D torus (DCN between slices)', link_gbps=100.0, switched=False,
        network_gbps=6.25, domain='slice',
        source='Cloud TPU v5p system architecture (cloud.google.com/tpu/docs/v5p): '
        '1,200 GB/s bidirectional ICI per chip (4,800 Gbps) over the 6 links of its 3D torus '
        '= 100 GB/s per link each way; DCN 50 Gbps = 6.25 GB/s per chip'),
    'h200': Interconnect(
        'NVLink 4 through NVSwitch in an 8-GPU node, 400 Gb/s InfiniBand between nodes',
        link_gbps=450.0, switched=True, network_gbps=50.0, domain='node',
        source='NVIDIA H200 datasheet: NVLink 900 GB/s per GPU (450 GB/s each way); NVIDIA '
        'DGX H200: 8 ConnectX-7 ports of 400 Gb/s per node, one per GPU = 50 GB/s each way'),
}


def interconnect(hw) -> Interconnect | None:
  """The interconnect of `config.hardware` (its topology's chip, or an H200 GPU target), or
  None where none is known (collectives are then counted in bytes, not timed)."""
  chip = hw.topology.split(':', 1)[0].lower() if hw.topology else ''
  if chip in INTERCONNECTS:
    return INTERCONNECTS[chip]
  named = f'{hw.gpu_target} {hw.name}'.lower() if hw.platform == 'gpu' else ''
  return next((v for k, v in INTERCONNECTS.items() if k in named), None)


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
  limit = int(float(gib or 0) * results.GIB)
  if backend == 'auto':
    backend = default_backend(plan)
  if backend == 'tpu':
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    topo = hw.topology
    if not topo:
      raise ValueError('config.hardware.topology: needed for --backend=tpu (e.g. v5p:4x4x4)')
    slices = mesh_slices(plan)
    # libtpu describes several slices of one topology joined over DCN (`num_slices`); each
    # device then carries its `slice_index`, which `foundation.topology` lays the mesh out by.
    extra = {'num_slices': slices} if slices > 1 else {}
    with native_stderr_held():      # libtpu's start-up lines on a host without TPU chips
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
                     'launch.plan.targets.use_simulated_cpu_devices(n) before any JAX work')
  why = {'tpu': ' (libtpu not installed: pip install "jax[tpu]")' if not have_libtpu()
                else ' (--backend=cpu)',
         'gpu': f' ({_no_gpu_compiler(hw)})'}.get(hw.platform, '')
  # For an accelerator, XLA:CPU's memory is a stand-in that runs above its own compiler's.
  above = (', above what its own compiler needs (bfloat16 matmuls in float32, other fusions: '
           'docs/planning.md)' if hw.platform in ('tpu', 'gpu') else '')
  desc = (f'{n} simulated CPU devices standing in for {hw.name or "the target"}{why}; '
          f'XLA:CPU memory estimates{above} (sampling programs without while-loop-invariant '
          'code motion: `CPU_SAMPLING_OPTIONS`), limit checked here')
  return Target(devices, 'cpu', desc, limit)


@contextlib.contextmanager
def native_stderr_held():
  """What native code writes to file descriptor 2 inside the block, held back and shown only
  if the block raises. libtpu, loaded by the first topology a plan asks for, checks the host it
  finds itself on and, on one without TPU chips (where a plan runs), prints five lines about
  it (no accelerator type, no worker hostnames, an E-level log with its source trace) through
  its own logging, which neither TF_CPP_MIN_LOG_LEVEL nor TPU_MIN_LOG_LEVEL nor
  TPU_STDERR_LOG_LEVEL turns off. They say nothing about the plan; the plan's own errors are
  raised, with what was held shown first."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    except BaseException:
      os.dup2(saved, 2)
      held.seek(0)
      sys.stderr.write(held.read().decode('utf-8', 'replace'))
      sys.stderr.flush()
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)


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
  cost analysis): the first n of this process's."""
  cpus = tuple(jax.devices('cpu'))
  if len(cpus) < n:
    raise ValueError(f'{len(cpus)} CPU devices: counting FLOPs needs {n}; call '
                     'launch.plan.targets.use_simulated_cpu_devices(n) before any JAX work')
  return cpus[:n]


def _no_gpu_compiler(hw) -> str:
  """Why a GPU target is planned on simulated CPU devices (`default_backend` chose 'cpu')."""
  if not have_cuda_plugin():
    return 'no CUDA plugin of jax installed: pip install "jax[cuda12]", docs/planning.md'
  if not hw.gpu_target:
    return 'config.hardware.gpu_target not set: no GPU description for XLA:GPU'
  return '--backend=cpu'


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
