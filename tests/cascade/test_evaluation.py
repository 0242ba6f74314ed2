"""The evaluation matrix: scoring (pass@1 over k samples), results.json/md/png, metrics files."""

import dataclasses
import json
import os
import types

import jax
import numpy as np
import pytest

from cascade import config as config_lib
from cascade import evaluation
from cascade import metrics
from cascade import verifier_errors
from rl import sampler as sampler_lib


class CharTokenizer:
  """One id per character (ids = ord), enough for rendering and decoding in a test."""

  vocab_size = 256

  def encode(self, text):
    return [ord(c) % 256 for c in text]

  def decode(self, ids, skip_special=False):
    del skip_special
    return ''.join(chr(i) for i in ids)


class FakeSampler:
  """Answers each prompt's k samples with 'right' or 'wrong' by a fixed per-row pattern."""

  def __init__(self, pattern):
    self.pattern = pattern
    self.calls = []

  def generate(self, params, prompts, rng, sp, num_samples=1):
    del params, rng
    self.calls.append((len(prompts), num_samples, sp))
    rows = []
    for i in range(len(prompts) * num_samples):
      rows.append('right' if self.pattern(len(self.calls), i) else 'wrong')
    n = sp.max_new_tokens
    toks = np.zeros((len(rows), n), np.int32)
    lens = np.array([len(r) for r in rows], np.int32)
    for i, r in enumerate(rows):
      toks[i, :len(r)] = [ord(c) for c in r]
    z = np.zeros((len(rows), n), np.float32)
    return sampler_lib.SampleOutput(prompt_tokens=np.ones((len(rows), 1), np.int32),
                                    prompt_mask=np.ones((len(rows), 1), np.int32),
                                    tokens=toks, mask=(toks > 0).astype(np.int32), logprobs=z,
                                    sampling_logprobs=z, lengths=lens,
                                    truncated=lens >= n)


class ExactVerifier:
  def __init__(self):
    self.seen = []

  def score(self, samples):
    self.seen += samples
    return [types.SimpleNamespace(reward=1.0 if s.completion == s.metadata['answer'] else -1.0,
                                  info={}) for s in samples]


Sample = lambda **kw: types.SimpleNamespace(**kw)


def test_evaluate_is_pass_at_1_over_k_samples_per_domain():
  recs = lambda d, n: [{'id': f'{d}{i}', 'domain': d, 'metadata': {'answer': 'right'},
                        'messages': [{'role': 'user', 'content': f'q{i}'}]} for i in range(n)]
  sets = {'a': recs('a', 5), 'b': recs('b', 3)}
  pattern = lambda call, row: row % 4 == 0          # 1 of every 4 rows is right
  fake = FakeSampler(pattern)
  ver = ExactVerifier()
  ev = config_lib.Eval(num_samples=4, temperature=1.0, top_p=1.0, greedy=False,
                       max_new_tokens=8, max_prompt_len=32, num_prompts=0, batch_size=2,
                       thinking=False)
  out = evaluation.evaluate(fake, None, CharTokenizer(), sets, lambda d: ver, Sample, ev,
                            jax.random.key(0))
  # Rows per call: prompts_in_call * 4; row r right iff r % 4 == 0 -> one right per prompt.
  assert out['a']['score'] == 25.0 and out['a']['samples'] == 20 and out['a']['prompts'] == 5
  assert out['b']['score'] == 25.0
  # The reward -1 counts as a failure (clipped to 0), the raw mean is kept beside it.
  np.testing.assert_allclose(out['a']['mean_reward'], 0.25 * 1 + 0.75 * -1)
  assert [c[:2] for c in fake.calls] == [(2, 4), (2, 4), (1, 4), (2, 4), (1, 4)]
  assert all(s.prompt.endswith('<|im_start|>assistant\n') for s in ver.seen)
  assert '/no_think' not in ver.seen[0].prompt           # verifiers see the mode-free prompt

  ev_greedy = dataclasses.replace(ev, greedy=True)
  fake2 = FakeSampler(lambda call, row: True)
  out = evaluation.evaluate(fake2, None, CharTokenizer(), sets, lambda d: ver, Sample,
                            ev_greedy, jax.random.key(0))
  assert out['a']['score'] == 100.0 and out['a']['samples'] == 5   # greedy: k = 1


