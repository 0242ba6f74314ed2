"""Sharded dataset files read by position: a glob of JSONL / compressed JSONL / Parquet /
ArrayRecord shards, local or gs://, as one random-access source of raw rows.

  src = shards.open_source('gs://b/sft/*.jsonl.zst', cache_dir='/tmp/cascade-data')
  len(src)                     # rows over all shards, in shard-name order
  where, row = src[123_456]    # ('gs://b/sft/part-003.jsonl.zst:8812', {...})

A source has `__len__` and `__getitem__`, which is what `grain.MapDataset.source`
takes, so a seeded shuffle over it is a deterministic global order and any
position can be read without reading what comes before it. Memory stays
bounded by the largest row group / line, never by the dataset:

  .jsonl / .json     a line-offset index is built once per shard by one streamed
                     pass (numpy int64 [rows, 3]: start, end, line number; blank
                     lines are not rows) and kept in the local cache dir, keyed by
                     the shard's path, size and stamp (`identity`: it changes with
                     every write, even one in place at the old size and time); a
                     row is one seek and one read. The index is memory-mapped.
  .jsonl.gz/.zst     decompressed once, streaming, into the cache (then indexed as
                     above). Random access into a gzip or zstd stream needs either
                     a full decompression from the start per read or a table of
                     decoder windows (32 KiB each for gzip, up to the frame's
                     window for zstd); a plain copy on local disk costs disk only
                     and makes every read a seek. The cache may be deleted at any
                     time: it is rebuilt from the shard.
  .parquet           by row group: row i is found from the footer's row counts; the
                     last two decoded row groups are kept (reading in order, as
                     preparation does, decodes each row group once).
  .arrayrecord       natively (array_record's reader); rows are JSON objects as
                     UTF-8 bytes. A gs:// shard is copied into the cache first
                     (array_record's reader opens local files).

Several processes (`open_shards`, given the run's hosts and a cache every process sees,
local or gs://) split the work of opening: the shards are dealt to the P processes by
file size (`deal`: largest first, each to the least-loaded process), each process
indexes and decompresses its own shards only and publishes each index (and plain copy)
to the shared cache; one exchange, a collective that is also the barrier, gives every process every
shard's row count. Rows keep their global positions, so the order is the single
process's, whatever P. A process reads a row of a shard it did not open through the
shared index (copied to its local cache, memory-mapped) and the shared plain copy:
each shard is streamed once per run, not once per host.

A shard's identity (`identity`: its path, size and a digest of its content; nothing is
downloaded on gs://, where the store keeps a crc32c of every object) is what a stage that
resumes from a checkpoint checks its data against (`cascade.data.stage_data`).

Errors are one line: a row names `file:line` (JSONL, the line within its shard,
compressed or not), `file row n` (Parquet) or `file record n` (ArrayRecord); a
corrupt shard names the shard and the byte offset of the damage (for gzip the
compressed byte at which the decoder fails, for zstd the start of the 64 KiB block that failed, for
Parquet the row group's first byte or the footer, for ArrayRecord the chunk the
reader rejected).
"""

from __future__ import annotations

import bisect
import collections
import glob as glob_lib
import hashlib
import heapq
import json
import os
import re
import zlib
from typing import Any, Iterator, Sequence

import numpy as np

from cascade import checksums
from foundation import paths

JSONL = ('.jsonl', '.json')
GZIP = ('.jsonl.gz', '.json.gz')
ZSTD = ('.jsonl.zst', '.json.zst')
PARQUET = ('.parquet',)
ARRAY_RECORD = ('.arrayrecord', '.array_record')
SUFFIXES = JSONL + GZIP + ZSTD + PARQUET + ARRAY_RECORD
_BLOCK = 1 << 20           # bytes read per call when streaming a shard
_ZSTD_BLOCK = 1 << 16      # compressed bytes fed per call to the zstd decoder
_INDEX_VERSION = 1         # bump when the index or decompressed layout changes


