"""launch.plan counts the judge models a run loads: their programs, their weights beside every
program from their first use on, and their scoring in the step-time bound."""

import dataclasses
import json
import types

import jax
import ml_collections
import numpy as np
import pytest

from cascade import config as config_lib
from launch.plan import judges as plan_judges
from launch.plan import memory as plan_memory
from launch.plan import report as plan_report
from launch.plan import stages as plan_stages
from launch.plan import step_time as plan_step_time
from launch.plan import targets as plan_targets
from models import config as model_config
from models import hf
from models import sharding
from rl import judge as judge_lib

RULES = sharding.DEFAULT_RULES


def _judge_dir(tmp_path, **kw):
  """An HF judge directory holding only config.json (the plan reads no weights)."""
  cfg = model_config.ModelConfig.tiny(embed_dim=96, num_layers=3, max_seq_len=2048, **kw)
  d = tmp_path / 'judge'
  d.mkdir(exist_ok=True)
  (d / 'config.json').write_text(json.dumps(hf.config_to_hf(cfg)))
  return str(d), cfg


def _config(judge, *, mode='pairwise', score_by='generate', initial_eval=False):
  template = {'pairwise': 'pairwise_ab', 'pointwise': 'pointwise_yes_no',
              'round_robin': 'pairwise_ab'}[mode]
  return config_lib.validate(ml_collections.ConfigDict(dict(
      seed=0,
      model=dict(preset='tiny', overrides=dict(max_seq_len=256)),
      tokenizer=dict(path='/nonexistent/tok.model'),
      mesh=dict(shape=(2, 2, 2)),
      hardware=dict(name='8 test devices', platform='cpu', device_memory_gib=1.0,
                    peak_tflops=1.0, hbm_gbps=10.0),
      sampler=dict(),
      ckpt=dict(every_n_steps=0, keep=1),
      eval=dict(num_samples=2, temperature=1.0, top_p=1.0, greedy=False, max_new_tokens=16,
                max_prompt_len=32, num_prompts=8, batch_size=8, initial=initial_eval),
      datasets=dict(sft=dict(path='/d/sft.jsonl', format='sft'),
                    add=dict(path='/d/add.jsonl', format='prompt', domain='add'),
                    chat=dict(path='/d/chat.jsonl', format='prompt', domain='chat')),
      domains=dict(add=dict(verifier='math', train='add', eval='add'),
                   chat=dict(verifier='judge', train='chat', eval='chat',
                             verifier_options=dict(judge=judge, template=template, mode=mode,
                                                   score_by=score_by, max_new_tokens=24))),
      stages=[
          dict(name='sft', kind='sft', domains=['add'], datasets=['sft'], steps=2,
               batch_size=8, max_len=64, optimizer=dict(lr=1e-3)),
          dict(name='add_rl', kind='grpo', domains=['add'], steps=2, optimizer=dict(lr=1e-4),
               prompts_per_step=4, group_size=4, max_prompt_len=32, max_response_len=16),
          dict(name='chat_rl', kind='grpo', domains=['chat'], steps=2,
               optimizer=dict(lr=1e-4), prompts_per_step=4, group_size=4, max_prompt_len=32,
               max_response_len=16),
      ])))


def _stage(p, name):
  return [s for s in p.stages if s.name == name][0]


@pytest.mark.parametrize('mode,rows_per_sample', [('pointwise', 1), ('pairwise', 2),
                                                  ('round_robin', 3)])
def test_a_stage_calls_its_judge_for_every_sample(tmp_path, mode, rows_per_sample):
  path, cfg = _judge_dir(tmp_path)
  p = _config(path, mode=mode)
  assert plan_judges.judge_calls(p, _stage(p, 'add_rl')) == []
  [jc] = plan_judges.judge_calls(p, _stage(p, 'chat_rl'))
  assert jc.source == ('hf', path) and jc.domain == 'chat'
  assert jc.where == 'config.domains.chat.verifier_options.judge'
  # The judge's own architecture, read from its config.json: not the policy's.
  assert (jc.model_cfg.embed_dim, jc.model_cfg.num_layers) == (96, 3) != (
      p.model.embed_dim, p.model.num_layers)
  # 16 samples (4 prompts x G=4); round robin: both orders of the 6 pairs of a group = 3 each.
  assert (jc.use.score_by, jc.use.max_new_tokens, jc.rows) == ('generate', 24,
                                                               16 * rows_per_sample)


