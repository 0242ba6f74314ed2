"""Writes a tiny world: every domain's datasets and a SentencePiece tokenizer, from a seed.

  from tiny_world import world
  paths = world.write('runs/tiny/world', seed=0)
  paths['math']['rl_train']      # -> 'runs/tiny/world/math/rl_train.jsonl'
  paths['tokenizer']             # -> 'runs/tiny/world/tokenizer.model'

Files written under `out_dir` (JSONL in cascade.data's canonical formats):

  <domain>/sft_train.jsonl     SFT records (response + thinking), train split
  <domain>/rl_train.jsonl      prompt records with verifier metadata, train split,
                               problems distinct from the SFT ones
  <domain>/heldout.jsonl       prompt records, held-out split (evaluation)
  <domain>/sft_heldout.jsonl   the same held-out problems with gold answers
                               (held-out SFT loss; never train on it)
  chat/preference_train.jsonl, chat/preference_heldout.jsonl
                               graded (chosen, rejected) pairs for the reward model
  tokenizer.model / .vocab     SentencePiece trained on the train-split text
  manifest.json                seed, sizes, record counts, paths

Domains and their verifiers: chat ('tiny_chat_quality' for the true score;
the learned reward model for RLHF), instruction_following, math, code, swe.
The output is a pure function of (seed, sizes, vocab_size): same arguments,
byte-identical files. Held-out/train membership does not depend on the seed
(see common.split_of).

Flawed demonstrations (`flaw_rate`): a fraction of each domain's SFT
records can come from an "imperfect teacher" whose answers carry the
domain's systematic mistake (`<generator>.flaw`): chat answers broken on two
of the four quality criteria, IF answers written for all constraints but
one, math answers that box the first step's value, code that prints instead
of returning, no-op SWE patches. SFT imitates both teachers, so the SFT
policy makes these mistakes at about that rate; the domain's verifier scores
them low (tests/cascade/test_tiny_world.py), and each RL stage's job is to
unlearn its domain's mistake. build.py sets the demo world's rates and
sizes and caches the world per seed.

Using it:
  * The verifier 'tiny_chat_quality' (chat's eval_verifier) is chat.QualityVerifier,
    which importing `tiny_world` (any of its modules) registers with `verifiers`.
  * Render prompts with foundation.chat.render(messages, thinking=...) and SFT
    targets with chat.render_response(response, thinking or None); both
    modes share `response`, so the math answer restates its working.
  * Tokens (vocab 1024, seed 0; mean/max): instruct-mode prompts chat 25/29,
    IF 32/44, math 36/39, code 38/44, SWE 67/84; gold answers with the stop
    token chat 14/28, IF 21/57 (upper-case answers are tokenized letter by
    letter), math 20/24, code 11/18, SWE 34/39; thinking mode adds 8-18.
  * build.py's docstring has what SFT and per-domain GRPO reached on an
    earlier version of this world (no flaws, harder math, whole-function code
    answers).
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Iterable, Mapping

from foundation import chat as chat_lib
from foundation import tokenizer as tokenizer_lib
from tiny_world import arithmetic
from tiny_world import chat
from tiny_world import code_tasks
from tiny_world import common
from tiny_world import instruction
from tiny_world import swe_tasks

GENERATORS = {m.DOMAIN: m for m in (chat, instruction, arithmetic, code_tasks, swe_tasks)}
DOMAINS = tuple(GENERATORS)
FILES = ('sft_train', 'rl_train', 'heldout', 'sft_heldout')


def _rng(seed: int, *parts: str) -> random.Random:
  # String seeds hash with SHA-512 in CPython: stable across runs and PYTHONHASHSEED.
  return random.Random('/'.join(['tiny_world', str(seed), *parts]))


def _write(path: str, records: Iterable[dict[str, Any]]) -> int:
  n = 0
  with open(path, 'w', encoding='utf-8') as f:
    for rec in records:
      f.write(json.dumps(rec, ensure_ascii=False) + '\n')
      n += 1
  return n


def generate(domain: str, seed: int, sft: int, rl: int, heldout: int, flaw_rate: float = 0.0,
             generator=None) -> dict[str, list[dict[str, Any]]]:
  """One domain's records (no files).

  Args:
    domain: one of DOMAINS.
    seed: the world's seed.
    sft: SFT records (train split).
    rl: RL prompt records (train split, problems distinct from the SFT ones).
    heldout: held-out problems (as prompt and as SFT records).
    flaw_rate: fraction of SFT records whose response is the domain's flawed
      demonstration (`<generator>.flaw`: an imperfect teacher's systematic
      mistake, which the domain's verifier scores below the gold answer) and
      that carry `"flawed": true`. Held-out and RL records are never flawed.
    generator: the module generating the domain's problems (default:
      GENERATORS[domain]; the heterogeneous world's math is arithmetic_long).

  Returns:
    {'sft_train', 'rl_train', 'heldout', 'sft_heldout'} -> records.
  """
  if domain not in GENERATORS:
    raise ValueError(f'unknown tiny-world domain {domain!r}; known: {DOMAINS}')
  gen = generator or GENERATORS[domain]
  draw = lambda split, n: common.draw_unique(
      domain, split, n, gen.HELDOUT_PERCENT, gen.draw_key, gen.realize,
      _rng(seed, domain, split), split_key=getattr(gen, 'split_key', None))
  train, held = draw(common.TRAIN, sft + rl), draw(common.HELDOUT, heldout)
  if not 0.0 <= flaw_rate <= 1.0:
    raise ValueError(f'{domain}: flaw_rate={flaw_rate!r} must be in [0, 1]')
  rid = lambda split, i: f'{domain}/{split}/{i:05d}'
  flaw_rng = _rng(seed, domain, 'flaw')
  sft_records = []
  for i, p in enumerate(train[:sft]):
    rec = common.sft_record(domain, rid('sft', i), p)
    if flaw_rng.random() < flaw_rate:
      flawed = gen.flaw(p, flaw_rng)
      if flawed:
        rec.update(response=flawed, flawed=True)
    sft_records.append(rec)
  return {
      'sft_train': sft_records,
      'rl_train': [common.prompt_record(domain, rid('rl', i), p)
                   for i, p in enumerate(train[sft:])],
      'heldout': [common.prompt_record(domain, rid('heldout', i), p) for i, p in enumerate(held)],
      'sft_heldout': [common.sft_record(domain, rid('heldout', i), p)
                      for i, p in enumerate(held)],
  }


def preferences(seed: int, split: str, n: int) -> list[dict[str, Any]]:
  """`n` chat preference records whose topics fall in `split`."""
  rng, out = _rng(seed, 'preference', split), []
  while len(out) < n:
    key = chat.draw_key(rng)
    if common.split_of(chat.DOMAIN, chat.split_key(key), chat.HELDOUT_PERCENT) != split:
      continue
    p, chosen, rejected = chat.preference_pair(key, rng)
    out.append({'id': f'chat/preference_{split}/{len(out):05d}', 'domain': chat.DOMAIN,
                'messages': [{'role': 'user', 'content': p.prompt}],
                'chosen': chosen, 'rejected': rejected})
  return out


def corpus(records: Iterable[dict[str, Any]]) -> list[str]:
  """Tokenizer training text: each record rendered as the model will see it.

  SFT records give both modes (instruct and thinking) with their ChatML
  wrapping, prompt records the prompt in both modes, preference records the
  prompt with each answer.
  """
  texts = []
  for rec in records:
    msgs = rec['messages']
    if 'response' in rec:
      texts.append(chat_lib.render(msgs, thinking=False)
                   + chat_lib.render_response(rec['response']))
      texts.append(chat_lib.render(msgs, thinking=True)
                   + chat_lib.render_response(rec['response'], rec['thinking']))
    elif 'chosen' in rec:
      for answer in (rec['chosen'], rec['rejected']):
        texts.append(chat_lib.render(msgs, thinking=False) + chat_lib.render_response(answer))
    else:
      texts.append(chat_lib.render(msgs, thinking=False))
      texts.append(chat_lib.render(msgs, thinking=True))
  return texts


def write(out_dir: str, seed: int = 0, *, sft: int | Mapping[str, int] = 2000, rl: int = 2000,
          heldout: int = 1000, preference: int = 4000, preference_heldout: int = 500,
          vocab_size: int = 1024, domains: Iterable[str] = DOMAINS,
          flaw_rate: float | Mapping[str, float] = 0.0,
          generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Writes the tiny world's datasets and tokenizer under `out_dir`.

  Args:
    out_dir: a local output directory (created; existing files of the same names
      are overwritten; SentencePiece trains into local files: build.py uploads a
      world meant for gs://).
    seed: the world's seed (problem draws and wording; not the split).
    sft: SFT records per domain (one number, or domain -> number).
    rl: RL prompt records per domain (distinct problems from the SFT ones).
    heldout: held-out problems per domain.
    preference: chat preference pairs for reward-model training.
    preference_heldout: chat preference pairs on held-out topics.
    vocab_size: SentencePiece vocabulary size (> 265: 4 control, 256 byte and
      5 chat special pieces are always there).
    domains: which domains to write (the tokenizer sees only these).
    flaw_rate: fraction of flawed SFT demonstrations (see `generate`), one
      number or domain -> number (missing domains: 0).
    generators: domain -> generator module replacing GENERATORS' for that
      domain (build.py's heterogeneous world: math -> arithmetic_long).

  Returns:
    {'tokenizer': path, 'manifest': path, <domain>: {<file name>: path}}; chat
    also has 'preference_train' and 'preference_heldout'.
  """
  domains = tuple(domains)
  per_domain = lambda x, default: ({d: x.get(d, default) for d in domains}
                                   if isinstance(x, Mapping) else dict.fromkeys(domains, x))
  sft, flaw_rate = per_domain(sft, 0), per_domain(flaw_rate, 0.0)
  sizes = [(f'sft[{d}]', n) for d, n in sft.items()] + [
      ('rl', rl), ('heldout', heldout), ('preference', preference),
      ('preference_heldout', preference_heldout)]
  for name, n in sizes:
    if n < 0:
      raise ValueError(f'{name}={n}: sizes must be >= 0')
  os.makedirs(out_dir, exist_ok=True)
  paths: dict[str, Any] = {}
  counts: dict[str, dict[str, int]] = {}
  train_records = []
  for domain in domains:
    records = generate(domain, seed, sft[domain], rl, heldout, flaw_rate[domain],
                       (generators or {}).get(domain))
    if domain == chat.DOMAIN:
      records['preference_train'] = preferences(seed, common.TRAIN, preference)
      records['preference_heldout'] = preferences(seed, common.HELDOUT, preference_heldout)
    os.makedirs(os.path.join(out_dir, domain), exist_ok=True)
    paths[domain], counts[domain] = {}, {}
    for name, recs in records.items():
      path = os.path.join(out_dir, domain, f'{name}.jsonl')
      counts[domain][name] = _write(path, recs)
      paths[domain][name] = path
    train_records += records['sft_train'] + records['rl_train'] + records.get(
        'preference_train', [])
  prefix = os.path.join(out_dir, 'tokenizer')
  tokenizer_lib.train_sentencepiece(corpus(train_records), prefix, vocab_size)
  paths['tokenizer'] = f'{prefix}.model'
  paths['manifest'] = os.path.join(out_dir, 'manifest.json')
  manifest = {'seed': seed, 'vocab_size': vocab_size, 'counts': counts,
              'flaw_rate': flaw_rate, 'sizes': {'sft': sft, 'rl': rl, 'heldout': heldout, 'preference': preference,
                        'preference_heldout': preference_heldout},
              'paths': {d: {k: os.path.relpath(v, out_dir) for k, v in paths[d].items()}
                        for d in domains}}
  with open(paths['manifest'], 'w', encoding='utf-8') as f:
    json.dump(manifest, f, indent=1)
  return paths
