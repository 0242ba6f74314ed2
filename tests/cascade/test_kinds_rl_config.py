"""An RL stage's config as a user writes it: defaults, bounds, the update/microbatch split, the
curriculum phases, and the sizes the stage derives from them (sampler call, train batch, records
kept, the learning-rate horizon).

Each case sits on a boundary (the smallest or largest value a field accepts, next to the first it
refuses), so a check that drifts by one, or a phase that ignores its own field, fails here.
Nothing is compiled: every test takes milliseconds.
"""

import dataclasses
import re

import jax
import ml_collections
import pytest

from cascade import config as config_lib
from cascade import kinds
from cascade import rollout
from cascade.data import stage_data
from cascade.kinds import base
from cascade.kinds import rl

GRPO = dict(name='rl', kind='grpo', domains=['a'], steps=6, optimizer=dict(lr=1e-3),
            prompts_per_step=3, group_size=2, max_prompt_len=10, max_response_len=16)


def _stage(raw, train=('a_train',)):
  """The stage dict parsed as `cascade.config` parses it (domain 'a', datasets `train`)."""
  doms = {'a': config_lib.Domain(name='a', verifier='math', train=train[0] if train else '',
                                 eval='a_train')}
  ds = {n: config_lib.Dataset(name=n, format='prompt', record_type='prompt')
        for n in ('a_train', 'b_train')}
  refs = base.Refs((), (raw['name'],), doms, ds)
  return kinds.parse(0, raw, refs)


def _error(raw, message, **kw):
  with pytest.raises(config_lib.ConfigError, match=re.escape(f"stages[0] 'rl': {message}")):
    _stage({**raw, **kw})


# ------------------------------------------------------------------ fields and defaults

def test_documented_defaults():
  """Unset, a stage samples at temperature 1 without top-p/top-k, filters dynamically with 4
  refill rounds, keeps truncated rows, aggregates per token and is strictly on-policy."""
  st = _stage(GRPO)
  assert (st.temperature, st.top_p, st.top_k) == (1.0, 1.0, 0)
  assert st.thinking_fraction is None
  assert (st.dynamic_filter, st.refill_cap, st.filter_overlong) == (True, 4, False)
  assert (st.loss_agg, st.updates_per_batch) == ('token', 1)
  # Stage configs are frozen values (hashable, never edited in place).
  with pytest.raises(dataclasses.FrozenInstanceError):
    st.group_size = 4
  assert hash(st) == hash(_stage(GRPO))


def test_a_thinking_fraction_per_domain_names_exactly_the_stage_domains():
  """A mapping gives each of the stage's domains its own rate; it is kept hashable, read back
  as a dict, and a missing, extra or out-of-range domain is refused by name."""
  doms = {d: config_lib.Domain(name=d, verifier='math', train=f'{d}_train', eval=f'{d}_train')
          for d in 'abc'}
  ds = {f'{d}_train': config_lib.Dataset(name=f'{d}_train', format='prompt',
                                         record_type='prompt') for d in 'abc'}
  two = lambda **kw: kinds.parse(0, dict(GRPO, domains=['a', 'b'], **kw),
                                 base.Refs((), ('rl',), doms, ds))
  st = two(thinking_fraction={'b': 0.0, 'a': 1.0})
  assert st.thinking_fraction == (('a', 1.0), ('b', 0.0))
  assert st.mode_fractions == {'a': 1.0, 'b': 0.0}
  assert hash(st) == hash(two(thinking_fraction={'a': 1, 'b': 0}))
  assert _stage(dict(GRPO, thinking_fraction=0.25)).mode_fractions == 0.25
  with pytest.raises(config_lib.ConfigError,
                     match=r"thinking_fraction: .*domains \['a', 'b'\]; missing \['b'\]"):
    two(thinking_fraction={'a': 1.0})
  with pytest.raises(config_lib.ConfigError, match=r"not in the stage: \['c'\]"):
    two(thinking_fraction={'a': 1.0, 'b': 0.0, 'c': 0.5})
  with pytest.raises(config_lib.ConfigError, match='thinking_fraction.*must be None'):
    two(thinking_fraction={'a': 1.5, 'b': 0.0})


