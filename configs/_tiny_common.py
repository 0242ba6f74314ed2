"""Shared pieces of the tiny-world configs (configs/tiny.py, tiny_blended.py, tiny_mopd.py).

The tiny world (cascade/tiny_world) is built deterministically from the seed
into a cache directory, `runs/tiny_world/seed<seed>`, and reused while its
stamp (sizes, flaw rates, SFT mode mix and a hash of the generator
sources) matches; a changed generator rebuilds it. Next to the world's own files it writes
`sft_mixed.jsonl`: every domain's SFT records, shuffled, with the thinking
trace dropped from a fixed fraction of them, so SFT teaches both the `/think`
and the `/no_think` mode (the world's records all carry a trace, and the SFT
stage puts a record with a trace in thinking mode).

Why each RL stage has something to learn: part of every domain's SFT data
comes from an "imperfect teacher" (FLAW_RATE; cascade/tiny_world/world.py)
with one systematic mistake per domain that the domain's verifier scores
low. SFT imitates it, so the SFT policy makes that mistake about as often,
and the domain's RL stage has to unlearn it from the reward alone (chat:
from the learned reward model). The rest of each domain's failures are
capability (copying an unseen topic or name, arithmetic), which a 1M-
parameter model improves only slowly under RL.

Config arguments (`configs/tiny.py:smoke,seed=1`): `smoke` (a few steps per
stage and few held-out prompts, for the smoke test), `seed=N` (world and
model seed, default 0), `root=DIR` (the world cache, default
`<repo>/runs/tiny_world`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
from typing import Any

import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOMAINS = ('chat', 'instruction_following', 'math', 'code', 'swe')
# World sizes: SFT records per domain (math, the hardest to learn, gets more),
# RL prompts, held-out problems, chat preference pairs.
SIZES = dict(sft=dict(chat=1500, instruction_following=2000, math=6000, code=2000, swe=1500),
             rl=2000, heldout=600, preference=4000, preference_heldout=500)
# Fraction of each domain's SFT demonstrations that come from an imperfect
# teacher (tiny_world's `flaw`: chat answers broken on two criteria, an IF
# answer that ignores one constraint, math boxing the first step's value,
# code that prints instead of returning, a no-op SWE patch). SFT imitates
# them; each domain's RL stage has to unlearn them with its verifier's reward.
FLAW_RATE = dict(chat=0.65, instruction_following=0.5, math=0.5, code=0.5, swe=0.6)
VOCAB = 1024
# Fraction of SFT records trained in thinking mode; the rest in instruct mode,
# the mode every RL stage and the evaluation use.
SFT_THINKING_FRACTION = 0.25
# Longest completion each domain needs in instruct mode (its gold responses are
# at most chat 25, IF 56, math 25, code 22, swe 35 tokens, plus the stop token).
RESPONSE_LEN = dict(chat=32, instruction_following=48, math=32, code=32, swe=40)
# Longest rendered instruct-mode prompt per domain (tokens: chat 30, IF 46,
# math 43, code 43, swe 82), rounded up to a sampler bucket. An RL stage's
# train rows are max_prompt_len + max_response_len wide, so tight lengths are
# most of the RL step's cost.
PROMPT_LEN = dict(chat=32, instruction_following=48, math=48, code=48, swe=96)
MAX_PROMPT_LEN = max(PROMPT_LEN.values())
EVAL_PROMPTS = 200


def parse_arg(arg: str | None) -> dict[str, Any]:
  """`'smoke,seed=1,root=/x'` -> {'smoke': True, 'seed': 1, 'root': '/x'} (defaults filled)."""
  out: dict[str, Any] = {'smoke': False, 'seed': 0, 'root': os.path.join(REPO, 'runs',
                                                                         'tiny_world')}
  for part in filter(None, (p.strip() for p in (arg or '').split(','))):
    key, eq, value = part.partition('=')
    if key == 'smoke' and not eq:
      out['smoke'] = True
    elif key == 'seed' and eq:
      try:
        out['seed'] = int(value)
      except ValueError:
        raise ValueError(f'config argument seed={value!r}: not an integer') from None
    elif key == 'root' and eq and value:
      out['root'] = value
    else:
      raise ValueError(f'config argument {part!r}: expected smoke, seed=N or root=DIR')
  return out


def _source_hash() -> str:
  """Hash of the world generators' sources: a changed generator means a new world."""
  from cascade import tiny_world  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256()
  for path in sorted(glob.glob(os.path.join(os.path.dirname(tiny_world.__file__), '*.py'))):
    if os.path.basename(path) != 'probe.py':
      with open(path, 'rb') as f:
        h.update(f.read())
  return h.hexdigest()[:16]


