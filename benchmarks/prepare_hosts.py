"""Preparing a stage's tokenize-once cache on two processes, the code of two commits side by side:
per process, the rows it tokenized and the bytes it read from the dataset.

  .venv/bin/python -m benchmarks.prepare_hosts --before=eeaf06a --after=HEAD

Generated (--dir): an SFT set of --rows conversations in 16 uneven shards (shard 0 holds
half the rows, 15 small ones the rest; every other small one gzipped), a 200-prompt
held-out set, and a SentencePiece tokenizer (1K pieces) trained on a sample. For each
commit (its tree taken with `git archive`, so the working tree's edits do not count), two
JAX processes (gloo on CPU, as two hosts) run the run's data path
(`cascade.data.stage_data.StageData.load` with the run's hosts) on an empty cache directory
they share, which opens the shards and prepares the SFT stage's cache. Per process:

  rows tokenized   calls of `cascade.kinds.sft.example` (the SFT stage's tokenize),
                   the cache key's probe of 8 included;
  bytes read       through `cascade.data.shards._open`: the dataset's shards (index builds,
                   decompression, row reads) and the decompressed copies of gzip shards;
  CPU s, wall s    of the load (both processes share this machine's cores);
  cache digest     sha256 of every position's item, read back from the cache.

The section "Preparing on several processes, measured" of --out (default docs/data.md) is
replaced with the table, the command, date, machine and load average; the rest of the page is
left as it is. The last line printed is the JSON of every process's numbers.
"""

from __future__ import annotations

import datetime
import gzip
import hashlib
import importlib
import json
import os
import pathlib
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

SECTION = '## Preparing on several processes, measured'
SHARDS = 16

if __name__ == '__main__' and '--phase' in ' '.join(sys.argv):
  # A phase imports `cascade` from the tree under test (PYTHONPATH), not from this checkout.
  sys.path = [p for p in sys.path if os.path.abspath(p or '.') != os.path.dirname(
      os.path.abspath(__file__))]

import numpy as np  # noqa: E402


def generate(d: str, rows: int) -> dict:
  """Writes the SFT shards, the held-out set and the tokenizer under `d`."""
  from foundation import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  words = [''.join(rng.choice(list('abcdefghijklmnopqrstuvwxyz'), int(rng.integers(2, 9))))
           for _ in range(3000)]
  text = lambda n: ' '.join(rng.choice(words, n))
  sft = pathlib.Path(d) / 'sft'
  sft.mkdir(parents=True, exist_ok=True)
  big = rows // 2
  small = [(rows - big) // (SHARDS - 1) + (j < (rows - big) % (SHARDS - 1))
           for j in range(SHARDS - 1)]
  n = 0
  for s, k in enumerate([big] + small):
    lines = []
    for i in range(n, n + k):
      lines.append(json.dumps({
          'id': f'sft-{i}', 'domain': 'math',
          'messages': [{'role': 'user', 'content': text(int(rng.lognormal(np.log(30), 0.6)) + 1)}],
          'response': text(int(rng.lognormal(np.log(150), 0.8)) + 1)}))
    n += k
    raw = ('\n'.join(lines) + '\n').encode()
    if s % 2:
      (sft / f'part-{s:02d}.jsonl.gz').write_bytes(gzip.compress(raw, 6))
    else:
      (sft / f'part-{s:02d}.jsonl').write_bytes(raw)
  with open(os.path.join(d, 'heldout.jsonl'), 'w') as f:
    for i in range(200):
      f.write(json.dumps({'id': f'ev-{i}', 'messages': [{'role': 'user', 'content': text(20)}],
                          'metadata': {'answer': str(i)}}) + '\n')
  tokenizer_lib.train_sentencepiece((text(200) for _ in range(2000)), pathlib.Path(d) / 'tok',
                                    1024)
  sizes = sorted(((f.name, f.stat().st_size) for f in sft.iterdir()))
  return {'rows': rows, 'shard_rows': [big] + small, 'shard_bytes': [s for _, s in sizes],
          'files': [n for n, _ in sizes]}


def config(d: str):
  import ml_collections  # pylint: disable=g-import-not-at-top
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny', overrides=dict(vocab_size=1024, max_seq_len=2048))
  c.tokenizer = dict(path=os.path.join(d, 'tok.model'))
  c.mesh = dict(shape=None)
  c.sampler = dict()
  c.ckpt = dict(every_n_steps=1000, keep=1)
  c.eval = dict(num_samples=1, temperature=1.0, top_p=1.0, max_new_tokens=8, max_prompt_len=512,
                num_prompts=0, batch_size=8)
  c.datasets = dict(sft=dict(path=os.path.join(d, 'sft', 'part-*'), format='sft'),
                    heldout=dict(path=os.path.join(d, 'heldout.jsonl'), format='prompt',
                                 domain='math'))
  c.domains = dict(math=dict(verifier='math', eval='heldout'))
  c.stages = [dict(name='sft', kind='sft', domains=['math'], datasets=['sft'], steps=1000,
                   batch_size=64, max_len=2048, optimizer=dict(lr=1e-5))]
  return c


