"""Tokenize once: a stage's data, tokenized and filtered, kept as ArrayRecord shards a run (and
every resume) reads instead of tokenizing.

A stage draws from a `cascade.data.readers.Stream`: its datasets' records by position, each
turned into what the stage's batches take (`stage.tokenize`: an SFT example's tokens
and loss mask) and filtered (`stage.record_filter`, the stage's domains). Preparing
runs that once over every position, streaming (memory bounded by one record and the
ArrayRecord writer's buffer), and writes, per position:

  items  (stages that tokenize) one ArrayRecord record per position, in shards of
         ROWS_PER_SHARD positions (`items-<k>.arrayrecord`): the item's arrays
         (int32) or empty bytes for a position the stage skips; the stage then
         draws from these shards and tokenizes nothing.
  keep   (stages that only filter, e.g. RL prompts by their rendered length) one
         byte per position (keep.npy); the stage draws the records and reads their
         keep bit instead of tokenizing the prompt again.

Positions are the source's, so the seeded order and a checkpoint's data position mean
the same with and without the cache (a run may resume across it).

Several processes (the run's hosts) split the preparing: each makes a contiguous run
of the parts (one items shard each) and writes their shards; one exchange, the
barrier, gathers the counts and keep bits; process 0 then commits (`prepare`). The
files are the same, byte for byte, as one process writes.

The cache directory is `<cache_dir>/<stage name>-<key>/` (local or gs://) with a
`manifest.json` written last (present = complete; a directory without one, left by a
preparation that stopped, is prepared again). The key hashes: this format's
version; the tokenizer's files (content); what the stage makes of the source's first
records (which changes with the chat template and the tokenizer's behaviour); the stage's
settings other than its optimizer and step count; each dataset's spec (`spelling`) and the
path, size and modification time of each of its shards. A changed tokenizer, template, setting or
source file is a new key, so a stale cache is never read.

A preparation that stopped is resumed, not redone: each finished part leaves a record
(`parts/<k>.json`: the full key, the part's index and rows, its shard's size and sha256,
its keep bits and malformed count), and the next preparation, on any number of
processes, reuses every part whose record matches and whose shard is intact, and makes
only the others (missing, torn, or recorded under another key). The commit removes the
records.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

from cascade.data import readers
from cascade.data import shards
from foundation import paths

VERSION = 2
ROWS_PER_SHARD = 8192      # positions per items shard, the unit of work processes split
_CHUNK = 256                  # positions made in one call of a stage's batch `make`
_PROBE = 8                    # first records of the source run through the stage in the key
_PARTS = 'parts'              # finished parts' records (`_record`), read on a resume
_SETTINGS_NOT_IN_KEY = ('optimizer', 'steps', 'index', 'seed_key', 'eval_every')
# Failures of a process's share raised as one DataError on every process; any other exception
# is raised as it is on the process that met it (the others raise the DataError naming it).
_REPORTED = (readers.DataError, paths.PathError, OSError)


def encode(item: Sequence) -> bytes:
  """An item (a tuple of integer sequences, e.g. tokens and loss mask) as bytes."""
  arrays = [np.asarray(a, np.int32) for a in item]
  head = np.asarray([len(arrays)] + [len(a) for a in arrays], np.uint32).tobytes()
  return head + b''.join(a.tobytes() for a in arrays)


def decode(raw: bytes):
  """`encode`'s inverse: a tuple of int32 arrays; None for empty bytes (a skipped position)."""
  if not raw:
    return None
  k = int(np.frombuffer(raw, np.uint32, 1)[0])
  lens = np.frombuffer(raw, np.uint32, k, 4)
  out, off = [], 4 * (k + 1)
  for n in lens:
    out.append(np.frombuffer(raw, np.int32, int(n), off))
    off += 4 * int(n)
  return tuple(out)


