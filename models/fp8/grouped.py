"""The FP8 grouped GEMM of Mixture-of-Experts layers: tokens sorted by expert times one weight
per expert, `y[t] = x[t] @ w[expert(t)]`, as `jax.lax.ragged_dot` computes it.

`grouped_dot(x [T, K], w [E, K, N], group_sizes [E], recipe)`: the rows of `x` are sorted by
expert, `group_sizes[e]` of them for expert e (their sum is at most T; rows past it give 0).
Under an FP8 recipe every expert's three GEMMs quantize their operands exactly as the dense
`models.fp8.fp8_dot_general` quantizes one GEMM's operands, with the expert's rows as that
GEMM's rows: a grouped GEMM is E dense GEMMs, and its FP8 values are those of a loop over the
experts (`tests/models/test_fp8_grouped.py` checks it against such a loop in float64 numpy).

    fprop  y_e  = Q(x_e) . Q(w_e)          contracted over K
    dgrad  dx_e = Q(g_e) . Q(w_e)^T        contracted over N
    wgrad  dw_e = Q(x_e)^T . Q(g_e)        contracted over the expert's tokens

with each operand's tiles taken along its own GEMM's contraction axis (`quantization.
operand_tile`): 1 x B activation and gradient tiles, B x B weight blocks per expert; "row" one
scale per token (along K or N) or per column of the expert's tokens (wgrad); "tensor" one scale
per expert's operand, never one across experts, so a token's numbers do not depend on which
other experts the batch routed to. Tiles along the tokens (wgrad) start at each expert's first
row, as they would in the expert's own GEMM. Per-token tiles never cross experts; for the others
the amax is a segment max over (expert, tile) segments, so no [E, T, K] padded copy is built.

Rows split over devices (expert parallelism, `models.expert_parallel`): inside `jax.shard_map`,
`row_offsets[e]` says where this device's rows of expert e start in the expert's whole row
list, whose other rows sit on the devices along the manual mesh axes `row_axes`. The
quantizations whose tiles run along the tokens (wgrad's operands; the "tensor" and "row"
scales that span an expert's tokens) then take their amax over the expert's global tiles: a
tile's amax is completed by `pmax` where the expert's whole rows form one tile, or, for 1 x B
tiles, by exchanging only the first and last tile of each expert's local run (the interior
tiles lie on one device). The FP8 values are those of one grouped GEMM over all the devices'
rows at once.

Backends: "emulate" (f32 `ragged_dot` of the dequantized operands, f32 accumulation) and, for
the block recipe, "pallas" (the Hopper grouped kernels, `models.fp8.kernels.grouped_block_matmul`:
the same FP8 values, f32 promotion per 128-wide K step; rows on one device only, no
`row_axes`). Non-quantized recipes run `ragged_dot` with the weights cast to the activations'
dtype, like the dense baseline. Either way the grouped GEMMs are `models.fp8.ragged.ragged_dot`:
`jax.lax.ragged_dot`, except on CPU at sizes where XLA's dense lowering of it would cost G times
the GEMM (a loop over row tiles instead).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from models.fp8.quantization import fake_quantize_operand, round_to_format, scaled_by_amax
from models.fp8.ragged import ragged_dot
from models.fp8.recipe import Format, Granularity, Recipe


def group_ids(group_sizes: Int[Array, " E"], rows: int) -> Int[Array, " T"]:
    """The expert of each of `rows` sorted rows (rows past the groups get E, no expert)."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


