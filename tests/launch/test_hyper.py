"""Sweep expansion (h.sweep / h.product / h.zipit) and the sweep runner's plumbing."""

import json
import os

import pytest

from launch import hyper
from launch import sweep


def test_product_zip_and_names():
  pts = hyper.product([hyper.sweep('seed', [0, 1]),
                       hyper.zipit([hyper.sweep('stages[1].lr', [1e-3, 2e-3]),
                                    hyper.sweep('stages[1].steps', [10, 20])])])
  assert pts == [{'seed': 0, 'stages[1].lr': 1e-3, 'stages[1].steps': 10},
                 {'seed': 0, 'stages[1].lr': 2e-3, 'stages[1].steps': 20},
                 {'seed': 1, 'stages[1].lr': 1e-3, 'stages[1].steps': 10},
                 {'seed': 1, 'stages[1].lr': 2e-3, 'stages[1].steps': 20}]
  assert hyper.point_name(pts[1]) == 'seed=0,lr=0.002,steps=20'
  assert hyper.format_override('stages[1].lr', 0.5) == '--config.stages[1].lr=0.5'
  assert hyper.format_override('eval.greedy', True) == '--config.eval.greedy=True'
  with pytest.raises(ValueError, match='different lengths'):
    hyper.zipit([hyper.sweep('a', [1]), hyper.sweep('b', [1, 2])])
  with pytest.raises(ValueError, match='more than one sweep'):
    hyper.product([hyper.sweep('a', [1]), hyper.sweep('a', [2])])
  with pytest.raises(ValueError, match='no values'):
    hyper.sweep('a', [])


def test_load_points_and_summary(tmp_path):
  cfg = tmp_path / 'c.py'
  cfg.write_text('def get_config(arg=None):\n  return None\n'
                 'def get_hyper(h):\n  return h.product([h.sweep("seed", [0, 1])])\n')
  pts = sweep.load_points(f'{cfg}:arg')
  assert pts == [{'seed': 0}, {'seed': 1}]
  cmd = sweep.point_command(f'{cfg}:arg', 'w', pts[1])
  assert cmd[-1] == '--config.seed=1' and '--workdir=w' in cmd
  names = ['000_seed=0', '001_seed=1']
  os.makedirs(tmp_path / names[0])
  (tmp_path / names[0] / 'results.json').write_text(json.dumps(
      {'domains': ['math', 'code'], 'stages': ['sft', 'rl'], 'stage_domains': [[], ['math']],
       'scores': [[10.0, 5.0], [30.0, 6.0]]}))
  summary = sweep.summarise(str(tmp_path), names, pts, [0, 1])
  assert summary['points'][0]['final'] == {'math': 30.0, 'code': 6.0}
  assert summary['points'][1]['final'] is None
  md = (tmp_path / 'summary.md').read_text()
  assert '| 000_seed=0 | 30.0 | 6.0 | 18.0 | ok |' in md and 'exit 1' in md
  bad = tmp_path / 'b.py'
  bad.write_text('def get_config(arg=None):\n  return None\n')
  with pytest.raises(ValueError, match='no get_hyper'):
    sweep.load_points(str(bad))


def test_xm_launch_imports_where_xmanager_is_installed():
  pytest.importorskip('xmanager')
  from launch import xm_launch
  args = xm_launch.job_args('configs/tiny.py', 'w/000', {'seed': 1})
  assert args == ['--config=configs/tiny.py', '--workdir=w/000', '--config.seed=1']
