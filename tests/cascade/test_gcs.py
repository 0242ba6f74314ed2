"""gs:// end to end against a local Cloud Storage emulator (gcp-storage-emulator).

Every client the run uses is pointed at the emulator: gcsfs (epath's gs://
backend: the path layer, metrics, TensorBoard, exports, datasets, the
tokenizer) through STORAGE_EMULATOR_HOST, and Orbax's tensorstore through
TENSORSTORE_GCS_HTTP_URL with GOOGLE_AUTH_TOKEN_FOR_TESTING (its test token
provider). Nothing leaves the loopback interface.

The emulator is the `gcs` fixture of tests/conftest.py, with one fix: its
object downloads lack the `x-goog-generation` header real Cloud Storage sends,
from which tensorstore takes the generation of its conditional OCDBT manifest
writes ("Malformed StorageGeneration" without it). It does not enforce
`ifGenerationMatch`, so those conditions are sent but not checked here (one
writer per object anyway).

Fast: the path layer's operations, a checkpoint save/restore, progress and
metrics round trips, an HF export and tokenizer read back, bad paths as one
line. Slow: the smoke cascade with --workdir=gs://... and its world on gs://,
SIGKILLed mid-run and resumed, ends with the matrix of an uninterrupted local run.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import types

import numpy as np
import pytest

pytest.importorskip('gcsfs', reason="gs:// needs gcsfs: pip install -e '.[gcs]'")
pytest.importorskip('gcp_storage_emulator', reason="the emulator: pip install -e '.[test]'")

from foundation import paths  # noqa: E402  pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(REPO, 'tests', 'faults.py')   # cascade.main with a test's kill hook
BUCKET = 'bucket'                  # the gcs fixture's bucket (tests/conftest.py)


def test_path_layer_on_the_emulator(gcs, tmp_path):
  root = gcs.root + '/layer'
  paths.write_json(paths.join(root, 'a', 'p.json'), {'x': [1, 2]})
  assert paths.read_json(paths.join(root, 'a', 'p.json')) == {'x': [1, 2]}
  assert paths.exists(paths.join(root, 'a')) and paths.isdir(paths.join(root, 'a'))
  assert not paths.exists(paths.join(root, 'nothing'))
  assert paths.read_json(paths.join(root, 'nothing.json'), 'dflt') == 'dflt'
  # Uploads from local files and back, whole directories, moves.
  (tmp_path / 'd' / 'sub').mkdir(parents=True)
  (tmp_path / 'd' / 'config.json').write_text('{}')
  (tmp_path / 'd' / 'sub' / 'w.bin').write_bytes(b'\0\1\2')
  paths.copy_tree(tmp_path / 'd', paths.join(root, 'd'), last=('config.json',))
  assert paths.listdir(paths.join(root, 'd')) == ['config.json', 'sub']
  with paths.local_file(paths.join(root, 'd', 'sub', 'w.bin')) as local:
    assert open(local, 'rb').read() == b'\0\1\2'
  assert not os.path.exists(local)                     # the temporary copy is gone
  with paths.local_target(paths.join(root, 'made.bin')) as local:
    with open(local, 'wb') as f:
      f.write(b'xyz')
  assert paths.read_bytes(paths.join(root, 'made.bin')) == b'xyz'
  paths.move_tree(paths.join(root, 'd'), paths.join(root, 'corrupt', 'd'))
  assert not paths.exists(paths.join(root, 'd', 'config.json'))
  assert paths.read_bytes(paths.join(root, 'corrupt', 'd', 'sub', 'w.bin')) == b'\0\1\2'
  paths.remove(paths.join(root, 'made.bin'))
  paths.rmtree(paths.join(root, 'corrupt'))
  assert paths.listdir(root) == ['a']
  # Object stores cannot append: the file is rewritten whole when flushed.
  log = paths.join(root, 'm.jsonl')
  f = paths.AppendFile(log, every_s=3600)
  f.write('1\n')
  assert not paths.exists(log)                         # not yet flushed
  f.flush(force=True)
  f.write('2\n')
  f.close()
  f = paths.AppendFile(log)
  f.write('3\n')
  f.close()
  assert paths.read_text(log) == '1\n2\n3\n'


def test_listings_see_objects_other_clients_wrote(gcs):
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  d = gcs.root + '/shared'
  paths.write_text(paths.join(d, 'a'), 'a')
  assert paths.listdir(d) == ['a']
  # Another writer (here tensorstore, as under Orbax; or another host) adds an object.
  kv = ts.KvStore.open({'driver': 'gcs', 'bucket': BUCKET, 'path': 'shared/'}).result()
  kv.write('b', b'b').result()
  assert paths.listdir(d) == ['a', 'b'] and paths.exists(paths.join(d, 'b'))


def test_bad_remote_paths_are_one_line_naming_the_path(gcs):
  with pytest.raises(paths.PathError) as e:
    paths.write_text('gs://no-such-bucket/run/x.json', '{}')
  assert str(e.value).startswith('gs://no-such-bucket/run/x.json: cannot write it: ')
  assert '\n' not in str(e.value)
  with pytest.raises(FileNotFoundError, match='gs://bucket/none.txt'):
    paths.read_text('gs://bucket/none.txt')


def test_checkpoint_progress_metrics_and_results_round_trip(gcs):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from cascade import checkpoint  # pylint: disable=g-import-not-at-top
  from cascade import evaluation  # pylint: disable=g-import-not-at-top
  from cascade import metrics  # pylint: disable=g-import-not-at-top

  workdir = gcs.root + '/rt'
  flushed = []
  ckpts = checkpoint.StageCheckpoints(paths.join(workdir, 'stages', '00_sft', 'ckpt'), keep=1,
                                      before_save=lambda: flushed.append(1))
  assert ckpts.directory == 'gs://bucket/rt/stages/00_sft/ckpt'      # not ./gs:/bucket/...
  state = {'w': jnp.arange(6.0).reshape(2, 3), 'step': jnp.int32(2)}
  for step in (1, 2):
    ckpts.save(step, jax.tree.map(lambda x: x * step, state), {'step': step, 'data': {'i': step}})
  ckpts.wait()
  assert ckpts.steps() == [2] and flushed == [1, 1]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])), state)
  ckpts.close()
  again = checkpoint.StageCheckpoints(paths.join(workdir, 'stages', '00_sft', 'ckpt'), keep=1)
  step, restored, meta = again.restore(abstract)
  assert step == 2 and meta == {'step': 2, 'data': {'i': 2}}
  np.testing.assert_array_equal(restored['w'], np.arange(6.0).reshape(2, 3) * 2)
  again.close()

  progress = checkpoint.Progress(workdir)
  progress.mark_done('sft', {'index': 0, 'final_step': 2})
  assert checkpoint.Progress(workdir).done == {'sft': {'index': 0, 'final_step': 2}}

  stage = types.SimpleNamespace(name='sft', index=0, kind='sft')
  w = metrics.Writer(workdir, enabled=True)
  w.write(stage, 1, {'loss': 1.5})
  w.flush()
  w.write(stage, 2, {'loss': 1.0})
  w.close()
  lines = [json.loads(l) for l in paths.read_text(paths.join(workdir, 'metrics.jsonl'))
           .splitlines()]
  assert [(m['step'], m['loss']) for m in lines] == [(1, 1.5), (2, 1.0)]
  events = paths.listdir(paths.join(workdir, 'tb'))
  assert len(events) == 1 and events[0].startswith('events.out.tfevents')
  assert paths.read_bytes(paths.join(workdir, 'tb', events[0]))        # not empty

  rows = [{'stage': 'sft', 'domains': ['a'], 'scores': {'a': 50.0}}]
  evaluation.write(workdir, rows, ['a'])
  assert json.loads(paths.read_text(paths.join(workdir, 'results.json')))['scores'] == [[50.0]]
  assert paths.read_bytes(paths.join(workdir, 'results.png'))[:4] == b'\x89PNG'


def test_sweep_root_on_gcs(gcs):
  from launch import sweep  # pylint: disable=g-import-not-at-top
  root = 'gs://bucket/sweep'
  code = sweep.run_point([sys.executable, '-c', 'print("point ran")'], f'{root}/000_a')
  assert code == 0 and paths.read_text(f'{root}/000_a/sweep.log') == 'point ran\n'
  paths.write_json(f'{root}/000_a/results.json', {'domains': ['math'], 'scores': [[10.0], [40.0]]})
  summary = sweep.summarise(root, ['000_a', '001_b'], [{'seed': 0}, {'seed': 1}], [0, 2])
  assert [p['final'] for p in summary['points']] == [{'math': 40.0}, None]
  assert paths.read_text(f'{root}/summary.md').splitlines()[2] == '| 000_a | 40.0 | 40.0 | ok |'
  assert paths.read_bytes(f'{root}/summary.png')[:4] == b'\x89PNG'
  assert paths.read_json(f'{root}/summary.json')['points'][1]['returncode'] == 2


def test_hf_export_and_tokenizer_read_from_gcs(gcs, tmp_path):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from models import config as model_config  # pylint: disable=g-import-not-at-top
  from models import hf  # pylint: disable=g-import-not-at-top
  from foundation import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from models import transformer  # pylint: disable=g-import-not-at-top

  cfg = model_config.ModelConfig.tiny().replace(vocab_size=300, num_layers=1)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  out = gcs.root + '/hf/m'
  hf.save_model(model, out)
  assert paths.listdir(out) == ['config.json', 'model.safetensors']
  back = hf.load_model(out)
  for (k, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                            nnx.to_flat_state(nnx.state(back, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), k)

  tok = tokenizer_lib.train_sentencepiece([f'word{i % 9} {i}' for i in range(200)],
                                          tmp_path / 'tok', vocab_size=300)
  paths.copy_file(tmp_path / 'tok.model', gcs.root + '/tok/tokenizer.model')
  remote = tokenizer_lib.load(gcs.root + '/tok')                       # a directory on gs://
  assert remote.encode('word3 17') == tok.encode('word3 17')


def _cli_env(gcs, cache):
  env = dict(os.environ, **gcs.env)
  env.pop('XLA_FLAGS', None)                       # one CPU device, as `make demo` runs
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=REPO, JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='-1')
  return env


def _smoke(workdir, world_root, env, check=True, kill_at=None):
  main = [FAULTS, f'--kill_at={kill_at}'] if kill_at else ['-m', 'cascade.main']
  cmd = [sys.executable, *main,
         f'--config={REPO}/configs/tiny.py:smoke,root={world_root}', f'--workdir={workdir}',
         '--config.ckpt.every_n_steps=1', '--verbosity=-1']    # a checkpoint per step to kill at
  p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
  if check and p.returncode:
    raise AssertionError(f'exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}')
  return p


@pytest.mark.heavy
def test_bad_workdir_bucket_is_one_line(gcs, tmp_path):
  p = _smoke('gs://no-such-bucket/run', tmp_path / 'world', _cli_env(gcs, tmp_path / 'cache'),
             check=False)
  assert p.returncode == 2, p.stderr[-3000:]
  last = p.stderr.strip().splitlines()[-1]
  # The lock is the run's first write.
  assert last.startswith("error: gs://no-such-bucket/run/lock.json: cannot create it: no bucket "
                         "'no-such-bucket'"), last
  assert 'Traceback' not in p.stderr


@pytest.mark.slow
def test_smoke_cascade_on_gcs_killed_and_resumed_matches_local(gcs, tmp_path):
  if not shutil.which('bwrap'):
    pytest.skip('the tiny cascade runs code in bubblewrap (make sysdeps)')
  cache = tmp_path / 'jax_cache'
  env = _cli_env(gcs, cache)
  local = tmp_path / 'local'
  _smoke(local, tmp_path / 'world', env)
  # "accounting" (where step time went) is timing, "configs" the configs' hashes (the two runs'
  # data paths differ, gs:// and local): the matrix and the rest must match.
  matrix = lambda res: {k: v for k, v in res.items() if k not in ('accounting', 'configs')}
  want = matrix(json.loads((local / 'results.json').read_text()))

  workdir, world = gcs.root + '/run', gcs.root + '/world'
  killed = _smoke(workdir, world, env, check=False, kill_at='math_rl:1')
  assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
  # The world was built locally and uploaded (stamp last); data and tokenizer are read from it.
  assert paths.exists(paths.join(world, 'seed0', 'stamp.json'))
  assert paths.exists(paths.join(world, 'seed0', 'tokenizer.model'))
  progress = paths.read_json(paths.join(workdir, 'progress.json'))
  assert 'if_rl' in progress['done'] and 'math_rl' not in progress['done']
  assert paths.exists(paths.join(workdir, 'stages', '02_rlhf', 'hf', 'config.json'))

  resumed = _smoke(workdir, world, env)
  assert '[4] math_rl: resuming at step 1/' in resumed.stdout, resumed.stdout[-3000:]
  assert matrix(json.loads(paths.read_text(paths.join(workdir, 'results.json')))) == want
  lines = [json.loads(l) for l in paths.read_text(paths.join(workdir, 'metrics.jsonl'))
           .splitlines()]
  assert {(m['stage'], m['step']) for m in lines if 'stage' in m} == {
      (s, i) for s in ('sft', 'rm', 'rlhf', 'if_rl', 'math_rl', 'code_rl', 'swe_rl')
      for i in (1, 2)}
  assert paths.exists(paths.join(workdir, 'stages', '06_swe_rl', 'hf', 'model.safetensors'))
  assert not os.path.exists(os.path.join(REPO, 'gs:'))          # nothing went to ./gs:/...


def test_workdir_lock_on_gcs(gcs):
  """The workdir lock works on an object store: created only if absent, a second taker refused
  naming the holder, a forced one takes over, release removes it."""
  from cascade import lock  # pylint: disable=g-import-not-at-top
  workdir = gcs.root + '/locked'
  assert paths.create_new(paths.join(workdir, 'x'), b'1')
  assert not paths.create_new(paths.join(workdir, 'x'), b'2')
  assert paths.read_bytes(paths.join(workdir, 'x')) == b'1'
  held = lock.take(workdir)
  with pytest.raises(lock.WorkdirBusy, match=rf'{workdir} is in use by another run: host .*, '
                                             rf'pid {os.getpid()}, since '):
    lock.take(workdir)
  held.release()
  assert not paths.exists(paths.join(workdir, lock.LOCK_FILE))
  held = lock.take(workdir)
  lock.take(workdir, force=True).release()
  held.release()                  # taken over: it leaves the new holder's record alone (gone now)
  assert not paths.exists(paths.join(workdir, lock.LOCK_FILE))
