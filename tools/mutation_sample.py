"""Keeps a seeded random sample of a cosmic-ray session's pending mutants; marks the rest skipped.

  python tools/mutation_sample.py SESSION.sqlite --size=100 --seed=0
  python tools/mutation_sample.py SESSION.sqlite --survivors_of=EARLIER.sqlite

The second form keeps the mutants that survived an earlier session of the
same code (e.g. to run them again against more tests).

The whole set of mutants of a large module takes hours to run on 2 cores; a
seeded random sample of them estimates the module's mutation score with a
known sampling error (the binomial standard error is printed). Skipped
mutants show as such in `cr-report` and are not counted as killed.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import sys

from cosmic_ray.work_db import use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult


def _where(item) -> tuple:
  return tuple((str(m.module_path), m.operator_name, m.occurrence, tuple(m.start_pos),
                tuple(m.end_pos)) for m in item.mutations)


def sample(session: str, size: int, seed: int) -> tuple[int, int]:
  """Marks all but `size` (seeded) pending work items skipped: (kept, skipped)."""
  if size < 1:
    raise ValueError(f'--size={size} must be >= 1')
  with use_db(session) as db:
    # Job ids are random per session: order by what each mutant changes, so one seed picks the
    # same mutants of the same code in any session.
    pending = sorted(db.pending_work_items, key=_where)
    chosen = random.Random(seed).sample(range(len(pending)), min(size, len(pending)))
    keep = {pending[i].job_id for i in chosen}
    skipped = 0
    for job_id in (w.job_id for w in pending):
      if job_id not in keep:
        db.set_result(job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                         output=f'not in the seeded sample ({size}, seed {seed})'))
        skipped += 1
  return len(keep), skipped


def _line_key(operator: str, line: str, start: tuple, end: tuple) -> tuple:
  return operator, line.strip(), start[1], end[1]


def survivors_of(session: str, earlier: str) -> tuple[int, int]:
  """Marks skipped every pending work item that did not survive in `earlier`: (kept, skipped).

  A mutant is recognised by its operator and the source line it changes (with
  the columns), not by line number, so code added elsewhere in the module
  since the earlier session does not lose it. Module paths are read relative
  to the working directory, as cosmic-ray does.
  """
  survived = set()
  with use_db(earlier) as db:
    for item, result in db.completed_work_items:
      if result.test_outcome != TestOutcome.SURVIVED:
        continue
      m = item.mutations[0]
      removed = [l[1:] for l in (result.diff or '').splitlines()
                 if l.startswith('-') and not l.startswith('---')]
      if removed:
        survived.add(_line_key(m.operator_name, removed[0], m.start_pos, m.end_pos))
  kept = skipped = 0
  sources = {}
  with use_db(session) as db:
    for w in sorted(db.pending_work_items, key=_where):
      m = w.mutations[0]
      if m.module_path not in sources:
        sources[m.module_path] = pathlib.Path(m.module_path).read_text().splitlines()
      line = sources[m.module_path][m.start_pos[0] - 1]
      if _line_key(m.operator_name, line, m.start_pos, m.end_pos) in survived:
        kept += 1
        continue
      db.set_result(w.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                         output=f'did not survive in {earlier}'))
      skipped += 1
  return kept, skipped


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('session')
  parser.add_argument('--size', type=int)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--survivors_of', help='keep only the mutants that survived this session')
  args = parser.parse_args(argv)
  if (args.size is None) == (args.survivors_of is None):
    parser.error('give exactly one of --size and --survivors_of')
  if args.survivors_of:
    kept, skipped = survivors_of(args.session, args.survivors_of)
    print(f'{args.session}: {kept} survivors of {args.survivors_of} kept, {skipped} skipped')
    return 0
  kept, skipped = sample(args.session, args.size, args.seed)
  total = kept + skipped
  # A score p measured on n of N mutants has standard error sqrt(p (1 - p) / n * (N - n) / (N - 1)).
  fpc = math.sqrt((total - kept) / (total - 1)) if total > 1 else 0.0
  print(f'{args.session}: {kept} of {total} mutants kept (seed {args.seed}), {skipped} skipped; '
        f'a score of 90 % on them has a standard error of '
        f'{100 * math.sqrt(0.09 / max(kept, 1)) * fpc:.1f} points')
  return 0


if __name__ == '__main__':
  sys.exit(main())
