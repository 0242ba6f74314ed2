"""BFCL v3's single-turn AST categories (non-live and live): the released layout read (JSON lines named .json, answers
joined from possible_answer/), the tools in the prompt as the chat template renders them, and
each rule of BFCL's AST checker (as cascade/suites/bfcl.py restates it) on hand-made calls."""

import json
import os

import pytest

from cascade import suites
from cascade.suites import base
from cascade.suites import bfcl
from foundation import chat

FIXTURES = os.path.join(os.path.dirname(__file__), '..', '..', 'fixtures', 'suites')
TRI = {'name': 'calculate_triangle_area', 'parameters': {
    'type': 'dict', 'required': ['base', 'height'],
    'properties': {'base': {'type': 'integer'}, 'height': {'type': 'integer'},
                   'unit': {'type': 'string'}}}}
TRI_ANSWER = {'calculate_triangle_area': {'base': [10], 'height': [5], 'unit': ['units', '']}}


def call(name, **args):
  return (name, args)


def tool_calls(*calls, thinking='ok'):
  """An assistant turn calling `calls` in `<tool_call>` blocks after a thinking block."""
  blocks = ''.join(chat.render_tool_call(n, a) + '\n' for n, a in calls)
  return f'<think>{thinking}</think>{blocks}'


def _read(category):
  suite = suites.get(f'bfcl_v3_{category}')
  return suite, suite.read(os.path.join(FIXTURES, f'bfcl_v3_{category}'))


def test_the_categories_are_registered_and_read_from_the_released_layout():
  for cat in bfcl.CATEGORIES:
    suite, recs = _read(cat)
    assert suite.name == f'bfcl_v3_{cat}' and suite.metric == 'accuracy'
    assert suite.protocol.greedy and suite.hub_dataset == bfcl._HUB
    assert all(r['metadata']['category'] == cat for r in recs)
    assert all(('ground_truth' in r['metadata']) == (cat not in bfcl.NO_ANSWERS) for r in recs)
  suite, recs = _read('simple')
  assert [r['id'] for r in recs] == ['simple_0', 'simple_1', 'simple_2']
  assert recs[0]['metadata']['ground_truth'] == [TRI_ANSWER]
  # The prompt: the offered functions as the chat template's tools (BFCL types as JSON
  # schema's), in a system turn of their own or after the question's system prompt.
  for rec, path in ((recs[0], 'BFCL_v3_simple.json'), (recs[2], 'BFCL_v3_simple.json')):
    with open(os.path.join(FIXTURES, 'bfcl_v3_simple', path)) as f:
      raw = next(json.loads(x) for x in f if json.loads(x)['id'] == rec['id'])
    tools = [bfcl.schema(d) for d in raw['function']]
    assert chat.render(rec['messages'], thinking=True) == chat.render(
        raw['question'][0], thinking=True, tools=tools)
  schema = bfcl.schema(recs[2]['metadata']['functions'][0])['function']['parameters']
  assert schema['type'] == 'object' and schema['properties']['address']['type'] == 'object'
  assert schema['properties']['items'] == {'type': 'array', 'items': {'type': 'object'},
                                           'description': 'items'}
  assert recs[2]['messages'][0]['content'].startswith('You are a careful shop assistant.\n\n'
                                                      '# Tools')


def test_missing_files_and_bad_records_are_one_line_naming_them(tmp_path):
  suite = suites.get('bfcl_v3_simple')
  with pytest.raises(base.DataMissing, match=r"suite 'bfcl_v3_simple': no BFCL_v3_simple\.json "
                                             r'or BFCL_v4_simple_python\.json under'):
    suite.read(str(tmp_path))
  (tmp_path / 'BFCL_v4_simple_python.json').write_text(json.dumps(
      {'id': 'a', 'question': [[{'role': 'user', 'content': 'x'}]], 'function': [TRI]}) + '\n')
  with pytest.raises(base.DataMissing, match=r'no possible_answer/BFCL_v3_simple\.json or '
                                             r'possible_answer/BFCL_v4_simple_python\.json'):
    suite.read(str(tmp_path))
  (tmp_path / 'possible_answer').mkdir()
  (tmp_path / 'possible_answer' / 'BFCL_v4_simple_python.json').write_text(
      json.dumps({'id': 'b', 'ground_truth': [TRI_ANSWER]}) + '\n')
  with pytest.raises(base.BadRecord, match=r"has no answer to 'a'"):
    suite.read(str(tmp_path))
  (tmp_path / 'BFCL_v4_simple_python.json').write_text(json.dumps(
      {'id': 'a', 'question': [[{'role': 'user', 'content': 'x'}], []], 'function': [TRI]}))
  with pytest.raises(base.BadRecord, match=r"BFCL_v4_simple_python\.json:1: field 'question' "
                                           'must be one turn'):
    suite.read(str(tmp_path))


