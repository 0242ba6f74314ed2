"""Rollout engine: a pure, jitted prefill + `lax.while_loop` decode over a preallocated KV cache.

Two levels:

* `sample(graphdef, params, prompt_tokens, prompt_mask, rng, temperature,
  top_p, top_k, max_new_tokens, row_offset, *, max_new_bucket, eos_ids,
  pad_id, greedy, filtered, decode_phases)` is the pure jitted function.
  Params are an argument (never closed over); temperature / top-p / top-k /
  max_new_tokens / row_offset are traced scalars, so a temperature or length
  curriculum inside one bucket does not recompile; only shapes and the
  greedy / filtered switches are static. The decode runs in up to
  `decode_phases` while loops whose cache doubles in length, so attention
  reads about the filled part of the cache.
* `Sampler.generate(params, prompts, rng, sp, num_samples)` is the host
  level: it left-pads the prompts into a bucketed [B, P] batch (each prompt
  repeated `num_samples` times, prompt-major), calls the jitted function, and
  trims the result back to the real rows and `sp.max_new_tokens` columns.
  With `cache_tokens_per_device` it samples the rows in chunks whose KV cache
  fits that budget, one chunk after another (one compiled program for all).
  A `Sampler` holds one engine object, chosen once by its `engine` setting:
  the one-call engine above, or the paged engine (`rl.engine`: continuous
  batching over a paged KV cache, with streams and KV sessions); the
  Sampler's `generate`, `stream`, `session` and `lower` call it alike.

Prompts are LEFT-padded so every row's last prompt token sits in the same
cache slot; padding has segment id 0 and nothing attends to it; positions are
`cumsum(prompt_mask) - 1`. Row r (= prompt i * G + sample g) draws its noise
from `fold_in(fold_in(rng, r), step)`, so its samples do not depend on how
many padding rows the batch has, on how the batch is sharded, nor on how the
rows are split into chunks (a chunk passes its first row's index as
`row_offset`).

Log-probabilities: `logprobs` are those of the sampled tokens under the
unmodified policy (temperature 1, no top-p/top-k): exactly what a training
forward pass computes, which is what makes GRPO strictly on-policy.
`sampling_logprobs` are under the distribution actually sampled from.

Routing (mixture-of-experts models): with `record_routing` either engine also
returns the experts each prompt and generated token went to in every 'moe'
sublayer, [rows, tokens, M, k] in a compact dtype (`routing_dtype`: uint8 up to
256 experts), taken from the forward passes it runs anyway (the model hands
them back functionally, `Transformer.hidden(return_stats=True)`), plus one
forward of each row's last sampled token (the paged engine's row *tail*,
`rl.paged_programs.decode`). A training forward replays them
(`rl.batch.TrainBatch.routing`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from foundation import step_clock
from models import config as config_lib
from models import hybrid
from models import sharding
from models import transformer
from rl import buckets
from rl import engine as engine_lib
from rl import engine_options as engine_options_lib
from rl import paged_programs
from rl import rollout_copy
from rl import sampling
from rl import scheduler

# The programs `Sampler.lower` compiles per engine (launch.plan plans each).
PROGRAMS = {'one_call': ('decode',), 'paged': ('decode', 'prefill')}


class RolloutWeights:
  """Params already in the sampler's rollout copy and layout (`Sampler.prepare`); not a
  pytree, so it cannot be mistaken for the params themselves."""
  __slots__ = ('params',)

  def __init__(self, params):
    self.params = params


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """How to pick each next token.

  Attributes:
    temperature: logits are divided by it before top-k/top-p (> 0 unless greedy).
    top_p: nucleus mass in (0, 1]; 1 = off.
    top_k: keep the k most likely tokens; 0 = off.
    greedy: take the argmax (temperature/top-p/top-k are then ignored).
    max_new_tokens: the most tokens generated per row (>= 1).
  """
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  greedy: bool = False
  max_new_tokens: int

  def __post_init__(self):
    if not isinstance(self.max_new_tokens, (int, np.integer)) or self.max_new_tokens < 1:
      raise ValueError(f'SamplingParams.max_new_tokens={self.max_new_tokens!r} must be an int >= 1')
    if not self.greedy and not self.temperature > 0:
      raise ValueError(f'SamplingParams.temperature={self.temperature!r} must be > 0 '
                       '(use greedy=True for argmax decoding)')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'SamplingParams.top_p={self.top_p!r} must be in (0, 1]')
    if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
      raise ValueError(f'SamplingParams.top_k={self.top_k!r} must be an int >= 0 (0 = off)')

  @property
  def filtered(self) -> bool:
    """Whether top-p or top-k is on (the sort is compiled in only then)."""
    return not self.greedy and (self.top_p < 1 or self.top_k > 0)


def _row_limits(row_limits, n: int, max_new_tokens: int, what: str) -> np.ndarray:
  """Each of n rows' most new tokens: `row_limits` checked to lie in [1, max_new_tokens], or
  max_new_tokens for all when None."""
  if row_limits is None:
    return np.full(n, max_new_tokens, np.int64)
  limits = np.asarray(row_limits, np.int64).reshape(-1)
  if limits.shape != (n,) or (n and (limits.min() < 1 or limits.max() > max_new_tokens)):
    raise ValueError(f'{what}: expected {n} ints in [1, max_new_tokens={max_new_tokens}]')
  return limits


class SampleOutput(NamedTuple):
  """A batch of rollouts; row i * G + g is sample g of prompt i.

  Attributes:
    prompt_tokens: [B, P] int32, left-padded with pad_id.
    prompt_mask: [B, P] int32, 1 = real prompt token.
    tokens: [B, N] int32 completion; pad_id after the stop token.
    mask: [B, N] int32, 1 for every generated token including the stop token.
    logprobs: [B, N] float32 log-prob of each sampled token under the
      unmodified policy (temperature 1, no top-p/top-k); 0 where mask is 0.
    sampling_logprobs: [B, N] float32 under the distribution sampled from
      (temperature, top-p, top-k applied); 0 for greedy and where mask is 0.
    lengths: [B] int32 number of generated tokens.
    truncated: [B] bool, hit max_new_tokens without a stop token.
    prompt_routing: with `record_routing`, [B, P, M, k] the experts each prompt token went
      to in each of the M 'moe' sublayers (`routing_dtype`; 0 on padding); else None.
    routing: with `record_routing`, [B, N, M, k] the experts of each generated token (its
      forward as the next step's input; the last one's in one step more); 0 where mask is
      0; else None.
  """
  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  tokens: jax.Array
  mask: jax.Array
  logprobs: jax.Array
  sampling_logprobs: jax.Array
  lengths: jax.Array
  truncated: jax.Array
  prompt_routing: jax.Array | None = None
  routing: jax.Array | None = None


# The compact dtype recorded expert ids take: uint8 up to 256 experts, else uint16/int32.
routing_dtype = paged_programs.routing_dtype


def check_records_routing(cfg: config_lib.ModelConfig) -> None:
  """A ValueError unless the model has 'moe' sublayers whose routing can be recorded."""
  if 'moe' not in cfg.mixers:
    raise ValueError(f'record_routing: the model (family {cfg.family!r}) has no \'moe\' '
                     'sublayers, so there is no routing to record')


class _Loop(NamedTuple):
  """State of the decode loop (a pytree)."""
  step: jax.Array          # [] int32, the next column to fill
  cache: transformer.Cache
  last: jax.Array          # [B] int32, the token sampled at step - 1
  done: jax.Array          # [B] bool, stopped (a stop token was emitted)
  tokens: jax.Array        # [B, Nb] int32
  logprobs: jax.Array      # [B, Nb] float32
  sampling_logprobs: jax.Array  # [B, Nb] float32
  routing: jax.Array | None = None   # [B, Nb, M, k] experts of each fed token (recording)


# Decode phases: none shorter than _MIN_PHASE_TOKENS (below that attention
# over unfilled slots costs less than compiling the loop body once more).
_MIN_PHASE_TOKENS = 128


def _phase_ends(nb: int, phases: int = engine_options_lib.DEFAULT_DECODE_PHASES
                ) -> tuple[int, ...]:
  """New-token extents of the decode phases, e.g. 1024 -> (128, 256, 512, 1024)."""
  ends = [nb]
  while len(ends) < phases and ends[0] // 2 >= _MIN_PHASE_TOKENS:
    ends.insert(0, ends[0] // 2)
  return tuple(ends)


def _grow(cache: transformer.Cache, length: int, rules: sharding.Rules) -> transformer.Cache:
  """The same cache with empty slots appended up to `length` (laid out by `rules`)."""
  extra = length - cache.segment_ids.shape[1]

  def grow(x):    # [L, B, K, S, H] or one layer's [B, K, S, H]: slots are the axis before last
    pad = [(0, 0)] * x.ndim
    pad[-2] = (0, extra)
    return sharding.constrain(jnp.pad(x, pad), transformer.CACHE_AXES[-x.ndim:], rules)
  return cache._replace(k=jax.tree.map(grow, cache.k), v=jax.tree.map(grow, cache.v),
                        segment_ids=jnp.pad(cache.segment_ids, ((0, 0), (0, extra))))


def _sample(graphdef, params, prompt_tokens, prompt_mask, rng, temperature, top_p,
            top_k, max_new_tokens, row_offset=0, row_limits=None, *, max_new_bucket: int,
            eos_ids: tuple[int, ...],
            pad_id: int, greedy: bool, filtered: bool,
            decode_phases: int = engine_options_lib.DEFAULT_DECODE_PHASES, group: int = 1,
            unroll: bool = False, record_routing: bool = False,
            rules: sharding.Rules = sharding.DEFAULT_RULES) -> SampleOutput:
  """Prefill + while-loop decode (see `sample`). B rows, P prompt, Nb = max_new_bucket."""
  model = nnx.merge(graphdef, params)
  model.rules = rules
  cfg = model.cfg
  if record_routing:
    check_records_routing(cfg)
  u, p = prompt_tokens.shape
  b = u * group
  nb = max_new_bucket
  batch_only = ('batch', None)
  prompt_tokens = sharding.constrain(prompt_tokens.astype(jnp.int32), batch_only, rules)
  prompt_mask = sharding.constrain(prompt_mask.astype(jnp.int32), batch_only, rules)
  temperature = jnp.asarray(temperature, jnp.float32)
  top_p = jnp.asarray(top_p, jnp.float32)
  top_k = jnp.asarray(top_k, jnp.int32)
  max_new = jnp.minimum(jnp.asarray(max_new_tokens, jnp.int32), nb)
  eos = jnp.asarray(eos_ids, jnp.int32)

  rows = jnp.asarray(row_offset, jnp.int32) + jnp.arange(b, dtype=jnp.int32)
  row_keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, rows)
  step_keys = lambda step: jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)
  pick_next = functools.partial(sampling.pick, temperature=temperature, top_p=top_p, top_k=top_k,
                                greedy=greedy, filtered=filtered)
  is_stop = lambda tok: (jnp.any(tok[..., None] == eos, axis=-1) if eos_ids
                         else jnp.zeros(tok.shape, bool))

  # Prefill the whole (left-padded) prompt in one call: each distinct prompt once, its cache
  # and last logits then copied to the `group` rows that sample it.
  positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
  ends = _phase_ends(nb, decode_phases)
  cache = transformer.init_cache(cfg, u, p + ends[0], rules=rules)
  hidden, cache, stats = model.hidden(prompt_tokens, positions, prompt_mask, cache=cache,
                                      return_stats=True)
  # Only the last position's logits: [B, P, V] would be huge at real vocab sizes.
  last = model.logits_from_hidden(hidden[:, -1:])[:, 0]
  rdt = routing_dtype(cfg.num_experts)
  routed = ('batch', None, None, None)
  # [M, rows, T, k] -> [rows, T, M, k], compact.
  as_rows = lambda idx: sharding.constrain(jnp.moveaxis(idx, 0, 2).astype(rdt), routed,
                                          rules)
  prompt_routing = as_rows(stats.indices) if record_routing else None
  if group > 1:
    rep = lambda x, axis: jnp.repeat(x, group, axis=axis)
    if isinstance(cache.k, tuple):   # per-sublayer buffers and Mamba states, rows first
      cache = cache._replace(k=hybrid.repeat_rows(cache.k, group),
                             v=hybrid.repeat_rows(cache.v, group),
                             state=hybrid.repeat_rows(cache.state, group),
                             segment_ids=sharding.constrain(rep(cache.segment_ids, 0),
                                                            batch_only, rules))
    else:
      cache = cache._replace(k=sharding.constrain(rep(cache.k, 1), transformer.CACHE_AXES,
                                                  rules),
                             v=sharding.constrain(rep(cache.v, 1), transformer.CACHE_AXES,
                                                  rules),
                             segment_ids=sharding.constrain(rep(cache.segment_ids, 0),
                                                            batch_only, rules))
    last = rep(last, 0)
    prompt_tokens = sharding.constrain(rep(prompt_tokens, 0), batch_only, rules)
    prompt_mask = sharding.constrain(rep(prompt_mask, 0), batch_only, rules)
    if record_routing:
      prompt_routing = sharding.constrain(rep(prompt_routing, 0), routed, rules)
  layers = None
  if unroll:
    layers, cache = model.layer_states(), transformer.unstack_cache(cache, rules)
  prompt_len = jnp.sum(prompt_mask, axis=1)                               # [B]
  # Each row's own limit (<= max_new); a row at its limit is done like a stopped one.
  limits = (jnp.full((b,), max_new) if row_limits is None
            else jnp.minimum(sharding.constrain(row_limits.astype(jnp.int32), ('batch',),
                                                rules),
                             max_new))
  tok, lp, slp = pick_next(last, step_keys(0))
  buf = lambda fill, dt: sharding.constrain(jnp.full((b, nb), fill, dt), batch_only, rules)
  routing = None
  if record_routing:
    m = cfg.mixers.count('moe')
    routing = sharding.constrain(jnp.zeros((b, nb, m, cfg.experts_per_token), rdt), routed,
                                 rules)
  state = _Loop(step=jnp.ones((), jnp.int32), cache=cache, last=tok,
                done=is_stop(tok) | (limits <= 1),
                tokens=buf(pad_id, jnp.int32).at[:, 0].set(tok),
                logprobs=buf(0, jnp.float32).at[:, 0].set(lp),
                sampling_logprobs=buf(0, jnp.float32).at[:, 0].set(slp), routing=routing)
  ones = jnp.ones((b, 1), jnp.int32)

  def feed(s: _Loop):
    """The forward of the token sampled at step - 1 (at position prompt_len + step - 1):
    (logits [B, V], cache, routing with that token's experts in column step - 1)."""
    pos = (prompt_len + s.step - 1)[:, None]
    hidden, cache, stats = model.hidden(s.last[:, None], pos, ones, cache=s.cache,
                                        layers=layers, return_stats=True)
    routing = s.routing
    if record_routing:
      routing = jax.lax.dynamic_update_slice(routing, as_rows(stats.indices),
                                             (0, s.step - 1, 0, 0))
    return model.logits_from_hidden(hidden)[:, 0], cache, routing

  def body(s: _Loop):
    logits, cache, routing = feed(s)
    tok, lp, slp = pick_next(logits, step_keys(s.step))
    live = ~s.done
    tok = jnp.where(live, tok, pad_id)
    col = lambda a, x: jax.lax.dynamic_update_slice(a, x[:, None], (0, s.step))
    done = s.done | (live & (is_stop(tok) | (s.step + 1 >= limits)))
    return _Loop(step=s.step + 1, cache=cache, last=tok, done=done,
                 tokens=col(s.tokens, tok),
                 logprobs=col(s.logprobs, jnp.where(live, lp, 0.)),
                 sampling_logprobs=col(s.sampling_logprobs, jnp.where(live, slp, 0.)),
                 routing=routing)

  # Decode in phases whose cache extent doubles, so attention reads about the
  # filled part of the cache rather than all p + nb slots on every step.
  # (A cache allocated once at full length and attended over a growing prefix
  # measured a higher peak on XLA:CPU: the loops then carry two full copies.)
  for i, end in enumerate(ends):
    if i:
      state = state._replace(cache=_grow(state.cache, p + end, rules))
    limit = jnp.minimum(max_new, end)
    state = jax.lax.while_loop(lambda s, limit=limit: (s.step < limit) & ~jnp.all(s.done),
                               body, state)

  # A column is generated iff it precedes max_new and the row had not stopped
  # before it: i.e. up to and including the stop token.
  cols = jnp.arange(nb, dtype=jnp.int32)[None, :]
  stop_at = jnp.where(is_stop(state.tokens) & (cols < state.step), cols, nb)
  first_stop = jnp.min(stop_at, axis=1)                                   # [B]
  end = jnp.minimum(jnp.minimum(first_stop + 1, state.step), limits)
  mask = (cols < end[:, None]).astype(jnp.int32)
  routing = None
  if record_routing:
    # The loop fed every generated token but those sampled at its last step (the rows still
    # live then): one more forward of them gives their experts (the cache has a free slot:
    # the loop wrote step - 1 < its extent of them). Padding columns become 0.
    _, _, routing = feed(state)
    keep = lambda r, m: jnp.where(m[:, :, None, None] > 0, r, jnp.zeros((), r.dtype))
    routing = keep(routing, mask)
    prompt_routing = keep(prompt_routing, prompt_mask)
  return SampleOutput(
      prompt_tokens=prompt_tokens, prompt_mask=prompt_mask,
      tokens=state.tokens, mask=mask, logprobs=state.logprobs,
      sampling_logprobs=state.sampling_logprobs,
      lengths=end.astype(jnp.int32),
      truncated=first_stop >= nb, prompt_routing=prompt_routing, routing=routing)


_STATIC = ('max_new_bucket', 'eos_ids', 'pad_id', 'greedy', 'filtered', 'decode_phases',
           'group', 'unroll', 'record_routing', 'rules')

sample = jax.jit(_sample, static_argnums=0, static_argnames=_STATIC)
sample.__doc__ = """The pure jitted sampler.

Args:
  graphdef: static nnx GraphDef of the policy (from `nnx.split(model)`).
  params: the policy's state (the other half of `nnx.split`).
  prompt_tokens: [B / group, P] int32, left-padded: each prompt once.
  prompt_mask: [B / group, P] int32, 1 = real token; every row needs at least one.
  rng: a PRNG key; row r uses fold_in(fold_in(rng, row_offset + r), step).
  temperature, top_p, top_k: traced scalars (see SamplingParams).
  max_new_tokens: traced int scalar <= max_new_bucket.
  row_offset: traced int scalar, the index of row 0 in the whole call (a
    chunk's first row; 0 for an unchunked call).
  row_limits: optional [B] int32, each row's own most new tokens (capped by
    max_new_tokens); None = max_new_tokens for every row.
  max_new_bucket: static Nb, the cache extent and output width.
  eos_ids: static tuple of stop-token ids (empty: never stop).
  pad_id: static id written after the stop token.
  greedy: static; argmax decoding.
  filtered: static; top-p/top-k filtering compiled in.
  decode_phases: static; the most decode loops, each with a cache twice as
    long as the one before (see Sampler).
  group: static; rows per prompt: prompt i is prefilled once and sampled by
    rows i * group ... (i + 1) * group - 1 (the returned prompt fields have
    B rows).
  unroll: static; decode with the blocks unrolled over per-layer weights and
    caches made once before the loop (Sampler's decode_layers='unrolled').
  record_routing: static; also return every prompt and generated token's experts
    (`SampleOutput.prompt_routing`, `.routing`; mixture-of-experts models only).
  rules: static; the logical rules the program traces with (`models.sharding.as_rules`; the
    Sampler's `rules`), set as the model's `rules` and given to every constraint.

Returns:
  A SampleOutput with N = max_new_bucket columns.
"""


def kv_token_bytes(cfg: config_lib.ModelConfig, mesh=None, rules=None) -> int:
  """Per-device bytes of one row's K and V for one token over every attention sublayer, the
  heads split over the mesh as the cache is."""
  kv_heads = cfg.num_kv_heads // sharding.split_ways(cfg.num_kv_heads, 'kv_heads', mesh, rules)
  head_dim = cfg.head_dim // sharding.split_ways(cfg.head_dim, 'head_dim', mesh, rules)
  return cfg.attention_layers * 2 * kv_heads * head_dim * cfg.jnp_dtype.itemsize


def row_state_bytes(cfg: config_lib.ModelConfig, mesh=None, rules=None) -> int:
  """Per-device bytes of one row's Mamba states (every Mamba sublayer's `mamba.MambaState`:
  ssm float32 [H, P, N], H over 'mamba_heads'; conv [K - 1, channels], whole); 0 without."""
  if not cfg.mamba_layers:
    return 0
  heads = cfg.mamba_heads // sharding.split_ways(cfg.mamba_heads, 'mamba_heads', mesh, rules)
  return cfg.mamba_layers * (heads * cfg.mamba_head_dim * cfg.mamba_state * 4 + (
      cfg.mamba_conv - 1) * cfg.mamba_conv_dim * cfg.jnp_dtype.itemsize)


def state_slots(cfg: config_lib.ModelConfig, mesh=None, rules=None) -> int:
  """KV-cache slots whose bytes equal one row's Mamba states (rounded up), what a hybrid row
  costs in a `cache_tokens_per_device` budget beside its tokens; 0 without Mamba layers or
  without attention (a budget of KV slots means nothing then)."""
  state, kv = row_state_bytes(cfg, mesh, rules), kv_token_bytes(cfg, mesh, rules)
  return -(-state // kv) if state and kv else 0


class Sampler:
  """Host-level rollout generation with bucketed shapes and a compile counter.

  Attributes:
    compile_count: number of distinct compilations (traces) of the jitted
      sampler so far.
  """

  def __init__(self, graphdef, model_cfg: config_lib.ModelConfig, *, eos_ids: Sequence[int],
               pad_id: int = 0, mesh=None, rules=None, **options):
    """Builds the sampler.

    Args:
      graphdef: the policy's nnx GraphDef (`nnx.split(model)[0]`).
      model_cfg: its ModelConfig (vocabulary bounds for validation).
      eos_ids: token ids that end a completion (any of them); empty = never stop.
      pad_id: id used for prompt left-padding and after the stop token.
      mesh: a ('data', 'fsdp', 'tensor') Mesh; rows are split over the
        'batch' rule, the model's own constraints do the rest. The params
        passed to `generate` must already live on it.
      rules: logical sharding rules (default: models.sharding.DEFAULT_RULES).
      **options: the fields of `rl.engine_options.SamplerOptions`, declared, defaulted and
        checked there (when the sampler is built); what each one does:
      prompt_buckets: allowed padded prompt lengths.
      new_token_buckets: allowed cache extents for the new tokens.
      batch_buckets: allowed padded batch sizes; None = powers of two. Either
        way a bucket is rounded up to a multiple of the batch shards.
      decode_phases: decode in up to this many loops whose cache extent
        doubles (phases of >= 128 new tokens), so attention reads about the
        filled part of the cache: ~1/3 fewer cache reads for long generations,
        for one more compiled loop body per phase. The grown cache is a copy
        (the old one lives until it is made): 1.55x the final cache at the
        last switch on XLA:CPU, less than the 2x that loops over a cache
        allocated once at full length hold there. 1 = one cache throughout.
      cache_tokens_per_device: the most KV-cache slots (rows x (prompt bucket
        + new-token bucket)) one device may hold at once; a call needing more
        is sampled in chunks of rows, one after another, each row's tokens
        identical to an unchunked call's. None = one call. A chunk's row
        count is a batch bucket (at least one row per batch shard). A hybrid
        model's rows also carry their Mamba states (a fixed size per row):
        each row is charged their bytes in KV slots (`state_slots`), so the
        budget bounds the cache's bytes whatever the family.
      rollout_rules: logical rules that override `rules` while sampling, e.g.
        (('embed', None),): weights replicated over 'fsdp' and split over
        'tensor' only, so no decode step gathers fsdp shards. `generate` puts
        the params in that layout once per call (a second copy of the
        weights while it runs; none when the rules move no weight, as rules on
        `models.sharding.ACTIVATION_AXES` alone do); None = sample in the training layout.
      engine: 'one_call' (all rows of a chunk in one decode loop, as above)
        or 'paged': continuous batching over a paged KV cache (rl.engine),
        the same tokens and log-probs for the same key.
      decode_layers: how a decode step runs the blocks (both engines). 'scan': one
        loop body over the stacked weights and cache, as training runs them.
        'unrolled': before the decode loop, each block's weights are sliced out
        of the stack and the cache is split into per-layer buffers (once per
        call: one more copy of the block weights and of the cache while it
        runs, and a step body num_layers times as long to compile; the paged
        engine keeps its page pools per layer between calls); the step then
        runs the blocks in a Python loop. XLA:CPU copies a layer's weights
        and its cache slice out of the stacks on every scanned step (1.6x the
        time of the unrolled step on the benchmarks' larger shape). 'auto':
        'unrolled' where the mesh's devices (or, without a mesh, the default
        backend) are CPUs, else 'scan'. The same tokens either way.
      rollout_cast: sample with a copy of the params in which every weight the sampler's
        programs only ever convert to a narrower compute dtype (a float32 master's matmul
        weights in a bfloat16 model) is stored in that dtype (`rl.rollout_copy`), made once
        per `generate` call or per `prepare`, in the rollout layout: half the weight
        bytes a decode step reads and the copy holds, the same tokens and log-probs bit
        for bit. Nothing is copied when no weight qualifies (a float32-compute model)
        and no `rollout_rules` reshard them.
      slots, page_size, pages, chunk_steps, prefill_prompts, decode_rows: the paged engine's
        options (`rl.engine_options.EngineOptions`): slots (rows decoded at once; None = the
        rows one 'one_call' chunk would hold, `chunk_rows`), page_size, pages (pages in the
        pool, split evenly over the mesh's batch shards: a slot's pages live on its own
        shard; None = `cache_tokens_per_device` / page_size per batch shard when that is set,
        else room for every slot's longest row), chunk_steps (free slots are refilled between
        calls), prefill_prompts and decode_rows.
    """
    self.graphdef = graphdef
    self.cfg = model_cfg
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.pad_id = int(pad_id)
    for name, ids in (('eos_ids', self.eos_ids), ('pad_id', (self.pad_id,))):
      bad = [i for i in ids if not 0 <= i < model_cfg.vocab_size]
      if bad:
        raise ValueError(f'Sampler {name} {bad} outside [0, vocab_size={model_cfg.vocab_size})')
    self.mesh = mesh
    # Checked here, so a bad option fails when the sampler is built, not at the first call.
    self.options = opts = engine_options_lib.SamplerOptions(**options)
    self.rollout_rules = opts.rollout_rules or ()
    if self.rollout_rules:
      merged = dict(sharding.DEFAULT_RULES if rules is None else rules)
      unknown = [k for k, _ in self.rollout_rules if k not in merged]
      if unknown:
        raise ValueError(f'Sampler rollout_rules name unknown logical axes {unknown} '
                         f'(known: {sorted(merged)})')
      rules = sharding.override_rules(rules, self.rollout_rules)
    # The rules the sampler traces and lays its weights out with: its programs' `rules`.
    self.rules = sharding.as_rules(rules)
    self.prompt_buckets = opts.prompt_buckets
    self.new_token_buckets = opts.new_token_buckets
    self.batch_buckets = opts.batch_buckets
    self.decode_phases = int(opts.decode_phases)
    decode_layers = opts.decode_layers
    if decode_layers == 'auto':
      platform = (mesh.devices.flat[0].platform if mesh is not None
                  else jax.default_backend())
      decode_layers = 'unrolled' if platform == 'cpu' else 'scan'
    self.decode_layers = decode_layers
    self.rollout_cast = bool(opts.rollout_cast)
    self._cast_plans, self._cast_fns = {}, {}
    self.cache_tokens_per_device = (None if opts.cache_tokens_per_device is None
                                    else int(opts.cache_tokens_per_device))
    self.state_slots = state_slots(model_cfg, mesh, self.rules)
    self.engine = opts.engine
    self.engine_options = opts.engine_options()
    self.slots = None if opts.slots is None else int(opts.slots)
    self._rollout = _ENGINE_TYPES[self.engine](self)
    self.compile_count = 0
    # Accounting, cumulative over calls: decode slots paid for (a chunk's rows x the decode
    # steps it ran, padding rows included) and tokens generated by real rows.
    self.decode_slots = 0
    self.generated_tokens = 0

  @property
  def _unroll(self) -> bool:
    return self.decode_layers == 'unrolled'

  def _batch_bucket(self, n: int) -> int:
    shards = sharding.batch_shards(self.mesh, self.rules)
    if self.batch_buckets is None:
      return buckets.pow2(n, multiple=shards)
    b = buckets.smallest_fit(self.batch_buckets, n, 'batch (prompts x num_samples)')
    return -(-b // shards) * shards

  def rollout_params(self, params):
    """`params` as the sampler's programs take them: the rollout copy (see `rollout_cast`) in
    the sampler's layout (resharded with `rollout_rules`), or `params` itself (no copy) when no
    weight is cast and no weight's sharding changes (rollout rules on activation axes only,
    `models.sharding.ACTIVATION_AXES`, such as rows split over 'sequence' too).

    Works on concrete params and on abstract ones (ShapeDtypeStructs with shardings); a
    `RolloutWeights` from `prepare` is passed through as it is.
    """
    if isinstance(params, RolloutWeights):
      return params.params
    reshard = bool(self.rollout_rules) and self.mesh is not None
    dtypes = self.cast_dtypes(params) if self.rollout_cast else None
    if not reshard and dtypes is None:
      return params
    shardings = (sharding.state_shardings(params, self.mesh, self.rules)
                 if self.mesh is not None else None)
    leaves, treedef = jax.tree.flatten(params)
    if dtypes is None and all(
        getattr(x, 'sharding', None) is not None and x.sharding.is_equivalent_to(sh, len(x.shape))
        for x, sh in zip(leaves, jax.tree.leaves(shardings))):
      return params     # the rollout rules move no weight: sample with the params as they are
    want = [l.dtype if d is None else d for l, d in zip(leaves, dtypes or [None] * len(leaves))]
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
      shs = (jax.tree.leaves(shardings) if shardings is not None
             else [x.sharding for x in leaves])
      return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, d, sharding=sh)
                                          for x, d, sh in zip(leaves, want, shs)])
    if dtypes is None:
      return jax.device_put(params, shardings)
    key = (treedef, tuple(want), None if shardings is None else str(shardings))
    fn = self._cast_fns.get(key)
    if fn is None:
      cast = lambda p: jax.tree.unflatten(treedef, [x.astype(d) for x, d in
                                                    zip(jax.tree.leaves(p), want)])
      fn = self._cast_fns[key] = jax.jit(cast, out_shardings=shardings)
    return fn(params)

  def prepare(self, params) -> 'RolloutWeights':
    """The rollout copy of `params` made once, for several `generate` / `stream` calls (a
    step's refill rounds, episodes' turns): pass the result instead of the params, and drop
    it when the calls are done, so its memory is free for the train step."""
    if isinstance(params, RolloutWeights):
      return params
    return RolloutWeights(self.rollout_params(params))

  def cast_dtypes(self, params) -> list | None:
    """Per leaf of `params` (concrete or abstract), the dtype the rollout copy stores it in
    (None: as it is), from this sampler's own traced programs; None when no leaf changes."""
    leaves, treedef = jax.tree.flatten(params)
    key = (treedef, tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves))
    if key not in self._cast_plans:
      abstract = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype)
                                              for x in leaves])
      if self.mesh is not None:
        shardings = sharding.state_shardings(abstract, self.mesh, self.rules)
        abstract = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                   sharding=sh),
                                abstract, shardings)
      rows = sharding.batch_shards(self.mesh, self.rules)
      sp = SamplingParams(max_new_tokens=1)
      programs = []
      # The programs' uncounted twins are traced (not compiled); an engine made for the
      # trace's shapes is dropped again.
      engines = getattr(self._rollout, 'engines', {})
      kept = dict(engines)
      try:
        with sharding.use_mesh(self.mesh):
          for program in PROGRAMS[self.engine]:
            args, kw, _ = self.abstract_args(RolloutWeights(abstract), rows, 1, sp, 1, program)
            fn = self._rollout.traceable(self.call_shape(rows, 1, 1)[2], program)
            programs.append(fn.trace(*args, **kw).jaxpr)
      finally:
        engines.clear()
        engines.update(kept)
      dtypes = rollout_copy.cast_dtypes(programs, leaves)
      self._cast_plans[key] = dtypes if any(d is not None for d in dtypes) else None
    return self._cast_plans[key]

  def chunk_rows(self, rows: int, slots_per_row: int) -> int:
    """Rows per sampler call (the padded batch) for `rows` rows of `slots_per_row` cache slots.

    The whole call's batch bucket, or with `cache_tokens_per_device` the
    largest batch bucket whose cache fits the budget (at least one row per
    batch shard), whichever is smaller.
    """
    whole = self._batch_bucket(rows)
    if self.cache_tokens_per_device is None:
      return whole
    shards = sharding.batch_shards(self.mesh, self.rules)
    per_device = max(1, self.cache_tokens_per_device // (slots_per_row + self.state_slots))
    if self.batch_buckets is None:
      fit = shards * (1 << (per_device.bit_length() - 1))   # a power of two per shard
    else:
      legal = [-(-x // shards) * shards for x in self.batch_buckets]
      fitting = [x for x in legal if x // shards <= per_device]
      fit = max(fitting) if fitting else min(legal)
    return min(whole, fit)

  def call_shape(self, rows: int, prompt_len: int, max_new_tokens: int) -> tuple[int, int, int]:
    """(prompt bucket, new-token bucket, rows per chunk) of a call of these sizes."""
    p = buckets.smallest_fit(self.prompt_buckets, prompt_len, 'prompt length')
    nb = buckets.smallest_fit(self.new_token_buckets, max_new_tokens, 'max_new_tokens')
    return p, nb, self.chunk_rows(rows, p + nb)

  def prefill_group(self, chunk: int, num_samples: int) -> int:
    """Rows that share one prefill in a chunk of `chunk` rows: G when whole groups fill the
    chunk and their prompts split evenly over the batch shards, else 1."""
    if num_samples <= 1 or chunk % num_samples:
      return 1
    shards = sharding.batch_shards(self.mesh, self.rules)
    return num_samples if (chunk // num_samples) % shards == 0 else 1

  def abstract_args(self, params, rows: int, prompt_len: int, sp: SamplingParams,
                    num_samples: int = 1, program: str = 'decode', record_routing: bool = False):
    """The arguments `generate` passes the jitted sampler for a call of these sizes, abstract.

    Args:
      params: the policy's params as ShapeDtypeStructs (with shardings on a mesh).
      rows: prompts x num_samples of the call.
      prompt_len: its longest prompt.
      sp: its SamplingParams.
      num_samples: G (rows of one prompt share its prefill, see `prefill_group`).
      program: with engine='paged', 'decode' (a decode call) or 'prefill' (a prefill
        call); the one-call sampler has one program.
      record_routing: the call records routing (`generate`'s): its routing buffers too.

    Returns:
      (positional args, keyword args, description) for `sample.lower(*args, **kwargs)`.
    """
    if program not in PROGRAMS[self.engine]:
      raise ValueError(f'engine {self.engine!r} has no program {program!r} '
                       f'(it has {PROGRAMS[self.engine]})')
    args, kw, what = self._rollout.abstract_args(params, rows, prompt_len, sp, num_samples,
                                                 program)
    if record_routing:
      check_records_routing(self.cfg)
      kw = dict(kw, **{'record_routing' if self.engine == 'one_call' else 'record': True})
      what += ', recording routing'
    return args, kw, what

  def lower(self, params, rows: int, prompt_len: int, sp: SamplingParams, num_samples: int = 1,
            program: str = 'decode', record_routing: bool = False):
    """Lowers the sampler for a call of these sizes (ahead of time; `params` abstract).
    `program` and `record_routing` as in `abstract_args`."""
    args, kw, _ = self.abstract_args(params, rows, prompt_len, sp, num_samples, program,
                                     record_routing)
    fn = self._rollout.program(self.call_shape(rows, prompt_len, sp.max_new_tokens)[2], program)
    with sharding.use_mesh(self.mesh):
      return fn.lower(*args, **kw)

  def generate(self, params, prompts: Sequence[Sequence[int]], rng, sp: SamplingParams,
               num_samples: int = 1, row_limits: Sequence[int] | None = None,
               session: scheduler.Session | None = None,
               keys: Sequence | None = None, record_routing: bool = False,
               clock=step_clock.NULL) -> SampleOutput:
    """Samples `num_samples` completions of every prompt.

    Args:
      params: the policy's state (`nnx.split(model)[1]`), on the mesh if any.
      prompts: token-id lists, each non-empty.
      rng: a PRNG key or an int seed; use a fresh one per call (same key ->
        same samples).
      sp: SamplingParams.
      num_samples: G, completions per prompt.
      row_limits: optional, each row's own most new tokens (len(prompts) * G
        ints in [1, sp.max_new_tokens]); None = sp.max_new_tokens for all.
      session: optional, from `self.session` (engine='paged', G = 1): each
        row's cache is kept under its key after the call, and a later prompt
        with that key prefills only what follows the kept tokens (an agentic
        episode's turns); the samples are those of a call without it.
      keys: with a session, one distinct hashable key per prompt.
      record_routing: also return the experts every prompt and generated token went to
        in each 'moe' sublayer (`SampleOutput.prompt_routing` and `.routing`), what a
        training forward replays (routing replay; mixture-of-experts models only). Each
        token's experts are those of the forward that computed what the sampled tokens
        attend to: the paged engine's shared prompt prefill for every row of the prompt,
        a session's earlier call for the tokens its pages keep, and one more forward of
        each row's last token (`rl.engine.Engine.run`). The tokens are those of a call
        without it.
      clock: a `foundation.step_clock.StepClock` the one-call path times its parts on
        ('sampling': each chunk's program and the copy of its rows to the host; 'rollout
        copy': preparing the weights, the host part); the paged engine's call is timed whole
        by its caller.

    Returns:
      SampleOutput of numpy arrays with len(prompts) * G rows (prompt-major),
      P = the longest prompt, N = sp.max_new_tokens.
    """
    if not isinstance(sp, SamplingParams):
      raise TypeError(f'sp must be a SamplingParams, got {type(sp).__name__}')
    if num_samples < 1:
      raise ValueError(f'num_samples={num_samples} must be >= 1')
    if not len(prompts):
      raise ValueError('prompts is empty')
    if record_routing:
      check_records_routing(self.cfg)
    prompts = [np.asarray(q, np.int64).reshape(-1) for q in prompts]
    for i, q in enumerate(prompts):
      if q.size == 0:
        raise ValueError(f'prompts[{i}] is empty')
      self._check_ids(q, f'prompts[{i}]')
    if isinstance(rng, (int, np.integer)):
      rng = jax.random.key(rng)
    n = len(prompts) * num_samples
    limits = _row_limits(row_limits, n, sp.max_new_tokens, 'row_limits')
    shape = self.call_shape(n, max(q.size for q in prompts), sp.max_new_tokens)
    extra = dict(record_routing=True) if record_routing else {}
    if clock is not step_clock.NULL and self.engine != 'paged':
      extra['clock'] = clock
    return self._rollout.generate(params, prompts, rng, sp, num_samples, limits, shape,
                                  session=session, keys=keys, **extra)

  def session(self, max_row_tokens: int) -> scheduler.Session:
    """A KV session (see `generate`) for rows of at most `max_row_tokens` cache tokens (a
    prompt and its new tokens), bucketed as prompts are."""
    return self._rollout.session(max_row_tokens)

  def stream(self, params, rng, sp: SamplingParams, num_samples: int, source,
             max_prompt_len: int, rows: int, record_routing: bool = False) -> int:
    """Samples G completions of prompts that `source` feeds, handing over groups as they end.

    Continuous batching (engine='paged' only): whenever no row waits,
    `source.more()` may add prompts; after each decode call the prompts whose G
    rows have all ended go to `source.finished`, and once `source.stop()` the
    rows still running or waiting are cancelled. Prompt i of the feed (counted
    over all `more` calls) and its sample g are row i * G + g of one call: its
    tokens equal `generate`'s for the concatenated prompts and this key.

    Args:
      params: the policy's state.
      rng: a PRNG key.
      sp: SamplingParams.
      num_samples: G.
      source: has `more()`, `finished(prompts, samples)` and `stop() -> bool`.
        `more()` gives the next token-id lists (an empty list: none yet, ask
        after the next decode call; None: no more), or (lists, row limits):
        each row's own most new tokens, len * G ints in [1, sp.max_new_tokens].
        `finished` gets prompt indices in feed order and a SampleOutput of their
        rows, prompts left-padded to `max_prompt_len`.
      max_prompt_len: the longest prompt `source` may feed (sizes the pages).
      rows: rows of a typical feed (sizes the slots when `slots` is unset).
      record_routing: the finished samples carry their routing (as `generate`'s).

    Returns:
      The number of prompts fed.
    """
    if record_routing:
      check_records_routing(self.cfg)
      return self._rollout.stream(params, rng, sp, num_samples, source, max_prompt_len, rows,
                                  record_routing=True)
    return self._rollout.stream(params, rng, sp, num_samples, source, max_prompt_len, rows)

  def _check_ids(self, q: np.ndarray, name: str) -> None:
    """Refuses a non-empty prompt with ids outside the model's vocabulary."""
    if q.min() < 0 or q.max() >= self.cfg.vocab_size:
      raise ValueError(f'{name} has token ids outside [0, {self.cfg.vocab_size})')

  @property
  def pages_in_use(self) -> int:
    """Pages the paged engine still held after its last call (0 unless pages leak)."""
    return self._rollout.pages_in_use


class _OneCall:
  """`Sampler(engine='one_call')`: each chunk of rows in one jitted prefill + decode loop.

  The engine objects share one small interface, which `Sampler` calls without
  asking which it holds: `generate`, `abstract_args`, `program` (the jitted
  function `Sampler.lower` lowers), `session`, `stream` and `pages_in_use`.
  """

  def __init__(self, sampler: Sampler):
    self.sampler = sampler

    @functools.wraps(_sample)
    def counted(*args, **kwargs):
      sampler.compile_count += 1     # runs at trace time only, i.e. once per compilation
      return _sample(*args, **kwargs)

    self._jit = jax.jit(counted, static_argnums=0, static_argnames=_STATIC)

  def _refuse(self, what: str):
    raise ValueError(f"{what} needs engine='paged' (this sampler's is 'one_call')")

  def session(self, max_row_tokens: int):
    self._refuse('a KV session')

  def stream(self, *args, **kwargs):
    self._refuse('Sampler.stream')

  @property
  def pages_in_use(self) -> int:
    return 0

  def program(self, chunk: int, program: str):
    return sample

  def traceable(self, chunk: int, program: str):
    return sample

  def abstract_args(self, params, rows, prompt_len, sp, num_samples, program):
    """See `Sampler.abstract_args`."""
    s = self.sampler
    p, nb, b = s.call_shape(rows, prompt_len, sp.max_new_tokens)
    group = s.prefill_group(b, num_samples)
    u = b // group
    rows_sh = rep = None
    if s.mesh is not None:
      spec = sharding.logical_to_spec(('batch', None), (u, p), s.mesh, s.rules)
      rows_sh = jax.sharding.NamedSharding(s.mesh, spec)
      rep = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
    sds = lambda shape, dt, sh: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    args = (s.graphdef, s.rollout_params(params), sds((u, p), jnp.int32, rows_sh),
            sds((u, p), jnp.int32, rows_sh), sds((), engine_lib.KEY_DTYPE, rep),
            sds((), jnp.float32, rep), sds((), jnp.float32, rep), sds((), jnp.int32, rep),
            sds((), jnp.int32, rep), sds((), jnp.int32, rep))
    kw = dict(max_new_bucket=nb, eos_ids=s.eos_ids, pad_id=s.pad_id,
              greedy=sp.greedy, filtered=sp.filtered, decode_phases=s.decode_phases,
              group=group, unroll=s._unroll, rules=s.rules)
    chunks = -(-rows // b)
    what = (f'{b} rows' + (f' per chunk, {chunks} chunks' if chunks > 1 else '')
            + (f', {u} prompts prefilled once each' if group > 1 else '')
            + f', prompt bucket {p}, new-token bucket {nb} (KV cache of {p + nb} '
            f'slots, {s.decode_phases} decode phase(s)'
            + (', layers unrolled' if s._unroll else '') + ')')
    return args, kw, what

  def generate(self, params, prompts, rng, sp: SamplingParams, num_samples: int,
               limits: np.ndarray, shape: tuple[int, int, int], *, session, keys,
               record_routing: bool = False, clock=step_clock.NULL) -> SampleOutput:
    """See `Sampler.generate` (prompts checked; `shape` = `Sampler.call_shape`'s)."""
    if session is not None:
      self._refuse('a KV session')
    s = self.sampler
    p, nb, c = shape
    n = len(prompts) * num_samples
    p_max = max(q.size for q in prompts)
    chunks = -(-n // c)
    b = chunks * c                        # the whole call's rows, padded to whole chunks

    tokens = np.full((b, p), s.pad_id, np.int32)
    mask = np.zeros((b, p), np.int32)
    for i, q in enumerate(prompts):
      rows = slice(i * num_samples, (i + 1) * num_samples)
      tokens[rows, p - q.size:] = q
      mask[rows, p - q.size:] = 1
    mask[n:, -1] = 1        # padding rows get a one-token prompt so no row is empty
    row_limits = np.ones(b, np.int32)
    row_limits[:n] = limits

    group = s.prefill_group(c, num_samples)
    kw = dict(max_new_bucket=nb, eos_ids=s.eos_ids, pad_id=s.pad_id,
              greedy=sp.greedy, filtered=sp.filtered, decode_phases=s.decode_phases,
              group=group, unroll=s._unroll, rules=s.rules)
    if record_routing:
      kw['record_routing'] = True
    scalars = (np.float32(sp.temperature if not sp.greedy else 1.0), np.float32(sp.top_p),
               np.int32(sp.top_k), np.int32(sp.max_new_tokens))
    with clock.part('rollout copy'):      # dispatches the cast (if any): host time
      params = s.rollout_params(params)
    row_sh = None
    if s.mesh is not None:
      spec = sharding.logical_to_spec(('batch', None), (c // group, p), s.mesh, s.rules)
      row_sh = jax.sharding.NamedSharding(s.mesh, spec)
    parts = []
    with sharding.use_mesh(s.mesh):
      for start in range(0, b, c):
        # Rows of one prompt are consecutive and a chunk holds whole groups: one row per prompt.
        chunk_tokens = tokens[start:start + c:group]
        chunk_mask = mask[start:start + c:group]
        if row_sh is not None:
          chunk_tokens = jax.device_put(chunk_tokens, row_sh)
          chunk_mask = jax.device_put(chunk_mask, row_sh)
        chunk_limits = row_limits[start:start + c]
        if row_sh is not None:
          chunk_limits = jax.device_put(chunk_limits, jax.sharding.NamedSharding(
              s.mesh, sharding.logical_to_spec(('batch',), (c,), s.mesh, s.rules)))
        with clock.program('sampling'):
          out = self._jit(s.graphdef, params, chunk_tokens, chunk_mask, rng, *scalars,
                          np.int32(start), chunk_limits, **kw)
          # The chunk's cache is freed before the next.
          parts.append(jax.tree.map(sharding.to_host, out))
        lens = parts[-1].lengths
        s.decode_slots += int(lens.shape[0]) * int(lens.max())
        s.generated_tokens += int(lens[:max(0, min(c, n - start))].sum())
    out = jax.tree.map(lambda *xs: np.concatenate(xs), *parts) if chunks > 1 else parts[0]
    m = sp.max_new_tokens
    routed = {}
    if record_routing:
      routed = dict(prompt_routing=out.prompt_routing[:n, p - p_max:],
                    routing=out.routing[:n, :m])
    return SampleOutput(
        prompt_tokens=out.prompt_tokens[:n, p - p_max:],
        prompt_mask=out.prompt_mask[:n, p - p_max:],
        tokens=out.tokens[:n, :m], mask=out.mask[:n, :m], logprobs=out.logprobs[:n, :m],
        sampling_logprobs=out.sampling_logprobs[:n, :m],
        lengths=out.lengths[:n], truncated=out.truncated[:n], **routed)


class _Paged:
  """`Sampler(engine='paged')`: continuous batching over a paged KV cache (`rl.engine`), one
  `Engine` per slot count; the same tokens as the one-call sampler for the same key, and
  streams and KV sessions besides. Its interface is `_OneCall`'s.

  Attributes:
    engines: the engines made so far, by slots.
  """

  def __init__(self, sampler: Sampler):
    s = self.sampler = sampler
    shards = sharding.batch_shards(s.mesh, s.rules)
    # From the budget: what is left of it per shard once the slots' Mamba states are paid.
    self._pages_from_budget = (s.engine_options.pages is None
                               and s.cache_tokens_per_device is not None)
    if s.slots and s.slots % shards:
      raise ValueError(f'Sampler slots={s.slots} must be a multiple of the mesh\'s '
                       f'{shards} batch shards')
    self.engines: dict[int, engine_lib.Engine] = {}

  def engine(self, chunk: int) -> engine_lib.Engine:
    """The engine of `slots` slots (or `chunk`, a one-call chunk's rows, when unset)."""
    s = self.sampler
    slots = s.slots or chunk
    eng = self.engines.get(slots)
    if eng is None:
      pages = s.engine_options.pages
      if self._pages_from_budget:
        shards = sharding.batch_shards(s.mesh, s.rules)
        left = s.cache_tokens_per_device - -(-slots // shards) * s.state_slots
        pages = max(1, left // int(s.engine_options.page_size)) * shards
      eng = self.engines[slots] = engine_lib.Engine(
          s.graphdef, s.cfg, dataclasses.replace(s.engine_options, slots=slots, pages=pages),
          eos_ids=s.eos_ids, pad_id=s.pad_id, mesh=s.mesh, rules=s.rules,
          prompt_buckets=s.prompt_buckets, unroll=s._unroll)
    return eng

  @property
  def pages_in_use(self) -> int:
    return sum(e.pages_in_use for e in self.engines.values())

  def session(self, max_row_tokens: int) -> scheduler.Session:
    return scheduler.Session(buckets.smallest_fit(self.sampler.prompt_buckets, max_row_tokens,
                                                  'session row tokens'))

  def traceable(self, chunk: int, program: str):
    """The engine's call as a pure jitted function to trace (uncounted, nothing donated)."""
    return self.engine(chunk).traceable[program]

  def program(self, chunk: int, program: str):
    """The engine's jitted call (its pool is an argument)."""
    eng = self.engine(chunk)
    return eng._prefill if program == 'prefill' else eng._decode

  def abstract_args(self, params, rows, prompt_len, sp, num_samples, program):
    """See `Sampler.abstract_args`."""
    s = self.sampler
    p, nb, b = s.call_shape(rows, prompt_len, sp.max_new_tokens)
    eng, params = self.engine(b), s.rollout_params(params)
    if program == 'prefill':
      return eng.abstract_prefill(s.graphdef, params, p + nb, prompt_len)
    return eng.abstract_decode(s.graphdef, params, p + nb, sp.greedy, sp.filtered)

  def generate(self, params, prompts, rng, sp: SamplingParams, num_samples: int,
               limits: np.ndarray, shape: tuple[int, int, int], *, session, keys,
               record_routing: bool = False) -> SampleOutput:
    """See `Sampler.generate`: rows assembled as the one-call path returns them."""
    p, nb, c = shape
    row_tokens = p + nb if session is None else session.row_tokens
    rows = self._run(self.engine(c), params, prompts, num_samples, limits, rng, sp,
                     row_tokens, session=session, keys=keys, record=record_routing)
    p_max = max(q.size for q in prompts)
    return self._assemble(rows, [prompts[r // num_samples] for r in range(len(rows.tokens))],
                          p_max, sp.max_new_tokens)

  def _run(self, eng, params, prompts, num_samples, limits, rng, sp, row_tokens,
           stream=None, session=None, keys=None, record=False):
    s = self.sampler
    before = (eng.compile_count, eng.decode_slots, eng.generated_tokens)
    scalars = (np.float32(sp.temperature if not sp.greedy else 1.0), np.float32(sp.top_p),
               np.int32(sp.top_k))
    try:
      return eng.run(s.rollout_params(params), prompts, num_samples, limits, rng, scalars,
                     greedy=sp.greedy, filtered=sp.filtered, row_tokens=row_tokens,
                     stream=stream, session=session, keys=keys, record_routing=record)
    finally:
      s.compile_count += eng.compile_count - before[0]
      s.decode_slots += eng.decode_slots - before[1]
      s.generated_tokens += eng.generated_tokens - before[2]

  def _assemble(self, rows: scheduler.Rows, row_prompts: Sequence[np.ndarray], width: int,
                m: int) -> SampleOutput:
    """A SampleOutput of engine rows: prompts left-padded to `width`, completions to `m`."""
    pad_id = self.sampler.pad_id
    n = len(rows.tokens)
    prompt_tokens = np.full((n, width), pad_id, np.int32)
    prompt_mask = np.zeros((n, width), np.int32)
    tokens = np.full((n, m), pad_id, np.int32)
    logprobs = np.zeros((n, m), np.float32)
    sampling_logprobs = np.zeros((n, m), np.float32)
    lengths = np.array([t.size for t in rows.tokens], np.int32)
    for r in range(n):
      q = row_prompts[r]
      prompt_tokens[r, width - q.size:], prompt_mask[r, width - q.size:] = q, 1
      k = lengths[r]
      tokens[r, :k], logprobs[r, :k] = rows.tokens[r], rows.logprobs[r]
      sampling_logprobs[r, :k] = rows.sampling_logprobs[r]
    mask = (np.arange(m)[None, :] < lengths[:, None]).astype(np.int32)
    routed = {} if rows.routing is None else self._routing(rows, row_prompts, width, m)
    return SampleOutput(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens,
                        mask=mask, logprobs=logprobs, sampling_logprobs=sampling_logprobs,
                        lengths=lengths, truncated=~rows.stopped, **routed)

  def _routing(self, rows: scheduler.Rows, row_prompts, width: int, m: int) -> dict:
    """`SampleOutput`'s prompt_routing [n, width, M, k] (left-padded) and routing [n, m, M, k]
    of engine rows, each row's [prompt + generated tokens, M, k] split at its prompt."""
    cfg = self.sampler.cfg
    n, tail = len(rows.tokens), (cfg.mixers.count('moe'), cfg.experts_per_token)
    dt = routing_dtype(cfg.num_experts)
    prompt = np.zeros((n, width) + tail, dt)
    gen = np.zeros((n, m) + tail, dt)
    for r in range(n):
      q, got, k = row_prompts[r].size, rows.routing[r], rows.tokens[r].size
      if got.shape[0] != q + k:
        raise AssertionError(f'engine row {r}: routing of {got.shape[0]} tokens for a prompt '
                             f'of {q} and {k} generated (a bug)')
      prompt[r, width - q:] = got[:q]
      gen[r, :k] = got[q:]
    return dict(prompt_routing=prompt, routing=gen)

  def stream(self, params, rng, sp: SamplingParams, num_samples: int, source,
             max_prompt_len: int, rows: int, record_routing: bool = False) -> int:
    """See `Sampler.stream`."""
    if num_samples < 1:
      raise ValueError(f'num_samples={num_samples} must be >= 1')
    if isinstance(rng, (int, np.integer)):
      rng = jax.random.key(rng)
    s = self.sampler
    p, nb, c = s.call_shape(rows, max_prompt_len, sp.max_new_tokens)
    fed: list[np.ndarray] = []
    outer = self

    class Adapter:
      def more(self):
        got = source.more()
        if got is None:
          return None
        limits = None
        if isinstance(got, tuple):
          got, limits = got
        got = [np.asarray(q, np.int64).reshape(-1) for q in got]
        limits = _row_limits(limits, len(got) * num_samples, sp.max_new_tokens,
                             'stream: row limits')
        for i, q in enumerate(got):
          if q.size == 0 or q.size > max_prompt_len:
            raise ValueError(f'stream: prompt {len(fed) + i} has {q.size} tokens (expected 1 '
                             f'to max_prompt_len={max_prompt_len})')
          s._check_ids(q, f'stream: prompt {len(fed) + i}')
        fed.extend(got)
        return got, limits

      def finished(self, groups, rows):
        row_prompts = [fed[g] for g in groups for _ in range(num_samples)]
        source.finished(groups, outer._assemble(rows, row_prompts, max_prompt_len,
                                                sp.max_new_tokens))

      def stop(self):
        return bool(source.stop())

    self._run(self.engine(c), params, [], num_samples, np.zeros(0, np.int64), rng, sp,
              p + nb, stream=Adapter(), record=record_routing)
    return len(fed)


_ENGINE_TYPES = {'one_call': _OneCall, 'paged': _Paged}
