"""benchmarks/cascade_vs_blended.py: the per-stage target check on hand-made results, and the
world pre-build through the configs' `prepare` step."""

import math

import pytest

from absl import flags
from absl.testing import flagsaver

from tiny_world import build as world_build
from tiny_world import world


def _res(scores):
  return {'domains': ['a', 'b', 'c'], 'stages': ['sft', 'a_rl', 'b_rl'],
          'stage_domains': [['a', 'b', 'c'], ['a'], ['b']], 'scores': scores}


def test_gains_and_drops_are_per_row_and_per_trained_domain():
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  res = _res([[10, 20, 30], [25, 16, 31], [24, 40, 26]])
  gain, drop, where = cascade_vs_blended.stage_checks(res)
  assert gain == 15                                  # a_rl +15 on a; b_rl +24 on b
  assert drop == 5 and where == 'b_rl: c'            # 31 -> 26 (b 20 -> 16 is 4)


def test_no_drop_and_no_rl_rows():
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  gain, drop, where = cascade_vs_blended.stage_checks(_res([[1, 1, 1], [3, 1, 2], [3, 4, 2]]))
  assert (gain, drop, where) == (2, 0.0, '')
  only_sft = {'domains': ['a'], 'stages': ['sft'], 'stage_domains': [['a']], 'scores': [[5]]}
  assert math.isnan(cascade_vs_blended.stage_checks(only_sft)[0])


def test_prepare_builds_each_configs_world_once(tmp_path, monkeypatch):
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(world_build, 'SIZES', dict(
      sft=dict.fromkeys(world_build.DOMAINS, 10), rl=5, heldout=4, preference=10,
      preference_heldout=2))
  writes = []
  real_write = world.write
  monkeypatch.setattr(world, 'write', lambda *a, **k: writes.append(a) or real_write(*a, **k))
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(config_arg=f'smoke,root={tmp_path}'):
    dirs = {c: cascade_vs_blended.prepare(c, 5) for c in cascade_vs_blended.CONFIGS}
    assert cascade_vs_blended.prepare('tiny', 5, 'drop=rlhf') == str(tmp_path / 'seed5')
  assert set(dirs.values()) == {str(tmp_path / 'seed5')}
  assert len(writes) == 1                            # the other configs reused the world
  assert (tmp_path / 'seed5' / 'sft_mixed.jsonl').stat().st_size > 0


def _run(stages, ends, steps, accounting=None):
  """A results.json and metrics.jsonl of a run: `ends` the held-out means of each stage's row,
  `steps` (stage, step_s, validation mean or None) in order."""
  res = {'domains': ['a', 'b'], 'stages': stages, 'stage_domains': [['a', 'b']] * len(stages),
         'scores': [[m, m] for m in ends], 'accounting': accounting or {}}
  records, done = [], 0
  for stage, step_s, val in steps:
    n = sum(1 for r in records if r.get('stage') == stage) + 1
    rec = {'stage': stage, 'step': n, 'step_s': step_s}
    if val is not None:
      rec.update({'val/a': val - 1, 'val/b': val + 1})
    records.append(rec)
    nxt = steps[steps.index((stage, step_s, val)) + 1][0] if (
        (stage, step_s, val) != steps[-1]) else None
    if nxt != stage:
      records.append({'eval': stage, 'row': done, 'scores': {'a': ends[done], 'b': ends[done]}})
      done += 1
  return res, records


