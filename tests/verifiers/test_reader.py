"""verifiers.reader: the text a reader sees and the letters a reader tells apart, and every
instruction checker (IFEval, IFTrain, IFBench) scoring invisible and look-alike text exactly as
its visible equivalent."""

import itertools
import sys

import pytest
import regex

from tests.verifiers import test_ifbench
from tests.verifiers import test_ifeval
from tests.verifiers import test_iftrain
from verifiers import ifbench
from verifiers import ifeval
from verifiers import iftrain
from verifiers import reader

# Default-ignorable code points, assigned and not (U+E0080, U+2065, U+FFF0 and U+E0FFF are
# unassigned: category Cn, which the old deletion of category Cf missed).
INVISIBLE = ['\u200b', '\u200d', '\u2060', '\ufeff', '\u00ad', '\u034f', '\ufe0f', '\u061c',
             '\u180e', '\U000e0041', '\U000e0080', '\u2065', '\ufff0', '\U000e0fff']
# What a reader sees as one line break.
SEPARATORS = ['\u2028', '\u2029', '\r\n', '\r', '\x85', '\x0b', '\x0c', '\x1c', '\x1e']
# Letters of other scripts drawn like a Latin one (Unicode's confusables): Cyrillic, Greek,
# Armenian, Cherokee, Coptic, Lisu and Latin's own look-alikes, not only Cyrillic and Greek.
LOOK_ALIKES = {
    'a': 'аɑ', 'c': 'сᴄ', 'e': 'е', 'o': 'оοօⲟ', 'p': 'рρⲣ', 'u': 'սᴜ', 'h': 'һհ',
    'i': 'іıɩ', 'n': 'ո', 'g': 'ցɡ', 's': 'ѕꜱ', 'x': 'х', 'y': 'уγү', 'v': 'νᴠ', 'w': 'ԝᴡ',
    'd': 'ԁ', 'j': 'јϳ', 'q': 'ԛ', 'r': 'гᴦ', 'z': 'ᴢ',
    'A': 'АΑᎪꓮ', 'B': 'ВΒᏴꓐ', 'C': 'СᏟꓚ', 'D': 'Ꭰꓓ', 'E': 'ЕΕᎬꓰ', 'F': 'ꓝϜ', 'G': 'ԌᏀꓖ',
    'H': 'НΗᎻꓧ', 'I': 'ІΙӀ', 'J': 'ЈᎫꓙ', 'K': 'КΚᏦꓗ', 'L': 'Ꮮꓡ', 'M': 'МΜᎷꓟ', 'N': 'Νꓠ',
    'O': 'ОΟՕⲞ', 'P': 'РΡᏢꓑ', 'R': 'ᏒꓣᎡ', 'S': 'ЅᏚꓢ', 'T': 'ТΤᎢꓔ', 'U': 'Սꓴ', 'V': 'ᏙꓦѴ',
    'W': 'ԜᏔꓪ', 'X': 'ХΧꓫ', 'Y': 'ҮΥꓬ', 'Z': 'ΖᏃꓜ',
}
CHECKERS = {'ifeval': (ifeval, test_ifeval.CASES), 'iftrain': (iftrain, test_iftrain.CASES),
            'ifbench': (ifbench, test_ifbench.CASES)}
# Language detection reads the letters as written (a Russian answer stays Russian).
READS_SCRIPTS = {'language:response_language', 'change_case:english_capital',
                 'change_case:english_lowercase'}


def _hide(value: str) -> str:
  """value with invisible characters between all its characters and its line breaks as other
  separators: what a reader sees is unchanged."""
  invisible, separators = itertools.cycle(INVISIBLE), itertools.cycle(SEPARATORS)
  return ''.join((next(separators) if c == '\n' else c) + next(invisible) for c in value)


def _look_alike(value: str) -> str:
  """value with every letter that has look-alikes written in another script, by turns."""
  turns = {c: itertools.cycle(alikes) for c, alikes in LOOK_ALIKES.items()}
  return ''.join(next(turns[c]) if c in turns else c for c in value)


def _disguised_kwargs(module, instruction_id: str, kwargs: dict, disguise) -> dict:
  """kwargs with the strings the instruction compares with disguised (not relations, nor a
  'raw' string, whose character indices the record gives)."""
  spec = module.INSTRUCTIONS[instruction_id][1]
  return {k: disguise(v) if spec.get(k) == ifeval.STR else [disguise(x) for x in v]
          if spec.get(k) == ifeval.STRS else v for k, v in kwargs.items()}


@pytest.mark.parametrize('checker', sorted(CHECKERS))
def test_invisible_text_scores_as_its_visible_equivalent(checker):
  # Every instruction of every checker, on a response that follows it and one that does not.
  module, cases = CHECKERS[checker]
  for instruction_id, (kwargs, *responses) in sorted(cases.items()):
    for response, loose in itertools.product(responses, (False, True)):
      want = module.follows([instruction_id], [kwargs], response, loose=loose)
      assert module.follows([instruction_id], [kwargs], _hide(response), loose=loose) == want, (
          instruction_id, response, loose)
      assert module.follows([instruction_id], [_disguised_kwargs(module, instruction_id, kwargs, _hide)], response,
                            loose=loose) == want, (instruction_id, kwargs, loose)


