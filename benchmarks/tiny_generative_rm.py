"""The tiny world's RLHF with a Bradley-Terry vs a generative reward model: the report page.

  .venv/bin/python -m benchmarks.tiny_generative_rm \
      --run bt=/tmp/jw/m_bt --run generative=/tmp/jw/m_generative \
      --world=/tmp/jw/world/seed0 --command="$(cat /tmp/jw/measure.sh)" \
      --note="$(cat notes.md)" --out=docs/tiny_generative_rm.md

Reads finished runs of configs/tiny.py (`rm=bt` and `rm=generative`, same seed)
and writes a Markdown page: each run's evaluation matrix (held-out scores:
chat by the world's hidden quality rule, never by the reward RLHF trained
on), the chat row before and after RLHF, each stage's wall time, and how well
each run's RLHF reward agreed with the hidden rule on the rollouts RLHF
logged (samples.jsonl: `config.eval.log_samples` per step; the mean reward
of every rollout per step is metrics.jsonl's reward_mean): the Pearson
correlation of reward and hidden quality, and the hidden quality of the
first and last logged steps' rollouts. The page quotes `--command` as the
command that produced the runs and ends with `--note`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Sequence

import numpy as np

from foundation import chat as chat_lib
from tiny_world import chat


def _read_jsonl(path: str) -> list[dict]:
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def rollout_agreement(workdir: str, world_dir: str, stage: str = 'rlhf') -> dict:
  """Reward vs hidden quality on the chat rollouts `stage` logged to samples.jsonl.

  Args:
    workdir: a finished run's workdir.
    world_dir: the world it ran on (its chat/rl_train.jsonl has each prompt's topic).
    stage: the RL stage.

  Returns:
    {'n', 'pearson' (None under 3 samples or a constant column), 'first_quality' and
    'last_quality' (mean hidden quality of the first and last logged step's rollouts),
    'first_reward', 'last_reward'}.
  """
  topics = {r['id']: r['metadata']['topic']
            for r in _read_jsonl(os.path.join(world_dir, 'chat', 'rl_train.jsonl'))}
  rows = []
  for s in _read_jsonl(os.path.join(workdir, 'samples.jsonl')):
    if s.get('stage') != stage or s.get('domain') != 'chat':
      continue
    if s['id'] not in topics:
      raise ValueError(f'{workdir}/samples.jsonl: sample id {s["id"]!r} is not in '
                       f'{world_dir}/chat/rl_train.jsonl')
    split = chat_lib.split_thinking(s['completion'])
    answer = split.answer.replace(chat_lib.IM_END, '')
    q = chat.quality(answer, topics[s['id']]).score if split.finished_thinking else 0.0
    rows.append((s['step'], float(s['reward']), q))
  if not rows:
    raise ValueError(f'{workdir}/samples.jsonl: no {stage!r} chat samples')
  steps = np.array([r[0] for r in rows])
  reward, quality = np.array([r[1] for r in rows]), np.array([r[2] for r in rows])
  pearson = None
  if len(rows) >= 3 and reward.std() > 0 and quality.std() > 0:
    pearson = float(np.corrcoef(reward, quality)[0, 1])
  first, last = steps == steps.min(), steps == steps.max()
  return {'n': len(rows), 'pearson': pearson,
          'first_step': int(steps.min()), 'last_step': int(steps.max()),
          'first_quality': float(quality[first].mean()),
          'last_quality': float(quality[last].mean()),
          'first_reward': float(reward[first].mean()), 'last_reward': float(reward[last].mean())}


def reward_curve(workdir: str, stage: str = 'rlhf') -> list[float]:
  """The stage's mean training reward per step (metrics.jsonl: every rollout of the step)."""
  rows = [m for m in _read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
          if m.get('stage') == stage and 'reward_mean' in m]
  return [float(m['reward_mean']) for m in sorted(rows, key=lambda m: m['step'])]


def _fmt(x) -> str:
  return 'n/a' if x is None else f'{x:.3f}'


def report(runs: Sequence[tuple[str, str]], world_dir: str, command: str, note: str = '') -> str:
  """The page's Markdown for `runs` [(label, workdir)], ending with `note` (Markdown)."""
  lines = ['# Tiny world: RLHF with a Bradley-Terry vs a generative reward model', '',
           'Written by `benchmarks/tiny_generative_rm.py` from the runs below. Held-out '
           'scores (percent) are 2 samples x 200 prompts per domain at temperature 0.6; chat '
           "is scored by the world's hidden quality rule in every run, never by the reward "
           'RLHF trained on. `rm=bt`: RLHF rewarded by the Bradley-Terry reward model (stage '
           '`rm`, on the preference pairs); `rm=generative`: by P(YES) of the judge '
           '(stage `judge`: the SFT policy fine-tuned on `judge_sft.jsonl`, the verdict '
           'records of tiny_world/judge_data.py) through verifier `judge` '
           '(configs/_tiny_common.py).', '', 'Produced by:', '', '```', command.strip(), '```',
           '']
  lines += ['## Chat before and after RLHF', '',
            '| run | chat after SFT | chat after RLHF | change | RLHF mean reward, first -> '
            'last step | hidden quality of logged RLHF rollouts, first -> last step | '
            'reward vs hidden quality (Pearson, logged rollouts) |',
            '|---|---:|---:|---:|---|---|---:|']
  details = []
  for label, workdir in runs:
    with open(os.path.join(workdir, 'results.json'), encoding='utf-8') as f:
      res = json.load(f)
    col = res['domains'].index('chat')
    before = res['scores'][res['stages'].index('sft')][col]
    after = res['scores'][res['stages'].index('rlhf')][col]
    ag = rollout_agreement(workdir, world_dir)
    curve = reward_curve(workdir)
    lines.append(f'| {label} | {before:.1f} | {after:.1f} | {after - before:+.1f} | '
                 f'{curve[0]:.3f} -> {curve[-1]:.3f} ({len(curve)} steps) | '
                 f'{ag["first_quality"]:.3f} -> {ag["last_quality"]:.3f} | '
                 f'{_fmt(ag["pearson"])} (n={ag["n"]}) |')
    details.append((label, workdir, res))
  lines.append('')
  for label, workdir, res in details:
    lines += [f'## {label}: the matrix', '', f'`{workdir}`', '',
              '| stage | ' + ' | '.join(res['domains']) + ' |',
              '|---|' + '---:|' * len(res['domains'])]
    for i, (stage, row) in enumerate(zip(res['stages'], res['scores'])):
      cells = [f'{v:.1f}' if i == 0 else f'{v:.1f} ({v - res["scores"][i - 1][j]:+.1f})'
               for j, v in enumerate(row)]
      lines.append(f'| {stage} | ' + ' | '.join(cells) + ' |')
    acc = res.get('accounting', {})
    if acc:
      lines += ['', 'Stage wall time (steps, compiles included, evaluation excluded): ' +
                ', '.join(f'{name} {a["step_s"]:.0f} s ({a["steps"]} steps)'
                          for name, a in acc.items() if 'step_s' in a) + '.']
    lines.append('')
  if note.strip():
    lines += ['## Notes', '', note.strip(), '']
  return '\n'.join(lines)


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog='python -m benchmarks.tiny_generative_rm',
                              description=__doc__.split('\n\n')[0])
  p.add_argument('--run', action='append', required=True, metavar='LABEL=WORKDIR',
                 help='a finished run (repeat)')
  p.add_argument('--world', required=True, help="the runs' world directory (<root>/seed<N>)")
  p.add_argument('--command', required=True, help='the command that produced the runs')
  p.add_argument('--note', default='', help="Markdown for the page's Notes section")
  p.add_argument('--out', help='write the page here (default: print it)')
  args = p.parse_args(argv)
  runs = []
  for item in args.run:
    label, eq, workdir = item.partition('=')
    if not eq or not label or not workdir:
      raise SystemExit(f'--run {item!r}: expected LABEL=WORKDIR')
    runs.append((label, workdir))
  page = report(runs, args.world, args.command, args.note)
  if args.out:
    with open(args.out, 'w', encoding='utf-8') as f:
      f.write(page + '\n')
  else:
    print(page)


if __name__ == '__main__':
  main()
