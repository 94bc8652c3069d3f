"""`python -m jfp8rl.audit` on the tiny policy: its rows, and the numbers that are exact by
construction (issue 12, part A).

Exact references: the BF16 recipe is batch-invariant and is its own shadow, so its noise floor
and its log r - log r16 are exactly 0 (at these small shapes XLA:CPU sums the mini-batch and
the whole batch in the same order; at 512 samples it differs by ~5e-7, docs/fp8_study.md);
per-1x128-tile (block) scales are batch-invariant too;
the per-tensor scale is an amax over the whole batch, so the same token quantizes differently
in the whole batch (old logprobs) and in a mini-batch (new logprobs): a non-zero floor. The
calibrated lower bound leaves exactly round(alpha |N|) tokens of N below it (losses.calibrated),
so its share equals the BF16 share within 1 / |N|.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tiny_run import TINY, small

RECIPES = (("bf16", "-"), ("fp8_tensor", "e4m3"), ("fp8_block", "e5m2"))


@pytest.fixture(scope="module")
def audit(base_policy_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from jfp8rl.audit import run_audit

    out = tmp_path_factory.mktemp("audit")
    sets = small(out / "unused", cache_dir, "data.batch_size=8", "train.mini_batches=4")
    rows = run_audit(str(TINY), sets, out, RECIPES, log=lambda m: None)
    return out, rows


def test_rows_present_and_finite(audit) -> None:
    out, rows = audit
    from jfp8rl.audit import UPDATES

    keys = {(r["recipe"], r["grad_format"], r["updates"]) for r in rows}
    assert keys == {(rc, g, u) for rc, g in RECIPES for u in UPDATES}
    required = (
        "recipe updates noise_floor clip_neg_lower_fp8 clip_neg_lower_bf16 clip_pos_upper_fp8 "
        "clip_pos_upper_bf16 balance_fp8 balance_bf16 L H clip_neg_lower_calibrated "
        "balance_calibrated n_neg n_pos"
    ).split()
    on_disk = json.loads((out / "audit.json").read_text())
    assert on_disk == rows
    for r in rows:
        for k in required:
            assert k in r, k
            if k != "recipe":
                assert math.isfinite(r[k]), (k, r)
        assert r["n_neg"] > 0 and r["n_pos"] > 0  # the batch has both signs to audit
    table = (out / "audit.md").read_text().splitlines()
    assert len(
        [line for line in table if line.startswith("| fp8_") or line.startswith("| bf16")]
    ) == len(rows)


def test_exact_cases(audit) -> None:
    _, rows = audit
    by = {(r["recipe"], r["updates"]): r for r in rows}
    for u in (0, 1, 2, 4):
        b = by[("bf16", u)]
        assert b["noise_floor"] == 0.0
        assert b["std_log_r_fp8_minus_bf16"] == 0.0  # BF16 is its own shadow
        assert b["clip_neg_lower_fp8"] == b["clip_neg_lower_bf16"]
        assert (b["L"], b["H"]) == pytest.approx((0.8, 1.28), abs=1e-6)  # FP8 == BF16: plain
    assert by[("fp8_block", 0)]["noise_floor"] == 0.0  # batch-invariant tiles
    assert by[("fp8_tensor", 0)]["noise_floor"] > 1e-4  # a whole-batch amax
    # The updates run at the configured lr (no warm-up): the ratios move.
    assert by[("bf16", 1)]["std_log_r"] > 0.0


def test_calibrated_shares_match_bf16(audit) -> None:
    _, rows = audit
    for r in rows:
        if r["L"] > 0.6 + 1e-6:  # not at the range clamp
            tol = 1.0 / r["n_neg"] + 1e-7
            assert abs(r["clip_neg_lower_calibrated"] - r["clip_neg_lower_bf16"]) <= tol, r
