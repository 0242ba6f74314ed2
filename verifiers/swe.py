"""SWE verifier (agentless): a predicted unified diff against the gold patch.

Lexical mode (the paper's execution-free reward): -1 if the answer holds no
parsable diff, 0 if the diff changes nothing, 1 if its changes equal the
gold patch's after normalisation (per file: the '-'/'+' lines without
context, line numbers or trailing whitespace), else the difflib similarity
ratio of the two normalised change texts, kept inside (0, 1).
Metadata: {'gold_patch': str}.

Semantic judge (`judge=`, lexical mode only): where the lexical rule gives
neither 1 nor 0 (nor -1), the reward is instead a judge model's P(YES) to
"does this patch fix the same issue as the reference patch?" from its
next-token logits (`verifiers.judge`, template `judge_template`; one batched
forward for the batch), kept inside (0, 1) like the ratio, as Cascade 1's
SWE reward does; info keeps the ratio as 'similarity' and adds 'p_yes'. The
patch is defused and fenced as every judge field is; a judge prompt that does
not fit gets `judge_reject_reward`, logged. Without a judge the ratio stays.

Execution mode (`execution=True`): the patch, its paths normalised by the
sandbox's rule as the agentic SWE environment's tools normalise theirs
(`verifiers.sandbox.server.normalize_path`: '..notes.txt' is a file name, a
path with '..' as a component does not apply), is applied to a copy of a
small repository given in the record and the record's test program runs in the
sandbox (`verifiers.sandbox.server`'s 'check' mode: the test runs in a judge process
and imports the repository's top-level modules from the candidate's process
through `verifiers.sandbox.bridge`, so only plain data crosses and comparison
objects or forged exits cannot pass it; `sys.exit` counts as failure; the
test may use the repository's functions, plain-data values and objects, but
candidate objects compare equal only to themselves). Reward 1 if it passes, 0 if it fails, the
patch changes nothing or does not apply, -1 if unparsable.
Metadata: {'repo': {path: text}, 'test': str, 'gold_patch': str (optional)}.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import posixpath
from typing import Any, Mapping, Sequence

from verifiers import base
from verifiers import sandbox
from verifiers import unidiff
from verifiers.sandbox import pool as pool_lib
from verifiers.sandbox import server as sandbox_server

# Similarity is kept in [_EPS, 1 - _EPS] so it never reads as 'no change'
# or 'exact match'.
_EPS = 1e-3


@functools.lru_cache(maxsize=1024)
def _gold(gold_patch: str):
  return unidiff.parse(unidiff.extract(gold_patch))


def lexical_reward(answer: str, gold_patch: str) -> tuple[float, dict]:
  """The paper's reward for one answer (see the module docstring).

  Args:
    answer: the text after the thinking block.
    gold_patch: the reference diff.

  Returns:
    (reward, info).
  """
  try:
    pred = unidiff.parse(unidiff.extract(answer))
  except ValueError as e:
    return -1.0, {'reason': f'unparsable diff: {e}'}
  if unidiff.is_noop(pred):
    return 0.0, {'reason': 'the patch changes nothing'}
  gold = _gold(gold_patch)
  if unidiff.changes(pred) == unidiff.changes(gold):
    return 1.0, {'reason': 'exact match with the gold patch'}
  ratio = difflib.SequenceMatcher(None, unidiff.render_changes(pred),
                                  unidiff.render_changes(gold)).ratio()
  return min(max(ratio, _EPS), 1 - _EPS), {'reason': 'lexical similarity to the gold patch',
                                            'similarity': ratio}


def _top_level_modules(files: Mapping[str, str]) -> list[str]:
  """Names the repository's files can be imported by: 'calc' for calc.py, 'pkg' for pkg/..."""
  names = set()
  for path in files:
    parts = posixpath.normpath(path).split('/')
    if len(parts) > 1:
      names.add(parts[0])
    elif parts[0].endswith('.py'):
      names.add(parts[0][:-3])
  return sorted(n for n in names if n.isidentifier())


