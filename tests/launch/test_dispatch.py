"""`launch.plan --compare_dispatch` (launch/plan/dispatch.py): which expert dispatch is cheaper
with 10 % of memory free, per stage and over a config's stages weighted by their steps; the
tables it prints; the expert shards it needs. The heavy test compiles both dispatches of a
tiny hybrid on 8 simulated devices."""

import dataclasses
import importlib.util
import pathlib

import jax
import numpy as np
import pytest

from cascade import config as config_lib
from launch.plan import collectives
from launch.plan import dispatch
from launch.plan import results
from launch.plan import targets
from models import config as model_config
from models import sharding

GIB = 2 ** 30


def _stage(total_gib: float, collective_update: float, *, limit_gib: float = 10.0,
           resident_gib: float = 0.0, update: float = 3.0, error: str = '', found=()):
  """A one-program stage: a train step of `total_gib` per device (plus `resident_gib` beside
  it) whose collectives take `collective_update` s per step."""
  p = results.ProgramReport('train step', '8 rows', argument_bytes=int(total_gib * GIB),
                            error=error, collectives=tuple(found),
                            collective_s=collective_update)
  return results.StageReport(0, 'math_rl', 'grpo', (p,), int(limit_gib * GIB), 64,
                             resident=(('train step', int(resident_gib * GIB)),),
                             time=results.StepTime(update=update,
                                                   collective_update=collective_update),
                             steps=100)


def test_the_cheaper_dispatch_has_fewer_collective_seconds_and_fits_with_headroom():
  # Serial bound: 3 s of update + its collectives.
  reports = {'gather': _stage(5.0, 4.0), 'all_to_all': _stage(5.0, 1.0)}
  assert dispatch.stage_seconds(reports['gather']) == 7.0
  assert dispatch.cheaper(reports, 'gather') == 'all_to_all'
  # 8.5 + 0.6 resident = 9.1 GiB of 10: fits, but with less than 10 % free.
  reports['all_to_all'] = _stage(8.5, 1.0, resident_gib=0.6)
  assert not dispatch.fits_with_headroom(reports['all_to_all'])
  assert dispatch.fits_with_headroom(reports['all_to_all'], headroom=0.05)
  assert dispatch.cheaper(reports, 'gather') == 'gather'
  assert dispatch.cheaper(reports, 'gather', headroom=0.05) == 'all_to_all'
  # Exactly 90 % is within the headroom; a program that does not compile never is.
  assert dispatch.fits_with_headroom(_stage(9.0, 1.0))
  assert not dispatch.fits_with_headroom(_stage(1.0, 1.0, error='RESOURCE_EXHAUSTED'))
  # Neither fits: no choice; a tie keeps the config's current dispatch.
  assert dispatch.cheaper({'gather': _stage(9.5, 1.0), 'all_to_all': _stage(9.5, 0.5)},
                          'gather') is None
  tie = {'gather': _stage(5.0, 1.0), 'all_to_all': _stage(5.0, 1.0)}
  assert dispatch.cheaper(tie, 'gather') == 'gather'
  assert dispatch.cheaper(tie, 'all_to_all') == 'all_to_all'
  # Collectives hidden behind a longer update: the overlapped bound ties, the serial one does not.
  hidden = {'gather': _stage(5.0, 2.0), 'all_to_all': _stage(5.0, 1.0)}
  assert hidden['gather'].time.bound == hidden['all_to_all'].time.bound == 3.0
  assert dispatch.cheaper(hidden, 'gather') == 'all_to_all'


def test_the_configs_dispatch_weights_stages_by_steps_and_fits_everywhere():
  long = dispatch.Comparison('code_rl', 100, {'gather': _stage(5.0, 2.0),
                                              'all_to_all': _stage(5.0, 1.0)})
  short = dispatch.Comparison('sft', 5, {'gather': _stage(5.0, 1.0),
                                         'all_to_all': _stage(5.0, 11.0)})
  # all_to_all: 100 x 4 + 5 x 14 = 470 s; gather: 100 x 5 + 5 x 4 = 520 s.
  assert dispatch.choose([long, short], 'gather') == 'all_to_all'
  assert dispatch.choose([long, dataclasses.replace(short, steps=10)], 'gather') == 'gather'
  # A dispatch that lacks the headroom in one stage is out everywhere.
  tight = dispatch.Comparison('mopd', 1, {'gather': _stage(5.0, 1.0),
                                          'all_to_all': _stage(9.5, 0.0)})
  assert dispatch.choose([long, tight], 'gather') == 'gather'
  assert dispatch.choose([], 'gather') is None
  assert 'cheaper dispatch over the compared stages: all_to_all' in dispatch.summary(
      [long, short], 'gather')
  assert 'no dispatch fits' in dispatch.summary(
      [dispatch.Comparison('x', 1, {'gather': _stage(9.9, 0.0), 'all_to_all': _stage(9.9, 0.0)})],
      'gather')


