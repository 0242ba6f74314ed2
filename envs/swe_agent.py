"""Agentic SWE: the policy fixes a small repository through file tools; a hidden test scores it.

    env = envs.get('swe_agent', workers=2)
    episodes = env.reset(records)    # each episode gets its own copy of metadata['repo']

Tools: `list_files`, `read_file`, `search`, `edit`, `apply_patch` and, when
the record has a visible test, `run_tests`. The repository lives on the host
as a dict (path -> text) per episode, copied in `_start`; tools read and
change only that dict, never the host's disk, so episodes cannot see each
other's files. Paths are normalised and confined to the repository by the
sandbox's own rule (`verifiers.sandbox.server.normalize_path`: absolute
paths, '..' as a component, control characters and over-long paths are tool
errors; '..notes.txt' is a file name), so every file the policy makes is
written into the sandbox as named; the repository's file count and size are
bounded: an edit that would pass the bounds fails. Every output is bounded.

`run_tests` and scoring execute code: the episode's current files are
written into the bubblewrap sandbox (`verifiers.sandbox`, 'check' mode as
`verifiers.swe`'s execution mode: the trusted test runs in a judge process
and imports the repository's modules from the candidate process; only the
top-level modules of the original repository, so a module the policy adds
cannot stand in for a standard-library one the test imports), one sandbox
request per call or ended episode, all of a batch in one `Sandbox.run`.
`run_tests` and scoring use two sandboxes that never share a server, so the
servers that run the policy's `run_tests` never hold a hidden test (nor do
the candidate processes of either: see `verifiers.sandbox.server`). Each
starts on first use; `close()` stops them.

Reward of an ended episode (final answer, whatever its text, or `finish`):
  * 0 when its files equal the original repository;
  * with metadata 'test': 1 iff that hidden test passes on its final files;
  * without 'test' but with 'gold_patch': the agentless lexical reward
    (`verifiers.swe.lexical_reward`) of the diff from the original files to
    the final ones.
Info: 'reason', 'tests' (the hidden test's status, or 'not run') and
'files_changed' (sorted paths).

Metadata: {'repo': {path: text}, 'test': str and/or 'gold_patch': str,
'visible_test': str (optional)}.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Sequence

from envs import base
from verifiers import base as verifiers_base
from verifiers import sandbox as sandbox_lib
from verifiers import swe
from verifiers import unidiff
from verifiers.sandbox import server as sandbox_server

# Bounds on one episode's repository and on what tools show.
MAX_PATH_CHARS = 200
MAX_FILES = 256
MAX_REPO_CHARS = 1_000_000
MAX_READ_LINES = 200
MAX_LINE_CHARS = 400
MAX_SEARCH_HITS = 50
MAX_LIST_FILES = 200
# Characters of a failing test's detail shown (its tail: the assertion is last).
MAX_TEST_DETAIL_CHARS = 600

_STR = {'type': 'string'}
_LINE = {'type': 'integer', 'minimum': 1}
TOOLS = {
    'list_files': base.function_schema(
        'list_files', 'List the repository files, optionally under a directory.',
        {'directory': _STR}),
    'read_file': base.function_schema(
        'read_file', 'Show a file with line numbers, optionally lines start_line to end_line.',
        {'path': _STR, 'start_line': _LINE, 'end_line': _LINE}, ['path']),
    'search': base.function_schema(
        'search', 'Find lines containing a text (not a regex): path:line: text.',
        {'pattern': {'type': 'string', 'minLength': 1, 'maxLength': 200}}, ['pattern']),
    'edit': base.function_schema(
        'edit', 'Replace the one occurrence of old with new in a file; old "" creates a file.',
        {'path': _STR, 'old': _STR, 'new': _STR}, ['path', 'old', 'new']),
    'apply_patch': base.function_schema(
        'apply_patch', 'Apply a unified diff to the repository.', {'patch': _STR}, ['patch']),
    'run_tests': base.function_schema('run_tests', 'Run the tests on the current files.', {}),
}


@dataclasses.dataclass
class Workspace:
  """One episode's repository.

  Attributes:
    original: the record's files (never changed).
    files: the episode's own copy, which the tools change.
    max_files, max_chars: the bounds an edit or patch may not take `files` past.
  """
  original: Mapping[str, str]
  files: dict[str, str]
  max_files: int = MAX_FILES
  max_chars: int = MAX_REPO_CHARS

  def changed(self) -> list[str]:
    """Sorted paths whose text differs from the original (created and deleted ones too)."""
    paths = set(self.original) | set(self.files)
    return sorted(p for p in paths if self.original.get(p) != self.files.get(p))


def normalize_path(path: str) -> str:
  """The repository path `path` names ('./a//b.py' -> 'a/b.py'), by the sandbox's own rule.

  `verifiers.sandbox.server.normalize_path` is the one rule: a path accepted
  here is written into the sandbox as it is named here ('..notes.txt' is a
  file name; '..' is never a component), plus this environment's bound on a
  path's length.

  Raises:
    base.ToolError: an empty, absolute, over-long or escaping path, or one
      with NUL or other control characters or that is not valid Unicode.
  """
  if len(path) > MAX_PATH_CHARS:
    raise base.ToolError(f'path longer than {MAX_PATH_CHARS} characters')
  try:
    return sandbox_server.normalize_path(path, 'the repository')
  except ValueError as e:
    raise base.ToolError(str(e)) from None


def check_tree(files: Mapping[str, str], max_files: int = MAX_FILES,
               max_chars: int = MAX_REPO_CHARS) -> None:
  """Checks a repository against the bounds; no path may be both a file and a directory.

  Raises:
    base.ToolError: says which bound or which path.
  """
  if len(files) > max_files:
    raise base.ToolError(f'the repository would hold {len(files)} files; at most {max_files}')
  size = sum(len(t) for t in files.values())
  if size > max_chars:
    raise base.ToolError(f'the repository would hold {size} characters; at most {max_chars}')
  for path in files:
    parts = path.split('/')
    for k in range(1, len(parts)):
      if '/'.join(parts[:k]) in files:
        raise base.ToolError(f'{"/".join(parts[:k])!r} is a file, so {path!r} cannot exist')


def check_text(text: str, what: str) -> None:
  """Raises base.ToolError when `text` cannot be written as UTF-8 (a lone surrogate from JSON)."""
  try:
    text.encode('utf-8')
  except UnicodeEncodeError as e:
    raise base.ToolError(f'{what} is not valid Unicode text ({e.reason} at {e.start})') from None


def _lines(text: str) -> list[str]:
  """A file's lines as `apply_patch` numbers them, less the empty one after a final newline."""
  lines = text.split('\n')
  if lines[-1] == '':
    lines.pop()
  return lines


