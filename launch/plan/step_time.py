"""The step-time bound, counted from the config with nothing compiled (`TIME_ASSUMPTIONS`):
the decode steps' reads of the weights, the KV cache and the Mamba states at HBM bandwidth
against their FLOPs at peak, the prefill, scoring, judges, the update and the frozen passes."""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
from jax.sharding import NamedSharding
import numpy as np

from cascade import policies
from launch.plan import flops as flops_lib
from launch.plan import judges as judges_lib
from launch.plan import memory
from launch.plan import programs as programs_lib
from launch.plan import results
from models import sharding
from rl import judge as judge_lib
from rl import sampler as sampler_lib


def decode_read_bytes(model_cfg, sampler, rows: int) -> float:
  """Per-device bytes of weights one decode step over `rows` rows reads, in the sampler's layout.

  Every weight the device holds (the rollout layout when `rollout_rules` reshards them),
  except that of its routed experts only those the step's tokens reach count: a
  shard's expert group sees R tokens (its batch shard's rows, times the 'expert' axes the
  rows are gathered over, as models/moe.py does), each choosing K of the E experts; with
  choices spread evenly an expert is reached with probability 1 - (1 - K/E)^R.
  """
  mesh, rules = sampler.mesh, sampler.rules
  reached = _experts_reached(model_cfg, mesh, rules, rows) if model_cfg.num_experts else 1.0
  _, params = policies.abstract_model(model_cfg, 'policy')
  _, given = programs_lib.sampler_for(model_cfg, mesh, rules, {})
  rolled = jax.tree.leaves(sampler.rollout_params(given))   # the dtypes the sampler reads
  flat = nnx.to_flat_state(params)
  assert len(rolled) == len(flat), (len(rolled), len(flat))
  total = 0.0
  for (_, v), leaf in zip(flat, rolled):
    shape = v.get_value().shape
    axes = v.get_metadata().get('logical_axes') or (None,) * len(shape)
    spec = sharding.logical_to_spec(axes, shape, mesh, rules)
    shard = NamedSharding(mesh, spec).shard_shape(shape)
    total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize * (
        reached if 'experts' in axes else 1.0)
  return total


def _experts_reached(cfg, mesh, rules, rows: int) -> float:
  """The expected fraction of a shard's routed experts that one decode step over `rows` rows
  reaches (see `decode_read_bytes`)."""
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  axes = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
  spec = sharding.logical_to_spec(('experts', 'embed', 'moe_mlp'),
                                  (cfg.num_experts, cfg.embed_dim, cfg.moe_dim), mesh, rules)
  ep, tp = axes(spec[0]), axes(spec[2])
  split = [a for a in axes(sharding.logical_to_spec(('batch',), (rows,), mesh, rules)[0])
           if a not in tp]
  seen = rows / np.prod([sizes[a] for a in split]) * np.prod([sizes[a] for a in split
                                                              if a in ep])
  return float(1 - (1 - cfg.experts_per_token / cfg.num_experts) ** seen)


