"""Opening a sharded dataset across processes: each shard is streamed (indexed, decompressed) by
one process only, the others read its rows through the shared cache, and every process sees
the single-process global order, batches and resume.

The default tier simulates the hosts with threads sharing an in-memory exchange
(tests/cascade/conftest.py `on_hosts`); the heavy test runs two JAX processes (gloo on
CPU, tests/cascade/data/shards_hosts_worker.py).
"""

import collections
import gzip
import json
import os
import re
import socket
import subprocess
import sys
import threading
import types

import pytest

from cascade.data import readers
from cascade.data import shards
from foundation import paths

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
WORKER = os.path.join(REPO, 'tests', 'cascade', 'data', 'shards_hosts_worker.py')


def write_shards(d, sizes=(7, 5, 9, 4, 6)):
  """Shards s0..s4 (.jsonl and .jsonl.gz alternating) of `sizes` rows; row k = {'k': k, ...}."""
  d.mkdir(parents=True, exist_ok=True)
  k = 0
  for j, n in enumerate(sizes):
    lines = b''.join(json.dumps({'k': k + i, 'text': f'row {k + i} ' + 'y' * ((k + i) % 5)})
                     .encode() + b'\n' for i in range(n))
    k += n
    if j % 2:
      (d / f's{j}.jsonl.gz').write_bytes(gzip.compress(lines))
    else:
      (d / f's{j}.jsonl').write_bytes(lines)
  return str(d / 's*'), k


class Streamed:
  """Counts the bytes each thread streams, per file, through `shards._chunks` (every index
  build and decompression goes through it; reads of single rows do not)."""

  def __init__(self, monkeypatch):
    self.by = collections.defaultdict(collections.Counter)
    real = shards._chunks

    def chunks(f):
      for b in real(f):
        name = getattr(f, 'name', None) or f.path          # gcsfs files have a path
        self.by[threading.current_thread().name][os.path.basename(name)] += len(b)
        yield b
    monkeypatch.setattr(shards, '_chunks', chunks)


def owned(files, h, count=2):
  """The shards host h of `count` opens: dealt by file size (`shards.deal`)."""
  sizes = [paths.path(f).stat().length for f in files]       # local or gs://
  return [files[j] for j in shards.deal(sizes, count)[h]]


def batches(loader, n):
  return [[row['k'] for _, row in loader.next()] for _ in range(n)]


def test_each_shard_is_streamed_by_one_host_and_every_host_gets_the_single_process_order(
    tmp_path, monkeypatch, fakes):
  pattern, total = write_shards(tmp_path / 'data')
  files = shards.expand(pattern)
  single = shards.open_source(pattern, str(tmp_path / 'single'))
  want = batches(readers.Loader(readers.Stream(single), seed=3, batch_size=4), 8)
  streamed = Streamed(monkeypatch)
  shared = str(tmp_path / 'shared')

  def host(hosts, tag='cold'):
    threading.current_thread().name = f'{tag}{hosts.index}'
    local = str(tmp_path / f'{tag}-local{hosts.index}')
    src = shards.open_source(pattern, local, shared, hosts)
    assert len(src) == total
    got = batches(readers.Loader(readers.Stream(src, hosts=hosts), seed=3, batch_size=4), 8)
    resumed = readers.Loader(readers.Stream(src, hosts=hosts), seed=3, batch_size=4)
    resumed.set_state({'position': 13})          # mid-epoch (31 rows) and mid-batch
    tail = [[row['k'] for _, row in resumed.next()] for _ in range(3)]
    rows = [src[i] for i in range(total)]
    return got, tail, rows, sorted(os.listdir(os.path.join(local, 'index')))

  out = fakes.on_hosts(2, host)
  first13 = [k for b in want for k in b][:13]
  for h in range(2):
    assert not isinstance(out[h], Exception), out[h]
    got, tail, rows, local_index = out[h]
    assert got == want
    flat = [k for b in want for k in b]
    assert first13 == flat[:13] and tail == [flat[13:17], flat[17:21], flat[21:25]]
    assert rows == [single[i] for i in range(total)]             # `where` (file:line) too
    assert len(local_index) == len(files)      # every shard's index, copied or built, local
  # Each shard was streamed by exactly one host, its owner by size, and nothing twice.
  assert sorted(owned(files, 0) + owned(files, 1)) == files and owned(files, 1)
  for h in range(2):
    names = set(streamed.by[f'cold{h}'])
    originals = {n for n in names if n.startswith('s')}
    assert originals == {os.path.basename(f) for f in owned(files, h)}, (h, names)
    # A decompressed copy is indexed by the host that made it: one per gzip shard it owns.
    assert len(names - originals) == sum(f.endswith('.gz') for f in owned(files, h))
  mine = lambda h: sum(os.path.getsize(f) for f in owned(files, h) if f.endswith('.jsonl'))
  for h in range(2):                  # a plain shard is streamed once, whole, by its owner
    for f in owned(files, h):
      if f.endswith('.jsonl'):
        assert streamed.by[f'cold{h}'][os.path.basename(f)] == os.path.getsize(f)
  assert mine(0) + mine(1) > 0
  # Fresh hosts (empty local caches) with the shared cache warm stream nothing at all.
  out = fakes.on_hosts(2, lambda hosts: host(hosts, 'warm'))
  assert all(out[h][0] == want for h in range(2))
  assert not streamed.by['warm0'] and not streamed.by['warm1']


