"""Stage runners: one per kind ('sft', 'reward_model', 'grpo', 'mopd', 'eval'), in a registry.

Every training kind goes through `train`: restore the stage's newest good
checkpoint (or build a fresh state from the stage's starting policy), then
for each step build a batch (the kind's `BatchMaker`), run the jitted train
step, log, and checkpoint every `ckpt.every_n_steps` steps and at the end.
Step s of stage i draws its randomness from fold_in(fold_in(seed, i), s) and
its data from a grain iterator whose state is in every checkpoint, so a
resumed stage repeats exactly what an uninterrupted one does.

The runners see the domains only as data: a GRPO batch may mix domains, each
row scored by its own domain's verifier; MOPD routes each row to its domain's
teacher by index. `ctx` is the `cascade.run.Context` (models, sampler,
tokenizer, data, verifiers, workdir).
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from cascade import checkpoint
from cascade import config as config_lib
from cascade import data as data_lib
from cascade import metrics as metrics_lib
from cascade import rollout
from models import chat
from models import sharding
from rl import batch as batch_lib
from rl import distill
from rl import grpo
from rl import reward_model
from rl import sampler as sampler_lib
from rl import sft
from rl import train_step as train_lib


def optimizer_config(stage: config_lib.Stage) -> train_lib.OptimizerConfig:
  """The stage's optimizer in rl.train_step's terms (cosine decays over the stage)."""
  o = stage.optimizer
  return train_lib.OptimizerConfig(
      learning_rate=o.lr, warmup_steps=o.warmup_steps, schedule=o.schedule,
      decay_steps=max(1, stage.steps - o.warmup_steps), min_lr_ratio=o.min_lr_ratio,
      b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, max_grad_norm=o.clip_norm)


def stage_seed(seed: int, stage_index: int) -> int:
  """A 31-bit seed for stage i's data order and PRNG key."""
  return int(np.random.SeedSequence([seed, stage_index + 1]).generate_state(1)[0] >> 1)


class BatchMaker(NamedTuple):
  """A kind's per-step batch builder: make(step, rng, state) -> (batch, host metrics)."""
  loss_name: str
  loss_cfg: Any
  loader: data_lib.Loader
  make: Callable[[int, jax.Array, train_lib.TrainState], tuple[Any, dict]]


def train(ctx, stage: config_lib.Stage, model_kind: str, maker_fn) -> train_lib.TrainState:
  """Runs (or resumes) a training stage to its last step; returns the final TrainState.

  Args:
    ctx: the run context.
    stage: the stage.
    model_kind: 'policy' or 'reward_model' (which graphdef the state has).
    maker_fn: (state) -> BatchMaker, called once the state exists.
  """
  optimizer = train_lib.make_optimizer(optimizer_config(stage))
  schedule = train_lib.make_schedule(optimizer_config(stage))
  ckpts = ctx.checkpoints(stage)
  abstract = ctx.abstract_state(model_kind, optimizer)
  restored = ckpts.restore(abstract)
  if restored is not None:
    step, state, meta = restored
    print(f'[{stage.index}] {stage.name}: resuming at step {step}/{stage.steps}', flush=True)
  else:
    step, meta = 0, None
    state = ctx.initial_state(stage, model_kind, optimizer, stage_seed(ctx.seed, stage.index))
  maker = maker_fn(state)
  if meta is not None:
    maker.loader.set_state(meta['data'])
  graphdef = ctx.graphdef(model_kind)
  step_fn = train_lib.make_train_step(graphdef, maker.loss_name, maker.loss_cfg, optimizer,
                                      mesh=ctx.mesh, rules=ctx.rules, state=state,
                                      microbatches=stage.microbatches, lr_schedule=schedule)
  if ctx.mesh is not None and jax.process_count() > 1:
    step_fn = _with_global_batch(step_fn, ctx.mesh, ctx.rules)
  every = int(ctx.config.ckpt.every_n_steps)
  bar = metrics_lib.StageBar(stage, step)
  start, first_step = time.time(), step
  while step < stage.steps:
    t0 = time.perf_counter()
    rng = jax.random.fold_in(state.rng, step)
    batch, host = maker.make(step, rng, state)
    state, m = train_lib.run_step(step_fn, state, batch)
    m['update_s'] = m.pop('step_s')
    m.update(host, step_s=time.perf_counter() - t0)
    step += 1
    ctx.writer.write(stage, step, m)
    bar.update(m)
    if step == stage.steps or (every and step % every == 0):
      ckpts.save(step, state, {'step': step, 'stage_index': stage.index, 'stage': stage.name,
                               'data': maker.loader.get_state(),
                               'rng': checkpoint.rng_to_json(state.rng)})
  ckpts.wait()
  bar.close()
  ctx.stage_log.setdefault(stage.name, {}).update(
      steps_run=step - first_step, seconds=time.time() - start, first=bar.first, last=bar.last)
  return state


