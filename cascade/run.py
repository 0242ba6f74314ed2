"""`run(config, workdir)`: the cascade — every stage in order, checkpoints, resume, the matrix.

  results = cascade.run(config, '/tmp/runs/tiny')

1. Validate the whole config (`cascade.config.validate`) and refuse a workdir
   that holds a different config.
2. Build the mesh, tokenizer, model architecture, sampler, verifiers, and
   load and check every dataset (a malformed record stops the run here, before
   any step).
3. Evaluate the starting policy when the cascade starts with RL (row 'init').
4. For each stage not yet complete in progress.json: run it through
   `cascade.stages.RUNNERS[kind]` (resuming from its newest good checkpoint),
   export its policy as HF safetensors, evaluate every domain (a row of the
   matrix), mark it complete; rewrite results.{json,md,png}.

Policies flow by reference: a stage starts from `init_from` (an earlier
stage's final checkpoint, or an HF directory) or else from the policy the
previous stage left (a reward_model stage leaves the policy unchanged), and
the final checkpoint of every stage is kept, so a rerun of the same command
picks up at the exact stage and step.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from cascade import checkpoint
from cascade import config as config_lib
from cascade import data as data_lib
from cascade import evaluation
from cascade import metrics
from cascade import rollout
from cascade import stages as stages_lib
from models import config as model_config
from models import hf
from models import sharding
from models import tokenizer as tokenizer_lib
from models import transformer
from rl import reward_model
from rl import sampler as sampler_lib
from rl import train_step as train_lib

INIT_ROW = 'init'


class Context:
  """Everything the stage runners share: models, sampler, tokenizer, data, verifiers, workdir."""

  def __init__(self, config, plan: config_lib.Plan, workdir: str):
    import verifiers  # pylint: disable=g-import-not-at-top
    self._verifiers_mod = verifiers
    self.sample_cls = verifiers.Sample
    self.config, self.plan, self.workdir = config, plan, workdir
    self.seed = int(config.seed)
    mesh_cfg = config.mesh.to_dict() if hasattr(config.mesh, 'to_dict') else dict(config.mesh)
    shape = mesh_cfg.get('shape')
    try:
      self.mesh = None if shape is None else sharding.make_mesh(tuple(shape))
    except ValueError as e:
      raise config_lib.ConfigError(f'config.mesh.shape={shape!r}: {e}') from None
    rules = mesh_cfg.get('rules')
    self.rules = tuple((k, v) for k, v in rules) if rules else sharding.DEFAULT_RULES
    self.batch_shards = 1
    if self.mesh is not None:
      spec = sharding.logical_to_spec(('batch',), None, self.mesh, self.rules)[0]
      axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
      self.batch_shards = int(np.prod([self.mesh.shape[a] for a in axes]))
    self.tokenizer = tokenizer_lib.load(config.tokenizer.path)
    self.model_cfg = _model_config(config.model)
    if self.tokenizer.vocab_size > self.model_cfg.vocab_size:
      raise config_lib.ConfigError(f'config.tokenizer: {self.tokenizer.vocab_size} tokens do not '
                                   f"fit the model's vocab_size={self.model_cfg.vocab_size}")
    if self.tokenizer.eos_id is None:
      raise config_lib.ConfigError('config.tokenizer: the tokenizer has no end-of-sequence token')
    self._abstract = {}
    self.sampler = sampler_lib.Sampler(self.graphdef('policy'), self.model_cfg,
                                       eos_ids=[self.tokenizer.eos_id],
                                       pad_id=self.tokenizer.pad_id, mesh=self.mesh,
                                       rules=self.rules, **_as_dict(config.sampler))
    self.domain_index = {d: i for i, d in enumerate(sorted(plan.domains))}
    self.writer = metrics.Writer(workdir)
    self.progress = checkpoint.Progress(workdir)
    self.stage_log: dict[str, dict] = {}
    self._ckpts: dict[str, checkpoint.StageCheckpoints] = {}
    self._verifiers: dict[tuple, Any] = {}
    self._records: dict[str, list] = {}
    self._stage_records: dict[str, list] = {}
    self._params: tuple | None = None     # (source, params): the one policy kept in memory

  # ------------------------------------------------------------ models and states

  def _abstract_model(self, kind: str):
    if kind not in self._abstract:
      if kind == 'policy':
        make = lambda: transformer.Transformer(self.model_cfg, rngs=nnx.Rngs(0))
      else:
        make = lambda: reward_model.create(self.model_cfg, 0)
      self._abstract[kind] = nnx.split(nnx.eval_shape(make))
    return self._abstract[kind]

  def graphdef(self, kind: str):
    """The nnx GraphDef of the policy ('policy') or of the reward model ('reward_model')."""
    return self._abstract_model(kind)[0]

  def abstract_state(self, kind: str, optimizer):
    """The TrainState restore target: shapes, dtypes and shardings, nothing allocated."""
    abstract = jax.eval_shape(lambda p: train_lib.init_state(p, optimizer),
                              self._abstract_model(kind)[1])
    if self.mesh is not None:
      shard = train_lib.state_shardings(abstract, optimizer, self.mesh, self.rules)
    else:
      one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      shard = jax.tree.map(lambda _: one, abstract)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shard)

  def checkpoints(self, stage) -> checkpoint.StageCheckpoints:
    if stage.name not in self._ckpts:
      self._ckpts[stage.name] = checkpoint.StageCheckpoints(
          os.path.join(checkpoint.stage_dir(self.workdir, stage), 'ckpt'),
          keep=int(self.config.ckpt.keep))
    return self._ckpts[stage.name]

  def final_state(self, stage) -> train_lib.TrainState:
    """A completed training stage's final TrainState, restored from its checkpoint."""
    kind = 'reward_model' if stage.kind == 'reward_model' else 'policy'
    opt = train_lib.make_optimizer(stages_lib.optimizer_config(stage))
    _, state, _ = self.checkpoints(stage).restore(self.abstract_state(kind, opt), step=stage.steps)
    return state

  # ------------------------------------------------------------ policy sources

  def source_before(self, index: int) -> tuple:
    """The policy the stage at `index` receives when it names no init_from."""
    return ('initial',) if index == 0 else self.source_after(index - 1)

  def source_after(self, index: int) -> tuple:
    """The policy the stage at `index` leaves behind."""
    st = self.plan.stages[index]
    if st.trains_policy:
      return ('stage', st.name)
    if st.kind == 'eval':
      return self.start_source(st)
    return self.source_before(index)          # a reward model leaves the policy as it was

  def start_source(self, stage) -> tuple:
    if not stage.init_from:
      return self.source_before(stage.index)
    if config_lib.looks_like_path(stage.init_from):
      return ('hf', stage.init_from)
    return self.source_after(self.plan.stage(stage.init_from).index)

  def params_of(self, source: tuple, keep: bool = True):
    """The policy params of a source ('initial' / ('stage', name) / ('hf', path))."""
    if self._params is not None and self._params[0] == source:
      return self._params[1]
    if source[0] == 'initial':
      m = self.config.model
      if m.get('hf_path'):
        params = nnx.split(hf.load_model(m.hf_path, mesh=self.mesh, rules=self.rules))[1]
      else:
        params = nnx.split(transformer.create(self.model_cfg, self.seed, self.mesh, self.rules))[1]
    elif source[0] == 'stage':
      params = self.final_state(self.plan.stage(source[1])).params
    else:
      model = hf.load_model(source[1], mesh=self.mesh, rules=self.rules)
      params = nnx.split(model)[1]
      want = jax.tree.map(lambda a: (a.shape, a.dtype), self._abstract_model('policy')[1])
      got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
      if want != got:
        raise ValueError(f'{source[1]}: the HF checkpoint is not the configured architecture '
                         f'({model.cfg} vs {self.model_cfg})')
    if keep:
      self._params = (source, params)
    return params

  def remember(self, source: tuple, params) -> None:
    self._params = (source, params)

  def start_params(self, stage):
    return self.params_of(self.start_source(stage))

  def initial_state(self, stage, kind: str, optimizer, seed: int) -> train_lib.TrainState:
    """A fresh TrainState for a stage: its starting policy (or a reward model on it)."""
    params = self.start_params(stage)
    if kind == 'reward_model':
      backbone = nnx.merge(self.graphdef('policy'), jax.tree.map(jnp.copy, params))
      params = nnx.split(reward_model.create(self.model_cfg, seed, backbone=backbone))[1]
      if self.mesh is not None:
        params = sharding.shard_state(params, self.mesh, self.rules)
    else:
      params = jax.tree.map(jnp.copy, params)   # the train step donates; keep the source intact
    state = train_lib.init_state(params, optimizer, seed=seed, mesh=self.mesh, rules=self.rules)
    if not stage.reset_optimizer:
      state = self._carry_optimizer(stage, state)
    return state

  def _carry_optimizer(self, stage, state):
    src = self.start_source(stage)
    if src[0] != 'stage':
      logging.warning('stage %s: reset_optimizer=False but it starts from %s, which has no '
                      'optimizer state; starting a fresh one', stage.name, src)
      return state
    prev = self.final_state(self.plan.stage(src[1]))
    if jax.tree.structure(prev.opt_state) != jax.tree.structure(state.opt_state):
      raise ValueError(f'stage {stage.name!r}: reset_optimizer=False, but the optimizer state of '
                       f'stage {src[1]!r} does not fit this stage\'s optimizer (different '
                       'clipping?)')
    return state._replace(opt_state=prev.opt_state)

  def teachers(self, stage):
    """MOPD teachers: (list of params, [num_domains] int array domain index -> teacher)."""
    chosen = {}
    for d in stage.domains:
      ref = stage.teachers if stage.teachers == 'best' else stage.teachers[d]
      if ref == 'best':
        rows = [r for r in self.progress.rows
                if r['stage'] == INIT_ROW or self.plan.stage(r['stage']).index < stage.index]
        rows = [r for r in rows if r['scores'].get(d) is not None]
        if not rows:
          raise ValueError(f'stage {stage.name!r}: no evaluated earlier policy to pick the '
                           f'{d!r} teacher from')
        best = max(rows, key=lambda r: r['scores'][d])    # max keeps the earliest of ties
        src = (('initial',) if best['stage'] == INIT_ROW
               else self.source_after(self.plan.stage(best['stage']).index))
        why = f'best {d} score {best["scores"][d]:.1f} after {best["stage"]}'
      elif config_lib.looks_like_path(ref):
        src, why = ('hf', ref), 'explicit path'
      else:
        src, why = self.source_after(self.plan.stage(ref).index), f'explicit stage {ref}'
      chosen[d] = (src, why)
    sources = sorted({src for src, _ in chosen.values()})
    params = [self.params_of(s, keep=False) for s in sources]
    table = np.full(len(self.domain_index), -1, np.int32)
    for d, (src, why) in chosen.items():
      table[self.domain_index[d]] = sources.index(src)
      print(f'[{stage.index}] {stage.name}: teacher for {d}: {src} ({why})', flush=True)
    self.stage_log.setdefault(stage.name, {})['teachers'] = {
        d: list(src) for d, (src, _) in chosen.items()}
    return params, table

  def check_rows(self) -> None:
    """Fixed-size batches must split over their microbatches and the mesh's batch shards."""
    for st in self.plan.stages:
      if st.kind in config_lib.RL_KINDS:
        rows, what = st.prompts_per_step * st.group_size, 'prompts_per_step * group_size'
      elif st.kind == 'reward_model':
        rows, what = st.batch_size, 'batch_size'
      else:
        continue                                 # SFT pads its packed rows to fit
      if rows % (st.microbatches * self.batch_shards):
        raise config_lib.ConfigError(
            f'stages[{st.index}] {st.name!r}: {what} = {rows} rows do not split over '
            f'{st.microbatches} microbatches x {self.batch_shards} batch shards of the mesh')

  # ------------------------------------------------------------ data and verifiers

  def _check_metadata(self, domain: str, metadata: dict, where: str) -> None:
    d = self.plan.domains[domain]
    for name, opts in ((d.verifier, d.verifier_options),
                       (d.eval_verifier, d.eval_verifier_options)):
      self._verifiers_mod.validate(name, metadata, where, **opts)

  def check_verifier_options(self) -> None:
    """Builds every verifier once (a stand-in for a reward model) so bad options fail now."""
    stand_in = lambda prompts, answers: np.zeros(len(prompts), np.float32)
    for d in self.plan.domains.values():
      for field, name, opts in (('verifier_options', d.verifier, d.verifier_options),
                                ('eval_verifier_options', d.eval_verifier,
                                 d.eval_verifier_options)):
        opts = dict(opts)
        if name in config_lib.RM_SCORER_REQUIRED or (
            d.reward_model_stage and name in config_lib.RM_SCORER_OPTION):
          opts[config_lib.RM_SCORER_OPTION[name]] = stand_in
        try:
          v = self._verifiers_mod.get(name, **opts)
        except (TypeError, ValueError) as e:
          raise config_lib.ConfigError(f'config.domains.{d.name}.{field}: verifier {name!r} '
                                       f'rejects {sorted(opts)}: {e}') from None
        v.close()

  def load_data(self) -> None:
    """Loads and checks every dataset the config names (errors name file and line)."""
    for name, spec in sorted(self.plan.datasets.items()):
      used = (any(name in s.datasets for s in self.plan.stages)
              or any(name in (d.train, d.eval) for d in self.plan.domains.values()))
      if used:
        self._records[name] = data_lib.load(spec, domains=list(self.plan.domains),
                                            check_metadata=self._check_metadata)
    ev = _as_dict(self.config.eval)
    modes = rollout.stage_modes(None if ev.get('thinking') is None else
                                float(bool(ev.get('thinking'))))
    self.eval_sets = {}
    for d, dom in sorted(self.plan.domains.items()):
      recs = [r for r in self._records[dom.eval] if r['domain'] == d]
      recs = self._fit(recs, lambda r: rollout.longest_prompt_len(r, self.tokenizer, modes)
                       <= int(ev['max_prompt_len']), f'eval set of domain {d!r}',
                       f'prompts longer than config.eval.max_prompt_len={ev["max_prompt_len"]}')
      n = int(ev['num_prompts'])
      self.eval_sets[d] = recs[:n] if n else recs
    for st in self.plan.stages:
      if st.kind != 'eval':
        self.stage_records(st)

  def _fit(self, recs, ok, what: str, why: str) -> list:
    kept = [r for r in recs if ok(r)]
    if len(kept) < len(recs):
      print(f'WARNING: {what}: dropped {len(recs) - len(kept)} of {len(recs)} records ({why})',
            flush=True)
    if not kept:
      raise ValueError(f'{what}: no records left after dropping {why}')
    return kept

  def stage_records(self, stage) -> list:
    """The stage's records (its datasets, its domains), too-long prompts dropped with a warning."""
    if stage.name not in self._stage_records:
      recs = [r for ds in stage.datasets for r in self._records[ds]
              if stage.kind in ('sft', 'reward_model') or r['domain'] in stage.domains]
      what = f'stages[{stage.index}] {stage.name!r}'
      if stage.kind in config_lib.RL_KINDS:
        modes = rollout.stage_modes(stage.thinking_fraction)
        recs = self._fit(recs, lambda r: rollout.longest_prompt_len(r, self.tokenizer, modes)
                         <= stage.max_prompt_len, what,
                         f'prompts longer than max_prompt_len={stage.max_prompt_len}')
      elif stage.kind == 'sft':
        recs = self._fit(recs, lambda r: any(stages_lib.sft_example(
            r, self.tokenizer, stage.thinking_switch, stage.max_len)[1]), what,
                         f'examples whose prompt fills max_len={stage.max_len}')
      self._stage_records[stage.name] = recs
    return self._stage_records[stage.name]

  def verifier_of(self, domain: str, for_eval: bool = False):
    """The (cached) training or evaluation verifier of a domain."""
    d = self.plan.domains[domain]
    name = d.eval_verifier if for_eval else d.verifier
    opts = dict(d.eval_verifier_options if for_eval else d.verifier_options)
    takes_rm = bool(d.reward_model_stage) and name in config_lib.RM_SCORER_OPTION and (
        not for_eval or name in config_lib.RM_SCORER_REQUIRED)
    key = (name, repr(sorted(opts.items())), d.reward_model_stage if takes_rm else '')
    if key not in self._verifiers:
      if takes_rm:
        opts[config_lib.RM_SCORER_OPTION[name]] = self._rm_scorer(d)
      self._verifiers[key] = self._verifiers_mod.get(name, **opts)
    return self._verifiers[key]

  def _rm_scorer(self, domain):
    rm_stage = self.plan.stage(domain.reward_model_stage)
    if rm_stage.name not in self.progress.done:
      raise ValueError(f'domain {domain.name!r} is scored by reward model stage '
                       f'{rm_stage.name!r}, which has not run yet')
    state = self.final_state(rm_stage)
    model = nnx.merge(self.graphdef('reward_model'), state.params)
    return reward_model.make_text_scorer(model, self.tokenizer, max_len=rm_stage.max_len,
                                         batch_size=rm_stage.batch_size)

  def evaluate_row(self, name: str, index: int, trains_on, params) -> dict:
    """Evaluates a policy on every domain and appends its row to progress.json."""
    ev = _as_dict(self.config.eval)
    # One key for every row: rows differ by their policy only, not by sampling noise.
    key = jax.random.fold_in(jax.random.PRNGKey(self.seed), 1_000_003)
    ready = {d: recs for d, recs in self.eval_sets.items() if self._can_score(d)}
    out = evaluation.evaluate(self.sampler, params, self.tokenizer, ready,
                              lambda d: self.verifier_of(d, for_eval=True), self.sample_cls,
                              ev, key)
    row = {'stage': name, 'index': index, 'domains': list(trains_on),
           'scores': {d: out[d]['score'] for d in sorted(out)}, 'details': out}
    self.progress.add_row(row)
    self.writer.write_scores(name, index, row['scores'])
    return row

  def _can_score(self, domain: str) -> bool:
    d = self.plan.domains[domain]
    if (d.eval_verifier not in config_lib.RM_SCORER_REQUIRED
        or d.reward_model_stage in self.progress.done):
      return True
    print(f'WARNING: domain {domain!r} is evaluated by reward model stage '
          f'{d.reward_model_stage!r}, not trained yet: no score in this row', flush=True)
    return False

  def close(self) -> None:
    for v in self._verifiers.values():
      if hasattr(v, 'close'):
        v.close()
    for c in self._ckpts.values():
      c.close()
    self.writer.close()


