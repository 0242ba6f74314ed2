"""Every instruction check of IFEval, IFTrain and IFBench costs well under a second of CPU per
megabyte of hostile text: titles, initials, clitics, brackets, separators, invisible characters,
a megabyte of distinct words or of sentences. (Runs of one mark, which cost the tokenizer most
before, are tests/verifiers/test_text.py's.)"""

import time

import pytest

from tests.verifiers import test_ifbench
from tests.verifiers import test_ifeval
from tests.verifiers import test_iftrain
from verifiers import ifbench
from verifiers import ifeval
from verifiers import iftrain
from verifiers import instruction_following
from verifiers import reader

MB = 1_000_000
# The bound each check meets on a megabyte, in CPU seconds, with room for a loaded machine: the
# worst check (a sentence check on a megabyte of four-character sentences) took about 0.5 s,
# and 0.76 s while two cores ran a dozen other processes; the checks this replaced took 1.1 to
# 1.7 s on their worst megabyte.
LIMIT_S = 0.9


def _megabyte(unit: str) -> str:
  return (unit * (MB // len(unit) + 1))[:MB]


def _distinct_words() -> str:
  # Two-letter words that never repeat (no cache helps) and never end a sentence.
  return ' '.join(chr(0x4e00 + i % 20_000) + chr(0x3400 + i // 20_000) for i in range(MB // 3))


def _distinct_sentences() -> str:
  return ''.join(chr(0x4e00 + i % 20_000) + chr(0x3400 + i // 20_000) + '. '
                 for i in range(MB // 4))


HOSTILE = {
    'titles': lambda: _megabyte('Dr. '),
    'initials': lambda: _megabyte('a. '),
    'clitics': lambda: _megabyte("I don't, "),
    'placeholders': lambda: _megabyte('[a] '),
    'quoted tabs': lambda: _megabyte('\t"'),
    'paragraph separators': lambda: 'x' + _megabyte('\u2029'),
    'distinct words': _distinct_words,
    'distinct sentences': _distinct_sentences,
    'hyphenated sentences': lambda: _megabyte('a.-'),
}
# Megabytes that cost reading (`reader.visible`) most; each check then reads what is left.
UNREAD = {
    'hangul fillers': lambda: 'x' + _megabyte('\u3164'),
    'unassigned invisible': lambda: 'x' + _megabyte('\U000e0080'),
    'combining marks': lambda: _megabyte('e\u0301'),
    'full-width letters': lambda: _megabyte('\uff41'),
    'line separators': lambda: _megabyte('\r\n\u2028'),
}
CHECKERS = {'ifeval': (ifeval, test_ifeval.CASES), 'iftrain': (iftrain, test_iftrain.CASES),
            'ifbench': (ifbench, test_ifbench.CASES)}


def _cost(module, instruction_id: str, kwargs: dict, response: str) -> float:
  start = time.process_time()
  assert module.follows([instruction_id], [kwargs], response) in ([True], [False])
  return time.process_time() - start


def _warm(responses) -> None:
  """What a worker has done before its first hostile megabyte: langdetect's profiles loaded
  (worker_init), and `reader.fold`'s table filled for the letters it has seen (once a process,
  at most a few tenths of a second for all of Unicode's letters)."""
  instruction_following.worker_init()
  for response in responses:
    reader.fold(reader.visible(response))
    reader.fold(reader.visible(response), keep_case=True)


@pytest.mark.parametrize('checker, instruction_id, hostile', [
    # Each took 1.1 to 1.7 s on this megabyte before (quadratic or a slow pass per token).
    ('ifeval', 'change_case:capital_word_frequency', 'titles'),
    ('ifeval', 'detectable_content:number_placeholders', 'placeholders'),
    ('ifbench', 'count:pronouns', 'titles'),
    ('ifbench', 'format:title_case', 'titles'),
    ('ifbench', 'words:start_verb', 'titles'),
    ('ifbench', 'words:words_position', 'titles'),
])
def test_the_slow_checks_cost_well_under_a_second_per_megabyte(checker, instruction_id, hostile):
  module, cases = CHECKERS[checker]
  response = HOSTILE[hostile]()
  assert _cost(module, instruction_id, cases[instruction_id][0], response) < LIMIT_S


def test_reading_costs_well_under_a_second_per_megabyte():
  # The megabytes above are read inside every check of the sweep below (heavy).
  for name, make in UNREAD.items():
    response = make()
    start = time.process_time()
    reader.fold(reader.visible(response), keep_case=True)
    assert time.process_time() - start < LIMIT_S, name


@pytest.mark.heavy
@pytest.mark.parametrize('checker', sorted(CHECKERS))
def test_every_instruction_check_costs_well_under_a_second_per_megabyte(checker):
  # Every check on every megabyte that is costly for some check (loose mode runs a check on up
  # to eight variants of the response: a megabyte each at most).
  module, cases = CHECKERS[checker]
  responses = {name: make() for name, make in HOSTILE.items()}
  _warm(responses.values())
  slow = {}
  for instruction_id, (kwargs, _, _) in sorted(cases.items()):
    for name, response in responses.items():
      cost = _cost(module, instruction_id, kwargs, response)
      if cost >= LIMIT_S:
        slow[instruction_id, name] = round(cost, 2)
  assert not slow