@pytest.mark.parametrize('field,ok,bad,message', [
    ('prompts_per_step', 1, 0, 'must be an int >= 1'),
    ('max_prompt_len', 1, 0, 'must be an int >= 1'),
    ('max_response_len', 1, 0, 'must be an int >= 1'),
    ('temperature', 0.01, 0.0, 'must be > 0'),
    ('top_p', 1.0, 1.01, 'must be in (0, 1]'),
    ('top_p', 0.01, 0.0, 'must be in (0, 1]'),
    ('top_k', 0, -1, 'must be an int >= 0 (0 = off)'),
    ('thinking_fraction', 0.0, -0.01, 'must be None'),
    ('thinking_fraction', 1.0, 1.01, 'must be None'),
    ('thinking_fraction', 0.5, True, 'must be None'),       # a bool is not a fraction
    ('refill_cap', 0, -1, 'must be an int >= 0'),
    ('dynamic_filter', False, 0, 'must be a bool'),
    ('filter_overlong', True, 1, 'must be a bool'),
    ('loss_agg', 'seq_mean_token_mean', 'tokens', 'unknown loss aggregation'),
    ('phases', [], 'x', 'must be a list of dicts'),
    ('phases', (), {}, 'must be a list of dicts'),
    ('updates_per_batch', 1, 0, 'must be an int >= 1'),
    ('pack_tokens', 0, -1, 'must be an int >= 0'),
    ('entropy_coef', 0.0, -0.01, 'must be >= 0'),
    ('kl_coef', 0.0, -0.01, 'must be >= 0'),
    ('stream_filter', True, 1, 'must be a bool'),
])
def test_each_field_accepts_its_boundary_and_refuses_the_next_value(field, ok, bad, message):
  assert getattr(_stage({**GRPO, field: ok}), field) == (ok if field != 'phases' else
                                                         _stage(GRPO).phases)
  _error(GRPO, f'{field}={bad!r}: {message}', **{field: bad})


@pytest.mark.parametrize('kl_coef', [0.0, 0.1])
def test_the_planned_grpo_batch_carries_reference_logprobs_exactly_with_a_kl_term(kl_coef):
  from cascade.kinds import grpo as grpo_kind  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1, 1, 1), ('data', 'fsdp', 'tensor'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=jax.devices()[:1])
  batch, _ = grpo_kind.abstract_batch(_stage(dict(GRPO, kl_coef=kl_coef)), mesh, None)
  assert (batch.ref_logprobs is not None) == (kl_coef > 0)
  if kl_coef:
    assert batch.ref_logprobs.shape == batch.tokens.shape and batch.ref_logprobs.dtype == 'float32'


def test_packing_needs_the_token_level_loss_and_streaming_needs_dynamic_filtering():
  assert _stage({**GRPO, 'pack_tokens': 64}).pack_tokens == 64
  _error(GRPO, "pack_tokens=64: needs loss_agg='token'", pack_tokens=64,
         loss_agg='seq_mean_token_mean')
  assert _stage({**GRPO, 'dynamic_filter': True, 'stream_filter': True}).stream_filter
  _error(GRPO, 'reference_on_host=True: has no effect with kl_coef=0', reference_on_host=True)
  _error(GRPO, 'stream_filter=True: needs dynamic_filter=True', dynamic_filter=False,
         stream_filter=True)


def test_group_size_one_is_a_valid_rl_group_but_not_a_grpo_baseline():
  mopd = _stage(dict(GRPO, kind='mopd', group_size=1, teachers={'a': '/teacher'}))
  assert mopd.group_size == 1 and mopd.rows_per_step() == (3, 'prompts_per_step * group_size')
  _error(dict(GRPO, kind='mopd', teachers={'a': '/t'}), 'group_size=0: must be an int >= 1',
         group_size=0)
  _error(GRPO, 'group_size=1: grpo needs G >= 2 (a group of one has no baseline)', group_size=1)
  assert _stage(dict(GRPO, group_size=2)).group_size == 2


# ------------------------------------------------------------------ updates and microbatches

@pytest.mark.parametrize('prompts,g,updates,micro', [
    (3, 2, 1, 6), (3, 2, 3, 1), (3, 2, 6, 1), (3, 2, 2, 3), (4, 4, 2, 1), (4, 4, 2, 2),
    (4, 4, 2, 4), (4, 4, 2, 8), (4, 4, 1, 16)])
def test_updates_and_microbatches_that_divide_the_rows_are_accepted(prompts, g, updates, micro):
  st = _stage(dict(GRPO, prompts_per_step=prompts, group_size=g, updates_per_batch=updates,
                   microbatches=micro))
  assert st.rows_per_step() == (prompts * g, 'prompts_per_step * group_size')
  # The learning-rate schedule spans every optimizer update, not every rollout batch.
  assert st.decay_steps == st.steps * updates


