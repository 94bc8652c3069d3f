"""Pure functions over (graphdef, params): init, forward, per-token logprobs and entropy.

The trainer and the rollout engine never hold a stateful module: `init_model` splits once, and
every function here merges `graphdef` with `params` inside (so they jit with
`static_argnums=0` and `static_argnames="recipe"`; graphdefs and recipes are hashable).

Padding: `attention_mask` is 1 on real tokens. RoPE positions are `cumsum(mask) - 1`, so a
left-padded row gives its first real token position 0 and its logits do not depend on the
padding. Key s is visible to query t iff s <= t and mask[s] == 1.

KV-cache decoding (rollout) over the same functions: `models.decoding`.

FP8 caveat: with per-tensor activation scaling (`fp8_tensor`) the scale is the amax over every
token in the call, so pads and batch neighbours shift a row's numbers, and a one-token decode
step quantizes differently from the full forward. Row and block scaling are per token, so
padding invariance and decode == forward hold for them up to reduction order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from models import fp8, invariant
from models import kv_quant as kvq
from models.attention import causal_self_attention
from models.config import ModelConfig
from models.decoder import Decoder
from models.kv_quant import KVScales
from models.moe import RouterLoad

Params = nnx.State
# Default budget for one chunk of f32 logits in `token_logprobs_and_entropy` (B x C x V x 4 B).
LOGITS_CHUNK_BYTES = 256 * 2**20


def init_model(cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, Params]:
    """A randomly initialised model (HF init: N(0, 0.02) weights, zero biases, unit norms).

    Returns `(graphdef, params)`; params is an `nnx.State` of `cfg.param_dtype` arrays.
    """
    model = Decoder(cfg, rngs=nnx.Rngs(params=seed))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, Params]:
    """`(graphdef, params)` with `jax.ShapeDtypeStruct` leaves: no memory, for loaders and
    sharding plans."""
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(params=0)))
    return nnx.split(model, nnx.Param)


def positions_from_mask(attention_mask: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """RoPE positions: 0, 1, ... over the real tokens of each row (pads get the neighbour's)."""
    m = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=1) - 1, 0)


def self_attention(
    cfg: ModelConfig,
    attention_mask: Int[Array, "B T"],
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
):
    """(i, q, k, v) -> causal self-attention of the padded batch in layer i by `cfg.attention`,
    over keys and values as a `kv_cache_dtype` cache holds them (`kv_quant.round_trip` with
    layer i's scales; "auto": as computed)."""
    key_mask = attention_mask.astype(bool)
    if kv_cache_dtype == "fp8" and kv_scales is None:
        raise ValueError("kv_cache_dtype='fp8' needs kv_scales (models.kv_quant.KVScales)")
    scales = kv_scales or kvq.unit_scales(cfg.num_layers)

    def attend(i: Array, q: Array, k: Array, v: Array) -> Array:
        if kv_cache_dtype != "auto":
            k = kvq.round_trip(k, scales.k[i], kv_cache_dtype)
            v = kvq.round_trip(v, scales.v[i], kv_cache_dtype)
        if cfg.batch_invariant:
            return invariant.exact_attention(q, k, v, key_mask, chunk=invariant.CHUNK)
        return causal_self_attention(
            q, k, v, key_mask, impl=cfg.attention, chunk=cfg.attention_chunk
        )

    return attend


