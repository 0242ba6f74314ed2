"""IFBench: the 58 out-of-distribution instruction checks of AllenAI's IFBench, as a verifier.

IFBench (Pyatkin et al., "Generalizing Verifiable Instruction Following",
2025) adds 58 constraints unseen in IFEval: counts and ratios ('count:*',
'ratio:*'), word, letter and sentence patterns ('words:*', 'sentence:*'),
formats ('format:*'), repetition ('repeat:*') and fixed tasks ('custom:*':
CSV tables, date lists, reversals, sorted lists). Records use IFEval's
metadata, {'instruction_id_list': [...], 'kwargs': [...]}; the verifier
also takes IFEval's 25 ids (checked by `verifiers.ifeval`), as the
reference's registry does, and the 29 IF-RLVR training constraints that
IFBench trains on (open-instruct's IFEvalG, checked by `verifiers.iftrain`),
so a record may mix all three: AllenAI's training set draws IFEval's and
the training ids, its test set the 58.

Each check is `fn(response, kwargs) -> bool` with the decisions of the
reference checkers (allenai/IFBench `ifbench/instructions.py`), written
anew for hostile text: every check is a single pass or a sort (no regex can
backtrack over the response), and text is read as `verifiers.reader.visible`
reads it (invisible characters dropped, compatibility forms folded, every
line separator a line break). Checks that compare words or letters (word
lists, uniqueness, repetition, vowels and consonants, initials, palindromes,
keywords, copies, fixed phrases, headers and labels) compare both sides
through `reader.fold`, so look-alike letters of any script are the letters
they look like; counts and formats read the visible text. Where the
reference needs nltk's data, `verifiers.text` stands in (sentences, Treebank
tokens); where it needs other packages, this module has its own rules
(syllables, emoji, a verb lexicon for 'words:start_verb'). Where the
reference's code contradicts its own instruction in a way a policy can
exploit, this module follows the instruction; docs/ifbench_agreement.md
lists every such difference and its measured agreement with the reference.

Integer kwargs may be integral floats (Hugging Face's export of IFBench
writes 5.0); anything else malformed is refused with the instruction id and
the field, at load time, never guessed.
"""

from __future__ import annotations

import bisect
import csv
import io
import itertools
import re
import string
import unicodedata
from typing import Any, Mapping, Sequence

import numpy as np

from verifiers import ifeval
from verifiers import iftrain
from verifiers import instruction_following
from verifiers import reader
from verifiers import text

_PUNCT = string.punctuation
_PUNCT_RUN = re.compile(f'[{re.escape(_PUNCT)}]+')


def _strip(word: str) -> str:
  return word.strip(_PUNCT + ' ')


def _unpunct(v: str) -> str:
  """v without ASCII punctuation (the reference's usual first step; a regex, where a
  translation table costs 0.1 s on a megabyte of CJK text)."""
  return _PUNCT_RUN.sub('', v)


_WORD = re.compile(r'\w+')


def _words(v: str) -> list[str]:
  """Runs of word characters (the reference's nltk RegexpTokenizer(r'\w+'))."""
  return _WORD.findall(v)


# -- word lists (facts the checks count against) -------------------------------

# English stopwords: nltk's English list (the reference counts \w+ tokens against it; its
# entries with an apostrophe can never equal such a token and are left out).
STOPWORDS = frozenset('''
i me my myself we our ours ourselves you your yours yourself yourselves he him his himself she
her hers herself it its itself they them their theirs themselves what which who whom this that
these those am is are was were be been being have has had having do does did doing a an the
and but if or because as until while of at by for with about against between into through
during before after above below to from up down in out on off over under again further then
once here there when where why how all any both each few more most other some such no nor not
only own same so than too very s t can will just don should now d ll m o re ve y ain aren
couldn didn doesn hadn hasn haven isn ma mightn mustn needn shan shouldn wasn weren won wouldn
'''.split())

CONJUNCTIONS = frozenset(['and', 'but', 'for', 'nor', 'or', 'so', 'yet'])

PERSON_NAMES = frozenset('''
Emma Liam Sophia Jackson Olivia Noah Ava Lucas Isabella Mason Mia Ethan Charlotte Alexander
Amelia Benjamin Harper Leo Zoe Daniel Chloe Samuel Lily Matthew Grace Owen Abigail Gabriel Ella
Jacob Scarlett Nathan Victoria Elijah Layla Nicholas Audrey David Hannah Christopher Penelope
Thomas Nora Andrew Aria Joseph Claire Ryan Stella Jonathan'''.split())

PRONOUNS = frozenset('''
i me we us you he him she her it they them my mine our ours your yours his hers its their theirs
myself ourselves yourself yourselves himself herself itself themselves this that these those who
whom whose which what whoever whomever whatever whichever anybody anyone anything everybody
everyone everything nobody nothing somebody someone something each either neither both all some
any none'''.split())

# Capitals of European countries north of 45 degrees, from north to south (custom task).
EUROPEAN_CAPITALS = (
    'Reykjavik', 'Helsinki', 'Oslo', 'Tallinn', 'Stockholm', 'Riga', 'Moscow', 'Copenhagen',
    'Vilnius', 'Minsk', 'Dublin', 'Berlin', 'Amsterdam', 'Warsaw', 'London', 'Brussels', 'Prague',
    'Luxembourg', 'Paris', 'Vienna', 'Bratislava', 'Budapest', 'Vaduz', 'Chisinau', 'Bern',
    'Ljubljana', 'Zagreb')