def test_shards_are_dealt_by_size_near_the_best_balance():
  """Largest first to the least-loaded host: every shard once, no host above the least-loaded
  one plus the largest shard, and within the greedy rule's bound (4/3 - 1/(3P)) of the best
  split, found by trying every assignment."""
  import itertools  # pylint: disable=g-import-not-at-top
  import random  # pylint: disable=g-import-not-at-top
  rng = random.Random(0)
  for trial in range(60):
    count = 2 + trial % 2
    sizes = [rng.choice([1, 3, 10, 100, 1000]) * rng.randint(1, 9) for _ in range(rng.randint(
        1, 8))]
    dealt = shards.deal(sizes, count)
    assert sorted(j for d in dealt for j in d) == list(range(len(sizes)))
    loads = [sum(sizes[j] for j in d) for d in dealt]
    assert max(loads) <= min(loads) + max(sizes), (sizes, dealt)
    best = min(max(sum(sizes[j] for j in range(len(sizes)) if a[j] == h) for h in range(count))
               for a in itertools.product(range(count), repeat=len(sizes)))
    assert max(loads) * 3 * count <= best * (4 * count - 1), (sizes, dealt, best)
  # One large shard and many small ones: the large one is a host's whole share, where dealing
  # by index (shard j to host j % 4) would give that host 7 small ones on top.
  sizes = [1 << 30] + [1 << 20] * 30
  dealt = shards.deal(sizes, 4)
  assert dealt[0] == [0] and sorted(len(d) for d in dealt[1:]) == [10, 10, 10]
  by_index = max(sum(sizes[j] for j in range(h, 31, 4)) for h in range(4))
  assert by_index - sizes[0] == 7 << 20
  # Ties (equal sizes, empty files) go round by count and index, not all to host 0.
  assert shards.deal([0] * 5, 2) == [[0, 2, 4], [1, 3]]
  assert shards.deal([5, 5, 5, 5], 3) == [[0, 3], [1], [2]]


def test_uneven_shards_are_streamed_by_size_and_both_hosts_deal_alike(tmp_path, monkeypatch,
                                                                      fakes):
  """A 200-row shard among six small ones: its host streams it alone, the other host the rest,
  and hosts that see different sizes stop with one error instead of dealing apart."""
  sizes = (4, 200, 3, 5, 2, 6, 4)
  pattern, total = write_shards(tmp_path / 'data', sizes)
  files = shards.expand(pattern)
  single = shards.open_source(pattern, str(tmp_path / 'single'))
  streamed = Streamed(monkeypatch)

  def host(hosts):
    threading.current_thread().name = f'u{hosts.index}'
    src = shards.open_source(pattern, str(tmp_path / f'local{hosts.index}'),
                             str(tmp_path / 'shared'), hosts)
    return [src[i] for i in range(total)]

  out = fakes.on_hosts(2, host)
  assert out[0] == out[1] == [single[i] for i in range(total)]
  opened = [{n for n in streamed.by[f'u{h}'] if n.startswith('s')} for h in range(2)]
  assert opened == [{'s1.jsonl.gz'}, {f's{j}.jsonl' + '.gz' * (j % 2) for j in (0, 2, 3, 4, 5,
                                                                                 6)}], opened
  raw = lambda h: sum(os.path.getsize(f) for f in files if os.path.basename(f) in opened[h])
  assert raw(0) > raw(1) > 0          # the big shard's host holds the most bytes, alone
  # Hosts that list different sizes (a shard rewritten meanwhile) would deal apart.
  real = shards._size  # pylint: disable=protected-access
  monkeypatch.setattr(shards, '_size', lambda p: real(p) + (
      threading.current_thread().name == 'u1' and p.endswith('s6.jsonl')))
  out = fakes.on_hosts(2, host)
  for h in range(2):
    assert isinstance(out[h], shards.DataError), out[h]
    assert str(out[h]) == (f'7 shards from {files[0]}: the processes see different file sizes '
                           '(a shard changed while the run opened it, or the hosts see '
                           'different files), so they would deal the shards differently')


