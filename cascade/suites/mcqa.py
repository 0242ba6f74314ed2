r"""Multiple choice: GPQA-Diamond and MMLU-Pro, each with its official prompt and extraction.

GPQA-Diamond (Idavidrein/gpqa, gpqa_diamond.csv, a gated dataset: `--download`
needs a Hugging Face token that accepted its terms; simple-evals reads the same
file): 198 questions, columns 'Question', 'Correct Answer', 'Incorrect Answer
1'..'3' and 'Record ID' (the record's id) among the release's others. The file
always lists the correct answer first, so the four choices are shuffled, as
OpenAI's simple-evals does it: one `random.Random(0)` over the file's rows in
order, each row's permutation `rng.sample(range(4), 4)` (the choice at position
i is released choice perm[i], the correct one released first) -- the
permutation simple-evals gives every question in a one-repeat run, and in the
first repeat of its default four. The prompt is simple-evals' multiple-choice
template ("Answer the following multiple choice question. The last line of your
response should be of the following format: 'Answer: $LETTER' ..." then the
question and "A) ..." to "D) ..."), the choices' text as released; the letter
is read by simple-evals' pattern `(?i)Answer[ \t]*:[ \t]*\$?([A-D])\$?` (first
match, case as written).

MMLU-Pro (TIGER-Lab/MMLU-Pro, data/test-*.parquet): 'question_id', 'question',
'options' (up to ten, A-J; "N/A" entries are dropped, as the official
`evaluate_from_api.py` does), 'answer' (the letter), 'answer_index',
'category'. The prompt is that script's: "The following are multiple choice
questions (with answers) about {category}. Think step by step and then output
the answer in the format of "The answer is (X)" at the end." and the question
as its `format_example` writes it ("Question: ...", "Options: A. ...", ...,
"Answer: Let's think step by step."), zero-shot: the script's five CoT examples
from the validation split are left out, as thinking-mode evaluations at 64K
tokens do. The letter is read by its three patterns in order ("answer is
(X)", "Answer: X", the last standalone letter A-J).

Both grade through the project's `mcqa` verifier with its official
extractions (`extraction='simple_evals'` / 'mmlu_pro', verifiers/mcqa.py),
after the thinking block; an answer with no letter scores 0 (MMLU-Pro's script
counts a seeded random guess instead). A grade's answer is the extracted letter
(maj@k).

Protocol: Cascade's 64K tokens, temperature 0.6, top-p 0.95, thinking mode.
GPQA-Diamond: 8 samples per question (avg@8): 198 questions, so one sample
each leaves a sampling noise near the gaps between stages. MMLU-Pro: one
sample per question (12,032 questions: the sampling noise is already well
under its standard error).

The papers' numbers: Cascade 1's 8B model after each stage (its intermediate
checkpoints' model card); the stage names are the recipe config's
(configs/_recipes.py).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Mapping, Sequence

from cascade.suites import base
from cascade.suites import graders
import verifiers

GPQA_TEMPLATE = (
    "Answer the following multiple choice question. The last line of your response should be "
    "of the following format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. "
    "Think step by step before answering.\n\n{question}\n\nA) {a}\nB) {b}\nC) {c}\nD) {d}")
MMLU_PRO_HEADER = (
    'The following are multiple choice questions (with answers) about {category}. Think step '
    'by step and then output the answer in the format of "The answer is (X)" at the end.\n\n')
_LETTERS = 'ABCDEFGHIJ'


def graded(record: Mapping, result: verifiers.Result) -> base.Graded:
  """The mcqa verifier's reward as the grade; the letter it extracted as the answer."""
  del record
  info = dict(result.info or {})
  letter = info.get('extracted')
  return base.Graded(score=graders.clipped(result),
                     answer=letter if isinstance(letter, str) else None, info=info)


def gpqa_permutations(n: int) -> list[list[int]]:
  """The choice order of each of n rows: simple-evals' `rng.sample(range(4), 4)` drawn in
  turn from one `random.Random(0)`."""
  rng = random.Random(0)
  return [rng.sample(range(4), 4) for _ in range(n)]


def mmlu_pro_prompt(question: str, options: Sequence[str], category: str) -> str:
  """The official script's zero-shot user turn."""
  lines = ''.join(f'{_LETTERS[i]}. {o}\n' for i, o in enumerate(options))
  return (MMLU_PRO_HEADER.format(category=category) +
          f"Question: {question}\nOptions: {lines}Answer: Let's think step by step.\n\n")


