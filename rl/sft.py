"""Supervised fine-tuning: masked next-token cross-entropy, and packing examples into rows.

An example is (tokens, mask) with mask 1 on the assistant tokens to learn
(the prompt and chat scaffolding get 0). Several examples share one row of
`row_len` tokens: each gets its own segment id (1, 2, ...) and positions that
restart at 0, so the model's segment mask keeps them from attending to each
other and the packed loss of every example equals its unpacked loss.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl import batch as batch_lib


@dataclasses.dataclass(frozen=True)
class SftConfig:
  """SFT has no settings: the loss is the token-level mean cross-entropy over learned tokens."""


def pack(examples: Sequence[tuple[Sequence[int], Sequence[int]]], row_len: int, *,
         num_rows: Optional[int] = None, pad_id: int = 0) -> batch_lib.TrainBatch:
  """Packs examples into rows of `row_len` tokens (first fit, in order).

  Args:
    examples: (tokens, mask) pairs; mask[i] = 1 if tokens[i] is learned.
      Token 0 of an example is never a target (nothing predicts it).
    row_len: L, tokens per row.
    num_rows: pad to exactly this many rows (an error if more are needed);
      default: as many rows as the packing takes.
    pad_id: token id of padding.

  Returns:
    A TrainBatch of numpy arrays [R, L]: tokens, positions (restarting per
    example), segment_ids (1.. per row, 0 = padding), targets and loss_mask
    (next token within the same example only).
  """
  rows: list[list[int]] = []     # example indices per row
  room: list[int] = []
  for i, (toks, mask) in enumerate(examples):
    if len(toks) != len(mask):
      raise ValueError(f'pack: example {i} has {len(toks)} tokens but {len(mask)} mask entries')
    if not 0 < len(toks) <= row_len:
      raise ValueError(f'pack: example {i} has {len(toks)} tokens; must be 1..row_len={row_len}')
    for r, free in enumerate(room):
      if free >= len(toks):
        rows[r].append(i)
        room[r] -= len(toks)
        break
    else:
      rows.append([i])
      room.append(row_len - len(toks))
  n = len(rows) if num_rows is None else num_rows
  if len(rows) > n:
    raise ValueError(f'pack: {len(examples)} examples need {len(rows)} rows of {row_len} '
                     f'tokens; num_rows={num_rows}')
  tokens = np.full((n, row_len), pad_id, np.int32)
  seg = np.zeros((n, row_len), np.int32)
  targets = np.zeros((n, row_len), np.int32)
  loss_mask = np.zeros((n, row_len), np.float32)
  for r, members in enumerate(rows):
    t = 0
    for s, i in enumerate(members, start=1):
      toks = np.asarray(examples[i][0], np.int32)
      mask = np.asarray(examples[i][1], np.float32)
      k = len(toks)
      tokens[r, t:t + k] = toks
      seg[r, t:t + k] = s
      targets[r, t:t + k - 1] = toks[1:]
      loss_mask[r, t:t + k - 1] = mask[1:]
      t += k
  return batch_lib.TrainBatch(tokens=tokens, positions=batch_lib.positions_from_segments(seg),
                              segment_ids=seg, targets=targets, loss_mask=loss_mask)


def normalizers(batch: batch_lib.TrainBatch, cfg) -> dict[str, jax.Array]:
  """{'tokens': learned tokens in the whole batch (>= 1)}."""
  del cfg
  return {'tokens': jnp.maximum(jnp.sum(jnp.asarray(batch.loss_mask, jnp.float32)), 1.0)}


def sft_loss(logprobs: jax.Array, batch: batch_lib.TrainBatch, cfg: SftConfig,
             norm: Optional[dict] = None):
  """Mean negative log-likelihood of the learned tokens.

  Args:
    logprobs: [B, L] log-probs of batch.targets.
    batch: TrainBatch (loss_mask is read).
    cfg: SftConfig.
    norm: whole-batch denominators (default: from this batch).

  Returns:
    (loss, metrics {'nll', 'tokens'}); metrics add up over microbatches.
  """
  if norm is None:
    norm = normalizers(batch, cfg)
  mask = jnp.asarray(batch.loss_mask, jnp.float32)
  loss = -jnp.sum(logprobs * mask) / norm['tokens']
  return loss, {'nll': loss, 'tokens': mask.sum()}


def loss_fn(model, batch: batch_lib.TrainBatch, cfg: SftConfig, norm: dict):
  """SFT loss of an NNX policy on a batch, plus next-token accuracy."""
  stats = batch_lib.policy_stats(model, batch, argmax=True)
  loss, metrics = sft_loss(stats['logprobs'], batch, cfg, norm)
  mask = jnp.asarray(batch.loss_mask, jnp.float32)
  correct = (stats['argmax'] == batch.targets).astype(jnp.float32)
  metrics['accuracy'] = jnp.sum(correct * mask) / norm['tokens']
  return loss, metrics
