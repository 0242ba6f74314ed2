"""BFCL v3's single-turn AST categories, non-live and live: function calls checked against the
released answers.

  suite = suites.get('bfcl_v3_parallel')
  records = suite.read('/data/suites/bfcl_v3_parallel')   # questions joined with answers
  grades = suite.grader().grade_batch(records, completions)
  suite.summarize(records, grades)                        # {'value': accuracy, ...}

The Berkeley Function Calling Leaderboard (gorilla-llm/Berkeley-Function-Calling-Leaderboard
on the Hub; the `bfcl-eval` package) scores a model's function calls by their
abstract syntax: the call's name, its arguments' types and values against a list
of accepted values per parameter. `bfcl-eval`'s own checker is not used: the
package pins numpy 1.26.4 (and tree-sitter, vllm-era clients...), which breaks JAX,
and its AST checker imports the package's model registry, which imports those
clients, so it cannot run beside cascade. The rules below restate its Python AST
checker (bfcl_eval/eval_checker/ast_eval/ast_checker.py of bfcl-eval 2026.3.23, read
from the wheel) in the project's own code, and tests/cascade/suites/test_bfcl.py
checks each rule on hand-made fixtures written in the released layout;
tests/cascade/suites/test_bfcl_reference.py compares them with the package's own checker
where an unpacked wheel is at hand (its registry stubbed): on the wheel's released data,
6,000 of 6,000 generated calls agree.

Categories (one suite each, 'bfcl_v3_<category>'): `simple` (one function offered,
one call expected; the release's Python file, BFCL_v3_simple.json, or v4's
BFCL_v4_simple_python.json), `multiple` (several offered, one call), `parallel`
(one offered, several calls, any order), `parallel_multiple` (several offered,
several calls, any order) and `irrelevance` (no offered function fits: right when
the model calls none); and the live categories, user-contributed questions and functions
(`live_simple`, `live_multiple`, `live_parallel`, `live_parallel_multiple`,
`live_irrelevance`, `live_relevance`). BFCL scores a live category with the same AST checker
as the non-live one whose name it contains (its checker dispatches on the category name: a
name containing 'parallel' by the unordered parallel match, else one containing 'multiple' by
the multiple match, else the simple one; Python throughout), and `live_irrelevance` and
`live_relevance` by its relevance rule: irrelevance is right when the response holds no
well-formed call, relevance when it holds at least one (any function, arguments unchecked;
neither has answer files).

The multi-turn categories (`multi_turn_base`, `_miss_func`, `_miss_param`, `_long_context`)
are not suites: BFCL scores them by executing each turn's calls against its API simulators
(a file system, messaging, trading, travel and vehicle back ends whose states after every
turn are compared with the ground truth's), which live in `bfcl-eval` and cannot be
installed beside JAX; `suites.get('bfcl_v3_multi_turn_base')` says so in one line
(`REFUSED`).

Files, as the Hub repository and the package lay them out, under the suite's
directory: `BFCL_v3_<category>.json` (JSON lines: id, question (a list of turns,
each a list of messages; the single-turn categories have one turn), function (the
offered functions)) and `possible_answer/BFCL_v3_<category>.json` (id, ground_truth:
a list of {function name: {parameter: [accepted values]}}; '' among a parameter's
accepted values marks it optional). v4's file names are read too.

Prompt. The offered functions are the tools of the conversation, in the chat
template's tool section (`foundation.chat.render(tools=...)`, BFCL's types mapped to JSON
schema's as its function-calling handlers map them: dict -> object, float ->
number, tuple -> array, any -> string), and the model calls them in `<tool_call>`
blocks (`foundation.chat.parse_tool_calls`), as a function-calling model does in
BFCL's FC mode; calls inside the thinking block are not calls, a malformed block
is not a call. Protocol: one greedy sample (BFCL samples at temperature 0.001),
thinking on, 8,192 new tokens.

Checking one call (`check_call`) against one expected {name: {param: accepted}}:
the name must be the expected one; every required parameter of the function's
description must be given; every given parameter must be in the description and in
the expected ones; a value's type must be the described one (an int is taken for a
float; for an array or tuple each element must have the item type, checked one level
deep; a value of the type the accepted values have is taken as a variable's name,
then compared as it is); values are compared, when not a variable, as BFCL compares
them: strings after removing spaces and the characters , . / - _ * ^, lowercased and
with ' as " (`normalize`), lists element-wise the same way, dicts key by key (no
key but accepted ones; each accepted key given unless '' is among its values),
lists of dicts dict by dict in order, anything else by Python equality against the
accepted values; and an expected parameter that was not given must accept ''.
`simple` takes exactly one call; `multiple` as many calls as expected (one), the
first checked against the expected one; `parallel` and `parallel_multiple` as many
calls as expected, each expected call in turn matched to the first unmatched call
that passes, none left over; a live category as the one its name contains.

The papers' numbers: neither Nemotron-Cascade paper reports BFCL v3 per category for
the recipes' checkpoints, so these suites carry none.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

from cascade.suites import base
from foundation import chat
from foundation import paths

CATEGORIES = ('simple', 'multiple', 'parallel', 'parallel_multiple', 'irrelevance',
              'live_simple', 'live_multiple', 'live_parallel', 'live_parallel_multiple',
              'live_irrelevance', 'live_relevance')
# Categories without answer files: right by whether the response calls anything at all.
NO_ANSWERS = ('irrelevance', 'live_irrelevance', 'live_relevance')
# BFCL v3's multi-turn categories, and why they are not suites (`cascade.suites.get` says so).
MULTI_TURN = ('multi_turn_base', 'multi_turn_miss_func', 'multi_turn_miss_param',
              'multi_turn_long_context')
REFUSED = {f'bfcl_v3_{c}': (
    "BFCL's multi-turn categories are scored by executing every turn's calls against "
    "bfcl-eval's API simulators (file system, messaging, trading, travel, vehicle) and "
    'comparing their states, and bfcl-eval cannot be installed beside JAX (it pins numpy '
    '1.26.4): not available (docs/evaluation.md); its single-turn categories are '
    'bfcl_v3_<simple, multiple, parallel, parallel_multiple, irrelevance> and their live_ '
    'versions')
    for c in MULTI_TURN}
# BFCL's parameter types and the Python type a value of each must have.
PY_TYPES = {'string': str, 'integer': int, 'float': float, 'boolean': bool, 'array': list,
            'tuple': list, 'dict': dict, 'any': str}
# Types whose elements are checked against the described item type.
NESTED = ('array', 'tuple')
# BFCL's types as JSON schema writes them, in the tools the model is shown.
_SCHEMA_TYPES = {'dict': 'object', 'float': 'number', 'tuple': 'array', 'any': 'string'}
_STRIP = re.compile(r'[ ,./\-_*^]')


def normalize(text: str) -> str:
  """A string as BFCL compares it: without spaces and , . / - _ * ^, lowercased, ' as "."""
  return _STRIP.sub('', text).lower().replace("'", '"')


