"""benchmarks/self_healing.py on a stubbed set of finished runs: each recorded once in the record
file (with its deciding probes' paired and independent errors), not rerun under the same code;
the page, the record file's rendering alone (the committed one too): matrices, inserted stages,
time ratios and forecast accuracy, the missing runs named, the load warning; the commands it
runs."""

import json
import os

import numpy as np

from absl import flags
from absl.testing import flagsaver

DOMAINS = ['chat', 'math', 'code']


def _res(stages, stage_domains, scores, **extra):
  return {'domains': DOMAINS, 'stages': stages, 'stage_domains': stage_domains,
          'scores': scores, **extra}


def _off():
  return _res(['sft', 'math_rl', 'code_rl'], [DOMAINS, ['math'], ['code']],
              [[40.0, 30.0, 20.0], [38.0, 50.0, 21.0], [30.0, 44.0, 45.0]],
              accounting={'sft': {'step_s': 100.0}, 'math_rl': {'step_s': 50.0},
                          'code_rl': {'step_s': 50.0}})


def _repair():
  forecast = [
      {'stage': 'math_rl', 'domain': 'chat', 'at_step': 5, 'steps': 10, 'forecast': -1.0,
       'stderr': 3.0, 'outcome': -2.0},
      {'stage': 'code_rl', 'domain': 'chat', 'at_step': 5, 'steps': 20, 'forecast': -12.0,
       'stderr': 5.0, 'outcome': -9.0},
      {'stage': 'code_rl', 'domain': 'math', 'at_step': 5, 'steps': 20, 'forecast': 2.0,
       'stderr': 5.0, 'outcome': -6.0},
      {'stage': 'code_rl', 'domain': 'swe', 'at_step': 5, 'steps': 20, 'forecast': -4.0,
       'stderr': 5.0, 'outcome': None}]
  return _res(['sft', 'math_rl', 'code_rl', 'code_rl_repair'],
              [DOMAINS, ['math'], ['code'], ['chat', 'math', 'code']],
              [[40.0, 30.0, 20.0], [39.0, 49.0, 21.0], [31.0, 42.0, 44.0],
               [39.0, 48.0, 43.0]],
              inserted=[None, None, None, {'repairs': 'code_rl',
                                           'drops': {'chat': 9.5, 'math': 6.25}}],
              validation=[[41.0, 31.0, 20.0], [40.0, 50.0, 22.0], [30.0, 41.0, 46.0],
                          [39.5, 49.0, 45.0]],
              ledger={'chat': {'validation': 41.0}, 'math': {'validation': 50.0},
                      'code': {'validation': 46.0}},
              accounting={'sft': {'step_s': 100.0}, 'math_rl': {'step_s': 55.0},
                          'code_rl': {'step_s': 55.0}, 'code_rl_repair': {'step_s': 30.0}},
              forecast=forecast)


def _write(root, name, res, wall=None, ledger=None, fingerprint=None):
  os.makedirs(root / name, exist_ok=True)
  (root / name / 'results.json').write_text(json.dumps(res))
  if wall is not None:
    from benchmarks import self_healing  # pylint: disable=g-import-not-at-top
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    model = 'hybrid' if 'hybrid' in name else 'dense'
    side = 'repair' if 'repair' in name else 'off'
    cmd = self_healing.command(model, side, int(name[-1]), str(root / name))
    (root / name / 'wall.json').write_text(json.dumps({
        'seconds': wall, 'load_before': [9.0, 8.0, 7.0], 'load_after': [3.0, 2.0, 1.0],
        'command': ' '.join(cmd[1:]), 'commit': 'abc',
        'fingerprint': fingerprint or self_healing.fingerprint(cmd)}))
  if ledger is not None:
    (root / name / 'progress.json').write_text(json.dumps({'ledger': ledger}))
    (root / name / 'config.json').write_text(json.dumps({'hash': 'h', 'config': {'guard': {
        'action': 'repair', 'prompts': 64, 'every': 5, 'max_drop': 3.0, 'stderrs': 2.0,
        'domains': ['chat']}}}))


