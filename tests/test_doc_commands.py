"""Every command and code block that README.md and docs/**/*.md show is run by a named test.

What is extracted from each page (file:line is where it starts):
  * every fenced code block. A block fenced as ```text (or ```output) is an OUTPUT SAMPLE (what
    a command prints, a table a script wrote): it needs no test itself, but a command shown in
    it on a `$ ` line is extracted and must be covered. Any other block (```, ```bash,
    ```shell, ```console, ```python ...) is code: a shell block is split into its commands (a
    `\\`-continued line is one command, a `for ...; do ... done` loop is one, comments are
    dropped); a python block is one unit, its whole text.
  * every inline code span in prose that is a command: it starts with `$ `, `make `,
    `python -m `, `python3 `, `.venv/bin/`, `pip `, `gsutil `, `gcloud `, `bash `, `./`,
    `xmanager `, `huggingface-cli `, `env `, `tensorboard `, `launch/tpu_vm.sh `, `pytest `,
    `sudo ` or `apt-get `, after any `NAME=value ` environment assignments.
Whitespace is normalised (runs of blanks to one space, each line stripped).

Where each unit is registered:
  * _RUNS: cases of `test_a_page_command_runs_as_shown`, which takes the command from the page
    (`doc_command`) and runs it exactly as shown with bash in a scratch root (`run_doc_command`),
    then checks what it wrote. A case's mark is its tier: `heavy` for minutes, `slow` for hours
    (the benchmarks that write results pages, the 14B/30B plans, sweeps, `make demo`).
  * REGISTRY: normalised text -> the node id of another test that runs exactly that text.
  * PATTERNS: a family (a regular expression over the normalised text: the module named in
    prose, a form with placeholders) -> a test that runs a member, with the reason.
  * CI: commands .ci/run runs (`make test`, `make test-heavy`).
  * NOT_RUN: the few that need the network, a TPU or a cloud project, each with the reason and
    the test of the nearest thing; a debt, kept short.
The checks fail on: a unit nothing covers (naming file:line and the text), an entry naming a
test that does not exist (node ids checked by parsing the test files with ast, not by collecting
them: the checks take well under a second), and an entry or case no page shows any more (stale).
"""

import ast
import functools
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTPUT_FENCES = ('text', 'output')
_SHELL_FENCES = ('', 'bash', 'sh', 'shell', 'console', 'shell-session', 'zsh')
_INLINE_COMMAND = re.compile(
    r'^([A-Z][A-Z0-9_]*=\S* )*'
    r'(\$ |make |python3? -m |python3? \S+\.py|\.venv/bin/|pip3? |gsutil |gcloud |bash |\./|'
    r'xmanager |huggingface-cli |env |tensorboard |launch/tpu_vm\.sh |pytest |sudo |apt-get )')


def pages():
  """README.md and every docs/**/*.md, as paths relative to the repository root."""
  found = [p for p in [ROOT / 'README.md'] if p.exists()]
  found += sorted((ROOT / 'docs').rglob('*.md'))
  return [str(p.relative_to(ROOT)) for p in found]


def normalise(text: str) -> str:
  lines = [re.sub(r'[ \t]+', ' ', line).strip() for line in text.strip('\n').split('\n')]
  return '\n'.join(line for line in lines if line)


def _strip_comment(line: str) -> str:
  """`line` without a shell comment (a `#` at a word's start, outside quotes)."""
  quote = None
  for i, ch in enumerate(line):
    if quote:
      if ch == quote:
        quote = None
    elif ch in '\'"':
      quote = ch
    elif ch == '#' and (i == 0 or line[i - 1] in ' \t'):
      return line[:i].rstrip()
  return line


def shell_commands(text: str, first_line: int):
  """(line, command) for each command of a shell block starting at page line `first_line`. A
  compound command (a loop) keeps one line per logical line, each `\\`-continued line joined."""
  out, current, start, depth, pending = [], [], None, 0, ''
  for offset, raw in enumerate(text.split('\n')):
    line = _strip_comment(raw.strip())
    if line.startswith('$ '):
      line = line[2:]
    if not line:
      continue
    if start is None:
      start = first_line + offset
    cont = line.endswith('\\')
    logical = pending + (line[:-1] if cont else line)
    if cont:
      pending = logical + ' '
      continue
    pending = ''
    current.append(logical)
    first = re.match(r'[\w-]+', logical)
    first = first.group(0) if first else ''
    depth += (first in ('for', 'while', 'until', 'if', 'case')) - (first in ('done', 'fi', 'esac'))
    if depth <= 0:
      out.append((start, normalise('\n'.join(current))))
      current, start, depth = [], None, 0
  if current or pending:
    out.append((start, normalise('\n'.join(current + [pending]))))
  return out


def units(page: str):
  """(line, kind, text) for each unit of `page`: kind is 'block' (a python or other non-shell
  code block) or 'command'."""
  return units_of_text((ROOT / page).read_text(encoding='utf-8'))


def units_of_text(text: str):
  lines = text.split('\n')
  out, i = [], 0
  while i < len(lines):
    m = re.match(r'^(\s*)(```+|~~~+)\s*([\w+-]*)', lines[i])
    if m:
      fence, lang = m.group(2), m.group(3).lower()
      j = i + 1
      while j < len(lines) and not lines[j].strip().startswith(fence):
        j += 1
      body = '\n'.join(lines[i + 1:j])
      if lang in OUTPUT_FENCES:
        for k, line in enumerate(lines[i + 1:j]):
          if line.strip().startswith('$ '):
            out.append((i + 2 + k, 'command', normalise(line.strip()[2:])))
      elif lang in _SHELL_FENCES:
        out.extend((n, 'command', c) for n, c in shell_commands(body, i + 2))
      else:
        out.append((i + 1, 'block', normalise(body)))
      i = j + 1
      continue
    for span in re.findall(r'(?<!`)`([^`\n]+)`(?!`)', lines[i]):
      if _INLINE_COMMAND.match(span.strip()):
        cmd = span.strip()
        out.append((i + 1, 'command', normalise(cmd[2:] if cmd.startswith('$ ') else cmd)))
    i += 1
  return out


def all_units():
  return [(page, line, kind, text) for page in pages() for line, kind, text in units(page)]


@functools.lru_cache(maxsize=None)
def _tests_in(path: str):
  """The test names in a test file: `test_x` and `Class::test_x`."""
  tree = ast.parse((ROOT / path).read_text(encoding='utf-8'))
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith('test'):
      names.add(node.name)
    if isinstance(node, ast.ClassDef):
      names |= {f'{node.name}::{n.name}' for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name.startswith('test')}
  return names


def node_exists(node: str) -> bool:
  path, _, name = node.partition('::')
  name = name.split('[')[0]
  return (ROOT / path).is_file() and name in _tests_in(path)


def doc_command(page: str, startswith: str) -> str:
  """The one command of `page` that starts with `startswith` (normalised), as the page shows it."""
  shown = [t for _, _, t in units(page)]
  found = sorted({t for t in shown if t == normalise(startswith)}) or sorted(
      {t for t in shown if t.startswith(normalise(startswith))})
  assert len(found) == 1, f'{page}: {len(found)} commands start with {startswith!r}: {found}'
  return found[0]


def run_doc_command(command: str, tmp_path, *, timeout: int, env=None, copy=(), own_venv=False):
  """Runs `command` exactly as a page shows it, with bash, in a scratch directory that stands in
  for the repository root: the repository's source folders are linked into it (so `configs/x.py`
  and `python -m package.module` resolve as from the root), `python` is this venv's python, and
  what the command writes (runs/, docs/ pages, /tmp paths it names) lands in the scratch copy or
  where it names, never in the checkout. `copy`: paths copied rather than linked (a command that
  writes into them, e.g. tests/ for a regenerated golden file). `own_venv`: no link to this venv
  (a `make` target builds .venv itself: it would otherwise reinstall the package into the shared
  venv from the scratch copy)."""
  if command.startswith('make ') and not own_venv:
    raise ValueError(f'{command!r}: a make target runs with own_venv=True (it installs into .venv)')
  work = pathlib.Path(tmp_path) / 'repo'
  work.mkdir(exist_ok=True)
  for name in ('benchmarks', 'cascade', 'configs', 'envs', 'foundation', 'launch', 'models', 'rl',
               'tiny_world', 'tools', 'verifiers', 'notebooks', 'setup.py', 'Makefile', 'docs', *copy):
    if (work / name).exists() or (work / name).is_symlink():
      continue
    if name in copy or name == 'docs':       # pages a command writes land in the copy
      (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, work / name)
    else:
      (work / name).symlink_to(ROOT / name)
  run_env = dict(os.environ)
  if not own_venv:
    venv = pathlib.Path(sys.prefix)           # this venv: `python` and `.venv/bin/python`
    if not (work / '.venv').exists():
      (work / '.venv').symlink_to(venv)
    run_env['PATH'] = f'{venv / "bin"}{os.pathsep}{run_env["PATH"]}'
    run_env['PYTHONPATH'] = str(work)
  run_env.update(env or {})
  return subprocess.run(['bash', '-euo', 'pipefail', '-c', command], cwd=work, env=run_env,
                        capture_output=True, text=True, timeout=timeout, check=False)


