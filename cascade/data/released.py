"""Readers for the released Nemotron-Cascade 1 and 2 datasets, as they are downloaded.

Each format maps one raw row of a release to the canonical record of
`cascade.data` (its module docstring); `cascade.data` registers them in its
`FORMATS` under the names below. A row that does not fit raises `RecordError`
naming the field (the loader adds the file and line); a value this module does
not know (a role, an agent, a grading mode, a schema type) is refused, never
dropped or guessed.

  nemotron_cascade_sft      Cascade 1's SFT-Stage-1, SFT-Stage-2 and SFT-SWE; Cascade 2's
                            SFT-Data (every subset). -> 'sft'
  cascade1_rl_rlhf          Nemotron-Cascade-RL-RLHF -> 'prompt' (chat: reward model, no metadata)
  cascade1_rl_if            Nemotron-Cascade-RL-Instruction-Following -> 'prompt'
                            (instruction_following metadata)
  cascade1_rl_math          Nemotron-Cascade-RL-Math -> 'prompt' (math metadata)
  cascade1_rl_swe           Nemotron-Cascade-RL-SWE -> 'prompt' (agentless swe metadata)
  cascade2_if_rl            Nemotron-Cascade-2-RL-data, subset IF-RL -> 'prompt'
  cascade2_multi_domain_rl  Nemotron-Cascade-2-RL-data, subset multi-domain-RL -> 'prompt'
                            (each row names its domain: mcqa, tool_calling or structured)
  cascade2_mopd             Nemotron-Cascade-2-RL-data, subset MOPD -> 'prompt' (each row
                            names its domain: math, instruction_following, mcqa,
                            tool_calling or structured)

Routing. Cascade 2's RL release is NeMo-Gym rows: every row names the agent
that scores it (`agent_ref.name`). That field routes a row to its domain
(`AGENTS`), so one file feeds a stage of several domains (multi-domain RL,
MOPD: records name their own domain and each stage keeps its domains'
records). A subset's format accepts only that subset's agents, so a row of
another subset (or an agent added to a later release) is a one-line error
naming `agent_ref.name`. Separate formats per subset, rather than one filter
field on the dataset spec, keep the check in the row's own format and need no
new config field.

Where the field names come from. No dataset card or viewer page of a
Nemotron-Cascade release is in the reference material this project can read
(searches for each name found only the openreward.ai page of
Nemotron-Cascade-2-RL-data, which states the subsets IF-RL 45,879,
multi-domain-RL 18,147 with MCQA / workplace function calling / structured
outputs, MOPD 6,171 and SWE-RL 3,612, but no field names). So no field below
is verified from a card; each is marked by its evidence:

  [gym]    the schema of NVIDIA NeMo-Gym's own resource servers, which consume these
           rows: instruction_following (`instruction_id_list`, `kwargs`, `prompt`,
           `responses_create_params.input`), mcqa (`options` as one-key dicts,
           `expected_answer`, `grading_mode`, `template_metadata`),
           structured_outputs (`schema_str`, `schema_type`), workplace_assistant
           (`responses_create_params.tools` in the Responses API's flat function
           form, `ground_truth` = [{"name", "arguments": JSON string}]).
  [loader] seen in third-party loaders of the release found by code search: the
           subset names `IF-RL`, `multi-domain-RL`, `MOPD`, `SWE-RL`, the file
           `MOPD/train.jsonl`; `agent_ref.name` values `mcqa_simple_agent`,
           `structured_outputs_simple_agent`, `workplace_assistant_simple_agent`;
           `dataset` = 'acereason' with `question` / `expected_answer` in MOPD;
           SWE-RL rows with `instance_id`, `problem_statement`, `repo`, `base_commit`,
           `FAIL_TO_PASS`; Cascade 1's RL-Math `problem`, `answer`, `source`; its
           RL-Instruction-Following `prompt` as a list of chat messages; its RL-SWE
           `relevant_file_contents`; the SFT sets' `messages` with the reasoning in a
           `<think>` block at the start of the assistant content; Cascade 2's SFT
           subsets math, science, chat, instruction_following, safety,
           conversational_agent, swe, terminal_agent (`math/math_notool.jsonl`),
           Cascade 1's SFT-Stage-2 subset tool_calling.
  [inferred] not seen anywhere: the rest (each function's docstring says which),
           taken from the OpenAI chat format (`tool_calls`, `reasoning_content`,
           `tool` messages) and from the fields above.

Columns a format does not read (ids aside: `uuid`, `source`, `category`,
`license`, `generator`, `used_in`, pass-rate statistics...) are provenance and
are not checked; inside what a format reads, every key and value is.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from foundation import chat

BOXED_INSTRUCTION = 'Please reason step by step, and put your final answer within \\boxed{}.'
SWE_INSTRUCTION = ('Fix the issue above. Answer with a unified diff (a ```diff block) of the '
                   'changes to the files shown.')

# Domains a released row may be routed to (the papers' domain names in configs/_recipes.py).
IF, MCQA, TOOLS, STRUCTURED, MATH = ('instruction_following', 'mcqa', 'tool_calling',
                                     'structured', 'math')

# NeMo-Gym agent (`agent_ref.name`) -> the domain its rows are scored in. [loader] for the
# mcqa, structured-output and workplace agents; [inferred] for the instruction-following
# agent (NeMo-Gym's name for its instruction_following server's agent) and the math one.
AGENTS = {
    'instruction_following_simple_agent': IF,
    'mcqa_simple_agent': MCQA,
    'workplace_assistant_simple_agent': TOOLS,
    'structured_outputs_simple_agent': STRUCTURED,
    'math_with_judge_simple_agent': MATH,
}
# The domains each Cascade-2 RL subset holds (the paper's split: IF-RL; multi-domain RL =
# MCQA + workplace function calling + structured output; MOPD = math, IF, MCQA, workplace,
# structured output).
SUBSETS = {
    'IF-RL': (IF,),
    'multi-domain-RL': (MCQA, TOOLS, STRUCTURED),
    'MOPD': (MATH, IF, MCQA, TOOLS, STRUCTURED),
}
# NeMo-Gym's MCQA grading modes [gym]; `verifiers.mcqa` reads every one of these answer forms.
GRADING_MODES = ('strict_single_letter_boxed', 'lenient_boxed', 'lenient_answer_colon',
                 'lenient_answer_colon_md')

_MESSAGE_KEYS = {'role', 'content', 'reasoning_content', 'tool_calls', 'tool_call_id', 'name'}


class RecordError(ValueError):
  """A released row that does not fit its format; the message names the field."""


# ------------------------------------------------------------------------------ small readers


def _text(raw: Mapping, key: str, *, where: str = '') -> str:
  name = f'{where}{key}'
  v = raw.get(key)
  if v is None:
    raise RecordError(f'missing field {name!r}')
  if not isinstance(v, str):
    raise RecordError(f'field {name!r} must be a string, got {type(v).__name__}')
  if not v.strip():
    raise RecordError(f'field {name!r} is empty')
  return v


def _json_value(value: Any, name: str) -> Any:
  """A field that may hold JSON as a string (Parquet exports often do): parsed."""
  if not isinstance(value, str):
    return value
  try:
    return json.loads(value)
  except ValueError:
    raise RecordError(f'field {name!r} is a string that is not JSON') from None
  except RecursionError:
    raise RecordError(f'field {name!r} is nested too deeply') from None


def _row_id(raw: Mapping, keys=('id', 'uuid', 'instance_id')) -> str:
  for k in keys:
    v = raw.get(k)
    if v is None:
      continue
    if isinstance(v, (str, int)) and not isinstance(v, bool):
      return str(v)
    raise RecordError(f'field {k!r} must be a string or int, got {type(v).__name__}')
  return ''


def _split_think(content: str, name: str) -> tuple[str | None, str]:
  """(reasoning or None, answer) of an assistant text that may open with a <think> block."""
  stripped = content.lstrip()
  if not stripped.startswith(chat.THINK_OPEN):
    if chat.THINK_CLOSE in content:
      raise RecordError(f'field {name!r} closes a thinking block it never opened')
    return None, content
  body = stripped[len(chat.THINK_OPEN):]
  end = body.find(chat.THINK_CLOSE)
  if end < 0:
    raise RecordError(f'field {name!r}: the thinking block is never closed')
  answer = body[end + len(chat.THINK_CLOSE):]
  if chat.THINK_OPEN in answer or chat.THINK_CLOSE in answer:
    raise RecordError(f'field {name!r} holds a second thinking block after the first')
  return body[:end].strip('\n'), answer.lstrip('\n')


def _tool_calls(calls: Any, name: str) -> list[dict]:
  """OpenAI `tool_calls` ({"type": "function", "function": {"name", "arguments"}}) or bare
  {"name", "arguments"} entries -> [{"name", "arguments": dict}]; arguments may be JSON text."""
  if not isinstance(calls, (list, tuple)):
    raise RecordError(f'field {name!r} must be a list, got {type(calls).__name__}')
  out = []
  for k, call in enumerate(calls):
    where = f'{name}[{k}]'
    if not isinstance(call, Mapping):
      raise RecordError(f'field {where!r} must be an object, got {type(call).__name__}')
    kind = call.get('type')
    if kind is not None and kind != 'function':
      raise RecordError(f'field {where}.type={kind!r}: only "function" calls are known')
    fn = call.get('function')
    fn = fn if fn is not None else call
    if not isinstance(fn, Mapping):
      raise RecordError(f'field {where}.function must be an object')
    fname = _text(fn, 'name', where=f'{where}.')
    args = _json_value(fn.get('arguments') or {}, f'{where}.arguments')
    if not isinstance(args, Mapping):
      raise RecordError(f'field {where}.arguments must be a JSON object, got '
                        f'{type(args).__name__}')
    out.append({'name': fname, 'arguments': dict(args)})
  return out


def _function_tools(tools: Any, name: str) -> list[dict]:
  """Tool schemas -> the OpenAI function form `foundation.chat` renders ({"type": "function",
  "function": {...}}); the Responses API's flat {"type": "function", "name", ...} [gym] too."""
  tools = _json_value(tools, name)
  if not isinstance(tools, (list, tuple)):
    raise RecordError(f'field {name!r} must be a list of tool schemas')
  out = []
  for k, tool in enumerate(tools):
    where = f'{name}[{k}]'
    if not isinstance(tool, Mapping):
      raise RecordError(f'field {where!r} must be an object')
    if tool.get('type', 'function') != 'function':
      raise RecordError(f'field {where}.type={tool.get("type")!r}: only "function" tools are '
                        'known')
    fn = tool.get('function')
    if fn is None:   # Responses API: the function's fields at the top level.
      fn = {k2: v for k2, v in tool.items() if k2 in ('name', 'description', 'parameters')}
    if not isinstance(fn, Mapping):
      raise RecordError(f'field {where}.function must be an object')
    _text(fn, 'name', where=f'{where}.')
    params = fn.get('parameters')
    if params is not None and not isinstance(params, Mapping):
      raise RecordError(f'field {where}.parameters must be a JSON Schema object')
    fn = {k2: v for k2, v in fn.items() if v is not None}
    out.append({'type': 'function', 'function': fn})
  return out


