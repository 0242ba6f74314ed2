"""Multiple-choice verifier: the letter an answer commits to, on completions in the forms models write."""

import random
import re
import time

import pytest

import verifiers
from verifiers import mcqa

S = verifiers.Sample
OPTIONS = ['London', 'Paris', 'Berlin', 'Madrid']

# (completion, gold, reward, found_by); found_by None skips that check.
CASES = [
    # Explicit statements.
    (r'The capital of France is Paris, so $\boxed{B}$.', 'B', 1.0, 'boxed'),
    (r'Therefore the answer is $\boxed{\text{B}}$', 'B', 1.0, 'boxed'),
    (r'\boxed{(C)}', 'C', 1.0, 'boxed'),
    (r'\boxed{B. Paris}', 'B', 1.0, 'boxed'),
    ('Answer: B', 'B', 1.0, 'answer phrase'),
    ('Paris is the capital of France.\n\nThe answer is (B).', 'B', 1.0, 'answer phrase'),
    ('**Answer:** B', 'B', 1.0, 'answer phrase'),
    ('**Answer: C**', 'C', 1.0, 'answer phrase'),
    ('Final Answer: D', 'D', 1.0, 'answer phrase'),
    ('Comparing the options, the correct answer is B: Paris', 'B', 1.0, 'answer phrase'),
    ('The best option is (C).', 'C', 1.0, 'answer phrase'),
    ('The answer is A because the net force on it is largest.', 'A', 1.0, 'answer phrase'),
    ('Answer:\n\nD', 'D', 1.0, None),
    ('answer: b', 'B', 1.0, 'answer phrase'),
    ('Option C is the correct answer.', 'C', 1.0, 'letter is correct'),
    ('(A) fails the units check, so B is correct.', 'B', 1.0, 'letter is correct'),
    ('The answer is B, not A.', 'B', 1.0, 'answer phrase'),
    ('Answer: 42 m/s (B)', 'B', 1.0, 'answer phrase'),
    ('After checking the units, A is correct.', 'A', 1.0, 'letter is correct'),
    ('The answer is B and I am confident about it.', 'B', 1.0, 'answer phrase'),
    ('The answer is B, though maybe I am missing something.', 'B', 1.0, 'answer phrase'),
    ('The final answer is B, or (B) in the original labels.', 'B', 1.0, 'answer phrase'),
    (r'\boxed{Paris}', 'B', 1.0, 'boxed'),
    (r'$\boxed{B\,}$', 'B', 1.0, 'boxed'),
    # A statement is the rest of its line (the next line after a bare "Answer:").
    ('Answer: B\n\nIt could also be C, but C fails the units check.', 'B', 1.0, 'answer phrase'),
    ('Answer:\n\nD, since it is the heaviest.\nIt could also be C, but C fails the units check.',
     'D', 1.0, 'answer phrase'),
    # A box cut off by the end of the answer is skipped.
    ('Answer: B\n\\boxed{x\\', 'B', 1.0, 'answer phrase'),
    ('I tried \\boxed{\\frac{1}{2} but it never closes.\nThe answer is C.', 'C', 1.0,
     'answer phrase'),
    # The last statement decides.
    ('At first I thought the answer is A. On reflection, the answer is C.', 'C', 1.0, None),
    ('The answer is C.', 'B', 0.0, 'answer phrase'),
    ('The answer is A.', 'B', 0.0, 'answer phrase'),
    (r'\boxed{A} ... no, wait: \boxed{D}', 'D', 1.0, 'boxed'),
    ('Answer: B\n\nI hope this helps!', 'B', 1.0, 'answer phrase'),
    # Final-line forms.
    ('**B**', 'B', 1.0, 'final line'),
    ('(B)', 'B', 1.0, 'final line'),
    ('B)', 'B', 1.0, 'final line'),
    ('B.', 'B', 1.0, 'final line'),
    ('Paris is the capital of France.\n\nB', 'B', 1.0, 'final line'),
    ('Option B', 'B', 1.0, 'final line'),
    ('b', 'B', 1.0, 'final line'),
    ('Reasoning about each city.\nB) Paris', 'B', 1.0, 'final line'),
    ('(A) is wrong.\n(B) is right.\n(C) is wrong.\n\n**C**', 'C', 1.0, 'final line'),
    ('Hence (B).', 'B', 1.0, 'final line'),
    ('Reasoning about each city.\nB) the capital of France', 'B', 1.0, 'final line'),
    ('Both reach the ground together. ' * 15 + 'Hence (B).', 'B', 1.0, 'final line'),
    # The option's text.
    ('The answer is Paris.', 'B', 1.0, 'answer phrase'),
    ('The answer is __Paris__.', 'B', 1.0, 'answer phrase'),
    ('_Paris_', 'B', 1.0, 'final line'),
    ('paris', 'B', 1.0, 'final line'),
    ('The answer is Paris, the city of light.', 'B', 0.0, 'none'),
    # Unclear: several letters, hedging, negation, letter against text.
    ('The answer is either A or C.', 'A', 0.0, 'answer phrase'),
    ('I think the answer is A, but it could also be C.', 'A', 0.0, 'answer phrase'),
    ('Answer: B or D', 'B', 0.0, 'answer phrase'),
    (r'\boxed{A, C}', 'A', 0.0, 'boxed'),
    ('The answer is not B.', 'B', 0.0, 'answer phrase'),
    ('the correct answer is B: Berlin', 'B', 0.0, 'answer phrase'),
    ('The correct answer is C: Paris', 'C', 0.0, 'answer phrase'),
    ('Reasoning about each city.\nA) Paris', 'A', 0.0, 'final line'),
    ('Reasoning about each city.\nC) Paris', 'C', 0.0, 'final line'),
    ('Both (A) and (C) look plausible.', 'A', 0.0, 'final line'),
    # Prose, not letters.
    ('A car travels 60 km in one hour, so its speed is 60 km/h.', 'A', 0.0, 'none'),
    ('Answer: A car travels at 60 km/h.', 'A', 0.0, 'none'),
    ('The answer is a bit subtle here.', 'A', 0.0, 'none'),
    ('I think it is Berlin or so.', 'A', 0.0, 'none'),
    ('The answer is E = mc^2.', 'E', 0.0, 'none'),
    ('i.e. this is it', 'I', 0.0, 'none'),
    ('', 'A', 0.0, 'none'),
    # Only the text after the thinking block counts.
    ('<think>The answer is B.</think>I am not sure.', 'B', 0.0, 'none'),
    ('<think>Maybe A? No: B.</think>\n\n**Answer:** B', 'B', 1.0, 'answer phrase'),
    ('<think>The answer is B. Let me double-check', 'B', 0.0, None),
]


