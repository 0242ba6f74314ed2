"""foundation.step_clock: a step's wall time split into program and host parts, on a fake clock."""

import pytest

from foundation import step_clock


@pytest.fixture
def now(monkeypatch):
  """A settable perf_counter: `now.t` seconds."""
  class Now:
    t = 0.0
  monkeypatch.setattr(step_clock.time, 'perf_counter', lambda: Now.t)
  return Now


def test_parts_nest_and_add_up_to_the_wall_time(now):
  clock = step_clock.StepClock()
  clock.start()
  now.t = 1.0                                   # 1 s before any part: 'other'
  with clock.part('batch'):
    now.t = 1.5
    with clock.program('sampling'):
      now.t = 4.5                               # 3 s of program inside 'batch'
    now.t = 5.0
  with clock.program('update'):
    now.t = 7.0
  with clock.outside():                         # a hook: no part of the step
    now.t = 100.0
  with clock.part('metrics log'):
    now.t = 100.25
  step = clock.stop()
  assert step['batch'] == pytest.approx(1.0)    # 4 s in it, 3 of them its inner program's
  assert step['sampling'] == pytest.approx(3.0)
  assert step['update'] == pytest.approx(2.0)
  assert step['metrics log'] == pytest.approx(0.25)
  assert step['other'] == pytest.approx(1.0)
  assert step['step_s'] == pytest.approx(7.25)  # 100.25 minus the 93 s outside
  assert step['program_s'] == pytest.approx(5.0)
  assert step['host_s'] == pytest.approx(2.25)
  assert clock.program_parts == {'sampling', 'update'}
  assert clock.history == [step]


def test_steps_are_summed_and_averaged(now):
  clock = step_clock.StepClock()
  for program, host in ((1.0, 0.5), (3.0, 1.5)):
    clock.start()
    with clock.program('update'):
      now.t += program
    with clock.part('checks'):
      now.t += host
    clock.stop()
  assert clock.steps == 2
  means = clock.means()
  assert means['update'] == pytest.approx(2.0) and means['host_s'] == pytest.approx(1.0)
  assert clock.host_parts() == {'checks': pytest.approx(1.0), 'other': 0.0}


def test_parts_outside_a_step_and_the_null_clock_time_nothing(now):
  clock = step_clock.StepClock()
  with clock.part('batch'):                     # no step started
    now.t = 5.0
  assert clock.stop() == {} and clock.totals == {} and not clock.running
  clock.start()
  clock.start()                                 # a step still running is dropped
  now.t = 6.0
  assert clock.stop()['step_s'] == pytest.approx(1.0) and clock.steps == 1
  null = step_clock.NULL
  with null.part('x'), null.program('y'), null.outside():
    pass
  null.start()
  assert null.stop() == {} and not null.running