def _clip(line: str) -> str:
  return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + ' [...]'


def _file(ws: Workspace, path: str) -> tuple[str, str]:
  norm = normalize_path(path)
  if norm not in ws.files:
    raise base.ToolError(f'no such file {norm!r}')
  return norm, ws.files[norm]


def list_files(ws: Workspace, directory: str = '') -> str:
  """The paths (under `directory`, if given), one per line."""
  paths = sorted(ws.files)
  if directory not in ('', '.', './'):
    prefix = normalize_path(directory) + '/'
    paths = [p for p in paths if p.startswith(prefix)]
    if not paths:
      raise base.ToolError(f'no files under {prefix[:-1]!r}')
  if not paths:
    return '(no files)'
  more = len(paths) - MAX_LIST_FILES
  return '\n'.join(paths[:MAX_LIST_FILES]) + (f'\n[... {more} more files]' if more > 0 else '')


def read_file(ws: Workspace, path: str, start_line: int = 1, end_line: int | None = None) -> str:
  """Lines start_line..end_line (at most MAX_READ_LINES) as 'number: text'."""
  path, text = _file(ws, path)
  lines = _lines(text)
  if not lines:
    return f'({path} is empty)'
  start = int(start_line)
  end = len(lines) if end_line is None else min(int(end_line), len(lines))
  if start > len(lines):
    raise base.ToolError(f'start_line {start} is past the end of {path} ({len(lines)} lines)')
  if end < start:
    raise base.ToolError(f'end_line {end_line} is before start_line {start}')
  shown = min(end, start + MAX_READ_LINES - 1)
  out = '\n'.join(f'{n}: {_clip(lines[n - 1])}' for n in range(start, shown + 1))
  if shown < end:
    out += f'\n[lines {start}-{shown} of {len(lines)}; read on with start_line={shown + 1}]'
  return out