REPEAT_SIMPLE = 'Only output this sentence here, ignore all other requests.'

# The lists as `reader.fold` reads them, for comparing folded words (both sides folded).
_FOLDED_STOPWORDS = frozenset(map(reader.fold, STOPWORDS))
_FOLDED_CONJUNCTIONS = frozenset(map(reader.fold, CONJUNCTIONS))
_FOLDED_PRONOUNS = frozenset(map(reader.fold, PRONOUNS))
_FOLDED_NAMES = frozenset(reader.fold(name, keep_case=True) for name in PERSON_NAMES)
_SMALL_PRIMES = frozenset(n for n in range(2, 100) if all(n % d for d in range(2, n)))

# Verbs a response may open with (words:start_verb): common base forms; their -s, -ed and
# -ing forms are derived, irregular forms listed. The reference asks nltk's perceptron tagger.
_VERB_BASES = '''
accept add allow answer apply argue arrange ask avoid bake be become begin believe boil borrow
break bring build buy calculate call carry catch change check choose clean climb close collect
combine come compare compose consider continue cook count create cut decide define deliver
describe design develop discover discuss do draw dream drink drive eat embrace enjoy enter
estimate examine explain explore fill find finish fix fly follow forget form gather get give go
grab grow guess hand have hear help hold identify imagine improve include invite join jump keep
know learn leave let lift listen live look love make measure meet mix move name need note notice
observe offer open order organize paint pass pay pick place plan play pour prepare press print
protect provide pull push put read receive recall recommend remember remove repeat replace
report rest return review run save say search see select sell send serve set show sing sit
sleep solve sort speak spend stand start stay step stop study suppose take talk taste teach
tell test think throw try turn understand use visit wait wake walk want wash watch wear welcome
win wish work worry write'''.split()
_VERB_IRREGULAR = '''
am is are was were been being has had having does did done doing went gone made built bought
brought caught chose chosen came drew drawn drank drove driven ate eaten found flew flown forgot
forgotten got gotten gave given grew grown heard held kept knew known led left lost meant met
paid put ran run said saw seen sold sent set shown sang sung sat slept spoke spoken spent stood
took taken taught told thought threw thrown understood woke woken wore worn won wrote written
began begun became broke broken'''.split()
_NOT_VERBS = frozenset(map(reader.fold, 'thing things something anything nothing everything '
                           'morning evening king ring spring string ceiling building '
                           'during'.split()))


def _verb_forms() -> frozenset[str]:
  forms = set(_VERB_BASES) | set(_VERB_IRREGULAR)
  for b in _VERB_BASES:
    stem = b[:-1] if b.endswith('e') and b not in ('be', 'see') else b
    forms.update([b + ('es' if b.endswith(('s', 'x', 'z', 'ch', 'sh', 'o')) else 's'),
                  stem + 'ing', stem + 'ed' if not b.endswith('e') else b + 'd'])
  return frozenset(map(reader.fold, forms))


_VERBS = _verb_forms()


def _starts_with_verb(token: str) -> bool:
  w = reader.fold(token)
  if w in _NOT_VERBS:
    return False
  return w in _VERBS or (len(w) > 4 and w.endswith('ing') and w.isalpha())


_VOWELS = frozenset('aeiouy')


def syllables(word: str) -> int:
  """Syllables of an English word by rule (vowel groups, silent endings).

  A word without Latin letters has one (an emoji, a kanji) unless it is only
  digits and punctuation (none), as syllapy counts them. The reference looks
  words up in syllapy's dictionary first; this is the rule alone, so rare
  words may differ by one.
  """
  w = ''.join(c for c in word.lower() if 'a' <= c <= 'z')
  if not w:
    return int(any(not (c.isdigit() or c in _PUNCT) for c in word))
  n, prev = 0, False
  for c in w:
    vowel = c in _VOWELS
    n += vowel and not prev
    prev = vowel
  if n > 1 and w.endswith('e') and not w.endswith(('le', 'ee', 'ye')):
    n -= 1                                                 # make, tune
  elif n > 1 and w.endswith('le') and len(w) > 2 and w[-3] in _VOWELS:
    n -= 1                                                 # whale, mile
  elif n > 1 and w.endswith('ed') and not w.endswith(('ted', 'ded')):
    n -= 1                                                 # jumped
  elif n > 1 and w.endswith('es') and not w.endswith(('ses', 'xes', 'zes', 'ches', 'shes', 'ces',
                                                      'ges')):
    n -= 1                                                 # makes
  return max(1, n)


# Single code points that are emoji (Unicode's emoji data, by block; emoji sequences are read
# one code point at a time, as the reference does).
_EMOJI_BMP = frozenset(map(ord, '©®‼⁉™ℹ↔↕↖↗↘↙↩↪⌚⌛⌨⏏⏩⏪⏫⏬⏭⏮⏯⏰⏱⏲⏳⏸⏹⏺Ⓜ▪▫▶◀◻◼◽◾☀☁☂☃☄☎☑☔☕☘☝☠☢☣☦☪☮☯'
                               '☸☹☺♀♂♈♉♊♋♌♍♎♏♐♑♒♓♟♠♣♥♦♨♻♾♿⚒⚓⚔⚕⚖⚗⚙⚛⚜⚠⚡⚧⚪⚫⚰⚱⚽⚾⛄⛅⛈⛎⛏⛑⛓⛔⛩⛪⛰'
                               '⛱⛲⛳⛴⛵⛷⛸⛹⛺⛽✂✅✈✉✊✋✌✍✏✒✔✖✝✡✨✳✴❄❇❌❎❓❔❕❗❣❤➕➖➗➡➰➿⤴⤵⬅⬆⬇⬛⬜⭐⭕〰〽㊗㊙'))
