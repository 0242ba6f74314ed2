"""The RL kinds' wiring around the math: row pairing in a draw, the overlong filter reaching the
loss mask, the KL reference being the stage's starting policy, MOPD rows routed to their
domain's teacher, and the PPO-style split of a rollout batch.

`grpo.run` / `mopd.run` are driven with `loop.train_stage` replaced by a hook that hands back
the kind's batch maker, so a step's train batch is built exactly as in a run, from a stand-in
sampler and verifiers (tests/cascade/conftest.py) and a real `Policies`.
"""

import random
import types

import jax
import numpy as np
import pytest
from flax import nnx

from cascade import policies as policies_lib
from cascade.data import readers
from cascade.kinds import base
from cascade.kinds import grpo
from cascade.kinds import loop
from cascade.kinds import mopd
from cascade.kinds import rl
from models import transformer
from rl import batch as batch_lib


def _records(fakes, domains=('a',), n=8):
  recs = [fakes.record(d, i, (10 if d == 'a' else 30) + i) for d in domains for i in range(n)]
  random.Random(0).shuffle(recs)
  return recs


def _ctx(fakes, plan, tmp_path, records, sampler=None, progress_rows=()):
  vs = {d: fakes.ValueVerifier(d) for d in plan.domains}
  return types.SimpleNamespace(
      plan=plan, workdir=str(tmp_path), mesh=None, rules=plan.rules,
      sampler=sampler or fakes.OwnAnswerSampler(answer=lambda n: str(n if n < 30 else n + 1)),
      tokenizer=fakes.CharTokenizer(), sample_cls=fakes.Sample,
      verifiers=types.SimpleNamespace(train_verifier=vs.__getitem__),
      domain_index={d: i for i, d in enumerate(sorted(plan.domains))},
      data=types.SimpleNamespace(stage_records=lambda st: records),
      policies=policies_lib.Policies(plan, str(tmp_path), None, plan.rules),
      progress=types.SimpleNamespace(rows=list(progress_rows)))


def _maker(monkeypatch, kind_mod, ctx, stage):
  """The kind's BatchMaker, built as its runner builds it (the training loop is not run)."""
  got = []
  monkeypatch.setattr(
      loop, 'train_stage',
      lambda ctx, kind, st, maker_fn: got.append(maker_fn(None)) or base.StageResult())
  kind_mod.run(ctx, stage)
  return got[0]


def _params(plan, seed):
  return nnx.split(transformer.create(plan.model, seed))[1]


def _prompt_text(row_tokens, row_mask):
  return ''.join(chr(t) for t, m in zip(row_tokens, row_mask) if m)


# ------------------------------------------------------------------ a draw keeps rows paired

def test_a_draw_pairs_each_rows_prompt_completion_domain_and_reward(fakes, tmp_path):
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a', 'b'], thinking_fraction=0.5)])
  st = plan.stages[0]
  recs = _records(fakes, ('a', 'b'))
  ctx = _ctx(fakes, plan, tmp_path, recs,
             fakes.OwnAnswerSampler(answer=lambda n: str(n if n < 30 else n + 1),
                                    right=lambda n, g: (n + g) % 3 != 0))
  loader = readers.Loader(recs, 0, st.prompts_per_step)
  draws = rl.Draws(ctx, st, loader, 0, jax.random.key(0), None)
  by_id = {}
  for _ in range(3):
    rows, rewards = draws(st.prompts_per_step)
    s = rows['samples']
    assert s.prompt_tokens.shape[1] == st.max_prompt_len          # left-padded to the stage's
    for i in range(len(rewards)):
      prompt = _prompt_text(s.prompt_tokens[i], s.prompt_mask[i])
      [rec] = [r for r in recs if f"user\n{r['messages'][0]['content']}" in prompt]
      completion = ''.join(chr(t) for t in s.tokens[i, :s.lengths[i]])
      right = completion == rec['metadata']['answer']
      assert rewards[i] == (rec['metadata']['value'] if right else -1.0), (i, prompt, completion)
      assert rows['domain'][i] == ctx.domain_index[rec['domain']]
      by_id[rec['id']] = rec
  # Both domains and both outcomes were exercised; the metrics split by domain.
  m = draws.metrics()
  assert {r['domain'] for r in by_id.values()} == {'a', 'b'}
  assert 'reward_mean/a' in m and 'reward_mean/b' in m
  r = np.concatenate(draws.rewards)
  assert (r == -1).any() and (r > 0).any()
  doms = np.array(draws.domains)
  for d in ('a', 'b'):
    assert m[f'reward_mean/{d}'] == pytest.approx(float(np.mean(r[doms == d])))
  assert m['reward_mean/a'] != m['reward_mean/b']


