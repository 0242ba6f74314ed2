"""Math domain of the heterogeneous world: three-step word problems with a long worked chain.

  "Ana has 7 pears, gets 5 more, sells 3, then doubles them. How many pears now?"
  thinking: "Start: 7 pears. gets 5 more: 7+5=12. sells 3: 12-3=9. doubles them: 9×2=18.
             Check backwards: 18÷2=9. 9+3=12. 12-5=7. Back to 7, so 18."
  answer:   "7+5=12. 12-3=9. 9×2=18. \\boxed{18}"

The heterogeneous world (build.py, world 'hetero') trains math in thinking
mode, where a response is the trace plus the answer: about 90 tokens, several
times a chat or IF answer (about 15-25). That length gap is the point of the
world: a blended RL batch that mixes math with the short domains waits for the
math rows, and its train rows are as wide as the longest of them. The
arithmetic is the default world's (tiny_world/arithmetic.py: counts
2-10 to start, steps +k / -k with k in 1-5 or doubling a count of at most 10,
so values stay below about 40); a chain has three steps instead of two, and
the trace works it forwards, then undoes it backwards (halving a double), the
verification a reasoning model writes. The backward check uses the same
facts, so the longer chain costs length, not a harder skill.

The key is (numeric skeleton, name, countable, three verb choices); the split
key is the skeleton, 15 % held out. The imperfect teacher (`flaw`) stops after
the first step and boxes that value, as in the default world. Checked by the
`math` verifier with metadata {"answer": "<integer>"}.
"""

from __future__ import annotations

import random

from tiny_world import arithmetic
from tiny_world import common

DOMAIN = 'math'
HELDOUT_PERCENT = 15
STEPS = 3


def draw_key(rng: random.Random) -> tuple:
  """(skeleton (start, op, op, op), name, countable, verb choice of each step)."""
  start = value = rng.randint(2, 10)
  ops = []
  for _ in range(STEPS):
    op = arithmetic._step(value, rng)  # pylint: disable=protected-access
    value = arithmetic._apply(value, op)[0]  # pylint: disable=protected-access
    ops.append(op)
  verbs = tuple(rng.randrange(3) for _ in range(STEPS))
  return (start, *ops), rng.choice(common.NAMES), rng.choice(common.COUNTABLES), verbs


def split_key(key: tuple) -> tuple:
  """The part of a key that decides its split: the numeric skeleton."""
  return key[0]


def _undo(value: int, op: tuple[str, int]) -> tuple[int, str]:
  """(value before `op`, the working that undoes it)."""
  kind, k = op
  if kind == '+':
    return value - k, f'{value}-{k}={value - k}'
  if kind == '-':
    return value + k, f'{value}+{k}={value + k}'
  return value // k, f'{value}÷{k}={value // k}'


def flaw(p: common.Problem, rng: random.Random) -> str:
  """An imperfect teacher's answer: the first step's working, boxed as if it were the answer."""
  del rng
  first = p.answer.split('. ')[0]
  return f'{first}. \\boxed{{{first.rsplit("=", 1)[1]}}}'


def realize(key: tuple, rng: random.Random) -> common.Problem:
  """A worded problem of a skeleton with its worked gold answer and long trace."""
  del rng  # The key holds the wording.
  (start, *ops), name, things, verbs = key
  words = [arithmetic._words(op, v) for op, v in zip(ops, verbs)]  # pylint: disable=protected-access
  value, forward, steps = start, [], []
  for op, w in zip(ops, words):
    value, work = arithmetic._apply(value, op)  # pylint: disable=protected-access
    forward.append(work)
    steps.append(f'{w}: {work}.')
  end, back = value, []
  for op in reversed(ops):
    value, work = _undo(value, op)
    back.append(work)
  prompt = (f'{name} has {start} {things}, {words[0]}, {words[1]}, then {words[2]}. '
            f'How many {things} now?')
  thinking = (f'Start: {start} {things}. {" ".join(steps)} '
              f'Check backwards: {". ".join(back)}. Back to {start}, so {end}.')
  answer = f'{". ".join(forward)}. \\boxed{{{end}}}'
  return common.Problem(key=key, prompt=prompt, answer=answer, thinking=thinking,
                        metadata={'answer': str(end)})