def _probes():
  """A repair run's probes: code_rl's last probe of chat falls 9.4 points on the prompts step 0
  scored (paired), math's has no per-prompt scores at its best (independent)."""
  first = {f'c{i}': x for i, x in enumerate([100.0, 50.0, 0.0, 100.0] * 4)}
  later = dict(first, c0=50.0, c3=50.0, c7=50.0)
  mk = lambda step, chat, math_, ps=None, **kw: {
      'stage': 'code_rl', 'index': 2, 'step': step, 'set': 'probe',
      'scores': {'chat': sum(chat.values()) / 16, 'math': math_},
      'stderr': {'chat': 10.0, 'math': 8.0}, **({'prompt_scores': ps} if ps else {}), **kw}
  return [mk(0, first, 50.0, {'chat': first}),
          mk(20, later, 40.0, {'chat': later, 'math': {'m0': 0.0, 'm1': 100.0}},
             breached={'chat': {}})]


def _flags(**kw):
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return flagsaver.flagsaver(**kw)


def test_runs_are_recorded_once_and_the_page_is_their_rendering(tmp_path, monkeypatch, capsys):
  from benchmarks import self_healing  # pylint: disable=g-import-not-at-top
  _write(tmp_path, 'tiny_model-hybrid_s0', _off(), wall=400.0)
  _write(tmp_path, 'tiny_model-hybrid-guard-repair_s0', _repair(), wall=500.0, ledger=_probes())
  _write(tmp_path, 'tiny_model-dense_s0', _off(), wall=1.0, fingerprint='other code')
  _write(tmp_path, 'tiny_model-dense-guard-repair_s0', _repair())      # killed: no wall.json
  monkeypatch.setattr(os, 'getloadavg', lambda: (9.0, 8.0, 7.0))
  monkeypatch.setattr(self_healing, 'run_one', lambda *a: (_ for _ in ()).throw(
      AssertionError('--norun ran a cascade')))
  doc, results = tmp_path / 'page.md', tmp_path / 'results.json'
  with _flags(models=['hybrid', 'dense'], seeds=['0'], workdir_root=str(tmp_path), doc=str(doc),
              run=False, results=str(results)):
    self_healing.main([])
  out = capsys.readouterr().out.splitlines()
  warn = [i for i, l in enumerate(out) if l.startswith('WARNING: the host was loaded')]
  summary = json.loads(out[-1])
  assert warn and warn[0] < len(out) - 1
  # dense off finished with other code: recorded under its own fingerprint, saying so; dense
  # repair was killed (no wall.json): missing.
  assert any('tiny_model-dense_s0: ' in l and 'recorded under its own fingerprint' in l
             for l in out)
  assert 'tiny_model-dense-guard-repair_s0' in summary['missing']
  assert 'tiny_model-dense_s0' not in summary['missing'] and 'tiny_model-hybrid_s0' not in (
      summary['missing'])
  # Falls past 5 points: code_rl's chat (-9, forecast -12: right) and math (-6, forecast +2:
  # wrong); errors 1, 3, 8 over the three with an outcome.
  assert summary['forecast'] == {'n': 3, 'mean_abs_error': 4.0, 'falls': 2,
                                 'falls_sign_right': 1}
  pair = summary['pairs']['hybrid_s0']
  assert pair['off']['worst_below_best'] == 10.0 and pair['repair']['worst_below_best'] == 1.0
  assert pair['repair']['training_s'] == 240.0 and pair['off']['wall_s'] == 400.0
  records = self_healing.load_results(str(results))
  assert sorted(records) == ['tiny_model-dense_s0', 'tiny_model-hybrid-guard-repair_s0',
                             'tiny_model-hybrid_s0']
  assert records['tiny_model-dense_s0']['fingerprint'] == 'other code'
  rec = records['tiny_model-hybrid-guard-repair_s0']
  assert rec['command'] == ('python -m cascade.main --config=configs/tiny.py:'
                            'model=hybrid,guard=repair,seed=0 --verbosity=-1')
  assert rec['commit'] == 'abc' and rec['wall_s'] == 500.0 and rec['training_s'] == 240.0
  chat, math_ = rec['probes']
  assert chat['stage'] == 'code_rl' and chat['drop'] == 9.375 and chat['pairs'] == 16
  diffs = np.array([50.0, 50.0, 50.0] + [0.0] * 13)
  assert chat['se_paired'] == round(float(np.std(diffs, ddof=1) / 4), 4) and chat['breached']
  assert chat['se_independent'] == round(float(np.hypot(10, 10)), 4)
  assert math_['se_paired'] is None and math_['drop'] == 10.0 and not math_['breached']
  assert rec['guard'] == {'action': 'repair', 'prompts': 64, 'every': 5, 'max_drop': 3.0,
                          'stderrs': 2.0}
  assert records['tiny_model-hybrid_s0']['guard'] == {}
  # The page is the record file's rendering, whatever else is on disk or in the air.
  text = doc.read_text()
  assert text == self_healing.page(records)
  monkeypatch.setattr(os, 'getloadavg', lambda: (0.0, 0.0, 0.0))
  with _flags(doc=str(tmp_path / 'again.md'), results=str(results), render_only=True,
              workdir_root='/nonexistent'):
    self_healing.main([])
  assert (tmp_path / 'again.md').read_text() == text
  assert text.startswith('# The self-healing cascade on the tiny world\n')
  assert '`python -m benchmarks.self_healing --render_only`' in text
  assert 'load average (1/5/15 min) 9.00/8.00/7.00 before and 3.00/2.00/1.00 after' in text
  assert 'WARNING: the host was loaded (one-minute load average 9.00 -> 3.00 on' in text
  missing = next(l for l in text.splitlines() if l.startswith('Missing runs (not recorded): '))
  assert 'tiny_model-dense-guard-repair_s0, ' in missing and 'tiny_model-dense_s0, ' not in missing
  assert 'hybrid_s0' not in missing and 'hybrid-guard-repair_s0' not in missing
  assert ('3 forecasts, mean absolute error 4.0 points; outcomes falling more than 5 points: 2, '
          'forecast sign right on 1.') in text
  assert '| tiny_model-hybrid-guard-repair_s0 | code_rl | chat | 5 of 20 | -12.0 ± 5.0 | -9.0 |' in text
  assert '| code_rl_repair (inserted) | chat, math, code | 39.0 (+8.0) |' in text
  assert 'Inserted: code_rl_repair (repairs code_rl: probe drops chat -9.5, math -6.2).' in text
  se = chat['se_paired']
  assert ('Guard: repair, probes of 64 prompts every 5 steps, bound 3.0 points + 2.0 standard '
          'errors.') in text
  assert (f'| code_rl | chat | 20 | +9.4 | {se:.1f} (16) | {3 + 2 * se:.1f} | 14.1 | 31.3 | yes |'
          in text)
  assert '| code_rl | math | 20 | +10.0 | - | - | 11.3 | 25.6 | no |' in text
  # chat: off ends 10 below its best row (40 -> 30), repair 1 (40 -> 39), 1.5 below the ledger.
  assert '| chat | 30.0 | 39.0 | 10.0 | 1.0 | 1.5 |' in text
  assert '| math_rl | +20.0 | +19.0 | -1.0 |' in text and '| code_rl | +24.0 | +23.0 | -1.0 |' in text
  assert 'off 200, repair 240, ratio 1.20' in text and 'off 400, repair 500, ratio 1.25' in text
  assert '## dense, seed 0' in text and '## hybrid, seed 0' in text
  assert 'Code fingerprint other code, commit abc' in text
  # Called again, the run of other code is not recorded again (nor rerun: --norun).
  with _flags(models=['dense'], seeds=['0'], workdir_root=str(tmp_path), doc=str(doc),
              run=False, results=str(results)):
    self_healing.main([])
  assert 'recorded as that; remove it to rerun' in capsys.readouterr().out
  assert self_healing.load_results(str(results)) == records


