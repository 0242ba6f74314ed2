"""Bradley-Terry reward model: a scalar head on the transformer's last real token.

`RewardModel` wraps a `Transformer` backbone (fresh, or an existing policy to
start from) and a linear head [D] -> 1 read at each row's last non-padding
token. Training minimises -log sigmoid(r_chosen - r_rejected) over preference
pairs; `score` is the jitted batched scorer and `make_text_scorer` the
host-side function the RLHF verifier receives (texts in, rewards out).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import config as config_lib
from models import sharding
from models import transformer
from rl import buckets


class RewardModel(nnx.Module):
  """Transformer backbone + linear scalar head on the last real token."""

  def __init__(self, cfg: config_lib.ModelConfig, rngs: nnx.Rngs,
               backbone: Optional[transformer.Transformer] = None):
    self.cfg = cfg
    self.backbone = transformer.Transformer(cfg, rngs=rngs) if backbone is None else backbone
    self.head = nnx.Param(
        jax.nn.initializers.normal(cfg.embed_dim ** -0.5)(rngs.params(), (cfg.embed_dim,),
                                                          jnp.float32),
        logical_axes=('embed',))

  @property
  def rules(self) -> sharding.Rules:
    """The logical rules the model traces with: its backbone's (`Transformer.rules`)."""
    return self.backbone.rules

  @rules.setter
  def rules(self, rules: sharding.Rules) -> None:
    self.backbone.rules = rules

  def __call__(self, tokens, positions=None, segment_ids=None) -> jax.Array:
    """Rewards [B] float32.

    Args:
      tokens: [B, T] int32, left- or right-padded.
      positions: [B, T] int32 (default: counted over the real tokens).
      segment_ids: [B, T] int32, 0 = padding (default: all real).
    """
    b, t = tokens.shape
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    real = segment_ids != 0
    if positions is None:
      positions = jnp.maximum(jnp.cumsum(real, 1) - 1, 0).astype(jnp.int32)
    hidden, _ = self.backbone.hidden(tokens, positions, segment_ids)
    last = jnp.max(jnp.where(real, jnp.arange(t), 0), axis=1)          # [B]
    h = jnp.take_along_axis(hidden, last[:, None, None], 1)[:, 0]       # [B, D]
    return jnp.einsum('BD,D->B', h.astype(jnp.float32), self.head[...])


def create(cfg: config_lib.ModelConfig, seed: int = 0,
           backbone: Optional[transformer.Transformer] = None) -> RewardModel:
  """A RewardModel with a fresh head (and a fresh backbone unless one is given)."""
  return RewardModel(cfg, nnx.Rngs(seed), backbone)


class PairBatch(NamedTuple):
  """Preference pairs; row i of chosen is preferred to row i of rejected.

  Attributes:
    chosen_tokens: [B, T] int32.
    chosen_segment_ids: [B, T] int32, 0 = padding.
    rejected_tokens: [B, T] int32.
    rejected_segment_ids: [B, T] int32.
  """
  chosen_tokens: jax.Array
  chosen_segment_ids: jax.Array
  rejected_tokens: jax.Array
  rejected_segment_ids: jax.Array


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
  """The Bradley-Terry loss has no settings."""


def normalizers(batch: PairBatch, cfg) -> dict[str, jax.Array]:
  """{'pairs': number of pairs in the whole batch}."""
  del cfg
  return {'pairs': jnp.asarray(batch.chosen_tokens.shape[0], jnp.float32)}


def bradley_terry_loss(chosen: jax.Array, rejected: jax.Array, norm: Optional[dict] = None):
  """-mean log sigmoid(r_c - r_r), pairwise accuracy and the mean margin.

  Args:
    chosen: [B] rewards of the preferred responses.
    rejected: [B] rewards of the others.
    norm: whole-batch {'pairs'} (default: B).

  Returns:
    (loss, metrics {'accuracy', 'margin', 'reward_mean'}); metrics add up
    over microbatches.
  """
  pairs = chosen.shape[0] if norm is None else norm['pairs']
  margin = chosen - rejected
  loss = -jnp.sum(jax.nn.log_sigmoid(margin)) / pairs
  return loss, {'accuracy': jnp.sum((margin > 0).astype(jnp.float32)) / pairs,
                'margin': jnp.sum(margin) / pairs,
                'reward_mean': jnp.sum(chosen + rejected) / (2 * pairs)}


def loss_fn(model: RewardModel, batch: PairBatch, cfg, norm: dict):
  """Bradley-Terry loss of a RewardModel on a PairBatch (both sides in one forward pass)."""
  del cfg
  tokens = jnp.concatenate([batch.chosen_tokens, batch.rejected_tokens], 0)
  seg = jnp.concatenate([batch.chosen_segment_ids, batch.rejected_segment_ids], 0)
  r = model(tokens, segment_ids=seg)
  b = batch.chosen_tokens.shape[0]
  return bradley_terry_loss(r[:b], r[b:], norm)


@functools.partial(jax.jit, static_argnums=0, static_argnames=('rules',))
def score(graphdef, params, tokens, segment_ids, *,
          rules: sharding.Rules = sharding.DEFAULT_RULES) -> jax.Array:
  """Jitted batched scoring: rewards [B] of rows tokens/segment_ids [B, T], traced with the
  logical `rules`."""
  model = nnx.merge(graphdef, params)
  model.rules = rules
  return model(tokens, segment_ids=segment_ids)