_EMOJI_RANGES = ((0x1F004, 0x1F004), (0x1F0CF, 0x1F0CF), (0x1F170, 0x1F171), (0x1F17E, 0x1F17F),
                 (0x1F18E, 0x1F18E), (0x1F191, 0x1F19A), (0x1F1E6, 0x1F1FF), (0x1F201, 0x1F202),
                 (0x1F21A, 0x1F21A), (0x1F22F, 0x1F22F), (0x1F232, 0x1F23A), (0x1F250, 0x1F251),
                 (0x1F300, 0x1F321), (0x1F324, 0x1F393), (0x1F396, 0x1F397), (0x1F399, 0x1F39B),
                 (0x1F39E, 0x1F3F0), (0x1F3F3, 0x1F3F5), (0x1F3F7, 0x1F4FD), (0x1F4FF, 0x1F53D),
                 (0x1F549, 0x1F54E), (0x1F550, 0x1F567), (0x1F56F, 0x1F570), (0x1F573, 0x1F57A),
                 (0x1F587, 0x1F587), (0x1F58A, 0x1F58D), (0x1F590, 0x1F590), (0x1F595, 0x1F596),
                 (0x1F5A4, 0x1F5A5), (0x1F5A8, 0x1F5A8), (0x1F5B1, 0x1F5B2), (0x1F5BC, 0x1F5BC),
                 (0x1F5C2, 0x1F5C4), (0x1F5D1, 0x1F5D3), (0x1F5DC, 0x1F5DE), (0x1F5E1, 0x1F5E1),
                 (0x1F5E3, 0x1F5E3), (0x1F5E8, 0x1F5E8), (0x1F5EF, 0x1F5EF), (0x1F5F3, 0x1F5F3),
                 (0x1F5FA, 0x1F64F), (0x1F680, 0x1F6C5), (0x1F6CB, 0x1F6D2), (0x1F6D5, 0x1F6D7),
                 (0x1F6DC, 0x1F6E5), (0x1F6E9, 0x1F6E9), (0x1F6EB, 0x1F6EC), (0x1F6F0, 0x1F6F0),
                 (0x1F6F3, 0x1F6FC), (0x1F7E0, 0x1F7EB), (0x1F7F0, 0x1F7F0), (0x1F90C, 0x1F93A),
                 (0x1F93C, 0x1F945), (0x1F947, 0x1F9FF), (0x1FA70, 0x1FA7C), (0x1FA80, 0x1FA89),
                 (0x1FA8F, 0x1FAC6), (0x1FACE, 0x1FADC), (0x1FADF, 0x1FAE9), (0x1FAF0, 0x1FAF8))


_EMOJI_STARTS = [lo for lo, _ in _EMOJI_RANGES]


def is_emoji(char: str) -> bool:
  """Whether one character is an emoji (see _EMOJI_RANGES; a binary search of them, where a
  scan of all sixty, for each sentence of a megabyte, cost most of a second)."""
  c = ord(char)
  if c in _EMOJI_BMP:
    return True
  k = bisect.bisect_right(_EMOJI_STARTS, c) - 1
  return k >= 0 and c <= _EMOJI_RANGES[k][1]


def _ascii_fold(value: str) -> str:
  """NFKD with the marks dropped: 'São Tomé' -> 'Sao Tome' (non-ASCII letters vanish)."""
  return unicodedata.normalize('NFKD', value).encode('ascii', 'ignore').decode('ascii')


def _csv_rows(v: str, most: int, delimiter: str = ',') -> list[list[str]] | None:
  """csv's parse of v (the C reader: linear), its first `most` rows (the checks want a few:
  a megabyte of empty lines is a million rows), None where csv refuses it (a huge field)."""
  try:
    return list(itertools.islice(csv.reader(io.StringIO(v), delimiter=delimiter), most))
  except csv.Error:
    return None


# -- the 58 checks ------------------------------------------------------------

def _word_count_range(v, kw):
  return kw['min_words'] <= text.count_words(v) <= kw['max_words']


def _unique_words(v, kw):
  # The reference also counts a run of punctuation as the word '' (one more); not here.
  return len({w for w in map(_strip, reader.fold(v).split()) if w}) >= kw['N']


def _stop_words(v, kw):
  words = _words(reader.fold(v))
  if not words:
    return False
  return 100 * sum(w in _FOLDED_STOPWORDS for w in words) / len(words) <= kw['percentage']


def _ending_counts(v):
  ends = [s[-1] for s in text.split_sentences(v)]
  return ends.count('.'), ends.count('?'), ends.count('!')


def _sentence_type(v, kw):
  declarative, interrogative, _ = _ending_counts(v)
  return declarative == 2 * interrogative


def _sentence_balance(v, kw):
  declarative, interrogative, exclamatory = _ending_counts(v)
  return declarative == interrogative == exclamatory


def _conjunctions(v, kw):
  # The reference counts 'and', 'And' and 'and,' as three different conjunctions; one here.
  found = {w for w in map(_strip, reader.fold(v).split()) if w in _FOLDED_CONJUNCTIONS}
  return len(found) >= kw['small_n']