def test_a_run_recorded_under_the_code_it_would_run_is_not_run_again(tmp_path, monkeypatch):
  from benchmarks import self_healing  # pylint: disable=g-import-not-at-top
  ran = []

  def fake_run(model, side, seed, workdir):
    ran.append((model, side, seed))
    _write(tmp_path, os.path.basename(workdir), _off(), wall=10.0)
    return self_healing.read_run(workdir)
  monkeypatch.setattr(self_healing, 'run_one', fake_run)
  results = str(tmp_path / 'results.json')
  with _flags(sides=['off']):
    self_healing.record_runs(['dense'], [1], str(tmp_path), results, run=True)
    assert ran == [('dense', 'off', 1)]
    self_healing.record_runs(['dense'], [1], str(tmp_path), results, run=True)
    assert ran == [('dense', 'off', 1)]                     # recorded: not run again
    records = self_healing.load_results(results)
    records['tiny_model-dense_s1']['fingerprint'] = 'older code'
    self_healing.save_results(results, records)
    (tmp_path / 'tiny_model-dense_s1' / 'results.json').unlink()
    self_healing.record_runs(['dense'], [1], str(tmp_path), results, run=True)
  assert ran == [('dense', 'off', 1)] * 2                  # other code: run again
  assert self_healing.load_results(results)['tiny_model-dense_s1']['fingerprint'] == (
      self_healing.fingerprint(self_healing.command('dense', 'off', 1, '/elsewhere')))


