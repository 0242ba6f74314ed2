"""Qwen3-style ChatML: the thinking / instruct switch, tools, and tool-call parsing.

Host-only (no jax import), so verifiers and environments can use it.

Thinking control follows Nemotron-Cascade / Qwen3: " /think" or " /no_think"
is appended to the last user turn. In instruct mode the generation prompt
pre-fills an empty thinking block (`<think>\\n\\n</think>\\n\\n`), as Qwen3's
template does, so the model writes only the answer. In multi-turn
conversations, earlier assistant turns keep only their final answers.

Tools follow Qwen3's template. `render(messages, tools=schemas)` puts the
schemas (OpenAI function format, `{"type": "function", "function": {"name",
"description", "parameters"}}`) in the system turn, after the system
message's content: a `# Tools` section lists them one JSON object per line
between `<tools>` and `</tools>` and shows the call format. The assistant calls
tools after its thinking, one block per call:

    <tool_call>
    {"name": "search", "arguments": {"query": "tides"}}
    </tool_call>

`render_tool_call` writes such a block (demonstrations; assistant messages
may also carry structured `tool_calls`), `parse_tool_calls` reads a sampled
turn's blocks. Tool results are messages with role 'tool'; consecutive ones
form one user turn of `<tool_response>\\n...\\n</tool_response>` blocks, which
never takes the thinking switch. In an agentic episode the prompt grows by
`render_observation` after each sampled turn, so the policy is always
conditioned on exactly the tokens it sampled.

`TEMPLATE` is `render` written as a Jinja chat template, which HF exports carry
(models/hf_tokenizer.py), so `transformers`' `apply_chat_template` (which vLLM and
SGLang call) builds the same prompts (tests/models/test_hf_tokenizer.py).

`SPECIAL_TOKENS` are the chat tokens a tokenizer keeps as single special ids;
`TOOL_TOKENS` are the tool markers, which a tokenizer may also keep as single
(not special: decoding keeps them) pieces. A tokenizer may know more tokens
that it reads whole from text (`<|fim_prefix|>`, `<|vision_start|>`, reserved
ones); `defuse` and `render_observation(markers=...)` take the tokenizer's
own list (`foundation.tokenizer.Tokenizer.added_tokens`), so text from outside the
policy never becomes any of them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, Mapping, Sequence

IM_START = '<|im_start|>'
IM_END = '<|im_end|>'
THINK_OPEN = '<think>'
THINK_CLOSE = '</think>'
ENDOFTEXT = '<|endoftext|>'
SPECIAL_TOKENS = (IM_START, IM_END, THINK_OPEN, THINK_CLOSE, ENDOFTEXT)
EMPTY_THINK = f'{THINK_OPEN}\n\n{THINK_CLOSE}\n\n'
ROLES = ('system', 'user', 'assistant', 'tool')
TOOL_CALL_OPEN = '<tool_call>'
TOOL_CALL_CLOSE = '</tool_call>'
TOOL_RESPONSE_OPEN = '<tool_response>'
TOOL_RESPONSE_CLOSE = '</tool_response>'
TOOL_TOKENS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)
# Bounds on parsing one assistant turn (model text is untrusted): calls read, and
# characters of one call's JSON. Past them the turn gets an error, not a slow parse.
MAX_TOOL_CALLS = 16
MAX_TOOL_CALL_CHARS = 20_000
# The `# Tools` section of the system turn, around the schemas (one JSON object per line).
_TOOLS_INTRO = ('# Tools\n\n'
                'You can call one or more of the functions below to help with the request.\n\n'
                'Their signatures follow, one JSON object per line, inside <tools></tools> tags:\n'
                '<tools>\n')
_TOOLS_OUTRO = ('\n</tools>\n\n'
                'To call a function, write a JSON object with its name and arguments inside '
                '<tool_call></tool_call> tags:\n'
                f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
                f'{TOOL_CALL_CLOSE}')

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


@functools.lru_cache(maxsize=8)
def _marker_pattern(markers: tuple[str, ...]) -> re.Pattern:
  # Longest first, so that a marker that starts another is replaced whole.
  return re.compile('|'.join(map(re.escape, sorted(set(markers), key=len, reverse=True))))


def _escape_first(m: re.Match) -> str:
  first = m.group(0)[0]
  return ('&lt;' if first == '<' else f'&#{ord(first)};') + m.group(0)[1:]


def defuse(text: str, markers: Sequence[str] = ()) -> str:
  """`text` with no chat or tool marker, nor any of `markers`, left verbatim.

  Each occurrence has its first character written as an HTML character
  reference ('<' as '&lt;'), so a reader still sees which token was meant
  but a tokenizer cannot read it as that token.

  Args:
    text: text from outside the policy (a tool's output, an observation).
    markers: further tokens to defuse, normally the tokenizer's
      `added_tokens`; SPECIAL_TOKENS and TOOL_TOKENS are always defused.

  Returns:
    The defused text.
  """
  every = tuple(m for m in (*SPECIAL_TOKENS, *TOOL_TOKENS, *markers) if len(m) > 1)
  if not any(m in text for m in every):
    return text
  return _marker_pattern(every).sub(_escape_first, text)


def _dumps(value: Any) -> str:
  """`value` as one line of JSON (non-ASCII kept) in which no chat marker appears verbatim.

  A marker's '<' can only sit inside a JSON string, where `\\u003c` means the
  same character: the text still parses to `value`, but a `</tool_call>`,
  `</think>` or `<|im_end|>` inside an argument can no longer end the block,
  the thinking or the turn (nor become a special token).
  """
  try:
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
  except (TypeError, ValueError, RecursionError) as e:
    raise ValueError(f'not JSON-serialisable ({e})') from None
  for marker in SPECIAL_TOKENS + TOOL_TOKENS:
    text = text.replace(marker, '\\u003c' + marker[1:])
  return text


def render_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
  """One tool call as the assistant writes it (demonstrations, structured `tool_calls`).

  `parse_tool_calls` reads the block back as (name, arguments), provided its
  JSON stays within MAX_TOOL_CALL_CHARS.

  Args:
    name: the tool's name.
    arguments: the call's arguments, a JSON object (string keys).

  Returns:
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

  Raises:
    ValueError: an empty or non-string name, or arguments that are not a
      JSON-serialisable dict.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f'name must be a non-empty string, got {name!r}')
  if not isinstance(arguments, Mapping):
    raise ValueError(f'arguments must be a dict, got {type(arguments).__name__}')
  try:
    body = _dumps({'name': name, 'arguments': dict(arguments)})
  except ValueError as e:
    raise ValueError(f'arguments: {e}') from None
  return f'{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}'


