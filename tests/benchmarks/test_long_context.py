"""benchmarks.long_context: the table, the growth summary and the JSON line (slow: compiles)."""

import json

from absl import flags
from absl.testing import flagsaver
import pytest

from benchmarks import long_context


@pytest.mark.slow
def test_long_context_benchmark_prints_growth_and_json(capsys):
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
