"""Scanned layers: equal to a per-layer Python loop over the stacked params (logits and
gradients, f32), remat policies change nothing numerically, and the program does not grow
with depth. Params held per layer (the rollout engine's) give the scan's numbers bit for bit."""

from __future__ import annotations

import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import all_eqns, left_padded_batch, tiny
from flax import nnx

from models import fp8
from models import functional as F
from models.attention import causal_self_attention
from models.config import get_config
from models.decoder import PerLayer, per_layer_params, unstack_layers
from models.rope import rope_cos_sin, rope_inv_freq


def unrolled_logits(graphdef, params, tokens, mask):
    """The test's reference: layer i = merge(layer params [i]) applied in a Python loop."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    dot_general = fp8.make_dot_general(fp8.BF16)
    cos, sin = rope_cos_sin(F.positions_from_mask(mask), rope_inv_freq(cfg))
    x = model.model.embed_tokens(tokens).astype(cfg.compute_dtype)
    layer_def, layer_params = nnx.split(model.model.layers)

    def attend(q, k, v, carry):
        out = causal_self_attention(q, k, v, mask, impl=cfg.attention, chunk=cfg.attention_chunk)
        return out, carry

    for i in range(cfg.num_layers):
        layer = nnx.merge(layer_def, jax.tree.map(lambda a, i=i: a[i], layer_params))
        x = layer(x, cos, sin, attend, None, dot_general)[0]
    h = model.model.norm(x)
    return jnp.einsum("btd,dv->btv", h, model.head_kernel(), preferred_element_type=jnp.float32)


# qwen2: qkv biases and a tied head; qwen3: q/k norms (llama adds nothing the scan touches).
@pytest.mark.parametrize("name", ["tiny_qwen2", "tiny_qwen3"])
def test_scan_equals_per_layer_loop(name):
    cfg, _, params = tiny(name)
    cfg = cfg.replace(num_layers=3, attention="reference")
    graphdef, params = F.init_model(cfg, 1)
    tokens, mask = left_padded_batch(cfg.vocab_size, 9, (0, 3))
    scanned = jax.jit(F.forward, static_argnums=0, static_argnames="recipe")
    np.testing.assert_allclose(
        np.asarray(scanned(graphdef, params, tokens, mask, recipe=fp8.BF16)),
        np.asarray(unrolled_logits(graphdef, params, tokens, mask)),
        atol=1e-6,
        rtol=0,
    )
    real = mask.astype(jnp.float32)[..., None]

    def loss_scan(p):
        return jnp.sum(F.forward(graphdef, p, tokens, mask, recipe=fp8.BF16) ** 2 * real) * 1e-3

    def loss_loop(p):
        return jnp.sum(unrolled_logits(graphdef, p, tokens, mask) ** 2 * real) * 1e-3

    g_scan = jax.jit(jax.grad(loss_scan))(params)
    g_loop = jax.jit(jax.grad(loss_loop))(params)
    chex.assert_trees_all_close(g_scan, g_loop, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["tiny_qwen2", "tiny_qwen3"])
@pytest.mark.parametrize("f32", [True, False])
def test_params_held_per_layer_give_the_scanned_numbers(name, f32):
    """`unstack_layers` params run the layers unrolled: the same logits as the layer scan bit
    for bit, in f32 and in bf16 compute (where XLA's excess precision would differ if a fusion
    spanned two layers), under the unquantized and the FP8 block recipe; the layer scan is gone."""
    cfg, graphdef, params = tiny(name, f32=f32)
    per_layer = unstack_layers(params)
    kernel = per_layer["model"]["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
    assert isinstance(kernel, PerLayer) and len(kernel.slices) == cfg.num_layers
    np.testing.assert_array_equal(
        kernel.slices[1], params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][1]
    )
    assert unstack_layers(per_layer) is not per_layer  # idempotent: a copy, the same leaves
    chex.assert_trees_all_equal(unstack_layers(per_layer), per_layer)
    tokens, mask = left_padded_batch(cfg.vocab_size, 9, (0, 3))
    forward = jax.jit(F.forward, static_argnums=0, static_argnames="recipe")
    for recipe in (fp8.BF16, fp8.FP8_BLOCK):
        np.testing.assert_array_equal(
            np.asarray(forward(graphdef, per_layer, tokens, mask, recipe=recipe)),
            np.asarray(forward(graphdef, params, tokens, mask, recipe=recipe)),
        )
    jaxpr = jax.make_jaxpr(lambda p: F.forward(graphdef, p, tokens, mask, recipe=fp8.BF16))

    def dots_outside_loops(j) -> int:
        """dot_generals in `j` and its nested calls (custom-gradient rules, jits), not in a
        scan's or while loop's body."""
        n = 0
        for e in j.eqns:
            n += e.primitive.name == "dot_general"
            if e.primitive.name in ("scan", "while"):
                continue
            for v in e.params.values():
                sub = getattr(v, "jaxpr", v)
                n += dots_outside_loops(sub) if hasattr(sub, "eqns") else 0
        return n

    def top_level_dots(p) -> int:  # GEMMs outside any loop: the layers' only when unrolled
        return dots_outside_loops(jaxpr(p).jaxpr)

    assert top_level_dots(params) < 7 <= 7 * cfg.num_layers <= top_level_dots(per_layer)


def test_a_mix_of_stacked_and_per_layer_leaves_is_refused():
    cfg, _, params = tiny("tiny_qwen3")
    layers = unstack_layers(params)["model"]["layers"]
    layers["mlp"]["up_proj"]["kernel"] = params["model"]["layers"]["mlp"]["up_proj"]["kernel"]
    with pytest.raises(ValueError, match="not a mix"):
        per_layer_params(layers, cfg.num_layers)


def test_layers_are_stacked_and_distinct():
    cfg, _, params = tiny("tiny_qwen3")
    q = np.asarray(params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][...])
    assert q.shape == (cfg.num_layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    assert not np.array_equal(q[0], q[1])  # each layer has its own random init


@pytest.mark.parametrize("policy", ["full", "save_dots"])
def test_remat_policies_give_the_same_loss_and_gradients(policy):
    cfg, graphdef, params = tiny("tiny_qwen3")
    graphdef_remat, _ = F.abstract_model(cfg.replace(remat=policy))
    tokens, mask = left_padded_batch(cfg.vocab_size, 9, (0, 2))

    def loss(p, g):
        return F.token_logprobs(g, p, tokens, mask, recipe=fp8.BF16, chunk_size=4).sum()

    def n_remat(g) -> int:
        jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, g).jaxpr
        return sum(e.primitive.name in ("remat2", "checkpoint", "remat") for e in all_eqns(jaxpr))

    # The logprob chunks carry one checkpoint of their own; the layer scan adds one (not L).
    assert n_remat(graphdef_remat) == n_remat(graphdef) + 1
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    l0, g0 = grad(params, graphdef)
    l1, g1 = grad(params, graphdef_remat)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    chex.assert_trees_all_close(g1, g0, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_materialized_cotangent_leaves_loss_and_gradients(monkeypatch, recipe):
    """The SwiGLU cotangent barrier (`layers.materialized_cotangent`) only changes how XLA fuses
    the backward: the loss and every gradient equal the plain identity's bit for bit, and its
    jaxpr holds one optimisation barrier per projection (gate and up)."""
    from models import layers

    cfg, graphdef, params = tiny("tiny_qwen3")
    tokens, mask = left_padded_batch(cfg.vocab_size, 9, (0, 2))
    rec = fp8.get_recipe(recipe)

    def loss(p):
        return F.token_logprobs(graphdef, p, tokens, mask, recipe=rec, chunk_size=4).sum()

    def barriers() -> int:
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
        return sum(e.primitive.name == "optimization_barrier" for e in all_eqns(jaxpr))

    with_barrier, n_with = jax.jit(jax.value_and_grad(loss))(params), barriers()
    monkeypatch.setattr(layers, "materialized_cotangent", lambda x: x)
    plain, n_plain = jax.jit(jax.value_and_grad(loss))(params), barriers()
    assert n_with == n_plain + 2
    assert float(with_barrier[0]) == float(plain[0])
    chex.assert_trees_all_equal(with_barrier[1], plain[1])


def test_remat_must_be_a_policy_name():
    with pytest.raises(ValueError, match="remat=True.*'none', 'full', 'save_dots'"):
        get_config("tiny_qwen3", remat=True)


def _compiled_grad(num_layers: int) -> tuple[int, float]:
    """(HLO text size, compile seconds) of value_and_grad of the logprobs of a 128-wide model."""
    cfg = get_config("tiny_qwen3", num_layers=num_layers, compute_dtype=jnp.float32)
    graphdef, params = F.abstract_model(cfg)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def loss(p, tok):
        return F.token_logprobs(graphdef, p, tok, jnp.ones_like(tok), recipe=fp8.BF16).sum()

    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, tokens)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    return len(compiled.as_text()), time.perf_counter() - t0


def test_program_size_does_not_grow_with_depth():
    size_2, _ = _compiled_grad(2)
    size_24, _ = _compiled_grad(24)
    # Only the stacked shapes' text changes (e.g. f32[2,...] vs f32[24,...]).
    assert size_24 < 1.05 * size_2, (size_2, size_24)
