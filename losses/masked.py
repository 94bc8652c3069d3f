"""Masked reductions over [B, T] token arrays: means, quantiles and loss aggregation.

Aggregation keeps a numerator and a denominator apart (`agg_parts`) so that micro-batches and
data-parallel shards reduce exactly: sum the numerators and the denominators over shards, then
divide once (or pass the global denominator to `agg_loss`). The modes follow
`verl.trainer.ppo.core_algos.agg_loss` (0.9.x); with m the mask, l the per-token loss,
n_b = sum_t m_bt the length of sequence b and v_b = [n_b > 0]:

    token-mean               num = sum_bt m l                      den = sum_bt m
    seq-mean-token-mean      num = sum_b v_b * (sum_t m l) / n_b    den = sum_b v_b
    seq-mean-token-sum       num = sum_b sum_t m l                 den = sum_b v_b
    seq-mean-token-sum-norm  num = sum_b (sum_t m l) / L_norm      den = sum_b v_b

with L_norm = the padded length T unless `loss_scale_len` is given (Dr.GRPO asks for a
constant, e.g. the generation budget). Fully masked sequences are excluded from every sequence
mean. `seq-mean-token-sum-norm` divides by the sequence count too, as verl >= 0.6 does (earlier
verl releases divided by L_norm only: a sum over sequences, not a mean).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from losses.checks import AGG_MODES, as_float_mask, check_choice
from losses.select import order_statistics


def safe_div(num: Array, den: Array) -> Array:
    """`num / den` where `den > 0`, else 0 (never NaN or inf from an empty set)."""
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def masked_sum(x: Float[Array, "B T"], mask: Array) -> Array:
    """sum_bt m_bt x_bt; masked entries may hold any finite or non-finite value."""
    return jnp.sum(jnp.where(mask != 0, x, 0.0))


def masked_mean(x: Float[Array, "B T"], mask: Array) -> Array:
    """sum_bt m x / sum_bt m, 0 when the mask is empty."""
    return safe_div(masked_sum(x, mask), jnp.sum(as_float_mask(mask)))


def masked_max(x: Float[Array, "B T"], mask: Array) -> Array:
    """max over unmasked entries, 0 when the mask is empty."""
    m = mask != 0
    return jnp.where(jnp.any(m), jnp.max(jnp.where(m, x, -jnp.inf)), 0.0)


def masked_min(x: Float[Array, "B T"], mask: Array) -> Array:
    """min over unmasked entries, 0 when the mask is empty."""
    m = mask != 0
    return jnp.where(jnp.any(m), jnp.min(jnp.where(m, x, jnp.inf)), 0.0)


def masked_quantiles(
    x: Array, mask: Array, qs: Sequence[float], lo: float = 2.0**-8, hi: float = 2.0**8
) -> Array:
    """Lower (inverted-CDF) quantiles of the unmasked entries of a POSITIVE array (ratios).

    Quantile q is the order statistic of index floor(q * (n - 1)) of the n unmasked values (0
    when n == 0), exact, found without a sort (`losses.select`); values outside the static
    range [lo, hi] are reported as lo or hi. Returns an array of len(qs).
    """
    valid = mask != 0
    n = jnp.sum(valid.astype(jnp.float32))
    k = jnp.floor(jnp.asarray(qs, jnp.float32) * jnp.maximum(n - 1.0, 0.0))
    vals = order_statistics(jnp.clip(x.astype(jnp.float32), lo, hi), valid, k, lo, hi)
    return jnp.where(n > 0, vals, 0.0)


def agg_denominator(mask: Array, agg_mode: str) -> Array:
    """The denominator of `agg_parts` (it depends on the mask only): the token count for
    token-mean, the count of non-empty sequences for the seq-* modes. A micro-batched caller
    computes it once over the whole mini-batch and passes it as `agg_loss(denominator=...)`."""
    check_choice("agg_mode", agg_mode, AGG_MODES)
    m = as_float_mask(mask)
    if agg_mode == "token-mean":
        return jnp.sum(m)
    return jnp.sum((jnp.sum(m, axis=-1) > 0).astype(jnp.float32))


def agg_parts(
    loss_mat: Float[Array, "B T"],
    mask: Array,
    agg_mode: str,
    loss_scale_len: int | None = None,
) -> tuple[Array, Array]:
    """(numerator, denominator) of the aggregated loss; see the module docstring."""
    den = agg_denominator(mask, agg_mode)
    m = as_float_mask(mask)
    tok = jnp.where(mask != 0, loss_mat, 0.0)
    if agg_mode == "token-mean":
        return jnp.sum(tok), den
    n_b = jnp.sum(m, axis=-1)
    valid_b = (n_b > 0).astype(jnp.float32)
    seq_sum = jnp.sum(tok, axis=-1)
    if agg_mode == "seq-mean-token-mean":
        seq = safe_div(seq_sum, n_b)
    elif agg_mode == "seq-mean-token-sum":
        seq = seq_sum
    else:
        norm = loss_mat.shape[-1] if loss_scale_len is None else loss_scale_len
        if norm <= 0:
            raise ValueError(f"argument `loss_scale_len` must be positive, got {norm}")
        seq = seq_sum / float(norm)
    return jnp.sum(seq * valid_b), den


def agg_loss(
    loss_mat: Float[Array, "B T"],
    mask: Array,
    agg_mode: str,
    loss_scale_len: int | None = None,
    denominator: Array | float | None = None,
) -> tuple[Array, Array, Array]:
    """Aggregate a per-token loss: returns (loss, numerator, denominator).

    `denominator`, when given, replaces the local one: pass the global token count (token-mean)
    or the global count of non-empty sequences (seq-* modes) when this call sees one
    micro-batch or shard of a larger batch, and sum the resulting losses.
    """
    num, den = agg_parts(loss_mat, mask, agg_mode, loss_scale_len)
    if denominator is not None:
        den = jax.lax.stop_gradient(jnp.asarray(denominator, jnp.float32))
    return safe_div(num, den), num, den