# ------------------------------------------------------------------ overlong filter

@pytest.mark.parametrize('how', ['stage', 'phase'])
def test_overlong_filter_takes_truncated_rows_out_of_the_loss(fakes, tmp_path, monkeypatch, how):
  extra = (dict(filter_overlong=True) if how == 'stage' else
           dict(phases=[dict(until_step=2, filter_overlong=True), dict(until_step=4)]))
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a'], **extra)])
  st = plan.stages[0]
  # Sample 0 of each prompt is right; sample 1 rambles to the length cap (truncated, wrong).
  sampler = fakes.OwnAnswerSampler(right=lambda n, g: g == 0, ramble=lambda n, g: g == 1)
  ctx = _ctx(fakes, plan, tmp_path, _records(fakes), sampler)
  maker = _maker(monkeypatch, grpo, ctx, st)
  state = types.SimpleNamespace(params=None)
  [batch], host = maker.make(0, jax.random.key(0), state)
  per_row = batch.loss_mask.sum(1)
  assert batch.truncated.tolist() == [False, True] * st.prompts_per_step
  assert (per_row[batch.truncated] == 0).all() and (per_row[~batch.truncated] > 0).all()
  assert host['rows_with_loss'] == 0.5
  # Without the filter (a later phase, or the same rows with the filter off) they carry loss.
  later = 2 if how == 'phase' else None
  if later is None:
    plan2 = fakes.toy_config([fakes.rl_stage('rl', ['a'])])
    maker = _maker(monkeypatch, grpo, _ctx(fakes, plan2, tmp_path, _records(fakes), sampler),
                   plan2.stages[0])
    later = 0
  [batch2], host2 = maker.make(later, jax.random.key(0), state)
  assert (batch2.loss_mask.sum(1) > 0).all() and host2['rows_with_loss'] == 1.0
  assert batch2.loss_mask.sum() > batch.loss_mask.sum()


def test_loss_valid_only_in_a_filtering_phase(fakes):
  plan = fakes.toy_config([fakes.rl_stage(
      'rl', ['a'], phases=[dict(until_step=1, filter_overlong=True), dict(until_step=3),
                           dict(until_step=4, filter_overlong=True), dict(until_step=5)])])
  st = plan.stages[0]
  rows = {'samples': types.SimpleNamespace(truncated=np.array([True, False, True, False]))}
  valid = np.array([True, True, False, False])
  want_filtered = [False, True, False, False]
  # Past the last phase, the last phase holds (not the first).
  for step, filtered in ((0, True), (1, False), (2, False), (3, True), (4, False), (9, False)):
    got = rl.loss_valid(st, step, rows, valid)
    assert got.tolist() == (want_filtered if filtered else valid.tolist()), step


# ------------------------------------------------------------------ the KL reference

