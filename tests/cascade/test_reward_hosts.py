"""One reward per rollout on every host: `rollout.score` split across hosts, then exchanged.

The fast tests run N simulated hosts as threads of one process, each calling
`rollout.score` with its own verifiers and an in-memory exchange (a barrier
with a timeout, so a host left waiting fails the test instead of hanging
it). Every record pays its own reward value, so a reward written back to
another row shows. The multiprocess test runs two real JAX processes
(gloo over localhost, tests/cascade/reward_hosts_worker.py) whose RL draws
are scored by verifiers that disagree: one host's is slow and times out, or
then fails.
"""

import json
import os
import socket
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from cascade import rollout
from rl import sampler as sampler_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, 'tests', 'cascade', 'reward_hosts_worker.py')
SP = sampler_lib.SamplingParams(temperature=1.0, max_new_tokens=8)


def _rollouts(fakes, g=3, n=5, right=lambda n, g: g != 1):
  """n prompts of each of domains a and b, interleaved, g samples each (sample 1 wrong)."""
  recs = [fakes.record(d, i, (10 if d == 'a' else 30) + i) for i in range(n) for d in 'ab']
  sampler = fakes.OwnAnswerSampler(answer=lambda k: str(k if k < 30 else k + 1), right=right)
  return rollout.generate(sampler, None, fakes.CharTokenizer(), recs, [None] * len(recs),
                          jax.random.key(0), SP, g)


class _Wrong:
  """Pays 100 + the record's value: what this host would say differs from every other host's."""

  def __init__(self, domain):
    self.domain, self.seen = domain, []

  def score(self, samples):
    self.seen += samples
    return [types.SimpleNamespace(reward=100.0 + s.metadata['value'],
                                  info={'id': s.metadata['id'], 'host_says': 'wrong'})
            for s in samples]


class _Failing:
  def score(self, samples):
    raise RuntimeError('verifier workers could not start')


def test_shares_are_whole_groups_split_evenly_in_row_order(fakes):
  ro = _rollouts(fakes, g=3, n=5)           # 10 groups of 3 rows
  assert [list(r) for r in rollout.groups(ro)][:2] == [[0, 1, 2], [3, 4, 5]]
  assert len(rollout.groups(ro)) == 10
  np.testing.assert_array_equal(rollout.owners(ro, 1), np.zeros(30))
  # 10 groups over 3 hosts: 4, 3, 3 groups, contiguous.
  np.testing.assert_array_equal(rollout.owners(ro, 3), np.repeat([0, 1, 2], [12, 9, 9]))
  # A collective domain's rows all belong to host 0; the other domain's 5 groups are shared.
  own = rollout.owners(ro, 2, collective=['b'])
  doms = np.array([r['domain'] for r in ro.records])
  assert (own[doms == 'b'] == 0).all()
  np.testing.assert_array_equal(own[doms == 'a'], np.repeat([0, 1], [9, 6]))
  # More hosts than groups: the last hosts get none.
  np.testing.assert_array_equal(rollout.owners(ro, 12)[::3], list(range(10)))


@pytest.mark.parametrize('count', [2, 3])
def test_every_host_gets_each_rows_reward_from_the_host_that_scored_it(fakes, count):
  ro = _rollouts(fakes, g=3, n=5)
  one_host = {d: fakes.ValueVerifier(d) for d in 'ab'}
  want, want_infos = rollout.score(ro, one_host.__getitem__, fakes.Sample)
  # Host 0 and the last host pay the record's value; the hosts between disagree (_Wrong).
  vs = [{d: (fakes.ValueVerifier(d) if h in (0, count - 1) else _Wrong(d)) for d in 'ab'}
        for h in range(count)]
  out = fakes.score_on_hosts(ro, vs, fakes.Sample)
  owner = rollout.owners(ro, count)
  value = np.array([r['metadata']['value'] for r in ro.records], np.float32)
  expect = np.where(np.isin(owner, [0, count - 1]), want, 100.0 + value)
  for h in range(count):
    rewards, infos = out[h]
    np.testing.assert_array_equal(rewards, expect)             # the same on every host
    assert [i['id'] for i in infos] == [r['metadata']['id'] for r in ro.records]
    assert rewards.dtype == np.float32
  assert out[0][1] == out[count - 1][1]
  for i in np.flatnonzero(np.isin(owner, [0, count - 1])):
    assert out[0][1][i] == want_infos[i]
  # Each row was scored once, by its owner only.
  seen = [sorted(s.metadata['id'] for v in vs[h].values() for s in v.seen) for h in range(count)]
  assert sorted(sum(seen, [])) == sorted(r['metadata']['id'] for r in ro.records)
  for h in range(count):
    assert seen[h] == sorted(ro.records[i]['metadata']['id'] for i in np.flatnonzero(owner == h))


