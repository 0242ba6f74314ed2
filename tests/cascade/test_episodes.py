"""Agentic episodes: turns, observations, limits, pairing, loss masks and on-policy log-probs."""

import random
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cascade import episodes
from envs import base as env_base
from foundation import chat
from models import config as config_lib
from models import hybrid
from models import transformer
from rl import batch as batch_lib
from rl import sampler as sampler_lib


class CharTok:
  """One id per character; id 1 ends a message (`<|im_end|>` decodes to it)."""
  vocab_size = 256
  pad_id = 0
  eos_id = 1
  added_tokens = (chat.IM_END,)

  def encode(self, text):
    out = []
    for k, part in enumerate(text.split(chat.IM_END)):
      out += ([1] if k else []) + [ord(c) % 256 for c in part]
    return out

  def decode(self, ids, skip_special=False):
    del skip_special
    return ''.join(chat.IM_END if i == 1 else chr(i) for i in ids)


class AddEnv(env_base.Environment):
  """'Add A and B': one `add` tool; the answer must be the tool's result. Rewards are distinct per
  record (metadata value), so a reward written to another row shows."""
  name = 'add_test'

  def tools(self, record):
    return [env_base.function_schema('add', 'a + b', {'a': {'type': 'integer'},
                                                      'b': {'type': 'integer'}}, ['a', 'b'])]

  def _execute(self, calls):
    return [str(c.call.arguments['a'] + c.call.arguments['b']) for c in calls]

  def _score(self, eps, answers):
    return [(e.record['metadata']['value'] if a == str(e.record['metadata']['answer']) else 0.0,
             {'reason': 'ok' if a is not None else 'cut', 'id': e.record['id']})
            for e, a in zip(eps, answers)]


_NUMS = re.compile(r'Add (\d+) and (\d+)')
_RESULT = re.compile(r'<tool_response>\n(-?\d+)\n</tool_response>')


class ScriptedSampler:
  """Acts from each prompt's own text: calls `add` first (`calls` times), then answers with the last
  tool result; `wrong(row)` answers 0 instead; rows with `ramble(row)` never stop."""

  pad_id = 0

  def __init__(self, calls=lambda a, b: 1, wrong=lambda a, b: False, ramble=lambda a, b: False):
    self.calls_fn, self.wrong, self.ramble = calls, wrong, ramble
    self.calls = []

  def generate(self, params, prompts, rng, sp, num_samples=1, row_limits=None):
    del params, rng
    assert num_samples == 1
    limits = [sp.max_new_tokens] * len(prompts) if row_limits is None else list(row_limits)
    self.calls.append(dict(rows=len(prompts), max_new=sp.max_new_tokens, limits=limits))
    tok = CharTok()
    texts, trunc = [], []
    for ids in prompts:
      text = tok.decode(ids)
      a, b = map(int, _NUMS.findall(text)[-1])
      made = text.count('<tool_response>')
      if self.ramble(a, b):
        texts.append('z' * sp.max_new_tokens)
        trunc.append(True)
        continue
      if made < self.calls_fn(a, b):
        t = chat.render_tool_call('add', {'a': a, 'b': b})
      else:
        seen = _RESULT.findall(text)
        t = '0' if self.wrong(a, b) else seen[-1] if seen else str(a + b)
      texts.append(t + chat.IM_END)
      trunc.append(False)
    n = sp.max_new_tokens
    toks = np.zeros((len(texts), n), np.int32)
    lens = np.zeros(len(texts), np.int32)
    lps = np.zeros((len(texts), n), np.float32)
    for r, t in enumerate(texts):
      ids = tok.encode(t)
      trunc[r] = trunc[r] or len(ids) > limits[r]         # a row stops at its own limit
      ids = ids[:limits[r]]
      toks[r, :len(ids)] = ids
      lens[r] = len(ids)
      lps[r, :len(ids)] = -0.5 - np.arange(len(ids)) / 100.0   # distinct, checkable
    mask = (np.arange(n)[None] < lens[:, None]).astype(np.int32)
    return sampler_lib.SampleOutput(prompt_tokens=None, prompt_mask=None, tokens=toks, mask=mask,
                                    logprobs=lps, sampling_logprobs=lps, lengths=lens,
                                    truncated=np.array(trunc))