CASES = [
    # (expected to pass, the call, why: the rule)
    (True, call('calculate_triangle_area', base=10, height=5), 'optional unit left out'),
    (True, call('calculate_triangle_area', base=10, height=5, unit='Units.'),
     'strings compared without case and . , / - _ * ^ and spaces'),
    (False, call('calculate_triangle_area', base=10, height=5, unit='cm'), 'a wrong string'),
    (False, call('calculate_triangle_area', base=10), 'a required parameter missing'),
    (False, call('calculate_triangle_area', base=10.0, height=5), 'a float for an integer'),
    (False, call('calculate_triangle_area', base='10', height=5), 'a string for an integer'),
    (False, call('calculate_triangle_area', base=10, height=5, color='red'),
     'a parameter the description lacks'),
    (False, call('calculate_triangle_area', base=11, height=5), 'a wrong value'),
    (False, call('triangle_area', base=10, height=5), 'another function'),
    (False, call('calculate_triangle_area', base=True, height=5), 'a bool is not an integer'),
]


@pytest.mark.parametrize('ok,the_call,why', CASES, ids=[c[2] for c in CASES])
def test_one_call_is_checked_by_bfcls_rules(ok, the_call, why):
  got, reason = bfcl.check_call(TRI, the_call, TRI_ANSWER)
  assert got == ok, (why, reason)
  assert bool(reason) == (not ok)


def test_types_values_and_variables_by_bfcls_rules():
  hyp = {'name': 'h', 'parameters': {'required': ['x'], 'properties': {
      'x': {'type': 'float'}, 'v': {'type': 'array', 'items': {'type': 'integer'}},
      't': {'type': 'tuple', 'items': {'type': 'string'}}, 'n': {'type': 'integer'},
      'b': {'type': 'boolean'}}}}
  want = {'h': {'x': [4.0], 'v': [[3, 5], ''], 't': [['a b', 'c'], ''], 'n': ['count', ''],
                'b': [True, '']}}
  check = lambda **a: bfcl.check_call(hyp, ('h', a), want)[0]
  assert check(x=4)                                   # an int is taken for a float
  assert not check(x=4.5)
  assert check(x=4.0, v=[3, 5]) and not check(x=4.0, v=[5, 3])     # lists in order
  assert not check(x=4.0, v=['3', '5'])                # the items' type
  assert check(x=4.0, t=('A-B', 'c'))                  # a tuple as a list, strings normalised
  assert check(x=4.0, n='count')                       # a variable's name for an integer
  assert not check(x=4.0, n='other') and not check(x=4.0, n=3)
  assert check(x=4.0, b=True) and not check(x=4.0, b=1)
  must = {'h': {'x': [4.0], 'n': [5]}}                 # n expected and not optional
  assert not bfcl.check_call(hyp, ('h', {'x': 4.0}), must)[0]
  assert bfcl.check_call(hyp, ('h', {'x': 4.0, 'n': 5}), must)[0]


def test_dicts_and_lists_of_dicts_by_bfcls_rules():
  doc = {'name': 'o', 'parameters': {'required': ['a'], 'properties': {
      'a': {'type': 'dict'}, 'l': {'type': 'array', 'items': {'type': 'dict'}}}}}
  want = {'o': {'a': [{'k': [1], 's': ['New York', ''], 'z': ['', 2]}],
                'l': [[{'id': [7]}, {'id': [8], 'q': ['', 1]}], '']}}
  check = lambda **a: bfcl.check_call(doc, ('o', a), want)
  assert check(a={'k': 1, 's': 'new-york'})[0]
  assert check(a={'k': 1})[0]                           # '' marks s and z optional
  assert 'unexpected dict key' in check(a={'k': 1, 'w': 0})[1]
  assert 'missing dict key' in check(a={'s': 'New York'})[1]
  assert not check(a={'k': 2})[0]
  assert check(a={'k': 1}, l=[{'id': 7}, {'id': 8, 'q': 1}])[0]
  assert not check(a={'k': 1}, l=[{'id': 8}, {'id': 7}])[0]        # in order
  assert 'wrong number of dicts' in check(a={'k': 1}, l=[{'id': 7}])[1]


