"""IFTrain's 29 checks (IFBench's IF-RLVR training constraints): a response that follows and one
that does not, per instruction; the reference's sentence splitter, loose mode, the deliberate
differences, kwargs errors, hostile inputs, and a record of AllenAI's released training set
loaded and scored end to end by the 'ifbench' verifier."""

import json

import pytest

from cascade import config as config_lib
from cascade.data import readers
from verifiers import ifbench
from verifiers import ifeval
from verifiers import iftrain
import verifiers

PHRASE = 'The early bird catches the worm'
PROMPT = 'Write a haiku about rain.'
COMPOSITION = 'Cats purr. Dogs bark.\n***\nBirds sing. Fish swim.\n***\nCows moo. Owls hoot.'

# id: (kwargs, follows, does not follow)
CASES = {
    'copy:repeat_phrase': ({'phrase': PHRASE, 'small_n': 2},
                           'The early cat catches the worm\nThe early bird eats the worm',
                           'The early bird catches the worm\nThe early bird eats the worm'),
    'copy:copy': ({'prompt_to_repeat': PROMPT}, ' write a haiku about RAIN. ', 'Rain falls.'),
    'new:copy_span_idx': ({'prompt_to_repeat': PROMPT, 'n_start': 2, 'n_end': 8.0}, 'ite a h',
                          'ite a'),
    'detectable_format:sentence_hyphens': ({}, 'I like tea.-You like coffee.-We agree.',
                                           'I like tea.- You like coffee.'),
    'keywords:no_adjacent_consecutive': ({}, 'The cat sat', 'A big dog'),
    'detectable_format:square_brackets': ({}, '[Hello] [world]', '[Hello world]'),
    'keywords:word_once': ({'keyword': 'moon'}, 'The Moon rose.', 'moon and moon'),
    'keywords:word_count_different_numbers': (
        {'keyword': 'sun', 'frequency': 2, 'relation': 'less than'}, 'sun and Sun', 'No star.'),
    'keywords:exclude_word_harder': ({'keyword': 'story'}, 'A tale of history.', 'Story time.'),
    'paragraphs:paragraphs': ({}, 'One.\n***\nTwo.', 'One.\n***\nTwo.\n***\nThree.'),
    'paragraphs:paragraphs2': ({}, 'One.\n\nTwo.', 'One.\nTwo.'),
    'first_word:first_word_sent': ({'first_word': 'yes'}, 'Yes, I do. Yes! yes?', 'Yes, I do. No!'),
    'first_word:first_word_answer': ({'first_word': 'Hello'}, 'Hello, world.', 'Hi, hello.'),
    'last_word:last_word_sent': ({'last_word': 'now'}, 'Go now. Stop now!', 'Go now. Stop.'),
    'last_word:last_word_answer': ({'last_word': 'end'}, 'This is the end.', 'The end is near.'),
    'detectable_format:bigram_wrapping': ({}, '<<I am>> <<at home>>', '<<I am>> at home'),
    'copy:copying_simple': ({'prompt_to_repeat': PROMPT}, PROMPT, PROMPT + ' Rain falls.'),
    'copy:copying_multiple': ({'prompt_to_repeat': 'Say hi.', 'N': 2},
                              'Say hi.\n******\nsay hi.', 'Say hi.'),
    'punctuation:punctuation_dot': ({}, 'No dots here', 'One dot.'),
    'punctuation:punctuation_exclamation': ({}, 'Calm.', 'Wow!'),
    'count:lowercase_counting': ({'N': 2}, 'The Cat sat Down', 'the cat sat'),
    'letters:letter_counting': ({'N': 5, 'relation': 'less than'}, 'Hi 123', 'Hello there'),
    'letters:letter_counting2': ({'letter': 'z', 'let_frequency': 2, 'let_relation': 'at least'},
                                 'Zebra zoo', 'Zebra'),
    'count:counting_composition': ({'n_sent': 2, 'n_words': 2}, COMPOSITION,
                                   COMPOSITION.replace('Fish swim.', 'Fish swim fast.')),
    'count:count_unique': ({}, 'Cats purr. Dogs bark.', 'The cat saw the dog.'),
    'count:count_increment_word': ({'keyword1': 'red', 'keyword2': 'blue'}, 'red blue BLUE',
                                   'red blue'),
    'keywords:palindrome': ({}, 'We saw a racecar.', 'I saw a cat.'),
    'keywords:keyword_specific_position': ({'keyword': 'blue', 'n': 2, 'm': 3},
                                           'Hi there. The sky, blue as ever.',
                                           'Hi there. The blue sky.'),
    'keywords:start_end': ({}, 'Hello, my friend, hello', 'Hello, my friend, hello.'),
}


