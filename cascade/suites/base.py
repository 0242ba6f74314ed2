"""What an evaluation suite is: its records, its prompts, its sampling protocol, its metric.

A suite is a benchmark as a paper runs it. It reads the benchmark's released
files (field names as on the dataset card) into records, renders each
record's prompt (system prompt, few-shot, the benchmark's instruction
template, thinking mode), samples every prompt `protocol.samples` times with
the protocol's temperature, top-p and token budget, grades each completion,
and reduces the grades to the benchmark's metric with its uncertainty.

  suite = suites.get('aime25')
  records = suite.read('/data/aime25')        # a one-line DataMissing naming the file
  grader = suite.grader()                     # verifier pools: close() when done
  grades = grader.grade(records[0], ['... \\boxed{70}', ...])
  summary = suite.summarize(records, all_grades)

Records are plain dicts {'id', 'messages', 'metadata'}, the same canonical
prompt records the stages read, so a suite's prompts go through the same
sampler and chat rendering as a stage's. A suite module defines one `Suite`
subclass (or instances of one) and the registry (`cascade.suites`) lists it.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
from typing import Any, Hashable, Mapping, NamedTuple, Sequence

import numpy as np

from cascade.suites import stats
from foundation import paths


class DataMissing(FileNotFoundError):
  """A suite's data is not where it was looked for (the message names the suite and file)."""


