"""Unified diffs: find one in an answer, parse it, normalise it, apply it to files.

Parsing is strict about structure (a `---`/`+++` file header, then hunks
opening with a valid `@@ -a,b +c,d @@` header and holding only ' ', '+',
'-' or '\\' lines) and lenient about the line counts in hunk headers, which
models often get wrong: hunks are recounted as `git apply --recount` does.
Text before the first file header and after the last hunk is ignored.

Everything here runs on model output in the trainer process, so it is
bounded: fences are found in linear time, parsing is one pass over the
lines, and `apply` gives up (ValueError) past a fixed amount of work.
"""

from __future__ import annotations

import dataclasses
import re

from verifiers import fences

_HUNK = re.compile(r'^@@ -(\d{1,9})(?:,(\d{1,9}))? \+(\d{1,9})(?:,(\d{1,9}))? @@')
DEV_NULL = '/dev/null'
# Line comparisons and copies `apply` may spend on one patch.
MAX_APPLY_WORK = 20_000_000


@dataclasses.dataclass(frozen=True)
class Hunk:
  """One hunk: where it starts in the old file and its tagged lines (' ', '-', '+')."""
  old_start: int
  lines: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class FilePatch:
  """The hunks of one file; a path is DEV_NULL for a created or deleted file."""
  old_path: str
  new_path: str
  hunks: tuple[Hunk, ...]

  @property
  def path(self) -> str:
    return self.old_path if self.new_path == DEV_NULL else self.new_path


def _path(header: str) -> str:
  path = header.split('\t')[0].strip()
  if path.startswith(('a/', 'b/')):
    path = path[2:]
  return path


def extract(answer: str) -> str:
  """The diff text of an answer: a diff/patch fence, a fence that holds a diff, or the answer."""
  blocks = [(lang.lower(), body) for lang, body in fences.find(answer)]
  for lang, body in blocks:
    if lang in ('diff', 'patch'):
      return body
  for _, body in blocks:
    if re.search(r'^--- ', body, re.MULTILINE) and re.search(r'^@@ ', body, re.MULTILINE):
      return body
  return answer


def parse(diff: str) -> list[FilePatch]:
  """Parses a unified diff.

  Args:
    diff: the diff text.

  Returns:
    One FilePatch per file, in order.

  Raises:
    ValueError: no file header, a file without hunks, a malformed hunk
      header or an empty hunk.
  """
  lines = diff.replace('\r\n', '\n').split('\n')
  files: list[FilePatch] = []
  i = 0
  while i < len(lines):
    if not (lines[i].startswith('--- ') and i + 1 < len(lines) and lines[i + 1].startswith('+++ ')):
      if files and lines[i].strip() and not lines[i].startswith(('diff ', 'index ', 'new file',
                                                                 'deleted file', 'similarity',
                                                                 'rename ', 'old mode', 'new mode')):
        break  # Prose after the diff.
      i += 1
      continue
    old, new = _path(lines[i][4:]), _path(lines[i + 1][4:])
    i += 2
    hunks = []
    while i < len(lines) and lines[i].startswith('@@'):
      m = _HUNK.match(lines[i])
      if not m:
        raise ValueError(f'line {i + 1}: malformed hunk header {lines[i][:80]!r}')
      i += 1
      body = []
      while i < len(lines):
        line = lines[i]
        if line.startswith('\\'):  # '\ No newline at end of file'
          i += 1
          continue
        if line.startswith('--- ') and i + 1 < len(lines) and lines[i + 1].startswith('+++ '):
          break
        if line == '':
          tag, content = ' ', ''
        elif line[0] in ' +-':
          tag, content = line[0], line[1:]
        else:
          break
        body.append((tag, content))
        i += 1
      while body and body[-1] == (' ', ''):  # Blank lines after a hunk are not context.
        body.pop()
      if not body:
        raise ValueError(f'line {i}: empty hunk')
      hunks.append(Hunk(int(m.group(1)), tuple(body)))
    if not hunks:
      raise ValueError(f'line {i}: file header for {new!r} without hunks')
    files.append(FilePatch(old, new, tuple(hunks)))
  if not files:
    raise ValueError('no "--- a/file" / "+++ b/file" header found')
  return files


