"""The Mixture-of-Experts feed-forward block of Qwen3-MoE (and Mixtral / OLMoE-style top-k
models): a softmax router, the top-k experts per token, SwiGLU experts run as grouped GEMMs.

    probs  = softmax(x . W_router)                      f32, never FP8 (as the field keeps it)
    top-k  = the k most probable experts per token; their weights are the probs, divided by
             their sum when `norm_topk_prob` (Qwen3-MoE: true, Mixtral-style)
    y      = sum over the k experts e of weight_e * down_e(silu(gate_e(x)) * up_e(x))

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

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from models.expert_parallel import sharded_experts
from models.fp8 import Recipe, grouped_dot


def route(
    x: Float[Array, "N D"],
    router: Float[Array, "D E"],
    top_k: int,
    norm_topk_prob: bool,
    routing: Int[Array, "N k"] | None = None,
) -> tuple[Float[Array, "N k"], Int[Array, "N k"], Int[Array, "N k"]]:
    """(weights, experts used, the router's own top-k) of each token, in f32; `routing`
    replays given experts (then the experts used are those, the router's own pick is returned
    beside them for comparison)."""
    logits = jnp.matmul(
        x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    probs = jax.nn.softmax(logits, axis=-1)
    weights, own = jax.lax.top_k(probs, top_k)
    experts = own
    if routing is not None:
        # A token whose recorded choice is unknown (any entry < 0: a pad, or the last token of
        # a sample, which the rollout never fed) keeps the router's own.
        replay = jnp.all(routing >= 0, axis=-1, keepdims=True)
        experts = jnp.where(replay, routing.astype(jnp.int32), own)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts, own


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
    shape, d = x.shape, x.shape[-1]
    xf = x.reshape(-1, d)
    n, experts_total = xf.shape[0], router.shape[-1]
    weights, experts, own = route(xf, router, top_k, norm_topk_prob, routing)
    # Under a mesh whose batch axes split the tokens: the experts over the devices.
    y = sharded_experts(xf, weights, experts, w_gate, w_up, w_down, recipe=recipe)
    if y is not None:
        return y.astype(x.dtype).reshape(shape), own
    flat = experts.reshape(-1)  # pair p = (token p // k, its (p % k)-th expert)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=experts_total)
    rows = xf[order // top_k]
    h = jax.nn.silu(grouped_dot(rows, w_gate, sizes, recipe)) * grouped_dot(
        rows, w_up, sizes, recipe
    )
    out = grouped_dot(h, w_down, sizes, recipe)
    pairs = jnp.zeros_like(out).at[order].set(out).reshape(n, top_k, d)
    y = jnp.sum(pairs.astype(jnp.float32) * weights[..., None], axis=1)
    return y.astype(x.dtype).reshape(shape), own
