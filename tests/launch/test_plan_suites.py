"""launch.plan plans config.eval.suites: each suite's largest sampler call by its protocol (its
prompts x samples, its longest prompt measured on its files or its bound, its token budget)
and the local judge model its grader runs; a served judge costs the devices nothing."""

import dataclasses
import json
import os

import jax
import ml_collections
import pytest

from cascade import config as config_lib
from cascade import rollout
from cascade import suites as suites_lib
from cascade.suites import arena_hard
from cascade.suites import base
from launch.plan import evaluation as plan_evaluation
from launch.plan import judges as plan_judges
from launch.plan import memory as plan_memory
from launch.plan import report as plan_report
from launch.plan import results as plan_results
from launch.plan import suite_calls as plan_suite_calls
from foundation import chat_template
from models import config as model_config
from models import hf
from models import sharding
from foundation import tokenizer as tokenizer_lib

RULES = sharding.DEFAULT_RULES
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'fixtures', 'suites')


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ShortSuite(base.Suite):
  """A suite of short prompts the plan assumes (nothing is read: the plan sizes it by its bound)."""

  def parse(self, path, raw):
    raise NotImplementedError

  def grader(self, **options):
    raise NotImplementedError


def _register():
  """Two short suites with one protocol (one program between them) and an ArenaHard release
  sized for the tiny model, registered once per process."""
  proto = base.Protocol(samples=4, temperature=0.6, top_p=0.95, max_new_tokens=16,
                        thinking=False)
  made = [_ShortSuite(name=n, title=n, source='the test', files=('x.jsonl',), protocol=proto,
                      prompt_tokens=24) for n in ('plan_short_a', 'plan_short_b')]
  made.append(dataclasses.replace(arena_hard.arena_hard_v2, name='plan_arena', prompt_tokens=24,
                                  records=0, judge_max_tokens=8,
                                  protocol=dataclasses.replace(proto, samples=1)))
  for s in made:
    if s.name not in suites_lib.names():
      suites_lib.register(s)


_register()


def _judge_dir(tmp_path):
  """An HF judge directory holding only config.json (the plan reads no weights)."""
  cfg = model_config.ModelConfig.tiny(embed_dim=96, num_layers=2, max_seq_len=256)
  d = tmp_path / 'judge'
  d.mkdir(exist_ok=True)
  (d / 'config.json').write_text(json.dumps(hf.config_to_hf(cfg)))
  return str(d)


