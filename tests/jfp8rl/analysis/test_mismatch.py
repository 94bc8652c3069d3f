"""`python -m jfp8rl.mismatch`: the trainer's rollout_corr/kl per recipe pairing and its split.

References: float64 numpy for the estimator (k1 = mean of rollout_logp - old_logp over the
sampled tokens, k3 = mean of exp(d) - d - 1 with d = old_logp - rollout_logp) on random arrays
and on the arrays the measurement wrote; exact cases: an identical pair of arrays gives 0 in
every statistic, a pairing of one recipe with itself has a recipe term of exactly 0, and the
BF16 and block recipes are batch-invariant at these small shapes (the micro-batch term is
exactly 0, as in the audit's noise floor, tests/jfp8rl/analysis/test_audit.py). The terms'
k1 telescope: their sum is the trainer's figure.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_run import TINY, small

from jfp8rl.analysis.mismatch import parse_pairings, parse_recipe, split_row, term
from jfp8rl.config import ConfigError


def _random(seed: int, n: int = 6, r: int = 9):
    rng = np.random.default_rng(seed)
    a = (-rng.uniform(0.01, 6.0, size=(n, r))).astype(np.float32)
    b = (a + rng.normal(0.0, 0.3, size=(n, r))).astype(np.float32)
    lens = rng.integers(0, r + 1, size=n)
    lens[0] = r
    mask = (np.arange(r)[None, :] < lens[:, None]).astype(np.float32)
    return a * mask, b * mask, mask


def test_term_against_float64_numpy() -> None:
    a, b, mask = _random(0)
    got = term(a, b, mask)
    on = mask > 0
    d = b.astype(np.float64)[on] - a.astype(np.float64)[on]  # trainer - rollout
    assert got["k1"] == pytest.approx(np.mean(-d), rel=1e-5, abs=1e-7)
    assert got["k3"] == pytest.approx(np.mean(np.exp(d) - d - 1.0), rel=1e-4, abs=1e-7)
    assert got["abs_mean"] == pytest.approx(np.mean(np.abs(d)), rel=1e-12)
    assert got["abs_max"] == pytest.approx(np.max(np.abs(d)), rel=1e-12)
    assert got["exact_share"] == 0.0


def test_identical_pair_is_exactly_zero() -> None:
    a, _, mask = _random(1)
    got = term(a, a.copy(), mask)
    assert got == {"k1": 0.0, "k3": 0.0, "abs_mean": 0.0, "abs_max": 0.0, "exact_share": 1.0}


def test_split_telescopes() -> None:
    a, b, mask = _random(2)
    c, d, _ = _random(3)
    c, d = c * mask, d * mask
    row = split_row(a, b, c, d, mask)
    on = mask > 0
    whole = np.mean(a.astype(np.float64)[on] - d.astype(np.float64)[on])
    assert row["sum_k1"] == pytest.approx(whole, rel=1e-5, abs=1e-6)
    assert row["sum_k1"] == pytest.approx(term(a, d, mask)["k1"], rel=1e-5, abs=1e-6)


def test_parse() -> None:
    assert parse_recipe("fp8_block+pow2").pow2_scales
    assert not parse_recipe("fp8_block").pow2_scales
    assert parse_pairings("bf16/bf16,fp8_tensor/bf16") == (("bf16", "bf16"), ("fp8_tensor", "bf16"))
    for bad in ("fp9", "bf16+pow2"):
        with pytest.raises(ConfigError, match="recipe"):
            parse_recipe(bad)
    with pytest.raises(ConfigError, match="ROLLOUT/TRAINER"):
        parse_pairings("fp8_block")


PAIRINGS = (("bf16", "bf16"), ("fp8_block", "fp8_block"), ("fp8_block", "bf16"),
            ("fp8_tensor", "fp8_tensor"))  # fmt: skip


@pytest.mark.slow
def test_on_the_tiny_policy(base_policy_dir, cache_dir, tmp_path) -> None:
    from jfp8rl.analysis.mismatch import run_mismatch

    sets = small(tmp_path / "unused", cache_dir, "rollout.temperature=0.8")
    rows = run_mismatch(str(TINY), sets, tmp_path, PAIRINGS, log=lambda m: None)
    assert [(r["rollout_recipe"], r["train_recipe"]) for r in rows] == list(PAIRINGS)
    assert json.loads((tmp_path / "mismatch.json").read_text()) == rows
    arrays = np.load(tmp_path / "arrays.npz")
    for row in rows:
        rs, ss = row["rollout_recipe"], row["train_recipe"]
        on = arrays[f"{rs}/mask"] > 0
        assert row["tokens"] == int(on.sum()) > 0
        roll = arrays[f"{rs}/rollout_logp"].astype(np.float64)[on]
        old = arrays[f"{rs}/old/{ss}"].astype(np.float64)[on]
        # The trainer's own figure, against float64 numpy on the arrays it was computed from.
        assert row["rollout_corr/kl"] == pytest.approx(np.mean(roll - old), rel=1e-4, abs=1e-7)
        d = old - roll
        k3 = np.mean(np.exp(d) - d - 1.0)
        assert row["rollout_corr/k3_kl"] == pytest.approx(k3, rel=1e-3, abs=1e-7)
        assert row["sum_k1"] == pytest.approx(row["rollout_corr/kl"], rel=1e-4, abs=1e-7)
        if rs == ss:
            assert row["recipe_k1"] == 0.0 and row["recipe_abs_mean"] == 0.0
        if rs in ("bf16", "fp8_block"):
            assert row["batch_abs_max"] == 0.0  # batch-invariant at these shapes
        assert row["temperature_k1"] != 0.0  # T = 0.8: scoring at 1 would differ
    drift = json.loads((tmp_path / "requantization.json").read_text())
    assert drift["installed_exact"] == 1.0  # the engine installs the trainer's operand
    assert 0.0 <= drift["requantize_weights_changed_share"] <= 1.0
    assert 0.0 <= drift["requantize_scales_moved_share"] <= 1.0
    bf16 = rows[0]
    # f32 compute without FP8: decode equals the full forward up to summation order.
    assert bf16["decode_abs_max"] < 1e-4
    assert abs(bf16["rollout_corr/kl"]) < 1e-6


@pytest.mark.slow
def test_exact_on_policy_has_no_mismatch(base_policy_dir, cache_dir, tmp_path) -> None:
    """`rollout.on_policy=exact`: every link of the chain is exactly 0 for both recipes (the
    engine's decode, the trainer's micro-batches), and so is the trainer's own figure."""
    from jfp8rl.analysis.mismatch import run_mismatch

    sets = small(tmp_path / "unused", cache_dir, "rollout.temperature=0.8",
                 "rollout.on_policy=exact", "train.micro_batch_size=4")  # fmt: skip
    pairings = (("bf16", "bf16"), ("fp8_block", "fp8_block"))
    rows = run_mismatch(str(TINY), sets, tmp_path, pairings, log=lambda m: None)
    for row in rows:
        assert row["tokens"] > 0
        assert row["rollout_corr/kl"] == 0.0 and row["rollout_corr/k3_kl"] == 0.0, row
        for name in ("decode", "batch", "recipe"):
            assert row[f"{name}_abs_max"] == 0.0 and row[f"{name}_exact_share"] == 1.0, name
