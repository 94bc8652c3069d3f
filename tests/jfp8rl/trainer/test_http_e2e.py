"""The trainer against a rollout server over HTTP: `python -m rollout_bridge.serve` (the
embedded engine behind vLLM's routes), killed mid-run: the trainer must exit 1 naming the
resume command, with its last checkpoint loadable. (The trainer against a real vLLM, with
verified exports: tests/jfp8rl/trainer/test_smollm2_runs.py.)
"""

from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny_run import TINY, small

from jfp8rl.observe.metrics import read_metrics
from jfp8rl.train import main
from jfp8rl.trainer.checkpoint import Checkpointer

pytestmark = pytest.mark.slow  # a whole run or more: scheduled first


REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "rollout_bridge"))

from bridge_support import ServeProcess  # noqa: E402  (the bridge's servers)


def _finite_steps(run_dir: Path) -> list[int]:
    steps = []
    for r in read_metrics(run_dir)[1:]:
        for k in ("reward/mean", "actor/pg_loss", "rollout_corr/kl", "timing/sync_s"):
            assert r.get(k) is not None and math.isfinite(r[k]), (r["step"], k)
        steps.append(r["step"])
    return steps


def test_serve_backend_then_server_dies(
    base_policy_dir: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = ServeProcess(base_policy_dir, tmp_path / "serve.log").wait_healthy()
    port = srv.port
    run_dir = tmp_path / "http"
    argv = ["--config", str(TINY), *small(run_dir, cache_dir, "rollout.backend=http",
            f"rollout.url=http://127.0.0.1:{port}", "rollout.timeout_s=5", "train.steps=40",
            f"model.path={base_policy_dir}")]  # fmt: skip
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.update(rc=main(argv)))
    thread.start()
    try:
        # Let it train over HTTP until checkpoint 2 exists, then kill the server mid-run.
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and thread.is_alive():
            steps = (
                [r["step"] for r in read_metrics(run_dir)]
                if (run_dir / "metrics.jsonl").exists()
                else []
            )
            if max(steps, default=0) >= 2:
                break
            time.sleep(0.05)
    finally:
        srv.kill()
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert result["rc"] == 1, "a dead rollout server must end the run with exit code 1"
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--resume" in err
    steps = _finite_steps(run_dir)
    assert steps[:2] == [1, 2] and max(steps) < 40
    ck = Checkpointer(run_dir, keep=2)
    last = ck.latest_step()
    assert last is not None and last >= 2 and last % 2 == 0
    ck.close()
