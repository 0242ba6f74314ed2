"""launch.plan on 8 simulated devices: sane per-device numbers, a clear failure naming the stage;
and the paper-recipe configs validate with their published numbers."""

import dataclasses
import importlib.util
import math
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cascade import config as config_lib
from cascade import kinds
from cascade import policies
from launch.plan import cli as plan_cli
from launch.plan import compiler as plan_compiler
from launch.plan import flops as plan_flops
from launch.plan import memory as plan_memory
from launch.plan import programs as plan_programs
from launch.plan import report as plan_report
from launch.plan import results as plan_results
from launch.plan import stages as plan_stages
from launch.plan import step_time as plan_step_time
from launch.plan import targets as plan_targets
from models import config as model_config
from models import sharding
from rl import sampler as sampler_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY_CONFIG = '''
"""A tiny cascade for launch.plan's test: SFT, a reward model, GRPO with two phases."""
import ml_collections


def get_config(arg=None):
  del arg
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny', overrides=dict(max_seq_len=256))
  c.tokenizer = dict(path='/nonexistent/tok.model')
  c.mesh = dict(shape=(2, 2, 2))
  c.hardware = dict(name='8 test devices', platform='cpu', device_memory_gib=1.0)
  c.sampler = dict()
  c.ckpt = dict(every_n_steps=0, keep=1)
  c.eval = dict(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=16,
                max_prompt_len=32, num_prompts=8, batch_size=8)
  c.datasets = dict(sft=dict(path='/d/sft.jsonl', format='sft'),
                    prefs=dict(path='/d/prefs.jsonl', format='preference', domain='add'),
                    add=dict(path='/d/add.jsonl', format='prompt', domain='add'))
  c.domains = dict(add=dict(verifier='math', train='add', eval='add'))
  c.stages = [
      dict(name='sft', kind='sft', domains=['add'], datasets=['sft'], steps=2, batch_size=8,
           max_len=64, optimizer=dict(lr=1e-3), microbatches=2),
      dict(name='rm', kind='reward_model', domains=['add'], datasets=['prefs'], steps=2,
           batch_size=8, max_len=64, optimizer=dict(lr=1e-4)),
      dict(name='add_rl', kind='grpo', domains=['add'], steps=4, optimizer=dict(lr=1e-4),
           prompts_per_step=4, group_size=4, max_prompt_len=32, max_response_len=32,
           microbatches=2, phases=[dict(until_step=2, max_response_len=16),
                                   dict(until_step=4, max_response_len=32)]),
  ]
  c.allow_config_change = False
  return c
'''


@pytest.fixture(scope='module')
def tiny_path(tmp_path_factory):
  path = tmp_path_factory.mktemp('plan') / 'tiny_plan_config.py'
  path.write_text(TINY_CONFIG)
  return str(path)


