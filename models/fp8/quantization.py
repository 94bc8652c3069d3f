"""FP8 quantization: current per-tile scales, quantize, dequantize, and GEMM operand tiles.

Scaling is *current* (just-in-time): every group of elements gets the scale

    s = amax(|x_group|) * (1 / fmax)          (fmax = 448 for E4M3, 57344 for E5M2)

optionally rounded up to a power of two (`2^ceil(log2(amax / fmax))`, UE8M0 style), and

    q = cast_fp8(clip(x * (1/s), -fmax, fmax)),   x ~= q * s   (round to nearest even).

(x / s is taken as x times the f32 reciprocal of s, as XLA computes a division by a broadcast
scale: `_clipped_product`.)

`s` multiplies back, like vLLM's `weight_scale_inv`. The scale is written as a multiplication by
the f32 constant `1/fmax`, not a division by `fmax`: XLA rewrites a division by a constant into
that multiplication under `jit` only, so a division would make jit and eager scales differ by
one ulp (docs/design.md section 2). Written this way, jit and eager agree bit for bit.

An all-zero group gets scale 1 (q = 0). A group holding a NaN or an infinity gets a NaN scale,
so its dequantized values and everything computed from them are NaN: non-finite input is
reported through the loss, never silently saturated to fmax. `nonfinite_count` counts them.

Groups are tiles: each axis of an operand is cut into tiles of a given length (the whole axis,
1, or the block size B; the last tile may be partial). For a GEMM operand the recipe's
granularity gives the tiles, relative to the GEMM's contraction axis (`operand_tile`):

    tensor: one scale for the whole operand
    row:    one scale per non-contracted index (per token, per output channel)
    block:  activations and gradients 1 x B tiles along the contraction axis;
            weights B x B blocks (DeepSeek-V3; vLLM's `weight_scale_inv` [ceil(N/B), ceil(K/B)])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from models.fp8.recipe import FP8_BLOCK, FP8_DTYPES, FP8_MAX, Format, Granularity, Recipe, Role


def _tile_lengths(shape: Sequence[int], tile: Sequence[int | None]) -> tuple[int, ...]:
    if len(tile) != len(shape):
        raise ValueError(f"tile {tuple(tile)} has {len(tile)} entries for shape {tuple(shape)}")
    out = []
    for dim, t in zip(shape, tile, strict=True):
        t = dim if t is None else int(t)
        out.append(max(1, min(t, dim)) if dim > 0 else 1)
    return tuple(out)


def scale_shape(shape: Sequence[int], tile: Sequence[int | None]) -> tuple[int, ...]:
    """Shape of the scale array: ceil(dim / tile) per axis (partial edge tiles allowed)."""
    tiles = _tile_lengths(shape, tile)
    return tuple(-(-d // t) for d, t in zip(shape, tiles, strict=True))


def _tile_amax(x: Array, tiles: tuple[int, ...]) -> Array:
    """max |x| over each tile, shape `scale_shape` (NaN if the tile holds one: max propagates
    it, abs(inf) = inf). Whole tiles are a reshape and a reduction; partial edge tiles (e.g.
    K = 576 in tiles of 128) a `reduce_window` whose padding is never materialised (a zero-padded
    copy of the operand, and the slice back, cost more than the quantization itself on CPU)."""
    if not x.size:
        return jnp.zeros(scale_shape(x.shape, tiles), x.dtype)
    a = jnp.abs(x)
    if all(d % t == 0 for d, t in zip(x.shape, tiles, strict=True)):
        split = [n for d, t in zip(x.shape, tiles, strict=True) for n in (d // t, t)]
        return jnp.max(a.reshape(split), axis=tuple(range(1, 2 * x.ndim, 2)))
    pads = [(0, -d % t) for d, t in zip(x.shape, tiles, strict=True)]
    return jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, tiles, tiles, pads)


def _per_element(s: Array, tiles: tuple[int, ...], shape: Sequence[int]) -> Array:
    """Per-tile values `s` [ceil(d / t) ...] broadcast to every element of their tile, `shape`
    (a broadcast, a reshape and, for partial edge tiles, a slice: fused into the consumer)."""
    wide = jnp.broadcast_to(
        s.reshape([n for g in s.shape for n in (g, 1)]),
        [n for g, t in zip(s.shape, tiles, strict=True) for n in (g, t)],
    ).reshape([g * t for g, t in zip(s.shape, tiles, strict=True)])
    return wide[tuple(slice(0, d) for d in shape)]


def compute_scale(amax: Array, fmt: Format, pow2: bool) -> Array:
    """Scale from a group's amax: `amax * (1/fmax)`, or its power-of-two ceiling.

    amax == 0 -> 1; non-finite amax -> NaN (reported downstream, never saturated)."""
    amax = amax.astype(jnp.float32)
    scale = amax * jnp.float32(1.0 / FP8_MAX[fmt])
    if pow2:
        # frexp is exact: scale = m * 2^e with m in [0.5, 1); the ceiling power of two is 2^e,
        # or 2^(e-1) when m == 0.5 (scale already a power of two).
        mant, expo = jnp.frexp(scale)
        expo = jnp.where(mant == 0.5, expo - 1, expo)
        scale = jnp.ldexp(jnp.ones_like(scale), expo)
    scale = jnp.where(amax == 0, jnp.float32(1.0), scale)
    return jnp.where(jnp.isfinite(amax), scale, jnp.float32(jnp.nan))


def quantize(
    x: Float[Array, "..."],
    fmt: Format,
    tile: Sequence[int | None],
    *,
    pow2: bool = False,
) -> tuple[Array, Float[Array, "..."]]:
    """Quantizes x to FP8 with one current scale per tile.

    Args:
      x: any float array.
      fmt: "e4m3" or "e5m2".
      tile: per axis, the tile length (None = the whole axis; 1 = one scale per index).
      pow2: power-of-two scales.

    Returns:
      (q, scale): q has x's shape and the FP8 dtype; scale is f32 of `scale_shape(x.shape, tile)`
      and `dequantize(q, scale, tile)` ~= x. Values past fmax * scale saturate to +-fmax.
    """
    x = jnp.asarray(x)
    y, scale, _ = _scaled(x, fmt, tile, pow2)
    return y.astype(FP8_DTYPES[fmt]), scale


def _scaled(
    x: Array, fmt: Format, tile: Sequence[int | None], pow2: bool
) -> tuple[Array, Array, Array]:
    """(clip(x / s, -fmax, fmax), the per-tile scales s [`scale_shape`], s per element) for f32
    x: what `quantize` casts to FP8. A NaN in a tile poisons its scale (`_tile_amax`)."""
    x = x.astype(jnp.float32)
    tiles = _tile_lengths(x.shape, tile)
    scale = compute_scale(_tile_amax(x, tiles), fmt, pow2)
    y = _clipped_product(x, _per_element(jnp.float32(1.0) / scale, tiles, x.shape), fmt)
    return y, scale, _per_element(scale, tiles, x.shape)


def scaled_by_amax(x: Array, amax: Array, fmt: Format, pow2: bool) -> tuple[Array, Array]:
    """(clip(x / s, -fmax, fmax), s) for the scale s of each element's group amax (`amax`
    broadcasts against f32 x): the step every tiling shares once its amax is known."""
    scale = compute_scale(amax, fmt, pow2)
    return _clipped_product(x, jnp.float32(1.0) / scale, fmt), scale


def _clipped_product(x: Array, inv_scale: Array, fmt: Format) -> Array:
    """clip(x * (1 / s), -fmax, fmax): x / s as the product with the f32 reciprocal of its
    scale, which is what XLA computes for a division by a broadcast scale (its algebraic
    simplifier rewrites it so); written out, every tiling rounds x / s the same way, also where
    the scale reaches x through a reshape that keeps the rewrite from applying."""
    fmax = jnp.float32(FP8_MAX[fmt])
    return jnp.clip(x * inv_scale, -fmax, fmax)


# Per format: mantissa bits and the exponent of the smallest normal (below it the grid is the
# subnormal spacing 2^(emin - mbits)).
_GRID = {"e4m3": (3, -6), "e5m2": (2, -14)}


def round_to_format(y: Float[Array, "..."], fmt: Format) -> Float[Array, "..."]:
    """`y.astype(fp8).astype(f32)` for f32 `y` with |y| <= fmax (or NaN), as f32 arithmetic:
    round to nearest even on the format's grid, whose spacing at |y| is
    2^(max(exponent(|y|), emin) - mbits). Exact: the division and product are by powers of two.

    The same values as the cast bit for bit (tested against ml_dtypes), in ops the CPU backend
    vectorises: XLA:CPU converts to FP8 element by element, several times slower."""
    mbits, emin = _GRID[fmt]
    a = jnp.abs(y)
    expo = (jax.lax.bitcast_convert_type(a, jnp.int32) >> 23) - 127  # floor(log2 a), a normal
    spacing_bits = (jnp.maximum(expo, emin) - mbits + 127) << 23
    spacing = jax.lax.bitcast_convert_type(spacing_bits, jnp.float32)
    return jnp.copysign(jnp.round(a / spacing) * spacing, y)


def dequantize(
    q: Array,
    scale: Float[Array, "..."],
    tile: Sequence[int | None],
    dtype: jnp.dtype = jnp.float32,
) -> Array:
    """x = q * scale, each scale broadcast over its tile (the `tile` given to `quantize`).

    The tile is needed explicitly: with partial edge tiles it cannot be inferred from the
    shapes (K = 300 with B = 128 has 3 scales, as would B = 100)."""
    tiles = _tile_lengths(q.shape, tile)
    expected = scale_shape(q.shape, tile)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"dequantize: scale shape {tuple(scale.shape)} does not match q shape "
            f"{tuple(q.shape)} with tile {tuple(tile)} (expected {expected})"
        )
    s = _per_element(scale.astype(jnp.float32), tiles, q.shape)
    return (q.astype(jnp.float32) * s).astype(dtype)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=("q", "scale"), meta_fields=("tile",)
)
@dataclasses.dataclass(frozen=True)
class StoredFP8Weight:
    """A weight kept as FP8 codes and scales, W = dequantize(q, scale, tile) (f32).

    The rollout engine holds the FP8 weights it serves this way (1 byte per weight instead of
    4); a param leaf of this type is expanded by `dense_weights` where the model uses it (inside
    the layer scan: one layer's f32 weights at a time). A pytree: `q` and `scale` are leaves
    (a stacked layer param has them with a leading layer axis; `tile` is per layer)."""

    q: Array
    scale: Array
    tile: tuple[int | None, ...]


def dense_weights(tree: object) -> object:
    """`tree` with every `StoredFP8Weight` leaf replaced by its f32 values; other leaves as
    they are (a no-op for the trainer's f32 params)."""

    def dense(x: object) -> object:
        return dequantize(x.q, x.scale, x.tile) if isinstance(x, StoredFP8Weight) else x

    return jax.tree.map(dense, tree, is_leaf=lambda x: isinstance(x, StoredFP8Weight))


def fake_quantize(x: Array, fmt: Format, tile: Sequence[int | None], *, pow2: bool) -> Array:
    """dequantize(quantize(x)) in f32: the value an FP8 GEMM operand really holds (the FP8
    cast done as f32 arithmetic, `round_to_format`: the same values)."""
    y, _, s = _scaled(jnp.asarray(x), fmt, tile, pow2)
    return round_to_format(y, fmt) * s


def nonfinite_count(x: Array) -> Array:
    """Number of NaN/inf entries of x (what quantize reports as NaN scales)."""
    return jnp.sum(~jnp.isfinite(x))


def operand_tile(
    ndim: int, contract_axis: int, granularity: Granularity, role: Role, block_size: int
) -> tuple[int | None, ...]:
    """Tile lengths of a 2-D GEMM operand (last two axes; leading axes are batch, tile 1).

    `contract_axis` is -1 or -2: the axis the GEMM sums over."""
    free_axis = -2 if contract_axis == -1 else -1
    tile: list[int | None] = [1] * ndim
    if granularity == "tensor":
        return (None,) * ndim
    if granularity == "row":
        tile[contract_axis] = None
        tile[free_axis] = 1
    elif role == "weight":
        tile[contract_axis] = block_size
        tile[free_axis] = block_size
    else:
        tile[contract_axis] = block_size
        tile[free_axis] = 1
    return tuple(tile)


def weight_tile(recipe: Recipe) -> tuple[int | None, int | None]:
    """Tile of a 2-D weight [out, in] under the recipe (what `quantize_weight` uses)."""
    return operand_tile(2, -1, recipe.weight_granularity, "weight", recipe.block_size)


def quantize_weight(
    w: Float[Array, "N K"], recipe: Recipe = FP8_BLOCK
) -> tuple[Array, Float[Array, "n k"]]:
    """Quantizes a linear weight stored [out, in] (HF / vLLM layout) the way the forward does.

    For the block recipe the scale is vLLM's `weight_scale_inv`, shape
    [ceil(out/B), ceil(in/B)]. Since B x B blocks are symmetric in the two axes, these are the
    same FP8 values the trainer's forward computes on its [in, out] kernel."""
    if not recipe.quantized:
        raise ValueError(f"quantize_weight needs an FP8 recipe, got {recipe.name!r}")
    return quantize(w, recipe.fwd_format, weight_tile(recipe), pow2=recipe.pow2_scales)


def quantize_operand(
    x: Array, fmt: Format, contract_axis: int, granularity: Granularity, role: Role, recipe: Recipe
) -> tuple[Array, Array]:
    """Quantizes a GEMM operand with the tiles of its role and contraction axis (-1 or -2): what
    both backends of `models.fp8.matmul` quantize, so they agree on every FP8 value and scale."""
    tile = operand_tile(x.ndim, contract_axis, granularity, role, recipe.block_size)
    return quantize(x, fmt, tile, pow2=recipe.pow2_scales)


def fake_quantize_operand(
    x: Array, fmt: Format, contract_axis: int, granularity: Granularity, role: Role, recipe: Recipe
) -> Array:
    """dequantize(quantize_operand(...)) in f32: the values the GEMM computes with."""
    tile = operand_tile(x.ndim, contract_axis, granularity, role, recipe.block_size)
    return fake_quantize(x, fmt, tile, pow2=recipe.pow2_scales)


def fake_quantize_weight(w: Float[Array, "... K N"], recipe: Recipe) -> Float[Array, "... K N"]:
    """The f32 FP8 values the forward computes with from a GEMM weight [*, K, N] (K the
    contraction axis, e.g. a `Linear` kernel [in, out]): dequantize(quantize(w)) per tile."""
    return fake_quantize_operand(
        w, recipe.fwd_format, -2, recipe.weight_granularity, "weight", recipe
    )