@dataclasses.dataclass(frozen=True, kw_only=True)
class McqaSuite(base.Suite):
  """A multiple-choice benchmark graded by the `mcqa` verifier's official extraction.

  Attributes:
    layout: 'gpqa' or 'mmlu_pro' (which release's columns `parse` reads).
    extraction: the `mcqa` verifier's extraction ('simple_evals', 'mmlu_pro').
  """
  layout: str
  extraction: str

  def parse(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    if self.layout == 'gpqa':
      return self._gpqa(path, raw)
    return self._mmlu_pro(path, raw)

  def _gpqa(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    out = []
    for (line, row), perm in zip(raw, gpqa_permutations(len(raw))):
      texts = [base.field(path, line, row, c) for c in
               ('Question', 'Correct Answer', 'Incorrect Answer 1', 'Incorrect Answer 2',
                'Incorrect Answer 3')]
      if not all(t.strip() for t in texts):
        raise base.BadRecord(f'{path}:{line}: an empty question or choice')
      released = texts[1:]
      choices = [released[i] for i in perm]
      out.append({
          'id': base.field(path, line, row, 'Record ID'),
          'messages': [{'role': 'user', 'content': GPQA_TEMPLATE.format(
              question=texts[0], a=choices[0], b=choices[1], c=choices[2], d=choices[3])}],
          'metadata': {'answer': 'ABCD'[perm.index(0)], 'options': choices}})
    return out

  def _mmlu_pro(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    out = []
    for line, row in raw:
      qid = base.field(path, line, row, 'question_id', int)
      question = base.field(path, line, row, 'question')
      category = base.field(path, line, row, 'category')
      options = [o for o in base.field(path, line, row, 'options', list) if o != 'N/A']
      answer = base.field(path, line, row, 'answer')
      index = base.field(path, line, row, 'answer_index', int)
      if not 2 <= len(options) <= len(_LETTERS) or not all(isinstance(o, str) for o in options):
        raise base.BadRecord(f"{path}:{line}: field 'options' must hold 2 to 10 strings "
                             f'(besides "N/A"), got {len(options)}')
      if not 0 <= index < len(options) or answer != _LETTERS[index]:
        raise base.BadRecord(f"{path}:{line}: 'answer' {answer!r} and 'answer_index' {index} "
                             f'do not name the same one of {len(options)} options')
      out.append({'id': str(qid),
                  'messages': [{'role': 'user',
                                'content': mmlu_pro_prompt(question, options, category)}],
                  'metadata': {'answer': answer, 'options': options}})
    return out

  def grader(self, **options) -> graders.VerifierGrader:
    return graders.VerifierGrader(verifiers.get('mcqa', extraction=self.extraction, **options),
                                  graded)


_C1_8B = ('arXiv 2512.13607, model card of nvidia/Nemotron-Cascade-8B-Intermediate-ckpts '
          '(8B after each stage)')
_STAGES = ('sft_32k', 'rlhf', 'if_rl_ifbench', 'math_rl', 'code_rl', 'swe_rl')


def _per_stage(values: Sequence[float]) -> tuple[base.Reported, ...]:
  return tuple(base.Reported(recipe='nemotron_cascade_8b', stage=s, value=v, source=_C1_8B)
               for s, v in zip(_STAGES, values))


# launch.plan's bound on a rendered question with its choices (ours, assumed) where it does not
# measure the files.
PROMPT_TOKENS = 2048

gpqa_diamond = McqaSuite(
    name='gpqa_diamond', title='GPQA-Diamond', metric='avg@8', layout='gpqa',
    extraction='simple_evals',
    source='Idavidrein/gpqa (gpqa_diamond.csv, 198 questions)', files=('gpqa_diamond.csv',),
    prompt_tokens=PROMPT_TOKENS, records=198,
    protocol=base.Protocol(samples=8, temperature=0.6, top_p=0.95, max_new_tokens=65536,
                           thinking=True, pass_ks=(8,)),
    hub_dataset='Idavidrein/gpqa', hub_files=('gpqa_diamond.csv',),
    reported=_per_stage((63.5, 66.8, 66.1, 65.7, 67.4, 66.5)))

mmlu_pro = McqaSuite(
    name='mmlu_pro', title='MMLU-Pro', metric='avg@1', layout='mmlu_pro', extraction='mmlu_pro',
    source='TIGER-Lab/MMLU-Pro (data/test-*.parquet, 12,032 questions)',
    files=('data/test-*.parquet',), prompt_tokens=PROMPT_TOKENS, records=12032,
    protocol=base.Protocol(samples=1, temperature=0.6, top_p=0.95, max_new_tokens=65536,
                           thinking=True),
    hub_dataset='TIGER-Lab/MMLU-Pro', hub_files=('data/test-*.parquet',),
    reported=_per_stage((74.4, 77.8, 74.5, 75.0, 75.3, 75.7)))
