"""SWE-bench Verified through the agentic environment: the released records with each instance's
repository (a checkout directory, an archive), a scripted policy's episodes in `envs.swe_agent`,
the final files' diff as the harness's predictions (applied by `git apply`), the environment's
own reward beside the harness's verdict, and the report."""

import dataclasses
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from cascade import suites
from cascade.suites import base
from cascade.suites import checkpoint
from cascade.suites import run
from cascade.suites import swe_bench
from cascade.suites import swe_bench_agentic as agentic
from foundation import chat
from tests.cascade.suites import canned

FIXTURES = os.path.join(os.path.dirname(__file__), '..', '..', 'fixtures', 'suites')
DJANGO, ASTROPY = 'django__django-11099', 'astropy__astropy-12907'
VALIDATORS = 'django/contrib/auth/validators.py'
OLD, NEW = r"regex = r'^[\w.@+-]+$'", r"regex = r'^[\w.@+-]+\Z'"



def _action(prompt: str) -> str:
  """The scripted policy's turn for a prompt: on the django instance it reads the file, fixes
  the regex and stops; on the other it gives up at once."""
  turn = prompt.count('<|im_start|>assistant') - 1
  if 'django/django' not in prompt:
    return '<think>no idea</think>I cannot fix this.'
  if turn == 0:
    return '<think>look</think>' + chat.render_tool_call('read_file', {'path': VALIDATORS})
  if turn == 1:
    return '<think>fix</think>' + chat.render_tool_call(
        'edit', {'path': VALIDATORS, 'old': OLD, 'new': NEW})
  return '<think>done</think>Fixed: the regex ends at \\Z.'


class ScriptedSampler:
  """`rl.sampler.Sampler.generate` of the scripted policy; keeps the prompts of every call."""
  pad_id = 0

  def __init__(self):
    self.calls = []

  def generate(self, params, prompts, rng, sp, row_limits=None):
    del params, rng, row_limits
    tok = canned.CharTokenizer()
    texts = [tok.decode(p) for p in prompts]
    self.calls.append(texts)
    rows = [canned.output(tok.encode(_action(t)), [p], 1, sp.max_new_tokens)
            for t, p in zip(texts, prompts)]
    return rows[0]._replace(**{f: np.concatenate([getattr(r, f) for r in rows])
                               for f in ('tokens', 'mask', 'logprobs', 'sampling_logprobs',
                                         'lengths', 'truncated')})


def _suite(**protocol):
  return suites.get('swe_bench_verified_agentic').with_protocol(max_new_tokens=4096, **protocol)


def _data(tmp_path, hidden=None):
  """The fixture's instances and repositories, with `hidden_tests.jsonl` rows when given."""
  root = tmp_path / 'data'
  shutil.copytree(os.path.join(FIXTURES, 'swe_bench_verified'), root)
  if hidden is not None:
    (root / agentic.HIDDEN_TESTS).write_text(''.join(json.dumps(r) + '\n' for r in hidden))
  return str(root)


def _checkout(tmp_path, files):
  """A git repository holding `files`, committed."""
  repo = tmp_path / 'checkout'
  for path, text in files.items():
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
  git = lambda *a: subprocess.run(['git', '-C', str(repo), *a], check=True, capture_output=True)
  git('init', '-q')
  git('add', '-A')
  git('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-qm', 'base')
  return repo


def _tree(repo):
  return {str(p.relative_to(repo)): p.read_text() for p in sorted(repo.rglob('*'))
          if p.is_file() and '.git' not in p.relative_to(repo).parts}


def test_git_diff_is_applied_by_git_apply(tmp_path):
  original = {'a.py': 'x = 1\ny = 2\nz = 3\n', 'b.txt': 'no newline', 'gone.py': 'bye\n',
              'empty_gone': '', 'keep.py': 'same\n', 'tail.py': 'one\ntwo'}
  files = {'a.py': 'x = 1\ny = 20\nz = 3\nw = 4\n', 'b.txt': 'no newline\n',
           'new/c.py': 'print(1)\n', 'new/empty': '', 'keep.py': 'same\n',
           'tail.py': 'one\nTWO'}
  patch = agentic.git_diff(original, files)
  assert 'new file mode 100644' in patch and 'deleted file mode 100644' in patch
  assert '\\ No newline at end of file' in patch
  assert agentic.git_diff(original, dict(original)) == ''
  repo = _checkout(tmp_path, original)
  (tmp_path / 'p.diff').write_text(patch)
  subprocess.run(['git', '-C', str(repo), 'apply', str(tmp_path / 'p.diff')], check=True,
                 capture_output=True)
  assert _tree(repo) == files


