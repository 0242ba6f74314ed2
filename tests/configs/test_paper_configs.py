"""The paper-recipe configs: the papers' numbers land in the stage fields they name, every
config validates, and what they cite is in the repository."""

import importlib
import math
import os
import re

import pytest

from cascade import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = ('nemotron_cascade_14b', 'nemotron_cascade_8b', 'nemotron_cascade2')
# GRPO fields every paper stage fixes: strictly on-policy, token-level loss, dynamic filtering;
# and ours: the sampler/trainer gap corrected by TIS at cap 2 (configs/_recipes.py
# correct_mismatch).
GRPO = dict(kind='grpo', advantage='grpo', loss_agg='token', dynamic_filter=True, init_from='',
            tis_cap=2.0)
# Cascade 2's RL stages also replay the rollouts' routing (a mixture-of-experts policy;
# configs/_recipes.py replay_routing).
CASCADE2_GRPO = dict(GRPO, routing_replay='on')


def _stage(config, name):
  c = importlib.import_module(f'configs.{config}').get_config()
  (st,) = [s for s in c.stages if s['name'] == name]
  return dict(st)


@pytest.mark.parametrize('name', CONFIGS)
def test_paper_configs_validate(name):
  c = importlib.import_module(f'configs.{name}').get_config('data_root=gs://b/d,base=/b')
  plan = config_lib.validate(c)
  assert plan.stages[0].kind == 'sft'
  # Cascade 1 reads the released RL-Math files as downloaded (configs/_recipes.py,
  # CASCADE1_RELEASE); Cascade 2 released no math RL set.
  assert c.datasets['math_train'].to_dict() == (
      dict(path='gs://b/d/rl/math.jsonl', format='nemotron_math', domain='math')
      if name == 'nemotron_cascade2' else
      dict(path='gs://b/d/Nemotron-Cascade-RL-Math/*.jsonl', format='cascade1_rl_math',
           domain='math'))


def test_cascade1_14b_math_stage_is_the_papers():
  """Math RL, 14B: lr 2.5e-6, 28K at temperature 1.2 until step 120, then 40K at 1.1."""
  assert _stage('nemotron_cascade_14b', 'math_rl') == dict(
      GRPO, name='math_rl', domains=['math'], steps=220,
      optimizer=dict(lr=2.5e-6, warmup_steps=0), prompts_per_step=128, group_size=8,
      temperature=1.2, top_p=0.95, max_prompt_len=2048, max_response_len=40_960,
      thinking_fraction=1.0, filter_overlong=False, kl_coef=0.0, microbatches=128,
      pack_tokens=2048 + 40_960, stream_filter=True,
      phases=[dict(until_step=120, max_response_len=28_672, temperature=1.2,
                   filter_overlong=True),
              dict(until_step=220, max_response_len=40_960, temperature=1.1,
                   filter_overlong=False)])


def test_cascade1_reward_model_and_8b_swe_stage():
  assert _stage('nemotron_cascade_14b', 'rm') == dict(
      name='rm', kind='reward_model', domains=['chat'], datasets=['rm_pairs'],
      init_from='sft_32k', steps=320, batch_size=256, max_len=8192,
      optimizer=dict(lr=2e-6), microbatches=32, score_max_len=65_536)
  assert _stage('nemotron_cascade_8b', 'swe_rl') == dict(
      GRPO, name='swe_rl', domains=['swe'], steps=120,
      optimizer=dict(lr=2.5e-6, warmup_steps=0), prompts_per_step=128, group_size=16,
      temperature=1.0, top_p=0.95, max_prompt_len=16_384, max_response_len=16_384,
      thinking_fraction=1.0, filter_overlong=False, kl_coef=0.0, microbatches=256,
      pack_tokens=32_768, stream_filter=True)


