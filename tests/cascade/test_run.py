"""Checks `cascade.run` makes before the first step, and the package's light import."""

import subprocess
import sys

import ml_collections
import pytest

from cascade import config as config_lib
from cascade import runner


def _plan(prompts, group, rm_batch, microbatches=1):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny')
  c.tokenizer = dict(path='/tok.model')
  c.mesh = dict(shape=None)
  c.sampler = dict()
  c.ckpt = dict(every_n_steps=0, keep=1)
  c.eval = dict(num_samples=1, temperature=1.0, top_p=1.0, max_new_tokens=8, max_prompt_len=8,
                num_prompts=0, batch_size=8)
  c.datasets = dict(p=dict(path='/p.jsonl', format='prompt', domain='a'),
                    pref=dict(path='/q.jsonl', format='preference', domain='a'))
  c.domains = dict(a=dict(verifier='math', train='p', eval='p'))
  c.stages = [dict(name='rm', kind='reward_model', domains=['a'], datasets=['pref'], steps=1,
                   batch_size=rm_batch, max_len=16, optimizer=dict(lr=1.0)),
              dict(name='rl', kind='grpo', domains=['a'], steps=1, optimizer=dict(lr=1.0),
                   prompts_per_step=prompts, group_size=group, max_prompt_len=8,
                   max_response_len=8, microbatches=microbatches)]
  return config_lib.validate(c, known_verifiers=['math'], known_formats={
      'prompt': 'prompt', 'preference': 'preference'})


def test_batch_rows_must_split_over_microbatches_and_batch_shards(monkeypatch):
  def check(plan, shards):
    monkeypatch.setattr(runner.sharding, 'batch_shards', lambda mesh, rules: shards)
    with pytest.raises(_Built):    # the rows check passed; stop before loading a tokenizer
      runner.make_context(plan, '/nonexistent')
  monkeypatch.setattr(runner.tokenizer_lib, 'load', _raise_built)
  check(_plan(prompts=2, group=4, rm_batch=8, microbatches=2), 4)
  with pytest.raises(config_lib.ConfigError, match=r"stages\[0\] 'rm': batch_size = 4 rows do "
                                                   r'not split over 1 microbatches x 8 batch'):
    check(_plan(prompts=2, group=4, rm_batch=4), 8)
  with pytest.raises(config_lib.ConfigError, match=r"stages\[1\] 'rl': prompts_per_step \* "
                                                   r'group_size = 8 rows do not split over 2'):
    check(_plan(prompts=2, group=4, rm_batch=8, microbatches=2), 8)


class _Built(Exception):
  pass


def _raise_built(path):
  raise _Built(path)


def test_cascade_run_is_callable_and_the_import_is_light():
  code = ('import sys, cascade\n'
          'assert "jax" not in sys.modules and callable(cascade.run)\n'
          'from cascade import runner\n'
          'assert callable(runner.run)\n')
  subprocess.run([sys.executable, '-c', code], check=True)


@pytest.mark.parametrize('override,message', [
    ('--config.bogus=1', "error: --config.bogus: config has no field 'bogus' (known: "
                         'allow_config_change, ckpt, '),
    ('--config.stages[4].bogus=1', "error: --config.stages[4].bogus: config.stages[4] has no "
                                   "field 'bogus' (known: "),
    ('--config.stages[42].steps=1', 'error: --config.stages[42].steps: config.stages has 7 '
                                    'stages, no [42] (by position: [0] sft, '),
    ('--config.stages[2].optimizer.lr=inf', "error: stages[2] 'rlhf': optimizer.lr=inf: must be > 0"),
    ('--config.stages[3].temperature=inf', "error: stages[3] 'if_rl': temperature=inf: must be > 0"),
    ('--config.stages.math_rl.temperature=inf',
     "error: stages[4] 'math_rl': temperature=inf: must be > 0"),
])
def test_command_line_mistakes_are_one_line(tmp_path, override, message):
  import os  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run(
      [sys.executable, '-m', 'cascade.main', '--config=configs/tiny.py:smoke',
       f'--workdir={tmp_path / "w"}', override], cwd=repo, capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], proc.stderr
  assert not (tmp_path / 'w').exists() or not os.listdir(tmp_path / 'w')   # nothing written


def test_an_unusable_workdir_is_one_line(tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  (tmp_path / 'file').write_text('not a directory')
  proc = subprocess.run(
      [sys.executable, '-m', 'cascade.main', '--config=configs/tiny.py:smoke',
       f'--workdir={tmp_path / "file" / "run"}'], cwd=repo, capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and str(tmp_path / 'file') in lines[0] and 'Not a directory' in lines[0]


def test_a_run_without_bubblewrap_stops_with_one_line(tmp_path, tiny_world_root):
  # The code domain's sandbox refuses to start without bubblewrap (no bwrap on PATH here): the
  # run ends with exit 2 and the refusal as its last line, no traceback.
  import os  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PATH=os.path.dirname(sys.executable))
  proc = subprocess.run(
      [sys.executable, '-m', 'cascade.main',
       f'--config=configs/tiny.py:smoke,root={tiny_world_root}',
       f'--workdir={tmp_path / "w"}'], cwd=repo, capture_output=True, text=True,
      timeout=300, env=env)
  assert proc.returncode == 2, proc.stderr
  assert 'Traceback' not in proc.stderr, proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith('error: verifiers.sandbox: bubblewrap is unusable') and (
      "isolation='none'" in last), proc.stderr


def test_a_start_that_fails_before_its_first_step_leaves_the_workdir_unclaimed(tmp_path, capsys,
                                                                            tiny_world_root):
  """A wrong mesh stops the run after config.json is written: the next command, a different
  config, is not refused as "a run of a different config" but takes the workdir over."""
  from cascade import checkpoint  # pylint: disable=g-import-not-at-top
  from configs import tiny  # pylint: disable=g-import-not-at-top
  w = str(tmp_path / 'w')
  hashes = []
  for shape in ((1, 16, 1), (1, 32, 1)):        # the tests' processes have 8 devices
    c = tiny.get_config(f'smoke,root={tiny_world_root}')
    c.mesh.shape = shape
    with pytest.raises(config_lib.ConfigError, match=f'needs {shape[1]} devices, have 8'):
      runner.run(c, w)
    hashes.append(checkpoint.read_json(str(tmp_path / 'w' / 'config.json'))['hash'])
  assert hashes[0] != hashes[1]
  assert f'config {hashes[1]} takes the workdir over' in capsys.readouterr().out
