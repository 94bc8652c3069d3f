"""Multi-process JAX: one trainer process per host (docs/design.md section 9, docs/cluster.md).

`initialize` joins the processes (`jax.distributed.initialize`) from the CLI flags
`--coordinator host:port --num-processes N --process-id i`, or from the environment where JAX
detects a cluster by itself (SLURM `srun`, Open MPI `mpirun`). It must run before any JAX
computation. After it `jax.devices()` lists every process's devices and the mesh
(`jfp8rl.parallel.mesh.make_mesh`) spans them all.

Roles: process 0 ("main") alone talks to the rollout backend, writes the config, metrics, logs,
rollout dumps and the HF export; every process runs the same jitted programs on its own devices,
feeds its own shards of the batch and saves / restores its shards of the checkpoint (orbax).

Everything below is a collective: every process calls it in the same order, or the run hangs.
With one process they are plain calls (no communication).

* `broadcast_from_main`: process 0's arrays and JSON-able info on every process, as raw bytes
  behind a JSON header (no pickle on the wire; `jfp8rl.trainer.rollout.share_rollout` sends
  the rollout batch with it);
* `on_main`: a side effect on process 0 while the others do their part of its collectives
  (`follow`); a failure on process 0 is raised on every process, so all stop together and the
  checkpoint stays the last complete one;
* `all_gather_json`: every process's JSON-able value on every process (the checkpoint
  checks of a resume agree on their verdicts with it);
* `consume_on_main`: process 0 consumes a stream of gathered tensors (a weight push, the final
  HF export) while the others gather with it; a failure part-way still completes every gather
  before it is raised on all.

Limit: only process 0's Python exceptions are agreed on. A process that dies (killed, OOM), or
an exception on another process, leaves the rest waiting in their next collective until JAX's
coordination service notices the missing process (its heartbeat timeout) and ends them; the
launcher (`scripts/launch_cluster.sh --local`, `srun --kill-on-bad-exit=1`) stops the others
sooner.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jfp8rl.config import ConfigError
from rollout_bridge.backend import RolloutError

# Environments in which `jax.distributed.initialize()` finds its processes itself (jax's
# `_src/clusters`): (cluster, the variable holding the process count, the variables that must
# be set too). SLURM's are those of an `srun` job step, not of the batch script itself.
AUTO_ENVS = (
    ("SLURM", "SLURM_NTASKS", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")),
    ("Open MPI", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")),
)  # fmt: skip


def detected_cluster() -> str:
    """The cluster `jax.distributed.initialize()` will detect with more than one process
    ("SLURM", "Open MPI"), or "" when none (only a count above 1 turns multi-process on)."""
    for name, count, others in AUTO_ENVS:
        if int(os.environ.get(count, "1") or 1) > 1 and all(v in os.environ for v in others):
            return name
    return ""


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1) -> bool:
    """Joins the trainer processes; True when the run is multi-process.

    Explicit (all three given): `coordinator` = "host:port" of process 0 (it binds there),
    `num_processes` >= 1, 0 <= `process_id` < `num_processes`. Nothing given: the cluster
    environment (`detected_cluster`), else a single process. CPU collectives go through gloo
    (XLA's CPU client has no cross-process collectives otherwise)."""
    given = [bool(coordinator), num_processes > 0, process_id >= 0]
    if any(given) and not all(given):
        raise ConfigError(
            "--coordinator, --num-processes and --process-id go together (got "
            f"coordinator={coordinator or None}, num_processes={num_processes or None}, "
            f"process_id={process_id if process_id >= 0 else None}); give all three, or none "
            "under SLURM / mpirun"
        )
    if all(given):
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--coordinator={coordinator}: expected host:port, e.g. node0:6379")
        if process_id >= num_processes:
            raise ConfigError(
                f"--process-id={process_id} must be below --num-processes={num_processes}"
            )
        if num_processes == 1:
            return False
    elif not detected_cluster():
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if all(given):
        jax.distributed.initialize(coordinator, num_processes, process_id)
    else:
        jax.distributed.initialize()
    return jax.process_count() > 1


def describe() -> str:
    """`jfp8rl: process i of N, L local of G devices (platform)`: each process's start line."""
    return (
        f"jfp8rl: process {jax.process_index()} of {jax.process_count()}, "
        f"{jax.local_device_count()} local of {jax.device_count()} devices "
        f"({jax.devices()[0].platform})"
    )


def is_main() -> bool:
    """Process 0: the one that talks to the rollout backend and writes the run folder's files."""
    return jax.process_index() == 0


def drain(it: Iterator[Any]) -> None:
    """Runs an iterator to its end (its items' collectives), keeping nothing."""
    deque(it, maxlen=0)


def broadcast_from_main(
    arrays: dict[str, np.ndarray], info: dict[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Process 0's `arrays` and JSON-able `info` on every process (what the others pass is
    ignored). Two broadcasts: the byte count, then one uint8 buffer = 8-byte header length,
    JSON header {info, [name, dtype, shape]...}, the arrays' raw bytes; no pickle."""
    if jax.process_count() == 1:
        return arrays, info
    buf = np.zeros(0, np.uint8)
    if is_main():
        spec = [[k, np.dtype(v.dtype).str, list(v.shape)] for k, v in arrays.items()]
        for k, dt, _ in spec:
            if np.dtype(dt) != arrays[k].dtype:
                raise TypeError(f"broadcast_from_main: array {k!r} has dtype {arrays[k].dtype}, "
                                "which has no portable name; cast it to a numpy dtype")  # fmt: skip
        head = json.dumps({"info": info, "arrays": spec}).encode()
        parts = [len(head).to_bytes(8, "little"), head]
        parts += [np.ascontiguousarray(v).tobytes() for v in arrays.values()]
        buf = np.frombuffer(b"".join(parts), np.uint8)
        if buf.size >= 2**31:
            raise ValueError(f"broadcast_from_main: {buf.size} bytes exceed the 2 GiB limit")
    size = int(multihost_utils.broadcast_one_to_all(np.array(buf.size, np.int32)))
    if not is_main():
        buf = np.zeros(size, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes()
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8 : 8 + n])
    out, offset = {}, 8 + n
    for k, dt, shape in head["arrays"]:
        count = int(np.prod(shape))
        out[k] = np.frombuffer(data, np.dtype(dt), count, offset).reshape(shape).copy()
        offset += count * np.dtype(dt).itemsize
    return out, head["info"]


def all_gather_json(value: Any) -> list[Any]:
    """Every process's JSON-able `value`, in process order, on every process. Two all-gathers:
    the byte counts, then the JSON bytes padded to the longest; no pickle."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
    sizes = sizes.reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(sizes.size, -1)
    return [json.loads(rows[i, :n].tobytes()) for i, n in enumerate(sizes)]


def _agree(error: BaseException | None) -> None:
    """Collective: raises on every process when process 0 reports `error` (its own error
    object on process 0; a RolloutError naming it elsewhere)."""
    msg = f"{type(error).__name__}: {error}" if error is not None else None
    _, info = broadcast_from_main({}, {"error": msg})
    if info["error"] is None:
        return
    if error is not None:
        raise error
    raise RolloutError(f"process 0 stopped the run: {info['error']}")


def on_main[T](fn: Callable[[], T], follow: Callable[[], Any] | None = None) -> T | None:
    """`fn()` on process 0 (its result; None on the others, which run `follow()`: their part of
    the collectives `fn` makes). An exception in `fn` is raised on every process."""
    if jax.process_count() == 1:
        return fn()
    result, error = None, None
    if is_main():
        try:
            result = fn()
        except Exception as e:  # re-raised below, after the others have been told
            error = e
    elif follow is not None:
        follow()
    _agree(error)
    return result


def consume_on_main[T](consume: Callable[[Iterator[Any]], T], tensors: Iterator[Any]) -> T | None:
    """`consume(tensors)` on process 0 (a weight push, the final HF export), its result there;
    the others gather the same tensors with it (`tensors` yields each after a cross-process
    gather, `models.sharding.host_array`). When `consume` stops early (it raised, or needed
    fewer), process 0 gathers the rest, so the gathers stay matched; then the error is raised
    on every process (`on_main`) rather than leaving the others in a gather that process 0
    never joins."""
    if jax.process_count() == 1:
        return consume(tensors)

    def main() -> T:
        try:
            return consume(tensors)
        finally:
            drain(tensors)

    return on_main(main, follow=lambda: drain(tensors))
