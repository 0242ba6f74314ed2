"""Which chat template renders the policy's prompts: the built-in one or a checkpoint's own.

Host-only (no jax import).

  tmpl = chat_template.load('/ckpt/Nemotron-Cascade-8B')   # its tokenizer_config.json's template
  text = tmpl.render(messages, thinking=False)               # what apply_chat_template renders
  tok = chat_template.attach(tokenizer.load(path), tmpl)     # the run's tokenizer carries it
  chat_template.of(tok).render(messages)                     # BUILTIN when none is attached

`BUILTIN` is `foundation.chat.render` (Qwen3 ChatML with the ' /think' / ' /no_think'
switch). `CheckpointTemplate` renders a checkpoint's own Jinja template the way
`transformers`' `apply_chat_template` does: a sandboxed (immutable) Jinja
environment with trim_blocks and lstrip_blocks, the loop-control extension, the
`{% generation %}` tag (rendered as its body), `raise_exception`, `strftime_now`, a
`tojson` that keeps non-ASCII and does not escape HTML, a `namespace` that refuses
underscore names, `tools` and `documents` always defined (None when not given), and
the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables. The
template is the directory's `chat_template.jinja` when there is one (transformers 4.50+
saves it there), else `tokenizer_config.json`'s `chat_template` (a string, or a list of
named templates of which 'default' is taken).

The thinking switch is mapped to whatever the template has:
  'kwarg'   the template reads `enable_thinking` (Qwen3, and our own TEMPLATE):
            thinking=True/False is passed as `enable_thinking`.
  'marker'  the template looks for '/no_think' in the messages (Nemotron-style
            templates): ' /think' or ' /no_think' is appended to the last user
            message, as Nemotron-Cascade writes it.
  None      no switch (Llama-3): only thinking=None renders; a mode is a ValueError
            naming the template, never a silently ignored switch.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import json
from typing import Any, Mapping, Sequence

import jinja2
from jinja2 import ext as jinja_ext
from jinja2 import meta as jinja_meta
from jinja2 import sandbox as jinja_sandbox

from foundation import chat
from foundation import paths

# What config.tokenizer.chat_template may name.
CHOICES = ('builtin', 'checkpoint')
_SPECIAL_KEYS = ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token',
                 'mask_token')
_MARKERS = (' /think', ' /no_think')


class Builtin:
  """The built-in template: `foundation.chat.render` (Qwen3 ChatML, ' /think' / ' /no_think')."""

  @staticmethod
  def render(messages: Sequence[Mapping[str, Any]], *, thinking: bool | None = None,
             add_generation_prompt: bool = True,
             tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    return chat.render(messages, thinking=thinking, add_generation_prompt=add_generation_prompt,
                       tools=tools)

  @staticmethod
  def render_response(messages: Sequence[Mapping[str, Any]], answer: str,
                      thinking: str | None, mode: bool | None) -> str:
    """The assistant text a model should produce after `render(messages, thinking=mode)`."""
    del messages
    return chat.render_response(answer, thinking if mode is not False else None)


BUILTIN = Builtin()


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # transformers' filter: Jinja's own escapes HTML characters; this one is json.dumps.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


class _Generation(jinja_ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens with
  it): rendered as its body."""
  tags = {'generation'}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


class _Namespace(jinja2.utils.Namespace):
  """Jinja's `namespace` refusing underscore names, as transformers' (no path to internals)."""

  def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith('_'):
      raise jinja2.exceptions.SecurityError(f'a namespace attribute may not start with _: '
                                            f'{name!r}')


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> tuple[jinja2.Template, frozenset]:
  """The template compiled as transformers compiles it, and the variables it reads."""
  env = jinja_sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja_ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals['raise_exception'] = _raise_exception
  env.globals['strftime_now'] = _strftime_now
  env.globals['namespace'] = _Namespace
  names = frozenset(jinja_meta.find_undeclared_variables(env.parse(source)))
  return env.from_string(source), names


