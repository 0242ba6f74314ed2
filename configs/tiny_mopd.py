"""The tiny world in the Cascade-2 order, with multi-domain on-policy distillation (MOPD).

  python -m cascade.main --config=configs/tiny_mopd.py --workdir=runs/tiny_mopd

SFT -> IF-RL -> multi-domain RL (math + code) -> reward model -> RLHF ->
MOPD (all domains; each domain's teacher is the earlier stage with its best
validation score, so a domain that a later stage degraded is pulled back) ->
SWE RL. Every domain has a validation set (held-out problems 400-499 of the
world, disjoint from the 200 the matrix reports), scored at every stage end
and every `eval.eval_every` steps inside a stage (off here; e.g.
`--config.eval.eval_every=5`). The stages reuse configs/tiny.py's settings (model, world, lengths,
prompts x G, the per-domain learning rates); the scale-sized recipe is
configs/nemotron_cascade2.py. Smoke mode (`configs/tiny_mopd.py:smoke`,
~100 s) checks the plumbing; docs/science.md gives its full runs on the heterogeneous
world (`world=hetero`) over three seeds, against the same cascade without
MOPD (`drop=mopd`).

Arguments: as configs/tiny.py (configs/_tiny_common.py lists them).
"""

from configs import _tiny_common as common


def get_config(arg=None):
  c, a = common.base_config(arg, validation=True)
  if a['order'] != 'cascade1':
    raise ValueError(f"config argument order={a['order']}: configs/tiny_mopd.py has Cascade "
                     "2's order already")
  rl = lambda name, doms, n, lr, **kw: common.rl_stage(a, name, doms, n, lr, **kw)
  c.stages = common.keep_stages(a, [
      common.sft_stage(a),
      rl('if_rl', ['instruction_following'], 20, 5e-5),
      rl('multi_rl', ['math', 'code'], 30, 4e-5, filter_overlong=True),
      common.rm_stage(a),
      rl('rlhf', ['chat'], 25, 5e-5),
      # MOPD: reverse-KL token advantages against the teachers; no reward, no
      # group filtering (G only sets the samples per prompt).
      rl('mopd', list(common.DOMAINS), 20, 5e-5, kind='mopd', group_size=4,
         dynamic_filter=False, refill_cap=0),
      rl('swe_rl', ['swe'], 15, 3e-5, filter_overlong=True),
  ])
  # The reward model scores MOPD's chat rollouts too, which may run to its length.
  for s in c.stages:
    if s['kind'] == 'reward_model':
      s['score_max_len'] = max(st['max_prompt_len'] + st['max_response_len']
                               for st in c.stages if 'chat' in st['domains']
                               and 'max_response_len' in st)
  common.apply_fast_path(c, a)   # config argument fast_path (else unchanged)
  common.apply_routing_replay(c, a)   # config argument routing_replay=MODE (else unchanged)
  return c
