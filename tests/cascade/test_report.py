"""What a run prints about itself (cascade/report.py): the start banner, stage i of N with the
cascade's ETA, a line per domain evaluated, nothing from a process other than 0; the heavy test
runs the smoke config from the command line, stops it mid-stage and resumes it.

docs/what_a_run_prints.md quotes the heavy test's output; to regenerate it:

  CASCADE_REGEN_DOCS=1 .venv/bin/python -m pytest -q -p no:xdist -m heavy \
      tests/cascade/test_report.py::test_a_smoke_run_and_its_resume_explain_themselves
"""

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from cascade import config as config_lib
from cascade import evaluation
from cascade import report
from cascade import runner
from cascade import verifier_set
from configs import tiny
from configs import tiny_agentic
from models import sharding

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(fakes):
  return fakes.toy_config([fakes.SFT_STAGE, fakes.rl_stage('rl_a', ['a'], steps=4),
                           fakes.rl_stage('rl_b', ['b'], steps=10),
                           dict(name='final', kind='eval', init_from='sft')])


def _banner(plan, **kw):
  args = dict(workdir='/runs/w', command='configs/x.py:smoke --config.seed=1',
              config_hash='abc123', mesh=None, done=(), resume_step=None,
              isolation={'code': 'bwrap', 'math': 'n/a'}, cache_line='compilation cache: /c')
  args.update(kw)
  return report.banner(plan, **args)


def test_the_banner_names_config_workdir_devices_mesh_stages_and_isolation(fakes):
  plan = _plan(fakes)
  mesh = sharding.make_mesh((2, 2, 2))
  text = _banner(plan, mesh=mesh)
  lines = text.splitlines()
  assert lines[0] == 'cascade: config configs/x.py:smoke --config.seed=1 (hash abc123)'
  assert lines[1] == 'workdir: /runs/w'
  assert lines[2].startswith(f'devices: {jax.device_count()} cpu (')
  assert lines[2].endswith('; mesh: data=2 fsdp=2 tensor=2')
  assert lines[3] == 'stages: 4, 20 training steps in all'
  assert lines[4:8] == [
      '  [0] sft (sft): 6 steps on a, b; evaluated after',
      '  [1] rl_a (grpo): 4 steps on a; evaluated after',
      '  [2] rl_b (grpo): 10 steps on b; evaluated after',
      '  [3] final (eval): no training; evaluated after']
  assert lines[8] == 'resume: none, a new run'
  assert lines[9] == 'isolation: code=bwrap; no code run: math'
  assert lines[10] == 'compilation cache: /c'
  assert 'mesh: none (config.mesh.shape=None' in _banner(plan, cache_line=None)
  assert _banner(plan, cache_line=None).endswith('compilation cache: off')


def test_the_banner_and_results_name_each_stand_in_reward(fakes, tmp_path):
  """A reward that stands in for a paper's (config.domains.<d>.stand_in) is announced in the
  start banner and recorded in results.json and results.md as a substitution."""
  text = 'a Bradley-Terry reward model in place of the paper\'s generative one'
  plan = fakes.toy_config(_plan(fakes).source['stages'], domains={
      'b': dict(verifier='math', train='b_train', eval='b_train', stand_in=text)})
  assert plan.substitutions == {'b': text}
  lines = _banner(plan).splitlines()
  assert lines[-2:] == [f'stand-in reward: b: {text}', 'compilation cache: /c']
  assert not any('stand-in' in line for line in _banner(_plan(fakes)).splitlines())
  progress = types.SimpleNamespace(rows=[], done={}, isolation={})
  ctx = types.SimpleNamespace(workdir=str(tmp_path), progress=progress, plan=plan, ledger=None,
                              before_write=lambda: None)
  res = runner._write_results(ctx, ['a', 'b'])
  assert res['substitutions'] == {'b': text}
  assert json.loads((tmp_path / 'results.json').read_text())['substitutions'] == {'b': text}
  assert f"Stand-in rewards (not the paper's): b: {text}" in (tmp_path / 'results.md').read_text()
  with pytest.raises(config_lib.ConfigError, match=r'config.domains.b.stand_in=.*one line'):
    fakes.toy_config(_plan(fakes).source['stages'], domains={
        'b': dict(verifier='math', train='b_train', eval='b_train', stand_in='x\ny')})


