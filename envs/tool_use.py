"""Tool-use environment: calculator, table lookup and sandboxed Python; a verifier scores answers.

    env = envs.get('tool_use', workers=2, verifier_options={'workers': 2})
    episodes = env.reset(records)
    steps = env.step(episodes, ['<tool_call>\\n{"name": "lookup", "arguments": '
                                '{"key": "lamp"}}\\n</tool_call>'] * len(records))
    steps = env.step(episodes, ['The answer is 412.'] * len(records))
    env.close()

Tools (`tools(record)` gives their schemas):
  calculator(expression): exact arithmetic on integers and decimals with
      + - * / // % ** and parentheses, evaluated on the host by walking
      Python's `ast` (never `eval`). Values are Fractions, so 0.1 + 0.2 is
      0.3 and 1 / 3 * 3 is 1; a whole result prints as an integer, any other
      rounded to DECIMAL_PLACES. Bounds on the expression's length, the
      exponent and the size of every intermediate value keep a hostile
      expression from hanging the host or exhausting its memory.
  lookup(key[, column]): the record's `metadata['table']` entry for `key`
      (case and surrounding spaces ignored). The table is not in the prompt:
      the model has to ask. `column` is offered only when the table has rows
      of columns; a row asked for without one comes back as JSON.
  python(code): runs `code` as a script in the bubblewrap sandbox
      (`verifiers.sandbox`, the server's 'run' mode) and returns the tail of
      its stdout; a failure (exception, timeout, limit) returns its status
      and the tail of its stderr as an error. Each call is a fresh process in
      a new work dir the sandbox makes for it, so nothing persists between
      calls or episodes: no file, no metadata (extended attributes, ACLs,
      times), no lock, socket or timer (see `verifiers.sandbox.server`). The
      sandbox starts on the first python call and stops at `close`.

Record metadata:
  answer: the gold final answer, for the answer verifier (required).
  table: {key: value} or {key: {column: value}}, values str or numbers
      (optional; needed by lookup).
  tools: names of the tools the record offers (optional; default all whose
      prerequisites exist: calculator, lookup when there is a table, python).

The final answer (an assistant turn without tool calls) is scored by the
verifier named by `answer_verifier` (default 'math', whose metadata is
{'answer': ...}) with the record's metadata; an episode cut short scores 0.
"""

from __future__ import annotations

import ast
import fractions
import re
from typing import Any, Mapping, Sequence

import verifiers
from envs import base
from verifiers import base as verifiers_base
from verifiers import sandbox as sandbox_lib

TOOL_NAMES = ('calculator', 'lookup', 'python')
# Calculator bounds: characters of an expression, the absolute value of an
# exponent, and bits of the numerator and denominator of every value. A
# product of two values within the bound costs microseconds, so an
# expression of at most MAX_EXPRESSION_CHARS characters is evaluated in
# milliseconds whatever it holds.
MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 10_000
MAX_BITS = 4096
DECIMAL_PLACES = 6
# Only these characters can form a calculator expression: no names, no
# scientific notation (1e999999999 would be a huge Fraction), no underscores.
_EXPRESSION_CHARS = re.compile(r'[0-9.+\-*/%() \t]*')
_BINARY_OPS = {ast.Add: '+', ast.Sub: '-', ast.Mult: '*', ast.Div: '/', ast.FloorDiv: '//',
               ast.Mod: '%', ast.Pow: '**'}
_UNARY_OPS = {ast.UAdd: '+', ast.USub: '-'}
# Bytes of a python call's stdout shown (its tail); with the note of a cut it
# stays under base.MAX_OBSERVATION_CHARS.
_PYTHON_OUTPUT_BYTES = 3000
_PYTHON_ERROR_CHARS = 1500


# -- calculator ----------------------------------------------------------------


