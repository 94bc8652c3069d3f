"""Calibrated Clipping: FP8 clipping bounds matched to the BF16 clipping behaviour.

Reconstruction of the paper's method (PAPER.md; spec in DESIGN.md section 5). Per mini-batch,
r8 = FP8 ratios pi_theta / pi_old of the response tokens, r16 = the BF16 ratios of the same
tokens (calibration steps only), A the token advantages, N = {A < 0}, P = {A > 0}:

    balance(l, h, r)  = sum_{t in P, r_t < h} A_t r_t  /  sum_{t in N, r_t > l} |A_t| r_t
                        (0 when the denominator is 0)
    share(l, h, r)    = balance(l, h, r) / balance(0, inf, r)
                      = (share of P's mass A r kept below h) / (share of N's mass kept above l)
    reference stats   alpha   = mean_{t in N} [r16_t < 1 - eps_low]    (BF16 lower clip share)
                      p_ref   = balance(1 - eps_low, 1 + eps_high, r16)   (`balance: absolute`)
                              = share(1 - eps_low, 1 + eps_high, r16)     (`balance: relative`)
                      beta_up = mean_{t in P} [r16_t > 1 + eps_high]   (BF16 upper clip share)
    lower bound       L: an alpha-quantile of {r8_t : t in N}, clamped to [range_lo, 1]
    upper bound       balance rule : the smallest h >= 1 with balance(L, h, r8) >= target,
                                     target = p_ref                         (absolute)
                                            = p_ref * balance(0, inf, r8)   (relative: the
                                              smallest h with share(L, h, r8) >= p_ref),
                      quantile rule: a (1 - beta_up)-quantile of {r8_t : t in P};
                      plain rule   : 1 + eps_high (only L is calibrated: the paper's
                                     Fig. 5 lower-only ablation);
                      clamped to [1, range_hi]
    smoothing         L <- ema * L_prev + (1 - ema) * L_new, same for H

Choices made here (where the spec leaves room), all static-shaped and NaN-free:

* Quantiles and thresholds are exact on the float32 grid but found without a sort: two
  histogram passes over the bit patterns of the ratios (`losses.select.search_min`); a sort
  of B*T keys cost ~50x the plain loss on CPU. With k = round(alpha |N|), every L in
  (x_(k-1), x_(k)] (x = sorted N ratios, x_(-1) = -inf, x_(|N|) = +inf) clips exactly k
  tokens of N (r < L): we take the point of that interval nearest to the plain bound
  1 - eps_low. So the clipped share equals alpha within 1/(2|N|), and when FP8 ratios equal
  BF16 ratios L == 1 - eps_low exactly.
* Balance rule: balance(L, h) is a non-decreasing step function of h; with y the sorted P
  ratios and j the first index where the running sum of A r reaches p_ref * den, the h that
  reach p_ref are exactly h > y_j, and H = the smallest of them (one ulp above y_j; any
  h <= y_j fails). Exception: if 1 + eps_high reaches p_ref with the same P tokens below it
  (same clipped set, same balance), H = 1 + eps_high, so FP8 == BF16 gives the plain bound
  exactly. The target is p_ref * den * (1 - `cfg.solver_rtol`) (1e-5) against float32
  summation-order noise. If no h <= range_hi reaches p_ref, H = range_hi (the h with the
  highest balance).
* Absolute vs relative balance. The absolute balance of a mini-batch is dominated by its
  advantage mix (which sequences of which groups landed in it, their lengths), not by the
  ratios: at r = 1 it is sum_P A / sum_N |A| over its tokens, which spreads by tens of percent
  over random quarters of one step's batch (group-normalised A sums to 0 per group only over
  the whole group). In `track` mode the stored p_ref comes from another mini-batch, so the
  absolute rule chases that mix difference and drives H to a clamp (docs/fp8_study.md, "Why
  the calibrated upper bound swung"). The relative rule matches the ratio of kept shares,
  which the mix cancels from: it is invariant to scaling all A of P (or of N) by a constant,
  and on its own batch its target differs from the absolute one only by the FP8 vs BF16
  difference of the unclipped balance (so FP8 == BF16 ratios still give the plain bounds).
* Quantile rule: m = round(beta_up |P|); H in [y_(|P|-m-1), y_(|P|-m)) leaves exactly m
  tokens of P above H (clipped: r > H); the point nearest to 1 + eps_high.
* Fallbacks: the plain bound is used for L when N is empty (in the batch or in the reference),
  for H when P is empty, when the reference balance was undefined, or when the FP8 balance
  denominator is 0. Before the first calibration the plain bounds apply.
* Where EMA smoothing is applied: (1) in `calibrate` (each calibration step: new bounds from
  that batch's FP8 ratios, smoothed with the stored ones; the very first calibration stores
  the raw bounds), and (2) in `current_bounds` in `track` mode (each mini-batch: new bounds
  from its FP8 ratios with the stored alpha / p_ref / beta_up, smoothed with the stored
  bounds, which are then replaced). `hold` mode returns the stored bounds unchanged.
  alpha, p_ref and beta_up are not smoothed: each calibration replaces them (when defined).
* A track update skips mini-batches whose ratios are all exactly 1 (on-policy, before any
  update): they carry no information about the FP8 noise and would drag L and H to 1.
* With data parallelism call these on the global batch (jit with sharded inputs computes
  global histograms and sums).

All returned bounds are stop-gradient. The caller threads `CalibState` through its steps and
saves it with its checkpoint (it is a pytree of arrays).

Metrics (`calib/*`, DESIGN.md section 8; shares of N / P, not of all tokens):
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

from losses.checks import check_choice
from losses.masked import safe_div
from losses.policy import check_token_inputs
from losses.select import prev_float, search_min

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibConfig:
    """Static configuration of Calibrated Clipping (hashable: safe as a jit static argument)."""

    eps_low: float = 0.2  # plain lower bound is 1 - eps_low
    eps_high: float = 0.28  # plain upper bound is 1 + eps_high (DAPO clip-higher; 0.2 for GRPO)
    every: int = 20  # calibrate (BF16 shadow pass) every `every` trainer steps
    ema: float = 0.9  # smoothing weight of the previous bound
    range: tuple[float, float] = (0.6, 1.8)  # clamps: L in [range[0], 1], H in [1, range[1]]
    # "hold": solve L, H on calibrating mini-batches only and keep them; "track": re-solve
    # them per mini-batch from the stored alpha / p_ref (drifts with each mini-batch's
    # advantage mix and PPO position: docs/fp8_study.md).
    mode: str = "hold"
    upper_rule: str = "balance"  # "balance", "quantile" or "plain" (1 + eps_high: lower only)
    # Balance target of the "balance" upper rule: "absolute" (BF16 balance p_ref, the spec's
    # literal rule) or "relative" (BF16 share of kept P mass over kept N mass; cancels the
    # mini-batch's advantage mix, see the module docstring).
    balance: str = "absolute"
    solver_rtol: float = 1e-5  # relative slack of the balance target (float32 summation noise)

    def __post_init__(self) -> None:
        check_choice("CalibConfig.mode", self.mode, ("track", "hold"))
        check_choice("CalibConfig.upper_rule", self.upper_rule, ("balance", "quantile", "plain"))
        check_choice("CalibConfig.balance", self.balance, ("absolute", "relative"))
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise ValueError(
                f"CalibConfig.eps_low must be in [0, 1) and eps_high >= 0, got "
                f"eps_low={self.eps_low}, eps_high={self.eps_high}"
            )
        if self.every < 1:
            raise ValueError(f"CalibConfig.every must be >= 1, got {self.every}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"CalibConfig.ema must be in [0, 1), got {self.ema}")
        lo, hi = self.range
        if not (0.0 < lo <= 1.0 - self.eps_low and 1.0 + self.eps_high <= hi):
            raise ValueError(
                f"CalibConfig.range={self.range} must satisfy 0 < range[0] <= 1 - eps_low and "
                f"1 + eps_high <= range[1], so the plain bounds lie inside it"
            )

    @property
    def plain_bounds(self) -> tuple[float, float]:
        """(1 - eps_low, 1 + eps_high)."""
        return 1.0 - self.eps_low, 1.0 + self.eps_high

    def is_calibration_step(self, step: int) -> bool:
        """True on steps 0, every, 2 * every, ... (the trainer runs the BF16 shadow pass)."""
        return step % self.every == 0


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


jax.tree_util.register_dataclass(
    CalibState,
    data_fields=[f.name for f in dataclasses.fields(CalibState)],
    meta_fields=[],
)


def init_calib_state(cfg: CalibConfig) -> CalibState:
    """State before any calibration: the plain bounds, no reference stats."""
    lo, hi = cfg.plain_bounds
    f = lambda v: jnp.asarray(v, _F32)  # noqa: E731
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


def _prep(r: Array, adv: Array, mask: Array, r_name: str) -> tuple[Array, Array, Array]:
    check_token_inputs(mask, **{r_name: r}, adv=adv)
    on = mask != 0
    r = jax.lax.stop_gradient(jnp.where(on, r.astype(_F32), 1.0))
    adv = jax.lax.stop_gradient(jnp.where(on, adv.astype(_F32), 0.0))
    return r, adv, on


def _balance_parts(
    lo: Array | float, hi: Array | float, r: Array, adv: Array, on: Array
) -> tuple[Array, Array]:
    """Numerator and denominator of the balance at bounds (lo, hi)."""
    lo, hi = jnp.asarray(lo, _F32), jnp.asarray(hi, _F32)
    num = jnp.sum(jnp.where(on & (adv > 0) & (r < hi), adv * r, 0.0))
    den = jnp.sum(jnp.where(on & (adv < 0) & (r > lo), -adv * r, 0.0))
    return num, den


def balance(
    lo: float | Array,
    hi: float | Array,
    r: Float[Array, "B T"],
    adv: Float[Array, "B T"],
    mask: Array,
) -> Array:
    """sum_{P, r < hi} A r / sum_{N, r > lo} |A| r over response tokens; 0 if the denominator
    is 0 (no negative-advantage token above `lo`)."""
    r, adv, on = _prep(r, adv, mask, "r")
    return safe_div(*_balance_parts(lo, hi, r, adv, on))


def _unclipped_balance(r: Array, adv: Array, on: Array) -> Array:
    """balance(0, inf, r): all of P over all of N (0 when N is empty)."""
    return safe_div(*_balance_parts(-jnp.inf, jnp.inf, r, adv, on))


def balance_share(
    lo: float | Array,
    hi: float | Array,
    r: Float[Array, "B T"],
    adv: Float[Array, "B T"],
    mask: Array,
) -> Array:
    """share(lo, hi, r) = balance(lo, hi, r) / balance(0, inf, r): the share of P's mass
    A r kept below `hi` over the share of N's mass |A| r kept above `lo`; 0 if undefined."""
    r, adv, on = _prep(r, adv, mask, "r")
    return safe_div(safe_div(*_balance_parts(lo, hi, r, adv, on)), _unclipped_balance(r, adv, on))


