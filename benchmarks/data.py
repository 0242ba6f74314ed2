"""Data at scale: start-up to the first batch (cold, and warm from the tokenize-once cache), host
memory peak and rows/s, on a generated SFT set and RL prompt set.

  .venv/bin/python -m benchmarks.data                      # 1M SFT rows, 100K RL prompts
  .venv/bin/python -m benchmarks.data --scale=0.1          # the same rows, texts 10x shorter
  .venv/bin/python -m benchmarks.data --small --out=/tmp/x.md   # the smoke test's size

Generated (streamed to disk, memory bounded; --dir): --rows SFT conversations in 16
.jsonl.zst shards and --rl_rows math prompts in 8 .jsonl shards, plus a 200-prompt
held-out set and a SentencePiece tokenizer (4K pieces) trained on a sample. An SFT
row is a user question (lognormal, median 60 words), a reasoning trace (lognormal,
median 1,500 words, one row in 50 a long trace of 6,000-30,000 words) and an answer
(median 120 words); --scale multiplies every length (1.0 is about the papers'
shape: most traces a few thousand tokens, a tail of tens of thousands).

Each measurement runs in a fresh Python process (so its memory peak is its own): the
run's data path (`cascade.stage_data.StageData` on a plan with an SFT stage over the
SFT set and a GRPO stage over the prompts) up to the first batch of each stage.
Cold: an empty cache directory (shard indexes, decompressed copies and the
stages' tokenized data are all made). Warm: the same directory again, as a run's
restart or resume finds it. Printed and written to --out (default
docs/data_benchmark.md): the command, date, machine and load average, the
start-up seconds, peak RSS, preparation rows/s per stage, and batches/s drawn
from the warm cache; last, one JSON line.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import resource
import shutil
import subprocess
import sys
import time

if __package__ in (None, ''):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402  (the imports below need the path above)
from absl import flags
import numpy as np

_ROWS = flags.DEFINE_integer('rows', 1_000_000, 'SFT conversations to generate.')
_RL_ROWS = flags.DEFINE_integer('rl_rows', 100_000, 'RL prompts to generate.')
_SCALE = flags.DEFINE_float('scale', 1.0, 'Multiplies every text length of the SFT rows.')
_DIR = flags.DEFINE_string('dir', '/tmp/cascade-data-bench', 'Where data and caches go.')
_OUT = flags.DEFINE_string('out', 'docs/data_benchmark.md', 'The report (markdown).')
_SMALL = flags.DEFINE_bool('small', False, 'Smoke size: 3000 SFT rows, 500 prompts, scale 0.05.')
_BATCHES = flags.DEFINE_integer('batches', 50, 'Warm batches drawn to time the draw rate.')
_PHASE = flags.DEFINE_string('phase', '', 'Internal: run one measurement in this process.')

SFT_SHARDS, RL_SHARDS = 16, 8
SFT_BATCH, SFT_MAX_LEN = 64, 8192
RL_PROMPTS, RL_MAX_PROMPT = 128, 1024


def _words(rng, n_pool=4096):
  letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
  return [''.join(rng.choice(letters, rng.integers(2, 9))) for _ in range(n_pool)]


class TextMaker:
  """Random text of a given number of words, from a pool of pre-made sentences (fast)."""

  def __init__(self, seed: int):
    rng = np.random.default_rng(seed)
    words = _words(rng)
    self.sentences = [' '.join(rng.choice(words, 12)) + '.' for _ in range(8192)]
    self.rng = rng

  def text(self, n_words: int) -> str:
    k = max(1, n_words // 12)
    idx = self.rng.integers(0, len(self.sentences), k)
    return ' '.join(self.sentences[i] for i in idx)


def _lognormal(rng, median: float, sigma: float = 0.8) -> int:
  return int(max(1, rng.lognormal(np.log(median), sigma)))


def generate(d: str, rows: int, rl_rows: int, scale: float) -> dict:
  """Writes the SFT and RL sets, the held-out set and the tokenizer under `d` (streamed)."""
  import zstandard  # pylint: disable=g-import-not-at-top
  from models import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  d = pathlib.Path(d)
  (d / 'sft').mkdir(parents=True, exist_ok=True)
  (d / 'rl').mkdir(parents=True, exist_ok=True)
  t0 = time.time()
  mk = TextMaker(0)
  rng = mk.rng
  chars = []
  cctx = zstandard.ZstdCompressor(level=3)
  per = -(-rows // SFT_SHARDS)
  for s in range(SFT_SHARDS):
    with open(d / 'sft' / f'part-{s:05d}.jsonl.zst', 'wb') as f, cctx.stream_writer(f) as w:
      for i in range(s * per, min(rows, (s + 1) * per)):
        trace = (int(rng.integers(6000, 30000)) if rng.random() < 0.02
                 else _lognormal(rng, 1500))
        row = {'id': f'sft-{i}', 'domain': 'math',
               'messages': [{'role': 'user', 'content': mk.text(int(
                   _lognormal(rng, 60) * scale) + 1)}],
               'thinking': mk.text(int(trace * scale) + 1),
               'response': mk.text(int(_lognormal(rng, 120) * scale) + 1)}
        line = json.dumps(row)
        if i < 2000:
          chars.append(len(line))
        w.write(line.encode() + b'\n')
  per = -(-rl_rows // RL_SHARDS)
  for s in range(RL_SHARDS):
    with open(d / 'rl' / f'part-{s:05d}.jsonl', 'w') as f:
      for i in range(s * per, min(rl_rows, (s + 1) * per)):
        q = mk.text(_lognormal(rng, 50, 0.6))
        f.write(json.dumps({'id': f'rl-{i}', 'messages': [{'role': 'user', 'content': q}],
                            'metadata': {'answer': str(i % 997)}}) + '\n')
  with open(d / 'heldout.jsonl', 'w') as f:
    for i in range(200):
      f.write(json.dumps({'id': f'ev-{i}', 'messages': [
          {'role': 'user', 'content': mk.text(40)}], 'metadata': {'answer': str(i)}}) + '\n')
  tokenizer_lib.train_sentencepiece((mk.text(200) for _ in range(3000)), d / 'tok', 4096)
  size = sum(f.stat().st_size for f in (d / 'sft').iterdir())
  return {'seconds': round(time.time() - t0, 1), 'sft_bytes_on_disk': size,
          'sft_mean_chars_per_row': round(float(np.mean(chars)), 1),
          'sft_p99_chars_per_row': int(np.percentile(chars, 99))}


def config(d: str, cache: str):
  """The plan's config: an SFT stage over the SFT shards, a GRPO stage over the prompts."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny', overrides=dict(vocab_size=4096, max_seq_len=SFT_MAX_LEN))
  c.tokenizer = dict(path=os.path.join(d, 'tok.model'))
  c.mesh = dict(shape=None)
  c.sampler = dict()
  c.ckpt = dict(every_n_steps=1000, keep=1)
  c.eval = dict(num_samples=1, temperature=1.0, top_p=1.0, max_new_tokens=8,
                max_prompt_len=RL_MAX_PROMPT, num_prompts=0, batch_size=8)
  c.datasets = dict(sft=dict(path=os.path.join(d, 'sft', '*.jsonl.zst'), format='sft'),
                    rl=dict(path=os.path.join(d, 'rl', '*.jsonl'), format='prompt',
                            domain='math'),
                    heldout=dict(path=os.path.join(d, 'heldout.jsonl'), format='prompt',
                                 domain='math'))
  c.domains = dict(math=dict(verifier='math', train='rl', eval='heldout'))
  c.stages = [dict(name='sft', kind='sft', domains=['math'], datasets=['sft'], steps=1000,
                   batch_size=SFT_BATCH, max_len=SFT_MAX_LEN, optimizer=dict(lr=1e-5)),
              dict(name='math_rl', kind='grpo', domains=['math'], steps=100,
                   optimizer=dict(lr=1e-6), prompts_per_step=RL_PROMPTS, group_size=8,
                   max_prompt_len=RL_MAX_PROMPT, max_response_len=256)]
  c.data_cache = cache
  return c


