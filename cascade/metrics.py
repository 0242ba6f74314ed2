"""Observability: TensorBoard events, a JSONL metrics log, per-stage progress bars and summaries.

  workdir/tb/            tensorboardX event files; tags '<stage name>/<metric>'
  workdir/metrics.jsonl  one JSON object per step: {"stage", "stage_index",
                         "kind", "step", "time", ...metrics}; a resumed run
                         appends the steps it redoes again (later lines win)

Only process 0 writes (`jax.process_index() == 0`); the others get no-op
writers, so callers never branch on the process. The workdir may be `gs://`:
both files then go through `cascade.paths` (an object store cannot append, so
each is uploaded whole when flushed: every 30 s, at `flush()` — cascade.train
has every checkpoint save call it first, so every step a resume will not redo
is logged — and at `close()`).
"""

from __future__ import annotations

import io
import json
import math
import sys
import time
from typing import Mapping

import jax
import tqdm

from cascade import paths


def _finite(metrics: Mapping) -> dict[str, float]:
  out = {}
  for k, v in metrics.items():
    try:
      f = float(v)
    except (TypeError, ValueError):
      continue
    if math.isfinite(f):
      out[k] = f
  return out


def _import_tensorboardx():
  """Imports tensorboardX without letting it import torch (3 s) where torch is installed.

  tensorboardX imports torch only to accept torch tensors; we log floats. A
  torch imported already (by anyone) is left alone, and one blocked here
  can still be imported later.
  """
  if 'torch' in sys.modules:
    import tensorboardX  # pylint: disable=g-import-not-at-top
  else:
    sys.modules['torch'] = None  # makes `import torch` raise ImportError
    try:
      import tensorboardX  # pylint: disable=g-import-not-at-top
    finally:
      del sys.modules['torch']
  from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top
  for scheme in paths.REMOTE_SCHEMES:
    record_writer.register_writer_factory(scheme, _EventFiles())
  return tensorboardX


class _EventFile:
  """A TensorBoard event file on an object store through `cascade.paths` (tensorboardX's own
  gs:// writer would be a second storage client): each flush uploads the whole file."""

  def __init__(self, path: str):
    self.path, self._buf, self._closed = path, io.BytesIO(), False

  def write(self, data: bytes) -> None:
    self._buf.write(data)

  def flush(self) -> None:
    paths.write_bytes(self.path, self._buf.getvalue())

  def close(self) -> None:
    if not self._closed:
      self.flush()
      self._closed = True


class _EventFiles:
  """tensorboardX's writer factory for the schemes of `paths.REMOTE_SCHEMES`."""

  def open(self, path: str) -> _EventFile:
    return _EventFile(path)

  def directory_check(self, path: str) -> None:
    del path  # object stores have no directories to create


class Writer:
  """Writes per-step metrics to TensorBoard and metrics.jsonl (process 0 only)."""

  def __init__(self, workdir: str, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._tb = None
    self._jsonl = None
    if self.enabled:
      tensorboardx = _import_tensorboardx()
      paths.makedirs(workdir)
      self._tb = tensorboardx.SummaryWriter(logdir=paths.join(workdir, 'tb'), flush_secs=30)
      self._jsonl = paths.AppendFile(paths.join(workdir, 'metrics.jsonl'))

  def write(self, stage, step: int, metrics: Mapping) -> None:
    """Logs one step of `stage` (a cascade.config.Stage, or anything with .name/.index/.kind)."""
    if not self.enabled:
      return
    vals = _finite(metrics)
    for k, v in vals.items():
      self._tb.add_scalar(f'{stage.name}/{k}', v, step)
    rec = {'stage': stage.name, 'stage_index': stage.index, 'kind': stage.kind, 'step': step,
           'time': round(time.time(), 3), **vals}
    self._jsonl.write(json.dumps(rec) + '\n')

  def write_scores(self, row_name: str, row_index: int, scores: Mapping[str, float]) -> None:
    """Logs an evaluation row: tags 'eval/<domain>' at x = row index (+1 for the initial row)."""
    if not self.enabled:
      return
    for d, v in scores.items():
      self._tb.add_scalar(f'eval/{d}', float(v), row_index + 1)
    self._jsonl.write(json.dumps({'eval': row_name, 'row': row_index, 'time': round(time.time(), 3),
                                  'scores': dict(scores)}) + '\n')
    self.flush()

  def flush(self) -> None:
    """Makes everything logged so far durable (TensorBoard and metrics.jsonl)."""
    if self.enabled:
      self._tb.flush()
      self._jsonl.flush(force=True)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._jsonl.close()
      self._tb = self._jsonl = None


# Short names shown on the progress bar, in order, when a step reports them.
_BAR_KEYS = (('reward_mean', 'reward'), ('response_len', 'len'), ('loss', 'loss'),
             ('accuracy', 'acc'), ('step_s', 's/step'))


class StageBar:
  """A tqdm bar for one stage (ETA from tqdm), with reward / length / step time; process 0 only."""

  def __init__(self, stage, start_step: int, enabled: bool | None = None):
    self.stage = stage
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.start_step = start_step
    self.start_time = time.time()
    self.first: dict[str, float] = {}
    self.last: dict[str, float] = {}
    self._bar = None
    if self.enabled:
      self._bar = tqdm.tqdm(total=stage.steps, initial=start_step, file=sys.stderr,
                            desc=f'[{stage.index}] {stage.name} ({stage.kind})',
                            dynamic_ncols=True, mininterval=1.0, leave=True)

  def update(self, metrics: Mapping) -> None:
    vals = _finite(metrics)
    if not self.first:
      self.first = dict(vals)
    self.last = dict(vals)
    if self._bar is not None:
      post = {short: f'{vals[k]:.3g}' for k, short in _BAR_KEYS if k in vals}
      self._bar.set_postfix(post, refresh=False)
      self._bar.update(1)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def summary_line(stage, steps_run: int, seconds: float, first: Mapping, last: Mapping,
                 scores: Mapping[str, float] | None = None,
                 previous: Mapping[str, float] | None = None) -> str:
  """One line closing a stage: steps, time, reward/loss first -> last, scores with deltas.

  Args:
    stage: the finished stage.
    steps_run: steps this process ran (fewer than stage.steps after a resume).
    seconds: wall time of those steps.
    first: metrics of the first step run; last: of the last.
    scores: the stage's evaluation row {domain: score}, if evaluated.
    previous: the row before it, for deltas.

  Returns:
    e.g. "stage 3 math_rl (grpo): 40 steps in 83s (2.08 s/step); reward 0.31 -> 0.62;
    math 52.0 (+12.0), code 30.5 (-0.5)".
  """
  parts = [f'stage {stage.index} {stage.name} ({stage.kind}): {steps_run} steps in '
           f'{seconds:.0f}s' + (f' ({seconds / steps_run:.2f} s/step)' if steps_run else '')]
  for key in ('reward_mean', 'loss', 'accuracy', 'response_len'):
    if key in first and key in last:
      parts.append(f'{key} {first[key]:.3g} -> {last[key]:.3g}')
  if scores:
    cells = []
    for d, v in scores.items():
      delta = '' if not previous or d not in previous else f' ({v - previous[d]:+.1f})'
      cells.append(f'{d} {v:.1f}{delta}')
    parts.append(', '.join(cells))
  return '; '.join(parts)
