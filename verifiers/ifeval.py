"""The 25 IFEval instruction checks, with the semantics of Google's reference.

Each instruction id (e.g. 'length_constraints:number_words') maps to a check
`fn(response, kwargs) -> bool` and the keyword arguments it takes. The checks
follow google-research `instruction_following_eval` (instructions.py and
evaluation_lib.py), including its quirks: keywords are regular expressions,
undetectable language counts as followed, `nth_paragraph_first_word` indexes
the raw paragraph list. Where the reference would pick a random value for a
missing argument, this module refuses the record instead. Sentences and words
are counted by `verifiers.text` (the reference needs nltk data).

`follows(ids, kwargs, response, prompt, loose)` checks a response against
its instruction list, in strict mode (the response as is, non-empty) or loose
mode (also with its first and/or last line removed and/or asterisks removed).
`check_kwargs` checks an instruction's kwargs against its table's kinds; it
serves `verifiers.iftrain` and `verifiers.ifbench` too.

Before any check, the response and the instructions' strings are read as a
reader sees them (`verifiers.reader.visible`: invisible characters deleted,
compatibility forms folded, blank letters as spaces, every line separator a
'\\n', look-alike commas as ','), so that characters a reader cannot see
neither inflate nor deflate a count nor pass a keyword or comma check; the
reference counts code points, which a policy learns to exploit. Checks that
compare words or letters (keywords, forbidden words, letter frequency, the
first word of a paragraph, the repeated prompt, the end phrase, the fixed
answers, section splitters, two different responses) compare both sides
through `reader.fold`, so look-alike letters of any script ('rеd' with a
Cyrillic 'е', Armenian 'օ', Cherokee 'Ꭺ') are the letters they look like;
language detection reads the visible text (a Russian answer stays Russian).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Callable, Mapping, Sequence

from verifiers import reader
from verifiers import text

RELATIONS = ('less than', 'at least')
CONSTRAINED_RESPONSES = ('My answer is yes.', 'My answer is no.', 'My answer is maybe.')


def _compare(count: int, relation: str, threshold: int) -> bool:
  return count < threshold if relation == 'less than' else count >= threshold


def _pattern(keyword: str, keep_case: bool = False) -> str:
  """The reference treats keywords as regexes; an invalid one is taken literally. The pattern
  searches `reader.fold`ed text (folded with `keep_case`), so its letters are folded too."""
  try:
    re.compile(keyword)
  except re.error:
    return re.escape(reader.fold(keyword, keep_case))
  return reader.fold_pattern(keyword, keep_case)


# langdetect reads at most its Detector's max_text_length characters of a text, after
# deleting URLs (a match spans at most 2,084 characters) and e-mail addresses (575) and
# composing Vietnamese letters with their marks (two characters into one).
_LANGDETECT_READS = 10_000
_CLEANING_REACH = 2_084 + 575 + 2


def _language_prefix(value: str) -> str:
  """A prefix of value on which langdetect decides exactly as on all of it.

  langdetect cleans the whole text before it reads its first 10,000
  characters, and its e-mail pattern retries up to 64 characters at every
  position: most of a second on a megabyte. The cleaning is local (no match
  reaches further than _CLEANING_REACH), so once a prefix's cleaned text is
  _CLEANING_REACH longer than what langdetect reads, those characters are the
  whole text's. Prefixes grow fourfold, so a text that cleans away to nothing
  costs a constant times one pass.
  """
  from langdetect import detector  # pylint: disable=g-import-not-at-top
  from langdetect.utils import ngram  # pylint: disable=g-import-not-at-top
  size = 4 * (_LANGDETECT_READS + _CLEANING_REACH)
  while size < len(value):
    prefix = value[:size]
    cleaned = ngram.NGram.normalize_vi(detector.Detector.MAIL_RE.sub(
        ' ', detector.Detector.URL_RE.sub(' ', prefix)))
    if len(cleaned) >= _LANGDETECT_READS + _CLEANING_REACH:
      return prefix
    size *= 4
  return value


@functools.lru_cache(maxsize=256)
def _language(value: str) -> str | None:
  """langdetect's answer (seeded, so cacheable), None when it cannot tell."""
  import langdetect  # pylint: disable=g-import-not-at-top
  langdetect.DetectorFactory.seed = 0  # langdetect is random otherwise.
  try:
    return langdetect.detect(_language_prefix(value))
  except langdetect.LangDetectException:
    return None  # The reference counts this as followed.


