"""Scores a checkpoint on evaluation suites: the papers' benchmarks by their protocols.

  python -m cascade.evaluate --checkpoint=/ckpt/Qwen3-14B --suites=aime25,ifeval --data_dir=data
  python -m cascade.evaluate --imports=tiny_world --checkpoint=runs/tiny   # a run: its suites

The flags to know first:
  --checkpoint=DIR   an HF checkpoint directory (config.json, safetensors, tokenizer), or a run's
                     workdir: its last exported stage (--stage=NAME for another), with the
                     run's config.eval.suites, suite data and protocol overrides as defaults.
  --suites=A,B       suite names (docs/evaluation.md lists them with their protocols).
  --data_dir=DIR     where the suites' files are: DIR/<suite>/ (a generated world's suites: the
                     world's directory); --download fetches them where the machine is online.
  --workdir=DIR      where each suite's graded batches are kept (a rerun resumes there) and
                     evaluation.json / evaluation.md are written; default: the run's
                     evaluations/<stage>, else runs/evaluate/<checkpoint's name>.
  --samples=K ...    protocol overrides (--max_new_tokens, --temperature, --top_p, --top_k,
                     --greedy, --thinking): the protocol's hash changes with them.
  --imports=PKG      packages to import first: they register their own suites (tiny_world).
  --suite_option=SUITE.KEY=VALUE   a suite's grader option (repeatable): ArenaHard's judge,
                     arena_hard_v2.url=http://judge:8000/v1 (a served one, with .model=,
                     .api_key_env=, .cache_dir=, .concurrency=, ...) or arena_hard_v2.judge=DIR
                     (a local judge model), and .baseline_answers=FILE; a run's
                     config.eval.suite_options are the defaults.

Prints one line per suite and then the table (suite, metric, value ± s.e., pass@k, n, k) and
the papers' numbers beside it with the difference and its uncertainty.

Exit status: 0 done; 2 a problem the user fixes (missing data: one line naming the suite and
the file; an unknown suite, a checkpoint that is not one, grader options a suite rejects);
75 stopped by SIGTERM or SIGINT before a batch: run the same command again to resume
(cascade/exits.py).
"""

import importlib
import os
import sys

from absl import app
from absl import flags

from cascade import exits
from cascade import overrides
from cascade.suites import options as options_lib

_CHECKPOINT = flags.DEFINE_string('checkpoint', None, "An HF checkpoint directory or a run's "
                                  'workdir (its last exported stage, or --stage).')
_STAGE = flags.DEFINE_string('stage', None, "With a run's workdir: the stage whose export to "
                             'evaluate (default: the last one).')
_SUITES = flags.DEFINE_list('suites', [], "Suite names (default: a run's config.eval.suites).")
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where graded batches and evaluation.{json,md} '
                               "go (default: the run's evaluations/<stage>, else "
                               'runs/evaluate/<name>).')
_DATA_DIR = flags.DEFINE_string('data_dir', None, "The suites' data root: DIR/<suite>/ (default: "
                                "a run's config.eval.suite_data, else data/suites).")
_DOWNLOAD = flags.DEFINE_bool('download', False, "Fetch missing suites' files from the Hugging "
                              'Face Hub (huggingface_hub, where the machine is online).')
_MAX_PROMPTS = flags.DEFINE_integer('max_prompts', None, 'Prompts per suite, its first N (0 = '
                                    "all; default: a run's config.eval.suite_prompts, else all).")
