"""The 25 IFEval checks: one response that follows and one that does not, per instruction."""

import random
import re
import time

import pytest

from verifiers import ifeval

LT, AL = 'less than', 'at least'
EN = ('The quick brown fox jumps over the lazy dog near the river bank while the children '
      'watch from the old wooden bridge and laugh together.')

# id: (kwargs, follows, does not follow)
CASES = {
    'keywords:existence': ({'keywords': ['fox', 'Bridge']}, 'A fox on a bridge.', 'A fox alone.'),
    'keywords:frequency': ({'keyword': 'cat', 'frequency': 2, 'relation': AL},
                           'Cat and cat.', 'One cat.'),
    'keywords:forbidden_words': ({'forbidden_words': ['red', 'blue']}, 'Reddish is fine.',
                                 'The sky is BLUE.'),
    'keywords:letter_frequency': ({'letter': 'z', 'let_frequency': 3, 'let_relation': LT},
                                  'Zoo bus.', 'Zoo buzz.'),
    'language:response_language': ({'language': 'de'},
                                    'Das ist ein ganz normaler deutscher Satz über das Wetter.',
                                    EN),
    'length_constraints:number_sentences': ({'num_sentences': 3, 'relation': LT},
                                            'One. Two.', 'One. Two. Three.'),
    'length_constraints:number_paragraphs': ({'num_paragraphs': 2}, 'First.\n***\nSecond.',
                                             'First.\n***\n\n***\nSecond.'),
    'length_constraints:number_words': ({'num_words': 5, 'relation': AL},
                                        'one two three four five', 'one two three four'),
    'length_constraints:nth_paragraph_first_word': (
        {'num_paragraphs': 2, 'nth_paragraph': 2, 'first_word': 'Then'},
        'Intro here.\n\n"Then," we left.', 'Intro here.\n\nAfter that we left.'),
    'detectable_content:number_placeholders': ({'num_placeholders': 2}, 'Hi [name], at [address].',
                                               'Hi [name].'),
    'detectable_content:postscript': ({'postscript_marker': 'P.S.'}, 'Bye.\n\nP.S. See you.',
                                      'Bye. PS see you.'),
    'detectable_format:number_bullet_lists': ({'num_bullets': 2}, 'List:\n* one\n- two',
                                              'List:\n* one\n* two\n* three'),
    'detectable_format:constrained_response': ({}, 'My answer is maybe.', 'Maybe.'),
    'detectable_format:number_highlighted_sections': ({'num_highlights': 2},
                                                      '*one* and **two**', '*one* and ** **'),
    'detectable_format:multiple_sections': ({'section_spliter': 'Section', 'num_sections': 2},
                                            'Section 1\nA\nSection 2\nB', 'Section 1\nA'),
    'detectable_format:json_format': ({}, '```json\n{"a": 1}\n```', '{"a": 1} trailing'),
    'detectable_format:title': ({}, '<<My Poem>>\nRoses.', '<< >>\nRoses.'),
    'combination:two_responses': ({}, 'First answer.\n******\nSecond answer.',
                                  'Same.\n******\nSame.'),
    'combination:repeat_prompt': ({'prompt_to_repeat': 'Write a poem.'},
                                  'write a poem. Here it is.', 'Here it is: Write a poem.'),
    'startend:end_checker': ({'end_phrase': 'Any other questions?'},
                             'Done. Any other questions?"', 'Any other questions? Done.'),
    'change_case:capital_word_frequency': ({'capital_frequency': 2, 'capital_relation': AL},
                                           'This is VERY IMPORTANT.', 'This is VERY important.'),
    'change_case:english_capital': ({}, EN.upper(), EN),
    'change_case:english_lowercase': ({}, EN.lower(), EN),
    'punctuation:no_comma': ({}, 'No commas here.', 'One, two.'),
    'startend:quotation': ({}, '"Quoted."', '"Half quoted.'),
}


def test_all_25_instructions_are_covered():
  assert len(ifeval.INSTRUCTIONS) == 25
  assert set(CASES) == set(ifeval.INSTRUCTIONS)


@pytest.mark.parametrize('instruction_id', sorted(CASES))
def test_follows_and_does_not_follow(instruction_id):
  kwargs, good, bad = CASES[instruction_id]
  assert ifeval.follows([instruction_id], [kwargs], good) == [True]
  assert ifeval.follows([instruction_id], [kwargs], bad) == [False]


