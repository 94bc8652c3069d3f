"""Rotary position embeddings (RoPE) in HF's rotate-half layout: the inverse frequencies with
HF's linear and Llama-3 scalings (`rope_inv_freq`), the cos/sin tables of given positions
(`rope_cos_sin`) and the rotation of queries and keys (`apply_rope`), all in f32."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from models import invariant
from models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies theta^(-2i/D), i < D/2, with Llama-3 / linear scaling, as in HF's
    `ROPE_INIT_FUNCTIONS` (computed in f32 as there)."""
    d = cfg.head_dim
    inv = (
        1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2).astype(np.float32) / d))
    ).astype(np.float32)
    scaling = cfg.rope_scaling_dict()
    if scaling is None:
        return inv
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_cos_sin(
    positions: Int[Array, "B T"], inv_freq: np.ndarray
) -> tuple[Float[Array, "B T D"], Float[Array, "B T D"]]:
    """cos/sin of angle = position * inv_freq, duplicated to the full head width (HF's
    rotate-half layout), in f32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "B T H D"],
    cos: Float[Array, "B T D"],
    sin: Float[Array, "B T D"],
    *,
    exact: bool = False,
) -> Float[Array, "B T H D"]:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (halves of the head), in f32;
    `exact`: products that are never contracted into the sum (`models.invariant.exact_mul`)."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    mul = invariant.exact_mul if exact else jnp.multiply
    out = mul(xf, cos[:, :, None, :]) + mul(rotated, sin[:, :, None, :])
    return out.astype(x.dtype)
