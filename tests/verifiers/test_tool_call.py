"""Tool-calling verifier: the turn's calls against the gold calls, their schemas, and hostile turns."""

import json
import time

import pytest

from foundation import chat
from verifiers import tool_call
import verifiers

S = verifiers.Sample


def _call(name, **arguments):
  return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def _tool(name, properties, required=()):
  return {'type': 'function',
          'function': {'name': name, 'description': f'the {name} tool',
                       'parameters': {'type': 'object', 'properties': properties,
                                      'required': list(required),
                                      'additionalProperties': False}}}


TOOLS = [
    _tool('get_weather', {'city': {'type': 'string'}, 'days': {'type': 'integer', 'minimum': 1},
                          'unit': {'type': 'string', 'enum': ['C', 'F']}}, ['city']),
    _tool('convert', {'amount': {'type': 'number'}, 'to': {'type': 'string'},
                      'tags': {'type': 'array', 'items': {'type': 'string'}},
                      'code': {'type': 'string'}}),
]
WEATHER = {'name': 'get_weather', 'arguments': {'city': 'Paris', 'days': 2}}
ALARM = {'name': 'alarm', 'arguments': {'loud': True, 'label': None}}
CONVERT = {'name': 'convert', 'arguments': {'amount': 2.5, 'to': 'EUR'}}

