"""Chat template, thinking-block splitting, tool rendering and tool-call parsing."""

import json
import random
import re
import time

import pytest

from foundation import chat


def test_render_thinking_and_instruct():
  msgs = [{'role': 'system', 'content': 'be brief'}, {'role': 'user', 'content': 'hi'}]
  think = chat.render(msgs, thinking=True)
  assert think.endswith('<|im_start|>user\nhi /think<|im_end|>\n<|im_start|>assistant\n')
  assert think.startswith('<|im_start|>system\nbe brief<|im_end|>\n')
  inst = chat.render(msgs, thinking=False)
  assert inst.endswith('hi /no_think<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n')
  assert '/think' not in chat.render(msgs)


def test_multiturn_keeps_only_final_answers():
  msgs = [{'role': 'user', 'content': 'a'},
          {'role': 'assistant', 'content': '<think>secret</think>\n\nanswer one'},
          {'role': 'user', 'content': 'b'}]
  text = chat.render(msgs, thinking=True)
  assert 'secret' not in text and 'answer one' in text
  assert text.count('/think') == 1 and 'b /think' in text


def test_split_thinking():
  s = chat.split_thinking('<think>\nwork\n</think>\n\nThe answer<|im_end|>')
  assert (s.thinking, s.answer, s.finished_thinking, s.had_thinking) == (
      'work', 'The answer', True, True)
  s = chat.split_thinking('<think> still going')
  assert not s.finished_thinking and s.answer == '' and s.thinking == 'still going'
  s = chat.split_thinking('plain answer')
  assert s.finished_thinking and not s.had_thinking and s.answer == 'plain answer'
  s = chat.split_thinking('reasoning continued from prompt</think>final')
  assert s.answer == 'final' and s.thinking == 'reasoning continued from prompt'
  assert chat.render_response('x', 'why') == '<think>\nwhy\n</think>\n\nx<|im_end|>'


# -- tools -------------------------------------------------------------------

SEARCH = {'type': 'function',
          'function': {'name': 'search', 'description': 'Search the web. «Ünïcode»',
                       'parameters': {'type': 'object',
                                      'properties': {'query': {'type': 'string'}},
                                      'required': ['query']}}}
CLOCK = {'type': 'function', 'function': {'name': 'now', 'description': 'The time.',
                                          'parameters': {'type': 'object', 'properties': {}}}}

