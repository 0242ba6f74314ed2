"""What this accelerator gives the framework: its peaks, and how close decode and training come.

  python -m benchmarks.device                                   # on a GPU or TPU host
  python -m benchmarks.device --report=docs/benchmarks/device.md
  .venv/bin/python -m benchmarks.device --small --report=/tmp/device.md   # tiny shapes, CPU

On JAX's default backend, in four parts:

1. The machine: the bf16 matmul rate (best over a few square products) and the memory
   read bandwidth (a sum over one large bf16 array), as `benchmarks.floor.measure_machine`
   measures the float32 ones.
2. Decode: the one-call sampler and the paged engine (`rl.sampler.Sampler`, engine='paged')
   generate the same rows (random prompts, temperature 1, no stop token) on a Qwen3-0.6B
   shape with random weights (float32 masters, bf16 compute: the samplers decode from their
   bf16 rollout copy, made once beforehand with `Sampler.prepare`). Printed: tokens/s, the
   bytes a decode step must read (`decode_step_bytes`: the weights in bf16 and the KV cache
   over the keys the rows attend), and those bytes over the generation's time against the
   measured bandwidth, the roofline fraction. The time includes the prefill and the host's
   work between device calls, so the fraction is a lower bound on the decode loop's own.
3. Training: one SFT train step (`rl.train_step`, AdamW, scan over layers, full remat, bf16
   compute; float32 on the CPU backend, see `train_config`) on 8 rows of 4096 tokens per
   attention implementation the backend has ('blockwise', 'dense', and 'splash' on TPU or
   'gpu_flash' on GPU). MFU is the model's FLOPs (`models.flops.counted_flops` without the
   remat recompute) per second over the measured matmul rate in the step's compute dtype
   (not a datasheet peak).
4. The bf16 sampler/trainer log-prob gap: max and mean |sampler log-prob - trainer
   log-prob| over the generated tokens of part 2 (`rl.batch.compute_logprobs` on the same
   params), for each engine.

--small runs the same four parts on tiny shapes (ModelConfig.tiny in bf16, 4 rows of 16 +
32 tokens, a 2 x 256-token train step) in about half a minute on a CPU: the heavy tier's
check that the benchmark runs (tests/benchmarks/test_device.py). A table is printed with the
backend, device kind, date and load average; --report=PATH also writes it as a Markdown
page. docs/benchmarks/device.md is only ever written from an accelerator (refused on CPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pathlib
import sys
import time

if __package__ in (None, ''):
  # Run as a file (python benchmarks/device.py): make the repository importable.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402  (the imports below need the path above)
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import floor
from benchmarks import host
from models import config as config_lib
from models import flops as flops_lib
from models import transformer
from rl import batch as batch_lib
from rl import sampler as sampler_lib
from rl import sft
from rl import train_step as train_lib


def define_flags():
  """The command line's flags, defined only when this module is the program: imported beside
  other absl programs (launch.plan's --report, in one test process) they would clash."""
  return (flags.DEFINE_bool('small', False, 'Tiny shapes (a CPU run of every part).'),
          flags.DEFINE_string('report', None, 'Also write the results to this Markdown page.'),
          flags.DEFINE_integer('repeats', None, 'Timed runs per measurement (best kept); '
                               'default 5 (3 with --small).'))


_SMALL = _REPORT = _REPEATS = None      # set by define_flags() under __main__

SFT = train_lib.LossSpec(sft.SftConfig, sft.loss_fn, sft.normalizers)
DEVICE_PAGE = 'docs/benchmarks/device.md'


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The sizes one run measures at.

  Attributes:
    matmul_sizes: n of the n x n x n bf16 products; the best rate is the peak.
    read_bytes: size of the bf16 array the bandwidth read sums.
    decode_cfg: the model decode runs (bf16 compute).
    decode_rows: rows generated at once.
    prompt_len: tokens per prompt.
    new_tokens: tokens generated per row.
    train_rows: rows of a train step.
    train_len: tokens per row of a train step.
  """
  matmul_sizes: tuple[int, ...]
  read_bytes: int
  decode_cfg: config_lib.ModelConfig
  decode_rows: int
  prompt_len: int
  new_tokens: int
  train_rows: int
  train_len: int


def shapes(small: bool) -> Shapes:
  """The full run's sizes (a Qwen3-0.6B shape, 8 x 4096 tokens) or --small's tiny ones."""
  if small:
    return Shapes(matmul_sizes=(128, 256), read_bytes=32 * 2 ** 20,
                  decode_cfg=config_lib.ModelConfig.tiny(dtype='bfloat16', max_seq_len=512),
                  decode_rows=4, prompt_len=16, new_tokens=32, train_rows=2, train_len=256)
  return Shapes(matmul_sizes=(2048, 4096, 8192), read_bytes=2 ** 31,
                decode_cfg=config_lib.ModelConfig.qwen3_0_6b(dtype='bfloat16'),
                decode_rows=64, prompt_len=128, new_tokens=512, train_rows=8, train_len=4096)


def attention_impls(backend: str) -> tuple[str, ...]:
  """The attention implementations a train step can use on `backend` (ModelConfig.attention)."""
  kernel = {'tpu': ('splash',), 'gpu': ('gpu_flash',)}.get(backend, ())
  return ('blockwise', 'dense') + kernel


# Part 1: the machine.

def matmul_peak(sizes, repeats: int, dtype=jnp.bfloat16) -> float:
  """Best matmul rate (FLOP/s) over n x n x n products in `dtype`, n in `sizes`."""
  best = 0.0
  matmul = jax.jit(lambda x, y: x @ y)
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    best = max(best, 2 * n ** 3 / floor.best_seconds(lambda: matmul(a, b), repeats))
  return best


def read_bandwidth(nbytes: int, repeats: int) -> float:
  """Memory read bandwidth (bytes/s): the best time of a sum over a bf16 array of `nbytes`."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  read = jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32))
  return x.nbytes / floor.best_seconds(lambda: read(x), repeats)


# Part 2: decode.

def decode_step_bytes(cfg: config_lib.ModelConfig, rows: int, keys: int) -> int:
  """Bytes one decode step must read: every weight once in bf16 (2 bytes per parameter of
  `cfg.num_params()`; a tied embedding is the output projection too) and the KV cache of
  `rows` rows over the `keys` keys each attends (`rl.sampler.kv_token_bytes`: K and V of
  every attention sublayer in the compute dtype). Dense families."""
  return 2 * cfg.num_params() + rows * keys * sampler_lib.kv_token_bytes(cfg)


def decode_bytes(cfg: config_lib.ModelConfig, rows: int, prompt: int, new: int) -> int:
  """Bytes the decode steps of a generation of `new` tokens after `prompt`-token prompts must
  read: the first token comes from the prefill, step t = 1 .. new - 1 attends prompt + t keys."""
  return sum(decode_step_bytes(cfg, rows, prompt + t) for t in range(1, new))


def decode(sh: Shapes, bandwidth: float, repeats: int) -> tuple[list[dict], list[dict]]:
  """Part 2 and part 4: per engine, its decode numbers and its sampler/trainer log-prob gap."""
  cfg = sh.decode_cfg
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, cfg.vocab_size, (sh.decode_rows, sh.prompt_len)).tolist()
  sp = sampler_lib.SamplingParams(max_new_tokens=sh.new_tokens, temperature=1.0)
  common = dict(eos_ids=(), prompt_buckets=(sh.prompt_len,), new_token_buckets=(sh.new_tokens,))
  engines = {'one_call': sampler_lib.Sampler(graphdef, cfg, **common),
             'paged': sampler_lib.Sampler(graphdef, cfg, engine='paged', slots=sh.decode_rows,
                                          **common)}
  need = decode_bytes(cfg, sh.decode_rows, sh.prompt_len, sh.new_tokens)
  tokens = sh.decode_rows * sh.new_tokens
  rows, gaps = [], []
  for name, s in engines.items():
    weights = s.prepare(params)
    calls = [0]
    outs = []

    def call(s=s, weights=weights, calls=calls, outs=outs):
      calls[0] += 1
      out = s.generate(weights, prompts, jax.random.key(calls[0]), sp)
      outs.append(out)
      return out.tokens

    secs = floor.best_seconds(call, repeats)
    out = outs[-1]
    if not np.all(out.lengths == sh.new_tokens):
      raise RuntimeError(f'decode: the {name} engine stopped a row before {sh.new_tokens} '
                         f'tokens (lengths {out.lengths.tolist()})')
    rows.append(dict(engine=name, seconds=secs, tokens_per_s=tokens / secs,
                     step_bytes=decode_step_bytes(cfg, sh.decode_rows,
                                                  sh.prompt_len + sh.new_tokens // 2),
                     bytes_per_s=need / secs, roofline=need / secs / bandwidth))
    del weights, call                   # the rollout copy: free before the next engine
    batch = batch_lib.from_samples(out, np.zeros((sh.decode_rows,), np.float32))
    trainer = np.asarray(batch_lib.compute_logprobs(graphdef, params, batch))
    mask = np.asarray(batch.loss_mask) > 0
    diff = np.abs(trainer - np.asarray(batch.old_logprobs))[mask]
    gaps.append(dict(engine=name, tokens=int(mask.sum()), max_abs=float(diff.max()),
                     mean_abs=float(diff.mean())))
  return rows, gaps


# Part 3: training.

def train_config(sh: Shapes, impl: str, backend: str) -> config_lib.ModelConfig:
  """The decode model as a train step runs it: scan over layers, full remat, `impl`.

  In float32 on the CPU backend: XLA:CPU cannot run the blockwise attention's bf16 x bf16 ->
  float32 dots ('Unsupported element type for DotThunk::Execute', jax 0.10.2), and its bf16
  rate is no accelerator's anyway; bf16 everywhere else."""
  block = 128 if sh.train_len < 512 else 512
  dtype = 'float32' if backend == 'cpu' else sh.decode_cfg.dtype
  return sh.decode_cfg.replace(attention=impl, remat='full', scan_layers=True, dtype=dtype,
                               max_seq_len=max(sh.train_len, sh.decode_cfg.max_seq_len),
                               attention_block_q=block, attention_block_kv=block)


def sft_batch(rows: int, length: int, vocab: int) -> batch_lib.TrainBatch:
  """`rows` random rows of `length` tokens, every position but the last a target."""
  tokens = np.random.default_rng(0).integers(3, vocab, (rows, length)).astype(np.int32)
  mask = np.ones((rows, length), np.float32)
  mask[:, -1] = 0
  return batch_lib.TrainBatch(
      tokens=tokens, positions=np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
      segment_ids=np.ones((rows, length), np.int32),
      targets=np.concatenate([tokens[:, 1:], np.zeros((rows, 1), np.int32)], 1),
      loss_mask=mask)


def model_flops(cfg: config_lib.ModelConfig, rows: int, length: int) -> float:
  """A causal train step's model FLOPs (forward and backward, no remat recompute)."""
  return flops_lib.counted_flops(cfg.replace(remat='none'), 'policy', rows * length,
                                 (length + 1) / 2, train=True)


def train(sh: Shapes, impl: str, peaks: dict, repeats: int) -> dict:
  """One implementation's train step: seconds (best of `repeats`), tokens/s and MFU (over
  `peaks[compute dtype]`, the measured matmul rate in the step's compute dtype)."""
  cfg = train_config(sh, impl, jax.default_backend())
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  opt = train_lib.make_optimizer(train_lib.OptimizerConfig(lr=1e-5))
  state = [train_lib.init_state(params, opt)]
  del params
  step = train_lib.make_train_step(graphdef, SFT, None, opt)
  batch = jax.tree.map(jnp.asarray, sft_batch(sh.train_rows, sh.train_len, cfg.vocab_size))
  t = time.perf_counter()
  compiled = step.lower(state[0], batch).compile()
  compile_s = time.perf_counter() - t

  def call():
    state[0], metrics = compiled(state[0], batch)
    return metrics['loss']

  secs = floor.best_seconds(call, repeats)
  loss = float(call())
  if not np.isfinite(loss):
    raise RuntimeError(f'train: the {impl} step gave a non-finite loss {loss}')
  fl = model_flops(cfg, sh.train_rows, sh.train_len)
  return dict(impl=impl, dtype=cfg.dtype, seconds=secs, compile_s=compile_s,
              tokens_per_s=sh.train_rows * sh.train_len / secs, flops=fl,
              mfu=fl / secs / peaks[cfg.dtype])


# The page.

def _uptime() -> str:
  return ', '.join(f'{x:.2f}' for x in os.getloadavg())


def render(meta: dict, machine: dict, decode_rows, gaps, train_rows, errors) -> str:
  """The results as a Markdown page."""
  lines = [
      '# Device benchmark', '',
      f'Written by `{meta["command"]}` on {meta["date"]}: backend {meta["backend"]}, '
      f'{meta["devices"]} x {meta["device_kind"]}, jax {meta["jax"]}, host {meta["host"]}, '
      f'load average {meta["load_before"]} before, {meta["load_after"]} after '
      f'(`uptime`). Shapes: {meta["shapes"]}. Every time is the best of {meta["repeats"]} '
      'runs after a warm-up.', '']
  if meta.get('warning'):
    lines += [meta['warning'], '']
  lines += ['## Machine', '', '| measure | value |', '|---|---|',
            *(f'| {dt} matmul peak | {rate / 1e12:.3f} TFLOP/s |'
              for dt, rate in machine['peaks'].items()),
            f'| memory read bandwidth | {machine["gbps"]:.2f} GB/s |', '',
            '## Decode', '',
            'Bytes per step: the weights in bf16 plus the KV cache over the attended keys, at '
            'the mean context; the roofline fraction is all decode steps\' bytes over the '
            'generation\'s time (prefill included) against the measured bandwidth.', '',
            '| engine | seconds | tokens/s | MB per step | GB/s | roofline fraction |',
            '|---|---|---|---|---|---|']
  for r in decode_rows:
    lines.append(f'| {r["engine"]} | {r["seconds"]:.4g} | {r["tokens_per_s"]:.1f} | '
                 f'{r["step_bytes"] / 1e6:.3f} | {r["bytes_per_s"] / 1e9:.3f} | '
                 f'{r["roofline"]:.4f} |')
  lines += ['', '## Train step', '',
            'MFU: model FLOPs (`models.flops.counted_flops`, no remat recompute) per second '
            'over the measured matmul peak in the step\'s compute dtype.', '',
            '| attention | compute dtype | seconds | compile s | tokens/s | TFLOP per step '
            '| MFU |', '|---|---|---|---|---|---|---|']
  for r in train_rows:
    lines.append(f'| {r["impl"]} | {r["dtype"]} | {r["seconds"]:.4g} | {r["compile_s"]:.1f} | '
                 f'{r["tokens_per_s"]:.1f} | {r["flops"] / 1e12:.4f} | {r["mfu"]:.4f} |')
  for impl, err in errors:
    lines.append(f'| {impl} | failed: {err} | | | | | |')
  lines += ['', '## Sampler/trainer log-prob gap (bf16)', '',
            '| engine | tokens | max abs | mean abs |', '|---|---|---|---|']
  for g in gaps:
    lines.append(f'| {g["engine"]} | {g["tokens"]} | {g["max_abs"]:.6f} | '
                 f'{g["mean_abs"]:.6f} |')
  return '\n'.join(lines) + '\n'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}')
  backend = jax.default_backend()
  report = _REPORT.value
  if (report and backend == 'cpu'
      and pathlib.Path(report).resolve() == pathlib.Path(DEVICE_PAGE).resolve()):
    raise app.UsageError(f'--report={report}: {DEVICE_PAGE} holds accelerator numbers; a CPU '
                         'run writes its page elsewhere')
  sh = shapes(_SMALL.value)
  repeats = _REPEATS.value or (3 if _SMALL.value else 5)
  if repeats < 1:
    raise app.UsageError(f'--repeats={repeats} must be >= 1')
  load_before = os.getloadavg()
  meta = dict(command='python -m benchmarks.device ' + ' '.join(sys.argv[1:]),
              date=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
              backend=backend, devices=jax.device_count(),
              device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
              host=f'{host.cpu_name()} ({os.cpu_count()} cores)',
              load_before=_uptime(), repeats=repeats,
              shapes=(f'{sh.decode_cfg.num_params() / 1e6:.2f}M-parameter Qwen3 shape, decode '
                      f'{sh.decode_rows} rows x ({sh.prompt_len} + {sh.new_tokens}) tokens, '
                      f'train {sh.train_rows} x {sh.train_len} tokens'))
  print(f'backend {backend}, {meta["devices"]} x {meta["device_kind"]}, {meta["date"]}, '
        f'load average {meta["load_before"]}', flush=True)
  peaks = {'bfloat16': matmul_peak(sh.matmul_sizes, repeats)}
  if backend == 'cpu':                            # the train steps' dtype there (train_config)
    peaks['float32'] = matmul_peak(sh.matmul_sizes, repeats, jnp.float32)
  bandwidth = read_bandwidth(sh.read_bytes, repeats)
  machine = dict(peaks=peaks, gbps=bandwidth / 1e9)
  print(', '.join(f'{dt} matmul peak {r / 1e12:.3f} TFLOP/s' for dt, r in peaks.items())
        + f', read bandwidth {machine["gbps"]:.2f} GB/s', flush=True)
  decode_rows, gaps = decode(sh, bandwidth, repeats)
  train_rows, errors = [], []
  for impl in attention_impls(backend):
    try:
      train_rows.append(train(sh, impl, peaks, repeats))
    except Exception as e:  # noqa: BLE001  (one implementation failing must not hide the rest)
      errors.append((impl, f'{type(e).__name__}: {str(e).splitlines()[0][:200]}'))
  meta['load_after'] = _uptime()
  meta['warning'] = host.print_load_warning(load_before)
  page = render(meta, machine, decode_rows, gaps, train_rows, errors)
  print(page)
  if report:
    pathlib.Path(report).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(report).write_text(page)
  if errors:
    raise SystemExit(f'{len(errors)} train step(s) failed: {errors}')


if __name__ == '__main__':
  _SMALL, _REPORT, _REPEATS = define_flags()
  app.run(main)