def _with_global_batch(step_fn, mesh, rules):
  """Wraps a train step so its host batch becomes global arrays split over 'batch'.

  In a multi-process run every process builds the same host batch (same data
  order, same seeds), but jit refuses host numpy inputs with a sharding that
  spans other processes' devices; each process contributes its own rows.
  """
  rows = jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(('batch',), None, mesh, rules))

  def to_global(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, rows, lambda index: x[index])

  return lambda state, batch: step_fn(state, jax.tree.map(to_global, batch))


# ---------------------------------------------------------------- SFT

def sft_example(rec: dict, tokenizer, thinking_switch: bool, max_len: int):
  """(tokens, loss mask) of an SFT record: the prompt is context, the response is learned."""
  thinking = rec.get('thinking')
  mode = (thinking is not None) if thinking_switch else None
  prompt = tokenizer.encode(rollout.prompt_text(rec, mode))
  # In instruct mode the empty thinking block is already in the prompt.
  response = tokenizer.encode(chat.render_response(rec['response'],
                                                   thinking if mode is not False else None))
  toks = (prompt + response)[:max_len]
  mask = ([0] * len(prompt) + [1] * len(response))[:max_len]
  return toks, mask


def _rows_bucket(n: int, multiple: int) -> int:
  """Rows padded to a power of two and a multiple of `multiple` (few compiled shapes)."""
  b = 1 << max(0, (n - 1).bit_length())
  return -(-b // multiple) * multiple


def run_sft(ctx, stage):
  records = ctx.stage_records(stage)

  def maker(state):
    del state
    loader = data_lib.Loader(records, stage_seed(ctx.seed, stage.index), stage.batch_size)

    def make(step, rng, state):
      del step, rng, state
      ex = [sft_example(r, ctx.tokenizer, stage.thinking_switch, stage.max_len)
            for r in loader.next()]
      packed = sft.pack(ex, stage.max_len, pad_id=ctx.tokenizer.pad_id)
      rows = _rows_bucket(packed.tokens.shape[0], stage.microbatches * ctx.batch_shards)
      batch = sft.pack(ex, stage.max_len, num_rows=rows, pad_id=ctx.tokenizer.pad_id)
      return batch, {'examples': len(ex), 'rows': rows,
                     'learned_tokens': float(np.sum(batch.loss_mask))}
    return BatchMaker('sft', None, loader, make)

  return train(ctx, stage, 'policy', maker)


# ---------------------------------------------------------------- reward model

def run_reward_model(ctx, stage):
  records = ctx.stage_records(stage)

  def maker(state):
    del state
    loader = data_lib.Loader(records, stage_seed(ctx.seed, stage.index), stage.batch_size)

    def make(step, rng, state):
      del step, rng, state
      recs = loader.next()
      batch = reward_model.make_pair_batch(
          ctx.tokenizer, [rollout.verifier_prompt(r) for r in recs],
          [r['chosen'] for r in recs], [r['rejected'] for r in recs], stage.max_len)
      return batch, {}
    return BatchMaker('reward_model', None, loader, make)

  return train(ctx, stage, 'reward_model', maker)


# ---------------------------------------------------------------- GRPO / MOPD

def _pad_prompts(samples: sampler_lib.SampleOutput, width: int) -> sampler_lib.SampleOutput:
  """Left-pads the prompt columns to `width`, so the train batch has one shape per phase."""
  p = samples.prompt_tokens.shape[1]
  if p > width:
    raise ValueError(f'prompt of {p} tokens exceeds max_prompt_len={width}')
  pad = lambda x: np.pad(np.asarray(x), ((0, 0), (width - p, 0)))
  return samples._replace(prompt_tokens=pad(samples.prompt_tokens),
                          prompt_mask=pad(samples.prompt_mask))


class _Draws:
  """Sampling rounds of one RL step: each draws prompts, samples G each and scores them."""

  def __init__(self, ctx, stage, loader, step, rng, params):
    self.ctx, self.stage, self.loader = ctx, stage, loader
    self.rng, self.params = rng, params
    phase = stage.phase_at(step)
    self.sp = sampler_lib.SamplingParams(temperature=phase.temperature, top_p=stage.top_p,
                                         top_k=stage.top_k,
                                         max_new_tokens=phase.max_response_len)
    self.modes_rng = np.random.default_rng([ctx.seed, stage.index, step])
    self.rewards, self.lengths, self.truncated, self.domains = [], [], [], []
    self.sample_s = self.score_s = 0.0

  def __call__(self, n: int):
    st = self.stage
    recs = self.loader.next()
    assert len(recs) == n, (len(recs), n)
    modes = rollout.draw_modes(n, st.thinking_fraction, self.modes_rng)
    t0 = time.perf_counter()
    key = jax.random.fold_in(self.rng, len(self.rewards))
    ro = rollout.generate(self.ctx.sampler, self.params, self.ctx.tokenizer, recs, modes, key,
                          self.sp, st.group_size)
    t1 = time.perf_counter()
    rewards, _ = rollout.score(ro, self.ctx.verifier_of, self.ctx.sample_cls)
    self.sample_s += t1 - t0
    self.score_s += time.perf_counter() - t1
    self.rewards.append(rewards)
    self.lengths.append(ro.samples.lengths)
    self.truncated.append(ro.samples.truncated)
    self.domains += [r['domain'] for r in ro.records]
    domain_idx = np.array([self.ctx.domain_index[r['domain']] for r in ro.records], np.int32)
    return {'samples': _pad_prompts(ro.samples, st.max_prompt_len), 'domain': domain_idx}, rewards

  def collect(self):
    """Draws one batch of groups (refilling past all-equal groups when the stage filters)."""
    st = self.stage
    if st.dynamic_filter:
      f = grpo.fill_groups(self, st.prompts_per_step, st.group_size,
                           max_rounds=1 + st.refill_cap)
      return f.rows, f.rewards, f.valid, {'prompts_drawn': f.prompts_drawn, 'rounds': f.rounds,
                                          'groups_kept': f.groups_kept}
    rows, rewards = self(st.prompts_per_step)
    return rows, rewards, np.ones(rewards.shape, bool), {}

  def metrics(self) -> dict:
    r = np.concatenate(self.rewards)
    out = {'reward_mean': float(np.mean(r)), 'reward_std': float(np.std(r)),
           'response_len': float(np.mean(np.concatenate(self.lengths))),
           'truncated_frac': float(np.mean(np.concatenate(self.truncated))),
           'sample_s': self.sample_s, 'score_s': self.score_s,
           'temperature': self.sp.temperature, 'max_response_len': self.sp.max_new_tokens}
    doms = np.array(self.domains)
    if len(set(self.domains)) > 1:
      for d in sorted(set(self.domains)):
        out[f'reward_mean/{d}'] = float(np.mean(r[doms == d]))
    return out


def _rl_valid(stage, step, rows, valid):
  """Rows that carry loss: the filled groups, minus truncated rows in an overlong-filter phase."""
  if stage.phase_at(step).filter_overlong:
    valid = valid & ~np.asarray(rows['samples'].truncated, bool)
  return valid


def run_grpo(ctx, stage):
  records = ctx.stage_records(stage)
  ref_params = ctx.start_params(stage) if stage.kl_coef > 0 else None
  loss_cfg = grpo.GrpoConfig(advantage=stage.advantage, aggregation=stage.loss_agg,
                             kl_coef=stage.kl_coef, kl_estimator=stage.kl_estimator)

  def maker(state):
    del state
    loader = data_lib.Loader(records, stage_seed(ctx.seed, stage.index), stage.prompts_per_step)

    def make(step, rng, state):
      draws = _Draws(ctx, stage, loader, step, rng, state.params)
      rows, rewards, valid, fill = draws.collect()
      adv = grpo.advantages(rewards, stage.group_size, stage.advantage)
      valid = _rl_valid(stage, step, rows, valid)
      batch = batch_lib.from_samples(rows['samples'], adv, valid=valid)
      if ref_params is not None:
        batch = batch._replace(ref_logprobs=np.asarray(batch_lib.compute_logprobs(
            ctx.graphdef('policy'), ref_params, batch, ctx.mesh, ctx.rules)))
      return batch, {**draws.metrics(), **fill, 'rows_with_loss': float(np.mean(valid))}
    return BatchMaker('grpo', loss_cfg, loader, make)

  return train(ctx, stage, 'policy', maker)


def run_mopd(ctx, stage):
  records = ctx.stage_records(stage)
  teachers, teacher_of_domain = ctx.teachers(stage)

  def maker(state):
    del state
    loader = data_lib.Loader(records, stage_seed(ctx.seed, stage.index), stage.prompts_per_step)

    def make(step, rng, state):
      draws = _Draws(ctx, stage, loader, step, rng, state.params)
      rows, _, valid, fill = draws.collect()
      valid = _rl_valid(stage, step, rows, valid)
      idx = teacher_of_domain[rows['domain']]
      batch = batch_lib.from_samples(rows['samples'], np.zeros(idx.shape, np.float32),
                                     valid=valid, teacher_index=idx)
      lp = distill.teacher_logprobs(ctx.graphdef('policy'), teachers, idx, batch,
                                    mesh=ctx.mesh, rules=ctx.rules)
      return batch._replace(teacher_logprobs=lp), {**draws.metrics(), **fill}
    return BatchMaker('mopd', None, loader, make)

  return train(ctx, stage, 'policy', maker)


def run_eval(ctx, stage):
  """An 'eval' stage trains nothing: its policy is its starting one (init_from or the current)."""
  del ctx, stage
  return None


# kind -> runner(ctx, stage) -> final TrainState (None for 'eval').
RUNNERS = {'sft': run_sft, 'reward_model': run_reward_model, 'grpo': run_grpo,
           'mopd': run_mopd, 'eval': run_eval}
