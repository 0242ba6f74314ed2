"""The record that code ran unsandboxed survives a resume: progress.json notes each verifier's
isolation as its code runs (before every checkpoint save and progress.json write), and
results.json's "isolation" is read from it, so a rerun that builds no such verifier (a stage
resumed at its last step, scored by another verifier) still says so."""

import importlib.util
import json

import pytest

from cascade import checkpoint
from cascade import preemption
from cascade import runner
from cascade.kinds import loop


def test_isolation_is_noted_once_merged_and_read_back(tmp_path):
  progress = checkpoint.Progress(str(tmp_path))
  assert progress.record_isolation({'code': 'none'})
  assert not progress.record_isolation({'code': 'none'})     # nothing new: no save needed
  progress.save()
  again = checkpoint.Progress(str(tmp_path))
  assert again.isolation == {'code': ['none']}
  assert again.record_isolation({'code': 'bwrap, none', 'swe': 'bwrap'})
  again.mark_done('code_rl', {'index': 0, 'isolation': {'tool_use': 'none'}})
  assert runner._isolation(checkpoint.Progress(str(tmp_path))) == {  # pylint: disable=protected-access
      'code': 'bwrap, none', 'swe': 'bwrap', 'tool_use': 'none'}


UNSANDBOXED = 'test_unsandboxed_math'


def _unsandboxed_math():
  """The math verifier, registered under another name, saying its code runs unsandboxed (what
  a code verifier with isolation='none' says), so the toy copy cascade can train with it."""
  import verifiers  # pylint: disable=g-import-not-at-top
  if UNSANDBOXED not in verifiers.names():

    class Unsandboxed(verifiers.cls('math')):
      @property
      def isolation(self) -> str:
        return 'none'

    verifiers.register(UNSANDBOXED, Unsandboxed)


def _load(path):
  spec = importlib.util.spec_from_file_location('cfg', path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


@pytest.mark.heavy
def test_a_resumed_run_keeps_the_record_that_code_ran_unsandboxed(tmp_path, copy_cascade,
                                                                  faults, monkeypatch):
  _unsandboxed_math()
  c = _load(copy_cascade(tmp_path, train=16, eval_=8, sft=32, sft_steps=2, rl_steps=2))
  # GRPO trains on the unsandboxed verifier; every evaluation scores with the plain one.
  c.domains.copy.verifier = UNSANDBOXED
  c.domains.copy.eval_verifier = 'math'
  c.domains.copy.eval_verifier_options = {'workers': 1}
  work = str(tmp_path / 'run')
  # Preempted at the RL stage's last step: the rerun resumes there, so it never builds the
  # training verifier again (no step left) and its evaluation uses the other one.
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [faults.signal_at('copy_rl:2:SIGTERM')])
  with pytest.raises(preemption.Preempted, match="stage 1 'copy_rl' step 2/2"):
    runner.run(c, work)
  monkeypatch.setattr(loop, 'STEP_END_HOOKS', [])
  res = runner.run(c, work)
  assert res['stages'] == ['sft', 'copy_rl']
  assert res['isolation'] == {UNSANDBOXED: 'none'}
  with open(f'{work}/results.json') as f:
    assert json.load(f)['isolation'] == {UNSANDBOXED: 'none'}
