"""The environment interface's scoring (envs/base.py): an exception from `_score` costs only the
episodes it is raised for, and is the environment's own error only when a fresh episode of the
same record raises with every probe answer too."""

import pytest

from envs import base
from verifiers import base as verifiers_base
from verifiers import sandbox as sandbox_lib


class _Env(base.Environment):
  """No tools; the final answer is scored by `rule(episode, answer)` (which may raise)."""

  name = 'toy_env'

  def __init__(self, rule):
    super().__init__()
    self.rule = rule

  def tools(self, record):
    return []

  def _score(self, episodes, answers):
    return [self.rule(ep, a) for ep, a in zip(episodes, answers)]


def _records(n=3):
  return [{'id': f'r{i}', 'domain': 'toy', 'messages': [{'role': 'user', 'content': 'q?'}],
           'metadata': {'answer': str(i)}} for i in range(n)]


def test_an_environment_that_raises_whatever_the_answer_marks_its_own_error():
  def rule(ep, answer):
    return float(answer == ep.record['metadata']['answr']), {'reason': 'checked'}   # its bug

  env = _Env(rule)
  recs = _records()
  steps = env.step(env.reset(recs), ['0', '<think>x</think>1', 'oops'])
  for s in steps:
    assert s.done and s.reward == 0.0 and s.info['reason'] == "error: KeyError: 'answr'"
    assert s.info['verifier'] == 'env:toy_env'
    assert s.info['verifier_error'].startswith('KeyError: answr at tests/envs/test_base.py:')
  cut = env.finish(env.reset(recs[:1]), ['max_turns'])
  assert cut[0].info['verifier_error'] and cut[0].info['cut'] == 'max_turns'
  assert env.own_error(recs[0]).endswith(' in rule')


def test_an_exception_only_some_answers_reach_costs_only_those_episodes():
  def rule(ep, answer):
    if answer and answer.startswith('{'):
      raise ValueError('cannot parse')               # a weakness hostile text reaches
    return float(answer == ep.record['metadata']['answer']), {'reason': 'checked'}

  env = _Env(rule)
  steps = env.step(env.reset(_records()), ['0', '{{{', '2'])
  assert [s.reward for s in steps] == [1.0, 0.0, 1.0]
  assert steps[1].info == {'reason': 'error: ValueError: cannot parse'}
  assert env.own_error(_records()[0]) is None
  assert not any(a.startswith('{') for a in verifiers_base.PROBE_ANSWERS)


def test_a_sandbox_that_cannot_start_still_stops_the_run():
  def rule(ep, answer):
    raise sandbox_lib.SandboxUnavailable('bubblewrap is unusable')

  env = _Env(rule)
  with pytest.raises(sandbox_lib.SandboxUnavailable):
    env.step(env.reset(_records(2)), ['0', '1'])
