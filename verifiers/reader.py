"""What a reader sees: the one reading of model text that every instruction check uses.

IFEval (`verifiers.ifeval`), the IF-RLVR training constraints
(`verifiers.iftrain`) and IFBench (`verifiers.ifbench`) read a response and
their instructions' strings through `visible` before any check, and compare
words and letters through `fold`. The references count code points, which a
policy learns to exploit: 'a\u200bb' is two words to `\\w+` and one to a
reader, U+E0080 (unassigned, so not even a format character) renders as
nothing, U+2029 is a line break that '\\n'-splitting misses, and 'rеd' with a
Cyrillic 'е' is not the forbidden 'red' to `==`.

`visible(value)` is the text a reader sees:

* blank letters as spaces: the Hangul fillers U+115F, U+1160, U+3164 and
  U+FFA0 and the blank braille pattern U+2800 render as a gap, so they
  separate words and are never words themselves;
* every other invisible character deleted: each Default_Ignorable_Code_Point,
  assigned or not (zero-width space and joiners, U+2060, U+FEFF, soft hyphen,
  bidirectional marks, variation selectors, tags, U+E0080 and the rest of
  the unassigned U+E0000-U+E0FFF, U+2065, U+FFF0-U+FFF8), and every other
  format character (category Cf), so they split and lengthen nothing;
* NFKC, which folds compatibility forms: full-width and mathematical
  letters, digits and punctuation ('ｆｏｘ', '𝐟𝐨𝐱', '，'), ligatures;
* every line or paragraph separator as one line break '\\n': CR LF, CR,
  VT, FF, the information separators U+001C-U+001E, NEL U+0085, U+2028 and
  U+2029 (a reader sees a new line, so a check that counts '\\n' sees one
  and one only);
* look-alike commas as ',' (those NFKC leaves: Arabic, ideographic, low-9
  quotation mark, Armenian, Ethiopic, Mongolian, Vai, Lisu, Bamum, NKo and
  the raised/turned/reversed comma punctuation).

`fold(value)` is the key that compares words and letters as a reader tells
them apart. Each letter becomes the letter that Unicode TR39's confusable
skeleton reads it as (ICU's `SpoofChecker.getSkeleton`, whose data is
Unicode's confusables.txt; PyPI's pyicu-wheels bundles ICU), then is
case-folded, so look-alikes of every script are one letter: Cyrillic 'е'
and 'Н', Greek 'ο' and 'Ν', Armenian 'օ', Cherokee 'Ꭺ', Coptic 'ⲟ', Lisu
'ꓮ', Latin 'ɑ' and 'ı' read as 'e', 'h', 'o', 'n', 'o', 'a', 'o', 'a', 'a'
and 'i'. It works letter by letter and keeps a letter whose skeleton is not
one letter, so a key has its text's length and word boundaries, and digits
and punctuation stay themselves: TR39's confusables within ASCII ('rn' and
'm', '1' and 'l', '0' and 'O', 'I' and 'l') stay apart, as a reader of
ordinary English keeps 'modern' and 'modem', 'I' and 'l' apart. A capital
keeps its case where its lower case reads as a letter (TR39 reads 'I',
Cyrillic 'І' and Greek 'Ι' as 'l'; here they are 'I'). Both sides of every
comparison are folded (a skeleton is never compared with a raw string).
`fold(value, keep_case=True)` is the same letters before case-folding, for
the checks that compare case. A letter is read by its own look, so where a
script's capital and small letter look like different Latin letters
(Cyrillic 'Н' and 'н'), they fold apart.

Which checks read which: counting checks (words, sentences, paragraphs,
letters, capitals, lengths, punctuation) count on `visible`; checks that
compare words or letters with each other or with an instruction's strings
(keywords, forbidden and stop words, uniqueness, repetition, vowels and
consonants, first and last words, copies, fixed phrases) compare `fold`s.
Language detection reads `visible` (a Russian answer stays Russian).

Both are linear: a translation table and two regex passes.
"""

from __future__ import annotations

import re
import unicodedata

import icu
import regex

# Letters that render as a blank gap (Hangul fillers, blank braille): a space, not nothing.
_BLANKS = '\u115f\u1160\u3164\uffa0\u2800'
_COMMAS = ('\u060c\u3001\u201a\u055d\u07f8\u1363\u1802\u1808\u2e32\u2e34\u2e41\ua4fe'
           '\ua60d\ua6f5')
