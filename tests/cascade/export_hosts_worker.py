"""One process of test_first_hour's two-process stage export (Policies.export_hf).

  python tests/cascade/export_hosts_worker.py COORDINATOR PROCESS_ID CONFIG SOURCE WORKDIR

Joins a 2-process JAX runtime on CPU (4 simulated devices each, gloo), loads the HF checkpoint
SOURCE onto a (2, 2, 2) mesh spanning both processes (no parameter addressable by one process
alone), and exports it as CONFIG's first stage under WORKDIR through Policies.export_hf, with
jax.experimental.multihost_utils.process_allgather wrapped to record what each call gathers.
Prints one JSON line: the bytes of each gather call's input, of the largest parameter and of
the whole policy.
"""

import json
import os
import sys

os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ.pop('XLA_FLAGS', None)

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 4)


def main(coordinator, process_id, config_path, source, workdir):
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(coordinator, 2, int(process_id))
  import importlib.util  # pylint: disable=g-import-not-at-top

  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  from cascade import config as config_lib  # pylint: disable=g-import-not-at-top
  from cascade import policies as policies_lib  # pylint: disable=g-import-not-at-top
  from models import hf  # pylint: disable=g-import-not-at-top
  from models import sharding  # pylint: disable=g-import-not-at-top

  spec = importlib.util.spec_from_file_location('export_config', config_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  plan = config_lib.validate(module.get_config())
  mesh = sharding.make_mesh((2, 2, 2))
  model = hf.load_model(source, mesh=mesh)
  params = nnx.split(model)[1]
  assert not any(x.is_fully_addressable for x in jax.tree.leaves(params))
  gathered = []
  plain = multihost_utils.process_allgather

  def recording(x, *args, **kwargs):
    gathered.append(sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(x)))
    return plain(x, *args, **kwargs)

  multihost_utils.process_allgather = recording
  pol = policies_lib.Policies(plan, workdir, mesh, plan.rules)
  out = pol.export_hf(plan.stages[0], params)
  sizes = [int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(params)]
  print(json.dumps({'gathered': gathered, 'whole': sum(sizes), 'largest': max(sizes),
                    'out': out}), flush=True)


if __name__ == '__main__':
  main(*sys.argv[1:])
