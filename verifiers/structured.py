"""Structured-output verifier: the answer's JSON, validated against a JSON Schema.

The JSON is the first fenced code block that parses as JSON, else the first
JSON object or array in the text that parses (scanning from each '{' or
'['), else the whole answer if it is a JSON scalar. A candidate that is
JSON but for a non-finite number, or that readers could take two ways, is
refused (reward 0), not skipped for a later candidate: NaN, Infinity and
-Infinity (not JSON, RFC 8259), a number too large for a double (`1e999`,
which Python reads as infinity) and an object with a repeated key (Python
keeps the last value, other readers the first). Validation uses `jsonschema` with the validator
class the schema's `$schema` names (Draft 2020-12 by default). Reward 1 if
valid, else 0.

Regular expressions run in linear time. A schema's `pattern` and
`patternProperties` meet the policy's strings and keys, and Python's
backtracking `re` spends minutes on '^(a+)+$' against 34 a's and a '!', so
they are matched by RE2 (`google-re2`: linear in the text; no backreferences
or lookaround; ECMA-262's \\uXXXX is read as RE2's \\x{XXXX}), never by
`re`: a schema with a pattern RE2 cannot compile is refused as malformed
metadata, naming the pattern, and so is one that gives
`unevaluatedProperties` beside `patternProperties` (jsonschema evaluates
that pair with `re` inside, out of reach). A string holding a lone surrogate
(JSON '\\ud800', not Unicode text) is matched with U+FFFD in its place.

`format` is asserted, not only annotated: the formats in CHECKED_FORMATS are
checked here (stdlib only, see each checker; optional jsonschema extras are
not relied on, so what is checked does not depend on what happens to be
installed). A schema naming a format that the JSON Schema drafts define but
this module does not check (UNCHECKED_FORMATS, e.g. 'iri') is refused as
malformed metadata, so such a field never pays anything that parses. Format
names outside the drafts ('int32', 'phone-number') are annotations, as the
specification says, and are not checked.

Metadata: {'schema': dict}.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import json
import math
import re
from typing import Any, Callable, Mapping

import re2

from verifiers import base
from verifiers import fences

# Fenced blocks and candidate start positions tried before giving up (bounds pathological
# text).
_MAX_STARTS = 200


class RefusedJson(ValueError):
  """JSON that parses but is refused: a non-finite number or a repeated object key."""


def _reject_constant(name: str):
  raise RefusedJson(f'{name} is not a JSON number')


def _finite_float(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):
    raise RefusedJson(f'number {text[:40]} does not fit a double (it reads as {value})')
  return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
  out = dict(pairs)
  if len(out) != len(pairs):
    seen = set()
    for key, _ in pairs:
      if key in seen:
        raise RefusedJson(f'key {key[:80]!r} appears twice in one object')
      seen.add(key)
  return out


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float,
                            object_pairs_hook=_unique_keys)


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

  Raises:
    RefusedJson: the first candidate that parses holds a non-finite number or
      a repeated key.
  """
  for _, body in fences.find(text)[:_MAX_STARTS]:
    try:
      return True, _loads(body), 'fenced block'
    except RefusedJson:
      raise
    except ValueError:
      continue
  starts = [m.start() for m in re.finditer(r'[{\[]', text)][:_MAX_STARTS]
  for start in starts:
    try:
      value, _ = _DECODER.raw_decode(text, start)
      return True, value, 'inline'
    except RefusedJson:
      raise
    except (ValueError, RecursionError):
      continue
  try:  # A bare scalar answer ('true', '3', '"x"').
    return True, _loads(text), 'whole answer'
  except RefusedJson:
    raise
  except ValueError:
    return False, None, 'none'


# -- formats -----------------------------------------------------------------

_DATE = re.compile(r'(\d{4})-(\d{2})-(\d{2})', re.ASCII)
# RFC 3339 full-time: hh:mm:ss[.frac](Z|+hh:mm|-hh:mm); second 60 is a leap second.
_TIME = re.compile(r'(?:[01]\d|2[0-3]):[0-5]\d:(?:[0-5]\d|60)(?:\.\d+)?'
                   r'(?:[zZ]|[+-](?:[01]\d|2[0-3]):[0-5]\d)', re.ASCII)
# RFC 3339 appendix A (ISO 8601 durations): units in order, each optional tail nested.
_DUR_TIME = r'T(?:\d+H(?:\d+M(?:\d+S)?)?|\d+M(?:\d+S)?|\d+S)'
_DURATION = re.compile(r'P(?:(?:\d+Y(?:\d+M(?:\d+D)?)?|\d+M(?:\d+D)?|\d+D)(?:' + _DUR_TIME
                       + r')?|' + _DUR_TIME + r'|\d+W)', re.ASCII)
