"""Rejection masks from trainer-vs-rollout divergence estimators (verl 0.9.1's rollout "RS").

A hard trust region: tokens, or whole sequences, whose estimated divergence between the trainer
(pi_old) and the rollout engine (pi_rollout) leaves a threshold are dropped from the loss mask.
Names, thresholds and metrics follow verl 0.9.1 (`verl/trainer/ppo/rollout_corr_helper.py`,
`compute_rollout_rejection_mask`, `compute_rs_metrics`). With
lr = clamp(old_logp - rollout_logp, -20, 20) per token:

    k1 = -lr        k2 = lr^2 / 2        k3 = exp(lr) - 1 - lr

    token_k1                keep a token if log(lower) <= k1 <= log(upper)
    token_k2, token_k3      keep a token if k <= upper
    seq_sum_k1..k3          the sequence's sum of k, tested as above (k1: both bounds)
    seq_mean_k1..k3         its mean over the sequence's tokens (seq_mean_k1: the geometric-mean
                            ratio mask)
    seq_max_k2, seq_max_k3  its maximum over the sequence's tokens

Several modes combine with commas ("token_k1,seq_max_k3"): a token stays only if every mode
keeps it. Thresholds (`parse_rejection`): one value shared by all modes or one per mode, comma
separated; a k1 mode takes "lower_upper" or a single upper (then lower = 1 / upper); other
modes take one upper bound.

Metrics (prefix `rollout_corr/rollout_rs_`, as verl): per mode `<mode>_mean|max|min|std`,
`_fraction_high|low`, `_seq_mean|std|max|min|max_deviation|fraction_high[|fraction_low]`,
`_masked_fraction` (tokens) and `_seq_masked_fraction` (non-empty sequences); overall
`masked_fraction` and `seq_masked_fraction` (over all sequences). An empty mask gives finite
metrics (0 where verl would raise).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from losses.checks import as_float_mask
from losses.masked import masked_max, masked_mean, masked_min, safe_div
from losses.policy import LOG_RATIO_CLAMP, check_token_inputs
from losses.rollout_correction import PREFIX, row_mean, row_sum, sample_std

# algorithm.rejection modes (verl's SUPPORTED_ROLLOUT_RS_OPTIONS).
REJECTION_MODES = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip


class RejectionRule(NamedTuple):
    """One mode and its bounds (`lower` for k1 modes only; on the ratio scale, not logs)."""

    mode: str
    upper: float
    lower: float | None = None


def _parse_bounds(mode: str, spec: str) -> RejectionRule:
    try:
        if mode.endswith("k1"):
            lo_s, up_s = spec.split("_", 1) if "_" in spec else (None, spec)
            upper = float(up_s)
            lower = float(lo_s) if lo_s is not None else 1.0 / upper
        elif "_" in spec:
            raise ValueError(f"mode {mode!r} takes a single upper bound, not {spec!r}")
        else:
            upper, lower = float(spec), None
    except (ValueError, ZeroDivisionError) as e:
        raise ValueError(f"threshold {spec!r} of rejection mode {mode!r}: {e}") from e
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(
            f"threshold {spec!r} of rejection mode {mode!r}: bounds must be positive with "
            "lower <= upper"
        )
    return RejectionRule(mode, upper, lower)


def parse_rejection(modes: str, thresholds: str | float) -> tuple[RejectionRule, ...]:
    """verl's `rollout_rs` / `rollout_rs_threshold` strings -> rules (duplicates dropped);
    () for an empty `modes`. Raises `ValueError` saying what is wrong."""
    names = list(dict.fromkeys(m.strip() for m in modes.split(",") if m.strip()))
    if not names:
        return ()
    for name in names:
        if name not in REJECTION_MODES:
            raise ValueError(f"rejection mode {name!r} is not one of {REJECTION_MODES}")
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"give one threshold shared by all rejection modes or one per mode ({len(names)}), "
            f"got {len(specs)}: {thresholds!r}"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    return tuple(_parse_bounds(n, s) for n, s in zip(names, specs, strict=True))


def divergence(lr: Float[Array, "B T"], mask: Array, mode: str) -> tuple[Array, Array | None]:
    """(the statistic per token [B, T], the per-sequence statistic [B] or None for token
    modes) of `mode`, from the clamped log-ratios `lr`."""
    k = mode[-2:]
    tok = {"k1": -lr, "k2": 0.5 * lr**2, "k3": jnp.exp(lr) - 1.0 - lr}[k]
    if mode.startswith("token"):
        return tok, None
    if mode.startswith("seq_sum"):
        seq = row_sum(tok, mask)
    elif mode.startswith("seq_mean"):
        seq = row_mean(tok, mask)
    else:
        mx = jnp.max(jnp.where(mask != 0, tok, -jnp.inf), axis=-1)
        seq = jnp.where(mx == -jnp.inf, 0.0, mx)
    return jnp.broadcast_to(seq[:, None], tok.shape), seq


def rule_metrics(
    rule: RejectionRule, stat: Array, seq: Array | None, mask: Array
) -> dict[str, Array]:
    """verl's `compute_rs_metrics` for one rule (bounds in the statistic's units: logs for k1)."""
    k1 = rule.lower is not None
    upper = math.log(rule.upper) if k1 else rule.upper
    lower = math.log(rule.lower) if k1 else 0.0
    valid = jnp.sum(as_float_mask(mask), axis=-1) > 0
    sv = row_mean(stat, mask) if seq is None else seq
    v = valid.astype(jnp.float32)
    n_seq = jnp.sum(v)

    def seq_share(cond: Array) -> Array:
        return safe_div(jnp.sum(cond * v), n_seq)

    seq_max = jnp.where(n_seq > 0, jnp.max(jnp.where(valid, sv, -jnp.inf)), 0.0)
    seq_min = jnp.where(n_seq > 0, jnp.min(jnp.where(valid, sv, jnp.inf)), 0.0)
    if seq is not None:  # sequence modes: over sequences
        mx, mn = seq_max, seq_min
        high, low = seq_share(sv > upper), seq_share(sv < lower) if k1 else 0.0
    else:
        mx, mn = masked_max(stat, mask), masked_min(stat, mask)
        high = masked_mean((stat > upper).astype(jnp.float32), mask)
        low = masked_mean((stat < lower).astype(jnp.float32), mask) if k1 else 0.0
    sc = jnp.clip(stat, lower, upper)
    var = masked_mean(sc * sc, mask) - masked_mean(sc, mask) ** 2
    out = {
        "mean": masked_mean(stat, mask), "max": mx, "min": mn,
        "fraction_high": high, "fraction_low": low,
        "std": jnp.where(jnp.sum(as_float_mask(mask)) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0),
        "seq_mean": safe_div(jnp.sum(sv * v), n_seq),
        "seq_std": sample_std(sv, valid),
        "seq_max": seq_max,
        "seq_min": seq_min,
        "seq_max_deviation": jnp.where(n_seq > 0, jnp.max(jnp.where(valid, jnp.abs(sv), 0.0)), 0.0),
        "seq_fraction_high": seq_share(sv > upper),
    }  # fmt: skip
    if k1:
        out["seq_fraction_low"] = seq_share(sv < lower)
    return {f"rollout_rs_{rule.mode}_{k}": v for k, v in out.items()}


def rejection_mask(
    old_logp: Float[Array, "B T"],
    rollout_logp: Float[Array, "B T"],
    mask: Array,
    rules: tuple[RejectionRule, ...],
) -> tuple[Array, dict[str, Array]]:
    """(the response mask with rejected tokens set to 0, in the mask's dtype; verl's RS
    metrics). `rules` from `parse_rejection` (static under jit); () keeps the mask as it is."""
    check_token_inputs(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    if not rules:
        return mask, {}
    on = mask != 0
    m = as_float_mask(mask)
    lr = jnp.where(on, old_logp.astype(jnp.float32) - rollout_logp.astype(jnp.float32), 0.0)
    lr = jax.lax.stop_gradient(jnp.clip(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    valid = jnp.sum(m, axis=-1) > 0
    keep_all = jnp.ones(lr.shape, bool)
    aux: dict[str, Array] = {}
    for rule in rules:
        stat, seq = divergence(lr, mask, rule.mode)
        if rule.lower is not None:
            keep = (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
        else:
            keep = stat <= rule.upper
        keep_all = keep_all & keep
        aux |= rule_metrics(rule, stat, seq, mask)
        seq_kept = ~jnp.any(~keep & on, axis=-1)
        name = f"rollout_rs_{rule.mode}"
        aux[f"{name}_masked_fraction"] = masked_mean(1.0 - keep.astype(jnp.float32), mask)
        aux[f"{name}_seq_masked_fraction"] = safe_div(
            jnp.sum(~seq_kept & valid), jnp.sum(valid).astype(jnp.float32)
        )
    aux["rollout_rs_masked_fraction"] = masked_mean(1.0 - keep_all.astype(jnp.float32), mask)
    aux["rollout_rs_seq_masked_fraction"] = jnp.mean(jnp.any(~keep_all & on, axis=-1))
    aux = {PREFIX + k: jnp.asarray(v, jnp.float32) for k, v in aux.items()}
    return (mask * keep_all).astype(mask.dtype), aux