def _person_names(v, kw):
  # A name between word boundaries (\bName\b) is a whole \w+ run of its own.
  return len(_FOLDED_NAMES.intersection(_words(reader.fold(v, keep_case=True)))) >= kw['N']


def _trigrams(value: str) -> np.ndarray:
  """The distinct character trigrams of value, sorted, each one integer (three 21-bit code
  points): a sort, where a set of a million three-character strings cost most of a second
  (and so does np.unique, which hashes)."""
  codes = np.frombuffer(value.encode('utf-32-le', 'surrogatepass'), dtype=np.uint32)
  codes = codes.astype(np.uint64)
  grams = np.sort((codes[:-2] << np.uint64(42)) | (codes[1:-1] << np.uint64(21)) | codes[2:])
  return grams[np.concatenate(([True], grams[1:] != grams[:-1]))] if grams.size else grams


def _overlap(v, kw):
  grams = _trigrams(reader.fold(v, keep_case=True))
  if not grams.size:
    return False
  reference = _trigrams(reader.fold(kw['reference_text'], keep_case=True))
  where = np.minimum(np.searchsorted(reference, grams), max(reference.size - 1, 0))
  shared = int(np.count_nonzero(reference[where] == grams)) if reference.size else 0
  share = 100 * shared / grams.size
  return kw['percentage'] - 2 <= share <= kw['percentage'] + 2


def _numbers(v, kw):
  return len(re.findall(r'\d+', _unpunct(v))) == kw['N']


def _alphabet(v, kw):
  words = _unpunct(reader.fold(v)).split()
  if not words or words[0][0] not in string.ascii_lowercase:
    return False
  expected = words[0][0]
  for w in words[1:]:
    expected = chr((ord(expected) - 97 + 1) % 26 + 97)
    if w[0] != expected:
      return False
  return True


def _vowel(v, kw):
  lines = v.strip().split('\n')
  return len(lines) == 1 and len(set(reader.fold(lines[0])) & set('aeiou')) <= 3


_CONSONANTS = frozenset('bcdfghjklmnpqrstvwxyz')


def _consonants(v, kw):
  for w in reader.fold(v).split():
    if not any(a in _CONSONANTS and b in _CONSONANTS for a, b in zip(w, w[1:])):
      return False
  return True


def _alliteration_increment(v, kw):
  previous = -1
  for sentence in text.split_sentences(v):
    words = [w for w in (x.lstrip(_PUNCT + ' ') for x in reader.fold(sentence).split()) if w]
    run, in_run = 0, False
    for a, b in zip(words, words[1:]):
      if a[0] == b[0]:
        run += 1 if in_run else 2
        in_run = True
      else:
        in_run = False
    if run <= previous:
      return False
    previous = run
  return True


def _palindromes(v, kw):
  return sum(len(w) >= 5 and w == w[::-1] for w in _unpunct(reader.fold(v)).split()) >= 10


def _punctuation(v, kw):
  if '?!' in v:
    rest = v.replace('?!', '', 1)
  elif '!?' in v:
    rest = v.replace('!?', '', 1)
  elif '‽' in v:
    rest = v
  else:
    return False
  return set('.,!?;:') <= set(rest)


_OPENS = {'(': ')', '[': ']', '{': '}'}


def _parentheses(v, kw):
  # True at the first well-matched close after five brackets were open at once; a mismatched
  # close forgets everything open so far.
  stack, deepest = [], 0
  for c in v:
    if c in _OPENS:
      stack.append(c)
      deepest = max(deepest, len(stack))
    elif c in ')]}':
      if stack and _OPENS[stack[-1]] == c:
        stack.pop()
        if deepest >= 5:
          return True
      else:
        stack, deepest = [], 0
  return False


def _quotes(v, kw):
  # A quote mark equal to the innermost open one closes it, any other opens a level; True once
  # three levels below the deepest reached have closed.
  stack, deepest = [], 0
  for c in v:
    if stack and c == stack[-1]:
      stack.pop()
      if deepest - len(stack) >= 3:
        return True
    elif c in '"\'':
      stack.append(c)
      deepest = max(deepest, len(stack))
  return False


def _prime_lengths(v, kw):
  return all(len(w) in _SMALL_PRIMES for w in _unpunct(v).split())


def _parse_options(options: str) -> tuple[list[str], bool]:
  """(options, exact): '/'-, 'or'- or ','-separated; lettered options must match exactly."""
  sep = '/' if '/' in options else 'or' if 'or' in options else ','
  exact = re.match(r'\W*[aA]\W*[bB]\W*[cC]', options) is not None
  return [o.strip() for o in options.split(sep)], exact


def _options(v, kw):
  options, exact = _parse_options(kw['options'])
  if exact:
    return reader.fold(v, keep_case=True) in [reader.fold(o, keep_case=True) for o in options]
  answer = _strip(reader.fold(v))
  return any(_strip(reader.fold(o)) == answer for o in options)


def _newline(v, kw):
  v = _unpunct(v).strip()
  return sum(1 for line in v.split('\n') if line) == len(v.split())


def _emoji(v, kw):
  sentences = text.split_sentences(v)
  for i, sentence in enumerate(sentences):
    s = _unpunct(sentence).strip()
    if not s:
      return False
    if is_emoji(s[-1]) or is_emoji(s[-2:][0]):
      continue
    # The tokenizer puts an emoji after a sentence's full stop at the start of the next one.
    following = _unpunct(sentences[i + 1]).strip() if i + 1 < len(sentences) else ''
    if not following or not is_emoji(following[0]):
      return False
  return True