def _load(path):
  spec = importlib.util.spec_from_file_location('tiny_plan_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _per_device_bytes(tree) -> int:
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


@pytest.mark.heavy
def test_plan_numbers_are_sane(tiny_path):
  config = _load(tiny_path)
  tgt = plan_targets.target(config_lib.validate(config), 'cpu')
  assert tgt.kind == 'cpu' and len(tgt.devices) == 8 and 'simulated' in tgt.description
  [rep] = plan_stages.run_plan(config_lib.validate(config), tgt, stages=['add_rl'], with_eval=False)
  train, samp = rep.programs
  assert (train.name, samp.name) == ('train step', 'sampler')
  assert rep.fits and not train.error and not samp.error

  # Expected per-device arguments: the sharded TrainState plus the sharded batch.
  stage = config_lib.validate(config).stage('add_rl')
  mesh = sharding.make_mesh((2, 2, 2), devices=tgt.devices)
  rules = sharding.DEFAULT_RULES
  model_cfg = model_config.ModelConfig.preset('tiny', max_seq_len=256)
  _, params = plan_programs.abstract_params(model_cfg, 'policy', mesh, rules)
  optimizer = kinds.base.make_optimizer(stage).tx
  state = policies.abstract_state(params, optimizer, mesh, rules)
  batch, what = kinds.get(stage.kind).abstract_batch(stage, mesh, rules)
  assert '16 rows x 64 tokens' in what            # 4 x 4 rows, 32 + the longest phase's 32
  state_bytes = _per_device_bytes(state)
  whole_state = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert state_bytes < whole_state / 2            # really sharded, not replicated
  assert train.argument_bytes == pytest.approx(state_bytes + _per_device_bytes(batch), rel=0.01)
  assert train.alias_bytes == pytest.approx(state_bytes, rel=0.01)   # the state is donated
  assert train.total_bytes >= train.argument_bytes and train.temp_bytes > 0
  # FLOPs of the whole step: ~6 x parameters x tokens, plus attention and softmaxes.
  dense = 6 * model_cfg.num_params() * 16 * 64
  assert dense < train.flops < 2 * dense
  # The sampler's arguments: the params (sharded) and the [4, 32] prompt arrays (each of the 4
  # prompts prefilled once for its G = 4 rows), split over the 4 batch shards.
  assert samp.argument_bytes == pytest.approx(
      _per_device_bytes(state.params) + 2 * 4 * 32 * 4 / 4 + 8 + 4 * 4, rel=0.002)
  assert 'KV cache of 64 slots' in samp.shapes and '4 prompts prefilled once each' in samp.shapes

  # --notrain: an SFT stage has nothing left to compile.
  assert plan_stages.run_plan(config_lib.validate(config), tgt, stages=['sft'], with_train=False, with_eval=False) == []

  # An impossible limit fails, naming the stage and the program.
  small = plan_results.StageReport(rep.index, rep.name, rep.kind, rep.programs, 1024,
                                   rep.num_devices)
  [msg, msg2] = plan_report.failures([small])
  assert msg.startswith("stage 'add_rl' (index 2): train step does not fit: needs")
  assert 'sampler does not fit' in msg2
  assert 'DOES NOT FIT' in plan_report.format_stage(small)


@pytest.mark.heavy
def test_cli_exits_nonzero_naming_the_stage(tiny_path, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)                      # the CLI sets its own device count
  report = tmp_path / 'plans' / 'tiny.md'         # its folder made by --report
  proc = subprocess.run(
      [sys.executable, '-m', 'launch.plan', f'--config={tiny_path}', '--stages=rm',
       '--nosampler', '--noeval', '--device_memory_gib=0.000001', f'--report={report}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert '8 simulated CPU devices' in proc.stdout
  assert '[1] rm (reward_model)' in proc.stdout and 'DOES NOT FIT' in proc.stdout
  assert "stage 'rm' (index 1): train step does not fit" in proc.stderr
  # The page says the same: the command, the stage's row, the failure.
  page = report.read_text()
  assert page.startswith(f'# Plan: `python -m launch.plan --config={tiny_path} --stages=rm')
  assert '| rm | train step |' in page and 'DOES NOT FIT' in page
  assert "PLAN FAILED: stage 'rm' (index 1)" in page


def test_a_config_without_a_mesh_is_planned_on_one_device():
  # configs/tiny.py runs on one device with no mesh (mesh.shape=None): the plan compiles its
  # programs on the one-device mesh (the same programs) instead of refusing the config.
  config = importlib.import_module('configs.tiny').get_config('smoke')
  p = config_lib.validate(config)
  assert p.mesh_shape is None
  assert plan_targets.mesh_shape(p) == (1, 1, 1) and plan_targets.num_devices(p) == 1
  assert '(1, 1, 1) (no mesh: one device)' in '\n'.join(plan_report.plan_header(p, None,
                                                                          time_only=True))


PAPER = ['nemotron_cascade_14b', 'nemotron_cascade_8b', 'nemotron_cascade2']


@pytest.mark.parametrize('name', PAPER)
def test_paper_configs_validate(name):
  module = importlib.import_module(f'configs.{name}')
  config = module.get_config()
  p = config_lib.validate(config)
  assert plan_targets.num_devices(p) == 64 and config.hardware.topology == 'v5p:4x4x4'
  for st in p.stages:
    if st.SAMPLES:
      assert getattr(st, 'kl_coef', 0.0) == 0.0 or (name == 'nemotron_cascade2' and 'rlhf' in st.name)
      assert st.loss_agg == 'token' and st.optimizer.lr <= 4e-6
      # One row per batch shard per microbatch: rows / microbatches = the batch shards (8 over
      # data x fsdp on the dense recipes' mesh, 8 over data x fsdp x expert on Cascade 2's,
      # each row split over its 8 sequence shards).
      shards = math.prod(p.mesh_shape[:-1] if len(p.mesh_shape) < 5 else p.mesh_shape[:3])
      assert st.prompts_per_step * st.group_size // st.microbatches == shards
  assert module.__doc__ and 'arXiv' in module.__doc__ and 'Not reproducible' in module.__doc__


def test_cascade1_published_numbers():
  c14 = importlib.import_module('configs.nemotron_cascade_14b').get_config()
  # The sampler compiles the exact phase lengths, not the next power of two.
  assert {28_672, 40_960, 57_344, 61_440} <= set(c14.sampler.new_token_buckets)
  p14 = config_lib.validate(c14)
  assert [s.name for s in p14.stages] == ['sft_16k', 'sft_32k', 'rm', 'rlhf', 'if_rl',
                                          'if_rl_ifbench', 'math_rl', 'code_rl', 'swe_rl']
  rlhf, if_rl, math, code, swe = (p14.stage(n) for n in ('rlhf', 'if_rl', 'math_rl', 'code_rl',
                                                          'swe_rl'))
  assert (rlhf.prompts_per_step, rlhf.group_size, rlhf.temperature, rlhf.top_p,
          rlhf.optimizer.lr, rlhf.steps) == (128, 8, 0.6, 0.95, 2e-6, 900)
  # IF-RL's two sub-stages: IFEval taxonomy, then IFBench (its own domain and verifier).
  if_bench = p14.stage('if_rl_ifbench')
  assert if_rl.thinking_fraction == if_bench.thinking_fraction == 0.0
  assert (if_rl.domains, if_rl.steps, if_bench.domains, if_bench.steps) == (
      ('instruction_following',), 800, ('ifbench',), 120)
  assert c14.domains.ifbench.verifier == 'ifbench'
  assert [(ph.until_step, ph.max_response_len, ph.temperature, ph.filter_overlong)
          for ph in math.phases] == [(120, 28_672, 1.2, True), (220, 40_960, 1.1, False)]
  assert (code.max_response_len, code.optimizer.lr, code.steps) == (57_344, 4e-6, 64)
  assert (swe.group_size, swe.optimizer.lr, swe.steps) == (16, 2.5e-6, 120)
  p8 = config_lib.validate(importlib.import_module('configs.nemotron_cascade_8b').get_config())
  assert (p8.stage('if_rl').steps, p8.stage('if_rl_ifbench').steps) == (550, 300)
  assert [(ph.until_step, ph.max_response_len, ph.temperature, ph.filter_overlong)
          for ph in p8.stage('math_rl').phases] == [(190, 24_576, 1.0, True),
                                                    (430, 32_768, 1.0, False),
                                                    (500, 40_960, 0.8, False)]
  c2 = config_lib.validate(importlib.import_module('configs.nemotron_cascade2').get_config())
  assert [s.name for s in c2.stages if s.kind != 'reward_model'] == [
      'sft', 'if_rl', 'multi_domain_rl', 'rlhf_teacher', 'mopd', 'rlhf', 'long_context_rl',
      'code_rl', 'swe_rl']
  mopd = c2.stage('mopd')
  assert (mopd.group_size, mopd.steps, mopd.optimizer.lr, mopd.teachers['math']) == (
      4, 52, 2e-6, 'sft')


@pytest.mark.heavy
def test_frozen_passes_and_the_co_resident_peak(tiny_path):
  """A KL stage compiles its reference pass, and every program's fit counts what stays
  resident beside it (the optimizer state beside the sampler, the frozen reference)."""
  config = _load(tiny_path)
  config.stages = [*config.stages[:2], dict(config.stages[2], kl_coef=0.01)]
  config.hardware.peak_tflops = 1.0
  config.hardware.hbm_gbps = 10.0
  tgt = plan_targets.target(config_lib.validate(config), 'cpu')
  [rep] = plan_stages.run_plan(config_lib.validate(config), tgt, stages=['add_rl'], with_eval=False)
  train, samp, ref = rep.programs
  # The 16 rows of a step go through the reference in the train step's 2 microbatches.
  assert ref.name == 'reference forward'
  assert '8 rows x 64 tokens per call, 2 calls' in ref.shapes, ref.shapes
  resident = dict(rep.resident)
  params = _per_device_bytes(plan_programs.abstract_params(
      config_lib.validate(config).model, 'policy', sharding.make_mesh((2, 2, 2),
                                                                       devices=tgt.devices),
      sharding.DEFAULT_RULES)[1])
  assert resident['train step'] == params               # the frozen reference
  assert resident['sampler'] == pytest.approx(3 * params, rel=0.01)   # 2 Adam moments + ref
  assert rep.peak(samp) == samp.total_bytes + resident['sampler']
  assert rep.seconds > 0 and 'chip-hours' in plan_report.format_stage(rep)
  small = plan_results.StageReport(rep.index, rep.name, rep.kind, rep.programs,
                                   samp.total_bytes + 1, rep.num_devices, rep.resident)
  assert any('sampler does not fit' in m and 'resident' in m for m in plan_report.failures([small]))


def test_frozen_copies_in_host_memory_are_not_resident(tiny_path):
  # Three teachers: on the devices, all three sit beside the train step and two beside
  # each teacher pass (the third is its argument); in host memory, none do.
  config = _load(tiny_path)
  p = config_lib.validate(config)
  st = [s for s in p.stages if s.name == 'add_rl'][0]
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  one = _per_device_bytes(plan_programs.abstract_params(p.model, 'policy', mesh,
                                                        sharding.DEFAULT_RULES)[1])
  programs = [types.SimpleNamespace(name=n) for n in ('train step', 'teacher forward')]

  def resident(on_host):
    ff = kinds.base.FrozenForward('teacher forward', 8, 64, copies=3, on_host=on_host)
    return dict(plan_memory.resident(st, p.model, mesh, sharding.DEFAULT_RULES, programs, [ff],
                                     []))

  dev, host = resident(False), resident(True)
  assert dev['train step'] == 3 * one and host['train step'] == 0
  assert dev['teacher forward'] - host['teacher forward'] == 2 * one


def test_a_sampler_with_its_own_copy_has_the_whole_state_beside_it(tiny_path):
  # Sampling with the state's params: beside the sampler is the state minus those params (its
  # argument); with a rollout copy (cast or resharded) the whole state stays beside it.
  p = config_lib.validate(_load(tiny_path))
  st = [s for s in p.stages if s.name == 'add_rl'][0]
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  one = _per_device_bytes(plan_programs.abstract_params(p.model, 'policy', mesh,
                                                        sharding.DEFAULT_RULES)[1])
  programs = [types.SimpleNamespace(name='sampler')]
  got = {copy: dict(plan_memory.resident(st, p.model, mesh, sharding.DEFAULT_RULES, programs, [],
                                         [], rollout_copy=copy))['sampler']
         for copy in (False, True)}
  assert got[True] - got[False] == one


@pytest.mark.heavy
def test_an_agentic_stage_plans_its_last_turn(tiny_path):
  """An agentic stage's sampler is planned for its largest turn: every episode live, its prompt
  the opening plus the whole episode budget, a turn's worth of new tokens."""
  config = _load(tiny_path)
  config.datasets.tools = dict(path='/d/tools.jsonl', format='prompt', domain='tools')
  config.domains.tools = dict(env='tool_use', train='tools', eval='tools', max_turns=4)
  config.stages = [dict(name='tool_rl', kind='agentic', domains=['tools'], steps=2,
                        optimizer=dict(lr=1e-4), prompts_per_step=4, group_size=4,
                        max_prompt_len=32, max_response_len=96, max_turn_tokens=16,
                        microbatches=2)]
  tgt = plan_targets.target(config_lib.validate(config), 'cpu')
  [rep] = plan_stages.run_plan(config_lib.validate(config), tgt, stages=['tool_rl'], with_eval=False, with_train=False)
  [samp] = rep.programs
  assert samp.name == 'sampler' and not samp.error
  assert '16 rows' in samp.shapes and 'prompt bucket 128' in samp.shapes
  assert 'new-token bucket 16' in samp.shapes


@pytest.mark.heavy
def test_a_packed_update_is_planned_at_its_largest_packed_batch(tiny_path):
  """pack_tokens: the train step is compiled for the largest batch packing can give (16 rows
  of 64 tokens two to a 128-token row: 8 rows, one microbatch of a padded microbatch's 8
  rows), with per-token advantages; its argument bytes are that batch's."""
  config = _load(tiny_path)
  config.stages[-1] = dict(config.stages[-1], pack_tokens=128, microbatches=2)
  validated = config_lib.validate(config)
  stage = validated.stage('add_rl')
  assert stage.microbatch_rows == 8
  tgt = plan_targets.target(validated, 'cpu')
  [rep] = plan_stages.run_plan(validated, tgt, stages=['add_rl'], with_eval=False,
                               with_sampler=False)
  [train] = rep.programs
  assert not train.error and rep.fits
  assert ('16 rows x 64 tokens (longest phase), packed into at most 8 rows x 128 tokens, '
          '1 microbatch(es) of 8 rows') in train.shapes
  mesh = sharding.make_mesh((2, 2, 2), devices=tgt.devices)
  batch, _ = kinds.get('grpo').abstract_batch(stage, mesh, sharding.DEFAULT_RULES)
  assert batch.tokens.shape == batch.advantages.shape == (8, 128)
  assert train.argument_bytes > _per_device_bytes(batch)


@pytest.mark.heavy
def test_the_paged_engine_is_planned_with_its_page_pool(tiny_path):
  config = _load(tiny_path)
  config.sampler = dict(engine='paged', slots=8, page_size=8)
  tgt = plan_targets.target(config_lib.validate(config), 'cpu')
  [rep] = plan_stages.run_plan(config_lib.validate(config), tgt, stages=['add_rl'], with_eval=False, with_train=False)
  samp, prefill = rep.programs
  assert (samp.name, prefill.name) == ('sampler', 'sampler prefill')
  assert not samp.error and samp.shapes.startswith('paged engine: 8 slots, a pool of 68 pages')
  assert not prefill.error and prefill.shapes.startswith('paged engine prefill: 8 prompts x ')
  assert prefill.flops > 0 and rep.peak(prefill) == prefill.total_bytes + rep.peak(samp) - (
      samp.total_bytes)   # the same state resident beside both calls
  mesh = sharding.make_mesh((2, 2, 2), devices=tgt.devices)
  model_cfg = model_config.ModelConfig.preset('tiny', max_seq_len=256)
  _, params = plan_programs.abstract_params(model_cfg, 'policy', mesh, sharding.DEFAULT_RULES)
  # 68 pages: per each of the 4 batch shards, 2 slots x 8 pages (32 + 32 tokens in pages of 8)
  # + 1; K/V heads split over 'tensor' (2), pages over the batch shards (4).
  pool = (2 * model_cfg.num_layers * model_cfg.num_kv_heads * 68 * 8 * model_cfg.head_dim
          * model_cfg.jnp_dtype.itemsize) / 8
  assert samp.argument_bytes == pytest.approx(_per_device_bytes(params) + pool, rel=0.05)
  assert samp.argument_bytes > _per_device_bytes(params) + 0.9 * pool
  assert prefill.argument_bytes > _per_device_bytes(params) + 0.9 * pool   # the pool it fills


@pytest.mark.parametrize('platform,unrolled', [('cpu', True), ('tpu', False)])
def test_programs_are_planned_with_the_platforms_layer_loops(tiny_path, platform, unrolled):
  # decode_layers='auto' and the model's scan_layers='auto' unroll on CPUs; a TPU config
  # planned on these simulated CPUs plans the TPU's programs, which scan their layers.
  config = _load(tiny_path)
  config.hardware.platform = platform
  [rep] = plan_stages.run_plan(config_lib.validate(config), plan_targets.target(config_lib.validate(config), 'cpu'), stages=['add_rl'], with_eval=False)
  train, samp = rep.programs
  assert not samp.error and samp.shapes.endswith('decode phase(s)' + (
      ', layers unrolled)' if unrolled else ')')), samp.shapes
  assert not train.error and train.shapes.endswith(', layers unrolled') == unrolled, train.shapes


# ---------------------------------------------------------------- the mixture-of-experts families

HYBRID_CONFIG = TINY_CONFIG.replace(
    "c.model = dict(preset='tiny', overrides=dict(max_seq_len=256))",
    "c.model = dict(preset='tiny_hybrid', overrides=dict(max_seq_len=256, remat=True,\n"
    "                                                        layer_types='M*E', num_layers=3))"
).replace("c.mesh = dict(shape=(2, 2, 2))", "c.mesh = dict(shape=(1, 2, 2, 2))").replace(
    "device_memory_gib=1.0)", "device_memory_gib=1.0, peak_tflops=1.0, hbm_gbps=10.0)")


@pytest.fixture(scope='module')
def hybrid_path(tmp_path_factory):
  path = tmp_path_factory.mktemp('plan') / 'tiny_hybrid_plan_config.py'
  path.write_text(HYBRID_CONFIG)
  return str(path)


def test_counted_flops_count_a_tokens_experts_not_all():
  cfg = model_config.ModelConfig.tiny_hybrid()          # 'ME*EM-': one attention sublayer
  d, f = cfg.embed_dim, cfg.moe_dim
  emb = cfg.vocab_size * d
  blocks = cfg.num_params(active=True) - 2 * emb - d   # untied: embedding and head left out
  attn = 4 * cfg.num_heads * cfg.head_dim               # QK^T and PV per key attended
  fwd = plan_flops.counted_flops(cfg, 'policy', 10, 5.0)
  assert fwd == 10 * (2 * blocks + 5.0 * attn + 2 * emb)
  # Routed experts: K = 2 of the E = 8 per token (relu2: up and down) in each of the 2 'moe'
  # sublayers, so routing every token to all of them would add (E - K) experts' matmuls.
  everything = plan_flops.counted_flops(cfg.replace(experts_per_token=8, router_groups=1), 'policy',
                                        10, 5.0)
  assert everything - fwd == 10 * 2 * 2 * (8 - 2) * 2 * d * f
  # A train step: forward + backward (3x), the sublayers once more under remat; the head's
  # matmul is not rematerialised. The reward model has no vocabulary head.
  assert plan_flops.counted_flops(cfg, 'policy', 10, 5.0, train=True) == 3 * fwd
  assert plan_flops.counted_flops(cfg.replace(remat='full'), 'policy', 10, 5.0, train=True) == (
      10 * (4 * (2 * blocks + 5.0 * attn) + 6 * emb))
  assert plan_flops.counted_flops(cfg, 'reward_model', 10, 5.0) == 10 * (2 * blocks + 5.0 * attn)


def _sampler_for(cfg, shape, sampler_cfg):
  mesh = sharding.make_mesh(shape, devices=jax.devices()[:int(np.prod(shape))])
  return plan_programs.sampler_for(cfg, mesh, sharding.DEFAULT_RULES, sampler_cfg)


def test_a_decode_step_reads_the_sampler_layout_and_the_experts_its_tokens_reach():
  cfg = model_config.ModelConfig.tiny_hybrid()
  sampler, params = _sampler_for(cfg, (1, 2, 2, 2), dict(rollout_rules=(('embed', None),)))
  laid_out = sampler.rollout_params(params)
  experts = other = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(laid_out):
    size = int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
    if any(getattr(k, 'key', None) in ('up', 'down') for k in path):
      experts += size
    else:
      other += size
  assert experts > 0 and other > 0
  # 4 rows: one per batch shard (data 1 x fsdp 2 x expert 2); an expert shard gathers the 2
  # rows of its expert group, and a token reaches a given expert with probability K/E = 2/8.
  reached = 1 - (1 - 2 / 8) ** 2
  assert plan_step_time.decode_read_bytes(cfg, sampler, 4) == pytest.approx(
      other + reached * experts)
  assert plan_step_time.decode_read_bytes(cfg, sampler, 4096) == pytest.approx(other + experts)
  # The rollout layout (embed whole) is what a decode step reads, not the training one.
  trained, _ = _sampler_for(cfg, (1, 2, 2, 2), {})
  assert plan_step_time.decode_read_bytes(cfg, trained, 4096) < other + experts
  # A dense model: every weight of the device, per step.
  dense = model_config.ModelConfig.tiny()
  sampler, params = _sampler_for(dense, (2, 2, 2), {})
  assert plan_step_time.decode_read_bytes(dense, sampler, 8) == _per_device_bytes(params)
  assert plan_memory.rollout_copy_bytes(sampler, params) == 0     # float32 compute: no copy


def test_a_bfloat16_model_samples_and_is_planned_with_its_rollout_copy():
  """The sampler is handed float32 masters; it samples with (and the plan lowers, reads and
  keeps beside the state) a copy whose matmul weights are bfloat16."""
  cfg = model_config.ModelConfig.tiny(param_dtype='bfloat16', dtype='bfloat16')
  cast, given = _sampler_for(cfg, (2, 2, 2), {})
  plain, _ = _sampler_for(cfg, (2, 2, 2), dict(rollout_cast=False))
  assert {x.dtype for x in jax.tree.leaves(given)} == {np.dtype('float32')}
  masters = _per_device_bytes(given)
  assert plan_step_time.decode_read_bytes(cfg, plain, 8) == masters
  assert plan_memory.rollout_copy_bytes(plain, given) == 0
  copy = plan_memory.rollout_copy_bytes(cast, given)
  assert plan_step_time.decode_read_bytes(cfg, cast, 8) == copy
  assert 0.5 * masters < copy < 0.55 * masters     # matmul weights halved, norms kept
  # The lowered sampler takes the copy: its params arguments have the copy's dtypes.
  lowered = cast.lower(given, 8, 4, sampler_lib.SamplingParams(max_new_tokens=4))
  n = len(jax.tree.leaves(given))
  got = [a.dtype for a in jax.tree.leaves(lowered.args_info)[:n]]
  assert got == [a.dtype for a in jax.tree.leaves(cast.rollout_params(given))]
  assert np.dtype(jnp.bfloat16) in got and np.dtype(np.float32) in got


def test_largest_arrays_name_what_fills_a_program():
  big = jax.jit(lambda x: (jnp.sin(jnp.outer(x, x)), x + 1)).lower(
      jax.ShapeDtypeStruct((1024,), jnp.float32)).compile().as_text()
  first = plan_compiler.largest_arrays(big)[0]
  assert first.startswith('4.00 MiB f32[1024,1024] ('), first


def test_sampling_programs_on_cpu_devices_hold_no_hoisted_float32_weights():
  """XLA:CPU computes a bfloat16 dot in float32 and hoists the conversion of a scanned layer
  stack out of a decode loop: a float32 copy of all the weights that a TPU or GPU never makes.
  `sampling_options` compiles without that hoisting; the temporaries are then the one layer's
  conversion at a time, not all of them."""
  layers, d, f = 8, 512, 2048

  def decode(w, x):
    def layer(x, wl):
      return jnp.einsum('bd,df->bf', x, wl[0]) @ wl[1], None
    return jax.lax.fori_loop(0, 16, lambda i, x: jax.lax.scan(layer, x, w)[0], x)

  w = (jax.ShapeDtypeStruct((layers, d, f), jnp.bfloat16),
       jax.ShapeDtypeStruct((layers, f, d), jnp.bfloat16))
  x = jax.ShapeDtypeStruct((8, d), jnp.bfloat16)
  lowered = jax.jit(decode).lower(w, x)
  mesh = jax.sharding.Mesh(np.array(jax.devices('cpu')[:1]), ('data',))
  assert plan_compiler.sampling_options(mesh) == plan_compiler.CPU_SAMPLING_OPTIONS
  stacked_f32 = 2 * layers * d * f * 4
  hoisted = plan_compiler.compile_program('decode', 'x', lambda: lowered, flops=0.)
  kept = plan_compiler.compile_program('decode', 'x', lambda: lowered, flops=0.,
                                       compiler_options=plan_compiler.sampling_options(mesh))
  assert hoisted.temp_bytes >= stacked_f32, hoisted
  assert kept.temp_bytes < stacked_f32 / 4, kept


def test_model_notes_say_how_an_expert_model_is_counted_and_compiled():
  cpu = plan_targets.Target((), 'cpu', 'x', 0)
  tpu = plan_targets.Target((), 'tpu', 'x', 0)
  assert plan_report.model_notes(model_config.ModelConfig.tiny(), cpu) == []
  hybrid = model_config.ModelConfig.tiny_hybrid()
  assert 'counted from the config' in plan_report.model_notes(hybrid, cpu)[0]
  assert 'ragged_dot' in plan_report.model_notes(hybrid, cpu)[1]
  assert 'megablox grouped-matmul kernel' in plan_report.model_notes(hybrid, tpu)[1]


@pytest.mark.heavy
def test_a_hybrid_with_an_expert_axis_is_planned(hybrid_path):
  """Mamba-2, attention and mixture-of-experts sublayers, unrolled, on a (data, fsdp, expert,
  tensor) mesh: the train step and sampler compile and fit, their FLOPs are counted from the
  config, and the stage gets a time bound."""
  config = _load(hybrid_path)
  p = config_lib.validate(config)
  assert plan_targets.num_devices(p) == 8
  tgt = plan_targets.target(p, 'cpu')
  [rep] = plan_stages.run_plan(p, tgt, stages=['add_rl'], with_eval=False)
  train, samp = rep.programs
  assert rep.fits and not train.error and not samp.error
  assert train.flops_from == samp.flops_from == plan_flops.COUNTED
  assert train.flops == pytest.approx(plan_flops.counted_flops(p.model, 'policy', 16 * 64, 32.5,
                                                               train=True))
  assert samp.flops > 0 and 'KV cache of 64 slots' in samp.shapes
  assert rep.seconds > 0 and 'chip-hours' in plan_report.format_stage(rep)
  assert '(counted from the config)' in plan_report.format_stage(rep)


def test_markdown_report_says_how_and_what(tmp_path):
  """The page `--report` writes: the command, date, host and load, the header lines, one row
  per program with its co-resident peak and share of the device, the stages' chip-hour bounds,
  and whether the plan failed (a compile error named in its row)."""
  gib = 2 ** 30
  ok = plan_results.ProgramReport('train step', '8 rows x 64 tokens', argument_bytes=2 * gib,
                                  temp_bytes=3 * gib, flops=1.5e15, compile_s=41.2,
                                  compile_cpu_s=80.0)
  bad = plan_results.ProgramReport('sampler', '8 rows | 64', compile_s=3.0, compile_cpu_s=3.0,
                                   error='JaxRuntimeError: RESOURCE_EXHAUSTED: 120G')
  rep = plan_results.StageReport(0, 'math_rl', 'grpo', (ok, bad), 10 * gib, 64,
                                 resident=(('train step', 1 * gib),),
                                 time=plan_results.StepTime(update=2.0), steps=1800)
  failed = plan_report.failures([rep])
  page = plan_report.markdown_report(
      [rep], command='python -m launch.plan --config=c.py',
      header=['target: TPU v5p', 'mesh (data, fsdp, tensor) = (1, 8, 8)'],
      hosts=('host: 2 CPUs, load average 0.5', 'host: 2 CPUs, load 1.0'),
      date='2026-12-03 15:00 UTC', failed=failed)
  assert page.startswith('# Plan: `python -m launch.plan --config=c.py`')
  assert '2026-12-03 15:00 UTC' in page and 'load average 0.5 (before)' in page
  assert '- target: TPU v5p' in page and '| stage | program | shapes | per device | of 10.00 GiB' in page
  # 2 + 3 GiB of its own + 1 GiB resident beside it = 6 GiB = 60 % of 10.
  assert '| math_rl | train step | 8 rows x 64 tokens | 6.00 GiB | 60 % | 41 s (80 s) | 1.5e+15 |' in page
  row = next(l for l in page.splitlines() if l.startswith('| math_rl | sampler'))
  assert 'DOES NOT COMPILE: JaxRuntimeError: RESOURCE_EXHAUSTED: 120G' in row
  # The shapes' own '|' escaped: 8 columns, the table stays whole.
  assert len(re.findall(r'(?<!\\)\|', row)) == 9 and '8 rows \\| 64' in row
  # 2 s x 1800 steps = 1 h on 64 chips; compiled programs without collectives: 0 s of them.
  assert '| math_rl | 1800 |  |  | 2 | 0 | 0 / 0 / 0 / 0 | 2 | 2 | 64, 64 | 1, 64 | 0, 0 |' in page
  assert 'PLAN FAILED' in page
  assert 'every planned program fits' in plan_report.markdown_report(
      [dataclasses.replace(rep, programs=(ok,))], command='c', header=['target: t'],
      hosts=('a', 'b'), date='d')
  # Written after each stage of a long plan: what it has, marked unfinished, no verdict.
  partial = plan_report.markdown_report([rep], command='c', header=['target: t'], hosts=('a', 'b'),
                                        date='d', finished=False)
  assert 'Unfinished' in partial and '| math_rl | train step |' in partial
  assert 'Result:' not in partial
  # Which compiler made the numbers is on every page: a header without it is refused.
  with pytest.raises(ValueError, match="no 'target: ' line"):
    plan_report.markdown_report([rep], command='c', header=['mesh (data, fsdp, tensor) = (1, 8)'],
                                hosts=('a', 'b'), date='d')


# ---------------------------------------------------------------- the step-time model

def _direct_sampling_seconds(cfg, sampler, engine, hw, *, kv_token, state_row, rows_dev,
                             chunks, prompt_len, max_new):
  """One call of 32 rows (8 prompts x 4) of a 20-token prompt and 300 new tokens, counted step
  by step from the model's shape: (seconds, seconds of the KV reads, decode steps bound by
  their FLOPs, decode steps) on `hw`.

  The blocks' matmuls are 2 FLOPs per active parameter outside the embedding, the output head
  2 per vocabulary entry x width, attention 4 x heads x head_dim per key attended.
  """
  bw, peak = hw.hbm_gbps * 1e9, hw.peak_tflops * 1e12 * 8   # 8 devices
  emb = cfg.vocab_size * cfg.embed_dim
  blocks = cfg.num_params(active=True) - emb * (1 if cfg.tie_embeddings else 2) - cfg.embed_dim
  per_key = cfg.attention_layers * 4 * cfg.num_heads * cfg.head_dim
  slots = rows_dev * 4                                      # 4 batch shards
  weights = plan_step_time.decode_read_bytes(cfg, sampler, slots)
  t = kv_s = 0.0
  by_flops = 0
  if engine == 'one_call':
    # Prompt bucket 32, new-token bucket 512 in 3 decode phases (128, 256, 512): decode step s
    # = 1 .. 299 attends every row's cache of 32 + the phase's end slots.
    steps = [32 + (128 if s < 128 else 256 if s < 256 else 512) for s in range(1, max_new)]
    # Per chunk one prefill of its 4 distinct prompts x 32 tokens, the head at their last.
    prefill = [(4 * 32 * (2 * blocks + per_key * 33 / 2) + 4 * 2 * emb,
                plan_step_time.decode_read_bytes(cfg, sampler, 4 * 32))] * chunks
  else:
    # Step j = 0 .. 299 attends the prompt's 20 + j keys in whole pages of 16.
    steps = [math.ceil((prompt_len + j) / 16) * 16 for j in range(max_new)]
    # One prefill call of the 8 prompts' first 19 tokens: prompt bucket 32, whole pages.
    prefill = [(8 * 32 * (2 * blocks + per_key * 33 / 2),
                plan_step_time.decode_read_bytes(cfg, sampler, 8 * 32))]
  for keys in steps:
    kv = rows_dev * keys * kv_token
    step_bytes = weights + kv + rows_dev * 2 * state_row
    flops = slots * (2 * blocks + 2 * emb + per_key * keys)
    t += chunks * max(step_bytes / bw, flops / peak)
    kv_s += chunks * kv / bw
    by_flops += flops / peak > step_bytes / bw
  for flops, read in prefill:
    t += max(read / bw, flops / peak)
  return t, kv_s, by_flops, len(steps)


@pytest.mark.parametrize('engine', ['one_call', 'paged'])
@pytest.mark.parametrize('family', ['dense', 'hybrid'])
def test_sampling_time_is_a_direct_count_of_its_reads_and_flops(engine, family):
  """The sampling part of the step-time bound equals the reads and FLOPs of a call counted step
  by step here: the weights of the sampler's layout, every row's K and V over the keys it
  attends (one-call: the decode phase's cache extent; paged: the row's filled pages), each
  Mamba state read and written, the prefill, each call at max(reads / bandwidth, FLOPs / peak)."""
  if family == 'dense':
    cfg, shape = model_config.ModelConfig.tiny(), (2, 2, 2)
    # 2 layers x K and V x 1 of 2 KV heads per device (over 'tensor') x 16 x float32.
    kv_token, state_row = 2 * 2 * 1 * 16 * 4, 0
  else:
    cfg, shape = model_config.ModelConfig.tiny_hybrid(), (1, 2, 2, 2)
    # 1 attention sublayer; 2 Mamba sublayers of 2 of 4 heads per device x 16 x state 8
    # float32, and the whole convolution's last 3 inputs of 4 x 16 + 2 x 2 x 8 channels.
    kv_token, state_row = 1 * 2 * 1 * 16 * 4, 2 * (2 * 16 * 8 * 4 + 3 * 96 * 4)
  if engine == 'one_call':   # 2 chunks of 16 rows (4 per device: 4 x 544 cache slots, each
    # row charged its Mamba states in cache slots besides)
    states = -(-state_row // kv_token)
    options, rows_dev, chunks = dict(cache_tokens_per_device=4 * (32 + 512 + states)), 4, 2
  else:                      # 8 slots (2 per device): 4 waves
    options, rows_dev, chunks = dict(engine='paged', slots=8, page_size=16), 2, 4
  sampler, _ = _sampler_for(cfg, shape, options)
  # Slow enough that some decode steps are bound by their FLOPs, the others by their reads.
  hw = config_lib.Hardware(peak_tflops=0.013 if (family, engine) == ('hybrid', 'paged')
                           else 0.016, hbm_gbps=10.0)
  got = plan_step_time.sampling_time(cfg, sampler, hw, rows=32, prompt_len=20, max_new_tokens=300,
                                     num_samples=4)
  want, kv, by_flops, steps = _direct_sampling_seconds(
      cfg, sampler, engine, hw, kv_token=kv_token, state_row=state_row, rows_dev=rows_dev,
      chunks=chunks, prompt_len=20, max_new=300)
  total = got['weights'] + got['kv'] + got['state'] + got['compute'] + got['prefill']
  assert total == pytest.approx(want, rel=1e-9)
  assert got['kv'] == pytest.approx(kv, rel=1e-9)
  assert got['decode_steps'] == chunks * steps == chunks * (
      299 if engine == 'one_call' else 300)
  assert 0 < by_flops < steps and got['compute'] > 0     # both kinds of step occur
  assert (got['state'] > 0) == (family == 'hybrid')


def test_the_weights_only_bound_is_below_the_step_time_model_at_long_lengths(tiny_path):
  """At 4K new tokens the KV reads the weights-only bound left out dominate; the step's other
  parts: the update's counted FLOPs, no scoring estimate for a verifier, 1 + refill_cap rounds
  at worst."""
  config = _load(tiny_path)
  config.model.overrides.max_seq_len = 8192
  config.hardware.peak_tflops, config.hardware.hbm_gbps = 1.0, 10.0
  config.stages[2].update(max_response_len=4096, phases=None)
  p = config_lib.validate(config)
  tgt = plan_targets.target(p, 'cpu')
  [rep] = plan_stages.time_plan(p, tgt, stages=['add_rl'])
  t = rep.time
  assert rep.programs == () and t.weights_only < 0.5 * t.bound and t.kv > t.weights
  assert t.scoring is None and t.rounds == 5 and t.worst == pytest.approx(
      5 * t.sampling + t.update)
  mesh = sharding.make_mesh((2, 2, 2), devices=tgt.devices)
  assert t.update == pytest.approx(plan_flops.counted_flops(p.model, 'policy', 16 * 4128, 4129 / 2,
                                                            train=True) / 8e12)
  # The weights-only bound: per new token of each chunk one read of the weights.
  sampler, _ = plan_programs.sampler_for(p.model, mesh, p.rules, p.sampler.options())
  assert t.weights_only == pytest.approx(
      4096 * plan_step_time.decode_read_bytes(p.model, sampler, 16) / 10e9 + t.update)
  text = plan_report.format_stage(rep)
  assert 'KV cache' in text and 'scoring not estimated' in text and 'worst case, 5' in text
  assert 'weights-only bound it replaces' in text and 'chip-hours' in text
  page = plan_report.markdown_report([rep], command='c', header=['target: t'], hosts=('a', 'b'),
                                     date='d')
  assert '| add_rl | 4 |' in page and 'not estimated' in page and 'The bound assumes:' in page
  assert 'step times only, nothing compiled.' in page and '| stage | program |' not in page


def test_the_step_time_page_times_every_stage_of_each_config(tiny_path):
  from launch import step_time_page  # pylint: disable=g-import-not-at-top
  config = _load(tiny_path)
  config.hardware.peak_tflops, config.hardware.hbm_gbps = 1.0, 10.0
  text = step_time_page.page({'tiny.py': config_lib.validate(config)}, command='c', date='d')
  assert text.startswith('# Step-time model: `c`') and 'nothing compiled' in text
  assert '## `tiny.py`' in text and '| sft | 2 |' in text and '| add_rl | 4 |' in text
  assert 'All stages:' in text and text.count('The bound assumes:') == 1


@pytest.mark.heavy
def test_time_only_and_the_page_from_the_command_line(tiny_path, tmp_path):
  """`launch.plan --time_only` prints and writes each stage's bound, compiling nothing;
  `launch.step_time_page` writes its page."""
  config = tmp_path / 'timed.py'
  config.write_text(TINY_CONFIG.replace("device_memory_gib=1.0)",
                                        "device_memory_gib=1.0, peak_tflops=1.0, hbm_gbps=10.0)"))
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  run = lambda *args: subprocess.run([sys.executable, '-m', *args], cwd=ROOT, env=env,
                                     capture_output=True, text=True, timeout=300)
  report = tmp_path / 'time.md'
  proc = run('launch.plan', f'--config={config}', '--time_only', f'--report={report}')
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert '[2] add_rl (grpo)' in proc.stdout and 'KV cache' in proc.stdout
  assert 'nothing compiled' in proc.stdout and 'compiled in' not in proc.stdout
  assert '| add_rl | 4 |' in report.read_text()
  out = tmp_path / 'page.md'
  proc = run('launch.step_time_page', f'--configs={config}', f'--out={out}')
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert f'## `{config}`' in out.read_text()


def test_an_agentic_step_is_timed_turn_by_turn(tiny_path):
  """An episode of 96 tokens in turns of 32: three calls, the prompt growing by the turns
  before (32, 64, 96 tokens after the opening 32), each priced as a call of its own."""
  config = _load(tiny_path)
  config.hardware.peak_tflops, config.hardware.hbm_gbps = 1.0, 10.0
  config.datasets.tools = dict(path='/d/tools.jsonl', format='prompt', domain='tools')
  config.domains.tools = dict(env='tool_use', train='tools', eval='tools', max_turns=4)
  config.stages = [dict(name='tool_rl', kind='agentic', domains=['tools'], steps=2,
                        optimizer=dict(lr=1e-4), prompts_per_step=4, group_size=4,
                        max_prompt_len=32, max_response_len=96, max_turn_tokens=32,
                        microbatches=2)]
  p = config_lib.validate(config)
  tgt = plan_targets.target(p, 'cpu')
  [rep] = plan_stages.time_plan(p, tgt)
  mesh = sharding.make_mesh((2, 2, 2), devices=tgt.devices)
  sampler, _ = plan_programs.sampler_for(p.model, mesh, p.rules, p.sampler.options())
  turns = [plan_step_time.sampling_time(p.model, sampler, p.hardware, rows=16,
                                        prompt_len=32 + 32 * k, max_new_tokens=32)
           for k in range(3)]
  assert rep.time.sampling == pytest.approx(sum(
      t['weights'] + t['kv'] + t['state'] + t['compute'] + t['prefill'] for t in turns))
  assert rep.time.decode_steps == 3 * 31


def test_the_config_flag_takes_cascade_mains_overrides():
  # launch.plan's --config is cascade.main's (cascade/overrides.py), parsed by its flags parser.
  # (The command line itself: the heavy tests below.)
  from absl import flags  # pylint: disable=g-import-not-at-top
  parser = plan_cli._CONFIG._flagvalues[plan_cli._CONFIG.name].parser
  assert plan_cli._CONFIG._flagvalues is flags.FLAGS and plan_cli._CONFIG.name == 'config'
  assert type(parser).__module__ == 'cascade.overrides' and parser.flag_type() == 'config object'


@pytest.mark.heavy
def test_a_bad_override_is_one_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, '-m', 'launch.plan', '--config=configs/tiny.py:smoke',
       '--config.stages.math_rll.group_size=8', '--time_only'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and proc.stdout == ''
  assert proc.stderr == ("error: --config.stages.math_rll.group_size: config.stages has no "
                         "stage named 'math_rll' (nearest: math_rl)\n")


@pytest.mark.heavy
def test_the_plan_is_of_the_overridden_config():
  # The module docstring's command: an unset field (mesh.shape, a tuple) and a stage by name.
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run(
      [sys.executable, '-m', 'launch.plan', '--config=configs/tiny.py:smoke',
       '--config.mesh.shape=1,2,1', '--config.stages.math_rl.group_size=8', '--stages=math_rl',
       '--noeval'], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert '2 simulated CPU devices' in proc.stdout
  assert 'mesh (data, fsdp, tensor) = (1, 2, 1);' in proc.stdout
  assert '[4] math_rl (grpo)' in proc.stdout and '4 prompts x 8 = 32 rows' in proc.stdout


def test_a_mesh_with_a_sequence_axis_is_accepted_and_named(tiny_path):
  config = _load(tiny_path)
  config.mesh.shape = (1, 2, 1, 2, 2)
  p = config_lib.validate(config)
  assert plan_targets.num_devices(p) == 8
  header = '\n'.join(plan_report.plan_header(p, None, time_only=True))
  assert 'mesh (data, fsdp, expert, sequence, tensor) = (1, 2, 1, 2, 2)' in header
  config.mesh.shape = (1, 1, 1, 2, 1, 1)
  with pytest.raises(config_lib.ConfigError, match='config.mesh.shape'):
    config_lib.validate(config)


@pytest.mark.heavy
def test_context_parallel_train_step_plans_with_fewer_temporaries_per_device(tiny_path):
  # The SFT stage's rows split over eight sequence shards (context-parallel attention, zig-zag
  # layout, sequence-sharded chunked log-probs) against eight tensor shards (the tiny model's
  # 2 kv heads do not split 8 ways: attention runs whole on every device).
  temps = {}
  for shape in ((1, 1, 1, 1, 8), (1, 1, 1, 8, 1)):
    config = _load(tiny_path)
    config.mesh.shape = shape
    p = config_lib.validate(config)
    tgt = plan_targets.target(p, 'cpu')
    [rep] = plan_stages.run_plan(p, tgt, stages=['sft'], with_eval=False)
    [train] = rep.programs
    assert rep.fits and not train.error
    temps[shape[3]] = train.temp_bytes
  assert temps[8] < temps[1]          # 3.0 against 3.4 MiB when written


def test_reward_model_scoring_is_planned_at_the_rows_the_run_scores():
  # The 14B recipe's RLHF rollouts (4,096 prompt + 12,288 response tokens, plus EOS) are
  # scored by the RM stage (256 pairs x 8,192 tokens a training call, score_max_len 65,536):
  # rows bucket to 32,768 tokens, so a scoring call holds 256 x 8,192 / 32,768 = 64 rows. The
  # plan compiles that call, and the run's scorer makes calls of that shape for such rows.
  import importlib  # pylint: disable=g-import-not-at-top
  from rl import reward_model  # pylint: disable=g-import-not-at-top
  p = config_lib.validate(importlib.import_module('configs.nemotron_cascade_14b').get_config(None))
  stage = p.stage('rlhf')
  [rm_stage] = plan_stages.scoring_rm_stages(p, stage)
  assert (rm_stage.batch_size, rm_stage.max_len, rm_stage.score_len) == (256, 8192, 65536)
  rows, length = plan_stages.rm_scoring_call(stage, rm_stage)
  assert (rows, length) == (64, 32768)
  longest = stage.max_prompt_len + stage.longest_response + 1
  assert reward_model.row_length(longest, rm_stage.score_len) == length
  assert reward_model.rows_per_call(length, rm_stage.batch_size,
                                    policies.scoring_call_tokens(rm_stage)) == rows
  # Rows within the RM's training length keep the whole batch per call.
  short = dataclasses.replace(stage, phases=tuple(dataclasses.replace(ph, max_response_len=2048)
                                                 for ph in stage.phases))
  assert plan_stages.rm_scoring_call(short, rm_stage) == (256, 8192)


def test_simulated_devices_say_when_they_stand_in_for_an_accelerator(tiny_path, monkeypatch):
  """The `target:` line of a plan on simulated CPU devices: for a TPU or GPU config it says
  why (libtpu missing, or --backend=cpu chosen where it is installed) and that XLA:CPU's memory
  runs above the accelerator compiler's (docs/planning.md, which to trust); for a CPU config
  XLA:CPU is the compiler, and it says nothing of the kind."""
  monkeypatch.setattr(plan_targets, 'have_libtpu', lambda: False)
  config = _load(tiny_path)
  assert 'above what its own compiler' not in plan_targets.target(
      config_lib.validate(config), 'cpu').description
  config.hardware = dict(platform='tpu', topology='v5p:2x2x2', device_memory_gib=95)
  desc = plan_targets.target(config_lib.validate(config), 'cpu').description
  assert desc.startswith('8 simulated CPU devices standing in for the target (libtpu not '
                         'installed'), desc
  assert 'XLA:CPU memory estimates, above what its own compiler needs' in desc, desc
  monkeypatch.setattr(plan_targets, 'have_libtpu', lambda: True)
  desc = plan_targets.target(config_lib.validate(config), 'cpu').description
  assert desc.startswith('8 simulated CPU devices standing in for the target (--backend=cpu);')


def test_native_stderr_held_shows_only_on_failure(capfd):
  """libtpu's start-up lines (written by native code to file descriptor 2 when the first TPU
  topology loads it on a host without TPU chips) are held back: dropped when the block succeeds,
  shown before the error when it raises."""
  with plan_targets.native_stderr_held():
    os.write(2, b'E0000 libtpu: unexpected worker hostname\n')
  assert capfd.readouterr().err == ''
  with pytest.raises(RuntimeError, match='^topology refused$'):
    with plan_targets.native_stderr_held():
      os.write(2, b'why it failed\n')
      raise RuntimeError('topology refused')
  assert capfd.readouterr().err == 'why it failed\n'
  os.write(2, b'after\n')                 # file descriptor 2 is back where it was
  assert capfd.readouterr().err == 'after\n'
