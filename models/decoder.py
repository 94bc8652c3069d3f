"""The decoder-only transformer (Qwen2/Qwen2.5, Qwen3, Llama 3 and the Mixture-of-Experts
Qwen3-MoE, Qwen2-MoE and Mixtral) as Flax NNX modules.

Module attribute names follow the HF checkpoints, so the name map in `hf_state.py` is a plain
table. The decoder layers are *stacked*: `model.layers` is one `DecoderLayer` whose params carry
a leading layer axis [L, ...] (`model.layers.self_attn.q_proj.kernel[i]` <->
`model.layers.{i}.self_attn.q_proj.weight`), and `Decoder.hidden_states` applies them with one
`jax.lax.scan`, so the program size and compile time do not grow with depth (MaxText's
`scan_layers`). The modules are used functionally (`models.functional`): split once, merged
inside jit. A Mixture-of-Experts model with dense layers among its MoE layers keeps its two
kinds of MLP in two stacks of their own (`stacked_layers`), each layer picking its slice.

Params may also hold the layers *per layer* (`unstack_layers`: each stacked leaf as a
`PerLayer` of its L slices), as the rollout engine installs them; `hidden_states` then runs the
layers as L unrolled calls on those slices. A scan reads layer i's weights through a
`dynamic_slice` of the stacked arrays, which XLA:CPU copies out before every GEMM: at every
decode step, every weight once more. Unrolled, each GEMM reads its weights in place; the
numbers are the same bit for bit (tested), the program is L layers long (compile time grows
with depth).

Precision: params are `cfg.param_dtype` (f32 masters). Activations run in `cfg.compute_dtype`.
Every attention/MLP projection calls the `dot_general` passed at call time (the recipe's FP8 or
plain one, `models.fp8.RecipeDot`), so the same params run under any recipe; Mixture-of-Experts
layers run their experts through its `grouped` GEMM and keep their router in f32. Embedding
lookup, RMSNorm (f32 inside), attention scores + softmax (f32) and the LM head (f32
accumulation, f32 logits) stay high precision, as in DeepSeek-V3's FP8 recipe. The linear,
norm, MLP and MoE layers themselves are in `models.layers`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from models import fp8
from models.config import ModelConfig, RematPolicy
from models.layers import MLP, DotGeneral, Linear, RMSNorm, SparseMoE, normal_init
from models.moe import RouterLoad
from models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from models.sharding import constrain_batch

# The layer body's `jax.checkpoint` policy: "full" saves nothing (recomputes the whole layer in
# the backward pass: activation memory ~ one layer), "save_dots" keeps the matmul outputs that
# have no batch dims (recomputes norms, RoPE, softmax, SwiGLU; MaxText's default style).
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
# attend(q [B,T,H,E], k [B,T,K,E], v [B,T,K,E], carry) -> (output [B,T,H,E], carry): one layer's
# attention; `carry` is threaded through the layer scan (the KV cache when decoding, else None).
Attend = Callable[[Array, Array, Array, Any], tuple[Array, Any]]
# attend_at(layer_index, q, k, v, carry): the same with the layer index (a traced int32 in the
# layer scan, a Python int when the layers run unrolled).
AttendAt = Callable[[Array, Array, Array, Array, Any], tuple[Array, Any]]


@functools.partial(jax.tree_util.register_dataclass, data_fields=("slices",), meta_fields=())
@dataclasses.dataclass(frozen=True)
class PerLayer:
    """A stacked layer param [L, ...] held as its L slices (`unstack_layers`)."""

    slices: tuple[Any, ...]

    @classmethod
    def of(cls, stacked: Any) -> PerLayer:
        """The L slices of `stacked` [L, ...]: an array, or a pytree of them (e.g. a
        `models.fp8.StoredFP8Weight`) sliced leaf by leaf."""
        return cls(tuple(layer_slices(stacked)))


def layer_slices(stacked: Any) -> Iterator[Any]:
    """Slice i of `stacked` [L, ...] (an array or a pytree of them, sliced leaf by leaf) for
    i = 0..L-1, one at a time."""
    for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        yield jax.tree.map(lambda x, i=i: x[i], stacked)


def _is_per_layer(x: object) -> bool:
    return isinstance(x, PerLayer)


def unstack_layers(params: nnx.State) -> nnx.State:
    """`params` with every leaf of the stacked decoder layers (`model.layers`) replaced by a
    `PerLayer` of its L slices (module docstring): the same values, for a forward that runs
    the layers unrolled. A leaf that is a pytree (`models.fp8.StoredFP8Weight`) is sliced
    leaf by leaf. Takes a new copy of the slices; the caller may drop the stacked params.
    Params already held per layer are returned as they are."""

    def split(var: nnx.Variable) -> nnx.Variable:
        value = var.get_value()
        return var if _is_per_layer(value) else var.replace(PerLayer.of(value))

    out = jax.tree.map(lambda x: x, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    layers = out["model"]["layers"]
    out["model"]["layers"] = jax.tree.map(
        split, layers, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return out


def per_layer_params(layer_params: nnx.State, num_layers: int) -> list[nnx.State] | None:
    """The L per-layer states of layer params held per layer (`unstack_layers`), or None for
    stacked params; a mix of the two is an error."""
    leaves = jax.tree.leaves(layer_params, is_leaf=_is_per_layer)
    held = [_is_per_layer(x) for x in leaves]
    if not any(held):
        return None
    if not all(held) or any(len(x.slices) != num_layers for x in leaves):
        raise ValueError(
            f"decoder layer params: either every leaf stacked or every leaf a PerLayer of "
            f"{num_layers} slices (models.decoder.unstack_layers), not a mix"
        )
    return [
        jax.tree.map(lambda x, i=i: x.slices[i], layer_params, is_leaf=_is_per_layer)
        for i in range(num_layers)
    ]


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional qkv bias and q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * hd, d, bias=False, cfg=cfg, rngs=rngs)
        self.q_norm = RMSNorm(hd, cfg=cfg) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg=cfg) if cfg.qk_norm else None
        self.exact_rope = cfg.batch_invariant

    def project_qkv(
        self,
        x: Float[Array, "B T D"],
        cos: Float[Array, "B T E"],
        sin: Float[Array, "B T E"],
        dot_general: DotGeneral,
    ) -> tuple[Array, Array, Array]:
        """q [B,T,H,E], k and v [B,T,K,E], with q/k normed (Qwen3) and rotated."""
        b, t, _ = x.shape
        q = self.q_proj(x, dot_general).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x, dot_general).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, dot_general).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = functools.partial(apply_rope, cos=cos, sin=sin, exact=self.exact_rope)
        return rope(q), rope(k), v

    def __call__(
        self,
        x: Float[Array, "B T D"],
        cos: Float[Array, "B T E"],
        sin: Float[Array, "B T E"],
        attend: Attend,
        carry: Any,
        dot_general: DotGeneral,
    ) -> tuple[Float[Array, "B T D"], Any]:
        q, k, v = self.project_qkv(x, cos, sin, dot_general)
        out, carry = attend(q, k, v, carry)
        return self.o_proj(out.reshape(*x.shape[:2], -1), dot_general), carry


class DecoderLayer(nnx.Module):
    """Pre-norm block: x += attn(norm(x)); x += mlp(norm(x)) (residual stream in compute dtype);
    the MLP is a `SparseMoE` in Mixture-of-Experts models (`sparse`: this layer's kind, default
    `cfg.is_moe`). A mixed model's stacked layer also holds `dense_mlp` (`stacked_layers`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, sparse: bool | None = None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg=cfg)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg=cfg)
        sparse = cfg.is_moe if sparse is None else sparse
        self.mlp = SparseMoE(cfg, rngs=rngs) if sparse else MLP(cfg, rngs=rngs)

    def __call__(
        self,
        x: Float[Array, "B T D"],
        cos: Float[Array, "B T E"],
        sin: Float[Array, "B T E"],
        attend: Attend,
        carry: Any,
        dot_general: DotGeneral,
        routing: Int[Array, "B T k"] | None = None,
        load_mask: Bool[Array, "B T"] | None = None,
        mlp_slot: tuple[Any, Any] | None = None,
    ) -> tuple[Float[Array, "B T D"], Any, Int[Array, "B T k"] | None, RouterLoad | None]:
        """(x, carry, the experts each token was routed to, the MoE layer's `RouterLoad` over
        the `load_mask` tokens); the last two None for a dense MLP, the load None without a
        mask. `mlp_slot` = (sparse, slot): in a mixed model, which of the two MLP stacks this
        layer's MLP is in and where (`mixed_mlp`)."""
        a, carry = self.self_attn(self.input_layernorm(x), cos, sin, attend, carry, dot_general)
        x = x + a
        h = self.post_attention_layernorm(x)
        if mlp_slot is not None:
            y, routed, load = self.mixed_mlp(h, dot_general, routing, load_mask, *mlp_slot)
        else:
            y, routed, load = run_mlp(self.mlp, h, dot_general, routing, load_mask)
        return x + y, carry, routed, load

    def mixed_mlp(
        self,
        h: Float[Array, "B T D"],
        dot_general: DotGeneral,
        routing: Int[Array, "B T k"] | None,
        load_mask: Bool[Array, "B T"] | None,
        sparse: bool | Array,
        slot: int | Array,
    ) -> tuple[Float[Array, "B T D"], Array, RouterLoad | None]:
        """One layer's MLP in a mixed model, whose `mlp` holds the MoE blocks of all its sparse
        layers stacked and `dense_mlp` the dense MLPs of the others: slice `slot` of the stack
        `sparse` picks. Traced `sparse` (the layer scan) runs one branch of a `lax.cond`; a
        dense layer returns zero routing and load in the MoE branch's shapes, which the decoder
        drops (`Decoder.hidden_states_and_load`)."""

        def moe(h: Array, slot: Any) -> tuple[Array, Array, RouterLoad | None]:
            return run_mlp(_module_slice(self.mlp, slot), h, dot_general, routing, load_mask)

        shapes = jax.eval_shape(functools.partial(moe, slot=slot), h)  # a Python slot stays one

        def dense(h: Array, slot: Any) -> tuple[Array, Array, RouterLoad | None]:
            y, _, _ = run_mlp(_module_slice(self.dense_mlp, slot), h, dot_general, None, None)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[1:])
            return (y, *zeros)

        if isinstance(sparse, bool):
            return (moe if sparse else dense)(h, slot)
        return jax.lax.cond(sparse, moe, dense, h, slot)


