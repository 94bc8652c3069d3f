"""Shared helpers of the loss tests: random batches and float64 numpy references."""

from __future__ import annotations

import jax
import numpy as np

from losses import calibrated as C

# The spec's literal rules (track mode, absolute balance); the defaults are tested by name.
CFG = C.CalibConfig(eps_low=0.2, eps_high=0.28, mode="track", balance="absolute")
# Jitted once per config and shape (cfg is static): eager dispatch of the solver is slow.
CALIB = jax.jit(C.calibrate, static_argnums=1)
BOUNDS = jax.jit(C.current_bounds, static_argnums=1)


def make_batch(seed, b=24, t=48, sigma_bf16=0.1, sigma_fp8=0.08):
    """Per-token advantages (both signs), a ragged mask, BF16 ratios and noisier FP8 ratios."""
    rng = np.random.default_rng(seed)
    adv = rng.normal(size=(b, t)).astype(np.float32)
    mask = (rng.random((b, t)) < 0.85).astype(np.float32)
    r16 = np.exp(rng.normal(0, sigma_bf16, (b, t))).astype(np.float32)
    r8 = (r16 * np.exp(rng.normal(0, sigma_fp8, (b, t)))).astype(np.float32)
    return r8, r16, adv, mask


def np_balance(lo, hi, r, adv, mask):
    r, adv = r.astype(np.float64), adv.astype(np.float64)
    on = mask > 0
    num = np.sum(np.where(on & (adv > 0) & (r < hi), adv * r, 0))
    den = np.sum(np.where(on & (adv < 0) & (r > lo), -adv * r, 0))
    return num / den


def np_kept_share(lo, hi, r, adv, mask):
    """balance(lo, hi) / balance(0, inf): the relative balance, float64."""
    return np_balance(lo, hi, r, adv, mask) / np_balance(-np.inf, np.inf, r, adv, mask)


def np_share_below(lo, r, adv, mask):
    neg = (mask > 0) & (adv < 0)
    return np.mean(r[neg] < lo), neg.sum()


def np_policy_loss(logp, old, adv, mask, lo, hi, agg, level="token", dual=None, w=None, norm=None):
    """Independent float64 reference of the verl surrogate."""
    logp, old, adv, mask = (np.asarray(x, np.float64) for x in (logp, old, adv, mask))
    if level == "token":
        ratio = np.exp(np.clip(logp - old, -20, 20))
    else:
        n = np.maximum(mask.sum(-1), 1)
        s = np.exp(np.minimum(((logp - old) * mask).sum(-1) / n, 10.0))
        ratio = np.repeat(s[:, None], logp.shape[1], 1)
    per = np.maximum(-adv * ratio, -adv * np.clip(ratio, lo, hi))
    if dual is not None:
        per = np.where(adv < 0, np.minimum(per, -adv * dual), per)
    if w is not None:
        per = per * w
    per = per * mask
    n_b = mask.sum(-1)
    valid = n_b > 0
    if agg == "token-mean":
        return per.sum() / mask.sum()
    if agg == "seq-mean-token-mean":
        seq = per.sum(-1)[valid] / n_b[valid]
    elif agg == "seq-mean-token-sum":
        seq = per.sum(-1)[valid]
    else:
        seq = per.sum(-1)[valid] / (norm or mask.shape[1])
    return seq.mean()


def random_inputs(seed, b=6, t=9):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, (b, t)).astype(np.float32)
    logp = (old + rng.normal(0, 0.35, (b, t))).astype(np.float32)
    adv = np.repeat(rng.normal(size=(b, 1)), t, 1).astype(np.float32)
    mask = (rng.random((b, t)) < 0.75).astype(np.float32)
    mask[0] = 0.0  # a fully masked sequence is excluded from sequence means
    w = rng.uniform(0.3, 2.0, (b, t)).astype(np.float32)
    return logp, old, adv, mask, w
