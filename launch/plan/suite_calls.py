"""What config.eval.suites ask of the devices (`suite_calls`): each suite's largest sampler call
(its prompts per call x its protocol's samples, its longest prompt, its protocol's new-token
budget, with config.eval.suite_protocol applied) and the local judge model a suite's grader runs
(`SuiteCall.judge`: ArenaHard's judge=DIR; a served judge, url=, runs on other machines and
costs these devices nothing).

The longest prompt is measured where it can be: the suite's files under config.eval.suite_data
read as the run reads them, each record rendered in the protocol's thinking mode with the run's
tokenizer and chat template (`Suite.prompt_text`: an agentic suite's opening lists its tools) and
counted; a suite that samples in turns says what its largest call is (`Suite.planned_call`: the
last turn's prompt holds the episode so far). Where the files or the
tokenizer are not there (a plan made before the data is placed), the suite's own bound stands
in (`Suite.planned_prompts`: a generated suite's exact length, a released benchmark's assumed
longest prompt, docs/evaluation.md), and a call is assumed to hold a full batch of prompts;
`SuiteCall.how` says which.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from launch.plan import judges as judges_lib


@dataclasses.dataclass(frozen=True)
class SuiteCall:
  """One suite's largest sampler call and its grader's local judge, as the plan counts them.

  Attributes:
    suite: the suite's name.
    prompts: prompts in its largest call (config.eval.suite_batch_size, or fewer where the suite
      has fewer: config.eval.suite_prompts, its records).
    samples: completions per prompt (its protocol's; 1 when greedy).
    prompt_len: its longest rendered prompt, in tokens.
    max_new_tokens: its protocol's completion budget.
    top_p, top_k: its protocol's.
    how: where prompt_len and prompts come from ('measured on DIR' or the assumption).
    judge: the local judge model its grader runs (`judges.JudgeCall`), or None.
  """
  suite: str
  prompts: int
  samples: int
  prompt_len: int
  max_new_tokens: int
  top_p: float
  top_k: int
  how: str
  judge: Any = None

  @property
  def rows(self) -> int:
    return self.prompts * self.samples

  def sizes(self) -> dict:
    """`programs.sampler_lowering`'s size arguments of the call."""
    return dict(rows=self.rows, prompt_len=self.prompt_len, max_new_tokens=self.max_new_tokens,
                top_p=self.top_p, top_k=self.top_k, num_samples=self.samples)


def _tokenizer(plan):
  """The run's tokenizer with its chat template, or (None, why) where it does not load here."""
  from foundation import chat_template  # pylint: disable=g-import-not-at-top
  from foundation import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  try:
    return chat_template.attach(tokenizer_lib.load(plan.tokenizer_path), plan.chat_template), ''
  except (OSError, ValueError) as e:
    return None, f'config.tokenizer.path={plan.tokenizer_path} does not load here ({e})'


def _measured(plan, suite, tokenizer) -> tuple[int, int] | str:
  """(records scored, their longest rendered prompt in tokens) of `suite`'s files under
  config.eval.suite_data, or why they were not measured."""
  from cascade.suites import base  # pylint: disable=g-import-not-at-top
  from foundation import chat_template  # pylint: disable=g-import-not-at-top
  ev = plan.eval
  if not suite.files:
    return 'it generates its records'
  if not ev.suite_data:
    return 'config.eval.suite_data names no directory'
  if isinstance(tokenizer, str):
    return tokenizer
  where = suite.directory(ev.suite_data)
  try:
    records = suite.read(where)
  except (base.DataMissing, base.BadRecord) as e:
    return str(e)
  records = records[:ev.suite_prompts] if ev.suite_prompts else records
  template = chat_template.of(tokenizer)
  mode = ev.suite_settings(suite.name).thinking
  longest = max(len(tokenizer.encode(suite.prompt_text(r, mode, template))) for r in records)
  return len(records), longest


def _judge_call(plan, suite, prompts: int, samples: int, model_for) -> Any:
  """The JudgeCall of the local judge `suite`'s grader runs with config.eval.suite_options, or
  None (no judge, or a served one)."""
  use = suite.judge_use(plan.eval.grader_options(suite.name))
  if use is None:
    return None
  path, how = use
  where = f'config.eval.suite_options.{suite.name}.judge'
  cfg = judges_lib._judge_model_cfg(plan, ('hf', path), where)  # pylint: disable=protected-access
  return judges_lib.JudgeCall(('hf', path), where, suite.name, model_for(cfg), how,
                              prompts * samples * how.rows_per_sample)


def suite_calls(plan, model_for: Callable = lambda cfg: cfg) -> list[SuiteCall]:
  """One SuiteCall per suite of config.eval.suites, in their order (see the module docstring).

  Args:
    plan: the validated config.
    model_for: a judge's ModelConfig as the target runs it (`targets.target_model`).
  """
  from cascade import suites as suites_lib  # pylint: disable=g-import-not-at-top
  ev = plan.eval
  if not ev.suites:
    return []
  tokenizer, why = _tokenizer(plan)
  out = []
  for name in ev.suites:
    suite = suites_lib.get(name)
    proto = ev.suite_settings(name)
    samples = 1 if proto.greedy else proto.samples
    cap = min(ev.suite_batch_size, ev.suite_prompts or ev.suite_batch_size)
    got = _measured(plan, suite, tokenizer if tokenizer is not None else why)
    if isinstance(got, tuple):
      records, longest = got
      prompts = min(cap, records)
      how = f'measured: {records} records under {suite.directory(ev.suite_data)}'
    else:
      longest, records = suite.planned_prompts()
      prompts = min(cap, records) if records else cap
      how = (f"the suite's bound ({got})" if records else
             f"the suite's bound, full batches ({got})")
    prompt_len, new_tokens = suite.planned_call(longest, proto)
    out.append(SuiteCall(name, prompts, samples, prompt_len, new_tokens, proto.top_p,
                         proto.top_k, how, _judge_call(plan, suite, prompts, samples, model_for)))
  return out


def grouped(calls, call_shape: Callable[[SuiteCall], tuple]) -> list[tuple[SuiteCall, list]]:
  """The calls that compile to one program together: suites whose calls have the same rows,
  samples, sampling cut and `call_shape` (the sampler's padded prompt and new-token buckets
  and rows per chunk) share one, planned at the longest prompt among them. Returns
  (the call to plan, the suites' names) pairs in the suites' order."""
  groups: dict[tuple, list[SuiteCall]] = {}
  for c in calls:
    key = (c.rows, c.samples, c.top_p, c.top_k, call_shape(c))
    groups.setdefault(key, []).append(c)
  out = []
  for members in groups.values():
    top = max(members, key=lambda c: c.prompt_len)
    out.append((top, [c.suite for c in members]))
  return out
