"""A suite's grader over one of the project's verifiers: the same checks that score training.

  grader = graders.VerifierGrader(verifiers.get('math', workers=2), graded=math_suite.graded)
  grades = grader.grade_batch(records, completions)     # one verifier.score call for the batch
  grader.close()                                         # stops the verifier's workers

Every completion of every record in a batch goes to the verifier in one `score`
call, so its worker pool is busy on all of them at once; each `verifiers.Result`
becomes a `base.Graded` by the suite's own rule (`graded(record, result)`): which
info holds the answer that maj@k votes on, which result is a 1. The verifier's
info is kept in the grade, so a verifier's own error ('verifier_error') reaches
the runner as it does in training.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from cascade.suites import base
from foundation import chat
import verifiers

Graded = Callable[[Mapping, verifiers.Result], base.Graded]


def clipped(result: verifiers.Result) -> float:
  """A verifier's reward as a grade in [0, 1] (a -1 "unparsable" reward is a failure)."""
  return min(max(float(result.reward), 0.0), 1.0)


def plain(record: Mapping, result: verifiers.Result) -> base.Graded:
  """The reward clipped to [0, 1], no answer (no maj@k)."""
  del record
  return base.Graded(score=clipped(result), info=dict(result.info or {}))


class VerifierGrader(base.Grader):
  """Grades with a built verifier (closed by `close`).

  Args:
    verifier: a `verifiers.Verifier`.
    graded: `(record, result) -> base.Graded`, the suite's rule.
  """

  def __init__(self, verifier: verifiers.Verifier, graded: Graded = plain):
    self.verifier, self.graded = verifier, graded

  def grade(self, record: Mapping, completions: Sequence[str]) -> list[base.Graded]:
    return self.grade_batch([record], [completions])[0]

  def grade_batch(self, records: Sequence[Mapping],
                  completions: Sequence[Sequence[str]]) -> list[list[base.Graded]]:
    samples = [verifiers.Sample(prompt=chat.render(r['messages'], thinking=None), completion=c,
                                metadata=r['metadata'])
               for r, cs in zip(records, completions) for c in cs]
    results = self.verifier.score(samples) if samples else []
    if len(results) != len(samples):
      raise RuntimeError(f'verifier {type(self.verifier).__name__} returned {len(results)} '
                         f'results for {len(samples)} samples')
    out, i = [], 0
    for record, cs in zip(records, completions):
      out.append([self.graded(record, r) for r in results[i:i + len(cs)]])
      i += len(cs)
    return out

  def close(self) -> None:
    self.verifier.close()