# ------------------------------------------------------------------------------ conversations


def _message(m: Any, i: int, key: str) -> dict:
  """One chat message, checked: role, content, and the optional OpenAI keys."""
  where = f'{key}[{i}]'
  if not isinstance(m, Mapping):
    raise RecordError(f'field {where!r} must be an object, got {type(m).__name__}')
  extra = sorted(k for k in m if k not in _MESSAGE_KEYS and m[k] is not None)
  if extra:
    raise RecordError(f'field {where}.{extra[0]}: unknown message field (known: '
                      f'{", ".join(sorted(_MESSAGE_KEYS))})')
  role = m.get('role')
  if role not in chat.ROLES:
    raise RecordError(f'field {where}.role={role!r}: expected one of {chat.ROLES}')
  content = m.get('content')
  if content is None and role == 'assistant' and m.get('tool_calls'):
    content = ''
  if not isinstance(content, str):
    raise RecordError(f'field {where}.content must be a string, got {type(content).__name__}')
  out = {'role': role, 'content': content}
  if role == 'assistant':
    reasoning = m.get('reasoning_content')
    thought, answer = _split_think(content, f'{where}.content')
    if reasoning is not None:
      if not isinstance(reasoning, str):
        raise RecordError(f'field {where}.reasoning_content must be a string')
      if thought is not None:
        raise RecordError(f'field {where}: reasoning both in reasoning_content and in a '
                          '<think> block of content')
      thought = reasoning
    out['content'], out['thinking'] = answer, thought
    if m.get('tool_calls'):
      out['tool_calls'] = _tool_calls(m['tool_calls'], f'{where}.tool_calls')
  else:
    for k in ('reasoning_content', 'tool_calls'):
      if m.get(k):
        raise RecordError(f'field {where}.{k}: only assistant messages carry it (role '
                          f'{role!r})')
  return out


