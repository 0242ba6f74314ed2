"""A training stage's divergence policy: bad steps judged, counted, reported; a rollback or a stop.

  watch = divergence.Watch(plan.divergence, stage, saved=meta.get('divergence'))
  if watch.see(step, metrics):          # True: the stage has diverged
    ...                                 # roll back (watch.rollback_step) or raise watch.diverged()

`why_bad` judges one step's metrics by `config.divergence`
(`cascade.config.Divergence`): a loss or gradient norm that is not finite (the
train step skipped the update), a gradient of exactly zero at a loss that is
not (a saturated model: the finite garbage of a far too high learning rate,
loss stuck at ln V), an update that changed the weights by orders of magnitude
(`update_ratio` = |new - old| / |old| above `max_update_ratio`, default 1e3:
the finite step that multiplies the weights by 1e37 before the NaN steps it
causes), or a loss or gradient norm outside the configured band.
`Watch` counts bad steps per stage (in all, and in a row), reports each at once
(one stderr line; `bad_steps` in the step's metrics, so TensorBoard and
metrics.jsonl have it) and says when a stage has diverged: more than
`max_bad_steps` bad steps in a row, or any bad step in a row of them that its
last step ends (fewer are tolerated mid-stage, where good steps may follow;
at the end nothing would follow to show that the policy recovered). Its counts
travel in every checkpoint's meta (`state()`), so a resumed stage counts on
where it stopped.

A diverged stage either rolls back (while `rollbacks` remain: the loop restores
the newest checkpoint from before the bad steps and goes on with its learning
rate times `rollback_lr_factor`, a factor kept in the meta so a resume uses it
too) or stops the run with `Diverged`, one line naming the stage, step and
metric (and the first bad step's, when the run of them is longer); the stage's
policy is then neither exported nor evaluated, and the command line exits with
EXIT_CODE. The line suggests rollbacks only to a run that has none.
"""

from __future__ import annotations

import math
import sys
from typing import Mapping, Sequence

import tqdm

from cascade import checkpoint

# The exit status of a run stopped by a diverged stage.
EXIT_CODE = 3

# A loss this close to zero with a zero gradient is a step with nothing to learn (a GRPO batch
# whose groups are all equal has loss and gradient 0), not a saturated model.
_ZERO_LOSS = 1e-6


class Diverged(RuntimeError):
  """A stage diverged (past its rollbacks); the message is one line naming stage, step, metric."""


def why_bad(policy, metrics: Mapping) -> str | None:
  """Why a step is bad under `policy` (a `cascade.config.Divergence`), or None for a good one.

  Args:
    policy: the run's divergence settings.
    metrics: the step's metrics; 'loss', 'grad_norm' (before clipping) and, where the train
      step reports it, 'update_ratio' are judged.

  Returns:
    A short reason naming the metric and its value, e.g. 'grad_norm=nan is not finite'.
  """
  loss, norm = float(metrics['loss']), float(metrics['grad_norm'])
  for name, v in (('loss', loss), ('grad_norm', norm)):
    if not math.isfinite(v):
      return f'{name}={v:g} is not finite (the update was skipped)'
  if norm == 0.0 and abs(loss) > _ZERO_LOSS:
    return f'grad_norm=0 at loss={loss:.4g} (a saturated model: it no longer learns)'
  if policy.min_loss is not None and loss < policy.min_loss:
    return f'loss={loss:.4g} is below config.divergence.min_loss={policy.min_loss:g}'
  if policy.max_loss is not None and loss > policy.max_loss:
    return f'loss={loss:.4g} is above config.divergence.max_loss={policy.max_loss:g}'
  if policy.max_grad_norm is not None and norm > policy.max_grad_norm:
    return (f'grad_norm={norm:.4g} is above config.divergence.max_grad_norm='
            f'{policy.max_grad_norm:g}')
  ratio = metrics.get('update_ratio')
  if ratio is not None and policy.max_update_ratio is not None and not (
      float(ratio) <= policy.max_update_ratio):
    return (f'update_ratio={float(ratio):.4g} is above config.divergence.max_update_ratio='
            f'{policy.max_update_ratio:g} (the update changed the weights by orders of '
            'magnitude)')
  return None


