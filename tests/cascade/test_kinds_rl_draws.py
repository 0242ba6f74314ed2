"""One RL step's sampling rounds (`rl.Draws`): the phase's sampling settings, dynamic filtering
and its refill rounds, the sandbox-error stop, the step's metrics, and the prompt padding of the
train rows.

A stand-in sampler answers each prompt from its own text and a verifier pays each record its own
value (tests/cascade/conftest.py); no model is built, so each test takes well under a second.
"""

import time
import types

import jax
import numpy as np
import pytest
from flax import nnx

from cascade.data import readers
from cascade.kinds import base
from cascade.kinds import rl
from models import config as config_lib
from models import transformer
from rl import filtering
from rl import sampler as sampler_lib


class _SandboxVerifier:
  """Pays each record its value when right (else -1); rows of the records in `broken` report a
  sandbox failure (the sandbox itself failed, not the sample's code) and score 0."""

  def __init__(self, broken=()):
    self.broken = set(broken)

  def score(self, samples):
    out = []
    for s in samples:
      if s.metadata['id'] in self.broken:
        out.append(types.SimpleNamespace(reward=0.0, info={'sandbox_error': 'bwrap failed'}))
      else:
        ok = s.completion == s.metadata['answer']
        out.append(types.SimpleNamespace(reward=s.metadata['value'] if ok else -1.0, info={}))
    return out


def _draws(fakes, stage, sampler, step=0, verifier=None, records=None, domains=('a',)):
  records = records or [fakes.record(d, i, (10 if d == 'a' else 30) + i)
                        for d in domains for i in range(10)]
  plan = fakes.toy_config([stage])
  st = plan.stages[0]
  verifier = verifier or _SandboxVerifier()
  ctx = types.SimpleNamespace(
      plan=plan, sampler=sampler, tokenizer=fakes.CharTokenizer(), sample_cls=fakes.Sample,
      verifiers=types.SimpleNamespace(train_verifier=lambda d: verifier),
      domain_index={d: i for i, d in enumerate(sorted(plan.domains))})
  loader = readers.Loader(records, 0, st.prompts_per_step, shuffle=False)
  return rl.Draws(ctx, st, loader, step, jax.random.key(0), 'params'), st


# ------------------------------------------------------------------ sampling settings

def test_each_step_samples_with_its_phases_length_cap_and_temperature(fakes):
  stage = fakes.rl_stage('rl', ['a'], top_p=0.9, top_k=3, max_response_len=8, phases=[
      dict(until_step=2, max_response_len=4, temperature=0.5), dict(until_step=4)])
  for step, (temp, cap) in ((0, (0.5, 4)), (1, (0.5, 4)), (2, (1.0, 8)), (7, (1.0, 8))):
    sampler = fakes.OwnAnswerSampler()
    draws, st = _draws(fakes, stage, sampler, step=step)
    rows, _ = draws(st.prompts_per_step)
    sp = sampler.calls[0]['sp']
    assert (sp.temperature, sp.max_new_tokens, sp.top_p, sp.top_k) == (temp, cap, 0.9, 3), step
    assert sampler.calls[0]['num_samples'] == st.group_size
    assert sampler.calls[0]['params'] == 'params'
    assert rows['samples'].tokens.shape == (st.prompts_per_step * st.group_size, cap)
    m = draws.metrics()
    assert (m['temperature'], m['max_response_len']) == (temp, cap)


