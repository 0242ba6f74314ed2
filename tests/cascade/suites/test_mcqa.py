"""GPQA-Diamond and MMLU-Pro suites: the released files read (csv, parquet), simple-evals'
seeded choice order, the official prompts, fixture completions graded by the official extractions,
the summary's numbers."""

import os
import random

import pytest

from cascade import suites
from cascade.suites import base
from cascade.suites import mcqa

FIXTURES = os.path.join(os.path.dirname(__file__), '..', '..', 'fixtures', 'suites')


def _read(name):
  return suites.get(name).read(os.path.join(FIXTURES, name))


def test_registered_under_their_names():
  assert suites.get('gpqa_diamond') is mcqa.gpqa_diamond
  assert suites.get('mmlu_pro') is mcqa.mmlu_pro


def _simple_evals_order(rows):
  """simple-evals' GPQAEval with n_repeats=1, as its code does it: (choices, correct letter)."""
  rng = random.Random(0)
  examples = [row | {'permutation': rng.sample(range(4), 4)} for row in rows]
  out = []
  for row in examples:
    choices = [row['Correct Answer'], row['Incorrect Answer 1'], row['Incorrect Answer 2'],
               row['Incorrect Answer 3']]
    choices = [choices[i] for i in row['permutation']]
    out.append((choices, 'ABCD'[choices.index(row['Correct Answer'])]))
  return out


def test_gpqa_choices_in_simple_evals_seeded_order():
  path = os.path.join(FIXTURES, 'gpqa_diamond', 'gpqa_diamond.csv')
  rows = [row for _, row in base.rows(path)]
  records = _read('gpqa_diamond')
  assert [r['id'] for r in records] == [row['Record ID'] for row in rows]
  assert [(r['metadata']['options'], r['metadata']['answer']) for r in records] == (
      _simple_evals_order(rows))
  # The file lists the correct answer first; the shuffle moves it.
  assert [r['metadata']['answer'] for r in records] == ['C', 'D', 'C']


def test_gpqa_prompt_is_simple_evals_template_with_the_text_as_released():
  content = _read('gpqa_diamond')[0]['messages'][0]['content']
  assert content == (
      "Answer the following multiple choice question. The last line of your response should be "
      "of the following format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. "
      "Think step by step before answering.\n\nTwo quantum states with energies E1 and E2 have a "
      "lifetime of 10^-9 sec and 10^-8 sec, respectively. We want to clearly distinguish these "
      "two energy levels. Which one of the following options could be their energy difference so "
      "that they can be clearly resolved?\n\n\nA) 10^-9 eV\nB) 10^-11 eV\nC) 10^-4 eV\n"
      "D) 10^-8 eV\n")


def test_csv_errors_name_file_and_line(tmp_path):
  path = tmp_path / 'gpqa_diamond.csv'
  path.write_text('Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,'
                  'Incorrect Answer 3,Record ID\n"two\nlines",a,b,c,d,rec1\nq,a,b,c\n')
  with pytest.raises(base.BadRecord, match=r'gpqa_diamond.csv:4: 4 fields for 6 columns'):
    suites.get('gpqa_diamond').read(str(tmp_path))
  path.write_text('Question,Correct Answer,Record ID\nq,a,rec1\n')
  with pytest.raises(base.BadRecord,
                     match=r"gpqa_diamond.csv:2: missing field 'Incorrect Answer 1'"):
    suites.get('gpqa_diamond').read(str(tmp_path))


def test_mmlu_pro_records_and_official_prompt():
  records = _read('mmlu_pro')
  assert [r['id'] for r in records] == ['70', '1000', '5461']
  assert [r['metadata']['answer'] for r in records] == ['I', 'C', 'J']
  # "N/A" options are dropped, as the official script's preprocess does.
  assert [len(r['metadata']['options']) for r in records] == [9, 4, 10]
  assert records[1]['messages'] == [{'role': 'user', 'content': (
      'The following are multiple choice questions (with answers) about math. Think step by '
      'step and then output the answer in the format of "The answer is (X)" at the end.\n\n'
      'Question: What is the value of $p$ in $24 = 2p$?\nOptions: A. p = 4\nB. p = 8\n'
      "C. p = 12\nD. p = 24\nAnswer: Let's think step by step.\n\n")}]


def test_mmlu_pro_answer_and_index_must_agree(tmp_path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  (tmp_path / 'data').mkdir()
  pq.write_table(pa.table({'question_id': [1], 'question': ['q'], 'options': [['x', 'y']],
                           'answer': ['B'], 'answer_index': [0], 'category': ['math']}),
                 str(tmp_path / 'data' / 'test-00000-of-00001.parquet'))
  with pytest.raises(base.BadRecord, match=r"parquet:1: 'answer' 'B' and 'answer_index' 0"):
    suites.get('mmlu_pro').read(str(tmp_path))


def test_fixture_completions_graded_by_the_official_extractions():
  gpqa = _read('gpqa_diamond')[0]   # gold C
  with suites.get('gpqa_diamond').grader() as grader:
    grades = grader.grade(gpqa, [
        '<think>Widths near 1e-7 eV.</think>Only 10^-4 eV is far larger.\nAnswer: C',
        'answer: c', 'The answer is (C).', '<think>Answer: C</think>Answer: A', 'Answer: $C$'])
  assert [g.score for g in grades] == [1.0, 0.0, 0.0, 0.0, 1.0]
  assert [g.answer for g in grades] == ['C', 'c', None, 'A', 'C']
  mmlu = _read('mmlu_pro')[1]   # gold C
  with suites.get('mmlu_pro').grader() as grader:
    grades = grader.grade(mmlu, ['2p = 24, so p = 12. The answer is (C).', 'Answer: C',
                                 'p is 12, option C', 'The answer is (B).', 'no idea'])
  assert [g.score for g in grades] == [1.0, 1.0, 1.0, 0.0, 0.0]
  assert [g.info['found_by'] for g in grades] == ['answer is', 'answer:', 'last letter',
                                                  'answer is', 'none']


def test_summary_numbers_by_hand():
  records = _read('gpqa_diamond')[:2]
  g = lambda s, a: base.Graded(score=s, answer=a)
  out = suites.get('gpqa_diamond').summarize(records, [[g(1, 'C'), g(0, 'A')],
                                                        [g(0, 'B'), g(0, 'B')]])
  # Per-question means 0.5 and 0: value 25, s.e. std([0.5, 0], ddof=1) / sqrt(2) = 0.25.
  assert out['value'] == pytest.approx(25.0) and out['stderr'] == pytest.approx(25.0)
  # maj@2: a tie goes to the first answer ('C', right); 'B' is wrong.
  assert out['maj@2'] == pytest.approx(50.0) and 'pass@8' not in out
