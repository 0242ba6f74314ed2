"""A finished stage whose final checkpoint is damaged: later stages start from its HF export."""

import importlib.util
import os

import pytest

from cascade import checkpoint
from cascade import runner


def _load(path):
  spec = importlib.util.spec_from_file_location('cfg', path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def _damage(step_dir):
  for root, _, files in os.walk(step_dir):
    for f in files:
      with open(os.path.join(root, f), 'r+b') as fh:
        fh.truncate(0)


@pytest.mark.slow
def test_damaged_final_checkpoint_falls_back_to_the_stage_export(tmp_path, copy_cascade, capsys):
  path = copy_cascade(tmp_path, train=16, eval_=8, sft=32, sft_steps=3, rl_steps=2)
  c = _load(path)
  rl_stage = c.stages[1]
  c.stages = [c.stages[0]]
  work = tmp_path / 'run'
  runner.run(c, str(work))
  sft_dir = work / 'stages' / '00_sft'
  assert (sft_dir / 'hf').is_dir()
  _damage(sft_dir / 'ckpt' / '3')
  c.stages = [c.stages[0], rl_stage]
  c.allow_config_change = True
  res = runner.run(c, str(work))                  # the RL stage starts from sft's policy
  assert res['stages'] == ['sft', 'copy_rl']
  out = capsys.readouterr().out
  assert "the final checkpoint of stage 'sft' cannot be restored" in out
  assert str(sft_dir / 'hf') in out


@pytest.mark.slow
def test_damaged_final_checkpoint_without_an_export_is_one_clear_error(tmp_path, copy_cascade):
  path = copy_cascade(tmp_path, train=16, eval_=8, sft=32, sft_steps=3, rl_steps=2)
  c = _load(path)
  rl_stage = c.stages[1]
  c.stages = [c.stages[0]]
  work = tmp_path / 'run'
  runner.run(c, str(work))
  sft_dir = work / 'stages' / '00_sft'
  _damage(sft_dir / 'ckpt' / '3')
  for root, dirs, files in os.walk(sft_dir / 'hf', topdown=False):
    for f in files:
      os.remove(os.path.join(root, f))
    os.rmdir(root)
  c.stages = [c.stages[0], rl_stage]
  c.allow_config_change = True
  with pytest.raises(checkpoint.CheckpointError, match=r"00_sft/ckpt/3: the final checkpoint "
                                                       r"of stage 'sft' cannot be restored"):
    runner.run(c, str(work))