def _prompt_messages(msgs: Any, key: str) -> list[dict]:
  """A prompt: chat messages ending with the user turn to answer (system, user, and earlier
  assistant turns and tool results as context)."""
  if not isinstance(msgs, (list, tuple)) or not msgs:
    raise RecordError(f'field {key!r} must be a non-empty list of chat messages')
  out = []
  for i, m in enumerate(msgs):
    msg = _message(m, i, key)
    msg.pop('thinking', None)    # earlier assistant turns render their answers only
    out.append(msg)
  if out[-1]['role'] != 'user':
    raise RecordError(f'field {key!r}: the last message must be the user turn to answer '
                      f'(got role {out[-1]["role"]!r})')
  return out


def _prompt_of(raw: Mapping, keys=('responses_create_params', 'messages', 'prompt')) -> tuple:
  """(messages, field) of an RL row: NeMo-Gym's `responses_create_params.input`, or
  `messages`, or `prompt` (chat messages or one user text)."""
  for key in keys:
    v = raw.get(key)
    if v is None:
      continue
    if key == 'responses_create_params':
      if not isinstance(v, Mapping):
        raise RecordError(f'field {key!r} must be an object')
      return _prompt_messages(v.get('input'), f'{key}.input'), key
    if isinstance(v, str):
      if not v.strip():
        raise RecordError(f'field {key!r} is empty')
      return [{'role': 'user', 'content': v}], key
    return _prompt_messages(v, key), key
  raise RecordError(f'missing field: the prompt (one of {", ".join(keys)})')


