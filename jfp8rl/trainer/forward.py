"""The trainer's model calls on a rollout batch: which arrays the forward and the update read,
the response-aligned log-probabilities and entropy of the sampled tokens, and routing replay's
comparison of the rollout's experts with the trainer's router (Mixture-of-Experts models).
`jfp8rl.trainer.step` builds the step programs on these."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models import functional as mf
from models.fp8 import Recipe
from models.moe import load_balancing_loss

# Batch arrays the update reads per mini-batch (rewards / lengths only feed `prepare`);
# "routing" only with routing replay (`present`).
UPDATE_INPUTS = (
    "tokens", "attention_mask", "prompt_lens", "response_mask", "rollout_logp", "routing"
)  # fmt: skip

# Batch arrays the model forward reads (the rest are per-token loss inputs).
MODEL_INPUTS = ("tokens", "attention_mask", "prompt_lens", "response_mask", "routing")


def present(batch: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The entries of `batch` named in `names` that it has (the optional "routing")."""
    return {n: batch[n] for n in names if n in batch}


def gather_response(
    x_NxT: Float[Array, "N T"], prompt_lens_N: Int[Array, " N"], resp_len: int
) -> Float[Array, "N R"]:
    """Moves per-token values of `tokens` ([N, P + R], right padded) to the response-aligned
    layout [N, R]: out[i, j] = x[i, prompt_lens[i] + j] (positions past T read the last one and
    are masked by the response mask anyway)."""
    idx = prompt_lens_N[:, None] + jnp.arange(resp_len)[None, :]
    idx = jnp.minimum(idx, x_NxT.shape[1] - 1)
    return jnp.take_along_axis(x_NxT, idx, axis=1)


def balance_mask(batch: dict[str, Array]) -> Array:
    """The tokens an MoE policy's load-balancing loss counts: the real tokens (attention mask)
    of the samples with a response token to train on."""
    return (batch["attention_mask"] != 0) & jnp.any(batch["response_mask"] != 0, 1, keepdims=True)


def response_logprobs(
    graphdef: Any, params: Any, batch: dict[str, Array], recipe: Recipe, temperature: float
) -> tuple[Float[Array, "N R"], Float[Array, "N R"]]:
    """(logp, entropy) of the response tokens under `recipe`, response-aligned, of the
    distribution the rollout sampled from: logits / `temperature` (`rollout.temperature`), as
    verl scores them, so the ratios against the rollout's logprobs compare like with like.
    With `batch["routing"]` (routing replay) an MoE model uses the rollout's experts."""
    return response_logprobs_and_routing(graphdef, params, batch, recipe, temperature)[:2]


def response_logprobs_and_routing(
    graphdef: Any, params: Any, batch: dict[str, Array], recipe: Recipe, temperature: float
) -> tuple[Float[Array, "N R"], Float[Array, "N R"], Array | None]:
    """`response_logprobs` and an MoE model's own router choices [N, T, L, k] in the same
    forward (with routing replay: what its router picked where the rollout's experts were
    used; None for dense models)."""
    return response_forward(graphdef, params, batch, recipe, temperature)[:3]


def response_forward(
    graphdef: Any, params: Any, batch: dict[str, Array], recipe: Recipe, temperature: float
) -> tuple[Float[Array, "N R"], Float[Array, "N R"], Array | None, Float[Array, ""] | None]:
    """`response_logprobs_and_routing` and an MoE model's load-balancing loss
    (`models.moe.load_balancing_loss`) over the real tokens (attention mask) of the samples
    with a response token to train on, all layers pooled; None for dense models. With routing
    replay its expert shares count the replayed experts, the ones the forward used."""
    tokens, mask = batch["tokens"], batch["attention_mask"]
    h, routed, load = mf.hidden_states_routing_and_load(
        graphdef, params, tokens, mask, recipe=recipe, routing=batch.get("routing"),
        load_mask=balance_mask(batch),
    )  # fmt: skip
    lp, ent = mf.head_logprobs_and_entropy(
        mf.head_of(nnx.merge(graphdef, params)), h, tokens, mask, temperature=temperature
    )
    r = batch["response_mask"].shape[1]
    return (
        gather_response(lp, batch["prompt_lens"], r),
        gather_response(ent, batch["prompt_lens"], r),
        routed,
        None if load is None else load_balancing_loss(load),
    )


def routing_mismatch_counts(
    recorded: Array, own: Array, attention_mask: Array
) -> tuple[Array, Array]:
    """(how many, out of how many) (token, layer) pairs have an expert set that differs
    between the rollout's record and the trainer's router, over the tokens the rollout
    recorded (real tokens, entries >= 0). Expert sets are compared, not their order."""
    known = jnp.all(recorded >= 0, axis=-1) & (attention_mask[:, :, None] != 0)
    differ = jnp.any(
        jnp.sort(recorded.astype(jnp.int32), axis=-1) != jnp.sort(own, axis=-1), axis=-1
    )
    return jnp.sum(differ & known, dtype=jnp.float32), jnp.sum(known, dtype=jnp.float32)
