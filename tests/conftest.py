"""Test setup: 8 simulated CPU devices for the sharding tests, float32 matmuls; shared fixtures
(the toy copy cascade, the tiny world's root, the bubblewrap sandbox, a local Cloud Storage
emulator)."""

import os


def with_device_count(flags: str, count: int = 8) -> str:
  """`flags` (the user's XLA_FLAGS) plus a simulated CPU device count, unless it sets one."""
  if '--xla_force_host_platform_device_count' in flags:
    return flags
  return f'{flags} --xla_force_host_platform_device_count={count}'.strip()


os.environ['XLA_FLAGS'] = with_device_count(os.environ.get('XLA_FLAGS', ''))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update('jax_default_matmul_precision', 'highest')


_COPY_CONFIG = '''
"""A toy cascade written by a test: SFT then GRPO on copying a digit."""
import ml_collections

def get_config(arg=None):
  root = {root!r}
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny', overrides=dict(vocab_size=320, embed_dim=32, num_layers=1,
                 num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64, max_seq_len=128))
  c.tokenizer = dict(path=root + '/tok.model')
  c.mesh = dict(shape={mesh_shape!r})
  c.sampler = dict(prompt_buckets=(64,), new_token_buckets=(8,))
  c.ckpt = dict(every_n_steps=1, keep={keep})
  c.eval = dict(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=6,
                max_prompt_len=64, num_prompts=8, batch_size=8, thinking=False)
  c.datasets = dict(sft=dict(path=root + '/sft.jsonl', format='sft'),
                    copy_train=dict(path=root + '/copy_train.jsonl', format='prompt', domain='copy'),
                    copy_eval=dict(path=root + '/copy_eval.jsonl', format='prompt', domain='copy'))
  c.domains = dict(copy=dict(verifier='math', verifier_options=dict(workers=1),
                             train='copy_train', eval='copy_eval'))
  c.stages = [
      dict(name='sft', kind='sft', domains=['copy'], datasets=['sft'], steps={sft_steps},
           batch_size=8, max_len=64, optimizer=dict(lr=1e-2)),
      dict(name='copy_rl', kind='grpo', domains=['copy'], steps={rl_steps},
           optimizer=dict(lr=1e-3), prompts_per_step={prompts_per_step}, group_size=4,
           max_prompt_len=64, max_response_len=6, thinking_fraction=0.0, dynamic_filter=False)]
  c.allow_config_change = False
  return c
'''


def write_copy_cascade(root, *, train: int, eval_: int, sft: int, mesh_shape=None,
                       keep: int = 1, sft_steps: int = 20, rl_steps: int = 20,
                       prompts_per_step: int = 2, config_name: str = 'cfg.py'):
  """Writes a toy 'copy a digit' world (data, tokenizer) and its SFT -> GRPO config.

  Args:
    root: a pathlib.Path directory.
    train, eval_, sft: numbers of RL train prompts, held-out prompts and SFT records.
    mesh_shape, keep, sft_steps, rl_steps, prompts_per_step: config fields.
    config_name: file name of the config written under `root`.

  Returns:
    The config file's path.
  """
  import json
  import random

  from foundation import chat
  from foundation import tokenizer as tokenizer_lib

  rng = random.Random(0)
  msgs = lambda a: [{'role': 'user', 'content': f'Copy {a}.'}]
  for split, n in (('train', train), ('eval', eval_)):
    with open(root / f'copy_{split}.jsonl', 'w') as f:
      for i in range(n):
        a = rng.randint(0, 9)
        f.write(json.dumps({'id': f'{split}-{i}', 'messages': msgs(a),
                            'metadata': {'answer': str(a)}}) + '\n')
  texts = []
  with open(root / 'sft.jsonl', 'w') as f:
    for _ in range(sft):
      a = rng.randint(0, 9)
      rec = {'domain': 'copy', 'messages': msgs(a), 'response': f'\\boxed{{{a}}}'}
      f.write(json.dumps(rec) + '\n')
      for mode in (False, None):
        texts.append(chat.render(rec['messages'], thinking=mode)
                     + chat.render_response(rec['response'], None))
  tokenizer_lib.train_sentencepiece(texts, str(root / 'tok'), vocab_size=300)
  path = root / config_name
  path.write_text(_COPY_CONFIG.format(
      root=str(root), mesh_shape=mesh_shape, keep=keep, sft_steps=sft_steps,
      rl_steps=rl_steps, prompts_per_step=prompts_per_step))
  return path


