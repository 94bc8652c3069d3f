"""Expert parallelism: the Mixture-of-Experts block's experts split over the mesh's `expert`
axis, each token's (token, expert) pairs sent to the devices that hold their experts by an
all-to-all exchange and their outputs sent back (GShard / DeepSpeed-MoE style).

`models.moe.mix_experts` calls `sharded_experts` when it runs under a mesh context
(`jax.set_mesh`, as the trainer's step programs do) whose batch axes split the tokens; without
one (the rollout engine, single-device tests) it computes the experts locally.

Layout (mesh axes `data`, `fsdp`, `expert`, `tensor`; `models.sharding` has the specs):

* Experts: `[E, D, I]` / `[E, I, D]` stored with E over `expert`, D over `fsdp`, I over
  `tensor`. For the block a device all-gathers its own E / X experts whole over `fsdp` and
  `tensor` (as FSDP gathers a dense layer's weights; the backward reduce-scatters their
  gradients), so device x of the expert axis holds experts [x E / X, (x + 1) E / X).
* Tokens: the expert axis also splits the batch, as the innermost batch axis (`BATCH_AXES`),
  so the devices of one expert group are data-parallel for attention and the dense layers, as
  in GShard, MaxText and Megatron-LM: otherwise the X devices of a group would hold the same
  tokens and compute the same attention X times, and the all-to-all would have nothing to
  exchange. A group's X devices hold one contiguous block of the batch.
* The router runs outside the exchange, under GSPMD, on each device's own tokens (its small
  [D, E] kernel all-gathered: every device routes over all E experts).

The exchange (inside `jax.shard_map` over the whole mesh): a device sorts its N x k pairs by
expert (stable: token order within an expert), so the pairs for device j are one run; sends run
j to device j with `jax.lax.all_to_all`; the receiver sorts what it got by its local expert
(stable: source order, then token order, which is the group's token order), runs the SwiGLU
experts as `models.fp8.grouped_dot` grouped GEMMs, and sends the outputs back the same way; the
sender scatters them to its pairs and sums each token's k outputs with the router's weights.

Dropless: every routed pair is computed, whatever the load. `jax.lax.all_to_all` moves
equal-sized blocks, so each block has room for the worst case: all of a device's pairs going
to one device (N x min(k, E / X) rows, `capacity`; a token's k experts are distinct, a top-k
or a replayed one). The receive buffer is X such blocks, X times the average load: the memory
of a dropless static-shape exchange, which grows with X (`docs/plan_results.md`: Qwen3-30B-A3B
fits 16 x 80 GB at expert=2 and 4, not at 8). A capacity factor would bound it by dropping
the pairs of overloaded experts, which changes the model's output and is not done here.
`jax.lax.ragged_all_to_all` would send only the real rows, but XLA:CPU does not implement it
(jax 0.11.2), so the exchange is the padded one on every backend (what the tests check); the
buffers' padding rows belong to no expert, and the grouped GEMM leaves them out where it can
(a GPU's ragged_dot; the tiled CPU loop of `models.fp8.ragged` skips whole padding tiles).

FP8: a device computes each of its experts over all the pairs its expert group routed to the
expert, in the group's token order, so every expert's GEMMs are quantized as
`grouped_dot` quantizes them on one device. The devices of the other groups (along `data` and
`fsdp`: `replica axes`) hold the expert's other rows; the quantizations whose tiles run along
the tokens (wgrad; "tensor" and "row" activation scales) complete their amax across them
(`grouped_dot`'s `row_offsets` / `row_axes`), so the FP8 values are those of one device
computing the whole batch (tested on 8 forced host devices, `tests/jfp8rl/parallel/
test_expert_parallel.py`).

The `tensor` axis does not split the experts' work: its devices hold the same tokens and
compute the same block (the experts' I axis is split over `tensor` for storage only). Use
`expert` and `fsdp` for MoE models.

Without an expert axis (X = 1), the same program runs each device's own tokens through all E
experts (gathered whole), i.e. data-parallel experts, instead of leaving the sort of the global
batch to GSPMD. Falls back to `None` (the caller's GSPMD path: correct, not parallel) when the
tokens do not divide over the batch axes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from models.fp8 import Recipe, grouped_dot
from models.sharding import BATCH_AXES

# The axis the experts are split over; the innermost of `BATCH_AXES`, so an expert group's
# devices hold one contiguous block of the batch.
EXPERT_AXIS = "expert"


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the block runs on the context mesh."""

    batch_axes: tuple[str, ...]  # the axes (size > 1) the tokens are split over, in order
    expert_axis: str | None  # the axis the experts are split over (None: every device has all)
    expert_size: int  # X, its size (1: none)
    replica_axes: tuple[str, ...]  # batch axes other than the expert axis: the expert groups

    @property
    def token_spec(self) -> PartitionSpec:
        return PartitionSpec(self.batch_axes)

    @property
    def expert_spec(self) -> PartitionSpec:
        return PartitionSpec(self.expert_axis) if self.expert_axis else PartitionSpec()


