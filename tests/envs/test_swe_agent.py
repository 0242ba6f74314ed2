"""The agentic SWE environment (envs/swe_agent.py) and its tiny-world domain (agentic_swe_tasks).

Tool tests run without a sandbox (no tool there executes code); tests that
run tests or score changed files need bubblewrap (`bwrap_sandbox`: skipped
where it is not installed, failing where it is installed but unusable).
"""

import collections
import json

import psutil
import pytest

from envs import base
from envs import swe_agent
import envs
from foundation import chat
from tiny_world import agentic_swe_tasks as tasks
from tiny_world import common
from tiny_world import swe_tasks
from verifiers import unidiff

CALC = 'def calc(x):\n    y = x - 7\n    return y * 2\n'
REPO = {'calc.py': CALC, 'pkg/util.py': 'def double(v):\n    return v * 2\n', 'README.md': 'calc\n'}
VISIBLE = 'from calc import calc\nassert calc(3) == 20, calc(3)\n'
HIDDEN = VISIBLE + 'assert calc(0) == 14, calc(0)\n'
GOLD = '--- a/calc.py\n+++ b/calc.py\n@@ -2 +2 @@\n-    y = x - 7\n+    y = x + 7\n'
FIX = {'path': 'calc.py', 'old': 'y = x - 7', 'new': 'y = x + 7'}


def record(**metadata):
  md = {'repo': REPO, 'test': HIDDEN, 'visible_test': VISIBLE, 'gold_patch': GOLD}
  md.update(metadata)
  return {'id': 'r', 'domain': 'swe_agent',
          'metadata': {k: v for k, v in md.items() if v is not None},
          'messages': [{'role': 'user', 'content': 'Fix calc.py. Issue: y must be x plus 7.'}]}


def call(name, **arguments):
  return chat.render_tool_call(name, arguments)


def observe(env, episodes, actions):
  """Steps once; each episode's tool results' contents (a list per episode)."""
  return [[m['content'] for m in s.messages] for s in env.step(episodes, actions)]


def one(env, action, rec=None):
  """A fresh episode's single tool result for `action`."""
  (out,) = observe(env, env.reset([rec or record()]), [action])
  (text,) = out
  return text


@pytest.fixture(scope='module')
def plain():
  """An environment whose sandbox is never needed (tools only, unchanged files)."""
  with swe_agent.SweAgentEnv(workers=1) as env:
    yield env


@pytest.fixture(scope='module')
def env(bwrap_sandbox):
  del bwrap_sandbox
  with envs.get('swe_agent', workers=2, timeout_s=5) as e:
    yield e


# -- tools -------------------------------------------------------------------


def test_registry_and_tool_schemas(plain):
  assert envs.cls('swe_agent') is swe_agent.SweAgentEnv
  names = lambda rec: [t['function']['name'] for t in plain.tools(rec)]
  assert names(record()) == ['list_files', 'read_file', 'search', 'edit', 'apply_patch',
                             'run_tests']
  assert 'run_tests' not in names(record(visible_test=None))
  out = one(plain, call('run_tests'), record(visible_test=None))
  assert out.startswith("error: unknown tool 'run_tests'")


def test_list_files(plain):
  assert one(plain, call('list_files')) == 'README.md\ncalc.py\npkg/util.py'
  assert one(plain, call('list_files', directory='./pkg/')) == 'pkg/util.py'
  assert one(plain, call('list_files', directory='.')) == 'README.md\ncalc.py\npkg/util.py'
  assert one(plain, call('list_files', directory='nope')) == "error: no files under 'nope'"
  assert 'leaves the repository' in one(plain, call('list_files', directory='..'))
  assert 'absolute' in one(plain, call('list_files', directory='/etc'))


