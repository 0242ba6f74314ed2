"""First-hour breaks of issue #40 that no other test file covers.

A missing tokenizer was reported through cascade.main's storage-error path ("... nothing already
written was changed: free the space or fix the path"), because `models.tokenizer.load` raised a
plain FileNotFoundError (an OSError, which that path takes for the disk failing).
"""

import os
import subprocess
import sys

import pytest

from models import paths
from models import tokenizer as tokenizer_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize('kind', ['file', 'directory'])
def test_a_missing_tokenizer_is_a_path_error_not_a_storage_failure(tmp_path, kind):
  """What cascade.main says in one line (a paths.PathError) and still a FileNotFoundError for
  callers that catch that."""
  target = tmp_path / 'nothing' / 'tok.model' if kind == 'file' else tmp_path
  with pytest.raises(tokenizer_lib.TokenizerNotFound) as e:
    tokenizer_lib.load(target)
  assert isinstance(e.value, paths.PathError) and isinstance(e.value, FileNotFoundError)
  assert str(target) in str(e.value) and '\n' not in str(e.value)


@pytest.mark.heavy
def test_a_run_with_a_missing_tokenizer_stops_with_one_line(copy_cascade, tmp_path):
  """The command line: exit 2 and one line naming the tokenizer file, not the storage advice."""
  config = copy_cascade(tmp_path, train=8, eval_=4, sft=8)
  config.write_text(config.read_text().replace("root + '/tok.model'", "root + '/no/tok.model'"))
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run([sys.executable, '-m', 'cascade.main', f'--config={config}',
                         f'--workdir={tmp_path / "w"}'], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert lines == [f'error: tokenizer file {tmp_path}/no/tok.model does not exist'], lines