# Regexes, not str.translate: a translation table costs 0.1 s on a megabyte of CJK text.
_BLANK = re.compile(f'[{_BLANKS}]')
_COMMA = re.compile(f'[{_COMMAS}]')
# `regex` knows the property for unassigned code points too (Python's unicodedata does not).
_INVISIBLE = regex.compile(r'[\p{Default_Ignorable_Code_Point}\p{Cf}]+')
_LINE_BREAK = re.compile('\r\n|[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]')


def visible(value: str) -> str:
  """The text a reader sees (see the module docstring).

  Args:
    value: a response or an instruction's string.

  Returns:
    Blank letters as spaces, invisible characters deleted, NFKC, line and
    paragraph separators as '\\n', look-alike commas as ','.
  """
  # Deleted before NFKC, so that a letter and its accent split by an invisible character
  # compose as the reader sees them; blank letters are Default_Ignorable too, so they go first.
  value = _INVISIBLE.sub('', _COMMA.sub(',', _BLANK.sub(' ', value)))
  return _LINE_BREAK.sub('\n', unicodedata.normalize('NFKC', value))


_SPOOF = icu.SpoofChecker()


def _skeleton_letter(value: str) -> str:
  """TR39's skeleton of `value` (NFC), if that is one letter, else ''."""
  skeleton = unicodedata.normalize('NFC', _SPOOF.getSkeleton(0, value))
  return skeleton if len(skeleton) == 1 and skeleton.isalpha() else ''


def _cased(char: str) -> str:
  """The letter a reader takes `char` for, in `char`'s case (see `fold`); a non-letter is itself."""
  if not char.isalpha():
    return char
  own = _skeleton_letter(char)
  if char.isupper():
    if own.isupper():
      return own
    # TR39 reads 'I' (and Cyrillic 'І', Greek 'Ι') as 'l': the capital of what its lower case
    # reads as keeps the case a reader sees.
    upper = _skeleton_letter(char.lower()).upper()
    return upper if len(upper) == 1 and upper.isupper() else char
  if char.islower():
    return own if own.islower() else char
  return own or char  # A letter without case (Lisu, Hebrew): the letter it looks like.


def _key(char: str, keep_case: bool) -> str:
  """`_cased`, and for comparing without case, that letter case-folded (one character)."""
  cased = _cased(char)
  if keep_case:
    return cased
  for folded in (cased.casefold(), cased.lower()):
    if len(folded) == 1:
      return folded
  return cased


class _Keys(dict):
  """str.translate's table, filled on first sight of each code point."""

  def __init__(self, keep_case: bool):
    super().__init__()
    self._keep_case = keep_case

  def __missing__(self, code: int) -> str:
    key = self[code] = _key(chr(code), self._keep_case)
    return key


_FOLD = _Keys(keep_case=False)
_FOLD_CASED = _Keys(keep_case=True)


def fold(value: str, keep_case: bool = False) -> str:
  """Each letter as the one letter a reader takes it for (see the module docstring).

  Args:
    value: text already read by `visible`.
    keep_case: keep each letter's case (else letters come out lower case).

  Returns:
    A string of the same length: letters replaced by their TR39 skeleton
    letter where that is one letter; digits, punctuation and space as they
    were.
  """
  if value.isascii():  # Every ASCII letter reads as itself.
    return value if keep_case else value.lower()
  return value.translate(_FOLD_CASED if keep_case else _FOLD)


# A backslash escape: its letter is syntax (\b, \D, \x41, \N{...}), not text to fold.
_ESCAPE = re.compile(r'\\(?:N\{[^}]*\}|x[0-9a-fA-F]{0,2}|u[0-9a-fA-F]{0,4}|U[0-9a-fA-F]{0,8}|.)',
                     re.DOTALL)


def fold_pattern(pattern: str, keep_case: bool = False) -> str:
  """A regular expression to search `fold`ed text with: its literal letters folded.

  Escapes stay as written; where folding makes the pattern invalid (an
  inline flag's letter), the folded pattern is taken literally.

  Args:
    pattern: a valid regular expression over `visible` text.
    keep_case: as in `fold`.

  Returns:
    The pattern for the folded text.
  """
  out, pos = [], 0
  for m in _ESCAPE.finditer(pattern):
    out += [fold(pattern[pos:m.start()], keep_case), m.group()]
    pos = m.end()
  folded = ''.join(out) + fold(pattern[pos:], keep_case)
  try:
    re.compile(folded)
  except re.error:
    return re.escape(folded)
  return folded
