"""One path layer for every file a run reads or writes: local paths and `gs://` alike.

  from foundation import paths
  paths.write_json(paths.join(workdir, 'progress.json'), {...})   # atomic, local or gs://
  rows = paths.read_text('gs://bucket/world/math/heldout.jsonl')
  with paths.local_file('gs://bucket/ckpt/model.safetensors') as f: ...   # for mmap readers

It sits in the bottom layer (foundation/ imports nothing else of the project), so the
model's HF import/export and tokenizers, the RL code, the verifiers, the environments
and the stage loop all read and write through the same functions.

Built on `etils.epath` (what Orbax uses), whose `gs://` backend is gcsfs
(`pip install -e '.[gcs]'`). Every function takes a `str` or any path-like;
the rest of the code passes paths around as plain strings.

Writes never leave half a file where a reader looks: a local file is written
to a temporary name, fsynced and renamed over the target; a `gs://` object is
written in one upload, which Cloud Storage makes visible only once complete
(an object store has no cheap rename, and needs none). Object stores cannot
append either: `AppendFile` rewrites the whole object when flushed.

Errors: an unknown scheme, a missing gcsfs, or a failing remote call raise
`PathError`, one line naming the path; local OSErrors pass through unchanged
(they name their file, and the entry point reports a full or read-only disk).

Pointing the clients at a Cloud Storage emulator (what tests/cascade/test_gcs.py
does): `STORAGE_EMULATOR_HOST=http://host:port` and `FSSPEC_GCS_TOKEN=anon` for
gcsfs, `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` (gcsfs would otherwise probe the
bucket type over gRPC, which emulators lack), and for Orbax's tensorstore
`TENSORSTORE_GCS_HTTP_URL=http://host:port` with `GOOGLE_AUTH_TOKEN_FOR_TESTING=x`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator

import fsspec
from etils import epath

# Schemes handled by epath's fsspec backend; anything else with '://' is refused.
REMOTE_SCHEMES = ('gs',)
_INSTALL_HINT = {'gs': "gs:// paths need gcsfs: pip install -e '.[gcs]'"}


# Objects appear from other writers (the other hosts, tensorstore under Orbax): gcsfs must ask the
# store, not answer from a listing it cached earlier.
fsspec.config.conf.setdefault('gcs', {}).setdefault('use_listings_cache', False)


class PathError(ValueError):
  """A path that cannot be used (unknown scheme, missing client) or a failed remote call."""


def scheme(p) -> str:
  """'gs' for `gs://b/x`, '' for a local path."""
  s = os.fspath(p)
  return s.split('://', 1)[0] if '://' in s else ''


def is_remote(p) -> bool:
  """Whether `p` lives on an object store (`gs://...`)."""
  return bool(scheme(p))


def path(p) -> epath.Path:
  """`p` as an `epath.Path` (pathlib's interface, for local and gs:// paths).

  Raises:
    PathError: a scheme other than gs://.
  """
  s = os.fspath(p)
  sch = scheme(s)
  if sch and sch not in REMOTE_SCHEMES:
    raise PathError(f'{s}: unsupported scheme {sch}:// (supported: local paths and '
                    + ', '.join(f'{x}://' for x in REMOTE_SCHEMES) + ')')
  return epath.Path(s)


def absolute(p) -> epath.Path:
  """`path(p)`, a local one made absolute (Orbax and tensorstore want that)."""
  return path(p) if is_remote(p) else epath.Path(os.path.abspath(os.fspath(p)))


def join(base, *parts: str) -> str:
  """`base/part/...` as a string; `gs://b` + 'x' -> 'gs://b/x'."""
  if is_remote(base):
    return os.fspath(epath.Path(os.fspath(base)).joinpath(*parts))
  return os.path.join(os.fspath(base), *parts)


def parent(p) -> str:
  """The directory holding `p` (`gs://b/x/y` -> `gs://b/x`)."""
  if is_remote(p):
    return os.fspath(epath.Path(os.fspath(p)).parent)
  return os.path.dirname(os.path.abspath(os.fspath(p)))


@contextlib.contextmanager
def _remote_errors(p, doing: str):
  """Turns a remote client's failure (or a missing client) into one PathError line."""
  if not is_remote(p):
    yield
    return
  try:
    yield
  except PathError:
    raise
  except FileNotFoundError:
    raise FileNotFoundError(2, 'no such file or object', os.fspath(p)) from None
  except ImportError as e:
    raise PathError(f'{os.fspath(p)}: cannot {doing}: '
                    f'{_INSTALL_HINT.get(scheme(p), e)}') from None
  except Exception as e:  # pylint: disable=broad-except
    why = (str(e).strip().splitlines() or [''])[0][:300]
    raise PathError(f'{os.fspath(p)}: cannot {doing}: {type(e).__name__}: {why}') from e


def exists(p) -> bool:
  with _remote_errors(p, 'check whether it exists'):
    return path(p).exists()


def isdir(p) -> bool:
  with _remote_errors(p, 'check whether it is a directory'):
    return path(p).is_dir()


def makedirs(p) -> None:
  """Creates directory `p` and its parents (a no-op on object stores, which have no directories
  beyond the names of their objects)."""
  if is_remote(p):
    path(p)   # checks the scheme
    return
  os.makedirs(p, exist_ok=True)


def listdir(p) -> list[str]:
  """Names (not paths) of the entries of directory `p`, sorted; [] when it does not exist."""
  with _remote_errors(p, 'list it'):
    d = path(p)
    if not d.is_dir():
      return []
    return sorted(c.name for c in d.iterdir())


def read_bytes(p) -> bytes:
  with _remote_errors(p, 'read it'):
    return path(p).read_bytes()


def read_text(p) -> str:
  return read_bytes(p).decode('utf-8')


def read_json(p, default: Any = None) -> Any:
  """The JSON object in `p`, or `default` when there is no such file."""
  if not exists(p):
    return default
  return json.loads(read_text(p))


def open_read(p):
  """A binary file object reading `p` (use it in a `with`)."""
  with _remote_errors(p, 'open it'):
    return path(p).open('rb')


def write_bytes(p, data: bytes) -> None:
  """Writes `data` to `p` so that no reader ever sees half of it.

  Local: a temporary file in the same directory, fsynced, renamed over `p`.
  gs://: one object upload (Cloud Storage shows an object only once complete).
  """
  s = os.fspath(p)
  if is_remote(s):
    _upload(s, io.BytesIO(data))
    return
  os.replace(_synced_temp(s, 'tmp', data), s)


def _synced_temp(s: str, tag: str, data: bytes) -> str:
  """`data` written and fsynced to a temporary file beside the local path `s`; its name."""
  os.makedirs(os.path.dirname(os.path.abspath(s)), exist_ok=True)
  tmp = f'{s}.{tag}.{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  return tmp


def write_text(p, text: str) -> None:
  write_bytes(p, text.encode('utf-8'))


def write_json(p, obj: Any) -> None:
  write_text(p, json.dumps(obj, indent=1, sort_keys=False) + '\n')


def create_new(p, data: bytes) -> bool:
  """Writes `data` to `p` only if nothing is there: True if this call created it, False if
  something already was.

  Local: the bytes go to a temporary file that is hard-linked to `p` (link refuses an existing
  name, so the check and the create are one step and a reader never sees half the content).
  gs://: one upload with the precondition `ifGenerationMatch=0` (Cloud Storage refuses it when
  the object exists); a store that ignores preconditions (the local emulator) is covered by a
  look before the upload, which leaves the moment between the two open.
  """
  s = os.fspath(p)
  if is_remote(s):
    with _remote_errors(s, 'create it'):
      if path(s).exists():
        return False
      fs, key = fsspec.core.url_to_fs(s)
      try:
        fs.pipe_file(key, data, mode='create')
      except FileExistsError:
        return False
      except FileNotFoundError:   # what the client says of a bucket that is not there
        raise _no_bucket(s, 'create it') from None
      return True
  tmp = _synced_temp(s, 'new', data)
  try:
    os.link(tmp, s)
  except FileExistsError:
    return False
  finally:
    os.remove(tmp)
  return True


def copy_file(src, dst) -> None:
  """Copies one file (either side local or remote); the copy appears whole at `dst`."""
  if is_remote(dst):
    with open_read(src) as f_in:
      _upload(dst, f_in)
    return
  os.makedirs(os.path.dirname(os.path.abspath(os.fspath(dst))), exist_ok=True)
  tmp = f'{os.fspath(dst)}.tmp.{os.getpid()}'
  with open_read(src) as f_in, open(tmp, 'wb') as f_out:
    shutil.copyfileobj(f_in, f_out, 1 << 24)
  os.replace(tmp, dst)


def _upload(p, src) -> None:
  """Writes the file object `src` to object `p` in one upload: the object appears only when the
  upload is finalised, and an error before that discards it (fsspec would otherwise finalise a
  partial upload on leaving a `with`)."""
  with _remote_errors(p, 'write it'):
    f = path(p).open('wb')
    try:
      shutil.copyfileobj(src, f, 1 << 24)
    except BaseException:
      f.discard()
      raise
    try:
      f.close()
    except FileNotFoundError:   # what the client says of a bucket that is not there
      raise _no_bucket(p, 'write it') from None


def _no_bucket(p, doing: str) -> PathError:
  """The one-line error of a write to a bucket that is not there (or not ours)."""
  bucket = os.fspath(p).split('://', 1)[1].split('/', 1)[0]
  return PathError(f'{os.fspath(p)}: cannot {doing}: no bucket {bucket!r} (or no access to it)')


def copy_tree(src, dst, last: tuple[str, ...] = ()) -> None:
  """Copies the files under directory `src` to `dst`, those named in `last` after the others.

  A reader that takes `dst/<last>` as the sign of a complete copy never sees a partial one.
  """
  for rel in sorted(files_under(src), key=lambda r: (r in last, r)):
    copy_file(join(src, rel), join(dst, rel))


def files_under(d, prefix: str = '') -> Iterator[str]:
  """Paths relative to `d` of the files under directory `d`."""
  for name in listdir(d):
    if isdir(join(d, name)):
      yield from files_under(join(d, name), os.path.join(prefix, name))
    else:
      yield os.path.join(prefix, name)


def remove(p) -> None:
  """Removes file `p`, if it exists."""
  if not is_remote(p):
    with contextlib.suppress(FileNotFoundError):
      os.remove(p)
    return
  with _remote_errors(p, 'remove it'):
    if path(p).exists():
      path(p).unlink()


def rmtree(p) -> None:
  """Removes `p` and everything under it, if it exists."""
  if not is_remote(p):
    shutil.rmtree(p, ignore_errors=True)
    return
  with _remote_errors(p, 'remove it'):
    if path(p).exists():
      path(p).rmtree()


def move_tree(src, dst) -> None:
  """Moves directory `src` to `dst` (an object store copies, then deletes the source)."""
  if not is_remote(src) and not is_remote(dst):
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(dst))), exist_ok=True)
    shutil.move(src, dst)
    return
  copy_tree(src, dst)
  rmtree(src)