@dataclasses.dataclass(frozen=True)
class CheckpointTemplate:
  """A checkpoint's own Jinja chat template.

  Attributes:
    source: the template's text.
    special_tokens: bos_token, eos_token, ... as the tokenizer config names them (the
      variables transformers gives the template).
    where: the file it came from (for messages).
  """
  source: str
  special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
  where: str = 'chat template'

  def __post_init__(self):
    try:
      _compile(self.source)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f'{self.where}: the chat template does not compile: {e}') from None

  @property
  def switch(self) -> str | None:
    """How the thinking switch reaches the template: 'kwarg', 'marker' or None (module doc)."""
    if 'enable_thinking' in _compile(self.source)[1]:
      return 'kwarg'
    if '/no_think' in self.source:
      return 'marker'
    return None

  def render(self, messages: Sequence[Mapping[str, Any]], *, thinking: bool | None = None,
             add_generation_prompt: bool = True,
             tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The conversation as `apply_chat_template(messages, tokenize=False, ...)` renders it.

    Args:
      messages: dicts with 'role' and 'content' (and whatever else the template reads).
      thinking: True / False: the thinking switch, mapped as `switch` says; None: none.
      add_generation_prompt: end with the opening of an assistant turn.
      tools: tool schemas, passed as `tools` (None: `tools` is None, as transformers passes it).

    Returns:
      The prompt text.

    Raises:
      ValueError: a mode for a template without a switch, or the template raising (its
        `raise_exception` or an error while rendering), naming the template's file.
    """
    msgs = [dict(m) for m in messages]
    kwargs: dict[str, Any] = dict(self.special_tokens)
    if thinking is not None:
      switch = self.switch
      if switch is None:
        raise ValueError(f'{self.where}: the chat template has no thinking switch (neither '
                         f'enable_thinking nor /no_think): thinking={thinking} cannot be '
                         'rendered; draw prompts without a mode (thinking_fraction=None)')
      if switch == 'kwarg':
        kwargs['enable_thinking'] = thinking
      else:
        last = max((i for i, m in enumerate(msgs) if m.get('role') == 'user'), default=-1)
        if last >= 0:
          msgs[last]['content'] = f"{msgs[last]['content']}{_MARKERS[0 if thinking else 1]}"
    try:
      return _compile(self.source)[0].render(
          messages=msgs, tools=None if tools is None else list(tools), documents=None,
          add_generation_prompt=add_generation_prompt, **kwargs)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f'{self.where}: the chat template failed: {e}') from None

  def render_response(self, messages: Sequence[Mapping[str, Any]], answer: str,
                      thinking: str | None, mode: bool | None) -> str:
    """The assistant text a model should produce after `render(messages, thinking=mode)`.

    It is what the template renders for the conversation with the answer appended (its
    thinking inside `<think>` unless mode is False), after the generation prompt.

    Raises:
      ValueError: the template does not render an assistant turn as a continuation of its
        generation prompt (then its responses cannot be learned token by token).
    """
    content = answer if thinking is None or mode is False else (
        f'{chat.THINK_OPEN}\n{thinking}\n{chat.THINK_CLOSE}\n\n{answer}')
    prompt = self.render(messages, thinking=mode)
    whole = self.render([*messages, {'role': 'assistant', 'content': content}], thinking=mode,
                        add_generation_prompt=False)
    if not whole.startswith(prompt):
      raise ValueError(f'{self.where}: the chat template does not render an assistant turn as '
                       'the continuation of its generation prompt, so a response cannot be '
                       'cut from it')
    return whole[len(prompt):]


def read(path: str) -> CheckpointTemplate:
  """The chat template of a checkpoint or tokenizer directory (or of a tokenizer.json's).

  Args:
    path: a directory holding tokenizer_config.json (and maybe chat_template.jinja), or a
      file inside one (its tokenizer.json); local or gs://.

  Returns:
    The CheckpointTemplate.

  Raises:
    ValueError: no template there, or one that does not compile (naming the file).
  """
  p = paths.path(path)
  folder = p if paths.isdir(p) else p.parent
  config_file = folder / 'tokenizer_config.json'
  config = paths.read_json(config_file, {})
  specials = {}
  for key in _SPECIAL_KEYS:
    value = config.get(key)
    value = value.get('content') if isinstance(value, dict) else value
    if isinstance(value, str):
      specials[key] = value
  jinja_file = folder / 'chat_template.jinja'
  if paths.exists(jinja_file):
    return CheckpointTemplate(paths.read_text(jinja_file), specials, str(jinja_file))
  source = config.get('chat_template')
  if isinstance(source, list):
    named = {t.get('name'): t.get('template') for t in source if isinstance(t, dict)}
    source = named.get('default')
  if not isinstance(source, str) or not source:
    raise ValueError(f'{config_file}: no chat_template (nor {jinja_file}): the checkpoint has '
                     "no template of its own; use config.tokenizer.chat_template='builtin'")
  return CheckpointTemplate(source, specials, f'{config_file}: chat_template')


def attach(tokenizer, template):
  """A shallow copy of `tokenizer` that carries `template` (what `of` gives back)."""
  tok = copy.copy(tokenizer)
  tok.chat_template = template
  return tok


def of(tokenizer):
  """The chat template `tokenizer` carries (`attach`), BUILTIN when none (or no tokenizer)."""
  return getattr(tokenizer, 'chat_template', None) or BUILTIN
