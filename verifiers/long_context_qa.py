"""Long-context QA verifier: a committed answer against reference strings, by token F1, exact match or containment.

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

The reward pays a committed answer, never a hedge. Plain F1 pays a list of
candidates more than one guess (with the reference among k one-word
candidates F1 is 2 / (k + 1), above the 1 / k a random single guess earns)
and plain containment pays a list of everything. So 'f1' and 'contains'
score an answer against a reference only when the answer is one span no
longer than `max_length_ratio` times the reference (in normalised words,
rounded down; the default 1.5 is below 2, so two candidates as long as the
reference never fit), and an answer that hedges in words ('or', 'either',
'and/or' where the reference has none) scores 0. 'exact' needs neither
rule. Only the first `max_answer_chars` characters of the answer are read,
which bounds the work. Scored on the host (string work only, no worker
process).

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
# Words that join alternatives ('and/or' normalises to 'andor'): an answer
# with one of them, where the reference has none, offers a choice instead of
# committing.
HEDGES = frozenset(('or', 'either', 'andor'))
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


def committed(answer: str, reference: str, max_length_ratio: float) -> bool:
  """Whether a normalised answer commits to one span that can be scored against a reference.

  Args:
    answer: the normalised answer.
    reference: the normalised reference.
    max_length_ratio: the answer may have at most this many times the
      reference's words (rounded down, at least one word).

  Returns:
    False when the answer is longer than that or hedges with a word of
    HEDGES that the reference does not contain.
  """
  pred, gold = answer.split(), reference.split()
  if len(pred) > max(1, int(max_length_ratio * len(gold))):
    return False
  return not (HEDGES.intersection(pred) - set(gold))


def score(answer: str, references: list[str], metric: str,
          max_length_ratio: float = 1.5) -> tuple[float, int]:
  """The metric of an answer against its references.

  Args:
    answer: the answer text (not yet normalised).
    references: the reference answers (not yet normalised).
    metric: one of METRICS.
    max_length_ratio: for 'f1' and 'contains', a reference scores the answer
      only when `committed` holds for the pair (0 otherwise).

  Returns:
    (the best value over the references, the index of the reference giving it).
  """
  pred = normalize(answer)
  values = []
  for ref in references:
    gold = normalize(ref)
    if metric == 'exact':
      values.append(float(pred == gold))
    elif not committed(pred, gold, max_length_ratio):
      values.append(0.0)
    elif metric == 'f1':
      values.append(f1(pred, gold))
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

  def __init__(self, *, metric: str = 'f1', max_answer_chars: int = 1000,
               max_length_ratio: float = 1.5, **common: Any):
    """Options.

    Args:
      metric: 'f1' (default), 'exact' or 'contains'; a record's 'metric'
        overrides it.
      max_answer_chars: characters of the answer that are scored.
      max_length_ratio: 'f1' and 'contains' score an answer of at most this
        many times a reference's words (>= 1; at 2 or more a list of two
        candidates fits and hedging pays again).
      **common: the base Verifier's options.
    """
    super().__init__(**common)
    if metric not in METRICS:
      raise ValueError(f'long_context_qa: metric must be one of {METRICS}, got {metric!r}')
    if max_answer_chars < 1:
      raise ValueError(f'long_context_qa: max_answer_chars must be >= 1, got {max_answer_chars}')
    if not max_length_ratio >= 1:
      raise ValueError(f'long_context_qa: max_length_ratio must be >= 1, got {max_length_ratio}')
    self.metric, self.max_answer_chars = metric, int(max_answer_chars)
    self.max_length_ratio = float(max_length_ratio)

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
    references = _references(sample.metadata)
    value, best = score(answer, references, metric, self.max_length_ratio)
    reason = f'{metric} {value:.3f} against reference {best}'
    pred = normalize(answer)
    if metric != 'exact' and not any(committed(pred, normalize(ref), self.max_length_ratio)
                                     for ref in references):
      reason = (f'not a committed answer: longer than {self.max_length_ratio:g} times every '
                f'reference or hedging with {"/".join(sorted(HEDGES))}')
    return base.Result(value, dict(info, reference=best, reason=reason))