_LABEL = re.compile(r'[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?', re.ASCII)
# RFC 5322's dot-atom local part (quoted local parts are refused).
_LOCAL = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*",
                    re.ASCII)
_UUID = re.compile(r'[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}')
_JSON_POINTER = re.compile(r'(?:/(?:[^~/]|~[01])*)*')
_RELATIVE_JSON_POINTER = re.compile(r'(?:0|[1-9]\d*)(?:#|(?:/(?:[^~/]|~[01])*)*)', re.ASCII)

# RFC 3986's grammar (appendix A). Every run is possessive (`*+`): the character that must
# follow a run is never one the run takes, so giving characters back could not match anything
# and would only cost time on a long invalid string.
_PCT = r'%[0-9A-Fa-f]{2}'
_UNRESERVED_SUB = r"A-Za-z0-9\-._~!$&'()*+,;="
_PCHAR = rf'(?:[{_UNRESERVED_SUB}:@]|{_PCT})'
_AUTHORITY = (rf'(?:(?:[{_UNRESERVED_SUB}:]|{_PCT})*+@)?'
              rf'(?:\[(?P<literal>[^\]/]*+)\]|(?:[{_UNRESERVED_SUB}]|{_PCT})*+)(?::\d*+)?')
_TAIL = rf'(?:\?(?:{_PCHAR}|[/?])*+)?(?:#(?:{_PCHAR}|[/?])*+)?'
_ABSOLUTE_PATHS = rf'//{_AUTHORITY}(?:/{_PCHAR}*+)*+|/(?:{_PCHAR}++(?:/{_PCHAR}*+)*+)?'
_URI = re.compile(rf'[A-Za-z][A-Za-z0-9+.\-]*+:(?:{_ABSOLUTE_PATHS}|{_PCHAR}++(?:/{_PCHAR}*+)*+)?'
                  + _TAIL)
_RELATIVE_REF = re.compile(
    rf'(?:{_ABSOLUTE_PATHS}|(?:[{_UNRESERVED_SUB}@]|{_PCT})++(?:/{_PCHAR}*+)*+)?' + _TAIL)
_IP_FUTURE = re.compile(rf'v[0-9A-Fa-f]+\.[{_UNRESERVED_SUB}:]+')


def _is_date(value: str) -> bool:
  m = _DATE.fullmatch(value)
  if not m:
    return False
  try:
    datetime.date(*map(int, m.groups()))
  except ValueError:
    return False
  return True


def _is_time(value: str) -> bool:
  return _TIME.fullmatch(value) is not None


def _is_date_time(value: str) -> bool:
  date, sep, time = value[:10], value[10:11], value[11:]
  return sep in ('T', 't') and _is_date(date) and _is_time(time)


def _is_hostname(value: str) -> bool:
  # RFC 1123: dot-separated labels of letters, digits and inner hyphens, 253 characters at most.
  name = value[:-1] if value.endswith('.') else value
  return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split('.'))


def _is_email(value: str) -> bool:
  local, at, domain = value.rpartition('@')
  return (bool(at) and len(local) <= 64 and len(value) <= 254 and
          _LOCAL.fullmatch(local) is not None and _is_hostname(domain))


def _is_ip(cls) -> Callable[[str], bool]:
  def check(value: str) -> bool:
    try:
      cls(value)
    except ValueError:
      return False
    return '%' not in value  # A scope id ('fe80::1%eth0') is not part of RFC 4291's text form.
  return check


def _literal_ok(m: re.Match) -> bool:
  literal = m.group('literal')
  return literal is None or _IP_FUTURE.fullmatch(literal) is not None or _is_ip(
      ipaddress.IPv6Address)(literal)


def _is_uri(value: str) -> bool:
  m = _URI.fullmatch(value)
  return m is not None and _literal_ok(m)


def _is_uri_reference(value: str) -> bool:
  m = _URI.fullmatch(value) or _RELATIVE_REF.fullmatch(value)
  return m is not None and _literal_ok(m)


def _is_regex(value: str) -> bool:
  try:
    re.compile(value)
  except (re.error, RecursionError, OverflowError):
    return False
  return True


