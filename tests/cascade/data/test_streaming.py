"""Training data streamed from shards: the Loader over a dataset read by position (seeded order,
exact resume across a shard boundary, each host reading its share), lazy checks and filters,
and the tokenize-once cache of a stage's items."""

import dataclasses
import json
import os

import numpy as np
import pytest

from cascade import config as config_lib
from cascade.data import readers
from cascade.data import stage_data
from cascade.data import token_cache
from foundation import chat_template


@pytest.fixture(autouse=True)
def _local_cache(tmp_path, monkeypatch):
  """Shard indexes of loads without a cache directory go to the test's own directory."""
  monkeypatch.setenv('CASCADE_DATA_CACHE', str(tmp_path / 'local_cache'))


def spec(path, fmt='sft', name='sft', **kw):
  return config_lib.Dataset(name=name, format=fmt, record_type=fmt, path=str(path), **kw)


def sft_row(i, domain='a'):
  return {'id': f'r{i}', 'domain': domain, 'messages': [{'role': 'user', 'content': f'Q{i}?'}],
          'response': f'A{i}.' + ' so' * (i % 5)}


def write_shards(d, sizes, bad=None):
  """JSONL shards s0.jsonl, s1.jsonl, ... of `sizes` rows; `bad` = (shard, row): an invalid one."""
  n = 0
  for s, k in enumerate(sizes):
    lines = []
    for j in range(k):
      row = sft_row(n)
      if bad == (s, j):
        row.pop('response')
      lines.append(json.dumps(row))
      n += 1
    (d / f's{s}.jsonl').write_text('\n'.join(lines) + '\n')
  return str(d / 's*.jsonl')


class Counting:
  """A source that records which positions were read."""

  def __init__(self, src):
    self.src, self.read = src, []

  def __len__(self):
    return len(self.src)

  def __getitem__(self, i):
    self.read.append(int(i))
    return self.src[i]


def test_streamed_batches_resume_exactly_mid_epoch_across_a_shard_boundary(tmp_path):
  """A loader restored from a state taken mid-epoch yields exactly the batches of an
  uninterrupted one, and reads no position the order put before its state."""
  pattern = write_shards(tmp_path, [7, 6, 5])                  # 18 rows over 3 shards
  recs = readers.Records(spec(pattern), str(tmp_path / 'cache'))
  assert len(recs) == 18 and recs[7]['id'] == 'r7' and recs[7]['response'] == 'A7. so so'
  ids = lambda b: [r['id'] for r in b]
  whole = readers.Loader(readers.Stream(recs), seed=4, batch_size=5)
  want = [ids(whole.next()) for _ in range(8)]                 # 40 draws: 2+ epochs
  flat = sum(want, [])
  assert sorted(flat[:18]) == sorted(f'r{i}' for i in range(18))   # an epoch: a permutation
  # The same order as the in-memory loader over the same records.
  mem = readers.Loader([recs[i] for i in range(18)], seed=4, batch_size=5)
  assert [ids(mem.next()) for _ in range(8)] == want
  first = readers.Loader(readers.Stream(recs), seed=4, batch_size=5)
  for _ in range(3):
    first.next()
  state = json.loads(json.dumps(first.get_state()))
  assert state == {'position': 15}                             # mid-epoch (of 18)
  counted = Counting(recs)
  resumed = readers.Loader(readers.Stream(counted), seed=4, batch_size=5)
  resumed.set_state(state)
  assert [ids(resumed.next()) for _ in range(5)] == want[3:]
  # It read exactly the positions from its state on, and they cross shard boundaries.
  order = resumed._order  # pylint: disable=protected-access
  assert counted.read == [order[p] for p in range(15, 40)]
  assert {recs.source[i][0].split('/')[-1].split(':')[0] for i in counted.read[:5]} != {'s0.jsonl'}
  with pytest.raises(readers.DataError, match='not a position of this loader'):
    resumed.set_state({'next_index': 3})


