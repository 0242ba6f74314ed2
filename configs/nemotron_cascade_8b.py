r"""Nemotron-Cascade 8B: Cascade RL on Qwen3-8B, the recipe of arXiv 2512.13607.

Wang et al., "Nemotron-Cascade: Scaling Cascaded Reinforcement Learning for
General-Purpose Reasoning Models", arXiv 2512.13607 (2025). The numbers are
the paper's as configs/PAPERS.md restates them; a comment marks each one that
is uncertain there or not published at all (then it is our choice). The 8B
math recipe rests on a single secondary source (PAPERS.md: "unverified").

    python -m launch.plan --config=configs/nemotron_cascade_8b.py
    python -m cascade.main --config=configs/nemotron_cascade_8b.py:data_root=gs://b/nemotron \
        --workdir=gs://b/runs/cascade8b

Stages: SFT 16K -> SFT 32K -> reward model -> RLHF -> IF-RL (IFEval taxonomy,
then IFBench) -> Math RL (24K -> 32K -> 40K) -> Code RL (56K) -> SWE RL; GRPO strictly on-policy, no
KL, token-level loss, dynamic filtering.

Config argument (`:key=value,...`): data_root, base (the Qwen3-8B-Base HF
directory), tokenizer, hardware ('v5p_128', 'h200x8', '2xh200x8' or '4xh200x8', see
configs/nemotron_cascade_14b.py).

Not reproducible here: the same as for configs/nemotron_cascade_14b.py (the
released data read as downloaded, code-RL prompts and RM pairs not released, a 72B
reward model and a 72B SWE judge in the paper, benchmark harnesses, whether
training used YaRN: x2.0 for the whole cascade here, as in the 14B).
Code and SWE RL use the 14B's published numbers: none are published for 8B.
"""

from configs import _recipes

def get_config(arg=None):
  """The 8B Cascade-1 config (see the module docstring)."""
  a = _recipes.parse_arg(arg, data_root='data/nemotron', base='checkpoints/Qwen3-8B-Base',
                         tokenizer='checkpoints/Qwen3-8B-Base',
                         hardware='v5p_128')
  rl = _recipes.cascade1_rl
  rlhf = rl(steps=800,                 # "~800" for 8B
            optimizer=dict(lr=2e-6, warmup_steps=0), temperature=0.6,
            max_prompt_len=4096,           # ours
            max_response_len=12_288, thinking_fraction=0.5)
  # IF-RL's two sub-stages: 550 steps on IFEval-taxonomy prompts, then 300 on IFBench-train
  # (verifiers.ifbench).
  if_rl = rl(optimizer=dict(lr=2e-6, warmup_steps=0), temperature=0.6,
             steps=550,
             max_prompt_len=2048, max_response_len=8192,  # ours
             thinking_fraction=0.0)
  if_rl_ifbench = dict(if_rl, steps=300)
  # Math, 8B (unverified): 128 x 8, temperatures 1.0 / 1.0 / 0.8, top-p 0.95, lr 2e-6,
  # 24K -> 32K -> 40K over steps 0-190, 190-430, 430-500, overlong filter in phase 1 only.
  math = rl(steps=500, optimizer=dict(lr=2e-6, warmup_steps=0), temperature=1.0,
            max_prompt_len=2048, max_response_len=40_960, thinking_fraction=1.0,
            phases=[
                dict(until_step=190, max_response_len=24_576, temperature=1.0,
                     filter_overlong=True),
                dict(until_step=430, max_response_len=32_768, temperature=1.0,
                     filter_overlong=False),
                dict(until_step=500, max_response_len=40_960, temperature=0.8,
                     filter_overlong=False),
            ])
  # SFT, the reward model, code RL and SWE RL: the 14B's published numbers (none are published
  # for 8B), from _recipes.cascade1.
  c = _recipes.cascade1(preset='qwen3_8b', data_root=a.data_root, tokenizer=a.tokenizer,
                        base=a.base, rlhf=rlhf, if_rl=if_rl, if_rl_ifbench=if_rl_ifbench,
                        math=math)
  return _recipes.on_hardware(c, a.hardware)


def get_hyper(h):
  """The Cascade-1 sweep (see _recipes.cascade1_hyper): 12 points."""
  return _recipes.cascade1_hyper(h, get_config())
