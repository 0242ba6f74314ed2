"""Instruction-following verifier: reward modes, loose mode, and the reward-model mixing rule."""

import numpy as np
import pytest

import verifiers
from verifiers import ifeval
from verifiers import instruction_following

S = verifiers.Sample
NO_COMMA = {'instruction_id_list': ['punctuation:no_comma', 'length_constraints:number_words'],
            'kwargs': [{}, {'num_words': 4, 'relation': 'less than'}]}
QUOTE = {'instruction_id_list': ['startend:quotation'], 'kwargs': [{}]}


def _length_scorer(prompts, answers):
  """A deterministic stand-in for the reward model: longer answers score higher."""
  assert len(prompts) == len(answers)
  return np.array([float(len(a)) for a in answers], dtype=np.float32)


def _reference(scores, groups, followed):
  """R_IF + sigmoid(group-normalised RM) if all followed else 0, in float64."""
  scores = np.asarray(scores, np.float64)
  out = []
  for s, g, f in zip(scores, groups, followed):
    member = scores[np.asarray(groups) == g]
    z = (s - member.mean()) / member.std() if member.std() > 0 else 0.0
    out.append(1.0 + 1.0 / (1.0 + np.exp(-z)) if f else 0.0)
  return np.array(out)


@pytest.fixture(scope='module')
def verifier():
  with verifiers.get('instruction_following', workers=2) as v:
    yield v


def test_all_or_fraction_and_loose(verifier):
  samples = [S('p', 'no commas here', NO_COMMA), S('p', 'a, b', NO_COMMA),
             S('p', 'too many words in this one, sadly', NO_COMMA),
             S('p', '<think>x, y</think>fine answer', NO_COMMA),
             S('p', 'Sure:\n"Quoted."', QUOTE), S('p', '<think>unfinished', QUOTE)]
  strict = verifier.score(samples)
  assert [r.reward for r in strict] == [1, 0, 0, 1, 0, 0]
  assert strict[2].info['followed'] == [False, False]
  assert strict[1].info['followed'] == [False, True]
  # Fraction of instructions; loose mode drops the 'Sure:' line before the quote.
  with verifiers.get('instruction_following', reward='fraction', mode='loose', workers=1) as v:
    loose = v.score(samples)
  assert [r.reward for r in loose] == [1, 0.5, 0, 1, 1, 0]


def test_both_modes_reports_each_instruction_strict_and_loose(verifier):
  lower = {'instruction_id_list': ['change_case:english_lowercase', 'punctuation:no_comma'],
           'kwargs': [{}, {}]}
  # The worker's answer in either mode: the lists are the same, the reward is the mode's.
  for loose in (False, True):
    out = instruction_following.answer(ifeval.follows, {
        'ids': lower['instruction_id_list'], 'kwargs': lower['kwargs'],
        'response': 'Sure:\nall lower case here', 'loose': loose, 'fraction': False,
        'both_modes': True})
    assert (out['info']['strict'], out['info']['loose']) == ([False, True], [True, True])
    assert out['reward'] == float(loose)
  samples = [S('p', 'Sure:\nall lower case here', lower),   # loose drops the 'Sure:' line
             S('p', 'all lower, with a comma', lower), S('p', '   ', lower),
             S('p', '<think>unfinished', lower)]
  with verifiers.get('instruction_following', mode='loose', both_modes=True, workers=1) as v:
    r = v.score(samples)
  assert [x.reward for x in r] == [1.0, 0.0, 0.0, 0.0]
  assert r[0].info['strict'] == [False, True] and r[0].info['loose'] == [True, True]
  assert r[1].info['strict'] == r[1].info['loose'] == [True, False]
  assert r[2].info['strict'] == r[2].info['loose'] == [False, False]   # an empty answer
  assert 'strict' not in r[3].info   # unfinished thinking: no check ran
  assert 'strict' not in verifier.score(samples[:1])[0].info   # only when asked


def test_reward_model_mixing_matches_reference():
  answers = ['short', 'a longer answer', 'has, a comma', 'mid answer',  # group of prompt A
             'x', 'y']                                                  # group of prompt B
  prompts = ['A'] * 4 + ['B'] * 2
  md = {'instruction_id_list': ['punctuation:no_comma'], 'kwargs': [{}]}
  samples = [S(p, a, md) for p, a in zip(prompts, answers)]
  followed = [',' not in a for a in answers]
  expected = _reference([len(a) for a in answers], prompts, followed)
  with verifiers.get('instruction_following', rm_scorer=_length_scorer, reward='fraction',
                     workers=1) as v:
    got = np.array([r.reward for r in v.score(samples)])
  np.testing.assert_allclose(got, expected, rtol=1e-12)
  # Equal scores within a group normalise to 0: sigmoid(0) = 0.5.
  assert expected[4] == expected[5] == 1.5
  # Consecutive groups of 2 instead of prompt groups.
  with verifiers.get('instruction_following', rm_scorer=_length_scorer, group_size=2,
                     workers=1) as v:
    got = np.array([r.reward for r in v.score(samples)])
    np.testing.assert_allclose(got, _reference([len(a) for a in answers], [0, 0, 1, 1, 2, 2],
                                               followed), rtol=1e-12)
    with pytest.raises(ValueError, match='not a multiple of group_size 2'):
      v.score(samples[:3])


def test_reward_model_mixing_keeps_early_results():
  md = {'instruction_id_list': ['punctuation:no_comma'], 'kwargs': [{}]}
  with verifiers.get('instruction_following', rm_scorer=_length_scorer, workers=1,
                     thinking_unfinished_reward=0.25) as v:
    r = v.score([S('p', '<think>never closed', md), S('p', 'ok', md), S('p', 'ok', {})])
  assert r[0].reward == 0.25 and 'rm_score' not in r[0].info
  # All three are in the group (the unfinished one scored whole), only one mixes.
  scores = [len('<think>never closed'), 2, 2]
  assert r[1].reward == pytest.approx(_reference(scores, [0, 0, 0], [False, True, False])[1])
  assert r[2].reward == 0.0 and r[2].info['reason'].startswith('bad metadata')


def test_group_normalise():
  z = instruction_following.group_normalise(np.array([1.0, 3.0, 5.0, 5.0]), [0, 0, 1, 1])
  np.testing.assert_allclose(z, [-1.0, 1.0, 0.0, 0.0])


def test_bad_options():
  with pytest.raises(ValueError, match='mode must be strict or loose'):
    verifiers.get('instruction_following', mode='lenient')
  with pytest.raises(ValueError, match='reward must be all or fraction'):
    verifiers.get('instruction_following', reward='mean')