def test_the_committed_page_is_the_rendering_of_the_committed_record():
  from benchmarks import self_healing  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  records = self_healing.load_results(os.path.join(root, 'benchmarks/results/self_healing.json'))
  with open(os.path.join(root, 'docs/self_healing.md'), encoding='utf-8') as f:
    assert f.read() == self_healing.page(records), (
        'docs/self_healing.md is not the rendering of benchmarks/results/self_healing.json: '
        'run python -m benchmarks.self_healing --render_only')


def test_each_run_is_the_tiny_config_with_or_without_the_repair_guard():
  from benchmarks import self_healing  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(isolation='none'):
    cmd = self_healing.command('hybrid', 'repair', 2, '/w')
  assert cmd[1:3] == ['-m', 'cascade.main']
  assert cmd[3].endswith('configs/tiny.py:model=hybrid,guard=repair,seed=2')
  assert '--workdir=/w' in cmd
  assert cmd[-2:] == ['--config.domains.code.verifier_options.isolation=none',
                      '--config.eval.suite_options={"tiny_code": {"isolation": "none"}}']
  with flagsaver.flagsaver(isolation=''):
    assert self_healing.command('dense', 'off', 0, '/w')[3].endswith('tiny.py:model=dense,seed=0')
  assert self_healing.run_name('dense', 'off', 1) == 'tiny_model-dense_s1'


def test_the_page_reports_each_signals_accuracy_where_the_runs_measured_them(tmp_path, monkeypatch,
                                                                            capsys):
  """Repair runs with config.guard.signals (`--signals`) carry kl, grad_cos and the combined
  sign beside each forecast: the page adds their columns and each predictor's accuracy."""
  from benchmarks import self_healing  # pylint: disable=g-import-not-at-top
  rep = _repair()
  sig = [dict(kl=0.01, grad_cos=0.3, falls=False), dict(kl=0.2, grad_cos=-0.5, falls=True),
         dict(kl=0.1, grad_cos=-0.1, falls=True), dict(kl=0.3, grad_cos=None, falls=True)]
  rep['forecast'] = [dict(r, **s) for r, s in zip(rep['forecast'], sig)]
  monkeypatch.setattr(os, 'getloadavg', lambda: (1.0, 1.0, 1.0))
  doc = tmp_path / 'page.md'
  with _flags(models=['hybrid'], seeds=['0'], workdir_root=str(tmp_path), doc=str(doc),
              run=False, signals=['kl', 'grad_cos'], results=str(tmp_path / 'results.json')):
    _write(tmp_path, 'tiny_model-hybrid_s0', _off(), wall=400.0)
    _write(tmp_path, 'tiny_model-hybrid-guard-repair-signals_s0', rep, wall=500.0)
    self_healing.main([])
    cmd = self_healing.command('hybrid', 'repair', 0, '/w')
    assert self_healing.command('hybrid', 'off', 0, '/w')[-1] == '--verbosity=-1'
  assert cmd[-1] == '--config.guard.signals=kl,grad_cos'
  summary = json.loads(capsys.readouterr().out.splitlines()[-1])
  # The two falls (chat -9, math -6): grad_cos -0.5 and -0.1 (both right), combined both right;
  # the KL of the falls 0.15, of the rest (chat in math_rl, -2) 0.01.
  assert 'tiny_model-hybrid_s0' not in summary['missing'] and summary['forecast'] == {
      'n': 3, 'mean_abs_error': 4.0, 'falls': 2, 'falls_sign_right': 1, 'falls_grad_cos': 2,
      'falls_sign_right_grad_cos': 2, 'falls_combined': 2, 'falls_sign_right_combined': 2,
      'kl_mean_falls': 0.15, 'kl_mean_rest': 0.01}
  text = doc.read_text()
  assert ("the gradient cosine's sign was right on 2 of the 2 falls it was defined on, the "
          'combined sign on 2 of 2; mean KL drift (nats per token) of the falls 0.15, of the '
          'rest 0.01.') in text
  assert ('| tiny_model-hybrid-guard-repair-signals_s0 | code_rl | chat | 5 of 20 | -12.0 ± 5.0 '
          '| -9.0 | 0.2 | -0.50 | fall |') in text
  assert '| code_rl | swe | 5 of 20 | -4.0 ± 5.0 | - | 0.3 | - | fall |' in text
