"""The tiny-world configs: pure data that validates, a `prepare` step that writes every file
they name, and the blended baseline as the cascade's like-for-like."""

import builtins
import importlib
import os

import pytest

from cascade import config as config_lib
from cascade.data import readers
from configs import _tiny_common as common
from foundation import tokenizer as tokenizer_lib
from tiny_world import build as world_build

CONFIGS = ('tiny', 'tiny_blended', 'tiny_mopd')


@pytest.fixture(scope='module')
def root(tmp_path_factory):
  return str(tmp_path_factory.mktemp('tiny_world'))


def _get(name, arg):
  return importlib.import_module(f'configs.{name}').get_config(arg)


@pytest.mark.parametrize('name', CONFIGS)
@pytest.mark.parametrize('smoke', [False, True])
def test_tiny_configs_validate(name, smoke, root):
  c = _get(name, f'{"smoke," if smoke else ""}root={root}')
  plan = config_lib.validate(c)
  assert [s.name for s in plan.stages][0] == 'sft'
  steps = [s.steps for s in plan.stages]
  assert (max(steps) <= 2) == smoke, steps


@pytest.mark.parametrize('name', CONFIGS)
def test_get_config_is_pure_and_names_its_prepare_step(name, tmp_path, monkeypatch):
  root = str(tmp_path / 'not_built')

  def no_io(*args, **kwargs):
    raise AssertionError(f'get_config did file I/O: {args}')

  get_config = importlib.import_module(f'configs.{name}').get_config   # imported, then no I/O
  for mod, attr in ((builtins, 'open'), (os, 'makedirs'), (os, 'mkdir'), (os, 'listdir'),
                    (os, 'stat'), (os, 'remove')):
    monkeypatch.setattr(mod, attr, no_io)
  c = get_config(f'seed=3,root={root}')
  monkeypatch.undo()
  assert not os.path.exists(root)
  assert c.prepare.to_dict() == {'fn': 'tiny_world.build:build',
                                 'kwargs': {'seed': 3, 'root': root}}
  world = os.path.join(root, 'seed3')
  assert c.tokenizer.path == os.path.join(world, 'tokenizer.model')
  for spec in c.datasets.values():
    assert spec['path'].startswith(world + os.sep), spec
  assert c.seed == 3


def test_prepare_writes_every_file_the_config_names(tmp_path, monkeypatch):
  # The layout does not depend on the sizes; small ones keep the build quick.
  monkeypatch.setattr(world_build, 'SIZES', dict(
      sft=dict.fromkeys(world_build.DOMAINS, 20), rl=10, heldout=8, preference=20,
      preference_heldout=5))
  c = _get('tiny_mopd', f'smoke,seed=2,root={tmp_path}')   # names every file tiny.py does
  plan = config_lib.validate(c)
  assert not os.path.exists(tmp_path / 'seed2')
  plan.prepare.call()                                       # as the run calls it
  domains = sorted(plan.domains)
  for name, spec in plan.datasets.items():
    assert os.path.exists(spec.path), name
    assert readers.load(spec, domains), name
  tok = tokenizer_lib.load(c.tokenizer.path)
  assert tok.vocab_size == c.model.overrides.vocab_size == world_build.VOCAB


def test_demo_stage_list_is_the_measured_one(root):
  """configs/tiny.py's stages as its docstring's table was measured (name, kind, steps, lr)."""
  c = _get('tiny', f'root={root}')
  got = [(s['name'], s['kind'], s['steps'], s['optimizer']['lr']) for s in c.stages]
  assert got == [('sft', 'sft', 600, 1e-3), ('rm', 'reward_model', 100, 1e-3),
                 ('rlhf', 'grpo', 25, 5e-5), ('if_rl', 'grpo', 20, 5e-5),
                 ('math_rl', 'grpo', 10, 4e-5), ('code_rl', 'grpo', 20, 4e-5),
                 ('swe_rl', 'grpo', 15, 3e-5)]
  rl = [s for s in c.stages if s['kind'] == 'grpo']
  assert {(s['prompts_per_step'], s['group_size'], s['temperature']) for s in rl} == {
      (16, 8, 0.8)}
  assert [s['filter_overlong'] for s in rl] == [False, False, False, True, True]


