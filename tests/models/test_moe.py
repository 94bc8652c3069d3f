"""The MoE block (`models.moe.moe_block`) against Qwen3-MoE's algorithm written out in float64
numpy, one token and one expert at a time: softmax router, top-k, `norm_topk_prob`, SwiGLU
experts, the weighted sum. Under an FP8 recipe the reference quantizes each expert's operands as
one dense GEMM over the tokens routed to it, in token order (`ref_fake_quant`). Also: routing
replay (given experts used, gradients through their gates to the router, against central
differences of the float64 reference) and the dropless load (an expert that gets every token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import ref_fake_quant
from test_fp8_matmul import ref_tiles

from models import fp8
from models.moe import moe_block

N, D, F, E, K = 40, 160, 96, 6, 2  # D, F (the experts' width): partial 128-blocks


def params(seed: int = 0, skew: float = 0.0):
    rng = np.random.default_rng(seed)
    router = rng.standard_normal((D, E)) * 0.3
    x = rng.standard_normal((N, D))
    x[:, 0] = 1 + np.abs(x[:, 0])
    router[0, 0] += skew  # skew > 0 sends every token to expert 0
    return (
        x.astype(np.float32),
        router.astype(np.float32),
        (rng.standard_normal((E, D, F)) * 0.1).astype(np.float32),
        (rng.standard_normal((E, D, F)) * 0.1).astype(np.float32),
        (rng.standard_normal((E, F, D)) * 0.1).astype(np.float32),
    )


def reference(recipe, x, router, wg, wu, wd, norm: bool, routing=None):
    """float64 numpy: (y, experts) of Qwen3-MoE's block."""
    x64 = x.astype(np.float64)
    logits = x64 @ router.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :K] if routing is None else routing
    weights = np.take_along_axis(probs, experts, axis=-1)
    if norm:
        weights = weights / weights.sum(-1, keepdims=True)

    def q(a, role, axis, fmt):
        if not recipe.quantized:
            return a.astype(np.float64)
        return ref_fake_quant(a, fmt, ref_tiles(recipe, role, axis), recipe.pow2_scales)

    y = np.zeros((N, D))
    for e in range(E):
        tok, slot = np.nonzero(experts == e)  # token order
        if tok.size == 0:
            continue
        xe = x[tok]
        f = recipe.fwd_format
        g = q(xe, "act", 1, f) @ q(wg[e], "weight", 0, f)
        u = q(xe, "act", 1, f) @ q(wu[e], "weight", 0, f)
        h = g / (1 + np.exp(-g)) * u
        out = q(h.astype(np.float32), "act", 1, f) @ q(wd[e], "weight", 0, f)
        y[tok] += weights[tok, slot, None] * out
    return y, experts


def run(recipe, p, norm: bool, routing=None):
    x, router, wg, wu, wd = (jnp.asarray(a) for a in p)
    return moe_block(
        x, router, wg, wu, wd, top_k=K, norm_topk_prob=norm, recipe=recipe,
        routing=None if routing is None else jnp.asarray(routing),
    )  # fmt: skip


# Jitted (recipe and norm static): one compile per program, shared by the tests that run it
# (the layer-by-layer eager run of the block costs more than its compile).
run_jit = jax.jit(run, static_argnums=(0, 2))


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "raw_topk"])
@pytest.mark.parametrize("recipe", [fp8.BF16, fp8.FP8_TENSOR, fp8.FP8_ROW, fp8.FP8_BLOCK])
def test_block_equals_the_float64_reference(recipe, norm: bool) -> None:
    p = params()
    y, experts = run_jit(recipe, p, norm)
    want, want_experts = reference(recipe, *p, norm)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    # f32 sums against float64 (measured: <= 6e-7 of max |y| for every recipe, while FP8 moves
    # y by 5-6% of it from BF16's); the FP8 bound leaves room for the intermediate h, quantized
    # from its f32 value, to sit an ulp from the float64 one and round to the next FP8 value.
    tol = 2e-5 if not recipe.quantized else 2e-3
    np.testing.assert_allclose(
        np.asarray(y, np.float64), want, rtol=tol, atol=tol * np.abs(want).max()
    )