class DataError(ValueError):
  """A malformed dataset, shard or record; the one-line message names the file and line (or
  shard and byte offset). `cascade.data.readers.DataError` is this class."""


def default_cache_dir() -> str:
  """$CASCADE_DATA_CACHE, else ~/.cache/cascade/data (a local directory)."""
  return os.environ.get('CASCADE_DATA_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'cascade', 'data')


def _kind(p: str) -> str:
  for kind, suffixes in (('gzip', GZIP), ('zstd', ZSTD), ('jsonl', JSONL),
                         ('parquet', PARQUET), ('arrayrecord', ARRAY_RECORD)):
    if p.endswith(suffixes):
      return kind
  raise DataError(f'{p}: unknown file type (expected {", ".join(SUFFIXES)})')


def expand(pattern: str) -> list[str]:
  """The files a dataset path names: itself, or the sorted matches of a glob (`*`, `?`, `[`).

  Raises:
    DataError: nothing matches, or a match has an unknown extension.
  """
  pattern = os.fspath(pattern)
  try:
    if not glob_lib.has_magic(pattern):
      if not paths.exists(pattern):
        raise DataError(f'{pattern}: no such file')
      found = [pattern]
    elif not paths.is_remote(pattern):
      found = sorted(f for f in glob_lib.glob(pattern) if os.path.isfile(f))
    else:
      # Split at the first component holding a wildcard: epath globs below a fixed prefix.
      parts = pattern.split('/')
      k = next(i for i, s in enumerate(parts) if glob_lib.has_magic(s))
      base, rest = '/'.join(parts[:k]), '/'.join(parts[k:])
      found = sorted(os.fspath(m) for m in paths.path(base).glob(rest) if not m.is_dir())
  except paths.PathError as e:
    raise DataError(str(e)) from None
  if not found:
    raise DataError(f'{pattern}: no file matches')
  for f in found:
    _kind(f)
  return found


# ----------------------------------------------------------------------------- decompression


def _chunks(f) -> Iterator[bytes]:
  while True:
    b = f.read(_BLOCK)
    if not b:
      return
    yield b


def _gunzip(path: str, f) -> Iterator[bytes]:
  """The decompressed bytes of a (multi-member) gzip stream; damage is named to the byte."""
  d = zlib.decompressobj(47)       # 32 + 15: gzip or zlib header, 32 KiB window
  pos = 0                          # compressed bytes consumed before `chunk`
  started = False
  for chunk in _chunks(f):
    while chunk:
      before = d.copy()
      try:
        out = d.decompress(chunk)
      except zlib.error as e:
        raise DataError(f'{path}: corrupt gzip data at byte offset '
                         f'{pos + _first_bad(before, chunk)} ({e})') from None
      started = True
      if out:
        yield out
      if d.eof:
        used = len(chunk) - len(d.unused_data)
        pos, chunk = pos + used, d.unused_data
        d = zlib.decompressobj(47)
        started = False
      else:
        pos, chunk = pos + len(chunk), b''
  if started and not d.eof:
    raise DataError(f'{path}: truncated gzip data (the stream ends at byte offset {pos} '
                     'inside a member)')


def _first_bad(d, chunk: bytes) -> int:
  """The offset in `chunk` of the byte at which decoder `d` (a copy) fails."""
  for i in range(len(chunk)):
    try:
      d.decompress(chunk[i:i + 1])
    except zlib.error:
      return i
  return len(chunk)


def _unzstd(path: str, f) -> Iterator[bytes]:
  """The decompressed bytes of a (multi-frame) zstd stream; damage is named by its block."""
  import zstandard  # pylint: disable=g-import-not-at-top
  dctx = zstandard.ZstdDecompressor()
  d, pos, started = dctx.decompressobj(), 0, False
  while True:
    chunk = f.read(_ZSTD_BLOCK)
    if not chunk:
      break
    while chunk:
      try:
        out = d.decompress(chunk)
      except zstandard.ZstdError as e:
        raise DataError(f'{path}: corrupt zstd data in the {len(chunk)}-byte block at byte '
                         f'offset {pos} ({e})') from None
      started = True
      if out:
        yield out
      if d.eof:
        used = len(chunk) - len(d.unused_data)
        pos, chunk = pos + used, d.unused_data
        d, started = dctx.decompressobj(), False
      else:
        pos, chunk = pos + len(chunk), b''
  if started and not d.eof:
    raise DataError(f'{path}: truncated zstd data (the stream ends at byte offset {pos} '
                     'inside a frame)')


def _plain_chunks(path: str, kind: str, f) -> Iterator[bytes]:
  if kind == 'gzip':
    return _gunzip(path, f)
  if kind == 'zstd':
    return _unzstd(path, f)
  return _chunks(f)


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
  """Lines (without their newline) of a byte stream."""
  rest = b''
  for chunk in chunks:
    parts = (rest + chunk).split(b'\n')
    rest = parts.pop()
    yield from parts
  if rest:
    yield rest


# ----------------------------------------------------------------------------- rows


def parse_json_line(where: str, raw: bytes) -> Any:
  """The row of one JSON line; every defect is a DataError naming `where` (file:line)."""
  try:
    line = raw.decode('utf-8')
  except UnicodeDecodeError as e:
    raise DataError(f'{where}: not UTF-8 (byte {raw[e.start:e.start + 1]!r} at byte '
                     f'{e.start + 1} of the line)') from None
  try:
    row = json.loads(line)
  except json.JSONDecodeError as e:
    raise DataError(f'{where}: not valid JSON ({e.msg} at column {e.colno})') from None
  except RecursionError:
    raise DataError(f'{where}: JSON nested too deeply') from None
  check_strings(row, where)
  return row


def check_strings(row: Any, where: str) -> None:
  """Rejects strings that cannot be UTF-8 (lone surrogates from \\ud800-style escapes)."""
  stack = [row]
  while stack:
    x = stack.pop()
    if isinstance(x, str):
      try:
        x.encode('utf-8')
      except UnicodeEncodeError as e:
        raise DataError(f'{where}: a string holds a lone surrogate '
                         f'({x[e.start]!r} at character {e.start + 1}), which is not text') from None
    elif isinstance(x, dict):
      stack.extend(x.keys())
      stack.extend(x.values())
    elif isinstance(x, list):
      stack.extend(x)


def _open(p: str):
  try:
    return paths.path(p).open('rb')
  except paths.PathError as e:
    raise DataError(str(e)) from None


def _remote_info(p: str) -> dict:
  """The store's metadata of object `p` (gcsfs: size, generation, crc32c, ...)."""
  import fsspec  # pylint: disable=g-import-not-at-top
  try:
    fs, rel = fsspec.core.url_to_fs(os.fspath(p))
    return fs.info(rel)
  except FileNotFoundError:
    raise DataError(f'{p}: no such file') from None
  except Exception as e:  # pylint: disable=broad-except
    why = (str(e).strip().splitlines() or [''])[0][:200]
    raise DataError(f'{p}: cannot read its metadata ({type(e).__name__}: {why})') from None


def _describe(p: str) -> tuple[int, list, str]:
  """(size, stamp, the store's digest or '') of shard `p`.

  The stamp changes whenever the file is written, even in place at its old size with its
  modification time set back: locally it is the modification and status-change times (ns;
  a process can set the first, not the second) and the inode; on gs:// the object's
  generation (a new one on every write). The store's digest is gs://'s crc32c of the
  object's bytes; a local file has none.
  """
  if not paths.is_remote(p):
    try:
      st = os.stat(p)
    except FileNotFoundError:
      raise DataError(f'{p}: no such file') from None
    return st.st_size, [st.st_mtime_ns, st.st_ctime_ns, st.st_ino], ''
  info = _remote_info(p)
  stored = info.get('crc32c')
  return (int(info['size']), [str(info.get('generation') or info.get('mtime'))],
          f'crc32c:{stored}' if stored else '')


def _stat_key(p: str, *extra) -> str:
  """A cache key for shard `p`: its path, size and stamp (`_describe`), and `extra`."""
  size, stamp, _ = _describe(p)
  ident = json.dumps([_INDEX_VERSION, os.fspath(p), size, stamp, *extra])
  return hashlib.sha256(ident.encode()).hexdigest()[:24]


def identity(p: str, known: dict | None = None) -> dict:
  """{'path', 'size', 'stamp', 'digest'} of shard `p`: what its bytes are, checked cheaply.

  The digest is of the content: on gs://, the crc32c the store keeps of every object (read
  from its metadata: nothing is downloaded); elsewhere 'sha256:<hex>' of the bytes, streamed
  (about 1 s per GB), unless `known`, this shard's earlier identity, has its size and stamp
  (`_describe`): its digest is then taken as it is, and nothing is read. So a rerun on the same
  host reads nothing, a copy of the same bytes (another host) is read once and matches, and a
  file rewritten in any way, even at its old size and modification time, is read again.

  Raises:
    DataError: the shard is missing or its metadata cannot be read.
  """
  size, stamp, digest = _describe(p)
  if not digest:
    if known and known.get('size') == size and known.get('stamp') == stamp and known.get(
        'path') == os.fspath(p):
      digest = known['digest']
    else:
      try:
        digest = 'sha256:' + checksums.digest(p)
      except FileNotFoundError:
        raise DataError(f'{p}: no such file') from None
  return {'path': os.fspath(p), 'size': size, 'stamp': stamp, 'digest': digest}


def stream(p: str) -> Iterator[tuple[str, Any]]:
  """(where, row) of every row of shard `p`, read front to back (no index, no cache)."""
  kind = _kind(p)
  if kind in ('jsonl', 'gzip', 'zstd'):
    with _open(p) as f:
      for n, raw in enumerate(_lines(_plain_chunks(p, kind, f)), 1):
        if raw.strip():
          yield f'{p}:{n}', parse_json_line(f'{p}:{n}', raw)
  elif kind == 'parquet':
    src = _ParquetShard(p)
    for g in range(src.num_row_groups):
      for i, row in enumerate(src.row_group(g)):
        yield f'{p} row {src.starts[g] + i + 1}', row
  else:
    src = _ArrayRecordShard(p, None)
    for i in range(len(src)):
      yield src[i]


class _JsonlShard:
  """Rows of a JSONL file by position, through a cached line-offset index."""

  def __init__(self, shown: str, local_or_remote: str, idx_path: str,
               shared_idx: str | None = None):
    self.shown, self.file = shown, local_or_remote
    if not os.path.exists(idx_path):
      if shared_idx is not None and paths.exists(shared_idx):
        paths.copy_file(shared_idx, idx_path)      # another process built it
      else:
        _atomic_save(idx_path, self._build_index())
    self.index = np.load(idx_path, mmap_mode='r')
    self._f = None

  def _build_index(self) -> np.ndarray:
    starts, ends, nums = [], [], []
    pos, line_no, line_start = 0, 1, 0
    with _open(self.file) as f:
      for chunk in _chunks(f):
        nl = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + pos
        s = np.concatenate([[line_start], nl[:-1] + 1]) if len(nl) else np.zeros(0, np.int64)
        starts.append(s)
        ends.append(nl)
        nums.append(np.arange(line_no, line_no + len(nl)))
        line_no += len(nl)
        if len(nl):
          line_start = int(nl[-1]) + 1
        pos += len(chunk)
    if pos > line_start:                       # a last line without a newline
      starts.append(np.array([line_start]))
      ends.append(np.array([pos]))
      nums.append(np.array([line_no]))
    if not starts:
      return np.zeros((0, 3), np.int64)
    idx = np.stack([np.concatenate(starts), np.concatenate(ends), np.concatenate(nums)],
                   axis=1).astype(np.int64)
    # Short lines may be blank (whitespace only): those are not rows.
    short = np.flatnonzero(idx[:, 1] - idx[:, 0] <= 64)
    if len(short):
      keep = np.ones(len(idx), bool)
      with _open(self.file) as f:
        for i in short:
          f.seek(int(idx[i, 0]))
          if not f.read(int(idx[i, 1] - idx[i, 0])).strip():
            keep[i] = False
      idx = idx[keep]
    return idx

  def __len__(self) -> int:
    return len(self.index)

  def __getitem__(self, i: int) -> tuple[str, Any]:
    start, end, line = (int(x) for x in self.index[i])
    if self._f is None:
      self._f = _open(self.file)
    self._f.seek(start)
    where = f'{self.shown}:{line}'
    return where, parse_json_line(where, self._f.read(end - start))

  def __getstate__(self):
    return {**self.__dict__, '_f': None}


def _atomic_save(path: str, arr: np.ndarray) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f'{path}.{os.getpid()}.tmp.npy'
  np.save(tmp, arr)
  os.replace(tmp, path)


def _decompressed(p: str, kind: str, out: str, also: str | None = None) -> str:
  """A plain copy `out` of compressed shard `p` (made once, streaming); with `also` (a gs://
  object), the same bytes are uploaded there as they are decompressed (not read back)."""
  if not os.path.exists(out):
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f'{out}.{os.getpid()}.tmp'
    upload = None
    try:
      if also is not None:
        try:
          upload = paths.path(also).open('wb')
        except Exception as e:  # pylint: disable=broad-except
          raise DataError(f'{p}: cannot share its plain copy at {also} ({type(e).__name__}: '
                          f'{e})') from None
      with _open(p) as f, open(tmp, 'wb') as w:
        for chunk in _plain_chunks(p, kind, f):
          w.write(chunk)
          if upload is not None:
            upload.write(chunk)
      if upload is not None:
        upload, u = None, upload
        u.close()                   # the object appears whole, or not at all
      os.replace(tmp, out)
    finally:
      if upload is not None:
        upload.discard()            # a failed decompression leaves no partial object
      if os.path.exists(tmp):
        os.remove(tmp)
  return out


class _ParquetShard:
  """Rows of a Parquet file by position, decoded one row group at a time (two kept)."""

  def __init__(self, p: str):
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    self.path = p
    self._f = _open(p)
    try:
      self._pf = pq.ParquetFile(self._f)
    except Exception as e:  # pylint: disable=broad-except
      size = paths.path(p).stat().length
      raise DataError(f'{p}: not a readable Parquet file: its footer (byte offset '
                       f'{max(size - 8, 0)}) is damaged ({type(e).__name__}: {e})') from None
    md = self._pf.metadata
    self.num_row_groups = md.num_row_groups
    counts = [md.row_group(g).num_rows for g in range(self.num_row_groups)]
    self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    self._cache: collections.OrderedDict = collections.OrderedDict()

  def row_group(self, g: int) -> list:
    if g in self._cache:
      self._cache.move_to_end(g)
      return self._cache[g]
    try:
      rows = self._pf.read_row_group(g).to_pylist()
    except Exception as e:  # pylint: disable=broad-except
      col = self._pf.metadata.row_group(g).column(0)
      off = col.dictionary_page_offset or col.data_page_offset
      raise DataError(f'{self.path}: row group {g} (byte offset {off}) is unreadable '
                       f'({type(e).__name__}: {e})') from None
    self._cache[g] = rows
    if len(self._cache) > 2:
      self._cache.popitem(last=False)
    return rows

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, i: int) -> tuple[str, Any]:
    g = bisect.bisect_right(self.starts, i) - 1
    return f'{self.path} row {i + 1}', self.row_group(g)[i - int(self.starts[g])]

  def __getstate__(self):
    raise TypeError('a Parquet shard is read in the process that opened it')


