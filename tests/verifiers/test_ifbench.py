"""IFBench's 58 checks: a response that follows and one that does not, per instruction; loose
mode, kwargs errors, hostile inputs, and the verifier's wiring (registry, RM rule)."""

import numpy as np
import pytest

import verifiers
from verifiers import ifbench

CSV_CITY = 'ID,Country,City,Year,Count\n' + '\n'.join(
    f'{i},France,Paris,2020,{i * 3}' for i in range(1, 8))
_BRANDS = ['"Acme & Co"' if i == 3 else 'Acme' for i in range(1, 15)]
CSV_SPECIAL = 'ProductID,Category,Brand,Price,Stock\n' + '\n'.join(
    f'{i},Tools,{brand},9.99,{i}' for i, brand in enumerate(_BRANDS, 1))
CSV_QUOTES = '\n'.join(
    '\t'.join(f'"{c}{r}"' for c in ('StudentID', 'Subject', 'Grade', 'Semester', 'Score'))
    for r in ('', '1', '2', '3'))
MCQ = '\n'.join(f'Question {k}: {"Which movement " + "really " * k + "began?"}\n'
                + '\n'.join(f'{c}) option {c}' for c in 'ABCDE') for k in range(1, 5))
AFRICA = '\n'.join(['Zimbabwe', 'Zambia', 'Uganda', 'Tunisia', 'Togo', 'Tanzania'] +
                   [f'Country {chr(90 - k // 2)}{"z" if k % 2 == 0 else "a"}' for k in range(46)])
STORY = ' '.join(f'{chr(65 + i)}word follows here.' for i in range(26))
REPEAT_PROMPT = 'Write a poem about the sea.'

