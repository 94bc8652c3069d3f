"""KV-cache decoding over (graphdef, params), the rollout engine's programs: `init_cache`,
`prefill`, `decode_step`.

Prompts are left-padded to one length P, `prefill` writes their keys and values into cache slots
[0, P) and `decode_step` appends one token per call at slot `index`. Slot s of the cache holds
column s of the sequence `prompt ++ generated`, so each step's logits equal
`models.functional.forward` over that sequence with the same mask (and the same
`kv_cache_dtype`). Jit `decode_step` with `donate_argnames="cache"` so the cache is updated in
place. The FP8 caveat of `models.functional` holds here too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from models import fp8
from models import kv_quant as kvq
from models.attention import reference_attention
from models.config import ModelConfig
from models.decoder import Decoder
from models.functional import (
    Params,
    apply_head,
    head_of,
    positions_from_mask,
    self_attention,
)
from models.kv_quant import KVScales


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


def _store_layer(
    bufs: tuple[Array, Array], layer: Array, k: Array, v: Array, s: KVScales
) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
    """Layer `layer`'s new keys and values [B, ..., K, E] as the cache stores them
    (`kv_quant.store` with the layer's scales), and the buffers [L, B, ..., K, E] of every
    layer's new entries with layer `layer` set. The layer scan carries only these buffers; the
    cache is written once, after the scan (a cache in the scan's carry is rewritten whole at
    every layer on the CPU backend)."""
    stored = tuple(
        kvq.store(x, sc[layer], b.dtype) for x, sc, b in zip((k, v), (s.k, s.v), bufs, strict=True)
    )
    bufs = tuple(
        jax.lax.dynamic_update_index_in_dim(b, x, layer, 0)
        for b, x in zip(bufs, stored, strict=True)
    )
    return stored, bufs


def _new_entry_buffers(cache: KVCache, shape: tuple[int, ...]) -> tuple[Array, Array]:
    """Zero buffers [L, *shape, K, E] in the cache's storage dtype (`_store_layer`)."""
    full = (cache.k.shape[0], *shape, *cache.k.shape[3:])
    return jnp.zeros(full, cache.k.dtype), jnp.zeros(full, cache.v.dtype)


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


def take_rows(cache: KVCache, rows: Int[Array, " R"]) -> KVCache:
    """The cache of rows `rows` (row r of the result is row rows[r] of `cache`): e.g. one
    prefilled prompt's cache copied to each of its samples."""
    return cache._replace(
        k=cache.k[:, rows], v=cache.v[:, rows], mask=cache.mask[rows], pos=cache.pos[rows]
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
        i: Array, q: Array, k: Array, v: Array, new: tuple[Array, Array]
    ) -> tuple[Array, tuple[Array, Array]]:
        return attend(i, q, k, v), _store_layer(new, i, k, v, cache.scales)[1]

    h, (k_new, v_new) = model.hidden_states(
        tokens,
        positions_from_mask(attention_mask),
        attend_at,
        fp8.make_dot_general(recipe),
        carry=_new_entry_buffers(cache, tokens.shape),
    )
    k_all = jax.lax.dynamic_update_slice(cache.k, k_new, (0,) * 5)
    v_all = jax.lax.dynamic_update_slice(cache.v, v_new, (0,) * 5)
    mask = jnp.zeros_like(cache.mask).at[:, :p].set(attention_mask.astype(bool))
    new_cache = cache._replace(
        k=k_all,
        v=v_all,
        mask=mask,
        pos=jnp.sum(attention_mask.astype(jnp.int32), axis=1),
        index=jnp.asarray(p, jnp.int32),
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
    """Appends one token per row at slot `cache.index` and returns the f32 next-token logits.

    Rows that are finished may keep feeding tokens (e.g. pad); their logits are simply ignored.
    """
    model: Decoder = nnx.merge(graphdef, params)
    index = cache.index
    at_index = jnp.arange(cache.mask.shape[1]) == index
    mask = cache.mask | at_index[None, :]
    allowed = mask[:, None, :]  # [B, 1, S]: every written slot up to and including index

    def attend_at(
        i: Array, q: Array, k: Array, v: Array, new: tuple[Array, Array]
    ) -> tuple[Array, tuple[Array, Array]]:
        # Layer i's cache as writing the new entry at slot `index` and reading back would give.
        stored, new = _store_layer(new, i, k[:, 0], v[:, 0], cache.scales)
        k_i, v_i = (
            kvq.load(jnp.where(at_index[:, None, None], x[:, None], c[i]), sc[i], q.dtype)
            for x, c, sc in zip(stored, (cache.k, cache.v), cache.scales, strict=True)
        )
        return reference_attention(q, k_i, v_i, allowed), new

    h, (k_new, v_new) = model.hidden_states(
        token[:, None],
        cache.pos[:, None],
        attend_at,
        fp8.make_dot_general(recipe),
        carry=_new_entry_buffers(cache, token.shape),
    )
    start = (0, 0, index, 0, 0)
    k_all = jax.lax.dynamic_update_slice(cache.k, k_new[:, :, None], start)
    v_all = jax.lax.dynamic_update_slice(cache.v, v_new[:, :, None], start)
    new_cache = cache._replace(k=k_all, v=v_all, mask=mask, pos=cache.pos + 1, index=index + 1)
    return apply_head(h[:, 0], head_of(model)), new_cache
