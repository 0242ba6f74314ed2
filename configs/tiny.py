"""The tiny cascade: SFT -> reward model -> RLHF -> IF-RL -> Math RL -> Code RL -> SWE RL.

  python -m cascade.main --config=configs/tiny.py --workdir=runs/tiny     # = make demo
  python -m cascade.main --config=configs/tiny.py:smoke --workdir=/tmp/t  # 2 steps per stage

On the generated tiny world (the top-level tiny_world package; the config's
`prepare` step, tiny_world/build.py, builds it into runs/tiny_world/seed<seed> on
first use, ~10 s) with a 0.9M-parameter
Qwen3-like model, in instruct mode. SFT sees both modes; part of each
domain's SFT data carries the domain's systematic "imperfect teacher"
mistake (tiny_world/build.py: FLAW_RATE), which that domain's RL stage
unlearns. Every RL stage is strictly on-policy GRPO (no KL, token-level
loss, 16 prompts x 8 samples, temperature 0.8) on its own domain; steps and
learning rates are per stage: the math stage learns fastest and, run longer
(25 steps at 7e-5: math +43.5), cost IF 7.8 points; code and SWE truncated
rollouts carry no loss. Held-out scores: 2 samples x 200 prompts per domain
at temperature 0.6, top-p 0.95 (the paper's evaluation sampling), by each
domain's real verifier (chat: the world's hidden quality rule, not the reward
model RLHF trained on).

Arguments: see configs/_tiny_common.py (`smoke`, `seed=N`, `world=hetero`, `rm=generative`,
`eval_every=N`, `drop=STAGE+STAGE`, `order=cascade2`, `guard=warn|stop|repair`, `root=DIR`).

What it prints (seed 0), its time, and why another machine or version prints a nearby
table: README, Quickstart; other seeds, the blended baseline and the ablations:
docs/science.md (benchmarks/cascade_vs_blended.py).

`rm=generative` scores RLHF with a generative reward model instead: a judge
stage (300 SFT steps from the SFT policy on the world's verdict records) whose
P(YES) is the chat reward. Seed 0, alignment stages only
(`rm=generative,drop=if_rl+math_rl+code_rl+swe_rl`): held-out chat 36.8 ->
74.4 with the judge, 36.8 -> 74.7 with the default Bradley-Terry model from the
same SFT policy (docs/tiny_generative_rm.md); the judge stage adds ~12 min of
2 loaded cores.

Sweep (`get_hyper`): 2 run seeds x the RL stages' learning rates (x0.5, x1,
x2, every RL stage at once) x group size (4, 8) = 12 points, each a full
cascade on the same world (the run seed moves the model's initialisation,
the data order and the sampling, not the world):

  python -m launch.sweep --config=configs/tiny.py --workdir_root=runs/sweep --parallel=2

about 12 x 8 min of 2 CPU cores; `--points=0,11` runs two of them, and
`configs/tiny.py:smoke` the same points in smoke mode (~2.5 min each).
Writes a summary table, its JSON and a plot of every point's final matrix
row under the workdir root (launch/sweep.py).
"""

from configs import _tiny_common as common


def get_config(arg=None):
  c, a = common.base_config(arg)
  rl = lambda name, domain, n, lr, **kw: common.rl_stage(a, name, [domain], n, lr, **kw)
  alignment = [common.rm_stage(a), rl('rlhf', 'chat', 25, 5e-5)]
  if_rl = [rl('if_rl', 'instruction_following', 20, 5e-5)]
  c.stages = common.keep_stages(a, [
      common.sft_stage(a),
      *(alignment + if_rl if a['order'] == 'cascade1' else if_rl + alignment),
      rl('math_rl', 'math', 10, 4e-5),
      rl('code_rl', 'code', 20, 4e-5, filter_overlong=True),
      rl('swe_rl', 'swe', 15, 3e-5, filter_overlong=True),
  ])
  common.apply_fast_path(c, a)   # config argument fast_path (else unchanged)
  common.apply_routing_replay(c, a)   # config argument routing_replay=MODE (else unchanged)
  common.fit_reward_model(c)     # config argument guard=repair (else unchanged)
  return c


def get_hyper(h):
  """Seeds x RL learning rates (scaled together) x group size; see the module docstring."""
  c = get_config()
  return h.product([
      h.sweep('seed', [0, 1]),
      h.stages(c, 'optimizer.lr', lambda st: [st['optimizer']['lr'] * f for f in (0.5, 1, 2)]),
      h.stages(c, 'group_size', [4, 8]),
  ])