def _segments(
    gid: Int[Array, " T"], group_sizes: Int[Array, " E"], token_tile: int | None
) -> tuple[Int[Array, " T"], int]:
    """Each row's token segment and how many there can be: the whole expert (None), the row
    itself (1), or tiles of `token_tile` rows counted from the expert's first row."""
    rows, experts = gid.shape[0], group_sizes.shape[0]
    if token_tile is None:
        return gid, experts + 1
    if token_tile == 1:
        return jnp.arange(rows), rows
    starts = jnp.concatenate([jnp.zeros(1, group_sizes.dtype), jnp.cumsum(group_sizes)])
    pos = jnp.arange(rows) - starts[gid]
    per_expert = -(-rows // token_tile)
    return gid * per_expert + pos // token_tile, (experts + 1) * per_expert


def fake_quantize_grouped(
    x: Float[Array, "T C"],
    group_sizes: Int[Array, " E"],
    fmt: Format,
    token_tile: int | None,
    col_tile: int | None,
    *,
    pow2: bool,
    row_offsets: Int[Array, " E"] | None = None,
    row_axes: tuple[str, ...] = (),
) -> Float[Array, "T C"]:
    """dequantize(quantize(x)) in f32 with tiles of `token_tile` rows within an expert (None:
    all the expert's rows) by `col_tile` columns (None: all). With `row_axes`, the experts'
    rows continue on other devices (module doc) and tiles along the tokens span them."""
    rows, cols = x.shape
    x = x.astype(jnp.float32)
    ct = cols if col_tile is None else min(col_tile, cols)
    padded = jnp.pad(x, ((0, 0), (0, -cols % ct))).reshape(rows, -1, ct)
    amax = jnp.max(jnp.abs(padded), axis=-1)  # [T, column tiles]; a NaN stays NaN
    gid = group_ids(group_sizes, rows)
    if token_tile != 1 and row_axes:
        amax = _split_amax(amax, gid, group_sizes, row_offsets, token_tile, row_axes)
    elif token_tile != 1:
        seg, n = _segments(gid, group_sizes, token_tile)
        amax = jax.ops.segment_max(amax, seg, num_segments=n)[seg]
    y, scale = scaled_by_amax(padded, amax[..., None], fmt, pow2)
    return (round_to_format(y, fmt) * scale).reshape(rows, -1)[:, :cols]


def _split_amax(
    amax: Float[Array, "T C"],
    gid: Int[Array, " T"],
    group_sizes: Int[Array, " E"],
    offsets: Int[Array, " E"],
    token_tile: int | None,
    axes: tuple[str, ...],
) -> Float[Array, "T C"]:
    """Each row's amax over its token tile of the expert's rows on all devices along `axes`
    (this device's rows of expert e are rows offsets[e] ... of the expert's row list)."""
    rows, experts = gid.shape[0], group_sizes.shape[0]
    if token_tile is None:  # one tile: the expert's rows everywhere
        local = jax.ops.segment_max(amax, gid, num_segments=experts + 1)
        return jax.lax.pmax(local, axes)[gid]
    b = token_tile
    sizes, offsets = group_sizes.astype(jnp.int32), offsets.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes)])
    off = jnp.concatenate([offsets, jnp.zeros(1, jnp.int32)])  # rows past the groups: 0
    pos = jnp.arange(rows) - starts[gid]
    per_expert = -(-rows // b) + 1  # an unaligned run of r rows touches <= ceil(r / b) + 1 tiles
    seg = gid * per_expert + (off[gid] % b + pos) // b
    n = (experts + 1) * per_expert
    tiles = jax.ops.segment_max(amax, seg, num_segments=n)  # [n, C], local rows only
    # Only the first and last tile of an expert's local run can hold other devices' rows.
    first = jnp.arange(experts) * per_expert
    local_ids = jnp.stack([first, first + (offsets % b + sizes - 1) // b], axis=-1)  # [E, 2]
    global_ids = jnp.stack([offsets // b, (offsets + sizes - 1) // b], axis=-1)
    has = (sizes > 0)[:, None]
    global_ids = jnp.where(has, global_ids, -1)
    edges = tiles[jnp.where(has, local_ids, 0)]  # [E, 2, C]
    all_ids = jax.lax.all_gather(global_ids, axes)  # [R, E, 2]
    all_edges = jax.lax.all_gather(edges, axes)  # [R, E, 2, C]
    same = (all_ids[:, :, None, :] == global_ids[None, :, :, None]) & has[None, :, :, None]
    merged = jnp.max(
        jnp.where(same[..., None], all_edges[:, :, None], -jnp.inf), axis=(0, 3)
    )  # [E, 2, C]: max over every device's edge tiles with the same global tile
    tiles = tiles.at[jnp.where(has, local_ids, n)].set(merged, mode="drop")
    return tiles[seg]


def _operand_tiles(granularity: Granularity, block: int, contract_tokens: bool):
    """(token tile, column tile) of a [T, C] activation or gradient operand."""
    if granularity == "tensor":
        return None, None
    if granularity == "row":
        return (None, 1) if contract_tokens else (1, None)
    return (block, 1) if contract_tokens else (1, block)


def _token_operand(
    x: Array, group_sizes: Array, fmt: Format, granularity: Granularity, recipe: Recipe,
    contract_tokens: bool, split: tuple[Array, tuple[str, ...]],
) -> Array:  # fmt: skip
    """An activation or gradient operand [T, C] quantized for a GEMM contracting over C
    (`contract_tokens` False) or over each expert's tokens (True); `split`: (row offsets,
    row axes) of rows split over devices."""
    tt, ct = _operand_tiles(granularity, recipe.block_size, contract_tokens)
    return fake_quantize_grouped(
        x, group_sizes, fmt, tt, ct, pow2=recipe.pow2_scales, row_offsets=split[0],
        row_axes=split[1],
    )  # fmt: skip


def _expert_weight(w: Float[Array, "E K N"], recipe: Recipe, contract_axis: int) -> Array:
    """Each expert's weight quantized as a dense GEMM's weight operand (contraction -2: K for
    the forward, -1: N for dgrad); "tensor" is one scale per expert. Weights that hold their
    forward FP8 values already (`recipe.prequantized_weights`, the rollout engine's) pass as
    they are in the forward."""
    if recipe.prequantized_weights and contract_axis == -2:
        return w.astype(jnp.float32)
    if recipe.weight_granularity == "tensor":
        quant = functools.partial(
            fake_quantize_operand, fmt=recipe.fwd_format, contract_axis=contract_axis,
            granularity="tensor", role="weight", recipe=recipe,
        )  # fmt: skip
        return jax.vmap(quant)(w)
    return fake_quantize_operand(
        w, recipe.fwd_format, contract_axis, recipe.weight_granularity, "weight", recipe
    )


def _ragged(a: Array, b: Array, group_sizes: Array) -> Array:
    return ragged_dot(a, b, group_sizes, precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_fp8(
    x: Array, w: Array, group_sizes: Array, offsets: Array, recipe: Recipe, axes: tuple[str, ...]
) -> Array:
    r, split = recipe, (offsets, axes)
    xq = _token_operand(x, group_sizes, r.fwd_format, r.act_granularity, r, False, split)
    return _ragged(xq, _expert_weight(w, r, -2), group_sizes).astype(x.dtype)


def _grouped_fp8_fwd(x, w, group_sizes, offsets, recipe, axes):
    return _grouped_fp8(x, w, group_sizes, offsets, recipe, axes), (x, w, group_sizes, offsets)


def _grouped_fp8_bwd(recipe, axes, res, g):
    x, w, group_sizes, offsets = res
    r, split = recipe, (offsets, axes)
    # dgrad: dx_e = g_e [T_e, N] . w_e^T [N, K], summed over N.
    gq_d = _token_operand(g, group_sizes, r.bwd_format, r.grad_granularity, r, False, split)
    wq_d = _expert_weight(w, r, -1)
    dx = _ragged(gq_d, jnp.swapaxes(wq_d, -1, -2), group_sizes)
    # wgrad: dw_e = x_e^T [K, T_e] . g_e [T_e, N], summed over the expert's tokens: the
    # transpose of ragged_dot in its weight argument.
    xq_w = _token_operand(x, group_sizes, r.fwd_format, r.act_granularity, r, True, split)
    gq_w = _token_operand(g, group_sizes, r.bwd_format, r.grad_granularity, r, True, split)
    _, pullback = jax.vjp(lambda wf: _ragged(xq_w, wf, group_sizes), w.astype(jnp.float32))
    (dw,) = pullback(gq_w)
    zero_sizes = jnp.zeros(group_sizes.shape, jax.dtypes.float0)
    zero_offsets = jnp.zeros(offsets.shape, jax.dtypes.float0)
    return dx.astype(x.dtype), dw.astype(w.dtype), zero_sizes, zero_offsets


_grouped_fp8.defvjp(_grouped_fp8_fwd, _grouped_fp8_bwd)


def grouped_dot(
    x: Float[Array, "T K"],
    w: Float[Array, "E K N"],
    group_sizes: Int[Array, " E"],
    recipe: Recipe,
    *,
    row_offsets: Int[Array, " E"] | None = None,
    row_axes: tuple[str, ...] = (),
) -> Float[Array, "T N"]:
    """`jax.lax.ragged_dot(x, w, group_sizes)` with the recipe's FP8 operands (module doc);
    differentiable in x and w. `row_offsets` and `row_axes` (inside `jax.shard_map`): the
    experts' rows continue on the devices along `row_axes`, this device's rows of expert e
    starting at row_offsets[e] of the expert's row list (module doc); ignored by unquantized
    recipes, whose rows never share a scale."""
    if not recipe.quantized:
        return ragged_dot(x, w.astype(x.dtype), group_sizes).astype(x.dtype)
    if recipe.backend == "pallas":
        if row_axes:
            raise NotImplementedError(
                f"grouped_dot: backend 'pallas' with row_axes {tuple(row_axes)}: the kernels take "
                "one device's rows (wgrad's token tiles would span devices); use "
                "backend='emulate' under expert parallelism"
            )
        # Imported on first use: the Hopper kernels import Pallas' Mosaic GPU modules (~0.4 s
        # of every process's start), needed only by this backend.
        from models.fp8.kernels import grouped_block_matmul

        return grouped_block_matmul.grouped_dot(x, w, group_sizes, recipe)
    if recipe.backend != "emulate":
        raise NotImplementedError(
            f"grouped_dot: recipe {recipe.name!r} backend {recipe.backend!r}; only 'emulate' "
            "has a grouped form (use get_recipe(name) without backend=)"
        )
    sizes = group_sizes.astype(jnp.int32)
    if not row_axes:
        row_offsets = None
    offsets = jnp.zeros_like(sizes) if row_offsets is None else row_offsets.astype(jnp.int32)
    return _grouped_fp8(x, w, sizes, offsets, recipe, tuple(row_axes))
