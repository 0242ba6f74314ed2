"""What a finished run's workdir survives: damaged exports, garbled run-state files, a config change
allowed after the fact, a read-only disk. One toy run (SFT -> GRPO, a few steps) is made once;
each test damages a copy of it and runs the same config (or a changed one) again."""

import builtins
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from cascade import checkpoint
from cascade import runner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.heavy


def _load(path):
  spec = importlib.util.spec_from_file_location('cfg', path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def _sha(path):
  return hashlib.sha256(open(path, 'rb').read()).hexdigest()


@pytest.fixture(scope='module')
def finished(tmp_path_factory, copy_cascade):
  root = tmp_path_factory.mktemp('finished')
  path = copy_cascade(root, train=16, eval_=8, sft=32, sft_steps=3, rl_steps=2)
  work = root / 'run'
  res = runner.run(_load(path), str(work))
  return path, work, res


@pytest.fixture
def copy(finished, tmp_path):
  path, work, res = finished
  dst = tmp_path / 'run'
  shutil.copytree(work, dst)
  return path, dst, res


def _export(work, stage):
  return work / 'stages' / stage / 'hf' / 'model.safetensors'


def test_a_truncated_or_bit_flipped_export_of_a_finished_stage_is_noticed_and_redone(copy,
                                                                                      capsys):
  path, work, res = copy
  want = {s: _sha(_export(work, s)) for s in ('00_sft', '01_copy_rl')}
  with open(_export(work, '00_sft'), 'r+b') as f:
    f.truncate(os.path.getsize(_export(work, '00_sft')) // 2)
  with open(_export(work, '01_copy_rl'), 'r+b') as f:
    f.seek(-100, 2)
    f.write(b'\0' * 10)
  assert runner.run(_load(path), str(work))['scores'] == res['scores']
  out = capsys.readouterr().out
  for s, name in (('00_sft', 'sft'), ('01_copy_rl', 'copy_rl')):
    assert f"{work / 'stages' / s / 'hf'}: the HF export of stage {name!r} is damaged " \
           '(checksum mismatch: model.safetensors' in out
    assert _sha(_export(work, s)) == want[s]                  # exported again, the same bytes
    assert os.listdir(work / 'stages' / s / 'corrupt')[0].startswith('hf.')


def test_a_garbled_progress_json_is_rebuilt_from_the_checkpoints(copy, capsys):
  path, work, res = copy
  (work / 'progress.json').write_text('{"done": {"sft": {"ind')
  assert runner.run(_load(path), str(work))['scores'] == res['scores']
  assert f"{work / 'progress.json'} is damaged" in capsys.readouterr().out
  assert set(checkpoint.Progress(str(work)).done) == {'sft', 'copy_rl'}


def test_a_garbled_config_json_is_one_line_naming_it(copy):
  path, work, _ = copy
  (work / 'config.json').write_text('{"hash": ')
  proc = subprocess.run([sys.executable, '-m', 'cascade.main', f'--config={path}',
                         f'--workdir={work}'], cwd=REPO, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f'error: {work / "config.json"} is damaged ('), \
      proc.stderr
  assert not (work / 'lock.json').exists()                    # released


def test_an_allowed_config_change_redoes_the_stages_it_affects(copy, capsys):
  """Changing a finished stage with allow_config_change redoes it (and everything after it) from
  its start; the rows before it are kept, and results.json names each row's config."""
  path, work, res = copy
  c = _load(path)
  old = checkpoint.config_hash(c)
  assert res['configs'] == [old, old]
  c.stages[1]['steps'] = 3
  c.allow_config_change = True
  new = runner.run(c, str(work))
  out = capsys.readouterr().out
  assert "the config change affects stage 1 'copy_rl' and after: redoing copy_rl" in out
  assert '[1] copy_rl (grpo): 3 steps in' in out                 # trained again from step 0
  assert new['configs'] == [old, checkpoint.config_hash(c)] and new['stages'] == res['stages']
  assert checkpoint.Progress(str(work)).done['copy_rl']['final_step'] == 3
  moved = os.listdir(work / 'superseded')
  assert len(moved) == 1 and moved[0].startswith(old)
  assert os.listdir(work / 'superseded' / moved[0]) == ['01_copy_rl']


def test_a_damaged_export_as_the_last_fallback_is_one_line(copy):
  path, work, _ = copy
  c = _load(path)
  c.ckpt.checksums = False                    # nothing checked ahead: the load itself fails
  for root, _, files in os.walk(work / 'stages' / '01_copy_rl' / 'ckpt' / '2'):
    for f in files:
      with open(os.path.join(root, f), 'r+b') as fh:
        fh.truncate(0)
  with open(_export(work, '01_copy_rl'), 'r+b') as f:
    f.truncate(100)
  c.stages = list(c.stages) + [dict(c.stages[1], name='more_rl')]
  c.allow_config_change = True
  with pytest.raises(checkpoint.CheckpointError) as e:
    runner.run(c, str(work))
  assert '\n' not in str(e.value)
  assert f"01_copy_rl/ckpt/2: the final checkpoint of stage 'copy_rl' cannot be restored" \
         in str(e.value) and 'its HF export' in str(e.value) and 'cannot be loaded either' \
         in str(e.value)


def test_a_read_only_finished_workdir_prints_its_results(copy, capsys, monkeypatch):
  path, work, res = copy
  before = {p: os.stat(os.path.join(r, p)).st_mtime_ns for r, _, fs in os.walk(work) for p in fs}

  def refuse(*a, **k):
    raise OSError(errno.EROFS, 'Read-only file system', str(a[0]) if a else '')
  plain_open = builtins.open

  def ro_open(file, mode='r', *a, **k):
    if any(m in mode for m in 'wax+') and str(file).startswith(str(work)):
      refuse(file)
    return plain_open(file, mode, *a, **k)
  monkeypatch.setattr(builtins, 'open', ro_open)
  for name in ('link', 'replace', 'rename', 'remove', 'mkdir'):
    monkeypatch.setattr(os, name, refuse)
  got = runner.run(_load(path), str(work))
  monkeypatch.undo()
  assert got == json.loads((work / 'results.json').read_text()) and got['scores'] == res['scores']
  out = capsys.readouterr().out
  assert '| stage | trains on | copy |' in out and f'results: {work / "results.md"}' in out
  after = {p: os.stat(os.path.join(r, p)).st_mtime_ns for r, _, fs in os.walk(work) for p in fs}
  assert after == before