def test_malformed_and_filtered_records_are_skipped_when_drawn_and_counted(tmp_path, capsys):
  pattern = write_shards(tmp_path, [4, 4], bad=(1, 1))         # row 5 has no response
  recs = readers.Records(spec(pattern), str(tmp_path / 'cache'))
  keep = lambda i, r: r if int(r['id'][1:]) % 3 else None      # drops r0, r3, r6
  loader = readers.Loader(readers.Stream(recs, keep, 'multiples of 3', 'test'), 0, 4, shuffle=False)
  assert [r['id'] for r in loader.next()] == ['r1', 'r2', 'r4', 'r7']
  assert (loader.malformed, loader.dropped) == (1, 3)
  out = capsys.readouterr().out
  assert f'malformed record skipped: {tmp_path}/s1.jsonl:2: missing field' in out
  assert 'dropped a record (multiples of 3)' in out
  never = readers.Loader(readers.Stream(recs, lambda i, r: None, 'everything', 'test'), 0, 3)
  with pytest.raises(readers.DataError, match='test: no records left after dropping everything'):
    never.next()


def test_each_host_reads_its_share_and_every_host_gets_the_whole_batch(tmp_path, fakes):
  pattern = write_shards(tmp_path, [5, 6])
  recs = readers.Records(spec(pattern), str(tmp_path / 'cache'))
  single = readers.Loader(readers.Stream(recs), 2, 4)
  want = [[r['id'] for r in single.next()] for _ in range(4)]
  reads = {}

  def host(hosts):
    counted = Counting(readers.Records(spec(pattern), str(tmp_path / 'cache')))
    reads[hosts.index] = counted.read
    loader = readers.Loader(readers.Stream(counted, hosts=hosts), 2, 4)
    return [[r['id'] for r in loader.next()] for _ in range(4)]

  out = fakes.on_hosts(2, host)
  assert out[0] == out[1] == want
  # 16 positions, 8 read by each host: host h reads positions h, h + 2, ...
  order = readers.Loader(readers.Stream(recs), 2, 4)._order  # pylint: disable=protected-access
  assert reads == {h: [order[p] for p in range(h, 16, 2)] for h in (0, 1)}


def _with_sft(plan, pattern):
  return dataclasses.replace(plan, datasets={**plan.datasets, 'sft': spec(pattern)})


class StageOnly(stage_data.StageData):
  """StageData whose evaluation sets are not read (the toy plan's point at no files)."""

  def _prompts(self, *a):
    return []


def _stage_data(fakes, plan, tok, cache_dir, **kw):
  sd = StageOnly(plan, tok, None, cache_dir=cache_dir, **kw)
  sd._records = {n: [] for n in ('a_train', 'b_train')}  # pylint: disable=protected-access
  real = stage_data.readers.open_dataset

  def open_training(spec_, *a, **k):
    return real(spec_, *a, **k) if spec_.name == 'sft' else []
  return sd, open_training


def test_a_malformed_row_in_the_checked_prefix_stops_the_load(fakes, tmp_path, monkeypatch):
  pattern = write_shards(tmp_path, [3, 3], bad=(1, 0))
  plan = _with_sft(fakes.toy_config([dict(fakes.SFT_STAGE, max_len=96)]), pattern)
  sd, open_training = _stage_data(fakes, plan, fakes.CharTokenizer(), None)
  monkeypatch.setattr(stage_data.readers, 'open_dataset', open_training)
  monkeypatch.setattr(stage_data.readers, 'load', lambda spec, **kw: [])
  with pytest.raises(readers.DataError, match=rf'{tmp_path}/s1.jsonl:1: missing field'):
    sd.load()
  monkeypatch.setattr(stage_data, 'CHECKED_PREFIX', 3)         # past the prefix: skipped later
  sd, _ = _stage_data(fakes, plan, fakes.CharTokenizer(), None)
  sd.load()
  loader = readers.Loader(sd.stage_records(plan.stages[0]), 0, 5, shuffle=False)
  assert len(loader.next()) == 5 and loader.malformed == 1