def _records(n=6, seed=0):
  recs = [{'id': f'r{i}', 'domain': 'add', 'messages': [
      {'role': 'user', 'content': f'Add {10 + i} and {3 * i}'}],
      'metadata': {'answer': 10 + 4 * i, 'value': 1.0 + i / 10}} for i in range(n)]
  random.Random(seed).shuffle(recs)
  return recs


SP = sampler_lib.SamplingParams(temperature=1.0, max_new_tokens=96)


def _run(sampler, recs, g=2, **kw):
  kw = {'max_turns': 4, 'max_tokens': 400, **kw}
  return episodes.generate(sampler, None, CharTok(), AddEnv(), recs, [False] * len(recs),
                           jax.random.key(0), SP, g, hosts=None, **kw)


def test_rows_stay_paired_and_turns_share_sampler_calls():
  recs = _records()
  # Records call the tool 0, 1 or 2 times: episodes at different turns share one sampler call.
  calls = lambda a, b: (a - 10) % 3
  s = ScriptedSampler(calls=calls)
  eps = _run(s, recs)
  g = 2
  want_turns = [calls(10 + int(r['id'][1:]), 0) + 1 for r in recs for _ in range(g)]
  assert [i['turns'] for i in eps.infos] == want_turns
  assert [c['rows'] for c in s.calls] == [
      sum(t > k for t in want_turns) for k in range(max(want_turns))]
  for row, rec in enumerate(r for r in recs for _ in range(g)):
    assert eps.records[row] is rec and eps.infos[row]['id'] == rec['id']
    assert eps.rewards[row] == pytest.approx(rec['metadata']['value'])
    assert eps.completions[row].endswith(f'{rec["metadata"]["answer"]}{chat.IM_END}')
  assert not eps.samples.truncated.any()


def test_policy_mask_covers_exactly_the_sampled_tokens():
  recs = _records(3)
  eps = _run(ScriptedSampler(calls=lambda a, b: 2), recs, g=1)
  tok = CharTok()
  s = eps.samples
  for row, rec in enumerate(recs):
    n = int(s.lengths[row])
    stream = tok.decode(s.tokens[row, :n].tolist())
    policy = ''.join(tok.decode([t]) if m else '\0'
                     for t, m in zip(s.tokens[row, :n].tolist(), s.policy_mask[row, :n]))
    # Observations (tool responses and the next generation prompt) are exactly the env's text,
    # rendered by chat.render_observation, and are not policy tokens.
    obs = chat.render_observation([{'role': 'tool', 'name': 'add',
                                    'content': str(rec['metadata']['answer'])}], thinking=False)
    assert stream.count(obs) == 2 and '\0' * len(tok.encode(obs)) in policy
    assert policy.replace('\0', '') == stream.replace(obs, '')
    # The sampler's log-probs sit on policy tokens only.
    assert np.all(s.logprobs[row][s.policy_mask[row] == 0] == 0)
    assert np.all(s.logprobs[row][s.policy_mask[row] == 1] < 0)
    # The opening prompt lists the tools.
    opening = tok.decode(s.prompt_tokens[row][s.prompt_mask[row] > 0].tolist())
    assert opening == episodes.opening_text(AddEnv(), rec, False)
    assert '"name": "add"' in opening
  batch = batch_lib.from_samples(s, np.ones(len(recs)))
  # The loss mask is the policy mask, moved to target alignment; observations are attended to.
  p = s.prompt_tokens.shape[1]
  np.testing.assert_array_equal(batch.loss_mask[:, p - 1:p - 1 + s.tokens.shape[1]],
                                s.policy_mask)
  np.testing.assert_array_equal(batch.segment_ids[:, p:], s.mask)


