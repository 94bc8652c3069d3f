"""The FP8 `dot_general`: a drop-in `lax.dot_general` whose GEMMs quantize their operands.

`fp8_dot_general` has a `jax.custom_vjp`. Forward (fprop): y = Q(x) . Q(w) with f32
accumulation. Backward: dgrad = Q(g) . Q(w)^T contracted over N, wgrad = Q(x)^T . Q(g)
contracted over the tokens; each GEMM re-quantizes its operands along its own contraction axis
(gradients in the recipe's backward format), with the tiles of `quantization.operand_tile`.
It is stateless: no amax history.

Backend `emulate` dequantizes to f32 and runs an f32 dot. On CPU XLA runs float8 dots by
upcasting anyway, so this is exactly what an FP8 GEMM with f32 accumulation computes (up to the
order of the f32 sums), and it is the reference the `pallas` Hopper kernel
(`models.fp8.kernels`) is checked against.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from models.fp8.grouped import grouped_dot
from models.fp8.quantization import fake_quantize_operand, fake_quantize_weight
from models.fp8.recipe import Recipe

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def _f32_matmul(a: Array, b: Array) -> Array:
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def transposed_left_operand(x: Array) -> Array:
    """x with its last two axes swapped, as the left operand of a weight-gradient GEMM
    (x^T . g, summed over the tokens).

    XLA folds a transpose into the dot's dimension numbers. On XLA:CPU a left operand contracted
    along its rows then misses the GEMM library (YNNPACK takes a transposed right operand, not a
    transposed left one) and runs as a generic dot at about half the speed; so on CPU the
    transpose is materialised (row-major, behind an optimization barrier), which costs one copy
    of the activations and makes the product a library GEMM. On GPU the GEMM reads transposed
    operands natively and the transpose is left to it. Values are the same either way; only
    the order of the f32 sums over the tokens can differ."""
    xt = jnp.swapaxes(x, -1, -2)
    return jax.lax.optimization_barrier(xt) if jax.default_backend() == "cpu" else xt


def _hopper_kernels():
    """`models.fp8.kernels.block_matmul`, imported on first use: it imports Pallas' Mosaic GPU
    modules (~0.4 s of every process's start), needed only by backend "pallas"."""
    from models.fp8.kernels import block_matmul

    return block_matmul


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_matmul(a: Array, b: Array, recipe: Recipe, out_dtype: jnp.dtype) -> Array:
    """a [*, M, K] @ b [*, K, N] with both operands quantized by the recipe; f32 accumulation."""
    if recipe.backend == "pallas":
        return _hopper_kernels().fprop(a, b, recipe, out_dtype)
    aq = fake_quantize_operand(a, recipe.fwd_format, -1, recipe.act_granularity, "act", recipe)
    bq = b if recipe.prequantized_weights else fake_quantize_weight(b, recipe)
    return _f32_matmul(aq, bq).astype(out_dtype)


def _fp8_matmul_fwd(a, b, recipe, out_dtype):
    return _fp8_matmul(a, b, recipe, out_dtype), (a, b)


def _fp8_matmul_bwd(recipe, out_dtype, res, g):
    a, b = res
    r = recipe
    if r.backend == "pallas":
        kernels = _hopper_kernels()
        return kernels.dgrad(g, b, r, a.dtype), kernels.wgrad(a, g, r, b.dtype)
    # dgrad: da = g [*, M, N] . b^T [*, N, K], summed over N (g's and b's last axis).
    gq_d = fake_quantize_operand(g, r.bwd_format, -1, r.grad_granularity, "grad", r)
    bq_d = fake_quantize_operand(b, r.fwd_format, -1, r.weight_granularity, "weight", r)
    da = _f32_matmul(gq_d, jnp.swapaxes(bq_d, -1, -2))
    # wgrad: db = a^T [*, K, M] . g [*, M, N], summed over the tokens M (axis -2 of both).
    aq_w = fake_quantize_operand(a, r.fwd_format, -2, r.act_granularity, "act", r)
    gq_w = fake_quantize_operand(g, r.bwd_format, -2, r.grad_granularity, "grad", r)
    db = _f32_matmul(transposed_left_operand(aq_w), gq_w)
    return da.astype(a.dtype), db.astype(b.dtype)


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


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
    """`lax.dot_general` with the weights cast to the activations' (compute) dtype. On a CPU
    backend a linear layer's product (x [..., K] . w [K, N]) takes `_linear`'s gradient rule
    (elsewhere autodiff's, which keeps `jax.checkpoint`'s "save_dots" policy seeing the dot)."""
    (lc, rc), (lb, rb) = dimension_numbers
    linear = tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and not lb and not rb
    if linear and rhs.ndim == 2 and jax.default_backend() == "cpu":
        return _linear(lhs, rhs, precision, preferred_element_type)
    return jax.lax.dot_general(
        lhs,
        rhs.astype(lhs.dtype),
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


def _linear_product(x: Array, w: Array, precision: object, out: jnp.dtype | None) -> Array:
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, precision=precision, preferred_element_type=out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _linear(x: Array, w: Array, precision: object, out: jnp.dtype | None) -> Array:
    """x [..., K] . w [K, N] in x's dtype (w cast to it). Its gradient is autodiff's, except
    that the weight gradient's tokens-contracted GEMM takes its left operand through
    `transposed_left_operand`."""
    return _linear_product(x, w.astype(x.dtype), precision, out)


def _linear_fwd(x, w, precision, out):
    return _linear(x, w, precision, out), (x, w)


def _linear_bwd(precision, out, res, g):
    x, w = res
    wc = w.astype(x.dtype)
    (dx,) = jax.vjp(lambda x_: _linear_product(x_, wc, precision, out), x)[1](g)
    x2 = x.reshape(-1, x.shape[-1])
    g2 = g.reshape(-1, g.shape[-1])
    dw = jax.lax.dot_general(
        transposed_left_operand(x2), g2, (((1,), (0,)), ((), ())), precision=precision,
        preferred_element_type=out,
    )  # fmt: skip
    return dx, dw.astype(w.dtype)


_linear.defvjp(_linear_fwd, _linear_bwd)


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
    non-quantized recipe it is `lax.dot_general` with the weights cast to the activations'
    dtype. Otherwise the operands are brought to [batch, M, K] x [batch, K, N] (several
    contracting axes are merged into one K, several free axes into one M or N: block tiles then
    run along the merged axis), multiplied by the custom-VJP FP8 matmul, and reshaped back;
    `precision` is ignored (accumulation is f32).
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


@dataclasses.dataclass(frozen=True)
class RecipeDot:
    """A recipe's GEMMs as a model's layers call them: called, it is the linear layers'
    `dot_general` (`dense`: `make_dot_general(recipe)`, possibly wrapped); `grouped(x, w,
    group_sizes)` is the Mixture-of-Experts layers' grouped GEMM under the same recipe."""

    dense: Callable[..., Array]
    recipe: Recipe

    def __call__(self, *args: Any, **kwargs: Any) -> Array:
        return self.dense(*args, **kwargs)

    def grouped(self, x: Array, w: Array, group_sizes: Array) -> Array:
        return grouped_dot(x, w, group_sizes, self.recipe)


def make_dot_general(recipe: Recipe) -> Callable[..., Array]:
    """A `lax.dot_general`-compatible callable for the recipe (pass to linear layers).

    Linear layers pass activations in the compute dtype and weights as f32 masters. The
    unquantized recipe casts the weights to the activations' dtype (the BF16 baseline); FP8
    recipes quantize the f32 masters directly, so the forward uses exactly the FP8 weights that
    `quantize_weight` exports to the rollout server."""
    if not recipe.quantized:
        return _high_precision_dot_general
    return functools.partial(fp8_dot_general, recipe=recipe)