def _rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def measure(d: str, cache: str, batches: int) -> dict:
  """One start-up in this process: the data path up to each stage's first batch."""
  t0 = time.time()
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade import data as data_lib  # pylint: disable=g-import-not-at-top
  from cascade import stage_data  # pylint: disable=g-import-not-at-top
  from cascade import verifier_set  # pylint: disable=g-import-not-at-top
  from models import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  t_import = time.time() - t0
  plan = config_lib.validate(config(d, cache))
  tok = tokenizer_lib.load(plan.tokenizer_path)
  checks = verifier_set.VerifierSet(plan, rm_scorer=lambda st: None, rm_ready=lambda n: False)
  sd = stage_data.StageData(plan, tok, checks.check_metadata, cache_dir=cache)
  t1 = time.time()
  logs = []
  real_print = print

  def log(*a, **k):
    logs.append(' '.join(str(x) for x in a))
    real_print(*a, **k)
  import builtins  # pylint: disable=g-import-not-at-top
  builtins.print = log
  try:
    sd.load()
    sft_stage, rl_stage = plan.stages
    sft_loader = data_lib.Loader(sd.stage_records(sft_stage), 1, sft_stage.batch_size)
    first = sft_loader.next()
    rl_loader = data_lib.Loader(sd.stage_records(rl_stage), 2, rl_stage.prompts_per_step)
    rl_loader.next()
  finally:
    builtins.print = real_print
  startup = time.time() - t1
  rss_startup = _rss_gib()
  t2 = time.time()
  for _ in range(batches):
    sft_loader.next()
  draw_s = time.time() - t2
  manifests = {}
  for st in plan.stages:
    found = [p for p in pathlib.Path(cache).glob(f'{st.name}-*/manifest.json')]
    if found:
      manifests[st.name] = json.loads(found[0].read_text())
  return {'import_s': round(t_import, 2), 'startup_s': round(startup, 2),
          'rss_peak_gib_at_first_batch': round(rss_startup, 3),
          'rss_peak_gib': round(_rss_gib(), 3),
          'sft_rows': len(sd.stage_records(sft_stage).source),
          'rl_rows': len(sd.stage_records(rl_stage).source),
          'first_batch_tokens': int(sum(len(t) for t, _ in first)),
          'sft_batches_per_s': round(batches / max(draw_s, 1e-9), 2),
          'sft_rows_per_s_drawn': round(batches * SFT_BATCH / max(draw_s, 1e-9), 1),
          'prepare_rows_per_s': {k: m['rows_per_s'] for k, m in manifests.items()},
          'prepare_s': {k: m['seconds'] for k, m in manifests.items()}}