# The test that runs each unit, by its normalised text, for units a test elsewhere runs. Keep an
# entry's text exactly as the page shows it (after normalise), so a changed page shows up as a
# stale entry and a new unit. Commands this file runs itself are listed in _RUNS (below): the
# page, the command's start, the test case; they count as registered.
_RUN = 'tests/test_doc_commands.py::test_a_page_command_runs_as_shown'
_HERE = 'tests/test_doc_commands.py::'
REGISTRY = {
    # docs/data.md
    'python -m cascade.prepare --config=my_config.py --cache_dir=gs://bucket/cache':
        _HERE + 'test_the_prepare_command_into_cloud_storage',
    # docs/topology.md
    "c.mesh = dict(shape=(2, 8, 8), slices=2) # data 2 = 1 per slice x 2 slices\n"
    "c.hardware = dict(platform='tpu', topology='v5p:4x4x4', slices=2, device_memory_gib=95)":
        _HERE + 'test_the_topology_page_multi_slice_config_block',
    'python -m launch.plan --config=configs/tiny.py --config.mesh.shape=2,2,2 '
    '--config.mesh.slices=2 "--config.hardware={\'platform\': \'tpu\', \'topology\': '
    '\'v5p:2x2x1\', \'slices\': 2, \'device_memory_gib\': 95}" --stages=sft --nosampler --noeval':
        'tests/launch/test_plan_slices.py::test_doc_command_compiles_two_tpu_slices',
    # docs/engine.md, docs/sandbox.md, docs/config.md: config lines and files
    "c.sampler = dict(engine='paged', slots=64, page_size=16, pages=None, chunk_steps=32)":
        _HERE + 'test_the_config_blocks_validate[engine]',
    "c.domains.code = dict(verifier='code', verifier_options=dict(isolation='none'),\n"
    "train='code_train', eval='code_eval')": _HERE + 'test_the_config_blocks_validate[sandbox]',
}
def _shown(page, start):
  """The unit of `page` that starts with `start`, for a registry key; a page that no longer shows
  one gives a key no page shows, which test_no_entry_is_stale reports (rather than an import
  error that would hide every other check)."""
  try:
    return doc_command(page, start)
  except (AssertionError, FileNotFoundError):
    return f'<{page} shows no unit starting with {start!r}>'


# README.md's "Bring your own" recipes: tests/test_readme_recipes.py takes these blocks and
# commands from README by their section headings and runs them as shown; test_episodes.py runs
# the `Dice` environment block.
_RECIPE = 'tests/test_readme_recipes.py::'
_RECIPE_FILES = _RECIPE + 'test_the_verifier_recipe_writes_its_data_and_its_config_and_verifier_check_out'
_RECIPE_RUNS = _RECIPE + 'test_the_verifier_and_model_recipes_run_as_written'
REGISTRY.update({
    _shown('README.md', '# make_data.py:'): _RECIPE_FILES,
    _shown('README.md', '# reverse_verifier.py:'): _RECIPE_FILES,
    _shown('README.md', '# my_config.py:'): _RECIPE_FILES,
    'python make_data.py': _RECIPE_FILES,
    'python -m cascade.main --config=my_config.py --workdir=runs/reverse': _RECIPE_RUNS,
    'python -m cascade.main --config=my_config.py:runs/reverse/stages/00_sft/hf '
    '--workdir=runs/reverse_from_sft': _RECIPE_RUNS,
    _shown('README.md', 'import envs\nfrom envs import base\nclass Dice'):
        'tests/cascade/test_episodes.py::test_readmes_environment_example_runs_an_episode',
})
_RELEASED_LOOPS = _HERE + 'test_the_released_data_downloads_fill_what_the_configs_read'
# docs/evaluation.md: its tiny command on a tiny run (the test runs it as the page shows it) and
# its config lines on the 14B recipe.
_EVALUATE = ('tests/cascade/suites/test_evaluate.py::'
             'test_a_runs_checkpoint_is_scored_on_every_tiny_suite_as_the_matrix_scored_it')
REGISTRY.update({
    'python -m cascade.evaluate --imports=tiny_world --checkpoint=runs/tiny': _EVALUATE,
    _shown('docs/evaluation.md', "c.eval.suites = ['aime25', 'ifeval', 'gpqa_diamond']"):
        'tests/cascade/suites/test_matrix.py::test_the_evaluation_pages_config_lines_check_out',
})
REGISTRY.update({
    'DATA=/data/nemotron': _RELEASED_LOOPS + '[nemotron_cascade_14b-DATA=/data/nemotron-CASCADE1_ROWS]',
    _shown('docs/released_data.md', 'for name in Nemotron-Cascade-SFT'):
        _RELEASED_LOOPS + '[nemotron_cascade_14b-DATA=/data/nemotron-CASCADE1_ROWS]',
    'DATA2=/data/nemotron2': _RELEASED_LOOPS + '[nemotron_cascade2-DATA2=/data/nemotron2-CASCADE2_ROWS]',
    _shown('docs/released_data.md', 'huggingface-cli download Qwen/Qwen3-14B-Base '):
        _RELEASED_LOOPS + '[nemotron_cascade_14b-DATA=/data/nemotron-CASCADE1_ROWS]',
    _shown('docs/released_data.md', 'huggingface-cli download nvidia/NVIDIA-Nemotron-3-Nano'):
        _RELEASED_LOOPS + '[nemotron_cascade2-DATA2=/data/nemotron2-CASCADE2_ROWS]',
    _shown('docs/released_data.md', 'for name in Nemotron-Cascade-2'):
        _RELEASED_LOOPS + '[nemotron_cascade2-DATA2=/data/nemotron2-CASCADE2_ROWS]',
})
_CONFIG_MD_BLOCK = 'import ml_collections\ndef get_config(arg=None):\nc = ml_collections.ConfigDict()'

# Families: (regular expression over the normalised text, test, why one test covers them all).
PATTERNS = [
    (r'python -m cascade\.main( \.\.\.)?', 'tests/cascade/test_tiny_demo.py::test_tiny_cascade_smoke',
     'the module named in prose (no arguments, or `...`): the entry point the smoke test runs'),
    (r'python -m cascade\.main --config=(\.\.\.|configs/x\.py\[:arg\]) --workdir=(\.\.\.|DIR)',
     'tests/cascade/test_tiny_demo.py::test_tiny_cascade_smoke',
     'the command\'s form with placeholders; the smoke test runs a member of it'),
    (r'make mutation MUTATE=<file> MUTATION_TESTS=<tests>', _RUN + '[mutation-engine]',
     'the form with placeholders; the page\'s concrete example of it is run'),
    (r'launch/tpu_vm\.sh create NAME ZONE v5p-128',
     'tests/launch/test_tpu_vm.py::test_create_install_run_delete',
     'NAME and ZONE are placeholders: the test runs `create tpu1 us-east5-a v5p-128` against a '
     'fake gcloud that records the calls'),
    (r'huggingface-cli download', _RELEASED_LOOPS,
     'the command named in prose; the test runs docs/released_data.md\'s download loops, which '
     'call it, against a stand-in huggingface-cli that records the calls'),
    (r'python -m cascade\.evaluate --checkpoint=DIR --suites=[\w,]+ --data_dir=\S+ --download',
     _EVALUATE, 'DIR is a placeholder (and the papers\' data needs the network): the test runs '
     'the form on a tiny run\'s export with the tiny world\'s suites and data'),
    (r'python -m cascade\.evaluate --checkpoint=DIR --suites=arena_hard_v2 --data_dir=\S+ '
     r'(--suite_option=arena_hard_v2\.\w+=\S+ ?)+',
     'tests/cascade/suites/test_suite_options.py::'
     'test_the_command_judges_arena_hard_v2_on_a_checkpoint_through_a_served_judge',
     'DIR and the judge\'s host are placeholders: the test runs the form on a tiny HF '
     'checkpoint, the release\'s fixture files and a loopback judge'),
    (r'(python -m cascade\.harness run|lm_eval) --model cascade --model_args checkpoint=DIR '
     r'--tasks \S+',
     'tests/cascade/suites/test_harness.py::'
     'test_lm_eval_console_script_runs_the_cascade_model_as_the_module_command_does',
     'DIR is a placeholder and the hub\'s tasks need the network: the test runs both forms, '
     'lm-eval\'s own console script and the module, on a tiny HF checkpoint with tasks built '
     'from a local jsonl (--include_path) and compares their samples'),
]

# Commands CI runs (.ci/run, which test_ci_runs_them checks shows each one verbatim).
CI = ('make test', 'make test-heavy')

_NEAREST_RELEASED = 'tests/cascade/data/test_released.py::test_released_paths_are_under_the_download_directories'
_NEAREST_PAPER = ('tests/cascade/data/test_released.py::'
                  'test_every_stage_of_the_paper_configs_reads_the_released_files')