# id: (kwargs, follows, does not follow)
CASES = {
    'count:word_count_range': ({'min_words': 3, 'max_words': 4.0}, 'one two three',
                               'one two three four five'),
    'count:unique_word_count': ({'N': 3}, 'Red, green; blue.', 'red red RED ... red'),
    'ratio:stop_words': ({'percentage': 50}, 'The cat sat quietly', 'It is in the box'),
    'ratio:sentence_type': ({}, 'Yes it is. Go there. Why not?', 'Yes it is. Why not?'),
    'ratio:sentence_balance': ({}, 'Yes it is. Why not? Go now!', 'Yes it is. Go there. Go now!'),
    'count:conjunctions': ({'small_n': 2}, 'Tea and cake, but no jam.', 'And and, AND and.'),
    'count:person_names': ({'N': 2}, 'Emma met Liam.', 'Emmanuel met emma and Liam.'),
    'ratio:overlap': ({'reference_text': 'abcdef', 'percentage': 100}, 'bcde', 'bcdx'),
    'count:numbers': ({'N': 2}, 'It cost 3.50 in 1999', 'It cost 3.50 in 1999 and 2000'),
    'words:alphabet': ({}, 'Yes, zebras are big.', 'Apples bake dough.'),
    'words:vowel': ({}, 'A cat sat on a mat.', 'A cat sat on the big mat.'),
    'words:consonants': ({}, 'Strong brave drums', 'Strong ego drum'),
    'sentence:alliteration_increment': ({}, 'No way. Big bad wolf. Sad silly snake sings.',
                                        'Big bad wolf. No way.'),
    'words:palindrome': ({}, ' '.join(['level', 'radar', 'kayak', 'refer', 'civic', 'madam',
                                       'rotor', 'stats', 'tenet', 'racecar']),
                         'level radar kayak refer civic madam rotor stats tenet wow'),
    'count:punctuation': ({}, 'Wait?! Yes! No? Well, maybe; or: fine.', 'Wait, no; maybe: fine.!?'),
    'format:parentheses': ({}, 'a (b [c {d (e [f])}])', 'a (b [c {d (e ]'),
    'format:quotes': ({}, 'He said "she said \'they said "go" today\' loudly" once.',
                      'He said "she said \'go\' loudly" once.'),
    'words:prime_lengths': ({}, 'We ran to the sea.', 'We walk to the sea.'),
    'format:options': ({'options': 'yes/no/maybe'}, 'Maybe.', 'Maybe not.'),
    'format:newline': ({}, 'One\nword\nper\nline.', 'Two words\nhere.'),
    'format:emoji': ({}, 'Hello there 😀. Bye now 🎉!', 'Hello there 😀. Bye now!'),
    'ratio:sentence_words': ({}, 'Cats purr. Dogs bark. Owls hoot.', 'Cats purr. Dogs bark.'),
    'count:words_japanese': ({'N': 2}, 'I 猫 like さくら', 'I 猫 like cherry'),
    'words:start_verb': ({}, 'Imagine a quiet morning.', 'A quiet morning.'),
    'words:repeats': ({'small_n': 2}, 'the cat and the dog', 'the cat, the dog, The end'),
    'sentence:keyword': ({'word': 'moon', 'N': 2.0}, 'Hi. The Moon rose.', 'The moon. Rose.'),
    'count:pronouns': ({'N': 3}, 'She told him/her that it works.', 'The cat sat there.'),
    'words:odd_even_syllables': ({}, 'cat table dog', 'cat dog table'),
    'words:last_first': ({}, 'I like cats. Cats like fish.', 'I like cats. Dogs like fish.'),
    'words:paragraph_last_first': ({}, 'Home is where I go home\nSea and sea.',
                                   'Home is here.\nSea and sea.'),
    'sentence:increment': ({'small_n': 1}, 'Go. Go now. Go now fast.', 'Go. Go now fast.'),
    'words:no_consecutive': ({}, 'A big cat dozed.', 'A big bold cat.'),
    'format:line_indent': ({}, 'a\n b\n\n   c', 'a\n  b\n c'),
    'format:quote_unquote': ({}, '"Carpe diem" means seize the day.', 'I like "carpe diem".'),
    'format:list': ({'sep': 'SEPARATOR'}, 'SEPARATOR a\nSEPARATOR b', 'SEPARATOR a\n- b'),
    'format:thesis': ({}, '<i>Cats rule.</i> They do.', '<i>Cats rule.</i>'),
    'format:sub-bullets': ({}, '* Fruit\n  - apple\n* Veg\n  - leek', '* Fruit\n  - apple\n* Veg'),
    'format:no_bullets_bullets': ({}, 'Two things. Both good.\n* one\n* two',
                                  'One thing.\n* one\n* two'),
    'custom:multiples': ({}, '14, 21, 28, 35, 42, 49', '7, 14, 21, 28, 35, 42, 49'),
    'custom:mcq_count_length': ({}, MCQ, 'Here you go:\n' + MCQ),
    'custom:reverse_newline': ({}, AFRICA, AFRICA.replace('Zambia', 'Angola')),
    'custom:word_reverse': ({}, 'Eagle bald the is it.', 'It is the bald eagle.'),
    'custom:character_reverse': ({}, '.elgae dlab ehT', 'The bald eagle.'),
    'custom:sentence_alphabet': ({}, STORY, STORY.replace('Bword', 'Xword')),
    'custom:european_capitals_sort': ({}, ', '.join(ifbench.EUROPEAN_CAPITALS),
                                      ', '.join(sorted(ifbench.EUROPEAN_CAPITALS))),
    'custom:csv_city': ({}, CSV_CITY, CSV_CITY.replace(',2020,', ',2020;')),
    'custom:csv_special_character': ({}, CSV_SPECIAL, CSV_SPECIAL.replace('"Acme & Co"', 'Acme')),
    'custom:csv_quotes': ({}, CSV_QUOTES, CSV_QUOTES.replace('"Grade1"', 'Grade1')),
    'custom:date_format_list': ({}, '1796-04-12, 1805-12-02', '1796-04-12, 1805-00-02'),
    'count:keywords_multiple': ({'keyword1': 'a1', 'keyword2': 'b2', 'keyword3': 'c3',
                                 'keyword4': 'd4', 'keyword5': 'e5'},
                                'a1 ' + 'b2 ' * 2 + 'c3 ' * 3 + 'd4 ' * 5 + 'e5 ' * 7,
                                'a1 ' + 'b2 ' * 2 + 'c3 ' * 3 + 'd4 ' * 5 + 'e5 ' * 6),
    'words:keywords_specific_position': ({'keyword': 'blue', 'n': 2, 'm': 3},
                                         'Hi there. The sky, blue as ever.',
                                         'Hi there. The blue sky.'),
    'words:words_position': ({'keyword': 'blue'}, 'A blue sky is blue today.',
                             'A blue sky is grey today.'),
    'repeat:repeat_change': ({'prompt_to_repeat': REPEAT_PROMPT}, 'Compose a poem about the sea.',
                             REPEAT_PROMPT),
    'repeat:repeat_simple': ({}, ifbench.REPEAT_SIMPLE.upper(), 'Only output this sentence.'),
    'repeat:repeat_span': ({'prompt_to_repeat': REPEAT_PROMPT, 'n_start': 2, 'n_end': 8},
                           'ite a p', 'Write a poem'),
    'format:title_case': ({}, 'The Quick Brown Fox', 'The quick Brown Fox'),
    'format:output_template': ({}, 'My Answer: x My Conclusion: y Future Outlook: z',
                               'My Answer: x Future Outlook: z'),
    'format:no_whitespace': ({}, 'no_whitespace_here', 'one space'),
}


