"""The Mixture-of-Experts feed-forward block of Qwen3-MoE, Qwen2-MoE and Mixtral: a softmax
router, the top-k experts per token, SwiGLU experts run as grouped GEMMs.

    probs  = softmax(x . W_router)                      f32, never FP8 (as the field keeps it)
    top-k  = the k most probable experts per token; their weights are the probs, divided by
             their sum when `norm_topk_prob` (Qwen3-MoE checkpoints and Mixtral: true;
             Qwen2-MoE: false)
    y      = sum over the k experts e of weight_e * down_e(silu(gate_e(x)) * up_e(x))
    (Qwen2-MoE adds sigmoid(x . w_shared_gate) * shared_expert(x), `models.layers.SparseMoE`)

Every (token, expert) pair is one row of the grouped GEMMs: the rows are sorted by expert (a
stable sort, so an expert's rows keep token order), run through `models.fp8.grouped_dot` under
the recipe (each expert's GEMMs quantized as its own dense GEMM would be), and scattered back.
Dropless: every routed pair is computed, whatever the load, so no capacity factor decides
which tokens lose their expert (the grouped GEMM takes any group sizes).

`routing`: the experts to use instead of the router's choice, [N, k] (routing replay: the
rollout's choices replayed in the trainer); a token with a negative entry keeps the router's
own choice. The weights are still the router's probabilities of the experts used, so gradients
reach the router through the gates of the replayed experts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from models import invariant
from models.expert_parallel import sharded_experts
from models.fp8 import Recipe, grouped_dot


def router_logits(
    x: Float[Array, "N D"], w: Float[Array, "D E"], *, exact: bool = False
) -> Float[Array, "N E"]:
    """x . w in f32 at full precision: a router's logits (never FP8, as the field keeps them).
    `exact`: batch-invariant, the rows padded to `models.invariant.MIN_ROWS` (its rule 1)."""
    rows, m = invariant.pad_rows(x, invariant.MIN_ROWS if exact else 1)
    y = jnp.matmul(
        rows.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return y[:m]


def route(
    x: Float[Array, "N D"],
    router: Float[Array, "D E"],
    top_k: int,
    norm_topk_prob: bool,
    routing: Int[Array, "N k"] | None = None,
    *,
    exact: bool = False,
) -> tuple[Float[Array, "N k"], Int[Array, "N k"], Int[Array, "N k"], Float[Array, "N E"]]:
    """(weights, experts used, the router's own top-k, the router's probabilities) of each
    token, in f32; `routing` replays given experts (then the experts used are those, the
    router's own pick is returned beside them for comparison). `exact`: batch-invariant
    (`models.invariant`: padded logit rows, the softmax's and top-k's sums by `tree_sum`)."""
    logits = router_logits(x, router, exact=exact)
    probs = jnp.exp(invariant.log_softmax(logits)) if exact else jax.nn.softmax(logits, axis=-1)
    weights, own = jax.lax.top_k(probs, top_k)
    experts = own
    if routing is not None:
        # A token whose recorded choice is unknown (any entry < 0: a pad, or the last token of
        # a sample, which the rollout never fed) keeps the router's own.
        replay = jnp.all(routing >= 0, axis=-1, keepdims=True)
        experts = jnp.where(replay, routing.astype(jnp.int32), own)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        total = (
            invariant.tree_sum(weights, keepdims=True)
            if exact
            else jnp.sum(weights, axis=-1, keepdims=True)
        )
        weights = weights / total
    return weights, experts, own, probs


class RouterLoad(NamedTuple):
    """One MoE layer's load over the tokens it counts (`router_load`), or L layers' stacked."""

    probs: Float[Array, "... E"]  # sum over the tokens of the router's probabilities
    routed: Float[Array, "... E"]  # how many of the tokens were routed to each expert
    tokens: Float[Array, "..."]  # how many tokens were counted


def router_load(
    probs: Float[Array, "N E"], experts: Int[Array, "N k"], valid: Bool[Array, " N"]
) -> RouterLoad:
    """The load of one layer over the `valid` tokens: the sums of their router probabilities
    (the gradient flows here) and the count of them routed to each expert (`experts`: the
    experts used, so with routing replay the replayed ones; no gradient)."""
    w = valid.astype(jnp.float32)
    routed = (
        jnp.zeros(probs.shape[-1], jnp.float32)
        .at[experts.reshape(-1)]
        .add(jnp.repeat(w, experts.shape[-1]))
    )
    return RouterLoad(jnp.sum(probs * w[:, None], axis=0), routed, jnp.sum(w))


def load_balancing_loss(load: RouterLoad) -> Float[Array, ""]:
    """The Switch / Qwen3-MoE load-balancing loss of L layers' loads ([L, E] sums):

        E * sum_e f_e * P_e,  f_e = routed_e / (L n),  P_e = probs_e / (L n)

    summed over the layers, n the tokens counted per layer: f_e is the share of the (layer,
    token) pairs that expert e serves (the f_e sum to k) and P_e its mean router probability,
    the layers pooled, as transformers' `load_balancing_loss_func` computes it with an
    attention mask. A balanced router gives k (every f_e = k / E, P_e = 1 / E); 0 when nothing
    was counted. The gradient reaches the router through P only: which experts serve a
    token is a discrete choice, so f is a constant of the loss."""
    total = jnp.maximum(jnp.sum(load.tokens), 1.0)
    f = jax.lax.stop_gradient(jnp.sum(load.routed, axis=0)) / total
    p = jnp.sum(load.probs, axis=0) / total
    return load.probs.shape[-1] * jnp.sum(f * p)


def moe_block(
    x: Float[Array, "... D"],
    router: Float[Array, "D E"],
    w_gate: Float[Array, "E D I"],
    w_up: Float[Array, "E D I"],
    w_down: Float[Array, "E I D"],
    *,
    top_k: int,
    norm_topk_prob: bool,
    recipe: Recipe,
    routing: Int[Array, "N k"] | None = None,
) -> tuple[Float[Array, "... D"], Int[Array, "N k"]]:
    """The block's output (x's shape and dtype) and the experts the router picked for each of
    the N = prod(x.shape[:-1]) tokens (what routing replay records; with `routing` given, the
    router's own pick, which may differ from the replayed experts the output used)."""
    xf = x.reshape(-1, x.shape[-1])
    weights, experts, own, _ = route(xf, router, top_k, norm_topk_prob, routing)
    y = mix_experts(xf, weights, experts, w_gate, w_up, w_down, recipe=recipe)
    return y.astype(x.dtype).reshape(x.shape), own


def mix_experts(
    xf: Float[Array, "N D"],
    weights: Float[Array, "N k"],
    experts: Int[Array, "N k"],
    w_gate: Float[Array, "E D I"],
    w_up: Float[Array, "E D I"],
    w_down: Float[Array, "E I D"],
    *,
    recipe: Recipe,
    exact: bool = False,
) -> Float[Array, "N D"]:
    """sum over each token's k experts of weight * SwiGLU expert(x), in f32 (module doc).
    `exact`: batch-invariant (`models.invariant`): the grouped GEMMs run on at least
    `MIN_ROWS` rows (zero rows past the groups), the k weighted outputs are summed by
    `tree_sum` of exact products. Not under expert parallelism, whose exchange sums in another
    order (`rollout.on_policy: exact` refuses an expert axis)."""
    if not exact:  # Under a mesh whose batch axes split the tokens: the experts over the devices.
        y = sharded_experts(xf, weights, experts, w_gate, w_up, w_down, recipe=recipe)
        if y is not None:
            return y
    (n, d), top_k = xf.shape, experts.shape[-1]
    flat = experts.reshape(-1)  # pair p = (token p // k, its (p % k)-th expert)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w_gate.shape[0])
    rows, m = invariant.pad_rows(xf[order // top_k], invariant.MIN_ROWS if exact else 1)
    h = jax.nn.silu(grouped_dot(rows, w_gate, sizes, recipe)) * grouped_dot(
        rows, w_up, sizes, recipe
    )
    out = grouped_dot(h, w_down, sizes, recipe)[:m]
    pairs = jnp.zeros_like(out).at[order].set(out).reshape(n, top_k, d).astype(jnp.float32)
    if exact:
        return invariant.tree_sum(invariant.exact_mul(pairs, weights[..., None]), axis=1)
    return jnp.sum(pairs * weights[..., None], axis=1)
