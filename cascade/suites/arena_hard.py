"""ArenaHard v1 and v2: the policy's answers judged against the benchmark's baseline answers,
in both orders, and scored as the official scripts score them.

  suite = suites.get('arena_hard_v1')
  records = suite.read('/data/suites/arena_hard_v1')    # questions joined with baseline answers
  with suite.grader(url='http://judge-host:8000/v1', api_key_env='OPENAI_API_KEY',
                    cache_dir='runs/eval/arena_hard_v1/judge_cache') as grader:
    grades = grader.grade_batch(records, completions)  # two judgments per answer
  suite.summarize(records, grades)   # {'value': win rate vs the baseline, 'ci_low', 'ci_high', ...}

Releases (lmarena/arena-hard-auto, its data on the Hub as lmarena-ai/arena-hard-auto):

* `arena_hard_v1` is arena-hard-auto v0.1: 500 questions, the baseline answers of
  gpt-4-0314, judged by gpt-4-1106-preview (temperature 0, 4,096 tokens).
* `arena_hard_v2` is arena-hard-v2.0: 750 questions, 500 'hard_prompt' ones
  (subcategories coding and math) against o3-mini-2025-01-31 and 250
  'creative_writing' ones against gemini-2.0-flash-001, judged by gpt-4.1
  (temperature 0, 16,000 tokens), creative writing with its own system prompt.

Files, under the suite's directory as the Hub repository lays them out:
`data/<release>/question.jsonl` and `data/<release>/model_answer/<baseline>.jsonl`.
Both record layouts the repository has used are read: the first release's
(question_id, turns[0].content; model_id, choices[0].turns[0].content) and the
current one (uid, prompt; model, messages[-1].content.answer); category is read
from each question (it picks the baseline and the judge's system prompt).

Protocol. One answer per question, as the benchmark is run, sampled with the
Cascade papers' evaluation settings (thinking, temperature 0.6, top-p 0.95, 64K
tokens). The judge reads the answer after its thinking block.

Judging, as gen_judgment does it: for each answer two games, game 1 with the
baseline as assistant A and the policy as B, game 2 swapped, each one
conversation of the official system prompt and user template. The fields (the
question and both answers) are hostile text: the template's own block markers
and chat markers in them are defused (`verifiers.judge.defuse_field`), so an
answer cannot close its block or the judge's turn. The judge is either

* served (`url=`): any OpenAI-compatible endpoint through `verifiers.served.Client`
  (asked for the official judge's model name unless `model=` names another, e.g. a
  GenRM served by vLLM / SGLang), with
  its concurrency limit, retries, timeouts and request-hash cache (`cache_dir=`,
  e.g. under the evaluation's workdir: a resumed evaluation does not pay twice); or
* local (`judge=`): a cascade judge model, `rl.judge.JudgeModel` or an HF checkpoint
  directory it loads, prompted through `verifiers.judge.Prompter` as the `judge`
  verifier prompts it (fields encoded as plain text, at most `max_field_tokens`).

Reading the verdict (`read_verdict`). Only the judge's own reply is parsed (after
its thinking block; at most `max_parse_chars` characters, by the official label
patterns: v0.1 `\\[\\[([AB<>=]+)\\]\\]`, v2.0 that one and then `\\[([AB<>=]+)\\]`).
The policy's text never reaches the parser directly; it can only reach it through
a judge that repeats it. So the rule is v0.1's: a reply whose labels are all one
label has that verdict; a reply carrying two different labels (a judge quoting an
answer's injected "[[A>>B]]" beside its own "[[B>A]]") is ambiguous, and so is
missing, as is a reply with no label or an unknown one. (v2.0's script takes the
last label instead; the stricter rule is kept for both, so an echoed injection can
make a judgment missing but never decide it.) v0.1's script asked a judge that gave
no label once more to finish; here that game is missing.

Failing closed. A game without a verdict is never scored: it is counted
('missing', with each game's reason in the grade's info), it is left out as the
official scripts leave out a null judgment (v0.1 drops that game, v2.0 the
question's pair), and `summarize` raises `JudgmentsMissing` when more than
`max_missing` of the games have none. A served judgment that never came because
the endpoint failed past its retries (not a refusal of that request) stops the
batch (`JudgeUnavailable`): nothing of it is kept, so a rerun resumes there, and
what the judge did answer comes from the cache.

Scoring, as show_result does it. Each verdict is a battle of the policy against
the baseline, from the policy's side 1 (win), 0.5 (tie) or 0 (loss); a strong
verdict ('>>') counts `weight` = 3 times. v1 (v0.1's show_result): the
Bradley-Terry MLE over the battles, ties as half a win each way, anchored at the
baseline, turned into the win rate against the baseline; with one policy and one
baseline that MLE's win rate is the weighted share of battles won, ties counting
half (`bt_win_rate`); its 95% interval is the 2.5th and 97.5th percentiles, on the
Elo scale, of 100 refits to battles resampled with replacement. v2 (v2.0's
show_result): the mean of 100 bootstrap means of the battles, with their 5th and
95th percentiles. v2's value is the 'hard_prompt' category (the script's default,
the leaderboard's headline); creative writing is reported beside it. Both use
`cascade.suites.stats.bootstrap_replicates` (seeded: the interval is
reproducible, not the scripts' pandas draws). 'stderr' is the replicates'
standard deviation. Style control (length and markdown features in the fit) is
not implemented: these are the scores without it.

The papers' numbers. Cascade 1 reports "ArenaHard" after each stage without a
version; they are placed on v1 (arena-hard-auto v0.1, the release so named before
v2.0). Cascade 2 reports ArenaHard v2.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np

from cascade.suites import base
from cascade.suites import stats
from foundation import chat
from foundation import paths
from verifiers import base as verifiers_base
from verifiers import judge as judge_lib
from verifiers import served

# The official judge system prompt (v0.1's, and v2.0's for every category but creative writing).
SYSTEM_PROMPT = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by "
    "two AI assistants to the user prompt displayed below. You will be given assistant A's "
    "answer and assistant B's answer. Your job is to evaluate which assistant's answer is "
    "better.\n\nBegin your evaluation by generating your own answer to the prompt. You must "
    "provide your answers before judging any answers.\n\nWhen evaluating the assistants' "
    "answers, compare both assistants' answers with your answer. You must identify and correct "
    "any mistakes or inaccurate information.\n\n")
# v2.0's creative writing prompt: the same without the judge's own answer.
CREATIVE_WRITING_PROMPT = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by "
    "two AI assistants to the user prompt displayed below. You will be given assistant A's "
    "answer and assistant B's answer. Your job is to evaluate which assistant's answer is "
    "better.\n\nWhen evaluating the assistants' answers, compare both assistants' answers. You "
    "must identify and correct any mistakes or inaccurate information.\n\n")
_CRITERIA = (
    "Then consider if the assistant's answers are helpful, relevant, and concise. Helpful means "
    "the answer correctly responds to the prompt or follows the instructions. Note when user "
    "prompt has any ambiguity or more than one interpretation, it is more helpful and "
    "appropriate to ask for clarifications or more information from the user than providing an "
    "answer based on assumptions. Relevant means all parts of the response closely connect or "
    "are appropriate to what is being asked. Concise means the response is clear and not "
    "verbose or excessive.\n\nThen consider the creativity and novelty of the assistant's "
    "answers when needed. Finally, identify any missing important information in the "
    "assistants' answers that would be beneficial to include when responding to the user "
    "prompt.\n\nAfter providing your explanation, you must output only one of the following "
    "choices as your final verdict with a label:\n\n1. Assistant A is significantly better: "
    "[[A>>B]]\n2. Assistant A is slightly better: [[A>B]]\n3. Tie, relatively the same: "
    "[[A=B]]\n4. Assistant B is slightly better: [[B>A]]\n5. Assistant B is significantly "
    "better: [[B>>A]]\n\nExample output: \"My final verdict is tie: [[A=B]]\".")
SYSTEM_PROMPT += _CRITERIA
CREATIVE_WRITING_PROMPT += _CRITERIA

# The official user template; the fields are the question and the two answers.
USER_TEMPLATE = ("<|User Prompt|>\n{question}\n\n<|The Start of Assistant A's Answer|>\n"
                 "{response_a}\n<|The End of Assistant A's Answer|>\n\n<|The Start of Assistant "
                 "B's Answer|>\n{response_b}\n<|The End of Assistant B's Answer|>")
DELIMITERS = ('<|User Prompt|>', "<|The Start of Assistant A's Answer|>",
              "<|The End of Assistant A's Answer|>", "<|The Start of Assistant B's Answer|>",
              "<|The End of Assistant B's Answer|>")

# Assistant A's score under each label show_result knows (v0.1 knows the first five).
A_SCORE = {'A>>B': 1.0, 'A>B': 1.0, 'A=B': 0.5, 'B>A': 0.0, 'B>>A': 0.0,
           'A<<B': 0.0, 'A<B': 0.0, 'B=A': 0.5, 'B<A': 1.0, 'B<<A': 1.0}
V1_LABELS = ('A>>B', 'A>B', 'A=B', 'B>A', 'B>>A')
LABEL_PATTERN = r'\[\[([AB<>=]+)\]\]'
LOOSE_LABEL_PATTERN = r'\[([AB<>=]+)\]'
# Characters of each judgment's end kept in a grade's info (where the verdict is).
_KEPT_CHARS = 300


class JudgmentsMissing(RuntimeError):
  """More of a suite's games have no verdict than its `max_missing` allows."""