# format -> check of a string instance (other types pass, as the specification says).
CHECKED_FORMATS: dict[str, Callable[[str], bool]] = {
    'date': _is_date,
    'time': _is_time,
    'date-time': _is_date_time,
    'duration': lambda v: _DURATION.fullmatch(v) is not None,
    'email': _is_email,
    'hostname': _is_hostname,
    'ipv4': _is_ip(ipaddress.IPv4Address),
    'ipv6': _is_ip(ipaddress.IPv6Address),
    'uri': _is_uri,
    'uri-reference': _is_uri_reference,
    'uuid': lambda v: _UUID.fullmatch(v) is not None,
    'regex': _is_regex,  # Python's dialect, close to ECMA-262's for ordinary patterns.
    'json-pointer': lambda v: _JSON_POINTER.fullmatch(v) is not None,
    'relative-json-pointer': lambda v: _RELATIVE_JSON_POINTER.fullmatch(v) is not None,
}
# Formats the drafts (3 to 2020-12) define that are not checked: a schema naming one is refused.
UNCHECKED_FORMATS = frozenset((
    'idn-email', 'idn-hostname', 'iri', 'iri-reference', 'uri-template', 'color', 'host-name',
    'ip-address', 'utc-millisec', 'style', 'phone'))
# Keywords whose values are data, not subschemas: a 'format' key inside them is not a keyword.
_DATA_KEYWORDS = frozenset(('const', 'enum', 'default', 'examples'))


def formats_in(schema: Any) -> set[str]:
  """The format names a schema asserts (its 'format' keywords, in any subschema).

  Args:
    schema: a JSON Schema (dict or bool).

  Returns:
    The set of format names.
  """
  out, stack = set(), [schema]
  while stack:
    node = stack.pop()
    if isinstance(node, dict):
      for key, value in node.items():
        if key == 'format' and isinstance(value, str):
          out.add(value)
        elif key not in _DATA_KEYWORDS:
          stack.append(value)
    elif isinstance(node, list):
      stack.extend(node)
  return out


# -- patterns ----------------------------------------------------------------

# Keywords whose values map names (not patterns) to subschemas.
_SUBSCHEMA_MAPS = frozenset(('properties', '$defs', 'definitions', 'dependentSchemas',
                             'dependencies'))


def regexes_in(schema: Any) -> tuple[set[str], set[str], bool]:
  """The regular expressions a schema matches against instances.

  Args:
    schema: a JSON Schema (dict or bool).

  Returns:
    ({its 'pattern' values}, {its 'patternProperties' keys}, whether any subschema has an
    'unevaluatedProperties' keyword).
  """
  patterns, keys, unevaluated, stack = set(), set(), False, [schema]
  while stack:
    node = stack.pop()
    if isinstance(node, list):
      stack.extend(node)
      continue
    if not isinstance(node, dict):
      continue
    for key, value in node.items():
      if key in _DATA_KEYWORDS:
        continue
      if key == 'pattern' and isinstance(value, str):
        patterns.add(value)
      elif (key in _SUBSCHEMA_MAPS or key == 'patternProperties') and isinstance(value, dict):
        if key == 'patternProperties':
          keys.update(value)
        stack.extend(value.values())
      else:
        unevaluated = unevaluated or key == 'unevaluatedProperties'
        stack.append(value)
  return patterns, keys, unevaluated


# ECMA-262 (JSON Schema's dialect) writes a code point as \uXXXX, RE2 as \x{XXXX}; an escaped
# backslash is taken whole, so that \\u0041 stays a backslash and 'u0041'.
_ECMA_CODE_POINT = re.compile(r'\\\\|\\u([0-9A-Fa-f]{4})')


@functools.lru_cache(maxsize=4096)
def _re2(pattern: str):
  """`pattern` (ECMA-262's \\uXXXX allowed) compiled by RE2; raises re2.error where RE2 cannot
  compile it."""
  options = re2.Options()
  options.log_errors = False  # The refusal says why; no line on stderr per bad schema.
  pattern = _ECMA_CODE_POINT.sub(lambda m: f'\\x{{{m[1]}}}' if m[1] else m[0], pattern)
  return re2.compile(pattern, options=options)


def _re2_error(pattern: str) -> str:
  """'' if RE2 compiles `pattern`, else why not."""
  try:
    _re2(pattern)
  except re2.error as e:
    why = e.args[0] if e.args else ''
    return why.decode('utf-8', 'replace') if isinstance(why, bytes) else str(why)
  return ''


_SURROGATE = re.compile('[\ud800-\udfff]')


