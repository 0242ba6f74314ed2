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
