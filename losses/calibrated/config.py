"""`CalibConfig`: the static settings of Calibrated Clipping, validated once on construction."""

from __future__ import annotations

import dataclasses

from losses.checks import check_choice

MODES: tuple[str, ...] = ("track", "hold")
UPPER_RULES: tuple[str, ...] = ("balance", "quantile", "plain")
BALANCES: tuple[str, ...] = ("absolute", "relative")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibConfig:
    """Static configuration of Calibrated Clipping (hashable: safe as a jit static argument)."""

    eps_low: float = 0.2  # plain lower bound is 1 - eps_low
    eps_high: float = 0.28  # plain upper bound is 1 + eps_high (DAPO clip-higher; 0.2 for GRPO)
    every: int = 20  # calibrate (BF16 shadow pass) every `every` trainer steps
    ema: float = 0.9  # smoothing weight of the stored bound
    range: tuple[float, float] = (0.6, 1.8)  # clamps: L in [range[0], 1], H in [1, range[1]]
    # "hold": solve L, H on calibrating mini-batches only and keep them; "track": re-solve
    # them per mini-batch from the stored alpha / p_ref (drifts with each mini-batch's
    # advantage mix and PPO position: docs/fp8_study.md).
    mode: str = "hold"
    upper_rule: str = "balance"  # "balance", "quantile" or "plain" (1 + eps_high: lower only)
    # Balance target of the "balance" upper rule: "absolute" (BF16 balance p_ref, the spec's
    # literal rule) or "relative" (BF16 share of kept P mass over kept N mass; cancels the
    # mini-batch's advantage mix, see `losses.calibrated.solve`).
    balance: str = "absolute"
    solver_rtol: float = 1e-5  # relative slack of the balance target (float32 summation noise)

    def __post_init__(self) -> None:
        check_choice("CalibConfig.mode", self.mode, MODES)
        check_choice("CalibConfig.upper_rule", self.upper_rule, UPPER_RULES)
        check_choice("CalibConfig.balance", self.balance, BALANCES)
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
