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

With --sequence (e.g. 2,4; needs that many devices: simulated ones with
XLA_FLAGS=--xla_force_host_platform_device_count=8) it also compares context
parallelism at the lengths in --cp_lengths: the scoring forward (hidden states
and chunked log-probs, `rl.batch.token_stats`) and the SFT train step, each on
one device and on a (1, 1, 1, n, 1) mesh splitting the row over n sequence
shards (zig-zag layout, K/V all-gathered: `models.context`), printing tokens/s
and XLA's temporaries per device beside the bare jitted program of the same work
on the same devices (`bare_forward`: embedding, the blocks' matmuls, causal
attention, log-softmax of the targets; its gradient for the train step; inputs
split along T and GSPMD left to place the rest). Simulated devices share this
host's cores, so tokens/s measures the programs' overhead, not a speed-up; the
temporaries per device are what context parallelism divides. --doc writes the
tables to a markdown page with the command, date, machine and load.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m benchmarks.long_context \\
      --lengths= --sequence=2,4 --cp_lengths=1024,2048 --doc=docs/benchmarks/context_parallel.md

--cp_family=hybrid compares the hybrid family instead (`ModelConfig.tiny_hybrid`'s
pattern of Mamba-2, MoE, attention and MLP sublayers at --embed / --heads / --vocab;
--layers does not apply): its Mamba-2 scans pass their state across the shards
(`models.mamba`). It has no bare counterpart, so only the framework's programs run.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m benchmarks.long_context \\
      --lengths= --sequence=2,4 --cp_lengths=1024,2048 --cp_family=hybrid \\
      --doc=docs/benchmarks/context_parallel_hybrid.md
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import floor
from benchmarks import host
from models import attention
from models import config as config_lib
from models import sharding
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
_SEQUENCE = flags.DEFINE_list('sequence', [], 'Context-parallel shard counts to compare '
                              '(empty: none).')
_CP_LENGTHS = flags.DEFINE_list('cp_lengths', ['1024', '2048'],
                                'Row lengths of the context-parallel comparison (all run).')
_CP_IMPL = flags.DEFINE_string('cp_impl', 'blockwise', 'Attention of the comparison.')
_CP_FAMILY = flags.DEFINE_enum('cp_family', 'dense', ['dense', 'hybrid'],
                               'Model family of the comparison: the Qwen3-like model of '
                               '--layers blocks, or the hybrid Mamba-2 / MoE / attention one.')
_DOC = flags.DEFINE_string('doc', None, 'Also write the tables to this markdown page.')

SFT = train_lib.LossSpec(sft.SftConfig, sft.loss_fn, sft.normalizers)


def model_config(impl: str, length: int) -> config_lib.ModelConfig:
  return config_lib.ModelConfig.tiny(
      vocab_size=_VOCAB.value, embed_dim=_EMBED.value, num_layers=_LAYERS.value,
      num_heads=_HEADS.value, num_kv_heads=2, head_dim=64, mlp_dim=4 * _EMBED.value,
      max_seq_len=length, attention=impl, remat='full', scan_layers=True)


def hybrid_config(impl: str, length: int) -> config_lib.ModelConfig:
  """`ModelConfig.tiny_hybrid`'s six sublayers (Mamba-2, MoE, attention, MoE, Mamba-2, MLP)
  at this benchmark's width, heads and vocabulary."""
  return config_lib.ModelConfig.tiny_hybrid(
      vocab_size=_VOCAB.value, embed_dim=_EMBED.value, num_heads=_HEADS.value, num_kv_heads=2,
      head_dim=64, mlp_dim=4 * _EMBED.value, moe_dim=_EMBED.value,
      shared_expert_dim=2 * _EMBED.value, mamba_heads=2 * _HEADS.value, mamba_head_dim=32,
      mamba_state=32, mamba_chunk=64, max_seq_len=length, attention=impl, remat='full',
      scan_layers=True)


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
  opt = train_lib.make_optimizer(train_lib.OptimizerConfig(lr=1e-4))
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


