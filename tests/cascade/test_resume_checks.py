"""A resumed run never trusts unchecked state: checkpoint steps are used only once sealed, a
missing config.json is not adopted by another config, and a stage resumes only on the data
files it started with.

Cheap tests drive `StageCheckpoints`, `guard_config` and `StageData.pin` directly; the heavy ones
SIGKILL a process inside a seal, and kill the toy cascade mid-stage, then change its config or
its data before the rerun.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import types

import jax
import ml_collections
import numpy as np
import pytest

from cascade import checkpoint
from cascade import checksums
from cascade.data import readers
from cascade.data import shards
from cascade.data import stage_data

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(REPO, 'tests', 'faults.py')   # cascade.main with a test's kill hook


# ----------------------------------------------------------------------------- checkpoints


def _state(seed):
  """A small pytree of arrays (no model: nothing to compile)."""
  rng = np.random.default_rng(seed)
  return {'w': jax.numpy.asarray(rng.standard_normal((64, 256)), jax.numpy.float32),
          'b': jax.numpy.asarray(rng.standard_normal(256), jax.numpy.float32),
          'step': jax.numpy.int32(seed)}


def _abstract():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      _state(0))


def _flip(directory):
  """Flips 64 bytes in the middle of the largest file under `directory` (same size)."""
  files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
  victim = max(files, key=os.path.getsize)
  with open(victim, 'r+b') as f:
    f.seek(os.path.getsize(victim) // 2)
    data = f.read(64)
    f.seek(-64, 1)
    f.write(bytes(b ^ 0xFF for b in data))


class _Killed(BaseException):
  """Where the process would have died."""


@pytest.mark.parametrize('point', ['while Orbax writes', 'between save and seal',
                                   'after the seal'])
@pytest.mark.parametrize('keep', [1, 2])
def test_a_kill_at_any_point_then_a_bit_flip_never_resumes_from_that_step(tmp_path, capsys,
                                                                          monkeypatch, point,
                                                                          keep):
  """Step 2 is saved and sealed; the run dies saving step 4 (before Orbax finalised it, after
  that but before its seal, or after the seal) and bytes of step 4 flip. The rerun never uses
  step 4: it restores step 2, its weights exactly, or, once 4 was sealed with keep=1 (which
  deleted 2), starts the stage again; one warning. An older step is deleted only once a newer
  one is sealed, so a kill before the seal always leaves step 2."""
  d = tmp_path / 'ckpt'
  ckpt = checkpoint.StageCheckpoints(str(d), keep=keep)
  ckpt.save(2, _state(2), {'step': 2, 'data': {'position': 8}})
  ckpt.wait()
  newest = d / '4'
  if point == 'while Orbax writes':        # what a kill before Orbax's rename leaves
    newest = d / '4.orbax-checkpoint-tmp-1234'
    shutil.copytree(d / '2', newest)
    os.remove(newest / 'checksums.json')
  elif point == 'between save and seal':
    seal = checksums.seal

    def dies_sealing_4(directory):
      if directory.endswith('/4'):
        raise _Killed()
      seal(directory)
    monkeypatch.setattr(checksums, 'seal', dies_sealing_4)
    ckpt.save(4, _state(4), {'step': 4, 'data': {'position': 16}})
    with pytest.raises(_Killed):
      ckpt.wait()
    monkeypatch.undo()
    assert sorted(os.listdir(d)) == ['2', '4'] and not checksums.sealed(str(newest))
  else:
    ckpt.save(4, _state(4), {'step': 4, 'data': {'position': 16}})
    ckpt.wait()
    assert checksums.sealed(str(newest)) and (d / '2').exists() == (keep == 2)
  _flip(newest)
  capsys.readouterr()

  again = checkpoint.StageCheckpoints(str(d), keep=keep)     # the rerun
  got = again.restore(_abstract())
  warnings = [l for l in capsys.readouterr().out.splitlines() if 'WARNING' in l]
  if point == 'after the seal' and keep == 1:
    assert got is None
    assert len(warnings) == 1 and warnings[0].startswith(
        f'WARNING: checkpoint {d}/4 is damaged (checksum mismatch: ') and warnings[0].endswith(
            'no earlier checkpoint is left: the stage starts again from its first step')
    return
  step, state, meta = got
  assert step == 2 and meta['data'] == {'position': 8}
  for k, v in _state(2).items():
    np.testing.assert_array_equal(np.asarray(state[k]), np.asarray(v))
  if point == 'while Orbax writes':
    assert warnings == []                  # Orbax never lists an unfinished step
  else:
    assert len(warnings) == 1 and warnings[0].startswith(f'WARNING: checkpoint {d}/4 is ')
    assert warnings[0].endswith('falling back to the previous checkpoint')
    assert ('not usable (checksums.json is missing: it was never sealed' in warnings[0]) == (
        point == 'between save and seal'), warnings[0]
  assert again.steps() == [2]
  again.save(4, _state(4), {'step': 4, 'data': {'position': 16}})     # redone, and sealed
  again.wait()
  assert checksums.sealed(str(d / '4')) and again.steps() == [2, 4][-keep:]
  again.close()


def test_a_lone_unsealed_step_restarts_the_stage_with_one_warning(tmp_path, capsys,
                                                                   monkeypatch):
  """With no sealed step to fall back to, the stage starts again from its first step (restore
  gives None) and the warning says so."""
  monkeypatch.setattr(checksums, 'seal', lambda directory: (_ for _ in ()).throw(_Killed()))
  ckpt = checkpoint.StageCheckpoints(str(tmp_path / 'ckpt'), keep=1)
  ckpt.save(3, _state(3), {'step': 3})
  with pytest.raises(_Killed):
    ckpt.wait()
  monkeypatch.undo()
  capsys.readouterr()
  assert checkpoint.StageCheckpoints(str(tmp_path / 'ckpt')).restore(_abstract()) is None
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 1 and out[0].startswith(f'WARNING: checkpoint {tmp_path / "ckpt"}/3 is '
                                             'not usable (checksums.json is missing')
  assert out[0].endswith('no earlier checkpoint is left: the stage starts again from its first '
                         'step')


def test_a_synchronous_save_is_sealed_before_it_returns(tmp_path):
  d = tmp_path / 'ckpt'
  ckpt = checkpoint.StageCheckpoints(str(d), keep=1, async_save=False)
  ckpt.save(1, _state(1), {'step': 1})
  assert checksums.sealed(str(d / '1'))
  ckpt.save(2, _state(2), {'step': 2})
  assert checksums.sealed(str(d / '2')) and ckpt.steps() == [2]      # 1 went once 2 was sealed
  ckpt.close()


_KILLED_IN_THE_SEAL = r'''
import os, signal, sys
import jax, numpy as np
sys.path.insert(0, {repo!r})
from cascade import checkpoint, checksums
seal = checksums.seal
def dies_sealing_4(directory):
  if directory.endswith('/4'):
    os.kill(os.getpid(), signal.SIGKILL)
  seal(directory)
checksums.seal = dies_sealing_4
ckpt = checkpoint.StageCheckpoints({d!r}, keep=1)
for step in (2, 4):
  rng = np.random.default_rng(step)
  ckpt.save(step, {{'w': jax.numpy.asarray(rng.standard_normal((64, 256)), jax.numpy.float32),
                    'b': jax.numpy.asarray(rng.standard_normal(256), jax.numpy.float32),
                    'step': jax.numpy.int32(step)}}, {{'step': step}})
ckpt.wait()
'''


@pytest.mark.heavy
def test_sigkill_between_orbax_finalising_a_step_and_sealing_it(tmp_path, capsys):
  """A real SIGKILL inside the seal of step 4 (Orbax has finalised it; keep=1): step 2 was not
  deleted, and the rerun restores it, with flipped bytes in step 4 or without."""
  d = tmp_path / 'ckpt'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  p = subprocess.run([sys.executable, '-c', _KILLED_IN_THE_SEAL.format(repo=REPO, d=str(d))],
                     env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
  assert sorted(os.listdir(d)) == ['2', '4'] and checksums.sealed(str(d / '2'))
  assert not checksums.sealed(str(d / '4'))
  shutil.copytree(d, tmp_path / 'flipped')
  _flip(tmp_path / 'flipped' / '4')
  for where in (d, tmp_path / 'flipped'):
    step, state, _ = checkpoint.StageCheckpoints(str(where), keep=1).restore(_abstract())
    assert step == 2
    np.testing.assert_array_equal(np.asarray(state['w']), np.asarray(_state(2)['w']))
    assert 'is not usable (checksums.json is missing' in capsys.readouterr().out


def test_an_export_without_its_seal_is_exported_again(tmp_path, capsys):
  """A gs:// export is uploaded file by file and sealed after its config.json: a kill between
  leaves it whole-looking but unsealed. Such an export is moved aside and made again, like a
  damaged one, never reused unchecked."""
  from cascade import policies  # pylint: disable=g-import-not-at-top
  pol = policies.Policies(types.SimpleNamespace(ckpt=types.SimpleNamespace(checksums=True)),
                          str(tmp_path), None, None)
  stage = types.SimpleNamespace(index=0, name='sft')
  out = tmp_path / 'stages' / '00_sft' / 'hf'
  out.mkdir(parents=True)
  (out / 'model.safetensors').write_bytes(b'weights')
  (out / 'config.json').write_text('{}')
  assert policies.exported(str(out))
  checksums.seal(str(out))
  assert not pol.damaged_export(stage, str(out))
  os.remove(out / checksums.MANIFEST)              # killed before the seal
  capsys.readouterr()
  assert pol.damaged_export(stage, str(out)) and not out.exists()
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      f"WARNING: {out}: the HF export of stage 'sft' is damaged (checksums.json is missing: it "
      'was never sealed') and lines[0].endswith('exporting it again')
  assert os.listdir(tmp_path / 'stages' / '00_sft' / 'corrupt')[0].startswith('hf.')


# ----------------------------------------------------------------------------- the config


def _files(d):
  return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), 'rb').read()
          for r, _, fs in os.walk(d) for f in fs}


def test_a_missing_config_json_is_taken_back_only_by_the_config_progress_records(tmp_path,
                                                                                 capsys):
  """progress.json keeps config.json's hash: once a run took a step, a deleted config.json lets
  no other config in (one line naming both hashes and a new --workdir / --fork_from; nothing
  written), allow_config_change included; the run's own config writes it again."""
  w = str(tmp_path)
  c = ml_collections.ConfigDict({'seed': 0, 'stages': [{'name': 'a', 'steps': 2}]})
  h = checkpoint.guard_config(w, c)
  assert checkpoint.read_json(str(tmp_path / 'progress.json'))['config'] == h
  checkpoint.Progress(w, config_hash=h).mark_done('a', {'index': 0})
  (tmp_path / 'stages' / '00_a' / 'ckpt' / '2').mkdir(parents=True)
  os.remove(tmp_path / 'config.json')
  other = ml_collections.ConfigDict({'seed': 1, 'stages': [{'name': 'a', 'steps': 2}]})
  h2 = checkpoint.config_hash(other)
  before = _files(w)
  for allow in (False, True):
    with pytest.raises(checkpoint.WorkdirError) as e:
      checkpoint.guard_config(w, other, allow_change=allow)
    msg = str(e.value)
    assert '\n' not in msg and msg.startswith(f'{tmp_path / "config.json"} is missing')
    assert f'run of config {h} ' in msg and f'not of this config {h2}' in msg
    assert 'new --workdir' in msg and f'--fork_from={w}' in msg
    assert _files(w) == before
  capsys.readouterr()
  assert checkpoint.guard_config(w, c) == h
  assert 'config.json was missing; progress.json records this config' in capsys.readouterr().out
  assert checkpoint.read_json(str(tmp_path / 'config.json'))['hash'] == h
  with pytest.raises(checkpoint.WorkdirError, match='different config'):
    checkpoint.guard_config(w, other)                 # and it holds the workdir again

  # A workdir whose progress.json records no hash (made before it did) cannot be checked.
  os.remove(tmp_path / 'config.json')
  rec = checkpoint.read_json(str(tmp_path / 'progress.json'))
  del rec['config']
  (tmp_path / 'progress.json').write_text(json.dumps(rec))
  for cfg in (c, other):
    with pytest.raises(checkpoint.WorkdirError, match='whose config nothing else records') as e:
      checkpoint.guard_config(w, cfg)
    assert '\n' not in str(e.value) and 'new --workdir' in str(e.value)