def changes(patch: list[FilePatch]) -> tuple:
  """The patch reduced to what it changes: per file (sorted), its '-'/'+' lines.

  Context lines, line numbers and trailing whitespace are dropped, so two
  diffs of the same edit with different context compare equal.
  """
  per_file: dict[str, list] = {}
  for fp in patch:
    per_file.setdefault(fp.path, []).extend(
        (tag, text.rstrip()) for h in fp.hunks for tag, text in h.lines if tag != ' ')
  return tuple((path, tuple(per_file[path])) for path in sorted(per_file))


def is_noop(patch: list[FilePatch]) -> bool:
  """True if no file changes: no '+'/'-' lines, or each file removes what it adds."""
  for fp in patch:
    removed = [t.rstrip() for h in fp.hunks for tag, t in h.lines if tag == '-']
    added = [t.rstrip() for h in fp.hunks for tag, t in h.lines if tag == '+']
    if removed != added or fp.old_path != fp.new_path:
      return False
  return True


def render_changes(patch: list[FilePatch]) -> str:
  """`changes` as text, for lexical similarity."""
  return '\n'.join(f'{path}\n' + '\n'.join(tag + text for tag, text in lines)
                   for path, lines in changes(patch))


def _find(lines: list[str], old: list[str], hint: int, budget: list[int]) -> int:
  """Index where `old` occurs in `lines`, nearest to `hint`; -1 if nowhere.

  Positions are tried outwards from the hint; each try is charged to
  `budget` (ValueError when it runs out).
  """
  if not old:
    return min(max(hint, 0), len(lines))
  last = len(lines) - len(old)
  hint = min(max(hint, 0), max(last, 0))
  for d in range(0, max(hint, last - hint) + 1):
    for pos in ((hint - d, hint + d) if d else (hint,)):
      if 0 <= pos <= last:
        budget[0] -= len(old)
        if budget[0] < 0:
          raise ValueError('patch too costly to apply')
        if lines[pos] == old[0] and lines[pos:pos + len(old)] == old:
          return pos
  return -1


def apply(patch: list[FilePatch], files: dict[str, str]) -> dict[str, str]:
  """Applies a patch to in-memory files.

  Args:
    patch: from `parse`.
    files: path -> content.

  Returns:
    The patched path -> content (a new dict).

  Raises:
    ValueError: a file is missing, a hunk's context is not found, or the
      patch needs more than MAX_APPLY_WORK line operations.
  """
  out = dict(files)
  budget = [MAX_APPLY_WORK]
  for fp in patch:
    if fp.old_path == DEV_NULL:
      lines = ['']
    elif fp.old_path in out:
      lines = out[fp.old_path].split('\n')
    else:
      raise ValueError(f'patch modifies {fp.old_path!r}, which is not in the repo')
    offset = 0
    for h in fp.hunks:
      old = [t for tag, t in h.lines if tag in ' -']
      new = [t for tag, t in h.lines if tag in ' +']
      # A hunk that only inserts ("-3,0") names the line it goes after; others their first line.
      pos = _find(lines, old, h.old_start - (1 if old else 0) + offset, budget)
      if pos < 0:
        raise ValueError(f'hunk at line {h.old_start} of {fp.old_path!r} does not apply')
      budget[0] -= len(lines) + len(new)
      if budget[0] < 0:
        raise ValueError('patch too costly to apply')
      lines[pos:pos + len(old)] = new
      offset += len(new) - len(old)
    if fp.old_path != DEV_NULL and fp.old_path != fp.new_path:
      del out[fp.old_path]
    if fp.new_path != DEV_NULL:
      out[fp.new_path] = '\n'.join(lines)
  return out