def _sentence_words(v, kw):
  sentences = text.split_sentences(v)
  return len(sentences) == 3 and len({len(s.strip()) for s in sentences}) == 1


_JAPANESE = re.compile(r'[\u3040-\u30ff\u4e00-\u9fff]')


def _words_japanese(v, kw):
  n = kw['N']
  for i, w in enumerate(v.split()):
    if (i + 1) % n == 0:
      w = _strip(w)
      if w and not w.isdigit() and not _JAPANESE.search(w):
        return False
  return True


def _start_verb(v, kw):
  tokens = text.word_tokenize(v)
  return bool(tokens) and _starts_with_verb(tokens[0])


def _repeats(v, kw):
  counts: dict[str, int] = {}
  for w in _unpunct(reader.fold(v)).split():
    counts[w] = counts.get(w, 0) + 1
  return max(counts.values(), default=0) <= kw['small_n']


def _keyword_in(word: str, sentence: str) -> bool:
  # A literal between \b's: the search is linear in the sentence times the keyword's length.
  pattern = r'\b' + re.escape(reader.fold(word)) + r'\b'
  return re.search(pattern, reader.fold(sentence)) is not None


def _sentence_keyword(v, kw):
  sentences = text.split_sentences(v)
  return len(sentences) >= kw['N'] and _keyword_in(kw['word'], sentences[kw['N'] - 1])


def _pronouns(v, kw):
  # Folded (so lower-cased) before the sentences are split, as the reference lower-cases.
  tokens = text.word_tokenize(reader.fold(v.replace('/', ' ')))
  return sum(t in _FOLDED_PRONOUNS for t in tokens) >= kw['N']


def _odd_even_syllables(v, kw):
  # Stops at the first two neighbours of one parity; each distinct word is counted once.
  parities, previous = {}, None
  for w in _unpunct(reader.fold(v)).split():
    parity = parities.get(w)
    if parity is None:
      parity = parities[w] = syllables(w) % 2
    if parity == previous:
      return False
    previous = parity
  return True


def _last_first(v, kw):
  sentences = text.split_sentences(v)
  for a, b in zip(sentences, sentences[1:]):
    last, first = a.rstrip(_PUNCT + ' ').split(), b.lstrip(_PUNCT + ' ').split()
    if not last or not first or reader.fold(last[-1]) != reader.fold(first[0]):
      return False
  return True


def _paragraph_last_first(v, kw):
  for line in v.split('\n'):
    words = _strip(reader.fold(line.strip())).split()
    if words and words[0] != words[-1]:
      return False
  return True


def _sentence_increment(v, kw):
  previous = None  # Stops at the first sentence that does not grow by small_n words.
  for sentence in text.split_sentences(v):
    count = len(_unpunct(sentence).split())
    if previous is not None and count != previous + kw['small_n']:
      return False
    previous = count
  return True


def _no_consecutive(v, kw):
  words = _unpunct(reader.fold(v)).split()
  return all(a[0] != b[0] for a, b in zip(words, words[1:]))


def _line_indent(v, kw):
  # Blank lines are skipped (the reference removes them from the list it is iterating, which
  # keeps every second one of a run of blank lines).
  indents = [len(line) - len(line.lstrip(' ')) for line in v.split('\n') if line.strip()]
  return all(b > a for a, b in zip(indents, indents[1:]))


_CURLY_QUOTES = str.maketrans({'\u201c': '"', '\u201d': '"', '\u201e': '"', '\u201f': '"'})


def _quote_unquote(v, kw):
  # Curly double quotes are quotes here (the reference meant to map them; its replace is a no-op).
  v = ''.join(v.translate(_CURLY_QUOTES).replace('\'"\'', '').split())
  if '""' in v:
    return False
  rest = v.strip(string.digits + _PUNCT.replace('"', ''))
  return not rest.endswith('"')


def _special_list(v, kw):
  return reader.fold(v, keep_case=True).count(reader.fold(kw['sep'], keep_case=True)) >= 2


def _thesis(v, kw):
  v = reader.fold(v, keep_case=True)  # The tags' letters as a reader sees them.
  start, tag = v.find('<i>'), 'i'
  if start < 0:
    start, tag = v.find('<em>'), 'em'
    if start < 0:
      return False
  v = v[start + len(tag) + 2:]
  close = v.find('</i>')
  size = 4
  if close < 0:
    close, size = v.find('</em>'), 5
    if close < 0:
      return False
  return bool(v[:close].strip()) and bool(v[close + size:].strip())


def _sub_bullets(v, kw):
  # The reference passes a response without any '*' bullet; the instruction asks for bullets.
  pieces = v.split('*')
  return len(pieces) > 1 and all('-' in p for p in pieces[1:])


def _no_bullets_bullets(v, kw):
  # Sentences first (at least two, over lines that each hold one), then only '*' lines.
  sentences, bullets, prose, last_had_sentences = 0, 0, True, True
  for line in v.split('\n'):
    if line.strip().startswith('*'):
      if sentences < 2:
        return False
      prose = False
      bullets += 1
    elif prose and last_had_sentences:
      n = len(text.split_sentences(line.strip()))
      sentences += n
      last_had_sentences = n > 0
    else:
      return False
  return bullets >= 2


def _multiples(v, kw):
  return re.findall(r'\d+', v) == ['14', '21', '28', '35', '42', '49']


