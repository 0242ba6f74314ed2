"""Agentic SWE domain: fix a one-file repository with tools (`envs.swe_agent`), hidden test.

  prompt:  Fix calc.py. Issue: y must be x plus 7.
  repo:    calc.py = def calc(x):
                         y = x - 7
                         return y * 2
  episode: read_file calc.py -> edit 'y = x - 7' -> 'y = x + 7' -> run_tests
           -> passed -> "done"

The functions, bugs, issue lines and failing inputs are the agentless SWE
domain's (`swe_tasks`); here the prompt is only the issue line and the
policy reads and edits the file itself. The visible test (`run_tests`) is
swe_tasks' failing assertion; the hidden test that scores the episode adds
a second input, so a fix that special-cases the visible input fails it.
Metadata: {"repo": {path: text}, "test": hidden test, "visible_test": str,
"gold_patch": swe_tasks' diff}.

Train and held-out problems are split by swe_tasks' key (function, bug)
hashed under swe_tasks' domain name, so a bug held out of one SWE domain is
held out of both. Train keys are halved once more: demonstrations come from
one half, RL prompts from the other.

Demonstrations (`sft_records`) are multi-turn: the scripted assistant turns
(tool calls as `foundation.chat.parse_tool_calls` reads them) are run in
`envs.swe_agent`, so every tool result is the environment's own text, and
each demonstration's reward is checked (1 for a fix, 0 for a flawed one).
Flawed demonstrations show an imperfect agent: a wrong edit, an edit made
without reading that guesses the line wrong (so it fails and nothing
changes), or stopping after reading. Building demonstrations needs the
sandbox (bubblewrap by default): about one sandbox run per demonstration
for `run_tests` and one for scoring, ~18 s for 2000 on two CPU cores.
"""

from __future__ import annotations

import ast
import dataclasses
import random
from typing import Any, Sequence

from envs import swe_agent
from foundation import chat
from tiny_world import common
from tiny_world import swe_tasks
from verifiers import unidiff

DOMAIN = 'swe_agent'
HELDOUT_PERCENT = swe_tasks.HELDOUT_PERCENT
FLAWS = ('wrong_edit', 'blind_edit', 'no_edit')
FINAL = 'done'
_FAILING = 'Failing: assert '


@dataclasses.dataclass(frozen=True)
class Task(common.Problem):
  """A problem with what demonstrations need.

  Attributes:
    path: the repository's one file.
    name: the function's name.
    buggy_line, fixed_line: the buggy line and its fix (unindented).
    cases: (input, expected output) of the hidden test.
  """
  path: str
  name: str
  buggy_line: str
  fixed_line: str
  cases: tuple


def _test(module: str, name: str, cases: Sequence[tuple[Any, Any]]) -> str:
  """A test program whose failure says what the function returned."""
  lines = [f'from {module} import {name}']
  for value, want in cases:
    call = f'{name}({value!r})'
    message = f"{f'{call} gave '!r} + repr(got) + {f', expected {want!r}'!r}"
    lines += [f'got = {call}', f'assert got == {want!r}, {message}']
  return '\n'.join(lines) + '\n'


def _extra_input(key: tuple, first: Any, good, bad, rng: random.Random) -> Any:
  """A second test input: one the buggy function also fails if there is one, else any valid one."""
  # pylint: disable-next=protected-access  # The sibling generator's own input samplers.
  sample, values = swe_tasks._INPUTS[key[0]], dict(key[1][-1][1])
  fallback = None
  for _ in range(20):
    value = sample(rng, values)
    want = good(value)
    if value == first or isinstance(want, str) and want.startswith('<'):
      continue  # The same input, or one the fixed function crashes on.
    if bad(value) != want:
      return value
    fallback = value if fallback is None else fallback
  return fallback


