"""Observability: TensorBoard events (and W&B), a JSONL metrics log, progress bars and summaries.

  workdir/tb/            tensorboardX event files: tags '<stage name>/<metric>' at the
                         stage's own step, the same metrics as 'run/<metric>' (and
                         'run/stage_index') at the run-wide step (the steps of the
                         stages before it added: one axis across the cascade), the
                         config as text ('config') and each stage's resolved config
                         ('<stage name>/hparams'); 'mfu' (model FLOP utilisation) where
                         config.hardware.peak_tflops is set
  workdir/metrics.jsonl  one JSON object per step: {"stage", "stage_index",
                         "kind", "step", "time", ...metrics}; a resumed run
                         appends the steps it redoes again (later lines win)
  workdir/samples.jsonl  a few generated samples of every RL step, one JSON
                         object each (`Writer.write_samples`; created at the
                         first one, so `config.eval.log_samples=0` leaves no
                         file); also TensorBoard text, tag '<stage name>/samples'
  W&B (optional)         with config.logging.wandb='<project>', every scalar and
                         text TensorBoard gets goes to a Weights & Biases run too,
                         under the same tags and steps (`_WandbRun`; the `wandb`
                         extra); docs/metrics.md lists every tag

Only process 0 writes (`jax.process_index() == 0`); the others get no-op
writers, so callers never branch on the process. Every file goes through
`foundation.paths`, so the workdir may be `gs://` (an object store cannot append,
so each is uploaded whole when flushed: every 30 s, at `flush()` — cascade.runner
has every checkpoint save call it first, so every step a resume will not redo
is logged — and at `close()`). TensorBoard's event file is written here too,
by the thread that logs (no writer thread): a failing write (a full disk) is
one error in the run, not a traceback from a background thread.
`before_write` (the workdir lock's check, `cascade.lock`) runs before each
write that reaches storage: each local JSONL line, each upload, each event
flush.
"""

from __future__ import annotations

import functools
import hashlib
import html
import json
import math
import os
import socket
import struct
import sys
import time
import weakref
from typing import Callable, Mapping

import jax
import numpy as np
import tqdm

from cascade import schema
from foundation import paths
from models import flops


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
  return tensorboardX


# Records up to this many bytes (a step's scalars) get `masked_crc32c`'s table form; longer ones
# (texts) tensorboardX's own byte loop.
CRC_TABLE_BYTES = 4096


@functools.lru_cache(maxsize=1)
def _crc_tables() -> tuple[np.ndarray, np.ndarray]:
  """CRC-32C (Castagnoli, reflected) as a linear map for records of up to CRC_TABLE_BYTES
  bytes: `shifted[k, b]` is the register after byte b and then k zero bytes from a zero
  register, `start[n]` the register after n zero bytes from the initial all-ones one. A
  record's register is start[n] XOR every `shifted[n - 1 - i, byte i]` (the CRC's update is
  linear over GF(2)). 4 MiB, made once per process."""
  from tensorboardX.crc32c import CRC_TABLE  # pylint: disable=g-import-not-at-top
  table = np.array(CRC_TABLE, np.uint32)
  shifted = np.empty((CRC_TABLE_BYTES, 256), np.uint32)
  shifted[0] = table
  for k in range(1, CRC_TABLE_BYTES):
    shifted[k] = table[shifted[k - 1] & 0xFF] ^ (shifted[k - 1] >> np.uint32(8))
  start = np.empty(CRC_TABLE_BYTES + 1, np.uint32)
  start[0] = 0xFFFFFFFF
  for k in range(1, CRC_TABLE_BYTES + 1):
    start[k] = table[start[k - 1] & 0xFF] ^ (start[k - 1] >> np.uint32(8))
  return shifted, start


