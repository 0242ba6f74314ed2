"""The persistent compilation cache (cascade/compile_cache.py): a fresh process loads what an
earlier one compiled (XLA:CPU executables included), the counts say so, JAX's own settings are
kept unless the config names others, and config.compilation_cache is checked and left out of the
config hash."""

import importlib
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from cascade import checkpoint
from cascade import compile_cache
from cascade import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(REPO, 'tests', 'faults.py')

# A fresh process: enables the cache, compiles one small program, prints what happened.
_PROGRAM = '''
import dataclasses, json, sys
import jax
import jax.numpy as jnp
from cascade import compile_cache
from cascade import distributed
distributed.initialize()      # JAX_COORDINATOR_ADDRESS etc. when the test starts several
path, default, secs = json.loads(sys.argv[1])
cache = compile_cache.enable(path, default=default, min_compile_secs=secs)

@jax.jit
def f(x):
  for _ in range(6):
    x = jnp.tanh(x @ x.T)
  return x.sum()

f(jnp.ones((16, 16))).block_until_ready()
out = dict(process=jax.process_index(), jax_dir=jax.config.jax_compilation_cache_dir,
           jax_secs=jax.config.jax_persistent_cache_min_compile_time_secs)
if cache is not None:
  n = cache.since()
  out.update(dataclasses.asdict(n), compiled=n.compiled, dir=cache.dir, stored=cache.stored(),
             secs=cache.min_compile_secs)
compile_cache.restore()
out['restored_dir'] = jax.config.jax_compilation_cache_dir
print(json.dumps(out))
'''


def _env(**extra):
  env = dict(os.environ)
  for k in ('XLA_FLAGS', 'JAX_COMPILATION_CACHE_DIR', 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS',
            'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', 'JAX_ENABLE_COMPILATION_CACHE'):
    env.pop(k, None)
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=REPO, **extra)
  return env


