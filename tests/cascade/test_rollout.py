"""Records and completions stay paired through generate, score and evaluate.

Every record here has its own answer and its own reward value, the sampler
answers each prompt from the prompt's own text, and batches mix domains in a
shuffled order: a completion routed to another record, or a reward written
back to another row, changes a number these tests pin.
"""

import random

import jax
import numpy as np
import pytest

from cascade import evaluation
from cascade import rollout
from rl import sampler as sampler_lib


def _mixed(fakes, n=6, seed=0):
  recs = [fakes.record('a', i, 10 + i) for i in range(n)] + [fakes.record('b', i, 30 + i)
                                                           for i in range(n)]
  random.Random(seed).shuffle(recs)
  return recs


def _verifiers(fakes):
  vs = {d: fakes.ValueVerifier(d) for d in ('a', 'b')}
  return vs, vs.__getitem__


SP = sampler_lib.SamplingParams(temperature=1.0, max_new_tokens=8)


def test_each_row_is_its_own_records_completion_and_reward(fakes):
  recs = _mixed(fakes)
  g = 3
  # Sample g of each prompt is right unless g == 1; an id past the tokenizer's vocabulary (the
  # first one: a padded embedding row) ends each row.
  sampler = fakes.OwnAnswerSampler(answer=lambda n: str(n if n < 30 else n + 1),
                                   right=lambda n, g: g != 1, junk_id=256)
  modes = [i % 2 == 0 for i in range(len(recs))]
  ro = rollout.generate(sampler, 'params', fakes.CharTokenizer(), recs, modes,
                        jax.random.key(0), SP, g)
  assert len(ro.records) == len(ro.completions) == len(ro.modes) == len(recs) * g
  assert sampler.calls[0]['num_samples'] == g and sampler.calls[0]['params'] == 'params'
  for i, rec in enumerate(recs):
    # The prompt the sampler saw is the record's, rendered in its own mode.
    prompt = ''.join(map(chr, sampler.calls[0]['prompts'][i]))
    assert prompt == rollout.prompt_text(rec, modes[i])
    for j in range(g):
      row = i * g + j
      assert ro.records[row] is rec and ro.modes[row] == modes[i]
      # The out-of-vocabulary id is dropped, the rest decoded.
      want = rec['metadata']['answer'] if j != 1 else 'x'
      assert ro.completions[row] == want, (row, ro.completions[row], rec)

  vs, verifier_of = _verifiers(fakes)
  rewards, infos = rollout.score(ro, verifier_of, fakes.Sample)
  want = np.array([r['metadata']['value'] if j != 1 else -1.0 for r in recs for j in range(g)],
                  np.float32)
  np.testing.assert_array_equal(rewards, want)
  assert [i['id'] for i in infos] == [r['id'] for r in recs for _ in range(g)]
  # One batched call per domain; the verifier sees the mode-free prompt.
  for d, v in vs.items():
    assert len(v.seen) == g * sum(r['domain'] == d for r in recs)
    assert all('/think' not in s.prompt and '/no_think' not in s.prompt for s in v.seen)
  assert vs['a'].seen[0].prompt == rollout.verifier_prompt(
      next(r for r in recs if r['domain'] == 'a'))


def test_score_refuses_a_verifier_that_drops_or_adds_rows(fakes):
  recs = _mixed(fakes, n=2)
  ro = rollout.generate(fakes.OwnAnswerSampler(), None, fakes.CharTokenizer(), recs,
                        [None] * len(recs), jax.random.key(0), SP, 2)

  class Short:
    def score(self, samples):
      return [type('R', (), {'reward': 1.0, 'info': {}})()] * (len(samples) - 1)

  with pytest.raises(RuntimeError, match='returned 3 results for 4 samples'):
    rollout.score(ro, lambda d: Short(), fakes.Sample)

  class Long:
    def score(self, samples):
      return [type('R', (), {'reward': 1.0, 'info': {}})()] * (len(samples) + 1)

  with pytest.raises(RuntimeError, match='returned 5 results for 4 samples'):
    rollout.score(ro, lambda d: Long(), fakes.Sample)


def test_stage_and_drawn_modes():
  assert rollout.stage_modes(None) == (None,)
  assert rollout.stage_modes(0.0) == (False,)
  assert rollout.stage_modes(1.0) == (True,)
  assert rollout.stage_modes(0.5) == (True, False)
  assert rollout.draw_modes(3, None, np.random.default_rng(0)) == [None] * 3
  rng = np.random.default_rng(0)
  u = np.random.default_rng(0).random(400)
  modes = rollout.draw_modes(400, 0.25, rng)
  assert modes == [bool(x < 0.25) for x in u]
  assert rollout.draw_modes(5, 1.0, rng) == [True] * 5
  assert rollout.draw_modes(5, 0.0, rng) == [False] * 5


