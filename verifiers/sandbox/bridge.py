"""The boundary between a candidate's process and the judge process that decides its verdict.

A 'check' run is two processes (see `server`): the *candidate*
process executes the untrusted code and answers requests; the *judge*
process, forked from the server before any candidate code ran, executes only
trusted code (the record's test) and sees the candidate's functions and
modules as `Remote` proxies. Every value that crosses from the candidate is
plain data: exactly None, bool, int, float, complex, str, bytes, list,
tuple, dict, set or frozenset (subclasses excluded), rebuilt as fresh
objects in the judge. So every comparison in a test runs on builtins the
candidate never touched, and the verdict (the judge's test ran to its end)
lives in a process the candidate cannot read, write or trace.

Anything else a candidate returns stays in its process as an opaque handle:
the judge may get its attributes, call it, or ask for its str/repr/len/bool/
items (each answer forced to plain data of the right type), but comparison
operators are never delegated, so a handle equals only itself. An exception
raised by candidate code is re-raised in the judge as the builtin exception
of the same name (others as RuntimeError), except control flow: StopIteration
and StopAsyncIteration (which end a judge's loop over `map(candidate, ...)`
or `iter(candidate, x)` early) and every BaseException that is not an
Exception (SystemExit, KeyboardInterrupt, GeneratorExit, ...) come as
RuntimeError and mark the link (`Link.control_flow`), so the verdict fails
even where the test catches the error. The judge decides this, not the
candidate's encoder: the candidate can write any frame. Standard library
only: this file runs inside the sandbox next to `server`.
"""

import builtins
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

try:  # On the host, as part of the package; in the sandbox, next to this file.
  from verifiers.sandbox import framing
except ImportError:
  import framing  # pylint: disable=g-import-not-at-top

# Bounds of one encoded value (the frame size bounds its bytes).
MAX_DEPTH = 64
MAX_NODES = 1 << 20
MAX_ITEMS = 100_000
_EXC_TEXT = 2000
# Exceptions (besides every BaseException that is not an Exception) that steer
# the judge's control flow instead of reporting an error.
_CONTROL_FLOW = (StopIteration, StopAsyncIteration)


class NotPlain(TypeError):
  """A value is not plain data (or exceeds the bounds)."""


def encode(value):
  """Plain data as a JSON value; raises NotPlain for anything else."""
  budget = [MAX_NODES]
  return _enc(value, 0, budget)


def _enc(x, depth, budget):
  budget[0] -= 1
  if budget[0] < 0 or depth > MAX_DEPTH:
    raise NotPlain('value too large or nested too deeply')
  t = type(x)
  if x is None or t is bool:
    return x
  if t is int:
    return ['i', hex(x)]  # Hex: no int-to-decimal digit limit, exact.
  if t is float:
    return ['f', x.hex()]
  if t is complex:
    return ['c', x.real.hex(), x.imag.hex()]
  if t is str:
    return ['s', x]
  if t is bytes:
    return ['b', x.hex()]
  if t in (list, tuple, set, frozenset):
    tag = {list: 'l', tuple: 't', set: 'S', frozenset: 'F'}[t]
    return [tag, [_enc(v, depth + 1, budget) for v in list(x)]]
  if t is dict:
    return ['d', [[_enc(k, depth + 1, budget), _enc(v, depth + 1, budget)]
                  for k, v in list(x.items())]]
  raise NotPlain(f'{t.__name__} is not plain data')


def decode(data):
  """Rebuilds a value from `encode`'s output; raises ValueError on anything malformed."""
  budget = [MAX_NODES]
  try:
    return _dec(data, 0, budget)
  except (TypeError, ValueError, OverflowError, IndexError) as e:
    raise ValueError(f'malformed plain data: {e}') from None


def _dec(x, depth, budget):
  budget[0] -= 1
  if budget[0] < 0 or depth > MAX_DEPTH:
    raise ValueError('value too large or nested too deeply')
  if x is None or type(x) is bool:
    return x
  if type(x) is not list or not x or type(x[0]) is not str:
    raise ValueError(f'bad node {str(x)[:40]}')
  tag = x[0]
  if tag == 'i':
    return int(_text(x[1]), 16)
  if tag == 'f':
    return float.fromhex(_text(x[1]))
  if tag == 'c':
    return complex(float.fromhex(_text(x[1])), float.fromhex(_text(x[2])))
  if tag == 's':
    return _text(x[1])
  if tag == 'b':
    return bytes.fromhex(_text(x[1]))
  if type(x[1]) is not list:
    raise ValueError(f'bad container {tag!r}')
  if tag == 'd':
    out = {}
    for pair in x[1]:
      if type(pair) is not list or len(pair) != 2:
        raise ValueError('bad dict item')
      out[_dec(pair[0], depth + 1, budget)] = _dec(pair[1], depth + 1, budget)
    return out
  items = [_dec(v, depth + 1, budget) for v in x[1]]
  kinds = {'l': list, 't': tuple, 'S': set, 'F': frozenset}
  if tag not in kinds:
    raise ValueError(f'unknown tag {tag!r}')
  return kinds[tag](items)