@pytest.mark.parametrize('on_host', [False, True], ids=['resident', 'on_host'])
def test_kl_reference_is_the_stages_starting_policy(fakes, tmp_path, monkeypatch, on_host):
  """The reference is the policy the stage starts from, with `reference_on_host` kept in
  pinned host memory and on the devices only for its pass (the same log-probs)."""
  plan = fakes.toy_config([fakes.SFT_STAGE, fakes.rl_stage('rl', ['a'], kl_coef=0.1,
                                                           reference_on_host=on_host)])
  st = plan.stages[1]
  ctx = _ctx(fakes, plan, tmp_path, _records(fakes))
  start, current = _params(plan, 11), _params(plan, 12)
  ctx.policies.remember(('stage', 'sft'), start)     # the policy the SFT stage left
  moves, passes = [], []
  to_memory, compute = grpo.distill.to_memory, batch_lib.compute_logprobs
  memory = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
  monkeypatch.setattr(grpo.distill, 'to_memory', lambda p, kind: (
      moves.append((memory(p), kind)) or to_memory(p, kind)))
  monkeypatch.setattr(batch_lib, 'compute_logprobs', lambda g, p, *a, **kw: (
      passes.append(memory(p)) or compute(g, p, *a, **kw)))
  maker = _maker(monkeypatch, grpo, ctx, st)
  [batch], _ = maker.make(0, jax.random.key(0), types.SimpleNamespace(params=current))
  assert passes == [{'device'}]
  held = 'pinned_host' if on_host else 'device'
  assert moves == ([({'device'}, 'pinned_host')] if on_host else []) + [({held}, 'device')]
  graphdef = ctx.policies.graphdef('policy')
  lp = lambda p: np.asarray(batch_lib.compute_logprobs(graphdef, p, batch)) * batch.loss_mask
  assert batch.ref_logprobs is not None
  np.testing.assert_allclose(batch.ref_logprobs * batch.loss_mask, lp(start), atol=1e-5)
  # Not the policy being trained, nor the cascade's initial one.
  for other in (current, _params(plan, plan.seed)):
    assert np.abs(lp(other) - lp(start)).max() > 1e-2


def test_reference_forwards_and_packed_rows_follow_the_microbatches_and_shards(
    fakes, tmp_path, monkeypatch):
  """The KL reference runs in calls of one microbatch's rows (its memory bound), and packed
  row counts are a multiple of a padded microbatch's rows (8 rows / 2 = 4, the train step's
  `microbatch_rows`) and of the batch shards (3): lcm 12, each microbatch splits evenly."""
  plan = fakes.toy_config([fakes.SFT_STAGE, fakes.rl_stage(
      'rl', ['a'], kl_coef=0.1, microbatches=2, pack_tokens=64)])
  st = plan.stages[1]                            # 4 prompts x 2 samples = 8 rows
  ctx = _ctx(fakes, plan, tmp_path, _records(fakes))
  ctx.batch_shards = 3
  ctx.policies.remember(('stage', 'sft'), _params(plan, 11))
  calls = {'ref': [], 'pack': []}
  compute, pack = batch_lib.compute_logprobs, batch_lib.pack
  monkeypatch.setattr(batch_lib, 'compute_logprobs', lambda *a, **kw: (
      calls['ref'].append(kw.get('rows_per_call')) or compute(*a, **kw)))
  monkeypatch.setattr(batch_lib, 'pack', lambda b, n, rows_multiple=1: (
      calls['pack'].append((n, rows_multiple)) or pack(b, n, rows_multiple=rows_multiple)))
  maker = _maker(monkeypatch, grpo, ctx, st)
  [batch], _ = maker.make(0, jax.random.key(0), types.SimpleNamespace(params=_params(plan, 12)))
  assert calls == {'ref': [4], 'pack': [(64, 12)]}
  assert batch.tokens.shape[0] % 12 == 0
  assert st.microbatch_rows == 4


def test_no_kl_term_no_reference(fakes, tmp_path, monkeypatch):
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a'])])
  ctx = _ctx(fakes, plan, tmp_path, _records(fakes))
  ctx.policies.start_params = lambda st: pytest.fail('loaded a reference without a KL term')
  maker = _maker(monkeypatch, grpo, ctx, plan.stages[0])
  [batch], _ = maker.make(0, jax.random.key(0), types.SimpleNamespace(params=None))
  assert batch.ref_logprobs is None


