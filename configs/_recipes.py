"""Building blocks of the paper-recipe configs (Nemotron-Cascade 1 and 2).

The paper configs (`nemotron_cascade_14b.py`, `nemotron_cascade_8b.py`,
`nemotron_cascade2.py`) differ in their stage lists and numbers; what they
share lives here: the staged-data layout, the domains and their verifiers,
the TPU v5p target, and one constructor per stage kind, so every stage dict
has the same fields in the same order. The constructors take the stage
fields under their own names (`prompts_per_step`, `group_size`,
`optimizer=dict(lr=...)`, ...) and only add the fields a kind fixes (`kind`,
GRPO's token-level loss and dynamic filtering). The papers' numbers and
where they come from: configs/PAPERS.md.

Data is staged by the user under one root (`data_root=` in the config
argument, default `data/nemotron`): the released datasets as they are
downloaded (CASCADE1_RELEASE, CASCADE2_RELEASE; docs/released_data.md), the
rest in the layout of DATASETS. Nothing here downloads.
"""

from __future__ import annotations

import math
import os

import ml_collections

# Target hardware: a TPU v5p pod slice. `launch.plan` compiles every stage for
# this topology (libtpu present) or for simulated CPU devices of the same count.
V5P_128 = dict(
    name='TPU v5p-128 (64 chips)',
    platform='tpu',
    topology='v5p:4x4x4',   # libtpu topology name: 4x4x4 chips = 64.
    device_memory_gib=95.0,  # HBM per v5p chip.
    peak_tflops=459.0,       # bf16 matmul peak per chip (launch.plan's time lower bound).
    hbm_gbps=2765.0,         # HBM bandwidth per chip, GB/s.
)

# YaRN over Qwen3's RoPE, for rollouts and evaluation longer than Qwen3's native
# context. The Nemotron-Cascade model cards evaluate (64K-token budgets) with
# YaRN factor 2.0 from Qwen3's 32,768-token pre-training context (its config's
# 40,960 = 32K + 8K of generation room): 32,768 x 2.0 = 65,536 positions, which
# covers the longest length every paper config uses (a 4K prompt + a 60K
# response or evaluation budget). configs/PAPERS.md does not say whether the
# papers trained with it; static YaRN is a model setting here, so it applies to
# every stage (transformers applies it at every length too).
QWEN3_YARN = dict(rope_type='yarn', factor=2.0, original_max_position_embeddings=32_768)
QWEN3_YARN_MAX_SEQ_LEN = 65_536   # = 32,768 x 2.0, the positions QWEN3_YARN covers.

# The planning alternative: one node of 8 NVIDIA H200 (141 GB HBM3e each),
# NVLink within the node; fsdp over the 8 GPUs.
H200_8 = dict(
    name='8 x NVIDIA H200 (one node)',
    platform='gpu',
    device_memory_gib=131.0,  # 141 GB per GPU.
    peak_tflops=989.0,        # dense bf16 tensor-core peak per GPU.
    hbm_gbps=4800.0,          # HBM bandwidth per GPU, GB/s.
    # The H200 for XLA:GPU's deviceless compiler (launch.plan --backend=gpu).
    gpu_target='launch/gpu_targets/h200.txtpb',
)
H200_8_MESH = (1, 8, 1)

# Several such nodes (InfiniBand between them): `launch.plan` compiles for XLA:GPU's
# topology 1xHx8 (H hosts of 8 GPUs, `launch.plan.targets.gpu_topology`); the dense mesh
# is fsdp over all of them.
H200_16 = dict(H200_8, name='16 x NVIDIA H200 (2 nodes of 8)')
H200_32 = dict(H200_8, name='32 x NVIDIA H200 (4 nodes of 8)')

# Mesh (data, fsdp, tensor) over the 64 chips. Qwen3-8B/14B have 8 KV heads,
# so tensor parallelism beyond 8 would replicate the K/V projections; fsdp
# shards the embedding dimension of every matrix and the batch.
V5P_128_MESH = (1, 8, 8)

# The datasets staged by the user in cascade.data's formats (not released, or not released
# for that cascade): name -> (path under data_root, format, domain); docs/released_data.md
# says what each holds. The released ones are in CASCADE1_RELEASE / CASCADE2_RELEASE.
DATASETS = {
    'rm_pairs': ('rm/preferences.jsonl', 'preference', 'chat'),
    'rlhf_train': ('rl/rlhf.jsonl', 'prompt', 'chat'),
    'chat_eval': ('eval/chat.jsonl', 'prompt', 'chat'),
    'if_eval': ('eval/ifeval.jsonl', 'ifeval', 'instruction_following'),
    # Cascade 1's second IF-RL sub-stage: IFBench-style constraints (verifiers.ifbench's ids).
    'ifbench_train': ('rl/ifbench.jsonl', 'nemotron_if', 'ifbench'),
    'ifbench_eval': ('eval/ifbench.jsonl', 'ifeval', 'ifbench'),
    'math_train': ('rl/math.jsonl', 'nemotron_math', 'math'),
    'math_eval': ('eval/aime25.jsonl', 'nemotron_math', 'math'),
    'code_train': ('rl/code.jsonl', 'prompt', 'code'),
    'code_eval': ('eval/humaneval.jsonl', 'humaneval', 'code'),
    'swe_eval': ('eval/swe.jsonl', 'prompt', 'swe'),
    # Cascade 2 only.
    'mcqa_eval': ('eval/mcqa.jsonl', 'prompt', 'mcqa'),
    'structured_eval': ('eval/structured.jsonl', 'prompt', 'structured'),
    'long_context_train': ('rl/long_context.jsonl', 'prompt', 'long_context'),
    'long_context_eval': ('eval/long_context.jsonl', 'prompt', 'long_context'),
    'tool_calling_eval': ('eval/tool_calling.jsonl', 'prompt', 'tool_calling'),
    # Cascade 2's agentic SWE: repositories, hidden tests (envs.swe_agent metadata).
    'swe_agent_train': ('rl/swe_agent.jsonl', 'prompt', 'swe_agent'),
    'swe_agent_eval': ('eval/swe_agent.jsonl', 'prompt', 'swe_agent'),
}