def test_the_tables_show_memory_collective_bytes_and_the_cheaper_dispatch():
  # An all-gather of a 1 MiB buffer over 4 devices: 3/4 MiB sent per device, twice per call.
  gathered = collectives.Collective('all-gather', 'ag', 2 ** 20, ((0, 1, 2, 3),), count=2)
  exchanged = collectives.Collective('all-to-all', 'a2a', 2 ** 20, ((0, 1, 2, 3),), count=1,
                                     loop='while.1')
  c = dispatch.Comparison('math_rl', 100, {
      'gather': _stage(5.0, 2.0, found=[gathered]),
      'all_to_all': _stage(5.0, 1.0, found=[exchanged])})
  lines = dispatch.table([c], 'gather')
  assert '| math_rl | train step | gather | 5.00 | 50 % | 1.50 MiB (0 B) | 2 (0) |' in lines
  assert '| math_rl | train step | all_to_all | 5.00 | 50 % | 0 B (768.00 KiB) | 1 (0) |' in lines
  assert '| math_rl | 100 | all_to_all | yes | 1 | 3 | 4 | **yes** |' in lines
  assert '| math_rl | 100 | gather | yes | 2 | 3 | 5 |  |' in lines


def test_expert_shards_are_those_the_experts_split_over():
  devices = jax.devices()[:8]
  mesh = sharding.make_mesh((1, 2, 2, 2), devices=devices)
  hybrid = model_config.ModelConfig.tiny_hybrid()
  assert dispatch.expert_shards(hybrid, mesh, sharding.DEFAULT_RULES) == 2
  assert dispatch.expert_shards(model_config.ModelConfig.tiny(), mesh,
                                sharding.DEFAULT_RULES) == 0
  one = sharding.make_mesh((2, 2, 1, 2), devices=devices)
  assert dispatch.expert_shards(hybrid, one, sharding.DEFAULT_RULES) == 1


def _hybrid_plan(tmp_path):
  """The tiny hybrid plan config of tests/launch/test_plan.py (an expert axis of 2)."""
  here = pathlib.Path(__file__).parent
  spec = importlib.util.spec_from_file_location('plan_tests', here / 'test_plan.py')
  tests = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tests)
  path = tmp_path / 'hybrid_config.py'
  path.write_text(tests.HYBRID_CONFIG)
  spec = importlib.util.spec_from_file_location('hybrid_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return config_lib.validate(module.get_config())


def test_a_model_without_split_experts_is_refused_in_one_line(tmp_path):
  p = _hybrid_plan(tmp_path)
  dense = dataclasses.replace(p, model=model_config.ModelConfig.tiny())
  with pytest.raises(ValueError, match=r'--compare_dispatch: model .* has no routed experts'):
    dispatch.compare(dense, targets.target(dense, 'cpu'))
  # Its experts on one shard (no expert axis): both dispatches are the same program.
  one = dataclasses.replace(p, mesh_shape=(2, 2, 1, 2))
  with pytest.raises(ValueError, match=r'8 experts on 1 expert shard'):
    dispatch.compare(one, targets.target(one, 'cpu'))


@pytest.mark.heavy
def test_both_dispatches_compile_and_move_what_they_should(tmp_path):
  """The tiny hybrid's GRPO train step and sampler, once per dispatch on 8 simulated devices:
  'gather' all-gathers the expert group's tokens, 'all_to_all' exchanges them (XLA:CPU: the
  padded all_to_all); both fit, and a dispatch is chosen."""
  p = _hybrid_plan(tmp_path)
  [c] = dispatch.compare(p, targets.target(p, 'cpu'), stages=['add_rl'])
  assert set(c.reports) == set(model_config.MOE_DISPATCH)
  train = {d: next(q for q in r.programs if q.name == 'train step')
           for d, r in c.reports.items()}
  sent = {d: collectives.by_kind(q.collectives) for d, q in train.items()}
  # The exchange sends its pairs all-to-all; the gather path all-gathers the group's tokens.
  assert sent['all_to_all'].get('all-to-all', 0) > sent['gather'].get('all-to-all', 0)
  assert sent['gather'].get('all-gather', 0) > 0
  for r in c.reports.values():
    assert [q.name for q in r.programs][:2] == ['train step', 'sampler']
    assert all(not q.error for q in r.programs) and r.fits
  assert dispatch.choose([c], p.model.moe_dispatch) in model_config.MOE_DISPATCH
  assert np.isfinite(dispatch.stage_seconds(c.reports['gather']))