def _existence(v, kw):
  v = reader.fold(v)
  return all(re.search(_pattern(k), v, flags=re.IGNORECASE) for k in kw['keywords'])


def _frequency(v, kw):
  n = len(re.findall(_pattern(kw['keyword'].strip()), reader.fold(v), flags=re.IGNORECASE))
  return _compare(n, kw['relation'], kw['frequency'])


def _forbidden(v, kw):
  v = reader.fold(v)
  return not any(re.search(r'\b' + _pattern(w) + r'\b', v, flags=re.IGNORECASE)
                 for w in kw['forbidden_words'])


def _letter_frequency(v, kw):
  return _compare(reader.fold(v).count(reader.fold(kw['letter'].strip())),
                  kw['let_relation'], kw['let_frequency'])


def _response_language(v, kw):
  lang = _language(v)
  return lang is None or lang == kw['language']


def _number_sentences(v, kw):
  return _compare(text.count_sentences(v), kw['relation'], kw['num_sentences'])


def _number_paragraphs(v, kw):
  paragraphs = re.split(r'\s?\*\*\*\s?', v)
  n = len(paragraphs)
  for k, p in enumerate(paragraphs):
    if not p.strip():
      if k in (0, len(paragraphs) - 1):
        n -= 1
      else:
        return False
  return n == kw['num_paragraphs']


def _number_words(v, kw):
  return _compare(text.count_words(v), kw['relation'], kw['num_words'])


def _nth_paragraph_first_word(v, kw):
  paragraphs = re.split(r'\n\n', v)
  n = sum(1 for p in paragraphs if p.strip())
  nth = kw['nth_paragraph']
  if nth > n:
    return False
  paragraph = paragraphs[nth - 1].strip()
  if not paragraph:
    return False
  word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
  first = re.match(r'[^.,?!\'"]*', word).group()  # Up to the first of those marks.
  return n == kw['num_paragraphs'] and reader.fold(first) == reader.fold(kw['first_word'])


def _count_placeholders(v: str) -> int:
  """How many matches `re.findall(r'\[.*?\]', v)` (the reference's count) has, in linear time.

  The regex tries every '[' and scans to the end of its line when no ']'
  follows, which is quadratic on a line of brackets; its matches are the
  first ']' after each leftmost '[' on a line, which `str.find` walks to.
  """
  # The first ']' after a position is remembered and the newline search stops at it: searching
  # to the end for either, at every '[', was quadratic.
  n, pos, close = 0, v.find('['), -1
  while pos >= 0:
    if close <= pos:
      close = v.find(']', pos + 1)
      if close < 0:
        return n
    newline = v.find('\n', pos + 1, close)
    if newline >= 0:  # No ']' on this line: no '[' on it matches.
      pos = v.find('[', newline + 1)
      continue
    n += 1
    pos = v.find('[', close + 1)
  return n


def _placeholders(v, kw):
  return _count_placeholders(v) >= kw['num_placeholders']


def _postscript(v, kw):
  marker = kw['postscript_marker'].strip()
  # The reference's patterns are these wrapped in r'\s*' ... r'.*$' (MULTILINE): both ends match
  # anything, including nothing, so a search for the core finds the same texts, without the
  # quadratic retries of a leading \s* over a run of newlines.
  if marker == 'P.P.S':
    pattern = r'p\.\s?p\.\s?s'
  elif marker == 'P.S.':
    pattern = r'p\.\s?s\.'
  else:
    pattern = _pattern(marker)  # Folded: lower case, as the reference lower-cases it.
  return re.search(pattern, reader.fold(v)) is not None


# The reference's r'^\s*\*[^\*].*$' and r'^\s*-.*$' let the leading \s* run over newlines, so
# every line start of a run of blank lines scans the whole run (quadratic). A match that starts
# on a blank line ends on the bullet's own line, which the same pattern without newlines in
# the leading run also matches, once: the counts are equal.
_STAR_BULLET = re.compile(r'^[^\S\n]*\*[^\*].*$', re.MULTILINE)
_DASH_BULLET = re.compile(r'^[^\S\n]*-.*$', re.MULTILINE)


