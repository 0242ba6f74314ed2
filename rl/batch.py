"""Training batches: the token layout every loss reads, and per-token log-probs over it.

A `TrainBatch` holds full rows (prompt ++ completion for RL, packed examples
for SFT) with everything aligned to *target* columns: column t of `targets`,
`loss_mask`, `old_logprobs`, `ref_logprobs`, `teacher_logprobs` and `trainer_logprobs` describes
the token at column t + 1, which the logits at column t predict. So

  logits = model(batch.tokens, batch.positions, batch.segment_ids)   # [B, L, V]
  logprobs = token_logprobs(logits, batch.targets)                    # [B, L]

lines up with every other per-token field, and `loss_mask` is 1 exactly on the
completion (or assistant) tokens being learned.

RL rows come from the sampler's `SampleOutput` through `from_samples`: the
left-padded prompt [B, P] and the completion [B, N] are concatenated into
[B, P + N]; since the prompt is left-padded the real tokens are contiguous.

One field is aligned with the *input* columns instead: `routing`, the experts
the sampler's forward sent each token to (a mixture-of-experts policy's
rollouts recorded with `record_routing`), which the policy's training forward
replays (`policy_stats`): column t holds the experts of `tokens[:, t]`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import context
from models import sharding


class TrainBatch(NamedTuple):
  """Rows of tokens with target-aligned per-token fields; a pytree.

  Attributes:
    tokens: [B, L] int32 input tokens.
    positions: [B, L] int32 RoPE positions (restart at 0 in every segment).
    segment_ids: [B, L] int32; 0 = padding, packed examples count 1, 2, ...
    targets: [B, L] int32, the token each column predicts (tokens shifted
      left by one inside a segment; 0 where there is none).
    loss_mask: [B, L] float32, 1 where targets[t] is a token to learn.
    old_logprobs: [B, L] float32 sampler log-probs of targets (RL only).
    advantages: [B] float32 one advantage per row (GRPO only).
    truncated: [B] bool, the completion hit the length limit (RL only).
    teacher_index: [B] int32 teacher / domain of each row (MOPD only).
    ref_logprobs: [B, L] float32 reference-policy log-probs of targets
      (GRPO with a KL term only).
    teacher_logprobs: [B, L] float32 teacher log-probs of targets (MOPD only).
    routing: [B, L, M, k] int (uint8 for up to 256 experts) the experts the sampler
      routed each *input* token (tokens[:, t], not targets) to in each of the policy's M
      'moe' sublayers (routing replay; 0 on padding); None when not recorded.
    trainer_logprobs: [B, L] float32 the trainer's log-probs of targets under the params
      that sampled the batch, computed before its first update (GRPO's sampler/trainer
      mismatch correction with several updates per rollout batch only).
  """
  tokens: jax.Array
  positions: jax.Array
  segment_ids: jax.Array
  targets: jax.Array
  loss_mask: jax.Array
  old_logprobs: Optional[jax.Array] = None
  advantages: Optional[jax.Array] = None
  truncated: Optional[jax.Array] = None
  teacher_index: Optional[jax.Array] = None
  ref_logprobs: Optional[jax.Array] = None
  teacher_logprobs: Optional[jax.Array] = None
  routing: Optional[jax.Array] = None
  trainer_logprobs: Optional[jax.Array] = None

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]


def positions_from_segments(segment_ids) -> np.ndarray:
  """Positions that restart at 0 at every segment change; 0 on padding.

  Args:
    segment_ids: [B, L] int, 0 = padding.

  Returns:
    [B, L] int32.
  """
  seg = np.asarray(segment_ids)
  idx = np.broadcast_to(np.arange(seg.shape[1]), seg.shape)
  change = np.concatenate([np.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)
  start = np.maximum.accumulate(np.where(change, idx, 0), axis=1)
  pos = idx - start
  return np.where(seg != 0, pos, 0).astype(np.int32)


def from_samples(samples, advantages, *, valid=None, teacher_index=None) -> TrainBatch:
  """Turns a sampler `SampleOutput` and per-row advantages into a `TrainBatch`.

  Row layout: tokens = prompt [P] ++ completion [N]. The logits at the last
  prompt column predict completion token 0, so the completion's mask, tokens
  and log-probs move one column left in target alignment.

  `old_logprobs` are the sampler's `logprobs` (the unmodified policy, as the
  trainer computes them), not `sampling_logprobs`: the importance ratio then
  measures only sampler/trainer mismatch and is 1 on-policy at any
  temperature or top-p.

  Args:
    samples: a `rl.sampler.SampleOutput` (or any object with its fields):
      prompt_tokens/prompt_mask [B, P] left-padded, tokens/mask/logprobs [B, N],
      truncated [B]; optionally policy_mask [B, N] (agentic episodes): only
      those tokens are learned, the rest of `mask` is context; and prompt_routing
      [B, P, M, k] with routing [B, N, M, k] (recorded routing): the batch's `routing`.
    advantages: [B] float, one per row (zeros for losses that need none).
    valid: optional [B] bool; rows that are False get an all-zero loss mask
      (used to pad a batch to a fixed size).
    teacher_index: optional [B] int, each row's teacher / domain (MOPD).

  Returns:
    A TrainBatch of numpy arrays, L = P + N.
  """
  prompt = np.asarray(samples.prompt_tokens, np.int32)
  prompt_mask = np.asarray(samples.prompt_mask, np.int32)
  comp = np.asarray(samples.tokens, np.int32)
  comp_mask = np.asarray(samples.mask, np.int32)
  logprobs = np.asarray(samples.logprobs, np.float32)
  b, p = prompt.shape
  if p < 1:
    raise ValueError('from_samples: prompt_tokens has 0 columns; every row needs a prompt token')
  if comp.shape[0] != b or comp_mask.shape != comp.shape or logprobs.shape != comp.shape:
    raise ValueError(f'from_samples: shapes disagree: prompt_tokens {prompt.shape}, tokens '
                     f'{comp.shape}, mask {comp_mask.shape}, logprobs {logprobs.shape}')
  advantages = np.asarray(advantages, np.float32).reshape(-1)
  if advantages.shape != (b,):
    raise ValueError(f'from_samples: advantages has shape {advantages.shape}, expected ({b},)')

  tokens = np.concatenate([prompt, comp], 1)
  seg = np.concatenate([prompt_mask, comp_mask], 1)
  positions = np.maximum(np.cumsum(seg, 1) - 1, 0) * seg
  targets = np.concatenate([tokens[:, 1:], np.zeros((b, 1), np.int32)], 1)
  # Target column t holds completion token t - (P - 1).
  shift = lambda x, fill: np.concatenate(
      [np.full((b, p - 1), fill, x.dtype), x, np.full((b, 1), fill, x.dtype)], 1)
  # Multi-turn episodes (`cascade.episodes`) learn only the tokens the policy sampled; their
  # observation tokens are present (mask 1, attended to) but carry no loss.
  policy = getattr(samples, 'policy_mask', None)
  if policy is not None and np.shape(policy) != comp.shape:
    raise ValueError(f'from_samples: policy_mask has shape {np.shape(policy)}, '
                     f'expected {comp.shape}')
  learned = comp_mask if policy is None else np.asarray(policy, np.int32) * comp_mask
  loss_mask = shift(learned.astype(np.float32), 0.0)
  if valid is not None:
    loss_mask = loss_mask * np.asarray(valid, np.float32).reshape(b, 1)
  targets = np.where(shift(comp_mask, 0) > 0, targets, 0)
  truncated = np.asarray(getattr(samples, 'truncated', np.zeros(b, bool)), bool)
  routing = None
  if getattr(samples, 'routing', None) is not None:
    head, tail = np.asarray(samples.prompt_routing), np.asarray(samples.routing)
    if (head.shape[:2] != (b, p) or tail.shape[:2] != comp.shape
        or head.shape[2:] != tail.shape[2:]):
      raise ValueError(f'from_samples: prompt_routing {head.shape} and routing {tail.shape} do '
                       f'not line up with prompt_tokens {prompt.shape} and tokens {comp.shape}')
    routing = np.concatenate([head, tail], 1)
  return TrainBatch(
      tokens=tokens, positions=positions.astype(np.int32), segment_ids=seg.astype(np.int32),
      targets=targets.astype(np.int32), loss_mask=loss_mask,
      old_logprobs=shift(logprobs, 0.0), advantages=advantages, truncated=truncated,
      teacher_index=None if teacher_index is None else np.asarray(teacher_index, np.int32),
      routing=routing)


def packed_rows(rows: int, rows_multiple: int = 1) -> int:
  """The row count `pack` gives a batch whose sequences fill `rows` packed rows: rounded up to
  a power of two or three quarters of one (1, 2, 3, 4, 6, 8, 12, ...), so few shapes compile,
  then to a multiple of `rows_multiple`."""
  count = max(1, int(rows))
  bucket = 1 << (count - 1).bit_length()            # a power of two, or 3/4 of one
  if bucket >= 4 and 3 * bucket // 4 >= count:
    bucket = 3 * bucket // 4
  return -(-bucket // rows_multiple) * rows_multiple


def packed_width(row_tokens: int, longest: int) -> int:
  """The width `pack` gives its rows: `row_tokens`, or the power of two that holds the longest
  sequence when that is longer."""
  return int(row_tokens) if longest <= row_tokens else 1 << (longest - 1).bit_length()


def pack(batch: TrainBatch, row_tokens: int, *, rows_multiple: int = 1) -> TrainBatch:
  """Packs a batch's sequences into rows of `row_tokens` tokens (several per row).

  With long-tailed response lengths most of a padded RL batch (every row
  prompt + max response wide) is padding; packed, the update's FLOPs follow
  the real tokens. Sequences are placed longest first, each into the first
  row with room (first-fit decreasing); each keeps its positions (and its
  recorded `routing`) and gets its own segment id in its row, so attention
  never crosses sequences. Per-row
  fields become per-token ([R, L]): advantages, truncated; teacher_index is
  refused (route teachers before packing: teacher_logprobs travel with their
  tokens). Rows that carry no loss are left out: with the token-level loss
  they add nothing to the loss, its gradient or its normaliser.

  The width is `row_tokens`, or the longest sequence when that is longer
  (rounded up to a power of two, so few widths compile); the row count is
  rounded up to a power of two or three quarters of one (1, 2, 3, 4, 6, 8,
  12, ...), then to a multiple of `rows_multiple` (microbatches x batch
  shards), the extra rows all padding.

  Args:
    batch: a TrainBatch of one sequence per row (`from_samples`), host arrays.
    row_tokens: tokens per packed row (the update's memory constant).
    rows_multiple: the packed row count is a multiple of this.

  Returns:
    The packed TrainBatch.
  """
  if row_tokens < 1 or rows_multiple < 1:
    raise ValueError(f'pack: row_tokens={row_tokens} and rows_multiple={rows_multiple} '
                     'must be >= 1')
  if batch.teacher_index is not None:
    raise ValueError('pack: batch has teacher_index (per-row teacher routing); compute '
                     'teacher_logprobs first and drop teacher_index')
  seg = np.asarray(batch.segment_ids)
  if np.any(seg > 1):
    raise ValueError('pack: the batch is already packed (segment ids above 1)')
  loss = np.asarray(batch.loss_mask)
  real = seg > 0
  starts = np.argmax(real, 1)
  lengths = real.sum(1)
  keep = np.flatnonzero((loss.sum(1) > 0) & (lengths > 0))
  # Each kept row's real tokens must be one contiguous span (left-padded prompt ++ completion).
  span_ok = np.array([real[r, starts[r]:starts[r] + lengths[r]].all() for r in keep], bool)
  if not span_ok.all():
    raise ValueError('pack: a row\'s tokens are not one contiguous span')
  width = packed_width(row_tokens, int(lengths[keep].max()) if keep.size else 1)
  free: list[int] = []                    # room left in each packed row
  place = {}
  for r in sorted(keep, key=lambda r: (-lengths[r], r)):
    n = int(lengths[r])
    row = next((i for i, room in enumerate(free) if room >= n), None)
    if row is None:
      free.append(width)
      row = len(free) - 1
    place[r] = (row, width - free[row])
    free[row] -= n
  count = packed_rows(len(free), rows_multiple)

  def empty(x, dtype=None):
    x = np.asarray(x)
    return np.zeros((count, width) + x.shape[2:], dtype or x.dtype)

  per_token = ('tokens', 'positions', 'targets', 'loss_mask', 'old_logprobs', 'ref_logprobs',
               'teacher_logprobs', 'routing', 'trainer_logprobs')
  fields = {name: empty(getattr(batch, name)) for name in per_token
            if getattr(batch, name) is not None}
  segment_ids = np.zeros((count, width), np.int32)
  advantages = (None if batch.advantages is None
                else np.zeros((count, width), np.float32))
  truncated = None if batch.truncated is None else np.zeros((count, width), bool)
  next_id = np.ones(count, np.int32)
  for r in sorted(place):
    row, col = place[r]
    a, n = int(starts[r]), int(lengths[r])
    for name, out in fields.items():
      out[row, col:col + n] = np.asarray(getattr(batch, name))[r, a:a + n]
    segment_ids[row, col:col + n] = next_id[row]
    next_id[row] += 1
    if advantages is not None:
      advantages[row, col:col + n] = np.asarray(batch.advantages).reshape(-1)[r]
    if truncated is not None:
      truncated[row, col:col + n] = np.asarray(batch.truncated).reshape(-1)[r]
  return TrainBatch(segment_ids=segment_ids, advantages=advantages, truncated=truncated,
                    **{k: fields.get(k) for k in per_token})


def _is_sample_output(x) -> bool:
  return hasattr(x, 'prompt_tokens') and hasattr(x, 'sampling_logprobs')


def _concat_samples(chunks):
  """Concatenates SampleOutputs by rows, left-padding prompts and right-padding completions."""
  p = max(c.prompt_tokens.shape[1] for c in chunks)
  n = max(c.tokens.shape[1] for c in chunks)
  pad = lambda x, before, after: np.pad(np.asarray(x), ((0, 0), (before, after))
                                        + ((0, 0),) * (np.ndim(x) - 2))
  left = lambda x, w: pad(x, w - x.shape[1], 0)
  right = lambda x, w: pad(x, 0, w - x.shape[1])
  fields = {}
  for name in chunks[0]._fields:
    present = [getattr(c, name) is not None for c in chunks]
    if not all(present):
      if any(present):
        raise ValueError(f'concat_rows: field {name!r} is set in some chunks and not others')
      fields[name] = None
    elif name in ('prompt_tokens', 'prompt_mask', 'prompt_routing'):
      fields[name] = np.concatenate([left(getattr(c, name), p) for c in chunks])
    elif name in ('tokens', 'mask', 'logprobs', 'sampling_logprobs', 'policy_mask', 'routing'):
      fields[name] = np.concatenate([right(getattr(c, name), n) for c in chunks])
    else:
      fields[name] = np.concatenate([np.asarray(getattr(c, name)) for c in chunks])
  return type(chunks[0])(**fields)


def concat_rows(chunks: Sequence[Any]):
  """Concatenates pytrees of row-major arrays along rows.

  SampleOutputs inside the pytrees may differ in prompt or completion width
  (different sampler buckets): prompts are left-padded and completions
  right-padded to the widest (pad id 0, mask 0). Other leaves must agree in
  every dimension but the first.

  Args:
    chunks: a non-empty list of pytrees with the same structure.

  Returns:
    One pytree of numpy arrays.
  """
  if not chunks:
    raise ValueError('concat_rows: no chunks')
  return jax.tree.map(lambda *xs: (_concat_samples(xs) if _is_sample_output(xs[0])
                                   else np.concatenate([np.asarray(x) for x in xs])),
                      *chunks, is_leaf=_is_sample_output)


def take_rows(tree, rows):
  """Selects rows (numpy index array) of every leaf of a row-major pytree."""
  rows = np.asarray(rows)
  return jax.tree.map(lambda x: (type(x)(*(None if f is None else np.asarray(f)[rows]
                                           for f in x))
                                 if _is_sample_output(x) else np.asarray(x)[rows]),
                      tree, is_leaf=_is_sample_output)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """log softmax(logits)[targets], in float32.

  Args:
    logits: [B, L, V].
    targets: [B, L] int.

  Returns:
    [B, L] float32.
  """
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), -1)[..., 0]
  return picked - jax.nn.logsumexp(logits, -1)


def token_entropy(logits: jax.Array) -> jax.Array:
  """Entropy of softmax(logits) per position: [B, L, V] -> [B, L] float32."""
  logits = logits.astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, -1)
  return -jnp.sum(jnp.exp(logp) * logp, -1)


# Sequence positions whose [rows, chunk, V] logits exist at once in a training or scoring
# pass. Longer rows are scanned in chunks of this many positions under remat, so no pass
# holds [rows, L, V] logits (V = 151,936 for Qwen3: ~76 KB per token in float32), in the
# forward or the backward; rows up to this long take the one-shot path.
LOGITS_CHUNK = 1024


def token_stats(model, tokens, positions, segment_ids, targets, *, entropy: bool = False,
                argmax: bool = False, chunk: int = LOGITS_CHUNK, routing=None,
                replay: bool = True) -> dict[str, jax.Array]:
  """Per-position log-prob of the target (and entropy, argmax) without full-length logits.

  Args:
    model: an NNX policy with `hidden(tokens, positions, segment_ids)`,
      `logits_from_hidden(h)` and the logical `rules` it traces with
      (models.transformer.Transformer).
    tokens, positions, segment_ids, targets: [B, L] int.
    entropy: also return the full-distribution entropy per position.
    argmax: also return the most likely token per position.
    chunk: positions per output-projection chunk (rows up to this long in one go).
    routing: optional [B, L, M, k] int experts of each token (`TrainBatch.routing`): the
      forward replays them (`replay`), or only compares its routers' own choice with them;
      either way the mismatch is in the model's MoE statistics.
    replay: see `routing`.

  Returns:
    {'logprobs': [B, L] float32, 'entropy': [B, L] float32, 'argmax': [B, L] int32}
    (the last two when asked for).
  """
  if routing is None:
    h, _ = model.hidden(tokens, positions, segment_ids)          # [B, L, D]
  else:
    h, _ = model.hidden(tokens, positions, segment_ids, routing=jnp.moveaxis(routing, 2, 0),
                        replay=replay)
  return stats_from_hidden(model, h, targets, entropy=entropy, argmax=argmax, chunk=chunk)


def stats_from_hidden(model, h, targets, *, entropy: bool = False, argmax: bool = False,
                      chunk: int = LOGITS_CHUNK) -> dict[str, jax.Array]:
  """`token_stats` from final hidden states h [B, L, D] (the output projection chunked; a
  row split along L is chunked per shard under the model's `rules`)."""

  def stats(hc, tc):
    logits = model.logits_from_hidden(hc)                       # [B, C, V] float32
    out = {'logprobs': token_logprobs(logits, tc)}
    if entropy:
      out['entropy'] = token_entropy(logits)
    if argmax:
      out['argmax'] = jnp.argmax(logits, -1).astype(jnp.int32)
    return out

  b, l, d = h.shape
  shards = context.shards(l, model.rules)
  if shards > 1 and l // shards > chunk:
    return _sharded_stats(stats, h, targets, shards, chunk, model.rules)
  if l <= chunk:
    return stats(h, targets)
  n = -(-l // chunk)
  pad = n * chunk - l
  hs = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1)
  ts = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
  body = jax.checkpoint(stats)          # the backward recomputes one chunk's logits at a time
  _, out = jax.lax.scan(lambda carry, x: (carry, body(*x)), None, (hs, ts))
  return {k: v.swapaxes(0, 1).reshape(b, n * chunk)[:, :l] for k, v in out.items()}


def _sharded_stats(stats, h, targets, shards: int, chunk: int,
                   rules: sharding.Rules) -> dict[str, jax.Array]:
  """`stats` in chunks when h [B, L, D] is split along L over `shards` context-parallel
  shards (under the model's `rules`): each shard's own part is cut into chunks, and step j
  of the scan runs chunk j of every shard at once ([B, shards * chunk] positions, shard s's
  chunk on shard s), so no hidden state or logit moves between shards and each holds
  [B, chunk, V] logits."""
  b, l, d = h.shape
  m = l // shards                                              # positions per shard
  n = -(-m // chunk)
  pad = n * chunk - m
  names = (None, 'batch', 'length', 'embed')

  def split(x):                                                # [B, L, ...] -> [n, B, S*C, ...]
    x = x.reshape(b, shards, m, *x.shape[2:])
    x = jnp.pad(x, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3))
    x = x.reshape(b, shards, n, chunk, *x.shape[3:])
    return jnp.moveaxis(x, 2, 0).reshape(n, b, shards * chunk, *x.shape[4:])

  hs = sharding.constrain(split(h), names, rules)
  ts = sharding.constrain(split(targets), names[:3], rules)
  body = jax.checkpoint(stats)
  _, out = jax.lax.scan(lambda carry, x: (carry, body(*x)), None, (hs, ts))

  def join(x):                                                 # [n, B, S*C] -> [B, L]
    x = jnp.moveaxis(x.reshape(n, b, shards, chunk), 0, 2).reshape(b, shards, n * chunk)
    return x[:, :, :m].reshape(b, l)

  return {k: join(v) for k, v in out.items()}


def policy_stats(model, batch, *, replay: bool = True, **kw) -> dict[str, jax.Array]:
  """`token_stats` over a batch's rows (tokens, positions, segment_ids, targets), with the
  batch's recorded `routing` when it has one (replayed, or with `replay=False` only compared)."""
  return token_stats(model, batch.tokens, batch.positions, batch.segment_ids, batch.targets,
                     routing=getattr(batch, 'routing', None), replay=replay, **kw)


@functools.partial(jax.jit, static_argnums=0, static_argnames=('rules',))
def _logprobs_jit(graphdef, params, tokens, positions, segment_ids, targets, routing=None, *,
                  rules: sharding.Rules = sharding.DEFAULT_RULES):
  model = nnx.merge(graphdef, params)
  model.rules = rules
  return token_stats(model, tokens, positions, segment_ids, targets, routing=routing)['logprobs']


def compute_logprobs(graphdef, params, batch: TrainBatch, mesh=None, rules=None, *,
                     rows_per_call: int | None = None,
                     replay_routing: bool = False) -> jax.Array | np.ndarray:
  """Per-target log-probs [B, L] of a policy over `batch`, no gradient.

  A jitted forward pass; used to fill `ref_logprobs` (KL), `teacher_logprobs`
  (MOPD) and `trainer_logprobs` (the policy itself before a batch's first update)
  before the train step. Only the architecture in `graphdef` must match the
  params; it need not be the student's.

  Args:
    graphdef: nnx GraphDef of the scoring model.
    params: its nnx.State.
    batch: the rows (tokens, positions, segment_ids, targets are read; routing too with
      `replay_routing`).
    mesh: optional mesh to trace under (params are used as they are placed).
    rules: logical rules for the mesh (None: DEFAULT_RULES), the forward's `rules`.
    rows_per_call: rows per forward pass (default: all B in one). With fewer,
      the rows go through in calls of exactly that many (the last one padded
      by repeating a row), so memory is bounded by rows_per_call rows and one
      shape compiles; a stage passes its train step's microbatch rows.
    replay_routing: replay the batch's recorded `routing` in the forward, as the policy's
      training forward does (the policy's own old log-probs); other models never replay.

  Returns:
    [B, L] float32: a device array from one call, a numpy array from several.
  """
  fields = (batch.tokens, batch.positions, batch.segment_ids, batch.targets)
  if replay_routing and batch.routing is not None:
    fields += (batch.routing,)
  b = batch.tokens.shape[0]
  if rows_per_call is not None and rows_per_call < 1:
    raise ValueError(f'compute_logprobs: rows_per_call={rows_per_call} must be >= 1')
  rules = sharding.as_rules(rules)
  if rows_per_call is None or rows_per_call >= b:
    with sharding.use_mesh(mesh):
      return _logprobs_jit(graphdef, params, *(jnp.asarray(f) for f in fields), rules=rules)
  host = [np.asarray(f) for f in fields]
  out = np.zeros(host[3].shape, np.float32)
  for start in range(0, b, rows_per_call):
    idx = np.arange(start, min(start + rows_per_call, b))
    padded = np.concatenate([idx, np.full(rows_per_call - idx.size, idx[0])])
    with sharding.use_mesh(mesh):
      lp = _logprobs_jit(graphdef, params, *(jnp.asarray(f[padded]) for f in host), rules=rules)
    out[idx] = np.asarray(lp)[:idx.size]
  return out