def test_all_29_instructions_are_covered_and_distinct():
  assert len(iftrain.INSTRUCTIONS) == 29
  assert set(CASES) == set(iftrain.INSTRUCTIONS)
  assert not set(iftrain.INSTRUCTIONS) & (set(ifbench.INSTRUCTIONS) | set(ifeval.INSTRUCTIONS))


@pytest.mark.parametrize('instruction_id', sorted(CASES))
def test_follows_and_does_not_follow(instruction_id):
  kwargs, good, bad = CASES[instruction_id]
  assert iftrain.follows([instruction_id], [kwargs], good) == [True]
  assert iftrain.follows([instruction_id], [kwargs], bad) == [False]
  # The 'ifbench' verifier's dispatch gives the same answers.
  assert ifbench.follows([instruction_id], [kwargs], good) == [True]
  assert ifbench.follows([instruction_id], [kwargs], bad) == [False]


@pytest.mark.parametrize('value, sentences', [
    ('Hello world. How are you? I am fine!', ['Hello world.', 'How are you?', 'I am fine!']),
    ('Dr. Smith went to Washington. He said hi.',
     ['Dr. Smith went to Washington.', 'He said hi.']),
    ('The U.S. He is here.', ['The U.S.', 'He is here.']),
    ('Pi is 3.14 today. Yes...no', ['Pi is 3.14 today.', 'Yes...', 'no']),
    ('He said "hi." Then left.', ['He said "hi".', 'Then left.']),
    ('Visit example.com now.\nOk', ['Visit example.com now.', 'Ok']),
    ('Acme Inc. He left.', ['Acme Inc', 'He left.']),
    ('Wait?! No', ['Wait?', '!', 'No']),
    ('a\ue001b', ['a b']),  # The splitter's own marker cannot be forged.
])
def test_sentences_split_as_the_reference_splits_them(value, sentences):
  assert iftrain.split_sentences(value) == sentences


def test_loose_mode_drops_a_first_line_and_asterisks():
  kw = [{'first_word': 'yes'}]
  assert iftrain.follows(['first_word:first_word_answer'], kw, 'Sure:\nYes.') == [False]
  assert iftrain.follows(['first_word:first_word_answer'], kw, 'Sure:\nYes.', loose=True) == [True]
  assert iftrain.follows(['detectable_format:square_brackets'], [{}], '**[a]** [b]') == [False]
  assert iftrain.follows(['detectable_format:square_brackets'], [{}], '**[a]** [b]',
                         loose=True) == [True]


