"""Datasets: format adapters, whole and streamed readers, and the resumable batch loader.

Canonical records (what every stage reads; adapters map other formats here):

  prompt      {"id", "domain", "messages": [{"role", "content"}, ...], "metadata": {...}}
              (RL and evaluation; `metadata` holds the domain verifier's fields)
  sft         {"id", "domain", "messages", "response", "thinking" (optional)}, or a
              multi-turn tool-calling demonstration {"id", "domain", "messages",
              "turns": [{"role": "assistant" | "tool", "content"}, ...],
              "tools" (optional schemas)} whose assistant turns are all learned
  preference  {"id", "domain", "messages", "chosen", "rejected"}

Adapters (the `format` of a dataset in the config):

  prompt, sft, preference  the canonical records above.
  gsm8k          {"question", "answer": "... #### 42"} (or TFDS's "short_answer")
                 -> math metadata {"answer": "42"}.
  humaneval      {"task_id", "prompt", "test", "entry_point", "canonical_solution"}
                 -> code metadata {"prompt", "test", "entry_point"}.
  ifeval         {"key", "prompt", "instruction_id_list", "kwargs"}
                 -> instruction-following metadata {"instruction_id_list", "kwargs"}.
  nemotron_math  NeMo-Gym style math rows as in NVIDIA's released RL sets
                 (e.g. Nemotron-RL-Math-v2: "question", "expected_answer",
                 "responses_create_params": {"input": [messages]}); also accepts
                 "problem"/"prompt" and "answer"/"ground_truth". The exact
                 field names of the Cascade-1 RL-Math release are not verified.
  nemotron_if    rows with "instruction_id_list", "kwargs" and "prompt" or
                 "responses_create_params.input" (Nemotron RL IF blends); or
                 AllenAI's IF-RLVR layout (allenai/IF_multi_constraints_upto5):
                 "messages" and "ground_truth", a string holding a one-item list
                 [{"instruction_id": [...], "kwargs": [...]}] as JSON or as a
                 Python literal (the release writes Python's repr).

A dataset's `path` is a file or a glob of shards (JSONL, .jsonl.gz, .jsonl.zst,
Parquet, ArrayRecord; local or gs://), read through `cascade.data.shards`. `load` reads
a small set whole (held-out and validation prompts); `Records` reads a training set
by position, adapting and checking each record as it is asked for, so its size
never reaches host memory. A malformed record is a `DataError` naming the file and
line (JSONL, the line within its shard), row (Parquet), record (ArrayRecord) or
index (TFDS).

Batches come from a `Loader`: grain's seeded, per-epoch shuffle of positions
(`MapDataset.range(n).seed(s).shuffle().repeat()`), items read as they are drawn
(each process its share) and skipped when malformed or filtered out. Its state is
the next position, a small dict saved in every checkpoint, so a resumed stage draws
exactly what an uninterrupted one would have, reading nothing before it.

New formats register into `FORMATS` (a `Format`: record type and adapter); every
reader above applies them.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from typing import Any, Callable, Iterator, Mapping, Sequence

import grain
import numpy as np

from cascade.data import released
from cascade.data import shards

_ROLES = ('system', 'user', 'assistant')
BOXED_INSTRUCTION = 'Please reason step by step, and put your final answer within \\boxed{}.'


DataError = shards.DataError  # a malformed dataset, shard or record, named by file and line


class _RecordError(ValueError):
  """Raised by adapters; the reader adds where the record is."""


@dataclasses.dataclass(frozen=True)
class Format:
  record_type: str                      # 'prompt', 'sft' or 'preference'
  adapt: Callable[[dict], dict]         # raw row -> canonical record (no domain needed)


def _str(raw: Mapping, key: str, *, allow_empty: bool = False) -> str:
  if key not in raw:
    raise _RecordError(f'missing field {key!r}')
  v = raw[key]
  if not isinstance(v, str):
    raise _RecordError(f'field {key!r} must be a string, got {type(v).__name__}')
  if not allow_empty and not v.strip():
    raise _RecordError(f'field {key!r} is empty')
  return v


def _first(raw: Mapping, keys: Sequence[str], what: str):
  for k in keys:
    if k in raw and raw[k] is not None:
      return k, raw[k]
  raise _RecordError(f'missing field: {what} (one of {", ".join(keys)})')


def _messages(raw: Mapping, key: str = 'messages') -> list[dict]:
  msgs = raw.get(key)
  if msgs is None:
    raise _RecordError(f'missing field {key!r}')
  if not isinstance(msgs, (list, tuple)) or not msgs:
    raise _RecordError(f'field {key!r} must be a non-empty list of {{"role", "content"}}')
  out = []
  for i, m in enumerate(msgs):
    if not isinstance(m, Mapping):
      raise _RecordError(f'{key}[{i}] must be an object, got {type(m).__name__}')
    role, content = m.get('role'), m.get('content')
    if role not in _ROLES:
      raise _RecordError(f'{key}[{i}].role={role!r}: expected one of {_ROLES}')
    if not isinstance(content, str):
      raise _RecordError(f'{key}[{i}].content must be a string')
    out.append({'role': role, 'content': content})
  if out[-1]['role'] != 'user':
    raise _RecordError(f'{key}: the last message must be the user turn to answer')
  return out


def _id(raw: Mapping, keys=('id',)) -> str:
  for k in keys:
    if k in raw and raw[k] is not None:
      v = raw[k]
      if isinstance(v, (str, int)) and not isinstance(v, bool):
        return str(v)
      raise _RecordError(f'field {k!r} must be a string or int')
  return ''


def _base(raw: Mapping) -> dict:
  out = {'id': _id(raw), 'messages': _messages(raw)}
  if 'domain' in raw:
    out['domain'] = _str(raw, 'domain')
  return out


def _adapt_prompt(raw):
  rec = _base(raw)
  md = raw.get('metadata', {})
  if not isinstance(md, Mapping):
    raise _RecordError(f'field \'metadata\' must be an object, got {type(md).__name__}')
  rec['metadata'] = dict(md)
  return rec


def _turns(raw: Mapping) -> list[dict]:
  """A multi-turn demonstration's turns: assistant turns and tool results, ending with the answer."""
  turns = raw['turns']
  if not isinstance(turns, (list, tuple)) or not turns:
    raise _RecordError("field 'turns' must be a non-empty list of {\"role\", \"content\"}")
  out = []
  for i, t in enumerate(turns):
    if not isinstance(t, Mapping):
      raise _RecordError(f'turns[{i}] must be an object, got {type(t).__name__}')
    role, content = t.get('role'), t.get('content')
    if role not in ('assistant', 'tool'):
      raise _RecordError(f"turns[{i}].role={role!r}: expected 'assistant' or 'tool'")
    if not isinstance(content, str):
      raise _RecordError(f'turns[{i}].content must be a string')
    if role == 'tool' and i == 0:
      raise _RecordError('turns[0]: a tool result must follow an assistant turn')
    out.append({'role': role, 'content': content})
  if out[-1]['role'] != 'assistant':
    raise _RecordError('turns: the last turn must be the assistant\'s final answer')
  return out


