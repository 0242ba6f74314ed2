"""Runs one suite on one policy: prompts sampled by the suite's protocol, graded as batches end,
kept batch by batch so a killed evaluation resumes, reduced to the suite's metric.

  policy = run.Policy(sampler, params, tokenizer, identity='runs/tiny/stages/06_swe_rl/hf@3f2c')
  result = run.run_suite(suites.get('tiny_math'), records, policy, out_dir='runs/tiny_eval')
  result['value'], result['stderr'], result['pass@4'], result['protocol']

Each batch of `batch_size` records is rendered in the protocol's thinking mode
(`cascade.rollout`, `foundation.chat`, as the stages render theirs), sampled
`protocol.samples` times with the protocol's temperature, top-p, top-k and
`max_new_tokens` through the policy's `rl.sampler.Sampler` (whichever engine it was
built with: the paged one samples at the suites' lengths; `Suite.sample`, which a suite
whose samples are agent episodes overrides), and graded by the suite's `Grader` while the
next batch samples. Batch b samples with
`fold_in(fold_in(PRNGKey(seed), crc32(suite)), b)`, so a batch's completions do not
depend on which batches ran before it, in this process or in an earlier one.

What is kept, `<out_dir>/<suite>/grades.jsonl` (process 0 writes it, through
`foundation.paths.AppendFile`: local or gs://):

  {"header": {"suite", "protocol" (its hash), "policy" (its identity), "records" (a hash of
              the records' ids and prompts), "batch_size", "seed", "settings" (the protocol),
              "grader" (with grader options: `Suite.grader_key`'s, e.g. the judge)}}
  {"batch": b, "ids": [...], "grades": [[{"score", "answer", "info"}, ...k], ...],
   "lengths": [[...]], "truncated": [[...]]}                        one line per batch

A rerun with the same header samples only the batches the file lacks (a line a kill cut
short is ignored); a different protocol, policy, record set, batch size or seed starts
the file afresh, saying so. Every number of the result is computed from the grades as
the file holds them, so a resumed evaluation's result equals an uninterrupted one's.

With several JAX processes every process samples every batch (the sampler is one
program over the mesh) and grades its share of the batch's records; the shares are
exchanged (`cascade.rollout.Hosts`), so each grade is computed once and every process
returns the same result.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import time
import zlib
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from cascade import rollout
from cascade.suites import base
from foundation import paths
from rl import sampler as sampler_lib

GRADES = 'grades.jsonl'
# A grade's info kept in grades.jsonl: its plain values, text cut to this many characters.
INFO_CHARS = 300


@dataclasses.dataclass(frozen=True)
class Policy:
  """What samples a suite's prompts.

  Attributes:
    sampler: an `rl.sampler.Sampler` of the policy's architecture.
    params: its params (or the sampler's prepared rollout copy).
    tokenizer: the policy's tokenizer.
    identity: names the weights (a checkpoint's path and fingerprint, a run's row): kept
      grades are reused only for the same identity.
  """
  sampler: Any
  params: Any
  tokenizer: Any
  identity: str


class Stopped(Exception):
  """`run_suite` stopped before a batch because its `stop` asked it to (what it graded is kept).

  Attributes:
    why: what `stop` returned (e.g. 'SIGTERM').
    where: e.g. "suite 'tiny_math' before batch 3/8".
  """

  def __init__(self, why: str, where: str):
    super().__init__(f'{why}: stopped at {where}')
    self.why, self.where = why, where


def with_judge_loader(suite: base.Suite, options: Mapping | None,
                      load: Callable[[str], Any] | None) -> dict:
  """A suite's grader options with its local judge's loader (`judge_model=`: `load(DIR)`, called
  when the grader is built, i.e. only if a batch is left to grade), where the suite runs one
  (`Suite.judge_use`, ArenaHard's judge=DIR): the judge then loads on the run's devices as
  `launch.plan` plans it. The loader changes no grade (not in grades.jsonl's header)."""
  options = dict(options or {})
  use = suite.judge_use(options) if load is not None else None
  if use is None:
    return options
  path = use[0]
  return {**options, 'judge_model': lambda: load(path)}


def sampling_params(protocol: base.Protocol) -> sampler_lib.SamplingParams:
  """The sampler's settings of a suite's protocol."""
  return sampler_lib.SamplingParams(temperature=protocol.temperature, top_p=protocol.top_p,
                                    top_k=protocol.top_k, greedy=protocol.greedy,
                                    max_new_tokens=protocol.max_new_tokens)


def records_hash(records: Sequence[Mapping]) -> str:
  """A short hash of the records' ids and prompts (what the kept grades were sampled from)."""
  blob = json.dumps([[r['id'], r['messages']] for r in records], sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _plain_info(info: Mapping) -> dict:
  """The JSON-plain part of a grade's info (numbers, bools, short text): what grades.jsonl keeps."""
  out = {}
  for k, v in (info or {}).items():
    if isinstance(v, (bool, int, float)) or v is None:
      out[str(k)] = v
    elif isinstance(v, str):
      out[str(k)] = v[:INFO_CHARS]
  return out


def _answer_json(a):
  """An answer as JSON (a tuple as a list; anything else not plain as its repr)."""
  if a is None or isinstance(a, (bool, int, float, str)):
    return a
  if isinstance(a, (tuple, list)):
    return [_answer_json(x) for x in a]
  return repr(a)


def _answer_back(a):
  """An answer read back from JSON, hashable again (a list as a tuple)."""
  return tuple(_answer_back(x) for x in a) if isinstance(a, list) else a


def _grade_json(g: base.Graded) -> dict:
  score = float(g.score)
  if not np.isfinite(score):
    raise ValueError(f'a grade of {score} (grades must be finite numbers in [0, 1])')
  return {'score': score, 'answer': _answer_json(g.answer), 'info': _plain_info(g.info)}


def _grade_back(x: Mapping) -> base.Graded:
  return base.Graded(score=float(x['score']), answer=_answer_back(x.get('answer')),
                     info=dict(x.get('info') or {}))


def _read_kept(path: str, header: dict) -> tuple[dict[int, dict], str]:
  """(batch -> its line, why nothing was kept: '' when the header matched or no file)."""
  if not paths.exists(path):
    return {}, ''
  lines = paths.read_text(path).splitlines()
  parsed = []
  for line in lines:
    try:
      parsed.append(json.loads(line))
    except json.JSONDecodeError:      # a line a kill cut short: that batch is sampled again
      continue
  head = parsed[0].get('header') if parsed and isinstance(parsed[0], dict) else None
  if head != header:
    if not isinstance(head, dict):
      return {}, 'it has no header'
    changed = [k for k in header if head.get(k) != header[k]]
    return {}, f'its {", ".join(changed) or "header"} differ(s) from this evaluation\'s'
  kept = {}
  for rec in parsed[1:]:
    if isinstance(rec, dict) and isinstance(rec.get('batch'), int):
      kept[rec['batch']] = rec
  return kept, ''


class _Writer:
  """grades.jsonl of one suite: a fresh header, or appends after a matching one (process 0)."""

  def __init__(self, path: str, header: dict, fresh: bool, enabled: bool,
               before_write: Callable[[], None] | None):
    self.enabled = enabled
    self._file = None
    if not enabled:
      return
    if before_write is not None:
      before_write()
    if fresh:
      paths.write_text(path, json.dumps({'header': header}) + '\n')
    self._file = paths.AppendFile(path, before_write=before_write)

  def append(self, line: dict) -> None:
    if self._file is not None:
      self._file.write(json.dumps(line, allow_nan=False) + '\n')
      self._file.flush(force=True)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


def _shared(hosts: rollout.Hosts, payload: Any) -> Any:
  """Process 0's `payload` (JSON) on every process."""
  if hosts.count == 1:
    return payload
  return json.loads(hosts.exchange(json.dumps(payload).encode())[0])


def _grade_on_hosts(grader: base.Grader, chunk: Sequence[Mapping], comps: list[list[str]],
                    hosts: rollout.Hosts) -> list[list[dict]]:
  """Every record's grades (as JSON), each graded once: on several processes each grades its
  share of the records and the shares are exchanged (a failure on any stops all of them)."""
  if hosts.count == 1:
    got = grader.grade_batch(chunk, comps)
    return [[_grade_json(g) for g in row] for row in got]
  share = np.array_split(np.arange(len(chunk)), hosts.count)[hosts.index]
  try:
    got = grader.grade_batch([chunk[i] for i in share], [comps[i] for i in share])
    body = json.dumps({'grades': [[_grade_json(g) for g in row] for row in got]})
  except Exception as e:  # pylint: disable=broad-except
    body = json.dumps({'error': f'{type(e).__name__}: {e}'})
  out = []
  for h, payload in enumerate(hosts.exchange(body.encode())):
    p = json.loads(payload)
    if 'error' in p:
      raise RuntimeError(f'grading failed on process {h} of {hosts.count} (every process stops '
                         f'here): {p["error"]}')
    out.extend(p['grades'])
  return out


def run_suite(suite: base.Suite, records: Sequence[Mapping], policy: Policy, out_dir: str, *,
              seed: int = 0, batch_size: int = 64, grader_options: Mapping | None = None,
              stop: Callable[[], str | None] | None = None, hosts: rollout.Hosts | None = None,
              before_write: Callable[[], None] | None = None,
              say: Callable[[str], None] | None = None) -> dict:
  """Samples, grades and scores `suite` on `records` (resuming what `out_dir` kept).

  Args:
    suite: the suite (its protocol as it should run: `Suite.with_protocol` for overrides).
    records: its records (`suite.read`, cut to the prompts wanted), each with 'messages'.
    policy: the policy to evaluate.
    out_dir: where `<suite>/grades.jsonl` is kept (local or gs://).
    seed: the sampling seed (batch keys derive from it and the suite's name).
    batch_size: records per sampler call (each sampled `protocol.samples` times).
    grader_options: keyword options of `suite.grader` (workers, timeout_s, a judge's url,
      ...); what of them changes a grade (`suite.grader_key`) is kept in the header.
    stop: asked before each batch still to sample; an answer stops there (`Stopped`), with
      every batch sampled so far graded and kept.
    hosts: the processes sharing the grading (default: this run's JAX processes).
    before_write: runs before every write to `out_dir` (a run's workdir-lock check).
    say: prints a line (None: nothing printed).

  Returns:
    `suite.summarize`'s dict ('metric', 'value', 'stderr', 'n', 'k', 'samples', 'pass@k',
    'maj@k') plus 'suite', 'title', 'protocol' (its hash), 'settings' (the protocol),
    'mean_len', 'truncated' (fractions of samples that hit max_new_tokens), 'seconds'
    (this call's), 'resumed' (batches taken from out_dir).

  Raises:
    Stopped: `stop` answered.
    ValueError: no records, or a record without messages.
  """
  if not records:
    raise ValueError(f'suite {suite.name!r}: no records to evaluate')
  if batch_size < 1:
    raise ValueError(f'batch_size={batch_size} must be >= 1')
  hosts = rollout.processes() if hosts is None else hosts
  say = say if say is not None and hosts.index == 0 else (lambda _: None)
  t0 = time.perf_counter()
  proto = suite.protocol
  sp, k = sampling_params(proto), proto.samples
  header = {'suite': suite.name, 'protocol': suite.protocol_hash(), 'policy': policy.identity,
            'records': records_hash(records), 'batch_size': int(batch_size), 'seed': int(seed),
            'settings': proto.to_json()}
  if grader_options:   # kept grades are resumed only under the same judge, baseline, ...
    header['grader'] = json.loads(json.dumps(suite.grader_key(grader_options), sort_keys=True,
                                             default=lambda o: type(o).__name__))
  path = paths.join(out_dir, suite.name, GRADES)
  kept, why = _shared(hosts, _read_kept(path, header) if hosts.index == 0 else None)
  kept = {int(b): v for b, v in kept.items()}
  if why:
    say(f'suite {suite.name}: {path} is not resumed ({why}); evaluating afresh')
  elif kept:
    say(f'suite {suite.name}: resuming, {len(kept)} batch(es) kept in {path}')
  starts = list(range(0, len(records), batch_size))
  lines: dict[int, dict] = {b: kept[b] for b in kept if b < len(starts)}
  key = jax.random.fold_in(jax.random.PRNGKey(seed), zlib.crc32(suite.name.encode()) & 0x7FFFFFFF)
  todo = [b for b in range(len(starts)) if b not in lines]
  writer = _Writer(path, header, fresh=not lines, enabled=hosts.index == 0 and bool(todo),
                   before_write=before_write)
  # One grading thread: batch b is graded while batch b + 1 samples. With several processes the
  # grading exchanges shares (a collective), so it runs in step with the sampler instead.
  pool = concurrent.futures.ThreadPoolExecutor(1) if hosts.count == 1 else None
  pending: concurrent.futures.Future | None = None

  def finish(fut):
    b, line = fut.result()
    lines[b] = line
    writer.append(line)

  try:
    # No grader (no worker pools) when every batch was kept.
    with (suite.grader(**dict(grader_options or {})) if todo
          else contextlib.nullcontext()) as grader:
      try:
        for b in todo:
          start = starts[b]
          reason = stop() if stop is not None else None
          if reason:
            if pending is not None:
              finish(pending)
              pending = None
            raise Stopped(reason, f'suite {suite.name!r} before batch {b + 1}/{len(starts)}')
          chunk = list(records[start:start + batch_size])
          got = suite.sample(policy, chunk, jax.random.fold_in(key, b), sp, k)
          comps = [list(c) for c in got.completions]
          lens = np.asarray(got.lengths).reshape(len(chunk), k)
          trunc = np.asarray(got.truncated).reshape(len(chunk), k)

          def grade(b=b, chunk=chunk, comps=comps, lens=lens, trunc=trunc):
            grades = _grade_on_hosts(grader, chunk, comps, hosts)
            if len(grades) != len(chunk) or any(len(g) != k for g in grades):
              raise RuntimeError(f'suite {suite.name!r}: its grader returned grades of another '
                                 f'shape than {len(chunk)} records x {k} samples')
            return b, {'batch': b, 'ids': [r['id'] for r in chunk], 'grades': grades,
                       'lengths': lens.tolist(), 'truncated': trunc.astype(bool).tolist()}

          if pending is not None:
            finish(pending)
            pending = None
          if pool is None:
            b_, line = grade()
            lines[b_] = line
            writer.append(line)
          else:
            pending = pool.submit(grade)
        if pending is not None:
          finish(pending)
          pending = None
      finally:
        # An error while the last batch grades: the grader stays open until that grade ends,
        # and a batch that graded is kept.
        if pending is not None and pending.exception() is None:
          finish(pending)
  finally:
    if pool is not None:
      pool.shutdown(wait=True)
    writer.close()
  return _result(suite, records, [lines[b] for b in range(len(starts))],
                 sum(b < len(starts) for b in kept), time.perf_counter() - t0)


def _result(suite: base.Suite, records: Sequence[Mapping], lines: Sequence[dict],
            resumed: int, seconds: float) -> dict:
  """The suite's metric from its batches' lines (as grades.jsonl holds them)."""
  ids = [i for line in lines for i in line['ids']]
  if ids != [r['id'] for r in records]:
    raise RuntimeError(f'suite {suite.name!r}: the kept batches do not hold the records in order')
  grades = [[_grade_back(g) for g in row] for line in lines for row in line['grades']]
  lens = np.array([x for line in lines for x in line['lengths']], np.float64)
  trunc = np.array([x for line in lines for x in line['truncated']], np.float64)
  out = dict(suite.summarize(records, grades))
  out.update(suite=suite.name, title=suite.title, protocol=suite.protocol_hash(),
             settings=suite.protocol.to_json(), mean_len=float(lens.mean()),
             truncated=float(trunc.mean()), seconds=round(float(seconds), 3),
             resumed=int(resumed))
  return out
