"""End-to-end GRPO step (rollout + trivial reward + update), optionally against TRL's GRPOTrainer.

  .venv/bin/python -m benchmarks.grpo_step
  .venv/bin/python -m benchmarks.grpo_step --compare_trl     # needs setup.py's [bench] extra
  python -m benchmarks.grpo_step --pair_with=27d9422 --pairs=3 --steps=6 \
      --doc=docs/benchmarks/grpo_step.md                     # old code against new

The fixed workload's step runs through the stage loop by default (--step=loop:
`cascade.kinds.loop.train_stage` in a temporary workdir, with its divergence
check, metrics log behind the workdir lock's check, checkpoint cadence and
preemption check), each step followed by the bare programs of the same work
(`benchmarks/floor.py`) so that the ratio compares neighbours in time; the
loop's step clock (`foundation.step_clock`) splits the step into program and
host time by part, and the JSON line carries host_s, program_s, parts_s,
bare_s, x_bare and x_bare_paired besides the keys below. --step=direct (and
--compare_trl) calls the sampler, the reward and the train step one after
another, as before. --pair_with=COMMIT (or a checkout's directory) runs
--step=loop with this file's code on that commit's tree and on this one,
alternately, --pairs times each, and --doc writes the page.

--scan_layers=true|false forces our model's layer scan (default 'auto': a loop on
CPU, see models/config.py) to compare the two.

Defaults: the tiny Qwen3-like shape (2 layers, embed 192, 6 x 32 heads, 6 kv
heads, MLP 768, vocab 256), 4 prompts x 8 samples x 64 new tokens, 16-token
prompts. One step = sample 32 completions, score them on the host (reward:
the fraction of completion tokens equal to --target_token), group
advantages, one jitted AdamW update (token-level loss, no KL, lr --lr).
Every completion is exactly --new_tokens long on both sides (we sample with
no stop token; TRL with min_new_tokens = max_new_tokens).

--compare_trl writes the same random weights with models.hf.save_model, loads
them into TRL's GRPOTrainer (beta 0 so no reference model, no vLLM, torch CPU
on 2 threads, float32, gradient checkpointing off, loss_type 'dapo' = our
token-level aggregation, scale_rewards 'group' = our (r - mean) / std, one
generation per update) with a 256-token word-level tokenizer, the same
prompts, G and reward, and interleaves one of our steps after every TRL step
so that load from other processes hits both alike. Medians after a warm-up
step are compared.

--workload=longtail: every row gets its own target length (a lognormal with
median --new_tokens / 8, one row in 32 at --new_tokens; stop positions
enforced as `row_limits`), and two of our steps alternate: today's padded
step (one-call sampler in chunks of --chunk_rows rows, every row padded to
prompt + max response for the update) and the engine step (the paged engine
at the same KV memory with 2 x --chunk_rows slots, the update packed into
rows of --pack_tokens tokens):

  .venv/bin/python -m benchmarks.grpo_step --workload=longtail --prompts=16 --new_tokens=256

Printed: a table, the step's floor (sampling: FLOPs at the measured matmul
rate, or the weight reads of the longest row's decode steps at the measured
bandwidth; the update: its FLOPs over the real tokens) beside the measurement
(for longtail, the engine's), then one JSON line with s_per_step, sample_s, score_s,
update_s, compile_s, layers_scanned, floor_s, x_floor, xla_sample_s and xla_update_s
(the fixed workload's sampling and update as bare jitted programs of the same work on
this backend, see benchmarks/floor.py) (and trl_s_per_step, trl_sample_s, speedup_vs_trl; for
longtail the two sides' medians and engine_speedup).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import floor
from benchmarks import host
from cascade import config as cascade_config
from cascade import kinds
from cascade import lock
from cascade import metrics as metrics_lib
from cascade import policies as policies_lib
from cascade.data import readers
from cascade.kinds import base as kinds_base
from cascade.kinds import loop
from models import config as config_lib
from models import transformer
from rl import batch as batch_lib
from rl import buckets
from rl import engine_options
from rl import grpo
from rl import sampler as sampler_lib
from rl import train_step as train_lib

try:                                    # the step's parts (absent from trees older than it)
  from foundation import step_clock
except ImportError:
  step_clock = None

_LAYERS = flags.DEFINE_integer('layers', 2, 'Transformer blocks.')
_EMBED = flags.DEFINE_integer('embed', 192, 'Residual width.')
_HEADS = flags.DEFINE_integer('heads', 6, 'Query heads.')
_HEAD_DIM = flags.DEFINE_integer('head_dim', 32, 'Per-head width.')
_KV_HEADS = flags.DEFINE_integer('kv_heads', 6, 'Key/value heads.')
_MLP = flags.DEFINE_integer('mlp', 768, 'MLP hidden width.')
_VOCAB = flags.DEFINE_integer('vocab', 256, 'Vocabulary size.')
_PROMPTS = flags.DEFINE_integer('prompts', 4, 'Prompts per step.')
_G = flags.DEFINE_integer('group_size', 8, 'Samples per prompt.')
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 16, 'Tokens per prompt.')
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 64, 'Tokens generated per completion.')
_LR = flags.DEFINE_float('lr', 1e-5, 'AdamW learning rate (both sides).')
_TARGET = flags.DEFINE_integer('target_token', 7, 'Reward = fraction of completion tokens equal to it.')
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps per side (after one warm-up step).')
_COMPARE_TRL = flags.DEFINE_bool('compare_trl', False,
                                 "Also time TRL's GRPOTrainer (torch CPU, 2 threads).")
_SEED = flags.DEFINE_integer('seed', 0, 'Weights and prompts seed.')
_WORKLOAD = flags.DEFINE_enum('workload', 'fixed', ['fixed', 'longtail'],
                              'fixed: every completion --new_tokens; longtail: per-row lengths.')
_CHUNK_ROWS = flags.DEFINE_integer('chunk_rows', 32, 'Longtail: one-call rows per chunk.')
_PACK_TOKENS = flags.DEFINE_integer('pack_tokens', 0,
                                    'Longtail: tokens per packed update row (0: prompt + max '
                                    'response, one padded row\'s width).')


_STEP = flags.DEFINE_enum(
    'step', 'loop', ['loop', 'direct'],
    "Fixed workload: 'loop' runs the step as a GRPO stage does (cascade.kinds.loop.train_stage "
    "with its divergence check, metrics log behind the workdir lock's check, checkpoint cadence "
    "and preemption check, in a temporary workdir); 'direct' calls the sampler, the reward and "
    "the train step one after another (--compare_trl uses it).")
_CKPT_EVERY = flags.DEFINE_integer('ckpt_every', 0, "--step=loop: config.ckpt.every_n_steps "
                                   '(0: the stage checkpoints at its end only).')
_DOC = flags.DEFINE_string('doc', None, 'With --pair_with: write the page (markdown) here.')
_PAIR_WITH = flags.DEFINE_string(
    'pair_with', None, 'An older commit of this repository (or a checkout of one): run this '
    "benchmark (--step=loop, this file's code) on its tree and on this one alternately, "
    '--pairs times each, and compare.')
_PAIRS = flags.DEFINE_integer('pairs', 3, 'With --pair_with: runs per tree.')

_SCAN_LAYERS = flags.DEFINE_enum('scan_layers', 'auto', ['auto', 'true', 'false'],
                                 "Our model's ModelConfig.scan_layers ('auto': a Python loop "
                                 'over the blocks on CPU, a scan elsewhere).')

GRPO_LOSS = train_lib.LossSpec(grpo.GrpoConfig, grpo.loss_fn, grpo.normalizers)


def _model_overrides() -> dict:
  """The flags' model shape as overrides of the 'tiny' preset."""
  scan = {'auto': 'auto', 'true': True, 'false': False}[_SCAN_LAYERS.value]
  return dict(num_layers=_LAYERS.value, embed_dim=_EMBED.value, num_heads=_HEADS.value,
              head_dim=_HEAD_DIM.value, num_kv_heads=_KV_HEADS.value, mlp_dim=_MLP.value,
              vocab_size=_VOCAB.value, scan_layers=scan)


