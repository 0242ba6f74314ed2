"""The config walk from `cascade.main`: the run (`cascade.runner.run`, what cascade.main calls)
hands the ConfigDict to the config modules once, and they read it once.

Traced while the run goes from the ConfigDict to the `Plan` (it stops where the stages would
start): every call into cascade/config.py or cascade/schema.py from a module outside the
config's own (those two, the stage kinds' typed configs in cascade/kinds/, and the check
vocabulary rl/fields.py that calls each field's check), and every call of a ConfigDict method
from outside ml_collections. The one of each: `config.validate`, called by the run, and the one
conversion of the ConfigDict to plain data (`schema.as_dict` -> `ConfigDict.to_dict`).
"""

import os
import sys

import pytest
from ml_collections.config_dict import config_dict

from cascade import config as config_lib
from cascade import kinds
from cascade import runner
from cascade import schema
from configs import tiny
from rl import fields

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(config_lib.__file__)))
_CONFIG_MODULES = {os.path.abspath(config_lib.__file__), os.path.abspath(schema.__file__)}
_KINDS = os.path.dirname(os.path.abspath(kinds.__file__)) + os.sep
_OWN = _CONFIG_MODULES | {os.path.abspath(fields.__file__)}
_CONFIG_DICT = os.path.abspath(config_dict.__file__)


class _Planned(Exception):
  """Raised where the run would start its stages: the walk is over."""


def _own(filename: str) -> bool:
  return filename in _OWN or filename.startswith(_KINDS)


class _Walk:
  """A `sys.setprofile` function recording the calls the module docstring names."""

  def __init__(self):
    self.calls = []

  def __call__(self, frame, event, arg):
    del arg
    if event != 'call' or frame.f_back is None:
      return
    callee = os.path.abspath(frame.f_code.co_filename)
    caller = os.path.abspath(frame.f_back.f_code.co_filename)
    where = os.path.relpath(caller, _ROOT)
    if callee == _CONFIG_DICT and caller != _CONFIG_DICT:
      self.calls.append((f'ConfigDict.{frame.f_code.co_name}', where))
    elif callee in _CONFIG_MODULES and not _own(caller):
      self.calls.append((frame.f_code.co_name, where))


def _planned(plan, *args, **kwargs):
  del args, kwargs
  raise _Planned(plan)


def test_the_run_enters_the_config_modules_once_and_reads_the_configdict_once(
    tmp_path, monkeypatch):
  config = tiny.get_config('smoke,root=/nowhere')
  monkeypatch.setattr(runner, '_run', _planned)
  walk = _Walk()
  sys.setprofile(walk)
  try:
    with pytest.raises(_Planned) as planned:
      runner.run(config, str(tmp_path / 'run'))
  finally:
    sys.setprofile(None)
  assert walk.calls == [('validate', os.path.join('cascade', 'runner.py')),
                        ('ConfigDict.to_dict', os.path.join('cascade', 'schema.py'))]
  plan = planned.value.args[0]
  assert isinstance(plan, config_lib.Plan) and plan.source == config.to_dict()
