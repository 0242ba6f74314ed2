"""One process of test_multihost: joins a 2-process JAX runtime on CPU, runs the cascade, restores.

  python tests/launch/multihost_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID CONFIG WORKDIR OUT

Each process has 4 simulated CPU devices (8 global, collectives over gloo),
runs `cascade.runner.run(config, workdir)` on the shared workdir, then restores
the last stage's final Orbax checkpoint (a collective restore) and writes
{process, devices, results, checksum} to OUT/<process id>.json, where
checksum is the float64 sum of |param| over every parameter (computed on
the global arrays, so both processes must agree).
"""

import importlib.util
import json
import os
import sys

os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ.pop('XLA_FLAGS', None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update('jax_num_cpu_devices', 4)


def _load_config(path):
  spec = importlib.util.spec_from_file_location('multihost_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _checksum(params) -> float:
  """sum |p| over all leaves, as one replicated scalar read from this process's shard."""
  total = jax.jit(lambda p: sum(jnp.sum(jnp.abs(x.astype(jnp.float32)))
                                for x in jax.tree.leaves(p)))(params)
  return float(np.asarray(total.addressable_shards[0].data))


def main(coordinator, num_processes, process_id, config_path, workdir, out_dir):
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(coordinator, int(num_processes), int(process_id))
  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade import policies  # pylint: disable=g-import-not-at-top
  from cascade import runner  # pylint: disable=g-import-not-at-top
  from models import sharding  # pylint: disable=g-import-not-at-top
  config = _load_config(config_path)
  results = runner.run(config, workdir)
  plan = config_lib.validate(config)
  pol = policies.Policies(plan, workdir, sharding.make_mesh(plan.mesh_shape), plan.rules)
  try:
    state = pol.final_state(plan.stages[-1])
    checksum = _checksum(state.params)
    step = int(np.asarray(state.step.addressable_shards[0].data))
  finally:
    pol.close()
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, f'{jax.process_index()}.json'), 'w') as f:
    json.dump({'process': jax.process_index(), 'processes': jax.process_count(),
               'devices': jax.device_count(), 'local_devices': jax.local_device_count(),
               'results': results, 'checksum': checksum, 'step': step}, f)


if __name__ == '__main__':
  main(*sys.argv[1:])