def test_all_58_instructions_are_covered():
  assert len(ifbench.INSTRUCTIONS) == 58
  assert set(CASES) == set(ifbench.INSTRUCTIONS)


@pytest.mark.parametrize('instruction_id', sorted(CASES))
def test_follows_and_does_not_follow(instruction_id):
  kwargs, good, bad = CASES[instruction_id]
  assert ifbench.follows([instruction_id], [kwargs], good) == [True]
  assert ifbench.follows([instruction_id], [kwargs], bad) == [False]


def test_ifeval_ids_mix_in():
  ids = ['punctuation:no_comma', 'count:numbers', 'length_constraints:number_words']
  kwargs = [{}, {'N': 1.0}, {'num_words': 3.0, 'relation': 'at least'}]  # Arrow floats.
  assert ifbench.follows(ids, kwargs, 'It costs 5 dollars') == [True, True, True]
  assert ifbench.follows(ids, kwargs, 'It costs, 5 and 6') == [False, False, True]


def test_loose_mode_drops_a_first_line_and_asterisks():
  kw = [{'options': 'yes/no/maybe'}]
  response = 'Here is my answer:\n**Yes**'
  assert ifbench.follows(['format:options'], kw, response) == [False]
  assert ifbench.follows(['format:options'], kw, response, loose=True) == [True]
  assert ifbench.follows(['format:no_whitespace'], [{}], 'Sure:\nabc', loose=True) == [True]


def test_deliberate_differences_from_the_reference():
  # Each is in docs/ifbench_agreement.md: the reference's code passes these, its instruction
  # does not.
  assert ifbench.follows(['format:sub-bullets'], [{}], 'No bullets at all.') == [False]
  assert ifbench.follows(['format:thesis'], [{}], '<em></em>') == [False]
  assert ifbench.follows(['custom:date_format_list'], [{}], '1800-00-00') == [False]
  assert ifbench.follows(['format:quote_unquote'], [{}], 'I said \u201chi\u201d') == [False]
  assert ifbench.follows(['count:conjunctions'], [{'small_n': 2}], 'and And and,') == [False]


@pytest.mark.parametrize('instruction_id, kwargs, message', [
    ('count:nonsense', {}, r"unknown instruction id 'count:nonsense'"),
    ('count:numbers', {}, r"count:numbers: kwarg 'N' is missing"),
    ('count:numbers', {'N': 2.5}, r"count:numbers: kwarg 'N' must be a non-negative int"),
    ('count:numbers', {'N': True}, r"kwarg 'N' must be a non-negative int"),
    ('count:numbers', {'N': 2, 'M': 1}, r"count:numbers: unexpected kwargs \['M'\]"),
    ('count:words_japanese', {'N': 0}, r"count:words_japanese: kwarg 'N' must be a positive int"),
    ('sentence:keyword', {'word': ' ', 'N': 1}, r"sentence:keyword: kwarg 'word' must be a "
                                                 'non-empty string'),
    ('count:word_count_range', {'min_words': 5, 'max_words': 4},
     'count:word_count_range: kwarg min_words 5 > max_words 4'),
    ('repeat:repeat_span', {'prompt_to_repeat': 'abc', 'n_start': 2, 'n_end': 1},
     'repeat:repeat_span: kwarg n_start 2 > n_end 1'),
    ('format:options', {'options': 'yes'}, 'format:options: kwarg options .* fewer than two'),
    ('count:numbers', [1], 'count:numbers: kwargs must be a dict'),
])
def test_kwargs_errors_name_the_instruction_and_field(instruction_id, kwargs, message):
  with pytest.raises(ValueError, match=message):
    ifbench.clean_kwargs(instruction_id, kwargs)


def test_none_kwargs_are_dropped():
  assert ifbench.clean_kwargs('count:numbers', {'N': 3.0, 'small_n': None}) == {'N': 3}
  assert ifbench.clean_kwargs('format:title_case', None) == {}


