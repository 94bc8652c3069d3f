"""Helpers shared by the real-model run tests (configs/smollm2_135m_math.yaml,
configs/qwen25_coder_05b_math.yaml): the config shrunk to two steps of a few prompts and
tokens, run as a user runs it (`python -m jfp8rl.train`, XLA:CPU fully optimising: the steps of
a real model are run time more than compile time), and the checks of its rollout dumps."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tiny_run import full_optimization_env

from jfp8rl.observe.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
# The test session's persistent compilation cache (tests/conftest.py), else the config's.
JAX_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR") or "runs/.jax_cache"


def run_two_steps(config: Path, run_dir: Path, model_dir: Path, *extra: str) -> list[dict]:
    """Two steps of `config` (its data files, 2 prompts x 2 samples, 8 new tokens, an eval of
    2 problems at step 2, calibration every step); returns the run's metrics records."""
    argv = [
        "--config", str(config), f"run_dir={run_dir}", f"model.path={model_dir}",
        "data.batch_size=2", "data.eval_size=2", "rollout.n=2", "rollout.max_tokens=8",
        "train.steps=2", "train.mini_batches=1", "train.eval_every=2", "calibration.every=1",
        "logging.console=none", "logging.rollout_samples=4",
        f"train.jax_cache_dir={JAX_CACHE}", *extra,
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "jfp8rl.train", *argv], capture_output=True, text=True,
        env=full_optimization_env(), timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return read_metrics(run_dir)


def check_two_steps(
    run_dir: Path, recs: list[dict], end_of_turn: int, reward: Callable[[str, str], float]
) -> None:
    """Each step's metrics are finite with a small FP8-vs-FP8 mismatch; in the rollout dumps no
    response runs past the end of turn, a response ends with it exactly when it finished on a
    stop, and each reward is `reward(response_text, answer)`; an eval ran."""
    for step in (1, 2):
        m = next(r for r in recs if r.get("step") == step and "reward/mean" in r)
        for k in ("reward/mean", "actor/pg_loss", "rollout_corr/kl"):
            assert math.isfinite(m[k]), (step, k)
        # Same weights, FP8 on both sides: a small mismatch (a sample estimate, either sign).
        assert abs(m["rollout_corr/kl"]) < 0.2
        rows = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step}.jsonl").open()]
        assert len(rows) == 4
        for r in rows:
            resp = r["response_ids"]
            assert end_of_turn not in resp[:-1], "generation went past the end of turn"
            assert (r["finish_reason"] == "stop") == (resp[-1] == end_of_turn)
            assert r["reward"] == reward(r["response_text"], r["answer"])
    assert any("eval/accuracy" in r for r in recs)