# (completion, metadata, reward, reason prefix)
CASES = [
    (_call('get_weather', city='Paris', days=2), {'calls': [WEATHER]}, 1.0, 'calls match'),
    ('<think>Paris, two days.</think>\n\n' + _call('get_weather', days=2.0, city=' Paris '),
     {'calls': [WEATHER], 'tools': TOOLS}, 1.0, 'calls match'),
    (_call('convert', amount=2.5, to='EUR') + _call('get_weather', city='Paris', days=2),
     {'calls': [WEATHER, CONVERT], 'tools': TOOLS}, 1.0, 'calls match'),
    (_call('convert', amount=2.5, to='EUR') + _call('get_weather', city='Paris', days=2),
     {'calls': [WEATHER, CONVERT], 'ordered': True}, 0.0, 'call 1: name'),
    (_call('get_weather', city='Paris', days=2) + _call('get_weather', city='Paris', days=2),
     {'calls': [WEATHER]}, 0.0, 'expected 1 call(s) (get_weather), got 2'),
    (_call('get_weather', city='Paris', days=2),
     {'calls': [WEATHER, CONVERT]}, 0.0, 'expected 2 call(s)'),
    # Two calls to one tool: each gold call needs its own predicted call.
    (_call('get_weather', city='Paris', days=2) + _call('get_weather', city='Paris', days=2),
     {'calls': [WEATHER, {'name': 'get_weather', 'arguments': {'city': 'Rome', 'days': 2}}]},
     0.0, "gold call 2 (get_weather): arguments.city: expected 'Rome', got 'Paris'"),
    (_call('get_weather', city='London', days=2), {'calls': [WEATHER]}, 0.0,
     "gold call 1 (get_weather): arguments.city: expected 'Paris', got 'London'"),
    (_call('get_weather', city='paris', days=2), {'calls': [WEATHER]}, 0.0,
     'gold call 1 (get_weather): arguments.city'),
    (_call('get_weather', city='Paris'), {'calls': [WEATHER]}, 0.0,
     "gold call 1 (get_weather): arguments: missing key 'days'"),
    (_call('get_weather', city='Paris', days=2, unit='C'), {'calls': [WEATHER]}, 0.0,
     "gold call 1 (get_weather): arguments: unexpected key 'unit'"),
    (_call('get_weather', city='Paris', days='2'), {'calls': [WEATHER]}, 0.0,
     "gold call 1 (get_weather): arguments.days: expected 2, got '2'"),
    (_call('get_weather', city='Paris', days=True), {'calls': [
        {'name': 'get_weather', 'arguments': {'city': 'Paris', 'days': 1}}]}, 0.0,
     'gold call 1 (get_weather): arguments.days: expected 1, got True'),
    (_call('search', q='x'), {'calls': [WEATHER]}, 0.0, "no call to 'get_weather' (gold call 1)"),
    # The name counts even when the arguments are the gold ones.
    (_call('search', city='Paris', days=2), {'calls': [WEATHER]}, 0.0,
     "no call to 'get_weather' (gold call 1)"),
    (_call('convert', city='Paris', days=2), {'calls': [WEATHER]}, 0.0,
     "no call to 'get_weather' (gold call 1)"),
    (_call('get_weather', city='Paris', days=2) + _call('get_weather', city='Paris', days=2),
     {'calls': [WEATHER, CONVERT]}, 0.0, "no call to 'convert' (gold call 2)"),
    (_call('get_weather', city='Paris', days=2) + _call('search', q='Rome'),
     {'calls': [WEATHER, {'name': 'get_weather', 'arguments': {'city': 'Rome', 'days': 2}}]},
     0.0, "gold call 2 (get_weather): arguments.city: expected 'Rome', got 'Paris'"),
    (_call('get_weather', city='Paris', days=1), {'calls': [WEATHER]}, 0.0,
     'gold call 1 (get_weather): arguments.days: expected 2, got 1'),
    (_call('get_weather', city='Paris', days=2) + _call('convert', amount=2.5, to='EUR'),
     {'calls': [WEATHER, {'name': 'convert', 'arguments': {'amount': 2.5, 'to': 'USD'}}],
      'ordered': True}, 0.0, "call 2: arguments.to: expected 'USD', got 'EUR'"),
    # Schema checks (with tools).
    (_call('get_weather', city='Paris', days=0), {'calls': [WEATHER], 'tools': TOOLS}, 0.0,
     'call 1 (get_weather): schema violation at days'),
    (_call('get_weather', city='Paris', days=2, unit='K'),
     {'calls': [{'name': 'get_weather', 'arguments': {'city': 'Paris', 'days': 2, 'unit': 'K'}}],
      'tools': TOOLS}, 0.0, 'call 1 (get_weather): schema violation at unit'),
    (_call('get_weather', city='Paris', days=2) + _call('get_time', city='Paris'),
     {'calls': [WEATHER], 'tools': TOOLS}, 0.0, "call 2: unknown tool 'get_time'"),
    (_call('get_weather', city='Paris', days=2) * 2 + _call('get_time', city='Paris'),
     {'calls': [WEATHER], 'tools': TOOLS}, 0.0, "call 3: unknown tool 'get_time'"),
    (_call('get_weather', city='Paris', days=2) + _call('convert', amount='2.5'),
     {'calls': [WEATHER, CONVERT], 'tools': TOOLS}, 0.0,
     'call 2 (convert): schema violation at amount'),
    # A string the schema types as a string may stand for a gold number.
    (_call('convert', amount=2.5, to='EUR', code='42'),
     {'calls': [{'name': 'convert', 'arguments': {'amount': 2.5, 'to': 'EUR', 'code': 42}}],
      'tools': TOOLS}, 1.0, 'calls match'),
    (_call('convert', amount=2.5, to='EUR', code='42'),
     {'calls': [{'name': 'convert', 'arguments': {'amount': 2.5, 'to': 'EUR', 'code': 42}}]},
     0.0, "gold call 1 (convert): arguments.code: expected 42, got '42'"),
    (_call('convert', amount=2.5, to='EUR', code=' 2.5 '),
     {'calls': [{'name': 'convert', 'arguments': {'amount': 2.5, 'to': 'EUR', 'code': 2.5}}],
      'tools': TOOLS}, 1.0, 'calls match'),
    # A type list that names 'string' counts too.
    (_call('label', code='42'),
     {'calls': [{'name': 'label', 'arguments': {'code': 42}}],
      'tools': [_tool('label', {'code': {'type': ['string', 'null']}})]}, 1.0, 'calls match'),
    # Booleans and null only as themselves.
    (_call('alarm', loud=True, label=None), {'calls': [ALARM]}, 1.0, 'calls match'),
    (_call('alarm', loud=1, label=None), {'calls': [ALARM]}, 0.0,
     'gold call 1 (alarm): arguments.loud: expected True, got 1'),
    (_call('alarm', loud=False, label=None), {'calls': [ALARM]}, 0.0,
     'gold call 1 (alarm): arguments.loud: expected True, got False'),
    (_call('alarm', loud=True, label=0), {'calls': [ALARM]}, 0.0,
     'gold call 1 (alarm): arguments.label: expected None, got 0'),
    # Lists and $any_of.
    (_call('convert', amount=1, to='USD', tags=['a', 'b']),
     {'calls': [{'name': 'convert', 'arguments': {'amount': 1.0, 'to': 'USD', 'tags': ['a', 'b']}}]},
     1.0, 'calls match'),
    (_call('convert', amount=1, to='USD', tags=['b', 'a']),
     {'calls': [{'name': 'convert', 'arguments': {'amount': 1, 'to': 'USD', 'tags': ['a', 'b']}}]},
     0.0, "gold call 1 (convert): arguments.tags[0]: expected 'a', got 'b'"),
    (_call('convert', amount=1, to='USD', tags=['a', 'b', 'c']),
     {'calls': [{'name': 'convert', 'arguments': {'amount': 1, 'to': 'USD', 'tags': ['a', 'b']}}]},
     0.0, 'gold call 1 (convert): arguments.tags: expected 2 items, got 3'),
    (_call('convert', amount=1, to='USD', tags=['a']),
     {'calls': [{'name': 'convert', 'arguments': {'amount': 1, 'to': 'USD', 'tags': ['a', 'b']}}]},
     0.0, 'gold call 1 (convert): arguments.tags: expected 2 items, got 1'),
    (_call('convert', amount=1, to='USD', tags=[str(i) for i in range(300)]),
     {'calls': [{'name': 'convert',
                 'arguments': {'amount': 1, 'to': 'USD', 'tags': [str(i) for i in range(300)]}}]},
     1.0, 'calls match'),
    (_call('get_weather', city='Paris, FR', days=2),
     {'calls': [{'name': 'get_weather',
                 'arguments': {'city': {'$any_of': ['Paris', 'Paris, FR']}, 'days': 2}}]},
     1.0, 'calls match'),
    (_call('get_weather', city='Lyon', days=2),
     {'calls': [{'name': 'get_weather',
                 'arguments': {'city': {'$any_of': ['Paris', 'Paris, FR']}, 'days': 2}}]},
     0.0, "gold call 1 (get_weather): arguments.city: 'Lyon' is none of the accepted values"),
    # Malformed calls.
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}</tool_call>',
     {'calls': [WEATHER]}, 0.0, 'malformed tool call: tool call 1: not valid JSON'),
    (_call('get_weather', city='Paris', days=2) + '<tool_call>{"arguments": {}}</tool_call>',
     {'calls': [WEATHER]}, 0.0, 'malformed tool call: tool call 2: "name"'),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
     {'calls': [WEATHER]}, 0.0, 'malformed tool call: tool call 1: <tool_call> is never closed'),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": NaN, "days": 2}}</tool_call>',
     {'calls': [WEATHER]}, 0.0, 'malformed tool call'),
    # Calls inside the thinking block are not calls.
    ('<think>' + _call('get_weather', city='Paris', days=2) + '</think>\n\nIt is sunny.',
     {'calls': [WEATHER]}, 0.0, 'no tool call (a final answer) but 1 expected'),
    ('<think>I should call ' + _call('get_weather', city='Paris', days=2),
     {'calls': [WEATHER]}, 0.0, 'thinking block never closed'),
    # When no call is right.
    ('The capital of France is Paris.', {'calls': []}, 1.0, 'no call, as expected'),
    (_call('get_weather', city='Paris', days=2), {'calls': [], 'tools': TOOLS}, 0.0,
     "called 'get_weather' but no call was expected"),
    ('<tool_call>oops</tool_call>', {'calls': []}, 0.0, 'malformed tool call'),
]


