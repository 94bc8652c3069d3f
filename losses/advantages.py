"""Outcome advantages for group-sampled rollouts: GRPO, Dr.GRPO, RLOO; broadcast to tokens.

Rewards come as a flat [B] vector with B = n_prompts * group_size, grouped contiguously
(prompt-major: the `group_size` samples of prompt 0, then of prompt 1, ...), the order vLLM
returns `n` samples per prompt. Formulas follow `verl.trainer.ppo.core_algos` (0.9.x):

    GRPO     A_i = (R_i - mean_G) / (std_G + eps)      std_G: unbiased (torch.std), eps = 1e-6
    Dr.GRPO  A_i =  R_i - mean_G                        (GRPO with norm_std=False)
    RLOO     A_i = R_i - mean_{j != i} R_j = G/(G-1) * (R_i - mean_G)

A group of one sample has no baseline: verl then uses mean 0 and std 1 (GRPO gives R/(1+eps),
RLOO gives R). Advantages carry no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from losses.checks import check_float, check_mask


def _groups(rewards: Array, group_size: int) -> Array:
    check_float("rewards", rewards, ndim=1)
    if group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"argument `group_size`={group_size} must be >= 1 and divide the number of rewards "
            f"{rewards.shape[0]} (rewards are grouped prompt-major, group_size per prompt)"
        )
    return jax.lax.stop_gradient(rewards).reshape(-1, group_size)


def grpo_advantages(
    rewards: Float[Array, " B"],
    group_size: int,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> Float[Array, " B"]:
    """GRPO: (R - mean_G) / (std_G + eps) per group; `norm_std=False` gives Dr.GRPO R - mean_G."""
    g = _groups(rewards, group_size)
    if group_size == 1:
        mean = jnp.zeros_like(g)
        std = jnp.ones_like(g)
    else:
        mean = jnp.mean(g, axis=-1, keepdims=True)
        std = jnp.std(g, axis=-1, keepdims=True, ddof=1)
    adv = (g - mean) / (std + eps) if norm_std else g - mean
    return adv.reshape(-1)


def dr_grpo_advantages(rewards: Float[Array, " B"], group_size: int) -> Float[Array, " B"]:
    """Dr.GRPO: R - mean_G (no std normalisation)."""
    return grpo_advantages(rewards, group_size, norm_std=False)


def rloo_advantages(rewards: Float[Array, " B"], group_size: int) -> Float[Array, " B"]:
    """RLOO: R_i minus the mean reward of the other samples of its group."""
    g = _groups(rewards, group_size)
    if group_size == 1:
        return g.reshape(-1)
    mean = jnp.mean(g, axis=-1, keepdims=True)
    return (g * group_size / (group_size - 1) - mean * group_size / (group_size - 1)).reshape(-1)


def compute_advantages(
    estimator: str, rewards: Float[Array, " B"], group_size: int, *, eps: float = 1e-6
) -> Float[Array, " B"]:
    """Dispatch by name: `grpo`, `dr_grpo` or `rloo` (the registry's `adv_estimator`)."""
    if estimator == "grpo":
        return grpo_advantages(rewards, group_size, eps=eps)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards, group_size)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_size)
    raise ValueError(
        f"argument `estimator`={estimator!r} is not one of ('grpo', 'dr_grpo', 'rloo')"
    )


def broadcast_to_tokens(adv: Float[Array, " B"], mask: Array) -> Float[Array, "B T"]:
    """adv_BxT = adv_B[:, None] * mask (zero on padding, as verl's `scores * response_mask`)."""
    check_float("adv", adv, ndim=1)
    check_mask("mask", mask)
    if adv.shape[0] != mask.shape[0]:
        raise ValueError(
            f"argument `adv` has {adv.shape[0]} rows but `mask` has {mask.shape[0]}; both are per sequence"
        )
    return adv[:, None] * (mask != 0).astype(adv.dtype)
