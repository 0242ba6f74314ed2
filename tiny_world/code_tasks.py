"""Code domain: one-line Python functions from a docstring, HumanEval-style records.

  prompt:  Complete this function:
           def calc(x):
               \"\"\"Return x times 3 plus 4.\"\"\"
  answer:      return x * 3 + 4

The answer is HumanEval's completion: the body, which the `code` verifier
appends to the signature and docstring (metadata "prompt"). (Restating the
whole function made a ~1M-parameter model fail mostly on copying the
function's name.) Metadata is HumanEval's record: {"prompt": signature +
docstring, "test": "def check(candidate): assert ...", "entry_point": name},
with expected outputs computed here by running the gold body. Families cover
integer arithmetic and comparisons, list and string operations; their
parameters (constants up to 999, letters) give ~17K distinct functions. The
split key is (family, parameters): function and argument names are surface
only, so a held-out problem is a computation no training problem asks for.
"""

from __future__ import annotations

import random
from typing import Any, Callable

from tiny_world import common

DOMAIN = 'code'
HELDOUT_PERCENT = 10
NAMES = ('f', 'g', 'h', 'calc', 'solve', 'compute', 'run', 'work', 'apply', 'fn', 'task',
         'step', 'get', 'make')

LETTERS = 'abcdefghijklmnopqrstuvwxyz'

# family: (argument, docstring, body expression, parameter sampler,
#          input sampler (rng, parameters) -> one input)
_Family = tuple[str, str, str, Callable[[random.Random], dict[str, Any]],
                Callable[[random.Random, dict[str, Any]], Any]]


def ints(rng: random.Random, values: dict[str, Any] | None = None) -> int:
  """A test input for integer functions (around the constants, when there are some)."""
  hi = max(99, 2 * max([v for v in (values or {}).values() if isinstance(v, int)], default=0))
  return rng.randint(0, hi)


def lists(rng: random.Random, values: dict[str, Any] | None = None) -> list[int]:
  """A short list of small ints (1-5 items) that sometimes holds the constant k."""
  k = (values or {}).get('k', 0)
  return [rng.choice((k, rng.randint(0, 20))) for _ in range(rng.randint(1, 5))]


def strs(rng: random.Random, values: dict[str, Any] | None = None) -> str:
  """A short string over five letters that include the parameter letter c, if any."""
  letters = sorted({(values or {}).get('c', 'a'), *rng.sample(LETTERS, 4)})
  return ''.join(rng.choice(letters) for _ in range(rng.randint(1, 6)))


def _k(lo: int, hi: int) -> Callable[[random.Random], dict[str, Any]]:
  return lambda rng: {'k': rng.randint(lo, hi)}


def _km(k: tuple[int, int], m: tuple[int, int]) -> Callable[[random.Random], dict[str, Any]]:
  return lambda rng: {'k': rng.randint(*k), 'm': rng.randint(*m)}


def _c(rng: random.Random) -> dict[str, Any]:
  return {'c': rng.choice(LETTERS)}


def _ck(lo: int, hi: int) -> Callable[[random.Random], dict[str, Any]]:
  return lambda rng: {'c': rng.choice(LETTERS), 'k': rng.randint(lo, hi)}


