"""TIS / MIS weights and mismatch metrics against float64 numpy."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from losses.rollout_correction import is_weights, mismatch_metrics


def inputs(seed=0, b=5, t=7):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.0, 0.5, (b, t)).astype(np.float32)
    roll = (old + rng.normal(0, 0.5, (b, t))).astype(np.float32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    return old, roll, mask


def np_weights(old, roll, mask, mode, level, cap):
    lr = (old.astype(np.float64) - roll) * mask
    rho = (
        np.exp(np.clip(lr, -20, 20))
        if level == "token"
        else np.repeat(np.exp(np.clip(lr.sum(-1), -20, 20))[:, None], lr.shape[1], 1)
    )
    w = {
        "tis": np.minimum(rho, cap),
        "mis": np.where(rho <= cap, rho, 0.0),
        "none": np.ones_like(rho),
    }[mode]
    return w * mask, rho


class ISWeightsTest(chex.TestCase, parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(mode=("tis", "mis", "none"), level=("token", "sequence"))
    def test_matches_numpy(self, mode, level):
        old, roll, mask = inputs(1)
        w, aux = self.variant(functools.partial(is_weights, mode=mode, level=level, cap=2.0))(
            old, roll, mask
        )
        ref, rho = np_weights(old, roll, mask, mode, level, 2.0)
        np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-7)
        on = mask > 0
        np.testing.assert_allclose(aux["rollout_corr/is_mean"], ref[on].mean(), rtol=1e-5)
        np.testing.assert_allclose(
            aux["rollout_corr/is_clipfrac"], np.mean(rho[on] > 2.0), rtol=1e-6
        )
        ess = ref[on].sum() ** 2 / (on.sum() * (ref[on] ** 2).sum())
        np.testing.assert_allclose(aux["rollout_corr/is_ess"], ess, rtol=1e-5)

    def test_hand_case_and_no_gradient(self):
        # rho = 0.5, 1.5, 3.0 (padding last)
        old = np.log(np.array([[0.5, 0.3, 0.6, 0.2]], np.float32))
        roll = np.log(np.array([[1.0, 0.2, 0.2, 0.9]], np.float32))
        mask = np.array([[1, 1, 1, 0]], np.float32)
        w, _ = is_weights(old, roll, mask, mode="tis", cap=2.0)
        np.testing.assert_allclose(w, [[0.5, 1.5, 2.0, 0.0]], rtol=1e-6)
        w, _ = is_weights(old, roll, mask, mode="mis", cap=2.0)
        np.testing.assert_allclose(w, [[0.5, 1.5, 0.0, 0.0]], rtol=1e-6)
        w, _ = is_weights(old, roll, mask, mode="tis", level="sequence", cap=5.0)
        np.testing.assert_allclose(w, [[2.25, 2.25, 2.25, 0.0]], rtol=1e-5)  # 0.5*1.5*3
        g = jax.grad(lambda o: jnp.sum(is_weights(o, roll, mask, mode="tis")[0]))(jnp.asarray(old))
        assert np.all(np.asarray(g) == 0.0)


class MismatchTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_numpy(self):
        tl, rl, mask = inputs(2)
        aux = self.variant(mismatch_metrics)(tl, rl, mask)
        on = mask > 0
        d = (tl.astype(np.float64) - rl)[on]
        np.testing.assert_allclose(aux["rollout_corr/kl"], np.mean(-d), rtol=1e-5)
        np.testing.assert_allclose(aux["rollout_corr/k3_kl"], np.mean(np.exp(d) - d - 1), rtol=1e-5)
        pd = np.abs(np.exp(tl.astype(np.float64)) - np.exp(rl.astype(np.float64)))[on]
        np.testing.assert_allclose(aux["training/rollout_probs_diff_mean"], pd.mean(), rtol=1e-5)
        np.testing.assert_allclose(aux["training/rollout_probs_diff_max"], pd.max(), rtol=1e-5)

    def test_errors_name_argument(self):
        tl, rl, mask = inputs(3)
        with self.assertRaisesRegex(ValueError, "rollout_logp"):
            mismatch_metrics(tl, rl[:, :3], mask)
        with self.assertRaisesRegex(ValueError, "mode"):
            is_weights(tl, rl, mask, mode="clip")
