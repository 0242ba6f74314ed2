"""Structured-output verifier: JSON extraction and JSON Schema validation."""

import json
import re
import time

import psutil
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


def test_overdeep_json_is_not_json():
  assert structured.extract_json('[' * 100_000 + ']' * 100_000) == (False, None, 'none')


@pytest.mark.parametrize('text, why', [
    ('NaN', 'NaN is not a JSON number'),
    ('{"a": NaN}', 'NaN is not a JSON number'),
    ('```json\n{"a": Infinity}\n```', 'Infinity is not a JSON number'),
    ('[-Infinity]', '-Infinity is not a JSON number'),
    # Python reads these as infinity; other readers fail or clip.
    ('{"a": 1e999}', 'number 1e999 does not fit a double'),
    ('{"a": -1.5E400}', 'number -1.5E400 does not fit a double'),
    # Python keeps the last value, other readers the first: the validated value is ambiguous.
    ('{"age": -1, "age": 3}', "key 'age' appears twice"),
    ('```json\n{"a": {"b": 1, "b": 1}}\n```', "key 'b' appears twice"),
])
def test_non_finite_numbers_and_repeated_keys_are_refused(text, why):
  with pytest.raises(structured.RefusedJson, match=why):
    structured.extract_json(text)


def test_refused_json_scores_zero_even_when_the_schema_would_pass():
  number = {'type': 'object', 'properties': {'x': {'type': 'number'}}}
  adult = {'type': 'object', 'properties': {'age': {'type': 'integer', 'minimum': 18}}}
  with verifiers.get('structured', workers=1) as v:
    r = v.score([S('p', '{"x": 1e999}', {'schema': number}),
                 S('p', '{"age": 3, "age": 30}', {'schema': adult}),
                 S('p', 'The answer: {"x": 1e300}', {'schema': number})])
  assert [x.reward for x in r] == [0.0, 0.0, 1.0]
  assert r[0].info['reason'].startswith('refused JSON: number 1e999 does not fit a double')
  assert r[1].info['reason'] == "refused JSON: key 'age' appears twice in one object"


@pytest.mark.parametrize('fmt, good, bad', [
    ('email', ['ada@example.com', "o'brien+x@mail.example.org", 'a@localhost'],
     ['not-an-email', 'a@', '@example.com', 'a b@example.com', 'a@@example.com',
      'a@-example.com', 'a..b@example.com']),
    ('date', ['2024-02-29', '1999-12-31'], ['2023-02-29', '2024-13-01', '24-01-01', '2024-1-01',
                                            '２０２４-01-01']),
    ('time', ['12:30:00Z', '23:59:60+01:00', '08:00:00.25-05:30'],
     ['12:30:00', '24:00:00Z', '12:60:00Z', '1:00:00Z']),
    ('date-time', ['2024-01-01T12:00:00Z', '2024-01-01t12:00:00.5+02:00'],
     ['2024-01-01 12:00:00Z', '2024-01-01T12:00:00', '2024-02-30T00:00:00Z', 'yesterday']),
    ('duration', ['P3Y6M4DT12H30M5S', 'PT1M', 'P2W', 'P1D'], ['P', 'PT', 'P1Y1D', '3 days', 'P1H']),
    ('hostname', ['example.com', 'a-b.c', 'localhost'], ['-a.com', 'a..com', 'a_b.com',
                                                         'x' * 64 + '.com']),
    ('ipv4', ['192.168.0.1'], ['256.1.1.1', '1.2.3', '01.2.3.4']),
    ('ipv6', ['::1', '2001:db8::8a2e:370:7334'], ['1.2.3.4', ':::', 'fe80::1%eth0']),
    ('uri', ['https://example.com/a?b=c#d', 'mailto:ada@example.com', 'urn:isbn:0451450523',
             'http://[::1]:8080/'], ['example.com/a', '/relative', 'http://exa mple.com',
                                    'http://[nope]/', 'http://x/%zz', '1http://x']),
    ('uri-reference', ['/relative/path', '../x?y#z', 'https://example.com'],
     ['a b', '%', 'http://[::g]/']),
    ('uuid', ['123e4567-e89b-12d3-a456-426614174000'],
     ['123e4567e89b12d3a456426614174000', '123e4567-e89b-12d3-a456-42661417400g']),
    ('regex', ['^a+$', '[0-9]{3}'], ['(', '[a-']),
    ('json-pointer', ['', '/a/b~0c/~1'], ['a/b', '/a~2']),
    ('relative-json-pointer', ['0', '1/a', '2#'], ['-1', '01', '/a']),
])
def test_formats_are_checked(fmt, good, bad):
  schema = json.dumps({'type': 'string', 'format': fmt}, sort_keys=True)
  for value in good:
    assert structured.work({'answer': json.dumps(value), 'schema': schema})['reward'] == 1.0, value
  for value in bad:
    r = structured.work({'answer': json.dumps(value), 'schema': schema})
    assert r['reward'] == 0.0 and 'is not a' in r['info']['reason'], value


