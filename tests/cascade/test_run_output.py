"""What a run prints: library INFO logs (JAX probing for a TPU, the compilation cache, Orbax's
checkpoint manager: hundreds of lines a run) are off by default, warnings always show, and
--verbosity=0 (or -v=0) turns the INFO lines back on (cascade.exits.quiet_library_logs, which
cascade.main, cascade.evaluate, cascade.prepare, cascade.device_check and launch.plan call
first)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# cascade.main's flags and its first call, then a library's and cascade's log lines, each through
# the logger its source uses (JAX: Python logging; Orbax: absl).
_PROBE = '''
import logging as pylogging
from absl import app
from absl import logging
from cascade import exits
from cascade import main as cascade_main

def probe(argv):
  exits.quiet_library_logs()
  pylogging.getLogger('jax._src.xla_bridge').info('library-info')
  logging.info('absl-info')
  pylogging.getLogger('orbax').warning('library-warning')
  logging.warning('cascade-warning')

app.run(probe, flags_parser=cascade_main.parse_flags)
'''


def _probe(tmp_path, *flags):
  script = tmp_path / 'probe.py'
  script.write_text(_PROBE)
  proc = subprocess.run([sys.executable, str(script), '--config=configs/tiny.py:smoke',
                         f'--workdir={tmp_path / "w"}', *flags], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  return [l.rsplit('] ', 1)[-1] for l in proc.stderr.splitlines()]


def test_library_info_is_off_by_default_and_a_flag_turns_it_on(tmp_path):
  assert _probe(tmp_path) == ['library-warning', 'cascade-warning']
  # What `make demo` once passed to get there (its command line no longer does).
  assert _probe(tmp_path, '--verbosity=-1') == ['library-warning', 'cascade-warning']
  assert _probe(tmp_path, '--verbosity=0') == ['library-info', 'absl-info', 'library-warning',
                                               'cascade-warning']


@pytest.mark.heavy
def test_a_run_that_stops_at_its_mesh_prints_one_line(tmp_path, tiny_world_root):
  # JAX's backends start (its 'Unable to initialize backend' INFO line) before the mesh is
  # refused: stderr holds the refusal alone. The user's environment: no test device count, no
  # platform chosen.
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JAX_PLATFORMS')}
  proc = subprocess.run(
      [sys.executable, '-m', 'cascade.main',
       f'--config=configs/tiny.py:smoke,root={tiny_world_root}',
       f'--workdir={tmp_path / "w"}', '--config.mesh.shape=1,4,1'], cwd=REPO,
      capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 2
  assert proc.stderr == ('error: config.mesh.shape=[1, 4, 1]: mesh shape (1, 4, 1) needs 4 '
                         'devices, have 1\n')


def test_a_prepare_that_stops_prints_its_line_alone(tmp_path):
  """cascade.prepare's error exit in the user's environment (no platform chosen, no test device
  count, so JAX probes for a TPU and logs 'Unable to initialize backend' at INFO before the
  error): stderr holds cascade's one line and nothing of the libraries'."""
  config = tmp_path / 'no_tokenizer.py'
  config.write_text('from configs import tiny\n\n\ndef get_config(arg=None):\n'
                    "  c = tiny.get_config('smoke')\n  del c['prepare']\n"
                    f"  c.tokenizer.path = {str(tmp_path / 'missing.model')!r}\n  return c\n")
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JAX_PLATFORMS')}
  env['PYTHONPATH'] = REPO
  proc = subprocess.run([sys.executable, '-m', 'cascade.prepare', f'--config={config}',
                         f'--cache_dir={tmp_path / "cache"}'], cwd=REPO, capture_output=True,
                        text=True, timeout=300, env=env)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr == f'error: tokenizer file {tmp_path / "missing.model"} does not exist\n'