def _norm(x):
  return normalize(x) if isinstance(x, str) else x


def _first_type(accepted: Sequence) -> type | None:
  """The type of the first accepted value that is not the optional marker ''."""
  for a in accepted:
    if a != '':
      return type(a)
  return None


def _type_ok(value, accepted: Sequence, type_name: str, want: type,
             inner: type | None) -> tuple[bool, bool, str]:
  """(valid, is a variable's name, why not) of a value's type."""
  seen = _first_type(accepted)
  variable = seen is not None and seen is not want
  if type(value) is want:                                    # pylint: disable=unidiomatic-typecheck
    if inner is None:
      return True, variable, ''
    for option in accepted:
      # An accepted value that is not a list (the optional marker) does not constrain items.
      if not isinstance(option, list) or all(
          _type_ok(v, option, inner.__name__, inner, None)[0] for v in value):
        return True, variable, ''
    return False, False, (f'nested type: expected {type_name} of {inner.__name__}, got '
                          f'{value!r}')
  if seen is not None and type(value) is seen:               # pylint: disable=unidiomatic-typecheck
    return True, True, ''
  return False, False, f'type: expected {type_name}, got {type(value).__name__} ({value!r})'


def _dict_ok(value: Mapping, accepted: Sequence) -> tuple[bool, str]:
  why = 'no accepted dict'
  for option in accepted:
    if option == '':
      continue
    ok = True
    for k, v in value.items():
      if k not in option:
        ok, why = False, f'unexpected dict key {k!r}'
        break
      if _norm(v) not in [_norm(a) for a in option[k]]:
        ok, why = False, f'dict value {k!r}={v!r} is none of {option[k]!r}'
        break
    if ok:
      for k, allowed in option.items():
        if k not in value and '' not in allowed:
          ok, why = False, f'missing dict key {k!r}'
          break
    if ok:
      return True, ''
  return False, why


