"""The `--config` flag: a config file, and overrides that name stages and unset fields.

  python -m cascade.main --config=configs/tiny.py:smoke,drop=rlhf --workdir=/tmp/t \
      --config.stages.math_rl.optimizer.lr=1e-4 --config.sampler.slots=8 \
      --config.mesh.shape=1,2,1

`ml_collections.config_flags` overrides only a field the loaded config holds
with a non-None value, and reaches a list entry only by position.
`define_config_file` defines that flag with a parser of its own, which loads
the config file and, before the flag applies the overrides, readies the config
for the paths the command line names (`prepare`):

* a stage by name, `stages.<name>` (`stages["a-b"]` for a name that is not an
  identifier), as well as by position, `stages[2]`: a name stays with its
  stage when a config argument such as `drop=` moves the positions. The stage
  list is a `Stages` view while the flags parse; `finish` puts the list back.
* a field that the config's schema declares (the sections of `cascade.config`,
  the stage kinds of `cascade.kinds` and their optimizer, `models.config.
  ModelConfig` under `model.overrides`) but that the config leaves out or sets
  to None: the override is parsed as the declared type (`--config.sampler.
  slots=8` an int, `--config.mesh.shape=1,2,1` a tuple).
* anything else (a field no schema declares, a stage name or a position the
  config does not have, a field below an unset one) is refused, as is a config
  argument the config file refuses (`configs/tiny.py:smok`) or a config file
  that does not exist: one `OverrideError` line naming what was given and the
  nearest names.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import sys
import traceback
import types
import typing
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
from ml_collections import config_dict
from ml_collections import config_flags
from ml_collections.config_flags import config_path

from cascade import schema


class OverrideError(flags.Error):
  """A config file, config argument or `--config.<path>` override the run cannot take."""


def one_line(e: BaseException) -> str:
  """An exception's message on one line (a KeyError's without the quotes `str` adds)."""
  msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
  return ' '.join(str(msg).split()) or type(e).__name__


# ------------------------------------------------------------------ the flag

def define_config_file(name: str, help_string: str, *, flag_values: flags.FlagValues = flags.FLAGS,
                       argv: Sequence[str] | None = None) -> flags.FlagHolder:
  """`config_flags.DEFINE_config_file(name, lock_config=True)` whose file is loaded by `load` and
  readied by `prepare` for the overrides in `argv` (default: sys.argv, as config_flags reads it).

  Call `finish(holder.value)` once the flags are parsed.
  """
  holder = config_flags.DEFINE_config_file(name, None, help_string, flag_values=flag_values,
                                           lock_config=True, sys_argv=argv)
  flag_values[name].parser = _Parser(name, argv)
  return holder


class _Parser(flags.ArgumentParser):
  """Parses `--<name>=file.py[:arg]`: the config, readied for the overrides, then locked."""

  def __init__(self, name: str, argv: Sequence[str] | None):
    self.name, self._argv = name, argv

  def parse(self, argument):
    config = load(argument)
    if isinstance(config, config_dict.ConfigDict):
      argv = sys.argv if self._argv is None else self._argv
      prepare(config, override_paths(flags.FLAGS.read_flags_from_files(argv, force_gnu=False),
                                     self.name))
      config.lock()
    return config

  def flag_type(self):
    return 'config object'


# absl's help flags: absl prints the usage and exits 1 (a failure); asked for, help is no error.
_HELP = ('-?', '-h', '-help', '--help', '-helpshort', '--helpshort', '-helpfull', '--helpfull')


def flags_parser(holder: flags.FlagHolder) -> Callable[[list[str]], list[str]]:
  """An `app.run(main, flags_parser=...)` for a program whose `--config` is `holder`.

  It parses the flags as absl does; a bad config file, config argument or override stops the
  program with one `error:` line on stderr (exit status 2), and a parsed config gets `finish`.
  A help flag prints the main module's docstring and its flags (--helpfull: every flag) on
  stdout and exits 0, whatever else is given. cascade.main, launch.plan, launch.sweep and
  launch/xm_launch.py share it.
  """

  def parse(argv: list[str]) -> list[str]:
    _help_if_asked(argv)
    try:
      rest = holder._flagvalues(argv)  # pylint: disable=protected-access
    except flags.Error as e:
      _exit(one_line(e))
    except (IndexError, KeyError, AttributeError, TypeError, ValueError) as e:
      # What `prepare` let through and config_flags refused (e.g. a value of the wrong type).
      _exit(f'a --{holder.name} override: {one_line(e)}')
    finish(holder.value)
    return rest

  return parse


def plain_flags_parser(argv: list[str]) -> list[str]:
  """An `app.run(main, flags_parser=...)` for a program without `--config` (cascade.evaluate,
  cascade.device_check): help as `flags_parser` gives it (exit 0), a bad flag one `error:` line
  (exit 2)."""
  _help_if_asked(argv)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _exit(one_line(e))


def _help_if_asked(argv: list[str]) -> None:
  """A help flag among `argv` (before any `--`): the main module's docstring and its flags
  (--helpfull: every flag) on stdout, exit 0."""
  given = argv[1:argv.index('--')] if '--' in argv else argv[1:]
  asked = [a for a in given if a in _HELP]
  if asked:
    app.usage(shorthelp='full' not in asked[0], writeto_stdout=True)
    sys.exit(0)


def _exit(message: str):
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(2)


def given_overrides(argv: Sequence[str], name: str = 'config') -> list[str]:
  """The `--config.<path>=<value>` arguments of `argv`, as given (a launcher passes them on to
  every `cascade.main` it starts)."""
  return [a for a in argv if re.match(rf'-{{1,2}}(no)?{re.escape(name)}\.', a)]


def described(holder: flags.FlagHolder, argv: Sequence[str]) -> str:
  """The config a command line gave: its file (and argument) and its overrides, as given
  ('configs/tiny.py:smoke --config.seed=1'), for the run's start banner."""
  flag = holder._flagvalues[holder.name]  # pylint: disable=protected-access
  return ' '.join([config_flags.get_config_filename(flag), *given_overrides(argv, holder.name)])