def test_an_evaluation_whose_verifier_raises_in_its_own_code_stops():
  """A held-out set scored by a verifier with a bug of its own would read 0.0 in the matrix:
  the evaluation stops instead, naming it (`verifier_errors.VerifierBug`)."""
  class Broken(ExactVerifier):
    def score(self, samples):
      return [types.SimpleNamespace(reward=0.0, info={
          'reason': 'error: KeyError', 'verifier': 'broken',
          'verifier_error': 'KeyError: answr at v.py:3 in _prepare'}) for _ in samples]

  sets = {'a': [{'id': f'a{i}', 'domain': 'a', 'metadata': {'answer': 'right'},
                 'messages': [{'role': 'user', 'content': f'q{i}'}]} for i in range(3)]}
  ev = config_lib.Eval(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=8,
                       max_prompt_len=32, num_prompts=0, batch_size=2, thinking=False)
  with pytest.raises(verifier_errors.VerifierBug, match=r"^evaluation of domain 'a': the verifier "
                                                     r"'broken' of domain 'a' raised in its own "
                                                     r"code on record 'a0'.*4 of 4 samples"):
    evaluation.evaluate(FakeSampler(lambda call, row: True), None, CharTokenizer(), sets,
                        lambda d: Broken(), Sample, ev, jax.random.key(0))


ROWS = [
    {'stage': 'init', 'index': -1, 'domains': [], 'scores': {'math': 10.0, 'code': 20.0}},
    {'stage': 'math_rl', 'index': 0, 'domains': ['math'], 'scores': {'math': 35.5, 'code': 19.0}},
    {'stage': 'code_rl', 'index': 1, 'domains': ['code'], 'scores': {'math': 36.0, 'code': 41.25}},
]


def test_results_json_md_png(tmp_path):
  res = evaluation.write(str(tmp_path), ROWS, ['math', 'code'])
  on_disk = json.loads((tmp_path / 'results.json').read_text())
  assert on_disk == res
  assert set(on_disk) == {'domains', 'stages', 'stage_domains', 'scores'}
  assert on_disk['stages'] == ['init', 'math_rl', 'code_rl']
  assert on_disk['stage_domains'] == [[], ['math'], ['code']]
  assert on_disk['scores'] == [[10.0, 20.0], [35.5, 19.0], [36.0, 41.25]]
  md = (tmp_path / 'results.md').read_text().splitlines()
  assert md[0] == '| stage | trains on | math | code |'
  # A stage's accounting goes in as given; stages without one are left out.
  acc = {'math_rl': {'steps': 3, 'step_s': 9.0, 'decode_waste': 0.5}, 'code_rl': {}}
  res = evaluation.write(str(tmp_path), ROWS, ['math', 'code'], accounting=acc)
  assert json.loads((tmp_path / 'results.json').read_text())['accounting'] == {
      'math_rl': acc['math_rl']}
  assert md[2] == '| init | - | 10.0 | 20.0 |'
  assert md[3] == '| math_rl | math | 35.5 (+25.5) | 19.0 (-1.0) |'
  assert md[4] == '| code_rl | code | 36.0 (+0.5) | 41.2 (+22.2) |'
  png = (tmp_path / 'results.png').read_bytes()
  assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 5000
  assert not [f for f in os.listdir(tmp_path) if '.tmp' in f]


