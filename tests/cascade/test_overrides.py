"""cascade.overrides: --config overrides that name stages and unset fields; one-line refusals."""

import os
import subprocess
import sys

import pytest
from absl import flags

from cascade import checkpoint
from cascade import config as config_lib
from cascade import overrides
from cascade import schema
from configs import tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(config, *args):
  """The config `python -m cascade.main --config=<config> <args>` runs (its flags, in-process)."""
  argv = ['prog', f'--config={config}', *args]
  fv = flags.FlagValues()
  holder = overrides.define_config_file('config', 'the config', flag_values=fv, argv=argv)
  fv(argv)
  overrides.finish(holder.value)
  return holder.value


def _stage(config, name):
  return next(s for s in config.stages if s['name'] == name)


def test_a_stage_by_name_is_the_stage_at_its_position():
  by_name = _parse('configs/tiny.py:smoke', '--config.stages.math_rl.optimizer.lr=1e-3',
                   '--config.stages["code_rl"].steps=5')
  by_index = _parse('configs/tiny.py:smoke', '--config.stages[4].optimizer.lr=1e-3',
                    '--config.stages[5].steps=5')
  assert schema.as_dict(by_name) == schema.as_dict(by_index)
  assert _stage(by_name, 'math_rl')['optimizer']['lr'] == 1e-3
  assert _stage(by_name, 'code_rl')['steps'] == 5
  assert type(by_name.stages) is list and all(type(s) is dict for s in by_name.stages)


def test_a_name_stays_with_its_stage_when_drop_moves_the_positions():
  c = _parse('configs/tiny.py:smoke,drop=rlhf', '--config.stages.math_rl.optimizer.lr=1e-3',
             '--config.stages[4].optimizer.lr=2e-3')
  lrs = {s['name']: s['optimizer']['lr'] for s in c.stages}
  default = {s['name']: s['optimizer']['lr'] for s in tiny.get_config('smoke,drop=rlhf').stages}
  # math_rl is [3] without rlhf: the name reaches it, position 4 is code_rl now.
  assert lrs == {**default, 'math_rl': 1e-3, 'code_rl': 2e-3}


def test_no_override_leaves_the_config_and_its_hash_alone():
  for arg in ('smoke', None):
    given = tiny.get_config(arg)
    parsed = _parse('configs/tiny.py' + (f':{arg}' if arg else ''))
    assert schema.as_dict(parsed) == schema.as_dict(given)
    assert checkpoint.config_hash(parsed) == checkpoint.config_hash(given)


def test_an_unset_field_takes_the_type_its_schema_declares():
  c = _parse('configs/tiny.py:smoke', '--config.mesh.shape=1,2,1', '--config.sampler.slots=8',
             '--noconfig.sampler.rollout_cast', '--config.model.overrides.rope_theta=1e5',
             '--config.stages.math_rl.kl_coef=0.01',
             '--config.stages.math_rl.optimizer.warmup_steps=3',
             '--config.divergence.min_loss=0')
  assert c.mesh.shape == (1, 2, 1)                     # None in the config
  assert (c.sampler.slots, c.sampler.rollout_cast) == (8, False)    # absent from it
  assert c.model.overrides.rope_theta == 1e5 and isinstance(c.model.overrides.rope_theta, float)
  rl = _stage(c, 'math_rl')
  assert (rl['kl_coef'], rl['optimizer']) == (0.01, {'lr': 4e-5, 'warmup_steps': 3})
  assert c.divergence.min_loss == 0.0 and isinstance(c.divergence.min_loss, float)
  assert type(c.stages) is list and all(type(s) is dict for s in c.stages)
  assert type(rl['optimizer']) is dict
  # The very config one would write in Python: same plan, same hash.
  want = tiny.get_config('smoke')
  want.mesh.shape = (1, 2, 1)
  want.sampler.slots, want.sampler.rollout_cast = 8, False
  want.model.overrides.rope_theta = 1e5
  want.divergence.min_loss = 0.0
  _stage(want, 'math_rl').update(kl_coef=0.01, optimizer=dict(lr=4e-5, warmup_steps=3))
  assert checkpoint.config_hash(c) == checkpoint.config_hash(want)
  plan = config_lib.validate(c)
  assert plan.mesh_shape == (1, 2, 1) and plan.sampler.slots == 8
  assert plan.stage('math_rl').kl_coef == 0.01
  assert plan.stage('math_rl').optimizer.warmup_steps == 3


def test_the_guards_forecast_confidence_is_set_from_the_command_line():
  """config.guard.forecast_confidence (cascade/forecast.py), a field of a guard section the
  config has, and one a config without that section refuses in one line."""
  c = _parse('configs/tiny.py:smoke,guard=stop', '--config.guard.forecast_confidence=0.9')
  assert c.guard.forecast_confidence == 0.9
  assert config_lib.validate(c).guard.forecast_confidence == 0.9
  with pytest.raises(overrides.OverrideError) as e:
    _parse('configs/tiny.py:smoke,guard=stop', '--config.guard.forecast_confidnce=0.9')
  assert "config.guard has no field 'forecast_confidnce' (nearest: forecast_confidence)" in str(
      e.value)


