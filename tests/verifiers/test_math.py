"""Math verifier: answer extraction and math-verify equivalence in time-limited workers."""

import json
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import verifiers
from verifiers import base
from verifiers import math as math_verifier

S = verifiers.Sample


@pytest.mark.parametrize('text, answer, how', [
    (r'So $\boxed{\frac{1}{2}}$.', r'\frac{1}{2}', 'boxed'),
    (r'\boxed{1} then, correcting myself, \boxed{2}', '2', 'boxed'),
    (r'nested \boxed{\{1, \{2\}\}} ok', r'\{1, \{2\}\}', 'boxed'),
    (r'\fbox{x+1}', 'x+1', 'boxed'),
    (r'\boxed 5 apples', '5', 'boxed'),
    ('Thus, the answer is $42$.', '42', 'answer phrase'),
    ('The final answer is: **7**', '7', 'answer phrase'),
    ('**Answer:** 3/4', '3/4', 'answer phrase'),
    ('Answer: x = 2\nsome trailing remark', 'x = 2', 'answer phrase'),
    ('I think the answer is 3. No wait, the answer is \\(4\\).', '4', 'answer phrase'),
    (r'unbalanced \boxed{1 + {2}', None, 'none'),
    # A group that never closes: an earlier one may still close before it.
    (r'\boxed{a} then \boxed{', 'a', 'boxed'),
    (r'\boxed{\frac{1}{2}} then \boxed{3 + {4}', r'\frac{1}{2}', 'boxed'),
    (r'\boxed{a \boxed{b} c', 'b', 'boxed'),
    (r'\boxed{1 + \boxed{2 + {3}', None, 'none'),
    # An empty group is skipped, and an earlier group may hold it.
    (r'\boxed{1} \boxed{ }', '1', 'boxed'),
    (r'\boxed{a {\boxed{} b}}', r'a {\boxed{} b}', 'boxed'),
    (r'\boxed 5$ then \boxed$', '5', 'boxed'),
    ('Answer   :  12', '12', 'answer phrase'),
    # A box cut off at the very end of a long answer.
    ('x' * 300 + ' The answer is 5.\n\\boxed', '5', 'answer phrase'),
    # Delimiters around nothing are kept (and the answer is then not parsable).
    ('The answer is 5.\nThe answer is $$.', '$$', 'answer phrase'),
    ('The answer is $2 + 3', '$2 + 3', 'answer phrase'),
    ('Working it out.\n**Answer:** 3/4', '3/4', 'answer phrase'),
    (r'The area is \boxed π', 'π', 'boxed'),
    # Markup and delimiters nested three deep.
    (r'The answer is \[*\[*5*\]*\].', '5', 'answer phrase'),
    ('The answer is 7.\nthe answer is.\n**Answer:**', '7', 'answer phrase'),
    ('no answer at all', None, 'none'),
])
def test_extract_answer(text, answer, how):
  assert math_verifier.extract_answer(text) == (answer, how)


@pytest.mark.parametrize('text, start, limit, inner', [
    (r'\boxed{1}', 6, None, '1'),
    ('x{a{b}c}y', 1, None, 'a{b}c'),
    ('xx{a{b}c}y', 2, None, 'a{b}c'),
    (r'{\}}', 0, None, r'\}'),
    (r'{B\,}', 0, None, r'B\,'),
    ('{Zürich}', 0, None, 'Zürich'),
    ('{' + 'a' * 5000 + '}', 0, None, 'a' * 5000),
    ('{1 + {2}', 0, None, None),
    ('{\\', 0, None, None),
    ('{a\\', 0, None, None),
    # With a limit, the group must close within `limit` characters from `start`.
    ('{ab}', 0, 4, 'ab'),
    ('{abc}', 0, 4, None),
    ('xyz{ab}', 3, 4, 'ab'),
    ('xyz{abc}', 3, 4, None),
    ('xyz{ab\\}}', 3, 4, None),
])
def test_braced(text, start, limit, inner):
  assert math_verifier.braced(text, start, limit) == inner


