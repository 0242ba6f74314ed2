"""Shared pieces of the tiny world: vocabulary, seed-free split assignment, record builders.

Every domain generator draws problems from a large parameter space. A
problem's *key* (the parameters that decide its answer, not its surface
wording) is hashed to put it in the train or the held-out split, so the two
splits are disjoint by construction and the partition is the same for every
seed: seeds change which problems are drawn and how they are worded, never
which side of the line a problem falls on. That keeps held-out sets
comparable across the seeds of a cascade-vs-blended comparison.

Record formats (JSONL, one object a line), the canonical ones of cascade/data:
  prompt records (RL and eval): {"id", "domain", "messages", "metadata"}
  SFT records: {"id", "domain", "messages", "response", "thinking"}
  preference records: {"id", "domain", "messages", "chosen", "rejected"}
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from typing import Any, Callable, Hashable

TRAIN = 'train'
HELDOUT = 'heldout'
SPLITS = (TRAIN, HELDOUT)

# Topic nouns by category; the chat and instruction-following domains talk about
# them and the math/code domains borrow names and objects. Single lowercase words
# so "mentions the topic" is a plain word match.
TOPICS = {
    'animal': (
        'fox wolf bear deer rabbit horse cow goat sheep pig duck goose owl eagle hawk crow '
        'robin swan frog toad snake lizard turtle whale dolphin shark seal otter beaver mouse '
        'rat bat cat dog lion tiger zebra camel llama monkey panda koala moose bison badger '
        'squirrel hedgehog mole crab lobster octopus squid salmon trout bee ant wasp moth '
        'beetle spider').split(),
    'food': (
        'apple pear plum peach cherry grape lemon lime orange banana mango melon berry carrot '
        'potato onion garlic pepper tomato bean pea corn rice bread cheese butter honey jam '
        'soup salad pasta pizza noodle cookie cake pie muffin bagel yogurt egg milk tea coffee '
        'cocoa juice olive walnut almond peanut oat wheat barley cabbage lettuce spinach '
        'celery radish pumpkin squash ginger').split(),
    'place': (
        'river lake ocean forest desert mountain valley island beach meadow swamp canyon cave '
        'glacier volcano jungle prairie harbor village city town farm garden park market '
        'library museum school castle temple bridge tower station airport stadium theater '
        'bakery kitchen cellar attic barn cabin palace street highway tunnel lighthouse pier '
        'orchard vineyard pond stream hill cliff bay reef marsh field plaza mall').split(),
    'object': (
        'lamp chair table clock mirror pencil book candle kettle spoon fork knife plate bowl '
        'cup basket bucket ladder hammer shovel rope blanket pillow window door key lock '
        'wallet camera radio piano guitar violin drum flute bicycle wagon boat canoe train '
        'truck kite balloon umbrella hat scarf glove boot jacket ribbon compass map telescope '
        'magnet battery bottle jar brush comb needle').split(),
    'nature': (
        'rain snow wind storm cloud fog thunder lightning rainbow sunset sunrise moon star '
        'comet planet tide wave sand stone rock pebble crystal metal iron copper silver gold '
        'salt clay mud ice frost dew flame smoke ash leaf root seed flower rose tulip daisy '
        'lily fern moss oak pine maple willow bamboo cactus grass weed vine acorn coral shell '
        'feather cotton').split(),
    'activity': (
        'swimming running hiking cooking baking reading writing painting drawing singing '
        'dancing fishing camping sailing skating skiing climbing cycling rowing gardening '
        'knitting sewing juggling chess soccer tennis golf hockey baseball cricket rugby boxing '
        'archery yoga karate surfing diving jogging walking sleeping dreaming laughing '
        'whistling shopping traveling studying teaching farming building sculpting pottery '
        'poetry music opera photography astronomy history science geometry puzzles '
        'riddles').split(),
}
TOPIC_CATEGORY = {t: c for c, ts in TOPICS.items() for t in ts}
ALL_TOPICS = tuple(TOPIC_CATEGORY)

NAMES = ('Ana Ben Cal Dee Eli Fay Gus Ivy Jon Kim Leo Mia Ned Oli Pam Rex Sam Tia Uma '
         'Vic Wes Zoe').split()
# Countable things for math stories: plural forms, all distinct words.
COUNTABLES = ('apples pears plums eggs cookies cakes pies muffins shells stones pebbles '
              'feathers acorns leaves seeds flowers roses books pencils cups spoons keys '
              'kites balloons hats coins cards marbles stamps buttons').split()


def topic_phrase(topic: str) -> str:
  """How a prompt names a topic: 'the fox', but 'swimming' for activities."""
  return topic if TOPIC_CATEGORY[topic] == 'activity' else f'the {topic}'


def split_of(domain: str, key: Hashable, heldout_percent: int) -> str:
  """Which split a problem belongs to, from its key alone (seed-independent).

  Args:
    domain: the domain name (salts the hash so domains partition independently).
    key: the problem's answer-deciding parameters; its repr is hashed.
    heldout_percent: share of the key space that is held out, in percent.

  Returns:
    TRAIN or HELDOUT.
  """
  digest = hashlib.sha256(f'{domain}|{key!r}'.encode()).digest()
  return HELDOUT if int.from_bytes(digest[:8], 'big') % 100 < heldout_percent else TRAIN


@dataclasses.dataclass(frozen=True)
class Problem:
  """One generated task with its gold solution.

  Attributes:
    key: the answer-deciding parameters (decides the split; unique per split).
    prompt: the user turn.
    answer: the gold final answer (instruct mode, and after thinking).
    thinking: the gold reasoning for thinking mode.
    metadata: the verifier fields of the domain.
  """
  key: Hashable
  prompt: str
  answer: str
  thinking: str
  metadata: dict[str, Any]


def draw_unique(domain: str, split: str, n: int, heldout_percent: int,
                draw_key: Callable[[random.Random], Hashable],
                realize: Callable[[Hashable, random.Random], Problem | None],
                rng: random.Random, split_key: Callable[[Hashable], Hashable] | None = None,
                max_misses: int = 20_000) -> list[Problem]:
  """Draws `n` problems with distinct keys that fall in `split`.

  Keys are cheap to draw; only keys on the right side of the split are
  realised into problems (wording, gold answer, tests), which keeps drawing
  a 10 % held-out split fast.

  Args:
    domain: domain name (for the split hash and for errors).
    split: TRAIN or HELDOUT.
    n: how many problems.
    heldout_percent: see `split_of`.
    draw_key: draws one random problem key.
    realize: (key, rng) -> the problem, or None when that key has no valid
      problem (the key is then skipped).
    rng: the generator's random state.
    split_key: the part of a key that decides its split (default: the whole
      key); problems are distinct by their whole key.
    max_misses: gives up after this many draws in a row without a new
      problem of the split (the space is exhausted, or nearly).

  Returns:
    `n` problems in draw order.

  Raises:
    ValueError: the split's problem space is too small for `n`.
  """
  if split not in SPLITS:
    raise ValueError(f'split={split!r}: expected one of {SPLITS}')
  seen, out, misses = set(), [], 0
  while len(out) < n and misses < max_misses:
    misses += 1
    key = draw_key(rng)
    if key in seen:
      continue
    seen.add(key)
    if split_of(domain, split_key(key) if split_key else key, heldout_percent) != split:
      continue
    p = realize(key, rng)
    if p is not None:
      out.append(p)
      misses = 0
  if len(out) < n:
    raise ValueError(f'{domain}/{split}: asked for {n} distinct problems, found only '
                     f'{len(out)}; the {split} problem space is too small for that size')
  return out


def prompt_record(domain: str, rid: str, p: Problem) -> dict[str, Any]:
  """The RL / eval prompt record of a problem."""
  return {'id': rid, 'domain': domain, 'messages': [{'role': 'user', 'content': p.prompt}],
          'metadata': p.metadata}


def sft_record(domain: str, rid: str, p: Problem) -> dict[str, Any]:
  """The SFT record of a problem (answer for instruct mode, plus thinking)."""
  return {'id': rid, 'domain': domain, 'messages': [{'role': 'user', 'content': p.prompt}],
          'response': p.answer, 'thinking': p.thinking}


WORD_RE = re.compile(r'\w+')


def count_words(text: str) -> int:
  """Words as Google IFEval counts them (runs of \\w)."""
  return len(WORD_RE.findall(text))
