"""A preparation of the tokenize-once cache that stopped part-way is resumed: the next one (on
any number of processes) reuses every part the stopped one finished and made for the same key,
makes only the others, and ends with the cache an uninterrupted preparation writes, byte for
byte. A part of another key, a torn or changed part, and an unreadable part record are made
again.

The stop is a tokenizer (or source) that raises after a given number of calls; the work done is
counted in tokenizer (or `make`) calls. The hosts are threads sharing an in-memory exchange
(tests/cascade/conftest.py `on_hosts`); the helpers are tests/cascade/data/test_token_cache_hosts.py's.
"""

import collections
import os
import threading

import pytest

from cascade.data import readers
from cascade.data import token_cache
from tests.cascade.data import test_token_cache_hosts as harness

ROWS = harness.ROWS            # positions per cache part: 33 rows in 9 parts
only_sft = harness.only_sft    # the fixture: the toy plan reads its SFT set only


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch, tmp_path):
  monkeypatch.setattr(token_cache, 'ROWS_PER_SHARD', ROWS)
  monkeypatch.setenv('CASCADE_DATA_CACHE', str(tmp_path / 'local_cache'))


class Preempted(Exception):
  """The stop: what a preempted host's preparation ends with, as far as the cache can tell."""


def stopping_tokenizer(base):
  """A tokenizer class that counts its `encode` calls per thread (a simulated host) and raises
  Preempted on the call after `limit[thread]` (no limit: never)."""

  class Counting(base):
    calls = collections.Counter()
    limit = {}

    def encode(self, text):
      me = threading.current_thread().name
      if Counting.calls[me] >= Counting.limit.get(me, float('inf')):
        raise Preempted(f'{me} stopped after {Counting.calls[me]} calls')
      Counting.calls[me] += 1
      return super().encode(text)
  return Counting


def costs(plan, tok_cls, n):
  """The tokenizer calls each position costs, counted one by one (the reference)."""
  st, out = plan.stages[0], []
  tok_cls.calls.clear()
  for i in range(n):
    before = tok_cls.calls['MainThread']
    st.tokenize(tok_cls())(harness.sft_row(i))
    out.append(tok_cls.calls['MainThread'] - before)
  tok_cls.calls.clear()
  assert all(out)
  return out


def stopping_run(tmp_path, fakes):
  """(plan, rows, a stopping tokenizer class, each row's tokenizer calls, the key's probe
  calls) over shards written under tmp_path/data."""
  pattern, n = harness.write_shards(tmp_path / 'data')
  plan = harness.plan_over(fakes, pattern)
  tok_cls = stopping_tokenizer(fakes.CharTokenizer)
  cost = costs(plan, tok_cls, n)
  return plan, n, tok_cls, cost, sum(cost[:token_cache._PROBE])  # pylint: disable=protected-access


def drawn(stream, n):
  return [None if stream.source[i] is None else [a.tolist() for a in stream.source[i]]
          for i in range(n)]


def test_an_interrupted_preparation_makes_only_the_parts_it_had_not_finished(
    tmp_path, fakes, only_sft, capsys):
  """Stopped in part 5 of 9, the next preparation tokenizes parts 5-8 only (and the key's
  probe), and the cache is an uninterrupted preparation's, byte for byte."""
  plan, n, tok_cls, cost, probe = stopping_run(tmp_path, fakes)
  whole = drawn(harness.prepared(plan, tok_cls(), str(tmp_path / 'whole')), n)
  tok_cls.calls.clear()

  finished = 5                                   # parts 0-4: rows 0-19
  tok_cls.limit['MainThread'] = probe + sum(cost[:finished * ROWS])
  cache = str(tmp_path / 'cache')
  with pytest.raises(Preempted):
    harness.prepared(plan, tok_cls(), cache)
  [stage_dir] = [f for f in os.listdir(cache) if f != 'shards']
  left = sorted(os.listdir(os.path.join(cache, stage_dir)))
  assert left == [f'items-{k:05d}.arrayrecord' for k in range(finished)] + ['parts'], left
  capsys.readouterr()

  tok_cls.limit.clear()
  tok_cls.calls.clear()
  again = harness.prepared(plan, tok_cls(), cache)
  assert tok_cls.calls == {'MainThread': probe + sum(cost[finished * ROWS:])}, tok_cls.calls
  out = capsys.readouterr().out
  assert f'{finished} of the 9 parts were finished by an earlier preparation' in out, out
  assert f'{n - finished * ROWS} of them made now, the rest reused' in out, out
  assert harness.contents(cache) == harness.contents(str(tmp_path / 'whole'))
  assert 'parts' not in os.listdir(os.path.join(cache, stage_dir))   # the commit removed them
  assert drawn(again, n) == whole


