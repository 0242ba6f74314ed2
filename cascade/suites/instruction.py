"""Instruction following: IFEval and IFBench, with the four accuracies their references report.

IFEval (google/IFEval, ifeval_input_data.jsonl, 541 prompts: the file with
Google's revised prompts; the older input_data.jsonl is not read): 'key', 'prompt',
'instruction_id_list', 'kwargs'. IFBench (allenai/IFBench_test,
data/train-00000-of-00001.parquet, 300 prompts): the same four fields, its
kwargs as Arrow writes them (every kwarg name on every instruction, None where
unused; integers as 5.0). The prompt is the user turn as released, no system
prompt, in thinking mode; the checks read the answer after the thinking block.

Grading: the project's `instruction_following` (IFEval's 25 ids) and `ifbench`
(IFBench's 58, with IFEval's) verifiers, asked for every instruction's result
in both modes (`both_modes`): strict (the response as written) and loose (also
with its first and/or last line and/or its asterisks removed), as Google's
reference `evaluation_lib` (and lm-eval's copy of it) checks them. Each sample
keeps its counts ('strict_followed', 'loose_followed', 'instructions'), and the
summary reports the reference's four numbers over all samples:

  prompt_level_strict_acc   responses that follow every instruction, strict
  inst_level_strict_acc     instructions followed, strict, over all instructions
  prompt_level_loose_acc    the same, loose
  inst_level_loose_acc

With k samples per prompt each number is the mean of k runs of the reference's
(a prompt and its instructions count once per sample). The suite's value, with
its standard error over prompts and pass@k, is one of them:

  IFEval: prompt-level strict accuracy, what the papers' "IFEval (Strict Prompt)"
  rows report.
  IFBench: prompt-level loose accuracy, the IFBench paper's headline number
  (Pyatkin et al., arXiv 2507.02833); whether the Cascade model cards' IFBench
  rows are loose or strict is not stated there.

Protocol: Cascade's 64K tokens, temperature 0.6, top-p 0.95, thinking mode; 4
samples per prompt. The references score one response per prompt; four cut
the sampling variance to a quarter, for a score whose stage-to-stage moves are
a few points, at a small cost next to the math suites' 64.

The papers' numbers: Cascade 1 14B-Thinking after each stage (IFEval), the 8B
model after each stage (its intermediate checkpoints' model card: IFEval and
IFBench); the stage names are the recipe configs' (configs/_recipes.py).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from cascade.suites import base
from cascade.suites import graders
import verifiers

# The summary's four numbers, named as lm-eval's ifeval task names them.
ACCURACIES = ('prompt_level_strict_acc', 'inst_level_strict_acc', 'prompt_level_loose_acc',
              'inst_level_loose_acc')


def counts(result: verifiers.Result, n: int) -> dict:
  """A result's per-mode counts: {'strict_followed', 'loose_followed', 'instructions'} (a
  result without the lists, a timeout or an unfinished thinking block, followed none)."""
  out = {'instructions': n}
  for mode in ('strict', 'loose'):
    followed = result.info.get(mode)
    ok = isinstance(followed, list) and len(followed) == n
    out[f'{mode}_followed'] = int(sum(bool(x) for x in followed)) if ok else 0
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class InstructionSuite(base.Suite):
  """IFEval-style records graded by an instruction verifier in both modes.

  Attributes:
    verifier: 'instruction_following' or 'ifbench'.
    headline: the mode of the suite's value and grade ('strict' or 'loose'), prompt level.
  """
  verifier: str
  headline: str

  def parse(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    out = []
    for line, row in raw:
      key = base.field(path, line, row, 'key', (int, str))
      prompt = base.field(path, line, row, 'prompt')
      metadata = {'instruction_id_list': base.field(path, line, row, 'instruction_id_list',
                                                    list),
                  'kwargs': base.field(path, line, row, 'kwargs', list)}
      try:
        verifiers.validate(self.verifier, metadata, f'{path}:{line}')
      except ValueError as e:
        raise base.BadRecord(str(e)) from None
      out.append({'id': str(key), 'messages': [{'role': 'user', 'content': prompt}],
                  'metadata': metadata})
    return out

  def graded(self, record: Mapping, result: verifiers.Result) -> base.Graded:
    """1 iff every instruction is followed in the headline mode; the counts in info."""
    c = counts(result, len(record['metadata']['instruction_id_list']))
    score = float(c[f'{self.headline}_followed'] == c['instructions'])
    return base.Graded(score=score, info=dict(result.info or {}, **c))

  def grader(self, **options) -> graders.VerifierGrader:
    return graders.VerifierGrader(verifiers.get(self.verifier, both_modes=True, **options),
                                  self.graded)

  def summarize(self, records: Sequence[Mapping], grades: Sequence[Sequence[base.Graded]]
                ) -> dict:
    """The base summary (value = prompt-level accuracy in the headline mode) and the
    reference's four accuracies, in percent, over every sample."""
    out = super().summarize(records, grades)
    n = np.array([len(r['metadata']['instruction_id_list']) for r, row in zip(records, grades)
                  for _ in row], np.float64)
    for mode in ('strict', 'loose'):
      followed = np.array([g.info.get(f'{mode}_followed', 0) for row in grades for g in row],
                          np.float64)
      out[f'prompt_level_{mode}_acc'] = 100.0 * float(np.mean(followed == n))
      out[f'inst_level_{mode}_acc'] = 100.0 * float(followed.sum() / n.sum())
    return out


PROTOCOL = base.Protocol(samples=4, temperature=0.6, top_p=0.95, max_new_tokens=65536,
                         thinking=True)
# launch.plan's bound on a rendered prompt (ours, assumed) where it does not measure the files.
PROMPT_TOKENS = 2048
_C1 = 'arXiv 2512.13607 (Nemotron-Cascade), 14B-Thinking after each stage'
_C1_8B = ('arXiv 2512.13607, model card of nvidia/Nemotron-Cascade-8B-Intermediate-ckpts '
          '(8B after each stage)')
_STAGES = ('sft_32k', 'rlhf', 'if_rl_ifbench', 'math_rl', 'code_rl', 'swe_rl')


def _per_stage(recipe: str, values: Sequence[float], source: str) -> tuple[base.Reported, ...]:
  return tuple(base.Reported(recipe=recipe, stage=s, value=v, source=source)
               for s, v in zip(_STAGES, values))


ifeval = InstructionSuite(
    name='ifeval', title='IFEval', metric='prompt-level strict', protocol=PROTOCOL,
    verifier='instruction_following', headline='strict',
    source='google/IFEval (ifeval_input_data.jsonl, 541 prompts)',
    files=('ifeval_input_data.jsonl',), hub_dataset='google/IFEval',
    prompt_tokens=PROMPT_TOKENS, records=541,
    reported=(_per_stage('nemotron_cascade_14b', (69.8, 56.2, 81.3, 84.3, 81.8, 81.9), _C1)
              + _per_stage('nemotron_cascade_8b', (70.8, 50.1, 90.4, 92.1, 90.7, 90.2),
                           _C1_8B)))

ifbench = InstructionSuite(
    name='ifbench', title='IFBench', metric='prompt-level loose', protocol=PROTOCOL,
    verifier='ifbench', headline='loose',
    source='allenai/IFBench_test (data/train-00000-of-00001.parquet, 300 prompts)',
    files=('data/train-*.parquet',), hub_dataset='allenai/IFBench_test',
    prompt_tokens=PROMPT_TOKENS, records=300,
    reported=_per_stage('nemotron_cascade_8b', (21.2, 24.5, 40.5, 40.4, 38.1, 40.8), _C1_8B))