def test_blended_spends_the_cascades_rollouts(root):
  cascade = _get('tiny', f'root={root}')
  blended = _get('tiny_blended', f'root={root}')
  rl = [s for s in cascade.stages if s['kind'] == 'grpo']
  (one,) = [s for s in blended.stages if s['kind'] == 'grpo']
  rollouts = lambda s: s['steps'] * s['prompts_per_step'] * s['group_size']
  per_step = one['prompts_per_step'] * one['group_size']
  assert abs(rollouts(one) - sum(rollouts(s) for s in rl)) <= per_step / 2
  assert sorted(one['domains']) == sorted(d for s in rl for d in s['domains'])
  # Same SFT and reward model (whose scorer reads the blended stage's longer rows whole); same
  # sampling settings; same world.
  head = lambda c: [{k: v for k, v in s.items() if k != 'score_max_len'}
                    for s in c.stages if s['kind'] != 'grpo']
  assert head(blended) == head(cascade)
  (rm,) = [s for s in blended.stages if s['kind'] == 'reward_model']
  assert rm['score_max_len'] == one['max_prompt_len'] + one['max_response_len']
  assert blended.prepare == cascade.prepare
  for key in ('temperature', 'group_size', 'thinking_fraction'):
    assert {s[key] for s in rl} == {one[key]}, key
  assert one['filter_overlong'] == any(s['filter_overlong'] for s in rl)


def test_tiny_agentic_config_validates_and_its_world_has_every_file(tmp_path, monkeypatch):
  from tiny_world import agentic  # pylint: disable=g-import-not-at-top
  from foundation import chat  # pylint: disable=g-import-not-at-top
  for smoke in (False, True):
    plan = config_lib.validate(_get('tiny_agentic', f'{"smoke," if smoke else ""}root={tmp_path}'))
    assert [s.kind for s in plan.stages] == ['sft', 'agentic', 'agentic']
    assert (max(s.steps for s in plan.stages) <= 2) == smoke
    assert {d: (dom.env, dom.max_turns) for d, dom in plan.domains.items()} == {
        'tool_use': ('tool_use', 4), 'swe_agent': ('swe_agent', 6)}
  assert not os.path.exists(tmp_path / 'agentic_seed0')      # get_config does no I/O
  monkeypatch.setattr(agentic, 'SIZES', dict(sft=dict(tool_use=40, swe_agent=20), rl=10,
                                             heldout=8))
  plan.prepare.call()
  for name, spec in plan.datasets.items():
    assert readers.load(spec, sorted(plan.domains)), name
  tok = tokenizer_lib.load(plan.tokenizer_path)
  assert tok.vocab_size == agentic.VOCAB
  for marker in chat.TOOL_TOKENS:                             # tool markers are single pieces
    assert len(tok.encode(marker)) == 1, marker
  sft = readers.load(plan.datasets['sft'], sorted(plan.domains))
  assert {r['domain'] for r in sft} == {'tool_use', 'swe_agent'}
  assert all(r['turns'][-1]['role'] == 'assistant' for r in sft)


