"""The rollout mismatch an FP8 KV cache adds: KL between the rollout policy with an FP8 cache
and with an unrounded one, on the same sequences and weights.

For a batch of rollout sequences, the rollout recipe's next-token distributions are computed
twice with the same params: reading keys and values as an FP8 KV cache holds them (E4M3 with
per-layer scales calibrated on the batch itself, amax / 448, as the engine calibrates at each
weight sync: `models.kv_calibration`) and unrounded ("auto"). Per response position t,

    KL_t = sum_v p_fp8(v | x_<t) (log p_fp8(v | x_<t) - log p_auto(v | x_<t))

exactly over the vocabulary (float64 sums), which is the part of the rollout-vs-trainer
mismatch KL that the cache's rounding adds. Reported: its mean over the response tokens and
its largest token value, and the mean |log p_fp8 - log p_auto| of the sampled tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import functional as mf
from models.fp8 import Recipe
from models.kv_calibration import calibrate_kv_scales


@functools.partial(jax.jit, static_argnums=0, static_argnames="recipe")
def _log_probs(graphdef: Any, params: Any, tokens: jax.Array, mask: jax.Array, *, recipe: Recipe):
    """(log-softmax with an FP8 cache, without one), both [B, T, V] f32."""
    scales = calibrate_kv_scales(graphdef, params, tokens, mask, recipe=recipe)
    fp8 = mf.forward(graphdef, params, tokens, mask, recipe=recipe, kv_cache_dtype="fp8",
                     kv_scales=scales)  # fmt: skip
    auto = mf.forward(graphdef, params, tokens, mask, recipe=recipe)
    return jax.nn.log_softmax(fp8, axis=-1), jax.nn.log_softmax(auto, axis=-1)


def kv_cache_mismatch(
    graphdef: Any,
    params: Any,
    tokens: np.ndarray,
    attention_mask: np.ndarray,
    prompt_lens: np.ndarray,
    response_mask: np.ndarray,
    recipe: Recipe,
) -> dict[str, float]:
    """The FP8 KV cache's share of the mismatch (module docstring) on one batch, laid out as
    `jfp8rl.data.batch.RolloutBatch`: tokens / attention_mask [N, T], response token j of row
    i at position prompt_lens[i] + j where response_mask[i, j] > 0."""
    lp8, lp = (np.asarray(x, np.float64) for x in _log_probs(
        graphdef, params, jnp.asarray(tokens), jnp.asarray(attention_mask), recipe=recipe
    ))  # fmt: skip
    rows, cols = np.nonzero(np.asarray(response_mask) > 0)
    at = np.asarray(prompt_lens)[rows] + cols  # the response token's position
    kl = np.sum(np.exp(lp8[rows, at - 1]) * (lp8[rows, at - 1] - lp[rows, at - 1]), axis=-1)
    tok = np.asarray(tokens)[rows, at]
    dlogp = lp8[rows, at - 1, tok] - lp[rows, at - 1, tok]
    if not len(kl):  # every group dropped (dynamic sampling): nothing to compare, as 0
        return dict.fromkeys(("kv_fp8_kl_mean", "kv_fp8_kl_max", "kv_fp8_abs_dlogp_mean"), 0.0)
    return {
        "kv_fp8_kl_mean": float(np.mean(kl)),
        "kv_fp8_kl_max": float(np.max(kl)),
        "kv_fp8_abs_dlogp_mean": float(np.mean(np.abs(dlogp))),
    }
