"""The bounds (L, H) of Calibrated Clipping from FP8 ratios and BF16 reference statistics.

The rules are in `losses.calibrated`; where they leave room, the choices made here, all
static-shaped and NaN-free:

* Quantiles and thresholds are exact on the float32 grid but found without a sort: two
  histogram passes over the bit patterns of the ratios (`losses.select.search_min`; a sort of
  the B*T keys costs far more than the plain loss, `python benchmarks/loss_overhead.py` times
  both). With k = round(alpha |N|), every L in (x_(k-1), x_(k)] (x = sorted N ratios,
  x_(-1) = -inf, x_(|N|) = +inf) clips exactly k tokens of N (r < L): we take the point of that
  interval nearest to the plain bound 1 - eps_low. So the clipped share equals alpha within
  1/(2|N|), and when FP8 ratios equal BF16 ratios L == 1 - eps_low exactly.
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
  ratios: at r = 1 it is sum_P A / sum_N |A| over its tokens, which varies widely between
  mini-batches of one step's batch (group-normalised A sums to 0 per group only over the whole
  group). In `track` mode the stored p_ref comes from another mini-batch, so the absolute rule
  chases that mix difference and drives H to a clamp (docs/fp8_study.md, "Why the calibrated
  upper bound swung"). The relative rule matches the ratio of kept shares, which the mix
  cancels from: it is invariant to scaling all A of P (or of N) by a constant, and on its own
  batch its target differs from the absolute one only by the FP8 vs BF16 difference of the
  unclipped balance (so FP8 == BF16 ratios still give the plain bounds).
* Quantile rule: m = round(beta_up |P|); H in [y_(|P|-m-1), y_(|P|-m)) leaves exactly m
  tokens of P above H (clipped: r > H); the point nearest to 1 + eps_high.
* Fallbacks: the plain bound is used for L when N is empty (in the batch or in the reference),
  for H when P is empty, when the reference balance was undefined, or when the FP8 balance
  denominator is 0.
* With data parallelism call this on the global batch (jit with sharded inputs computes
  global histograms and sums).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from losses.calibrated.config import CalibConfig
from losses.calibrated.stats import prep_ratios, unclipped_balance
from losses.select import prev_float, search_min


def solve_bounds(
    stats: dict[str, Array],
    r_fp8: Float[Array, "B T"],
    adv: Float[Array, "B T"],
    mask: Array,
    cfg: CalibConfig,
) -> tuple[Array, Array]:
    """Raw (L, H) from FP8 ratios given reference stats (keys of `reference_stats`); clamped,
    not smoothed. See the module docstring for the exact rules and fallbacks."""
    r, adv, on = prep_ratios(r_fp8, adv, mask, "r_fp8")
    plain_lo, plain_hi = cfg.plain_bounds
    range_lo, range_hi = cfg.range
    v, a, o = r.reshape(-1), adv.reshape(-1), on.reshape(-1)
    neg, pos = o & (a < 0), o & (a > 0)
    neg_w, pos_w = neg.astype(jnp.float32), pos.astype(jnp.float32)
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
        upper, ok = jnp.asarray(plain_hi, jnp.float32), jnp.asarray(True)
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
        return p_ref * unclipped_balance(r, adv, on)
    return p_ref