_IMPORTS = flags.DEFINE_list('imports', [], 'Packages to import first (they register suites and '
                             'verifiers), e.g. tiny_world.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_BATCH = flags.DEFINE_integer('batch_size', 64, 'Prompts per sampler call.')
_MESH = flags.DEFINE_list('mesh', None, "Mesh shape, e.g. 1,8,1 (default: a run's config.mesh, "
                          'else one device).')
_SAMPLER = flags.DEFINE_list('sampler', None, 'Sampler options as config.sampler takes them, '
                             "KEY=VALUE,... (default: a run's config.sampler, else engine=paged).")
_SUITE_OPTION = flags.DEFINE_multi_string(
    'suite_option', [], "A suite's grader option, SUITE.KEY=VALUE (repeatable), e.g. "
    'arena_hard_v2.url=http://host:8000/v1 (the judge), arena_hard_v2.judge=DIR (a local judge '
    "model), arena_hard_v2.baseline_answers=FILE; default: a run's config.eval.suite_options.")
_SAMPLES = flags.DEFINE_integer('samples', None, 'Protocol override: samples per prompt (k).')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', None, 'Protocol override: completion budget.')
_TEMPERATURE = flags.DEFINE_float('temperature', None, 'Protocol override: temperature.')
_TOP_P = flags.DEFINE_float('top_p', None, 'Protocol override: nucleus mass.')
_TOP_K = flags.DEFINE_integer('top_k', None, 'Protocol override: top-k (0 = off).')
_GREEDY = flags.DEFINE_bool('greedy', None, 'Protocol override: argmax decoding (samples=1).')
_THINKING = flags.DEFINE_enum('thinking', None, ['think', 'no_think', 'none'],
                              'Protocol override: the /think switch.')
flags.mark_flags_as_required(['checkpoint'])


def _overrides() -> dict:
  out = {k: f.value for k, f in (('samples', _SAMPLES), ('max_new_tokens', _MAX_NEW),
                                 ('temperature', _TEMPERATURE), ('top_p', _TOP_P),
                                 ('top_k', _TOP_K), ('greedy', _GREEDY)) if f.value is not None}
  if _THINKING.value is not None:
    out['thinking'] = {'think': True, 'no_think': False, 'none': None}[_THINKING.value]
  return out


def _sampler_options() -> dict | None:
  if _SAMPLER.value is None:
    return None
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  out = {}
  for item in _SAMPLER.value:
    key, eq, value = item.partition('=')
    if not eq:
      raise config_lib.ConfigError(f'--sampler: {item!r} is not KEY=VALUE')
    out[key] = options_lib.scalar(value)
  return out


def _evaluate() -> None:
  # pylint: disable=g-import-not-at-top  (JAX starts only after the flags are parsed)
  import jax
  from jax.experimental import multihost_utils
  from cascade import checkpoint as ckpt_lib
  from cascade import preemption
  from cascade.suites import checkpoint
  from cascade.suites import run as suites_run
  from cascade.suites import table
  # pylint: enable=g-import-not-at-top
  writer = ckpt_lib.is_writer()
  say = print if writer else (lambda _: None)
  source = checkpoint.resolve(_CHECKPOINT.value, _STAGE.value or '')
  suites = checkpoint.for_tokenizer(checkpoint.plan(_SUITES.value, source, _overrides()), source)
  options = checkpoint.grader_options(suites, source,
                                     options_lib.suite_options(_SUITE_OPTION.value))
  root = _DATA_DIR.value or checkpoint.default_data_dir(source)
  prompts = (_MAX_PROMPTS.value if _MAX_PROMPTS.value is not None
             else checkpoint.default_prompts(source))
  if _DOWNLOAD.value:
    if writer:
      for suite in suites:
        if not checkpoint.has_files(suite, root):
          checkpoint.download(suite, root, say)
    if jax.process_count() > 1:       # the other processes read what process 0 fetched
      multihost_utils.sync_global_devices('cascade.evaluate.download')
  sets = [(s, checkpoint.read(s, root, prompts)) for s in suites]   # missing data: exit 2 here
  workdir = _WORKDIR.value or (
      os.path.join(source.run, 'evaluations', source.stage) if source.run
      else os.path.join('runs', 'evaluate', os.path.basename(os.path.normpath(source.hf_dir))))
  say(f'evaluate: {source.describe()} on {", ".join(s.name for s in suites)}; data {root}; '
      f'kept in {workdir}')
  loaded = checkpoint.load(source, [int(x) for x in _MESH.value] if _MESH.value else None,
                           _sampler_options())
  with preemption.watch():
    try:
      results = checkpoint.evaluate(sets, loaded.policy, workdir, seed=_SEED.value,
                                    batch_size=_BATCH.value, grader_options=options,
                                    stop=preemption.stop_requested, say=say,
                                    load_judge=loaded.load_judge)
    except suites_run.Stopped as e:
      raise preemption.Preempted(f'{e}; the graded batches are kept in {workdir}: rerun the same '
                                 'command to resume there') from None
  rep = checkpoint.report(results, suites, source, root, _SEED.value)
  if writer:
    js, md = checkpoint.write(workdir, rep, suites)
    print('\n' + table.results_table(results), flush=True)
    papers = table.papers_table(results, {s.name: s for s in suites})
    if papers:
      print("The papers' numbers beside (± this run's standard error; the papers give none):\n\n"
            + papers, flush=True)
    print(f'results: {md}, {js}', flush=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  exits.quiet_library_logs()
  exits.quiet_storage_errors()
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize()
  sys.path.insert(0, os.getcwd())          # --imports of a package beside the command
  for name in _IMPORTS.value:
    try:
      importlib.import_module(name)
    except ImportError as e:
      print(f'error: --imports={name}: {e}', file=sys.stderr, flush=True)
      sys.exit(2)
  exits.run(_evaluate, _WORKDIR.value or '.')


if __name__ == '__main__':
  app.run(main, flags_parser=overrides.plain_flags_parser)
