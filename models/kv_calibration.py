"""FP8 KV-cache calibration: per-layer K/V scales of the current policy over calibration tokens.

`kv_amax` runs the unquantized forward over a batch and takes, per attention layer, max |k|
and max |v| over its real tokens (the keys after the q/k norm and RoPE, the values: what a KV
cache stores). `calibrate_kv_scales` turns them into `models.kv_quant.KVScales` (amax / 448).
The rollout engine calls it at every weight install, so the FP8 cache never runs on the scales
of older weights; the trainer calls it for the scales it pushes to vLLM servers.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models import fp8
from models.decoder import Decoder
from models.functional import Params, dot_general_for, positions_from_mask, self_attention
from models.kv_quant import KVScales, kv_scales_from_amax


def kv_amax(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
) -> tuple[Float[Array, " L"], Float[Array, " L"]]:
    """Per-layer max |k| and max |v| (f32) over the real tokens of a batch: the keys (after
    the q/k norm and RoPE) and values a KV cache would store, from the unquantized forward.
    `calibrate_kv_scales` turns them into FP8 KV-cache scales."""
    model: Decoder = nnx.merge(graphdef, params)
    cfg = model.cfg
    attend = self_attention(cfg, attention_mask)
    real = attention_mask.astype(bool)[:, :, None, None]

    def attend_at(i: Array, q: Array, k: Array, v: Array, amax: tuple[Array, Array]):
        new = [jnp.max(jnp.where(real, jnp.abs(x.astype(jnp.float32)), 0.0)) for x in (k, v)]
        return attend(i, q, k, v), tuple(a.at[i].set(n) for a, n in zip(amax, new, strict=True))

    zeros = jnp.zeros((cfg.num_layers,), jnp.float32)
    _, amax, _ = model.hidden_states(
        tokens,
        positions_from_mask(attention_mask),
        attend_at,
        dot_general_for(model.cfg, recipe),
        carry=(zeros, zeros),
    )
    return amax


def calibrate_kv_scales(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    *,
    recipe: fp8.Recipe,
) -> KVScales:
    """FP8 KV-cache scales of the policy `params` on a calibration batch: amax / 448 per
    layer (`kv_amax`, `models.kv_quant.kv_scales_from_amax`)."""
    return kv_scales_from_amax(*kv_amax(graphdef, params, tokens, attention_mask, recipe=recipe))
