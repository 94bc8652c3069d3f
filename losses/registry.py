"""Named algorithms (`grpo`, `dapo`, `dr_grpo`, `gspo`) and the one loss entry point.

The trainer picks an algorithm by config name, optionally overrides fields
(`dataclasses.replace(get_algorithm("dapo"), kl_coef=0.0)`), and calls `compute_loss` inside
its jitted step. Calibrated Clipping is not an algorithm but a switch on any of them
(`clip: plain | calibrated`): the caller chooses `lo, hi` (plain: `algo.plain_bounds`;
calibrated: `losses.calibrated.current_bounds`) and passes them in.

Defaults follow the papers and verl's example scripts:

    name     advantages   agg_mode                 eps_low  eps_high  ratio     dual  KL loss
    grpo     grpo (std)   seq-mean-token-mean      0.2      0.2       token     3.0   k3, 0.001
    dapo     grpo (std)   token-mean               0.2      0.28      token     3.0   none
    dr_grpo  dr_grpo      seq-mean-token-sum-norm  0.2      0.2       token     3.0   none
    gspo     grpo (std)   seq-mean-token-mean      3e-4     4e-4      sequence  none  none

Dual-clip c = 3 is on by default as in verl's vanilla loss (clip_ratio_c = 3.0, applied
unconditionally there) and as docs/design.md asks; note that verl's DAPO example scripts set
clip_ratio_c = 10.0 (`dataclasses.replace(algo, dual_clip=10.0)` to match them); set
`dual_clip=None` to turn it off. DAPO's dynamic sampling and
overlong shaping are data-side and live in the trainer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from losses.checks import AGG_MODES, check_choice
from losses.entropy import entropy_bonus
from losses.kl import KL_KINDS, kl_loss
from losses.policy import policy_loss


@dataclasses.dataclass(frozen=True, kw_only=True)
class Algorithm:
    """Loss-side defaults of one RL algorithm (hashable: usable as a jit static argument)."""

    name: str
    adv_estimator: str = "grpo"  # grpo | dr_grpo | rloo (losses.advantages.compute_advantages)
    agg_mode: str = "token-mean"  # see losses.masked
    eps_low: float = 0.2  # plain lower ratio bound 1 - eps_low
    eps_high: float = 0.2  # plain upper ratio bound 1 + eps_high
    ratio_level: str = "token"  # token | sequence (GSPO)
    dual_clip: float | None = 3.0  # c of the dual clip for A < 0, None to disable
    use_kl_loss: bool = False  # add kl_coef * agg(KL(pi || pi_ref)) to the loss
    kl_kind: str = "k3"  # k1 | k2 | k3
    kl_coef: float = 0.001  # weight of the KL loss when use_kl_loss
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted)
    loss_scale_len: int | None = None  # divisor of seq-mean-token-sum-norm (None: padded T)

    def __post_init__(self) -> None:
        check_choice(f"{self.name}.adv_estimator", self.adv_estimator, ("grpo", "dr_grpo", "rloo"))
        check_choice(f"{self.name}.agg_mode", self.agg_mode, AGG_MODES)
        check_choice(f"{self.name}.ratio_level", self.ratio_level, ("token", "sequence"))
        check_choice(f"{self.name}.kl_kind", self.kl_kind, KL_KINDS)
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise ValueError(
                f"{self.name}: eps_low must be in [0, 1) and eps_high >= 0, got "
                f"{self.eps_low}, {self.eps_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"{self.name}.dual_clip must be > 1 or None, got {self.dual_clip}")

    @property
    def plain_bounds(self) -> tuple[float, float]:
        """The plain ratio bounds (1 - eps_low, 1 + eps_high)."""
        return 1.0 - self.eps_low, 1.0 + self.eps_high


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(
        name="grpo", agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_kind="k3", kl_coef=0.001
    ),
    "dapo": Algorithm(name="dapo", agg_mode="token-mean", eps_low=0.2, eps_high=0.28),
    "dr_grpo": Algorithm(
        name="dr_grpo", adv_estimator="dr_grpo", agg_mode="seq-mean-token-sum-norm"
    ),
    "gspo": Algorithm(
        name="gspo",
        agg_mode="seq-mean-token-mean",
        eps_low=3e-4,
        eps_high=4e-4,
        ratio_level="sequence",
        dual_clip=None,
    ),
}


def get_algorithm(name: str) -> Algorithm:
    """The registered defaults of `name` (grpo | dapo | dr_grpo | gspo)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