def test_limits_cut_episodes_and_the_env_scores_them():
  recs = _records(4)
  # Two calls needed but max_turns=2: cut after the second turn, no observation appended.
  eps = _run(ScriptedSampler(calls=lambda a, b: 2), recs, g=1, max_turns=2)
  assert eps.samples.truncated.all() and all(i['cut'] == 'turn limit' for i in eps.infos)
  assert (eps.rewards == 0).all() and all(i['turns'] == 2 for i in eps.infos)
  assert all(c.endswith(chat.IM_END) for c in eps.completions)
  # A turn that never stops is cut at the turn cap.
  eps = _run(ScriptedSampler(ramble=lambda a, b: a % 2 == 0), recs, g=1)
  rambled = [int(r['messages'][0]['content'].split()[1]) % 2 == 0 for r in recs]
  np.testing.assert_array_equal(eps.samples.truncated, rambled)
  assert [i.get('cut') for i in eps.infos] == [
      'turn longer than max_new_tokens' if r else None for r in rambled]
  # The token budget: nothing past it, and the episode is cut.
  samp = ScriptedSampler(calls=lambda a, b: 3)
  eps = _run(samp, recs, g=1, max_tokens=60)
  assert (eps.samples.lengths <= 60).all() and eps.samples.truncated.all()
  assert {i['cut'] for i in eps.infos} == {'token budget'}
  # Each row's turn is asked for no more than its episode's remaining budget.
  assert samp.calls[0]['limits'] == [samp.calls[0]['max_new']] * 4
  assert all(1 <= lim <= c['max_new'] for c in samp.calls for lim in c['limits'])
  samp = ScriptedSampler(calls=lambda a, b: 3)
  eps = _run(samp, recs, g=1, max_tokens=200)
  first, second = samp.calls[:2]
  # The second turn is asked only for what is left: 200 minus the first turn and observation.
  assert second['limits'] == [200 - int(n) for n in eps.samples.lengths - second['max_new']]
  assert second['max_new'] < first['max_new'] and {i['cut'] for i in eps.infos} == {
      'token budget'}


def test_wrong_answers_score_zero_per_row():
  recs = _records(6)
  eps = _run(ScriptedSampler(wrong=lambda a, b: a % 2 == 1), recs)
  for row, rec in enumerate(r for r in recs for _ in range(2)):
    a = int(rec['messages'][0]['content'].split()[1])
    want = 0.0 if a % 2 == 1 else rec['metadata']['value']
    assert eps.rewards[row] == pytest.approx(want)
  m = episodes.metrics(eps)
  assert m['turns'] == 2 and m['tool_calls'] == 1 and m['tool_errors'] == 0
  assert m['success'] == pytest.approx(np.mean(eps.rewards >= 1.0))


def test_demonstrations_tokenize_like_episodes():
  rec = _records(1)[0]
  eps = _run(ScriptedSampler(calls=lambda a, b: 1), [rec], g=1)
  a, b = map(int, _NUMS.findall(rec['messages'][0]['content'])[0])
  demo = dict(rec, turns=[
      {'role': 'assistant', 'content': chat.render_tool_call('add', {'a': a, 'b': b})},
      {'role': 'tool', 'content': str(a + b)},
      {'role': 'assistant', 'content': str(a + b)}])
  toks, mask = episodes.demonstration(demo, CharTok(), False, tools=AddEnv().tools(rec))
  s = eps.samples
  n = int(s.lengths[0])
  want = s.prompt_tokens[0][s.prompt_mask[0] > 0].tolist() + s.tokens[0, :n].tolist()
  assert toks == want
  assert mask == [0] * int(s.prompt_mask[0].sum()) + s.policy_mask[0, :n].tolist()


class EveryTurnTool(env_base.Environment):
  """Any turn is answered with a tool result until turn 3, which ends the episode."""
  name = 'every_turn_test'

  def tools(self, record):
    return []

  def step(self, eps, actions):
    out = []
    for e, a in zip(eps, actions):
      e.turns += 1
      if e.turns >= 3:
        e.done = True
        out.append(env_base.Step(done=True, reward=float(len(a) % 3), info={'reason': 'end'}))
      else:
        out.append(env_base.Step(messages=(env_base.tool_message('t', f'r{e.turns} ' * e.turns),)))
    return out

  def _score(self, eps, answers):
    return [(0.0, {'reason': 'cut'}) for _ in eps]