def test_the_resume_line_says_what_is_done_and_where_the_next_stage_restarts(fakes):
  stages = _plan(fakes).stages
  assert report.resume_line(stages, ['sft'], 3) == (
      'resume: done sft; rl_a resumes at step 3/4 (its newest checkpoint)')
  assert report.resume_line(stages, ['rl_a', 'sft'], None) == (
      'resume: done sft, rl_a; rl_b starts from its beginning')
  assert report.resume_line(stages, [], 2) == (
      'resume: done none; sft resumes at step 2/6 (its newest checkpoint)')
  assert report.resume_line(stages, ['sft', 'rl_a', 'rl_b', 'final'], None) == (
      'resume: all 4 stages done (sft, rl_a, rl_b, final); nothing left to run')


def test_stage_lines_come_in_order_with_the_cascades_eta(fakes, capsys):
  plan = _plan(fakes)
  rep = report.Reporter(plan, enabled=True)
  assert rep.eta() is None
  # (steps run, steady s/step, evaluation s, export s, wall s) of each stage.
  for st, (ran, step_s, ev, ex, secs) in zip(plan.stages, [(6, 2.0, 6.0, 1.0, 30.0),
                                                          (4, 3.0, 4.0, 1.0, 25.0),
                                                          (10, 3.5, 4.0, 1.0, 65.0),
                                                          (0, 0.0, 3.0, 0.0, 5.0)]):
    rep.stage_started(st)
    if ex:
      rep.exported(st, f'/w/{st.name}/hf', ex)
    rep.evaluated(f'[{st.index}] {st.name}', 1, 2, 'a', {'score': 50.0, 'samples': 4}, ev / 2)
    rep.evaluated(f'[{st.index}] {st.name}', 2, 2, 'b', {'score': 50.0, 'samples': 4}, ev / 2)
    rep.stage_ended(st, ran, secs, step_s if ran else None)
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('stage ')]
  assert [l.split(':')[0] for l in lines] == [
      'stage 1 of 4', 'stage 1 of 4 done', 'stage 2 of 4', 'stage 2 of 4 done',
      'stage 3 of 4', 'stage 3 of 4 done', 'stage 4 of 4', 'stage 4 of 4 done']
  assert lines[0] == 'stage 1 of 4: [0] sft (sft), 6 steps on a, b'
  # sft: 30 s = 6 steps x 2 s + 6 s evaluation + 1 s export + 11 s start (compiles, setup).
  # Left: rl_a (4 steps), rl_b (10), final (0), no grpo or eval stage measured: each timed
  # as sft (2 s a step, an 11 s start); 3 evaluations of 6 s, 2 exports of 1 s.
  assert lines[1] == (
      'stage 1 of 4 done: [0] sft (sft) in 30 s; cascade ETA ~1 min 21 s (14 steps ~28 s, '
      '3 stage starts (compiles, setup) ~33 s, 3 evaluations ~18 s, 2 exports ~2 s; a guess: '
      'no grpo, eval stage ran yet, timed as sft)')
  # rl_a: 25 = 4 x 3 + 4 + 1 + 8. Left: rl_b at 3 s a step and an 8 s start (rl_a's), final
  # still a guess (timed as rl_a); evaluations as the last one, 4 s.
  assert lines[3] == (
      'stage 2 of 4 done: [1] rl_a (grpo) in 25 s; cascade ETA ~55 s (10 steps ~30 s, '
      '2 stage starts (compiles, setup) ~16 s, 2 evaluations ~8 s, 1 export ~1 s; a guess: '
      'no eval stage ran yet, timed as grpo)')
  # rl_b: 65 = 10 x 3.5 + 4 + 1 + 25. Left: final, timed as rl_b (its start 25 s) and an
  # evaluation (4 s).
  assert lines[5].endswith('cascade ETA ~29 s (0 steps ~0 s, 1 stage start (compiles, setup) '
                           '~25 s, 1 evaluation ~4 s; a guess: no eval stage ran yet, timed '
                           'as grpo)')
  assert lines[6] == 'stage 4 of 4: [3] final (eval), no training'
  assert lines[7] == ('stage 4 of 4 done: [3] final (eval) in 5 s; the cascade is done '
                      '(2 min 05 s in this run)')
  assert [t.start_s for t in rep.times] == [11.0, 8.0, 25.0, 2.0]