def bare_forward(weights, tokens, targets, cfg: config_lib.ModelConfig):
  """The same work as the model's scoring forward, as one plain jnp program: embedding, per
  block the q/k/v/o and SwiGLU matmuls with RMS norms and causal GQA attention
  (`jax.nn.dot_product_attention`), the output projection and the targets' log-softmax.
  No RoPE, no segments, no remat, no chunking: what XLA makes of the bare work."""
  b, t = tokens.shape
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  norm = lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
  x = weights['embed'][tokens]
  layers = weights['layers']
  for attn, mlp in zip(layers[0::2], layers[1::2]):
    y = norm(x)
    q = (y @ attn['q']).reshape(b, t, n, h)
    kk = (y @ attn['k']).reshape(b, t, k, h)
    v = (y @ attn['v']).reshape(b, t, k, h)
    o = jax.nn.dot_product_attention(q, kk, v, is_causal=True).reshape(b, t, n * h)
    x = x + o @ attn['o']
    y = norm(x)
    x = x + (jax.nn.silu(y @ mlp['gate']) * (y @ mlp['up'])) @ mlp['down']
  logits = norm(x) @ (weights['embed'].T if weights['head'] is None else weights['head'])
  logp = jax.nn.log_softmax(logits, -1)
  return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]


def _timed(compiled, args, repeats: int) -> float:
  best = float('inf')
  for i in range(repeats + 1):              # the first call warms up
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    if i:
      best = min(best, time.perf_counter() - t)
  return best


def _compile(fn, args, mesh, in_shardings=None, out_shardings=None):
  """(compiled, temporaries MiB per device, compile s) of jit(fn) traced under `mesh`."""
  t0 = time.perf_counter()
  jitted = jax.jit(fn) if in_shardings is None else jax.jit(
      fn, in_shardings=in_shardings, out_shardings=out_shardings)
  if mesh is None:
    compiled = jitted.lower(*args).compile()
  else:
    with sharding.use_mesh(mesh):
      compiled = jitted.lower(*args).compile()
  return (compiled, compiled.memory_analysis().temp_size_in_bytes / 2 ** 20,
          time.perf_counter() - t0)


def measure_cp(length: int, shards: int, repeats: int) -> list[dict]:
  """Forward and train step of one row of `length` tokens: the framework's on one device and
  context-parallel over `shards` sequence shards, and the bare program on each (dense only)."""
  hybrid = _CP_FAMILY.value == 'hybrid'
  cfg = (hybrid_config if hybrid else model_config)(_CP_IMPL.value, length)
  make = lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, _ = nnx.split(nnx.eval_shape(make))
  params = jax.jit(lambda: nnx.state(make()))()
  batch = jax.tree.map(jnp.asarray, sft_batch(length))
  weights = None if hybrid else floor._bare_weights(cfg, np.random.default_rng(0))
  opt = train_lib.make_optimizer(train_lib.OptimizerConfig(lr=1e-4))
  rows = []
  tokens = batch.tokens.size

  def forward(params, batch):
    model = nnx.merge(graphdef, params)
    return batch_lib.token_stats(model, batch.tokens, batch.positions, batch.segment_ids,
                                 batch.targets)['logprobs']

  bare = functools.partial(bare_forward, cfg=cfg)
  bare_grad = jax.grad(lambda w, t, y: -jnp.sum(bare(w, t, y)))
  for n in (1, shards):
    mesh = None if n == 1 else sharding.make_mesh((1, 1, 1, n, 1), jax.devices()[:n])
    p = params if mesh is None else sharding.shard_state(params, mesh)
    state = train_lib.init_state(p, opt, mesh=mesh)
    step = train_lib.make_train_step(graphdef, SFT, None, opt, mesh=mesh,
                                     state=None if mesh is None else state, donate=False)
    row_sh = row = None
    if mesh is not None:
      row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, 'sequence'))
      rep_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      row_sh = (jax.tree.map(lambda _: rep_sh, weights), row, row)
    programs = [('forward', forward, (p, batch), None, None),
                ('forward (bare)', bare, (weights, batch.tokens, batch.targets), row_sh, row),
                ('train step', step, (state, batch), None, None),
                ('train step (bare)', bare_grad, (weights, batch.tokens, batch.targets), row_sh,
                 None if mesh is None else row_sh[0])]
    if hybrid:
      programs = [x for x in programs if not x[0].endswith('(bare)')]
    for name, fn, args, in_sh, out_sh in programs:
      if name == 'train step':
        t0 = time.perf_counter()
        compiled = step.lower(*args).compile()
        temp, compile_s = (compiled.memory_analysis().temp_size_in_bytes / 2 ** 20,
                           time.perf_counter() - t0)
      else:
        compiled, temp, compile_s = _compile(fn, args, mesh, in_sh, out_sh)
      sec = _timed(compiled, args, repeats)
      rows.append(dict(program=name, length=length, shards=n, temp_mib=temp,
                       tokens_per_s=tokens / sec, step_s=sec, compile_s=compile_s))
  return rows


