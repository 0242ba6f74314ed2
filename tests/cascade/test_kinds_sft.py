"""The SFT example (`cascade.kinds.sft.example`): the prompt is context, only the response is
learned, in the mode the record asks for."""

from cascade import rollout
from cascade.kinds import sft
from models import chat

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
  plan = fakes.toy_config([dict(fakes.SFT_STAGE, max_len=len(rollout.prompt_text(REC, False)))])
  keep, why = plan.stages[0].record_filter(fakes.CharTokenizer())
  assert not keep(REC) and 'prompt fills max_len' in why
  plan = fakes.toy_config([dict(fakes.SFT_STAGE, max_len=120)])
  assert plan.stages[0].record_filter(fakes.CharTokenizer())[0](REC)
