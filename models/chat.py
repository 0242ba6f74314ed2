"""Qwen3-style ChatML template with the thinking / instruct switch, and thinking-block splitting.

Host-only (no jax import), so verifiers can use it.

Thinking control follows Nemotron-Cascade / Qwen3: " /think" or " /no_think"
is appended to the last user turn. In instruct mode the generation prompt
pre-fills an empty thinking block (`<think>\\n\\n</think>\\n\\n`), as Qwen3's
template does, so the model writes only the answer. In multi-turn
conversations, earlier assistant turns keep only their final answers.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

IM_START = '<|im_start|>'
IM_END = '<|im_end|>'
THINK_OPEN = '<think>'
THINK_CLOSE = '</think>'
ENDOFTEXT = '<|endoftext|>'
SPECIAL_TOKENS = (IM_START, IM_END, THINK_OPEN, THINK_CLOSE, ENDOFTEXT)
EMPTY_THINK = f'{THINK_OPEN}\n\n{THINK_CLOSE}\n\n'
ROLES = ('system', 'user', 'assistant')
TOOL_CALL_OPEN = '<tool_call>'
TOOL_CALL_CLOSE = '</tool_call>'
TOOL_RESPONSE_OPEN = '<tool_response>'
TOOL_RESPONSE_CLOSE = '</tool_response>'
# Bounds on parsing one assistant turn (model text is untrusted): calls read, and
# characters of one call's JSON. Past them the turn gets an error, not a slow parse.
MAX_TOOL_CALLS = 16
MAX_TOOL_CALL_CHARS = 20_000


@dataclasses.dataclass(frozen=True)
class Split:
  """A completion split into its thinking part and its final answer.

  Attributes:
    thinking: the text inside the thinking block ('' when there was none).
    answer: the text after the thinking block (the whole text without one);
      '' when the thinking never closed.
    finished_thinking: False iff a thinking block was opened and never closed.
    had_thinking: a thinking block was present.
  """
  thinking: str
  answer: str
  finished_thinking: bool
  had_thinking: bool


def split_thinking(completion: str) -> Split:
  """Splits a completion at its thinking block.

  A `</think>` without an opening tag (the opening tag was in the prompt)
  also closes a thinking block.

  Args:
    completion: the generated text (may end with `<|im_end|>`).

  Returns:
    A `Split`.
  """
  text = completion
  for stop in (IM_END, ENDOFTEXT):
    if text.endswith(stop):
      text = text[: -len(stop)]
  close = text.find(THINK_CLOSE)
  open_ = text.find(THINK_OPEN)
  if close >= 0 and (open_ < 0 or open_ < close):
    start = open_ + len(THINK_OPEN) if open_ >= 0 else 0
    return Split(thinking=text[start:close].strip(), answer=text[close + len(THINK_CLOSE):].strip(),
                 finished_thinking=True, had_thinking=True)
  if open_ >= 0:
    return Split(thinking=text[open_ + len(THINK_OPEN):].strip(), answer='',
                 finished_thinking=False, had_thinking=True)
  return Split(thinking='', answer=text.strip(), finished_thinking=True, had_thinking=False)


def render(messages: Sequence[Mapping[str, str]], *, thinking: bool | None = None,
           add_generation_prompt: bool = True) -> str:
  """Renders a conversation in ChatML.

  Args:
    messages: dicts with 'role' in ('system', 'user', 'assistant') and 'content'.
    thinking: True appends ' /think' to the last user turn, False appends
      ' /no_think' and pre-fills an empty thinking block; None adds neither.
    add_generation_prompt: end with the opening of an assistant turn.

  Returns:
    The prompt text.

  Raises:
    ValueError: a message with an unknown role or without content.
  """
  last_user = max((i for i, m in enumerate(messages) if m.get('role') == 'user'), default=-1)
  parts = []
  for i, m in enumerate(messages):
    role, content = m.get('role'), m.get('content')
    if role not in ROLES:
      raise ValueError(f'message {i}: role {role!r} is not one of {ROLES}')
    if not isinstance(content, str):
      raise ValueError(f'message {i}: content must be a string, got {type(content).__name__}')
    if role == 'assistant':
      content = split_thinking(content).answer or content
    if i == last_user and thinking is not None:
      content = content + (' /think' if thinking else ' /no_think')
    parts.append(f'{IM_START}{role}\n{content}{IM_END}\n')
  if add_generation_prompt:
    parts.append(f'{IM_START}assistant\n')
    if thinking is False:
      parts.append(EMPTY_THINK)
  return ''.join(parts)


def render_response(answer: str, thinking: str | None = None) -> str:
  """The assistant text a model should produce (gold SFT targets), ending with <|im_end|>.

  Args:
    answer: the final answer.
    thinking: the reasoning for thinking mode; None for instruct mode (whose
      empty thinking block is already in the prompt).
  """
  if thinking is None:
    return f'{answer}{IM_END}'
  return f'{THINK_OPEN}\n{thinking}\n{THINK_CLOSE}\n\n{answer}{IM_END}'


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed call: the tool's name and its arguments (a JSON object)."""
  name: str
  arguments: dict