def _share(cond: Array, subset: Array) -> tuple[Array, Array]:
    n = jnp.sum(subset.astype(_F32))
    return safe_div(jnp.sum((cond & subset).astype(_F32)), n), n


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
    r, adv, on = _prep(r, adv, mask, "r")
    lo, hi = jnp.asarray(lo, _F32), jnp.asarray(hi, _F32)
    neg_lower, n_neg = _share(r < lo, on & (adv < 0))
    pos_upper, n_pos = _share(r > hi, on & (adv > 0))
    return {
        "neg_lower": neg_lower,
        "pos_upper": pos_upper,
        "balance": safe_div(*_balance_parts(lo, hi, r, adv, on)),
        "n_neg": n_neg,
        "n_pos": n_pos,
    }


def reference_stats(
    r_bf16: Float[Array, "B T"], adv: Float[Array, "B T"], mask: Array, cfg: CalibConfig
) -> dict[str, Array]:
    """alpha, p_ref, beta_up of the BF16 ratios and whether each is defined (`*_ok`);
    `balance_bf16` is the absolute BF16 balance at the plain bounds (= p_ref when absolute)."""
    r, adv, on = _prep(r_bf16, adv, mask, "r_bf16")
    lo, hi = cfg.plain_bounds
    neg, pos = on & (adv < 0), on & (adv > 0)
    alpha, n_neg = _share(r < lo, neg)
    beta_up, n_pos = _share(r > hi, pos)
    num, den = _balance_parts(lo, hi, r, adv, on)
    p_ref = safe_div(num, den)
    if cfg.balance == "relative":  # n_pos > 0 and den > 0 imply balance(0, inf) > 0
        p_ref = safe_div(p_ref, _unclipped_balance(r, adv, on))
    return {
        "alpha": alpha,
        "p_ref": p_ref,
        "balance_bf16": safe_div(num, den),
        "beta_up": beta_up,
        "alpha_ok": n_neg > 0,
        "p_ref_ok": (n_neg > 0) & (n_pos > 0) & (den > 0),
        "beta_up_ok": n_pos > 0,
    }


