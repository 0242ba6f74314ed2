"""The tiny world the demo configs train on: built once per seed, reused while its stamp matches.

  python -m tiny_world.build --seed=0 --root=runs/tiny_world   # = make world
  from tiny_world import build as world_build
  world_build.build(seed=0, root='runs/tiny_world')    # -> 'runs/tiny_world/seed0'

configs/tiny.py (and tiny_blended.py, tiny_mopd.py) name this function as
their `prepare` step and point their datasets and tokenizer at the files it
writes under `<root>/seed<seed>` (`directory`): the world of
tiny_world/world.py at the sizes and flaw rates below, plus
`sft_mixed.jsonl`, every domain's SFT records shuffled together with the
thinking trace dropped from a fixed share of them, so SFT teaches both the
`/think` and the `/no_think` mode (the world's records all carry a trace,
and the SFT stage puts a record with a trace in thinking mode), and
`judge_sft.jsonl`, verdict records that teach a tiny judge P(YES) = the
hidden chat quality (judge_data.py; configs/tiny.py:rm=generative).

`build(seed, root, world='hetero')` (`--world=hetero`; the configs'
`world=hetero` argument) makes the heterogeneous world instead, in
`<root>/hetero_seed<seed>`: the same chat, IF, code and SWE data, but math
problems of three steps whose thinking-mode response (a worked chain checked
backwards, arithmetic_long.py) is about 7x a chat answer, with 90 % of the
math SFT records in thinking mode (WORLDS). It is the world on which
benchmarks/cascade_vs_blended.py measures what length heterogeneity costs a
blended RL stage.

`root` may be `gs://...` (`foundation.paths`): the world is then built in a
local temporary directory and uploaded, `stamp.json` last.

`build` is idempotent: it rebuilds only when `stamp.json` differs from what
this code would write (seed, sizes, vocabulary, flaw rates, SFT mode mix, the
judge records' count and template, and a hash of every generator source in
this package), and writes the stamp
last, so an interrupted build is redone. Same seed and sources, byte-
identical files (tests/cascade/test_tiny_world.py pins seed 0's).

Why each RL stage has something to learn: part of every domain's SFT data
comes from an "imperfect teacher" (FLAW_RATE) with one systematic mistake
per domain that the domain's verifier scores low. SFT imitates it, so the
SFT policy makes that mistake about as often, and the domain's RL stage has
to unlearn it from the reward alone (chat: from the learned reward model).
The rest of each domain's failures are capability (copying an unseen topic
or name, arithmetic), which a 1M-parameter model improves only slowly.

What an earlier version of this world taught (no flaws, harder math, whole-
function code answers; SFT on all domains, then GRPO on one domain at a time
from the SFT weights, 0.9M parameters): after SFT, what fails is mostly
copying from the prompt (the chat or IF topic, the code function's name, the
SWE letter) and arithmetic facts in math. Code (+16 points at temperature
0.7, flat at 1.0, where sampling was far from the under-trained greedy
policy) and SWE (+30 in 40 steps; its similarity reward is dense) improved
under GRPO; chat and IF moved 0-8 points in 60 steps; math had almost no
signal (2-4 of 16 groups) until SFT saw ~300 steps' worth of it, and GRPO at
lr 1e-4 then lost ground. The configs took those levers (a larger math
share of the SFT mix, GRPO temperature 0.8, a learning rate per RL stage);
the flawed demonstrations came later, to give every RL stage a mistake to
unlearn.

This module imports only the standard library at the top, so configs can
read its constants and `directory` without loading the generators.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import sys
import tempfile
from typing import Sequence

# Order of the domains in the world and in the configs.
DOMAINS = ('chat', 'instruction_following', 'math', 'code', 'swe')
# World sizes: SFT records per domain (math, the hardest to learn, gets more),
# RL prompts, held-out problems, chat preference pairs.
SIZES = dict(sft=dict(chat=1500, instruction_following=2000, math=6000, code=2000, swe=1500),
             rl=2000, heldout=600, preference=4000, preference_heldout=500)
# Fraction of each domain's SFT demonstrations that come from an imperfect
# teacher (world.py's `flaw`: chat answers broken on two criteria, an IF
# answer that ignores one constraint, math boxing the first step's value,
# code that prints instead of returning, a no-op SWE patch). SFT imitates
# them; each domain's RL stage has to unlearn them with its verifier's reward.
FLAW_RATE = dict(chat=0.65, instruction_following=0.5, math=0.5, code=0.5, swe=0.6)
# SentencePiece vocabulary size (the configs' model vocab_size must equal it).
VOCAB = 1024
# Fraction of SFT records trained in thinking mode; the rest in instruct mode,
# the mode every RL stage and the evaluation use.
SFT_THINKING_FRACTION = 0.25
SFT_MIXED = 'sft_mixed.jsonl'
# Verdict SFT records for a tiny judge (judge_data.py: chat answers graded by the hidden
# quality rule in a judge template; configs/tiny.py:rm=generative trains its judge on them).
JUDGE_SFT = 'judge_sft.jsonl'
JUDGE_RECORDS = 8000
JUDGE_TEMPLATE = 'compact_yes_no'     # a template of verifiers/judge.py
STAMP = 'stamp.json'
# The worlds `build` makes. 'default' is the demo's. 'hetero' is the heterogeneous world of
# the cascade-vs-blended comparison: its math problems have three steps and a long worked
# trace (arithmetic_long.py: about 90 tokens in thinking mode, where the RL stage and the
# evaluation put math, against 15-25 for a chat or IF answer), and most of its math SFT
# records are in thinking mode. Each entry: domain -> generator module replacing the default
# one, and the SFT thinking fraction per domain.
WORLDS = {
    'default': dict(generators={}, sft_thinking={}),
    'hetero': dict(generators={'math': 'arithmetic_long'}, sft_thinking={'math': 0.9}),
}


def directory(seed: int, root: str, world: str = 'default') -> str:
  """Where `build(seed, root, world)` puts the world (no I/O).

  Args:
    seed: the world's seed.
    root: the cache directory holding one world per seed.
    world: a name in WORLDS.

  Returns:
    `<root>/seed<seed>`, or `<root>/<world>_seed<seed>` for another world than the default.
  """
  _check_world(world)
  return os.path.join(root, f'seed{seed}' if world == 'default' else f'{world}_seed{seed}')


def _check_world(world: str) -> None:
  if world not in WORLDS:
    raise ValueError(f'tiny world {world!r}: expected one of {sorted(WORLDS)}')


def sft_thinking_fraction(domain: str, world: str = 'default') -> float:
  """The share of the domain's SFT records kept in thinking mode in `world`."""
  return WORLDS[world]['sft_thinking'].get(domain, SFT_THINKING_FRACTION)


