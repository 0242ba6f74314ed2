"""benchmarks/plan_parity.py's comparison of two plans' JSON: equal plans give no difference and
an 'Equal.' page; a changed program's memory or FLOPs, a stage's step-time bound, a program only
one side has are each named; compile seconds are shown, never compared (no compiler runs)."""

import copy
import importlib
import json
import os

from absl import flags
from absl.testing import flagsaver

GIB = 2 ** 30


def _parity():
  """benchmarks.plan_parity, imported in the test (it defines absl flags; tests/conftest.py
  unloads it after this file)."""
  return importlib.import_module('benchmarks.plan_parity')


def _program(name='train step', total=10 * GIB, flops=1.5e18, compile_s=90.0):
  return dict(name=name, shapes='64 rows x 8192 tokens', argument_bytes=total, output_bytes=0,
              temp_bytes=0, alias_bytes=0, total_bytes=total, flops=flops, flops_from='',
              error='', collective_s=0.5, collective_step_s=0.0, compile_s=compile_s,
              compile_cpu_s=2 * compile_s, collectives=[
                  dict(kind='all-reduce', name='all-reduce.1', buffer_bytes=4.0,
                       groups=[[0, 1]], count=1, loop=''),
                  dict(kind='all-gather', name='all-gather.2', buffer_bytes=8.0,
                       groups=[[0, 1]], count=2, loop='')])


def _plan(compile_s=90.0):
  return dict(argv=['--config=c.py'], exit=0, load_before=[1.0, 1.0, 1.0],
              load_after=[2.0, 2.0, 2.0], wall_s=200.0, stages=[dict(
                  name='sft', kind='sft', limit_bytes=95 * GIB, steps=4000,
                  resident=[['train step', GIB]],
                  programs=[_program(compile_s=compile_s),
                            _program('sampler', 5 * GIB, 1e15, compile_s / 3)],
                  time=dict(bound=43.8, serial=44.1, worst=43.8, weights_only=43.8))])


def test_equal_plans_differ_in_nothing_but_their_compile_seconds():
  plan_parity = _parity()
  before, after = _plan(90.0), _plan(120.0)
  after['stages'][0]['programs'][0]['compile_cpu_s'] = 360.0   # a CPU ratio apart from wall's
  assert plan_parity.differences(before, after) == []
  assert plan_parity.train_compile_seconds([before, after]) == [90.0, 120.0]
  assert plan_parity.train_compile_seconds([before, after], 'compile_cpu_s') == [180.0, 360.0]
  lines, equal = plan_parity.page([('m' * 40, 'p' * 40, 'c2_train', '--config=c.py', [before],
                                    [after])], 'python -m benchmarks.plan_parity', 'today')
  assert equal and '**Equal.**' in lines
  row = next(l for l in lines if l.startswith('| sft | train step'))
  assert '10.00 GiB / 10.00 GiB' in row and '1.500e+18 / 1.500e+18' in row
  assert '| yes | 90.0 (180) | 120.0 (360) |' in row
  assert any(l.startswith("Train steps' compile, seconds summed per plan, wall (CPU): before "
                          '90.0 (180); after 120.0 (360); after / before (means) 1.333 wall, '
                          '2.000 CPU.') for l in lines)
  assert any(l.startswith('- before #1: from ? UTC, load 1.00, 1.00, 1.00 -> 2.00, 2.00, 2.00')
             for l in lines)


def test_each_difference_is_named():
  plan_parity = _parity()
  before = _plan()
  after = copy.deepcopy(before)
  after['stages'][0]['programs'][0]['temp_bytes'] = GIB
  after['stages'][0]['programs'][0]['total_bytes'] = 11 * GIB
  after['stages'][0]['programs'][1]['flops'] = 2e15
  after['stages'][0]['time']['serial'] = 45.0
  diffs = plan_parity.differences(before, after)
  assert 'sft / train step (64 rows x 8192 tokens) temp_bytes: 0 -> 1073741824' in diffs
  assert f'sft / train step (64 rows x 8192 tokens) total_bytes: {10 * GIB} -> {11 * GIB}' in diffs
  assert 'sft / sampler (64 rows x 8192 tokens) flops: 1000000000000000.0 -> 2000000000000000.0' in diffs
  assert 'stage sft step time serial: 44.1 -> 45.0' in diffs
  assert len(diffs) == 4
  # Collectives: renamed or reordered is equal; another count or bytes is not.
  again = copy.deepcopy(before)
  again['stages'][0]['programs'][0]['collectives'].reverse()
  again['stages'][0]['programs'][0]['collectives'][0]['name'] = 'all-gather.7'
  assert plan_parity.differences(before, again) == []
  again['stages'][0]['programs'][0]['collectives'][0]['count'] = 3
  assert plan_parity.differences(before, again) == [
      'sft / train step (64 rows x 8192 tokens) collectives: 2 -> 2 (1 only before, 1 only after)']
  # A program or a stage only one side has.
  del after['stages'][0]['programs'][1]
  assert 'sft / sampler (64 rows x 8192 tokens): only before' in plan_parity.differences(
      before, after)
  after['stages'][0]['name'] = 'sft2'
  assert {'stage sft: only before', 'stage sft2: only after'} <= set(
      plan_parity.differences(before, after))
  lines, equal = plan_parity.page([('m' * 40, 'p' * 40, 'c', 'x', [before], [after])], 'cmd', 'd')
  assert not equal and '**DIFFERENT:**' in lines


def test_a_repeat_that_differs_from_the_first_is_named_too():
  plan_parity = _parity()
  first, again = _plan(), _plan()
  again['stages'][0]['programs'][0]['flops'] = 1.0
  lines, equal = plan_parity.page([('m' * 40, 'p' * 40, 'c', 'x', [first, again],
                                    [_plan(), _plan()])], 'cmd', 'd')
  assert not equal
  assert any(l.startswith('- repeat: sft / train step') for l in lines)


def test_noplan_renders_the_page_from_the_json_and_names_the_plans_missing(tmp_path, monkeypatch,
                                                                           capsys):
  plan_parity = _parity()
  merge, parent = 'm' * 40, 'p' * 40
  monkeypatch.setattr(plan_parity, 'resolve', lambda repo, rev: parent if rev.endswith('^1')
                      else merge)
  monkeypatch.setattr(plan_parity, 'worktree', lambda *a: (_ for _ in ()).throw(
      AssertionError('--noplan made a worktree')))
  monkeypatch.setattr(os, 'getloadavg', lambda: (9.0, 8.0, 7.0))
  runs = tmp_path / 'json' / merge[:10] / 'c2_train'
  runs.mkdir(parents=True)
  for side, seconds in (('before', 90.0), ('after', 120.0)):
    (runs / f'{side}-0.json').write_text(json.dumps(_plan(seconds)))
  page = tmp_path / 'page.md'
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(merges=['abc'], cases=['c2_train'], repeats=2, workdir=str(tmp_path),
                           page=str(page), plan=False):
    plan_parity.main([])
  out = capsys.readouterr().out.splitlines()
  assert [l for l in out if l.startswith('WARNING: the host was loaded')]
  lines = page.read_text().splitlines()
  assert f'## {merge} (c2_train)' in lines and '**Equal.**' in lines
  assert lines[-2:] == ['- mmmmmmm c2_train after #2', '- mmmmmmm c2_train before #2']