def _confined(fp: unidiff.FilePatch) -> unidiff.FilePatch:
  """A file patch whose paths are normalised by the sandbox's rule, which writes them.

  Raises:
    ValueError: a path the rule refuses ('..' as a component, absolute, ...).
  """
  old, new = (p if p == unidiff.DEV_NULL else sandbox_server.normalize_path(p, 'the repository')
              for p in (fp.old_path, fp.new_path))
  return dataclasses.replace(fp, old_path=old, new_path=new)


def work(payload: dict) -> dict:
  """Worker side of lexical mode."""
  reward, info = lexical_reward(payload['answer'], payload['gold_patch'])
  return {'reward': reward, 'info': info}


class SweVerifier(base.Verifier):
  """See the module docstring."""

  name = 'swe'
  worker_fn = 'verifiers.swe:work'
  judge_option = 'judge'

  @classmethod
  def judge_use(cls, options, group_size):
    # P(YES) from one forward per patch the lexical rule leaves undecided (at most every one).
    del group_size
    return base.JudgeUse('logits', 1, 1) if options.get('judge') is not None else None

  def __init__(self, *, execution: bool = False, isolation: str = 'bwrap', bwrap: str = 'bwrap',
               memory_mb: int = 1024, nproc: int = 16, fsize_mb: int = 64, tmpfs_mb: int = 256,
               max_answer_chars: int = 1 << 20, judge: Any = None,
               judge_template: str = 'swe_same_fix', judge_max_field_tokens: int = 2048,
               judge_reject_reward: float = 0.0, **common: Any):
    """Options.

    Args:
      execution: run the record's test on the patched repo instead of
        comparing with the gold patch.
      isolation, bwrap, memory_mb, nproc, fsize_mb, tmpfs_mb: the sandbox's,
        as in `verifiers.code` (execution mode only).
      max_answer_chars: longer answers score -1 without being parsed.
      judge: a judge (`rl.judge.JudgeModel`) scoring the patches the lexical rule
        finds neither equal nor empty (see the module docstring); None keeps the ratio.
      judge_template: its pointwise yes/no template with a {reference} field.
      judge_max_field_tokens: the most tokens of the issue, the gold and the candidate patch
        in the judge's prompt.
      judge_reject_reward: the reward of a patch the judge cannot score.
      **common: thinking_unfinished_reward, workers, timeout_s.
    """
    super().__init__(**common)
    self.execution = bool(execution)
    self.judge = None
    if judge is not None:
      if self.execution:
        raise ValueError('swe: judge= scores the lexical rule\'s middle case; execution=True '
                         'has none')
      from verifiers import judge as judge_lib  # pylint: disable=g-import-not-at-top
      if judge_template not in judge_lib.TEMPLATES or 'reference' not in (
          judge_lib.TEMPLATES[judge_template].fields):
        raise ValueError(f'swe: judge_template={judge_template!r} must name a template with a '
                         '{reference} field (e.g. \'swe_same_fix\')')
      self.judge = judge_lib.JudgeVerifier(
          judge=judge, template=judge_template, mode='pointwise', score_by='logits',
          reference_field='gold_patch', max_field_tokens=judge_max_field_tokens,
          reject_reward=judge_reject_reward, thinking_unfinished_reward=0.0)
    self.max_answer_chars = int(max_answer_chars)
    self.sandbox = None
    if self.execution:
      self.sandbox = sandbox.Sandbox(self.workers, isolation=isolation, bwrap=bwrap,
                                     memory_mb=memory_mb, nproc=nproc, fsize_mb=fsize_mb,
                                     tmpfs_mb=tmpfs_mb)

  @property
  def isolation(self) -> str:
    """'bwrap' or 'none' in execution mode; 'n/a' in lexical mode (no code runs)."""
    return self.sandbox.isolation if self.sandbox is not None else 'n/a'

  def _options(self) -> dict:
    return {'execution': self.execution}

  @classmethod
  def _check_metadata(cls, metadata: Mapping[str, Any], execution: bool = False,
                      **options: Any) -> None:
    super()._check_metadata(metadata)
    if execution:
      repo = base.require(metadata, 'repo', dict, 'path -> file text of the repository')
      if not repo or not all(isinstance(k, str) and isinstance(v, str) for k, v in repo.items()):
        raise ValueError('metadata["repo"] must be a non-empty dict of path -> text')
      for path in repo:
        try:
          norm = sandbox_server.normalize_path(path, 'the repository')
        except ValueError as e:
          raise ValueError(f'metadata["repo"]: {e}') from None
        if norm != path:
          raise ValueError(f'metadata["repo"]: path {path!r} is not normalised (write {norm!r})')
      base.require(metadata, 'test', str, 'Python test program run on the patched repo')
    if execution and 'gold_patch' not in metadata:
      return
    gold = base.require(metadata, 'gold_patch', str, 'the reference unified diff')
    try:
      _gold(gold)
    except ValueError as e:
      raise ValueError(f'metadata["gold_patch"] is not a parsable diff: {e}') from None

  def _prepare(self, sample: base.Sample, answer: str) -> dict | base.Result:
    md = sample.metadata
    if len(answer) > self.max_answer_chars:
      return base.Result(-1.0, {'reason': f'answer longer than {self.max_answer_chars} characters'})
    if not self.execution:
      return {'answer': answer, 'gold_patch': md['gold_patch']}
    try:
      pred = unidiff.parse(unidiff.extract(answer))
    except ValueError as e:
      return base.Result(-1.0, {'reason': f'unparsable diff: {e}'})
    if unidiff.is_noop(pred):
      return base.Result(0.0, {'reason': 'the patch changes nothing'})
    try:
      files = unidiff.apply([_confined(fp) for fp in pred], md['repo'])
    except ValueError as e:
      return base.Result(0.0, {'reason': f'patch does not apply: {e}'})
    # The test may import the repository's own modules only: a module the patch adds under a
    # name the test imports from elsewhere (e.g. a stdlib name) must not replace that import.
    return {'mode': 'check', 'program': '', 'test': md['test'], 'files': files,
            'importable': _top_level_modules(md['repo'])}

  def _run(self, payloads: Sequence[dict]) -> list[pool_lib.Outcome]:
    if not self.execution:
      return super()._run(payloads)
    out = []
    for ans in self.sandbox.run(payloads, [self.timeout_s] * len(payloads)):
      reason = 'tests passed' if ans['passed'] else f'{ans["status"]}: {str(ans["detail"])[-500:]}'
      out.append(pool_lib.Outcome(True, {'reward': float(ans['passed']), 'info': dict(
          sandbox.result_info(ans, self.sandbox.isolation), reason=reason)}))
    return out

  def _finish(self, samples: Sequence[base.Sample], results: list[base.Result]
              ) -> list[base.Result]:
    """With a judge: its P(YES) replaces the ratio of every middle-case patch (one batch)."""
    if self.judge is None:
      return results
    middle = [i for i, r in enumerate(results) if 'similarity' in r.info]
    if not middle:
      return results
    judged = self.judge.score([samples[i] for i in middle])
    out = list(results)
    for i, j in zip(middle, judged):
      info = dict(results[i].info, **{k: v for k, v in j.info.items() if k != 'reason'})
      if j.info.get('rejected'):
        out[i] = base.Result(j.reward, dict(info, reason=j.info['reason']))
      else:
        out[i] = base.Result(min(max(j.reward, _EPS), 1 - _EPS),
                             dict(info, reason='semantic judge: P(YES) that the patch fixes '
                                               'the same issue as the gold patch'))
    return out

  def close(self) -> None:
    """Stops workers and sandbox servers."""
    super().close()
    if self.sandbox is not None:
      self.sandbox.close()
