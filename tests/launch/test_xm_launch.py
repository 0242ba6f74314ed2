"""launch/xm_launch.py without XManager installed: the job specs are plain data (one job per sweep
point, its own workdir and overrides, the machine from config.hardware: a multi-host TPU slice
runs one process per host with CASCADE_DISTRIBUTED=auto), and `main` runs against a recording
stand-in for the `xmanager` package; the real package, where installed, is checked in
test_hyper.py."""

import ast
import importlib
import json
import os
import re
import sys
import types

from launch import hyper

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest


class _Recorder:
  def __init__(self):
    self.jobs, self.packaged, self.titles = [], [], []


def _fake_xmanager(rec):
  xm = types.ModuleType('xmanager.xm')
  xm.ModuleName = lambda name: ('module', name)
  xm.dockerfile_container = lambda **kw: ('dockerfile', kw)
  xm.Job = lambda **kw: kw
  xm.JobRequirements = lambda **kw: ('requirements', kw)
  xm.Topology = lambda name: ('topology', name)
  xm_local = types.ModuleType('xmanager.xm_local')

  class Local:
    Spec = staticmethod(lambda: 'local-spec')

  class Vertex:
    Spec = staticmethod(lambda: 'vertex-spec')

    def __init__(self, requirements):
      self.requirements = requirements

  class Experiment:
    def __enter__(self):
      return self

    def __exit__(self, *exc):
      return False

    def package(self, packageables):
      rec.packaged += packageables
      return ['executable']

    def add(self, job):
      rec.jobs.append(job)

  def create_experiment(experiment_title):
    rec.titles.append(experiment_title)
    return Experiment()

  xm_local.Local, xm_local.Vertex, xm_local.create_experiment = Local, Vertex, create_experiment
  pkg = types.ModuleType('xmanager')
  pkg.xm, pkg.xm_local = xm, xm_local
  return {'xmanager': pkg, 'xmanager.xm': xm, 'xmanager.xm_local': xm_local}


@pytest.fixture
def xm_launch(monkeypatch):
  rec = _Recorder()
  for name, mod in _fake_xmanager(rec).items():
    monkeypatch.setitem(sys.modules, name, mod)
  monkeypatch.delitem(sys.modules, 'launch.xm_launch', raising=False)
  mod = importlib.import_module('launch.xm_launch')
  yield mod, rec
  sys.modules.pop('launch.xm_launch', None)