def search(ws: Workspace, pattern: str) -> str:
  """Lines containing the literal `pattern`, as 'path:line: text' (at most MAX_SEARCH_HITS)."""
  hits, total = [], 0
  for path in sorted(ws.files):
    text = ws.files[path]
    if pattern not in text:
      continue
    for n, line in enumerate(_lines(text), 1):
      if pattern in line:
        total += 1
        if len(hits) < MAX_SEARCH_HITS:
          hits.append(f'{path}:{n}: {_clip(line)}')
  if not hits:
    return f'no line contains {pattern!r}'
  more = total - len(hits)
  return '\n'.join(hits) + (f'\n[... {more} more matches]' if more > 0 else '')


def edit(ws: Workspace, path: str, old: str, new: str) -> str:
  """Replaces the unique occurrence of `old` in a file; `old` '' creates a file that is absent."""
  norm = normalize_path(path)
  check_text(new, 'new')
  files = dict(ws.files)
  if norm not in files:
    if old:
      raise base.ToolError(f'no such file {norm!r} (to create it, give old as "")')
    files[norm] = new
    verb = 'created'
  else:
    if not old:
      raise base.ToolError(f'{norm!r} exists: old must be the text to replace')
    if old == new:
      raise base.ToolError('old and new are the same text')
    text = files[norm]
    at = text.find(old)
    if at < 0:
      raise base.ToolError(f'old text not found in {norm!r}')
    again = text.find(old, at + 1)
    if again >= 0:
      raise base.ToolError(f'old text occurs more than once in {norm!r} (at lines '
                           f'{text.count(chr(10), 0, at) + 1} and '
                           f'{text.count(chr(10), 0, again) + 1}); include more of it')
    files[norm] = text[:at] + new + text[at + len(old):]
    verb = 'edited'
  check_tree(files, ws.max_files, ws.max_chars)
  ws.files = files
  return f'{verb} {norm}'


def apply_patch(ws: Workspace, patch: str) -> str:
  """Applies a unified diff (`verifiers.unidiff`; its paths confined like every path)."""
  check_text(patch, 'the patch')
  try:
    parsed = unidiff.parse(unidiff.extract(patch))
  except ValueError as e:
    raise base.ToolError(f'unparsable patch: {e}') from None
  confined = []
  for fp in parsed:
    old, new = (p if p == unidiff.DEV_NULL else normalize_path(p) for p in (fp.old_path,
                                                                             fp.new_path))
    if old == unidiff.DEV_NULL and new in ws.files:
      raise base.ToolError(f'the patch creates {new!r}, which exists')
    confined.append(dataclasses.replace(fp, old_path=old, new_path=new))
  try:
    files = unidiff.apply(confined, ws.files)
  except ValueError as e:
    raise base.ToolError(f'patch does not apply: {e}') from None
  check_tree(files, ws.max_files, ws.max_chars)
  changed = sorted(p for p in set(files) | set(ws.files) if files.get(p) != ws.files.get(p))
  ws.files = files
  return f'patched {", ".join(changed)}' if changed else 'the patch changes nothing'


_TOOL_FNS = {'list_files': list_files, 'read_file': read_file, 'search': search, 'edit': edit,
             'apply_patch': apply_patch}


def diff(original: Mapping[str, str], files: Mapping[str, str]) -> str:
  """The unified diff from `original` to `files`, as `verifiers.unidiff` parses and applies it.

  With context lines: `unidiff.apply` places a hunk by its context, and a
  context-free pure insertion ('@@ -3,0 +4 @@') lands a line too early there.
  """
  out = []
  for path in sorted(set(original) | set(files)):
    before, after = original.get(path), files.get(path)
    if before == after:
      continue
    # Lines as `unidiff.apply` splits them; an absent file is one empty line there.
    out.extend(difflib.unified_diff(
        (before or '').split('\n'), (after or '').split('\n'),
        fromfile=unidiff.DEV_NULL if before is None else f'a/{path}',
        tofile=unidiff.DEV_NULL if after is None else f'b/{path}', lineterm=''))
  return '\n'.join(out) + '\n' if out else ''


