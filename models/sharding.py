"""Partition specs of the model params over a {data, fsdp, expert, tensor} mesh.

Layout in docs/design.md section 9.

The rules follow tunix's `ShardingConfig` for Qwen3 and MaxText's logical axis rules, in this
code base's [in, out] kernel layout:

    param (shape)                          spec                    Megatron role
    embed_tokens.embedding [V, D]          (tensor, fsdp)          vocab-parallel embedding
    q/k/v_proj.kernel      [L, D, H*E]     (None, fsdp, tensor)    column-parallel
    q/k/v_proj.bias        [L, H*E]        (None, tensor)          as its kernel's output
    o_proj.kernel          [L, H*E, D]     (None, tensor, fsdp)    row-parallel
    gate/up_proj.kernel    [L, D, F]       (None, fsdp, tensor)    column-parallel
    down_proj.kernel       [L, F, D]       (None, tensor, fsdp)    row-parallel
    lm_head                [D, V]          (fsdp, tensor)          vocab-parallel head
    norms (any)            replicated      (small: D or E floats per layer)

Mixture-of-Experts layers (Qwen3-MoE, Qwen2-MoE, Mixtral):

    mlp.gate.kernel        [L, D, E]       (None, fsdp, None)      the router
    mlp.shared_expert_gate.kernel [L, D, 1] (None, fsdp, None)     Qwen2-MoE, as the router
    mlp.shared_expert.*    as the dense MLP's                       Qwen2-MoE's shared expert
    mlp.experts.gate/up_proj [L, E, D, I]  (None, expert, fsdp, tensor)   as the dense MLP's,
    mlp.experts.down_proj  [L, E, I, D]    (None, expert, tensor, fsdp)   experts over `expert`

The experts' E axis is split over `expert` (expert parallelism, `models.expert_parallel`: a
device holds E / expert of every layer's experts), their D and I axes as the dense MLP's. The
router is small (D x E floats per layer) and every device routes its own tokens over all E
experts, so its E axis is never split: its D axis is FSDP-sharded like every matrix's, and
all-gathered in the layer.

The `expert` axis also splits the batch (`BATCH_AXES`): its devices are data-parallel for
everything but the experts, so for the other params it is one more FSDP axis: the dims that
`fsdp` splits (the embed role) are split over `fsdp x expert` where both are in the mesh (over
`fsdp` alone, else, when the product does not divide), and the experts' D, whose E already
takes `expert`, over `fsdp`. A mesh without an expert axis gets the table above unchanged.

FSDP shards every large matrix over `fsdp` (ZeRO-3: XLA all-gathers a layer's weights inside
the layer scan and reduce-scatters its gradients); `tensor` splits the attention heads and the
MLP width (Megatron-LM). The stacked layer axis L is never sharded (the scan slices it).

A dim is sharded over an axis only when the axis is in the mesh with size > 1 and divides it;
otherwise that dim falls back to replication (silently: e.g. a 151936 vocabulary over
tensor=16 still shards, 152064 over fsdp=7 does not). The q/k/v and o splits over `tensor`
also need whole heads per device (num_heads, resp. num_kv_heads, divisible by the tensor
size), since attention reshapes H*E into [H, E]; k/v fall back to replication when the KV
heads do not divide (GQA with more devices than KV heads), q/o keep their split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig

# The mesh axes a batch is split over, outermost first (the trainer's
# `jfp8rl.parallel.mesh.BATCH_AXES`). `expert` is innermost, so the devices of one expert group
# hold one contiguous block of the batch (`models.expert_parallel`).
BATCH_AXES = ("data", "fsdp", "expert")

# Logical roles of each param's dims, by the param's path suffix (layer params without L).
_EMBED, _HEADS_Q, _HEADS_KV, _MLP = "embed", "heads_q", "heads_kv", "mlp"
_VOCAB, _EXPERTS = "vocab", "experts"
_RULES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("embed_tokens", "embedding"): (_VOCAB, _EMBED),
    ("q_proj", "kernel"): (_EMBED, _HEADS_Q),
    ("k_proj", "kernel"): (_EMBED, _HEADS_KV),
    ("v_proj", "kernel"): (_EMBED, _HEADS_KV),
    ("q_proj", "bias"): (_HEADS_Q,),
    ("k_proj", "bias"): (_HEADS_KV,),
    ("v_proj", "bias"): (_HEADS_KV,),
    ("o_proj", "kernel"): (_HEADS_Q, _EMBED),
    ("gate_proj", "kernel"): (_EMBED, _MLP),
    ("up_proj", "kernel"): (_EMBED, _MLP),
    ("down_proj", "kernel"): (_MLP, _EMBED),
    ("lm_head",): (_EMBED, _VOCAB),
    ("mlp", "gate", "kernel"): (_EMBED, None),  # the MoE router
    ("shared_expert_gate", "kernel"): (_EMBED, None),  # Qwen2-MoE's shared expert's gate
    ("experts", "gate_proj"): (_EXPERTS, _EMBED, _MLP),
    ("experts", "up_proj"): (_EXPERTS, _EMBED, _MLP),
    ("experts", "down_proj"): (_EXPERTS, _MLP, _EMBED),
}


def _role_axes(fsdp_axis: str, tensor_axis: str, expert_axis: str) -> dict[str, tuple[str, ...]]:
    """The axes each role's dim is split over, jointly, in this order (a dim takes the longest
    prefix of those still free in its spec whose product divides it)."""
    return {
        _EMBED: (fsdp_axis, expert_axis),
        _VOCAB: (tensor_axis,),
        _HEADS_Q: (tensor_axis,),
        _HEADS_KV: (tensor_axis,),
        _MLP: (tensor_axis,),
        _EXPERTS: (expert_axis,),
    }


def _spec(
    path: tuple[str, ...],
    shape: tuple[int, ...],
    cfg: ModelConfig,
    mesh_shape: Mapping[str, int],
    role_axes: dict[str, tuple[str, ...]],
) -> PartitionSpec:
    """The spec of one param from its path, shape and the mesh's axis sizes."""
    # Stacked layer params sit under model.layers, also inside an optimizer state's tree.
    stacked = any(path[i : i + 2] == ("model", "layers") for i in range(len(path) - 2))
    roles = next((r for suffix, r in _RULES.items() if path[-len(suffix) :] == suffix), None)
    if roles is None:  # norms: replicated
        return PartitionSpec()
    dims = shape[1:] if stacked else shape
    if len(dims) != len(roles):
        raise ValueError(f"param {'.'.join(path)}: shape {shape} does not match roles {roles}")
    # Whole heads per device: the number of heads (not H*E) must divide.
    units = {_HEADS_Q: cfg.num_heads, _HEADS_KV: cfg.num_kv_heads}
    out: list[str | tuple[str, ...] | None] = []
    used: set[str] = set()
    for dim, role in zip(dims, roles, strict=True):
        count = units.get(role, dim)
        axes = role_axes.get(role, ()) if role else ()
        free = [a for a in axes if mesh_shape.get(a, 1) > 1 and a not in used]
        while free and (dim % _size(free, mesh_shape) or count % _size(free, mesh_shape)):
            free.pop()
        used.update(free)
        out.append(None if not free else free[0] if len(free) == 1 else tuple(free))
    return PartitionSpec(*(([None] if stacked else []) + out))