def realize(key: tuple, rng: random.Random) -> Task | None:
  """The agentic task of a swe_tasks key, or None when swe_tasks has none for it."""
  p = swe_tasks.realize(key, rng)
  if p is None:
    return None
  head, *source, failing = p.prompt.split('\n')
  gold = p.metadata['gold_patch']
  (patch,) = unidiff.parse(gold)
  path = patch.path
  if not (head.startswith(f'Fix {path}. Issue: ') and failing.startswith(_FAILING)
          and source[0].startswith('def ')
          and [tag for tag, _ in patch.hunks[0].lines] == ['-', '+']):
    raise RuntimeError(f'swe_tasks problems changed their layout: {p.prompt!r}, {gold!r}')
  buggy = '\n'.join(source) + '\n'
  fixed = unidiff.apply([patch], {path: buggy})[path]
  name = source[0][len('def '):source[0].index('(')]
  call = failing[len(_FAILING):].rsplit(' == ', 1)[0]
  first = ast.literal_eval(call[len(name) + 1:-1])
  # pylint: disable-next=protected-access  # swe_tasks' crash-safe runner of its functions.
  good, bad = swe_tasks._compile(fixed, name), swe_tasks._compile(buggy, name)
  extra = _extra_input(key, first, good, bad, rng)
  cases = tuple((v, good(v)) for v in (first, extra) if v is not None)
  module = path[:-len('.py')]
  (_, removed), (_, added) = patch.hunks[0].lines
  return Task(key=key, prompt=head, answer=p.answer, thinking=p.thinking,
              metadata={'repo': {path: buggy}, 'test': _test(module, name, cases),
                        'visible_test': _test(module, name, cases[:1]), 'gold_patch': gold},
              path=path, name=name, buggy_line=removed.strip(), fixed_line=added.strip(),
              cases=cases)


def _rng(seed: int, *parts: str) -> random.Random:
  # String seeds hash with SHA-512 in CPython: stable across runs and PYTHONHASHSEED.
  return random.Random('/'.join(['tiny_world', str(seed), DOMAIN, *parts]))


def in_sft_half(key: tuple) -> bool:
  """Train problems are halved by key: demonstrations from one half, RL prompts from the other."""
  return common.split_of(f'{DOMAIN}/sft', key, 50) == common.HELDOUT


def draw(seed: int, n: int, split: str, part: str) -> list[Task]:
  """`n` distinct tasks of `split`; train ones from the `part` ('sft' or 'rl') half.

  The split is swe_tasks' (its key, hashed under its domain name).
  """
  if part not in ('sft', 'rl'):
    raise ValueError(f"{DOMAIN}: part must be 'sft' or 'rl', got {part!r}")

  def realize_part(key, rng):
    if split == common.TRAIN and in_sft_half(key) != (part == 'sft'):
      return None
    return realize(key, rng)
  return common.draw_unique(swe_tasks.DOMAIN, split, n, HELDOUT_PERCENT, swe_tasks.draw_key,
                            realize_part, _rng(seed, part, split))


def prompt_records(seed: int, n: int, split: str) -> list[dict[str, Any]]:
  """RL / eval prompt records.

  Args:
    seed: the world's seed.
    n: how many (distinct problems; train ones never demonstrated by `sft_records`).
    split: common.TRAIN or common.HELDOUT.

  Returns:
    Canonical prompt records {id, domain, messages, metadata}.
  """
  return [common.prompt_record(DOMAIN, f'{DOMAIN}/{split}/{i:05d}', t)
          for i, t in enumerate(draw(seed, n, split, 'rl'))]


def _wrong_line(task: Task, rng: random.Random, *, runs: bool) -> str | None:
  """Another mutation of the correct line: neither the bug nor the fix, and (`runs`) one the
  hidden test catches, or (not `runs`) text the file does not hold."""
  _, lines, where, _ = task.key
  template, values = lines[where]
  buggy_source = task.metadata['repo'][task.path]
  for _ in range(20):
    # pylint: disable-next=protected-access  # swe_tasks' own bug maker.
    line = template.format(**swe_tasks._mutate((template, dict(values)), rng))
    if line in (task.buggy_line, task.fixed_line):
      continue
    if not runs:
      if line not in buggy_source:
        return line
      continue
    # pylint: disable-next=protected-access
    wrong = swe_tasks._compile(buggy_source.replace(task.buggy_line, line), task.name)
    if any(wrong(value) != want for value, want in task.cases):
      return line
  return None


