"""Config validation: a valid cascade resolves; each bad field is one clear error naming stage and field."""

import copy
import dataclasses

import ml_collections
import pytest

from cascade import checkpoint
from cascade import config as config_lib

VERIFIERS = ('math', 'instruction_following', 'code', 'reward_model')
FORMATS = {'prompt': 'prompt', 'sft': 'sft', 'preference': 'preference', 'gsm8k': 'prompt'}


def make_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny', overrides=dict(max_seq_len=256))
  c.tokenizer = dict(path='/tmp/tok.model')
  c.mesh = dict(shape=(-1, 1, 1))
  c.sampler = dict()
  c.ckpt = dict(every_n_steps=2, keep=2)
  c.eval = dict(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=16,
                max_prompt_len=32, num_prompts=8, batch_size=8)
  c.datasets = dict(
      sft_mix=dict(path='/d/sft.jsonl', format='sft'),
      prefs=dict(path='/d/prefs.jsonl', format='preference', domain='chat'),
      add_train=dict(path='/d/add.jsonl', format='prompt', domain='add'),
      add_eval=dict(path='/d/add_eval.jsonl', format='prompt', domain='add'),
      mul_train=dict(path='/d/mul.jsonl', format='prompt', domain='mul'),
      mul_eval=dict(path='/d/mul_eval.jsonl', format='prompt', domain='mul'),
      add_val=dict(path='/d/add_eval.jsonl', format='prompt', domain='add', skip=100),
      mul_val=dict(path='/d/mul_val.jsonl', format='prompt', domain='mul'),
      chat_train=dict(path='/d/chat.jsonl', format='prompt', domain='chat'),
      chat_eval=dict(path='/d/chat_eval.jsonl', format='prompt', domain='chat'))
  c.domains = dict(
      add=dict(verifier='math', train='add_train', eval='add_eval', validation='add_val'),
      mul=dict(verifier='math', verifier_options=dict(unfinished_reward=0.0),
               train='mul_train', eval='mul_eval', validation='mul_val'),
      chat=dict(verifier='reward_model', train='chat_train', eval='chat_eval',
                reward_model_stage='rm'))
  rl = lambda: dict(kind='grpo', steps=6, optimizer=dict(lr=1e-4), prompts_per_step=4,
                    group_size=4, max_prompt_len=32, max_response_len=16)
  c.stages = [
      dict(name='sft', kind='sft', domains=['add', 'mul'], datasets=['sft_mix'], steps=4,
           batch_size=4, max_len=64, optimizer=dict(lr=1e-3, warmup_steps=1,
                                                    schedule='cosine')),
      dict(name='rm', kind='reward_model', domains=['chat'], datasets=['prefs'], steps=3,
           batch_size=4, max_len=64, optimizer=dict(lr=1e-4), init_from='sft'),
      dict(name='rlhf', **rl(), domains=['chat']),
      dict(name='add_rl', **rl(), domains=['add'],
           phases=[dict(until_step=3, max_response_len=8, filter_overlong=True),
                   dict(until_step=6, max_response_len=16, temperature=0.8)]),
      dict(name='blend', **rl(), domains=['add', 'mul'], init_from='sft'),
      dict(name='mopd', kind='mopd', domains=['add', 'mul'], steps=2, optimizer=dict(lr=1e-5),
           prompts_per_step=4, group_size=2, max_prompt_len=32, max_response_len=16),
      dict(name='final', kind='eval'),
  ]
  c.allow_config_change = False
  return c


def validate(c):
  return config_lib.validate(c, known_verifiers=VERIFIERS, known_formats=FORMATS)


def test_valid_config_resolves_defaults_and_phases():
  plan = validate(make_config())
  assert [s.name for s in plan.stages] == ['sft', 'rm', 'rlhf', 'add_rl', 'blend', 'mopd', 'final']
  add_rl = plan.stage('add_rl')
  assert add_rl.datasets == ('add_train',)          # defaults to the domain's train set
  assert add_rl.phase_at(0).max_response_len == 8 and add_rl.phase_at(0).filter_overlong
  assert add_rl.phase_at(3).temperature == 0.8 and not add_rl.phase_at(3).filter_overlong
  assert add_rl.phase_at(100).max_response_len == 16
  assert add_rl.max_response_len == 16 and add_rl.reset_optimizer
  assert plan.stage('blend').datasets == ('add_train', 'mul_train')
  assert plan.stage('mopd').teachers == 'best'
  assert plan.stage('rm').evaluate is False
  assert plan.stage('sft').optimizer.schedule == 'cosine'
  assert plan.domains['mul'].verifier_options == {'unfinished_reward': 0.0}
  assert not plan.initial_eval                      # the cascade starts with SFT