@pytest.fixture(scope='module')
def verifier():
  with verifiers.get('mcqa') as v:
    yield v


def test_table_of_completions(verifier):
  # Golds past D are scored without options (an answer needs its option).
  results = verifier.score([S('q', c, {'answer': g, 'options': OPTIONS} if g <= 'D' else
                              {'answer': g}) for c, g, _, _ in CASES])
  for (completion, _, reward, how), r in zip(CASES, results):
    assert r.reward == reward, (completion, r.info)
    if how is not None:
      assert r.info['found_by'] == how, (completion, r.info)


def test_reasons_say_why(verifier):
  r = verifier.score([S('q', 'The answer is either A or C.', {'answer': 'A'}),
                      S('q', 'No idea.', {'answer': 'A'}),
                      S('q', 'the correct answer is B: Berlin', {'answer': 'B',
                                                                'options': OPTIONS}),
                      S('q', 'Answer: C', {'answer': 'B'}),
                      S('q', 'Answer: B', {'answer': 'B'})])
  assert r[0].info['reason'] == 'the final statement names several letters (A, C)'
  assert r[1].info['reason'] == 'no answer letter found'
  assert 'text of option C' in r[2].info['reason']
  assert (r[3].info['reason'], r[3].info['extracted']) == ('wrong letter', 'C')
  assert r[4].info == {'gold': 'B', 'extracted': 'B', 'found_by': 'answer phrase',
                       'reason': 'correct'}


def test_option_text_needs_options_and_a_unique_match():
  assert mcqa.extract_choice('Paris')[0] is None
  assert mcqa.extract_choice('**Paris**', OPTIONS)[0] == 'B'
  assert mcqa.extract_choice('Paris', ['Paris', 'paris.', 'Rome'])[0] is None


