"""The device mesh and the shardings of the train state and the batch (docs/design.md section 9).

Four named axes, `("data", "fsdp", "expert", "tensor")`, sized by `train.mesh`:

* params: the PartitionSpecs of `models.sharding` (FSDP over `fsdp` for every large matrix,
  column/row tensor parallelism over `tensor`, a Mixture-of-Experts model's experts over
  `expert`), replicated over `data`; the `expert` axis also FSDP-shards the dims `fsdp` splits
  of the params other than the experts;
* optimizer state: every leaf that mirrors a param (Adam's mu and nu) takes that param's spec
  (`optax.tree_map_params`); everything else (step counts) is replicated;
* calibration state, PRNG, metrics: replicated scalars;
* batch arrays [N, ...]: samples split over `data x fsdp x expert` (FSDP devices each see their
  own samples and all-gather the weights they need, as in nanodo's `fsdp.py`; the expert axis
  splits the batch too, innermost: its devices are data-parallel for all but the experts, whose
  tokens they exchange, `models.expert_parallel`).

The default `train.mesh` is 1 x 1 x 1 x 1, so a single-CPU run and an 8-device run
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`) run the same jitted code. With several
trainer processes (`jfp8rl.parallel.distributed`) the mesh spans all their devices, process-major.

`Layout` bundles the mesh with the param specs as a hashable value (flattened specs + treedef),
so `step.make_step_fns` can cache compiled programs per layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jfp8rl.config import ConfigError
from jfp8rl.config.sections import MeshConfig
from models.sharding import BATCH_AXES, param_partition_specs

# Outermost first: `tensor` innermost (the fastest links), then `expert` (its all-to-all).
AXES = ("data", "fsdp", "expert", "tensor")
# Samples are split over the data-parallel axes, `BATCH_AXES` = (data, fsdp, expert) (from
# `models.sharding`, whose batch constraint and expert exchange must agree with it).


def resolve_mesh(sizes: Mapping[str, int], n_devices: int) -> dict[str, int]:
    """The axes' sizes (a subset of `AXES`; the others are 1) with a -1 entry replaced by the
    remaining devices, in `AXES` order.

    Raises ValueError when more than one entry is -1, an entry is 0 or < -1, the product
    does not divide / exceed `n_devices`.
    """
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {AXES}")
    sizes = {a: sizes[a] for a in AXES if a in sizes}
    named = " ".join(f"{a}={v}" for a, v in sizes.items())
    if any(v == 0 or v < -1 for v in sizes.values()):
        raise ValueError(f"mesh sizes must be positive or -1, got {named}")
    free = [a for a, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError("at most one mesh axis may be -1 (the remaining devices)")
    known = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if n_devices % known:
            raise ValueError(
                f"-1 means the remaining devices: {n_devices} devices are not a multiple of "
                f"the other axes' product {known}"
            )
        sizes[free[0]] = n_devices // known
    if math.prod(sizes.values()) > n_devices:
        product = " x ".join(f"{a}={v}" for a, v in sizes.items())
        raise ValueError(
            f"mesh {product} needs {math.prod(sizes.values())} devices, only {n_devices} available"
        )
    return {a: sizes.get(a, 1) for a in AXES}


def resolve_mesh_shape(data: int, fsdp: int, tensor: int, n_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) of a mesh without an expert axis, a -1 entry replaced by the
    remaining devices (`resolve_mesh`, which names the expert axis too)."""
    r = resolve_mesh({"data": data, "fsdp": fsdp, "tensor": tensor}, n_devices)
    return r["data"], r["fsdp"], r["tensor"]


def make_mesh(
    data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Any = None, *, expert: int = 1
) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh over the first data*fsdp*expert*tensor devices (one
    size may be -1: the rest)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor} | (
        {"expert": expert} if expert != 1 else {}
    )
    shape = tuple(resolve_mesh(sizes, len(devices)).values())
    n = math.prod(shape)
    if jax.process_count() > 1:
        return Mesh(multi_process_grid(shape, devices), AXES)
    try:
        # Topology-aware order on GPU/TPU (tensor axis innermost: the fastest links).
        grid = mesh_utils.create_device_mesh(shape, devices[:n])
    except (ValueError, AssertionError, NotImplementedError):
        grid = np.array(devices[:n]).reshape(shape)
    return Mesh(grid, AXES)


