"""Command line: tokenize a config's training data once, before any run (`data.token_cache`).

  python -m cascade.prepare --config=configs/tiny.py --cache_dir=gs://bucket/cascade-cache
  python -m cascade.prepare --config=configs/tiny.py --workdir=runs/tiny

Every stage that tokenizes its records (SFT: tokens and loss masks) or filters them by
tokenized length (RL prompts) gets its cache, streamed (memory bounded by one record
and the writer's buffer); each stage prints rows/s. A run then finds the cache and
starts without tokenizing, as does every resume. The cache directory is `--cache_dir`,
else the config's `data_cache`, else `<--workdir>/data_cache` (where a run keeps it);
a run does the same step itself when its cache is missing. The config's own
data-making step (`config.prepare`) runs first, as in a run.

Started on several processes the way a run is (`cascade.distributed`: the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID environment, or
CASCADE_DISTRIBUTED=auto on a TPU pod), the processes split the work: each opens
its share of the shards and tokenizes its share of the positions, into a cache
directory they all see (gs://), the same files one process would write.

Exit status: 0 done; 2 a config or data problem (one line).
"""

import sys
import time

from absl import app
from absl import flags

from cascade import exits
from cascade import overrides

_CONFIG = overrides.define_config_file('config', 'Config file (configs/x.py or configs/x.py:arg).')
_CACHE_DIR = flags.DEFINE_string('cache_dir', None, 'Where the prepared data go (local or gs://).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'A run directory: the cache goes to its '
                               'data_cache/ (when neither --cache_dir nor config.data_cache).')
flags.mark_flag_as_required('config')


def prepare(config, cache_dir: str, hosts=None) -> dict:
  """Makes (or finds) the prepared data of every stage of `config` in `cache_dir`.

  Args:
    config: the run's config.
    cache_dir: where the prepared data go (local or gs://).
    hosts: the processes sharing the work (`cascade.rollout.processes()`); None: one.

  Returns:
    stage name -> {'rows', 'seconds'} of the stage's stream (its source's rows).
  """
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade.data import stage_data  # pylint: disable=g-import-not-at-top
  from cascade import verifier_set  # pylint: disable=g-import-not-at-top
  from foundation import chat_template  # pylint: disable=g-import-not-at-top
  from foundation import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  plan = config_lib.validate(config)
  if plan.prepare is not None:
    plan.prepare.call()
  tokenizer = chat_template.attach(tokenizer_lib.load(plan.tokenizer_path), plan.chat_template)
  checks = verifier_set.VerifierSet(plan, rm_scorer=lambda st: None, rm_ready=lambda n: False)
  sd = stage_data.StageData(plan, tokenizer, checks.check_metadata, cache_dir=cache_dir,
                            hosts=hosts)
  t0 = time.time()
  sd.load()
  out = {st.name: {'rows': len(sd.stage_records(st).source)}
         for st in plan.stages if st.datasets}
  print(f'prepared {len(out)} stage(s) in {time.time() - t0:.1f} s; cache {cache_dir}',
        flush=True)
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  exits.quiet_library_logs()     # its lines and one error line, no JAX backend probing
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade.data import readers  # pylint: disable=g-import-not-at-top
  from foundation import paths  # pylint: disable=g-import-not-at-top
  cfg = _CONFIG.value
  cache_dir = _CACHE_DIR.value or (cfg.get('data_cache') if hasattr(cfg, 'get') else None)
  if not cache_dir and _WORKDIR.value:
    cache_dir = paths.join(_WORKDIR.value, 'data_cache')
  if not cache_dir:
    print('error: give --cache_dir, --workdir or config.data_cache', file=sys.stderr)
    sys.exit(2)
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  from cascade import rollout  # pylint: disable=g-import-not-at-top
  distributed.initialize()          # several processes, when the environment says so
  try:
    prepare(cfg, cache_dir, rollout.processes())
  except (config_lib.ConfigError, readers.DataError, paths.PathError) as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main, flags_parser=overrides.flags_parser(_CONFIG))