def test_the_categories_count_and_match_calls_as_bfcl_does():
  docs = [TRI, {'name': 'g', 'parameters': {'required': ['c'],
                                            'properties': {'c': {'type': 'string'}}}}]
  two = [{'g': {'c': ['Paris']}}, {'g': {'c': ['Tokyo']}}]
  assert bfcl.check('parallel', docs, [call('g', c='tokyo'), call('g', c='paris')], two)[0]
  assert not bfcl.check('parallel', docs, [call('g', c='Paris'), call('g', c='Paris')], two)[0]
  assert not bfcl.check('parallel', docs, [call('g', c='Paris')] * 3, two)[0]
  assert 'matches none left' in bfcl.check('parallel', docs,
                                           [call('g', c='Paris'), call('g', c='Rome')], two)[1]
  one = [{'g': {'c': ['Paris']}}]
  assert bfcl.check('multiple', docs, [call('g', c='Paris')], one)[0]
  assert not bfcl.check('multiple', docs, [call('calculate_triangle_area', base=1, height=2)],
                        one)[0]
  assert not bfcl.check('multiple', docs, [call('g', c='Paris')] * 2, one)[0]
  assert not bfcl.check('simple', docs, [], [TRI_ANSWER])[0]
  assert bfcl.check('irrelevance', docs, [], [])[0]
  assert not bfcl.check('irrelevance', docs, [call('g', c='x')], [])[0]


def test_completions_are_graded_and_scored_per_category():
  expected = {
      'simple': [
          (tool_calls(('calculate_triangle_area', {'base': 10, 'height': 5})), 1.0),
          (tool_calls(('math.hypot', {'x': 4, 'y': 5.0, 'z': 0.0})), 1.0),
          (tool_calls(('place_order', {'items': [{'id': 7, 'qty': 2}],
                                       'address': {'street': '1 main st.', 'zip': '94110'}})),
           1.0)],
      'multiple': [(tool_calls(('get_stock_price', {'company': 'Paris'})), 0.0),
                   (tool_calls(('get_stock_price', {'company': 'nvda'})), 1.0)],
      'parallel': [(tool_calls(('get_weather', {'city': 'Tokyo'}),
                               ('get_weather', {'city': 'Paris'})), 1.0),
                   (tool_calls(('get_stock_price', {'company': 'AAPL'})), 0.0)],
      'parallel_multiple': [(tool_calls(
          ('math_toolkit.product_of_primes', {'count': 5}),
          ('math_toolkit.sum_of_multiples', {'lower_limit': 1, 'upper_limit': 1000,
                                             'multiples': [3, 5]})), 1.0)],
      'irrelevance': [
          # A call inside the thinking block and a malformed block are not calls.
          ('<think><tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call></think>'
           'I cannot help with that using these tools. <tool_call>{bad json</tool_call>', 1.0),
          (tool_calls(('get_weather', {'city': 'Paris'})), 0.0)],
  }
  for cat, rows in expected.items():
    suite, recs = _read(cat)
    assert len(recs) == len(rows), cat
    grades = suite.grader().grade_batch(recs, [[c] for c, _ in rows])
    assert [g[0].score for g in grades] == [s for _, s in rows], (
        cat, [g[0].info['reason'] for g in grades])
    res = suite.summarize(recs, grades)
    want = 100.0 * sum(s for _, s in rows) / len(rows)
    assert (res['metric'], res['value'], res['n']) == ('accuracy', pytest.approx(want), len(rows))
  # A thinking block that never closed: no calls (right only where none is expected).
  suite, recs = _read('simple')
  g = suite.grader().grade(recs[0], ['<think>still thinking ' + chat.render_tool_call(
      'calculate_triangle_area', {'base': 10, 'height': 5})])
  assert g[0].score == 0.0 and 'never closed' in g[0].info['reason']
  with pytest.raises(TypeError, match='takes none'):
    suite.grader(workers=2)