class BadRecord(ValueError):
  """A benchmark file's record does not have the fields the suite reads (names file:line)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Protocol:
  """How a suite samples, as its paper evaluates.

  Attributes:
    samples: completions per prompt (the k of avg@k).
    temperature: sampling temperature (0 with greedy).
    top_p: nucleus mass.
    top_k: 0 for no top-k cut.
    greedy: argmax decoding (then samples must be 1).
    max_new_tokens: the completion budget.
    thinking: True (' /think'), False (' /no_think') or None (no switch).
    pass_ks: the k of each pass@k reported (each <= samples).
  """
  samples: int = 1
  temperature: float = 0.6
  top_p: float = 0.95
  top_k: int = 0
  greedy: bool = False
  max_new_tokens: int = 65536
  thinking: bool | None = True
  pass_ks: tuple[int, ...] = ()

  def __post_init__(self):
    if self.samples < 1:
      raise ValueError(f'Protocol.samples must be >= 1, got {self.samples}')
    if self.greedy and self.samples != 1:
      raise ValueError('Protocol: greedy decoding gives one distinct sample: samples must be 1')
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'Protocol.top_p must be in (0, 1], got {self.top_p}')
    if self.temperature < 0:
      raise ValueError(f'Protocol.temperature must be >= 0, got {self.temperature}')
    if self.max_new_tokens < 1:
      raise ValueError(f'Protocol.max_new_tokens must be >= 1, got {self.max_new_tokens}')
    bad = [k for k in self.pass_ks if not 1 <= k <= self.samples]
    if bad:
      raise ValueError(f'Protocol.pass_ks {bad} must lie in [1, samples={self.samples}]')

  def to_json(self) -> dict:
    return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
            for f in dataclasses.fields(self)}

  def replaced(self, **fields) -> Protocol:
    """This protocol with some fields replaced (a quick look at fewer samples, a smaller
    model's shorter budget); pass_ks above a smaller `samples` are dropped unless given.

    Raises:
      ValueError: an unknown field (the known ones named), or values that do not check out.
    """
    known = [f.name for f in dataclasses.fields(self)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
      raise ValueError(f'unknown protocol field(s) {unknown} (known: {", ".join(known)})')
    merged = dict(self.to_json(), **fields)
    if 'pass_ks' not in fields:
      merged['pass_ks'] = [k for k in merged['pass_ks'] if k <= merged['samples']]
    merged['pass_ks'] = tuple(merged['pass_ks'])
    try:
      return Protocol(**merged)
    except TypeError as e:
      raise ValueError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Graded:
  """One completion's grade.

  Attributes:
    score: in [0, 1]; 1 is right (pass@k counts only 1).
    answer: the extracted, normalised answer for maj@k (None: no answer).
    info: JSON-serialisable details (always a 'reason').
  """
  score: float
  answer: Hashable | None = None
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Sampled(NamedTuple):
  """What `Suite.sample` gives the runner for a batch of records.

  Attributes:
    completions: per record, its `k` completions: the text its grader grades.
    lengths: [records, k] tokens each sample took.
    truncated: [records, k] the sample hit a limit (the token budget, turns).
  """
  completions: list
  lengths: np.ndarray
  truncated: np.ndarray


@dataclasses.dataclass(frozen=True)
class Reported:
  """A number a paper reports for this suite.

  Attributes:
    recipe: the recipe's config name (e.g. 'nemotron_cascade_14b').
    stage: the stage after which it was measured ('final' for a released model).
    value: the reported metric, in the suite's units (percent for most).
    source: where it is reported (paper, table).
  """
  recipe: str
  stage: str
  value: float
  source: str


class Grader:
  """Grades completions of a suite's records; holds worker pools until `close`.

  Subclasses implement `grade`; a grader is used as a context manager or
  closed by its user.
  """

  def grade(self, record: Mapping, completions: Sequence[str]) -> list[Graded]:
    """The grade of each of one record's completions (a failure is 0 with a reason)."""
    raise NotImplementedError

  def grade_batch(self, records: Sequence[Mapping],
                  completions: Sequence[Sequence[str]]) -> list[list[Graded]]:
    """`grade` of each record's completions; a grader whose verifier scores a batch in one
    call (its worker pool busy on every sample at once) overrides it."""
    return [self.grade(r, c) for r, c in zip(records, completions)]

  def close(self) -> None:
    """Stops the grader's workers (idempotent)."""

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Suite:
  """A benchmark with its protocol.

  Attributes:
    name: the registry name ('aime25').
    title: the benchmark's name as papers write it ('AIME 2025').
    source: the released data it reads (dataset card name and split).
    files: file names (globs allowed) the reader looks for under its data directory.
    protocol: the sampling protocol.
    metric: what `summarize`'s 'value' is ('avg@16', 'prompt-level strict', ...).
    reported: the papers' numbers for it.
    hub_dataset: the Hugging Face dataset repository `cascade.evaluate --download` fetches
      the suite's files from ('' = none: a generated suite, or one placed by hand).
    hub_files: the patterns of the repository's files it fetches (empty: `files`), written
      under the suite's directory with their paths in the repository.
    prompt_tokens: `launch.plan`'s bound on one rendered prompt, in tokens, where it cannot
      measure the suite's files (`planned_prompts`; docs/evaluation.md says where each
      suite's comes from).
    records: the records the release has, as its card states (0: not stated); the plan's
      calls hold no more prompts than that.
  """
  name: str
  title: str
  source: str
  files: tuple[str, ...]
  protocol: Protocol
  metric: str = 'avg@k'
  reported: tuple[Reported, ...] = ()
  hub_dataset: str = ''
  hub_files: tuple[str, ...] = ()
  prompt_tokens: int = 4096
  records: int = 0

  def with_protocol(self, **fields) -> Suite:
    """This suite with some protocol fields replaced (`Protocol.replaced`); its protocol hash
    changes with them, so its results never mix with the paper protocol's.

    Raises:
      ValueError: an unknown field, or a protocol that does not check out (names the suite).
    """
    if not fields:
      return self
    try:
      return dataclasses.replace(self, protocol=self.protocol.replaced(**fields))
    except ValueError as e:
      raise ValueError(f'suite {self.name!r}: {e}') from None

  def directory(self, root: str) -> str:
    """Where the suite's files are under a data root (`--data_dir`, config.eval.suite_data):
    `<root>/<name>`, or what a suite whose files share one tree with others says."""
    return paths.join(root, self.name)

  # --- planning ------------------------------------------------------------------------------

  def prompt_text(self, record: Mapping, thinking: bool | None, template: Any) -> str:
    """A record's prompt as the suite samples it, rendered by the policy's chat `template`
    (`launch.plan` measures it): `cascade.rollout.prompt_text` here."""
    from cascade import rollout  # pylint: disable=g-import-not-at-top
    return rollout.prompt_text(record, thinking, template)

  def planned_call(self, prompt_len: int, protocol: Protocol) -> tuple[int, int]:
    """(prompt tokens, new tokens) of the suite's largest sampler call, for its longest
    rendered prompt `prompt_len` under `protocol`: one call of the whole budget here; a suite
    that samples in turns (`sample`) says its own."""
    return prompt_len, protocol.max_new_tokens

  def planned_prompts(self) -> tuple[int, int]:
    """(the longest rendered prompt in tokens, the records it has, 0 when not known) that
    `launch.plan` assumes where it does not read and measure the suite's files."""
    return self.prompt_tokens, self.records

  def judge_use(self, options: Mapping[str, Any]) -> tuple[str, Any] | None:
    """The judge model this suite's grader runs on the policy's devices with `options`: (its
    HF checkpoint directory, how it is called per graded sample: a
    `verifiers.base.JudgeUse`), or None where grading uses none there (no judge, or a judge
    served by other machines)."""
    del options
    return None

  # --- reading -------------------------------------------------------------------------------

  # True for a suite whose records depend on the policy's tokenizer (RULER's lengths are
  # counted in it): its runners give it theirs (`for_tokenizer`) before `read`.
  NEEDS_TOKENIZER = False

  def for_tokenizer(self, tokenizer: Any) -> Suite:
    """This suite reading its records with the policy's `tokenizer` (self where they do not
    depend on it)."""
    del tokenizer
    return self

  def read(self, data_dir: str) -> list[dict]:
    """The suite's records from its files under `data_dir` (local or gs://).

    Raises:
      DataMissing: no file matches; the message names the suite, the directory and the files.
      BadRecord: a record lacks a field (file:line and the field).
    """
    found = []
    for pattern in self.files:
      found.extend(sorted(str(p) for p in paths.path(data_dir).glob(pattern)))
    if not found:
      fetch = ('; `python -m cascade.evaluate --download` fetches it where the machine is online'
               if self.hub_dataset else '')
      raise DataMissing(f'suite {self.name!r}: no {" or ".join(self.files)} under {data_dir} '
                        f'({self.source}{fetch})')
    records = []
    for path in found:
      records.extend(self.parse(path, rows(path)))
    if not records:
      raise DataMissing(f'suite {self.name!r}: {", ".join(found)} hold no records')
    ids = [r['id'] for r in records]
    if len(set(ids)) != len(ids):
      dup = next(i for i in ids if ids.count(i) > 1)
      raise BadRecord(f'suite {self.name!r}: record id {dup!r} appears twice')
    return records

  def parse(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    """The canonical records of one file's raw rows ((line, row) pairs)."""
    raise NotImplementedError

  # --- sampling ------------------------------------------------------------------------------

  def sample(self, policy: Any, records: Sequence[Mapping], key: Any, sampling: Any,
             k: int) -> Sampled:
    """`k` samples of each record by `policy` (`cascade.suites.run.Policy`): one sampler call
    of the prompts rendered in the protocol's thinking mode (`cascade.rollout.generate`). A
    suite whose samples are episodes (an agent acting through tools) overrides it.

    Args:
      policy: the policy (sampler, params, tokenizer).
      records: the batch's records.
      key: the batch's PRNG key.
      sampling: the protocol's `rl.sampler.SamplingParams`.
      k: samples per record.
    """
    from cascade import rollout  # pylint: disable=g-import-not-at-top
    ro = rollout.generate(policy.sampler, policy.params, policy.tokenizer, records,
                          [self.protocol.thinking] * len(records), key, sampling, k)
    n = len(records)
    return Sampled(completions=[ro.completions[i * k:(i + 1) * k] for i in range(n)],
                   lengths=np.asarray(ro.samples.lengths).reshape(n, k),
                   truncated=np.asarray(ro.samples.truncated).reshape(n, k))

  # --- grading and the metric ----------------------------------------------------------------

  def grader(self, **options) -> Grader:
    """A grader for this suite's completions (options: workers, timeout_s, ...)."""
    raise NotImplementedError

  def check_grader_options(self, options: Mapping[str, Any]) -> None:
    """Checks `grader(**options)` before anything is sampled (`--suite_option`,
    config.eval.suite_options): by building the grader and closing it. A suite whose grader
    is costly to build (a judge model to load) or that needs options overrides it.

    Raises:
      ValueError: an option the grader rejects (one line naming the suite).
    """
    if not options:
      return
    try:
      self.grader(**dict(options)).close()
    except (TypeError, ValueError) as e:
      raise ValueError(f'suite {self.name!r}: grader options {sorted(options)}: {e}') from None

  def grader_key(self, options: Mapping[str, Any]) -> Mapping[str, Any]:
    """What of `options` changes a grade (kept in grades.jsonl's header: grades kept with other
    grader options are not resumed). By default all of them."""
    return {k: options[k] for k in sorted(options)}

  def summarize(self, records: Sequence[Mapping], grades: Sequence[Sequence[Graded]]) -> dict:
    """The metric of every record's graded samples.

    Returns:
      {'value', 'stderr' (both in percent), 'metric', 'n' (prompts), 'k' (samples per
      prompt), 'samples', and 'pass@k' for each k in protocol.pass_ks, 'maj@k' when the
      grades carry answers}.
    """
    g = np.array([[x.score for x in row] for row in grades], np.float64)
    mean, se = stats.avg_at_k(g)
    k = g.shape[1]
    # An avg@k metric names the k sampled (a protocol override may have changed it).
    metric = f'avg@{k}' if self.metric.startswith('avg@') else self.metric
    out = {'metric': metric, 'value': 100.0 * mean, 'stderr': 100.0 * se,
           'n': len(records), 'k': k, 'samples': int(g.size)}
    for pk in self.protocol.pass_ks:
      if pk <= k:
        out[f'pass@{pk}'] = 100.0 * stats.pass_at_k(g, pk)
    answers = [[x.answer for x in row] for row in grades]
    if k > 1 and any(a is not None for row in answers for a in row):
      out[f'maj@{k}'] = 100.0 * stats.maj_at_k(g, answers)
    return out

  def protocol_hash(self) -> str:
    """A short hash of what makes two runs of the suite comparable (name, protocol, metric)."""
    blob = json.dumps({'suite': self.name, 'protocol': self.protocol.to_json(),
                       'metric': self.metric, 'version': type(self).VERSION},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]

  # Bumped by a suite module whenever its rendering or grading changes what a score means.
  VERSION = 1


def rows(path: str) -> list[tuple[int, Mapping]]:
  """(line, row) pairs of a .jsonl, .json (a list, or JSON lines), .parquet or .csv file (a
  header row, then one row per record: {column: text}).

  Raises:
    BadRecord: a line is not a JSON object, or a csv row has another number of fields than
      the header (file:line).
  """
  if path.endswith('.parquet'):
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    with paths.open_read(path) as f:
      table = pq.read_table(f)
    return list(enumerate(table.to_pylist(), 1))
  text = paths.read_text(path)
  if path.endswith('.csv'):
    return _csv_rows(path, text)
  if path.endswith('.json'):
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      if e.msg == 'Extra data' and text.lstrip().startswith('{'):
        return _json_lines(path, text)     # JSON lines named .json (BFCL's files)
      raise BadRecord(f'{path}: not JSON ({e.msg} at line {e.lineno})') from None
    if isinstance(data, Mapping) and not ('data' in data or 'rows' in data or all(
        isinstance(v, Mapping) for v in data.values())):
      data = [data]                      # one record: a one-line file of JSON lines
    elif isinstance(data, Mapping):      # {"data": [...]} or {"id": {...}, ...}
      data = data.get('data', data.get('rows', list(data.values())))
    if not isinstance(data, list) or not all(isinstance(r, Mapping) for r in data):
      raise BadRecord(f'{path}: expected a list of objects')
    return list(enumerate(data, 1))
  return _json_lines(path, text)


def _json_lines(path: str, text: str) -> list[tuple[int, Mapping]]:
  out = []
  for i, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise BadRecord(f'{path}:{i}: not JSON ({e.msg})') from None
    if not isinstance(row, Mapping):
      raise BadRecord(f'{path}:{i}: expected a JSON object')
    out.append((i, row))
  return out


def _csv_rows(path: str, text: str) -> list[tuple[int, Mapping]]:
  """(line, {column: text}) of a csv file's rows; a row's line is the one it starts on (a
  quoted field may span lines)."""
  reader = csv.reader(io.StringIO(text.removeprefix('\ufeff'), newline=''))
  out = []
  try:
    header = next(reader, None)
    if header is None:
      return out
    start = reader.line_num + 1
    for row in reader:
      if row and len(row) != len(header):
        raise BadRecord(f'{path}:{start}: {len(row)} fields for {len(header)} columns')
      if row:
        out.append((start, dict(zip(header, row))))
      start = reader.line_num + 1
  except csv.Error as e:
    raise BadRecord(f'{path}:{reader.line_num}: not csv ({e})') from None
  return out


def field(path: str, line: int, row: Mapping, name: str, types=str) -> Any:
  """row[name], or a BadRecord naming file:line and the field."""
  if name not in row:
    raise BadRecord(f'{path}:{line}: missing field {name!r} (has: {", ".join(sorted(row))})')
  value = row[name]
  if not isinstance(value, types):
    want = '/'.join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
    raise BadRecord(f'{path}:{line}: field {name!r} must be {want}, got {type(value).__name__}')
  return value
