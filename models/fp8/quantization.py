"""FP8 numerics: quantize, dequantize, and a drop-in FP8 `dot_general` (DESIGN.md section 3).

Scaling is *current* (just-in-time): every group of elements gets the scale

    s = amax(|x_group|) * (1 / fmax)          (fmax = 448 for E4M3, 57344 for E5M2)

optionally rounded up to a power of two (`2^ceil(log2(amax / fmax))`, UE8M0 style), and

    q = cast_fp8(clip(x / s, -fmax, fmax)),   x ~= q * s   (round to nearest even).

`s` multiplies back, like vLLM's `weight_scale_inv`. The scale is written as a multiplication by
the f32 constant `1/fmax`, not a division by `fmax`: XLA rewrites a division by a constant into
that multiplication under `jit` only, which moved scales by one ulp between jit and eager (a
measured trap, DESIGN.md section 2). Written this way, jit and eager agree bit for bit.

An all-zero group gets scale 1 (q = 0). A group holding a NaN or an infinity gets a NaN scale,
so its dequantized values and everything computed from them are NaN: non-finite input is
reported through the loss, never silently saturated to fmax. `nonfinite_count` counts them.

Groups are tiles: each axis of an operand is cut into tiles of a given length (the whole axis,
1, or the block size B; the last tile may be partial). For a GEMM operand the recipe's
granularity gives the tiles, relative to the GEMM's contraction axis:

    tensor: one scale for the whole operand
    row:    one scale per non-contracted index (per token, per output channel)
    block:  activations and gradients 1 x B tiles along the contraction axis;
            weights B x B blocks (DeepSeek-V3; vLLM's `weight_scale_inv` [ceil(N/B), ceil(K/B)])

`fp8_dot_general` has a `jax.custom_vjp`. Forward (fprop): y = Q(x) . Q(w) with f32
accumulation. Backward: dgrad = Q(g) . Q(w)^T contracted over N, wgrad = Q(x)^T . Q(g)
contracted over the tokens; each GEMM re-quantizes its operands along its own contraction axis
(gradients in the recipe's backward format). It is stateless: no amax history.

Backend `emulate` dequantizes to f32 and runs an f32 dot. On CPU XLA runs float8 dots by
upcasting anyway, so this is exactly what an FP8 GEMM with f32 accumulation computes (up to the
order of the f32 sums), and it is the reference the `pallas` Hopper kernel (`models.fp8_kernels`) is checked
against.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

Format = Literal["e4m3", "e5m2"]
Granularity = Literal["tensor", "row", "block"]
Role = Literal["act", "weight", "grad"]
Backend = Literal["emulate", "pallas"]

FP8_DTYPES: dict[str, jnp.dtype] = {
    "e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "e5m2": jnp.dtype(jnp.float8_e5m2),
}
FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}
_GRANULARITIES = ("tensor", "row", "block")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """How the linear layers' GEMMs are computed. Hashable: pass it as a static jit argument.

    Attributes:
      name: label used in logs and configs.
      fwd_format: format of activations and weights in every GEMM; None = no quantization
        (plain `dot_general` in the compute dtype: the BF16 baseline).
      bwd_format: format of the output gradient in the dgrad and wgrad GEMMs.
      act_granularity: tiles of activations ("tensor" | "row" | "block").
      weight_granularity: tiles of weights.
      grad_granularity: tiles of output gradients.
      block_size: B of the 1 x B and B x B tiles.
      pow2_scales: round scales up to powers of two (UE8M0).
      backend: "emulate" (f32 dot of dequantized operands) or "pallas" (the Hopper kernel of
        `models.fp8_kernels`; block recipe with block_size 128 only; Mosaic GPU interpreter
        off a GPU).
      prequantized_weights: the weights given to the forward already hold their FP8 values
        (`fake_quantize_weight`, done once when they arrive: the rollout engine); the emulated
        forward then skips quantizing them, with the same result. Inference only.
    """

    name: str
    fwd_format: Format | None = "e4m3"
    bwd_format: Format = "e4m3"
    act_granularity: Granularity = "block"
    weight_granularity: Granularity = "block"
    grad_granularity: Granularity = "block"
    block_size: int = 128
    pow2_scales: bool = False
    backend: Backend = "emulate"
    prequantized_weights: bool = False

    def __post_init__(self) -> None:
        for field in ("act_granularity", "weight_granularity", "grad_granularity"):
            if getattr(self, field) not in _GRANULARITIES:
                raise ValueError(
                    f"Recipe {self.name!r}: {field}={getattr(self, field)!r}; "
                    f"expected one of {_GRANULARITIES}"
                )
        for field in ("fwd_format", "bwd_format"):
            value = getattr(self, field)
            if value is not None and value not in FP8_DTYPES:
                raise ValueError(
                    f"Recipe {self.name!r}: {field}={value!r}; expected 'e4m3' or 'e5m2'"
                )
        if self.prequantized_weights and self.backend != "emulate":
            raise ValueError(f"Recipe {self.name!r}: prequantized_weights needs backend='emulate'")
        if self.block_size < 1:
            raise ValueError(f"Recipe {self.name!r}: block_size must be >= 1")
        if self.backend not in ("emulate", "pallas"):
            raise ValueError(
                f"Recipe {self.name!r}: backend={self.backend!r}; expected 'emulate' or 'pallas'"
            )
        grans = (self.act_granularity, self.weight_granularity, self.grad_granularity)
        if (
            self.backend == "pallas"
            and self.quantized
            and (grans != ("block",) * 3 or self.block_size != 128)
        ):
            raise ValueError(
                f"Recipe {self.name!r}: backend='pallas' runs the block recipe only (act, "
                f"weight and grad granularity 'block', block_size 128), got granularities "
                f"{grans} and block_size {self.block_size}; use backend='emulate' for this "
                f"recipe, or get_recipe('fp8_block', backend='pallas')"
            )

    @property
    def quantized(self) -> bool:
        return self.fwd_format is not None


BF16 = Recipe(name="bf16", fwd_format=None)
FP8_TENSOR = Recipe(
    name="fp8_tensor",
    act_granularity="tensor",
    weight_granularity="tensor",
    grad_granularity="tensor",
)
FP8_ROW = Recipe(
    name="fp8_row", act_granularity="row", weight_granularity="row", grad_granularity="row"
)
FP8_BLOCK = Recipe(name="fp8_block")
RECIPES: dict[str, Recipe] = {r.name: r for r in (BF16, FP8_TENSOR, FP8_ROW, FP8_BLOCK)}


def get_recipe(name: str, **overrides: object) -> Recipe:
    """A preset recipe by name ("bf16", "fp8_tensor", "fp8_row", "fp8_block"), with optional
    field overrides, e.g. `get_recipe("fp8_block", bwd_format="e5m2", pow2_scales=True)`."""
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose one of {sorted(RECIPES)}")
    return dataclasses.replace(RECIPES[name], **overrides) if overrides else RECIPES[name]


# --------------------------------------------------------------------------------------------
# Quantization over tiles
# --------------------------------------------------------------------------------------------


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


def _tiled(x: Array, tiles: tuple[int, ...]) -> Array:
    """Zero-pads x to whole tiles and reshapes axis i into (groups_i, tile_i)."""
    pads = [(0, -d % t) for d, t in zip(x.shape, tiles, strict=True)]
    if any(p for _, p in pads):
        x = jnp.pad(x, pads)
    split = []
    for d, t in zip(x.shape, tiles, strict=True):
        split += [d // t, t]
    return x.reshape(split)


def _untile(xt: Array, shape: Sequence[int]) -> Array:
    n = len(shape)
    padded = [xt.shape[2 * i] * xt.shape[2 * i + 1] for i in range(n)]
    x = xt.reshape(padded)
    return x[tuple(slice(0, d) for d in shape)]


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
    tiles = _tile_lengths(x.shape, tile)
    xt = _tiled(x.astype(jnp.float32), tiles)
    inner = tuple(range(1, xt.ndim, 2))
    amax = jnp.max(jnp.abs(xt), axis=inner, keepdims=True) if xt.size else jnp.zeros_like(xt)
    # A NaN in the group must poison the scale: max() propagates NaN, abs(inf) = inf.
    scale = compute_scale(amax, fmt, pow2)
    fmax = jnp.float32(FP8_MAX[fmt])
    q = jnp.clip(xt / scale, -fmax, fmax).astype(FP8_DTYPES[fmt])
    return _untile(q, x.shape), jnp.squeeze(scale, axis=inner)


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
    qt = _tiled(q.astype(jnp.float32), tiles)
    st = jnp.expand_dims(scale.astype(jnp.float32), tuple(range(1, qt.ndim, 2)))
    return _untile(qt * st, q.shape).astype(dtype)


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
    """dequantize(quantize(x)) in f32: the value an FP8 GEMM operand really holds."""
    q, scale = quantize(x, fmt, tile, pow2=pow2)
    return dequantize(q, scale, tile)


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


# --------------------------------------------------------------------------------------------
# The FP8 matmul with its custom VJP
# --------------------------------------------------------------------------------------------


def _fq_operand(
    x: Array, fmt: Format, contract_axis: int, gran: Granularity, role: Role, recipe: Recipe
) -> Array:
    tile = operand_tile(x.ndim, contract_axis, gran, role, recipe.block_size)
    return fake_quantize(x, fmt, tile, pow2=recipe.pow2_scales)


def fake_quantize_weight(w: Float[Array, "... K N"], recipe: Recipe) -> Float[Array, "... K N"]:
    """The f32 FP8 values the forward computes with from a GEMM weight [*, K, N] (K the
    contraction axis, e.g. a `Linear` kernel [in, out]): dequantize(quantize(w)) per tile."""
    return _fq_operand(w, recipe.fwd_format, -2, recipe.weight_granularity, "weight", recipe)


def _f32_matmul(a: Array, b: Array) -> Array:
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _kernels():
    """models.fp8_kernels, imported on first use: it imports this module (for `quantize`)."""
    from models import fp8_kernels

    return fp8_kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_matmul(a: Array, b: Array, recipe: Recipe, out_dtype: jnp.dtype) -> Array:
    """a [*, M, K] @ b [*, K, N] with both operands quantized by the recipe; f32 accumulation."""
    if recipe.backend == "pallas":
        return _kernels().fprop(a, b, recipe, out_dtype)
    aq = _fq_operand(a, recipe.fwd_format, -1, recipe.act_granularity, "act", recipe)
    bq = b if recipe.prequantized_weights else fake_quantize_weight(b, recipe)
    return _f32_matmul(aq, bq).astype(out_dtype)


def _fp8_matmul_fwd(a, b, recipe, out_dtype):
    return _fp8_matmul(a, b, recipe, out_dtype), (a, b)


def _fp8_matmul_bwd(recipe, out_dtype, res, g):
    a, b = res
    r = recipe
    if r.backend == "pallas":
        kernels = _kernels()
        return kernels.dgrad(g, b, r, a.dtype), kernels.wgrad(a, g, r, b.dtype)
    # dgrad: da = g [*, M, N] . b^T [*, N, K], summed over N (g's and b's last axis).
    gq_d = _fq_operand(g, r.bwd_format, -1, r.grad_granularity, "grad", r)
    bq_d = _fq_operand(b, r.fwd_format, -1, r.weight_granularity, "weight", r)
    da = _f32_matmul(gq_d, jnp.swapaxes(bq_d, -1, -2))
    # wgrad: db = a^T [*, K, M] . g [*, M, N], summed over the tokens M (axis -2 of both).
    aq_w = _fq_operand(a, r.fwd_format, -2, r.act_granularity, "act", r)
    gq_w = _fq_operand(g, r.bwd_format, -2, r.grad_granularity, "grad", r)
    db = _f32_matmul(jnp.swapaxes(aq_w, -1, -2), gq_w)
    return da.astype(a.dtype), db.astype(b.dtype)


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def _canonical(x: Array, batch: Sequence[int], rows: Sequence[int], cols: Sequence[int]) -> Array:
    """Transposes x to (batch..., rows..., cols...) and merges rows and cols into one axis each."""
    perm = [*batch, *rows, *cols]
    xt = jnp.transpose(x, perm)
    bshape = [x.shape[i] for i in batch]
    nrows = math.prod(x.shape[i] for i in rows)
    ncols = math.prod(x.shape[i] for i in cols)
    return xt.reshape(*bshape, nrows, ncols)


def _high_precision_dot_general(
    lhs: Array,
    rhs: Array,
    dimension_numbers: DimensionNumbers,
    precision: object = None,
    preferred_element_type: jnp.dtype | None = None,
) -> Array:
    """`lax.dot_general` with the weights cast to the activations' (compute) dtype."""
    return jax.lax.dot_general(
        lhs,
        rhs.astype(lhs.dtype),
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


def fp8_dot_general(
    lhs: Array,
    rhs: Array,
    dimension_numbers: DimensionNumbers,
    precision: object = None,
    preferred_element_type: jnp.dtype | None = None,
    *,
    recipe: Recipe,
) -> Array:
    """`jax.lax.dot_general` with FP8 operands; lhs = activations, rhs = weights.

    Same signature and output layout as `lax.dot_general` (batch, lhs free, rhs free). With a
    non-quantized recipe it is `lax.dot_general` with the weights cast to the activations' dtype. Otherwise the operands are brought to
    [batch, M, K] x [batch, K, N] (several contracting axes are merged into one K, several free
    axes into one M or N: block tiles then run along the merged axis), multiplied by the custom-
    VJP FP8 matmul, and reshaped back; `precision` is ignored (accumulation is f32).
    """
    if not recipe.quantized:
        return _high_precision_dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type
        )
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (
        tuple(int(a) % n for a in axes)
        for axes, n in ((lc, lhs.ndim), (rc, rhs.ndim), (lb, lhs.ndim), (rb, rhs.ndim))
    )
    lfree = tuple(i for i in range(lhs.ndim) if i not in lc and i not in lb)
    rfree = tuple(i for i in range(rhs.ndim) if i not in rc and i not in rb)
    a = _canonical(lhs, lb, lfree, lc)
    b = _canonical(rhs, rb, rc, rfree)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    y = _fp8_matmul(a, b, recipe, out_dtype)
    out_shape = (
        [lhs.shape[i] for i in lb] + [lhs.shape[i] for i in lfree] + [rhs.shape[i] for i in rfree]
    )
    return y.reshape(out_shape)


def make_dot_general(recipe: Recipe) -> Callable[..., Array]:
    """A `lax.dot_general`-compatible callable for the recipe (pass to linear layers).

    Linear layers pass activations in the compute dtype and weights as f32 masters. The
    unquantized recipe casts the weights to the activations' dtype (the BF16 baseline); FP8
    recipes quantize the f32 masters directly, so the forward uses exactly the FP8 weights that
    `quantize_weight` exports to the rollout server."""
    if not recipe.quantized:
        return _high_precision_dot_general
    return functools.partial(fp8_dot_general, recipe=recipe)
