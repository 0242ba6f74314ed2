"""A frozen judge model: batched next-token choice probabilities and greedy verdicts, on a mesh.

`JudgeModel` holds a model of any supported family (params + graphdef + its
ModelConfig) and its tokenizer, and answers the two questions a judge
verifier (`verifiers.judge`) asks of token rows it has built:

* `choice_logprobs(rows, choice_ids)`: one forward per row; at the row's last
  position (the answer position) the log-softmax over the logits of the
  given token ids only, [n, k]: P(YES) = exp of column 0 when the choices
  are (YES, NO). No sampling.
* `generate(rows, max_new_tokens)`: greedy completions through
  `rl.sampler.Sampler`, all rows in one call (its batch buckets and chunks).

Rows are batched in fixed-size batches (the last filled with copies) padded
to a power-of-two length bucket, so few shapes compile, as
`rl.reward_model.make_text_scorer` does. With a mesh the params must live on
it (`from_hf` loads them there) and the rows are split over its batch shards.

  judge = rl.judge.JudgeModel.from_hf('/ckpt/Qwen3-8B', mesh=mesh)
  v = verifiers.get('judge', judge=judge, template='pointwise_yes_no', score_by='logits')
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from foundation import tokenizer as tokenizer_lib
from models import config as config_lib
from models import hf
from models import sharding
from rl import buckets
from rl import sampler as sampler_lib


def _choice_logprobs(graphdef, params, tokens, segment_ids, choice_ids, rules):
  """[B, k] log-softmax over `choice_ids`' logits at each row's last real token.

  Args:
    graphdef, params: the judge (`nnx.split`).
    tokens: [B, T] int32, right-padded.
    segment_ids: [B, T] int32, 0 = padding; every row has a real token.
    choice_ids: [k] int32 token ids.
    rules: static; the logical rules the pass traces with.
  """
  model = nnx.merge(graphdef, params)
  model.rules = rules
  t = tokens.shape[1]
  real = segment_ids != 0
  positions = jnp.maximum(jnp.cumsum(real, 1) - 1, 0).astype(jnp.int32)
  hidden, _ = model.hidden(tokens, positions, segment_ids)                 # [B, T, D]
  last = jnp.max(jnp.where(real, jnp.arange(t), 0), axis=1)               # [B]
  h = jnp.take_along_axis(hidden, last[:, None, None], 1)                  # [B, 1, D]
  logits = model.logits_from_hidden(h)[:, 0]                               # [B, V] float32
  picked = jnp.take(logits, choice_ids, axis=1)                            # [B, k]
  return jax.nn.log_softmax(picked, axis=-1)


choice_logprobs_fn = jax.jit(_choice_logprobs, static_argnums=(0, 5))

# A judge's defaults: rows per jitted forward, and its longest row in tokens.
BATCH_SIZE = 8
MAX_LEN = 8192


def run_sampler_options(run_options: dict, judge_cfg: config_lib.ModelConfig,
                    policy_cfg: config_lib.ModelConfig, mesh=None, rules=None) -> dict:
  """A judge's Sampler options, from the run's (its policy sampler's):

  - the default length buckets: a judge's prompt holds the policy's prompt and answer and
    more;
  - of the `rollout_rules`, only those on logical axes no weight carries
    (`models.sharding.ACTIVATION_AXES`, e.g. the sequence mesh's rows split over 'sequence'
    too): the judge's rows split as many ways as the policy's, while its weights stay in the
    layout they were loaded in (split over every axis its rules split them over), so its
    sampler makes no copy of them. A rule that moves weights is dropped: beside the policy's
    train state, its rollout copy and its KV pool there is no room for a second,
    fsdp-replicated copy of a judge that is often far larger than the policy (a 235B judge
    replicated over fsdp holds 470 GB / 8 experts shards = 59 GB on each v5p chip);
  - the same KV bytes: `cache_tokens_per_device` (and an explicit `pages`) count the
    policy's KV slots, so they are scaled by the policy's KV bytes per token over the
    judge's (`rl.sampler.kv_token_bytes` on `mesh`): a judge whose tokens cost 30x the
    policy's holds 1/30 of the tokens in the same memory, instead of 30x the memory. An
    explicit `pages` is split over the batch shards of the rules the judge's Sampler uses
    (`rules` with the kept rollout rules), the policy's own.
  """
  kept = tuple((k, v) for k, v in (run_options.get('rollout_rules') or ())
               if k in sharding.ACTIVATION_AXES)
  out = {k: v for k, v in run_options.items()
         if k not in ('prompt_buckets', 'new_token_buckets', 'rollout_rules')}
  if kept:
    out['rollout_rules'] = kept
  used = sharding.override_rules(rules, kept)     # what the judge's Sampler traces with
  mine = sampler_lib.kv_token_bytes(judge_cfg, mesh, used)
  theirs = sampler_lib.kv_token_bytes(policy_cfg, mesh, used)
  if mine and theirs:
    if out.get('cache_tokens_per_device'):
      out['cache_tokens_per_device'] = max(1, int(out['cache_tokens_per_device']) * theirs
                                           // mine)
    if out.get('pages'):
      shards = sharding.batch_shards(mesh, used)
      per_shard = int(out['pages']) // shards * theirs // mine
      out['pages'] = max(1, per_shard) * shards
  return out


class JudgeModel:
  """A frozen judge; see the module docstring.

  Args:
    graphdef: the judge's nnx GraphDef (`nnx.split(model)[0]`).
    params: its params (on `mesh` when one is given); never modified.
    model_cfg: its ModelConfig.
    tokenizer: its tokenizer (`foundation.tokenizer.Tokenizer`): encode, encode_text,
      decode, eos_id, pad_id, added_tokens.
    mesh, rules: where the params live (None: one device) and the logical rules.
    batch_size: rows per jitted forward of `choice_logprobs` (rounded up to a
      multiple of the mesh's batch shards).
    max_len: the longest row, in tokens (longer rows are a ValueError: the
      verifier caps the hostile fields so its rows fit).
    sampler_options: keyword options of the `rl.sampler.Sampler` that `generate` uses
      (buckets, engine, cache budget); eos/pad ids, mesh and rules are the judge's.
    policy_cfg: when given, `sampler_options` are the run's (its policy sampler's, whose
      `cache_tokens_per_device` counts this model's KV slots) and the judge samples with
      `run_sampler_options(those, model_cfg, policy_cfg, mesh, rules)`.
  """

  def __init__(self, graphdef, params, model_cfg: config_lib.ModelConfig, tokenizer, *,
               mesh=None, rules=None, batch_size: int = BATCH_SIZE, max_len: int = MAX_LEN,
               sampler_options: dict | None = None,
               policy_cfg: config_lib.ModelConfig | None = None):
    if batch_size < 1:
      raise ValueError(f'JudgeModel: batch_size must be >= 1, got {batch_size}')
    if max_len < 2:
      raise ValueError(f'JudgeModel: max_len must be >= 2, got {max_len}')
    if tokenizer.eos_id is None:
      raise ValueError('JudgeModel: the tokenizer has no end-of-sequence token')
    if tokenizer.vocab_size > model_cfg.vocab_size:
      raise ValueError(f'JudgeModel: the tokenizer has {tokenizer.vocab_size} tokens, the model '
                       f'{model_cfg.vocab_size}')
    self.graphdef, self.params, self.cfg = graphdef, params, model_cfg
    self.tokenizer = tokenizer
    self.mesh, self.rules = mesh, rules
    shards = sharding.batch_shards(mesh, rules)
    self.batch_size = -(-int(batch_size) // shards) * shards
    self.max_len = int(max_len)
    self._sampler_options = dict(sampler_options or {})
    if policy_cfg is not None:
      self._sampler_options = run_sampler_options(self._sampler_options, model_cfg, policy_cfg,
                                                  mesh, rules)
    self._sampler = None
    self._rollout = None

  @classmethod
  def from_hf(cls, path: str, *, tokenizer_path: str | None = None, mesh=None, rules=None,
              dtype=None, **options) -> 'JudgeModel':
    """A judge loaded from an HF checkpoint directory (local or gs://; `models.hf.load_model`).

    Args:
      path: the checkpoint directory.
      tokenizer_path: where its tokenizer is (default: `path`).
      mesh, rules: place the params sharded on this mesh as they are read.
      dtype: parameter and compute dtype (default: the checkpoint's).
      **options: the constructor's batch_size, max_len, sampler_options, policy_cfg.
    """
    model = hf.load_model(path, mesh=mesh, rules=rules, dtype=dtype)
    graphdef, params = nnx.split(model)
    tok = tokenizer_lib.load(tokenizer_path or path)
    return cls(graphdef, params, model.cfg, tok, mesh=mesh, rules=rules, **options)

  def _check_rows(self, rows: Sequence[Sequence[int]]) -> list[np.ndarray]:
    out = []
    for i, r in enumerate(rows):
      r = np.asarray(r, np.int64).reshape(-1)
      if r.size == 0 or r.size > self.max_len:
        raise ValueError(f'JudgeModel: row {i} has {r.size} tokens (1 .. max_len={self.max_len})')
      if r.min() < 0 or r.max() >= self.cfg.vocab_size:
        raise ValueError(f'JudgeModel: row {i} has ids outside [0, {self.cfg.vocab_size})')
      out.append(r)
    return out

  def choice_logprobs(self, rows: Sequence[Sequence[int]], choice_ids: Sequence[int]
                      ) -> np.ndarray:
    """Log-probabilities [n, k] of the k choice tokens at each row's answer position.

    Args:
      rows: n token-id rows (each the judge's whole prompt, ending where the
        verdict token comes next).
      choice_ids: k distinct token ids (e.g. the first tokens of 'YES', 'NO').

    Returns:
      float64 [n, k]: log-softmax over the k choices' logits only.
    """
    rows = self._check_rows(rows)
    ids = np.asarray(choice_ids, np.int32)
    out = np.zeros((len(rows), ids.size), np.float64)
    with sharding.use_mesh(self.mesh):
      for start in range(0, len(rows), self.batch_size):
        chunk = rows[start:start + self.batch_size]
        full = chunk + [chunk[0]] * (self.batch_size - len(chunk))
        length = buckets.pow2(max(r.size for r in full), lo=16, hi=self.max_len)
        tokens = np.full((self.batch_size, length), self.tokenizer.pad_id, np.int32)
        seg = np.zeros((self.batch_size, length), np.int32)
        for i, r in enumerate(full):
          tokens[i, :r.size], seg[i, :r.size] = r, 1
        if self.mesh is not None:
          spec = sharding.logical_to_spec(('batch', None), tokens.shape, self.mesh, self.rules)
          row_sh = jax.sharding.NamedSharding(self.mesh, spec)
          tokens, seg = jax.device_put(tokens, row_sh), jax.device_put(seg, row_sh)
        lp = choice_logprobs_fn(self.graphdef, self.params, tokens, seg, ids,
                                sharding.as_rules(self.rules))
        out[start:start + len(chunk)] = sharding.to_host(lp)[:len(chunk)]
    return out

  @property
  def sampler(self) -> sampler_lib.Sampler:
    """The judge's own Sampler (built on first use)."""
    if self._sampler is None:
      self._sampler = sampler_lib.Sampler(
          self.graphdef, self.cfg, eos_ids=[self.tokenizer.eos_id], pad_id=self.tokenizer.pad_id,
          mesh=self.mesh, rules=self.rules, **self._sampler_options)
    return self._sampler

  def generate(self, rows: Sequence[Sequence[int]], max_new_tokens: int) -> list[str]:
    """Greedy completions of every row in one Sampler call, decoded up to the stop token.

    Args:
      rows: token-id rows (the judge's prompts).
      max_new_tokens: the most tokens generated per row.

    Returns:
      One text per row (the stop token dropped, other special tokens kept as text).
    """
    rows = self._check_rows(rows)
    if self._rollout is None:
      self._rollout = self.sampler.prepare(self.params)   # frozen: the rollout copy is made once
    sp = sampler_lib.SamplingParams(greedy=True, max_new_tokens=int(max_new_tokens))
    out = self.sampler.generate(self._rollout, rows, 0, sp)
    texts = []
    for toks, n in zip(np.asarray(out.tokens), np.asarray(out.lengths)):
      ids = [int(t) for t in toks[:int(n)] if int(t) != self.tokenizer.eos_id]
      # Special tokens kept: a thinking judge's <think> block must stay visible to the parser.
      texts.append(self.tokenizer.decode(ids))
    return texts
