"""The SFT example (`cascade.kinds.sft.example`): the prompt is context, only the response is
learned, in the mode the record asks for."""

import types

import jax

from cascade import episodes
from cascade import rollout
from cascade.kinds import base
from cascade.kinds import loop
from cascade.kinds import sft
from foundation import chat
from models import sharding
from rl import sft as sft_lib

REC = {'domain': 'a', 'messages': [{'role': 'user', 'content': 'Copy 7.'}],
       'response': '\\boxed{7}'}


def _check(fakes, rec, switch, mode, thinking, max_len=1000):
  tok = fakes.CharTokenizer()
  toks, mask = sft.example(rec, tok, switch, max_len)
  prompt = rollout.prompt_text(rec, mode)
  response = chat.render_response(rec['response'], thinking)
  assert tok.decode(toks) == (prompt + response)[:max_len]
  assert mask == ([0] * len(prompt) + [1] * len(response))[:max_len]
  assert tok.decode([t for t, m in zip(toks, mask) if m]) == response[:max(0, max_len - len(prompt))]
  return toks, mask


def test_instruct_record_learns_only_its_response(fakes):
  # No thinking trace: instruct mode, whose prompt already holds the empty thinking block.
  _check(fakes, REC, True, False, None)
  assert '/no_think' in rollout.prompt_text(REC, False)


def test_thinking_record_learns_its_thinking_and_response(fakes):
  rec = dict(REC, thinking='seven')
  _, mask = _check(fakes, rec, True, True, 'seven')
  assert sum(mask) == len(chat.render_response(rec['response'], 'seven'))


def test_without_the_switch_no_mode_and_the_trace_is_kept(fakes):
  _check(fakes, dict(REC, thinking='seven'), False, None, 'seven')
  _check(fakes, REC, False, None, None)


def test_max_len_cuts_tokens_and_mask_together(fakes):
  n = len(rollout.prompt_text(REC, False))
  _check(fakes, REC, True, False, None, max_len=n + 3)
  toks, mask = _check(fakes, REC, True, False, None, max_len=n - 2)
  assert len(toks) == n - 2 and not any(mask)


def test_record_filter_drops_examples_with_nothing_to_learn(fakes):
  # The filter judges the stage's items: records as `tokenize` makes them into examples.
  tok = fakes.CharTokenizer()
  plan = fakes.toy_config([dict(fakes.SFT_STAGE, max_len=len(rollout.prompt_text(REC, False)))])
  keep, why = plan.stages[0].record_filter(tok)
  assert not keep(plan.stages[0].tokenize(tok)(REC)) and 'prompt fills max_len' in why
  plan = fakes.toy_config([dict(fakes.SFT_STAGE, max_len=120)])
  assert plan.stages[0].record_filter(tok)[0](plan.stages[0].tokenize(tok)(REC))


def test_multi_turn_demonstration_takes_the_stage_switch(fakes):
  # A `turns` record is tokenized as an agentic episode: instruct mode with the switch,
  # no mode without it (the two differ: the mode shows in the opening prompt).
  rec = dict(REC, turns=[{'role': 'assistant', 'content': 'Done: \\boxed{7}'}])
  tok = fakes.CharTokenizer()
  on, off = sft.example(rec, tok, True, 10_000), sft.example(rec, tok, False, 10_000)
  assert list(on) == list(episodes.demonstration(rec, tok, False))
  assert list(off) == list(episodes.demonstration(rec, tok, None))
  assert list(on) != list(off)


def test_packed_rows_split_over_microbatches_and_batch_shards(fakes, monkeypatch):
  # 12 examples of up to 40 tokens in rows of 64: however many rows they pack into, the
  # batch has the next multiple of microbatches (2) x batch shards (3) rows, padded.
  plan = fakes.toy_config([dict(fakes.SFT_STAGE, batch_size=12, max_len=64, microbatches=2)])
  st = plan.stages[0]
  recs = [dict(fakes.record('a', i, 10 + i), response='\\boxed{%d}' % (10 + i) + ' ok' * i)
          for i in range(12)]
  tok = fakes.CharTokenizer()
  items = [st.tokenize(tok)(r) for r in recs]     # what the stage's stream yields
  ctx = types.SimpleNamespace(plan=plan, tokenizer=tok, batch_shards=3,
                              data=types.SimpleNamespace(stage_records=lambda s: items))
  got = []
  monkeypatch.setattr(loop, 'train_stage',
                      lambda ctx, kind, s, maker_fn: got.append(maker_fn(None)))
  sft.run(ctx, st)
  [batch], metrics = got[0].make(0, jax.random.key(0), None)
  ex = [sft.example(r, tok, st.thinking_switch, st.max_len) for r in recs]
  packed = sft_lib.pack(ex, st.max_len, pad_id=0).tokens.shape[0]
  assert 1 < packed and batch.tokens.shape == (base.rows_bucket(packed, 6), 64)
  assert batch.tokens.shape[0] % 6 == 0 and metrics['rows'] == batch.tokens.shape[0]
  assert metrics['examples'] == 12
  assert metrics['learned_tokens'] == sum(sum(m) for _, m in ex)
  # launch.plan's abstract batch follows the same rule on a mesh of 3 batch shards.
  monkeypatch.setattr(sft.sharding, 'batch_shards', lambda mesh, rules: 3)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  abstract, what = sft.abstract_batch(st, mesh, plan.rules)
  assert abstract.tokens.shape == (base.rows_bucket(12, 6), 64) and abstract.tokens.shape[0] % 6 == 0
  assert what.startswith(f'{abstract.tokens.shape[0]} packed rows x 64 tokens')