def _multi_turn(engine='one_call', cfg=None, record_routing=False, **engine_kw):
  """Episodes of a peaked tiny policy whose rows stop at different turns' ends (3 records x 2)."""
  cfg = cfg or config_lib.ModelConfig.tiny()
  graphdef, params = nnx.split(transformer.create(cfg, seed=0))
  params = jax.tree.map(lambda x: x * 4, params)    # peaked: rows stop at different turns' ends
  kw = dict(pad_id=0, prompt_buckets=(64, 128, 256), new_token_buckets=(16,), batch_buckets=(8,))
  recs = [{'id': f'p{i}', 'domain': 'x', 'messages': [{'role': 'user', 'content': 'q' * (i + 1)}],
           'metadata': {}} for i in range(3)]
  sp = sampler_lib.SamplingParams(temperature=0.9, max_new_tokens=12)
  key = jax.random.key(3)
  # Stop ids that the first turn's rows emit at different steps (the same call, never stopping).
  tok, env = CharTok(), EveryTurnTool()
  openings = [tok.encode(episodes.opening_text(env, r, None)) for r in recs for _ in range(2)]
  probe = sampler_lib.Sampler(graphdef, cfg, eos_ids=(), **kw).generate(
      params, openings, jax.random.fold_in(key, 0), sp)
  stops = (int(probe.tokens[0, 2]), int(probe.tokens[3, 6]))
  samp = sampler_lib.Sampler(graphdef, cfg, eos_ids=stops, engine=engine, **kw, **engine_kw)
  eps = episodes.generate(samp, params, tok, env, recs, [None] * 3, key, sp, 2, max_turns=3,
                          max_tokens=120, record_routing=record_routing)
  return eps, samp, graphdef, params


@pytest.mark.heavy
def test_multi_turn_logprobs_equal_a_training_forward_over_the_episode():
  eps, _, graphdef, params = _multi_turn()
  s = eps.samples
  # Some episodes ran several turns (observations inside), some stopped early.
  assert (s.policy_mask.sum(1) < s.lengths).any()
  batch = batch_lib.from_samples(s, np.ones(6))
  model = nnx.merge(graphdef, params)
  logits = model(jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                 jnp.asarray(batch.segment_ids))
  ref = np.asarray(batch_lib.token_logprobs(logits, jnp.asarray(batch.targets)))
  m = batch.loss_mask > 0
  assert m.sum() > 20
  np.testing.assert_allclose(batch.old_logprobs[m], ref[m], atol=1e-4, rtol=0)


@pytest.mark.heavy
def test_paged_episodes_keep_their_pages_between_turns_and_sample_the_same():
  """With the paged engine an episode's cache stays in its pages between turns (a turn prefills
  only its new tokens); the episodes equal the one-call sampler's, which re-prefills."""
  ref, _, _, _ = _multi_turn()
  eps, samp, _, _ = _multi_turn('paged', page_size=8, slots=4, chunk_steps=5, prefill_prompts=2)
  for name in ('prompt_tokens', 'tokens', 'mask', 'policy_mask', 'lengths', 'truncated'):
    np.testing.assert_array_equal(getattr(eps.samples, name), getattr(ref.samples, name),
                                  err_msg=name)
  np.testing.assert_allclose(eps.samples.logprobs, ref.samples.logprobs, atol=1e-4, rtol=0)
  np.testing.assert_array_equal(eps.rewards, ref.rewards)
  # Some episodes took an observation and a second turn, some ended on their first.
  obs = eps.samples.lengths - eps.samples.policy_mask.sum(1)
  assert (obs > 0).any() and (obs == 0).any()
  # A turn's prompt is the stream so far; its last token is fed by the first decode step. So
  # the first turn prefills the opening, and a later turn only what its stream added after the
  # kept cache (the previous turn's last token, then the observation but its last token): the
  # observation's length. The rest, every earlier token, is read from the kept pages.
  prefilled, reused = eps.prefill
  opening = eps.samples.prompt_mask.sum(1)
  assert prefilled == (opening - 1).sum() + obs.sum()
  assert reused >= (opening[obs > 0]).sum()
  assert episodes.metrics(eps)['kv_reuse'] == pytest.approx(reused / (reused + prefilled))
  assert episodes.metrics(ref)['kv_reuse'] == 0.0 and ref.prefill == (0, 0)
  assert samp.pages_in_use == 0


