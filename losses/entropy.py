"""Entropy bonus: the aggregated per-token policy entropy, subtracted from the loss.

    entropy_loss = agg(H_bt)      (same aggregation as the policy loss, verl 0.9.x)
    total        = pg_loss - entropy_coef * entropy_loss

`token_entropy` (models/) computes H_bt = -sum_v p log p per position; here it is an input.
"""

from __future__ import annotations

import jax
from jax import Array
from jaxtyping import Float

from losses.masked import agg_loss
from losses.policy import check_token_inputs


def entropy_bonus(
    entropy: Float[Array, "B T"],
    mask: Array,
    *,
    agg_mode: str = "token-mean",
    loss_scale_len: int | None = None,
    denominator: float | Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """agg(entropy) (to be subtracted, times its coefficient); aux: actor/entropy (+ num/den)."""
    check_token_inputs(mask, entropy=entropy)
    ent, num, den = agg_loss(entropy, mask, agg_mode, loss_scale_len, denominator)
    return ent, {
        "actor/entropy": jax.lax.stop_gradient(ent),
        "actor/entropy_num": jax.lax.stop_gradient(num),
        "actor/entropy_den": den,
    }