def test_the_guards_forecast_signals_are_set_from_the_command_line():
  """config.guard.signals (cascade/signals.py), a tuple field, and signal_samples."""
  c = _parse('configs/tiny.py:smoke,guard=warn', '--config.guard.signals=kl,grad_cos',
             '--config.guard.signal_samples=2')
  plan = config_lib.validate(c)
  assert plan.guard.signals == ('kl', 'grad_cos') and plan.guard.signal_samples == 2
  one = config_lib.validate(_parse('configs/tiny.py:smoke,guard=warn', '--config.guard.signals=kl'))
  assert one.guard.signals == ('kl',)


@pytest.mark.parametrize('arg, message', [
    ('--config.eval.num_promts=3',
     "--config.eval.num_promts: config.eval has no field 'num_promts' (nearest: num_prompts, suite_prompts)"),
    ('--config.sampler.slotz=8',
     "--config.sampler.slotz: config.sampler has no field 'slotz' (nearest: slots)"),
    ('--config.sead=1', "--config.sead: config has no field 'sead' (nearest: seed)"),
    ('--config.stages.math_r.steps=3', "--config.stages.math_r.steps: config.stages has no stage "
                                       "named 'math_r' (nearest: math_rl)"),
    ('--config.stages.math_rl.kl_cof=0.1', "--config.stages.math_rl.kl_cof: "
                                           "config.stages.math_rl has no field 'kl_cof' "
                                           '(nearest: kl_coef)'),
    ('--config.stages[9].steps=3', '--config.stages[9].steps: config.stages has 7 stages, no [9] '
                                   '(by position: [0] sft, [1] rm, [2] rlhf, [3] if_rl, '
                                   '[4] math_rl, [5] code_rl, [6] swe_rl)'),
    ('--config.domains.code.verifier_options.isolaton=none',
     "config.domains.code.verifier_options has no field 'isolaton' (nearest: isolation)"),
    ('--config.eval.domains.math.num_prompts=3',
     "config.eval.domains is not set in this config: set it whole, e.g. "
     "--config.eval.domains='{...}'"),
    ('--config.seed.x=1', "config.seed is a value (int), not a section: it has no field 'x'"),
])
def test_what_the_config_cannot_take_is_refused_in_one_line(arg, message):
  with pytest.raises(overrides.OverrideError) as e:
    _parse('configs/tiny.py:smoke', arg)
  assert message in str(e.value)
  assert '\n' not in str(e.value) and '\\' not in str(e.value)


def test_a_stage_named_like_a_list_method_and_a_config_argument_error(tmp_path):
  path = tmp_path / 'cfg.py'
  path.write_text('import ml_collections\n\n\ndef get_config():\n'
                  '  return ml_collections.ConfigDict(dict(seed=0, stages=[\n'
                  "      dict(name='index', kind='sft', steps=1),\n"
                  "      dict(name='copy', kind='sft', steps=1)]))\n")
  c = _parse(str(path), '--config.stages.copy.steps=4', '--config.stages.index.steps=3')
  assert [s['steps'] for s in c.stages] == [3, 4]
  with pytest.raises(overrides.OverrideError, match=r'^--config=.*cfg.py:x: get_config\(\) takes '
                                                    r'0 positional arguments but 1 was given$'):
    _parse(f'{path}:x')
  path.write_text('def get_config(arg):\n  return arg + 1\n')     # a bug in the config
  with pytest.raises(overrides.OverrideError,
                     match=r'cfg.py:a: can only concatenate str .* \(.*cfg.py:2\)$'):
    _parse(f'{path}:a')