def _context(m: dict) -> dict:
  """A message of the prompt as `foundation.chat.render` takes it."""
  return {k: v for k, v in m.items() if k != 'thinking'}


def _turn(m: dict) -> dict:
  """An assistant turn or tool result of a demonstration (`turns`): its text and calls."""
  if m['role'] == 'tool':
    return {'role': 'tool', 'content': m['content']}
  blocks = [chat.render_tool_call(c['name'], c['arguments']) for c in m.get('tool_calls', ())]
  text = '\n'.join([m['content'], *blocks] if m['content'] else blocks)
  return {'role': 'assistant', 'content': text}


def adapt_sft(raw: Mapping) -> dict:
  """An SFT conversation -> the canonical 'sft' record.

  Fields: `messages` [loader] (OpenAI chat messages: system / user / assistant /
  tool; assistant reasoning as a leading `<think>` block [loader] or in
  `reasoning_content` [inferred]; assistant `tool_calls` and `tool` results
  [inferred]); `tools` [inferred] (function schemas, a list or its JSON text);
  `id` / `uuid` [inferred].

  The prompt is everything up to the last user message; what follows it is
  learned. One plain assistant answer (no tools) is a single-answer record
  (`response`, and `thinking` when its reasoning is not empty); anything else
  (tool calls, tool results, several assistant turns, tool schemas) is a
  multi-turn demonstration (`turns`, `tools`), whose assistant turns keep their
  answers and calls: demonstrations train in instruct mode
  (`cascade.episodes.demonstration`), so their reasoning is not learned.
  """
  msgs = raw.get('messages')
  if not isinstance(msgs, (list, tuple)) or not msgs:
    raise RecordError("field 'messages' must be a non-empty list of chat messages")
  checked = [_message(m, i, 'messages') for i, m in enumerate(msgs)]
  users = [i for i, m in enumerate(checked) if m['role'] == 'user']
  if not users:
    raise RecordError("field 'messages' has no user message")
  last = users[-1]
  learned = checked[last + 1:]
  if not learned:
    raise RecordError("field 'messages': nothing follows the last user message (no answer to "
                      'learn)')
  for j, m in enumerate(learned, last + 1):
    if m['role'] == 'system':
      raise RecordError(f"field messages[{j}].role='system' after the last user message")
  if learned[0]['role'] != 'assistant':
    raise RecordError(f"field messages[{last + 1}]: a tool result must follow an assistant "
                      'turn that called the tool')
  if learned[-1]['role'] != 'assistant':
    raise RecordError(f"field messages[{len(checked) - 1}]: the conversation must end with an "
                      "assistant turn, got role 'tool'")
  rec = {'messages': [_context(m) for m in checked[:last + 1]]}
  rid = _row_id(raw)
  if rid:
    rec['id'] = rid
  tools = raw.get('tools')
  # An empty list, or its empty text, is a conversation without tools.
  tools = _function_tools(tools, 'tools') if tools not in (None, '', '[]') else []
  if len(learned) == 1 and 'tool_calls' not in learned[0] and not tools:
    answer = learned[0]
    if not answer['content'].strip():
      raise RecordError(f"field messages[{last + 1}].content: the answer is empty")
    rec['response'] = answer['content']
    if answer['thinking'] is not None and answer['thinking'].strip():
      rec['thinking'] = answer['thinking']
    return rec
  rec['turns'] = [_turn(m) for m in learned]
  if tools:
    rec['tools'] = tools
  return rec