def mesh_for_config(m: MeshConfig, devices: Any = None) -> Mesh:
    """The mesh of `train.mesh`; a size the devices cannot hold is a ConfigError naming it."""
    try:
        return make_mesh(m.data, m.fsdp, m.tensor, devices, expert=m.expert)
    except ValueError as e:
        named = f"data: {m.data}, fsdp: {m.fsdp}, tensor: {m.tensor}"
        named += f", expert: {m.expert}" if m.expert != 1 else ""
        raise ConfigError(f"train.mesh={{{named}}}: {e}") from e


def multi_process_grid(shape: tuple[int, ...], devices: list[Any]) -> np.ndarray:
    """The device grid of a mesh over several processes (`jfp8rl.parallel.distributed`): every device
    of every process, process-major, so the outer axes span the hosts and `tensor` (then
    `expert`, `fsdp`) stays inside one host's fast links; e.g. 2 hosts x 8 GPUs as data=2 x
    fsdp=8 keeps FSDP's all-gathers on NVLink and only the gradient all-reduce crosses hosts."""
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"with {jax.process_count()} processes the mesh must use all {len(devices)} "
            f"devices, {' x '.join(AXES[-len(shape) :])} = {math.prod(shape)} (set one axis "
            "to -1)"
        )
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.array(ordered).reshape(shape)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's axes among `BATCH_AXES` (a mesh built elsewhere may lack some)."""
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def batch_size_divisor(mesh: Mesh) -> int:
    """Sample counts (micro-batches, mini-batches) must be multiples of this."""
    return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    """Scalars and small state: one full copy per device."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Batch arrays [N, ...]: samples split over `data x fsdp x expert`."""
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the PartitionSpec of every param leaf, hashable (a jit cache key)."""

    mesh: Mesh
    param_treedef: Any  # jax PyTreeDef of the params
    param_shapes: tuple[jax.ShapeDtypeStruct, ...]  # one per leaf, in treedef order
    param_specs: tuple[PartitionSpec, ...]  # one per leaf, in treedef order

    def params(self) -> Any:
        """The params' NamedShardings (same tree as the params)."""
        return jax.tree.unflatten(
            self.param_treedef, [NamedSharding(self.mesh, s) for s in self.param_specs]
        )

    def abstract_params(self) -> Any:
        """The params as `jax.ShapeDtypeStruct`s carrying their shardings (no memory)."""
        return jax.tree.unflatten(
            self.param_treedef,
            [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, s))
                for a, s in zip(self.param_shapes, self.param_specs, strict=True)
            ],
        )

    def opt_state(self, optimizer: optax.GradientTransformation) -> Any:
        """Shardings of `optimizer.init(params)`: a param's spec for each leaf mirroring it,
        replicated for the rest (counts). Same tree as the optimizer state."""
        state = jax.eval_shape(optimizer.init, self.abstract_params())
        rep = replicated(self.mesh)
        return optax.tree_map_params(
            optimizer,
            lambda _, sh: sh,
            state,
            self.params(),
            transform_non_params=lambda _: rep,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )

    def replicated(self) -> NamedSharding:
        return replicated(self.mesh)

    def batch(self) -> NamedSharding:
        return batch_sharded(self.mesh)


def make_layout(mesh: Mesh, params: Any, param_specs: Any) -> Layout:
    """`Layout` from the params (arrays or ShapeDtypeStructs) and a tree of PartitionSpecs
    of the same structure."""
    leaves, treedef = jax.tree.flatten(params)
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if len(specs) != len(leaves):
        raise ValueError(f"{len(specs)} PartitionSpecs for {len(leaves)} params")
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
    return Layout(mesh, treedef, shapes, tuple(specs))


def replicated_layout(mesh: Mesh, params: Any) -> Layout:
    """Every param replicated (a 1-device mesh, or a model without sharding specs)."""
    return make_layout(mesh, params, jax.tree.map(lambda _: PartitionSpec(), params))


def put_batch(batch: dict[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """Host arrays (the global batch, the same on every process) -> device arrays sharded
    along the sample axis. Each process copies only the blocks of its own devices (with
    several processes, `jfp8rl.parallel.distributed`, the mesh spans devices it cannot address)."""
    sh = batch_sharded(mesh)

    def put(x: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda index: x[index])

    return {k: put(v) for k, v in batch.items()}


def param_layout(mesh: Mesh, model_cfg: Any, params: Any) -> Layout:
    """The params' layout on `mesh`: `models.sharding`'s specs (FSDP + tensor parallel) for
    the model's param tree (arrays or ShapeDtypeStructs); the same specs `models.hf_io.load_hf
    (mesh=...)` loads into."""
    return make_layout(mesh, params, param_partition_specs(model_cfg, params, dict(mesh.shape)))