class _ArrayRecordShard:
  """Rows of an ArrayRecord file by position; each record is a JSON object in UTF-8 (or, with
  `decode`, whatever decode(bytes) makes of it)."""

  def __init__(self, p: str, cache_dir: str | None, decode=None):
    self._decode = decode
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    self.path, local = p, p
    if paths.is_remote(p):
      if cache_dir is None:
        cache_dir = default_cache_dir()
      local = os.path.join(cache_dir, 'copies', f'{_stat_key(p)}.arrayrecord')
      if not os.path.exists(local):
        os.makedirs(os.path.dirname(local), exist_ok=True)
        paths.path(p).copy(local + '.tmp', overwrite=True)
        os.replace(local + '.tmp', local)
    try:
      self._r = array_record_module.ArrayRecordReader(local, 'readahead_buffer_size:0')
      ok = self._r.ok()
    except RuntimeError as e:
      raise DataError(f'{p}: corrupt ArrayRecord file{_at_byte(e)} ({e})') from None
    if not ok or (self._r.num_records() == 0 and os.path.getsize(local) > 0):
      raise DataError(f'{p}: not an ArrayRecord file (no readable footer at the end, byte '
                       f'offset {max(os.path.getsize(local) - 1, 0)})')
    self._n = self._r.num_records()

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, i: int) -> tuple[str, Any]:
    where = f'{self.path} record {i + 1}'
    try:
      [raw] = self._r.read([i])
    except RuntimeError as e:
      raise DataError(f'{self.path}: corrupt ArrayRecord data{_at_byte(e)} reading record '
                       f'{i + 1} ({e})') from None
    if self._decode is not None:
      return self._decode(raw)
    return where, parse_json_line(where, raw)

  def __getstate__(self):
    raise TypeError('an ArrayRecord shard is read in the process that opened it')


