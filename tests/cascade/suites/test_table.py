"""The suites' text: the matrix's suite table with its changes, and docs/evaluation.md's list of
suites generated from the registry (so it cannot go stale)."""

import os
import pathlib
import re

from cascade import suites
from cascade.suites import table
from tiny_world import suites as world_suites

PAGE = pathlib.Path(__file__).resolve().parents[3] / 'docs' / 'evaluation.md'
BLOCK = re.compile(r'(<!-- suites: begin -->\n)(.*?)(<!-- suites: end -->)', re.S)


def test_the_evaluation_page_lists_every_registered_suite_with_its_protocol():
  # The shipped suites and the tiny world's (not those other tests register in this process).
  listed = sorted(set(suites.builtin_names()) | {s.name for s in world_suites.SUITES})
  want = table.registry_markdown([suites.get(n) for n in listed])
  text = PAGE.read_text(encoding='utf-8')
  m = BLOCK.search(text)
  assert m, f'{PAGE}: no <!-- suites: begin --> ... <!-- suites: end --> block'
  if os.environ.get('CASCADE_REGEN_DOCS') and m.group(2) != want:
    PAGE.write_text(text[:m.start(2)] + want + text[m.end(2):], encoding='utf-8')
    return
  assert m.group(2) == want, ('docs/evaluation.md lists other suites or protocols than the '
                              'registry: run this test with CASCADE_REGEN_DOCS=1 to rewrite it')
  for name in listed:
    assert f'| `{name}` |' in want and suites.get(name).protocol_hash() in want


def test_the_matrix_table_shows_each_change_only_between_rows_of_one_protocol():
  a = {'value': 50.0, 'stderr': 2.0, 'protocol': 'p1'}
  b = {'value': 55.5, 'stderr': 2.5, 'protocol': 'p1'}
  c = {'value': 60.0, 'stderr': 1.0, 'protocol': 'p2'}        # the protocol changed in between
  md = table.matrix_markdown(['sft', 'rlhf', 'math_rl'], ['s1', 's2'],
                             [[a, None], [b, a], [c, None]])
  rows = md.splitlines()[2:]
  assert rows == ['| sft | 50.0 ± 2.0 | - |', '| rlhf | 55.5 ± 2.5 (+5.5) | 50.0 ± 2.0 |',
                  '| math_rl | 60.0 ± 1.0 | - |']
  cell = table.matrix_cell({'metric': 'avg@4', 'value': 1 / 3, 'stderr': 0.1, 'n': 3, 'k': 4,
                            'samples': 12, 'protocol': 'p', 'pass@4': 2 / 3, 'maj@4': 0.5,
                            'seconds': 9.0, 'settings': {}})
  assert cell == {'metric': 'avg@4', 'value': 0.3333, 'stderr': 0.1, 'n': 3, 'k': 4,
                  'samples': 12, 'protocol': 'p', 'pass@4': 0.6667, 'maj@4': 0.5}
  assert table.summary({'metric': 'avg@4', 'value': 53.04, 'stderr': 2.06, 'pass@16': 80.0,
                        'pass@4': 70.0}) == 'avg@4 53.0 ± 2.1, pass@4 70.0, pass@16 80.0'
