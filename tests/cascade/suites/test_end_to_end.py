"""Every paper suite end to end on its fixture files, as `python -m cascade.evaluate` runs it:
read, rendered in its protocol's thinking mode, sampled (a stand-in sampler answers every prompt
with one canned completion and keeps the prompts it was given), graded, kept, reduced to its
metric and reported beside the papers' numbers. The result equals the suite's own grader on the
same completions, graded directly."""

import dataclasses
import os

import pytest

from cascade import rollout
from cascade import suites
from cascade.suites import checkpoint
from cascade.suites import ruler
from cascade.suites import run
from cascade.suites import swe_bench
from foundation import chat
from foundation import chat_template
from tests.cascade.suites import canned

FIXTURES = os.path.join(os.path.dirname(__file__), '..', '..', 'fixtures', 'suites')
_CODE = '```python\na, b = map(int, input().split())\nprint(a + b)\n```'
# One completion per suite family: right for some records, wrong for others.
ANSWERS = {
    'math': '<think>ok</think>The answer is \\boxed{70}.',
    'mcqa': '<think>ok</think>The answer is (A).\nAnswer: A',
    'instruction': '<think>ok</think>Hello, World. THIS IS MY ANSWER, in english.',
    'livecodebench': f'<think>ok</think>{_CODE}',
    'bfcl': '<think>ok</think>' + chat.render_tool_call('get_weather', {'city': 'Paris'}),
    'arena_hard': '<think>ok</think>A GOOD answer.',
    'ruler': '1234567 and VAR ABCDE',
    'swe_bench': '<think>ok</think>```diff\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n```',
    # An episode's first turn without a tool call ends it (nothing changed: an empty patch).
    'swe_bench_agentic': '<think>ok</think>Nothing to change.',
}
SWE = ('swe_bench', 'swe_bench_agentic')
# Every suite; of RULER's twenty (four tasks at five lengths, one code path per task), each task
# at 8K.
PAPER = sorted(n for n in suites.builtin_names() if not n.startswith('ruler_') or
               n.endswith('_8k'))
# Grader options that keep the test cheap (one worker) or name a judge.
OPTIONS = {'math': {'workers': 1}, 'instruction': {'workers': 1},
           'livecodebench': {'workers': 1}}



class CannedSampler:
  """`rl.sampler.Sampler.generate`'s output for every row: `text`; keeps each call's prompts."""
  pad_id = 0

  def __init__(self, text):
    self.ids, self.prompts = canned.CharTokenizer().encode(text), []

  def generate(self, params, prompts, rng, sp, num_samples=1, row_limits=None):
    del params, rng, row_limits      # an episode's turn call gives row_limits
    self.prompts += [list(p) for p in prompts]
    return canned.output(self.ids, prompts, num_samples, sp.max_new_tokens)


class _Shared:
  """One grader for the run and the direct grading (one worker pool): closed by the test."""

  def __init__(self, grader):
    self.grader = grader

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    del exc

  def grade_batch(self, records, completions):
    return self.grader.grade_batch(records, completions)

  def close(self):
    pass


def _family(suite):
  return type(suite).__module__.rsplit('.', 1)[-1]


def _fair_judge(body, attempt):
  """A served judge preferring the answer that says GOOD (assistant B's block is the second)."""
  del attempt
  user = body['messages'][-1]['content']
  a, b = user.split("<|The Start of Assistant B's Answer|>")
  verdict = {(True, False): 'A>>B', (False, True): 'B>>A'}.get(('GOOD' in a.split(
      "<|The Start of Assistant A's Answer|>")[1], 'GOOD' in b), 'A=B')
  return f'Read both.\n\nMy final verdict is: [[{verdict}]]'


@pytest.mark.parametrize('name', PAPER)
def test_a_paper_suite_runs_end_to_end_on_its_fixture_files(name, tmp_path, request,
                                                            monkeypatch):
  suite = suites.get(name).with_protocol(samples=1 if suites.get(name).protocol.greedy else 2)
  family = _family(suite)
  tok = canned.CharTokenizer()
  options = dict(OPTIONS.get(family, {}))
  if family == 'livecodebench':
    request.getfixturevalue('bwrap_sandbox')       # its tests run in the sandbox
  if family == 'arena_hard':
    options['url'] = request.getfixturevalue('fake_openai')(_fair_judge).url
  if family in SWE:
    options['docker'] = str(tmp_path / 'no-docker')   # no container runtime: the refusal
  if family == 'ruler':
    suite = dataclasses.replace(suite, records=2, length=2000)   # over every task's template
  suite = suite.for_tokenizer(tok)
  source = checkpoint.Source(hf_dir=str(tmp_path / 'hf'))
  records = checkpoint.read(suite, FIXTURES)
  text = ANSWERS[family]
  sampler = CannedSampler(text)
  policy = run.Policy(sampler, None, tok, 'canned')
  sets = [(suite, records)]
  said = []
  shared = suite.grader(**options)
  request.addfinalizer(shared.close)
  monkeypatch.setattr(type(suite), 'grader', lambda self, **kw: _Shared(shared))
  k = suite.protocol.samples
  if family not in SWE:
    # Graded directly (the run then grades on a thread of its own, with the same workers).
    direct = suite.summarize(records, shared.grade_batch(records, [[text] * k] * len(records)))
  if family in SWE:
    with pytest.raises(swe_bench.Unscorable, match='predictions written to'):
      checkpoint.evaluate(sets, policy, str(tmp_path / 'eval'), batch_size=2,
                          grader_options={name: options}, say=said.append)
    return
  res = checkpoint.evaluate(sets, policy, str(tmp_path / 'eval'), batch_size=2,
                            grader_options={name: options}, say=said.append)[name]
  # Rendered as the protocol says, every record once per batch.
  template = chat_template.of(tok)
  want = [tok.encode(rollout.prompt_text(r, suite.protocol.thinking, template)) for r in records]
  assert sampler.prompts == want
  # Graded and reduced as the suite's grader does it directly.
  assert (res['n'], res['k'], res['samples']) == (direct['n'], k, len(records) * k)
  assert res['value'] == pytest.approx(direct['value']) and 0 <= res['value'] <= 100
  assert res['stderr'] == pytest.approx(direct['stderr'])
  assert res['protocol'] == suite.protocol_hash() and res['metric'] == direct['metric']
  assert said[-1].startswith(f'suite 1/1 {name}: ')
  # The report: the results table, the papers' numbers beside where the suite has any.
  md = checkpoint.markdown(checkpoint.report({name: res}, [suite], source, FIXTURES, 0), [suite])
  assert f'| {name} |' in md
  if suite.reported:
    assert "The papers' numbers beside" in md and f'{suite.reported[0].value:g}' in md