def test_read_file(plain):
  assert one(plain, call('read_file', path='calc.py')) == (
      '1: def calc(x):\n2:     y = x - 7\n3:     return y * 2')
  assert one(plain, call('read_file', path='./calc.py', start_line=2, end_line=2)) == (
      '2:     y = x - 7')
  assert one(plain, call('read_file', path='calc.py', start_line=3, end_line=99)) == (
      '3:     return y * 2')
  assert one(plain, call('read_file', path='calc.py', start_line=4)) == (
      'error: start_line 4 is past the end of calc.py (3 lines)')
  assert 'before start_line' in one(plain, call('read_file', path='calc.py', start_line=3,
                                                end_line=2))
  assert one(plain, call('read_file', path='nope.py')) == "error: no such file 'nope.py'"
  assert 'start_line' in one(plain, call('read_file', path='calc.py', start_line=0))  # Schema.
  assert one(plain, call('read_file', path='e.py'), record(repo={'e.py': ''})) == '(e.py is empty)'


def test_search_is_literal_and_numbered(plain):
  assert one(plain, call('search', pattern='y')) == (
      'calc.py:2:     y = x - 7\ncalc.py:3:     return y * 2')
  assert one(plain, call('search', pattern='v * 2')) == 'pkg/util.py:2:     return v * 2'
  assert one(plain, call('search', pattern='.*')) == "no line contains '.*'"  # Not a regex.
  assert 'pattern' in one(plain, call('search', pattern=''))


def test_edit(plain):
  (ep,) = plain.reset([record()])
  step = lambda **a: observe(plain, [ep], [call('edit', **a)])[0][0]
  assert step(**FIX) == 'edited calc.py'
  assert ep.state.files['calc.py'] == CALC.replace('x - 7', 'x + 7')
  assert step(path='calc.py', old='y = x - 7', new='y') == "error: old text not found in 'calc.py'"
  assert step(path='calc.py', old='y', new='z') == (
      "error: old text occurs more than once in 'calc.py' (at lines 2 and 3); include more of it")
  assert step(path='calc.py', old='x', new='x') == 'error: old and new are the same text'
  assert step(path='calc.py', old='', new='x') == (
      "error: 'calc.py' exists: old must be the text to replace")
  assert step(path='new/mod.py', old='', new='A = 1\n') == 'created new/mod.py'
  assert ep.state.files['new/mod.py'] == 'A = 1\n'
  assert step(path='gone.py', old='a', new='b') == (
      "error: no such file 'gone.py' (to create it, give old as \"\")")
  assert step(path='calc.py/x.py', old='', new='') == (
      "error: 'calc.py' is a file, so 'calc.py/x.py' cannot exist")
  assert step(path='pkg', old='', new='') == "error: 'pkg' is a file, so 'pkg/util.py' cannot exist"
  assert 'not valid Unicode' in step(path='calc.py', old='y = x + 7', new='y = "\ud800"')
  assert ep.tool_calls == 2 and ep.tool_errors == 8


def test_edit_bounds_on_files_and_size(plain):
  (ep,) = plain.reset([record()])
  ep.state.files.update({f'f{i}.py': '' for i in range(swe_agent.MAX_FILES - len(REPO))})
  (out,), = observe(plain, [ep], [call('edit', path='one_more.py', old='', new='')])
  assert out == f'error: the repository would hold {swe_agent.MAX_FILES + 1} files; at most 256'
  assert 'one_more.py' not in ep.state.files
  big = 'x' * 15_000
  ep.state.files['f0.py'] = 'x' * (swe_agent.MAX_REPO_CHARS - 10_000)
  (out,), = observe(plain, [ep], [call('edit', path='calc.py', old='y = x - 7', new=big)])
  assert out.startswith('error: the repository would hold') and ep.state.files['calc.py'] == CALC


