"""The training entry point as one of several processes on JAX's distributed runtime.

`python -m experiments.launch` starts N local processes of `experiments.train` over loopback and
tells each its place through the environment (COORDINATOR, NUM_PROCESSES, PROCESS_ID,
HEARTBEAT_SECONDS below); `initialize` reads them, checks them by name and calls
`jax.distributed.initialize`, with gloo collectives on CPU. On a cluster (SLURM, Cloud TPU),
`python -m experiments.train --distributed` calls `jax.distributed.initialize()` with no
arguments and JAX finds the coordinator itself, as it documents.

What the runner does differently with several processes (`experiments.train`): every process
builds the same global batch (a pure function of seed and step) and hands the runtime only the
rows its own devices hold (`global_batch`); every process saves and restores checkpoints
together (orbax); evaluation runs on the parameters gathered to each host (`local`), so each
process computes the same figures; only process 0 (`is_primary`) writes metrics, TensorBoard,
plots and the summary.
"""

from __future__ import annotations

import os
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils

COORDINATOR = "FLAX_MHA_COORDINATOR"  # host:port of process 0's coordination service
NUM_PROCESSES = "FLAX_MHA_NUM_PROCESSES"
PROCESS_ID = "FLAX_MHA_PROCESS_ID"
HEARTBEAT_SECONDS = "FLAX_MHA_HEARTBEAT_SECONDS"  # a peer silent this long ends every process
DEFAULT_HEARTBEAT_SECONDS = 10
INIT_TIMEOUT_SECONDS = 120  # how long processes wait for each other to start


class SetupError(ValueError):
  """A distributed setting that cannot work, named (the entry point prints it alone)."""


def _env_int(name: str, lowest: int, environ) -> int:
  text = environ[name]
  try:
    value = int(text)
  except ValueError:
    raise SetupError(f"{name} must be an int, got {text!r}") from None
  if value < lowest:
    raise SetupError(f"{name} must be >= {lowest}, got {value}")
  return value


def settings(environ=None) -> dict | None:
  """The distributed settings the environment gives (None: not one of several processes),
  checked: a ValueError names the variable that is wrong."""
  environ = os.environ if environ is None else environ
  if NUM_PROCESSES not in environ:
    return None
  missing = [name for name in (COORDINATOR, PROCESS_ID) if name not in environ]
  if missing:
    raise SetupError(f"{NUM_PROCESSES} is set, so {' and '.join(missing)} must be too")
  num = _env_int(NUM_PROCESSES, 1, environ)
  pid = _env_int(PROCESS_ID, 0, environ)
  if pid >= num:
    raise SetupError(f"{PROCESS_ID} must be in [0, {num}) for {NUM_PROCESSES}={num}, got {pid}")
  host, _, port = environ[COORDINATOR].rpartition(":")
  if not host or not port.isdigit():
    raise SetupError(f"{COORDINATOR} must be host:port, got {environ[COORDINATOR]!r}")
  heartbeat = _env_int(HEARTBEAT_SECONDS, 1, environ) if HEARTBEAT_SECONDS in environ else (
      DEFAULT_HEARTBEAT_SECONDS)
  return dict(coordinator_address=f"{host}:{port}", num_processes=num, process_id=pid,
              heartbeat_timeout_seconds=heartbeat)


def check_port_free(address: str) -> None:
  """Raise a ValueError naming `address` (host:port) if nothing can listen there."""
  host, _, port = address.rpartition(":")
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    try:
      sock.bind((host, int(port)))
    except OSError as e:
      raise SetupError(f"the coordinator address {address} cannot be used ({e.strerror}): "
                       f"another process listens there; pick another port") from None


def initialize(auto: bool = False) -> None:
  """Join the distributed runtime if the environment says so (`settings`), or with `auto`
  through JAX's own cluster detection (`jax.distributed.initialize()`); nothing otherwise.
  Call before anything else touches JAX's devices."""
  given = settings()
  if given is None and not auto:
    return
  # CPU collectives across processes (on GPU and TPU the platform's own are used).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # SIGTERM is the training loop's (experiments.preemption): the runtime's preemption notifier
  # would take it over and, unless polled every step, swallow it, leaving the process running.
  jax.config.update("jax_enable_preemption_service", False)
  if given is None:
    jax.distributed.initialize()
    return
  if given["process_id"] == 0:
    check_port_free(given["coordinator_address"])
  jax.distributed.initialize(initialization_timeout=INIT_TIMEOUT_SECONDS, **given)


def is_primary() -> bool:
  """Whether this process writes the run's files (process 0)."""
  return jax.process_index() == 0


def check_mesh_covers_devices(mesh_size: int) -> None:
  """With several processes every device must be in the mesh (a process whose devices are all
  outside it would have nothing to run)."""
  if jax.process_count() > 1 and mesh_size != jax.device_count():
    raise SetupError(
        f"with {jax.process_count()} processes the mesh must use all {jax.device_count()} "
        f"devices, got config.mesh data x fsdp x model x seq = {mesh_size}")


def global_batch(batch: dict, sharding) -> dict:
  """Every host array [B, ...] of `batch` as one global array laid out by `sharding`, built
  from the rows this process's devices hold (`jax.make_array_from_callback` asks for those
  only). In one process the host arrays as they are: jit's in_shardings place them."""
  if jax.process_count() == 1:
    return batch
  return {name: jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index])
          for name, x in batch.items()}


def local(tree):
  """`tree` as each process can compute with it on its own: unchanged in one process; with
  several, NumPy arrays of the global values, gathered into every process."""
  if jax.process_count() == 1:
    return tree
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def barrier(name: str) -> None:
  """Wait until every process reaches `name` (nothing with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
  """Whether `flag` is True in any process, the same answer in each. With several processes an
  all-gather: every process must call it at the same point of the program."""
  if jax.process_count() == 1:
    return flag
  return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))