def main_cp(shard_counts: list[int], lengths: list[int]) -> tuple[list[str], list[dict]]:
  """The context-parallel comparison's table lines and rows."""
  if jax.device_count() < max(shard_counts):
    raise app.UsageError(f'--sequence={max(shard_counts)} needs that many devices, have '
                         f'{jax.device_count()}: set XLA_FLAGS=--xla_force_host_platform_'
                         f'device_count=8')
  family = '' if _CP_FAMILY.value == 'dense' else f'{_CP_FAMILY.value} model, '
  lines = [f'context parallelism ({family}{_CP_IMPL.value} attention; one row; temporaries '
           'per device)',
           f'{"program":>18} {"T":>6} {"shards":>6} {"temp MiB":>9} {"tokens/s":>9} '
           f'{"s":>7} {"compile s":>9}']
  print('\n'.join(lines))
  rows, seen = [], set()
  for length in lengths:
    for shards in shard_counts:
      for r in measure_cp(length, shards, _REPEATS.value):
        if r['shards'] == 1 and (r['program'], length) in seen:
          continue                             # the one-device programs, once per length
        seen.add((r['program'], length))
        rows.append(r)
        line = (f'{r["program"]:>18} {length:>6} {r["shards"]:>6} {r["temp_mib"]:>9.1f} '
                f'{r["tokens_per_s"]:>9.0f} {r["step_s"]:>7.3f} {r["compile_s"]:>9.1f}')
        lines.append(line)
        print(line)
  return lines, rows


def main(argv):
  del argv
  lengths = [int(x) for x in _LENGTHS.value if x]
  flops_rate, _ = floor.measure_machine(())
  load = os.getloadavg()
  print(f'machine floor: float32 matmul {flops_rate / 1e9:.1f} GFLOP/s '
        f'({jax.default_backend()}, {jax.device_count()} device(s)); load average '
        f'{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (ratios are only meaningful near 0)')
  if lengths:
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
  cp_lines, cp_rows = [], []
  if _SEQUENCE.value:
    cp_lines, cp_rows = main_cp([int(x) for x in _SEQUENCE.value],
                                [int(x) for x in _CP_LENGTHS.value])
  result = json.dumps(dict(flops_rate=flops_rate, load_average=load, rows=rows,
                           temp_growth=growth, context_parallel=cp_rows))
  warning = host.print_load_warning(load)
  print(result)
  if _DOC.value:
    after = os.getloadavg()
    command = 'python -m benchmarks.long_context ' + ' '.join(sys.argv[1:])
    hybrid = _CP_FAMILY.value == 'hybrid'
    what = ('The hybrid family (`ModelConfig.tiny_hybrid`\'s pattern at this width: Mamba-2, '
            'MoE, attention, MoE, Mamba-2, MLP), whose Mamba-2 scans pass their state across '
            'the shards; it has no bare counterpart. ' if hybrid else
            '"bare" is the same work as one plain jitted jnp program (`bare_forward`), inputs '
            'split along T on the same devices. ')
    page = ['# Long context: context parallelism against one device'
            + (' (hybrid family)' if hybrid else ''), '',
            f'Written by `benchmarks/long_context.py` on {datetime.date.today().isoformat()}: '
            f'`XLA_FLAGS={os.environ.get("XLA_FLAGS", "")} {command}` on {os.cpu_count()} '
            f'cores of {host.cpu_name()} ({jax.device_count()} {jax.default_backend()} devices), '
            f'load average {load[0]:.2f} before and {after[0]:.2f} after (one minute).', '',
            'Simulated devices share the host\'s cores: tokens/s compares the programs\' '
            'overhead on one machine, not a speed-up; the temporaries per device are what '
            'splitting a row over the sequence axis divides. ' + what, '', '```text',
            *cp_lines, '```', '', '```text', *([warning] if warning else []), result, '```',
            '']
    os.makedirs(os.path.dirname(os.path.abspath(_DOC.value)), exist_ok=True)
    with open(_DOC.value, 'w', encoding='utf-8') as f:
      f.write('\n'.join(page))


if __name__ == '__main__':
  app.run(main)
