"""Multiple-choice verifier: the letter an answer commits to, on completions in the forms models write."""

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
    # The last statement decides.
    ('At first I thought the answer is A. On reflection, the answer is C.', 'C', 1.0, None),
    ('The answer is C.', 'B', 0.0, 'answer phrase'),
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
    # The option's text.
    ('The answer is Paris.', 'B', 1.0, 'answer phrase'),
    ('paris', 'B', 1.0, 'final line'),
    ('The answer is Paris, the city of light.', 'B', 0.0, 'none'),
    # Unclear: several letters, hedging, negation, letter against text.
    ('The answer is either A or C.', 'A', 0.0, 'answer phrase'),
    ('I think the answer is A, but it could also be C.', 'A', 0.0, 'answer phrase'),
    ('Answer: B or D', 'B', 0.0, 'answer phrase'),
    (r'\boxed{A, C}', 'A', 0.0, 'boxed'),
    ('The answer is not B.', 'B', 0.0, 'answer phrase'),
    ('the correct answer is B: Berlin', 'B', 0.0, 'answer phrase'),
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


@pytest.mark.parametrize('metadata, message', [
    ({}, r"metadata\['answer'\] is missing"),
    ({'answer': 2}, r"metadata\['answer'\] must be str"),
    ({'answer': 'b'}, r'metadata\["answer"\] must be one letter A-Z'),
    ({'answer': 'AB'}, r'metadata\["answer"\] must be one letter A-Z'),
    ({'answer': 'B', 'options': 'A or B'}, r"metadata\['options'\] must be list"),
    ({'answer': 'B', 'options': ['x']}, r'metadata\["options"\] must have 2 to 26 entries'),
    ({'answer': 'B', 'options': ['x', 3]}, r'metadata\["options"\]\[1\] must be str'),
    ({'answer': 'D', 'options': ['x', 'y', 'z']}, r'metadata\["answer"\] \'D\' has no option'),
])
def test_validate_names_the_field(metadata, message):
  with pytest.raises(ValueError, match=r'^data/mcqa.jsonl:3: ' + message):
    verifiers.validate('mcqa', metadata, 'data/mcqa.jsonl:3')
  verifiers.validate('mcqa', {'answer': 'C', 'options': OPTIONS}, 'x')
  verifiers.validate('mcqa', {'answer': 'Z'}, 'x')


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