def test_a_judge_is_resident_from_its_first_use_on(tmp_path):
  path, _ = _judge_dir(tmp_path)
  # The held-out chat set is judged too: after stage 0 the evaluation loads the judge, which
  # the run keeps; with an initial evaluation it is there from the start.
  p = _config(path)
  assert [bool(plan_judges.loaded_judges(p, i)) for i in range(3)] == [False, True, True]
  assert set(plan_judges.loaded_judges(p, None)) == {('hf', path)}
  p0 = _config(path, initial_eval=True)
  assert [bool(plan_judges.loaded_judges(p0, i)) for i in range(3)] == [True, True, True]
  # A stage's policy as the judge: loaded only after that stage has run.
  ps = _config('stage:add_rl')
  assert [bool(plan_judges.loaded_judges(ps, i)) for i in range(3)] == [False, False, True]
  [(cfg, generates)] = plan_judges.loaded_judges(ps, 2).values()
  assert cfg == ps.model and generates


def test_a_judge_without_its_config_is_a_one_line_error(tmp_path):
  p = _config(str(tmp_path / 'nowhere'))
  with pytest.raises(ValueError, match=r"^config\.domains\.chat\.verifier_options\.judge="
                                       r".*launch\.plan reads the judge's architecture from "
                                       r".*config\.json"):
    plan_judges.judge_calls(p, _stage(p, 'chat_rl'))


def test_loaded_judges_sit_beside_every_program_and_their_own_beside_the_state(tmp_path):
  path, _ = _judge_dir(tmp_path)
  p = _config(path, mode='pointwise', score_by='logits')
  st = _stage(p, 'chat_rl')
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  calls = plan_judges.judge_calls(p, st)
  loaded = plan_judges.loaded_judges(p, st.index)
  judge = plan_memory.params_bytes(calls[0].model_cfg, 'policy', mesh, RULES)
  assert plan_memory.judge_bytes(calls[0].model_cfg, False, mesh, RULES, {}) == (judge, 0)
  programs = [types.SimpleNamespace(name=n, argument_bytes=0)
              for n in ('train step', 'sampler', 'judge (chat)')]

  def resident(**kw):
    return dict(plan_memory.resident(st, p.model, mesh, RULES, programs, [], [], **kw))

  bare, full = resident(), resident(judges=calls, loaded=loaded, copy_bytes=5)
  assert full['train step'] - bare['train step'] == judge
  assert full['sampler'] - bare['sampler'] == judge
  # Its own weights are the judge program's argument; beside it the whole train state and the
  # policy's rollout copy, alive while the step collects.
  state = bare['sampler'] + plan_memory.params_bytes(p.model, 'policy', mesh, RULES, np.float32)
  assert full['judge (chat)'] == state + 5
  # Streamed scoring: the policy engine's arguments are alive beside the judge too, less the
  # params they hold, which are the rollout copy already counted (or the state's own).
  streamed = dataclasses.replace(st, stream_filter=True)
  pools = 1000
  for copy in (5, 0):
    given = copy or plan_memory.params_bytes(p.model, 'policy', mesh, RULES, np.float32)
    engine = [types.SimpleNamespace(name='sampler', argument_bytes=given + pools)]
    got = dict(plan_memory.resident(streamed, p.model, mesh, RULES, programs + engine, [], [],
                                    judges=calls, loaded=loaded, copy_bytes=copy))
    assert got['judge (chat)'] == state + copy + pools, copy