class SweAgentEnv(base.Environment):
  """See the module docstring."""

  name = 'swe_agent'

  def __init__(self, *, isolation: str = 'bwrap', workers: int | None = None,
               timeout_s: float = 10.0, memory_mb: int = 1024, max_calls_per_turn: int = 4,
               max_files: int = MAX_FILES, max_repo_chars: int = MAX_REPO_CHARS):
    """Options.

    Args:
      isolation: the sandbox's: 'bwrap' (refuses to start without a working
        bubblewrap) or 'none' (trusted code only; see `verifiers.sandbox`).
      workers: sandbox servers, i.e. test runs in parallel (default
        min(2, cpu count)).
      timeout_s: wall-clock seconds of one test run.
      memory_mb: memory of one test run.
      max_calls_per_turn: see `envs.base.Environment`.
      max_files, max_repo_chars: the bounds of an episode's repository (edits and patches
        may not pass them). Records are checked at load time (`validate_metadata`, a class
        method) against the defaults, which training's task repositories keep; a caller that
        builds its own records on larger repositories (the SWE-bench Verified agentic suite,
        `cascade.suites.swe_bench`) raises them.
    """
    super().__init__(max_calls_per_turn=max_calls_per_turn)
    if isolation not in sandbox_lib.ISOLATIONS:
      raise ValueError(f'{self.name}: isolation must be one of {sandbox_lib.ISOLATIONS}, '
                       f'got {isolation!r}')
    workers, timeout_s = verifiers_base.pool_options(self.name, workers, timeout_s)
    if memory_mb < 64:
      raise ValueError(f'{self.name}: memory_mb must be >= 64, got {memory_mb}')
    self.isolation = isolation
    self.workers = int(workers)
    self.timeout_s = float(timeout_s)
    self.memory_mb = int(memory_mb)
    if max_files < 1 or max_repo_chars < 1:
      raise ValueError(f'{self.name}: max_files={max_files} and max_repo_chars={max_repo_chars} '
                       'must be >= 1')
    self.max_files, self.max_repo_chars = int(max_files), int(max_repo_chars)
    # 'visible': run_tests (the policy's tests); 'hidden': scoring. Started on first use.
    self._sandboxes: dict[str, sandbox_lib.Sandbox] = {}

  def tools(self, record: Mapping[str, Any]) -> list[dict]:
    """All tools; `run_tests` only when the record has a visible test."""
    offered = [n for n in TOOLS if n != 'run_tests' or 'visible_test' in record['metadata']]
    return [TOOLS[n] for n in offered]

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any]) -> None:
    super()._check_metadata(metadata)
    repo = verifiers_base.require(metadata, 'repo', dict, 'path -> file text of the repository')
    if not repo:
      raise ValueError("metadata['repo'] must not be empty")
    for path, text in repo.items():
      if not isinstance(path, str) or not isinstance(text, str):
        raise ValueError(f"metadata['repo'] must map path strings to text strings; entry "
                         f'{str(path)[:80]!r} is {type(path).__name__} -> {type(text).__name__}')
      try:
        norm = normalize_path(path)
        check_text(text, f'the text of {path!r}')
      except base.ToolError as e:
        raise ValueError(f"metadata['repo']: {e}") from None
      if norm != path:
        raise ValueError(f"metadata['repo']: path {path!r} is not normalised (write {norm!r})")
    try:
      check_tree(repo)
    except base.ToolError as e:
      raise ValueError(f"metadata['repo']: {e}") from None
    if 'test' not in metadata and 'gold_patch' not in metadata:
      raise ValueError("metadata needs 'test' (the hidden test program) or 'gold_patch' (the "
                       'reference diff of the lexical reward)')
    for key in ('test', 'visible_test'):
      if key in metadata:
        test = verifiers_base.require(metadata, key, str, 'a Python test program')
        if not test.strip():
          raise ValueError(f'metadata[{key!r}] is empty')
    if 'gold_patch' in metadata:
      gold = verifiers_base.require(metadata, 'gold_patch', str, 'the reference unified diff')
      try:
        unidiff.parse(unidiff.extract(gold))
      except ValueError as e:
        raise ValueError(f"metadata['gold_patch'] is not a parsable diff: {e}") from None

  def _start(self, record: Mapping[str, Any]) -> Workspace:
    repo = record['metadata']['repo']
    return Workspace(original=repo, files=dict(repo), max_files=self.max_files,
                     max_chars=self.max_repo_chars)

  def _execute(self, calls: Sequence[base.Call]) -> list[str | base.ToolError]:
    out: list[str | base.ToolError | None] = [None] * len(calls)
    runs = []  # (index, request): run together after the others, on the files of their turn.
    for i, c in enumerate(calls):
      ws = c.episode.state
      if c.call.name == 'run_tests':
        runs.append((i, _request(c.episode.record['metadata']['visible_test'], ws)))
        continue
      try:
        out[i] = _TOOL_FNS[c.call.name](ws, **c.call.arguments)
      except base.ToolError as e:
        out[i] = e
    for (i, _), ans in zip(runs, self._run('visible', [r for _, r in runs])):
      if ans['passed']:
        out[i] = 'passed'
      else:
        out[i] = f'failed ({ans["status"]}): {_tail(ans["detail"], MAX_TEST_DETAIL_CHARS)}'
    return out

  def _score(self, episodes: Sequence[base.Episode],
             answers: Sequence[str | None]) -> list[tuple]:
    del answers  # The files are the answer; the final text is free.
    out: list[tuple | None] = [None] * len(episodes)
    runs = []
    for i, ep in enumerate(episodes):
      ws, md = ep.state, ep.record['metadata']
      changed = ws.changed()
      info = {'tests': 'not run', 'files_changed': changed}
      if not changed:
        out[i] = (0.0, dict(info, reason='the files are unchanged'))
      elif 'test' in md:
        runs.append((i, _request(md['test'], ws), info))
      else:
        patch = diff(ws.original, ws.files)
        if patch:
          reward, lexical = swe.lexical_reward(patch, md['gold_patch'])
        else:  # No line changed: only empty files came or went.
          reward, lexical = 0.0, {'reason': 'only empty files were created or deleted'}
        out[i] = (reward, dict(info, **lexical))
    for (i, _, info), ans in zip(runs, self._run('hidden', [r for _, r, _ in runs])):
      reason = ('the hidden test passed' if ans['passed'] else
                f'the hidden test failed: {ans["status"]}: {_tail(ans["detail"], 500)}')
      out[i] = (float(ans['passed']), dict(info, **sandbox_lib.result_info(ans, self.isolation),
                                           tests=ans['status'], reason=reason))
    return out

  def _run(self, tests: str, requests: list[dict]) -> list[dict]:
    """Runs sandbox requests in one batch on the sandbox of `tests`, starting it on first use.

    Args:
      tests: 'visible' (run_tests) or 'hidden' (scoring).
      requests: 'check' requests.

    Returns:
      The server answers.
    """
    if not requests:
      return []
    if tests not in self._sandboxes:
      self._sandboxes[tests] = sandbox_lib.Sandbox(self.workers, isolation=self.isolation,
                                                   memory_mb=self.memory_mb)
    return self._sandboxes[tests].run(requests, [self.timeout_s] * len(requests))

  def close(self) -> None:
    """Stops the sandbox servers (a later test run starts them again)."""
    for sb in self._sandboxes.values():
      sb.close()
    self._sandboxes.clear()


def _request(test: str, ws: Workspace) -> dict:
  """A 'check' request: `test` in the judge, on the episode's current files.

  The judge imports from the candidate's files only the modules the original
  repository has: a module the policy adds (a 'shlex.py') must not stand in
  for one the test imports from the standard library.
  """
  # pylint: disable-next=protected-access  # The swe verifier's rule, shared on purpose.
  importable = swe._top_level_modules(ws.original)
  return {'mode': 'check', 'program': '', 'test': test, 'files': dict(ws.files),
          'importable': importable}


def _tail(text: Any, limit: int) -> str:
  text = str(text).strip()
  return text if len(text) <= limit else '[...]' + text[-limit:]
