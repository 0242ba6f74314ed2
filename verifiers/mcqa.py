r"""Multiple-choice verifier: the option letter the answer commits to, against the gold letter.

The answer is read in the forms models write. Explicit statements first:
`\boxed{B}` (also `\boxed{\text{B}}`, `\boxed{(B)}`, `\boxed{B. text}`),
an answer phrase followed by the letter ("Answer: B", "**Answer:** B", "The
answer is (B).", "the correct answer is B: text", "The best option is C")
and "B is correct" / "Option B is the correct answer". The last of them that
names anything decides. Without one, the final non-empty line decides: a
line that is only a letter (`B`, `(B)`, `**B**`, `B.`, `Option B`), a line
that starts with one (`B) text`, `B. text`), or marks in it (`(B)`,
`**B**`, `Option B`); of a final line longer than `_MAX_STATEMENT_CHARS`,
the first characters are read for a leading letter and the last for marks.
With `options`, a statement (or final line) that is exactly one option's
text, after normalisation, names that option.

Fails closed: a statement naming several different letters ("either A or C",
"A, but it could also be C"), a negated one ("the answer is not B"), a
letter whose text is another option's, or no answer at all scores 0 with the
reason. A capital "A" or "I" followed by a word ("A car travels...", "I
think") is prose, not a letter, and so is a lower-case letter followed by a
word. Only the last `_MAX_SCAN_CHARS` characters are scanned and every
pattern is linear, so hostile text costs bounded time. Scored on the host
(string work only, no worker process).

Benchmarks score with their own official extraction, which reads fewer forms
and is what their published numbers mean; `extraction` picks it. It reads the
whole answer after the thinking block (its patterns are linear), and no letter
scores 0: the official scripts' quirks are kept, their random guess for an
unreadable answer is not.

* 'mmlu_pro': TIGER-Lab's MMLU-Pro `evaluate_from_api.py`: the first "answer
  is (X)" / "answer is X" (case as written), else the `[aA]nswer:\s*X` that
  its `.*[aA]nswer:\s*([A-J])` search finds (the last one on the first line
  that has one), else the last standalone letter A-J. Its three patterns are
  matched here in linear time with the same results (the originals backtrack
  quadratically on long lines).
* 'simple_evals': OpenAI simple-evals' multiple-choice pattern
  `(?i)Answer[ \t]*:[ \t]*\$?([A-D])\$?`, first match; the letter is taken
  as written, so a lower-case 'b' is not 'B', as there.

Metadata: {'answer': 'B', 'options': ['text of A', 'text of B', ...]} with
`options` optional (index 0 is 'A').
"""

from __future__ import annotations

import re
import string
import unicodedata
from typing import Any, Mapping

from verifiers import base
from verifiers import math as math_lib

# Characters at the end of the answer that are scanned (the final statement is
# at the end); earlier text is ignored.
_MAX_SCAN_CHARS = 20_000
# Characters of one statement (a boxed group, the rest of a line) that are read.
_MAX_STATEMENT_CHARS = 400
# Statements tried, from the last one back, before giving up.
_MAX_STATEMENTS = 32
_LETTERS = string.ascii_uppercase

# These run over the whole scanned text: whitespace is matched possessively
# (`\s*+`), so a long run of it after "answer" costs linear time, not quadratic.
_BOX = re.compile(r'\\(?:boxed|fbox)\s*+\{')
_VERB = r'(?:is|would\s++be|should\s++be|must\s++be|will\s++be)(?![\w\'’])'
# Phrases after which the statement's letter comes.
_PHRASE = re.compile(
    r'(?i:\b(?:final\s++|correct\s++|right\s++|best\s++)?answer\b\s*+'
    rf'(?:choice\b\s*+|option\b\s*+)?(?:\*\*|__)?\s*+(?:{_VERB}|[:：=])'
    rf'|\b(?:correct|right|best)\s++(?:option|choice)\b\s*+(?:\*\*|__)?\s*+(?:{_VERB}|[:：]))')
# A letter followed by "is (the) correct (answer)": "B is correct", "Option (C) is the right one".
_LETTER_FIRST = re.compile(
    r'(?<![\w\\])(?:(?i:option|choice)\s++)?[(\[]?([A-Z])[)\]]?(?:\*\*)?\s++is\s++(?:the\s++)?'
    r'(?i:correct|right)\b')
_LATEX_WRAP = re.compile(r'\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|bf)\s*\{')
_LATEX_DELIM = re.compile(r'\\[()\[\]]|\$')
_NEGATED = re.compile(r'[\s*_:："\'`]*(?i:not|never)\b')
_JUNK = r'[\s*_:："\'`{(\[]*'
# After a letter: no letter or digit of any script follows ('São Paulo' is no letter S).
_ALONE = r'(?![^\W_])'
# The letter a statement starts with (after formatting and filler words).
_LEAD = re.compile(
    rf'{_JUNK}(?:(?i:either|option|choice|letter|therefore|thus|clearly|indeed)\b{_JUNK})*'
    rf'([A-Za-z]){_ALONE}')
