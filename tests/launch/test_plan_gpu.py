"""launch.plan --backend=gpu: the H200 description it compiles for, the deviceless XLA:GPU
target it builds (topology, file, refusals), the backend it picks, how a GPU target's programs
are configured and compiled, and (with jax's CUDA plugin) a real XLA:GPU plan of a tiny hybrid."""

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import types

import jax
import numpy as np
import pytest

from cascade import config as config_lib
from cascade import kinds
from cascade import policies
from configs import _recipes
from launch.plan import compiler as plan_compiler
from launch.plan import flops as plan_flops
from launch.plan import programs as plan_programs
from launch.plan import report as plan_report
from launch.plan import results as plan_results
from launch.plan import stages as plan_stages
from launch.plan import targets as plan_targets
from models import config as model_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H200 = 'launch/gpu_targets/h200.txtpb'


# ---------------------------------------------------------------- the H200 description

def parse_text_proto(text: str) -> dict:
  """A protobuf text-format message as nested dicts: `name { ... }` a dict, `name: value` an
  int, a float or a string (quoted). Comments (`#` to the line's end) dropped; a field given
  twice, a bad line or an unclosed brace raise ValueError naming the line."""
  root: dict = {}
  stack = [root]
  for n, raw in enumerate(text.splitlines(), 1):
    line = raw.split('#', 1)[0].strip()
    if not line:
      continue
    if m := re.fullmatch(r'(\w+)\s*\{', line):
      if m.group(1) in stack[-1]:
        raise ValueError(f'line {n}: {m.group(1)} given twice')
      stack[-1][m.group(1)] = child = {}
      stack.append(child)
    elif line == '}':
      if len(stack) == 1:
        raise ValueError(f'line {n}: unmatched }}')
      stack.pop()
    elif m := re.fullmatch(r'(\w+)\s*:\s*(".*"|[-+\w.]+)', line):
      name, value = m.groups()
      if name in stack[-1]:
        raise ValueError(f'line {n}: {name} given twice')
      stack[-1][name] = (value[1:-1] if value.startswith('"') else
                         int(value) if re.fullmatch(r'[-+]?\d+', value) else
                         True if value == 'true' else False if value == 'false' else
                         float(value))
    else:
      raise ValueError(f'line {n}: not a text-format field: {raw!r}')
  if len(stack) != 1:
    raise ValueError('unclosed {')
  return root


def test_the_parser_reads_text_format_and_names_a_bad_line():
  text = '# a comment\na {\n  b: 1  # one\n  c: "x"\n  d {\n    e: 2.5\n  }\n}\nf: true\n'
  assert parse_text_proto(text) == {'a': {'b': 1, 'c': 'x', 'd': {'e': 2.5}}, 'f': True}
  with pytest.raises(ValueError, match='line 2: not a text-format field'):
    parse_text_proto('a: 1\nb = 2\n')
  with pytest.raises(ValueError, match='line 2: a given twice'):
    parse_text_proto('a: 1\na: 2\n')
  with pytest.raises(ValueError, match='unclosed'):
    parse_text_proto('a {\nb: 1\n')


# The fields XLA:GPU reads to compile for a GPU without one (GpuTargetConfigProto's
# gpu_device_info; the launch/gpu_targets/h200.txtpb comments say where each number is from).
DEVICE_FIELDS = ('core_count', 'fpus_per_core', 'threads_per_warp', 'threads_per_block_limit',
                 'threads_per_core_limit', 'thread_dim_limit_x', 'thread_dim_limit_y',
                 'thread_dim_limit_z', 'block_dim_limit_x', 'block_dim_limit_y',
                 'block_dim_limit_z', 'registers_per_core_limit', 'registers_per_block_limit',
                 'shared_memory_per_block', 'shared_memory_per_block_optin',
                 'shared_memory_per_core', 'l2_cache_size', 'clock_rate_ghz',
                 'memory_bandwidth', 'device_memory_size')


