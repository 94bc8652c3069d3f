"""Pure functions over (graphdef, params): init, forward, per-token logprobs/entropy, KV decoding.

The trainer and the rollout engine never hold a stateful module: `init_model` splits once, and
every function here merges `graphdef` with `params` inside (so they jit with
`static_argnums=0` and `static_argnames="recipe"`; graphdefs and recipes are hashable).

Padding: `attention_mask` is 1 on real tokens. RoPE positions are `cumsum(mask) - 1`, so a
left-padded row gives its first real token position 0 and its logits do not depend on the
padding. Key s is visible to query t iff s <= t and mask[s] == 1.

KV decoding (rollout): prompts are left-padded to one length P, `prefill` writes their keys and
values into cache slots [0, P) and `decode_step` appends one token per call at slot `index`.
Slot s of the cache holds column s of the sequence `prompt ++ generated`, so each step's logits
equal `forward` over that sequence with the same mask. Jit `decode_step` with
`donate_argnames="cache"` so the cache is updated in place.

FP8 caveat: with per-tensor activation scaling (`fp8_tensor`) the scale is the amax over every
token in the call, so pads and batch neighbours shift a row's numbers, and a one-token decode
step quantizes differently from the full forward. Row and block scaling are per token, so
padding invariance and decode == forward hold for them up to reduction order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from models import fp8
from models import kv_quant as kvq
from models.attention import causal_self_attention, reference_attention
from models.config import ModelConfig
from models.decoder import Decoder
from models.kv_quant import KVScales

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
        return causal_self_attention(
            q, k, v, key_mask, impl=cfg.attention, chunk=cfg.attention_chunk
        )

    return attend


def hidden_states(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
) -> Float[Array, "B T D"]:
    """The final-normed hidden states (compute dtype): the scanned layers with
    `cfg.attention` self-attention and `cfg.remat` rematerialisation; keys and values are
    read as a `kv_cache_dtype` KV cache holds them (`models.kv_quant`; "auto": unrounded)."""
    model: Decoder = nnx.merge(graphdef, params)
    cfg = model.cfg
    attend = self_attention(cfg, attention_mask, kv_cache_dtype, kv_scales)

    def attend_at(i: Array, q: Array, k: Array, v: Array, carry: None) -> tuple[Array, None]:
        return attend(i, q, k, v), carry

    h, _ = model.hidden_states(
        tokens,
        positions_from_mask(attention_mask),
        attend_at,
        fp8.make_dot_general(recipe),
        remat=cfg.remat,
    )
    return h


class Head(NamedTuple):
    """The LM head weight in compute dtype as the model stores it, and the einsum that applies
    it (`_head_of`)."""

    w: Array
    spec: str

    @property
    def vocab_size(self) -> int:
        return self.w.shape[0 if self.spec == _TIED_HEAD else 1]


_TIED_HEAD = "...d,vd->...v"  # the embedding [V, D] contracted on D
_UNTIED_HEAD = "...d,dv->...v"  # an `lm_head` kernel [D, V]


def _head_of(model: Decoder) -> Head:
    """The LM head of `model`: a tied embedding [V, D] is contracted on D as it is, so XLA never
    materialises its transpose (an f32 [D, V] copy handed to the logprob scan, and a [D, V]
    gradient accumulator in its backward: 0.6 GB each at a 152k vocabulary and d = 1024)."""
    dtype = model.cfg.compute_dtype
    if model.lm_head is None:
        return Head(model.model.embed_tokens.embedding[...].astype(dtype), _TIED_HEAD)
    return Head(model.lm_head[...].astype(dtype), _UNTIED_HEAD)


def _head(graphdef: nnx.GraphDef, params: Params) -> Head:
    return _head_of(nnx.merge(graphdef, params))


def _logits(h: Float[Array, "... D"], head: Head) -> Float[Array, "... V"]:
    # The LM head stays out of FP8: compute-dtype operands, f32 accumulation, f32 logits.
    return jnp.einsum(head.spec, h, head.w, preferred_element_type=jnp.float32)


def forward(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
) -> Float[Array, "B T V"]:
    """f32 logits for every position; logits[:, t] predicts tokens[:, t + 1] (K/V read as a
    `kv_cache_dtype` cache holds them, `hidden_states`)."""
    kv = dict(kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
    h = hidden_states(graphdef, params, tokens, attention_mask, recipe=recipe, **kv)
    return _logits(h, _head(graphdef, params))


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
    `kv_cache_dtype` / `kv_scales`: K/V read as such a KV cache holds them (`hidden_states`).
    """
    kv = dict(kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
    h = hidden_states(graphdef, params, tokens, attention_mask, recipe=recipe, **kv)
    head = _head(graphdef, params)
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
        z = _logits(h_c, head)
        if temperature != 1.0:
            z = z / temperature
        lse = jax.nn.logsumexp(z, axis=-1)
        z_tgt = jnp.take_along_axis(z, tgt_c[..., None], axis=-1)[..., 0]
        ent = lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)
        return z_tgt - lse, ent

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