# Further letters of a list: "A or C", "A, C", "A and C", "A/C".
_MORE = re.compile(
    r'[\s*_)\]}"\'`.]*(?:,|/|&|\+|(?i:\bor\b|\band\b))'
    rf'{_JUNK}(?:(?i:option|choice|letter)\b{_JUNK})?([A-Za-z]){_ALONE}')
# Hedges later in the statement: "A, but it could also be C", "B or possibly D".
_HEDGE = re.compile(
    r'(?i:\b(?:or|also|maybe|perhaps|possibly)\b)\s+(?:(?i:be|option|choice)\s+)*'
    rf'[(\[]?([A-Z]){_ALONE}')
# What follows a letter that makes it a word or a variable, not an answer.
_WORD_AFTER = re.compile(r'[ \t]+([A-Za-z][A-Za-z\'’-]*)')
_VARIABLE_AFTER = re.compile(r'\s*[=<>^_]')
# Words that may follow an answer letter ("A because ...").
_CONNECTORS = frozenset(
    'because since as and or but so which given due hence therefore thus with from for'.split())
# Marks anywhere in a line: "(B)", "**B**", "[B]", "Option B".
_MARKS = re.compile(
    r'(?<![\w\\])\(([A-Z])\)|(?<![\w\\])\[([A-Z])\]|\*\*\s*[(\[]?([A-Z])[)\]]?\s*[.:]?\s*\*\*'
    rf'|(?i:\b(?:option|choice))\s+[(\[]?([A-Z]){_ALONE}')
# A final line that is only a letter: "B", "(B)", "**B**", "B.", "Option B".
_ONLY_LETTER = re.compile(r'[\W_]*(?:(?i:option|choice)\s*)?[(\[]?([A-Za-z])[)\]]?[\W_]*')
# A final line starting with a letter and a delimiter: "B) 42 m/s", "B. Paris", "(B) Paris".
_LINE_START = re.compile(
    r'[\s*_#>]*(?:(?i:option|choice)\s*)?[(\[]?([A-Za-z])(?:[)\]]\s*[.:：]?|\s*[.:：](?![A-Za-z]))'
    r'[\s*_]*(.*)')
_SEPARATOR = re.compile(r'[\s*_)\]}.:：\-–—]+')


def normalize_option(text: str) -> str:
  """An option's text for exact comparison: case, markup and surrounding punctuation dropped."""
  t = unicodedata.normalize('NFKC', _LATEX_DELIM.sub(' ', _LATEX_WRAP.sub('', text)))
  t = ' '.join(t.replace('*', ' ').replace('`', ' ').replace('}', ' ').lower().split())
  return t.strip(' .,;:!?"\'_')   # '_' only at the ends: '__Paris__' is markup, 'x_1' is not.


def _option_named(text: str, options: list[str] | None) -> int | None:
  """The index of the one option whose normalised text equals `text`, else None."""
  if not options:
    return None
  t = normalize_option(text)
  hits = [i for i, o in enumerate(options) if t and normalize_option(o) == t]
  return hits[0] if len(hits) == 1 else None


def _is_word(text: str, pos: int, letter: str) -> bool:
  """Whether the letter ending at text[pos] is prose ('A car', 'I think') or a variable ('x =')."""
  if _VARIABLE_AFTER.match(text, pos):
    return True
  m = _WORD_AFTER.match(text, pos)
  if m is None or m.group(1).lower() in _CONNECTORS:
    return False
  # An upper-case letter other than the English words "A" and "I" is a letter
  # even before a word ("B because", "C has the largest mass").
  return letter.islower() or letter in 'AI'


def _read(content: str, options: list[str] | None, *, lead: bool = True
          ) -> tuple[list[str], str]:
  """The letters one statement names, and why it names none or several.

  Args:
    content: the statement's text after its phrase (or a boxed group, or a line).
    options: the option texts, if given.
    lead: read a letter at the start (statements); False for a bare final line.

  Returns:
    (letters in order, note): no letters with note '' means the statement
    names nothing; 'negated' or 'text of option X' mean it is unclear.
  """
  text = _LATEX_DELIM.sub(' ', _LATEX_WRAP.sub('', content[:_MAX_STATEMENT_CHARS]))
  if lead:
    if _NEGATED.match(text):
      return [], 'negated'
    m = _LEAD.match(text)
    if m and not _is_word(text, m.end(), m.group(1)):
      letters, pos = [m.group(1).upper()], m.end()
      while (more := _MORE.match(text, pos)) and not _is_word(text, more.end(), more.group(1)):
        letters.append(more.group(1).upper())
        pos = more.end()
      for h in _HEDGE.finditer(text, pos):
        if not _is_word(text, h.end(), h.group(1)):
          letters.append(h.group(1))
      sep = _SEPARATOR.match(text, pos)
      named = _option_named(text[sep.end() if sep else pos:], options)
      if len(set(letters)) == 1 and named is not None and _LETTERS[named] != letters[0]:
        return [], f'letter {letters[0]} but the text of option {_LETTERS[named]}'
      return letters, ''
  marks = [next(g for g in m.groups() if g) for m in _MARKS.finditer(text)]
  if marks:
    return marks, ''
  named = _option_named(text, options)
  return ([_LETTERS[named]], 'option text') if named is not None else ([], '')


