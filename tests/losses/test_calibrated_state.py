"""Calibrated Clipping across steps (losses.calibrated.state): plain bounds before the first
calibration, hold vs track, EMA smoothing, on-policy skips, no gradient, and the FP8-noise
mechanism the method exists to fix."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from _loss_testlib import BOUNDS, CALIB, CFG, make_batch, np_balance, np_share_below

from losses import calibrated as C


class ModesTest(chex.TestCase):
    def test_plain_before_first_calibration(self):
        r8, _, adv, mask = make_batch(8)
        for mode in ("track", "hold"):
            cfg = dataclasses.replace(CFG, mode=mode)
            init = C.init_calib_state(cfg)
            state, lo, hi, aux = jax.jit(C.current_bounds, static_argnums=1)(
                init, cfg, r8, adv, mask
            )
            np.testing.assert_allclose([lo, hi], [0.8, 1.28])
            chex.assert_trees_all_equal(state, init)

    def test_hold_keeps_and_track_smooths(self):
        r8, r16, adv, mask = make_batch(9)
        r8b, _, _, _ = make_batch(10)
        hold = dataclasses.replace(CFG, mode="hold")
        state, _ = CALIB(C.init_calib_state(hold), hold, r8, r16, adv, mask)
        s2, lo, hi, _ = BOUNDS(state, hold, r8b, adv, mask)
        np.testing.assert_allclose([lo, hi], [state.lower, state.upper])
        chex.assert_trees_all_equal(s2, state)

        state, _ = CALIB(C.init_calib_state(CFG), CFG, r8, r16, adv, mask)
        lo_raw, hi_raw = jax.jit(C.solve_bounds, static_argnums=4)(
            state.reference(), r8b, adv, mask, CFG
        )
        s2, lo, hi, aux = BOUNDS(state, CFG, r8b, adv, mask)
        np.testing.assert_allclose(lo, 0.9 * state.lower + 0.1 * lo_raw, rtol=1e-6)
        np.testing.assert_allclose(hi, 0.9 * state.upper + 0.1 * hi_raw, rtol=1e-6)
        np.testing.assert_allclose([s2.lower, s2.upper], [lo, hi])
        assert int(s2.n_updates) == 1 and float(aux["calib/updated"]) == 1.0
        # On-policy mini-batch (all ratios exactly 1): no update.
        s3, lo3, hi3, aux3 = BOUNDS(s2, CFG, np.ones_like(r8b), adv, mask)
        np.testing.assert_allclose([lo3, hi3], [s2.lower, s2.upper])
        assert int(s3.n_updates) == 1 and float(aux3["calib/updated"]) == 0.0
        # The caller says on-policy: no update even when rounding moved r off 1 by an ulp.
        r_ulp = np.where(np.arange(r8b.size).reshape(r8b.shape) % 7 == 0, 1 + 2**-23, 1.0)
        s4, lo4, hi4, aux4 = BOUNDS(s2, CFG, r_ulp.astype(np.float32), adv, mask, True)
        np.testing.assert_allclose([lo4, hi4], [s2.lower, s2.upper])
        assert int(s4.n_updates) == 1 and float(aux4["calib/updated"]) == 0.0
        _, _, _, aux5 = BOUNDS(s2, CFG, r_ulp.astype(np.float32), adv, mask, False)
        assert float(aux5["calib/updated"]) == 1.0  # without the flag, the ulp counts as moved

    def test_calibration_smooths_with_previous_bounds(self):
        r8, r16, adv, mask = make_batch(11)
        s1, a1 = CALIB(C.init_calib_state(CFG), CFG, r8, r16, adv, mask)
        np.testing.assert_allclose(s1.lower, a1["calib/lower_raw"])  # first: raw, unsmoothed
        r8b, r16b, _, _ = make_batch(12)
        s2, a2 = CALIB(s1, CFG, r8b, r16b, adv, mask)
        np.testing.assert_allclose(
            s2.lower, 0.9 * s1.lower + 0.1 * a2["calib/lower_raw"], rtol=1e-6
        )
        np.testing.assert_allclose(
            s2.upper, 0.9 * s1.upper + 0.1 * a2["calib/upper_raw"], rtol=1e-6
        )
        assert int(s2.n_calibrations) == 2

    def test_bounds_carry_no_gradient(self):
        r8, r16, adv, mask = make_batch(13)
        state, _ = CALIB(C.init_calib_state(CFG), CFG, r8, r16, adv, mask)
        g = jax.grad(lambda r: sum(C.current_bounds(state, CFG, r, adv, mask)[1:3]))(
            jnp.asarray(r8)
        )
        assert np.all(np.asarray(g) == 0.0)


class MechanismTest(chex.TestCase):
    def test_fp8_noise_clips_more_negatives_and_calibration_restores(self):
        # BF16 ratios after an update step; FP8 adds log-normal noise of a blockwise-FP8 size
        # (log-ratio std ~ 0.05-0.1; docs/paper.md's toy: clip share 0.4% -> 1.3% for blockwise).
        rng = np.random.default_rng(0)
        b, t = 64, 128
        adv = np.repeat(rng.normal(size=(b, 1)), t, 1).astype(np.float32)  # sequence-level A
        mask = (np.arange(t)[None, :] < rng.integers(t // 4, t, (b, 1))).astype(np.float32)
        r16 = np.exp(rng.normal(0, 0.12, (b, t))).astype(np.float32)
        r8 = (r16 * np.exp(rng.normal(0, 0.07, (b, t)))).astype(np.float32)
        alpha, n_neg = np_share_below(0.8, r16, adv, mask)
        plain_share, _ = np_share_below(0.8, r8, adv, mask)
        assert plain_share > 1.5 * alpha  # FP8 noise pushes negatives out of the trust region
        p_ref = np_balance(0.8, 1.28, r16, adv, mask)
        plain_balance = np_balance(0.8, 1.28, r8, adv, mask)
        state, aux = CALIB(C.init_calib_state(CFG), CFG, r8, r16, adv, mask)
        lo, hi = float(state.lower), float(state.upper)
        assert lo < 0.8 and 1.28 < hi < 1.8  # both bounds move, the upper one inside the range
        cal_share, _ = np_share_below(lo, r8, adv, mask)
        assert abs(cal_share - alpha) <= 1.0 / n_neg
        cal_balance = np_balance(lo, hi, r8, adv, mask)
        assert abs(cal_balance - p_ref) < 0.1 * abs(plain_balance - p_ref)
        assert cal_balance >= p_ref * (1 - 1e-5)
        # Lower-only calibration over-penalises: balance falls below the BF16 one.
        assert np_balance(lo, 1.28, r8, adv, mask) < p_ref
        np.testing.assert_allclose(
            aux["calib/fp8_clipfrac_neg_lower_plain"], plain_share, rtol=1e-5
        )
        np.testing.assert_allclose(
            aux["calib/fp8_clipfrac_neg_lower_calibrated"], cal_share, rtol=1e-5
        )