# How a dataset spec is spelled in the key (`spelling`): (spelled name, attribute of
# `cascade.config.Dataset`), in this order. The spelling is frozen: it is what `repr` of the
# Dataset dataclass printed when the cache was introduced (its config field `tfds` was then the
# attribute `tfds_name`), so caches prepared before stay valid whatever the class becomes.
# `record_type` and `domains` follow from `format` (and `domain`); they are spelled because the
# first keys spelled them.
_SPEC_SPELLING = (('name', 'name'), ('format', 'format'), ('record_type', 'record_type'),
                  ('path', 'path'), ('tfds_name', 'tfds'), ('split', 'split'),
                  ('data_dir', 'data_dir'), ('domain', 'domain'), ('limit', 'limit'),
                  ('skip', 'skip'), ('domains', 'domains'))


def spelling(spec) -> str:
  """A dataset spec (`cascade.config.Dataset`) as the cache key spells it: every field that says
  which records are read and what they are, each value as `repr` writes it, e.g.
  "Dataset(name='sft', format='sft', record_type='sft', path='/d/sft.jsonl', tfds_name='',
  split='train', data_dir='', domain='', limit=0, skip=0, domains=None)". Stable across changes
  of the config class (`_SPEC_SPELLING`); a new field that changes what is read must be added
  there, which changes every key."""
  fields = ', '.join(f'{spelled}={getattr(spec, attr)!r}' for spelled, attr in _SPEC_SPELLING)
  return f'Dataset({fields})'


def _tokenizer_digest(tokenizer) -> str:
  h = hashlib.sha256(type(tokenizer).__name__.encode())
  p = getattr(tokenizer, 'path', None)
  if p is not None:
    for f in (paths.path(p), paths.path(p).parent / 'tokenizer_config.json'):
      if f.exists():
        h.update(f.name.encode())
        h.update(f.read_bytes())
  return h.hexdigest()


def _settings(stage) -> dict:
  return {f.name: repr(getattr(stage, f.name)) for f in dataclasses.fields(stage)
          if f.name not in _SETTINGS_NOT_IN_KEY}


def _probe(source, make: Callable[[int, Any], Any]) -> list:
  """What the stage makes of the source's first records (tokens and all)."""
  out = []
  for i in range(min(_PROBE, len(source))):
    try:
      item = make(i, source[i])
    except readers.DataError as e:
      item = str(e)
    out.append(item if item is None or isinstance(item, str)
               else encode(item).hex() if isinstance(item, tuple) else True)
  return out


def key(stage, tokenizer, specs: Sequence, source, make: Callable[[int, Any], Any]) -> str:
  """The cache key of a stage's prepared data (see the module docstring)."""
  inputs = {
      'version': VERSION,
      'tokenizer': _tokenizer_digest(tokenizer),
      'probe': _probe(source, make),
      'stage': {'kind': stage.kind, **_settings(stage)},
      'datasets': [{'spec': spelling(s),
                    'files': shards.fingerprint(s.path) if s.path else s.tfds}
                   for s in specs],
  }
  return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=repr).encode()).hexdigest()


def directory(cache_dir: str, stage, k: str) -> str:
  return paths.join(cache_dir, f'{stage.name}-{k[:16]}')


def _manifest(d: str) -> dict | None:
  p = paths.join(d, 'manifest.json')
  return json.loads(paths.read_text(p)) if paths.exists(p) else None


def parts(n: int) -> list[range]:
  """The positions of each part of an n-row cache: ROWS_PER_SHARD each (the last fewer). A
  part is one items shard, and the unit of work processes split; the layout depends on n
  alone, so every number of processes writes the same files."""
  return [range(a, min(a + ROWS_PER_SHARD, n)) for a in range(0, n, ROWS_PER_SHARD)]


