"""The divergence policy: bad steps are judged, reported as they happen, and a diverged stage stops
the run in one line (exit 3) without exporting or evaluating its policy, or rolls back.

The end-to-end tests run the command line on the toy copy cascade (heavy: each compiles a run):
the first update at lr=1e30 or 1e4 multiplies the weights (update_ratio far above 1e3); after it
at lr=1e30 they overflow (the updates after the first are skipped as non-finite); at lr=1e4
they saturate (loss stuck at ln V with a gradient of exactly zero: finite garbage).
"""

import json
import math
import os
import subprocess
import sys

import pytest

from cascade import config as config_lib
from cascade import divergence
from cascade import schema

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _policy(**kw):
  return schema.from_mapping(config_lib.Divergence, kw, 'config.divergence', sep='.')


@pytest.mark.parametrize('metrics, why', [
    ({'loss': math.nan, 'grad_norm': 1.0}, 'loss=nan is not finite'),
    ({'loss': 2.0, 'grad_norm': math.inf}, 'grad_norm=inf is not finite'),
    ({'loss': 5.768, 'grad_norm': 0.0}, 'grad_norm=0 at loss=5.768 (a saturated model'),
    ({'loss': 9.0, 'grad_norm': 1.0}, 'loss=9 is above config.divergence.max_loss=8'),
    ({'loss': -1.0, 'grad_norm': 1.0}, 'loss=-1 is below config.divergence.min_loss=0'),
    ({'loss': 1.0, 'grad_norm': 70.0}, 'grad_norm=70 is above config.divergence.max_grad_norm=50'),
    ({'loss': 1.0, 'grad_norm': 1.0, 'update_ratio': 1e37},
     'update_ratio=1e+37 is above config.divergence.max_update_ratio=1000 (the update changed'),
    ({'loss': 1.0, 'grad_norm': 1.0, 'update_ratio': math.inf}, 'update_ratio=inf is above'),
])
def test_a_bad_step_is_named_by_its_metric(metrics, why):
  got = divergence.why_bad(_policy(min_loss=0.0, max_loss=8.0, max_grad_norm=50.0), metrics)
  assert got is not None and got.startswith(why), got


@pytest.mark.parametrize('metrics', [
    {'loss': 0.0, 'grad_norm': 0.0},      # a GRPO batch whose groups are all equal: no signal
    {'loss': -0.0, 'grad_norm': 0.0},
    {'loss': 5.768, 'grad_norm': 2.4},    # a fresh model's first SFT step: ln V is its loss
    {'loss': 1e9, 'grad_norm': 1e9},      # no band by default
    {'loss': 2.0, 'grad_norm': 1.0, 'update_ratio': 0.02},   # a big but sane update
    {'loss': 2.0, 'grad_norm': 1.0, 'update_ratio': 0.0},    # a skipped one
])
def test_good_steps_by_default_include_a_no_signal_step_and_a_fresh_models_loss(metrics):
  assert divergence.why_bad(_policy(), metrics) is None


def test_the_band_is_checked_in_the_config():
  with pytest.raises(config_lib.ConfigError, match=r'config.divergence.min_loss=3.0: must be '
                                                    r'below max_loss=1'):
    _policy(min_loss=3, max_loss=1)
  with pytest.raises(config_lib.ConfigError, match=r'config.divergence.max_grad_norm=0: must'):
    _policy(max_grad_norm=0)


class _Stage:
  index, name, steps, where = 2, 'math_rl', 10, "stages[2] 'math_rl'"


def test_bad_steps_are_reported_as_they_happen_and_only_a_run_of_them_diverges(capsys):
  watch = divergence.Watch(_policy(max_bad_steps=2), _Stage())
  bad, good = {'loss': 1.0, 'grad_norm': math.nan}, {'loss': 1.0, 'grad_norm': 1.0}
  seen = []
  for step, m in enumerate([good, bad, good, bad, bad, bad], start=1):
    m = dict(m)
    seen.append((watch.see(step, m), m['bad_steps']))
  # Sporadic bad steps are tolerated; the third in a row diverges the stage.
  assert seen == [(False, 0), (False, 1), (False, 1), (False, 2), (False, 3), (True, 4)]
  err = capsys.readouterr().err.splitlines()
  assert [l.split(':')[1] for l in err] == [' [2] math_rl step 2/10', ' [2] math_rl step 4/10',
                                            ' [2] math_rl step 5/10', ' [2] math_rl step 6/10']
  assert err[0].startswith('WARNING: [2] math_rl step 2/10: bad step: grad_norm=nan is not '
                           'finite (the update was skipped) (1 in a row; 3 in a row diverge')
  # A resumed stage counts on; the rollback target is the newest checkpoint no bad step judged
  # (step 4's metrics judge step 3's update).
  again = divergence.Watch(watch.policy, _Stage(), json.loads(json.dumps(watch.state())))
  assert (again.bad_steps, again.streak, again.streak_start) == (4, 3, 4)
  assert again.rollback_step([1, 2, 3, 5]) == 2 and again.rollback_step([3]) == 0
  err = str(again.diverged(6, 2))
  assert err.startswith("stage 2 'math_rl' diverged at step 6/10: ") and '\n' not in err


