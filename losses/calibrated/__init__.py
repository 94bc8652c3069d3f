"""Calibrated Clipping: FP8 clipping bounds matched to the BF16 clipping behaviour.

Reconstruction of the paper's method (docs/paper.md; spec in docs/design.md section 5). Per
mini-batch, r8 = FP8 ratios pi_theta / pi_old of the response tokens, r16 = the BF16 ratios of
the same tokens (calibration steps only), A the token advantages, N = {A < 0}, P = {A > 0}:

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

Modules, by concern:
- `config`: `CalibConfig` (static settings) and its choice lists.
- `stats`: the statistics above of one set of ratios (`balance`, `balance_share`,
  `clip_stats`, `reference_stats`).
- `solve`: `solve_bounds`, the exact L and H of one batch, with its choices and fallbacks.
- `state`: `CalibState` across steps, `calibrate` (a BF16 shadow step), `current_bounds` (every
  mini-batch), the smoothing and the `calib/*` metrics.

The public names are re-exported here: `from losses import calibrated as cal; cal.calibrate`.
"""

from losses.calibrated.config import BALANCES, MODES, UPPER_RULES, CalibConfig
from losses.calibrated.solve import solve_bounds
from losses.calibrated.state import CalibState, calibrate, current_bounds, init_calib_state
from losses.calibrated.stats import balance, balance_share, clip_stats, reference_stats

__all__ = [
    "BALANCES",
    "MODES",
    "UPPER_RULES",
    "CalibConfig",
    "CalibState",
    "balance",
    "balance_share",
    "calibrate",
    "clip_stats",
    "current_bounds",
    "init_calib_state",
    "reference_stats",
    "solve_bounds",
]