def share(num_parts: int, count: int, index: int) -> range:
  """Process `index` of `count`'s parts: a contiguous run, the runs as equal as can be (the
  rows of a run lie in few of the source's shards)."""
  return range(index * num_parts // count, (index + 1) * num_parts // count)


def _shard_name(k: int) -> str:
  return f'items-{k:05d}.arrayrecord'


def _record_path(d: str, k: int) -> str:
  return paths.join(d, _PARTS, f'{k:05d}.json')


def _digest(p) -> tuple[int, str]:
  """The size and sha256 of file `p` (local or gs://), read in chunks."""
  h, size = hashlib.sha256(), 0
  with paths.open_read(p) as f:
    while chunk := f.read(1 << 22):
      h.update(chunk)
      size += len(chunk)
  return size, h.hexdigest()


def _record(key: str, k: int, rows: range, tokenizes: bool) -> dict:
  """What a part's record must say for the part to be reused (its shard's size and digest, keep
  bits and malformed count come beside it)."""
  return {'version': VERSION, 'key': key, 'part': k, 'rows': [rows.start, rows.stop],
          'items': tokenizes}


def _finished(d: str, k: int, rows: range, tokenizes: bool, key: str, what: str,
              log) -> tuple[np.ndarray, int] | None:
  """Part k as an earlier preparation finished it, if its record says it was made for this
  cache (key, rows, format) and its shard still has the recorded size and sha256.

  Returns:
    (keep bits [len(rows)] uint8, malformed count), or None: the part must be made (no record,
    a record of another cache, a torn or changed shard, an unreadable record; each but the
    first logged, naming the file).
  """
  p = _record_path(d, k)
  try:
    if not paths.exists(p):
      return None
    rec = json.loads(paths.read_text(p))
    want = _record(key, k, rows, tokenizes)
    if {f: rec.get(f) for f in want} != want:
      log(f'{what}: {p} records part {k} of another cache (key, rows or format differ): '
          'it is made again')
      return None
    if tokenizes:
      shard = paths.join(d, _shard_name(k))
      size, digest = _digest(shard) if paths.exists(shard) else (None, None)
      if (size, digest) != (rec['bytes'], rec['sha256']):
        log(f'WARNING: {what}: {shard} is torn or changed ({size} bytes, sha256 '
            f'{(digest or "-")[:16]}; its record {p} says {rec["bytes"]} bytes, sha256 '
            f'{rec["sha256"][:16]}): it is made again')
        return None
    bits = np.unpackbits(np.frombuffer(base64.b64decode(rec['keep']), np.uint8),
                         count=len(rows))
    return bits, int(rec['malformed'])
  except (ValueError, KeyError, TypeError, OSError) as e:   # PathError is a ValueError
    log(f'WARNING: {what}: the record {p} of part {k} is unreadable ({type(e).__name__}: '
        f'{e}): the part is made again')
    return None


def _part(d: str, k: int, rows: range, source, make, tokenizes: bool, what: str, log,
          counts: dict, key: str) -> tuple[np.ndarray, bool]:
  """Part k: reused if an earlier preparation finished it (`_finished`), else made
  (`_make_part`). Returns its keep bits and whether it was reused; counts grow either way."""
  done = _finished(d, k, rows, tokenizes, key, what, log)
  if done is None:
    return _make_part(d, k, rows, source, make, tokenizes, what, log, counts, key), False
  bits, malformed = done
  counts['kept'] += int(bits.sum())
  counts['malformed'] += malformed
  return bits, True


def _malformed(e: Exception, what: str, log, counts: dict) -> None:
  counts['malformed'] += 1
  if counts['malformed'] <= 5:
    log(f'WARNING: {what}: malformed record skipped: {e}')


def _make_chunk(rows: range, source, make, what: str, log, counts: dict) -> list:
  """`make(i, source[i])` for each position of `rows`, None for a malformed record (counted
  and logged). Where `make` has a `batch` (records -> items, e.g. the tokenizer library's
  batch encode on all cores), the records read go through it in one call, the same items;
  a chunk in which it meets a malformed record is made again row by row."""
  batch = getattr(make, 'batch', None)
  if batch is None:
    return [_make_one(i, source, make, what, log, counts) for i in rows]
  recs, good = [None] * len(rows), []
  for j, i in enumerate(rows):
    try:
      recs[j] = source[i]
      good.append(j)
    except readers.DataError as e:
      _malformed(e, what, log, counts)
  try:
    made = batch([recs[j] for j in good])
  except readers.DataError:
    return [None if recs[j] is None else _make_one(i, source, make, what, log, counts)
            for j, i in enumerate(rows)]
  out = [None] * len(rows)
  for j, item in zip(good, made):
    out[j] = item
  return out


def _make_one(i: int, source, make, what: str, log, counts: dict):
  try:
    return make(i, source[i])
  except readers.DataError as e:
    _malformed(e, what, log, counts)
    return None


def _make_part(d: str, k: int, rows: range, source, make, tokenizes: bool, what: str,
               log, counts: dict, key: str) -> np.ndarray:
  """Runs `make` over the positions `rows` of part k, streaming (tokenizing stages) its items
  into its shard `items-<k>.arrayrecord` in `d`, which appears whole (local: a temporary
  name renamed into place; gs://: written locally, then uploaded as one object). Then writes
  the part's record (`parts/<k>.json`, also whole): a part without one is made again.

  Returns:
    The part's keep bits ([len(rows)] uint8); counts['kept'], counts['malformed'] and
    counts['made'] (rows run through `make`) grow.
  """
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  bits = np.zeros(len(rows), np.uint8)
  name = _shard_name(k)
  remote = paths.is_remote(d)
  malformed = counts['malformed']
  size = digest = None
  tmp_dir = tmp = writer = None
  try:
    if tokenizes:
      tmp_dir = tempfile.mkdtemp(prefix='cascade-part-') if remote else d
      fd, tmp = tempfile.mkstemp(prefix=f'.{name}.', suffix='.tmp', dir=tmp_dir)
      os.close(fd)
      writer = array_record_module.ArrayRecordWriter(tmp, 'group_size:1')
    for start in range(0, len(rows), _CHUNK):
      chunk = rows[start:start + _CHUNK]
      for j, item in enumerate(_make_chunk(chunk, source, make, what, log, counts), start):
        if item is not None:
          bits[j] = 1
        if writer is not None:
          writer.write(b'' if item is None else encode(item))
    if writer is not None:
      writer, w = None, writer
      w.close()
      size, digest = _digest(tmp)
      if remote:
        paths.copy_file(tmp, paths.join(d, name))
      else:
        os.replace(tmp, os.path.join(d, name))
  finally:
    if writer is not None:
      writer.close()
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)
    if remote and tmp_dir is not None:
      shutil.rmtree(tmp_dir, ignore_errors=True)
  counts['kept'] += int(bits.sum())
  counts['made'] += len(rows)
  paths.write_json(_record_path(d, k), {
      **_record(key, k, rows, tokenizes), 'file': name if tokenizes else None, 'bytes': size,
      'sha256': digest, 'malformed': counts['malformed'] - malformed,
      'keep': base64.b64encode(np.packbits(bits).tobytes()).decode('ascii')})
  return bits


