"""The tiny cascade: SFT -> reward model -> RLHF -> IF-RL -> Math RL -> Code RL -> SWE RL.

  python -m cascade.main --config=configs/tiny.py --workdir=runs/tiny     # = make demo
  python -m cascade.main --config=configs/tiny.py:smoke --workdir=/tmp/t  # 2 steps per stage

On the generated tiny world (cascade/tiny_world, built into
runs/tiny_world/seed<seed> on first use) with a ~1M-parameter Qwen3-like
model, in instruct mode. Every stage is strictly on-policy GRPO (no KL,
token-level loss) on its own domain; later stages get smaller learning rates
(a large one costs the earlier domains points). Held-out scores are greedy,
on 300 prompts per domain, by each domain's real verifier (chat: the world's
hidden quality rule, not the reward model RLHF trained on).

Arguments: see configs/_tiny_common.py (`smoke`, `seed=N`, `root=DIR`).

Measured: see the README's demo section (filled in from a run).
"""

from configs import _tiny_common as common


def get_config(arg=None):
  c, a = common.base_config(arg)
  rl = lambda name, domain, n, lr: common.rl_stage(a, name, [domain], n, lr)
  c.stages = [
      common.sft_stage(a),
      common.rm_stage(a),
      rl('rlhf', 'chat', 30, 5e-5),
      rl('if_rl', 'instruction_following', 30, 5e-5),
      rl('math_rl', 'math', 30, 5e-5),
      rl('code_rl', 'code', 30, 5e-5),
      rl('swe_rl', 'swe', 30, 5e-5),
  ]
  return c
