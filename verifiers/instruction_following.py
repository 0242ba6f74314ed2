"""Instruction-following verifier: IFEval constraints, optionally mixed with a reward model.

Metadata is IFEval's record: {'instruction_id_list': [...], 'kwargs': [...]}
(see `verifiers.ifeval` for the 25 ids and their kwargs). The reward is 1 if
every instruction is followed, else 0 (`reward='all'`), or the fraction
followed (`reward='fraction'`); `mode='loose'` uses IFEval's loose checking.
With `both_modes`, info also holds each instruction's result in both modes
('strict' and 'loose' lists): IFEval's reference reports four accuracies
(prompt- and instruction-level, strict and loose) from one response.

With `rm_scorer`, the reward follows Nemotron-Cascade's thinking-mode IF-RL
rule: R_IF + sigmoid(group-normalised reward-model score) when every
instruction passes, else 0. Groups are the rollouts of one prompt: runs of
`group_size` consecutive samples, or (group_size=None) samples sharing the
prompt text. The scorer runs in this process (it is a device model), on the
answer after the thinking block.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from foundation import chat
from verifiers import base
from verifiers import ifeval

Scorer = Callable[[Sequence[str], Sequence[str]], np.ndarray]


def worker_init() -> None:
  """Loads langdetect's language profiles before the first request."""
  ifeval.follows(['language:response_language'], [{'language': 'en'}],
                 'A warm-up sentence in English.')


def work(payload: dict) -> dict:
  """Worker side: check one response against its instructions."""
  return answer(ifeval.follows, payload)


def answer(follows: Callable[..., list[bool]], payload: dict) -> dict:
  """The worker's answer for one response, checked by `follows` (ifeval's or ifbench's).

  Args:
    follows: `(ids, kwargs, response, loose) -> [bool]`.
    payload: {'ids', 'kwargs', 'response', 'loose', 'fraction', 'both_modes'} from
      `_prepare`.

  Returns:
    `reward_of`'s answer in the payload's mode; with 'both_modes', info's 'strict' and
    'loose' hold each instruction's result in either mode.
  """
  args = payload['ids'], payload['kwargs'], payload['response']
  followed = follows(*args, loose=payload['loose'])
  out = reward_of(followed, payload['fraction'])
  if payload.get('both_modes'):
    other = follows(*args, loose=not payload['loose'])
    strict, loose = (other, followed) if payload['loose'] else (followed, other)
    out['info'].update(strict=strict, loose=loose)
  return out


def reward_of(followed: list[bool], fraction: bool) -> dict:
  """The worker's answer for one response's per-instruction results (shared with ifbench).

  Args:
    followed: one bool per instruction.
    fraction: reward the fraction followed (else 1 iff all are).

  Returns:
    {'reward', 'info'} with the reason, the list and whether all were followed.
  """
  n = sum(followed)
  reward = n / len(followed) if fraction else float(n == len(followed))
  return {'reward': reward, 'info': {
      'reason': f'{n}/{len(followed)} instructions followed', 'followed': followed,
      'all_followed': n == len(followed)}}


def _sigmoid(x: np.ndarray) -> np.ndarray:
  return 1.0 / (1.0 + np.exp(-x))


def group_normalise(scores: np.ndarray, groups: Sequence[int]) -> np.ndarray:
  """(score - group mean) / group std, 0 where a group's scores are all equal.

  Args:
    scores: [batch] float scores.
    groups: [batch] group id of each score.

  Returns:
    [batch] float64 normalised scores.
  """
  scores = np.asarray(scores, dtype=np.float64)
  groups = np.asarray(groups)
  out = np.zeros_like(scores)
  for g in np.unique(groups):
    idx = groups == g
    std = scores[idx].std()
    if std > 0:
      out[idx] = (scores[idx] - scores[idx].mean()) / std
  return out