def test_the_h200_description_is_a_gpu_target_config_of_the_h200():
  with open(os.path.join(ROOT, H200)) as f:
    cfg = parse_text_proto(f.read())
  assert set(cfg) == {'gpu_device_info', 'platform_name', 'dnn_version_info', 'runtime_version',
                      'device_description_str'}, sorted(cfg)
  info = cfg['gpu_device_info']
  assert set(info) == {*DEVICE_FIELDS, 'cuda_compute_capability'}, sorted(info)
  assert all(isinstance(info[k], (int, float)) and info[k] > 0 for k in DEVICE_FIELDS)
  assert info['cuda_compute_capability'] == {'major': 9, 'minor': 0}          # sm_90
  assert (info['core_count'], info['l2_cache_size']) == (132, 50 * 2 ** 20)
  # The same GPU as the recipe's numbers: its HBM bandwidth, and more memory than the limit the
  # plan checks (141 GB as the driver reports it: 143,771 MiB).
  assert info['memory_bandwidth'] == _recipes.H200_8['hbm_gbps'] * 1e9
  assert info['device_memory_size'] == 143771 * 2 ** 20
  assert info['device_memory_size'] > _recipes.H200_8['device_memory_gib'] * plan_results.GIB
  assert info['shared_memory_per_block'] <= info['shared_memory_per_block_optin'] <= (
      info['shared_memory_per_core'])
  assert info['threads_per_block_limit'] <= info['threads_per_core_limit']
  assert cfg['platform_name'] == 'CUDA' and 'H200' in cfg['device_description_str']
  assert _recipes.H200_8['gpu_target'] == H200


@pytest.mark.parametrize('dist,field', [('nvidia-cudnn-cu12', 'dnn_version_info'),
                                        ('nvidia-cuda-runtime-cu12', 'runtime_version')])
def test_the_h200_description_names_the_cuda_libraries_the_wheels_install(dist, field):
  """cuDNN and the CUDA runtime as `pip install "jax[cuda12]"` installs them (XLA:GPU gates
  rewrites on the cuDNN version); checked where those wheels are installed."""
  try:
    version = importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    pytest.skip(f'{dist} is not installed here (pip install "jax[cuda12]")')
  with open(os.path.join(ROOT, H200)) as f:
    got = parse_text_proto(f.read())[field]
  want = [int(x) for x in version.split('.')[:3]]
  assert [got['major'], got['minor']] == want[:2], (got, version)


def test_the_gpu_environment_pins_the_jax_this_checkout_runs():
  """docs/planning.md's GPU environment and the CUDA library versions h200.txtpb declares are
  of one jax, of the release series installed here (a fresh install may take a newer patch
  release than the one the page names)."""
  pins = {}
  for path in ('docs/planning.md', H200):
    with open(os.path.join(ROOT, path)) as f:
      pins[path] = set(re.findall(r"jax\[cuda12\]==([\w.]+)", f.read()))
  assert len(set().union(*pins.values())) == 1 and all(pins.values()), pins
  series = lambda v: tuple(v.split('.')[:2])
  assert {series(v) for v in set().union(*pins.values())} == {series(jax.__version__)}, pins


# ---------------------------------------------------------------- the target