def _is_list(value: Any) -> bool:
  return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
  """The `# Tools` part of the system turn ('' without tools): the schemas and the call format."""
  if not _is_list(tools):
    raise ValueError(f'tools must be a list of function schemas, got {type(tools).__name__}')
  if not tools:
    return ''
  lines, seen = [], {}
  for k, tool in enumerate(tools):
    fn = tool.get('function') if isinstance(tool, Mapping) else None
    name = fn.get('name') if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
      raise ValueError(f'tools[{k}]: function.name must be a non-empty string (expected '
                       '{"type": "function", "function": {"name", "description", "parameters"}})')
    if tool.get('type', 'function') != 'function':
      raise ValueError(f'tools[{k}]: type must be "function", got {tool["type"]!r}')
    if not isinstance(fn.get('parameters', {}), Mapping):
      raise ValueError(f'tools[{k}]: function.parameters must be a JSON schema object')
    if name in seen:
      raise ValueError(f'tools[{k}]: function.name {name!r} repeats tools[{seen[name]}]')
    seen[name] = k
    try:
      lines.append(_dumps(tool))
    except ValueError as e:
      raise ValueError(f'tools[{k}]: {e}') from None
  return _TOOLS_INTRO + '\n'.join(lines) + _TOOLS_OUTRO


def _check_message(i: int, m: Any) -> tuple[str, str]:
  """(role, content) of message `i`; ValueError names the index and the field."""
  if not isinstance(m, Mapping):
    raise ValueError(f'message {i}: expected a dict, got {type(m).__name__}')
  role, content = m.get('role'), m.get('content')
  if role not in ROLES:
    raise ValueError(f'message {i}: role {role!r} is not one of {ROLES}')
  if not isinstance(content, str):
    raise ValueError(f'message {i}: content must be a string, got {type(content).__name__}')
  if role == 'tool' and m.get('name') is not None and not isinstance(m['name'], str):
    raise ValueError(f'message {i}: name must be a string, got {type(m["name"]).__name__}')
  if role != 'assistant' and m.get('tool_calls') is not None:
    raise ValueError(f'message {i}: tool_calls: only assistant messages make tool calls '
                     f'(role {role!r})')
  return role, content


