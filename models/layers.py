"""The layers a decoder block is built from: `Linear` (the recipe's `dot_general`), `RMSNorm`,
the SwiGLU `MLP` and the Mixture-of-Experts `SparseMoE` (its `Experts` and f32 router), as Flax
NNX modules whose attribute names follow the HF checkpoints (`models.hf_state`'s name map).
The model assembles them in `models.decoder`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from models import invariant
from models.config import ModelConfig
from models.moe import RouterLoad, mix_experts, route, router_load, router_logits

DotGeneral = Callable[..., Array]


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> Array:
    # HF's `initializer_range` default: N(0, 0.02).
    return (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = dot_general(x, W) + b with W stored [in, out] (HF stores [out, in]).

    x is cast to `compute_dtype`; W is passed as the f32 master. An FP8 recipe quantizes the
    master directly (the same Q(W) the weight export sends to the rollout server), while the
    unquantized recipe casts W to x's dtype (`fp8.make_dot_general`). The product accumulates
    in f32 and is cast back.
    """

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, cfg: ModelConfig, rngs: nnx.Rngs
    ):
        self.kernel = nnx.Param(normal_init(rngs, (in_features, out_features), cfg.param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), cfg.param_dtype)) if bias else None
        self.compute_dtype = cfg.compute_dtype

    def __call__(self, x: Float[Array, "... I"], dot_general: DotGeneral) -> Float[Array, "... O"]:
        dt = self.compute_dtype
        y = dot_general(
            x.astype(dt),
            self.kernel[...],
            (((x.ndim - 1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(dt)


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps), the mean over the last axis, computed in f32."""

    def __init__(self, dim: int, *, cfg: ModelConfig):
        self.weight = nnx.Param(jnp.ones((dim,), cfg.param_dtype))
        self.eps = cfg.rms_norm_eps
        self.compute_dtype = cfg.compute_dtype
        self.batch_invariant = cfg.batch_invariant

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        xf = x.astype(jnp.float32)
        if self.batch_invariant:  # a fixed order of the sum, no contraction (models.invariant)
            sum_sq = invariant.tree_sum(invariant.exact_mul(xf, xf), keepdims=True)
            mean_sq = invariant.exact_mul(sum_sq, np.float32(1.0 / x.shape[-1]))
        else:
            mean_sq = jnp.mean(xf * xf, axis=-1, keepdims=True)
        xf = xf * jax.lax.rsqrt(mean_sq + self.eps)
        # HF casts the normalised value to the input dtype before the weight multiply.
        return self.weight[...].astype(self.compute_dtype) * xf.astype(self.compute_dtype)


@jax.custom_vjp
def materialized_cotangent(x: Array) -> Array:
    """The identity, whose cotangent is materialised (an optimisation barrier) before it reaches
    the GEMMs that consume it. The weight gradient of `x = dot(h, W)` is a GEMM over the
    tokens, for which XLA:CPU lays the cotangent out transposed; left free, it fuses the
    elementwise math that produces the cotangent (SwiGLU's backward reads four [T, F] arrays)
    into that transposing copy, which then reads every input in strided order (a quarter of
    SmolLM2's forward+backward on CPU). Materialised first, the math runs in row order and the
    transpose is one plain copy. Values are unchanged: the same operations, another fusion."""
    return x


def _materialized_fwd(x: Array) -> tuple[Array, None]:
    return x, None


def _materialized_bwd(_: None, g: Array) -> tuple[Array]:
    return (jax.lax.optimization_barrier(g),)


materialized_cotangent.defvjp(_materialized_fwd, _materialized_bwd)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the gate and up projections' cotangents are
    materialised before their GEMMs (`materialized_cotangent`). `width`: the hidden width
    (default `cfg.intermediate_size`; a Qwen2-MoE shared expert's is its own)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, width: int | None = None):
        d, f = cfg.hidden_size, width or cfg.intermediate_size
        self.gate_proj = Linear(d, f, bias=False, cfg=cfg, rngs=rngs)
        self.up_proj = Linear(d, f, bias=False, cfg=cfg, rngs=rngs)
        self.down_proj = Linear(f, d, bias=False, cfg=cfg, rngs=rngs)

    def __call__(self, x: Float[Array, "B T D"], dot_general: DotGeneral) -> Float[Array, "B T D"]:
        gate = materialized_cotangent(self.gate_proj(x, dot_general))
        up = materialized_cotangent(self.up_proj(x, dot_general))
        h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
        return self.down_proj(h, dot_general)


class Experts(nnx.Module):
    """An MoE layer's SwiGLU experts, stacked on a leading expert axis: `gate_proj` and
    `up_proj` [E, D, I], `down_proj` [E, I, D] (HF: one [out, in] tensor per expert,
    `mlp.experts.{e}.{gate,up,down}_proj.weight`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.gate_proj = nnx.Param(normal_init(rngs, (e, d, f), cfg.param_dtype))
        self.up_proj = nnx.Param(normal_init(rngs, (e, d, f), cfg.param_dtype))
        self.down_proj = nnx.Param(normal_init(rngs, (e, f, d), cfg.param_dtype))


class SparseMoE(nnx.Module):
    """An MoE layer's sparse MLP (`models.moe`): the router `gate` (kernel [D, E], run in f32,
    never FP8) and the experts, run as the recipe's grouped GEMMs; with
    `cfg.shared_expert_intermediate_size` (Qwen2-MoE) also a `shared_expert` SwiGLU that every
    token goes through, its GEMMs the recipe's as a dense MLP's, scaled by
    sigmoid(x . shared_expert_gate) (kernel [D, 1], f32 like the router) and added."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, shared = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.gate = Linear(d, cfg.num_experts, bias=False, cfg=cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)
        self.shared_expert = MLP(cfg, rngs=rngs, width=shared) if shared else None
        self.shared_expert_gate = Linear(d, 1, bias=False, cfg=cfg, rngs=rngs) if shared else None
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.batch_invariant = cfg.batch_invariant

    def __call__(
        self,
        x: Float[Array, "B T D"],
        dot_general: DotGeneral,
        routing: Int[Array, "B T k"] | None = None,
        load_mask: Bool[Array, "B T"] | None = None,
    ) -> tuple[Float[Array, "B T D"], Int[Array, "B T k"], RouterLoad | None]:
        """The block's output, each token's experts as the router picked them (`routing`:
        experts to replay instead) and, with `load_mask`, the layer's `RouterLoad` over the
        tokens it marks (for the load-balancing loss; None without)."""
        recipe = getattr(dot_general, "recipe", None)
        if recipe is None:
            raise TypeError(
                "an MoE layer needs the recipe's GEMMs as a models.fp8.RecipeDot "
                "(models.functional.dot_general_for), not a bare dot_general"
            )
        e, k, exact = self.experts, self.top_k, self.batch_invariant
        xf = x.reshape(-1, x.shape[-1])
        weights, experts, own, probs = route(
            xf, self.gate.kernel[...], k, self.norm_topk_prob,
            None if routing is None else routing.reshape(-1, k), exact=exact,
        )  # fmt: skip
        y = mix_experts(
            xf, weights, experts, e.gate_proj[...], e.up_proj[...], e.down_proj[...],
            recipe=recipe, exact=exact,
        )  # fmt: skip
        if self.shared_expert is not None:
            gate = router_logits(xf, self.shared_expert_gate.kernel[...], exact=exact)
            shared = self.shared_expert(xf, dot_general).astype(jnp.float32)
            mul = invariant.exact_mul if exact else jnp.multiply
            y = y + mul(jax.nn.sigmoid(gate), shared)
        load = None if load_mask is None else router_load(probs, experts, load_mask.reshape(-1))
        return y.astype(x.dtype).reshape(x.shape), own.reshape(*x.shape[:-1], k), load