def test_the_runs_stage_data_shares_the_opening_through_its_data_cache(tmp_path, monkeypatch,
                                                                       fakes):
  """StageData hands its hosts and `<data_cache>/shards` to the training sets it opens: with a
  gs://-like cache (not the hosts' local one), each shard is streamed by one host only."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade.data import stage_data  # pylint: disable=g-import-not-at-top
  lines = lambda lo, hi: ''.join(json.dumps({'id': f'r{i}', 'domain': 'a', 'messages': [
      {'role': 'user', 'content': f'Q{i}?'}], 'response': f'A{i}.'}) + '\n' for i in range(lo, hi))
  d = tmp_path / 'sft'
  d.mkdir()
  for j in range(4):
    (d / f's{j}.jsonl').write_text(lines(5 * j, 5 * j + 5))
  plan = fakes.toy_config([dict(fakes.SFT_STAGE, max_len=96)])
  plan = dataclasses.replace(plan, datasets={**plan.datasets, 'sft': config_lib.Dataset(
      name='sft', format='sft', record_type='sft', path=str(d / 's*.jsonl'))})
  monkeypatch.setattr(stage_data.readers, 'load', lambda spec, **kw: [])
  real = stage_data.readers.open_dataset
  monkeypatch.setattr(stage_data.readers, 'open_dataset', lambda spec, *a, **k: (
      real(spec, *a, **k) if spec.name == 'sft' else []))
  # The cache stands in for a gs:// one: StageData keeps no local index there.
  monkeypatch.setattr(stage_data, 'paths', types.SimpleNamespace(
      join=stage_data.paths.join, is_remote=lambda p: str(p).startswith(str(tmp_path))))
  streamed = Streamed(monkeypatch)

  class Opened(stage_data.StageData):
    def _prompts(self, *a):
      return []

    def stage_records(self, stage):                  # the tokenized cache is not this test's
      return None

  # Each simulated host's own local cache. Not through $CASCADE_DATA_CACHE: the hosts are
  # threads of one process sharing its environment, so a host could read the other's setting
  # (that race failed this test under load).
  local = {f'sd{h}': str(tmp_path / f'local{h}') for h in range(2)}
  monkeypatch.setattr(shards, 'default_cache_dir',
                      lambda: local[threading.current_thread().name])

  def host(hosts):
    threading.current_thread().name = f'sd{hosts.index}'
    sd = Opened(plan, fakes.CharTokenizer(), None, cache_dir=str(tmp_path / 'bucket'),
                hosts=hosts)
    sd.load()
    src = sd._sources['sft']  # pylint: disable=protected-access
    return [src[i]['id'] for i in range(len(src))]

  out = fakes.on_hosts(2, host)
  assert out[0] == out[1] == [f'r{i}' for i in range(20)], out
  assert set(streamed.by['sd0']) == {'s0.jsonl', 's2.jsonl'}, streamed.by
  assert set(streamed.by['sd1']) == {'s1.jsonl', 's3.jsonl'}, streamed.by
  assert len(os.listdir(tmp_path / 'bucket' / 'shards' / 'index')) == 4


def test_a_corrupt_shard_stops_every_host_with_its_byte_offset(tmp_path, fakes):
  pattern, _ = write_shards(tmp_path / 'data')
  raw = (tmp_path / 'data' / 's3.jsonl.gz').read_bytes()
  (tmp_path / 'data' / 's3.jsonl.gz').write_bytes(raw[:-9])        # host 1's shard
  out = fakes.on_hosts(2, lambda hosts: shards.open_source(
      pattern, str(tmp_path / f'l{hosts.index}'), str(tmp_path / 'shared'), hosts))
  for h in range(2):
    assert isinstance(out[h], shards.DataError), out[h]
    assert str(out[h]) == str(out[1 - h])
    assert f's3.jsonl.gz: truncated gzip data (the stream ends at byte offset {len(raw) - 9} ' \
        in str(out[h])


def test_a_host_that_cannot_write_its_cache_stops_every_host(tmp_path, fakes):
  """Any failure while a host opens its share reaches every host (none waits in the exchange)."""
  pattern, _ = write_shards(tmp_path / 'data')
  (tmp_path / 'l1').write_text('a file where host 1\'s cache directory should be')
  out = fakes.on_hosts(2, lambda hosts: shards.open_source(
      pattern, str(tmp_path / f'l{hosts.index}'), str(tmp_path / 'shared'), hosts))
  first = re.escape(owned(shards.expand(pattern), 1)[0])          # host 1's first shard
  for h in range(2):
    assert isinstance(out[h], shards.DataError), out[h]
    assert re.match(rf'{first}: cannot open it here \((FileExistsError|'
                    r'NotADirectoryError)', str(out[h])), out[h]


def test_without_a_shared_cache_a_host_indexes_what_it_reads_itself(tmp_path, fakes):
  """Separate hosts' disks and no shared cache: still the same rows, built where read."""
  pattern, total = write_shards(tmp_path / 'data')
  single = shards.open_source(pattern, str(tmp_path / 'single'))
  out = fakes.on_hosts(2, lambda hosts: [
      shards.open_source(pattern, str(tmp_path / f'l{hosts.index}'), None, hosts)[i]
      for i in range(total)])
  assert out[0] == out[1] == [single[i] for i in range(total)]
  # A shard that changes between the hosts' opening is named, not misread.
  src = fakes.on_hosts(2, lambda hosts: shards.open_source(
      pattern, str(tmp_path / f'm{hosts.index}'), None, hosts))[0]
  assert owned(shards.expand(pattern), 1)[-1].endswith('s4.jsonl')   # host 1's: 6 rows
  (tmp_path / 'data' / 's4.jsonl').write_bytes(b'{"k": 0}\n')
  with pytest.raises(shards.DataError, match=r's4\.jsonl: holds 1 rows here but 6 in the '
                                             'process that indexed it'):
    src[total - 1]  # pylint: disable=pointless-statement


