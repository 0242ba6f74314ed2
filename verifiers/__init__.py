"""Host-side reward functions, one per domain, chosen by name.

    v = verifiers.get('math', workers=2, timeout_s=10)
    results = v.score([verifiers.Sample(prompt, completion, {'answer': '1/2'})])
    results[0].reward, results[0].info

Domain modules are imported on first use, so importing this package is cheap
(no jax, no sympy) and safe in worker processes.
"""

from __future__ import annotations

from typing import Any, Mapping

from foundation import registry
from verifiers.base import Result
from verifiers.base import Sample
from verifiers.base import Verifier

# name -> 'module:Class' for the built-in domains (imported lazily).
_BUILTIN = {
    'math': 'verifiers.math:MathVerifier',
    'instruction_following': 'verifiers.instruction_following:InstructionFollowingVerifier',
    'ifbench': 'verifiers.ifbench:IFBenchVerifier',
    'code': 'verifiers.code:CodeVerifier',
    'swe': 'verifiers.swe:SweVerifier',
    'structured': 'verifiers.structured:StructuredVerifier',
    'mcqa': 'verifiers.mcqa:McqaVerifier',
    'tool_call': 'verifiers.tool_call:ToolCallVerifier',
    'long_context_qa': 'verifiers.long_context_qa:LongContextQaVerifier',
    'reward_model': 'verifiers.reward_model:RewardModelVerifier',
    'judge': 'verifiers.judge:JudgeVerifier',
}
_registry = registry.Registry('verifier', Verifier, _BUILTIN)

__all__ = ['Result', 'Sample', 'Verifier', 'cls', 'get', 'names', 'register', 'validate']


def register(name: str, cls: type[Verifier]) -> None:
  """Adds a Verifier subclass under `name`.

  Raises:
    ValueError: the name is taken or `cls` is not a Verifier subclass.
  """
  _registry.register(name, cls)


def names() -> list[str]:
  """Registered verifier names."""
  return _registry.names()


def cls(name: str) -> type[Verifier]:
  """The class registered under `name` (its class attributes say what it takes, e.g.
  `reward_model_option`), imported on first use.

  Raises:
    ValueError: no such name.
  """
  return _registry.cls(name)


def get(name: str, **options: Any) -> Verifier:
  """Builds the verifier registered under `name`.

  Args:
    name: e.g. 'math', 'instruction_following', 'ifbench', 'code', 'swe', 'structured',
      'mcqa', 'tool_call', 'long_context_qa', 'reward_model', 'judge'.
    **options: the verifier's keyword options (see its class); common ones are
      thinking_unfinished_reward, workers and timeout_s.

  Returns:
    A Verifier; use it as a context manager or call close() when done.
  """
  return _registry.cls(name)(**options)


def validate(name: str, metadata: Mapping[str, Any], where: str, **options: Any) -> None:
  """Checks one dataset record's metadata for verifier `name`, without building it.

  Args:
    name: the verifier name.
    metadata: the record's metadata dict.
    where: names the record in the error, e.g. 'data/math.jsonl:17'.
    **options: the verifier options that change what is valid (swe's
      `execution`); others are ignored.

  Raises:
    ValueError: malformed metadata, with `where` and the field in the message.
  """
  _registry.cls(name).validate_metadata_for(metadata, where, **options)