def _assistant_content(i: int, m: Mapping[str, Any]) -> str:
  """An earlier assistant turn as rendered: its final answer, then its tool-call blocks."""
  content, calls = m['content'], m.get('tool_calls')
  if calls is not None and not _is_list(calls):
    raise ValueError(f'message {i}: tool_calls must be a list, got {type(calls).__name__}')
  if not calls:
    return split_thinking(content).answer or content
  blocks = []
  for k, call in enumerate(calls):
    if isinstance(call, ToolCall):
      call = {'name': call.name, 'arguments': call.arguments}
    if not isinstance(call, Mapping):
      raise ValueError(f'message {i}: tool_calls[{k}] must be a dict with "name" and '
                       f'"arguments", got {type(call).__name__}')
    try:
      blocks.append(render_tool_call(call.get('name'), call.get('arguments', {})))
    except ValueError as e:
      raise ValueError(f'message {i}: tool_calls[{k}]: {e}') from None
  split = split_thinking(content)
  answer = split.answer if split.finished_thinking else content
  if TOOL_CALL_OPEN in answer:  # A sampled turn: its own blocks are the calls.
    return answer
  return '\n'.join([answer, *blocks] if answer else blocks)


def _tool_turn(contents: Sequence[str]) -> str:
  """Consecutive tool results as one user turn of `<tool_response>` blocks."""
  blocks = ''.join(f'\n{TOOL_RESPONSE_OPEN}\n{c}\n{TOOL_RESPONSE_CLOSE}' for c in contents)
  return f'{IM_START}user{blocks}{IM_END}\n'


def _generation_prompt(thinking: bool | None) -> str:
  return f'{IM_START}assistant\n' + (EMPTY_THINK if thinking is False else '')


def render(messages: Sequence[Mapping[str, Any]], *, thinking: bool | None = None,
           add_generation_prompt: bool = True,
           tools: Sequence[Mapping[str, Any]] | None = None) -> str:
  """Renders a conversation in ChatML.

  Args:
    messages: dicts with 'role' in ROLES and a string 'content'. An assistant
      message may carry 'tool_calls', a list of {'name', 'arguments'} (or
      `ToolCall`s), rendered as `<tool_call>` blocks after its content; one
      whose answer already holds `<tool_call>` blocks (a sampled turn) is
      rendered as it is. A 'tool' message is one tool result (an optional
      'name' is not rendered); consecutive ones form one user turn.
    thinking: True appends ' /think' to the last user turn, False appends
      ' /no_think' and pre-fills an empty thinking block; None adds neither.
      Tool-response turns (from 'tool' messages) are not user turns here.
    add_generation_prompt: end with the opening of an assistant turn.
    tools: tool schemas in the OpenAI / Qwen3 function format; the system
      turn lists them (a system turn is added when the conversation does not
      open with one). None or empty: no tools section.

  Returns:
    The prompt text.

  Raises:
    ValueError: a message with an unknown role, without string content or
      with malformed tool_calls, or a malformed tool schema; the message names
      the index and the field.
  """
  checked = [_check_message(i, m) for i, m in enumerate(messages)]
  last_user = max((i for i, (role, _) in enumerate(checked) if role == 'user'), default=-1)
  parts, results = [], []
  section = '' if tools is None else _tools_section(tools)
  if section and (not checked or checked[0][0] != 'system'):
    parts.append(f'{IM_START}system\n{section}{IM_END}\n')
  for i, (role, content) in enumerate(checked):
    if role == 'tool':
      results.append(content)
      continue
    if results:
      parts.append(_tool_turn(results))
      results = []
    if role == 'assistant':
      content = _assistant_content(i, messages[i])
    if i == 0 and role == 'system' and section:
      content = f'{content}\n\n{section}' if content else section
    if i == last_user and thinking is not None:
      content = content + (' /think' if thinking else ' /no_think')
    parts.append(f'{IM_START}{role}\n{content}{IM_END}\n')
  if results:
    parts.append(_tool_turn(results))
  if add_generation_prompt:
    parts.append(_generation_prompt(thinking))
  return ''.join(parts)


