"""Grader options from the command line and the config (`--suite_option`,
config.eval.suite_options): ArenaHard v2 judged through `cascade.evaluate`'s own path against a
loopback served judge, checked in one line before anything samples, kept in grades.jsonl's
header so a rerun under another judge or baseline is judged afresh."""

import json
import os
import shutil

import pytest

from cascade import config as config_lib
from cascade.suites import arena_hard
from cascade.suites import checkpoint
from cascade.suites import run
from tests.cascade.suites import canned

FIXTURES = os.path.join(os.path.dirname(__file__), '..', '..', 'fixtures', 'suites')
V2 = arena_hard.arena_hard_v2


class FixedSampler:
  """Answers every prompt with `text` (one id per character), as `rl.sampler.Sampler` does."""

  def __init__(self, text):
    self.text, self.calls = text, 0

  def generate(self, params, prompts, rng, sp, num_samples=1):
    del params, rng
    self.calls += 1
    return canned.output([ord(c) for c in self.text], prompts, num_samples,
                         sp.max_new_tokens)


def _policy(fakes, text='A GOOD answer.'):
  return run.Policy(FixedSampler(text), None, fakes.CharTokenizer(), 'policy-1')


def fair_judge(body, attempt):
  """Prefers the answer that says GOOD, strongly (assistant B's block is the second)."""
  del attempt
  user = body['messages'][-1]['content']
  a, b = user.split("<|The Start of Assistant B's Answer|>")
  verdict = {(True, False): 'A>>B', (False, True): 'B>>A'}.get(('GOOD' in a.split(
      "<|The Start of Assistant A's Answer|>")[1], 'GOOD' in b), 'A=B')
  return f'Read both.\n\nMy final verdict is: [[{verdict}]]'


def test_suite_option_items_parse_to_per_suite_options_and_bad_ones_are_one_line():
  from cascade.suites import options  # pylint: disable=g-import-not-at-top
  got = options.suite_options(['arena_hard_v2.url=http://judge:8000/v1',
                                'arena_hard_v2.retries=0', 'arena_hard_v2.temperature=0.5',
                                'arena_hard_v2.extra_body={"top_k": 1}', 'ifeval.workers=2'])
  assert got == {'arena_hard_v2': {'url': 'http://judge:8000/v1', 'retries': 0,
                                   'temperature': 0.5, 'extra_body': {'top_k': 1}},
                 'ifeval': {'workers': 2}}
  for bad in ('arena_hard_v2url=x', 'arena_hard_v2.url', '.url=x', 'arena_hard_v2.=x'):
    with pytest.raises(config_lib.ConfigError, match=r'^--suite_option: .* is not '
                                                     r'SUITE\.KEY=VALUE'):
      options.suite_options([bad])
  with pytest.raises(config_lib.ConfigError, match=r'^--suite_option: .* is not JSON'):
    options.suite_options(['arena_hard_v2.extra_body={bad'])


