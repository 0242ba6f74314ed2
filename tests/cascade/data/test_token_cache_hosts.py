"""Preparing the tokenize-once cache on several processes: each tokenizes only its share of the
positions and writes its own parts, the result is the single process's cache byte for byte, and
a preparation that stopped part-way is never read (it is resumed: tests/cascade/
test_token_cache_resume.py).

The hosts are threads sharing an in-memory exchange (tests/cascade/conftest.py `on_hosts`).
"""

import collections
import dataclasses
import json
import os
import threading

import numpy as np
import pytest

from cascade import config as config_lib
from cascade.data import readers
from cascade.data import stage_data
from cascade.data import token_cache

SIZES = (23, 3, 5, 2)          # rows per source shard: uneven; 33 rows
ROWS = 4                       # positions per cache part in these tests: 9 parts


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch, tmp_path):
  monkeypatch.setattr(token_cache, 'ROWS_PER_SHARD', ROWS)
  monkeypatch.setenv('CASCADE_DATA_CACHE', str(tmp_path / 'local_cache'))


def sft_row(i):
  return {'id': f'r{i}', 'domain': 'a', 'messages': [{'role': 'user', 'content': f'Q{i}?'}],
          'response': f'A{i}.' + ' so' * (i % 5)}


def write_shards(d, sizes=SIZES):
  d.mkdir(parents=True, exist_ok=True)
  n = 0
  for s, k in enumerate(sizes):
    (d / f's{s}.jsonl').write_text(''.join(json.dumps(sft_row(n + j)) + '\n' for j in range(k)))
    n += k
  return str(d / 's*.jsonl'), n


def counting_tokenizer(base):
  """A tokenizer class that counts its `encode` calls per thread (a simulated host)."""

  class Counting(base):
    calls = collections.Counter()

    def encode(self, text):
      Counting.calls[threading.current_thread().name] += 1
      return super().encode(text)
  return Counting


class Stages(stage_data.StageData):
  """StageData without evaluation sets (the toy plan's point at no files)."""

  def _prompts(self, *a):
    return []


def plan_over(fakes, pattern):
  plan = fakes.toy_config([dict(fakes.SFT_STAGE, max_len=96)])
  return dataclasses.replace(plan, datasets={**plan.datasets, 'sft': config_lib.Dataset(
      name='sft', format='sft', record_type='sft', path=pattern)})


@pytest.fixture
def only_sft(monkeypatch):
  """Reads the SFT set only: the toy plan's other datasets are empty."""
  real = stage_data.readers.open_dataset
  monkeypatch.setattr(stage_data.readers, 'load', lambda spec, **kw: [])
  monkeypatch.setattr(stage_data.readers, 'open_dataset', lambda spec, *a, **k: (
      real(spec, *a, **k) if spec.name == 'sft' else []))


def prepared(plan, tok, cache, hosts=None):
  sd = Stages(plan, tok, None, cache_dir=cache, hosts=hosts)
  sd.load()
  return sd.stage_records(plan.stages[0])


def contents(cache):
  """{stage dir/file: bytes} of a cache (the shard indexes aside), and its manifests without the
  timings."""
  files, manifests = {}, {}
  for stage in sorted(os.listdir(cache)):
    if stage == 'shards':
      continue
    for f in sorted(os.listdir(os.path.join(cache, stage))):
      raw = open(os.path.join(cache, stage, f), 'rb').read()
      if f == 'manifest.json':
        man = json.loads(raw)
        manifests[stage] = {k: v for k, v in man.items() if k not in ('seconds', 'rows_per_s')}
      else:
        files[f'{stage}/{f}'] = raw
  return files, manifests