def _child(d: str, cache: str, batches: int) -> dict:
  cmd = [sys.executable, '-m', 'benchmarks.data', f'--phase=measure', f'--dir={d}',
         f'--batches={batches}', f'--out={cache}']
  t0 = time.time()
  out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                       cwd=str(pathlib.Path(__file__).resolve().parents[1]))
  if out.returncode:
    raise RuntimeError(f'{" ".join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}')
  res = json.loads(out.stdout.strip().splitlines()[-1])
  res['process_s'] = round(time.time() - t0, 2)
  return res


def _machine() -> str:
  import psutil  # pylint: disable=g-import-not-at-top
  return (f'{platform.node()}: {platform.processor() or platform.machine()}, '
          f'{os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2 ** 30:.0f} GiB RAM, '
          f'Python {platform.python_version()}')


def report(args: dict, gen: dict, cold: dict, warm: dict, load: tuple) -> str:
  cmd = ' '.join(['.venv/bin/python -m benchmarks.data'] + sys.argv[1:])
  rows = [('start-up to the first batch (s, in-process)', cold['startup_s'], warm['startup_s']),
          ('the whole process, imports included (s)', cold['process_s'], warm['process_s']),
          ('host memory peak at the first batches (GiB RSS)',
           cold['rss_peak_gib_at_first_batch'], warm['rss_peak_gib_at_first_batch']),
          (f'SFT rows drawn per s from the cache ({args["batches"]} batches of {SFT_BATCH})',
           cold['sft_rows_per_s_drawn'], warm['sft_rows_per_s_drawn'])]
  lines = [
      '# Data path benchmark', '',
      'Generated by `benchmarks/data.py` (its docstring describes the data and the phases); '
      'rerun the command to refresh this page.', '',
      f'- command: `{cmd}`',
      f'- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC',
      f'- machine: {_machine()}',
      f'- load average (1, 5, 15 min) before / after: {load[0]} / {load[1]}',
      f'- data: {warm["sft_rows"]:,} SFT conversations in {SFT_SHARDS} .jsonl.zst shards '
      f'({gen.get("sft_bytes_on_disk", 0) / 2 ** 20:,.0f} MiB compressed, mean '
      f'{gen.get("sft_mean_chars_per_row", 0):,.0f} characters a row, p99 '
      f'{gen.get("sft_p99_chars_per_row", 0):,}; --scale={args["scale"]}), '
      f'{warm["rl_rows"]:,} RL prompts in {RL_SHARDS} .jsonl shards',
      '', '| | cold (empty cache) | warm (cache found) |', '|---|---:|---:|']
  lines += [f'| {a} | {b} | {c} |' for a, b, c in rows]
  lines += ['', 'Cold preparation (streamed, one process): '
            + ', '.join(f'{k} {v:,.0f} rows/s ({cold["prepare_s"][k]:.0f} s)'
                        for k, v in cold['prepare_rows_per_s'].items()) + '.', '',
            f'Cold start-up / warm start-up: {cold["startup_s"] / warm["startup_s"]:,.0f}x '
            '(the same process and data, side by side in one run).', '',
            f'Target (a 1M-row SFT set starts training in <= 30 s from a warm cache, host '
            f'memory < 2 GiB): {warm["sft_rows"]:,} rows, warm start-up {warm["startup_s"]} s '
            f'in-process ({warm["process_s"]} s with imports), peak RSS '
            f'{warm["rss_peak_gib_at_first_batch"]} GiB.', '']
  if args['scale'] != 1.0:
    lines += [f'Text lengths are scaled by --scale={args["scale"]}. The warm start-up reads '
              'the shard indexes and the cache by position, not the text, so it does not grow '
              'with the lengths. Cold preparation does: it tokenizes every character.', '']
  return '\n'.join(lines)


