"""Sharded sources: a glob of JSONL / gzip / zstd / Parquet / ArrayRecord shards read by position,
their cached indexes, and one-line errors naming file and line or shard and byte offset."""

import gzip
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from array_record.python import array_record_module

from cascade.data import shards


def rows(lo, hi):
  return [{'k': i, 'text': f'row {i} ' + 'x' * (i % 7)} for i in range(lo, hi)]


def jsonl(rs, blank_after=()):
  out = b''
  for i, r in enumerate(rs):
    out += json.dumps(r).encode() + b'\n'
    if i in blank_after:
      out += b'  \n'
  return out


def write_all(d):
  """Five shards of every type (names sort in this order), 3 + 4 + 3 + 5 + 2 rows."""
  (d / 'p0.jsonl').write_bytes(jsonl(rows(0, 3), blank_after=(0,)))      # line 2 blank
  # Two gzip members (what `cat a.gz b.gz` makes).
  (d / 'p1.jsonl.gz').write_bytes(gzip.compress(jsonl(rows(3, 5)))
                                  + gzip.compress(jsonl(rows(5, 7))))
  c = zstandard.ZstdCompressor()
  (d / 'p2.jsonl.zst').write_bytes(c.compress(jsonl(rows(7, 9))) + c.compress(jsonl(rows(9, 10))))
  pq.write_table(pa.Table.from_pylist(rows(10, 15)), d / 'p3.parquet', row_group_size=2)
  w = array_record_module.ArrayRecordWriter(str(d / 'p4.arrayrecord'), 'group_size:1')
  for r in rows(15, 17):
    w.write(json.dumps(r).encode())
  w.close()


def test_a_glob_of_every_shard_type_reads_by_position(tmp_path):
  write_all(tmp_path)
  cache = tmp_path / 'cache'
  src = shards.open_source(str(tmp_path / 'p*'), str(cache))
  assert len(src) == 17
  assert [src[i][1] for i in range(17)] == rows(0, 17)
  # Random order reads the same rows (parquet row groups, compressed copies, line offsets).
  for i in np.random.default_rng(0).permutation(17):
    assert src[int(i)][1] == rows(0, 17)[i]
  wheres = [src[i][0] for i in (0, 1, 3, 6, 7, 10, 14, 16)]
  p = str(tmp_path)
  assert wheres == [f'{p}/p0.jsonl:1', f'{p}/p0.jsonl:3', f'{p}/p1.jsonl.gz:1',
                    f'{p}/p1.jsonl.gz:4', f'{p}/p2.jsonl.zst:1', f'{p}/p3.parquet row 1',
                    f'{p}/p3.parquet row 5', f'{p}/p4.arrayrecord record 2']
  # Front-to-back streaming agrees with random access, shard by shard.
  streamed = [x for f in shards.expand(str(tmp_path / 'p*')) for x in shards.stream(f)]
  assert streamed == [src[i] for i in range(17)]
  with pytest.raises(shards.DataError, match=r'q\*: no file matches'):
    shards.expand(str(tmp_path / 'q*'))
  (tmp_path / 'p9.csv').write_text('a,b\n')
  with pytest.raises(shards.DataError, match=r'p9\.csv: unknown file type'):
    shards.expand(str(tmp_path / 'p*'))


def test_the_line_index_is_built_once_and_rebuilt_when_the_shard_changes(tmp_path, monkeypatch):
  f = tmp_path / 'a.jsonl'
  f.write_bytes(jsonl(rows(0, 5)))
  cache = str(tmp_path / 'cache')
  built = []
  real = shards._JsonlShard._build_index
  monkeypatch.setattr(shards._JsonlShard, '_build_index',
                      lambda self: built.append(1) or real(self))
  assert len(shards.open_shard(str(f), cache)) == 5
  assert len(shards.open_shard(str(f), cache)) == 5 and len(built) == 1    # cached
  f.write_bytes(jsonl(rows(0, 6)))                                           # new size
  s = shards.open_shard(str(f), cache)
  assert len(s) == 6 and len(built) == 2 and s[5][1] == rows(0, 6)[5]
  # A last line without its newline is a row; the index is memory-mapped, not loaded.
  f.write_bytes(jsonl(rows(0, 2)) + json.dumps(rows(2, 3)[0]).encode())
  s = shards.open_shard(str(f), cache)
  assert len(s) == 3 and s[2] == (f'{f}:3', rows(2, 3)[0])
  assert isinstance(s.index, np.memmap)


