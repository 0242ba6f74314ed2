"""benchmarks/tiny_generative_rm.py on a hand-made run: the hidden quality of logged rollouts,
its correlation with the reward (against numpy float64), and the page's chat row."""

import json
import os

import numpy as np
import pytest

from benchmarks import tiny_generative_rm as report_lib
from tiny_world import chat


def _write_jsonl(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    for r in rows:
      f.write(json.dumps(r) + '\n')


@pytest.fixture
def run(tmp_path):
  world = tmp_path / 'world'
  _write_jsonl(str(world / 'chat' / 'rl_train.jsonl'), [
      {'id': 'chat/rl/0', 'metadata': {'topic': 'bee'}},
      {'id': 'chat/rl/1', 'metadata': {'topic': 'lamp'}}])
  answers = [  # (step, prompt id, completion, reward)
      (1, 'chat/rl/0', 'The bee is busy all day.<|im_end|>', 0.9),
      (1, 'chat/rl/1', 'The bee is busy all day and', 0.2),
      (2, 'chat/rl/1', 'I like the lamp a lot.', 0.7),
      (2, 'chat/rl/0', '<think>unclosed', 0.4),
      (2, 'chat/rl/0', 'Bee.', 0.1)]
  wd = tmp_path / 'run'
  _write_jsonl(str(wd / 'samples.jsonl'), [
      {'stage': 'rlhf', 'step': st, 'domain': 'chat', 'id': i, 'completion': c, 'reward': r}
      for st, i, c, r in answers] + [
      {'stage': 'if_rl', 'step': 1, 'domain': 'instruction_following', 'id': 'x',
       'completion': '', 'reward': 1.0}])
  _write_jsonl(str(wd / 'metrics.jsonl'), [
      {'stage': 'sft', 'step': 1, 'loss': 2.0},
      {'stage': 'rlhf', 'step': 2, 'reward_mean': 0.75},
      {'stage': 'rlhf', 'step': 1, 'reward_mean': 0.25}])
  (wd / 'results.json').write_text(json.dumps({
      'domains': ['chat', 'math'], 'stages': ['sft', 'rlhf'],
      'scores': [[40.0, 10.0], [55.5, 9.0]],
      'accounting': {'sft': {'steps': 3, 'step_s': 12.0}, 'rlhf': {'steps': 2, 'step_s': 30.0}}}))
  topic = {'chat/rl/0': 'bee', 'chat/rl/1': 'lamp'}
  quality = [0.0 if c.startswith('<think>') else
             chat.quality(c.replace('<|im_end|>', ''), topic[i]).score for _, i, c, _ in answers]
  return str(wd), str(world), answers, np.array(quality, np.float64)


def test_rollout_agreement_is_reward_against_the_hidden_rule(run):
  wd, world, answers, quality = run
  got = report_lib.rollout_agreement(wd, world)
  reward = np.array([a[3] for a in answers], np.float64)
  assert quality[0] == 1.0 and quality[1] < 1.0          # the rule sees each answer's topic
  assert got['n'] == 5
  assert got['pearson'] == pytest.approx(np.corrcoef(reward, quality)[0, 1], abs=1e-12)
  assert got['first_quality'] == pytest.approx(quality[:2].mean())
  assert got['last_quality'] == pytest.approx(quality[2:].mean())
  assert (got['first_reward'], got['last_reward']) == pytest.approx((0.55, 0.4))


def test_report_page_has_the_chat_row_and_the_matrix(run, tmp_path):
  wd, world, _, _ = run
  out = tmp_path / 'page.md'
  report_lib.main(['--run', f'generative={wd}', '--world', world, '--command', 'make it',
                   '--note', 'A *note*.', '--out', str(out)])
  page = out.read_text()
  assert '| generative | 40.0 | 55.5 | +15.5 | 0.250 -> 0.750 (2 steps) |' in page
  assert '| rlhf | 55.5 (+15.5) | 9.0 (-1.0) |' in page
  assert 'make it' in page and 'rlhf 30 s (2 steps)' in page
  assert page.endswith('## Notes\n\nA *note*.\n\n')
  with pytest.raises(SystemExit, match='LABEL=WORKDIR'):
    report_lib.main(['--run', wd, '--world', world, '--command', 'x'])
  with pytest.raises(ValueError, match='no .math_rl. chat samples'):
    report_lib.rollout_agreement(wd, world, stage='math_rl')
