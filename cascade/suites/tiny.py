"""Suites over a generated world's held-out domains (the tiny world's, or a user's own).

A generated world (tiny_world/world.py writes one) keeps each domain's held-out
prompts in `<world>/<domain>/heldout.jsonl` as canonical prompt records
({'id', 'domain', 'messages', 'metadata'}) that a registered verifier grades. A
`WorldSuite` makes one such domain an evaluation suite with the papers' protocol
machinery: k samples per prompt, avg@k with its standard error, pass@k, maj@k
where the verifier reports the answer it extracted. Its grader is the suites'
`graders.VerifierGrader` over that verifier (a batch in one `score` call).

The framework never imports the world: the world registers its suites, as it
registers its verifier (tiny_world/suites.py: `tiny_chat`, `tiny_if`, `tiny_math`,
`tiny_code`, `tiny_swe`), so they exist wherever `tiny_world` was imported (the tiny
configs import it; `python -m cascade.evaluate --imports=tiny_world` does too).

  suite = tiny.WorldSuite(name='my_math', title='My math', domain='math', verifier='math',
                          protocol=base.Protocol(samples=4, max_new_tokens=64), ...)
  suites.register(suite)
  records = suite.read('runs/tiny_world/seed0')       # the world's directory is the data root
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from cascade.suites import base
from cascade.suites import graders
import verifiers


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorldSuite(base.Suite):
  """One domain of a generated world as a suite.

  Attributes:
    domain: the world's domain; its prompts are `<world>/<domain>/heldout.jsonl`.
    verifier: the registered verifier that grades them (`verifiers.get`).
    verifier_options: its options (e.g. the code sandbox's isolation); `grader(**options)`
      adds to them.
    answer_info: the verifier's info key holding the extracted answer (maj@k); '' = none.
  """
  domain: str
  verifier: str
  verifier_options: Mapping[str, Any] | None = None
  answer_info: str = ''

  def directory(self, root: str) -> str:
    """The world's directory itself: every domain's files are under it."""
    return root

  def parse(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    out = []
    for line, row in raw:
      rid = base.field(path, line, row, 'id')
      messages = base.field(path, line, row, 'messages', list)
      if not messages or not all(isinstance(m, Mapping) and isinstance(m.get('content'), str)
                                 for m in messages):
        raise base.BadRecord(f"{path}:{line}: field 'messages' must be a non-empty list of "
                             "{'role', 'content'} objects")
      metadata = base.field(path, line, row, 'metadata', Mapping) if 'metadata' in row else {}
      out.append({'id': rid, 'domain': row.get('domain', self.domain),
                  'messages': [dict(m) for m in messages], 'metadata': dict(metadata)})
    return out

  def grader(self, **options) -> graders.VerifierGrader:
    verifier = verifiers.get(self.verifier, **{**dict(self.verifier_options or {}), **options})
    return graders.VerifierGrader(verifier, self._graded if self.answer_info else graders.plain)

  def _graded(self, record: Mapping, result: verifiers.Result) -> base.Graded:
    """The reward clipped to [0, 1], the verifier's info[answer_info] as the answer (maj@k)."""
    del record
    info = dict(result.info or {})
    answer = info.get(self.answer_info)
    return base.Graded(score=graders.clipped(result), info=info,
                       answer=answer if isinstance(answer, (str, int, float)) else None)
