"""Calibrated Clipping's bounds (losses.calibrated.solve): exactness when FP8 == BF16, the
quantile and balance rules against float64 numpy and a sorting reference, clamps, fallbacks,
and vmap."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import numpy as np
from _loss_testlib import CALIB, CFG, make_batch, np_balance, np_kept_share, np_share_below
from absl.testing import parameterized

from losses import calibrated as C


class PropertiesTest(chex.TestCase, parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(
        ("balance", "absolute"), ("balance", "relative"), ("quantile", "absolute")
    )
    def test_equal_ratios_give_plain_bounds(self, rule, balance):
        _, r16, adv, mask = make_batch(0)
        cfg = dataclasses.replace(CFG, upper_rule=rule, balance=balance)
        state, aux = self.variant(functools.partial(C.calibrate, cfg=cfg))(
            C.init_calib_state(cfg), r_fp8=r16, r_bf16=r16, adv=adv, mask=mask
        )
        assert float(aux["calib/alpha"]) > 0  # the BF16 ratios do clip something
        np.testing.assert_allclose(state.lower, 0.8, rtol=1e-7)
        np.testing.assert_allclose(state.upper, 1.28, rtol=1e-7)
        np.testing.assert_allclose(
            aux["calib/balance_fp8_calibrated"], aux["calib/balance_bf16"], rtol=1e-6
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_lower_share_matches_alpha_and_upper_is_minimal(self):
        r8, r16, adv, mask = make_batch(1)
        state, aux = self.variant(functools.partial(C.calibrate, cfg=CFG))(
            C.init_calib_state(CFG), r_fp8=r8, r_bf16=r16, adv=adv, mask=mask
        )
        lo, hi = float(state.lower), float(state.upper)
        # Independent reference stats in float64.
        alpha, n_neg = np_share_below(0.8, r16, adv, mask)
        p_ref = np_balance(0.8, 1.28, r16, adv, mask)
        np.testing.assert_allclose(aux["calib/alpha"], alpha, rtol=1e-6)
        np.testing.assert_allclose(aux["calib/p_ref"], p_ref, rtol=1e-5)
        share, _ = np_share_below(lo, r8, adv, mask)
        assert abs(share - alpha) <= 1.0 / n_neg
        assert 0.6 <= lo <= 1.0 and 1.0 <= hi < 1.8  # reached inside the range
        assert np_balance(lo, hi, r8, adv, mask) >= p_ref * (1 - 1e-5)
        # Any smaller H fails: the largest P ratio below H is excluded by every h <= it.
        pos = (mask > 0) & (adv > 0)
        below = r8[pos & (r8 < hi)]
        assert np_balance(lo, below.max(), r8, adv, mask) < p_ref
        np.testing.assert_allclose(
            C.balance(lo, hi, r8, adv, mask), np_balance(lo, hi, r8, adv, mask), rtol=1e-5
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_relative_balance_matches_float64_and_upper_is_minimal(self):
        r8, r16, adv, mask = make_batch(1)
        cfg = dataclasses.replace(CFG, balance="relative")
        state, aux = self.variant(functools.partial(C.calibrate, cfg=cfg))(
            C.init_calib_state(cfg), r_fp8=r8, r_bf16=r16, adv=adv, mask=mask
        )
        lo, hi = float(state.lower), float(state.upper)
        q_ref = np_kept_share(0.8, 1.28, r16, adv, mask)
        np.testing.assert_allclose(aux["calib/p_ref"], q_ref, rtol=1e-5)
        np.testing.assert_allclose(
            aux["calib/balance_bf16"], np_balance(0.8, 1.28, r16, adv, mask), rtol=1e-5
        )
        np.testing.assert_allclose(
            aux["calib/balance_fp8_unclipped"],
            np_balance(-np.inf, np.inf, r8, adv, mask),
            rtol=1e-5,
        )
        np.testing.assert_allclose(
            C.balance_share(lo, hi, r8, adv, mask),
            np_kept_share(lo, hi, r8, adv, mask),
            rtol=1e-5,
        )
        assert 1.0 <= hi < 1.8
        assert np_kept_share(lo, hi, r8, adv, mask) >= q_ref * (1 - 1e-5)
        pos = (mask > 0) & (adv > 0)
        assert np_kept_share(lo, r8[pos & (r8 < hi)].max(), r8, adv, mask) < q_ref

    @parameterized.parameters(("pos", 4.0), ("pos", 0.25), ("neg", 4.0), ("neg", 3.0))
    def test_relative_rule_cancels_the_advantage_mix(self, side, c):
        # The stored reference comes from one batch, the bounds from another whose advantages
        # of one sign are all scaled by c (another mix of sequences): the relative rule's H
        # does not move, the absolute one's does (it chases the mix, not the FP8 noise).
        _, r16, adv_ref, mask_ref = make_batch(14)
        r8, _, adv, mask = make_batch(15)
        sel = adv > 0 if side == "pos" else adv < 0
        scaled = np.where(sel, c * adv, adv).astype(np.float32)
        uppers = {}
        for balance in ("absolute", "relative"):
            cfg = dataclasses.replace(CFG, balance=balance)
            state, _ = CALIB(C.init_calib_state(cfg), cfg, r16, r16, adv_ref, mask_ref)
            for name, a in (("orig", adv), ("scaled", scaled)):
                _, hi = jax.jit(C.solve_bounds, static_argnums=4)(
                    state.reference(), r8, a, mask, cfg
                )
                uppers[balance, name] = float(hi)
            # The relative reference itself ignores a rescaled reference batch.
            ref = jax.jit(C.reference_stats, static_argnums=3)
            a_ref = np.where(adv_ref > 0 if side == "pos" else adv_ref < 0, c * adv_ref, adv_ref)
            p1 = float(ref(r16, adv_ref, mask_ref, cfg)["p_ref"])
            p2 = float(ref(r16, a_ref.astype(np.float32), mask_ref, cfg)["p_ref"])
            if balance == "relative":
                np.testing.assert_allclose(p2, p1, rtol=1e-5)
            else:
                np.testing.assert_allclose(p2, p1 * (c if side == "pos" else 1 / c), rtol=1e-5)
        np.testing.assert_allclose(
            uppers["relative", "scaled"], uppers["relative", "orig"], rtol=1e-6
        )
        assert abs(uppers["absolute", "scaled"] - uppers["absolute", "orig"]) > 1e-3, uppers

    def test_quantile_upper_rule_matches_beta_up(self):
        r8, r16, adv, mask = make_batch(2)
        cfg = dataclasses.replace(CFG, upper_rule="quantile")
        state, aux = CALIB(C.init_calib_state(cfg), cfg, r8, r16, adv, mask)
        pos = (mask > 0) & (adv > 0)
        beta_up = np.mean(r16[pos] > 1.28)
        np.testing.assert_allclose(aux["calib/beta_up"], beta_up, rtol=1e-6)
        assert abs(np.mean(r8[pos] > float(state.upper)) - beta_up) <= 1.0 / pos.sum()

    def test_plain_upper_rule_keeps_eps_high_and_the_lower_rule(self):
        """Lower-only (the paper's Fig. 5 ablation): H = 1 + eps_high always, L as the balance
        rule's L (the lower rule does not depend on the upper one)."""
        for seed in (2, 5):
            r8, r16, adv, mask = make_batch(seed, sigma_fp8=0.3)
            plain = dataclasses.replace(CFG, upper_rule="plain")
            s_plain, _ = CALIB(C.init_calib_state(plain), plain, r8, r16, adv, mask)
            s_bal, _ = CALIB(C.init_calib_state(CFG), CFG, r8, r16, adv, mask)
            assert float(s_plain.upper) == np.float32(1.28)
            assert float(s_plain.lower) == float(s_bal.lower)
            assert float(s_bal.upper) != np.float32(1.28)  # the balance rule did move H

    def test_clamps_hold_under_heavy_noise(self):
        for rule in ("balance", "quantile"):
            cfg = dataclasses.replace(CFG, upper_rule=rule)
            r8, r16, adv, mask = make_batch(3, sigma_bf16=0.15, sigma_fp8=1.5)
            state, aux = CALIB(C.init_calib_state(cfg), cfg, r8, r16, adv, mask)
            assert state.lower == np.float32(0.6) and state.upper == np.float32(1.8)
            r8 = np.ones_like(r8) * 1.5  # everything far above: L would be > 1, clamped to 1
            state, _ = CALIB(C.init_calib_state(cfg), cfg, r8, r16, adv, mask)
            assert 0.6 <= float(state.lower) <= 1.0 and 1.0 <= float(state.upper) <= 1.8

    @chex.variants(with_jit=True, without_jit=True)
    def test_empty_sets_fall_back_to_plain_without_nan(self):
        r8, r16, adv, mask = make_batch(4)
        calib = self.variant(functools.partial(C.calibrate, cfg=CFG))
        # No N: both plain (the balance has no denominator). No P: plain H, L still calibrated.
        cases = {
            "no_negative": (np.abs(adv), True),
            "no_positive": (-np.abs(adv), False),
            "zero_adv": (np.zeros_like(adv), True),
        }
        for name, (a, plain_lower) in cases.items():
            state, aux = calib(C.init_calib_state(CFG), r_fp8=r8, r_bf16=r16, adv=a, mask=mask)
            chex.assert_tree_all_finite((state, aux))
            np.testing.assert_allclose(state.upper, 1.28, err_msg=name)
            if plain_lower:
                np.testing.assert_allclose(state.lower, 0.8, err_msg=name)
            else:
                assert float(state.lower) < 0.8, name
        state, aux = calib(
            C.init_calib_state(CFG), r_fp8=r8, r_bf16=r16, adv=adv, mask=np.zeros_like(mask)
        )
        chex.assert_tree_all_finite((state, aux))
        np.testing.assert_allclose([state.lower, state.upper], [0.8, 1.28])
        # Balance with an empty denominator is 0, not NaN.
        assert float(C.balance(0.8, 1.28, r8, np.abs(adv), mask)) == 0.0

    def test_vmap_over_batches(self):
        batches = [make_batch(s) for s in (5, 6, 7)]
        r8 = np.stack([b[0] for b in batches])
        r16 = np.stack([b[1] for b in batches])
        adv, mask = batches[0][2], batches[0][3]
        init = C.init_calib_state(CFG)
        fn = jax.jit(jax.vmap(lambda a, b: C.calibrate(init, CFG, a, b, adv, mask)))
        states, aux = fn(r8, r16)
        for i in range(3):
            single, _ = CALIB(init, CFG, r8[i], r16[i], adv, mask)
            np.testing.assert_allclose(states.lower[i], single.lower, rtol=1e-6)
            np.testing.assert_allclose(states.upper[i], single.upper, rtol=1e-6)
        chex.assert_tree_all_finite(aux)


def _next_up(x):
    return np.nextafter(np.float32(x), np.float32(np.inf))


def brute_bounds(stats, r, adv, mask, cfg):
    """The documented rules by sorting and scanning (float64 sums): an independent reference.

    L: the point of {x : #{N, r < x} = k} nearest to 1 - eps_low (k = round(alpha |N|));
    H (balance): the smallest float32 h in [1, range_hi] with sum_{P, r < h} A r >= p * den,
    p = p_ref (absolute) or p_ref * sum_P A r / sum_N |A| r (relative)
    (1 + eps_high if it keeps the same P tokens below it); H (quantile): the point of
    {h : #{P, r > h} = m} nearest to 1 + eps_high (m = round(beta_up |P|)); both clamped.
    """
    f32 = np.float32
    on = mask > 0
    neg, pos = on & (adv < 0), on & (adv > 0)
    plo, phi = (f32(b) for b in cfg.plain_bounds)
    rlo, rhi = (f32(b) for b in cfg.range)
    x = np.sort(r[neg])
    if not (bool(stats["alpha_ok"]) and len(x) > 0):
        lower = plo
    else:
        k = int(np.round(f32(stats["alpha"]) * f32(len(x))))
        c_plain = int(np.sum(x < plo))
        if c_plain == k:
            lower = plo
        elif c_plain > k:
            lower = x[k]
        else:
            lower = _next_up(x[k - 1])
        lower = f32(min(max(lower, rlo), 1.0))
    y, ay = r[pos], adv[pos].astype(np.float64)
    if cfg.upper_rule == "balance":
        den = np.sum(np.where(neg & (r > lower), -adv.astype(np.float64) * r, 0.0))
        if not (bool(stats["p_ref_ok"]) and len(y) > 0 and den > 0):
            return lower, phi
        p = float(stats["p_ref"])
        if cfg.balance == "relative":
            p *= np_balance(-np.inf, np.inf, r, adv, mask)
        target = p * den * (1 - cfg.solver_rtol)
        grid = [f32(1.0)] + sorted({_next_up(v) for v in y if 1.0 <= _next_up(v) <= rhi})
        passing = [h for h in grid if np.sum(np.where(y < h, ay * y, 0.0)) >= target]
        if not passing:
            return lower, rhi
        upper = passing[0]
        if np.sum(np.where(y < phi, ay * y, 0.0)) >= target and np.sum(y < phi) == np.sum(
            y < upper
        ):
            upper = phi
    else:
        if not (bool(stats["beta_up_ok"]) and len(y) > 0):
            return lower, phi
        need = len(y) - int(np.round(f32(stats["beta_up"]) * f32(len(y))))
        ys = np.sort(y)
        le_plain = int(np.sum(ys <= phi))
        if le_plain == need:
            upper = phi
        elif le_plain < need:
            upper = ys[need - 1]
        else:
            upper = np.nextafter(ys[need], f32(-np.inf))
    return lower, f32(min(max(upper, 1.0), rhi))


class BruteForceTest(chex.TestCase):
    def test_solve_bounds_matches_sorting_reference_with_ties(self):
        solve = jax.jit(C.solve_bounds, static_argnums=4)
        ref_stats = jax.jit(C.reference_stats, static_argnums=3)
        rng = np.random.default_rng(21)
        for trial in range(24):
            adv = rng.normal(size=(6, 10)).astype(np.float32)
            if trial % 4 == 0:
                adv = np.round(adv).astype(np.float32)  # zero advantages: neither N nor P
            mask = (rng.random((6, 10)) < 0.8).astype(np.float32)
            s16, s8 = rng.uniform(0.02, 0.4, 2)
            r16 = np.exp(rng.normal(0, s16, (6, 10))).astype(np.float32)
            r8 = (r16 * np.exp(rng.normal(0, s8, (6, 10)))).astype(np.float32)
            if trial % 3 == 0:
                r8 = np.round(r8, 2).astype(np.float32)  # ties among the FP8 ratios
            for rule, balance in (
                ("balance", "absolute"),
                ("balance", "relative"),
                ("quantile", "absolute"),
            ):
                cfg = dataclasses.replace(CFG, upper_rule=rule, balance=balance)
                stats = ref_stats(r16, adv, mask, cfg)
                got = [np.float32(b) for b in solve(stats, r8, adv, mask, cfg)]
                want = brute_bounds(stats, r8, adv, mask, cfg)
                assert got == list(want), (trial, rule, got, want)