class Watch:
  """One stage's bad steps: judged, counted, reported; whether and where the stage rolls back.

  Attributes:
    bad_steps: bad steps of the stage so far (rolled-back ones included).
    streak: bad steps in a row up to the newest step.
    streak_start: the first step of that run of bad steps (None: the newest step was good).
    rollbacks: rollbacks the stage has made.
    lr_scale: the factor on the stage's learning rate (rollback_lr_factor ** rollbacks).
    why: the newest bad step's reason.
    first_why: the reason of the first bad step of the run up to the newest step.
  """

  def __init__(self, policy, stage, saved: Mapping | None = None):
    saved = dict(saved or {})
    self.policy, self.stage = policy, stage
    self.bad_steps = int(saved.get('bad_steps', 0))
    self.streak = int(saved.get('streak', 0))
    self.streak_start = saved.get('streak_start')
    self.rollbacks = int(saved.get('rollbacks', 0))
    self.lr_scale = float(saved.get('lr_scale', 1.0))
    self.why = ''
    self.first_why = str(saved.get('first_why', ''))

  def state(self) -> dict:
    """The counts a checkpoint's meta keeps (JSON), for `Watch(..., saved=)` on resume."""
    return {'bad_steps': self.bad_steps, 'streak': self.streak,
            'streak_start': self.streak_start, 'rollbacks': self.rollbacks,
            'lr_scale': self.lr_scale, 'first_why': self.first_why}

  def see(self, step: int, metrics: dict) -> bool:
    """Judges step `step` (1-based, as logged); adds `bad_steps` to its metrics and reports a bad
    one on stderr (the writer process). Returns True when the stage has now diverged: past
    `max_bad_steps` bad steps in a row, or the stage's last step ends a row of them."""
    why = why_bad(self.policy, metrics)
    if why is None:
      self.streak, self.streak_start, self.first_why = 0, None, ''
      metrics['bad_steps'] = float(self.bad_steps)
      return False
    self.bad_steps += 1
    self.streak += 1
    if self.streak_start is None:
      self.streak_start, self.first_why = step, why
    self.why = why
    metrics['bad_steps'] = float(self.bad_steps)
    if checkpoint.is_writer():
      st = self.stage
      # tqdm.write keeps the stage's progress bar (also on stderr) intact.
      tqdm.tqdm.write(f'WARNING: [{st.index}] {st.name} step {step}/{st.steps}: bad step: {why} '
                      f'({self.streak} in a row; {self.policy.max_bad_steps + 1} in a row '
                      'diverge the stage)', file=sys.stderr)
    return self.streak > self.policy.max_bad_steps or step >= self.stage.steps

  @property
  def can_roll_back(self) -> bool:
    return self.rollbacks < self.policy.rollbacks

  def rollback_step(self, saved_steps: Sequence[int]) -> int:
    """The newest of `saved_steps` that no bad step judged (0: the stage's start).

    A step's metrics judge the weights it started from, so the first bad step `b` condemns the
    update of step b - 1 too: the newest state above suspicion is the one after step b - 2.
    """
    return max((s for s in saved_steps if s <= self.streak_start - 2), default=0)

  def rolled_back(self) -> None:
    """Counts a rollback: the learning rate scales down, the run of bad steps is over."""
    self.rollbacks += 1
    self.lr_scale *= self.policy.rollback_lr_factor
    self.streak, self.streak_start, self.first_why = 0, None, ''

  def diverged(self, step: int, restart_step: int) -> Diverged:
    """The one-line error of a stage that diverged at `step`; `restart_step`: its newest
    checkpoint from before the bad steps (0: none)."""
    st = self.stage
    if self.streak > self.policy.max_bad_steps:
      run = (f'{self.streak} bad steps in a row (config.divergence.max_bad_steps='
             f'{self.policy.max_bad_steps})')
    else:
      run = f'the stage ended on {self.streak} bad step(s) in a row, unrecovered'
    if self.streak > 1 and self.first_why:
      run += f', the first at step {self.streak_start}: {self.first_why}'
    back = (f'after {self.rollbacks} rollback(s) to a learning rate x{self.lr_scale:g}; '
            if self.rollbacks else '')
    since = (f'its newest checkpoint from before them is step {restart_step}'
             if restart_step else 'no checkpoint predates them')
    # Rollbacks are suggested only to a run that has none: one that used them up needs a lower lr.
    fix = 'lower its optimizer.lr' + ('' if self.policy.rollbacks
                                      else ' or set config.divergence.rollbacks')
    return Diverged(
        f'stage {st.index} {st.name!r} diverged at step {step}/{st.steps}: {self.why}; {run} '
        f'{back}({since}); its policy was not exported or evaluated: {fix}')
