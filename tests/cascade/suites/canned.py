"""A canned sampler call's output for the suite tests' stand-in samplers."""

import numpy as np

from rl import sampler as sampler_lib


def output(ids, prompts, num_samples: int, max_new_tokens: int) -> sampler_lib.SampleOutput:
  """Every one of len(prompts) x num_samples rows completes with `ids` (cut at
  max_new_tokens), as `Sampler.generate` returns it."""
  b, n = len(prompts) * num_samples, max_new_tokens
  ids = list(ids)[:n]
  toks = np.zeros((b, n), np.int32)
  toks[:, :len(ids)] = ids
  lens = np.full((b,), len(ids), np.int32)
  mask = (np.arange(n)[None] < lens[:, None]).astype(np.int32)
  z = np.zeros((b, n), np.float32)
  p = max(len(x) for x in prompts)
  return sampler_lib.SampleOutput(
      prompt_tokens=np.zeros((b, p), np.int32), prompt_mask=np.ones((b, p), np.int32),
      tokens=toks, mask=mask, logprobs=z, sampling_logprobs=z, lengths=lens,
      truncated=np.zeros((b,), bool))


class CharTokenizer:
  """One id per character (code points below 256), as the stand-in policy's tokenizer."""
  vocab_size, pad_id, eos_id, added_tokens = 256, 0, 1, ()

  def encode(self, text):
    return [ord(c) % 256 for c in text]

  def decode(self, ids, skip_special=False):
    del skip_special
    return ''.join(chr(i) for i in ids)
