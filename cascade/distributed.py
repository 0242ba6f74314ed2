"""Multi-host start-up: `jax.distributed.initialize()` driven by flags or the environment.

* TPU pods / GKE / SLURM / Open MPI: JAX detects the cluster itself; set
  `CASCADE_DISTRIBUTED=auto` (or pass `mode='auto'`) to call
  `jax.distributed.initialize()` with no arguments.
* Anything else (GPU clusters, two local CPU processes in tests): an explicit
  coordinator address, process count and process id, from arguments or the
  environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
  `JAX_PROCESS_ID`).
* Neither: a single process; nothing is initialised.

On CPU the cross-process collectives use gloo, which must be chosen before
the backend starts, so call `initialize` before any other JAX work.

`allgather_bytes` hands every process every process's host-side payload
(the rollout scorers' shares of the rewards, `cascade.rollout.score`).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

_initialized = False


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, mode: str | None = None) -> bool:
  """Joins the multi-process JAX runtime when this run is one of several processes.

  Args:
    coordinator_address: 'host:port' of process 0's coordinator.
    num_processes: total number of processes.
    process_id: this process's index in [0, num_processes).
    mode: 'auto' (cluster auto-detection), 'explicit', 'off', or None to
      decide from the arguments and the environment.

  Returns:
    True when the distributed runtime is (now) initialised.

  Raises:
    ValueError: an explicit set-up with a missing or inconsistent field.
  """
  global _initialized
  if _initialized:
    return True
  env = os.environ
  mode = mode or env.get('CASCADE_DISTRIBUTED')
  coordinator_address = coordinator_address or env.get('JAX_COORDINATOR_ADDRESS')
  if num_processes is None and env.get('JAX_NUM_PROCESSES'):
    num_processes = int(env['JAX_NUM_PROCESSES'])
  if process_id is None and env.get('JAX_PROCESS_ID'):
    process_id = int(env['JAX_PROCESS_ID'])
  if mode == 'off':
    return False
  if mode is None:
    mode = 'explicit' if coordinator_address else 'off'
  if mode == 'off':
    return False
  if mode not in ('auto', 'explicit'):
    raise ValueError(f'distributed mode {mode!r}: expected auto, explicit or off')
  if mode == 'explicit':
    missing = [n for n, v in (('coordinator_address', coordinator_address),
                              ('num_processes', num_processes),
                              ('process_id', process_id)) if v is None]
    if missing:
      raise ValueError(f'multi-process run: missing {", ".join(missing)} '
                       '(flags or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)')
    if not 0 <= process_id < num_processes:
      raise ValueError(f'process_id={process_id} is not in [0, num_processes={num_processes})')
  if _cpu_only():
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if mode == 'auto':
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
  _initialized = True
  logging.info('distributed: process %d of %d, %d local / %d global devices',
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def _cpu_only() -> bool:
  platforms = os.environ.get('JAX_PLATFORMS', '') or str(jax.config.jax_platforms or '')
  return platforms.strip().lower() == 'cpu'


def allgather_bytes(data: bytes) -> list[bytes]:
  """Every process's `data`, in process order (a collective: every process must call it).

  Payloads may differ in length: the lengths are gathered first, then the
  payloads padded to one width (rounded up to a power of two, so repeated
  calls reuse a few compiled gathers).

  Args:
    data: this process's payload.

  Returns:
    One bytes object per process; [data] in a single process.
  """
  if jax.process_count() == 1:
    return [data]
  lengths = multihost_utils.process_allgather(np.array([len(data)], np.int32)).reshape(-1)
  width = 1 << max(4, int(lengths.max() - 1).bit_length())
  buf = np.zeros(width, np.uint8)
  buf[:len(data)] = np.frombuffer(data, np.uint8)
  gathered = multihost_utils.process_allgather(buf)
  return [gathered[i, :n].tobytes() for i, n in enumerate(lengths.tolist())]
