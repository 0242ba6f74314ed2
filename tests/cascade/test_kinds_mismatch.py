"""The GRPO stage's sampler/trainer mismatch correction as a config writes it: its fields reach the
loss config, bad values are refused naming the field, and with several updates per rollout batch
each step computes the policy's old log-probs before its first update (the math:
tests/rl/test_mismatch_correction.py).
"""

import importlib.util
import json
import re
import types

import jax
import numpy as np
import pytest
from flax import nnx

from cascade import checkpoint
from cascade import config as config_lib
from cascade import kinds
from cascade import policies as policies_lib
from cascade import runner
from cascade.kinds import base
from cascade.kinds import grpo
from cascade.kinds import loop
from models import transformer
from rl import batch as batch_lib
from rl import grpo as grpo_lib

GRPO = dict(name='rl', kind='grpo', domains=['a'], steps=6, optimizer=dict(lr=1e-3),
            prompts_per_step=4, group_size=2, max_prompt_len=10, max_response_len=16)
ON = dict(tis_cap=2.0, mismatch_mask='sequence', mismatch_mask_low=0.25, mismatch_mask_high=4)


def _stage(raw, kind='grpo'):
  doms = {'a': config_lib.Domain(name='a', verifier='math', train='a_train', eval='a_train')}
  ds = {'a_train': config_lib.Dataset(name='a_train', format='prompt', record_type='prompt')}
  return kinds.parse(0, dict(raw, kind=kind), base.Refs((), (raw['name'],), doms, ds))


def test_the_options_reach_the_stages_loss_config_and_are_off_by_default():
  _, off = kinds.get('grpo').loss(_stage(GRPO))
  assert not off.corrects_mismatch and off == grpo_lib.GrpoConfig(advantage='grpo')
  _, cfg = kinds.get('grpo').loss(_stage(dict(GRPO, **ON)))
  assert (cfg.tis_cap, cfg.mismatch_mask, cfg.mismatch_mask_low, cfg.mismatch_mask_high) == (
      2.0, 'sequence', 0.25, 4.0)
  assert isinstance(cfg.mismatch_mask_high, float)
  # The agentic kind takes every grpo field.
  assert {'tis_cap', 'mismatch_mask'} <= {f.name for f in
                                          kinds.get('agentic').config.__dataclass_fields__.values()}


def test_a_validated_config_carries_them_and_its_hash_is_unchanged_when_they_are_absent(fakes):
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a'], tis_cap=3, mismatch_mask='token')])
  _, cfg = kinds.get('grpo').loss(plan.stages[0])
  assert (cfg.tis_cap, cfg.mismatch_mask) == (3.0, 'token')
  # Left out, the stage dict (what the config hash covers) is what it was before the options.
  bare = fakes.toy_config([fakes.rl_stage('rl', ['a'])])
  assert not any(k in bare.source['stages'][0] for k in ON)
  assert checkpoint.config_hash(bare.source) != checkpoint.config_hash(plan.source)


@pytest.mark.parametrize('field,value,message', [
    ('tis_cap', 0.5, 'must be None (off) or a finite number >= 1'),
    ('tis_cap', float('inf'), 'must be None (off) or a finite number >= 1'),
    ('mismatch_mask', 'icepop', 'unknown mismatch mask mode (known: off, token, sequence)'),
    ('mismatch_mask_low', 1.0, 'must be in [0, 1)'),
    ('mismatch_mask_low', -0.5, 'must be in [0, 1)'),
    ('mismatch_mask_high', 1.0, 'must be a finite number > 1'),
])
def test_bad_values_are_refused_naming_the_field(field, value, message):
  raw = {**GRPO, 'mismatch_mask': 'token', field: value}
  with pytest.raises(config_lib.ConfigError,
                     match=re.escape(f"stages[0] 'rl': {field}={value!r}: {message}")):
    _stage(raw)


@pytest.mark.parametrize('field,value', [('mismatch_mask_low', 0.2), ('mismatch_mask_high', 3.0)])
def test_a_band_without_masking_is_refused(field, value):
  with pytest.raises(config_lib.ConfigError,
                     match=re.escape(f"stages[0] 'rl': {field}={value!r}: has no effect with "
                                     "mismatch_mask='off'")):
    _stage(dict(GRPO, **{field: value}))


@pytest.mark.parametrize('updates,options,forward', [
    (1, ON, False), (2, {}, False), (2, dict(tis_cap=2.0), True),
    (2, dict(mismatch_mask='token'), True)])
