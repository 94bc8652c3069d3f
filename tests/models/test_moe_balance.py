"""The MoE load-balancing loss (`models.moe.router_load` + `load_balancing_loss`) against two
references: the Switch / Qwen3-MoE formula written out in float64 numpy one (layer, token) at
a time, and transformers' own `load_balancing_loss_func` (Qwen3-MoE) with an attention mask,
its value and its gradient with respect to the router logits (golden
`tests/models/golden/load_balancing.npz`, made by `scripts/make_model_golden.py`, and live in
the vLLM venv). Also: with routing replay the expert shares count the replayed experts, and
the decoder's per-layer loads (`Decoder.hidden_states_and_load`) equal the formula on each
layer's router logits taken from a layer-by-layer run of the same model.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import left_padded_batch, tiny
from flax import nnx

from models import fp8
from models import functional as F
from models.moe import RouterLoad, load_balancing_loss, route, router_load
from models.rope import rope_cos_sin, rope_inv_freq

GOLDEN = Path(__file__).parent / "golden" / "load_balancing.npz"


def reference64(logits: np.ndarray, mask: np.ndarray, top_k: int, experts=None) -> float:
    """E * sum_e f_e P_e over the (layer, token) pairs with mask 1, float64: f_e the share of
    the pairs whose top-k (or given `experts`) hold e, P_e the mean softmax probability of e."""
    num_layers, n, e = logits.shape
    valid = mask.reshape(-1).astype(bool)
    routed, probs, count = np.zeros(e), np.zeros(e), 0
    for layer in range(num_layers):
        for t in range(n):
            if not valid[t]:
                continue
            z = logits[layer, t].astype(np.float64)
            p = np.exp(z - z.max())
            p /= p.sum()
            chosen = np.argsort(-p, kind="stable")[:top_k] if experts is None else experts[layer, t]
            routed[list(chosen)] += 1
            probs += p
            count += 1
    return float(e * np.sum(routed / count * probs / count))


def ours(logits, mask, top_k: int, routing=None):
    """The loss from our router (`route` on logits given as x, with the identity router) and
    the per-layer loads."""

    def one_layer(z, replay):
        eye = jnp.eye(z.shape[-1], dtype=jnp.float32)
        _, experts, _, probs = route(z, eye, top_k, True, replay)
        return router_load(probs, experts, jnp.asarray(mask).reshape(-1) != 0)

    replay = [None] * logits.shape[0] if routing is None else list(jnp.asarray(routing))
    loads = [one_layer(z, r) for z, r in zip(jnp.asarray(logits), replay, strict=True)]
    return load_balancing_loss(jax.tree.map(lambda *a: jnp.stack(a), *loads))


# Jitted (top_k static): the loss and its gradient with respect to the logits.
ours_jit = jax.jit(ours, static_argnums=2)
value_and_grad = jax.jit(jax.value_and_grad(ours), static_argnums=2)


def random_case(seed: int, layers=2, b=2, t=9, e=6):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((layers, b * t, e)).astype(np.float32)
    logits[..., 1] += 0.8
    _, mask = left_padded_batch(10, t, (0, 4)[:b], seed)
    return logits, np.asarray(mask)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_equals_float64_formula(top_k):
    logits, mask = random_case(top_k)
    got = float(ours_jit(logits, mask, top_k))
    assert abs(got - reference64(logits, mask, top_k)) < 1e-6


def test_balanced_router_gives_top_k_and_no_tokens_give_zero():
    e, k = 4, 2
    # Uniform probabilities, each expert in the top-2 of half of the tokens.
    load = RouterLoad(jnp.full((1, e), 2.0), jnp.full((1, e), 4.0), jnp.full((1,), 8.0))
    assert float(load_balancing_loss(load)) == pytest.approx(k)
    empty = RouterLoad(jnp.zeros((2, e)), jnp.zeros((2, e)), jnp.zeros((2,)))
    assert float(load_balancing_loss(empty)) == 0.0


def test_value_and_gradient_equal_transformers_golden():
    gold = np.load(GOLDEN)
    logits, mask, k = gold["gate_logits"], gold["mask"], int(gold["top_k"])
    loss, grad = value_and_grad(jnp.asarray(logits), mask, k)
    assert abs(float(loss) - float(gold["loss"])) < 1e-6 * float(gold["loss"])
    assert abs(float(loss) - reference64(logits, mask, k)) < 1e-6
    # The gradient flows through the probabilities only, as in transformers (its top-k
    # indices carry none); pads get none.
    g = np.asarray(grad)
    assert np.abs(g - gold["grad"]).max() < 1e-5 * np.abs(gold["grad"]).max()
    assert np.all(g[:, mask.reshape(-1) == 0] == 0)


@pytest.mark.vllm
def test_value_and_gradient_equal_transformers_live(transformers_ref):
    logits, mask = random_case(5, layers=4, b=2, t=6, e=16)
    _, out = transformers_ref(
        "load_balancing", arrays={"gate_logits": logits, "mask": mask}, num_experts=16, top_k=4
    )
    loss, grad = value_and_grad(jnp.asarray(logits), mask, 4)
    assert abs(float(loss) - float(out["loss"])) < 1e-6 * float(out["loss"])
    assert np.abs(np.asarray(grad) - out["grad"]).max() < 1e-5 * np.abs(out["grad"]).max()


def test_replayed_experts_are_the_ones_counted():
    logits, mask = random_case(7)
    rng = np.random.default_rng(0)
    replay = np.stack([rng.permutation(6)[:2] for _ in range(2 * 18)]).reshape(2, 18, 2)
    replay[0, 3] = -1  # an unknown record: the router's own choice stands
    own = np.argsort(-logits, axis=-1, kind="stable")[..., :2]
    counted = np.where(np.all(replay >= 0, axis=-1, keepdims=True), replay, own)
    got = float(ours_jit(logits, mask, 2, replay))
    assert abs(got - reference64(logits, mask, 2, counted)) < 1e-6
    assert abs(got - reference64(logits, mask, 2)) > 1e-3  # the replay changed the shares


def test_decoder_loads_equal_the_formula_on_each_layers_router_logits():
    cfg, graphdef, params = tiny("tiny_qwen3_moe")
    tokens, mask = left_padded_batch(cfg.vocab_size, 8, (0, 3))

    @jax.jit  # one program: the decoder's loads and a layer-by-layer run of the same modules
    def loads_and_router_inputs(params):
        model = nnx.merge(graphdef, params)
        attend = F.self_attention(cfg, mask)
        dot = F.dot_general_for(cfg, fp8.BF16)
        positions = F.positions_from_mask(mask)
        _, _, _, load = model.hidden_states_and_load(
            tokens, positions, lambda i, q, k, v, c: (attend(i, q, k, v), c), dot,
            load_mask=mask != 0,
        )  # fmt: skip
        # Each layer's router input and router weight, layer by layer.
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg))
        x = model.model.embed_tokens(tokens).astype(cfg.compute_dtype)
        layer_def, layer_params = nnx.split(model.model.layers)
        hs, gates = [], []
        for i in range(cfg.num_layers):
            layer = nnx.merge(layer_def, jax.tree.map(lambda a, i=i: a[i], layer_params))

            def attend_i(q, k, v, c, i=i):
                return attend(i, q, k, v), c

            a, _ = layer.self_attn(layer.input_layernorm(x), cos, sin, attend_i, None, dot)
            hs.append(layer.post_attention_layernorm(x + a).reshape(-1, x.shape[-1]))
            gates.append(layer.mlp.gate.kernel[...])
            x = layer(x, cos, sin, attend_i, None, dot)[0]
        return load, jnp.stack(hs), jnp.stack(gates)

    load, hs, gates = loads_and_router_inputs(params)
    # Each layer's router logits in float64.
    logits = np.asarray(hs, np.float64) @ np.asarray(gates, np.float64)
    ref = reference64(logits, np.asarray(mask), cfg.num_experts_per_tok)
    assert load.probs.shape == (cfg.num_layers, cfg.num_experts)
    np.testing.assert_array_equal(np.asarray(load.tokens), np.full(cfg.num_layers, 13.0))
    assert abs(float(load_balancing_loss(load)) - ref) < 1e-5
