"""Suites on any checkpoint (what `python -m cascade.evaluate` runs): which policy a directory
names, which suites and protocols, missing data in one line (exit 2), --download's one line, the
report with the papers' numbers beside."""

import json
import os
import sys

import pytest

from cascade import config as config_lib
from cascade import exits
from cascade import schema
from cascade.data import shards
from cascade.suites import base
from cascade.suites import checkpoint


def _hf(d):
  d.mkdir(parents=True)
  (d / 'config.json').write_text('{"architectures": ["Qwen3ForCausalLM"]}')
  return d


def _run(tmp_path, eval_=None):
  """A run's workdir: stages sft (index 0) and math_rl (index 2) exported, rm (1) not."""
  work = tmp_path / 'run'
  for stage in ('00_sft', '02_math_rl'):
    _hf(work / 'stages' / stage / 'hf')
  done = {'sft': {'index': 0, 'hf': 'elsewhere/run/stages/00_sft/hf'},
          'rm': {'index': 1},
          'math_rl': {'index': 2, 'hf': 'elsewhere/run/stages/02_math_rl/hf'}}
  (work / 'progress.json').write_text(json.dumps({'done': done, 'rows': []}))
  (work / 'config.json').write_text(json.dumps({'hash': 'h', 'config': {'eval': eval_ or {}}}))
  return work


def test_a_run_names_its_last_export_or_a_stage_and_an_hf_directory_itself(tmp_path):
  work = _run(tmp_path)
  src = checkpoint.resolve(str(work))
  assert (src.hf_dir, src.stage, src.run) == (str(work / 'stages' / '02_math_rl' / 'hf'),
                                             'math_rl', str(work))
  assert checkpoint.resolve(str(work), 'sft').hf_dir == str(work / 'stages' / '00_sft' / 'hf')
  hf = _hf(tmp_path / 'hf')
  assert checkpoint.resolve(str(hf)) == checkpoint.Source(hf_dir=str(hf))
  for args, pattern in (((str(work), 'rm'), r"--stage=rm: not a finished stage of .* that "
                                            r'exported a policy \(those are: sft, math_rl\)'),
                        ((str(hf), 'sft'), r"--stage=sft: .* is not a run's workdir"),
                        ((str(tmp_path / 'none'),), r'holds no HF checkpoint \(no config.json\)')):
    with pytest.raises(config_lib.ConfigError, match=pattern):
      checkpoint.resolve(*args)


def test_the_suites_and_their_protocols_come_from_the_flags_or_the_run(tmp_path, toy):
  from cascade import suites  # pylint: disable=g-import-not-at-top
  if 'toy_copy' not in suites.names():
    suites.register(toy.suite(samples=3))
  paper = suites.get('toy_copy')
  work = _run(tmp_path, {'suites': ['toy_copy'], 'suite_data': '/data/s', 'suite_prompts': 7,
                         'suite_protocol': {'toy_copy': {'max_new_tokens': 6}}})
  src = checkpoint.resolve(str(work))
  (suite,) = checkpoint.plan([], src)                     # the run's suites and overrides
  assert suite.protocol == paper.protocol.replaced(max_new_tokens=6)
  (suite,) = checkpoint.plan(['toy_copy'], src, {'samples': 2})
  assert (suite.protocol.samples, suite.protocol.max_new_tokens) == (2, 6)
  assert suite.protocol_hash() not in (paper.protocol_hash(),)
  assert checkpoint.default_data_dir(src) == '/data/s' and checkpoint.default_prompts(src) == 7
  hf = checkpoint.resolve(str(_hf(tmp_path / 'hf')))
  assert checkpoint.default_data_dir(hf) == os.path.join('data', 'suites')
  with pytest.raises(config_lib.ConfigError, match=r'--suites: no suite named .* known: .*toy'):
    checkpoint.plan([], hf)
  with pytest.raises(config_lib.ConfigError, match=r"--suites: unknown suite 'nope'; known: "):
    checkpoint.plan(['nope'], hf)
  with pytest.raises(config_lib.ConfigError, match=r"protocol overrides: suite 'toy_copy': "
                                                   'Protocol.top_p must be in'):
    checkpoint.plan(['toy_copy'], hf, {'top_p': 2.0})


def test_bfcls_multi_turn_categories_are_refused_in_one_line_and_exit_2(tmp_path, capsys):
  """`--suites=bfcl_v3_multi_turn_base`: why it is not a suite, one line, exit 2; and the same
  reason from a config naming it."""
  hf = checkpoint.resolve(str(_hf(tmp_path / 'hf')))
  with pytest.raises(SystemExit) as done:
    exits.run(lambda: checkpoint.plan(['aime25', 'bfcl_v3_multi_turn_base'], hf), str(tmp_path))
  assert done.value.code == 2
  err = capsys.readouterr().err.strip()
  assert '\n' not in err and err.startswith(
      "error: --suites: suite 'bfcl_v3_multi_turn_base' is not available: BFCL's multi-turn "
      "categories are scored by executing every turn's calls against bfcl-eval's API "
      'simulators'), err
  ev = config_lib.Eval(num_samples=1, max_new_tokens=8, max_prompt_len=8, num_prompts=1,
                       batch_size=1, temperature=1.0, top_p=1.0,
                       suites=('bfcl_v3_multi_turn_long_context',))
  with pytest.raises(config_lib.ConfigError, match=r"suites=.*: suite "
                                                   r"'bfcl_v3_multi_turn_long_context' is not "
                                                   r'available: .*API simulators'):
    ev.check(schema.failer('config.eval', ev))