def _statements(text: str) -> list[tuple[int, str, str]]:
  """(position, kind, content) of every explicit answer statement, in order."""
  found = []
  for m in _BOX.finditer(text):
    found.append((m.start(), 'boxed', m.end() - 1))
  for m in _PHRASE.finditer(text):
    found.append((m.start(), 'answer phrase', m.end()))
  for m in _LETTER_FIRST.finditer(text):
    found.append((m.start(), 'letter is correct', m.start(1)))
  found.sort()
  out = []
  for pos, kind, at in found[-_MAX_STATEMENTS:]:
    if kind == 'boxed':
      inner = math_lib.braced(text, at, _MAX_STATEMENT_CHARS)
      if inner is None:
        continue
      content = inner
    elif kind == 'letter is correct':
      content = text[at]
    else:
      line_end = text.find('\n', at, at + _MAX_STATEMENT_CHARS)
      content = text[at:line_end if line_end >= 0 else at + _MAX_STATEMENT_CHARS]
      if not content.strip(' \t*_:：'):   # "Answer:" then the letter on the next line.
        rest = text[at:at + _MAX_STATEMENT_CHARS].lstrip(' \t*_:：\r\n')
        content = rest.split('\n', 1)[0]
    out.append((pos, kind, content))
  return out


def extract_choice(text: str, options: list[str] | None = None) -> tuple[str | None, str, str]:
  """Finds the option letter an answer commits to.

  Args:
    text: the answer (the text after the thinking block).
    options: the option texts (index 0 is 'A'), or None.

  Returns:
    (letter or None, how it was found, why not when None): `how` is 'boxed',
    'answer phrase', 'letter is correct', 'final line' or 'none'; the letter
    is upper case and None when nothing, or several letters, are named.
  """
  scan_starts_line = len(text) <= _MAX_SCAN_CHARS or text[-_MAX_SCAN_CHARS - 1] == '\n'
  text = text[-_MAX_SCAN_CHARS:]
  tail = text.rstrip()
  lines = [line for line in tail[-_MAX_STATEMENT_CHARS:].split('\n') if line.strip()]
  if not lines:
    return None, 'none', 'empty answer'
  last = lines[-1]
  # `last` is the final line's end. Its start is read only where it really is: a longer line
  # cut inside has none ("...here. Both" cut at "e. Both" is no letter E), and neither has a
  # line that starts before the scanned text.
  line_start = tail.rfind('\n') + 1
  known_start = line_start > 0 or scan_starts_line
  whole = known_start and not tail[line_start:len(tail) - len(last)].strip()
  m = _ONLY_LETTER.fullmatch(last) if whole else None
  if m:   # A final line that is only a letter is the last statement.
    return m.group(1).upper(), 'final line', ''
  for _, kind, content in reversed(_statements(text)):
    letters, note = _read(content, options)
    if note and not letters:
      return None, kind, f'the final statement is unclear ({note})'
    if letters:
      return _one(letters, kind)
  if whole:
    m = _LINE_START.match(last)
  else:   # The line's first characters, where it starts in the scanned text.
    m = known_start and _LINE_START.match(tail, line_start, line_start + _MAX_STATEMENT_CHARS)
  if m:
    named = _option_named(m.group(2), options)
    if named is not None and _LETTERS[named] != m.group(1).upper():
      return None, 'final line', (f'the final line names {m.group(1).upper()} with the text of '
                                  f'option {_LETTERS[named]}')
    return m.group(1).upper(), 'final line', ''
  letters, _ = _read(last, options, lead=False)
  if letters:
    return _one(letters, 'final line')
  return None, 'none', 'no answer letter found'


# MMLU-Pro's three patterns (module docstring); the second as a lookahead, so that every
# start is found, overlapping ones too ("answer: Answer: B" has two).
_MMLU_PRO_PHRASE = re.compile(r'answer is \(?([A-J])\)?')
_MMLU_PRO_LABEL = re.compile(r'(?=[aA]nswer:\s*([A-J]))')
_MMLU_PRO_LETTER = re.compile(r'\b[A-J]\b')
_SIMPLE_EVALS = re.compile(r'(?i)Answer[ \t]*:[ \t]*\$?([A-D])\$?')
# The extractions `McqaVerifier` takes (the module docstring).
EXTRACTIONS = ('forms', 'mmlu_pro', 'simple_evals')


