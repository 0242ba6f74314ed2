"""SWE verifier: diff parsing and application, the paper's lexical reward, execution mode."""

import pytest

import verifiers
from verifiers import swe
from verifiers import unidiff

S = verifiers.Sample
REPO = {'calc.py': 'def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n',
        'README.md': 'calc\n'}
GOLD = """diff --git a/calc.py b/calc.py
index 1111111..2222222 100644
--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a - b
+    return a + b
"""
TEST = 'from calc import add, mul\nassert add(2, 3) == 5\nassert mul(2, 3) == 6\n'


def test_parse_and_apply():
  patch = unidiff.parse(GOLD)
  assert [(f.old_path, f.new_path) for f in patch] == [('calc.py', 'calc.py')]
  assert patch[0].hunks[0].lines == ((' ', 'def add(a, b):'), ('-', '    return a - b'),
                                     ('+', '    return a + b'))
  files = unidiff.apply(patch, REPO)
  assert files['calc.py'].startswith('def add(a, b):\n    return a + b\n') and files['README.md']
  assert REPO['calc.py'].count('a - b') == 1  # Input untouched.
  # Wrong line numbers and counts are recounted; new, deleted and renamed files work.
  multi = ('--- a/calc.py\n+++ b/calc.py\n@@ -40,9 +40,9 @@\n def mul(a, b):\n-    return a * b\n'
           '+    return b * a\n--- /dev/null\n+++ b/new.py\n@@ -0,0 +1,2 @@\n+x = 1\n+y = 2\n'
           '--- a/README.md\n+++ /dev/null\n@@ -1 +0,0 @@\n-calc\n')
  files = unidiff.apply(unidiff.parse(multi), REPO)
  assert files['calc.py'].endswith('return b * a\n')
  assert files['new.py'] == 'x = 1\ny = 2\n' and 'README.md' not in files
  with pytest.raises(ValueError, match='does not apply'):
    unidiff.apply(unidiff.parse(GOLD.replace('a - b', 'a / b')), REPO)
  with pytest.raises(ValueError, match='not in the repo'):
    unidiff.apply(unidiff.parse(GOLD.replace('calc.py', 'other.py')), REPO)


def test_pure_insertions_land_after_the_line_their_header_names():
  """A context-free hunk that only inserts ('@@ -3,0 +4 @@', what `diff -U0` writes) goes after
  line 3, as patch(1) puts it; '-0,0' inserts at the top."""
  import difflib  # pylint: disable=g-import-not-at-top
  rng = __import__('random').Random(0)
  for _ in range(200):
    old = [f'line{i}' for i in range(rng.randrange(0, 8))]
    new = list(old)
    for _ in range(rng.randrange(1, 4)):
      new.insert(rng.randrange(0, len(new) + 1), f'new{rng.randrange(100)}')
    diff = ''.join(difflib.unified_diff([x + '\n' for x in old], [x + '\n' for x in new],
                                        'a/f.py', 'b/f.py', n=0))
    got = unidiff.apply(unidiff.parse(diff), {'f.py': ''.join(x + '\n' for x in old)})
    assert got['f.py'] == ''.join(x + '\n' for x in new), diff


def test_execution_tests_import_only_the_repositorys_own_modules():
  """A patch that adds a module named like one the test imports from elsewhere cannot replace it:
  this test passes only if `colorsys` is the candidate's."""
  test = 'import colorsys\nassert colorsys.rgb_to_hsv(0, 0, 0) == "HIJACKED"\n'
  hijack = GOLD + ('--- /dev/null\n+++ b/colorsys.py\n@@ -0,0 +1 @@\n'
                   '+def rgb_to_hsv(*a): return "HIJACKED"\n')
  with verifiers.get('swe', execution=True, workers=1, timeout_s=5) as v:
    r = v.score([S('p', hijack, {'repo': REPO, 'test': test}),
                 S('p', hijack, {'repo': REPO, 'test': TEST})])
  assert [x.reward for x in r] == [0.0, 1.0], [x.info for x in r]


@pytest.mark.parametrize('text, match', [
    ('just prose', 'no "--- a/file"'),
    ('--- a/x\n+++ b/x\n', 'without hunks'),
    ('--- a/x\n+++ b/x\n@@ bogus @@\n-a\n', 'malformed hunk header'),
    ('--- a/x\n+++ b/x\n@@ -1 +1 @@\nprose right away\n', 'empty hunk'),
])
def test_unparsable(text, match):
  with pytest.raises(ValueError, match=match):
    unidiff.parse(text)