def _main(mod, monkeypatch, *args):
  """`xmanager launch launch/xm_launch.py -- <args>`: its flags parsed as the script parses them
  (cascade.overrides' parser: a bad override exits 2 with one line), then `main`."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from cascade import overrides  # pylint: disable=g-import-not-at-top
  argv = ['launch/xm_launch.py', *args]
  fv = flags.FlagValues()
  rest = overrides.flags_parser(mod.define_flags(fv, argv=argv))(argv)
  monkeypatch.setattr(sys, 'argv', argv)
  mod.main(rest, fv)


def test_importing_needs_no_xmanager(monkeypatch):
  monkeypatch.setitem(sys.modules, 'xmanager', None)      # `import xmanager` would now fail
  monkeypatch.delitem(sys.modules, 'launch.xm_launch', raising=False)
  mod = importlib.import_module('launch.xm_launch')
  sys.modules.pop('launch.xm_launch', None)
  assert mod.machine(None).hosts == 1


def test_the_machine_comes_from_config_hardware():
  from launch import xm_launch  # pylint: disable=g-import-not-at-top
  from configs import nemotron_cascade_14b  # pylint: disable=g-import-not-at-top
  hw = dict(nemotron_cascade_14b.get_config().hardware)
  assert xm_launch.machine(hw) == xm_launch.Machine(accelerator='tpu_v5p', topology='4x4x4',
                                                    chips=64, hosts=16)
  assert xm_launch.machine({'platform': 'tpu', 'topology': 'v4:2x2x1'}).hosts == 1
  assert xm_launch.machine({'platform': 'tpu', 'topology': 'v5e:2x4'}).hosts == 1
  assert xm_launch.machine({'platform': 'tpu', 'topology': 'v5e:4x4'}).hosts == 4
  assert xm_launch.machine({'platform': 'tpu', 'topology': 'v5p:2x2x2'},
                           accelerator='tpu_v5').accelerator == 'tpu_v5'
  assert xm_launch.machine(None) == xm_launch.Machine()
  with pytest.raises(ValueError, match='v5p:4x4x4'):
    xm_launch.machine({'platform': 'tpu', 'topology': '4x4x4'})


def test_a_paper_sweep_is_one_multi_host_job_per_point():
  from launch import sweep  # pylint: disable=g-import-not-at-top
  from launch import xm_launch  # pylint: disable=g-import-not-at-top
  from configs import nemotron_cascade_14b  # pylint: disable=g-import-not-at-top
  cfg = 'configs/nemotron_cascade_14b.py:data_root=gs://b/d'
  points = sweep.load_points(cfg)
  jobs = xm_launch.job_specs(cfg, 'gs://b/runs', points,
                             nemotron_cascade_14b.get_config().hardware)
  assert len(jobs) == len(points) == 12
  assert len({j.name for j in jobs}) == 12
  for job, point in zip(jobs, points):
    assert job.machine.hosts == 16 and job.machine.topology == '4x4x4'
    assert job.env == {'CASCADE_DISTRIBUTED': 'auto'}      # every host joins the one run
    assert job.args[:2] == (f'--config={cfg}', f'--workdir=gs://b/runs/{job.name}')
    assert list(job.args[2:]) == [f'--config.{k}={v}' for k, v in point.items()]
  # A config without hardware: one CPU process, no distributed start-up.
  [tiny] = xm_launch.job_specs('configs/tiny.py', 'runs', [{}])
  assert tiny.machine.hosts == 1 and tiny.env == {} and tiny.name == '000_default'


def test_job_args_are_cascade_main_arguments(xm_launch):
  mod, _ = xm_launch
  assert mod.job_args('configs/tiny.py', 'w/000', {'seed': 1, 'stages[1].steps': 5}) == [
      '--config=configs/tiny.py', '--workdir=w/000', '--config.seed=1',
      '--config.stages[1].steps=5']


def test_one_job_per_sweep_point(xm_launch, monkeypatch, tmp_path):
  mod, rec = xm_launch
  cfg = tmp_path / 'c.py'
  cfg.write_text('import ml_collections\n'
                 'def get_config(arg=None):\n'
                 '  return ml_collections.ConfigDict(dict(hardware=dict(platform="tpu", '
                 'topology="v5p:2x2x4")))\n'
                 'def get_hyper(h):\n  return h.product([h.sweep("seed", [0, 1])])\n')
  _main(mod, monkeypatch, f'--config={cfg}:x', '--workdir_root=gs://b/runs', '--executor=vertex')
  assert rec.titles == ['c.py']
  [(kind, container)] = rec.packaged
  assert kind == 'dockerfile' and container['executor_spec'] == 'vertex-spec'
  # The image is launch/Dockerfile's, built from the repository root wherever this runs.
  assert container['path'] == REPO and container['dockerfile'] == os.path.join(
      REPO, 'launch', 'Dockerfile')
  assert [j['args'] for j in rec.jobs] == [
      [f'--config={cfg}:x', '--workdir=gs://b/runs/000_seed=0', '--config.seed=0'],
      [f'--config={cfg}:x', '--workdir=gs://b/runs/001_seed=1', '--config.seed=1']]
  assert rec.jobs[0]['executor'].requirements == ('requirements',
                                                   {'tpu_v5p': ('topology', '2x2x4')})
  assert rec.jobs[0]['env_vars'] == {'CASCADE_DISTRIBUTED': 'auto'}     # 4 hosts of 4 chips


def test_a_config_without_a_sweep_is_one_local_job(xm_launch, monkeypatch, tmp_path):
  mod, rec = xm_launch
  cfg = tmp_path / 'plain.py'
  cfg.write_text('def get_config(arg=None):\n  return None\n')
  _main(mod, monkeypatch, f'--config={cfg}', '--workdir_root=runs', '--title=t')
  assert rec.titles == ['t'] and len(rec.jobs) == 1
  assert rec.jobs[0]['args'] == [f'--config={cfg}', '--workdir=runs/000_default']
  assert rec.jobs[0]['env_vars'] == {}
  assert rec.packaged[0][1]['executor_spec'] == 'local-spec'


def test_missing_flags_are_a_usage_error(xm_launch, monkeypatch):
  mod, _ = xm_launch
  from absl import app  # pylint: disable=g-import-not-at-top
  with pytest.raises(app.UsageError, match='--workdir_root are required'):
    _main(mod, monkeypatch, '--config=configs/tiny.py')


def test_the_command_lines_overrides_reach_every_job_and_its_machine(xm_launch, monkeypatch):
  # The module docstring's command: the overridden topology makes the machine (128 chips, 32
  # hosts), and every job runs the command line's overrides before its point's.
  mod, rec = xm_launch
  cfg = 'configs/nemotron_cascade_14b.py'
  _main(mod, monkeypatch, f'--config={cfg}', '--executor=vertex', '--workdir_root=gs://b/runs',
        '--config.hardware.topology=v5p:4x4x8', '--config.stages.math_rl.steps=200')
  assert len(rec.jobs) == 12
  given = ['--config.hardware.topology=v5p:4x4x8', '--config.stages.math_rl.steps=200']
  for job in rec.jobs:
    assert job['args'][:4] == [f'--config={cfg}', job['args'][1], *given]
    assert job['executor'].requirements == ('requirements', {'tpu_v5p': ('topology', '4x4x8')})
    assert job['env_vars'] == {'CASCADE_DISTRIBUTED': 'auto'}
  # The sweep's keys name stages by name (they stay with their stage under drop=).
  assert any(a.startswith(f'--config.{hyper.stage_path("math_rl")}.optimizer.lr=')
             for a in rec.jobs[0]['args'])


@pytest.mark.parametrize('arg,message', [
    ('--config.stages.math_rll.steps=2',
     "--config.stages.math_rll.steps: config.stages has no stage named 'math_rll' "
     '(nearest: math_rl)'),
    ('--config.seed=3', '--config.seed is set on the command line and swept by get_hyper'),
    ('--config.hardware.topoogy=v5p:4x4x8', "config.hardware has no field 'topoogy'"),
])
def test_a_bad_override_is_one_line_before_any_job(xm_launch, monkeypatch, capsys, arg, message):
  mod, rec = xm_launch
  with pytest.raises(SystemExit) as e:
    _main(mod, monkeypatch, '--config=configs/nemotron_cascade_14b.py', '--workdir_root=w', arg)
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith('error: ') and message in err
  assert err.count('\n') == 1 and rec.jobs == []


def _instructions(path):
  """A Dockerfile's instructions as (KEYWORD, text), comments dropped, continuations joined."""
  text = re.sub(r'\\\n', ' ', open(path).read())
  out = []
  for line in text.splitlines():
    line = line.strip()
    if line and not line.startswith('#'):
      word, _, rest = line.partition(' ')
      out.append((word, ' '.join(rest.split())))
  return out