def test_cascade2_if_rl_and_mopd_stages():
  assert _stage('nemotron_cascade2', 'if_rl') == dict(
      CASCADE2_GRPO, name='if_rl', domains=['instruction_following'], steps=180,
      optimizer=dict(lr=3e-6, warmup_steps=0), prompts_per_step=128, group_size=16,
      temperature=1.0, top_p=1.0, max_prompt_len=2048, max_response_len=49_152,
      thinking_fraction=0.0, filter_overlong=False, kl_coef=0.0, microbatches=256,
      pack_tokens=2048 + 49_152, stream_filter=True)
  assert _stage('nemotron_cascade2', 'mopd') == dict(
      name='mopd', kind='mopd', domains=['math', 'instruction_following', 'chat', 'mcqa',
                                         'structured', 'tool_calling'],
      datasets=['mopd_train', 'rlhf_train'],
      teachers={'math': 'sft', 'instruction_following': 'multi_domain_rl',
                'chat': 'rlhf_teacher', 'mcqa': 'multi_domain_rl',
                'structured': 'multi_domain_rl', 'tool_calling': 'multi_domain_rl'},
      init_from='multi_domain_rl', steps=52, optimizer=dict(lr=2e-6, warmup_steps=30),
      prompts_per_step=128, group_size=4, temperature=1.0, max_prompt_len=4096,
      max_response_len=98_304, microbatches=64, routing_replay='on')
  assert _stage('nemotron_cascade2', 'rlhf')['kl_coef'] == 0.03


def test_cascade2_rl_stages_run_to_the_papers_49k():
  """"Most stages use ... responses up to ~49K tokens": IF-RL, multi-domain RL, both RLHF runs
  and long-context RL generate 49,152 tokens on every hardware preset, their prompts as before;
  the reward model scores and the GenRM judge reads the longest chat answer whole."""
  module = importlib.import_module('configs.nemotron_cascade2')
  prompts = dict(if_rl=2048, multi_domain_rl=4096, rlhf_teacher=4096, rlhf=4096,
                 long_context_rl=32_768)
  for hardware in ('v5p_128', 'h200x8', '2xh200x8', '4xh200x8'):
    stages = {s['name']: s for s in module.get_config(f'hardware={hardware}').stages}
    for name, prompt in prompts.items():
      assert (stages[name]['max_prompt_len'], stages[name]['max_response_len']) == (
          prompt, 49_152), (hardware, name)
    chat_rows = [s['max_prompt_len'] + s['max_response_len'] for s in stages.values()
                 if 'chat' in s.get('domains', ()) and 'max_response_len' in s]
    assert stages['rm']['score_max_len'] >= max(chat_rows) == 4096 + 98_304
  c = module.get_config('genrm=configs/judges/qwen3_235b_a22b')
  window = c.domains.chat.verifier_options['max_field_tokens']
  assert window == max(s.get('max_response_len', 0) for s in c.stages
                       if 'chat' in s.get('domains', ()))
  config_lib.validate(c)


def test_cascade2_mopd_teachers_get_rows_of_their_domains():
  """The released MOPD subset holds math, IF, MCQA, workplace tool calling and structured
  output, no chat: chat's teacher (the side RLHF run) gets the RLHF prompts, and a stage or
  domain expecting rows a released subset cannot hold is a one-line config error naming both."""
  module = importlib.import_module('configs.nemotron_cascade2')
  plan = config_lib.validate(module.get_config())
  mopd = plan.stage('mopd')
  for d in mopd.domains:
    assert any(not plan.datasets[ds].lacks(d) for ds in mopd.datasets), d
  assert plan.datasets['mopd_train'].domains == (
      'math', 'instruction_following', 'mcqa', 'tool_calling', 'structured')
  c = module.get_config()
  (st,) = [s for s in c.stages if s['name'] == 'mopd']
  st['datasets'] = ['mopd_train']
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  assert str(e.value) == (
      "stages[5] 'mopd': domains=['math', 'instruction_following', 'chat', 'mcqa', "
      "'structured', 'tool_calling']: domain 'chat' gets no rows: dataset 'mopd_train' has no "
      "rows of domain 'chat' (its format 'cascade2_mopd' holds only math, "
      'instruction_following, mcqa, tool_calling, structured)')
  c = module.get_config()
  c.domains.mcqa.train = 'if_train'
  with pytest.raises(config_lib.ConfigError, match=(
      r"^config.domains.mcqa.train='if_train': dataset 'if_train' has no rows of domain 'mcqa' "
      r"\(its format 'cascade2_if_rl' holds only instruction_following\)$")):
    config_lib.validate(c)
  c14 = importlib.import_module('configs.nemotron_cascade_14b').get_config()
  c14.domains.math.train = 'rlhf_train'
  with pytest.raises(config_lib.ConfigError, match=(
      r"^config.domains.math.train='rlhf_train': dataset 'rlhf_train' has no rows of domain "
      r"'math' \(records of format 'cascade1_rl_rlhf' are all of the dataset's domain 'chat'\)$")):
    config_lib.validate(c14)