def _module(name: str, older: str):
  """The module `name` of the tree under test, or `older` where that tree predates the move
  (a phase runs the code of the commit measured, before or after cascade/data/ and
  foundation/ existed)."""
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name not in (name, name.rpartition('.')[0]):
      raise
    return importlib.import_module(older)


def phase(d: str, cache: str, rank: int, coordinator: str) -> dict:
  """One process of the two: the run's data path on the shared, empty cache `cache`."""
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(coordinator, 2, rank)
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade import rollout  # pylint: disable=g-import-not-at-top
  from cascade.kinds import sft  # pylint: disable=g-import-not-at-top
  shards = _module('cascade.data.shards', 'cascade.shards')
  stage_data = _module('cascade.data.stage_data', 'cascade.stage_data')
  tokenizer_lib = _module('foundation.tokenizer', 'models.tokenizer')
  plan = config_lib.validate(config(d), known_verifiers=['math'])
  tok = tokenizer_lib.load(plan.tokenizer_path)
  counts = {'tokenized': 0, 'shards': 0, 'plain': 0}
  dataset = set(shards.expand(plan.datasets['sft'].path))
  real_example, real_open = sft.example, shards._open  # pylint: disable=protected-access

  def example(*a, **k):
    counts['tokenized'] += 1
    return real_example(*a, **k)

  # A tree whose cache tokenizes by batches (`sft.examples`): its single-turn rows are counted
  # here, its multi-turn ones by `example`, which it calls.
  real_examples = getattr(sft, 'examples', None)

  def examples(recs, *a, **k):
    counts['tokenized'] += sum(1 for r in recs if 'turns' not in r)
    return real_examples(recs, *a, **k)

  class Counted:
    def __init__(self, f, what):
      self._f, self._what = f, what

    def read(self, *a):
      b = self._f.read(*a)
      counts[self._what] += len(b)
      return b

    def __getattr__(self, name):
      return getattr(self._f, name)

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self._f.close()

  sft.example = example
  if real_examples is not None:
    sft.examples = examples
  shards._open = lambda p: Counted(real_open(p), 'shards' if p in dataset else 'plain')
  hosts = rollout.processes()
  sd = stage_data.StageData(plan, tok, None, cache_dir=cache, hosts=hosts)
  cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
  t0, c0 = time.time(), cpu()
  sd.load()
  wall, cpu_s = time.time() - t0, cpu() - c0
  got = dict(counts)
  items = sd.stage_records(plan.stages[0]).source
  h = hashlib.sha256()
  for i in range(len(items)):
    item = items[i]
    h.update(b'-' if item is None else b''.join(np.asarray(a, np.int32).tobytes() + b'|'
                                                for a in item))
  return {'rank': rank, 'rows': len(items), 'wall_s': round(wall, 2),
          'cpu_s': round(cpu_s, 2), **got, 'digest': h.hexdigest()[:16]}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _tree(rev: str, root: str) -> tuple[str, str]:
  """`rev`'s files under a new directory (git archive); (directory, commit)."""
  commit = subprocess.run(['git', 'rev-parse', '--short', rev], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()
  out = tempfile.mkdtemp(prefix=f'cascade-{commit}-')
  archive = subprocess.run(['git', 'archive', commit], cwd=root, check=True,
                           capture_output=True).stdout
  subprocess.run(['tar', '-x', '-C', out], input=archive, check=True)
  return out, commit


def across(d: str, tree: str) -> list[dict]:
  """Both processes of one commit's tree, on a fresh shared cache."""
  cache = os.path.join(d, 'cache')
  shutil.rmtree(cache, ignore_errors=True)
  coordinator = f'127.0.0.1:{_free_port()}'
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX_', 'XLA_'))}
  env.update(PYTHONPATH=tree, JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), '--phase', d, cache,
                             str(r), coordinator], cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for r in range(2)]
  outs = [p.communicate(timeout=3600)[0] for p in procs]
  for p, o in zip(procs, outs):
    if p.returncode:
      raise RuntimeError(f'a process of {tree} failed:\n{o[-3000:]}')
  return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def _machine() -> str:
  import psutil  # pylint: disable=g-import-not-at-top
  return (f'{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, '
          f'{psutil.virtual_memory().total / 2 ** 30:.0f} GiB RAM, Python '
          f'{platform.python_version()}')


