"""Math suites (AIME 2024/2025, HMMT Feb 2025): the released files read, prompts rendered, fixture
completions graded by the `math` verifier, the summary's numbers, and agreement with math-verify."""

import json
import logging
import os
import random

import numpy as np
import pytest

from cascade import suites
from cascade.suites import base
from cascade.suites import math as math_suites

FIXTURES = os.path.join(os.path.dirname(__file__), '..', '..', 'fixtures', 'suites')


def _read(name):
  return suites.get(name).read(os.path.join(FIXTURES, name))


def test_registered_under_their_names():
  for name in ('aime24', 'aime25', 'hmmt_feb25'):
    assert suites.get(name) is getattr(math_suites, name)
    assert suites.get(name).protocol.samples == 64 and suites.get(name).metric == 'avg@64'


def test_records_as_released():
  aime24 = _read('aime24')   # 'ID', 'Problem', 'Answer' (int) in a parquet file
  assert [r['id'] for r in aime24] == ['2024-II-4', '2024-I-2', '2024-I-1']
  assert [r['metadata']['answer'] for r in aime24] == ['33', '25', '204']
  aime25 = _read('aime25')   # 'question', 'answer' in two jsonl files, no id
  assert [r['id'] for r in aime25] == ['aime2025-I-1', 'aime2025-I-2', 'aime2025-II-1']
  assert [r['metadata']['answer'] for r in aime25] == ['70', '16', '468']
  hmmt = _read('hmmt_feb25')   # 'problem_idx', 'problem', 'answer' (LaTeX) under data/
  assert [r['id'] for r in hmmt] == ['1', '2', '3']
  assert hmmt[1]['metadata']['answer'] == r'\frac{\sqrt{2}}{2}'


def test_prompt_is_the_problem_and_the_boxed_instruction():
  record = _read('aime25')[0]
  assert record['messages'] == [{'role': 'user', 'content': (
      'Find the sum of all integer bases $b>9$ for which $17_{b}$ is a divisor of $97_{b}$.\n'
      'Please reason step by step, and put your final answer within \\boxed{}.')}]


def test_bad_files_are_one_line_errors(tmp_path):
  with pytest.raises(base.DataMissing, match=r"suite 'aime25': no aime2025-I.jsonl or "
                                             r'aime2025-II.jsonl under .*opencompass/AIME2025'):
    suites.get('aime25').read(str(tmp_path))
  (tmp_path / 'aime2025-I.jsonl').write_text(json.dumps({'question': 'q', 'answer': '1'}) + '\n' +
                                            json.dumps({'question': 'q2'}) + '\n')
  with pytest.raises(base.BadRecord, match=r"aime2025-I.jsonl:2: missing field 'answer'"):
    suites.get('aime25').read(str(tmp_path))
  (tmp_path / 'aime2025-I.jsonl').write_text(json.dumps({'question': 'q', 'answer': ' '}) + '\n')
  with pytest.raises(base.BadRecord, match=r"aime2025-I.jsonl:1: field 'answer' or 'question'"):
    suites.get('aime25').read(str(tmp_path))


def test_fixture_completions_graded_by_math_verify():
  aime, hmmt = _read('aime25')[0], _read('hmmt_feb25')[1]
  with suites.get('aime25').grader(workers=1, timeout_s=30) as grader:
    grades = grader.grade_batch(
        [aime, hmmt],
        [['<think>17_b = b + 7 divides 9b + 7.</think>The bases are 21 and 49: $\\boxed{70}$.',
          'So the answer is \\boxed{070}.', 'The answer is \\boxed{71}.', 'I cannot tell.',
          '<think>b + 7 divides 56, so'],
         ['\\boxed{\\dfrac{\\sqrt{2}}{2}}', '\\boxed{\\frac12\\sqrt2}',
          '\\boxed{\\frac{1}{\\sqrt{2}}}', '\\boxed{\\sqrt{2}}']])
  assert [g.score for g in grades[0]] == [1.0, 1.0, 0.0, 0.0, 0.0]
  # maj@k votes on math-verify's parse: 70 and 070 are one answer, and so are sqrt(2)/2 and
  # 1/2 sqrt 2; 1/sqrt(2) is right too, but math-verify parses it apart (it votes alone).
  assert [g.answer for g in grades[0]] == ['70', '70', '71', None, None]
  assert [g.score for g in grades[1]] == [1.0, 1.0, 1.0, 0.0]
  assert [g.answer for g in grades[1]] == ['sqrt(2)/2', 'sqrt(2)/2', '1/sqrt(2)', 'sqrt(2)']
  assert grades[0][4].info['reason'] == 'thinking block never closed'