def encode(tokenizer, prompt: str, completion: str, max_len: int) -> list[int]:
  """Token ids of prompt + completion + EOS, at most max_len, the prompt kept whole.

  The prompt is chat-rendered: its markers are the structure and become
  their special ids. The completion is the policy's text, encoded with
  `encode_text`: a `<|im_end|>` or `<|im_start|>user` it writes stays text
  and cannot end the answer or open a turn in the reward model's view. When
  the row is too long the completion's end is cut, never the prompt, so a
  long answer cannot push what was asked out of view; only a prompt that
  alone leaves no room keeps its last max_len - 1 tokens (and no answer).
  Training pairs and verifier scoring must both use this.

  Args:
    tokenizer: has encode, encode_text and eos_id.
    prompt: the chat-rendered prompt.
    completion: the text scored after it.
    max_len: most tokens of the row.

  Returns:
    The ids, ending with EOS (the scored position).
  """
  head = list(tokenizer.encode(prompt))
  room = max_len - 1 - len(head)
  if room < 0:
    return head[len(head) - (max_len - 1):] + [tokenizer.eos_id]
  return head + list(tokenizer.encode_text(completion))[:room] + [tokenizer.eos_id]


def row_length(longest: int, max_len: int) -> int:
  """The padded length of a batch whose longest row has `longest` tokens: a power of two
  >= 16, at most max_len."""
  return buckets.pow2(longest, lo=16, hi=max_len)


def pad_rows(rows: Sequence[Sequence[int]], length: int, pad_id: int):
  """Right-pads token lists to [len(rows), length]; returns (tokens, segment_ids) int32."""
  tokens = np.full((len(rows), length), pad_id, np.int32)
  seg = np.zeros((len(rows), length), np.int32)
  for i, r in enumerate(rows):
    if len(r) > length:
      raise ValueError(f'pad_rows: row {i} has {len(r)} tokens > length {length}')
    tokens[i, :len(r)] = r
    seg[i, :len(r)] = 1
  return tokens, seg


def make_pair_batch(tokenizer, prompts: Sequence[str], chosen: Sequence[str],
                    rejected: Sequence[str], max_len: int) -> PairBatch:
  """Encodes preference pairs (see `encode`) into a PairBatch padded to one length bucket."""
  if not len(prompts) == len(chosen) == len(rejected):
    raise ValueError(f'make_pair_batch: {len(prompts)} prompts, {len(chosen)} chosen, '
                     f'{len(rejected)} rejected')
  c = [encode(tokenizer, p, x, max_len) for p, x in zip(prompts, chosen)]
  r = [encode(tokenizer, p, x, max_len) for p, x in zip(prompts, rejected)]
  length = row_length(max(map(len, c + r)), max_len)
  ct, cs = pad_rows(c, length, tokenizer.pad_id)
  rt, rs = pad_rows(r, length, tokenizer.pad_id)
  return PairBatch(ct, cs, rt, rs)


def rows_per_call(length: int, batch_size: int, call_tokens: int | None) -> int:
  """Rows of a scoring call at padded `length`: `batch_size`, fewer where that would pass
  `call_tokens` tokens (at least one row)."""
  if call_tokens is None:
    return batch_size
  return max(1, min(batch_size, call_tokens // length))


def make_text_scorer(model: RewardModel, tokenizer, max_len: int, batch_size: int,
                     call_tokens: int | None = None
                     ) -> Callable[[Sequence[str], Sequence[str]], np.ndarray]:
  """A host function scoring (prompt, completion) texts with the reward model.

  The params are snapshotted now. Texts are encoded with `encode` and scored
  in order, in calls of `rows_per_call` rows (the last padded with copies),
  each padded to the power-of-two length bucket of its longest row, so few
  shapes compile. With `call_tokens` a call holds at most that many tokens
  (at least one row): rows longer than the model was trained on go fewer to a
  call, so a call's memory stays near a training call's.

  Args:
    model: a RewardModel.
    tokenizer: has encode(text) -> list[int], pad_id and eos_id.
    max_len: most tokens scored per text (the answer's end is cut first, see `encode`).
    batch_size: the most rows per jitted call.
    call_tokens: the most tokens (rows x padded length) per call; None: no bound.

  Returns:
    scorer(prompts, completions) -> float32 [n] rewards.
  """
  graphdef, params = nnx.split(model)

  def scorer(prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
    if len(prompts) != len(completions):
      raise ValueError(f'reward scorer: {len(prompts)} prompts but {len(completions)} completions')
    rows = [encode(tokenizer, p, c, max_len) for p, c in zip(prompts, completions)]
    out = np.zeros(len(rows), np.float32)
    start = 0
    while start < len(rows):
      # The call's rows: the most of the next ones that fit the budget at the length bucket
      # of the longest among them (fewer rows never need a longer bucket).
      longest = len(rows[start])
      length = row_length(longest, max_len)
      n = 1
      while n < min(batch_size, len(rows) - start):
        longer = max(longest, len(rows[start + n]))
        wider = row_length(longer, max_len)
        if rows_per_call(wider, batch_size, call_tokens) < n + 1:
          break
        longest, length, n = longer, wider, n + 1
      fit = rows_per_call(length, batch_size, call_tokens)
      chunk = rows[start:start + n]
      full = chunk + [chunk[0]] * (fit - len(chunk))
      tokens, seg = pad_rows(full, length, tokenizer.pad_id)
      out[start:start + len(chunk)] = np.asarray(score(graphdef, params, tokens, seg))[:len(chunk)]
      start += len(chunk)
    return out

  return scorer
