"""Orbax stage checkpoints: save/restore, fallback past a damaged step, the config guard, progress."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from cascade import checkpoint
from models import config as model_config
from models import transformer


def make_state(seed):
  model = transformer.create(model_config.ModelConfig.tiny(num_layers=1), seed)
  params = nnx.state(model, nnx.Param)
  opt = optax.adamw(1e-3).init(params)
  return {'params': params, 'opt_state': opt, 'step': jnp.int32(seed)}


def assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_restore_and_fallback_past_damaged_step(tmp_path):
  ckpt = checkpoint.StageCheckpoints(str(tmp_path / 'ckpt'), keep=3)
  states = {s: make_state(s) for s in (2, 4)}
  for s, st in states.items():
    ckpt.save(s, st, {'step': s, 'stage_index': 1, 'data': {'next_index': s * 4}})
  ckpt.wait()
  assert ckpt.steps() == [2, 4]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          make_state(0))
  step, state, meta = ckpt.restore(abstract)
  assert step == 4 and meta['data'] == {'next_index': 16}
  assert_same(state, states[4])

  # Damage the newest step: truncate every array file in it.
  for root, _, files in os.walk(tmp_path / 'ckpt' / '4' / 'state'):
    for f in files:
      with open(os.path.join(root, f), 'r+b') as fh:
        fh.truncate(3)
  ckpt2 = checkpoint.StageCheckpoints(str(tmp_path / 'ckpt'), keep=3)
  step, state, meta = ckpt2.restore(abstract)
  assert step == 2 and meta['data'] == {'next_index': 8}
  assert_same(state, states[2])
  assert ckpt2.steps() == [2]
  assert os.listdir(tmp_path / 'corrupt')                 # moved aside, not deleted
  ckpt2.save(4, states[4], {'step': 4})                   # the redone step saves again
  ckpt2.wait()
  assert ckpt2.steps() == [2, 4]

  # A deleted state directory is damage too; with nothing left, restore is None.
  import shutil
  for s in (2, 4):
    shutil.rmtree(tmp_path / 'ckpt' / str(s) / 'state')
  assert checkpoint.StageCheckpoints(str(tmp_path / 'ckpt')).restore(abstract) is None
  ckpt.close()
  ckpt2.close()


def test_config_guard(tmp_path):
  c = ml_collections.ConfigDict({'seed': 0, 'stages': [{'name': 'a', 'steps': 2}],
                                 'ckpt': {'keep': 2}, 'allow_config_change': False})
  h = checkpoint.guard_config(str(tmp_path), c)
  assert checkpoint.guard_config(str(tmp_path), c) == h          # same config: fine
  c.ckpt.keep = 9                                                  # harmless field
  assert checkpoint.guard_config(str(tmp_path), c) == h
  checkpoint.Progress(str(tmp_path)).mark_done('a', {'index': 0})  # the run took its steps
  c.stages[0]['steps'] = 3
  with pytest.raises(ValueError,
                     match='different config.*finished stages.*allow_config_change=True'):
    checkpoint.guard_config(str(tmp_path), c)
  h2 = checkpoint.guard_config(str(tmp_path), c, allow_change=True)
  assert h2 != h and os.path.exists(tmp_path / f'config.{h}.json')
  assert checkpoint.read_json(str(tmp_path / 'config.json'))['hash'] == h2


def test_progress_round_trip_and_atomic_writes(tmp_path):
  p = checkpoint.Progress(str(tmp_path))
  p.add_row({'stage': 'sft', 'index': 0, 'domains': ['a'], 'scores': {'a': 12.5}})
  p.mark_done('sft', {'index': 0, 'kind': 'sft', 'final_step': 4})
  with pytest.raises(ValueError, match='already has an evaluation row'):
    p.add_row({'stage': 'sft', 'index': 0, 'domains': [], 'scores': {}})
  q = checkpoint.Progress(str(tmp_path))
  assert q.done == {'sft': {'index': 0, 'kind': 'sft', 'final_step': 4}}
  assert q.row('sft')['scores'] == {'a': 12.5}
  assert [f for f in os.listdir(tmp_path) if '.tmp' in f] == []


def _files(d):
  return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), 'rb').read()
          for r, _, fs in os.walk(d) for f in fs}


def test_a_run_that_stopped_before_its_first_step_does_not_hold_the_workdir(tmp_path, capsys):
  """A failed start (a wrong mesh, no sandbox) wrote config.json and no more: the corrected,
  different config takes the workdir over in one line, keeping the old record beside it."""
  w = str(tmp_path)
  c = ml_collections.ConfigDict({'seed': 0, 'stages': [{'name': 'a', 'steps': 2}]})
  old = checkpoint.guard_config(w, c)
  # What a start that fails in make_context or the verifiers' checks leaves besides config.json.
  (tmp_path / 'metrics.jsonl').write_text('')
  (tmp_path / 'tb').mkdir()
  (tmp_path / 'tb' / 'events.out.tfevents.1.host').write_bytes(b'\x00' * 40)
  (tmp_path / 'compilation_cache').mkdir()
  (tmp_path / 'compilation_cache' / 'jit_f-1234').write_bytes(b'program')
  (tmp_path / 'stages' / '00_a' / 'ckpt').mkdir(parents=True)     # no step saved in it
  checkpoint.Progress(w).save()                                      # no stage, no row
  capsys.readouterr()
  c.stages[0]['steps'] = 3
  new = checkpoint.guard_config(w, c)
  assert new != old
  assert capsys.readouterr().out.splitlines() == [
      f'{w}: its run of config {old} stopped before its first step (no step, checkpoint or '
      f'evaluation); config {new} takes the workdir over (the old record is config.{old}.json)']
  assert checkpoint.read_json(str(tmp_path / 'config.json'))['hash'] == new
  assert checkpoint.read_json(str(tmp_path / f'config.{old}.json'))['hash'] == old
  assert checkpoint.guard_config(w, c) == new                        # and it is this run's now


@pytest.mark.parametrize('took_a_step, says', [
    (lambda w: checkpoint.Progress(w).mark_done('a', {'index': 0}), 'progress.json records'),
    (lambda w: checkpoint.Progress(w).add_row({'stage': 'init', 'index': -1, 'domains': [],
                                              'scores': {}}), 'progress.json records'),
    (lambda w: _write(w, 'progress.json', '{"done": '), 'progress.json cannot be read'),
    (lambda w: _write(w, 'stages/00_a/ckpt/2/state/d/0.0', 'x'), 'stages/00_a/ckpt/2/state/d/0.0'),
    (lambda w: _write(w, 'stages/00_a/hf/model.safetensors', 'x'), 'hf/model.safetensors'),
    (lambda w: _write(w, 'metrics.jsonl', '{"step": 1}\n'), 'metrics.jsonl logs steps'),
    (lambda w: _write(w, 'samples.jsonl', '{}\n'), 'samples.jsonl'),
    (lambda w: _write(w, 'superseded/abc.1/00_a/x', 'x'), 'superseded'),
])
def test_a_run_that_took_a_step_keeps_its_workdir(tmp_path, took_a_step, says):
  """Anything a run leaves once it has stepped keeps the workdir its own: a different config is
  refused in one line naming what was found, and nothing there changes."""
  w = str(tmp_path)
  c = ml_collections.ConfigDict({'seed': 0, 'stages': [{'name': 'a', 'steps': 2}]})
  checkpoint.guard_config(w, c)
  took_a_step(w)
  before = _files(w)
  c.stages[0]['steps'] = 3
  with pytest.raises(checkpoint.WorkdirError, match='different config') as e:
    checkpoint.guard_config(w, c)
  assert says in str(e.value) and '\n' not in str(e.value)
  assert _files(w) == before


def _write(w, rel, text):
  path = os.path.join(w, rel)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    f.write(text)


def test_config_json_records_the_config_its_hash_names(tmp_path):
  """config.json is written for a new or changed config only (a harmless change keeps the
  recorded one), whichever way the hashes compare; a ConfigDict and its plain dict hash alike."""
  base = {'seed': 0, 'stages': [{'name': 'a', 'steps': 2}], 'ckpt': {'keep': 2}}
  c = ml_collections.ConfigDict(base)
  assert checkpoint.config_hash(c) == checkpoint.config_hash(base)
  assert checkpoint.config_hash(dict(reversed(list(base.items())))) == checkpoint.config_hash(base)
  assert len(checkpoint.config_hash(base)) == 16
  h = checkpoint.guard_config(str(tmp_path), c)
  c.ckpt.keep = 9
  assert checkpoint.guard_config(str(tmp_path), c) == h
  assert checkpoint.read_json(str(tmp_path / 'config.json'))['config']['ckpt']['keep'] == 2
  (tmp_path / 'metrics.jsonl').write_text('{"stage": "a", "step": 1}\n')   # a run took a step
  seen = set()
  for steps in range(3, 40):                    # changes whose hash sorts below and above
    c.stages[0]['steps'] = steps
    old = checkpoint.read_json(str(tmp_path / 'config.json'))['hash']
    with pytest.raises(checkpoint.WorkdirError, match='different config'):
      checkpoint.guard_config(str(tmp_path), c)
    new = checkpoint.guard_config(str(tmp_path), c, allow_change=True)
    rec = checkpoint.read_json(str(tmp_path / 'config.json'))
    assert rec['hash'] == new and rec['config']['stages'][0]['steps'] == steps
    seen.add(new < old)
  assert seen == {True, False}


def test_progress_rows_by_name_and_writes_on_process_0_only(tmp_path, monkeypatch):
  p = checkpoint.Progress(str(tmp_path))
  for name in ('sft', 'math_rl', 'code_rl'):
    p.add_row({'stage': name, 'index': 0, 'domains': [], 'scores': {}})
  assert [p.row(n)['stage'] for n in ('code_rl', 'math_rl', 'sft')] == ['code_rl', 'math_rl',
                                                                        'sft']
  assert p.row('swe_rl') is None
  checkpoint.atomic_write_text(str(tmp_path / 'a.txt'), 'x')
  checkpoint.atomic_write_json(str(tmp_path / 'a.json'), {'x': 1})
  assert (tmp_path / 'a.txt').read_text() == 'x' and checkpoint.read_json(
      str(tmp_path / 'a.json')) == {'x': 1}
  monkeypatch.setattr(checkpoint.jax, 'process_index', lambda: 1)
  assert not checkpoint.is_writer()
  checkpoint.atomic_write_text(str(tmp_path / 'b.txt'), 'x')
  checkpoint.atomic_write_json(str(tmp_path / 'b.json'), {'x': 1})
  assert not (tmp_path / 'b.txt').exists() and not (tmp_path / 'b.json').exists()


def _fake_run(workdir, stages, done, config_extra=None):
  """A workdir as a run leaves it: config.json, progress.json, stage files, metrics.jsonl."""
  cfg = ml_collections.ConfigDict(dict(seed=0, model=dict(preset='tiny'), ckpt=dict(keep=1),
                                       stages=stages, **(config_extra or {})))
  checkpoint.guard_config(str(workdir), cfg)
  p = checkpoint.Progress(str(workdir))
  lines = []
  for i, st in enumerate(stages):
    if st['name'] not in done:
      continue
    d = workdir / 'stages' / f'{i:02d}_{st["name"]}'
    (d / 'hf').mkdir(parents=True)
    (d / 'hf' / 'model.safetensors').write_text(f'weights of {st["name"]}')
    (d / 'ckpt').mkdir()
    (d / 'ckpt' / 'state').write_text(f'state of {st["name"]}')
    p.mark_done(st['name'], {'index': i, 'kind': 'x', 'hf': str(d / 'hf')})
    p.add_row({'stage': st['name'], 'index': i, 'scores': {'a': float(i)},
               'hf': str(d / 'hf')})
    lines += [json.dumps({'stage': st['name'], 'step': 1, 'step_s': 1.0}),
              json.dumps({'eval': st['name'], 'row': i, 'scores': {'a': float(i)}})]
  (workdir / 'metrics.jsonl').write_text(''.join(l + '\n' for l in lines))
  return cfg


def test_fork_copies_the_shared_finished_head_and_nothing_else(tmp_path):
  """The longest prefix of identical stages finished in the source is copied (files, progress
  with exports retargeted, rows, metrics records); the first changed stage and all after it
  are not, even when an identical one follows."""
  stages = [dict(name='sft', steps=3), dict(name='rl', steps=2), dict(name='last', steps=1)]
  src = tmp_path / 'src'
  _fake_run(src, stages, done={'sft', 'rl', 'last'})
  mine = ml_collections.ConfigDict(dict(seed=0, model=dict(preset='tiny'), ckpt=dict(keep=3),
                                        stages=[stages[0], dict(name='rl', steps=5),
                                                stages[2]]))
  dst = tmp_path / 'dst'
  checkpoint.guard_config(str(dst), mine)
  assert checkpoint.fork(str(src), str(dst), mine) == ['sft']
  assert (dst / 'stages' / '00_sft' / 'hf' / 'model.safetensors').read_text() == 'weights of sft'
  assert (dst / 'stages' / '00_sft' / 'ckpt' / 'state').read_text() == 'state of sft'
  assert not (dst / 'stages' / '01_rl').exists() and not (dst / 'stages' / '02_last').exists()
  p = checkpoint.Progress(str(dst))
  assert list(p.done) == ['sft'] and p.done['sft']['forked_from'] == str(src)
  assert p.done['sft']['hf'] == str(dst / 'stages' / '00_sft' / 'hf')
  assert [r['stage'] for r in p.rows] == ['sft'] and p.rows[0]['hf'] == p.done['sft']['hf']
  recs = [json.loads(l) for l in (dst / 'metrics.jsonl').read_text().splitlines()]
  assert {r.get('stage') or r.get('eval') for r in recs} == {'sft'} and len(recs) == 2
  # A rerun of the forked command resumes its own progress: nothing is copied again.
  (dst / 'stages' / '00_sft' / 'hf' / 'model.safetensors').write_text('mine now')
  assert checkpoint.fork(str(src), str(dst), mine) is None
  assert (dst / 'stages' / '00_sft' / 'hf' / 'model.safetensors').read_text() == 'mine now'


def test_fork_copies_only_finished_stages_and_refuses_other_sections(tmp_path):
  stages = [dict(name='sft', steps=3), dict(name='rl', steps=2)]
  src = tmp_path / 'src'
  _fake_run(src, stages, done={'sft'})                  # rl still running there
  mine = ml_collections.ConfigDict(dict(seed=0, model=dict(preset='tiny'), ckpt=dict(keep=1),
                                        stages=stages))
  assert checkpoint.fork(str(src), str(tmp_path / 'a'), mine) == ['sft']
  other = ml_collections.ConfigDict(dict(seed=1, model=dict(preset='small'),
                                         ckpt=dict(keep=1), stages=stages))
  with pytest.raises(checkpoint.WorkdirError, match='its config differs in model, seed;'):
    checkpoint.fork(str(src), str(tmp_path / 'b'), other)
  with pytest.raises(checkpoint.WorkdirError, match='no run there'):
    checkpoint.fork(str(tmp_path / 'nothing'), str(tmp_path / 'c'), mine)
  assert not (tmp_path / 'b' / 'stages').exists()
  first_differs = ml_collections.ConfigDict(dict(mine.to_dict(), stages=[
      dict(name='sft', steps=4), stages[1]]))
  assert checkpoint.fork(str(src), str(tmp_path / 'd'), first_differs) == []


def _largest_file(d):
  files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
  return max(files, key=os.path.getsize)


def test_flipped_bytes_or_an_edited_data_position_fall_back_with_a_warning(tmp_path, capsys):
  """Damage that keeps the format (bytes flipped inside the parameter data, the data position
  edited in the metadata) restores without an error; the step's checksums catch it, it is moved
  aside with a one-line warning and the previous step is used, as for damage Orbax notices."""
  ckpt = checkpoint.StageCheckpoints(str(tmp_path / 'ckpt'), keep=3)
  states = {s: make_state(s) for s in (2, 4, 6)}
  for s, st in states.items():
    ckpt.save(s, st, {'step': s, 'stage_index': 1, 'data': {'next_index': s * 4}})
  ckpt.close()
  assert all(os.path.exists(tmp_path / 'ckpt' / str(s) / 'checksums.json') for s in (2, 4, 6))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          make_state(0))
  victim = _largest_file(tmp_path / 'ckpt' / '6' / 'state')
  with open(victim, 'r+b') as f:                 # same size, 64 bytes in the middle flipped
    f.seek(os.path.getsize(victim) // 2)
    data = f.read(64)
    f.seek(-64, 1)
    f.write(bytes(b ^ 0xFF for b in data))
  meta = tmp_path / 'ckpt' / '4' / 'meta' / 'metadata'
  meta.write_text(meta.read_text().replace('"next_index": 16', '"next_index": 99'))
  again = checkpoint.StageCheckpoints(str(tmp_path / 'ckpt'), keep=3)
  step, state, got = again.restore(abstract)
  assert step == 2 and got['data'] == {'next_index': 8}
  assert_same(state, states[2])
  out = capsys.readouterr().out.splitlines()
  assert [l for l in out if 'WARNING' in l] == [
      f'WARNING: checkpoint {tmp_path / "ckpt"}/6 is damaged (checksum mismatch: '
      f'{os.path.relpath(victim, tmp_path / "ckpt" / "6")} differs from what was saved '
      '(sha256)); falling back to the previous checkpoint',
      f'WARNING: checkpoint {tmp_path / "ckpt"}/4 is damaged (checksum mismatch: meta/metadata '
      'differs from what was saved (sha256)); falling back to the previous checkpoint']
  assert sorted(os.listdir(tmp_path / 'corrupt'))[0].startswith('4.')
  again.close()


def test_without_checksums_flipped_bytes_restore_silently(tmp_path):
  """Why the checksums exist: Orbax restores a parameter file with flipped bytes as different
  weights, no error (config.ckpt.checksums=False, and every run before them)."""
  ckpt = checkpoint.StageCheckpoints(str(tmp_path / 'ckpt'), keep=1, checksums=False)
  ckpt.save(2, make_state(2), {'step': 2})
  ckpt.close()
  assert not os.path.exists(tmp_path / 'ckpt' / '2' / 'checksums.json')
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          make_state(0))
  # Orbax's data file holds raw arrays beside compressed ones, in an order its concurrent
  # writes choose: a flip inside a compressed chunk is noticed, one inside raw weights is not.
  # Flips at several places, each in a fresh copy: at least one restores silently.
  silent = []
  for k in range(1, 8):
    copy = tmp_path / f'copy{k}'
    shutil.copytree(tmp_path / 'ckpt', copy)
    victim = _largest_file(copy / '2' / 'state')
    with open(victim, 'r+b') as f:
      f.seek(os.path.getsize(victim) * k // 8)
      data = f.read(64)
      f.seek(-64, 1)
      f.write(bytes(b ^ 0xFF for b in data))
    got = checkpoint.StageCheckpoints(str(copy), checksums=False).restore(abstract)
    if got is not None:
      step, state, _ = got
      assert step == 2
      with pytest.raises(AssertionError):
        assert_same(state, make_state(2))
      silent.append(k)
  assert silent, 'every flip was noticed by Orbax itself'


def test_a_half_line_in_metrics_jsonl_swallows_nothing_and_fork_survives_it(tmp_path, capsys):
  """A run killed mid-line leaves metrics.jsonl without its last newline: the next writer starts
  a new line (the next record is kept), readers skip the damaged line with a warning naming it,
  and --fork_from copies the good records."""
  from cascade import metrics  # pylint: disable=g-import-not-at-top
  from foundation import paths  # pylint: disable=g-import-not-at-top
  stages = [dict(name='sft', steps=3), dict(name='rl', steps=2)]
  src = tmp_path / 'src'
  _fake_run(src, stages, done={'sft'})
  log = src / 'metrics.jsonl'
  with open(log, 'a') as f:
    f.write('{"stage": "rl", "step": 1, "lo')           # killed mid-line
  w = paths.AppendFile(str(log))
  w.write(json.dumps({'stage': 'rl', 'step': 1, 'loss': 2.0}) + '\n')
  w.close()
  recs = metrics.read_records(str(log))
  assert recs[-1] == {'stage': 'rl', 'step': 1, 'loss': 2.0} and len(recs) == 3
  assert capsys.readouterr().out == f'WARNING: {log}:3: damaged line skipped (Unterminated ' \
                                    'string starting at: line 1 column 28 (char 27))\n'
  mine = ml_collections.ConfigDict(dict(seed=0, model=dict(preset='tiny'), ckpt=dict(keep=1),
                                        stages=stages))
  assert checkpoint.fork(str(src), str(tmp_path / 'dst'), mine) == ['sft']
  got = metrics.read_records(str(tmp_path / 'dst' / 'metrics.jsonl'))
  assert [r.get('stage') or r.get('eval') for r in got] == ['sft', 'sft']
  assert 'damaged line skipped' in capsys.readouterr().out


def test_fork_of_a_bad_source_refuses_in_one_line_and_copies_nothing(tmp_path, monkeypatch):
  """--fork_from checks its source before copying: a garbled progress.json or config.json, or a
  stage whose export differs from its checksums, is one WorkdirError line naming the file, and a
  copy that fails half way takes back what it copied."""
  from cascade import checksums  # pylint: disable=g-import-not-at-top
  from foundation import paths  # pylint: disable=g-import-not-at-top
  stages = [dict(name='sft', steps=3), dict(name='rl', steps=2)]
  mine = ml_collections.ConfigDict(dict(seed=0, model=dict(preset='tiny'), ckpt=dict(keep=1),
                                        stages=stages))

  def fresh(name):
    src = tmp_path / name
    _fake_run(src, stages, done={'sft', 'rl'})
    for st in ('00_sft', '01_rl'):
      checksums.seal(str(src / 'stages' / st / 'hf'))
    dst = tmp_path / f'{name}_dst'
    checkpoint.guard_config(str(dst), mine)
    return src, dst

  def refused(src, dst, match):
    with pytest.raises(checkpoint.WorkdirError, match=match) as e:
      checkpoint.fork(str(src), str(dst), mine)
    assert '\n' not in str(e.value) and str(e.value).endswith('nothing was copied')
    assert sorted(os.listdir(dst)) == ['config.json', 'progress.json']    # guard_config's
    assert not checkpoint.Progress(str(dst)).done

  src, dst = fresh('garbled_progress')
  (src / 'progress.json').write_text('{"done": {"sft"')
  refused(src, dst, rf'--fork_from={src}: {src / "progress.json"} is damaged \(Expecting')
  src, dst = fresh('garbled_config')
  (src / 'config.json').write_text('')
  refused(src, dst, rf'--fork_from={src}: {src / "config.json"} is damaged \(Expecting value')
  src, dst = fresh('bad_export')
  (src / 'stages' / '01_rl' / 'hf' / 'model.safetensors').write_text('weights of rX')
  refused(src, dst, rf'{src / "stages" / "01_rl" / "hf"} is damaged \(checksum mismatch: '
                    r'model.safetensors differs from what was saved')

  src, dst = fresh('disk_fills')
  copy, calls = paths.copy_file, []

  def fails_on_the_third(a, b):
    calls.append(a)
    if len(calls) == 3:
      raise OSError(28, 'No space left on device', b)
    copy(a, b)
  monkeypatch.setattr(paths, 'copy_file', fails_on_the_third)
  with pytest.raises(OSError, match='No space left'):
    checkpoint.fork(str(src), str(dst), mine)
  assert sorted(os.listdir(dst)) == ['config.json', 'progress.json', 'stages']
  assert not os.listdir(dst / 'stages') and not checkpoint.Progress(str(dst)).done
  monkeypatch.setattr(paths, 'copy_file', copy)
  assert checkpoint.fork(str(src), str(dst), mine) == ['sft', 'rl']   # the same command again


@pytest.mark.parametrize('text', ['', '{"done": {"sft": {"index": 0}}, "ro', '[1, 2]'])
def test_a_garbled_progress_json_is_moved_aside_and_a_garbled_config_json_refused(tmp_path,
                                                                                   capsys, text):
  """progress.json can be rebuilt (the stages resume from their checkpoints): a damaged one is
  moved aside with one warning line; config.json cannot: one WorkdirError line naming it."""
  (tmp_path / 'progress.json').write_text(text)
  p = checkpoint.Progress(str(tmp_path))
  assert p.done == {} and p.rows == []
  out = capsys.readouterr().out.strip().splitlines()
  assert len(out) == 1 and out[0].startswith(f'WARNING: {tmp_path / "progress.json"} is damaged (')
  assert out[0].endswith("rebuilding it from the stages' checkpoints")
  assert not (tmp_path / 'progress.json').exists()
  moved = [f for f in os.listdir(tmp_path) if f.startswith('progress.json.damaged.')]
  assert len(moved) == 1 and (tmp_path / moved[0]).read_text() == text
  (tmp_path / 'config.json').write_text(text)
  c = ml_collections.ConfigDict({'seed': 0, 'stages': [{'name': 'a', 'steps': 2}]})
  with pytest.raises(checkpoint.WorkdirError) as e:
    checkpoint.guard_config(str(tmp_path), c, allow_change=True)
  assert str(e.value).startswith(f'{tmp_path / "config.json"} is damaged (')
  assert '\n' not in str(e.value) and (tmp_path / 'config.json').read_text() == text
  # Afresh means a new workdir: moved away, config.json would let another config in.
  assert str(e.value).endswith('restore it from a copy, or start afresh in a new --workdir')


def _repair_run(workdir):
  """A run of sft -> rl -> last whose guard inserted rl_repair after rl (plan positions 00_sft,
  01_rl, 02_rl_repair, 03_last), each finished, with a ledger entry of rl."""
  stages = [dict(name='sft', steps=3), dict(name='rl', steps=2), dict(name='last', steps=1)]
  cfg = ml_collections.ConfigDict(dict(seed=0, model=dict(preset='tiny'), ckpt=dict(keep=1),
                                       stages=stages))
  checkpoint.guard_config(str(workdir), cfg)
  p = checkpoint.Progress(str(workdir))
  for i, name in enumerate(['sft', 'rl', 'rl_repair', 'last']):
    d = workdir / 'stages' / f'{i:02d}_{name}'
    (d / 'ckpt').mkdir(parents=True)
    (d / 'ckpt' / 'state').write_text(f'state of {name}')
    p.mark_done(name, {'index': i, 'kind': 'x'})
    p.add_row({'stage': name, 'index': i, 'scores': {'a': float(i)}})
  p.ledger = [{'stage': 'rl', 'index': 1, 'step': 1, 'set': 'validation', 'scores': {'a': 1.0},
               'stderr': {}, 'ckpt': True}]
  p.save()
  (workdir / 'metrics.jsonl').write_text('{"stage": "sft", "step": 1}\n')
  return cfg


def test_fork_and_a_config_change_find_a_guards_repair_stages_by_name(tmp_path):
  src = tmp_path / 'src'
  cfg = _repair_run(src)
  mine = ml_collections.ConfigDict(cfg.to_dict())
  mine.stages[2] = dict(name='last', steps=7)
  dst = tmp_path / 'dst'
  checkpoint.guard_config(str(dst), mine)
  assert checkpoint.fork(str(src), str(dst), mine) == ['sft', 'rl', 'rl_repair']
  assert (dst / 'stages' / '02_rl_repair' / 'ckpt' / 'state').read_text() == 'state of rl_repair'
  assert not (dst / 'stages' / '03_last').exists()
  assert [e['stage'] for e in checkpoint.Progress(str(dst)).ledger] == ['rl']
  # A change to rl makes rl, its repair and last stale, found by name at their positions.
  changed = ml_collections.ConfigDict(cfg.to_dict())
  changed.stages[1] = dict(name='rl', steps=9)
  checkpoint.guard_config(str(src), changed, allow_change=True)
  p = checkpoint.Progress(str(src))
  assert list(p.done) == ['sft'] and [r['stage'] for r in p.rows] == ['sft'] and not p.ledger
  assert sorted(os.listdir(src / 'stages')) == ['00_sft']
  [old] = os.listdir(src / 'superseded')
  assert sorted(os.listdir(src / 'superseded' / old)) == ['01_rl', '02_rl_repair', '03_last']
