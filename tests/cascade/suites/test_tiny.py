"""The tiny world's suites: registered by importing tiny_world, reading the world's held-out
files, graded by the domains' verifiers (a gold answer is right, a wrong one is not)."""

import json

import pytest

from cascade import suites
from cascade.suites import base
from cascade.suites import tiny
from foundation import chat
import tiny_world  # pylint: disable=unused-import  (importing it registers its suites)
from tiny_world import suites as world_suites
from tiny_world import world

# The suites graded here on the world's gold answers (math's and IF's verifier pools take seconds
# to start: math's case is heavy, IF's the heavy end-to-end run's).
DOMAINS = {'tiny_chat': 'chat', 'tiny_math': 'math'}


@pytest.fixture(scope='module')
def root(tmp_path_factory):
  """A world directory with a few held-out records of chat and math (no tokenizer: the
  suites read only the held-out files); returns (root, {domain: its gold SFT records})."""
  out, gold = tmp_path_factory.mktemp('world'), {}
  for domain in DOMAINS.values():
    recs = world.generate(domain, seed=0, sft=0, rl=0, heldout=6)
    (out / domain).mkdir()
    with open(out / domain / 'heldout.jsonl', 'w') as f:
      f.writelines(json.dumps(r) + '\n' for r in recs['heldout'])
    gold[domain] = recs['sft_heldout']
  return str(out), gold


def test_importing_the_world_registers_its_suites():
  assert {s.name for s in world_suites.SUITES} <= set(suites.names())
  for s in world_suites.SUITES:
    assert suites.get(s.name) is s and isinstance(s, tiny.WorldSuite)
    assert s.metric == 'avg@4' and s.protocol.samples == 4 and s.protocol.pass_ks == (4,)
    assert s.files == (f'{s.domain}/heldout.jsonl',)


@pytest.mark.parametrize('name', ['tiny_chat', pytest.param('tiny_math', marks=pytest.mark.heavy)])
def test_a_gold_answer_is_right_and_a_wrong_one_is_not(root, name):
  data_dir, gold = root
  suite = suites.get(name)
  recs = suite.read(suite.directory(data_dir))
  golds = gold[DOMAINS[name]]
  assert [r['id'] for r in recs] == [g['id'] for g in golds] and len(recs) == 6
  completions = [[chat.render_response(g['response']), 'no answer here' + chat.IM_END]
                 for g in golds]
  with suite.grader(workers=1) as grader:
    grades = grader.grade_batch(recs, completions)
  scores = [[x.score for x in row] for row in grades]
  assert all(row[0] == 1.0 and row[1] < 1.0 for row in scores), [
      [x.info for x in row] for row in grades]
  if name == 'tiny_math':        # maj@k votes on the verifier's parsed answer
    assert all(row[0].answer is not None and row[1].answer is None for row in grades)
  summary = suite.summarize(recs, grades)
  assert summary['value'] == pytest.approx(100 * sum(map(sum, scores)) / 12)
  assert summary['pass@2'] == 100.0 if 'pass@2' in summary else summary['n'] == 6


def test_a_record_without_messages_is_one_line_naming_its_file_and_line(tmp_path):
  (tmp_path / 'math').mkdir()
  (tmp_path / 'math' / 'heldout.jsonl').write_text(
      '{"id": "a", "messages": [{"role": "user", "content": "1+1?"}], "metadata": {}}\n'
      '{"id": "b", "metadata": {"answer": "2"}}\n')
  with pytest.raises(base.BadRecord, match=r"heldout.jsonl:2: missing field 'messages'"):
    suites.get('tiny_math').read(str(tmp_path))
  with pytest.raises(base.DataMissing, match=r"suite 'tiny_code': no code/heldout.jsonl under "):
    suites.get('tiny_code').read(str(tmp_path))
