"""A verifier's own bug stops the run (`cascade.verifier_set`): the count over a stage's batches
and its thresholds, the dry run before the first step, and the one line a run ends with; a
sample that fails (hostile text, a wrong answer) never stops anything."""

import os
import subprocess
import sys
import types

import jax
import ml_collections
import pytest

from cascade import config as config_lib
from cascade import verifier_errors
from cascade import verifier_set
from cascade.data import readers
from cascade.kinds import rl
import verifiers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Misnamed(verifiers.Verifier):
  """Reads metadata['answr'], a field no record has: it raises whatever the answer."""
  name = 'misnamed_test'

  def _prepare(self, sample, answer):
    return verifiers.Result(float(answer == sample.metadata['answr']), {'reason': 'checked'})


class Fragile(verifiers.Verifier):
  """Raises on an answer that starts with '{' (a parser hostile text can trip), else pays 1 for
  the record's answer."""
  name = 'fragile_test'

  def _prepare(self, sample, answer):
    if answer.startswith('{'):
      raise ValueError('cannot parse')
    return verifiers.Result(float(answer == sample.metadata['answer']), {'reason': 'checked'})


for _cls in (Misnamed, Fragile):
  if _cls.name not in verifiers.names():
    verifiers.register(_cls.name, _cls)


def _infos(n, bad=()):
  return [{'reason': 'x', **({'verifier_error': 'KeyError: answr at v.py:3 in _prepare',
                              'verifier': 'v'} if i in bad else {})} for i in range(n)]


def _recs(n):
  return [{'id': f'r{i}', 'domain': 'a'} for i in range(n)]


def test_one_own_error_in_the_first_batch_stops_later_ones_past_one_percent():
  errors = verifier_errors.VerifierErrors("stages[1] 'rl'")
  with pytest.raises(verifier_errors.VerifierBug) as e:
    errors.count(_recs(16), _infos(16, bad={5}))
  assert str(e.value) == (
      "stages[1] 'rl': the verifier 'v' of domain 'a' raised in its own code on record 'r5', "
      'whatever the answer: KeyError: answr at v.py:3 in _prepare (1 of 16 samples in the first '
      'scored batch); fix it and rerun the same command: the run resumes from its last checkpoint')
  errors = verifier_errors.VerifierErrors('x')
  errors.count(_recs(100), _infos(100))                       # a clean first batch
  errors.count(_recs(100), _infos(100, bad={7, 8}))            # 2 of 200: at 1 %
  assert errors.errors == 2
  errors.count(_recs(100), _infos(100, bad={9}))               # 3 of 300: at 1 %
  with pytest.raises(verifier_errors.VerifierBug, match=r'step 4: .* on record .r1., .*5 of 400 '
                                                     r'samples so far'):
    errors.count(_recs(100), _infos(100, bad={1, 2}), where='step 4')


def _plan(verifier):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = dict(preset='tiny', overrides=dict(max_seq_len=128, vocab_size=320))
  c.tokenizer = dict(path='/tmp/tok.model')
  c.mesh = dict(shape=None)
  c.sampler = dict()
  c.ckpt = dict(every_n_steps=2, keep=2)
  c.eval = dict(num_samples=1, temperature=1.0, top_p=1.0, max_new_tokens=8, max_prompt_len=64,
                num_prompts=4, batch_size=4)
  c.datasets = dict(a_train=dict(path='/a.jsonl', format='prompt', domain='a'),
                    a_eval=dict(path='/a_eval.jsonl', format='prompt', domain='a'))
  c.domains = dict(a=dict(verifier=verifier, verifier_options=dict(workers=1),
                          eval_verifier=Fragile.name, eval_verifier_options=dict(workers=1),
                          train='a_train', eval='a_eval'))
  c.stages = [dict(name='rl', kind='grpo', domains=['a'], steps=2, optimizer=dict(lr=1e-3),
                   prompts_per_step=2, group_size=2, max_prompt_len=64, max_response_len=8)]
  return config_lib.validate(c, known_verifiers=[Misnamed.name, Fragile.name],
                             known_formats={'prompt': 'prompt'})


def _record(i):
  return {'id': f'a{i}', 'domain': 'a', 'messages': [{'role': 'user', 'content': f'Copy {i}.'}],
          'metadata': {'answer': str(i)}}


def test_the_dry_run_stops_a_verifier_that_raises_in_its_own_code():
  vs = verifier_set.VerifierSet(_plan(Misnamed.name), rm_scorer=None, rm_ready=lambda n: False)
  try:
    with pytest.raises(verifier_errors.VerifierBug) as e:
      vs.dry_run({'a': [_record(i) for i in range(5)]})
  finally:
    vs.close()
  msg = str(e.value)
  assert msg.startswith("before the first step (dry run of the probe answers): the verifier "
                        "'misnamed_test' of domain 'a' raised in its own code on record 'a0', "
                        'whatever the answer: KeyError: answr at '
                        'tests/cascade/test_verifier_set.py:')
  assert ' in _prepare (on 2 record(s) x 2 probe answers)' in msg and '\n' not in msg