def _list_of_dicts_ok(value: list, accepted: Sequence) -> tuple[bool, str]:
  why = 'no accepted list of dicts'
  for option in accepted:
    if len(value) != len(option):
      why = 'wrong number of dicts in the list'
      continue
    for item, want in zip(value, option):
      ok, why = _dict_ok(item, [want])
      if not ok:
        break
    else:
      return True, ''
  return False, why


def check_call(doc: Mapping, call: tuple[str, Mapping], expected: Mapping) -> tuple[bool, str]:
  """Whether one call passes BFCL's AST check against one expected call (module docstring).

  Args:
    doc: the function's description ({'name', 'parameters': {'properties', 'required'}}).
    call: (name, arguments) the model gave.
    expected: {name: {parameter: [accepted values]}} (one name).

  Returns:
    (passed, why not).
  """
  (want_name, accepted), = expected.items()
  name, args = call
  if name != doc['name'] or name != want_name:
    return False, f'function {name!r} is not {want_name!r}'
  params = doc.get('parameters') or {}
  props = params.get('properties') or {}
  for p in params.get('required') or ():
    if p not in args:
      return False, f'missing required parameter {p!r}'
  for p, value in args.items():
    if p not in props or p not in accepted:
      return False, f'unexpected parameter {p!r}'
    type_name = props[p].get('type')
    if type_name not in PY_TYPES:
      return False, f'parameter {p!r}: type {type_name!r} is not one BFCL checks'
    want, inner = PY_TYPES[type_name], None
    if type_name in NESTED:
      inner = PY_TYPES.get((props[p].get('items') or {}).get('type'))
    if type_name == 'tuple' and isinstance(value, tuple):
      value = list(value)
    if type_name == 'float' and type(value) is int:          # pylint: disable=unidiomatic-typecheck
      value = float(value)
    ok, variable, why = _type_ok(value, accepted[p], type_name, want, inner)
    if not ok:
      return False, f'parameter {p!r}: {why}'
    if not variable:
      if want is dict:
        ok, why = _dict_ok(value, accepted[p])
      elif want is list and inner is dict:
        ok, why = _list_of_dicts_ok(value, accepted[p])
      elif want is str:
        ok = normalize(value) in [normalize(a) for a in accepted[p] if isinstance(a, str)]
        why = f'{value!r} is none of {accepted[p]!r} (case and punctuation aside)'
      elif want is list:
        got = [_norm(v) for v in value]
        ok = got in [[_norm(v) for v in a] for a in accepted[p] if isinstance(a, list)]
        why = f'{value!r} is none of {accepted[p]!r}'
      else:
        ok, why = value in accepted[p], f'{value!r} is none of {accepted[p]!r}'
      if not ok:
        return False, f'parameter {p!r}: {why}'
      continue
    if value not in accepted[p]:
      return False, f'parameter {p!r}: {value!r} is none of {accepted[p]!r}'
  for p, allowed in accepted.items():
    if p not in args and '' not in allowed:
      return False, f'parameter {p!r} is not given and is not optional'
  return True, ''


def _doc(docs: Sequence[Mapping], name: str) -> Mapping:
  for d in docs:
    if d['name'] == name:
      return d
  return {'name': name, 'parameters': {}}     # an answer naming no offered function: fails


