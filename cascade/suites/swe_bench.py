"""SWE-bench Verified: the policy's patches as the official harness's predictions, scored by it.

Records, as released: princeton-nlp/SWE-bench_Verified, data/test-00000-of-00001.parquet
(500 instances): 'instance_id', 'repo', 'base_commit', 'problem_statement', 'patch' (the
gold diff), 'test_patch', 'FAIL_TO_PASS', 'PASS_TO_PASS', 'version', ... . SWE-bench ships
no code, so the agentless prompt needs a localisation beside it: `localization.jsonl`, one
row per instance, {'instance_id', 'relevant_file_contents'} (the files an agentless
localisation picked, as {path: text} or [{'path', 'content'}], read at 'base_commit'; the
field name and both layouts are those of Cascade's RL-SWE data). The prompt is the one the
SWE stage trains on (`cascade.data.released.adapt_cascade1_rl_swe`): the issue, each file in a
fence, and the instruction to answer with a unified diff.

Predictions: each completion's diff (`verifiers.unidiff.extract`: a diff fence, a fence
holding a diff, or the answer) is a line of the official harness's predictions file,
{"instance_id", "model_name_or_path", "model_patch"}; sample j of every instance goes to
`predictions-<j>.jsonl` under the grader's directory (the harness takes one patch per
instance per run). The agentic suite (`cascade.suites.swe_bench_agentic`) writes and
scores the diffs of its episodes' final files through the same grader.

Scoring: `python -m swebench.harness.run_evaluation` (the `swebench` package, SWE-bench's
own Docker harness) on each predictions file; an instance scores 1 when the harness's
report lists it in 'resolved_ids'. Without a reachable container runtime (`docker info`
fails) or without the package, the grader still writes the predictions and then raises
`Unscorable`, one line naming the file and the command that scores it elsewhere.

Protocol (Cascade 1, arXiv 2512.13607: 64K tokens, temperature 0.6, top-p 0.95): one sample
per instance (the papers' k is not stated in what could be read here; each sample is a full
harness run), the metric the resolved rate.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Mapping, Sequence

from cascade.data import released
from cascade.suites import base
from foundation import chat
from foundation import paths
from verifiers import unidiff

DATASET = 'princeton-nlp/SWE-bench_Verified'
LOCALIZATION = 'localization.jsonl'


class Unscorable(RuntimeError):
  """The harness cannot run here (no container runtime or no `swebench`); the predictions
  were written (the message names them and the command that scores them)."""


def completion_patch(completion: str) -> str:
  """An agentless completion's diff (after the thinking block; '' when there is none)."""
  split = chat.split_thinking(completion)
  patch = unidiff.extract(split.answer) if split.finished_thinking else ''
  if patch and not patch.endswith('\n'):
    patch += '\n'   # `git apply` rejects a diff whose last line has no newline.
  return patch


def prediction(instance_id: str, completion: str, model_name: str) -> dict:
  """The harness's prediction of one completion: its diff (after the thinking block)."""
  return {'instance_id': instance_id, 'model_name_or_path': model_name,
          'model_patch': completion_patch(completion)}


def write_predictions(path: str, predictions: Sequence[Mapping]) -> None:
  """Writes (replacing) a predictions.jsonl file."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  tmp = f'{path}.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    for p in predictions:
      f.write(json.dumps(dict(p)) + '\n')
  os.replace(tmp, path)


def runtime_missing(docker: str = 'docker') -> str | None:
  """Why the harness cannot run here (None when it can)."""
  if importlib.util.find_spec('swebench') is None:
    return 'the swebench package is not installed (pip install swebench)'
  try:
    out = subprocess.run([docker, 'info', '--format', '{{.ServerVersion}}'], capture_output=True,
                         text=True, timeout=30, check=False)
  except FileNotFoundError:
    return f'no container runtime ({docker} not found)'
  except subprocess.TimeoutExpired:
    return f'no container runtime ({docker} info did not answer in 30 s)'
  if out.returncode != 0:
    last = (out.stderr.strip().splitlines() or ['no answer'])[-1]
    return f'no container runtime ({docker} daemon not reachable: {last[:200]})'
  return None


def harness_command(predictions_path: str, run_id: str, instance_ids: Sequence[str],
                    workers: int) -> list[str]:
  """The official harness's command line for one predictions file."""
  return [sys.executable, '-m', 'swebench.harness.run_evaluation', '--dataset_name', DATASET,
          '--split', 'test', '--predictions_path', predictions_path, '--run_id', run_id,
          '--max_workers', str(workers), '--instance_ids', *instance_ids]


def report_path(directory: str, model_name: str, run_id: str) -> str:
  """Where the harness writes its report (its working directory, the model's name with '/'
  as '__')."""
  return os.path.join(directory, f'{model_name.replace("/", "__")}.{run_id}.json')


