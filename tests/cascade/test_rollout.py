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
            batch_size=3, thinking=False)
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