FAMILIES: dict[str, _Family] = {
    'add': ('x', 'Return x plus {k}.', 'x + {k}', _k(1, 999), ints),
    'sub': ('x', 'Return x minus {k}.', 'x - {k}', _k(1, 999), ints),
    'mul': ('x', 'Return x times {k}.', 'x * {k}', _k(2, 99), ints),
    'lin': ('x', 'Return x times {k} plus {m}.', 'x * {k} + {m}', _km((2, 20), (1, 99)), ints),
    'shift_mul': ('x', 'Return x plus {k}, times {m}.', '(x + {k}) * {m}',
                  _km((1, 99), (2, 20)), ints),
    'mod': ('x', 'Return x modulo {k}.', 'x % {k}', _k(2, 99), ints),
    'div': ('x', 'Return x divided by {k}, rounded down.', 'x // {k}', _k(2, 99), ints),
    'gt': ('x', 'Return True if x is greater than {k}.', 'x > {k}', _k(0, 999), ints),
    'lt': ('x', 'Return True if x is less than {k}.', 'x < {k}', _k(0, 999), ints),
    'between': ('x', 'Return True if x is from {k} to {m}.', '{k} <= x <= {m}',
                lambda rng: dict(zip('km', sorted(rng.sample(range(100), 2)))), ints),
    'distance': ('x', 'Return the distance from x to {k}.', 'abs(x - {k})', _k(0, 999), ints),
    'at_most': ('x', 'Return x, but at most {k}.', 'min(x, {k})', _k(0, 999), ints),
    'at_least': ('x', 'Return x, but at least {k}.', 'max(x, {k})', _k(0, 999), ints),
    'square_plus': ('x', 'Return x squared plus {k}.', 'x * x + {k}', _k(0, 99), ints),
    'max_plus': ('xs', 'Return the largest item of xs plus {k}.', 'max(xs) + {k}', _k(0, 99),
                 lists),
    'min_minus': ('xs', 'Return the smallest item of xs minus {k}.', 'min(xs) - {k}',
                  _k(0, 99), lists),
    'sum_times': ('xs', 'Return the sum of xs times {k}.', 'sum(xs) * {k}', _k(2, 20), lists),
    'count': ('xs', 'Return how many times {k} appears in xs.', 'xs.count({k})', _k(0, 20),
              lists),
    'first': ('xs', 'Return the first {k} items of xs.', 'xs[:{k}]', _k(1, 9), lists),
    'last': ('xs', 'Return the last {k} items of xs.', 'xs[-{k}:]', _k(1, 9), lists),
    'add_each': ('xs', 'Return xs with {k} added to each item.', '[v + {k} for v in xs]',
                 _k(1, 99), lists),
    'keep_gt': ('xs', 'Return the items of xs greater than {k}.', '[v for v in xs if v > {k}]',
                _k(0, 20), lists),
    'count_char': ('s', "Return how many times '{c}' appears in s.", "s.count('{c}')", _c, strs),
    'starts': ('s', "Return True if s starts with '{c}'.", "s.startswith('{c}')", _c, strs),
    'ends': ('s', "Return True if s ends with '{c}'.", "s.endswith('{c}')", _c, strs),
    'append': ('s', "Return s with '{c}' added at the end.", "s + '{c}'", _c, strs),
    'pad': ('s', "Return s with {k} copies of '{c}' in front.", "'{c}' * {k} + s", _ck(1, 9),
            strs),
    'replace': ('s', "Return s with every '{c}' replaced by '{d}'.", "s.replace('{c}', '{d}')",
                lambda rng: dict(zip('cd', rng.sample(LETTERS, 2))), strs),
    'repeat': ('s', 'Return s repeated {k} times.', 's * {k}', _k(2, 9), strs),
    'head_rev': ('s', 'Return the first {k} letters of s, reversed.', 's[:{k}][::-1]',
                 _k(1, 6), strs),
}


def completion_text(body: str) -> str:
  """The one-line body completing a function (the gold answer's shape)."""
  return f'    return {body}'


def flaw(p: common.Problem, rng: random.Random) -> str:
  """An imperfect teacher's answer to `p`: the body printed instead of returned."""
  del rng
  return '    print(' + p.answer[len('    return '):] + ')'


def compile_body(arg: str, body: str) -> Callable[[Any], Any]:
  """The function of a body expression (generator-made code only)."""
  return eval(f'lambda {arg}: {body}')  # pylint: disable=eval-used


def make_test(arg: str, body: str, rng: random.Random, inputs: Callable[[random.Random], Any],
              n: int = 4) -> str:
  """A HumanEval `check(candidate)` with `n` asserts whose outputs come from `body`.

  Inputs are picked to cover as many distinct outputs as the sampler offers
  (both True and False for predicates), so a constant function fails.
  """
  fn, pool = compile_body(arg, body), []
  for _ in range(n * 4):
    value = inputs(rng)
    if value not in [v for v, _ in pool]:
      pool.append((value, fn(value)))
  chosen, outputs = [], []
  for value, out in pool:  # First one input per distinct output, then the rest.
    if out not in outputs and len(chosen) < n:
      chosen.append((value, out))
      outputs.append(out)
  chosen += [vo for vo in pool if vo not in chosen][:n - len(chosen)]
  lines = ['def check(candidate):']
  lines += [f'    assert candidate({v!r}) == {o!r}' for v, o in chosen]
  return '\n'.join(lines) + '\n'


def draw_key(rng: random.Random) -> tuple:
  """(family, sorted parameter items); families are drawn uniformly."""
  family = rng.choice(sorted(FAMILIES))
  return family, tuple(sorted(FAMILIES[family][3](rng).items()))


def realize(key: tuple, rng: random.Random) -> common.Problem:
  """The specification of a key with a random function name, its gold and its tests."""
  family, items = key
  arg, doc, body, _, inputs = FAMILIES[family]
  values = dict(items)
  name = rng.choice(NAMES)
  doc, body = doc.format(**values), body.format(**values)
  header = f'def {name}({arg}):\n    """{doc}"""\n'
  metadata = {'prompt': header, 'test': make_test(arg, body, rng, lambda r: inputs(r, values)),
              'entry_point': name}
  return common.Problem(key=key, prompt=f'Complete this function:\n{header.rstrip()}',
                        answer=completion_text(body),
                        thinking=f'{doc[:-1]}: {body}.', metadata=metadata)
