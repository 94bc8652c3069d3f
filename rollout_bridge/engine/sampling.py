"""Token sampling for the embedded engine: temperature, top-k, top-p, per-request seeds.

Pure functions on `[B, V]` logits, one row per sequence, every knob a per-row array so that a
change of temperature or top-p between RL steps never recompiles the decode loop.

The distribution a row samples from (the order and the rules follow vLLM's V1 sampler):
  1. `z = logits * (1 / T)` (float32; the reciprocal is the trainer's too,
     `models.functional.inverse_temperature`, so both scale the logits alike);
  2. top-k: keep the tokens with `z >= z_(k)`, the k-th largest value (ties at the threshold are
     kept, as vLLM does); `k <= 0` or `k >= V` disables it;
  3. top-p: sort the survivors by probability, descending; keep a token when the probability
     mass of the tokens ranked strictly above it is `< p` (so the most likely token is always
     kept; vLLM's ascending form "drop while cumsum <= 1 - p" is the same rule); `p = 1`
     disables it;
  4. `pi = softmax(z masked to -inf outside the kept set)`.

The returned logprob of a sampled token is `log pi(token)`: the log-probability under the
distribution *actually sampled from* (temperature-scaled, top-k/top-p renormalised). At
temperature 1 with no truncation this is the raw `log_softmax(logits)`.

Greedy rows (`T == 0`) take `argmax(logits)` and return the raw temperature-1, untruncated
logprob of that token, as vLLM's `processed_logprobs` mode does for greedy requests.

Randomness: row r draws step t with `fold_in(row_key[r], t)`, where `row_key` is derived from
(seed, prompt index, sample index) only, so a sample does not depend on what else is in the
batch, how the batch was padded, or which step bucket was compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt32

from models.functional import log_probs, scale_logits

_NEG_INF = -jnp.inf


def processed_logits(
    logits: Float[Array, "B V"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
) -> Float[Array, "B V"]:
    """Temperature-scaled logits with tokens outside top-k / top-p set to -inf.

    `log_softmax` of the result is the sampling distribution `log pi` of the module docstring.
    Rows with `temperature == 0` are scaled by 1 (they are decoded greedily).
    """
    z_BxV = logits.astype(jnp.float32)
    vocab = z_BxV.shape[-1]
    t_B = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    z_BxV = scale_logits(z_BxV, (jnp.float32(1.0) / t_B)[:, None])

    k_B = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).astype(jnp.int32)
    truncated = jnp.any(k_B < vocab) | jnp.any(top_p < 1.0)
    # Without top-k / top-p in any row every token is kept: skip the vocabulary sort (the
    # truncating branch would keep the logits unchanged too, at the cost of a [B, V] sort).
    return jax.lax.cond(truncated, _truncate, lambda z, k, p: z, z_BxV, k_B, top_p)


def _truncate(
    z_BxV: Float[Array, "B V"], k_B: Int[Array, " B"], top_p: Float[Array, " B"]
) -> Float[Array, "B V"]:
    """`z` with the tokens outside each row's top-k (k = V: off) and top-p set to -inf."""
    sorted_BxV = -jnp.sort(-z_BxV, axis=-1)  # descending
    kth_B = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=-1)[:, 0]
    z_BxV = jnp.where(z_BxV >= kth_B[:, None], z_BxV, _NEG_INF)

    # Top-p on the top-k survivors, in sorted order; the mass strictly above a token is the
    # exclusive cumulative sum. Mapping back through a threshold value keeps ties together.
    sorted_BxV = jnp.where(sorted_BxV >= kth_B[:, None], sorted_BxV, _NEG_INF)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    above_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    keep_BxV = above_BxV < top_p.astype(jnp.float32)[:, None]
    keep_BxV = keep_BxV.at[:, 0].set(True)
    n_keep_B = jnp.sum(keep_BxV, axis=-1)
    pth_B = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)[:, 0]
    apply_p_B = top_p < 1.0
    return jnp.where(apply_p_B[:, None] & (z_BxV < pth_B[:, None]), _NEG_INF, z_BxV)