# ------------------------------------------------------------------ MOPD teachers

MOPD_STAGES = lambda fakes, teachers: [
    fakes.SFT_STAGE, fakes.rl_stage('a_rl', ['a']), fakes.rl_stage('b_rl', ['b']),
    dict(name='mopd', kind='mopd', domains=['a', 'b'], teachers=teachers, steps=2,
         optimizer=dict(lr=1e-4), prompts_per_step=4, group_size=2, max_prompt_len=100,
         max_response_len=8)]
# On validation, a: sft and b_rl tie at 50 (the earliest wins), b: a_rl is best. The held-out
# scores would choose otherwise (a: b_rl, b: b_rl): 'best' must not select on them.
ROWS = [{'stage': 'sft', 'index': 0, 'scores': {'a': 10.0, 'b': 10.0},
         'validation': {'a': 50.0, 'b': 10.0}},
        {'stage': 'a_rl', 'index': 1, 'scores': {'a': 20.0, 'b': 20.0},
         'validation': {'a': 20.0, 'b': 40.0}},
        {'stage': 'b_rl', 'index': 2, 'scores': {'a': 90.0, 'b': 90.0},
         'validation': {'a': 50.0, 'b': 30.0}}]


@pytest.mark.parametrize('teachers,want', [
    (''.join(['be', 'st']), {'a': 'sft', 'b': 'a_rl'}),     # compared by value, not identity
    ({'a': 'a_rl', 'b': 'b_rl'}, {'a': 'a_rl', 'b': 'b_rl'}),
])
def test_mopd_routes_each_row_to_its_domains_teacher(fakes, tmp_path, monkeypatch, teachers,
                                                     want):
  plan = fakes.toy_config(MOPD_STAGES(fakes, teachers), validation=True)
  st = plan.stages[3]
  ctx = _ctx(fakes, plan, tmp_path, _records(fakes, ('a', 'b')), progress_rows=ROWS)
  params = {name: _params(plan, 20 + i) for i, name in enumerate(('sft', 'a_rl', 'b_rl'))}
  ctx.policies.final_state = lambda s: types.SimpleNamespace(params=params[s.name])
  chosen = mopd.choose_teachers(ctx, st)
  assert {d: src for d, (src, _) in chosen.items()} == {d: ('stage', n) for d, n in want.items()}
  maker = _maker(monkeypatch, mopd, ctx, st)
  graphdef = ctx.policies.graphdef('policy')
  seen = set()
  for step in range(3):
    [batch], _ = maker.make(step, jax.random.key(step), types.SimpleNamespace(params=None))
    full = {n: np.asarray(batch_lib.compute_logprobs(graphdef, p, batch)) * batch.loss_mask
            for n, p in params.items()}
    for i in range(batch.tokens.shape[0]):
      prompt = ''.join(chr(t) for t in batch.tokens[i] if t)
      d = 'a' if 'Copy' in prompt else 'b'
      seen.add(d)
      np.testing.assert_allclose(batch.teacher_logprobs[i], full[want[d]][i], atol=1e-5,
                                 err_msg=f'row {i} ({d})')
      others = [n for n in params if n != want[d]]
      assert all(np.abs(full[n][i] - full[want[d]][i]).max() > 1e-3 for n in others)
  assert seen == {'a', 'b'}


def test_mopd_best_teacher_needs_an_evaluated_earlier_policy(fakes, tmp_path):
  plan = fakes.toy_config(MOPD_STAGES(fakes, 'best'), validation=True)
  rows = [{'stage': 'sft', 'index': 0, 'scores': {'a': 1.0, 'b': 1.0},
           'validation': {'a': 1.0}},
          # A later stage's row is no teacher candidate.
          {'stage': 'mopd', 'index': 3, 'scores': {'b': 9.0}, 'validation': {'b': 9.0}}]
  ctx = _ctx(fakes, plan, tmp_path, [], progress_rows=rows)
  with pytest.raises(base.StageError, match="no earlier policy has a validation score of 'b'"):
    mopd.choose_teachers(ctx, plan.stages[3])