def _mutate(fn):
  c = make_config()
  stages = copy.deepcopy(list(c.stages))
  fn(c, stages)
  c.stages = stages
  return c


CASES = [
    ('unknown kind', lambda c, s: s[2].update(kind='ppo'), "stages[2] 'rlhf': kind='ppo': unknown kind"),
    ('missing field', lambda c, s: s[3].pop('steps'), "stages[3] 'add_rl': steps: missing field"),
    ('unknown field', lambda c, s: s[3].update(lrr=1), "stages[3] 'add_rl': lrr: unknown field"),
    ('missing name', lambda c, s: s[3].pop('name'), 'stages[3]: name: missing field'),
    ('empty name', lambda c, s: s[3].update(name=''), 'stages[3]: name: missing field'),
    ('name not a string', lambda c, s: s[3].update(name=5), 'stages[3]: name: missing field'),
    ('duplicate name', lambda c, s: s[3].update(name='rlhf'), "stages[3] 'rlhf': name: duplicate"),
    ('G < 2', lambda c, s: s[3].update(group_size=1), "stages[3] 'add_rl': group_size=1: grpo needs G >= 2"),
    ('lr <= 0', lambda c, s: s[3]['optimizer'].update(lr=0.0), "stages[3] 'add_rl': optimizer.lr=0.0: must be > 0"),
    ('unknown optimizer field', lambda c, s: s[0]['optimizer'].update(beta=1),
     "stages[0] 'sft': optimizer.beta: unknown field"),
    ('unknown domain', lambda c, s: s[3].update(domains=['physics']),
     "stages[3] 'add_rl': domains=['physics']: unknown domain 'physics'"),
    ('unknown dataset', lambda c, s: s[0].update(datasets=['nope']),
     "stages[0] 'sft': datasets=['nope']: unknown dataset 'nope'"),
    ('wrong record type', lambda c, s: s[0].update(datasets=['add_train']),
     "stages[0] 'sft': datasets=['add_train']: dataset 'add_train' holds prompt records"),
    ('unknown verifier', lambda c, s: c.domains.add.update(dict(verifier='magic')),
     "config.domains.add.verifier='magic': unknown verifier"),
    ('unknown domain dataset', lambda c, s: c.domains.add.update(dict(train='x')),
     "config.domains.add.train='x': unknown dataset"),
    ('unknown format', lambda c, s: c.datasets.prefs.update(dict(format='csv')),
     "config.datasets.prefs.format='csv': unknown format"),
    ('max length over model', lambda c, s: s[4].update(max_response_len=300),
     "stages[4] 'blend': max_response_len=300: max_prompt_len + max_response_len = 332 exceeds"),
    ('phase longer than stage', lambda c, s: s[3]['phases'][1].update(max_response_len=250),
     "stages[3] 'add_rl': phases[1].max_response_len=250: exceeds the stage's max_response_len=16"),
    ('phases not increasing', lambda c, s: s[3]['phases'][1].update(until_step=3),
     "stages[3] 'add_rl': phases[1].until_step=3: phases must end at strictly increasing steps"),
    ('phase unknown field', lambda c, s: s[3]['phases'][0].update(top_p=0.5),
     "stages[3] 'add_rl': phases[0].top_p: unknown field"),
    ('init_from later stage', lambda c, s: s[3].update(init_from='mopd'),
     "stages[3] 'add_rl': init_from='mopd': names a later stage"),
    ('init_from unknown stage', lambda c, s: s[3].update(init_from='nothing'),
     "stages[3] 'add_rl': init_from='nothing': names an unknown stage"),
    ('init_from reward model', lambda c, s: s[3].update(init_from='rm'),
     "stages[3] 'add_rl': init_from='rm': is a reward_model stage"),
    ('init_from itself', lambda c, s: s[3].update(init_from='add_rl'),
     "stages[3] 'add_rl': init_from='add_rl': a stage cannot start from itself"),
    ('negative weight decay', lambda c, s: s[3]['optimizer'].update(weight_decay=-0.5),
     "stages[3] 'add_rl': optimizer.weight_decay=-0.5: must be >= 0"),
    ('negative lr', lambda c, s: s[3]['optimizer'].update(lr=-0.5),
     "stages[3] 'add_rl': optimizer.lr=-0.5: must be > 0"),
    ('negative Adam eps', lambda c, s: s[3]['optimizer'].update(eps=-1e-8),
     "stages[3] 'add_rl': optimizer.eps=-1e-08: must be > 0"),
    ('pair longer than the model', lambda c, s: s[1].update(max_len=257),
     "stages[1] 'rm': max_len=257: exceeds the model's max_seq_len=256"),
    ('sft longer than the model', lambda c, s: s[0].update(max_len=257),
     "stages[0] 'sft': max_len=257: exceeds the model's max_seq_len=256"),
    ('sft rows of one token', lambda c, s: s[0].update(max_len=1),
     "stages[0] 'sft': max_len=1: must be an int >= 2"),
    ('temperature', lambda c, s: s[3].update(temperature=0), "stages[3] 'add_rl': temperature=0: must be > 0"),
    ('top_p', lambda c, s: s[3].update(top_p=1.5), "stages[3] 'add_rl': top_p=1.5: must be in (0, 1]"),
    ('thinking fraction', lambda c, s: s[3].update(thinking_fraction=2),
     "stages[3] 'add_rl': thinking_fraction=2"),
    ('advantage', lambda c, s: s[3].update(advantage='ppo'), "stages[3] 'add_rl': advantage='ppo': unknown advantage"),
    ('microbatches', lambda c, s: s[3].update(microbatches=3), "stages[3] 'add_rl': microbatches=3: must divide"),
    ('teacher unknown', lambda c, s: s[5].update(teachers={'add': 'sft', 'mul': 'zzz'}),
     "stages[5] 'mopd': teachers="),
    ('teacher missing domain', lambda c, s: s[5].update(teachers={'add': 'sft'}),
     "no teacher for domain 'mul'"),
    ('rm stage later', lambda c, s: s.insert(1, s.pop(2)),
     "stages[1] 'rlhf': domains: domain 'chat' is scored by reward model stage 'rm', which comes later"),
    ('rm stage unknown', lambda c, s: c.domains.chat.update(dict(reward_model_stage='sft')),
     "config.domains.chat.reward_model_stage='sft': names no reward_model stage"),
    ('rm verifier without rm stage', lambda c, s: c.domains.chat.update(dict(reward_model_stage='')),
     "config.domains.chat.reward_model_stage: missing field"),
    ('rm stage for a verifier without rm', lambda c, s: c.domains.add.update(dict(reward_model_stage='rm')),
     "config.domains.add.reward_model_stage='rm': neither verifier 'math'"),
    ('rollout past the reward model', lambda c, s: s[2].update(max_response_len=40),
     "stages[2] 'rlhf': max_prompt_len + max_response_len = 72 tokens of domain 'chat' do not fit "
     "the scorer of reward model stage 'rm' (score_max_len=64, its max_len when 0)"),
    ('eval past the reward model', lambda c, s: c.eval.update(max_new_tokens=40),
     "config.eval: max_prompt_len + max_new_tokens = 72 tokens of domain 'chat' do not fit the "
     "scorer of reward model stage 'rm'"),
    ('score window past the model', lambda c, s: s[1].update(score_max_len=300),
     "stages[1] 'rm': score_max_len=300: exceeds the model's max_seq_len=256"),
    ('no eval set', lambda c, s: c.domains.add.update(dict(eval='')), 'config.domains.add.eval: missing'),
    ('eval samples', lambda c, s: c.eval.update(dict(num_samples=0)), 'config.eval.num_samples=0'),
    ('no model', lambda c, s: c.model.update(dict(preset='')), "config.model: needs 'preset'"),
    ('bad preset', lambda c, s: c.model.update(dict(preset='gpt9')), "unknown model preset 'gpt9'"),
    ('steps', lambda c, s: s[0].update(steps=0), "stages[0] 'sft': steps=0: must be an int >= 1"),
    ('empty', lambda c, s: s.clear(), 'config.stages: the stage list is empty'),
    ('sampler field', lambda c, s: c.sampler.update(dict(chunk=4)),
     'config.sampler.chunk: unknown field'),
    ('cache budget', lambda c, s: c.sampler.update(dict(cache_tokens_per_device=0)),
     'config.sampler.cache_tokens_per_device=0: must be an int >= 1'),
    ('decode layers', lambda c, s: c.sampler.update(dict(decode_layers='unroll')),
     "config.sampler.decode_layers='unroll': expected one of ('auto', 'scan', 'unrolled')"),
    ('decode rows', lambda c, s: c.sampler.update(dict(decode_rows='every')),
     "config.sampler.decode_rows='every': expected one of ('live', 'all')"),
    ('rollout rules', lambda c, s: c.sampler.update(dict(rollout_rules=['embed'])),
     "config.sampler.rollout_rules=['embed']: must be (logical axis, mesh axes) pairs"),
]


