"""The online check of `rollout.on_policy: exact`.

With exact on-policy rollouts the trainer takes the rollout's log-probs as the old log-probs and
never recomputes them, so a change that silently broke the bit-identity (a new kernel, another
XLA version, a backend that is not batch-invariant) would go unseen. Every
`rollout.on_policy_check_every` steps, and at step 1, the trainer recomputes the old log-probs of
one mini-batch, as `prepare` would without the bypass, and logs

    rollout_corr/exact_share    share of response tokens whose recomputed log-prob equals the
                                rollout's bit for bit (1.0 when exact, or with no token)
    rollout_corr/max_abs_dlogp  the largest |recomputed - rollout| over those tokens (0.0)

and warns once when the share is below 1.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jfp8rl.config import Config, ConfigError
from jfp8rl.parallel import mesh as mesh_lib
from jfp8rl.trainer.forward import MODEL_INPUTS, present, response_logprobs
from jfp8rl.trainer.step_settings import StepSettings


def require_backend(cfg: Config) -> None:
    """`rollout.on_policy: exact` rests on XLA:CPU's batch-invariant kernels (`models.invariant`):
    refused on another backend, whose GEMMs pick their tiling by shape."""
    backend = jax.default_backend()
    if cfg.rollout.on_policy == "exact" and backend != "cpu":
        raise ConfigError(
            f"rollout.on_policy=exact cannot hold on the {backend} backend (its GEMM kernels are "
            "not batch-invariant): set rollout.on_policy=off"
        )


def check_due(cfg: Config, step: int) -> bool:
    """Whether step `step` runs the check (module docstring)."""
    every = cfg.rollout.on_policy_check_every
    return cfg.rollout.on_policy == "exact" and every > 0 and (step == 1 or step % every == 0)


@functools.lru_cache(maxsize=4)
def _check_program(graphdef: Any, s: StepSettings) -> Any:
    def check(params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        lp, _ = response_logprobs(graphdef, params, batch, s.train_recipe, s.temperature)
        valid = batch["response_mask"] != 0
        rollout = batch["rollout_logp"]
        same, n = jnp.sum(valid & (lp == rollout)), jnp.sum(valid)
        # No response token to compare (e.g. every group of the mini-batch filtered out by
        # dynamic sampling): nothing differs, so no warning.
        share = jnp.where(n > 0, same / jnp.maximum(n, 1), 1.0)
        gap = jnp.max(jnp.where(valid, jnp.abs(lp - rollout), 0.0))
        return {"rollout_corr/exact_share": share, "rollout_corr/max_abs_dlogp": gap}

    return jax.jit(check)


def on_policy_check(
    graphdef: Any,
    settings: StepSettings,
    fns: Any,
    mesh: jax.sharding.Mesh,
    params: Any,
    host: dict[str, np.ndarray],
    rows: int,
) -> dict[str, float]:
    """The check's metrics (module docstring) on the first `rows` samples of the step."""
    sub = {k: v[:rows] for k, v in present(host, (*MODEL_INPUTS, "rollout_logp")).items()}
    with fns.mesh_context():
        out = _check_program(graphdef, settings)(params, mesh_lib.put_batch(sub, mesh))
    return {k: float(v) for k, v in out.items()}