class JudgeUnavailable(RuntimeError):
  """A served judge gave no judgment (it failed past its retries): the batch is not scored."""


@functools.lru_cache(maxsize=8)
def _pattern(pattern: str) -> re.Pattern:
  return re.compile(pattern)


def read_verdict(text: str, patterns: Sequence[str], labels: Sequence[str],
                 max_chars: int) -> tuple[str | None, str]:
  """The verdict label of a judge's reply, or None and why (see the module docstring).

  Bounded: the reply after its thinking block, its last `max_chars` characters, is searched
  by each pattern in turn (a literal-led character class: linear) until one matches.

  Args:
    text: the judge's reply.
    patterns: the label patterns, in order (one group: the label).
    labels: the labels that are verdicts.
    max_chars: the most characters read.

  Returns:
    (label, '') or (None, the reason: no label, an unknown one, several different ones).
  """
  split = chat.split_thinking(text)
  if not split.finished_thinking:
    return None, "the judge's thinking never closed"
  reply = split.answer[-max_chars:].upper()
  for pattern in patterns:
    found = sorted({m.strip() for m in _pattern(pattern).findall(reply)} - {''})
    if len(found) > 1:
      return None, f'ambiguous: {len(found)} different verdict labels ({", ".join(found[:4])})'
    if found:
      return ((found[0], '') if found[0] in labels
              else (None, f'an unknown verdict label {found[0]!r}'))
  return None, 'no verdict label'


