r"""Nemotron-Cascade 8B: Cascade RL on Qwen3-8B, the recipe of arXiv 2512.13607.

Wang et al., "Nemotron-Cascade: Scaling Cascaded Reinforcement Learning for
General-Purpose Reasoning Models", arXiv 2512.13607 (2025). The numbers are
the paper's as configs/PAPERS.md restates them; a comment marks each one that
is uncertain there or not published at all (then it is our choice). The 8B
math recipe rests on a single secondary source (PAPERS.md: "unverified").

    python -m launch.plan --config=configs/nemotron_cascade_8b.py
    python -m cascade.main --config=configs/nemotron_cascade_8b.py:data_root=gs://b/nemotron \
        --workdir=gs://b/runs/cascade8b

Stages: SFT 16K -> SFT 32K -> reward model -> RLHF -> IF-RL -> Math RL
(24K -> 32K -> 40K) -> Code RL (56K) -> SWE RL; GRPO strictly on-policy, no
KL, token-level loss, dynamic filtering.

Config argument (`:key=value,...`): data_root, base (the Qwen3-8B-Base HF
directory), tokenizer, hardware ('v5p_128' or 'h200x8', see
configs/nemotron_cascade_14b.py).

Not reproducible here: the same as for configs/nemotron_cascade_14b.py (data
to be staged by the user, code-RL prompts and RM pairs not released, a 72B
reward model and a 72B SWE judge in the paper, benchmark harnesses, whether
training used YaRN: x2.0 for the whole cascade here, as in the 14B).
Code and SWE RL use the 14B's published numbers: none are published for 8B.
"""

from configs import _recipes

_RL_MICRO = _recipes.CASCADE1_RL_MICROBATCHES


def get_config(arg=None):
  """The 8B Cascade-1 config (see the module docstring)."""
  a = _recipes.parse_arg(arg, data_root='data/nemotron', base='checkpoints/Qwen3-8B-Base',
                         tokenizer='checkpoints/Qwen3-8B-Base',
                         hardware='v5p_128')
  sft_stages = _recipes.cascade1_sft_stages(a.base)
  rm = dict(steps=320, batch_size=256, max_len=8192, optimizer=dict(lr=2e-6),  # max_len: ours
            microbatches=32)
  rl = dict(prompts_per_step=128, group_size=8, top_p=0.95, microbatches=_RL_MICRO)
  # RL optimizers: AdamW at a constant lr, no warm-up (no weight decay, clipping at 1:
  # the optimizer's defaults).
  rlhf = dict(rl, steps=800,                 # "~800" for 8B
              optimizer=dict(lr=2e-6, warmup_steps=0), temperature=0.6,
              max_prompt_len=4096,           # ours
              max_response_len=12_288, thinking_fraction=0.5)
  if_rl = dict(rl, optimizer=dict(lr=2e-6, warmup_steps=0), temperature=0.6,
               steps=850,                    # 550 (IFEval taxonomy) + 300 (IFBench-train)
               max_prompt_len=2048, max_response_len=8192,  # ours
               thinking_fraction=0.0)
  # Math, 8B (unverified): 128 x 8, temperatures 1.0 / 1.0 / 0.8, top-p 0.95, lr 2e-6,
  # 24K -> 32K -> 40K over steps 0-190, 190-430, 430-500, overlong filter in phase 1 only.
  math = dict(rl, steps=500, optimizer=dict(lr=2e-6, warmup_steps=0), temperature=1.0,
              max_prompt_len=2048, max_response_len=40_960, thinking_fraction=1.0,
              phases=[
                  dict(until_step=190, max_response_len=24_576, temperature=1.0,
                       filter_overlong=True),
                  dict(until_step=430, max_response_len=32_768, temperature=1.0,
                       filter_overlong=False),
                  dict(until_step=500, max_response_len=40_960, temperature=0.8,
                       filter_overlong=False),
              ])
  code = dict(rl, steps=64, optimizer=dict(lr=4e-6, warmup_steps=0),   # the 14B's numbers
              temperature=1.0,
              max_prompt_len=4096, max_response_len=57_344, thinking_fraction=1.0)
  swe = dict(rl, group_size=16, microbatches=2 * _RL_MICRO, steps=120,  # the 14B's
             optimizer=dict(lr=2.5e-6, warmup_steps=0),
             temperature=1.0,                # assumed
             max_prompt_len=16_384, max_response_len=16_384,  # ours
             thinking_fraction=1.0)
  c = _recipes.cascade1(
      preset='qwen3_8b',
      # YaRN factor 2.0 from 32,768 positions = 65,536 (see _recipes.QWEN3_YARN).
      model_overrides=dict(max_seq_len=_recipes.QWEN3_YARN_MAX_SEQ_LEN, remat=True,
                           rope_scaling=_recipes.QWEN3_YARN),
      data_root=a.data_root, tokenizer=a.tokenizer, sft_stages=sft_stages, rm=rm, rlhf=rlhf,
      if_rl=if_rl, math=math, code=code, swe=swe,
      eval_max_new_tokens=61_440, eval_max_prompt_len=4096)
  return _recipes.on_hardware(c, a.hardware)


def get_hyper(h):
  """The Cascade-1 sweep (see _recipes.cascade1_hyper): 12 points."""
  return _recipes.cascade1_hyper(h, get_config())
