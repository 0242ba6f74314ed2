"""Math domain: two-step arithmetic word problems whose answer goes in \\boxed{}.

  "Ana has 7 pears, gets 5 more, then gives away 3. How many pears now?"
  answer: "7+5=12. 12-3=9. \\boxed{9}"    thinking: "7+5=12. 12-3=9."

The answer restates the working in both modes (SFT records carry one
response); in thinking mode the trace holds the same steps first.

Two shapes: a start count (2-10) followed by two steps (+k or -k with k in
1-5, or doubling a count of at most 10), or, rarely, a product start
("3 bags of 2 pears", factors 2-3) followed by one step. Counts stay in
1-25, so the answers need about 250 arithmetic facts. The numbers are small
on purpose: a ~1M-parameter model must learn the facts from a few thousand
SFT records in a few minutes; with starts up to 25 and steps up to 9 it
wrote "10-4=5" and "24+1=26" after the demo's SFT (~6 % held-out), and with
factors up to 9, steps up to 20 and tripling it had 2-3 % at temperature 1,
so GRPO groups were all wrong (no signal). The working is written
without spaces and with "×" for products, so the math answer format shares
little surface with the code domain's "x * 3" (FACTS: domains whose outputs
share vocabulary interfere). A problem's key is its numeric skeleton (shape,
numbers, operations; about 1.1K) plus its wording (name, countable, verbs),
and the split key is the skeleton alone, 15 % held out: held-out problems
are new computations, not new wordings of trained ones.
Checked by the `math` verifier with metadata {"answer": "<integer>"}.
"""

from __future__ import annotations

import random

from tiny_world import common

DOMAIN = 'math'
HELDOUT_PERCENT = 15

_ADD = ('gets {k} more', 'finds {k} more', 'buys {k} more')
_SUB = ('gives away {k}', 'loses {k}', 'sells {k}')
_DOUBLE = 'doubles them'


def _step(value: int, rng: random.Random) -> tuple[str, int]:
  """Draws one operation applicable to `value`: +k, -k (k < value) with k in 1..5, or x2 (<= 10)."""
  kind = rng.choice(('+', '+', '-', '-', '*'))
  if kind == '*' and value <= 10:
    return '*', 2
  if kind != '+' and value >= 2:
    return '-', rng.randint(1, min(5, value - 1))
  return '+', rng.randint(1, 5)


def _apply(value: int, op: tuple[str, int]) -> tuple[int, str]:
  """(new value, working) of one operation."""
  kind, k = op
  new = {'+': value + k, '-': value - k, '*': value * k}[kind]
  return new, f'{value}{"×" if kind == "*" else kind}{k}={new}'


def _words(op: tuple[str, int], verb: int) -> str:
  kind, k = op
  if kind == '*':
    return _DOUBLE
  verbs = _ADD if kind == '+' else _SUB
  return verbs[verb % len(verbs)].format(k=k)


def _skeleton(rng: random.Random) -> tuple:
  """('chain', a, op1, op2) or ('bags', a, b, op); op = (kind, k)."""
  if rng.random() < 0.9:
    a = rng.randint(2, 10)
    op1 = _step(a, rng)
    return 'chain', a, op1, _step(_apply(a, op1)[0], rng)
  a, b = rng.randint(2, 3), rng.randint(2, 3)
  return 'bags', a, b, _step(a * b, rng)


def draw_key(rng: random.Random) -> tuple:
  """(numeric skeleton, name, countable, verb choice of each step)."""
  return (_skeleton(rng), rng.choice(common.NAMES), rng.choice(common.COUNTABLES),
          rng.randrange(3), rng.randrange(3))


def split_key(key: tuple) -> tuple:
  """The part of a key that decides its split: the numeric skeleton."""
  return key[0]


def flaw(p: common.Problem, rng: random.Random) -> str:
  """An imperfect teacher's answer to `p`: it stops after the first step and boxes that value.

  The working is right but the answer is not (the problem has two steps), a
  premature answer that only the reward tells apart from the gold one.
  """
  del rng
  first = p.thinking.split('. ')[0]
  return f'{first}. \\boxed{{{first.rsplit("=", 1)[1]}}}'


def realize(key: tuple, rng: random.Random) -> common.Problem:
  """A worded problem of a skeleton with its worked gold answer."""
  del rng  # The key holds the wording.
  skeleton, name, things, verb1, verb2 = key
  if skeleton[0] == 'chain':
    _, a, op1, op2 = skeleton
    v1, work1 = _apply(a, op1)
    v2, work2 = _apply(v1, op2)
    prompt = (f'{name} has {a} {things}, {_words(op1, verb1)}, then {_words(op2, verb2)}. '
              f'How many {things} now?')
  else:
    _, a, b, op = skeleton
    v1, work1 = _apply(a, ('*', b))
    v2, work2 = _apply(v1, op)
    prompt = (f'{name} has {a} bags of {b} {things}, then {_words(op, verb2)}. '
              f'How many {things} now?')
  thinking = f'{work1}. {work2}.'
  return common.Problem(key=key, prompt=prompt, answer=f'{thinking} \\boxed{{{v2}}}',
                        thinking=thinking, metadata={'answer': str(v2)})