def test_each_host_tokenizes_only_its_share_and_the_cache_is_the_single_process_one(
    tmp_path, fakes, only_sft):
  pattern, n = write_shards(tmp_path / 'data')
  plan = plan_over(fakes, pattern)
  st = plan.stages[0]
  tok_cls = counting_tokenizer(fakes.CharTokenizer)
  single = prepared(plan, tok_cls(), str(tmp_path / 'one'))
  assert len(single.source) == n
  # The reference: what tokenizing each position costs, counted on its own.
  tok_cls.calls.clear()
  cost = []
  for i in range(n):
    before = tok_cls.calls['MainThread']
    st.tokenize(tok_cls())(sft_row(i))
    cost.append(tok_cls.calls['MainThread'] - before)
  tok_cls.calls.clear()

  def host(hosts):
    threading.current_thread().name = f'h{hosts.index}'
    got = prepared(plan, tok_cls(), str(tmp_path / 'two'), hosts)
    return [got.source[i] for i in range(n)]

  out = fakes.on_hosts(2, host)
  assert not isinstance(out[0], Exception), out[0]
  assert not isinstance(out[1], Exception), out[1]
  # 9 parts of 4 positions: host 0 makes parts 0-3 (rows 0-15), host 1 parts 4-8 (16-32);
  # each also tokenizes the key's probe (the first 8 records).
  probe = sum(cost[:token_cache._PROBE])  # pylint: disable=protected-access
  assert tok_cls.calls['h0'] == probe + sum(cost[:16]), tok_cls.calls
  assert tok_cls.calls['h1'] == probe + sum(cost[16:]), tok_cls.calls
  assert sum(cost[16:]) > 0 and sum(cost[:16]) > 0
  # The same files, byte for byte, and the same manifest but for its timings.
  one, two = contents(str(tmp_path / 'one')), contents(str(tmp_path / 'two'))
  assert len(one[0]) == 9 and one == two
  # Every host draws the single process's items.
  want = [[a.tolist() for a in single.source[i]] for i in range(n)]
  for h in range(2):
    assert [[a.tolist() for a in item] for item in out[h]] == want
  # Found again by fresh hosts: nothing is tokenized but the key's probe.
  tok_cls.calls.clear()
  out = fakes.on_hosts(2, host)
  assert not isinstance(out[0], Exception), out[0]
  assert tok_cls.calls == {'h0': probe, 'h1': probe}


class Rows:
  """A source of ints by position; `fail(i)` may raise when position i is read."""

  def __init__(self, n, fail=lambda i: None):
    self.n, self.fail = n, fail

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    self.fail(i)
    if i % 11 == 10:
      raise readers.DataError(f'rows:{i + 1}: malformed')
    return i


def make_item(i, rec):
  """An item per position: tokens [i, i+1, ...] (length i % 4 + 1), none for multiples of 3."""
  return None if rec % 3 == 0 else (list(range(i, i + i % 4 + 1)), [1] * (i % 4 + 1))


@pytest.mark.parametrize('tokenizes', [True, False])
def test_split_preparation_writes_the_single_process_files(tmp_path, fakes, tokenizes):
  """Items shards and keep bits alike; malformed positions are counted once over the hosts."""
  n = 37
  make = make_item if tokenizes else (lambda i, rec: None if rec % 3 == 0 else rec)
  one = token_cache.prepare(str(tmp_path / 'one'), Rows(n), make, tokenizes, 'test',
                            log=lambda s: None)
  out = fakes.on_hosts(3, lambda hosts: token_cache.prepare(
      str(tmp_path / 'three'), Rows(n), make, tokenizes, 'test', log=lambda s: None,
      hosts=hosts))
  timing = ('seconds', 'rows_per_s')
  for h in range(3):
    assert not isinstance(out[h], Exception), out[h]
    assert {k: v for k, v in out[h].items() if k not in timing} == {
        k: v for k, v in one.items() if k not in timing}
  kept = [i for i in range(n) if i % 11 != 10 and i % 3]
  assert one['kept'] == len(kept) and one['malformed'] == 3 and one['rows'] == n
  names = sorted(os.listdir(tmp_path / 'one'))
  assert names == sorted(os.listdir(tmp_path / 'three'))
  for f in names:
    if f != 'manifest.json':
      assert (tmp_path / 'one' / f).read_bytes() == (tmp_path / 'three' / f).read_bytes(), f
  if tokenizes:
    assert len(names) == 11              # 10 parts of 4 positions, and the manifest
    items = token_cache.Items(str(tmp_path / 'three'), out[2])
    for i in range(n):
      want = make_item(i, i) if i in kept else None
      got = items[i]
      assert (got is None) if want is None else [a.tolist() for a in got] == list(want), i
  else:
    bits = np.load(tmp_path / 'three' / 'keep.npy')
    assert np.flatnonzero(bits).tolist() == kept