def _at_byte(e: Exception) -> str:
  m = re.search(r'at byte (\d+)', str(e))
  return f' at byte offset {m.group(1)}' if m else ''


def open_arrayrecord(p: str, decode, cache_dir: str | None = None):
  """An ArrayRecord file by position, `[i]` -> decode(record bytes) (gs:// copied to the
  local cache first)."""
  return _ArrayRecordShard(p, _local_cache(cache_dir), decode)


def _local_cache(cache_dir: str | None) -> str:
  if not cache_dir or paths.is_remote(cache_dir):
    return default_cache_dir()      # indexes are memory-mapped: they stay on local disk
  return cache_dir


def open_shard(p: str, cache_dir: str | None = None, shared_dir: str | None = None):
  """A random-access reader of one shard: `len()` rows, `[i]` -> (where, row).

  Args:
    p: the shard.
    cache_dir: the local cache (indexes, decompressed copies, copies of gs:// ArrayRecord
      shards); a gs:// or empty one means `default_cache_dir()`.
    shared_dir: a cache every process of a run sees (local or gs://), where `open_shards`
      publishes what one process built for the others: a shard's index found there is
      copied to `cache_dir` instead of being built, and a compressed shard's plain copy
      found there is read in place instead of decompressing the shard.
  """
  cache_dir = _local_cache(cache_dir)
  kind = _kind(p)
  if kind in ('parquet', 'arrayrecord'):
    return _ParquetShard(p) if kind == 'parquet' else _ArrayRecordShard(p, cache_dir)
  key = _stat_key(p)
  idx = os.path.join(cache_dir, 'index', f'{key}.npy')
  shared = _shared_paths(shared_dir, key, cache_dir)
  if kind == 'jsonl':
    return _JsonlShard(p, p, idx, shared and shared[0])
  plain = os.path.join(cache_dir, 'plain', f'{key}.jsonl')
  if not os.path.exists(plain) and shared and paths.exists(shared[1]):
    plain = shared[1]                 # another process's copy: rows are read from it
  elif not os.path.exists(plain) and shared and not paths.is_remote(shared[1]):
    plain = _decompressed(p, kind, shared[1])     # a shared disk: the one copy, read by all
  else:
    # A gs:// shared cache gets the plain copy as it is made (one pass, nothing read back).
    _decompressed(p, kind, plain, shared and paths.is_remote(shared[1]) and shared[1] or None)
  return _JsonlShard(p, plain, idx, shared and shared[0])