@pytest.mark.parametrize('prompts,g,updates,micro,message', [
    (3, 2, 4, 1, 'updates_per_batch=4: must divide prompts_per_step * group_size = 6'),
    (3, 2, 5, 1, 'updates_per_batch=5: must divide prompts_per_step * group_size = 6'),
    (3, 2, 1, 4, 'microbatches=4: must divide prompts_per_step * group_size'),
    (4, 4, 2, 16, 'microbatches=16: must divide prompts_per_step * group_size / updates_per_batch'),
    (4, 4, 2, 3, 'microbatches=3: must divide prompts_per_step * group_size / updates_per_batch'),
    (4, 4, 1, 3, 'microbatches=3: must divide prompts_per_step * group_size'),
])
def test_updates_or_microbatches_that_split_a_row_are_refused(prompts, g, updates, micro,
                                                              message):
  raw = dict(GRPO, prompts_per_step=prompts, group_size=g, updates_per_batch=updates,
             microbatches=micro)
  with pytest.raises(config_lib.ConfigError) as e:
    _stage(raw)
  assert str(e.value) == f"stages[0] 'rl': {message}"


# ------------------------------------------------------------------ curriculum phases

def test_without_phases_one_phase_covers_the_stage_with_its_own_settings():
  st = _stage(dict(GRPO, temperature=0.7, filter_overlong=True))
  assert st.phases == (base.Phase(until_step=6, max_response_len=16, temperature=0.7,
                                  filter_overlong=True),)
  assert [st.phase_at(s) for s in (0, 5, 6, 100)] == [st.phases[0]] * 4


def test_each_phase_overrides_only_its_own_fields_and_holds_until_its_step():
  st = _stage(dict(GRPO, temperature=0.9, phases=[
      dict(until_step=1, max_response_len=4),
      dict(until_step=3, temperature=0.5, filter_overlong=True),
      ml_collections.ConfigDict(dict(until_step=5, max_response_len=16, temperature=1.5))]))
  P = base.Phase  # pylint: disable=invalid-name
  assert st.phases == (P(until_step=1, max_response_len=4, temperature=0.9, filter_overlong=False),
                       P(until_step=3, max_response_len=16, temperature=0.5, filter_overlong=True),
                       P(until_step=5, max_response_len=16, temperature=1.5,
                         filter_overlong=False))
  # A phase holds for steps [previous until_step, until_step); past the last, the last holds.
  want = [0, 1, 1, 2, 2, 2, 2]
  assert [st.phases.index(st.phase_at(s)) for s in range(7)] == want
  assert st.longest_response == 16
  assert _stage(dict(GRPO, phases=[dict(until_step=2, max_response_len=5),
                                   dict(until_step=6, max_response_len=9)])).longest_response == 9


@pytest.mark.parametrize('phases,message', [
    ([dict(until_step=0)], 'phases[0].until_step=0: phases must end at strictly increasing '
                           'steps (previous 0)'),
    ([dict(until_step=2), dict(until_step=2)], 'phases[1].until_step=2: phases must end at '
                                               'strictly increasing steps (previous 2)'),
    ([dict(until_step=3), dict(until_step=2)], 'phases[1].until_step=2: phases must end at '
                                               'strictly increasing steps (previous 3)'),
    ([dict(until_step=2.5)], 'phases[0].until_step=2.5: phases must end'),
    ([dict(max_response_len=4)], 'phases[0].until_step: missing field'),
    ([dict(until_step=2, top_p=0.5)], 'phases[0].top_p: unknown field (known: until_step, '
                                      'max_response_len, temperature, filter_overlong)'),
    ([dict(until_step=2, max_response_len=0)], 'phases[0].max_response_len=0: must be an int'),
    ([dict(until_step=2, max_response_len=4.0)], 'phases[0].max_response_len=4.0: must be an'),
    ([dict(until_step=2, max_response_len=17)], "phases[0].max_response_len=17: exceeds the "
                                                "stage's max_response_len=16"),
    ([dict(until_step=2, temperature=0.0)], 'phases[0].temperature=0.0: must be > 0'),
    ([dict(until_step=2, temperature='hot')], "phases[0].temperature='hot': must be > 0"),
    ([dict(until_step=2, filter_overlong=1)], 'phases[0].filter_overlong=1: must be a bool'),
])
def test_a_malformed_phase_is_a_one_line_error(phases, message):
  with pytest.raises(config_lib.ConfigError) as e:
    _stage(dict(GRPO, phases=phases))
  assert str(e.value).startswith(f"stages[0] 'rl': {message}"), str(e.value)


