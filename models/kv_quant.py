"""KV-cache storage formats: the model's own dtype, bf16, or FP8 E4M3 with per-layer scales.

The FP8 cache follows vLLM's `--kv-cache-dtype fp8`: every attention layer l has one f32
`k_scale[l]` and one `v_scale[l]` (per tensor: all heads, all tokens), the cache stores

    k_q = e4m3(clip(k / k_scale[l], -448, 448))        (round to nearest even, saturating)

for the keys after the q/k norm and RoPE (and the same for values with `v_scale[l]`), and the
attention reads k_q * k_scale[l] back. vLLM keeps these scales as `Attention._k_scale` /
`_k_scale_float`, loaded from a checkpoint's `model.layers.<l>.self_attn.k_scale` tensors (or
its `kv_cache_scheme`); without them it uses 1.0. Here they are computed from the policy
itself (`kv_scales_from_amax` of the amax over calibration tokens, `models.kv_calibration.kv_amax`),
as NeMo-RL does at every weight sync: scale = amax / 448, so the largest calibrated entry maps
to the largest E4M3 value and nothing seen in calibration saturates.

"auto" stores the compute dtype (no rounding: the cache before FP8 existed, bit for bit);
"bf16" stores bfloat16 (a no-op for bf16 compute). Everything here is a pure function.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from models.fp8.recipe import FP8_DTYPES, FP8_MAX

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bf16", "fp8")
E4M3_MAX = FP8_MAX["e4m3"]
_E4M3 = FP8_DTYPES["e4m3"]
# Smallest scale: an all-zero layer (amax 0) still gets a finite, positive scale.
_MIN_SCALE = np.float32(np.finfo(np.float32).tiny)


class KVScales(NamedTuple):
    """Per-layer FP8 KV-cache scales (a pytree): k [L] and v [L], f32, dequantized = q * s."""

    k: Float[Array, " L"]
    v: Float[Array, " L"]


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raises a ValueError naming the choices for an unknown KV-cache dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}"
        )


def storage_dtype(kv_cache_dtype: str, compute_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype the cache holds: the compute dtype ("auto"), bfloat16, or float8_e4m3fn."""
    check_kv_cache_dtype(kv_cache_dtype)
    return {
        "auto": jnp.dtype(compute_dtype),
        "bf16": jnp.dtype(jnp.bfloat16),
        "fp8": jnp.dtype(_E4M3),
    }[kv_cache_dtype]


def kv_scales_from_amax(k_amax: Array, v_amax: Array) -> KVScales:
    """Scales that map each layer's calibrated amax to 448 (E4M3's largest finite value)."""

    def one(amax: Array) -> Array:
        return jnp.maximum(jnp.asarray(amax, jnp.float32) / np.float32(E4M3_MAX), _MIN_SCALE)

    return KVScales(one(k_amax), one(v_amax))


def unit_scales(num_layers: int) -> KVScales:
    """Scales of 1.0 (unused by "auto" / "bf16" caches; vLLM's default for fp8)."""
    ones = jnp.ones((num_layers,), jnp.float32)
    return KVScales(ones, ones)


def store(x: Array, scale: Array, dtype: jnp.dtype) -> Array:
    """x as the cache holds it: e4m3(clip(x / scale)) for FP8 storage, else x cast to `dtype`."""
    if jnp.dtype(dtype) != jnp.dtype(_E4M3):
        return x.astype(dtype)
    y = x.astype(jnp.float32) / scale.astype(jnp.float32)
    return jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(_E4M3)


def load(x: Array, scale: Array, dtype: jnp.dtype) -> Array:
    """Cache entries back in the compute dtype `dtype`: q * scale (f32 product) for FP8, else a
    cast (a no-op for an "auto" cache)."""
    if x.dtype != jnp.dtype(_E4M3):
        return x.astype(dtype)
    return (x.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def round_trip(x: Array, scale: Array, kv_cache_dtype: str) -> Array:
    """load(store(x)): the values attention sees for keys or values it reads from the cache.
    Identity (the same array) for "auto"."""
    if kv_cache_dtype == "auto":
        return x
    dtype = storage_dtype(kv_cache_dtype, x.dtype)
    return load(store(x, scale, dtype), scale, x.dtype)