def test_metrics_writer_bar_and_summary(tmp_path):
  stage = types.SimpleNamespace(name='math_rl', index=2, kind='grpo', steps=3)
  w = metrics.Writer(str(tmp_path), enabled=True)
  bar = metrics.StageBar(stage, start_step=0, enabled=True)
  for step, r in enumerate((0.25, 0.5, 0.75)):
    m = {'reward_mean': r, 'response_len': 10 + step, 'step_s': 0.5, 'bad': float('nan'),
         'note': 'text'}
    w.write(stage, step, m)
    bar.update(m)
  w.write_scores('math_rl', 2, {'math': 50.0})
  w.write_scores('code_rl', 3, {'math': 49.0}, validation={'math': 12.5})
  bar.close()
  w.close()
  lines = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert lines[0]['stage'] == 'math_rl' and lines[0]['step'] == 0 and lines[2]['reward_mean'] == 0.75
  assert 'bad' not in lines[0] and 'note' not in lines[0]       # only finite numbers
  assert lines[3]['scores'] == {'math': 50.0} and 'validation' not in lines[3]
  assert lines[4]['validation'] == {'math': 12.5} and lines[4]['eval'] == 'code_rl'
  assert any(f.startswith('events.out.tfevents') for f in os.listdir(tmp_path / 'tb'))
  line = metrics.summary_line(stage, 3, 6.0, bar.first, bar.last, {'math': 50.0, 'code': 9.0},
                              {'math': 40.0, 'code': 10.0})
  assert line == ('[2] math_rl (grpo): 3 steps in 6s (2.00 s/step); reward_mean 0.25 -> 0.75; '
                  'response_len 10 -> 12; math 50.0 (+10.0), code 9.0 (-1.0)')


def _eval(**kw):
  base = dict(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=8,
              max_prompt_len=32, num_prompts=0, batch_size=4, thinking=False)
  return config_lib.Eval(**{**base, **kw})


def test_each_domain_samples_with_its_own_settings_and_both_modes():
  recs = lambda d, n: [{'id': f'{d}{i}', 'domain': d, 'metadata': {'answer': 'right'},
                        'messages': [{'role': 'user', 'content': f'{d} q{i}'}]} for i in range(n)]
  sets = {'a': recs('a', 3), 'b': recs('b', 2)}
  prompts = []

  prepared, given = [], []

  class Recording(FakeSampler):
    def prepare(self, params):     # the rollout copy: made once for every domain and mode
      prepared.append(params)
      return ('copy of', params)

    def generate(self, params, prompts_, rng, sp, num_samples=1):
      given.append(params)
      prompts.extend(''.join(chr(t) for t in p) for p in prompts_)
      return super().generate(params, prompts_, rng, sp, num_samples)

  # Every row right in /think mode, every other row right in /no_think mode.
  fake = Recording(lambda call, row: ' /think<' in prompts[-1] or row % 2 == 0)
  ver = ExactVerifier()
  settings = {'a': _eval(max_new_tokens=8, num_samples=2, thinking='both'),
              'b': _eval(max_new_tokens=5, num_samples=3, thinking=False)}
  out = evaluation.evaluate(fake, None, CharTokenizer(), sets, lambda d: ver, Sample, settings,
                            jax.random.key(0))
  # a: two calls (think, then no_think), each 3 prompts x 2 samples at 8 new tokens; b: one.
  assert [(c[0], c[1], c[2].max_new_tokens) for c in fake.calls] == [(3, 2, 8), (3, 2, 8),
                                                                     (2, 3, 5)]
  assert all(' /think<' in p for p in prompts[:3]) and all('/no_think' in p for p in prompts[3:])
  assert out['a']['modes']['think']['score'] == 100.0
  assert out['a']['modes']['no_think']['score'] == 50.0
  assert out['a']['score'] == 75.0 and out['a']['samples'] == 12 and out['a']['prompts'] == 3
  assert 'modes' not in out['b'] and out['b']['samples'] == 6
  assert out['b']['score'] == 50.0
  assert prepared == [None] and given == [('copy of', None)] * 3


VROWS = [dict(r, validation=v, hf=f'/x/{r["stage"]}',
              details={d: {'modes': {'think': {'score': s + 1}, 'no_think': {'score': s - 1}}}
                       for d, s in r['scores'].items()})
         for r, v in zip(ROWS, [{'math': 30.0, 'code': 5.0}, {'math': 30.0, 'code': 7.0},
                                {'math': 10.0, 'code': 6.0}])]