def test_phases_at_the_boundaries_are_accepted():
  st = _stage(dict(GRPO, phases=[dict(until_step=1, max_response_len=1, temperature=1e-3),
                                 dict(until_step=2, max_response_len=16)]))
  assert [(p.until_step, p.max_response_len) for p in st.phases] == [(1, 1), (2, 16)]


# ------------------------------------------------------------------ what the stage derives

def test_datasets_default_to_each_domains_train_set():
  assert _stage(GRPO).datasets == ('a_train',)
  assert _stage(dict(GRPO, datasets=['b_train'])).datasets == ('b_train',)
  with pytest.raises(config_lib.ConfigError,
                     match=re.escape("datasets=None: not given, and domain 'a' has no train")):
    _stage(GRPO, train=())


def test_prompt_plus_response_must_fit_the_model(fakes):
  # The toy model holds 128 tokens; the toy stages' prompts are up to 100.
  assert fakes.toy_config([fakes.rl_stage('rl', ['a'], max_response_len=28)]).stages[0]
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      "max_response_len=29: max_prompt_len + max_response_len = 129 exceeds the model's "
      'max_seq_len=128')):
    fakes.toy_config([fakes.rl_stage('rl', ['a'], max_response_len=29)])
  st = fakes.toy_config([fakes.rl_stage('rl', ['a'])]).stages[0]
  st.check_lengths(None, lambda *a: pytest.fail(f'no model length, no check: {a}'))
  # A cascade that starts with an RL stage evaluates its starting policy first.
  assert fakes.toy_config([fakes.rl_stage('rl', ['a'])]).initial_eval
  assert not fakes.toy_config([fakes.SFT_STAGE, fakes.rl_stage('rl', ['a'])]).initial_eval


