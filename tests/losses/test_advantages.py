"""Advantages against float64 numpy (torch's unbiased std, verl's conventions)."""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
import pytest

from losses import advantages as A


def np_grpo(r, g, norm=True, eps=1e-6):
    r = np.asarray(r, np.float64).reshape(-1, g)
    if g == 1:
        mean, std = np.zeros_like(r), np.ones_like(r)
    else:
        mean, std = r.mean(1, keepdims=True), r.std(1, ddof=1, keepdims=True)
    return ((r - mean) / (std + eps) if norm else r - mean).reshape(-1)


def np_rloo(r, g):
    r = np.asarray(r, np.float64).reshape(-1, g)
    if g == 1:
        return r.reshape(-1)
    others = (r.sum(1, keepdims=True) - r) / (g - 1)
    return (r - others).reshape(-1)


class AdvantagesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_case(self):
        r = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], np.float32)  # 2 prompts x 3 samples
        adv = self.variant(functools.partial(A.grpo_advantages, group_size=3))(r)
        # group 0: mean 1/3, unbiased std sqrt(1/3); group 1: all equal -> 0
        s = np.sqrt(1 / 3)
        np.testing.assert_allclose(
            adv,
            [(2 / 3) / (s + 1e-6), -(1 / 3) / (s + 1e-6), -(1 / 3) / (s + 1e-6), 0, 0, 0],
            rtol=1e-5,
        )
        rloo = self.variant(functools.partial(A.rloo_advantages, group_size=3))(r)
        np.testing.assert_allclose(rloo, [1.0, -0.5, -0.5, 0, 0, 0], rtol=1e-6, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_random_against_numpy(self):
        rng = np.random.default_rng(0)
        for g in (1, 2, 5):
            r = rng.normal(size=4 * g).astype(np.float32)
            for fn, ref in (
                (A.grpo_advantages, np_grpo(r, g)),
                (A.dr_grpo_advantages, np_grpo(r, g, norm=False)),
                (A.rloo_advantages, np_rloo(r, g)),
            ):
                out = self.variant(functools.partial(fn, group_size=g))(r)
                np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            A.compute_advantages("dr_grpo", r, 5), np_grpo(r, 5, norm=False), rtol=1e-5, atol=1e-6
        )

    def test_broadcast_and_errors(self):
        adv = np.array([1.5, -2.0], np.float32)
        mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
        out = jax.jit(A.broadcast_to_tokens)(adv, mask)
        np.testing.assert_array_equal(out, [[1.5, 1.5, 0], [-2.0, 0, 0]])
        with pytest.raises(ValueError, match="group_size"):
            A.grpo_advantages(np.zeros(5, np.float32), 2)
        with pytest.raises(ValueError, match="adv"):
            A.broadcast_to_tokens(np.zeros(3, np.float32), mask)
        with pytest.raises(TypeError, match="rewards"):
            A.grpo_advantages(np.zeros(4, np.int32), 2)
        with pytest.raises(ValueError, match="estimator"):
            A.compute_advantages("ppo", np.zeros(4, np.float32), 2)