class InstructionFollowingVerifier(base.Verifier):
  """IFEval rule checks; see the module docstring."""

  name = 'instruction_following'
  worker_fn = 'verifiers.instruction_following:work'
  # The taxonomy's kwargs check: (instruction id, kwargs) -> cleaned kwargs, or ValueError.
  clean_kwargs = staticmethod(ifeval.clean_kwargs)
  reward_model_option = 'rm_scorer'   # thinking mode: the RM term (module docstring)

  def __init__(self, *, mode: str = 'strict', reward: str = 'all', rm_scorer: Scorer | None = None,
               group_size: int | None = None, both_modes: bool = False, **common: Any):
    """Options.

    Args:
      mode: 'strict' or 'loose' (IFEval's two accuracies): the reward's.
      both_modes: also report each instruction's result in both modes (info's 'strict' and
        'loose'), for an evaluation's four accuracies.
      reward: 'all' (1 iff every instruction is followed) or 'fraction'.
      rm_scorer: optional `(prompts, answers) -> [batch] scores`; enables the
        R_IF + sigmoid(group-normalised RM) rule.
      group_size: rollouts per prompt, consecutive in each batch; None groups
        samples by prompt text.
      **common: thinking_unfinished_reward, workers, timeout_s.
    """
    super().__init__(**common)
    if mode not in ('strict', 'loose'):
      raise ValueError(f'{self.name}: mode must be strict or loose, got {mode!r}')
    if reward not in ('all', 'fraction'):
      raise ValueError(f'{self.name}: reward must be all or fraction, got {reward!r}')
    if group_size is not None and group_size < 1:
      raise ValueError(f'{self.name}: group_size must be >= 1, got {group_size}')
    self.mode, self.reward, self.rm_scorer, self.group_size = mode, reward, rm_scorer, group_size
    self.both_modes = bool(both_modes)

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any], **options: Any) -> None:
    ids = base.require(metadata, 'instruction_id_list', list, 'instruction ids')
    kwargs = base.require(metadata, 'kwargs', list, 'one dict per instruction')
    if not ids:
      raise ValueError('metadata["instruction_id_list"] is empty')
    if len(kwargs) != len(ids):
      raise ValueError(f'metadata["kwargs"] has {len(kwargs)} entries for {len(ids)} instructions')
    for k, (instruction_id, kw) in enumerate(zip(ids, kwargs)):
      try:
        cls.clean_kwargs(instruction_id, kw)
      except ValueError as e:
        raise ValueError(f'instruction {k}: {e}') from None

  def _prepare(self, sample: base.Sample, answer: str) -> dict | base.Result:
    md = sample.metadata
    if not answer.strip():
      n = len(md['instruction_id_list'])
      info = {'reason': 'empty answer', 'followed': [False] * n, 'all_followed': False}
      if self.both_modes:
        info.update(strict=[False] * n, loose=[False] * n)
      return base.Result(0.0, info)
    return {'ids': md['instruction_id_list'], 'kwargs': md['kwargs'], 'response': answer,
            'loose': self.mode == 'loose', 'fraction': self.reward == 'fraction',
            'both_modes': self.both_modes}

  def _groups(self, samples: Sequence[base.Sample]) -> list[int]:
    if self.group_size is None:
      ids: dict[str, int] = {}
      return [ids.setdefault(s.prompt, len(ids)) for s in samples]
    if len(samples) % self.group_size:
      raise ValueError(f'{self.name}: batch of {len(samples)} is not a multiple of '
                       f'group_size {self.group_size}')
    return [i // self.group_size for i in range(len(samples))]

  def _finish(self, samples: Sequence[base.Sample], results: list[base.Result]) -> list[base.Result]:
    if self.rm_scorer is None or not samples:
      return results
    groups = self._groups(samples)
    answers = []
    for s in samples:
      split = chat.split_thinking(s.completion)
      answers.append(split.answer if split.finished_thinking else s.completion)
    scores = np.asarray(self.rm_scorer([s.prompt for s in samples], answers), dtype=np.float64)
    if scores.shape != (len(samples),):
      raise ValueError(f'rm_scorer returned shape {scores.shape} for {len(samples)} samples')
    z = group_normalise(scores, groups)
    out = []
    for r, score, zi in zip(results, scores, z):
      if 'all_followed' not in r.info:  # Unfinished thinking, bad metadata, timeout.
        out.append(r)
        continue
      info = dict(r.info, rm_score=float(score), rm_normalised=float(zi))
      if r.info['all_followed']:
        out.append(base.Result(1.0 + float(_sigmoid(zi)), dict(info, reason=r.info['reason'] +
                                                                 '; + sigmoid(normalised RM)')))
      else:
        out.append(base.Result(0.0, info))
    return out