def main(argv):
  del argv
  if _PHASE.value == 'measure':
    print(json.dumps(measure(_DIR.value, _OUT.value, _BATCHES.value)))
    return
  rows, rl_rows, scale = _ROWS.value, _RL_ROWS.value, _SCALE.value
  if _SMALL.value:
    rows, rl_rows, scale = 3000, 500, 0.05
  d = _DIR.value
  load0 = tuple(round(x, 2) for x in os.getloadavg())
  shutil.rmtree(d, ignore_errors=True)
  gen = generate(d, rows, rl_rows, scale)
  print(f'generated in {gen["seconds"]} s: {gen}', flush=True)
  cache = os.path.join(d, 'cache')
  cold = _child(d, cache, _BATCHES.value)
  print(f'cold: {cold}', flush=True)
  warm = _child(d, cache, _BATCHES.value)
  print(f'warm: {warm}', flush=True)
  load1 = tuple(round(x, 2) for x in os.getloadavg())
  text = report({'scale': scale, 'batches': _BATCHES.value}, gen, cold, warm, (load0, load1))
  pathlib.Path(_OUT.value).write_text(text)
  print(text)
  print(json.dumps({'generate': gen, 'cold': cold, 'warm': warm}))


if __name__ == '__main__':
  app.run(main)