@pytest.mark.slow
def test_tiny_agentic_smoke_runs_from_the_command_line(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  p = subprocess.run([sys.executable, '-m', 'cascade.main',
                      f'--config=configs/tiny_agentic.py:smoke,root={tmp_path / "w"}',
                      f'--workdir={tmp_path / "run"}', '--verbosity=-1'],
                     cwd=repo, capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-4000:]
  assert '| swe_agent_rl | swe_agent |' in p.stdout
  assert '[1] tool_rl (agentic): 2 steps in' in p.stdout


@pytest.mark.parametrize('name', CONFIGS)
def test_hetero_world_configs_think_in_math_only_and_validate(name, root):
  """`world=hetero`: the world's own directory; math drawn and scored in thinking mode with a
  longer cap (a math-only stage extends it in phases, the length curriculum), every other
  domain in instruct mode; a stage mixing them gets a fraction per domain."""
  c = _get(name, f'world=hetero,seed=1,root={root}')
  plan = config_lib.validate(c)
  world = world_build.directory(1, root, 'hetero')
  assert c.prepare.kwargs.to_dict() == {'seed': 1, 'root': root, 'world': 'hetero'}
  assert c.tokenizer.path == os.path.join(world, 'tokenizer.model')
  assert plan.eval_of('math').modes == (True,) and plan.eval_of('chat').modes == (False,)
  assert plan.eval_of('math').max_new_tokens == 144
  for st in plan.stages:
    if st.kind not in ('grpo', 'mopd'):
      continue
    want = {d: float(d == 'math') for d in st.domains}
    got = st.mode_fractions
    assert (got if isinstance(got, dict) else dict.fromkeys(st.domains, got)) == want
    assert st.longest_response == max(common.HETERO_RESPONSE_LEN[d] for d in st.domains)
    if list(st.domains) == ['math']:
      assert [p.max_response_len for p in st.phases] == [128, 144]


def test_ablation_arguments_drop_stages_and_reorder_them(root):
  """`drop=` leaves stages out (an unknown one is refused by name), `order=cascade2` puts IF-RL
  before the reward model and RLHF, and a config without that choice refuses it."""
  names = lambda arg, name='tiny': [s['name'] for s in _get(name, f'{arg},root={root}').stages]
  assert names('drop=rlhf') == ['sft', 'rm', 'if_rl', 'math_rl', 'code_rl', 'swe_rl']
  assert names('order=cascade2') == ['sft', 'if_rl', 'rm', 'rlhf', 'math_rl', 'code_rl',
                                     'swe_rl']
  assert names('drop=mopd', 'tiny_mopd') == ['sft', 'if_rl', 'multi_rl', 'rm', 'rlhf',
                                             'swe_rl']
  config_lib.validate(_get('tiny', f'order=cascade2,root={root}'))
  config_lib.validate(_get('tiny', f'drop=rlhf,root={root}'))
  # The reward model scores chat in every evaluation, so it cannot be dropped with RLHF.
  with pytest.raises(ValueError, match="reward_model_stage='rm': names no reward_model stage"):
    config_lib.validate(_get('tiny', f'drop=rm+rlhf,root={root}'))
  config_lib.validate(_get('tiny_mopd', f'drop=mopd,root={root}'))
  with pytest.raises(ValueError, match=r"drop=rlhf\+nope: no stage named 'nope'"):
    _get('tiny', f'drop=rlhf+nope,root={root}')
  with pytest.raises(ValueError, match="order='cascade3': expected one of"):
    _get('tiny', f'order=cascade3,root={root}')
  with pytest.raises(ValueError, match='has Cascade 2.s order already'):
    _get('tiny_mopd', f'order=cascade2,root={root}')
  with pytest.raises(ValueError, match="eval_every='x'"):
    _get('tiny', f'eval_every=x,root={root}')
  c = _get('tiny', f'eval_every=5,root={root}')
  assert c.eval.eval_every == 5 and all(d.get('validation') for d in c.domains.values())


@pytest.mark.parametrize('name', CONFIGS)
@pytest.mark.parametrize('smoke', [False, True])
def test_model_hybrid_argument_gives_a_hybrid_policy(name, smoke, root):
  """`model=hybrid` (docs/science.md: the cascade on a hybrid model) swaps in a Nemotron-H-like tiny
  policy with Mamba, MoE and attention layers; the stages are the dense config's."""
  arg = f'{"smoke," if smoke else ""}root={root}'
  dense = config_lib.validate(_get(name, arg))
  hybrid = config_lib.validate(_get(name, f'model=hybrid,{arg}'))
  m = hybrid.model
  assert m.family == 'nemotron_h' and {'mamba', 'moe', 'attention'} <= set(m.layer_types)
  assert m.vocab_size == dense.model.vocab_size and m.embed_dim == dense.model.embed_dim
  assert [s.name for s in hybrid.stages] == [s.name for s in dense.stages]
  with pytest.raises(ValueError, match="model='moe2': expected one of"):
    _get(name, f'model=moe2,{arg}')


@pytest.mark.parametrize('name', CONFIGS)
@pytest.mark.parametrize('smoke', [False, True])
def test_fast_path_argument_puts_the_rl_stages_on_the_paged_engine(name, smoke, root):
  """`fast_path` (docs/benchmarks/fast_path_tiny.md) applies the recipes' rollout fast path with
  the tiny world's page and chunk sizes: the paged engine, and every GRPO stage filters while it
  samples and packs rows of its prompt + longest response; the rest of the config is the plain
  one's (whose hashes tests/configs/test_config_hashes.py pins)."""
  arg = f'{"smoke," if smoke else ""}root={root}'
  plain_config, fast_config = _get(name, arg), _get(name, f'fast_path,{arg}')
  plain, fast = config_lib.validate(plain_config), config_lib.validate(fast_config)
  assert plain.sampler.engine is None and plain.sampler.page_size is None
  assert (fast.sampler.engine, fast.sampler.page_size, fast.sampler.chunk_steps) == (
      'paged', common.TINY_PAGED_ENGINE['page_size'], common.TINY_PAGED_ENGINE['chunk_steps'])
  # A tiny row (at most 96 + 48 tokens) spans a few pages, and a decode call is a fraction of
  # the shortest domain's response cap, so a freed slot refills within a response.
  assert fast.sampler.page_size * 4 <= common.MAX_PROMPT_LEN
  assert fast.sampler.chunk_steps * 4 <= min(common.RESPONSE_LEN.values())
  assert [s.name for s in fast.stages] == [s.name for s in plain.stages]
  rl = [s for s in fast.stages if s.kind == 'grpo']
  assert rl
  for st in rl:
    assert st.stream_filter is True
    assert st.pack_tokens == st.max_prompt_len + st.longest_response
  for st in fast.stages:
    if st.kind != 'grpo':
      assert getattr(st, 'pack_tokens', None) is None, st.name
  for st in plain.stages:
    assert not getattr(st, 'stream_filter', False) and not getattr(st, 'pack_tokens', None)
  # Only the sampler and the RL stages' two fields differ from the plain config.
  strip = lambda c: [{k: v for k, v in dict(s).items() if k not in ('stream_filter', 'pack_tokens')}
                     for s in c.stages]
  assert strip(fast_config) == strip(plain_config)
  same = lambda c: {k: v for k, v in c.to_dict().items() if k not in ('stages', 'sampler')}
  assert same(fast_config) == same(plain_config)
  with pytest.raises(ValueError, match="config argument 'fast_path=1'"):
    _get(name, f'fast_path=1,{arg}')


@pytest.mark.parametrize('smoke', [False, True])
def test_guard_argument_protects_every_domain_and_only_adds_its_section(smoke, root):
  """`guard=warn|stop|repair` (cascade/guard.py) gives every domain a validation set and a guard on it;
  without the argument there is no guard section (the pinned hashes are the plain config's)."""
  arg = f'{"smoke," if smoke else ""}root={root}'
  plain = config_lib.validate(_get('tiny', arg))
  for action in common.GUARD_ACTIONS:
    plan = config_lib.validate(_get('tiny', f'guard={action},{arg}'))
    assert plan.guard.action == action and plan.guard.domains == tuple(common.DOMAINS)
    assert plan.guard.every == (1 if smoke else common.GUARD_EVERY)
    assert all(plan.domains[d].validation for d in common.DOMAINS)
    names = [s.name for s in plan.stages]
    if action != 'repair':
      assert names == [s.name for s in plain.stages]
      continue
    # A repair stage after every RL stage (each has domains an earlier stage trained).
    want = [n for s in plain.stages
            for n in ([s.name, f'{s.name}_repair'] if s.kind == 'grpo' else [s.name])]
    assert names == want
    repair = plan.stage('math_rl_repair')
    assert repair.kind == 'mopd' and repair.repairs == 'math_rl'
    assert set(repair.domains) == set(common.DOMAINS) and repair.domains[-1] == 'math'
    assert repair.steps == (2 if smoke else common.REPAIR_STEPS)
  assert plain.guard is None and 'guard' not in plain.source
  with pytest.raises(ValueError, match="guard='pray': expected one of"):
    _get('tiny', f'guard=pray,{arg}')
