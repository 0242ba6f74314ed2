"""Checksums of what a run saves: every checkpoint step and every HF export carries a manifest.

  checksums.seal(step_dir)            # after the files are final: writes step_dir/checksums.json
  why = checksums.verify(step_dir, required=True)    # '' when whole, else why not

The manifest names every file under the directory with its size and sha256. A
check compares sizes first (a truncated file costs one listing) and then
streams each file through sha256 in 16 MiB reads, so memory stays flat
whatever the file size. What it costs is reading the directory once more:
sha256 runs at about 1.2 GB/s per core here (hashlib with SHA-NI), so sealing
or checking a 1 GB checkpoint adds about a second, and a 14B model's full
training checkpoint (bf16 params, float32 master weights and Adam moments,
about 200 GB) a few minutes, plus the time to read it from storage.

Format-keeping damage is what this catches: bytes flipped inside a parameter
file, or an edited field (e.g. the data position) in a checkpoint's metadata,
restore without an error and would silently change the run. A directory
without a manifest (saved before manifests existed, with checksums off, or by a
run killed between finishing its files and sealing them) cannot be checked:
`verify(d, required=True)`, what checkpoint steps and exports are read with,
calls it unusable, since bytes flipped in it would go unnoticed.
"""

from __future__ import annotations

import hashlib
import json

from foundation import paths

MANIFEST = 'checksums.json'
_CHUNK = 1 << 24


class Mismatch(ValueError):
  """A directory's files differ from its manifest (the message names the first such file)."""


class Unsealed(Mismatch):
  """A directory that must be sealed has no manifest, so its bytes cannot be checked."""


def digest(path: str) -> str:
  """sha256 hex digest of a file, streamed."""
  h = hashlib.sha256()
  with paths.open_read(path) as f:
    for chunk in iter(lambda: f.read(_CHUNK), b''):
      h.update(chunk)
  return h.hexdigest()


def _size(path: str) -> int:
  with paths.open_read(path) as f:
    return f.seek(0, 2)


def seal(directory: str) -> None:
  """Writes `directory`/checksums.json: every file under it, its size and sha256."""
  files = {}
  for rel in sorted(paths.files_under(directory)):
    if rel != MANIFEST:
      p = paths.join(directory, rel)
      files[rel] = {'size': _size(p), 'sha256': digest(p)}
  paths.write_json(paths.join(directory, MANIFEST), {'algorithm': 'sha256', 'files': files})


def sealed(directory: str) -> bool:
  return paths.exists(paths.join(directory, MANIFEST))


def verify(directory: str, required: bool = False) -> str:
  """'' when `directory` matches its manifest, else why not (one line).

  Args:
    directory: a sealed directory.
    required: a directory without a manifest is unusable (True) or passes unchecked (False).
  """
  path = paths.join(directory, MANIFEST)
  if not paths.exists(path):
    return (f'{MANIFEST} is missing: it was never sealed (a run stopped between writing it '
            'and sealing it, or saved it with config.ckpt.checksums=False), so it cannot be '
            'checked') if required else ''
  try:
    files = json.loads(paths.read_text(path))['files']
  except (ValueError, KeyError, TypeError, UnicodeDecodeError):
    return f'{MANIFEST} is unreadable'
  for rel, want in files.items():
    p = paths.join(directory, rel)
    if not paths.exists(p):
      return f'{rel} is missing'
    size = _size(p)
    if size != want['size']:
      return f'{rel} has {size} bytes, {want["size"]} were saved'
  for rel, want in files.items():
    if digest(paths.join(directory, rel)) != want['sha256']:
      return f'{rel} differs from what was saved (sha256)'
  return ''


def check(directory: str, required: bool = False) -> None:
  """Raises Mismatch (naming the file) when `directory` differs from its manifest, or, when
  `required`, has none (Unsealed)."""
  if required and not sealed(directory):
    raise Unsealed(verify(directory, required=True))
  why = verify(directory)
  if why:
    raise Mismatch(f'checksum mismatch: {why}')