@pytest.mark.parametrize('name,mutate,message', CASES, ids=[c[0] for c in CASES])
def test_validation_error_names_stage_and_field(name, mutate, message):
  del name
  with pytest.raises(config_lib.ConfigError) as e:
    validate(_mutate(mutate))
  assert message in str(e.value), str(e.value)


def test_a_reward_models_score_window_covers_the_rows_it_scores():
  # Training pairs of 64 tokens, scoring rollouts and held-out rows of up to 72 tokens whole.
  def mutate(c, s):
    s[1]['score_max_len'] = 72
    s[2]['max_response_len'] = 40
    c.eval.max_new_tokens = 40
  plan = validate(_mutate(mutate))
  assert plan.stage('rm').max_len == 64 and plan.stage('rm').score_len == 72
  assert validate(make_config()).stage('rm').score_len == 64      # 0: the training max_len


def _judged_chat(window: int, response: int = 16, eval_tokens: int = 16, **eval_options):
  """The chat domain scored by a judge reading `window` tokens of an answer."""
  def mutate(c, s):
    c.domains.chat.update(dict(verifier='judge', reward_model_stage='', verifier_options=dict(
        judge='stage:sft', max_field_tokens=window)))
    if eval_options:
      c.domains.chat.update(dict(eval_verifier='judge', eval_verifier_options=dict(
          judge='stage:sft', **eval_options)))
    s[2]['max_response_len'] = response
    c.eval.max_new_tokens = eval_tokens
  c = _mutate(mutate)
  return config_lib.validate(c, known_verifiers=VERIFIERS + ('judge',), known_formats=FORMATS)


