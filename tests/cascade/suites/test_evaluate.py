"""`python -m cascade.evaluate` end to end (heavy): a tiny run scores the tiny world's suites after
its stage, and the command on the run's final checkpoint prints every suite with avg@k ± s.e.
and pass@k, the same numbers, as docs/evaluation.md shows it; missing data is one line, exit 2."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
SUITES = ('tiny_chat', 'tiny_if', 'tiny_math', 'tiny_code', 'tiny_swe')
# The smoke cascade's first two stages (SFT, reward model): one row of the matrix.
SMOKE = 'configs/tiny.py:smoke,drop=rlhf+if_rl+math_rl+code_rl+swe_rl,root={root}'


def _page_command(prefix: str) -> str:
  """The one command of docs/evaluation.md that starts with `prefix`, as the page shows it."""
  text = (REPO / 'docs' / 'evaluation.md').read_text(encoding='utf-8')
  found = sorted({line.strip() for line in text.splitlines() if line.strip().startswith(prefix)})
  assert len(found) == 1, found
  return found[0]


def _run(cmd, cwd, timeout=1800):
  # `python` of a page's command is this venv's, as for tests/test_doc_commands.py.
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS='cpu',
             PATH=f'{pathlib.Path(sys.prefix) / "bin"}{os.pathsep}{os.environ["PATH"]}')
  return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                        check=False, shell=isinstance(cmd, str))


@pytest.mark.heavy
def test_a_runs_checkpoint_is_scored_on_every_tiny_suite_as_the_matrix_scored_it(
    tiny_world_root, bwrap_sandbox, tmp_path):
  del bwrap_sandbox                # the code and SWE suites grade in the sandbox
  work = tmp_path / 'runs' / 'tiny'
  run = _run([sys.executable, '-m', 'cascade.main', f'--config={SMOKE.format(root=tiny_world_root)}',
              f'--workdir={work}'], REPO)
  assert run.returncode == 0, run.stderr[-3000:]
  for i, name in enumerate(SUITES, 1):
    assert re.search(rf'^\[0\] sft: suite {i}/5 {name} avg@4 \d+\.\d ± \d+\.\d, pass@4 \d+\.\d '
                     r'\(16 samples, ', run.stdout, re.M), run.stdout[-3000:]
  res = json.loads((work / 'results.json').read_text())
  assert res['suites'] == list(SUITES) and res['stages'] == ['sft']
  assert 'Suites (value ± standard error' in (work / 'results.md').read_text()
  matrix = dict(zip(res['suites'], res['suite_scores'][0]))

  # The page's command, run where `runs/tiny` is this run: the run's suites, data and prompts.
  cmd = _page_command('python -m cascade.evaluate --imports=tiny_world --checkpoint=runs/tiny')
  out = _run(cmd, tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  for i, name in enumerate(SUITES, 1):
    assert re.search(rf'^suite {i}/5 {name}: avg@4 \d+\.\d ± \d+\.\d, pass@4 \d+\.\d \(4 prompts, '
                     r'16 samples, ', out.stdout, re.M), out.stdout[-3000:]
    assert re.search(rf'^\| {name} \| avg@4 \| \d+\.\d ± \d+\.\d \| pass@4 \d+\.\d \| 4 \| 4 \| 16 '
                     r'\|', out.stdout, re.M), out.stdout[-3000:]
  rep = json.loads((work / 'evaluations' / 'sft' / 'evaluation.json').read_text())
  assert rep['stage'] == 'sft' and list(rep['suites']) == list(SUITES)
  # The export, loaded from its files with its HF tokenizer, samples what the run's policy did.
  for name in SUITES:
    got, want = rep['suites'][name], matrix[name]
    for key in ('value', 'stderr', 'pass@4', 'n', 'k', 'protocol'):
      assert got[key] == pytest.approx(want[key], abs=1e-4), (name, key)

  # The same form with the suites and data named, --download where the files are already there.
  hf = work / 'stages' / '00_sft' / 'hf'
  world = pathlib.Path(tiny_world_root) / 'seed0'
  named = _run([sys.executable, '-m', 'cascade.evaluate', '--imports=tiny_world',
                f'--checkpoint={hf}', '--suites=tiny_math,tiny_chat', f'--data_dir={world}',
                '--download', '--samples=2', '--max_prompts=8', f'--workdir={tmp_path / "named"}'],
               tmp_path)
  assert named.returncode == 0, named.stderr[-3000:]
  for name in ('tiny_math', 'tiny_chat'):
    assert re.search(rf'^\| {name} \| avg@2 \| \d+\.\d ± \d+\.\d \| .* \| 8 \| 2 \| 16 \|',
                     named.stdout, re.M), named.stdout[-3000:]

  # Missing data: one line naming the suite and the file, exit 2, before any model is loaded.
  missing = _run([sys.executable, '-m', 'cascade.evaluate', '--imports=tiny_world',
                  f'--checkpoint={work}', f'--data_dir={tmp_path / "nowhere"}'], tmp_path)
  assert missing.returncode == 2, missing.stderr[-3000:]
  assert missing.stderr.strip() == (
      f"error: suite 'tiny_chat': no chat/heldout.jsonl under {tmp_path / 'nowhere'} (the tiny "
      'world (tiny_world/world.py), chat/heldout.jsonl)')