@contextlib.contextmanager
def local_file(p) -> Iterator[str]:
  """A local filename holding `p`'s bytes, for libraries that read only local files (mmap).

  Local paths are yielded as they are; a remote file is downloaded to a
  temporary file that is removed when the block ends.
  """
  if not is_remote(p):
    yield os.fspath(p)
    return
  suffix = os.path.splitext(os.fspath(p))[1]
  fd, tmp = tempfile.mkstemp(prefix='cascade-', suffix=suffix)
  try:
    with os.fdopen(fd, 'wb') as f, open_read(p) as src:
      shutil.copyfileobj(src, f, 1 << 24)
    yield tmp
  finally:
    os.unlink(tmp)


@contextlib.contextmanager
def local_target(p) -> Iterator[str]:
  """A local filename for a library that writes only local files; what it wrote ends up at `p`.

  A local `p` is yielded as it is; for a remote one a temporary file, uploaded
  to `p` when the block ends without an error, then removed.
  """
  if not is_remote(p):
    yield os.fspath(p)
    return
  fd, tmp = tempfile.mkstemp(prefix='cascade-', suffix=os.path.splitext(os.fspath(p))[1])
  os.close(fd)
  try:
    yield tmp
    copy_file(tmp, p)
  finally:
    os.unlink(tmp)