def test_a_stage_is_tokenized_once_and_resumes_from_the_cache(fakes, tmp_path, monkeypatch):
  """The cache holds what the stage would tokenize (same items, same order); a second run
  tokenizes only the key's probe; a resume across the cache's shard boundary is exact; a
  changed tokenizer or source file makes a new cache."""
  monkeypatch.setattr(token_cache, 'ROWS_PER_SHARD', 7)
  pattern = write_shards(tmp_path, [9, 8])
  plan = _with_sft(fakes.toy_config([dict(fakes.SFT_STAGE, max_len=96)]), pattern)
  st = plan.stages[0]
  monkeypatch.setattr(stage_data.readers, 'load', lambda spec, **kw: [])
  cache = str(tmp_path / 'prepared')

  def stream(tok, cache_dir):
    sd, open_training = _stage_data(fakes, plan, tok, cache_dir)
    monkeypatch.setattr(stage_data.readers, 'open_dataset', open_training)
    sd.load()
    return sd.stage_records(st)

  direct = stream(fakes.CharTokenizer(), None)                 # tokenized as drawn
  cached = stream(fakes.CharTokenizer(), cache)
  listing = sorted(p.name for p in (tmp_path / 'prepared').iterdir())
  assert len(listing) == 2 and listing[1] == 'shards'         # the stage's cache + indexes
  d = tmp_path / 'prepared' / listing[0]
  assert sorted(p.name for p in d.iterdir()) == ['items-00000.arrayrecord',
                                                 'items-00001.arrayrecord',
                                                 'items-00002.arrayrecord', 'manifest.json']
  man = json.loads((d / 'manifest.json').read_text())
  assert man['rows'] == 17 and man['kept'] == 17 and man['rows_per_s'] > 0
  tok = fakes.CharTokenizer()
  for i in range(17):
    want = st.tokenize(tok)(direct.source[i])
    got = cached.source[i]
    assert [list(a) for a in got] == [list(a) for a in want]
  flat = lambda b: [np.asarray(t).tolist() for t, _ in b]
  a = readers.Loader(direct, 1, 4)
  want = [flat(a.next()) for _ in range(9)]
  b = readers.Loader(cached, 1, 4)
  b.next(), b.next()
  state = b.get_state()
  assert state == {'position': 8}       # mid-epoch; batches read across the 7-row cache shards
  calls = []
  real_encode = type(tok).encode
  monkeypatch.setattr(type(tok), 'encode', lambda self, text: calls.append(1) or real_encode(
      self, text))                                             # the same tokenizer, counted
  probe = token_cache._PROBE  # pylint: disable=protected-access
  for i in range(probe):
    st.tokenize(tok)(direct.source[i])
  probe_calls = len(calls)
  calls.clear()
  again = stream(fakes.CharTokenizer(), cache)                 # found: only the key's probe
  assert len(calls) == probe_calls
  c = readers.Loader(again, 1, 4)
  c.set_state(state)
  assert [flat(c.next()) for _ in range(7)] == want[2:]
  assert len(calls) == probe_calls                             # training tokenizes nothing

  class Shifted(type(tok)):
    def encode(self, text):
      return [(t + 1) % 256 for t in super().encode(text)]
  stream(Shifted(), cache)                                     # another tokenizer: a new cache
  assert len(list((tmp_path / 'prepared').iterdir())) == 3
  own = chat_template.CheckpointTemplate(                       # another chat template: too
      '{% if enable_thinking is defined and enable_thinking is false %}[no thinking]\n'
      '{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}'
      '{% if add_generation_prompt %}assistant: {% endif %}')
  stream(chat_template.attach(fakes.CharTokenizer(), own), cache)
  assert len(list((tmp_path / 'prepared').iterdir())) == 4
  (tmp_path / 's1.jsonl').write_text((tmp_path / 's1.jsonl').read_text() + '\n' +
                                     json.dumps(sft_row(99)) + '\n')
  assert len(stream(fakes.CharTokenizer(), cache).source) == 18
  assert len(list((tmp_path / 'prepared').iterdir())) == 5     # a changed source file too


