"""cascade: Cascade RL in JAX — a list of domain-wise RL stages, checkpoints, and the matrix.

  import cascade
  results = cascade.run(config, workdir)     # = cascade.runner.run; see cascade/runner.py

Importing the package is light: `cascade.run` (and everything under it, jax
included) is imported on first use.
"""


def run(config, workdir: str) -> dict:
  """Runs (or resumes) the cascade `config` describes in `workdir` (see `cascade.runner.run`)."""
  from cascade import runner  # pylint: disable=g-import-not-at-top
  return runner.run(config, workdir)
