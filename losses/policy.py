"""Clipped policy-gradient surrogate (PPO / GRPO / DAPO / Dr.GRPO / GSPO) with per-call bounds.

Per response token, with ratio r = pi_theta / pi_old and advantage A (verl 0.9.x
`compute_policy_loss_vanilla` / `compute_policy_loss_gspo`):

    log r   = clamp(logp - old_logp, -20, 20)             (token level)
    pg1     = -A * r
    pg2     = -A * clip(r, lo, hi)                        lo, hi are RATIO bounds, e.g. 0.8, 1.28
    l       = max(pg1, pg2)                               = -min(r A, clip(r, lo, hi) A)
    dual    : l = min(l, -A * c)  where A < 0             (dual-clip, c = 3 typical; optional)
    loss    = agg(l * w)                                  w = rollout-correction IS weights

Gradient per unit of logp: -A r w for tokens inside the trust region, exactly 0 for clipped
tokens (A < 0 and r < lo; A > 0 and r > hi; dual-clipped). A token exactly ON a bound
(r == lo or r == hi) is not clipped and keeps the full gradient, as in verl/torch (computed as
where(pg2 > pg1, pg2, pg1): jnp.maximum / jnp.clip would give such a token 3/4 of it). Bounds
and weights are stop-gradient. GSPO (`ratio_level="sequence"`) replaces r by the sequence ratio
s_b = exp(mean_t(logp - old_logp)) with the token-level straight-through form of verl:
log s_bt = logp_bt - sg(logp_bt) + sg(mean_t(logp_b - old_logp_b)), clamped above at 10.

Aggregation is chosen separately (`losses.masked`): token-mean, seq-mean-token-mean,
seq-mean-token-sum, seq-mean-token-sum-norm.

Metrics (aux). Fractions are over ALL response tokens (verl's convention for pg_clipfrac and
pg_clipfrac_lower), except the two `*_of_neg` / `*_of_pos` shares, which are over the tokens
of that advantage sign (the quantity docs/paper.md quotes: "share of negative-advantage tokens
clipped below 0.8"; also what `calib/fp8_clipfrac_neg_lower_*` report):
    actor/pg_loss               the aggregated loss
    actor/pg_loss_num, _den     its numerator and denominator (sum both over shards, divide once)
    actor/pg_clipfrac           share of tokens where the clipped term wins (pg2 > pg1)
    actor/pg_clipfrac_lower     share of tokens cut by the dual clip (verl's name)
    actor/clipfrac_neg_lower    share of tokens with A < 0 and r < lo
    actor/clipfrac_pos_upper    share of tokens with A > 0 and r > hi
    actor/clipfrac_neg_lower_of_neg  #{A < 0, r < lo} / #{A < 0}   (0 when no A < 0 token)
    actor/clipfrac_pos_upper_of_pos  #{A > 0, r > hi} / #{A > 0}   (0 when no A > 0 token)
    actor/ppo_kl                masked mean of (old_logp - logp) (clamped log-ratio)
    actor/ratio_mean|min|max, actor/ratio_qNN (masked quantiles, `ratio_quantiles`)
    actor/clip_lo, actor/clip_hi  the bounds used
    actor/sum/{tokens,neg,pos,clipped,dual_clipped,neg_lower,pos_upper,ppo_kl,ratio}
                                raw sums: every fraction above is a ratio of two of them
                                (sum/neg_lower / sum/tokens, sum/neg_lower / sum/neg, ...),
                                exact under micro-batching and data parallelism
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from losses.checks import (
    as_float_mask,
    check_choice,
    check_float,
    check_mask,
    check_same_shape,
)
from losses.masked import agg_loss, masked_max, masked_min, masked_quantiles, safe_div

LOG_RATIO_CLAMP = 20.0  # verl: clamp(logp - old_logp, -20, 20) before exp
GSPO_LOG_RATIO_MAX = 10.0  # verl compute_policy_loss_gspo: clamp(max=10)


def check_token_inputs(mask: Array, **arrays: Array | None) -> None:
    """Trace-time checks shared by the per-token loss functions: floats of the mask's shape."""
    check_mask("mask", mask)
    for name, x in arrays.items():
        if x is not None:
            check_float(name, x, ndim=2)
    check_same_shape("mask", mask, **arrays)


