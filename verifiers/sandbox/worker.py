"""Main of a verifier worker process: `python -m verifiers.sandbox.worker module:function`.

Imports the module once (running its optional `worker_init()` to warm
caches), reports ready, then answers framed JSON requests (see
`framing`) with `function(payload)` until its stdin closes. An
exception becomes {'error': ...}; the pool enforces wall-clock limits by
killing the whole process, which also dies with its parent.
"""

import ctypes
import importlib
import os
import signal
import sys
import traceback

from verifiers.sandbox import framing


def main(spec: str) -> None:
  # The protocol gets private descriptors; stray prints from libraries go to
  # stderr instead of corrupting it.
  proto_in, proto_out = os.dup(0), os.dup(1)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  os.dup2(2, 1)
  if sys.platform.startswith('linux'):
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # The parent died before the line above.
      return
  module_name, fn_name = spec.split(':')
  module = importlib.import_module(module_name)
  fn = getattr(module, fn_name)
  init = getattr(module, 'worker_init', None)
  if init is not None:
    init()
  framing.write_frame(proto_out, {'ready': True, 'pid': os.getpid()})
  while True:
    try:
      payload = framing.read_frame(proto_in)
    except (EOFError, ValueError):
      return
    if payload is None:
      return
    try:
      frame = framing.encode_frame(fn(payload))
    except Exception as e:  # pylint: disable=broad-except
      # 'where', the exception's last frame, names the line when the verifier's own code raised.
      last = traceback.extract_tb(e.__traceback__)[-1]
      frame = framing.encode_frame({'error': f'{type(e).__name__}: {e}',
                                    'where': f'{last.filename}:{last.lineno} in {last.name}'})
    framing.write_all(proto_out, frame)


if __name__ == '__main__':
  main(sys.argv[1])
