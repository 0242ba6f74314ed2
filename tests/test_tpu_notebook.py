"""notebooks/tpu_runtime.ipynb: its mesh choice, and the whole notebook on CPU with a gs:// workdir.

No TPU here: the notebook runs in a kernel with 4 simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4) and a workdir on the
local Cloud Storage emulator (the `gcs` fixture, tests/conftest.py), on the
toy 'copy' cascade (SFT -> GRPO) the quickstart test uses, 2 steps per stage.
The fast tests run the notebook's `choose-mesh` cell in this process (8
simulated devices) for 1, 4 and 8 devices and check that the framework's own
batch-split check agrees with it.
"""

import ast
import os
import re

import jax
import nbformat
import pytest
from nbclient import NotebookClient

from cascade import config as config_lib
from cascade import runner
from foundation import paths

pytestmark = pytest.mark.heavy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, 'notebooks', 'tpu_runtime.ipynb')


def _load_config(path):
  import importlib.util
  spec = importlib.util.spec_from_file_location('tpu_nb_test_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _choose_mesh():
  """The notebook's `choose_mesh`, from its cell tagged choose-mesh."""
  nb = nbformat.read(NOTEBOOK, as_version=4)
  cells = [c for c in nb.cells if 'choose-mesh' in c.metadata.get('tags', [])]
  assert len(cells) == 1
  scope = {}
  exec(compile(cells[0].source, 'choose-mesh', 'exec'), scope)  # pylint: disable=exec-used
  return scope['choose_mesh']


@pytest.fixture(scope='module')
def toy_config(tmp_path_factory, copy_cascade):
  root = tmp_path_factory.mktemp('toy')
  return copy_cascade(root, train=16, eval_=4, sft=32, config_name='toy_config.py')


def test_notebook_is_valid_and_saved_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == 'code']
  assert code and all(not c.outputs and c.execution_count is None for c in code)
  assert nb.metadata.kernelspec.name == 'python3'
  # The matrix and plot are read through foundation.paths (gs:// too), never open().
  assert not any(re.search(r'\bopen\(', c.source) for c in code)
  assert any('cascade.run(config, WORKDIR)' in c.source for c in code)


def test_mesh_uses_every_device_for_the_toy_batches(toy_config):
  choose_mesh = _choose_mesh()
  plan = config_lib.validate(_load_config(toy_config))     # GRPO: 2 prompts x 4 = 8 rows
  assert jax.device_count() == 8                           # tests/conftest.py
  assert choose_mesh(plan, jax.devices()[:1]) == (None, ['one device: no mesh'])
  for n in (2, 4, 8):
    shape, notes = choose_mesh(plan, jax.devices()[:n])
    assert shape == (1, n, 1), (n, shape)
    assert notes == [f'every stage batch splits over {n} batch shards']


def test_mesh_puts_what_the_batch_cannot_split_on_tensor_and_agrees_with_the_run(toy_config,
                                                                                 tmp_path):
  choose_mesh = _choose_mesh()
  config = _load_config(toy_config)
  config.stages[1]['prompts_per_step'] = 3                   # 3 x 4 rows: split 4 ways, not 8
  plan = config_lib.validate(config)
  shape, notes = choose_mesh(plan, jax.devices())
  assert shape == (1, 4, 2)
  assert notes[1].startswith('tensor axis of 2: a wider batch split fails (copy_rl: '
                             'prompts_per_step * group_size = 12 rows over 1 microbatches x 8 '
                             'shards)')
  assert 'make every stage batch a multiple of 8 x its microbatches' in notes[1]
  assert choose_mesh(plan, jax.devices()[:4])[0] == (1, 4, 1)
  assert choose_mesh(plan, jax.devices()[:2])[0] == (1, 2, 1)
  # The run's own check (cascade.runner.make_context, before it builds anything) refuses the wider
  # split the notebook rejected, with the error the notebook avoids.
  config.mesh.shape = (1, 8, 1)
  with pytest.raises(config_lib.ConfigError, match='do not split over 1 microbatches x 8 batch'):
    runner.make_context(config_lib.validate(config), str(tmp_path / 'w'))
  # Microbatches count too: 4 microbatches of the GRPO stage's 8 rows leave 2 batch shards.
  config = _load_config(toy_config)
  config.stages[1]['microbatches'] = 4
  shape, _ = choose_mesh(config_lib.validate(config), jax.devices())
  assert shape == (1, 2, 4)


def test_tpu_notebook_runs_on_cpu_devices_with_a_gcs_workdir(toy_config, gcs, monkeypatch):
  workdir = gcs.root + '/tpu_notebook'
  monkeypatch.setenv('CASCADE_NOTEBOOK_CONFIG', str(toy_config))
  monkeypatch.setenv('CASCADE_NOTEBOOK_STEPS', '2')
  monkeypatch.setenv('CASCADE_NOTEBOOK_WORKDIR', workdir)
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=4')
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(nb, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': os.path.join(REPO, 'notebooks')}})
  client.execute()

  def text_of(cell):
    return ''.join(o.get('text', '') for o in cell.outputs if o.output_type == 'stream')

  code = [c for c in nb.cells if c.cell_type == 'code']
  text = ''.join(text_of(c) for c in code)
  assert 'cascade checkout: ' + REPO in text
  assert 'nothing to install' in text                      # the venv has cascade installed
  assert 'backend: cpu' in text and 'devices: 4 |' in text and 'no TPU here' in text
  shape = ast.literal_eval(re.search(r'mesh shape \(data, fsdp, tensor\): (\(.*?\)) on 4 device',
                                     text).group(1))
  assert shape == (1, 4, 1)                                # every device splits the batch
  assert f'workdir: {workdir} (Cloud Storage)' in text
  assert f'new run in {workdir}: 2 stages to run' in text
  assert 'copy_rl  grpo          steps=2' in text

  shown = [o for c in code for o in c.outputs if o.output_type == 'display_data']
  assert any('| copy_rl |' in o.data.get('text/markdown', '') for o in shown)   # the matrix
  assert any('image/png' in o.data for o in shown)                             # the plot

  # The last cell runs the cascade again: it says both stages are done and trains nothing.
  again = text_of(code[-1])
  assert (f'resuming in {workdir}: 2 of 2 stages already done (sft, copy_rl); to run: nothing'
          in again)
  assert 'copy_rl  grpo' not in again and '| copy_rl |' in again   # no summary line, the matrix

  # Everything is on the emulator's bucket: results, progress, checkpoints, exports.
  res = paths.read_json(paths.join(workdir, 'results.json'))
  assert res['stages'] == ['sft', 'copy_rl'] and res['domains'] == ['copy']
  assert set(paths.read_json(paths.join(workdir, 'progress.json'))['done']) == {'sft', 'copy_rl'}
  assert paths.listdir(paths.join(workdir, 'stages', '01_copy_rl', 'ckpt'))
  assert paths.exists(paths.join(workdir, 'stages', '01_copy_rl', 'hf', 'model.safetensors'))
  assert not os.path.exists(os.path.join(REPO, 'gs:'))         # nothing went to ./gs:/...