def test_routing_replay_uses_the_given_experts_and_reaches_the_router() -> None:
    p = params(1)
    _, own = run_jit(fp8.BF16, p, True)
    y_own, _ = run_jit(fp8.BF16, p, True)
    y_replay, _ = run_jit(fp8.BF16, p, True, routing=np.asarray(own))
    np.testing.assert_array_equal(np.asarray(y_replay), np.asarray(y_own))
    # Other experts (the same two for every token): the reference with that routing.
    other = np.tile(np.arange(E - K, E), (N, 1))
    y_other, picked = run_jit(fp8.BF16, p, True, routing=other)
    np.testing.assert_array_equal(np.asarray(picked), np.asarray(own))  # the router's own pick
    want, _ = reference(fp8.BF16, *p, True, routing=other)
    np.testing.assert_allclose(
        np.asarray(y_other, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max()
    )
    # Tokens recorded with a negative entry (pads, a sample's last token) keep their own
    # experts; the others take the replayed ones.
    partial = other.copy()
    partial[::3, 0] = -1
    y_partial, _ = run_jit(fp8.BF16, p, True, routing=partial)
    mixed = np.where((partial >= 0).all(-1, keepdims=True), other, np.asarray(own))
    want, _ = reference(fp8.BF16, *p, True, routing=mixed)
    np.testing.assert_allclose(
        np.asarray(y_partial, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max()
    )

    # Gradients through the replayed experts' gates reach the router: against central
    # differences of the float64 reference (routing fixed, so the function is smooth).
    c = np.random.default_rng(3).standard_normal((N, D))

    def loss(router):
        x, _, wg, wu, wd = (jnp.asarray(a) for a in p)
        y, _ = moe_block(x, router, wg, wu, wd, top_k=K, norm_topk_prob=True, recipe=fp8.BF16,
                         routing=jnp.asarray(other))  # fmt: skip
        return jnp.sum(y * c)

    grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(p[1])), np.float64)
    assert np.abs(grad).max() > 0
    for i, j in [(0, E - 1), (7, E - 2), (100, 0), (159, 3)]:
        step = np.zeros(p[1].shape)
        step[i, j] = 1e-4
        hi = reference(fp8.BF16, p[0], p[1] + step, *p[2:], True, routing=other)[0]
        lo = reference(fp8.BF16, p[0], p[1] - step, *p[2:], True, routing=other)[0]
        fd = np.sum((hi - lo) * c) / 2e-4
        assert abs(grad[i, j] - fd) <= 1e-3 * max(1.0, abs(fd)), (i, j, grad[i, j], fd)


def test_dropless_under_a_skewed_load() -> None:
    """A router that sends every token to expert 0 (plus one other): no token loses it."""
    p = params(2, skew=50.0)
    y, experts = run_jit(fp8.FP8_BLOCK, p, True)  # the reference test's program
    assert np.all(np.asarray(experts)[:, 0] == 0)
    want, _ = reference(fp8.FP8_BLOCK, *p, True)
    np.testing.assert_allclose(
        np.asarray(y, np.float64), want, rtol=2e-3, atol=2e-3 * np.abs(want).max()
    )


@pytest.mark.parametrize("recipe", [fp8.BF16, fp8.FP8_TENSOR, fp8.FP8_BLOCK])
def test_shared_expert_is_a_recipe_mlp_gated_in_f32(recipe) -> None:
    """Qwen2-MoE's layer (`models.layers.SparseMoE` with a shared expert) = the routed block +
    sigmoid(x . w_gate) * SwiGLU(x), the shared expert's three GEMMs quantized as a dense
    MLP's over all the tokens (float64 numpy with `ref_fake_quant`), the gate in float64."""
    from flax import nnx

    from models import functional as mf
    from models.config import get_config
    from models.layers import SparseMoE

    cfg = get_config("tiny_qwen2_moe", compute_dtype=jnp.float32)
    layer = SparseMoE(cfg, rngs=nnx.Rngs(params=3))
    x = np.random.default_rng(2).standard_normal((2, 7, cfg.hidden_size)).astype(np.float32)
    graphdef, state = nnx.split(layer)

    @jax.jit
    def layer_and_block(state, x):  # one program for both
        layer = nnx.merge(graphdef, state)
        y, _, _ = layer(x, mf.dot_general_for(cfg, recipe))
        routed, _ = moe_block(
            x, layer.gate.kernel[...], layer.experts.gate_proj[...],
            layer.experts.up_proj[...], layer.experts.down_proj[...], top_k=2,
            norm_topk_prob=False, recipe=recipe,
        )  # fmt: skip
        return y, routed

    y, routed = layer_and_block(state, jnp.asarray(x))
    xf = x.reshape(-1, cfg.hidden_size)
    s = layer.shared_expert

    def swiglu(quantized: bool) -> np.ndarray:
        def q(a, role, axis):
            if not quantized:
                return np.asarray(a, np.float64)
            tile = ref_tiles(recipe, role, axis)
            return ref_fake_quant(np.asarray(a), recipe.fwd_format, tile, recipe.pow2_scales)

        g = q(xf, "act", 1) @ q(s.gate_proj.kernel[...], "weight", 0)
        u = q(xf, "act", 1) @ q(s.up_proj.kernel[...], "weight", 0)
        h = (g / (1 + np.exp(-g)) * u).astype(np.float32)
        return q(h, "act", 1) @ q(s.down_proj.kernel[...], "weight", 0)

    w_gate = np.asarray(layer.shared_expert_gate.kernel[...], np.float64)
    gate = 1 / (1 + np.exp(-(xf.astype(np.float64) @ w_gate)))
    base = np.asarray(routed, np.float64).reshape(-1, cfg.hidden_size)
    want = base + gate * swiglu(recipe.quantized)
    got = np.asarray(y, np.float64).reshape(-1, cfg.hidden_size)
    tol = 2e-5 if not recipe.quantized else 2e-3
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)
    if recipe.quantized:  # the shared expert runs in FP8: far from its unquantized value
        assert np.abs(got - (base + gate * swiglu(False))).max() > 10 * tol * scale
