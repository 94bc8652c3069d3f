"""The FP8 grouped GEMM of MoE layers (`models.fp8.grouped.grouped_dot`) against a loop over the
experts in float64 numpy: each expert's rows and weight quantized as one dense GEMM's operands
(`ref_fake_quant`, written independently of the project's tiling), its fprop, dgrad and wgrad
products in float64. Three experts, one of them empty, and rows past the groups (which give 0
and get no gradient); K = 260 and N = 136 leave partial 128-tiles; an expert with 35 rows and
a 32-block recipe put wgrad tiles across an expert's rows.

The quantized operands are the same values on both sides, so what differs is the f32 sum of
the products: bounded by K (or the expert's rows) x 2^-24 x sum |a||b|, far below one FP8
rounding step (2^-4 relative): a wrong scale or a tile crossing an expert boundary fails it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import ref_fake_quant
from test_fp8_matmul import QUANT_RECIPES, ref_tiles

from models import fp8
from models.fp8.grouped import grouped_dot

# With power-of-two scales a tile's membership barely matters (a scale off by a power of two
# rounds the same): the 32-block recipe with exact scales is the one that sees where wgrad's
# token tiles start.
RECIPES = [*QUANT_RECIPES, fp8.get_recipe("fp8_block", block_size=32)]
T, K, N = 70, 260, 136
SIZES = (29, 0, 35)  # 64 rows in groups, 6 past them


def operands(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[3] *= 1e3  # an outlier token: its own 1 x B tiles, its expert's tensor scale
    w = (rng.standard_normal((len(SIZES), K, N)) * 0.05).astype(np.float32)
    g = rng.standard_normal((T, N)).astype(np.float32)
    return x, w, g


def reference(recipe, x, w, g):
    """(y, dx, dw) of the loop over experts in float64, and the sum |a||b| bounds of each."""
    q = lambda a, fmt, role, axis: ref_fake_quant(  # noqa: E731
        a, fmt, ref_tiles(recipe, role, axis), recipe.pow2_scales
    )
    f, b = recipe.fwd_format, recipe.bwd_format
    y, dx = np.zeros((T, N)), np.zeros((T, K))
    dw = np.zeros(w.shape)
    by, bdx, bdw = np.zeros((T, N)), np.zeros((T, K)), np.zeros(w.shape)
    start = 0
    for e, n in enumerate(SIZES):
        rows = slice(start, start + n)
        start += n
        if n == 0:
            continue
        xe, ge, we = x[rows], g[rows], w[e]
        xq, wq = q(xe, f, "act", 1), q(we, f, "weight", 0)
        y[rows], by[rows] = xq @ wq, np.abs(xq) @ np.abs(wq)
        gq, wq_d = q(ge, b, "grad", 1), q(we, f, "weight", 1)
        dx[rows], bdx[rows] = gq @ wq_d.T, np.abs(gq) @ np.abs(wq_d.T)
        xq_w, gq_w = q(xe, f, "act", 0), q(ge, b, "grad", 0)
        dw[e], bdw[e] = xq_w.T @ gq_w, np.abs(xq_w.T) @ np.abs(gq_w)
    return (y, dx, dw), (by * K, bdx * N, bdw * max(SIZES))


def grouped(recipe, x, w, g, jit: bool):
    sizes = jnp.asarray(SIZES, jnp.int32)

    def f(a, b):
        return grouped_dot(a, b, sizes, recipe)

    f = jax.jit(f) if jit else f
    y, pullback = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    return (y, *pullback(jnp.asarray(g)))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize(
    "recipe", RECIPES, ids=lambda r: f"{r.name}-B{r.block_size}-{r.pow2_scales}"
)
def test_fprop_dgrad_wgrad_equal_the_per_expert_loop(recipe, jit: bool) -> None:
    x, w, g = operands()
    got = grouped(recipe, x, w, g, jit)
    want, bounds = reference(recipe, x, w, g)
    for name, a, b, bound in zip(("y", "dx", "dw"), got, want, bounds, strict=True):
        err = np.abs(np.asarray(a, np.float64) - b)
        assert np.all(err <= bound * 2.0**-24 + 1e-30), (name, float(np.max(err - bound * 2**-24)))
    # Rows past the groups: no output, no gradient.
    assert not np.any(np.asarray(got[0])[sum(SIZES) :])
    assert not np.any(np.asarray(got[1])[sum(SIZES) :])


def test_fp8_rounding_is_visible_and_bf16_is_ragged_dot() -> None:
    """The FP8 output differs from the unquantized product by FP8 rounding (the check above is
    not vacuous), and the BF16 recipe is `ragged_dot` itself."""
    x, w, g = operands(1)
    sizes = jnp.asarray(SIZES, jnp.int32)
    plain = jax.lax.ragged_dot(jnp.asarray(x), jnp.asarray(w), sizes)
    np.testing.assert_array_equal(
        grouped_dot(jnp.asarray(x), jnp.asarray(w), sizes, fp8.BF16), plain
    )
    y = grouped_dot(jnp.asarray(x), jnp.asarray(w), sizes, fp8.FP8_BLOCK)
    rel = np.abs(np.asarray(y) - np.asarray(plain))[: sum(SIZES)].max() / np.abs(plain).max()
    assert 1e-4 < rel < 0.1
