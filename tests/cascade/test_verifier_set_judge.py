"""A run's judge verifiers: the config names a judge source, the verifier set checks it and loads the
judge once, on the run's mesh (`cascade.verifier_set`, `cascade.policies.Policies.judge_model`)."""

import shutil

import ml_collections
import numpy as np
import pytest

from cascade import config as config_lib
from cascade import policies as policies_lib
from cascade import rollout
from cascade import verifier_set
from foundation import chat
from foundation import tokenizer as tokenizer_lib
from models import config as model_config
from models import hf
from models import transformer
from rl import judge as judge_lib

VERIFIERS = ('math', 'judge', 'swe')
FORMATS = {'prompt': 'prompt', 'sft': 'sft'}


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  root = tmp_path_factory.mktemp('tok')
  texts = [chat.render([{'role': 'user', 'content': 'Is this right? Verdict: YES or NO'}],
                       thinking=False)] * 8
  tokenizer_lib.train_sentencepiece(texts, root / 'tok', vocab_size=300)
  return str(root / 'tok.model')


def make_config(judge_options, eval_options=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny', overrides=dict(max_seq_len=256, vocab_size=320))
  c.tokenizer = dict(path='/tmp/tok.model')
  c.mesh = dict(shape=(-1, 1, 1))
  c.sampler = dict()
  c.ckpt = dict(every_n_steps=2, keep=2)
  c.eval = dict(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=16,
                max_prompt_len=32, num_prompts=8, batch_size=8)
  c.datasets = dict(sft=dict(path='/d/sft.jsonl', format='sft'),
                    chat_train=dict(path='/d/chat.jsonl', format='prompt', domain='chat'),
                    chat_eval=dict(path='/d/chat_eval.jsonl', format='prompt', domain='chat'))
  c.domains = dict(chat=dict(verifier='judge', verifier_options=judge_options,
                             eval_verifier_options=eval_options or judge_options,
                             train='chat_train', eval='chat_eval'))
  c.stages = [
      dict(name='sft', kind='sft', domains=['chat'], datasets=['sft'], steps=2, batch_size=4,
           max_len=64, optimizer=dict(lr=1e-3)),
      dict(name='rlhf', kind='grpo', domains=['chat'], steps=2, optimizer=dict(lr=1e-4),
           prompts_per_step=4, group_size=4, max_prompt_len=32, max_response_len=16)]
  c.allow_config_change = False
  return c


def plan_of(c):
  return config_lib.validate(c, known_verifiers=VERIFIERS, known_formats=FORMATS)


class Loader:
  """Records the judge sources loaded; hands back a fake judge with the test tokenizer."""

  def __init__(self, tok_path, done=('sft',)):
    self.tok = tokenizer_lib.load(tok_path)
    self.loaded, self.done = [], set(done)

  def model(self, source):
    self.loaded.append(source)
    return verifier_set._StandInJudge(self.tok)   # pylint: disable=protected-access

  def verifier_set(self, plan):
    return verifier_set.VerifierSet(plan, rm_scorer=None, rm_ready=lambda n: n in self.done,
                                    judge_model=self.model,
                                    judge_tokenizer=lambda src: self.tok)


def test_a_stage_judge_is_checked_then_loaded_once_on_first_use(tok):
  loader = Loader(tok)
  plan = plan_of(make_config(dict(judge='stage:sft', mode='pointwise', max_new_tokens=32)))
  vs = loader.verifier_set(plan)
  vs.check_options()
  assert loader.loaded == []                     # checking loads no weights
  v = vs.train_verifier('chat')
  assert v.judge is vs.eval_verifier('chat').judge
  assert loader.loaded == [('stage', 'sft')]     # one load for both verifiers
  assert getattr(v, rollout.COLLECTIVE) and v.max_new_tokens == 32
  assert vs.can_evaluate('chat')
  late = Loader(tok, done=())
  vs = late.verifier_set(plan)
  with pytest.raises(ValueError, match="judged by the policy of stage 'sft', which has not run"):
    vs.train_verifier('chat')
  assert not vs.can_evaluate('chat') and late.loaded == []


@pytest.mark.parametrize('options, match', [
    (dict(judge='stage:nope'), r"^config\.domains\.chat\.verifier_options\.judge='stage:nope': "
                               'names no stage that trains a policy'),
    (dict(judge='stage:rlhf'), "stage 'rlhf' samples domain 'chat' before the judge stage"),
    (dict(judge=3), r'verifier_options\.judge=3: expected a judge source'),
    (dict(judge='stage:sft', template='nope'),
     r"^config\.domains\.chat\.verifier_options: verifier 'judge' rejects .*template='nope'"),
    (dict(judge='stage:sft', mode='pairwise'), 'verifier_options: .*needs a pairwise one'),
    (dict(judge='stage:sft', reject_reward='x'), "reject_reward='x'"),
    (dict(template='pointwise_yes_no'), 'judge= is required'),
])
def test_bad_judge_options_name_the_field(tok, options, match):
  vs = Loader(tok).verifier_set(plan_of(make_config(options)))
  with pytest.raises(config_lib.ConfigError, match=match):
    vs.check_options()


def test_an_hf_judge_needs_its_tokenizer_and_a_loader(tok, tmp_path):
  plan = plan_of(make_config(dict(judge=str(tmp_path / 'missing'))))
  vs = verifier_set.VerifierSet(plan, rm_scorer=None, rm_ready=lambda n: True,
                                judge_model=None,
                                judge_tokenizer=lambda src: tokenizer_lib.load(src[1]))
  with pytest.raises(config_lib.ConfigError, match=r"verifier_options\.judge='.*missing': the "
                                                   "judge's tokenizer cannot be loaded"):
    vs.check_options()
  vs = verifier_set.VerifierSet(plan, rm_scorer=None, rm_ready=lambda n: True)
  with pytest.raises(config_lib.ConfigError, match='this run cannot load judge models'):
    vs.check_options()


def test_policies_load_an_hf_judge_with_its_own_tokenizer(tok, tmp_path):
  cfg = model_config.ModelConfig.tiny(vocab_size=320, num_layers=1, embed_dim=32, num_heads=2,
                                      num_kv_heads=1, head_dim=16, mlp_dim=64)
  model = transformer.create(cfg, 3)
  hf.save_model(model, tmp_path / 'judge')
  shutil.copy(tok, tmp_path / 'judge' / 'tok.model')
  plan = plan_of(make_config(dict(judge=str(tmp_path / 'judge'))))
  pol = policies_lib.Policies(plan, str(tmp_path / 'run'), None, None)
  jm = pol.judge_model(('hf', str(tmp_path / 'judge')), tokenizer=None)
  assert isinstance(jm, judge_lib.JudgeModel) and jm.tokenizer.vocab_size <= 320
  row = [5, 6, 7, 8]
  logits = np.asarray(model(np.asarray([row], np.int32)))[0, -1, [10, 11]]
  want = logits - np.logaddexp(*logits)
  np.testing.assert_allclose(jm.choice_logprobs([row], (10, 11))[0], want, atol=1e-5)


@pytest.mark.heavy
def test_a_run_judges_its_rl_samples_with_an_earlier_stages_policy(tmp_path, copy_cascade):
  """The copy world's GRPO stage scored by the SFT stage's policy as a P(YES) judge: loaded from
  the stage's checkpoint, its verdicts' P(YES) are the rewards, and reach samples.jsonl."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  from cascade import runner  # pylint: disable=g-import-not-at-top
  path = copy_cascade(tmp_path, train=16, eval_=8, sft=32, sft_steps=4, rl_steps=2)
  spec = importlib.util.spec_from_file_location('copy_cfg', path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.domains.copy.verifier = 'judge'
  c.domains.copy.verifier_options = dict(judge='stage:sft', template='pointwise_yes_no')
  c.domains.copy.eval_verifier = 'math'
  c.domains.copy.eval_verifier_options = dict(workers=1)
  c.eval.log_samples = 4
  res = runner.run(c, str(tmp_path / 'run'))
  assert res['stages'] == ['sft', 'copy_rl']
  rows = [json.loads(l) for l in open(tmp_path / 'run' / 'samples.jsonl')]
  assert rows and all(r['stage'] == 'copy_rl' for r in rows)
  judged = [r for r in rows if 'p_yes' in r['info']]
  assert judged and all(r['info']['reason'] == 'thinking block never closed'
                        for r in rows if r not in judged)     # a barely trained policy's '<think>'
  for r in judged:
    assert r['info']['reason'] == 'judge pointwise_yes_no (logits)'
    assert 0 < r['reward'] < 1 and r['reward'] == pytest.approx(r['info']['p_yes'], abs=1e-6)


def test_swe_takes_its_semantic_judge_from_the_config(tok):
  c = make_config(dict(judge='stage:sft'))
  c.datasets.swe_train = dict(path='/d/swe.jsonl', format='prompt', domain='swe')
  c.datasets.swe_eval = dict(path='/d/swe_eval.jsonl', format='prompt', domain='swe')
  c.domains.swe = dict(verifier='swe', verifier_options=dict(judge='stage:sft', workers=1),
                       train='swe_train', eval='swe_eval')
  loader = Loader(tok)
  vs = loader.verifier_set(plan_of(c))
  vs.check_options()
  v = vs.train_verifier('swe')
  assert v.judge.judge is vs.train_verifier('chat').judge      # one judge for both domains
  assert loader.loaded == [('stage', 'sft')] and getattr(v, rollout.COLLECTIVE)
  vs.close()