def render_observation(tool_messages: Sequence[Mapping[str, Any]], *,
                       thinking: bool | None = None, markers: Sequence[str] = ()) -> str:
  """The text that follows a sampled assistant turn in an agentic episode.

  An episode's prompt is built incrementally, `render(opening, thinking=m,
  tools=t) + turn_1 + render_observation(obs_1, thinking=m) + turn_2 + ...`,
  where each turn is the sampled text ending with `<|im_end|>`; it is the
  exact token stream the policy sampled. It equals the full re-render
  `render(opening + [{'role': 'assistant', 'content': turn_1}, *obs_1, ...],
  thinking=m, tools=t)` byte for byte (opening, tool-response turns,
  generation prompts) except inside each earlier assistant turn: after its
  `<|im_start|>assistant\\n` the incremental text keeps the pre-filled empty
  thinking block (m False) and the sampled text verbatim, with its thinking
  block and the whitespace around the answer, where the re-render has only
  the final answer `split_thinking(turn).answer` (tool-call blocks included).
  The thinking switch sits on the opening's last user message in both.

  Args:
    tool_messages: the results of the turn's calls, role 'tool', in order.
    thinking: as in `render`: False pre-fills an empty thinking block.
    markers: tokens the tokenizer reads whole (its `added_tokens`); each
      message's content is `defuse`d with them (and the chat and tool
      markers), so no tool output becomes a token of the tokenizer.

  Returns:
    '\\n' (closing the sampled turn's line), the tool-response user turn and
    the next generation prompt.

  Raises:
    ValueError: no messages, or a message that is not a well-formed tool
      message (names the index and the field).
  """
  if not tool_messages:
    raise ValueError('render_observation: no tool messages')
  contents = []
  for i, m in enumerate(tool_messages):
    role, content = _check_message(i, m)
    if role != 'tool':
      raise ValueError(f"message {i}: role {role!r}: observations are 'tool' messages")
    contents.append(defuse(content, tuple(markers)))
  return '\n' + _tool_turn(contents) + _generation_prompt(thinking)


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


def _jinja(text: str) -> str:
  """`text` as a Jinja string literal (JSON's escapes are Jinja's)."""
  return json.dumps(text)


