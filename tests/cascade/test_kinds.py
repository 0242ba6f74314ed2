"""Stage kinds: the registry's contract, typed configs, and the newest kinds run in a cascade."""

import importlib.util
import json
import os
import pathlib
import random
import re

import jax
import ml_collections
import numpy as np
import pytest

from cascade import config as config_lib
from cascade import kinds
from cascade import runner
from cascade.kinds import base
from cascade.kinds import loop
from rl import grpo as grpo_lib

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_every_kind_declares_its_config_runner_and_training_pieces():
  assert set(kinds.KINDS) == {'sft', 'reward_model', 'grpo', 'mopd', 'eval', 'dpo', 'agentic'}
  for name, kind in kinds.KINDS.items():
    assert kind.name == name and issubclass(kind.config, base.StageConfig)
    trains = kind.config.MODEL is not None
    # A kind that trains a model says how (loss, batch); one that does not, says nothing.
    assert (kind.loss is not None) == trains == (kind.abstract_batch is not None), name
    assert (kind.sampler_sizes is not None) == kind.config.SAMPLES, name


def test_no_kind_branches_outside_the_kind_modules():
  names = '|'.join(kinds.KINDS)
  pattern = re.compile(rf"""\bkind\s*(==|!=)\s*['"]({names})['"]|\bkind\s+(not\s+)?in\s+"""
                       rf"""[(\[{{][^)\]}}]*['"]({names})['"]|RL_KINDS|POLICY_KINDS""")
  offenders = []
  for path in REPO.rglob('*.py'):
    rel = path.relative_to(REPO).as_posix()
    if rel.startswith(('.venv/', 'cascade/kinds/', 'tests/')) or '/.' in rel:
      continue
    for i, line in enumerate(path.read_text(encoding='utf-8').splitlines(), 1):
      if pattern.search(line):
        offenders.append(f'{rel}:{i}: {line.strip()}')
  assert not offenders, offenders


def _stage(raw, earlier=(), domains=('a',)):
  doms = {d: config_lib.Domain(name=d, verifier='math', train=f'{d}_train', eval=f'{d}_train')
          for d in domains}
  ds = {f'{d}_train': config_lib.Dataset(name=f'{d}_train', format='prompt',
                                         record_type='prompt') for d in domains}
  ds['prefs'] = config_lib.Dataset(name='prefs', format='preference', record_type='preference')
  refs = base.Refs(tuple(earlier), tuple(s.name for s in earlier) + (raw['name'],), doms, ds)
  return kinds.parse(len(earlier), raw, refs)


GRPO = dict(name='rl', kind='grpo', domains=['a'], steps=4, optimizer=dict(lr=1e-3),
            prompts_per_step=4, group_size=4, max_prompt_len=8, max_response_len=8)


@pytest.mark.parametrize('field,value,message', [
    ('temperature', float('inf'), 'temperature=inf: must be > 0'),
    ('kl_coef', float('inf'), 'kl_coef=inf: must be >= 0'),
    ('top_p', float('nan'), 'top_p=nan'),
    ('clip_eps_high', -0.1, 'clip_eps_high=-0.1'),
    ('updates_per_batch', 3, 'updates_per_batch=3: must divide prompts_per_step * group_size = 16'),
    ('entropy_coef', 'x', "entropy_coef='x'"),
])
def test_non_finite_and_out_of_range_numbers_are_one_line_errors(field, value, message):
  with pytest.raises(config_lib.ConfigError, match=re.escape(f"stages[0] 'rl': {message}")):
    _stage({**GRPO, field: value})


def test_optimizer_rejects_infinite_learning_rate():
  with pytest.raises(config_lib.ConfigError, match=r"stages\[0\] 'rl': optimizer.lr=inf"):
    _stage({**GRPO, 'optimizer': dict(lr=float('inf'))})