class _Short:
  index, name, steps, where = 0, 'sft', 4, "stages[0] 'sft'"


GOOD = {'loss': 2.0, 'grad_norm': 1.0, 'update_ratio': 0.01}
BLOWUP = {'loss': 2.0, 'grad_norm': 1.0, 'update_ratio': 1e37}   # finite, weights x1e37
NAN = {'loss': math.nan, 'grad_norm': math.nan, 'update_ratio': 0.0}


@pytest.mark.parametrize('steps, diverged_at, first', [
    ([GOOD, BLOWUP, NAN, NAN], 4, 'the first at step 2: update_ratio=1e+37 is above'),
    ([GOOD, GOOD, GOOD, BLOWUP], 4, None),        # the last update is judged by its own size
    ([GOOD, GOOD, NAN, NAN], 4, 'the first at step 3: loss=nan'),
    ([BLOWUP, GOOD, NAN, GOOD], None, None),      # recovered: the stage ends on a good step
])
def test_a_stage_that_ends_on_bad_steps_diverges_even_below_max_bad_steps(
    steps, diverged_at, first, capsys):
  watch = divergence.Watch(_policy(max_bad_steps=3), _Short())
  seen = [watch.see(step, dict(m)) for step, m in enumerate(steps, start=1)]
  assert seen == [step == diverged_at for step in range(1, 5)]
  if diverged_at is None:
    return
  msg = str(watch.diverged(diverged_at, 0))
  assert msg.startswith("stage 0 'sft' diverged at step 4/4: ") and '\n' not in msg, msg
  assert 'the stage ended on' in msg and 'bad step(s) in a row, unrecovered' in msg
  assert (first in msg) if first else ('the first at' not in msg)
  assert 'its policy was not exported or evaluated' in msg
  assert capsys.readouterr().err.count('bad step:') == sum(m is not GOOD for m in steps)


def test_the_message_suggests_rollbacks_only_to_a_run_without_them():
  bad = {'loss': 1.0, 'grad_norm': math.nan}
  none = divergence.Watch(_policy(max_bad_steps=0), _Stage())
  assert none.see(1, dict(bad))
  assert str(none.diverged(1, 0)).endswith(
      'lower its optimizer.lr or set config.divergence.rollbacks')
  used = divergence.Watch(_policy(max_bad_steps=0, rollbacks=2), _Stage())
  for step in (1, 2, 3):
    assert used.see(step, dict(bad))
    if used.can_roll_back:
      used.rolled_back()
  msg = str(used.diverged(3, 0))
  assert 'after 2 rollback(s) to a learning rate x0.25' in msg
  assert msg.endswith('its policy was not exported or evaluated: lower its optimizer.lr'), msg


def _cli(config, workdir, *overrides, env=None, timeout=600):
  cmd = [sys.executable, '-m', 'cascade.main', f'--config={config}', f'--workdir={workdir}',
         '--verbosity=-1', *overrides]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                        env=dict(os.environ, **(env or {})))


@pytest.fixture(scope='module')
def world(tmp_path_factory, copy_cascade, derived_config):
  root = tmp_path_factory.mktemp('divergence')
  copy_cascade(root, train=16, eval_=8, sft=32, sft_steps=6, rl_steps=2)
  # A band bound the command line may set: a typed placeholder (a plain None is not overridable).
  (root / 'policy.py').write_text(derived_config(
      '  c.divergence = dict(max_bad_steps=3, rollbacks=0, rollback_lr_factor=0.5,\n'
      '                      max_loss=ml_collections.config_dict.placeholder(float))\n'
      '  c.ckpt.keep = 3\n', imports='import ml_collections\n'))
  return root


def _lines(stderr):
  """stderr without the progress bars' redraws."""
  return [l for l in stderr.replace('\r', '\n').splitlines() if l.strip() and '|' not in l]


@pytest.mark.heavy
@pytest.mark.parametrize('lr, why', [('1e30', 'grad_norm=nan is not finite'),
                                     ('1e4', 'grad_norm=0 at loss=5.768')])