def _source_hash() -> str:
  """Hash of this package's sources: a changed generator means a new world."""
  h = hashlib.sha256()
  for path in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            '*.py'))):
    with open(path, 'rb') as f:
      h.update(f.read())
  return h.hexdigest()[:16]


def stamp(seed: int, world: str = 'default') -> dict:
  """What `stamp.json` of the seed's world holds when the world is current."""
  _check_world(world)
  return {'seed': seed, 'world': world, 'sizes': SIZES, 'vocab_size': VOCAB,
          'flaw_rate': FLAW_RATE, 'sft_thinking_fraction': {
              d: sft_thinking_fraction(d, world) for d in DOMAINS},
          'judge': {'records': JUDGE_RECORDS, 'template': _judge_template()},
          'source': _source_hash()}


def _judge_template() -> dict:
  # The judge template lives in verifiers/judge.py, outside this package's source hash.
  from tiny_world import judge_data  # pylint: disable=g-import-not-at-top
  return judge_data.template_spec(JUDGE_TEMPLATE)


def build(seed: int, root: str, world: str = 'default') -> str:
  """Builds (or reuses) the tiny world of `seed` under `root`.

  Args:
    seed: the world's seed (problem draws, wording, the SFT mode mix).
    root: the cache directory; the world goes to `directory(seed, root, world)`.
    world: a name in WORLDS.

  Returns:
    The world's directory, holding world.py's files (see world.write),
    `sft_mixed.jsonl`, `judge_sft.jsonl` and `stamp.json`.
  """
  return cached(directory(seed, root, world), stamp(seed, world),
                lambda d, want: _build_into(d, seed, want, world))


