"""benchmarks/data.py at its smoke size, and `python -m cascade.prepare` on the data it makes."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args):
  out = subprocess.run([sys.executable, '-m', *args], capture_output=True, text=True,
                       cwd=ROOT, check=False, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


@pytest.mark.heavy
def test_small_benchmark_and_the_prepare_command(tmp_path):
  d, report = tmp_path / 'data', tmp_path / 'report.md'
  out = _run('benchmarks.data', '--small', f'--dir={d}', f'--out={report}', '--batches=5')
  res = json.loads(out.strip().splitlines()[-1])
  cold, warm = res['cold'], res['warm']
  assert cold['sft_rows'] == warm['sft_rows'] == 3000 and warm['rl_rows'] == 500
  # The warm start reads the cache the cold one wrote: the same first batch, and faster.
  assert cold['first_batch_tokens'] == warm['first_batch_tokens'] > 0
  assert warm['startup_s'] < cold['startup_s']
  assert 0 < warm['rss_peak_gib_at_first_batch'] < 2
  assert set(cold['prepare_rows_per_s']) == {'sft', 'math_rl'}
  text = report.read_text()
  for line in ('- command: `', '- load average', '| start-up to the first batch',
               'Cold preparation (streamed, one process): sft '):
    assert line in text, text

  # The same data through the command line, into another cache: prepared, then found.
  cfg = tmp_path / 'cfg.py'
  cfg.write_text('from benchmarks import data\n\n\ndef get_config():\n'
                 f'  return data.config({str(d)!r}, "")\n')
  cache = tmp_path / 'cache2'
  first = _run('cascade.prepare', f'--config={cfg}', f'--cache_dir={cache}')
  assert "stages[0] 'sft': prepared 3000 rows in " in first and 'rows/s' in first
  assert "stages[1] 'math_rl': prepared 500 rows" in first
  again = _run('cascade.prepare', f'--config={cfg}', f'--cache_dir={cache}')
  assert "stages[0] 'sft': data from the prepared cache" in again and 'prepared 3000' not in again
  manifests = sorted(cache.glob('*/manifest.json'))
  assert [p.parent.name.split('-')[0] for p in manifests] == ['math_rl', 'sft']


@pytest.mark.heavy
@pytest.mark.multiprocess
def test_small_cold_open_by_one_and_two_processes(tmp_path):
  """--open_hosts: two JAX processes each read about half of the shards' bytes the single
  process reads, draw the same first batches, and the page keeps its other sections."""
  d, report = tmp_path / 'data', tmp_path / 'report.md'
  report.write_text('# Data path benchmark\n\nbefore\n\n## Other\n\nafter\n')
  out = _run('benchmarks.data', '--open_hosts=1,2', '--small', f'--dir={d}', f'--out={report}')
  runs = json.loads(out.strip().splitlines()[-1])
  one, two = runs['1'][0], runs['2']
  assert [r['rank'] for r in two] == [0, 1]
  assert {r['first_ids'] for r in two} == {one['first_ids']}
  assert sum(r['open_from_data'] for r in two) == one['open_from_data'] > 0
  for r in two:                       # 16 + 8 shards of near-equal size, dealt 8 + 4 each
    assert 0.4 < r['open_from_data'] / one['open_from_data'] < 0.6, r
  text = report.read_text()
  assert text.startswith('# Data path benchmark\n\nbefore\n\n## Other\n\nafter\n')
  assert text.count('## Cold open across processes') == 1
  for line in ('- command: `', '- load average', '| 2 | 1 |', 'first batches are the same '
               'rows in every run (the single process\'s order): yes.'):
    assert line in text, text


@pytest.mark.heavy
def test_small_tokenization_beside_the_library_batch_encode(tmp_path):
  """--tokenize: both tokenizers' cold preparation and batch encode of the same rows are timed
  and written as their own section, the rest of the page kept."""
  d, report = tmp_path / 'data', tmp_path / 'report.md'
  report.write_text('# Data path benchmark\n\nbefore\n')
  out = _run('benchmarks.data', '--tokenize', '--rows=60', '--rl_rows=20', '--scale=0.05',
             f'--dir={d}', f'--out={report}')
  results = json.loads(out.strip().splitlines()[-1])
  assert [r['tokenizer'] for r in results] == ['SentencePieceTokenizer', 'HFTokenizer']
  for r in results:
    assert r['rows'] == 60 and r['library_s'] > 0 and r['ours_s'] > 0
    # Both seconds are printed to the millisecond, so the ratio (of the unrounded ones) lies
    # within what those roundings allow.
    half = 0.0005
    lo = (r['ours_s'] - half) / (r['library_s'] + half)
    hi = (r['ours_s'] + half) / max(r['library_s'] - half, 1e-9)
    assert lo * 0.99 <= r['ratio'] <= hi * 1.01, r
  text = report.read_text()
  assert text.startswith('# Data path benchmark\n\nbefore\n')
  assert text.count("## Cold tokenization against the tokenizer library's batch encode") == 1
  assert '--tokenize' in text and '- load average' in text and '| HFTokenizer |' in text