@pytest.mark.parametrize('text, answer', [
    ('\\boxed{' * 150_000, None),
    ('\\boxed{1}' + '\\boxed{' * 150_000, '1'),
    ('\\boxed$' * 150_000, None),
    ('The answer is 7.\n' + 'the answer is.\n' * 70_000, '7'),
    ('answer' + ' ' * 1_000_000 + 'x', None),
    # Runs of blank lines: `^\\W*answer` retried the whole run from every line start.
    ('\n' * 1_000_000, None),
    ('-\n' * 500_000, None),
    ('\n' * 1_000_000 + '**Answer:** 7', '7'),
])
def test_hostile_megabyte_answers_extract_fast(text, answer):
  # Linear scans take ~0.1-0.5 s on a megabyte (more on a loaded host); a quadratic one takes
  # minutes, so a 5 s bound tells them apart without failing on a busy machine.
  start = time.perf_counter()
  cpu = time.process_time()
  assert math_verifier.extract_answer(text)[0] == answer
  assert time.perf_counter() - start < 5.0
  # The worker-side bound, as the host parsers': under a second of CPU for a megabyte.
  assert time.process_time() - cpu < 1.0


# A kilobyte of brackets: math-verify's LaTeX parser took ~6 s of CPU on the parentheses.
NESTED_KB = {
    'parentheses': '(' * 500 + '1' + ')' * 500,
    'braces': '{' * 500 + '1' + '}' * 500,
    'left-right': '\\left(' * 70 + 'x' + '\\right)' * 70,
    'fractions': '\\frac{' * 100 + '1' + '}{2}' * 100,
    'powers': '2^{' * 250 + '2' + '}' * 250,
}


@pytest.mark.parametrize('answer, why', [
    ('1' * 301, 'answer longer than 300 characters (301)'),
    (NESTED_KB['parentheses'], 'answer longer than 300 characters (1001)'),
    ('(' * 9 + 'x' + ')' * 9, 'answer nests brackets 9 deep (most 8)'),
    ('\\{' * 7 + '[(x)]' + '\\}' * 7, 'answer nests brackets 9 deep (most 8)'),
    ('\\{' * 6 + '[(x)]' + '\\}' * 6, ''),
    ('\\left(' * 9 + 'x', 'answer nests brackets 9 deep (most 8)'),
    ('1' * 300, ''),
    ('(' * 8 + 'x' + ')' * 8, ''),
    ('[1, 2) \\cup (3, 4]', ''),
    (')' * 20 + '(x)', ''),
    ('\\left(\\frac{\\sqrt{2}}{2}, -\\frac{\\pi}{4}\\right)', ''),
])
def test_answers_too_long_or_too_deep_are_refused(answer, why):
  assert math_verifier.refusal(answer) == (why and why + ': not parsed')


@pytest.mark.parametrize('kind', sorted(NESTED_KB))
def test_a_kilobyte_of_nesting_costs_under_a_second(kind):
  cpu = time.process_time()
  for text in (f'\\boxed{{{NESTED_KB[kind]}}}', f'The answer is {NESTED_KB[kind]}'):
    out = math_verifier.work({'answer_text': text, 'gold': '1', 'parse_timeout_s': None})
    assert out['reward'] == 0.0 and 'not parsed' in out['info']['reason'], out
  assert time.process_time() - cpu < 1.0


@pytest.fixture(scope='module')
def verifier():
  with verifiers.get('math', workers=2, timeout_s=10) as v:
    yield v


