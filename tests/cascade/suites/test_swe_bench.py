"""SWE-bench Verified: the released parquet with its localisation read into the SWE stage's
prompt, predictions in the official harness's format, the refusal without a container runtime
(predictions still written) and the harness's report read back."""

import json
import os

import pytest

from cascade import suites
from cascade.data import released
from cascade.suites import base
from cascade.suites import swe_bench

FIXTURES = os.path.join(os.path.dirname(__file__), '..', '..', 'fixtures', 'suites')
DIFF = ('--- a/django/contrib/auth/validators.py\n+++ b/django/contrib/auth/validators.py\n'
        '@@ -3,3 +3,3 @@\n class ASCIIUsernameValidator(validators.RegexValidator):\n'
        "-    regex = r'^[\\w.@+-]+$'\n+    regex = r'^[\\w.@+-]+\\Z'")


def _read():
  return suites.get('swe_bench_verified').read(os.path.join(FIXTURES, 'swe_bench_verified'))


def _script(path, body):
  path.write_text('#!/bin/sh\n' + body + '\n')
  path.chmod(0o755)
  return str(path)


def test_records_and_the_agentless_prompt():
  records = _read()
  assert [r['id'] for r in records] == ['astropy__astropy-12907', 'django__django-11099']
  text = records[1]['messages'][0]['content']
  assert text.startswith('Issue:\nUsernameValidator allows trailing newline in usernames')
  assert 'File django/contrib/auth/validators.py:\n```\n@deconstructible' in text
  assert text.endswith(released.SWE_INSTRUCTION)
  assert records[0]['metadata']['gold_patch'].startswith('diff --git a/astropy/modeling/')


def test_missing_localisation_is_a_one_line_error(tmp_path):
  with pytest.raises(base.DataMissing, match=r"suite 'swe_bench_verified': no "
                                             r'localization.jsonl under'):
    swe_bench.swe_bench_verified.read(str(tmp_path))
  src = os.path.join(FIXTURES, 'swe_bench_verified')
  (tmp_path / 'data').mkdir()
  (tmp_path / 'data' / 'test-00000-of-00001.parquet').write_bytes(
      open(os.path.join(src, 'data', 'test-00000-of-00001.parquet'), 'rb').read())
  first = open(os.path.join(src, 'localization.jsonl')).readline()
  (tmp_path / 'localization.jsonl').write_text(first)
  with pytest.raises(base.BadRecord, match=r"test-00000-of-00001.parquet:2: instance "
                                           r"'django__django-11099' has no row in "
                                           r'localization.jsonl'):
    swe_bench.swe_bench_verified.read(str(tmp_path))


def test_predictions_written_in_the_harness_format_then_a_one_line_refusal(tmp_path):
  records = _read()
  docker = _script(tmp_path / 'docker', 'echo "Cannot connect to the Docker daemon" >&2; exit 1')
  grader = swe_bench.swe_bench_verified.grader(directory=str(tmp_path / 'out'),
                                               model_name='org/model', docker=docker)
  completions = [['<think>unfinished'], [f'<think>ok</think>Here:\n```diff\n{DIFF}\n```']]
  with pytest.raises(swe_bench.Unscorable) as e:
    grader.grade_batch(records, completions)
  message = str(e.value)
  assert '\n' not in message and 'predictions written to' in message
  assert ('daemon not reachable: Cannot connect to the Docker daemon' in message
          or 'swebench package is not installed' in message)
  assert 'swebench.harness.run_evaluation --dataset_name princeton-nlp/SWE-bench_Verified' in message
  lines = [json.loads(x) for x in (tmp_path / 'out' / 'predictions-0.jsonl').read_text()
           .splitlines()]
  assert lines == [
      {'instance_id': 'astropy__astropy-12907', 'model_name_or_path': 'org/model',
       'model_patch': ''},
      {'instance_id': 'django__django-11099', 'model_name_or_path': 'org/model',
       'model_patch': DIFF + '\n'}]


def test_no_runtime_reasons(tmp_path):
  assert 'not found' in swe_bench.runtime_missing(str(tmp_path / 'nope')) or \
      'swebench' in swe_bench.runtime_missing(str(tmp_path / 'nope'))


def test_scores_are_the_harness_reports_resolved_ids(tmp_path, monkeypatch):
  """Where the harness runs, each sample's predictions file is one harness run; a fake harness
  writes the report the official one writes (its name and 'resolved_ids')."""
  records = _read()
  monkeypatch.setattr(swe_bench, 'runtime_missing', lambda docker: None)
  calls = []

  def fake(path, run_id, ids, workers):
    calls.append((os.path.basename(path), run_id, list(ids), workers))
    preds = [json.loads(x) for x in open(path)]
    resolved = [p['instance_id'] for p in preds if 'Z' in p['model_patch']]
    report = json.dumps({'resolved_ids': resolved, 'unresolved_ids': []})
    name = swe_bench.report_path('.', 'org/model', run_id)
    return ['python3', '-c', f'open({name!r}, "w").write({report!r})']

  grader = swe_bench.HarnessGrader(directory=str(tmp_path), model_name='org/model', workers=2,
                                   command=fake)
  grades = grader.grade_batch(records, [['no diff', 'no patch either'],
                                        [f'```diff\n{DIFF}\n```', 'nothing']])
  assert [[g.score for g in row] for row in grades] == [[0.0, 0.0], [1.0, 0.0]]
  assert calls == [('predictions-0.jsonl', 'cascade-0-0', [r['id'] for r in records], 2),
                   ('predictions-1.jsonl', 'cascade-0-1', [r['id'] for r in records], 2)]
  assert (tmp_path / 'org__model.cascade-0-1.json').exists()