def test_reference_quirks():
  # Keywords are regular expressions in the reference; an invalid one is literal.
  assert ifeval.follows(['keywords:existence'], [{'keywords': ['colou?r']}], 'Color.') == [True]
  assert ifeval.follows(['keywords:existence'], [{'keywords': ['C++']}], 'I like C++.') == [True]
  # Undetectable language counts as followed; an empty response never does.
  assert ifeval.follows(['language:response_language'], [{'language': 'fr'}], '12345') == [True]
  assert ifeval.follows(['punctuation:no_comma'], [{}], '   ') == [False]
  # The nth paragraph is indexed in the raw split, empty paragraphs included.
  kw = {'num_paragraphs': 2, 'nth_paragraph': 2, 'first_word': 'b'}
  assert ifeval.follows(['length_constraints:nth_paragraph_first_word'], [kw],
                        'a\n\n\n\nb') == [False]
  # A markdown divider at the very start or end is not an empty paragraph.
  assert ifeval.follows(['length_constraints:number_paragraphs'], [{'num_paragraphs': 2}],
                        '***\nA\n***\nB\n***') == [True]
  # Postscript markers other than the two built-in ones are matched literally-ish.
  assert ifeval.follows(['detectable_content:postscript'], [{'postscript_marker': 'Note:'}],
                        'Hi.\nNOTE: later.') == [True]


def test_loose_mode_removes_first_or_last_line_and_asterisks():
  kw = [{'end_phrase': 'Bye.'}]
  response = 'Sure! Here it is.\nHello. Bye.\n(Let me know if you need more.)'
  assert ifeval.follows(['startend:end_checker'], kw, response) == [False]
  assert ifeval.follows(['startend:end_checker'], kw, response, loose=True) == [True]
  quote = '**"All of it."**'
  assert ifeval.follows(['startend:quotation'], [{}], quote) == [False]
  assert ifeval.follows(['startend:quotation'], [{}], quote, loose=True) == [True]
  variants = ifeval.loose_variants('a\n*b*\nc')
  assert len(variants) == 8 and 'b' in variants and '*b*' in variants


def test_kwargs_validation():
  # Arrow-style records carry every kwarg name, None where unused.
  assert ifeval.clean_kwargs('punctuation:no_comma', {'num_words': None, 'keyword': None}) == {}
  assert ifeval.clean_kwargs('punctuation:no_comma', None) == {}
  with pytest.raises(ValueError, match='unknown instruction id'):
    ifeval.clean_kwargs('multi-turn:constrained_start', {})
  with pytest.raises(ValueError, match=r"unexpected kwargs \['num_words'\]"):
    ifeval.clean_kwargs('punctuation:no_comma', {'num_words': 3})
  with pytest.raises(ValueError, match="kwarg 'relation' is missing"):
    ifeval.clean_kwargs('length_constraints:number_words', {'num_words': 3})
  with pytest.raises(ValueError, match='must be one of'):
    ifeval.clean_kwargs('length_constraints:number_words', {'num_words': 3, 'relation': 'at most'})
  with pytest.raises(ValueError, match='non-negative int'):
    ifeval.clean_kwargs('length_constraints:number_words', {'num_words': True, 'relation': LT})
  with pytest.raises(ValueError, match='one character'):
    ifeval.clean_kwargs('keywords:letter_frequency', {'letter': 'ab', 'let_frequency': 1,
                                                      'let_relation': LT})
  with pytest.raises(ValueError, match='nth_paragraph <= num_paragraphs'):
    ifeval.clean_kwargs('length_constraints:nth_paragraph_first_word',
                        {'num_paragraphs': 2, 'nth_paragraph': 3, 'first_word': 'x'})