def test_missing_data_is_one_line_naming_the_suite_and_the_file_and_exit_2(tmp_path, toy,
                                                                            capsys):
  suite = toy.suite()
  with pytest.raises(shards.DataError) as e:
    checkpoint.read(suite, str(tmp_path))
  assert str(e.value).startswith(f"suite 'toy_copy': no *.jsonl under {tmp_path}/toy_copy")
  assert not checkpoint.has_files(suite, str(tmp_path))

  def fails():
    checkpoint.read(suite, str(tmp_path))
  with pytest.raises(SystemExit) as done:
    exits.run(fails, str(tmp_path))
  assert done.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: suite 'toy_copy': no *.jsonl under ") and '\n' not in err
  (tmp_path / 'toy_copy').mkdir()
  (tmp_path / 'toy_copy' / 'r.jsonl').write_text(
      ''.join(json.dumps(r) + '\n' for r in toy.records(5)))
  assert checkpoint.has_files(suite, str(tmp_path))
  assert [r['id'] for r in checkpoint.read(suite, str(tmp_path), max_prompts=3)] == [
      'r0', 'r1', 'r2']


def test_download_says_in_one_line_what_it_did_or_why_not(tmp_path, toy, monkeypatch):
  said = []
  suite = toy.suite()
  assert not checkpoint.download(suite, str(tmp_path), said.append)
  assert said[-1] == (f"--download: suite 'toy_copy' names no Hugging Face dataset (made by the "
                      f'test); place its files under {tmp_path}/toy_copy')
  import dataclasses  # pylint: disable=g-import-not-at-top
  hubbed = dataclasses.replace(suite, hub_dataset='org/toy', hub_files=('data/*.jsonl',))
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  assert not checkpoint.download(hubbed, str(tmp_path), said.append)
  assert said[-1].startswith('--download: the Hugging Face Hub cannot be reached from this '
                             "machine (HF_HUB_OFFLINE is set); place toy_copy's files (org/toy)")
  monkeypatch.setitem(sys.modules, 'huggingface_hub', None)     # not installed
  assert not checkpoint.download(hubbed, str(tmp_path), said.append)
  assert said[-1].startswith('--download: huggingface_hub is not installed')
  # Online: the files the suite names land in its directory.
  calls = []

  class FakeHub:
    @staticmethod
    def snapshot_download(**kw):
      calls.append(kw)
      os.makedirs(os.path.join(kw['local_dir'], 'data'))
      with open(os.path.join(kw['local_dir'], 'data', 'r.jsonl'), 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in toy.records(2))
  monkeypatch.setitem(sys.modules, 'huggingface_hub', FakeHub)
  monkeypatch.setattr(checkpoint, 'hub_reachable', lambda: '')
  assert checkpoint.download(hubbed, str(tmp_path), said.append)
  assert calls == [dict(repo_id='org/toy', repo_type='dataset', allow_patterns=['data/*.jsonl'],
                        local_dir=str(tmp_path / 'toy_copy'))]
  assert said[-1] == f'--download: toy_copy: org/toy -> {tmp_path}/toy_copy'
  assert dataclasses.replace(hubbed, files=('data/*.jsonl',)).read(
      str(tmp_path / 'toy_copy'))[1]['id'] == 'r1'


def test_the_report_puts_the_papers_numbers_beside_with_the_difference_and_its_error(toy):
  reported = (base.Reported(recipe='nemotron_cascade_14b', stage='sft', value=40.0,
                            source='arXiv 2512.13607, Table 1'),
              base.Reported(recipe='nemotron_cascade_14b', stage='math_rl', value=55.5,
                            source='arXiv 2512.13607, Table 1'))
  suite = toy.suite(reported=reported)
  result = {'suite': 'toy_copy', 'metric': 'avg@4', 'value': 50.25, 'stderr': 2.5, 'n': 30,
            'k': 4, 'samples': 120, 'pass@4': 70.0, 'truncated': 0.1, 'protocol': 'abc'}
  rep = checkpoint.report({'toy_copy': result}, [suite],
                          checkpoint.Source(hf_dir='/ckpt'), '/data', 0)
  assert [(p['stage'], p['diff'], p['stderr']) for p in rep['papers']] == [
      ('sft', 10.25, 2.5), ('math_rl', -5.25, 2.5)]
  md = checkpoint.markdown(rep, [suite])
  assert '| toy_copy | avg@4 | 50.2 ± 2.5 | pass@4 70.0 | 30 | 4 | 120 | 10% | abc |' in md
  assert ('| toy_copy | nemotron_cascade_14b | math_rl | 55.5 | 50.2 | -5.2 ± 2.5 | '
          'arXiv 2512.13607, Table 1 |') in md
  assert "the difference carries this run's standard error" in md