def test_the_eta_is_measured_once_every_kind_has_run(fakes):
  plan = _plan(fakes)
  sft, rl_a, rl_b, final = plan.stages
  times = [report.StageTime('sft', 2.0, 11.0), report.StageTime('grpo', 3.0, 8.0),
           report.StageTime('eval', 0.0, 2.0)]
  est = report.estimate([(rl_b, 10), (final, 0)], times, evals=[9.0, 4.0], exports=[1.0, 0.5])
  # rl_b: 10 x 3 + 8 + 4 + 0.5; final: 0 + 2 + 4.
  assert (est.steps, est.starts, est.evals, est.exports) == (10, 2, 2, 1)
  assert est.seconds == pytest.approx(30 + 8 + 2 + 2 * 4 + 0.5)
  assert est.guesses == ()
  assert est.describe().endswith("; each part as this run's stages measured it)")
  # Nothing evaluated or exported yet: those parts are guesses of 0 s.
  est = report.estimate([(rl_b, 10)], times, evals=[], exports=[])
  assert est.seconds == pytest.approx(38.0) and est.guesses == (
      'no evaluation ran yet, counted as 0 s', 'no export ran yet, counted as 0 s')
  assert report.estimate([(rl_b, 10)], [], [], []) is None


def test_the_steady_step_time_leaves_out_the_first_steps_compile():
  assert report.steady_step_s({'step_s': 40.0}, {'steps': 5, 'step_s': 48.0}) == 2.0
  assert report.steady_step_s({'step_s': 40.0}, {'steps': 1, 'step_s': 40.0}) == 40.0
  assert report.steady_step_s({}, {'steps': 4, 'step_s': 8.0}) == 2.0
  assert report.steady_step_s({'step_s': 1.0}, {}) is None


def test_durations_read_as_a_person_says_them():
  assert [report.duration(s) for s in (0.4, 59.6, 60, 605, 3599, 3600, 7620, 90000)] == [
      '0 s', '1 min 00 s', '1 min 00 s', '10 min 05 s', '59 min 59 s', '1 h 00 min',
      '2 h 07 min', '25 h 00 min']


def test_a_resumed_run_counts_only_the_steps_it_has_left(fakes, capsys):
  plan = _plan(fakes)
  rep = report.Reporter(plan, done=['sft'], resume_step=3, enabled=True)
  rl_a = plan.stages[1]
  rep.stage_ended(rl_a, 1, 4.0, 3.0)     # resumed at 3 of 4: one step run, 3 s, a 1 s start
  est = rep.eta()
  assert est.steps == 10 and est.seconds == pytest.approx(10 * 3.0 + 2 * 1.0)


def test_no_line_but_from_process_0(fakes, capsys, monkeypatch):
  plan = _plan(fakes)

  def everything():
    rep = report.Reporter(plan)
    rep.say(_banner(plan))
    rep.stage_started(plan.stages[0])
    rep.evaluated('[0] sft', 1, 2, 'a', {'score': 50.0, 'samples': 4}, 1.0)
    rep.stage_ended(plan.stages[0], 6, 12.0)
    runner._prepare(dataclasses.replace(plan, prepare=config_lib.Prepare(
        fn='os.path:exists', kwargs={'path': '/'})))
    return capsys.readouterr().out

  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  assert everything() == ''
  monkeypatch.setattr(jax, 'process_index', lambda: 0)
  out = everything().splitlines()
  assert out[0].startswith('cascade: config') and len(out) == 16
  assert out[12] == '[0] sft: eval 1/2 a 50.0 (4 samples, 1.0 s)'
  assert out[14] == "prepare: os.path:exists(path='/') ..."
  assert re.fullmatch(r'prepare: done in \d+\.\d s', out[15])


def test_evaluation_reports_each_domain_in_order_with_its_result():
  sets = {d: [{'id': f'{d}{i}', 'domain': d, 'metadata': {'answer': 'r'},
               'messages': [{'role': 'user', 'content': f'q{i}'}]} for i in range(n)]
          for d, n in (('b', 3), ('a', 2))}

  class Sampler:
    def generate(self, params, prompts, rng, sp, num_samples=1):
      del params, rng
      b, n = len(prompts) * num_samples, sp.max_new_tokens
      z = np.zeros((b, n), np.float32)
      return types.SimpleNamespace(
          prompt_tokens=np.ones((b, 2), np.int32), prompt_mask=np.ones((b, 2), np.int32),
          tokens=np.full((b, n), ord('r'), np.int32), mask=np.ones((b, n), np.int32),
          logprobs=z, sampling_logprobs=z, lengths=np.full((b,), 1, np.int32),
          truncated=np.zeros((b,), bool))

  class Verifier:
    def score(self, samples):
      return [types.SimpleNamespace(reward=float(s.metadata['answer'] in s.completion), info={})
              for s in samples]

  class Tok:
    vocab_size, pad_id, eos_id, added_tokens = 256, 0, 1, ()
    encode = staticmethod(lambda t: [ord(c) % 256 for c in t])
    decode = staticmethod(lambda ids, skip_special=False: ''.join(chr(i) for i in ids))

  ev = config_lib.Eval(num_samples=2, temperature=1.0, top_p=1.0, greedy=False,
                       max_new_tokens=1, max_prompt_len=32, num_prompts=0, batch_size=2,
                       thinking=False)
  calls = []
  out = evaluation.evaluate(Sampler(), None, Tok(), sets, lambda d: Verifier(),
                            types.SimpleNamespace, ev, jax.random.key(0),
                            report=lambda *a: calls.append(a))
  assert [c[:3] for c in calls] == [(1, 2, 'a'), (2, 2, 'b')]
  assert [c[3] for c in calls] == [out['a'], out['b']]
  assert out['a']['samples'] == 4 and out['b']['samples'] == 6
  assert all(c[4] >= 0 for c in calls)


