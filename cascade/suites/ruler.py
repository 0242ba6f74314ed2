"""RULER-style long-context suites, generated from a seed: needles, variable tracking and QA.

RULER (Hsieh et al., arXiv 2404.06654) measures what a model retrieves and tracks at a given
context length with synthetic prompts. These suites generate four of its task kinds with
RULER's templates, at 8K, 16K, 32K, 64K and 128K tokens, needing no download:

  ruler_niah_single_<L>    one needle ("One of the special magic numbers for <key> is:
                           <7 digits>.") in RULER's noise haystack; asked for its key.
  ruler_niah_multikey_<L>  four needles with different keys; asked for one (three
                           distractors).
  ruler_vt_<L>             variable tracking: one chain of five assignments ('VAR ABCDE =
                           12345', 'VAR FGHIJ = VAR ABCDE', ...) spread through the noise;
                           asked for every variable holding the value.
  ruler_qa_<L>             QA over generated documents: 'Document i:' paragraphs of made-up
                           facts (one holds the answer), asked a question about one fact.

One registered suite per task and length (20 in all), so each column of a report is one
RULER cell and its protocol hash names its length.

Lengths are measured in the policy's tokenizer, a parameter: `suite.with_tokenizer(tok)`
(anything with `encode(text) -> list`) before `read`, which generates; the whole user turn
(template, haystack, question) is the largest that fits the length less RULER's answer
budget for the task (niah 128, vt 30, qa 32 tokens), found by bisection on the haystack's
size as RULER's generators do. A record is a function of (task, length, seed, index) and
the tokenizer only: the same tokenizer gives the same records on every host.

Grading is RULER's string match: a completion's score is the share of the expected values
that occur in its answer (case-insensitive substrings; RULER's `string_match_all`) for
niah and vt, and 1 when any reference occurs (`string_match_part`) for qa. No project
verifier computes this recall, and it is RULER's metric as published, so it is here: host
string work on the answer after the thinking block, bounded to its first
`MAX_ANSWER_CHARS` characters.

Protocol: RULER decodes greedily, one sample per prompt, with the answer budgets above and
no thinking (' /no_think'); 100 prompts per task and length (RULER uses 500; 100 keeps a
128K column to 13M prompt tokens, with a standard error of a few points reported beside).
RULER's answer prefix (a partial assistant turn) is left out: records are user turns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import string
from typing import Any, Callable, Mapping, Sequence

from cascade.suites import base
from foundation import chat

# RULER's noise haystack: one unit of filler.
NOISE = ('The grass is green. The sky is blue. The sun is yellow. Here we go. '
         'There and back again.')
NEEDLE = 'One of the special magic numbers for {key} is: {value}.'
NIAH_TEMPLATE = ('Some special magic numbers are hidden within the following text. Make sure '
                 'to memorize it. I will quiz you about the numbers afterwards.\n{context}\n'
                 'What are all the special magic numbers for {query} mentioned in the provided '
                 'text?')
VT_TEMPLATE = ('Memorize and track the chain(s) of variable assignment hidden in the following '
               'text.\n\n{context}\nQuestion: Find all variables that are assigned the value '
               '{query} in the text above.')
QA_INSTRUCTION = ('Answer the question based on the given documents. Only give me the answer '
                  'and do not output any other words.')
QA_TEMPLATE = (QA_INSTRUCTION + '\n\nThe following are given documents.\n\n{context}\n\n'
               + QA_INSTRUCTION + '\n\nQuestion: {query}')
# Tokens RULER leaves for the answer, per task kind.
ANSWER_TOKENS = {'niah_single': 128, 'niah_multikey': 128, 'vt': 30, 'qa': 32}
LENGTHS = {'8k': 8192, '16k': 16384, '32k': 32768, '64k': 65536, '128k': 131072}
MAX_ANSWER_CHARS = 4096
_ADJECTIVES = ('amber', 'brisk', 'calm', 'dusty', 'eager', 'faint', 'gentle', 'hollow', 'icy',
               'jolly', 'keen', 'lucky', 'misty', 'noble', 'odd', 'proud', 'quiet', 'rapid',
               'shy', 'tidy', 'vivid', 'wild', 'young', 'zesty')
_NOUNS = ('anchor', 'badger', 'candle', 'dragon', 'engine', 'falcon', 'garden', 'harbor',
          'island', 'jacket', 'kettle', 'ladder', 'meadow', 'needle', 'orchard', 'pepper',
          'quartz', 'river', 'saddle', 'tunnel', 'violin', 'walrus', 'yonder', 'zephyr')
_SYLLABLES = ('ka', 'lo', 'mi', 'ren', 'sa', 'tor', 'vel', 'du', 'bri', 'no', 'fa', 'gus')
# Facts of the QA documents: (statement, question) templates about a made-up entity.
_FACTS = (('The capital of the country of {e} is {a}.', 'What is the capital of {e}?'),
          ('The river {e} flows into the lake called {a}.', 'Which lake does the river {e} '
           'flow into?'),
          ('The inventor {e} was born in the town of {a}.', 'In which town was the inventor {e} '
           'born?'),
          ('The ship {e} was built at the shipyard of {a}.', 'At which shipyard was the ship '
           '{e} built?'))


def _name(rng: random.Random, parts: int = 3) -> str:
  return ''.join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def _key(rng: random.Random) -> str:
  return f'{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}'


def _number(rng: random.Random) -> str:
  return str(rng.randint(1_000_000, 9_999_999))


def _spread(units: list[str], inserts: Sequence[str], rng: random.Random) -> list[str]:
  """`units` with each insert at a seeded random depth (inserts keep their order)."""
  spots = sorted(rng.randint(0, len(units)) for _ in inserts)
  out, last = [], 0
  for spot, text in zip(spots, inserts):
    out.extend(units[last:spot])
    out.append(text)
    last = spot
  return out + units[last:]


@dataclasses.dataclass(frozen=True)
class _Task:
  """One record's recipe: its prompt at a haystack size, and what the answer must hold."""
  render: Callable[[int], str]
  expected: list[str]
  match: str   # 'all' (recall) or 'part' (any)
  info: dict