def _extras():
  tree = ast.parse(open(os.path.join(REPO, 'setup.py')).read())
  call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
              and getattr(n.func, 'attr', '') == 'setup')
  return ast.literal_eval(next(k.value for k in call.keywords if k.arg == 'extras_require'))


def test_the_image_installs_cascade_with_its_tpu_extra_and_runs_cascade_main():
  steps = _instructions(os.path.join(REPO, 'launch', 'Dockerfile'))
  words = [w for w, _ in steps]
  known = {'FROM', 'RUN', 'COPY', 'WORKDIR', 'ENV', 'ENTRYPOINT', 'ARG', 'CMD', 'LABEL'}
  assert words[0] == 'FROM' and set(words) <= known, words
  runs = [t for w, t in steps if w == 'RUN']
  assert any('apt-get install' in r and 'bubblewrap' in r for r in runs)   # the sandbox
  # The whole context is copied, then installed with an extra setup.py declares: tpu.
  copy = steps.index(('COPY', '. .'))
  [install] = [t for t in runs if 'pip install' in t]
  assert steps.index(('RUN', install)) > copy
  extras = re.findall(r'"\.\[([a-z,]+)\]"', install)
  assert extras == ['tpu'] and 'tpu' in _extras() and any('jax[tpu]' in r
                                                         for r in _extras()['tpu'])
  # The entry point, in exec form, is cascade.main (each job appends its arguments).
  [entry] = [t for w, t in steps if w == 'ENTRYPOINT']
  assert json.loads(entry) == ['python', '-m', 'cascade.main']
  assert importlib.util.find_spec('cascade.main') is not None


def test_the_build_context_leaves_out_the_environment_and_keeps_the_package():
  ignored = [l.strip() for l in open(os.path.join(REPO, '.dockerignore'))
             if l.strip() and not l.startswith('#')]
  assert {'.git', '.venv', 'runs'} <= set(ignored)
  needed = ['setup.py', 'LICENSE', 'cascade/main.py', 'launch/Dockerfile', 'configs/tiny.py']
  import fnmatch  # pylint: disable=g-import-not-at-top
  for path in needed:
    assert os.path.exists(os.path.join(REPO, path))
    parts = path.split('/')
    prefixes = ['/'.join(parts[:i]) for i in range(1, len(parts) + 1)]
    assert not any(fnmatch.fnmatch(p, pat.replace('**/', '')) or fnmatch.fnmatch(p, pat)
                   for pat in ignored for p in prefixes), path
