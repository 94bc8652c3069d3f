"""The correction menu against verl 0.9.1's own `rollout_corr_helper`, imported from the
package installed in the verl venv (scripts/setup_verl_env.sh) and run on the same float32 inputs:
IS weights (TIS / IcePop, token / sequence, with and without batch normalisation), every
rejection mode alone and comma-combined, the threshold parsing, and every `rollout_corr/`
metric. One reference process for all cases. Skips, with the reason, only where the verl venv
cannot be built or JFP8RL_SKIP_VERL=1 (scripts/test.sh builds it first, so CI never skips)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from losses.rollout_correction import is_weights, mismatch_metrics, raw_ratios
from losses.rollout_rejection import parse_rejection, rejection_mask

IS_CASES = [
    (level, threshold, norm)
    for level, threshold in (
        ("token", 2.0), ("token", "0.5_2.0"), ("sequence", 5.0), ("sequence", "0.2_5.0")
    )
    for norm in (False, True)
]  # fmt: skip
RS_CASES = [
    ("token_k1", "0.6_1.5"), ("token_k1", 1.5), ("token_k2", 0.1), ("token_k3", 0.1),
    ("seq_sum_k1", "0.3_3.0"), ("seq_sum_k2", 0.8), ("seq_sum_k3", 0.8),
    ("seq_mean_k1", "0.8_1.25"), ("seq_mean_k2", 0.05), ("seq_mean_k3", 0.05),
    ("seq_max_k2", 0.5), ("seq_max_k3", 0.5),
    ("token_k1,seq_max_k3", "0.6_1.5,0.5"), ("token_k2,seq_mean_k3,token_k2", "0.1"),
]  # fmt: skip
MIS_CASES = (("token", 2.0), ("sequence", 5.0))


def inputs(seed=0, b=8, t=12):
    """Log-ratios ~ N(0, 0.6) with a few spikes, a ragged mask, an empty sequence and one whose
    summed log-ratio (30) passes the +-20 clamp."""
    rng = np.random.default_rng(seed)
    roll = rng.normal(-1.5, 0.7, (b, t))
    lr = rng.normal(0.0, 0.6, (b, t))
    lr[rng.random((b, t)) < 0.05] = 5.0
    lr[2] = 2.5
    lengths = rng.integers(3, t + 1, b)
    lengths[5] = 0
    lengths[2] = t
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    return (roll + lr).astype(np.float32), roll.astype(np.float32), mask


def ours(old, roll, mask, rollout_is, threshold, norm, rs, rs_threshold):
    """Our functions, called the way the trainer's `prepare` calls them."""
    w, aux = None, {}
    if rollout_is is not None:
        spec = str(threshold)
        lower, upper = spec.split("_") if "_" in spec else (None, spec)
        w, aux = is_weights(
            old, roll, mask, mode="icepop" if lower else "tis", level=rollout_is,
            cap=float(upper), lower=float(lower) if lower else None, batch_normalize=norm,
        )  # fmt: skip
    kept, rs_aux = rejection_mask(old, roll, mask, parse_rejection(rs or "", rs_threshold or ""))
    off = {k: v for k, v in mismatch_metrics(old, roll, mask).items() if k.startswith("rollout")}
    return w, kept, aux | rs_aux | off


@pytest.fixture(scope="module")
def verl_python():
    from verl_env import ensure_verl_env

    if os.environ.get("JFP8RL_SKIP_VERL") == "1":
        pytest.skip("JFP8RL_SKIP_VERL=1: the verl reference venv is not built")
    try:
        return ensure_verl_env()
    except RuntimeError as e:
        pytest.skip(f"verl reference venv not available: {e}")


@pytest.fixture(scope="module")
def verl_run(verl_python):
    from client import VERL_SCRIPT, run_reference

    old, roll, mask = inputs()
    cases = [(lv, th, n, None, None) for lv, th, n in IS_CASES]
    cases += [(None, None, False, rs, th) for rs, th in RS_CASES]
    cases.append(("token", "0.5_2.0", True, "token_k1,seq_max_k3", "0.6_1.5,0.5"))
    arrays = {"old": old, "roll": roll, "mask": mask}
    mis_specs = []
    for i, (level, cap) in enumerate(MIS_CASES):
        w, _ = is_weights(old, roll, mask, mode="mis", level=level, cap=cap)
        rho, log_ratio = raw_ratios(old, roll, mask, level)
        arrays |= {f"mis_w{i}": w, f"mis_raw{i}": rho}
        arrays[f"mis_lr{i}"] = np.asarray(log_ratio)[:, None] if level == "sequence" else log_ratio
        mis_specs.append(
            {"w": f"mis_w{i}", "raw": f"mis_raw{i}", "log_ratio": f"mis_lr{i}", "level": level,
             "cap": cap, "lower": 1.0 / cap}
        )  # fmt: skip
    keys = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
            "rollout_rs_threshold")  # fmt: skip
    meta, out = run_reference(
        "verl", script=VERL_SCRIPT, python=verl_python,
        arrays={k: np.asarray(v) for k, v in arrays.items()},
        cases=[dict(zip(keys, c, strict=True)) for c in cases], is_metrics=mis_specs,
        thresholds=[[rs, str(th)] for rs, th in RS_CASES],
    )  # fmt: skip
    assert meta["verl"] == "0.9.1", meta["verl"]
    return (old, roll, mask), cases, meta, out


def assert_metrics_equal(got, want, what):
    assert sorted(got) == sorted(want), f"{what}: metric names differ"
    for k, v in want.items():
        # verl's token std is sqrt(E[x^2] - E[x]^2) in float32: near 0 it is rounding noise of
        # E[x^2] (about 1e-5 here), whose summation order differs between torch and XLA.
        atol = 1e-4 if k.endswith("_std") and not k.endswith("_seq_std") else 2e-6
        np.testing.assert_allclose(float(got[k]), v, rtol=2e-5, atol=atol, err_msg=f"{what} {k}")


def test_every_case_matches_verl(verl_run):
    (old, roll, mask), cases, meta, out = verl_run
    assert len(meta["metrics"]) == len(cases)
    for i, case in enumerate(cases):
        w, kept, mets = ours(old, roll, mask, *case)
        if w is not None:
            np.testing.assert_allclose(w, out[f"w{i}"], rtol=1e-5, atol=1e-6, err_msg=str(case))
        np.testing.assert_array_equal(kept, out[f"mask{i}"], err_msg=str(case))
        assert_metrics_equal(mets, meta["metrics"][i], str(case))
    # The cases exercise what they are meant to: masks reject something, IcePop zeroes.
    assert all(out[f"mask{i}"].sum() < mask.sum() for i in range(len(IS_CASES), len(cases)))
    assert any(m.get("rollout_corr/rollout_is_oob_ratio", 0) > 0 for m in meta["metrics"])


def test_mis_metrics_match_verls_is_metrics(verl_run):
    (old, roll, mask), _, meta, _ = verl_run
    for i, (level, cap) in enumerate(MIS_CASES):
        _, aux = is_weights(old, roll, mask, mode="mis", level=level, cap=cap)
        assert_metrics_equal(
            {k.removeprefix("rollout_corr/"): v for k, v in aux.items()}, meta["is_metrics"][i],
            f"mis {level}",
        )  # fmt: skip


def test_threshold_parsing_matches_verl(verl_run):
    _, _, meta, _ = verl_run
    for (modes, spec), want in zip(RS_CASES, meta["thresholds"], strict=True):
        got = {r.mode: {"lower": r.lower, "upper": r.upper} for r in parse_rejection(modes, spec)}
        assert got == want, (modes, spec)