def test_deliberate_differences_from_the_reference():
  # Each is in docs/ifbench_agreement.md: the reference's code passes the first response of
  # each pair and fails the second, its instruction asks the opposite.
  f = iftrain.follows
  assert f(['keywords:palindrome'], [{}], 'I have a cat.') == [False]
  assert f(['keywords:palindrome'], [{}], 'Level, she said.') == [True]
  assert f(['keywords:start_end'], [{}], '* text *') == [False]
  assert f(['keywords:exclude_word_harder'], [{'keyword': 'cat'}], 'Cat, I said.') == [False]
  assert f(['keywords:word_count_different_numbers'],
           [{'keyword': 'cat', 'frequency': 3, 'relation': 'at least'}], 'cat ' * 4) == [False]
  assert f(['count:count_unique'], [{}], 'The dog saw the cat') == [False]
  assert f(['count:count_unique'], [{}], 'One. Two, three, four.') == [True]
  assert f(['new:copy_span_idx'], [{'prompt_to_repeat': 'abcdef', 'n_start': 1, 'n_end': 3}],
           'bcd') == [True]
  assert f(['count:counting_composition'], [{'n_sent': 1, 'n_words': 2}],
           'Cats purr.\n* * *\nDogs bark.\n* * *\nOwls hoot.') == [True]
  assert f(['keywords:keyword_specific_position'], [{'keyword': 'sky', 'n': 1, 'm': 2}],
           'Blue, sky, today.') == [True]
  assert f(['first_word:first_word_answer'], [{'first_word': 'yes'}], 'Yes, indeed.') == [True]
  assert f(['count:lowercase_counting'], [{'N': 1}], 'café naïve') == [False]
  assert f(['letters:letter_counting'], [{'N': 3, 'relation': 'less than'}], 'éàü') == [False]
  assert f(['punctuation:punctuation_dot'], [{}], 'Done\u3002') == [False]
  assert f(['punctuation:punctuation_exclamation'], [{}], 'Wow\u01c3') == [False]


def test_visible_text_and_look_alikes():
  assert iftrain.follows(['keywords:word_once'], [{'keyword': 'red'}], 'r\u0435d, red') == [False]
  assert iftrain.follows(['punctuation:punctuation_dot'], [{}], 'Done\uff0e') == [False]
  assert iftrain.follows(['first_word:first_word_answer'], [{'first_word': 'yes'}],
                         '\u200bYes') == [True]


@pytest.mark.parametrize('instruction_id, kwargs, message', [
    ('copy:nonsense', {}, r"unknown instruction id 'copy:nonsense'"),
    ('copy:repeat_phrase', {'phrase': PHRASE}, r"copy:repeat_phrase: kwarg 'small_n' is missing"),
    ('copy:repeat_phrase', {'phrase': 'Hi there', 'small_n': 2},
     'copy:repeat_phrase: kwarg phrase .* fewer than three words'),
    ('copy:copying_multiple', {'prompt_to_repeat': 'x', 'N': 0},
     r"copy:copying_multiple: kwarg 'N' must be a positive int"),
    ('count:lowercase_counting', {'N': 2.5}, r"count:lowercase_counting: kwarg 'N' must be"),
    ('letters:letter_counting', {'N': 3, 'relation': 'exactly'},
     r"letters:letter_counting: kwarg 'relation' must be one of"),
    ('letters:letter_counting', {'N': 3}, r"letters:letter_counting: kwarg 'relation' is missing"),
    ('keywords:word_count_different_numbers', {'keyword': 'a', 'frequency': 1, 'relation': 'lt'},
     r"keywords:word_count_different_numbers: kwarg 'relation' must be one of"),
    ('letters:letter_counting2', {'letter': 'ab', 'let_frequency': 1, 'let_relation': 'at least'},
     'letters:letter_counting2: kwarg letter must be one character'),
    ('keywords:word_once', {'keyword': ' '}, r"keywords:word_once: kwarg 'keyword' must be a "
                                             'non-empty string'),
    ('keywords:word_once', {'keyword': 'a', 'N': 3}, r"keywords:word_once: unexpected kwargs \['N'\]"),
    ('first_word:first_word_answer', {'first_word': '--'},
     r"first_word:first_word_answer: kwarg 'first_word' '--' holds no word"),
    ('keywords:keyword_specific_position', {'keyword': 'ice cream', 'n': 1, 'm': 1},
     r"keywords:keyword_specific_position: kwarg 'keyword' 'ice cream' is not one word"),
    ('new:copy_span_idx', {'prompt_to_repeat': 'abc', 'n_start': 2, 'n_end': 1},
     r'new:copy_span_idx: need n_start <= n_end < len\(prompt_to_repeat\) \(3\)'),
    ('new:copy_span_idx', {'prompt_to_repeat': 'abc', 'n_start': 0, 'n_end': 3},
     r'new:copy_span_idx: need n_start <= n_end'),
    ('new:copy_span_idx', {'prompt_to_repeat': 'a   b', 'n_start': 1, 'n_end': 2},
     r'new:copy_span_idx: the span \[1, 2\] of prompt_to_repeat is blank'),
    ('keywords:start_end', [1], 'keywords:start_end: kwargs must be a dict'),
])
def test_kwargs_errors_name_the_instruction_and_field(instruction_id, kwargs, message):
  with pytest.raises(ValueError, match=message):
    ifbench.clean_kwargs(instruction_id, kwargs)


