"""tools/mutation_sample.py: a seeded sample of a cosmic-ray session's mutants stays pending."""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

cosmic_ray = pytest.importorskip('cosmic_ray', reason='the mutation extra is not installed')

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _session(tmp_path):
  tmp_path.mkdir(parents=True, exist_ok=True)
  (tmp_path / 'mod.py').write_text('def f(a, b):\n  return a + b if a < b else a - b * 2\n')
  (tmp_path / 'cr.toml').write_text(
      '[cosmic-ray]\nmodule-path = "mod.py"\ntimeout = 10.0\nexcluded-modules = []\n'
      'test-command = "true"\n[cosmic-ray.distributor]\nname = "local"\n')
  subprocess.run([pathlib.Path(sys.executable).parent / 'cosmic-ray', 'init', 'cr.toml',
                  's.sqlite'], cwd=tmp_path, check=True, capture_output=True)
  return tmp_path / 's.sqlite'


def _pending(path):
  """(what each pending mutant changes, sorted; how many mutants in all)."""
  from cosmic_ray.work_db import use_db  # pylint: disable=g-import-not-at-top
  with use_db(str(path)) as db:
    return sorted(str(w.mutations) for w in db.pending_work_items), len(db.work_items)


def test_a_seeded_sample_stays_pending_and_the_rest_is_skipped(tmp_path):
  path = _session(tmp_path)
  _, total = _pending(path)
  assert total > 10
  runs = []
  for seed in (0, 0, 1):
    p = _session(tmp_path / f'run{len(runs)}')
    out = subprocess.run([sys.executable, str(ROOT / 'tools' / 'mutation_sample.py'), str(p),
                          '--size=5', f'--seed={seed}'], capture_output=True, text=True,
                         check=True).stdout
    assert f'5 of {total} mutants kept (seed {seed}), {total - 5} skipped' in out
    pending, n = _pending(p)
    assert len(pending) == 5 and n == total
    runs.append(pending)
  # The same seed keeps the same mutants in another session of the same code; another seed
  # keeps others.
  assert runs[0] == runs[1] and runs[0] != runs[2]


def test_a_sample_larger_than_the_session_keeps_everything(tmp_path):
  path = _session(tmp_path)
  _, total = _pending(path)
  subprocess.run([sys.executable, str(ROOT / 'tools' / 'mutation_sample.py'), str(path),
                  f'--size={total + 10}'], check=True, capture_output=True)
  assert len(_pending(path)[0]) == total
  bad = subprocess.run([sys.executable, str(ROOT / 'tools' / 'mutation_sample.py'), str(path),
                        '--size=0'], capture_output=True, text=True)
  assert bad.returncode != 0 and '--size=0 must be >= 1' in bad.stderr


def _exec(path, test_command):
  """Runs the session's pending mutants against `test_command` ('true': all survive)."""
  toml = path.parent / 'cr.toml'
  toml.write_text(toml.read_text().replace('test-command = "true"',
                                           f'test-command = "{test_command}"'))
  subprocess.run([pathlib.Path(sys.executable).parent / 'cosmic-ray', 'exec', 'cr.toml',
                  path.name], cwd=path.parent, check=True, capture_output=True)


def test_survivors_of_an_earlier_session_are_kept_even_after_code_moves(tmp_path):
  tool = [sys.executable, str(ROOT / 'tools' / 'mutation_sample.py')]
  first = _session(tmp_path / 'first')
  subprocess.run(tool + [str(first), '--size=4', '--seed=3'], check=True, capture_output=True)
  sampled, _ = _pending(first)
  # Every mutant survives a test that always passes.
  _exec(first, 'true')
  # The module gains lines above the function: the same mutants are found again.
  second = _session(tmp_path / 'second')
  mod = second.parent / 'mod.py'
  mod.write_text('X = 1\n\n' + mod.read_text())
  subprocess.run([pathlib.Path(sys.executable).parent / 'cosmic-ray', 'init', 'cr.toml',
                  'again.sqlite'], cwd=second.parent, check=True, capture_output=True)
  again = second.parent / 'again.sqlite'
  out = subprocess.run(tool + [str(again), f'--survivors_of={first}'], cwd=second.parent,
                       check=True, capture_output=True, text=True).stdout
  assert f'4 survivors of {first} kept' in out
  strip = lambda ms: sorted(m.split('occurrence')[0] for m in ms)   # occurrences may shift
  assert strip(_pending(again)[0]) == strip(sampled)
  # A session whose mutants were all killed leaves nothing to run again.
  third = _session(tmp_path / 'third')
  subprocess.run(tool + [str(third), '--size=4', '--seed=3'], check=True, capture_output=True)
  _exec(third, 'false')
  fourth = _session(tmp_path / 'fourth')
  subprocess.run(tool + [str(fourth), f'--survivors_of={third}'], cwd=fourth.parent, check=True,
                 capture_output=True)
  assert _pending(fourth)[0] == []
  bad = subprocess.run(tool + [str(fourth), '--size=3', f'--survivors_of={third}'],
                       capture_output=True, text=True)
  assert bad.returncode != 0 and 'exactly one of' in bad.stderr


@pytest.mark.heavy
def test_make_mutation_samples_then_reruns_the_survivors(tmp_path):
  """docs/testing.md's `make mutation` with MUTATION_SAMPLE, then MUTATION_RERUN over the first run's
  sessions (on rl/buckets.py and its own fast tests)."""
  if shutil.which('make') is None:
    pytest.skip('needs make')
  venv = pathlib.Path(sys.executable).parent.parent
  base = ['make', '-C', str(ROOT), '-o', f'{venv}/.stamp-mutation', 'mutation', f'VENV={venv}',
          'MUTATE=rl/buckets.py', 'MUTATION_TESTS=tests/rl/test_buckets.py']
  first = subprocess.run(base + ['MUTATION_SAMPLE=3', 'MUTATION_SEED=0',
                                 f'MUTATION_DIR={tmp_path / "a"}'],
                         capture_output=True, text=True, timeout=600)
  assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
  assert '3 of ' in first.stdout and 'mutants kept (seed 0)' in first.stdout
  survived = int(re.search(r'surviving mutants: (\d+)', first.stdout).group(1))
  (tmp_path / 'prev').mkdir()
  shutil.copy(tmp_path / 'a' / 'rl_buckets_py.sqlite', tmp_path / 'prev')
  again = subprocess.run(base + [f'MUTATION_RERUN={tmp_path / "prev"}',
                                 f'MUTATION_DIR={tmp_path / "b"}'],
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
  assert re.search(rf'{survived} survivors of \S+ kept', again.stdout), again.stdout[-2000:]