def hidden_states_routing_and_load(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
    routing: Int[Array, "B T L k"] | None = None,
    load_mask: Bool[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T D"], Int[Array, "B T L k"] | None, RouterLoad | None]:
    """The final-normed hidden states (compute dtype), in a Mixture-of-Experts model the
    experts each layer routed each token to, and with `load_mask` every layer's router load
    over the tokens it marks (`models.moe.RouterLoad` [L, E], for the load-balancing loss);
    None where a dense model has none. The scanned layers run with `cfg.attention`
    self-attention and `cfg.remat` rematerialisation; keys and values are read as a
    `kv_cache_dtype` KV cache holds them (`models.kv_quant`; "auto": unrounded). `routing`
    (MoE): experts to replay instead of the router's choice, by token, as
    `models.decoding.KVCache.routing` records them (a token with an entry < 0 keeps its own)."""
    model: Decoder = nnx.merge(graphdef, params)
    cfg = model.cfg
    attend = self_attention(cfg, attention_mask, kv_cache_dtype, kv_scales)

    def attend_at(i: Array, q: Array, k: Array, v: Array, carry: None) -> tuple[Array, None]:
        return attend(i, q, k, v), carry

    h, _, routed, load = model.hidden_states_and_load(
        tokens,
        positions_from_mask(attention_mask),
        attend_at,
        dot_general_for(cfg, recipe),
        remat=cfg.remat,
        routing=None if routing is None else jnp.moveaxis(routing, 2, 0),
        load_mask=load_mask,
    )
    return h, None if routed is None else jnp.moveaxis(routed, 0, 2), load


def hidden_states_and_routing(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
    routing: Int[Array, "B T L k"] | None = None,
) -> tuple[Float[Array, "B T D"], Int[Array, "B T L k"] | None]:
    """The hidden states and routed experts of `hidden_states_routing_and_load`."""
    return hidden_states_routing_and_load(
        graphdef, params, tokens, attention_mask, recipe=recipe,
        kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, routing=routing,
    )[:2]  # fmt: skip


def hidden_states(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
    routing: Int[Array, "B T L k"] | None = None,
) -> Float[Array, "B T D"]:
    """The final-normed hidden states of `hidden_states_and_routing`."""
    return hidden_states_and_routing(
        graphdef, params, tokens, attention_mask, recipe=recipe,
        kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, routing=routing,
    )[0]  # fmt: skip


def routed_experts(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
) -> Int[Array, "B T L k"]:
    """The experts a Mixture-of-Experts model's router picks for each token in each layer
    under `recipe` (what routing replay compares the rollout's record with)."""
    return hidden_states_and_routing(graphdef, params, tokens, attention_mask, recipe=recipe)[1]


def dot_general_for(cfg: ModelConfig, recipe: fp8.Recipe) -> fp8.RecipeDot:
    """The layers' GEMMs under `recipe` (`models.fp8.RecipeDot`: the linear layers'
    `dot_general` and the MoE experts' grouped GEMM), with at least `invariant.MIN_ROWS` rows
    per dense GEMM when `cfg.batch_invariant` (`models.invariant`, rule 1)."""
    dot = fp8.make_dot_general(recipe)
    return fp8.RecipeDot(invariant.rows_padded(dot) if cfg.batch_invariant else dot, recipe)


class Head(NamedTuple):
    """The LM head weight in compute dtype as the model stores it, the einsum that applies it
    (`head_of`), and whether its rows are padded to `invariant.MIN_ROWS` (batch-invariant)."""

    w: Array
    spec: str
    min_rows: int = 1

    @property
    def vocab_size(self) -> int:
        return self.w.shape[0 if self.spec == _TIED_HEAD else 1]


_TIED_HEAD = "...d,vd->...v"  # the embedding [V, D] contracted on D
_UNTIED_HEAD = "...d,dv->...v"  # an `lm_head` kernel [D, V]


def head_of(model: Decoder) -> Head:
    """The LM head of `model`: a tied embedding [V, D] is contracted on D as it is, so XLA never
    materialises its transpose (an f32 [D, V] copy handed to the logprob scan, and a [D, V]
    gradient accumulator in its backward: 0.6 GB each at a 152k vocabulary and d = 1024)."""
    dtype = model.cfg.compute_dtype
    rows = invariant.MIN_ROWS if model.cfg.batch_invariant else 1
    if model.lm_head is None:
        return Head(model.model.embed_tokens.embedding[...].astype(dtype), _TIED_HEAD, rows)
    return Head(model.lm_head[...].astype(dtype), _UNTIED_HEAD, rows)


def _head(graphdef: nnx.GraphDef, params: Params) -> Head:
    return head_of(nnx.merge(graphdef, params))


def apply_head(h: Float[Array, "... D"], head: Head) -> Float[Array, "... V"]:
    # The LM head stays out of FP8: compute-dtype operands, f32 accumulation, f32 logits.
    rows, m = invariant.pad_rows(h, head.min_rows)
    z = jnp.einsum(head.spec, rows, head.w, preferred_element_type=jnp.float32)
    return z[:m].reshape(*h.shape[:-1], z.shape[-1])


def inverse_temperature(temperature: float) -> np.float32:
    """1 / temperature as the f32 division the engine's sampler computes on its per-row
    temperatures (a multiplication by it scales the logits the same way on both sides)."""
    return np.float32(1.0) / np.float32(temperature)


def scale_logits(logits: Float[Array, "... V"], inv_temperature: Array) -> Float[Array, "... V"]:
    """f32 logits times 1 / temperature (`inverse_temperature`): the product rounded to f32 on
    its own (`models.invariant.exact_mul`), never fused with the log-softmax's subtraction."""
    return invariant.exact_mul(logits.astype(jnp.float32), inv_temperature)


def log_probs(z: Float[Array, "... V"], *, exact: bool = False) -> Float[Array, "... V"]:
    """log softmax(z) over the vocabulary: the one formula by which the engine's sampler and
    the trainer's log-prob head turn temperature-scaled f32 logits into log-probabilities;
    `exact` (batch-invariant models) sums the exponentials in a fixed order
    (`models.invariant`, rule 3)."""
    return invariant.log_softmax(z) if exact else jax.nn.log_softmax(z, axis=-1)


def token_logprob_terms(
    z: Float[Array, "... V"], tokens: Int[Array, "..."], *, exact: bool = False
) -> Float[Array, "..."]:
    """log softmax(z)[token] (`log_probs`)."""
    logp = log_probs(z, exact=exact)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def forward(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
    routing: Int[Array, "B T L k"] | None = None,
) -> Float[Array, "B T V"]:
    """f32 logits for every position; logits[:, t] predicts tokens[:, t + 1] (K/V read as a
    `kv_cache_dtype` cache holds them, `hidden_states`; `routing`: MoE experts to replay)."""
    kv = dict(kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, routing=routing)
    h = hidden_states(graphdef, params, tokens, attention_mask, recipe=recipe, **kv)
    return apply_head(h, _head(graphdef, params))


def token_logprobs_and_entropy(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
    routing: Int[Array, "B T L k"] | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Per-token log-probability of the given tokens and entropy of the predicting distribution.

    With z_t = logits at position t / temperature (f32):
        logp[:, t]    = log_softmax(z_{t-1})[tokens[:, t]]
        entropy[:, t] = logsumexp(z_{t-1}) - sum_v softmax(z_{t-1})_v z_{t-1, v}
    for t >= 1 where both tokens t-1 and t are real (mask 1); every other entry (t = 0, pads,
    the first real token of a left-padded row) is 0. So `logp * response_mask` selects the
    response tokens' log-probabilities directly.

    The LM head runs over the sequence in chunks of `chunk_size` positions inside a
    rematerialised `lax.scan`, so only a few [B, chunk_size, V] f32 blocks of logits are live,
    in the forward and the backward pass (a 152k vocabulary at T = 8192 never builds [T, V]).
    `chunk_size=None` picks the largest chunk whose logits fit `LOGITS_CHUNK_BYTES`.
    `kv_cache_dtype` / `kv_scales`: K/V read as such a KV cache holds them (`hidden_states`);
    `routing`: an MoE model's experts to replay (`hidden_states_and_routing`).
    """
    kv = dict(kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, routing=routing)
    h = hidden_states(graphdef, params, tokens, attention_mask, recipe=recipe, **kv)
    return head_logprobs_and_entropy(
        _head(graphdef, params), h, tokens, attention_mask,
        chunk_size=chunk_size, temperature=temperature,
    )  # fmt: skip


def head_logprobs_and_entropy(
    head: Head,
    h: Float[Array, "B T D"],
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """`token_logprobs_and_entropy` from the final hidden states `h` and the LM `head`
    (`head_of`): the chunked log-prob head alone."""
    exact = head.min_rows > 1  # a batch-invariant model
    b, t, d = h.shape
    if chunk_size is None:
        chunk_size = LOGITS_CHUNK_BYTES // (4 * b * head.vocab_size)
    c = max(1, min(chunk_size, t))
    n = -(-t // c)
    pad = n * c - t
    # Position j predicts token j + 1; the last position predicts nothing (target 0, dropped).
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    h_chunks = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
    t_chunks = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)

    @jax.checkpoint
    def chunk(h_c: Array, tgt_c: Array) -> tuple[Array, Array]:
        # The chunk's logits are materialised: fused into the log-softmax, XLA:CPU computed the
        # head's product of bf16 operands at a lower precision (5e-3 nats on a sharp policy).
        z = jax.lax.optimization_barrier(apply_head(h_c, head))
        if temperature != 1.0:
            z = scale_logits(z, inverse_temperature(temperature))
        lse = jax.nn.logsumexp(z, axis=-1)
        ent = lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)
        return token_logprob_terms(z, tgt_c, exact=exact), ent

    def body(carry: None, xs: tuple[Array, Array]) -> tuple[None, tuple[Array, Array]]:
        return None, chunk(*xs)

    _, (lp, ent) = jax.lax.scan(body, None, (h_chunks, t_chunks))
    lp = lp.swapaxes(0, 1).reshape(b, n * c)[:, : t - 1]
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, : t - 1]
    mask = attention_mask.astype(bool)
    valid = mask[:, 1:] & mask[:, :-1]
    zero = jnp.zeros((b, 1), jnp.float32)
    lp = jnp.concatenate([zero, jnp.where(valid, lp, 0.0)], axis=1)
    ent = jnp.concatenate([zero, jnp.where(valid, ent, 0.0)], axis=1)
    return lp, ent


def token_logprobs(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
    routing: Int[Array, "B T L k"] | None = None,
) -> Float[Array, "B T"]:
    """log p(tokens[:, t] | tokens[:, :t]) in f32, entry 0 = 0 (see
    `token_logprobs_and_entropy`)."""
    return token_logprobs_and_entropy(
        graphdef,
        params,
        tokens,
        attention_mask,
        recipe=recipe,
        chunk_size=chunk_size,
        temperature=temperature,
        kv_cache_dtype=kv_cache_dtype,
        kv_scales=kv_scales,
        routing=routing,
    )[0]


def token_entropy(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> Float[Array, "B T"]:
    """Entropy (nats, f32) of the distribution that predicts tokens[:, t], entry 0 = 0."""
    return token_logprobs_and_entropy(
        graphdef,
        params,
        tokens,
        attention_mask,
        recipe=recipe,
        chunk_size=chunk_size,
        temperature=temperature,
    )[1]