def test_a_per_domain_fraction_draws_each_prompt_by_its_domain():
  """A blended stage's domains think at their own rates, on the same uniforms a single fraction
  would use (so changing one domain's fraction moves no other prompt's mode)."""
  u = [0.1, 0.1, 0.6, 0.6, 0.95]
  doms = ['math', 'chat', 'math', 'chat', 'math']
  fr = {'math': 0.9, 'chat': 0.2}
  assert rollout.draw_modes(5, fr, _Uniform(u), doms) == [True, True, True, False, False]
  assert rollout.draw_modes(5, {'math': 1.0, 'chat': 0.0}, _Uniform(u), doms) == [
      True, False, True, False, True]
  assert rollout.stage_modes({'math': 1.0, 'chat': 0.0}) == (True, False)
  assert rollout.stage_modes({'math': 1.0, 'chat': 1.0}) == (True,)
  assert rollout.stage_modes({'math': 0.0}) == (False,)
  with pytest.raises(ValueError, match='needs the 5 prompts\' domains'):
    rollout.draw_modes(5, fr, _Uniform(u))
  with pytest.raises(ValueError, match=r"no thinking_fraction for domain\(s\) \['code'\]"):
    rollout.draw_modes(5, fr, _Uniform(u), doms[:4] + ['code'])


def test_longest_prompt_len_is_the_longest_mode(fakes):
  rec = fakes.record('a', 0, 5)
  tok = fakes.CharTokenizer()
  lens = {m: len(rollout.prompt_text(rec, m)) for m in (True, False, None)}
  assert len(set(lens.values())) == 3
  assert rollout.longest_prompt_len(rec, tok, (True, False)) == max(lens[True], lens[False])
  assert rollout.longest_prompt_len(rec, tok, (None,)) == lens[None]


def test_evaluation_scores_each_prompt_against_its_own_answer(fakes):
  """The sampler is right on exactly the records whose number is even: each domain's score is
  the fraction of even-numbered records, which misrouted completions would not give."""
  sets = {'a': [fakes.record('a', i, n) for i, n in enumerate([4, 7, 9, 2, 11, 13, 5])],
          'b': [fakes.record('b', i, n) for i, n in enumerate([31, 30, 35, 37, 39])]}
  for recs in sets.values():
    random.Random(1).shuffle(recs)
  sampler = fakes.OwnAnswerSampler(answer=lambda n: str(n if n < 30 else n + 1),
                                   right=lambda n, g: n % 2 == 0)
  vs, verifier_of = _verifiers(fakes)
  ev = dict(num_samples=3, temperature=1.0, top_p=1.0, top_k=0, greedy=False, max_new_tokens=8,
            batch_size=3, thinking=False, modes=(False,))
  ev = type('Eval', (), ev)
  out = evaluation.evaluate(sampler, None, fakes.CharTokenizer(), sets, verifier_of,
                            fakes.Sample, ev, jax.random.key(0))
  assert out['a']['score'] == pytest.approx(100 * 2 / 7)
  assert out['b']['score'] == pytest.approx(100 * 1 / 5)
  assert out['a']['samples'] == 21 and out['b']['samples'] == 15
  # Raw mean reward: each right row pays its own record's value, each wrong row -1.
  want_a = np.mean([r['metadata']['value'] if int(r['metadata']['answer']) % 2 == 0 else -1.0
                    for r in sets['a']])
  assert out['a']['mean_reward'] == pytest.approx(want_a)


@pytest.mark.parametrize('junk_id', [256, 300])
def test_ids_past_the_vocabulary_decode_to_nothing(fakes, junk_id):
  """Padded embedding rows (any id >= vocab_size, not just the first) are not text."""
  recs = [fakes.record('a', 0, 12)]
  ro = rollout.generate(fakes.OwnAnswerSampler(junk_id=junk_id), None, fakes.CharTokenizer(),
                        recs, [None], jax.random.key(0), SP, 2)
  assert ro.completions == ['12', '12']


class _Uniform:
  """A stand-in for np.random.Generator whose uniforms are given."""

  def __init__(self, u):
    self.u = np.asarray(u, np.float64)

  def random(self, n):
    assert n == len(self.u)
    return self.u


def test_a_prompt_thinks_exactly_when_its_uniform_is_below_the_fraction():
  # u in [0, 1): P(u < f) = f, so a uniform equal to the fraction does not think, and a
  # fraction of 0 never thinks, not even on a draw of exactly 0.0.
  u = [0.0, 0.25, 0.2499, 0.7, 0.9999]
  assert rollout.draw_modes(5, 0.25, _Uniform(u)) == [True, False, True, False, False]
  assert rollout.draw_modes(5, 0.0, _Uniform(u)) == [False] * 5
  assert rollout.draw_modes(5, 1.0, _Uniform(u)) == [True] * 5


