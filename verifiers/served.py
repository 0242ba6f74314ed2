"""A served judge: an OpenAI-compatible chat-completions client that fails closed.

Most labs run their generative reward model or evaluation judge as a server
(vLLM, SGLang, a hosted API) on other machines. `Client` asks one such
endpoint for many judgments at once:

  client = served.Client('http://judge-host:8000/v1', 'Qwen/Qwen3-235B-A22B',
                         api_key_env='JUDGE_API_KEY', concurrency=16,
                         cache_dir='runs/eval/arena_hard_v1/judge_cache')
  replies = client.complete([[{'role': 'system', 'content': ...},
                              {'role': 'user', 'content': ...}], ...], max_tokens=4096)
  replies[0].text        # the judgment, or None: replies[0].error says why none came
  client.close()

What it guarantees:

* At most `concurrency` requests are in flight (a thread pool of that size;
  identical requests of one call are sent once).
* Each request is retried on HTTP 429, 408 and 5xx, on connection errors, on a
  timeout and on a malformed body, up to `retries` more times, after an
  exponentially growing, jittered pause (`backoff_s` * 2^attempt, capped at
  `max_backoff_s`, drawn from its upper half), or after the server's
  `Retry-After` when that is longer (capped likewise). Another 4xx is the
  server's refusal of that very request and is not retried.
* A request is abandoned once `timeout_s` has passed (each read waits at most
  `timeout_s`, and the body is read chunk by chunk against that deadline, so a
  server that trickles bytes cannot hold it longer); a body over
  MAX_RESPONSE_BYTES is a failure.
* Failing closed: a judgment that never came is a `Reply` with `text=None`
  and the reason in `error`, never an empty or made-up text; the caller counts
  it and scores nothing from it. A reply the server did send is its message's
  `content` as written ('' when the server sent none): reading a verdict from it
  is the caller's bounded parser's job.
* A request-hash cache: with `cache_dir`, every reply that came is written to
  `<cache_dir>/<h[:2]>/<h>.json`, h the sha256 of the request's canonical JSON
  (sorted keys, no spaces: exactly the bytes sent), atomically
  (`foundation.paths.write_bytes`: local or gs://), with the request itself; a later
  identical request is answered from it without a round trip, so a resumed
  evaluation does not pay for a judgment twice. A file whose request differs
  from the one asked is not used. Failures are not cached.
* The API key is read from the environment variable `api_key_env` names (never
  from a config); it goes in the Authorization header only and appears in no
  message, cache file or repr.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import email.utils
import hashlib
import json
import os
import random
import threading
import time
from typing import Any, Mapping, Sequence

import httpx

from foundation import paths

# The largest response body read (a judgment is a few KiB; this bounds a broken server).
MAX_RESPONSE_BYTES = 16 << 20
# HTTP statuses worth asking again: rate limits, request timeouts, conflicts, server errors.
_RETRY_STATUS = frozenset({408, 409, 429})
# Characters of a refusing server's body kept in `Reply.error`.
_ERROR_CHARS = 200


@dataclasses.dataclass(frozen=True)
class Reply:
  """The server's answer to one request.

  Attributes:
    text: the message content it sent ('' when none), or None when no judgment came.
    error: why none came ('' when one did).
    finish_reason: the server's finish_reason ('length': the judge ran out of max_tokens).
    cached: answered from the cache, with no round trip.
    attempts: HTTP requests made for it (0 when cached).
    refused: no judgment came because the server refused this very request (a 4xx other than
      408, 409 and 429): asking again would not help, unlike an outage.
  """
  text: str | None
  error: str = ''
  finish_reason: str = ''
  cached: bool = False
  attempts: int = 0
  refused: bool = False

  @property
  def ok(self) -> bool:
    return self.text is not None


class _Retry(Exception):
  """A failed attempt worth repeating (the message says what failed)."""

  def __init__(self, message: str, wait_s: float = 0.0):
    super().__init__(message)
    self.wait_s = wait_s


class _Refused(Exception):
  """A failure that another attempt would repeat (the server refused this request)."""


def canonical(body: Mapping[str, Any]) -> bytes:
  """The request's canonical JSON: sorted keys, no spaces, UTF-8 (what is sent and hashed)."""
  return json.dumps(body, sort_keys=True, separators=(',', ':'), ensure_ascii=False,
                    allow_nan=False).encode('utf-8')


def request_key(body: Mapping[str, Any]) -> str:
  """The sha256 (hex) of the request's canonical JSON: its cache key."""
  return hashlib.sha256(canonical(body)).hexdigest()


def retry_after_s(value: str | None) -> float:
  """A `Retry-After` header as seconds: a number, or an HTTP date (0 when absent or unreadable)."""
  if not value:
    return 0.0
  try:
    return max(0.0, float(value))
  except ValueError:
    pass
  try:
    when = email.utils.parsedate_to_datetime(value)
  except (TypeError, ValueError):
    return 0.0
  return max(0.0, when.timestamp() - time.time())


