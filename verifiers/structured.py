"""Structured-output verifier: the answer's JSON, validated against a JSON Schema.

The JSON is the first fenced code block that parses as JSON, else the first
JSON object or array in the text that parses (scanning from each '{' or
'['), else the whole answer if it is a JSON scalar. NaN, Infinity and
-Infinity are not JSON (RFC 8259) and never parse. Validation uses `jsonschema` with the validator class the schema's
`$schema` names (Draft 2020-12 by default). Reward 1 if valid, else 0.

Metadata: {'schema': dict}.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Mapping

from verifiers import base

_FENCE = re.compile(r'```[^\n]*\n(.*?)```', re.DOTALL)
# Candidate start positions tried before giving up (bounds pathological text).
_MAX_STARTS = 200


def _reject_constant(name: str):
  raise ValueError(f'{name} is not a JSON number')


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _loads(text: str) -> Any:
  """Strict json.loads: no NaN/Infinity; nesting too deep for the decoder is a ValueError."""
  try:
    value, end = _DECODER.raw_decode(text, len(text) - len(text.lstrip()))
  except RecursionError:
    raise ValueError('JSON nested too deeply') from None
  if text[end:].strip():
    raise ValueError('extra data after the JSON value')
  return value


def extract_json(text: str) -> tuple[bool, Any, str]:
  """Finds the JSON value in an answer.

  Args:
    text: the answer.

  Returns:
    (found, value, where: 'fenced block', 'inline', 'whole answer' or 'none').
  """
  for m in _FENCE.finditer(text):
    try:
      return True, _loads(m.group(1)), 'fenced block'
    except ValueError:
      continue
  starts = [m.start() for m in re.finditer(r'[{\[]', text)][:_MAX_STARTS]
  for start in starts:
    try:
      value, _ = _DECODER.raw_decode(text, start)
      return True, value, 'inline'
    except (ValueError, RecursionError):
      continue
  try:  # A bare scalar answer ('true', '3', '"x"').
    return True, _loads(text), 'whole answer'
  except ValueError:
    return False, None, 'none'


def work(payload: dict) -> dict:
  """Worker side: extract and validate one answer."""
  found, value, where = extract_json(payload['answer'])
  if not found:
    return {'reward': 0.0, 'info': {'reason': 'no JSON value in the answer'}}
  error = next(iter(validator(payload['schema']).iter_errors(value)), None)
  if error is not None:
    path = '/'.join(str(p) for p in error.absolute_path) or '(root)'
    return {'reward': 0.0, 'info': {'reason': f'schema violation at {path}: {error.message[:300]}',
                                    'json_from': where}}
  return {'reward': 1.0, 'info': {'reason': 'valid', 'json_from': where}}


@functools.lru_cache(maxsize=1024)
def schema_error(schema_json: str) -> str:
  """'' for a valid JSON Schema (given as JSON text), else why not (cached: a stage reuses few
  schemas)."""
  import jsonschema  # pylint: disable=g-import-not-at-top
  schema = json.loads(schema_json)
  try:
    jsonschema.validators.validator_for(schema).check_schema(schema)
  except jsonschema.SchemaError as e:
    return e.message
  return ''


@functools.lru_cache(maxsize=1024)
def validator(schema_json: str):
  """A validator for a JSON Schema given as JSON text (cached; the schema is assumed valid:
  see `schema_error`)."""
  import jsonschema  # pylint: disable=g-import-not-at-top
  schema = json.loads(schema_json)
  return jsonschema.validators.validator_for(schema)(schema)


class StructuredVerifier(base.Verifier):
  """Reward 1 iff the answer contains JSON valid under metadata['schema']."""

  name = 'structured'
  worker_fn = 'verifiers.structured:work'

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any], **options: Any) -> None:
    schema = base.require(metadata, 'schema', (dict, bool), 'a JSON Schema')
    try:
      text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as e:
      raise ValueError(f'metadata["schema"] is not JSON-serialisable: {e}') from None
    error = schema_error(text)
    if error:
      raise ValueError(f'metadata["schema"] is not a valid JSON Schema: {error}')

  def _prepare(self, sample: base.Sample, answer: str) -> dict:
    return {'answer': answer, 'schema': json.dumps(sample.metadata['schema'], sort_keys=True)}
