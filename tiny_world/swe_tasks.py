"""SWE domain: a three-line buggy function and its failing test; the answer is a unified diff.

  prompt:  Fix calc.py. Issue: y must be x plus 7.
           def calc(x):
               y = x - 7
               return y * 2
           Failing: assert calc(3) == 20
  answer:  --- a/calc.py
           +++ b/calc.py
           @@ -2 +2 @@
           -    y = x - 7
           +    y = x + 7

Functions are `y = <first step>; return y <op> m` over an int, a list or a
string; the bug is one mutation (an operator, a constant off by one, the
wrong builtin or string step, the wrong letter) on line 2 or 3, and the
failing test's input is chosen so the buggy and the fixed function differ on
it. The prompt opens with an issue line saying in words what the buggy line
should compute (as SWE tasks start from an issue): from the failing test
alone, the fix of an arithmetic bug needs arithmetic a few-million-parameter
model cannot do, so the task would be guessing. Diffs have no context lines
(`difflib`'s n=0), the shortest patch a `patch`-style tool applies, so the
answer stays ~33 tokens. Metadata: {"gold_patch": diff} for the agentless
`swe` verifier (1 when the changed lines equal the gold patch's, a
similarity score in (0, 1) otherwise, 0 for no change, -1 unparsable). The
split key is (function, bug).
"""

from __future__ import annotations

import difflib
import random
import re
from typing import Any, Callable

from tiny_world import code_tasks
from tiny_world import common

DOMAIN = 'swe'
HELDOUT_PERCENT = 10
FILES = ('calc.py', 'util.py', 'main.py', 'lib.py', 'core.py', 'ops.py')
_INT_OPS = ('+', '-', '*')
_RET_OPS = ('+', '-', '*', '%', '//')
_AGGS = ('max', 'min', 'sum', 'len')
_STR_STEPS = ('s.upper()', 's[::-1]', 's[1:]', 's[:-1]', 's + s')
# What a correct line does, in words, for the issue text.
_SAYS = {'+': 'plus', '-': 'minus', '*': 'times', '%': 'modulo', '//': 'divided by',
         'max': 'the largest item of xs', 'min': 'the smallest item of xs',
         'sum': 'the sum of xs', 'len': 'the length of xs', 's.upper()': 's in capitals',
         's[::-1]': 's reversed', 's[1:]': 's without its first letter',
         's[:-1]': 's without its last letter', 's + s': 's twice'}


def _issue(template: str, values: dict[str, Any]) -> str:
  """The issue text: what the buggy line should compute, without naming the line."""
  if template.startswith('y = x'):
    return f'y must be x {_SAYS[values["op"]]} {values["k"]}.'
  if template.startswith('y = {agg}'):
    return f'y must be {_SAYS[values["agg"]]}.'
  if template.startswith('y = {step}'):
    return f'y must be {_SAYS[values["step"]]}.'
  if 'c' in values:
    return f'it must return y plus {values["c"]!r}.'
  return f'it must return y {_SAYS[values["op"]]} {values["k"]}.'


_INPUTS = {'x': code_tasks.ints, 'xs': code_tasks.lists, 's': code_tasks.strs}


def _draw_function(rng: random.Random) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
  """A correct function as (argument, [(line template, slot values)] for lines 2 and 3)."""
  kind = rng.choice(('int', 'int', 'list', 'str'))
  if kind == 'int':
    arg, first = 'x', ('y = x {op} {k}', {'op': rng.choice(_INT_OPS), 'k': rng.randint(1, 20)})
  elif kind == 'list':
    arg, first = 'xs', ('y = {agg}(xs)', {'agg': rng.choice(_AGGS)})
  else:
    arg, first = 's', ('y = {step}', {'step': rng.choice(_STR_STEPS)})
  if kind == 'str':
    second = ('return y + {c!r}', {'c': rng.choice(code_tasks.LETTERS)})
  else:
    second = ('return y {op} {k}', {'op': rng.choice(_RET_OPS), 'k': rng.randint(2, 20)})
  return arg, [first, second]