@pytest.mark.heavy
@pytest.mark.parametrize('engine', ['one_call', 'paged'])
def test_episodes_carry_their_routing_across_turns(engine):
  """A mixture-of-experts policy's episodes (several turns, observations between them; with
  the paged engine a KV session between turns): the routing carried along the stream is the
  training forward's own on every token, and replayed it gives the sampler's log-probs."""
  kw = dict(page_size=8, slots=4, chunk_steps=5, prefill_prompts=2) if engine == 'paged' else {}
  eps, _, graphdef, params = _multi_turn(engine, config_lib.ModelConfig.tiny_moe(),
                                         record_routing=True, **kw)
  s = eps.samples
  obs = s.lengths - s.policy_mask.sum(1)
  assert (obs > 0).any()
  batch = batch_lib.from_samples(s, np.ones(6))
  real = batch.segment_ids > 0
  assert batch.routing.shape == batch.tokens.shape + (2, 2)
  model = nnx.merge(graphdef, params)
  model.collect_moe_stats = True
  batch_lib.policy_stats(model, batch._replace(routing=None))       # the routers' own choice
  experts = np.moveaxis(np.asarray(hybrid.moe_stats(model).indices), 0, 2)
  same = (np.sort(experts, -1) == np.sort(batch.routing.astype(np.int64), -1)).all((-1, -2))
  np.testing.assert_array_equal(same[real], True)
  replayed = np.asarray(batch_lib.policy_stats(model, batch)['logprobs'])
  m = batch.loss_mask > 0
  np.testing.assert_allclose(replayed[m], batch.old_logprobs[m], atol=1e-4, rtol=0)


# ------------------------------------------------------------------ the 'agentic' kind


@pytest.fixture()
def add_env_registered():
  import envs  # pylint: disable=g-import-not-at-top
  if 'add_test' not in envs.names():
    envs.register('add_test', AddEnv)
  yield


AGENT = dict(env='add_test', train='a_train', eval='a_train', max_turns=3)


def _agentic_stage(**kw):
  return dict(dict(name='tools', kind='agentic', domains=['a', 'b'], steps=2,
                   optimizer=dict(lr=1e-3), prompts_per_step=4, group_size=2,
                   max_prompt_len=300, max_response_len=120, max_turn_tokens=96,
                   dynamic_filter=False), **kw)


def _agentic_records(n=4):
  recs = []
  for d in ('a', 'b'):
    for r in _records(n, seed=1 if d == 'b' else 0):
      recs.append(dict(r, id=f'{d}{r["id"]}', domain=d))
  random.Random(2).shuffle(recs)
  return recs


