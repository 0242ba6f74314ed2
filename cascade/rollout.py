"""Prompts in, scored completions out: chat rendering, group sampling, detokenising, verifying.

Shared by the RL stages and the evaluation. Host side only, apart from the
sampler call. A record's prompt is rendered with `models.chat.render` in the
mode it was drawn for (thinking: ' /think'; instruct: ' /no_think' and a
pre-filled empty thinking block; None: no switch), encoded, sampled G times,
and each completion is scored by the verifier of its record's domain, so a
batch may mix domains (the blended baseline) with no branch on any domain.

Verifiers receive `Sample(prompt=<the conversation rendered without a mode
switch>, completion=<decoded text, special tokens kept>, metadata=<record
metadata>)`: the mode-free prompt is the text a reward model is trained on.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from models import chat
from rl import sampler as sampler_lib


def prompt_text(record: dict, thinking: bool | None) -> str:
  """The generation prompt of a record in a mode."""
  return chat.render(record['messages'], thinking=thinking)


def verifier_prompt(record: dict) -> str:
  """The prompt as verifiers and reward models see it (no mode switch)."""
  return chat.render(record['messages'], thinking=None)


def longest_prompt_len(record: dict, tokenizer, modes: Sequence[bool | None]) -> int:
  """Tokens of the record's prompt in the longest of the modes it may be drawn in."""
  return max(len(tokenizer.encode(prompt_text(record, m))) for m in modes)


def stage_modes(thinking_fraction: float | None) -> tuple:
  """The modes a stage draws prompts in."""
  if thinking_fraction is None:
    return (None,)
  return tuple(m for m, on in ((True, thinking_fraction > 0), (False, thinking_fraction < 1))
               if on)


def draw_modes(n: int, thinking_fraction: float | None, rng: np.random.Generator) -> list:
  """Each of n prompts' mode: thinking with probability `thinking_fraction` (None: no switch)."""
  if thinking_fraction is None:
    return [None] * n
  return [bool(u < thinking_fraction) for u in rng.random(n)]


class Rollouts(NamedTuple):
  """G completions of each of n prompts; every per-row list has n * G entries (prompt-major).

  Attributes:
    records: the record of each row.
    modes: the thinking mode of each row.
    completions: decoded completion text of each row (stop token kept).
    samples: the sampler's SampleOutput (numpy).
  """
  records: list
  modes: list
  completions: list
  samples: sampler_lib.SampleOutput


def generate(sampler, params, tokenizer, records: Sequence[dict], modes: Sequence,
             rng, sp: sampler_lib.SamplingParams, group_size: int) -> Rollouts:
  """Samples `group_size` completions of every record's prompt.

  Args:
    sampler: an `rl.sampler.Sampler`.
    params: the policy's params.
    tokenizer: a `models.tokenizer.Tokenizer`.
    records: canonical prompt records.
    modes: one thinking mode per record (True, False or None).
    rng: PRNG key for this call.
    sp: sampling parameters.
    group_size: G.

  Returns:
    Rollouts with len(records) * G rows.
  """
  ids = [tokenizer.encode(prompt_text(r, m)) for r, m in zip(records, modes)]
  out = sampler.generate(params, ids, rng, sp, num_samples=group_size)
  # Ids past the tokenizer's vocabulary (a model's padded embedding rows) decode to nothing.
  completions = [tokenizer.decode([t for t in out.tokens[i, :int(out.lengths[i])].tolist()
                                   if t < tokenizer.vocab_size])
                 for i in range(out.tokens.shape[0])]
  rep = lambda xs: [x for x in xs for _ in range(group_size)]
  return Rollouts(records=rep(records), modes=rep(modes), completions=completions, samples=out)


def score(rollouts: Rollouts, verifier_of: Callable[[str], object],
          sample_cls) -> tuple[np.ndarray, list[dict]]:
  """Scores every row with its own domain's verifier (one batched call per domain).

  Args:
    rollouts: from `generate`.
    verifier_of: domain name -> verifier (has `score(samples) -> [Result]`).
    sample_cls: `verifiers.Sample`.

  Returns:
    (rewards [rows] float32, infos [rows] dicts).
  """
  n = len(rollouts.records)
  rewards = np.zeros(n, np.float32)
  infos: list[dict] = [{} for _ in range(n)]
  by_domain: dict[str, list[int]] = {}
  for i, rec in enumerate(rollouts.records):
    by_domain.setdefault(rec['domain'], []).append(i)
  for domain in sorted(by_domain):
    rows = by_domain[domain]
    samples = [sample_cls(prompt=verifier_prompt(rollouts.records[i]),
                          completion=rollouts.completions[i],
                          metadata=rollouts.records[i]['metadata']) for i in rows]
    results = verifier_of(domain).score(samples)
    if len(results) != len(rows):
      raise RuntimeError(f'verifier of domain {domain!r} returned {len(results)} results for '
                         f'{len(rows)} samples')
    for i, res in zip(rows, results):
      rewards[i] = float(res.reward)
      infos[i] = dict(res.info or {})
  return rewards, infos