def _checked(value: fractions.Fraction) -> fractions.Fraction:
  """`value` if its numerator and denominator fit in MAX_BITS bits, else a ToolError."""
  if value.numerator.bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
    raise base.ToolError(f'result too large (more than {MAX_BITS} bits)')
  return value


def _power(left: fractions.Fraction, right: fractions.Fraction) -> fractions.Fraction:
  """left ** right for an integer exponent whose result fits the bounds (checked beforehand)."""
  if right.denominator != 1:
    raise base.ToolError('unsupported: a non-integer exponent (the result would not be exact)')
  exponent = right.numerator
  if abs(exponent) > MAX_EXPONENT:
    raise base.ToolError(f'exponent too large (more than {MAX_EXPONENT})')
  # n ** e has at most e * bits(n) bits; 0 and +-1 stay small whatever the exponent.
  bits = max(abs(left.numerator).bit_length() if abs(left.numerator) > 1 else 0,
             left.denominator.bit_length() if left.denominator > 1 else 0)
  if bits * abs(exponent) > MAX_BITS:
    raise base.ToolError(f'result too large (more than {MAX_BITS} bits)')
  return left ** exponent


def _binary(op: ast.operator, left: fractions.Fraction,
            right: fractions.Fraction) -> fractions.Fraction:
  try:
    if isinstance(op, ast.Pow):
      return _checked(_power(left, right))
    if isinstance(op, ast.Add):
      return _checked(left + right)
    if isinstance(op, ast.Sub):
      return _checked(left - right)
    if isinstance(op, ast.Mult):
      return _checked(left * right)
    if isinstance(op, ast.Div):
      return _checked(left / right)
    if isinstance(op, ast.FloorDiv):
      return _checked(fractions.Fraction(left // right))
    return _checked(left % right)
  except ZeroDivisionError:
    raise base.ToolError('division by zero') from None


def _literal(node: ast.Constant, expression: str) -> fractions.Fraction:
  """A number literal, exactly: read from its source text (0.1 is 1/10, not a float)."""
  if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
    raise base.ToolError(f'unsupported syntax: {node.value!r}')
  # One line of ASCII (checked before parsing), so offsets index the string.
  return _checked(fractions.Fraction(expression[node.col_offset:node.end_col_offset]))


def evaluate(expression: str) -> fractions.Fraction:
  """The exact value of a calculator expression.

  Args:
    expression: numbers (integers, decimals), + - * / // % **, parentheses.

  Returns:
    The value.

  Raises:
    base.ToolError: an expression that is too long, not arithmetic, divides
      by zero, or whose value (or an intermediate one) is past the bounds.
  """
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise base.ToolError(f'expression longer than {MAX_EXPRESSION_CHARS} characters')
  if not expression.strip():
    raise base.ToolError('empty expression')
  if _EXPRESSION_CHARS.fullmatch(expression) is None:
    char = next(c for c in expression if not _EXPRESSION_CHARS.fullmatch(c))
    raise base.ToolError(f'unsupported syntax: character {char!r}; use numbers, '
                         '+ - * / // % ** and parentheses')
  expression = expression.strip(' \t')
  try:
    tree = ast.parse(expression, mode='eval')
  except SyntaxError as e:
    raise base.ToolError(f'unsupported syntax: {e.msg}') from None
  except (ValueError, RecursionError, MemoryError):
    raise base.ToolError('unsupported syntax: expression too complex') from None
  for node in ast.walk(tree.body):  # Iterative: no recursion on deep trees.
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
      continue
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
      continue
    if isinstance(node, (ast.Constant, ast.operator, ast.unaryop)):
      continue
    raise base.ToolError(f'unsupported syntax: {type(node).__name__}')
  # Post-order with an explicit stack: a 1000-term sum is as safe as a short one.
  stack: list[tuple[ast.expr, bool]] = [(tree.body, False)]
  values: list[fractions.Fraction] = []
  while stack:
    node, ready = stack.pop()
    if isinstance(node, ast.Constant):
      values.append(_literal(node, expression))
    elif not ready:
      stack.append((node, True))
      if isinstance(node, ast.BinOp):
        stack.append((node.right, False))
        stack.append((node.left, False))
      else:
        stack.append((node.operand, False))
    elif isinstance(node, ast.BinOp):
      right = values.pop()
      values.append(_binary(node.op, values.pop(), right))
    else:
      values.append(-values.pop() if isinstance(node.op, ast.USub) else values.pop())
  return values[0]


def format_number(value: fractions.Fraction) -> str:
  """An integer when whole, else a decimal rounded (half away from zero) to DECIMAL_PLACES."""
  if value.denominator == 1:
    return str(value.numerator)
  scale = 10 ** DECIMAL_PLACES
  units, rest = divmod(abs(value.numerator) * scale, value.denominator)
  if 2 * rest >= value.denominator:
    units += 1
  whole, frac = divmod(units, scale)
  digits = str(frac).rjust(DECIMAL_PLACES, '0').rstrip('0')
  text = f'{whole}.{digits}' if digits else str(whole)
  return f'-{text}' if value < 0 and units else text


def calculate(expression: str) -> str:
  """The calculator tool: `format_number(evaluate(expression))`; ToolError as `evaluate`."""
  return format_number(evaluate(expression))


# -- lookup --------------------------------------------------------------------


def _scalar(value: Any) -> bool:
  return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def lookup(table: Mapping[str, Any], key: str, column: str | None = None) -> str:
  """The lookup tool: the entry of `key` (case and surrounding spaces ignored).

  Args:
    table: {key: value} or {key: {column: value}}.
    key: the entry to look up.
    column: the column of a row entry (None: the whole row, as JSON).

  Returns:
    The value as text.

  Raises:
    base.ToolError: no such entry or column (the message names only what was asked).
  """
  wanted = key.strip().casefold()
  found = next((k for k in table if k.strip().casefold() == wanted), None)
  if found is None:
    raise base.ToolError(f'no entry {key!r}')
  value = table[found]
  if column is None:
    return str(value) if _scalar(value) else base.dumps(value)
  if _scalar(value):
    raise base.ToolError(f'entry {key!r} has no columns')
  wanted = column.strip().casefold()
  col = next((c for c in value if c.strip().casefold() == wanted), None)
  if col is None:
    raise base.ToolError(f'no column {column!r} in entry {key!r}')
  return str(value[col])


def _has_columns(table: Mapping[str, Any]) -> bool:
  return any(isinstance(v, Mapping) for v in table.values())


# -- the environment -----------------------------------------------------------


def _schema(name: str, table: Mapping[str, Any] | None) -> dict:
  if name == 'calculator':
    return base.function_schema(
        'calculator', 'Exact arithmetic: numbers, + - * / // % ** and parentheses.',
        {'expression': {'type': 'string', 'description': 'e.g. "(12 + 3.5) * 4"'}},
        ['expression'])
  if name == 'lookup':
    props = {'key': {'type': 'string', 'description': 'the entry to look up'}}
    if table is not None and _has_columns(table):
      props['column'] = {'type': 'string', 'description': 'the column to read'}
    return base.function_schema('lookup', 'Looks up an entry in the table.', props, ['key'])
  return base.function_schema('python', 'Runs Python code and returns what it prints.',
                              {'code': {'type': 'string', 'description': 'a Python script'}},
                              ['code'])


def _tool_names(metadata: Mapping[str, Any]) -> list[str]:
  names = metadata.get('tools')
  if names is not None:
    return list(names)
  return [n for n in TOOL_NAMES if n != 'lookup' or metadata.get('table') is not None]


class ToolUseEnv(base.Environment):
  """Calculator, lookup and python tools; the final answer is scored by a verifier."""

  name = 'tool_use'

  def __init__(self, *, answer_verifier: str = 'math',
               verifier_options: Mapping[str, Any] | None = None, workers: int | None = None,
               timeout_s: float = 10.0, isolation: str = 'bwrap', bwrap: str = 'bwrap',
               memory_mb: int = 1024, nproc: int = 16, fsize_mb: int = 64, tmpfs_mb: int = 256,
               **common: Any):
    """Builds the answer verifier; the python sandbox starts on the first python call.

    Args:
      answer_verifier: the registered verifier that scores final answers.
      verifier_options: its keyword options (e.g. workers, timeout_s).
      workers: python sandbox servers, i.e. python calls run in parallel
        (default min(2, cpu count)).
      timeout_s: wall-clock limit of one python call, in seconds.
      isolation: 'bwrap' (the first python call raises when bubblewrap is
        unusable) or 'none' (no isolation: trusted code only; see
        `verifiers.sandbox`).
      bwrap: the bubblewrap binary.
      memory_mb: memory of a python call (per process; in total with a cgroup).
      nproc: processes and threads of a python call.
      fsize_mb: largest file (and stdout) a python call may write.
      tmpfs_mb: size of each sandbox server's private /tmp.
      **common: `base.Environment` options (max_calls_per_turn).

    Raises:
      ValueError: an option out of range or an unknown verifier or isolation.
    """
    super().__init__(**common)
    if isolation not in sandbox_lib.ISOLATIONS:
      raise ValueError(f'{self.name}: isolation must be one of {sandbox_lib.ISOLATIONS}, '
                       f'got {isolation!r}')
    workers, self.timeout_s = verifiers_base.pool_options(self.name, workers, timeout_s)
    self._sandbox_options = dict(workers=workers,
                                 isolation=isolation, bwrap=bwrap, memory_mb=memory_mb, nproc=nproc,
                                 fsize_mb=fsize_mb, tmpfs_mb=tmpfs_mb)
    self._sandbox: sandbox_lib.Sandbox | None = None
    self.verifier = verifiers.get(answer_verifier, **dict(verifier_options or {}))

  @property
  def isolation(self) -> str:
    """The isolation its python calls run under: 'bwrap' or 'none'."""
    return self._sandbox_options['isolation']

  @property
  def sandbox(self) -> sandbox_lib.Sandbox | None:
    """The python sandbox, None until the first python call."""
    return self._sandbox

  def tools(self, record: Mapping[str, Any]) -> list[dict]:
    """The schemas of the tools `record` offers (see the module docstring)."""
    metadata = record.get('metadata') or {}
    return [_schema(n, metadata.get('table')) for n in _tool_names(metadata)]

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any]) -> None:
    super()._check_metadata(metadata)
    if 'answer' not in metadata:
      raise ValueError('metadata["answer"] is missing (the gold final answer)')
    answer = metadata['answer']
    if not _scalar(answer) or isinstance(answer, str) and not answer.strip():
      raise ValueError(f'metadata["answer"] must be a non-empty str or a number, got '
                       f'{answer!r:.80}')
    table = metadata.get('table')
    if table is not None:
      _check_table(table)
    names = metadata.get('tools')
    if names is not None:
      if not isinstance(names, list) or not names:
        raise ValueError(f'metadata["tools"] must be a non-empty list of tool names, got '
                         f'{names!r:.80}')
      for k, n in enumerate(names):
        if n not in TOOL_NAMES:
          raise ValueError(f'metadata["tools"][{k}]: unknown tool {n!r}; known: '
                           f'{", ".join(TOOL_NAMES)}')
      if len(set(names)) != len(names):
        raise ValueError(f'metadata["tools"] names a tool twice: {names}')
      if 'lookup' in names and table is None:
        raise ValueError('metadata["tools"] offers lookup but metadata["table"] is missing')

  def _execute(self, calls: Sequence[base.Call]) -> list[str | base.ToolError]:
    out: list[str | base.ToolError | None] = [None] * len(calls)
    python = []
    for k, c in enumerate(calls):
      args = c.call.arguments
      try:
        if c.call.name == 'calculator':
          out[k] = calculate(args['expression'])
        elif c.call.name == 'lookup':
          out[k] = lookup(c.episode.record['metadata']['table'], args['key'], args.get('column'))
        else:
          python.append(k)
      except base.ToolError as e:
        out[k] = e
    if python:
      requests = [{'mode': 'run', 'program': calls[k].call.arguments['code'],
                   'output_bytes': _PYTHON_OUTPUT_BYTES} for k in python]
      answers = self._get_sandbox().run(requests, [self.timeout_s] * len(requests))
      for k, answer in zip(python, answers):
        out[k] = _python_result(answer)
    return out

  def _get_sandbox(self) -> sandbox_lib.Sandbox:
    if self._sandbox is None:
      options = dict(self._sandbox_options)
      self._sandbox = sandbox_lib.Sandbox(options.pop('workers'), **options)
    return self._sandbox

  def _score(self, episodes: Sequence[base.Episode],
             answers: Sequence[str | None]) -> list[tuple]:
    out: list[tuple | None] = [None] * len(episodes)
    jobs, samples = [], []
    for k, (ep, answer) in enumerate(zip(episodes, answers)):
      if answer is None:
        out[k] = (0.0, {'reason': 'no final answer'})
      else:
        jobs.append(k)
        samples.append(verifiers.Sample(prompt='', completion=answer,
                                        metadata=ep.record['metadata']))
    if samples:
      for k, result in zip(jobs, self.verifier.score(samples)):
        out[k] = (result.reward, dict(result.info))
    return out

  def close(self) -> None:
    """Stops the python sandbox and the answer verifier's workers."""
    if self._sandbox is not None:
      self._sandbox.close()
      self._sandbox = None
    self.verifier.close()