# ----------------------------------------------------------------------------------------------
# KV-cache decoding
# ----------------------------------------------------------------------------------------------


class KVCache(NamedTuple):
    """Static-shape decoding state (a pytree).

    k, v:   [L, B, S, K, E] keys (after RoPE) and values as stored (`models.kv_quant`: the
            compute dtype, bf16, or e4m3 codes); slot s = column s.
    mask:   [B, S] True where slot s holds a real token.
    pos:    [B] RoPE position of the next token (= real tokens so far in the row).
    index:  [] the slot the next token is written to (same for every row).
    scales: per-layer K/V scales of an FP8 cache (ones, unused, otherwise).
    """

    k: Float[Array, "L B S K E"]
    v: Float[Array, "L B S K E"]
    mask: Bool[Array, "B S"]
    pos: Int[Array, " B"]
    index: Int[Array, ""]
    scales: KVScales


def _write_kv(
    kv: tuple[Array, Array], layer: Array, slot: Array | int, k: Array, v: Array, s: KVScales
) -> tuple[Array, Array]:
    """Cache (k, v) [L, B, S, K, E] with layer `layer`'s slots [slot, slot + T) set to the new
    [B, T, K, E] keys and values as stored (`kv_quant.store` with the layer's scales). The
    cache is the layer scan's carry, so XLA writes in place."""
    start = (layer, 0, slot, 0, 0)
    return tuple(
        jax.lax.dynamic_update_slice(c, kvq.store(x, sc[layer], c.dtype)[None], start)
        for c, x, sc in zip(kv, (k, v), (s.k, s.v), strict=True)
    )


def _read_kv(kv: tuple[Array, Array], layer: Array, s: KVScales, dtype: jnp.dtype):
    """Layer `layer`'s cached (k, v) [B, S, K, E] back in the compute dtype (`kv_quant.load`)."""
    return tuple(
        kvq.load(jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False), sc[layer], dtype)
        for c, sc in zip(kv, (s.k, s.v), strict=True)
    )


