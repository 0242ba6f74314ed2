"""The environment interface of agentic (multi-turn, tool-calling) rollouts.

An environment holds many episodes at once and is driven in batches by the
rollout (`cascade/episodes.py`), which renders conversations, samples the
policy and appends the observations:

    env = envs.get('tool_use', workers=2)
    episodes = env.reset(records)                  # one episode per rollout row
    episodes[i].messages                           # the opening conversation
    env.tools(records[i])                          # the tool schemas it accepts
    steps = env.step(episodes, actions)            # actions: assistant turns (text)
    steps[i].messages, steps[i].done, steps[i].reward, steps[i].info
    steps = env.finish(episodes, reasons)          # episodes cut short by a limit
    env.close()

An assistant turn with `<tool_call>` blocks (see `foundation.chat.parse_tool_calls`)
is a tool turn: every call is checked against the tool's JSON schema and
executed, and the results (or one error line per malformed or failed call)
come back as 'tool' messages. A turn without any tool-call block is the final
answer: the episode ends and the environment scores it. Model text never
makes `step` raise: malformed calls, unknown tools, bad arguments and tool
failures are observations; only a failure of the environment itself (its
sandbox cannot start) raises.

An exception from `_score` costs only the episodes it is raised for: each scores
0 with the reason, as a verifier's sample does (`verifiers.base`). When a fresh
episode of the same record raises as well with each of the verifiers' fixed
`PROBE_ANSWERS` as its final answer, the exception does not depend on what the
model did, so the environment's own code is at fault: the info then carries
'verifier_error' (the exception and its last frame) and 'verifier'
('env:<name>'), which the run counts and stops on (`cascade.verifier_set`).

Subclasses supply `tools`, `_check_metadata`, `_start` (per-episode state),
`_execute` (a batch of calls, all episodes together, so a sandboxed tool runs
them in parallel) and `_score` (a batch of final answers or cut episodes).
Episode state lives in `Episode.state` on the host; tools see only their own
episode's state, so no episode can reach another's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

import jsonschema

from foundation import chat
from verifiers import base as verifiers_base
from verifiers import sandbox as sandbox_lib
from verifiers import structured

# Characters of one tool result shown to the model; longer results are cut.
MAX_OBSERVATION_CHARS = 4000


@dataclasses.dataclass
class Episode:
  """One rollout row's episode.

  Attributes:
    record: the dataset record (canonical: messages, metadata, domain).
    messages: the conversation so far as messages (opening turns, assistant
      turns, tool results).
    state: the environment's private per-episode state.
    turns: assistant turns taken.
    tool_calls: tool calls executed (well-formed ones).
    tool_errors: malformed calls, unknown tools, bad arguments and failed calls.
    done: the episode has ended (final answer or `finish`).
  """
  record: Mapping[str, Any]
  messages: list
  state: Any = None
  turns: int = 0
  tool_calls: int = 0
  tool_errors: int = 0
  done: bool = False


@dataclasses.dataclass(frozen=True)
class Step:
  """What one `step` (or `finish`) gives an episode.

  Attributes:
    messages: messages to append to the conversation (role 'tool'); empty
      when the episode ended.
    done: the episode ended.
    reward: the episode's reward when done (0.0 while not done).
    info: JSON-serialisable details; 'reason' when done.
  """
  messages: tuple = ()
  done: bool = False
  reward: float = 0.0
  info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Call:
  """A checked call waiting for `_execute`: its episode and the parsed call."""
  episode: Episode
  call: chat.ToolCall


class ToolError(Exception):
  """Raised (or returned) by a tool for a failure the model should read, e.g. 'no such file'."""


def tool_message(name: str, content: str) -> dict:
  """A 'tool' message holding one call's result (markers defused), cut to MAX_OBSERVATION_CHARS.

  Chat and tool markers inside a tool's output would read as structure once
  tokenized (a fake end of turn or tool response): `chat.defuse` writes their
  '<' as '&lt;'. The tokenizer's other added tokens are defused where the
  observation is rendered for it (`chat.render_observation(markers=...)`).
  """
  content = chat.defuse(content)
  if len(content) > MAX_OBSERVATION_CHARS:
    content = content[:MAX_OBSERVATION_CHARS] + f'\n[... cut at {MAX_OBSERVATION_CHARS} characters]'
  return {'role': 'tool', 'name': name, 'content': content}


def function_schema(name: str, description: str, properties: Mapping[str, Any],
                    required: Sequence[str] = ()) -> dict:
  """A tool schema in the OpenAI / Qwen3 function format."""
  return {'type': 'function',
          'function': {'name': name, 'description': description,
                       'parameters': {'type': 'object', 'properties': dict(properties),
                                      'required': list(required),
                                      'additionalProperties': False}}}


class Environment:
  """Base class; see the module docstring."""

  name = ''

  def __init__(self, *, max_calls_per_turn: int = 4):
    """Common options.

    Args:
      max_calls_per_turn: tool calls executed per assistant turn; calls past
        it get an error observation.
    """
    if max_calls_per_turn < 1:
      raise ValueError(f'{self.name}: max_calls_per_turn must be >= 1, got {max_calls_per_turn}')
    self.max_calls_per_turn = int(max_calls_per_turn)

  # -- what subclasses supply ------------------------------------------------

  def tools(self, record: Mapping[str, Any]) -> list[dict]:
    """The tool schemas (`function_schema`) an episode of `record` may call."""
    raise NotImplementedError

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any]) -> None:
    """Raises ValueError (without the record's name) when the record's metadata is malformed."""
    if not isinstance(metadata, Mapping):
      raise ValueError(f'metadata must be a dict, got {type(metadata).__name__}')

  def _start(self, record: Mapping[str, Any]) -> Any:
    """The per-episode state of a new episode of `record`."""
    return None

  def _execute(self, calls: Sequence[Call]) -> list[str | ToolError]:
    """Runs a batch of checked calls (arguments valid for their schema).

    Returns:
      One result text or ToolError per call, in order. Raising is for a
      failure of the environment itself only.
    """
    raise NotImplementedError

  def _score(self, episodes: Sequence[Episode], answers: Sequence[str | None]) -> list[tuple]:
    """Rewards of ended episodes.

    Args:
      episodes: the ended episodes.
      answers: each one's final answer text (after the thinking block), or
        None for an episode cut short by a limit (`finish`).

    Returns:
      One (reward, info) per episode; info has 'reason'.
    """
    raise NotImplementedError

  # -- the interface ---------------------------------------------------------

  @classmethod
  def validate_metadata(cls, metadata: Mapping[str, Any], where: str) -> None:
    """Checks a record's metadata at load time; ValueError names `where` and the field."""
    try:
      cls._check_metadata(metadata)
    except ValueError as e:
      raise ValueError(f'{where}: {e}') from None

  def reset(self, records: Sequence[Mapping[str, Any]]) -> list[Episode]:
    """One new episode per record (records may repeat: G episodes of one task)."""
    return [Episode(record=r, messages=[dict(m) for m in r['messages']], state=self._start(r))
            for r in records]

  def step(self, episodes: Sequence[Episode], actions: Sequence[str]) -> list[Step]:
    """Applies one assistant turn to each episode (all episodes in one batch).

    Args:
      episodes: live episodes.
      actions: each episode's sampled assistant turn (decoded, may end with
        `<|im_end|>`).

    Returns:
      One Step per episode.
    """
    if len(episodes) != len(actions):
      raise ValueError(f'step: {len(episodes)} episodes but {len(actions)} actions')
    pending: list[tuple[int, int, Call]] = []      # (episode, slot in its results, call)
    results: list[list] = []
    finals: list[tuple[int, str]] = []
    for i, (ep, action) in enumerate(zip(episodes, actions)):
      if ep.done:
        raise ValueError(f'step: episode {i} has already ended')
      ep.turns += 1
      ep.messages.append({'role': 'assistant', 'content': action})
      turn = chat.parse_tool_calls(action)
      out: list = []
      results.append(out)
      if not turn.finished_thinking or not turn.is_tool_turn:
        # An unfinished thinking block ends the episode too: the rollout stops
        # a turn only at the end of a message, so there is no call to wait for.
        finals.append((i, turn.content if turn.finished_thinking else None))
        continue
      for e in turn.errors:
        out.append(tool_message('error', f'error: {e}'))
        ep.tool_errors += 1
      names = {t['function']['name']: t['function'] for t in self.tools(ep.record)}
      for k, call in enumerate(turn.calls):
        if k >= self.max_calls_per_turn:
          out.append(tool_message(call.name, f'error: more than {self.max_calls_per_turn} '
                                             'tool calls in one turn; this one was not run'))
          ep.tool_errors += 1
          continue
        why = _check_call(call, names)
        if why:
          out.append(tool_message(call.name, f'error: {why}'))
          ep.tool_errors += 1
          continue
        out.append(None)
        pending.append((i, len(out) - 1, Call(ep, call)))
    if pending:
      executed = self._execute([c for _, _, c in pending])
      if len(executed) != len(pending):
        raise RuntimeError(f'{self.name}: _execute returned {len(executed)} results for '
                           f'{len(pending)} calls')
      for (i, slot, c), res in zip(pending, executed):
        ep = episodes[i]
        if isinstance(res, ToolError):
          ep.tool_errors += 1
          results[i][slot] = tool_message(c.call.name, f'error: {res}')
        else:
          ep.tool_calls += 1
          results[i][slot] = tool_message(c.call.name, str(res))
    steps: list[Step | None] = [None] * len(episodes)
    if finals:
      ended = [episodes[i] for i, _ in finals]
      for (i, _), (reward, info) in zip(finals, self._scored(ended, [a for _, a in finals])):
        episodes[i].done = True
        steps[i] = Step(done=True, reward=float(reward), info=dict(info))
    for i, out in enumerate(results):
      if steps[i] is None:
        episodes[i].messages.extend(out)
        steps[i] = Step(messages=tuple(out))
    return steps

  def finish(self, episodes: Sequence[Episode], reasons: Sequence[str]) -> list[Step]:
    """Ends episodes cut short by a limit (turns, tokens); scores them as the environment does
    for an episode without a final answer."""
    steps = []
    for ep, (reward, info), why in zip(episodes, self._scored(episodes, [None] * len(episodes)),
                                       reasons):
      ep.done = True
      steps.append(Step(done=True, reward=float(reward), info=dict(info, cut=why)))
    return steps

  def _scored(self, episodes: Sequence[Episode], answers: Sequence[str | None]) -> list[tuple]:
    """`_score`, an exception costing only the episodes it is raised for (module docstring); a
    sandbox that cannot start still raises."""
    try:
      return self._score(episodes, answers)
    except sandbox_lib.SandboxUnavailable:
      raise
    except Exception as e:  # pylint: disable=broad-except
      if len(episodes) == 1:
        return [self._failed(episodes[0], e)]
    out = []
    for ep, answer in zip(episodes, answers):
      try:
        out += self._score([ep], [answer])
      except sandbox_lib.SandboxUnavailable:
        raise
      except Exception as e:  # pylint: disable=broad-except
        out.append(self._failed(ep, e))
    return out

  def _failed(self, episode: Episode, e: Exception) -> tuple:
    """(0, info) of an episode whose scoring raised `e`."""
    info = {'reason': f'error: {type(e).__name__}: {e}'}
    own = self.own_error(episode.record)
    if own is not None:
      info.update(verifier_error=own, verifier=f'env:{self.name}')
    return 0.0, info

  def own_error(self, record: Mapping[str, Any]) -> str | None:
    """The error `_score` raises on a fresh episode of `record` with every one of the verifiers'
    `PROBE_ANSWERS` as its final answer, on one line with its last frame; None when one of them
    scores."""
    errors = []
    for text in verifiers_base.PROBE_ANSWERS:
      try:
        self._score(self.reset([record]), [text])
      except sandbox_lib.SandboxUnavailable:
        raise
      except Exception as e:  # pylint: disable=broad-except
        errors.append(verifiers_base.describe(e))
        continue
      return None
    return errors[0]

  def close(self) -> None:
    """Releases what the environment holds (sandbox servers)."""

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _check_call(call: chat.ToolCall, functions: Mapping[str, dict]) -> str:
  """Why a parsed call cannot run ('' when it can): an unknown tool or arguments off its schema."""
  fn = functions.get(call.name)
  if fn is None:
    return f'unknown tool {call.name!r}; tools: {", ".join(sorted(functions)) or "none"}'
  # One cached validator per tool schema (checking the schema on every call cost ~2 ms).
  schema = dumps(fn.get('parameters') or {'type': 'object'})
  why = structured.schema_error(schema)
  if why:
    raise ValueError(f'tool {call.name!r}: its parameters are not a valid JSON Schema: {why}')
  errors = structured.validator(schema).iter_errors(call.arguments)
  error = jsonschema.exceptions.best_match(errors)
  if error is not None:
    where = '/'.join(str(p) for p in error.absolute_path) or 'arguments'
    return f'{call.name}: {where}: {error.message[:300]}'
  return ''


def dumps(value: Any) -> str:
  """Compact, deterministic JSON for observations."""
  return json.dumps(value, sort_keys=True, separators=(', ', ': '), ensure_ascii=False)
