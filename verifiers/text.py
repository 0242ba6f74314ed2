"""Sentence splitting and word tokenisation for IFEval, without nltk or its data.

IFEval's reference counts sentences with nltk's pretrained English Punkt model
and tokenises words with nltk's Treebank tokenizer; neither model file can be
downloaded here. These are rule-based stand-ins that follow the same
decisions on ordinary English text:

* a sentence ends at '.', '?' or '!' (possibly repeated, possibly followed by
  closing quotes or brackets) that is followed by whitespace or the end;
  newlines alone never end one (as in Punkt);
* a period does not end a sentence after a known abbreviation or a single
  initial when the next word starts in lower case or with a digit, and never
  after a title such as 'Dr.'; an ellipsis ends one only before a capital;
* words split off surrounding punctuation and the clitics 's 'm 'd 'll 're
  've and n't, keep inner hyphens, apostrophes and periods ('U.S.'), and
  commas or colons between digits ('1,000').
"""

from __future__ import annotations

import re

# Titles never end a sentence; Punkt learned them as abbreviations that are
# followed by names.
_TITLES = frozenset('mr mrs ms dr prof sr jr st mt capt col gen lt sgt rev hon gov sen rep'.split())
# Other common English abbreviations (from Punkt's learned list and style
# guides); they end a sentence only before a capitalised word.
_ABBREVIATIONS = _TITLES | frozenset(
    'e.g i.e etc vs cf al approx dept est fig no vol ch pp ed eds inc ltd co corp jan feb mar apr '
    'jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun ave blvd rd u.s u.k a.m p.m '
    'ph.d b.a m.a b.sc m.sc'.split())
# Runs are possessive and start only where a run of [.?!] starts: every start inside a run
# reaches the same end, so retrying them (and giving characters back) could only fail again,
# and cost quadratic time on a long run of dots.
_END = re.compile(r'(?<![.?!])([.?!]++)(["\'”’)\]]*+)(?=\s|\Z)')
_WORD = re.compile(r'\w+')
_NEXT_WORD = re.compile(r'\s*(["\'“‘(\[]*)(\S*)')
_INITIAL = re.compile(r'[a-z]')
_INITIALS = re.compile(r'(?:[a-z]\.)+[a-z]')
_DOTTED = re.compile(r'(?:\w\.)+')


def _word_before(text: str, end: int) -> str:
  """The whitespace-delimited token ending at text[end] (exclusive), leading brackets dropped."""
  start = end
  while start > 0 and not text[start - 1].isspace():
    start -= 1
  return text[start:end].lstrip('("\'“‘[')


def _next_word(text: str, pos: int) -> str:
  m = _NEXT_WORD.match(text, pos)
  return m.group(2) if m else ''


def _is_break(text: str, m: re.Match) -> bool:
  punct = m.group(1)
  if '?' in punct or '!' in punct:
    return True
  if len(punct) >= 2:  # An ellipsis.
    nxt = _next_word(text, m.end())
    return not nxt or nxt[0].isupper()
  token = _word_before(text, m.start()).lower()
  title = token in _TITLES
  if not title and token not in _ABBREVIATIONS and not _INITIAL.fullmatch(token) and not (
      _INITIALS.fullmatch(token)):
    return True  # A plain word: the period ends the sentence whatever follows.
  nxt = _next_word(text, m.end())
  if not nxt:
    return True
  return not title and nxt[0].isupper() and len(token) > 1


def split_sentences(text: str) -> list[str]:
  """Splits text into sentences (see the module docstring).

  Args:
    text: any text.

  Returns:
    The non-empty sentences, stripped, in order.
  """
  out, start = [], 0
  for m in _END.finditer(text):
    if _is_break(text, m):
      piece = text[start:m.end()].strip()
      if piece:
        out.append(piece)
      start = m.end()
  tail = text[start:].strip()
  if tail:
    out.append(tail)
  return out


def count_sentences(text: str) -> int:
  """Number of sentences, as IFEval's length_constraints:number_sentences counts them."""
  return len(split_sentences(text))


def count_words(text: str) -> int:
  """Number of words: runs of word characters (nltk's RegexpTokenizer(r'\\w+'), as IFEval)."""
  return len(_WORD.findall(text))


_CLITIC = re.compile(r"(?i)^(.+?)(n't|'s|'m|'d|'ll|'re|'ve)$")
_LEADING = '"\'“‘([{<`'
_TRAILING = '"\'”’)]}>,;:!?'


def _split_chunk(chunk: str, last_in_sentence: bool) -> list[str]:
  if chunk.isalnum():  # Nothing to split off (the common case).
    return [chunk]
  # Indices, not repeated slicing: a chunk of a million brackets costs one pass.
  start, end = 0, len(chunk)
  while start < end and chunk[start] in _LEADING:
    start += 1
  head, tail = list(chunk[:start]), []
  while start < end:
    if chunk.endswith('...', start, end):
      size = 3
    elif chunk[end - 1] in _TRAILING:
      size = 1
    elif (last_in_sentence and chunk[end - 1] == '.' and end - start > 1
          and not _DOTTED.fullmatch(chunk, start, end)):  # Keep 'U.S.' whole.
      size = 1
    else:
      break
    tail.append(chunk[end - size:end])
    end -= size
  tail.reverse()
  chunk = chunk[start:end]
  if not chunk or chunk.isalnum():
    return head + ([chunk] if chunk else []) + tail
  # Commas, semicolons and colons inside a chunk split it unless between digits.
  middle = [p for p in re.split(r'((?<!\d)[,;:]|[,;:](?!\d))', chunk) if p]
  words = []
  for piece in middle:
    m = _CLITIC.match(piece)
    words += [m.group(1), m.group(2)] if m and any(c.isalnum() for c in m.group(1)) else [piece]
  return head + words + tail


def word_tokenize(text: str) -> list[str]:
  """Treebank-style tokens (see the module docstring), for counting capitalised words."""
  tokens = []
  for sentence in split_sentences(text):
    chunks = sentence.split()
    for k, chunk in enumerate(chunks):
      tokens += _split_chunk(chunk, k == len(chunks) - 1)
  return tokens