def test_records_with_their_repositories(tmp_path):
  suite = _suite()
  records = suite.read(os.path.join(FIXTURES, 'swe_bench_verified'))
  assert [r['id'] for r in records] == [ASTROPY, DJANGO]
  text = records[1]['messages'][0]['content']
  assert text.startswith('Repository: django/django (commit ')
  assert 'Issue:\nUsernameValidator allows trailing newline' in text
  assert text.endswith(agentic.INSTRUCTION)
  # One repository an archive, the other a checkout directory; the workspace is their files.
  assert records[0]['metadata']['repo_source'].endswith(f'repos/{ASTROPY}.tar.gz')
  assert os.path.isdir(records[1]['metadata']['repo_source'])
  env_rec = suite.episode_record(records[1])
  assert list(env_rec['metadata']['repo']) == [VALIDATORS]
  assert OLD in env_rec['metadata']['repo'][VALIDATORS]
  assert env_rec['metadata']['gold_patch'].startswith('diff --git a/django/')
  assert list(suite.episode_record(records[0])['metadata']['repo']) == [
      'astropy/modeling/separable.py']
  # The opening lists the tools, as launch.plan measures it.
  opening = suite.prompt_text(records[1], True, None)
  assert '"name": "apply_patch"' in opening and 'run_tests' not in opening
  assert suite.planned_call(100, suite.protocol) == (100 + 4096, 4096)


def test_a_missing_repository_or_bound_is_one_line(tmp_path):
  root = _data(tmp_path)
  shutil.rmtree(os.path.join(root, 'repos', DJANGO))
  with pytest.raises(base.DataMissing, match=(
      rf"^suite 'swe_bench_verified_agentic': no repos/{DJANGO}/ or repos/{DJANGO}.tar.gz "
      r'under .* \(a checkout of django/django at [0-9a-f]+, or its `git archive`\)$')):
    _suite().read(root)
  suite = _suite()
  records = suite.read(os.path.join(FIXTURES, 'swe_bench_verified'))
  small = dataclasses.replace(suite, max_repo_chars=50)
  with pytest.raises(ValueError, match=rf"^suite 'swe_bench_verified_agentic': instance "
                                       rf"'{DJANGO}': .*at most 50"):
    small.episode_record(records[1])
  with pytest.raises(base.BadRecord, match=r"hidden_tests.jsonl:1: missing field 'test'"):
    _suite().read(_data(tmp_path / 'h', hidden=[{'instance_id': DJANGO}]))


def _run(tmp_path, suite, root, options):
  records = suite.read(root)
  sampler = ScriptedSampler()
  policy = run.Policy(sampler, None, canned.CharTokenizer(), 'scripted')
  res = run.run_suite(suite, records, policy, str(tmp_path / 'eval'), batch_size=2,
                      grader_options=options)
  return records, sampler, res


def test_episodes_predictions_and_the_environments_reward(tmp_path):
  """The scripted policy's episodes: its diff is the django prediction (git applies it to the
  repository), the other instance's is empty; scored by the environment's reward (lexical
  against the gold patch: the edit is the gold one) and reported."""
  suite = _suite(samples=2)
  out = tmp_path / 'preds'
  records, sampler, res = _run(tmp_path, suite, _data(tmp_path),
                               {'score_by': 'env', 'directory': str(out),
                                'model_name': 'org/model'})
  # Turn calls: both episodes of both records, then django's two more turns.
  assert [len(c) for c in sampler.calls] == [4, 2, 2]
  assert all('"name": "read_file"' in p for p in sampler.calls[0])
  assert '1: @deconstructible' in sampler.calls[1][0]        # the read_file observation
  lines = [json.loads(x) for x in (out / 'predictions-1.jsonl').read_text().splitlines()]
  assert [p['instance_id'] for p in lines] == [ASTROPY, DJANGO]
  assert lines[0] == {'instance_id': ASTROPY, 'model_name_or_path': 'org/model',
                      'model_patch': ''}
  patch = lines[1]['model_patch']
  assert patch.startswith(f'diff --git a/{VALIDATORS} b/{VALIDATORS}\n--- a/{VALIDATORS}\n')
  assert f'-    {OLD}\n+    {NEW}\n' in patch
  repo = _checkout(tmp_path, suite.episode_record(records[1])['metadata']['repo'])
  (tmp_path / 'p.diff').write_text(patch)
  subprocess.run(['git', '-C', str(repo), 'apply', str(tmp_path / 'p.diff')], check=True,
                 capture_output=True)
  assert NEW in (repo / VALIDATORS).read_text()
  kept = [json.loads(x) for x in (tmp_path / 'eval' / suite.name / run.GRADES).read_text()
          .splitlines()]
  astropy, django = kept[1]['grades']
  assert [g['score'] for g in astropy] == [0.0, 0.0]
  assert astropy[0]['info']['env_reason'] == 'the files are unchanged'
  assert django[0]['score'] == 1.0 and django[0]['info']['turns'] == 3
  assert django[0]['info']['scored_by'] == 'env' and django[0]['info']['tool_calls'] == 2
  assert res['metric'] == 'env reward' and res['value'] == pytest.approx(50.0)
  assert res['env_reward'] == pytest.approx(50.0) and (res['n'], res['k']) == (2, 2)
  md = checkpoint.markdown(checkpoint.report({suite.name: res}, [suite],
                                             checkpoint.Source(hf_dir=str(tmp_path)), 'data', 0),
                           [suite])
  assert f'| {suite.name} |' in md and '50.2' in md        # Cascade 2's number beside