@pytest.mark.heavy      # the emulator's start and round trips: ~20 s
def test_shards_and_the_prepared_cache_on_gcs(gcs, fakes, tmp_path, monkeypatch, capsys):
  """A glob of gs:// shards of every kind reads like a local one, and a stage's cache on gs://
  is written there and found again."""
  from tests.cascade.data import test_shards  # pylint: disable=g-import-not-at-top
  from foundation import paths  # pylint: disable=g-import-not-at-top
  local = tmp_path / 'local'
  local.mkdir()
  test_shards.write_all(local)
  root = gcs.root + '/shards'
  for f in sorted(local.iterdir()):
    paths.copy_file(str(f), paths.join(root, f.name))
  src = readers.shards.open_source(root + '/p*', str(tmp_path / 'idx'))
  assert [src[i][1] for i in range(len(src))] == test_shards.rows(0, 17)
  assert src[3][0] == f'{root}/p1.jsonl.gz:1' and src[16][0] == f'{root}/p4.arrayrecord record 2'

  sft_dir = gcs.root + '/sft'
  for s, k in enumerate([5, 4]):
    paths.write_text(paths.join(sft_dir, f's{s}.jsonl'), ''.join(
        json.dumps(sft_row(s * 5 + j)) + '\n' for j in range(k)))
  plan = _with_sft(fakes.toy_config([dict(fakes.SFT_STAGE, max_len=96)]), sft_dir + '/s*.jsonl')
  monkeypatch.setattr(stage_data.readers, 'load', lambda spec, **kw: [])
  cache = gcs.root + '/cache'
  logs = []
  for _ in range(2):
    sd, open_training = _stage_data(fakes, plan, fakes.CharTokenizer(), cache)
    monkeypatch.setattr(stage_data.readers, 'open_dataset', open_training)
    sd.load()
    logs.append(capsys.readouterr().out)
    got = readers.Loader(sd.stage_records(plan.stages[0]), 0, 9, shuffle=False).next()
    tok = fakes.CharTokenizer()
    assert [list(t) for t, _ in got] == [
        list(plan.stages[0].tokenize(tok)(sft_row(i))[0]) for i in range(9)]
  assert 'prepared 9 rows' in logs[0] and 'data from the prepared cache' in logs[1]
  assert os.listdir(tmp_path / 'local_cache' / 'copies')       # the items shard, copied to read
  [stage_dir] = paths.listdir(cache)
  assert sorted(paths.listdir(paths.join(cache, stage_dir))) == ['items-00000.arrayrecord',
                                                                 'manifest.json']


def test_the_batched_preparation_writes_what_one_row_at_a_time_does(fakes, tmp_path, monkeypatch):
  """The token cache prepares a stage with one batch call per chunk (`make.batch`: the
  tokenizer library's batch encode): the same shards, byte for byte, and the same malformed
  count as one `make` per row, also for a chunk that meets a malformed record."""
  monkeypatch.setattr(token_cache, '_CHUNK', 4)
  monkeypatch.setattr(stage_data, 'CHECKED_PREFIX', 2)         # the bad row is met preparing
  pattern = write_shards(tmp_path, [9, 8], bad=(1, 1))
  plan = _with_sft(fakes.toy_config([dict(fakes.SFT_STAGE, max_len=90)]), pattern)  # responses cut
  st = plan.stages[0]
  monkeypatch.setattr(stage_data.readers, 'load', lambda spec, **kw: [])

  def prepared(cache):
    sd, open_training = _stage_data(fakes, plan, fakes.CharTokenizer(), str(tmp_path / cache))
    monkeypatch.setattr(stage_data.readers, 'open_dataset', open_training)
    sd.load()
    stream = sd.stage_records(st)
    d = next(p for p in (tmp_path / cache).iterdir() if p.name != 'shards')
    man = json.loads((d / 'manifest.json').read_text())
    return stream, {p.name: p.read_bytes() for p in d.glob('items-*')}, man

  batched, shards, man = prepared('batched')
  assert man['malformed'] == 1 and man['kept'] == 16
  monkeypatch.setattr(type(st), 'tokenize_batch', lambda self, tok: None)
  _, one_by_one, man_one = prepared('one_by_one')
  assert shards == one_by_one and man_one['malformed'] == 1
  assert any(len(batched.source[i][0]) == 90 for i in range(17) if i != 10)   # some were cut