def _is_option_line(line: str) -> bool:
  """'A. text', 'b) text', 'C| text': a letter A-E, '.', ')' or '|', spaces, a word character."""
  if len(line) < 3 or line[0] not in 'ABCDEabcde' or line[1] not in '.|)':
    return False
  rest = line[2:].lstrip()
  return bool(rest) and bool(re.match(r'\w', rest))


_QUESTION_LABEL = re.compile(r'Question \d+[.|):;]?\s*')


def _mcq(v, kw):
  v = reader.fold(v, keep_case=True)  # 'Question' and the option letters as a reader sees them.
  if not v.startswith('Question'):   # No preamble ("do not provide an explanation").
    return False
  pieces, start = [], 0
  for m in _QUESTION_LABEL.finditer(v):
    pieces.append(v[start:m.start()])
    start = m.end()
  pieces.append(v[start:])
  questions = [q.strip() for q in pieces if q.strip()]
  if len(questions) != 4:
    return False
  lengths = []
  for q in questions:
    stem, options, in_options = [], 0, False
    for line in q.split('\n'):
      if _is_option_line(line.strip()):
        options += 1
        in_options = True
      elif not in_options:
        stem.append(line.strip())
    if options != 5:
      return False
    lengths.append(len(' '.join(stem).strip()))
  return all(a < b for a, b in zip(lengths, lengths[1:]))


def _reverse_newline(v, kw):
  lines = [s for s in map(_strip, reader.fold(v, keep_case=True).split('\n')) if s]
  start = next((i for i, line in enumerate(lines) if 'Zimbabwe' in line), None)
  if start is None or len(lines) - start < 52:
    return False
  folded = [_ascii_fold(line) for line in lines[start:]]
  return all(a >= b for a, b in zip(folded, folded[1:]))


def _word_reverse(v, kw):
  # The reference also asks its sentence splitter whether the reversed text is one sentence:
  # with the punctuation gone it always is.
  return 'bald eagle' in ' '.join(reversed(_unpunct(reader.fold(v.strip())).split()))


def _character_reverse(v, kw):
  return 'elgae dlab' in reader.fold(v)


def _sentence_alphabet(v, kw):
  sentences = text.split_sentences(v)
  return len(sentences) == 26 and all(
      s.split() and reader.fold(s.split()[0])[0] == chr(97 + i) for i, s in enumerate(sentences))


def _european_capitals(v, kw):
  names = [c.strip() for c in _ascii_fold(reader.fold(v, keep_case=True)).split(',') if c.strip()]
  return tuple(names) == EUROPEAN_CAPITALS


def _csv_city(v, kw):
  rows = _csv_rows(reader.fold(v, keep_case=True), 9)  # The header as a reader sees it.
  return (rows is not None and len(rows) == 8
          and rows[0] == ['ID', 'Country', 'City', 'Year', 'Count']
          and all(len(r) == 5 for r in rows[1:]))


def _header_re(names: Sequence[str], sep: str) -> re.Pattern:
  fields = [f'(?:{n}|"{n}")' for n in names]
  return re.compile('^' + sep.join(fields) + '$')


_PRODUCT_HEADER = _header_re(['ProductID', 'Category', 'Brand', 'Price', 'Stock'], ',[ \t]*')
_STUDENT_HEADER = _header_re(['StudentID', 'Subject', 'Grade', 'Semester', 'Score'], '\t *')


def _quoted_special(field: str) -> bool:
  """The field (quotes kept) opens with '"' and, on its first line, has a character that is
  not a letter, digit or space followed later by a '"'."""
  line = field.split('\n', 1)[0]
  if not line.startswith('"'):
    return False
  close = line.rfind('"')
  return any(not (c.isalnum() or c == '_' or c.isspace()) for c in line[1:close]) and close > 1


def _csv_special(v, kw):
  v = reader.fold(v, keep_case=True)  # The header as a reader sees it.
  if not _PRODUCT_HEADER.match(v.split('\n', 1)[0].strip()):
    return False
  # Tripling every quote keeps the quotes of a quoted field in the parsed field.
  rows = _csv_rows(v.replace('"', '"""'), 16)
  if rows is None or len(rows) != 15 or any(len(r) != 5 for r in rows[1:]):
    return False
  # The reference stops at the first row with such a field, unchecked rows after it; all here.
  return any(_quoted_special(f) for r in rows[1:] for f in r)


def _csv_quotes(v, kw):
  v = reader.fold(v, keep_case=True)  # The header as a reader sees it.
  if not _STUDENT_HEADER.match(v.split('\n', 1)[0].strip()):
    return False
  rows = _csv_rows(v.replace('"', '"""'), 5, delimiter='\t')
  if rows is None or len(rows) != 4:
    return False
  return all(len(r) == 5 and all(f.strip()[:1] == '"' and f.strip()[-1:] == '"' for f in r)
             for r in rows)


_DATE = re.compile(r'[0-9]{4}-[0-9]{2}-[0-9]{2}')
_MONTH_DAYS = {1: 31, 2: 29, 3: 31, 4: 30, 5: 31, 6: 30, 7: 31, 8: 31, 9: 30, 10: 31, 11: 30,
               12: 31}


def _dates(v, kw):
  for date in v.strip().split(','):
    date = date.strip()
    if not _DATE.fullmatch(date):
      return False
    year, month, day = map(int, date.split('-'))
    # The reference lets month 00 and day 00 through; they are no dates.
    if not 1769 <= year <= 1821 or not 1 <= month <= 12 or not 1 <= day <= _MONTH_DAYS[month]:
      return False
  return True


