"""Tool-calling verifier: the turn's `<tool_call>` blocks against the gold calls.

The calls are Qwen3's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks after the thinking block, parsed by `foundation.chat.parse_tool_calls`
(bounded: at most `chat.MAX_TOOL_CALLS` calls of `chat.MAX_TOOL_CALL_CHARS`
characters each). Reward 1 iff

* no call block is malformed (bad JSON, no name, unclosed, too many);
* with `tools`, every call names one of them and its arguments validate
  against that tool's `parameters` JSON Schema (jsonschema, the validator
  class the schema's `$schema` names);
* the calls equal the gold calls as a multiset (in order with `ordered`):
  the same names, the same argument keys, and equal values: numbers by value
  (2 == 2.0; a string "2" equals 2 only where the tool's schema types that
  argument as a string), booleans only as booleans, strings exactly after
  stripping surrounding whitespace, lists and objects recursively. A gold
  value `{"$any_of": [v1, v2, ...]}` accepts any of the alternatives.

With no gold calls the right move is to answer without calling a tool:
reward 1 iff the turn has no call block. A final answer without calls when
calls were expected scores 0. Info gives the reason (the call and the
argument that differ). Scored on the host (parsing and comparison of bounded
JSON, no worker process); the verdict reads only plain JSON values from the
model's text.

Metadata: {'calls': [{'name': str, 'arguments': {...}}, ...], 'ordered':
bool (optional), 'tools': [{'type': 'function', 'function': {'name',
'description', 'parameters'}}, ...] (optional; a bare {'name',
'parameters'} function is accepted too)}.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping, Sequence

from foundation import chat
from verifiers import base
from verifiers import structured

ANY_OF = '$any_of'
# Nesting depth of gold values (and of comparisons).
_MAX_DEPTH = 32
# A string the schema types as a string may stand for a gold number ("2" for 2).
_NUMBER = re.compile(r'-?(?:0|[1-9]\d{0,40})(?:\.\d{1,40})?(?:[eE][+-]?\d{1,4})?')


def _short(value: Any) -> str:
  """A bounded rendering of a model-given value for reasons."""
  if isinstance(value, dict):
    return f'an object with {len(value)} keys'
  if isinstance(value, list):
    return f'a list of {len(value)}'
  return repr(value)[:80]


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _types(schema: Any) -> tuple:
  """The JSON types a (sub)schema names, () when unknown."""
  if not isinstance(schema, Mapping):
    return ()
  t = schema.get('type')
  return (t,) if isinstance(t, str) else tuple(t) if isinstance(t, list) else ()


def _diff(gold: Any, pred: Any, schema: Any, path: str, depth: int = 0) -> str | None:
  """Why `pred` does not equal the gold value at `path`, or None when it does.

  Args:
    gold: the gold value (may hold `$any_of` alternatives).
    pred: the model's value (plain JSON from `json.loads`).
    schema: the JSON Schema of this value in the tool's parameters, or None.
    path: where the value is, for the reason ('arguments.city').
    depth: the nesting depth so far.
  """
  if depth > _MAX_DEPTH:
    return f'{path}: nested too deeply'
  if isinstance(gold, dict) and ANY_OF in gold:
    if any(_diff(alt, pred, schema, path, depth + 1) is None for alt in gold[ANY_OF]):
      return None
    return f'{path}: {_short(pred)} is none of the accepted values'
  if isinstance(gold, bool) or gold is None:
    return None if pred is gold else f'{path}: expected {gold!r}, got {_short(pred)}'
  if _is_number(gold):
    value = pred
    if isinstance(pred, str) and 'string' in _types(schema) and _NUMBER.fullmatch(pred.strip()):
      text = pred.strip()
      value = int(text) if text.lstrip('-').isdigit() else float(text)
    if _is_number(value) and value == gold:
      return None
    return f'{path}: expected {gold!r}, got {_short(pred)}'
  if isinstance(gold, str):
    if isinstance(pred, str) and pred.strip() == gold.strip():
      return None
    return f'{path}: expected {gold[:80]!r}, got {_short(pred)}'
  if isinstance(gold, list):
    if not isinstance(pred, list):
      return f'{path}: expected a list, got {_short(pred)}'
    if len(pred) != len(gold):
      return f'{path}: expected {len(gold)} items, got {len(pred)}'
    items = schema.get('items') if isinstance(schema, Mapping) else None
    for i, (g, p) in enumerate(zip(gold, pred)):
      why = _diff(g, p, items, f'{path}[{i}]', depth + 1)
      if why:
        return why
    return None
  if not isinstance(pred, dict):
    return f'{path}: expected an object, got {_short(pred)}'
  missing, extra = sorted(set(gold) - set(pred)), sorted(set(pred) - set(gold))
  if missing:
    return f'{path}: missing key {missing[0]!r}'
  if extra:
    return f'{path}: unexpected key {extra[0][:80]!r}'
  props = schema.get('properties') if isinstance(schema, Mapping) else None
  for key in sorted(gold):
    sub = props.get(key) if isinstance(props, Mapping) else None
    why = _diff(gold[key], pred[key], sub, f'{path}.{key}', depth + 1)
    if why:
      return why
  return None


def _call_diff(gold: Mapping[str, Any], pred: chat.ToolCall, functions: Mapping[str, Any]
               ) -> str | None:
  """Why a predicted call is not the gold call, or None when it is."""
  if pred.name != gold['name']:
    return f'name {pred.name[:80]!r} is not {gold["name"]!r}'
  return _diff(gold.get('arguments', {}), pred.arguments, functions.get(gold['name']),
               'arguments')


def _matching(ok: Sequence[Sequence[bool]]) -> list[int]:
  """A maximum matching of gold calls to predicted calls: match[i] = j, or -1 (Kuhn's algorithm)."""
  owner = [-1] * (len(ok[0]) if ok else 0)

  def augment(i: int, seen: list[bool]) -> bool:
    for j, good in enumerate(ok[i]):
      if good and not seen[j]:
        seen[j] = True
        if owner[j] < 0 or augment(owner[j], seen):
          owner[j] = i
          return True
    return False

  for i in range(len(ok)):
    augment(i, [False] * len(owner))
  match = [-1] * len(ok)
  for j, i in enumerate(owner):
    if i >= 0:
      match[i] = j
  return match


def compare_calls(gold: Sequence[Mapping[str, Any]], pred: Sequence[chat.ToolCall],
                  functions: Mapping[str, Any], ordered: bool) -> str | None:
  """Why the predicted calls are not the gold calls, or None when they match.

  Args:
    gold: the gold calls ({'name', 'arguments'}).
    pred: the parsed calls.
    functions: tool name -> its parameters schema (empty without tools).
    ordered: compare in order; else as a multiset.

  Returns:
    None when every gold call has its own equal predicted call, else the first
    difference ('gold call 2 (get_weather): arguments.city: expected ...').
  """
  if len(pred) != len(gold):
    want = ', '.join(g['name'] for g in gold)
    got = ', '.join(p.name[:80] for p in pred)
    return f'expected {len(gold)} call(s) ({want}), got {len(pred)} ({got})'
  if ordered:
    for k, (g, p) in enumerate(zip(gold, pred)):
      why = _call_diff(g, p, functions)
      if why:
        return f'call {k + 1}: {why}'
    return None
  diffs = [[_call_diff(g, p, functions) for p in pred] for g in gold]
  match = _matching([[d is None for d in row] for row in diffs])
  for i, j in enumerate(match):
    if j < 0:
      g = gold[i]
      same = [k for k, p in enumerate(pred) if p.name == g['name']]
      if not same:
        return f'no call to {g["name"]!r} (gold call {i + 1})'
      free = [k for k in same if k not in match] or same
      return f'gold call {i + 1} ({g["name"]}): {diffs[i][free[0]]}'
  return None


def functions_of(tools: Sequence[Any]) -> dict[str, dict]:
  """Tool name -> its parameters schema, from OpenAI/Qwen3 function tools.

  Raises:
    ValueError: a malformed tool, naming `metadata["tools"][i]`.
  """
  out = {}
  for i, tool in enumerate(tools):
    where = f'metadata["tools"][{i}]'
    if not isinstance(tool, Mapping):
      raise ValueError(f'{where} must be a dict, got {type(tool).__name__}')
    fn = tool.get('function', tool) if tool.get('type', 'function') == 'function' else None
    if not isinstance(fn, Mapping):
      raise ValueError(f'{where} must be {{"type": "function", "function": {{...}}}}')
    name = fn.get('name')
    if not isinstance(name, str) or not name:
      raise ValueError(f'{where}: "name" must be a non-empty string')
    if name in out:
      raise ValueError(f'{where}: tool {name!r} is defined twice')
    params = fn.get('parameters', {'type': 'object'})
    if not isinstance(params, (dict, bool)):
      raise ValueError(f'{where}: "parameters" must be a JSON Schema object')
    out[name] = params
  return out


def _check_gold(value: Any, where: str, depth: int = 0) -> None:
  """Raises ValueError unless `value` is plain JSON with well-formed `$any_of` groups."""
  if depth > _MAX_DEPTH:
    raise ValueError(f'{where} is nested deeper than {_MAX_DEPTH}')
  if isinstance(value, dict):
    if ANY_OF in value:
      alts = value[ANY_OF]
      if len(value) != 1 or not isinstance(alts, list) or not alts:
        raise ValueError(f'{where} must be {{"{ANY_OF}": [a non-empty list of alternatives]}}')
      for k, alt in enumerate(alts):
        _check_gold(alt, f'{where}["{ANY_OF}"][{k}]', depth + 1)
      return
    for key, v in value.items():
      if not isinstance(key, str):
        raise ValueError(f'{where} has a key that is not a string: {key!r}')
      _check_gold(v, f'{where}[{key!r}]', depth + 1)
  elif isinstance(value, list):
    for k, v in enumerate(value):
      _check_gold(v, f'{where}[{k}]', depth + 1)
  elif isinstance(value, float) and not math.isfinite(value):
    raise ValueError(f'{where} is {value}, not a JSON number')
  elif not (value is None or isinstance(value, (str, int, float, bool))):
    raise ValueError(f'{where} must be a JSON value, got {type(value).__name__}')


class ToolCallVerifier(base.Verifier):
  """Reward 1 iff the turn's tool calls are the gold calls (see the module docstring)."""

  name = 'tool_call'

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any], **options: Any) -> None:
    calls = base.require(metadata, 'calls', list, 'the gold tool calls; [] when none is right')
    if len(calls) > chat.MAX_TOOL_CALLS:
      raise ValueError(f'metadata["calls"] has {len(calls)} calls; a turn holds at most '
                       f'{chat.MAX_TOOL_CALLS}')
    for i, call in enumerate(calls):
      where = f'metadata["calls"][{i}]'
      if not isinstance(call, Mapping):
        raise ValueError(f'{where} must be a dict, got {type(call).__name__}')
      extra = sorted(set(call) - {'name', 'arguments'})
      if extra:
        raise ValueError(f'{where} has unexpected keys {extra}; expected "name" and "arguments"')
      if not isinstance(call.get('name'), str) or not call['name']:
        raise ValueError(f'{where}["name"] must be a non-empty string')
      if not isinstance(call.get('arguments', {}), dict):
        raise ValueError(f'{where}["arguments"] must be a dict, got '
                         f'{type(call["arguments"]).__name__}')
      _check_gold(call.get('arguments', {}), f'{where}["arguments"]')
    if 'ordered' in metadata:
      base.require(metadata, 'ordered', bool, 'compare the calls in order')
    if metadata.get('tools') is None:
      return
    functions = functions_of(base.require(metadata, 'tools', list, 'the tool schemas'))
    for name, params in functions.items():
      error = structured.schema_error(json.dumps(params, sort_keys=True))[:300]
      if error:
        raise ValueError(f'metadata["tools"]: the parameters of {name!r} are not a valid JSON '
                         f'Schema: {error}')
    for i, call in enumerate(calls):
      if call['name'] not in functions:
        raise ValueError(f'metadata["calls"][{i}] calls {call["name"]!r}, which is not in '
                         f'metadata["tools"] ({", ".join(sorted(functions))})')

  def _prepare(self, sample: base.Sample, answer: str) -> base.Result:
    md = sample.metadata
    gold = md['calls']
    # The same split as the base class's; only the text after the thinking block counts.
    turn = chat.parse_tool_calls(sample.completion)
    info = {'calls': len(turn.calls), 'expected': len(gold)}
    if turn.errors:
      return base.Result(0.0, dict(info, reason=f'malformed tool call: {turn.errors[0]}'))
    if not gold:
      if turn.calls:
        return base.Result(0.0, dict(info, reason=f'called {turn.calls[0].name[:80]!r} but no '
                                                  'call was expected'))
      return base.Result(1.0, dict(info, reason='no call, as expected'))
    if not turn.calls:
      return base.Result(0.0, dict(info, reason=f'no tool call (a final answer) but {len(gold)} '
                                                'expected'))
    functions = {}
    if md.get('tools') is not None:
      functions = functions_of(md['tools'])
      for k, call in enumerate(turn.calls):
        if call.name not in functions:
          return base.Result(0.0, dict(info, reason=f'call {k + 1}: unknown tool '
                                                    f'{call.name[:80]!r}'))
        error = next(iter(structured.validator(json.dumps(functions[call.name], sort_keys=True))
                          .iter_errors(call.arguments)), None)
        if error is not None:
          path = '/'.join(str(p) for p in error.absolute_path) or '(arguments)'
          return base.Result(0.0, dict(info, reason=f'call {k + 1} ({call.name}): schema '
                                                    f'violation at {path}: {error.message[:200]}'))
    why = compare_calls(gold, turn.calls, functions, bool(md.get('ordered', False)))
    if why:
      return base.Result(0.0, dict(info, reason=why))
    return base.Result(1.0, dict(info, reason='calls match'))