def solve_bounds(
    stats: dict[str, Array],
    r_fp8: Float[Array, "B T"],
    adv: Float[Array, "B T"],
    mask: Array,
    cfg: CalibConfig,
) -> tuple[Array, Array]:
    """Raw (L, H) from FP8 ratios given reference stats (keys of `reference_stats`); clamped,
    not smoothed. See the module docstring for the exact rules and fallbacks."""
    r, adv, on = _prep(r_fp8, adv, mask, "r_fp8")
    plain_lo, plain_hi = cfg.plain_bounds
    range_lo, range_hi = cfg.range
    v, a, o = r.reshape(-1), adv.reshape(-1), on.reshape(-1)
    neg, pos = o & (a < 0), o & (a > 0)
    neg_w, pos_w = neg.astype(_F32), pos.astype(_F32)
    n_neg, n_pos = jnp.sum(neg_w), jnp.sum(pos_w)

    # Lower: L must leave exactly k tokens of N strictly below it. c(x) = #{N : r < x}.
    k = jnp.clip(jnp.round(stats["alpha"] * n_neg), 0.0, n_neg)
    c_plain = jnp.sum(jnp.where(v < plain_lo, neg_w, 0.0))
    too_many = c_plain > k  # plain clips too many: L = x_(k) = the largest x with c(x) <= k
    x, found = search_min(v, neg_w, jnp.where(too_many, k + 1.0, k), range_lo, 1.0)
    x = jnp.where(found, x, 1.0)
    lower = jnp.where(c_plain == k, plain_lo, jnp.where(too_many, prev_float(x), x))
    lower = jnp.clip(lower, range_lo, 1.0)
    lower = jnp.where(stats["alpha_ok"] & (n_neg > 0), lower, plain_lo)

    if cfg.upper_rule == "balance":
        den = jnp.sum(jnp.where(neg & (v > lower), -a * v, 0.0))
        w = jnp.where(pos, a * v, 0.0)
        target = _balance_target(stats["p_ref"], r, adv, on, cfg) * den * (1.0 - cfg.solver_rtol)
        h_min, found = search_min(v, w, target, 1.0, range_hi)

        def n_below(h: Array | float) -> Array:
            return jnp.sum(jnp.where(v < h, pos_w, 0.0))

        # 1 + eps_high is kept when it includes the same P tokens as the smallest passing h.
        plain_ok = (jnp.sum(jnp.where(v < plain_hi, w, 0.0)) >= target) & (
            n_below(plain_hi) == n_below(h_min)
        )
        upper = jnp.where(found, jnp.where(plain_ok, plain_hi, h_min), range_hi)
        ok = stats["p_ref_ok"] & (n_pos > 0) & (den > 0)
    elif cfg.upper_rule == "plain":
        upper, ok = jnp.asarray(plain_hi, _F32), jnp.asarray(True)
    else:
        # H must leave exactly m tokens of P above it: need = #{P : r <= H} = |P| - m.
        m = jnp.clip(jnp.round(stats["beta_up"] * n_pos), 0.0, n_pos)
        need = n_pos - m
        le_plain = jnp.sum(jnp.where(v <= plain_hi, pos_w, 0.0))
        too_low = le_plain < need  # H = y_(need-1), else H = prev_float(y_(need))
        x, found = search_min(v, pos_w, jnp.where(too_low, need, need + 1.0), 1.0, range_hi)
        cand = jnp.where(too_low, prev_float(x), prev_float(prev_float(x)))
        upper = jnp.where(le_plain == need, plain_hi, jnp.where(found, cand, range_hi))
        ok = stats["beta_up_ok"] & (n_pos > 0)
    upper = jnp.clip(upper, 1.0, range_hi)
    upper = jnp.where(ok, upper, plain_hi)
    return jax.lax.stop_gradient(lower), jax.lax.stop_gradient(upper)


