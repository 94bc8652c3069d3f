"""The optimizer of the FP32 master params: global-norm clip, then AdamW with linear warmup."""

from __future__ import annotations

from typing import NamedTuple

import optax


class OptimSettings(NamedTuple):
    """AdamW hyperparameters (hashable, so the jitted step can be cached per setting)."""

    lr: float
    warmup_updates: int
    weight_decay: float
    grad_clip: float
    b1: float
    b2: float
    eps: float = 1e-8  # Adam's epsilon (optax / torch default)


def make_optimizer(o: OptimSettings) -> optax.GradientTransformation:
    """Global-norm clip, then AdamW with linear warmup over `o.warmup_updates` optimizer
    updates (then constant), on the FP32 masters."""
    sched = optax.linear_schedule(0.0, o.lr, o.warmup_updates) if o.warmup_updates > 0 else o.lr
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
    )