def test_format_email_violation_fails_through_workers():
  schema = {'type': 'object', 'properties': {'email': {'type': 'string', 'format': 'email'},
                                             'born': {'type': 'string', 'format': 'date'}}}
  with verifiers.get('structured', workers=1) as v:
    r = v.score([S('p', '{"email": "not an email", "born": "1815-12-10"}', {'schema': schema}),
                 S('p', '{"email": "ada@example.com", "born": "1815-13-10"}', {'schema': schema}),
                 S('p', '{"email": "ada@example.com", "born": "1815-12-10"}', {'schema': schema}),
                 # Formats constrain strings only, as the specification says.
                 S('p', '{"email": 3}', {'schema': {'properties': {'email': {'format': 'email'}}}})])
  assert [x.reward for x in r] == [0.0, 0.0, 1.0, 1.0]
  assert r[0].info['reason'] == "schema violation at email: 'not an email' is not a 'email'"


def test_every_checked_format_is_the_verifiers_own():
  # The checked set does not depend on jsonschema's optional extras being installed.
  assert set(structured.format_checker().checkers) == set(structured.CHECKED_FORMATS)
  assert not set(structured.CHECKED_FORMATS) & structured.UNCHECKED_FORMATS


@pytest.mark.parametrize('schema', [
    {'type': 'string', 'format': 'iri'},
    {'properties': {'home': {'items': {'format': 'idn-hostname'}}}},
    {'anyOf': [{'format': 'uri-template'}]},
])
def test_schema_with_an_unchecked_draft_format_is_refused(schema):
  with pytest.raises(ValueError, match=r'^x:1: metadata\["schema"\] is not a valid JSON Schema: '
                     r'format .* is not checked by this verifier \(checked: date, time, '):
    verifiers.validate('structured', {'schema': schema}, 'x:1')


def test_format_names_outside_the_drafts_and_format_as_data_are_accepted():
  # 'int32' is an annotation (the specification ignores unknown formats); a property named
  # 'format' and a 'format' key inside const are not the keyword.
  verifiers.validate('structured', {'schema': {
      'properties': {'n': {'format': 'int32'}, 'format': {'type': 'string'}},
      'const': {'format': 'iri'}}}, 'x')
  assert structured.formats_in({'properties': {'format': {'format': 'email'}},
                                'enum': [{'format': 'iri'}]}) == {'email'}


@pytest.mark.parametrize('text', [
    '`' * 1_000_000, '```\n' * 250_000, '```' + 'x' * 1_000_000, '{"' * 500_000,
    '[1,' * 333_000, '{' * 1_000_000, '\n' * 1_000_000,
    '{"u": "http://' + 'a' * 1_000_000 + ' "}', '{"u": "//' + '@' * 1_000_000 + '"}',
    '{"e": "' + 'a.' * 500_000 + '@x"}', '"' + '9' * 1_000_000 + '"',
])
def test_hostile_megabyte_answers_validate_fast(text):
  schema = json.dumps({'type': 'object', 'properties': {
      'u': {'format': 'uri'}, 'e': {'format': 'email'}}}, sort_keys=True)
  start = time.process_time()
  structured.work({'answer': text, 'schema': schema})
  assert time.process_time() - start < 1.0


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


# '^(a+)+$' on 34 a's and a '!': Python's backtracking re tries 2^34 splits (minutes).
REDOS = '^(a+)+$'
EVIL = 'a' * 34 + '!'


