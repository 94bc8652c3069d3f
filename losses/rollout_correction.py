"""Rollout correction (TIS / MIS) and trainer-vs-rollout mismatch metrics.

The rollout engine samples from pi_rollout (e.g. FP8 vLLM), the trainer computes pi_old on the
same tokens; their ratio rho = pi_old / pi_rollout re-weights the policy loss
(verl 0.9.x `rollout_corr_helper`, "rollout_is"):

    token level     log rho_bt = clamp(old_logp_bt - rollout_logp_bt, -20, 20)
    sequence level  log rho_b  = clamp(sum_t m_bt (old_logp_bt - rollout_logp_bt), -20, 20),
                    broadcast to the tokens of sequence b
    TIS (truncate)  w = min(rho, C)
    MIS (mask)      w = rho * [rho <= C]
    none            w = 1

Weights are zero on padding and carry no gradient. Metrics (fractions over response tokens):
    rollout_corr/is_mean, is_max, is_min   of w
    rollout_corr/rho_mean                  of the raw rho
    rollout_corr/is_clipfrac               share with rho > C (truncated by TIS, masked by MIS)
    rollout_corr/is_ess                    effective sample size (sum w)^2 / (n sum w^2), in (0, 1]
    rollout_corr/sum/{tokens,w,w2,clipped} raw sums for exact reduction across shards
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from losses.checks import as_float_mask, check_choice
from losses.masked import masked_max, masked_mean, masked_min, safe_div
from losses.policy import LOG_RATIO_CLAMP, check_token_inputs


def is_weights(
    old_logp: Float[Array, "B T"],
    rollout_logp: Float[Array, "B T"],
    mask: Array,
    *,
    mode: str = "tis",
    level: str = "token",
    cap: float = 2.0,
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """Importance weights pi_old / pi_rollout, truncated (TIS) or masked (MIS); stop-gradient.

    Args:
      old_logp: trainer log-probs of the sampled tokens under the behaviour params, [B, T].
      rollout_logp: the rollout engine's log-probs of the same tokens, [B, T].
      mask: response mask [B, T].
      mode: "tis" | "mis" | "none".
      level: "token" | "sequence".
      cap: the threshold C (2.0 in the paper's runs).
    Returns:
      (weights [B, T] float32, zero on padding; aux metrics listed in the module docstring).
    """
    check_token_inputs(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    check_choice("mode", mode, ("tis", "mis", "none"))
    check_choice("level", level, ("token", "sequence"))
    if cap <= 0:
        raise ValueError(f"argument `cap` must be positive (e.g. 2.0), got {cap}")
    on = mask != 0
    m = as_float_mask(mask)
    log_rho = jnp.where(on, old_logp.astype(jnp.float32) - rollout_logp.astype(jnp.float32), 0.0)
    log_rho = jax.lax.stop_gradient(log_rho)
    if level == "token":
        rho = jnp.exp(jnp.clip(log_rho, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    else:
        seq = jnp.clip(jnp.sum(log_rho, axis=-1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        rho = jnp.broadcast_to(jnp.exp(seq)[:, None], log_rho.shape)
    over = (rho > cap) & on
    if mode == "tis":
        w = jnp.minimum(rho, cap)
    elif mode == "mis":
        w = jnp.where(rho <= cap, rho, 0.0)
    else:
        w = jnp.ones_like(rho)
    w = w * m
    n = jnp.sum(m)
    sums = {
        "rollout_corr/sum/tokens": n,
        "rollout_corr/sum/w": jnp.sum(w),
        "rollout_corr/sum/w2": jnp.sum(w * w),
        "rollout_corr/sum/clipped": jnp.sum(over.astype(jnp.float32)),
    }
    aux = {
        "rollout_corr/is_mean": safe_div(sums["rollout_corr/sum/w"], n),
        "rollout_corr/is_max": masked_max(w, mask),
        "rollout_corr/is_min": masked_min(w, mask),
        "rollout_corr/rho_mean": masked_mean(rho, mask),
        "rollout_corr/is_clipfrac": safe_div(sums["rollout_corr/sum/clipped"], n),
        "rollout_corr/is_ess": safe_div(
            sums["rollout_corr/sum/w"] ** 2, n * sums["rollout_corr/sum/w2"]
        ),
        **sums,
    }
    return jax.lax.stop_gradient(w), aux


def mismatch_metrics(
    trainer_logp: Float[Array, "B T"],
    rollout_logp: Float[Array, "B T"],
    mask: Array,
) -> dict[str, Array]:
    """Trainer-vs-rollout mismatch on the sampled tokens (verl's names and formulas).

    With d = trainer_logp - rollout_logp over response tokens:
        rollout_corr/kl                  mean(-d)              (k1 estimate of KL(rollout || trainer))
        rollout_corr/k3_kl               mean(exp(d) - d - 1)
        training/rollout_probs_diff_mean mean |exp(trainer_logp) - exp(rollout_logp)|
        training/rollout_probs_diff_max  max  |exp(trainer_logp) - exp(rollout_logp)|
    All metrics are stop-gradient; 0 for an empty mask.
    """
    check_token_inputs(mask, trainer_logp=trainer_logp, rollout_logp=rollout_logp)
    on = mask != 0
    tl = jax.lax.stop_gradient(jnp.where(on, trainer_logp.astype(jnp.float32), 0.0))
    rl = jax.lax.stop_gradient(jnp.where(on, rollout_logp.astype(jnp.float32), 0.0))
    d = jnp.clip(tl - rl, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    pdiff = jnp.abs(jnp.exp(tl) - jnp.exp(rl))
    return {
        "rollout_corr/kl": masked_mean(-d, mask),
        "rollout_corr/k3_kl": masked_mean(jnp.exp(d) - d - 1.0, mask),
        "training/rollout_probs_diff_mean": masked_mean(pdiff, mask),
        "training/rollout_probs_diff_max": masked_max(pdiff, mask),
    }
