"""KV-cache decoding over (graphdef, params), the rollout engine's programs: `init_cache`,
`prefill`, `decode_step`.

Prompts come left-padded to one length P. The cache is written *by position*: slot s of row b
holds the token at RoPE position s of that row (`prefill` rotates each prompt left by its
leading pads before writing slots [0, P); `decode_step` writes row b's next token at slot
`pos[b]`). So a row's keys sit at the same columns whatever its padding, which the
batch-invariant attention needs (`models.invariant`), and each step's logits equal
`models.functional.forward` over the sequence `prompt ++ generated` with the same mask (and the
same `kv_cache_dtype`). Both run the layers unrolled (`models.decoder.unstack_layers`; stacked
params are sliced per layer), the cache holding one array per layer. Jit `decode_step` with
`donate_argnames="cache"` so the cache is updated in place. The FP8 caveat of
`models.functional` holds here too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from models import fp8, invariant
from models import kv_quant as kvq
from models.attention import leading_pads, reference_attention, rotate_rows
from models.config import ModelConfig
from models.decoder import Decoder, unstack_layers
from models.functional import (
    Params,
    apply_head,
    dot_general_for,
    head_of,
    positions_from_mask,
    self_attention,
)
from models.kv_quant import KVScales


class KVCache(NamedTuple):
    """Static-shape decoding state (a pytree).

    k, v:   per layer, [B, K, S, E] keys (after RoPE) and values as stored (`models.kv_quant`:
            the compute dtype, bf16, or e4m3 codes); slot s = position s. One array per layer,
            heads before slots: a decode step writes its entry into layer i's array in place
            and the attention products read that array as it is (no copy, no transpose).
    mask:   [B, S] True where slot s holds a real token (slots [0, pos[b])).
    pos:    [B] RoPE position of the next token (= real tokens so far in the row), also the
            slot it is written to.
    index:  [] P + decode steps taken: no row has written past it.
    scales: per-layer K/V scales of an FP8 cache (ones, unused, otherwise).
    routing: Mixture-of-Experts models made with `record_routing`: [B, S, L, k] int16, the
            experts layer l routed the token in slot s to (what routing replay hands the
            trainer); -1 where no token was fed (pads, slots not reached). Else None.
    """

    k: tuple[Float[Array, "B K S E"], ...]
    v: tuple[Float[Array, "B K S E"], ...]
    mask: Bool[Array, "B S"]
    pos: Int[Array, " B"]
    index: Int[Array, ""]
    scales: KVScales
    routing: Int[Array, "B S L k"] | None = None


Layers = tuple[tuple[Array, ...], tuple[Array, ...]]


def _write_layer(
    layers: Layers, layer: int, k: Array, v: Array, s: KVScales, start: Int[Array, " B"]
) -> Layers:
    """The per-layer caches with layer `layer`'s new keys and values [B, T, K, E], as the
    cache stores them (`kv_quant.store` with the layer's scales), row b written at slots
    [start[b], start[b] + T) of that layer's array (an in-place update)."""

    def put(cache_row: Array, entry_row: Array, at: Array) -> Array:
        return jax.lax.dynamic_update_slice(cache_row, entry_row, (0, at, 0))

    def write(caches: tuple[Array, ...], x: Array, scales: Array) -> tuple[Array, ...]:
        entry = kvq.store(x, scales[layer], caches[layer].dtype).transpose(0, 2, 1, 3)
        new = jax.vmap(put)(caches[layer], entry, start)
        return caches[:layer] + (new,) + caches[layer + 1 :]

    return write(layers[0], k, s.k), write(layers[1], v, s.v)


def init_cache(
    cfg: ModelConfig,
    batch: int,
    max_len: int,
    *,
    kv_cache_dtype: str = "auto",
    kv_scales: KVScales | None = None,
    record_routing: bool = False,
) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` tokens (prompt + generation),
    stored as `kv_cache_dtype` ("auto" | "bf16" | "fp8", `models.kv_quant`); "fp8" needs the
    per-layer `kv_scales`. `record_routing`: an MoE model's cache also records each token's
    experts (`KVCache.routing`).

    Writing past `max_len` is not checked under jit (the last slot would be overwritten):
    callers size `max_len >= prompt_len + max_new_tokens`.
    """
    dtype = kvq.storage_dtype(kv_cache_dtype, cfg.compute_dtype)
    if kv_cache_dtype == "fp8" and kv_scales is None:
        raise ValueError("init_cache: kv_cache_dtype='fp8' needs kv_scales (per-layer K/V scales)")
    if cfg.batch_invariant:  # whole attention chunks: the decode step reads them in place
        max_len = -(-max_len // invariant.CHUNK) * invariant.CHUNK
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
        mask=jnp.zeros((batch, max_len), bool),
        pos=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
        scales=kvq.unit_scales(cfg.num_layers) if kv_scales is None else kv_scales,
        routing=(
            jnp.full((batch, max_len, cfg.num_moe_layers, cfg.num_experts_per_tok), -1, jnp.int16)
            if cfg.is_moe and record_routing
            else None
        ),
    )


def take_rows(cache: KVCache, rows: Int[Array, " R"]) -> KVCache:
    """The cache of rows `rows` (row r of the result is row rows[r] of `cache`): e.g. one
    prefilled prompt's cache copied to each of its samples."""
    return cache._replace(
        k=tuple(x[rows] for x in cache.k),
        v=tuple(x[rows] for x in cache.v),
        mask=cache.mask[rows],
        pos=cache.pos[rows],
        routing=None if cache.routing is None else cache.routing[rows],
    )


def _cache_format(cache: KVCache, compute_dtype: jnp.dtype) -> str:
    """The `kv_cache_dtype` a cache was made with, from its storage dtype."""
    for name in kvq.KV_CACHE_DTYPES:
        if kvq.storage_dtype(name, compute_dtype) == cache.k[0].dtype:
            return name
    raise ValueError(f"KV cache of dtype {cache.k[0].dtype}: make it with init_cache")


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
    model: Decoder = nnx.merge(graphdef, unstack_layers(params))
    p = tokens.shape[1]
    if p > cache.mask.shape[1]:
        raise ValueError(
            f"prefill: prompt length {p} exceeds the cache length {cache.mask.shape[1]}; "
            "size init_cache(max_len=...) for prompt + generation"
        )
    fmt = _cache_format(cache, model.cfg.compute_dtype)
    attend = self_attention(model.cfg, attention_mask, fmt, cache.scales)
    key_mask = attention_mask.astype(bool)
    first = leading_pads(key_mask)  # rotate rows so position s lands in slot s
    start = jnp.zeros_like(first)

    def attend_at(i: int, q: Array, k: Array, v: Array, layers: Layers) -> tuple[Array, Layers]:
        k_pos, v_pos = rotate_rows(k, first), rotate_rows(v, first)
        return attend(i, q, k, v), _write_layer(layers, i, k_pos, v_pos, cache.scales, start)

    h, (k_all, v_all), routed = model.hidden_states(
        tokens,
        positions_from_mask(attention_mask),
        attend_at,
        dot_general_for(model.cfg, recipe),
        carry=(cache.k, cache.v),
    )
    real = rotate_rows(key_mask, first)
    mask = jnp.zeros_like(cache.mask).at[:, :p].set(real)
    routing = cache.routing
    if routing is not None:  # [L, B, P, k] -> by position [B, P, L, k], pads -1
        by_pos = rotate_rows(jnp.moveaxis(routed, 0, 2), first)
        by_pos = jnp.where(real[:, :, None, None], by_pos, -1).astype(routing.dtype)
        routing = jnp.full_like(routing, -1).at[:, :p].set(by_pos)
    new_cache = cache._replace(
        k=k_all,
        v=v_all,
        mask=mask,
        pos=jnp.sum(attention_mask.astype(jnp.int32), axis=1),
        index=jnp.asarray(p, jnp.int32),
        routing=routing,
    )
    return apply_head(h[:, -1], head_of(model)), new_cache


def decode_step(
    graphdef: nnx.GraphDef,
    params: Params,
    token: Int[Array, " B"],
    cache: KVCache,
    *,
    recipe: fp8.Recipe,
) -> tuple[Float[Array, "B V"], KVCache]:
    """Appends one token per row at slot `cache.pos[b]` (its position) and returns the f32
    next-token logits.

    Rows that are finished may keep feeding tokens (e.g. pad); their logits are simply ignored.
    """
    model: Decoder = nnx.merge(graphdef, unstack_layers(params))
    pos = cache.pos
    mask = cache.mask | (jnp.arange(cache.mask.shape[1])[None, :] == pos[:, None])
    allowed = mask[:, None, :]  # [B, 1, S]: every written slot up to and including pos

    def attend_at(i: int, q: Array, k: Array, v: Array, layers: Layers) -> tuple[Array, Layers]:
        # Layer i's cache with the new entry written at slot `pos`, read as stored.
        layers = _write_layer(layers, i, k, v, cache.scales, pos)
        k_i, v_i = (
            kvq.load(c[i], sc[i], q.dtype) for c, sc in zip(layers, cache.scales, strict=True)
        )
        if model.cfg.batch_invariant:
            out = invariant.exact_decode_attention(q, k_i, v_i, pos, chunk=invariant.CHUNK)
            return out, layers
        return reference_attention(q, k_i, v_i, allowed, heads_major=True), layers

    h, (k_all, v_all), routed = model.hidden_states(
        token[:, None],
        pos[:, None],
        attend_at,
        dot_general_for(model.cfg, recipe),
        carry=(cache.k, cache.v),
    )
    routing = cache.routing
    if routing is not None:  # [L, B, 1, k] written at slot pos of each row
        entry = jnp.moveaxis(routed, 0, 2).astype(routing.dtype)  # [B, 1, L, k]
        routing = jax.vmap(lambda r, e, at: jax.lax.dynamic_update_slice(r, e, (at, 0, 0)))(
            routing, entry, pos
        )
    new_cache = cache._replace(
        k=k_all, v=v_all, mask=mask, pos=pos + 1, index=cache.index + 1, routing=routing
    )
    return apply_head(h[:, 0], head_of(model)), new_cache