def _shared_paths(shared_dir: str | None, key: str, cache_dir: str) -> tuple[str, str] | None:
  """(index, plain copy) of shard `key` in `shared_dir`; None when there is no shared cache
  or it is the local cache itself."""
  if not shared_dir or _same_dir(shared_dir, cache_dir):
    return None
  return (paths.join(shared_dir, 'index', f'{key}.npy'),
          paths.join(shared_dir, 'plain', f'{key}.jsonl'))


def _same_dir(a: str, b: str) -> bool:
  if paths.is_remote(a) or paths.is_remote(b):
    return os.fspath(a).rstrip('/') == os.fspath(b).rstrip('/')
  return os.path.realpath(a) == os.path.realpath(b)


def _publish(p: str, shard, cache_dir: str, shared_dir: str | None) -> None:
  """Copies what opening shard `p` built locally (its index and, for a compressed shard, its
  plain copy) to the shared cache, where the run's other processes find them."""
  if not isinstance(shard, _JsonlShard):
    return
  key = _stat_key(p)
  shared = _shared_paths(shared_dir, key, _local_cache(cache_dir))
  if shared is None:
    return
  local_idx = os.path.join(_local_cache(cache_dir), 'index', f'{key}.npy')
  try:
    if not paths.exists(shared[0]):
      paths.copy_file(local_idx, shared[0])
    if shard.file != p and shard.file != shared[1] and not paths.exists(shared[1]):
      paths.copy_file(shard.file, shared[1])
  except paths.PathError as e:
    raise DataError(f'{p}: cannot share its index in {shared_dir} ({e})') from None