def init_cache(
    cfg: ModelConfig,
    batch: int,
    max_len: int,
    *,
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` tokens (prompt + generation),
    stored as `kv_cache_dtype` ("auto" | "bf16" | "fp8", `models.kv_quant`); "fp8" needs the
    per-layer `kv_scales`.

    Writing past `max_len` is not checked under jit (the last slot would be overwritten):
    callers size `max_len >= prompt_len + max_new_tokens`.
    """
    dtype = kvq.storage_dtype(kv_cache_dtype, cfg.compute_dtype)
    if kv_cache_dtype == "fp8" and kv_scales is None:
        raise ValueError("init_cache: kv_cache_dtype='fp8' needs kv_scales (per-layer K/V scales)")
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        mask=jnp.zeros((batch, max_len), bool),
        pos=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
        scales=kvq.unit_scales(cfg.num_layers) if kv_scales is None else kv_scales,
    )


def _cache_format(cache: KVCache, compute_dtype: jnp.dtype) -> str:
    """The `kv_cache_dtype` a cache was made with, from its storage dtype."""
    for name in kvq.KV_CACHE_DTYPES:
        if kvq.storage_dtype(name, compute_dtype) == cache.k.dtype:
            return name
    raise ValueError(f"KV cache of dtype {cache.k.dtype}: make it with init_cache")


def prefill(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B P"],
    attention_mask: Int[Array, "B P"],
    cache: KVCache,
    *,
    recipe: fp8.Recipe,
) -> tuple[Float[Array, "B V"], KVCache]:
    """Runs the (left-padded) prompts, fills cache slots [0, P) and returns the f32 logits of
    the last column (the next-token distribution; the last column must be a real token).
    The prompt attends to its keys and values as the cache stores them (as vLLM's attention
    reads them from its cache), so an FP8 cache rounds the prompt's attention too.

    Starts a fresh cache: whatever `cache` held is overwritten or masked out.
    """
    model: Decoder = nnx.merge(graphdef, params)
    p = tokens.shape[1]
    if p > cache.mask.shape[1]:
        raise ValueError(
            f"prefill: prompt length {p} exceeds the cache length {cache.mask.shape[1]}; "
            "size init_cache(max_len=...) for prompt + generation"
        )
    fmt = _cache_format(cache, model.cfg.compute_dtype)
    attend = self_attention(model.cfg, attention_mask, fmt, cache.scales)

    def attend_at(
        i: Array, q: Array, k: Array, v: Array, kv: tuple[Array, Array]
    ) -> tuple[Array, tuple[Array, Array]]:
        return attend(i, q, k, v), _write_kv(kv, i, 0, k, v, cache.scales)

    h, (k_all, v_all) = model.hidden_states(
        tokens,
        positions_from_mask(attention_mask),
        attend_at,
        fp8.make_dot_general(recipe),
        carry=(cache.k, cache.v),
    )
    mask = jnp.zeros_like(cache.mask).at[:, :p].set(attention_mask.astype(bool))
    new_cache = cache._replace(
        k=k_all,
        v=v_all,
        mask=mask,
        pos=jnp.sum(attention_mask.astype(jnp.int32), axis=1),
        index=jnp.asarray(p, jnp.int32),
    )
    return _logits(h[:, -1], _head_of(model)), new_cache


def decode_step(
    graphdef: nnx.GraphDef,
    params: Params,
    token: Int[Array, " B"],
    cache: KVCache,
    *,
    recipe: fp8.Recipe,
) -> tuple[Float[Array, "B V"], KVCache]:
    """Appends one token per row at slot `cache.index` and returns the f32 next-token logits.

    Rows that are finished may keep feeding tokens (e.g. pad); their logits are simply ignored.
    """
    model: Decoder = nnx.merge(graphdef, params)
    index = cache.index
    slots = jnp.arange(cache.mask.shape[1])
    mask = cache.mask | (slots == index)[None, :]
    allowed = mask[:, None, :]  # [B, 1, S]: every written slot up to and including index

    def attend_at(
        i: Array, q: Array, k: Array, v: Array, kv: tuple[Array, Array]
    ) -> tuple[Array, tuple[Array, Array]]:
        # Write slot `index` of layer i, then attend over that layer's whole cache ([B,H,1,S]).
        kv = _write_kv(kv, i, index, k, v, cache.scales)
        k_i, v_i = _read_kv(kv, i, cache.scales, q.dtype)
        return reference_attention(q, k_i, v_i, allowed), kv

    h, (k_all, v_all) = model.hidden_states(
        token[:, None],
        cache.pos[:, None],
        attend_at,
        fp8.make_dot_general(recipe),
        carry=(cache.k, cache.v),
    )
    new_cache = cache._replace(k=k_all, v=v_all, mask=mask, pos=cache.pos + 1, index=index + 1)
    return _logits(h[:, 0], _head_of(model)), new_cache