def _model_config() -> config_lib.ModelConfig:
  return config_lib.ModelConfig.tiny(**_model_overrides())


def reward(tokens: np.ndarray, mask: np.ndarray, target: int) -> np.ndarray:
  """Fraction of each row's completion tokens equal to `target`: [B, N] -> [B]."""
  return ((tokens == target) & (mask > 0)).sum(1) / np.maximum(mask.sum(1), 1)


class _Ours:
  """One cascade GRPO step: rl.sampler -> host reward -> advantages -> rl.train_step."""

  def __init__(self, cfg, model, prompts):
    self.graphdef, params = nnx.split(model)
    # The prompt bucket is the prompt length, as configs set it: the prefill and the update's
    # rows carry no padding.
    self.sampler = sampler_lib.Sampler(self.graphdef, cfg, eos_ids=(), pad_id=0,
                                       prompt_buckets=(_PROMPT_LEN.value,))
    self.sp = sampler_lib.SamplingParams(temperature=1.0, max_new_tokens=_NEW_TOKENS.value)
    opt_cfg = train_lib.OptimizerConfig(lr=_LR.value, clip_norm=1.0)
    opt = train_lib.make_optimizer(opt_cfg)
    self.state = train_lib.init_state(jax.tree.map(jnp.copy, params), opt, seed=_SEED.value)
    self.step = train_lib.make_train_step(self.graphdef, GRPO_LOSS, grpo.GrpoConfig(), opt)
    self.prompts = prompts
    self.calls = 0

  def __call__(self) -> dict:
    t0 = time.perf_counter()
    key = jax.random.fold_in(jax.random.key(_SEED.value), self.calls)
    out = self.sampler.generate(self.state.params, self.prompts, key, self.sp,
                                num_samples=_G.value)
    t1 = time.perf_counter()
    rewards = reward(out.tokens, out.mask, _TARGET.value)
    t2 = time.perf_counter()
    batch = batch_lib.from_samples(out, grpo.advantages(rewards, _G.value))
    self.state, metrics = self.step(self.state, batch)
    loss = float(metrics['loss'])                   # waits for the update
    t3 = time.perf_counter()
    self.calls += 1
    assert np.all(out.lengths == _NEW_TOKENS.value) and np.isfinite(loss)
    return dict(step=t3 - t0, sample=t1 - t0, score=t2 - t1, update=t3 - t2,
                reward=float(rewards.mean()))


_LOOP_RECORDS = 4096