def masked_crc32c(data: bytes) -> int:
  """TFRecord's masked CRC-32C of `data`, what tensorboardX's `record_writer.masked_crc32c`
  computes: by table (`_crc_tables`, some 20x faster than its pure-Python byte loop, the cost
  of a step's log) up to CRC_TABLE_BYTES bytes, by that function past them."""
  n = len(data)
  if n > CRC_TABLE_BYTES:
    from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top
    return record_writer.masked_crc32c(data)
  shifted, start = _crc_tables()
  reg = start[n]
  if n:
    reg ^= np.bitwise_xor.reduce(shifted[np.arange(n - 1, -1, -1),
                                         np.frombuffer(data, np.uint8)])
  crc = int(reg) ^ 0xFFFFFFFF
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class _Events:
  """One TensorBoard event file (TFRecord-framed `Event` protos), written through `foundation.paths`
  by the thread that logs.

  Events wait in memory until `flush`: every `every_s` seconds as events come, and whenever
  asked. Locally a flush appends them to the file; on an object store it uploads the whole
  file again. `before_write` runs before each flush that has something to write.
  """

  def __init__(self, logdir: str, before_write: Callable[[], None] | None = None,
               every_s: float = 30.0):
    tbx = _import_tensorboardx()
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import summary_pb2  # pylint: disable=g-import-not-at-top
    self._text, self._crc = tbx.summary.text, masked_crc32c
    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    self._before_write, self._every = before_write, every_s
    self.path = paths.join(logdir, f'events.out.tfevents.{int(time.time())}.'
                                   f'{socket.gethostname()}.{os.getpid()}')
    self._remote = paths.is_remote(self.path)
    if not self._remote:
      paths.makedirs(logdir)
    self._written = b''       # what an object store holds (it is uploaded whole)
    self._pending: list[bytes] = []
    self._last = time.monotonic()
    self._add(event_pb2.Event(wall_time=time.time(), file_version='brain.Event:2'))
    self.flush()

  def _add(self, event) -> None:
    data = event.SerializeToString()
    head = struct.pack('<Q', len(data))
    self._pending.append(head + struct.pack('<I', self._crc(head)) + data
                         + struct.pack('<I', self._crc(data)))
    if time.monotonic() - self._last >= self._every:
      self.flush()

  def scalars(self, values: Mapping[str, float], step: int) -> None:
    """One event holding every `tag: value` of `values` at `step`."""
    summary = self._summary_pb2.Summary(value=[
        self._summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
    self._add(self._event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

  def text(self, tag: str, text: str, step: int) -> None:
    self._add(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                    summary=self._text(tag, text)))

  def flush(self) -> None:
    self._last = time.monotonic()
    if not self._pending:
      return
    if self._before_write is not None:
      self._before_write()
    data = b''.join(self._pending)
    if self._remote:
      paths.write_bytes(self.path, self._written + data)
      self._written += data
    else:
      with open(self.path, 'ab') as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    self._pending = []

  def close(self, discard: bool = False) -> None:
    """Flushes what is pending (dropped instead with `discard`)."""
    if discard:
      self._pending = []
    else:
      self.flush()


class _WandbRun:
  """A Weights & Biases run that takes what `_Events` takes (config.logging.wandb), process 0.

  W&B gives a run one x axis; here each tag keeps its own, named by its first part: a value
  logged as 'rlhf/loss' at step 3 is logged with 'rlhf/step' = 3, its step metric
  (`define_metric`), so '<stage>/*', 'run/*', 'eval/*' and 'validation/*' have the steps
  TensorBoard shows. A text (a stage's config, a step's samples: model output) is shown as
  escaped preformatted HTML. The run's id is made from the workdir and the config, so the same
  command run again in the same workdir goes on with the same W&B run. W&B's own settings
  apply (WANDB_MODE=offline, WANDB_DIR, its login); its files go to <workdir>/wandb for a local
  workdir. W&B's service process writes what it is given as it comes: `flush` has nothing to do.

  Args:
    project: the W&B project.
    workdir: the run's directory.
    config: the run's config as plain data (`Plan.source`), W&B's run config.
    lib: the `wandb` module (tests pass a stand-in).
  """

  def __init__(self, project: str, workdir: str, config: Mapping, lib=None):
    if lib is None:
      try:
        import wandb as lib  # pylint: disable=g-import-not-at-top
      except ImportError:
        raise schema.ConfigError(f'config.logging.wandb={project!r}: the wandb package is not '
                                 "installed (pip install -e '.[wandb]')") from None
    self._lib = lib
    local = not paths.is_remote(workdir)
    where = os.path.abspath(workdir) if local else workdir
    key = json.dumps([where, config], sort_keys=True, default=str)
    self._run = lib.init(project=project, id=hashlib.sha256(key.encode()).hexdigest()[:16],
                         name=os.path.basename(where.rstrip('/')), config=dict(config),
                         dir=where if local else None, resume='allow',
                         settings=lib.Settings(console='off', silent=True))
    self._axes: set[str] = set()

  def _axis(self, tag: str) -> str | None:
    """The step metric of `tag` ('<first part>/step'; None for a tag of one part), defined on
    first use."""
    head, sep, _ = tag.partition('/')
    if not sep:
      return None
    if head not in self._axes:
      self._run.define_metric(f'{head}/step', hidden=True)
      self._run.define_metric(f'{head}/*', step_metric=f'{head}/step')
      self._axes.add(head)
    return f'{head}/step'

  def scalars(self, values: Mapping[str, float], step: int) -> None:
    row = {}
    for tag, value in values.items():
      axis = self._axis(tag)
      if axis is not None:
        row[axis] = int(step)
      row[tag] = float(value)
    self._run.log(row)

  def text(self, tag: str, text: str, step: int) -> None:
    row = {tag: self._lib.Html(f'<pre>{html.escape(text)}</pre>', inject=False)}
    axis = self._axis(tag)
    if axis is not None:
      row[axis] = int(step)
    self._run.log(row)

  def flush(self) -> None:
    pass

  def close(self, discard: bool = False) -> None:
    """Ends the W&B run (marked failed with `discard`: the workdir was taken over)."""
    self._run.finish(exit_code=1 if discard else 0)


class _Logs:
  """Everywhere the scalars and texts of a run go: TensorBoard, and W&B when configured."""

  def __init__(self, sinks: list):
    self.sinks = sinks

  def scalars(self, values: Mapping[str, float], step: int) -> None:
    for s in self.sinks:
      s.scalars(values, step)

  def text(self, tag: str, text: str, step: int) -> None:
    for s in self.sinks:
      s.text(tag, text, step)

  def flush(self) -> None:
    for s in self.sinks:
      s.flush()

  def close(self, discard: bool = False) -> None:
    for s in self.sinks:
      s.close(discard)


# Generated text is untrusted model output. Each string of a logged sample keeps at most
# SAMPLE_TEXT_CHARS of its characters (its head and its tail, half each, with a marker naming how
# many were cut between them: a completion's final answer is at its end); a verifier info keeps
# SAMPLE_INFO_KEYS keys, each value cut to SAMPLE_INFO_CHARS characters.
SAMPLE_TEXT_CHARS = 2000
SAMPLE_INFO_CHARS = 200
SAMPLE_INFO_KEYS = 16
_SAMPLE_KEY_CHARS = 100


def _safe_repr(x) -> str:
  try:
    return repr(x)
  except Exception:  # pylint: disable=broad-except
    return f'<unprintable {type(x).__name__}>'


def clean_text(text, limit: int = SAMPLE_TEXT_CHARS) -> str:
  """`text` as a string every encoder takes (UTF-8, JSON, protobuf), cut to `limit` characters.

  Lone surrogates become U+FFFD (a surrogate pair written as two code points is
  joined into its character). A longer text keeps its first `limit // 2` and
  last `limit - limit // 2` characters around '…[N characters cut]…'.

  Args:
    text: anything; a non-string is logged as its repr.
    limit: how many of its characters to keep at most.

  Returns:
    The cleaned text.
  """
  if not isinstance(text, str):
    text = _safe_repr(text)
  text = text.encode('utf-16', 'surrogatepass').decode('utf-16', 'replace')
  if len(text) > limit:
    head = limit // 2
    tail = text[len(text) - (limit - head):] if limit - head else ''
    text = f'{text[:head]} …[{len(text) - limit} characters cut]… {tail}'
  return text


def _clean_value(v, limit: int):
  """A JSON value that strict encoders take: finite numbers, bools, None, or cleaned text."""
  if v is None or isinstance(v, (bool, np.bool_)):
    return None if v is None else bool(v)
  if isinstance(v, (int, np.integer)):
    return int(v)
  if isinstance(v, (float, np.floating)):
    f = float(v)
    return f if math.isfinite(f) else str(f)
  if isinstance(v, str):
    return clean_text(v, limit)
  if isinstance(v, np.ndarray):
    v = v.tolist()
  text = None
  if isinstance(v, (list, tuple, dict)):       # as JSON text; anything odd inside as its repr
    try:
      text = json.dumps(v, default=_safe_repr)
    except (TypeError, ValueError, RecursionError):
      pass
  return clean_text(_safe_repr(v) if text is None else text, limit)


def clean_info(info) -> dict:
  """A verifier's info kept short: SAMPLE_INFO_KEYS keys, each value cut to SAMPLE_INFO_CHARS."""
  if info is None:
    return {}
  if not isinstance(info, Mapping):
    return {'info': _clean_value(info, SAMPLE_INFO_CHARS)}
  items = list(info.items())
  out = {clean_text(k, _SAMPLE_KEY_CHARS): _clean_value(v, SAMPLE_INFO_CHARS)
         for k, v in items[:SAMPLE_INFO_KEYS]}
  if len(items) > SAMPLE_INFO_KEYS:
    out['…'] = f'{len(items) - SAMPLE_INFO_KEYS} more keys'
  return out


def clean_sample(sample: Mapping) -> dict:
  """A logged sample, every value JSON-safe: `clean_info` for 'info', `clean_text` for text."""
  return {clean_text(k, _SAMPLE_KEY_CHARS): (clean_info(v) if k == 'info'
                                             else _clean_value(v, SAMPLE_TEXT_CHARS))
          for k, v in sample.items()}


_TEXT_FIELDS = ('prompt', 'completion')
_CONTEXT_FIELDS = ('stage', 'stage_index', 'kind', 'step')


def samples_markdown(recs: list[dict]) -> str:
  """TensorBoard text of cleaned samples: a bold title each, then an indented code block
  (indented line by line, so no text can close it or render as markdown/HTML)."""
  parts = []
  for i, r in enumerate(recs):
    head = ' '.join(f'{k}={json.dumps(v)}' for k, v in r.items()
                    if k not in _TEXT_FIELDS + _CONTEXT_FIELDS + ('info',))
    lines = [head]
    for k in _TEXT_FIELDS:
      if k in r:
        lines += [f'--- {k}:', *str(r[k]).splitlines()]
    lines.append(f'--- info: {json.dumps(r.get("info", {}))}')
    parts += [f'**sample {i + 1} of {len(recs)}**', '\n'.join('    ' + l for l in lines)]
  return '\n\n'.join(parts)


def _code_block(obj) -> str:
  """TensorBoard text (markdown) showing `obj` as indented JSON, verbatim."""
  text = json.dumps(obj, indent=1, sort_keys=True, default=str)
  return '\n'.join('    ' + line for line in text.splitlines())


def stage_hparams(stage) -> dict:
  """A stage's resolved config (every field, defaults filled in) as plain data."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  if dataclasses.is_dataclass(stage):
    return dataclasses.asdict(stage)
  return {'name': getattr(stage, 'name', None), 'kind': getattr(stage, 'kind', None)}


class Writer:
  """Writes per-step metrics to TensorBoard and metrics.jsonl, samples to samples.jsonl (process
  0 only).

  With the run's `plan` naming a W&B project (config.logging.wandb), everything TensorBoard
  gets goes to a W&B run too (`_WandbRun`).

  Given the run's `plan` (cascade.config.Plan), it also logs every step at its run-wide step
  (`run_step`), the config and each stage's resolved config as text, and each update's model
  FLOP utilisation: 'mfu' = tokens_per_s x FLOPs per token (`models.flops.counted_flops` of
  the model config for a training step, attention's score FLOPs left out: a lower bound) /
  (config.hardware.peak_tflops x devices), where the peak is set.
  """

  def __init__(self, workdir: str, enabled: bool | None = None, plan=None,
               before_write: Callable[[], None] | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._before_write = before_write
    self._logs = None
    self._jsonl = None
    self._samples = None
    self._samples_path = paths.join(workdir, 'samples.jsonl')
    self._offsets: dict[int, int] = {}         # stage index -> steps of the stages before it
    self._flops: dict[int, float] = {}         # stage index -> its update's FLOPs per token
    self._peak = 0.0                           # FLOP/s of all the run's devices
    self._described: set[int] = set()
    if plan is not None:
      offset = 0
      for st in plan.stages:
        self._offsets[st.index] = offset
        offset += getattr(st, 'steps', 0) or 0
        if getattr(st, 'MODEL', None):
          self._flops[st.index] = flops.counted_flops(plan.model, st.MODEL, 1, 0, train=True)
      self._peak = plan.hardware.peak_tflops * 1e12 * jax.device_count()
    if self.enabled:
      paths.makedirs(workdir)
      sinks = [_Events(paths.join(workdir, 'tb'), before_write)]
      if plan is not None and plan.logging.wandb:
        sinks.append(_WandbRun(plan.logging.wandb, workdir, plan.source))
      self._logs = _Logs(sinks)
      self._jsonl = paths.AppendFile(paths.join(workdir, 'metrics.jsonl'),
                                     before_write=before_write)
      if plan is not None:
        self._logs.text('config', _code_block(plan.source), 0)

  def run_step(self, stage, step: int) -> int:
    """`step` of `stage` on the run-wide axis: the steps of the stages before it added."""
    return self._offsets.get(stage.index, 0) + step

  def mfu(self, stage, metrics: Mapping) -> float | None:
    """The update's model FLOP utilisation (0..1), or None (no peak, no tokens_per_s)."""
    per_token = self._flops.get(stage.index)
    tps = metrics.get('tokens_per_s')
    if not self._peak or not per_token or tps is None:
      return None
    return float(tps) * per_token / self._peak

  def write(self, stage, step: int, metrics: Mapping) -> None:
    """Logs one step of `stage` (a cascade.config.Stage, or anything with .name/.index/.kind)."""
    if not self.enabled:
      return
    vals = _finite(metrics)
    mfu = self.mfu(stage, vals)
    if mfu is not None:
      vals['mfu'] = mfu
    rec = {'stage': stage.name, 'stage_index': stage.index, 'kind': stage.kind, 'step': step,
           'time': round(time.time(), 3), **vals}
    self._jsonl.write(json.dumps(rec) + '\n')
    if stage.index not in self._described:
      self._described.add(stage.index)
      self._logs.text(f'{stage.name}/hparams', _code_block(stage_hparams(stage)), 0)
    self._logs.scalars({f'{stage.name}/{k}': v for k, v in vals.items()}, step)
    self._logs.scalars({**{f'run/{k}': v for k, v in vals.items()},
                      'run/stage_index': stage.index}, self.run_step(stage, step))

  def write_samples(self, stage, step: int, samples: list[Mapping]) -> None:
    """Logs generated samples of one step of `stage` to samples.jsonl and TensorBoard text.

    Args:
      stage: as for `write`.
      step: the step, numbered as in metrics.jsonl.
      samples: one mapping each (field -> value; 'prompt', 'completion' and
        'info' are shown apart in TensorBoard); every value is cleaned first
        (`clean_sample`), so no model output can make the encoding fail.
    """
    if not self.enabled or not samples:
      return
    ctx = {'stage': stage.name, 'stage_index': stage.index, 'kind': stage.kind, 'step': step}
    recs = [{**ctx, **clean_sample(s)} for s in samples]
    if self._samples is None:
      self._samples = paths.AppendFile(self._samples_path, before_write=self._before_write)
    self._samples.write(''.join(json.dumps(r, allow_nan=False) + '\n' for r in recs))
    self._logs.text(f'{stage.name}/samples', samples_markdown(recs), step)

  def write_scores(self, row_name: str, row_index: int, scores: Mapping[str, float],
                   validation: Mapping[str, float] | None = None) -> None:
    """Logs an evaluation row: tags 'eval/<domain>' (and 'validation/<domain>' for the row's
    validation scores) at x = row index (+1 for the initial row)."""
    if not self.enabled:
      return
    rec = {'eval': row_name, 'row': row_index, 'time': round(time.time(), 3),
           'scores': dict(scores)}
    if validation:
      rec['validation'] = dict(validation)
    self._jsonl.write(json.dumps(rec) + '\n')
    self._logs.scalars({**{f'eval/{d}': v for d, v in scores.items()},
                      **{f'validation/{d}': v for d, v in (validation or {}).items()}},
                     row_index + 1)
    self.flush()

  def flush(self) -> None:
    """Makes everything logged so far durable (TensorBoard, metrics.jsonl, samples.jsonl)."""
    if self.enabled:
      self._logs.flush()
      self._jsonl.flush(force=True)
      if self._samples is not None:
        self._samples.flush(force=True)

  def close(self, discard: bool = False) -> None:
    """Writes what is pending and closes the files; with `discard` (a run whose workdir lock was
    taken over) what has not reached storage yet is dropped instead."""
    if self._logs is not None:
      self._logs.close(discard)
      self._jsonl.close(discard)
      if self._samples is not None:
        self._samples.close(discard)
      self._logs = self._jsonl = self._samples = None


def read_records(path: str) -> list[dict]:
  """The records of a JSONL log (metrics.jsonl, samples.jsonl); a damaged line (a writer killed
  mid-line, an edit) is skipped with a one-line warning naming the file and the line."""
  out = []
  for i, line in enumerate(paths.read_text(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
      if not isinstance(rec, dict):
        raise ValueError('not a JSON object')
    except ValueError as e:
      print(f'WARNING: {path}:{i}: damaged line skipped ({str(e).splitlines()[0][:80]})',
            flush=True)
      continue
    out.append(rec)
  return out


# Short names shown on the progress bar, in order, when a step reports them.
_BAR_KEYS = (('reward_mean', 'reward'), ('response_len', 'len'), ('loss', 'loss'),
             ('accuracy', 'acc'), ('step_s', 's/step'))


# The stage bars not yet closed (`close_bars`).
_OPEN_BARS: weakref.WeakSet = weakref.WeakSet()


def close_bars() -> None:
  """Closes every stage bar still open (a stage stopped by an error), so a line printed next
  (the command line's one error line) starts a line of its own."""
  for bar in list(_OPEN_BARS):
    bar.close()


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
      _OPEN_BARS.add(self)

  def update(self, metrics: Mapping) -> None:
    vals = _finite(metrics)
    if not self.first:
      self.first = dict(vals)
    self.last = dict(vals)
    if self._bar is not None:
      post = {short: f'{vals[k]:.3g}' for k, short in _BAR_KEYS if k in vals}
      self._bar.set_postfix(post, refresh=False)
      self._bar.update(1)

  def rewind(self, step: int) -> None:
    """Moves the bar back to `step` (a diverged stage rolled back to an earlier checkpoint)."""
    if self._bar is not None:
      self._bar.n = step
      self._bar.refresh()

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
      _OPEN_BARS.discard(self)


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
    e.g. "[3] math_rl (grpo): 40 steps in 83s (2.08 s/step); reward 0.31 -> 0.62;
    math 52.0 (+12.0), code 30.5 (-0.5)" ([index] as config.stages[index]).
  """
  parts = [f'[{stage.index}] {stage.name} ({stage.kind}): {steps_run} steps in '
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