def _bullets(v, kw):
  n = len(_STAR_BULLET.findall(v)) + len(_DASH_BULLET.findall(v))
  return n == kw['num_bullets']


def _constrained(v, kw):
  v = reader.fold(v.strip(), keep_case=True)
  return any(reader.fold(option, keep_case=True) in v for option in CONSTRAINED_RESPONSES)


def _highlights(v, kw):
  n = sum(1 for h in re.findall(r'\*[^\n\*]*\*', v) if h.strip('*').strip())
  n += sum(1 for h in re.findall(r'\*\*[^\n\*]*\*\*', v) if h[2:-2].strip())
  return n >= kw['num_highlights']


def _sections(v, kw):
  splitter = _pattern(kw['section_spliter'].strip(), keep_case=True)
  sections = re.split(r'\s?' + splitter + r'\s?\d+\s?', reader.fold(v, keep_case=True))
  return len(sections) - 1 >= kw['num_sections']


def _json(v, kw):
  v = v.strip()
  fence = reader.fold(v[:7], keep_case=True)  # The fence's 'json' as a reader sees it.
  for prefix in ('```json', '```Json', '```JSON', '```'):
    if fence.startswith(prefix):
      v = v[len(prefix):]
      break
  if v.endswith('```'):
    v = v[:-3]
  try:
    json.loads(v.strip())
  except (ValueError, RecursionError):  # Nesting too deep for the decoder is not JSON here.
    return False
  return True


def _title(v, kw):
  # The reference's re.findall(r'<<[^\n]+>>', v) matches, per line, from the first '<<' to the
  # last '>>' at least one character after it (greedy), and nothing else on that line; the
  # regex finds that by retrying every '<<' (quadratic on a line of them), str.find directly,
  # from each line's first '<<' (lines without one cost nothing).
  start = v.find('<<')
  while start >= 0:
    line_end = v.find('\n', start)
    line_end = len(v) if line_end < 0 else line_end
    end = v.rfind('>>', start, line_end)
    if end >= start + 3 and v[start:end + 2].lstrip('<').rstrip('>').strip():
      return True
    start = v.find('<<', line_end)
  return False


def _two_responses(v, kw):
  parts = v.split('******')
  valid = []
  for k, part in enumerate(parts):
    if not part.strip():
      if k not in (0, len(parts) - 1):
        return False
    else:
      valid.append(part)
  return len(valid) == 2 and (reader.fold(valid[0].strip(), keep_case=True)
                              != reader.fold(valid[1].strip(), keep_case=True))


def _repeat_prompt(v, kw):
  return reader.fold(v.strip()).startswith(reader.fold(kw['prompt_to_repeat'].strip()))


def _end_checker(v, kw):
  return reader.fold(v.strip().strip('"')).endswith(reader.fold(kw['end_phrase'].strip()))


def _capital_words(v, kw):
  n = sum(1 for w in text.word_tokenize(v) if w.isupper())
  return _compare(n, kw['capital_relation'], kw['capital_frequency'])


def _english_capital(v, kw):
  if not v.isupper():
    return False
  lang = _language(v)
  return lang is None or lang == 'en'


def _english_lowercase(v, kw):
  if not v.islower():
    return False
  lang = _language(v)
  return lang is None or lang == 'en'


def _no_comma(v, kw):
  return ',' not in v


def _quotation(v, kw):
  v = v.strip()
  return len(v) > 1 and v[0] == '"' and v[-1] == '"'


# Kinds of kwarg (`check_kwargs`). IFEval's ids take INT, STR, STRS and REL; IFTrain's and
# IFBench's also POS, RAW (a string passed as written: character indices) and OPTIONAL_REL (a
# relation that may be missing).
INT, POS, STR, RAW, STRS, REL, OPTIONAL_REL = (
    'int', 'positive int', 'str', 'raw str', 'list of str', 'relation', 'optional relation')