def test_timeline_counts_steps_after_sft_and_places_scores_in_time():
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  res, records = _run(['sft', 'x', 'y'], [10, 20, 30],
                      [('sft', 100.0, None), ('x', 2.0, None), ('x', 3.0, 15),
                       ('y', 4.0, None), ('y', 1.0, None)],
                      accounting={'sft': {'step_s': 100.0}, 'x': {
                          'step_s': 5.0, 'score_s': 1.0, 'decode_slots': 10.0,
                          'generated_tokens': 4.0, 'update_tokens': 3.0, 'update_slots': 6.0,
                          'decode_waste': 0.6}, 'y': {'step_s': 5.0, 'score_s': 0.0,
                                                      'decode_slots': 10.0,
                                                      'generated_tokens': 6.0}})
  records.insert(3, dict(records[2]))          # a resumed step logged twice counts once
  tl = cascade_vs_blended.timeline(res, records)
  assert tl['wall_s'] == 10.0
  assert tl['stage_ends'] == [('x', 5.0, 20), ('y', 10.0, 30)]
  assert tl['curve'] == [(5.0, 15)]             # validation scores only, when there are any
  acc = tl['accounting']
  assert acc['step_s'] == 10.0 and acc['verifier_share'] == 0.1
  assert acc['decode_waste'] == 0.5 and acc['update_waste'] == 0.5
  res2, rec2 = _run(['sft', 'x'], [10, 20], [('sft', 1.0, None), ('x', 2.0, None)])
  assert cascade_vs_blended.timeline(res2, rec2)['curve'] == [(2.0, 20)]   # else stage ends


def test_reach_fraction_equal_wall_and_paired_verdicts():
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  tl = {'stage_ends': [('x', 2.0, 40.0), ('y', 5.0, 61.0), ('z', 9.0, 70.0)]}
  assert cascade_vs_blended.reach_fraction(tl, 60.0, 10.0) == 0.5
  assert cascade_vs_blended.reach_fraction(tl, 40.0, 4.0) == 0.5
  assert math.isinf(cascade_vs_blended.reach_fraction(tl, 71.0, 10.0))
  curve = [(1.0, 3.0), (4.0, 5.0)]
  assert cascade_vs_blended.score_at(curve, 4.0) == 5.0
  assert cascade_vs_blended.score_at(curve, 3.9) == 3.0
  assert math.isnan(cascade_vs_blended.score_at(curve, 0.5))
  m, se, verdict = cascade_vs_blended.paired([70, 72, 71], [60, 61, 62])
  assert m == 10 and se == pytest.approx(1 / math.sqrt(3)) and verdict == 'A higher'
  assert cascade_vs_blended.paired([70, 60, 80], [69, 61, 78])[2] == 'tie'
  assert cascade_vs_blended.paired([1, 2], [3, 4.5])[2] == 'B higher'
  assert cascade_vs_blended.paired([5], [1])[2] == 'tie'       # one seed: no spread to go by


def test_interference_and_side_names():
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  res = _res([[10, 20, 30], [25, 16, 31], [24, 40, 26]])
  assert cascade_vs_blended.interference(res) == {'a_rl -> b': -4, 'a_rl -> c': 1,
                                                  'b_rl -> a': -1, 'b_rl -> c': -5}
  assert cascade_vs_blended.split_side('tiny:drop=rlhf') == ('tiny', 'drop=rlhf')
  assert cascade_vs_blended.run_name('tiny:drop=rlhf+if_rl') == 'tiny_drop-rlhf-if-rl'
  assert cascade_vs_blended.run_name('tiny_blended') == 'tiny_blended'
  with pytest.raises(Exception, match='expected config or config:argument'):
    cascade_vs_blended.split_side('../x')


def test_plot_draws_both_sides(tmp_path):
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  tl = {'curve': [(1.0, 10.0), (3.0, 20.0)], 'stage_ends': [('x', 3.0, 21.0)]}
  path = tmp_path / 'sub' / 'curve.png'
  cascade_vs_blended.plot(str(path), ['A', 'B'], {'A': {0: tl}, 'B': {0: dict(tl, curve=[])}})
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_seed_mean_stage_ends_average_wall_and_score_per_stage():
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  ends = [[('x', 2.0, 40.0), ('y', 6.0, 60.0)], [('x', 4.0, 50.0), ('y', 8.0, 64.0)]]
  assert cascade_vs_blended.seed_mean_ends(ends) == [('x', 3.0, 45.0), ('y', 7.0, 62.0)]
  assert cascade_vs_blended.seed_mean_ends([ends[0], ends[1][:1]]) == []
  assert cascade_vs_blended.seed_mean_ends([]) == []


