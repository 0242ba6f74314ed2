"""The suite runner: sampled by the protocol, graded per batch, kept per batch, resumed after a
kill to the same result, started afresh for another protocol or policy, shared over hosts."""

import json
import re

import numpy as np
import pytest

from cascade.suites import run
from cascade.suites import stats


def _right(num, g):
  """Which samples the stand-in sampler gets right: a fixed pattern over (prompt, sample)."""
  return (num * 7 + g) % 3 != 0


def _policy(fakes, identity='policy-1'):
  sampler = fakes.OwnAnswerSampler(right=_right)
  return run.Policy(sampler, None, fakes.CharTokenizer(), identity), sampler


def _expected(n, k):
  """The grades the pattern gives [n, k]."""
  return np.array([[float(_right(i, g)) for g in range(k)] for i in range(n)])


def test_a_suite_scores_avg_at_k_with_its_standard_error_pass_at_k_and_maj_at_k(
    fakes, toy, tmp_path):
  suite, recs = toy.suite(samples=4), toy.records(10)
  policy, sampler = _policy(fakes)
  res = run.run_suite(suite, recs, policy, str(tmp_path), batch_size=4)
  g = _expected(10, 4)
  per_prompt = g.mean(axis=1)
  assert res['value'] == pytest.approx(100 * per_prompt.mean())
  assert res['stderr'] == pytest.approx(100 * per_prompt.std(ddof=1) / np.sqrt(10))
  assert res['pass@4'] == pytest.approx(100 * stats.pass_at_k(g, 4))
  assert res['pass@1'] == pytest.approx(res['value'])
  assert 'maj@4' in res and res['maj@4'] == pytest.approx(100 * stats.maj_at_k(
      g, [[str(i) if _right(i, j) else 'x' for j in range(4)] for i in range(10)]))
  assert (res['n'], res['k'], res['samples'], res['metric']) == (10, 4, 40, 'avg@4')
  assert res['protocol'] == suite.protocol_hash() and res['settings']['samples'] == 4
  # The protocol's sampling reached the sampler: 3 calls of <= 4 prompts, k samples each.
  assert [len(c['prompts']) for c in sampler.calls] == [4, 4, 2]
  sp = sampler.calls[0]['sp']
  assert (sp.temperature, sp.top_p, sp.max_new_tokens) == (1.0, 1.0, 8)
  assert all(c['num_samples'] == 4 for c in sampler.calls)
  # One header and one line per batch, each with its records' ids and grades.
  lines = (tmp_path / 'toy_copy' / 'grades.jsonl').read_text().splitlines()
  head = json.loads(lines[0])['header']
  assert head['protocol'] == suite.protocol_hash() and head['policy'] == 'policy-1'
  assert [json.loads(x)['ids'] for x in lines[1:]] == [
      ['r0', 'r1', 'r2', 'r3'], ['r4', 'r5', 'r6', 'r7'], ['r8', 'r9']]
  assert suite.log[-1] == 'closed'          # the grader's workers were stopped


