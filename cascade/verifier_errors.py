"""A verifier's (or environment's) own bugs, told apart from a candidate's failures and counted.

`verifiers.base` marks a sample whose verifier raised in its own code (it
raised on the fixed probe answers too, whatever the candidate wrote) with info
'verifier_error'; `VerifierErrors` counts those over a stage's training batches
or a domain's evaluation and stops it with one line (`VerifierBug`, exit 2).
Kept apart from `cascade.verifier_set` (which builds verifiers from the plan) so
the stage kinds and the evaluation can count without importing the config.
"""

from __future__ import annotations

from typing import Mapping, Sequence


# Past the first scored batch, a stage (or a domain's evaluation) stops once more than this
# fraction of its samples met a verifier's own error: a bug only some records reach may cost
# that many zeros, not a run.
MAX_VERIFIER_ERROR_FRACTION = 0.01


class VerifierBug(RuntimeError):
  """A verifier (or environment) raised in its own code, whatever the answer: one line."""


def bug_message(where: str, record: Mapping, info: Mapping, count: str) -> str:
  """The one line of a `VerifierBug` for a sample of `record` whose info has 'verifier_error'."""
  return (f'{where}: the verifier {info.get("verifier", "?")!r} of domain '
          f'{record.get("domain")!r} raised in its own code on record {record.get("id")!r}, '
          f'whatever the answer: {info["verifier_error"]} ({count}); fix it and rerun the same '
          'command: the run resumes from its last checkpoint')


class VerifierErrors:
  """Counts the samples whose verifier raised in its own code (info 'verifier_error') over a
  stage's training batches or one domain's evaluation, and stops it (module docstring).

  Args:
    where: names the stage or evaluation in the message.
  """

  def __init__(self, where: str):
    self.where = where
    self.errors = self.scored = self.batches = 0

  def count(self, records: Sequence[Mapping], infos: Sequence[Mapping],
            where: str | None = None) -> None:
    """Counts one scored batch (each row's record and verifier info); `where` names it in the
    message (default: the count's own `where`).

    Raises:
      VerifierBug: a verifier error in the first batch, or in more than
        MAX_VERIFIER_ERROR_FRACTION of the samples so far.
    """
    bad = [i for i, info in enumerate(infos) if info and info.get('verifier_error')]
    self.errors += len(bad)
    self.scored += len(infos)
    self.batches += 1
    if bad and (self.batches == 1 or self.errors > MAX_VERIFIER_ERROR_FRACTION * self.scored):
      when = 'in the first scored batch' if self.batches == 1 else 'so far'
      raise VerifierBug(bug_message(where or self.where, records[bad[0]], infos[bad[0]],
                                    f'{self.errors} of {self.scored} samples {when}'))