# The released datasets, read as they are downloaded (docs/released_data.md): each
# `huggingface-cli download nvidia/<name> --repo-type dataset --local-dir <data_root>/<name>`.
# Dataset name -> (path under data_root, cascade.data format, domain). File names: Cascade 2's RL subsets as `<subset>/train.jsonl` and its SFT subsets as
# `<subset>/<file>.jsonl` (seen in loaders of the releases); Cascade 1's layouts are inferred
# (cascade/data/released.py says which field and file names are verified, seen or inferred). The
# SFT sets' domain is a label only (an SFT stage keeps every record of its datasets).
CASCADE1_RELEASE = {
    'sft_stage1': ('Nemotron-Cascade-SFT-Stage-1/*/*.jsonl', 'nemotron_cascade_sft', 'chat'),
    'sft_stage2': ('Nemotron-Cascade-SFT-Stage-2/*/*.jsonl', 'nemotron_cascade_sft', 'chat'),
    'sft_swe': ('Nemotron-Cascade-SFT-SWE/*.jsonl', 'nemotron_cascade_sft', 'swe'),
    'rlhf_train': ('Nemotron-Cascade-RL-RLHF/*.jsonl', 'cascade1_rl_rlhf', 'chat'),
    'if_train': ('Nemotron-Cascade-RL-Instruction-Following/*.jsonl', 'cascade1_rl_if',
                 'instruction_following'),
    'math_train': ('Nemotron-Cascade-RL-Math/*.jsonl', 'cascade1_rl_math', 'math'),
    'swe_train': ('Nemotron-Cascade-RL-SWE/*.jsonl', 'cascade1_rl_swe', 'swe'),
}
_C2_RL = 'Nemotron-Cascade-2-RL-data'
CASCADE2_RELEASE = {
    'sft_stage1': ('Nemotron-Cascade-2-SFT-Data/*/*.jsonl', 'nemotron_cascade_sft', 'chat'),
    'if_train': (f'{_C2_RL}/IF-RL/train.jsonl', 'cascade2_if_rl', ''),
    # MCQA, workplace tool calling and structured output in one file: each record names its
    # domain (routed by its NeMo-Gym agent), and the three domains train on it (DOMAINS).
    'multi_domain_train': (f'{_C2_RL}/multi-domain-RL/train.jsonl', 'cascade2_multi_domain_rl',
                           ''),
    'mopd_train': (f'{_C2_RL}/MOPD/train.jsonl', 'cascade2_mopd', ''),
}

# Domain -> (training verifier, options, train set, held-out set).
DOMAINS = {
    # RLHF: the Bradley-Terry reward model trained by the 'rm' stage scores the
    # text after the thinking block. The held-out score is that same RM on
    # held-out prompts (the paper's ArenaHard uses an LLM judge, not here).
    'chat': ('reward_model', {}, 'rlhf_train', 'chat_eval'),
    'instruction_following': ('instruction_following', {}, 'if_train', 'if_eval'),
    # IFBench: trained on its IF-RLVR prompts (IFEval's 25 and the 29 training constraints),
    # held out on its test (the 58 out-of-distribution constraints).
    'ifbench': ('ifbench', {}, 'ifbench_train', 'ifbench_eval'),
    'math': ('math', {}, 'math_train', 'math_eval'),
    'code': ('code', {'isolation': 'bwrap'}, 'code_train', 'code_eval'),
    'swe': ('swe', {}, 'swe_train', 'swe_eval'),
    # Cascade 2: multiple-choice STEM answers by the option letter the answer
    # commits to; tool calling by the turn's calls against the gold calls
    # (JSON-schema checked); structured output by the JSON-schema verifier;
    # long-context QA by token F1 against the reference answers (SQuAD-style). The three
    # first train on Cascade 2's multi-domain RL subset, whose records name their domain.
    'mcqa': ('mcqa', {}, 'multi_domain_train', 'mcqa_eval'),
    'tool_calling': ('tool_call', {}, 'multi_domain_train', 'tool_calling_eval'),
    'structured': ('structured', {}, 'multi_domain_train', 'structured_eval'),
    'long_context': ('long_context_qa', {}, 'long_context_train', 'long_context_eval'),
}


