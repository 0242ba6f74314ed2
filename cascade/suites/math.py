r"""Competition math: AIME 2024, AIME 2025 and HMMT February 2025, graded by math-verify.

Records, as released (field names of the dataset cards):

  aime24      Maxwell-Jia/AIME_2024, aime_2024_problems.parquet: 'ID' ('2024-I-1'),
              'Problem', 'Solution', 'Answer' (int).
  aime25      opencompass/AIME2025, aime2025-I.jsonl and aime2025-II.jsonl: 'question',
              'answer' (str); no id, so a record's id is its file and row ('aime2025-I-3').
  hmmt_feb25  MathArena/hmmt_feb_2025, data/train-00000-of-00001.parquet: 'problem_idx'
              (int), 'problem', 'answer' (LaTeX str), 'problem_type' (list).

Prompt: one user turn, the problem, a new line, and the instruction the R1-style
reasoning models are evaluated with, "Please reason step by step, and put your
final answer within \boxed{}." (no system prompt, no few-shot), in thinking
mode.

Protocol (Cascade 1, arXiv 2512.13607, and its model cards: 64K-token budget,
temperature 0.6, top-p 0.95): 64 samples per problem, the metric avg@64 (pass@1
estimated from 64 samples) with its standard error over problems, pass@k by
the unbiased estimator and maj@64. Why 64: the papers' own text could not be
read here (their tables say "Pass@1" and the budget above); 64 is what the same
NVIDIA team's AceReason-Nemotron reports for AIME, and with 30 problems per set
a smaller k leaves sampling noise a large share of the error. HMMT February
2025 has the same size and format and gets the same k.

Grading: the project's `math` verifier (verifiers/math.py) in its worker pool:
the last \boxed{} after the thinking block, compared with the gold answer by
math-verify. A grade's answer (what maj@k votes on) is math-verify's parse of
the extracted answer as a string ('1/2' for 0.5, \frac{1}{2} and 1/2 alike;
'70' for 070; 'sqrt(2)/2' for \dfrac{\sqrt{2}}{2} and \frac12\sqrt2), so
equivalent answers vote together; equivalent forms math-verify parses apart
(\frac{1}{\sqrt{2}}; \sqrt{8} and 2\sqrt{2}) vote apart.

The papers' numbers: Cascade 1 14B-Thinking after each stage (AIME25), the
8B model after each stage (its intermediate checkpoints' model card: AIME24,
AIME25), Cascade 2 final (AIME25). Stages are the recipe configs' names
(configs/_recipes.py): sft_32k, rlhf, if_rl_ifbench (both IF-RL sub-stages
done), math_rl, code_rl, swe_rl.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Mapping, Sequence

from cascade.suites import base
from cascade.suites import graders
import verifiers

INSTRUCTION = 'Please reason step by step, and put your final answer within \\boxed{}.'


def prompt(problem: str) -> str:
  """The user turn of a problem."""
  return f'{problem}\n{INSTRUCTION}'


def graded(record: Mapping, result: verifiers.Result) -> base.Graded:
  """The math verifier's reward as the grade; its parse of the answer ('pred') as the answer
  maj@k votes on (None where nothing parsed)."""
  del record
  info = dict(result.info or {})
  pred = info.get('pred')
  return base.Graded(score=graders.clipped(result),
                     answer=pred if isinstance(pred, str) and pred else None, info=info)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathSuite(base.Suite):
  """A final-answer math benchmark graded by the `math` verifier.

  Attributes:
    id_field: the record's id field ('' = none: '<file stem>-<row>').
    problem_field: the problem statement's field.
    answer_field: the gold answer's field (str or int).
  """
  id_field: str = ''
  problem_field: str = 'problem'
  answer_field: str = 'answer'

  def parse(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    stem = posixpath.basename(path).split('.')[0]
    out = []
    for n, (line, row) in enumerate(raw, 1):
      problem = base.field(path, line, row, self.problem_field)
      answer = base.field(path, line, row, self.answer_field, (str, int))
      if isinstance(answer, bool) or not str(answer).strip() or not problem.strip():
        raise base.BadRecord(f'{path}:{line}: field {self.answer_field!r} or '
                             f'{self.problem_field!r} is empty or not an answer')
      rid = (str(base.field(path, line, row, self.id_field, (str, int))) if self.id_field
             else f'{stem}-{n}')
      out.append({'id': rid, 'messages': [{'role': 'user', 'content': prompt(problem)}],
                  'metadata': {'answer': str(answer).strip()}})
    return out

  def grader(self, **options) -> graders.VerifierGrader:
    return graders.VerifierGrader(verifiers.get('math', **options), graded)


PROTOCOL = base.Protocol(samples=64, temperature=0.6, top_p=0.95, max_new_tokens=65536,
                         thinking=True, pass_ks=(4, 16, 64))
# launch.plan's bound on a rendered problem (ours, assumed: a competition problem and the
# instruction to box the answer are a few hundred tokens) where it does not measure the files.
PROMPT_TOKENS = 1024
_C1 = 'arXiv 2512.13607 (Nemotron-Cascade), 14B-Thinking after each stage'
_C1_8B = ('arXiv 2512.13607, model card of nvidia/Nemotron-Cascade-8B-Intermediate-ckpts '
          '(8B after each stage)')
_C2 = 'arXiv 2603.19220 (Nemotron-Cascade 2), final model'
_STAGES = ('sft_32k', 'rlhf', 'if_rl_ifbench', 'math_rl', 'code_rl', 'swe_rl')


def _per_stage(recipe: str, values: Sequence[float], source: str) -> tuple[base.Reported, ...]:
  return tuple(base.Reported(recipe=recipe, stage=s, value=v, source=source)
               for s, v in zip(_STAGES, values))


aime24 = MathSuite(
    name='aime24', title='AIME 2024', metric='avg@64', protocol=PROTOCOL,
    prompt_tokens=PROMPT_TOKENS, records=30,
    source='Maxwell-Jia/AIME_2024 (aime_2024_problems.parquet, 30 problems)',
    files=('aime_2024_problems.parquet',), id_field='ID', problem_field='Problem',
    answer_field='Answer', hub_dataset='Maxwell-Jia/AIME_2024',
    reported=_per_stage('nemotron_cascade_8b', (83.6, 86.1, 86.2, 90.2, 89.1, 89.5), _C1_8B))

aime25 = MathSuite(
    name='aime25', title='AIME 2025', metric='avg@64', protocol=PROTOCOL,
    prompt_tokens=PROMPT_TOKENS, records=30,
    source='opencompass/AIME2025 (aime2025-I.jsonl, aime2025-II.jsonl, 30 problems)',
    files=('aime2025-I.jsonl', 'aime2025-II.jsonl'), problem_field='question',
    hub_dataset='opencompass/AIME2025',
    reported=(_per_stage('nemotron_cascade_14b', (81.1, 81.8, 82.3, 83.3, 83.5, 83.3), _C1)
              # The 8B card's final (SWE) value could not be read here: five stages only.
              + _per_stage('nemotron_cascade_8b', (72.8, 75.0, 75.2, 81.9, 80.5), _C1_8B)
              + (base.Reported(recipe='nemotron_cascade2', stage='final', value=92.4,
                               source=_C2),)))

hmmt_feb25 = MathSuite(
    name='hmmt_feb25', title='HMMT February 2025', metric='avg@64', protocol=PROTOCOL,
    prompt_tokens=PROMPT_TOKENS, records=30,
    source='MathArena/hmmt_feb_2025 (data/train-00000-of-00001.parquet, 30 problems)',
    files=('data/train-*.parquet',), id_field='problem_idx', problem_field='problem',
    hub_dataset='MathArena/hmmt_feb_2025')