# ------------------------------------------------------------------------------ verifier metadata


def _if_metadata(ids: Any, kwargs: Any, where: str = '') -> dict:
  """IFEval-style `instruction_id_list` and `kwargs` [gym] -> instruction-following metadata
  (each kwargs entry an object, its JSON text, or null; null arguments dropped, as IFEval
  pads every entry with the other instructions' arguments)."""
  if (not isinstance(ids, (list, tuple)) or not ids
      or not all(isinstance(i, str) and i for i in ids)):
    raise RecordError(f"field '{where}instruction_id_list' must be a non-empty list of strings")
  if not isinstance(kwargs, (list, tuple)) or len(kwargs) != len(ids):
    raise RecordError(f"field '{where}kwargs' must be a list with one entry per instruction "
                      f'({len(ids)})')
  clean = []
  for k, kw in enumerate(kwargs):
    kw = _json_value(kw, f'{where}kwargs[{k}]')
    if kw is None:
      kw = {}
    if not isinstance(kw, Mapping):
      raise RecordError(f"field '{where}kwargs[{k}]' must be an object or null")
    clean.append({a: v for a, v in kw.items() if v is not None})
  return {'instruction_id_list': list(ids), 'kwargs': clean}


def _ground_truth_if(value: Any) -> dict:
  """AllenAI IF-RLVR's `ground_truth`: [{"instruction_id": [...], "kwargs": [...]}] (JSON text
  or a list) -> instruction-following metadata."""
  gt = _json_value(value, 'ground_truth')
  if isinstance(gt, (list, tuple)):
    if len(gt) != 1:
      raise RecordError(f"field 'ground_truth' holds {len(gt)} constraint sets; expected one")
    gt = _json_value(gt[0], 'ground_truth[0]')
  if not isinstance(gt, Mapping):
    raise RecordError("field 'ground_truth' must hold an object with 'instruction_id' and "
                      "'kwargs'")
  ids = gt.get('instruction_id', gt.get('instruction_id_list'))
  return _if_metadata(ids, gt.get('kwargs'), 'ground_truth.')


def _mcqa_metadata(raw: Mapping) -> dict:
  """NeMo-Gym MCQA [gym]: `options` as one-key {"A": text} objects (a Parquet export fills
  the other letters with null), `expected_answer` the letter -> {'answer', 'options'}."""
  mode = raw.get('grading_mode')
  if mode is not None and mode not in GRADING_MODES:
    raise RecordError(f'field grading_mode={mode!r}: unknown (known: {", ".join(GRADING_MODES)})')
  template = raw.get('template_metadata')
  if template is not None and not isinstance(_json_value(template, 'template_metadata'),
                                             Mapping):
    raise RecordError("field 'template_metadata' must be an object")
  answer = _text(raw, 'expected_answer').strip().upper()
  opts = _json_value(raw.get('options'), 'options')
  if not isinstance(opts, (list, tuple)) or not opts:
    raise RecordError("field 'options' must be a non-empty list of {letter: text} objects")
  by_letter = {}
  for k, entry in enumerate(opts):
    if not isinstance(entry, Mapping):
      raise RecordError(f"field 'options[{k}]' must be a {{letter: text}} object")
    items = [(l, t) for l, t in entry.items() if t is not None]
    if len(items) != 1:
      raise RecordError(f"field 'options[{k}]' must hold exactly one letter, got "
                        f'{len(items)}')
    letter, text = items[0]
    if not (isinstance(letter, str) and len(letter) == 1 and letter.isalpha()):
      raise RecordError(f"field 'options[{k}]': key {letter!r} is not an option letter")
    if not isinstance(text, str):
      raise RecordError(f"field 'options[{k}].{letter}' must be a string")
    if letter.upper() in by_letter:
      raise RecordError(f"field 'options[{k}]': letter {letter.upper()!r} repeats")
    by_letter[letter.upper()] = text
  letters = sorted(by_letter)
  expected = [chr(ord('A') + i) for i in range(len(letters))]
  if letters != expected:
    raise RecordError(f"field 'options': letters {''.join(letters)} are not A.. in sequence")
  if answer not in by_letter:
    raise RecordError(f'field expected_answer={answer!r} names no option ({"".join(letters)})')
  return {'answer': answer, 'options': [by_letter[l] for l in letters]}