def _loop_plan(workdir: str, steps: int):
  """A validated one-stage GRPO plan of the fixed workload (the benchmark's model shape,
  prompts x G x new tokens, its optimizer); its dataset is never read."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  del workdir
  c = ml_collections.ConfigDict()
  c.seed = _SEED.value
  c.model = dict(preset='tiny', overrides=_model_overrides())
  c.tokenizer = dict(path='/nonexistent/tok.model')
  c.mesh = dict(shape=None)
  c.sampler = dict()
  c.ckpt = dict(every_n_steps=_CKPT_EVERY.value, keep=2)
  c.eval = dict(num_samples=1, temperature=1.0, top_p=1.0, max_new_tokens=8, max_prompt_len=64,
                num_prompts=0, batch_size=8)
  c.datasets = dict(prompts=dict(path='/nonexistent/prompts.jsonl', format='prompt',
                                 domain='bench'))
  c.domains = dict(bench=dict(verifier='math', train='prompts', eval='prompts'))
  c.stages = [dict(name='grpo', kind='grpo', domains=['bench'], steps=steps,
                   optimizer=dict(lr=_LR.value, clip_norm=1.0),
                   prompts_per_step=_PROMPTS.value, group_size=_G.value,
                   max_prompt_len=_PROMPT_LEN.value, max_response_len=_NEW_TOKENS.value,
                   temperature=1.0, dynamic_filter=False)]
  return cascade_config.validate(c, known_verifiers=['math'], known_formats={'prompt': 'prompt'})


def _clock_kw(clock) -> dict:
  """`clock=` for the sampler, where this tree's sampler takes one."""
  return {} if clock is None else dict(clock=clock)


class _Bare:
  """The fixed workload's sampling and update as bare jitted programs (`benchmarks.floor`),
  each run once per call and timed, compiled first."""

  def __init__(self, cfg):
    rows, width = _PROMPTS.value * _G.value, _PROMPT_LEN.value + _NEW_TOKENS.value
    self.fns = dict(sample=floor.xla_decode_loop_fn(cfg, rows, _PROMPT_LEN.value,
                                                    _NEW_TOKENS.value),
                    update=floor.xla_update_fn(cfg, rows, width))
    self.times = {k: [] for k in self.fns}
    for fn in self.fns.values():
      jax.block_until_ready(fn())

  def __call__(self) -> None:
    for name, fn in self.fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      self.times[name].append(time.perf_counter() - t)