TOOLS_SECTION = (
    '# Tools\n\n'
    'You can call one or more of the functions below to help with the request.\n\n'
    'Their signatures follow, one JSON object per line, inside <tools></tools> tags:\n'
    '<tools>\n'
    '{"type": "function", "function": {"name": "search", "description": "Search the web. '
    '«Ünïcode»", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, '
    '"required": ["query"]}}}\n'
    '{"type": "function", "function": {"name": "now", "description": "The time.", '
    '"parameters": {"type": "object", "properties": {}}}}\n'
    '</tools>\n\n'
    'To call a function, write a JSON object with its name and arguments inside '
    '<tool_call></tool_call> tags:\n'
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def test_tools_go_in_the_system_turn():
  msgs = [{'role': 'system', 'content': 'be brief'}, {'role': 'user', 'content': 'hi'}]
  text = chat.render(msgs, thinking=True, tools=[SEARCH, CLOCK])
  assert text == (f'<|im_start|>system\nbe brief\n\n{TOOLS_SECTION}<|im_end|>\n'
                  '<|im_start|>user\nhi /think<|im_end|>\n<|im_start|>assistant\n')
  # Without a system message the tools section is the whole system turn.
  text = chat.render(msgs[1:], tools=[SEARCH, CLOCK])
  assert text == (f'<|im_start|>system\n{TOOLS_SECTION}<|im_end|>\n'
                  '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n')
  assert chat.render(msgs, tools=[]) == chat.render(msgs) == chat.render(msgs, tools=None)


def test_qwen3_tool_conversation_golden():
  msgs = [{'role': 'user', 'content': 'Weather in Oslo and the time?'},
          {'role': 'assistant', 'content': '<think>two tools</think>\n\nChecking.',
           'tool_calls': [{'name': 'search', 'arguments': {'query': 'Oslo weather'}},
                          chat.ToolCall('now', {})]},
          {'role': 'tool', 'name': 'search', 'content': 'rain, 4 °C'},
          {'role': 'tool', 'content': '10:00'},
          {'role': 'assistant', 'content': 'Rainy, 4 °C, at 10:00.'},
          {'role': 'user', 'content': 'thanks'}]
  text = chat.render(msgs, thinking=False, tools=[SEARCH, CLOCK])
  assert text == (
      f'<|im_start|>system\n{TOOLS_SECTION}<|im_end|>\n'
      '<|im_start|>user\nWeather in Oslo and the time?<|im_end|>\n'
      '<|im_start|>assistant\nChecking.\n'
      '<tool_call>\n{"name": "search", "arguments": {"query": "Oslo weather"}}\n</tool_call>\n'
      '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
      '<|im_start|>user\n<tool_response>\nrain, 4 °C\n</tool_response>\n'
      '<tool_response>\n10:00\n</tool_response><|im_end|>\n'
      '<|im_start|>assistant\nRainy, 4 °C, at 10:00.<|im_end|>\n'
      '<|im_start|>user\nthanks /no_think<|im_end|>\n'
      '<|im_start|>assistant\n<think>\n\n</think>\n\n')


def test_tool_calls_without_content_and_sampled_turns():
  call = chat.render_tool_call('now', {})
  only_calls = [{'role': 'assistant', 'content': '', 'tool_calls': [{'name': 'now'}]}]
  assert chat.render(only_calls, add_generation_prompt=False) == (
      f'<|im_start|>assistant\n{call}<|im_end|>\n')
  # Thinking is dropped even when nothing but the calls follows it.
  thought = [{'role': 'assistant', 'content': '<think>hm</think>',
              'tool_calls': [{'name': 'now', 'arguments': {}}]}]
  assert chat.render(thought, add_generation_prompt=False) == chat.render(
      only_calls, add_generation_prompt=False)
  # A sampled turn already holds its blocks: rendered as it is (less its thinking),
  # with or without the parsed calls alongside.
  sampled = f'<think>\nplan\n</think>\n\nLooking.\n{call}<|im_end|>'
  for extra in ({}, {'tool_calls': list(chat.parse_tool_calls(sampled).calls)}):
    text = chat.render([{'role': 'assistant', 'content': sampled, **extra}],
                       add_generation_prompt=False)
    assert text == f'<|im_start|>assistant\nLooking.\n{call}<|im_end|>\n'
  # Structured calls render exactly like the same calls written in the content.
  structured = [{'role': 'assistant', 'content': 'Looking.', 'tool_calls': [{'name': 'now'}]}]
  assert chat.render(structured) == chat.render(
      [{'role': 'assistant', 'content': f'Looking.\n{call}'}])


def test_thinking_switch_skips_tool_turns():
  msgs = [{'role': 'user', 'content': 'q'},
          {'role': 'assistant', 'content': '', 'tool_calls': [{'name': 'now'}]},
          {'role': 'tool', 'content': 'r'}]
  for mode, mark in ((True, ' /think'), (False, ' /no_think')):
    text = chat.render(msgs, thinking=mode)
    assert text.count(mark) == 1 and f'q{mark}<|im_end|>' in text
    assert '</tool_response><|im_end|>' in text
  assert chat.render(msgs, add_generation_prompt=False).endswith(
      '<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n')


def _episode(mode, tools):
  """A two-call episode: (incremental text, full re-render, [(sampled, re-rendered)]).

  `sampled` is a turn as the incremental text has it (prefill + sampled text);
  `re-rendered` is the same turn in the full re-render.
  """
  opening = [{'role': 'system', 'content': 'Use tools.'},
             {'role': 'user', 'content': 'Find the tide at Brest.'}]
  call1 = chat.render_tool_call('search', {'query': 'tide Brest'})
  call2 = chat.render_tool_call('now', {})
  think = (lambda s: f'<think>\n{s}\n</think>\n\n') if mode is not False else (lambda s: '')
  turns = [f'{think("search first")}Let me look.\n{call1}<|im_end|>',
           f'{think("then the time")}{call2}<|im_end|>']
  answers = [f'Let me look.\n{call1}', call2]
  obs = [[{'role': 'tool', 'name': 'search', 'content': 'high tide 14:02\nlow 20:15'},
          {'role': 'tool', 'name': 'error', 'content': 'error: more than 1 call'}],
         [{'role': 'tool', 'name': 'now', 'content': '13:00'}]]
  incremental = chat.render(opening, thinking=mode, tools=tools)
  convo = list(opening)
  for turn, ob in zip(turns, obs):
    incremental += turn + chat.render_observation(ob, thinking=mode)
    convo += [{'role': 'assistant', 'content': turn}, *ob]
  full = chat.render(convo, thinking=mode, tools=tools)
  prefill = '<|im_start|>assistant\n' + (chat.EMPTY_THINK if mode is False else '')
  pairs = [(prefill + t, f'<|im_start|>assistant\n{a}<|im_end|>') for t, a in zip(turns, answers)]
  return incremental, full, pairs


@pytest.mark.parametrize('tools', [None, [SEARCH, CLOCK]])
@pytest.mark.parametrize('mode', [True, False, None])
def test_incremental_episode_matches_full_render(mode, tools):
  incremental, full, pairs = _episode(mode, tools)
  # They differ only where the docstring says: each earlier assistant turn keeps
  # its (pre-filled or sampled) thinking block in the incremental text.
  expected = incremental
  for sampled, rerendered in pairs:
    assert expected.count(sampled) == 1
    expected = expected.replace(sampled, rerendered)
  assert full == expected
  assert incremental.startswith(chat.render([{'role': 'system', 'content': 'Use tools.'}],
                                            tools=tools, add_generation_prompt=False))
  tail = chat.render_observation([{'role': 'tool', 'content': '13:00'}], thinking=mode)
  assert full.endswith(tail) and incremental.endswith(tail)
  # Every turn's calls parse back from the sampled text.
  assert [c.name for s, _ in pairs for c in chat.parse_tool_calls(s).calls] == ['search', 'now']


def test_render_observation():
  obs = [{'role': 'tool', 'content': 'a'}, {'role': 'tool', 'content': 'b', 'name': 'f'}]
  assert chat.render_observation(obs) == (
      '\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n'
      '<tool_response>\nb\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
  assert chat.render_observation(obs, thinking=True) == chat.render_observation(obs)
  assert chat.render_observation(obs, thinking=False).endswith(
      '<|im_start|>assistant\n<think>\n\n</think>\n\n')
  with pytest.raises(ValueError, match='no tool messages'):
    chat.render_observation([])
  with pytest.raises(ValueError, match=r"message 1: role 'user'"):
    chat.render_observation([obs[0], {'role': 'user', 'content': 'x'}])
  with pytest.raises(ValueError, match='message 0: content must be a string'):
    chat.render_observation([{'role': 'tool', 'content': None}])


@pytest.mark.parametrize('messages, tools, match', [
    ([{'role': 'bot', 'content': 'x'}], None, r"message 0: role 'bot'"),
    ([{'role': 'user', 'content': 'x'}, {'role': 'user', 'content': 3}], None,
     'message 1: content must be a string, got int'),
    ([{'role': 'user'}], None, 'message 0: content must be a string, got NoneType'),
    (['hi'], None, 'message 0: expected a dict'),
    ([{'role': 'tool', 'content': 'x', 'name': 3}], None, 'message 0: name must be a string'),
    ([{'role': 'user', 'content': 'x', 'tool_calls': []}], None, 'message 0: tool_calls: only'),
    ([{'role': 'assistant', 'content': '', 'tool_calls': {'name': 'f'}}], None,
     'message 0: tool_calls must be a list, got dict'),
    ([{'role': 'assistant', 'content': '', 'tool_calls': ['f']}], None,
     r'message 0: tool_calls\[0\] must be a dict'),
    ([{'role': 'assistant', 'content': '', 'tool_calls': [{'arguments': {}}]}], None,
     r'message 0: tool_calls\[0\]: name must be a non-empty string'),
    ([{'role': 'user', 'content': ''},
      {'role': 'assistant', 'content': '', 'tool_calls': [{'name': 'f'}, {'name': 'g',
                                                                          'arguments': '{}'}]}],
     None, r'message 1: tool_calls\[1\]: arguments must be a dict, got str'),
    ([{'role': 'assistant', 'content': '', 'tool_calls': [{'name': 'f',
                                                           'arguments': {'x': float('nan')}}]}],
     None, r'message 0: tool_calls\[0\]: arguments: not JSON-serialisable'),
    ([{'role': 'assistant', 'content': '', 'tool_calls': [{'name': 'f',
                                                           'arguments': {'x': object()}}]}],
     None, r'message 0: tool_calls\[0\]: arguments: not JSON-serialisable'),
    ([], [{'type': 'function', 'function': {'description': 'no name'}}],
     r'tools\[0\]: function.name must be a non-empty string'),
    ([], [SEARCH, {'name': 'flat', 'parameters': {}}], r'tools\[1\]: function.name'),
    ([], [SEARCH, SEARCH], r"tools\[1\]: function.name 'search' repeats tools\[0\]"),
    ([], [{'type': 'retrieval', 'function': {'name': 'f'}}], r'tools\[0\]: type must be'),
    ([], [{'type': 'function', 'function': {'name': 'f', 'parameters': 'x'}}],
     r'tools\[0\]: function.parameters'),
    ([], SEARCH, 'tools must be a list'),
])
def test_render_errors(messages, tools, match):
  with pytest.raises(ValueError, match=match):
    chat.render(messages, tools=tools)


# -- render_tool_call / parse_tool_calls --------------------------------------

def _random_json(rng, depth=0):
  atoms = [lambda: rng.randint(-10**12, 10**12), lambda: rng.uniform(-1e6, 1e6),
           lambda: rng.choice([True, False, None, 0, -0.5, 1e-300, 2**63]),
           lambda: _random_text(rng)]
  if depth >= 4 or rng.random() < 0.4:
    return rng.choice(atoms)()
  if rng.random() < 0.5:
    return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
  return {_random_text(rng): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _random_text(rng):
  pieces = ['a', 'Z9', ' ', '"', "'", '\\', '\n', '\t', '\r\n', '{', '}]', 'é', '東京', '🙂',
            '\u2028', '\x00', '</tool_call>', '<tool_call>', '</think>', '<think>',
            '<|im_end|>', '<|im_start|>', '<tool_response>', '<', '\\u003c', '/']
  return ''.join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))


def test_render_tool_call_round_trips():
  rng = random.Random(0)
  assert chat.render_tool_call('f', {'x': [1, 'é']}) == (
      '<tool_call>\n{"name": "f", "arguments": {"x": [1, "é"]}}\n</tool_call>')
  for _ in range(500):
    name = _random_text(rng) or 'f'
    args = {_random_text(rng): _random_json(rng) for _ in range(rng.randint(0, 5))}
    block = chat.render_tool_call(name, args)
    # No marker but the block's own two appears: an argument cannot end the
    # block, the thinking or the turn.
    assert block.startswith('<tool_call>\n') and block.endswith('\n</tool_call>')
    body = block[len('<tool_call>\n'):-len('\n</tool_call>')]
    assert not [m for m in chat.SPECIAL_TOKENS + chat.TOOL_TOKENS if m in body]
    turn = chat.parse_tool_calls(f'Calling.\n{block}<|im_end|>')
    assert turn.errors == () and turn.content == 'Calling.'
    assert [(c.name, c.arguments) for c in turn.calls] == [(name, args)]
  with pytest.raises(ValueError, match='name must be a non-empty string'):
    chat.render_tool_call('', {})
  with pytest.raises(ValueError, match='arguments must be a dict, got list'):
    chat.render_tool_call('f', [1])


def _call(name='f', **args):
  return '<tool_call>\n' + json.dumps({'name': name, 'arguments': args}) + '\n</tool_call>'


def test_parse_well_formed_calls():
  turn = chat.parse_tool_calls(_call('search', query='x') + '<|im_end|>')
  assert turn.calls == (chat.ToolCall('search', {'query': 'x'}),)
  assert (turn.errors, turn.content, turn.is_tool_turn, turn.finished_thinking) == (
      (), '', True, True)
  text = f'<think>\nplan\n</think>\n\nFirst,\n{_call("a", n=1)}\nthen\n{_call("b")}\ndone.'
  turn = chat.parse_tool_calls(text)
  assert [(c.name, c.arguments) for c in turn.calls] == [('a', {'n': 1}), ('b', {})]
  assert turn.errors == () and turn.content == 'First,\n\nthen\n\ndone.'
  # Arguments left out mean {}; arguments written as a JSON string are decoded.
  as_string = json.dumps({'name': 'g', 'arguments': json.dumps({'k': [1]})})
  turn = chat.parse_tool_calls(
      f'<tool_call>{{"name": "f"}}</tool_call><tool_call>{as_string}</tool_call>')
  assert [(c.name, c.arguments) for c in turn.calls] == [('f', {}), ('g', {'k': [1]})]


def test_parse_ignores_calls_inside_thinking():
  turn = chat.parse_tool_calls(f'<think>maybe {_call("f")}?</think>\n\nNo tools needed: 4.')
  assert turn.calls == () and turn.errors == () and not turn.is_tool_turn
  assert turn.content == 'No tools needed: 4.'
  turn = chat.parse_tool_calls(f'<think>still thinking {_call("f")}')
  assert turn.calls == () and not turn.finished_thinking and turn.content == ''


@pytest.mark.parametrize('body, error', [
    ('{"name": "f", "arguments": {', 'not valid JSON'),
    ('not json at all', 'not valid JSON'),
    ('{"arguments": {}}', '"name" must be a non-empty string'),
    ('{"name": "", "arguments": {}}', '"name" must be a non-empty string'),
    ('{"name": 3}', '"name" must be a non-empty string'),
    ('{"name": "f", "arguments": "not json"}', 'is a string that is not a JSON object'),
    ('{"name": "f", "arguments": "[1, 2]"}', 'must be a JSON object, got list'),
    ('{"name": "f", "arguments": [1]}', 'must be a JSON object, got list'),
    ('{"name": "f", "arguments": 7}', 'must be a JSON object, got int'),
    ('{"name": "f", "arguments": {"x": NaN}}', 'NaN is not JSON'),
    ('["f", {}]', 'expected a JSON object, got list'),
    ('{"name": "f", "arguments": {}, "id": 1}', r"unexpected keys \['id'\]"),
    ('{"name": "f", "arguments": {"x": "' + 'y' * chat.MAX_TOOL_CALL_CHARS + '"}}',
     f'longer than {chat.MAX_TOOL_CALL_CHARS} characters'),
    ('{"name": "f", "arguments": ' + '[' * 9000 + ']' * 9000 + '}', 'nested too deeply'),
])
def test_parse_malformed_calls_are_errors(body, error):
  turn = chat.parse_tool_calls(f'Before.\n<tool_call>\n{body}\n</tool_call>\n{_call("ok")}')
  assert [c.name for c in turn.calls] == ['ok']
  assert len(turn.errors) == 1 and turn.errors[0].startswith('tool call 1: ')
  assert re.search(error, turn.errors[0]), turn.errors[0]
  assert turn.is_tool_turn and turn.content == 'Before.'


def test_parse_unclosed_and_too_many_calls():
  turn = chat.parse_tool_calls(f'Text {_call("a")} more <tool_call>{{"name": "b"}}')
  assert [c.name for c in turn.calls] == ['a']
  assert turn.errors == ('tool call 2: <tool_call> is never closed by </tool_call>',)
  assert turn.content == 'Text  more' and turn.is_tool_turn
  many = '\n'.join(_call(f'f{i}') for i in range(chat.MAX_TOOL_CALLS + 3)) + '\ntail'
  turn = chat.parse_tool_calls(many)
  assert len(turn.calls) == chat.MAX_TOOL_CALLS
  assert turn.errors == (f'tool call {chat.MAX_TOOL_CALLS + 1}: more than '
                         f'{chat.MAX_TOOL_CALLS} calls in one turn',)
  assert turn.content.endswith('tail')
  assert chat.parse_tool_calls('') == chat.Turn(content='', calls=(), errors=())


@pytest.mark.parametrize('text', [
    '<tool_call>' * 90_000,                                   # ~1 MB, never closed
    '<tool_call></tool_call>' * 45_000,                       # ~1 MB of empty calls
    '<tool_call>' * 90_000 + '</tool_call>',                  # one 1 MB body
    '<tool_call>{"name": "f", "arguments": ' + '[' * 1_000_000 + '</tool_call>',
    '<tool_call>{"name": "f", "arguments": ' + '{"a":' * 3_200 + '1' + '}' * 3_201
    + '</tool_call>',                                          # deep, under the size bound
    '<think>' * 100_000 + '</think>' * 100_000,
])
def test_parse_hostile_inputs_are_fast(text):
  start = time.perf_counter()
  turn = chat.parse_tool_calls(text)
  assert time.perf_counter() - start < 0.5
  assert isinstance(turn, chat.Turn)
