"""The common verifier interface: registry, metadata validation, thinking, errors, lifecycle."""

import gc
import sys

import psutil
import pytest

import verifiers
from verifiers import base

S = verifiers.Sample


class _Echo(base.Verifier):
  """Its worker is json.loads: the answer text is the worker's reply."""
  name = 'echo'
  worker_fn = 'json:loads'

  def _prepare(self, sample, answer):
    if answer == 'raise':
      raise RuntimeError('prepare failed')
    return answer


def test_registry_lists_every_domain_and_rejects_unknown_names():
  assert set(verifiers.names()) >= {'math', 'instruction_following', 'code', 'swe', 'structured',
                                    'reward_model'}
  with pytest.raises(ValueError, match="unknown verifier 'nope'"):
    verifiers.get('nope')
  with pytest.raises(TypeError):
    verifiers.get('structured', no_such_option=1)


def test_register_a_custom_verifier():
  verifiers.register('echo_test', _Echo)
  with pytest.raises(ValueError, match='already registered'):
    verifiers.register('echo_test', _Echo)
  with pytest.raises(ValueError, match='not a Verifier subclass'):
    verifiers.register('bad_test', dict)
  with verifiers.get('echo_test', workers=1) as v:
    r = v.score([S('p', '{"reward": 0.25, "info": {"reason": "because"}}')])
  assert r == [verifiers.Result(0.25, {'reason': 'because'})]


