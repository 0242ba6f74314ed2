"""The per-stage target check of benchmarks/cascade_vs_blended.py on hand-made results."""

import math

from benchmarks import cascade_vs_blended


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