def bt_win_rate(outcomes: np.ndarray) -> float:
  """The win rate against the baseline of show_result's (v0.1) Bradley-Terry MLE.

  show_result fits a logistic regression without intercept on every battle
  twice, a tie once as a win and once as a loss, P(policy wins) =
  sigmoid(ln 10 * (b_policy - b_baseline)), and reads the win rate back from
  the two ratings. With two players the likelihood depends on the difference
  d only, and it is maximal where sigmoid(d) equals the share of policy wins
  among the doubled battles: (2 W + T) / (2 N), the mean of the outcomes with
  ties as 0.5. (All won or all lost: the MLE is at infinity and the rate 1 or 0;
  the script's solver stops at a large finite rating, a rate within 1e-6 of it.)

  Args:
    outcomes: [battles] the policy's outcome of each battle (1, 0.5, 0), weighted
      battles repeated.
  """
  return float(np.mean(outcomes))


def _logit(p: np.ndarray) -> np.ndarray:
  p = np.clip(p, 1e-12, 1.0 - 1e-12)
  return np.log(p / (1.0 - p))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArenaHardSuite(base.Suite):
  """One ArenaHard release (see the module docstring).

  Attributes:
    release: its directory under data/ ('arena-hard-v0.1').
    baselines: (category, baseline model) of each category the release has.
    creative_categories: categories judged with CREATIVE_WRITING_PROMPT.
    judge_model: the official judge (the served model name unless `grader(model=)`).
    judge_max_tokens: the judge's token budget per judgment.
    patterns: the label patterns tried in order.
    labels: the labels that are verdicts.
    drop: 'game' (v0.1: a game without a verdict is left out) or 'question' (v2.0: the
      question's pair is).
    game_order: the games' battles in show_result's order ((0, 1): game 1 first).
    value_category: the category whose score is 'value'.
    estimator: 'bt' (v0.1: the fit to all battles, a percentile interval on the Elo scale)
      or 'bootstrap_mean' (v2.0: the mean of the bootstrap means, their percentiles).
    ci_level: the interval's coverage (0.95; v2.0's script prints 0.90).
    weight: battles a strong verdict counts for.
    rounds: bootstrap resamples.
    seed: the resampling seed.
    max_missing: the largest share of games without a verdict before `summarize` refuses.
    max_parse_chars: the most characters of a judge's reply read for its verdict.
  """
  release: str
  baselines: tuple[tuple[str, str], ...]
  creative_categories: tuple[str, ...] = ()
  judge_model: str
  judge_max_tokens: int
  patterns: tuple[str, ...]
  labels: tuple[str, ...]
  drop: str
  game_order: tuple[int, int] = (0, 1)
  value_category: str
  estimator: str
  ci_level: float
  weight: int = 3
  rounds: int = 100
  seed: int = 0
  max_missing: float = 0.05
  max_parse_chars: int = 200_000

  # --- reading -------------------------------------------------------------------------------

  def answers_path(self, data_dir: str, model: str) -> str:
    return paths.join(data_dir, 'data', self.release, 'model_answer', f'{model}.jsonl')

  def read(self, data_dir: str) -> list[dict]:
    """The questions with each one's baseline answer in metadata['baseline_answer'].

    Raises:
      DataMissing: no question file, or no answer file of a baseline (names it).
      BadRecord: a record without a field it needs, an unknown category, or a question the
        baseline file has no answer to (file:line or file and question).
    """
    records = super().read(data_dir)
    answers = {}
    for model in sorted({r['metadata']['baseline'] for r in records}):
      path = self.answers_path(data_dir, model)
      if not paths.exists(path):
        raise base.DataMissing(f'suite {self.name!r}: no baseline answers {path} ({self.source})')
      answers[model] = (path, _answers(path))
    for r in records:
      path, by_id = answers[r['metadata']['baseline']]
      if r['id'] not in by_id:
        raise base.BadRecord(f'suite {self.name!r}: {path} has no answer to question '
                             f'{r["id"]!r}')
      r['metadata']['baseline_answer'] = by_id[r['id']]
    return records

  def parse(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    baselines = dict(self.baselines)
    out = []
    for line, row in raw:
      rid = base.field(path, line, row, 'uid' if 'uid' in row else 'question_id')
      if 'prompt' in row:
        prompt = base.field(path, line, row, 'prompt')
      else:
        turns = base.field(path, line, row, 'turns', list)
        if len(turns) != 1 or not isinstance(turns[0], Mapping) or not isinstance(
            turns[0].get('content'), str):
          raise base.BadRecord(f"{path}:{line}: field 'turns' must be one {{'content': str}} "
                               '(ArenaHard questions are single-turn)')
        prompt = turns[0]['content']
      category = base.field(path, line, row, 'category')
      if category not in baselines:
        raise base.BadRecord(f'{path}:{line}: category {category!r} is none of '
                             f'{sorted(baselines)} ({self.release})')
      meta = {'uid': rid, 'category': category, 'baseline': baselines[category]}
      for extra in ('subcategory', 'cluster'):
        if isinstance(row.get(extra), str):
          meta[extra] = row[extra]
      out.append({'id': rid, 'messages': [{'role': 'user', 'content': prompt}],
                  'metadata': meta})
    return out

  # --- judging -------------------------------------------------------------------------------

  def templates(self) -> dict[str, judge_lib.Template]:
    """category -> the judge prompt of its games."""
    return {cat: judge_lib.Template(
        user=USER_TEMPLATE, delimiters=DELIMITERS, verdict='', choices=(),
        system=CREATIVE_WRITING_PROMPT if cat in self.creative_categories else SYSTEM_PROMPT)
            for cat, _ in self.baselines}

  def grader(self, *, url: str = '', model: str = '', judge: Any = None, max_tokens: int = 0,
             temperature: float = 0.0, judge_thinking: bool | None = False,
             max_field_tokens: int = 32768, baseline_answers: str = '',
             judge_model: Any = None, **served_options) -> ArenaHardGrader:
    """A grader judging with a served judge (`url=`) or a local judge model (`judge=`).

    Args:
      url: an OpenAI-compatible API base ('http://host:8000/v1').
      model: the served model's name (default: the official judge's, `judge_model`).
      judge: a local judge: an `rl.judge.JudgeModel` (or an object with its `tokenizer`,
        `generate` and `max_len`), or an HF checkpoint directory to load one from.
      max_tokens: the judge's token budget per judgment (0: the release's).
      temperature: 'served': the judge's sampling temperature (the official 0); a local judge
        decodes greedily.
      judge_thinking: 'local': the judge prompt's thinking switch (`chat.render`).
      max_field_tokens: 'local': the most tokens of each field (the rest is cut, counted).
      baseline_answers: a model_answer file (either layout) whose answers the policy's are
        judged against instead of the release's baseline's (every question needs one); the
        grades and the result name it ('baseline').
      judge_model: 'local', with judge=DIR: that judge already loaded on the run's devices, or
        a callable loading it (`run.with_judge_loader`: sharded on the policy's mesh, with its
        sampler's options, as `launch.plan` plans it); None loads DIR on the default device.
      **served_options: 'served': further `verifiers.served.Client` options (api_key_env,
        concurrency, timeout_s, retries, backoff_s, max_backoff_s, cache_dir, extra_body).

    Raises:
      ValueError: neither or both of url= and judge=, or an option the judge rejects.
    """
    where = f'suite {self.name!r}: grader'
    if bool(url) == (judge is not None):
      raise ValueError(f'{where}: give the judge as url= (an OpenAI-compatible endpoint, e.g. '
                       f'one serving {self.judge_model}) or as judge= (a local judge model or '
                       'its HF checkpoint directory), one of them')
    budget = max_tokens or self.judge_max_tokens
    baseline = _Baseline.of(self, baseline_answers)
    if url:
      try:
        client = served.Client(url, model or self.judge_model, **served_options)
      except TypeError as e:
        raise ValueError(f'{where}: {e}') from None
      return ArenaHardGrader(self, _ServedJudge(client, self.templates(), budget, temperature),
                             baseline)
    if served_options or model:
      raise ValueError(f'{where}: {sorted(served_options) + (["model"] if model else [])} are '
                       'options of a served judge (url=), not of judge=')
    if isinstance(judge, str) and judge_model is not None:
      judge = judge_model() if callable(judge_model) else judge_model
    elif isinstance(judge, str):
      from rl import judge as rl_judge  # pylint: disable=g-import-not-at-top  (loads JAX)
      judge = rl_judge.JudgeModel.from_hf(judge)
    return ArenaHardGrader(self, _LocalJudge(judge, self.templates(), budget, judge_thinking,
                                             max_field_tokens), baseline)

  # Options of `grader` besides the served client's.
  _GRADER_OPTIONS = ('url', 'model', 'judge', 'max_tokens', 'temperature', 'judge_thinking',
                     'max_field_tokens', 'baseline_answers', 'judge_model')
  # Options that change no judgment (where and how the judge is asked, where it is loaded).
  _TRANSPORT = ('url', 'api_key_env', 'concurrency', 'timeout_s', 'retries', 'backoff_s',
                'max_backoff_s', 'cache_dir', 'judge_model')

  def check_grader_options(self, options: Mapping[str, Any]) -> None:
    """The judge must be named (url= or judge=); a served judge's options are checked by
    building its client, a local judge's directory by its config.json (the model is not
    loaded here), a baseline answers file by reading it.

    Raises:
      ValueError: one line naming the suite and the option.
    """
    where = f'suite {self.name!r}'
    opts = dict(options)
    url, judge = opts.get('url') or '', opts.get('judge')
    if bool(url) == (judge is not None):
      raise ValueError(
          f'{where} needs its judge, one of: url= (an OpenAI-compatible endpoint serving '
          f'{self.judge_model} or another judge) or judge= (a local judge model\'s HF '
          f'directory); e.g. --suite_option={self.name}.url=http://host:8000/v1 or '
          f'config.eval.suite_options.{self.name}.url')
    if isinstance(judge, str):
      if not paths.exists(paths.join(judge, 'config.json')):
        raise ValueError(f'{where}: judge={judge}: no HF checkpoint there (no config.json)')
      served_given = sorted(set(opts) - set(self._GRADER_OPTIONS)) + (
          ['model'] if opts.get('model') else [])
      if served_given:
        raise ValueError(f'{where}: {served_given} are options of a served judge (url=), not '
                         'of judge=')
      _Baseline.of(self, opts.get('baseline_answers') or '')
      return
    self.grader(**opts).close()

  def judge_use(self, options: Mapping[str, Any]) -> tuple[str, Any] | None:
    """A local judge (judge=DIR) generates greedily, both orders of every answer, up to its
    token budget (max_tokens=, else the release's); a served one (url=) runs elsewhere."""
    judge = dict(options).get('judge')
    if not isinstance(judge, str) or not judge:
      return None
    budget = int(dict(options).get('max_tokens') or self.judge_max_tokens)
    return judge, verifiers_base.JudgeUse(score_by='generate', max_new_tokens=budget,
                                          rows_per_sample=2)

  def grader_key(self, options: Mapping[str, Any]) -> Mapping[str, Any]:
    """The judge (its served model name or its directory), its sampling, and the baseline's
    answers (their file's content hash): not where or how often it is asked."""
    out = {k: v for k, v in sorted(options.items()) if k not in self._TRANSPORT}
    if options.get('url'):
      out['model'] = options.get('model') or self.judge_model
    if not isinstance(out.get('judge', ''), str):
      out['judge'] = type(out['judge']).__name__
    if out.get('baseline_answers'):
      out['baseline_answers'] = _Baseline.of(self, out['baseline_answers']).digest
    return out

  # --- the score -----------------------------------------------------------------------------

  def battles(self, game1: str | None, game2: str | None) -> list[float]:
    """One answer's battles, the policy's outcomes, each repeated by its verdict's weight, in
    show_result's order; a game without a verdict adds none (v0.1), or neither game does
    (v2.0)."""
    labels = (game1, game2)
    usable = [x in self.labels for x in labels]
    if self.drop == 'question' and not all(usable):
      return []
    out = []
    for g in self.game_order:
      if usable[g]:
        a = A_SCORE[labels[g]]
        # Game 1 has the baseline as A, game 2 the policy.
        outcome = 1.0 - a if g == 0 else a
        out += [outcome] * (self.weight if '>>' in labels[g] or '<<' in labels[g] else 1)
    return out

  def score(self, outcomes: Sequence[float]) -> dict:
    """{'value', 'ci_low', 'ci_high', 'stderr'} (percent) of one category's battles."""
    rows = np.asarray(outcomes, np.float64)
    reps = stats.bootstrap_replicates(rows, bt_win_rate, self.rounds, self.seed)
    tail = (1.0 - self.ci_level) / 2
    if self.estimator == 'bt':
      # show_result reads the percentiles of the refitted Elo ratings, then the win rates.
      lo, hi = np.quantile(_logit(reps), [tail, 1.0 - tail])
      value, low, high = bt_win_rate(rows), 1 / (1 + np.exp(-lo)), 1 / (1 + np.exp(-hi))
    else:
      value = float(reps.mean())
      low, high = np.quantile(reps, [tail, 1.0 - tail])
    return {'value': 100.0 * value, 'ci_low': 100.0 * float(low), 'ci_high': 100.0 * float(high),
            'stderr': 100.0 * float(reps.std(ddof=1))}

  def summarize(self, records: Sequence[Mapping], grades: Sequence[Sequence[base.Graded]]) -> dict:
    """The win rate against the baseline (see the module docstring).

    Returns:
      {'metric', 'value', 'stderr', 'ci_low', 'ci_high' (percent), 'ci_level', 'n' (questions
      of the value's category), 'k', 'samples', 'games' (judgments asked), 'missing' (games
      without a verdict), 'battles' (weighted, of the value's category), 'judge', 'baseline'
      (the release's baselines, or the baseline_answers file's model), and for every other
      category '<category>', '<category>_ci_low', '<category>_ci_high'}.

    Raises:
      JudgmentsMissing: more than `max_missing` of the games have no verdict (the message
        counts the reasons).
      ValueError: grades from two different judges, or no battle in the value's category.
    """
    judges = sorted({str(g.info.get('judge')) for row in grades for g in row})
    if len(judges) > 1:
      raise ValueError(f'suite {self.name!r}: grades from {len(judges)} judges ({judges}): '
                       'one evaluation, one judge')
    released = {m for _, m in self.baselines}
    own = sorted({str(g.info['baseline']) for row in grades for g in row
                  if g.info.get('baseline') and g.info['baseline'] not in released})
    if len(own) > 1:
      raise ValueError(f'suite {self.name!r}: grades against {len(own)} baseline answer files '
                       f'({own}): one evaluation, one baseline')
    metric = f'{self.metric.split(" vs ")[0]} vs {own[0]}' if own else self.metric
    by_cat: dict[str, list[float]] = collections.defaultdict(list)
    questions = collections.Counter()
    why = collections.Counter()
    games = missing = 0
    for rec, row in zip(records, grades):
      cat = rec['metadata']['category']
      questions[cat] += 1
      for g in row:
        labels = (g.info.get('game1'), g.info.get('game2'))
        for i, label in enumerate(labels, 1):
          games += 1
          if label not in self.labels:
            missing += 1
            why[str(g.info.get(f'why{i}') or 'no verdict')] += 1
        by_cat[cat] += self.battles(*labels)
    if games and missing / games > self.max_missing:
      reasons = '; '.join(f'{n} x {w}' for w, n in why.most_common(3))
      raise JudgmentsMissing(f'suite {self.name!r}: {missing} of {games} judgments '
                             f'({100 * missing / games:.1f}%) have no verdict, more than '
                             f'max_missing={100 * self.max_missing:g}% ({reasons}); none of them '
                             'is scored')
    if not by_cat[self.value_category]:
      raise ValueError(f'suite {self.name!r}: no judged battle in category '
                       f'{self.value_category!r}')
    k = max((len(row) for row in grades), default=0)
    out = {'metric': metric, 'ci_level': self.ci_level, 'n': questions[self.value_category],
           'k': k, 'samples': sum(len(row) for row in grades), 'games': games,
           'missing': missing, 'battles': len(by_cat[self.value_category]),
           'judge': judges[0] if judges else '',
           'baseline': own[0] if own else ', '.join(sorted(released))}
    out.update(self.score(by_cat[self.value_category]))
    for cat in sorted(by_cat):
      if cat != self.value_category and by_cat[cat]:
        s = self.score(by_cat[cat])
        out.update({cat: s['value'], f'{cat}_ci_low': s['ci_low'],
                    f'{cat}_ci_high': s['ci_high']})
    return out


def _answers(path: str) -> dict[str, str]:
  """question id -> answer text of a model_answer file (either layout)."""
  out = {}
  for line, row in base.rows(path):
    rid = base.field(path, line, row, 'uid' if 'uid' in row else 'question_id')
    text = None
    if 'messages' in row:
      messages = base.field(path, line, row, 'messages', list)
      last = messages[-1] if messages else None
      if isinstance(last, Mapping) and last.get('role') == 'assistant':
        text = last.get('content')
        text = text.get('answer') if isinstance(text, Mapping) else text
    else:
      choices = base.field(path, line, row, 'choices', list)
      try:
        text = choices[0]['turns'][0]['content']
      except (IndexError, KeyError, TypeError):
        text = None
    if not isinstance(text, str):
      raise base.BadRecord(f'{path}:{line}: no answer text (messages[-1].content.answer or '
                           'choices[0].turns[0].content)')
    if rid in out:
      raise base.BadRecord(f'{path}:{line}: a second answer to question {rid!r}')
    out[rid] = text
  return out


# ----------------------------------------------------------------------------- the judges

class _ServedJudge:
  """Judge prompts as chat messages to an OpenAI-compatible endpoint."""

  def __init__(self, client: served.Client, templates: Mapping[str, judge_lib.Template],
               max_tokens: int, temperature: float):
    self.client, self.max_tokens, self.temperature = client, max_tokens, temperature
    self.prompters = {c: judge_lib.MessagesPrompter(t) for c, t in templates.items()}
    self.name = f'{client.model} (served)'

  def ask(self, jobs: Sequence[tuple[str, Mapping[str, str]]]
          ) -> list[tuple[str | None, str, bool]]:
    """(reply or None, why none, whether a field was cut) of each (category, fields) prompt.

    Raises:
      JudgeUnavailable: a judgment never came for a reason other than a refusal.
    """
    replies = self.client.complete([self.prompters[c].row(f)[0] for c, f in jobs],
                                   max_tokens=self.max_tokens, temperature=self.temperature)
    down = [r for r in replies if not r.ok and not r.refused]
    if down:
      raise JudgeUnavailable(f'{len(down)} of {len(replies)} judgments never came from '
                             f'{self.client.url} ({down[0].error}); nothing of this batch is '
                             'kept: rerun to resume (answered judgments come from cache_dir)')
    return [(r.text, r.error, False) for r in replies]     # sent whole

  def close(self) -> None:
    self.client.close()


class _LocalJudge:
  """Judge prompts as token rows to a cascade judge model (`rl.judge.JudgeModel`)."""

  def __init__(self, judge: Any, templates: Mapping[str, judge_lib.Template], max_tokens: int,
               thinking: bool | None, max_field_tokens: int):
    missing = [m for m in ('tokenizer', 'generate') if not hasattr(judge, m)]
    if missing:
      raise ValueError(f'judge={type(judge).__name__} has no {missing} (expected a loaded '
                       'rl.judge.JudgeModel)')
    self.judge, self.max_tokens = judge, max_tokens
    self.prompters = {c: judge_lib.Prompter(judge.tokenizer, t, thinking, max_field_tokens,
                                            with_verdict=False) for c, t in templates.items()}
    self.name = f'{type(judge).__name__} (local)'

  def ask(self, jobs: Sequence[tuple[str, Mapping[str, str]]]
          ) -> list[tuple[str | None, str, bool]]:
    """(reply or None, why none, whether a field was cut) of each (category, fields) prompt."""
    rows = [self.prompters[c].row(f) for c, f in jobs]
    limit = getattr(self.judge, 'max_len', None)
    fits = [limit is None or len(r) <= limit for r, _ in rows]
    texts = iter(self.judge.generate([r for (r, _), ok in zip(rows, fits) if ok],
                                     self.max_tokens))
    return [(str(next(texts)), '', cut) if ok else
            (None, f'the judge prompt ({len(r)} tokens) is longer than the judge takes ({limit})',
             cut) for (r, cut), ok in zip(rows, fits)]

  def close(self) -> None:
    """The judge model is its owner's to free."""


@dataclasses.dataclass(frozen=True)
class _Baseline:
  """A baseline answers file given to the grader (`baseline_answers=`).

  Attributes:
    path: the file.
    name: its model (the file's name without .jsonl).
    answers: question id -> answer text.
    digest: a short hash of the file's content.
  """
  path: str
  name: str
  answers: Mapping[str, str]
  digest: str

  @classmethod
  def of(cls, suite: ArenaHardSuite, path: str) -> _Baseline | None:
    """The file's answers (None for ''); a ValueError naming the suite and file when it is
    missing or is not a model_answer file."""
    if not path:
      return None
    if not isinstance(path, str) or not paths.exists(path):
      raise ValueError(f'suite {suite.name!r}: baseline_answers={path}: no such file')
    try:
      answers = _answers(path)
    except base.BadRecord as e:
      raise ValueError(f'suite {suite.name!r}: baseline_answers: {e}') from None
    name = os.path.basename(path).removesuffix('.jsonl')
    digest = hashlib.sha256(paths.read_bytes(path)).hexdigest()[:16]
    return cls(path=path, name=name, answers=answers, digest=digest)

  def answer(self, question: str) -> str:
    if question not in self.answers:
      raise ValueError(f'baseline_answers={self.path} has no answer to question {question!r}')
    return self.answers[question]


class ArenaHardGrader(base.Grader):
  """Judges each answer in both orders against its question's baseline answer (one judge call
  per batch: the served judge's concurrency, the local judge's batches, busy on all of them).

  A grade's score is the share of its battles won (ties half); `summarize` scores the battles
  themselves. Its info: 'judge', 'game1' / 'game2' (the verdict labels, None when missing),
  'why1' / 'why2' (why missing), 'judgment1' / 'judgment2' (each reply's end), 'missing',
  'truncated' (a local judge read a field cut to its max_field_tokens).
  """

  def __init__(self, suite: ArenaHardSuite, judge: Any, baseline: _Baseline | None = None):
    self.suite, self.judge, self.baseline = suite, judge, baseline

  def grade(self, record: Mapping, completions: Sequence[str]) -> list[base.Graded]:
    return self.grade_batch([record], [completions])[0]

  def grade_batch(self, records: Sequence[Mapping],
                  completions: Sequence[Sequence[str]]) -> list[list[base.Graded]]:
    jobs = []
    for rec, comps in zip(records, completions):
      meta, question = rec['metadata'], rec['messages'][-1]['content']
      base_answer = (meta['baseline_answer'] if self.baseline is None
                     else self.baseline.answer(rec['id']))
      for comp in comps:
        answer = chat.split_thinking(comp).answer     # '' when its thinking never closed
        jobs.append((meta['category'], {'question': question, 'response_a': base_answer,
                                        'response_b': answer}))
        jobs.append((meta['category'], {'question': question, 'response_a': answer,
                                        'response_b': base_answer}))
    replies = iter(self.judge.ask(jobs) if jobs else ())
    s = self.suite
    out = []
    for rec, comps in zip(records, completions):
      row = []
      for _ in comps:
        info: dict[str, Any] = {'judge': self.judge.name, 'truncated': False,
                                'baseline': (rec['metadata']['baseline'] if self.baseline is None
                                             else self.baseline.name)}
        labels = []
        for g in (1, 2):
          text, error, cut = next(replies)
          info['truncated'] = info['truncated'] or cut
          label, why = ((None, error) if text is None else
                        read_verdict(text, s.patterns, s.labels, s.max_parse_chars))
          labels.append(label)
          info[f'game{g}'] = label
          if why:
            info[f'why{g}'] = why
          if text:
            info[f'judgment{g}'] = text[-_KEPT_CHARS:]
        info['missing'] = sum(x is None for x in labels)
        won = s.battles(*labels)
        info['reason'] = (f'{s.title}: {labels[0]} / {labels[1]} (game 1: baseline as A)'
                          if not info['missing'] else
                          f'{s.title}: {info["missing"]} judgment(s) without a verdict '
                          '(not scored)')
        row.append(base.Graded(score=float(np.mean(won)) if won else 0.0, info=info))
      out.append(row)
    return out

  def close(self) -> None:
    self.judge.close()


# ----------------------------------------------------------------------------- the releases

PROTOCOL = base.Protocol(samples=1, temperature=0.6, top_p=0.95, max_new_tokens=65536,
                         thinking=True)
_HUB = 'lmarena-ai/arena-hard-auto'
_C1 = 'arXiv 2512.13607 (Nemotron-Cascade), 14B-Thinking after each stage'
_C1_8B = ('arXiv 2512.13607, model card of nvidia/Nemotron-Cascade-8B-Intermediate-ckpts '
          '(8B after each stage)')
_C2 = 'arXiv 2603.19220 (Nemotron-Cascade 2), final model (model card table)'
_STAGES = ('sft_32k', 'rlhf', 'if_rl_ifbench', 'math_rl', 'code_rl', 'swe_rl')


def _per_stage(recipe: str, values: Sequence[float], source: str) -> tuple[base.Reported, ...]:
  return tuple(base.Reported(recipe=recipe, stage=s, value=v, source=source)
               for s, v in zip(_STAGES, values))


def _files(release: str, baselines: Sequence[str]) -> dict:
  return dict(files=(f'data/{release}/question.jsonl',),
              hub_files=(f'data/{release}/question.jsonl',) + tuple(
                  f'data/{release}/model_answer/{m}.jsonl' for m in baselines))


# launch.plan's bound on a rendered question (ours, assumed: some paste long code or documents)
# where it does not measure the files.
PROMPT_TOKENS = 16384

arena_hard_v1 = ArenaHardSuite(
    name='arena_hard_v1', title='ArenaHard v1 (arena-hard-auto v0.1)',
    metric='win rate vs gpt-4-0314', protocol=PROTOCOL,
    source=f'{_HUB} (data/arena-hard-v0.1: question.jsonl, model_answer/gpt-4-0314.jsonl; '
           '500 questions)',
    hub_dataset=_HUB, **_files('arena-hard-v0.1', ['gpt-4-0314']), prompt_tokens=PROMPT_TOKENS,
    records=500,
    release='arena-hard-v0.1', baselines=(('arena-hard-v0.1', 'gpt-4-0314'),),
    judge_model='gpt-4-1106-preview', judge_max_tokens=4096, patterns=(LABEL_PATTERN,),
    labels=V1_LABELS, drop='game', value_category='arena-hard-v0.1', estimator='bt',
    ci_level=0.95,
    reported=(_per_stage('nemotron_cascade_14b', (76.9, 93.1, 90.2, 89.3, 89.8, 89.5), _C1)
              + _per_stage('nemotron_cascade_8b', (70.0, 90.1, 88.0, 87.0, 87.8, 87.9),
                           _C1_8B)))

arena_hard_v2 = ArenaHardSuite(
    name='arena_hard_v2', title='ArenaHard v2 (arena-hard-v2.0)',
    metric='hard-prompt win rate vs o3-mini', protocol=PROTOCOL,
    source=f'{_HUB} (data/arena-hard-v2.0: question.jsonl, model_answer/o3-mini-2025-01-31.jsonl,'
           ' model_answer/gemini-2.0-flash-001.jsonl; 750 questions)',
    hub_dataset=_HUB, **_files('arena-hard-v2.0', ['o3-mini-2025-01-31',
                                                    'gemini-2.0-flash-001']),
    release='arena-hard-v2.0', prompt_tokens=PROMPT_TOKENS, records=750,
    baselines=(('hard_prompt', 'o3-mini-2025-01-31'), ('coding', 'o3-mini-2025-01-31'),
               ('math', 'o3-mini-2025-01-31'), ('creative_writing', 'gemini-2.0-flash-001')),
    creative_categories=('creative_writing',), judge_model='gpt-4.1', judge_max_tokens=16000,
    patterns=(LABEL_PATTERN, LOOSE_LABEL_PATTERN), labels=tuple(A_SCORE), drop='question',
    game_order=(1, 0), value_category='hard_prompt', estimator='bootstrap_mean', ci_level=0.90,
    reported=(base.Reported(recipe='nemotron_cascade2', stage='final', value=83.5, source=_C2),
              base.Reported(recipe='nemotron_cascade2', stage='mopd', value=85.5,
                            source='arXiv 2603.19220, MOPD (52 steps) against RLHF')))