def test_cascade2_lengths_are_the_papers_on_v5p_and_h200_nodes():
  """On the v5p slice and on 1, 2 or 4 H200 nodes (a sequence axis each: a row over 8 chips or
  a node's 8 GPUs, the nodes fsdp) SFT packs 256K-token rows, MOPD samples up to 98K and code
  RL 118K (configs/PAPERS.md)."""
  module = importlib.import_module('configs.nemotron_cascade2')
  for arg, (sft, mopd, code, mesh) in {
      None: (262_144, 98_304, 118_784, (1, 1, 8, 8, 1)),
      'hardware=h200x8': (262_144, 98_304, 118_784, (1, 1, 1, 8, 1)),
      'hardware=2xh200x8': (262_144, 98_304, 118_784, (1, 2, 1, 8, 1)),
      'hardware=4xh200x8': (262_144, 98_304, 118_784, (1, 4, 1, 8, 1))}.items():
    c = module.get_config(arg)
    stage = {st['name']: st for st in c.stages}
    # One row per batch shard in every microbatch, as on the v5p slice (none padded in): on
    # H nodes the rows split H ways (a row over a node's 8 GPUs).
    for st in c.stages:
      rows = st.get('batch_size') or st['prompts_per_step'] * st['group_size']
      assert rows == st['microbatches'] * math.prod(c.mesh.shape[:3]), (arg, st['name'])
    assert (stage['sft']['max_len'], stage['mopd']['max_response_len'],
            stage['code_rl']['max_response_len'], tuple(c.mesh.shape)) == (sft, mopd, code, mesh)
    # The RM scores MOPD's chat rows whole; the sampler compiles the exact lengths.
    assert stage['rm']['score_max_len'] == 4096 + mopd
    assert {mopd, code} <= set(c.sampler.new_token_buckets)
    plan = config_lib.validate(c)
    if len(c.mesh.shape) == 5:
      # Every trained row splits into 2 x 8 zig-zag chunks (models.context), and the sampler
      # splits its rows over the sequence axis too.
      for st in plan.stages:
        longest = (st.max_len if st.kind in ('sft', 'reward_model')
                   else st.max_prompt_len + st.longest_response)
        assert longest % 16 == 0, st.name
      assert dict(c.sampler.rollout_rules)['batch'] == ('data', 'fsdp', 'expert', 'sequence')
    else:
      assert 'batch' not in dict(c.sampler.rollout_rules)