def _strict_schema(schema: Any) -> Any:
  """The schema as NeMo-Gym's structured-output server validates with it [gym]: every object
  that lists properties requires all of them and allows no others."""
  if isinstance(schema, Mapping):
    out = {k: _strict_schema(v) for k, v in schema.items()}
    if isinstance(out.get('properties'), Mapping):
      out['required'] = list(out['properties'])
      out['additionalProperties'] = False
    return out
  if isinstance(schema, list):
    return [_strict_schema(v) for v in schema]
  return schema


def _structured_metadata(raw: Mapping) -> dict:
  """NeMo-Gym structured outputs [gym]: `schema_str` (JSON Schema text), `schema_type`
  ('json'; the verifier checks JSON only) -> {'schema'} made strict as NeMo-Gym does."""
  kind = raw.get('schema_type')
  if kind is not None and str(kind).lower() != 'json':
    raise RecordError(f'field schema_type={kind!r}: only "json" is scored here '
                      '(verifiers.structured reads JSON)')
  schema = _json_value(_text(raw, 'schema_str'), 'schema_str')
  if not isinstance(schema, (Mapping, bool)):
    raise RecordError("field 'schema_str' must hold a JSON Schema object")
  return {'schema': _strict_schema(schema)}   # a new object: the row is not changed


def _tool_metadata(raw: Mapping, tools: list[dict]) -> dict:
  """NeMo-Gym workplace assistant [gym]: `ground_truth` = [{"name", "arguments": JSON
  text}] and the row's tool schemas -> {'calls', 'tools'}."""
  gt = _json_value(raw.get('ground_truth'), 'ground_truth')
  if not isinstance(gt, (list, tuple)):
    raise RecordError("field 'ground_truth' must be the list of expected tool calls")
  return {'calls': _tool_calls(gt, 'ground_truth'), 'tools': tools}


def _math_answer(raw: Mapping, keys: Sequence[str]) -> str:
  for key in keys:
    v = raw.get(key)
    if v is None:
      continue
    if isinstance(v, (int, float)) and not isinstance(v, bool):
      v = str(v)
    if not isinstance(v, str) or not v.strip():
      raise RecordError(f'field {key!r} must be a non-empty string or number')
    return v.strip()
  raise RecordError(f'missing field: the answer (one of {", ".join(keys)})')


def _with_tools_listed(msgs: list[dict], tools: list[dict]) -> list[dict]:
  """The prompt with the tool schemas listed in its system turn, as `foundation.chat` lists them
  for a rollout (RL prompts are rendered without a separate tools argument)."""
  # pylint: disable-next=protected-access
  section = chat._tools_section(tools)
  msgs = [dict(m) for m in msgs]
  if msgs and msgs[0]['role'] == 'system':
    body = msgs[0]['content']
    msgs[0]['content'] = f'{body}\n\n{section}' if body else section
  else:
    msgs.insert(0, {'role': 'system', 'content': section})
  return msgs


# ------------------------------------------------------------------------------ Cascade 2 RL


def _agent(raw: Mapping) -> str:
  ref = _json_value(raw.get('agent_ref'), 'agent_ref')
  if ref is None:
    raise RecordError("missing field 'agent_ref' (the NeMo-Gym agent that scores the row)")
  if not isinstance(ref, Mapping):
    raise RecordError("field 'agent_ref' must be an object with 'name'")
  return _text(ref, 'name', where='agent_ref.')