def test_a_diverged_stage_stops_the_run_in_one_line_without_export_or_evaluation(
    world, tmp_path, lr, why):
  work = tmp_path / 'run'
  proc = _cli(world / 'policy.py', work, f'--config.stages[0].optimizer.lr={lr}')
  assert proc.returncode == divergence.EXIT_CODE == 3, proc.stderr[-3000:]
  lines = _lines(proc.stderr)
  assert lines[-1].startswith("error: stage 0 'sft' diverged at step 4/6: " + why), lines
  assert ('4 bad steps in a row (config.divergence.max_bad_steps=3), the first at step 1: '
          'update_ratio=') in lines[-1]
  assert 'Traceback' not in proc.stderr
  # Every bad step was reported as it happened, and logged (metrics.jsonl; TensorBoard alike).
  warned = [l for l in lines if l.startswith('WARNING: [0] sft step ')]
  assert [l.split()[4] for l in warned] == ['1/6:', '2/6:', '3/6:', '4/6:'], lines
  recs = [json.loads(l) for l in (work / 'metrics.jsonl').read_text().splitlines()]
  assert [r['bad_steps'] for r in recs if r.get('stage') == 'sft'] == [1, 2, 3, 4]
  assert list((work / 'tb').iterdir())
  # The diverged policy is neither exported nor evaluated; the next stage never started.
  assert not (work / 'stages' / '00_sft' / 'hf').exists()
  assert not (work / 'stages' / '01_copy_rl').exists()
  assert not (work / 'results.json').exists() or 'sft' not in (work / 'results.json').read_text()
  progress = json.loads((work / 'progress.json').read_text()) if (
      work / 'progress.json').exists() else {}
  assert not progress.get('done') and not progress.get('rows')


@pytest.mark.heavy
def test_a_loss_outside_the_band_diverges_the_stage(world, tmp_path):
  proc = _cli(world / 'policy.py', tmp_path / 'run', '--config.divergence.max_loss=4.0',
              '--config.divergence.max_bad_steps=0')
  assert proc.returncode == 3, proc.stderr[-3000:]
  assert _lines(proc.stderr)[-1].startswith(
      "error: stage 0 'sft' diverged at step 1/6: loss=5.759 is above "
      'config.divergence.max_loss=4'), proc.stderr[-2000:]


@pytest.mark.heavy
def test_rollback_restarts_the_diverged_stage_at_a_lower_learning_rate(world, tmp_path):
  work = tmp_path / 'run'
  proc = _cli(world / 'policy.py', work, '--config.stages[0].optimizer.lr=1e4',
              '--config.divergence.rollbacks=1', '--config.divergence.rollback_lr_factor=1e-6')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ('[0] sft: diverged at step 4/6; rolled back to step 0, learning rate x1e-06 '
          '(rollback 1 of 1)') in _lines(proc.stderr)
  done = json.loads((work / 'progress.json').read_text())['done']['sft']
  assert (done['bad_steps'], done['rollbacks'], done['lr_scale']) == (4, 1, 1e-6)
  recs = [json.loads(l) for l in (work / 'metrics.jsonl').read_text().splitlines()]
  sft = [r for r in recs if r.get('stage') == 'sft']
  # Steps 1-4 at lr 1e4, then the stage again from its start at 1e-2, learning.
  assert [r['step'] for r in sft] == [1, 2, 3, 4, 1, 2, 3, 4, 5, 6]
  assert all(r['lr'] == pytest.approx(1e-2) for r in sft[4:])
  assert sft[-1]['loss'] < sft[4]['loss'] - 1.0 and sft[-1]['bad_steps'] == 4
  assert all(r['update_ratio'] < 1.0 for r in sft[4:])
  assert (work / 'stages' / '00_sft' / 'hf').exists()


@pytest.mark.heavy
def test_a_blown_up_step_then_nan_steps_to_the_stage_end_stop_the_run_without_export(
    world, tmp_path):
  # At lr 1e36 step 1 is finite but multiplies the weights by ~1e36; steps 2 and 3 are NaN. A
  # run of 3 bad steps is tolerated mid-stage (max_bad_steps=3), but this one ends the stage.
  work = tmp_path / 'run'
  proc = _cli(world / 'policy.py', work, '--config.stages[0].optimizer.lr=1e36',
              '--config.stages[0].steps=3')
  assert proc.returncode == divergence.EXIT_CODE, proc.stderr[-3000:]
  last = _lines(proc.stderr)[-1]
  assert last.startswith("error: stage 0 'sft' diverged at step 3/3: "), last
  assert ('the stage ended on 3 bad step(s) in a row, unrecovered, the first at step 1: '
          'update_ratio=') in last and 'Traceback' not in proc.stderr
  assert not (work / 'stages' / '00_sft' / 'hf').exists()
  assert not (work / 'stages' / '01_copy_rl').exists()
  assert not (work / 'results.json').exists() or 'sft' not in (work / 'results.json').read_text()
  progress = json.loads((work / 'progress.json').read_text()) if (
      work / 'progress.json').exists() else {}
  assert not progress.get('done') and not progress.get('rows')