@pytest.fixture(scope='module')
def verifier():
  with verifiers.get('tool_call') as v:
    yield v


def test_table_of_turns(verifier):
  results = verifier.score([S('q', c, md) for c, md, _, _ in CASES])
  for (completion, _, reward, reason), r in zip(CASES, results):
    assert (r.reward, r.info['reason'][:len(reason)]) == (reward, reason), (completion, r.info)


def test_arguments_given_as_a_json_string_count():
  body = json.dumps({'name': 'get_weather', 'arguments': json.dumps({'city': 'Paris', 'days': 2})})
  with verifiers.get('tool_call') as v:
    (r,) = v.score([S('q', f'<tool_call>{body}</tool_call>', {'calls': [WEATHER], 'tools': TOOLS})])
  assert r.reward == 1.0, r.info


def _weather_in(city):
  return {'name': 'get_weather', 'arguments': {'city': city, 'days': 2}}


@pytest.mark.parametrize('gold, cities', [
    # The first gold call takes the first city; it must give it up for the second.
    ([_weather_in({'$any_of': ['Paris', 'Rome']}), _weather_in('Paris')], ['Paris', 'Rome']),
    # The second gold call cannot take the first city from the first (it has no other).
    ([_weather_in('Paris'), _weather_in({'$any_of': ['Paris', 'Rome']})], ['Paris', 'Rome']),
    # A chain: the third call takes Paris from the second, which moves to Rome.
    ([_weather_in('Lyon'), _weather_in({'$any_of': ['Paris', 'Rome']}), _weather_in('Paris')],
     ['Lyon', 'Paris', 'Rome']),
])
def test_unordered_calls_find_a_full_matching(verifier, gold, cities):
  turn = ''.join(_call('get_weather', city=c, days=2) for c in cities)
  (r,) = verifier.score([S('q', turn, {'calls': gold})])
  assert r.reward == 1.0, r.info


