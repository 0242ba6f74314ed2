"""Keeps a seeded random sample of a cosmic-ray session's pending mutants; marks the rest skipped.

  python tools/mutation_sample.py SESSION.sqlite --size=100 --seed=0

The whole set of mutants of a large module takes hours to run on 2 cores; a
seeded random sample of them estimates the module's mutation score with a
known sampling error (the binomial standard error is printed). Skipped
mutants show as such in `cr-report` and are not counted as killed.
"""

from __future__ import annotations

import argparse
import math
import random
import sys

from cosmic_ray.work_db import use_db
from cosmic_ray.work_item import WorkerOutcome, WorkResult


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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('session')
  parser.add_argument('--size', type=int, required=True)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(argv)
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
