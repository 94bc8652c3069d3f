"""`configs/tiny_moe_cpu.yaml` as a user runs it, shrunk to two steps: the Qwen3-MoE policy
trains under FP8 block with routing replay through the whole loop (the engine records, the
batch carries, prepare and the update replay), logs the routing mismatch of each step, and
writes a final folder that loads back as the same Mixture-of-Experts model."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tiny_run import REPO, small

from jfp8rl.observe.metrics import read_metrics
from jfp8rl.train import main
from models.hf_io import load_hf

CONFIG = REPO / "configs" / "tiny_moe_cpu.yaml"


def test_two_steps_with_routing_replay(tmp_path: Path, cache_dir: Path) -> None:
    run_dir = tmp_path / "run"
    argv = small(run_dir, cache_dir, "warmstart.steps=20", "train.steps=2",
                 "train.eval_every=2", "calibration.every=1", "checkpoint.every=2")  # fmt: skip
    assert main(["--config", str(CONFIG), *argv]) == 0
    recs = read_metrics(run_dir)
    for step in (1, 2):
        m = next(r for r in recs if r.get("step") == step and "reward/mean" in r)
        share = m["rollout_corr/routing_mismatch"]
        assert 0.0 <= share < 0.2, share  # same weights, FP8 on both sides: a few flips
        for k in ("actor/pg_loss", "rollout_corr/kl", "calib/lower"):
            assert math.isfinite(m[k]), (step, k)
    cfg, _, _ = load_hf(run_dir / "hf_final")
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    hf = json.loads((run_dir / "hf_final" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"]