def override_paths(argv: Sequence[str], name: str = 'config') -> list[str]:
  """The paths `argv` overrides, as config_flags reads them: `--config.a.b=1` -> 'a.b'."""
  out = []
  for arg in argv:
    m = re.match(rf'-{{1,2}}(no)?{re.escape(name)}\.', arg)
    if m:
      path = arg[m.end():].split('=', 1)[0]
      if path not in out:
        out.append(path)
  return out


def load(argument: str):
  """The config `get_config` of `file.py` returns (`file.py:arg`: `get_config(arg)`).

  Raises:
    OverrideError: there is no such file, the file does not run (a syntax error, a failed
      import) or defines no get_config, or get_config refuses the argument (a ValueError
      from it) or fails: one line, naming the file and line where the config's code raised.
  """
  path, colon, arg = argument.partition(':')
  if not os.path.isfile(path):
    raise OverrideError(f'--config={argument}: no such config file {path!r}')
  spec = importlib.util.spec_from_file_location('config_file_' + re.sub(r'\W', '_', path), path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise OverrideError(f'--config={argument}: {os.path.relpath(e.filename or path)}:{e.lineno}: '
                        f'{type(e).__name__}: {e.msg}') from None
  except Exception as e:  # pylint: disable=broad-except
    raise OverrideError(f'--config={argument}: {type(e).__name__}: {one_line(e)}'
                        f'{_raised_at(e)}') from None
  get_config = getattr(module, 'get_config', None)
  if not callable(get_config):
    raise OverrideError(f'--config={argument}: {path} defines no get_config(arg=None) function; a '
                        'config file is Python whose get_config returns the ConfigDict (see '
                        'configs/tiny.py)')
  try:
    return get_config(arg) if colon else get_config()
  except ValueError as e:          # the config's own refusal (of its argument): its message
    raise OverrideError(f'--config={argument}: {one_line(e)}') from None
  except TypeError as e:
    raise OverrideError(f'--config={argument}: {one_line(e)}{_raised_at(e)}') from None
  except Exception as e:  # pylint: disable=broad-except
    raise OverrideError(f'--config={argument}: {type(e).__name__}: {one_line(e)}'
                        f'{_raised_at(e)}') from None


def _raised_at(e: BaseException) -> str:
  """' (file:line)' of the innermost frame of a config's code an exception came from."""
  frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__
            and 'importlib' not in f.filename]
  return f' ({os.path.relpath(frames[-1].filename)}:{frames[-1].lineno})' if frames else ''


def finish(config) -> None:
  """Puts the plain stage list back in place of the `Stages` view (its entries as plain dicts)."""
  stages = _get(config, 'stages')
  if isinstance(stages, Stages):
    with config.ignore_type():
      config.stages = stages.plain()


# ------------------------------------------------------------------ stages by name