def test_bad_rows_in_any_shard_name_file_and_line(tmp_path):
  good = json.dumps({'k': 0}).encode()
  (tmp_path / 'a.jsonl.gz').write_bytes(gzip.compress(good + b'\n\n' + b'{"k": \n'))
  src = shards.open_source(str(tmp_path / 'a.jsonl.gz'), str(tmp_path / 'c'))
  with pytest.raises(shards.DataError, match=r'a\.jsonl\.gz:3: not valid JSON'):
    src[1]  # pylint: disable=pointless-statement
  with pytest.raises(shards.DataError, match=r'a\.jsonl\.gz:3: not valid JSON'):
    list(shards.stream(str(tmp_path / 'a.jsonl.gz')))
  w = array_record_module.ArrayRecordWriter(str(tmp_path / 'b.arrayrecord'), 'group_size:1')
  w.write(good)
  w.write(b'\xff\xfe')
  w.close()
  with pytest.raises(shards.DataError, match=r'b\.arrayrecord record 2: not UTF-8'):
    shards.open_shard(str(tmp_path / 'b.arrayrecord'))[1]  # pylint: disable=expression-not-assigned


def test_corrupt_shards_name_the_shard_and_byte_offset(tmp_path):
  cache = str(tmp_path / 'cache')
  member = gzip.compress(jsonl(rows(0, 50)))
  # A second gzip member whose compression method byte (its byte 2) is not deflate.
  bad = bytearray(gzip.compress(jsonl(rows(50, 60))))
  bad[2] = 7
  (tmp_path / 'a.jsonl.gz').write_bytes(member + bytes(bad))
  with pytest.raises(shards.DataError) as e:
    shards.open_shard(str(tmp_path / 'a.jsonl.gz'), cache)
  # zlib reads the method and flag bytes together: it fails on the byte after the bad one.
  at = int(re.search(r'a\.jsonl\.gz: corrupt gzip data at byte offset (\d+) ', str(e.value))[1])
  assert len(member) + 2 <= at <= len(member) + 3, str(e.value)
  (tmp_path / 'b.jsonl.gz').write_bytes(member[:-9])
  with pytest.raises(shards.DataError, match=r'b\.jsonl\.gz: truncated gzip data \(the stream '
                                             rf'ends at byte offset {len(member) - 9} '):
    shards.open_shard(str(tmp_path / 'b.jsonl.gz'), cache)
  assert not os.listdir(os.path.join(cache, 'plain'))          # no half-written copy left

  frame = zstandard.ZstdCompressor().compress(jsonl(rows(0, 50)))
  (tmp_path / 'c.jsonl.zst').write_bytes(frame + b'\x00' * 40)
  with pytest.raises(shards.DataError, match=r'c\.jsonl\.zst: corrupt zstd data in the 40-byte '
                                             rf'block at byte offset {len(frame)} '):
    shards.open_shard(str(tmp_path / 'c.jsonl.zst'), cache)

  pq.write_table(pa.Table.from_pylist(rows(0, 10)), tmp_path / 'd.parquet', row_group_size=5)
  raw = (tmp_path / 'd.parquet').read_bytes()
  (tmp_path / 'e.parquet').write_bytes(raw[:-3])
  with pytest.raises(shards.DataError, match=r'e\.parquet: not a readable Parquet file: its '
                                             rf'footer \(byte offset {len(raw) - 3 - 8}\)'):
    shards.open_shard(str(tmp_path / 'e.parquet'))
  md = pq.ParquetFile(tmp_path / 'd.parquet').metadata.row_group(1).column(0)
  off = md.dictionary_page_offset or md.data_page_offset
  broken = bytearray(raw)
  broken[off:off + 40] = b'\xff' * 40
  (tmp_path / 'f.parquet').write_bytes(bytes(broken))
  s = shards.open_shard(str(tmp_path / 'f.parquet'))
  assert s[0][1] == rows(0, 1)[0]                              # row group 0 is intact
  with pytest.raises(shards.DataError, match=rf'f\.parquet: row group 1 \(byte offset {off}\) '
                                             'is unreadable'):
    s[7]  # pylint: disable=pointless-statement

  w = array_record_module.ArrayRecordWriter(str(tmp_path / 'g.arrayrecord'), 'group_size:1')
  for r in rows(0, 5):
    w.write(json.dumps(r).encode())
  w.close()
  broken = bytearray((tmp_path / 'g.arrayrecord').read_bytes())
  broken[100:110] = b'x' * 10
  (tmp_path / 'h.arrayrecord').write_bytes(bytes(broken))
  with pytest.raises(shards.DataError, match=r'h\.arrayrecord: corrupt ArrayRecord data at byte '
                                             r'offset \d+ reading record 1'):
    shards.open_shard(str(tmp_path / 'h.arrayrecord'))[0]  # pylint: disable=expression-not-assigned
  (tmp_path / 'i.arrayrecord').write_bytes(b'garbage' * 10)
  with pytest.raises(shards.DataError, match=r'i\.arrayrecord: not an ArrayRecord file'):
    shards.open_shard(str(tmp_path / 'i.arrayrecord'))
