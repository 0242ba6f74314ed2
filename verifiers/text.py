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
_END = re.compile(r'([.?!]+)(["\'”’)\]]*)(?=\s|\Z)')
_WORD = re.compile(r'\w+')


def _word_before(text: str, end: int) -> str:
  """The whitespace-delimited token ending at text[end] (exclusive), leading brackets dropped."""
  start = end
  while start > 0 and not text[start - 1].isspace():
    start -= 1
  return text[start:end].lstrip('("\'“‘[')


def _next_word(text: str, pos: int) -> str:
  m = re.compile(r'\s*(["\'“‘(\[]*)(\S*)').match(text, pos)
  return m.group(2) if m else ''


def _is_break(text: str, m: re.Match) -> bool:
  punct = m.group(1)
  if '?' in punct or '!' in punct:
    return True
  nxt = _next_word(text, m.end())
  if not nxt:
    return True
  starts_upper = nxt[0].isupper()
  if len(punct) >= 2:  # An ellipsis.
    return starts_upper
  token = _word_before(text, m.start()).lower()
  if token in _TITLES:
    return False
  abbreviation = (token in _ABBREVIATIONS or re.fullmatch(r'[a-z]', token) is not None
                  or re.fullmatch(r'(?:[a-z]\.)+[a-z]', token) is not None)
  if abbreviation:
    return starts_upper and len(token) > 1
  return True


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
  head, tail = [], []
  while chunk and chunk[0] in _LEADING:
    head.append(chunk[0])
    chunk = chunk[1:]
  while chunk:
    if chunk.endswith('...'):
      piece = '...'
    elif chunk[-1] in _TRAILING:
      piece = chunk[-1]
    elif (last_in_sentence and chunk.endswith('.') and len(chunk) > 1
          and not re.fullmatch(r'(?:\w\.)+', chunk)):  # Keep 'U.S.' whole.
      piece = '.'
    else:
      break
    tail.insert(0, piece)
    chunk = chunk[:-len(piece)]
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