# id -> (check, {kwarg: kind}).
INSTRUCTIONS: dict[str, tuple[Callable[[str, dict], bool], dict[str, str]]] = {
    'keywords:existence': (_existence, {'keywords': STRS}),
    'keywords:frequency': (_frequency, {'keyword': STR, 'frequency': INT, 'relation': REL}),
    'keywords:forbidden_words': (_forbidden, {'forbidden_words': STRS}),
    'keywords:letter_frequency': (_letter_frequency, {'letter': STR, 'let_frequency': INT,
                                                      'let_relation': REL}),
    'language:response_language': (_response_language, {'language': STR}),
    'length_constraints:number_sentences': (_number_sentences, {'num_sentences': INT,
                                                                'relation': REL}),
    'length_constraints:number_paragraphs': (_number_paragraphs, {'num_paragraphs': INT}),
    'length_constraints:number_words': (_number_words, {'num_words': INT, 'relation': REL}),
    'length_constraints:nth_paragraph_first_word': (
        _nth_paragraph_first_word, {'num_paragraphs': INT, 'nth_paragraph': INT,
                                    'first_word': STR}),
    'detectable_content:number_placeholders': (_placeholders, {'num_placeholders': INT}),
    'detectable_content:postscript': (_postscript, {'postscript_marker': STR}),
    'detectable_format:number_bullet_lists': (_bullets, {'num_bullets': INT}),
    'detectable_format:constrained_response': (_constrained, {}),
    'detectable_format:number_highlighted_sections': (_highlights, {'num_highlights': INT}),
    'detectable_format:multiple_sections': (_sections, {'section_spliter': STR,
                                                        'num_sections': INT}),
    'detectable_format:json_format': (_json, {}),
    'detectable_format:title': (_title, {}),
    'combination:two_responses': (_two_responses, {}),
    'combination:repeat_prompt': (_repeat_prompt, {'prompt_to_repeat': STR}),
    'startend:end_checker': (_end_checker, {'end_phrase': STR}),
    'change_case:capital_word_frequency': (_capital_words, {'capital_frequency': INT,
                                                            'capital_relation': REL}),
    'change_case:english_capital': (_english_capital, {}),
    'change_case:english_lowercase': (_english_lowercase, {}),
    'punctuation:no_comma': (_no_comma, {}),
    'startend:quotation': (_quotation, {}),
}


def _check_value(where: str, value: Any, kind: str, integral_floats: bool) -> Any:
  """Checks one kwarg's value against its kind (IFEval's, IFTrain's and IFBench's).

  Args:
    where: the message's subject, e.g. "count:numbers: kwarg 'N'".
    value: the value, not None.
    kind: one of INT, POS, STR, RAW, STRS, REL and OPTIONAL_REL.
    integral_floats: as in `check_kwargs`.

  Returns:
    The value, an integral float as int.

  Raises:
    ValueError: `where`, what the kind takes and the value.
  """
  if kind in (INT, POS):
    if integral_floats and isinstance(value, float) and value.is_integer():
      value = int(value)
    least = 1 if kind == POS else 0
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
      raise ValueError(f'{where} must be {"a positive" if least else "a non-negative"} int, '
                       f'got {value!r}')
  elif kind in (REL, OPTIONAL_REL):
    if value not in RELATIONS:
      raise ValueError(f'{where} must be one of {RELATIONS}, got {value!r}')
  elif kind == STRS:
    if not isinstance(value, list) or not value or not all(
        isinstance(s, str) and reader.visible(s).strip() for s in value):
      raise ValueError(f'{where} must be a non-empty list of non-empty strings, got {value!r}')
  elif not isinstance(value, str) or not reader.visible(value).strip():
    # Blank as a reader sees it (only invisible characters) is empty: it would match anywhere.
    raise ValueError(f'{where} must be a non-empty string, got {value!r}')
  return value


