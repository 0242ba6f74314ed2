"""Each knob once: a GRPO stage's loss fields are `rl.grpo.GrpoConfig`'s, declared there with
their default and check, and reach the loss under the same names (no stage kind declares one of
its own); config.sampler's options are `rl.engine_options.SamplerOptions`' (the paged engine's
among them)."""

import dataclasses

import pytest

from cascade import config as config_lib
from cascade import kinds
from cascade import schema
from cascade.kinds import base
from cascade.kinds import grpo
from rl import engine_options
from rl import grpo as grpo_lib

GRPO = dict(name='rl', kind='grpo', domains=['a'], steps=6, optimizer=dict(lr=1e-3),
            prompts_per_step=3, group_size=2, max_prompt_len=10, max_response_len=16)
# A legal value other than the library's default for each of a stage's loss fields.
SET = dict(advantage='rloo', loss_agg='seq_mean_token_mean', clip_eps_low=0.1, clip_eps_high=0.3,
           kl_coef=0.5, kl_estimator='k1', entropy_coef=0.01, tis_cap=3.0, mismatch_mask='token',
           mismatch_mask_low=0.25, mismatch_mask_high=4.0)
LIBRARY = {f.name: f for f in dataclasses.fields(grpo_lib.GrpoConfig)}


def _stage(raw):
  doms = {'a': config_lib.Domain(name='a', verifier='math', train='a_train', eval='a_train')}
  ds = {'a_train': config_lib.Dataset(name='a_train', format='prompt', record_type='prompt')}
  return kinds.parse(0, raw, base.Refs((), (raw['name'],), doms, ds))


def declared_in(cls, name: str) -> list:
  """The classes of `cls`'s MRO that declare field `name` in their own body (the bases
  `schema.settings` derives from a library dataclass aside)."""
  return [k.__qualname__ for k in cls.__mro__ if k.__module__ != schema.__name__
          and name in k.__dict__.get('__annotations__', {})]


@pytest.mark.parametrize('kind', ['grpo', 'agentic'])
def test_a_grpo_stage_has_exactly_the_librarys_loss_fields(kind):
  fields = {f.name: f for f in dataclasses.fields(kinds.get(kind).config)}
  assert set(LIBRARY) & set(fields) == set(grpo.LOSS_FIELDS) == set(LIBRARY) - set(grpo.NOT_SET)
  for name in grpo.LOSS_FIELDS:
    lib, own = LIBRARY[name], fields[name]
    assert own.default == lib.default, name
    assert own.metadata['check'] is lib.metadata['check'], name
    assert own.metadata['convert'] is lib.metadata['convert'], name


@pytest.mark.parametrize('kind', sorted(kinds.KINDS))
def test_no_kind_declares_a_loss_field_of_its_own(kind):
  twice = {name: declared_in(kinds.get(kind).config, name) for name in LIBRARY}
  assert not {n: where for n, where in twice.items() if where}


def test_the_check_finds_a_field_declared_again():
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Again(grpo.Config):
    kl_coef: float = base.field(0.0)
  assert declared_in(Again, 'kl_coef') == [Again.__qualname__]
  assert declared_in(grpo.Config, 'kl_coef') == []


def test_every_loss_field_reaches_the_loss_by_its_name():
  assert set(SET) == set(grpo.LOSS_FIELDS)
  assert all(SET[n] != LIBRARY[n].default for n in SET)
  _, cfg = grpo.loss(_stage({**GRPO, **SET}))
  assert {n: getattr(cfg, n) for n in SET} == SET
  _, default = grpo.loss(_stage(GRPO))
  assert default == grpo_lib.GrpoConfig()


@pytest.mark.parametrize('name,value', [('kl_coef', -1.0), ('clip_eps_low', 1.0),
                                        ('loss_agg', 'sum'), ('tis_cap', 0.5)])
def test_the_stage_and_the_library_refuse_with_the_same_check(name, value):
  why = LIBRARY[name].metadata['check'][1]
  with pytest.raises(config_lib.ConfigError) as stage_error:
    _stage({**GRPO, name: value})
  assert str(stage_error.value) == f"stages[0] 'rl': {name}={value!r}: {why}"
  with pytest.raises(ValueError) as library_error:
    grpo_lib.GrpoConfig(**{name: value})
  assert str(library_error.value) == f'GrpoConfig.{name}={value!r}: {why}'


def test_config_sampler_takes_every_sampler_option_from_the_library():
  library = {f.name: f for f in dataclasses.fields(engine_options.SamplerOptions)}
  section = {f.name: f for f in dataclasses.fields(config_lib.Sampler)}
  engine = {f.name for f in dataclasses.fields(engine_options.EngineOptions)}
  assert engine < set(library) == set(section)
  for name, lib in library.items():
    assert section[name].default is None, name           # unset: the library's default
    assert section[name].metadata['check'] is lib.metadata['check'], name
    assert section[name].metadata['convert'] is lib.metadata['convert'], name
    assert not declared_in(config_lib.Sampler, name), name


@pytest.mark.parametrize('name,value', [('page_size', 0), ('pages', 1.5), ('decode_rows', 'x'),
                                        ('prompt_buckets', []), ('decode_phases', 0),
                                        ('engine', 'pagd'), ('decode_layers', 'unroll'),
                                        ('rollout_rules', ['embed'])])
def test_a_bad_sampler_option_is_refused_by_its_one_check(name, value):
  why = next(f for f in dataclasses.fields(engine_options.SamplerOptions)
             if f.name == name).metadata['check'][1]
  with pytest.raises(config_lib.ConfigError) as section_error:
    schema.from_mapping(config_lib.Sampler, {name: value}, 'config.sampler', sep='.')
  assert str(section_error.value) == f'config.sampler.{name}={value!r}: {why}'
  with pytest.raises(ValueError) as library_error:
    engine_options.SamplerOptions(**{name: value})
  assert str(library_error.value) == f'SamplerOptions.{name}={value!r}: {why}'


def test_the_sampler_options_normalise_as_the_config_does():
  opts = engine_options.SamplerOptions(prompt_buckets=[64, 32], rollout_rules={'embed': None},
                                       batch_buckets=(8, 2))
  assert (opts.prompt_buckets, opts.batch_buckets) == ((32, 64), (2, 8))
  assert opts.rollout_rules == (('embed', None),)
  section = schema.from_mapping(config_lib.Sampler, dict(prompt_buckets=[64, 32],
                                rollout_rules=[['embed', ['fsdp', 'tensor']]]), 'c', sep='.')
  assert section.prompt_buckets == (32, 64)
  assert section.rollout_rules == (('embed', ('fsdp', 'tensor')),)
  assert engine_options.SamplerOptions(**section.options()) == engine_options.SamplerOptions(
      prompt_buckets=(32, 64), rollout_rules=(('embed', ('fsdp', 'tensor')),))
