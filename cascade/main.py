"""Runs (or resumes) a cascade.

  python -m cascade.main --config=configs/tiny.py:smoke --workdir=runs/smoke
  python -m cascade.main --config=configs/tiny.py --workdir=runs/tiny --config.eval.num_prompts=64

The flags to know first:
  --config=FILE[:ARG]  a Python file whose get_config(arg=None) returns the run's ConfigDict
                       (docs/config.md); ARG is passed as `arg` (configs/tiny.py:smoke,seed=1).
  --workdir=DIR        the run's directory, local or gs://; the same command run again in it
                       resumes at the exact stage and step (a different config is refused
                       unless --config.allow_config_change=True).
  --config.PATH=VALUE  overrides one field: --config.eval.num_prompts=64; a stage by name
                       (--config.stages.math_rl.steps=10) or position (stages[4]); a field the
                       config leaves unset, as its declared type (--config.mesh.shape=1,2,1).
  --fork_from=DIR      another run's workdir: the leading stages both configs share are copied
                       from there, not run again.

Exit status: 0 done; 2 a config, data, workdir or storage problem, or a verifier that raises in
its own code (one line); 3 a stage diverged; 75 stopped by SIGTERM or SIGINT at a step boundary
with a checkpoint: run the same command again to resume (cascade/exits.py).

Output: a start banner, then one line per event (cascade/report.py). Logs: warnings and errors
only; --verbosity=0 adds the libraries' INFO lines. Multi-host: jax.distributed.initialize()
runs first when the environment asks for it (cascade/distributed.py).
"""

import sys

from absl import app
from absl import flags

from cascade import exits
from cascade import overrides

# config_flags.DEFINE_config_file(lock_config=True), whose overrides also name stages and unset
# fields (cascade/overrides.py).
_CONFIG = overrides.define_config_file(
    'config', 'A Python file whose get_config(arg=None) returns the ConfigDict; FILE:ARG passes '
    'ARG. --config.PATH=VALUE overrides one field (--config.stages.math_rl.steps=10).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; an existing one is resumed.')
_FORK_FROM = flags.DEFINE_string(
    'fork_from', None, "Another run's workdir: the leading stages this config shares with it "
    '(identical stages, identical other sections) are copied from there, not rerun.')
_FORCE_LOCK = flags.DEFINE_bool(
    'force_lock', False, "Take the workdir's lock over even from a run that looks alive.")
_LOCK_STALE_S = flags.DEFINE_float(
    'lock_stale_s', 600.0, 'A workdir lock with no heartbeat for this many seconds is taken over.')
flags.declare_key_flag('config')      # defined in cascade/overrides.py; --help lists it here
flags.mark_flags_as_required(['config', 'workdir'])

# absl's flag parsing; --help prints this docstring and the flags above (exit 0); a bad config
# file, argument or override is one line (exit 2).
parse_flags = overrides.flags_parser(_CONFIG)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  exits.quiet_library_logs()
  exits.quiet_storage_errors()
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize()         # before any other JAX work (gloo on CPU)
  from cascade import runner  # pylint: disable=g-import-not-at-top
  exits.run(lambda: runner.run(_CONFIG.value, _WORKDIR.value, fork_from=_FORK_FROM.value,
                               force_lock=_FORCE_LOCK.value, lock_stale_s=_LOCK_STALE_S.value,
                               command=overrides.described(_CONFIG, sys.argv)), _WORKDIR.value)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