def test_the_bounds_are_options_of_the_environment():
  """A larger repository (the SWE-bench agentic suite's) raises them; edits stay within them."""
  env = swe_agent.SweAgentEnv(isolation='none', max_files=len(REPO) + 1, max_repo_chars=10**7)
  (ep,) = env.reset([record()])
  assert (ep.state.max_files, ep.state.max_chars) == (len(REPO) + 1, 10**7)
  ep.state.files['README.md'] = 'x' * (swe_agent.MAX_REPO_CHARS + 1)   # past the default
  (out,), = observe(env, [ep], [call('edit', path='one.py', old='', new='A = 1\n')])
  assert out == 'created one.py'
  (out,), = observe(env, [ep], [call('edit', path='two.py', old='', new='')])
  assert out == f'error: the repository would hold {len(REPO) + 2} files; at most {len(REPO) + 1}'
  with pytest.raises(ValueError, match='max_files=0 and max_repo_chars=1 must be >= 1'):
    swe_agent.SweAgentEnv(isolation='none', max_files=0, max_repo_chars=1)


def test_apply_patch(plain):
  (ep,) = plain.reset([record()])
  step = lambda patch: observe(plain, [ep], [call('apply_patch', patch=patch)])[0][0]
  assert step('prose') == 'error: unparsable patch: no "--- a/file" / "+++ b/file" header found'
  assert step(GOLD.replace('x - 7', 'x - 8')).startswith(
      "error: patch does not apply: hunk at line 2 of 'calc.py' does not apply")
  assert step(f'```diff\n{GOLD}```') == 'patched calc.py'
  assert ep.state.files['calc.py'] == CALC.replace('x - 7', 'x + 7')
  assert step('--- /dev/null\n+++ b/docs/new.md\n@@ -0,0 +1 @@\n+hello\n') == 'patched docs/new.md'
  assert ep.state.files['docs/new.md'] == 'hello\n'
  assert step('--- /dev/null\n+++ b/calc.py\n@@ -0,0 +1 @@\n+x = 1\n') == (
      "error: the patch creates 'calc.py', which exists")
  assert step('--- a/docs/new.md\n+++ /dev/null\n@@ -1 +0,0 @@\n-hello\n') == 'patched docs/new.md'
  assert 'docs/new.md' not in ep.state.files and ep.state.files['calc.py'] != CALC
  for escape in ('../outside.py', '/etc/passwd', 'a/../../x'):
    out = step(f'--- /dev/null\n+++ {escape}\n@@ -0,0 +1 @@\n+x\n')
    assert out.startswith('error: ') and ('leaves' in out or 'absolute' in out), out
  assert step(GOLD.replace('calc.py', 'nope.py')) == (
      "error: patch does not apply: patch modifies 'nope.py', which is not in the repo")


@pytest.mark.parametrize('path', ['../calc.py', '/etc/passwd', 'pkg/../../etc/passwd',
                                  'calc.py\x00', 'a\nb', 'x' * 201, '', '.', 'pkg/..'])
def test_paths_stay_in_the_episodes_copy(plain, path):
  for action in (call('read_file', path=path), call('edit', path=path, old='', new='pwned'),
                 call('list_files', directory=path)):
    (ep,) = plain.reset([record()])
    (out,), = observe(plain, [ep], [action])
    if path in ('', '.') and action.startswith('<tool_call>\n{"name": "list_files"'):
      assert out.startswith('README.md')  # The repository root.
      continue
    assert out.startswith('error: ') and ep.state.files == REPO, out


def test_episodes_have_their_own_copy(plain):
  rec = record()
  a, b = plain.reset([rec, rec])
  observe(plain, [a, b], [call('edit', **FIX), call('edit', path='c.py', old='', new='C = 1\n')])
  assert a.state.files['calc.py'] != CALC and 'c.py' not in a.state.files
  assert b.state.files['calc.py'] == CALC and 'c.py' in b.state.files
  assert rec['metadata']['repo'] == REPO and 'c.py' not in REPO
  (out_a,), (out_b,) = observe(plain, [a, b], [call('read_file', path='calc.py')] * 2)
  assert '+ 7' in out_a and '- 7' in out_b


