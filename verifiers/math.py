"""Math verifier: the final answer, compared with the gold one by `math-verify`.

The answer is the last `\\boxed{...}` (or `\\fbox{...}`) after the thinking
block; without one, the last "final answer is X" / "the answer is X" /
"Answer: X" line. Equivalence is math-verify's (fractions, decimals,
percentages, LaTeX, sets, intervals, equations, symbolic expressions). Gold
answers given as raw LaTeX are wrapped in `$...$`, which math-verify parses
reliably.

Parsing hostile text is bounded. math-verify's LaTeX parser (ANTLR) spends
tens of milliseconds per level of brackets it has not met before, so a
kilobyte of nested parentheses took seconds. An answer longer than
MAX_ANSWER_CHARS or with brackets ('(', '[', '{', '\\{', '\\left(') open more
than MAX_NESTING deep is refused (reward 0, with the reason) before
math-verify sees it. Extraction and that refusal are linear scans (a megabyte
of hostile text takes well under a second), so they run on the host first, as
the thinking split does: a completion with no final answer, or one refused,
is scored there (`screen`) and never waits for a worker, nor starts one. What
is left runs in worker processes, in their main
thread, where math-verify's own parsing timeout (SIGALRM; it fails outside a
main thread, so a call from another thread runs without it) stops a parse
that still stalls after `parse_timeout_s` (a third of the verifier's
`timeout_s`, whole seconds): reward 0, 'parse timed out', and the worker goes
on serving. The pool kills a worker past `timeout_s` (a comparison that
sympy cannot settle, work in C that no signal interrupts) and starts another.

Metadata: {'answer': str | int | float}.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any, Mapping

from verifiers import base

_BOX = re.compile(r'\\(?:boxed|fbox)\b\s*')
# The answer of `\boxed 5` (no braces).
_TOKEN = re.compile(r'[^\s$]+')
# Phrases after which the rest of the line is the answer. (`\W*?[:：]` rather than
# `\W*?\s*[:：]`, which matches the same but backtracks quadratically on a run of spaces; the
# line's lead-in `[^\w\n]*` rather than `\W*`, which from every line start of a run of blank
# lines scans the whole run: quadratic, and the same 'answer' is found from its own line.)
_ANSWER_PHRASE = re.compile(
    r'final answer\s*(?:is)?\s*[:：]?|the answer is\s*[:：]?|^[^\w\n]*answer\W*?[:：]',
    re.IGNORECASE | re.MULTILINE)
# Final answers are short (a number, a fraction, a set, an interval, a small matrix); the
# parser's cost grows with length and depth, under a second of CPU for 300 characters nested
# MAX_NESTING deep.
MAX_ANSWER_CHARS = 300
# Brackets open at once: ~80 ms of parsing per level a worker has not met before (0.7 s for 8,
# 2.8 s for 15); real answers need a few (\left(\frac{\sqrt{2}}{2}, ...\right) is 3).
MAX_NESTING = 8
_OPEN, _CLOSE = frozenset('([{'), frozenset(')]}')


def braced(text: str, start: int, limit: int | None = None) -> str | None:
  """The content of the brace group opening at text[start] ('{'), or None if unbalanced (within
  `limit` characters from `start` when given)."""
  depth = 0
  end = len(text) if limit is None else min(len(text), start + limit)
  i = start
  while i < end:
    c = text[i]
    if c == '\\':
      i += 2
      continue
    if c == '{':
      depth += 1
    elif c == '}':
      depth -= 1
      if depth == 0:
        return text[start + 1:i]
    i += 1
  return None


def _unwrap(answer: str) -> str:
  """Strips sentence punctuation, markdown bold and math delimiters around an answer."""
  a = answer.strip()
  for _ in range(3):
    a = a.strip().rstrip('.').strip().strip('*').strip()
    for left, right in (('$$', '$$'), ('$', '$'), ('\\(', '\\)'), ('\\[', '\\]')):
      if a.startswith(left) and a.endswith(right) and len(a) > len(left) + len(right):
        a = a[len(left):-len(right)]
  return a.strip()


def extract_answer(text: str) -> tuple[str | None, str]:
  """Finds the final answer in a response.

  Args:
    text: the text after the thinking block.

  Returns:
    (answer or None, how it was found: 'boxed', 'answer phrase' or 'none').
  """
  # A group that never closes holds every later '{' that never closes either, so an earlier
  # group is read only up to the last unclosed one: hostile text ('\\boxed{' * 10**5) costs
  # linear time, not quadratic.
  bound = len(text)
  for m in reversed(list(_BOX.finditer(text))):
    end = m.end()
    if end < len(text) and text[end] == '{':
      inner = braced(text, end, bound - end)
      if inner is None:
        bound = end
      elif inner.strip():
        return inner.strip(), 'boxed'
    else:  # `\boxed 5`
      token = _TOKEN.match(text, end)
      if token:
        return token.group(0), 'boxed'
  for m in reversed(list(_ANSWER_PHRASE.finditer(text))):
    line_end = text.find('\n', m.end())
    answer = _unwrap(text[m.end():line_end if line_end >= 0 else len(text)])
    if answer:
      return answer, 'answer phrase'
  return None, 'none'


def refusal(answer: str) -> str:
  """Why an extracted answer is not given to math-verify ('' when it is): longer than
  MAX_ANSWER_CHARS, or brackets nested deeper than MAX_NESTING. Linear."""
  if len(answer) > MAX_ANSWER_CHARS:
    return f'answer longer than {MAX_ANSWER_CHARS} characters ({len(answer)}): not parsed'
  depth = deepest = 0
  for c in answer:
    if c in _OPEN:
      depth += 1
      deepest = max(deepest, depth)
    elif c in _CLOSE:
      depth = max(0, depth - 1)
  if deepest > MAX_NESTING:
    return f'answer nests brackets {deepest} deep (most {MAX_NESTING}): not parsed'
  return ''


def _as_latex(answer: str) -> str:
  return answer if '$' in answer or '\\boxed' in answer else f'${answer}$'


def parse_timeout(timeout_s: float) -> int | None:
  """math-verify's parsing timeout for a verifier whose samples have `timeout_s` seconds: a
  third of it in whole seconds (SIGALRM's unit), so a stalled parse ends before the pool kills
  the worker; None below 3 s (the pool's limit alone)."""
  return int(timeout_s // 3) or None


class ParseTimeout(Exception):
  """math-verify's parsing timeout ended a parse."""


@functools.lru_cache(maxsize=8192)
def _parse(text: str, timeout_s: int | None = None) -> list:
  """math-verify's parse of `text`; [] when it parses nothing or fails, as math-verify's own
  default. Raises ParseTimeout past `timeout_s` (a main thread only: SIGALRM)."""
  import math_verify  # pylint: disable=g-import-not-at-top
  from math_verify import errors  # pylint: disable=g-import-not-at-top
  try:
    return math_verify.parse(text, parsing_timeout=timeout_s, raise_on_error=True)
  except errors.TimeoutException:
    raise ParseTimeout(f'no parse within {timeout_s}s') from None
  except Exception:  # pylint: disable=broad-except
    return []


def worker_init() -> None:
  """Imports sympy/math-verify and warms their caches before the first request."""
  import math_verify  # pylint: disable=g-import-not-at-top
  logging.getLogger('math_verify').setLevel(logging.ERROR)
  math_verify.verify(_parse('$\\frac{1}{2}$'), _parse('$0.5$'), timeout_seconds=None)


def screen(answer_text: str) -> tuple[dict | None, str, dict]:
  """What is decided before math-verify: (the final {'reward', 'info'} when the text has no
  final answer or its answer is refused, else None; the answer; the info so far). Linear in
  the text's length."""
  answer, how = extract_answer(answer_text)
  if answer is None:
    return ({'reward': 0.0, 'info': {'reason': 'no final answer (\\boxed{} or "the answer is")'}},
            '', {})
  info = {'extracted': answer[:200], 'found_by': how}
  why = refusal(answer)
  if why:
    return {'reward': 0.0, 'info': dict(info, reason=why)}, answer, info
  return None, answer, info


def work(payload: dict) -> dict:
  """Worker side: extract, bound, parse and compare one answer.

  Args:
    payload: {'answer_text': the text after the thinking block, 'gold': the gold answer,
      'parse_timeout_s': math-verify's parsing timeout (int seconds or None; used only in
      the main thread, where SIGALRM works)}.

  Returns:
    {'reward', 'info'}.
  """
  early, answer, info = screen(payload['answer_text'])
  if early is not None:
    return early
  limit = payload.get('parse_timeout_s')
  if threading.current_thread() is not threading.main_thread():
    limit = None
  parsed = {}
  for name, text in (('gold', payload['gold']), ('answer', answer)):
    try:
      parsed[name] = _parse(_as_latex(text), limit)
    except ParseTimeout:
      return {'reward': 0.0, 'info': dict(info, reason=f'{name} parse timed out after {limit}s')}
  gold, pred = parsed['gold'], parsed['answer']
  info.update(gold=str(gold[0])[:200] if gold else None, pred=str(pred[0])[:200] if pred else None)
  if not gold:
    return {'reward': 0.0, 'info': dict(info, reason='gold answer not parsable')}
  if not pred:
    return {'reward': 0.0, 'info': dict(info, reason='answer not parsable')}
  import math_verify  # pylint: disable=g-import-not-at-top
  ok = math_verify.verify(gold, pred, timeout_seconds=None)
  return {'reward': float(ok), 'info': dict(info, reason='equivalent' if ok else 'not equivalent')}


class MathVerifier(base.Verifier):
  """Reward 1 iff the final answer is equivalent to metadata['answer']."""

  name = 'math'
  worker_fn = 'verifiers.math:work'

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any], **options: Any) -> None:
    answer = base.require(metadata, 'answer', (str, int, float), 'the gold answer')
    if isinstance(answer, str) and not answer.strip():
      raise ValueError('metadata["answer"] is empty')

  def _prepare(self, sample: base.Sample, answer: str) -> dict | base.Result:
    early, _, _ = screen(answer)     # no answer, or one refused: no worker needed
    if early is not None:
      return base.Result(early['reward'], early['info'])
    return {'answer_text': answer, 'gold': str(sample.metadata['answer']),
            'parse_timeout_s': parse_timeout(self.timeout_s)}
