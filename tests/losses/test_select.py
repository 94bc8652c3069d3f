"""Sort-free threshold search and order statistics against numpy sorting (float64 sums)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from losses.masked import masked_quantiles
from losses.select import order_statistics, search_min

SEARCH = jax.jit(search_min, static_argnums=(3, 4))


def brute_min(v, w, target, lo, hi):
    """Smallest x in [lo, hi] with sum w[v < x] >= target, over the candidate grid."""
    inf = np.float32(np.inf)
    cands = [np.float32(lo)] + sorted(
        {np.nextafter(x, inf) for x in v if lo <= np.nextafter(x, inf) <= hi}
    )
    for c in cands:
        if np.sum(w[v < c], dtype=np.float64) >= target:
            return c
    return None


class SelectTest(chex.TestCase):
    def test_search_min_matches_brute_force(self):
        rng = np.random.default_rng(0)
        for trial in range(40):
            n = 64
            v = np.exp(rng.normal(0, 0.3, n)).astype(np.float32)
            if trial % 3 == 0:
                v = np.round(v, 2).astype(np.float32)  # ties
            w = rng.integers(0, 3, n).astype(np.float32)  # integer weights: exact float sums
            target = np.float32(rng.integers(0, int(w.sum()) + 3))
            x, found = SEARCH(jnp.asarray(v), jnp.asarray(w), target, 0.6, 1.8)
            want = brute_min(v, w, target, 0.6, 1.8)
            if want is None:
                assert not bool(found), trial
            else:
                assert bool(found) and np.float32(x) == want, (trial, float(x), want)

    def test_order_statistics_and_quantiles_match_sort(self):
        rng = np.random.default_rng(1)
        v = np.exp(rng.normal(0, 0.5, (8, 40))).astype(np.float32)
        mask = rng.random((8, 40)) < 0.6
        srt = np.sort(v[mask])
        ks = np.array([0, 3, len(srt) // 2, len(srt) - 1])
        got = jax.jit(order_statistics, static_argnums=(3, 4))(v, mask, ks, 2.0**-8, 2.0**8)
        np.testing.assert_array_equal(got, srt[ks])
        qs = (0.01, 0.1, 0.5, 0.9, 0.99)
        got = jax.jit(masked_quantiles, static_argnums=2)(v, mask, qs)
        np.testing.assert_array_equal(got, srt[np.floor(np.array(qs) * (len(srt) - 1)).astype(int)])
        assert np.all(np.asarray(masked_quantiles(v, np.zeros_like(mask), qs)) == 0.0)
