"""Verdict SFT records for a tiny judge: chat answers graded by the world's hidden quality rule.

  from tiny_world import judge_data
  recs = judge_data.records(seed=0, n=8000, template='compact_yes_no')
  # build.py writes them to <world>/judge_sft.jsonl (its JUDGE_RECORDS, JUDGE_TEMPLATE)

Each record is an SFT record (cascade.data's 'sft' format) whose user turn is
a judge template's prompt (`verifiers.judge.TEMPLATES[template]`) filled with
a chat question and a candidate answer, defused exactly as the judge verifier
defuses a field, and whose response is the template's verdict line
('Verdict: YES' or 'Verdict: NO'). So a policy fine-tuned on them is a judge
the 'judge' verifier reads with score_by='logits': the row it builds is this
record's prompt followed by 'Verdict: ', and the next token's YES-vs-NO
probability is the reward (configs/tiny.py:rm=generative).

The label is drawn YES with probability equal to the answer's hidden quality
(`chat.quality`: the fraction of its four criteria met), so a judge that fits
the data has P(YES) = quality: a graded reward, like the Bradley-Terry reward
model's, not a pass/fail one. Per chat problem (train-split topics only, as
the preference pairs): the gold answer, the flawed teacher's answer (what the
SFT policy imitates and RLHF has to unlearn) and two of `chat.variants`'
corrupted answers. Records carry their parts ('question', 'answer',
'topic', 'quality') for tests; the SFT stage reads only 'messages' and 'response'.

Deterministic: a pure function of (seed, n, template) with a random stream of
its own, so writing it changes no other file of the world.
"""

from __future__ import annotations

import random
from typing import Any

from foundation import chat as chat_lib
from tiny_world import chat
from tiny_world import common
from verifiers import judge

# Broken answers per problem besides the gold one and the flawed teacher's.
BROKEN_PER_PROBLEM = 2


def template_spec(template: str) -> dict[str, Any]:
  """What of the template the records depend on (build.py puts it in the world's stamp, so a
  changed template rebuilds the world)."""
  t = judge.TEMPLATES[template]
  return {'name': template, 'user': t.user, 'delimiters': list(t.delimiters),
          'verdict': t.verdict, 'choices': list(t.choices)}


def prompt(question: str, answer: str, template: str) -> str:
  """The judge's user turn for (question, answer), each field defused as the verifier does."""
  t = judge.TEMPLATES[template]
  defused = t.delimiters + (t.verdict,)
  fields = {'question': question, 'response': answer}
  return t.user.format(**{f: judge.defuse_field(fields[f], defused, chat_lib.SPECIAL_TOKENS)
                          for f in t.fields})


def records(seed: int, n: int, template: str) -> list[dict[str, Any]]:
  """`n` verdict SFT records (see the module docstring).

  Args:
    seed: the world's seed.
    n: how many records.
    template: a pointwise yes/no template of `verifiers.judge.TEMPLATES`.

  Returns:
    SFT records {'id', 'domain', 'messages', 'response', 'question', 'answer', 'topic',
    'quality'}.
  """
  t = judge.TEMPLATES[template]
  if t.pairwise or 'response' not in t.fields or len(t.choices) != 2:
    raise ValueError(f'tiny judge data: template={template!r} is not a pointwise yes/no '
                     'template')
  yes, no = (f'{t.verdict} {c}' for c in t.choices)
  rng = random.Random(f'tiny_world/{seed}/judge')
  out: list[dict[str, Any]] = []
  while len(out) < n:
    key = chat.draw_key(rng)
    if common.split_of(chat.DOMAIN, chat.split_key(key), chat.HELDOUT_PERCENT) != common.TRAIN:
      continue
    p = chat.realize(key, rng)
    topic = p.metadata['topic']
    gold, *broken = chat.variants(p.answer, topic, rng)
    answers = [gold[0], chat.flaw(p, rng)] + [a for a, _ in rng.sample(broken, BROKEN_PER_PROBLEM)]
    for answer in answers:
      if not answer.strip() or len(out) >= n:
        continue
      q = chat.quality(answer, topic).score
      out.append({'id': f'chat/judge_sft/{len(out):05d}', 'domain': chat.DOMAIN,
                  'messages': [{'role': 'user', 'content': prompt(p.prompt, answer, template)}],
                  'response': yes if rng.random() < q else no,
                  'question': p.prompt, 'answer': answer, 'topic': topic, 'quality': q})
  return out
