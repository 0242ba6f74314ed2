"""An RL stage's `routing_replay` option: validated against the model and the sampler, carried
into the loss config and the planned train batch, and one GRPO step on a tiny mixture-of-experts
policy run through the real stage loop (real sampler, train step and checkpoints; stand-in
tokenizer and verifier) with the rollouts' routing recorded, replayed and its mismatch logged.
The routing itself (recording, replay, the metric's value) is tested in
tests/rl/test_routing_replay.py."""

import re
import types

import jax
import pytest

from cascade import config as config_lib
from cascade import kinds
from cascade import policies as policies_lib
from cascade import schema
from cascade.kinds import base
from cascade.kinds import grpo
from cascade.kinds import mopd
from cascade.kinds import rl
from models import sharding
from rl import sampler as sampler_lib

MOE = dict(preset='tiny_moe')


def _stage(raw):
  """A stage dict parsed as `cascade.config` parses it (domain 'a'), before the model is known."""
  doms = {'a': config_lib.Domain(name='a', verifier='math', train='a_train', eval='a_train')}
  ds = config_lib.Dataset(name='a_train', format='prompt', record_type='prompt')
  refs = base.Refs((), (raw['name'],), doms, {'a_train': ds})
  return kinds.parse(0, raw, refs)


GRPO = dict(name='rl', kind='grpo', domains=['a'], steps=2, optimizer=dict(lr=1e-3),
            prompts_per_step=2, group_size=2, max_prompt_len=64, max_response_len=4)


def test_routing_replay_is_off_by_default_and_takes_three_modes():
  st = _stage(GRPO)
  assert st.routing_replay == 'off' and st.routing_layout == () and not st.records_routing
  for mode in rl.ROUTING_REPLAY:
    assert _stage(dict(GRPO, routing_replay=mode)).routing_replay == mode
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      "stages[0] 'rl': routing_replay=True: unknown routing_replay mode (known: off, measure, "
      'on)')):
    _stage(dict(GRPO, routing_replay=True))


def test_a_dense_policy_is_refused_and_either_engine_records(fakes):
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      "stages[0] 'rl': routing_replay='on': needs a mixture-of-experts policy (a model with "
      "'moe' layers); config.model is a qwen3 model without experts")):
    fakes.toy_config([fakes.rl_stage('rl', ['a'], routing_replay='on')])
  # Off, a dense policy is fine; on, a mixture-of-experts one gets its routing layout.
  assert fakes.toy_config([fakes.rl_stage('rl', ['a'])]).stages[0].routing_layout == ()
  for mode in ('measure', 'on'):
    st = fakes.toy_config([fakes.rl_stage('rl', ['a'], routing_replay=mode)],
                          model=MOE).stages[0]
    assert st.routing_layout == (2, 2, 'uint8')        # tiny_moe: 2 'moe' sublayers, top-2
  st = _stage(dict(GRPO, routing_replay='on'))
  moe = config_lib.Model(preset='tiny_moe').resolve()
  for engine in ('one_call', 'paged'):
    got = st.with_model(moe, config_lib.Sampler(engine=engine), schema.failer(st.where, st))
    assert got.routing_layout == (2, 2, 'uint8')


def test_streaming_and_agentic_stages_take_routing_replay():
  """The paged engine records routing through streams, and episodes carry it across turns."""
  assert _stage(dict(GRPO, routing_replay='measure', stream_filter=True)).records_routing
  doms = {'a': config_lib.Domain(name='a', verifier='math', train='a_train', eval='a_train',
                                 env='add_test', env_options={})}
  ds = config_lib.Dataset(name='a_train', format='prompt', record_type='prompt')
  refs = base.Refs((), ('rl',), doms, {'a_train': ds})
  assert kinds.parse(0, dict(GRPO, kind='agentic', routing_replay='on'), refs).records_routing