def test_fork_only_where_every_section_but_the_stages_agrees(tmp_path):
  """B forks from A (`cascade.checkpoint.fork`) only when their configs differ in the stages
  alone: `tiny:fast_path` against `tiny` differs in the sampler (the paged engine), so B runs
  whole and the summary says why, instead of the fork stopping the comparison."""
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(config_arg=f'root={tmp_path}'):
    assert cascade_vs_blended.fork_blocker('tiny', 'tiny:drop=rlhf', 0) == ''
    assert cascade_vs_blended.fork_blocker('tiny', 'tiny_blended', 1) == ''
    assert (cascade_vs_blended.fork_blocker('tiny:fast_path', 'tiny', 0)
            == 'their configs differ in sampler')
    assert (cascade_vs_blended.fork_blocker('tiny', 'tiny:model=hybrid,fast_path', 0)
            == 'their configs differ in model, sampler')


def test_doc_page_holds_the_summary_command_machine_and_load(tmp_path, monkeypatch):
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  from benchmarks import host  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  monkeypatch.setattr(cascade_vs_blended.os, 'getloadavg', lambda: (3.25, 2.5, 1.0))
  monkeypatch.setattr(cascade_vs_blended.sys, 'argv',
                      ['cascade_vs_blended.py', '--compare=tiny:fast_path,tiny', '--doc=x.md'])
  page = tmp_path / 'sub' / 'page.md'
  with flagsaver.flagsaver(compare=['tiny:fast_path', 'tiny']):
    cascade_vs_blended.write_doc(str(page), ['\nheld-out score', 'math  1.0 ± 2.0'],
                                 (1.5, 1.25, 1.0), read_back=2, runs=6)
  text = page.read_text()
  assert text.startswith('# tiny:fast_path vs tiny on the tiny world\n')
  assert ('`python -m benchmarks.cascade_vs_blended --compare=tiny:fast_path,tiny --doc=x.md`'
          in text)
  assert f'cores of {host.cpu_name()}' in text
  assert 'load average (1/5/15 min) 1.50/1.25/1.00 before and 3.25/2.50/1.00 after' in text
  assert '2 of the 6 runs had finished before this call and were read back' in text
  assert '```text\n\nheld-out score\nmath  1.0 ± 2.0\n```\n' in text
  cascade_vs_blended.write_doc(str(page), ['x'], (1.0, 1.0, 1.0), read_back=0, runs=6)
  assert 'read back' not in page.read_text()


def test_sampling_split_tells_first_steps_and_slow_steps_from_the_rest():
  from benchmarks import cascade_vs_blended  # pylint: disable=g-import-not-at-top
  res = {'stages': ['sft', 'x', 'y']}
  rec = lambda stage, step, s: {'stage': stage, 'step': step, 'sample_s': s}
  records = [{'stage': 'sft', 'step': 1}, rec('x', 1, 50.0), rec('x', 2, 1.0), rec('x', 3, 9.0),
             rec('x', 4, 1.2), rec('x', 5, 0.8), rec('x', 4, 1.4),      # step 4 re-logged
             rec('y', 1, 20.0), rec('y', 2, 2.0), rec('y', 3, 3.0),
             {'eval': 'x', 'row': 1, 'scores': {}}]
  out = cascade_vs_blended.sampling_split(res, records)
  # x: median of later steps (1.0, 9.0, 1.4, 0.8) is 1.2; 9.0 > 6.0 is slow.
  assert out['first_s'] == 70.0 and out['slow_s'] == 9.0
  assert out['rest_s'] == pytest.approx(1.0 + 1.4 + 0.8 + 2.0 + 3.0)
  assert out['median_s'] == 1.4                       # of 0.8, 1.0, 1.4, 2.0, 3.0
  empty = cascade_vs_blended.sampling_split({'stages': ['sft']}, [])
  assert empty['first_s'] == 0.0 and math.isnan(empty['median_s'])
