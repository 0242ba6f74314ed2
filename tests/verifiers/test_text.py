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


def test_sentence_ends_are_the_plain_regexs():
  # The possessive, run-start-only pattern finds exactly what r'([.?!]+)(["\'”’)\]]*)(?=\s|\Z)'
  # found, without retrying every position of a run.
  plain = re.compile(r'([.?!]+)(["\'”’)\]]*)(?=\s|\Z)')
  rng = random.Random(0)
  for _ in range(20_000):
    v = ''.join(rng.choice('.?!"\')] a\n') for _ in range(rng.randrange(12)))
    assert [m.groups() + (m.span(),) for m in text._END.finditer(v)] == [
        m.groups() + (m.span(),) for m in plain.finditer(v)], v


@pytest.mark.parametrize('source', ['.' * 1_000_000 + 'x', '!' * 1_000_000 + '"x',
                                    '(' * 1_000_000, '"' * 1_000_000, '...' * 333_333])
def test_hostile_megabyte_texts_tokenize_fast(source):
  # Quadratic before: the sentence regex retried each dot of a run, and tokenisation peeled a
  # run of brackets or ellipses off one character (copy) at a time.
  start = time.process_time()
  text.count_sentences(source)
  text.word_tokenize(source)
  assert time.process_time() - start < 1.0
