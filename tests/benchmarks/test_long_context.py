"""benchmarks.long_context: the table, the growth summary and the JSON line (slow: compiles)."""

import json

from absl import flags
from absl.testing import flagsaver
import pytest


@pytest.mark.slow
def test_long_context_benchmark_prints_growth_and_json(capsys):
  from benchmarks import long_context  # pylint: disable=g-import-not-at-top
  flags.FLAGS.unparse_flags()
  flags.FLAGS(['long_context'])
  with flagsaver.flagsaver(lengths=['256', '512'], run_max=256, repeats=1, layers=1,
                           embed=64, heads=2, vocab=256):
    long_context.main([])
  out = capsys.readouterr().out.strip().splitlines()
  result = json.loads(out[-1])
  rows = {(r['impl'], r['length']): r for r in result['rows']}
  assert set(rows) == {(i, t) for i in ('dense', 'blockwise') for t in (256, 512)}
  assert 'step_s' in rows['dense', 256] and 'step_s' not in rows['dense', 512]
  assert all(r['flops'] > 0 and r['temp_mib'] > 0 for r in rows.values())
  assert result['temp_growth']['dense'] > result['temp_growth']['blockwise']
  assert out[0].startswith('machine floor:')


@pytest.mark.slow
def test_context_parallel_comparison_writes_its_page(capsys, tmp_path):
  from benchmarks import long_context  # pylint: disable=g-import-not-at-top
  flags.FLAGS.unparse_flags()
  flags.FLAGS(['long_context'])
  doc = tmp_path / 'cp.md'
  with flagsaver.flagsaver(lengths=[], sequence=['2'], cp_lengths=['256'], repeats=1, layers=1,
                           embed=64, heads=2, vocab=256, doc=str(doc)):
    long_context.main([])
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  rows = {(r['program'], r['shards']): r for r in result['context_parallel']}
  programs = ('forward', 'forward (bare)', 'train step', 'train step (bare)')
  assert set(rows) == {(p, n) for p in programs for n in (1, 2)}
  assert all(r['tokens_per_s'] > 0 and r['temp_mib'] > 0 for r in rows.values())
  # Splitting the row over two shards lowers the framework's temporaries per device.
  assert rows['train step', 2]['temp_mib'] < rows['train step', 1]['temp_mib']
  page = doc.read_text()
  assert page.startswith('# Long context: context parallelism') and 'load average' in page
  assert 'train step (bare)' in page


@pytest.mark.slow
def test_hybrid_context_parallel_comparison_writes_its_page(capsys, tmp_path):
  from benchmarks import long_context  # pylint: disable=g-import-not-at-top
  flags.FLAGS.unparse_flags()
  flags.FLAGS(['long_context'])
  doc = tmp_path / 'cp_hybrid.md'
  with flagsaver.flagsaver(lengths=[], sequence=['2'], cp_lengths=['256'], cp_family='hybrid',
                           repeats=1, embed=64, heads=2, vocab=256, doc=str(doc)):
    long_context.main([])
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  rows = {(r['program'], r['shards']): r for r in result['context_parallel']}
  assert set(rows) == {(p, n) for p in ('forward', 'train step') for n in (1, 2)}
  assert all(r['tokens_per_s'] > 0 and r['temp_mib'] > 0 for r in rows.values())
  assert rows['train step', 2]['temp_mib'] < rows['train step', 1]['temp_mib']
  page = doc.read_text()
  assert page.startswith('# Long context: context parallelism against one device (hybrid')
  assert 'hybrid model, blockwise attention' in page and '```text' in page