# Commands no test runs, each with why and the test that runs the nearest thing. Keep it short:
# each is a debt the report names.
NOT_RUN = {
    'make test-all': ('every test including `slow` (many hours here) and this file\'s own: run from '
                      'a test it would run itself', _HERE + 'test_the_make_targets_the_docs_name'),
    'sudo apt-get install bubblewrap': (
        'changes the machine\'s system packages, and this machine has no `sudo` (sessions and CI '
        'run as root without it); the nearest test runs apt-get install bubblewrap as root',
        'tests/test_notebook_install.py::test_as_root_with_apt_get_the_cell_installs_bubblewrap'),
    'xmanager launch launch/xm_launch.py -- --config=configs/nemotron_cascade_14b.py '
    '--executor=vertex --workdir_root=gs://bucket/runs': (
        'submits jobs to Vertex AI: needs a Google Cloud project, its credentials and the network '
        'beyond the package index',
        'tests/launch/test_xm_launch.py::test_the_command_lines_overrides_reach_every_job_and_its_machine'),
    'python -m cascade.main --config=configs/nemotron_cascade_14b.py:data_root=gs://bucket/nemotron '
    '--workdir=gs://bucket/runs/c14b': (
        'trains the 14B recipe: it needs the Qwen3-14B-Base checkpoint and tokenizer (a hub '
        'download), a real gs:// bucket holding the released data, and the v5p-128 slice its '
        'mesh names', 'tests/cascade/test_gcs.py::test_smoke_cascade_on_gcs_killed_and_resumed_matches_local'),
    'python -m cascade.main --config=configs/nemotron_cascade_14b.py:data_root=$DATA '
    '--workdir=gs://bucket/runs/c14b': (
        'trains the 14B recipe: it needs the real Qwen3-14B-Base weights (the hub download the '
        'page shows before it) and the v5p-128 slice its mesh names; the download and the loop '
        'before it run (test_the_released_data_downloads_fill_what_the_configs_read)',
        _NEAREST_PAPER),
    'python -m cascade.main --config=configs/nemotron_cascade2.py:data_root=$DATA2 '
    '--workdir=gs://bucket/runs/c2': (
        'trains the 30B-A3B Cascade 2 recipe: it needs the real Nemotron-3-Nano-30B-A3B-Base '
        'weights (the hub download the page shows before it) and the v5p-128 slice its mesh '
        'names; the download and the loop before it run '
        '(test_the_released_data_downloads_fill_what_the_configs_read)',
        _NEAREST_PAPER),
}


def _run_units():
  """text -> case id for each command a case of _RUNS runs (on its page, or shown elsewhere)."""
  out = {}
  for case in _RUNS:
    page, prefixes = case.values[0], case.values[1]
    for prefix in prefixes:
      try:
        out[doc_command(page, prefix)] = case.id
      except AssertionError:
        pass                    # reported by test_no_entry_is_stale
  return out


def _covering(page, text, runs):
  if text in REGISTRY:
    return REGISTRY[text]
  if text in runs:
    return f'{_RUN}[{runs[text]}]'
  if page == 'docs/config.md' and text.startswith(_CONFIG_MD_BLOCK):
    return _HERE + 'test_the_config_page_sample_runs_on_the_data_it_names'
  if text in CI or text in NOT_RUN:
    return text
  for pattern, node, _ in PATTERNS:
    if re.fullmatch(pattern, text, flags=re.S):
      return node
  return None


def _uncovered(found, runs):
  """'file:line: text' for each (page, line, kind, text) of `found` that nothing covers."""
  return [f'{page}:{line}: {text!r}' for page, line, _, text in found
          if _covering(page, text, runs) is None]


def test_every_command_and_code_block_is_run_by_a_test():
  missing = _uncovered(all_units(), _run_units())
  assert not missing, ('commands and code blocks no test runs (add each to REGISTRY or _RUNS in '
                       'tests/test_doc_commands.py with the test that runs it, or fence an output '
                       'sample ```text):\n' + '\n'.join(missing))


def test_every_registered_test_exists():
  nodes = (list(REGISTRY.values()) + [node for _, node, _ in PATTERNS]
           + [node for _, node in NOT_RUN.values()])
  missing = sorted({n for n in nodes if not node_exists(n)})
  assert not missing, f'tests/test_doc_commands.py names tests that do not exist: {missing}'
  ids = {case.id for case in _RUNS}
  unknown = sorted({n for n in nodes if n.startswith(_RUN + '[') and n[len(_RUN) + 1:-1] not in ids})
  assert not unknown, f'no such case of {_RUN}: {unknown}'
  assert len(ids) == len(_RUNS), 'two cases of _RUNS share an id'


def test_no_entry_is_stale():
  shown = {text for _, _, _, text in all_units()}
  stale = [text for text in (*REGISTRY, *CI, *NOT_RUN) if text not in shown]
  stale += [pattern for pattern, _, _ in PATTERNS
            if not any(re.fullmatch(pattern, t, flags=re.S) for t in shown)]
  for case in _RUNS:
    for prefix in case.values[1]:
      try:
        doc_command(case.values[0], prefix)
      except (AssertionError, FileNotFoundError) as e:
        stale.append(f'{case.id}: {e}')
  assert not stale, 'entries no page shows any more:\n' + '\n'.join(map(str, stale))


def test_ci_runs_them():
  """CI's script runs each command of CI, as its own line."""
  lines = {line.strip() for line in (ROOT / '.ci' / 'run').read_text().splitlines()}
  assert set(CI) <= lines, set(CI) - lines


def test_the_extraction():
  """A shell block's continued lines are one command, a loop is one, comments go; an output
  block yields only its `$ ` lines; inline command spans are found, other spans are not."""
  page = (
      'Run `make demo` or see `configs/tiny.py`.\n'
      '```bash\n'
      '# a comment\n'
      'A=1   # set\n'
      'python -m x \\\n'
      '    --flag="a # b"\n'
      'for n in a b; do\n'
      '  echo $n\n'
      'done\n'
      '```\n'
      '```text\n'
      '$ make test\n'
      'table 1 2\n'
      '```\n'
      '```python\n'
      'c.mesh = dict(shape=(2,))\n'
      '```\n')
  assert units_of_text(page) == [
      (1, 'command', 'make demo'), (4, 'command', 'A=1'),
      (5, 'command', 'python -m x --flag="a # b"'),
      (7, 'command', 'for n in a b; do\necho $n\ndone'),
      (12, 'command', 'make test'), (15, 'block', 'c.mesh = dict(shape=(2,))')]


def _page_like(written: pathlib.Path, page: str):
  """`written` is `page` as its script writes it: the same title and the same `## ` headings."""
  assert written.exists(), f'{written} was not written'
  new, old = written.read_text(encoding='utf-8'), (ROOT / page).read_text(encoding='utf-8')
  heads = lambda t: [l for l in t.splitlines() if l.startswith('## ')]
  assert new.splitlines()[0] == old.splitlines()[0], (new[:300], old[:300])
  assert heads(new) == heads(old), (heads(new), heads(old))


def _check_prepare(proc, work):
  assert 'prepared 7 stage(s)' in proc.stdout, proc.stdout[-2000:]
  cached = {p.name.rsplit('-', 1)[0] for p in (work / 'runs/tiny/data_cache').iterdir()
            if p.is_dir() and '-' in p.name}
  assert cached == {'code_rl', 'if_rl', 'math_rl', 'rlhf', 'sft', 'swe_rl'}, cached


def _check_data_benchmark(proc, work):
  del proc
  text = (work / 'docs/data_benchmark.md').read_text()
  assert '- command: `.venv/bin/python -m benchmarks.data --rows=1000000' in text, text[:500]


def _check_data_benchmark_full(proc, work):
  del proc, work
  assert '- command: `' in pathlib.Path('/tmp/full_length.md').read_text()


def _check_verifiers(proc, work):
  del work
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  assert res['code_samples_per_s'] > 0 and res['humaneval_sandbox_s'] > 0, res


def _check_verifiers_page(proc, work):
  _check_verifiers(proc, work)
  _page_like(work / 'docs/benchmarks/verifiers.md', 'docs/benchmarks/verifiers.md')


def _check_hybrid(proc, work):
  del work
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  assert res['sublayers'] == 52 and res['bodies'] < res['sublayers'], res


def _check_step_time(proc, work):
  """The bounds are counted from the configs, not measured: the table rows equal the page's."""
  del proc
  rows = lambda t: [l for l in t.splitlines() if l.startswith('|')]
  page = 'docs/plans/step_time_model.md'
  assert rows((work / page).read_text()) == rows((ROOT / page).read_text())


def _check_golden(proc, work):
  """The matrix test regenerated this machine's pinned file (it ends in a skip saying so: one
  file of the copy rewritten, the copy's other times kept by copytree) and rewrote it as it is:
  regeneration on this machine reproduces the pinned matrix."""
  assert re.search(r'\b1 skipped\b', proc.stdout), proc.stdout[-2000:]
  added = sorted({p.name for p in (work / 'tests/cascade/golden').glob('*.json')}
                 - {p.name for p in (ROOT / 'tests/cascade/golden').glob('*.json')})
  if added:
    pytest.skip(f'this machine has no pinned matrix: regenerating added {added}')
  rewritten = []
  for path in sorted((ROOT / 'tests/cascade/golden').glob('*.json')):
    copy = work / 'tests/cascade/golden' / path.name
    assert copy.read_text() == path.read_text(), path.name
    if copy.stat().st_mtime > path.stat().st_mtime:
      rewritten.append(path.name)
  assert len(rewritten) == 1, rewritten


