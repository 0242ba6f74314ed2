"""Length-prefixed JSON framing spoken by every verifier process.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8
JSON. The pool, `worker` and the sandbox server (which runs inside
bubblewrap next to this file) all use it, so this module imports only the
standard library. Decoding rejects NaN/Infinity and frames over
`MAX_FRAME_BYTES`, and a nesting deeper than the interpreter can decode is a
ValueError, not a RecursionError.
"""

import json
import os
import struct

_HEADER = struct.Struct('>I')
MAX_FRAME_BYTES = 1 << 28


def _no_constant(name):
  raise ValueError(f'{name} is not valid JSON')


def decode(body: bytes):
  """One frame body as a JSON value.

  Raises:
    ValueError: not UTF-8, not JSON (NaN and Infinity included) or nested
      too deeply.
  """
  try:
    return json.loads(body.decode('utf-8'), parse_constant=_no_constant)
  except RecursionError:
    raise ValueError('JSON nested too deeply') from None


def encode_frame(obj) -> bytes:
  """One message as bytes: length header plus compact JSON."""
  data = json.dumps(obj, separators=(',', ':'), allow_nan=False).encode('utf-8')
  if len(data) > MAX_FRAME_BYTES:
    raise ValueError(f'frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}')
  return _HEADER.pack(len(data)) + data


def write_all(fd: int, data: bytes) -> None:
  """Writes all of `data` to a blocking file descriptor."""
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]


def write_frame(fd: int, obj) -> None:
  """Writes one message to a blocking file descriptor."""
  write_all(fd, encode_frame(obj))


def read_frame(fd: int, max_bytes: int = MAX_FRAME_BYTES):
  """Reads one message from a blocking file descriptor; None at end of file.

  Raises:
    EOFError: the stream ended inside a frame.
    ValueError: a frame over `max_bytes` or one that is not JSON.
  """
  header = _read_exactly(fd, _HEADER.size)
  if header is None:
    return None
  (size,) = _HEADER.unpack(header)
  if size > max_bytes:
    raise ValueError(f'frame of {size} bytes exceeds {max_bytes}')
  body = _read_exactly(fd, size)
  if body is None:
    raise EOFError('stream ended inside a frame')
  return decode(body)


def _read_exactly(fd, n):
  chunks, got = [], 0
  while got < n:
    chunk = os.read(fd, min(n - got, 1 << 20))
    if not chunk:
      if got:
        raise EOFError('stream ended inside a frame')
      return None
    chunks.append(chunk)
    got += len(chunk)
  return b''.join(chunks)


class FrameReader:
  """Incremental decoder for a non-blocking stream: feed bytes, get whole messages."""

  def __init__(self):
    self._buf = bytearray()

  def feed(self, data: bytes) -> list:
    """Appends `data`; returns the messages completed by it (may be empty).

    Raises:
      ValueError: a frame longer than MAX_FRAME_BYTES or one that is not JSON.
    """
    self._buf += data
    out = []
    while len(self._buf) >= _HEADER.size:
      (size,) = _HEADER.unpack_from(self._buf)
      if size > MAX_FRAME_BYTES:
        raise ValueError(f'frame of {size} bytes exceeds {MAX_FRAME_BYTES}')
      if len(self._buf) < _HEADER.size + size:
        break
      body = bytes(self._buf[_HEADER.size:_HEADER.size + size])
      del self._buf[:_HEADER.size + size]
      out.append(decode(body))
    return out