@pytest.mark.parametrize('instruction_id, kwargs, response', [
    # Not blank (a blank response is not checked at all).
    ('detectable_content:postscript', {'postscript_marker': 'P.S.'}, 'x' + '\n' * 1_000_000),
    ('detectable_content:postscript', {'postscript_marker': 'P.P.S'}, 'x' + ' ' * 1_000_000),
    ('detectable_format:number_bullet_lists', {'num_bullets': 1}, 'x' + '\n' * 1_000_000),
    ('detectable_format:number_bullet_lists', {'num_bullets': 1}, 'x' + ' \n' * 500_000),
    ('detectable_content:number_placeholders', {'num_placeholders': 1}, '[' * 1_000_000),
    ('detectable_format:title', {}, '<' * 1_000_000),
    ('detectable_format:json_format', {}, '[' * 1_000_000),
    ('length_constraints:number_sentences', {'num_sentences': 1, 'relation': AL},
     '.' * 1_000_000 + 'x'),
    ('change_case:capital_word_frequency', {'capital_frequency': 1, 'capital_relation': AL},
     '(' * 1_000_000),
    ('change_case:capital_word_frequency', {'capital_frequency': 1, 'capital_relation': AL},
     '...' * 333_333),
])
def test_hostile_megabyte_responses_check_fast(instruction_id, kwargs, response):
  # The worker-side bound, as the host parsers': a megabyte costs under a second of CPU. The
  # reference's regexes took minutes on these (quadratic), and json_format raised RecursionError.
  start = time.process_time()
  assert ifeval.follows([instruction_id], [kwargs], response) in ([True], [False])
  assert time.process_time() - start < 1.0


def test_linear_rewrites_count_as_the_reference_regexes():
  rng = random.Random(0)
  for _ in range(20_000):
    v = ''.join(rng.choice('[]<>*-\n \t\r\x0bapsPS.') for _ in range(rng.randrange(14)))
    assert ifeval._count_placeholders(v) == len(re.findall(r'\[.*?\]', v)), v
    assert ifeval._title(v, {}) == any(t.lstrip('<').rstrip('>').strip()
                                       for t in re.findall(r'<<[^\n]+>>', v)), v
    bullets = (len(re.findall(r'^\s*\*[^\*].*$', v, flags=re.MULTILINE))
               + len(re.findall(r'^\s*-.*$', v, flags=re.MULTILINE)))
    assert ifeval._bullets(v, {'num_bullets': bullets}), v
    for marker, pattern in (('P.S.', r'\s*p\.\s?s\..*$'), ('P.P.S', r'\s*p\.\s?p\.\s?s.*$'),
                            ('ps', r'\s*ps.*$')):
      assert ifeval._postscript(v, {'postscript_marker': marker}) == bool(
          re.findall(pattern, v.lower(), flags=re.MULTILINE)), (v, marker)


@pytest.mark.parametrize('instruction_id, kwargs, response, followed', [
    # Zero-width spaces and joiners split nothing: one visible word is one word.
    ('length_constraints:number_words', {'num_words': 5, 'relation': AL},
     'one\u200btwo\u200cthree\u200dfour\u2060five\ufeff', False),
    # Hangul fillers render blank: they separate words and are not words themselves.
    ('length_constraints:number_words', {'num_words': 5, 'relation': AL},
     'one \u3164 \u3164 \u115f \u1160 \uffa0', False),
    ('length_constraints:number_words', {'num_words': 3, 'relation': LT},
     'one\u3164two\u3164three', False),
    # Nor can invisible characters deflate a count below what a reader sees.
    ('length_constraints:number_words', {'num_words': 3, 'relation': AL},
     'one\u3164two\u2800three', True),
    # Look-alike commas are commas.
    ('punctuation:no_comma', {}, 'Red\uff0c green\u060c blue\u3001 and\u201a gray\ufe50 or not',
     False),
    ('punctuation:no_comma', {}, 'Red and green and blue', True),
    # An invisible character or a look-alike letter does not hide a forbidden word.
    ('keywords:forbidden_words', {'forbidden_words': ['red']}, 'The sky is r\u200bed.', False),
    ('keywords:forbidden_words', {'forbidden_words': ['red']}, 'The sky is r\u0435d.', False),
    ('keywords:forbidden_words', {'forbidden_words': ['red']}, 'The sky is \uff52\uff45\uff44.',
     False),
    # And a keyword must be there as a reader sees it, not split by an invisible separator.
    ('keywords:frequency', {'keyword': 'cat', 'frequency': 2, 'relation': LT},
     'cat and c\u200bat', False),
    ('keywords:existence', {'keywords': ['fox']}, 'A f\u043ex ran.', True),
])
def test_invisible_and_look_alike_characters_are_read_as_seen(instruction_id, kwargs, response,
                                                              followed):
  assert ifeval.follows([instruction_id], [kwargs], response) == [followed]
