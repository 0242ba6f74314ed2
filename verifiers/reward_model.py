"""Reward-model verifier: a scalar reward model's score of the answer (RLHF stages).

The scorer is a callable `(prompts, completions) -> [batch] scores`, normally
`rl.reward_model.make_text_scorer(...)` around the Flax Bradley-Terry model;
it runs in this process, batched, on the device. Following Nemotron-Cascade,
only the answer after the thinking block is scored, and a completion whose
thinking never closed is scored whole (unless `thinking_unfinished_reward`
is set). With `mixed_language_penalty`, an answer that mixes in a script the
prompt does not use gets the lowest score of the batch minus 10.

Metadata: none needed (any dict).
"""

from __future__ import annotations

import collections
import unicodedata
from typing import Callable, Sequence

import numpy as np

from foundation import chat
from verifiers import base

Scorer = Callable[[Sequence[str], Sequence[str]], np.ndarray]
PENALTY = 10.0
# Scripts that appear in any language's technical text (code, names, maths).
_NEUTRAL = frozenset({'LATIN', 'GREEK'})
# Writing systems of one language family, counted as one script.
_GROUPS = {'HIRAGANA': 'CJK', 'KATAKANA': 'CJK', 'HANGUL': 'CJK', 'BOPOMOFO': 'CJK',
           'FULLWIDTH': 'CJK', 'HALFWIDTH': 'CJK', 'IDEOGRAPHIC': 'CJK'}


def scripts(text: str) -> collections.Counter:
  """Letters per writing system ('LATIN', 'CJK', 'CYRILLIC', ...)."""
  out = collections.Counter()
  for c in text:
    if c.isalpha():
      name = unicodedata.name(c, '')
      if name:
        first = name.split(' ')[0]
        out[_GROUPS.get(first, first)] += 1
  return out


def mixes_language(prompt: str, answer: str, min_chars: int = 3) -> bool:
  """Whether the answer uses a non-Latin script the prompt does not.

  Latin and Greek are allowed everywhere (code, names, formulas); any other
  script with at least `min_chars` letters in the answer must also occur in
  the prompt.

  Args:
    prompt: the prompt text.
    answer: the answer text.
    min_chars: letters of a foreign script that count as mixing.

  Returns:
    True for a mixed-language answer.
  """
  in_prompt = scripts(prompt)
  return any(n >= min_chars and s not in _NEUTRAL and s not in in_prompt
             for s, n in scripts(answer).items())


class RewardModelVerifier(base.Verifier):
  """Scores answers with `scorer`; see the module docstring."""

  name = 'reward_model'
  reward_model_option = 'scorer'
  needs_reward_model = True

  def __init__(self, *, scorer: Scorer, mixed_language_penalty: bool = False,
               mixed_language_min_chars: int = 3, thinking_unfinished_reward: float | None = None):
    """Options.

    The common `workers` and `timeout_s` options do not exist here: the
    scorer runs batched in this process, on the device.

    Args:
      scorer: `(prompts, answers) -> np.ndarray [batch]`.
      mixed_language_penalty: apply the paper's mixed-language penalty.
      mixed_language_min_chars: letters of a foreign script that count.
      thinking_unfinished_reward: None scores an unfinished completion whole
        (the paper's rule); a number gives it that reward instead.
    """
    super().__init__(thinking_unfinished_reward=thinking_unfinished_reward, workers=1)
    if not callable(scorer):
      raise ValueError(f'reward_model: scorer must be callable, got {type(scorer).__name__}')
    self.scorer = scorer
    self.mixed_language_penalty = bool(mixed_language_penalty)
    self.mixed_language_min_chars = int(mixed_language_min_chars)

  def score(self, samples: Sequence[base.Sample]) -> list[base.Result]:
    """Scores a batch with one scorer call (see `base.Verifier.score`)."""
    results: list[base.Result | None] = [None] * len(samples)
    idx, prompts, texts, notes = [], [], [], []
    for i, s in enumerate(samples):
      split = chat.split_thinking(s.completion)
      if not split.finished_thinking and self.thinking_unfinished_reward is not None:
        results[i] = base.Result(float(self.thinking_unfinished_reward),
                                 {'reason': 'thinking block never closed', 'thinking': 'unfinished'})
        continue
      idx.append(i)
      prompts.append(s.prompt)
      if split.finished_thinking:
        texts.append(split.answer)
        notes.append('answer after the thinking block' if split.had_thinking else 'whole answer')
      else:
        texts.append(s.completion)
        notes.append('whole text (thinking never closed)')
    if idx:
      scores = np.asarray(self.scorer(prompts, texts), dtype=np.float64)
      if scores.shape != (len(idx),):
        raise ValueError(f'reward_model: scorer returned shape {scores.shape} for {len(idx)} texts')
      finite = scores[np.isfinite(scores)]
      floor = (float(finite.min()) if finite.size else 0.0) - PENALTY
      for k, i in enumerate(idx):
        info = {'reason': f'reward model score of the {notes[k]}', 'rm_score': float(scores[k])}
        reward = float(scores[k])
        if not np.isfinite(reward):
          reward, info['reason'] = 0.0, 'reward model returned a non-finite score'
        elif self.mixed_language_penalty and mixes_language(prompts[k], texts[k],
                                                            self.mixed_language_min_chars):
          reward, info['reason'] = floor, 'mixed-language answer: lowest score in batch - 10'
        results[i] = base.Result(reward, info)
    return results
