"""`python -m launch.plan`: the planner's command line (`launch.plan.cli`)."""

from absl import flags

from launch import plan
from launch.plan import cli

# absl's --help prints the main module's docstring and key flags: the package's docstring (what
# the command does) and the flags of launch.plan.cli.
__doc__ = plan.__doc__  # pylint: disable=redefined-builtin
flags.adopt_module_key_flags(cli)

if __name__ == '__main__':
  cli.run()
