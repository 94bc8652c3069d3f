"""Calibrated Clipping across steps: the `CalibState` pytree, calibration, per-mini-batch bounds.

Where EMA smoothing is applied: (1) in `calibrate` (each calibration step: new bounds from that
batch's FP8 ratios, smoothed with the stored ones; the very first calibration stores the raw
bounds), and (2) in `current_bounds` in `track` mode (each mini-batch: new bounds from its FP8
ratios with the stored alpha / p_ref / beta_up, smoothed with the stored bounds, which are then
replaced). `hold` mode returns the stored bounds unchanged. alpha, p_ref and beta_up are not
smoothed: each calibration replaces them (when defined). Before the first calibration the plain
bounds apply. A track update skips mini-batches whose ratios are all exactly 1 (on-policy,
before any update): they carry no information about the FP8 noise and would drag L and H to 1.

All returned bounds are stop-gradient. The caller threads `CalibState` through its steps and
saves it with its checkpoint (it is a pytree of arrays).

Metrics (`calib/*`, docs/design.md section 8; shares of N / P, not of all tokens):
    calib/lower, calib/upper                     the bounds after this call
    calib/lower_raw, calib/upper_raw             this batch's solution before smoothing
    calib/alpha, calib/p_ref, calib/beta_up      reference stats in use
    calib/bf16_clipfrac_neg_lower                = alpha of this calibration
    calib/bf16_clipfrac_pos_upper                = beta_up of this calibration
    calib/fp8_clipfrac_neg_lower_plain|calibrated  share of N with r8 < 1 - eps_low | < L
    calib/balance_fp8_plain                      balance(1 - eps_low, 1 + eps_high, r8)
    calib/balance_fp8_calibrated                 balance(L, H, r8)
    calib/balance_fp8_unclipped                  balance(0, inf, r8): the advantage mix term
    calib/balance_bf16                           balance(1 - eps_low, 1 + eps_high, r16) of
                                                 this calibration (= p_ref when absolute)
    calib/updated                                1 when this call moved the bounds
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Bool, Float, Int

from losses.calibrated.config import CalibConfig
from losses.calibrated.solve import solve_bounds
from losses.calibrated.stats import (
    balance_parts,
    prep_ratios,
    reference_stats,
    share_of,
    unclipped_balance,
)
from losses.masked import safe_div


@dataclasses.dataclass(frozen=True)
class CalibState:
    """Calibration state carried between steps (a pytree of scalar arrays)."""

    lower: Float[Array, ""]  # current lower bound L
    upper: Float[Array, ""]  # current upper bound H
    alpha: Float[Array, ""]  # BF16 share of N below 1 - eps_low (last calibration)
    p_ref: Float[Array, ""]  # BF16 balance (or share, `balance: relative`) at the plain bounds
    beta_up: Float[Array, ""]  # BF16 share of P above 1 + eps_high (last calibration)
    alpha_ok: Bool[Array, ""]  # alpha was defined (N non-empty) at some calibration
    p_ref_ok: Bool[Array, ""]  # p_ref was defined (N, P non-empty, denominator > 0)
    beta_up_ok: Bool[Array, ""]  # beta_up was defined (P non-empty)
    initialized: Bool[Array, ""]  # at least one calibration happened
    n_calibrations: Int[Array, ""]  # calibrations so far
    n_updates: Int[Array, ""]  # track-mode bound updates so far

    def reference(self) -> dict[str, Array]:
        """The stored reference statistics, keyed as `reference_stats` returns them (the
        `stats` argument of `solve_bounds`)."""
        names = ("alpha", "p_ref", "beta_up", "alpha_ok", "p_ref_ok", "beta_up_ok")
        return {name: getattr(self, name) for name in names}


jax.tree_util.register_dataclass(
    CalibState,
    data_fields=[f.name for f in dataclasses.fields(CalibState)],
    meta_fields=[],
)


def init_calib_state(cfg: CalibConfig) -> CalibState:
    """State before any calibration: the plain bounds, no reference stats."""
    lo, hi = cfg.plain_bounds
    f = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    b = lambda v: jnp.asarray(v, jnp.bool_)  # noqa: E731
    return CalibState(
        lower=f(lo),
        upper=f(hi),
        alpha=f(0.0),
        p_ref=f(0.0),
        beta_up=f(0.0),
        alpha_ok=b(False),
        p_ref_ok=b(False),
        beta_up_ok=b(False),
        initialized=b(False),
        n_calibrations=jnp.asarray(0, jnp.int32),
        n_updates=jnp.asarray(0, jnp.int32),
    )


def _fp8_metrics(
    lo: Array, hi: Array, r_fp8: Array, adv: Array, mask: Array, cfg: CalibConfig
) -> dict[str, Array]:
    r, a, on = prep_ratios(r_fp8, adv, mask, "r_fp8")
    plain_lo, plain_hi = cfg.plain_bounds
    neg = on & (a < 0)
    return {
        "calib/fp8_clipfrac_neg_lower_plain": share_of(r < plain_lo, neg)[0],
        "calib/fp8_clipfrac_neg_lower_calibrated": share_of(r < lo, neg)[0],
        "calib/balance_fp8_plain": safe_div(*balance_parts(plain_lo, plain_hi, r, a, on)),
        "calib/balance_fp8_calibrated": safe_div(*balance_parts(lo, hi, r, a, on)),
        "calib/balance_fp8_unclipped": unclipped_balance(r, a, on),
    }


def calibrate(
    state: CalibState,
    cfg: CalibConfig,
    r_fp8: Float[Array, "B T"],
    r_bf16: Float[Array, "B T"],
    adv: Float[Array, "B T"],
    mask: Array,
) -> tuple[CalibState, dict[str, Array]]:
    """One calibration: reference stats from BF16 ratios, bounds from FP8 ratios, smoothing.

    r_fp8 / r_bf16: ratios pi_theta / pi_old of the same tokens under the FP8 and BF16 recipes
    (same params); adv: token advantages [B, T]; mask: response mask. Returns the new state
    and `calib/*` metrics. Stats undefined in this batch (empty N or P) keep their old values.
    """
    ref = reference_stats(r_bf16, adv, mask, cfg)
    stats = {
        name: jnp.where(ref[ok], ref[name], getattr(state, name))
        for name, ok in (("alpha", "alpha_ok"), ("p_ref", "p_ref_ok"), ("beta_up", "beta_up_ok"))
    }
    for ok in ("alpha_ok", "p_ref_ok", "beta_up_ok"):
        stats[ok] = ref[ok] | getattr(state, ok)
    lo_raw, hi_raw = solve_bounds(stats, r_fp8, adv, mask, cfg)
    lo = jnp.where(state.initialized, cfg.ema * state.lower + (1 - cfg.ema) * lo_raw, lo_raw)
    hi = jnp.where(state.initialized, cfg.ema * state.upper + (1 - cfg.ema) * hi_raw, hi_raw)
    new = CalibState(
        lower=lo,
        upper=hi,
        initialized=jnp.asarray(True),
        n_calibrations=state.n_calibrations + 1,
        n_updates=state.n_updates,
        **stats,
    )
    aux = {
        "calib/lower": lo,
        "calib/upper": hi,
        "calib/lower_raw": lo_raw,
        "calib/upper_raw": hi_raw,
        "calib/alpha": stats["alpha"],
        "calib/p_ref": stats["p_ref"],
        "calib/beta_up": stats["beta_up"],
        "calib/bf16_clipfrac_neg_lower": ref["alpha"],
        "calib/bf16_clipfrac_pos_upper": ref["beta_up"],
        "calib/balance_bf16": ref["balance_bf16"],
        "calib/updated": jnp.asarray(1.0, jnp.float32),
        **_fp8_metrics(lo, hi, r_fp8, adv, mask, cfg),
    }
    return new, aux


def current_bounds(
    state: CalibState,
    cfg: CalibConfig,
    r_fp8: Float[Array, "B T"],
    adv: Float[Array, "B T"],
    mask: Array,
    on_policy: bool | Bool[Array, ""] = False,
) -> tuple[CalibState, Array, Array, dict[str, Array]]:
    """Bounds (lo, hi) for this mini-batch's loss, and the state to carry on.

    Before the first calibration: the plain bounds, state unchanged. `hold`: the stored bounds.
    `track`: re-solve L, H from these FP8 ratios with the stored alpha / p_ref / beta_up,
    smooth them with the stored bounds (EMA), store and return them. An on-policy mini-batch
    (params == old params: pass `on_policy=True`, e.g. the first mini-batch of a step) or one
    whose ratios are all exactly 1 leaves the state unchanged. The caller's flag is what makes
    this robust: an on-policy r is 1 only up to the rounding of two compiled programs (1 ulp
    apart with another device count or jax version), and bounds solved from that noise would
    drag the EMA towards 1. Returns (state, lo, hi, aux); lo and hi are stop-gradient scalars.
    """
    plain_lo, plain_hi = cfg.plain_bounds
    if cfg.mode == "hold":
        lo = jnp.where(state.initialized, state.lower, plain_lo)
        hi = jnp.where(state.initialized, state.upper, plain_hi)
        new = state
        updated = jnp.asarray(False)
        lo_raw, hi_raw = lo, hi
    else:
        lo_raw, hi_raw = solve_bounds(state.reference(), r_fp8, adv, mask, cfg)
        r_on = jnp.where(mask != 0, jax.lax.stop_gradient(r_fp8), 1.0)
        informative = jnp.any(r_on != 1.0) & ~jnp.asarray(on_policy)
        updated = state.initialized & informative
        lo = jnp.where(updated, cfg.ema * state.lower + (1 - cfg.ema) * lo_raw, state.lower)
        hi = jnp.where(updated, cfg.ema * state.upper + (1 - cfg.ema) * hi_raw, state.upper)
        new = dataclasses.replace(
            state, lower=lo, upper=hi, n_updates=state.n_updates + updated.astype(jnp.int32)
        )
        lo = jnp.where(state.initialized, lo, plain_lo)
        hi = jnp.where(state.initialized, hi, plain_hi)
    lo = jax.lax.stop_gradient(jnp.asarray(lo, jnp.float32))
    hi = jax.lax.stop_gradient(jnp.asarray(hi, jnp.float32))
    aux = {
        "calib/lower": lo,
        "calib/upper": hi,
        "calib/lower_raw": lo_raw,
        "calib/upper_raw": hi_raw,
        "calib/alpha": state.alpha,
        "calib/p_ref": state.p_ref,
        "calib/beta_up": state.beta_up,
        "calib/updated": updated.astype(jnp.float32),
        **_fp8_metrics(lo, hi, r_fp8, adv, mask, cfg),
    }
    return new, lo, hi, aux