class Stages:
  """config.stages while the flags parse: an entry by position (`[2]`) or by name (`['math_rl']`).

  config_path reaches `stages.math_rl` as `stages['math_rl']` when the holder has no attribute
  of that name, so this class has no public attribute a stage name could collide with.
  """

  def __init__(self, entries):
    self.__type, self.__entries = type(entries), list(entries)

  def __len__(self):
    return len(self.__entries)

  def __iter__(self):
    return iter(self.__entries)

  def __contains__(self, key):
    return _find(self.__entries, key) is not None

  def __getitem__(self, key):
    return self.__entries[_locate(self.__entries, key)]

  def __setitem__(self, key, value):
    self.__entries[_locate(self.__entries, key)] = value

  def plain(self):
    """The entries as the config gave them (list or tuple), readied ones as plain dicts again."""
    return self.__type(e.to_dict() if isinstance(e, config_dict.ConfigDict) else e
                       for e in self.__entries)


def _stage_names(entries) -> list[str]:
  return [str(_get(e, 'name')) for e in entries if isinstance(_get(e, 'name'), str)]


def _find(entries, key) -> int | None:
  if isinstance(key, bool):
    return None
  if isinstance(key, int):
    return key % len(entries) if -len(entries) <= key < len(entries) else None
  if isinstance(key, str):
    return next((i for i, e in enumerate(entries) if _get(e, 'name') == key), None)
  return None


def _locate(entries, key) -> int:
  i = _find(entries, key)
  if i is None:
    raise (IndexError if isinstance(key, int) else KeyError)(key)
  return i


# ------------------------------------------------------------------ the schema

@dataclasses.dataclass(frozen=True)
class _Entries:
  """A mapping of named entries, each with the fields of `of` (config.datasets, .domains)."""
  of: Any


_STAGES = 'stages'     # the schema node of config.stages: an entry's kind gives its fields


def _root() -> dict[str, Any]:
  """config's sections and what each holds (cascade.config.SECTIONS)."""
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib
  return {'seed': int, 'allow_config_change': bool, 'model': c.Model, 'tokenizer': c.Tokenizer,
          'mesh': c.Mesh, 'sampler': c.Sampler, 'ckpt': c.Ckpt, 'eval': c.Eval,
          'divergence': c.Divergence, 'hardware': c.Hardware,
          'compilation_cache': c.CompilationCache, 'logging': c.Logging, 'prepare': c.Prepare,
          'guard': c.Guard,
          'data_cache': str,
          'datasets': _Entries(c.Dataset), 'domains': _Entries(c.Domain), 'stages': _STAGES}


def _fields(node) -> dict[str, Any]:
  """Field name -> declared type of a schema node ({} for a free-form mapping)."""
  if isinstance(node, dict):
    return node
  if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
    return {}
  hints = typing.get_type_hints(node)
  return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(node)
          if f.metadata.get('user', True)}


def _none():
  return None


def _child(parent: Callable[[], Any], key) -> Any:
  """The schema node of field `key` of `parent()` (None: free-form or a plain value)."""
  node = parent()
  if isinstance(node, _Entries):
    return node.of
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  if node is config_lib.Model and key == 'overrides':
    from models import config as model_config  # pylint: disable=g-import-not-at-top
    return model_config.ModelConfig
  if node is config_lib.Eval and key == 'domains':
    hints = typing.get_type_hints(config_lib.Eval)
    return _Entries({k: hints[k] for k in config_lib.EVAL_DOMAIN_FIELDS})
  t = _without_none(_fields(node).get(key))
  if isinstance(t, (_Entries, dict)) or t is _STAGES:
    return t
  return t if isinstance(t, type) and dataclasses.is_dataclass(t) else None


def _stage_node(entry) -> Any:
  from cascade import kinds  # pylint: disable=g-import-not-at-top
  kind = kinds.KINDS.get(_get(entry, 'kind'))
  return None if kind is None else kind.config


def _without_none(t):
  if typing.get_origin(t) in (typing.Union, types.UnionType):
    rest = [a for a in typing.get_args(t) if a is not type(None)]
    return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]
  return t


def _flag_type(t) -> type:
  """The config_flags type an override of a field declared `t` parses as."""
  t = _without_none(t)
  if t in (int, float, bool, str):
    return t
  if t is tuple or typing.get_origin(t) is tuple:
    return tuple
  return object     # a Python literal (ml_collections' literal parser), else a string