def compute_loss(
    algo: Algorithm,
    *,
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Array,
    lo: float | Array | None = None,
    hi: float | Array | None = None,
    is_weights: Float[Array, "B T"] | None = None,
    ref_logp: Float[Array, "B T"] | None = None,
    entropy: Float[Array, "B T"] | None = None,
    denominator: float | Array | None = None,
    ratio_quantiles: tuple[float, ...] = (0.01, 0.1, 0.5, 0.9, 0.99),
) -> tuple[Array, dict[str, Array]]:
    """Total loss = pg_loss + kl_coef * kl_loss (if use_kl_loss) - entropy_coef * entropy.

    Args:
      algo: an `Algorithm` (static under jit).
      logp, old_logp, advantages, mask: as `losses.policy.policy_loss`.
      lo, hi: ratio bounds; None means `algo.plain_bounds` (pass calibrated bounds here).
      is_weights: rollout-correction weights (`losses.rollout_correction.is_weights`) or None.
      ref_logp: reference log-probs, required when `algo.use_kl_loss` and kl_coef != 0.
      entropy: per-token entropy [B, T], required when `algo.entropy_coef` != 0 (else only
        logged when given).
      denominator: global denominator of the aggregation when this call sees a micro-batch
        (token count or non-empty sequence count, per agg_mode); all three terms use it.
    Returns:
      (loss, aux): aux has the policy metrics (`losses.policy`), `actor/kl_loss*` and
      `actor/entropy*` when computed, and `actor/loss` (the total).
    """
    plain_lo, plain_hi = algo.plain_bounds
    loss, aux = policy_loss(
        logp,
        old_logp,
        advantages,
        mask,
        clip_low=plain_lo if lo is None else lo,
        clip_high=plain_hi if hi is None else hi,
        agg_mode=algo.agg_mode,
        ratio_level=algo.ratio_level,
        dual_clip=algo.dual_clip,
        is_weights=is_weights,
        loss_scale_len=algo.loss_scale_len,
        denominator=denominator,
        ratio_quantiles=ratio_quantiles,
    )
    if algo.use_kl_loss and algo.kl_coef != 0.0:
        if ref_logp is None:
            raise ValueError(
                f"algorithm {algo.name!r} has use_kl_loss=True: pass `ref_logp` (reference "
                "log-probs) or set use_kl_loss=False"
            )
        kl, kl_aux = kl_loss(
            logp,
            ref_logp,
            mask,
            kind=algo.kl_kind,
            agg_mode=algo.agg_mode,
            loss_scale_len=algo.loss_scale_len,
            denominator=denominator,
        )
        loss = loss + algo.kl_coef * kl
        aux.update(kl_aux)
        aux["actor/kl_coef"] = jnp.asarray(algo.kl_coef, jnp.float32)
    if entropy is not None or algo.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError(
                f"algorithm {algo.name!r} has entropy_coef={algo.entropy_coef}: pass `entropy`"
            )
        ent, ent_aux = entropy_bonus(
            entropy,
            mask,
            agg_mode=algo.agg_mode,
            loss_scale_len=algo.loss_scale_len,
            denominator=denominator,
        )
        if algo.entropy_coef != 0.0:
            loss = loss - algo.entropy_coef * ent
        aux.update(ent_aux)
    aux["actor/loss"] = jax.lax.stop_gradient(loss)
    return loss, aux