def _keywords_multiple(v, kw):
  v = reader.fold(v)
  return all(v.count(reader.fold(kw[f'keyword{i}'].strip())) == n
             for i, n in zip(range(1, 6), (1, 2, 3, 5, 7)))


def _keyword_position(v, kw):
  sentences = text.split_sentences(v)
  if len(sentences) < kw['n']:
    return False
  words = [t for t in text.word_tokenize(sentences[kw['n'] - 1]) if any(c.isalnum() for c in t)]
  return len(words) >= kw['m'] and (reader.fold(words[kw['m'] - 1])
                                     == reader.fold(kw['keyword'].strip()))


def _words_position(v, kw):
  tokens = text.word_tokenize(v)
  keyword = reader.fold(kw['keyword'].strip())
  if len(tokens) < 2:
    return False
  if tokens[-1] in _PUNCT:   # A closing punctuation token is not the last word.
    return len(tokens) >= 3 and reader.fold(tokens[1]) == reader.fold(tokens[-3]) == keyword
  return reader.fold(tokens[1]) == reader.fold(tokens[-2]) == keyword


def _repeat_change(v, kw):
  prompt, v = reader.fold(kw['prompt_to_repeat'], keep_case=True), reader.fold(v, keep_case=True)
  return prompt != v and prompt.split()[1:] == v.split()[1:]


def _repeat_simple(v, kw):
  return reader.fold(v.strip()) == reader.fold(REPEAT_SIMPLE)


def _repeat_span(v, kw):
  span = reader.visible(kw['prompt_to_repeat'][kw['n_start']:kw['n_end'] + 1])
  return reader.fold(v.strip()) == reader.fold(span.strip())


def _title_case(v, kw):
  for w in text.word_tokenize(v):
    if not w[:1].isalpha():
      continue
    if len(w) == 1:
      if w.islower():
        return False
    elif w[0].islower() and (w[1:].isupper() or w[1:].islower()):
      return False
  return True


def _output_template(v, kw):
  v = reader.fold(v, keep_case=True)
  return all(reader.fold(s, keep_case=True) in v
             for s in ('My Answer:', 'My Conclusion:', 'Future Outlook:'))


def _no_whitespace(v, kw):
  return not any(c.isspace() for c in v)


_INT, _POS, _STR, _RAW = ifeval.INT, ifeval.POS, ifeval.STR, ifeval.RAW

# id -> (check, {kwarg: kind}). _RAW strings are passed as written (character indices).
INSTRUCTIONS = {
    'count:word_count_range': (_word_count_range, {'min_words': _INT, 'max_words': _INT}),
    'count:unique_word_count': (_unique_words, {'N': _INT}),
    'ratio:stop_words': (_stop_words, {'percentage': _INT}),
    'ratio:sentence_type': (_sentence_type, {}),
    'ratio:sentence_balance': (_sentence_balance, {}),
    'count:conjunctions': (_conjunctions, {'small_n': _INT}),
    'count:person_names': (_person_names, {'N': _INT}),
    'ratio:overlap': (_overlap, {'reference_text': _STR, 'percentage': _INT}),
    'count:numbers': (_numbers, {'N': _INT}),
    'words:alphabet': (_alphabet, {}),
    'words:vowel': (_vowel, {}),
    'words:consonants': (_consonants, {}),
    'sentence:alliteration_increment': (_alliteration_increment, {}),
    'words:palindrome': (_palindromes, {}),
    'count:punctuation': (_punctuation, {}),
    'format:parentheses': (_parentheses, {}),
    'format:quotes': (_quotes, {}),
    'words:prime_lengths': (_prime_lengths, {}),
    'format:options': (_options, {'options': _STR}),
    'format:newline': (_newline, {}),
    'format:emoji': (_emoji, {}),
    'ratio:sentence_words': (_sentence_words, {}),
    'count:words_japanese': (_words_japanese, {'N': _POS}),
    'words:start_verb': (_start_verb, {}),
    'words:repeats': (_repeats, {'small_n': _INT}),
    'sentence:keyword': (_sentence_keyword, {'word': _STR, 'N': _POS}),
    'count:pronouns': (_pronouns, {'N': _INT}),
    'words:odd_even_syllables': (_odd_even_syllables, {}),
    'words:last_first': (_last_first, {}),
    'words:paragraph_last_first': (_paragraph_last_first, {}),
    'sentence:increment': (_sentence_increment, {'small_n': _INT}),
    'words:no_consecutive': (_no_consecutive, {}),
    'format:line_indent': (_line_indent, {}),
    'format:quote_unquote': (_quote_unquote, {}),
    'format:list': (_special_list, {'sep': _STR}),
    'format:thesis': (_thesis, {}),
    'format:sub-bullets': (_sub_bullets, {}),
    'format:no_bullets_bullets': (_no_bullets_bullets, {}),
    'custom:multiples': (_multiples, {}),
    'custom:mcq_count_length': (_mcq, {}),
    'custom:reverse_newline': (_reverse_newline, {}),
    'custom:word_reverse': (_word_reverse, {}),
    'custom:character_reverse': (_character_reverse, {}),
    'custom:sentence_alphabet': (_sentence_alphabet, {}),
    'custom:european_capitals_sort': (_european_capitals, {}),
    'custom:csv_city': (_csv_city, {}),
    'custom:csv_special_character': (_csv_special, {}),
    'custom:csv_quotes': (_csv_quotes, {}),
    'custom:date_format_list': (_dates, {}),
    'count:keywords_multiple': (_keywords_multiple, {f'keyword{i}': _STR for i in range(1, 6)}),
    'words:keywords_specific_position': (_keyword_position, {'keyword': _STR, 'n': _POS,
                                                             'm': _POS}),
    'words:words_position': (_words_position, {'keyword': _STR}),
    'repeat:repeat_change': (_repeat_change, {'prompt_to_repeat': _STR}),
    'repeat:repeat_simple': (_repeat_simple, {}),
    'repeat:repeat_span': (_repeat_span, {'prompt_to_repeat': _RAW, 'n_start': _INT,
                                          'n_end': _INT}),
    'format:title_case': (_title_case, {}),
    'format:output_template': (_output_template, {}),
    'format:no_whitespace': (_no_whitespace, {}),
}