def _as_dict(x) -> dict:
  return x.to_dict() if hasattr(x, 'to_dict') else dict(x or {})


def _model_config(model) -> model_config.ModelConfig:
  m = _as_dict(model)
  if m.get('hf_path'):
    import json  # pylint: disable=g-import-not-at-top
    with open(os.path.join(m['hf_path'], 'config.json'), encoding='utf-8') as f:
      return hf.config_from_hf(json.load(f))
  return model_config.ModelConfig.preset(m['preset'], **dict(m.get('overrides') or {}))


def export_hf(ctx: Context, stage, params) -> str:
  """Writes the stage's policy to stages/<idx>_<name>/hf (via a temporary dir and a rename)."""
  out = os.path.join(checkpoint.stage_dir(ctx.workdir, stage), 'hf')
  if os.path.exists(out):
    return out
  if not all(getattr(x, 'is_fully_addressable', True) for x in jax.tree.leaves(params)):
    # Multi-host: the gather is a collective, so every process joins it; the
    # writer then holds the whole policy in host memory (CPU-backed arrays).
    host = jax.local_devices(backend='cpu')[0]
    params = jax.tree.map(lambda x: jax.device_put(x, host),
                          multihost_utils.process_allgather(params, tiled=True))
  if not checkpoint.is_writer():
    return out
  for stale in glob.glob(out + '.tmp.*'):
    shutil.rmtree(stale, ignore_errors=True)     # a previous run killed mid-export
  tmp = f'{out}.tmp.{os.getpid()}'
  hf.save_model(nnx.merge(ctx.graphdef('policy'), params), tmp)
  os.replace(tmp, out)
  return out


