r"""Nemotron-Cascade 2's stage order and settings, on its own model (arXiv 2603.19220).

"Nemotron-Cascade 2", arXiv 2603.19220 (2026). The paper post-trains
Nemotron-3-Nano-30B-A3B: a hybrid of 23 Mamba-2 layers, 23 mixture-of-experts
layers (128 routed experts, 6 per token, one shared expert) and 6 grouped-query
attention layers, 31.6B parameters of which 3.6B are active per token (the
`nemotron_3_nano_30b_a3b` preset, models/config.py). Numbers are the paper's as
configs/PAPERS.md restates them; most step counts there are approximate ("~"),
and each is marked.

    python -m launch.plan --config=configs/nemotron_cascade2.py
    python -m cascade.main --config=configs/nemotron_cascade2.py:data_root=gs://b/nemotron2 \
        --workdir=gs://b/runs/cascade2

Order: SFT -> IF-RL -> multi-domain RL (MCQA, tool calling, structured output) -> reward
model -> a short side RLHF run (MOPD's chat teacher) -> MOPD (from the
multi-domain policy) -> RLHF -> long-context RL -> code RL -> agentic SWE RL. RL is GRPO
strictly on-policy, token level, KL 0 except RLHF (0.03), lr 3e-6, 128 prompts x 16 rollouts,
temperature 1.0, responses up to ~49K tokens (49,152 here: IF-RL, multi-domain RL, both RLHF
runs and long-context RL; code RL's and SWE RL's are their own), all-equal groups filtered.

Mesh (ours): on the v5p slice (data 1, fsdp 1, expert 8, sequence 8, tensor 1),
`_recipes.SEQUENCE_MESH`: each MoE layer's 128 experts split 16 per chip over the
expert axis (their embed dim over 'sequence': 64 ways in all), tokens dispatched to
them and back (models/moe.py), every other weight's embed dim over 'sequence' (8 ways:
2688 / 64 is not whole TPU tiles, see _recipes.SEQUENCE_MESH); training rows
split over the 8 expert shards and each row over the 8 sequence shards (context
parallelism: attention, the Mamba-2 scan and the routed experts split along the row),
so a 256K-token SFT row is 32K tokens per chip; the sampler splits its rows over all
64. On H200 nodes (`hardware=h200x8`, `2xh200x8`, `4xh200x8`) (data 1, fsdp H, expert 1,
sequence 8, tensor 1) for H nodes: each row split over a node's 8 GPUs, the routed experts
16 per GPU over 'sequence', the nodes data/FSDP-parallel (`_recipes.SEQUENCE_MESH`).

Config argument (`:key=value,...`): data_root, base, tokenizer, hardware
('v5p_128', 'h200x8', '2xh200x8' or '4xh200x8'; configs/_recipes.py HARDWARE), genrm (an HF
checkpoint directory: RLHF's generative reward model, below; '' = the
Bradley-Terry stand-in).

Not reproducible here:
* SWE RL is agentic (kind 'agentic', `envs.swe_agent`), but a record's repository is a
  set of files its tests run on with the sandbox's Python: the paper's OpenHands
  scaffold and per-task container images (installed dependencies) are not here.
* Tool calling is scored on one assistant turn (its `<tool_call>` blocks
  against the record's gold calls, `verifiers.tool_call`), not on multi-turn
  episodes with executed tools.
* RLHF's generative reward model: by default replaced by a Bradley-Terry RM
  stage trained on the SFT policy (one RM serves the side run and the main
  RLHF). With `genrm=<HF directory>` the chat domain is scored by that judge
  instead (`verifiers.judge`: it rates each answer 1-10 after its own
  reasoning, greedy, at most 4096 tokens; prompt, mode and length are ours, the
  paper's are not in configs/PAPERS.md; it reads every chat answer whole, up to
  MOPD's response length) and the RM stage is dropped. Without it the run's start banner
  and results.json ("substitutions") name the Bradley-Terry stand-in.
* IF-RL (and held-out IF) is scored by `verifiers.ifbench`, which takes every instruction id
  of the release (IFEval's, IFBench's and IFEvalG's).
  `launch.plan` counts the judge (its weights beside every program from its
  first use, its sampler, its generation in the step time) from the
  directory's config.json alone, so a plan needs no weights:
  `genrm=configs/judges/qwen3_235b_a22b` holds the architecture of the
  235B-A22B Qwen3-MoE generative RM NVIDIA released for Nemotron-3-Nano's RLHF
  (which judge the paper used is not in configs/PAPERS.md: an assumption).
* Sequence lengths: on the v5p slice the papers' (`_LENGTHS`): SFT rows of 262,144
  tokens ("256K"), MOPD responses of 98,304 ("up to 98K"), code RL responses of
  118,784 ("118K-token responses"; each the first multiple of 1,024 at or above the
  paper's number, our reading of "K"), both after a 4,096-token prompt (ours); the
  model has no RoPE limit (its attention layers take no positions, 262,144 in its
  config). The H200 presets run the same lengths, a row split over a node's 8 GPUs (before
  their meshes had a sequence axis they were capped at 32,768 / 61,440 / 61,440).
  docs/plans/nemotron_cascade2_v5p.md is what `launch.plan` found for the v5p slice,
  docs/plans/nemotron_cascade2_h200x8.md (and _2xh200x8, _4xh200x8) for the GPU nodes;
  docs/plans/nemotron_cascade2_h200x8_rl49k.md for the ~49K RL stages on one node.
* Data: the released `nvidia/Nemotron-Cascade-2-SFT-Data` and `-RL-data`
  are read as they are downloaded under data_root (docs/released_data.md):
  SFT, IF-RL (45,879), multi-domain RL (18,147: MCQA, workplace tool calling
  and structured output, each row routed to its domain by its NeMo-Gym agent)
  and MOPD (6,171). SWE-RL (3,612) rows name a GitHub repository and commit
  but carry no files, which the agentic SWE environment needs: its prompts
  stay a staged file (rl/swe_agent.jsonl) of tasks with their repositories.
"""