class _Opened:
  """A shard another process opened first: its row count is known; it is opened here on the
  first read of one of its rows (from the shared cache's index and plain copy, if there)."""

  def __init__(self, p: str, rows: int, cache_dir: str | None, shared_dir: str | None):
    self.p, self.rows, self.cache_dir, self.shared_dir = p, rows, cache_dir, shared_dir
    self._shard = None

  def open(self):
    if self._shard is None:
      s = open_shard(self.p, self.cache_dir, self.shared_dir)
      if len(s) != self.rows:
        raise DataError(f'{self.p}: holds {len(s)} rows here but {self.rows} in the process '
                        'that indexed it (it changed while the run opened it, or the hosts '
                        'see different files)')
      self._shard = s
    return self._shard

  def __len__(self) -> int:
    return self.rows

  def __getitem__(self, i: int) -> tuple[str, Any]:
    return self.open()[i]

  def __getstate__(self):
    return {**self.__dict__, '_shard': None}


def deal(sizes: Sequence[int], count: int) -> list[list[int]]:
  """Shards dealt to `count` processes by size, so that each opens about as many bytes.

  Largest first, each shard to the process with the fewest bytes so far (ties: the
  one with fewer shards, then the lower index; equal sizes go in listing order). A
  function of `sizes` alone: processes that see the same listing deal alike. No
  process gets more than the least-loaded one plus the largest shard.

  Args:
    sizes: each shard's size in bytes, in listing order.
    count: the number of processes.

  Returns:
    Per process, the indexes of its shards, ascending.
  """
  heap = [(0, 0, h) for h in range(count)]          # (bytes, shards, process)
  out: list[list[int]] = [[] for _ in range(count)]
  for j in sorted(range(len(sizes)), key=lambda j: (-int(sizes[j]), j)):
    load, n, h = heapq.heappop(heap)
    out[h].append(j)
    heapq.heappush(heap, (load + int(sizes[j]), n + 1, h))
  return [sorted(o) for o in out]


