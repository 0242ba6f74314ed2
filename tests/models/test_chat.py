"""Chat template and thinking-block splitting."""

from models import chat


def test_render_thinking_and_instruct():
  msgs = [{'role': 'system', 'content': 'be brief'}, {'role': 'user', 'content': 'hi'}]
  think = chat.render(msgs, thinking=True)
  assert think.endswith('<|im_start|>user\nhi /think<|im_end|>\n<|im_start|>assistant\n')
  assert think.startswith('<|im_start|>system\nbe brief<|im_end|>\n')
  inst = chat.render(msgs, thinking=False)
  assert inst.endswith('hi /no_think<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n')
  assert '/think' not in chat.render(msgs)


def test_multiturn_keeps_only_final_answers():
  msgs = [{'role': 'user', 'content': 'a'},
          {'role': 'assistant', 'content': '<think>secret</think>\n\nanswer one'},
          {'role': 'user', 'content': 'b'}]
  text = chat.render(msgs, thinking=True)
  assert 'secret' not in text and 'answer one' in text
  assert text.count('/think') == 1 and 'b /think' in text


def test_split_thinking():
  s = chat.split_thinking('<think>\nwork\n</think>\n\nThe answer<|im_end|>')
  assert (s.thinking, s.answer, s.finished_thinking, s.had_thinking) == (
      'work', 'The answer', True, True)
  s = chat.split_thinking('<think> still going')
  assert not s.finished_thinking and s.answer == '' and s.thinking == 'still going'
  s = chat.split_thinking('plain answer')
  assert s.finished_thinking and not s.had_thinking and s.answer == 'plain answer'
  s = chat.split_thinking('reasoning continued from prompt</think>final')
  assert s.answer == 'final' and s.thinking == 'reasoning continued from prompt'
  assert chat.render_response('x', 'why') == '<think>\nwhy\n</think>\n\nx<|im_end|>'
