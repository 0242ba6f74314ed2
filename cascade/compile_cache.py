"""JAX's persistent compilation cache for a run, and a count of the programs it served.

  from cascade import compile_cache
  cache = compile_cache.enable(None, default=paths.join(workdir, 'compilation_cache'))
  print(cache.banner())          # compilation cache: DIR (12 programs stored; ...)
  mark = compile_cache.counts()
  ...                            # every jit compile looks in the cache first
  print(cache.since(mark).describe())   # 12 programs loaded, 3 compiled (1 written)

`enable` sets JAX's options before the run compiles anything:
`jax_compilation_cache_dir` (the directory: local, or gs:// through
etils.epath) and `jax_persistent_cache_min_compile_time_secs` (only
programs that took at least that long to compile are written). It leaves
`jax_persistent_cache_min_entry_size_bytes` at JAX's setting (0 by default: no
size limit). An option the run leaves None keeps JAX's own setting (its
`JAX_...` environment variable or `jax.config.update`); `enable('')` turns the
cache off even when JAX's setting names a directory, and
`JAX_ENABLE_COMPILATION_CACHE=false` turns it off too. `restore` gives JAX its
own settings back (a run calls it when it ends), so the runs of one process
(tests, notebooks) do not inherit each other's cache.

What JAX does with it (jax 0.10): every compile is keyed by the program's
StableHLO, the jaxlib version, the backend's platform and version, the XLA
flags, the compile options and the devices' topology, and looked up before
compiling; XLA:CPU executables are cached like TPU and GPU ones. A program that
uses host callbacks (`jax.debug.print`, `io_callback`) is never written. On
several hosts every process reads the cache and only process 0 writes it
(contention on object stores such as Cloud Storage), so the directory should be
one all hosts see: a gs:// workdir or a shared disk. On GPU, JAX also keeps
XLA's per-fusion autotuning results under the directory
(`jax_persistent_cache_enable_xla_caches`). The cache is trusted: whoever can
write to its directory can run code in the run's processes.

The counts come from JAX's monitoring events, with one listener per process:
`/jax/compilation_cache/compile_requests_use_cache` (a compile that looked in
the cache), `/jax/compilation_cache/cache_hits` (a program loaded from it) and
`/jax/compilation_cache/cache_misses` (a compiled program written to it).
A program jit already holds in memory is neither loaded nor compiled.

A program is loaded only when it lowers exactly as before. On a mesh, a resumed
stage's train step is (it is jitted with explicit shardings). Without one
(`config.mesh.shape=None`) it is compiled again: the restored state's arrays are
committed to their device, a fresh state's are not, and the two lower to
different programs.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from foundation import paths

_DIR = 'jax_compilation_cache_dir'
_MIN_SECS = 'jax_persistent_cache_min_compile_time_secs'

# JAX's monitoring events -> the `Counts` field each one adds to.
EVENTS = {
    '/jax/compilation_cache/compile_requests_use_cache': 'looked_up',
    '/jax/compilation_cache/cache_hits': 'loaded',
    '/jax/compilation_cache/cache_misses': 'written',
}
# JAX's LRU cache stores a program as '<key>-cache' in the directory.
_ENTRY_SUFFIX = '-cache'


@dataclasses.dataclass(frozen=True)
class Counts:
  """Compiles of this process that went through the cache (since the listener started, or the
  difference of two such counts).

  Attributes:
    looked_up: compiles that looked in the cache first.
    loaded: programs loaded from the cache (not compiled).
    written: compiled programs written to the cache.
  """
  looked_up: int = 0
  loaded: int = 0
  written: int = 0

  @property
  def compiled(self) -> int:
    """Programs compiled after the cache had none (written or not)."""
    return self.looked_up - self.loaded

  def minus(self, earlier: Counts) -> Counts:
    return Counts(*(getattr(self, f.name) - getattr(earlier, f.name)
                    for f in dataclasses.fields(self)))

  def describe(self) -> str:
    """'N programs loaded, M compiled (K written)'."""
    return f'{self.loaded} programs loaded, {self.compiled} compiled ({self.written} written)'


_lock = threading.Lock()
_totals = dict.fromkeys(EVENTS.values(), 0)
_listening = False
# JAX's own settings, from before `enable` first changed them (until `restore`).
_jax_own: dict[str, object] = {}


def _count(event: str, **kwargs) -> None:
  del kwargs
  field = EVENTS.get(event)
  if field is not None:
    with _lock:
      _totals[field] += 1


def counts() -> Counts:
  """This process's compiles through the cache since the first `enable` (all zero before)."""
  with _lock:
    return Counts(**_totals)


def _own(option: str):
  return _jax_own[option] if option in _jax_own else getattr(jax.config, option)


def _set(option: str, value) -> None:
  _jax_own.setdefault(option, getattr(jax.config, option))
  jax.config.update(option, value)


@dataclasses.dataclass(frozen=True)
class Cache:
  """The cache a run uses.

  Attributes:
    dir: its directory.
    min_compile_secs: programs that compile faster are not written.
    start: `counts()` when it was enabled.
  """
  dir: str
  min_compile_secs: float
  start: Counts

  def since(self, mark: Counts | None = None) -> Counts:
    """Compiles through the cache since `mark` (a `counts()`; default: since `enable`)."""
    return counts().minus(self.start if mark is None else mark)

  def stored(self) -> int:
    """Programs in the directory now (0 when it does not exist yet)."""
    return sum(name.endswith(_ENTRY_SUFFIX) for name in paths.listdir(self.dir))

  def banner(self) -> str:
    """The run's start line: where the cache is and what it holds."""
    by = ' by process 0' if jax.process_count() > 1 else ''
    return (f'compilation cache: {self.dir} ({self.stored()} programs stored; those that take '
            f'{self.min_compile_secs:g} s or more to compile are written{by})')


def enable(path: str | None, *, default: str,
           min_compile_secs: float | None = None) -> Cache | None:
  """Points JAX's persistent compilation cache at a directory; call before the run compiles.

  Args:
    path: the directory (local, or gs:// through etils.epath); '' turns the cache off;
      None: JAX's own setting (`JAX_COMPILATION_CACHE_DIR`) if it names one, else `default`.
      `restore` undoes what this sets.
    default: the directory when neither `path` nor JAX's setting names one (a run's is
      `<workdir>/compilation_cache`).
    min_compile_secs: programs that compile faster are not written (None: JAX's own setting,
      1 s unless `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` says otherwise).

  Returns:
    The `Cache`, or None when the cache is off.
  """
  global _listening
  where = path if path is not None else (_own(_DIR) or default)
  secs = float(_own(_MIN_SECS) if min_compile_secs is None else min_compile_secs)
  _set(_DIR, where or None)
  _set(_MIN_SECS, secs)
  # JAX opens its cache once, at the first compile after a directory is set: a second run in
  # this process with another directory must make it open again.
  jax_cache.reset_cache()
  if not where or not jax.config.jax_enable_compilation_cache:
    return None
  with _lock:
    if not _listening:
      jax.monitoring.register_event_listener(_count)
      _listening = True
  return Cache(dir=where, min_compile_secs=secs, start=counts())


def restore() -> None:
  """Gives JAX back the settings `enable` changed (a no-op when it changed none)."""
  for option, value in _jax_own.items():
    jax.config.update(option, value)
  if _jax_own:
    _jax_own.clear()
    jax_cache.reset_cache()