def _size(p: str) -> int:
  try:
    return int(paths.path(p).stat().length)
  except FileNotFoundError:
    raise DataError(f'{p}: no such file') from None


def open_shards(files: Sequence[str], cache_dir: str | None = None,
                shared_dir: str | None = None, hosts=None) -> list:
  """Random-access readers of `files`, the work of opening them split across processes.

  With one process (hosts None or of count 1) every shard is opened here, as by
  `open_shard`. With P processes, the shards are dealt by file size (`deal`), and
  each process opens (indexes, decompresses) its own shards only and publishes their
  indexes and plain copies to `shared_dir`; one exchange (a collective, which is also
  the barrier) then gives every process every shard's row count. A shard opened
  elsewhere is opened here only when one of its rows is first read, from the shared
  index (copied to the local cache, memory-mapped) and the shared plain copy: nothing
  of it is streamed here. Without a shared cache that every process sees, such a
  shard is indexed here on first read (correct, not cheaper).

  Args:
    files: the shards, in order.
    cache_dir: the local cache (see `open_shard`).
    shared_dir: the cache every process sees (local or gs://); may be `cache_dir`.
    hosts: (index, count, exchange(bytes) -> [bytes of each process]), e.g.
      `cascade.rollout.processes()`; every process must call this with the same files.

  Raises:
    DataError: a shard's error (the first shard's, in order, whichever process met it),
      raised on every process alike; processes that saw different shard sizes (so
      dealt them differently).
  """
  files = list(files)
  if hosts is None or hosts.count == 1:
    return [open_shard(p, cache_dir) for p in files]
  mine, rows, error, seen = {}, {}, None, None
  try:
    sizes = [_size(p) for p in files]
    seen = hashlib.sha256(json.dumps(sizes).encode()).hexdigest()
    share = deal(sizes, hosts.count)[hosts.index]
  except DataError as e:
    error, share = [-1, str(e)], []
  except (paths.PathError, OSError) as e:       # told to every process: none waits alone
    error, share = [-1, f'{files[0]}: cannot list the shards here ({type(e).__name__}: '
                        f'{e})'], []
  for j in share:
    try:
      mine[j] = open_shard(files[j], cache_dir, shared_dir)
      _publish(files[j], mine[j], cache_dir, shared_dir)
      rows[j] = len(mine[j])
    except DataError as e:
      error = [j, str(e)]
      break
    except (paths.PathError, OSError) as e:   # told to every process: none waits alone
      error = [j, f'{files[j]}: cannot open it here ({type(e).__name__}: {e})']
      break
  got = [json.loads(b) for b in hosts.exchange(json.dumps({
      'rows': rows, 'error': error, 'sizes': seen}).encode())]
  errors = sorted(g['error'] for g in got if g['error'])
  if errors:
    raise DataError(errors[0][1])
  if len({g['sizes'] for g in got}) > 1:
    raise DataError(f'{len(files)} shards from {files[0]}: the processes see different file '
                    'sizes (a shard changed while the run opened it, or the hosts see '
                    'different files), so they would deal the shards differently')
  counts = {int(j): n for g in got for j, n in g['rows'].items()}
  return [mine[j] if j in mine else _Opened(p, counts[j], cache_dir, shared_dir)
          for j, p in enumerate(files)]