def test_agentic_step_pairs_episodes_rewards_and_loss_masks(fakes, tmp_path, monkeypatch,
                                                           add_env_registered):
  import types  # pylint: disable=g-import-not-at-top
  from cascade.data import readers  # pylint: disable=g-import-not-at-top
  from cascade import policies as policies_lib  # pylint: disable=g-import-not-at-top
  from cascade.kinds import agentic  # pylint: disable=g-import-not-at-top
  from cascade.kinds import base  # pylint: disable=g-import-not-at-top
  from cascade.kinds import loop  # pylint: disable=g-import-not-at-top
  plan = fakes.toy_config([_agentic_stage(max_prompt_len=100, max_response_len=400)],
                          max_seq_len=512, domains=dict(
                              a=AGENT, b=dict(AGENT, train='b_train', eval='b_train',
                                              max_turns=2)))
  st = plan.stages[0]
  assert st.kind == 'agentic' and st.turn_tokens == 96
  recs = _agentic_records()
  # 'a' tasks need two tool calls; 'b' allows two turns, so its two-call tasks are cut.
  agents = {d: episodes.Agent(AddEnv(), plan.domains[d].max_turns, False) for d in ('a', 'b')}
  sampler = ScriptedSampler(calls=lambda a, b: 1 + (a % 2),
                            wrong=lambda a, b: a == 13)
  ctx = types.SimpleNamespace(
      plan=plan, workdir=str(tmp_path), mesh=None, rules=plan.rules, sampler=sampler,
      tokenizer=CharTok(), verifiers=types.SimpleNamespace(train_verifier=agents.__getitem__),
      domain_index={'a': 0, 'b': 1}, data=types.SimpleNamespace(stage_records=lambda s: recs),
      policies=policies_lib.Policies(plan, str(tmp_path), None, plan.rules),
      progress=types.SimpleNamespace(rows=[]))
  got = []
  monkeypatch.setattr(loop, 'train_stage', lambda ctx, kind, s, maker_fn: got.append(
      (kind, maker_fn(None))) or base.StageResult())
  agentic.run(ctx, st)
  kind, maker = got[0]
  assert kind is agentic.KIND
  t0 = time.perf_counter()
  [batch], host = maker.make(0, jax.random.key(0), types.SimpleNamespace(params=None))
  wall = time.perf_counter() - t0
  loader = readers.Loader(recs, base.stage_seed(plan.seed, st.index), st.prompts_per_step)
  drawn = loader.next()
  g = st.group_size
  assert batch.tokens.shape == (st.prompts_per_step * g, st.max_prompt_len + st.max_response_len)
  tok = CharTok()
  wants = []
  for row in range(len(drawn) * g):
    rec = drawn[row // g]
    a = int(rec['messages'][0]['content'].split()[1])
    text = tok.decode(batch.tokens[row][batch.segment_ids[row] > 0].tolist())
    assert f"user\nAdd {a} and " in text         # the row is its own record's episode
    cut = rec['domain'] == 'b' and a % 2 == 1
    right = not cut and a != 13
    want = rec['metadata']['value'] if right else 0.0
    assert batch.advantages is not None
    learned = ''.join(tok.decode([t]) for t, m in zip(batch.targets[row], batch.loss_mask[row])
                      if m)
    assert '<tool_response>' not in learned and learned.count('<tool_call>') >= 1
    if right:
      assert learned.endswith(f'{rec["metadata"]["answer"]}{chat.IM_END}')
    wants.append(want)
  # Each row's reward is its own record's (values are distinct per record).
  assert host['reward_mean'] == pytest.approx(np.mean(wants))
  assert len(set(wants)) > 2
  for k in ('episode/turns', 'episode/tool_calls', 'episode/success', 'episode/cut_frac'):
    assert k in host
  assert 0 < host['episode/cut_frac'] < 1
  assert host['score_s'] > 0 and host['sample_s'] > 0     # time in the env counts as scoring
  assert host['score_s'] + host['sample_s'] <= wall        # parts of the step, not more


@pytest.mark.parametrize('edit,message', [
    (lambda c: c.update(stages=[dict(_agentic_stage(), domains=['a', 'plain'])]),
     "domain 'plain' names no env"),
    (lambda c: c.update(stages=[dict(_agentic_stage(), kind='grpo', domains=['a'])]),
     "train it with kind 'agentic'"),
    (lambda c: c.update(stages=[_agentic_stage(dynamic_filter=True, stream_filter=True)]),
     'stream_filter.*multi-turn episode'),
])
def test_agentic_domains_and_kinds_are_matched(fakes, add_env_registered, edit, message):
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  raw = dict(stages=[_agentic_stage()])
  edit(raw)
  if raw['stages'][0]['kind'] == 'grpo':
    for k in ('max_turn_tokens',):
      raw['stages'][0].pop(k)
  with pytest.raises(config_lib.ConfigError, match=message):
    fakes.toy_config(raw['stages'], max_seq_len=512, domains=dict(
        a=AGENT, b=dict(AGENT, train='b_train', eval='b_train'),
        plain=dict(verifier='math', train='a_train', eval='a_train')))


@pytest.mark.parametrize('turn,message', [
    (120, None),                                   # a turn may take the whole budget
    (0, None),                                     # 0: the whole budget
    (121, 'max_turn_tokens=121: exceeds max_response_len=120'),
    (-1, 'max_turn_tokens=-1: must be an int >= 0'),
    (1.5, 'max_turn_tokens=1.5: must be an int >= 0'),
])
def test_agentic_turn_cap_and_its_largest_sampler_call(fakes, add_env_registered, turn, message):
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade.kinds import agentic  # pylint: disable=g-import-not-at-top
  domains = dict(a=AGENT, b=dict(AGENT, train='b_train', eval='b_train'))
  make = lambda: fakes.toy_config([_agentic_stage(max_turn_tokens=turn)], max_seq_len=512,
                                  domains=domains)
  if message:
    with pytest.raises(config_lib.ConfigError, match=message):
      make()
    return
  st = make().stages[0]
  assert st.turn_tokens == 120
  unset = {k: v for k, v in _agentic_stage().items() if k != 'max_turn_tokens'}
  plan = fakes.toy_config([unset], max_seq_len=512, domains=domains)
  assert (plan.stages[0].max_turn_tokens, plan.stages[0].turn_tokens) == (0, 120)
  # launch.plan's largest turn: every episode live, the opening plus the whole budget as prompt.
  assert agentic.sampler_sizes(st) == dict(rows=8, prompt_len=420, max_new_tokens=120,
                                           top_p=st.top_p, top_k=st.top_k)


def test_agentic_records_whose_opening_fits_exactly_are_kept(fakes, add_env_registered):
  from cascade import rollout as rollout_lib  # pylint: disable=g-import-not-at-top
  domains = dict(a=AGENT, b=dict(AGENT, train='b_train', eval='b_train'))
  rec = _agentic_records(1)[0]
  tok = CharTok()
  st0 = fakes.toy_config([_agentic_stage()], max_seq_len=512, domains=domains).stages[0]
  [mode] = rollout_lib.stage_modes(st0.thinking_fraction)
  n = len(tok.encode(episodes.opening_text(AddEnv(), rec, mode, True)))   # tools rendered
  for limit, kept in ((n, True), (n - 1, False)):
    st = fakes.toy_config([_agentic_stage(max_prompt_len=limit)], max_seq_len=2048,
                          domains=domains).stages[0]
    keep, why = st.record_filter(tok)
    assert keep(rec) is kept and f'max_prompt_len={limit}' in why


@pytest.mark.parametrize('fields,message', [
    (dict(AGENT, env='nope'), "env='nope': unknown environment"),
    (dict(AGENT, verifier='math'), 'a domain with an env is scored by its environment'),
    (dict(AGENT, max_turns=0), 'max_turns=0: must be an int >= 1'),
    (dict(AGENT, render_tools='yes'), 'render_tools'),
    (dict(AGENT, max_turn_tokens=-1), 'max_turn_tokens=-1: must be an int >= 0'),
    (dict(verifier='math', train='a_train', eval='a_train', max_turns=3),
     'only a domain with an env takes it'),
])
def test_agentic_domain_fields_are_checked(fakes, add_env_registered, fields, message):
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(config_lib.ConfigError, match=message):
    fakes.toy_config([fakes.rl_stage('rl', ['b'])], domains=dict(a=fields))


def test_evaluation_scores_an_agentic_domain_by_whole_episodes():
  import types  # pylint: disable=g-import-not-at-top
  from cascade import evaluation  # pylint: disable=g-import-not-at-top
  recs = [dict(r, domain='a') for r in _records(6)]
  ev = types.SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, greedy=False,
                             max_new_tokens=300, num_samples=2, batch_size=4, modes=(False,))
  sampler = ScriptedSampler(calls=lambda a, b: 1, wrong=lambda a, b: a % 3 == 0)
  agent = episodes.Agent(AddEnv(), max_turns=3, render_tools=True, max_turn_tokens=96)
  out = evaluation.evaluate(sampler, None, CharTok(), {'a': recs}, lambda d: agent, None, ev,
                            jax.random.key(0))
  wrong = [int(r['messages'][0]['content'].split()[1]) % 3 == 0 for r in recs]
  want = np.mean([0.0 if w else min(r['metadata']['value'], 1.0) for r, w in zip(recs, wrong)])
  assert out['a']['score'] == pytest.approx(100 * want)
  assert out['a']['samples'] == 12 and out['a']['truncated'] == 0
  # Every turn is capped by the domain's max_turn_tokens, the episode by max_new_tokens.
  assert {c['max_new'] for c in sampler.calls} == {96}