def report(cmd: str, gen: dict, runs: dict, loads: tuple, warning: str | None) -> str:
  mib = lambda b: f'{b / 2 ** 20:.1f}'
  lines = [SECTION, '',
           f'Written by `benchmarks/prepare_hosts.py` (its docstring says what is counted); '
           'rerun the command to refresh this section.', '',
           f'- command: `{cmd}`',
           f'- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC',
           f'- machine: {_machine()}',
           f'- load average (1, 5, 15 min) before / after: {loads[0]} / {loads[1]}',
           *([f'- {warning}'] if warning else []),
           f'- data: {gen["rows"]:,} SFT conversations in {SHARDS} shards of '
           f'{min(gen["shard_rows"]):,} to {max(gen["shard_rows"]):,} rows '
           f'({mib(sum(gen["shard_bytes"]))} MiB on disk, the largest shard '
           f'{mib(max(gen["shard_bytes"]))} MiB), every other small shard gzipped; two JAX '
           'processes (gloo on CPU) sharing one empty cache directory', '',
           '| commit | process | rows tokenized | MiB read from the shards | MiB read from '
           'plain copies | CPU s | wall s | cache digest |',
           '|---|---:|---:|---:|---:|---:|---:|---|']
  for label, (commit, procs) in runs.items():
    for p in procs:
      lines.append(f'| {label} ({commit}) | {p["rank"]} | {p["tokenized"]:,} | '
                   f'{mib(p["shards"])} | {mib(p["plain"])} | {p["cpu_s"]} | {p["wall_s"]} | '
                   f'`{p["digest"]}` |')
  (bc, before), (ac, after) = runs['before'], runs['after']
  tok = lambda ps: sum(p['tokenized'] for p in ps)
  read = lambda ps: sum(p['shards'] + p['plain'] for p in ps)
  lines += ['', f'Rows tokenized, both processes together: {tok(before):,} before, '
            f'{tok(after):,} after ({tok(after) / tok(before):.2f}x); per process at most '
            f'{max(p["tokenized"] for p in before):,} before, '
            f'{max(p["tokenized"] for p in after):,} after. Bytes read from the dataset (shards '
            f'and plain copies), both together: {mib(read(before))} MiB before, '
            f'{mib(read(after))} MiB after ({read(after) / read(before):.2f}x).',
            '', 'Every process read back the same items from the cache, before and after: ' +
            ('yes.' if len({p['digest'] for p in before + after}) == 1 else 'NO.'),
            '', 'The two processes share this machine\'s cores and disk with each other and '
            'with other work (see the load average), so the seconds are not what separate '
            'hosts would take; the rows tokenized and bytes read are what carries over.', '']
  return '\n'.join(lines)


def write_section(out: str, section: str) -> None:
  """Replaces (or appends) SECTION in the page `out`, leaving the rest as it is."""
  p = pathlib.Path(out)
  text = p.read_text()
  if SECTION in text:
    head, rest = text.split(SECTION, 1)
    tail = rest[rest.index('\n## '):] if '\n## ' in rest else ''
    text = head + section.rstrip('\n') + '\n' + tail
  else:
    text = text.rstrip('\n') + '\n\n' + section
  p.write_text(text)


def main(argv: list[str]) -> None:
  import argparse  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--before', required=True, help='the commit before the change')
  ap.add_argument('--after', default='HEAD', help='the commit after it')
  ap.add_argument('--rows', type=int, default=32768, help='SFT conversations to generate')
  ap.add_argument('--dir', default='/tmp/cascade-prepare-hosts', help='data and caches')
  ap.add_argument('--out', default='docs/data.md', help='the page whose section is replaced')
  args = ap.parse_args(argv)
  root = str(pathlib.Path(__file__).resolve().parents[1])      # the git checkout
  loads = [tuple(round(x, 2) for x in os.getloadavg())]
  shutil.rmtree(args.dir, ignore_errors=True)
  gen = generate(args.dir, args.rows)
  runs = {}
  for label, rev in (('before', args.before), ('after', args.after)):
    tree, commit = _tree(rev, root)
    try:
      runs[label] = (commit, across(args.dir, tree))
    finally:
      shutil.rmtree(tree, ignore_errors=True)
    print(label, commit, json.dumps(runs[label][1]), flush=True)
  loads.append(tuple(round(x, 2) for x in os.getloadavg()))
  cmd = ' '.join(['.venv/bin/python -m benchmarks.prepare_hosts'] + argv)
  from benchmarks import host  # pylint: disable=g-import-not-at-top
  section = report(cmd, gen, runs, loads, host.load_warning(loads[0], loads[1]))
  write_section(args.out, section)         # relative to where the command runs
  print(section)
  host.print_load_warning(loads[0])
  print(json.dumps({'data': gen, 'runs': runs}))


if __name__ == '__main__':
  if len(sys.argv) > 1 and sys.argv[1] == '--phase':
    print(json.dumps(phase(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])))
  else:
    if __package__ in (None, ''):
      sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