def prepare(d: str, source, make: Callable[[int, Any], Any], tokenizes: bool, what: str,
            log: Callable[[str], None] = print, hosts=None, key: str = '') -> dict:
  """Runs `make` over every position of `source` and writes the cache directory `d`.

  The positions are cut into parts (`parts`: one items shard each). With several
  processes, each makes a contiguous run of the parts (`share`) and writes their shards;
  one exchange (the barrier) gathers every process's counts and keep bits, or the first
  error, which every process then raises. Process 0 then writes `keep.npy` (stages that
  only filter) and, last, `manifest.json`: the commit. A second exchange carries a failed
  commit to every process. A process that does not see every part, or after the second
  exchange the manifest (a cache directory on its own disk, not shared), makes what it
  lacks and commits its own copy: correct, not cheaper. Until the manifest is written
  the directory is incomplete, and a run that finds it so prepares it again: a
  preparation that stopped part-way is never read, but the parts it finished are reused
  (`_finished`: each part's record names the key, the part and its rows, and its shard's
  size and sha256), whatever the number of processes then; only the others are made. The
  commit removes the records. The files are the same, byte for byte, whatever the number
  of processes and however often the preparation was stopped.

  Args:
    d: the stage's cache directory (local or gs://); every process must see the same one
      for the work to be shared.
    source: the stage's records by position (`[i]` may raise DataError).
    make: (position, record) -> the stage's item, or None to skip the position.
    tokenizes: items are tuples of int sequences (written as ArrayRecord shards);
      False: items are the records themselves (one keep byte each).
    what: who prepares (log lines).
    hosts: (index, count, exchange) of the processes sharing the work; None: one.
    key: the cache key (`key`), kept in each finished part's record: a part recorded under
      another key is made again, not reused.

  Returns:
    The manifest (rows, kept, malformed, seconds, rows_per_s: the rows made by this
    preparation, over its seconds, shards).

  Raises:
    DataError: a process could not read or write its share (every process raises it).
  """
  n = len(source)
  count, index = (1, 0) if hosts is None else (hosts.count, hosts.index)
  cuts = parts(n)
  mine = share(len(cuts), count, index)
  t0 = time.time()
  counts, bits, failure = {'kept': 0, 'malformed': 0, 'made': 0}, {}, None
  who = what if count == 1 else f'{what}: process {index}'
  reused = 0
  try:
    paths.makedirs(d)
    for k in mine:
      bits[k], was = _part(d, k, cuts[k], source, make, tokenizes, what, log, counts, key)
      reused += was
      done = cuts[k].stop - cuts[mine.start].start
      if done // 100_000 > (done - len(cuts[k])) // 100_000:
        log(f'{who}: prepared {done} of {n if count == 1 else "its"} rows '
            f'({counts["made"] / max(time.time() - t0, 1e-9):.0f} rows/s)')
  except Exception as e:  # pylint: disable=broad-except  (told to every process: none waits)
    failure = e
  if reused:
    log(f'{who}: {reused} of {"the" if count == 1 else "its"} {len(mine)} parts were finished '
        f'by an earlier preparation in {d}: reused, not made again')
  error = None if failure is None else (f'{what}: preparing {d} failed on process {index} '
                                        f'({type(failure).__name__}: {failure})')
  errors = [error] if error else []
  if count > 1:
    got = [pickle.loads(b) for b in hosts.exchange(pickle.dumps(
        {'counts': counts, 'bits': {k: np.packbits(b) for k, b in bits.items()},
         'error': error}))]
    errors = [g['error'] for g in got if g['error']]
    counts = {c: sum(g['counts'][c] for g in got) for c in counts}
    bits = {k: np.unpackbits(b, count=len(cuts[k])) for g in got for k, b in g['bits'].items()}
  if failure is not None and not isinstance(failure, _REPORTED):
    raise failure                 # a bug, not the data or storage: its own traceback, here
  if errors:
    raise readers.DataError(errors[0])
  names = ([f'items-{k:05d}.arrayrecord' for k in range(len(cuts))] if tokenizes
           else ['keep.npy'])
  seconds = time.time() - t0
  manifest = {'version': VERSION, 'rows': n, 'kept': counts['kept'],
              'malformed': counts['malformed'], 'items': tokenizes, 'shards': names,
              'rows_per_shard': ROWS_PER_SHARD, 'seconds': round(seconds, 3),
              'rows_per_s': round(counts['made'] / max(seconds, 1e-9), 1)}
  keep = np.concatenate([bits[k] for k in range(len(cuts))] or [np.zeros(0, np.uint8)])

  def commit():
    if not tokenizes:
      buf = io.BytesIO()
      np.save(buf, keep)
      paths.write_bytes(paths.join(d, 'keep.npy'), buf.getvalue())
    paths.write_json(paths.join(d, 'manifest.json'), manifest)      # last: the commit
    try:              # the parts' records: only a preparation that did not commit reads them
      paths.rmtree(paths.join(d, _PARTS))
    except (paths.PathError, OSError) as e:
      log(f'WARNING: {what}: could not remove {paths.join(d, _PARTS)} after the commit '
          f'({type(e).__name__}: {e}); it is left, and nothing reads it')

  # Every part is written (each appeared whole before the exchange).
  error = filled = None
  try:
    if count > 1 and tokenizes:
      have = set(paths.listdir(d))
      filled = [k for k, name in enumerate(names) if name not in have]
      if filled:
        log(f'WARNING: {what}: process {index} does not see {len(filled)} of the {len(names)} '
            f'parts the others wrote in {d} (not a directory every process sees): it makes '
            'them itself')
      for k in filled:
        _part(d, k, cuts[k], source, make, tokenizes, what, log,
              {'kept': 0, 'malformed': 0, 'made': 0}, key)
    if index == 0 or filled:
      commit()
  except (readers.DataError, paths.PathError, OSError) as e:
    error = f'{what}: committing {d} failed on process {index} ({type(e).__name__}: {e})'
  if count > 1:
    errors = [e for e in (pickle.loads(b) for b in hosts.exchange(pickle.dumps(error))) if e]
    if errors:
      raise readers.DataError(errors[0])
    if _manifest(d) is None:          # keep bits only, on a disk process 0 did not write
      commit()
  elif error:
    raise readers.DataError(error)
  kept = manifest['kept']
  made = '' if counts['made'] == n else f', {counts["made"]} of them made now, the rest reused'
  log(f'{what}: prepared {n} rows in {manifest["seconds"]:.1f} s ({manifest["rows_per_s"]:.0f} '
      f'rows/s{"" if count == 1 else f", {count} processes"}{made}): {kept} kept, '
      f'{manifest["malformed"]} malformed, {n - kept - manifest["malformed"]} dropped; cache {d}')
  return manifest


