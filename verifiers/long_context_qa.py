"""Long-context QA verifier: the answer against reference strings, by token F1, exact match or containment.

Answers and references are normalised as in SQuAD's evaluation script:
lower case, punctuation deleted (ASCII punctuation as SQuAD does, and
Unicode punctuation too, so curly quotes and dashes go the same way), the
articles a / an / the removed, whitespace collapsed. Metrics:

* 'f1' (the default; SQuAD's and LongBench's single-document and multi-
  document QA score): token-overlap F1 = 2PR / (P + R) with P and R the
  shared tokens (as multisets) over the answer's and the reference's
  counts; the maximum over the references.
* 'exact': 1 iff the normalised answer equals a normalised reference.
* 'contains': 1 iff a normalised reference occurs in the normalised answer
  as whole words (RULER's string match, any reference).

Reward = the metric, in [0, 1]. Only the first `max_answer_chars` characters
of the answer are scored (info says when the answer was cut), which bounds
the work and keeps 'contains' from rewarding answers that list everything.
Scored on the host (string work only, no worker process).

Metadata: {'answers': [str, ...]} or {'answer': str}, and optionally
'metric' ('f1', 'exact' or 'contains') to override the verifier's option for
that record.
"""

from __future__ import annotations

import collections
import re
import string
import unicodedata
from typing import Any, Mapping

from verifiers import base

METRICS = ('f1', 'exact', 'contains')
_ARTICLES = re.compile(r'\b(?:a|an|the)\b')
_ASCII_PUNCT = frozenset(string.punctuation)


def _is_punct(c: str) -> bool:
  return c in _ASCII_PUNCT or (c > '\x7f' and unicodedata.category(c).startswith('P'))


def normalize(text: str) -> str:
  """SQuAD's answer normalisation (see the module docstring)."""
  text = ''.join(c for c in text.lower() if not _is_punct(c))
  return ' '.join(_ARTICLES.sub(' ', text).split())


def f1(answer: str, reference: str) -> float:
  """Token-overlap F1 of two normalised strings (1 when both are empty, 0 when one is)."""
  pred, gold = answer.split(), reference.split()
  if not pred or not gold:
    return float(pred == gold)
  same = sum((collections.Counter(pred) & collections.Counter(gold)).values())
  if not same:
    return 0.0
  precision, recall = same / len(pred), same / len(gold)
  return 2 * precision * recall / (precision + recall)


def score(answer: str, references: list[str], metric: str) -> tuple[float, int]:
  """The metric of an answer against its references.

  Args:
    answer: the answer text (not yet normalised).
    references: the reference answers (not yet normalised).
    metric: one of METRICS.

  Returns:
    (the best value over the references, the index of the reference giving it).
  """
  pred = normalize(answer)
  values = []
  for ref in references:
    gold = normalize(ref)
    if metric == 'f1':
      values.append(f1(pred, gold))
    elif metric == 'exact':
      values.append(float(pred == gold))
    else:
      values.append(float(f' {gold} ' in f' {pred} '))
  best = max(range(len(values)), key=lambda i: values[i])
  return values[best], best


def _references(metadata: Mapping[str, Any]) -> list[str]:
  if 'answers' in metadata:
    return list(metadata['answers'])
  return [metadata['answer']]


class LongContextQaVerifier(base.Verifier):
  """Reward = the answer's F1 / exact match / containment against the references."""

  name = 'long_context_qa'

  def __init__(self, *, metric: str = 'f1', max_answer_chars: int = 1000, **common: Any):
    """Options.

    Args:
      metric: 'f1' (default), 'exact' or 'contains'; a record's 'metric'
        overrides it.
      max_answer_chars: characters of the answer that are scored.
      **common: the base Verifier's options.
    """
    super().__init__(**common)
    if metric not in METRICS:
      raise ValueError(f'long_context_qa: metric must be one of {METRICS}, got {metric!r}')
    if max_answer_chars < 1:
      raise ValueError(f'long_context_qa: max_answer_chars must be >= 1, got {max_answer_chars}')
    self.metric, self.max_answer_chars = metric, int(max_answer_chars)

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any], **options: Any) -> None:
    if not isinstance(metadata, Mapping):
      raise ValueError(f'metadata must be a dict, got {type(metadata).__name__}')
    if 'answers' in metadata and 'answer' in metadata:
      raise ValueError('give metadata["answers"] (a list) or metadata["answer"] (a string), '
                       'not both')
    if 'answers' in metadata:
      refs = base.require(metadata, 'answers', list, 'the reference answers')
      if not refs:
        raise ValueError('metadata["answers"] is empty')
      fields = [f'metadata["answers"][{i}]' for i in range(len(refs))]
    else:
      refs = [base.require(metadata, 'answer', str, 'the reference answer (or "answers")')]
      fields = ['metadata["answer"]']
    for field, ref in zip(fields, refs):
      if not isinstance(ref, str):
        raise ValueError(f'{field} must be str, got {type(ref).__name__}')
      if not normalize(ref):
        # An empty reference would give the empty answer full marks.
        raise ValueError(f'{field} {ref!r:.80} is empty after normalisation (punctuation and '
                         'articles removed)')
    if 'metric' in metadata and metadata['metric'] not in METRICS:
      raise ValueError(f'metadata["metric"] must be one of {METRICS}, got '
                       f'{metadata["metric"]!r:.80}')

  def _prepare(self, sample: base.Sample, answer: str) -> base.Result:
    metric = sample.metadata.get('metric', self.metric)
    info = {'metric': metric}
    if len(answer) > self.max_answer_chars:
      answer = answer[:self.max_answer_chars]
      info['cut'] = f'scored the first {self.max_answer_chars} characters'
    if not normalize(answer):
      return base.Result(0.0, dict(info, reason='empty answer'))
    value, best = score(answer, _references(sample.metadata), metric)
    return base.Result(value, dict(info, reference=best,
                                   reason=f'{metric} {value:.3f} against reference {best}'))