HOSTILE = [
    '(' * 200_000, '"\'' * 100_000, '\n' * 200_000, ' \n' * 100_000, '.' * 200_000 + 'x',
    'Question 1\n' * 20_000, '*-' * 100_000, 'a' * 200_000, '<i>' * 50_000,
    '"' + 'x,' * 100_000, ('word ' * 40_000).strip(), '1800-01-01,' * 20_000,
]


@pytest.mark.parametrize('instruction_id', sorted(CASES))
def test_hostile_long_inputs(instruction_id):
  # Sizes at which a quadratic check would take minutes (2e5 characters squared); the checks
  # are linear, so the whole set finishes in seconds. Outcomes are bools, never exceptions.
  kwargs = CASES[instruction_id][0]
  for response in HOSTILE:
    assert ifbench.follows([instruction_id], [kwargs], response) in ([True], [False])


def test_invisible_characters_do_not_change_counts():
  assert ifbench.follows(['count:word_count_range'], [{'min_words': 1, 'max_words': 1}],
                         'one\u200btwo') == [True]
  assert ifbench.follows(['format:no_whitespace'], [{}], 'a\u3164b') == [False]
  assert ifbench.follows(['count:keywords_multiple'],
                         [{'keyword1': 'red', 'keyword2': 'x', 'keyword3': 'y', 'keyword4': 'z',
                           'keyword5': 'w'}],
                         'r\u0435d red ' + 'x ' * 2 + 'y ' * 3 + 'z ' * 5 + 'w ' * 7) == [False]


S = verifiers.Sample
MD = {'instruction_id_list': ['format:no_whitespace', 'count:numbers'], 'kwargs': [{}, {'N': 1}]}


def test_verifier_scores_batches_and_fails_closed():
  assert 'ifbench' in verifiers.names()
  samples = [S('p', 'abc1', MD), S('p', 'a b 1', MD), S('p', '<think>x</think>ab12', MD),
             S('p', 'abc1', {'instruction_id_list': ['count:numbers'], 'kwargs': [{}]}),
             S('p', 'abc1', {'instruction_id_list': ['bogus:id'], 'kwargs': [{}]})]
  with verifiers.get('ifbench', workers=1) as v:
    results = v.score(samples)
  assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0]
  assert results[1].info['followed'] == [False, True]
  assert "kwarg 'N' is missing" in results[3].info['reason']
  assert "unknown instruction id 'bogus:id'" in results[4].info['reason']
  with verifiers.get('ifbench', workers=1, reward='fraction', mode='loose') as v:
    assert v.score([S('p', 'Sure:\na b 1', MD)])[0].reward == 1.0
  with pytest.raises(ValueError, match='ifbench: mode must be strict or loose'):
    verifiers.get('ifbench', mode='lenient')


def test_both_modes_reports_each_instruction_strict_and_loose():
  with verifiers.get('ifbench', workers=1, both_modes=True) as v:
    r = v.score([S('p', 'Sure:\nabc1', MD), S('p', 'a b 1', MD)])
  assert (r[0].info['strict'], r[0].info['loose']) == ([False, True], [True, True])
  assert (r[1].info['strict'], r[1].info['loose']) == ([False, True], [False, True])


def test_validate_names_the_record():
  with pytest.raises(ValueError, match=r"data/x.jsonl:3: instruction 1: count:numbers: kwarg 'N'"):
    verifiers.validate('ifbench', {'instruction_id_list': ['format:no_whitespace', 'count:numbers'],
                                   'kwargs': [{}, {'N': -1}]}, 'data/x.jsonl:3')


def test_thinking_mode_reward_model_rule_is_instruction_followings():
  def scorer(prompts, answers):
    return np.array([float(len(a)) for a in answers])
  md = {'instruction_id_list': ['format:no_whitespace'], 'kwargs': [{}]}
  samples = [S('A', 'ab', md), S('A', 'abcd', md), S('A', 'a b', md)]
  with verifiers.get('ifbench', rm_scorer=scorer, workers=1) as v:
    got = [r.reward for r in v.score(samples)]
  scores = np.array([2.0, 4.0, 3.0])
  z = (scores - scores.mean()) / scores.std()
  np.testing.assert_allclose(got, [1 + 1 / (1 + np.exp(-z[0])), 1 + 1 / (1 + np.exp(-z[1])), 0.0])
