"""Suites as the matrix's columns: config.eval.suites checked, scored after the domains of every
row, stopped by SIGTERM mid-suite and resumed to the same row, in results.json/md."""

import dataclasses
import json
import pathlib
import re
import types

import pytest

from cascade import checkpoint
from cascade import config as config_lib
from cascade import evaluation
from cascade import preemption
from cascade import runner
from cascade import suites
from cascade.data import shards
from configs import tiny


def _register(toy):
  if 'toy_copy' not in suites.names():
    suites.register(toy.suite(samples=3))
  return suites.get('toy_copy')


def _plan(fakes, toy, data_dir, **eval_fields):
  _register(toy)
  plan = fakes.toy_config([fakes.SFT_STAGE])
  ev = dataclasses.replace(plan.eval, suites=('toy_copy',), suite_data=str(data_dir),
                           suite_batch_size=2, **eval_fields)
  return dataclasses.replace(plan, eval=ev)


def _ctx(fakes, plan, workdir):
  right = lambda num, g: (num + g) % 2 == 0
  return types.SimpleNamespace(
      plan=plan, sampler=fakes.OwnAnswerSampler(right=right), tokenizer=fakes.CharTokenizer(),
      workdir=str(workdir), before_write=lambda: None, config_hash='cfg1',
      data=types.SimpleNamespace(eval_sets={'a': [fakes.record('a', i, i) for i in range(4)]},
                                 validation_sets={}),
      verifiers=types.SimpleNamespace(can_evaluate=lambda d: True,
                                      eval_verifier=fakes.ValueVerifier),
      sample_cls=fakes.Sample, progress=checkpoint.Progress(str(workdir)),
      writer=types.SimpleNamespace(write_scores=lambda *a: None))