def test_none_kwargs_are_dropped_and_relation_is_optional_where_unused():
  assert iftrain.clean_kwargs('count:lowercase_counting', {'N': 3.0, 'phrase': None}) == {'N': 3}
  assert iftrain.clean_kwargs('keywords:word_count_different_numbers',
                              {'keyword': 'a', 'frequency': 2}) == {'keyword': 'a', 'frequency': 2}
  assert iftrain.clean_kwargs('keywords:start_end', None) == {}


HOSTILE = [
    '(' * 200_000, '\n' * 200_000, ' \n' * 100_000, '.' * 200_000 + 'x', '-' * 200_000,
    '*-' * 100_000, 'a' * 200_000, '<<' * 100_000, 'Dr. ' * 50_000, 'The early ' * 20_000,
    'The early x\n' * 16_000 + ' worm', ('word ' * 40_000).strip(), '!' * 200_000,
    '******' * 30_000, 'a.b.' * 50_000,
]


@pytest.mark.parametrize('instruction_id', sorted(CASES))
def test_hostile_long_inputs(instruction_id):
  # Sizes at which a quadratic check would take minutes; the checks are linear, so the whole
  # set finishes in seconds. Outcomes are bools, never exceptions.
  kwargs = CASES[instruction_id][0]
  for response in HOSTILE:
    assert iftrain.follows([instruction_id], [kwargs], response) in ([True], [False])


def test_a_released_training_record_loads_and_scores(tmp_path):
  # allenai/IF_multi_constraints_upto5's layout: the constraints in 'ground_truth', Python's
  # repr of a one-item list, kwargs padded with None; IFEval's ids beside IFTrain's.
  ground_truth = str([{
      'instruction_id': ['count:count_increment_word', 'punctuation:no_comma',
                         'last_word:last_word_answer'],
      'kwargs': [{'keyword1': 'tea', 'keyword2': 'cup', 'N': None, 'phrase': None}, None,
                 {'last_word': 'morning', 'N': None}]}])
  row = {'key': 'ifeval_42', 'messages': [{'role': 'user', 'content': 'Describe tea.'}],
         'ground_truth': ground_truth, 'dataset': 'ifeval',
         'constraint_type': 'Count Increment Word', 'constraint': 'Include keyword tea once...'}
  bad = dict(row, ground_truth=ground_truth.replace("'morning'", "''"))
  path = tmp_path / 'ifbench.jsonl'
  path.write_text(json.dumps(row) + '\n')
  spec = config_lib.Dataset(name='ifbench_train', format='nemotron_if', record_type='prompt',
                            path=str(path), domain='ifbench')

  def check(domain, metadata, where):
    verifiers.validate(domain, metadata, where)

  rec, = readers.load(spec, check_metadata=check)
  assert rec['id'] == 'ifeval_42' and rec['messages'][-1]['content'] == 'Describe tea.'
  assert rec['metadata']['kwargs'][0] == {'keyword1': 'tea', 'keyword2': 'cup'}
  samples = [verifiers.Sample('Describe tea.', answer, rec['metadata']) for answer in (
      'A cup of tea, a cup every morning', 'A cup of tea and a cup each morning',
      'A cup of tea and a cup each evening')]
  with verifiers.get('ifbench', workers=1, reward='fraction') as v:
    got = [r.reward for r in v.score(samples)]
  assert got == [2 / 3, 1.0, 2 / 3]

  path.write_text(json.dumps(bad) + '\n')
  with pytest.raises(readers.DataError, match=r"ifbench.jsonl:1: instruction 2: "
                                           r"last_word:last_word_answer: kwarg 'last_word'"):
    readers.load(spec, check_metadata=check)
