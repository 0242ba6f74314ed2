"""envs.tool_use and the tiny world's tool-use domain: tools, episodes, scoring, demonstrations."""

import fractions
import json
import os
import random
import re
import time

import pytest

from envs import base
from envs import tool_use
import envs
from foundation import chat
from tiny_world import common
from tiny_world import tool_tasks
from verifiers import base as verifier_base

F = fractions.Fraction
TABLE = {'lamp': 412, 'Cup': 35, 'kite': 'sold out'}
ROWS = {'lamp': {'price': 412, 'stock': 3}, 'cup': {'price': 35, 'stock': 0}}


@pytest.fixture(scope='module')
def env():
  with envs.get('tool_use', verifier_options={'workers': 1}) as e:
    yield e


def _record(answer='412', **metadata):
  return {'id': 'r', 'domain': 'tool_use', 'messages': [{'role': 'user', 'content': 'q?'}],
          'metadata': dict(answer=answer, **metadata)}


def _call(name, **arguments):
  return tool_tasks.tool_call(name, **arguments)


# -- calculator ----------------------------------------------------------------


def _random_expression(rng, depth):
  """(text, exact value or None when it divides by zero), built beside Fraction arithmetic."""
  if depth == 0 or rng.random() < 0.25:
    if rng.random() < 0.5:
      n = rng.randint(0, 10 ** rng.randint(1, 6))
      return str(n), F(n)
    whole, digits = rng.randint(0, 999), rng.randint(1, 4)
    frac = rng.randint(0, 10 ** digits - 1)
    text = f'{whole}.{frac:0{digits}d}'
    return text, F(whole) + F(frac, 10 ** digits)
  if rng.random() < 0.15:
    text, value = _random_expression(rng, depth - 1)
    return f'-({text})', None if value is None else -value
  op = rng.choice(['+', '-', '*', '/', '//', '%', '**'])
  left, lv = _random_expression(rng, depth - 1)
  if op == '**':
    exponent = rng.randint(-3, 3)
    right, rv = str(exponent), F(exponent)
  else:
    right, rv = _random_expression(rng, depth - 1)
  text = f'({left}) {op} ({right})'
  if lv is None or rv is None:
    return text, None
  try:
    value = {'+': lambda: lv + rv, '-': lambda: lv - rv, '*': lambda: lv * rv,
             '/': lambda: lv / rv, '//': lambda: F(lv // rv), '%': lambda: lv % rv,
             '**': lambda: lv ** int(rv)}[op]()
  except ZeroDivisionError:
    return text, None
  return text, value


def test_calculator_matches_fraction_arithmetic_on_random_expressions():
  rng = random.Random(0)
  checked = 0
  for _ in range(400):
    text, value = _random_expression(rng, 4)
    if len(text) > tool_use.MAX_EXPRESSION_CHARS:
      continue
    if value is None:
      with pytest.raises(base.ToolError, match='division by zero'):
        tool_use.calculate(text)
      continue
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > tool_use.MAX_BITS:
      continue
    assert tool_use.evaluate(text) == value, text
    shown = tool_use.calculate(text)
    if value.denominator == 1:
      assert shown == str(value.numerator), text
    else:
      assert re.fullmatch(r'-?\d+(\.\d{1,6})?', shown), shown
      assert abs(F(shown) - value) <= F(1, 2 * 10 ** tool_use.DECIMAL_PLACES), (text, shown)
    checked += 1
  assert checked > 300


@pytest.mark.parametrize('expression, shown', [
    ('347 * 29', '10063'), ('2 + 3 * 4 ** 2', '50'), ('-2 ** 2', '-4'), ('2 ** -2', '0.25'),
    ('0.1 + 0.2', '0.3'), ('1 / 3 * 3', '1'), ('1 / 3', '0.333333'), ('2 / 3', '0.666667'),
    ('-5 / 2', '-2.5'), ('7 // 2', '3'), ('-7 // 2', '-4'), ('-7 % 3', '2'), ('7.5 % 2', '1.5'),
    ('((1.5)) * 4', '6'), ('  12  ', '12'), ('.5 + 1.', '1.5'), ('0 ** 0', '1'),
    ('(-1) ** 9999', '-1'), ('+'.join(['1'] * 400), '400'), ('-' * 300 + '7', '7')])
def test_calculator_values(expression, shown):
  assert tool_use.calculate(expression) == shown


@pytest.mark.parametrize('expression, error', [
    ('1 / 0', 'division by zero'), ('5 // (2 - 2)', 'division by zero'), ('3 % 0', 'division'),
    ('0 ** -1', 'division by zero'), ('2 ** 0.5', 'non-integer exponent'),
    ('abs(1)', 'unsupported syntax'), ('__import__("os")', 'unsupported syntax'),
    ('1e5', 'unsupported syntax'), ('1_000', 'unsupported syntax'), ('3 < 4', 'unsupported'),
    ('...', 'unsupported syntax'), ('(1, 2)', 'unsupported syntax'), ('1 +', 'unsupported'),
    ('007', 'unsupported syntax'), ('', 'empty expression'), ('1\n+1', 'unsupported syntax')])
def test_calculator_errors_are_tool_errors(expression, error):
  with pytest.raises(base.ToolError, match=error):
    tool_use.calculate(expression)


@pytest.mark.parametrize('expression', [
    '9 ** 9 ** 9', '2 ** 2 ** 2 ** 2 ** 2', '10 ** 10000', '(10 ** 1000) ** 1000',
    '(' + '9' * 300 + ') ** 14', '9' * 999, '9' * 500 + '*' + '9' * 499,
    '*'.join(['999999999'] * 100), '(' * 199 + '1' + ')' * 199, '(' * 300 + '1' + ')' * 300,
    '-' * 999 + '1', '1/' * 499 + '7', '0.' + '0' * 997 + '1',
    'x' * 100_000, '1' * 100_000, '(' * 100_000, '2**' * 33_000 + '2'])
def test_hostile_expressions_end_quickly(expression):
  # CPU time of this process, which a loaded host does not inflate; the wall clock only
  # must not hang.
  start, cpu = time.monotonic(), time.process_time()
  try:
    shown = tool_use.calculate(expression)
  except base.ToolError as e:
    shown = f'error: {e}'
  assert time.process_time() - cpu < 1.0, expression[:80]
  assert time.monotonic() - start < 10.0, expression[:80]
  assert len(shown) < 1300


# -- lookup --------------------------------------------------------------------


def test_lookup_reads_entries_and_columns():
  assert tool_use.lookup(TABLE, 'lamp') == '412'
  assert tool_use.lookup(TABLE, ' CUP ') == '35'
  assert tool_use.lookup(TABLE, 'kite') == 'sold out'
  assert tool_use.lookup(ROWS, 'cup', 'Stock') == '0'
  assert json.loads(tool_use.lookup(ROWS, 'lamp')) == {'price': 412, 'stock': 3}
  with pytest.raises(base.ToolError) as e:
    tool_use.lookup(TABLE, 'sofa')
  assert str(e.value) == "no entry 'sofa'"  # Names nothing in the table.
  with pytest.raises(base.ToolError, match="no column 'color'"):
    tool_use.lookup(ROWS, 'lamp', 'color')
  with pytest.raises(base.ToolError, match='has no columns'):
    tool_use.lookup(TABLE, 'lamp', 'price')


def test_tools_offered_per_record(env):
  names = lambda rec: [t['function']['name'] for t in env.tools(rec)]
  assert names(_record()) == ['calculator', 'python']
  assert names(_record(table=TABLE)) == ['calculator', 'lookup', 'python']
  assert names(_record(table=TABLE, tools=['lookup'])) == ['lookup']
  lookup_props = lambda rec: env.tools(rec)[0]['function']['parameters']['properties']
  assert set(lookup_props(_record(table=TABLE, tools=['lookup']))) == {'key'}
  assert set(lookup_props(_record(table=ROWS, tools=['lookup']))) == {'key', 'column'}


@pytest.mark.parametrize('metadata, field', [
    ({}, 'metadata["answer"] is missing'), ({'answer': ' '}, 'metadata["answer"]'),
    ({'answer': True}, 'metadata["answer"]'), ({'answer': '1', 'table': []}, 'metadata["table"]'),
    ({'answer': '1', 'table': {}}, 'metadata["table"]'),
    ({'answer': '1', 'table': {'a': [1]}}, "metadata[\"table\"]['a']"),
    ({'answer': '1', 'table': {'a': {'p': None}}}, "metadata[\"table\"]['a']['p']"),
    ({'answer': '1', 'table': {'': 1}}, 'non-empty string'),
    ({'answer': '1', 'tools': 'calculator'}, 'metadata["tools"]'),
    ({'answer': '1', 'tools': ['calculator', 'shell']}, 'metadata["tools"][1]'),
    ({'answer': '1', 'tools': ['lookup']}, 'metadata["table"] is missing'),
    ({'answer': '1', 'tools': ['python', 'python']}, 'twice')])
def test_metadata_errors_name_the_field(metadata, field):
  with pytest.raises(ValueError) as e:
    tool_use.ToolUseEnv.validate_metadata(metadata, 'data/t.jsonl:3')
  assert str(e.value).startswith('data/t.jsonl:3: ') and field in str(e.value), str(e.value)


def test_metadata_of_every_task_kind_is_valid():
  for r in tool_tasks.prompt_records(0, 30, common.TRAIN):
    tool_use.ToolUseEnv.validate_metadata(r['metadata'], r['id'])


# -- episodes ------------------------------------------------------------------


def test_malformed_calls_unknown_tools_and_bad_arguments_are_observations(env):
  rec = _record(table=TABLE, tools=['lookup', 'calculator'])
  (ep,) = env.reset([rec])
  action = '\n'.join([
      '<tool_call>\n{"name": "lookup", "arguments": {"key": "lamp"}\n</tool_call>',   # Bad JSON.
      _call('python', code='print(1)'),                   # Not offered to this record.
      _call('lookup'),                                    # Missing key.
      _call('lookup', key='lamp', color='red'),           # Extra argument.
  ])
  (step,) = env.step([ep], [action])
  assert not step.done and len(step.messages) == 4
  assert all(m['role'] == 'tool' and m['content'].startswith('error: ') for m in step.messages)
  assert 'not valid JSON' in step.messages[0]['content']
  assert "unknown tool 'python'" in step.messages[1]['content']
  assert 'key' in step.messages[2]['content'] and 'color' in step.messages[3]['content']
  assert (ep.tool_calls, ep.tool_errors) == (0, 4)
  (step,) = env.step([ep], ['\n'.join([_call('calculator', expression=5), _call('lookup', key='x'),
                                       _call('calculator', expression='1/0'),
                                       _call('calculator', expression='6*7'),
                                       _call('lookup', key='lamp')])])
  contents = [m['content'] for m in step.messages]
  assert contents[0].startswith('error: calculator: expression: 5 is not of type')
  assert contents[1:4] == ["error: no entry 'x'", 'error: division by zero', '42']
  assert 'more than 4 tool calls' in contents[4]
  assert (ep.tool_calls, ep.tool_errors, ep.turns) == (1, 8, 2)
  assert ep.messages[-5:] == list(step.messages)


def _problems():
  """One task of each kind, drawn as the world draws them."""
  rng, found = random.Random(1), {}
  while len(found) < len(tool_tasks.KINDS):
    p = tool_tasks.realize(tool_tasks.draw_key(rng), rng)
    found.setdefault(p.key[0], p)
  return [found[k] for k in tool_tasks.KINDS]


def _play(env, problems, flaws, final=None):
  """Runs the scripted agent; `final` replaces its last turn. Returns the ended steps."""
  records = [common.prompt_record(tool_tasks.DOMAIN, f'p{i}', p) for i, p in enumerate(problems)]
  episodes = env.reset(records)
  results = [[] for _ in problems]
  ended = [None] * len(problems)
  while not all(ep.done for ep in episodes):
    live = [i for i, ep in enumerate(episodes) if not ep.done]
    actions = []
    for i in live:
      action = tool_tasks.next_action(problems[i], flaws[i], results[i])
      if final is not None and not chat.parse_tool_calls(action).is_tool_turn:
        action = final(problems[i])
      actions.append(action)
    for i, step in zip(live, env.step([episodes[i] for i in live], actions)):
      if step.done:
        ended[i] = step
      else:
        results[i].append([m['content'] for m in step.messages])
  return episodes, ended


def test_scripted_episodes_of_every_kind_earn_1_and_wrong_answers_0(env):
  problems = _problems()
  episodes, ended = _play(env, problems, [None] * 3)
  assert [s.reward for s in ended] == [1.0, 1.0, 1.0], [s.info for s in ended]
  assert [ep.turns for ep in episodes] == [2, 2, 3]
  assert [ep.tool_calls for ep in episodes] == [1, 1, 3]
  assert all(ep.tool_errors == 0 for ep in episodes)
  assert all(s.info['reason'] == 'equivalent' for s in ended)
  wrong = lambda p: f'The answer is {int(p.metadata["answer"]) + 1}.'
  _, ended = _play(env, problems, [None] * 3, final=wrong)
  assert [s.reward for s in ended] == [0.0, 0.0, 0.0]
  _, ended = _play(env, problems, [None] * 3, final=lambda p: 'I do not know.')
  assert [s.reward for s in ended] == [0.0, 0.0, 0.0]
  assert all('no final answer' in s.info['reason'] for s in ended)


def test_finish_and_unfinished_thinking_score_0(env):
  rec = _record(table=TABLE)
  episodes = env.reset([rec, rec])
  steps = env.finish(episodes, ['max_turns', 'max_tokens'])
  assert [(s.done, s.reward) for s in steps] == [(True, 0.0), (True, 0.0)]
  assert steps[0].info == {'reason': 'no final answer', 'cut': 'max_turns'}
  (ep,) = env.reset([rec])
  (step,) = env.step([ep], ['<think>the lamp costs 412 so The answer is 412.'])
  assert step.done and step.reward == 0.0 and step.info['reason'] == 'no final answer'
  (ep,) = env.reset([rec])
  (step,) = env.step([ep], ['<think>\nlook it up\n</think>\n\nThe answer is 412.<|im_end|>'])
  assert step.done and step.reward == 1.0


def test_registry_and_options():
  assert envs.cls('tool_use') is tool_use.ToolUseEnv
  with pytest.raises(ValueError, match='isolation'):
    tool_use.ToolUseEnv(isolation='docker')
  with pytest.raises(ValueError, match='timeout_s'):
    tool_use.ToolUseEnv(timeout_s=0)
  with pytest.raises(ValueError, match='workers'):
    tool_use.ToolUseEnv(workers=0)
  with pytest.raises(ValueError, match='unknown verifier'):
    tool_use.ToolUseEnv(answer_verifier='nope')


# -- python --------------------------------------------------------------------


@pytest.fixture(scope='module')
def py_env():
  with tool_use.ToolUseEnv(workers=2, timeout_s=2.0, verifier_options={'workers': 1}) as e:
    yield e


def test_python_runs_in_the_sandbox_and_returns_stdout(bwrap_sandbox, py_env):
  rec = _record(tools=['python'])
  episodes = py_env.reset([rec] * 4)
  assert py_env.sandbox is None  # Started by the first python call only.
  steps = py_env.step(episodes, [
      _call('python', code='print(6 * 7)\nprint("done")\n'),
      _call('python', code='while True:\n    pass\n'),
      _call('python', code='import sys\nprint("before")\nsys.exit("bad input")\n'),
      _call('python', code='x = 1\n')])
  assert py_env.sandbox is not None and py_env.sandbox.isolation == 'bwrap'
  contents = [s.messages[0]['content'] for s in steps]
  assert contents[0] == '42\ndone'
  assert contents[1].startswith('error: timeout: killed after 2.00s')
  assert contents[2].startswith('error: runtime_error: ') and 'bad input' in contents[2]
  assert contents[2].endswith('stdout:\nbefore\n')
  assert contents[3] == '(no output)'
  assert [(ep.tool_calls, ep.tool_errors) for ep in episodes] == [(1, 0), (0, 1), (0, 1), (1, 0)]
  (step,) = py_env.step([episodes[0]], [_call('python', code='print("x" * 100000)')])
  shown = step.messages[0]['content']
  assert shown.startswith('[... first 97001 bytes of output cut]\n') and len(shown) < 4000


def test_python_cannot_reach_other_episodes_or_the_host(bwrap_sandbox, py_env, tmp_path):
  rec = _record(table=TABLE, tools=['python'])
  # Two episodes at once (two servers), then the other way round on reused servers.
  write = ('import os, time\nopen("state.txt", "w").write("secret")\ntime.sleep(1.0)\n'
           'print("wrote")\n')
  look = ('import os, time\ntime.sleep(0.3)\n'
          'print(os.listdir("."), os.path.exists(os.path.abspath("state.txt")))\n')
  a, b = py_env.reset([rec, rec])
  steps = py_env.step([a, b], [_call('python', code=write), _call('python', code=look)])
  assert [s.messages[0]['content'] for s in steps] == ['wrote', '[] False']
  steps = py_env.step([a, b], [_call('python', code=look), _call('python', code=look)])
  assert [s.messages[0]['content'] for s in steps] == ['[] False', '[] False']
  secret = tmp_path / 'secret.txt'
  secret.write_text('x')
  # Host files: the checkout's (its venv's parent directories exist, nothing else of it), /etc's
  # and the host's /tmp.
  host = [p for p in (tool_use.__file__, os.path.join(verifier_base.PACKAGE_PARENT, 'envs'),
                      '/etc/passwd', '/etc/hostname', str(secret)) if os.path.exists(p)]
  assert len(host) >= 4
  probe = f'import os\nprint([os.path.exists(p) for p in {host!r}])\nprint(os.listdir("."))\n'
  steps = py_env.step([a, b], [_call('python', code=probe)] * 2)
  for s in steps:
    assert s.messages[0]['content'] == f'{[False] * len(host)}\n[]', s.messages[0]['content']


_LEAVE = r"""
import os, struct
acl = struct.pack('<I', 2) + b''.join(struct.pack('<HHI', t, 0, 0xFFFFFFFF) for t in (1, 4, 32))
for call, args in ((os.setxattr, ('.', 'user.note', b'for the next episode')),
                   (os.setxattr, ('.', 'system.posix_acl_default', acl)),
                   (os.utime, ('.', (1, 2))), (os.chmod, ('.', 0o700))):
    try:
        call(*args)
    except OSError as e:
        print(call.__name__, e.strerror)
"""
_LOOK = r"""
import os, stat, time
st = os.stat('.')
open('new.txt', 'w').close()
print(os.listxattr('.'), oct(stat.S_IMODE(st.st_mode)), st.st_mtime > time.time() - 60,
      oct(stat.S_IMODE(os.stat('new.txt').st_mode)))
"""


def test_python_calls_leave_no_metadata_for_later_episodes(bwrap_sandbox, py_env):
  """Extended attributes, a default ACL, times and the mode of the work dir: refused or gone."""
  rec = _record(tools=['python'])
  a, b, c, d = py_env.reset([rec] * 4)
  # Two calls at once: one on each of the two servers.
  left = py_env.step([a, b], [_call('python', code=_LEAVE)] * 2)
  looked = py_env.step([c, d], [_call('python', code=_LOOK)] * 2)
  assert [s.messages[0]['content'] for s in looked] == ['[] 0o755 True 0o644'] * 2
  assert [s.messages[0]['content'] for s in left] == [
      'setxattr Operation not permitted\n' * 2 + 'utime Operation not permitted'] * 2


# -- the tiny world's tool-use domain -------------------------------------------


def test_demonstrations_replay_through_the_environment(env):
  records = tool_tasks.sft_records(0, 60, flaw_rate=0.5)
  assert [r['id'] for r in records] == [f'tool_use/sft/{i:05d}' for i in range(60)]
  flawed = sum(bool(r.get('flawed')) for r in records)
  assert 15 <= flawed <= 45
  for rec in records:
    (ep,) = env.reset([rec])
    turns = rec['turns']
    k = 0
    while True:
      action = turns[k]
      assert action['role'] == 'assistant'
      turn = chat.parse_tool_calls(action['content'])
      (step,) = env.step([ep], [action['content']])
      k += 1
      if step.done:
        break
      assert turn.calls and not turn.errors
      for block, call in zip(re.findall(r'<tool_call>\n(.*?)\n</tool_call>', action['content']),
                             turn.calls):
        assert block == json.dumps({'name': call.name, 'arguments': call.arguments})
      assert list(step.messages) == turns[k:k + len(step.messages)]  # Byte-identical results.
      k += len(step.messages)
    assert k == len(turns), rec
    assert step.reward == (0.0 if rec.get('flawed') else 1.0), rec
    assert ep.tool_errors == 0


def test_flaws_cover_each_mistake():
  problems = _problems()
  rng = random.Random(0)
  seen = set()
  for _ in range(60):
    for p in problems:
      flaw = tool_tasks._draw_flaw(p, rng)  # pylint: disable=protected-access
      seen.add((p.key[0], flaw[0]))
  flaws = tool_tasks._FLAWS  # pylint: disable=protected-access
  assert seen == {(k, f) for k, fs in flaws.items() for f in fs}


def _split_key(record):
  md = record['metadata']
  if 'table' in md:
    return 'table', tuple(sorted(md['table']))
  a, op, b = re.fullmatch(r'What is (\d+) ([+*]) (\d+)\?',
                          record['messages'][0]['content']).groups()
  return 'calc', op, int(a), int(b)


def test_train_and_heldout_are_disjoint_and_sft_and_rl_distinct():
  train = tool_tasks.prompt_records(0, 300, common.TRAIN)
  sft = tool_tasks.sft_records(0, 100)
  held = tool_tasks.prompt_records(0, 100, common.HELDOUT)
  held_other_seed = tool_tasks.prompt_records(1, 100, common.HELDOUT)
  train_keys = {_split_key(r) for r in train + sft}
  held_keys = {_split_key(r) for r in held + held_other_seed}
  assert not train_keys & held_keys
  for key in held_keys:
    assert common.split_of(tool_tasks.DOMAIN, key, tool_tasks.HELDOUT_PERCENT) == common.HELDOUT
  task = lambda r: (r['messages'][0]['content'], json.dumps(r['metadata'], sort_keys=True))
  assert not {task(r) for r in train} & {task(r) for r in sft}
  assert len({task(r) for r in train}) == 300
  kinds = {('table' in r['metadata'], tuple(r['metadata']['tools'])) for r in train}
  assert kinds == {(False, ('calculator',)), (True, ('lookup',)), (True, ('lookup', 'calculator'))}
  assert tool_tasks.prompt_records(0, 300, common.TRAIN) == train  # A pure function of the seed.


def test_prompts_and_answers_are_short():
  for r in tool_tasks.prompt_records(0, 200, common.TRAIN) + tool_tasks.sft_records(0, 50, 0.5):
    assert len(r['messages'][0]['content']) <= 60
    assert len(r['metadata']['answer']) <= 8
    for t in r.get('turns', ()):
      assert len(t['content']) <= 200
