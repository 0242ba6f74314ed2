"""benchmarks/prepare_hosts.py at a small size: two JAX processes prepare a stage's cache with the
code before the split (each tokenizes every row) and after it (each its share)."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BEFORE = '6666720'      # the last commit before shards were dealt by size and preparing split


@pytest.mark.heavy      # four JAX processes and a tokenizer trained: ~2 min at load 8
@pytest.mark.multiprocess
def test_before_each_process_tokenizes_everything_after_each_its_share(tmp_path):
  if subprocess.run(['git', 'cat-file', '-e', BEFORE], cwd=ROOT, check=False).returncode:
    pytest.skip(f'commit {BEFORE} is not in this checkout (a shallow clone)')
  page = tmp_path / 'page.md'
  page.write_text('# Page\n\n## Preparing on several processes, measured\n\nold\n\n'
                  '## Next\n\nkept\n')
  rows = 20000          # 3 parts of 8,192: the first process makes 1, the second 2
  out = subprocess.run([sys.executable, '-m', 'benchmarks.prepare_hosts', f'--before={BEFORE}',
                        '--after=HEAD', f'--rows={rows}', f'--dir={tmp_path / "d"}',
                        f'--out={page}'], capture_output=True, text=True, cwd=ROOT,
                       check=False, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  res = json.loads(out.stdout.strip().splitlines()[-1])
  before, after = res['runs']['before'][1], res['runs']['after'][1]
  probe = 8
  assert [p['tokenized'] for p in before] == [rows + probe] * 2
  assert [p['tokenized'] for p in after] == [8192 + probe, rows - 8192 + probe]
  assert len({p['digest'] for p in before + after}) == 1          # the same items, read back
  read = lambda ps: sum(p['shards'] + p['plain'] for p in ps)
  assert read(after) < read(before)
  text = page.read_text()
  assert 'old' not in text and text.endswith('## Next\n\nkept\n')
  assert '| after (' in text and 'before and after: yes.' in text