def _check_table(table: Any) -> None:
  """Raises ValueError naming the entry when `table` is not {key: scalar | {column: scalar}}."""
  if not isinstance(table, Mapping) or not table:
    raise ValueError(f'metadata["table"] must be a non-empty dict, got {table!r:.80}')
  for key, value in table.items():
    if not isinstance(key, str) or not key.strip():
      raise ValueError(f'metadata["table"]: key {key!r:.80} must be a non-empty string')
    if isinstance(value, Mapping):
      if not value:
        raise ValueError(f'metadata["table"][{key!r}] has no columns')
      for col, v in value.items():
        if not isinstance(col, str) or not col.strip():
          raise ValueError(f'metadata["table"][{key!r}]: column {col!r:.80} must be a non-empty '
                           'string')
        if not _scalar(v):
          raise ValueError(f'metadata["table"][{key!r}][{col!r}] must be a str or a number, '
                           f'got {type(v).__name__}')
    elif not _scalar(value):
      raise ValueError(f'metadata["table"][{key!r}] must be a str, a number or a dict of '
                       f'columns, got {type(value).__name__}')


def _python_result(answer: Mapping[str, Any]) -> str | base.ToolError:
  """A python call's observation from the sandbox server's 'run' answer."""
  if answer['status'] == 'sandbox_error':
    return base.ToolError(f'sandbox error: {str(answer.get("detail", ""))[-300:]}')
  stdout = str(answer.get('stdout', ''))
  cut = int(answer.get('stdout_bytes', 0)) - len(stdout.encode('utf-8', 'replace'))
  if cut > 0:
    stdout = f'[... first {cut} bytes of output cut]\n{stdout}'
  if answer['passed']:
    return stdout.rstrip() or '(no output)'
  text = f'{answer["status"]}: {str(answer.get("detail", ""))[-_PYTHON_ERROR_CHARS:]}'
  if stdout.strip():
    text += f'\nstdout:\n{stdout[-_PYTHON_ERROR_CHARS:]}'
  return base.ToolError(text)