def test_readmes_environment_example_runs_an_episode():
  """README's ten-line `Dice` environment registers and scores episodes as it says."""
  import os  # pylint: disable=g-import-not-at-top
  import envs  # pylint: disable=g-import-not-at-top
  readme = open(os.path.join(os.path.dirname(__file__), '..', '..', 'README.md'),
                encoding='utf-8').read()
  [code] = [b for b in readme.split('```python\n')[1:] if 'class Dice' in b]
  code = code.split('```')[0]
  if 'dice' in envs.names():
    code = code.replace("envs.register('dice', Dice)", '')
  scope = {}
  exec(compile(code, 'README.md', 'exec'), scope)  # pylint: disable=exec-used
  env = envs.get('dice')
  rec = {'messages': [{'role': 'user', 'content': 'roll'}], 'metadata': {'answer': 4}}
  [ep] = env.reset([rec])
  [s] = env.step([ep], [chat.render_tool_call('roll', {'seed': 9}) + chat.IM_END])
  assert not s.done and s.messages[0]['content'] == '4'
  [s] = env.step([ep], ['4' + chat.IM_END])
  assert s.done and s.reward == 1.0 and ep.turns == 2 and ep.tool_calls == 1
  [ep] = env.reset([rec])
  [s] = env.step([ep], [chat.render_tool_call('roll', {'seed': 'x'})])
  assert ep.tool_errors == 1 and s.messages[0]['content'].startswith('error: roll: seed')