def test_a_host_that_fails_part_way_stops_every_host_and_the_cache_is_redone(tmp_path, fakes):
  """Host 1 fails in its share (a disk error): both hosts raise it, no manifest is written, host
  0's finished parts are not taken for a cache, and the next preparation completes it, making
  only the parts no preparation finished (and a torn one)."""
  n, ref = 37, str(tmp_path / 'ref')
  token_cache.prepare(ref, Rows(n), make_item, True, 'test', log=lambda s: None)
  cache = str(tmp_path / 'cache')
  k = token_cache.key(_Stage(), None, [], Rows(n), make_item)
  d = token_cache.directory(cache, _Stage(), k)

  def failing(hosts):
    def fail(i):
      if hosts.index == 1 and i == 30:
        raise OSError(28, 'No space left on device')
    return token_cache.prepare(d, Rows(n, fail), make_item, True, 'test', log=lambda s: None,
                               hosts=hosts, key=k)

  out = fakes.on_hosts(2, failing)
  for h in range(2):
    assert isinstance(out[h], readers.DataError), out[h]
    assert str(out[h]) == (f'test: preparing {d} failed on process 1 (OSError: [Errno 28] No '
                           'space left on device)')
  # Not a storage or data error (a bug, say): raised as it is where it happened, named on the
  # other host, and neither waits for the other. Host 0's parts 0-4 and host 1's parts 5 and 6
  # are finished: reused; host 1 makes part 7 (rows 28-31) and fails in part 8.
  out = fakes.on_hosts(2, lambda hosts: token_cache.prepare(
      d, Rows(n, lambda i: hosts.index == 1 and i == 33 and 1 / 0), make_item, True, 'test',
      log=lambda s: None, hosts=hosts, key=k))
  assert isinstance(out[1], ZeroDivisionError), out[1]
  assert str(out[0]) == (f'test: preparing {d} failed on process 1 (ZeroDivisionError: '
                         'division by zero)')
  left = sorted(os.listdir(d))
  assert 'manifest.json' not in left and 'items-00000.arrayrecord' in left   # host 0's parts
  assert not [f for f in left if f.endswith('.tmp')]                          # no half part
  # A part a crash left half-written under its final name (a store without atomic writes).
  with open(os.path.join(d, 'items-00007.arrayrecord'), 'wb') as f:
    f.write(b'half a part')
  calls = collections.Counter()

  def counted(i, rec):
    calls[threading.current_thread().name] += 1
    return make_item(i, rec)

  assert token_cache._manifest(d) is None  # pylint: disable=protected-access
  logs = collections.defaultdict(list)

  def host(hosts):
    threading.current_thread().name = f'r{hosts.index}'
    got = token_cache.stream(cache, _Stage(), None, [], Rows(n), counted, True, '', hosts,
                             log=logs[hosts.index].append)
    return [None if got.source[i] is None else [a.tolist() for a in got.source[i]]
            for i in range(n)]

  out = fakes.on_hosts(2, host)
  # `stream` finds no manifest, so both hosts prepare again: each the key's probe of 8; host 0
  # nothing more (its parts are finished), host 1 the torn part 7 and parts 8-9 (rows 28-36,
  # one malformed).
  assert not isinstance(out[0], Exception), out[0]
  assert calls == {'r0': 8, 'r1': 9 - 1 + 8}, calls
  torn = os.path.join(d, 'items-00007.arrayrecord')
  assert any(s.startswith(f'WARNING: {_Stage().where}: {torn} is torn or changed (11 bytes')
             for s in logs[1]), logs[1]
  assert token_cache._manifest(d)['kept'] == 22  # pylint: disable=protected-access
  assert 'parts' not in os.listdir(d)                          # the commit removed the records
  for f in sorted(os.listdir(ref)):
    if f != 'manifest.json':
      assert (tmp_path / 'ref' / f).read_bytes() == open(os.path.join(d, f), 'rb').read(), f
  want = [list(make_item(i, i)) if i % 11 != 10 and i % 3 else None for i in range(n)]
  assert out[0] == out[1] == want


