"""SWE-bench Verified through the agentic environment: each sample is an episode of the policy in
`envs.swe_agent` on the instance's repository at its base commit; its prediction is the diff of
the episode's final files.

Records: the released instances as the agentless suite reads them (`cascade.suites.swe_bench`:
princeton-nlp/SWE-bench_Verified, data/test-00000-of-00001.parquet, 'instance_id', 'repo',
'base_commit', 'problem_statement', 'patch'), in the same directory (`<data>/swe_bench_verified`).
SWE-bench ships no code, so each instance's repository lies beside them, under `repos/`:

  repos/<instance_id>/          a checkout of 'repo' at 'base_commit', or
  repos/<instance_id>.tar.gz    its archive (.tar, .tgz too), e.g.
                                `git -C REPO archive --format=tar.gz -o ... BASE_COMMIT`

An instance without either is a one-line `DataMissing` naming the suite and the path. The
episode's workspace is the repository's text files (UTF-8, no NUL; '.git', binary files and
paths the environment's rule does not accept as written are left out, and are never part
of a diff), within the suite's bounds (`max_files`, `max_repo_chars`: a repository past them is
a one-line error naming the instance). Repositories are read a batch at a time, when its
episodes start.

Optionally `hidden_tests.jsonl`, one row per instance it covers: {'instance_id', 'test'
(a Python test program the environment runs on the episode's final files, as a training
record's hidden test, `envs.swe_agent`), 'visible_test' (optional: offered as `run_tests`)}.

The prompt: the repository's name and commit, the issue, and `INSTRUCTION`; the environment's
tools (list_files, read_file, search, edit, apply_patch, and run_tests where a visible test is
given) are listed in the opening system turn, as the agentic stage renders them
(`cascade.episodes`). Each sample is one episode (`cascade.episodes.generate`), up to
`max_turns` assistant turns of at most `max_turn_tokens` each, within the protocol's
`max_new_tokens` for the whole episode (turns and observations).

Scoring: the episode's final files against the original ones, as a diff in git's format
(`git_diff`: `git apply` applies it at 'base_commit'), are the model_patch of the official
harness's predictions.jsonl, scored by it as the agentless suite's are (`HarnessGrader`: one
harness run per sample index, 'resolved_ids'; without a container runtime the predictions are
written and the grader raises `Unscorable`, one line). Every grade also carries the
environment's own reward, as training computes it (`envs.swe_agent`): with a hidden test, 1
iff it passes on the final files; without one, the lexical reward of the episode's diff
against the gold patch; 0 for unchanged files. `score_by='env'` (a grader option) scores by
that reward instead of the harness, with no container runtime needed; the result's metric then
says so, and its 'env_reward' is always the mean of the environment's rewards.

A completion, as the runner hands it to the grader, is the episode's outcome as JSON:
{'patch', 'env_reward', 'env_reason', 'turns', 'tool_calls', 'tool_errors', 'cut'}.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import tarfile
from typing import Any, Mapping, Sequence

import numpy as np

from cascade.suites import base
from cascade.suites import swe_bench
from envs import swe_agent
from foundation import paths

REPOS = 'repos'
ARCHIVES = ('.tar.gz', '.tgz', '.tar')
HIDDEN_TESTS = 'hidden_tests.jsonl'
# The agentless suite's directory, which this suite shares (the same released files).
SHARED = 'swe_bench_verified'
INSTRUCTION = ('Fix the issue above in the repository, using the tools to read, search and '
               'change its files. When the fix is done, answer without a tool call: the '
               'changes you made to the files are your answer.')
SCORE_BY = ('harness', 'env')


# --- repositories ----------------------------------------------------------------------------


def repo_source(data_dir: str, instance_id: str) -> str | None:
  """The instance's repository under `data_dir`: its checkout directory or archive (None:
  neither)."""
  root = os.path.join(data_dir, REPOS, instance_id)
  if os.path.isdir(root):
    return root
  for ext in ARCHIVES:
    if os.path.isfile(root + ext):
      return root + ext
  return None


def _text(data: bytes) -> str | None:
  """A file's text, or None for a binary file (not UTF-8, or holding NUL)."""
  if b'\0' in data:
    return None
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError:
    return None