CASES = [
    # (completion, gold, reward)
    (r'<think>1/2 = 0.5</think>The probability is $\boxed{\frac{1}{2}}$.', '0.5', 1.0),
    (r'$\boxed{0.5}$', r'\frac{1}{2}', 1.0),
    (r'$\boxed{\frac{2}{4}}$', r'\dfrac12', 1.0),
    (r'\boxed{50\%}', '0.5', 1.0),
    (r'\boxed{\{3, 1, 2\}}', r'\{1,2,3\}', 1.0),
    (r'\boxed{(1, 2]}', '(1,2]', 1.0),
    (r'\boxed{[1, 2]}', '(1,2]', 0.0),
    (r'\boxed{(x+1)^2}', 'x^2+2x+1', 1.0),
    (r'\boxed{x = 3}', '3', 1.0),
    (r'\boxed{\sqrt{8}}', r'2\sqrt{2}', 1.0),
    (r'\boxed{2.0001}', '2', 0.0),
    ('The answer is 12.', 12, 1.0),
    ('The answer is 13.', 12, 0.0),
    (r'\boxed{3.14}', 3.14, 1.0),
    ('The answer is $$.', '1', 0.0),
    (r'\boxed{1}', '$$', 0.0),
    ('no final answer', '1', 0.0),
    (r'<think>\boxed{1} but I never stop', '1', 0.0),
]


def test_equivalence_batch(verifier):
  results = verifier.score([S('q', c, {'answer': g}) for c, g, _ in CASES])
  assert [r.reward for r in results] == [r for _, _, r in CASES], [r.info for r in results]
  assert results[0].info['found_by'] == 'boxed' and results[0].info['gold'] == '1/2'
  assert 'no final answer' in results[-2].info['reason']
  assert [r.info['reason'] for r in results[1:3]] == ['equivalent'] * 2
  assert results[6].info['reason'] == 'not equivalent'
  assert results[-4].info['reason'] == 'answer not parsable'
  assert results[-3].info['reason'] == 'gold answer not parsable'
  assert results[-1].info['thinking'] == 'unfinished'


def _worker_cpu(v) -> tuple[float, list[int]]:
  pids = v._pool.pids
  return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids), pids


def test_hostile_nesting_costs_the_worker_under_a_second_and_no_restart(verifier):
  verifier.score([S('q', r'\boxed{1}', {'answer': '1'})])  # Workers up and warm.
  cpu, pids = _worker_cpu(verifier)
  restarts = verifier._pool.restarts
  texts = [f'\\boxed{{{t}}}' for t in NESTED_KB.values()] + [
      f'Answer: {t}' for t in NESTED_KB.values()]
  results = verifier.score([S('q', t, {'answer': '1'}) for t in texts])
  assert all(r.reward == 0.0 and 'not parsed' in r.info['reason'] for r in results), results
  spent, after = _worker_cpu(verifier)
  assert after == pids and verifier._pool.restarts == restarts
  assert spent - cpu < 1.0


def test_no_answer_and_refused_answers_are_scored_on_the_host_as_a_worker_would():
  # Extraction and the refusal are linear: what they decide needs no worker, so a batch of
  # them starts none (a random policy's evaluation), and scores as `work` does.
  texts = ['nothing boxed, no phrase', r'\boxed{' + '(' * 9 + 'x' + ')' * 9 + '}',
           'The answer is ' + '1' * 301]
  with verifiers.get('math', workers=1, timeout_s=10) as v:
    results = v.score([S('q', t, {'answer': '1'}) for t in texts])
    assert v._pool is None
    answered = v.score([S('q', r'\boxed{1}', {'answer': '1'})])
    assert v._pool is not None and answered[0].reward == 1.0
  want = [math_verifier.work({'answer_text': t, 'gold': '1', 'parse_timeout_s': None})
          for t in texts]
  assert [{'reward': r.reward, 'info': r.info} for r in results] == want
  assert [r.info['reason'] for r in results] == [
      'no final answer (\\boxed{} or "the answer is")',
      'answer nests brackets 9 deep (most 8): not parsed',
      'answer longer than 300 characters (301): not parsed']