def test_grader_options_come_from_the_run_then_the_flags_and_are_checked_before_sampling(
    tmp_path):
  work = tmp_path / 'run'
  (work / 'stages' / '00_sft' / 'hf').mkdir(parents=True)
  (work / 'stages' / '00_sft' / 'hf' / 'config.json').write_text('{}')
  (work / 'progress.json').write_text(json.dumps(
      {'done': {'sft': {'index': 0, 'hf': 'x/stages/00_sft/hf'}}}))
  (work / 'config.json').write_text(json.dumps({'config': {'eval': {
      'suites': ['arena_hard_v2'],
      'suite_options': {'arena_hard_v2': {'url': 'http://run-judge:1/v1', 'retries': 2}}}}}))
  src = checkpoint.resolve(str(work))
  plan = checkpoint.plan([], src)
  assert checkpoint.grader_options(plan, src) == {
      'arena_hard_v2': {'url': 'http://run-judge:1/v1', 'retries': 2}}
  got = checkpoint.grader_options(plan, src, {'arena_hard_v2': {'url': 'http://cli:2/v1'}})
  assert got == {'arena_hard_v2': {'url': 'http://cli:2/v1', 'retries': 2}}

  hf = checkpoint.resolve(str(work / 'stages' / '00_sft' / 'hf'))
  plan = checkpoint.plan(['arena_hard_v2'], hf)
  bad = [
      ({}, r"^grader options: suite 'arena_hard_v2' needs its judge, one of: url= .* "
           r'--suite_option=arena_hard_v2\.url=http://host:8000/v1'),
      ({'url': 'http://j:1/v1', 'judge': str(tmp_path)}, 'needs its judge, one of'),
      ({'url': 'http://j:1/v1', 'bogus': 1}, r"suite 'arena_hard_v2'.*bogus"),
      ({'url': 'ftp://j/v1'}, r'url=.* must be an http:// or https:// API base'),
      ({'url': 'http://j:1/v1', 'retries': -1}, r'retries=-1 must be an int >= 0'),
      ({'judge': str(tmp_path / 'nowhere')}, r'judge=.*nowhere: no HF checkpoint there'),
      ({'judge': str(work / 'stages' / '00_sft' / 'hf'), 'cache_dir': 'c'},
       r"\['cache_dir'\] are options of a served judge"),
      ({'url': 'http://j:1/v1', 'baseline_answers': str(tmp_path / 'none.jsonl')},
       r'baseline_answers=.*none\.jsonl: no such file'),
  ]
  for opts, pattern in bad:
    with pytest.raises(config_lib.ConfigError, match=pattern) as e:
      checkpoint.grader_options(plan, hf, {'arena_hard_v2': opts})
    assert '\n' not in str(e.value)
  with pytest.raises(config_lib.ConfigError, match=r"--suite_option: names suite 'ifeval', "
                                                   'which is not evaluated'):
    checkpoint.grader_options(plan, hf, {'arena_hard_v2': {'url': 'http://j:1/v1'},
                                         'ifeval': {'workers': 1}})
  # A local judge's directory is checked by its config.json, its model not loaded.
  ok = {'judge': str(work / 'stages' / '00_sft' / 'hf')}
  assert checkpoint.grader_options(plan, hf, {'arena_hard_v2': ok}) == {'arena_hard_v2': ok}


def test_config_eval_suite_options_are_checked_with_the_config(fakes):
  import dataclasses  # pylint: disable=g-import-not-at-top
  plan = fakes.toy_config([fakes.SFT_STAGE])

  def check(**fields):
    ev = dataclasses.replace(plan.eval, **fields)
    ev.check(config_lib.schema.failer('config.eval', ev, sep='.'))
    return ev
  with pytest.raises(config_lib.ConfigError, match=r"config\.eval\.suite_options\.arena_hard_v2:"
                                                   r" suite 'arena_hard_v2' needs its judge"):
    check(suites=('arena_hard_v2',))
  with pytest.raises(config_lib.ConfigError, match=r"config\.eval\.suite_options: names suite "
                                                   r"'ifeval', which config\.eval\.suites"):
    check(suites=('arena_hard_v2',), suite_options={
        'arena_hard_v2': {'url': 'http://j:1/v1'}, 'ifeval': {}})
  ev = check(suites=('arena_hard_v2',), suite_options={'arena_hard_v2': {'url': 'http://j:1/v1'}})
  assert ev.grader_options('arena_hard_v2') == {'url': 'http://j:1/v1'}
  assert ev.grader_options('other') == {}


