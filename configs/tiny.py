"""The tiny cascade: SFT -> reward model -> RLHF -> IF-RL -> Math RL -> Code RL -> SWE RL.

  python -m cascade.main --config=configs/tiny.py --workdir=runs/tiny     # = make demo
  python -m cascade.main --config=configs/tiny.py:smoke --workdir=/tmp/t  # 2 steps per stage

On the generated tiny world (cascade/tiny_world; the config's `prepare` step,
cascade/tiny_world/build.py, builds it into runs/tiny_world/seed<seed> on
first use, ~10 s) with a 0.9M-parameter
Qwen3-like model, in instruct mode. SFT sees both modes; part of each
domain's SFT data carries the domain's systematic "imperfect teacher"
mistake (cascade/tiny_world/build.py: FLAW_RATE), which that domain's RL stage
unlearns. Every RL stage is strictly on-policy GRPO (no KL, token-level
loss, 16 prompts x 8 samples, temperature 0.8) on its own domain; steps and
learning rates are per stage: the math stage learns fastest and, run longer
(25 steps at 7e-5: math +43.5), cost IF 7.8 points; code and SWE truncated
rollouts carry no loss. Held-out scores: 2 samples x 200 prompts per domain
at temperature 0.6, top-p 0.95 (the paper's evaluation sampling), by each
domain's real verifier (chat: the world's hidden quality rule, not the reward
model RLHF trained on).

Arguments: see configs/_tiny_common.py (`smoke`, `seed=N`, `root=DIR`).

Measured (seed 0, 2 idle CPU cores): 8 min 17 s for `make demo` in a fresh
clone, world build included (SFT 160 s, reward model
35 s, RL stages 25-60 s each, ~15 s per evaluation row, the rest
compiling, checkpoints and HF exports), and

  stage    chat          code          IF            math          swe
  sft      37.1          38.5          35.8          32.5          38.7
  rlhf     74.6 (+37.6)  41.2 (+2.8)   39.0 (+3.2)   34.5 (+2.0)   39.1 (+0.4)
  if_rl    70.9 (-3.7)   41.8 (+0.5)   59.8 (+20.8)  37.0 (+2.5)   38.8 (-0.2)
  math_rl  70.9 (-0.1)   43.0 (+1.2)   59.0 (-0.8)   72.8 (+35.8)  38.3 (-0.5)
  code_rl  70.2 (-0.6)   70.8 (+27.8)  58.5 (-0.5)   74.2 (+1.5)   39.8 (+1.5)
  swe_rl   70.6 (+0.4)   70.8 (+0.0)   59.5 (+1.0)   72.8 (-1.5)   65.7 (+25.9)

(on this project's 2-core machines; XLA:CPU's kernels depend on the CPU, so
another machine type prints a nearby table — an earlier one ended at 74.5 /
70.5 / 56.8 / 77.0 / 62.6)

Other seeds: README (benchmarks/cascade_vs_blended.py).

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
  c.stages = [
      common.sft_stage(a),
      common.rm_stage(a),
      rl('rlhf', 'chat', 25, 5e-5),
      rl('if_rl', 'instruction_following', 20, 5e-5),
      rl('math_rl', 'math', 10, 4e-5),
      rl('code_rl', 'code', 20, 4e-5, filter_overlong=True),
      rl('swe_rl', 'swe', 15, 3e-5, filter_overlong=True),
  ]
  return c


def get_hyper(h):
  """Seeds x RL learning rates (scaled together) x group size; see the module docstring."""
  c = get_config()
  return h.product([
      h.sweep('seed', [0, 1]),
      h.stages(c, 'optimizer.lr', lambda st: [st['optimizer']['lr'] * f for f in (0.5, 1, 2)]),
      h.stages(c, 'group_size', [4, 8]),
  ])