def _gym_record(raw: Mapping, subset: str) -> dict:
  """A NeMo-Gym row of a Cascade-2 RL subset -> a prompt record of the domain its agent
  scores in (`AGENTS`), checked against the subset's domains (`SUBSETS`)."""
  agent = _agent(raw)
  domain = AGENTS.get(agent)
  allowed = SUBSETS[subset]
  if domain is None or domain not in allowed:
    known = sorted(a for a, d in AGENTS.items() if d in allowed)
    raise RecordError(f'field agent_ref.name={agent!r}: not an agent of subset {subset} '
                      f'(known: {", ".join(known)})')
  if domain == MATH and raw.get('responses_create_params') is None:
    msgs = [{'role': 'user', 'content': f'{_text(raw, "question")}\n{BOXED_INSTRUCTION}'}]
  else:
    msgs, _ = _prompt_of(raw, ('responses_create_params',))
  if domain == IF:
    md = _if_metadata(raw.get('instruction_id_list'), raw.get('kwargs'))
  elif domain == MCQA:
    md = _mcqa_metadata(raw)
  elif domain == STRUCTURED:
    md = _structured_metadata(raw)
  elif domain == TOOLS:
    tools = _function_tools(raw['responses_create_params'].get('tools') or [],
                            'responses_create_params.tools')
    if not tools:
      raise RecordError("field 'responses_create_params.tools' is empty: a tool-calling row "
                        'lists its tools')
    md = _tool_metadata(raw, tools)
    msgs = _with_tools_listed(msgs, tools)
  else:
    md = {'answer': _math_answer(raw, ('expected_answer',))}
  rec = {'domain': domain, 'messages': msgs, 'metadata': md}
  rid = _row_id(raw)
  if rid:
    rec['id'] = rid
  return rec


def adapt_cascade2_if_rl(raw: Mapping) -> dict:
  """Cascade-2 RL subset IF-RL: NeMo-Gym instruction-following rows [gym]."""
  return _gym_record(raw, 'IF-RL')


def adapt_cascade2_multi_domain_rl(raw: Mapping) -> dict:
  """Cascade-2 RL subset multi-domain-RL: MCQA, workplace tool calling, structured output."""
  return _gym_record(raw, 'multi-domain-RL')


def adapt_cascade2_mopd(raw: Mapping) -> dict:
  """Cascade-2 RL subset MOPD: math (`question`, `expected_answer` [loader]), IF, MCQA,
  workplace tool calling, structured output; each row to its domain's teacher."""
  return _gym_record(raw, 'MOPD')


# ------------------------------------------------------------------------------ Cascade 1 RL


def _record(raw: Mapping, msgs: list[dict], md: dict) -> dict:
  rec = {'messages': msgs, 'metadata': md}
  rid = _row_id(raw)
  if rid:
    rec['id'] = rid
  return rec


def adapt_cascade1_rl_math(raw: Mapping) -> dict:
  """Nemotron-Cascade-RL-Math: `problem`, `answer`, `source` [loader] -> math metadata.

  The problem gets the paper's boxed-answer instruction unless it already asks
  for a boxed answer.
  """
  problem = _text(raw, 'problem')
  if '\\boxed' not in problem:
    problem = f'{problem}\n{BOXED_INSTRUCTION}'
  return _record(raw, [{'role': 'user', 'content': problem}],
                 {'answer': _math_answer(raw, ('answer',))})


def adapt_cascade1_rl_if(raw: Mapping) -> dict:
  """Nemotron-Cascade-RL-Instruction-Following: `prompt` as chat messages [loader] (or
  text, or `responses_create_params.input` / `messages` [inferred]); the constraints as
  `instruction_id_list` + `kwargs`, or IF-RLVR's `ground_truth` [inferred]."""
  msgs, _ = _prompt_of(raw, ('prompt', 'messages', 'responses_create_params'))
  if raw.get('instruction_id_list') is not None:
    md = _if_metadata(raw['instruction_id_list'], raw.get('kwargs'))
  elif raw.get('ground_truth') is not None:
    md = _ground_truth_if(raw['ground_truth'])
  else:
    raise RecordError("missing field: the constraints ('instruction_id_list' and 'kwargs', "
                      "or 'ground_truth')")
  return _record(raw, msgs, md)


def adapt_cascade1_rl_rlhf(raw: Mapping) -> dict:
  """Nemotron-Cascade-RL-RLHF: the prompt as `prompt` / `messages` (chat messages or text)
  or `responses_create_params.input` [inferred]; scored by the reward model (no metadata)."""
  msgs, _ = _prompt_of(raw, ('prompt', 'messages', 'responses_create_params'))
  return _record(raw, msgs, {})


