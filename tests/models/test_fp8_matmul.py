"""The FP8 dot_general (models.fp8.matmul): forward and custom VJP against the dequantized
numpy reference, the bf16 recipe as a plain dot, batch dimension numbers."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from _model_testlib import ref_fake_quant
from absl.testing import parameterized

from models import fp8

LINEAR_DN = (((2,), (0,)), ((), ()))


def operands(seed=0, shape=(2, 40, 260), n=136):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((shape[-1], n)) * 0.05).astype(np.float32)
    return x, w


def ref_tiles(recipe, role, contract_axis):
    """Tiles of a 2-D operand, written out independently of fp8.operand_tile."""
    gran = {
        "act": recipe.act_granularity,
        "weight": recipe.weight_granularity,
        "grad": recipe.grad_granularity,
    }[role]
    B = recipe.block_size
    if gran == "tensor":
        return (None, None)
    if gran == "row":
        return (1, None) if contract_axis == 1 else (None, 1)
    if role == "weight":
        return (B, B)
    return (1, B) if contract_axis == 1 else (B, 1)


QUANT_RECIPES = [
    fp8.FP8_TENSOR,
    fp8.FP8_ROW,
    fp8.FP8_BLOCK,
    fp8.get_recipe("fp8_block", bwd_format="e5m2", pow2_scales=True, block_size=32),
]


class DotGeneralTest(chex.TestCase, parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((r.name + str(i), r) for i, r in enumerate(QUANT_RECIPES))
    def test_forward_equals_dequantized_f32_dot(self, recipe):
        x, w = operands()
        y = self.variant(lambda a, b: fp8.fp8_dot_general(a, b, LINEAR_DN, recipe=recipe))(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        xq = ref_fake_quant(x2, recipe.fwd_format, ref_tiles(recipe, "act", 1), recipe.pow2_scales)
        wq = ref_fake_quant(
            w, recipe.fwd_format, ref_tiles(recipe, "weight", 0), recipe.pow2_scales
        )
        exact = jnp.matmul(
            jnp.asarray(xq, jnp.float32),
            jnp.asarray(wq, jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        np.testing.assert_array_equal(np.asarray(y).reshape(exact.shape), np.asarray(exact))
        # Within the FP8 error bound of the float64 product: each operand is off by at most
        # u = 2^-4 relative (normals) plus a subnormal floor, so |dy| <= sum|x||w| (2u + u^2)
        # + the subnormal terms, bounded here by the same sum times 2^-7.
        y64 = x2.astype(np.float64) @ w.astype(np.float64)
        bound = np.abs(x2) @ np.abs(w) * (2 * 2.0**-4 + 2.0**-8 + 2.0**-7)
        self.assertTrue(np.all(np.abs(np.asarray(y).reshape(y64.shape) - y64) <= bound))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((r.name + str(i), r) for i, r in enumerate(QUANT_RECIPES))
    def test_custom_vjp_equals_reference_fp8_backward(self, recipe):
        x, w = operands(1, shape=(2, 33, 200), n=136)
        g = np.random.default_rng(2).standard_normal((2, 33, 136)).astype(np.float32)

        def f(a, b):
            return fp8.fp8_dot_general(a, b, LINEAR_DN, recipe=recipe)

        _, vjp = jax.vjp(f, x, w)
        dx, dw = self.variant(vjp)(g)
        x2, g2 = x.reshape(-1, 200), g.reshape(-1, 136)
        p2 = recipe.pow2_scales
        # dgrad: Q(g) [M, N] . Q(w)^T, both tiled along N.
        gq_d = ref_fake_quant(g2, recipe.bwd_format, ref_tiles(recipe, "grad", 1), p2)
        wq_d = ref_fake_quant(w.T, recipe.fwd_format, ref_tiles(recipe, "weight", 0), p2)
        dx_ref = gq_d @ wq_d
        # wgrad: Q(x)^T . Q(g), both tiled along the tokens M.
        xq_w = ref_fake_quant(x2, recipe.fwd_format, ref_tiles(recipe, "act", 0), p2)
        gq_w = ref_fake_quant(g2, recipe.bwd_format, ref_tiles(recipe, "grad", 0), p2)
        dw_ref = xq_w.T @ gq_w
        np.testing.assert_allclose(
            np.asarray(dx).reshape(dx_ref.shape),
            dx_ref,
            rtol=2e-5,
            atol=2e-5 * np.abs(dx_ref).max(),
        )
        np.testing.assert_allclose(
            np.asarray(dw), dw_ref, rtol=2e-5, atol=2e-5 * np.abs(dw_ref).max()
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_bf16_recipe_is_plain_dot(self):
        # Forward and input gradient: lax.dot_general's, bit for bit. Weight gradient: its own
        # GEMM (`transposed_left_operand`), checked against float64 numpy of the same rounded
        # cotangent: within bf16 rounding, and no worse than autodiff of lax.dot_general.
        x, w = operands(3)
        x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)

        def loss(dot):
            return lambda a, b: jnp.sum(dot(a, b, LINEAR_DN).astype(jnp.float32) ** 2)

        ours_dot = fp8.make_dot_general(fp8.BF16)
        chex.assert_trees_all_equal(
            self.variant(ours_dot, static_argnums=2)(x, w, LINEAR_DN),
            self.variant(jax.lax.dot_general, static_argnums=2)(x, w, LINEAR_DN),
        )
        ours = self.variant(jax.grad(loss(ours_dot), argnums=(0, 1)))(x, w)
        plain = self.variant(jax.grad(loss(jax.lax.dot_general), argnums=(0, 1)))(x, w)
        chex.assert_trees_all_equal(ours[0], plain[0])
        x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
        y = np.asarray(jnp.asarray(x64 @ w64, jnp.bfloat16), np.float64)
        g = np.asarray(jnp.asarray(2 * y, jnp.bfloat16), np.float64)
        dw_ref = x64.reshape(-1, x64.shape[-1]).T @ g.reshape(-1, g.shape[-1])

        def err(dw):
            return np.abs(np.asarray(dw, np.float64) - dw_ref).max() / np.abs(dw_ref).max()

        assert err(ours[1]) < 2**-7, err(ours[1])
        assert err(ours[1]) <= err(plain[1]), (err(ours[1]), err(plain[1]))

    def test_f32_linear_weight_gradient_against_float64(self):
        # The f32 weight gradient through the transposed-operand GEMM vs float64 numpy.
        x, w = operands(5)
        dot = fp8.make_dot_general(fp8.BF16)
        g = np.random.default_rng(6).standard_normal((*x.shape[:-1], w.shape[1]))
        dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(dot(a, b, LINEAR_DN) * g), (0, 1)))(x, w)
        dw_ref = x.reshape(-1, x.shape[-1]).astype(np.float64).T @ g.reshape(-1, g.shape[-1])
        np.testing.assert_allclose(
            np.asarray(dw), dw_ref, rtol=1e-5, atol=1e-5 * np.abs(dw_ref).max()
        )
        np.testing.assert_allclose(
            np.asarray(dx), g @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5 * np.abs(dx).max()
        )

    def test_batched_dimension_numbers(self):
        # [B, H, M, K] x [B, K, N] with a batch axis: each batch element is its own GEMM;
        # tensor scales then span the whole operand (all batch elements together).
        rng = np.random.default_rng(4)
        a = rng.standard_normal((3, 4, 40)).astype(np.float32)
        b = rng.standard_normal((3, 40, 24)).astype(np.float32)
        dn = (((2,), (1,)), ((0,), (0,)))
        y = fp8.fp8_dot_general(a, b, dn, recipe=fp8.FP8_ROW)
        ref = np.stack(
            [
                ref_fake_quant(a[i], "e4m3", (1, None), False)
                @ ref_fake_quant(b[i], "e4m3", (None, 1), False)
                for i in range(3)
            ]
        )
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