class Client:
  """An OpenAI-compatible chat-completions endpoint (see the module docstring).

  Args:
    url: the API base ('http://host:8000/v1'; '/chat/completions' is appended unless it is
      there).
    model: the served model's name, sent in every request.
    api_key_env: the environment variable holding the API key ('' = send none).
    concurrency: requests in flight at most.
    timeout_s: the most seconds one request may take.
    retries: further attempts after a failed one (429, 408, 409, 5xx, connection errors,
      timeouts, malformed bodies).
    backoff_s: the first pause before a retry; it doubles with each attempt.
    max_backoff_s: the longest pause (also caps a server's Retry-After).
    cache_dir: where replies are cached by request hash ('' = no cache); local or gs://.
    extra_body: further request fields for every request (e.g. vLLM's `chat_template_kwargs`);
      they are part of the request's hash.

  Raises:
    ValueError: an option out of range, a URL that is not http(s), or an `api_key_env` that
      names an unset variable (the message names the option, never the key).
  """

  def __init__(self, url: str, model: str, *, api_key_env: str = '', concurrency: int = 8,
               timeout_s: float = 300.0, retries: int = 6, backoff_s: float = 1.0,
               max_backoff_s: float = 60.0, cache_dir: str = '',
               extra_body: Mapping[str, Any] | None = None):
    if not isinstance(url, str) or not url.startswith(('http://', 'https://')):
      raise ValueError(f'served judge: url={url!r} must be an http:// or https:// API base')
    if not isinstance(model, str) or not model.strip():
      raise ValueError(f'served judge: model={model!r} must name the served model')
    for name, value, low in (('concurrency', concurrency, 1), ('retries', retries, 0)):
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f'served judge: {name}={value!r} must be an int >= {low}')
    for name, value in (('timeout_s', timeout_s), ('backoff_s', backoff_s),
                        ('max_backoff_s', max_backoff_s)):
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f'served judge: {name}={value!r} must be a number >= 0')
    if timeout_s <= 0:
      raise ValueError(f'served judge: timeout_s={timeout_s!r} must be > 0')
    reserved = sorted({'model', 'messages', 'max_tokens', 'temperature'} &
                      set(extra_body or {}))
    if reserved:
      raise ValueError(f'served judge: extra_body sets {reserved}, which the client sets itself')
    headers = {'Content-Type': 'application/json'}
    if api_key_env:
      key = os.environ.get(api_key_env, '')
      if not key:
        raise ValueError(f'served judge: api_key_env={api_key_env!r} names an environment '
                         'variable that is not set (the API key is read from it)')
      headers['Authorization'] = f'Bearer {key}'
    base = url.rstrip('/')
    self.url = base if base.endswith('/chat/completions') else base + '/chat/completions'
    self.model, self.concurrency, self.timeout_s = model, concurrency, float(timeout_s)
    self.retries, self.backoff_s = retries, float(backoff_s)
    self.max_backoff_s = float(max_backoff_s)
    self.cache_dir, self.extra_body = cache_dir, dict(extra_body or {})
    self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(self.timeout_s),
                              limits=httpx.Limits(max_connections=concurrency,
                                                  max_keepalive_connections=concurrency))
    self._pool = concurrent.futures.ThreadPoolExecutor(concurrency,
                                                       thread_name_prefix='served-judge')
    self._closed = threading.Event()
    self._lock = threading.Lock()
    # HTTP requests sent, replies answered from the cache, judgments that never came.
    self.counts = {'requests': 0, 'cached': 0, 'failed': 0}

  def __repr__(self) -> str:
    return f'served.Client({self.url!r}, {self.model!r}, concurrency={self.concurrency})'

  def _count(self, what: str) -> None:
    with self._lock:
      self.counts[what] += 1

  def body(self, messages: Sequence[Mapping[str, str]], max_tokens: int,
           temperature: float) -> dict:
    """The request body of one conversation (what is sent, and hashed for the cache)."""
    return {**self.extra_body, 'model': self.model,
            'messages': [{'role': str(m['role']), 'content': str(m['content'])} for m in messages],
            'max_tokens': int(max_tokens), 'temperature': float(temperature)}

  def complete(self, conversations: Sequence[Sequence[Mapping[str, str]]], *, max_tokens: int,
               temperature: float = 0.0) -> list[Reply]:
    """One reply per conversation, asked concurrently (at most `concurrency` in flight).

    Args:
      conversations: each a list of {'role', 'content'} messages.
      max_tokens: the most tokens the judge writes per reply.
      temperature: its sampling temperature (0: greedy, as judges are run).

    Returns:
      The replies, in order; a failed one has text None and its reason (never raises for a
      server's failure).
    """
    if self._closed.is_set():
      raise RuntimeError(f'{self!r} is closed')
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
      raise ValueError(f'served judge: max_tokens={max_tokens!r} must be an int >= 1')
    bodies = [self.body(c, max_tokens, temperature) for c in conversations]
    keys = [request_key(b) for b in bodies]
    unique = dict(zip(keys, bodies))          # identical requests are sent (and cached) once
    futures = {k: self._pool.submit(self._one, k, b) for k, b in unique.items()}
    done = {k: f.result() for k, f in futures.items()}
    return [done[k] for k in keys]

  # -- one request -----------------------------------------------------------------------------

  def _cache_path(self, key: str) -> str:
    return paths.join(self.cache_dir, key[:2], key + '.json')

  def _cached(self, key: str, body: dict) -> Reply | None:
    if not self.cache_dir:
      return None
    where = self._cache_path(key)
    try:
      if not paths.exists(where):
        return None
      kept = json.loads(paths.read_text(where))
    except (OSError, ValueError):
      return None               # an unreadable entry is asked again (and written afresh)
    if (not isinstance(kept, dict) or kept.get('request') != body
        or not isinstance(kept.get('text'), str)):
      return None
    return Reply(kept['text'], finish_reason=str(kept.get('finish_reason') or ''), cached=True)

  def _keep(self, key: str, body: dict, reply: Reply) -> None:
    if not self.cache_dir:
      return
    try:
      paths.write_bytes(self._cache_path(key), canonical(
          {'request': body, 'text': reply.text, 'finish_reason': reply.finish_reason}))
    except OSError:
      pass       # the reply stands; only a later identical request will be asked again

  def _one(self, key: str, body: dict) -> Reply:
    hit = self._cached(key, body)
    if hit is not None:
      self._count('cached')
      return hit
    payload = canonical(body)
    error = ''
    for attempt in range(self.retries + 1):
      if self._closed.is_set():
        error = 'the client was closed'
        break
      self._count('requests')
      try:
        text, finish = self._post(payload)
      except _Refused as e:
        self._count('failed')
        return Reply(None, error=str(e), attempts=attempt + 1, refused=True)
      except _Retry as e:
        error = str(e)
        if attempt < self.retries:
          self._closed.wait(self._pause(attempt, e.wait_s))
        continue
      reply = Reply(text, finish_reason=finish, attempts=attempt + 1)
      self._keep(key, body, reply)
      return reply
    self._count('failed')
    tries = self.retries + 1
    return Reply(None, error=f'{error} (after {tries} attempt{"s" * (tries > 1)})',
                 attempts=tries)

  def _pause(self, attempt: int, retry_after: float) -> float:
    """Exponential backoff with jitter (the upper half of the doubled step), or the server's
    Retry-After when longer; both capped at max_backoff_s."""
    step = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
    return min(self.max_backoff_s, max(retry_after, step * random.uniform(0.5, 1.0)))

  def _post(self, payload: bytes) -> tuple[str, str]:
    """(content, finish_reason) of one HTTP request; raises _Retry or _Refused."""
    deadline = time.monotonic() + self.timeout_s
    try:
      with self._http.stream('POST', self.url, content=payload) as r:
        status = r.status_code
        chunks, size = [], 0
        for chunk in r.iter_bytes():
          size += len(chunk)
          if size > MAX_RESPONSE_BYTES:
            raise _Retry(f'a response body over {MAX_RESPONSE_BYTES} bytes')
          if time.monotonic() > deadline:
            raise _Retry(f'timed out after {self.timeout_s:g} s (reading the body)')
          chunks.append(chunk)
        wait = retry_after_s(r.headers.get('retry-after'))
    except httpx.TimeoutException:
      raise _Retry(f'timed out after {self.timeout_s:g} s') from None
    except httpx.TransportError as e:
      raise _Retry(f'connection error ({type(e).__name__})') from None
    raw = b''.join(chunks)
    if status in _RETRY_STATUS or status >= 500:
      raise _Retry(f'HTTP {status}', wait)
    if status != 200:
      excerpt = raw[:_ERROR_CHARS].decode('utf-8', 'replace')
      raise _Refused(f'HTTP {status}: {excerpt}')
    try:
      data = json.loads(raw)
      choice = data['choices'][0]
      content = choice['message'].get('content')
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
      raise _Retry('a malformed response (not a chat completion)') from None
    if content is not None and not isinstance(content, str):
      raise _Retry('a malformed response (its content is not text)')
    finish = choice.get('finish_reason')
    return content or '', finish if isinstance(finish, str) else ''

  def close(self) -> None:
    """Stops the pool and the connections (idempotent); pending retries give up."""
    if not self._closed.is_set():
      self._closed.set()
      self._pool.shutdown(wait=True)
      self._http.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()