def test_redos_patterns_cost_the_worker_under_a_second_and_no_restart():
  keyed = {'type': 'object', 'patternProperties': {REDOS: {'type': 'integer'}},
           'additionalProperties': False}
  samples = [
      S('p', json.dumps(EVIL), {'schema': {'type': 'string', 'pattern': REDOS}}),
      S('p', json.dumps('a' * 34), {'schema': {'type': 'string', 'pattern': REDOS}}),
      S('p', json.dumps({EVIL: 1}), {'schema': keyed}),
      S('p', json.dumps({'a' * 34: 'x'}), {'schema': keyed}),
      S('p', json.dumps({'a' * 34: 1}), {'schema': keyed}),
      S('p', json.dumps({EVIL: 1}), {'schema': {'propertyNames': {'pattern': REDOS}}}),
  ]
  with verifiers.get('structured', workers=1, timeout_s=10) as v:
    v.score([S('p', '1', {'schema': True})])  # The worker up and warm.
    pid, = v._pool.pids
    cpu = sum(psutil.Process(pid).cpu_times()[:2])
    r = v.score(samples)
    spent = sum(psutil.Process(pid).cpu_times()[:2]) - cpu
    assert v._pool.pids == [pid] and v._pool.restarts == 0
  assert [x.reward for x in r] == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0], [x.info for x in r]
  assert f'does not match {REDOS!r}' in r[0].info['reason']
  assert 'Additional properties are not allowed' in r[2].info['reason']
  assert spent < 1.0


@pytest.mark.parametrize('schema, pattern', [
    ({'type': 'string', 'pattern': '(a)\\1'}, '(a)\\1'),                     # a backreference
    ({'properties': {'x': {'pattern': '(?=a)a'}}}, '(?=a)a'),               # lookahead
    ({'patternProperties': {'(?<!x)y': {}}}, '(?<!x)y'),                    # lookbehind key
    ({'prefixItems': [{'pattern': 'a{2000}'}]}, 'a{2000}'),                 # past RE2's limit
])
def test_a_pattern_re2_cannot_compile_is_refused_naming_it(schema, pattern):
  with pytest.raises(ValueError, match=(
      r'^x:1: metadata\["schema"\] is not a valid JSON Schema: pattern '
      + re.escape(repr(pattern)) + r' is not supported: RE2 \(linear-time matching')):
    verifiers.validate('structured', {'schema': schema}, 'x:1')


def test_unevaluated_properties_beside_pattern_properties_is_refused():
  # jsonschema computes unevaluatedProperties with Python's re on the keys, out of reach.
  with pytest.raises(ValueError, match='unevaluatedProperties beside patternProperties'):
    verifiers.validate('structured', {'schema': {
        'patternProperties': {'^a': {}}, 'unevaluatedProperties': False}}, 'x:1')
  # Draft 7 has no such keyword, and either alone is fine.
  for schema in ({'$schema': 'http://json-schema.org/draft-07/schema#',
                  'patternProperties': {'^a': {}}, 'unevaluatedProperties': False},
                 {'unevaluatedProperties': False, 'properties': {'patternProperties': {}}},
                 {'patternProperties': {'^a': {}}}):
    verifiers.validate('structured', {'schema': schema}, 'x:1')


@pytest.mark.parametrize('pattern, text, valid', [
    ('^[\\u0041-\\u005A]+$', 'ABC', True),      # ECMA-262's \uXXXX
    ('^[\\u0041-\\u005A]+$', 'abc', False),
    ('^\\\\u0041$', '\\u0041', True),           # an escaped backslash, then 'u0041'
    ('^a.$', 'a\ud800', True),                  # a lone surrogate reads as U+FFFD
    ('bad', 'bad\ud800', True),
    ('^\\d+$', '١٢', False),                    # \d is ASCII, as in ECMA-262
])
def test_patterns_match_as_ecma_262_reads_them(pattern, text, valid):
  out = structured.work({'answer': json.dumps(text),
                         'schema': json.dumps({'type': 'string', 'pattern': pattern})})
  assert out['reward'] == float(valid), out
