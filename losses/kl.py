"""KL estimators to a reference policy, as a loss term or as a reward penalty.

Per token, with logp = log pi_theta and ref = log pi_ref of the sampled token
(verl 0.9.x `core_algos.kl_penalty`; Schulman's k1/k2/k3):

    k1  logp - ref
    k2  0.5 * (logp - ref)^2
    k3  exp(ref - logp) - (ref - logp) - 1, with ref - logp clamped to [-20, 20] and the result
        to [-10, 10] (verl's "low_var_kl")

As a loss (GRPO): loss += kl_coef * agg(kl) with the policy loss's aggregation.
As a reward penalty (PPO-style): token_rewards = token_scores - beta * kl (on response tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Float

from losses.checks import check_choice
from losses.masked import agg_loss
from losses.policy import check_token_inputs

KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(
    logp: Float[Array, "B T"], ref_logp: Float[Array, "B T"], kind: str = "k3"
) -> Float[Array, "B T"]:
    """Per-token KL estimate (see the module docstring); gradient flows through `logp` only."""
    check_choice("kind", kind, KL_KINDS)
    ref = jax.lax.stop_gradient(ref_logp.astype(jnp.float32))
    logp = logp.astype(jnp.float32)
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * jnp.square(logp - ref)
    kl = jnp.clip(ref - logp, -20.0, 20.0)
    return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)


def kl_loss(
    logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    mask: Array,
    *,
    kind: str = "k3",
    agg_mode: str = "token-mean",
    loss_scale_len: int | None = None,
    denominator: float | Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """agg(kl_penalty) as a loss term; aux: actor/kl_loss, actor/kl_loss_num, actor/kl_loss_den."""
    check_token_inputs(mask, logp=logp, ref_logp=ref_logp)
    on = mask != 0
    kl = kl_penalty(jnp.where(on, logp, 0.0), jnp.where(on, ref_logp, 0.0), kind)
    loss, num, den = agg_loss(kl, mask, agg_mode, loss_scale_len, denominator)
    return loss, {
        "actor/kl_loss": jax.lax.stop_gradient(loss),
        "actor/kl_loss_num": jax.lax.stop_gradient(num),
        "actor/kl_loss_den": den,
    }


def kl_reward_penalty(
    token_scores: Float[Array, "B T"],
    logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    mask: Array,
    *,
    beta: float | Array,
    kind: str = "k1",
) -> tuple[Float[Array, "B T"], dict[str, Array]]:
    """token_rewards = token_scores - beta * kl * mask (verl `apply_kl_penalty`); no gradient.

    aux: actor/reward_kl_penalty (mean over sequences of the per-sequence token-mean KL, as
    verl) and actor/reward_kl_penalty_coeff.
    """
    check_token_inputs(mask, token_scores=token_scores, logp=logp, ref_logp=ref_logp)
    on = mask != 0
    m = on.astype(jnp.float32)
    kl = jax.lax.stop_gradient(
        kl_penalty(jnp.where(on, logp, 0.0), jnp.where(on, ref_logp, 0.0), kind) * m
    )
    rewards = token_scores - beta * kl
    n_b = jnp.sum(m, axis=-1)
    seq_kl = jnp.sum(kl, axis=-1) / jnp.maximum(n_b, 1.0)
    return rewards, {
        "actor/reward_kl_penalty": jnp.mean(seq_kl),
        "actor/reward_kl_penalty_coeff": jnp.asarray(beta, jnp.float32),
    }