class HarnessGrader(base.Grader):
  """Writes predictions and scores them with the official harness.

  Args:
    directory: where predictions-<j>.jsonl and the harness's reports go (a new temporary
      directory when empty).
    model_name: the predictions' model_name_or_path.
    workers: the harness's --max_workers.
    docker: the container runtime's command.
    command: the harness's command line (`harness_command`'s signature); a test's fake.
  """

  SUITE = 'swe_bench_verified'

  def __init__(self, directory: str = '', model_name: str = 'cascade', workers: int = 4,
               docker: str = 'docker', command=harness_command):
    self.directory = directory or tempfile.mkdtemp(prefix=f'{self.SUITE}-')
    self.model_name, self.workers, self.docker = model_name, int(workers), docker
    self.command = command
    self.batches = 0

  def grade(self, record: Mapping, completions: Sequence[str]) -> list[base.Graded]:
    return self.grade_batch([record], [completions])[0]

  def patch(self, completion: str) -> str:
    """A completion's model_patch (the agentic grader's completions are episode outcomes)."""
    return completion_patch(completion)

  def write(self, records: Sequence[Mapping],
            completions: Sequence[Sequence[str]]) -> tuple[int, list[str]]:
    """(this batch's number, its predictions files: sample j of every record in file j)."""
    k = max((len(c) for c in completions), default=0)
    batch, self.batches = self.batches, self.batches + 1
    files = []
    for j in range(k):
      path = os.path.join(self.directory, f'predictions-{j}.jsonl' if batch == 0
                          else f'predictions-{j}-batch{batch}.jsonl')
      write_predictions(path, [{'instance_id': r['id'], 'model_name_or_path': self.model_name,
                                'model_patch': self.patch(cs[j])}
                               for r, cs in zip(records, completions) if j < len(cs)])
      files.append(path)
    return batch, files

  def grade_batch(self, records: Sequence[Mapping],
                  completions: Sequence[Sequence[str]]) -> list[list[base.Graded]]:
    batch, files = self.write(records, completions)
    why = runtime_missing(self.docker)
    if why:
      command = shlex.join(harness_command(files[0] if files else '', 'cascade', [], 4)[:-1])
      raise Unscorable(f'{self.SUITE}: {why}; predictions written to '
                       f'{", ".join(files)}; score them where Docker runs with `{command}`')
    resolved = []
    for j, path in enumerate(files):
      run_id = f'cascade-{batch}-{j}'
      ids = [r['id'] for r, cs in zip(records, completions) if j < len(cs)]
      done = subprocess.run(self.command(path, run_id, ids, self.workers), cwd=self.directory,
                            capture_output=True, text=True, check=False)
      report = report_path(self.directory, self.model_name, run_id)
      if done.returncode != 0 or not os.path.exists(report):
        tail = (done.stderr.strip().splitlines() or ['no output'])[-1][:300]
        raise RuntimeError(f'{self.SUITE}: the harness failed on {path} '
                           f'(exit {done.returncode}): {tail}')
      with open(report, encoding='utf-8') as f:
        resolved.append(set(json.load(f).get('resolved_ids', ())))
    return [[base.Graded(score=float(r['id'] in resolved[j]),
                         info={'reason': 'resolved' if r['id'] in resolved[j]
                               else 'not resolved', 'predictions': files[j]})
             for j in range(len(cs))] for r, cs in zip(records, completions)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweBenchSuite(base.Suite):
  """SWE-bench Verified with an agentless localisation beside it.

  Attributes:
    localization: instance_id -> (line, relevant_file_contents), filled by `read`.
  """
  localization: Mapping = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def read(self, data_dir: str) -> list[dict]:
    found = sorted(str(p) for p in paths.path(data_dir).glob(LOCALIZATION))
    if not found:
      raise base.DataMissing(f'suite {self.name!r}: no {LOCALIZATION} under {data_dir} (the '
                             f"agentless localisation: one {{'instance_id', "
                             f"'relevant_file_contents'}} row per instance)")
    localization = {}
    for line, row in base.rows(found[0]):
      iid = base.field(found[0], line, row, 'instance_id')
      localization[iid] = (line, base.field(found[0], line, row, 'relevant_file_contents',
                                            (dict, list, str)))
    located = dataclasses.replace(self, localization=localization)
    return base.Suite.read(located, data_dir)

  def parse(self, path: str, raw: Sequence[tuple[int, Mapping]]) -> list[dict]:
    out = []
    for line, row in raw:
      iid = base.field(path, line, row, 'instance_id')
      for name in ('problem_statement', 'patch', 'repo', 'base_commit'):
        base.field(path, line, row, name)
      if iid not in self.localization:
        raise base.BadRecord(f'{path}:{line}: instance {iid!r} has no row in {LOCALIZATION}')
      loc_line, files = self.localization[iid]
      try:
        rec = released.adapt_cascade1_rl_swe({'problem_statement': row['problem_statement'],
                                              'relevant_file_contents': files,
                                              'patch': row['patch']})
      except released.RecordError as e:
        raise base.BadRecord(f'{LOCALIZATION}:{loc_line}: {e}') from None
      out.append({'id': iid, 'messages': rec['messages'],
                  'metadata': {'gold_patch': row['patch'], 'repo': row['repo'],
                               'base_commit': row['base_commit']}})
    return out

  def grader(self, **options) -> HarnessGrader:
    return HarnessGrader(**options)


swe_bench_verified = SweBenchSuite(
    name='swe_bench_verified', title='SWE-bench Verified (agentless)', metric='resolved',
    protocol=base.Protocol(samples=1, temperature=0.6, top_p=0.95, max_new_tokens=65536,
                           thinking=True),
    source=f'{DATASET} (data/test-00000-of-00001.parquet) with {LOCALIZATION}',
    files=('data/test-*.parquet', 'data/test-*.jsonl'), hub_dataset=DATASET,
    hub_files=('data/test-*.parquet',), records=500,
    # launch.plan's bound where it does not measure the files: the issue and the localised
    # files, as the recipes' SWE RL stages cap their prompts (ours).
    prompt_tokens=16384,
    reported=(tuple(base.Reported(recipe='nemotron_cascade_14b', stage=s, value=v,
                                  source='arXiv 2512.13607 (Nemotron-Cascade), 14B-Thinking '
                                         'after each stage')
                    for s, v in zip(('sft_32k', 'rlhf', 'if_rl_ifbench', 'math_rl', 'code_rl',
                                     'swe_rl'), (34.5, 38.8, 38.4, 39.7, 39.6, 43.1)))))
# Cascade 2's number (OpenHands, agentic) is the agentic suite's (`swe_bench_agentic`).