def test_a_changed_tokenizer_reuses_no_part(tmp_path, fakes, only_sft):
  """Another tokenizer is another key, so another cache directory: every part is tokenized,
  and the stopped preparation's parts are left as they were."""
  plan, n, tok_cls, cost, probe = stopping_run(tmp_path, fakes)
  cache = str(tmp_path / 'cache')
  tok_cls.limit['MainThread'] = probe + sum(cost[:6 * ROWS])
  with pytest.raises(Preempted):
    harness.prepared(plan, tok_cls(), cache)
  [stopped] = [f for f in os.listdir(cache) if f != 'shards']
  tok_cls.limit.clear()
  tok_cls.calls.clear()

  class Shifted(tok_cls):
    def encode(self, text):
      return [(t + 1) % 256 for t in super().encode(text)]

  harness.prepared(plan, Shifted(), cache)
  assert tok_cls.calls == {'MainThread': probe + sum(cost)}, tok_cls.calls
  stages = sorted(f for f in os.listdir(cache) if f != 'shards')
  assert len(stages) == 2 and stopped in stages
  assert 'manifest.json' not in os.listdir(os.path.join(cache, stopped))


def test_a_part_recorded_under_another_key_or_rows_is_made_again(tmp_path, monkeypatch):
  """In one directory (prepare called directly): parts recorded under another key, or cut into
  other rows, are never reused."""
  n, d = 37, str(tmp_path / 'cache')
  calls = []

  def counted(i, rec):
    calls.append(i)
    return harness.make_item(i, rec)

  def stop_at(row):
    def fail(i):
      if i == row:
        raise Preempted(i)
    return fail

  with pytest.raises(Preempted):       # parts 0-5 (rows 0-23) finished under key 'a'
    token_cache.prepare(d, harness.Rows(n, stop_at(24)), counted, True, 'test',
                        log=lambda s: None, key='a')
  logs = []
  calls.clear()
  token_cache.prepare(d, harness.Rows(n), counted, True, 'test', log=logs.append, key='b')
  made = [i for i in range(n) if i % 11 != 10]          # every well-formed position
  assert calls == made
  record = token_cache._record_path(d, 0)  # pylint: disable=protected-access
  assert f'test: {record} records part 0 of another cache (key, rows or format differ): it is ' \
         'made again' in logs, logs

  ref = str(tmp_path / 'ref')
  token_cache.prepare(ref, harness.Rows(n), harness.make_item, True, 'test', log=lambda s: None,
                      key='b')
  d2 = str(tmp_path / 'cache2')
  with pytest.raises(Preempted):       # parts of 5 rows: 0-3 (rows 0-19) finished
    with monkeypatch.context() as m:
      m.setattr(token_cache, 'ROWS_PER_SHARD', 5)
      token_cache.prepare(d2, harness.Rows(n, stop_at(20)), counted, True, 'test',
                          log=lambda s: None, key='b')
  calls.clear()
  token_cache.prepare(d2, harness.Rows(n), counted, True, 'test', log=lambda s: None, key='b')
  assert calls == made                 # parts of 4 rows: no part's rows match a record's
  for f in os.listdir(ref):
    if f != 'manifest.json':
      assert open(os.path.join(ref, f), 'rb').read() == open(os.path.join(d2, f), 'rb').read()


