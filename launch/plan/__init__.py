"""Ahead-of-time plan: compile every stage's programs for the config's mesh, without weights.

One command in rooms that say what they hold (one way, no circles: each imports
only the rooms listed before it):

  results.py     what a plan finds: ProgramReport, StageReport, StepTime
  targets.py     the devices compiled for (TPU topology, XLA:GPU deviceless, simulated
                 CPUs), the plan's mesh, the model and sampler as the target runs them
  collectives.py the collectives of a compiled program's optimized HLO (`parse`: kind, replica
                 groups, ring bytes, loop counts) and their seconds on the target's
                 interconnect (`priced`, `seconds`)
  compiler.py    compiler options, `compile_program` (memory, FLOPs and collectives of one
                 program)
  programs.py    abstract params, the Sampler a run builds, the lowerings of train
                 steps, sampler calls and frozen scoring passes
  flops.py       FLOPs counted from the config (`counted_flops`)
  judges.py      the judge models verifiers call, and their programs
  memory.py      bytes beside each program: what stays resident (`resident`)
  step_time.py   the step-time bound (`step_time`, `TIME_ASSUMPTIONS`)
  suite_calls.py what config.eval.suites ask of the devices: each suite's largest sampler
                 call and its grader's local judge
  evaluation.py  the held-out evaluation's programs and the suites'
  stages.py      a stage's plan (`plan_stage`) and a config's (`run_plan`, `time_plan`,
                 `collective_plan`)
  dispatch.py    the two expert dispatches compiled side by side (`compare`) and the cheaper
                 with 10 % of memory free (`cheaper`, `choose`): --compare_dispatch
  report.py      the printed plan, the header, the Markdown page, the failures
  cli.py         the flags and `main` of `python -m launch.plan` (__main__.py runs it)

    python -m launch.plan --config=configs/nemotron_cascade_14b.py
    python -m launch.plan --config=configs/tiny.py --stages=sft,math_rl --backend=cpu
    python -m launch.plan --config=configs/tiny.py:smoke --config.mesh.shape=1,2,1         --config.stages.math_rl.group_size=8 --stages=math_rl --noeval

`--config` takes the overrides `python -m cascade.main` takes (stages by name,
fields the config leaves unset; cascade/overrides.py), so a plan is of the
config the same command line would run.

For every training stage it lowers and compiles, for the config's mesh and
with abstract shapes only (`nnx.eval_shape` for the model,
`jax.ShapeDtypeStruct`s with shardings for the state and the batch):

* the jitted train step (`rl.train_step.make_train_step`) for the stage's
  largest batch: SFT rows of `max_len`, reward-model pairs, RL rows of
  `max_prompt_len` + the longest phase's `max_response_len`;
* for RL stages, the jitted sampler (`rl.sampler.sample`) with the shapes
  the stage loop feeds it: prompts x G rows in one call, the prompt and
  new-token buckets and decode phases of `config.sampler` (default:
  rl.sampler's);

plus the held-out evaluation's sampler once. It prints per-device memory
(arguments, outputs, temporaries, total = arguments + outputs + temporaries
- donated aliases, from `compiled.memory_analysis()`; for a program over the
limit by itself, its largest arrays) and its collectives (`collectives.parse`: each
all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute of the optimized
HLO with its replica groups, counted per call with known loop trip counts, and the ring
algorithm's bytes per device) and XLA's FLOP count
(`cost_analysis()`; XLA counts a loop body once, so FLOPs are counted on a
twin lowered with the layers unrolled and the batch in one microbatch; a
sampler's prefill and one step per decode loop), and exits with status 1 naming every stage
that does not fit the per-device memory in `config.hardware`.

The mixture-of-experts families (hybrid Mamba / MoE / attention stacks, the
mesh's 'expert' axis) compile the same way, but their FLOPs are counted from
the config (`flops.counted_flops`: the active parameters, `num_params(active=True)`,
and attention scores): XLA:CPU lowers the routed experts' ragged_dot as a
dense dot of all of a shard's experts over all token-expert pairs and counts
a shard_map body once, so XLA's number is no measure of their work; a
sampler's FLOPs are then the whole call's.

Target devices: with `libtpu` importable (`pip install "jax[tpu]"`, not a
dependency of cascade) the real TPU compiler runs against
`config.hardware.topology` (e.g. 'v5p:4x4x4') on this CPU host, and an
over-HBM program fails at compile time. Without it, simulated CPU devices of
the same count stand in: argument sizes are exact, temporaries are XLA:CPU's
(its fusion and layouts differ from the TPU's), and the limit is checked
here. The output says which.

For a GPU target (`config.hardware.platform='gpu'`) with jax's CUDA plugin importable
(`pip install "jax[cuda12]"` in its own environment, docs/planning.md) and
`config.hardware.gpu_target` naming a GpuTargetConfigProto text file (e.g.
launch/gpu_targets/h200.txtpb), XLA:GPU compiles deviceless on this CPU host for as many
of those GPUs, 8 per host (`--backend=gpu`): its memory is XLA:GPU's own, but it compiles
a program over the GPU's memory without complaint, so the limit is checked here, and it
returns no cost analysis, so FLOPs are counted on CPU devices as for a TPU topology.

    python -m launch.plan --config=configs/nemotron_cascade_14b.py:hardware=h200x8 --backend=gpu

plus the frozen passes a step runs (the kind's `frozen_forwards`: a KL or DPO
reference, MOPD teachers) and the reward model's scoring pass for stages whose
domains are scored by one. Each program's fit is checked with what stays
resident beside it (the optimizer state beside the sampler, frozen references,
teachers and reward models beside everything): the co-resident peak. With
`hardware.peak_tflops` and `hardware.hbm_gbps` it prints a bound on each
step's time by part and per stage in chip-hours (`step_time`, counted from the
config, with its `TIME_ASSUMPTIONS`): sampling per device call, each decode
step the larger of its reads (the weights in the sampler's layout,
`decode_read_bytes`; the KV cache over the keys each row attends; Mamba
states) at HBM bandwidth and its FLOPs at peak, the prefill, the refill
rounds' worst case; reward-model scoring; the update's and the frozen passes'
FLOPs at peak; where the programs were compiled, each part's collectives priced on the
target's interconnect (`targets.INTERCONNECTS`: TPU v5p ICI and DCN, H200 NVLink and the
inter-node network), overlapped with the part (the bound) and serial (added).
`--time_only` prints just that, compiling nothing (no collectives). Not
compiled: the per-phase variants shorter than a stage's longest phase (they
need less memory).

    python -m launch.plan --config=configs/nemotron_cascade_14b.py --time_only

The evaluation's plan also holds each of config.eval.suites' largest sampler call (its
prompts x its protocol's samples, its longest prompt, its protocol's token budget: AIME's
64K) and its grader's local judge model (ArenaHard's judge=DIR; a served judge costs no
device memory), `suite_calls`.
"""