def _files(value: Any) -> list[tuple[str, str]]:
  """`relevant_file_contents` [loader]: {path: text}, or a list of {path, content} objects
  (`path` / `file_path` / `file`, `content` / `contents` / `text`) [inferred], or JSON text."""
  value = _json_value(value, 'relevant_file_contents')
  if isinstance(value, Mapping):
    items = list(value.items())
  elif isinstance(value, (list, tuple)):
    items = []
    for k, f in enumerate(value):
      where = f'relevant_file_contents[{k}]'
      if not isinstance(f, Mapping):
        raise RecordError(f'field {where!r} must be an object with a path and content')
      path = next((f[p] for p in ('path', 'file_path', 'file') if f.get(p) is not None), None)
      text = next((f[c] for c in ('content', 'contents', 'text') if f.get(c) is not None), None)
      if path is None or text is None:
        raise RecordError(f'field {where!r} must name a path (path/file_path/file) and its '
                          'content (content/contents/text)')
      items.append((path, text))
  else:
    raise RecordError("field 'relevant_file_contents' must map paths to file texts")
  for path, text in items:
    if not isinstance(path, str) or not isinstance(text, str):
      raise RecordError("field 'relevant_file_contents': paths and contents must be strings")
  return items


def adapt_cascade1_rl_swe(raw: Mapping) -> dict:
  """Nemotron-Cascade-RL-SWE (agentless): the issue (`problem_statement` [loader]) with the
  code (`relevant_file_contents` [loader]), or a ready `prompt` / `messages` [inferred];
  the gold diff `patch` (SWE-bench's name) or `gold_patch` / `golden_patch` [inferred]
  -> swe metadata {'gold_patch'}. Cascade 2's SWE-RL rows with a `patch` read the same way."""
  if raw.get('prompt') is not None or raw.get('messages') is not None:
    msgs, _ = _prompt_of(raw, ('prompt', 'messages'))
  else:
    issue = _text(raw, 'problem_statement')
    parts = [f'Issue:\n{issue}']
    if raw.get('relevant_file_contents') is not None:
      for path, text in _files(raw['relevant_file_contents']):
        parts.append(f'File {path}:\n```\n{text}\n```')
    parts.append(SWE_INSTRUCTION)
    msgs = [{'role': 'user', 'content': '\n\n'.join(parts)}]
  key = next((k for k in ('patch', 'gold_patch', 'golden_patch') if raw.get(k) is not None),
             None)
  if key is None:
    raise RecordError('missing field: the gold diff (one of patch, gold_patch, golden_patch)')
  return _record(raw, msgs, {'gold_patch': _text(raw, key)})


# Format -> the only domains its records name (each row routed by its agent, `SUBSETS`):
# config validation refuses a stage or domain that expects rows of another domain from it.
FORMAT_DOMAINS: dict[str, tuple[str, ...]] = {
    'cascade2_if_rl': SUBSETS['IF-RL'],
    'cascade2_multi_domain_rl': SUBSETS['multi-domain-RL'],
    'cascade2_mopd': SUBSETS['MOPD'],
}
# Formats whose records name no domain: every record is its dataset's `domain`.
DATASET_DOMAIN_FORMATS = ('cascade1_rl_rlhf', 'cascade1_rl_if', 'cascade1_rl_math',
                          'cascade1_rl_swe')

# (record type, adapter) per format name; `cascade.data` registers them in FORMATS.
ADAPTERS: dict[str, tuple[str, Callable[[Mapping], dict]]] = {
    'nemotron_cascade_sft': ('sft', adapt_sft),
    'cascade1_rl_rlhf': ('prompt', adapt_cascade1_rl_rlhf),
    'cascade1_rl_if': ('prompt', adapt_cascade1_rl_if),
    'cascade1_rl_math': ('prompt', adapt_cascade1_rl_math),
    'cascade1_rl_swe': ('prompt', adapt_cascade1_rl_swe),
    'cascade2_if_rl': ('prompt', adapt_cascade2_if_rl),
    'cascade2_multi_domain_rl': ('prompt', adapt_cascade2_multi_domain_rl),
    'cascade2_mopd': ('prompt', adapt_cascade2_mopd),
}