@pytest.mark.parametrize('tokenizes', [True, False])
def test_a_torn_or_changed_part_and_an_unreadable_record_are_made_again(tmp_path, tokenizes):
  """After a stop in part 6 of 10: part 1's shard truncated, part 2's with one byte changed
  (same size), part 3's record garbled. The next preparation makes exactly parts 1-3 and 6-9,
  logs a line naming each, and writes the uninterrupted preparation's files. Keep-only stages
  (no shards) resume from their records' keep bits."""
  n, d, ref = 37, str(tmp_path / 'cache'), str(tmp_path / 'ref')
  make = harness.make_item if tokenizes else (lambda i, rec: None if rec % 3 == 0 else rec)
  want = token_cache.prepare(ref, harness.Rows(n), make, tokenizes, 'test', log=lambda s: None,
                             key='k')
  made = []

  def counted(i, rec):
    made.append(i)
    return make(i, rec)

  def stop(i):
    if i == 24:
      raise Preempted(i)
  with pytest.raises(Preempted):
    token_cache.prepare(d, harness.Rows(n, stop), counted, tokenizes, 'test',
                        log=lambda s: None, key='k')
  part = lambda k: os.path.join(d, f'items-{k:05d}.arrayrecord')
  record = lambda k: token_cache._record_path(d, k)  # pylint: disable=protected-access
  damaged = [3]
  if tokenizes:
    damaged = [1, 2, 3]
    raw = open(part(1), 'rb').read()
    open(part(1), 'wb').write(raw[:len(raw) // 2])
    raw = bytearray(open(part(2), 'rb').read())
    raw[-1] ^= 0xff
    open(part(2), 'wb').write(bytes(raw))
  open(record(3), 'w').write('{"version": 2, "key": "k", "par')

  made.clear()
  logs = []
  got = token_cache.prepare(d, harness.Rows(n), counted, tokenizes, 'test', log=logs.append,
                            key='k')
  rows = [i for k in damaged + [6, 7, 8, 9] for i in range(4 * k, min(4 * k + 4, n))]
  assert made == [i for i in rows if i % 11 != 10], made
  timing = ('seconds', 'rows_per_s')
  assert {k: v for k, v in got.items() if k not in timing} == {
      k: v for k, v in want.items() if k not in timing}
  assert sorted(os.listdir(d)) == sorted(os.listdir(ref))
  for f in os.listdir(ref):
    if f != 'manifest.json':
      assert open(os.path.join(ref, f), 'rb').read() == open(os.path.join(d, f), 'rb').read(), f
  if tokenizes:
    assert any(s.startswith(f'WARNING: test: {part(1)} is torn or changed (') for s in logs)
    assert any(s.startswith(f'WARNING: test: {part(2)} is torn or changed (') for s in logs)
  assert any(s.startswith(f'WARNING: test: the record {record(3)} of part 3 is unreadable (')
             for s in logs), logs
  assert f'test: {6 - len(damaged)} of the 10 parts were finished by an earlier preparation ' \
         f'in {d}: reused, not made again' in logs, logs


def test_hosts_resume_with_another_host_count(tmp_path, fakes, only_sft):
  """Three hosts stop (host 1 preempted in its second part); two hosts resume: host 0's share
  (parts 0-3) is all finished, host 1 (parts 4-8) makes parts 4 and 5 only. The cache is the
  single process's, byte for byte, and every host draws its items."""
  plan, n, tok_cls, cost, probe = stopping_run(tmp_path, fakes)
  single = drawn(harness.prepared(plan, tok_cls(), str(tmp_path / 'one')), n)
  cache = str(tmp_path / 'shared')

  def host(hosts):
    threading.current_thread().name = f'h{hosts.index}'
    return drawn(harness.prepared(plan, tok_cls(), cache, hosts), n)

  # 3 hosts: host 0 parts 0-2, host 1 parts 3-5 (stopped in part 4), host 2 parts 6-8.
  tok_cls.calls.clear()
  tok_cls.limit['h1'] = probe + sum(cost[12:16])
  out = fakes.on_hosts(3, host)
  assert isinstance(out[1], Preempted), out[1]
  for h in (0, 2):
    assert isinstance(out[h], readers.DataError), out[h]
    assert 'failed on process 1 (Preempted: h1 stopped after' in str(out[h]), out[h]
  assert tok_cls.calls == {'h0': probe + sum(cost[:12]), 'h1': probe + sum(cost[12:16]),
                           'h2': probe + sum(cost[24:])}, tok_cls.calls

  tok_cls.limit.clear()
  tok_cls.calls.clear()
  out = fakes.on_hosts(2, host)
  for h in range(2):
    assert not isinstance(out[h], Exception), out[h]
    assert out[h] == single
  assert tok_cls.calls == {'h0': probe, 'h1': probe + sum(cost[16:24])}, tok_cls.calls
  assert harness.contents(cache) == harness.contents(str(tmp_path / 'one'))


@pytest.mark.heavy      # the storage emulator's start and round trips: ~15 s
def test_a_preparation_on_gcs_resumes(gcs, tmp_path):
  """The same on gs:// (parts and records uploaded whole, read back through etils.epath): a
  stopped preparation's parts are reused, an overwritten half part is made again, and the
  commit removes the records."""
  from foundation import paths  # pylint: disable=g-import-not-at-top
  n, d, ref = 37, gcs.root + '/cache/toy', str(tmp_path / 'ref')
  want = token_cache.prepare(ref, harness.Rows(n), harness.make_item, True, 'test',
                             log=lambda s: None, key='k')
  made = []

  def counted(i, rec):
    made.append(i)
    return harness.make_item(i, rec)

  def stop(i):
    if i == 24:
      raise Preempted(i)
  with pytest.raises(Preempted):        # parts 0-5 finished
    token_cache.prepare(d, harness.Rows(n, stop), counted, True, 'test', log=lambda s: None,
                        key='k')
  half = paths.join(d, 'items-00004.arrayrecord')
  paths.write_bytes(half, paths.read_bytes(half)[:40])
  made.clear()
  logs = []
  got = token_cache.prepare(d, harness.Rows(n), counted, True, 'test', log=logs.append, key='k')
  assert made == [i for i in range(16, 20)] + [i for i in range(24, n) if i % 11 != 10], made
  assert any(s.startswith(f'WARNING: test: {half} is torn or changed (40 bytes') for s in logs)
  assert got['kept'] == want['kept'] and got['shards'] == want['shards']
  assert paths.listdir(d) == sorted(os.listdir(ref))
  for f in os.listdir(ref):
    if f != 'manifest.json':
      assert paths.read_bytes(paths.join(d, f)) == open(os.path.join(ref, f), 'rb').read(), f
