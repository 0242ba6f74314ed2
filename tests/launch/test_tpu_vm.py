"""launch/tpu_vm.sh: each command asks gcloud for the right thing (a stand-in gcloud records it)."""

import os
import pathlib
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / 'launch' / 'tpu_vm.sh'


@pytest.fixture
def fake_gcloud(tmp_path):
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  log = tmp_path / 'calls.txt'
  gcloud = bin_dir / 'gcloud'
  gcloud.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$*" >> "$GCLOUD_LOG"\n')
  gcloud.chmod(0o755)
  env = dict(os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}', GCLOUD_LOG=str(log))
  return env, log


def _run(env, *args, cwd=None):
  return subprocess.run(['bash', str(SCRIPT), *args], env=env, cwd=cwd, capture_output=True,
                        text=True, timeout=120)


def test_create_install_run_delete(fake_gcloud, tmp_path):
  env, log = fake_gcloud
  checkout = tmp_path / 'checkout'
  (checkout / 'cascade').mkdir(parents=True)
  (checkout / 'setup.py').write_text('')
  assert _run(env, 'create', 'tpu1', 'us-east5-a', 'v5p-128').returncode == 0
  assert _run(env, 'install', 'tpu1', 'us-east5-a', cwd=checkout).returncode == 0
  p = _run(env, 'run', 'tpu1', 'us-east5-a', 'configs/nemotron_cascade_14b.py',
           'gs://bucket/runs/c14b', '--config.seed=3')
  assert p.returncode == 0 and 'started on all hosts' in p.stdout
  assert _run(env, 'delete', 'tpu1', 'us-east5-a').returncode == 0
  create, scp, install, run, delete = log.read_text().split('\0')[:-1]
  assert create == ('compute tpus tpu-vm create tpu1 --zone=us-east5-a '
                    '--accelerator-type=v5p-128 --version=v2-alpha-tpuv5')
  assert scp.startswith('compute tpus tpu-vm scp /tmp/cascade-src.tgz tpu1:~/ ') and \
      '--worker=all' in scp
  assert '--worker=all' in install and '.venv/bin/pip install -q -e ".[tpu]"' in install
  assert 'CASCADE_DISTRIBUTED=auto' in run and '-m cascade.main' in run
  assert '--config=configs/nemotron_cascade_14b.py --workdir=gs://bucket/runs/c14b' in run
  assert '--config.seed=3' in run
  assert delete == 'compute tpus tpu-vm delete tpu1 --zone=us-east5-a --quiet'


def test_unknown_command_and_missing_arguments(fake_gcloud):
  env, log = fake_gcloud
  p = _run(env, 'resize', 'tpu1', 'zone')
  assert p.returncode == 2 and 'unknown command resize' in p.stderr
  p = _run(env, 'run', 'tpu1', 'zone')
  assert p.returncode != 0 and 'config file' in p.stderr
  assert not log.exists()


def _names(tgz):
  import tarfile  # pylint: disable=g-import-not-at-top
  with tarfile.open(tgz) as t:
    return {n[2:] if n.startswith('./') else n for n in t.getnames()}


def test_install_packs_the_repository_root_from_anywhere(fake_gcloud, tmp_path):
  # The tarball install copies is the checkout the script belongs to, not the folder it is
  # called from: in a git checkout, what git tracks and does not ignore (no .venv, runs, .git).
  env, _ = fake_gcloud
  out = tmp_path / 'src.tgz'
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  (elsewhere / 'stray.txt').write_text('not cascade')
  p = _run(env, 'pack', str(out), cwd=elsewhere)
  assert p.returncode == 0, p.stderr
  names = _names(out)
  root = SCRIPT.parents[1]
  tracked = set(subprocess.run(['git', '-C', str(root), 'ls-files'], capture_output=True,
                               text=True, check=True).stdout.split())
  assert {'setup.py', 'launch/tpu_vm.sh', 'cascade/main.py', 'LICENSE'} <= names
  assert {n for n in tracked if (root / n).exists()} <= names
  assert 'stray.txt' not in names
  assert not [n for n in names if n.split('/')[0] in ('.venv', 'runs', '.git')
              or '__pycache__' in n]


def test_pack_outside_git_leaves_out_the_environment_and_runs(tmp_path):
  # A checkout without git (e.g. unpacked from a tarball): everything but .venv, runs, caches.
  tree = tmp_path / 'cascade-src'
  (tree / 'launch').mkdir(parents=True)
  (tree / 'launch' / 'tpu_vm.sh').write_text(SCRIPT.read_text())
  for f in ('setup.py', 'cascade/main.py', '.venv/bin/python', 'runs/r/config.json',
            'cascade/__pycache__/main.cpython-311.pyc', 'cascade.egg-info/PKG-INFO'):
    (tree / f).parent.mkdir(parents=True, exist_ok=True)
    (tree / f).write_text('x')
  out = tmp_path / 'src.tgz'
  p = subprocess.run(['bash', str(tree / 'launch' / 'tpu_vm.sh'), 'pack', str(out)],
                     cwd=tmp_path, capture_output=True, text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  files = {n for n in _names(out) if not (tree / n).is_dir()}
  assert files == {'setup.py', 'cascade/main.py', 'launch/tpu_vm.sh'}


def test_run_quotes_each_override_for_the_remote_shell(fake_gcloud):
  env, log = fake_gcloud
  p = _run(env, 'run', 'tpu1', 'zone', 'configs/tiny.py:smoke', 'gs://b/w',
           '--config.stages["math-rl"].steps=3', '--config.seed=1')
  assert p.returncode == 0, p.stderr
  [run] = log.read_text().split('\0')[:-1]
  remote = run.split('--command=', 1)[1]
  assert r'--config.stages\[\"math-rl\"\].steps=3 --config.seed=1 > run.log' in remote
  # The remote shell reads it back as the arguments given.
  words = subprocess.run(['bash', '-c', 'printf "%s\\n" ' + remote.split('cascade.main', 1)[1]
                          .split('>', 1)[0]], capture_output=True, text=True).stdout.split('\n')
  assert words[:4] == ['--config=configs/tiny.py:smoke', '--workdir=gs://b/w',
                       '--config.stages["math-rl"].steps=3', '--config.seed=1']