@pytest.fixture(scope='session')
def tiny_world_root(tmp_path_factory):
  """A `root=` for configs/tiny*.py: their `prepare` step builds the tiny world there (once per
  session, then reused), never in the checkout's runs/tiny_world, the configs' default."""
  return str(tmp_path_factory.mktemp('tiny_world'))


@pytest.fixture(scope='session')
def copy_cascade():
  """The `write_copy_cascade` helper, for tests in any folder."""
  return write_copy_cascade


@pytest.fixture(scope='session')
def faults():
  """tests/faults.py, the fault-injection hooks a test installs in the training loop
  (`cascade.kinds.loop.STEP_END_HOOKS`), for tests in any folder."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(
      'faults', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'faults.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture
def fake_openai():
  """A maker of loopback OpenAI-compatible servers (tests/fake_openai.py): `fake_openai(behave,
  hold_s=0)` starts one; every server it made is closed after the test."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(
      'fake_openai', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fake_openai.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  made = []

  def make(behave=None, hold_s: float = 0.0):
    made.append(module.FakeServer(behave, hold_s))
    return made[-1]

  make.Response, make.completion = module.Response, module.completion
  yield make
  for server in made:
    server.close()


@pytest.fixture(scope='session')
def bwrap_sandbox():
  """Requires a working bubblewrap sandbox: skips where bwrap is not installed, fails where it is
  installed but unusable (saying why), so a broken sandbox never passes as a skip."""
  import shutil

  from verifiers import sandbox

  if not shutil.which('bwrap'):
    pytest.skip('bubblewrap is not installed (`make sysdeps` as root, or apt-get install '
                'bubblewrap)')
  why = sandbox.probe_bwrap('bwrap')
  if why:
    pytest.fail(f'bubblewrap is installed but the sandbox cannot use it: {why}')


# A local Cloud Storage emulator (gcp-storage-emulator) for the gs:// tests: tests/cascade/test_gcs.py
# and tests/test_tpu_notebook.py.
#
# The emulator runs with one fix (GCS_EMULATOR below): its object downloads lack the
# `x-goog-generation` header real Cloud Storage sends, from which tensorstore takes the generation
# of its conditional OCDBT manifest writes ("Malformed StorageGeneration" without it). It does not
# enforce `ifGenerationMatch`, so those conditions are sent but not checked (one writer per object
# anyway).
GCS_BUCKET = 'bucket'