def _balance_target(p_ref: Array, r: Array, adv: Array, on: Array, cfg: CalibConfig) -> Array:
    """The absolute balance(L, H, r8) that the balance rule solves H for in this batch."""
    if cfg.balance == "relative":
        return p_ref * _unclipped_balance(r, adv, on)
    return p_ref


def _stats_of(state: CalibState) -> dict[str, Array]:
    return {
        "alpha": state.alpha,
        "p_ref": state.p_ref,
        "beta_up": state.beta_up,
        "alpha_ok": state.alpha_ok,
        "p_ref_ok": state.p_ref_ok,
        "beta_up_ok": state.beta_up_ok,
    }


def _fp8_metrics(
    lo: Array, hi: Array, r_fp8: Array, adv: Array, mask: Array, cfg: CalibConfig
) -> dict[str, Array]:
    r, a, on = _prep(r_fp8, adv, mask, "r_fp8")
    plain_lo, plain_hi = cfg.plain_bounds
    neg = on & (a < 0)
    return {
        "calib/fp8_clipfrac_neg_lower_plain": _share(r < plain_lo, neg)[0],
        "calib/fp8_clipfrac_neg_lower_calibrated": _share(r < lo, neg)[0],
        "calib/balance_fp8_plain": safe_div(*_balance_parts(plain_lo, plain_hi, r, a, on)),
        "calib/balance_fp8_calibrated": safe_div(*_balance_parts(lo, hi, r, a, on)),
        "calib/balance_fp8_unclipped": _unclipped_balance(r, a, on),
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
        "calib/updated": jnp.asarray(1.0, _F32),
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
        lo_raw, hi_raw = solve_bounds(_stats_of(state), r_fp8, adv, mask, cfg)
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
    lo = jax.lax.stop_gradient(jnp.asarray(lo, _F32))
    hi = jax.lax.stop_gradient(jnp.asarray(hi, _F32))
    aux = {
        "calib/lower": lo,
        "calib/upper": hi,
        "calib/lower_raw": lo_raw,
        "calib/upper_raw": hi_raw,
        "calib/alpha": state.alpha,
        "calib/p_ref": state.p_ref,
        "calib/beta_up": state.beta_up,
        "calib/updated": updated.astype(_F32),
        **_fp8_metrics(lo, hi, r_fp8, adv, mask, cfg),
    }
    return new, lo, hi, aux
