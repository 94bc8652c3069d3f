"""`python -m jfp8rl.audit` on the tiny policy: its rows, and the numbers that are exact by
construction.

Exact references: the BF16 recipe is batch-invariant and is its own shadow, so its noise floor
and its log r - log r16 are exactly 0 (at these small shapes XLA:CPU sums the mini-batch and
the whole batch in the same order; at 512 samples it differs by ~5e-7, docs/fp8_study.md);
per-1x128-tile (block) scales are batch-invariant too;
the per-tensor scale is an amax over the whole batch, so the same token quantizes differently
in the whole batch (old logprobs) and in a mini-batch (new logprobs): a non-zero floor. The
calibrated lower bound leaves exactly round(alpha |N|) tokens of N below it (losses.calibrated),
so its share equals the BF16 share within 1 / |N|.

Also here: `train.grad_format` (the audit's E5M2 gradients in the trainer: the backward GEMMs'
gradient operand against a float64 numpy quantize-dequantize), and the audit from a checkpoint
(its updates start from the checkpoint's params and Adam moments, compared exactly).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from tiny_run import TINY, small

pytestmark = pytest.mark.slow  # a whole run or more: scheduled first


RECIPES = (("bf16", "-"), ("fp8_tensor", "e4m3"), ("fp8_block", "e5m2"))


@pytest.fixture(scope="module")
def audit(base_policy_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from jfp8rl.analysis.audit import run_audit

    out = tmp_path_factory.mktemp("audit")
    # `small()`'s shapes (16 samples, 2 mini-batches of 8): the rollout and prepare programs
    # of the session's tiny run (`tiny_full_run`), and the audit from its checkpoint below.
    sets = small(out / "unused", cache_dir)
    rows = run_audit(str(TINY), sets, out, RECIPES, log=lambda m: None)
    return out, rows


def test_rows_present_and_finite(audit) -> None:
    out, rows = audit
    from jfp8rl.analysis.audit import UPDATES

    keys = {(r["recipe"], r["grad_format"], r["updates"]) for r in rows}
    assert keys == {(rc, g, u) for rc, g in RECIPES for u in UPDATES}
    required = (
        "recipe updates noise_floor clip_neg_lower_fp8 clip_neg_lower_bf16 clip_pos_upper_fp8 "
        "clip_pos_upper_bf16 balance_fp8 balance_bf16 L H clip_neg_lower_calibrated "
        "balance_calibrated n_neg n_pos kv_fp8_kl_mean kv_fp8_kl_max kv_fp8_abs_dlogp_mean"
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
    # A fresh start: Adam's moments are zero before the first update, not after it.
    assert by[("bf16", 0)]["start_step"] == 0 and by[("bf16", 0)]["opt_state_norm"] == 0.0
    assert by[("bf16", 1)]["opt_state_norm"] > 0.0


def test_calibrated_shares_match_bf16(audit) -> None:
    _, rows = audit
    for r in rows:
        if r["L"] > 0.6 + 1e-6:  # not at the range clamp
            # Within 1/|N|, or short by less than the run of equal ratios at the cut.
            tol = max(1.0, r["n_neg_tied_at_cut"] - 1.0) / r["n_neg"] + 1e-7
            assert abs(r["clip_neg_lower_calibrated"] - r["clip_neg_lower_bf16"]) <= tol, r


def test_tied_at_cut_and_the_lower_bound_inside_a_tie() -> None:
    """Hand-made N: ratios 0.5, 0.7, 0.7, 0.7, 0.9 and a BF16 count of 2 below 1 - eps_low.
    The 2nd and 3rd smallest are tied in a run of 3, so the solved L leaves 1 token below it
    (the largest count <= 2 that a bound can leave); with the run broken it leaves exactly 2."""
    import jax.numpy as jnp

    from jfp8rl.analysis.audit import tied_at_cut
    from losses import calibrated as cal

    tied = np.float32([0.5, 0.7, 0.7, 0.7, 0.9])
    assert tied_at_cut(tied, 2) == 3
    assert tied_at_cut(tied, 1) == 0 and tied_at_cut(tied, 4) == 0
    assert tied_at_cut(tied, 0) == 0 and tied_at_cut(tied, 5) == 0
    cfg = cal.CalibConfig()
    adv = jnp.full((1, 5), -1.0)
    mask = jnp.ones((1, 5))
    for r8, below in ((tied, 1), (np.float32([0.5, 0.69, 0.7, 0.71, 0.9]), 2)):
        r16 = jnp.asarray([[0.5, 0.75, 0.85, 0.9, 0.95]])  # 2 of N below 0.8
        stats = cal.reference_stats(r16, adv, mask, cfg)
        big_l, _ = cal.solve_bounds(stats, jnp.asarray(r8)[None], adv, mask, cfg)
        assert int(np.sum(r8 < float(big_l))) == below, (r8, float(big_l))


# ---- train.grad_format: the output gradient of the backward GEMMs in E5M2 ----


def e5m2_round(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto the E5M2 grid in float64: 2 mantissa bits, normals from
    2^-14, subnormal step 2^-16, saturating at 57344 (the recipe's scaled values never exceed
    it)."""
    v = np.asarray(v, np.float64)
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0**-14)))
    step = 2.0 ** (e - 2)
    return np.clip(np.round(v / step) * step, -57344.0, 57344.0)  # np.round: half to even