class Source:
  """The rows of several shards, in shard order, by global position (grain's data-source
  protocol: `len()` and `[i]`).

  Args:
    shards: random-access readers (`open_shard`), in order.
  """

  def __init__(self, shards: Sequence):
    self.shards = list(shards)
    self.starts = np.concatenate([[0], np.cumsum([len(s) for s in self.shards])]).astype(
        np.int64)

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, i: int) -> tuple[str, Any]:
    i = int(i)
    if not 0 <= i < len(self):
      raise IndexError(f'row {i} of a source of {len(self)} rows')
    s = bisect.bisect_right(self.starts, i) - 1
    return self.shards[s][i - int(self.starts[s])]


def open_source(pattern: str, cache_dir: str | None = None, shared_dir: str | None = None,
                hosts=None) -> Source:
  """A `Source` over the shards `pattern` names (a file or a glob), each opened (and its index
  built or found in `cache_dir`) once, by one process of `hosts` (see `open_shards`)."""
  return Source(open_shards(expand(pattern), cache_dir, shared_dir, hosts))


def fingerprint(pattern: str) -> list:
  """[path, size, mtime] of every shard `pattern` names: what a cache built from them keys on."""
  out = []
  for p in expand(pattern):
    st = paths.path(p).stat()
    out.append([os.fspath(p), st.length, st.mtime])
  return out