# What the step-time bound (`step_time`) assumes, printed with it.
TIME_ASSUMPTIONS = (
    'every device call (a decode step, a prefill) takes max(the bytes it reads per device / '
    'hardware.hbm_gbps, its FLOPs per device / hardware.peak_tflops): reads and compute '
    'overlap perfectly; host syncs, launches and sampling itself are free',
    "collectives (where the programs were compiled): those of each compiled program's optimized "
    'HLO, each priced at the ring algorithm\'s bytes per device ((n - 1) / n of the buffer; '
    'twice that for an all-reduce) over the target\'s interconnect (`targets.INTERCONNECTS`: '
    'on a torus both ways along the axes a group spans, an all-to-all at the ring\'s bisection; '
    'through a switch at one link\'s rate; across slices or hosts at DCN or the inter-node '
    "network's rate), one after another. Overlapped (the bound): a part's collectives hide "
    'behind its compute and reads, the part taking the larger; serial: they add. A sampler '
    "call's collectives count per call (chunk or engine call) plus, per decode step, those of "
    'one iteration of its decode loop; the largest call\'s program stands for every call',
    "every row of a round generates the longest phase's max_response_len tokens: a one-call "
    "chunk runs to the cap, the paged engine's slots turn over in whole waves",
    "a decode step reads per device the weights in the sampler's layout (of routed experts, "
    'those its tokens reach); for each of its rows the K and V of every attention sublayer '
    "over the keys it attends (one-call: the decode phase's cache extent, every row of the "
    "chunk; paged: the row's filled pages); each Mamba sublayer's state, read and written. "
    'A prefill call reads the weights once; its KV writes are left out',
    'FLOPs counted from the config (`counted_flops`: matmuls and attention scores; Mamba\'s '
    'scan, norms and the embedding gather left out), for the prefill, the update (each of '
    'updates_per_batch), the frozen passes and reward-model scoring, all at peak',
    'one sampling round per step (the bound); dynamic filtering runs up to 1 + refill_cap '
    "rounds, stream_filter feeds up to 1 + refill_cap batches (the worst case: sampling and "
    'scoring that many times)',
    'scoring by verifiers on the hosts is not estimated (host CPU time, partly hidden behind '
    'sampling); a reward model\'s scoring pass is, every row of the round at its full length '
    "up to the reward-model stage's max_len",
    "a judge model's scoring is: every sample of the round judged (pairwise: both orders; "
    'round robin: G - 1 rows per sample), every judge row at the judge\'s longest row '
    "(rl.judge.MAX_LEN tokens, within its positions); 'logits': one forward per batch of rl.judge.BATCH_SIZE rows, "
    "each max(reading the judge's weights, its FLOPs at peak); 'generate': one greedy sampler "
    "call of max_new_tokens per row, bounded as the policy's sampling is",
    "an agentic episode: one call per turn, the turns' prompts growing by the turns before "
    '(observations left out); with the paged engine a KV session holds them',
)