def test_prompts_are_left_padded_to_max_prompt_len_and_a_longer_one_is_refused(fakes):
  recs = [fakes.record('a', i, n) for i, n in enumerate([7, 123, 45, 6])]
  tok = fakes.CharTokenizer()
  longest = max(len(tok.encode(rl.rollout.prompt_text(r, None))) for r in recs)
  draws, st = _draws(fakes, fakes.rl_stage('rl', ['a'], max_prompt_len=longest),
                     fakes.OwnAnswerSampler(), records=recs)
  s = draws(st.prompts_per_step)[0]['samples']
  assert s.prompt_tokens.shape == s.prompt_mask.shape == (8, longest)
  for i in range(8):
    text = rl.rollout.prompt_text(recs[i // 2], None)
    # Right-aligned: the prompt ends where the completion begins.
    assert ''.join(map(chr, s.prompt_tokens[i, longest - len(text):])) == text
    assert s.prompt_mask[i].tolist() == [0] * (longest - len(text)) + [1] * len(text)
    assert not s.prompt_tokens[i, :longest - len(text)].any()
  draws, st = _draws(fakes, fakes.rl_stage('rl', ['a'], max_prompt_len=longest - 1),
                     fakes.OwnAnswerSampler(), records=recs)
  with pytest.raises(ValueError, match=f'prompt of {longest} tokens exceeds max_prompt_len='
                                       f'{longest - 1}'):
    draws(st.prompts_per_step)


# ------------------------------------------------------------------ dynamic filtering

def test_groups_without_signal_are_refilled_up_to_the_refill_cap(fakes):
  """Every sample right: every group's rewards are equal, so the step draws 1 + refill_cap
  rounds and keeps no group (the batch is padded with invalid rows)."""
  for cap in (0, 2):
    sampler = fakes.OwnAnswerSampler()
    draws, st = _draws(fakes, fakes.rl_stage('rl', ['a'], dynamic_filter=True, refill_cap=cap),
                       sampler)
    rows, rewards, valid, fill = draws.collect()
    assert fill == {'prompts_drawn': 4 * (1 + cap), 'rounds': 1 + cap, 'groups_kept': 0}
    assert len(sampler.calls) == 1 + cap
    assert rewards.shape == valid.shape == (8,) and not valid.any()
    assert rows['samples'].tokens.shape[0] == 8


def test_the_rollout_copy_is_made_once_per_step_and_dropped_before_the_update(fakes):
  """Every refill round of a step samples with the one copy `Sampler.prepare` made (the
  weights cast and laid out for rollout); after `collect` the Draws holds the raw params only,
  so the copy's memory is free for the train step."""
  class Preparing(fakes.OwnAnswerSampler):
    prepared = []

    def prepare(self, params):
      self.prepared.append(params)
      return ('copy of', params)

  sampler = Preparing()
  draws, st = _draws(fakes, fakes.rl_stage('rl', ['a'], dynamic_filter=True, refill_cap=2),
                     sampler)
  draws.collect()
  assert sampler.prepared == ['params']
  assert [c['params'] for c in sampler.calls] == [('copy of', 'params')] * 3
  assert draws.params == 'params'


def test_groups_with_signal_are_kept_in_one_round(fakes):
  sampler = fakes.OwnAnswerSampler(right=lambda n, g: g == 0)
  draws, st = _draws(fakes, fakes.rl_stage('rl', ['a'], dynamic_filter=True), sampler)
  rows, rewards, valid, fill = draws.collect()
  assert fill == {'prompts_drawn': 4, 'rounds': 1, 'groups_kept': 4}
  assert valid.all() and len(sampler.calls) == 1
  assert rewards.tolist() == [1.0 + i if g == 0 else -1.0 for i in range(4) for g in range(2)]
  assert rows['domain'].tolist() == [0] * 8


def test_without_dynamic_filtering_one_round_and_every_row_carries_loss(fakes):
  sampler = fakes.OwnAnswerSampler()
  draws, st = _draws(fakes, fakes.rl_stage('rl', ['a'], dynamic_filter=False, refill_cap=3),
                     sampler)
  rows, rewards, valid, fill = draws.collect()
  assert fill == {} and len(sampler.calls) == 1
  assert valid.dtype == bool and valid.all() and valid.shape == (8,)
  assert rewards.tolist() == [1.0 + i for i in range(4) for _ in range(2)]
  assert rows['samples'].tokens.shape[0] == 8


# ------------------------------------------------------------------ sandbox failures

def test_a_tenth_of_samples_failing_in_the_sandbox_is_tolerated_more_stops_the_stage(fakes):
  stage = fakes.rl_stage('rl', ['a'], prompts_per_step=10)          # 20 rows per round
  verifier = _SandboxVerifier(broken={'a0'})
  draws, st = _draws(fakes, stage, fakes.OwnAnswerSampler(), step=3, verifier=verifier)
  draws(10)                                                          # 2 of 20: at the limit
  assert draws.metrics()['sandbox_errors'] == 2.0
  # The step's next round (the loader repeats a0..a9) has two broken records: 6 of 40 in all.
  verifier.broken = {'a0', 'a1'}
  with pytest.raises(base.StageError, match=r"step 3: 6 of 40 samples failed in the sandbox "
                                            r"itself \(sandbox_error\)") as e:
    draws(10)
  assert st.where in str(e.value)
  # Failures that are the sample's own (wrong code, no sandbox_error) never stop the stage.
  wrong = fakes.OwnAnswerSampler(right=lambda n, g: False)
  draws, _ = _draws(fakes, stage, wrong)
  _, rewards = draws(10)
  assert (rewards == -1).all() and draws.metrics()['sandbox_errors'] == 0.0


def test_one_broken_sample_in_a_small_batch_stops_the_stage(fakes):
  draws, _ = _draws(fakes, fakes.rl_stage('rl', ['a']), fakes.OwnAnswerSampler(),
                    verifier=_SandboxVerifier(broken={'a2'}))
  with pytest.raises(base.StageError, match='2 of 8 samples failed in the sandbox'):
    draws(4)


# ------------------------------------------------------------------ the step's metrics

def test_metrics_summarise_every_round_of_the_step(fakes, monkeypatch):
  # Sample 0 right and short, sample 1 rambles to the cap (wrong, truncated).
  sampler = fakes.OwnAnswerSampler(right=lambda n, g: g == 0, ramble=lambda n, g: g == 1)
  clock = iter([10.0, 12.0, 15.0, 20.0, 21.0, 25.0])
  monkeypatch.setattr(rl.time, 'perf_counter', lambda: next(clock))
  draws, st = _draws(fakes, fakes.rl_stage('rl', ['a'], max_response_len=8), sampler)
  draws(4)
  draws(4)
  m = draws.metrics()
  r = np.array([1.0 + i if g == 0 else -1.0 for i in range(8) for g in range(2)])
  assert m['reward_mean'] == pytest.approx(r.mean()) and m['reward_std'] == pytest.approx(r.std())
  lens = [len(str(10 + i)) if g == 0 else 8 for i in range(8) for g in range(2)]
  assert m['response_len'] == pytest.approx(np.mean(lens))
  assert m['truncated_frac'] == 0.5
  # Sampling took 2 + 1 s and scoring 3 + 4 s over the two rounds.
  assert (m['sample_s'], m['score_s']) == (3.0, 7.0)
  assert m['sandbox_errors'] == 0.0
  # One domain: no per-domain split.
  assert not any(k.startswith('reward_mean/') for k in m)


def test_per_domain_reward_means_when_the_step_mixes_domains(fakes):
  recs = [fakes.record('a', 0, 10), fakes.record('b', 0, 30), fakes.record('a', 1, 11),
          fakes.record('b', 1, 31)]
  sampler = fakes.OwnAnswerSampler(answer=lambda n: str(n if n < 30 else n + 1))
  draws, st = _draws(fakes, fakes.rl_stage('rl', ['a', 'b']), sampler, records=recs,
                     domains=('a', 'b'))
  rows, rewards = draws(4)
  assert rows['domain'].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
  m = draws.metrics()
  assert m['reward_mean/a'] == pytest.approx(1.5) and m['reward_mean/b'] == pytest.approx(2.0)
  assert m['reward_mean'] == pytest.approx(1.75)


# ------------------------------------------------------------------ streamed filtering

class _TextVerifier:
  """Records a0, a2, ... pay 1.0 whatever the completion (no signal); the others a value of the
  completion's text (signal unless both samples hash alike). `delay` sleeps a record-dependent
  time per sample, so groups finish scoring in another order than they were handed over."""

  def __init__(self, delay=0.0):
    self.delay = delay

  def score(self, samples):
    out = []
    for s in samples:
      i = int(s.metadata['id'][1:])
      if self.delay:
        time.sleep(self.delay * ((7 * i) % 5))
      r = 1.0 if i % 2 == 0 else float(sum(map(ord, s.completion)) % 5)
      out.append(types.SimpleNamespace(reward=r, info={'i': i}))
    return out


@pytest.fixture(scope='module')
def tiny_policy():
  cfg = config_lib.ModelConfig.tiny()
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  return cfg, graphdef, params


def _paged_sampler(tiny_policy):
  cfg, graphdef, _ = tiny_policy
  return sampler_lib.Sampler(graphdef, cfg, eos_ids=(1,), pad_id=0, engine='paged', slots=6,
                             page_size=8, chunk_steps=3, prompt_buckets=(64,),
                             new_token_buckets=(8,))


def _stream_draws(fakes, tiny_policy, verifier, **kw):
  kw = dict(dict(refill_cap=3), **kw)
  stage = fakes.rl_stage('rl', ['a'], dynamic_filter=True, stream_filter=True,
                         max_prompt_len=64, temperature=1.0, **kw)
  draws, st = _draws(fakes, stage, _paged_sampler(tiny_policy), verifier=verifier,
                     records=[fakes.record('a', i, 10 + i) for i in range(20)])
  draws.params = tiny_policy[2]
  return draws, st


@pytest.mark.heavy
@pytest.mark.parametrize('thread', [True, False], ids=['scoring_thread', 'in_loop'])
def test_streamed_filtering_keeps_what_one_round_of_every_fed_prompt_keeps(fakes, tiny_policy,
                                                                           thread):
  """The streamed batch equals sampling every fed prompt in one call with the step's key,
  scoring it and keeping the first groups with signal (`fill_groups`, one round), whether
  scoring runs on a thread (slow, out of order) or between decode calls."""
  draws, st = _stream_draws(fakes, tiny_policy, _TextVerifier(delay=0.002 if thread else 0))
  draws.SCORE_THREAD = thread
  logged = {}
  draws.log_samples = lambda rows, rewards, valid, drawn_row: logged.update(drawn_row=drawn_row)
  rows, rewards, valid, fill = draws.collect()
  fed = fill['prompts_drawn']
  g = st.group_size
  assert fill['groups_kept'] == st.prompts_per_step and valid.all()
  assert fed % st.prompts_per_step == 0 and fed > st.prompts_per_step, 'half the groups are flat'
  assert fill['rounds'] == fed // st.prompts_per_step
  # The reference: one `generate` over every fed prompt with the stream's key.
  recs = [fakes.record('a', i, 10 + i) for i in range(20)][:fed]
  tok = fakes.CharTokenizer()
  ref = _paged_sampler(tiny_policy).generate(
      tiny_policy[2], [tok.encode(rl.rollout.prompt_text(r, None)) for r in recs],
      jax.random.fold_in(jax.random.key(0), 0), draws.sp, num_samples=g)
  ro = rl.rollout.from_samples(tok, recs, [None] * fed, ref, g)
  ref_rewards, _ = rl.rollout.score(ro, lambda d: _TextVerifier(), fakes.Sample)
  expect = filtering.fill_groups(
      lambda n: (rl._pad_prompts(ref, st.max_prompt_len), ref_rewards),
      st.prompts_per_step, g, max_rounds=1, draw_size=fed)
  for name in ('prompt_tokens', 'tokens', 'mask', 'lengths', 'truncated'):
    np.testing.assert_array_equal(getattr(rows['samples'], name), getattr(expect.rows, name),
                                  err_msg=name)
  np.testing.assert_allclose(rows['samples'].logprobs, expect.rows.logprobs, atol=1e-5)
  np.testing.assert_array_equal(rewards, expect.rewards)
  # Each kept row's logged record is its own (drawn in scoring order, not row order).
  for i in range(len(rewards)):
    rec, _, completion, info = draws.drawn[int(logged['drawn_row'][i])]
    assert completion == tok.decode(rows['samples'].tokens[i, :rows['samples'].lengths[i]])
    assert rewards[i] == (1.0 if info['i'] % 2 == 0 else sum(map(ord, completion)) % 5)
  m = draws.metrics()
  assert m['sample_s'] > 0 and m['score_s'] > 0
  assert fill['rows_cancelled'] + fill['rows_unscored'] == fed * g - len(draws.drawn)
  assert draws.ctx.sampler.pages_in_use == 0


@pytest.mark.heavy
def test_streamed_filtering_pads_at_the_cap_and_needs_the_paged_engine(fakes, tiny_policy):
  class Flat:
    def score(self, samples):
      return [types.SimpleNamespace(reward=0.5, info={}) for _ in samples]

  draws, st = _stream_draws(fakes, tiny_policy, Flat(), refill_cap=1)
  rows, rewards, valid, fill = draws.collect()
  assert (fill['prompts_drawn'], fill['rounds'], fill['groups_kept']) == (8, 2, 0)
  assert fill['rows_cancelled'] == fill['rows_unscored'] == 0
  assert not valid.any() and rewards.shape == (8,)
  stage = fakes.rl_stage('rl', ['a'], dynamic_filter=True, stream_filter=True)
  draws, _ = _draws(fakes, stage, fakes.OwnAnswerSampler())
  with pytest.raises(base.StageError, match="stream_filter needs config.sampler.engine='paged'"):
    draws.collect()
  with pytest.raises(ValueError, match='stream_filter.*needs dynamic_filter=True'):
    fakes.toy_config([fakes.rl_stage('rl', ['a'], stream_filter=True)])