def test_the_dry_run_passes_verifiers_that_only_fail_on_some_answers():
  # Fragile raises on some answers, not on the probes: no error of its own.
  vs = verifier_set.VerifierSet(_plan(Fragile.name), rm_scorer=None, rm_ready=lambda n: False)
  try:
    vs.dry_run({'a': [_record(i) for i in range(5)]})
  finally:
    vs.close()


class _Sampler:
  """Answers every prompt `text` (G rows each), like rl.sampler's SampleOutput."""

  def __init__(self, text):
    self.text = text

  def generate(self, params, prompts, rng, sp, num_samples=1):
    import numpy as np  # pylint: disable=g-import-not-at-top
    from rl import sampler as sampler_lib  # pylint: disable=g-import-not-at-top
    b, n = len(prompts) * num_samples, sp.max_new_tokens
    toks = np.zeros((b, n), np.int32)
    toks[:, :len(self.text)] = [ord(c) for c in self.text]
    lens = np.full(b, len(self.text), np.int32)
    p = max(len(x) for x in prompts)
    z = np.zeros((b, n), np.float32)
    return sampler_lib.SampleOutput(
        prompt_tokens=np.ones((b, p), np.int32), prompt_mask=np.ones((b, p), np.int32),
        tokens=toks, mask=(np.arange(n)[None] < lens[:, None]).astype(np.int32), logprobs=z,
        sampling_logprobs=z, lengths=lens, truncated=np.zeros(b, bool))


def _draws(fakes, verifier_name, text, step=0, errors=None):
  plan = _plan(verifier_name)
  st = plan.stages[0]
  v = verifiers.get(verifier_name, workers=1)
  ctx = types.SimpleNamespace(
      plan=plan, sampler=_Sampler(text), tokenizer=fakes.CharTokenizer(),
      sample_cls=verifiers.Sample, verifiers=types.SimpleNamespace(train_verifier=lambda d: v),
      domain_index={'a': 0})
  loader = readers.Loader([_record(i) for i in range(8)], 0, st.prompts_per_step, shuffle=False)
  return rl.Draws(ctx, st, loader, step, jax.random.key(0), 'params', errors), st


def test_a_training_step_stops_at_its_verifiers_own_bug_and_never_at_hostile_text(fakes):
  draws, st = _draws(fakes, Misnamed.name, '3')
  with pytest.raises(verifier_errors.VerifierBug, match=r"^stages\[0\] 'rl': step 1: the verifier "
                                                     r"'misnamed_test' of domain 'a' raised in its "
                                                     r"own code on record 'a0'.*4 of 4 samples"):
    draws(2)
  # A parser that hostile text trips scores those samples 0, step after step: no stop.
  errors = verifier_errors.VerifierErrors(st.where)
  for step in range(3):
    draws, _ = _draws(fakes, Fragile.name, '{x: 1}', step=step, errors=errors)
    _, rewards = draws(2)
    assert rewards.tolist() == [0.0] * 4
    assert draws.metrics()['verifier_errors'] == 0.0
  assert errors.scored == 12 and errors.errors == 0


@pytest.mark.heavy
def test_a_run_whose_verifier_raises_in_its_own_code_ends_with_one_line(tmp_path, copy_cascade,
                                                                        derived_config):
  """The command line: the toy cascade scored by a verifier with a bug of its own stops before
  its first step, exit 2, one line naming the verifier, the domain, the record and the line."""
  copy_cascade(tmp_path, train=8, eval_=4, sft=8)
  (tmp_path / 'misnamed.py').write_text(
      'import verifiers\n\n'
      'class Misnamed(verifiers.Verifier):\n'
      "  name = 'misnamed'\n\n"
      '  def _prepare(self, sample, answer):\n'
      "    return verifiers.Result(float(answer == sample.metadata['answr']), {'reason': 'x'})\n\n"
      "verifiers.register('misnamed', Misnamed)\n")
  (tmp_path / 'bad.py').write_text(derived_config(
      "  c.domains.copy.verifier = 'misnamed'\n  c.domains.copy.verifier_options = {}\n",
      imports='import sys\nsys.path.insert(0, os.path.dirname(__file__))\nimport misnamed\n'))
  proc = subprocess.run([sys.executable, '-m', 'cascade.main', f'--config={tmp_path}/bad.py',
                         f'--workdir={tmp_path}/run'], cwd=REPO, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith("error: before the first step (dry run of the probe answers): the "
                             "verifier 'misnamed' of domain 'copy' raised in its own code on "
                             "record 'eval-0', whatever the answer: KeyError: answr at "), lines[0]
  assert "misnamed.py:7 in _prepare" in lines[0]
  assert not os.path.exists(tmp_path / 'run' / 'stages')        # nothing trained
