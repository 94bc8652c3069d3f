"""Clipping statistics (losses.calibrated.stats) against float64 numpy."""

from __future__ import annotations

import numpy as np
from _loss_testlib import CFG, make_batch, np_balance, np_kept_share, np_share_below

from losses import calibrated as C


def test_clip_stats_match_numpy():
    r8, _, adv, mask = make_batch(6, sigma_fp8=0.3)
    got = {k: float(v) for k, v in C.clip_stats(0.8, 1.28, r8, adv, mask).items()}
    share, n_neg = np_share_below(0.8, r8, adv, mask)
    pos = (mask > 0) & (adv > 0)
    np.testing.assert_allclose(got["neg_lower"], share, rtol=1e-6)
    np.testing.assert_allclose(got["pos_upper"], np.mean(r8[pos] > 1.28), rtol=1e-6)
    np.testing.assert_allclose(got["balance"], np_balance(0.8, 1.28, r8, adv, mask), rtol=1e-5)
    assert (got["n_neg"], got["n_pos"]) == (n_neg, pos.sum())


def test_balance_share_and_reference_stats_match_float64():
    r8, r16, adv, mask = make_batch(16)
    np.testing.assert_allclose(
        C.balance(0.8, 1.28, r8, adv, mask), np_balance(0.8, 1.28, r8, adv, mask), rtol=1e-5
    )
    np.testing.assert_allclose(
        C.balance_share(0.8, 1.28, r8, adv, mask),
        np_kept_share(0.8, 1.28, r8, adv, mask),
        rtol=1e-5,
    )
    ref = C.reference_stats(r16, adv, mask, CFG)
    pos = (mask > 0) & (adv > 0)
    np.testing.assert_allclose(ref["alpha"], np_share_below(0.8, r16, adv, mask)[0], rtol=1e-6)
    np.testing.assert_allclose(ref["beta_up"], np.mean(r16[pos] > 1.28), rtol=1e-6)
    np.testing.assert_allclose(ref["p_ref"], np_balance(0.8, 1.28, r16, adv, mask), rtol=1e-5)
    assert bool(ref["alpha_ok"]) and bool(ref["p_ref_ok"]) and bool(ref["beta_up_ok"])


def test_empty_denominator_gives_zero_not_nan():
    r8, _, adv, mask = make_batch(17)
    assert float(C.balance(0.8, 1.28, r8, np.abs(adv), mask)) == 0.0
    assert float(C.balance_share(0.8, 1.28, r8, np.abs(adv), mask)) == 0.0
