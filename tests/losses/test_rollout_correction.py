"""TIS / IcePop / MIS weights, batch normalisation and off-policy metrics against float64
numpy (verl equality: test_rollout_correction_verl.py)."""

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


def np_weights(old, roll, mask, mode, level, cap, lower=0.5):
    lr = (old.astype(np.float64) - roll) * mask
    rho = (
        np.exp(np.clip(lr, -20, 20))
        if level == "token"
        else np.repeat(np.exp(np.clip(lr.sum(-1), -20, 20))[:, None], lr.shape[1], 1)
    )
    w = {
        "tis": np.minimum(rho, cap),
        "mis": np.where(rho <= cap, rho, 0.0),
        "icepop": np.where((rho >= lower) & (rho <= cap), rho, 0.0),
        "none": np.ones_like(rho),
    }[mode]
    return w * mask, rho


class ISWeightsTest(chex.TestCase, parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(mode=("tis", "mis", "icepop", "none"), level=("token", "sequence"))
    def test_matches_numpy(self, mode, level):
        old, roll, mask = inputs(1)
        f = functools.partial(is_weights, mode=mode, level=level, cap=2.0, lower=0.5)
        w, aux = self.variant(f)(old, roll, mask)
        ref, rho = np_weights(old, roll, mask, mode, level, 2.0)
        np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-7)
        if mode == "none":
            assert aux == {}
            return
        on = mask > 0
        np.testing.assert_allclose(aux["rollout_corr/rollout_is_mean"], ref[on].mean(), rtol=1e-5)
        if level == "token":
            high = np.mean(rho[on] > 2.0)
            np.testing.assert_allclose(aux["rollout_corr/rollout_is_ratio_fraction_high"], high)
        # ESS = 1 / mean((w / mean w)^2) = (sum w)^2 / (n sum w^2) for w <= C.
        ess = ref[on].sum() ** 2 / (on.sum() * (ref[on] ** 2).sum())
        np.testing.assert_allclose(aux["rollout_corr/rollout_is_eff_sample_size"], ess, rtol=1e-5)

    @chex.variants(with_jit=True)
    @parameterized.product(level=("token", "sequence"))
    def test_batch_normalisation_gives_mean_one(self, level):
        old, roll, mask = inputs(4)
        mask[2] = 0.0  # an empty sequence does not count in the sequence-level mean
        f = functools.partial(is_weights, mode="tis", level=level, cap=2.0, batch_normalize=True)
        w, aux = self.variant(f)(old, roll, mask)
        ref, _ = np_weights(old, roll, mask, "tis", level, 2.0)
        on, rows = mask > 0, mask.sum(-1) > 0
        mean = ref[on].mean() if level == "token" else ref[rows].max(-1).mean()
        np.testing.assert_allclose(w, ref / mean, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(aux["rollout_corr/rollout_is_batch_norm_factor"], mean, 1e-5)

    @parameterized.product(mode=("tis", "mis"), level=("token", "sequence"))
    def test_tis_and_mis_weights_are_the_earlier_formula_bit_for_bit(self, mode, level):
        """The menu's extension leaves the TIS / MIS weights of existing configs as they were:
        clamp the (summed) log-ratio, exp, then truncate or mask, times the mask."""
        old, roll, mask = inputs(5)
        on = mask != 0
        log_rho = jnp.where(on, jnp.asarray(old) - jnp.asarray(roll), 0.0)
        if level == "token":
            rho = jnp.exp(jnp.clip(log_rho, -20.0, 20.0))
        else:
            seq = jnp.exp(jnp.clip(jnp.sum(log_rho, axis=-1), -20.0, 20.0))
            rho = jnp.broadcast_to(seq[:, None], log_rho.shape)
        want = jnp.minimum(rho, 2.0) if mode == "tis" else jnp.where(rho <= 2.0, rho, 0.0)
        w, _ = is_weights(old, roll, mask, mode=mode, level=level, cap=2.0)
        np.testing.assert_array_equal(w, want * mask)

    def test_hand_case_and_no_gradient(self):
        # rho = 0.5, 1.5, 3.0 (padding last)
        old = np.log(np.array([[0.5, 0.3, 0.6, 0.2]], np.float32))
        roll = np.log(np.array([[1.0, 0.2, 0.2, 0.9]], np.float32))
        mask = np.array([[1, 1, 1, 0]], np.float32)
        w, _ = is_weights(old, roll, mask, mode="tis", cap=2.0)
        np.testing.assert_allclose(w, [[0.5, 1.5, 2.0, 0.0]], rtol=1e-6)
        w, _ = is_weights(old, roll, mask, mode="mis", cap=2.0)
        np.testing.assert_allclose(w, [[0.5, 1.5, 0.0, 0.0]], rtol=1e-6)
        w, _ = is_weights(old, roll, mask, mode="icepop", cap=2.0, lower=0.6)
        np.testing.assert_allclose(w, [[0.0, 1.5, 0.0, 0.0]], rtol=1e-6)
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
        # Per-sequence perplexities (mean over sequences) and chi^2 (verl's definitions).
        m64 = mask.astype(np.float64)
        seq_t = (tl * m64).sum(-1) / m64.sum(-1)
        seq_r = (rl * m64).sum(-1) / m64.sum(-1)
        np.testing.assert_allclose(aux["rollout_corr/training_ppl"], np.exp(-seq_t).mean(), 1e-5)
        np.testing.assert_allclose(
            aux["rollout_corr/ppl_ratio"], np.exp(seq_r - seq_t).mean(), 1e-5
        )
        np.testing.assert_allclose(aux["rollout_corr/chi2_token"], np.mean(np.exp(2 * d)) - 1, 1e-5)
        seq_d = ((tl.astype(np.float64) - rl) * m64).sum(-1)
        np.testing.assert_allclose(aux["rollout_corr/chi2_seq"], np.exp(2 * seq_d).mean() - 1, 1e-5)
        pd = np.abs(np.exp(tl.astype(np.float64)) - np.exp(rl.astype(np.float64)))[on]
        np.testing.assert_allclose(aux["training/rollout_probs_diff_mean"], pd.mean(), rtol=1e-5)
        np.testing.assert_allclose(aux["training/rollout_probs_diff_max"], pd.max(), rtol=1e-5)

    def test_errors_name_argument(self):
        tl, rl, mask = inputs(3)
        with self.assertRaisesRegex(ValueError, "rollout_logp"):
            mismatch_metrics(tl, rl[:, :3], mask)
        with self.assertRaisesRegex(ValueError, "mode"):
            is_weights(tl, rl, mask, mode="clip")
        with self.assertRaisesRegex(ValueError, "lower"):
            is_weights(tl, rl, mask, mode="icepop", cap=2.0, lower=3.0)


def test_empty_mask_gives_finite_metrics():
    """A step whose groups dynamic sampling all dropped has no response token: every metric is
    finite (verl raises there)."""
    from losses.rollout_rejection import parse_rejection, rejection_mask

    old, roll, _ = inputs(6)
    empty = np.zeros(old.shape, np.float32)
    for level in ("token", "sequence"):
        w, aux = jax.jit(functools.partial(is_weights, mode="icepop", level=level, lower=0.5,
                                           batch_normalize=True))(old, roll, empty)  # fmt: skip
        assert np.all(np.asarray(w) == 0)
        assert all(np.isfinite(float(v)) for v in aux.values()), aux
    rules = parse_rejection("token_k1,seq_sum_k2,seq_max_k3", "2.0")
    kept, aux = jax.jit(rejection_mask, static_argnums=3)(old, roll, empty, rules)
    assert np.all(np.asarray(kept) == 0)
    assert all(np.isfinite(float(v)) for v in aux.values()), aux