def _mutate(line: tuple[str, dict[str, Any]], rng: random.Random) -> dict[str, Any]:
  """A buggy version of one line's slot values (always different from the original)."""
  template, values = line
  values = dict(values)
  options = []
  if 'op' in values:
    ops = _INT_OPS if template.startswith('y') else _RET_OPS
    options.append(('op', rng.choice([o for o in ops if o != values['op']])))
  if 'k' in values:
    options.append(('k', values['k'] + rng.choice((-1, 1))))
  if 'agg' in values:
    options.append(('agg', rng.choice([a for a in _AGGS if a != values['agg']])))
  if 'step' in values:
    options.append(('step', rng.choice([s for s in _STR_STEPS if s != values['step']])))
  if 'c' in values:
    options.append(('c', rng.choice([c for c in code_tasks.LETTERS if c != values['c']])))
  slot, new = rng.choice(options)
  values[slot] = new
  return values


def _source(name: str, arg: str, lines: list[tuple[str, dict[str, Any]]]) -> str:
  return f'def {name}({arg}):\n' + ''.join(f'    {t.format(**v)}\n' for t, v in lines)


def _compile(source: str, name: str) -> Callable[[Any], Any]:
  """The function a source defines, raising nothing: a crash returns '<ErrorName>'."""
  scope: dict[str, Any] = {}
  exec(source, scope)  # pylint: disable=exec-used  # generator-made code only.
  fn = scope[name]

  def call(value):
    try:
      return fn(value)
    except Exception as e:  # pylint: disable=broad-except  # a crash also differs.
      return f'<{type(e).__name__}>'
  return call


def unified_diff(path: str, before: str, after: str) -> str:
  """A git-style unified diff with no context lines (`a/` and `b/` prefixes)."""
  lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                               fromfile=f'a/{path}', tofile=f'b/{path}', n=0)
  return ''.join(lines)


def _freeze(lines: list[tuple[str, dict[str, Any]]]) -> tuple:
  return tuple((t, tuple(sorted(v.items()))) for t, v in lines)


def draw_key(rng: random.Random) -> tuple:
  """(argument, correct lines, buggy line index, buggy lines), lines frozen."""
  arg, lines = _draw_function(rng)
  where = rng.randrange(2)
  buggy = list(lines)
  buggy[where] = (lines[where][0], _mutate(lines[where], rng))
  return arg, _freeze(lines), where, _freeze(buggy)


def flaw(p: common.Problem, rng: random.Random) -> str:
  """An imperfect teacher's patch for `p`: the buggy line rewritten unchanged (a no-op patch).

  The agentless reward scores a patch that changes nothing 0.
  """
  del rng
  removed = re.search(r'^-(?!--).*$', p.answer, re.M).group(0)
  return re.sub(r'^\+(?!\+\+).*$', '+' + removed[1:], p.answer, count=1, flags=re.M)


def realize(key: tuple, rng: random.Random) -> common.Problem | None:
  """The task of a key, or None when no drawn input tells the buggy function apart."""
  arg, frozen, where, frozen_bug = key
  lines = [(t, dict(v)) for t, v in frozen]
  buggy = [(t, dict(v)) for t, v in frozen_bug]
  name, path = rng.choice(code_tasks.NAMES), rng.choice(FILES)
  good_src, bad_src = _source(name, arg, lines), _source(name, arg, buggy)
  good, bad = _compile(good_src, name), _compile(bad_src, name)
  for _ in range(20):
    value = _INPUTS[arg](rng, lines[-1][1])
    want = good(value)
    if isinstance(want, str) and want.startswith('<'):
      continue  # The fixed function must not crash on the test input.
    if bad(value) != want:
      break
  else:
    return None
  patch = unified_diff(path, bad_src, good_src)
  fixed_line = lines[where][0].format(**lines[where][1])
  prompt = (f'Fix {path}. Issue: {_issue(*lines[where])}\n{bad_src}'
            f'Failing: assert {name}({value!r}) == {want!r}')
  return common.Problem(key=key, prompt=prompt, answer=patch.rstrip('\n'),
                        thinking=f'Line {where + 2} should be: {fixed_line}',
                        metadata={'gold_patch': patch})