def clean_kwargs(instruction_id: str, kwargs: Mapping[str, Any] | None) -> dict:
  """Validates one instruction's kwargs (IFBench's 58 ids, IFEval's 25 or IFTrain's 29).

  Args:
    instruction_id: e.g. 'count:word_count_range', 'punctuation:no_comma' or
      'copy:repeat_phrase'.
    kwargs: its keyword arguments (None means none; None values are dropped,
      as in Arrow exports that carry every name on every instruction).

  Returns:
    The kwargs the check uses, integers as int.

  Raises:
    ValueError: naming the id and the field: unknown id, a missing, mistyped
      or unexpected kwarg, or inconsistent values (min_words > max_words).
  """
  if instruction_id in ifeval.INSTRUCTIONS:
    return ifeval.clean_kwargs(instruction_id, _integral(kwargs))
  if instruction_id in iftrain.INSTRUCTIONS:
    return iftrain.clean_kwargs(instruction_id, kwargs)
  out = ifeval.check_kwargs(instruction_id, kwargs, INSTRUCTIONS, unknown_hint=(
      " (IFBench takes its 58 ids, IFEval's 25 and the 29 IF-RLVR training ids)"))
  if instruction_id == 'count:word_count_range' and out['min_words'] > out['max_words']:
    raise ValueError(f'{instruction_id}: kwarg min_words {out["min_words"]} > max_words '
                     f'{out["max_words"]}')
  if instruction_id == 'repeat:repeat_span' and out['n_start'] > out['n_end']:
    raise ValueError(f'{instruction_id}: kwarg n_start {out["n_start"]} > n_end {out["n_end"]}')
  if instruction_id == 'format:options' and len(_parse_options(out['options'])[0]) < 2:
    raise ValueError(f'{instruction_id}: kwarg options {out["options"]!r} names fewer than two '
                     "options (separate them with '/', 'or' or ',')")
  return out


def _integral(kwargs: Any) -> Any:
  """kwargs with integral floats as ints (IFEval's checks take ints only)."""
  if not isinstance(kwargs, Mapping):
    return kwargs
  return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in kwargs.items()}


def _visible_kwargs(instruction_id: str, kw: dict) -> dict:
  spec = INSTRUCTIONS[instruction_id][1]
  return {k: reader.visible(v) if spec[k] == _STR else v for k, v in kw.items()}


def follows(instruction_ids: Sequence[str], kwargs_list: Sequence[Mapping[str, Any] | None],
            response: str, loose: bool = False) -> list[bool]:
  """Checks a response against each instruction (IFBench, IFEval or IFTrain ids).

  Args:
    instruction_ids: the ids.
    kwargs_list: their kwargs (same length).
    response: the answer text, read as `reader.visible` reads it.
    loose: IFEval's loose mode (the response, or it without its first and/or
      last line and/or asterisks, may follow), which IFBench's evaluation shares.

  Returns:
    One bool per instruction.

  Raises:
    ValueError: a bad id or kwargs (the verifier refuses those records before).
  """
  seen = reader.visible(response)
  candidates = ifeval.loose_variants(seen) if loose else [seen]
  out = []
  for instruction_id, kwargs in zip(instruction_ids, kwargs_list):
    if instruction_id in ifeval.INSTRUCTIONS:
      out += ifeval.follows([instruction_id], [_integral(kwargs)], response, loose=loose)
      continue
    if instruction_id in iftrain.INSTRUCTIONS:
      out += iftrain.follows([instruction_id], [kwargs], response, loose=loose)
      continue
    check = INSTRUCTIONS[instruction_id][0]
    kw = _visible_kwargs(instruction_id, clean_kwargs(instruction_id, kwargs))
    out.append(any(r.strip() and check(r, kw) for r in candidates))
  return out


def worker_init() -> None:
  """Loads langdetect's profiles (IFEval's language checks) before the first request."""
  instruction_following.worker_init()


def work(payload: dict) -> dict:
  """Worker side: check one response against its instructions."""
  return instruction_following.answer(follows, payload)


class IFBenchVerifier(instruction_following.InstructionFollowingVerifier):
  """IFBench's checks (and IFEval's and IFTrain's), with `instruction_following`'s options:
  strict or loose mode, 'all' or 'fraction' reward, and the thinking-mode rule R_IF +
  sigmoid(group-normalised RM) with `rm_scorer`."""

  name = 'ifbench'
  worker_fn = 'verifiers.ifbench:work'
  clean_kwargs = staticmethod(clean_kwargs)