def test_grpo_fields_reach_the_loss_config_and_updates_split_the_batch():
  st = _stage({**GRPO, 'clip_eps_high': 0.28, 'entropy_coef': 0.01, 'updates_per_batch': 2,
               'microbatches': 2})
  loss, cfg = kinds.get('grpo').loss(st)
  assert loss.loss is grpo_lib.loss_fn and isinstance(cfg, loss.config)
  assert cfg.clip_eps_high == 0.28 and cfg.entropy_coef == 0.01
  # The learning-rate schedule spans every update, not every rollout batch.
  assert base.optimizer_config(st).decay_steps == 8
  mesh = jax.make_mesh((1, 1, 1), ('data', 'fsdp', 'tensor'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=jax.devices()[:1])
  batch, what = kinds.get('grpo').abstract_batch(st, mesh, None)
  assert batch.tokens.shape == (8, 16) and '2 updates per rollout batch' in what


def test_dpo_config_checks_its_fields():
  raw = dict(name='d', kind='dpo', domains=['a'], datasets=['prefs'], steps=2, batch_size=4,
             max_len=32, optimizer=dict(lr=1e-3))
  assert _stage(raw).beta == 0.1
  with pytest.raises(config_lib.ConfigError, match=r"stages\[0\] 'd': beta=0.0: must be > 0"):
    _stage({**raw, 'beta': 0.0})
  with pytest.raises(config_lib.ConfigError, match="dataset 'a_train' holds prompt records; a dpo"):
    _stage({**raw, 'datasets': ['a_train']})
  # Label smoothing in [0, 0.5); the mode: None (no switch), or a bool (instruct by default).
  assert _stage({**raw, 'label_smoothing': 0.25}).label_smoothing == 0.25
  for bad in (0.5, -0.1):
    with pytest.raises(config_lib.ConfigError, match=f'label_smoothing={bad}'):
      _stage({**raw, 'label_smoothing': bad})
  assert _stage(raw).thinking is False
  assert _stage({**raw, 'thinking': None}).thinking is None
  assert _stage({**raw, 'thinking': True}).thinking is True
  with pytest.raises(config_lib.ConfigError, match="thinking='yes': must be None"):
    _stage({**raw, 'thinking': 'yes'})


def test_dpo_declares_its_reference_pass_and_its_pair_batch():
  raw = dict(name='d', kind='dpo', domains=['a'], datasets=['prefs'], steps=2, batch_size=8,
             max_len=32, optimizer=dict(lr=1e-3), microbatches=4)
  st = _stage(raw)
  kind = kinds.get('dpo')
  # Both sides of every microbatch go through the frozen reference: 2 calls per microbatch.
  [ref] = kind.frozen_forwards(st)
  assert (ref.name, ref.rows, ref.length, ref.calls, ref.copies) == (
      'reference forward', 2, 32, 8, 1)
  mesh = jax.make_mesh((1, 1, 1), ('data', 'fsdp', 'tensor'), devices=jax.devices()[:1])
  batch, what = kind.abstract_batch(st, mesh, None)
  for side in ('chosen', 'rejected'):
    for f, dt in (('tokens', 'int32'), ('positions', 'int32'), ('segment_ids', 'int32'),
                  ('targets', 'int32'), ('loss_mask', 'float32')):
      x = getattr(batch, f'{side}_{f}')
      assert (x.shape, str(x.dtype)) == ((8, 32), dt), (side, f)
    assert getattr(batch, f'ref_{side}_logps').shape == (8,)
  assert what == '8 pairs x 2 sides x 32 tokens, 4 microbatch(es)'


def test_merge_of_several_updates_averages_and_keeps_the_last_skip_count():
  m = loop._merge([{'loss': 1.0, 'skipped': 0.0}, {'loss': 3.0, 'skipped': 1.0}])  # pylint: disable=protected-access
  assert m == {'loss': 2.0, 'skipped': 1.0, 'updates': 2.0}
  # One update that blew the weights up is the step's (divergence judges the largest).
  ms = [{'update_ratio': 1e37, 'skipped': 0.0}, {'update_ratio': 0.0, 'skipped': 1.0}]
  assert loop._merge(ms)['update_ratio'] == 1e37  # pylint: disable=protected-access


def _load_config(path):
  spec = importlib.util.spec_from_file_location('cfg', path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


@pytest.mark.heavy
def test_dpo_and_ppo_style_grpo_run_inside_a_cascade(tmp_path, copy_cascade):
  """SFT -> DPO (prefers the right copy) -> GRPO with 2 updates per rollout batch."""
  path = copy_cascade(tmp_path, train=64, eval_=32, sft=64, sft_steps=10, rl_steps=2)
  rng = random.Random(1)
  with open(tmp_path / 'prefs.jsonl', 'w') as f:
    for i in range(128):
      a = rng.randint(0, 9)
      wrong = (a + rng.randint(1, 9)) % 10
      f.write(json.dumps({'id': f'p{i}', 'domain': 'copy',
                          'messages': [{'role': 'user', 'content': f'Copy {a}.'}],
                          'chosen': f'\\boxed{{{a}}}', 'rejected': f'\\boxed{{{wrong}}}'}) + '\n')
  c = _load_config(path)
  c.sampler.new_token_buckets = (16,)     # room for '\\boxed{7}<|im_end|>' (10 toy tokens)
  c.eval.max_new_tokens = 12
  c.datasets.prefs = dict(path=str(tmp_path / 'prefs.jsonl'), format='preference', domain='copy')
  rl = dict(c.stages[1])
  rl.update(updates_per_batch=2, clip_eps_high=0.28, prompts_per_step=4)
  c.stages = [c.stages[0],
              dict(name='dpo', kind='dpo', domains=['copy'], datasets=['prefs'], steps=30,
                   batch_size=16, max_len=64, beta=0.5, optimizer=dict(lr=3e-3)),
              rl]
  res = runner.run(c, str(tmp_path / 'run'))
  assert res['stages'] == ['sft', 'dpo', 'copy_rl']
  rows = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')]
  dpo = [r for r in rows if r.get('stage') == 'dpo']
  first, last = dpo[0], dpo[-1]
  # The policy learns to prefer the right copy over the wrong one, relative to the reference.
  assert first['margin'] == pytest.approx(0.0, abs=1e-4)     # step 1: policy == reference
  assert last['margin'] > 1.0 and last['accuracy'] > 0.8, last
  rl_rows = [r for r in rows if r.get('stage') == 'copy_rl']
  assert all(r['updates'] == 2.0 for r in rl_rows)
  progress = json.load(open(tmp_path / 'run' / 'progress.json'))
  assert progress['done']['dpo']['final_step'] == 30


def _fake_rollouts(recs, g, p=3, n=4):
  from cascade import rollout  # pylint: disable=g-import-not-at-top
  from rl import sampler as sampler_lib  # pylint: disable=g-import-not-at-top
  rows = len(recs) * g
  z = lambda *s: np.zeros(s, np.int32)
  samples = sampler_lib.SampleOutput(
      prompt_tokens=z(rows, p) + 1, prompt_mask=z(rows, p) + 1, tokens=z(rows, n) + 2,
      mask=z(rows, n) + 1, logprobs=np.zeros((rows, n), np.float32),
      sampling_logprobs=np.zeros((rows, n), np.float32), lengths=z(rows) + n,
      truncated=np.zeros(rows, bool))
  return rollout.Rollouts(records=[r for r in recs for _ in range(g)], modes=[None] * rows,
                          completions=['x'] * rows, samples=samples)


@pytest.mark.parametrize('bad,stops', [(1, False), (16, True)])
def test_rl_step_stops_when_the_sandbox_itself_fails(monkeypatch, bad, stops):
  import types  # pylint: disable=g-import-not-at-top
  from cascade.kinds import rl  # pylint: disable=g-import-not-at-top
  st = _stage({**GRPO, 'dynamic_filter': False})
  recs = [{'domain': 'a', 'messages': [], 'metadata': {}} for _ in range(4)]
  loader = types.SimpleNamespace(next=lambda: recs)
  monkeypatch.setattr(rl.rollout, 'generate', lambda *a, **k: _fake_rollouts(recs, 4))
  infos = [{'sandbox_error': i < bad} for i in range(16)]
  monkeypatch.setattr(rl.rollout, 'score',
                      lambda ro, v, s: (np.arange(16, dtype=np.float32), infos))
  ctx = types.SimpleNamespace(plan=types.SimpleNamespace(seed=0), sampler=None, tokenizer=None,
                              verifiers=types.SimpleNamespace(train_verifier=None),
                              sample_cls=None, domain_index={'a': 0})
  draws = rl.Draws(ctx, st, loader, 0, jax.random.PRNGKey(0), None)
  if stops:
    with pytest.raises(base.StageError, match=r"stages\[0\] 'rl': step 0: 16 of 16 samples"):
      draws.collect()
  else:
    draws.collect()
    assert draws.metrics()['sandbox_errors'] == 1.0


@pytest.mark.heavy
def test_the_paged_engine_and_packed_updates_run_a_cascade_as_the_defaults_do(tmp_path,
                                                                               copy_cascade):
  """config.sampler.engine='paged' and pack_tokens: the same rollouts, scores and loss."""
  path = copy_cascade(tmp_path, train=16, eval_=16, sft=64, sft_steps=25, rl_steps=1)
  out = {}
  for variant in ('defaults', 'paged_packed'):
    c = _load_config(path)
    c.sampler.new_token_buckets = (16,)
    c.eval.max_new_tokens = 12
    c.eval.num_prompts = 16
    rl = dict(c.stages[1], max_response_len=12, prompts_per_step=4)
    if variant == 'paged_packed':
      c.sampler.update(engine='paged', slots=8, page_size=8, pages=None, chunk_steps=4)
      rl['pack_tokens'] = 32
    c.stages = [c.stages[0], rl]
    res = runner.run(c, str(tmp_path / variant))
    rows = [json.loads(line) for line in open(tmp_path / variant / 'metrics.jsonl')]
    rl_row = [r for r in rows if r.get('stage') == 'copy_rl'][0]
    out[variant] = res['scores'][0], rl_row
  (sft_a, a), (sft_b, b) = out['defaults'], out['paged_packed']
  # The same keys give the same tokens: the same SFT scores and the same first rollouts.
  assert sft_b == sft_a and any(v > 0 for v in sft_a)
  assert (b['reward_mean'], b['response_len']) == (a['reward_mean'], a['response_len'])
  # The packed update's forward gives the padded one's log-probs (mean -log p over the loss
  # tokens; the sampler's to 1e-6: ratio 1), on the same tokens, in fewer token slots.
  assert b['entropy'] == pytest.approx(a['entropy'], rel=1e-5) and a['entropy'] > 0
  assert b['logprob_gap'] < 1e-5 and b['tokens'] == a['tokens'] > 0
  assert b['update_tokens'] <= a['update_tokens'] and b['update_waste'] < a['update_waste']
