"""Clipping statistics of one set of ratios: the balance, the kept-share ratio, clip shares,
and the BF16 reference statistics alpha, p_ref, beta_up (definitions in `losses.calibrated`).

N = {A < 0} and P = {A > 0} over the response tokens (mask != 0); every share is over N or
over P, not over all tokens. All results are stop-gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from losses.calibrated.config import CalibConfig
from losses.masked import safe_div
from losses.policy import check_token_inputs

_F32 = jnp.float32


def prep_ratios(r: Array, adv: Array, mask: Array, r_name: str) -> tuple[Array, Array, Array]:
    """Checked, stop-gradient f32 (r, adv, on): masked tokens get r = 1 and A = 0."""
    check_token_inputs(mask, **{r_name: r}, adv=adv)
    on = mask != 0
    r = jax.lax.stop_gradient(jnp.where(on, r.astype(_F32), 1.0))
    adv = jax.lax.stop_gradient(jnp.where(on, adv.astype(_F32), 0.0))
    return r, adv, on


def balance_parts(
    lo: Array | float, hi: Array | float, r: Array, adv: Array, on: Array
) -> tuple[Array, Array]:
    """Numerator and denominator of the balance at bounds (lo, hi), of prepared inputs."""
    lo, hi = jnp.asarray(lo, _F32), jnp.asarray(hi, _F32)
    num = jnp.sum(jnp.where(on & (adv > 0) & (r < hi), adv * r, 0.0))
    den = jnp.sum(jnp.where(on & (adv < 0) & (r > lo), -adv * r, 0.0))
    return num, den


def unclipped_balance(r: Array, adv: Array, on: Array) -> Array:
    """balance(0, inf, r) of prepared inputs: all of P over all of N (0 when N is empty)."""
    return safe_div(*balance_parts(-jnp.inf, jnp.inf, r, adv, on))


def share_of(cond: Array, subset: Array) -> tuple[Array, Array]:
    """(share of `subset` where `cond` holds, size of `subset`); share 0 when it is empty."""
    n = jnp.sum(subset.astype(_F32))
    return safe_div(jnp.sum((cond & subset).astype(_F32)), n), n


def balance(
    lo: float | Array,
    hi: float | Array,
    r: Float[Array, "B T"],
    adv: Float[Array, "B T"],
    mask: Array,
) -> Array:
    """sum_{P, r < hi} A r / sum_{N, r > lo} |A| r over response tokens; 0 if the denominator
    is 0 (no negative-advantage token above `lo`)."""
    r, adv, on = prep_ratios(r, adv, mask, "r")
    return safe_div(*balance_parts(lo, hi, r, adv, on))


def balance_share(
    lo: float | Array,
    hi: float | Array,
    r: Float[Array, "B T"],
    adv: Float[Array, "B T"],
    mask: Array,
) -> Array:
    """share(lo, hi, r) = balance(lo, hi, r) / balance(0, inf, r): the share of P's mass
    A r kept below `hi` over the share of N's mass |A| r kept above `lo`; 0 if undefined."""
    r, adv, on = prep_ratios(r, adv, mask, "r")
    return safe_div(safe_div(*balance_parts(lo, hi, r, adv, on)), unclipped_balance(r, adv, on))


def clip_stats(
    lo: float | Array,
    hi: float | Array,
    r: Float[Array, "B T"],
    adv: Float[Array, "B T"],
    mask: Array,
) -> dict[str, Array]:
    """What bounds (lo, hi) do to one set of ratios: `neg_lower` the share of N with r < lo
    (penalising gradient zeroed), `pos_upper` the share of P with r > hi, `balance`
    balance(lo, hi, r), and the counts `n_neg`, `n_pos` (the audit's columns)."""
    r, adv, on = prep_ratios(r, adv, mask, "r")
    lo, hi = jnp.asarray(lo, _F32), jnp.asarray(hi, _F32)
    neg_lower, n_neg = share_of(r < lo, on & (adv < 0))
    pos_upper, n_pos = share_of(r > hi, on & (adv > 0))
    return {
        "neg_lower": neg_lower,
        "pos_upper": pos_upper,
        "balance": safe_div(*balance_parts(lo, hi, r, adv, on)),
        "n_neg": n_neg,
        "n_pos": n_pos,
    }


def reference_stats(
    r_bf16: Float[Array, "B T"], adv: Float[Array, "B T"], mask: Array, cfg: CalibConfig
) -> dict[str, Array]:
    """alpha, p_ref, beta_up of the BF16 ratios and whether each is defined (`*_ok`);
    `balance_bf16` is the absolute BF16 balance at the plain bounds (= p_ref when absolute)."""
    r, adv, on = prep_ratios(r_bf16, adv, mask, "r_bf16")
    lo, hi = cfg.plain_bounds
    neg, pos = on & (adv < 0), on & (adv > 0)
    alpha, n_neg = share_of(r < lo, neg)
    beta_up, n_pos = share_of(r > hi, pos)
    num, den = balance_parts(lo, hi, r, adv, on)
    p_ref = safe_div(num, den)
    if cfg.balance == "relative":  # n_pos > 0 and den > 0 imply balance(0, inf) > 0
        p_ref = safe_div(p_ref, unclipped_balance(r, adv, on))
    return {
        "alpha": alpha,
        "p_ref": p_ref,
        "balance_bf16": safe_div(num, den),
        "beta_up": beta_up,
        "alpha_ok": n_neg > 0,
        "p_ref_ok": (n_neg > 0) & (n_pos > 0) & (den > 0),
        "beta_up_ok": n_pos > 0,
    }