def test_a_judged_domain_writes_no_more_than_its_judge_reads():
  # The judge reads max_field_tokens of an answer; a longer one would be judged on its head.
  assert _judged_chat(16).domains['chat'].verifier == 'judge'
  with pytest.raises(config_lib.ConfigError) as e:
    _judged_chat(16, response=24)
  assert str(e.value) == (
      "stages[2] 'rlhf': max_response_len=24 tokens of domain 'chat' exceed its judge's window "
      '(config.domains.chat.verifier_options.max_field_tokens=16): raise it or shorten the '
      'responses')
  # The held-out verifier's own window bounds the evaluation's generations.
  assert _judged_chat(16, eval_tokens=24, max_field_tokens=24)
  with pytest.raises(config_lib.ConfigError, match=(
      r"^config.eval: max_new_tokens=24 tokens of domain 'chat' exceed its judge's window "
      r'\(config.domains.chat.eval_verifier_options.max_field_tokens=20\)')):
    _judged_chat(16, eval_tokens=24, max_field_tokens=20)
  # Without eval options the training verifier scores the held-out set too.
  with pytest.raises(config_lib.ConfigError, match=r'^config.eval: max_new_tokens=24 .*'
                                                   r'chat.verifier_options.max_field_tokens=16'):
    _judged_chat(16, eval_tokens=24)


