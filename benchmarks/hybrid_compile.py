"""Compile time of the hybrid (Nemotron-H) layer stack: unrolled, segments and folded, side by side.

  .venv/bin/python -m benchmarks.hybrid_compile                          # Nemotron-3-Nano's pattern
  .venv/bin/python -m benchmarks.hybrid_compile --pattern='M*EM*EM*E-' --programs=forward
  .venv/bin/python -m benchmarks.hybrid_compile --variants=segments,folded --programs=train

For each program (an SFT train step: forward, backward with full remat and the AdamW
update; a forward to logits; one decode step into a KV cache and Mamba states) it lowers
and compiles the same small-width model once per variant on the default backend, back to
back so load from other processes hits them alike: 'unrolled' (scan_layers=False: one body
per sublayer), 'segments' (models/hybrid.py `plan`: a scan per repeated segment, one body per
position of its unit) and 'folded' (`hybrid.Fold`: one scan over the pattern, one body per
kind of sublayer in a switch); the layout is forced per variant (`transformer.create(layout=)`),
whatever the pattern would choose. It prints the seconds of each, the ratio of the first
variant's to each other's, and the compiled program's temporaries (XLA's memory analysis).
The compiled programs run once on the same inputs and each variant's outputs are checked
against the first's (the forward's logits, the decode step's logits, the train step's
loss). The last line is JSON. Compile times are only comparable near a load average of 0;
the load is printed before and after.
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import host
from models import config as config_lib
from models import hybrid
from models import transformer
from rl import batch as batch_lib
from rl import sft
from rl import train_step as train_lib

_PATTERN = flags.DEFINE_string('pattern', config_lib.NEMOTRON_3_NANO_PATTERN,
                               "Nemotron-H layer letters ('M' mamba, '*' attention, '-' mlp, "
                               "'E' moe); default Nemotron-3-Nano-30B-A3B's 52.")
_PROGRAMS = flags.DEFINE_list('programs', ['train', 'forward', 'decode'],
                              'Programs to compile: train, forward, decode.')
_EMBED = flags.DEFINE_integer('embed', 64, 'Residual width (the rest as tiny_hybrid).')
_LENGTH = flags.DEFINE_integer('length', 64, 'Tokens per row (train and forward).')
_ROWS = flags.DEFINE_integer('rows', 2, 'Rows.')
_VARIANTS = flags.DEFINE_list('variants', ['unrolled', 'segments', 'folded'],
                              'Stacks to compare, the first the reference: unrolled, segments, '
                              'folded.')

SFT = train_lib.LossSpec(sft.SftConfig, sft.loss_fn, sft.normalizers)
PROGRAMS = ('train', 'forward', 'decode')
VARIANTS = ('unrolled', 'segments', 'folded')


def model_config(scan: bool) -> config_lib.ModelConfig:
  pattern = config_lib.parse_pattern(_PATTERN.value)
  return config_lib.ModelConfig.tiny_hybrid(
      embed_dim=_EMBED.value, num_layers=len(pattern), layer_types=pattern, remat='full',
      scan_layers=scan, max_seq_len=max(_LENGTH.value, 128))


def sft_batch(rows: int, length: int, vocab: int) -> batch_lib.TrainBatch:
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, vocab, (rows, length)).astype(np.int32)
  z = np.zeros((rows, length), np.float32)
  return batch_lib.TrainBatch(
      tokens=tokens, positions=np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape),
      segment_ids=np.ones(tokens.shape, np.int32),
      targets=np.concatenate([tokens[:, 1:], np.zeros((rows, 1), np.int32)], 1),
      loss_mask=np.concatenate([np.ones((rows, length - 1)), np.zeros((rows, 1))], 1).astype(
          np.float32),
      old_logprobs=z, advantages=np.zeros((rows,), np.float32),
      truncated=np.zeros((rows,), bool), teacher_index=np.zeros((rows,), np.int32),
      ref_logprobs=z, teacher_logprobs=z)


def program(name: str, cfg: config_lib.ModelConfig, layout: str):
  """(jitted function, its arguments, output -> array compared between the two stacks)."""
  graphdef, params = nnx.split(transformer.create(cfg, seed=0, layout=layout))
  rows, length = _ROWS.value, _LENGTH.value
  if name == 'train':
    opt = train_lib.make_optimizer(train_lib.OptimizerConfig(lr=1e-4))
    state = train_lib.init_state(params, opt)
    batch = jax.tree.map(jnp.asarray, sft_batch(rows, length, cfg.vocab_size))
    return (train_lib.make_train_step(graphdef, SFT, None, opt), (state, batch),
            lambda out: out[1]['loss'])
  tokens = jnp.asarray(sft_batch(rows, length, cfg.vocab_size).tokens)
  if name == 'forward':
    return (jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)), (params, tokens), lambda out: out)
  if name == 'decode':
    cache = transformer.init_cache(cfg, rows, 128)

    def step(p, cache, t):
      return nnx.merge(graphdef, p)(t, cache=cache)
    return jax.jit(step), (params, cache, tokens[:, :1]), lambda out: out[0]
  raise ValueError(f'--programs: unknown program {name!r}; expected some of {PROGRAMS}')


def measure(name: str, variants) -> dict:
  out, results = dict(program=name), {}
  for key in variants:
    layout = 'fold' if key == 'folded' else 'segments'
    fn, args, pick = program(name, model_config(key != 'unrolled'), layout)
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out[f'{key}_lower_s'], out[f'{key}_compile_s'] = t1 - t0, t2 - t1
    memory = compiled.memory_analysis()
    out[f'{key}_temp_mib'] = (None if memory is None
                              else memory.temp_size_in_bytes / 2**20)
    results[key] = np.asarray(pick(compiled(*args)), np.float64)
  first = variants[0]
  total = lambda k: out[f'{k}_lower_s'] + out[f'{k}_compile_s']
  for key in variants[1:]:
    out[f'{key}_ratio'] = total(first) / total(key)
    out[f'{key}_max_abs_diff'] = float(np.max(np.abs(results[key] - results[first])))
  return out


def main(argv):
  del argv
  jax.config.update('jax_enable_compilation_cache', False)
  variants = _VARIANTS.value
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown or not variants:
    raise app.UsageError(f'--variants: unknown {unknown}; expected some of {VARIANTS}')
  cfg = model_config(True)
  segs = hybrid.plan(cfg.mixers)
  bodies = sum(len(s.unit) for s in segs)
  kinds = len(hybrid.fold_steps(cfg.mixers)[0])
  before = os.getloadavg()
  print(f'{cfg.num_layers} sublayers: unrolled {cfg.num_layers} bodies, segments {bodies} '
        f'bodies in {len(segs)} segments, folded {kinds} bodies; width {cfg.embed_dim}, '
        f'{_ROWS.value} x {_LENGTH.value} tokens; {jax.default_backend()}; '
        f'load average {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}', flush=True)
  rows = []
  for name in _PROGRAMS.value:
    r = measure(name, variants)
    rows.append(r)
    for key in variants:
      extra = ('' if key == variants[0] else
               f'  {variants[0]}/{key} {r[f"{key}_ratio"]:.1f}x  max |diff| '
               f'{r[f"{key}_max_abs_diff"]:.2e}')
      temp = r[f'{key}_temp_mib']
      print(f'{name:>8} {key:>9}: lower {r[f"{key}_lower_s"]:7.1f} s + compile '
            f'{r[f"{key}_compile_s"]:7.1f} s, temporaries '
            f'{"?" if temp is None else f"{temp:.1f}"} MiB{extra}', flush=True)
  after = os.getloadavg()
  print(f'load average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}')
  warning = host.load_warning(before, after)
  if warning:
    print(warning)
  print(json.dumps(dict(sublayers=cfg.num_layers, bodies=bodies, segments=len(segs),
                        kinds=kinds, variants=variants, load_before=before,
                        load_after=after, rows=rows)))


if __name__ == '__main__':
  app.run(main)