def _nested(depth, leaf, kind):
  """`leaf` at nesting `depth` below the arguments object (which is depth 0)."""
  value = leaf
  for _ in range(depth - 1):
    value = {'list': [value], 'dict': {'k': value}, 'any_of': {'$any_of': [value]}}[kind]
  return {'x': value}


@pytest.mark.parametrize('kind', ['list', 'dict', 'any_of'])
def test_gold_nesting_is_bounded(verifier, kind):
  deepest = tool_call._MAX_DEPTH
  gold = {'name': 'f', 'arguments': _nested(deepest, 1, kind)}
  verifiers.validate('tool_call', {'calls': [gold]}, 'x')
  pred = _nested(deepest, 1, 'list' if kind == 'list' else 'dict')
  if kind == 'any_of':
    pred = {'x': 1}
  (r,) = verifier.score([S('q', _call('f', **pred), {'calls': [gold]})])
  assert r.reward == 1.0, r.info
  too_deep = {'name': 'f', 'arguments': _nested(deepest + 1, 1, kind)}
  with pytest.raises(ValueError, match=f'is nested deeper than {deepest}'):
    verifiers.validate('tool_call', {'calls': [too_deep]}, 'x')


@pytest.mark.parametrize('kind', ['list', 'dict', 'any_of'])
def test_comparison_depth_is_bounded_without_the_metadata_check(kind):
  # The verifier checks gold nesting first; compare_calls bounds its own recursion too.
  deepest = tool_call._MAX_DEPTH
  pred = {'x': 1} if kind == 'any_of' else _nested(deepest + 1, 1, kind)
  gold = [{'name': 'f', 'arguments': _nested(deepest + 1, 1, kind)}]
  why = tool_call.compare_calls(gold, [chat.ToolCall('f', pred)], {}, ordered=False)
  assert why.startswith('gold call 1 (f): arguments.x') and why.endswith(
      ': 1 is none of the accepted values' if kind == 'any_of' else ': nested too deeply')
  pred = {'x': 1} if kind == 'any_of' else _nested(deepest, 1, kind)
  gold = [{'name': 'f', 'arguments': _nested(deepest, 1, kind)}]
  assert tool_call.compare_calls(gold, [chat.ToolCall('f', pred)], {}, ordered=False) is None


def test_nested_objects_compare_recursively():
  gold = {'name': 'book', 'arguments': {'who': {'first': 'Ada', 'ids': [1, {'$any_of': [2, 3]}]}}}
  with verifiers.get('tool_call') as v:
    r = v.score([S('q', _call('book', who={'ids': [1.0, 3], 'first': 'Ada'}), {'calls': [gold]}),
                 S('q', _call('book', who={'ids': [1, 4], 'first': 'Ada'}), {'calls': [gold]})])
  assert [x.reward for x in r] == [1.0, 0.0]
  assert r[1].info['reason'] == ('gold call 1 (book): arguments.who.ids[1]: 4 is none of the '
                                 'accepted values')