def _check_tiny_judge(proc, work):
  del proc, work
  for run in ('g_full', 'bt_full'):     # the whole cascade, each RL stage evaluated
    res = json.loads(pathlib.Path('/tmp/jw', run, 'results.json').read_text())
    assert res['stages'] == ['sft', 'rlhf', 'if_rl', 'math_rl', 'code_rl', 'swe_rl'], res['stages']


def _page_block(page: str, first_line: str) -> list[str]:
  """The lines of `page`'s fenced block whose first line starts with `first_line`."""
  lines = (ROOT / page).read_text(encoding='utf-8').split('\n')
  start = next(i for i, l in enumerate(lines) if l.startswith(first_line) and i
               and lines[i - 1].startswith('```'))
  return lines[start:lines.index('```', start)]


def _check_sample_plan(proc, work):
  """docs/planning.md's sample output is what its command prints: the stage's block and the
  verdict line by line, up to the numbers (compile times, the host's load); and stderr is empty
  (libtpu's start-up lines held back, the libraries' INFO lines off)."""
  del work
  assert proc.stderr == '', proc.stderr[-3000:]
  shape = lambda line: re.sub(r'\d+(\.\d+)?(e[+-]\d+)?', 'N', line)
  sample = _page_block('docs/planning.md', 'target: v5p:2x2x1')
  start = next(i for i, l in enumerate(sample) if l.startswith('[4] math_rl'))
  block = sample[start:sample.index('', start)] + [sample[-1]]
  printed = [shape(l) for l in proc.stdout.splitlines()]
  missing = [l for l in block if shape(l) not in printed]
  assert not missing, (missing, proc.stdout[-3000:])


def _check_readme_numbers(proc, work):
  """README's generated blocks are the rendering of the results the runs recorded, for the
  demo and both recipes."""
  from benchmarks import readme_numbers  # pylint: disable=g-import-not-at-top
  results = readme_numbers.load_results(str(work / readme_numbers.RESULTS))
  assert set(results) == set(readme_numbers.BLOCKS), sorted(results)
  text = (work / 'README.md').read_text(encoding='utf-8')
  assert readme_numbers.blocks(text) == readme_numbers.render_blocks(results)


def _writes(page):
  return lambda proc, work: _page_like(work / page, page)


def _same_page(page):
  """The command wrote `page` exactly as the checkout has it (a page rendered from a committed
  record file)."""
  def check(proc, work):
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (work / page).read_text(encoding='utf-8') == (ROOT / page).read_text(encoding='utf-8')
  return check


def _needs(path, why):
  return lambda: None if os.path.exists(path) else pytest.skip(f'{why}: {path} is missing')


def _needs_libtpu():
  """The TPU compiler (libtpu) in this environment: docs/planning.md installs it apart."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec('libtpu') is None:
    pytest.skip('libtpu is not installed here (docs/planning.md: its own environment)')


def _needs_cuda_plugin():
  """jax's CUDA plugin in this environment (XLA:GPU, deviceless): docs/planning.md installs it
  apart, with the command test_the_install_commands_install_their_extras[gpu] runs."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  try:
    found = importlib.util.find_spec('jax_plugins.xla_cuda12') is not None
  except ModuleNotFoundError:
    found = False
  if not found:
    pytest.skip('jax\'s CUDA plugin is not installed here (docs/planning.md: its own environment)')


def _needs_index():
  """A `make` target builds its own .venv from the package index: skip without the network."""
  import socket  # pylint: disable=g-import-not-at-top
  try:
    socket.create_connection(('pypi.org', 443), timeout=3).close()
  except OSError:
    pytest.skip('no route to the package index (make builds .venv from it)')


def _mutation_ready():
  """`make mutation` runs in the checkout with its .venv: only where that venv is already built
  for it (its stamps newer than setup.py, so make installs nothing into it)."""
  stamps = [ROOT / '.venv' / f'.stamp-{n}' for n in ('base', 'test', 'mutation')]
  setup = (ROOT / 'setup.py').stat().st_mtime
  if not all(p.exists() and p.stat().st_mtime >= setup for p in stamps):
    pytest.skip('.venv is not built for `make mutation` (its stamps are missing or older than '
                'setup.py: make would reinstall into the shared venv)')


def _tiny_judge_fresh():
  if os.path.exists('/tmp/jw'):
    pytest.skip('/tmp/jw exists (an earlier run of the page\'s commands): remove it to rerun them')


def _case(case_id, page, prefixes, timeout, check, *, mark=None, pre=None, copy=(), root=False,
          before=None, own_venv=False):
  """A case of test_a_page_command_runs_as_shown: `prefixes` pick the page's commands (run in
  order), `pre` skips where a prerequisite is missing ('gcs': the Cloud Storage emulator),
  `before` a command (of the same page's story, e.g. the run a fork copies from) run first."""
  marks = [mark] if mark else []
  return pytest.param(page, prefixes, timeout, check, pre, copy, root, before, own_venv,
                      id=case_id, marks=marks)


def _plan_case(case_id, name: str, scratch: str, pre=None):
  """A `launch.plan` page of docs/plans/: its command writes `scratch`, shaped as the page."""
  page = f'docs/plans/{name}'
  return _case(case_id, page, ['python -m launch.plan'], 4 * 3600,
               lambda proc, work: _page_like(pathlib.Path(scratch), page), mark=_SLOW, pre=pre)


