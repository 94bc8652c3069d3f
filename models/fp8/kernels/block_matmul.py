"""The three GEMMs of the block recipe's FP8 matmul on the Hopper kernel (`backend="pallas"`).

Same math as the emulate backend of `models.fp8.matmul`, operand for operand (both quantize
with `quantization.quantize_operand`, so they agree on every FP8 value and scale); only the GEMM
differs: `gemm.scaled_matmul_nt` instead of an f32 dot of dequantized operands. With B = 128:

    fprop  y [M, N]  = x [M, K] . w [K, N]     x: 1 x B along K,  w: B x B blocks
           NT form:    a = Q(x) [M, K],       b = Q(w)^T [N, K]   (DeepGEMM sm90 1d2d)
    dgrad  dx [M, K] = g [M, N] . w^T          g: 1 x B along N,  w: B x B blocks
           NT form:    a = Q(g) [M, N],       b = Q(w) [K, N]     (1d2d; w's own layout)
    wgrad  dw [K, N] = x^T . g, over tokens M  x and g: 1 x B along M (the token axis)
           NT form:    a = Q(x)^T [K, M],     b = Q(g)^T [N, M]   (1d1d)

What stays in XLA (fused elementwise + transposes, outside the kernel): the quantizers (amax,
scale, cast), the transposed FP8 copies (Q(w)^T for fprop, Q(x)^T and Q(g)^T for wgrad: FP8
wgmma takes no transposed 8-bit operand), the repetition of the 128x128 weight scales along
their rows, the zero-padding to whole tiles and leading batch axes (a `lax.map`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from models.fp8.kernels import gemm
from models.fp8.quantization import quantize_operand
from models.fp8.recipe import Format, Recipe, Role


def _quantize(x: Array, fmt: Format, contract_axis: int, role: Role, recipe: Recipe):
    """A 2-D operand quantized with the block recipe's tiles for its role."""
    return quantize_operand(x, fmt, contract_axis, "block", role, recipe)


def _rows_of_blocks(scale: Array, rows: int, block: int) -> Array:
    """[ceil(rows/B), kb] block scales -> [rows, kb], one per row (what the kernel reads)."""
    return jnp.repeat(scale, block, axis=0)[:rows]


def _kernel_dtype(dtype: jnp.dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    return dtype if dtype in gemm.OUT_DTYPES else jnp.dtype(jnp.float32)


def _over_batch(fn: Callable[..., Array], *xs: Array) -> Array:
    """fn on 2-D operands, mapped over any leading batch axes (shared by all operands)."""
    if xs[0].ndim == 2:
        return fn(*xs)
    batch = xs[0].shape[:-2]
    flat = [x.reshape(-1, *x.shape[-2:]) for x in xs]
    out = jax.lax.map(lambda args: fn(*args), tuple(flat))
    return out.reshape(*batch, *out.shape[-2:])


def _fprop2d(x: Array, w: Array, recipe: Recipe, out_dtype: jnp.dtype) -> Array:
    qx, sx = _quantize(x, recipe.fwd_format, -1, "act", recipe)  # sx [M, Kb]
    qw, sw = _quantize(w, recipe.fwd_format, -2, "weight", recipe)  # qw [K, N], sw [Kb, Nb]
    n = w.shape[1]
    sb = _rows_of_blocks(sw.T, n, recipe.block_size)
    y = gemm.scaled_matmul_nt(qx, qw.T, sx, sb, _kernel_dtype(out_dtype))
    return y.astype(out_dtype)


def _dgrad2d(g: Array, w: Array, recipe: Recipe, out_dtype: jnp.dtype) -> Array:
    qg, sg = _quantize(g, recipe.bwd_format, -1, "grad", recipe)  # sg [M, Nb]
    qw, sw = _quantize(w, recipe.fwd_format, -1, "weight", recipe)  # qw [K, N], sw [Kb, Nb]
    sb = _rows_of_blocks(sw, w.shape[0], recipe.block_size)
    dx = gemm.scaled_matmul_nt(qg, qw, sg, sb, _kernel_dtype(out_dtype))
    return dx.astype(out_dtype)


def _wgrad2d(x: Array, g: Array, recipe: Recipe, out_dtype: jnp.dtype) -> Array:
    qx, sx = _quantize(x, recipe.fwd_format, -2, "act", recipe)  # sx [Mb, K]
    qg, sg = _quantize(g, recipe.bwd_format, -2, "grad", recipe)  # sg [Mb, N]
    dw = gemm.scaled_matmul_nt(qx.T, qg.T, sx.T, sg.T, _kernel_dtype(out_dtype))
    return dw.astype(out_dtype)


def fprop(
    x: Float[Array, "*B M K"], w: Float[Array, "*B K N"], recipe: Recipe, out_dtype: jnp.dtype
) -> Float[Array, "*B M N"]:
    """y = Q(x) . Q(w) (E4M3, 1x128 activation tiles, 128x128 weight blocks), f32 promotion."""
    return _over_batch(lambda a, b: _fprop2d(a, b, recipe, out_dtype), x, w)


def dgrad(
    g: Float[Array, "*B M N"], w: Float[Array, "*B K N"], recipe: Recipe, out_dtype: jnp.dtype
) -> Float[Array, "*B M K"]:
    """dx = Q(g) . Q(w)^T over N; g in the recipe's backward format, 1x128 tiles along N."""
    return _over_batch(lambda a, b: _dgrad2d(a, b, recipe, out_dtype), g, w)


def wgrad(
    x: Float[Array, "*B M K"], g: Float[Array, "*B M N"], recipe: Recipe, out_dtype: jnp.dtype
) -> Float[Array, "*B K N"]:
    """dw = Q(x)^T . Q(g) over the tokens M; both with 1x128 tiles along M."""
    return _over_batch(lambda a, b: _wgrad2d(a, b, recipe, out_dtype), x, g)
