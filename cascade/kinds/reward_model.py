"""Kind 'reward_model': a Bradley-Terry reward model on preference pairs, started from a policy.

  dict(name='rm', kind='reward_model', domains=['chat'], datasets=['chat_prefs'], steps=100,
       batch_size=32, max_len=64, optimizer=dict(lr=1e-3), init_from='sft')

The model is the starting policy's backbone with a scalar head; each step
scores `batch_size` (chosen, rejected) pairs, each rendered as the prompt the
verifiers see plus the response, and minimises -log sigmoid(r_chosen -
r_rejected). The stage leaves the policy as it was; a domain whose verifier
is 'reward_model' (or that adds the RM score, like IF in thinking mode) names
this stage in `reward_model_stage`. Not a row of the matrix. As a scorer it
reads rows of up to `score_max_len` tokens (default `max_len`): the prompt kept
whole, the response's chat markers as text (`rl.reward_model.encode`). A scoring
call holds at most a training call's tokens (batch_size x max_len): rows longer
than max_len go fewer to a call (`rl.reward_model.rows_per_call`), and
`launch.plan` compiles the call a stage's longest rollouts make.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from cascade import rollout
from cascade.kinds import base
from cascade.kinds import loop
from models import sharding
from rl import reward_model as rm_lib
from rl import train_step as train_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(base.PairStageConfig):
  MODEL: ClassVar[str] = 'reward_model'
  LEAVES: ClassVar[str] = 'previous'
  ROW: ClassVar[bool] = False

  evaluate: bool = base.field(False, check=base.BOOL)
  # Most tokens of a row the trained model scores as a verifier (prompt + rollout, the
  # rollout's last token standing for the EOS the row ends with); 0: max_len. Every sampling
  # stage and evaluation it scores must fit (config validation), so no rollout is cut.
  score_max_len: int = base.field(0, check=base.int_at_least(0))

  @property
  def score_len(self) -> int:
    """The scorer's row cap: score_max_len, or max_len when that is 0."""
    return self.score_max_len or self.max_len

  def check_lengths(self, max_seq, fail):
    super().check_lengths(max_seq, fail)
    if max_seq is not None and self.score_max_len > max_seq:
      fail('score_max_len', f"exceeds the model's max_seq_len={max_seq}")


LOSS = train_lib.LossSpec(rm_lib.RewardModelConfig, rm_lib.loss_fn, rm_lib.normalizers)


def loss(stage: Config):
  del stage
  return LOSS, None


def abstract_batch(stage: Config, mesh, rules):
  rows_sh = NamedSharding(mesh, sharding.logical_to_spec(('batch',), None, mesh, rules))
  b, t = stage.batch_size, stage.max_len
  mat = lambda: jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows_sh)
  return (rm_lib.PairBatch(mat(), mat(), mat(), mat()),
          f'{b} pairs x {t} tokens, {stage.microbatches} microbatch(es)')


def run(ctx, stage: Config) -> base.StageResult:
  def batches(recs):
    return [rm_lib.make_pair_batch(
        ctx.tokenizer, [rollout.verifier_prompt(r) for r in recs],
        [r['chosen'] for r in recs], [r['rejected'] for r in recs], stage.max_len)], {}

  maker = loop.record_batches(ctx, stage, batches)
  return loop.train_stage(ctx, KIND, stage, maker)._replace(params=None)


KIND = base.Kind('reward_model', Config, run, loss=loss, abstract_batch=abstract_batch)