_HEAVY, _SLOW = pytest.mark.heavy, pytest.mark.slow
_OK = lambda proc, work: None          # the command's exit status is the check
_BWRAP = lambda: None if shutil.which('bwrap') else pytest.skip('no bubblewrap')
_RUNS = [
    # docs/data.md, docs/data_benchmark.md
    _case('data-tiny-prepare', 'docs/data.md', ['python -m cascade.prepare --config=configs/tiny'],
          600, _check_prepare, mark=_HEAVY),
    _case('data-benchmark', 'docs/data_benchmark.md',
          ['.venv/bin/python -m benchmarks.data --rows=1000000'], 4 * 3600,
          _check_data_benchmark, mark=_SLOW),
    _case('data-benchmark-full', 'docs/data_benchmark.md',
          ['.venv/bin/python -m benchmarks.data --rows=4000'], 3 * 3600,
          _check_data_benchmark_full, mark=_SLOW),
    _case('data-open-hosts', 'docs/data_benchmark.md',
          ['.venv/bin/python -m benchmarks.data --open_hosts=1,2'], 4 * 3600, _OK, mark=_SLOW),
    _case('data-tokenize', 'docs/data_benchmark.md',
          ['.venv/bin/python -m benchmarks.data --tokenize'], 1800, _OK, mark=_SLOW),
    _case('data-prepare-hosts', 'docs/data.md', ['.venv/bin/python -m benchmarks.prepare_hosts'],
          1800, _OK, mark=_SLOW),
    # docs/ifbench_agreement.md, docs/model_families.md, docs/plans/, docs/tiny_generative_rm.md
    _case('ifbench-agreement', 'docs/ifbench_agreement.md',
          ['python -m benchmarks.ifbench_agreement'], 4 * 3600,
          _writes('docs/ifbench_agreement.md'), mark=_SLOW,
          pre=_needs('/tmp/ifbench_ref/bin/python', 'the reference checkers\' venv '
                     '(benchmarks/ifbench_agreement.py\'s docstring makes it)')),
    _case('compile-profile', 'docs/benchmarks/compile_profile.md',
          ['python -m benchmarks.compile_profile'], 2 * 3600,
          _writes('docs/benchmarks/compile_profile.md'), mark=_SLOW, pre=_needs_libtpu),
    _case('compile-bound', 'docs/benchmarks/compile_bound.md',
          ['python -m benchmarks.compile_bound'], 2 * 3600,
          _writes('docs/benchmarks/compile_bound.md'), mark=_SLOW, pre=_needs_libtpu),
    _case('hybrid-compile', 'docs/model_families.md',
          ['.venv/bin/python -m benchmarks.hybrid_compile'],
          3 * 3600, _check_hybrid, mark=_SLOW),
    _case('hybrid-compile-fold', 'docs/model_families.md',
          ['.venv/bin/python -m benchmarks.hybrid_compile --programs=forward',
           '.venv/bin/python -m benchmarks.hybrid_compile --programs=train',
           '.venv/bin/python -m benchmarks.hybrid_compile --programs=decode'],
          3 * 3600, _check_hybrid, mark=_SLOW),
    # Written by the TPU compiler's plan to a scratch path (the page's --report), then copied
    # into docs/plans/: Cascade 2's three long stages and its other seven with the evaluation
    # (issue #37), the 14B and 8B recipes, Cascade 2's RLHF with the GenRM judge.
    _plan_case('plan-cascade2', 'nemotron_cascade2_v5p.md', '/tmp/s50/plan/c2_v5p.md'),
    _plan_case('plan-cascade2-rest', 'nemotron_cascade2_v5p_rest.md',
               '/tmp/s50/plan/c2_v5p_rest.md'),
    _plan_case('plan-cascade14b', 'nemotron_cascade_14b_v5p.md', '/tmp/c14b_fast.md'),
    _plan_case('plan-cascade8b', 'nemotron_cascade_8b_v5p.md', '/tmp/h1/c8b_v5p.md'),
    _plan_case('plan-cascade2-genrm', 'nemotron_cascade2_rlhf_genrm_v5p.md',
               '/tmp/h1/c2_rlhf_genrm.md'),
    # Cascade 2 on 1, 2 and 4 8 x H200 nodes (the sequence mesh, the papers' lengths), by
    # XLA:GPU (deviceless) in the environment docs/planning.md installs.
    _plan_case('plan-cascade2-h200-gpu', 'nemotron_cascade2_h200x8.md',
               '/tmp/s56/plan/c2_h200x8.md', pre=_needs_cuda_plugin),
    _plan_case('plan-cascade2-2xh200-gpu', 'nemotron_cascade2_2xh200x8.md',
               '/tmp/s56/plan/c2_2xh200x8_b.md', pre=_needs_cuda_plugin),
    _plan_case('plan-cascade2-4xh200-gpu', 'nemotron_cascade2_4xh200x8.md',
               '/tmp/s56/plan/c2_4xh200x8_b.md', pre=_needs_cuda_plugin),
    # The RL stages the paper runs to ~49K (issue #56), on one node.
    _plan_case('plan-cascade2-h200-rl49k', 'nemotron_cascade2_h200x8_rl49k.md',
               '/tmp/gpu49k-plan/c2_h200x8_49k.md', pre=_needs_cuda_plugin),
    # Plan parity across the model wing's merges (issue #54): each side's plans by the TPU
    # compiler, hours on a 2-core host.
    _case('plan-parity', 'docs/plans/wing_parity.md', ['python -m benchmarks.plan_parity'],
          12 * 3600, _writes('docs/plans/wing_parity.md'), mark=_SLOW, pre=_needs_libtpu),
    # The step-time page; with --compile every stage's programs are compiled (the TPU
    # compiler's for v5p): hours.
    _case('step-time-page', 'docs/plans/step_time_model.md', ['python -m launch.step_time_page'],
          12 * 3600, _check_step_time, mark=_SLOW),
    _case('tiny-judge', 'docs/tiny_generative_rm.md',
          ['.venv/bin/python -m tiny_world.build', 'env -u XLA_FLAGS JAX_PLATFORMS=cpu '
           '.venv/bin/python -m cascade.main --config=configs/tiny.py:rm=generative',
           'env -u XLA_FLAGS JAX_PLATFORMS=cpu .venv/bin/python -m cascade.main '
           '--config=configs/tiny.py:rm=bt'], 6 * 3600, _check_tiny_judge, mark=_SLOW,
          pre=_tiny_judge_fresh),
    # docs/benchmarks/, docs/benchmarks.md
    _case('evaluate-page', 'docs/benchmarks/evaluate.md', ['python -m benchmarks.evaluate'],
          1800, _writes('docs/benchmarks/evaluate.md'), mark=_SLOW),
    # Slow: the page's command extracts an older commit (--compare_tree=git:REV), which needs
    # the repository's history, not the copy these cases run in; the heavy
    # tests/benchmarks/test_verifiers_benchmark.py runs --compare_tree=git:HEAD and --doc.
    _case('verifiers-page', 'docs/benchmarks/verifiers.md', ['python -m benchmarks.verifiers'],
          1800, _check_verifiers_page, mark=_SLOW, pre=_BWRAP),
    _case('grpo-step-page', 'docs/benchmarks/grpo_step.md', ['python -m benchmarks.grpo_step'],
          3 * 3600, _writes('docs/benchmarks/grpo_step.md'), mark=_SLOW),
    _case('context-parallel', 'docs/benchmarks/context_parallel.md',
          ['XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.long_context'],
          3 * 3600, _writes('docs/benchmarks/context_parallel.md'), mark=_SLOW),
    _case('context-parallel-hybrid', 'docs/benchmarks/context_parallel_hybrid.md',
          ['XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.long_context'],
          3 * 3600, _writes('docs/benchmarks/context_parallel_hybrid.md'), mark=_SLOW),
    _case('readme-numbers', 'docs/benchmarks.md', ['python -m benchmarks.readme_numbers'], 6 * 3600,
          _check_readme_numbers, mark=_SLOW, copy=('README.md', 'benchmarks')),
    _case('fast-path-tiny', 'docs/benchmarks/fast_path_tiny.md',
          ['python -m benchmarks.cascade_vs_blended'], 6 * 3600,
          _writes('docs/benchmarks/fast_path_tiny.md'), mark=_SLOW),
    _case('long-context-tests', 'docs/benchmarks.md',
          ['pytest -m slow tests/benchmarks/test_long_context.py'], 3600, _OK, mark=_SLOW,
          root=True),
    _case('long-context', 'docs/benchmarks.md', ['.venv/bin/python -m benchmarks.long_context'],
          3 * 3600, _OK, mark=_SLOW),
    _case('sampler-greedy', 'docs/benchmarks.md',
          ['.venv/bin/python -m benchmarks.sampler --compare_hf --compare_scan --mode=greedy '
           '--scaling= --repeats=9'], 3 * 3600, _OK, mark=_SLOW),
    _case('sampler-sample', 'docs/benchmarks.md',
          ['.venv/bin/python -m benchmarks.sampler --compare_hf --compare_scan --mode=sample'],
          3 * 3600, _OK, mark=_SLOW),
    _case('sampler-wide', 'docs/benchmarks.md',
          ['.venv/bin/python -m benchmarks.sampler --compare_hf --compare_scan --mode=greedy '
           '--scaling= --repeats=7'], 3 * 3600, _OK, mark=_SLOW),
    _case('grpo-step-trl', 'docs/benchmarks.md', ['.venv/bin/python -m benchmarks.grpo_step'],
          3 * 3600, _OK, mark=_SLOW,
          pre=lambda: pytest.importorskip('trl', reason='the bench extra (TRL)')),
    _case('verifiers-all', 'docs/benchmarks.md', ['.venv/bin/python -m benchmarks.verifiers'],
          3600, _check_verifiers, mark=_SLOW, pre=_BWRAP),
    _case('cvb-seeds', 'docs/benchmarks.md',
          ['.venv/bin/python -m benchmarks.cascade_vs_blended --seeds=0,1,2'], 6 * 3600, _OK,
          mark=_SLOW),
    _case('cvb-hetero', 'docs/benchmarks.md',
          ['.venv/bin/python -m benchmarks.cascade_vs_blended --config_arg=world=hetero'],
          6 * 3600, _OK, mark=_SLOW),
    _case('cvb-ablation', 'docs/benchmarks.md',
          ['.venv/bin/python -m benchmarks.cascade_vs_blended --compare=tiny,tiny:drop=rlhf'],
          6 * 3600, _OK, mark=_SLOW),
    _case('self-healing', 'docs/benchmarks.md',
          ['.venv/bin/python -m benchmarks.self_healing --seeds=0,1,2'], 12 * 3600, _OK,
          mark=_SLOW),
    _case('self-healing-page', 'docs/self_healing.md', ['python -m benchmarks.self_healing'],
          600, _same_page('docs/self_healing.md'), mark=_HEAVY),
    _case('sampler-turns', 'docs/benchmarks.md',
          ['.venv/bin/python -m benchmarks.sampler --workload=turns'], 3600, _OK, mark=_SLOW),
    _case('plan-14b', 'docs/benchmarks.md', ['python -m launch.plan'], 4 * 3600, _OK, mark=_SLOW),
    # docs/engine.md
    _case('sampler-longtail', 'docs/engine.md',
          ['.venv/bin/python -m benchmarks.sampler --workload=longtail'], 3600, _OK, mark=_SLOW),
    _case('sampler-turns-session', 'docs/engine.md',
          ['.venv/bin/python -m benchmarks.sampler --workload=turns'], 3600, _OK, mark=_SLOW),
    _case('grpo-step-longtail', 'docs/engine.md', ['.venv/bin/python -m benchmarks.grpo_step'],
          3600, _OK, mark=_SLOW),
    _case('stream-filter', 'docs/engine.md', ['.venv/bin/python -m benchmarks.stream_filter'],
          3600, _OK, mark=_SLOW),
    _case('stream-filter-20ms', 'docs/engine.md',
          ['.venv/bin/python -m benchmarks.stream_filter --score_ms=20'], 3600, _OK, mark=_SLOW),
    # docs/planning.md
    _case('plan-14b-all', 'docs/planning.md',
          ['python -m launch.plan --config=configs/nemotron_cascade_14b.py'], 4 * 3600, _OK,
          mark=_SLOW),
    _case('plan-14b-math', 'docs/planning.md',
          ['python -m launch.plan --config=configs/nemotron_cascade_14b.py --stages=math_rl'],
          3 * 3600, _OK, mark=_SLOW),
    # The sample plan the page shows, by the TPU compiler in the environment the page installs
    # (libtpu; a minute or two here).
    _case('plan-tiny-tpu-sample', 'docs/planning.md',
          ['python -m launch.plan --config=configs/tiny.py --config.mesh.shape=1,4,1'], 1800,
          _check_sample_plan, mark=_HEAVY, pre=_needs_libtpu),
    # XLA:GPU, deviceless, in the environment the page installs (tests/launch/test_plan_gpu.py
    # compiles a tiny hybrid so in seconds).
    _case('plan-14b-h200-gpu', 'docs/planning.md',
          ['python -m launch.plan --config=configs/nemotron_cascade_14b.py:hardware=h200x8 '
           '--backend=gpu'], 4 * 3600, _OK, mark=_SLOW, pre=_needs_cuda_plugin),
    # docs/plans/*_h200x8.md: the dense recipes by XLA:GPU to a scratch path and copied.
    _plan_case('plan-14b-h200', 'nemotron_cascade_14b_h200x8.md',
               '/tmp/s51/plan/c14b_h200x8_gpu.md', pre=_needs_cuda_plugin),    # XLA:GPU
    _plan_case('plan-8b-h200', 'nemotron_cascade_8b_h200x8.md',
               '/tmp/s51/plan/c8b_h200x8_gpu.md', pre=_needs_cuda_plugin),      # XLA:GPU
    # docs/science.md
    _case('cvb', 'docs/science.md', ['.venv/bin/python -m benchmarks.cascade_vs_blended'],
          6 * 3600, _OK, mark=_SLOW),
    _case('cvb-hetero-science', 'docs/science.md',
          ['.venv/bin/python -m benchmarks.cascade_vs_blended --config_arg=world=hetero,'
           'eval_every=10 --workdir_root=runs/cvb_hetero'], 6 * 3600, _OK, mark=_SLOW),
    _case('cvb-drop-rlhf', 'docs/science.md',
          ['.venv/bin/python -m benchmarks.cascade_vs_blended --config_arg=world=hetero,'
           'eval_every=10 --workdir_root=runs/cvb_hetero --compare=tiny,tiny:drop=rlhf'],
          6 * 3600, _OK, mark=_SLOW),
    _case('cvb-order', 'docs/science.md',
          ['.venv/bin/python -m benchmarks.cascade_vs_blended --config_arg=world=hetero,'
           'eval_every=10 --workdir_root=runs/cvb_hetero --compare=tiny,tiny:order=cascade2'],
          6 * 3600, _OK, mark=_SLOW),
    _case('cvb-mopd', 'docs/science.md',
          ['.venv/bin/python -m benchmarks.cascade_vs_blended --config_arg=world=hetero,'
           'eval_every=10 --workdir_root=runs/cvb_hetero --compare=tiny_mopd'], 6 * 3600, _OK,
          mark=_SLOW),
    _case('tiny-agentic', 'docs/science.md',
          ['python -m cascade.main --config=configs/tiny_agentic.py'], 3 * 3600, _OK, mark=_SLOW),
    _case('tiny-hybrid', 'docs/science.md',
          ['python -m cascade.main --config=configs/tiny.py:model=hybrid'], 3 * 3600, _OK,
          mark=_SLOW),
    # docs/sandbox.md, docs/config.md
    _case('make-demo', 'docs/sandbox.md', ['make demo'], 3 * 3600, _OK, mark=_SLOW,
          own_venv=True, pre=_needs_index),
    _case('compile-cache-gs', 'docs/config.md',
          ['python -m cascade.main --config=configs/tiny.py:smoke --workdir=runs/smoke'], 3600,
          _OK, mark=_SLOW, pre='gcs'),
    _case('fork-from', 'docs/config.md',
          ['python -m cascade.main --config=configs/tiny.py:drop=rlhf'], 3 * 3600, _OK,
          mark=_SLOW, before='python -m cascade.main --config=configs/tiny.py --workdir=runs/tiny'),
    # docs/at_scale.md
    _case('gcs-slow', 'docs/at_scale.md', ['python -m pytest -m slow tests/cascade/test_gcs.py'],
          3600, _OK, mark=_SLOW, root=True),
    # Slow: 377 s at load 20 (tests/cascade/test_device_check.py checks it in-process, heavy).
    _case('device-check', 'docs/at_scale.md', ['python -m cascade.device_check'], 1800, _OK,
          mark=_SLOW),
    _case('sweep', 'docs/at_scale.md', ['python -m launch.sweep --config=configs/tiny.py'],
          12 * 3600, _OK, mark=_SLOW),
    _case('sweep-tests', 'docs/at_scale.md', ['pytest -m slow tests/launch/test_sweep.py'], 3600,
          _OK, mark=_SLOW, root=True),
    _case('reward-hosts', 'docs/at_scale.md',
          ['pytest -m multiprocess tests/cascade/test_reward_hosts.py'], 3600, _OK, mark=_SLOW,
          root=True),
    # docs/what_a_run_survives.md, docs/testing.md
    _case('verifiers-code', 'docs/what_a_run_survives.md',
          ['python -m benchmarks.verifiers --domains=code'], 1800, _check_verifiers, mark=_SLOW,
          pre=_BWRAP),     # slow: test_verifiers_benchmark (heavy) runs the same work and --doc
    _case('mutation-engine', 'docs/testing.md', ['make mutation MUTATE=rl/engine.py'],
          12 * 3600, _OK, mark=_SLOW, root=True, pre=_mutation_ready),
    _case('regen-golden', 'docs/testing.md', ['CASCADE_REGEN_GOLDEN=1'], 3600, _check_golden,
          mark=_SLOW, copy=('tests', 'pytest.ini')),
    _case('tpu-notebook', 'docs/testing.md',
          ['.venv/bin/python -m pytest -q -m heavy tests/test_tpu_notebook.py'], 1800, _OK,
          mark=_SLOW, root=True),
]