@pytest.mark.heavy      # the emulator's start and round trips
def test_shards_and_the_shared_cache_on_gcs(gcs, tmp_path, monkeypatch, fakes):
  """Shards on gs:// and the shared cache on gs://: each shard is streamed by one host, the
  other reads its rows through the index and plain copy published to the bucket."""
  local, total = write_shards(tmp_path / 'data')
  root = gcs.root + '/shards'
  for f in shards.expand(local):
    paths.copy_file(f, paths.join(root, os.path.basename(f)))
  pattern = root + '/s*'
  files = shards.expand(pattern)
  single = shards.open_source(pattern, str(tmp_path / 'single'))
  want = batches(readers.Loader(readers.Stream(single), seed=3, batch_size=4), 8)
  streamed = Streamed(monkeypatch)
  shared = gcs.root + '/cache/shards'

  def host(hosts):
    threading.current_thread().name = f'h{hosts.index}'
    src = shards.open_source(pattern, str(tmp_path / f'local{hosts.index}'), shared, hosts)
    got = batches(readers.Loader(readers.Stream(src, hosts=hosts), seed=3, batch_size=4), 8)
    return got, [src[i] for i in range(total)]

  out = fakes.on_hosts(2, host)
  for h in range(2):
    assert not isinstance(out[h], Exception), out[h]
    assert out[h] == (want, [single[i] for i in range(total)])
    originals = {n for n in streamed.by[f'h{h}'] if n.startswith('s')}
    assert originals == {os.path.basename(f) for f in owned(files, h)}, streamed.by
  assert len(paths.listdir(shared + '/index')) == len(files)
  assert len(paths.listdir(shared + '/plain')) == sum(f.endswith('.gz') for f in files)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.heavy
@pytest.mark.multiprocess
def test_two_jax_processes_each_stream_their_own_shards_and_draw_the_single_process_batches(
    tmp_path):
  pattern, total = write_shards(tmp_path / 'data')
  files = shards.expand(pattern)
  single = shards.open_source(pattern, str(tmp_path / 'single'))
  flat = [k for b in batches(readers.Loader(readers.Stream(single), seed=3, batch_size=4), 11)
          for k in b]
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX_', 'XLA_'))}
  env['PYTHONPATH'] = REPO
  coordinator = f'127.0.0.1:{_free_port()}'
  procs = [subprocess.Popen([sys.executable, WORKER, coordinator, str(i), pattern,
                             str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=120)[0])      # a hang fails here, not forever
  finally:
    for p in procs:
      p.kill()
  assert all(p.returncode == 0 for p in procs), '\n'.join(logs)[-4000:]
  out = [json.loads((tmp_path / f'{i}.json').read_text()) for i in range(2)]
  for h in range(2):
    assert out[h]['batches'] == [flat[i:i + 4] for i in range(0, 32, 4)]
    assert out[h]['resumed'] == [flat[13:17], flat[17:21], flat[21:25]]
    assert out[h]['where'] == [single[i][0] for i in range(total)]
    originals = {n for n in out[h]['streamed'] if n.startswith('s')}
    assert originals == {os.path.basename(f) for f in owned(files, h)}, out[h]['streamed']
    for f in owned(files, h):
      if f.endswith('.jsonl'):                         # streamed once, whole
        assert out[h]['streamed'][os.path.basename(f)] == os.path.getsize(f)
    assert not out[h]['streamed_on_restart']