def _adapt_sft(raw):
  rec = _base(raw)
  if 'turns' in raw:
    # A multi-turn (tool-calling) demonstration; every assistant turn is learned.
    if 'response' in raw:
      raise _RecordError("give either 'response' or 'turns', not both")
    rec['turns'] = _turns(raw)
    tools = raw.get('tools')
    if tools is not None:
      if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
        raise _RecordError("field 'tools' must be a list of tool schemas (objects)")
      rec['tools'] = [dict(t) for t in tools]
    return rec
  rec['response'] = _str(raw, 'response')
  if raw.get('thinking') is not None:
    rec['thinking'] = _str(raw, 'thinking', allow_empty=True)
  return rec


def _adapt_preference(raw):
  rec = _base(raw)
  rec['chosen'] = _str(raw, 'chosen')
  rec['rejected'] = _str(raw, 'rejected')
  return rec


def _user(text: str) -> list[dict]:
  return [{'role': 'user', 'content': text}]


def _adapt_gsm8k(raw):
  question = _str(raw, 'question')
  if isinstance(raw.get('answer'), str) and '####' in raw['answer']:
    answer = raw['answer'].rsplit('####', 1)[1].strip()
  elif isinstance(raw.get('short_answer'), str):
    answer = raw['short_answer'].strip()
  else:
    raise _RecordError("field 'answer' has no '#### <final answer>' (and no 'short_answer')")
  if not answer:
    raise _RecordError('the final answer is empty')
  answer = answer.replace(',', '')  # GSM8K writes thousands with commas ('1,000').
  return {'id': _id(raw), 'messages': _user(f'{question}\n{BOXED_INSTRUCTION}'),
          'metadata': {'answer': answer}}


