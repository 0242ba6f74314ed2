"""A toy suite the runner tests sample with the stand-in sampler (tests/cascade/conftest.py's
`fakes`): 'Copy N.' prompts, a completion is right when it is N, graded exactly."""

import dataclasses
import types

import pytest

from cascade.suites import base


class ExactGrader(base.Grader):
  """1 when the completion is the record's answer, else 0; the answer itself for maj@k.
  Counts the records it graded and whether it was closed."""

  def __init__(self, log):
    self.log = log

  def grade(self, record, completions):
    self.log.append(record['id'])
    return [base.Graded(score=float(c.strip() == record['metadata']['answer']),
                        answer=c.strip() or None, info={'reason': 'exact match'})
            for c in completions]

  def close(self):
    self.log.append('closed')


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToySuite(base.Suite):
  """Records made in memory (`records`); `parse` reads them back from a .jsonl."""

  log: list = dataclasses.field(default_factory=list, compare=False)

  def parse(self, path, raw):
    return [{'id': base.field(path, line, row, 'id'), 'messages': row['messages'],
             'metadata': row['metadata']} for line, row in raw]

  def grader(self, **options):
    del options
    return ExactGrader(self.log)


def records(n):
  """n 'Copy i.' records (answer str(i))."""
  return [{'id': f'r{i}', 'messages': [{'role': 'user', 'content': f'Copy {i}.'}],
           'metadata': {'answer': str(i)}} for i in range(n)]


def toy_suite(name='toy_copy', samples=4, reported=()):
  return ToySuite(name=name, title='Toy copy', source='made by the test', files=('*.jsonl',),
                  protocol=base.Protocol(samples=samples, temperature=1.0, top_p=1.0,
                                         max_new_tokens=8, thinking=False,
                                         pass_ks=(1, samples)),
                  metric=f'avg@{samples}', reported=reported)


@pytest.fixture(scope='session')
def toy():
  """The toy suite's maker, its records' maker and its grader class."""
  return types.SimpleNamespace(suite=toy_suite, records=records, ExactGrader=ExactGrader)