@pytest.mark.parametrize('checker', sorted(CHECKERS))
def test_look_alike_text_scores_as_its_visible_equivalent(checker):
  module, cases = CHECKERS[checker]
  for instruction_id, (kwargs, *responses) in sorted(cases.items()):
    if instruction_id in READS_SCRIPTS:
      continue
    for response in responses:
      want = module.follows([instruction_id], [kwargs], response)
      assert module.follows([instruction_id], [kwargs], _look_alike(response)) == want, (
          instruction_id, response, _look_alike(response))
      assert module.follows([instruction_id], [_disguised_kwargs(module, instruction_id, kwargs, _look_alike)],
                            response) == want, (instruction_id, kwargs)


@pytest.mark.parametrize('checker, instruction_id, kwargs, hidden, seen', [
    # A keyword hidden by look-alikes of several scripts is still there.
    ('ifeval', 'keywords:forbidden_words', {'forbidden_words': ['honey']},
     'Some \u04bb\u0585\u0578\u0435\u0443.', 'Some honey.'),
    ('iftrain', 'count:count_unique', {}, 'The cat and th\u0435 dog', 'The cat and the dog'),
    ('ifbench', 'words:repeats', {'small_n': 1}, 'go \u0261\u0585 stop', 'go go stop'),
    ('ifbench', 'ratio:stop_words', {'percentage': 40},
     '\u13a2\u04bbe cat sat \u0585n \u0251 mat', 'The cat sat on a mat'),
    ('ifbench', 'words:vowel', {}, 'We hid a red m\u057dg.', 'We hid a red mug.'),
    # An unassigned invisible code point neither splits nor lengthens a word.
    ('ifbench', 'count:word_count_range', {'min_words': 2, 'max_words': 2},
     'one\U000e0080two three', 'onetwo three'),
    ('iftrain', 'keywords:palindrome', {},
     'We saw a lev\U000e0080el.', 'We saw a level.'),
    # A paragraph separator is a line break: the answer is on two lines.
    ('ifbench', 'words:vowel', {}, 'A cat sat\u2029on a mat.', 'A cat sat\non a mat.'),
    ('iftrain', 'paragraphs:paragraphs2', {}, 'One.\u2029\u2029Two.', 'One.\n\nTwo.'),
    ('ifeval', 'length_constraints:nth_paragraph_first_word',
     {'num_paragraphs': 2, 'nth_paragraph': 2, 'first_word': 'two'}, 'One.\u2028\u2028Two.',
     'One.\n\nTwo.'),
])
def test_disguised_text_scores_as_what_a_reader_sees(checker, instruction_id, kwargs, hidden,
                                                     seen):
  module = CHECKERS[checker][0]
  want = module.follows([instruction_id], [kwargs], seen)
  assert module.follows([instruction_id], [kwargs], hidden) == want


# Every code point, in order (no CR before a LF: each line boundary stands alone).
EVERY = ''.join(map(chr, range(sys.maxunicode + 1)))


def test_visible_deletes_every_default_ignorable_code_point_assigned_or_not():
  ignorable = ''.join(regex.findall(r'\p{Default_Ignorable_Code_Point}', EVERY))
  blanks = '\u115f\u1160\u3164\uffa0'   # Hangul fillers: a gap, so a space (below).
  assert '\U000e0080' in ignorable and '\u2065' in ignorable
  assert reader.visible('a' + ''.join(c for c in ignorable if c not in blanks) + 'b') == 'ab'
  assert reader.visible('one\u3164two\u2800three') == 'one two three'
  # Deleted before NFKC: a letter and its accent split by one compose as a reader sees them.
  assert reader.visible('e\U000e0080\u0301') == '\u00e9'


def test_visible_reads_every_line_separator_as_one_line_break():
  # Python's own list of line boundaries (those splitlines() removes): each is one '\n', CR LF
  # too.
  breaks = [line[-1] for line in EVERY.splitlines(keepends=True)[:-1]]
  assert set(SEPARATORS) - {'\r\n'} <= set(breaks)
  for separator in breaks + ['\r\n']:
    assert reader.visible(f'a{separator}b') == 'a\nb', hex(ord(separator[0]))


def test_visible_keeps_ordinary_text_and_other_scripts():
  for value in ('Hello, world.', 'Ünïcödé façade', 'Привет, мир', '北京', 'a\nb\n\nc'):
    assert reader.visible(value) == value
  assert reader.visible('a\u00adb\u200ec \uff46\uff4f\uff58\uff0c') == 'abc fox,'


def test_fold_reads_look_alikes_as_one_letter_and_keeps_ascii_apart():
  for letter, alikes in LOOK_ALIKES.items():
    for alike in alikes:
      assert reader.fold(alike) == letter.lower(), (letter, alike)
      assert reader.fold(alike, keep_case=True) == letter, (letter, alike)
  # Both sides folded: ASCII reads as itself, and TR39's confusables within ASCII stay apart
  # (a legitimate 'modern', 'l1', 'I', 'O0' is not another word).
  ascii_letters = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'
  assert reader.fold(ascii_letters, keep_case=True) == ascii_letters
  assert reader.fold(ascii_letters) == ascii_letters.lower()
  for a, b in (('modern', 'modem'), ('l', '1'), ('I', 'l'), ('O', '0'), ('rn', 'm')):
    assert reader.fold(a) != reader.fold(b)
  # Same length, digits and punctuation kept: word boundaries and counts are the text's.
  value = 'Пр\u0456вет, 42 m\u043ere!'
  assert len(reader.fold(value)) == len(value) and reader.fold(value)[7:] == ' 42 more!'


def test_fold_pattern_folds_letters_and_keeps_escapes():
  pattern = reader.fold_pattern('C\u043elou?r' + r'\b\D\x41')
  assert pattern == r'colou?r\b\D\x41'
  assert reader.fold_pattern('(?L)x') == r'\(\?l\)x'  # Folding broke it: literal.
