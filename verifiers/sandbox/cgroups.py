"""Per-sandbox control groups: a memory and process ceiling on everything one worker runs.

A worker serves one sample at a time, so a cgroup per worker bounds each
sample in total: all its processes, their threads and the files they write to
the worker's tmpfs (tmpfs pages are charged to the writer's cgroup). Used
where the host lets us create one below our own cgroup:

  * cgroup v2 (`memory.max`, `memory.swap.max`, `pids.max`) when our cgroup
    already delegates the memory and pids controllers to its children;
  * cgroup v1 (`memory.limit_in_bytes`, `memory.memsw.limit_in_bytes`,
    `pids.max`) when the memory hierarchy is mounted and writable.

Elsewhere `detect()` says why not and the sandbox falls back to rlimits only
(see `verifiers.sandbox` for what holds then).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import time


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  """Where new cgroups go: 'cgroup2', or 'cgroup1' with one directory per controller."""
  kind: str
  parents: tuple[str, ...]


def _mounts():
  """(fstype, mount point, root within the hierarchy, super options) of cgroup mounts."""
  out = []
  try:
    with open('/proc/self/mountinfo', encoding='utf-8') as f:
      for line in f:
        pre, _, post = line.partition(' - ')
        fields, post_fields = pre.split(), post.split()
        if len(fields) >= 5 and len(post_fields) >= 3 and post_fields[0] in ('cgroup', 'cgroup2'):
          out.append((post_fields[0], fields[4], fields[3], set(post_fields[2].split(','))))
  except OSError:
    pass
  return out


def _own_cgroups():
  """controller (or '' for v2) -> our path in that hierarchy."""
  out = {}
  try:
    with open('/proc/self/cgroup', encoding='utf-8') as f:
      for line in f:
        _, controllers, path = line.rstrip('\n').split(':', 2)
        for c in controllers.split(',') if controllers else ['']:
          out[c] = path
  except OSError:
    pass
  return out


def _join(mount_point, mount_root, path):
  if mount_root != '/' and (path == mount_root or path.startswith(mount_root + '/')):
    path = path[len(mount_root):]
  return os.path.join(mount_point, path.lstrip('/'))


def _writable_dir(d):
  return os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)


def detect() -> tuple[Hierarchy | None, str]:
  """The hierarchy to create sandbox cgroups in, or (None, why not)."""
  own = _own_cgroups()
  mounts = _mounts()
  for fstype, point, root, _ in mounts:
    if fstype == 'cgroup2' and '' in own:
      d = _join(point, root, own[''])
      try:
        with open(os.path.join(d, 'cgroup.subtree_control'), encoding='utf-8') as f:
          enabled = set(f.read().split())
      except OSError:
        continue
      if {'memory', 'pids'} <= enabled and _writable_dir(d):
        return Hierarchy('cgroup2', (d,)), ''
  found = {}
  for controller in ('memory', 'pids'):
    for fstype, point, root, opts in mounts:
      if fstype == 'cgroup' and controller in opts and controller in own:
        d = _join(point, root, own[controller])
        if _writable_dir(d):
          found[controller] = d
          break
  if 'memory' in found:
    return Hierarchy('cgroup1', tuple(dict.fromkeys(found.values()))), ''
  return None, ('no writable cgroup: cgroup v2 without delegated memory+pids controllers '
                'and no writable cgroup v1 memory hierarchy')


class Cgroup:
  """One cgroup (a directory per hierarchy) with a memory and a process ceiling."""

  def __init__(self, hierarchy: Hierarchy, name: str, memory_bytes: int, pids: int):
    """Creates it.

    Raises:
      OSError: the kernel refused to create or configure it.
    """
    self.kind = hierarchy.kind
    self.dirs = []
    try:
      for parent in hierarchy.parents:
        d = os.path.join(parent, name)
        os.makedirs(d, exist_ok=True)
        self.dirs.append(d)
        files = os.listdir(d)
        if self.kind == 'cgroup2':
          _write(d, 'memory.max', memory_bytes)
          if 'memory.swap.max' in files:
            _write(d, 'memory.swap.max', 0)
          _write(d, 'pids.max', pids)
        elif 'memory.limit_in_bytes' in files:
          _write(d, 'memory.limit_in_bytes', memory_bytes)
          if 'memory.memsw.limit_in_bytes' in files:
            _write(d, 'memory.memsw.limit_in_bytes', memory_bytes)
        elif 'pids.max' in files:
          _write(d, 'pids.max', pids)
    except OSError:
      self.remove()
      raise

  @property
  def procs_files(self) -> list[str]:
    """The cgroup.procs files a process writes its pid to, to enter this cgroup."""
    return [os.path.join(d, 'cgroup.procs') for d in self.dirs]

  def kill(self) -> None:
    """Kills every process in it."""
    for d in self.dirs:
      if self.kind == 'cgroup2' and os.path.exists(os.path.join(d, 'cgroup.kill')):
        try:
          _write(d, 'cgroup.kill', 1)
          continue
        except OSError:
          pass
      try:
        with open(os.path.join(d, 'cgroup.procs'), encoding='utf-8') as f:
          pids = [int(x) for x in f.read().split()]
      except OSError:
        continue
      for pid in pids:
        try:
          os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass

  def remove(self) -> None:
    """Kills what is left in it and removes it (waits up to 2 s for processes to exit)."""
    deadline = time.monotonic() + 2.0
    for d in reversed(self.dirs):
      while os.path.isdir(d):
        try:
          os.rmdir(d)
        except OSError as e:
          if e.errno != errno.EBUSY or time.monotonic() > deadline:
            break
          self.kill()
          time.sleep(0.01)
    self.dirs = []


def _write(d, name, value):
  with open(os.path.join(d, name), 'w', encoding='utf-8') as f:
    f.write(str(value))
