"""A loopback OpenAI-compatible chat-completions server for the served-judge tests.

A real HTTP server (`http.server.ThreadingHTTPServer`, one thread per
connection) on 127.0.0.1 in a background thread; what it answers is the test's
`behave(body, attempt)` function, which returns a `Response` (or a content string
for a plain 200 chat completion). It records what a test checks: every request
body, the attempts per distinct request, and the most requests it was handling
at once.

  server = FakeServer(lambda body, attempt: 'My final verdict is [[A>B]]')
  server.url          # 'http://127.0.0.1:<port>/v1'
  server.requests     # HTTP requests received
  server.close()

`tests/conftest.py`'s `fake_openai` fixture makes one per test and closes it.
"""

import dataclasses
import http.server
import json
import threading
import time
from typing import Callable


@dataclasses.dataclass
class Response:
  """What the server sends for one request.

  Attributes:
    status: the HTTP status.
    body: the body (bytes as they are; a str is encoded; a dict is JSON).
    headers: extra headers (e.g. {'Retry-After': '0.2'}).
    delay_s: seconds to wait before answering (a hang, when longer than the client waits).
    trickle_s: seconds between the body's bytes (a server that sends slowly).
  """
  status: int = 200
  body: object = b''
  headers: dict = dataclasses.field(default_factory=dict)
  delay_s: float = 0.0
  trickle_s: float = 0.0


def completion(content, finish_reason: str = 'stop') -> dict:
  """A chat completion's JSON carrying `content` as the assistant message."""
  return {'id': 'fake', 'object': 'chat.completion', 'model': 'fake-judge',
          'choices': [{'index': 0, 'finish_reason': finish_reason,
                       'message': {'role': 'assistant', 'content': content}}]}


class FakeServer:
  """See the module docstring.

  Args:
    behave: (request body, attempt: 1 for the first time this exact request arrives) ->
      a Response, or a str sent as the content of a 200 chat completion.
    hold_s: seconds every request is held before it is answered (so concurrent ones overlap).
  """

  def __init__(self, behave: Callable[[dict, int], object] | None = None, hold_s: float = 0.0):
    self.behave = behave or (lambda body, attempt: 'OK')
    self.hold_s = hold_s
    self.bodies: list[dict] = []
    self.attempts: dict[str, int] = {}
    self.headers: list[dict] = []
    self.in_flight = 0
    self.max_in_flight = 0
    self._lock = threading.Lock()
    outer = self

    class Handler(http.server.BaseHTTPRequestHandler):

      def log_message(self, *args):       # quiet
        del args

      def do_POST(self):                   # pylint: disable=invalid-name
        raw = self.rfile.read(int(self.headers.get('Content-Length', 0)))
        body = json.loads(raw)
        key = json.dumps(body, sort_keys=True)
        with outer._lock:
          outer.bodies.append(body)
          outer.headers.append(dict(self.headers))
          outer.attempts[key] = attempt = outer.attempts.get(key, 0) + 1
          outer.in_flight += 1
          outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
        try:
          time.sleep(outer.hold_s)
          resp = outer.behave(body, attempt)
          if not isinstance(resp, Response):
            resp = Response(body=completion(resp))
          time.sleep(resp.delay_s)
          data = resp.body
          if isinstance(data, dict):
            data = json.dumps(data).encode()
          elif isinstance(data, str):
            data = data.encode()
          self.send_response(resp.status)
          self.send_header('Content-Type', 'application/json')
          self.send_header('Content-Length', str(len(data)))
          for k, v in resp.headers.items():
            self.send_header(k, v)
          self.end_headers()
          if resp.trickle_s:
            for i in range(len(data)):
              self.wfile.write(data[i:i + 1])
              self.wfile.flush()
              time.sleep(resp.trickle_s)
          else:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
          pass                             # the client gave up (a timeout test)
        finally:
          with outer._lock:
            outer.in_flight -= 1

    self._server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    self._server.daemon_threads = True
    self._thread = threading.Thread(target=self._server.serve_forever,
                                    kwargs={'poll_interval': 0.02}, daemon=True)
    self._thread.start()
    self.url = f'http://127.0.0.1:{self._server.server_address[1]}/v1'

  @property
  def requests(self) -> int:
    """HTTP requests received so far."""
    with self._lock:
      return len(self.bodies)

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()
