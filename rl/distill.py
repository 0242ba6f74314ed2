"""MOPD: multi-domain on-policy distillation (Nemotron-Cascade 2).

The student samples; each prompt's domain picks its teacher (the best
earlier checkpoint for that domain); every sampled token gets the advantage

  a_t = log pi_teacher(y_t) - log pi_student(y_t)        (stop-gradient on both)

and the student takes a REINFORCE step  sum_t w_t a_t grad log pi_student(y_t),
with a truncated importance weight w_t = pi_trainer(y_t) / pi_sampler(y_t)
kept only inside [0.5, 2] (tokens outside get weight 0), aggregated over all
tokens of the batch. On-policy w_t = 1, and the step lowers the per-token
reverse KL(student || teacher) on the student's own samples.

Teacher log-probs are computed before the train step (`teacher_logprobs`),
one forward pass per teacher over only the rows routed to it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl import batch as batch_lib
from rl import buckets
from rl import grpo


@dataclasses.dataclass(frozen=True)
class MopdConfig:
  """MOPD loss settings.

  Attributes:
    is_low: smallest importance weight trainer/sampler kept (paper: 0.5).
    is_high: largest importance weight kept (paper: 2).
    replay_routing: when the batch carries the sampler's recorded experts (`routing`):
      replay them in the student's forward (True) or only measure the mismatch (False).
      Teachers never replay: they are other models.
  """
  is_low: float = 0.5
  is_high: float = 2.0
  replay_routing: bool = True

  def __post_init__(self):
    if not 0 <= self.is_low <= 1 <= self.is_high:
      raise ValueError(f'MopdConfig: need 0 <= is_low <= 1 <= is_high, got '
                       f'is_low={self.is_low}, is_high={self.is_high}')


def normalizers(batch: batch_lib.TrainBatch, cfg) -> dict[str, jax.Array]:
  """{'tokens': loss tokens in the whole batch (>= 1)}."""
  del cfg
  return {'tokens': jnp.maximum(jnp.sum(jnp.asarray(batch.loss_mask, jnp.float32)), 1.0)}


def mopd_loss(logprobs: jax.Array, batch: batch_lib.TrainBatch, cfg: MopdConfig,
              norm: Optional[dict] = None):
  """The MOPD surrogate: -1/sum|o| * sum_t w_t a_t pi/sg(pi).

  Its value is -mean(w_t a_t) (minus the kept-weighted teacher-student gap);
  its gradient is the REINFORCE step above.

  Args:
    logprobs: [B, L] student (trainer) log-probs of batch.targets.
    batch: TrainBatch with loss_mask, old_logprobs (sampler) and teacher_logprobs.
    cfg: MopdConfig.
    norm: whole-batch denominators (default: from this batch).

  Returns:
    (loss, metrics); metrics add up over microbatches except '_max' keys.
  """
  if batch.teacher_logprobs is None:
    raise ValueError('mopd_loss needs batch.teacher_logprobs (fill it with '
                     'rl.distill.teacher_logprobs)')
  if norm is None:
    norm = normalizers(batch, cfg)
  mask = jnp.asarray(batch.loss_mask, jnp.float32)
  on = mask > 0
  student = jax.lax.stop_gradient(logprobs)
  adv = jnp.where(on, batch.teacher_logprobs - student, 0.0)
  log_w = jnp.where(on, student - batch.old_logprobs, 0.0)
  w = jnp.exp(log_w)
  kept = (w >= cfg.is_low) & (w <= cfg.is_high)
  weight = jnp.where(kept, w, 0.0)
  surrogate = weight * adv * jnp.exp(logprobs - student)
  tok_mean = lambda x: jnp.sum(x * mask) / norm['tokens']
  loss = -tok_mean(surrogate)
  return loss, {
      'advantage': tok_mean(adv),
      'is_kept_frac': tok_mean(kept.astype(jnp.float32)),
      'ratio_mean': tok_mean(w),
      'ratio_max': jnp.max(jnp.where(on, w, 0.0)),
      'entropy': tok_mean(-logprobs),
      'tokens': mask.sum(),
      **grpo.gap_metrics(student, batch.old_logprobs, mask, norm, (cfg.is_low, cfg.is_high)),
  }


def loss_fn(model, batch: batch_lib.TrainBatch, cfg: MopdConfig, norm: dict):
  """MOPD loss of an NNX student on a batch."""
  stats = batch_lib.policy_stats(model, batch, replay=cfg.replay_routing)
  return mopd_loss(stats['logprobs'], batch, cfg, norm)


def teacher_logprobs(graphdef, teachers: Sequence, teacher_index, batch: batch_lib.TrainBatch,
                     *, mesh=None, rules=None, rows_per_call: int | None = None) -> np.ndarray:
  """Each row's log-probs of its targets under its own teacher.

  Rows are grouped by teacher and each teacher runs one forward pass over
  its rows only (padded to a power of two by repeating a row).

  Args:
    graphdef: nnx GraphDef shared by the teachers (same architecture).
    teachers: list of teacher params (nnx.State), indexed by teacher_index.
    teacher_index: [B] int, row -> teacher.
    batch: the student's TrainBatch (tokens, positions, segment_ids, targets).
    mesh: optional mesh to run under.
    rules: logical rules for the mesh.
    rows_per_call: rows per forward pass of a teacher (`batch.compute_logprobs`).

  Returns:
    [B, L] float32 numpy, 0 where loss_mask is 0.
  """
  idx = np.asarray(teacher_index).reshape(-1)
  b = batch.tokens.shape[0]
  if idx.shape != (b,):
    raise ValueError(f'teacher_logprobs: teacher_index has {idx.shape[0]} rows, batch has {b}')
  if idx.size and (idx.min() < 0 or idx.max() >= len(teachers)):
    raise ValueError(f'teacher_logprobs: teacher_index in [{idx.min()}, {idx.max()}] but '
                     f'there are {len(teachers)} teachers')
  fields = ('tokens', 'positions', 'segment_ids', 'targets')
  host = {f: np.asarray(getattr(batch, f)) for f in fields}
  out = np.zeros(host['tokens'].shape, np.float32)
  for k in np.unique(idx):
    rows = np.flatnonzero(idx == k)
    padded = np.concatenate([rows, np.full(buckets.pow2(rows.size, hi=b) - rows.size, rows[0])])
    sub = batch_lib.TrainBatch(**{f: host[f][padded] for f in fields}, loss_mask=None)
    # A teacher kept in host memory comes onto the devices for its pass only.
    lp = batch_lib.compute_logprobs(graphdef, to_memory(teachers[k], 'device'), sub, mesh, rules,
                                    rows_per_call=rows_per_call)
    out[rows] = np.asarray(lp)[:rows.size]
  return out * np.asarray(batch.loss_mask, np.float32)


def to_memory(params, kind: str):
  """params with every array in memory `kind` ('device' or 'pinned_host'), same sharding."""
  def move(x):
    if not isinstance(x, jax.Array) or x.sharding.memory_kind == kind:
      return x
    return jax.device_put(x, x.sharding.with_memory_kind(kind))
  return jax.tree.map(move, params)
