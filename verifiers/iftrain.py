"""IFTrain: the 29 IF-RLVR training constraints of AllenAI's IFBench, as instruction checks.

IFBench (Pyatkin et al., "Generalizing Verifiable Instruction Following",
2025) trains on constraints disjoint from its 58 test ones: 29 new ids in
open-instruct's IFEvalG (`open_instruct/IFEvalG/instructions.py`), drawn with
IFEval's 25 into AllenAI's IF-RLVR training set
(`allenai/IF_multi_constraints_upto5`, up to five per prompt). They ask to
copy (a phrase repeated with one word changed, the request once or N times,
a character span of it), to count (lowercase words, letters, keyword
occurrences, sentences per paragraph and words per sentence, unique words),
to place words (the first or last word of the answer or of every sentence,
a keyword at a position, the same word at both ends) and to shape the text
(hyphen-joined sentences, bracketed words, wrapped bigrams, two paragraphs,
no dots, no exclamation marks, a palindrome). `verifiers.ifbench` takes
these ids beside its own and IFEval's; records use IFEval's metadata.

Each check is `fn(response, kwargs) -> bool` with the decisions of the
reference, written anew for hostile text (single passes and `str` searches;
no pattern can backtrack over the response). They read the answer as
`verifiers.reader.visible` reads it, stripped, as open-instruct's verifier
passes it (`remove_thinking_section` strips). Checks that compare words or
letters (keywords, copies, first and last words, uniqueness, palindromes,
consecutive initials) compare both sides through `reader.fold`, so
look-alike letters of any script are the letters they look like; keywords
are literal text (the reference reads them as regular expressions); counts
of letters, lower-case words and lengths read the visible text. Sentences
are split by the reference's own rules (`split_sentences`: not Punkt;
abbreviations, initials, decimals, web suffixes, ellipses and closing
quotes, newlines never end one).

Where the reference's code contradicts its own instruction so that a policy
could exploit it, or so that no response following the instruction passes,
this module follows the instruction (docs/ifbench_agreement.md measures
each difference):

* a word is what a reader takes for one: punctuation around it is not part
  of it and a token of punctuation is no word (first-word checks, unique
  words, words per sentence, a keyword's position, the same word at both
  ends; the reference keeps nltk's punctuation tokens and attached commas);
* 'count:count_unique' compares words case-insensitively ('The' repeats
  'the'); 'keywords:keyword_specific_position' too;
* 'keywords:word_count_different_numbers' asks for exactly N occurrences, as
  its instruction says ("should appear N times"); the reference applies a
  `relation` the prompt never states, so 'less than' passes a response
  without the word;
* 'keywords:exclude_word_harder' refuses the word anywhere as a whole word,
  in any case; the reference only looks for it between two spaces;
* 'keywords:palindrome' needs a palindrome of three characters or more; the
  reference takes 'a' or 'I', so nearly any English answer passes;
* 'keywords:start_end' needs a word, not punctuation, at both ends; the
  reference passes '* text *';
* 'new:copy_span_idx' copies the span including index n_end, as the
  instruction says ("between (and including)"); the reference drops it;
* 'count:counting_composition' also takes the divider its instruction names,
  '* * *' (the reference splits on '***' only);
* 'count:lowercase_counting' and 'letters:letter_counting' count letters of
  any script ('é', Cyrillic); the reference counts ASCII only, which a
  policy meets by writing accented or look-alike letters;
* 'punctuation:punctuation_dot' and '..._exclamation' read the full stops
  and exclamation marks of other scripts ('。', 'ǃ', '¡') as '.' and '!'.

Integer kwargs may be integral floats (Arrow exports); anything else
malformed is refused with the instruction id and the field at load time,
never guessed (the reference draws a random value for a missing or zero
one).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from verifiers import ifeval
from verifiers import reader

# -- sentences, as the reference splits them ---------------------------------

# Markers for "a period that ends nothing" and "a sentence ends here": private-use code points,
# taken out of the text first so that a response cannot forge them.
_KEEP, _END = '\ue000', '\ue001'
_AFTER_ACRONYM = (r'(Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|'
                  r'But\s|However\s|That\s|This\s|Wherever)')
# (pattern, replacement), applied in order: each is one of the reference's decisions about a
# period. All are fixed-width or a single repeated class, so each pass is linear. Replacements
# are literal strings or functions: Python 3.11 expands a template ('\\1') in Python at each
# match, twice the cost of a function, on a megabyte of initials.
_PERIOD_RULES = (
    # Titles and web suffixes by lookaround, so the replacement is literal; the periods they
    # mark are the same.
    (re.compile(r'\.(?:(?<=Mr\.|St\.|Ms\.|Dr\.)|(?<=Mrs\.))'), _KEEP),       # titles
    (re.compile(r'\.(?=com|net|org|io|gov|edu|me)'), _KEEP),              # web suffixes
    (re.compile(r'([0-9])\.([0-9])'), lambda m: m[1] + _KEEP + m[2]),    # decimals
    (re.compile(r'\.{2,}'), lambda m: _KEEP * len(m[0]) + _END),         # an ellipsis ends one
    (re.compile(r'Ph\.D\.'), 'Ph' + _KEEP + 'D' + _KEEP),
    (re.compile(r'\s([A-Za-z])\. '), lambda m: ' ' + m[1] + _KEEP + ' '),  # an initial
    # An acronym ends a sentence before a word that usually starts one.
    (re.compile(r'([A-Z]\.[A-Z]\.(?:[A-Z]\.)?) ' + _AFTER_ACRONYM),
     lambda m: m[1] + _END + ' ' + m[2]),
    (re.compile(r'([A-Za-z])\.([A-Za-z])\.([A-Za-z])\.'), lambda m: m[0].replace('.', _KEEP)),
    (re.compile(r'([A-Za-z])\.([A-Za-z])\.'), lambda m: m[0].replace('.', _KEEP)),
    # A company suffix ends a sentence before such a word, and its period is dropped.
    (re.compile(r' (Inc|Ltd|Jr|Sr|Co)\. ' + _AFTER_ACRONYM),
     lambda m: ' ' + m[1] + _END + ' ' + m[2]),
    (re.compile(r' (Inc|Ltd|Jr|Sr|Co)\.'), lambda m: ' ' + m[1] + _KEEP),
    (re.compile(r' ([A-Za-z])\.'), lambda m: ' ' + m[1] + _KEEP),
)


def split_sentences(value: str) -> list[str]:
  """Sentences by open-instruct's rule-based splitter (IFEvalG's `split_into_sentences`).

  Newlines are spaces; '.', '?' and '!' end a sentence except the periods of
  titles ('Dr.'), web suffixes ('.com'), decimals, 'Ph.D.', initials and
  acronyms; an ellipsis ends one; a period, '!' or '?' before a closing
  double quote moves after it. Empty sentences are kept except a last one.
  The rules read letters as `reader.fold(value, keep_case=True)` does (a 'Dr.'
  written with a Cyrillic 'r' is the title a reader sees).

  Args:
    value: any text.

  Returns:
    The sentences, stripped, folded as the rules read them.
  """
  t = reader.fold(value, keep_case=True).replace(_KEEP, ' ').replace(_END, ' ')
  t = ' ' + t.replace('\n', ' ') + '  '
  for pattern, replacement in _PERIOD_RULES:
    t = pattern.sub(replacement, t)
  for mark, moved in (('.\u201d', '\u201d.'), ('."', '".'), ('!"', '"!'), ('?"', '"?')):
    t = t.replace(mark, moved)
  for mark in '.?!':
    t = t.replace(mark, mark + _END)
  sentences = [s.strip() for s in t.replace(_KEEP, '.').split(_END)]
  if sentences and not sentences[-1]:
    sentences.pop()
  return sentences


# -- words --------------------------------------------------------------------

_NOT_WORD = re.compile(r'[^\w\s]')
_WORD_RUN = re.compile(r'\w+')


def _bare(word: str) -> str:
  """The word without punctuation anywhere in it, folded (the reference's last words, which it
  lower-cases; `reader.fold` lower-cases and reads look-alike letters as one)."""
  return reader.fold(_NOT_WORD.sub('', word))


def _trim(word: str) -> str:
  """The word without non-alphanumeric characters at its ends."""
  i, j = 0, len(word)
  while i < j and not word[i].isalnum():
    i += 1
  while j > i and not word[j - 1].isalnum():
    j -= 1
  return word[i:j]


def _core(word: str) -> str:
  """The word without non-alphanumeric characters at its ends, folded ('"Cat,"' -> 'cat')."""
  return reader.fold(_trim(word))


def _words(value: str) -> list[str]:
  """A reader's words, folded: split at whitespace, punctuation at the ends dropped, none empty.
  The text is folded once (folding keeps what is alphanumeric), most words need no trimming."""
  return [w for w in (x if x.isalnum() else _trim(x) for x in reader.fold(value).split()) if w]


def _occurrences(value: str, keyword: str) -> int:
  """Case-insensitive, non-overlapping occurrences of a literal keyword (letters folded)."""
  return reader.fold(value).count(reader.fold(keyword.strip()))


# -- the 29 checks --------------------------------------------------------------

def _phrase_spans(v: str, head: str, tail: str) -> list[str]:
  """The reference's `re.findall(head + '.*?' + tail)` for literal head and tail, in one pass.

  Leftmost, non-overlapping, lazy, within a line. A start whose line holds
  no tail after it cannot match, nor can any later start on that line, so
  the scan moves to the next line; the first tail at or after a position is
  remembered, so no stretch of text is searched twice.
  """
  out, pos, tail_at = [], 0, -1
  while True:
    start = v.find(head, pos)
    if start < 0:
      return out
    body = start + len(head)
    if tail_at < body:
      tail_at = v.find(tail, body)
      if tail_at < 0:
        return out
    newline = v.find('\n', body, tail_at)
    if newline >= 0:
      pos = newline + 1
      continue
    pos = tail_at + len(tail)
    out.append(v[start:pos])


def _repeat_phrase(v, kw):
  v = reader.fold(v, keep_case=True)
  phrase = reader.fold(kw['phrase'], keep_case=True).split()
  spans = _phrase_spans(v, phrase[0] + ' ', ' ' + phrase[-1])
  if len(spans) != kw['small_n']:
    return False
  for span in spans:
    words = span.split()
    if len(words) != len(phrase) or sum(a != b for a, b in zip(words, phrase)) != 1:
      return False
  return True


def _copy(v, kw):
  return reader.fold(v) == reader.fold(kw['prompt_to_repeat'].strip())


def _copy_span(v, kw):
  span = reader.visible(kw['prompt_to_repeat'][kw['n_start']:kw['n_end'] + 1])
  return reader.fold(v) == reader.fold(span.strip())


def _sentence_hyphens(v, kw):
  # Each '-'-separated piece is, unpadded, the sentence the splitter finds there (pieces past
  # the last sentence are not checked, as in the reference).
  v = reader.fold(v, keep_case=True)  # As the splitter reads it.
  gold = split_sentences(v.replace('-', ' '))
  return all(piece == piece.strip() and piece == g for piece, g in zip(v.split('-'), gold))


def _no_adjacent_consecutive(v, kw):
  # As the reference: the next word's first character may not be the code point after this
  # one's (lower-cased, here folded); a first character that lower-cases to two characters fails.
  words = v.split()
  for a, b in zip(words, words[1:]):
    if (len(a[0].lower()) != 1 or len(b[0].lower()) != 1
        or ord(reader.fold(b[0])) - ord(reader.fold(a[0])) == 1):
      return False
  return True


def _square_brackets(v, kw):
  return all(w.startswith('[') and w.endswith(']') for w in v.split())


def _word_once(v, kw):
  return _occurrences(v, kw['keyword']) == 1


def _word_count(v, kw):
  return _occurrences(v, kw['keyword']) == kw['frequency']


def _exclude_word(v, kw):
  pattern = r'(?<!\w)' + re.escape(_core(kw['keyword'])) + r'(?!\w)'
  return re.search(pattern, reader.fold(v)) is None


_NUMBER_PARAGRAPHS = ifeval.INSTRUCTIONS['length_constraints:number_paragraphs'][0]


def _paragraphs(v, kw):
  return _NUMBER_PARAGRAPHS(v, {'num_paragraphs': 2})


def _paragraphs2(v, kw):
  parts = v.split('\n\n')
  n = len(parts)
  for k, part in enumerate(parts):
    if not part.strip():
      if k not in (0, len(parts) - 1):
        return False
      n -= 1
  return n == 2


def _first_word_sent(v, kw):
  want = _bare(kw['first_word'])
  return all(s.strip() and _bare(s.split()[0]) == want for s in split_sentences(v))


def _first_word_answer(v, kw):
  words = v.split()
  return bool(words) and _bare(words[0]) == _bare(kw['first_word'])


def _last_word_sent(v, kw):
  want = _bare(kw['last_word'])
  return all(s.strip() and _bare(s.split()[-1]) == want for s in split_sentences(v))


def _last_word_answer(v, kw):
  words = v.split()
  return bool(words) and _bare(words[-1]) == _bare(kw['last_word'])


def _bigram_wrapping(v, kw):
  # Pairs from the first word on; an odd last word is unchecked, as in the reference.
  words = v.split()
  return all(words[i].startswith('<<') and words[i + 1].endswith('>>')
             for i in range(0, len(words) - 1, 2))


def _copying_multiple(v, kw):
  want = reader.fold(kw['prompt_to_repeat'].strip())
  parts = v.split('******')
  return len(parts) == kw['N'] and all(reader.fold(p.strip()) == want for p in parts)


# Full stops and exclamation marks of other scripts (NFKC, in `reader.visible`, already folds
# the full-width and small forms, '…' and '‼').
_AS_DOT = str.maketrans(dict.fromkeys(
    '\u0589\u06d4\u0701\u0702\u1362\u166e\u1803\u1809\u2e3c\u3002\ua4ff\ua60e\ua6f3', '.'))
_AS_BANG = str.maketrans(dict.fromkeys(
    '\u00a1\u01c3\u055c\u07f9\u1944\u2755\u2757\ua71d\ua71e\ua71f', '!'))


def _no_dot(v, kw):
  return '.' not in v.translate(_AS_DOT)


def _no_exclamation(v, kw):
  return '!' not in v.translate(_AS_BANG)


def _lowercase_counting(v, kw):
  # Runs of word characters that are all lower-case letters (the reference's \b[a-z]+\b, for
  # any script).
  n = sum(1 for w in _WORD_RUN.findall(v) if w.isalpha() and w.islower())
  return n <= kw['N']


def _compare(count: int, relation: str, threshold: int) -> bool:
  return count < threshold if relation == 'less than' else count >= threshold


def _letter_counting(v, kw):
  return _compare(sum(1 for c in v if c.isalpha()), kw['relation'], kw['N'])


_LETTER_FREQUENCY = ifeval.INSTRUCTIONS['keywords:letter_frequency'][0]


def _letter_counting2(v, kw):
  return _LETTER_FREQUENCY(v, kw)


_DIVIDER = re.compile(r'\s?(?:\*\*\*|\* \* \*)\s?')


def _counting_composition(v, kw):
  # Exactly three paragraphs, none empty (the reference fails an empty first or last one too:
  # it has no sentences).
  paragraphs = _DIVIDER.split(v)
  if len(paragraphs) != 3:
    return False
  for p in paragraphs:
    sentences = split_sentences(p)
    if len(sentences) != kw['n_sent'] or any(len(_words(s)) != kw['n_words'] for s in sentences):
      return False
  return True


def _count_unique(v, kw):
  words = _words(v)
  return len(words) == len(set(words))


def _count_increment(v, kw):
  return _occurrences(v, kw['keyword1']) == 1 and _occurrences(v, kw['keyword2']) == 2


def _palindrome(v, kw):
  return any(len(w) >= 3 and w == w[::-1] for w in _words(v))


def _keyword_position(v, kw):
  sentences = split_sentences(v)
  if len(sentences) < kw['n']:
    return False
  words = _words(sentences[kw['n'] - 1])
  return len(words) >= kw['m'] and words[kw['m'] - 1] == _core(kw['keyword'])


def _start_end(v, kw):
  words = v.split()
  return (len(words) >= 2 and v[0].isalnum() and v[-1].isalnum()
          and _core(words[0]) == _core(words[-1]))


_INT, _POS, _STR, _RAW, _REL, _OPTIONAL_REL = (
    ifeval.INT, ifeval.POS, ifeval.STR, ifeval.RAW, ifeval.REL, ifeval.OPTIONAL_REL)

# id -> (check, {kwarg: kind}). _RAW strings are passed as written (character indices); an
# _OPTIONAL_REL kwarg is checked when present and not used (see the module docstring).
INSTRUCTIONS = {
    'copy:repeat_phrase': (_repeat_phrase, {'phrase': _STR, 'small_n': _POS}),
    'copy:copy': (_copy, {'prompt_to_repeat': _STR}),
    'new:copy_span_idx': (_copy_span, {'prompt_to_repeat': _RAW, 'n_start': _INT, 'n_end': _INT}),
    'detectable_format:sentence_hyphens': (_sentence_hyphens, {}),
    'keywords:no_adjacent_consecutive': (_no_adjacent_consecutive, {}),
    'detectable_format:square_brackets': (_square_brackets, {}),
    'keywords:word_once': (_word_once, {'keyword': _STR}),
    'keywords:word_count_different_numbers': (_word_count, {'keyword': _STR, 'frequency': _INT,
                                                            'relation': _OPTIONAL_REL}),
    'keywords:exclude_word_harder': (_exclude_word, {'keyword': _STR}),
    'paragraphs:paragraphs': (_paragraphs, {}),
    'paragraphs:paragraphs2': (_paragraphs2, {}),
    'first_word:first_word_sent': (_first_word_sent, {'first_word': _STR}),
    'first_word:first_word_answer': (_first_word_answer, {'first_word': _STR}),
    'last_word:last_word_sent': (_last_word_sent, {'last_word': _STR}),
    'last_word:last_word_answer': (_last_word_answer, {'last_word': _STR}),
    'detectable_format:bigram_wrapping': (_bigram_wrapping, {}),
    'copy:copying_simple': (_copy, {'prompt_to_repeat': _STR}),
    'copy:copying_multiple': (_copying_multiple, {'prompt_to_repeat': _STR, 'N': _POS}),
    'punctuation:punctuation_dot': (_no_dot, {}),
    'punctuation:punctuation_exclamation': (_no_exclamation, {}),
    'count:lowercase_counting': (_lowercase_counting, {'N': _POS}),
    'letters:letter_counting': (_letter_counting, {'N': _POS, 'relation': _REL}),
    'letters:letter_counting2': (_letter_counting2, {'letter': _STR, 'let_frequency': _INT,
                                                     'let_relation': _REL}),
    'count:counting_composition': (_counting_composition, {'n_sent': _POS, 'n_words': _POS}),
    'count:count_unique': (_count_unique, {}),
    'count:count_increment_word': (_count_increment, {'keyword1': _STR, 'keyword2': _STR}),
    'keywords:palindrome': (_palindrome, {}),
    'keywords:keyword_specific_position': (_keyword_position, {'keyword': _STR, 'n': _POS,
                                                               'm': _POS}),
    'keywords:start_end': (_start_end, {}),
}


# kwargs that name one word (a word at a position: one word, or no response can pass), and
# kwargs that must hold a word character at all.
_ONE_WORD = {'first_word:first_word_sent': 'first_word', 'first_word:first_word_answer':
             'first_word', 'last_word:last_word_sent': 'last_word', 'last_word:last_word_answer':
             'last_word', 'keywords:keyword_specific_position': 'keyword'}
_WORDS_NEEDED = dict(_ONE_WORD, **{'keywords:exclude_word_harder': 'keyword'})


def _check_consistency(instruction_id: str, out: dict) -> None:
  name = _WORDS_NEEDED.get(instruction_id)
  if name and not _bare(out[name]):
    raise ValueError(f'{instruction_id}: kwarg {name!r} {out[name]!r} holds no word')
  name = _ONE_WORD.get(instruction_id)
  if name and len(out[name].split()) != 1:
    raise ValueError(f'{instruction_id}: kwarg {name!r} {out[name]!r} is not one word')
  if instruction_id == 'copy:repeat_phrase' and len(out['phrase'].split()) < 3:
    raise ValueError(f'{instruction_id}: kwarg phrase {out["phrase"]!r} has fewer than three '
                     'words (no centre word to replace)')
  if instruction_id == 'letters:letter_counting2' and len(
      reader.visible(out['letter']).strip()) != 1:  # One character as a reader sees it.
    raise ValueError(f'{instruction_id}: kwarg letter must be one character, got '
                     f'{out["letter"]!r}')
  if instruction_id == 'new:copy_span_idx':
    size = len(out['prompt_to_repeat'])
    if not out['n_start'] <= out['n_end'] < size:
      raise ValueError(f'{instruction_id}: need n_start <= n_end < len(prompt_to_repeat) '
                       f'({size}), got n_start {out["n_start"]} and n_end {out["n_end"]}')
    if not out['prompt_to_repeat'][out['n_start']:out['n_end'] + 1].strip():
      raise ValueError(f'{instruction_id}: the span [{out["n_start"]}, {out["n_end"]}] of '
                       'prompt_to_repeat is blank')


def clean_kwargs(instruction_id: str, kwargs: Mapping[str, Any] | None) -> dict:
  """Validates one IFTrain instruction's kwargs.

  Args:
    instruction_id: one of INSTRUCTIONS, e.g. 'copy:repeat_phrase'.
    kwargs: its keyword arguments (None means none; None values are dropped,
      as in Arrow exports that carry every name on every instruction).

  Returns:
    The kwargs the check uses, integers as int.

  Raises:
    ValueError: naming the id and the field: unknown id, a missing,
      mistyped or unexpected kwarg, or values no response can meet (a span
      outside the prompt, a phrase without a centre word).
  """
  out = ifeval.check_kwargs(instruction_id, kwargs, INSTRUCTIONS)
  _check_consistency(instruction_id, out)
  return out


def follows(instruction_ids: Sequence[str], kwargs_list: Sequence[Mapping[str, Any] | None],
            response: str, loose: bool = False) -> list[bool]:
  """Checks a response against each IFTrain instruction.

  Args:
    instruction_ids: ids of INSTRUCTIONS.
    kwargs_list: their kwargs (same length).
    response: the answer text, read as `reader.visible` reads it and stripped.
    loose: IFEval's loose mode (the response, or it without its first and/or
      last line and/or asterisks, may follow).

  Returns:
    One bool per instruction.

  Raises:
    ValueError: a bad id or kwargs (the verifier refuses those records before).
  """
  seen = reader.visible(response)
  candidates = [r.strip() for r in (ifeval.loose_variants(seen) if loose else [seen])]
  out = []
  for instruction_id, kwargs in zip(instruction_ids, kwargs_list):
    check, spec = INSTRUCTIONS[instruction_id]
    kw = {k: reader.visible(v) if spec[k] == _STR else v
          for k, v in clean_kwargs(instruction_id, kwargs).items()}
    out.append(any(r and check(r, kw) for r in candidates))
  return out