def test_cascade2_multi_domain_rl_and_its_verifiers():
  """Multi-domain RL trains MCQA, tool calling and structured output, each by its own verifier."""
  assert _stage('nemotron_cascade2', 'multi_domain_rl') == dict(
      CASCADE2_GRPO, name='multi_domain_rl', domains=['mcqa', 'tool_calling', 'structured'],
      steps=70,
      optimizer=dict(lr=3e-6, warmup_steps=0), prompts_per_step=128, group_size=16,
      temperature=1.0, top_p=1.0, max_prompt_len=4096, max_response_len=49_152,
      thinking_fraction=1.0, filter_overlong=False, kl_coef=0.0, microbatches=256,
      pack_tokens=4096 + 49_152, stream_filter=True)
  c = importlib.import_module('configs.nemotron_cascade2').get_config('data_root=/d')
  assert {d: c.domains[d]['verifier'] for d in ('mcqa', 'tool_calling', 'structured',
                                                'long_context')} == {
      'mcqa': 'mcqa', 'tool_calling': 'tool_call', 'structured': 'structured',
      'long_context': 'long_context_qa'}
  # The three train on the released multi-domain subset, whose records name their domain.
  assert {d: c.domains[d]['train'] for d in ('mcqa', 'tool_calling', 'structured')} == dict.fromkeys(
      ('mcqa', 'tool_calling', 'structured'), 'multi_domain_train')
  assert c.datasets['multi_domain_train'].to_dict() == dict(
      path='/d/Nemotron-Cascade-2-RL-data/multi-domain-RL/train.jsonl',
      format='cascade2_multi_domain_rl')
  assert 'tool_calling_train' not in c.datasets
  assert c.datasets['tool_calling_eval']['path'] == '/d/eval/tool_calling.jsonl'


def test_cascade2_swe_rl_is_agentic():
  """SWE RL runs G episodes per task in the swe_agent environment, its turns and last-turn
  prompt in the sampler's buckets."""
  assert _stage('nemotron_cascade2', 'swe_rl') == dict(
      CASCADE2_GRPO, name='swe_rl', kind='agentic', domains=['swe_agent'], steps=45,
      optimizer=dict(lr=3e-6, warmup_steps=0), prompts_per_step=128, group_size=16,
      temperature=1.0, top_p=1.0, max_prompt_len=4096, max_response_len=32_768,
      max_turn_tokens=8192, thinking_fraction=1.0, filter_overlong=False, kl_coef=0.0,
      microbatches=256, pack_tokens=4096 + 32_768)    # an episode is several calls: no streaming
  c = importlib.import_module('configs.nemotron_cascade2').get_config('data_root=/d')
  assert c.domains['swe_agent'].to_dict() == dict(
      env='swe_agent', env_options=dict(isolation='bwrap'), train='swe_agent_train',
      eval='swe_agent_eval', max_turns=50)
  assert 'swe' not in c.domains
  assert 8192 in c.sampler.new_token_buckets and 4096 + 32_768 in c.sampler.prompt_buckets
  plan = config_lib.validate(c)
  st = plan.stage('swe_rl')
  assert st.turn_tokens == 8192 and dict(st.agents[0][2]) == dict(isolation='bwrap')


@pytest.mark.parametrize('name,arg', [(n, None) for n in CONFIGS]
                         + [(n, 'hardware=h200x8') for n in CONFIGS])
def test_paper_rl_stages_run_the_fast_path(name, arg):
  """Every paper recipe samples with the paged engine; its GRPO stages filter while they
  sample; its GRPO and agentic stages pack their updates at their longest row, in microbatches
  of a padded microbatch's rows (so a packed microbatch holds no more tokens than a padded
  one); MOPD keeps its padded batch."""
  c = importlib.import_module(f'configs.{name}').get_config(arg)
  plan = config_lib.validate(c)
  assert plan.sampler.engine == 'paged' and plan.sampler.page_size == 64
  # slots and pages follow the KV budget the recipe sets (rl.sampler.Sampler).
  assert plan.sampler.slots is None and plan.sampler.pages is None
  assert plan.sampler.cache_tokens_per_device
  rl_kinds = [st for st in plan.stages if st.kind in ('grpo', 'agentic', 'mopd')]
  assert {st.kind for st in rl_kinds} >= {'grpo'}
  for st in rl_kinds:
    if st.kind == 'mopd':
      assert not st.stream_filter and not hasattr(st, 'pack_tokens')
      continue
    assert st.pack_tokens == st.max_prompt_len + st.longest_response, st.name
    assert st.stream_filter == (st.kind == 'grpo'), st.name
    rows = st.prompts_per_step * st.group_size // st.updates_per_batch
    assert st.microbatch_rows == rows // st.microbatches, st.name