def test_explicit_teachers_and_paths():
  def mutate(c, s):
    s[5]['teachers'] = {'add': 'add_rl', 'mul': '/ckpts/mul_teacher'}
    s[3]['init_from'] = '/some/hf/dir'
  plan = validate(_mutate(mutate))
  assert plan.stage('mopd').teachers == {'add': 'add_rl', 'mul': '/ckpts/mul_teacher'}
  assert plan.stage('add_rl').init_from == '/some/hf/dir'


def test_initial_eval_when_cascade_starts_with_rl():
  def mutate(c, s):
    del s[:2]
    s[2].pop('init_from')
    s[0]['domains'] = ['add']
    c.domains.chat.reward_model_stage = ''
    c.domains.chat.verifier = 'math'
  assert validate(_mutate(mutate)).initial_eval

  # A reward model first has no matrix row: the first row is still an RL stage's.
  def rm_first(c, s):
    del s[0]
    s[0]['init_from'] = '/ckpts/base'
    s[3].pop('init_from')
  plan = validate(_mutate(rm_first))
  assert plan.stages[0].kind == 'reward_model' and plan.initial_eval


def test_config_hash_ignores_harmless_fields():
  a = make_config()
  b = make_config()
  b.allow_config_change = True
  b.ckpt.keep = 5
  b.divergence = dict(max_bad_steps=7, max_loss=50.0)   # thresholds only stop a run
  assert checkpoint.config_hash(a) == checkpoint.config_hash(b)
  c = make_config()
  c.divergence = dict(rollbacks=1)                     # a rollback retrains: not harmless
  assert checkpoint.config_hash(a) != checkpoint.config_hash(c)
  b.stages[0]['steps'] = 5
  assert checkpoint.config_hash(a) != checkpoint.config_hash(b)


@pytest.mark.parametrize('edit,message', [
    (lambda c: c.eval.update(domains={'nope': {}}),
     'config.eval.domains.nope: unknown domain'),
    (lambda c: c.eval.update(domains={'add': {'batch_size': 3}}),
     'config.eval.domains.add.batch_size: not a per-domain field'),
    (lambda c: c.eval.update(domains={'add': {'temperature': float('inf')}}),
     'config.eval.domains.add.temperature=inf: must be a number >= 0'),
    (lambda c: c.eval.update(thinking='sometimes'), "config.eval.thinking='sometimes'"),
    (lambda c: c.eval.update(eval_every=-1), 'config.eval.eval_every=-1: must be an int >= 0'),
    (lambda c: c.domains.add.update(validation='add_eval'),
     "config.domains.add.validation='add_eval': is the held-out set"),
    (lambda c: c.domains.add.update(validation='nope'),
     "config.domains.add.validation='nope': unknown dataset"),
    (lambda c: c.datasets.add_val.update(skip=-2), 'config.datasets.add_val.skip=-2'),
    (lambda c: c.domains.mul.update(validation=''),
     "stages[5] 'mopd': teachers='best': 'best' chooses on validation scores, and domain 'mul' "
     'has no validation set'),
])
def test_evaluation_settings_and_validation_sets_are_checked(edit, message):
  c = make_config()
  edit(c)
  with pytest.raises(config_lib.ConfigError) as e:
    validate(c)
  assert str(e.value).startswith(message), str(e.value)


def test_per_domain_evaluation_settings_and_both_modes():
  c = make_config()
  c.eval.update(thinking='both', eval_every=3, validation_prompts=5,
                domains={'add': {'max_new_tokens': 32, 'thinking': False, 'num_samples': 1}})
  plan = validate(c)
  add, mul = plan.eval_of('add'), plan.eval_of('mul')
  assert (add.max_new_tokens, add.modes, add.num_samples) == (32, (False,), 1)
  assert (mul.max_new_tokens, mul.modes, mul.num_samples) == (16, (True, False), 2)
  assert add.eval_every == mul.eval_every == 3 and add.validation_prompts == 5
  assert plan.domains['add'].validation == 'add_val' and plan.datasets['add_val'].skip == 100
  assert plan.domains['chat'].validation == ''


def test_stage_references_need_equal_names_not_the_same_string_object():
  # Names read from JSON or the command line are new str objects, not interned literals.
  c = make_config()
  stages = copy.deepcopy(list(c.stages))
  stages[4]['init_from'] = ''.join(['s', 'f', 't'])
  stages[1]['max_len'] = 256                      # exactly the model's length is allowed
  stages[5]['init_from'] = 'add_rl'               # an earlier stage whose name sorts first
  c.stages = stages
  plan = validate(c)
  assert (plan.stages[4].init_from, plan.stages[5].init_from) == ('sft', 'add_rl')


