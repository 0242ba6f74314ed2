"""The tiny-world configs validate, and the blended baseline is the cascade's like-for-like."""

import importlib

import pytest

from cascade import config as config_lib

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


def test_blended_spends_the_cascades_rollouts(root):
  cascade = _get('tiny', f'root={root}')
  blended = _get('tiny_blended', f'root={root}')
  rl = [s for s in cascade.stages if s['kind'] == 'grpo']
  (one,) = [s for s in blended.stages if s['kind'] == 'grpo']
  rollouts = lambda s: s['steps'] * s['prompts_per_step'] * s['group_size']
  per_step = one['prompts_per_step'] * one['group_size']
  assert abs(rollouts(one) - sum(rollouts(s) for s in rl)) <= per_step / 2
  assert sorted(one['domains']) == sorted(d for s in rl for d in s['domains'])
  # Same SFT and reward model; same sampling settings.
  head = lambda c: [dict(s) for s in c.stages if s['kind'] != 'grpo']
  assert head(blended) == head(cascade)
  for key in ('temperature', 'group_size', 'thinking_fraction'):
    assert {s[key] for s in rl} == {one[key]}, key
  assert one['filter_overlong'] == any(s['filter_overlong'] for s in rl)
