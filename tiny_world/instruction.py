"""Instruction-following domain: a short writing task with one or two IFEval constraints.

Prompts read "Write about the fox." followed by the constraints in words;
metadata carries Google IFEval's `instruction_id_list` and `kwargs` (one dict
per instruction, `{}` for those without arguments), checked by the
`instruction_following` verifier. The constraint types used (their ids are
Google's):

  change_case:english_lowercase / english_capital, length_constraints:number_words
  (less than / at least), keywords:existence, keywords:forbidden_words,
  startend:end_checker, punctuation:no_comma, detectable_format:title,
  startend:quotation, detectable_content:postscript.

Gold answers are assembled from short frames and checked here with the same
semantics before they are kept (`check`), so every gold answer passes. The
forbidden word is always one the default frames use, so the constraint bites.
The split key is (topic, constraints with their arguments).
"""

from __future__ import annotations

import random
import re
from typing import Any

from tiny_world import common

DOMAIN = 'instruction_following'
HELDOUT_PERCENT = 10

ADJECTIVES = (
    'bright quiet gentle strong small large warm cold soft loud calm wild happy busy clever '
    'brave proud shy swift slow sweet fresh green golden dusty rusty shiny smooth rough heavy '
    'light ancient modern simple famous lovely noisy peaceful curious friendly graceful sturdy '
    'tiny giant humble lively cheerful patient playful rare tidy useful').split()
# Frames of the body sentence; a* are adjectives. Forbidden words come from FILLERS,
# which appear in some frames and not in others.
FRAMES = (
    '{T} is {a1} and {a2}.', '{T} is very {a1}.', 'I think {tp} is really {a1}.',
    '{T} seems quite {a1} to me.', '{T} is always {a1} and {a2}.', '{T} is {a1}, {a2} and {a3}.',
    'To me, {tp} is {a1}.',
)
# Frames for the case constraints: langdetect reads these as English in upper and
# lower case whatever its seed (see `check`).
CASE_FRAMES = ('I think {tp} is {a1} and {a2}.', 'I really like {tp} because it is {a1}.',
               'I think that {tp} is {a1}.', 'I really think that {tp} is {a1}.')
FILLERS = ('very', 'really', 'quite', 'always', 'and', 'think', 'seems')
EXTRA = ('It is also {a}.', 'I like it a lot.', 'Everyone agrees on that.', 'It feels {a} today.')
END_PHRASES = ('That is all.', 'The end.', 'Thank you.', 'Any questions?', 'See you soon.',
               'Have a nice day.', 'Bye for now.')
PS_NOTES = ('P.S. I mean it.', 'P.S. Go see it.', 'P.S. Tell a friend.')

KINDS = ('lowercase', 'capital', 'words_lt', 'words_ge', 'keyword', 'forbidden', 'end',
         'no_comma', 'title', 'quote', 'postscript')
IDS = {
    'lowercase': 'change_case:english_lowercase', 'capital': 'change_case:english_capital',
    'words_lt': 'length_constraints:number_words', 'words_ge': 'length_constraints:number_words',
    'keyword': 'keywords:existence', 'forbidden': 'keywords:forbidden_words',
    'end': 'startend:end_checker', 'no_comma': 'punctuation:no_comma',
    'title': 'detectable_format:title', 'quote': 'startend:quotation',
    'postscript': 'detectable_content:postscript',
}
_CONFLICTS = {frozenset(p) for p in (('lowercase', 'capital'), ('words_lt', 'words_ge'),
                                     ('quote', 'end'), ('quote', 'postscript'),
                                     ('keyword', 'forbidden'), ('words_lt', 'postscript'),
                                     ('words_lt', 'title'),
                                     # Capitals tokenize letter by letter: keep them short.
                                     ('capital', 'words_ge'))}