def test_stage_seeds_are_31_bit_distinct_and_reproducible():
  from cascade.kinds import base  # pylint: disable=g-import-not-at-top
  seeds = [base.stage_seed(s, i) for s in range(8) for i in range(8)]
  assert all(isinstance(x, int) and 0 <= x < 2 ** 31 for x in seeds)
  assert len(set(seeds)) == len(seeds)
  assert seeds == [base.stage_seed(s, i) for s in range(8) for i in range(8)]
  # Over 64 seeds, 31 bits: some use the top bit (a seed kept to 31 bits by accident of
  # the draw would not).
  assert max(seeds) >= 2 ** 30


def test_a_stage_with_only_warmup_still_decays_over_one_update():
  from cascade.kinds import base  # pylint: disable=g-import-not-at-top
  c = make_config()
  stages = copy.deepcopy(list(c.stages))
  stages[0]['optimizer'] = dict(lr=1e-3, warmup_steps=4, schedule='cosine')   # steps=4
  c.stages = stages
  assert base.optimizer_config(validate(c).stages[0]).decay_steps == 1


def test_make_config_hash_is_pinned():
  # Workdirs of this config made before the typed sections still resume.
  assert checkpoint.config_hash(make_config()) == '7b0a47bbec9591bc'
  assert checkpoint.config_hash(validate(make_config()).source) == '7b0a47bbec9591bc'


@pytest.mark.parametrize('hardware,message', [
    (dict(platform='fpga'), "config.hardware.platform='fpga': unknown platform (known: tpu, gpu, "
                            'cpu)'),
    (dict(device_memory_gib=-1.0), 'config.hardware.device_memory_gib=-1.0: must be a finite '
                                   'number >= 0'),
    (dict(peak_tflops=float('inf')), 'config.hardware.peak_tflops=inf: must be a finite'),
    (dict(topology=4), 'config.hardware.topology=4: must be a string'),
    (dict(chips=64), 'config.hardware.chips: unknown field'),
])
def test_hardware_is_checked(hardware, message):
  c = make_config()
  c.hardware = hardware
  with pytest.raises(config_lib.ConfigError) as e:
    validate(c)
  assert str(e.value).startswith(message), str(e.value)


def test_hardware_and_sampler_are_typed_sections_of_the_plan():
  c = make_config()
  plan = validate(c)
  assert plan.hardware == config_lib.Hardware() and plan.sampler.options() == {}
  c.hardware = dict(name='node', platform='gpu', device_memory_gib=131, peak_tflops=989.0)
  c.sampler = dict(prompt_buckets=[32, 64], engine='paged', slots=None,
                   rollout_rules={'embed': None})
  plan = validate(c)
  assert (plan.hardware.platform, plan.hardware.device_memory_gib) == ('gpu', 131.0)
  # Options left None take rl.sampler.Sampler's defaults: only the others are passed.
  assert plan.sampler.options() == dict(prompt_buckets=(32, 64), engine='paged',
                                        rollout_rules=(('embed', None),))
  c.sampler = dict(engine='pagd')
  with pytest.raises(config_lib.ConfigError, match=r"^config\.sampler\.engine='pagd': expected "
                                                   r"one of \('one_call', 'paged'\)$"):
    validate(c)