@pytest.mark.parametrize('isolation', ['bwrap', 'none'])
def test_check_options_says_the_isolation_each_verifier_will_use(isolation):
  if isolation == 'bwrap' and not os.path.exists('/usr/bin/bwrap'):
    pytest.skip('bubblewrap is not installed')
  c = tiny.get_config('smoke')
  c.domains.code.verifier_options = dict(c.domains.code.verifier_options, isolation=isolation)
  plan = config_lib.validate(c)
  vs = verifier_set.VerifierSet(plan, rm_scorer=None, rm_ready=lambda name: False)
  got = vs.check_options()
  assert got['code'] == isolation
  assert {k: v for k, v in got.items() if k != 'code'} == dict.fromkeys(
      sorted(({d.verifier for d in plan.domains.values()}
              | {d.eval_verifier for d in plan.domains.values()}) - {'code'}), 'n/a')


def test_an_agentic_domains_environment_says_its_isolation():
  c = tiny_agentic.get_config('smoke')
  envs_of = {d.env for d in config_lib.validate(c).domains.values() if d.agentic}
  assert envs_of == {'tool_use', 'swe_agent'}
  for iso in ('none', 'bwrap'):
    for d in c.domains.values():
      if d.get('env'):
        d.env_options = dict(d.get('env_options') or {}, isolation=iso)
    vs = verifier_set.VerifierSet(config_lib.validate(c), rm_scorer=None,
                                  rm_ready=lambda name: False)
    assert vs.check_options() == {'env:swe_agent': iso, 'env:tool_use': iso}


# ---------------------------------------------------------------- the command line, end to end

_SMOKE = 'smoke,drop=if_rl+math_rl+swe_rl'      # sft, rm, rlhf, code_rl: 4 stages, 8 steps


def _run(tmp_path, *extra, faults=None):
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)                     # one CPU device, as `make demo` runs
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=REPO)
  main = [os.path.join(REPO, 'tests', 'faults.py'), f'--signal_at={faults}'] if faults else [
      '-m', 'cascade.main']
  cmd = [sys.executable, *main, f'--config=configs/tiny.py:{_SMOKE},root={tmp_path}/world',
         f'--workdir={tmp_path}/run', *extra]
  return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.heavy
