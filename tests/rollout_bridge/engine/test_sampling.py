"""Sampling math of the embedded engine against a float64 numpy reference (vLLM's rules)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from rollout_bridge.engine import sampling


def _ref_logpi(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    """vLLM V1's order: temperature, top-k (ties kept), top-p in its ascending form
    (sort ascending, drop while cumsum <= 1 - p, always keep the largest); float64."""
    z = logits.astype(np.float64) / (t if t > 0 else 1.0)
    v = z.shape[0]
    if 0 < k < v:
        kth = np.sort(z)[::-1][k - 1]
        z = np.where(z >= kth, z, -np.inf)
    if p < 1.0:
        order = np.argsort(z, kind="stable")  # ascending
        pz = np.exp(z[order] - z[order].max())
        pz /= pz.sum()
        drop = np.cumsum(pz) <= 1.0 - p
        drop[-1] = False
        z = z.copy()
        z[order[drop]] = -np.inf
    m = z.max()
    return z - m - np.log(np.exp(z - m).sum())


class ProcessedLogitsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("plain", 1.0, -1, 1.0),
        ("temp", 0.7, -1, 1.0),
        ("topk", 1.0, 5, 1.0),
        ("topp", 1.0, -1, 0.8),
        ("all", 1.3, 7, 0.6),
        ("tiny_p", 0.9, -1, 0.01),
    )
    def test_matches_numpy(self, t, k, p):
        rng = np.random.default_rng(0)
        logits = rng.normal(size=(4, 33)).astype(np.float32) * 3
        fn = self.variant(sampling.processed_logits)
        z = fn(
            jnp.asarray(logits),
            jnp.full((4,), t, jnp.float32),
            jnp.full((4,), k, jnp.int32),
            jnp.full((4,), p, jnp.float32),
        )
        got = np.asarray(jax.nn.log_softmax(z, axis=-1))
        for r in range(4):
            want = _ref_logpi(logits[r], t, k, p)
            np.testing.assert_array_equal(np.isfinite(got[r]), np.isfinite(want))
            fin = np.isfinite(want)
            np.testing.assert_allclose(got[r][fin], want[fin], atol=1e-5)

    def test_per_row_parameters(self):
        rng = np.random.default_rng(1)
        logits = rng.normal(size=(3, 17)).astype(np.float32)
        ts, ks, ps = [0.5, 1.0, 2.0], [3, -1, 0], [1.0, 0.5, 0.9]
        z = sampling.processed_logits(
            jnp.asarray(logits), jnp.asarray(ts), jnp.asarray(ks), jnp.asarray(ps)
        )
        got = np.asarray(jax.nn.log_softmax(z, axis=-1))
        for r in range(3):
            want = _ref_logpi(logits[r], ts[r], ks[r], ps[r])
            fin = np.isfinite(want)
            np.testing.assert_array_equal(np.isfinite(got[r]), fin)
            np.testing.assert_allclose(got[r][fin], want[fin], atol=1e-5)


class SampleTokensTest(chex.TestCase):
    def _draw(self, logits, t, k, p, seeds, steps):
        b = logits.shape[0]
        keys = sampling.row_keys(
            jnp.asarray(seeds, jnp.uint32),
            jnp.zeros((b,), jnp.uint32),
            jnp.zeros((b,), jnp.int32),
            jnp.arange(b, dtype=jnp.int32),
        )
        fn = jax.jit(sampling.sample_tokens)
        tf = jnp.full((b,), t, jnp.float32)
        kf = jnp.full((b,), k, jnp.int32)
        pf = jnp.full((b,), p, jnp.float32)
        out = [fn(jnp.asarray(logits), keys, jnp.int32(s), tf, kf, pf) for s in range(steps)]
        return np.stack([np.asarray(o[0]) for o in out]), np.stack([np.asarray(o[1]) for o in out])

    def test_frequencies_and_logprobs(self):
        """Empirical frequencies over many rows x steps follow pi; each returned logprob is
        log pi(token) of the numpy reference."""
        rng = np.random.default_rng(2)
        row = rng.normal(size=(9,)).astype(np.float32)
        b, steps, t, k, p = 64, 64, 0.8, 6, 0.9
        logits = np.tile(row, (b, 1))
        toks, lps = self._draw(logits, t, k, p, seeds=np.arange(b), steps=steps)
        want = _ref_logpi(row, t, k, p)
        np.testing.assert_allclose(lps, want[toks], atol=1e-5)
        freq = np.bincount(toks.ravel(), minlength=9) / toks.size
        probs = np.exp(want)
        # 4096 draws: binomial std <= 0.008; 5 sigma.
        np.testing.assert_allclose(freq, probs, atol=0.04)
        self.assertTrue(np.all(freq[~np.isfinite(want)] == 0))

    def test_greedy_returns_argmax_and_raw_logprob(self):
        rng = np.random.default_rng(3)
        logits = rng.normal(size=(5, 21)).astype(np.float32)
        toks, lps = self._draw(logits, 0.0, 3, 0.5, seeds=np.arange(5), steps=2)
        np.testing.assert_array_equal(toks[0], logits.argmax(-1))
        np.testing.assert_array_equal(toks[1], logits.argmax(-1))
        raw = logits.astype(np.float64)
        raw = raw - raw.max(-1, keepdims=True)
        raw = raw - np.log(np.exp(raw).sum(-1, keepdims=True))
        np.testing.assert_allclose(lps[0], raw[np.arange(5), toks[0]], atol=1e-6)

    def test_seeds_reproduce_and_differ(self):
        rng = np.random.default_rng(4)
        logits = np.tile(rng.normal(size=(50,)).astype(np.float32), (4, 1))
        a, _ = self._draw(logits, 1.0, -1, 1.0, seeds=[7, 7, 8, 9], steps=16)
        b, _ = self._draw(logits, 1.0, -1, 1.0, seeds=[7, 7, 8, 9], steps=16)
        np.testing.assert_array_equal(a, b)
        # Rows 0 and 1 share a seed but are different samples (sample index 0 vs 1).
        self.assertFalse(np.array_equal(a[:, 0], a[:, 1]))
        self.assertFalse(np.array_equal(a[:, 2], a[:, 3]))

    def test_is_stop(self):
        tok = jnp.asarray([3, 5, 7], jnp.int32)
        stop = jnp.asarray([[3, -1], [4, 6], [7, 7]], jnp.int32)
        np.testing.assert_array_equal(np.asarray(sampling.is_stop(tok, stop)), [True, False, True])


def test_first_argmax_equals_numpy_argmax():
    """First index of the row maximum, ties and NaN (counted as the largest) as numpy's."""
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, size=(64, 257)).astype(np.float32)  # many ties
    x[5, 17] = np.nan
    x[6, [3, 200]] = np.nan
    x[7] = -np.inf
    x[8, 100:] = np.inf
    got = np.asarray(jax.jit(sampling.first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