def _chat_template() -> str:
  """`render` as a Jinja chat template, for `transformers`' `apply_chat_template` (TEMPLATE)."""
  lit = _jinja
  markers = '[' + ', '.join(map(lit, SPECIAL_TOKENS + TOOL_TOKENS)) + ']'
  lines = [
      # _dumps: tojson (HF's: ensure_ascii=False, json.dumps' separators), markers' '<' escaped.
      '{%- macro dumps(value) -%}',
      '{%- set d = namespace(text=value | tojson) -%}',
      f'{{%- for m in {markers} -%}}',
      r"{%- set d.text = d.text | replace(m, '\\u003c' ~ m[1:]) -%}",
      '{%- endfor -%}',
      '{{- d.text -}}',
      '{%- endmacro -%}',
      # The mode: `thinking` as in render; `enable_thinking` (Qwen3's name) when it is not given.
      '{%- set ns = namespace(mode=none, last_user=-1, tools="", text="") -%}',
      '{%- if thinking is defined and thinking is not none -%}{%- set ns.mode = thinking -%}',
      '{%- elif enable_thinking is defined and enable_thinking is not none -%}',
      '{%- set ns.mode = enable_thinking -%}{%- endif -%}',
      "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}",
      '{%- endif -%}{%- endfor -%}',
      '{%- if tools is defined and tools -%}',
      f'{{%- set ns.tools = {lit(_TOOLS_INTRO)} -%}}',
      '{%- for tool in tools -%}',
      "{%- set ns.tools = ns.tools ~ ('' if loop.first else '\\n') ~ dumps(tool) -%}",
      '{%- endfor -%}',
      f'{{%- set ns.tools = ns.tools ~ {lit(_TOOLS_OUTRO)} -%}}',
      "{%- if not messages or messages[0].role != 'system' -%}",
      f"{{{{- {lit(IM_START + 'system' + chr(10))} ~ ns.tools ~ {lit(IM_END + chr(10))} -}}}}",
      '{%- endif -%}{%- endif -%}',
      '{%- for m in messages -%}',
      "{%- set text = m.content if m.content is string else '' -%}",
      "{%- if m.role == 'tool' -%}",
      "{%- if loop.first or loop.previtem.role != 'tool' -%}"
      f"{{{{- {lit(IM_START + 'user')} -}}}}{{%- endif -%}}",
      f'{{{{- {lit(chr(10) + TOOL_RESPONSE_OPEN + chr(10))} ~ text ~ '
      f'{lit(chr(10) + TOOL_RESPONSE_CLOSE)} -}}}}',
      "{%- if loop.last or loop.nextitem.role != 'tool' -%}"
      f'{{{{- {lit(IM_END + chr(10))} -}}}}{{%- endif -%}}',
      '{%- else -%}',
      '{%- set content = text -%}',
      "{%- if m.role == 'assistant' -%}",
      # split_thinking(content): the answer, and whether the thinking was closed.
      f'{{%- if text.endswith({lit(IM_END)}) -%}}{{%- set text = text[:-{len(IM_END)}] -%}}'
      '{%- endif -%}',
      f'{{%- if text.endswith({lit(ENDOFTEXT)}) -%}}{{%- set text = text[:-{len(ENDOFTEXT)}] -%}}'
      '{%- endif -%}',
      f'{{%- set close = text.find({lit(THINK_CLOSE)}) -%}}'
      f'{{%- set open = text.find({lit(THINK_OPEN)}) -%}}',
      '{%- set finished = true -%}',
      '{%- if close >= 0 and (open < 0 or open < close) -%}'
      f'{{%- set answer = text[close + {len(THINK_CLOSE)}:].strip() -%}}',
      "{%- elif open >= 0 -%}{%- set answer = '' -%}{%- set finished = false -%}",
      '{%- else -%}{%- set answer = text.strip() -%}{%- endif -%}',
      '{%- set calls = m.tool_calls if m.tool_calls is defined and m.tool_calls else [] -%}',
      '{%- if not calls -%}{%- set content = answer or content -%}',
      '{%- else -%}',
      '{%- set ns.text = answer if finished else content -%}',
      f'{{%- if {lit(TOOL_CALL_OPEN)} not in ns.text -%}}',
      '{%- for tc in calls -%}',
      # Structured calls: {name, arguments} as render takes them, or OpenAI's {function: ...}.
      '{%- set call = tc.function if tc.function is defined else tc -%}',
      '{%- set args = call.arguments if call.arguments is defined else {} -%}',
      '{%- set json = dumps(call.name) if args is string else '
      "dumps({'name': call.name, 'arguments': args}) -%}",
      "{%- if args is string -%}{%- set json = '{\"name\": ' ~ json ~ ', \"arguments\": ' ~ "
      "args ~ '}' -%}{%- endif -%}",
      f"{{%- set block = {lit(TOOL_CALL_OPEN + chr(10))} ~ json ~ "
      f"{lit(chr(10) + TOOL_CALL_CLOSE)} -%}}",
      "{%- set ns.text = (ns.text ~ '\\n' ~ block) if ns.text else block -%}",
      '{%- endfor -%}',
      '{%- endif -%}',
      '{%- set content = ns.text -%}',
      '{%- endif -%}',
      '{%- endif -%}',
      "{%- if loop.first and m.role == 'system' and ns.tools -%}",
      "{%- set content = (content ~ '\\n\\n' ~ ns.tools) if content else ns.tools -%}",
      '{%- endif -%}',
      '{%- if loop.index0 == ns.last_user and ns.mode is not none -%}',
      "{%- set content = content ~ (' /think' if ns.mode else ' /no_think') -%}",
      '{%- endif -%}',
      f"{{{{- {lit(IM_START)} ~ m.role ~ '\\n' ~ content ~ {lit(IM_END + chr(10))} -}}}}",
      '{%- endif -%}',
      '{%- endfor -%}',
      '{%- if add_generation_prompt is defined and add_generation_prompt -%}',
      f"{{{{- {lit(IM_START + 'assistant' + chr(10))} -}}}}",
      f'{{%- if ns.mode is false -%}}{{{{- {lit(EMPTY_THINK)} -}}}}{{%- endif -%}}',
      '{%- endif -%}',
  ]
  return '\n'.join(lines)


# `render` as a Jinja chat template (an HF export's tokenizer_config.json `chat_template`):
# `apply_chat_template(messages, add_generation_prompt=..., tools=..., thinking=True|False)`
# gives render's text for the same arguments (`enable_thinking` is taken for `thinking`, as
# Qwen3 names it; neither: no switch). Structured tool calls may also be OpenAI's
# {'function': {'name', 'arguments'}}, the arguments a dict or JSON text.
TEMPLATE = _chat_template()


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
