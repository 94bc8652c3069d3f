"""The block recipe's FP8 grouped GEMM (`models.fp8.grouped.grouped_dot` with backend "pallas")
on the Hopper kernels of `grouped_gemm.py`: fprop, dgrad and wgrad, with a custom VJP.

Same FP8 values and scales as the emulate backend of `models.fp8.grouped` (both quantize each
expert's operands as its own dense GEMM would), so the two agree up to the order of the f32
sums. With B = 128 and the rows laid out by `grouped_gemm.GroupLayout` (each expert's run
starting at a multiple of 128 rows, zero rows between runs):

    fprop  y_e  = Q(x_e) . Q(w_e)      x: 1 x B along K,   w_e: B x B    rows form, b = Q(w)^T
    dgrad  dx_e = Q(g_e) . Q(w_e)^T    g: 1 x B along N,   w_e: B x B    rows form, b = Q(w)
    wgrad  dw_e = Q(x_e)^T . Q(g_e)    x, g: B x 1 tiles along the tokens, each expert's tiles
                                       starting at its first row        contraction form

Quantizing the laid-out rows gives the emulate path's tiles directly: 1 x B tiles are per row
(a zero padding row gets scale 1 and FP8 zeros), and B-row token tiles of the buffer are the
expert's own token tiles, since every run starts on a B boundary and padding rows are zero
(they never raise an amax). Quantizers, layout gathers and the transposed FP8 copies stay in
XLA, as in `block_matmul.py`.

Rows split over devices (`row_axes` of `grouped_dot`) are not supported here: their wgrad
token tiles span devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from models.fp8.kernels import grouped_gemm
from models.fp8.kernels.block_matmul import _kernel_dtype
from models.fp8.kernels.gemm import BLOCK_K
from models.fp8.quantization import quantize_operand
from models.fp8.recipe import Recipe


def check_recipe(recipe: Recipe) -> None:
    """The kernels run the block recipe only (1 x 128 / 128 x 128 tiles)."""
    grans = (recipe.act_granularity, recipe.weight_granularity, recipe.grad_granularity)
    if not recipe.quantized or grans != ("block",) * 3 or recipe.block_size != BLOCK_K:
        raise ValueError(
            f"grouped_dot: backend='pallas' runs the block recipe only (act, weight and grad "
            f"granularity 'block', block_size {BLOCK_K}), got recipe {recipe.name!r} with "
            f"granularities {grans} and block_size {recipe.block_size}; use backend='emulate' "
            "for this recipe, or get_recipe('fp8_block', backend='pallas')"
        )


def _block_rows(scale: Array, rows: int) -> Array:
    """[E, ceil(rows / B), c] block scales -> [E, rows, c], one per row (what the kernel reads)."""
    return jnp.repeat(scale, BLOCK_K, axis=1)[:, :rows]


def _rows_product(a: Array, w: Array, layout, fmt, contract_axis: int, recipe, out_dtype):
    """The rows form on laid-out rows `a` [M, C] and each expert's weight w [E, K, N]
    contracted over its axis `contract_axis` (-2: fprop, C = K; -1: dgrad, C = N)."""
    qa, sa = quantize_operand(a, fmt, -1, "block", "act", recipe)  # sa [M, Cb]
    qw, sw = quantize_operand(w, recipe.fwd_format, contract_axis, "block", "weight", recipe)
    if contract_axis == -2:  # b = Q(w)^T [E, N, K]; sw [E, Kb, Nb] -> per row of b [E, N, Kb]
        qb, sb = jnp.swapaxes(qw, 1, 2), _block_rows(jnp.swapaxes(sw, 1, 2), w.shape[2])
    else:  # b = Q(w) [E, K, N], sw [E, Kb, Nb] -> [E, K, Nb]
        qb, sb = qw, _block_rows(sw, w.shape[1])
    out = grouped_gemm.grouped_rows_nt(qa, qb, sa, sb, layout.tile_experts, out_dtype)
    return layout.scatter(out)


def _fprop(x, w, group_sizes, recipe):
    layout = grouped_gemm.GroupLayout.create(group_sizes, x.shape[0])
    y = _rows_product(
        layout.gather(x), w, layout, recipe.fwd_format, -2, recipe, _kernel_dtype(x.dtype)
    )
    return y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x: Array, w: Array, group_sizes: Array, recipe: Recipe) -> Array:
    return _fprop(x, w, group_sizes, recipe)


def _grouped_fwd(x, w, group_sizes, recipe):
    return _fprop(x, w, group_sizes, recipe), (x, w, group_sizes)


def _grouped_bwd(recipe, res, g):
    x, w, group_sizes = res
    layout = grouped_gemm.GroupLayout.create(group_sizes, x.shape[0])
    g_rows = layout.gather(g)
    dx = _rows_product(g_rows, w, layout, recipe.bwd_format, -1, recipe, _kernel_dtype(x.dtype))
    # wgrad: B x 1 tiles along the laid-out tokens (each run starts on a B boundary).
    qx, sx = quantize_operand(layout.gather(x), recipe.fwd_format, -2, "block", "act", recipe)
    qg, sg = quantize_operand(g_rows, recipe.bwd_format, -2, "block", "grad", recipe)
    dw = grouped_gemm.grouped_contraction_nt(
        qx.T, qg.T, sx.T, sg.T, layout.first_block, layout.num_blocks, _kernel_dtype(w.dtype)
    )
    zero_sizes = jnp.zeros(group_sizes.shape, jax.dtypes.float0)
    return dx.astype(x.dtype), dw.astype(w.dtype), zero_sizes


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_dot(
    x: Float[Array, "T K"], w: Float[Array, "E K N"], group_sizes: Int[Array, " E"], recipe: Recipe
) -> Float[Array, "T N"]:
    """y[t] = Q(x)[t] . Q(w[expert of t]) on the kernels; x's rows sorted by expert, group_sizes
    [E] of them per expert (sum at most T; rows past it give 0 and get no gradient).
    Differentiable in x and w (dgrad on the rows form, wgrad on the contraction form)."""
    check_recipe(recipe)
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_dot: need x [T, K] and w [E, K, N], got {x.shape}, {w.shape}")
    if x.shape[0] == 0 or w.shape[0] == 0:  # no rows or no experts: nothing for a kernel
        return jnp.zeros((x.shape[0], w.shape[2]), x.dtype)
    return _grouped(x, w, group_sizes.astype(jnp.int32), recipe)