def test_a_new_or_unstarted_workdir_records_the_hash_beside_config_json(tmp_path):
  """guard_config keeps the hash in progress.json from the start (and across an allowed change),
  and Progress keeps it through its own saves."""
  w = str(tmp_path)
  c = ml_collections.ConfigDict({'seed': 0, 'stages': [{'name': 'a', 'steps': 2}]})
  h = checkpoint.guard_config(w, c)
  p = checkpoint.Progress(w)
  assert p.config == h and not p.done and not checkpoint.run_started(w)
  p.add_row({'stage': 'init', 'index': -1, 'domains': [], 'scores': {}})
  assert checkpoint.recorded_hash(w) == h
  c.seed = 5
  h2 = checkpoint.guard_config(w, c, allow_change=True)
  assert h2 != h and checkpoint.recorded_hash(w) == h2
  assert checkpoint.read_json(str(tmp_path / 'progress.json'))['rows'] == []   # redone


# ----------------------------------------------------------------------------- the data


def _write_lines(path, lines):
  with open(path, 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in lines)


def _rewrite_in_place(path, text):
  """Writes `text` (same length) over `path` in place, its modification time set back."""
  st = os.stat(path)
  assert len(text.encode()) == st.st_size
  with open(path, 'r+b') as f:
    f.write(text.encode())
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  assert os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_a_shard_rewritten_in_place_at_its_size_and_time_is_indexed_again(tmp_path):
  """The line-offset index is keyed by a stamp that changes with any write: a shard rewritten
  with the same size and modification time (its lines cut elsewhere) reads its new rows, not
  garbage through the stale index."""
  p = tmp_path / 'a.jsonl'
  p.write_text('{"a": 1}\n{"b": 22}\n')
  cache = str(tmp_path / 'cache')
  assert [shards.open_shard(str(p), cache)[i][1] for i in range(2)] == [{'a': 1}, {'b': 22}]
  _rewrite_in_place(p, '{"a": 11}\n{"b": 2}\n')
  assert [shards.open_shard(str(p), cache)[i][1] for i in range(2)] == [{'a': 11}, {'b': 2}]