def extract_mmlu_pro(text: str) -> tuple[str | None, str]:
  """The letter MMLU-Pro's `extract_answer` returns, and which of its patterns found it
  ('answer is', 'answer:', 'last letter' or 'none'). Linear in len(text)."""
  m = _MMLU_PRO_PHRASE.search(text)
  if m:
    return m.group(1), 'answer is'
  # `re.search(r'.*[aA]nswer:\s*([A-J])', text)`: `.*` stays on one line, so the search
  # succeeds first from the start of the first line holding a match, and the greedy `.*`
  # takes the last match starting on that line.
  found = None
  for m in _MMLU_PRO_LABEL.finditer(text):
    if found is None:
      line_end = text.find('\n', m.start())
      line_end = len(text) if line_end < 0 else line_end
    elif m.start() >= line_end:
      break
    found = m.group(1)
  if found is not None:
    return found, 'answer:'
  # `\b[A-J]\b(?!.*\b[A-J]\b)` with DOTALL: the last standalone letter.
  last = None
  for m in _MMLU_PRO_LETTER.finditer(text):
    last = m.group(0)
  return (last, 'last letter') if last is not None else (None, 'none')


def extract_simple_evals(text: str) -> tuple[str | None, str]:
  """The letter simple-evals' `ANSWER_PATTERN_MULTICHOICE` extracts (first match, case as
  written), and 'answer:' or 'none'."""
  m = _SIMPLE_EVALS.search(text)
  return (m.group(1), 'answer:') if m else (None, 'none')


def _one(letters: list[str], how: str) -> tuple[str | None, str, str]:
  distinct = sorted(set(letters))
  if len(distinct) > 1:
    return None, how, f'the final statement names several letters ({", ".join(distinct)})'
  return distinct[0], how, ''


class McqaVerifier(base.Verifier):
  """Reward 1 iff the answer's chosen letter is metadata['answer'] (see the module docstring)."""

  name = 'mcqa'

  def __init__(self, *, extraction: str = 'forms', **common: Any):
    """Options.

    Args:
      extraction: 'forms' (every form models write, the module docstring), 'mmlu_pro' or
        'simple_evals' (a benchmark's official extraction).
      **common: thinking_unfinished_reward, workers, timeout_s.
    """
    super().__init__(**common)
    if extraction not in EXTRACTIONS:
      raise ValueError(f'{self.name}: extraction must be one of {EXTRACTIONS}, got '
                       f'{extraction!r}')
    self.extraction = extraction

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any], **options: Any) -> None:
    answer = base.require(metadata, 'answer', str, 'the gold option letter')
    if len(answer) != 1 or answer not in _LETTERS:
      raise ValueError(f'metadata["answer"] must be one letter A-Z, got {answer!r:.50}')
    if 'options' not in metadata or metadata['options'] is None:
      return
    opts = base.require(metadata, 'options', list, 'the option texts, index 0 = A')
    if not 2 <= len(opts) <= len(_LETTERS):
      raise ValueError(f'metadata["options"] must have 2 to 26 entries, got {len(opts)}')
    for i, o in enumerate(opts):
      if not isinstance(o, str):
        raise ValueError(f'metadata["options"][{i}] must be str, got {type(o).__name__}')
    if _LETTERS.index(answer) >= len(opts):
      raise ValueError(f'metadata["answer"] {answer!r} has no option: metadata["options"] has '
                       f'{len(opts)} entries')

  def _prepare(self, sample: base.Sample, answer: str) -> base.Result:
    gold = sample.metadata['answer']
    if self.extraction != 'forms':
      official = extract_mmlu_pro if self.extraction == 'mmlu_pro' else extract_simple_evals
      letter, how = official(answer)
      info = {'gold': gold, 'extracted': letter, 'found_by': how}
      if letter is None:
        return base.Result(0.0, dict(info, reason=f'no answer letter ({self.extraction})'))
      ok = letter == gold
      return base.Result(float(ok), dict(info, reason='correct' if ok else 'wrong letter'))
    options = sample.metadata.get('options') or None
    letter, how, why = extract_choice(answer, options)
    info = {'gold': gold, 'extracted': letter, 'found_by': how}
    if len(answer) > _MAX_SCAN_CHARS:
      info['scanned'] = f'the last {_MAX_SCAN_CHARS} characters'
    if letter is None:
      return base.Result(0.0, dict(info, reason=why))
    ok = letter == gold
    return base.Result(float(ok), dict(info, reason='correct' if ok else 'wrong letter'))
