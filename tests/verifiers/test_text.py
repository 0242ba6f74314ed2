"""Rule-based sentence splitting and word tokenisation (IFEval's counts without nltk data)."""

import random
import re
import time

import pytest

from verifiers import text


@pytest.mark.parametrize('source, sentences', [
    ('Hello world. How are you? Fine!', ['Hello world.', 'How are you?', 'Fine!']),
    ('Dr. Smith met Mr. Jones at 5 p.m. on Monday.', ['Dr. Smith met Mr. Jones at 5 p.m. on Monday.']),
    ('It costs $3.50. That is cheap.', ['It costs $3.50.', 'That is cheap.']),
    ('J. R. R. Tolkien wrote it. Then he rested.', ['J. R. R. Tolkien wrote it.', 'Then he rested.']),
    ('Apples, pears, etc. are fruit.', ['Apples, pears, etc. are fruit.']),
    ('I like fruit, e.g. apples. You do too.', ['I like fruit, e.g. apples.', 'You do too.']),
    ('He said "Stop." Then he left.', ['He said "Stop."', 'Then he left.']),
    ('Wait... what? Yes...\nNo.', ['Wait... what?', 'Yes...', 'No.']),
    ('Well... maybe.', ['Well... maybe.']),
    ('The U.S. is large. The U.K. Parliament sat.', ['The U.S. is large.', 'The U.K.', 'Parliament sat.']),
    ('Line one\nline two without stop', ['Line one\nline two without stop']),
    ('Really?! Yes.', ['Really?!', 'Yes.']),
    ('', []),
    ('   \n ', []),
])
def test_split_sentences(source, sentences):
  assert text.split_sentences(source) == sentences
  assert text.count_sentences(source) == len(sentences)


def test_count_words_is_word_character_runs():
  assert text.count_words("Don't stop-me now, 3.5 times!") == 8
  assert text.count_words('') == 0
  assert text.count_words('naïve café') == 2


def test_word_tokenize_treebank_style():
  assert text.word_tokenize("I DON'T know, JOHN'S U.S.-made car (1,000 km) is \"FAST\".") == [
      'I', 'DO', "N'T", 'know', ',', 'JOHN', "'S", 'U.S.-made', 'car', '(', '1,000', 'km', ')',
      'is', '"', 'FAST', '"', '.']
  assert text.word_tokenize('HELLO,WORLD: A-OK.') == ['HELLO', ',', 'WORLD', ':', 'A-OK', '.']
  assert text.word_tokenize('Wait... OK') == ['Wait', '...', 'OK']


# The splitter as it was written first: a plain regex over the whole text for the ends, a
# search back for the word before each. Quadratic on hostile text, plain to read: the oracle.
_PLAIN_END = re.compile(r'([.?!]+)(["\'”’)\]]*)(?=\s|\Z)')


def _plain_split(value):
  out, start = [], 0
  for m in _PLAIN_END.finditer(value):
    punct = m.group(1)
    nxt = re.match(r'\s*["\'“‘(\[]*(\S*)', value[m.end():]).group(1)
    token = re.search(r'\S*\Z', value[:m.start()]).group().lstrip('("\'“‘[').lower()
    if '?' in punct or '!' in punct:
      ends = True
    elif len(punct) >= 2:
      ends = not nxt or nxt[0].isupper()
    elif (token not in text._TITLES and token not in text._ABBREVIATIONS
          and not re.fullmatch(r'[a-z]', token) and not re.fullmatch(r'(?:[a-z]\.)+[a-z]', token)):
      ends = True
    else:
      ends = not nxt or (token not in text._TITLES and nxt[0].isupper() and len(token) > 1)
    if ends:
      if value[start:m.end()].strip():
        out.append(value[start:m.end()].strip())
      start = m.end()
  return out + ([value[start:].strip()] if value[start:].strip() else [])


def test_one_pass_over_chunks_splits_and_tokenizes_as_the_plain_regex():
  # The splitter decides at each whitespace-delimited chunk from it and the next; the
  # tokenizer takes most chunks whole. Both as the plain regex and the chunk splitter did.
  rng = random.Random(0)
  pieces = ['a', 'Ab', 'Dr', 'e.g', 'U.S', 'etc', 'The', '.', '...', '?', '!', '"', "'", '(', ')',
            ']', '“', '’', ' ', ' ', '\n', '\t', '1', 'i.e', ',', ';', "n't", "'s", '<', '`']
  for _ in range(20_000):
    v = ''.join(rng.choice(pieces) for _ in range(rng.randrange(12)))
    sentences = _plain_split(v)
    assert text.split_sentences(v) == sentences, v
    tokens = []
    for sentence in sentences:
      chunks = sentence.split()
      for k, chunk in enumerate(chunks):
        tokens += text._split_chunk(chunk, k == len(chunks) - 1)
    assert text.word_tokenize(v) == tokens, v


@pytest.mark.parametrize('source', ['.' * 1_000_000 + 'x', '!' * 1_000_000 + '"x',
                                    '(' * 1_000_000, '"' * 1_000_000, '...' * 333_333])
def test_hostile_megabyte_texts_tokenize_fast(source):
  # Quadratic before: the sentence regex retried each dot of a run, and tokenisation peeled a
  # run of brackets or ellipses off one character (copy) at a time.
  start = time.process_time()
  text.count_sentences(source)
  text.word_tokenize(source)
  assert time.process_time() - start < 1.0