def _draw_kwargs(kind: str, rng: random.Random) -> dict[str, Any]:
  """The IFEval kwargs of one constraint of `kind` ({} for those without)."""
  if kind == 'words_lt':
    return {'num_words': rng.randint(5, 8), 'relation': 'less than'}
  if kind == 'words_ge':
    return {'num_words': rng.randint(9, 13), 'relation': 'at least'}
  if kind == 'keyword':
    return {'keywords': [rng.choice(ADJECTIVES)]}
  if kind == 'forbidden':
    return {'forbidden_words': [rng.choice(FILLERS)]}
  if kind == 'end':
    return {'end_phrase': rng.choice(END_PHRASES)}
  if kind == 'postscript':
    return {'postscript_marker': 'P.S.'}
  if kind in KINDS:
    return {}
  raise ValueError(f'unknown constraint kind {kind!r}')


def _describe(kind: str, kw: dict[str, Any]) -> tuple[str, str]:
  """(prompt text, thinking note) of one constraint."""
  return {
      'lowercase': lambda: ('Use only lowercase letters.', 'lowercase'),
      'capital': lambda: ('Use only capital letters.', 'capitals'),
      'words_lt': lambda: (f'Use fewer than {kw["num_words"]} words.',
                           f'under {kw["num_words"]} words'),
      'words_ge': lambda: (f'Use at least {kw["num_words"]} words.', f'{kw["num_words"]}+ words'),
      'keyword': lambda: (f'Include the word {kw["keywords"][0]}.', f'use {kw["keywords"][0]}'),
      'forbidden': lambda: (f'Do not say {kw["forbidden_words"][0]}.',
                            f'avoid {kw["forbidden_words"][0]}'),
      'end': lambda: (f'End with "{kw["end_phrase"]}"', f'end "{kw["end_phrase"]}"'),
      'no_comma': lambda: ('Do not use commas.', 'no commas'),
      'title': lambda: ('Add a title in <<>>.', 'title'),
      'quote': lambda: ('Wrap it in double quotes.', 'quotes'),
      'postscript': lambda: ('Add a P.S. at the end.', 'P.S.'),
  }[kind]()


def _freeze(kw: dict[str, Any]) -> tuple:
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items()))


def _thaw(items: tuple) -> dict[str, Any]:
  return {k: list(v) if isinstance(v, tuple) else v for k, v in items}


def check(text: str, kind: str, kwargs: dict[str, Any]) -> bool:
  """Whether `text` follows one constraint, with Google IFEval's semantics.

  The case constraints' language test (langdetect says English) is not run
  here: it costs ~5 ms a call. Case-constrained answers use CASE_FRAMES, whose
  texts stayed English under langdetect seeds 0-5 in a probe (0 of 240 per
  frame), while short upper-case texts of other frames flipped to German or
  Somali under some seed up to 95 % of the time.

  Args:
    text: the answer.
    kind: one of KINDS.
    kwargs: the constraint's IFEval kwargs.

  Returns:
    True iff followed.
  """
  if kind == 'lowercase':
    return text == text.lower()
  if kind == 'capital':
    return text == text.upper()
  if kind in ('words_lt', 'words_ge'):
    n = common.count_words(text)
    return n < kwargs['num_words'] if kwargs['relation'] == 'less than' \
        else n >= kwargs['num_words']
  if kind == 'keyword':
    return all(re.search(k, text, re.IGNORECASE) for k in kwargs['keywords'])
  if kind == 'forbidden':
    return not any(re.search(rf'\b{w}\b', text, re.IGNORECASE)
                   for w in kwargs['forbidden_words'])
  if kind == 'end':
    return text.strip().lower().endswith(kwargs['end_phrase'].strip().lower())
  if kind == 'no_comma':
    return ',' not in text
  if kind == 'title':
    return any(t.lstrip('<').rstrip('>').strip() for t in re.findall(r'<<[^\n]+>>', text))
  if kind == 'quote':
    t = text.strip()
    return len(t) > 1 and t[0] == '"' and t[-1] == '"'
  if kind == 'postscript':
    return re.search(r'\s*p\.\s?s\..*$', text.lower(), flags=re.MULTILINE) is not None
  raise ValueError(f'unknown constraint kind {kind!r}')