def _text(x):
  if type(x) is not str:
    raise ValueError('expected a string')
  return x


# -- candidate side ---------------------------------------------------------


class Server:
  """Answers the judge's requests about objects of this (candidate) process.

  Args:
    roots: module name -> module already loaded (e.g. 'solution'); other
      names are imported on request when `importable` allows them.
    importable: top-level names the judge may import here (a repository's
      modules), or () for none.
  """

  def __init__(self, roots, importable=()):
    self._roots = dict(roots)
    self._importable = frozenset(importable)
    self._objects = []   # handle -> object (kept alive, so ids stay unique)
    self._ids = {}       # id(object) -> handle

  def handle(self, req):
    """One request -> one answer (a JSON value); never raises."""
    try:
      return self._handle(req)
    except BaseException as e:  # pylint: disable=broad-except
      return encode_error(e)

  def _answer(self, value):
    try:
      return ['v', encode(value)]
    except NotPlain:
      pass
    key = id(value)
    if key not in self._ids:
      self._ids[key] = len(self._objects)
      self._objects.append(value)
    kind = 'module' if isinstance(value, types.ModuleType) else (
        'callable' if callable(value) else 'object')
    return ['h', self._ids[key], kind]

  def _obj(self, ref):
    if type(ref) is not int or not 0 <= ref < len(self._objects):
      raise ValueError(f'unknown handle {ref!r}')
    return self._objects[ref]

  def _handle(self, req):
    op = req['op']
    if op == 'import':
      name = req['name']
      if name in self._roots:
        return self._answer(self._roots[name])
      if type(name) is not str or name.split('.')[0] not in self._importable:
        raise ImportError(f'{name!r} is not importable from the candidate')
      return self._answer(importlib.import_module(name))
    obj = self._obj(req['ref'])
    if op == 'getattr':
      name = req['name']
      if type(name) is not str or name.startswith('__'):
        raise AttributeError(f'attribute {name!r} is not shared')
      return self._answer(getattr(obj, name))
    if op == 'call':
      args = decode(req['args'])
      kwargs = decode(req['kwargs'])
      if type(args) is not tuple or type(kwargs) is not dict:
        raise ValueError('bad call')
      return self._answer(obj(*args, **kwargs))
    if op == 'getitem':
      return self._answer(obj[decode(req['key'])])
    if op == 'str':
      return ['v', encode(_forced(str(obj), str))]
    if op == 'repr':
      return ['v', encode(_forced(repr(obj), str))]
    if op == 'len':
      return ['v', encode(_forced(len(obj), int))]
    if op == 'bool':
      return ['v', encode(_forced(bool(obj), bool))]
    if op == 'contains':
      return ['v', encode(_forced(decode(req['item']) in obj, bool))]
    if op == 'items':
      out = []
      for v in obj:
        if len(out) >= MAX_ITEMS:
          raise ValueError(f'more than {MAX_ITEMS} items')
        out.append(self._answer(v))
      return ['items', out]
    raise ValueError(f'unknown op {op!r}')

  def serve(self, fd_in, fd_out):
    """Answers requests until the judge closes the stream."""
    while True:
      req = framing.read_frame(fd_in)
      if req is None:
        return
      try:
        frame = framing.encode_frame(self.handle(req))
      except BaseException as e:  # pylint: disable=broad-except
        frame = framing.encode_frame(encode_error(e))
      framing.write_all(fd_out, frame)


def _forced(value, t):
  if type(value) is not t:
    raise TypeError(f'expected {t.__name__}, got {type(value).__name__}')
  return value


def encode_error(e):
  """An exception as plain data: its class name (if builtin) and text."""
  try:
    name = type(e).__name__
    builtin = isinstance(getattr(builtins, name, None), type) and getattr(builtins, name) is type(e)
    text = str(e)
    text = text if type(text) is str else ''
  except BaseException:  # pylint: disable=broad-except
    name, builtin, text = 'Exception', False, ''
  return ['e', name if builtin else '', f'{name}: {text[:_EXC_TEXT]}']