def check(category: str, docs: Sequence[Mapping], calls: Sequence[tuple[str, Mapping]],
          expected: Sequence[Mapping]) -> tuple[bool, str]:
  """Whether a response's calls pass the category's check (module docstring): a category's
  rule is picked by the names it contains, as BFCL's checker picks it."""
  if 'irrelevance' in category:
    return (not calls, '' if not calls else f'{len(calls)} call(s) where none fits')
  if 'relevance' in category:
    return (bool(calls), '' if calls else 'no call where one fits')
  if 'parallel' not in category and 'multiple' not in category:
    if len(calls) != 1:
      return False, f'{len(calls)} calls for 1'
    return check_call(docs[0], calls[0], expected[0])
  if len(calls) != len(expected):
    return False, f'{len(calls)} calls for {len(expected)}'
  if 'parallel' not in category:      # multiple
    return check_call(_doc(docs, next(iter(expected[0]))), calls[0], expected[0])
  used: set[int] = set()
  for i, want in enumerate(expected):
    doc = _doc(docs, next(iter(want)))
    why = ''
    for j, call in enumerate(calls):
      if j in used:
        continue
      ok, why = check_call(doc, call, want)
      if ok:
        used.add(j)
        break
    else:
      return False, f'expected call {i + 1} ({next(iter(want))}) matches none left ({why})'
  return True, ''


def schema(doc: Mapping) -> dict:
  """A function description as the tool the model is shown (BFCL types to JSON schema's)."""

  def fix(node):
    if isinstance(node, Mapping):
      out = {k: fix(v) for k, v in node.items()}
      if isinstance(out.get('type'), str):
        out['type'] = _SCHEMA_TYPES.get(out['type'], out['type'])
      return out
    if isinstance(node, list):
      return [fix(x) for x in node]
    return node
  fn = {k: v for k, v in doc.items() if k in ('name', 'description')}
  fn['parameters'] = fix(doc.get('parameters') or {'type': 'dict', 'properties': {}})
  return {'type': 'function', 'function': fn}


def with_tools(messages: Sequence[Mapping], docs: Sequence[Mapping]) -> list[dict]:
  """The messages with the tools' section in their system turn, so that `chat.render` of them
  is `chat.render(messages, tools=...)` (records carry no tools of their own)."""
  opening = chat.render([], tools=[schema(d) for d in docs], add_generation_prompt=False)
  section = opening.removeprefix(f'{chat.IM_START}system\n').removesuffix(f'{chat.IM_END}\n')
  out = [dict(m) for m in messages]
  if out and out[0].get('role') == 'system':
    out[0]['content'] = f'{out[0]["content"]}\n\n{section}' if out[0]['content'] else section
  else:
    out.insert(0, {'role': 'system', 'content': section})
  return out