# ------------------------------------------------------------------ prepare

def prepare(config: config_dict.ConfigDict, paths: Sequence[str]) -> None:
  """Readies an unlocked config for overrides of `paths` (config_path syntax: 'a.b[2].c').

  config.stages becomes a `Stages` view; a declared field that is absent or None becomes a
  typed placeholder (in a stage, the stage is a ConfigDict until `finish`).

  Raises:
    OverrideError: the first path the config cannot take, naming the nearest names.
  """
  stages = _get(config, 'stages')
  if isinstance(stages, (list, tuple)):
    with config.ignore_type():
      config.stages = Stages(stages)
  for path in paths:
    _prepare(config, path)


def _prepare(config, path: str) -> None:
  fail = lambda msg: OverrideError(f'--config.{path}: {msg}')
  try:
    parts = config_path.split(path)
  except ValueError:
    raise fail('not a field path (a.b, a[2].b, stages.<name>.b, or stages["<name>"].b for a '
               'name that is not an identifier)') from None
  # node() is the schema of `holder`, looked up only when needed (cascade.kinds imports JAX).
  holder, node, where = config, _root, 'config'
  stage: tuple[Stages, int] | None = None     # the stage the path is in (view, position)
  for i, key in enumerate(parts):
    last = i == len(parts) - 1
    if isinstance(holder, Stages):
      pos = _find(list(holder), key)
      if pos is None:
        raise fail(_no_stage(holder, key))
      stage, where = (holder, pos), _where(where, key)
      holder, node = holder[pos], functools.partial(_stage_node, holder[pos])
      continue
    if isinstance(holder, (list, tuple)):
      if not isinstance(key, int) or isinstance(key, bool) or _find(holder, key) is None:
        raise fail(f'{where} is a list of {len(holder)}: no [{key!r}]')
      holder, node, where = holder[key], _none, _where(where, key)
      continue
    if not hasattr(holder, 'keys'):
      raise fail(f'{where} is a value ({type(holder).__name__}), not a section: it has no '
                 f'field {key!r}')
    present = key in holder and holder[key] is not None
    if not last:
      if not present:
        declared = _fields(node())
        if key in holder or key in declared:
          whole = '[...]' if _flag_type(declared.get(key)) is tuple else '{...}'
          raise fail(f'{_where(where, key)} is not set in this config: set it whole, e.g. '
                     f"--config.{_path(where, key)}='{whole}'")
        raise fail(_no_field(where, key, list(holder.keys()) + list(_fields(node()))))
      holder, node, where = holder[key], functools.partial(_child, node, key), _where(where, key)
      continue
    if present or (isinstance(holder, config_dict.ConfigDict) and key in holder
                   and holder.get_type(key) is not type(None)):
      return          # config_flags parses it as the type of its value (or of its placeholder)
    declared = _fields(node())
    if key in declared:
      kind = _flag_type(declared[key])
    elif key in holder:           # None in a free-form mapping: any Python literal
      kind = object
    else:
      raise fail(_no_field(where, key, list(holder.keys()) + list(declared)))
    if isinstance(holder, config_dict.ConfigDict):
      with holder.unlocked(), holder.ignore_type():
        holder[key] = config_dict.placeholder(kind)
      return
    if stage is None or isinstance(stage[0][stage[1]], config_dict.ConfigDict):
      raise fail(f'{where} is a plain {type(holder).__name__}: {key!r} cannot be set in it')
    view, pos = stage          # a stage is a plain dict: ready it as a ConfigDict, then again
    view[pos] = config_dict.ConfigDict(view[pos])
    _prepare(config, path)
    return


def _get(cfg, key):
  try:
    return cfg[key] if key in cfg else None
  except TypeError:
    return None


def _where(where: str, key) -> str:
  return f'{where}.{key}' if isinstance(key, str) and key.isidentifier() else f'{where}[{key!r}]'


def _path(where: str, key) -> str:
  return _where(where, key).partition('.')[2]


def _no_field(where: str, key, names: list[str]) -> str:
  return f'{where} has no field {key!r} ({schema.nearest(key, names)})'


def _no_stage(view: Stages, key) -> str:
  names = _stage_names(view)
  if isinstance(key, int) and not isinstance(key, bool):
    return (f'config.stages has {len(view)} stages, no [{key}] (by position: '
            + ', '.join(f'[{i}] {n}' for i, n in enumerate(names)) + ')')
  return f'config.stages has no stage named {key!r} ({schema.nearest(key, names)})'
