"""Shared pieces of the tiny-world configs (configs/tiny.py, tiny_blended.py, tiny_mopd.py).

The configs are data: `get_config` computes every path from the seed and the
world cache `root` and reads or writes nothing. The world itself (datasets,
tokenizer, the mixed-mode `sft_mixed.jsonl`) is the config's `prepare` step,
`tiny_world.build:build(seed, root)`, which writes it to `<root>/seed<seed>`
(or reuses it while its stamp matches) before the run loads data; `make world`
or `python -m tiny_world.build` runs it alone. tiny_world/build.py has the
world's sizes and its "imperfect teacher" flaw rates (why each RL stage has
something to learn).

Config arguments (`configs/tiny.py:smoke,seed=1`): `smoke` (a few steps per
stage and few held-out prompts, for the smoke test), `seed=N` (world and
model seed, default 0), `world=hetero` (the heterogeneous world of
build.py's WORLDS: long math chains in thinking mode), `eval_every=N` (give
every domain a validation set and score it every N steps inside each stage
that trains the policy, as well as at every stage end: a score-vs-time
curve), `drop=rlhf` or `drop=rlhf+if_rl` (leave those stages out: an
ablation; a stage that starts from a dropped one, or a reward that names it,
fails validation: the reward model scores chat, so `rm` stays; a dropped `judge`
fails the run's option check before the first step), `order=cascade2` (configs/tiny.py
only: IF-RL before the reward model and RLHF, Cascade 2's order), `rm=generative`
(chat's RLHF reward from a generative reward model instead of the Bradley-Terry
one: the `judge` stage fine-tunes a copy of the SFT policy on the world's
verdict records (tiny_world/judge_data.py) and the chat domain's training
verifier is 'judge', P(YES) from that stage's policy's next-token logits; the
stage after the judge continues from the policy before it; held-out chat stays
the hidden rule; `rm=bt`, the default, is the reward model stage `rm`),
`fast_path` (the paper recipes' rollout fast path, `configs/_recipes.py: fast_path`: the
paged engine, GRPO's `stream_filter` and a packed update, `pack_tokens` = prompt + longest
response, with pages and decode chunks sized for the tiny world: TINY_PAGED_ENGINE),
`root=DIR` (the world cache, default `<repo>/runs/tiny_world`), `guard=warn|stop|repair`
(regression guards on every domain, `cascade/guard.py`: each domain gets a validation set,
and while a stage trains the domains earlier stages trained are probed every GUARD_EVERY
steps on GUARD_PROMPTS of its prompts; a fall of more than 3 points plus 2 standard errors
(paired prompt by prompt) below a domain's best probe is reported, with `stop` ends the stage at its newest probed
checkpoint within bounds, with `repair` runs the MOPD stage inserted after it, `guard_repair`;
absent: no guard section, the config hashes as without it), `routing_replay=on|measure`
(with `model=hybrid`, a mixture-of-experts policy: every RL stage records its rollouts'
expert choices, and with `on` replays them in the update; absent: off, the config hashes as
without it).
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from configs import _recipes
# Importing the world (any module of it) registers its verifier, 'tiny_chat_quality' (chat's
# eval_verifier), so a config built here validates wherever it is loaded.
from tiny_world import build as world_build
from tiny_world import suites as world_suites

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOMAINS = world_build.DOMAINS
VOCAB = world_build.VOCAB
# Longest completion each domain needs in instruct mode (its gold responses are
# at most chat 25, IF 56, math 25, code 22, swe 35 tokens, plus the stop token).
RESPONSE_LEN = dict(chat=32, instruction_following=48, math=32, code=32, swe=40)
# Longest rendered instruct-mode prompt per domain (tokens: chat 30, IF 46,
# math 43, code 43, swe 82), rounded up to a sampler bucket. An RL stage's
# train rows are max_prompt_len + max_response_len wide, so tight lengths are
# most of the RL step's cost.
PROMPT_LEN = dict(chat=32, instruction_following=48, math=48, code=48, swe=96)
MAX_PROMPT_LEN = max(PROMPT_LEN.values())
# The heterogeneous world (`world=hetero`, build.py's WORLDS): math is trained and scored in
# thinking mode, where its gold responses are 110 tokens on average and at most 127 (three-
# step chains worked forwards and checked backwards), against chat 14 and IF 22 in instruct
# mode. Its math RL stage extends the response cap as it goes (HETERO_MATH_PHASES), the
# length curriculum the paper's math stages use; every other length is the default world's.
HETERO_RESPONSE_LEN = dict(RESPONSE_LEN, math=144)
HETERO_MATH_PHASES = (dict(until_step=5, max_response_len=128),)
THINKING_DOMAINS = dict(default=(), hetero=('math',))
EVAL_PROMPTS = 200
# Prompts of each tiny suite scored after every row (x 4 samples: 128 rows, one sampler call
# per suite; the smoke run's 4 x 4 rows are its domains' 8 x 2, so they compile nothing more).
# Measured on a loaded 2-core host, untrained policy (every row to 48 tokens): the five suites
# took 29 s where the five domains' held-out sets took 95 s.
SUITE_PROMPTS, SMOKE_SUITE_PROMPTS = 32, 4
# Validation sets (base_config(validation=True)): the last third of each heldout.jsonl (rows
# 400.. of the world's 600; the matrix reads the first EVAL_PROMPTS), VALIDATION_PROMPTS of
# them scored.
VALIDATION_PROMPTS = 100
PREPARE_FN = 'tiny_world.build:build'
# Stage orders of configs/tiny.py: Cascade 1's (RLHF, then IF-RL) and Cascade 2's (IF-RL first).
ORDERS = ('cascade1', 'cascade2')
# config argument rm=NAME: chat's RLHF reward, a Bradley-Terry reward model ('bt', stage
# 'rm') or a generative one ('generative': a judge SFT stage, JUDGE_STAGE, read by verifier
# 'judge').
REWARD_MODELS = ('bt', 'generative')
JUDGE_STAGE = 'judge'
# The judge verifier's options in `rm=generative`: the tiny world's compact yes/no template
# (the one its verdict records are written in), P(YES) from the judge's next-token logits.
# Each field is capped at JUDGE_FIELD_TOKENS tokens (a chat answer of the RL stages is at most
# 48), so a judge row stays within the model's 256 positions (tests/configs/test_tiny_configs).
JUDGE_FIELD_TOKENS = 64
JUDGE_OPTIONS = dict(judge='stage:' + JUDGE_STAGE, template=world_build.JUDGE_TEMPLATE,
                     mode='pointwise', score_by='logits', max_field_tokens=JUDGE_FIELD_TOKENS)


# config argument fast_path: _recipes.fast_path with the paged engine sized for the tiny world
# (_recipes.PAGED_ENGINE's page_size 64 and chunk_steps 64 are sized for 10-60K-token rows).
# - page_size 16: a tiny row is at most 96 + 48 = 144 tokens, 9 pages; 64-token pages would
#   leave most of a 32-token response's page empty (rl.sampler's own default is 16 too).
# - chunk_steps 8: a response is 22-56 tokens, so 64 steps per device call would be a whole
#   response and a freed slot would never take a new row before the call ends; 8 lets a
#   finished row's slot refill within a quarter of a 32-token response, at 4-6 host round
#   trips per row.
TINY_PAGED_ENGINE = dict(page_size=16, chunk_steps=8)


def _hybrid_model(smoke: bool) -> dict:
  """A tiny Nemotron-H-like hybrid of width 128: Mamba-2, mixture-of-experts (8 experts, 2 per
  token, a shared expert, sigmoid group-limited routing), attention and MLP layers."""
  return dict(preset='tiny_hybrid', overrides=dict(
      vocab_size=VOCAB, embed_dim=128, layer_types='M*E' if smoke else 'ME*EM-',
      num_layers=3 if smoke else 6, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384,
      max_seq_len=256, mamba_heads=4, mamba_head_dim=32, mamba_groups=2, mamba_state=16,
      mamba_chunk=32, num_experts=8, experts_per_token=2, moe_dim=128, shared_expert_dim=192))


# config argument guard=ACTION (config.guard.action): probes every GUARD_EVERY steps (each stage's
# first and last too) of GUARD_PROMPTS validation prompts per protected domain (smoke: every step,
# 8 prompts).
GUARD_ACTIONS = ('warn', 'stop', 'repair')
# guard=repair: the inserted MOPD stage's step budget and learning rate (tiny_mopd.py's MOPD's).
REPAIR_STEPS = 10
REPAIR_LR = 5e-5
GUARD_EVERY = 5
# 64 (of the 100 validation prompts), not 32: over 32 prompts of 2 samples each the paired
# error of a drop (cascade/guard.py) still left RLHF's fall of instruction following on the
# dense seed 1 inside its bound (docs/self_healing.md, that run's deciding probes); the error
# shrinks as 1/sqrt(prompts). A probe then costs about two training steps of an RL stage.
GUARD_PROMPTS = 64

# config argument model=NAME: the tiny policy's architecture ('dense' is the module's default).
MODELS = {'dense': None, 'hybrid': _hybrid_model}


def parse_arg(arg: str | None) -> dict[str, Any]:
  """`'smoke,seed=1,root=/x'` -> {'smoke': True, 'seed': 1, 'root': '/x'} (defaults filled)."""
  out: dict[str, Any] = {'smoke': False, 'seed': 0, 'world': 'default', 'eval_every': 0,
                         'drop': (), 'order': 'cascade1', 'model': 'dense', 'rm': 'bt',
                         'fast_path': False, 'guard': '', 'routing_replay': '',
                         'root': os.path.join(REPO, 'runs', 'tiny_world')}
  for part in filter(None, (p.strip() for p in (arg or '').split(','))):
    key, eq, value = part.partition('=')
    if key == 'smoke' and not eq:
      out['smoke'] = True
    elif key == 'fast_path' and not eq:
      out['fast_path'] = True
    elif key == 'seed' and eq:
      try:
        out['seed'] = int(value)
      except ValueError:
        raise ValueError(f'config argument seed={value!r}: not an integer') from None
    elif key == 'root' and eq and value:
      out['root'] = value
    elif key == 'eval_every' and eq:
      if not value.isdigit() or int(value) < 1:
        raise ValueError(f'config argument eval_every={value!r}: not an integer >= 1')
      out['eval_every'] = int(value)
    elif key == 'drop' and eq and value:
      out['drop'] = tuple(value.split('+'))
    elif key == 'order' and eq:
      if value not in ORDERS:
        raise ValueError(f'config argument order={value!r}: expected one of {ORDERS}')
      out['order'] = value
    elif key == 'rm' and eq:
      if value not in REWARD_MODELS:
        raise ValueError(f'config argument rm={value!r}: expected one of {REWARD_MODELS}')
      out['rm'] = value
    elif key == 'model' and eq:
      if value not in MODELS:
        raise ValueError(f'config argument model={value!r}: expected one of {sorted(MODELS)}')
      out['model'] = value
    elif key == 'guard' and eq:
      if value not in GUARD_ACTIONS:
        raise ValueError(f'config argument guard={value!r}: expected one of {GUARD_ACTIONS}')
      out['guard'] = value
    elif key == 'routing_replay' and eq:
      if value not in ('on', 'measure'):
        raise ValueError(f"config argument routing_replay={value!r}: expected 'on' or "
                         "'measure'")
      out['routing_replay'] = value
    elif key == 'world' and eq:
      if value not in world_build.WORLDS:
        raise ValueError(f'config argument world={value!r}: expected one of '
                         f'{sorted(world_build.WORLDS)}')
      out['world'] = value
    else:
      raise ValueError(f'config argument {part!r}: expected smoke, fast_path, seed=N, world=NAME, '
                       'eval_every=N, drop=STAGE+STAGE, order=NAME, model=NAME, rm=NAME, '
                       'guard=ACTION, routing_replay=MODE or root=DIR')
  return out


def base_config(arg: str | None,
                validation: bool = False) -> tuple[ml_collections.ConfigDict, dict[str, Any]]:
  """Everything but the stage list: prepare, model, sampler, eval, datasets, domains.

  Args:
    arg: the config argument (see parse_arg).
    validation: give every domain a validation set: held-out problems
      of the last third of the world's heldout.jsonl, disjoint from the
      EVAL_PROMPTS the matrix reports (MOPD's teachers='best' chooses on it).

  Returns:
    (config without `stages`, parsed argument).
  """
  a = parse_arg(arg)
  validation = validation or bool(a['eval_every']) or bool(a['guard'])
  world_dir = world_build.directory(a['seed'], a['root'], a['world'])
  c = ml_collections.ConfigDict()
  c.seed = a['seed']
  # Run before any data is loaded: builds (or reuses) the world the paths below name.
  c.prepare = dict(fn=PREPARE_FN, kwargs=dict(seed=a['seed'], root=a['root']))
  if a['world'] != 'default':
    c.prepare.kwargs.world = a['world']
  # ~1M parameters: 4 blocks of width 128 (Qwen3-like, tied embeddings). The
  # smoke run has one block: XLA unrolls the blocks, so compiling (most of a
  # 2-step stage) scales with their number.
  c.model = dict(preset='tiny', overrides=dict(
      vocab_size=VOCAB, embed_dim=128, num_layers=1 if a['smoke'] else 4, num_heads=4,
      num_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=256))
  if a['model'] != 'dense':
    c.model = MODELS[a['model']](a['smoke'])
  c.tokenizer = dict(path=os.path.join(world_dir, 'tokenizer.model'))
  c.mesh = dict(shape=None)
  c.sampler = dict(prompt_buckets=sorted(set(PROMPT_LEN.values())),
                   new_token_buckets=sorted(set(response_lens(a).values()) | {48} | {
                       p['max_response_len'] for p in phases(a, ['math'])}))
  c.ckpt = dict(every_n_steps=1000, keep=1)
  # More than 3 bad steps in a row (a non-finite or zero gradient) stop the run
  # (cascade/divergence.py); rollbacks=N goes back to a checkpoint at a lower learning rate.
  c.divergence = dict(max_bad_steps=3, rollbacks=0)
  # JAX's persistent compilation cache (cascade/compile_cache.py), so a restart loads what an
  # earlier run compiled: dir None = <workdir>/compilation_cache (or JAX_COMPILATION_CACHE_DIR),
  # '' = off, gs:// allowed; min_compile_secs None = JAX's 1 s. Placeholders typed for
  # --config.compilation_cache.dir=...; not in the config hash.
  c.compilation_cache = dict(dir=ml_collections.config_dict.placeholder(str),
                             min_compile_secs=ml_collections.config_dict.placeholder(float))
  # Sampled like the paper's evaluation (temperature 0.6, top-p 0.95), two
  # samples per prompt; every row uses the same key, so rows differ by policy.
  c.eval = dict(num_samples=2, temperature=0.6, top_p=0.95, greedy=False, max_new_tokens=48,
                max_prompt_len=MAX_PROMPT_LEN, num_prompts=8 if a['smoke'] else EVAL_PROMPTS,
                batch_size=256, thinking=False, eval_every=0)
  if THINKING_DOMAINS[a['world']]:      # those domains are scored in thinking mode
    c.eval.domains = {d: dict(thinking=True, max_new_tokens=response_lens(a)[d])
                      for d in THINKING_DOMAINS[a['world']]}
  # The world's evaluation suites (tiny_world/suites.py) after every row, beside the domains:
  # the first SUITE_PROMPTS held-out prompts of each domain, 4 samples each, avg@4 with its
  # standard error and pass@4 (the papers' protocol machinery, run on every CPU test run).
  c.eval.suites = [s.name for s in world_suites.SUITES]
  c.eval.suite_data = world_dir
  c.eval.suite_prompts = SMOKE_SUITE_PROMPTS if a['smoke'] else SUITE_PROMPTS
  c.eval.suite_batch_size = SUITE_PROMPTS
  if THINKING_DOMAINS[a['world']]:      # their suites sample in that mode and at that length
    c.eval.suite_protocol = {s.name: dict(thinking=True,
                                          max_new_tokens=response_lens(a)[s.domain])
                             for s in world_suites.SUITES
                             if s.domain in THINKING_DOMAINS[a['world']]}
  c.datasets = dict(sft=dict(path=os.path.join(world_dir, 'sft_mixed.jsonl'), format='sft'),
                    chat_prefs=dict(path=os.path.join(world_dir, 'chat', 'preference_train.jsonl'),
                                    format='preference', domain='chat'))
  c.domains = dict()
  for d in DOMAINS:
    c.datasets[d + '_train'] = dict(path=os.path.join(world_dir, d, 'rl_train.jsonl'),
                                    format='prompt', domain=d)
    c.datasets[d + '_eval'] = dict(path=os.path.join(world_dir, d, 'heldout.jsonl'),
                                   format='prompt', domain=d)
    c.domains[d] = dict(verifier=d, train=d + '_train', eval=d + '_eval')
    if validation:
      c.datasets[d + '_val'] = dict(path=os.path.join(world_dir, d, 'heldout.jsonl'),
                                    format='prompt', domain=d,
                                    skip=world_build.SIZES['heldout'] * 2 // 3)
      c.domains[d].validation = d + '_val'
  # Code runs in the bubblewrap sandbox; without it the verifiers refuse to start
  # (`--config.domains.code.verifier_options.isolation=none` opts out, recorded in results.json).
  c.domains.code.verifier_options = dict(isolation='bwrap')
  # RLHF trains on the learned reward model's score; the held-out score is the
  # world's hidden quality rule, so reward hacking shows in the table.
  c.domains.chat = dict(verifier='reward_model', reward_model_stage='rm',
                        eval_verifier='tiny_chat_quality', train='chat_train', eval='chat_eval',
                        **(dict(validation='chat_val') if validation else {}))
  if a['rm'] == 'generative':
    # The judge stage's policy scores RLHF's rollouts (P(YES)); held-out chat stays the rule.
    c.datasets.judge_sft = dict(path=os.path.join(world_dir, world_build.JUDGE_SFT),
                                format='sft', domain='chat')
    c.domains.chat.verifier = 'judge'
    c.domains.chat.verifier_options = dict(JUDGE_OPTIONS)
    c.domains.chat.reward_model_stage = ''
  if validation:
    c.eval.validation_prompts = 8 if a['smoke'] else VALIDATION_PROMPTS
    c.eval.eval_every = a['eval_every']
  if a['guard']:
    c.guard = dict(domains=list(DOMAINS), action=a['guard'],
                   every=1 if a['smoke'] else GUARD_EVERY,
                   prompts=8 if a['smoke'] else GUARD_PROMPTS)
    if a['guard'] == 'repair':
      c.guard.repair = guard_repair(a)
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
                             min_lr_ratio=0.1),
              # eval_every=N draws curves through the RL stages; SFT is scored at its end only.
              **(dict(eval_every=0) if a['eval_every'] else {}))


def rm_stage(a: dict[str, Any]) -> dict[str, Any]:
  """The chat reward model, initialised from the SFT policy: the Bradley-Terry one on the
  preference pairs (`rm=bt`) or the generative one (`rm=generative`, `judge_stage`)."""
  if a['rm'] == 'generative':
    return judge_stage(a)
  return dict(name='rm', kind='reward_model', domains=['chat'], datasets=['chat_prefs'],
              steps=steps(a, 100), batch_size=32, max_len=64,
              optimizer=dict(lr=1e-3), init_from='sft')


def judge_stage(a: dict[str, Any]) -> dict[str, Any]:
  """The generative reward model: the SFT policy fine-tuned on the world's verdict records
  (a chat question and answer in the judge template -> 'Verdict: YES' with probability = the
  answer's hidden quality). A branch: no matrix row, and the cascade does not continue from
  it (`continue_past_judge`)."""
  n = steps(a, 300)
  return dict(name=JUDGE_STAGE, kind='sft', domains=['chat'], datasets=['judge_sft'], steps=n,
              batch_size=24, max_len=256, init_from='sft', evaluate=False,
              optimizer=dict(lr=5e-4, warmup_steps=min(20, n - 1), schedule='cosine',
                             min_lr_ratio=0.1),
              **(dict(eval_every=0) if a['eval_every'] else {}))


def continue_past_judge(a: dict[str, Any], stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """`stages` where the stage right after the judge stage (rm=generative) starts from the
  policy the stage before the judge left, not from the judge's (unless it names its own)."""
  names = [s['name'] for s in stages]
  if a['rm'] != 'generative' or JUDGE_STAGE not in names:
    return stages
  at = names.index(JUDGE_STAGE)
  if 0 < at < len(stages) - 1 and not stages[at + 1].get('init_from'):
    stages[at + 1] = dict(stages[at + 1], init_from=names[at - 1])
  return stages


def response_lens(a: dict[str, Any]) -> dict[str, int]:
  """Each domain's response cap in the world of the config argument."""
  return HETERO_RESPONSE_LEN if a['world'] == 'hetero' else RESPONSE_LEN


def phases(a: dict[str, Any], domains: list[str]) -> list[dict[str, Any]]:
  """The length curriculum of an RL stage on `domains`: the heterogeneous world's math-only
  stage starts at a shorter cap (in smoke mode, for its first step); other stages have none."""
  if a['world'] != 'hetero' or list(domains) != ['math']:
    return []
  return [dict(p, until_step=1) if a['smoke'] else dict(p) for p in HETERO_MATH_PHASES]


def rl_stage(a: dict[str, Any], name: str, domains: list[str], n: int, lr: float,
             **kw) -> dict[str, Any]:
  """A GRPO stage (16 prompts x 8 samples per step), in instruct mode but for the world's
  thinking domains (a stage mixing both gets a thinking fraction per domain)."""
  modes = {d: float(d in THINKING_DOMAINS[a['world']]) for d in domains}
  curriculum = phases(a, domains)
  longest = max(response_lens(a)[d] for d in domains)
  if curriculum:
    curriculum.append(dict(until_step=steps(a, n), max_response_len=longest))
  return dict(dict(name=name, kind='grpo', domains=list(domains), steps=steps(a, n),
                   optimizer=dict(lr=lr), prompts_per_step=4 if a['smoke'] else 16,
                   group_size=8, temperature=0.8,
                   max_prompt_len=max(PROMPT_LEN[d] for d in domains),
                   max_response_len=longest,
                   thinking_fraction=(modes if len(set(modes.values())) > 1
                                      else next(iter(modes.values()))),
                   refill_cap=2, filter_overlong=False,
                   **(dict(phases=curriculum) if curriculum else {})), **kw)


def guard_repair(a: dict[str, Any]) -> dict[str, Any]:
  """config.guard.repair: the MOPD stage inserted after a guarded stage, as tiny_mopd.py's MOPD
  (every domain's lengths, 4 samples per prompt, no filtering) with a REPAIR_STEPS budget."""
  st = rl_stage(a, 'repair', list(DOMAINS), REPAIR_STEPS, REPAIR_LR, kind='mopd', group_size=4,
                dynamic_filter=False, refill_cap=0)
  return {k: v for k, v in st.items() if k not in ('name', 'kind', 'domains')}


def fit_reward_model(c) -> None:
  """With guard=repair, the chat reward model's scorer holds a repair stage's chat rows (its
  prompt + response lengths, every domain's longest): the reward model scores every stage
  sampling chat, config validation checks it."""
  repair = (c.get('guard') or {}).get('repair')
  if not repair:
    return
  for s in c.stages:
    if s['kind'] == 'reward_model':
      s['score_max_len'] = repair['max_prompt_len'] + repair['max_response_len']


def keep_stages(a: dict[str, Any], stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """`stages` without the ones the config argument drops (`drop=rlhf`); an ablation.

  Raises:
    ValueError: `drop` names a stage the config does not have.
  """
  names = [s['name'] for s in stages]
  unknown = [d for d in a['drop'] if d not in names]
  if unknown:
    raise ValueError(f'config argument drop={"+".join(a["drop"])}: no stage named '
                     f'{unknown[0]!r} (stages: {", ".join(names)})')
  return continue_past_judge(a, [s for s in stages if s['name'] not in a['drop']])


def apply_routing_replay(c: ml_collections.ConfigDict, a: dict[str, Any]) -> None:
  """With the config argument `routing_replay=MODE`, sets every RL stage's `routing_replay`
  (the hybrid model's mixture-of-experts routing: recorded, and with 'on' replayed); without
  it, leaves c as it is."""
  if a['routing_replay']:
    c.stages = [dict(st, routing_replay=a['routing_replay'])
                if st['kind'] in ('grpo', 'agentic', 'mopd') else st for st in c.stages]


def apply_fast_path(c: ml_collections.ConfigDict, a: dict[str, Any]) -> None:
  """With the config argument `fast_path`, puts c's RL stages on the recipes' rollout fast path
  (`_recipes.fast_path`) with the tiny world's page and chunk sizes (TINY_PAGED_ENGINE);
  without it, leaves c as it is."""
  if a['fast_path']:
    _recipes.fast_path(c)
    c.sampler.update(TINY_PAGED_ENGINE)
