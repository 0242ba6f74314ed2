"""Train-step memory and time against sequence length, per attention implementation.

  .venv/bin/python -m benchmarks.long_context                       # 4K..64K planned, runs <= 4K
  .venv/bin/python -m benchmarks.long_context --lengths=1024,2048,4096 --run_max=4096

For every length T and implementation (dense, blockwise; splash / gpu_flash
on their platforms) it compiles one SFT train step of a small Qwen3-like
model over one row of T tokens (scan over layers, full remat, chunked
log-probs: the framework's long-context path) and reads XLA's memory
analysis: temporaries per device, which is what grows with T. Lengths up to
--run_max are also run (best of --repeats) and printed beside the machine's
floor for the step: its FLOPs (XLA's count) at this machine's measured
matmul rate. Dense attention materialises [heads, T, T] scores, so its
temporaries grow with T^2; the blockwise path holds one [T, block] tile and
grows linearly. The last line is JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import floor
from models import attention
from models import config as config_lib
from models import transformer
from rl import batch as batch_lib
from rl import sft
from rl import train_step as train_lib

_LENGTHS = flags.DEFINE_list('lengths', ['4096', '8192', '16384', '32768', '65536'],
                             'Sequence lengths (tokens per row).')
_IMPLS = flags.DEFINE_list('impls', ['dense', 'blockwise'],
                           'Attention implementations (models.attention.IMPLS).')
_RUN_MAX = flags.DEFINE_integer('run_max', 4096, 'Run (not only compile) lengths up to this.')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Timed runs per measured point (best is kept).')
_LAYERS = flags.DEFINE_integer('layers', 2, 'Transformer blocks.')
_EMBED = flags.DEFINE_integer('embed', 256, 'Residual width.')
_HEADS = flags.DEFINE_integer('heads', 4, 'Query heads (head_dim 64, 2 K/V heads).')
_VOCAB = flags.DEFINE_integer('vocab', 4096, 'Vocabulary.')

SFT = train_lib.LossSpec(sft.SftConfig, sft.loss_fn, sft.normalizers)


def model_config(impl: str, length: int) -> config_lib.ModelConfig:
  return config_lib.ModelConfig.tiny(
      vocab_size=_VOCAB.value, embed_dim=_EMBED.value, num_layers=_LAYERS.value,
      num_heads=_HEADS.value, num_kv_heads=2, head_dim=64, mlp_dim=4 * _EMBED.value,
      max_seq_len=length, attention=impl, remat='full', scan_layers=True)


def sft_batch(length: int) -> batch_lib.TrainBatch:
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, _VOCAB.value, (1, length)).astype(np.int32)
  z = np.zeros((1, length), np.float32)
  return batch_lib.TrainBatch(
      tokens=tokens, positions=np.arange(length, dtype=np.int32)[None],
      segment_ids=np.ones((1, length), np.int32),
      targets=np.concatenate([tokens[:, 1:], np.zeros((1, 1), np.int32)], 1),
      loss_mask=np.concatenate([np.ones((1, length - 1)), np.zeros((1, 1))], 1).astype(
          np.float32),
      old_logprobs=z, advantages=np.zeros((1,), np.float32),
      truncated=np.zeros((1,), bool), teacher_index=np.zeros((1,), np.int32),
      ref_logprobs=z, teacher_logprobs=z)


def measure(impl: str, length: int, run: bool, flops_rate: float) -> dict:
  cfg = model_config(impl, length)
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  opt = train_lib.make_optimizer(train_lib.OptimizerConfig(learning_rate=1e-4))
  state = train_lib.init_state(params, opt)
  step = train_lib.make_train_step(graphdef, SFT, None, opt)
  batch = jax.tree.map(jnp.asarray, sft_batch(length))
  t0 = time.perf_counter()
  lowered = step.lower(state, batch)
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  unrolled_cfg = dataclasses.replace(cfg, scan_layers=False)
  unrolled = train_lib.make_train_step(
      nnx.split(nnx.eval_shape(lambda: transformer.create(unrolled_cfg, seed=0)))[0], SFT,
      None, opt)
  cost = unrolled.lower(state, batch).cost_analysis()   # XLA counts a scan body once
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float((cost or {}).get('flops', 0.0))
  out = dict(impl=impl, length=length,
             resolved=attention.resolve(impl, length, length, self_attention=True),
             temp_mib=mem.temp_size_in_bytes / 2 ** 20,
             argument_mib=mem.argument_size_in_bytes / 2 ** 20,
             flops=flops, floor_s=flops / flops_rate, compile_s=compile_s)
  if run:
    best = float('inf')
    s = state
    for _ in range(_REPEATS.value + 1):       # the first call warms up
      t = time.perf_counter()
      s, metrics = compiled(s, batch)
      jax.block_until_ready(metrics['loss'])
      best = min(best, time.perf_counter() - t)
    out.update(step_s=best, x_floor=best / out['floor_s'])
  return out


def main(argv):
  del argv
  lengths = [int(x) for x in _LENGTHS.value]
  flops_rate, _ = floor.measure_machine(())
  load = os.getloadavg()
  print(f'machine floor: float32 matmul {flops_rate / 1e9:.1f} GFLOP/s '
        f'({jax.default_backend()}, {jax.device_count()} device(s)); load average '
        f'{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (ratios are only meaningful near 0)')
  print(f'{"impl":>10} {"T":>7} {"temp MiB":>10} {"GFLOP":>9} {"floor s":>9} '
        f'{"step s":>8} {"x floor":>8} {"compile s":>10}')
  rows = []
  for length in lengths:
    for impl in _IMPLS.value:
      r = measure(impl, length, length <= _RUN_MAX.value, flops_rate)
      rows.append(r)
      step = f'{r["step_s"]:>8.3f} {r["x_floor"]:>8.1f}' if 'step_s' in r else f'{"-":>8} {"-":>8}'
      print(f'{impl:>10} {length:>7} {r["temp_mib"]:>10.1f} {r["flops"] / 1e9:>9.2f} '
            f'{r["floor_s"]:>9.3f} {step} {r["compile_s"]:>10.1f}')
  # Growth of the temporaries per doubling of T: ~2 linear, ~4 quadratic.
  growth = {}
  for impl in _IMPLS.value:
    temps = [r['temp_mib'] for r in rows if r['impl'] == impl]
    if len(temps) > 1:
      growth[impl] = float(np.exp(np.mean(np.diff(np.log(temps)))))
      print(f'{impl}: temporaries x{growth[impl]:.2f} per step of the length list')
  print(json.dumps(dict(flops_rate=flops_rate, load_average=load, rows=rows,
                        temp_growth=growth)))


if __name__ == '__main__':
  app.run(main)