def test_bounded_outputs_on_huge_files(plain):
  huge = ''.join(f'line {i} y\n' for i in range(40_000)) + 'y' * 100_000 + '\n'
  rec = record(repo={'big.py': huge, 'calc.py': CALC})
  read = one(plain, call('read_file', path='big.py'), rec)
  assert read.startswith('1: line 0 y\n') and len(read) <= base.MAX_OBSERVATION_CHARS
  assert read.endswith('\n200: line 199 y\n[lines 1-200 of 40001; read on with start_line=201]')
  tail = one(plain, call('read_file', path='big.py', start_line=39_990), rec)
  assert tail.startswith('39990: line 39989 y\n')
  assert tail.endswith('\n40001: ' + 'y' * swe_agent.MAX_LINE_CHARS + ' [...]')
  found = one(plain, call('search', pattern='y'), rec)
  assert found.split('\n')[-1] == f'[... {40_003 - 50} more matches]' and found.count('\n') == 50
  assert len(found) <= base.MAX_OBSERVATION_CHARS
  listed = one(plain, call('list_files'), record(
      repo={f'd/f{i:03d}.py': '' for i in range(swe_agent.MAX_FILES)}))
  assert listed.endswith('\n[... 56 more files]') and listed.count('\n') == 200


# -- metadata and options --------------------------------------------------------


@pytest.mark.parametrize('metadata, match', [
    ({'test': HIDDEN}, r"metadata\['repo'\] is missing"),
    ({'repo': {}, 'test': HIDDEN}, r"metadata\['repo'\] must not be empty"),
    ({'repo': {'a.py': 1}, 'test': HIDDEN}, r"metadata\['repo'\] must map path strings"),
    ({'repo': {'../a.py': ''}, 'test': HIDDEN}, r"metadata\['repo'\]: path '../a.py' leaves"),
    ({'repo': {'./a.py': ''}, 'test': HIDDEN},
     r"metadata\['repo'\]: path './a.py' is not normalised \(write 'a.py'\)"),
    ({'repo': {'a': '', 'a/b': ''}, 'test': HIDDEN},
     r"metadata\['repo'\]: 'a' is a file, so 'a/b' cannot exist"),
    ({'repo': REPO}, r"metadata needs 'test'"),
    ({'repo': REPO, 'test': 3}, r"metadata\['test'\] must be str"),
    ({'repo': REPO, 'test': ' \n'}, r"metadata\['test'\] is empty"),
    ({'repo': REPO, 'test': HIDDEN, 'visible_test': None}, r"metadata\['visible_test'\] must be"),
    ({'repo': REPO, 'gold_patch': 'prose'}, r"metadata\['gold_patch'\] is not a parsable diff"),
])
def test_metadata_errors_name_the_field(metadata, match):
  with pytest.raises(ValueError, match=r'^rec 3: ' + match):
    swe_agent.SweAgentEnv.validate_metadata(metadata, 'rec 3')


def test_valid_metadata_and_options():
  swe_agent.SweAgentEnv.validate_metadata(record()['metadata'], 'r')
  swe_agent.SweAgentEnv.validate_metadata({'repo': REPO, 'gold_patch': GOLD}, 'r')
  for bad, match in (({'isolation': 'docker'}, 'isolation must be one of'),
                     ({'workers': 0}, 'workers must be >= 1'),
                     ({'timeout_s': 0}, 'timeout_s must be > 0'),
                     ({'memory_mb': 1}, 'memory_mb must be >= 64')):
    with pytest.raises(ValueError, match=match):
      swe_agent.SweAgentEnv(**bad)


# -- running tests and scoring -------------------------------------------------------


def test_unchanged_files_score_0_without_a_sandbox(plain):
  (ep,) = plain.reset([record()])
  observe(plain, [ep], [call('read_file', path='calc.py')])
  (s,) = plain.step([ep], ['done'])
  assert s.done and s.reward == 0.0 and s.info['reason'] == 'the files are unchanged'
  assert not plain._sandboxes  # pylint: disable=protected-access  # Started lazily.


