"""Policies and where they come from: the initial model, stage checkpoints, HF directories.

Policies flow by reference. A stage starts from `init_from` (an earlier
stage's policy, or an HF directory) or else from the policy the previous
stage left: a stage that trains a policy leaves its own, an eval stage its
starting one, a reward model the one before it. A source is a tuple:
('initial',), ('stage', name) or ('hf', path). One policy's params are kept
in memory (the one the last stage produced or loaded), so consecutive stages
do not reload; others are restored from the stage's final checkpoint. A fourth source,
('ckpt', name, step), is a stage's checkpoint of that step (the validation ledger's best
checkpoints, `cascade.ledger`: MOPD's teachers).

`abstract_state` is the restore target of a stage's TrainState (shapes,
dtypes and shardings, nothing allocated); `launch.plan` compiles against the
same function.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import time
from typing import Callable

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from cascade import checkpoint
from cascade import checksums
from cascade import config as config_lib
from cascade.kinds import base
from foundation import chat_template
from foundation import paths
from foundation import tokenizer as tokenizer_lib
from models import hf
from models import sharding
from models import transformer
from rl import judge as judge_lib
from rl import reward_model
from rl import train_step as train_lib


# The models a stage can train (a kind's `MODEL`): ModelConfig -> a freshly built module.
MODELS = {
    'policy': lambda cfg: transformer.Transformer(cfg, rngs=nnx.Rngs(0)),
    'reward_model': lambda cfg: reward_model.create(cfg, 0),
}


def abstract_model(model_cfg, model_kind: str):
  """(graphdef, abstract params) of a model in MODELS; nothing allocated."""
  return nnx.split(nnx.eval_shape(lambda: MODELS[model_kind](model_cfg)))


def master_dtype(model_cfg) -> str | None:
  """The dtype of a stage's master weights and Adam moments: float32 whenever the params are lower.

  At the paper's RL learning rates (2e-6 .. 4e-6) an Adam update is ~1e-6, far
  below half a bfloat16 ulp of typical weights (~6e-5 at magnitude 0.02): in
  bfloat16 most updates would round to nothing and RL would silently not learn.
  """
  dt = jnp.dtype(model_cfg.param_dtype)
  return 'float32' if jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4 else None


def abstract_state(params, optimizer, mesh, rules, master: str | None = None):
  """The TrainState `init_state` builds from `params` (float `master` weights), abstract."""
  abstract = jax.eval_shape(lambda p: train_lib.init_state(p, optimizer, master_dtype=master),
                            params)
  if mesh is not None:
    shard = train_lib.state_shardings(abstract, optimizer, mesh, rules)
  else:
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shard = jax.tree.map(lambda _: one, abstract)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shard)


def scoring_call_tokens(rm_stage) -> int:
  """The most tokens a scoring call of `rm_stage`'s reward model holds: its training call's
  rows x length (batch_size x max_len), so rows longer than it trained on (up to
  score_max_len) go fewer to a call; `launch.plan` compiles that call."""
  return rm_stage.batch_size * rm_stage.max_len


class Policies:
  """Model structures, stage checkpoints and policy sources of one run.

  Args:
    plan: the validated plan.
    workdir: the run's directory.
    mesh, rules: where params live (mesh None: one device).
    before_save: runs before every checkpoint save (the run's metrics flush).
    pinned: stage name -> the steps its checkpoint rotation keeps besides the newest
      (`cascade.ledger.Ledger.pinned`).
    skipped: stage name -> whether the stage was skipped (a guard's repair stage with nothing
      to repair: it leaves the policy it received).
  """

  def __init__(self, plan: config_lib.Plan, workdir: str, mesh, rules,
               before_save: Callable[[], None] | None = None,
               pinned: Callable[[str], set[int]] | None = None,
               skipped: Callable[[str], bool] | None = None):
    self.plan, self.workdir, self.mesh, self.rules = plan, workdir, mesh, rules
    self._before_save = before_save
    self._pinned = pinned
    self._skipped = skipped or (lambda name: False)
    self._abstract: dict[str, tuple] = {}
    self._ckpts: dict[str, checkpoint.StageCheckpoints] = {}
    self._params: tuple | None = None     # (source, params): the one policy kept in memory

  # ------------------------------------------------------------ structures and checkpoints

  def _model(self, model_kind: str):
    if model_kind not in self._abstract:
      self._abstract[model_kind] = abstract_model(self.plan.model, model_kind)
    return self._abstract[model_kind]

  def graphdef(self, model_kind: str):
    """The nnx GraphDef of the policy ('policy') or of the reward model ('reward_model')."""
    return self._model(model_kind)[0]

  def abstract_state(self, model_kind: str, optimizer):
    return abstract_state(self._model(model_kind)[1], optimizer, self.mesh, self.rules,
                          master_dtype(self.plan.model))

  def compute_copy(self, params):
    """Params in the model's own dtype (master weights may be float32): for exports and for
    frozen copies (references, teachers), which the forward pass casts to that dtype anyway."""
    dt = self.plan.model.jnp_param_dtype
    return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)

  def checkpoints(self, stage) -> checkpoint.StageCheckpoints:
    if stage.name not in self._ckpts:
      self._ckpts[stage.name] = checkpoint.StageCheckpoints(
          paths.join(checkpoint.stage_dir(self.workdir, stage), 'ckpt'),
          keep=self.plan.ckpt.keep, before_save=self._before_save,
          checksums=self.plan.ckpt.checksums,
          pinned=None if self._pinned is None else (lambda name=stage.name: self._pinned(name)))
    return self._ckpts[stage.name]

  def final_state(self, stage) -> train_lib.TrainState:
    """A completed training stage's final TrainState, restored from its checkpoint.

    A damaged final checkpoint falls back to the stage's HF export (the same
    weights; the optimizer state is then fresh, which only matters to a
    later `reset_optimizer=False`), with a warning; an export that is
    damaged too is one CheckpointError line.
    """
    opt = base.make_optimizer(stage).tx
    target = self.abstract_state(stage.MODEL, opt)
    ckpts = self.checkpoints(stage)
    try:
      _, state, _ = ckpts.restore(target, step=stage.steps)
      return state
    except Exception as e:  # pylint: disable=broad-except
      export = paths.join(checkpoint.stage_dir(self.workdir, stage), 'hf')
      if stage.MODEL != 'policy' or not exported(export):
        raise checkpoint.CheckpointError(
            f'{ckpts.directory}/{stage.steps}: the final checkpoint of stage {stage.name!r} '
            f'cannot be restored ({type(e).__name__}) and there is no HF export to fall back '
            'to; rerun the stage in a new workdir') from None
      print(f'WARNING: {ckpts.directory}/{stage.steps}: the final checkpoint of stage '
            f'{stage.name!r} cannot be restored ({type(e).__name__}); using its HF export '
            f'{export} (weights only)', flush=True)
      try:
        if self.plan.ckpt.checksums:
          checksums.check(export, required=True)
        params = self._load_hf(export)
      except Exception as e2:  # pylint: disable=broad-except
        why = str(e2).splitlines()[0][:200] if str(e2) else ''
        raise checkpoint.CheckpointError(
            f'{ckpts.directory}/{stage.steps}: the final checkpoint of stage {stage.name!r} '
            f'cannot be restored ({type(e).__name__}) and its HF export {export} cannot be '
            f'loaded either ({type(e2).__name__}: {why}); rerun the stage in a new '
            'workdir') from None
      return train_lib.init_state(params, opt, master_dtype=master_dtype(self.plan.model),
                                  mesh=self.mesh, rules=self.rules)

  def close(self) -> None:
    for c in self._ckpts.values():
      c.close()

  def rotate(self, names) -> None:
    """Applies the checkpoint rotation to the named stages that have checkpoints (a finished
    stage's intermediate checkpoint the validation ledger no longer pins is deleted)."""
    for st in self.plan.stages:
      ckpt = paths.join(checkpoint.stage_dir(self.workdir, st), 'ckpt')
      if st.name in names and st.MODEL is not None and paths.exists(ckpt):
        self.checkpoints(st).rotate()

  # ------------------------------------------------------------ sources

  def source_before(self, index: int) -> tuple:
    """The policy the stage at `index` receives when it names no init_from."""
    return ('initial',) if index == 0 else self.source_after(index - 1)

  def source_after(self, index: int) -> tuple:
    """The policy the stage at `index` leaves behind."""
    st = self.plan.stages[index]
    if self._skipped(st.name):
      return self.source_before(index)
    if st.LEAVES == 'own':
      return ('stage', st.name)
    if st.LEAVES == 'start':
      return self.start_source(st)
    return self.source_before(index)

  def start_source(self, stage) -> tuple:
    if not stage.init_from:
      return self.source_before(stage.index)
    if base.looks_like_path(stage.init_from):
      return ('hf', stage.init_from)
    return self.source_after(self.plan.stage(stage.init_from).index)

  def _load_hf(self, path: str):
    model = hf.load_model(path, mesh=self.mesh, rules=self.rules)
    params = nnx.split(model)[1]
    want = jax.tree.map(lambda a: (a.shape, a.dtype), self._model('policy')[1])
    got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    if want != got:
      raise ValueError(f'{path}: the HF checkpoint is not the configured architecture '
                       f'({model.cfg} vs {self.plan.model})')
    return params

  def checkpoint_params(self, stage, step: int):
    """The params of `stage`'s checkpoint of `step` (one CheckpointError line when it cannot
    be restored)."""
    ckpts = self.checkpoints(stage)
    target = self.abstract_state(stage.MODEL, base.make_optimizer(stage).tx)
    try:
      _, state, _ = ckpts.restore(target, step=step)
    except Exception as e:  # pylint: disable=broad-except
      raise checkpoint.CheckpointError(
          f'{ckpts.directory}/{step}: the checkpoint of stage {stage.name!r} step {step} '
          f'cannot be restored ({type(e).__name__}); rerun in a new workdir') from None
    return state.params

  def params_of(self, source: tuple, keep: bool = True):
    """The policy params of a source ('initial' / ('stage', name) / ('hf', path) /
    ('ckpt', name, step))."""
    if self._params is not None and self._params[0] == source:
      return self._params[1]
    if source[0] == 'initial':
      if self.plan.hf_path:
        params = nnx.split(hf.load_model(self.plan.hf_path, mesh=self.mesh, rules=self.rules))[1]
      else:
        params = nnx.split(transformer.create(self.plan.model, self.plan.seed, self.mesh,
                                              self.rules))[1]
    elif source[0] == 'stage':
      params = self.final_state(self.plan.stage(source[1])).params
    elif source[0] == 'ckpt':
      params = self.checkpoint_params(self.plan.stage(source[1]), source[2])
    else:
      params = self._load_hf(source[1])
    if keep:
      self._params = (source, params)
    return params

  def remember(self, source: tuple, params) -> None:
    self._params = (source, params)

  def start_params(self, stage):
    return self.params_of(self.start_source(stage))

  def initial_state(self, stage, optimizer, seed: int) -> train_lib.TrainState:
    """A fresh TrainState for a stage: its starting policy (or a reward model on it)."""
    params = self.start_params(stage)
    if stage.MODEL == 'reward_model':
      backbone = nnx.merge(self.graphdef('policy'), jax.tree.map(jnp.copy, params))
      params = nnx.split(reward_model.create(self.plan.model, seed, backbone=backbone))[1]
      if self.mesh is not None:
        params = sharding.shard_state(params, self.mesh, self.rules)
    else:
      params = jax.tree.map(jnp.copy, params)   # the train step donates; keep the source intact
    state = train_lib.init_state(params, optimizer, seed=seed,
                                 master_dtype=master_dtype(self.plan.model), mesh=self.mesh,
                                 rules=self.rules)
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

  def reward_scorer(self, rm_stage, tokenizer):
    """A text scorer from a finished reward_model stage's final checkpoint."""
    state = self.final_state(rm_stage)
    model = nnx.merge(self.graphdef('reward_model'), state.params)
    return reward_model.make_text_scorer(model, tokenizer, max_len=rm_stage.score_len,
                                         batch_size=rm_stage.batch_size,
                                         call_tokens=scoring_call_tokens(rm_stage))

  def judge_model(self, source: tuple, tokenizer) -> judge_lib.JudgeModel:
    """A frozen judge on the run's mesh: ('stage', name), that stage's final policy in the
    model's compute dtype with the run's `tokenizer`; ('hf', path), an HF checkpoint directory
    with its own tokenizer (any supported family). Its sampler takes the run's sampler options
    as `rl.judge.run_sampler_options` turns them into a judge's (default length buckets, its
    loaded layout, the same KV bytes)."""
    options = dict(sampler_options=self.plan.sampler.options(), policy_cfg=self.plan.model)
    if source[0] == 'stage':
      params = self.compute_copy(self.params_of(source, keep=False))
      return judge_lib.JudgeModel(self.graphdef('policy'), params, self.plan.model, tokenizer,
                                  mesh=self.mesh, rules=self.rules, **options)
    return judge_lib.JudgeModel.from_hf(source[1], mesh=self.mesh, rules=self.rules, **options)

  # ------------------------------------------------------------ export

  def export_hf(self, stage, params) -> str:
    """Writes the stage's policy and the run's tokenizer (with the run's chat template: ours,
    or the checkpoint's own for config.tokenizer.chat_template='checkpoint') to
    stages/<idx>_<name>/hf, never leaving a partial export.

    Every process joins (a policy spanning hosts is gathered one tensor at a time);
    process 0 writes. Local: written to a temporary directory renamed into place.
    gs://: uploaded file by file, config.json last, so `exported` is true only of a
    whole one (a killed upload is redone).
    """
    out = paths.join(checkpoint.stage_dir(self.workdir, stage), 'hf')
    if exported(out) and not self.damaged_export(stage, out):
      return out
    model = nnx.merge(self.graphdef('policy'), self.compute_copy(params))
    tokenizer = tokenizer_lib.load(self.plan.tokenizer_path)
    writer = checkpoint.is_writer()
    if paths.is_remote(out):
      hf.save_model(model, out, tokenizer=tokenizer)       # config.json is uploaded last
      if writer:
        self._keep_template(out)
      if writer and self.plan.ckpt.checksums:
        checksums.seal(out)           # read back from the store: what is there is what is sealed
      return out
    if writer:
      for stale in glob.glob(out + '.tmp.*'):
        shutil.rmtree(stale, ignore_errors=True)     # a previous run killed mid-export
    tmp = f'{out}.tmp.{os.getpid()}'
    try:
      hf.save_model(model, tmp, tokenizer=tokenizer)
      if writer:
        self._keep_template(tmp)
      if writer and self.plan.ckpt.checksums:
        checksums.seal(tmp)
    except Exception as e:
      if writer:
        shutil.rmtree(tmp, ignore_errors=True)   # e.g. a full disk: give the space back
      if 'No space left' in str(e) and not isinstance(e, OSError):
        # safetensors reports a full disk as its own error type: make it the OSError it is.
        raise OSError(errno.ENOSPC, 'No space left on device', out) from None
      raise
    if writer:
      os.replace(tmp, out)
    return out

  def _keep_template(self, out: str) -> None:
    """The export's tokenizer_config.json names the run's chat template (`hf.save_model`
    writes ours): a checkpoint's own template stays with the policy trained on it."""
    template = self.plan.chat_template
    if template is chat_template.BUILTIN:
      return
    path = paths.join(out, 'tokenizer_config.json')
    config = json.loads(paths.read_text(path))
    config['chat_template'] = template.source
    paths.write_text(path, json.dumps(config, indent=2, ensure_ascii=False))

  def damaged_export(self, stage, out: str) -> bool:
    """Whether `stage`'s export at `out` differs from its checksums or was never sealed (a
    gs:// export is uploaded file by file and sealed after its config.json, so a kill can
    leave one whole but unsealed: nothing vouches for its bytes); such an export is moved
    aside to stages/<idx>_<name>/corrupt/hf.<time> with a warning (the caller exports again)."""
    if not self.plan.ckpt.checksums:
      return False
    why = checksums.verify(out, required=True)
    if not why:
      return False
    dest = paths.join(checkpoint.stage_dir(self.workdir, stage), 'corrupt',
                      f'hf.{int(time.time())}')
    what = why if not checksums.sealed(out) else f'checksum mismatch: {why}'
    print(f'WARNING: {out}: the HF export of stage {stage.name!r} is damaged ({what}); moved '
          f'to {dest}, exporting it again', flush=True)
    if checkpoint.is_writer():
      paths.move_tree(out, dest)
    return True


def exported(hf_dir: str) -> bool:
  """Whether a whole HF export is at `hf_dir` (its config.json is written last)."""
  return paths.exists(paths.join(hf_dir, 'config.json'))
