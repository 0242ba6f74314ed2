"""notebooks/quickstart.ipynb runs top to bottom (nbclient, the venv's python3 kernel), tiny.

The notebook reads CASCADE_NOTEBOOK_CONFIG / _STEPS / _WORKDIR. The default
test runs a two-stage cascade (SFT -> GRPO) on a toy 'copy' domain written by
the test, two steps per stage; the slow one runs configs/tiny.py:smoke (the
notebook's default config: the tiny world's seven stages). Both must show the
matrix, the plot and a sample.
"""

import json
import os

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.heavy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, 'notebooks', 'quickstart.ipynb')

@pytest.fixture()
def toy_config(tmp_path, copy_cascade):
  return copy_cascade(tmp_path, train=16, eval_=4, sft=32, config_name='toy_config.py')


def _execute(monkeypatch, config: str, workdir) -> str:
  """Runs the notebook with `config` and 2 steps per stage; returns its printed text."""
  monkeypatch.setenv('CASCADE_NOTEBOOK_CONFIG', config)
  monkeypatch.setenv('CASCADE_NOTEBOOK_STEPS', '2')
  monkeypatch.setenv('CASCADE_NOTEBOOK_WORKDIR', str(workdir))
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  monkeypatch.delenv('XLA_FLAGS', raising=False)     # the kernel uses the one CPU device
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(nb, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': os.path.join(REPO, 'notebooks')}})
  client.execute()
  outputs = [o for cell in nb.cells if cell.cell_type == 'code' for o in cell.outputs]
  shown = [o for o in outputs if o.output_type == 'display_data']
  assert any('image/png' in o.data for o in shown)
  text = ''.join(o.get('text', '') for o in outputs if o.output_type == 'stream')
  text += ''.join(o.data.get('text/markdown', '') for o in shown)
  assert 'cascade checkout: ' + REPO in text
  assert 'policy: ' in text and 'sample 1:' in text
  return text


def _rl_steps(workdir, stage) -> int:
  metrics = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  return max(m['step'] for m in metrics if m.get('stage') == stage)


def test_quickstart_notebook_runs(toy_config, tmp_path, monkeypatch):
  workdir = tmp_path / 'run'
  text = _execute(monkeypatch, str(toy_config), workdir)
  assert 'copy_rl  grpo          steps=2' in text
  assert '| copy_rl |' in text                        # the matrix is displayed
  res = json.loads((workdir / 'results.json').read_text())
  assert res['stages'] == ['sft', 'copy_rl'] and res['domains'] == ['copy']
  assert _rl_steps(workdir, 'copy_rl') == 2


@pytest.mark.slow
def test_quickstart_notebook_runs_the_tiny_config(tmp_path, monkeypatch):
  workdir = tmp_path / 'run'
  text = _execute(monkeypatch, f'configs/tiny.py:smoke,root={tmp_path / "world"}', workdir)
  res = json.loads((workdir / 'results.json').read_text())
  assert res['stages'][-1] == 'swe_rl' and '| swe_rl |' in text
  assert _rl_steps(workdir, 'swe_rl') == 2