def _adapt_humaneval(raw):
  prompt = _str(raw, 'prompt')
  md = {'prompt': prompt, 'test': _str(raw, 'test'), 'entry_point': _str(raw, 'entry_point')}
  text = ('Complete the following Python function. Answer with the whole function in '
          f'a ```python code block.\n\n```python\n{prompt}```')
  return {'id': _id(raw, ('task_id', 'id')), 'messages': _user(text), 'metadata': md}


def _if_metadata(raw) -> dict:
  ids = raw.get('instruction_id_list')
  if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids) or not ids:
    raise _RecordError("field 'instruction_id_list' must be a non-empty list of strings")
  kwargs = raw.get('kwargs')
  if not isinstance(kwargs, (list, tuple)) or len(kwargs) != len(ids):
    raise _RecordError(f"field 'kwargs' must be a list with one entry per instruction "
                       f'({len(ids)})')
  clean = []
  for i, kw in enumerate(kwargs):
    if kw is None:
      kw = {}
    if not isinstance(kw, Mapping):
      raise _RecordError(f'kwargs[{i}] must be an object or null')
    # IFEval pads each kwargs dict with nulls for the other instructions' arguments.
    clean.append({k: v for k, v in kw.items() if v is not None})
  return {'instruction_id_list': list(ids), 'kwargs': clean}


def _adapt_ifeval(raw):
  return {'id': _id(raw, ('key', 'id')), 'messages': _user(_str(raw, 'prompt')),
          'metadata': _if_metadata(raw)}


def _gym_messages(raw) -> list[dict] | None:
  params = raw.get('responses_create_params')
  if isinstance(params, Mapping) and params.get('input') is not None:
    return _messages(params, 'input')
  return None


def _adapt_nemotron_math(raw):
  msgs = _gym_messages(raw)
  if msgs is None:
    key, _ = _first(raw, ('messages', 'question', 'problem', 'prompt'), 'the problem')
    msgs = _messages(raw) if key == 'messages' else _user(f'{_str(raw, key)}\n{BOXED_INSTRUCTION}')
  key, answer = _first(raw, ('expected_answer', 'answer', 'ground_truth'), 'the answer')
  if isinstance(answer, (int, float)) and not isinstance(answer, bool):
    answer = str(answer)
  if not isinstance(answer, str) or not answer.strip():
    raise _RecordError(f'field {key!r} must be a non-empty string or number')
  return {'id': _id(raw, ('id', 'uuid')), 'messages': msgs, 'metadata': {'answer': answer}}


def _parse_ground_truth(value) -> Any:
  """A `ground_truth` string as JSON, else as a Python literal (literals only: no code runs)."""
  if not isinstance(value, str):
    return value
  try:
    return json.loads(value)
  except ValueError:
    pass
  except RecursionError:
    raise _RecordError("field 'ground_truth' is nested too deeply") from None
  try:
    return ast.literal_eval(value)
  except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
    raise _RecordError("field 'ground_truth' is neither JSON nor a Python literal") from None


def _rlvr_metadata(raw) -> dict:
  """Instruction metadata from AllenAI's IF-RLVR `ground_truth` (see the module docstring)."""
  gt = _parse_ground_truth(raw['ground_truth'])
  if isinstance(gt, (list, tuple)):
    if len(gt) != 1:
      raise _RecordError(f"field 'ground_truth' holds {len(gt)} constraint sets; expected one")
    gt = _parse_ground_truth(gt[0])
  if not isinstance(gt, Mapping):
    raise _RecordError("field 'ground_truth' must hold an object with 'instruction_id' and "
                       "'kwargs'")
  ids = gt.get('instruction_id', gt.get('instruction_id_list'))
  try:
    return _if_metadata({'instruction_id_list': ids, 'kwargs': gt.get('kwargs')})
  except _RecordError as e:
    raise _RecordError(f'ground_truth: {e}') from None


def _adapt_nemotron_if(raw):
  msgs = _gym_messages(raw)
  if msgs is None:
    msgs = _messages(raw) if 'messages' in raw else _user(_str(raw, 'prompt'))
  if 'instruction_id_list' not in raw and 'ground_truth' in raw:
    md = _rlvr_metadata(raw)
  else:
    md = _if_metadata(raw)
  return {'id': _id(raw, ('id', 'key', 'uuid')), 'messages': msgs, 'metadata': md}