def importance_ratio(
    logp: Float[Array, "B T"], old_logp: Float[Array, "B T"]
) -> Float[Array, "B T"]:
    """Token ratio r = exp(clamp(logp - old_logp, -20, 20)), as the loss computes it."""
    return jnp.exp(jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def quantile_key(q: float) -> str:
    """Metric name of a ratio quantile: 0.01 -> actor/ratio_q01, 0.5 -> actor/ratio_q50."""
    pct = q * 100.0
    return (
        f"actor/ratio_q{int(round(pct)):02d}"
        if abs(pct - round(pct)) < 1e-9
        else f"actor/ratio_q{pct:g}"
    )


def policy_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Array,
    *,
    clip_low: float | Array,
    clip_high: float | Array,
    agg_mode: str = "token-mean",
    ratio_level: str = "token",
    dual_clip: float | None = None,
    is_weights: Float[Array, "B T"] | None = None,
    loss_scale_len: int | None = None,
    denominator: float | Array | None = None,
    ratio_quantiles: Sequence[float] = (0.01, 0.1, 0.5, 0.9, 0.99),
) -> tuple[Array, dict[str, Array]]:
    """Clipped surrogate loss and its diagnostics (formulas in the module docstring).

    Args:
      logp: log pi_theta of the sampled tokens (carries the gradient), [B, T].
      old_logp: log pi_old (no gradient), [B, T].
      advantages: per-token advantages (`broadcast_to_tokens`), [B, T]; no gradient.
      mask: response mask [B, T] (bool or 0/1); masked positions change nothing.
      clip_low, clip_high: RATIO bounds lo < 1 < hi (e.g. 0.8, 1.28), floats or scalar arrays
        (Calibrated Clipping passes arrays); stop-gradient.
      agg_mode: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm.
      ratio_level: "token" or "sequence" (GSPO).
      dual_clip: c > 1 for the dual clip of A < 0 tokens, or None.
      is_weights: rollout-correction weights [B, T] (`losses.rollout_correction.is_weights`);
        stop-gradient.
      loss_scale_len: the constant divisor of seq-mean-token-sum-norm (default: T).
      denominator: global denominator when this call sees one micro-batch / shard.
      ratio_quantiles: quantiles of r reported as actor/ratio_qNN (one sort; () skips it).
    Returns:
      (loss, aux) with the aux keys listed in the module docstring.
    """
    check_token_inputs(
        mask, logp=logp, old_logp=old_logp, advantages=advantages, is_weights=is_weights
    )
    check_choice("ratio_level", ratio_level, ("token", "sequence"))
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"argument `dual_clip` must be > 1 (e.g. 3.0) or None, got {dual_clip}")
    m = as_float_mask(mask)
    on = mask != 0
    lo = jax.lax.stop_gradient(jnp.asarray(clip_low, jnp.float32))
    hi = jax.lax.stop_gradient(jnp.asarray(clip_high, jnp.float32))
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    logp = logp.astype(jnp.float32)
    old_logp = jax.lax.stop_gradient(old_logp.astype(jnp.float32))
    # Padding may hold anything (even inf/nan): zero it before it can reach exp or a gradient.
    logp = jnp.where(on, logp, 0.0)
    old_logp = jnp.where(on, old_logp, 0.0)
    adv = jnp.where(on, adv, 0.0)

    neg_kl = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if ratio_level == "token":
        log_ratio = neg_kl
    else:
        n_b = jnp.maximum(jnp.sum(m, axis=-1), 1.0)
        seq_neg_kl = jnp.sum((logp - old_logp) * m, axis=-1) / n_b
        log_ratio = logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq_neg_kl)[:, None]
        log_ratio = jnp.minimum(log_ratio, GSPO_LOG_RATIO_MAX)
    ratio = jnp.exp(log_ratio)

    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, lo, hi)
    # = max(pg1, pg2), but a token ON a bound (r == lo or r == hi: on-policy r == 1 against a
    # calibrated bound clamped to 1, or r == L when L is a data point) keeps its full gradient
    # as in verl/torch; jnp.maximum and jnp.clip each split a tie's gradient in half.
    clipped = pg2 > pg1
    losses = jnp.where(clipped, pg2, pg1)
    clipped = clipped & on
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        dual = (adv < 0) & (losses > pg3) & on
        losses = jnp.where(adv < 0, jnp.minimum(losses, pg3), losses)
    else:
        dual = jnp.zeros_like(on)
    if is_weights is not None:
        losses = losses * jax.lax.stop_gradient(is_weights.astype(jnp.float32))

    loss, num, den = agg_loss(losses, mask, agg_mode, loss_scale_len, denominator)

    r_sg = jax.lax.stop_gradient(ratio)
    n_tok = jnp.sum(m)
    sums = {
        "actor/sum/tokens": n_tok,
        "actor/sum/neg": jnp.sum(((adv < 0) & on).astype(jnp.float32)),
        "actor/sum/pos": jnp.sum(((adv > 0) & on).astype(jnp.float32)),
        "actor/sum/clipped": jnp.sum(clipped.astype(jnp.float32)),
        "actor/sum/dual_clipped": jnp.sum(dual.astype(jnp.float32)),
        "actor/sum/neg_lower": jnp.sum(((adv < 0) & (r_sg < lo) & on).astype(jnp.float32)),
        "actor/sum/pos_upper": jnp.sum(((adv > 0) & (r_sg > hi) & on).astype(jnp.float32)),
        "actor/sum/ppo_kl": jnp.sum(jax.lax.stop_gradient(-neg_kl) * m),
        "actor/sum/ratio": jnp.sum(r_sg * m),
    }
    aux = {
        "actor/pg_loss": jax.lax.stop_gradient(loss),
        "actor/pg_loss_num": jax.lax.stop_gradient(num),
        "actor/pg_loss_den": den,
        "actor/pg_clipfrac": safe_div(sums["actor/sum/clipped"], n_tok),
        "actor/pg_clipfrac_lower": safe_div(sums["actor/sum/dual_clipped"], n_tok),
        "actor/clipfrac_neg_lower": safe_div(sums["actor/sum/neg_lower"], n_tok),
        "actor/clipfrac_pos_upper": safe_div(sums["actor/sum/pos_upper"], n_tok),
        "actor/clipfrac_neg_lower_of_neg": safe_div(
            sums["actor/sum/neg_lower"], sums["actor/sum/neg"]
        ),
        "actor/clipfrac_pos_upper_of_pos": safe_div(
            sums["actor/sum/pos_upper"], sums["actor/sum/pos"]
        ),
        "actor/ppo_kl": safe_div(sums["actor/sum/ppo_kl"], n_tok),
        "actor/ratio_mean": safe_div(sums["actor/sum/ratio"], n_tok),
        "actor/ratio_min": masked_min(r_sg, mask),
        "actor/ratio_max": masked_max(r_sg, mask),
        "actor/clip_lo": lo,
        "actor/clip_hi": hi,
        **sums,
    }
    if ratio_quantiles:
        qv = masked_quantiles(r_sg, mask, ratio_quantiles)
        for i, q in enumerate(ratio_quantiles):
            aux[quantile_key(q)] = qv[i]
    return loss, aux
