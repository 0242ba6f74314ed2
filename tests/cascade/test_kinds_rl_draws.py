"""One RL step's sampling rounds (`rl.Draws`): the phase's sampling settings, dynamic filtering
and its refill rounds, the sandbox-error stop, the step's metrics, and the prompt padding of the
train rows.

A stand-in sampler answers each prompt from its own text and a verifier pays each record its own
value (tests/cascade/conftest.py); no model is built, so each test takes well under a second.
"""

import types

import jax
import numpy as np
import pytest

from cascade import data as data_lib
from cascade.kinds import base
from cascade.kinds import rl


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
  env = types.SimpleNamespace(
      plan=plan, sampler=sampler, tokenizer=fakes.CharTokenizer(), sample_cls=fakes.Sample,
      verifiers=types.SimpleNamespace(train_verifier=lambda d: verifier),
      domain_index={d: i for i, d in enumerate(sorted(plan.domains))})
  loader = data_lib.Loader(records, 0, st.prompts_per_step, shuffle=False)
  return rl.Draws(env, st, loader, step, jax.random.key(0), 'params'), st


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