def test_configs_cite_files_that_exist():
  """Every `*.md` a config names is in the repository, and PAPERS.md names both papers."""
  with open(os.path.join(REPO, 'configs', 'PAPERS.md'), encoding='utf-8') as f:
    papers = f.read()
  assert 'arXiv 2512.13607' in papers and 'arXiv 2603.19220' in papers
  for name in os.listdir(os.path.join(REPO, 'configs')):
    if not name.endswith('.py'):
      continue
    with open(os.path.join(REPO, 'configs', name), encoding='utf-8') as f:
      text = f.read()
    for cited in set(re.findall(r'[\w/.-]+\.md\b', text)):
      path = cited if '/' in cited else os.path.join('configs', cited)
      assert os.path.exists(os.path.join(REPO, path)), (name, cited)


# (pod mesh, node mesh, the node's cached bytes per token over the pod's). The dense recipes
# split 8 K/V heads over the pod's tensor axis; Cascade 2's hybrid splits its experts over an
# expert axis and its rows over a sequence axis on the pod, and no heads (its 2 K/V heads sit
# whole on every device of both).
_MESHES = {'nemotron_cascade_14b': ((1, 8, 8), (1, 8, 1), 8),
           'nemotron_cascade_8b': ((1, 8, 8), (1, 8, 1), 8),
           'nemotron_cascade2': ((1, 1, 8, 8, 1), (1, 1, 1, 8, 1), 1)}