FORMATS: dict[str, Format] = {
    'prompt': Format('prompt', _adapt_prompt),
    'sft': Format('sft', _adapt_sft),
    'preference': Format('preference', _adapt_preference),
    'gsm8k': Format('prompt', _adapt_gsm8k),
    'humaneval': Format('prompt', _adapt_humaneval),
    'ifeval': Format('prompt', _adapt_ifeval),
    'nemotron_math': Format('prompt', _adapt_nemotron_math),
    'nemotron_if': Format('prompt', _adapt_nemotron_if),
}


def _released(adapt: Callable[[dict], dict]) -> Callable[[dict], dict]:
  """A `cascade.data.released` adapter whose errors the loader reports with the row's place."""
  def run(raw):
    try:
      return adapt(raw)
    except released.RecordError as e:
      raise _RecordError(str(e)) from None
  return run


# The released Nemotron-Cascade 1 and 2 datasets, read as they are (cascade/data/released.py).
FORMATS.update({name: Format(kind, _released(adapt))
                for name, (kind, adapt) in released.ADAPTERS.items()})


def _decode(x):
  """TFDS yields bytes for text and numpy arrays for sequences; make them JSON-like."""
  if isinstance(x, bytes):
    return x.decode('utf-8')
  if isinstance(x, Mapping):
    return {k: _decode(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_decode(v) for v in x]
  if hasattr(x, 'tolist'):
    return _decode(x.tolist())
  return x


def read_rows(spec) -> Iterator[tuple[str, Any]]:
  """Yields (where, raw row) from a dataset spec's source; `where` names file and line.

  Args:
    spec: a `cascade.config.Dataset`.

  Raises:
    DataError: a missing file, an unknown extension, or a line that is not
      UTF-8, not JSON, nested too deeply or holding a lone surrogate.
  """
  if spec.tfds:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    import tensorflow_datasets.text  # noqa: F401  pylint: disable=unused-import,g-import-not-at-top
    try:
      source = tfds.data_source(spec.tfds, split=spec.split,
                                data_dir=spec.data_dir or None)
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f'tfds:{spec.tfds}/{spec.split}: cannot open the prepared dataset '
                      f'({type(e).__name__}: {e}); prepare it with `tfds build` first') from e
    for i in range(len(source)):
      yield f'tfds:{spec.tfds}/{spec.split} record {i}', _decode(source[i])
    return
  try:
    files = shards.expand(spec.path)
  except DataError as e:
    raise DataError(f'{e} (dataset {spec.name!r})') from None
  for f in files:
    yield from shards.stream(f)


def adapt(spec, fmt: Format, where: str, raw: Any, n: int,
          domains: Sequence[str] | None = None,
          check_metadata: Callable[[str, dict, str], None] | None = None) -> dict:
  """One raw row as a checked canonical record (see `load`); `n` numbers it from 0 after
  `spec.skip` (its default id is '<dataset>:<n>').

  Raises:
    DataError: naming `where` (file and line) and the field.
  """
  if not isinstance(raw, Mapping):
    raise DataError(f'{where}: a record must be a JSON object, got {type(raw).__name__}')
  try:
    rec = fmt.adapt(raw)
  except _RecordError as e:
    raise DataError(f'{where}: {e} (format {spec.format!r})') from None
  rec['id'] = rec.get('id') or f'{spec.name}:{n}'
  rec['domain'] = rec.get('domain') or spec.domain
  if not rec['domain']:
    raise DataError(f"{where}: the record has no 'domain' and dataset {spec.name!r} "
                    'names none')
  if domains is not None and rec['domain'] not in domains:
    raise DataError(f'{where}: domain {rec["domain"]!r} is not a configured domain '
                    f'({", ".join(sorted(domains))})')
  if fmt.record_type == 'prompt' and check_metadata is not None:
    try:
      check_metadata(rec['domain'], rec['metadata'], where)
    except ValueError as e:
      msg = str(e) if str(e).startswith(where) else f'{where}: {e}'
      raise DataError(f'{msg} (rejected by the {rec["domain"]!r} verifier)') from None
  return rec