def world(seed: int, root: str) -> str:
  """Builds (or reuses) the tiny world of `seed` under `root`; returns its directory.

  Importing cascade.tiny_world also registers the chat domain's
  'tiny_chat_quality' verifier, which the configs name.
  """
  from cascade import tiny_world  # pylint: disable=g-import-not-at-top
  out = os.path.join(root, f'seed{seed}')
  stamp = {'seed': seed, 'sizes': SIZES, 'vocab_size': VOCAB, 'flaw_rate': FLAW_RATE,
           'sft_thinking_fraction': SFT_THINKING_FRACTION, 'source': _source_hash()}
  stamp_path = os.path.join(out, 'stamp.json')
  if os.path.exists(stamp_path):
    with open(stamp_path, encoding='utf-8') as f:
      if json.load(f) == stamp:
        return out
  paths = tiny_world.build(out, seed=seed, vocab_size=VOCAB, flaw_rate=FLAW_RATE, **SIZES)
  records = []
  for d in DOMAINS:
    with open(paths[d]['sft_train'], encoding='utf-8') as f:
      records += [json.loads(line) for line in f]
  rng = random.Random(f'tiny_sft_modes/{seed}')
  rng.shuffle(records)
  with open(os.path.join(out, 'sft_mixed.jsonl'), 'w', encoding='utf-8') as f:
    for rec in records:
      if rng.random() >= SFT_THINKING_FRACTION:
        rec = {k: v for k, v in rec.items() if k != 'thinking'}
      f.write(json.dumps(rec, ensure_ascii=False) + '\n')
  with open(stamp_path, 'w', encoding='utf-8') as f:   # last: a crash above rebuilds
    json.dump(stamp, f, indent=1)
  return out


def base_config(arg: str | None) -> tuple[ml_collections.ConfigDict, dict[str, Any]]:
  """Everything but the stage list: world, model, sampler, eval, datasets, domains.

  Args:
    arg: the config argument (see parse_arg).

  Returns:
    (config without `stages`, parsed argument).
  """
  a = parse_arg(arg)
  root = world(a['seed'], a['root'])
  c = ml_collections.ConfigDict()
  c.seed = a['seed']
  # ~1M parameters: 4 blocks of width 128 (Qwen3-like, tied embeddings). The
  # smoke run has one block: XLA unrolls the blocks, so compiling (most of a
  # 2-step stage) scales with their number.
  c.model = dict(preset='tiny', overrides=dict(
      vocab_size=VOCAB, embed_dim=128, num_layers=1 if a['smoke'] else 4, num_heads=4,
      num_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=256))
  c.tokenizer = dict(path=os.path.join(root, 'tokenizer.model'))
  c.mesh = dict(shape=None)
  c.sampler = dict(prompt_buckets=sorted(set(PROMPT_LEN.values())),
                   new_token_buckets=sorted(set(RESPONSE_LEN.values()) | {48}))
  c.ckpt = dict(every_n_steps=1000, keep=1)
  # Sampled like the paper's evaluation (temperature 0.6, top-p 0.95), two
  # samples per prompt; every row uses the same key, so rows differ by policy.
  c.eval = dict(num_samples=2, temperature=0.6, top_p=0.95, greedy=False, max_new_tokens=48,
                max_prompt_len=MAX_PROMPT_LEN, num_prompts=8 if a['smoke'] else EVAL_PROMPTS,
                batch_size=256, thinking=False)
  c.datasets = dict(sft=dict(path=os.path.join(root, 'sft_mixed.jsonl'), format='sft'),
                    chat_prefs=dict(path=os.path.join(root, 'chat', 'preference_train.jsonl'),
                                    format='preference', domain='chat'))
  c.domains = dict()
  for d in DOMAINS:
    c.datasets[d + '_train'] = dict(path=os.path.join(root, d, 'rl_train.jsonl'),
                                    format='prompt', domain=d)
    c.datasets[d + '_eval'] = dict(path=os.path.join(root, d, 'heldout.jsonl'),
                                   format='prompt', domain=d)
    c.domains[d] = dict(verifier=d, train=d + '_train', eval=d + '_eval')
  # RLHF trains on the learned reward model's score; the held-out score is the
  # world's hidden quality rule, so reward hacking shows in the table.
  c.domains.chat = dict(verifier='reward_model', reward_model_stage='rm',
                        eval_verifier='tiny_chat_quality', train='chat_train', eval='chat_eval')
  c.allow_config_change = False
  return c, a


def steps(a: dict[str, Any], full: int) -> int:
  """A stage's step count: `full`, or 2 in smoke mode."""
  return 2 if a['smoke'] else full


def sft_stage(a: dict[str, Any]) -> dict[str, Any]:
  """SFT on every domain's records, both modes."""
  n = steps(a, 600)
  return dict(name='sft', kind='sft', domains=list(DOMAINS), datasets=['sft'], steps=n,
              batch_size=24, max_len=256,
              optimizer=dict(lr=1e-3, warmup_steps=min(20, n - 1), schedule='cosine',
                             min_lr_ratio=0.1))


def rm_stage(a: dict[str, Any]) -> dict[str, Any]:
  """The chat reward model, initialised from the SFT policy, on the preference pairs."""
  return dict(name='rm', kind='reward_model', domains=['chat'], datasets=['chat_prefs'],
              steps=steps(a, 100), batch_size=32, max_len=64,
              optimizer=dict(lr=1e-3), init_from='sft')


def rl_stage(a: dict[str, Any], name: str, domains: list[str], n: int, lr: float,
             **kw) -> dict[str, Any]:
  """A GRPO stage in instruct mode (16 prompts x 8 samples per step)."""
  return dict(dict(name=name, kind='grpo', domains=list(domains), steps=steps(a, n),
                   optimizer=dict(lr=lr), prompts_per_step=4 if a['smoke'] else 16,
                   group_size=8, temperature=0.8,
                   max_prompt_len=max(PROMPT_LEN[d] for d in domains),
                   max_response_len=max(RESPONSE_LEN[d] for d in domains),
                   thinking_fraction=0.0, refill_cap=2, filter_overlong=False), **kw)
