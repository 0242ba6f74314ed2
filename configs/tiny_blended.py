"""The blended baseline of configs/tiny.py: the same SFT and reward model, then ONE GRPO stage.

  python -m cascade.main --config=configs/tiny_blended.py --workdir=runs/tiny_blended

The RL stage draws its prompts from all five domains at once (each sample
scored by its own domain's verifier; chat by the reward model) with the
default prompts x G per step, for as many steps as spend the cascade's RL
rollouts (all its stages together); its learning rate is the cascade's
rollout-weighted mean, and truncated rollouts carry no loss if any cascade
stage says so (code RL does). This is the baseline Cascade RL claims to beat;
benchmarks/cascade_vs_blended.py compares the two over seeds.

Arguments: as configs/tiny.py (configs/_tiny_common.py lists them).
"""

from configs import _tiny_common as common
from configs import tiny


def get_config(arg=None):
  c = tiny.get_config(arg)
  stages = list(c.stages)
  rl = [s for s in stages if s['kind'] == 'grpo']
  rollouts = [s['steps'] * s['prompts_per_step'] * s['group_size'] for s in rl]
  lr = sum(n * s['optimizer']['lr'] for n, s in zip(rollouts, rl)) / sum(rollouts)
  a = common.parse_arg(arg)
  blended = common.rl_stage(a, 'blended_rl', list(common.DOMAINS), 1, lr,
                            filter_overlong=any(s['filter_overlong'] for s in rl))
  if not a['smoke']:
    blended['steps'] = max(1, round(sum(rollouts) / (blended['prompts_per_step']
                                                     * blended['group_size'])))
  c.stages = common.continue_past_judge(
      a, [s for s in stages if s['kind'] != 'grpo'] + [blended])
  # The reward model scores the blended stage's chat rollouts, which may run to its length.
  for s in c.stages:
    if s['kind'] == 'reward_model':
      s['score_max_len'] = blended['max_prompt_len'] + blended['max_response_len']
  common.apply_fast_path(c, a)   # config argument fast_path (else unchanged)
  common.apply_routing_replay(c, a)   # config argument routing_replay=MODE (else unchanged)
  return c
