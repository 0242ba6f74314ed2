"""benchmarks/cascade_vs_blended.py: the per-stage target check on hand-made results, and the
world pre-build through the configs' `prepare` step."""

import math

from absl import flags
from absl.testing import flagsaver

from benchmarks import cascade_vs_blended
from cascade.tiny_world import build as world_build
from cascade.tiny_world import world


def _res(scores):
  return {'domains': ['a', 'b', 'c'], 'stages': ['sft', 'a_rl', 'b_rl'],
          'stage_domains': [['a', 'b', 'c'], ['a'], ['b']], 'scores': scores}


def test_gains_and_drops_are_per_row_and_per_trained_domain():
  res = _res([[10, 20, 30], [25, 16, 31], [24, 40, 26]])
  gain, drop, where = cascade_vs_blended.stage_checks(res)
  assert gain == 15                                  # a_rl +15 on a; b_rl +24 on b
  assert drop == 5 and where == 'b_rl: c'            # 31 -> 26 (b 20 -> 16 is 4)


def test_no_drop_and_no_rl_rows():
  gain, drop, where = cascade_vs_blended.stage_checks(_res([[1, 1, 1], [3, 1, 2], [3, 4, 2]]))
  assert (gain, drop, where) == (2, 0.0, '')
  only_sft = {'domains': ['a'], 'stages': ['sft'], 'stage_domains': [['a']], 'scores': [[5]]}
  assert math.isnan(cascade_vs_blended.stage_checks(only_sft)[0])


def test_prepare_builds_each_configs_world_once(tmp_path, monkeypatch):
  monkeypatch.setattr(world_build, 'SIZES', dict(
      sft=dict.fromkeys(world_build.DOMAINS, 10), rl=5, heldout=4, preference=10,
      preference_heldout=2))
  writes = []
  real_write = world.write
  monkeypatch.setattr(world, 'write', lambda *a, **k: writes.append(a) or real_write(*a, **k))
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(config_arg=f'smoke,root={tmp_path}'):
    dirs = {c: cascade_vs_blended.prepare(c, 5) for c in cascade_vs_blended.CONFIGS}
  assert set(dirs.values()) == {str(tmp_path / 'seed5')}
  assert len(writes) == 1                            # the second config reused the world
  assert (tmp_path / 'seed5' / 'sft_mixed.jsonl').stat().st_size > 0