def load(spec, domains: Sequence[str] | None = None,
         check_metadata: Callable[[str, dict, str], None] | None = None) -> list[dict]:
  """Reads and validates a whole dataset into canonical records (for the small sets: held-out
  and validation prompts; training sets stream through `open_dataset`).

  Args:
    spec: a `cascade.config.Dataset`.
    domains: known domain names; a record's domain must be one of them.
    check_metadata: (domain, metadata, where) raising ValueError (naming
      `where` and the field) when the domain's verifier rejects the metadata;
      applied to prompt records.

  Returns:
    The records, in file order (the first `spec.skip` rows left out, at most
    `spec.limit` kept), each with 'id' (default '<dataset>:<n>', n counting
    kept records) and 'domain' (default: the dataset's domain).

  Raises:
    DataError: the first malformed record, naming file and line.
  """
  fmt = FORMATS[spec.format]
  out = []
  skip = getattr(spec, 'skip', 0)
  for n, (where, raw) in enumerate(read_rows(spec)):
    if n < skip:
      continue
    out.append(adapt(spec, fmt, where, raw, len(out), domains, check_metadata))
    if spec.limit and len(out) >= spec.limit:
      break
  if not out:
    raise DataError(f'dataset {spec.name!r} ({spec.path or spec.tfds}) holds no records')
  return out


class Records:
  """A dataset's canonical records by position, read and checked as they are asked for.

  `len()` and `[i]` (grain's data-source protocol) over the dataset's shards
  (`cascade.data.shards`), `spec.skip` and `spec.limit` applied; `[i]` raises
  DataError (naming file and line) for a malformed row. Nothing is held in
  memory but the shards' indexes (memory-mapped) and one Parquet row group.

  Args:
    spec: a `cascade.config.Dataset` with a `path` (a file or a glob of shards).
    cache_dir: where shard indexes and decompressed copies are kept (local).
    domains, check_metadata: as for `load`.
    shared_dir, hosts: with several processes, each opens (indexes, decompresses) only
      its share of the shards and publishes it in `shared_dir`, a cache every process
      sees (`cascade.data.shards.open_shards`); every process must open the dataset.
  """

  def __init__(self, spec, cache_dir: str | None = None, domains: Sequence[str] | None = None,
               check_metadata: Callable[[str, dict, str], None] | None = None,
               shared_dir: str | None = None, hosts=None):
    self.spec, self.fmt = spec, FORMATS[spec.format]
    self.domains, self.check_metadata = domains, check_metadata
    try:
      self.files = shards.expand(spec.path)
      self.source = shards.Source(shards.open_shards(self.files, cache_dir, shared_dir, hosts))
    except DataError as e:
      raise DataError(f'{e} (dataset {spec.name!r})') from None
    self.skip = min(spec.skip, len(self.source))
    n = len(self.source) - self.skip
    self._len = min(n, spec.limit) if spec.limit else n
    if not self._len:
      raise DataError(f'dataset {spec.name!r} ({spec.path}) holds no records')

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, i: int) -> dict:
    i = int(i)
    if not 0 <= i < self._len:
      raise IndexError(f'record {i} of {self._len}')
    where, raw = self.source[self.skip + i]
    return adapt(self.spec, self.fmt, where, raw, i, self.domains, self.check_metadata)

  def check(self, n: int) -> None:
    """Reads and checks the first `n` records (a malformed file stops the run here, before
    anything trains)."""
    for i in range(min(n, self._len)):
      self[i]  # pylint: disable=pointless-statement


def open_dataset(spec, cache_dir: str | None = None, domains: Sequence[str] | None = None,
                 check_metadata: Callable[[str, dict, str], None] | None = None,
                 shared_dir: str | None = None, hosts=None):
  """A training dataset by position: `Records` streamed from its shards, or, for a TFDS
  dataset (prepared data, read whole), the list `load` gives."""
  if spec.tfds:
    return load(spec, domains, check_metadata)
  return Records(spec, cache_dir, domains, check_metadata, shared_dir, hosts)


class Concat:
  """Several random-access sources as one, in order (`len()`, `[i]`)."""

  def __init__(self, parts: Sequence):
    self.parts = list(parts)
    self.starts = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(
        np.int64)

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, i: int):
    k = int(np.searchsorted(self.starts, i, side='right')) - 1
    return self.parts[k][int(i) - int(self.starts[k])]


@dataclasses.dataclass(frozen=True)
class Stream:
  """What a stage draws from: a random-access source and what becomes of each item drawn.

  Attributes:
    source: `len()` and `[i]`; `[i]` may raise DataError (a malformed row: skipped,
      counted and logged).
    keep: (position, item) -> the item the stage takes, or None to skip it (another
      stage's domain, filtered by the kind); None = take every item as it is.
    why: what `keep` drops (for the log line that counts them).
    what: who draws (e.g. "stages[0] 'sft'"), for log lines and errors.
    hosts: (index, count, exchange) of the processes sharing the reading: each reads
      and checks its share of every batch's positions, `exchange(bytes) -> [bytes per
      process]` gathers the rest; None = one process reads everything.
  """
  source: Any
  keep: Callable[[int, Any], Any] | None = None
  why: str = ''
  what: str = ''
  hosts: Any = None


