"""The device mesh and the two shardings the trainer uses (DESIGN.md section 9).

One axis, `data`: params, optimizer state and calibration state are replicated; batch arrays
are split along their first (sample) axis. The default mesh holds one device, so a single-CPU
run and an 8-device run (`XLA_FLAGS=--xla_force_host_platform_device_count=8`) run the same
jitted code; going multi-device changes configuration (the mesh), not code. FSDP / tensor axes
would add entries to `param_sharding` only.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def make_mesh(num_devices: int = 1) -> Mesh:
    """A 1-D (`data`) mesh over the first `num_devices` devices."""
    devices = jax.devices()
    if num_devices > len(devices):
        raise ValueError(f"asked a mesh of {num_devices} devices, only {len(devices)} available")
    return Mesh(np.array(devices[:num_devices]), ("data",))


def replicated(mesh: Mesh) -> NamedSharding:
    """Params, optimizer and calibration state: one full copy per device."""
    return NamedSharding(mesh, PartitionSpec())


def data_sharded(mesh: Mesh) -> NamedSharding:
    """Batch arrays [N, ...]: samples split over `data`."""
    return NamedSharding(mesh, PartitionSpec("data"))


def put_batch(batch: dict[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """Host arrays -> device arrays sharded along the sample axis."""
    sh = data_sharded(mesh)
    return {k: jax.device_put(np.asarray(v), sh) for k, v in batch.items()}