@pytest.fixture
def data(tmp_path, toy):
  d = tmp_path / 'data' / 'toy_copy'
  d.mkdir(parents=True)
  d.joinpath('records.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in toy.records(5)))
  return tmp_path / 'data'


def test_a_row_scores_the_suites_after_its_domains_and_results_show_them(fakes, toy, data,
                                                                       tmp_path):
  plan = _plan(fakes, toy, data)
  ctx = _ctx(fakes, plan, tmp_path / 'run')
  row = runner.evaluate_row(ctx, 'sft', 0, ['a'], params=None)
  cell = row['suites']['toy_copy']
  assert (cell['n'], cell['k'], cell['samples']) == (5, 3, 15)
  assert cell['protocol'] == _register(toy).protocol_hash()
  assert (tmp_path / 'run' / 'suites' / 'sft' / 'toy_copy' / 'grades.jsonl').exists()
  res = evaluation.results(ctx.progress.rows, ['a'])
  assert res['suites'] == ['toy_copy']
  got = res['suite_scores'][0][0]
  assert got['value'] == pytest.approx(cell['value'], abs=1e-4)
  assert set(got) >= {'value', 'stderr', 'k', 'n', 'samples', 'metric', 'protocol', 'pass@3'}
  md = evaluation.markdown(res)
  assert 'Suites (value ± standard error' in md
  assert f'| sft | {cell["value"]:.1f} ± {cell["stderr"]:.1f} |' in md


def test_sigterm_in_a_suite_stops_the_row_and_the_rerun_makes_the_same_row(
    fakes, toy, data, tmp_path, monkeypatch):
  plan = _plan(fakes, toy, data)
  whole = runner.evaluate_row(_ctx(fakes, plan, tmp_path / 'whole'), 'sft', 0, ['a'], None)
  # SIGTERM seen before the suite's second batch (asked once before the domain's one batch).
  asked = []
  monkeypatch.setattr(preemption, 'stop_requested',
                      lambda: 'SIGTERM' if len(asked.append(1) or asked) == 3 else None)
  ctx = _ctx(fakes, plan, tmp_path / 'run')
  with pytest.raises(preemption.Preempted) as e:
    runner.evaluate_row(ctx, 'sft', 0, ['a'], None)
  assert str(e.value).startswith("SIGTERM: stopped evaluating [0] sft at suite 'toy_copy' "
                                 'before batch 2/3 (1 domain(s) and 0 batch(es) kept in ')
  assert ctx.progress.rows == []
  monkeypatch.setattr(preemption, 'stop_requested', lambda: None)
  ctx = _ctx(fakes, plan, tmp_path / 'run')
  row = runner.evaluate_row(ctx, 'sft', 0, ['a'], None)
  # The domain came from eval_partial.json, the suite's first batch from its grades file.
  assert len(ctx.sampler.calls) == 2 and row['suites']['toy_copy']['resumed'] == 1
  drop = lambda r: {k: v for k, v in r['suites']['toy_copy'].items()
                    if k not in ('seconds', 'resumed')}
  assert drop(row) == drop(whole) and row['scores'] == whole['scores']


def test_a_suites_missing_data_stops_the_run_before_it_starts_in_one_line(fakes, toy,
                                                                         tmp_path):
  plan = _plan(fakes, toy, tmp_path / 'nowhere')
  with pytest.raises(shards.DataError) as e:
    evaluation.suite_sets(plan)
  msg = str(e.value)
  assert msg.startswith("config.eval.suites: suite 'toy_copy': no *.jsonl under ")
  assert str(tmp_path / 'nowhere' / 'toy_copy') in msg and '\n' not in msg


def test_suite_settings_are_checked_with_the_config(tiny_world_root):
  c = tiny.get_config(f'smoke,root={tiny_world_root}')
  plan = config_lib.validate(c)
  assert plan.eval.suites == ('tiny_chat', 'tiny_if', 'tiny_math', 'tiny_code', 'tiny_swe')
  assert plan.eval.suite_settings('tiny_math') == suites.get('tiny_math').protocol
  bad = [
      (dict(suites=['tiny_math', 'aime99']),
       r"config\.eval\.suites=\['tiny_math', 'aime99'\]: unknown suite 'aime99' \(known: .*"
       r'tiny_chat, tiny_code, tiny_if, tiny_math'),
      (dict(suites=['tiny_math', 'tiny_math']), r'names a suite twice'),
      (dict(suite_protocol={'tiny_math': {'samplez': 2}}),
       r"config\.eval\.suite_protocol\.tiny_math=\{'samplez': 2\}: unknown protocol field"),
      (dict(suite_protocol={'aime25': {'samples': 2}}),
       r"config\.eval\.suite_protocol: names suite 'aime25', which config\.eval\.suites does "
       'not list'),
      (dict(suite_protocol={'tiny_math': {'max_new_tokens': 300}}),
       r"suite 'tiny_math' samples up to 300 new tokens, more than the model's "
       r'max_seq_len=256 holds: set config\.eval\.suite_protocol\.tiny_math\.max_new_tokens'),
      (dict(suite_protocol={'tiny_math': {'max_new_tokens': 100}}),
       r'past config\.sampler\.new_token_buckets \(largest 48\)'),
  ]
  for fields, pattern in bad:
    c = tiny.get_config(f'smoke,root={tiny_world_root}')
    for k, v in fields.items():
      setattr(c.eval, k, v)
    with pytest.raises(config_lib.ConfigError, match=pattern) as e:
      config_lib.validate(c)
    assert '\n' not in str(e.value)
  c = tiny.get_config(f'smoke,root={tiny_world_root}')
  c.eval.suite_protocol = {'tiny_math': {'samples': 2}}
  quick = config_lib.validate(c).eval.suite_settings('tiny_math')
  assert quick.samples == 2 and quick.pass_ks == ()


def test_the_evaluation_pages_config_lines_check_out():
  """docs/evaluation.md's config lines, on the 14B recipe: its matrix gains the three suites at
  the recipe's evaluation budget, a protocol of its own (another hash than the paper's)."""
  from configs import nemotron_cascade_14b  # pylint: disable=g-import-not-at-top
  page = (pathlib.Path(__file__).resolve().parents[3] / 'docs' / 'evaluation.md').read_text()
  block = re.search(r"```python\n(c\.eval\.suites = .*?)```", page, re.S).group(1)
  c = nemotron_cascade_14b.get_config()
  exec(block, {'c': c})  # pylint: disable=exec-used
  plan = config_lib.validate(c)
  assert plan.eval.suites == ('aime25', 'ifeval', 'gpqa_diamond')
  for name in plan.eval.suites:
    mine, paper = plan.eval.suite_settings(name), suites.get(name).protocol
    assert mine == paper.replaced(max_new_tokens=61_440) and mine != paper
  # The paper's own 64K budget does not fit the recipe's positions: one line says which field.
  c.eval.suite_protocol = None
  with pytest.raises(config_lib.ConfigError, match=r"suite 'aime25' samples up to 65536 new "
                                                   "tokens, more than the model's max_seq_len"):
    config_lib.validate(c)