@pytest.mark.parametrize('page,prefixes,timeout,check,pre,copy,root,before,own_venv', _RUNS)
def test_a_page_command_runs_as_shown(page, prefixes, timeout, check, pre, copy, root, before,
                                      own_venv, request, tmp_path):
  """Runs the page's command(s), taken from the page, exactly as shown (`run_doc_command`; a
  `make` target that copies the checkout, and a pytest run of the repository's own tests, which
  write nothing there, run in the checkout: `root`), then checks what it wrote."""
  env = None
  if pre == 'gcs':
    env = request.getfixturevalue('gcs').env
  elif pre:
    pre()
  work = tmp_path / 'repo'
  commands = [doc_command(page, prefix) for prefix in prefixes]
  if before:
    proc = run_doc_command(before, tmp_path, timeout=timeout)
    assert proc.returncode == 0, f'{before}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}'
  for command in commands:
    if root:
      root_env = dict(os.environ, PATH=f'{pathlib.Path(sys.prefix) / "bin"}{os.pathsep}'
                      f'{os.environ["PATH"]}')
      proc = subprocess.run(['bash', '-euo', 'pipefail', '-c', command], cwd=ROOT, env=root_env,
                            capture_output=True, text=True, timeout=timeout, check=False)
    else:
      proc = run_doc_command(command, tmp_path, timeout=timeout, copy=copy, env=env,
                             own_venv=own_venv)
    assert proc.returncode == 0, f'{page}: {command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}'
  check(proc, work)