def test_a_verifier_declares_its_reward_model_option(monkeypatch):
  import verifiers  # pylint: disable=g-import-not-at-top
  from cascade import verifier_set  # pylint: disable=g-import-not-at-top

  class Judge(verifiers.Verifier):
    name = 'judge'
    reward_model_option = 'judge_scorer'     # all it takes: no list elsewhere names it

    def __init__(self, *, judge_scorer=None, **common):
      super().__init__(**common)
      self.judge_scorer = judge_scorer

  # pylint: disable-next=protected-access
  monkeypatch.setitem(verifiers._registry._entries, 'judge', Judge)
  c = make_config()
  c.domains.chat.verifier = 'judge'
  c.domains.chat.eval_verifier = 'math'
  c.domains.mul.verifier_options = {}            # make_config's are not the math verifier's
  plan = config_lib.validate(c, known_verifiers=VERIFIERS + ('judge',), known_formats=FORMATS)
  scorer = lambda prompts, answers: None
  vs = verifier_set.VerifierSet(plan, rm_scorer=lambda stage: scorer, rm_ready=lambda name: True)
  vs.check_options()
  assert vs.train_verifier('chat').judge_scorer is scorer
  assert not hasattr(vs.eval_verifier('chat'), 'judge_scorer')
  # A verifier that declares none takes no reward model stage.
  c.domains.chat.verifier = 'code'
  with pytest.raises(config_lib.ConfigError, match="neither verifier 'code' nor eval_verifier "
                                                   r"'math' takes a reward model \(those that do: "
                                                   'instruction_following, judge, reward_model'):
    config_lib.validate(c, known_verifiers=VERIFIERS + ('judge',), known_formats=FORMATS)


@pytest.mark.parametrize('edit,message', [
    (lambda c: c.datasets.prefs.update(format=None), 'config.datasets.prefs.format: missing field'),
    (lambda c: c.datasets.prefs.update(tfds='prefs_tfds'),
     "config.datasets.prefs.tfds: give exactly one of 'path' (JSONL/Parquet) or 'tfds'"),
    (lambda c: c.datasets.prefs.update(path=''),
     "config.datasets.prefs.path: give exactly one of 'path' (JSONL/Parquet) or 'tfds'"),
    (lambda c: setattr(c.datasets, 'prefs', dict(path=3, format='preference')),
     'config.datasets.prefs.path=3: must be a string'),
    (lambda c: c.datasets.prefs.update(limt=3),
     'config.datasets.prefs.limt: unknown field (nearest: limit'),
    (lambda c: c.datasets.update({'bad name': dict(path='/d/x.jsonl', format='sft')}),
     "config.datasets.bad name: a dataset name may hold only letters, digits, _ . -"),
    (lambda c: c.datasets.update(x='/d/x.jsonl'),
     'config.datasets.x: must be a mapping of its fields, got str'),
    (lambda c: c.domains.add.update(verifier=None),
     'config.domains.add.verifier: missing field'),
    (lambda c: c.domains.add.update(verifier_options='strict'),
     "config.domains.add.verifier_options='strict': must be a mapping"),
    (lambda c: c.domains.add.update(max_turns=3),
     'config.domains.add.max_turns: only a domain with an env takes it'),
])
def test_dataset_and_domain_fields_are_checked_by_their_declarations(edit, message):
  c = make_config()
  edit(c)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, known_verifiers=VERIFIERS, known_formats=FORMATS)
  assert str(e.value).startswith(message)


def test_dataset_and_domain_defaults_and_derived_fields():
  c = make_config()
  c.datasets.add_val.update(split=None, limit=None)          # None: the field's default
  c.domains.mul.update(eval_verifier='math')                  # the same verifier: its options
  c.domains.add.update(verifier_options=dict(x=1), eval_verifier_options={})   # given: kept
  plan = config_lib.validate(c, known_verifiers=VERIFIERS, known_formats=FORMATS)
  val = plan.datasets['add_val']
  assert (val.split, val.limit, val.skip, val.record_type, val.domains) == (
      'train', 0, 100, 'prompt', None)
  mul, add = plan.domains['mul'], plan.domains['add']
  assert mul.eval_verifier_options == mul.verifier_options == {'unfinished_reward': 0.0}
  assert (add.eval_verifier, add.verifier_options, add.eval_verifier_options) == (
      'math', {'x': 1}, {})
  assert plan.domains['chat'].env_options == {} and not plan.domains['chat'].agentic


def test_the_config_page_names_every_dataset_and_domain_field():
  import pathlib  # pylint: disable=g-import-not-at-top
  page = (pathlib.Path(__file__).parents[2] / 'docs' / 'config.md').read_text(encoding='utf-8')
  for cls in (config_lib.Dataset, config_lib.Domain):
    for f in dataclasses.fields(cls):
      if f.metadata.get('user', True):
        assert f'`{f.name}`' in page, f'docs/config.md does not name {cls.__name__}.{f.name}'