def _kept(path: str) -> str | None:
  """`path` as the workspace keys it, or None when the environment would not name it so
  ('.git', an over-long path, one its rule rewrites or rejects)."""
  if path.split('/', 1)[0] == '.git':
    return None
  try:
    norm = swe_agent.normalize_path(path)
  except swe_agent.base.ToolError:
    return None
  return norm if norm == path else None


def _walk(root: str) -> dict[str, bytes]:
  """Every regular file under a checkout directory (symbolic links left out), by relative path."""
  out = {}
  for top, dirs, names in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d != '.git' or top != root)
    for name in names:
      full = os.path.join(top, name)
      if os.path.islink(full) or not os.path.isfile(full):
        continue
      with open(full, 'rb') as f:
        out[os.path.relpath(full, root).replace(os.sep, '/')] = f.read()
  return out


def _untar(archive: str) -> dict[str, bytes]:
  """Every regular file of an archive, by its path (a leading './' dropped)."""
  out = {}
  with tarfile.open(archive) as tar:
    for member in tar:
      if member.isfile():
        name = member.name[2:] if member.name.startswith('./') else member.name
        out[name] = tar.extractfile(member).read()
  return out


def load_repo(source: str, max_files: int, max_chars: int) -> dict[str, str]:
  """The workspace of a checkout directory or archive: its text files, {path: text}.

  Raises:
    ValueError: the files pass the bounds (one line naming `source`).
  """
  raw = _walk(source) if os.path.isdir(source) else _untar(source)
  files = {}
  for path, data in raw.items():
    key, text = _kept(path), _text(data)
    if key is not None and text is not None:
      files[key] = text
  if not files:
    raise ValueError(f'{source}: no text files')
  try:
    swe_agent.check_tree(files, max_files, max_chars)
  except swe_agent.base.ToolError as e:
    raise ValueError(f'{source}: {e} (the suite\'s max_files / max_repo_chars)') from None
  return files


# --- the prediction --------------------------------------------------------------------------


