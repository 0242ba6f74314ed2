"""DPO: offline Direct Preference Optimisation (Rafailov et al. 2023, arXiv 2305.18290).

A pair is one prompt with a chosen and a rejected response. With the
policy's and the frozen reference's summed response log-probs

  h = (log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))

the 'sigmoid' loss is the DPO loss -log sigmoid(beta h), with conservative
label smoothing eps (cDPO: the label is wrong with probability eps)

  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h),

and the 'ipo' loss is IPO's (h - 1 / (2 beta))^2 (Azar et al. 2023,
arXiv 2310.12036). The implicit reward of a response is beta (log pi -
log ref); the metrics report its mean on both sides, their margin and how
often the chosen one wins.

Usage (the reference log-probs are computed once per batch, before the step):

  batch = dpo.make_batch(tokenizer, prompts, chosen, rejected, max_len=512)
  ref_c, ref_r = dpo.reference_logps(graphdef, ref_params, batch)
  batch = batch._replace(ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)
  loss = train_step.LossSpec(dpo.DpoConfig, dpo.loss_fn, dpo.normalizers)
  step = train_step.make_train_step(graphdef, loss, dpo.DpoConfig(beta=0.1), optimizer)

Both sides of a pair are rows of the same length; every field of a
`DpoBatch` has the pair axis first, so the train step splits pairs over the
mesh's 'batch' axis and over microbatches. The loss is a sum over pairs
divided by the whole batch's pair count, so microbatches add up to exactly
the full-batch loss and gradient.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl import batch as batch_lib
from rl import buckets

LOSS_TYPES = ('sigmoid', 'ipo')
SIDES = ('chosen', 'rejected')
_ROW_FIELDS = ('tokens', 'positions', 'segment_ids', 'targets', 'loss_mask')


@dataclasses.dataclass(frozen=True)
class DpoConfig:
  """DPO loss settings.

  Attributes:
    beta: inverse temperature of the implicit reward (strength of the
      implicit KL to the reference); > 0.
    label_smoothing: cDPO's probability that a preference label is flipped,
      in [0, 0.5); 0 is plain DPO. 'sigmoid' only.
    loss_type: 'sigmoid' (DPO) or 'ipo'.
  """
  beta: float = 0.1
  label_smoothing: float = 0.0
  loss_type: str = 'sigmoid'

  def __post_init__(self):
    if not self.beta > 0:
      raise ValueError(f'DpoConfig.beta={self.beta} must be > 0')
    if not 0 <= self.label_smoothing < 0.5:
      raise ValueError(f'DpoConfig.label_smoothing={self.label_smoothing} must be in [0, 0.5)')
    if self.loss_type not in LOSS_TYPES:
      raise ValueError(f'DpoConfig.loss_type={self.loss_type!r}: expected one of {LOSS_TYPES}')
    if self.loss_type == 'ipo' and self.label_smoothing:
      raise ValueError('DpoConfig.label_smoothing applies to the sigmoid loss only, not ipo')


class DpoBatch(NamedTuple):
  """Preference pairs: row i of chosen_* is preferred to row i of rejected_*.

  Each side's rows are laid out like a `TrainBatch` (targets and loss_mask
  aligned to the token each column predicts; loss_mask is 1 on response
  tokens only, the prompt is context).

  Attributes:
    chosen_tokens: [B, L] int32 prompt ++ chosen response, right-padded.
    chosen_positions: [B, L] int32.
    chosen_segment_ids: [B, L] int32, 1 on real tokens, 0 = padding.
    chosen_targets: [B, L] int32 next token (0 where none).
    chosen_loss_mask: [B, L] float32, 1 where the target is a response token.
    rejected_tokens: [B, L] int32 prompt ++ rejected response, right-padded.
    rejected_positions: [B, L] int32.
    rejected_segment_ids: [B, L] int32.
    rejected_targets: [B, L] int32.
    rejected_loss_mask: [B, L] float32.
    ref_chosen_logps: [B] float32 reference log pi_ref(chosen | prompt).
    ref_rejected_logps: [B] float32 reference log pi_ref(rejected | prompt).
  """
  chosen_tokens: jax.Array
  chosen_positions: jax.Array
  chosen_segment_ids: jax.Array
  chosen_targets: jax.Array
  chosen_loss_mask: jax.Array
  rejected_tokens: jax.Array
  rejected_positions: jax.Array
  rejected_segment_ids: jax.Array
  rejected_targets: jax.Array
  rejected_loss_mask: jax.Array
  ref_chosen_logps: jax.Array
  ref_rejected_logps: jax.Array


def side(batch: DpoBatch, name: str) -> batch_lib.TrainBatch:
  """One side ('chosen' or 'rejected') of the pairs as a TrainBatch [B, L]."""
  if name not in SIDES:
    raise ValueError(f'side {name!r}: expected one of {SIDES}')
  return batch_lib.TrainBatch(**{f: getattr(batch, f'{name}_{f}') for f in _ROW_FIELDS})


# ---------------------------------------------------------------- host-side batches

def encode(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
  """Token ids of a chat-rendered prompt and of its response, which ends with EOS.

  The two texts are encoded separately (as SFT examples are), so the
  prompt / response boundary is exact; EOS is appended unless the response
  already ends with it (e.g. a `chat.render_response` text ending in
  <|im_end|>).
  """
  prompt_ids = list(tokenizer.encode(prompt))
  response_ids = list(tokenizer.encode(response))
  if not response_ids or response_ids[-1] != tokenizer.eos_id:
    response_ids.append(tokenizer.eos_id)
  return prompt_ids, response_ids


def _rows(pairs: Sequence[tuple[list[int], list[int]]], length: int, num_rows: int,
          pad_id: int) -> dict[str, np.ndarray]:
  """Right-padded [num_rows, length] row fields of (prompt, response) pairs; extra rows empty."""
  tokens = np.full((num_rows, length), pad_id, np.int32)
  seg = np.zeros((num_rows, length), np.int32)
  targets = np.zeros((num_rows, length), np.int32)
  mask = np.zeros((num_rows, length), np.float32)
  for i, (p, r) in enumerate(pairs):
    row = np.asarray(p + r, np.int32)
    n = row.size
    tokens[i, :n] = row
    seg[i, :n] = 1
    targets[i, :n - 1] = row[1:]
    # Target column t predicts token t + 1: the response is columns len(p) - 1 .. n - 2.
    mask[i, len(p) - 1:n - 1] = 1.0
  return dict(tokens=tokens, positions=batch_lib.positions_from_segments(seg), segment_ids=seg,
              targets=targets, loss_mask=mask)


def make_batch(tokenizer, prompts: Sequence[str], chosen: Sequence[str],
               rejected: Sequence[str], max_len: int, *,
               num_pairs: Optional[int] = None) -> DpoBatch:
  """Encodes preference pairs into a DpoBatch (reference log-probs still zero).

  Rows are prompt ++ response ++ EOS (see `encode`), right-padded to one
  length bucket (a power of two >= 16, at most max_len) shared by both
  sides. A pair too long for max_len loses the beginning of its prompt first
  (both sides keep the same prompt tokens, at least one), then the end of
  its responses.

  Args:
    tokenizer: has encode(text) -> list[int], pad_id and eos_id.
    prompts: chat-rendered prompt texts (e.g. `chat.render(messages)`).
    chosen: the preferred response texts.
    rejected: the other response texts.
    max_len: most tokens per row (>= 2).
    num_pairs: pad to exactly this many pairs with empty pairs (no tokens,
      no loss), e.g. to a multiple of microbatches x batch shards; default:
      len(prompts).

  Returns:
    A DpoBatch of numpy arrays with B pairs and ref_*_logps = 0.
  """
  if not len(prompts) == len(chosen) == len(rejected):
    raise ValueError(f'dpo.make_batch: {len(prompts)} prompts, {len(chosen)} chosen, '
                     f'{len(rejected)} rejected')
  if max_len < 2:
    raise ValueError(f'dpo.make_batch: max_len={max_len} must be >= 2')
  b = len(prompts) if num_pairs is None else num_pairs
  if b < len(prompts):
    raise ValueError(f'dpo.make_batch: {len(prompts)} pairs but num_pairs={num_pairs}')
  sides = {'chosen': [], 'rejected': []}
  for i, (p_text, c_text, r_text) in enumerate(zip(prompts, chosen, rejected)):
    p, c = encode(tokenizer, p_text, c_text)
    _, r = encode(tokenizer, p_text, r_text)
    if not p:
      raise ValueError(f'dpo.make_batch: pair {i} has an empty prompt; the first response '
                       'token needs a token before it')
    keep = max(1, min(len(p), max_len - max(len(c), len(r))))
    p = p[len(p) - keep:]
    sides['chosen'].append((p, c[:max_len - keep]))
    sides['rejected'].append((p, r[:max_len - keep]))
  longest = max((len(p) + len(r) for rows in sides.values() for p, r in rows), default=1)
  length = buckets.pow2(longest, lo=16, hi=max_len)
  fields = {}
  for name, pairs in sides.items():
    for f, x in _rows(pairs, length, b, tokenizer.pad_id).items():
      fields[f'{name}_{f}'] = x
  zeros = np.zeros(b, np.float32)
  return DpoBatch(**fields, ref_chosen_logps=zeros, ref_rejected_logps=zeros.copy())


# ---------------------------------------------------------------- log-probs

def _masked_sum(logprobs: jax.Array, mask: jax.Array) -> jax.Array:
  """Sum over a row's loss tokens: [B, L] -> [B] (padding's values never leak in)."""
  return jnp.sum(jnp.where(mask > 0, logprobs, 0.0), axis=-1)


def sequence_logps(model, batch: DpoBatch) -> tuple[jax.Array, jax.Array]:
  """The model's summed response log-probs of both sides, in one forward pass over 2B rows.

  Args:
    model: an NNX policy (`model(tokens, positions, segment_ids) -> logits`).
    batch: a DpoBatch.

  Returns:
    (chosen [B], rejected [B]) float32 log pi(response | prompt).
  """
  both = jax.tree.map(lambda c, r: jnp.concatenate([jnp.asarray(c), jnp.asarray(r)], 0),
                      side(batch, 'chosen'), side(batch, 'rejected'))
  logps = _masked_sum(batch_lib.policy_stats(model, both)['logprobs'], both.loss_mask)
  b = batch.chosen_tokens.shape[0]
  return logps[:b], logps[b:]


def reference_logps(graphdef, params, batch: DpoBatch, mesh=None, rules=None, *,
                    rows_per_call: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
  """The frozen reference's summed response log-probs of both sides of every pair.

  Each call of the jitted `batch.compute_logprobs` forward pass sees
  `rows_per_call` rows of one side (the last chunk padded by repeating a
  row), so memory is bounded by that many rows whatever the batch size, and
  one shape compiles.

  Args:
    graphdef: nnx GraphDef of the reference model.
    params: its nnx.State (usually the policy's params at the start of the stage).
    batch: a DpoBatch (its ref_* fields are ignored).
    mesh: optional mesh to run under.
    rules: logical rules for the mesh.
    rows_per_call: rows per forward pass (default: all B rows of one side).

  Returns:
    (ref_chosen_logps [B], ref_rejected_logps [B]) float32 numpy.
  """
  b = batch.chosen_tokens.shape[0]
  k = b if rows_per_call is None else rows_per_call
  if k < 1:
    raise ValueError(f'dpo.reference_logps: rows_per_call={rows_per_call} must be >= 1')
  out = []
  for name in SIDES:
    rows = side(batch, name)
    lp = batch_lib.compute_logprobs(graphdef, params, rows, mesh, rules, rows_per_call=k)
    out.append(np.asarray(_masked_sum(jnp.asarray(lp), jnp.asarray(rows.loss_mask)),
                          np.float32))
  return out[0], out[1]


# ---------------------------------------------------------------- loss

def pair_valid(batch: DpoBatch) -> jax.Array:
  """[B] float32: 1 for pairs with response tokens on both sides (0 for padding pairs)."""
  has = lambda m: jnp.any(jnp.asarray(m) > 0, axis=-1)
  return (has(batch.chosen_loss_mask) & has(batch.rejected_loss_mask)).astype(jnp.float32)


def normalizers(batch: DpoBatch, cfg) -> dict[str, jax.Array]:
  """{'pairs': real pairs in the whole batch (>= 1)}."""
  del cfg
  return {'pairs': jnp.maximum(jnp.sum(pair_valid(batch)), 1.0)}


def dpo_loss(chosen_logps: jax.Array, rejected_logps: jax.Array, ref_chosen_logps: jax.Array,
             ref_rejected_logps: jax.Array, cfg: DpoConfig, norm: Optional[dict] = None,
             valid: Optional[jax.Array] = None):
  """The DPO (or IPO) loss of per-pair summed log-probs, averaged over the batch's pairs.

  Args:
    chosen_logps: [B] policy log pi(y_c | x) (differentiable).
    rejected_logps: [B] policy log pi(y_r | x).
    ref_chosen_logps: [B] reference log-probs of the chosen responses.
    ref_rejected_logps: [B] reference log-probs of the rejected responses.
    cfg: DpoConfig.
    norm: whole-batch {'pairs'} (default: the valid pairs here).
    valid: [B] 1 for real pairs, 0 for padding (default: all real).

  Returns:
    (loss, metrics) with metrics 'accuracy' (chosen's implicit reward is
    higher), 'chosen_reward', 'rejected_reward' (mean beta (log pi - log
    ref)), 'margin' (their mean difference), 'chosen_logps',
    'rejected_logps' (mean policy log-probs) and 'pairs'; all add up over
    microbatches.
  """
  valid = jnp.ones_like(chosen_logps) if valid is None else jnp.asarray(valid, jnp.float32)
  pairs = jnp.maximum(jnp.sum(valid), 1.0) if norm is None else norm['pairs']
  chosen_ratio = chosen_logps - ref_chosen_logps
  rejected_ratio = rejected_logps - ref_rejected_logps
  h = chosen_ratio - rejected_ratio
  if cfg.loss_type == 'sigmoid':
    z = cfg.beta * h
    eps = cfg.label_smoothing
    per_pair = -(1.0 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)
  else:
    per_pair = (h - 1.0 / (2.0 * cfg.beta)) ** 2
  mean = lambda x: jnp.sum(x * valid) / pairs
  chosen_reward = cfg.beta * chosen_ratio
  rejected_reward = cfg.beta * rejected_ratio
  return mean(per_pair), {
      'accuracy': mean((chosen_reward > rejected_reward).astype(jnp.float32)),
      'chosen_reward': mean(chosen_reward),
      'rejected_reward': mean(rejected_reward),
      'margin': mean(chosen_reward - rejected_reward),
      'chosen_logps': mean(chosen_logps),
      'rejected_logps': mean(rejected_logps),
      'pairs': jnp.sum(valid),
  }


def loss_fn(model, batch: DpoBatch, cfg: DpoConfig, norm: dict):
  """DPO loss of an NNX policy on a DpoBatch (both sides in one forward pass)."""
  chosen, rejected = sequence_logps(model, batch)
  return dpo_loss(chosen, rejected, batch.ref_chosen_logps, batch.ref_rejected_logps, cfg,
                  norm, pair_valid(batch))