def _tokenizer_dir(tmp_path):
  """A small byte-level BPE tokenizer (tokenizer.json) the plan measures prompts with."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from foundation import chat  # pylint: disable=g-import-not-at-top
  bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
  bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tokenizers.decoders.ByteLevel()
  bpe.train_from_iterator(['Find the sum of all integer bases b > 9.'] * 4,
                          tokenizers.trainers.BpeTrainer(
                              vocab_size=300, special_tokens=list(chat.SPECIAL_TOKENS),
                              initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                              show_progress=False))
  d = tmp_path / 'tok'
  d.mkdir(exist_ok=True)
  bpe.save(str(d / 'tokenizer.json'))
  (d / 'tokenizer_config.json').write_text(json.dumps({'bos_token': None}))
  return str(d)


def _config(suites, *, tokenizer='/nonexistent/tok.model', suite_data='', protocol=None,
            options=None, batch=8, prompts=0, mesh=(2, 2, 2)):
  return config_lib.validate(ml_collections.ConfigDict(dict(
      seed=0,
      model=dict(preset='tiny', overrides=dict(max_seq_len=256)),
      tokenizer=dict(path=tokenizer),
      mesh=dict(shape=mesh),
      hardware=dict(name='8 test devices', platform='cpu', device_memory_gib=1.0),
      sampler=dict(),
      ckpt=dict(every_n_steps=0, keep=1),
      eval=dict(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=16,
                max_prompt_len=32, num_prompts=8, batch_size=8, suites=list(suites),
                suite_data=suite_data, suite_batch_size=batch, suite_prompts=prompts,
                suite_protocol=protocol or {}, suite_options=options or {}),
      datasets=dict(sft=dict(path='/d/sft.jsonl', format='sft'),
                    add=dict(path='/d/add.jsonl', format='prompt', domain='add')),
      domains=dict(add=dict(verifier='math', train='add', eval='add')),
      stages=[dict(name='sft', kind='sft', domains=['add'], datasets=['sft'], steps=2,
                   batch_size=8, max_len=64, optimizer=dict(lr=1e-3))])))


AIME = dict(aime25=dict(samples=4, max_new_tokens=16))


def test_a_suite_call_is_its_prompts_times_its_protocols_samples_at_its_bound():
  p = _config(['aime25', 'ruler_niah_single_8k', 'bfcl_v3_simple'], batch=64,
              protocol=dict(AIME, bfcl_v3_simple=dict(max_new_tokens=16)))
  aime, ruler, bfcl = plan_suite_calls.suite_calls(p)
  # No data named: AIME's 30 problems (fewer than a batch of 64) at its bound, 4 samples each
  # (the config's override of its 64), its overridden budget.
  assert (aime.prompts, aime.samples, aime.rows) == (30, 4, 120)
  assert (aime.prompt_len, aime.max_new_tokens) == (1024, 16)
  assert "suite's bound" in aime.how and aime.judge is None
  # RULER's length is exact by construction; greedy: one sample of each of its 100 prompts.
  assert (ruler.prompts, ruler.samples, ruler.prompt_len, ruler.max_new_tokens) == (
      64, 1, 8192, 128)
  # A count the card does not state: full batches.
  assert (bfcl.prompts, bfcl.prompt_len) == (64, 8192) and 'full batches' in bfcl.how
  # config.eval.suite_prompts caps a call too.
  assert plan_suite_calls.suite_calls(_config(['aime25'], protocol=AIME, batch=64,
                                              prompts=5))[0].prompts == 5


def test_the_longest_prompt_is_measured_on_the_suites_files(tmp_path):
  tok_dir = _tokenizer_dir(tmp_path)
  p = _config(['aime25'], tokenizer=tok_dir, suite_data=FIXTURES, protocol=AIME, batch=64)
  [call] = plan_suite_calls.suite_calls(p)
  records = suites_lib.get('aime25').read(os.path.join(FIXTURES, 'aime25'))
  tok = tokenizer_lib.load(tok_dir)
  want = max(len(tok.encode(rollout.prompt_text(r, True, chat_template.of(tok))))
             for r in records)
  assert (call.prompts, call.prompt_len) == (len(records), want), call
  assert call.how.startswith(f'measured: {len(records)} records')
  # Data named but not there: the bound, saying why.
  missing = _config(['aime25'], tokenizer=tok_dir, suite_data=str(tmp_path / 'none'),
                    protocol=AIME)
  [call] = plan_suite_calls.suite_calls(missing)
  assert call.prompt_len == 1024 and 'no aime2025-I.jsonl' in call.how


def test_a_local_judge_is_a_judge_call_and_a_served_one_is_none(tmp_path):
  judge = _judge_dir(tmp_path)
  local = _config(['plan_arena'], options=dict(plan_arena=dict(judge=judge, max_tokens=6)))
  [call] = plan_suite_calls.suite_calls(local)
  jc = call.judge
  # Both orders of each of a batch's 8 answers, greedy, up to the judge's budget.
  assert (jc.source, jc.rows, jc.use.score_by, jc.use.max_new_tokens) == (
      ('hf', judge), 8 * 1 * 2, 'generate', 6)
  assert jc.where == 'config.eval.suite_options.plan_arena.judge'
  assert jc.model_cfg.embed_dim == 96
  served = _config(['plan_arena'], options=dict(plan_arena=dict(url='http://judge:8000/v1')))
  assert plan_suite_calls.suite_calls(served)[0].judge is None


def _suite_programs(tmp_path):
  """suite_programs of two short suites (one program between them) and ArenaHard with a local
  judge, on 2 devices, 7 bytes of loaded judges beside everything."""
  judge = _judge_dir(tmp_path)
  p = _config(['plan_short_a', 'plan_short_b', 'plan_arena'], batch=4, mesh=(1, 2, 1),
              options=dict(plan_arena=dict(judge=judge)))
  mesh = sharding.make_mesh((1, 2, 1), devices=jax.devices()[:2])
  sampler_cfg = p.sampler.options()
  progs, resident = plan_evaluation.suite_programs(p, p.model, mesh, RULES, sampler_cfg,
                                                   limit_bytes=2 ** 30, held_bytes=7)
  jcfg = plan_suite_calls.suite_calls(p)[2].judge.model_cfg
  jbytes = sum(plan_memory.judge_bytes(jcfg, True, mesh, RULES, sampler_cfg, p.model))
  return {q.name: q for q in progs}, dict(resident), jbytes


def _check_programs(by_name, res, jbytes):
  # The two short suites share one program (same rows, buckets and sampling); ArenaHard's call
  # (one sample) is another; its local judge's sampler a third.
  assert sorted(by_name) == ['judge sampler (plan_arena)', 'suite sampler (plan_arena)',
                             'suite sampler (plan_short_a, plan_short_b)'], sorted(by_name)
  short = by_name['suite sampler (plan_short_a, plan_short_b)']
  assert short.shapes.startswith('16 rows') and '4 prompts x 4 samples' in short.shapes
  assert by_name['suite sampler (plan_arena)'].shapes.startswith('4 rows')
  # Both orders of its 4 answers, at the judge's longest row (its 256 positions less 8 new).
  assert by_name['judge sampler (plan_arena)'].shapes.startswith('8 rows, prompt bucket 256')
  # Loaded judges beside everything; the suite's own judge beside its sampler while it grades;
  # beside the judge, the policy sampler's arguments (the next batch samples meanwhile).
  assert res['suite sampler (plan_short_a, plan_short_b)'] == 7
  assert res['suite sampler (plan_arena)'] == 7 + jbytes
  arena = by_name['suite sampler (plan_arena)'].argument_bytes
  assert arena > 0 and res['judge sampler (plan_arena)'] == 7 + arena


def test_the_suites_programs_are_named_sized_and_have_their_judge_beside_them(tmp_path,
                                                                             monkeypatch):
  """The wiring, with each compile replaced by a report of its shapes (compiling is the heavy
  test below's)."""
  made = []

  def fake_compile(name, shapes, lower, *args, **kwargs):
    del lower, args, kwargs
    made.append(name)
    return plan_results.ProgramReport(name, shapes, argument_bytes=1000 + len(made))

  monkeypatch.setattr(plan_evaluation.compiler, 'compile_program', fake_compile)
  monkeypatch.setattr(plan_judges.compiler, 'compile_program', fake_compile)
  _check_programs(*_suite_programs(tmp_path))
  # The evaluation's plan holds them after the held-out evaluation's sampler.
  p = _config(['plan_short_a', 'plan_short_b'], batch=4, mesh=(1, 2, 1))
  mesh = sharding.make_mesh((1, 2, 1), devices=jax.devices()[:2])
  rep = plan_evaluation.plan_eval(p, p.model, mesh, RULES, p.sampler.options(), 2 ** 30)
  assert [q.name for q in rep.programs] == ['eval sampler',
                                            'suite sampler (plan_short_a, plan_short_b)']
  assert [n for n, _ in rep.resident] == [q.name for q in rep.programs]


@pytest.mark.heavy
def test_the_suites_programs_compile_with_their_judge_beside_them(tmp_path):
  by_name, res, jbytes = _suite_programs(tmp_path)
  _check_programs(by_name, res, jbytes)
  progs = tuple(by_name.values())
  assert all(not q.error and q.total_bytes > 0 and q.flops > 0 for q in progs), progs
  # More rows, more work: 16 rows against 4 of the same lengths.
  assert (by_name['suite sampler (plan_short_a, plan_short_b)'].flops
          > by_name['suite sampler (plan_arena)'].flops)
  report = plan_report.format_stage(plan_results.StageReport(
      -1, 'evaluation', 'eval', progs, 2 ** 30, 2, resident=tuple(res.items())))
  assert 'suite sampler (plan_arena)' in report and 'DOES NOT' not in report
  assert 'for the prefill and one decode step per decode phase' in report


def test_a_suite_call_past_the_models_positions_is_a_failure_saying_why():
  """RULER at 8K on a model of 256 positions: no program, an error the plan's failures name."""
  p = _config(['plan_short_a', 'ruler_niah_single_8k'], batch=2, mesh=(1, 1, 1))
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  sampler_cfg = p.sampler.options()
  calls = plan_suite_calls.suite_calls(p)
  sampler, _ = plan_evaluation.programs_lib.sampler_for(p.model, mesh, RULES, sampler_cfg)
  assert plan_evaluation._unplannable(calls[0], p.model, sampler) == ''  # pylint: disable=protected-access
  why = plan_evaluation._unplannable(calls[1], p.model, sampler)  # pylint: disable=protected-access
  assert why.startswith("prompts of up to 8192 tokens (the suite's bound (it generates its "
                        "records)) + 128 new tokens exceed the model's max_seq_len=256: the "
                        'suite does not fit this model'), why
  short = dataclasses.replace(calls[0], prompt_len=200, max_new_tokens=100)
  assert plan_evaluation._unplannable(short, p.model, sampler).endswith(  # pylint: disable=protected-access
      'config.eval.suite_protocol.plan_short_a.max_new_tokens <= 56')
  rep = plan_results.StageReport(-1, 'evaluation', 'eval', (plan_results.ProgramReport(
      'suite sampler (ruler_niah_single_8k)', 'x', error=why),), 2 ** 30, 1)
  [failure] = plan_report.failures([rep])
  assert 'suite sampler (ruler_niah_single_8k) does not fit' in failure and why in failure


def test_an_agentic_suites_largest_call_is_its_last_turn(tmp_path):
  """SWE-bench through the agentic environment: its opening (the issue with the tools' schemas)
  measured on its files, then the last turn's call, whose prompt holds the whole episode budget
  and whose new tokens are one turn's (as the agentic stage's)."""
  from cascade import episodes  # pylint: disable=g-import-not-at-top
  name = 'swe_bench_verified_agentic'
  proto = {name: dict(max_new_tokens=48)}
  tok_dir = _tokenizer_dir(tmp_path)
  suite = suites_lib.get(name)
  [call] = plan_suite_calls.suite_calls(_config([name], tokenizer=tok_dir, suite_data=FIXTURES,
                                                protocol=proto))
  records = suite.read(suite.directory(FIXTURES))
  tok = tokenizer_lib.load(tok_dir)
  opening = max(len(tok.encode(episodes.opening_text(suite.environment(), r, True)))
                for r in records)
  assert (call.prompts, call.samples) == (2, 1) and call.how.startswith('measured: 2 records')
  assert (call.prompt_len, call.max_new_tokens) == (opening + 48, 48)
  # Turns of at most max_turn_tokens; the suite's bound where its files are not there.
  short = dataclasses.replace(suite.with_protocol(max_new_tokens=20000), max_turn_tokens=4096)
  assert short.planned_call(100, short.protocol) == (100 + 20000, 4096)
  [call] = plan_suite_calls.suite_calls(_config([name], protocol=proto))
  assert (call.prompt_len, call.max_new_tokens) == (8192 + 48, 48)
