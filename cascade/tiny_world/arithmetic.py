"""Math domain: two-step arithmetic word problems whose answer goes in \\boxed{}.

  "Ana has 7 pears, gets 5 more, then gives away 3. How many pears now?"
  answer: "7+5=12. 12-3=9. \\boxed{9}"    thinking: "7+5=12. 12-3=9."

The answer restates the working in both modes (SFT records carry one
response); in thinking mode the trace holds the same steps first.

Two shapes: a start count (2-30) followed by two steps (+k or -k with k in
1-9, or doubling), or a product start ("4 bags of 5 pears", factors 2-5)
followed by one step. Intermediate counts never go negative. The numbers are
small on purpose: with factors up to 9, steps up to 20 and tripling, a
0.9M-parameter model had 8 % held-out after 400 SFT steps and 2-3 % at
temperature 1, so GRPO groups were all wrong (no signal; probe.py). The
working is written without spaces and with "×" for products, so the math
answer format shares little surface with the code domain's "x * 3" (FACTS:
domains whose outputs share vocabulary interfere). The split key is the
numeric skeleton (shape, numbers, operations), about 11K skeletons, 15 %
held out, so held-out problems are new computations, not new wordings.
Checked by the `math` verifier with metadata {"answer": "<integer>"}.
"""

from __future__ import annotations

import random

from cascade.tiny_world import common

DOMAIN = 'math'
HELDOUT_PERCENT = 15

_ADD = ('gets {k} more', 'finds {k} more', 'buys {k} more')
_SUB = ('gives away {k}', 'loses {k}', 'sells {k}')
_DOUBLE = 'doubles them'


def _step(value: int, rng: random.Random) -> tuple[str, int]:
  """Draws one operation applicable to `value`: +k, -k (k < value) with k in 1..9, or x2."""
  kind = rng.choice(('+', '+', '-', '-', '*'))
  if kind == '*':
    return '*', 2
  if kind == '-' and value >= 2:
    return '-', rng.randint(1, min(9, value - 1))
  return '+', rng.randint(1, 9)


def _apply(value: int, op: tuple[str, int]) -> tuple[int, str]:
  """(new value, working) of one operation."""
  kind, k = op
  new = {'+': value + k, '-': value - k, '*': value * k}[kind]
  return new, f'{value}{"×" if kind == "*" else kind}{k}={new}'


def _words(op: tuple[str, int], rng: random.Random) -> str:
  kind, k = op
  if kind == '*':
    return _DOUBLE
  return rng.choice(_ADD if kind == '+' else _SUB).format(k=k)


def draw_key(rng: random.Random) -> tuple:
  """A numeric skeleton: ('chain', a, op1, op2) or ('bags', a, b, op); op = (kind, k)."""
  if rng.random() < 0.8:
    a = rng.randint(2, 30)
    op1 = _step(a, rng)
    return 'chain', a, op1, _step(_apply(a, op1)[0], rng)
  a, b = rng.randint(2, 5), rng.randint(2, 5)
  return 'bags', a, b, _step(a * b, rng)


def realize(key: tuple, rng: random.Random) -> common.Problem:
  """A worded problem of a skeleton with its worked gold answer."""
  name, things = rng.choice(common.NAMES), rng.choice(common.COUNTABLES)
  if key[0] == 'chain':
    _, a, op1, op2 = key
    v1, work1 = _apply(a, op1)
    v2, work2 = _apply(v1, op2)
    prompt = (f'{name} has {a} {things}, {_words(op1, rng)}, then {_words(op2, rng)}. '
              f'How many {things} now?')
  else:
    _, a, b, op = key
    v1, work1 = _apply(a, ('*', b))
    v2, work2 = _apply(v1, op)
    prompt = (f'{name} has {a} bags of {b} {things}, then {_words(op, rng)}. '
              f'How many {things} now?')
  thinking = f'{work1}. {work2}.'
  return common.Problem(key=key, prompt=prompt, answer=f'{thinking} \\boxed{{{v2}}}',
                        thinking=thinking, metadata={'answer': str(v2)})