def test_a_commit_that_fails_leaves_no_manifest_and_every_host_raises(tmp_path, fakes,
                                                                      monkeypatch):
  n, d = 21, str(tmp_path / 'cache')
  real = token_cache.paths.write_json

  def write_json(p, obj):
    if str(p).endswith('manifest.json'):
      raise OSError(5, 'Input/output error')
    real(p, obj)
  monkeypatch.setattr(token_cache.paths, 'write_json', write_json)
  out = fakes.on_hosts(2, lambda hosts: token_cache.prepare(
      d, Rows(n), make_item, True, 'test', log=lambda s: None, hosts=hosts))
  for h in range(2):
    assert isinstance(out[h], readers.DataError), out[h]
    assert str(out[h]).startswith(f'test: committing {d} failed on process 0 (OSError: '
                                  '[Errno 5] Input/output')
  assert token_cache._manifest(d) is None  # pylint: disable=protected-access
  assert len([f for f in os.listdir(d) if f.startswith('items-')]) == 6    # all parts, no commit


def test_hosts_with_separate_cache_disks_each_end_with_a_whole_cache(tmp_path, fakes,
                                                                     monkeypatch):
  """A cache directory that is not shared (each host its own disk): correct, not cheaper."""
  n = 37
  ref = str(tmp_path / 'ref')
  token_cache.prepare(ref, Rows(n), make_item, True, 'test', log=lambda s: None)
  disks = {f'd{h}': tmp_path / f'disk{h}' for h in range(2)}

  def own(p):            # '/shared/...' names each host's own disk
    p = str(p)
    if not p.startswith('/shared'):
      return p
    return p.replace('/shared', str(disks[threading.current_thread().name]))
  real_makedirs, real_exists = token_cache.paths.makedirs, token_cache.paths.exists
  real_write, real_read = token_cache.paths.write_json, token_cache.paths.read_text
  real_listdir, real_rmtree = token_cache.paths.listdir, token_cache.paths.rmtree
  monkeypatch.setattr(token_cache.paths, 'listdir', lambda p: real_listdir(own(p)))
  monkeypatch.setattr(token_cache.paths, 'rmtree', lambda p: real_rmtree(own(p)))
  monkeypatch.setattr(token_cache.paths, 'makedirs', lambda p: real_makedirs(own(p)))
  monkeypatch.setattr(token_cache.paths, 'exists', lambda p: real_exists(own(p)))
  monkeypatch.setattr(token_cache.paths, 'read_text', lambda p: real_read(own(p)))
  monkeypatch.setattr(token_cache.paths, 'write_json', lambda p, o: real_write(own(p), o))
  real_replace = os.replace
  monkeypatch.setattr(token_cache.os, 'replace', lambda a, b: real_replace(a, own(b)))
  real_mkstemp = token_cache.tempfile.mkstemp
  monkeypatch.setattr(token_cache.tempfile, 'mkstemp', lambda **kw: real_mkstemp(
      **{**kw, 'dir': own(kw['dir'])}))
  logs = collections.defaultdict(list)

  def host(hosts):
    threading.current_thread().name = f'd{hosts.index}'
    return token_cache.prepare('/shared/cache', Rows(n), make_item, True, 'test',
                               log=logs[hosts.index].append, hosts=hosts)

  out = fakes.on_hosts(2, host)
  for h in range(2):
    assert not isinstance(out[h], Exception), out[h]
    mine = disks[f'd{h}'] / 'cache'
    assert sorted(os.listdir(mine)) == sorted(os.listdir(ref))
    for f in os.listdir(ref):
      if f != 'manifest.json':
        assert (mine / f).read_bytes() == open(os.path.join(ref, f), 'rb').read()
  for h in range(2):                  # each made the 5 parts the other wrote on its own disk
    assert any(f'process {h} does not see 5 of the 10 parts' in s for s in logs[h]), logs[h]


@dataclasses.dataclass(frozen=True)
class _Stage:
  """The fields of a stage config the cache's key and log lines read."""
  name: str = 'toy'
  kind: str = 'sft'
  where: str = "stages[0] 'toy'"