def test_arena_hard_v2_is_judged_through_the_evaluate_path_and_resumed_per_judge(
    fakes, fake_openai, tmp_path):
  server = fake_openai(fair_judge)
  data = tmp_path / 'data'
  shutil.copytree(os.path.join(FIXTURES, 'arena_hard_v2'), data / 'arena_hard_v2')
  src = checkpoint.Source(hf_dir=str(tmp_path / 'hf'))
  plan = checkpoint.plan(['arena_hard_v2'], src, {'max_new_tokens': 32})
  cli = {'arena_hard_v2': {'url': server.url, 'retries': 0,
                           'cache_dir': str(tmp_path / 'judge_cache')}}
  options = checkpoint.grader_options(plan, src, cli)
  sets = [(s, checkpoint.read(s, str(data))) for s in plan]
  said = []
  res = checkpoint.evaluate(sets, _policy(fakes), str(tmp_path / 'eval'), batch_size=2,
                            grader_options=options, say=said.append)['arena_hard_v2']
  # Three questions, one answer each, two games each: every game won strongly.
  assert server.requests == 6
  assert (res['value'], res['n'], res['games'], res['missing']) == (100.0, 2, 6, 0)
  assert res['judge'] == 'gpt-4.1 (served)' and res['creative_writing'] == 100.0
  assert res['baseline'] == 'gemini-2.0-flash-001, o3-mini-2025-01-31'
  head = json.loads((tmp_path / 'eval' / 'arena_hard_v2' / 'grades.jsonl').read_text()
                    .splitlines()[0])['header']
  assert head['grader'] == {'model': 'gpt-4.1'}   # where and how often it is asked: not kept
  # The same judge elsewhere: the kept grades are resumed, nothing judged again.
  moved = dict(cli['arena_hard_v2'], url=fake_openai(fair_judge).url, cache_dir='')
  again = checkpoint.evaluate(sets, _policy(fakes), str(tmp_path / 'eval'), batch_size=2,
                              grader_options={'arena_hard_v2': moved}, say=said.append)
  assert again['arena_hard_v2']['resumed'] == 2 and server.requests == 6
  # Another judge model: judged afresh (its model name reaches the endpoint).
  other = dict(cli['arena_hard_v2'], model='my-genrm')
  checkpoint.evaluate(sets, _policy(fakes), str(tmp_path / 'eval'), batch_size=2,
                      grader_options={'arena_hard_v2': other}, say=said.append)
  assert server.requests == 12 and server.bodies[-1]['model'] == 'my-genrm'
  assert any('is not resumed (its grader differ(s)' in s for s in said)


def test_a_baseline_answers_file_replaces_the_releases_baseline(fakes, fake_openai, tmp_path):
  server = fake_openai(fair_judge)
  data = tmp_path / 'data'
  shutil.copytree(os.path.join(FIXTURES, 'arena_hard_v2'), data / 'arena_hard_v2')
  src = checkpoint.Source(hf_dir=str(tmp_path / 'hf'))
  plan = checkpoint.plan(['arena_hard_v2'], src, {'max_new_tokens': 32})
  sets = [(s, checkpoint.read(s, str(data))) for s in plan]
  mine = tmp_path / 'my-model.jsonl'
  # The current layout (uid, messages[-1].content.answer); every baseline answer is GOOD.
  mine.write_text(''.join(json.dumps({'uid': r['id'], 'model': 'my-model', 'messages': [
      {'role': 'user', 'content': 'q'},
      {'role': 'assistant', 'content': {'answer': 'A GOOD baseline.'}}]}) + '\n'
                          for r in sets[0][1]))
  opts = {'url': server.url, 'retries': 0, 'baseline_answers': str(mine)}
  options = checkpoint.grader_options(plan, src, {'arena_hard_v2': opts})
  res = checkpoint.evaluate(sets, _policy(fakes), str(tmp_path / 'eval'), batch_size=2,
                            grader_options=options, say=lambda _: None)['arena_hard_v2']
  assert (res['value'], res['baseline'], res['metric']) == (
      50.0, 'my-model', 'hard-prompt win rate vs my-model')          # ties throughout
  assert all('A GOOD baseline.' in b['messages'][-1]['content'] for b in server.bodies)
  head = json.loads((tmp_path / 'eval' / 'arena_hard_v2' / 'grades.jsonl').read_text()
                    .splitlines()[0])['header']
  assert len(head['grader']['baseline_answers']) == 16     # the file's content hash
  # A file without an answer to every question: a one-line error naming it and the question.
  mine.write_text(mine.read_text().splitlines()[0] + '\n')
  with pytest.raises(ValueError, match=r'baseline_answers=.*my-model\.jsonl has no answer to '
                                       "question '8e4b0d3f2c5e6b71'"):
    checkpoint.evaluate(sets, _policy(fakes), str(tmp_path / 'eval2'), batch_size=2,
                        grader_options={'arena_hard_v2': opts}, say=lambda _: None)