def loop_side(cfg, prompts) -> dict:
  """The fixed workload's GRPO step through the stage loop (`cascade.kinds.loop.train_stage`)
  in a temporary workdir: one warm-up step, then --steps timed ones, each followed by the bare
  programs of the same work (run from the loop's step-end hook, outside the step's time).

  A step is timed from the end of the previous one's hook to the start of its own: everything
  the loop does for it (batch, update, divergence check, metrics log, checkpoint when due,
  preemption check). Where this tree has `foundation.step_clock`, the loop's clock also splits
  it into program and host time by part.
  """
  workdir = tempfile.mkdtemp(prefix='grpo_bench_loop_')
  plan = _loop_plan(workdir, _STEPS.value + 1)
  stage = plan.stages[0]
  clock = step_clock.StepClock() if step_clock is not None else None
  held = lock.take(workdir)
  writer = metrics_lib.Writer(workdir, plan=plan, before_write=held.check)
  ctx = types.SimpleNamespace(
      plan=plan, workdir=workdir, mesh=None, rules=plan.rules, writer=writer,
      policies=policies_lib.Policies(plan, workdir, None, plan.rules),
      data=types.SimpleNamespace(validation_sets={}), clock=clock)
  graphdef = ctx.policies.graphdef('policy')
  sampler = sampler_lib.Sampler(graphdef, cfg, eos_ids=(), pad_id=0,
                                prompt_buckets=(_PROMPT_LEN.value,))
  sp = sampler_lib.SamplingParams(temperature=1.0, max_new_tokens=_NEW_TOKENS.value)
  # The prompts repeated into a data set of a real stage's size: grain's shuffle of a few records
  # costs milliseconds per record (its index shuffle walks a far larger domain), of thousands
  # microseconds. Every step draws prompts_per_step of them: the same work as the fixed prompts.
  records = [{'prompt_ids': p} for p in prompts] * max(1, _LOOP_RECORDS // len(prompts))

  def maker_fn(state):
    del state
    loader = readers.Loader(records, kinds_base.stage_seed(plan.seed, stage.seeds_from),
                            stage.prompts_per_step)

    def make(step, rng, state):
      del step
      ids = [r['prompt_ids'] for r in loader.next()]
      out = sampler.generate(state.params, ids, rng, sp, num_samples=_G.value,
                             **_clock_kw(clock))
      part = clock.part if clock is not None else (lambda name: contextlib.nullcontext())
      with part('reward'):
        rewards = reward(out.tokens, out.mask, _TARGET.value)
      with part('advantages + train batch'):
        batch = batch_lib.from_samples(out, grpo.advantages(rewards, _G.value))
      assert np.all(out.lengths == _NEW_TOKENS.value)
      return [batch], {'reward_mean': float(rewards.mean())}
    return loop.BatchMaker(loader, make)

  bare = _Bare(cfg)
  ends, starts = [], [time.perf_counter()]

  def between_steps(stage_name, step, saved, ckpts):
    del stage_name, step, saved, ckpts
    ends.append(time.perf_counter())
    bare()
    starts.append(time.perf_counter())

  loop.STEP_END_HOOKS.append(between_steps)
  try:
    loop.train_stage(ctx, kinds.get('grpo'), stage, maker_fn)
  finally:
    loop.STEP_END_HOOKS.remove(between_steps)
    ctx.policies.close()
    writer.close()
    held.release()
  steps = [e - s for s, e in zip(starts, ends)][1:]          # after the warm-up step
  bare_times = {k: v[1:] for k, v in bare.times.items()}
  med = statistics.median
  result = dict(step='loop', s_per_step=med(steps), steps=len(steps),
                bare_sample_s=med(bare_times['sample']), bare_update_s=med(bare_times['update']),
                first_step_s=ends[0] - starts[0])
  result['bare_s'] = result['bare_sample_s'] + result['bare_update_s']
  result['x_bare'] = result['s_per_step'] / result['bare_s']
  # Each step over the bare programs that ran right after it: load shifts cancel pairwise.
  result['x_bare_paired'] = med(s / (a + b) for s, a, b in zip(steps, bare_times['sample'],
                                                                bare_times['update']))
  if clock is not None:
    timed = clock.history[1:]
    for k in ('host_s', 'program_s'):
      result[k] = med(h[k] for h in timed)
    parts = sorted({k for h in timed for k in h} - {'step_s', 'program_s', 'host_s'})
    result['parts_s'] = {k: statistics.mean(h.get(k, 0.0) for h in timed) for k in parts}
    result['parts_steps'] = {k: sum(k in h for h in timed) for k in parts}
    result['program_parts'] = sorted(clock.program_parts)
  return result



class _TRL:
  """TRL's GRPOTrainer on the same weights, prompts, G, reward and optimizer settings."""

  def __init__(self, model, prompts, workdir, between_steps):
    import datasets                                 # only with --compare_trl
    import tokenizers
    import torch
    import transformers
    import trl
    from models import hf
    torch.set_num_threads(2)
    torch.manual_seed(_SEED.value)
    hf.save_model(model, f'{workdir}/model')
    # Word-level: token id i is the word 't{i}'; ids 0..2 are pad / eos / unk.
    vocab = {f't{i}': i for i in range(3, _VOCAB.value)}
    vocab.update({'<pad>': 0, '<eos>': 1, '<unk>': 2})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='<unk>'))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    self.tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token='<pad>', eos_token='<eos>', unk_token='<unk>')
    text = [' '.join(f't{i}' for i in p) for p in prompts]
    assert [self.tokenizer(t, add_special_tokens=False)['input_ids'] for t in text] == prompts
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        f'{workdir}/model', dtype=torch.float32)
    with torch.no_grad():
      theirs = self.model(torch.tensor(prompts)).logits.numpy()
    ours = np.asarray(model(jnp.asarray(prompts, jnp.int32)))
    self.logits_max_abs_diff = float(np.max(np.abs(theirs - ours)))
    if self.logits_max_abs_diff > 1e-3:
      raise RuntimeError(f'TRL model logits differ from ours by {self.logits_max_abs_diff}')

    steps = _STEPS.value + 1
    n = _PROMPTS.value
    # Each step draws the same n prompts (no shuffling), each G times.
    data = datasets.Dataset.from_dict({'prompt': text * steps})
    args = trl.GRPOConfig(
        output_dir=f'{workdir}/trl', use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, beta=0.0, loss_type='dapo', scale_rewards='group',
        num_generations=_G.value, per_device_train_batch_size=n * _G.value,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=_NEW_TOKENS.value, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={'min_new_tokens': _NEW_TOKENS.value},
        learning_rate=_LR.value, lr_scheduler_type='constant', warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_steps=steps, logging_steps=10 ** 6, save_strategy='no',
        report_to='none', shuffle_dataset=False, dataloader_num_workers=0,
        seed=_SEED.value, use_vllm=False, disable_tqdm=True)

    def reward_fn(prompts, completions, completion_ids, **kw):
      del prompts, kw
      return [sum(x == _TARGET.value for x in ids) / max(len(ids), 1) for ids in completion_ids]

    self.times, self.sample_times = [], []
    outer = self

    class _Clock(transformers.TrainerCallback):
      def on_step_begin(self, *a, **kw):
        outer._t = time.perf_counter()
        outer._gen = 0.0

      def on_step_end(self, *a, **kw):
        outer.times.append(time.perf_counter() - outer._t)
        outer.sample_times.append(outer._gen)
        between_steps()                             # one of our steps, interleaved

    self.trainer = trl.GRPOTrainer(model=self.model, reward_funcs=reward_fn, args=args,
                                   train_dataset=data, processing_class=self.tokenizer,
                                   callbacks=[_Clock()])
    generate = self.model.generate

    def timed_generate(*a, **kw):
      t = time.perf_counter()
      out = generate(*a, **kw)
      outer._gen += time.perf_counter() - t
      return out

    self.model.generate = timed_generate

  def run(self):
    self.trainer.train()