def _lines(text: str) -> list[str]:
  """A file's lines with their '\\n' (only '\\n' ends a line, as git reads it)."""
  parts = text.split('\n')
  return [p + '\n' for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def git_diff(original: Mapping[str, str], files: Mapping[str, str]) -> str:
  """The diff from `original` to `files` in git's format: `git apply` (and `patch -p1`) apply
  it to the original tree ('diff --git' headers, new and deleted files, a last line without a
  newline marked as git marks it).
  """
  out = []
  for path in sorted(set(original) | set(files)):
    before, after = original.get(path), files.get(path)
    if before == after:
      continue
    out.append(f'diff --git a/{path} b/{path}\n')
    if before is None:
      out.append('new file mode 100644\n')
    elif after is None:
      out.append('deleted file mode 100644\n')
    old, new = _lines(before or ''), _lines(after or '')
    if not old and not new:
      continue                              # an empty file came or went: the header says it
    for line in difflib.unified_diff(
        old, new, fromfile='/dev/null' if before is None else f'a/{path}',
        tofile='/dev/null' if after is None else f'b/{path}'):
      out.append(line if line.endswith('\n') else line + '\n\\ No newline at end of file\n')
  return ''.join(out)


class _DiffRecordingEnv(swe_agent.SweAgentEnv):
  """`envs.swe_agent` whose ended episodes' info also holds their final diff (`git_diff`),
  which reaches every process with the info (`cascade.episodes`)."""

  def _score(self, episodes, answers):
    out = super()._score(episodes, answers)
    return [(reward, dict(info, final_diff=git_diff(ep.state.original, ep.state.files)))
            for ep, (reward, info) in zip(episodes, out)]

  def _failed(self, episode, e):
    """An episode whose scoring raised keeps its diff too (the harness may still resolve it)."""
    reward, info = super()._failed(episode, e)
    return reward, dict(info, final_diff=git_diff(episode.state.original, episode.state.files))


def outcome(reward: float, info: Mapping) -> str:
  """An ended episode's outcome, as the grader reads it (the module docstring)."""
  return json.dumps({'patch': info.get('final_diff', ''), 'env_reward': float(reward),
                     'env_reason': str(info.get('reason', '')),
                     'turns': int(info.get('turns', 0)),
                     'tool_calls': int(info.get('tool_calls', 0)),
                     'tool_errors': int(info.get('tool_errors', 0)),
                     'cut': str(info.get('cut', ''))})


def read_outcome(completion: str) -> dict:
  """An outcome back from its JSON (`outcome`).

  Raises:
    ValueError: the text is not one (a completion of another suite).
  """
  try:
    got = json.loads(completion)
  except json.JSONDecodeError:
    got = None
  if not isinstance(got, dict) or not isinstance(got.get('patch'), str):
    raise ValueError(f'{SHARED}_agentic: a completion must be an episode outcome (JSON with '
                     f"'patch'), got {completion[:80]!r}")
  return got


# --- grading ---------------------------------------------------------------------------------


class AgenticGrader(swe_bench.HarnessGrader):
  """Episode outcomes as the harness's predictions, scored by it (or by the environment's own
  reward: `score_by='env'`); every grade carries the environment's reward.

  Args:
    score_by: 'harness' (the official harness; the refusal without a container runtime) or
      'env' (the environment's reward, as training's).
    **options: `swe_bench.HarnessGrader`'s.
  """
  SUITE = f'{SHARED}_agentic'

  def __init__(self, score_by: str = 'harness', **options):
    if score_by not in SCORE_BY:
      raise ValueError(f'score_by must be one of {SCORE_BY}, got {score_by!r}')
    super().__init__(**options)
    self.score_by = score_by

  def patch(self, completion: str) -> str:
    return read_outcome(completion)['patch']

  def grade_batch(self, records: Sequence[Mapping],
                  completions: Sequence[Sequence[str]]) -> list[list[base.Graded]]:
    outcomes = [[read_outcome(c) for c in cs] for cs in completions]
    if self.score_by == 'env':
      _, files = self.write(records, completions)
      return [[base.Graded(score=o['env_reward'],
                           info=_env_info(o, 'env', reason=o['env_reason'],
                                          predictions=files[j]))
               for j, o in enumerate(row)] for row in outcomes]
    graded = super().grade_batch(records, completions)
    return [[dataclasses.replace(g, info=_env_info(o, 'harness', **g.info))
             for g, o in zip(gs, row)] for gs, row in zip(graded, outcomes)]


def _env_info(o: Mapping, scored_by: str, **info) -> dict:
  """A grade's info with what scored it, the episode's environment reward and its shape."""
  return dict(info, scored_by=scored_by, env_reward=o['env_reward'],
              env_reason=o['env_reason'], turns=o['turns'], tool_calls=o['tool_calls'],
              cut=o['cut'], patch_lines=o['patch'].count('\n'))


# --- the suite -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgenticSuite(base.Suite):
  """SWE-bench Verified as episodes in `envs.swe_agent` (the module docstring).

  Attributes:
    max_turns: assistant turns per episode.
    max_turn_tokens: one turn's tokens (0: the whole budget).
    max_files, max_repo_chars: the bounds of an episode's workspace.
    isolation: the sandbox's for hidden and visible tests (`envs.swe_agent`).
    test_timeout_s: one test run's wall-clock limit.
    hidden: instance_id -> (line, its hidden_tests.jsonl row), filled by `read`.
    root: the directory `read` read (where `repos/` is).
  """
  max_turns: int = 50
  max_turn_tokens: int = 8192
  max_files: int = 20_000
  max_repo_chars: int = 64_000_000
  isolation: str = 'bwrap'
  test_timeout_s: float = 60.0
  hidden: Mapping = dataclasses.field(default_factory=dict, compare=False, repr=False)
  root: str = dataclasses.field(default='', compare=False, repr=False)

  VERSION = 1

  def directory(self, root: str) -> str:
    """The agentless suite's directory: the same released files, with `repos/` beside them."""
    return paths.join(root, SHARED)

  def agent_settings(self) -> dict:
    """What of the suite besides its protocol changes what an episode can do."""
    return {'max_turns': self.max_turns, 'max_turn_tokens': self.max_turn_tokens,
            'max_files': self.max_files, 'max_repo_chars': self.max_repo_chars,
            'test_timeout_s': self.test_timeout_s}

  def protocol_hash(self) -> str:
    blob = json.dumps({'base': base.Suite.protocol_hash(self), 'agent': self.agent_settings()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]

  def prompt_text(self, record: Mapping, thinking: bool | None, template: Any) -> str:
    """An episode's opening: the conversation with the tools' schemas (`cascade.episodes`)."""
    from cascade import episodes  # pylint: disable=g-import-not-at-top
    del template                  # episodes render their openings with `foundation.chat`
    return episodes.opening_text(self.environment(), record, thinking)

  def planned_call(self, prompt_len: int, protocol: base.Protocol) -> tuple[int, int]:
    """The last turn's call: the opening plus the whole episode budget as its prompt (as the
    agentic stage plans it, `cascade.kinds.agentic.sampler_sizes`), a turn's new tokens."""
    turn = min(self.max_turn_tokens or protocol.max_new_tokens, protocol.max_new_tokens)
    return prompt_len + protocol.max_new_tokens, turn

  # --- reading -------------------------------------------------------------------------------

  def read(self, data_dir: str) -> list[dict]:
    hidden = {}
    found = sorted(str(p) for p in paths.path(data_dir).glob(HIDDEN_TESTS))
    for line, row in (base.rows(found[0]) if found else ()):
      iid = base.field(found[0], line, row, 'instance_id')
      base.field(found[0], line, row, 'test')
      if 'visible_test' in row:
        base.field(found[0], line, row, 'visible_test')
      hidden[iid] = (line, row)
    located = dataclasses.replace(self, hidden=hidden, root=data_dir)
    records = base.Suite.read(located, data_dir)
    unknown = sorted(set(hidden) - {r['id'] for r in records})
    if unknown:
      raise base.BadRecord(f'{found[0]}:{hidden[unknown[0]][0]}: instance {unknown[0]!r} is '
                           f'not in the released records')
    return records

  def parse(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    out = []
    for line, row in raw:
      iid = base.field(path, line, row, 'instance_id')
      issue = base.field(path, line, row, 'problem_statement')
      repo = base.field(path, line, row, 'repo')
      commit = base.field(path, line, row, 'base_commit')
      gold = base.field(path, line, row, 'patch')
      source = repo_source(self.root, iid)
      if source is None:
        raise base.DataMissing(
            f'suite {self.name!r}: no {REPOS}/{iid}/ or {REPOS}/{iid}.tar.gz under {self.root} '
            f'(a checkout of {repo} at {commit}, or its `git archive`)')
      metadata = {'repo_source': source, 'repo': repo, 'base_commit': commit,
                  'gold_patch': gold}
      if iid in self.hidden:
        row_h = self.hidden[iid][1]
        metadata.update({k: row_h[k] for k in ('test', 'visible_test') if k in row_h})
      text = f'Repository: {repo} (commit {commit})\n\nIssue:\n{issue}\n\n{INSTRUCTION}'
      out.append({'id': iid, 'messages': [{'role': 'user', 'content': text}],
                  'metadata': metadata})
    return out

  def episode_record(self, record: Mapping) -> dict:
    """The environment's record of one of the suite's: its repository read from its source.

    Raises:
      ValueError: the repository passes the bounds (names the instance and its source).
    """
    md = record['metadata']
    try:
      files = load_repo(md['repo_source'], self.max_files, self.max_repo_chars)
    except ValueError as e:
      raise ValueError(f'suite {self.name!r}: instance {record["id"]!r}: {e}') from None
    env_md = {'repo': files, 'gold_patch': md['gold_patch']}
    env_md.update({k: md[k] for k in ('test', 'visible_test') if k in md})
    return {'id': record['id'], 'messages': record['messages'], 'metadata': env_md}

  # --- sampling ------------------------------------------------------------------------------

  def environment(self) -> swe_agent.SweAgentEnv:
    """The episodes' environment (its sandboxes start only if a test runs)."""
    return _DiffRecordingEnv(isolation=self.isolation, timeout_s=self.test_timeout_s,
                             max_files=self.max_files, max_repo_chars=self.max_repo_chars)

  def sample(self, policy: Any, records: Sequence[Mapping], key: Any, sampling: Any,
             k: int) -> base.Sampled:
    """`k` episodes of each record; each one's outcome (the module docstring) is its sample."""
    from cascade import episodes  # pylint: disable=g-import-not-at-top
    budget = sampling.max_new_tokens
    turn_sp = dataclasses.replace(
        sampling, max_new_tokens=min(self.max_turn_tokens or budget, budget))
    env_records = [self.episode_record(r) for r in records]
    with self.environment() as env:
      eps = episodes.generate(policy.sampler, policy.params, policy.tokenizer, env,
                              env_records, [self.protocol.thinking] * len(records), key,
                              turn_sp, k, max_turns=self.max_turns, max_tokens=budget)
    n = len(records)
    texts = [outcome(r, i) for r, i in zip(eps.rewards.tolist(), eps.infos)]
    return base.Sampled(completions=[texts[i * k:(i + 1) * k] for i in range(n)],
                        lengths=np.asarray(eps.samples.lengths).reshape(n, k),
                        truncated=np.asarray(eps.samples.truncated).reshape(n, k))

  # --- grading -------------------------------------------------------------------------------

  def grader(self, **options) -> AgenticGrader:
    return AgenticGrader(**options)

  def summarize(self, records: Sequence[Mapping], grades: Sequence[Sequence[base.Graded]]
                ) -> dict:
    """The resolved rate (or the environment's reward with `score_by='env'`), with
    'env_reward': the mean environment reward, in percent."""
    out = base.Suite.summarize(self, records, grades)
    flat = [g for row in grades for g in row]
    if flat and all(g.info.get('scored_by') == 'env' for g in flat):
      out['metric'] = 'env reward'
    rewards = [float(g.info['env_reward']) for g in flat if 'env_reward' in g.info]
    if rewards:
      out['env_reward'] = 100.0 * float(np.mean(rewards))
    return out


swe_bench_verified_agentic = AgenticSuite(
    name='swe_bench_verified_agentic', title='SWE-bench Verified (agentic)', metric='resolved',
    protocol=base.Protocol(samples=1, temperature=0.6, top_p=0.95, max_new_tokens=65536,
                           thinking=True),
    source=(f'{swe_bench.DATASET} (data/test-00000-of-00001.parquet) with {REPOS}/ (each '
            f"instance's repository at its base_commit) under {SHARED}/"),
    files=('data/test-*.parquet', 'data/test-*.jsonl'), hub_dataset=swe_bench.DATASET,
    hub_files=('data/test-*.parquet',), records=500,
    # launch.plan's bound on the opening prompt where it does not measure the files: the issue
    # and the tools' schemas (ours; an issue is at most a few thousand tokens).
    prompt_tokens=8192,
    reported=(base.Reported(recipe='nemotron_cascade2', stage='final', value=50.2,
                            source='arXiv 2603.19220 (Nemotron-Cascade 2), final model '
                                   '(OpenHands, agentic)'),))