class Items:
  """A prepared stage's items by position (`len()`, `[i]` -> tuple of arrays or None)."""

  def __init__(self, d: str, manifest: dict, local_dir: str | None = None):
    self._shards = [shards.open_arrayrecord(paths.join(d, n), decode, local_dir)
                    for n in manifest['shards']]
    self._per = manifest['rows_per_shard']
    self._n = manifest['rows']

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, i: int):
    i = int(i)
    return self._shards[i // self._per][i % self._per]


def stream(cache_dir: str, stage, tokenizer, specs: Sequence, source,
           make: Callable[[int, Any], Any], tokenizes: bool, why: str, hosts=None,
           local_dir: str | None = None, log: Callable[[str], None] = print) -> readers.Stream:
  """The stage's `Stream` from its prepared cache, preparing it first if it is missing.

  Args:
    cache_dir: where caches live (local or gs://).
    stage: the stage's config.
    tokenizer: the run's tokenizer.
    specs: the stage's datasets (`cascade.config.Dataset`), in order.
    source: their records by position.
    make: (position, record) -> the stage's item or None (see `prepare`).
    tokenizes: whether items are tokenized (see `prepare`).
    why: what `make` drops (log lines).
    hosts: see `cascade.data.readers.Stream`; they also share the preparing (`prepare`), in
      which every process must take part.
    local_dir: local directory for copies of gs:// shards.
  """
  k = key(stage, tokenizer, specs, source, make)
  d = directory(cache_dir, stage, k)
  manifest = _manifest(d)
  if hosts is not None and hosts.count > 1:
    # Decided together: a process that alone prepared (or alone skipped) would wait forever
    # in `prepare`'s exchange. Any process not seeing the manifest makes all prepare.
    if not all(json.loads(b) for b in hosts.exchange(json.dumps(manifest is not None)
                                                     .encode())):
      manifest = None
  if manifest is None:
    manifest = prepare(d, source, make, tokenizes, stage.where, log, hosts, key=k)
  else:
    log(f'{stage.where}: data from the prepared cache {d} ({manifest["rows"]} rows, '
        f'{manifest["kept"]} kept)')
  if manifest['rows'] != len(source):
    raise readers.DataError(f'{d}: the cache holds {manifest["rows"]} rows; the stage\'s '
                             f'datasets hold {len(source)}')
  if not manifest['kept']:
    dropped = why or 'malformed records'
    raise readers.DataError(f'{stage.where}: no records left after dropping {dropped} (of '
                             f'{manifest["rows"]}; cache {d})')
  if tokenizes:
    return readers.Stream(Items(d, manifest, local_dir), None, why, stage.where, hosts)
  with paths.local_file(paths.join(d, 'keep.npy')) as f:
    bits = np.load(f)
  return readers.Stream(source, lambda i, rec: rec if bits[i] else None, why, stage.where,
                         hosts)
