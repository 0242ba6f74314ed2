"""Structured-output verifier: JSON extraction and JSON Schema validation."""

import pytest

import verifiers
from verifiers import structured

S = verifiers.Sample
SCHEMA = {'type': 'object', 'properties': {'name': {'type': 'string'},
                                           'age': {'type': 'integer', 'minimum': 0}},
          'required': ['name', 'age'], 'additionalProperties': False}


@pytest.mark.parametrize('text, found, value, where', [
    ('```json\n{"a": 1}\n```', True, {'a': 1}, 'fenced block'),
    ('```\nnot json\n```\n```json\n[1, 2]\n```', True, [1, 2], 'fenced block'),
    ('Result: {"a": "}"} and more {"b": 2}', True, {'a': '}'}, 'inline'),
    ('{broken {"ok": true}', True, {'ok': True}, 'inline'),
    (' 42 ', True, 42, 'whole answer'),
    # More leading whitespace than value: the scalar still parses from after it.
    ('\n \n 7', True, 7, 'whole answer'),
    ('```\n\n\n\n1\n```', True, 1, 'fenced block'),
    ('no json', False, None, 'none'),
    ('', False, None, 'none'),
    (' \n\t ', False, None, 'none'),
])
def test_extract_json(text, found, value, where):
  assert structured.extract_json(text) == (found, value, where)


def test_schema_validation_through_workers():
  samples = [
      S('p', 'Here you go:\n```json\n{"name": "Ada", "age": 36}\n```', {'schema': SCHEMA}),
      S('p', '<think>{"name": 1}</think>{"name": "Ada", "age": -1}', {'schema': SCHEMA}),
      S('p', '{"name": "Ada", "age": 3, "extra": true}', {'schema': SCHEMA}),
      S('p', 'I cannot answer.', {'schema': SCHEMA}),
      S('p', '[{"x": 1}]', {'schema': {'$schema': 'http://json-schema.org/draft-07/schema#',
                                       'type': 'array', 'items': {'type': 'object'}}}),
      S('p', 'true', {'schema': True}),
  ]
  with verifiers.get('structured', workers=1) as v:
    r = v.score(samples)
  assert [x.reward for x in r] == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
  assert r[1].info['reason'].startswith('schema violation at age')
  assert 'Additional properties' in r[2].info['reason']
  assert r[3].info['reason'] == 'no JSON value in the answer'


@pytest.mark.parametrize('text', ['NaN', '{"a": NaN}', '```json\n{"a": Infinity}\n```',
                                  '[-Infinity]', '[' * 100_000 + ']' * 100_000])
def test_nan_infinity_and_overdeep_json_are_not_json(text):
  assert structured.extract_json(text) == (False, None, 'none')


def test_nan_scores_zero_against_a_number_schema():
  with verifiers.get('structured', workers=1) as v:
    r = v.score([S('p', '{"x": NaN}', {'schema': {'type': 'object',
                                                  'properties': {'x': {'type': 'number'}}}}),
                 S('p', '{"x": 1.5}', {'schema': {'type': 'object',
                                                  'properties': {'x': {'type': 'number'}}}})])
  assert [x.reward for x in r] == [0.0, 1.0]


def test_valid_metadata_passes_the_load_time_check():
  verifiers.validate('structured', {'schema': SCHEMA}, 'data/s.jsonl:1')
  verifiers.validate('structured', {'schema': True}, 'data/s.jsonl:2')


@pytest.mark.parametrize('schema, why', [
    ({'type': 'nonsense'}, 'is not a valid JSON Schema'),
    ({'minimum': 'zero'}, 'is not a valid JSON Schema'),
    ({'const': {1, 2}}, 'is not JSON-serialisable'),
    ({'enum': [object()]}, 'is not JSON-serialisable'),
])
def test_bad_schema_is_a_value_error_naming_the_record(schema, why):
  with pytest.raises(ValueError, match=f'^data/s.jsonl:3: metadata\\["schema"\\] {why}'):
    verifiers.validate('structured', {'schema': schema}, 'data/s.jsonl:3')


def test_circular_schema_is_a_value_error_naming_the_record():
  schema = {'type': 'object'}
  schema['properties'] = {'self': schema}
  with pytest.raises(ValueError, match='^data/s.jsonl:4: .*not JSON-serialisable: Circular'):
    verifiers.validate('structured', {'schema': schema}, 'data/s.jsonl:4')