def test_a_killed_evaluation_resumes_where_it_stopped_to_the_same_result(fakes, toy, tmp_path):
  suite, recs = toy.suite(samples=3), toy.records(9)
  whole = run.run_suite(suite, recs, _policy(fakes)[0], str(tmp_path / 'whole'), batch_size=2)
  # Stopped before its third batch (as SIGTERM does), then killed while appending the third
  # batch's line on the rerun: the file ends in half a line.
  policy, sampler = _policy(fakes)
  asked = []
  stop = lambda: 'SIGTERM' if len(asked.append(1) or asked) == 3 else None
  with pytest.raises(run.Stopped, match=r"SIGTERM: stopped at suite 'toy_copy' before batch 3/5"):
    run.run_suite(suite, recs, policy, str(tmp_path / 'run'), batch_size=2, stop=stop)
  assert len(sampler.calls) == 2
  path = tmp_path / 'run' / 'toy_copy' / 'grades.jsonl'
  assert len(path.read_text().splitlines()) == 3            # the header and two batches
  third = json.dumps({'batch': 2, 'ids': ['r4', 'r5'], 'grades': []})
  with open(path, 'a') as f:
    f.write(third[:len(third) // 2])
  said = []
  policy, sampler = _policy(fakes)
  res = run.run_suite(suite, recs, policy, str(tmp_path / 'run'), batch_size=2, say=said.append)
  assert said == [f'suite toy_copy: resuming, 2 batch(es) kept in {path}']
  # Only the batches the file lacks were sampled again (the torn one among them).
  asked_for = [[int(re.findall(r'Copy (\d+)', ''.join(map(chr, p)))[-1]) for p in c['prompts']]
               for c in sampler.calls]
  assert asked_for == [[4, 5], [6, 7], [8]] and res['resumed'] == 2
  for key in ('value', 'stderr', 'pass@1', 'pass@3', 'maj@3', 'n', 'k', 'samples', 'protocol',
              'mean_len', 'truncated'):
    assert res[key] == whole[key], key


def test_a_crash_while_sampling_keeps_every_batch_graded_before_it(fakes, toy, tmp_path):
  suite, recs = toy.suite(samples=2), toy.records(6)
  policy, sampler = _policy(fakes)
  generate = sampler.generate

  def crashing(*args, **kw):
    if len(sampler.calls) == 2:         # the third batch: batch 2 is being graded meanwhile
      raise RuntimeError('the device went away')
    return generate(*args, **kw)
  sampler.generate = crashing
  with pytest.raises(RuntimeError, match='the device went away'):
    run.run_suite(suite, recs, policy, str(tmp_path), batch_size=2)
  lines = (tmp_path / 'toy_copy' / 'grades.jsonl').read_text().splitlines()
  assert [json.loads(x)['batch'] for x in lines[1:]] == [0, 1]
  assert suite.log[-1] == 'closed' and suite.log.count('r3') == 1   # closed after it graded
  policy, sampler = _policy(fakes)
  assert run.run_suite(suite, recs, policy, str(tmp_path), batch_size=2)['resumed'] == 2
  assert len(sampler.calls) == 1


def test_a_changed_protocol_or_policy_starts_afresh(fakes, toy, tmp_path):
  suite, recs = toy.suite(samples=2), toy.records(4)
  run.run_suite(suite, recs, _policy(fakes)[0], str(tmp_path), batch_size=2)
  path = tmp_path / 'toy_copy' / 'grades.jsonl'
  for changed, policy_id, why in (
      (suite.with_protocol(samples=3), 'policy-1', 'protocol, settings'),
      (suite.with_protocol(samples=3), 'policy-2', 'policy')):
    said = []
    policy, sampler = _policy(fakes, policy_id)
    res = run.run_suite(changed, recs, policy, str(tmp_path), batch_size=2, say=said.append)
    assert said == [f'suite toy_copy: {path} is not resumed (its {why} differ(s) from this '
                    "evaluation's); evaluating afresh"]
    assert len(sampler.calls) == 2 and res['resumed'] == 0
    assert (res['k'], res['metric']) == (3, 'avg@3')       # the k the override sampled
    assert json.loads(path.read_text().splitlines()[0])['header']['policy'] == policy_id
  # The same protocol and policy again: nothing sampled.
  policy, sampler = _policy(fakes, 'policy-2')
  assert run.run_suite(suite.with_protocol(samples=3), recs, policy, str(tmp_path),
                       batch_size=2)['resumed'] == 2
  assert not sampler.calls


def test_several_hosts_grade_their_shares_once_and_agree(fakes, toy, tmp_path):
  suite, recs = toy.suite(samples=2), toy.records(6)
  alone = run.run_suite(suite, recs, _policy(fakes)[0], str(tmp_path / 'alone'), batch_size=3)
  logs = {}

  def host(hosts):
    s = toy.suite(samples=2)
    out = run.run_suite(s, recs, _policy(fakes)[0], str(tmp_path / 'hosts'), batch_size=3,
                        hosts=hosts)
    logs[hosts.index] = [x for x in s.log if x != 'closed']
    return out

  out = fakes.on_hosts(2, host)
  assert not any(isinstance(v, Exception) for v in out.values()), out
  timeless = lambda r: {k: v for k, v in r.items() if k != 'seconds'}
  assert timeless(out[0]) == timeless(out[1])
  for key in ('value', 'stderr', 'pass@2', 'n', 'k', 'samples'):
    assert out[0][key] == alone[key]
  # Host 0 graded the first 2 records of each batch of 3, host 1 the last one: each once.
  assert logs == {0: ['r0', 'r1', 'r3', 'r4'], 1: ['r2', 'r5']}


def test_protocol_overrides_are_checked_and_change_the_hash(toy):
  suite = toy.suite(samples=4)
  quick = suite.with_protocol(samples=2)
  assert quick.protocol.samples == 2 and quick.protocol.pass_ks == (1,)
  assert quick.protocol_hash() != suite.protocol_hash()
  with pytest.raises(ValueError, match=r"suite 'toy_copy': unknown protocol field\(s\) "
                                       r"\['samplez'\]"):
    suite.with_protocol(samplez=2)
  with pytest.raises(ValueError, match='greedy decoding gives one distinct sample'):
    suite.with_protocol(greedy=True)
