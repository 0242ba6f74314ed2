"""cascade: Cascade RL in JAX — a list of domain-wise RL stages, checkpoints, and the matrix.

  import cascade
  results = cascade.run(config, workdir)     # see cascade/run.py

Importing the package is light: `cascade.run` (and everything under it, jax
included) is imported on first use.
"""


def __getattr__(name):
  if name == 'run':
    import importlib  # pylint: disable=g-import-not-at-top
    # The submodule is callable: cascade.run(config, workdir) == cascade.run.run(...).
    return importlib.import_module('cascade.run')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