def e5m2_fake_quant_tensor(g: np.ndarray) -> np.ndarray:
    """Per-tensor quantize-dequantize (fp8_tensor's gradient tiles): scale amax / 57344."""
    scale = np.max(np.abs(g.astype(np.float64))) / 57344.0
    return e5m2_round(g / scale) * scale


def test_grad_format_e5m2_quantizes_the_backward_gemm_gradient(tmp_path: Path) -> None:
    import jax
    import jax.numpy as jnp

    from jfp8rl.config import ConfigError, load_config
    from jfp8rl.trainer.settings import step_settings
    from models import fp8

    cfg = load_config(TINY, [f"run_dir={tmp_path}", "train.recipe=fp8_tensor",
                             "train.grad_format=e5m2"])  # fmt: skip
    recipe = step_settings(cfg)[0].train_recipe
    assert (recipe.name, recipe.fwd_format, recipe.bwd_format) == ("fp8_tensor", "e4m3", "e5m2")

    def grads(r, a, b, g):
        y, vjp = jax.vjp(
            lambda a_, b_: fp8.fp8_dot_general(a_, b_, (((1,), (0,)), ((), ())), recipe=r), a, b
        )
        return [np.asarray(x, np.float64) for x in vjp(jnp.asarray(g, jnp.float32))]

    # Hand-checked: a = e_0 and b = I are exact in E4M3 (per-tensor scales 1/448), so
    # dgrad = Q(g) I and wgrad row 0 = Q(g). With amax 57344 the scale is 1: 1000 -> 1024
    # (step 128 in [512, 1024)), -300 -> -320 (step 64), 5 -> 5 (step 1).
    a, b = np.eye(1, 4, dtype=np.float32), np.eye(4, dtype=np.float32)
    g = np.array([[57344.0, 1000.0, -300.0, 5.0]], np.float32)
    hand = np.array([[57344.0, 1024.0, -320.0, 5.0]])
    da, db = grads(recipe, a, b, g)
    np.testing.assert_allclose(da, hand, rtol=1e-6)
    np.testing.assert_allclose(db[0], hand[0], rtol=1e-6)
    np.testing.assert_allclose(e5m2_fake_quant_tensor(g), hand, rtol=1e-6)  # the reference
    # Random operands: dgrad = Q8(g) Q4(b)^T against float64 numpy, Q8 = E5M2 per tensor.
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 8)).astype(np.float32)
    b = np.eye(8, 5, dtype=np.float32)  # exact in E4M3 (amax 1), so Q4(b) = b
    g = (rng.standard_normal((6, 5)) * np.logspace(-3, 2, 5)).astype(np.float32)
    da = grads(recipe, a, b, g)[0]
    ref = e5m2_fake_quant_tensor(g) @ b.T.astype(np.float64)
    np.testing.assert_allclose(da, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    e4m3 = grads(fp8.get_recipe("fp8_tensor"), a, b, g)[0]
    assert np.abs(e4m3 - ref).max() > 100 * np.abs(da - ref).max()  # not E4M3's grid

    # The default is the recipe as before (equal frozen dataclasses: the same programs).
    default = step_settings(load_config(TINY, [f"run_dir={tmp_path}"]))[0].train_recipe
    assert default == fp8.get_recipe("fp8_block") == fp8.FP8_BLOCK
    assert default.bwd_format == "e4m3"
    with pytest.raises(ConfigError, match=r"train\.grad_format='e6m1'"):
        load_config(TINY, [f"run_dir={tmp_path}", "train.grad_format=e6m1"])
    with pytest.raises(ConfigError, match=r"train\.grad_format=e5m2 needs an FP8 train\.recipe"):
        load_config(TINY, [f"run_dir={tmp_path}", "train.recipe=bf16", "train.grad_format=e5m2"])


# ---- the audit from a checkpoint ----


def float_norm(tree) -> float:
    """Reference L2 norm (float64) of the floating leaves of a restored pytree."""
    import jax

    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    return float(np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in leaves
                             if np.issubdtype(x.dtype, np.floating))))  # fmt: skip


def test_audit_from_checkpoint_starts_at_its_state(tiny_full_run: Path, tmp_path: Path) -> None:
    """The session's tiny run (`small()`, 4 steps) audited from its latest checkpoint (step 4)
    with E5M2 gradients: the rows start from that checkpoint's params and Adam moments."""
    import orbax.checkpoint as ocp

    from jfp8rl.analysis.audit import run_audit

    state = ocp.StandardCheckpointer().restore(tiny_full_run / "checkpoints" / "4" / "state")
    ref_params, ref_opt = float_norm(state["params"]), float_norm(state["opt_state"])
    assert ref_opt > 0.0  # Adam moments after 4 steps

    out = tmp_path / "audit"
    rows = run_audit(str(tiny_full_run / "config.yaml"), [], out, (("fp8_block", "e5m2"),),
                     log=lambda m: None, checkpoint=tiny_full_run, updates=(0, 1))  # fmt: skip
    by = {r["updates"]: r for r in rows}
    assert by[0]["start_step"] == 4  # the run folder's latest checkpoint
    assert by[0]["param_norm"] == ref_params  # exact: the checkpoint's params
    assert by[0]["opt_state_norm"] == ref_opt  # and its Adam moments, not fresh zeros
    # One update moves them (the restored Adam moments move params even where the batch's
    # groups are all masked out, as at this 16-sample size they may be).
    assert by[1]["param_norm"] != ref_params
    assert "from " + str(tiny_full_run / "checkpoints" / "4") in (out / "audit.md").read_text()