def test_a_collective_verifier_is_run_by_every_host_and_host_0s_rewards_are_kept(fakes):
  ro = _rollouts(fakes, g=2, n=4)
  vs = [{d: fakes.ValueVerifier(d) for d in 'ab'}, {'a': fakes.ValueVerifier('a'),
                                                     'b': _Wrong('b')}]
  for h in range(2):
    setattr(vs[h]['b'], rollout.COLLECTIVE, True)
  out = fakes.score_on_hosts(ro, vs, fakes.Sample)
  want, _ = rollout.score(ro, {d: fakes.ValueVerifier(d) for d in 'ab'}.__getitem__,
                          fakes.Sample)
  np.testing.assert_array_equal(out[0][0], want)
  np.testing.assert_array_equal(out[1][0], want)
  n_b = sum(r['domain'] == 'b' for r in ro.records)
  assert len(vs[0]['b'].seen) == len(vs[1]['b'].seen) == n_b        # both ran it on every row
  assert len(vs[0]['a'].seen) + len(vs[1]['a'].seen) == len(ro.records) - n_b


def test_a_host_whose_scoring_fails_makes_every_host_raise_the_same_error(fakes):
  ro = _rollouts(fakes)
  vs = [{d: fakes.ValueVerifier(d) for d in 'ab'} for _ in range(2)] + [
      {d: _Failing() for d in 'ab'}]
  out = fakes.score_on_hosts(ro, vs, fakes.Sample)
  msgs = {str(e) for e in out.values()}
  assert all(isinstance(e, RuntimeError) for e in out.values()) and len(msgs) == 1
  assert 'scoring failed on process 2 of 3' in msgs.pop()
  assert 'verifier workers could not start' in str(out[0])


def test_hosts_that_sampled_different_completions_are_an_error(fakes):
  ros = [_rollouts(fakes), _rollouts(fakes, right=lambda n, g: g != 2)]
  out = fakes.score_on_hosts(ros, [{d: fakes.ValueVerifier(d) for d in 'ab'} for _ in range(2)],
                        fakes.Sample)
  assert all(isinstance(e, RuntimeError) and 'different completions' in str(e)
             for e in out.values())


def test_infos_cross_hosts_as_plain_json(fakes):
  ro = _rollouts(fakes, g=2, n=2)

  class Numpy:
    def score(self, samples):
      return [types.SimpleNamespace(reward=np.float32(0.5),
                                    info={'ok': np.bool_(True), 'n': np.int64(3),
                                          'v': np.arange(2), 'tags': {'x'}}) for _ in samples]

  out = fakes.score_on_hosts(ro, [{'a': Numpy(), 'b': Numpy()}] * 2, fakes.Sample)
  for rewards, infos in out.values():
    np.testing.assert_array_equal(rewards, np.full(len(ro.records), 0.5, np.float32))
    assert infos[0] == {'ok': True, 'n': 3, 'v': [0, 1], 'tags': ['x']}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.heavy
@pytest.mark.multiprocess
def test_two_hosts_with_a_slow_then_failing_verifier_agree_or_fail_together(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  env.pop('XLA_FLAGS', None)
  coordinator = f'127.0.0.1:{_free_port()}'
  procs = [subprocess.Popen([sys.executable, WORKER, coordinator, str(i), str(tmp_path)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=120)[0])      # a hang fails here, not forever
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  codes = [p.returncode for p in procs]
  assert codes == [0, 0], '\n'.join(f'--- process {i} exited {c}:\n{log[-3000:]}'
                                     for i, (c, log) in enumerate(zip(codes, logs)))
  r0, r1 = (json.loads((tmp_path / f'{i}.json').read_text()) for i in range(2))
  # The same rewards, rows with loss and refill rounds on both hosts, every step.
  assert r0['steps'] == r1['steps'] and len(r0['steps']) == 3
  # Process 1's verifier timed out (reward 0) on every row it scored: its groups were all
  # equal and dropped, so each step refilled; the kept groups are those process 0 scored.
  assert all(s['fill']['rounds'] == 2 for s in r0['steps'])
  assert all(0 not in s['rewards'] for s in r0['steps'])
  # Every rollout was scored once: 3 steps x 2 rounds x 16 rows, half on each host.
  assert len(r0['scored_here']) == len(r1['scored_here']) == 48
  # Then process 1's verifier fails: one clear error, the same on both hosts.
  assert r0['error'] == r1['error']
  assert r0['error'].startswith('scoring failed on process 1 of 2')
  assert 'verifier workers could not start' in r0['error']


def test_verifier_set_marks_the_verifiers_that_hold_a_reward_model_collective():
  from cascade import verifier_set  # pylint: disable=g-import-not-at-top
  dom = lambda verifier, rm='', eval_verifier=None: types.SimpleNamespace(
      verifier=verifier, verifier_options={}, eval_verifier=eval_verifier or verifier,
      eval_verifier_options={}, reward_model_stage=rm, agentic=False)
  plan = types.SimpleNamespace(
      domains={'chat': dom('reward_model', 'rm', 'math'), 'math': dom('math'),
               'if': dom('instruction_following', 'rm')},
      stage=lambda name: name)
  scorer = lambda prompts, completions: np.zeros(len(prompts), np.float32)
  vs = verifier_set.VerifierSet(plan, rm_scorer=lambda st: scorer, rm_ready=lambda n: True)
  try:
    collective = lambda v: getattr(v, rollout.COLLECTIVE, False)
    assert collective(vs.train_verifier('chat')) and collective(vs.train_verifier('if'))
    assert not collective(vs.train_verifier('math'))
    # Held-out IF and chat here score without the reward model: split across hosts.
    assert not collective(vs.eval_verifier('if')) and not collective(vs.eval_verifier('chat'))
  finally:
    vs.close()