def check_kwargs(instruction_id: str, kwargs: Mapping[str, Any] | None,
                 instructions: Mapping[str, tuple[Callable[[str, dict], bool], Mapping[str, str]]],
                 unknown_hint: str = '', integral_floats: bool = True) -> dict:
  """The kwargs checks every instruction table shares (IFEval's, IFTrain's, IFBench's).

  Datasets exported through Arrow (e.g. Hugging Face's IFEval) carry every
  kwarg name on every instruction, with None for the unused ones; those are
  dropped. Checks of one instruction's values together (a range's ends in
  order) are the caller's.

  Args:
    instruction_id: e.g. 'keywords:frequency'.
    kwargs: its keyword arguments (None means none).
    instructions: the table, id -> (check, {kwarg: kind}).
    unknown_hint: appended to the unknown-id message (which ids the caller takes).
    integral_floats: read an integral float as its int (Arrow exports write
      5.0); IFEval's own ids take ints only.

  Returns:
    The kwargs the check uses (integers as int where integral_floats); an
    OPTIONAL_REL one that is missing is left out.

  Raises:
    ValueError: unknown id, kwargs not a dict, an unexpected, missing or
      mistyped kwarg.
  """
  if instruction_id not in instructions:
    raise ValueError(f'unknown instruction id {instruction_id!r}{unknown_hint}')
  kwargs = {} if kwargs is None else kwargs
  if not isinstance(kwargs, Mapping):
    raise ValueError(f'{instruction_id}: kwargs must be a dict, got {type(kwargs).__name__}')
  spec = instructions[instruction_id][1]
  extra = sorted(k for k, v in kwargs.items() if v is not None and k not in spec)
  if extra:
    raise ValueError(f'{instruction_id}: unexpected kwargs {extra} (takes {sorted(spec)})')
  out = {}
  for name, kind in spec.items():
    if kwargs.get(name) is None:
      if kind == OPTIONAL_REL:
        continue
      raise ValueError(f'{instruction_id}: kwarg {name!r} is missing')
    out[name] = _check_value(f'{instruction_id}: kwarg {name!r}', kwargs[name], kind,
                             integral_floats)
  return out


def clean_kwargs(instruction_id: str, kwargs: Mapping[str, Any] | None) -> dict:
  """Validates one instruction's kwargs and keeps the ones it takes.

  Args:
    instruction_id: e.g. 'keywords:frequency'.
    kwargs: its keyword arguments (None means none; None values are dropped).

  Returns:
    The kwargs the check uses.

  Raises:
    ValueError: unknown id, a missing or mistyped kwarg, or an unexpected one.
  """
  out = check_kwargs(instruction_id, kwargs, INSTRUCTIONS, integral_floats=False)
  letter = reader.visible(out.get('letter', '')).strip()  # One character as a reader sees it.
  if instruction_id == 'keywords:letter_frequency' and len(letter) != 1:
    raise ValueError(f'{instruction_id}: letter must be one character, got {out["letter"]!r}')
  if instruction_id == 'length_constraints:nth_paragraph_first_word' and not (
      1 <= out['nth_paragraph'] <= out['num_paragraphs']):
    raise ValueError(f'{instruction_id}: need 1 <= nth_paragraph <= num_paragraphs, got '
                     f'{out["nth_paragraph"]} and {out["num_paragraphs"]}')
  return out


def loose_variants(response: str) -> list[str]:
  """The reference's loose-mode variants: first/last line removed, asterisks removed."""
  lines = response.split('\n')
  first = '\n'.join(lines[1:]).strip()
  last = '\n'.join(lines[:-1]).strip()
  both = '\n'.join(lines[1:-1]).strip()
  variants = [response, response.replace('*', ''), first, last, both]
  return variants + [first.replace('*', ''), last.replace('*', ''), both.replace('*', '')]


def follows(instruction_ids: Sequence[str], kwargs_list: Sequence[Mapping[str, Any] | None],
            response: str, loose: bool = False) -> list[bool]:
  """Checks a response against each instruction.

  Args:
    instruction_ids: IFEval ids.
    kwargs_list: their kwargs (same length).
    response: the answer text (checked as `reader.visible` reads it, as are the kwargs'
      strings).
    loose: IFEval's loose mode.

  Returns:
    One bool per instruction.
  """
  response = reader.visible(response)
  candidates = loose_variants(response) if loose else [response]
  out = []
  for instruction_id, kwargs in zip(instruction_ids, kwargs_list):
    check, _ = INSTRUCTIONS[instruction_id]
    kw = {k: reader.visible(v) if isinstance(v, str) else [reader.visible(x) for x in v]
          if isinstance(v, list) else v for k, v in clean_kwargs(instruction_id, kwargs).items()}
    out.append(any(r.strip() and check(r, kw) for r in candidates))
  return out