class AstGrader(base.Grader):
  """Grades each completion by `check` (host work: no workers)."""

  def __init__(self, category: str):
    self.category = category

  def grade(self, record: Mapping, completions: Sequence[str]) -> list[base.Graded]:
    meta = record['metadata']
    out = []
    for text in completions:
      turn = chat.parse_tool_calls(text)
      calls = [(c.name, c.arguments) for c in turn.calls]
      if not turn.finished_thinking:
        calls = []
        ok, why = check(self.category, meta['functions'], calls, [])[0], (
            'the thinking block never closed')
      else:
        ok, why = check(self.category, meta['functions'], calls, meta.get('ground_truth', []))
      out.append(base.Graded(score=float(ok), info={
          'reason': 'passes the AST check' if ok else why, 'calls': len(calls),
          'malformed': len(turn.errors)}))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class BfclSuite(base.Suite):
  """One BFCL v3 single-turn AST category (see the module docstring).

  Attributes:
    category: one of CATEGORIES.
  """
  category: str

  def answers_files(self, data_dir: str) -> list[str]:
    found = []
    for pattern in self.files:
      found += sorted(str(p) for p in paths.path(data_dir).glob(f'possible_answer/{pattern}'))
    return found

  def read(self, data_dir: str) -> list[dict]:
    """The questions, each with its ground truth (irrelevance has none).

    Raises:
      DataMissing: no question file, or no answer file (names it).
      BadRecord: a record without a field it needs, or a question without an answer.
    """
    records = super().read(data_dir)
    if self.category in NO_ANSWERS:
      return records
    files = self.answers_files(data_dir)
    if not files:
      wanted = ' or '.join(f'possible_answer/{f}' for f in self.files)
      raise base.DataMissing(f'suite {self.name!r}: no {wanted} under {data_dir} '
                             f'({self.source})')
    truth = {}
    for path in files:
      for line, row in base.rows(path):
        gt = base.field(path, line, row, 'ground_truth', list)
        if not gt or not all(isinstance(g, Mapping) and len(g) == 1 and isinstance(
            next(iter(g.values())), Mapping) for g in gt):
          raise base.BadRecord(f'{path}:{line}: ground_truth must be a list of '
                               '{function: {parameter: [accepted values]}}')
        truth[base.field(path, line, row, 'id')] = gt
    for r in records:
      if r['id'] not in truth:
        raise base.BadRecord(f'suite {self.name!r}: {", ".join(files)} has no answer to '
                             f'{r["id"]!r}')
      r['metadata']['ground_truth'] = truth[r['id']]
    return records

  def parse(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    out = []
    for line, row in raw:
      rid = base.field(path, line, row, 'id')
      question = base.field(path, line, row, 'question', list)
      if (len(question) != 1 or not isinstance(question[0], list) or not question[0]
          or not all(isinstance(m, Mapping) and isinstance(m.get('content'), str)
                     and m.get('role') in ('system', 'user', 'assistant') for m in question[0])):
        raise base.BadRecord(f"{path}:{line}: field 'question' must be one turn, a list of "
                             "{'role', 'content'} messages (the AST categories are "
                             'single-turn)')
      functions = base.field(path, line, row, 'function', list)
      if not functions or not all(isinstance(f, Mapping) and isinstance(f.get('name'), str)
                                  for f in functions):
        raise base.BadRecord(f"{path}:{line}: field 'function' must be a list of function "
                             "descriptions with a 'name'")
      try:
        messages = with_tools(question[0], functions)
      except ValueError as e:
        raise base.BadRecord(f'{path}:{line}: {e}') from None
      out.append({'id': rid, 'messages': messages,
                  'metadata': {'category': self.category, 'functions': functions}})
    return out

  def grader(self, **options) -> AstGrader:
    if options:
      raise TypeError(f'unexpected grader options {sorted(options)} (the AST check takes none)')
    return AstGrader(self.category)


PROTOCOL = base.Protocol(samples=1, temperature=0.0, top_p=1.0, greedy=True,
                         max_new_tokens=8192, thinking=True)
_HUB = 'gorilla-llm/Berkeley-Function-Calling-Leaderboard'
# launch.plan's bound on a rendered question with its functions' documentation (ours, assumed)
# where it does not measure the files.
PROMPT_TOKENS = 8192
_TITLES = {'simple': 'simple (Python)', 'multiple': 'multiple', 'parallel': 'parallel',
           'parallel_multiple': 'parallel multiple', 'irrelevance': 'irrelevance',
           'live_simple': 'live simple', 'live_multiple': 'live multiple',
           'live_parallel': 'live parallel', 'live_parallel_multiple': 'live parallel multiple',
           'live_irrelevance': 'live irrelevance', 'live_relevance': 'live relevance'}


def _suite(category: str) -> BfclSuite:
  files = (f'BFCL_v3_{category}.json',) + (
      ('BFCL_v4_simple_python.json',) if category == 'simple' else (f'BFCL_v4_{category}.json',))
  hub = (f'BFCL_v3_{category}.json',) + (
      () if category in NO_ANSWERS else (f'possible_answer/BFCL_v3_{category}.json',))
  return BfclSuite(
      name=f'bfcl_v3_{category}', title=f'BFCL v3 {_TITLES[category]} (AST)',
      source=f'{_HUB} ({" + ".join(hub)})', files=files, protocol=PROTOCOL,
      metric='accuracy', category=category, hub_dataset=_HUB, hub_files=hub,
      prompt_tokens=PROMPT_TOKENS)


bfcl_v3_simple = _suite('simple')
bfcl_v3_multiple = _suite('multiple')
bfcl_v3_parallel = _suite('parallel')
bfcl_v3_parallel_multiple = _suite('parallel_multiple')
bfcl_v3_irrelevance = _suite('irrelevance')
bfcl_v3_live_simple = _suite('live_simple')
bfcl_v3_live_multiple = _suite('live_multiple')
bfcl_v3_live_parallel = _suite('live_parallel')
bfcl_v3_live_parallel_multiple = _suite('live_parallel_multiple')
bfcl_v3_live_irrelevance = _suite('live_irrelevance')
bfcl_v3_live_relevance = _suite('live_relevance')