class _Longtail:
  """One GRPO step on the long-tail workload, padded (one-call sampler) or packed (engine)."""

  def __init__(self, cfg, model, prompts, limits, engine: bool):
    self.graphdef, params = nnx.split(model)
    pb = buckets.smallest_fit(engine_options.DEFAULT_PROMPT_BUCKETS, _PROMPT_LEN.value, 'prompt')
    nb = buckets.smallest_fit(engine_options.DEFAULT_NEW_TOKEN_BUCKETS, _NEW_TOKENS.value,
                              'new tokens')
    budget = _CHUNK_ROWS.value * (pb + nb)          # KV token slots, the same on both sides
    kw = (dict(engine='paged', slots=2 * _CHUNK_ROWS.value, pages=budget // 16) if engine
          else dict(cache_tokens_per_device=budget))
    self.sampler = sampler_lib.Sampler(self.graphdef, cfg, eos_ids=(), pad_id=0, **kw)
    self.sp = sampler_lib.SamplingParams(temperature=1.0, max_new_tokens=_NEW_TOKENS.value)
    opt = train_lib.make_optimizer(train_lib.OptimizerConfig(lr=_LR.value, clip_norm=1.0))
    self.state = train_lib.init_state(jax.tree.map(jnp.copy, params), opt, seed=_SEED.value)
    self.step = train_lib.make_train_step(self.graphdef, GRPO_LOSS, grpo.GrpoConfig(), opt)
    self.prompts, self.limits, self.engine = prompts, limits, engine
    self.pack_tokens = _PACK_TOKENS.value or _PROMPT_LEN.value + _NEW_TOKENS.value
    self.calls = 0

  def __call__(self) -> dict:
    t0 = time.perf_counter()
    key = jax.random.fold_in(jax.random.key(_SEED.value), self.calls)
    out = self.sampler.generate(self.state.params, self.prompts, key, self.sp,
                                num_samples=_G.value, row_limits=self.limits)
    t1 = time.perf_counter()
    rewards = reward(out.tokens, out.mask, _TARGET.value)
    batch = batch_lib.from_samples(out, grpo.advantages(rewards, _G.value))
    if self.engine:
      batch = batch_lib.pack(batch, self.pack_tokens)
    t2 = time.perf_counter()
    self.state, metrics = self.step(self.state, batch)
    loss = float(metrics['loss'])
    t3 = time.perf_counter()
    self.calls += 1
    assert np.array_equal(out.lengths, self.limits) and np.isfinite(loss)
    return dict(step=t3 - t0, sample=t1 - t0, score=t2 - t1, update=t3 - t2,
                slots=int(np.asarray(batch.tokens).size), loss=loss)


def longtail(cfg, model, prompts):
  """Padded one-call steps against engine + packed steps, alternating; prints a table + JSON."""
  load_before = os.getloadavg()
  rows = len(prompts) * _G.value
  limits = floor.longtail_limits(rows, _NEW_TOKENS.value, _SEED.value)
  sides = {'padded (one-call sampler)': _Longtail(cfg, model, prompts, limits, False),
           'engine + packed update': _Longtail(cfg, model, prompts, limits, True)}
  firsts = {name: side() for name, side in sides.items()}     # compiles
  runs = {name: [] for name in sides}
  for _ in range(_STEPS.value):
    for name, side in sides.items():
      runs[name].append(side())
  print(f'\nlong-tail: {rows} rows, target lengths median {int(np.median(limits))}, mean '
        f'{limits.mean():.0f}, cap {_NEW_TOKENS.value}; {int(limits.sum())} generated tokens')
  print(f'{"":<28} {"s/step":>8} {"sample s":>9} {"update s":>9} {"update slots":>13}')
  result = dict(workload='longtail', rows=rows, cap=_NEW_TOKENS.value,
                generated_tokens=int(limits.sum()), steps=_STEPS.value, sides={})
  for name, rs in runs.items():
    med = {k: statistics.median(r[k] for r in rs) for k in ('step', 'sample', 'update')}
    print(f'{name:<28} {med["step"]:8.3f} {med["sample"]:9.3f} {med["update"]:9.3f} '
          f'{rs[-1]["slots"]:>13}')
    result['sides'][name] = dict(s_per_step=med['step'], sample_s=med['sample'],
                                 update_s=med['update'], update_token_slots=rs[-1]['slots'],
                                 first_step_s=firsts[name]['step'])
  a, b = (result['sides'][n] for n in sides)
  result['engine_speedup'] = a['s_per_step'] / b['s_per_step']
  result['update_speedup'] = a['update_s'] / b['update_s']
  print(f'engine + packed vs padded: {result["engine_speedup"]:.2f}x per step '
        f'(update {result["update_speedup"]:.2f}x)')
  result.update(_step_floor(cfg, rows, [_PROMPT_LEN.value] * rows, list(limits),
                            b['s_per_step']))
  host.print_load_warning(load_before)
  print(json.dumps(result))


def main(argv):
  del argv
  if _PAIR_WITH.value:
    return pairs(_PAIR_WITH.value)
  load_before = os.getloadavg()
  cfg = _model_config()
  model = transformer.create(cfg, seed=_SEED.value)
  rng = np.random.default_rng(_SEED.value)
  # Prompt ids avoid 0..2 (pad / eos / unk of the TRL tokenizer).
  prompts = rng.integers(3, cfg.vocab_size, (_PROMPTS.value, _PROMPT_LEN.value)).tolist()
  print(f'model: {cfg.num_layers} layers, embed {cfg.embed_dim}, {cfg.num_heads}x{cfg.head_dim} '
        f'heads ({cfg.num_kv_heads} kv), mlp {cfg.mlp_dim}, vocab {cfg.vocab_size}, '
        f'{cfg.num_params() / 1e6:.2f}M params | {_PROMPTS.value} prompts x {_G.value} samples '
        f'x {_NEW_TOKENS.value} new tokens, prompt {_PROMPT_LEN.value}, layers '
        f'{"scanned" if cfg.scans_layers else "looped"} | jax {jax.__version__} '
        f'on {jax.devices()[0].platform}')

  if _WORKLOAD.value == 'longtail':
    return longtail(cfg, model, prompts)
  if _STEP.value == 'loop' and not _COMPARE_TRL.value:
    return loop_main(cfg, prompts, load_before)
  ours = _Ours(cfg, model, prompts)
  first = ours()                                    # compiles the sampler and the step
  runs = []
  trl_runner = None
  if _COMPARE_TRL.value:
    trl_runner = _TRL(model, prompts, tempfile.mkdtemp(prefix='grpo_bench_trl_'),
                      lambda: runs.append(ours()))
    trl_runner.run()                                # warm-up step + _STEPS steps, ours in between
    runs = runs[1:]                                 # the one after TRL's warm-up step
  else:
    runs = [ours() for _ in range(_STEPS.value)]

  med = lambda key, rs: statistics.median(r[key] for r in rs)
  s_step = med('step', runs)
  result = dict(s_per_step=s_step, sample_s=med('sample', runs), score_s=med('score', runs),
                update_s=med('update', runs), compile_s=max(first['step'] - s_step, 0.0),
                prompts=_PROMPTS.value, group_size=_G.value, new_tokens=_NEW_TOKENS.value,
                steps=len(runs), reward=runs[-1]['reward'], layers_scanned=cfg.scans_layers)
  print(f'\n{"":<26} {"s/step":>8} {"sample s":>9} {"score s":>8} {"update s":>9}')
  print(f'{"cascade (jax)":<26} {s_step:8.3f} {result["sample_s"]:9.3f} '
        f'{result["score_s"]:8.4f} {result["update_s"]:9.3f}')
  if trl_runner is not None:
    trl_times = trl_runner.times[1:]
    trl_gen = trl_runner.sample_times[1:]
    result.update(trl_s_per_step=statistics.median(trl_times),
                  trl_sample_s=statistics.median(trl_gen),
                  speedup_vs_trl=statistics.median(trl_times) / s_step,
                  logits_max_abs_diff=trl_runner.logits_max_abs_diff)
    print(f'{"trl GRPOTrainer (torch)":<26} {result["trl_s_per_step"]:8.3f} '
          f'{result["trl_sample_s"]:9.3f} {"":>8} '
          f'{result["trl_s_per_step"] - result["trl_sample_s"]:9.3f}  (update = step - generate)')
    print(f'speedup vs TRL: {result["speedup_vs_trl"]:.2f}x (medians of {len(trl_times)} steps); '
          f'prompt logits max |diff| {trl_runner.logits_max_abs_diff:.2e}')
  print(f'first step (compile + run): {first["step"]:.2f} s')
  rows, width = _PROMPTS.value * _G.value, _PROMPT_LEN.value + _NEW_TOKENS.value
  result.update(_step_floor(cfg, rows, [_PROMPT_LEN.value] * rows, [_NEW_TOKENS.value] * rows,
                            s_step))
  # What this backend reaches for the same work with nothing else: the sampling as a bare
  # decode loop, the update as a bare forward + backward of the same matmuls.
  bare_sample = floor.xla_decode_loop(cfg, rows, _PROMPT_LEN.value, _NEW_TOKENS.value,
                                      repeats=_STEPS.value)
  bare_update = floor.xla_update(cfg, rows, width, repeats=_STEPS.value)
  print(f'this backend\'s bare programs of the same work: sampling {bare_sample * 1e3:.1f} ms '
        f'({bare_sample / result["floor_sample_s"]:.1f}x its floor), update '
        f'{bare_update * 1e3:.1f} ms ({bare_update / result["floor_update_s"]:.1f}x its floor, '
        f'without attention or the optimizer)')
  result.update(xla_sample_s=bare_sample, xla_update_s=bare_update)
  host.print_load_warning(load_before)
  print(json.dumps(result))


def loop_main(cfg, prompts, load_before) -> None:
  """--step=loop: prints the step through the stage loop beside its bare programs, its host
  time by part, its floor, and the JSON line."""
  result = loop_side(cfg, prompts)
  result.update(prompts=_PROMPTS.value, group_size=_G.value, new_tokens=_NEW_TOKENS.value,
                layers_scanned=cfg.scans_layers, xla_sample_s=result['bare_sample_s'],
                xla_update_s=result['bare_update_s'])
  print(f'\n{"":<30} {"s/step":>8} {"program s":>10} {"host s":>8} {"bare s":>8} '
        f'{"x bare":>7}')
  print(f'{"cascade GRPO step (stage loop)":<30} {result["s_per_step"]:8.3f} '
        f'{result.get("program_s", float("nan")):10.3f} {result.get("host_s", float("nan")):8.4f} '
        f'{result["bare_s"]:8.3f} {result["x_bare"]:7.2f}')
  print(f'x bare per step, each beside the bare programs run right after it (median): '
        f'{result["x_bare_paired"]:.2f}')
  if 'parts_s' in result:
    host_parts = {k: v for k, v in result['parts_s'].items() if k not in result['program_parts']}
    print('host time by part (ms per step, mean): ' + ', '.join(
        f'{k} {v * 1e3:.2f}' for k, v in sorted(host_parts.items(), key=lambda kv: -kv[1])))
    print('program time by part (ms per step, mean): ' + ', '.join(
        f'{k} {result["parts_s"][k] * 1e3:.1f}' for k in result['program_parts']))
  print(f'first step (compile + run): {result["first_step_s"]:.2f} s')
  rows = _PROMPTS.value * _G.value
  result.update(_step_floor(cfg, rows, [_PROMPT_LEN.value] * rows, [_NEW_TOKENS.value] * rows,
                            result['s_per_step']))
  print(f'this backend\'s bare programs of the same work, run between the steps: sampling '
        f'{result["bare_sample_s"] * 1e3:.1f} ms ({result["bare_sample_s"] / result["floor_sample_s"]:.1f}x '
        f'its floor), update {result["bare_update_s"] * 1e3:.1f} ms '
        f'({result["bare_update_s"] / result["floor_update_s"]:.1f}x its floor, without attention '
        'or the optimizer)')
  host.print_load_warning(load_before)
  print(json.dumps(result))


def _run_tree(tree: str, overlay: str | None) -> dict:
  """One `--step=loop` run of this file's code on `tree` (its library; `overlay` holds this
  tree's benchmarks package, put first on the path for an older tree): its JSON line."""
  path = [overlay, tree] if overlay else [tree]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
  args = [sys.executable, '-m', 'benchmarks.grpo_step', '--step=loop',
          f'--steps={_STEPS.value}', f'--ckpt_every={_CKPT_EVERY.value}',
          f'--prompts={_PROMPTS.value}', f'--group_size={_G.value}',
          f'--new_tokens={_NEW_TOKENS.value}', f'--prompt_len={_PROMPT_LEN.value}',
          f'--seed={_SEED.value}', f'--scan_layers={_SCAN_LAYERS.value}']
  # `python -m` puts the working directory first on the path: the overlay's, for an older tree.
  done = subprocess.run(args, cwd=overlay or tree, env=env, capture_output=True, text=True,
                        check=False)
  if done.returncode:
    raise RuntimeError(f'{tree}: benchmark run failed ({done.returncode}):\n'
                       f'{done.stderr[-3000:]}')
  return json.loads(done.stdout.strip().splitlines()[-1])


def _commit(tree: str) -> str:
  return subprocess.run(['git', '-C', tree, 'rev-parse', '--short', 'HEAD'], capture_output=True,
                        text=True, check=False).stdout.strip() or '?'


def _old_tree(old: str, new_tree: str) -> str:
  """`old` itself when it is a directory, else the tree of commit `old` of `new_tree`'s
  repository, extracted into a temporary directory (`git archive`)."""
  if os.path.isdir(old):
    return old
  out = tempfile.mkdtemp(prefix=f'grpo_bench_{old}_')
  archive = subprocess.run(['git', '-C', new_tree, 'archive', old], capture_output=True,
                           check=False)
  if archive.returncode:
    raise SystemExit(f'--pair_with={old}: neither a directory nor a commit of {new_tree} '
                     f'({archive.stderr.decode().strip()})')
  subprocess.run(['tar', '-x', '-C', out], input=archive.stdout, check=True)
  return out


def pairs(old: str) -> None:
  """--pair_with: this benchmark's --step=loop on the older tree `old` and on this tree,
  alternately (old, new, new, old, old, new, ...), --pairs runs each; prints and (--doc)
  writes the page."""
  new_tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  old_tree = _old_tree(old, new_tree)
  overlay = tempfile.mkdtemp(prefix='grpo_bench_overlay_')
  os.makedirs(f'{overlay}/benchmarks')
  for name in ('__init__.py', 'grpo_step.py', 'floor.py', 'host.py'):
    with open(f'{new_tree}/benchmarks/{name}', encoding='utf-8') as f, open(
        f'{overlay}/benchmarks/{name}', 'w', encoding='utf-8') as g:
      g.write(f.read())
  uptimes = [_uptime()]
  load_before = os.getloadavg()
  runs = {'old': [], 'new': []}
  for i in range(_PAIRS.value):
    for side in (('old', 'new') if i % 2 == 0 else ('new', 'old')):
      r = (_run_tree(old_tree, overlay) if side == 'old' else _run_tree(new_tree, None))
      runs[side].append(r)
      print(f'pair {i + 1} {side}: {r["s_per_step"] * 1e3:.1f} ms/step, bare '
            f'{r["bare_s"] * 1e3:.1f} ms, x bare {r["x_bare_paired"]:.2f}'
            + (f', host {r["host_s"] * 1e3:.1f} ms' if 'host_s' in r else ''), flush=True)
      uptimes.append(_uptime())
  med = statistics.median
  summary = {side: dict(s_per_step=med(r['s_per_step'] for r in rs),
                        x_bare=med(r['x_bare_paired'] for r in rs),
                        host_s=med(r['host_s'] for r in rs) if 'host_s' in rs[0] else None)
             for side, rs in runs.items()}
  summary['new_over_old'] = med(n['s_per_step'] / o['s_per_step']
                                for n, o in zip(runs['new'], runs['old']))
  summary.update(commits=dict(old=old if old_tree != old else _commit(old_tree),
                              new=_commit(new_tree)),
                 uptimes=uptimes, runs=runs)
  print(f'medians: old {summary["old"]["s_per_step"] * 1e3:.1f} ms/step (x bare '
        f'{summary["old"]["x_bare"]:.2f}), new {summary["new"]["s_per_step"] * 1e3:.1f} ms/step '
        f'(x bare {summary["new"]["x_bare"]:.2f}); new / old per pair {summary["new_over_old"]:.3f}')
  if _DOC.value:
    with open(_DOC.value, 'w', encoding='utf-8') as f:
      f.write(page(summary))
    print(f'wrote {_DOC.value}')
  host.print_load_warning(load_before)
  print(json.dumps({k: v for k, v in summary.items() if k != 'runs'}))


def _uptime() -> str:
  return subprocess.run(['uptime'], capture_output=True, text=True, check=False).stdout.strip()


def page(summary: dict) -> str:
  """The markdown page of a --pair_with run."""
  new = summary['runs']['new']
  lines = [
      '# The GRPO step: stage loop against its bare programs, old and new code',
      '',
      f'Written by `benchmarks/grpo_step.py` on {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}: '
      f'`{" ".join(["python -m benchmarks.grpo_step"] + sys.argv[1:])}` on {os.cpu_count()} '
      f'cores of {host.cpu_name()}, jax {jax.__version__} on {jax.devices()[0].platform}, at '
      f'nice {os.nice(0)} (the runs inherit it).',
      '',
      f'- old tree: commit {summary["commits"]["old"]}; new tree: commit '
      f'{summary["commits"]["new"]} (this file\'s code drives both; the old tree\'s library)',
      f'- workload: the tiny shape ({_LAYERS.value} layers, embed {_EMBED.value}), '
      f'{_PROMPTS.value} prompts x {_G.value} samples x {_NEW_TOKENS.value} new tokens, prompt '
      f'{_PROMPT_LEN.value}; the step as a GRPO stage runs it (`cascade.kinds.loop.train_stage`: '
      'sampling, reward, advantages, the update, the divergence check, the metrics log behind the '
      'workdir lock\'s check, the preemption check; checkpoints '
      + (f'every {_CKPT_EVERY.value} steps' if _CKPT_EVERY.value else 'at the stage end only')
      + f'), {_STEPS.value} timed steps per run after one warm-up step',
      '- bare programs: the same sampling and update as bare jitted programs '
      '(`benchmarks/floor.py`: no norms, RoPE or sampling; the update without attention or the '
      'optimizer), run right after each step; x bare = step / (bare sampling + bare update), '
      'the median over steps of each step against the bare programs beside it',
      '- runs alternate old, new, new, old, ... so load from other work hits both alike; the '
      'load average (uptime) before the first run and after each:',
      '',
  ]
  lines += [f'  - `{u}`' for u in summary['uptimes']]
  lines += ['', '| run | tree | ms/step | bare ms | x bare | host ms/step |',
            '|---|---|---|---|---|---|']
  for i in range(_PAIRS.value):
    for side in ('old', 'new'):
      r = summary['runs'][side][i]
      host_ms = f'{r["host_s"] * 1e3:.2f}' if 'host_s' in r else 'not split (no step clock)'
      lines.append(f'| {i + 1} | {side} | {r["s_per_step"] * 1e3:.1f} | {r["bare_s"] * 1e3:.1f} '
                   f'| {r["x_bare_paired"]:.2f} | {host_ms} |')
  o, n = summary['old'], summary['new']
  lines += ['', f'Medians: old {o["s_per_step"] * 1e3:.1f} ms/step, x bare {o["x_bare"]:.2f}; '
            f'new {n["s_per_step"] * 1e3:.1f} ms/step, x bare {n["x_bare"]:.2f}, host time '
            f'{n["host_s"] * 1e3:.2f} ms/step; new / old, run by run: '
            f'{summary["new_over_old"]:.3f}. The target, x bare <= 1.25 for the new step: '
            f'{"met" if n["x_bare"] <= 1.25 else "not met"}.', '',
            '## Host time of the new step, by part', '',
            'Host time is the step\'s wall time outside its jitted programs (their dispatch and '
            'the wait for their results: `foundation.step_clock`); mean ms per step over the '
            'new runs\' timed steps, and in how many of them the part ran (the checkpoint: '
            'the stage\'s final one, on its last step; the metrics log flushes TensorBoard\'s '
            'events every 30 s):', '', '| part | ms/step (mean) | steps with it |',
            '|---|---|---|']
  parts, seen = {}, {}
  for r in new:
    for k, v in r['parts_s'].items():
      parts[k] = parts.get(k, 0.0) + v / len(new)
      seen[k] = seen.get(k, 0) + r.get('parts_steps', {}).get(k, r['steps'])
  total = sum(r['steps'] for r in new)
  programs = set(new[0]['program_parts'])
  for k, v in sorted(parts.items(), key=lambda kv: (kv[0] in programs, -kv[1])):
    lines.append(f'| {k}{" (program)" if k in programs else ""} | {v * 1e3:.2f} | '
                 f'{seen[k]} of {total} |')
  mean = lambda key: statistics.mean(r[key] for r in new)
  step, host_ms = mean('s_per_step'), mean('host_s')
  lines += ['', f'Host time is {100 * host_ms / step:.2f} % of the new step. Its programs '
            'against the bare programs of the same work (means over the new runs, ms per step):',
            '', '| program | ms/step | bare ms | x bare |', '|---|---|---|---|']
  for part, bare_key in (('sampling', 'bare_sample_s'), ('update', 'bare_update_s')):
    if part in parts:
      lines.append(f'| {part} | {parts[part] * 1e3:.1f} | {mean(bare_key) * 1e3:.1f} | '
                   f'{parts[part] / mean(bare_key):.2f} |')
  return '\n'.join(lines) + '\n'


def _step_floor(cfg, rows: int, prompt_lens, new_lens, measured: float) -> dict:
  """Prints and returns the step's floor: sampling (floor.generation_floor per row, FLOPs at the
  measured matmul rate; bytes at the measured bandwidth for the batched decode) + the update's
  FLOPs over the real tokens."""
  flops_rate, bandwidth = floor.measure_machine(
      [(rows, cfg.embed_dim, cfg.mlp_dim), (rows, cfg.mlp_dim, cfg.embed_dim),
       (rows, cfg.embed_dim, cfg.vocab_size)])
  sample_flops = sum(floor.generation_floor(cfg, 1, p, n, flops_rate, bandwidth)['flops']
                     for p, n in zip(prompt_lens, new_lens))
  # A batched decode step reads the weights once for all rows: the longest row's steps.
  weight_s = max(new_lens) * 4 * cfg.num_params() / bandwidth
  sample_s = max(sample_flops / flops_rate, weight_s)
  update = sum(floor.update_flops(cfg, 1, p + n) for p, n in zip(prompt_lens, new_lens))
  update_s = update / flops_rate
  total = sample_s + update_s
  print(f'machine: float32 matmul {flops_rate / 1e9:.1f} GFLOP/s, memory read '
        f'{bandwidth / 1e9:.1f} GB/s; step floor {total * 1e3:.1f} ms (sampling '
        f'{sample_s * 1e3:.1f} ms, update {update_s * 1e3:.1f} ms over the real tokens); '
        f'measured {measured * 1e3:.1f} ms = {measured / total:.1f}x the floor')
  return dict(floor_s=total, floor_sample_s=sample_s, floor_update_s=update_s,
              x_floor=measured / total, matmul_gflops=flops_rate / 1e9,
              mem_gbps=bandwidth / 1e9)


if __name__ == '__main__':
  app.run(main)