def test_the_mode_reaches_the_loss_and_the_planned_batch(fakes):
  for mode, replay in (('off', True), ('measure', False), ('on', True)):
    st = fakes.toy_config([fakes.rl_stage('rl', ['a'], routing_replay=mode)],
                          model=MOE).stages[0]
    assert grpo.loss(st)[1].replay_routing is replay
    mo = fakes.toy_config([fakes.rl_stage('rl', ['a'], kind='mopd', teachers={'a': '/t'},
                                          routing_replay=mode)], model=MOE).stages[0]
    assert mopd.loss(mo)[1].replay_routing is replay
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    batch, _ = grpo.abstract_batch(st, mesh, None)
    if mode == 'off':
      assert batch.routing is None
    else:
      # Aligned with the tokens, two 'moe' sublayers of top-2 experts, split as the tokens
      # are (rows, and tokens where the mesh has a sequence axis), its own axes whole.
      assert batch.routing.shape == batch.tokens.shape + (2, 2)
      assert batch.routing.dtype == 'uint8'
      tokens, routing = batch.tokens.sharding, batch.routing.sharding
      assert routing.mesh == tokens.mesh
      assert tuple(routing.spec) == tuple(tokens.spec) + (None,) * (4 - len(tokens.spec))


class _Recording:
  """The real sampler, noting what each call asked for."""

  def __init__(self, inner):
    self.inner, self.asked = inner, []

  def generate(self, *args, **kw):
    self.asked.append(kw.get('record_routing', False))
    return self.inner.generate(*args, **kw)

  def stream(self, *args, **kw):
    self.asked.append(kw.get('record_routing', False))
    return self.inner.stream(*args, **kw)

  def __getattr__(self, name):          # engine, prepare, counters: the sampler's
    return getattr(self.inner, name)


@pytest.mark.heavy
@pytest.mark.parametrize('engine', ['one_call', 'paged'])
def test_a_grpo_step_with_routing_replay_runs_through_the_stage_loop(fakes, tmp_path, engine):
  """One step; with the paged engine its groups stream (`stream_filter`). The trainer's routers
  agree with every recorded choice (same params, float32): replayed, nothing differs."""
  paged = engine == 'paged'
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a'], routing_replay='on', steps=1,
                                          prompts_per_step=2, max_prompt_len=64,
                                          max_response_len=4, stream_filter=paged,
                                          dynamic_filter=paged)],
                          model=MOE)
  st = plan.stages[0]
  pol = policies_lib.Policies(plan, str(tmp_path), None, plan.rules)
  tok = fakes.CharTokenizer()
  kw = dict(engine='paged', slots=4, page_size=8, chunk_steps=4) if paged else {}
  samp = _Recording(sampler_lib.Sampler(pol.graphdef('policy'), plan.model, eos_ids=(tok.eos_id,),
                                        pad_id=tok.pad_id, prompt_buckets=(64,),
                                        new_token_buckets=(4,), **kw))
  logged = []
  recs = [fakes.record('a', i, 10 + i) for i in range(4)]
  ctx = types.SimpleNamespace(
      plan=plan, workdir=str(tmp_path), mesh=None, rules=plan.rules, batch_shards=1,
      writer=types.SimpleNamespace(write=lambda stage, step, m: logged.append(m),
                                   enabled=False),
      sampler=samp, tokenizer=tok, sample_cls=fakes.Sample,
      verifiers=types.SimpleNamespace(train_verifier=lambda d: fakes.ValueVerifier(d)),
      domain_index={'a': 0, 'b': 1},
      data=types.SimpleNamespace(stage_records=lambda stage: recs, validation_sets={}),
      policies=pol)
  try:
    result = grpo.run(ctx, st)
  finally:
    pol.close()
  assert result.final_step == 1 and samp.asked and all(samp.asked)
  [m] = logged
  # The policy's own routers agree with the sampler's (same params, float32) on every pair.
  assert m['routing_mismatch'] == 0.0
  assert 'router_aux_loss' in m and m['skipped'] == 0
