"""`python -m launch.plan`: runs the planner's command line (launch/plan/targets.py)."""

from absl import app
from absl import flags

from cascade import overrides
from launch.plan import targets

# absl's --help prints the main module's docstring and key flags: the planner's.
__doc__ = targets.__doc__  # pylint: disable=redefined-builtin
flags.adopt_module_key_flags(targets)

if __name__ == '__main__':
  app.run(targets.main, flags_parser=overrides.flags_parser(targets._CONFIG))  # pylint: disable=protected-access
