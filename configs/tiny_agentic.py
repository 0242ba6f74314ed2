"""The tiny agentic cascade: SFT on tool-use demonstrations -> tool-use RL -> agentic SWE RL.

  python -m cascade.main --config=configs/tiny_agentic.py --workdir=runs/tiny_agentic
  python -m cascade.main --config=configs/tiny_agentic.py:smoke --workdir=/tmp/ta   # 2 steps

On the tiny agentic world (tiny_world/agentic.py, built by the
config's `prepare` step into <root>/agentic_seed<seed>): a tool-use domain
whose answers only the tools know (a table lookup, a product of 3-4-digit
numbers) and a one-file repository with a failing test to fix through
list/read/search/edit/run-tests tools. The same 0.9M-parameter Qwen3-like
model as configs/tiny.py, with a longer context (an episode is the opening
prompt, up to `max_turns` assistant turns and the tool results between
them). SFT learns every assistant turn of multi-turn demonstrations, half of
which carry a realistic mistake the environment scores 0; each agentic RL
stage (kind 'agentic': GRPO over G = 8 episodes per task, strictly
on-policy, instruct mode) then trains on its domain's environment reward.
Tool calls run in the environments (the SWE tests in the bubblewrap
sandbox); the tool schemas are not rendered into the prompt (the tiny
prompts do not name the tools: the demonstrations teach which tool a task
needs; `render_tools=True`, the default, lists them as Qwen3 does).

Arguments: see configs/_tiny_common.py (`smoke`, `seed=N`, `root=DIR`).

Measured (seed 0, 2 cores shared with other jobs): SFT 400 steps in 5.5 min,
tool_rl 30 steps in 13.6 min, swe_agent_rl 25 steps in 16.7 min, about 2.5 min
per evaluation row; held-out (2 samples x 200 tasks per domain, temperature
0.6):

  stage         swe_agent     tool_use
  sft           51.5          22.0
  tool_rl       52.5 (+1.0)   32.5 (+10.5)
  swe_agent_rl  63.2 (+10.8)  34.0 (+1.5)

(The two RL stages were measured from this config's SFT policy, exported by
a full run, with the SFT stage replaced by an eval stage of that export: the
same stage indices, seeds and data order as the full run. With 15 steps at
3e-5 each the gains were +7.0 and +8.8.)
"""

import os

import ml_collections

from configs import _tiny_common as common
from tiny_world import agentic as world

PREPARE_FN = 'tiny_world.agentic:build'
# Tokens of the opening prompt, and of a whole episode after it (turns and tool results).
PROMPT_LEN = 64
EPISODE_LEN = dict(tool_use=160, swe_agent=224)
TURN_LEN = 96
MAX_TURNS = dict(tool_use=4, swe_agent=6)
EVAL_PROMPTS = 200


def get_config(arg=None):
  a = common.parse_arg(arg)
  world_dir = world.directory(a['seed'], a['root'])
  c = ml_collections.ConfigDict()
  c.seed = a['seed']
  c.prepare = dict(fn=PREPARE_FN, kwargs=dict(seed=a['seed'], root=a['root']))
  c.model = dict(preset='tiny', overrides=dict(
      vocab_size=world.VOCAB, embed_dim=128, num_layers=1 if a['smoke'] else 4, num_heads=4,
      num_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=PROMPT_LEN + max(EPISODE_LEN.values())))
  c.tokenizer = dict(path=os.path.join(world_dir, 'tokenizer.model'))
  c.mesh = dict(shape=None)
  # A turn's prompt is the opening plus the episode so far.
  c.sampler = dict(prompt_buckets=[64, 128, 192, 256, 320], new_token_buckets=[32, 64, 96, 128])
  c.ckpt = dict(every_n_steps=1000, keep=1)
  # More than 3 bad steps in a row (a non-finite or zero gradient) stop the run
  # (cascade/divergence.py); rollbacks=N goes back to a checkpoint at a lower learning rate.
  c.divergence = dict(max_bad_steps=3, rollbacks=0)
  c.eval = dict(num_samples=2, temperature=0.6, top_p=0.95, greedy=False,
                max_new_tokens=max(EPISODE_LEN.values()), max_prompt_len=PROMPT_LEN,
                num_prompts=8 if a['smoke'] else EVAL_PROMPTS, batch_size=128, thinking=False,
                eval_every=0, domains={d: dict(max_new_tokens=n) for d, n in EPISODE_LEN.items()})
  c.datasets = dict(sft=dict(path=os.path.join(world_dir, world.SFT), format='sft'))
  c.domains = dict()
  for d in world.DOMAINS:
    c.datasets[d + '_train'] = dict(path=os.path.join(world_dir, d, 'rl_train.jsonl'),
                                    format='prompt', domain=d)
    c.datasets[d + '_eval'] = dict(path=os.path.join(world_dir, d, 'heldout.jsonl'),
                                   format='prompt', domain=d)
    c.domains[d] = dict(env=d, train=d + '_train', eval=d + '_eval', max_turns=MAX_TURNS[d],
                        max_turn_tokens=TURN_LEN, render_tools=False)
  c.domains.swe_agent.env_options = dict(isolation='bwrap')
  c.allow_config_change = False
  n = common.steps(a, 400)
  c.stages = [
      dict(name='sft', kind='sft', domains=list(world.DOMAINS), datasets=['sft'], steps=n,
           batch_size=24, max_len=PROMPT_LEN + max(EPISODE_LEN.values()),
           optimizer=dict(lr=1e-3, warmup_steps=min(20, n - 1), schedule='cosine',
                          min_lr_ratio=0.1)),
      _rl(a, 'tool_rl', 'tool_use', 30, 6e-5),
      _rl(a, 'swe_agent_rl', 'swe_agent', 25, 5e-5),
  ]
  common.apply_fast_path(c, a)   # config argument fast_path (else unchanged)
  common.apply_routing_replay(c, a)   # config argument routing_replay=MODE (else unchanged)
  return c


def _rl(a, name, domain, steps, lr):
  return dict(name=name, kind='agentic', domains=[domain], steps=common.steps(a, steps),
              optimizer=dict(lr=lr), prompts_per_step=4 if a['smoke'] else 16, group_size=8,
              temperature=0.8, max_prompt_len=PROMPT_LEN, max_response_len=EPISODE_LEN[domain],
              max_turn_tokens=TURN_LEN, thinking_fraction=0.0, refill_cap=2)
