"""The command line of `python -m launch.plan` (its flags and `main`; launch/plan/__init__.py
says what it does)."""

from __future__ import annotations

import sys
import time

from absl import app
from absl import flags
from etils import epath

from cascade import config as config_lib
from cascade import exits
from cascade import overrides
from launch.plan import dispatch as dispatch_lib
from launch.plan import report as report_lib
from launch.plan import results
from launch.plan import stages as stages_lib
from launch.plan import targets

# config_flags.DEFINE_config_file(lock_config=True) whose overrides also name stages and unset
# fields, as cascade.main's (cascade/overrides.py).
_CONFIG = overrides.define_config_file('config', 'Config file (configs/x.py or configs/x.py:arg).')
_BACKEND = flags.DEFINE_enum('backend', 'auto', ['auto', 'tpu', 'gpu', 'cpu'],
                             'tpu: libtpu topology; gpu: XLA:GPU deviceless for '
                             'config.hardware.gpu_target (needs a CUDA plugin of jax); cpu: '
                             'simulated CPU devices; auto: tpu when libtpu is installed and the '
                             'config targets a TPU, gpu when a CUDA plugin is and it targets a '
                             'GPU it describes, else cpu.')
_STAGES = flags.DEFINE_list('stages', [], 'Stage names to plan (default: all).')
_MEMORY = flags.DEFINE_float('device_memory_gib', None,
                             'Per-device memory limit (default: config.hardware).')
_TRAIN = flags.DEFINE_bool('train', True, "Compile the stages' train steps.")
_SAMPLER = flags.DEFINE_bool('sampler', True, "Compile RL stages' samplers.")
_EVAL = flags.DEFINE_bool('eval', True, "Compile the evaluation's sampler.")
_TIME_ONLY = flags.DEFINE_bool(
    'time_only', False, "Only each stage's step-time bound and its parts (`step_time`), "
    'compiling nothing (seconds, even for the paper configs); --backend, --train, --sampler '
    'and --eval do not apply.')
_COMPARE_DISPATCH = flags.DEFINE_bool(
    'compare_dispatch', False, "Instead of the plan: compile the selected stages' train steps "
    "and samplers once per ModelConfig.moe_dispatch ('gather', 'all_to_all') and print per "
    'program its memory and collectives, per stage its step-time bound, and which dispatch is '
    'cheaper with 10 % of memory free (`launch.plan.dispatch`); for a model whose routed '
    'experts are split over several shards.')
_REPORT = flags.DEFINE_string(
    'report', None, 'Also write the plan as a Markdown page here (any etils.epath path, e.g. '
    'docs/plans/x.md or gs://bucket/plans/x.md): the command, date, host and its load, the '
    "target, and one table row per program (`markdown_report`).")


def main(argv):
  del argv
  exits.quiet_library_logs()     # the plan's lines and its failures, no library INFO lines
  config = _CONFIG.value
  if config is None:
    raise app.UsageError('--config is required')
  plan = config_lib.validate(config)     # touches no device
  time_only = _TIME_ONLY.value
  backend = 'cpu' if time_only else _BACKEND.value
  if backend == 'auto':
    backend = targets.default_backend(plan)
  # Backends start lazily: this takes effect as long as nothing has touched a
  # device yet (the config file only imports modules). The TPU and GPU paths need
  # the CPU devices too: FLOPs are counted on CPU lowerings of the same mesh (and with
  # jax_platforms 'cpu' the CUDA plugin looks for no GPU: it only compiles).
  targets.use_simulated_cpu_devices(targets.num_devices(plan))
  tgt = targets.target(plan, backend, _MEMORY.value)
  header = report_lib.plan_header(plan, tgt, time_only)
  load_before = report_lib.host_load()
  print('\n'.join([header[0], load_before, *header[1:]]) + '\n', flush=True)
  command = 'python -m launch.plan ' + ' '.join(sys.argv[1:])
  started = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
  done: list[results.StageReport] = []

  def write_page(final: bool, bad=()):
    """The --report page, rewritten after every stage (a long plan interrupted keeps what it
    planned, marked unfinished) and once at the end."""
    if not _REPORT.value:
      return
    path = epath.Path(_REPORT.value)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_lib.markdown_report(
        done, command=command, header=header, hosts=(load_before, report_lib.host_load()),
        date=started, failed=bad, finished=final))
    if final:
      print(f'wrote {path}')

  def on_stage(r: results.StageReport):
    print(report_lib.format_stage(r), flush=True)
    done.append(r)
    write_page(final=False)

  if _COMPARE_DISPATCH.value:
    compare_dispatch(plan, tgt, header, load_before, command, started)
    return
  if time_only:
    reports = stages_lib.time_plan(plan, tgt, stages=_STAGES.value, report=on_stage)
  else:
    reports = stages_lib.run_plan(plan, tgt, stages=_STAGES.value, with_sampler=_SAMPLER.value,
                                  with_eval=_EVAL.value, with_train=_TRAIN.value, report=on_stage)
  print(f'\n{report_lib.host_load()}')
  bad = report_lib.failures(reports)
  done[:] = reports
  write_page(final=True, bad=bad)
  if bad:
    print('\nPLAN FAILED:\n  ' + '\n  '.join(bad), file=sys.stderr, flush=True)
    sys.exit(1)
  print(f'\nstep times of {len(reports)} stage(s), nothing compiled.' if time_only else
        f'\nevery planned program fits ({len(reports)} stage(s) planned).')


def compare_dispatch(plan, tgt, header, load_before: str, command: str, started: str) -> None:
  """`--compare_dispatch`: `dispatch.compare`'s tables printed (and the --report page written)
  after every stage, the dispatch `dispatch.choose` picks last."""
  done: list[dispatch_lib.Comparison] = []
  current = plan.model.moe_dispatch

  def page(final: bool) -> str:
    return '\n'.join([
        f'# Expert dispatch compared: `{command}`', '',
        f'Written by `launch.plan --compare_dispatch` on {started}, on '
        f'{report_lib.cpu_model()}.', '',
        *[f'- {h}' for h in (load_before + ' (before)', report_lib.host_load() + ' (after)',
                              *header)], '',
        *dispatch_lib.table(done, current), '',
        (dispatch_lib.summary(done, current) if final else
         f'Unfinished: {len(done)} stage(s) compared so far.'), ''])

  def on_stage(c: dispatch_lib.Comparison) -> None:
    done.append(c)
    print('\n'.join(dispatch_lib.table([c], current)) + '\n', flush=True)
    write(page(final=False))

  def write(text: str) -> None:
    if _REPORT.value:
      path = epath.Path(_REPORT.value)
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text)

  try:
    dispatch_lib.compare(plan, tgt, stages=_STAGES.value, with_sampler=_SAMPLER.value,
                         with_train=_TRAIN.value, report=on_stage)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(dispatch_lib.summary(done, current), flush=True)
  write(page(final=True))
  if _REPORT.value:
    print(f'wrote {_REPORT.value}')


def run() -> None:
  """Runs `main` as a program: its flags parsed, `--config` with the overrides
  `python -m cascade.main` takes (`cascade.overrides.flags_parser`)."""
  app.run(main, flags_parser=overrides.flags_parser(_CONFIG))
