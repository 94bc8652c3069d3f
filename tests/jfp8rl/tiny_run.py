"""Helpers shared by the trainer tests: the tiny config and the overrides that shrink it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"


def small(run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """Overrides that shrink tiny_cpu.yaml to a few-second run (compiles aside)."""
    return [
        f"run_dir={run_dir}",
        f"warmstart.cache_dir={cache_dir}",
        f"train.jax_cache_dir={cache_dir / 'jax'}",
        "warmstart.steps=120",
        "warmstart.target_accuracy=0",
        "data.batch_size=4",
        "data.eval_size=16",
        "rollout.n=4",
        "train.steps=4",
        "train.mini_batches=2",
        "train.eval_every=2",
        "calibration.every=2",
        "checkpoint.every=2",
        "logging.console=none",
        *extra,
    ]