def script(task: Task, flaw: str | None, rng: random.Random) -> tuple[list[str], str | None]:
  """The assistant turns of a demonstration, and the flaw they show (None: a correct fix).

  A flaw that cannot be drawn for the task (no suitable wrong line) falls
  back to 'no_edit'.
  """
  read = chat.render_tool_call('read_file', {'path': task.path})
  edit = lambda old, new: chat.render_tool_call('edit', {'path': task.path, 'old': old, 'new': new})
  if flaw is None:
    return [read, edit(task.buggy_line, task.fixed_line), chat.render_tool_call('run_tests', {}),
            FINAL], None
  if flaw == 'wrong_edit':
    line = _wrong_line(task, rng, runs=True)
    if line is not None:
      return [read, edit(task.buggy_line, line), FINAL], flaw
  if flaw == 'blind_edit':
    line = _wrong_line(task, rng, runs=False)
    if line is not None:
      return [edit(line, task.fixed_line), FINAL], flaw
  return [read, FINAL], 'no_edit'


def sft_records(seed: int, n: int, flaw_rate: float = 0.0, *, isolation: str = 'bwrap',
                workers: int | None = None) -> list[dict[str, Any]]:
  """Multi-turn demonstrations, run in `envs.swe_agent` (see the module docstring).

  Args:
    seed: the world's seed.
    n: how many (distinct train problems, never RL prompts).
    flaw_rate: fraction of flawed demonstrations (they carry "flawed": true).
    isolation, workers: the environment's sandbox options.

  Returns:
    Records {id, domain, messages: [user], turns: [assistant, tool, ...,
    assistant], metadata}, flawed ones with "flawed": true.

  Raises:
    ValueError: flaw_rate outside [0, 1].
    RuntimeError: a demonstration did not score as its script says (1 for a
      fix, 0 for a flaw).
  """
  if not 0.0 <= flaw_rate <= 1.0:
    raise ValueError(f'{DOMAIN}: flaw_rate={flaw_rate!r} must be in [0, 1]')
  tasks = draw(seed, n, common.TRAIN, 'sft')
  flaw_rng = _rng(seed, 'flaw')
  scripts = []
  for task in tasks:
    flaw = flaw_rng.choice(FLAWS) if flaw_rng.random() < flaw_rate else None
    scripts.append(script(task, flaw, flaw_rng))
  records = [dict(common.prompt_record(DOMAIN, f'{DOMAIN}/sft/{i:05d}', t), turns=[])
             for i, t in enumerate(tasks)]
  with swe_agent.SweAgentEnv(isolation=isolation, workers=workers) as env:
    episodes = env.reset(records)
    for turn in range(max((len(actions) for actions, _ in scripts), default=0)):
      live = [i for i, (actions, _) in enumerate(scripts) if turn < len(actions)]
      steps = env.step([episodes[i] for i in live], [scripts[i][0][turn] for i in live])
      for i, step in zip(live, steps):
        records[i]['turns'].append({'role': 'assistant', 'content': scripts[i][0][turn]})
        records[i]['turns'].extend(dict(m) for m in step.messages)
        if step.done != (turn == len(scripts[i][0]) - 1):
          raise RuntimeError(f'{records[i]["id"]}: turn {turn} ended={step.done}, against its '
                             'script')
        want = 0.0 if scripts[i][1] else 1.0
        if step.done and step.reward != want:
          raise RuntimeError(f'{records[i]["id"]} ({scripts[i][1] or "fix"}) scored {step.reward}, '
                             f'not {want}: {step.info}')
  for rec, (_, flaw) in zip(records, scripts):
    if flaw:
      rec['flawed'] = True
  return records