def test_the_step_time_bound_includes_judge_scoring(tmp_path):
  path, _ = _judge_dir(tmp_path)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  hw = config_lib.Hardware(peak_tflops=1.0, hbm_gbps=10.0)
  p = _config(path, mode='pairwise', score_by='logits')
  st = _stage(p, 'chat_rl')
  from cascade import kinds
  kind = kinds.get(st.kind)
  [jc] = plan_judges.judge_calls(p, st)
  without = plan_step_time.step_time(st, kind, p.model, mesh, RULES, hw, {})
  with_judge = plan_step_time.step_time(st, kind, p.model, mesh, RULES, hw, {}, judges=[jc])
  assert without.scoring is None and without.judge == 0
  # Logits: ceil(32 rows / 8) forwards of 8 rows x the judge's 2048 positions, each the larger
  # of reading its weights and its FLOPs at peak (counted directly here).
  cfg = jc.model_cfg
  rows, length = judge_lib.BATCH_SIZE, min(judge_lib.MAX_LEN, cfg.max_seq_len)
  emb = cfg.vocab_size * cfg.embed_dim
  blocks = cfg.num_params(active=True) - emb * (1 if cfg.tie_embeddings else 2) - cfg.embed_dim
  flops = rows * length * (2 * blocks + cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim
                           * (length + 1) / 2) + rows * 2 * emb
  reads = plan_memory.params_bytes(cfg, 'policy', mesh, RULES)
  want = 4 * max(reads / 10e9, flops / 1e12)
  assert with_judge.judge == pytest.approx(want, rel=1e-9) and with_judge.scoring is None
  assert with_judge.bound == pytest.approx(without.bound + want, rel=1e-9)
  # Generating costs more than one forward per row.
  pg = _config(path, mode='pairwise', score_by='generate')
  [jg] = plan_judges.judge_calls(pg, _stage(pg, 'chat_rl'))
  assert plan_step_time.judge_time([jg], mesh, RULES, hw, {}) > want


@pytest.mark.heavy
@pytest.mark.parametrize('score_by', ['logits', 'generate'])
def test_a_stage_with_a_judge_compiles_its_programs_and_counts_them(tmp_path, score_by):
  path, _ = _judge_dir(tmp_path)
  p = _config(path, mode='pairwise', score_by=score_by)
  tgt = plan_targets.target(p, 'cpu')
  reps = plan_stages.run_plan(p, tgt, stages=['add_rl', 'chat_rl'])
  add, chat, ev = reps
  names = [q.name for q in chat.programs]
  judge = [q for q in chat.programs if q.name.startswith('judge')]
  assert judge and all(not q.error and q.total_bytes > 0 for q in judge), names
  assert not any(q.name.startswith('judge') for q in add.programs)
  # The judge's weights sit beside the RL stages' programs (loaded by the evaluation after
  # stage 0) and beside the evaluation's; the evaluation compiles the judge's programs too.
  mesh = sharding.make_mesh((2, 2, 2), devices=tgt.devices)
  jbytes = plan_memory.params_bytes(plan_judges.judge_calls(p, _stage(p, 'chat_rl'))[0].model_cfg,
                                    'policy', mesh, RULES)
  assert dict(add.resident)['train step'] >= jbytes
  assert any(q.name.startswith('judge') for q in ev.programs)
  assert dict(ev.resident)['eval sampler'] >= jbytes
  assert chat.time.judge > 0 and 'judge models' in plan_report.format_stage(chat)
  assert 'judge' in '\n'.join(plan_report.time_table([chat]))


def test_the_cascade2_genrm_architecture_is_a_235b_a22b_qwen3_moe():
  # configs/judges/qwen3_235b_a22b/config.json: the GenRM architecture the Cascade 2 config's
  # docstring names for planning; its parameter counts are the model's name.
  import os
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  path = os.path.join(root, 'configs', 'judges', 'qwen3_235b_a22b')
  with open(os.path.join(path, 'config.json')) as f:
    cfg = hf.config_from_hf(json.load(f))
  assert cfg.family == 'qwen3_moe' and cfg.param_dtype == 'bfloat16'
  assert round(cfg.num_params() / 1e9) == 235 and round(cfg.num_params(active=True) / 1e9) == 22
  from configs import nemotron_cascade2
  p = config_lib.validate(nemotron_cascade2.get_config(f'genrm={path}'))
  calls = plan_judges.judge_calls(p, _stage(p, 'rlhf'))
  assert [(c.domain, c.use.score_by, c.use.max_new_tokens, c.model_cfg.num_experts)
          for c in calls] == [('chat', 'generate', 4096, 128)]
  assert set(plan_judges.loaded_judges(p, _stage(p, 'rlhf').index)) == {('hf', path)}