def sampling_time(model_cfg, sampler, hw, *, rows: int, prompt_len: int, max_new_tokens: int,
                  num_samples: int = 1, continued: bool = False, **_) -> dict:
  """One `Sampler.generate` call's time bound in parts (`results.StepTime`'s sampling fields,
  seconds) and its decode steps, every row generating `max_new_tokens` (`TIME_ASSUMPTIONS`).

  One-call: per chunk of rows, a prefill of its distinct prompts (`prefill_group`) over the
  prompt bucket, then max_new_tokens - 1 decode steps, the step s of decode phase i (ends[i-1]
  <= s < ends[i], `decode_phases`) attending the cache extent prompt bucket + ends[i] for every
  row of the chunk. Paged: the prompts' first len - 1 tokens prefilled once per prompt in calls
  of `prefill_prompts` (none when `continued`), then per wave of `slots` rows max_new_tokens
  decode steps, step j attending the prompt_len + j keys of each row in whole pages.

  Returns:
    dict(weights, kv, state, compute, prefill, decode_steps).
  """
  peak, bw = hw.peak_tflops * 1e12, hw.hbm_gbps * 1e9
  cfg, mesh, rules = model_cfg, sampler.mesh, sampler.rules
  n, shards = mesh.size, sharding.batch_shards(mesh, rules)
  p, nb, chunk = sampler.call_shape(rows, prompt_len, max_new_tokens)
  m = min(max_new_tokens, nb)
  prefills = []      # (calls, tokens per call, keys per token on average)
  if sampler.engine == 'one_call':
    slots = chunk
    keys, count, lo = [], [], 1
    ends = sampler_lib._phase_ends(nb, sampler.decode_phases)  # pylint: disable=protected-access
    for end in ends:
      hi = min(m, end)
      if hi > lo:
        keys.append(p + end)
        count.append(hi - lo)
      lo = max(lo, hi)
    keys, count = np.asarray(keys, float), np.asarray(count, float)
    u = chunk // sampler.prefill_group(chunk, num_samples)
    prefills.append((-(-rows // chunk), u * p, (p + 1) / 2, u))
  else:
    eng = sampler._rollout.engine(chunk)  # pylint: disable=protected-access
    slots, ps = eng.opt.slots, eng.opt.page_size
    keys = np.ceil((prompt_len + np.arange(m)) / ps) * ps
    count = np.ones(m)
    if not continued:
      a, t = eng.opt.prefill_prompts, eng.prefill_tokens(prompt_len)
      prompts = -(-rows // num_samples)               # each prompt once, for its G rows
      prefills.append((-(-prompts // a), a * t, (t + 1) / 2, 0))
  waves = -(-rows // slots)
  rows_dev = slots // shards
  weights = decode_read_bytes(cfg, sampler, slots)
  kv = rows_dev * keys * sampler_lib.kv_token_bytes(cfg, mesh, rules)
  state = rows_dev * 2 * sampler_lib.row_state_bytes(cfg, mesh, rules)       # read and written
  f0 = flops_lib.counted_flops(cfg, 'policy', slots, 0.0)
  # Linear in the keys.
  flops = f0 + (flops_lib.counted_flops(cfg, 'policy', slots, 1.0) - f0) * keys
  reads = (weights + kv + state) / bw
  out = dict(weights=float(waves * count.sum() * weights / bw),
             kv=waves * float((count * kv).sum()) / bw,
             state=float(waves * count.sum() * state / bw),
             compute=waves * float((count * np.maximum(0.0, flops / (n * peak) - reads)).sum()),
             prefill=0.0, decode_steps=int(waves * count.sum()))
  for calls, tokens, context, head in prefills:
    f = flops_lib.counted_flops(cfg, 'policy', tokens, context, head_tokens=head)
    out['prefill'] += calls * max(decode_read_bytes(cfg, sampler, tokens) / bw, f / (n * peak))
  return out


def step_time(stage, kind, model_cfg, mesh, rules, hw, sampler_cfg: dict,
              rm_stages=(), judges=()) -> results.StepTime | None:
  """The time bound of one step of `stage` and its parts, from the config alone (nothing is
  compiled; `TIME_ASSUMPTIONS`), on `hw` (`peak_tflops`, `hbm_gbps`); None when it names
  neither.

  Args:
    stage, kind: the resolved stage and its kind.
    model_cfg, mesh, rules: the policy, the target mesh and its logical rules.
    hw: config.hardware.
    sampler_cfg: config.sampler's options.
    rm_stages: the reward_model stages whose models score this stage's rows.
    judges: the judge models its verifiers call (`judges.judge_calls`).

  Returns:
    The StepTime.
  """
  peak, bw = hw.peak_tflops * 1e12, hw.hbm_gbps * 1e9
  if not peak or not bw:
    return None
  at_peak = lambda flops: flops / (mesh.size * peak)
  parts = dict(weights=0.0, kv=0.0, state=0.0, compute=0.0, prefill=0.0, decode_steps=0)
  old = 0.0
  sizes = kind.sampler_sizes(stage) if kind.sampler_sizes is not None else None
  if sizes is not None:
    sampler, _ = programs_lib.sampler_for(model_cfg, mesh, rules, sampler_cfg)
    for call in (kind.sampler_calls(stage) if kind.sampler_calls is not None else [sizes]):
      for k, v in sampling_time(model_cfg, sampler, hw, **call).items():
        parts[k] += v
    # The bound this replaces: per new token of each chunk of the largest call, one read of
    # the weights a decode step reads; the paged engine's prefill calls at peak.
    chunk = sampler.call_shape(sizes['rows'], sizes['prompt_len'], sizes['max_new_tokens'])[2]
    old += (-(-sizes['rows'] // chunk) * sizes['max_new_tokens']
            * decode_read_bytes(model_cfg, sampler, chunk) / bw)
    if sampler.engine == 'paged':
      eng = sampler._rollout.engine(chunk)  # pylint: disable=protected-access
      a, t = eng.opt.prefill_prompts, eng.prefill_tokens(sizes['prompt_len'])
      prompts = -(-sizes['rows'] // sizes.get('num_samples', 1))
      old += -(-prompts // a) * at_peak(flops_lib.counted_flops(
          model_cfg, 'policy', a * t, (t + 1) / 2, head_tokens=0))
  update = 0.0
  if kind.abstract_batch is not None:
    one = at_peak(flops_lib.train_flops(stage, model_cfg, mesh, rules))
    update, old = getattr(stage, 'updates_per_batch', 1) * one, old + one
  frozen = sum(ff.calls * at_peak(flops_lib.forward_flops(model_cfg, 'policy', mesh, rules,
                                                          ff.rows, ff.length)[0])
               for ff in (kind.frozen_forwards(stage) if kind.frozen_forwards else []))
  old += frozen
  scoring = None
  if sizes is not None and rm_stages:
    rows, length = sizes['rows'], stage.max_prompt_len + stage.longest_response
    scoring = sum(at_peak(flops_lib.counted_flops(model_cfg, 'reward_model',
                                                  rows * min(length, s.score_len),
                                                  (min(length, s.score_len) + 1) / 2))
                  for s in rm_stages)
    old += sum(at_peak(flops_lib.forward_flops(model_cfg, 'reward_model', mesh, rules,
                                               s.batch_size, s.max_len)[0]) for s in rm_stages)
  judge = (judge_time(judges, mesh, rules, hw, sampler_cfg, model_cfg) if sizes is not None
           else 0.0)
  rounds = 1 + stage.refill_cap if getattr(stage, 'dynamic_filter', False) else 1
  steps = parts.pop('decode_steps')
  return results.StepTime(**parts, scoring=scoring, judge=judge, update=update, frozen=frozen,
                          rounds=rounds,
                          weights_only=old, decode_steps=steps)


def with_collectives(time: results.StepTime | None, programs, stage, kind, sampler=None,
                     ) -> results.StepTime | None:
  """`time` with the collectives of a stage's priced programs (`collectives.priced`) per step:
  the train step's times updates_per_batch; the sampler's per call times its calls and per
  decode step times the decode steps; the frozen passes' times their calls; reward-model
  scoring's once (`TIME_ASSUMPTIONS`). Judges' programs are left out."""
  if time is None:
    return None
  by = {p.name: p for p in programs if not p.error}
  update = (getattr(stage, 'updates_per_batch', 1) * by['train step'].collective_s
            if 'train step' in by else 0.0)
  frozen = sum(ff.calls * by[ff.name].collective_s
               for ff in (kind.frozen_forwards(stage) if kind.frozen_forwards else [])
               if ff.name in by)
  scoring = sum(p.collective_s for n, p in by.items() if n.startswith('reward model scoring'))
  sampling = 0.0
  if sampler is not None and 'sampler' in by:
    decode_calls, prefill_calls = sampler_call_counts(stage, kind, sampler, time.decode_steps)
    sampling = (decode_calls * by['sampler'].collective_s
                + time.decode_steps * by['sampler'].collective_step_s)
    if 'sampler prefill' in by:
      sampling += prefill_calls * by['sampler prefill'].collective_s
  return dataclasses.replace(time, collective_sampling=sampling, collective_update=update,
                             collective_frozen=frozen, collective_scoring=scoring)


def sampler_call_counts(stage, kind, sampler, decode_steps: int) -> tuple[float, float]:
  """(decode calls, prefill calls) of one sampling round: one-call, a call per chunk of rows
  (its prefill inside); paged, an engine call per chunk_steps decode steps and the prefill
  calls of `prefill_prompts` prompts each."""
  calls = kind.sampler_calls(stage) if kind.sampler_calls is not None else [
      kind.sampler_sizes(stage)]
  decode = prefill = 0.0
  for call in calls:
    rows = call['rows']
    chunk = sampler.call_shape(rows, call['prompt_len'], call['max_new_tokens'])[2]
    if sampler.engine == 'one_call':
      decode += -(-rows // chunk)
      continue
    eng = sampler._rollout.engine(chunk)  # pylint: disable=protected-access
    if not call.get('continued', False):
      prompts = -(-rows // call.get('num_samples', 1))
      prefill += -(-prompts // eng.opt.prefill_prompts)
  if sampler.engine != 'one_call':
    decode = decode_steps / eng.opt.chunk_steps
  return decode, prefill


def judge_time(calls, mesh, rules, hw, sampler_cfg: dict, policy_cfg=None) -> float:
  """Seconds of one scoring call of every judge (`TIME_ASSUMPTIONS`)."""
  peak, bw = hw.peak_tflops * 1e12, hw.hbm_gbps * 1e9
  total = 0.0
  for jc in calls:
    cfg = jc.model_cfg
    if jc.use.score_by == 'logits':
      rows = programs_lib.forward_rows(judge_lib.BATCH_SIZE, mesh, rules)
      length = judges_lib.judge_row_len(cfg)
      flops = flops_lib.counted_flops(cfg, 'policy', rows * length, (length + 1) / 2,
                                      head_tokens=rows)
      reads = memory.params_bytes(cfg, 'policy', mesh, rules)
      total += -(-jc.rows // rows) * max(reads / bw, flops / (mesh.size * peak))
      continue
    opts = judges_lib.judge_sampler_options(sampler_cfg, cfg, policy_cfg, mesh, rules)
    sampler, _ = programs_lib.sampler_for(cfg, mesh, rules, opts, frozen=True)
    parts = sampling_time(cfg, sampler, hw, rows=jc.rows,
                          prompt_len=judges_lib.judge_row_len(cfg, jc.use.max_new_tokens),
                          max_new_tokens=jc.use.max_new_tokens)
    parts.pop('decode_steps')
    total += sum(parts.values())
  return total