def test_fix_wrong_fix_and_gaming_the_visible_test(env):
  rec = record()
  eps = env.reset([rec] * 4)
  hardcoded = 'def calc(x):\n    return 20 if x == 3 else 0\n'
  observe(env, eps, [call('edit', **FIX), call('edit', path='calc.py', old='x - 7', new='x + 8'),
                     call('apply_patch', patch=swe_agent.diff({'calc.py': CALC},
                                                              {'calc.py': hardcoded})),
                     call('read_file', path='calc.py')])
  tests = observe(env, eps, [call('run_tests')] * 4)
  assert [t[0].split(' ')[0] for t in tests] == ['passed', 'failed', 'passed', 'failed']
  assert tests[1][0].startswith('failed (runtime_error): ') and 'AssertionError: 22' in tests[1][0]
  steps = env.step(eps, ['done', 'I fixed it.', '<think>ok</think>done', 'done'])
  assert [s.reward for s in steps] == [1.0, 0.0, 0.0, 0.0]
  assert steps[0].info['reason'] == 'the hidden test passed' and steps[0].info['tests'] == 'passed'
  assert steps[0].info['files_changed'] == ['calc.py'] and steps[0].info['isolation'] == 'bwrap'
  assert 'AssertionError: 0' in steps[2].info['reason']  # The hidden case the visible one lacks.
  assert steps[3].info['reason'] == 'the files are unchanged'
  json.dumps([s.info for s in steps])  # Serialisable, for the samples log.


def test_calls_of_a_turn_run_in_order(env):
  a, b = env.reset([record()] * 2)
  out = observe(env, [a, b], [call('edit', **FIX) + call('run_tests'),
                              call('run_tests') + call('edit', **FIX)])
  assert out == [['edited calc.py', 'passed'], [out[1][0], 'edited calc.py']]
  assert out[1][0].startswith('failed')


def test_finish_scores_the_current_files(env):
  a, b = env.reset([record()] * 2)
  observe(env, [a, b], [call('edit', **FIX), call('search', pattern='calc')])
  steps = env.finish([a, b], ['max_turns', 'max_tokens'])
  assert [s.reward for s in steps] == [1.0, 0.0]
  assert steps[0].info['cut'] == 'max_turns' and steps[0].info['reason'] == 'the hidden test passed'
  assert a.done and b.done


def test_lexical_fallback_without_a_hidden_test(plain):
  rec = record(test=None, visible_test=None)
  eps = plain.reset([rec] * 4)
  observe(plain, eps, [call('edit', **FIX), call('edit', path='calc.py', old='x - 7', new='x + 8'),
                       call('read_file', path='calc.py'), call('edit', path='e', old='', new='')])
  steps = plain.step(eps, ['done'] * 4)
  assert steps[0].reward == 1.0 and steps[0].info['reason'] == 'exact match with the gold patch'
  assert 0.0 < steps[1].reward < 1.0 and steps[1].info['tests'] == 'not run'
  assert steps[2].reward == 0.0 and steps[2].info['reason'] == 'the files are unchanged'
  assert steps[3].reward == 0.0 and steps[3].info == {
      'tests': 'not run', 'files_changed': ['e'],
      'reason': 'only empty files were created or deleted'}
  assert not plain._sandboxes  # pylint: disable=protected-access  # No code ran.
  assert swe_agent.diff({'a': 'x\n'}, {'a': 'y\n', 'b': 'z\n'}) == (
      '--- a/a\n+++ b/a\n@@ -1,2 +1,2 @@\n-x\n+y\n \n'
      '--- /dev/null\n+++ b/b\n@@ -1 +1,2 @@\n+z\n \n')
  for before, after in (({'a': 'x\n'}, {'a': 'x\ny'}), ({'a': 'x'}, {}), ({}, {'b/c': 'q'}),
                        ({'a': '1\n2\n3\n'}, {'a': '0\n2\n3\n4\n', 'n': 'z'})):
    assert unidiff.apply(unidiff.parse(swe_agent.diff(before, after)), before) == after