def _stage_data(tmp_path, pattern):
  spec = types.SimpleNamespace(path=pattern, name='sft')
  plan = types.SimpleNamespace(datasets={'sft': spec})
  stage = types.SimpleNamespace(datasets=('sft',), where="stages[0] 'sft'")
  return stage_data.StageData(plan, None, None, cache_dir=str(tmp_path / 'cache')), stage


def _shards(tmp_path):
  d = tmp_path / 'data'
  d.mkdir()
  for k in range(3):
    _write_lines(d / f'part-{k}.jsonl', [{'id': f'{k}-{i}', 'x': i} for i in range(4)])
  return d


@pytest.mark.parametrize('change, says', [
    ('deleted', 'part-1.jsonl (one of its shards, '),
    ('rewritten', 'part-1.jsonl holds '),
    ('same size and time', 'part-1.jsonl holds other bytes (same size;'),
    ('added', 'part-3.jsonl is a shard it did not have'),
])
def test_a_shard_changed_between_kill_and_rerun_refuses_the_resume_naming_it(tmp_path, change,
                                                                            says):
  d = _shards(tmp_path)
  sd, stage = _stage_data(tmp_path, str(d / 'part-*.jsonl'))
  started = sd.pin(stage, None, resuming=False)
  assert [r['path'] for r in started] == [str(d / f'part-{k}.jsonl') for k in range(3)]
  victim = d / 'part-1.jsonl'
  if change == 'deleted':
    os.remove(victim)
  elif change == 'rewritten':
    _write_lines(victim, [{'id': 'new', 'x': 0}])
  elif change == 'same size and time':
    lines = victim.read_text().splitlines(keepends=True)
    _rewrite_in_place(victim, ''.join(reversed(lines)))
  else:
    _write_lines(d / 'part-3.jsonl', [{'id': 'more', 'x': 0}])
  with pytest.raises(readers.DataError) as e:
    sd.pin(stage, json.loads(json.dumps(started)), resuming=True)
  msg = str(e.value)
  assert '\n' not in msg and msg.startswith("stages[0] 'sft' resumes from a checkpoint, but ")
  assert says in msg and 'new --workdir' in msg, msg
  # A stage that starts afresh takes the data as it is now, and records it.
  assert sd.pin(stage, started, resuming=False) != started