def run_mlp(
    mlp: MLP | SparseMoE,
    h: Float[Array, "B T D"],
    dot_general: DotGeneral,
    routing: Int[Array, "B T k"] | None,
    load_mask: Bool[Array, "B T"] | None,
) -> tuple[Float[Array, "B T D"], Int[Array, "B T k"] | None, RouterLoad | None]:
    """(the MLP's output, the experts each token was routed to, the `RouterLoad`); the last
    two None for a dense MLP."""
    if isinstance(mlp, SparseMoE):
        return mlp(h, dot_general, routing, load_mask)
    return mlp(h, dot_general), None, None


def _module_slice(stacked: nnx.Module, slot: int | Array) -> nnx.Module:
    """Slice `slot` of a module whose params are stacked on a leading axis (held per layer:
    the `PerLayer`'s own slice, `slot` then a Python int), stored FP8 weights expanded."""

    def one(x: Any) -> Any:
        if _is_per_layer(x):
            return x.slices[slot]
        return jax.lax.dynamic_index_in_dim(x, slot, keepdims=False)

    graph, state = nnx.split(stacked)
    return nnx.merge(graph, fp8.dense_weights(jax.tree.map(one, state, is_leaf=_is_per_layer)))


class Embed(nnx.Module):
    """Token embedding table [V, D] (also the LM head when tied)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embedding = nnx.Param(
            normal_init(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.param_dtype)
        )

    def __call__(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        # "clip": an out-of-range pad id (e.g. -1) must not become NaN ("fill" mode) and leak
        # into real tokens through 0 * NaN in the attention of masked keys.
        return jnp.take(self.embedding[...], tokens, axis=0, mode="clip")


def stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """One `DecoderLayer` whose params are the L layers' params stacked on a leading axis.

    In a mixed model (`cfg.is_mixed`: dense and MoE layers) the attention and norms are stacked
    over all L layers, `mlp` over the MoE layers only and `dense_mlp` over the dense ones, in
    layer order (`cfg.sparse_layers`).

    Built as L separate layers and stacked, so the random stream (and so `init_model(cfg, seed)`)
    is the same as that of L unstacked layers; under `nnx.eval_shape` nothing is allocated.
    """
    kinds = cfg.sparse_layers
    layers = [DecoderLayer(cfg, rngs=rngs, sparse=k) for k in kinds]
    states = [nnx.state(layer) for layer in layers]

    def stack(trees: list[Any]) -> Any:
        return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)

    if not cfg.is_mixed:
        nnx.update(layers[0], stack(states))
        return layers[0]
    first = layers[kinds.index(True)]
    first.dense_mlp = layers[kinds.index(False)].mlp
    stacked = {k: stack([s[k] for s in states]) for k in states[0] if k != "mlp"}
    stacked["mlp"] = stack([s["mlp"] for s, k in zip(states, kinds, strict=True) if k])
    stacked["dense_mlp"] = stack([s["mlp"] for s, k in zip(states, kinds, strict=True) if not k])
    nnx.update(first, nnx.State(stacked))
    return first


class Backbone(nnx.Module):
    """Embedding, the stacked decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embed_tokens = Embed(cfg, rngs=rngs)
        self.layers = stacked_layers(cfg, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg=cfg)


