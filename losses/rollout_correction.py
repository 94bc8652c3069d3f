"""Rollout-correction importance weights (TIS / MIS / IcePop) and off-policy metrics.

The rollout engine samples from pi_rollout (e.g. FP8 vLLM), the trainer computes pi_old on the
same tokens; their ratio rho = pi_old / pi_rollout re-weights the policy loss. Names, formulas
and metrics follow verl 0.9.1 (`verl/trainer/ppo/rollout_corr_helper.py`,
`compute_rollout_correction_weights`, `compute_is_metrics`, `compute_offpolicy_metrics`):

    token level     log rho_bt = clamp(old_logp_bt - rollout_logp_bt, -20, 20)
    sequence level  log rho_b  = clamp(sum_t m_bt (old_logp_bt - rollout_logp_bt), -20, 20),
                    broadcast to the tokens of sequence b
    TIS     (truncate)  w = min(rho, C)                     verl: rollout_is_threshold = C
    IcePop  (zero out)  w = rho * [lower <= rho <= C]       verl: rollout_is_threshold = "lower_C"
    MIS     (mask)      w = rho * [rho <= C]
    none                w = 1
    batch normalisation (optional)  w / mean(w), the mean over tokens (token level) or over
                    non-empty sequences (sequence level); skipped when that mean is <= 1e-8

Weights are zero on padding and carry no gradient; an empty mask gives finite metrics (0 where
verl would raise). The IS metrics are verl's
(`rollout_corr/rollout_is_*`, computed before batch normalisation): mean / max / min / std,
`eff_sample_size` (ESS = 1 / mean((w / mean w)^2) of w clamped to [0, C]), the shares of raw
ratios above C and below the lower bound (1 / C unless IcePop gives one), per-sequence
statistics, `oob_ratio` (IcePop) and `batch_norm_factor` (batch normalisation). Rejection masks
from divergence estimators are `losses.rollout_rejection`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from losses.checks import as_float_mask, check_choice
from losses.masked import masked_max, masked_mean, masked_min, safe_div
from losses.policy import LOG_RATIO_CLAMP, check_token_inputs

# algorithm.correction choices (verl: TIS for a single threshold, IcePop for "lower_upper").
CORRECTIONS = ("tis", "mis", "icepop", "none")
CORRECTION_LEVELS = ("token", "sequence")
PREFIX = "rollout_corr/"


def row_sum(x: Float[Array, "B T"], mask: Array) -> Float[Array, " B"]:
    """sum_t m_bt x_bt per sequence (masked entries may hold anything)."""
    return jnp.sum(jnp.where(mask != 0, x, 0.0), axis=-1)


def row_mean(x: Float[Array, "B T"], mask: Array) -> Float[Array, " B"]:
    """Per-sequence masked mean, 0 for an empty sequence."""
    return safe_div(row_sum(x, mask), jnp.sum(as_float_mask(mask), axis=-1))


def sample_std(x: Float[Array, " B"], valid: Array) -> Array:
    """Unbiased standard deviation of the valid entries (torch's `std`), 0 for fewer than 2."""
    v = valid.astype(jnp.float32)
    n = jnp.sum(v)
    mean = safe_div(jnp.sum(x * v), n)
    var = safe_div(jnp.sum(v * (x - mean) ** 2), n - 1.0)
    return jnp.where(n > 1, jnp.sqrt(var), 0.0)


def check_correction(mode: str, level: str, cap: float, lower: float | None) -> None:
    """Trace-time checks of the correction's static arguments."""
    check_choice("mode", mode, CORRECTIONS)
    check_choice("level", level, CORRECTION_LEVELS)
    if cap <= 0:
        raise ValueError(f"argument `cap` must be positive (e.g. 2.0), got {cap}")
    if mode == "icepop" and (lower is None or not 0 < lower <= cap):
        raise ValueError(f"IcePop needs 0 < `lower` <= `cap`, got lower={lower}, cap={cap}")


def raw_ratios(
    old_logp: Float[Array, "B T"], rollout_logp: Float[Array, "B T"], mask: Array, level: str
) -> tuple[Float[Array, "B T"], Array]:
    """(rho [B, T] zero on padding, the unclamped log-ratio verl's metrics read: [B, T] at
    token level, the per-sequence sums [B] at sequence level); stop-gradient."""
    on = mask != 0
    log_rho = jnp.where(on, old_logp.astype(jnp.float32) - rollout_logp.astype(jnp.float32), 0.0)
    log_rho = jax.lax.stop_gradient(log_rho)
    if level == "token":
        rho = jnp.exp(jnp.clip(log_rho, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        return rho * as_float_mask(mask), log_rho
    seq = jnp.sum(log_rho, axis=-1)
    rho = jnp.exp(jnp.clip(seq, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return jnp.broadcast_to(rho[:, None], log_rho.shape) * as_float_mask(mask), seq


def is_weights(
    old_logp: Float[Array, "B T"],
    rollout_logp: Float[Array, "B T"],
    mask: Array,
    *,
    mode: str = "tis",
    level: str = "token",
    cap: float = 2.0,
    lower: float | None = None,
    batch_normalize: bool = False,
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """Importance weights pi_old / pi_rollout: truncated (TIS), zeroed outside [lower, cap]
    (IcePop) or above cap (MIS); optionally normalised to mean 1; stop-gradient.

    Args:
      old_logp: trainer log-probs of the sampled tokens under the behaviour params, [B, T].
      rollout_logp: the rollout engine's log-probs of the same tokens, [B, T].
      mask: response mask [B, T].
      mode: "tis" | "icepop" | "mis" | "none".
      level: "token" | "sequence".
      cap: the upper threshold C (2.0 in the paper's runs).
      lower: IcePop's lower threshold (required there); elsewhere the metrics' lower bound is
        1 / C, as in verl.
      batch_normalize: divide by the batch mean of the weights (verl's
        `rollout_is_batch_normalize`).
    Returns:
      (weights [B, T] float32, zero on padding; verl's IS metrics, none for mode "none").
    """
    check_token_inputs(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    check_correction(mode, level, cap, lower)
    m = as_float_mask(mask)
    if mode == "none":
        return m, {}
    rho, log_ratio = raw_ratios(old_logp, rollout_logp, mask, level)
    if mode == "tis":
        w = jnp.minimum(rho, cap)
    elif mode == "mis":
        w = jnp.where(rho <= cap, rho, 0.0)
    else:
        w = jnp.where((rho >= lower) & (rho <= cap), rho, 0.0)
    w = w * m
    lo = lower if mode == "icepop" else 1.0 / cap
    aux = is_metrics(w, rho, log_ratio, mask, level=level, cap=cap, lower=lo)
    if mode == "icepop":
        aux[PREFIX + "rollout_is_oob_ratio"] = masked_mean(
            ((rho < lower) | (rho > cap)).astype(jnp.float32), mask
        )
    if batch_normalize:
        w, factor = batch_normalized(w, mask, level)
        aux[PREFIX + "rollout_is_batch_norm_factor"] = factor
    return jax.lax.stop_gradient(w), aux


def batch_normalized(
    w: Float[Array, "B T"], mask: Array, level: str
) -> tuple[Float[Array, "B T"], Array]:
    """(w / mean, mean) with verl's mean: over tokens at token level, over non-empty sequences
    of their per-token mean at sequence level; (w, 1) when that mean is <= 1e-8."""
    if level == "token":
        mean = masked_mean(w, mask)
    else:
        seq_ok = jnp.sum(as_float_mask(mask), axis=-1) > 0
        mean = masked_mean(row_mean(w, mask)[:, None], seq_ok[:, None])
    ok = mean > 1e-8
    return jnp.where(ok, w / jnp.where(ok, mean, 1.0), w), jnp.where(ok, mean, 1.0)


def is_metrics(
    w: Float[Array, "B T"],
    rho: Float[Array, "B T"],
    log_ratio: Array,
    mask: Array,
    *,
    level: str,
    cap: float,
    lower: float,
) -> dict[str, Array]:
    """verl's `compute_is_metrics` on the applied weights `w` and the raw ratios `rho`.
    `log_ratio`: the unclamped token log-ratios [B, T] (token level) or their per-sequence sums
    [B] (sequence level)."""
    if level == "sequence":
        aux = {
            "rollout_is_max": jnp.exp(jnp.minimum(jnp.max(log_ratio), LOG_RATIO_CLAMP)),
            "rollout_is_min": jnp.exp(jnp.min(log_ratio)),
            "rollout_is_ratio_fraction_high": jnp.mean(log_ratio > jnp.log(jnp.float32(cap))),
            "rollout_is_ratio_fraction_low": jnp.mean(log_ratio < jnp.log(jnp.float32(lower))),
        }
    else:
        aux = {
            "rollout_is_max": masked_max(w, mask),
            "rollout_is_min": masked_min(w, mask),
            "rollout_is_ratio_fraction_high": masked_mean((rho > cap).astype(jnp.float32), mask),
            "rollout_is_ratio_fraction_low": masked_mean((rho < lower).astype(jnp.float32), mask),
        }
    aux["rollout_is_mean"] = masked_mean(w, mask)
    wc = jnp.clip(w, 0.0, cap)
    mean_c = masked_mean(wc, mask)
    var = masked_mean(wc * wc, mask) - mean_c**2
    aux["rollout_is_std"] = jnp.where(
        jnp.sum(as_float_mask(mask)) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0
    )
    # 0 (not inf) when there is no token, or every weight is 0 (verl: an error, or inf).
    aux["rollout_is_eff_sample_size"] = safe_div(
        1.0, masked_mean((wc / (mean_c + 1e-8)) ** 2, mask)
    )
    seq_w = row_mean(w, mask)
    every = jnp.ones(seq_w.shape, bool)
    raw_seq = row_mean(rho, mask)
    aux |= {
        "rollout_is_seq_mean": jnp.mean(seq_w),
        "rollout_is_seq_std": sample_std(seq_w, every),
        "rollout_is_seq_max": jnp.max(seq_w),
        "rollout_is_seq_min": jnp.min(seq_w),
        "rollout_is_seq_max_deviation": jnp.max(jnp.abs(seq_w - 1.0)),
        "rollout_is_seq_fraction_high": jnp.mean(raw_seq > cap),
        "rollout_is_seq_fraction_low": jnp.mean(raw_seq < lower),
    }
    return {PREFIX + k: jnp.asarray(v, jnp.float32) for k, v in aux.items()}


def mismatch_metrics(
    trainer_logp: Float[Array, "B T"],
    rollout_logp: Float[Array, "B T"],
    mask: Array,
) -> dict[str, Array]:
    """Trainer-vs-rollout off-policy metrics on the sampled tokens (verl's
    `compute_offpolicy_metrics`, plus the probability differences).

    With d = trainer_logp - rollout_logp, per-sequence means over its tokens and batch means
    over sequences (an empty sequence counts with mean 0, as in verl):
        rollout_corr/kl                    mean over tokens of -d (k1 of KL(rollout || trainer))
        rollout_corr/k3_kl                 mean over tokens of exp(d) - d - 1 (d clamped to +-20)
        rollout_corr/training_ppl          batch mean of exp(-seq mean of trainer_logp)
        rollout_corr/training_log_ppl      batch mean of -seq mean of trainer_logp
        rollout_corr/rollout_ppl, rollout_log_ppl   the same for rollout_logp
        rollout_corr/log_ppl_diff[_max|_min]        of seq mean rollout_logp - trainer_logp
        rollout_corr/log_ppl_abs_diff      batch mean of its absolute value
        rollout_corr/ppl_ratio             batch mean of exp(log_ppl_diff)
        rollout_corr/chi2_token            mean over tokens of rho^2, minus 1 (d clamped)
        rollout_corr/chi2_seq              batch mean of exp(2 clamp(seq sum d)), minus 1
        training/rollout_probs_diff_mean|max   of |exp(trainer_logp) - exp(rollout_logp)|
    All metrics are stop-gradient.
    """
    check_token_inputs(mask, trainer_logp=trainer_logp, rollout_logp=rollout_logp)
    on = mask != 0
    tl = jax.lax.stop_gradient(jnp.where(on, trainer_logp.astype(jnp.float32), 0.0))
    rl = jax.lax.stop_gradient(jnp.where(on, rollout_logp.astype(jnp.float32), 0.0))
    d = jnp.clip(tl - rl, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    pdiff = jnp.abs(jnp.exp(tl) - jnp.exp(rl))
    seq_tl, seq_rl = row_mean(tl, mask), row_mean(rl, mask)
    log_ppl_diff = seq_rl - seq_tl
    seq_d = jnp.clip(row_sum(tl - rl, mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    aux = {
        "kl": masked_mean(-d, mask),
        "k3_kl": masked_mean(jnp.exp(d) - d - 1.0, mask),
        "training_ppl": jnp.mean(jnp.exp(-seq_tl)),
        "training_log_ppl": jnp.mean(-seq_tl),
        "rollout_ppl": jnp.mean(jnp.exp(-seq_rl)),
        "rollout_log_ppl": jnp.mean(-seq_rl),
        "log_ppl_diff": jnp.mean(log_ppl_diff),
        "log_ppl_abs_diff": jnp.mean(jnp.abs(log_ppl_diff)),
        "log_ppl_diff_max": jnp.max(log_ppl_diff),
        "log_ppl_diff_min": jnp.min(log_ppl_diff),
        "ppl_ratio": jnp.mean(jnp.exp(log_ppl_diff)),
        "chi2_token": masked_mean(jnp.exp(d) ** 2, mask) - 1.0,
        "chi2_seq": jnp.mean(jnp.exp(2.0 * seq_d)) - 1.0,
    }
    return {PREFIX + k: v for k, v in aux.items()} | {
        "training/rollout_probs_diff_mean": masked_mean(pdiff, mask),
        "training/rollout_probs_diff_max": masked_max(pdiff, mask),
    }
