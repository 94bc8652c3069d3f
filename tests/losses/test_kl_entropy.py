"""KL estimators (loss and reward penalty) and the entropy bonus against float64 numpy."""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
from absl.testing import parameterized

from losses.entropy import entropy_bonus
from losses.kl import kl_loss, kl_penalty, kl_reward_penalty


def inputs(seed=0, b=4, t=6):
    rng = np.random.default_rng(seed)
    lp = rng.normal(-1.0, 0.4, (b, t)).astype(np.float32)
    ref = (lp + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    return lp, ref, mask


def np_kl(lp, ref, kind):
    d = lp.astype(np.float64) - ref
    return {"k1": d, "k2": 0.5 * d**2, "k3": np.exp(-d) + d - 1}[kind]


class KLTest(chex.TestCase, parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("k1", "k2", "k3")
    def test_estimators_and_loss(self, kind):
        lp, ref, mask = inputs(1)
        np.testing.assert_allclose(
            self.variant(functools.partial(kl_penalty, kind=kind))(lp, ref),
            np_kl(lp, ref, kind),
            rtol=1e-5,
            atol=1e-6,
        )
        loss, aux = self.variant(functools.partial(kl_loss, kind=kind, agg_mode="token-mean"))(
            lp, ref, mask
        )
        np.testing.assert_allclose(
            loss, np_kl(lp, ref, kind)[mask > 0].mean(), rtol=1e-5, atol=1e-7
        )
        # The gradient of k3 is 1 - pi_ref / pi per token (over the token count).
        if kind == "k3":
            g = jax.grad(lambda x: kl_loss(x, ref, mask, kind="k3")[0])(lp)
            np.testing.assert_allclose(
                g, (1 - np.exp(ref - lp)) * mask / mask.sum(), rtol=1e-4, atol=1e-7
            )

    @chex.variants(with_jit=True, without_jit=True)
    def test_reward_penalty(self):
        lp, ref, mask = inputs(2)
        scores = np.zeros_like(lp)
        scores[:, -1] = 1.0
        out, aux = self.variant(functools.partial(kl_reward_penalty, beta=0.1, kind="k1"))(
            scores, lp, ref, mask
        )
        kl = np_kl(lp, ref, "k1") * mask
        np.testing.assert_allclose(out, scores - 0.1 * kl, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(
            aux["actor/reward_kl_penalty"],
            np.mean(kl.sum(-1) / np.maximum(mask.sum(-1), 1)),
            rtol=1e-5,
        )


class EntropyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_seq_mean_token_mean(self):
        ent = np.array([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]], np.float32)
        mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
        val, aux = self.variant(functools.partial(entropy_bonus, agg_mode="seq-mean-token-mean"))(
            ent, mask
        )
        np.testing.assert_allclose(val, (1.5 + 4.0) / 2, rtol=1e-6)
        np.testing.assert_allclose(aux["actor/entropy"], 2.75, rtol=1e-6)