def cached(out: str, want: dict, build_into) -> str:
  """`out`, rebuilt by `build_into(local_dir, want)` unless its STAMP already equals `want`.

  `build_into` writes the stamp last, so a crash rebuilds; a gs:// `out` is
  built in a local temporary directory and uploaded, the stamp last.
  """
  from foundation import paths  # pylint: disable=g-import-not-at-top
  if paths.read_json(paths.join(out, STAMP)) == want:
    return out
  if not paths.is_remote(out):
    build_into(out, want)
    return out
  with tempfile.TemporaryDirectory(prefix='tiny_world-') as local:
    build_into(local, want)
    paths.copy_tree(local, out, last=(STAMP,))
  return out


def _build_into(out: str, seed: int, want: dict, name: str = 'default') -> None:
  """Writes the world `name` of `seed` into the local directory `out`, its stamp `want` last."""
  # The generators load the tokenizer libraries; only a build needs them.
  import importlib  # pylint: disable=g-import-not-at-top
  from tiny_world import world  # pylint: disable=g-import-not-at-top
  generators = {d: importlib.import_module(f'tiny_world.{m}')
                for d, m in WORLDS[name]['generators'].items()}
  files = world.write(out, seed=seed, vocab_size=VOCAB, flaw_rate=FLAW_RATE,
                      generators=generators, **SIZES)
  records = []
  for d in DOMAINS:
    with open(files[d]['sft_train'], encoding='utf-8') as f:
      records += [json.loads(line) for line in f]
  rng = random.Random(f'tiny_sft_modes/{seed}')
  rng.shuffle(records)
  with open(os.path.join(out, SFT_MIXED), 'w', encoding='utf-8') as f:
    for rec in records:
      if rng.random() >= sft_thinking_fraction(rec['domain'], name):
        rec = {k: v for k, v in rec.items() if k != 'thinking'}
      f.write(json.dumps(rec, ensure_ascii=False) + '\n')
  from tiny_world import judge_data  # pylint: disable=g-import-not-at-top
  with open(os.path.join(out, JUDGE_SFT), 'w', encoding='utf-8') as f:
    for rec in judge_data.records(seed, JUDGE_RECORDS, JUDGE_TEMPLATE):
      f.write(json.dumps(rec, ensure_ascii=False) + '\n')
  with open(os.path.join(out, STAMP), 'w', encoding='utf-8') as f:   # last: a crash rebuilds
    json.dump(want, f, indent=1)


def main(argv: Sequence[str] | None = None) -> None:
  """`python -m tiny_world.build --seed=N --root=DIR`: builds and prints the directory."""
  parser = argparse.ArgumentParser(prog='python -m tiny_world.build',
                                   description='Builds (or reuses) the tiny world of a seed.')
  parser.add_argument('--seed', type=int, default=0, help='the world seed (default 0)')
  parser.add_argument('--root', default='runs/tiny_world',
                      help='the world cache; the world goes to ROOT/seed<seed>')
  parser.add_argument('--world', default='default', choices=sorted(WORLDS),
                      help="which world (default: the demo's; hetero: long math chains)")
  args = parser.parse_args(argv)
  print(build(args.seed, args.root, args.world))


if __name__ == '__main__':
  main(sys.argv[1:])
