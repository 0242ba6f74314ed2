"""Kind 'sft': supervised fine-tuning on packed (prompt, response) records; the prompt is context.

A stage dict:

  dict(name='sft', kind='sft', domains=[...], datasets=['sft'], steps=600, batch_size=24,
       max_len=256, optimizer=dict(lr=1e-3, schedule='cosine', warmup_steps=20))

Each step takes `batch_size` examples: records tokenized once (`Config.tokenize`,
cached by `cascade.data.token_cache`), each rendered in the mode its record asks for
(a record with a thinking trace in thinking mode, else instruct mode;
`thinking_switch=False`: no mode switch at all), packs them into rows of
`max_len` tokens (segment ids keep them apart) and takes one update on the
response tokens' cross-entropy. Rows are padded to a power of two (and a
multiple of microbatches x batch shards) so few shapes compile.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from cascade import episodes
from cascade import rollout
from cascade.kinds import base
from cascade.kinds import loop
from foundation import chat_template
from foundation import tokenizer as tokenizer_lib
from models import sharding
from rl import batch as batch_lib
from rl import sft as sft_lib
from rl import train_step as train_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(base.TrainStageConfig):
  RECORDS: ClassVar[str] = 'sft'

  batch_size: int = base.field(check=base.int_at_least(1))
  max_len: int = base.field(check=base.int_at_least(2))
  thinking_switch: bool = base.field(True, check=base.BOOL)

  def check_lengths(self, max_seq, fail):
    if max_seq is not None and self.max_len > max_seq:
      fail('max_len', f"exceeds the model's max_seq_len={max_seq}")

  def tokenize(self, tokenizer):
    return lambda r: example(r, tokenizer, self.thinking_switch, self.max_len)

  def tokenize_batch(self, tokenizer):
    return lambda recs: examples(recs, tokenizer, self.thinking_switch, self.max_len)

  def record_filter(self, tokenizer):
    del tokenizer
    return (lambda ex: bool(np.any(ex[1]))), f'examples whose prompt fills max_len={self.max_len}'


def example(rec: dict, tokenizer, thinking_switch: bool, max_len: int):
  """(tokens, loss mask) of an SFT record: the prompt is context, the response is learned.

  A multi-turn demonstration (`turns`) is tokenized as an agentic episode is
  (`episodes.demonstration`): every assistant turn learned, tool results context. The
  prompt and response are the tokenizer's chat template's (`chat_template.of`): with a
  checkpoint's own, the response is what that template renders after the prompt.
  """
  template = chat_template.of(tokenizer)
  if 'turns' in rec:
    if template is not chat_template.BUILTIN:
      raise ValueError(f'SFT record {rec.get("id")!r}: a multi-turn demonstration (turns) is '
                       "rendered with the built-in template's tool turns, not a checkpoint's "
                       "own: config.tokenizer.chat_template='builtin'")
    toks, mask = episodes.demonstration(rec, tokenizer, False if thinking_switch else None,
                                        tools=rec.get('tools'))
    return toks[:max_len], mask[:max_len]
  prompt, response = (tokenizer.encode(t) for t in texts(rec, template, thinking_switch))
  toks = (prompt + response)[:max_len]
  mask = ([0] * len(prompt) + [1] * len(response))[:max_len]
  return toks, mask


def texts(rec: dict, template, thinking_switch: bool) -> tuple[str, str]:
  """The rendered (prompt, response) of a single-turn SFT record, as `example` encodes them."""
  thinking = rec.get('thinking')
  mode = (thinking is not None) if thinking_switch else None
  # In instruct mode the empty thinking block is already in the prompt.
  return (rollout.prompt_text(rec, mode, template),
          template.render_response(rec['messages'], rec['response'], thinking, mode))


def examples(recs: list, tokenizer, thinking_switch: bool, max_len: int) -> list:
  """`example` of each record, the same ids, with every text encoded in one call of the
  tokenizer library on all cores (`Tokenizer.encode_batch`): how the token cache prepares a
  stage. Tokens and mask come as int32 arrays."""
  template = chat_template.of(tokenizer)
  out, rendered, single = [None] * len(recs), [], []
  for k, rec in enumerate(recs):
    if 'turns' in rec:
      out[k] = example(rec, tokenizer, thinking_switch, max_len)
    else:
      rendered += texts(rec, template, thinking_switch)
      single.append(k)
  ids = tokenizer_lib.encode_batch(tokenizer, rendered)
  for n, k in enumerate(single):
    prompt, response = ids[2 * n], ids[2 * n + 1]
    toks = np.asarray(prompt + response, np.int32)[:max_len]
    mask = np.zeros(len(prompt) + len(response), np.int32)
    mask[len(prompt):] = 1
    out[k] = toks, mask[:max_len]
  return out


LOSS = train_lib.LossSpec(sft_lib.SftConfig, sft_lib.loss_fn, sft_lib.normalizers)


def loss(stage: Config):
  del stage
  return LOSS, None


def abstract_batch(stage: Config, mesh, rules):
  rows_sh = NamedSharding(mesh, sharding.logical_to_spec(('batch',), None, mesh, rules))
  b = base.rows_bucket(stage.batch_size, stage.microbatches * sharding.batch_shards(mesh, rules))
  mat = lambda dt: jax.ShapeDtypeStruct((b, stage.max_len), jnp.dtype(dt), sharding=rows_sh)
  batch = batch_lib.TrainBatch(tokens=mat(jnp.int32), positions=mat(jnp.int32),
                               segment_ids=mat(jnp.int32), targets=mat(jnp.int32),
                               loss_mask=mat(jnp.float32))
  return batch, (f'{b} packed rows x {stage.max_len} tokens, {stage.microbatches} '
                 'microbatch(es)')


def run(ctx, stage: Config) -> base.StageResult:
  pad_id = ctx.tokenizer.pad_id

  def batches(examples):
    # The stage's items are already tokenized (`Config.tokenize`; from the prepared cache).
    ex = list(examples)
    packed = sft_lib.pack(ex, stage.max_len, pad_id=pad_id)
    rows = base.rows_bucket(packed.tokens.shape[0], stage.microbatches * ctx.batch_shards)
    batch = sft_lib.pack(ex, stage.max_len, num_rows=rows, pad_id=pad_id)
    return [batch], {'examples': len(ex), 'rows': rows,
                     'learned_tokens': float(np.sum(batch.loss_mask))}

  maker = loop.record_batches(ctx, stage, batches)
  return loop.train_stage(ctx, KIND, stage, maker)


KIND = base.Kind('sft', Config, run, loss=loss, abstract_batch=abstract_batch)