class CountingEnv(AddEnv):
  """AddEnv that counts the tool calls it runs (per instance: one per simulated host)."""

  def __init__(self, fail=False):
    super().__init__()
    self.ran, self.fail = 0, fail

  def _execute(self, calls):
    if self.fail:
      raise RuntimeError('the sandbox is gone')
    self.ran += len(calls)
    return super()._execute(calls)


def test_with_several_hosts_process_0_steps_the_env_and_every_host_gets_its_steps(fakes):
  recs = _records(4)
  envs_of = [CountingEnv(), CountingEnv()]
  run = lambda hosts: episodes.generate(
      ScriptedSampler(calls=lambda a, b: 1 + a % 2), None, CharTok(), envs_of[hosts.index], recs,
      [False] * 4, jax.random.key(0), SP, 2, max_turns=4, max_tokens=400, hosts=hosts)
  out = fakes.on_hosts(2, run)
  assert not isinstance(out[0], Exception), out[0]
  assert envs_of[0].ran > 0 and envs_of[1].ran == 0           # tools ran once, on process 0
  for field in ('tokens', 'policy_mask', 'lengths'):
    np.testing.assert_array_equal(getattr(out[0].samples, field), getattr(out[1].samples, field))
  np.testing.assert_array_equal(out[0].rewards, out[1].rewards)
  assert out[0].infos == out[1].infos and out[0].rewards.sum() > 0
  # An environment failing on process 0 stops every process with its error, none hangs.
  envs_of[:] = [CountingEnv(fail=True), CountingEnv()]
  out = fakes.on_hosts(2, run)
  assert all(isinstance(e, RuntimeError) and 'the sandbox is gone' in str(e)
             for e in out.values()), out