def test_results_carry_validation_best_policies_and_modes(tmp_path):
  res = evaluation.write(str(tmp_path), VROWS, ['math', 'code'])
  assert res['scores'] == [[10.0, 20.0], [35.5, 19.0], [36.0, 41.25]]
  assert res['validation'] == [[30.0, 5.0], [30.0, 7.0], [10.0, 6.0]]
  # Chosen on validation (ties: the earliest), whatever the held-out scores say.
  assert res['best'] == {'math': {'stage': 'init', 'validation': 30.0, 'held_out': 10.0,
                                  'hf': '/x/init'},
                         'code': {'stage': 'math_rl', 'validation': 7.0, 'held_out': 19.0,
                                  'hf': '/x/math_rl'}}
  assert res['scores_by_mode']['think'] == [[11.0, 21.0], [36.5, 20.0], [37.0, 42.25]]
  assert res['scores_by_mode']['no_think'][0] == [9.0, 19.0]
  md = (tmp_path / 'results.md').read_text()
  assert 'Validation (the selection set):' in md and '| code_rl | code | 10.0 (-20.0) | 6.0 (-1.0) |' in md
  assert 'Held-out, think mode:' in md and 'Held-out, no_think mode:' in md
  assert evaluation.best_on_validation(VROWS, 'code', before=0)['stage'] == 'init'
  assert evaluation.best_on_validation(VROWS, 'code', before=-1) is None
  assert evaluation.best_on_validation(ROWS, 'code') is None       # no validation scores


class KeyedSampler(FakeSampler):
  """Answers like a real sampler: what each row says depends on the call's key (and the row),
  not on how many calls came before; rewards are drawn from {-1, 0.5, 1} the same way."""

  def __init__(self):
    super().__init__(None)
    self.keys = []

  def generate(self, params, prompts, rng, sp, num_samples=1):
    seed = int(np.asarray(jax.random.key_data(rng)).astype(np.uint64).sum() % 9973)
    self.keys.append(seed)
    self.pattern = lambda call, row: (seed + 3 * row) % 5 < 2
    return super().generate(params, prompts, rng, sp, num_samples)


def test_a_stopped_evaluation_goes_on_from_its_batches_and_equals_an_uninterrupted_one():
  recs = lambda d, n: [{'id': f'{d}{i}', 'domain': d, 'metadata': {'answer': 'right'},
                        'messages': [{'role': 'user', 'content': f'{d} q{i}'}]} for i in range(n)]
  sets = {'a': recs('a', 5), 'b': recs('b', 3)}
  settings = {'a': _eval(batch_size=2, thinking='both'), 'b': _eval(batch_size=2)}
  ver = ExactVerifier()
  run = lambda sampler, **kw: evaluation.evaluate(sampler, None, CharTokenizer(), sets,
                                                  lambda d: ver, Sample, settings,
                                                  jax.random.key(0), **kw)
  whole_sampler = KeyedSampler()
  whole = run(whole_sampler)          # a: 3 batches per mode, think then no_think; b: 2
  assert len(whole_sampler.keys) == 8 and 0 < whole['a']['score'] < 100

  # Asked before each batch: the fifth ask (a's no_think batch 2) stops it there.
  asks = iter([None] * 4 + ['SIGTERM'])
  first = KeyedSampler()
  with pytest.raises(evaluation.Stopped) as stopped:
    run(first, stop=lambda: next(asks))
  e = stopped.value
  assert (e.why, e.where) == ('SIGTERM', "domain 'a' (no_think mode) before batch 2/3")
  assert first.keys == whole_sampler.keys[:4]
  kept = json.loads(json.dumps(e.done))              # what a run keeps on disk: plain JSON
  # The rerun samples only the rest and ends where the uninterrupted call did, to the bit.
  second = KeyedSampler()
  reported = []
  out = run(second, done=kept, stop=lambda: None,
            report=lambda i, n, d, res, secs: reported.append(d))
  assert second.keys == whole_sampler.keys[4:] and out == whole and reported == ['a', 'b']
  # Stopped again in the next domain: a is kept whole, b's first batch too.
  asks = iter([None, None, None, 'SIGINT'])
  with pytest.raises(evaluation.Stopped) as stopped:
    run(KeyedSampler(), done=kept, stop=lambda: next(asks))
  assert stopped.value.where == "domain 'b' before batch 2/2"
  third = KeyedSampler()
  assert run(third, done=json.loads(json.dumps(stopped.value.done))) == whole
  assert third.keys == whole_sampler.keys[-1:]