class Decoder(nnx.Module):
    """The causal LM: `model` (backbone) and, when untied, `lm_head` (kernel [D, V])."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = Backbone(cfg, rngs=rngs)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Param(normal_init(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.param_dtype))
        )

    def head_kernel(self) -> Float[Array, "D V"]:
        """The LM head as [D, V] in compute dtype (the embedding transposed when tied)."""
        w = self.model.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head[...]
        return w.astype(self.cfg.compute_dtype)

    def hidden_states(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        attend_at: AttendAt,
        dot_general: DotGeneral,
        *,
        carry: Any = None,
        remat: RematPolicy = "none",
        routing: Int[Array, "L B T k"] | None = None,
    ) -> tuple[Float[Array, "B T D"], Any, Int[Array, "L B T k"] | None]:
        """Final-normed hidden states (compute dtype), the final `carry`, and in an MoE model
        the experts every MoE layer routed each token to ([L_moe, B, T, k]; None for dense
        models).

        One `lax.scan` over the stacked layers (or, with the layers held per layer, L unrolled
        calls: module docstring): step i merges layer i's params and runs x <- layer_i(x),
        with `attend_at(i, q, k, v, carry) -> (out, carry)` doing its attention (masked
        self-attention for a full forward; a KV-cache write + read when decoding, the cache
        being the `carry`). `remat` is the layer body's `jax.checkpoint` policy
        (`REMAT_POLICIES`); a non-"none" policy needs `carry=None`, since a rematerialised body
        must not thread state (decoding passes "none"). `routing` replays given experts in
        the MoE layers instead of the router's choice (routing replay).
        """
        h, carry, routed, _ = self.hidden_states_and_load(
            tokens, positions, attend_at, dot_general, carry=carry, remat=remat, routing=routing
        )
        return h, carry, routed

    def hidden_states_and_load(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        attend_at: AttendAt,
        dot_general: DotGeneral,
        *,
        carry: Any = None,
        remat: RematPolicy = "none",
        routing: Int[Array, "L B T k"] | None = None,
        load_mask: Bool[Array, "B T"] | None = None,
    ) -> tuple[Float[Array, "B T D"], Any, Int[Array, "L B T k"] | None, RouterLoad | None]:
        """`hidden_states` and, in an MoE model given `load_mask`, every layer's router load
        over the tokens it marks (`models.moe.RouterLoad`, stacked [L, E]: what the
        load-balancing loss `models.moe.load_balancing_loss` reads); None otherwise."""
        cfg = self.cfg
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r}: use one of {sorted(REMAT_POLICIES)}")
        if remat != "none" and carry is not None:
            raise ValueError(f"remat={remat!r} with a carry (decoding): decode with remat='none'")
        # The RoPE tables are materialised once, as a scan's loop-invariant operands are: left
        # to fuse into unrolled layers, XLA recomputes cos/sin there with other f32 roundings.
        cos, sin = jax.lax.optimization_barrier(rope_cos_sin(positions, rope_inv_freq(cfg)))
        x = constrain_batch(self.model.embed_tokens(tokens).astype(cfg.compute_dtype))
        mask = load_mask if cfg.is_moe else None
        # A mixed model's MLP stacks (MoE and dense layers) are not sliced by the layer loop:
        # each layer picks its own slice (`DecoderLayer.mixed_mlp`).
        mixed = cfg.is_mixed
        mlp_stacks = nnx.Any(nnx.PathContains("mlp"), nnx.PathContains("dense_mlp"))
        layer_def, stacks, layer_params = nnx.split(
            self.model.layers, mlp_stacks if mixed else nnx.Nothing, ...
        )
        kinds, slots = cfg.sparse_layers, cfg.mlp_slots
        moe_ids = np.flatnonzero(kinds)
        if mixed and routing is not None:  # [L_moe, ...] -> [L, ...] (dense layers' unused)
            routing = routing[np.array(slots) * np.array(kinds)]

        def layer(
            params_i: nnx.State, x: Array, carry: Any, i: Any, routing_i: Array | None,
            mlp_slot: tuple[Any, Any] | None,
        ) -> tuple[Array, Any, Array | None, RouterLoad | None]:  # fmt: skip
            def attend(q: Array, k: Array, v: Array, c: Any) -> tuple[Array, Any]:
                return attend_at(i, q, k, v, c)

            # Stored FP8 weights (the rollout engine's) expand here, one layer at a time.
            params_i = fp8.dense_weights(params_i)
            x, carry, routed, load = nnx.merge(layer_def, stacks, params_i)(
                x, cos, sin, attend, carry, dot_general, routing_i, mask, mlp_slot
            )
            return constrain_batch(x), carry, routed, load

        if remat != "none":
            # prevent_cse=False: inside a scan CSE cannot undo the recomputation (jax docs).
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)

        def body(state: tuple[Array, Any], xs: tuple[Any, ...]) -> tuple[Any, Any]:
            params_i, i, routing_i, mlp_slot = xs
            x, carry, routed, load = layer(params_i, *state, i, routing_i, mlp_slot)
            return (x, carry), (routed, load)

        per_layer = per_layer_params(layer_params, cfg.num_layers)
        if per_layer is not None:
            outs = []
            for i, params_i in enumerate(per_layer):
                x, carry, routed, load = layer(
                    params_i, x, carry, i, None if routing is None else routing[i],
                    (kinds[i], slots[i]) if mixed else None,
                )  # fmt: skip
                outs.append((routed, load))
                # x is materialised between layers, as in the scan: a fusion across two layers
                # could skip a rounding to the compute dtype (XLA's bf16 excess precision).
                x = jax.lax.optimization_barrier(x)
            routed, load = jax.tree.map(lambda *a: jnp.stack(a), *outs)  # (None, None): dense
        else:
            layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            mlp_slots = (jnp.array(kinds), jnp.array(slots, jnp.int32)) if mixed else None
            (x, carry), (routed, load) = jax.lax.scan(
                body, (x, carry), (layer_params, layer_ids, routing, mlp_slots)
            )
        if mixed:  # the MoE layers' rows only
            routed, load = jax.tree.map(lambda a: a[moe_ids], (routed, load))
        return self.model.norm(x), carry, routed, load