@dataclasses.dataclass(frozen=True)
class Turn:
  """An assistant turn parsed for tool calls.

  Attributes:
    content: the answer text with the tool-call blocks removed (stripped).
    calls: the well-formed calls, in order.
    errors: one line per malformed block ('tool call 2: ...'); a turn with
      errors and no calls is still a tool turn (the environment answers with
      the errors), not a final answer.
    finished_thinking: False iff a thinking block was opened and never closed.
  """
  content: str
  calls: tuple[ToolCall, ...]
  errors: tuple[str, ...]
  finished_thinking: bool = True

  @property
  def is_tool_turn(self) -> bool:
    """The turn asked for tools (well-formed or not): the episode goes on."""
    return bool(self.calls or self.errors)


def _parse_call(body: str) -> ToolCall:
  """One `<tool_call>` body -> ToolCall; ValueError says what is wrong."""
  if len(body) > MAX_TOOL_CALL_CHARS:
    raise ValueError(f'longer than {MAX_TOOL_CALL_CHARS} characters')
  try:
    value = json.loads(body, parse_constant=lambda c: (_ for _ in ()).throw(
        ValueError(f'{c} is not JSON')))
  except RecursionError:
    raise ValueError('JSON nested too deeply') from None
  except ValueError as e:
    raise ValueError(f'not valid JSON ({e})') from None
  if not isinstance(value, dict):
    raise ValueError(f'expected a JSON object, got {type(value).__name__}')
  name = value.get('name')
  if not isinstance(name, str) or not name:
    raise ValueError('"name" must be a non-empty string')
  args: Any = value.get('arguments', {})
  if isinstance(args, str):  # Some models write the arguments as a JSON string.
    try:
      args = json.loads(args)
    except (ValueError, RecursionError):
      raise ValueError('"arguments" is a string that is not a JSON object') from None
  if not isinstance(args, dict):
    raise ValueError(f'"arguments" must be a JSON object, got {type(args).__name__}')
  extra = sorted(set(value) - {'name', 'arguments'})
  if extra:
    raise ValueError(f'unexpected keys {extra}')
  return ToolCall(name=name, arguments=args)


def parse_tool_calls(completion: str) -> Turn:
  """Parses an assistant turn's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

  Only the text after the thinking block is searched (calls inside the
  reasoning are not calls). Never raises on model text: malformed blocks
  (bad JSON, a missing name, an unclosed tag, too many calls) become
  `errors`. Runs in time linear in the text.

  Args:
    completion: the sampled assistant turn (may end with `<|im_end|>`).

  Returns:
    A `Turn`.
  """
  split = split_thinking(completion)
  text = split.answer
  calls, errors, content = [], [], []
  pos = 0
  index = 0
  while True:
    start = text.find(TOOL_CALL_OPEN, pos)
    if start < 0:
      content.append(text[pos:])
      break
    content.append(text[pos:start])
    index += 1
    body_start = start + len(TOOL_CALL_OPEN)
    end = text.find(TOOL_CALL_CLOSE, body_start)
    if end < 0:
      errors.append(f'tool call {index}: {TOOL_CALL_OPEN} is never closed by {TOOL_CALL_CLOSE}')
      break
    pos = end + len(TOOL_CALL_CLOSE)
    if index > MAX_TOOL_CALLS:
      errors.append(f'tool call {index}: more than {MAX_TOOL_CALLS} calls in one turn')
      content.append(text[pos:])
      break
    try:
      calls.append(_parse_call(text[body_start:end].strip()))
    except ValueError as e:
      errors.append(f'tool call {index}: {e}')
  return Turn(content=''.join(content).strip(), calls=tuple(calls), errors=tuple(errors),
              finished_thinking=split.finished_thinking)
