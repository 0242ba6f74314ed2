"""Dynamic filtering: refill rounds against streaming (oversampling) for one RL step's batch.

  .venv/bin/python -m benchmarks.stream_filter

One step wants --prompts groups of --group samples whose rewards are not all
equal. A fraction --flat of the prompts are "flat" (every sample gets the
same reward, so the group is dropped), the others always carry signal. Each
row has its own target length (the long-tail lengths of benchmarks/sampler.py:
lognormal with median --new_tokens / 8, one row in 32 at --new_tokens),
enforced as a per-row stop position, and scoring a row costs --score_ms of
wall time outside the interpreter (a sleep: a sandboxed verifier runs in its
own process). Three sides collect the same batch (the first groups with
signal in prompt order), each with the same KV-cache memory (--batch rows x
(prompt + cap) token slots):

* rounds, one-call sampler: sample a round of --prompts prompts, score it,
  refill with another round while groups are missing (`filtering.fill_groups`);
* rounds, paged engine (--slots slots): the same rounds through the engine;
* stream, paged engine: one streaming call fed a batch whenever its queue runs
  dry and the running groups are not expected to fill the batch, each group
  scored on a thread as it ends, the rest cancelled once the batch is known
  (`filtering.stream_fill`).

The sides run alternately (--repeats times, after one warm-up each); printed:
a table of median seconds per step, the useful tokens (the kept rows'), the
tokens generated and decode slots paid for, rows cancelled, time the sampler
waited for scores; the floor of the useful work (its FLOPs at a measured
float32 matmul rate, plus nothing for scoring, which can overlap); and last
one JSON line.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

if __package__ in (None, ''):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402  (the imports below need the path above)
from absl import flags
import jax
import numpy as np
from flax import nnx

from benchmarks import floor
from benchmarks import host
from models import config as config_lib
from models import transformer
from rl import buckets
from rl import engine_options
from rl import filtering
from rl import sampler as sampler_lib

_LAYERS = flags.DEFINE_integer('layers', 2, 'Transformer blocks.')
_EMBED = flags.DEFINE_integer('embed', 192, 'Residual width.')
_PROMPTS = flags.DEFINE_integer('prompts', 16, 'Groups wanted per step (prompts per batch).')
_GROUP = flags.DEFINE_integer('group', 8, 'Samples per prompt (G).')
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 16, 'Tokens per prompt.')
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 256, 'Length cap (the longest rows).')
_BATCH = flags.DEFINE_integer('batch', 32, 'KV memory: rows of prompt + cap token slots.')
_SLOTS = flags.DEFINE_integer('slots', 64, 'Decode slots of the paged engine.')
_FLAT = flags.DEFINE_float('flat', 0.5, 'Fraction of prompts whose groups carry no signal.')
_SCORE_MS = flags.DEFINE_float('score_ms', 5.0, 'Wall milliseconds to score one row.')
_REFILL_CAP = flags.DEFINE_integer('refill_cap', 4, 'Extra batches allowed (both ways).')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed steps per side.')
_SEED = flags.DEFINE_integer('seed', 0, 'Workload seed.')


class Workload:
  """Prompts, per-row lengths and which prompts are flat, for every batch a step may feed."""

  def __init__(self, cfg, seed: int):
    p, g = _PROMPTS.value, _GROUP.value
    total = p * (1 + _REFILL_CAP.value)
    rng = np.random.default_rng(seed)
    self.prompts = rng.integers(0, cfg.vocab_size, (total, _PROMPT_LEN.value)).tolist()
    self.limits = floor.longtail_limits(total * g, _NEW_TOKENS.value, seed)
    self.flat = rng.random(total) < _FLAT.value
    self.scored_rows = 0

  def batch(self, k: int):
    p, g = _PROMPTS.value, _GROUP.value
    return self.prompts[k * p:(k + 1) * p], self.limits[k * p * g:(k + 1) * p * g]

  def score(self, prompt_ids, lengths) -> np.ndarray:
    """Rewards of the rows of `prompt_ids` (G each); sleeps --score_ms per row."""
    g = _GROUP.value
    time.sleep(_SCORE_MS.value / 1e3 * len(prompt_ids) * g)
    self.scored_rows += len(prompt_ids) * g
    flat = np.repeat(self.flat[np.asarray(prompt_ids)], g)
    out = np.where(flat, 1.0, np.tile(np.arange(g) % 2, len(prompt_ids)))
    # Every row ran to its own length: the workload is what both sides generate.
    assert lengths.shape == (len(prompt_ids) * g,)
    return out.astype(np.float32)


def rounds(sampler, params, sp, work: Workload, key):
  """Dynamic filtering in refill rounds: (kept rows' lengths, rounds)."""
  drawn = [0]

  def draw(n):
    k = drawn[0]
    drawn[0] += 1
    prompts, limits = work.batch(k)
    assert len(prompts) == n
    out = sampler.generate(params, prompts, jax.random.fold_in(key, k), sp,
                           num_samples=_GROUP.value, row_limits=limits)
    assert np.array_equal(out.lengths, limits), 'a row did not run to its target length'
    ids = np.arange(k * n, (k + 1) * n)
    return out.lengths, work.score(ids, out.lengths)

  f = filtering.fill_groups(draw, _PROMPTS.value, _GROUP.value,
                            max_rounds=1 + _REFILL_CAP.value)
  return f, {'rounds': f.rounds}


def stream(sampler, params, sp, work: Workload, key):
  """Dynamic filtering by streaming: (kept rows' lengths, stats)."""
  fill = filtering.StreamFill(_PROMPTS.value, _GROUP.value, _PROMPTS.value, 1 + _REFILL_CAP.value)
  fed = [0]

  def next_prompts():
    k = fed[0]
    fed[0] += 1
    return work.batch(k)

  got = filtering.stream_fill(
      sampler, params, key, sp, fill, next_prompts,
      score=lambda groups, s: (s.lengths, work.score(groups, s.lengths)),
      book=lambda groups, scored: scored, max_prompt_len=_PROMPT_LEN.value,
      rows=_PROMPTS.value * _GROUP.value)
  return fill.result(), {'rounds': fill.batches, 'rows_cancelled': got.rows_cancelled,
                         'rows_unscored': got.rows_unscored, 'score_wait_s': got.wait_s}


def main(argv):
  del argv
  load_before = os.getloadavg()
  cfg = config_lib.ModelConfig.tiny(num_layers=_LAYERS.value, embed_dim=_EMBED.value,
                                    num_heads=6, num_kv_heads=6, head_dim=32,
                                    mlp_dim=4 * _EMBED.value, vocab_size=256)
  graphdef, params = nnx.split(transformer.create(cfg, seed=_SEED.value))
  p, g, cap = _PROMPTS.value, _GROUP.value, _NEW_TOKENS.value
  sp = sampler_lib.SamplingParams(max_new_tokens=cap, temperature=1.0)
  pb = buckets.smallest_fit(engine_options.DEFAULT_PROMPT_BUCKETS, _PROMPT_LEN.value, 'prompt')
  nb = buckets.smallest_fit(engine_options.DEFAULT_NEW_TOKEN_BUCKETS, cap, 'new tokens')
  budget = _BATCH.value * (pb + nb)                 # KV token slots, the same on every side
  paged = lambda: sampler_lib.Sampler(graphdef, cfg, eos_ids=(), engine='paged',
                                      slots=_SLOTS.value, page_size=16, pages=budget // 16,
                                      chunk_steps=32)
  sides = {
      'rounds, one-call sampler': (sampler_lib.Sampler(graphdef, cfg, eos_ids=(),
                                                       cache_tokens_per_device=budget), rounds),
      'rounds, paged engine': (paged(), rounds),
      'stream, paged engine': (paged(), stream)}
  work = Workload(cfg, _SEED.value)
  print(f'model: {cfg.num_layers} layers, embed {cfg.embed_dim}, {cfg.num_params() / 1e6:.2f}M '
        f'params | jax {jax.__version__} on {jax.devices()[0].platform}')
  print(f'step: {p} groups of {g} wanted, {_FLAT.value:.0%} of prompts flat, cap {cap} '
        f'(per-row lengths median {int(np.median(work.limits))}, mean '
        f'{work.limits.mean():.0f}), scoring {_SCORE_MS.value} ms per row, KV memory {budget} '
        f'token slots on every side')
  secs = {name: [] for name in sides}
  stats, kept = {}, {}
  for rep in range(1 + _REPEATS.value):             # the first pass compiles
    for name, (s, fn) in sides.items():
      slots0, made0 = s.decode_slots, s.generated_tokens
      work.scored_rows = 0
      t0 = time.perf_counter()
      f, st = fn(s, params, sp, work, jax.random.key(rep))
      dt = time.perf_counter() - t0
      if rep:
        secs[name].append(dt)
      kept[name] = (int(f.rows.sum()), f.groups_kept)
      stats[name] = dict(st, generated_tokens=s.generated_tokens - made0,
                         decode_slots=s.decode_slots - slots0, scored_rows=work.scored_rows,
                         prompts_fed=f.prompts_drawn)
  assert len(set(kept.values())) == 1, f'the sides kept different batches: {kept}'
  useful, groups = kept['stream, paged engine']
  med = {name: statistics.median(v) for name, v in secs.items()}
  base = med['rounds, one-call sampler']
  print(f'\nthe batch: {groups} groups kept, {useful} useful tokens')
  print(f'{"":<26} {"median s":>9} {"vs rounds":>10} {"generated":>10} {"slots paid":>11} '
        f'{"scored":>7} {"cancelled":>10} {"unscored":>9} {"prompts fed":>12}')
  result = dict(groups=groups, group_size=g, cap=cap, flat=_FLAT.value,
                score_ms=_SCORE_MS.value, useful_tokens=useful, kv_token_slots=budget, sides={})
  for name, m in med.items():
    st = stats[name]
    print(f'{name:<26} {m:>9.3f} {base / m:>9.2f}x {st["generated_tokens"]:>10} '
          f'{st["decode_slots"]:>11} {st["scored_rows"]:>7} {st.get("rows_cancelled", 0):>10} '
          f'{st.get("rows_unscored", 0):>9} {st["prompts_fed"]:>12}')
    result['sides'][name] = dict(median_s=m, speedup_vs_one_call_rounds=base / m, **st)
  result['stream_vs_engine_rounds'] = med['rounds, paged engine'] / med['stream, paged engine']
  result['stream_vs_one_call_rounds'] = base / med['stream, paged engine']
  flops_rate, bandwidth = floor.measure_machine(
      [(_BATCH.value, cfg.embed_dim, cfg.mlp_dim), (_BATCH.value, cfg.mlp_dim, cfg.embed_dim),
       (_BATCH.value, cfg.embed_dim, cfg.vocab_size)])
  # Floor: the kept rows' own tokens at the measured matmul rate (scoring can overlap it).
  flops = useful_flops(cfg, work, groups, flops_rate, bandwidth)
  fl = flops / flops_rate
  print(f'machine: float32 matmul {flops_rate / 1e9:.1f} GFLOP/s, memory read '
        f'{bandwidth / 1e9:.1f} GB/s; floor of the useful work {flops / 1e9:.2f} GFLOP -> '
        f'{fl:.3f} s; the stream {med["stream, paged engine"] / fl:.1f}x the floor')
  result.update(floor_s=fl, matmul_gflops=flops_rate / 1e9, mem_gbps=bandwidth / 1e9)
  host.print_load_warning(load_before)
  print(json.dumps(result))


def useful_flops(cfg, work: Workload, groups: int, flops_rate, bandwidth) -> float:
  """FLOPs of generating the kept groups' rows alone (the first `groups` prompts with signal)."""
  g = _GROUP.value
  keep = np.flatnonzero(~work.flat)[:groups]
  return sum(floor.generation_floor(cfg, 1, _PROMPT_LEN.value, int(n), flops_rate,
                                    bandwidth)['flops']
             for i in keep for n in work.limits[i * g:(i + 1) * g])


if __name__ == '__main__':
  app.run(main)