def _niah(rng: random.Random, keys: int) -> _Task:
  chosen = []
  while len(chosen) < keys:
    k = _key(rng)
    if k not in chosen:
      chosen.append(k)
  values = [_number(rng) for _ in chosen]
  needles = [NEEDLE.format(key=k, value=v) for k, v in zip(chosen, values)]
  order = rng.sample(needles, len(needles))
  seed = rng.random()

  def render(n: int) -> str:
    units = _spread([NOISE] * n, order, random.Random(seed))
    return NIAH_TEMPLATE.format(context=' '.join(units), query=chosen[0])
  return _Task(render, [values[0]], 'all', {'key': chosen[0]})


def _vt(rng: random.Random, hops: int = 4) -> _Task:
  names = []
  while len(names) < hops + 1:
    v = ''.join(rng.choice(string.ascii_uppercase) for _ in range(5))
    if v not in names:
      names.append(v)
  value = str(rng.randint(10_000, 99_999))
  chain = [f'VAR {names[0]} = {value}.'] + [f'VAR {names[i]} = VAR {names[i - 1]}.'
                                            for i in range(1, len(names))]
  seed = rng.random()

  def render(n: int) -> str:
    units = _spread([NOISE] * n, chain, random.Random(seed))
    return VT_TEMPLATE.format(context=' '.join(units), query=value)
  return _Task(render, names, 'all', {'value': value})


def _qa(rng: random.Random) -> _Task:
  statement, question = rng.choice(_FACTS)
  entity, answer = _name(rng, 4), _name(rng, 3)
  gold = statement.format(e=entity, a=answer)
  seed = rng.random()

  def render(n: int) -> str:
    doc_rng = random.Random(seed)

    def other() -> str:   # Any entity but the asked one: the question has one answer.
      while (name := _name(doc_rng, 4)) == entity:
        pass
      return name

    def facts(k: int) -> list[str]:   # The same kinds of facts on other entities.
      return [s.format(e=other(), a=_name(doc_rng, 3)) for s, _ in doc_rng.sample(_FACTS, k)]
    docs = [' '.join(facts(3)) for _ in range(n)]
    gold_doc = facts(2)
    gold_doc.insert(doc_rng.randint(0, 2), gold)
    docs.insert(doc_rng.randint(0, n), ' '.join(gold_doc))
    context = '\n\n'.join(f'Document {i + 1}:\n{d}' for i, d in enumerate(docs))
    return QA_TEMPLATE.format(context=context, query=question.format(e=entity))
  return _Task(render, [answer], 'part', {'entity': entity})


_MAKERS = {'niah_single': lambda rng: _niah(rng, 1), 'niah_multikey': lambda rng: _niah(rng, 4),
           'vt': _vt, 'qa': _qa}


def fit(render: Callable[[int], str], count: Callable[[str], int], budget: int) -> str:
  """The longest `render(n)` whose token count is within `budget` (bisection on n).

  Raises:
    ValueError: even `render(0)` (template and needles alone) is longer than `budget`.
  """
  if count(render(0)) > budget:
    raise ValueError(f'the template alone is over {budget} tokens')
  lo, hi = 0, 1
  while count(render(hi)) <= budget:
    lo, hi = hi, hi * 2
  while hi - lo > 1:   # count(render(lo)) fits, count(render(hi)) does not.
    mid = (lo + hi) // 2
    if count(render(mid)) <= budget:
      lo = mid
    else:
      hi = mid
  return render(lo)


