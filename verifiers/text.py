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

import itertools
import re

from verifiers import reader

# Titles never end a sentence; Punkt learned them as abbreviations that are
# followed by names.
_TITLES = frozenset('mr mrs ms dr prof sr jr st mt capt col gen lt sgt rev hon gov sen rep'.split())
# Other common English abbreviations (from Punkt's learned list and style
# guides); they end a sentence only before a capitalised word.
_ABBREVIATIONS = _TITLES | frozenset(
    'e.g i.e etc vs cf al approx dept est fig no vol ch pp ed eds inc ltd co corp jan feb mar apr '
    'jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun ave blvd rd u.s u.k a.m p.m '
    'ph.d b.a m.a b.sc m.sc'.split())
_LONGEST = max(map(len, _ABBREVIATIONS))
_WORD = re.compile(r'\w+')
_INITIALS = re.compile(r'(?:[a-z]\.)+[a-z]')
_DOTTED = re.compile(r'(?:\w\.)+')
_SPACE = re.compile(r'(\s+)')
_CLOSERS = '"\'”’)]'
_OPENERS = '"\'“‘(['
_MAY_END = '.?!' + _CLOSERS
_STOPS = frozenset('.?!')


def _ends_sentence(chunk: str, following: str) -> bool:
  """Whether a sentence ends after this whitespace-delimited chunk (the module docstring).

  A sentence can end only at a chunk's end: a run of '.', '?' or '!' there,
  then closing quotes or brackets. Looking at the chunk and the next one
  (`following`, '' at the end) is one pass over the text, where a regex over
  the whole text, searching back for the word before each period, cost a
  second per megabyte of periods.
  """
  core = chunk.rstrip(_CLOSERS)
  word = core.rstrip('.?!')
  punct = core[len(word):]
  if not punct:
    return False
  if '?' in punct or '!' in punct:
    return True
  if len(punct) == 1:
    token = word.lstrip(_OPENERS)
    # Abbreviations and initials are short and ASCII (and the chunk is folded: a look-alike
    # of one is ASCII too), so most words are plain at once (the common case).
    if not token.isascii() or len(token) > _LONGEST and '.' not in token:
      return True
    token = token.lower()
    title = token in _TITLES
    if not title and token not in _ABBREVIATIONS and not (
        len(token) == 1 and 'a' <= token <= 'z') and not (
            '.' in token and _INITIALS.fullmatch(token)):
      return True  # A plain word (not an initial): the period ends the sentence whatever follows.
  following = following.lstrip(_OPENERS)
  if len(punct) >= 2:  # An ellipsis.
    return not following or following[0].isupper()
  if not following:
    return True
  return not title and following[0].isupper() and len(token) > 1


def _ends(chunks: list[str]) -> list[bool]:
  """For each chunk (of text folded by `reader.fold(text, keep_case=True)`: look-alike letters
  read as the letters they look like, so a 'Dr.' with a Cyrillic 'r' is a title), whether a
  sentence ends after it. The text is folded once: folding keeps every chunk's length."""
  following = chunks[1:] + ['']
  # The first tests inline: most chunks end in a letter or a quote after no full stop, and a
  # call per chunk is the cost.
  return [bool(c) and c[-1] in _MAY_END and (c[-1] in _STOPS or c.rstrip(_CLOSERS)[-1:] in _STOPS)
          and _ends_sentence(c, f) for c, f in zip(chunks, following)]


def split_sentences(text: str) -> list[str]:
  """Splits text into sentences (see the module docstring).

  Args:
    text: any text.

  Returns:
    The non-empty sentences, stripped, in order.
  """
  # Chunks at the even indices, the whitespace between them at the odd ones; an empty chunk
  # only first (and last) where the text starts (ends) with whitespace.
  parts = _SPACE.split(text)
  offsets = list(itertools.accumulate(map(len, parts)))
  first = 0 if parts[0] else 2
  ends = _ends(reader.fold(text, keep_case=True).split())
  # Where each sentence ends: after chunk k, at offsets[first + 2k].
  cuts = [0] + [offsets[first + 2 * k] for k in itertools.compress(range(len(ends)), ends)]
  out = [text[a:b].strip() for a, b in zip(cuts, cuts[1:])]
  tail = text[cuts[-1]:].strip()
  return out + [tail] if tail else out


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
  word, mark = chunk[:-1], chunk[-1]
  if mark in '.?!' and word.isalnum():  # A word and its full stop (the next most common).
    if mark != '.' or (last_in_sentence and len(word) > 1):
      return [word, mark]
    return [chunk]  # Inside a sentence, or an initial ('A.').
  # Indices, not repeated slicing: a chunk of a million brackets costs one pass.
  start, end = 0, len(chunk)
  while start < end and chunk[start] in _LEADING:
    start += 1
  head, tail = list(chunk[:start]), []
  while start < end:
    if chunk.endswith('...', start, end):
      tail.append('...')
      end -= 3
      continue
    # A run of trailing marks, each a token: peeled in one go ('...' holds none of them).
    run_end = end
    while end > start and chunk[end - 1] in _TRAILING:
      end -= 1
    if end < run_end:
      tail += reversed(chunk[end:run_end])
    elif (last_in_sentence and chunk[end - 1] == '.' and end - start > 1
          and not _DOTTED.fullmatch(chunk, start, end)):  # Keep 'U.S.' whole.
      tail.append('.')
      end -= 1
    else:
      break
  tail.reverse()
  chunk = chunk[start:end]
  if not chunk or chunk.isalnum():
    return head + ([chunk] if chunk else []) + tail
  # Commas, semicolons and colons inside a chunk split it unless between digits.
  middle = [p for p in re.split(r'((?<!\d)[,;:]|[,;:](?!\d))', chunk) if p]
  words = []
  for piece in middle:
    m = _CLITIC.match(piece) if "'" in piece else None  # Every clitic has an apostrophe.
    words += [m.group(1), m.group(2)] if m and any(c.isalnum() for c in m.group(1)) else [piece]
  return head + words + tail


# A chunk that is one token as it stands, unless it ends a sentence: no leading quote or
# bracket, no trailing punctuation or '...', no comma, semicolon or colon, no apostrophe (so
# no clitic). Most chunks of prose; matching it is one C call where the general path is many.
_WHOLE = re.compile(r'''[^"'“‘(\[{<`,;:][^,;:']*+(?<!['"”’)\]}>,;:!?])(?<!\.\.\.)''')


def word_tokenize(text: str) -> list[str]:
  """Treebank-style tokens (see the module docstring), for counting capitalised words."""
  chunks = text.split()
  ends = _ends(reader.fold(text, keep_case=True).split())
  ends[-1:] = [True]  # The last chunk ends the last sentence, whatever it ends with.
  tokens, seen = [], {}
  for chunk, end in zip(chunks, ends):
    if chunk.isalnum() or not end and _WHOLE.fullmatch(chunk):
      tokens.append(chunk)
    elif end and chunk[-1] in _STOPS and len(chunk) > 2 and chunk[:-1].isalnum():
      tokens += (chunk[:-1], chunk[-1])  # A word and the stop that ends its sentence.
    else:
      # Each distinct chunk is split once: prose and hostile text repeat theirs.
      split = seen.get((chunk, end))
      if split is None:
        split = seen[chunk, end] = _split_chunk(chunk, end)
      tokens += split
  return tokens