@pytest.mark.heavy
def test_the_prepare_command_into_cloud_storage(gcs, tmp_path):
  """docs/data.md's `--cache_dir=gs://bucket/cache` form, with `my_config.py` a small config of
  the data benchmark's world, against the local Cloud Storage emulator (bucket 'bucket'); then
  the run side: the config with `data_cache=gs://bucket/cache` finds every stage prepared."""
  command = doc_command('docs/data.md', 'python -m cascade.prepare --config=my_config.py')
  from benchmarks import data as data_bench  # pylint: disable=g-import-not-at-top
  data = tmp_path / 'data'
  data_bench.generate(str(data), rows=3000, rl_rows=500, scale=0.05)
  work = tmp_path / 'repo'
  work.mkdir()
  (work / 'my_config.py').write_text(
      'from benchmarks import data\n\n\ndef get_config():\n'
      f'  return data.config({str(data)!r}, "")\n')
  proc = run_doc_command(command, tmp_path, timeout=600, env=gcs.env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "stages[0] 'sft': prepared 3000 rows" in proc.stdout, proc.stdout
  again = run_doc_command(command, tmp_path, timeout=600, env=gcs.env)
  assert "stages[0] 'sft': data from the prepared cache" in again.stdout, again.stdout
  from foundation import paths  # pylint: disable=g-import-not-at-top
  names = sorted(p.name.split('-')[0] for p in paths.path('gs://bucket/cache').iterdir())
  assert names == ['math_rl', 'sft'], names


_FAKE_HF_CLI = '''#!{python}
"""A stand-in for `huggingface-cli download nvidia/NAME --repo-type dataset --local-dir DIR` and
`huggingface-cli download ORG/MODEL --local-dir DIR`: records the call in $FAKE_HF_LOG and writes,
for a dataset, the release's rows (a few, in its schema), for a model, the files of an HF
checkpoint directory (config.json, model.safetensors, tokenizer.json: placeholders) under DIR: an
absolute DIR under $FAKE_HF_ROOT, a scratch stand-in for the host's file system; a relative one
from the working directory, as the real command does."""
import json, os, sys
args = sys.argv[1:]
with open(os.environ['FAKE_HF_LOG'], 'a') as f:
  f.write(json.dumps(args) + '\\n')
def place(d, rel):
  return (os.environ['FAKE_HF_ROOT'] if os.path.isabs(d) else '') + os.path.join(d, rel)
if (len(args) == 4 and args[0] == 'download' and args[2] == '--local-dir'
    and args[1].count('/') == 1):
  if args[1] not in json.loads(os.environ['FAKE_HF_MODELS']):
    sys.exit(f'404: no model repository {{args[1]}}')
  for rel in ('config.json', 'model.safetensors', 'tokenizer.json'):
    path = place(args[3], rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, 'w').write('{{}}')
  sys.exit(0)
if (len(args) != 6 or args[0] != 'download' or args[2:4] != ['--repo-type', 'dataset']
    or args[4] != '--local-dir' or not args[1].startswith('nvidia/')):
  sys.exit(f'huggingface-cli (stand-in): unexpected arguments {{args}}')
files = json.loads(os.environ['FAKE_HF_FILES']).get(args[1][len('nvidia/'):])
if files is None:
  sys.exit(f'404: no dataset repository {{args[1]}}')
for rel, rows in files.items():
  path = place(args[5], rel)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    f.writelines(json.dumps(r) + '\\n' for r in rows)
'''


# The base checkpoint each paper config starts from, as its publisher names it on the hub.
_BASE_MODELS = {'nemotron_cascade_14b': 'Qwen/Qwen3-14B-Base',
                'nemotron_cascade2': 'nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16'}


@pytest.mark.parametrize('config,assign,rows', [
    ('nemotron_cascade_14b', 'DATA=/data/nemotron', 'CASCADE1_ROWS'),
    ('nemotron_cascade2', 'DATA2=/data/nemotron2', 'CASCADE2_ROWS')])
def test_the_released_data_downloads_fill_what_the_configs_read(config, assign, rows, tmp_path):
  """docs/released_data.md's assignment, base-model download and download loop, run as shown from
  the repository root with a stand-in `huggingface-cli` (no network here) that records each call
  and writes the release's rows (the schemas of tests/cascade/data/test_released.py) under a scratch
  root standing in for the host's file system, and a checkpoint directory's files for a model:
  the model comes from the config's base model's hub repository into the directory the config
  reads its base weights and tokenizer from by default; the loop downloads exactly the releases
  the config reads, each into the directory the page assigned, and then every released dataset
  of the config loads from there (a name missing from the loop, misspelled, or a --local-dir
  elsewhere leaves a dataset without files)."""
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade.data import readers  # pylint: disable=g-import-not-at-top
  from cascade.data import released  # pylint: disable=g-import-not-at-top
  from tests.cascade.data import test_released  # pylint: disable=g-import-not-at-top
  page, var = 'docs/released_data.md', assign.split('=')[0]
  loop = doc_command(page, 'for name in Nemotron-Cascade-' + ('SFT' if var == 'DATA' else '2'))
  assert f'--local-dir ${var}/$name' in loop, loop
  # Each release's files, relative to its download directory, from the config's own paths.
  plan = config_lib.validate(importlib.import_module(f'configs.{config}').get_config(
      'data_root=/R'))
  want = getattr(test_released, rows)
  files = {}
  for name, spec in plan.datasets.items():
    if spec.format in released.ADAPTERS:
      release, rel = spec.path[len('/R/'):].split('/', 1)
      files.setdefault(release, {})[test_released._file_for(rel)] = want[name]  # pylint: disable=protected-access
  fake = tmp_path / 'bin' / 'huggingface-cli'
  fake.parent.mkdir()
  fake.write_text(_FAKE_HF_CLI.format(python=sys.executable))
  fake.chmod(0o755)
  root, log = tmp_path / 'host', tmp_path / 'calls.jsonl'
  env = dict(PATH=f'{fake.parent}{os.pathsep}{pathlib.Path(sys.prefix) / "bin"}{os.pathsep}'
                  f'{os.environ["PATH"]}', FAKE_HF_ROOT=str(root), FAKE_HF_LOG=str(log),
             FAKE_HF_FILES=json.dumps(files))
  model = doc_command(page, f'huggingface-cli download {_BASE_MODELS[config]} ')
  env['FAKE_HF_MODELS'] = json.dumps(sorted(_BASE_MODELS.values()))
  proc = run_doc_command('\n'.join([doc_command(page, assign), model, loop]), tmp_path,
                         timeout=120, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  data_root = assign.split('=', 1)[1]
  calls = [json.loads(l) for l in log.read_text().splitlines()]
  models = [c for c in calls if '--repo-type' not in c]
  assert [c[1] for c in models] == [_BASE_MODELS[config]], models
  cfg = importlib.import_module(f'configs.{config}').get_config(f'data_root={data_root}')
  base = config_lib.validate(cfg).stages[0].init_from
  assert models[0][3] == base == cfg.tokenizer.path, (models, base, cfg.tokenizer.path)
  assert (tmp_path / 'repo' / base / 'config.json').is_file(), base
  calls = [c for c in calls if '--repo-type' in c]
  names = [c[1][len('nvidia/'):] for c in calls]
  assert sorted(names) == sorted(files), (names, sorted(files))
  assert [c[5] for c in calls] == [f'{data_root}/{n}' for n in names], calls
  plan = config_lib.validate(importlib.import_module(f'configs.{config}').get_config(
      f'data_root={root}{data_root}'))
  for name, spec in plan.datasets.items():
    if spec.format in released.ADAPTERS:
      assert len(readers.load(spec, domains=list(plan.domains))) == len(want[name]), name

def _fresh_venv(work: pathlib.Path) -> dict:
  """A new virtual environment at `work`/.venv (what a user's checkout has) that also sees this
  venv's packages through a .pth file, so pip counts them as installed and downloads only what an
  extra adds; pip installs into the new one (it refuses to uninstall outside it). Returns the
  environment whose PATH finds its `pip` and `python` first."""
  import site  # pylint: disable=g-import-not-at-top
  import venv  # pylint: disable=g-import-not-at-top
  venv.EnvBuilder(with_pip=True).create(work / '.venv')
  [lib] = (work / '.venv' / 'lib').glob('python3*/site-packages')
  (lib / 'project_venv.pth').write_text('\n'.join(site.getsitepackages()) + '\n')
  # As the Makefile makes .venv: pip upgraded first (ensurepip's can be years old).
  subprocess.run([str(work / '.venv' / 'bin' / 'python'), '-m', 'pip', 'install', '-q',
                  '--upgrade', 'pip'], check=True, timeout=600)
  return dict(os.environ, PATH=f'{work / ".venv" / "bin"}{os.pathsep}{os.environ["PATH"]}')


# (page, command, the distributions it must have installed into the new venv), by case id.
_INSTALLS = {
    'gcs': ('docs/at_scale.md', "pip install -e '.[gcs]'", ['cascade', 'gcsfs']),
    'tensorboard': ('docs/metrics.md', "pip install -e '.[tensorboard]'",
                    ['cascade', 'tensorboard']),
    'wandb': ('docs/metrics.md', "pip install -e '.[wandb]'", ['cascade', 'wandb']),
    'xm': ('docs/at_scale.md', 'pip install -e .[xm]', ['cascade', 'xmanager']),
    'bench': ('docs/benchmarks.md', ".venv/bin/pip install -e '.[bench]'", ['cascade', 'trl']),
    'tpu': ('docs/planning.md', 'pip install "jax[tpu]"', ['libtpu']),
    'cuda': ('docs/at_scale.md', "pip install -e '.[cuda]'", ['cascade', 'jax-cuda12-plugin']),
    'gpu': ('docs/planning.md', "python3.11 -m venv gpuvenv && gpuvenv/bin/pip install "
            "'jax[cuda12]==0.10.2' && gpuvenv/bin/pip install -e .",
            ['cascade', 'jax', 'jax-cuda12-plugin']),
}
# The environment a case installs into, where it makes its own (default: the checkout's .venv).
_INSTALL_VENVS = {'gpu': 'gpuvenv'}
_INSTALL = _HERE + 'test_the_install_commands_install_their_extras'
REGISTRY.update({command: f'{_INSTALL}[{case}]' for case, (_, command, _) in _INSTALLS.items()})


@pytest.mark.slow      # network: 20-60 s each here, cuda 190 s (gigabytes of CUDA wheels); gpu
                       # more (cascade's dependencies too, into an environment of its own)
@pytest.mark.parametrize('case', list(_INSTALLS))
def test_the_install_commands_install_their_extras(case, tmp_path):
  """Each `pip install` a page shows, run as shown from a checkout's root in a new virtual
  environment (the package index is reachable here): it succeeds and the new environment holds
  the extra's distributions, cascade itself installed from that checkout."""
  _needs_index()
  page, command, dists = _INSTALLS[case]
  work = tmp_path / 'repo'
  work.mkdir()
  env = _fresh_venv(work)
  proc = run_doc_command(doc_command(page, command), tmp_path, timeout=3600, env=env,
                         own_venv=True, copy=('LICENSE', 'README.md'))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  check = ('import importlib.metadata as m, pathlib, sys\n'
           'for d in sys.argv[1:]:\n'
           '  print(d, pathlib.Path(m.distribution(d).locate_file("")).resolve())\n')
  venv = work / _INSTALL_VENVS.get(case, '.venv')
  out = subprocess.run([str(venv / 'bin' / 'python'), '-c', check, *dists],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-2000:]          # each distribution is there
  where = dict(line.split(' ', 1) for line in out.stdout.splitlines())
  if 'cascade' in where:                                  # installed into the new venv
    assert pathlib.Path(where['cascade']).is_relative_to(venv.resolve()), where

def test_the_topology_page_multi_slice_config_block():
  """docs/topology.md's two lines on a config: it validates, spans 2 slices, and the mesh has
  one device per chip of two v5p:4x4x4 slices (64 chips each)."""
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from launch.plan import targets as plan_targets  # pylint: disable=g-import-not-at-top
  [block] = [t for _, kind, t in units('docs/topology.md') if kind == 'block'
             and t.startswith('c.mesh = dict(shape=(2, 8, 8)')]
  spec = importlib.util.spec_from_file_location('tiny_cfg', ROOT / 'configs' / 'tiny.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  exec(block, {'c': c})  # pylint: disable=exec-used
  p = config_lib.validate(c)
  assert plan_targets.mesh_slices(p) == 2 and plan_targets.mesh_shape(p) == (2, 8, 8)
  assert math.prod(plan_targets.mesh_shape(p)) == 4 * 4 * 4 * 2
  c.mesh.slices = 4
  with pytest.raises(ValueError, match='slices'):
    plan_targets.mesh_slices(config_lib.validate(c))


def test_the_make_targets_the_docs_name():
  """`make -n` of the targets the pages name: test and test-heavy run pytest on the default and
  heavy tiers, test-all with every marker (-m ""): the tier each page says they run."""
  def recipe(target):
    out = subprocess.run(['make', '-n', '-W', 'setup.py', target], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [l for l in out.splitlines() if ' -m pytest' in l]
  assert recipe('test') == ['.venv/bin/python -m pytest -q -n 2 --dist loadfile']
  assert recipe('test-heavy') == ['.venv/bin/python -m pytest -q -n 2 --dist loadfile -m heavy']
  assert recipe('test-all') == ['.venv/bin/python -m pytest -q -m ""']


@pytest.mark.parametrize('which', ['engine', 'sandbox', 'config'])
def test_the_config_blocks_validate(which):
  """The config lines docs/engine.md and docs/sandbox.md show, on configs/tiny.py, and the whole
  config file docs/config.md shows: each validates, with the values it set."""
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  page = {'engine': 'docs/engine.md', 'sandbox': 'docs/sandbox.md', 'config': 'docs/config.md'}
  start = {'engine': "c.sampler = dict(engine='paged'", 'sandbox': 'c.domains.code = dict(',
           'config': _CONFIG_MD_BLOCK}[which]
  [block] = [t for _, kind, t in units(page[which]) if kind == 'block' and t.startswith(start)]
  if which == 'config':
    # Lines were stripped by normalise: the page's own text (indentation kept) is executed.
    scope = {}
    exec(_config_page_sample(), scope)  # pylint: disable=exec-used
    plan = config_lib.validate(scope['get_config']())
    assert [s.name for s in plan.stages] == ['sft', 'math_rl', 'code_rl']
    ds = plan.datasets['math_eval']
    assert (ds.tfds, ds.data_dir, ds.split) == ('tiny_math', 'data/tfds', 'test')
    return
  spec = importlib.util.spec_from_file_location('tiny_cfg', ROOT / 'configs' / 'tiny.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  exec(block, {'c': c})  # pylint: disable=exec-used
  plan = config_lib.validate(c)
  if which == 'engine':
    assert plan.sampler.engine == 'paged' and plan.sampler.slots == 64
  else:
    assert plan.domains['code'].verifier_options['isolation'] == 'none'


def _config_page_sample() -> str:
  """docs/config.md's sample config file, as the page shows it (indentation kept)."""
  text = (ROOT / 'docs/config.md').read_text(encoding='utf-8')
  body = text[text.index('```python\nimport ml_collections') + len('```python\n'):]
  return body[:body.index('```')]


@pytest.mark.heavy     # ~3 min: SFT, two GRPO stages and the evaluation matrix of the tiny preset
def test_the_config_page_sample_runs_on_the_data_it_names(tmp_path):
  """docs/config.md's sample, saved as a config file, trains end to end from the files it names,
  made here: the tokenizer and the math and code sets from the tiny world (its generators at
  small sizes; code_train as Parquet), data/tfds by the command the sample's comment gives. The
  command line cuts only step counts and batch sizes (`--config.stages.<name>...`, the
  overrides docs/config.md describes): every stage runs and results.json holds the matrix."""
  _BWRAP()                                    # the code verifier's sandbox
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  from tiny_world import world  # pylint: disable=g-import-not-at-top
  sample = _config_page_sample()
  work = tmp_path / 'repo'
  (work / 'data').mkdir(parents=True)
  files = world.write(str(tmp_path / 'world'), seed=0, sft=64, rl=64, heldout=16, preference=0,
                      preference_heldout=0, domains=('math', 'code'))
  shutil.copy(files['tokenizer'], work / 'data/tok.model')
  (work / 'data/sft.jsonl').write_text(''.join(
      pathlib.Path(files[d]['sft_train']).read_text() for d in ('math', 'code')))
  shutil.copy(files['math']['rl_train'], work / 'data/math_train.jsonl')
  rows = [json.loads(l) for l in pathlib.Path(files['code']['rl_train']).read_text().splitlines()]
  pq.write_table(pa.Table.from_pylist(rows), str(work / 'data/code.parquet'))
  shutil.copy(files['code']['heldout'], work / 'data/code_eval.jsonl')
  [tfds_command] = re.findall(r'`(python -m tiny_world\.tfds_math [^`]*)`', sample)
  (work / 'my_config.py').write_text(sample)
  run = ('python -m cascade.main --config=my_config.py --workdir=runs/sample '
         '--config.stages.sft.steps=2 --config.stages.sft.batch_size=4 '
         '--config.stages.math_rl.steps=2 --config.stages.math_rl.prompts_per_step=2 '
         '--config.stages.math_rl.group_size=2 --config.stages.math_rl.phases[0].until_step=1 '
         '--config.stages.math_rl.phases[1].until_step=2 --config.stages.code_rl.steps=1 '
         '--config.stages.code_rl.prompts_per_step=2 --config.stages.code_rl.group_size=2 '
         '--config.eval.num_prompts=4 --config.eval.num_samples=2')
  for command, timeout in ((tfds_command, 300), (run, 1800)):
    proc = run_doc_command(command, tmp_path, timeout=timeout)
    assert proc.returncode == 0, f'{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}'
  res = json.loads((work / 'runs/sample/results.json').read_text())
  assert res['stages'] == ['sft', 'math_rl', 'code_rl'] and res['domains'] == ['code', 'math'], res

def test_the_config_page_sample_reads_its_tfds_dataset(tmp_path, monkeypatch):
  """docs/config.md's sample reads `math_eval` from TFDS: the command its comment gives prepares
  the dataset where the sample says (data/tfds, from the directory a run starts in), and the
  sample's own spec then loads its 16 test problems through cascade.data."""
  pytest.importorskip('tensorflow_datasets')
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade.data import readers  # pylint: disable=g-import-not-at-top
  from tiny_world import tfds_math  # pylint: disable=g-import-not-at-top
  body = _config_page_sample()
  [command] = re.findall(r'`(python -m tiny_world\.tfds_math [^`]*)`', body)
  proc = run_doc_command(command, tmp_path, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  scope = {}
  exec(body, scope)  # pylint: disable=exec-used
  plan = config_lib.validate(scope['get_config']())
  monkeypatch.chdir(tmp_path / 'repo')
  records = readers.load(plan.datasets['math_eval'])
  want = tfds_math.problems('test', 16)
  assert sorted(r['metadata']['answer'] for r in records) == sorted(
      p['answer'].rsplit('#### ', 1)[1] for p in want)
  assert all(r['domain'] == 'math' for r in records)

def test_an_uncovered_command_and_a_stale_key_are_reported():
  """The check names an unregistered command by file:line; a registered one passes; a key for a
  unit a page stopped showing is the sentinel no page shows."""
  found = [('docs/x.md', 3, 'command', 'python -m nothing.registers.this --flag'),
           ('docs/x.md', 9, 'command', 'make test')]
  assert _uncovered(found, {}) == ["docs/x.md:3: 'python -m nothing.registers.this --flag'"]
  assert _uncovered(found, {'python -m nothing.registers.this --flag': 'case'}) == []
  key = _shown('docs/testing.md', 'no such command at all')
  assert key.startswith('<docs/testing.md shows no unit') and key not in {
      t for _, _, _, t in all_units()}