def _compose(topic: str, cons: list[tuple[str, dict[str, Any]]], rng: random.Random) -> str:
  """One candidate gold answer for a topic under constraints (may still fail `check`)."""
  kinds = {k for k, _ in cons}
  kw = {k: a for k, a in cons}
  cased = kinds & {'lowercase', 'capital'}
  frames = [f for f in (CASE_FRAMES if cased else FRAMES)
            if not ('no_comma' in kinds and ',' in f)
            and not any(re.search(rf'\b{w}\b', f) for w in
                        kw.get('forbidden', {}).get('forbidden_words', []))]
  if 'words_lt' in kinds and not cased:
    frames = ['{T} is {a1}.']
  if not frames:
    return ''
  adjs = rng.sample(ADJECTIVES, 3)
  if 'keyword' in kinds:
    adjs[0] = kw['keyword']['keywords'][0]
  tp = common.topic_phrase(topic)
  body = rng.choice(frames).format(T=tp[0].upper() + tp[1:], tp=tp, a1=adjs[0], a2=adjs[1],
                                   a3=adjs[2])
  parts = [body]
  if 'words_ge' in kinds:
    extras = list(EXTRA)
    rng.shuffle(extras)
    while common.count_words(' '.join(parts)) < kw['words_ge']['num_words'] and extras:
      parts.append(extras.pop().format(a=rng.choice(ADJECTIVES)))
  if 'postscript' in kinds:
    parts.append(rng.choice(PS_NOTES))
  if 'end' in kinds:
    parts.append(kw['end']['end_phrase'])
  text = ' '.join(parts)
  if 'title' in kinds:
    text = f'<<{tp.title()}>>\n{text}'
  if 'quote' in kinds:
    text = f'"{text}"'
  if 'lowercase' in kinds:
    text = text.lower()
  if 'capital' in kinds:
    text = text.upper()
  return text


def draw_key(rng: random.Random) -> tuple:
  """A key: (topic, ((kind, frozen kwargs), ...)) with one or two compatible constraints."""
  topic = rng.choice(common.ALL_TOPICS)
  while True:
    kinds = rng.sample(KINDS, 1 if rng.random() < 0.5 else 2)
    if frozenset(kinds) not in _CONFLICTS:
      break
  return topic, tuple((k, _freeze(_draw_kwargs(k, rng))) for k in kinds)


def flaw(p: common.Problem, rng: random.Random) -> str:
  """An imperfect teacher's answer to `p`: written for all its constraints but one.

  Returns '' when no such answer fails the dropped constraint (some answers
  meet a constraint by chance).
  """
  topic, frozen = p.key
  cons = [(k, _thaw(items)) for k, items in frozen]
  kept = list(cons)
  kept.pop(rng.randrange(len(kept)))
  for _ in range(10):
    answer = _compose(topic, kept, rng)
    if answer and not all(check(answer, k, a) for k, a in cons):
      return answer
  return ''


def realize(key: tuple, rng: random.Random) -> common.Problem | None:
  """The problem of a key, or None when no frame gives a gold answer that passes."""
  topic, frozen = key
  cons = [(k, _thaw(items)) for k, items in frozen]
  for _ in range(10):
    answer = _compose(topic, cons, rng)
    if answer and all(check(answer, k, a) for k, a in cons):
      break
  else:
    return None
  described = [_describe(k, a) for k, a in cons]
  prompt = ' '.join([f'Write about {common.topic_phrase(topic)}.'] + [d[0] for d in described])
  thinking = f'Topic: {topic}. Rules: ' + ', '.join(d[1] for d in described) + '.'
  metadata = {'instruction_id_list': [IDS[k] for k, _ in cons], 'kwargs': [a for _, a in cons]}
  return common.Problem(key=key, prompt=prompt, answer=answer, thinking=thinking,
                        metadata=metadata)