GCS_EMULATOR = """
import sys
from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

plain = objects.download

def download(request, response, storage, *args, **kwargs):
  try:
    obj = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
    response['x-goog-generation'] = str(obj['generation'])
    response['x-goog-metageneration'] = str(obj['metageneration'])
  except NotFound:
    pass
  return plain(request, response, storage, *args, **kwargs)

objects.download = download            # objects.get calls it for ?alt=media
for _, methods in server.HANDLERS:     # the routes hold the function itself
  for verb, fn in list(methods.items()):
    if fn is plain:
      methods[verb] = download
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def emulator_env(url: str) -> dict[str, str]:
  """The variables that point gcsfs and tensorstore at an emulator at `url`."""
  return {'STORAGE_EMULATOR_HOST': url,            # gcsfs (and google-cloud-storage)
          'FSSPEC_GCS_TOKEN': 'anon',              # no credential lookup (no metadata server)
          'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',   # no gRPC bucket-type probe
          'TENSORSTORE_GCS_HTTP_URL': url,         # Orbax's tensorstore
          'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator',    # tensorstore's fixed test token
          'TENSORSTORE_GCS_REQUEST_CONCURRENCY': '4'}     # the emulator serves one at a time


@pytest.fixture(scope='module')
def gcs(tmp_path_factory):
  """An emulator with bucket 'bucket', and this process's clients pointed at it (os.environ, so
  subprocesses and notebook kernels started meanwhile inherit it). Skips without gcsfs or the
  emulator (the `test` extra)."""
  import socket
  import subprocess
  import sys
  import time
  import types

  pytest.importorskip('gcsfs', reason="gs:// needs gcsfs: pip install -e '.[gcs]'")
  pytest.importorskip('gcp_storage_emulator', reason="the emulator: pip install -e '.[test]'")
  port = free_port()
  log = open(tmp_path_factory.mktemp('emulator') / 'log.txt', 'w')
  proc = subprocess.Popen(
      [sys.executable, '-c', GCS_EMULATOR, 'start', '--host', '127.0.0.1',
       '--port', str(port), '--default-bucket', GCS_BUCKET, '--in-memory', '-q'],
      stdout=log, stderr=subprocess.STDOUT)
  deadline = time.time() + 30
  while True:
    try:
      socket.create_connection(('127.0.0.1', port), 0.2).close()
      break
    except OSError:
      if time.time() > deadline or proc.poll() is not None:
        proc.kill()
        pytest.fail(f'the storage emulator did not start (see {log.name})')
      time.sleep(0.1)
  env = emulator_env(f'http://127.0.0.1:{port}')
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    yield types.SimpleNamespace(env=env, root=f'gs://{GCS_BUCKET}')
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    proc.kill()
    proc.wait()
    log.close()


_DERIVED_CONFIG = '''
import importlib.util, os
{imports}_spec = importlib.util.spec_from_file_location('cfg', os.path.join(os.path.dirname(__file__),
                                                                   'cfg.py'))
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)


def get_config(arg=None):
  c = _mod.get_config(arg)
{edits}  return c
'''


@pytest.fixture(scope='session')
def derived_config():
  """Source of a config file that loads the `cfg.py` beside it (what `copy_cascade` writes) and
  edits its config: make(edits, imports='') with `edits` the indented lines run on `c`."""
  return lambda edits, imports='': _DERIVED_CONFIG.format(imports=imports, edits=edits)


@pytest.fixture(scope='session')
def pallas_interpret_flags():
  """fn, *args -> the `interpret` parameter of every pallas_call in fn's jaxpr (sub-jaxprs
  included): whether a kernel traces as a real kernel for the platform or as an interpreted
  loop."""
  import jax  # pylint: disable=g-import-not-at-top

  def flags_of(fn, *args):
    flags = []

    def walk(jaxpr):
      for eqn in jaxpr.eqns:
        if eqn.primitive.name == 'pallas_call':
          flags.append(bool(eqn.params['interpret']))
        for v in eqn.params.values():
          for sub in (v if isinstance(v, (tuple, list)) else (v,)):
            sub = getattr(sub, 'jaxpr', sub)           # a ClosedJaxpr's jaxpr
            if hasattr(sub, 'eqns'):
              walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return flags
  return flags_of


# Command-line modules that only their own `python -m` imports: each defines its flags in absl's
# process-global FLAGS at import, and several share names (`--rows`, `--repeats`, `--embed`).
# A test file may import one to call its functions; a later file on the same xdist worker that
# imports another would then fail with DuplicateFlagError, depending on how files were dealt to
# workers. After each test file, the flags such a module defined are removed and the module is
# unloaded, so the next file imports it afresh with its own flags.
_CLI_ONLY = ('benchmarks.', 'cascade.device_check')


def _cli_only(name: str) -> bool:
  return any(name == p or name.startswith(p) for p in _CLI_ONLY)


@pytest.fixture(scope='module', autouse=True)
def _unload_command_line_modules():
  import sys  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  modules, names = set(sys.modules), set(flags.FLAGS)
  yield
  for name in set(flags.FLAGS) - names:
    if _cli_only(flags.FLAGS.find_module_defining_flag(name) or ''):
      delattr(flags.FLAGS, name)
  for name in set(sys.modules) - modules:
    if _cli_only(name):
      del sys.modules[name]
      parent, _, child = name.rpartition('.')
      if parent in sys.modules and getattr(sys.modules[parent], child, None) is not None:
        delattr(sys.modules[parent], child)


def pytest_collection_finish(session):
  """A command-line module imported at a test file's top level defines its flags while every
  worker collects, before the fixture above can unload it: refuse that at collection."""
  del session
  from absl import flags  # pylint: disable=g-import-not-at-top
  early = sorted(m for m in flags.FLAGS.flags_by_module_dict() if _cli_only(m))
  if early:
    raise pytest.UsageError(
        f'{", ".join(early)} defined absl flags while the tests were collected: import it '
        'inside the tests that use it (tests/conftest.py unloads it after each file)')
