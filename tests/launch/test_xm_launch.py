"""launch/xm_launch.py without XManager installed: its module runs against a recording stand-in
for the `xmanager` package (one job per sweep point, each with its own workdir and overrides);
the real package, where installed, is checked in test_hyper.py."""

import importlib
import sys
import types

import pytest


class _Recorder:
  def __init__(self):
    self.jobs, self.packaged, self.titles = [], [], []


def _fake_xmanager(rec):
  xm = types.ModuleType('xmanager.xm')
  xm.ModuleName = lambda name: ('module', name)
  xm.python_container = lambda **kw: ('container', kw)
  xm.Job = lambda **kw: kw
  xm.JobRequirements = lambda **kw: ('requirements', kw)
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


def _flags(**kw):
  return types.SimpleNamespace(**{**dict(config=None, workdir_root=None, executor='local',
                                         accelerator=None, accelerator_count=1,
                                         base_image='python:3.11', title=None), **kw})


def test_job_args_are_cascade_main_arguments(xm_launch):
  mod, _ = xm_launch
  assert mod.job_args('configs/tiny.py', 'w/000', {'seed': 1, 'stages[1].steps': 5}) == [
      '--config=configs/tiny.py', '--workdir=w/000', '--config.seed=1',
      '--config.stages[1].steps=5']


def test_one_job_per_sweep_point(xm_launch, monkeypatch, tmp_path):
  mod, rec = xm_launch
  cfg = tmp_path / 'c.py'
  cfg.write_text('def get_config(arg=None):\n  return None\n'
                 'def get_hyper(h):\n  return h.product([h.sweep("seed", [0, 1])])\n')
  monkeypatch.setattr(mod, 'FLAGS', _flags(config=f'{cfg}:x', workdir_root='gs://b/runs',
                                           executor='vertex', accelerator='tpu_v5p',
                                           accelerator_count=64))
  mod.main([])
  assert rec.titles == ['c.py']
  [(kind, container)] = rec.packaged
  assert kind == 'container' and container['entrypoint'] == ('module', 'cascade.main')
  assert container['executor_spec'] == 'vertex-spec'
  assert [j['args'] for j in rec.jobs] == [
      [f'--config={cfg}:x', '--workdir=gs://b/runs/000_seed=0', '--config.seed=0'],
      [f'--config={cfg}:x', '--workdir=gs://b/runs/001_seed=1', '--config.seed=1']]
  assert rec.jobs[0]['executor'].requirements == ('requirements', {'tpu_v5p': 64})


def test_a_config_without_a_sweep_is_one_local_job(xm_launch, monkeypatch, tmp_path):
  mod, rec = xm_launch
  cfg = tmp_path / 'plain.py'
  cfg.write_text('def get_config(arg=None):\n  return None\n')
  monkeypatch.setattr(mod, 'FLAGS', _flags(config=str(cfg), workdir_root='runs', title='t'))
  mod.main([])
  assert rec.titles == ['t'] and len(rec.jobs) == 1
  assert rec.jobs[0]['args'] == [f'--config={cfg}', '--workdir=runs/000_default']
  assert rec.packaged[0][1]['executor_spec'] == 'local-spec'


def test_missing_flags_are_a_usage_error(xm_launch, monkeypatch):
  mod, _ = xm_launch
  from absl import app  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(mod, 'FLAGS', _flags(config='c.py'))
  with pytest.raises(app.UsageError, match='--workdir_root are required'):
    mod.main([])