@pytest.mark.parametrize('name', sorted(_MESHES))
def test_hardware_argument_retargets_mesh_and_sampler_budget(name):
  module = importlib.import_module(f'configs.{name}')
  pod, node = module.get_config(), module.get_config('hardware=h200x8')
  pod_mesh, node_mesh, ratio = _MESHES[name]
  assert tuple(pod.mesh.shape) == pod_mesh and pod.hardware.platform == 'tpu'
  assert tuple(node.mesh.shape) == node_mesh and node.hardware.platform == 'gpu'
  # The node's cache budget is 16 GiB against the pod's 24 GiB, of `ratio` times the bytes
  # per cached token.
  assert abs(pod.sampler.cache_tokens_per_device * 16 / (24 * ratio)
             - node.sampler.cache_tokens_per_device) <= 1
  assert [s['name'] for s in node.stages] == [s['name'] for s in pod.stages]
  pod_plan, node_plan = config_lib.validate(pod), config_lib.validate(node)
  # The node runs the MLP in chunks and keeps MOPD teachers in host memory; the pod neither.
  assert (pod_plan.model.mlp_chunk, node_plan.model.mlp_chunk) == (0, 8192)
  assert pod_plan.model.replace(mlp_chunk=8192) == node_plan.model
  for p, n in zip(pod_plan.stages, node_plan.stages):
    assert getattr(p, 'teachers_on_host', False) is False
    assert getattr(n, 'teachers_on_host', False) is (n.kind == 'mopd')
  # A microbatch holds the same rows per batch shard on both (no empty rows padded in): on
  # Cascade 2's pod mesh rows split 8 ways (data x fsdp x expert; each row over 'sequence'),
  # on the node 1 (each row over its 8 GPUs).
  shards = lambda c: math.prod(c.mesh.shape[:{3: 2, 4: 3, 5: 3}[len(c.mesh.shape)]])
  for p, n in zip(pod.stages, node.stages):
    rows = p.get('batch_size') or p['prompts_per_step'] * p['group_size']
    assert rows % (p['microbatches'] * shards(pod)) == 0, p['name']
    assert (rows // (p['microbatches'] * shards(pod))
            == rows // (n['microbatches'] * shards(node))), p['name']
  with pytest.raises(ValueError, match="hardware='a100': expected one of"):
    module.get_config('hardware=a100')


def test_cascade1_recipe_on_qwen3_30b_a3b():
  """`configs/nemotron_cascade_14b.py:model=qwen3_30b_a3b`: the same stages on the MoE preset,
  with an expert axis that splits its 128 experts; an unknown model is refused."""
  module = importlib.import_module('configs.nemotron_cascade_14b')
  dense, moe = module.get_config(), module.get_config('model=qwen3_30b_a3b')
  plan = config_lib.validate(moe)
  assert plan.model.family == 'qwen3_moe' and plan.model.num_experts == 128
  assert plan.model.rope_scaling == config_lib.validate(dense).model.rope_scaling
  assert tuple(moe.mesh.shape) == (1, 8, 8, 1)
  assert [s['name'] for s in moe.stages] == [s['name'] for s in dense.stages]
  node = module.get_config('model=qwen3_30b_a3b,hardware=h200x8')
  assert tuple(node.mesh.shape) == (1, 1, 8, 1)
  # Rows split 64 ways on the pod's expert mesh (8 on the dense one): 8x fewer microbatches,
  # the same rows per device in each; the routed experts take 32K tokens at a time.
  for d, m in zip(dense.stages, moe.stages):
    assert m['microbatches'] * 8 == d['microbatches'], d['name']
  assert plan.model.moe_chunk == 32_768
  with pytest.raises(ValueError, match="model='qwen3_32b': expected one of"):
    module.get_config('model=qwen3_32b')


def test_cascade1_14b_swe_judge_argument():
  """`configs/nemotron_cascade_14b.py:swe_judge=DIR`: the swe domain's semantic judge (P(YES)
  where the lexical rule gives neither 1 nor 0) is loaded from DIR; off by default."""
  module = importlib.import_module('configs.nemotron_cascade_14b')
  assert 'judge' not in module.get_config().domains.swe.verifier_options
  c = module.get_config('swe_judge=gs://b/judges/qwen2.5-72b-instruct')
  assert c.domains.swe.verifier_options.judge == 'gs://b/judges/qwen2.5-72b-instruct'
  plan = config_lib.validate(c)
  assert plan.domains['swe'].verifier_options['judge'] == 'gs://b/judges/qwen2.5-72b-instruct'


def test_cascade2_genrm_argument():
  """`configs/nemotron_cascade2.py:genrm=DIR`: chat (RLHF, its side run, held-out) is scored by
  the generative RM at DIR, and the Bradley-Terry stand-in's stage is gone; off by default."""
  module = importlib.import_module('configs.nemotron_cascade2')
  assert module.get_config().domains.chat.verifier == 'reward_model'
  c = module.get_config('genrm=gs://b/genrm')
  plan = config_lib.validate(c)
  chat = plan.domains['chat']
  assert (chat.verifier, chat.eval_verifier, chat.reward_model_stage) == ('judge', 'judge', '')
  assert chat.verifier_options['judge'] == chat.eval_verifier_options['judge'] == 'gs://b/genrm'
  assert 'rm' not in [s.name for s in plan.stages] and 'rlhf' in [s.name for s in plan.stages]
  # A stage scored by a generating judge samples, then scores (configs/_recipes.py
  # `_generating_judge`: the judge's engine does not run beside the policy's).
  streams = lambda cfg: {s['name']: bool(s.get('stream_filter')) for s in cfg.stages}
  assert streams(module.get_config())['rlhf'] and not streams(c)['rlhf']
  assert streams(c)['code_rl'] and streams(c)['if_rl']


def test_sampler_cache_budget_counts_attention_layers_only():
  """The recipes' KV budget in slots is the GiB over the bytes a token keeps: Cascade 2's 6
  attention layers of 2 K/V heads x 128 in bfloat16; a model without attention keeps nothing
  per token, so it gets no slot budget (None) rather than a division by zero."""
  from configs import _recipes  # pylint: disable=g-import-not-at-top
  from models import config as model_config  # pylint: disable=g-import-not-at-top
  c = importlib.import_module('configs.nemotron_cascade2').get_config()
  per_token = 6 * 2 * 2 * 128 * 2
  assert _recipes.cache_slots_per_device(c, 24.0) == 24 * 2 ** 30 // per_token
  c.model.overrides = {**dict(c.model.overrides),
                       'layer_types': model_config.parse_pattern('MEMEME'), 'num_layers': 6}
  assert _recipes.cache_slots_per_device(c, 24.0) is None
  _recipes.exact_sampler_buckets(c)
  assert c.sampler.cache_tokens_per_device is None


def test_the_papers_reward_defaults_and_their_stand_ins():
  """Cascade 1's RLHF reward carries the mixed-language penalty (training only); Cascade 2's IF
  domain is scored by the verifier that takes every instruction id of the release; each
  recipe names the rewards that stand in for the paper's, and drops a name when the config
  argument gives the paper's kind of reward (issue #56)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import verifiers  # pylint: disable=g-import-not-at-top
  for name in ('nemotron_cascade_14b', 'nemotron_cascade_8b'):
    plan = config_lib.validate(importlib.import_module(f'configs.{name}').get_config())
    chat = plan.domains['chat']
    assert dict(chat.verifier_options) == {'mixed_language_penalty': True}
    assert dict(chat.eval_verifier_options) == {}
    v = verifiers.cls(chat.verifier)(scorer=lambda p, c: np.ones(len(c)),
                                      **chat.verifier_options)
    assert v.mixed_language_penalty
    assert sorted(plan.substitutions) == ['chat', 'swe']
    assert 'difflib' in plan.substitutions['swe'] and '72B' in plan.substitutions['chat']
  judged = config_lib.validate(importlib.import_module('configs.nemotron_cascade_14b').get_config(
      'swe_judge=/judges/swe'))
  assert sorted(judged.substitutions) == ['chat']
  module = importlib.import_module('configs.nemotron_cascade2')
  plan = config_lib.validate(module.get_config())
  assert plan.domains['instruction_following'].verifier == 'ifbench'
  assert plan.domains['instruction_following'].eval_verifier == 'ifbench'
  assert plan.domains['chat'].verifier_options == {}     # Cascade 2 names no such penalty
  assert list(plan.substitutions) == ['chat'] and 'generative' in plan.substitutions['chat']
  genrm = os.path.join(REPO, 'configs', 'judges', 'qwen3_235b_a22b')
  assert config_lib.validate(module.get_config(f'genrm={genrm}')).substitutions == {}


@pytest.mark.parametrize('name,arg,moe', [('nemotron_cascade2', None, True),
                                          ('nemotron_cascade_14b', 'model=qwen3_30b_a3b', True),
                                          ('nemotron_cascade_14b', None, False),
                                          ('nemotron_cascade_8b', None, False)])
def test_recipes_correct_the_mismatch_and_moe_ones_replay_routing(name, arg, moe):
  """Every GRPO and agentic stage runs TIS at cap 2 (MOPD keeps its [0.5, 2] band); the
  mixture-of-experts recipes replay routing in every RL stage, the dense ones do not."""
  plan = config_lib.validate(importlib.import_module(f'configs.{name}').get_config(arg))
  rl = [st for st in plan.stages if st.kind in ('grpo', 'agentic', 'mopd')]
  assert {st.kind for st in rl} >= {'grpo'} and plan.sampler.engine == 'paged'
  for st in rl:
    if st.kind != 'mopd':
      assert st.tis_cap == 2.0, st.name
    assert st.routing_replay == ('on' if moe else 'off'), st.name
    assert bool(st.routing_layout) == moe