def run(config, workdir: str) -> dict:
  """Runs (or resumes) the cascade a config describes in `workdir`.

  Args:
    config: the ConfigDict (see README, "Config format").
    workdir: the run's directory; rerunning with the same config resumes.

  Returns:
    The results.json object (domains, stages, stage_domains, scores).

  Raises:
    cascade.config.ConfigError: the config is invalid (before anything runs).
    cascade.data.DataError: a malformed record (before the first step).
    cascade.checkpoint.WorkdirError: the workdir holds a different config (unless allowed).
  """
  plan = config_lib.validate(config)
  os.makedirs(workdir, exist_ok=True)
  checkpoint.guard_config(workdir, config,
                          allow_change=bool(config.get('allow_config_change', False)))
  ctx = Context(config, plan, workdir)
  domains = sorted(plan.domains)
  try:
    ctx.check_rows()
    ctx.check_verifier_options()
    ctx.load_data()
    if plan.initial_eval and ctx.progress.row(INIT_ROW) is None:
      row = ctx.evaluate_row(INIT_ROW, -1, [], ctx.params_of(('initial',)))
      evaluation.write(workdir, ctx.progress.rows, domains)
      print('initial policy: ' + ', '.join(f'{d} {v:.1f}' for d, v in row['scores'].items()),
            flush=True)
    for stage in plan.stages:
      if stage.name in ctx.progress.done:
        continue
      _run_stage(ctx, stage, domains)
  finally:
    ctx.close()
  res = evaluation.write(workdir, ctx.progress.rows, domains)
  if checkpoint.is_writer():
    print(evaluation.markdown(res), flush=True)
    print(f'results: {os.path.join(workdir, "results.md")}, '
          f'{os.path.join(workdir, "results.png")}', flush=True)
  return res


