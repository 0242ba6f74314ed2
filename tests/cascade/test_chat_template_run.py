"""config.tokenizer.chat_template='checkpoint': RL, SFT and the stage export use a fixture
instruct checkpoint's own template, and what the policy is prompted with is exactly what
transformers' `apply_chat_template` gives for that checkpoint."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from cascade import config as config_lib
from cascade import policies as policies_lib
from cascade import rollout
from cascade.kinds import sft
from foundation import chat_template
from foundation import tokenizer as tokenizer_lib
from models import transformer
from rl import sampler as sampler_lib
from tests.foundation import test_chat_template as fixtures

transformers = pytest.importorskip('transformers')


class CaptureSampler:
  """Keeps the prompt ids it is given; answers every row with no tokens."""

  def __init__(self):
    self.prompts = []

  def generate(self, params, prompts, rng, sp, num_samples=1):
    del params, rng
    self.prompts += [list(p) for p in prompts]
    b = len(prompts) * num_samples
    z = np.zeros((b, sp.max_new_tokens), np.int32)
    return sampler_lib.SampleOutput(prompt_tokens=z, prompt_mask=z, tokens=z, mask=z,
                                    logprobs=z.astype(np.float32),
                                    sampling_logprobs=z.astype(np.float32),
                                    lengths=np.zeros(b, np.int32), truncated=np.zeros(b, bool))


def _plan(fakes, d, template='checkpoint', stages=None, **kw):
  return fakes.toy_config(stages or [fakes.rl_stage('rl', ['a'], thinking_fraction=0.5)],
                          tokenizer=dict(path=str(d), chat_template=template), **kw)


def _ids(x):
  return list(x['input_ids'] if hasattr(x, 'keys') else x)


@pytest.mark.parametrize('family', ['qwen3', 'nemotron'])
def test_rl_prompts_are_what_apply_chat_template_gives(fakes, tmp_path, family):
  d = fixtures.write_checkpoint(tmp_path, family)
  plan = _plan(fakes, d)
  assert plan.chat_template.source == fixtures.FAMILIES[family][0]
  tok = chat_template.attach(tokenizer_lib.load(d), plan.chat_template)
  auto = transformers.AutoTokenizer.from_pretrained(d)
  recs = [fakes.record('a', i, 10 + i) for i in range(4)]
  modes = [True, False, True, False]
  sampler = CaptureSampler()
  rollout.generate(sampler, None, tok, recs, modes, jax.random.key(0),
                   sampler_lib.SamplingParams(temperature=1.0, max_new_tokens=2), 1)
  for rec, mode, got in zip(recs, modes, sampler.prompts):
    msgs = [dict(m) for m in rec['messages']]
    if family == 'qwen3':
      want = auto.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=mode)
    else:
      msgs[-1]['content'] += ' /think' if mode else ' /no_think'
      want = auto.apply_chat_template(msgs, add_generation_prompt=True)
    assert got == _ids(want)
  # The stage's prompt-length filter measures the same prompts.
  keep, _ = plan.stages[0].record_filter(tok)
  longest = max(len(p) for p in sampler.prompts)
  assert rollout.longest_prompt_len(recs[-1], tok, (True, False)) <= longest and keep(recs[0])


def test_sft_examples_are_the_templates_whole_conversation(fakes, tmp_path):
  d = fixtures.write_checkpoint(tmp_path, 'qwen3')
  tok = chat_template.attach(tokenizer_lib.load(d), _plan(fakes, d).chat_template)
  auto = transformers.AutoTokenizer.from_pretrained(d)
  rec = {'messages': [{'role': 'user', 'content': 'What is 2 + 3?'}], 'response': '5',
         'thinking': 'two and three'}
  for switch, think in ((True, '<think>\ntwo and three\n</think>\n\n5'), (False, None)):
    toks, mask = sft.example(rec, tok, switch, 512)
    conv = rec['messages'] + [{'role': 'assistant', 'content': think or
                               '<think>\ntwo and three\n</think>\n\n5'}]
    whole = auto.apply_chat_template(conv, tokenize=False,
                                     **({'enable_thinking': True} if switch else {}))
    assert tok.decode(toks) == whole
    prompt = auto.apply_chat_template(rec['messages'], tokenize=False, add_generation_prompt=True)
    assert tok.decode(toks[:mask.index(1)]) == prompt


def test_the_export_keeps_the_checkpoints_template(fakes, tmp_path):
  (tmp_path / 'ckpt').mkdir()
  d = fixtures.write_checkpoint(tmp_path / 'ckpt', 'llama3')
  plan = _plan(fakes, d, stages=[fakes.rl_stage('rl', ['a'])])
  pol = policies_lib.Policies(plan, str(tmp_path / 'run'), None, plan.rules)
  out = pol.export_hf(plan.stages[0], nnx.split(transformer.create(plan.model, 3))[1])
  with open(f'{out}/tokenizer_config.json', encoding='utf-8') as f:
    config = json.load(f)
  assert config['chat_template'] == fixtures.LLAMA3
  conv = [{'role': 'user', 'content': 'Copy 7.'}]
  back = transformers.AutoTokenizer.from_pretrained(out)
  assert back.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == \
      plan.chat_template.render(conv)
  # The built-in choice exports the built-in template, as before.
  assert _plan(fakes, d, template='builtin').chat_template is chat_template.BUILTIN
  # Llama-3's template has no thinking switch: a stage drawing modes stops as its prompts are
  # read, naming the template.
  tok = chat_template.attach(tokenizer_lib.load(d), plan.chat_template)
  keep, _ = _plan(fakes, d).stages[0].record_filter(tok)
  with pytest.raises(ValueError, match='tokenizer_config.json: chat_template: the chat template '
                                       'has no thinking switch'):
    keep(fakes.record('a', 0, 3))


def test_checkpoint_template_errors_are_one_line(fakes, tmp_path):
  (tmp_path / 'tokenizer_config.json').write_text('{}')
  with pytest.raises(config_lib.ConfigError,
                     match=(r"^config.tokenizer.chat_template='checkpoint': "
                            r'.*tokenizer_config.json: no chat_template')):
    _plan(fakes, tmp_path)
  with pytest.raises(config_lib.ConfigError, match=r'config.tokenizer.chat_template.*unknown chat '
                                                   r'template \(known: builtin, checkpoint\)'):
    _plan(fakes, tmp_path, template='qwen')
  (tmp_path / 'q').mkdir()
  d = fixtures.write_checkpoint(tmp_path / 'q', 'qwen3')
  with pytest.raises(config_lib.ConfigError, match=r"domain\(s\) \['c'\] are agentic"):
    _plan(fakes, d, domains={'c': dict(env='tool_use', train='a_train', eval='a_train')})


def test_the_runs_tokenizer_carries_the_template(fakes, tmp_path):
  """make_context gives the run (its stages' data, rollouts and evaluation) a tokenizer that
  carries the checkpoint's template; the built-in choice carries BUILTIN."""
  from cascade import runner  # pylint: disable=g-import-not-at-top
  (tmp_path / 'ckpt').mkdir()
  d = fixtures.write_checkpoint(tmp_path / 'ckpt', 'qwen3')
  model = dict(preset='tiny', overrides=dict(vocab_size=512, embed_dim=32, num_layers=1,
                                             num_heads=2, num_kv_heads=1, head_dim=16,
                                             mlp_dim=64, max_seq_len=128))
  for template in ('checkpoint', 'builtin'):
    plan = _plan(fakes, d, template=template, model=model)
    ctx = runner.make_context(plan, str(tmp_path / template))
    try:
      assert chat_template.of(ctx.tokenizer) is plan.chat_template
      assert chat_template.of(ctx.data.tokenizer) is plan.chat_template
      assert ctx.tokenizer.eos_id == tokenizer_lib.load(d).token_to_id('<|im_end|>')
    finally:
      ctx.verifiers.close()
      ctx.policies.close()
  assert isinstance(_plan(fakes, d, model=model).chat_template, chat_template.CheckpointTemplate)


def test_evaluating_a_runs_export_prompts_with_the_runs_template(tmp_path):
  """`cascade.evaluate` on a run's export renders with the template the run trained with."""
  from cascade.suites import checkpoint as suite_checkpoint  # pylint: disable=g-import-not-at-top
  d = fixtures.write_checkpoint(tmp_path, 'nemotron')
  tok = tokenizer_lib.load(d)
  ran = suite_checkpoint.Source(hf_dir=str(d), run='/w', stage='rl', config={
      'tokenizer': {'path': str(d), 'chat_template': 'checkpoint'}})
  got = chat_template.of(suite_checkpoint.policy_tokenizer(ran, tok))
  assert got.source == fixtures.NEMOTRON
  plain = suite_checkpoint.Source(hf_dir=str(d), config={'tokenizer': {'path': str(d)}})
  assert chat_template.of(suite_checkpoint.policy_tokenizer(plain, tok)) is chat_template.BUILTIN
  (d / 'tokenizer_config.json').write_text('{}')
  with pytest.raises(config_lib.ConfigError, match=r"^/w, stage 'rl' .*no chat_template"):
    suite_checkpoint.policy_tokenizer(ran, tok)