# Agentic domains -> (environment, options, train set, held-out set, max_turns): episodes in
# the environment (kind 'agentic'), scored by it. Turn limit: ours (not published).
AGENT_DOMAINS = {
    'swe_agent': ('swe_agent', {'isolation': 'bwrap'}, 'swe_agent_train', 'swe_agent_eval', 50),
}


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'key=value,key=value' (the `configs/x.py:arg` part) over defaults.

  Values are converted to the type of the default (int, float, bool, str).
  """
  out = dict(defaults)
  for item in filter(None, (arg or '').split(',')):
    key, sep, value = item.partition('=')
    if not sep or key not in defaults:
      raise ValueError(f'config argument {item!r}: expected key=value with key in '
                       f'{sorted(defaults)}')
    kind = type(defaults[key])
    out[key] = (value.lower() in ('1', 'true', 'yes')) if kind is bool else kind(value)
  return ml_collections.ConfigDict(out)


def base_config(*, preset: str, model_overrides: dict, data_root: str, tokenizer: str,
                domains: list[str], datasets: list[str], seed: int = 0,
                eval_max_new_tokens: int, eval_max_prompt_len: int,
                eval_temperature: float = 0.6, eval_top_p: float = 0.95,
                eval_num_samples: int = 4,
                release: dict | None = None) -> ml_collections.ConfigDict:
  """Everything but the stage list.

  Args:
    preset: the `models.config.ModelConfig` preset of the base model's shapes.
    model_overrides: ModelConfig fields to change (e.g. max_seq_len).
    data_root: directory holding the staged files of `DATASETS`.
    tokenizer: the HF tokenizer directory (tokenizer.json) of the base model.
    domains: domain names (keys of `DOMAINS`) this cascade trains or evaluates.
    datasets: dataset names (keys of `DATASETS`) beyond the domains' own.
    seed: the run's seed.
    eval_max_new_tokens: generation budget of the held-out evaluation.
    eval_max_prompt_len: longest held-out prompt.
    eval_temperature: held-out sampling temperature.
    eval_top_p: held-out nucleus mass.
    eval_num_samples: samples per held-out prompt (pass@1 averaged over them).
    release: dataset name -> (path, format, domain) of the released files read as they
      are (CASCADE1_RELEASE, CASCADE2_RELEASE), beside DATASETS.

  Returns:
    A ConfigDict with seed, model, tokenizer, mesh, hardware, sampler, ckpt,
    eval, datasets, domains and an empty stage list.
  """
  c = ml_collections.ConfigDict()
  c.seed = seed
  c.model = dict(preset=preset, overrides=dict(model_overrides))
  c.tokenizer = dict(path=tokenizer)
  # (data, fsdp, tensor); rules: models.sharding.DEFAULT_RULES.
  c.mesh = dict(shape=V5P_128_MESH)
  c.hardware = dict(V5P_128)
  c.sampler = dict()         # Sampler arguments; see exact_sampler_buckets.
  c.ckpt = dict(every_n_steps=25, keep=2)  # RL steps take minutes at this scale.
  # More than 3 bad steps in a row (a non-finite or zero gradient) stop the run
  # (cascade/divergence.py); rollbacks=N goes back to a checkpoint at a lower learning rate.
  c.divergence = dict(max_bad_steps=3, rollbacks=0)
  # JAX's persistent compilation cache (cascade/compile_cache.py), so a restart loads what an
  # earlier run compiled: dir None = <workdir>/compilation_cache (or JAX_COMPILATION_CACHE_DIR),
  # '' = off, gs:// allowed; min_compile_secs None = JAX's 1 s. Placeholders typed for
  # --config.compilation_cache.dir=...; not in the config hash.
  c.compilation_cache = dict(dir=ml_collections.config_dict.placeholder(str),
                             min_compile_secs=ml_collections.config_dict.placeholder(float))
  # The papers evaluate at temperature 0.6, top-p 0.95 (64K tokens for Cascade 1).
  c.eval = dict(num_samples=eval_num_samples, temperature=eval_temperature, top_p=eval_top_p,
                greedy=False, max_new_tokens=eval_max_new_tokens,
                max_prompt_len=eval_max_prompt_len,
                num_prompts=0,   # 0 = the whole held-out set.
                batch_size=256, thinking=True)
  table = {**DATASETS, **(release or {})}
  names = list(datasets)
  for d in domains:
    train, held_out = DOMAINS[d][2:4] if d in DOMAINS else AGENT_DOMAINS[d][2:4]
    names += [train, held_out]
  c.datasets = {n: dict(path=os.path.join(data_root, table[n][0]), format=table[n][1],
                        **({'domain': table[n][2]} if table[n][2] else {}))
                for n in dict.fromkeys(names)}
  c.domains = {}
  for d in domains:
    if d in AGENT_DOMAINS:
      env, options, train, held_out, turns = AGENT_DOMAINS[d]
      c.domains[d] = dict(env=env, env_options=dict(options), train=train, eval=held_out,
                          max_turns=turns)
      continue
    verifier, options, train, held_out = DOMAINS[d]
    c.domains[d] = dict(verifier=verifier, verifier_options=dict(options), train=train,
                        eval=held_out)
  if 'chat' in c.domains:
    c.domains.chat.reward_model_stage = 'rm'
  c.stages = []
  c.allow_config_change = False
  return c


# Device memory per chip the sampler's KV cache may take; a stage's rollout
# rows are sampled in chunks that fit it (rl.sampler.Sampler's
# cache_tokens_per_device), beside the optimizer state and frozen models.
SAMPLER_CACHE_GIB = 24.0


def cache_slots_per_device(c: ml_collections.ConfigDict, gib: float) -> int | None:
  """KV-cache slots (rows x tokens) per device that `gib` GiB hold for c's model and mesh;
  None for a model without attention layers (nothing is kept per token, so a budget of
  slots bounds nothing: the sampler then takes each call's rows at once)."""
  from models import config as model_config  # pylint: disable=g-import-not-at-top
  m = model_config.ModelConfig.preset(c.model['preset'], **dict(c.model['overrides']))
  if not m.attention_layers:
    return None
  tensor = int(c.mesh['shape'][-1])               # (data, fsdp[, expert], tensor)
  kv_heads = -(-m.num_kv_heads // tensor)         # K/V heads split over 'tensor'
  # Only attention layers keep keys and values per token (a hybrid's Mamba layers keep a
  # fixed state per row instead, which the Sampler charges each row out of this budget).
  per_slot = m.attention_layers * 2 * kv_heads * m.head_dim * m.jnp_dtype.itemsize
  return int(gib * 2 ** 30) // per_slot


# name -> (hardware, mesh, sampler cache GiB per device). On one H200 node the mesh has no
# 'tensor' axis, so the rollout layout holds the whole model on every GPU beside the
# training state: planned (XLA:CPU estimates), the 24 GiB cache left the RLHF and SWE
# samplers 2-6 GiB over 131; 16 GiB fits them.
HARDWARE = {'v5p_128': (V5P_128, None, SAMPLER_CACHE_GIB),
            'h200x8': (H200_8, H200_8_MESH, 16.0),
            '2xh200x8': (H200_16, (1, 16, 1), 16.0),
            '4xh200x8': (H200_32, (1, 32, 1), 16.0)}

# The GPU presets (HARDWARE keys): one node of 8 H200s and 2 or 4 of them.
GPU_NODES = {'h200x8': 1, '2xh200x8': 2, '4xh200x8': 4}

# Positions per MLP chunk on hardware whose longest train steps need it (ModelConfig.mlp_chunk):
# on one H200 node a 64K-token row is one GPU's whole microbatch, and its
# [65536, 17408] MLP activations alone took ~14 GiB of a Cascade-2 train step.
MLP_CHUNK = {name: 8192 for name in GPU_NODES}

# Prompts per paged-engine prefill call (`sampler.prefill_prompts`; the engine's default is 8) on
# hardware where 8 of the longest prompts do not fit beside the rollout copy: on one H200 node
# (no 'tensor' axis, so every GPU holds every KV head) a prefill call's new K and V are gathered
# to every GPU before they are written into the pool's pages (split over 'fsdp'), and the SWE
# stage's call of 8 x 16,384-token prompts was planned at 154.68 GiB per GPU for the 14B model
# (XLA:CPU, 2026-12-04; 127.53 for the 8B). Its size follows the prompts per call.
PREFILL_PROMPTS = {name: 2 for name in GPU_NODES}

# Hardware on which MOPD keeps its teachers in host memory between their passes
# (`teachers_on_host`): beside a 64K-token train step, three resident 14B teachers
# (10 GiB per GPU) are what one H200 does not have left.
TEACHERS_ON_HOST = tuple(GPU_NODES)


# (data, fsdp, expert, tensor) meshes of the mixture-of-experts recipes per hardware, and the
# logical rules that differ from models.sharding.DEFAULT_RULES: on the v5p slice the experts
# split 16 per chip over the expert axis and everything else over fsdp x expert; on one H200
# node the weights outside the experts split over the expert axis too (several nodes: the
# expert axis inside each, fsdp across them).
EXPERT_MESH = {'v5p_128': ((1, 8, 8, 1), ()),
               **{name: ((1, nodes, 8, 1), (('embed', ('fsdp', 'expert')),))
                  for name, nodes in GPU_NODES.items()}}

# The same with a sequence axis (context parallelism) on the v5p slice, for the papers' longest
# rows (Cascade 2: 256K-token SFT rows, 100-120K-token RL rows): (data, fsdp, expert, sequence,
# tensor) = (1, 1, 8, 8, 1), a row split over 8 chips, rows over the 8 expert shards, the
# experts 16 per chip over 'expert' and their embed dim over 'sequence' (64 ways in all), every
# other weight's embed dim over 'sequence' (8 ways). Not over all 64 chips: Nemotron-3-Nano's
# embed dim, 2688, is 42 rows per chip in 64 shards, not whole (8, 128) tiles, and the TPU
# compiler gathers such shards as all-reduces of zero-padded whole weights (twice an
# all-gather's bytes, and each one slow to build), 336 rows in 8 shards as all-gathers: the
# code RL train step compiled in 64 s instead of 72 s, needing 6.8 GiB more per chip (2.7 of
# it parameters and optimizer state; docs/plans/history.md).
#
# On H200 nodes (GPU_NODES) the sequence axis is the node's 8 GPUs (NVLink) and the nodes are
# fsdp (data-parallel rows, weights split across them): (1, H, 1, 8, 1) for H nodes, a row
# split over the 8 GPUs of a node (a 256K-token SFT row is 32K tokens per GPU, the length one
# GPU trained whole before the axis existed), H rows at a time. A node has no room for an
# expert axis beside it, so the routed experts split over 'sequence' (16 per GPU; models/moe.py
# gathers a row's tokens over the axis the 'experts' rule names and reduce-scatters them
# back), their embed dim over the nodes ('fsdp'), every other weight's embed dim over
# fsdp x sequence (8H ways: 2688 / 32 = 84 rows is no tiling problem for XLA:GPU). No tensor
# axis: Cascade 2's 2 K/V heads would not split beyond 2, and its per-token work is small.
_GPU_SEQUENCE_RULES = (('experts', 'sequence'), ('embed', ('fsdp', 'sequence')))
SEQUENCE_MESH = {'v5p_128': ((1, 1, 8, 8, 1), (('embed', ('fsdp', 'sequence')),)),
                 **{name: ((1, nodes, 1, 8, 1), _GPU_SEQUENCE_RULES)
                    for name, nodes in GPU_NODES.items()}}


# Tokens per pass of a shard's routed experts (ModelConfig.moe_chunk) in the mixture-of-experts
# recipes: a shard gathers its expert group's tokens (8 x 32K in a 32K-token SFT row per chip),
# and their [tokens x top-k, width] dispatch buffers took 68 GiB of temporaries per MoE layer
# at once on the v5p slice (launch.plan); 32K at a time keeps them near 1 GiB each.
MOE_CHUNK = 32_768


def _rescale_microbatches(c: ml_collections.ConfigDict, before: int, after: int,
                          what: str) -> None:
  """Every stage's microbatches for rows split over `after` batch shards instead of `before`,
  each microbatch keeping its rows per shard: divided by the growth, multiplied by a shrink."""
  if after % before and before % after:
    raise ValueError(f'{what}: its {after} batch shards are neither a multiple nor a divisor '
                     f'of the {before} the stages\' microbatches were set for')
  scale = lambda n: max(1, n // (after // before)) if after >= before else n * (before // after)
  c.stages = [dict(st, microbatches=scale(st['microbatches']))
              if st.get('microbatches') else st for st in c.stages]


def on_expert_mesh(c: ml_collections.ConfigDict, hardware: str,
                   meshes: dict | None = None) -> ml_collections.ConfigDict:
  """c (already `on_hardware`) on its hardware's EXPERT_MESH (or `meshes`, e.g. SEQUENCE_MESH),
  the sampler's KV budget per device
  recomputed for that mesh, the routed experts run MOE_CHUNK tokens at a time, and every stage's microbatches divided by the growth in batch
  shards (rows split over data x fsdp x expert instead of data x fsdp), so a microbatch keeps
  its rows per device instead of being padded with empty rows up to the new shard count
  (`rows_bucket`): on the v5p slice 8 -> 64 shards, e.g. 2048 RL rows in 32 microbatches of one
  row per chip instead of 256 of 8 rows padded to 64. Where the mesh has fewer batch shards
  than the dense one (an H200 node's sequence mesh: 8 -> 1, a row over all 8 GPUs) they are
  multiplied by the shrink instead: still one row per batch shard. On a mesh with a sequence axis the
  training rows split over data x fsdp x expert and each row over 'sequence'; the sampler
  splits its rows over 'sequence' too (a decode step has one token per row, nothing to split
  along the length), so no chip decodes another's rows again."""
  table = EXPERT_MESH if meshes is None else meshes
  shape, rules = table[hardware]
  _rescale_microbatches(c, math.prod(int(n) for n in c.mesh['shape'][:2]),  # (data, fsdp, tensor)
                        math.prod(shape[:3]),     # (data, fsdp, expert[, sequence], tensor)
                        f'mesh {shape} for {hardware!r}')
  from models import sharding  # pylint: disable=g-import-not-at-top
  c.mesh = dict(shape=shape, rules=(sharding.override_rules(None, rules) if rules else None))
  if len(shape) == 5:
    c.sampler.rollout_rules = (*tuple(c.sampler.rollout_rules or ()),
                               ('batch', ('data', 'fsdp', 'expert', 'sequence')))
  c.model.overrides = {**dict(c.model.overrides), 'moe_chunk': MOE_CHUNK}
  c.sampler.cache_tokens_per_device = cache_slots_per_device(c, HARDWARE[hardware][2])
  return c


def on_hardware(c: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """c retargeted at the hardware `name` (a HARDWARE key): its mesh and the sampler's cache budget.

  'v5p_128' (the papers' scale, the default) leaves c as it is; 'h200x8' plans
  the same recipe for one 8-GPU node, '2xh200x8' and '4xh200x8' for 2 and 4 of them
  (`launch.plan --backend=gpu` compiles them with XLA:GPU), with the MLP run in chunks of
  MLP_CHUNK positions, PREFILL_PROMPTS prompts per prefill call and MOPD's
  teachers in host memory between their passes. On several nodes every stage's
  microbatches shrink with the growth in batch shards (a microbatch keeps its rows per GPU).
  """
  if name not in HARDWARE:
    raise ValueError(f'config argument hardware={name!r}: expected one of {sorted(HARDWARE)}')
  hw, mesh, cache_gib = HARDWARE[name]
  if mesh is not None:
    # Several nodes split the rows over more fsdp shards than the recipe's mesh: each
    # microbatch keeps its rows per GPU (2xh200x8: 8 -> 16 shards, half the microbatches).
    _rescale_microbatches(c, math.prod(int(n) for n in c.mesh['shape'][:2]),
                          math.prod(mesh[:2]), f'hardware={name!r}')
    c.hardware = dict(hw)
    c.mesh = dict(shape=mesh)
    c.sampler.cache_tokens_per_device = cache_slots_per_device(c, cache_gib)
  if name in MLP_CHUNK:
    c.model.overrides = {**dict(c.model.overrides), 'mlp_chunk': MLP_CHUNK[name]}
  if name in PREFILL_PROMPTS:
    c.sampler.prefill_prompts = PREFILL_PROMPTS[name]
  if name in TEACHERS_ON_HOST:
    c.stages = [dict(st, teachers_on_host=True) if st['kind'] == 'mopd' else st
                for st in c.stages]
  return c


# The rollout fast path of the paper recipes (`fast_path`): the paged engine (rl/engine.py,
# continuous batching over a paged KV cache) instead of one decode loop per chunk of rows.
# - slots and pages are left to the Sampler: a call decodes as many rows at once as one
#   chunk of it would hold in the KV budget (`cache_tokens_per_device`, SAMPLER_CACHE_GIB per
#   chip or the hardware's), so they follow each stage's lengths, and the pool is that budget
#   in pages, so no row is ever preempted; a finished row's slot takes the call's next row
#   at once instead of idling until the chunk's longest row stops.
# - page_size 64: a 40-60K-token row is ~1K pages in its page table, and the TPU paged-
#   attention kernel reads 8 pages (512 keys) per block, the block size of the training
#   path's flash attention.
# - chunk_steps 64: decode steps per device call; between calls the host refills free
#   slots and streams finished groups to the verifiers, so a freed slot waits at most 64
#   steps (a few seconds) out of a 10-60K-token response.
PAGED_ENGINE = dict(engine='paged', page_size=64, chunk_steps=64)


def fast_path(c: ml_collections.ConfigDict) -> None:
  """Puts c's RL stages on the rollout fast path: the paged engine (PAGED_ENGINE); GRPO
  stages filter while they sample (`stream_filter`: groups are scored as they finish, and
  prompts are drawn only until the batch is full, instead of sampling whole refill rounds);
  every GRPO and agentic stage packs its update (`pack_tokens` = its longest row, prompt +
  response: the update's FLOPs follow the real tokens, a microbatch holds at most as many
  tokens as a padded one; `microbatch_rows`). Agentic episodes are several sampler calls, so
  they filter after sampling; MOPD keeps its fixed batch (no filtering) and padded update
  (its per-row teacher routing is not packed)."""
  c.sampler.update(PAGED_ENGINE)
  stages = []
  for st in c.stages:
    if st['kind'] in ('grpo', 'agentic'):
      longest = max([int(st['max_response_len'])]
                    + [int(p['max_response_len']) for p in st.get('phases') or []])
      st = dict(st, pack_tokens=int(st['max_prompt_len']) + longest)
      if (st['kind'] == 'grpo' and st.get('dynamic_filter', True)
          and not any(_generating_judge(c, d) for d in st.get('domains') or [])):
        st['stream_filter'] = True
    stages.append(st)
  c.stages = stages


# The cap of truncated importance sampling (TIS) on the sampler/trainer gap (`correct_mismatch`):
# C = 2, the value of Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
# Training" (2025), which introduced TIS for this gap, and the default verl and slime ship; it
# keeps every token whose trainer/sampler ratio is at most 2 at its full importance weight
# (the upper end of MOPD's [0.5, 2] band in the Cascade 2 paper) and truncates the rare tokens
# the rollout kernels over-sample by more.
TIS_CAP = 2.0


def correct_mismatch(c: ml_collections.ConfigDict) -> None:
  """Turns on TIS (`tis_cap` = TIS_CAP) in c's GRPO and agentic stages: their rollouts run
  other kernels than their updates (the paged engine's ragged paged attention and one-token
  decode matmuls against the training forward's splash attention and batched matmuls, a bf16
  rollout copy of the weights, the Mamba-2 recurrence against the chunked scan), so the
  sampler's log-probs are not the trainer's, and the PPO clip against them drops the gradient
  of tokens the sampler under-sampled (rl.grpo). The gap itself is logged every step
  (`logprob_gap`, `_max`, `_outside_frac`). MOPD keeps its own importance-weight band, the
  paper's [0.5, 2] (rl.distill)."""
  c.stages = [dict(st, tis_cap=st.get('tis_cap', TIS_CAP))
              if st['kind'] in ('grpo', 'agentic') else st for st in c.stages]


def replay_routing(c: ml_collections.ConfigDict) -> None:
  """Turns on rollout routing replay (`routing_replay='on'`) in c's RL stages (GRPO, agentic,
  MOPD): for a mixture-of-experts policy. The sampler's and the trainer's routers see slightly
  different hidden states (other kernels, bf16, batch shapes), so a token near a routing tie
  goes to other experts in the update than in the rollout: an off-policy gap the importance
  ratio does not correct, and the most reported cause of MoE GRPO collapse (NeMo-RL, Megatron,
  SkyRL and AReaL all added replay for Qwen3-30B-A3B-class models). Replayed, the update uses
  the rollout's experts (the router's weights still learn); `routing_mismatch` logs for how
  many sampled tokens its own routers would have chosen otherwise in some MoE layer. Its
  cost: the recorded experts ride in the train batch ([rows, tokens, MoE layers, k] uint8;
  `launch.plan` counts it) and one more forward of each row's last token in the paged
  engine."""
  c.stages = [dict(st, routing_replay='on') if st['kind'] in ('grpo', 'agentic', 'mopd')
              else st for st in c.stages]


def _generating_judge(c: ml_collections.ConfigDict, domain: str) -> bool:
  """Whether `domain`'s training rewards come from a judge model that generates (a
  generative RM). Such a stage does not stream its filtering: streamed scoring runs the
  judge's engine while the policy's is still decoding, so both engines' pools and the
  policy's rollout copy are on the chips at once. Planned with the TPU compiler for
  Cascade 2's RLHF with the 235B-A22B GenRM on v5p:4x4x4, the judge's decode call then
  needs 115 GiB of the 95 (its own 60 GiB beside 55.5 GiB: the train state, the
  policy's rollout copy and its engine's 35 GiB of arguments); scored after sampling,
  the policy's engine is gone and the same call needs about 80 GiB. The judge runs on
  the same chips as the policy, so streaming would not overlap their compute anyway."""
  dom = c.domains.get(domain) if domain in c.domains else None
  if dom is None:
    return False
  opts = dict(dom.get('verifier_options') or {})
  return bool(opts.get('judge')) and opts.get('score_by', 'logits') == 'generate'


def exact_sampler_buckets(c: ml_collections.ConfigDict) -> None:
  """Sets the sampler's new-token buckets to the lengths the stages and the evaluation use.

  rl.sampler's default buckets are powers of two, so a 40K phase would get
  a 64K KV cache; the exact lengths (a handful) cost one compilation each
  and no padding. Also bounds the sampler's KV cache to SAMPLER_CACHE_GIB per
  chip (rows beyond it are sampled in chunks, one after another) and samples
  in the rollout layout.
  """
  c.sampler.cache_tokens_per_device = cache_slots_per_device(c, SAMPLER_CACHE_GIB)
  # Sample with the weights replicated over 'fsdp' (split over 'tensor' only):
  # a decode step then reads local weights instead of gathering fsdp shards.
  c.sampler.rollout_rules = (('embed', None),)
  lengths = {int(c.eval.max_new_tokens)}
  from rl import engine_options  # pylint: disable=g-import-not-at-top
  prompts = set(engine_options.DEFAULT_PROMPT_BUCKETS)
  for st in c.stages:
    lengths.update(int(p['max_response_len']) for p in st.get('phases') or [])
    if 'max_response_len' in st:
      lengths.add(int(st['max_response_len']))
    if st.get('max_turn_tokens'):             # an agentic stage's turns
      lengths.add(int(st['max_turn_tokens']))
      # Its last turn's prompt is the opening plus the whole episode budget.
      prompts.add(int(st['max_prompt_len']) + int(st['max_response_len']))
  c.sampler.new_token_buckets = tuple(sorted(lengths))
  c.sampler.prompt_buckets = tuple(sorted(prompts))


def sft(name: str, *, datasets: list[str], domains: list[str], steps: int, batch_size: int,
        max_len: int, optimizer: dict, microbatches: int, init_from: str = '') -> dict:
  """An SFT stage over packed rows of `max_len` tokens."""
  return dict(name=name, kind='sft', domains=domains, datasets=datasets, steps=steps,
              batch_size=batch_size, max_len=max_len, optimizer=optimizer,
              microbatches=microbatches, init_from=init_from)


def reward_model(name: str, *, init_from: str, steps: int, batch_size: int, max_len: int,
                 optimizer: dict, microbatches: int, score_max_len: int) -> dict:
  """The Bradley-Terry reward-model stage for the chat domain, on the 'rm_pairs' set.

  It trains on pairs of at most `max_len` tokens and, as the chat verifier, scores rows of
  up to `score_max_len` (every RLHF rollout and held-out generation with its prompt, whole).
  """
  return dict(name=name, kind='reward_model', domains=['chat'], datasets=['rm_pairs'],
              init_from=init_from, steps=steps, batch_size=batch_size, max_len=max_len,
              optimizer=optimizer, microbatches=microbatches, score_max_len=score_max_len)


def grpo(name: str, *, domains: list[str], steps: int, optimizer: dict, prompts_per_step: int,
         group_size: int, temperature: float, top_p: float, max_prompt_len: int,
         max_response_len: int, thinking_fraction: float | None, microbatches: int,
         phases: list[dict] | None = None, filter_overlong: bool = False, kl_coef: float = 0.0,
         init_from: str = '') -> dict:
  """A strictly on-policy GRPO stage: one update per batch, token-level loss, dynamic filtering.

  The arguments are the stage's fields. `microbatches` splits the
  prompts_per_step x group_size rows of one update into gradient
  accumulation steps (the update is still one optimizer step).
  """
  st = dict(name=name, kind='grpo', domains=domains, steps=steps,
            optimizer=optimizer, prompts_per_step=prompts_per_step,
            group_size=group_size, temperature=temperature, top_p=top_p,
            max_prompt_len=max_prompt_len, max_response_len=max_response_len,
            thinking_fraction=thinking_fraction, dynamic_filter=True,
            filter_overlong=filter_overlong, loss_agg='token', advantage='grpo',
            kl_coef=kl_coef, microbatches=microbatches, init_from=init_from)
  if phases:
    st['phases'] = phases
  return st


def agentic(name: str, *, max_turn_tokens: int, **grpo_fields) -> dict:
  """A GRPO stage over multi-turn episodes in its domains' environments (kind 'agentic').

  `max_response_len` is an episode's token budget after the opening prompt
  (turns and tool results), `max_turn_tokens` one assistant turn's; the rest
  as `grpo`.
  """
  return dict(grpo(name, **grpo_fields), kind='agentic', max_turn_tokens=max_turn_tokens)


def mopd(name: str, *, domains: list[str], teachers: dict, steps: int, optimizer: dict,
         prompts_per_step: int, group_size: int, temperature: float, max_prompt_len: int,
         max_response_len: int, microbatches: int, init_from: str = '',
         datasets: tuple[str, ...] = ('mopd_train',)) -> dict:
  """A multi-domain on-policy distillation stage (per-domain teachers from earlier stages).

  The arguments are the stage's fields; its prompts come from `datasets` ('mopd_train').
  """
  return dict(name=name, kind='mopd', domains=domains, datasets=list(datasets),
              teachers=teachers, steps=steps, optimizer=optimizer,
              prompts_per_step=prompts_per_step, group_size=group_size, temperature=temperature,
              max_prompt_len=max_prompt_len, max_response_len=max_response_len,
              microbatches=microbatches, init_from=init_from)


CASCADE1_DOMAINS = ['chat', 'instruction_following', 'ifbench', 'math', 'code', 'swe']
# The domains the SFT stages train (IFBench's constraints come in with IF-RL's second sub-stage).
CASCADE1_SFT_DOMAINS = ['chat', 'instruction_following', 'math', 'code', 'swe']


# Rows of one RL update are split into microbatches so that one row per device
# is in flight: 128 x 8 = 1024 rows over 8 batch shards (fsdp) = 128 per shard.
CASCADE1_RL_MICROBATCHES = 128

# The reward model of both Cascade-1 recipes: the paper's batch 256, lr 2e-6 and one epoch
# over 82K pairs (= 320 steps); max_len (its training pairs) is ours. As the chat verifier it
# scores whole rows up to the longest held-out one (a 4K prompt + the 60K budget = 65,536).
CASCADE1_RM = dict(steps=320, batch_size=256, max_len=8192, optimizer=dict(lr=2e-6),
                   microbatches=32, score_max_len=QWEN3_YARN_MAX_SEQ_LEN)


def cascade1_rl(**fields) -> dict:
  """A Cascade-1 GRPO stage's fields: 128 prompts x 8 rollouts at top-p 0.95, then `fields`.

  RL optimizers are AdamW at a constant lr with no warm-up (no weight decay,
  clipping at 1: the optimizer's defaults); a field given here replaces the
  shared one (e.g. SWE's 16 rollouts).
  """
  return {**dict(prompts_per_step=128, group_size=8, top_p=0.95,
                 microbatches=CASCADE1_RL_MICROBATCHES), **fields}


def cascade1_code_rl() -> dict:
  """Code RL as published for 14B (one stage at 56K); the 8B recipe uses it too (no 8B numbers)."""
  return cascade1_rl(steps=64, optimizer=dict(lr=4e-6, warmup_steps=0), temperature=1.0,
                     # 128 x 8 and top-p 0.95 assumed (not published for code).
                     max_prompt_len=4096, max_response_len=57_344,  # 56K
                     thinking_fraction=1.0)


def cascade1_swe_rl() -> dict:
  """Agentless SWE RL as published for 14B (x16 rollouts, lr 2.5e-6, 120 steps); 8B uses it too.

  The group size doubles, so the microbatch count does too (a microbatch keeps its rows).
  """
  return cascade1_rl(group_size=16, microbatches=2 * CASCADE1_RL_MICROBATCHES, steps=120,
                     optimizer=dict(lr=2.5e-6, warmup_steps=0),
                     temperature=1.0,              # assumed (not published)
                     # 128 prompts assumed; agentless prompts carry the localised files:
                     max_prompt_len=16_384, max_response_len=16_384,  # ours (not published)
                     thinking_fraction=1.0)


def cascade1_sft_stages(base: str) -> list[dict]:
  """Cascade 1's two SFT stages (16K, then 32K tokens) from the base checkpoint `base`.

  Cascade 1 gives SFT only as "two stages, 16K then 32K tokens"
  (configs/PAPERS.md); the optimizer is Cascade 2's published SFT optimizer,
  steps and batch are ours.
  """
  opt = dict(lr=5e-5, schedule='cosine', min_lr_ratio=0.1, warmup_steps=200, b2=0.98,
             weight_decay=0.1)
  return [
      dict(name='sft_16k', datasets=['sft_stage1'], init_from=base, steps=4000,  # steps: ours
           batch_size=64, max_len=16_384, optimizer=opt, microbatches=8),
      dict(name='sft_32k', datasets=['sft_stage2', 'sft_swe'], steps=2000,  # steps: ours
           batch_size=64, max_len=32_768, optimizer=opt, microbatches=8),
  ]


def cascade1(*, preset: str, data_root: str, tokenizer: str, base: str, rlhf: dict, if_rl: dict,
             if_rl_ifbench: dict, math: dict) -> ml_collections.ConfigDict:
  """Cascade 1: SFT stages -> reward model -> RLHF -> IF-RL (IFEval, then IFBench) -> Math RL
  -> Code RL -> SWE RL.

  The SFT stages (`cascade1_sft_stages` from the base checkpoint `base`), the
  reward model (`CASCADE1_RM`), code and SWE RL are the same for 8B and 14B;
  `rlhf`, `if_rl`, `if_rl_ifbench` and `math` hold the fields of the stages
  that differ (the keyword arguments of `grpo` other than name and domains).
  IF-RL is the paper's two sub-stages: 'if_rl' on IFEval-taxonomy prompts
  (verifier 'instruction_following'), then 'if_rl_ifbench' on IFBench-style
  prompts (verifier 'ifbench'), each a GRPO stage of its own. The order and the
  domains are the paper's. The model runs with YaRN factor 2.0 from 32,768
  positions (65,536, see QWEN3_YARN) and the paper's 64K evaluation budget
  (temperature 0.6, top-p 0.95).
  """
  c = base_config(preset=preset,
                  model_overrides=dict(max_seq_len=QWEN3_YARN_MAX_SEQ_LEN, remat=True,
                                       rope_scaling=QWEN3_YARN),
                  data_root=data_root, tokenizer=tokenizer, domains=CASCADE1_DOMAINS,
                  datasets=['sft_stage1', 'sft_stage2', 'sft_swe', 'rm_pairs'],
                  eval_max_new_tokens=61_440, eval_max_prompt_len=4096,
                  release=CASCADE1_RELEASE)
  # RLHF's reward as the paper's: an answer that mixes in a script its prompt does not use
  # scores the batch's lowest minus 10 (verifiers/reward_model.py). Training only: the
  # held-out chat score stays the reward model's own.
  c.domains.chat.verifier_options = dict(mixed_language_penalty=True)
  c.domains.chat.eval_verifier_options = dict()
  # Rewards that stand in for the paper's (announced in the banner, results.json
  # "substitutions"); a recipe that gives the paper's clears its line.
  c.domains.chat.stand_in = ("a Bradley-Terry reward model trained here on the SFT policy "
                             "(stage 'rm') in place of the paper's Qwen2.5-72B-Instruct one")
  c.domains.swe.stand_in = ('lexical similarity (difflib, verifiers.swe) for a patch neither '
                            "gold nor empty, in place of the paper's 72B judge's P(YES)")
  stages = [sft(**s, domains=list(CASCADE1_SFT_DOMAINS)) for s in cascade1_sft_stages(base)]
  last_sft = stages[-1]['name']
  stages.append(reward_model('rm', init_from=last_sft, **CASCADE1_RM))
  # RLHF starts from the SFT policy (not the RM); later stages from the previous policy.
  stages.append(grpo('rlhf', domains=['chat'], init_from=last_sft, **rlhf))
  stages.append(grpo('if_rl', domains=['instruction_following'], **if_rl))
  stages.append(grpo('if_rl_ifbench', domains=['ifbench'], **if_rl_ifbench))
  stages.append(grpo('math_rl', domains=['math'], **math))
  stages.append(grpo('code_rl', domains=['code'], **cascade1_code_rl()))
  stages.append(grpo('swe_rl', domains=['swe'], **cascade1_swe_rl()))
  c.stages = stages
  exact_sampler_buckets(c)
  fast_path(c)
  correct_mismatch(c)
  return c


def cascade1_hyper(h, c: ml_collections.ConfigDict) -> list[dict]:
  """Seeds x RL learning rates (x0.5, x1, x2 in every GRPO stage) x group size (x1, x2) of c.

  12 points, each a full cascade: `python -m launch.sweep` runs them one host
  at a time; `launch/xm_launch.py` submits one multi-host job per point. The
  group size doubles with the microbatch count, so a microbatch keeps its
  rows (and `launch.plan`'s memory numbers).
  """
  return h.product([
      h.sweep('seed', [0, 1]),
      h.stages(c, 'optimizer.lr', lambda st: [st['optimizer']['lr'] * f for f in (0.5, 1, 2)]),
      h.zipit([h.stages(c, 'group_size', lambda st: [st['group_size'] * f for f in (1, 2)]),
               h.stages(c, 'microbatches', lambda st: [st['microbatches'] * f for f in (1, 2)])]),
  ])
