"""Validation sets: loaded disjoint from the held-out prompts, scored inside a stage every
`eval.eval_every` steps on the live policy, and read by nothing that reports held-out numbers."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from cascade import evaluation
from cascade import kinds
from cascade import policies as policies_lib
from cascade.data import readers
from cascade.data import stage_data
from cascade.kinds import loop
from rl import sft as sft_lib


def _records(fakes, domain, nums):
  return [fakes.record(domain, i, n) for i, n in enumerate(nums)]


def _load(fakes, monkeypatch, by_dataset):
  monkeypatch.setattr(readers, 'load', lambda spec, **kw: by_dataset[spec.name])


def test_validation_sets_are_cut_and_must_not_share_held_out_prompts(fakes, monkeypatch):
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a'])], validation=True)
  plan = dataclasses.replace(plan, eval_settings={
      d: dataclasses.replace(e, num_prompts=3, validation_prompts=2)
      for d, e in plan.eval_settings.items()})
  by = {'sft': [], 'a_train': _records(fakes, 'a', range(10)),
        'b_train': _records(fakes, 'b', range(10)),
        'a_val': _records(fakes, 'a', range(20, 25)), 'b_val': _records(fakes, 'b', [30, 31, 32])}
  _load(fakes, monkeypatch, by)
  sd = stage_data.StageData(plan, fakes.CharTokenizer(), None)
  sd.load()
  assert [len(sd.eval_sets[d]) for d in 'ab'] == [3, 3]
  assert [r['metadata']['answer'] for r in sd.validation_sets['a']] == ['20', '21']
  # A validation prompt that is one of the reported held-out prompts stops the run; one that
  # is only in the unreported rest of the held-out file does not.
  by['b_val'] = _records(fakes, 'b', [7, 30])
  sd = stage_data.StageData(plan, fakes.CharTokenizer(), None)
  sd.load()
  by['b_val'] = _records(fakes, 'b', [30, 1])
  sd = stage_data.StageData(plan, fakes.CharTokenizer(), None)
  with pytest.raises(readers.DataError, match=r"config\.domains\.b\.validation='b_val': 1 of "
                                               r"its 2 prompts are also held-out prompts"):
    sd.load()


@pytest.mark.parametrize('sets,own,want', [
    ({'a': [1]}, None, [2, 4]),
    pytest.param({'a': [1]}, 3, [3], marks=pytest.mark.heavy),    # the stage's own cadence
    pytest.param({'a': [1]}, 0, [], marks=pytest.mark.heavy),     # the stage opts out
    pytest.param({}, None, [], marks=pytest.mark.heavy)])
def test_stage_scores_validation_every_n_steps_on_its_live_policy(fakes, tmp_path, monkeypatch,
                                                                   sets, own, want):
  sft = dict(fakes.SFT_STAGE, **({} if own is None else {'eval_every': own}))
  plan = fakes.toy_config([sft], every=100, validation=True)
  plan = dataclasses.replace(plan, eval=dataclasses.replace(plan.eval, eval_every=2))
  stage = plan.stages[0]                                       # 6 steps
  logged, seen_by_maker, validated = {}, {}, []
  writer = types.SimpleNamespace(write=lambda st, step, m: logged.__setitem__(step, dict(m)))
  ctx = types.SimpleNamespace(plan=plan, workdir=str(tmp_path), mesh=None, rules=plan.rules,
                              writer=writer, data=types.SimpleNamespace(validation_sets=sets),
                              policies=policies_lib.Policies(plan, str(tmp_path), None,
                                                             plan.rules))
  digest = lambda params: float(sum(np.abs(np.asarray(x, np.float64)).sum()
                                    for x in jax.tree.leaves(params)))

  def fake_validation(ctx_, params):
    assert ctx_ is ctx
    validated.append(digest(params))
    return {'a': {'score': 10.0 * len(validated), 'stderr': 1.0},
            'b': {'score': 1.0, 'stderr': 0.5}}
  monkeypatch.setattr(evaluation, 'validation_results', fake_validation)

  def maker_fn(state):
    del state
    loader = readers.Loader([{'id': k} for k in range(8)], 0, stage.batch_size)

    def make(step, rng, state):
      del rng
      seen_by_maker[step] = digest(state.params)                # the policy after `step` updates
      ex = [([2 + (7 * r['id'] + j) % 250 for j in range(8)], [0, 0] + [1] * 6)
            for r in loader.next()]
      return [sft_lib.pack(ex, stage.max_len, num_rows=4)], {}
    return loop.BatchMaker(loader, make)

  try:
    loop.train_stage(ctx, kinds.get('sft'), stage, maker_fn)
  finally:
    ctx.policies.close()
  # After steps 2 and 4; step 6 is the stage's end, which its matrix row scores. Without
  # validation sets, nothing is validated.
  assert [s for s in sorted(logged) if 'val/a' in logged[s]] == want
  if not want:
    assert not validated
    return
  if own == 3:
    assert validated == [seen_by_maker[3]] and logged[3]['val/a'] == 10.0
    return
  assert logged[2]['val/a'] == 10.0 and logged[4]['val/a'] == 20.0 and logged[4]['val/b'] == 1.0
  assert validated == [seen_by_maker[2], seen_by_maker[4]]
  assert seen_by_maker[2] != seen_by_maker[4]
  assert 'validation_s' in logged[2] and 'validation_s' not in logged[3]