def test_a_live_category_is_checked_by_the_rule_its_name_names():
  docs = [TRI, {'name': 'g', 'parameters': {'required': ['c'],
                                            'properties': {'c': {'type': 'string'}}}}]
  two = [{'g': {'c': ['Paris']}}, {'g': {'c': ['Tokyo']}}]
  one = [{'g': {'c': ['Paris']}}]
  for live, plain, calls, truth in (
      ('live_simple', 'simple', [call('g', c='Paris')], one),
      ('live_simple', 'simple', [call('g', c='Paris')] * 2, one),
      ('live_multiple', 'multiple', [call('g', c='paris')], one),
      ('live_multiple', 'multiple', [call('g', c='Rome')], one),
      ('live_parallel', 'parallel', [call('g', c='Tokyo'), call('g', c='Paris')], two),
      ('live_parallel_multiple', 'parallel_multiple', [call('g', c='Paris')] * 2, two),
      ('live_irrelevance', 'irrelevance', [], []),
      ('live_irrelevance', 'irrelevance', [call('g', c='x')], [])):
    simple_docs = [docs[1]] if 'simple' in live else docs
    assert bfcl.check(live, simple_docs, calls, truth) == bfcl.check(plain, simple_docs, calls,
                                                                     truth), (live, calls)
  # Relevance: right with any well-formed call (of any function, its arguments unchecked).
  assert bfcl.check('live_relevance', docs, [call('nope', zz=1)], [])[0]
  assert bfcl.check('live_relevance', docs, [], []) == (False, 'no call where one fits')


def test_the_live_categories_are_graded_from_their_released_layout():
  expected = {
      'live_simple': [
          (tool_calls(('get_user_info', {'user_id': 7890, 'special': 'black'})), 1.0),
          # The unit is optional (its accepted values hold ''); a wrong city is wrong.
          (tool_calls(('get_current_weather', {'location': 'Boston, MA'})), 1.0)],
      'live_multiple': [
          (tool_calls(('ChaFod', {'foodItem': 'Burger', 'removeIngredients': 'onions'})), 1.0),
          (tool_calls(('get_current_weather', {'location': 'Santa Rosa, CA'})), 0.0)],
      'live_parallel': [(tool_calls(
          ('get_current_weather', {'location': 'San Francisco, CA'}),
          ('get_current_weather', {'location': 'Boston, MA', 'unit': 'fahrenheit'})), 1.0)],
      'live_parallel_multiple': [(tool_calls(
          ('uber.ride', {'loc': '2150 Shattuck Ave, Berkeley, CA', 'type': 'plus',
                         'time': 10})), 0.0)],
      'live_irrelevance': [
          ('<think>no tool fits</think>Waves fold on the shore...', 1.0),
          (tool_calls(('uber.ride', {'loc': 'x', 'type': 'plus', 'time': 4})), 0.0)],
      'live_relevance': [
          (tool_calls(('uber.ride', {'loc': '1 Main St, Berkeley, CA', 'type': 'comfort',
                                     'time': 30})), 1.0),
          # A malformed block is no call; neither is one inside the thinking block.
          ('<think>' + chat.render_tool_call('Movies_1_FindMovies', {'location': 'x'})
           + '</think><tool_call>{bad json</tool_call>', 0.0)],
  }
  for cat, rows in expected.items():
    suite, recs = _read(cat)
    assert suite.title.startswith('BFCL v3 live') and suite.protocol.greedy
    assert len(recs) == len(rows), cat
    assert recs[0]['id'].startswith(f'{cat}_0-')
    grades = suite.grader().grade_batch(recs, [[c] for c, _ in rows])
    assert [g[0].score for g in grades] == [s for _, s in rows], (
        cat, [g[0].info['reason'] for g in grades])
  # A live question's own system prompt stays first, the tools' section after it.
  _, recs = _read('live_simple')
  assert recs[1]['messages'][0]['content'].startswith('You are a helpful assistant.\n\n# Tools')


@pytest.mark.parametrize('category', bfcl.MULTI_TURN)
def test_the_multi_turn_categories_are_refused_in_one_line_saying_why(category):
  name = f'bfcl_v3_{category}'
  with pytest.raises(ValueError) as e:
    suites.get(name)
  msg = str(e.value)
  assert '\n' not in msg and msg.startswith(f'suite {name!r} is not available: ')
  assert 'API simulators' in msg and 'numpy' in msg
  assert name not in suites.names() and suites.refusal('bfcl_v3_simple') == ''