class AppendFile:
  """A text file appended to line by line (metrics.jsonl).

  Local: an append-mode file, flushed after every write. Object stores cannot
  append, so on gs:// the whole text (what was there plus what was written)
  is uploaded again by `flush`: at most every `every_s` seconds unless
  `force`d, and on `close`. A file that does not end with a newline (a
  writer killed mid-line) gets one first, so the half line stays alone and
  cannot swallow the next record. `before_write`, when given, runs before
  each write that reaches storage (each local line, each upload) and may
  raise to refuse it (a run's workdir-lock check).
  """

  def __init__(self, p, every_s: float = 30.0, before_write: Callable[[], None] | None = None):
    self.path, self._every = os.fspath(p), every_s
    self._before_write = before_write
    self._remote = is_remote(self.path)
    if self._remote:
      self._buf = io.StringIO()
      old = read_text(self.path) if exists(self.path) else ''
      self._buf.write(old + ('\n' if old and not old.endswith('\n') else ''))
      self._dirty, self._last = False, time.monotonic()
    else:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      self._f = open(self.path, 'a+b')
      if self._f.tell():
        self._f.seek(-1, os.SEEK_END)
        if self._f.read(1) != b'\n':
          self._f.write(b'\n')
      self._f.close()
      self._f = open(self.path, 'a', encoding='utf-8')

  def write(self, text: str) -> None:
    if self._remote:
      self._buf.write(text)
      self._dirty = True
      self.flush()
    else:
      if self._before_write is not None:
        self._before_write()
      self._f.write(text)
      self._f.flush()

  def flush(self, force: bool = False) -> None:
    """Makes what was written durable (remote: when `every_s` passed, or `force`)."""
    if not self._remote or not self._dirty:
      return
    if force or time.monotonic() - self._last >= self._every:
      if self._before_write is not None:
        self._before_write()
      write_text(self.path, self._buf.getvalue())
      self._dirty, self._last = False, time.monotonic()

  def close(self, discard: bool = False) -> None:
    """Closes the file; with `discard`, what an object store has not yet received is dropped
    instead of uploaded (the local file already holds every line written)."""
    if self._remote:
      if not discard:
        self.flush(force=True)
    else:
      self._f.close()