@pytest.mark.parametrize('metadata, message', [
    ({}, r"metadata\['calls'\] is missing"),
    ({'calls': {'name': 'x'}}, r"metadata\['calls'\] must be list"),
    ({'calls': ['get_weather']}, r'metadata\["calls"\]\[0\] must be a dict'),
    ({'calls': [{'arguments': {}}]}, r'metadata\["calls"\]\[0\]\["name"\] must be a non-empty'),
    ({'calls': [{'name': 'f', 'arguments': '{}'}]},
     r'metadata\["calls"\]\[0\]\["arguments"\] must be a dict'),
    ({'calls': [{'name': 'f', 'args': {}}]}, r'metadata\["calls"\]\[0\] has unexpected keys'),
    ({'calls': [{'name': 'f', 'arguments': {'x': {'$any_of': []}}}]},
     r'metadata\["calls"\]\[0\]\["arguments"\]\[\'x\'\] must be \{"\$any_of"'),
    ({'calls': [{'name': 'f', 'arguments': {'x': float('nan')}}]}, r'metadata\["calls"\]\[0\]\["arguments"\]\[\'x\'\] is nan, not a JSON number'),
    ({'calls': [{'name': 'f', 'arguments': {'x': [1, float('inf')]}}]},
     r'metadata\["calls"\]\[0\]\["arguments"\]\[\'x\'\]\[1\] is inf, not a JSON number'),
    ({'calls': [{'name': 'f', 'arguments': {'x': {'$any_of': [1, float('nan')]}}}]},
     r'metadata\["calls"\]\[0\]\["arguments"\]\[\'x\'\]\["\$any_of"\]\[1\] is nan'),
    ({'calls': [{'name': 'f', 'arguments': {'x': {'$any_of': [1], 'y': 2}}}]},
     r'metadata\["calls"\]\[0\]\["arguments"\]\[\'x\'\] must be \{"\$any_of"'),
    ({'calls': [{'name': 'f', 'arguments': {'x': {1, 2}}}]},
     r'metadata\["calls"\]\[0\]\["arguments"\]\[\'x\'\] must be a JSON value, got set'),
    ({'calls': [], 'ordered': 'yes'}, r"metadata\['ordered'\] must be bool"),
    ({'calls': [], 'tools': {'name': 'f'}}, r"metadata\['tools'\] must be list"),
    ({'calls': [], 'tools': [{'type': 'function', 'function': {}}]},
     r'metadata\["tools"\]\[0\]: "name" must be a non-empty string'),
    ({'calls': [], 'tools': [{'type': 'function', 'function': {'name': ''}}]},
     r'metadata\["tools"\]\[0\]: "name" must be a non-empty string'),
    ({'calls': [], 'tools': [{'name': 5}]},
     r'metadata\["tools"\]\[0\]: "name" must be a non-empty string'),
    ({'calls': [], 'tools': [{'type': 'code_interpreter', 'name': 'python'}]},
     r'metadata\["tools"\]\[0\] must be \{"type": "function"'),
    ({'calls': [], 'tools': [{'type': 'web_search', 'name': 'search'}]},
     r'metadata\["tools"\]\[0\] must be \{"type": "function"'),
    ({'calls': [], 'tools': [TOOLS[0], TOOLS[0]]}, r'metadata\["tools"\]\[1\]: tool .* twice'),
    ({'calls': [], 'tools': [_tool('f', {'x': {'type': 'strin'}})]},
     r'metadata\["tools"\]: the parameters of \'f\' are not a valid JSON Schema'),
    ({'calls': [WEATHER], 'tools': TOOLS[1:]},
     r'metadata\["calls"\]\[0\] calls \'get_weather\', which is not in metadata\["tools"\]'),
    ({'calls': [WEATHER] * 17}, r'metadata\["calls"\] has 17 calls'),
])
def test_validate_names_the_field(metadata, message):
  with pytest.raises(ValueError, match=r'^rl/tool_calling.jsonl:9: ' + message):
    verifiers.validate('tool_call', metadata, 'rl/tool_calling.jsonl:9')


def test_valid_metadata_passes():
  verifiers.validate('tool_call', {'calls': [WEATHER, CONVERT], 'tools': TOOLS, 'ordered': False},
                     'x')
  verifiers.validate('tool_call', {'calls': [], 'tools': [TOOLS[0]['function']]}, 'x')
  verifiers.validate('tool_call', {'calls': [WEATHER] * 16}, 'x')
  verifiers.validate('tool_call', {'calls': [ALARM]}, 'x')
  # As read from a JSONL file: no string is the same object as a literal in the verifier.
  verifiers.validate('tool_call', json.loads(json.dumps({'calls': [WEATHER], 'tools': TOOLS})),
                     'x')


@pytest.mark.parametrize('text, reward', [
    ('<tool_call>' * 200_000, 0.0),
    (_call('get_weather', city='Paris', days=2) * 40_000, 0.0),
    ('<tool_call>{"name": "get_weather", "arguments": ' + '[' * 1_000_000 + '</tool_call>', 0.0),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "' + 'x' * 1_000_000
     + '"}}</tool_call>', 0.0),
    ('<tool_call>{"name": "f", "arguments": ' + '{"a": ' * 15_000 + '1' + '}' * 15_000
     + '}</tool_call>', 0.0),
    # Text around the calls does not matter; only the calls do.
    ('</think>' * 100_000 + _call('get_weather', city='Paris', days=2), 1.0),
])
def test_hostile_megabyte_turns_score_fast(verifier, text, reward):
  start = time.perf_counter()
  (r,) = verifier.score([S('q', text, {'calls': [WEATHER], 'tools': TOOLS})])
  assert time.perf_counter() - start < 0.5
  assert r.reward == reward, r.info


def test_deep_model_arguments_score_zero_without_raising(verifier):
  deep = '{"name": "get_weather", "arguments": {"city": ' + '[' * 900 + ']' * 900 + ', "days": 2}}'
  (r,) = verifier.score([S('q', f'<tool_call>{deep}</tool_call>', {'calls': [WEATHER]})])
  assert r.reward == 0.0 and 'arguments.city: expected' in r.info['reason'], r.info