def test_importing_verifiers_does_not_import_jax_or_sympy():
  import subprocess  # pylint: disable=g-import-not-at-top
  code = ('import sys, verifiers; verifiers.get("structured").close(); '
          'print(sorted(m for m in ("jax", "sympy", "math_verify") if m in sys.modules))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       env={'PYTHONPATH': base.PACKAGE_PARENT}, check=True).stdout
  assert out.strip() == '[]'


@pytest.mark.parametrize('name, metadata, match', [
    ('math', {}, r"data/m\.jsonl:17: metadata\['answer'\] is missing"),
    ('math', {'answer': True}, r"data/m\.jsonl:17: metadata\['answer'\] must be"),
    ('structured', {'schema': {'type': 'nonsense'}}, r'data/m\.jsonl:17: .*not a valid JSON Schema'),
    ('code', {'prompt': 'x'}, r"data/m\.jsonl:17: metadata\['test'\] is missing"),
    ('code', {}, r"data/m\.jsonl:17: metadata\['prompt'\] is missing \(HumanEval record\)"),
    ('code', {'inputs': ['1'], 'outputs': []}, r'data/m\.jsonl:17: .*equally long'),
    ('code', {'entry_point': 'f(x)', 'prompt': '', 'test': ''}, r'identifier'),
    ('swe', {'gold_patch': 'not a diff'}, r'data/m\.jsonl:17: .*not a parsable diff'),
    ('instruction_following', {'instruction_id_list': ['punctuation:no_comma'], 'kwargs': []},
     r'data/m\.jsonl:17: .*0 entries for 1 instructions'),
    ('instruction_following', {'instruction_id_list': ['length_constraints:number_words'],
                               'kwargs': [{'num_words': 5}]},
     r"data/m\.jsonl:17: instruction 0: .*kwarg 'relation' is missing"),
])
def test_validate_names_the_record_and_field(name, metadata, match):
  with pytest.raises(ValueError, match=match):
    verifiers.validate(name, metadata, 'data/m.jsonl:17')


def test_validate_accepts_good_records_and_uses_options():
  verifiers.validate('math', {'answer': '\\frac{1}{2}'}, 'x:1')
  verifiers.validate('code', {'inputs': ['1'], 'outputs': ['1']}, 'x:1')
  with pytest.raises(ValueError, match=r"x:1: metadata\['repo'\] is missing"):
    verifiers.validate('swe', {'gold_patch': '--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n'}, 'x:1',
                       execution=True)
  with verifiers.get('structured') as v:
    with pytest.raises(ValueError, match='x:2: metadata must be a dict'):
      v.validate_metadata(['not', 'a', 'dict'], 'x:2')


def test_thinking_errors_and_bad_metadata_give_reasons_not_exceptions():
  schema = {'schema': {'type': 'object'}}
  with verifiers.get('structured', thinking_unfinished_reward=-0.5, workers=1) as v:
    r = v.score([
        S('p', '<think>plan</think>{"a": 1}', schema),
        S('p', '<think>{"a": 1} and it never ends', schema),
        S('p', '{"a": 1}', {'schema': 'not a schema'}),
        S('p', '[1, 2]', schema),
    ])
  assert [x.reward for x in r] == [1.0, -0.5, 0.0, 0.0]
  assert r[1].info['thinking'] == 'unfinished'
  assert r[2].info['reason'].startswith('bad metadata:')
  assert 'schema violation' in r[3].info['reason']
  v = _Echo(workers=1, timeout_s=5)
  try:
    r = v.score([S('p', 'raise'), S('p', '[1]'), S('p', 'not json'), S('p', '{"reward": 1}')])
    assert r[0].reward == 0 and 'prepare failed' in r[0].info['reason']
    assert r[1].reward == 0 and 'malformed answer' in r[1].info['reason']
    assert r[2].reward == 0 and 'JSONDecodeError' in r[2].info['reason']
    assert r[3] == verifiers.Result(1.0, {})
    assert v.score([]) == []
  finally:
    v.close()


def test_workers_are_reused_and_closed():
  v = verifiers.get('structured', workers=2)
  samples = [S('p', '{}', {'schema': {'type': 'object'}})] * 8
  assert all(r.reward == 1 for r in v.score(samples))
  pids = v._pool.pids  # pylint: disable=protected-access
  v.score(samples)
  assert v._pool.pids == pids  # pylint: disable=protected-access
  v.close()
  assert not any(psutil.pid_exists(p) for p in pids)
  assert v.score(samples[:1])[0].reward == 1  # Restarts lazily after close.
  v.close()


def test_dropping_a_verifier_stops_its_processes_without_gc():
  gc.disable()  # No reference cycle may keep workers alive until a collection.
  try:
    v = verifiers.get('structured', workers=1)
    v.score([S('p', '{}', {'schema': {'type': 'object'}})])
    pids = v._pool.pids  # pylint: disable=protected-access
    c = verifiers.get('code', workers=1)
    c.score([S('p', 'x = 1', {'inputs': ['\n'], 'outputs': ['']})])
    pids += c.sandbox.server_pids
    assert len(pids) == 2
    del v, c
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
  finally:
    gc.enable()


def test_raw_answer_keeps_indentation():
  assert base.raw_answer('\n\n    return x\n<|im_end|>') == '    return x'
  assert base.raw_answer('<think>t</think>\n  y = 1\n') == '  y = 1'
  assert base.raw_answer('</think>z') == 'z'


# ------------------------------------------------------------------ the verifier's own bug

class _Misnamed(base.Verifier):
  """A user's verifier with a bug of its own: it reads a metadata field the records lack."""
  name = 'misnamed'

  def _prepare(self, sample, answer):
    ok = answer == sample.metadata['answr']
    return verifiers.Result(float(ok), {'reason': 'right' if ok else 'wrong'})


class _Fragile(base.Verifier):
  """A verifier whose parser raises on some answers (a weakness hostile text can reach)."""
  name = 'fragile'

  def _prepare(self, sample, answer):
    if not answer or answer[0] in '{<\\':
      raise ValueError(f'cannot parse {answer[:10]!r}')
    return verifiers.Result(float(answer == sample.metadata['answer']), {'reason': 'parsed'})


class _WorkerBug(_Echo):
  """Its worker function fails on every payload it is given (json.loads of a dict)."""
  name = 'worker_bug'

  def _prepare(self, sample, answer):
    return {'text': answer}


def test_a_verifier_that_raises_whatever_the_answer_marks_its_own_error():
  # Every sample scores 0 with its reason, as before, and carries the exception and its last
  # frame (the verifier's own line), which the run stops on (cascade.verifier_set).
  v = _Misnamed(workers=1)
  r = v.score([S('p', 'x', {'answer': 'x'}), S('p', '<think>a</think>y', {'answer': 'y'})])
  for res in r:
    assert res.reward == 0 and res.info['reason'] == "error: KeyError: 'answr'"
    assert res.info['verifier'] == 'misnamed'
    assert res.info['verifier_error'].startswith("KeyError: answr at tests/verifiers/test_base.py:")
    assert res.info['verifier_error'].endswith(' in _prepare')
  # Its worker function's own error too, with the worker's last frame.
  v = _WorkerBug(workers=1, timeout_s=5)
  try:
    r = v.score([S('p', 'x'), S('p', 'y')])
  finally:
    v.close()
  assert all(x.reward == 0 and 'TypeError' in x.info['reason'] for x in r)
  assert all(x.info['verifier'] == 'worker_bug' for x in r)
  assert 'json' in r[0].info['verifier_error'] and r[0].info['verifier_error'].endswith(' in loads')


def test_no_model_text_makes_a_fragile_parser_the_verifiers_own_error():
  """A parser that raises on hostile text costs those samples their reward, never a stop: the
  probe answers, not the model's text, decide whose error it was."""
  v = _Fragile(workers=1)
  hostile = ['', '{', '<|im_end|>', '\\boxed{', '{"a": ' * 1000, '<think></think>{',
             *base.PROBE_ANSWERS]
  r = v.score([S('p', t, {'answer': '7'}) for t in hostile] + [S('p', '7', {'answer': '7'})])
  assert [x.reward for x in r] == [0.0] * len(hostile) + [1.0]
  assert not [x.info for x in r if 'verifier_error' in x.info]
  assert r[1].info['reason'].startswith('error: ValueError: cannot parse')
  # The echo verifier's worker fails on text that is not JSON, not on the probes: no own error.
  v = _Echo(workers=1, timeout_s=5)
  try:
    r = v.score([S('p', 'not json'), S('p', '{"reward": 1}')])
  finally:
    v.close()
  assert 'JSONDecodeError' in r[0].info['reason'] and 'verifier_error' not in r[0].info


def test_own_error_probes_a_record_once_per_batch(monkeypatch):
  v = _Misnamed(workers=1)
  calls = []
  monkeypatch.setattr(v, 'own_error', lambda prompt, md: calls.append(md) or 'bug')
  md = {'answer': 'x'}
  v.score([S('p', 'a', md)] * 8 + [S('p', 'b', {'answer': 'y'})])
  assert len(calls) == 2
