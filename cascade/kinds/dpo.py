"""Kind 'dpo': offline Direct Preference Optimisation on preference pairs, reference frozen.

  dict(name='chat_dpo', kind='dpo', domains=['chat'], datasets=['chat_prefs'], steps=50,
       batch_size=32, max_len=64, beta=0.1, optimizer=dict(lr=1e-5))

Each step takes `batch_size` (chosen, rejected) pairs of the stage's
preference records, renders each prompt the way the policy is prompted
(`thinking`: False = instruct mode, the cascade's default; True = /think;
None = no switch), computes the frozen reference's summed response log-probs
(the policy the stage starts from, kept unchanged), and takes one update on
`rl.dpo`'s loss with `beta` and optional label smoothing (cDPO) or the IPO
variant. The stage trains the policy and gets a row of the matrix.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from cascade import rollout
from cascade.kinds import base
from cascade.kinds import loop
from foundation import chat_template
from models import sharding
from rl import dpo as dpo_lib
from rl import train_step as train_lib


def _thinking_ok(v) -> bool:
  return v is None or isinstance(v, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(base.PairStageConfig):
  beta: float = base.field(0.1, check=base.num_in(0, lo_open=True, what='must be > 0'),
                           convert=float)
  label_smoothing: float = base.field(0.0, check=base.num_in(0, 0.5, hi_open=True),
                                      convert=float)
  loss_type: str = base.field('sigmoid', check=base.one_of(dpo_lib.LOSS_TYPES, 'DPO loss'))
  thinking: bool | None = base.field(False, check=(
      _thinking_ok, 'must be None (no /think switch), True (/think) or False (/no_think)'),
      none_is_a_value=True)


LOSS = train_lib.LossSpec(dpo_lib.DpoConfig, dpo_lib.loss_fn, dpo_lib.normalizers)


def loss(stage: Config):
  return LOSS, dpo_lib.DpoConfig(beta=stage.beta, label_smoothing=stage.label_smoothing,
                                 loss_type=stage.loss_type)


def abstract_batch(stage: Config, mesh, rules):
  rows_sh = NamedSharding(mesh, sharding.logical_to_spec(('batch',), None, mesh, rules))
  b, t = stage.batch_size, stage.max_len
  mat = lambda dt: jax.ShapeDtypeStruct((b, t), jnp.dtype(dt), sharding=rows_sh)
  vec = jax.ShapeDtypeStruct((b,), jnp.float32, sharding=rows_sh)
  fields = {}
  for side in dpo_lib.SIDES:
    for f, dt in (('tokens', jnp.int32), ('positions', jnp.int32), ('segment_ids', jnp.int32),
                  ('targets', jnp.int32), ('loss_mask', jnp.float32)):
      fields[f'{side}_{f}'] = mat(dt)
  return (dpo_lib.DpoBatch(**fields, ref_chosen_logps=vec, ref_rejected_logps=vec),
          f'{b} pairs x 2 sides x {t} tokens, {stage.microbatches} microbatch(es)')


def run(ctx, stage: Config) -> base.StageResult:
  # The reference is the policy the stage starts from, frozen for the whole stage.
  ref_params = ctx.policies.compute_copy(ctx.policies.start_params(stage))
  graphdef = ctx.policies.graphdef('policy')

  def batches(recs):
    batch = dpo_lib.make_batch(ctx.tokenizer,
                               [rollout.prompt_text(r, stage.thinking,
                                                    chat_template.of(ctx.tokenizer))
                                for r in recs],
                               [r['chosen'] for r in recs], [r['rejected'] for r in recs],
                               stage.max_len)
    ref_c, ref_r = dpo_lib.reference_logps(
        graphdef, ref_params, batch, mesh=ctx.mesh, rules=ctx.rules,
        rows_per_call=base.frozen_rows_per_call(stage.batch_size, stage.microbatches))
    return [batch._replace(ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)], {}

  maker = loop.record_batches(ctx, stage, batches)
  return loop.train_stage(ctx, KIND, stage, maker)


def frozen_forwards(stage: Config) -> list:
  return [base.FrozenForward('reference forward',
                             base.frozen_rows_per_call(stage.batch_size, stage.microbatches),
                             stage.max_len, calls=2 * stage.microbatches)]


KIND = base.Kind('dpo', Config, run, loss=loss, abstract_batch=abstract_batch,
                 frozen_forwards=frozen_forwards)
