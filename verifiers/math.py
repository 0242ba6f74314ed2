"""Math verifier: the final answer, compared with the gold one by `math-verify`.

The answer is the last `\\boxed{...}` (or `\\fbox{...}`) after the thinking
block; without one, the last "final answer is X" / "the answer is X" /
"Answer: X" line. Equivalence is math-verify's (fractions, decimals,
percentages, LaTeX, sets, intervals, equations, symbolic expressions). Its own
time limit relies on SIGALRM, which fails outside the main thread, so it runs
with `parsing_timeout=None, timeout_seconds=None` inside worker processes
that the pool kills at `timeout_s` (process-level limit). Gold answers given
as raw LaTeX are wrapped in `$...$`, which math-verify parses reliably.

Metadata: {'answer': str | int | float}.
"""

from __future__ import annotations

import functools
import logging
import re
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
_MAX_ANSWER_CHARS = 1000


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
      return answer[:_MAX_ANSWER_CHARS], 'answer phrase'
  return None, 'none'


def _as_latex(answer: str) -> str:
  return answer if '$' in answer or '\\boxed' in answer else f'${answer}$'


@functools.lru_cache(maxsize=8192)
def _parse(text: str):
  import math_verify  # pylint: disable=g-import-not-at-top
  return math_verify.parse(text, parsing_timeout=None)


def worker_init() -> None:
  """Imports sympy/math-verify and warms their caches before the first request."""
  import math_verify  # pylint: disable=g-import-not-at-top
  logging.getLogger('math_verify').setLevel(logging.ERROR)
  math_verify.verify(_parse('$\\frac{1}{2}$'), _parse('$0.5$'), timeout_seconds=None)


def work(payload: dict) -> dict:
  """Worker side: extract, parse and compare one answer."""
  import math_verify  # pylint: disable=g-import-not-at-top
  answer, how = extract_answer(payload['answer_text'])
  if answer is None:
    return {'reward': 0.0, 'info': {'reason': 'no final answer (\\boxed{} or "the answer is")'}}
  gold = _parse(_as_latex(payload['gold']))
  pred = _parse(_as_latex(answer))
  info = {'extracted': answer[:200], 'found_by': how,
          'gold': str(gold[0])[:200] if gold else None, 'pred': str(pred[0])[:200] if pred else None}
  if not gold:
    return {'reward': 0.0, 'info': dict(info, reason='gold answer not parsable')}
  if not pred:
    return {'reward': 0.0, 'info': dict(info, reason='answer not parsable')}
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

  def _prepare(self, sample: base.Sample, answer: str) -> dict:
    return {'answer_text': answer, 'gold': str(sample.metadata['answer'])}