# ------------------------------------------------------------------ PPO-style updates

def test_split_updates_partitions_the_rollout_batch(fakes):
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a'], updates_per_batch=4, prompts_per_step=4,
                                          group_size=2)])
  st = plan.stages[0]
  b = 8
  batch = batch_lib.TrainBatch(tokens=np.arange(b * 3).reshape(b, 3), positions=None,
                               segment_ids=None, targets=None, loss_mask=np.ones((b, 3)),
                               advantages=np.arange(b, dtype=np.float32))
  parts = rl.split_updates(st, 1, 0, batch)
  assert len(parts) == 4 and all(p.tokens.shape == (2, 3) for p in parts)
  rows = np.concatenate([p.advantages for p in parts])
  assert sorted(rows.tolist()) == list(range(b))                  # each row exactly once
  for p in parts:                                                 # rows keep their fields
    np.testing.assert_array_equal(p.tokens[:, 0], p.advantages * 3)
  again = rl.split_updates(st, 1, 0, batch)
  assert all((p.advantages == q.advantages).all() for p, q in zip(parts, again))
  other = rl.split_updates(st, 2, 0, batch)
  assert any((p.advantages != q.advantages).any() for p, q in zip(parts, other))
  one = fakes.toy_config([fakes.rl_stage('rl', ['a'])]).stages[0]
  assert rl.split_updates(one, 1, 0, batch) == [batch]


# ------------------------------------------------------------------ accounting

def test_a_steps_accounting_measures_decode_and_update_padding(fakes, tmp_path, monkeypatch):
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a'])])
  st = plan.stages[0]
  inner = fakes.OwnAnswerSampler(ramble=lambda n, g: g == 1)   # sample 1 fills the cap

  class Counting:
    pad_id = 0
    decode_slots = generated_tokens = 0

    def generate(self, *args, **kw):
      out = inner.generate(*args, **kw)
      self.decode_slots += out.tokens.shape[0] * int(out.lengths.max())
      self.generated_tokens += int(out.lengths.sum())
      return out

  ctx = _ctx(fakes, plan, tmp_path, _records(fakes), Counting())
  maker = _maker(monkeypatch, grpo, ctx, st)
  [batch], host = maker.make(0, jax.random.key(0), types.SimpleNamespace(params=None))
  lens = batch.loss_mask.sum(1)        # completion tokens per row (every row carries loss here)
  cap = st.max_response_len
  assert host['decode_slots'] == len(lens) * cap and host['generated_tokens'] == lens.sum()
  assert host['decode_waste'] == pytest.approx(1 - lens.sum() / (len(lens) * cap))
  assert host['sample_idle_s'] == pytest.approx(host['sample_s'] * host['decode_waste'])
  real = (batch.segment_ids > 0).sum()
  assert host['update_tokens'] == real and host['update_slots'] == batch.segment_ids.size
  assert host['update_waste'] == pytest.approx(1 - real / batch.segment_ids.size)


def test_stage_accounting_sums_steps_and_splits_their_time():
  totals = {'step_s': 10.0, 'sample_s': 6.0, 'score_s': 2.0, 'update_s': 1.5,
            'decode_slots': 400.0, 'generated_tokens': 100.0, 'update_tokens': 30.0,
            'update_slots': 120.0}
  acc = loop.accounting(totals, 4)
  assert acc['steps'] == 4 and acc['other_s'] == pytest.approx(0.5)
  assert acc['verifier_share'] == pytest.approx(0.2) and acc['decode_waste'] == pytest.approx(0.75)
  assert acc['update_waste'] == pytest.approx(0.75)
  assert loop.accounting({}, 0) == {}
