"""The host a benchmark ran on: a warning when other work shared it.

Ratios taken side by side in one run still carry when the host is busy, but seconds and
throughputs do not, and even a ratio drifts when the load changes between its two sides. Every
benchmark that prints timings says the load; `load_warning` turns it into a line a reader cannot
miss when the host ran more runnable processes than it has cores.
"""

from __future__ import annotations

import os
import platform
from typing import Sequence


def load_warning(before: Sequence[float] | float, after: Sequence[float] | float | None = None,
                 cpus: int | None = None) -> str | None:
  """A one-line warning when the one-minute load average, before or after, exceeds the cores.

  Args:
    before: os.getloadavg() (or its one-minute value) when the measurement started.
    after: the same when it ended (None: not taken).
    cpus: the host's cores (None: os.cpu_count()).

  Returns:
    The line, or None on a host no busier than its cores.
  """
  cpus = cpus or os.cpu_count() or 1
  one = lambda x: float(x if isinstance(x, (int, float)) else x[0])
  loads = [one(before)] + ([] if after is None else [one(after)])
  worst = max(loads)
  if worst <= cpus:
    return None
  said = ' -> '.join(f'{x:.2f}' for x in loads)
  return (f'WARNING: the host was loaded (one-minute load average {said} on {cpus} cores): '
          'other work shared the CPUs, so the seconds and throughputs here are inflated and the '
          'ratios less certain; rerun on an idle host to quote them')


def print_load_warning(before: Sequence[float] | float) -> str | None:
  """Prints `load_warning(before, os.getloadavg())` when there is one: every benchmark's main
  calls it just before its summary (the JSON line), so the line sits above it.

  Args:
    before: os.getloadavg() (or its one-minute value) when the measurement started.

  Returns:
    The line (for a page the benchmark writes), or None on a host no busier than its cores.
  """
  line = load_warning(before, os.getloadavg())
  if line:
    print(line, flush=True)
  return line


def cpu_name() -> str:
  """The host's CPU model (/proc/cpuinfo's 'model name'), or platform's name for it."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine() or 'an unknown CPU'