def test_a_smoke_run_and_its_resume_explain_themselves(tmp_path):
  first = _run(tmp_path, faults='code_rl:1:SIGTERM')
  assert first.returncode == 75, first.stderr[-3000:]
  out = first.stdout.splitlines()
  # The data-making step, then the banner, before any stage.
  assert out[0].startswith("prepare: tiny_world.build:build(root='")
  start = out.index(next(l for l in out if l.startswith('cascade: config')))
  assert out[start].startswith(f'cascade: config configs/tiny.py:{_SMOKE},root=')
  assert out[start + 1] == f'workdir: {tmp_path}/run'
  assert out[start + 2] == ('devices: 1 cpu (cpu), 1 process (1 local device); mesh: none '
                            '(config.mesh.shape=None: one device, no sharding)')
  assert out[start + 3] == 'stages: 4, 8 training steps in all'
  assert out[start + 4:start + 8] == [
      '  [0] sft (sft): 2 steps on chat, instruction_following, math, code, swe; evaluated after',
      '  [1] rm (reward_model): 2 steps on chat',
      '  [2] rlhf (grpo): 2 steps on chat; evaluated after',
      '  [3] code_rl (grpo): 2 steps on code; evaluated after']
  assert out[start + 8] == 'resume: none, a new run'
  assert out[start + 9].startswith('isolation: code=bwrap; no code run: ')
  assert out[start + 10].startswith(f'compilation cache: {tmp_path}/run/compilation_cache (0 ')
  assert not any(l.startswith('compilation cache: ') for l in out[start + 11:])
  stage_lines = [l for l in out if re.match(r'stage \d of 4', l)]
  assert [l.split(':')[0] for l in stage_lines] == [
      'stage 1 of 4', 'stage 1 of 4 done', 'stage 2 of 4', 'stage 2 of 4 done',
      'stage 3 of 4', 'stage 3 of 4 done', 'stage 4 of 4']
  assert re.search(r'; cascade ETA ~[\d a-z]+ \(6 steps ~[\d a-z]+, 3 stage starts \(compiles, '
                   r'setup\) ~[\d a-z]+, 2 evaluations ~[\d a-z]+, 2 exports ~[\d a-z]+; a guess: '
                   r'no reward_model, grpo stage ran yet, timed as sft\)', stage_lines[1])
  evals = [l for l in out if l.startswith('[0] sft: eval ')]
  assert [l.split()[3:5] for l in evals] == [
      ['1/5', 'chat'], ['2/5', 'code'], ['3/5', 'instruction_following'], ['4/5', 'math'],
      ['5/5', 'swe']]
  assert any(re.fullmatch(r'\[2\] rlhf: exported to .*/stages/02_rlhf/hf in \d+\.\d s', l)
             for l in out)

  second = _run(tmp_path)
  assert second.returncode == 0, second.stderr[-3000:]
  out2 = second.stdout.splitlines()
  start = out2.index(next(l for l in out2 if l.startswith('cascade: config')))
  assert out2[start + 8] == ('resume: done sft, rm, rlhf; code_rl resumes at step 1/2 '
                             '(its newest checkpoint)')
  stage_lines = [l for l in out2 if re.match(r'stage \d of 4', l)]
  assert [l.split(':')[0] for l in stage_lines] == ['stage 4 of 4', 'stage 4 of 4 done']
  assert 'the cascade is done' in stage_lines[1]
  if os.environ.get('CASCADE_REGEN_DOCS'):
    _write_docs(first.stdout, second.stdout, tmp_path)


@pytest.mark.heavy
@pytest.mark.multiprocess
def test_on_two_hosts_only_process_0_prints_the_banner_and_progress(tmp_path, copy_cascade,
                                                                    derived_config):
  """Two local JAX processes (4 CPU devices each) run one SFT stage of 1 step on a (2, 2, 2)
  mesh over a shared workdir: process 0 prints the banner (8 devices, 2 processes, the mesh's
  axes) and the stage lines, process 1 none of them."""
  copy_cascade(tmp_path, train=16, eval_=8, sft=32, mesh_shape=(2, 2, 2), sft_steps=1,
               rl_steps=1)
  (tmp_path / 'sft_only.py').write_text(derived_config('  c.stages = c.stages[:1]\n'))
  port = _free_port()
  procs = []
  for i in range(2):
    env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO, JAX_NUM_PROCESSES='2',
               JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}', JAX_PROCESS_ID=str(i),
               XLA_FLAGS='--xla_force_host_platform_device_count=4')
    procs.append(subprocess.Popen(
        [sys.executable, '-m', 'cascade.main', f'--config={tmp_path}/sft_only.py',
         f'--workdir={tmp_path}/run'], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True))
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=600))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for _, e in outs]
  zero, one = outs[0][0].splitlines(), outs[1][0].splitlines()
  assert ('devices: 8 cpu (cpu), 2 processes (4 local devices); mesh: data=2 fsdp=2 tensor=2'
          in zero)
  assert 'stage 1 of 1: [0] sft (sft), 1 step on copy' in zero
  assert any(l.startswith('stage 1 of 1 done: [0] sft (sft) in ') for l in zero)
  assert any(l.startswith('[0] sft: eval 1/1 copy ') for l in zero)
  assert not [l for l in one if l.startswith(('cascade: ', 'devices: ', 'stage ', '[0] sft: eval',
                                              'prepare: ', 'resume: '))], one


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


_DOC = os.path.join(REPO, 'docs', 'what_a_run_prints.md')


def _write_docs(first: str, second: str, tmp_path) -> None:
  """Rewrites the captured blocks of docs/what_a_run_prints.md (its prose stays)."""
  clean = lambda s: s.replace(str(tmp_path), '/tmp/t').rstrip('\n')
  with open(_DOC, encoding='utf-8') as f:
    page = f.read()
  for name, text in (('first', first), ('second', second)):
    page = re.sub(rf'(<!-- {name} run -->\n```text\n).*?(^```$)',
                  lambda m, t=clean(text): m.group(1) + t + '\n' + m.group(2), page,
                  count=1, flags=re.S | re.M)
  with open(_DOC, 'w', encoding='utf-8') as f:
    f.write(page)