class Loader:
  """Seeded, shuffled, endlessly repeated batches from a random-access source, resumable.

  The order is grain's `MapDataset.source(range(n)).seed(seed).shuffle().repeat()`:
  each epoch is a fresh permutation of the positions, computed per position (no
  list of n is ever built), so position p of the order is known without reading
  anything before it. A batch takes the next positions in that order, reads them
  (each process its share, when a `Stream` names several), skips those the
  stream's `keep` rejects or that are malformed (counted and logged), and goes on
  until it has `batch_size` items. The state is the next position in the order
  (`get_state()`, a small JSON-able dict), so a restored loader yields exactly
  the batches an uninterrupted one would, reading nothing before that position.

  Args:
    records: a sequence of records (held in memory) or a `Stream`.
    seed: the shuffle seed.
    batch_size: items per batch.
    shuffle: False: file order (each epoch the same).
  """

  LOGGED = 5      # skipped items whose reason is printed one by one; then one line per 10x

  def __init__(self, records, seed: int, batch_size: int, shuffle: bool = True):
    stream = records if isinstance(records, Stream) else Stream(records)
    self.stream, self.batch_size = stream, batch_size
    n = len(stream.source)
    if not n:
      raise DataError(f'Loader{" of " + stream.what if stream.what else ""}: no records')
    order = grain.MapDataset.range(n)
    if shuffle:
      order = order.seed(seed).shuffle()
    self._order = order.repeat(None)
    self._n = n
    self._pos = 0
    self.malformed = 0      # items skipped as malformed (since this loader was made)
    self.dropped = 0        # items `keep` rejected

  def _read(self, positions: Sequence[int]) -> list:
    """[(kept item or None, malformed message or None)] for `positions` of the order."""
    st = self.stream
    hosts = st.hosts
    mine = (positions if hosts is None or hosts.count == 1
            else positions[hosts.index::hosts.count])
    out = []
    for p in mine:
      i = self._order[p]
      try:
        item = st.source[i]
      except DataError as e:
        out.append((None, str(e)))
        continue
      out.append((item if st.keep is None else st.keep(i, item), None))
    if hosts is None or hosts.count == 1:
      return out
    import pickle  # pylint: disable=g-import-not-at-top
    shares = [pickle.loads(b) for b in hosts.exchange(pickle.dumps(out))]
    merged = [None] * len(positions)
    for h, share in enumerate(shares):
      merged[h::hosts.count] = share
    return merged

  def _log(self, count: int, what: str) -> None:
    if count <= self.LOGGED or count in (10 ** k for k in range(2, 19)):
      print(f'WARNING: {self.stream.what or "loader"}: {what} (skipped so far: '
            f'{self.malformed} malformed, {self.dropped} dropped)', flush=True)

  def next(self) -> list:
    """The next batch (a list of `batch_size` items)."""
    batch, run = [], 0          # run: positions skipped since the last kept item
    while len(batch) < self.batch_size:
      want = self.batch_size - len(batch)
      positions = list(range(self._pos, self._pos + want))
      for item, bad in self._read(positions):
        self._pos += 1
        if item is not None:
          batch.append(item)
          run = 0
          continue
        run += 1
        if bad is not None:
          self.malformed += 1
          self._log(self.malformed, f'malformed record skipped: {bad}')
        else:
          self.dropped += 1
          if self.stream.why:
            self._log(self.dropped, f'dropped a record ({self.stream.why})')
        if run >= 2 * self._n:      # a kept item recurs within two epochs
          raise DataError(f'{self.stream.what or "loader"}: no records left after dropping '
                          f'{self.stream.why or "malformed records"} (none kept in two '
                          f'epochs of {self._n})')
    return batch

  def get_state(self) -> dict:
    return {'position': self._pos}

  def set_state(self, state: Mapping) -> None:
    if set(state) != {'position'} or not isinstance(state['position'], int):
      raise DataError(f'data position {dict(state)!r}: not a position of this loader (a '
                      "checkpoint of a cascade before streamed data saved grain's batch "
                      "iterator; rerun that stage from its start)")
    self._pos = state['position']