def plan_for(n_tokens: int, n_experts: int) -> Plan | None:
    """The plan on the context mesh (`jax.set_mesh`) for N tokens and E experts, or None: no
    mesh context, no batch axis of size > 1, or N not divisible over the batch axes. The
    experts are split over `expert` when E divides over it; otherwise that axis only splits
    the batch."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    batch = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    if not batch or n_tokens % math.prod(sizes[a] for a in batch):
        return None
    x = sizes.get(EXPERT_AXIS, 1)
    if x > 1 and n_experts % x == 0:
        return Plan(batch, EXPERT_AXIS, x, tuple(a for a in batch if a != EXPERT_AXIS))
    return Plan(batch, None, 1, batch)


def capacity(n_tokens: int, top_k: int, experts_per_device: int) -> int:
    """Rows of one block of the exchange: the most pairs one device can send another (all its
    N tokens, each with at most min(k, E / X) of the receiver's experts)."""
    return n_tokens * min(top_k, experts_per_device)


def sharded_experts(
    x: Float[Array, "N D"],
    weights: Float[Array, "N k"],
    experts: Int[Array, "N k"],
    w_gate: Float[Array, "E D I"],
    w_up: Float[Array, "E D I"],
    w_down: Float[Array, "E I D"],
    *,
    recipe: Recipe,
) -> Float[Array, "N D"] | None:
    """sum over each token's k experts of weight * SwiGLU expert(x), in f32, computed with the
    experts split over the context mesh (module doc); None where `plan_for` gives no plan."""
    plan = plan_for(x.shape[0], w_gate.shape[0])
    if plan is None:
        return None
    tok, exp = plan.token_spec, plan.expert_spec
    body = functools.partial(_block, plan=plan, recipe=recipe)
    return jax.shard_map(
        body, in_specs=(tok, tok, tok, exp, exp, exp), out_specs=tok
    )(x, weights, experts, w_gate, w_up, w_down)  # fmt: skip


def _swiglu(
    rows: Array, sizes: Array, w_gate: Array, w_up: Array, w_down: Array, recipe: Recipe,
    offsets: Array | None, axes: tuple[str, ...],
) -> Array:  # fmt: skip
    """The experts' SwiGLU over rows sorted by expert, `sizes[e]` rows for expert e."""
    dot = functools.partial(grouped_dot, recipe=recipe, row_offsets=offsets, row_axes=axes)
    h = jax.nn.silu(dot(rows, w_gate, sizes)) * dot(rows, w_up, sizes)
    return dot(h, w_down, sizes)


def _group_offsets(sizes: Int[Array, " E"], axes: tuple[str, ...]) -> Int[Array, " E"] | None:
    """Where this expert group's rows of each expert start in the expert's row list over all
    groups (the groups' rows in batch order)."""
    if not axes:
        return None
    every = jax.lax.all_gather(sizes, axes)  # [R, E], groups in batch order
    me = jax.lax.axis_index(axes)
    before = jnp.arange(every.shape[0])[:, None] < me
    return jnp.sum(jnp.where(before, every, 0), axis=0)


def _block(
    x: Float[Array, "n D"],
    weights: Float[Array, "n k"],
    experts: Int[Array, "n k"],
    w_gate: Float[Array, "El D I"],
    w_up: Float[Array, "El D I"],
    w_down: Float[Array, "El I D"],
    *,
    plan: Plan,
    recipe: Recipe,
) -> Float[Array, "n D"]:
    """One device's part (inside `shard_map`): its n tokens' pairs through the exchange."""
    n, d = x.shape
    top_k, e_local, size = experts.shape[-1], w_gate.shape[0], plan.expert_size
    # The weights are the same on every device of an expert group; made varying like the
    # tokens, the gradients they receive from the devices' tokens are summed (the transpose).
    ws = [jax.lax.pcast(w, plan.replica_axes, to="varying") for w in (w_gate, w_up, w_down)]
    flat = experts.reshape(-1)  # pair p = (token p // k, its (p % k)-th expert)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // top_k]
    if size == 1:
        sizes = jnp.bincount(flat, length=e_local)
        offsets = _group_offsets(sizes, plan.replica_axes)
        out = _swiglu(rows, sizes, *ws, recipe, offsets, plan.replica_axes)
    else:
        axis = plan.expert_axis
        counts = jnp.bincount(flat, length=size * e_local).reshape(size, e_local)
        send = jnp.sum(counts, axis=1)  # pairs for each device of the group
        dest = flat[order] // e_local
        cap = capacity(n, top_k, e_local)
        slot = dest * cap + jnp.arange(n * top_k) - (jnp.cumsum(send) - send)[dest]
        buf = jnp.zeros((size * cap, d), x.dtype).at[slot].set(rows)
        recv = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)  # block s: from device s
        recv_counts = jax.lax.all_to_all(counts, axis, 0, 0, tiled=True)  # [source, El]
        # Each received row's expert (past a block's rows: e_local, no expert), then the rows
        # by expert: a stable sort keeps source order, i.e. the group's token order.
        ends = jnp.cumsum(recv_counts, axis=1)
        eid = jax.vmap(lambda c: jnp.searchsorted(c, jnp.arange(cap), side="right"))(ends)
        perm = jnp.argsort(eid.reshape(-1), stable=True)
        sizes = jnp.sum(recv_counts, axis=0)
        offsets = _group_offsets(sizes, plan.replica_axes)
        done = _swiglu(recv[perm], sizes, *ws, recipe, offsets, plan.replica_axes)
        back = jnp.zeros_like(done).at[perm].set(done)
        out = jax.lax.all_to_all(back, axis, 0, 0, tiled=True)[slot]
    pairs = jnp.zeros_like(out).at[order].set(out).reshape(n, top_k, d)
    return jnp.sum(pairs.astype(jnp.float32) * weights[..., None], axis=1)