def _run_stage(ctx: Context, stage, domains) -> None:
  state = stages_lib.RUNNERS[stage.kind](ctx, stage)
  info = {'index': stage.index, 'kind': stage.kind}
  params = None
  if stage.trains_policy:
    params = state.params
    ctx.remember(('stage', stage.name), params)
    info['hf'] = export_hf(ctx, stage, params)
  if stage.trains_policy or stage.kind == 'reward_model':
    info['final_step'] = stage.steps
  row = ctx.progress.row(stage.name)
  if stage.is_policy_stage and stage.evaluate and row is None:
    if params is None:
      params = ctx.params_of(ctx.source_after(stage.index))
    row = ctx.evaluate_row(stage.name, stage.index, stage.domains if stage.trains_policy else [],
                           params)
  log = ctx.stage_log.get(stage.name, {})
  if log.get('teachers'):
    info['teachers'] = log['teachers']
  ctx.progress.mark_done(stage.name, info)
  evaluation.write(ctx.workdir, ctx.progress.rows, domains)
  rows = ctx.progress.rows
  prev = rows[rows.index(row) - 1]['scores'] if row is not None and rows.index(row) else None
  if checkpoint.is_writer():
    print(metrics.summary_line(stage, log.get('steps_run', 0), log.get('seconds', 0.0),
                               log.get('first', {}), log.get('last', {}),
                               row['scores'] if row else None, prev), flush=True)


class _CallableModule(type(os)):
  """Lets `cascade.run(config, workdir)` work although `cascade.run` is this module."""

  def __call__(self, config, workdir: str) -> dict:
    return run(config, workdir)


sys.modules[__name__].__class__ = _CallableModule