def _size(axes: list[str], mesh_shape: Mapping[str, int]) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def param_partition_specs(
    cfg: ModelConfig,
    params: Any,
    mesh_shape: Mapping[str, int],
    *,
    fsdp_axis: str = "fsdp",
    tensor_axis: str = "tensor",
    expert_axis: str = "expert",
) -> Any:
    """A pytree like `params` (arrays or `jax.ShapeDtypeStruct`s, an `nnx.State` or its pure
    dict) with a `PartitionSpec` per param (module docstring). `mesh_shape` maps axis names to
    sizes (`mesh.shape`); axes missing from it count as size 1 (never named in a spec).

    Params are recognised by their path suffix, so any tree whose leaves sit under the params'
    paths works too: an optax state (`mu`/`nu` mirror the params and get their specs; scalars
    such as `count` are replicated)."""
    role_axes = _role_axes(fsdp_axis, tensor_axis, expert_axis)

    def one(key_path: tuple[Any, ...], leaf: Any) -> PartitionSpec:
        path = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)
        # nnx.State leaves are Variables: their key path ends in the Variable's `value`.
        path = tuple(p for p in path if p != "value")
        return _spec(path, tuple(leaf.shape), cfg, mesh_shape, role_axes)

    return jax.tree_util.tree_map_with_path(one, params)


def param_shardings(cfg: ModelConfig, params: Any, mesh: Mesh, **axes: str) -> Any:
    """`param_partition_specs` as `NamedSharding`s on `mesh` (for `jax.jit` in/out shardings,
    `jax.device_put`, or `hf_state.from_hf_state_dict(shardings=...)`)."""
    specs = param_partition_specs(cfg, params, mesh.shape, **axes)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def constrain_batch(x: jax.Array) -> jax.Array:
    """x with its leading (batch) axis sharded over the context mesh's batch axes.

    Applied to the residual stream [B, T, D] after the embedding and after every layer: without
    it XLA's sharding propagation may resolve an FSDP matmul by all-gathering the activations
    instead of the weights, which multiplies the update's temporaries (`python -m jfp8rl.plan`
    reports them, e.g. for qwen3_8b with fsdp=8). A no-op without a mesh context
    (`jax.set_mesh`), as in the rollout engine and single-device tests, when no batch axis has
    size > 1, or when B does not divide over them.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if not axes or x.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes))


def host_array(x: Any) -> Any:
    """The whole of a (possibly multi-process) jax.Array as one numpy array on this host.

    One process: a plain device-to-host copy. Several processes (`jax.distributed`), where a
    sharded array has shards this process cannot address: every process must call this for
    the same array (it is a collective: `multihost_utils.process_allgather`), and each gets the
    full value."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        # np.asarray, not jax.device_get: on CPU the former is a view of the buffer, the latter
        # a copy.
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
