"""The optimizer's global-norm clip (`jfp8rl.trainer.optimizer.clip_by_global_norm`) against
a float64 numpy reference and optax's own clip, below and above the threshold, and the whole
chain's state structure (checkpoints of either clip load in the other)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jfp8rl.trainer.optimizer import OptimSettings, clip_by_global_norm, make_optimizer


def grads(scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"a": scale * rng.standard_normal((7, 5)), "b": {"c": scale * rng.standard_normal(11)}}


@pytest.mark.parametrize("scale", [0.01, 3.0])  # |g| ~0.07 (kept) and ~21 (clipped to 1)
def test_clip_matches_float64_reference_and_optax(scale: float) -> None:
    g64 = grads(scale)
    norm = np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(g64)))
    want = jax.tree.map(lambda x: x * min(1.0, 1.0 / norm), g64)
    g32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g64)
    got, _ = clip_by_global_norm(1.0).update(g32, optax.EmptyState())
    ref, _ = optax.clip_by_global_norm(1.0).update(g32, optax.EmptyState())
    leaves = zip(jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
    for w, x, r in leaves:
        np.testing.assert_allclose(np.asarray(x), w, rtol=2e-7, atol=0)
        np.testing.assert_allclose(np.asarray(x), np.asarray(r), rtol=2.4e-7, atol=0)
    got_norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(got)))
    assert got_norm == pytest.approx(min(norm, 1.0), rel=1e-6)


def test_state_structure_is_optax_clips() -> None:
    params = {"w": jnp.ones((3, 2))}
    settings = OptimSettings(1e-3, 0, 0.0, 1.0, 0.9, 0.999)  # constant lr
    ours = jax.tree.structure(make_optimizer(settings).init(params))
    theirs = jax.tree.structure(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)).init(params)
    )
    assert ours == theirs