from configs import _recipes

_DOMAINS = ['chat', 'instruction_following', 'math', 'mcqa', 'tool_calling', 'structured',
            'long_context', 'code', 'swe_agent']
# 128 x 16 = 2048 rows per update over 8 batch shards (the dense mesh's data x fsdp): one row
# per batch shard at a time. `on_expert_mesh` divides it (and every stage's) by the growth in
# batch shards: none on the v5p slice (data x fsdp x expert = 8, each row over 8 sequence
# shards); on H200 nodes it multiplies it by the shrink, 8 H -> H: one row per node.
_MICRO = 256

# hardware -> (SFT row, MOPD response, code RL response) in tokens: the papers' on the v5p
# slice and on H200 nodes (their sequence axes split a row over 8 chips / GPUs). See
# "Sequence lengths" above.
_PAPER_LENGTHS = (262_144, 98_304, 118_784)
_LENGTHS = {name: _PAPER_LENGTHS for name in ('v5p_128', *_recipes.GPU_NODES)}

# MOPD's prompts (ours); its rows are this plus its responses.
_MOPD_PROMPT = 4096


def get_config(arg=None):
  """The Cascade-2 recipe on Nemotron-3-Nano-30B-A3B (see the module docstring)."""
  a = _recipes.parse_arg(arg, data_root='data/nemotron2',
                         base='checkpoints/Nemotron-3-Nano-30B-A3B-Base',
                         tokenizer='checkpoints/Nemotron-3-Nano-30B-A3B-Base',
                         hardware='v5p_128', genrm='')
  if a.hardware not in _LENGTHS:
    raise ValueError(f'config argument hardware={a.hardware!r}: expected one of '
                     f'{sorted(_LENGTHS)}')
  sft_len, mopd_len, code_len = _LENGTHS[a.hardware]
  c = _recipes.base_config(
      preset='nemotron_3_nano_30b_a3b',
      model_overrides=dict(remat=True),
      data_root=a.data_root, tokenizer=a.tokenizer, domains=_DOMAINS,
      datasets=['sft_stage1', 'rm_pairs', 'mopd_train'],
      eval_max_new_tokens=49_152, eval_max_prompt_len=4096, eval_temperature=1.0,
      eval_top_p=1.0, release=_recipes.CASCADE2_RELEASE)
  # IF-RL (and MOPD's IF prompts) on the verifier that takes every instruction id of the
  # release: IFEval's 25, IFBench's 58 and IFEvalG's 29 training ids (verifiers.ifbench); the
  # IFEval-only verifier refuses rows carrying the others (every record of a domain is checked
  # against both its verifiers, so held-out IFEval is scored by ifbench too: it checks IFEval's
  # ids as verifiers.ifeval does).
  c.domains.instruction_following.verifier = 'ifbench'
  # RL optimizer: AdamW at a constant 3e-6, no warm-up (the optimizer's other defaults).
  rl = dict(prompts_per_step=128, group_size=16, optimizer=dict(lr=3e-6, warmup_steps=0),
            temperature=1.0, top_p=1.0, microbatches=_MICRO, thinking_fraction=1.0)
  # "Most stages use ... responses up to ~49K tokens": IF-RL, multi-domain RL, both RLHF runs
  # and long-context RL generate up to 49,152 (48 x 1,024, our reading of "~49K"); code RL
  # (118K) and SWE RL (an episode budget) say their own. Prompts are ours. On one H200 node
  # (`hardware=h200x8`) they fit with the update batch split along its tokens over the node's
  # sequence axis (IF-RL's train step 72 %, RLHF's 83 % beside its resident reference and reward
  # model, long-context RL's 74 %; whole on every GPU, with its recorded routing, they took 91,
  # 103 and 105 %: docs/plans/history.md).
  paper_len = 49_152
  long_rl = dict(max_prompt_len=4096, max_response_len=paper_len)
  r = _recipes
  c.stages = [
      # Global batch 64, lr 5e-5 -> 5e-6 cosine, 200 warm-up steps, AdamW (0.9, 0.98),
      # weight decay 0.1. Rows of 256K tokens, packed;
      # steps are ours; 8 microbatches of 8 rows (one per batch shard): ours.
      r.sft('sft', datasets=['sft_stage1'], domains=list(_DOMAINS), init_from=a.base,
            steps=4000, batch_size=64, max_len=sft_len, microbatches=8,
            optimizer=dict(lr=5e-5, schedule='cosine', min_lr_ratio=0.1, warmup_steps=200,
                           b1=0.9, b2=0.98, weight_decay=0.1)),
      r.grpo('if_rl', domains=['instruction_following'], steps=180,   # "~180"
             max_prompt_len=2048, max_response_len=paper_len,          # prompt: ours
             **{**rl, 'thinking_fraction': 0.0}),
      r.grpo('multi_domain_rl', domains=['mcqa', 'tool_calling', 'structured'],
             steps=70,   # "~70"
             **long_rl, **rl),
      r.reward_model('rm', init_from='sft', steps=320, batch_size=256, max_len=8192,
                     optimizer=dict(lr=2e-6),
                     microbatches=32,   # the Cascade-1 RM recipe (no C2 numbers)
                     # Whole rows as a scorer: the longest chat row, MOPD's (chat is one of
                     # its domains): 102,400 tokens.
                     score_max_len=_MOPD_PROMPT + mopd_len),
      # The chat teacher of MOPD: "a short side RLHF run" (its length is not
      # published; 30 steps is ours), from the multi-domain policy.
      r.grpo('rlhf_teacher', domains=['chat'], steps=30, init_from='multi_domain_rl',
             kl_coef=0.03, **long_rl, **rl),
      # MOPD: 128 x 4, temperature 1.0, 52 steps, lr 2e-6 (text), 30 warm-up steps;
      # responses up to 98K; the 4K prompt is ours.
      # One teacher per prompt, by its domain: math = the SFT checkpoint; chat = the side RLHF
      # run ("RLHF teacher"); the rest = after IF-RL + multi-domain RL. The paper's MOPD
      # prompts: math 1,853, IF 1,854, workplace (tool calling) 610, STEM (MCQA) 927,
      # structured output 927, which the released MOPD subset holds, each row routed to its
      # domain by its NeMo-Gym agent (cascade/data/released.py); it holds no chat row, so the RLHF
      # teacher would get no prompt (cascade.config refuses a stage domain none of the
      # stage's datasets can hold). Its prompts, chat's, are the RLHF stages' (rlhf_train,
      # ours: the paper's counts name none); chat's share of MOPD's draws is that set's size
      # beside the subset's 6,171 rows.
      r.mopd('mopd', domains=['math', 'instruction_following', 'chat', 'mcqa', 'structured',
                              'tool_calling'],
             datasets=('mopd_train', 'rlhf_train'),
             teachers={'math': 'sft', 'instruction_following': 'multi_domain_rl',
                       'chat': 'rlhf_teacher', 'mcqa': 'multi_domain_rl',
                       'structured': 'multi_domain_rl', 'tool_calling': 'multi_domain_rl'},
             init_from='multi_domain_rl', steps=52, optimizer=dict(lr=2e-6, warmup_steps=30),
             prompts_per_step=128, group_size=4, temperature=1.0,
             max_prompt_len=_MOPD_PROMPT, max_response_len=mopd_len, microbatches=64),
      r.grpo('rlhf', domains=['chat'], steps=30,          # "~25-30"
             kl_coef=0.03, **long_rl, **rl),
      # Long documents: a 32K prompt (ours), responses to the paper's ~49K.
      r.grpo('long_context_rl', domains=['long_context'], steps=30,   # "~30"
             max_prompt_len=32_768, max_response_len=paper_len, **rl),
      # "~22" steps on 3.5K hardest problems, 118K-token responses; the 4K prompt is
      # ours.
      r.grpo('code_rl', domains=['code'], steps=22, max_prompt_len=4096,
             max_response_len=code_len, **rl),
      # Agentic SWE: G = 16 episodes per task in the swe_agent environment (list, read,
      # search, edit, patch, run tests), rewarded by the hidden tests. "~40-50" steps; the
      # episode budget (32K tokens after a 4K opening, turns of at most 8K) is ours.
      r.agentic('swe_rl', domains=['swe_agent'], steps=45, max_prompt_len=4096,
                max_response_len=32_768, max_turn_tokens=8192, **rl),
  ]
  if a.genrm:
    # The generative RM scores chat (training and held-out) in place of the BT reward model,
    # reading each answer whole: its window is the longest chat answer a stage (MOPD's) or the
    # evaluation writes (cascade.config refuses a shorter one).
    chat_len = max([s.get('max_response_len', 0) for s in c.stages
                    if 'chat' in s.get('domains', ())] + [c.eval.max_new_tokens])
    c.domains.chat.verifier = 'judge'
    c.domains.chat.verifier_options = dict(judge=a.genrm, template='pointwise_score',
                                           mode='pointwise', score_by='generate',
                                           max_new_tokens=4096,   # ours
                                           max_field_tokens=chat_len)
    c.domains.chat.reward_model_stage = ''
    c.stages = [st for st in c.stages if st['name'] != 'rm']
  else:
    # Announced in the banner and recorded in results.json ("substitutions").
    c.domains.chat.stand_in = ("a Bradley-Terry reward model (stage 'rm') in place of the "
                               "paper's generative reward model (genrm= gives one)")
  r.exact_sampler_buckets(c)
  r.fast_path(c)
  # MoE RL stability: the rollouts run other kernels than the updates (the paged engine's
  # attention and decode matmuls, the Mamba-2 recurrence against the training's chunked scan,
  # in bf16), so TIS at the literature's cap of 2 corrects the log-prob gap
  # (_recipes.correct_mismatch; MOPD keeps the paper's [0.5, 2] importance band), and the
  # 23 MoE layers' experts chosen in the rollout are replayed in the update (routing replay,
  # _recipes.replay_routing), so a token near a routing tie is trained through the experts
  # that sampled it. Neither is in the paper's text; both are what every framework training
  # Nemotron-3-Nano/Qwen3-30B-A3B-class MoE models with GRPO turned on (docs/model_families.md,
  # "Routing replay").
  r.correct_mismatch(c)
  r.replay_routing(c)
  return r.on_expert_mesh(r.on_hardware(c, a.hardware), a.hardware, r.SEQUENCE_MESH)


def get_hyper(h):
  """Seeds x RL learning rates (x0.5, x1, x2 in every GRPO stage) x group size (8, 16).

  12 points, each a full cascade: `python -m launch.sweep` runs them one host
  at a time; `launch/xm_launch.py` submits one multi-host job per point. The
  paper's G = 16 and half of it; the microbatch count halves with G, so a
  microbatch keeps its rows (and `launch.plan`'s memory numbers).
  """
  c = get_config()
  return h.product([
      h.sweep('seed', [0, 1]),
      h.stages(c, 'optimizer.lr', lambda st: [st['optimizer']['lr'] * f for f in (0.5, 1, 2)]),
      h.zipit([h.stages(c, 'group_size', lambda st: [st['group_size'] // d for d in (2, 1)]),
               h.stages(c, 'microbatches', lambda st: [st['microbatches'] // d for d in (2, 1)])]),
  ])