@pytest.mark.parametrize('answer, reward', [
    (GOLD, 1.0),
    ('Here is the fix:\n```diff\n' + GOLD.split('\n', 2)[2] + '```\nDone.', 1.0),
    # More context and other line numbers: the same change.
    ('--- a/calc.py\n+++ b/calc.py\n@@ -1,3 +1,3 @@\n def add(a, b):\n-    return a - b\n'
     '+    return a + b   \n \n', 1.0),
    ('no diff here', -1.0),
    ('--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n     return a - b\n', 0.0),
    ('--- a/calc.py\n+++ b/calc.py\n@@ -2 +2 @@\n-    return a - b\n+    return a - b\n', 0.0),
])
def test_lexical_reward_fixed_points(answer, reward):
  assert swe.lexical_reward(answer, GOLD)[0] == reward


def test_lexical_similarity_is_strictly_between_0_and_1_and_ordered():
  close, _ = swe.lexical_reward(GOLD.replace('a + b', 'b + a'), GOLD)
  far, _ = swe.lexical_reward('--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-calc\n'
                              '+a calculator library\n', GOLD)
  assert 0 < far < close < 1


def test_lexical_verifier_through_workers():
  with verifiers.get('swe', workers=1) as v:
    r = v.score([S('p', GOLD, {'gold_patch': GOLD}), S('p', 'nothing', {'gold_patch': GOLD}),
                 S('p', '<think>--- a/x', {'gold_patch': GOLD})])
  assert [x.reward for x in r] == [1.0, -1.0, 0.0]


@pytest.mark.usefixtures('bwrap_sandbox')
def test_execution_mode():
  md = {'repo': REPO, 'test': TEST, 'gold_patch': GOLD}
  exits = GOLD.replace('+    return a + b', '+    return a + b\n+import sys; sys.exit(0)')
  swapped = GOLD.replace('a + b', 'b + a')  # Different text, same behaviour.
  with verifiers.get('swe', execution=True, workers=2, timeout_s=5) as v:
    r = v.score([S('p', GOLD, md), S('p', swapped, md), S('p', GOLD.replace('a + b', 'a * b'), md),
                 S('p', exits, md), S('p', 'prose', md),
                 S('p', GOLD.replace('a - b', 'a / b'), md), S('p', GOLD, {'gold_patch': GOLD})])
  assert [x.reward for x in r] == [1.0, 1.0, 0.0, 0.0, -1.0, 0.0, 0.0]
  assert r[3].info['status'] == 'runtime_error' and 'SystemExit' in r[3].info['reason']
  assert 'does not apply' in r[5].info['reason']
  assert r[6].info['reason'].startswith("bad metadata: metadata['repo'] is missing")


@pytest.mark.usefixtures('bwrap_sandbox')
def test_execution_paths_follow_the_sandboxs_rule():
  """'..notes.txt' is a file name: a right patch that adds one scores 1 (the sandbox writes it by
  the same rule, `verifiers.sandbox.server.normalize_path`); '..' as a component does not apply."""
  reads = ('--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,6 @@\n def add(a, b):\n-    return a - b\n'
           '+    return a + b\n+\n+\n+def notes():\n+    return open("..notes.txt").read()\n')

  def adds(path):
    return reads + f'--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+hello\n'
  test = TEST + 'from calc import notes\nassert notes().strip() == "hello", notes()\n'
  md = {'repo': REPO, 'test': test}
  with verifiers.get('swe', execution=True, workers=1, timeout_s=5) as v:
    r = v.score([S('p', adds('..notes.txt'), md), S('p', adds('./..notes.txt'), md),
                 S('p', adds('../..notes.txt'), md), S('p', adds('x/../..notes.txt'), md),
                 S('p', adds('/tmp/..notes.txt'), md),
                 S('p', 'x', {'repo': {'../a.py': ''}, 'test': TEST})])
  report = [(x.reward, x.info['reason'][-300:]) for x in r]
  assert [x.reward for x in r] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0], report
  assert all('does not apply' in x.info['reason'] for x in r[2:5]), report
  assert "path '../..notes.txt' leaves the repository" in r[2].info['reason']
  assert "metadata[\"repo\"]: path '../a.py' leaves" in r[5].info['reason']
