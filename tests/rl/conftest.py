"""The tiny policy the sampler and engine tests sample from."""

import jax
import pytest
from flax import nnx

from models import config as config_lib
from models import transformer

CFG = config_lib.ModelConfig.tiny()          # GQA: 4 heads over 2 kv heads


def peaked_policy(mesh=None):
  """(graphdef, params) of the tiny policy with weights scaled up, so its distributions are
  peaked (real stop tokens, few near-ties); born sharded on `mesh` when given."""
  graphdef, params = nnx.split(transformer.create(CFG, seed=0, mesh=mesh))
  return graphdef, jax.tree.map(lambda x: x * 4, params)


@pytest.fixture(scope='module')
def make_policy():
  return peaked_policy


@pytest.fixture(scope='module')
def policy():
  return peaked_policy()