def _cli(args, cwd, timeout=900):
  import pathlib  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  repo = pathlib.Path(__file__).resolve().parents[3]
  env = dict(os.environ, PYTHONPATH=str(repo), JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-m', 'cascade.evaluate'] + args, cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


def test_the_command_without_a_judge_is_one_line_and_exit_2_before_loading(tmp_path):
  (tmp_path / 'hf').mkdir()
  (tmp_path / 'hf' / 'config.json').write_text('{}')       # never loaded: refused before
  out = _cli([f'--checkpoint={tmp_path / "hf"}', '--suites=arena_hard_v2',
              f'--data_dir={FIXTURES}'], tmp_path, timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().startswith("error: grader options: suite 'arena_hard_v2' needs its "
                                       'judge, one of: url=')
  assert '\n' not in out.stderr.strip()
  out = _cli([f'--checkpoint={tmp_path / "hf"}', '--suites=arena_hard_v2',
              f'--data_dir={FIXTURES}', '--suite_option=arena_hard_v2'], tmp_path, timeout=300)
  assert out.returncode == 2 and out.stderr.strip() == (
      "error: --suite_option: 'arena_hard_v2' is not SUITE.KEY=VALUE (e.g. "
      'arena_hard_v2.url=http://host:8000/v1)')


@pytest.mark.heavy
def test_the_command_judges_arena_hard_v2_on_a_checkpoint_through_a_served_judge(
    tiny_hf, fake_openai, tmp_path):
  """docs/evaluation.md's ArenaHard command: a tiny HF checkpoint's answers, judged by a loopback
  judge named with --suite_option, scored, reported and resumed from the judge's cache."""
  server = fake_openai(lambda body, attempt: 'Much alike.\n\nMy final verdict is: [[A=B]]')
  args = [f'--checkpoint={tiny_hf}', '--suites=arena_hard_v2', f'--data_dir={FIXTURES}',
          f'--suite_option=arena_hard_v2.url={server.url}',
          f'--suite_option=arena_hard_v2.cache_dir={tmp_path / "judge_cache"}',
          '--suite_option=arena_hard_v2.retries=0', '--max_new_tokens=16',
          f'--workdir={tmp_path / "eval"}']
  out = _cli(args, tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  assert server.requests == 6
  assert all(b['model'] == 'gpt-4.1' for b in server.bodies)
  rep = json.loads((tmp_path / 'eval' / 'evaluation.json').read_text())
  res = rep['suites']['arena_hard_v2']
  # A judge calling every game a tie.
  assert (res['value'], res['games'], res['missing'], res['judge']) == (
      50.0, 6, 0, 'gpt-4.1 (served)')
  assert '| arena_hard_v2 | hard-prompt win rate vs o3-mini | 50.0 ±' in out.stdout
  # Another workdir, the same judge cache: sampled again, judged from the cache.
  out = _cli(args[:-1] + [f'--workdir={tmp_path / "eval2"}'], tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  assert server.requests == 6


def test_other_suites_grader_options_are_checked_by_building_their_graders():
  src = checkpoint.Source(hf_dir='x')
  plan = checkpoint.plan(['ifeval', 'bfcl_v3_simple'], src)
  assert checkpoint.grader_options(plan, src, {'ifeval': {'workers': 2}}) == {
      'ifeval': {'workers': 2}, 'bfcl_v3_simple': {}}
  for opts, pattern in (({'ifeval': {'bogus': 1}}, r"suite 'ifeval': grader options \['bogus'\]"),
                        ({'bfcl_v3_simple': {'workers': 2}}, r"suite 'bfcl_v3_simple'.*takes none")):
    with pytest.raises(config_lib.ConfigError, match=pattern):
      checkpoint.grader_options(plan, src, opts)
