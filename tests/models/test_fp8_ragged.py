"""`models.fp8.ragged.ragged_dot`: the tiled loop (what CPUs run at scale, instead of XLA's dense
expansion) equals `jax.lax.ragged_dot` in values and in both gradients, with empty groups,
groups shorter and longer than a tile, tiles shared by several groups and padding rows past the
groups; and it needs a fraction of the dense expansion's memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.fp8 import ragged

SIZES = np.array([50, 0, 7, 3, 120, 0, 60], np.int32)  # 240 rows of 300: 60 padding rows
M, K, N = 300, 24, 20


@pytest.mark.parametrize("tile", [16, 64, 512])
def test_tiled_equals_ragged_dot_and_its_gradients(tile: int, monkeypatch) -> None:
    monkeypatch.setattr(ragged, "ROW_TILE", tile)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((len(SIZES), K, N)).astype(np.float32)
    ct = rng.standard_normal((M, N)).astype(np.float32)
    hi = jax.lax.Precision.HIGHEST

    def loss(a, b, tiled):
        y = ragged.ragged_dot(a, b, jnp.asarray(SIZES), precision=hi, tiled=tiled)
        return jnp.sum(y * ct), y

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (_, want), want_g = grad(a, b, False)
    (_, got), got_g = grad(a, b, True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)
    assert not np.asarray(got)[SIZES.sum() :].any()  # padding rows: 0
    for g, w in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=5e-5)


def test_tiled_memory_is_a_fraction_of_the_dense_expansion() -> None:
    m, k, n, g = 8192, 256, 128, 64
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.float32),
        jax.ShapeDtypeStruct((g, k, n), jnp.float32),
        jax.ShapeDtypeStruct((g,), jnp.int32),
    )
    temps = {}
    for tiled in (False, True):
        fn = jax.jit(lambda a, b, s, t=tiled: ragged.ragged_dot(a, b, s, tiled=t))
        temps[tiled] = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temps[False] >= g * m * k * 4  # XLA:CPU's [G, M, K] expansion
    assert temps[True] < temps[False] / 8, temps
