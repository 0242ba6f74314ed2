"""Compiling one program: the compiler options per target and per kind of program, the
lowering and compiling timed, its memory and FLOPs read (`compile_program`), and the largest
arrays of a program that does not fit."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from typing import Any, Callable

import numpy as np

from launch.plan import collectives as collectives_lib
from launch.plan import results


def xla_flops(lowered) -> float:
  """XLA's FLOP count of a lowered program (`cost_analysis`; 0 where it gives none)."""
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


# Programs compiled in this process without a memory limit, by their lowered text and options:
# a plan of several stages that lower the same program (two stages of the same shapes) compiles
# it once (`compile_program`).
_COMPILED: dict[tuple[str, str], results.ProgramReport] = {}


def compile_program(name: str, shapes: str, lower: Callable[[], Any],
                    lower_for_flops: Callable[[], Any] | None = None,
                    flops: float | None = None, flops_from: str = '',
                    limit_bytes: int = 0,
                    compiler_options: dict | None = None) -> results.ProgramReport:
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
      its largest arrays. Without one (0), a program this process compiled before (the same
      lowered text and options) is not compiled again: its report is reused.
    compiler_options: XLA options for this compile (`compiler_options`,
      `sampling_options`).

  Returns:
    The report, with the collectives of the optimized HLO (`collectives.parse`; priced later,
    on the mesh, by `collectives.priced`); a compile error (e.g. RESOURCE_EXHAUSTED from the TPU
    compiler) becomes its `error` rather than an exception.
  """
  start, cpu = time.perf_counter(), time.process_time()
  try:
    lowered = lower()
    key = None if limit_bytes else (hashlib.sha256(lowered.as_text().encode()).hexdigest(),
                                    repr(sorted((compiler_options or {}).items())))
    if key in _COMPILED:
      if flops is None:
        flops, flops_from = xla_flops(lower_for_flops() if lower_for_flops else lowered), ''
      return dataclasses.replace(_COMPILED[key], name=name, shapes=shapes, flops=flops,
                                 flops_from=flops_from)
    compiled = lowered.compile(compiler_options=compiler_options)
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return results.ProgramReport(name, shapes, compile_s=time.perf_counter() - start,
                                 compile_cpu_s=time.process_time() - cpu,
                                 error=f'{type(e).__name__}: {first[:300]}')
  elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
  mem, text = compiled.memory_analysis(), compiled.as_text()
  get = lambda attr: int(getattr(mem, attr, 0) or 0) if mem is not None else 0
  if flops is None:
    flops, flops_from = xla_flops(lower_for_flops() if lower_for_flops else lowered), ''
  report = results.ProgramReport(name, shapes, argument_bytes=get('argument_size_in_bytes'),
                                 output_bytes=get('output_size_in_bytes'),
                                 temp_bytes=get('temp_size_in_bytes'),
                                 alias_bytes=get('alias_size_in_bytes'), flops=flops,
                                 compile_s=elapsed, compile_cpu_s=cpu, flops_from=flops_from,
                                 collectives=collectives_lib.parse(text))
  if limit_bytes and report.total_bytes > limit_bytes:
    report = dataclasses.replace(report, largest=largest_arrays(text))
  if key is not None:
    _COMPILED[key] = report
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
  return tuple(f'{results.size_text(size)} {dt}[{shape}] ({first}'
               + (f' and {count - 1} more' if count > 1 else '') + ')'
               for (dt, shape), (size, count, first) in top)