def string_match(answer: str, expected: Sequence[str], match: str) -> float:
  """RULER's string match of one answer: the share of `expected` found in it ('all'), or 1
  when any is ('part'); case-insensitive substrings."""
  text = answer[:MAX_ANSWER_CHARS].lower()
  hits = [e.lower() in text for e in expected]
  if match == 'part':
    return float(any(hits))
  return sum(hits) / len(hits)


class StringMatchGrader(base.Grader):
  """RULER's string match on the answer after the thinking block (no worker process)."""

  def grade(self, record: Mapping, completions: Sequence[str]) -> list[base.Graded]:
    md = record['metadata']
    out = []
    for c in completions:
      split = chat.split_thinking(c)
      if not split.finished_thinking:
        out.append(base.Graded(0.0, info={'reason': 'thinking block never closed'}))
        continue
      score = string_match(split.answer, md['expected'], md['match'])
      out.append(base.Graded(score, info={'reason': f'{score:.2f} of the expected values '
                                                    f'found ({md["match"]})'}))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class RulerSuite(base.Suite):
  """One RULER task at one context length, generated.

  Attributes:
    task: 'niah_single', 'niah_multikey', 'vt' or 'qa'.
    length: the context length in the policy's tokens (prompt plus answer budget).
    records: prompts generated.
    seed: the generation seed.
    tokenizer: the policy's tokenizer (`with_tokenizer`); not part of the protocol hash.
  """
  task: str
  length: int
  records: int = 100
  seed: int = 0
  tokenizer: Any = dataclasses.field(default=None, compare=False, repr=False)

  NEEDS_TOKENIZER = True

  def for_tokenizer(self, tokenizer: Any) -> RulerSuite:
    return self.with_tokenizer(tokenizer)

  def planned_prompts(self) -> tuple[int, int]:
    """Its context length (a rendered prompt, in the policy's tokens, is within it) and its
    records: exact, by construction."""
    return self.length, self.records

  def with_tokenizer(self, tokenizer: Any) -> RulerSuite:
    """This suite measuring lengths in `tokenizer` (anything with `encode(text) -> list`)."""
    return dataclasses.replace(self, tokenizer=tokenizer)

  def read(self, data_dir: str = '') -> list[dict]:
    """The generated records (`data_dir` unused: nothing is downloaded).

    Raises:
      ValueError: no tokenizer was given (`with_tokenizer`), or the length is too short for
        the task's template.
    """
    del data_dir
    if self.tokenizer is None:
      raise ValueError(f'suite {self.name!r} measures lengths in the policy\'s tokenizer: '
                       f'call suite.with_tokenizer(tokenizer) before read()')
    count = lambda text: len(self.tokenizer.encode(text))
    budget = self.length - ANSWER_TOKENS[self.task]
    digest = hashlib.sha256(f'{self.task}/{self.length}/{self.seed}'.encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], 'big'))
    out = []
    for i in range(self.records):
      task = _MAKERS[self.task](rng)
      try:
        text = fit(task.render, count, budget)
      except ValueError as e:
        raise ValueError(f'suite {self.name!r}: {e}') from None
      out.append({'id': f'{self.name}-{i}', 'messages': [{'role': 'user', 'content': text}],
                  'metadata': dict(task.info, expected=task.expected, match=task.match,
                                   tokens=count(text))})
    return out

  def grader(self, **options) -> StringMatchGrader:
    del options   # Host string work: no workers to size.
    return StringMatchGrader()


_SOURCE = 'generated (RULER, arXiv 2404.06654, templates and metrics; no download)'


def _suite(task: str, length: str) -> RulerSuite:
  return RulerSuite(
      name=f'ruler_{task}_{length}', title=f'RULER {task} {length}', source=_SOURCE, files=(),
      metric='string match', task=task, length=LENGTHS[length],
      protocol=base.Protocol(samples=1, greedy=True, temperature=0.0, top_p=1.0,
                             max_new_tokens=ANSWER_TOKENS[task], thinking=False))


niah_single_8k = _suite('niah_single', '8k')
niah_single_16k = _suite('niah_single', '16k')
niah_single_32k = _suite('niah_single', '32k')
niah_single_64k = _suite('niah_single', '64k')
niah_single_128k = _suite('niah_single', '128k')
niah_multikey_8k = _suite('niah_multikey', '8k')
niah_multikey_16k = _suite('niah_multikey', '16k')
niah_multikey_32k = _suite('niah_multikey', '32k')
niah_multikey_64k = _suite('niah_multikey', '64k')
niah_multikey_128k = _suite('niah_multikey', '128k')
vt_8k = _suite('vt', '8k')
vt_16k = _suite('vt', '16k')
vt_32k = _suite('vt', '32k')
vt_64k = _suite('vt', '64k')
vt_128k = _suite('vt', '128k')
qa_8k = _suite('qa', '8k')
qa_16k = _suite('qa', '16k')
qa_32k = _suite('qa', '32k')
qa_64k = _suite('qa', '64k')
qa_128k = _suite('qa', '128k')