def _search(pattern: str, text: str) -> bool:
  """Whether RE2 finds `pattern` in `text` (linear in the text)."""
  try:
    return _re2(pattern).search(text) is not None
  except UnicodeEncodeError:  # A lone surrogate: read as U+FFFD, as a UTF-8 reader would.
    return _re2(pattern).search(_SURROGATE.sub('\ufffd', text)) is not None


def _pattern(validator, pattern, instance, schema):
  del schema
  if validator.is_type(instance, 'string') and not _search(pattern, instance):
    import jsonschema  # pylint: disable=g-import-not-at-top
    yield jsonschema.ValidationError(f'{instance[:80]!r} does not match {pattern!r}')


def _pattern_properties(validator, pattern_properties, instance, schema):
  del schema
  if not validator.is_type(instance, 'object'):
    return
  for pattern, subschema in pattern_properties.items():
    for key, value in instance.items():
      if _search(pattern, key):
        yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator, additional, instance, schema):
  if not validator.is_type(instance, 'object'):
    return
  properties = schema.get('properties', {})
  patterns = list(schema.get('patternProperties', {}))
  extras = [k for k in instance
            if k not in properties and not any(_search(p, k) for p in patterns)]
  if validator.is_type(additional, 'object'):
    for key in extras:
      yield from validator.descend(instance[key], additional, path=key)
  elif not additional and extras:
    import jsonschema  # pylint: disable=g-import-not-at-top
    named = ', '.join(repr(k[:80]) for k in extras[:5]) + (', ...' if len(extras) > 5 else '')
    yield jsonschema.ValidationError(f'Additional properties are not allowed ({named} '
                                     f'{"was" if len(extras) == 1 else "were"} unexpected)')


# The keywords that match patterns, in RE2.
_RE2_KEYWORDS = {'pattern': _pattern, 'patternProperties': _pattern_properties,
                 'additionalProperties': _additional_properties}


@functools.lru_cache(maxsize=None)
def _linear_validator_class(cls):
  """`cls` (a jsonschema validator class) with its pattern-matching keywords in RE2."""
  import jsonschema  # pylint: disable=g-import-not-at-top
  return jsonschema.validators.extend(
      cls, {k: f for k, f in _RE2_KEYWORDS.items() if k in cls.VALIDATORS})


@functools.lru_cache(maxsize=1)
def format_checker():
  """A jsonschema FormatChecker holding exactly CHECKED_FORMATS."""
  import jsonschema  # pylint: disable=g-import-not-at-top
  checker = jsonschema.FormatChecker(formats=())
  for name, check in CHECKED_FORMATS.items():
    checker.checks(name)(lambda v, check=check: not isinstance(v, str) or check(v))
  return checker


def work(payload: dict) -> dict:
  """Worker side: extract and validate one answer."""
  try:
    found, value, where = extract_json(payload['answer'])
  except RefusedJson as e:
    return {'reward': 0.0, 'info': {'reason': f'refused JSON: {e}'}}
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
  """'' for a valid JSON Schema (given as JSON text) whose formats are all checked or
  unknown to the drafts, else why not (cached: a stage reuses few schemas)."""
  import jsonschema  # pylint: disable=g-import-not-at-top
  schema = json.loads(schema_json)
  try:
    jsonschema.validators.validator_for(schema).check_schema(schema)
  except jsonschema.SchemaError as e:
    return e.message
  unchecked = sorted(formats_in(schema) & UNCHECKED_FORMATS)
  if unchecked:
    return (f'format {", ".join(unchecked)} is not checked by this verifier (checked: '
            f'{", ".join(CHECKED_FORMATS)})')
  patterns, keys, unevaluated = regexes_in(schema)
  for pattern in sorted(patterns | keys):
    why = _re2_error(pattern)
    if why:
      return (f'pattern {pattern[:200]!r} is not supported: RE2 (linear-time matching; no '
              f'backreferences or lookaround) cannot compile it ({why})')
  cls = jsonschema.validators.validator_for(schema)
  if keys and unevaluated and 'unevaluatedProperties' in cls.VALIDATORS:
    return ('unevaluatedProperties beside patternProperties is not supported (jsonschema '
            "would match those patterns with Python's backtracking re)")
  return ''


@functools.lru_cache(maxsize=1024)
def validator(schema_json: str):
  """A validator asserting formats for a JSON Schema given as JSON text (cached; the schema is
  assumed valid: see `schema_error`)."""
  import jsonschema  # pylint: disable=g-import-not-at-top
  schema = json.loads(schema_json)
  cls = _linear_validator_class(jsonschema.validators.validator_for(schema))
  return cls(schema, format_checker=format_checker())


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
