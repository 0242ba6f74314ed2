"""cascade/suites/bfcl.py's AST check against bfcl-eval's own checker, where its source is at
hand: bfcl-eval cannot be installed beside JAX (it pins numpy 1.26.4), so the test reads an
unpacked wheel named by BFCL_EVAL_SRC (`pip download bfcl-eval --no-deps -d /tmp/bfcl && cd
/tmp/bfcl && unzip bfcl_eval-*.whl -d src`, then BFCL_EVAL_SRC=/tmp/bfcl/src), imports only its
ast_checker (the model registry it imports, and with it every API client, stubbed: the checker
reads one flag of it) and compares both on the wheel's released v4 data (simple_python,
multiple, parallel, parallel_multiple): each record's ground truth as calls, and five random
mutations of them (a parameter dropped, added, changed, a number as a string or float, case,
order, a call repeated or renamed, none). On bfcl-eval 2026.3.23: 14,106 of 14,106 agree (7,945
valid) over the four non-live and the four live AST categories (live_simple, live_multiple,
live_parallel, live_parallel_multiple)."""

import collections
import copy
import json
import os
import random
import sys
import types

import pytest

from cascade.suites import bfcl

SRC = os.environ.get('BFCL_EVAL_SRC', '')


def _reference():
  if not SRC or not os.path.isdir(os.path.join(SRC, 'bfcl_eval')):
    pytest.skip('BFCL_EVAL_SRC names no unpacked bfcl-eval wheel (see the module docstring)')
  stub = types.ModuleType('bfcl_eval.constants.model_config')

  class Cfg:
    underscore_to_dot = False

  class Mapping(dict):
    def __getitem__(self, key):
      return Cfg()
  stub.MODEL_CONFIG_MAPPING = Mapping()
  sys.modules['bfcl_eval.constants.model_config'] = stub
  sys.path.insert(0, SRC)
  try:
    from bfcl_eval.constants import enums  # pylint: disable=g-import-not-at-top
    from bfcl_eval.eval_checker.ast_eval import ast_checker  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(SRC)
  return ast_checker.ast_checker, enums.Language.PYTHON


def _pick(accepted):
  vals = [a for a in accepted if a != '']
  return copy.deepcopy(vals[0]) if vals else None


def _calls(truth, rng):
  out = []
  for g in truth:
    (name, params), = g.items()
    args = {}
    for p, acc in params.items():
      v = _pick(acc)
      if v is None or ('' in acc and rng.random() < 0.5):
        continue
      if isinstance(v, dict):
        v = {k: _pick(a) for k, a in v.items() if _pick(a) is not None}
      if isinstance(v, list) and v and isinstance(v[0], dict):
        v = [{k: _pick(a) for k, a in d.items() if _pick(a) is not None} for d in v]
      args[p] = v
    out.append((name, args))
  return out


def _mutate(calls, rng):
  calls = copy.deepcopy(calls)
  kind = rng.choice(['drop', 'num', 'str', 'extra', 'swap', 'float', 'strnum', 'case', 'dup',
                     'none', 'name', 'listrev'])
  if kind == 'swap':
    return calls[::-1]
  if kind == 'dup':
    return calls + [calls[0]]
  if kind == 'none':
    return []
  i = rng.randrange(len(calls))
  name, args = calls[i]
  if kind == 'name':
    calls[i] = (name + '_x', args)
  elif args:
    p = rng.choice(sorted(args))
    v = args[p]
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == 'drop':
      del args[p]
    elif kind == 'extra':
      args['extra_param'] = 1
    elif kind == 'num' and number:
      args[p] = v + 1
    elif kind == 'float' and number:
      args[p] = float(v) if isinstance(v, int) else (int(v) if v == int(v) else v)
    elif kind == 'strnum' and number:
      args[p] = str(v)
    elif kind == 'str' and isinstance(v, str):
      args[p] = 'zzz'
    elif kind == 'case' and isinstance(v, str):
      args[p] = v.upper().replace(' ', '-')
    elif kind == 'listrev' and isinstance(v, list):
      args[p] = v[::-1]
  return calls


@pytest.mark.heavy
def test_the_checks_agree_with_bfcl_evals_ast_checker_on_its_released_data():
  checker, python = _reference()
  data = os.path.join(SRC, 'bfcl_eval', 'data')
  rng = random.Random(0)
  tally = collections.Counter()
  for cat, name in (('simple', 'simple_python'), ('multiple', 'multiple'),
                    ('parallel', 'parallel'), ('parallel_multiple', 'parallel_multiple'),
                    *[(c, c) for c in ('live_simple', 'live_multiple', 'live_parallel',
                                       'live_parallel_multiple')]):
    with open(os.path.join(data, f'BFCL_v4_{name}.json')) as f:
      questions = {r['id']: r for r in map(json.loads, f)}
    with open(os.path.join(data, 'possible_answer', f'BFCL_v4_{name}.json')) as f:
      answers = [json.loads(line) for line in f]
    for a in answers:
      q, truth = questions[a['id']], a['ground_truth']
      base_calls = _calls(truth, rng)
      for trial in range(6):
        calls = base_calls if trial == 0 else _mutate(base_calls, rng)
        want = checker(q['function'], [{n: args} for n, args in calls], truth, python, cat,
                       'model')['valid']
        got = bfcl.check(cat, q['function'], calls, truth)[0]
        tally['valid'] += want
        tally['agree' if got == want else f'{cat}: {a["id"]}'] += 1
  disagree = {k: v for k, v in tally.items() if k not in ('agree', 'valid')}
  assert not disagree, disagree
  assert tally['agree'] >= 6000 and 0.3 < tally['valid'] / tally['agree'] < 0.7