def test_a_test_run_sees_only_its_episodes_files(env):
  probe = "import os\ndef files():\n    return sorted(os.listdir('.'))\n"
  test = "from probe import files\nassert files() == ['calc.py', 'probe.py'], files()\n"
  rec = record(repo={'calc.py': CALC, 'probe.py': probe}, visible_test=test)
  eps = env.reset([rec] * 4)
  observe(env, eps[1:3], [call('edit', path='b_only.py', old='', new='')] * 2)
  results = observe(env, eps, [call('run_tests')] * 4)  # One batch, two sandbox servers.
  assert results[0] == results[3] == ['passed'] and results[2] == results[1]
  assert "['b_only.py', 'calc.py', 'probe.py']" in results[1][0]


def test_hostile_code_is_contained_and_scores_0(env, tmp_path):
  secret = tmp_path / 'secret.txt'
  secret.write_text('the secret')
  outside = tmp_path / 'written_outside'
  rec = record(repo={'calc.py': 'def calc(x):\n    return 0\n'},
               test='from calc import calc\nassert calc(0) == 1\n')
  hostile = {
      'read a host file': f'def calc(x):\n    return int(open({str(secret)!r}).read() == '
                          "'the secret')\n",
      'read /etc/passwd': "def calc(x):\n    return int(open('/etc/passwd').read()[:5] == "
                          "'root:')\n",
      'write outside': f'def calc(x):\n    try:\n        open({str(outside)!r}, "w").write("x")\n'
                       '    except OSError:\n        return 0\n    return 1\n',
      'fork many': 'import os, time\ndef calc(x):\n    for _ in range(100):\n'
                   '        if os.fork() == 0:\n'
                   '            time.sleep(60)\n            os._exit(0)\n'
                   '    return 1\n',
      'exhaust memory': "def calc(x):\n    b = ['x' * (1 << 20) for _ in range(4096)]\n"
                        '    return 1\n',
  }
  eps = env.reset([rec] * len(hostile))
  observe(env, eps, [call('edit', path='calc.py', old='def calc(x):\n    return 0\n', new=code)
                     for code in hostile.values()])
  steps = env.step(eps, ['done'] * len(eps))
  assert [s.reward for s in steps] == [0.0] * len(hostile), [s.info for s in steps]
  assert not outside.exists()
  assert all(s.info['sandbox_error'] is False for s in steps)
  sandbox = env._sandboxes['hidden']  # pylint: disable=protected-access
  assert not [p for p in psutil.process_iter(['uids'])
              if p.info['uids'] and p.info['uids'].real in set(sandbox.uids)]  # No process left.
  (after,) = env.reset([record()])
  observe(env, [after], [call('edit', **FIX)])
  assert env.step([after], ['done'])[0].reward == 1.0  # The sandbox still works.


def test_an_added_module_cannot_stand_in_for_one_the_test_imports(env):
  rec = record(test="import shlex\nfrom calc import calc\n"
                    "assert calc(3) == 20 or shlex.quote('') == 'x'\n")
  (ep,) = env.reset([rec])
  observe(env, [ep], [call('edit', path='shlex.py', old='', new="def quote(v):\n    return 'x'\n")])
  (s,) = env.step([ep], ['done'])
  assert s.reward == 0.0 and s.info['files_changed'] == ['shlex.py']


# Sets a default ACL on the work dir at import: on a reused work dir it made every file the
# harness wrote there later mode 000, so every later fix on that server failed to import.
_POISON = ('import os, struct\ntry:\n    os.setxattr(".", "system.posix_acl_default", '
           'struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, 0, 0xFFFFFFFF) '
           'for t in (1, 4, 32)))\nexcept OSError:\n    pass\n')