def test_the_old_policy_forward_runs_exactly_with_a_correction_over_several_updates(
    updates, options, forward):
  st = _stage(dict(GRPO, updates_per_batch=updates, microbatches=2, **options))
  mesh = jax.make_mesh((1, 1, 1), ('data', 'fsdp', 'tensor'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=jax.devices()[:1])
  batch, _ = kinds.get('grpo').abstract_batch(st, mesh, None)
  assert (batch.trainer_logprobs is not None) == forward
  if forward:
    assert batch.trainer_logprobs.shape == batch.old_logprobs.shape == (8 // updates, 26)
  passes = kinds.get('grpo').frozen_forwards(st)
  assert passes == ([base.FrozenForward('old policy forward', 4, 26, copies=0, calls=2)]
                    if forward else [])


def _maker(monkeypatch, fakes, tmp_path, plan):
  """The stage's BatchMaker, built as its runner builds it (the training loop is not run)."""
  recs = [fakes.record('a', i, 10 + i) for i in range(8)]
  vs = {d: fakes.ValueVerifier(d) for d in plan.domains}
  ctx = types.SimpleNamespace(
      plan=plan, workdir=str(tmp_path), mesh=None, rules=plan.rules, batch_shards=1,
      sampler=fakes.OwnAnswerSampler(answer=str), tokenizer=fakes.CharTokenizer(),
      sample_cls=fakes.Sample, verifiers=types.SimpleNamespace(train_verifier=vs.__getitem__),
      domain_index={'a': 0, 'b': 1}, data=types.SimpleNamespace(stage_records=lambda st: recs),
      policies=policies_lib.Policies(plan, str(tmp_path), None, plan.rules),
      progress=types.SimpleNamespace(rows=[]))
  got = []
  monkeypatch.setattr(loop, 'train_stage',
                      lambda ctx, kind, st, maker_fn: got.append(maker_fn(None)) or None)
  grpo.run(ctx, plan.stages[0])
  return ctx, got[0]


@pytest.mark.parametrize('pack', [0, 64])
def test_each_update_carries_the_policys_log_probs_from_before_the_first(fakes, tmp_path,
                                                                         monkeypatch, pack):
  """Every mini-batch of a step holds the log-probs of the params that sampled it (those the
  step starts from), whatever update it feeds; packed rows carry them with their tokens."""
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a'], updates_per_batch=2, tis_cap=2.0,
                                          pack_tokens=pack)])
  ctx, maker = _maker(monkeypatch, fakes, tmp_path, plan)
  params = nnx.split(transformer.create(plan.model, 5))[1]
  updates, _ = maker.make(0, jax.random.key(0), types.SimpleNamespace(params=params))
  assert len(updates) == 2
  graphdef = ctx.policies.graphdef('policy')
  for u in updates:
    want = np.asarray(batch_lib.compute_logprobs(graphdef, params, u)) * u.loss_mask
    np.testing.assert_allclose(u.trainer_logprobs * u.loss_mask, want, atol=1e-5)
    assert np.abs(want).max() > 0.1


@pytest.mark.heavy
def test_a_corrected_ppo_style_stage_runs_inside_a_cascade(tmp_path, copy_cascade):
  """SFT -> GRPO with TIS and token masking over 2 updates per rollout batch, the whole loop: the
  jitted step takes mini-batches carrying the old policy's log-probs, and every step logs the
  mismatch ratio's distribution, which on XLA:CPU in float32 (sampler == trainer) is 1 with no
  token masked or over the cap."""
  spec = importlib.util.spec_from_file_location(
      'cfg', copy_cascade(tmp_path, train=64, eval_=32, sft=64, sft_steps=10, rl_steps=2))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.sampler.new_token_buckets = (16,)
  c.eval.max_new_tokens = 12
  rl = dict(c.stages[1], updates_per_batch=2, prompts_per_step=4, tis_cap=2.0,
            mismatch_mask='token')
  c.stages = [c.stages[0], rl]
  runner.run(c, str(tmp_path / 'run'))
  rows = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')]
  rl_rows = [r for r in rows if r.get('stage') == rl['name']]
  assert len(rl_rows) == 2 and all(r['updates'] == 2.0 for r in rl_rows)
  for r in rl_rows:
    assert r['mismatch_ratio_min'] == pytest.approx(1.0, abs=1e-3), r
    assert r['mismatch_ratio_max'] == pytest.approx(1.0, abs=1e-3), r
    assert r['mismatch_masked_frac'] == r['mismatch_over_cap_frac'] == 0.0
