"""LiveCodeBench code generation, release windows v5 and v6, run in the project's sandbox.

Records, as released in livecodebench/code_generation_lite (test.jsonl, test2.jsonl, ...,
test6.jsonl; each release adds one file): 'question_title', 'question_content', 'platform'
('leetcode', 'atcoder', 'codeforces'), 'question_id', 'contest_id', 'contest_date'
(ISO 8601, '2024-08-03T00:00:00'), 'starter_code' ('' for stdin problems), 'difficulty',
'public_test_cases' (a JSON string: [{'input', 'output', 'testtype'}], testtype 'stdin' or
'functional'), 'private_test_cases' (the same list as a JSON string, pickled, zlib-compressed,
base64-encoded; older rows hold the JSON string itself) and 'metadata' (a JSON string;
'func_name' for functional problems).

The pickled tests come from a downloaded file, and unpickling runs whatever a pickle names,
so they are read by `RestrictedUnpickler`, which builds plain data only (str, bytes, int,
float, bool, None, list, tuple, dict): a pickle that names any class or function, or asks
for a persistent id, is a BadRecord naming file:line, and nothing it names is imported or
called.

Windows (problems kept by 'contest_date', start inclusive, end exclusive), as the papers and
LiveCodeBench's leaderboard slice the releases: v5 2024-08-01 .. 2025-02-01 (279 problems
of release_v5), v6 2025-02-01 .. 2025-05-01 (175 problems of release_v6), the counts the
reports citing these windows give. A suite reads every test*.jsonl
under its directory and keeps the rows in its window, so either release's files serve.

Prompt: LiveCodeBench's own (lcb_runner/prompts/code_generation.py, the generic chat
format): its system message, then '### Question:' with the statement and '### Format:'
with either the starter code to complete or the stdin/stdout instruction and a '# YOUR
CODE HERE' block, then '### Answer: (use the provided format with backticks)'.

Grading: the project's `code` verifier in its bubblewrap sandbox, on public and private
tests together, each test with LiveCodeBench's per-test limit of 6 s of wall clock
(`verifiers.code`: stdin tests compared as LCB's `grade_stdio` compares, line by line with
decimal tokens; functional tests as `Solution().<func_name>(*json args)` equal to the JSON
output, a tuple counting as a list). The code is the answer's last fenced Python block.

Protocol (Cascade 1, arXiv 2512.13607: 64K tokens, temperature 0.6, top-p 0.95): 8 samples
per problem, the metric pass@1 as avg@8 with its standard error over problems (the papers
report pass@1; the k they average over is not stated in what could be read here, and 8 is
the usual choice for LCB at this length), pass@k by the unbiased estimator.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import io
import json
import pickle
import zlib
from typing import Any, Mapping, Sequence

from cascade.suites import base
from cascade.suites import graders
import verifiers

SYSTEM = ('You are an expert Python programmer. You will be given a question (problem '
          'specification) and will generate a correct Python program that matches the '
          'specification and passes all tests.')
WITH_STARTER = ('You will use the following starter code to write the solution to the problem '
                'and enclose your code within delimiters.')
WITHOUT_STARTER = ('Read the inputs from stdin solve the problem and write the answer to stdout '
                   '(do not directly test on the sample inputs). Enclose your code within '
                   'delimiters as follows. Ensure that when the python program runs, it reads '
                   'the inputs, runs the algorithm and writes output to STDOUT.')
# LiveCodeBench's runner's per-test timeout (seconds).
TIME_LIMIT_S = 6.0
# Largest decompressed private-test blob read (the largest released ones are ~100 MB).
MAX_TESTS_BYTES = 1 << 30


def prompt(content: str, starter_code: str) -> str:
  """The user turn of a problem, as LiveCodeBench renders it."""
  text = f'### Question:\n{content}\n\n'
  if starter_code:
    text += f'### Format: {WITH_STARTER}\n```python\n{starter_code}\n```\n\n'
  else:
    text += f'### Format: {WITHOUT_STARTER}\n```python\n# YOUR CODE HERE\n```\n\n'
  return text + '### Answer: (use the provided format with backticks)\n\n'


class RestrictedUnpickler(pickle.Unpickler):
  """An unpickler that builds plain data only: any global (class, function) or persistent id
  is refused before it is looked up, so a hostile pickle runs nothing."""

  def find_class(self, module: str, name: str) -> Any:
    raise pickle.UnpicklingError(f'refused global {module}.{name} (plain data only)')

  def persistent_load(self, pid: Any) -> Any:
    raise pickle.UnpicklingError('refused persistent id (plain data only)')


_PLAIN = (str, bytes, int, float, bool, type(None))


def _is_plain(value: Any, depth: int = 0) -> bool:
  if depth > 100:
    return False
  if isinstance(value, _PLAIN):
    return True
  if isinstance(value, (list, tuple)):
    return all(_is_plain(v, depth + 1) for v in value)
  if isinstance(value, dict):
    return all(_is_plain(k, depth + 1) and _is_plain(v, depth + 1) for k, v in value.items())
  return False


def restricted_loads(data: bytes) -> Any:
  """The plain value a pickle holds.

  Raises:
    pickle.UnpicklingError: it names a class or function, or is not a pickle.
  """
  value = RestrictedUnpickler(io.BytesIO(data)).load()
  if not _is_plain(value):
    raise pickle.UnpicklingError(f'not plain data: {type(value).__name__}')
  return value


def private_tests(text: str, where: str) -> list:
  """The released 'private_test_cases' field: a JSON list, or base64(zlib(pickle(JSON))).

  Raises:
    base.BadRecord: it is neither, or its pickle is not plain data (names `where`).
  """
  if text.lstrip().startswith('['):
    try:
      return json.loads(text)
    except json.JSONDecodeError as e:
      raise base.BadRecord(f'{where}: private_test_cases is not JSON ({e.msg})') from None
  try:
    packed = base64.b64decode(text, validate=True)
    inflater = zlib.decompressobj()
    raw = inflater.decompress(packed, MAX_TESTS_BYTES)
    if inflater.unconsumed_tail:
      raise base.BadRecord(f'{where}: private_test_cases inflate past {MAX_TESTS_BYTES} bytes')
    value = restricted_loads(raw)
  except (ValueError, zlib.error, pickle.UnpicklingError, EOFError, IndexError,
          TypeError) as e:
    if isinstance(e, base.BadRecord):
      raise
    raise base.BadRecord(f'{where}: private_test_cases is not base64(zlib(pickle)) of plain '
                         f'data ({type(e).__name__}: {str(e)[:200]})') from None
  if isinstance(value, bytes):
    value = value.decode('utf-8', errors='replace')
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError as e:
      raise base.BadRecord(f'{where}: private_test_cases unpickles to non-JSON '
                           f'({e.msg})') from None
  return value


def _tests(value: Any, where: str, name: str) -> list[dict]:
  if not isinstance(value, list):
    raise base.BadRecord(f'{where}: {name} must be a list of tests')
  out = []
  for k, t in enumerate(value):
    if not (isinstance(t, Mapping) and isinstance(t.get('input'), str)
            and isinstance(t.get('output'), str)
            and t.get('testtype') in ('stdin', 'functional')):
      raise base.BadRecord(f'{where}: {name}[{k}] must be {{"input": str, "output": str, '
                           f'"testtype": "stdin"|"functional"}}')
    out.append({'input': t['input'], 'output': t['output'], 'testtype': t['testtype']})
  return out


def _date(text: str, where: str) -> datetime.date:
  try:
    return datetime.datetime.fromisoformat(text).date()
  except ValueError:
    raise base.BadRecord(f'{where}: contest_date {text[:40]!r} is not an ISO date') from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LiveCodeBenchSuite(base.Suite):
  """LiveCodeBench problems in a release window.

  Attributes:
    start: first contest date kept (ISO, inclusive).
    end: first contest date not kept (ISO, exclusive).
    time_limit_s: wall-clock limit of each test.
  """
  start: str
  end: str
  time_limit_s: float = TIME_LIMIT_S

  def parse(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    start, end = datetime.date.fromisoformat(self.start), datetime.date.fromisoformat(self.end)
    out = []
    for line, row in raw:
      where = f'{path}:{line}'
      date = _date(base.field(path, line, row, 'contest_date'), where)
      if not start <= date < end:
        continue
      content = base.field(path, line, row, 'question_content')
      starter = base.field(path, line, row, 'starter_code')
      try:
        public = json.loads(base.field(path, line, row, 'public_test_cases'))
        meta = json.loads(base.field(path, line, row, 'metadata') or '{}')
      except json.JSONDecodeError as e:
        raise base.BadRecord(f'{where}: public_test_cases or metadata is not JSON '
                             f'({e.msg})') from None
      tests = (_tests(public, where, 'public_test_cases')
               + _tests(private_tests(base.field(path, line, row, 'private_test_cases'), where),
                        where, 'private_test_cases'))
      if not tests:
        raise base.BadRecord(f'{where}: the problem has no tests')
      func_name = meta.get('func_name') if isinstance(meta, Mapping) else None
      if any(t['testtype'] == 'functional' for t in tests) and not (
          isinstance(func_name, str) and func_name.isidentifier()):
        raise base.BadRecord(f"{where}: functional tests need metadata's func_name")
      out.append({
          'id': str(base.field(path, line, row, 'question_id', (str, int))),
          'messages': [{'role': 'system', 'content': SYSTEM},
                       {'role': 'user', 'content': prompt(content, starter)}],
          'metadata': {'tests': tests, 'func_name': func_name,
                       'time_limit_s': self.time_limit_s,
                       'platform': row.get('platform'), 'difficulty': row.get('difficulty'),
                       'contest_date': date.isoformat()}})
    return out

  def grader(self, **options) -> graders.VerifierGrader:
    return graders.VerifierGrader(verifiers.get('code', **options), graders.plain)


PROTOCOL = base.Protocol(samples=8, temperature=0.6, top_p=0.95, max_new_tokens=65536,
                         thinking=True, pass_ks=(1, 8))
_C1 = 'arXiv 2512.13607 (Nemotron-Cascade), 14B-Thinking after each stage'
_C1_FINAL = 'arXiv 2512.13607 (Nemotron-Cascade), 14B-Thinking final model'
_C2 = 'arXiv 2603.19220 (Nemotron-Cascade 2), final model'
_STAGES = ('sft_32k', 'rlhf', 'if_rl_ifbench', 'math_rl', 'code_rl', 'swe_rl')
_SOURCE = 'livecodebench/code_generation_lite (test*.jsonl)'
# launch.plan's bound on a rendered problem with its examples and starter code (ours, assumed)
# where it does not measure the files.
PROMPT_TOKENS = 4096

lcb_v5 = LiveCodeBenchSuite(
    name='lcb_v5', title='LiveCodeBench v5 (2024-08 .. 2025-01)', metric='avg@8',
    protocol=PROTOCOL, source=_SOURCE, files=('test*.jsonl',), prompt_tokens=PROMPT_TOKENS, start='2024-08-01',
    end='2025-02-01', hub_dataset='livecodebench/code_generation_lite',
    reported=(base.Reported(recipe='nemotron_cascade_14b', stage='swe_rl', value=77.5,
                            source=_C1_FINAL),))

lcb_v6 = LiveCodeBenchSuite(
    name='lcb_v6', title='LiveCodeBench v6 (2025-02 .. 2025-04)', metric='avg@8',
    protocol=PROTOCOL, source=_SOURCE, files=('test*.jsonl',), prompt_tokens=PROMPT_TOKENS, start='2025-02-01',
    end='2025-05-01', hub_dataset='livecodebench/code_generation_lite',
    reported=(tuple(base.Reported(recipe='nemotron_cascade_14b', stage=s, value=v, source=_C1)
                    for s, v in zip(_STAGES, (63.1, 72.3, 72.7, 72.4, 74.8, 74.6)))
              + (base.Reported(recipe='nemotron_cascade2', stage='final', value=87.2,
                               source=_C2),)))