def test_summary_numbers_by_hand():
  records = _read('aime25')[:2]
  g = lambda s, a: base.Graded(score=s, answer=a)
  grades = [[g(1, '70'), g(1, '70'), g(0, '71'), g(0, '72')],
            [g(1, '5'), g(0, '6'), g(0, '6'), g(0, '6')]]
  out = suites.get('aime25').summarize(records, grades)
  # Per-prompt means 0.5 and 0.25; s.e. = std([0.5, 0.25], ddof=1) / sqrt(2) = 0.125.
  assert out['value'] == pytest.approx(37.5) and out['stderr'] == pytest.approx(12.5)
  # pass@4: each prompt has a right sample; maj@4: '70' (right) and '6' (wrong) win.
  assert out['pass@4'] == pytest.approx(100.0) and out['maj@4'] == pytest.approx(50.0)
  assert (out['n'], out['k'], out['samples']) == (2, 4, 8)
  assert 'pass@16' not in out


def _pairs(seed=0):
  """(gold, answer) pairs: integers, fractions, radicals, multiples of pi, intervals, sets,
  equations and polynomials, each in equivalent and in wrong forms."""
  rng = random.Random(seed)
  out = []
  for _ in range(12):
    n = rng.randint(2, 999)
    out += [(str(n), str(n)), (str(n), f'0{n}'), (str(n), f'{n}.0'), (str(n), f'\\text{{{n}}}'),
            (str(n), f'\\dfrac{{{2 * n}}}{{2}}'), (str(n), f'{n}^\\circ'), (str(n), str(n + 1)),
            (str(n), f'-{n}'), (str(n), f'{n}\\%')]
  for _ in range(10):
    p, q = rng.randint(1, 30), rng.choice([2, 3, 4, 5, 7, 8, 9])
    p += p % q == 0
    gold = f'\\frac{{{p}}}{{{q}}}'
    out += [(gold, f'{p}/{q}'), (gold, f'\\dfrac{{{p}}}{{{q}}}'),
            (gold, f'\\frac{{{2 * p}}}{{{2 * q}}}'),
            (gold, f'{p / q:.10g}' if q in (2, 4, 5, 8) else f'{p}\\div{q}'),
            (gold, f'\\frac{{{q}}}{{{p}}}'), (gold, f'\\frac{{{p + 1}}}{{{q}}}')]
  for _ in range(8):
    a, b = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7])
    gold = f'{a}\\sqrt{{{b}}}'
    out += [(gold, f'\\sqrt{{{a * a * b}}}'), (gold, f'\\sqrt{{{b}}}\\cdot {a}'),
            (gold, f'\\frac{{{2 * a}\\sqrt{{{b}}}}}{{2}}'), (gold, f'{a}\\sqrt{{{b + 1}}}'),
            (gold, f'{a + 1}\\sqrt{{{b}}}')]
  for _ in range(6):
    k = rng.randint(2, 12)
    out += [(f'{k}\\pi', f'\\pi {k}'), (f'{k}\\pi', f'\\frac{{{2 * k}\\pi}}{{2}}'),
            (f'{k}\\pi', f'{k + 1}\\pi')]
  for _ in range(5):
    a, b = sorted(rng.sample(range(-9, 10), 2))
    out += [(f'({a}, {b}]', f'({a},{b}]'), (f'({a}, {b}]', f'[{a}, {b}]'),
            (f'\\{{{a}, {b}\\}}', f'\\{{{b}, {a}\\}}'),
            (f'\\{{{a}, {b}\\}}', f'\\{{{a}, {b + 1}\\}}'),
            (f'x={a}', f'{a}'), (f'{a}', f'x = {a}')]
  for _ in range(5):
    c = rng.randint(1, 6)
    out += [(f'x^2+{2 * c}x+{c * c}', f'(x+{c})^2'), (f'x^2+{2 * c}x+{c * c}', f'x^2+{c * c}'),
            (f'{c}x+{c}', f'{c}(x+1)'), (f'\\frac{{1}}{{x+{c}}}', f'(x+{c})^{{-1}}')]
  return out


@pytest.mark.heavy
def test_verdicts_agree_with_math_verify():
  import math_verify  # pylint: disable=g-import-not-at-top
  logging.getLogger('math_verify').setLevel(logging.ERROR)
  pairs = _pairs()
  completion = 'Working through it, the result follows.\n\nSo the final answer is $\\boxed{%s}$.'
  records = [{'id': str(i), 'messages': [{'role': 'user', 'content': 'q'}],
              'metadata': {'answer': gold}} for i, (gold, _) in enumerate(pairs)]
  with suites.get('aime25').grader(workers=2, timeout_s=60) as grader:
    ours = [row[0].score for row in
            grader.grade_batch(records, [[completion % answer] for _, answer in pairs])]
  # math-verify's own reading: its parse of the gold and of the whole answer text, its verify.
  theirs = [float(math_verify.verify(math_verify.parse(f'${gold}$', parsing_timeout=None),
                                     math_verify.parse(completion % answer, parsing_timeout=None),
                                     timeout_seconds=None)) for gold, answer in pairs]
  assert len(pairs) >= 200 and 60 <= sum(theirs) <= len(pairs) - 60   # both verdicts, often
  wrong = [(p, o, t) for p, o, t in zip(pairs, ours, theirs) if o != t]
  assert not wrong, wrong
  assert np.mean(ours) == np.mean(theirs)