def test_unchanged_shards_are_not_read_again_and_a_same_bytes_copy_passes(tmp_path, monkeypatch,
                                                                          capsys):
  d = _shards(tmp_path)
  sd, stage = _stage_data(tmp_path, str(d / 'part-*.jsonl'))
  slow = stage_data.SLOW_PIN_S
  monkeypatch.setattr(stage_data, 'SLOW_PIN_S', 0.0)      # as if hashing took long: it says so
  started = json.loads(json.dumps(sd.pin(stage, None, resuming=False)))    # via progress.json
  assert capsys.readouterr().out.startswith(
      "stages[0] 'sft': pinned the identity of its data files in 0 s (3 shards;")
  monkeypatch.setattr(stage_data, 'SLOW_PIN_S', slow)
  hashed = []
  digest = checksums.digest
  monkeypatch.setattr(checksums, 'digest', lambda p: hashed.append(p) or digest(p))
  assert sd.pin(stage, started, resuming=True) == started and hashed == []
  # The same bytes copied afresh (another host, a restored backup): read once, and accepted.
  copy = d / 'part-0.jsonl.tmp'
  shutil.copyfile(d / 'part-0.jsonl', copy)
  os.replace(copy, d / 'part-0.jsonl')
  now = sd.pin(stage, started, resuming=True)
  assert hashed == [str(d / 'part-0.jsonl')] and now[0]['digest'] == started[0]['digest']
  assert now[0]['stamp'] != started[0]['stamp']
  # A stage resuming with no record (an older workdir) says so in one warning, and records.
  capsys.readouterr()
  assert sd.pin(stage, None, resuming=True) == now
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 1 and out[0].startswith("WARNING: stages[0] 'sft': no record of the data")


