"""Reward-model verifier: what is scored, unfinished thinking, the mixed-language penalty."""

import numpy as np
import pytest

import verifiers
from verifiers import reward_model

S = verifiers.Sample


class _Recorder:
  """Deterministic scorer: the answer's length; remembers what it was given."""

  def __init__(self):
    self.calls = []

  def __call__(self, prompts, answers):
    self.calls.append((list(prompts), list(answers)))
    return np.array([float(len(a)) for a in answers])


def test_scores_only_the_answer_in_one_batched_call():
  scorer = _Recorder()
  v = verifiers.get('reward_model', scorer=scorer)
  r = v.score([S('q1', '<think>long reasoning here</think>\n\nshort'), S('q2', 'plain answer'),
               S('q3', '<think>never closed, scored whole')])
  assert len(scorer.calls) == 1
  assert scorer.calls[0] == (['q1', 'q2', 'q3'],
                             ['short', 'plain answer', '<think>never closed, scored whole'])
  assert [x.reward for x in r] == [5.0, 12.0, 33.0]
  assert 'thinking never closed' in r[2].info['reason']
  v = verifiers.get('reward_model', scorer=scorer, thinking_unfinished_reward=-1.0)
  r = v.score([S('q', '<think>x'), S('q', 'ab')])
  assert [x.reward for x in r] == [-1.0, 2.0] and scorer.calls[-1][1] == ['ab']


def test_mixed_language_penalty():
  scorer = _Recorder()
  samples = [S('Explain gravity.', 'Gravity pulls masses together.'),
             S('Explain gravity.', 'Gravity 是一种 force between masses.'),
             S('解释重力。', '重力是物体之间的吸引力, also called gravitation.'),
             S('Explain gravity.', 'Uses π and θ and λ: fine.'),
             S('Объясни гравитацию.', 'Гравитация притягивает тела.')]
  scores = np.array([float(len(s.completion)) for s in samples])
  with_penalty = verifiers.get('reward_model', scorer=scorer, mixed_language_penalty=True)
  got = [x.reward for x in with_penalty.score(samples)]
  assert got == [scores[0], scores.min() - 10.0, scores[2], scores[3], scores[4]]
  plain = verifiers.get('reward_model', scorer=scorer)
  assert [x.reward for x in plain.score(samples)] == list(scores)


def test_scripts_and_mixing():
  assert reward_model.scripts('Hi 你好 カタ 한') == {'LATIN': 2, 'CJK': 5}
  assert not reward_model.mixes_language('question', 'answer with x² and π')
  assert reward_model.mixes_language('question', 'answer with 中文字')
  assert not reward_model.mixes_language('question', 'one 字 only', min_chars=3)
  assert not reward_model.mixes_language('中文问题', '中文答案 with English')


def test_scorer_errors_surface():
  with pytest.raises(ValueError, match='scorer must be callable'):
    verifiers.get('reward_model', scorer=None)
  with pytest.raises(TypeError):
    verifiers.get('reward_model', scorer=_Recorder(), workers=2)
  v = verifiers.get('reward_model', scorer=lambda p, a: np.zeros(len(a) + 1))
  with pytest.raises(ValueError, match='returned shape'):
    v.score([S('p', 'a')])
  v = verifiers.get('reward_model', scorer=lambda p, a: np.array([np.nan, 1.0]))
  r = v.score([S('p', 'a'), S('p', 'b')])
  assert [x.reward for x in r] == [0.0, 1.0] and 'non-finite' in r[0].info['reason']


class _ByteTokenizer:
  """Bytes shifted past the special ids: pad 0, eos 1."""
  pad_id = 0
  eos_id = 1

  def encode(self, text):
    return [b % 250 + 3 for b in text.encode()]

  encode_text = encode  # No token is read whole from text.


def test_with_the_flax_reward_model():
  from models import config as config_lib  # pylint: disable=g-import-not-at-top
  from rl import reward_model as rm  # pylint: disable=g-import-not-at-top
  scorer = rm.make_text_scorer(rm.create(config_lib.ModelConfig.tiny(), seed=1), _ByteTokenizer(),
                               max_len=64, batch_size=8)
  samples = [S('Say hi.', '<think>greet</think>Hello!'), S('Say hi.', 'Hi there.'),
             S('Say hi.', '<think>unfinished'), S('Say bye.', 'Bye.'), S('Say bye.', 'Ciao.')]
  results = verifiers.get('reward_model', scorer=scorer).score(samples)
  expected = scorer([s.prompt for s in samples],
                    ['Hello!', 'Hi there.', '<think>unfinished', 'Bye.', 'Ciao.'])
  np.testing.assert_allclose([r.reward for r in results], expected, rtol=1e-6)
  assert len(set(np.round(expected, 6))) == 5  # The model tells them apart.