def test_a_letter_before_a_letter_of_any_script_is_a_word():
  cities = ['Rio de Janeiro', 'São Paulo', 'Zürich']
  assert mcqa.extract_choice('The answer is São Paulo.', cities) == ('B', 'answer phrase', '')
  assert mcqa.extract_choice(r'\boxed{Zürich}', cities) == ('C', 'boxed', '')
  assert mcqa.extract_choice('The answer is A, or perhaps Zürich.', cities)[0] == 'A'
  assert mcqa.extract_choice('I would pick the option Zürich here.')[0] is None
  assert mcqa.extract_choice("The answer is Gödel's theorem.")[0] is None


# A line of 400 characters ending "... neither is faster." that starts "e. Both": the tail
# of "...ignore air resistance here. Both ..." where a final line is cut.
_CUT_AT_E = ('e. ' + 'Both reach the ground together, so neither is faster. ' * 8)[:399] + '.'


def test_a_long_final_line_is_read_from_where_it_starts():
  assert len(_CUT_AT_E) == mcqa._MAX_STATEMENT_CHARS
  # Whole, the line starts with the letter E; cut out of a longer line it does not.
  assert mcqa.extract_choice('Thinking.\n' + _CUT_AT_E)[0] == 'E'
  assert mcqa.extract_choice(_CUT_AT_E)[0] == 'E'
  assert mcqa.extract_choice('We ignore air resistance her' + _CUT_AT_E)[0] is None
  assert mcqa.extract_choice('y' * len(_CUT_AT_E) + _CUT_AT_E)[0] is None
  # A long line's own start is read; blanks before its end do not cut it.
  assert mcqa.extract_choice('B. ' + _CUT_AT_E) == ('B', 'final line', '')
  assert mcqa.extract_choice(' ' * 500 + 'B) Paris') == ('B', 'final line', '')
  # Where the scanned text starts inside the line, its start is not read at all.
  scan = mcqa._MAX_SCAN_CHARS
  assert mcqa.extract_choice('x' * scan + _CUT_AT_E + ' ' * (scan - 400))[0] is None
  assert mcqa.extract_choice('x' * scan + '\t' + _CUT_AT_E + ' ' * (scan - 400))[0] is None
  assert mcqa.extract_choice('B) ' + 'x ' * (scan // 2))[0] is None
  assert mcqa.extract_choice('x' * scan + '\n' + _CUT_AT_E + ' ' * (scan - 400))[0] == 'E'
  assert mcqa.extract_choice('x' * scan + '\n' + _CUT_AT_E + ' ' * (scan - 401))[0] == 'E'


_N = mcqa._MAX_STATEMENT_CHARS


@pytest.mark.parametrize('answer, letter', [
    ('Answer: B\n\nIt could also be C, but C fails the units check.', 'B'),
    ('Answer:\n\nD, since it is the heaviest.\nIt could also be C, but C fails the units check.',
     'D'),
    (r'\boxed{Paris}', 'B'),
    # A box longer than a statement is skipped.
    ('The answer is C.\n\\boxed{B' + ' ' * (_N + 50) + '}', 'C'),
    # A statement's last character is read; the one after it is not.
    ('The answer is' + ' ' * (_N - 1) + 'B because it is heavier.', 'B'),
    ('The answer is either' + ' ' * (_N - 8) + 'B', 'B'),
    # A long final line is read from its start.
    ('B. ' + _CUT_AT_E, 'B'),
    ('The answer is' + ' ' * _N + 'B because it is heavier.', None),
])
def test_a_statement_reads_the_same_anywhere_in_the_answer(answer, letter):
  for n in range(520):
    assert mcqa.extract_choice('x' * n + '\n' + answer, OPTIONS)[0] == letter, n


def test_only_the_last_statements_and_characters_are_read():
  filler = 'The answer is what we check next.\n'
  assert mcqa.extract_choice('Answer: B.\n' + filler * (mcqa._MAX_STATEMENTS - 1))[0] == 'B'
  assert mcqa.extract_choice('Answer: B.\n' + filler * mcqa._MAX_STATEMENTS)[0] is None
  scan = mcqa._MAX_SCAN_CHARS
  assert mcqa.extract_choice('Answer: B\n' + 'x' * (scan - 10))[0] == 'B'
  assert mcqa.extract_choice('Answer: B\n' + 'x' * (scan - 9))[0] is None
  # Blanks before a letter do not cut its line.
  assert mcqa.extract_choice('B'.rjust(scan)) == ('B', 'final line', '')


def test_scanned_is_reported_past_the_limit(verifier):
  scan = mcqa._MAX_SCAN_CHARS
  r = verifier.score([S('q', 'x' * (scan - 2) + '\nB', {'answer': 'B'}),
                      S('q', 'x' * (scan - 1) + '\nB', {'answer': 'B'})])
  assert [x.reward for x in r] == [1.0, 1.0], [x.info for x in r]
  assert 'scanned' not in r[0].info
  assert r[1].info['scanned'] == f'the last {scan} characters'


@pytest.mark.parametrize('metadata, message', [
    ({}, r"metadata\['answer'\] is missing"),
    ({'answer': 2}, r"metadata\['answer'\] must be str"),
    ({'answer': 'b'}, r'metadata\["answer"\] must be one letter A-Z'),
    ({'answer': ''}, r'metadata\["answer"\] must be one letter A-Z'),
    ({'answer': 'AB'}, r'metadata\["answer"\] must be one letter A-Z'),
    ({'answer': 'B', 'options': 'A or B'}, r"metadata\['options'\] must be list"),
    ({'answer': 'B', 'options': ['x']}, r'metadata\["options"\] must have 2 to 26 entries'),
    ({'answer': 'B', 'options': ['x'] * 27}, r'metadata\["options"\] must have 2 to 26 entries'),
    ({'answer': 'B', 'options': ['x', 3]}, r'metadata\["options"\]\[1\] must be str'),
    ({'answer': 'D', 'options': ['x', 'y', 'z']}, r'metadata\["answer"\] \'D\' has no option'),
    ({'answer': 'E', 'options': ['x', 'y', 'z']}, r'metadata\["answer"\] \'E\' has no option'),
])
def test_validate_names_the_field(metadata, message):
  with pytest.raises(ValueError, match=r'^data/mcqa.jsonl:3: ' + message):
    verifiers.validate('mcqa', metadata, 'data/mcqa.jsonl:3')
  verifiers.validate('mcqa', {'answer': 'C', 'options': OPTIONS}, 'x')
  verifiers.validate('mcqa', {'answer': 'Z'}, 'x')
  verifiers.validate('mcqa', {'answer': 'Z', 'options': [str(i) for i in range(26)]}, 'x')


@pytest.mark.parametrize('text', [
    'the answer is ' * 80_000, '\\boxed{' * 150_000, '\\boxed{\\text{' * 90_000, '(' * 1_000_000,
    'Answer: ' + 'A, or ' * 170_000, 'A ' * 500_000, ' *_:"`{([' * 100_000,
    'answer is ' + 'either option ' * 70_000, '(A) **B** option C [D] ' * 45_000,
    'x' * 1_000_000 + '\n**A**',
    # Long whitespace runs inside an answer phrase (quadratic with plain `\s*`).
    'x' * 980_000 + 'answer' + ' ' * 10_000 + '**' + ' ' * 9_000 + 'so.',
])
def test_hostile_megabyte_answers_score_fast(verifier, text):
  start = time.perf_counter()
  (r,) = verifier.score([S('q', text, {'answer': 'A', 'options': OPTIONS})])
  assert time.perf_counter() - start < 0.5
  assert r.info['scanned'] == 'the last 20000 characters'
  # Only the last, unambiguous final line may count.
  assert r.reward == (1.0 if text.endswith('**A**') else 0.0), r.info


# --- The benchmarks' official extractions (`extraction='mmlu_pro'` / 'simple_evals') ----------
# The official scripts' patterns as they are written: the reference the linear versions match.


def _mmlu_pro_reference(text):
  """TIGER-Lab MMLU-Pro `evaluate_from_api.py`: extract_answer / extract_again / extract_final."""
  m = re.search(r'answer is \(?([A-J])\)?', text)
  if m:
    return m.group(1)
  m = re.search(r'.*[aA]nswer:\s*([A-J])', text)
  if m:
    return m.group(1)
  m = re.search(r'\b[A-J]\b(?!.*\b[A-J]\b)', text, re.DOTALL)
  return m.group(0) if m else None


def _simple_evals_reference(text):
  """openai/simple-evals `ANSWER_PATTERN_MULTICHOICE`, first match."""
  m = re.search(r'(?i)Answer[ \t]*:[ \t]*\$?([A-D])\$?', text)
  return m.group(1) if m else None


TRICKY = [
    'The answer is (B).', 'the answer is B', 'The Answer is B, so: B', 'The answer is Definitely C',
    'answer is (J) and later the answer is (A)', 'Answer: C\nanswer: D\nAnswer: E',
    'Option A. Answer: B; final answer: C\nAnswer: D', 'answer: Answer: B', 'Answer:\n\nB',
    'I think A. But on reflection the best choice is E.', 'I choose (A) but maybe (B)',
    'None of them, I am sure.', 'Aé B', 'x' * 3000 + ' Answer: C ' + 'y' * 3000, '',
    'ANSWER: c', 'answer: b', 'Answer : $C$', 'Answer:\tD', 'Answer:\nB', '**Answer:** B',
    'The answer: A. Later Answer: C', 'Answer: E', 'Answer:$B$', 'My answer is (K)... so F',
    'I.e. the answer is G\nAnswer: H', 'first line\nsecond Answer:  I then answer: J\nAnswer: A',
]


def _random_texts(n, seed=0):
  rng = random.Random(seed)
  pieces = ['answer', 'Answer', 'ANSWER', ' is ', ':', ' ', '\t', '\n', '(', ')', '$', 'x', 'é',
            '.', ','] + list('ABCDEFGHIJK') + ['ab', 'Ja']
  return [''.join(rng.choice(pieces) for _ in range(rng.randint(0, 40))) for _ in range(n)]


def test_official_extractions_equal_the_official_patterns():
  for text in TRICKY + _random_texts(3000):
    assert mcqa.extract_mmlu_pro(text)[0] == _mmlu_pro_reference(text), repr(text)
    assert mcqa.extract_simple_evals(text)[0] == _simple_evals_reference(text), repr(text)
  # Which of MMLU-Pro's patterns found it.
  assert mcqa.extract_mmlu_pro('The answer is (B).') == ('B', 'answer is')
  assert mcqa.extract_mmlu_pro('answer: Answer: B') == ('B', 'answer:')
  assert mcqa.extract_mmlu_pro('I choose (A) but maybe (B)') == ('B', 'last letter')
  assert mcqa.extract_mmlu_pro('None of them.') == (None, 'none')


def test_official_extractions_are_linear_on_long_lines():
  # One line of 'answer: ' without a letter: the reference's `.*[aA]nswer:` retries from every
  # position (quadratic); the linear match is fast.
  text = 'answer: x ' * 100_000
  t0 = time.perf_counter()
  assert mcqa.extract_mmlu_pro(text) == (None, 'none')
  assert mcqa.extract_simple_evals(text) == (None, 'none')
  assert time.perf_counter() - t0 < 2.0


def test_verifier_scores_with_an_official_extraction():
  with verifiers.get('mcqa', extraction='mmlu_pro') as v:
    r = v.score([S('q', '<think>the answer is (A)</think>So the answer is (C).', {'answer': 'C'}),
                 S('q', 'Hmm.\nAnswer: B', {'answer': 'C'}),
                 S('q', 'no letter here', {'answer': 'C'}),
                 S('q', '<think>the answer is (C)', {'answer': 'C'})])
  assert [x.reward for x in r] == [1.0, 0.0, 0.0, 0.0]
  assert r[0].info == {'gold': 'C', 'extracted': 'C', 'found_by': 'answer is', 'reason': 'correct'}
  assert (r[1].info['extracted'], r[1].info['reason']) == ('B', 'wrong letter')
  assert r[2].info['reason'] == 'no answer letter (mmlu_pro)'
  with verifiers.get('mcqa', extraction='simple_evals') as v:
    r = v.score([S('q', 'Answer: B', {'answer': 'B'}), S('q', 'answer: b', {'answer': 'B'}),
                 S('q', 'The answer is (B).', {'answer': 'B'})])
  # simple-evals takes the letter as written ('b' is not 'B') and reads only "Answer: X".
  assert [x.reward for x in r] == [1.0, 0.0, 0.0]
  with pytest.raises(ValueError, match='extraction must be one of'):
    verifiers.get('mcqa', extraction='lm_eval')