def _process(path, default, secs, **env):
  p = subprocess.run([sys.executable, '-c', _PROGRAM, json.dumps([path, default, secs])],
                     env=_env(**env), cwd=REPO, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_fresh_process_loads_what_an_earlier_one_compiled(tmp_path):
  cache = str(tmp_path / 'cache')
  first = _process(cache, 'unused', 0.0)
  assert first['dir'] == first['jax_dir'] == cache and first['secs'] == 0.0
  # Every program (f and the small ones jnp.ones makes) is compiled and, at 0 s, written:
  # XLA:CPU executables are cached in this JAX.
  assert first['loaded'] == 0 and first['compiled'] >= 2
  assert first['written'] == first['compiled'] == first['stored']
  second = _process(cache, 'unused', 0.0)
  assert second['loaded'] == first['compiled'] and second['compiled'] == 0
  assert second['written'] == 0 and second['stored'] == first['stored']
  assert second['restored_dir'] is None            # JAX's own setting (none) is back


def test_a_cloud_storage_cache_serves_a_fresh_process(gcs):
  cache = f'{gcs.root}/runs/compilation_cache'
  first = _process(cache, 'unused', 0.0)
  assert first['dir'] == cache and first['compiled'] == first['written'] == first['stored'] >= 2
  second = _process(cache, 'unused', 0.0)
  assert second['loaded'] == first['compiled'] and second['compiled'] == 0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.multiprocess
def test_on_several_hosts_every_process_reads_and_only_process_0_writes(tmp_path):
  cache = str(tmp_path / 'cache')
  env = _env(JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{_free_port()}', JAX_NUM_PROCESSES='2')
  procs = [subprocess.Popen([sys.executable, '-c', _PROGRAM, json.dumps([cache, 'unused', 0.0])],
                            env={**env, 'JAX_PROCESS_ID': str(i)}, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=300))      # a hang fails here, not forever
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
  first, second = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
  assert (first['process'], second['process']) == (0, 1)
  assert first['written'] == first['compiled'] >= 2 and second['written'] == 0
  # Process 1 compiled what process 0 had not written yet when it looked, and loaded the rest.
  assert second['loaded'] + second['compiled'] == second['looked_up'] == first['looked_up']
  assert len(os.listdir(cache)) == first['written']


def test_slow_compiles_only_are_written(tmp_path):
  cache = str(tmp_path / 'cache')
  first = _process(cache, 'unused', 60.0)          # nothing takes a minute to compile
  assert first['compiled'] >= 2 and first['written'] == first['stored'] == 0
  assert _process(cache, 'unused', 60.0)['loaded'] == 0


def test_jaxs_own_settings_stand_unless_the_config_names_others(tmp_path):
  own = str(tmp_path / 'own')
  jax_env = dict(JAX_COMPILATION_CACHE_DIR=own, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  # None: JAX's own directory and threshold (not the run's default); restore gives them back.
  out = _process(None, str(tmp_path / 'default'), None, **jax_env)
  assert out['dir'] == own and out['secs'] == 0.0 and out['written'] >= 2
  assert out['restored_dir'] == own and not (tmp_path / 'default').exists()
  # No setting of JAX's: the default directory.
  out = _process(None, str(tmp_path / 'default'), None)
  assert out['dir'] == str(tmp_path / 'default') and out['secs'] == 1.0   # JAX's default 1 s
  # '' turns the cache off even where JAX's setting names a directory.
  out = _process('', 'unused', None, **jax_env)
  assert 'dir' not in out and out['jax_dir'] is None and out['restored_dir'] == own
  # JAX's switch turns it off too.
  out = _process(str(tmp_path / 'x'), 'unused', 0.0, JAX_ENABLE_COMPILATION_CACHE='false')
  assert 'dir' not in out and not (tmp_path / 'x').exists()


def test_counts_are_differences_of_the_events():
  a = compile_cache.Counts(looked_up=7, loaded=4, written=2)
  b = compile_cache.Counts(looked_up=2, loaded=1, written=0)
  assert a.minus(b) == compile_cache.Counts(looked_up=5, loaded=3, written=2)
  assert a.compiled == 3
  assert a.describe() == '4 programs loaded, 3 compiled (2 written)'
  assert set(compile_cache.EVENTS) == {'/jax/compilation_cache/compile_requests_use_cache',
                                       '/jax/compilation_cache/cache_hits',
                                       '/jax/compilation_cache/cache_misses'}


def _tiny():
  return importlib.import_module('configs.tiny').get_config('smoke,root=/pinned/world')


@pytest.mark.parametrize('section,message', [
    (dict(dir=3), 'config.compilation_cache.dir=3: must be a string'),
    (dict(dir='s3://bucket/cache'), "config.compilation_cache.dir='s3://bucket/cache': "
                                    'unsupported scheme s3:// (supported: local paths and gs://)'),
    (dict(min_compile_secs=-1.0), 'config.compilation_cache.min_compile_secs=-1.0: must be a '
                                  'finite number >= 0'),
    (dict(min_compile_secs=float('nan')), 'config.compilation_cache.min_compile_secs=nan: must'),
    (dict(min_compile_secs='1'), "config.compilation_cache.min_compile_secs='1': must be a"),
    (dict(max_size=10), 'config.compilation_cache.max_size: unknown field (known: dir, '
                        'min_compile_secs)'),
])
def test_bad_settings_name_the_field(section, message):
  config = _tiny()
  config.compilation_cache = section
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
  assert str(e.value).startswith(message), str(e.value)


def test_the_section_is_typed_and_left_out_of_the_config_hash():
  config = _tiny()
  plan = config_lib.validate(config)
  assert plan.compilation_cache == config_lib.CompilationCache(dir=None, min_compile_secs=None)
  before = checkpoint.config_hash(config)
  config.compilation_cache.dir = 'gs://bucket/cache'      # typed: the command line can set it
  config.compilation_cache.min_compile_secs = 0
  plan = config_lib.validate(config)
  assert plan.compilation_cache == config_lib.CompilationCache(dir='gs://bucket/cache',
                                                                min_compile_secs=0.0)
  assert checkpoint.config_hash(config) == checkpoint.config_hash(plan.source) == before


def test_a_command_line_setting_is_checked_as_one_line(tmp_path):
  p = subprocess.run(
      [sys.executable, '-m', 'cascade.main', '--config=configs/tiny.py:smoke',
       f'--workdir={tmp_path / "w"}', '--config.compilation_cache.min_compile_secs=-2',
       # docs/config.md's form: a gs:// cache set on the command line (valid; the bad value is refused)
       '--config.compilation_cache.dir=gs://bucket/jax_cache'],
      env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
  assert p.returncode == 2, p.stderr[-3000:]
  assert p.stderr.strip() == ('error: config.compilation_cache.min_compile_secs=-2.0: must be a '
                              'finite number >= 0'), p.stderr


_COUNTS = re.compile(r'(\d+) programs loaded, (\d+) compiled \((\d+) written\)')


def _counts(line):
  return tuple(map(int, _COUNTS.search(line).groups()))


def test_a_resumed_run_loads_its_programs_from_the_workdirs_cache(tmp_path, copy_cascade):
  # On a mesh (here of the one CPU device) the train step is jitted with explicit shardings, so a
  # restored state lowers to the same program as a fresh one. (Without a mesh it does not: the
  # restored arrays are committed to their device, the fresh ones are not, and the resumed train
  # step is compiled again.)
  config = copy_cascade(tmp_path, train=8, eval_=4, sft=16, sft_steps=2, rl_steps=1,
                        mesh_shape=(-1, 1, 1))
  workdir, cache = tmp_path / 'run', tmp_path / 'run' / 'compilation_cache'
  # Every program written; JAX's compiler logs each program it loads.
  env = _env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_DEBUG_LOG_MODULES='jax._src.compiler')

  def run(*main):
    p = subprocess.run([sys.executable, *main, f'--config={config}', f'--workdir={workdir}'],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    return p, p.stdout.splitlines()

  # Stopped (SIGTERM) with a checkpoint after SFT's first step: everything compiled and written.
  p, out = run(FAULTS, '--signal_at=sft:1:SIGTERM')
  assert p.returncode == 75, f'{p.stdout[-3000:]}\n{p.stderr[-3000:]}'
  assert f'compilation cache: {cache} (0 programs stored; those that take 0 s or more to ' \
         'compile are written)' in out
  assert out[-1].startswith(f'compilation cache {cache}: ') and out[-1].endswith(' in this run')
  loaded, compiled, written = _counts(out[-1])
  assert loaded == 0 and compiled == written > 0
  assert sum(f.name.endswith('-cache') for f in cache.iterdir()) == written
  # Resumed to the end: SFT's train step is loaded, not compiled; each stage's line and the
  # run's last cache line say how many programs were loaded.
  p, out = run('-m', 'cascade.main')
  assert p.returncode == 0, f'{p.stdout[-3000:]}\n{p.stderr[-3000:]}'
  assert '[0] sft: resuming at step 1/2' in out
  assert "Persistent compilation cache hit for 'jit_step'" in p.stderr
  assert any(line.startswith(f'compilation cache: {cache} ({written} programs stored; ')
             for line in out)
  sft = next(line for line in out if line.startswith('[0] sft: compilation cache: '))
  assert _counts(sft)[0] >= 1, sft
  assert any(line.startswith('[1] copy_rl: compilation cache: ') for line in out)
  total = next(line for line in out if line.startswith(f'compilation cache {cache}: '))
  assert total.endswith(' in this run') and _counts(total)[0] >= _counts(sft)[0]