def test_an_exactly_named_shard_that_is_gone_refuses_the_resume_in_one_line(tmp_path):
  p = tmp_path / 'sft.jsonl'
  _write_lines(p, [{'id': 'a'}])
  sd, stage = _stage_data(tmp_path, str(p))
  started = sd.pin(stage, None, resuming=False)
  os.remove(p)
  with pytest.raises(readers.DataError) as e:
    sd.pin(stage, started, resuming=True)
  assert '\n' not in str(e.value) and str(e.value).startswith(
      f"stages[0] 'sft' resumes from a checkpoint, but {p}: no such file")


# ----------------------------------------------------------------------------- end to end


def _env():
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  return env


def _main(path, work, *extra, kill_at=None):
  main = [FAULTS, f'--kill_at={kill_at}'] if kill_at else ['-m', 'cascade.main']
  return subprocess.run([sys.executable, *main, f'--config={path}', f'--workdir={work}', *extra],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.heavy
def test_a_run_killed_mid_stage_resumes_only_with_its_config_and_its_data(tmp_path,
                                                                          copy_cascade):
  """SIGKILL mid-SFT; then config.json is deleted and another config tries the workdir (one
  line, exit 2, both hashes), and the SFT shard is rewritten in place at its size and time (one
  line, exit 2, naming it); with the bytes put back (a fresh copy) the same command resumes."""
  path = copy_cascade(tmp_path, train=16, eval_=8, sft=32, sft_steps=4, rl_steps=1)
  work = tmp_path / 'run'
  p = _main(path, work, kill_at='sft:2')
  assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
  h = json.loads((work / 'config.json').read_text())['hash']

  os.remove(work / 'config.json')
  p = _main(path, work, '--config.seed=1')
  lines = p.stderr.strip().splitlines()
  assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
  assert lines[0].startswith(f'error: {work / "config.json"} is missing') and f'config {h} ' \
      in lines[0] and 'new --workdir' in lines[0]
  assert not (work / 'config.json').exists()

  sft = tmp_path / 'sft.jsonl'
  original = sft.read_bytes()
  rows = original.decode().splitlines(keepends=True)
  _rewrite_in_place(sft, ''.join(rows[1:] + rows[:1]))
  p = _main(path, work)
  lines = p.stderr.strip().splitlines()
  assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
  assert lines[0].startswith("error: stages[0] 'sft' resumes from a checkpoint, but since it "
                             f'started {sft} holds other bytes'), lines[0]
  assert json.loads((work / 'config.json').read_text())['hash'] == h     # written again

  sft.write_bytes(original)
  p = _main(path, work)
  assert p.returncode == 0, p.stderr[-3000:]
  assert '[0] sft: resuming at step 2/4' in p.stdout
  assert set(json.loads((work / 'progress.json').read_text())['done']) == {'sft', 'copy_rl'}
