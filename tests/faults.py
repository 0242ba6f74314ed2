"""Fault injection for the kill/resume and preemption tests, installed by the tests only.

The training loop calls every hook in `cascade.kinds.loop.STEP_END_HOOKS` at the end of each
step, an evaluation every hook in `cascade.evaluation.BATCH_END_HOOKS` after each batch (both
empty in a run). This module makes the hooks the tests need and, run as a script, is
`python -m cascade.main` with them installed:

  python tests/faults.py --kill_at=sft:4 --config=configs/x.py --workdir=DIR
  python tests/faults.py --signal_at=sft:3:SIGTERM --config=configs/x.py --workdir=DIR
  python tests/faults.py --signal_after_batch=copy:2:SIGTERM --config=configs/x.py --workdir=DIR

In process: `monkeypatch.setattr(loop, 'STEP_END_HOOKS', [faults.kill_at('sft:4')])`, with
the module from the `faults` fixture (tests/conftest.py).
"""

import os
import signal
import sys


def kill_at(where: str):
  """A hook that SIGKILLs the process once step `where` ('<stage>:<step>') has its checkpoint
  on disk, so a kill/resume test stops a run at a chosen point, not by a race."""

  def hook(stage: str, step: int, saved: bool, ckpts) -> None:
    if saved and f'{stage}:{step}' == where:
      ckpts.wait()
      os.kill(os.getpid(), signal.SIGKILL)

  return hook


def signal_at(spec: str):
  """A hook that sends this process a signal at the end of a step, just before the loop asks
  whether to stop; `spec` is '<stage>:<step>:<signal>' (e.g. 'sft:3:SIGTERM'), so a preemption
  test (one host of two, say) picks the step it is signalled at."""
  where, _, name = spec.rpartition(':')
  sig = signal.Signals[name]

  def hook(stage: str, step: int, saved: bool, ckpts) -> None:
    del saved, ckpts
    if f'{stage}:{step}' == where:
      os.kill(os.getpid(), sig)

  return hook


def signal_after_batch(spec: str):
  """An evaluation hook (`cascade.evaluation.BATCH_END_HOOKS`) that sends this process a signal
  once, when batch N of a domain's evaluation is scored; `spec` is '<domain>:<N>:<signal>'
  (e.g. 'copy:2:SIGTERM'), so a preemption test stops an evaluation between two batches."""
  where, _, name = spec.rpartition(':')
  sig = signal.Signals[name]
  fired = []

  def hook(domain: str, batch: int, batches: int) -> None:
    del batches
    if f'{domain}:{batch}' == where and not fired:
      fired.append(True)
      os.kill(os.getpid(), sig)

  return hook


def _main():
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top

  from cascade import evaluation  # pylint: disable=g-import-not-at-top
  from cascade import main as cascade_main  # pylint: disable=g-import-not-at-top
  from cascade.kinds import loop  # pylint: disable=g-import-not-at-top

  kill = flags.DEFINE_string('kill_at', None, "'<stage>:<step>': SIGKILL once its checkpoint "
                             'is on disk.')
  sig = flags.DEFINE_string('signal_at', None, "'<stage>:<step>:<signal>': send that signal "
                            'at the end of that step.')
  eval_sig = flags.DEFINE_string('signal_after_batch', None, "'<domain>:<batch>:<signal>': "
                                 "send that signal once that evaluation batch is scored.")

  def main(argv):
    if kill.value:
      loop.STEP_END_HOOKS.append(kill_at(kill.value))
    if sig.value:
      loop.STEP_END_HOOKS.append(signal_at(sig.value))
    if eval_sig.value:
      evaluation.BATCH_END_HOOKS.append(signal_after_batch(eval_sig.value))
    cascade_main.main(argv)

  app.run(main, flags_parser=cascade_main.parse_flags)


if __name__ == '__main__':
  _main()
