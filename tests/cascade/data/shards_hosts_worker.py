"""One process of test_shards_hosts' two-process test: a sharded dataset opened by two JAX processes.

  python tests/cascade/data/shards_hosts_worker.py COORDINATOR PROCESS_ID PATTERN DIR

Joins a 2-process JAX runtime on CPU (gloo), opens the shards PATTERN names with its
own local cache (DIR/local<id>, as a host's own disk) and the shared cache DIR/shared,
draws 8 batches of 4 from a seeded loader whose reading the processes share, then
reopens the dataset (as a restarted run would) and resumes at position 13 for 3
batches. Writes to DIR/<id>.json the batches (each row's 'k'), the resumed batches,
every row's `where`, and the bytes it streamed per file while opening (every index
build and decompression goes through `cascade.data.shards._chunks`).
"""

import collections
import json
import os
import sys

os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ.pop('XLA_FLAGS', None)


def main(coordinator, process_id, pattern, out_dir):
  from cascade import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(coordinator, 2, int(process_id))
  from cascade.data import readers  # pylint: disable=g-import-not-at-top
  from cascade import rollout  # pylint: disable=g-import-not-at-top
  from cascade.data import shards  # pylint: disable=g-import-not-at-top
  streamed = collections.Counter()
  real = shards._chunks

  def chunks(f):
    for b in real(f):
      streamed[os.path.basename(f.name)] += len(b)
      yield b
  shards._chunks = chunks
  hosts = rollout.processes()
  local, shared = os.path.join(out_dir, f'local{process_id}'), os.path.join(out_dir, 'shared')

  src = shards.open_source(pattern, local, shared, hosts)
  loader = readers.Loader(readers.Stream(src, hosts=hosts), seed=3, batch_size=4)
  got = [[row['k'] for _, row in loader.next()] for _ in range(8)]
  cold = dict(streamed)
  streamed.clear()
  src = shards.open_source(pattern, local, shared, hosts)       # a restart: caches found
  resumed = readers.Loader(readers.Stream(src, hosts=hosts), seed=3, batch_size=4)
  resumed.set_state({'position': 13})
  tail = [[row['k'] for _, row in resumed.next()] for _ in range(3)]
  with open(os.path.join(out_dir, f'{process_id}.json'), 'w') as f:
    json.dump({'batches': got, 'resumed': tail, 'where': [src[i][0] for i in range(len(src))],
               'streamed': cold, 'streamed_on_restart': dict(streamed)}, f)


if __name__ == '__main__':
  main(*sys.argv[1:])