# -- judge side -------------------------------------------------------------


class CandidateFailed(Exception):
  """The candidate process broke the protocol or went away."""


class Link:
  """The judge's connection to the candidate process.

  Attributes:
    control_flow: the name of the first control-flow exception the candidate
      raised (see the module docstring), or '' if none: the verdict fails.
  """

  def __init__(self, fd_in, fd_out):
    self.fd_in = fd_in
    self.fd_out = fd_out
    self.control_flow = ''
    self._proxies = {}

  def request(self, req):
    """Sends one request, returns the decoded result or raises what the candidate raised."""
    try:
      framing.write_frame(self.fd_out, req)
      ans = framing.read_frame(self.fd_in)
    except (OSError, EOFError, ValueError) as e:
      raise CandidateFailed(f'candidate process: {type(e).__name__}: {e}') from None
    if ans is None:
      raise CandidateFailed('the candidate process exited before answering')
    return self.result(ans)

  def result(self, ans):
    """Decodes one answer frame (see `request`)."""
    if type(ans) is not list or not ans:
      raise CandidateFailed('malformed answer')
    tag = ans[0]
    if tag == 'v' and len(ans) == 2:
      return decode(ans[1])
    if tag == 'h' and len(ans) == 3 and type(ans[1]) is int and ans[2] in ('module', 'callable',
                                                                          'object'):
      if ans[1] not in self._proxies:
        self._proxies[ans[1]] = Remote(self, ans[1], ans[2])
      return self._proxies[ans[1]]
    if tag == 'items' and len(ans) == 2 and type(ans[1]) is list:
      return [self.result(a) for a in ans[1]]
    if tag == 'e' and len(ans) == 3 and type(ans[1]) is str and type(ans[2]) is str:
      cls = getattr(builtins, ans[1], None) if ans[1] else None
      if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        cls = RuntimeError
      elif not issubclass(cls, Exception) or issubclass(cls, _CONTROL_FLOW):
        self.control_flow = self.control_flow or cls.__name__
        raise RuntimeError(f'the candidate raised {cls.__name__}, a control-flow exception: '
                           f'{ans[2]}')
      try:
        exc = cls(ans[2])
      except Exception:  # pylint: disable=broad-except
        exc = RuntimeError(ans[2])
      raise exc
    raise CandidateFailed('malformed answer')

  def import_module(self, name):
    """A proxy of the candidate's module `name`."""
    return self.request({'op': 'import', 'name': name})


class Remote:
  """An object of the candidate process, seen from the judge.

  Equality, hashing and ordering are the judge's own (identity): they are
  never delegated to candidate code.
  """

  __slots__ = ('_link', '_ref', '_kind', '__weakref__')

  def __init__(self, link, ref, kind):
    object.__setattr__(self, '_link', link)
    object.__setattr__(self, '_ref', ref)
    object.__setattr__(self, '_kind', kind)

  def _op(self, op, **kw):
    return self._link.request(dict(op=op, ref=self._ref, **kw))

  def __getattr__(self, name):
    if name.startswith('__'):
      raise AttributeError(name)
    return self._op('getattr', name=name)

  def __setattr__(self, name, value):
    raise AttributeError('candidate objects are read-only in the judge')

  def __call__(self, *args, **kwargs):
    try:
      a, k = encode(args), encode(kwargs)
    except NotPlain as e:
      raise TypeError(f'cannot pass to candidate code: {e}') from None
    return self._op('call', args=a, kwargs=k)

  def __getitem__(self, key):
    return self._op('getitem', key=encode(key))

  def __str__(self):
    return self._op('str')

  def __repr__(self):
    return self._op('repr')

  def __len__(self):
    return self._op('len')

  def __bool__(self):
    return self._op('bool')

  def __contains__(self, item):
    return self._op('contains', item=encode(item))

  def __iter__(self):
    return iter(self._op('items'))


class _RemoteFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports of the candidate's top-level modules give proxies of them."""

  def __init__(self, link, names):
    self._link = link
    self._names = frozenset(names)

  def find_spec(self, fullname, path=None, target=None):
    if fullname.split('.')[0] not in self._names:
      return None
    return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

  def create_module(self, spec):
    remote = self._link.import_module(spec.name)
    module = types.ModuleType(spec.name)
    module.__getattr__ = lambda name: getattr(remote, name)
    module.__path__ = []
    return module

  def exec_module(self, module):
    pass


def install_finder(link, names):
  """Routes imports of `names` (and their submodules) in this process to the candidate."""
  sys.meta_path.insert(0, _RemoteFinder(link, names))