def test_config_file_mistakes_are_one_line_with_a_hint(tmp_path):
  """The mistakes made inside a config file read like the command line's: a file without
  get_config, one that does not run, and a field, stage field or section the schema does not
  know (named with the nearest ones, as an override is)."""
  path = tmp_path / 'cfg.py'
  path.write_text('import ml_collections\n\n\ndef config():\n  return None\n')
  with pytest.raises(overrides.OverrideError, match=r'^--config=.*cfg.py: .*cfg.py defines no '
                                                    r'get_config\(arg=None\) function; '):
    _parse(str(path))
  path.write_text('def get_config(arg=None)\n  return None\n')
  with pytest.raises(overrides.OverrideError,
                     match=r'^--config=.*cfg.py: .*cfg.py:1: SyntaxError: '):
    _parse(str(path))
  path.write_text('import no_such_module_here\n')
  with pytest.raises(overrides.OverrideError, match=r"^--config=.*cfg.py: ModuleNotFoundError: No "
                                                    r"module named 'no_such_module_here' "
                                                    r'\(.*cfg.py:1\)$'):
    _parse(str(path))
  for edit, message in [
      (lambda c: c.sampler.update(slotss=8),
       'config.sampler.slotss: unknown field (nearest: slots)'),
      (lambda c: c.stages[2].update(group_sise=4), "stages[2] 'rlhf': group_sise: unknown field "
                                                   'for a grpo stage (nearest: group_size)'),
      (lambda c: c.stages[0]['optimizer'].update(warmup=3),
       "stages[0] 'sft': optimizer.warmup: unknown field (nearest: warmup_steps)"),
      (lambda c: c.update(evall={}), 'config.evall: unknown section (nearest: eval)'),
      (lambda c: c.domains.math.update(verfier='math'),
       "config.domains.math.verfier: unknown field (nearest: verifier, eval_verifier, "
       "verifier_options)"),
      (lambda c: c.compilation_cache.update(max_size=10), 'config.compilation_cache.max_size: '
                                                          'unknown field (known: dir, '
                                                          'min_compile_secs)')]:
    c = tiny.get_config('smoke,root=/nowhere')
    with c.unlocked():
      if 'compilation_cache' not in c:
        c.compilation_cache = {}
      edit(c)
    with pytest.raises(config_lib.ConfigError) as e:
      config_lib.validate(c)
    assert str(e.value) == message


def test_help_is_no_error_and_shows_the_flags_to_know_first():
  proc = subprocess.run([sys.executable, '-m', 'cascade.main', '--help'], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout.splitlines()
  for flag in ('--config=FILE[:ARG]', '--workdir=DIR', '--config.PATH=VALUE', '--fork_from=DIR'):
    assert any(line.lstrip().startswith(flag) for line in out), flag
  assert any(line.startswith('  --config: A Python file whose get_config') for line in out)
  # The examples are whole commands, one per line, and their flags parse.
  examples = [line.strip() for line in out if line.strip().startswith('python -m cascade.main')]
  assert len(examples) == 2
  for example in examples:
    args = example.split()[3:]
    config = [a for a in args if a.startswith('--config=')][0].partition('=')[2]
    c = _parse(config, *[a for a in args if a.startswith('--config.')])
    assert c.eval.num_prompts == (64 if '--config.eval.num_prompts=64' in args else 8)
  full = subprocess.run([sys.executable, '-m', 'cascade.main', '--helpfull'], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert full.returncode == 0 and '--verbosity' in full.stdout


@pytest.mark.parametrize('module, flag', [('cascade.evaluate', '--checkpoint'),
                                          ('cascade.device_check', '--preset')])
def test_the_other_commands_help_exits_0_and_a_bad_flag_is_one_line(module, flag):
  proc = subprocess.run([sys.executable, '-m', module, '--help'], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert any(line.lstrip().startswith(flag) for line in proc.stdout.splitlines())
  bad = subprocess.run([sys.executable, '-m', module, '--no_such_flag=1'], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines() == ["error: Unknown command line flag 'no_such_flag'"]


def test_the_schema_knows_every_section():
  assert set(overrides._root()) == set(config_lib.SECTIONS)  # pylint: disable=protected-access


@pytest.mark.parametrize('args, line', [
    (['--config=configs/tiny.py:smok'],
     "error: --config=configs/tiny.py:smok: config argument 'smok': expected smoke, fast_path, "
     'seed=N, world=NAME, eval_every=N, drop=STAGE+STAGE, order=NAME, model=NAME, rm=NAME, '
     'guard=ACTION, routing_replay=MODE or root=DIR'),
    (['--config=configs/tny.py'], "error: --config=configs/tny.py: no such config file "
                                  "'configs/tny.py'"),
    (['--config=configs/__init__.py'], 'error: --config=configs/__init__.py: configs/__init__.py '
                                       'defines no get_config(arg=None) function; a config file '
                                       'is Python whose get_config returns the ConfigDict (see '
                                       'configs/tiny.py)'),
    (['--config=configs/tiny.py:smoke', '--config.eval.num_promts=3'],
     "error: --config.eval.num_promts: config.eval has no field 'num_promts' "
     '(nearest: num_prompts, suite_prompts)'),
    (['--config=configs/tiny.py:smoke', '--config.sampler.slots=many'],
     "error: flag --config.sampler.slots=many: invalid literal for int() with base 10: 'many'"),
])
def test_the_command_line_says_it_in_one_line(tmp_path, args, line):
  proc = subprocess.run([sys.executable, '-m', 'cascade.main', *args,
                         f'--workdir={tmp_path / "w"}'], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stderr
  assert not (tmp_path / 'w').exists()