def test_an_acl_left_by_one_episode_changes_no_later_score(env):
  """Episodes that set a default ACL where the sandbox writes files (in run_tests and in their
  own scoring, on both servers of each sandbox) score on their own merit; later right fixes on
  the same servers still pass run_tests and score 1."""
  right, wrong = _POISON + CALC.replace('x - 7', 'x + 7'), _POISON + CALC.replace('x - 7', 'x + 8')
  poisoners = env.reset([record()] * 2)
  observe(env, poisoners, [call('edit', path='calc.py', old=CALC, new=text)
                           for text in (right, wrong)])
  assert [t[0].split(' ')[0] for t in observe(env, poisoners, [call('run_tests')] * 2)] == [
      'passed', 'failed']
  assert [s.reward for s in env.step(poisoners, ['done'] * 2)] == [1.0, 0.0]
  later = env.reset([record()] * 2)
  observe(env, later, [call('edit', **FIX)] * 2)
  assert observe(env, later, [call('run_tests')] * 2) == [['passed']] * 2
  steps = env.step(later, ['done'] * 2)
  assert [s.reward for s in steps] == [1.0, 1.0], [s.info['reason'] for s in steps]


def test_a_dot_dot_name_is_a_file_the_tests_see(env):
  """'..notes.txt' is a legitimate file name: the tools take it and the sandbox writes it (one path
  rule, `verifiers.sandbox.server.normalize_path`); '..' as a component is refused by both."""
  reads = (CALC.replace('x - 7', 'x + 7')
           + '\n\ndef notes():\n    return open("..notes.txt").read()\n')
  check = 'from calc import notes\nassert notes() == "hello", notes()\n'
  (ep,) = env.reset([record(test=HIDDEN + check, visible_test=VISIBLE + check)])
  out = observe(env, [ep], [call('edit', path='..notes.txt', old='', new='hello')
                            + call('edit', path='calc.py', old=CALC, new=reads)
                            + call('edit', path='x/../..notes.txt', old='', new='hello')
                            + call('run_tests')])
  assert out[0][:2] == ['created ..notes.txt', 'edited calc.py']
  assert out[0][2].startswith("error: path 'x/../..notes.txt' leaves the repository"), out
  assert out[0][3] == 'passed', out
  (s,) = env.step([ep], ['done'])
  assert s.reward == 1.0 and s.info['files_changed'] == ['..notes.txt', 'calc.py'], s.info


def test_close_stops_the_sandbox_and_a_later_run_restarts_it(bwrap_sandbox):
  del bwrap_sandbox
  env = swe_agent.SweAgentEnv(workers=1, timeout_s=5)
  (ep,) = env.reset([record()])
  assert observe(env, [ep], [call('run_tests')])[0][0].startswith('failed')
  pids = env._sandboxes['visible'].server_pids  # pylint: disable=protected-access
  assert pids and all(psutil.pid_exists(p) for p in pids)
  env.close()
  assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                 for p in pids)
  observe(env, [ep], [call('edit', **FIX)])
  assert env.step([ep], ['done'])[0].reward == 1.0
  env.close()


def test_isolation_none_opt_out_runs_tests():
  with swe_agent.SweAgentEnv(isolation='none', workers=1, timeout_s=5) as env:
    (ep,) = env.reset([record()])
    observe(env, [ep], [call('edit', **FIX)])
    assert observe(env, [ep], [call('run_tests')]) == [['passed']]
    (s,) = env.step([ep], ['done'])
  assert s.reward == 1.0 and s.info['isolation'] == 'none'


# -- the tiny-world domain ----------------------------------------------------------