def _config(**hardware):
  """configs/tiny.py:smoke,model=hybrid on 8 devices, (data, fsdp, expert, tensor) =
  (1, 1, 8, 1), for the hardware given (default: 8 x H200 described by H200)."""
  spec = importlib.util.spec_from_file_location('tiny_cfg', os.path.join(ROOT, 'configs',
                                                                        'tiny.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config('smoke,model=hybrid')
  c.mesh.shape = (1, 1, 8, 1)
  c.hardware = dict(dict(name='tiny on 8 x H200', platform='gpu', gpu_target=H200,
                         device_memory_gib=131.0), **hardware)
  return c


def _fake_topologies(monkeypatch, kind='NVIDIA H200'):
  """jax.experimental.topologies.get_topology_desc recording its calls, returning as many
  stand-in GPUs as the topology string names."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  calls = []

  def get_topology_desc(**kwargs):
    calls.append(kwargs)
    n = int(np.prod([int(x) for x in kwargs['topology'].split('x')]))
    return types.SimpleNamespace(devices=[types.SimpleNamespace(platform='gpu', device_kind=kind,
                                                                id=i) for i in range(n)])
  monkeypatch.setattr(topologies, 'get_topology_desc', get_topology_desc)
  monkeypatch.setattr(plan_targets, 'have_cuda_plugin', lambda: True)
  return calls


def test_the_gpu_target_is_the_described_gpus_on_one_host(monkeypatch):
  calls = _fake_topologies(monkeypatch)
  p = config_lib.validate(_config())
  tgt = plan_targets.target(p, 'gpu')
  with open(os.path.join(ROOT, H200)) as f:
    assert calls == [dict(platform='cuda', target_config=f.read(), topology='1x1x8')]
  assert tgt.kind == 'gpu' and len(tgt.devices) == 8
  assert tgt.count_devices == tuple(jax.devices('cpu'))          # FLOPs counted on CPUs
  assert tgt.device_memory_bytes == 131 * plan_results.GIB
  assert tgt.description.startswith('tiny on 8 x H200: 8 x NVIDIA H200 (one host) as '
                                    f'{H200} describes them, compiled by XLA:GPU deviceless')
  assert 'limit is checked here' in tgt.description
  assert (plan_targets.target(p, 'gpu', device_memory_gib=10).device_memory_bytes
          == 10 * plan_results.GIB)


def test_a_mesh_over_several_hosts_has_8_gpus_each():
  assert plan_targets.gpu_topology(8) == '1x1x8' and plan_targets.gpu_topology(2) == '1x1x2'
  assert plan_targets.gpu_topology(16) == '1x2x8' and plan_targets.gpu_topology(64) == '1x8x8'
  with pytest.raises(ValueError, match=r'needs 12 GPUs: .* a multiple of 8'):
    plan_targets.gpu_topology(12)


def test_the_gpu_target_refuses_without_the_plugin_the_file_or_with_slices(monkeypatch):
  calls = _fake_topologies(monkeypatch)
  p = config_lib.validate(_config())
  replace = lambda **kw: dataclasses.replace(p, hardware=dataclasses.replace(p.hardware, **kw))
  missing = 'launch/gpu_targets/no_such_gpu.txtpb'
  with pytest.raises(ValueError, match=re.escape(
      f"config.hardware.gpu_target='{missing}': cannot read {ROOT}/{missing}")):
    plan_targets.target(replace(gpu_target=missing), 'gpu')
  with pytest.raises(ValueError, match=r'^config\.hardware\.gpu_target: needed for --backend=gpu'):
    plan_targets.target(replace(gpu_target=''), 'gpu')
  with pytest.raises(ValueError, match=r'config\.hardware\.slices=2: TPU slices'):
    plan_targets.target(replace(slices=2), 'gpu')
  monkeypatch.setattr(plan_targets, 'have_cuda_plugin', lambda: False)
  with pytest.raises(ValueError, match=r'^--backend=gpu: no CUDA plugin of jax is installed '
                                       r'here .*pip install "jax\[cuda12\]"'):
    plan_targets.target(p, 'gpu')
  assert calls == []                                   # refused before asking XLA:GPU


def test_the_config_names_a_gpu_description_that_exists():
  c = _config(gpu_target='launch/gpu_targets/no_such_gpu.txtpb')
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      "config.hardware.gpu_target='launch/gpu_targets/no_such_gpu.txtpb': no such file: "
      f'{ROOT}/launch/gpu_targets/no_such_gpu.txtpb')):
    config_lib.validate(c)
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      f"config.hardware.gpu_target='{H200}': describes a GPU, but "
      "config.hardware.platform='tpu'")):
    config_lib.validate(_config(platform='tpu'))
  absolute = config_lib.validate(_config(gpu_target=os.path.join(ROOT, H200))).hardware
  assert absolute.gpu_target_path() == config_lib.validate(_config()).hardware.gpu_target_path()
  assert config_lib.validate(_config(gpu_target='')).hardware.gpu_target_path() is None


def test_have_cuda_plugin_finds_an_importable_plugin(monkeypatch):
  found = {'jax_plugins.xla_cuda13'}

  def find_spec(name):
    if name.startswith('jax_plugins.') and found is None:
      raise ModuleNotFoundError("No module named 'jax_plugins'")
    return object() if found and name in found else None
  monkeypatch.setattr(importlib.util, 'find_spec', find_spec)
  assert plan_targets.have_cuda_plugin()
  found = set()
  assert not plan_targets.have_cuda_plugin()
  found = None                                     # no jax_plugins package at all
  assert not plan_targets.have_cuda_plugin()


@pytest.mark.parametrize('platform,gpu_target,plugin,libtpu,want', [
    ('gpu', H200, True, False, 'gpu'),
    ('gpu', H200, False, True, 'cpu'),
    ('gpu', '', True, False, 'cpu'),
    ('tpu', '', True, True, 'tpu'),
    ('tpu', '', True, False, 'cpu'),
    ('cpu', '', True, True, 'cpu'),
])
def test_the_default_backend(monkeypatch, platform, gpu_target, plugin, libtpu, want):
  monkeypatch.setattr(plan_targets, 'have_cuda_plugin', lambda: plugin)
  monkeypatch.setattr(plan_targets, 'have_libtpu', lambda: libtpu)
  p = config_lib.validate(_config(platform=platform, gpu_target=gpu_target))
  assert plan_targets.default_backend(p) == want


@pytest.mark.parametrize('plugin,gpu_target,backend,why', [
    (False, H200, 'auto', 'no CUDA plugin of jax installed: pip install "jax[cuda12]"'),
    (True, '', 'auto', 'config.hardware.gpu_target not set'),
    (True, H200, 'cpu', '--backend=cpu'),
])
def test_a_gpu_config_on_cpus_says_why(monkeypatch, plugin, gpu_target, backend, why):
  monkeypatch.setattr(plan_targets, 'have_cuda_plugin', lambda: plugin)
  tgt = plan_targets.target(config_lib.validate(_config(gpu_target=gpu_target)), backend)
  assert tgt.kind == 'cpu' and f'standing in for tiny on 8 x H200 ({why}' in tgt.description
  assert 'XLA:CPU memory estimates, above what its own compiler needs' in tgt.description


# ---------------------------------------------------------------- a GPU target's programs

def _mesh_of(platform):
  return types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform=platform)]))


def test_gpu_programs_compile_without_triton_gemms_and_samplers_on_cpus_without_hoisting():
  assert plan_compiler.compiler_options(_mesh_of('gpu')) == plan_compiler.GPU_OPTIONS == {
      'xla_gpu_enable_triton_gemm': False}
  assert plan_compiler.sampling_options(_mesh_of('gpu')) == plan_compiler.GPU_OPTIONS
  assert plan_compiler.compiler_options(_mesh_of('cpu')) is None
  assert plan_compiler.sampling_options(_mesh_of('cpu')) == plan_compiler.CPU_SAMPLING_OPTIONS
  tpu = _mesh_of('tpu')
  assert plan_compiler.compiler_options(tpu) is plan_compiler.sampling_options(tpu) is None


def test_a_gpu_target_runs_the_gpu_kernels_and_scans(monkeypatch):
  _fake_topologies(monkeypatch)
  p = config_lib.validate(_config())
  tgt = plan_targets.target(p, 'gpu')
  model_cfg, _, sampler_cfg = plan_targets.for_target(p, tgt)
  assert p.model.attention == 'auto' and model_cfg.attention == 'gpu_flash'
  assert model_cfg.scan_layers is True and sampler_cfg['decode_layers'] == 'scan'
  assert plan_targets.target_model(p, tgt, model_config.ModelConfig.tiny()).attention == 'gpu_flash'
  cpu = plan_targets.Target((), 'cpu', 'x', 0)
  assert plan_targets.target_model(p, cpu, model_config.ModelConfig.tiny()).attention == 'auto'


def test_a_gpu_plan_says_how_it_compiles(monkeypatch):
  _fake_topologies(monkeypatch)
  p = config_lib.validate(_config())
  header = plan_report.plan_header(p, plan_targets.target(p, 'gpu'))
  assert plan_compiler.GPU_NOTE in header and 'Triton GEMM fusions off' in plan_compiler.GPU_NOTE
  [experts] = [l for l in header if l.startswith('routed experts:')]
  assert "models/moe.py's 'tiled' grouped matmul" in experts
  cpu_header = plan_report.plan_header(p, plan_targets.Target((), 'cpu', 'x', 0))
  assert plan_compiler.GPU_NOTE not in cpu_header


# ---------------------------------------------------------------- XLA:GPU itself

@pytest.mark.slow      # XLA:GPU compiles two programs: 15-20 s on a 2-core host
def test_xla_gpu_plans_a_tiny_hybrid_deviceless(monkeypatch):
  """With jax's CUDA plugin: the SFT stage and the evaluation of configs/tiny.py:smoke,
  model=hybrid compiled by XLA:GPU for 8 x H200 (no GPU here): every program compiles with
  `GPU_OPTIONS` and fits; the train step's arguments are its sharded state and batch, the state
  donated; its attention is the Triton flash kernel; FLOPs are counted from the config."""
  pytest.importorskip('jax_plugins.xla_cuda12', reason='jax\'s CUDA plugin: pip install '
                      '"jax[cuda12]" (docs/planning.md)')
  c = _config()
  c.eval.suites = []      # the suites' sampler calls are planned alike (test_plan_suites.py)
  p = config_lib.validate(c)
  assert plan_targets.default_backend(p) == 'gpu'
  tgt = plan_targets.target(p, 'auto')
  assert tgt.kind == 'gpu' and {(d.platform, d.device_kind) for d in tgt.devices} == {
      ('gpu', 'NVIDIA H200')}
  compiled = []
  original = plan_compiler.compile_program

  def compile_program(name, shapes, lower, *args, compiler_options=None, **kwargs):
    def lower_and_keep():
      lowered = lower()
      compiled.append((name, compiler_options, lowered.as_text()))
      return lowered
    return original(name, shapes, lower_and_keep, *args, compiler_options=compiler_options,
                    **kwargs)
  monkeypatch.setattr(plan_compiler, 'compile_program', compile_program)
  sft, evaluation = plan_stages.run_plan(p, tgt, stages=['sft'])
  [train], [sampler] = sft.programs, evaluation.programs
  assert (train.name, sampler.name) == ('train step', 'eval sampler')
  assert sft.fits and evaluation.fits, (train, sampler)
  assert [(n, o) for n, o, _ in compiled] == [('train step', plan_compiler.GPU_OPTIONS),
                                              ('eval sampler', plan_compiler.GPU_OPTIONS)]
  assert '__gpu$xla.gpu.triton' in compiled[0][2]         # gpu_flash: a Pallas Triton kernel

  # Reference: the train state and batch, sharded over the same mesh, counted here.
  model_cfg, rules, _ = plan_targets.for_target(p, tgt)
  stage = p.stage('sft')
  mesh = plan_targets.make_mesh(p, tgt.devices)
  _, params = plan_programs.abstract_params(model_cfg, 'policy', mesh, rules)
  optimizer = kinds.base.make_optimizer(stage).tx
  state = policies.abstract_state(params, optimizer, mesh, rules,
                                  policies.master_dtype(model_cfg))
  batch, _ = kinds.get(stage.kind).abstract_batch(stage, mesh, rules)
  per_device = lambda tree: sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                                for x in jax.tree.leaves(tree))
  assert train.argument_bytes == pytest.approx(per_device(state) + per_device(batch), rel=0.01)
  assert train.alias_bytes == pytest.approx(per_device(state), rel=0.01)
  assert train.temp_bytes > 0 and sampler.temp_bytes > 0
  assert train.flops_from == sampler.flops_from == plan_flops.COUNTED
  assert train.flops == pytest.approx(plan_flops.train_flops(stage, model_cfg, mesh, rules))
