"""The blended baseline of configs/tiny.py: the same SFT and reward model, then ONE GRPO stage.

  python -m cascade.main --config=configs/tiny_blended.py --workdir=runs/tiny_blended

The RL stage draws its prompts from all five domains at once (each sample
scored by its own domain's verifier; chat by the reward model) and runs as
many steps, of the same prompts x G, as the cascade's RL stages together, so
both spend the same number of rollouts; its learning rate is the cascade's
step-weighted mean, and truncated rollouts carry no loss if any cascade
stage says so (code RL does). This is the baseline Cascade RL claims to beat;
benchmarks/cascade_vs_blended.py compares the two over seeds.

Arguments: as configs/tiny.py (`smoke`, `seed=N`, `root=DIR`).
"""

from configs import _tiny_common as common
from configs import tiny


def get_config(arg=None):
  c = tiny.get_config(arg)
  stages = list(c.stages)
  rl = [s for s in stages if s['kind'] == 'grpo']
  n = sum(s['steps'] for s in rl)
  lr = sum(s['steps'] * s['optimizer']['lr'] for s in rl) / n
  head = [s for s in stages if s['kind'] != 'grpo']
  c.stages = head + [common.rl_stage(
      common.parse_arg(arg), 'blended_rl', list(common.DOMAINS), n, lr,
      filter_overlong=any(s['filter_overlong'] for s in rl))]
  return c