def test_a_batch_of_several_hundred_rows_is_scored_row_by_row(fakes):
  """A realistic batch (more rows than CPython caches small ints for) on one and on two hosts."""
  recs = _mixed(fakes, n=10)                      # 20 prompts x G = 30: 600 rows
  sampler = fakes.OwnAnswerSampler(answer=lambda n: str(n if n < 30 else n + 1),
                                   right=lambda n, g: (n + g) % 4 != 0)
  ro = rollout.generate(sampler, None, fakes.CharTokenizer(), recs, [None] * len(recs),
                        jax.random.key(0), SP, 30)
  want = np.array([r['metadata']['value'] if (int(r['metadata']['answer']) - (r['domain'] == 'b')
                                              + j) % 4 else -1.0
                   for r in recs for j in range(30)], np.float32)
  rewards, infos = rollout.score(ro, _verifiers(fakes)[1], fakes.Sample)
  np.testing.assert_array_equal(rewards, want)
  out = fakes.score_on_hosts([ro, ro], [_verifiers(fakes)[0], _verifiers(fakes)[0]], fakes.Sample)
  for h in (0, 1):
    assert not isinstance(out[h], Exception), out[h]
    np.testing.assert_array_equal(out[h][0], want)
    assert out[h][1] == infos


def test_one_process_scores_alone_and_exchanges_nothing(fakes):
  recs = _mixed(fakes, n=2)
  ro = rollout.generate(fakes.OwnAnswerSampler(), None, fakes.CharTokenizer(), recs,
                        [None] * len(recs), jax.random.key(0), SP, 2)
  alone = rollout.Hosts(0, 1, lambda data: pytest.fail('a single process called a collective'))
  rewards, _ = rollout.score(ro, _verifiers(fakes)[1], fakes.Sample, hosts=alone)
  assert rewards.shape == (8,) and (rewards != 0).all()


def test_equal_prompts_drawn_twice_are_two_groups(fakes):
  """A dataset may hold the same prompt twice: each draw is its own group of G rows, so the
  shares stay G-row groups (a host never scores half of one) and split evenly."""
  recs = [fakes.record('a', 0, 5), fakes.record('a', 0, 5), fakes.record('a', 1, 6)]
  assert recs[0] == recs[1] and recs[0] is not recs[1]
  ro = rollout.generate(fakes.OwnAnswerSampler(), None, fakes.CharTokenizer(), recs,
                        [None] * 3, jax.random.key(0), SP, 2)
  assert rollout.groups(ro) == [range(0, 2), range(2, 4), range(4, 6)]
  assert rollout.owners(ro, 3).tolist() == [0, 0, 1, 1, 2, 2]
  # One sample per prompt (G = 1, as MOPD may draw): every row is its own group.
  ro1 = rollout.generate(fakes.OwnAnswerSampler(), None, fakes.CharTokenizer(), recs,
                         [None] * 3, jax.random.key(0), SP, 1)
  assert rollout.groups(ro1) == [range(0, 1), range(1, 2), range(2, 3)]
  assert rollout.owners(ro1, 3).tolist() == [0, 1, 2]


@pytest.mark.parametrize('odd_host', [0, 1])
def test_hosts_that_disagree_on_which_verifier_is_collective_stop(fakes, odd_host):
  """Only one host holds domain a's verifier as a collective (a reward model on the mesh): the
  hosts split the rows differently, and every host refuses to mix their rewards."""
  recs = _mixed(fakes, n=3)
  ro = rollout.generate(fakes.OwnAnswerSampler(answer=lambda n: str(n if n < 30 else n + 1)),
                        None, fakes.CharTokenizer(), recs, [None] * len(recs),
                        jax.random.key(0), SP, 2)
  vs = [_verifiers(fakes)[0], _verifiers(fakes)[0]]
  setattr(vs[odd_host]['a'], rollout.COLLECTIVE, True)
  out = fakes.score_on_hosts([ro, ro], vs, fakes.Sample)
  for h in (0, 1):
    assert isinstance(out[h], RuntimeError), out[h]
    assert 'scored other rollouts' in str(out[h])


def test_a_host_with_no_rows_of_one_domain_still_scores_the_others(fakes):
  """Domain a's prompts all fall in host 0's share, b's in host 1's: each host skips the domain
  it has nothing of and scores the rest, and both end with every row's own reward."""
  recs = [fakes.record('a', i, 10 + i) for i in range(3)] + [fakes.record('b', i, 30 + i)
                                                           for i in range(3)]
  ro = rollout.generate(fakes.OwnAnswerSampler(answer=lambda n: str(n if n < 30 else n + 1),
                                               right=lambda n, g: g == 0),
                        None, fakes.CharTokenizer(), recs, [None] * 6, jax.random.key(0), SP, 2)
  assert rollout.owners(ro, 2).tolist() == [0] * 6 + [1] * 6
  want = [r['metadata']['value'] if g == 0 else -1.0 for r in recs for g in range(2)]
  out = fakes.score_on_hosts([ro, ro], [_verifiers(fakes)[0], _verifiers(fakes)[0]], fakes.Sample)
  for h in (0, 1):
    assert not isinstance(out[h], Exception), out[h]
    assert out[h][0].tolist() == want