def row_keys(
    seed_lo: UInt32[Array, " B"],
    seed_hi: UInt32[Array, " B"],
    prompt_index: Int[Array, " B"],
    sample_index: Int[Array, " B"],
) -> Array:
    """One PRNG key per row from (64-bit seed split in two words, prompt index, sample index)."""

    def one(lo, hi, i, j):
        key = jax.random.fold_in(jax.random.key(0), lo)
        key = jax.random.fold_in(key, hi)
        key = jax.random.fold_in(key, i)
        return jax.random.fold_in(key, j)

    return jax.vmap(one)(seed_lo, seed_hi, prompt_index, sample_index)


def sample_tokens(
    logits: Float[Array, "B V"],
    keys: Array,
    step: Int[Array, ""],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    *,
    exact: bool = False,
) -> tuple[Int[Array, " B"], Float[Array, " B"]]:
    """Draws one token per row and returns `(token, log pi(token))` (module docstring);
    `exact`: the log-softmax of a batch-invariant model (`models.functional.log_probs`).

    Args:
      logits: next-token logits of each row.
      keys: per-row PRNG keys from `row_keys`; this call uses `fold_in(keys[r], step)`.
      step: index of the token being drawn within the response (0-based).
      temperature, top_k, top_p: per-row sampling parameters.
    """
    z_BxV = processed_logits(logits, temperature, top_k, top_p)
    logpi_BxV = log_probs(z_BxV, exact=exact)
    is_greedy_B = temperature <= 0
    zeros_B = jnp.zeros(is_greedy_B.shape, jnp.int32)
    drawn_B = jax.lax.cond(
        jnp.all(is_greedy_B),
        lambda keys, lp: zeros_B,
        _gumbel_max,
        jax.vmap(lambda k: jax.random.fold_in(k, step))(keys),
        logpi_BxV,
    )
    # Greedy rows: the argmax of the raw log-softmax and its logprob (skipped without any).
    greedy_B, lp_raw_B = jax.lax.cond(
        jnp.any(is_greedy_B),
        _greedy,
        lambda lg: (zeros_B, jnp.zeros(zeros_B.shape, jnp.float32)),
        logits,
    )
    token_B = jnp.where(is_greedy_B, greedy_B, drawn_B).astype(jnp.int32)
    lp_sampled_B = jnp.take_along_axis(logpi_BxV, token_B[:, None], axis=-1)[:, 0]
    return token_B, jnp.where(is_greedy_B, lp_raw_B, lp_sampled_B)


def _gumbel_max(step_keys: Array, logpi_BxV: Float[Array, "B V"]) -> Int[Array, " B"]:
    """`jax.random.categorical(step_keys[r], logpi[r])` per row, the same draw: the argmax of
    Gumbel noise + logpi. The noise is materialised before the argmax (fused into the argmax's
    reduction it is computed several times slower on the CPU backend)."""
    noise_BxV = jax.vmap(lambda k: jax.random.gumbel(k, logpi_BxV.shape[-1:]))(step_keys)
    noise_BxV = jax.lax.optimization_barrier(noise_BxV)
    return first_argmax(noise_BxV + logpi_BxV)


def _greedy(logits: Float[Array, "B V"]) -> tuple[Int[Array, " B"], Float[Array, " B"]]:
    """Per row the argmax of the raw (temperature-1) log-softmax and its logprob."""
    raw_BxV = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_B = first_argmax(raw_BxV)
    return token_B, jnp.take_along_axis(raw_BxV, token_B[:, None], axis=-1)[:, 0]


def first_argmax(x_BxV: Float[Array, "B V"]) -> Int[Array, " B"]:
    """`jnp.argmax(x, axis=-1)` (the first index of the largest value, a NaN counting as the
    largest) as two plain reductions, a max and a min of indices, which the CPU backend
    vectorises (a fused value-and-index reduction it does not)."""
    nan_BxV = jnp.isnan(x_BxV)
    top_B = jnp.max(x_BxV, axis=-1, keepdims=True)
    hit_BxV = jnp.where(jnp.any(nan_BxV, axis=-1, keepdims=True), nan_BxV, x_BxV == top_B)
    idx = jnp.arange(x_BxV.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit_BxV, idx, x_BxV.shape[-1]), axis=-1)


def is_stop(token: Int[Array, " B"], stop_ids: Int[Array, "B S"]) -> Bool[Array, " B"]:
    """True where `token` is one of the row's stop ids (rows pad `stop_ids` with -1)."""
    return jnp.any(token[:, None] == stop_ids, axis=-1)
