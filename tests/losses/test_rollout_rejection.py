"""Rejection masks on hand-computed cases, and the threshold parsing's errors (equality with
verl's code for every mode: test_rollout_correction_verl.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from losses.rollout_rejection import RejectionRule, parse_rejection, rejection_mask

# Row 0: ratios pi_old / pi_rollout 2.5, 0.5, 1 (then padding); row 1: e^0.1, e^-0.1, 1, 1.
LOG_RATIO = np.array([[np.log(2.5), np.log(0.5), 0.0, 0.0], [0.1, -0.1, 0.0, 0.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int32)
ROLL = np.full(LOG_RATIO.shape, -1.0, np.float32)


def run(modes, spec):
    rules = parse_rejection(modes, spec)
    return jax.jit(rejection_mask, static_argnums=3)(ROLL + LOG_RATIO, ROLL, MASK, rules)


def test_token_k1_keeps_ratios_inside_the_bounds():
    # k1 = -log ratio must lie in [log 0.6, log 1.5]: ratios 2.5 and 0.5 are out.
    kept, aux = run("token_k1", "0.6_1.5")
    np.testing.assert_array_equal(kept, [[0, 0, 1, 0], [1, 1, 1, 1]])
    assert kept.dtype == MASK.dtype
    np.testing.assert_allclose(aux["rollout_corr/rollout_rs_masked_fraction"], 2 / 7)
    np.testing.assert_allclose(aux["rollout_corr/rollout_rs_seq_masked_fraction"], 0.5)
    np.testing.assert_allclose(aux["rollout_corr/rollout_rs_token_k1_fraction_high"], 1 / 7)
    np.testing.assert_allclose(aux["rollout_corr/rollout_rs_token_k1_fraction_low"], 1 / 7)


def test_sequence_modes_drop_whole_sequences_and_combine():
    # k3 = r - 1 - log r: 0.584 for r = 2.5, so seq_max_k3 <= 0.5 drops row 0 entirely.
    kept, aux = run("seq_max_k3", "0.5")
    np.testing.assert_array_equal(kept, [[0, 0, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_allclose(aux["rollout_corr/rollout_rs_seq_max_k3_max"], 1.5 - np.log(2.5))
    # seq_sum_k1: sum of -log r = -log(1.25) for row 0, 0 for row 1; bounds [0.9, 1.1] on the
    # product of ratios keep row 1 only. Combined with token_k1, the AND of both.
    kept, _ = run("seq_sum_k1,token_k1", "0.9_1.1,0.6_1.5")
    np.testing.assert_array_equal(kept, [[0, 0, 0, 0], [1, 1, 1, 1]])
    kept, _ = run("seq_mean_k2", "0.2")  # row 0: (0.84 + 0.48) / 3 / 2 = 0.22 > 0.2
    np.testing.assert_array_equal(kept, [[0, 0, 0, 0], [1, 1, 1, 1]])


def test_parsing_shares_one_threshold_and_defaults_k1_lower():
    assert parse_rejection("token_k1, seq_max_k2,token_k1", "2") == (
        RejectionRule("token_k1", 2.0, 0.5),
        RejectionRule("seq_max_k2", 2.0, None),
    )
    assert parse_rejection("", "") == ()


@pytest.mark.parametrize(
    "modes, spec, why",
    [
        ("token_k4", "2", "not one of"),
        ("token_k2", "0.5_2", "single upper"),
        ("token_k1,token_k2,seq_max_k3", "1,2", "one per mode"),
        ("token_k1", "", "one per mode"),
        ("seq_sum_k1", "2_0.5", "lower <= upper"),
        ("token_k3", "-1", "positive"),
        ("token_k3", "abc", "abc"),
    ],
)
def test_bad_specs_say_why(modes, spec, why):
    with pytest.raises(ValueError, match=why):
        parse_rejection(modes, spec)
