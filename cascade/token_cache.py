"""Tokenize once: a stage's data, tokenized and filtered, kept as ArrayRecord shards a run (and
every resume) reads instead of tokenizing.

A stage draws from a `cascade.data.Stream`: its datasets' records by position, each
turned into what the stage's batches take (`stage.tokenize`: an SFT example's tokens
and loss mask) and filtered (`stage.record_filter`, the stage's domains). Preparing
runs that once over every position, streaming (memory bounded by one record and the
ArrayRecord writer's buffer), and writes, per position:

  items  (stages that tokenize) one ArrayRecord record per position: the item's
         arrays (int32) or empty bytes for a position the stage skips; the stage
         then draws from these shards and tokenizes nothing.
  keep   (stages that only filter, e.g. RL prompts by their rendered length) one
         byte per position (keep.npy); the stage draws the records and reads their
         keep bit instead of tokenizing the prompt again.

Positions are the source's, so the seeded order and a checkpoint's data position mean
the same with and without the cache (a run may resume across it).

The cache directory is `<cache_dir>/<stage name>-<key>/` (local or gs://) with a
`manifest.json` written last (present = complete). The key hashes: this format's
version; the tokenizer's files (content); what the stage makes of the source's first
records (which changes with the chat template and the tokenizer's behaviour); the stage's
settings other than its optimizer and step count; each dataset's spec and the path, size
and modification time of each of its shards. A changed tokenizer, template, setting or
source file is a new key, so a stale cache is never read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

from cascade import data as data_lib
from cascade import shards
from models import paths

VERSION = 1
ROWS_PER_SHARD = 100_000
_PROBE = 8                    # first records of the source run through the stage in the key
_SETTINGS_NOT_IN_KEY = ('optimizer', 'steps', 'index', 'eval_every')


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
    except data_lib.DataError as e:
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
      'datasets': [{'spec': repr(s),
                    'files': shards.fingerprint(s.path) if s.path else s.tfds_name}
                   for s in specs],
  }
  return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=repr).encode()).hexdigest()


def directory(cache_dir: str, stage, k: str) -> str:
  return paths.join(cache_dir, f'{stage.name}-{k[:16]}')


def _manifest(d: str) -> dict | None:
  p = paths.join(d, 'manifest.json')
  return json.loads(paths.read_text(p)) if paths.exists(p) else None


def prepare(d: str, source, make: Callable[[int, Any], Any], tokenizes: bool, what: str,
            log: Callable[[str], None] = print) -> dict:
  """Runs `make` over every position of `source` and writes the cache directory `d`.

  Args:
    d: the stage's cache directory (local or gs://).
    source: the stage's records by position (`[i]` may raise DataError).
    make: (position, record) -> the stage's item, or None to skip the position.
    tokenizes: items are tuples of int sequences (written as ArrayRecord shards);
      False: items are the records themselves (one keep byte each).
    what: who prepares (log lines).

  Returns:
    The manifest (rows, kept, malformed, seconds, rows_per_s, shards).
  """
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  n = len(source)
  remote = paths.is_remote(d)
  # A local cache is written beside its final name and renamed into place; a gs:// one is
  # written to local disk, then uploaded shard by shard, the manifest last.
  local = (tempfile.mkdtemp(prefix='cascade-prepare-') if remote
           else f'{d}.partial-{os.getpid()}')
  os.makedirs(local, exist_ok=True)
  t0 = time.time()
  kept = malformed = 0
  names, keep_bits = [], np.zeros(n, np.uint8)
  writer = None
  try:
    for i in range(n):
      if tokenizes and i % ROWS_PER_SHARD == 0:
        if writer is not None:
          writer.close()
        names.append(f'items-{len(names):05d}.arrayrecord')
        writer = array_record_module.ArrayRecordWriter(os.path.join(local, names[-1]),
                                                       'group_size:1')
      try:
        item = make(i, source[i])
      except data_lib.DataError as e:
        malformed += 1
        if malformed <= 5:
          log(f'WARNING: {what}: malformed record skipped: {e}')
        item = None
      if item is not None:
        kept += 1
        keep_bits[i] = 1
      if tokenizes:
        writer.write(b'' if item is None else encode(item))
      if (i + 1) % 100_000 == 0:
        log(f'{what}: prepared {i + 1} of {n} rows ({(i + 1) / (time.time() - t0):.0f} rows/s)')
    if writer is not None:
      writer.close()
    if not tokenizes:
      np.save(os.path.join(local, 'keep.npy'), keep_bits)
      names = ['keep.npy']
    seconds = time.time() - t0
    manifest = {'version': VERSION, 'rows': n, 'kept': kept, 'malformed': malformed,
                'items': tokenizes, 'shards': names, 'rows_per_shard': ROWS_PER_SHARD,
                'seconds': round(seconds, 3), 'rows_per_s': round(n / max(seconds, 1e-9), 1)}
    if remote:
      for name in names:
        paths.copy_file(os.path.join(local, name), paths.join(d, name))
      paths.write_json(paths.join(d, 'manifest.json'), manifest)
    else:
      paths.write_json(os.path.join(local, 'manifest.json'), manifest)
      try:
        os.replace(local, d)
      except OSError:       # another process finished the same cache first
        if _manifest(d) is None:
          raise
  finally:
    shutil.rmtree(local, ignore_errors=True)
  log(f'{what}: prepared {n} rows in {manifest["seconds"]:.1f} s ({manifest["rows_per_s"]:.0f} '
      f'rows/s): {kept} kept, {malformed} malformed, {n - kept - malformed} dropped; cache {d}')
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
           local_dir: str | None = None, log: Callable[[str], None] = print) -> data_lib.Stream:
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
    hosts: see `cascade.data.Stream`.
    local_dir: local directory for copies of gs:// shards.
  """
  k = key(stage, tokenizer, specs, source, make)
  d = directory(cache_dir, stage, k)
  manifest = _manifest(d)
  if manifest is None:
    manifest = prepare(d, source, make, tokenizes, stage.where, log)
  else:
    log(f'{stage.where}: data from the prepared cache {d} ({manifest["rows"]} rows, '
        f'{manifest["kept"]} kept)')
  if manifest['rows'] != len(source):
    raise data_lib.DataError(f'{d}: the cache holds {manifest["rows"]} rows; the stage\'s '
                             f'datasets hold {len(source)}')
  if not manifest['kept']:
    dropped = why or 'malformed records'
    raise data_lib.DataError(f'{stage.where}: no records left after dropping {dropped} (of '
                             f'{manifest["rows"]}; cache {d})')
  if tokenizes:
    return data_lib.Stream(Items(d, manifest, local_dir), None, why, stage.where, hosts)
  with paths.local_file(paths.join(d, 'keep.npy')) as f:
    bits = np.load(f)
  return data_lib.Stream(source, lambda i, rec: rec if bits[i] else None, why, stage.where,
                         hosts)