def test_harness_verdict_or_the_refusal(tmp_path, monkeypatch):
  suite = _suite()
  root = _data(tmp_path)
  docker = str(tmp_path / 'no-docker')
  with pytest.raises(swe_bench.Unscorable, match=(
      r"^swe_bench_verified_agentic: .*predictions written to .*predictions-0.jsonl; score")):
    _run(tmp_path / 'a', suite, root, {'docker': docker, 'directory': str(tmp_path / 'o1')})
  assert DJANGO in (tmp_path / 'o1' / 'predictions-0.jsonl').read_text()
  # Where the harness runs: its report's resolved_ids (a fake harness resolves what fixes \Z).
  monkeypatch.setattr(swe_bench, 'runtime_missing', lambda docker: None)

  def fake(path, run_id, ids, workers):
    del ids, workers
    resolved = [p['instance_id'] for p in map(json.loads, open(path))
                if '\\Z' in p['model_patch']]
    name = swe_bench.report_path('.', 'cascade', run_id)
    report = json.dumps({'resolved_ids': resolved})
    return ['python3', '-c', f'open({name!r}, "w").write({report!r})']

  _, _, res = _run(tmp_path / 'b', suite, root, {'directory': str(tmp_path / 'o2'),
                                                 'command': fake})
  assert res['metric'] == 'resolved' and res['value'] == pytest.approx(50.0)
  assert res['env_reward'] == pytest.approx(50.0)


def test_hidden_tests_score_the_episodes_final_files(tmp_path, bwrap_sandbox):
  """A hidden_tests.jsonl row: the environment runs it on the final files, as training does."""
  del bwrap_sandbox
  test = ('from django.contrib.auth import validators as v\n'
          "assert v.ASCIIUsernameValidator.regex.endswith('\\\\Z'), v.ASCIIUsernameValidator.regex\n")
  stub = 'class RegexValidator: pass\n'
  root = _data(tmp_path, hidden=[{'instance_id': DJANGO, 'test': test}])
  # The fixture's file needs what it imports to run: a tiny stand-in of django's modules.
  repo = os.path.join(root, 'repos', DJANGO)
  for path, text in {'django/__init__.py': '', 'django/core/__init__.py': '',
                     'django/core/validators.py': stub,
                     'django/utils/__init__.py': '', 'django/utils/deconstruct.py':
                     'def deconstructible(c):\n    return c\n',
                     'django/contrib/__init__.py': '', 'django/contrib/auth/__init__.py': ''
                     }.items():
    os.makedirs(os.path.dirname(os.path.join(repo, path)), exist_ok=True)
    with open(os.path.join(repo, path), 'w') as f:
      f.write(text)
  with open(os.path.join(repo, VALIDATORS)) as f:
    body = f.read()
  with open(os.path.join(repo, VALIDATORS), 'w') as f:
    f.write('from django.core import validators\nfrom django.utils.deconstruct import '
            'deconstructible\n\n' + body)
  _, _, res = _run(tmp_path, _suite(), root, {'score_by': 'env',
                                              'directory': str(tmp_path / 'o')})
  kept = [json.loads(x) for x in (tmp_path / 'eval' / 'swe_bench_verified_agentic' / run.GRADES)
          .read_text().splitlines()]
  django = kept[1]['grades'][1][0]
  assert django['score'] == 1.0 and django['info']['env_reason'] == 'the hidden test passed'
  assert res['value'] == pytest.approx(50.0)


def test_grader_options_and_outcomes_are_checked():
  with pytest.raises(ValueError, match="score_by must be one of"):
    agentic.AgenticGrader(score_by='vibes')
  with pytest.raises(ValueError, match='must be an episode outcome'):
    agentic.read_outcome('<think>x</think>```diff\n```')


def test_an_episode_whose_scoring_raised_keeps_its_diff():
  env = _suite().environment()
  record = {'id': 'x', 'messages': [{'role': 'user', 'content': 'fix'}],
            'metadata': {'repo': {'a.py': 'x = 1\n'}, 'gold_patch': 'not a diff'}}
  [ep] = env.reset([record])
  ep.state.files['a.py'] = 'x = 2\n'
  [(reward, info)] = env._scored([ep], [None])  # pylint: disable=protected-access
  assert reward == 0.0 and info['reason'].startswith('error: ')
  assert info['final_diff'] == agentic.git_diff({'a.py': 'x = 1\n'}, {'a.py': 'x = 2\n'})
  assert '-x = 1\n+x = 2\n' in info['final_diff']
