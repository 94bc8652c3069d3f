"""verl 0.9.1's rollout correction on given inputs, for the equality tests of `losses`.

Runs in the verl venv (verl 0.9.1 from PyPI with torch, built by scripts/setup_verl_env.sh;
never our packages, which need jax) and calls `verl.trainer.ppo.rollout_corr_helper` as
installed. Driven by `tests/reference/client.py` (`run_reference(..., script=VERL_SCRIPT,
python=<verl venv>)`): `job.json` + .npy inputs in, `result.json` + `result.npz` out, no
pickle. One job computes every case, so the verl import is paid once:

    arrays  old, roll, mask        float32 [B, T] log-probs and response mask
    cases   list of {"rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
            "rollout_rs", "rollout_rs_threshold"}: verl's `compute_rollout_correction_and_
            rejection_mask` arguments -> arrays w<i> (weights, if any), mask<i>; meta
            metrics[i] (every metric, "rollout_corr/..." names)
    is_metrics  list of {"w", "raw", "log_ratio", "level", "cap", "lower"}: names of .npy
            arrays and the thresholds for verl's `compute_is_metrics` on weights made elsewhere
            -> meta is_metrics[i]
    thresholds  list of [modes, spec] -> meta thresholds[i], verl's parsed rejection bounds

Usage: `<verl-venv>/bin/python verl_ref.py JOB.json OUT_DIR`.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from verl.trainer.ppo import rollout_corr_helper as verl


def run_cases(job: dict, t: dict[str, torch.Tensor]) -> tuple[list[dict], dict[str, np.ndarray]]:
    metrics, arrays = [], {}
    for i, case in enumerate(job.get("cases", [])):
        w, kept, mets = verl.compute_rollout_correction_and_rejection_mask(
            t["old"], t["roll"], t["mask"], **case
        )
        if w is not None:  # verl wraps the weights in its DataProto
            arrays[f"w{i}"] = w.batch["rollout_is_weights"].numpy()
        arrays[f"mask{i}"] = kept.numpy()
        metrics.append({k: float(v) for k, v in mets.items()})
    return metrics, arrays


def run_is_metrics(job: dict, t: dict[str, torch.Tensor]) -> list[dict]:
    out = []
    for spec in job.get("is_metrics", []):
        mets = verl.compute_is_metrics(
            rollout_is_weights=t[spec["w"]], raw_rollout_is_weights=t[spec["raw"]],
            log_ratio_for_metrics=t[spec["log_ratio"]], response_mask=t["mask"],
            rollout_is=spec["level"], rollout_is_threshold=spec["cap"],
            rollout_is_threshold_lower=spec["lower"],
        )  # fmt: skip
        out.append({k: float(v) for k, v in mets.items()})
    return out


def main(job_path: str, out_dir: str) -> None:
    job = json.loads(Path(job_path).read_text())
    t = {k: torch.from_numpy(np.load(v)) for k, v in job.items() if str(v).endswith(".npy")}
    metrics, arrays = run_cases(job, t)
    opts = [[o.strip() for o in modes.split(",")] for modes, _ in job.get("thresholds", [])]
    meta = {
        "metrics": metrics,
        "is_metrics": run_is_metrics(job, t),
        "thresholds": [
            verl._parse_rollout_rs_thresholds(o, spec)
            for o, (_, spec) in zip(opts, job.get("thresholds", []), strict=True)
        ],
        "torch": torch.__version__,
        "verl": version("verl"),
    }
    out = Path(out_dir)
    np.savez(out / "result.npz", **arrays)
    (out / "result.json").write_text(json.dumps(meta))


if __name__ == "__main__":
    main(*sys.argv[1:3])
