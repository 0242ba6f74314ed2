"""One process of test_hf_tokenizer's two-process export: a model sharded over both hosts.

  python tests/models/hf_export_worker.py COORDINATOR PROCESS_ID SOURCE OUT

Joins a 2-process JAX runtime on CPU (4 simulated devices each, gloo), loads the
HF export SOURCE onto a (2, 2, 2) mesh that spans both processes (no parameter is
addressable by one process alone), and saves it with SOURCE's tokenizer to
OUT/p<process id> in weight files of at most 100 KB.
"""

import os
import sys

os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ.pop('XLA_FLAGS', None)

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 4)


def main(coordinator, process_id, source, out):
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(coordinator, 2, int(process_id))
  from models import hf  # pylint: disable=g-import-not-at-top
  from models import sharding  # pylint: disable=g-import-not-at-top
  from foundation import tokenizer  # pylint: disable=g-import-not-at-top
  model = hf.load_model(source, mesh=sharding.make_mesh((2, 2, 2)))
  assert not model.embed.get_value().is_fully_addressable
  hf.save_model(model, os.path.join(out, f'p{process_id}'), tokenizer=tokenizer.load(source),
                max_shard_size=100_000)


if __name__ == '__main__':
  main(*sys.argv[1:])