def test_sampler_call_and_train_batch_sizes_follow_the_longest_phase():
  st = _stage(dict(GRPO, prompts_per_step=4, top_p=0.9, top_k=7, updates_per_batch=2,
                   microbatches=2, phases=[dict(until_step=2, max_response_len=6),
                                           dict(until_step=6, max_response_len=12)]))
  assert rl.sampler_sizes(st) == dict(rows=8, prompt_len=10, max_new_tokens=12, top_p=0.9,
                                      top_k=7, num_samples=2)
  mesh = jax.make_mesh((1, 1, 1), ('data', 'fsdp', 'tensor'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=jax.devices()[:1])
  batch, what = rl.abstract_batch(st, mesh, None, teacher_index=('row', 'int32'),
                                  ref_logprobs=('token', 'float32'))
  # One update's rows (8 / 2) x (prompt + longest response) tokens.
  for name in ('tokens', 'positions', 'segment_ids', 'targets'):
    assert getattr(batch, name).shape == (4, 22) and getattr(batch, name).dtype == 'int32'
  assert batch.loss_mask.shape == batch.old_logprobs.shape == (4, 22)
  assert batch.advantages.shape == batch.truncated.shape == (4,)
  assert batch.teacher_index.shape == (4,) and batch.ref_logprobs.shape == (4, 22)
  assert what == ('4 prompts x 2 = 8 rows x 22 tokens (longest phase), 2 updates per rollout '
                  'batch, 2 microbatch(es)')
  one, what1 = rl.abstract_batch(_stage(GRPO), mesh, None)
  assert one.tokens.shape == (6, 26) and what1 == ('3 prompts x 2 = 6 rows x 26 tokens (longest '
                                                   'phase), 1 microbatch(es)')


@pytest.mark.parametrize('pack,want_rows,want_width', [
    (26, 8, 26),     # one longest row (10 + 16) per packed row: as many rows as padded
    (64, 4, 64),     # two to a row: half the rows, one microbatch of 4
    (20, 8, 32),     # narrower than a row: pack widens to the power of two that holds it
    (100, 4, 100),   # three to a row: 3 rows, bucketed up to a whole microbatch of 4
])
def test_a_packed_update_plans_its_largest_packed_batch(pack, want_rows, want_width):
  """With pack_tokens the planned update is the largest batch `rl.batch.pack` can give: every
  sequence at its longest, as many to a row as fit, the row count bucketed as pack buckets it
  (a multiple of the microbatch rows), per-row fields per token; the train step runs as many
  microbatches of `microbatch_rows` as it holds."""
  st = _stage(dict(GRPO, prompts_per_step=4, microbatches=2, pack_tokens=pack))
  assert st.microbatch_rows == 4 and _stage(GRPO).microbatch_rows is None
  mesh = jax.make_mesh((1, 1, 1), ('data', 'fsdp', 'tensor'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=jax.devices()[:1])
  batch, what = rl.abstract_batch(st, mesh, None)
  for name in ('tokens', 'segment_ids', 'loss_mask', 'advantages', 'truncated'):
    assert getattr(batch, name).shape == (want_rows, want_width), name
  assert what == (f'4 prompts x 2 = 8 rows x 26 tokens (longest phase), packed into at most '
                  f'{want_rows} rows x {want_width} tokens, {want_rows // 4} microbatch(es) of '
                  '4 rows')


@pytest.mark.parametrize('fraction', [None, 0.5])
def test_a_stage_keeps_its_domains_prompts_that_fit_in_every_mode(fakes, monkeypatch, fraction):
  """The stage reads only its own domains' records from a dataset that mixes domains, and drops
  a prompt longer than max_prompt_len in the longest mode it may be drawn in."""
  tok = fakes.CharTokenizer()
  recs = [fakes.record(d, i, n) for i, (d, n) in enumerate(
      [('a', 1), ('b', 2), ('a', 333), ('b', 4), ('a', 55555)])]
  modes = rollout.stage_modes(fraction)
  longest = lambda r: rollout.longest_prompt_len(r, tok, modes)
  cap = longest(recs[2])          # the 3-digit prompt fits exactly; the 5-digit one does not
  plan = fakes.toy_config([fakes.rl_stage('rl', ['a'], max_prompt_len=cap,
                                          thinking_fraction=fraction)])
  monkeypatch.setattr(stage_data.readers, 'load', lambda spec, **kw: recs)
  monkeypatch.setattr(stage_data.readers, 'open_dataset', lambda spec, *a, **kw: recs)
  sd = stage_data.StageData(plan, tok, lambda *a: None)
  sd.load()
  loader = stage_data.readers.Loader(sd.stage_records(plan.stages[0]), 0, 4, shuffle=False)
  assert [r['id'] for r in loader.next()] == ['a0', 'a2', 'a0', 'a2']
  assert (loader.dropped, loader.malformed) == (4, 0)      # b1, b3, a4; then b1 again


def test_frozen_passes_run_in_the_train_steps_microbatches():
  """The KL reference and MOPD teacher passes go through a step's rows one microbatch per call
  (what launch.plan compiles), not all rows at once."""
  grpo = _stage(dict(GRPO, kl_coef=0.1, microbatches=4, prompts_per_step=8, group_size=4))
  [ref] = kinds.get('grpo').frozen_forwards(grpo)
  assert (ref.name, ref.rows, ref.calls, ref.copies) == ('reference forward', 8, 4, 1)
  assert ref.length == grpo.max_prompt_len + grpo.longest_response
  assert kinds.get('grpo').frozen_forwards(_stage(dict(GRPO, kl_coef=0.0))) == []
  assert not ref.on_host
  [ref] = kinds.get('grpo').frozen_forwards(dataclasses.replace(grpo, reference_on_host=True))
  assert ref.on_host
  mopd = _stage(dict(GRPO, kind='mopd', teachers={'a': '/t'}, microbatches=2,
                     prompts_per_step=8, group_size=4))
  [teacher] = kinds.get('mopd').frozen_forwards(mopd)
  assert (teacher.rows, teacher.calls, teacher.copies) == (16, 2, 1)
  assert teacher.length == mopd.max_prompt_len + mopd.longest_response
  odd = dataclasses.replace(mopd, max_prompt_len=112)        # 112 | 16 = 112: bits overlap
  assert odd.longest_response == 16
  assert kinds.get('mopd').frozen_forwards(odd)[0].length == 128
  assert not teacher.on_host
  # 'best' may pick another stage per domain: one copy per domain ('best' compared by value:
  # a command-line override is a new str object).
  best = dataclasses.replace(mopd, teachers=''.join(['be', 'st']), teachers_on_host=True)
  [teacher] = kinds.get('mopd').frozen_forwards(best)
  assert (teacher.copies, teacher.on_host) == (1, True)
  assert base.frozen_rows_per_call(7, 8) == 1
