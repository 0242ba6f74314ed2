"""The verifier interface: samples in, rewards with reasons out, never an exception.

A `Verifier` scores a batch of `Sample`s. The base class does what every
domain shares: it cuts the thinking block off (a completion whose thinking
never closed gets `thinking_unfinished_reward`), checks each sample's
metadata (malformed metadata scores 0 with the reason), and runs the domain's
check in long-lived worker processes with a wall-clock limit per sample (a
timeout or a crash scores 0 with the reason). Subclasses supply
`_check_metadata`, `_prepare` (host side, per sample) and a worker function.

A sample's failure and the verifier's own bug. An exception escaping
`_check_metadata`, `_prepare` or the worker function scores the sample 0 with
the reason, as a timeout does: a verifier reads hostile text, and a parser the
text trips must cost that sample only. But a bug in the verifier's own code (a
metadata field it misnames, a wrong call) raises for every answer, and scoring
every sample 0 would train on all-zero rewards in silence. So when scoring a
sample raised, its record is scored again with each of `PROBE_ANSWERS` in the
model's place; if that raises for every one of them too, the exception does not
depend on what the model wrote, and the sample's info carries
'verifier_error' (the exception and its last frame) and 'verifier' (the name):
the run counts those and stops (`cascade.verifier_set`). No model output can
set it: the probes are fixed text, scored with the record's own prompt and
metadata, the run's data. A bug that only some answers reach (a parser that
raises on odd text, or on an empty answer) stays that sample's 0 with its reason.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
import traceback
from typing import Any, Mapping, Sequence

from foundation import chat
from verifiers.sandbox import pool as pool_lib

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The answers a sample's record is scored with when scoring the sample raised (see the module
# docstring): plain, wrong for almost every task, and not empty (a verifier may answer an empty
# text before it reads the record, which would hide a bug past that point).
PROBE_ANSWERS = ('0', 'The answer is 0.')


@dataclasses.dataclass(frozen=True)
class Sample:
  """One rollout to score.

  Attributes:
    prompt: the prompt text the model saw.
    completion: the generated text (may contain a thinking block).
    metadata: the dataset record's fields the verifier needs (per domain).
  """
  prompt: str
  completion: str
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Result:
  """A reward and why.

  Attributes:
    reward: the scalar reward.
    info: JSON-serialisable details; always has 'reason'.
  """
  reward: float
  info: dict


def where_error(where: str, message: str) -> ValueError:
  """A ValueError naming the record: 'data/x.jsonl:17: metadata["answer"] ...'."""
  return ValueError(f'{where}: {message}')


def require(metadata: Mapping[str, Any], key: str, types: type | tuple, what: str = '') -> Any:
  """Returns metadata[key], raising a ValueError naming the field when absent or mistyped."""
  if not isinstance(metadata, Mapping):
    raise ValueError(f'metadata must be a dict, got {type(metadata).__name__}')
  if key not in metadata:
    raise ValueError(f'metadata[{key!r}] is missing{f" ({what})" if what else ""}')
  value = metadata[key]
  if not isinstance(value, types) or isinstance(value, bool) and bool not in _as_tuple(types):
    names = '/'.join(t.__name__ for t in _as_tuple(types))
    raise ValueError(f'metadata[{key!r}] must be {names}, got {type(value).__name__}')
  return value


def _as_tuple(types):
  return types if isinstance(types, tuple) else (types,)


_LEADING_BLANK_LINES = re.compile(r'\A(?:[ \t]*\r?\n)+')


def raw_answer(completion: str) -> str:
  """The text after the thinking block with its indentation kept (for code).

  `chat.split_thinking` strips the answer, which would break a completion
  that continues an indented function body; this keeps leading spaces of the
  first line and drops only blank lines and trailing whitespace.
  """
  text = completion
  for stop in (chat.IM_END, chat.ENDOFTEXT):
    if text.endswith(stop):
      text = text[:-len(stop)]
  close = text.find(chat.THINK_CLOSE)
  open_ = text.find(chat.THINK_OPEN)
  if close >= 0 and (open_ < 0 or open_ < close):
    text = text[close + len(chat.THINK_CLOSE):]
  return _LEADING_BLANK_LINES.sub('', text).rstrip()


def worker_popen(spec: str, index: int = 0) -> subprocess.Popen:
  """Starts a `verifiers.sandbox.worker` process serving the function `spec` ('module:fn').

  Args:
    spec: 'module:function'.
    index: the worker's slot in its pool (unused; the pool passes it).
  """
  del index
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get('PYTHONPATH')) if p)
  return subprocess.Popen([sys.executable, '-P', '-m', 'verifiers.sandbox.worker', spec], env=env,
                          **pool_lib.popen_kwargs())


def pool_options(owner: str, workers: int | None, timeout_s: float) -> tuple[int, float]:
  """(workers, timeout_s) checked: workers default min(2, cpu count) and must be >= 1, the
  timeout > 0; errors name `owner`."""
  if workers is None:
    workers = min(2, os.cpu_count() or 1)
  if workers < 1:
    raise ValueError(f'{owner}: workers must be >= 1, got {workers}')
  if not timeout_s > 0:
    raise ValueError(f'{owner}: timeout_s must be > 0, got {timeout_s}')
  return int(workers), float(timeout_s)



@dataclasses.dataclass(frozen=True)
class JudgeUse:
  """How a verifier calls its judge model per scored sample (`Verifier.judge_use`).

  Attributes:
    score_by: 'logits' (one forward per judge row) or 'generate' (greedy completions).
    max_new_tokens: the most tokens the judge writes per row ('generate').
    rows_per_sample: judge rows per scored sample at most (pairwise: both orders; round
      robin: both orders of every pair in a group of G, G - 1 per sample).
    answer_tokens: the most tokens of a policy answer the judge reads (the rest is cut), or
      None where nothing is cut or it is not known; a config whose stage writes longer
      answers for the domain is refused (`cascade.config`).
  """
  score_by: str
  max_new_tokens: int
  rows_per_sample: int
  answer_tokens: int | None = None


class Verifier:
  """Base class; see the module docstring.

  Subclasses set `name` and `worker_fn` ('module:function' run in workers,
  taking the payload from `_prepare` and returning {'reward', 'info'}), and
  override `_check_metadata` and `_prepare`. A verifier is meant to be held
  for a whole stage; it is not thread-safe (one verifier per thread).
  """

  name = ''
  worker_fn = ''
  # The keyword option a learned reward model's scorer is passed in (`(prompts, answers) ->
  # [batch] scores`), for a verifier that takes one ('' = it takes none); the run builds the
  # scorer from the domain's `reward_model_stage` (`cascade.verifier_set`).
  reward_model_option = ''
  # Whether the verifier cannot score at all without that reward model.
  needs_reward_model = False
  # The keyword option a judge model (`rl.judge.JudgeModel`) is passed in ('' = none); a
  # config names its source there as a string ('stage:<name>' or an HF directory) and the run
  # loads it on its mesh (`cascade.verifier_set`).
  judge_option = ''

  @classmethod
  def judge_use(cls, options: Mapping[str, Any], group_size: int) -> 'JudgeUse | None':
    """How this verifier, with these config options, calls its judge model (None: it takes
    none); `launch.plan` counts the judge's programs, memory and time from it.

    Args:
      options: the domain's verifier options as the config gives them.
      group_size: the rollouts per prompt of the stage whose samples it scores.
    """
    del options, group_size
    return None

  def __init__(self, *, thinking_unfinished_reward: float | None = 0.0, workers: int | None = None,
               timeout_s: float = 10.0):
    """Common options.

    Args:
      thinking_unfinished_reward: reward of a completion whose thinking block
        never closed.
      workers: worker processes (default min(2, cpu count)).
      timeout_s: wall-clock limit per sample, in seconds.
    """
    self.workers, self.timeout_s = pool_options(self.name, workers, timeout_s)
    self.thinking_unfinished_reward = thinking_unfinished_reward
    self._pool = None

  @property
  def isolation(self) -> str:
    """The isolation candidates' code runs under; 'n/a' for verifiers that run no code.

    Sandboxed verifiers return 'bwrap' or 'none'; the stage loop records it.
    """
    return 'n/a'

  # -- metadata ------------------------------------------------------------

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any], **options: Any) -> None:
    """Raises ValueError (without the record's name) when metadata is malformed."""
    if not isinstance(metadata, Mapping):
      raise ValueError(f'metadata must be a dict, got {type(metadata).__name__}')

  @classmethod
  def validate_metadata_for(cls, metadata: Mapping[str, Any], where: str, **options: Any) -> None:
    """Like `validate_metadata`, for a verifier with `options`, without building one."""
    try:
      cls._check_metadata(metadata, **options)
    except ValueError as e:
      raise where_error(where, str(e)) from None

  def _options(self) -> dict:
    """Options that change what valid metadata is (see swe's execution mode)."""
    return {}

  def validate_metadata(self, metadata: Mapping[str, Any], where: str) -> None:
    """Checks a dataset record's metadata at load time.

    Args:
      metadata: the record's metadata.
      where: names the record, e.g. 'data/math.jsonl:17'.

    Raises:
      ValueError: naming `where` and the offending field.
    """
    self.validate_metadata_for(metadata, where, **self._options())

  # -- scoring -------------------------------------------------------------

  def _prepare(self, sample: Sample, answer: str) -> dict | Result:
    """Host-side step per sample: a payload for the worker, or a final Result."""
    raise NotImplementedError

  def _finish(self, samples: Sequence[Sample], results: list[Result]) -> list[Result]:
    """Batch-level step after the workers (e.g. reward-model mixing)."""
    return results

  def _split(self, sample: Sample) -> tuple[str, Result | None]:
    """The answer to score, or the Result for an unfinished thinking block."""
    split = chat.split_thinking(sample.completion)
    if not split.finished_thinking:
      return '', Result(float(self.thinking_unfinished_reward or 0.0),
                        {'reason': 'thinking block never closed', 'thinking': 'unfinished'})
    return split.answer, None

  def _run(self, payloads: list[dict]) -> list[pool_lib.Outcome]:
    if self._pool is None:
      # A partial, not a closure over self: the pool must not keep the
      # verifier alive, so that dropping the verifier stops its workers.
      self._pool = pool_lib.ProcessPool(functools.partial(worker_popen, self.worker_fn),
                                        self.workers, name=f'verifier[{self.name}]')
    return self._pool.run(payloads, [self.timeout_s] * len(payloads))

  def _host_step(self, sample: Sample) -> dict | Result:
    """The per-sample host side: the thinking split, the metadata check, `_prepare`."""
    answer, early = self._split(sample)
    if early is not None:
      return early
    try:
      self._check_metadata(sample.metadata, **self._options())
    except ValueError as e:
      return Result(0.0, {'reason': f'bad metadata: {e}'})
    return self._prepare(sample, answer)

  def score(self, samples: Sequence[Sample]) -> list[Result]:
    """Scores a batch.

    Args:
      samples: the rollouts.

    Returns:
      One Result per sample, in order. Exceptions, timeouts and malformed
      metadata give reward 0 with the reason in info (an exception the
      verifier raises whatever the answer also gives 'verifier_error', see the
      module docstring); nothing raises except a verifier whose workers cannot
      start at all.
    """
    results: list[Result | None] = [None] * len(samples)
    jobs, payloads, raised = [], [], []
    for i, sample in enumerate(samples):
      try:
        early = self._host_step(sample)
      except Exception as e:  # pylint: disable=broad-except
        early = Result(0.0, {'reason': f'error: {type(e).__name__}: {e}'})
        raised.append(i)
      if isinstance(early, Result):
        results[i] = early
      else:
        jobs.append(i)
        payloads.append(early)
    if payloads:
      for i, outcome in zip(jobs, self._run(payloads)):
        results[i] = _to_result(outcome)
        if _worker_error(outcome) is not None:
          raised.append(i)
    if raised:
      self._blame(samples, results, raised)
    return self._finish(samples, results)

  def _blame(self, samples: Sequence[Sample], results: list, raised: list[int]) -> None:
    """Marks the samples in `raised` whose verifier raises on their record whatever the answer
    ('verifier_error'); each record is probed once."""
    own: dict[tuple, str | None] = {}
    for i in raised:
      s = samples[i]
      key = (id(s.metadata), s.prompt)
      if key not in own:
        own[key] = self.own_error(s.prompt, s.metadata)
      if own[key] is not None:
        results[i] = Result(results[i].reward, dict(results[i].info, verifier_error=own[key],
                                                    verifier=self.name or type(self).__name__))

  def own_error(self, prompt: str, metadata: Mapping[str, Any]) -> str | None:
    """The error this verifier raises on a record with every one of `PROBE_ANSWERS`, as one line
    ('KeyError: 'answr' at my_verifier.py:12 in _prepare'), or None when one of them scores.

    Args:
      prompt: the record's prompt, as samples carry it.
      metadata: the record's metadata.
    """
    errors, payloads = [], []
    for text in PROBE_ANSWERS:
      try:
        out = self._host_step(Sample(prompt, text, metadata))
      except Exception as e:  # pylint: disable=broad-except
        errors.append(describe(e))
        continue
      if isinstance(out, Result):
        return None
      payloads.append(out)
    for outcome in self._run(payloads) if payloads else ():
      err = _worker_error(outcome)
      if err is None:
        return None
      errors.append(err)
    return errors[0]

  def close(self) -> None:
    """Stops the worker processes (they restart if `score` is called again)."""
    if self._pool is not None:
      self._pool.close()
      self._pool = None

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def describe(e: BaseException) -> str:
  """An exception on one line with its last frame: "KeyError: 'answr' at x.py:12 in _prepare"."""
  msg = ' '.join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
  text = f'{type(e).__name__}: {msg[:300]}' if msg else type(e).__name__
  frames = traceback.extract_tb(e.__traceback__)
  if not frames:
    return text
  last = frames[-1]
  where = os.path.relpath(last.filename)
  where = last.filename if where.startswith('..') else where
  return f'{text} at {where}:{last.lineno} in {last.name}'


def _worker_error(outcome: pool_lib.Outcome) -> str | None:
  """The exception the worker function raised for a request, on one line (None: it answered,
  or it timed out or died, which is no exception of its code)."""
  if not outcome.ok or not isinstance(outcome.value, dict) or 'error' not in outcome.value:
    return None
  where = outcome.value.get('where')
  return f'{outcome.value["error"]}' + (f' at {where}' if where else '')


def _to_result(outcome: pool_lib.Outcome) -> Result:
  if not outcome.ok:
    return Result(0.0, {'reason': outcome.error})
  value = outcome.value
  if not isinstance(value, dict) or 'error' in value:
    err = value.get('error') if isinstance(value, dict) else f'malformed answer {value!r:.200}'
    return Result(0.0, {'reason': f'error: {err}'})
  return Result(float(value['reward']), dict(value.get('info') or {}))