def test_prompt_records_and_split():
  train = tasks.draw(0, 300, common.TRAIN, 'rl')
  sft = tasks.draw(0, 300, common.TRAIN, 'sft')
  held = tasks.draw(0, 60, common.HELDOUT, 'rl')
  keys = lambda ts: {t.key for t in ts}
  assert not keys(train) & keys(held) and not keys(sft) & keys(held) and not keys(train) & keys(sft)
  assert all(common.split_of(swe_tasks.DOMAIN, t.key, 10) == common.HELDOUT for t in held)
  assert all(common.split_of(swe_tasks.DOMAIN, t.key, 10) == common.TRAIN for t in train + sft)
  recs = tasks.prompt_records(0, 40, common.HELDOUT)
  assert recs == tasks.prompt_records(0, 40, common.HELDOUT)
  assert [r['id'] for r in recs[:2]] == ['swe_agent/heldout/00000', 'swe_agent/heldout/00001']
  for r, t in zip(recs, held):
    assert r['domain'] == 'swe_agent' and r['messages'] == [{'role': 'user', 'content': t.prompt}]
    assert t.prompt.startswith(f'Fix {t.path}. Issue: ') and '\n' not in t.prompt
    assert list(r['metadata']['repo']) == [t.path] and len(t.cases) == 2
    swe_agent.SweAgentEnv.validate_metadata(r['metadata'], r['id'])
    assert r['metadata']['test'].startswith(r['metadata']['visible_test'])


def test_gold_fixes_score_1_and_the_bugs_fail(env):
  recs = tasks.prompt_records(0, 30, common.TRAIN)
  eps = env.reset(recs)
  before = observe(env, eps, [call('run_tests')] * len(eps))
  assert all(out[0].startswith('failed (runtime_error): ') and ' gave ' in out[0]
             for out in before), before
  patched = observe(env, eps, [call('apply_patch', patch=r['metadata']['gold_patch'])
                               for r in recs])
  assert all(out[0].startswith('patched ') for out in patched)
  assert [s.reward for s in env.step(eps, ['done'] * len(eps))] == [1.0] * len(eps)


def test_demonstrations_replay_to_their_rewards(env):
  demos = tasks.sft_records(0, 30, flaw_rate=0.6, workers=2)
  assert demos == tasks.sft_records(0, 30, flaw_rate=0.6, workers=2)
  flawed = [d for d in demos if d.get('flawed')]
  assert 8 <= len(flawed) <= 28
  kinds = collections.Counter()
  for d in demos:
    turns = d['turns']
    assert [t['role'] for t in turns[::2]] == ['assistant'] * len(turns[1::2]) + ['assistant']
    assert all(t['role'] == 'tool' for t in turns[1::2]) and turns[-1]['content'] == 'done'
    for t in turns[:-1:2]:
      parsed = chat.parse_tool_calls(t['content'])
      assert len(parsed.calls) == 1 and not parsed.errors and not parsed.content
      assert t['content'] == call(parsed.calls[0].name, **parsed.calls[0].arguments)
    assert sum(len(t['content']) for t in turns) < 500  # The tiny model's context is short.
    names = [json.loads(t['content'].split('\n')[1])['name'] for t in turns[:-1:2]]
    kinds[(bool(d.get('flawed')), tuple(names))] += 1
  assert set(kinds) == {(False, ('read_file', 'edit', 'run_tests')), (True, ('read_file', 'edit')),
                        (True, ('edit',)), (True, ('read_file',))}
  eps = env.reset(demos)
  for turn in range(0, max(len(d['turns']) for d in demos), 2):
    live = [i for i, d in enumerate(demos) if turn < len(d['turns'])]
    steps = env.step([eps[i] for i in live], [demos[i]['turns'][turn]['content'] for i in live])
    for i, s in zip(live, steps):
      want = demos[i]['turns'][turn + 1:turn + 2]
      assert [dict(m) for m in s.messages] == want
      if s.done:
        assert s.reward == (0.0 if demos[i].get('flawed') else 1.0), (demos[i], s.info)
  assert all(ep.done for ep in eps)


def test_demonstration_flaw_rates():
  with pytest.raises(ValueError, match=r'flaw_rate=1.5 must be in \[0, 1\]'):
    tasks.sft_records(0, 1, 1.5)
  assert tasks.sft_records(0, 0, 0.5) == []
