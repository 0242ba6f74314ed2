"""Kind 'grpo': group-relative policy optimisation on verifier rewards (the cascade's RL stage).

  dict(name='math_rl', kind='grpo', domains=['math'], steps=10, optimizer=dict(lr=4e-5),
       prompts_per_step=16, group_size=8, temperature=0.8, max_prompt_len=48,
       max_response_len=32, phases=[dict(until_step=5, max_response_len=24,
       filter_overlong=True)])

The Cascade RL default is strictly on-policy GRPO: one update per rollout
batch, token-level loss, no KL term, advantages normalised within each
prompt's group of G samples. Everything `rl.grpo.grpo_loss` offers is a
field here: the advantage estimator, the loss aggregation, the clip range
(`clip_eps_low`, `clip_eps_high` for clip-higher; they act only when a
rollout batch is reused, `updates_per_batch` > 1), a KL penalty to the
stage's starting policy (`kl_coef`, `kl_estimator`; `reference_on_host` keeps that reference in
pinned host memory between its passes), an entropy bonus
(`entropy_coef`) and the sampler/trainer mismatch correction (`tis_cap`,
`mismatch_mask`, `mismatch_mask_low`, `mismatch_mask_high`; off by default).
With a correction and `updates_per_batch` > 1, each step runs one more policy
forward before its first update: the trainer's own old log-probs the PPO ratio
and the mismatch ratio are taken against (`TrainBatch.trainer_logprobs`); with
one update the training forward's own log-probs serve. Rollouts, curriculum,
filtering and a mixture-of-experts policy's routing replay (`routing_replay`):
`cascade.kinds.rl`.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from cascade import schema
from cascade import verifier_errors
from cascade.data import readers
from cascade.data import readers
from cascade.kinds import base
from cascade.kinds import loop
from cascade.kinds import rl
from foundation import step_clock
from rl import batch as batch_lib
from rl import distill
from rl import grpo as grpo_lib
from rl import train_step as train_lib


# `rl.grpo.GrpoConfig`'s fields a stage does not set: the library's defaults hold (a stage's
# advantages take the default eps; its phases' `filter_overlong` drops truncated rows), and
# replay_routing follows from the stage's `routing_replay`.
NOT_SET = ('adv_eps', 'mask_truncated', 'replay_routing')
# The loss fields of a stage: every other field of GrpoConfig, by its own name (`loss_agg`
# comes with every RL kind, `rl.RLStageConfig`).
LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(grpo_lib.GrpoConfig)
                    if f.name not in NOT_SET)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(rl.RLStageConfig,
             schema.settings(grpo_lib.GrpoConfig, leave_out=NOT_SET + ('loss_agg',))):
  """A GRPO stage: an RL stage (`rl.RLStageConfig`) with the loss fields of
  `rl.grpo.GrpoConfig` (advantage, the clip range, KL, entropy, the mismatch correction:
  `tis_cap`, `mismatch_mask`, its band), each with the library's default and check."""
  pack_tokens: int = base.field(0, check=(lambda v: base.is_int(v) and v >= 0,
                                          'must be an int >= 0 (0 = padded rows)'))
  # The KL reference (kl_coef > 0) kept in pinned host memory between its passes, as MOPD's
  # `teachers_on_host` keeps teachers: on the devices only during its forward.
  reference_on_host: bool = base.field(False, check=base.BOOL)

  def check(self, fail):
    if self.group_size < 2:
      fail('group_size', 'grpo needs G >= 2 (a group of one has no baseline)')
    if self.mismatch_mask == 'off':
      for name in ('mismatch_mask_low', 'mismatch_mask_high'):
        if getattr(self, name) != getattr(grpo_lib.GrpoConfig, name):
          fail(name, "has no effect with mismatch_mask='off' (set it to 'token' or 'sequence')")
    if self.reference_on_host and self.kl_coef <= 0:
      fail('reference_on_host', 'has no effect with kl_coef=0 (there is no reference model)')
    if self.pack_tokens and self.loss_agg != 'token':
      fail('pack_tokens', f"needs loss_agg='token' (got {self.loss_agg!r}): a packed row holds "
           'several sequences')
    super().check(fail)

  @property
  def microbatch_rows(self) -> int | None:
    """Packed updates (`pack_tokens`): rows per microbatch, those of a padded update's
    microbatch (prompts_per_step x group_size / updates_per_batch / microbatches), so a packed
    microbatch holds no more tokens than a padded one (`pack_tokens` <= prompt + response
    width) and an update runs as many microbatches as its packed rows fill; None when the
    update is padded (then `microbatches` is the count)."""
    if not self.pack_tokens:
      return None
    return max(1, self.prompts_per_step * self.group_size // self.updates_per_batch
               // self.microbatches)


# The loss this kind trains with (the agentic kind's too).
LOSS = train_lib.LossSpec(grpo_lib.GrpoConfig, grpo_lib.loss_fn, grpo_lib.normalizers)


def loss(stage: Config):
  return LOSS, grpo_lib.GrpoConfig(**{name: getattr(stage, name) for name in LOSS_FIELDS},
                                   replay_routing=stage.routing_replay != 'measure')


def _old_trainer_forward(stage: Config) -> bool:
  """Whether a step computes the policy's old log-probs before its first update: a mismatch
  correction over several updates per rollout batch (with one, the update's own forward
  gives them)."""
  return stage.updates_per_batch > 1 and loss(stage)[1].corrects_mismatch


def abstract_batch(stage: Config, mesh, rules):
  extra = {'ref_logprobs': ('token', jnp.float32)} if stage.kl_coef > 0 else {}
  if _old_trainer_forward(stage):
    extra['trainer_logprobs'] = ('token', jnp.float32)
  return rl.abstract_batch(stage, mesh, rules, **extra)


def run(ctx, stage: Config) -> base.StageResult:
  return train_stage(ctx, stage, KIND, rl.Draws)


def train_stage(ctx, stage: Config, kind: base.Kind, draws_cls) -> base.StageResult:
  """The GRPO stage loop with rollouts drawn by `draws_cls` (`rl.Draws` or a subclass)."""
  records = ctx.data.stage_records(stage)
  # The KL reference is the policy the stage starts from, frozen.
  ref_params = (ctx.policies.compute_copy(ctx.policies.start_params(stage))
                if stage.kl_coef > 0 else None)
  if ref_params is not None and stage.reference_on_host:
    ref_params = distill.to_memory(ref_params, 'pinned_host')
  graphdef = ctx.policies.graphdef('policy')
  per_call = base.frozen_rows_per_call(stage.prompts_per_step * stage.group_size,
                                       stage.microbatches)
  clock = getattr(ctx, 'clock', None) or step_clock.NULL

  def maker(state):
    del state
    loader = readers.Loader(records, base.stage_seed(ctx.plan.seed, stage.seeds_from),
                             stage.prompts_per_step)
    own_errors = verifier_errors.VerifierErrors(stage.where)   # over the stage's steps

    def make(step, rng, state):
      draws = draws_cls(ctx, stage, loader, step, rng, state.params, own_errors)
      rows, rewards, valid, fill = draws.collect()
      with clock.part('advantages + train batch'):
        adv = grpo_lib.advantages(rewards, stage.group_size, stage.advantage)
        valid = rl.loss_valid(stage, step, rows, valid)
        batch = batch_lib.from_samples(rows['samples'], adv, valid=valid)
      if ref_params is not None:
        with clock.program('reference forward'):
          batch = batch._replace(ref_logprobs=np.asarray(batch_lib.compute_logprobs(
              graphdef, distill.to_memory(ref_params, 'device'), batch, ctx.mesh, ctx.rules,
              rows_per_call=per_call)))
      if _old_trainer_forward(stage):
        # The params that sampled the batch, before any of its updates: every mini-batch's
        # ratios are taken against them (the forward replays routing as the update's does).
        with clock.program('old policy forward'):
          batch = batch._replace(trainer_logprobs=np.asarray(batch_lib.compute_logprobs(
              graphdef, state.params, batch, ctx.mesh, ctx.rules, rows_per_call=per_call,
              replay_routing=stage.routing_replay == 'on')))
      with clock.part('updates: split, pack'):
        updates = rl.split_updates(stage, step, ctx.plan.seed, batch)
        if stage.pack_tokens:
          # The update follows the real tokens: each mini-batch's sequences packed into rows of
          # `pack_tokens` (same loss and gradient as the padded rows).
          # A packed update runs as many microbatches of `microbatch_rows` as it fills.
          multiple = math.lcm(stage.microbatch_rows, ctx.batch_shards)
          updates = [batch_lib.pack(u, stage.pack_tokens, rows_multiple=multiple)
                     for u in updates]
        host = {**draws.metrics(), **fill, 'rows_with_loss': float(np.mean(valid)),
                **rl.update_accounting(updates)}
      return updates, host
    return loop.BatchMaker(loader, make)

  return loop.train_stage(ctx, kind, stage, maker)


def frozen_forwards(stage: Config) -> list:
  rows = stage.prompts_per_step * stage.group_size
  out = []
  if stage.kl_coef > 0:
    out.append(base.FrozenForward('reference forward',
                                  base.frozen_rows_per_call(rows, stage.microbatches),
                                  stage.max_prompt_len + stage.longest_response,
                                  calls=stage.microbatches, on_host=stage.reference_on_host))
  if _old_trainer_forward(stage):
    # The policy's own params before the step's first update: no copy beside the state.
    out.append(base.FrozenForward('old policy forward',
                                  base.frozen_rows_per_call(rows, stage.microbatches),
                                  stage.max_prompt_len + stage.longest_response, copies=0,
                                  calls=stage.microbatches))
  return out


KIND = base.Kind('grpo', Config, run, loss=loss, abstract_batch=abstract_batch,
                 sampler_sizes=rl.sampler_sizes, frozen_forwards=frozen_forwards)
