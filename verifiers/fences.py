"""Markdown code fences in model output, found in linear time.

A regular expression with a lazy body and a per-fence info line backtracks
quadratically on text such as thousands of fences on one line; this scanner
only moves forward with `str.find`, so a long hostile completion costs one
pass over its text in the trainer process.
"""

from __future__ import annotations

import re

_LANG = re.compile(r'[ \t]*([\w+#.-]*)')


def find(text: str) -> list[tuple[str, str]]:
  """The fenced blocks of `text`, in order.

  A block opens at three backticks; the rest of that line is its info
  string, whose first word is the language. It ends at the next three
  backticks or, if none follows (a truncated answer), at the end of the text.

  Args:
    text: model output.

  Returns:
    (language as written, body) pairs.
  """
  out = []
  pos = 0
  while True:
    start = text.find('```', pos)
    if start < 0:
      return out
    newline = text.find('\n', start + 3)
    if newline < 0:  # No line break after it: no block can open from here on.
      return out
    lang = _LANG.match(text, start + 3, newline).group(1)
    end = text.find('```', newline + 1)
    if end < 0:
      out.append((lang, text[newline + 1:]))
      return out
    out.append((lang, text[newline + 1:end]))
    pos = end + 3
