"""The configs' sweeps and the local sweep runner's outputs.

Every point of tiny's and the paper configs' `get_hyper` is a valid config
(its overrides applied as `--config.<key>=<value>` would apply them), the
summary writer's table and plot hold each point's final matrix row, and
(slow) `python -m launch.sweep` runs two points of the smoke config end to
end: about 2 x 2.5 min of CPU, over the default suite's budget.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest
from ml_collections.config_flags import config_path

from cascade import config as config_lib
from cascade import overrides
from launch import hyper
from launch import sweep

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {'tiny': 'smoke', 'nemotron_cascade_14b': 'data_root=gs://b/d',
           'nemotron_cascade_8b': 'data_root=gs://b/d', 'nemotron_cascade2': 'data_root=gs://b/d'}


def _apply(config, point):
  """The config `--config.<key>=<value>` of every entry of `point` would run (stages by name)."""
  overrides.prepare(config, list(point))
  for key, value in point.items():
    config_path.set_value(key, config, value)
  overrides.finish(config)
  return config


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_every_sweep_point_is_a_valid_config(name):
  module = importlib.import_module(f'configs.{name}')
  points = sweep.load_points(os.path.join(REPO, 'configs', f'{name}.py'))
  assert len(points) == 12
  names = [hyper.point_name(p) for p in points]
  assert len(set(names)) == len(names)                         # one workdir per point
  base = module.get_config(CONFIGS[name])
  rl = [i for i, st in enumerate(base.stages) if st['kind'] == 'grpo']
  seen = {'seed': set(), 'lr': set(), 'group_size': set()}
  for point in points:
    plan = config_lib.validate(_apply(module.get_config(CONFIGS[name]), point))
    seen['seed'].add(plan.seed)
    seen['lr'].add(tuple(plan.stages[i].optimizer.lr for i in rl))
    seen['group_size'].add(tuple(plan.stages[i].group_size for i in rl))
    # Every RL stage moves together: its learning rate by one factor of its default.
    factors = {round(plan.stages[i].optimizer.lr / base.stages[i]['optimizer']['lr'], 6)
               for i in rl}
    assert len(factors) == 1 and factors <= {0.5, 1.0, 2.0}
  assert (len(seen['seed']), len(seen['lr']), len(seen['group_size'])) == (2, 3, 2)


def test_stages_sweeps_one_field_of_every_stage_of_a_kind():
  c = importlib.import_module('configs.tiny').get_config()
  pts = hyper.stages(c, 'optimizer.lr', lambda st: [st['optimizer']['lr'] * 2])
  # Stages by name: a name stays with its stage when drop= moves the positions.
  assert pts == [{'stages.rlhf.optimizer.lr': 1e-4, 'stages.if_rl.optimizer.lr': 1e-4,
                  'stages.math_rl.optimizer.lr': 8e-5, 'stages.code_rl.optimizer.lr': 8e-5,
                  'stages.swe_rl.optimizer.lr': 6e-5}]
  assert hyper.point_name(pts[0]) == 'lr=0.0001_8e-05_6e-05'
  assert hyper.stages(c, 'group_size', [4], kinds=('sft',)) == [{'stages.sft.group_size': 4}]
  c.stages[0]['name'] = 'warm-up'
  assert hyper.stages(c, 'steps', [4], kinds=('sft',)) == [{'stages["warm-up"].steps': 4}]
  with pytest.raises(ValueError, match='no stage of kind'):
    hyper.stages(c, 'group_size', [4], kinds=('mopd',))


def test_select_points():
  pts = [{'seed': i} for i in range(4)]
  assert sweep.select(pts, None) == [0, 1, 2, 3]
  assert sweep.select(pts, ['3', '1', '3']) == [1, 3]
  with pytest.raises(ValueError, match='out of range'):
    sweep.select(pts, ['4'])
  with pytest.raises(ValueError, match='expected indices'):
    sweep.select(pts, ['a'])


def _results(root, name, scores):
  os.makedirs(root / name)
  (root / name / 'results.json').write_text(json.dumps(
      {'domains': ['code', 'math'], 'stages': ['sft', 'rl'], 'stage_domains': [[], ['math']],
       'scores': scores}))


def test_summary_table_and_plot_hold_each_points_final_row(tmp_path):
  names = ['000_seed=0', '001_seed=1', '002_seed=2']
  _results(tmp_path, names[0], [[10.0, 5.0], [20.0, 70.0]])
  _results(tmp_path, names[1], [[10.0, 5.0], [30.0, None]])
  summary = sweep.summarise(str(tmp_path), names, [{'seed': i} for i in range(3)], [0, 0, 1])
  assert [p['final'] for p in summary['points']] == [{'code': 20.0, 'math': 70.0},
                                                      {'code': 30.0, 'math': None}, None]
  md = (tmp_path / 'summary.md').read_text().splitlines()
  assert md[0] == '| point | code | math | mean | status |'
  assert md[2:] == ['| 000_seed=0 | 20.0 | 70.0 | 45.0 | ok |',
                    '| 001_seed=1 | 30.0 | - | 30.0 | ok |',
                    '| 002_seed=2 | - | - | - | exit 1 |']
  assert json.loads((tmp_path / 'summary.json').read_text())['points'][2]['returncode'] == 1
  png = (tmp_path / 'summary.png').read_bytes()
  assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 5000
  assert not [p for p in os.listdir(tmp_path) if '.tmp.' in p]


@pytest.mark.slow
def test_sweep_runs_two_smoke_points_and_summarises(tmp_path):
  root = tmp_path / 'sweep'
  cmd = [sys.executable, '-m', 'launch.sweep', '--config=configs/tiny.py:smoke',
         f'--workdir_root={root}', '--points=0,11', '--parallel=2']
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  summary = json.loads((root / 'summary.json').read_text())
  assert [p['name'][:4] for p in summary['points']] == ['000_', '011_']
  assert all(p['returncode'] == 0 and p['final'] for p in summary['points'])
  assert summary['domains'] == ['chat', 'code', 'instruction_following', 'math', 'swe']
  assert summary['points'][1]['point']['seed'] == 1
  md = (root / 'summary.md').read_text()
  assert md.count('| ok |') == 2 and md in proc.stdout
  assert (root / 'summary.png').read_bytes()[:4] == b'\x89PNG'
  # Each point is a whole cascade in its own workdir, with the point's overrides.
  for p in summary['points']:
    res = json.loads((root / p['name'] / 'results.json').read_text())
    assert res['stages'][-1] == 'swe_rl'
    cfg = json.loads((root / p['name'] / 'config.json').read_text())['config']
    assert cfg['seed'] == p['point']['seed']
    assert cfg['stages'][4]['group_size'] == p['point']['stages.math_rl.group_size']


def test_the_command_lines_overrides_are_checked_and_passed_to_every_point(tmp_path):
  # The module docstring's command (with --points): the override reaches every point's
  # cascade.main before the point's own keys, which name the stages.
  proc = subprocess.run(
      [sys.executable, '-m', 'launch.sweep', '--config=configs/tiny.py:smoke',
       f'--workdir_root={tmp_path}', '--config.stages.math_rl.steps=10', '--dry_run',
       '--points=0,11'], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert len(lines) == 2 and not list(tmp_path.iterdir())      # a dry run writes nothing
  for line, seed in zip(lines, (0, 1)):
    args = line.split()
    assert args[1:5] == ['-m', 'cascade.main', '--config=configs/tiny.py:smoke',
                         args[4]] and args[4].startswith(f'--workdir={tmp_path}/')
    assert args[5:7] == ['--config.stages.math_rl.steps=10', f'--config.seed={seed}']
    assert '--config.stages.math_rl.group_size=' + ('4' if seed == 0 else '8') in args


@pytest.mark.parametrize('given,point,message', [
    ((), {'stages.math_rll.steps': 1},
     "get_hyper of configs/tiny.py:smoke: --config.stages.math_rll.steps: config.stages has "
     "no stage named 'math_rll' (nearest: math_rl)"),
    ((), {'sampler.slots': 8}, None),             # unset in the config, declared: an int
    ((), {'sampler.slotz': 8}, "config.sampler has no field 'slotz'"),
    (('--config.seed=2',), {'seed': 1},
     '--config.seed is set on the command line and swept by get_hyper: drop one'),
])
def test_point_keys_are_checked_once_before_any_point_runs(given, point, message):
  spec = 'configs/tiny.py:smoke'
  if message is None:
    sweep.check_points(spec, [point], given)
    return
  with pytest.raises(overrides.OverrideError) as e:
    sweep.check_points(spec, [{'seed': 0}, point], given)
  assert message in str(e.value) and '\n' not in str(e.value)


def test_a_swept_stage_that_a_config_argument_drops_is_refused():
  # tiny's get_hyper names the stages of the full cascade: with drop=rlhf the rlhf key is
  # refused in one line, where a position would have silently moved to the next stage.
  points = sweep.load_points('configs/tiny.py:smoke,drop=rlhf')
  with pytest.raises(overrides.OverrideError, match="no stage named 'rlhf'"):
    sweep.check_points('configs/tiny.py:smoke,drop=rlhf', points)


def test_a_points_command_line_parses_to_the_points_config():
  # Its cascade.main arguments through cascade.main's own --config parser (stages by name): the
  # point's values, the command line's override, nothing else moved.
  from absl import flags  # pylint: disable=g-import-not-at-top
  points = sweep.load_points('configs/tiny.py:smoke')
  cmd = sweep.point_command('configs/tiny.py:smoke', '/tmp/w', points[11],
                            given=['--config.stages.math_rl.steps=3'])
  argv = ['cascade.main', *cmd[3:]]
  fv = flags.FlagValues()
  flags.DEFINE_string('workdir', None, '', flag_values=fv)
  holder = overrides.define_config_file('config', '', flag_values=fv, argv=argv)
  fv(argv)
  overrides.finish(holder.value)
  plan = config_lib.validate(holder.value)
  base = config_lib.validate(importlib.import_module('configs.tiny').get_config('smoke'))
  assert plan.seed == 1
  for st, b in zip(plan.stages, base.stages):
    if st.kind == 'grpo':
      assert st.group_size == 8 and st.optimizer.lr == pytest.approx(2 * b.optimizer.lr)
    else:
      assert st == b
    assert st.steps == (3 if st.name == 'math_rl' else b.steps)