def test_the_parse_timeout_is_used_only_in_a_main_thread(monkeypatch):
  # math-verify's SIGALRM timeout raises outside a main thread; there it is left off.
  limits = []
  monkeypatch.setattr(math_verifier, '_parse', lambda text, limit: limits.append(limit) or [])
  payload = {'answer_text': r'\boxed{\frac{1}{2}}', 'gold': '0.5', 'parse_timeout_s': 3}
  math_verifier.work(payload)
  worker = threading.Thread(target=math_verifier.work, args=(payload,))
  worker.start()
  worker.join()
  assert limits == [3, 3, None, None]  # The gold's parse and the answer's, in each thread.


@pytest.mark.heavy
def test_a_stalled_parse_ends_at_the_parse_timeout_and_the_worker_goes_on():
  # Past the bounds (lifted here), 24 levels of brackets keep math-verify's parser for seconds;
  # its own timeout (SIGALRM, a main thread) ends the parse at 1 s, and the process parses
  # right afterwards. In a fresh process, as a worker: in a test process, garbage collection
  # can run the signal's handler inside a finaliser, where its exception is ignored.
  script = textwrap.dedent("""
      import json, time
      from verifiers import math as m
      m.MAX_NESTING = 1000
      deep = '\\\\{' * 8 + '[' * 8 + '{' * 8 + 'x' + '}' * 8 + ']' * 8 + '\\\\}' * 8
      start = time.monotonic()
      stalled = m.work({'answer_text': '\\\\boxed{' + deep + '}', 'gold': 'x',
                        'parse_timeout_s': 1})
      took = time.monotonic() - start
      after = m.work({'answer_text': '\\\\boxed{\\\\frac{2}{4}}', 'gold': '0.5',
                      'parse_timeout_s': 1})
      print(json.dumps([stalled, took, after]))
  """)
  run = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                       timeout=120, cwd=base.PACKAGE_PARENT, check=True)
  stalled, took, after = json.loads(run.stdout.splitlines()[-1])
  assert stalled['info']['reason'] == 'answer parse timed out after 1s', stalled
  assert took < 4.0
  assert after['reward'] == 1.0, after


@pytest.mark.parametrize('answer, latex', [
    ('5', '$5$'), (r'\frac{1}{2}', r'$\frac{1}{2}$'), ('$5$', '$5$'), (r'\(5\) or $6$', r'\(5\) or $6$'),
    (r'\boxed{5}', r'\boxed{5}'),
])
def test_gold_and_answers_are_parsed_as_latex(answer, latex):
  assert math_verifier._as_latex(answer) == latex


@pytest.mark.parametrize('metadata, message', [
    ({}, r"metadata\['answer'\] is missing"),
    ({'answer': [1]}, r"metadata\['answer'\] must be"),
    ({'answer': ' '}, r'metadata\["answer"\] is empty'),
])
def test_validate_names_the_field(metadata, message):
  with pytest.raises(ValueError, match=r'^rl/math.jsonl:2: ' + message):
    verifiers.validate('math', metadata, 'rl/math.jsonl:2')
  for answer in ('1/2', 3, 0.5):
    verifiers.validate('math', {'answer': answer}, 'x')


def test_a_stuck_sample_times_out_without_blocking_the_batch():
  # sympy does not settle a tower of powers for minutes; the worker is killed at the limit.
  slow = S('q', r'\boxed{10^{10^{10^{10}}} - 10^{10^{10^{10}}} + 1}', {'answer': '1'})
  with verifiers.get('math', workers=1, timeout_s=1.0) as v:
    v.score([S('q', r'\boxed{1}', {'answer': '1'})])  # Start-up is not timed.
    start = time.monotonic()
    results = v.score([slow, S('q', r'\boxed{2}', {'answer': '2'})])
    elapsed = time.monotonic() - start
  assert results[0].reward == 0.0 and 'timeout after 1s' in results[0].info['reason']
  assert results[1].reward == 1.0
  assert elapsed < 30  # The 1 s limit plus a worker restart, not sympy's hours.
