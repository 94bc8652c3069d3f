"""One-step off-policy rollout (`rollout.max_staleness: 1`, `jfp8rl.trainer.overlap`) against two
real `python -m rollout_bridge.serve` processes on loopback (`rollout.urls`).

- Versions: each step's samples carry the weight version the servers report for them (the
  rollout dumps' `weight_version`, written by the servers); with checkpoints every 2 steps of 4,
  step 1 samples with the base policy, step 2 (sampled ahead during step 1's update) with it
  too, step 3 (after checkpoint 2, nothing ahead) with step 2's, step 4 with step 2's again:
  `rollout/weight_version` 0, 0, 2, 2 and `rollout/staleness` 0, 1, 0, 1.
- The embedded engine, sampling ahead on the worker thread: step 1 equals the on-policy run's
  (`max_staleness: 0`) step 1 exactly (every metric but timings, every sample); step 2 is
  sampled with the base policy where the on-policy run samples it with step 1's weights.
- Resume: the run's folder as a kill during step 3 leaves it (checkpoint 4, the later dumps and
  the export not written), resumed, equals the uninterrupted run, every metric (timings
  aside) and every sample. At checkpoint 2 nothing is sampled ahead, so the folder holds all
  a resume needs; `train.stop_after` with a rollout ahead is the embedded test's.
- A server killed mid-run, while a batch may be in flight, is dropped as in an on-policy run
  and the run finishes on the survivor, which serves the final version.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny_run import TINY, small

from jfp8rl.config import load_config
from jfp8rl.observe.metrics import read_metrics
from jfp8rl.train import main
from jfp8rl.trainer import stages
from jfp8rl.trainer.loop import run
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "rollout_bridge"))
from bridge_support import ServeProcess, serve_processes  # noqa: E402

pytestmark = pytest.mark.slow  # a whole run or more: scheduled first


TIMING_PREFIXES = ("timing/", "throughput/")  # wall-clock metrics differ between runs


@pytest.fixture(scope="module")
def two_servers(base_policy_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with serve_processes(base_policy_dir, tmp_path_factory.mktemp("serve_logs_off"), 2) as procs:
        yield procs


def _argv(run_dir: Path, cache_dir: Path, policy: Path, urls: list[str], *extra: str) -> list[str]:
    return ["--config", str(TINY), *small(run_dir, cache_dir, "rollout.backend=http",
            f"rollout.urls=[{','.join(urls)}]", "rollout.timeout_s=20", f"model.path={policy}",
            "train.eval_every=0", "logging.rollout_samples=16", *extra)]  # fmt: skip


def _version(url: str) -> str:
    return HttpBackend(url, ClientSettings(max_retries=0)).weight_version()


def _dumps(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "rollouts" / f"step_{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _steady(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith(TIMING_PREFIXES)}


def test_versions_staleness_and_exact_resume(
    two_servers: list[ServeProcess], base_policy_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    urls = [s.url for s in two_servers]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    argv = _argv(full, cache_dir, base_policy_dir, urls, "rollout.max_staleness=1")
    assert main(argv) == 0
    recs = read_metrics(full)[1:]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["rollout/weight_version"] for r in recs] == [0, 0, 2, 2]
    assert [r["rollout/staleness"] for r in recs] == [0, 1, 0, 1]
    # The servers' own labels of the samples: the weights each batch was drawn with.
    for step, used in zip([1, 2, 3, 4], [0, 0, 2, 2], strict=True):
        assert {d["weight_version"] for d in _dumps(full, step)} == {f"step-{used}"}
    assert [_version(u) for u in urls] == ["step-4"] * 2
    # A batch sampled ahead waits for its weights push: the settle time is logged.
    assert all(r["timing/settle_s"] >= 0 for r in recs)

    # Killed after checkpoint 2, then resumed: the uninterrupted run's records and samples.
    shutil.copytree(full, resumed, ignore=shutil.ignore_patterns("hf_final", "tb"))
    for leftover in ("checkpoints/4", "rollouts/step_3.jsonl", "rollouts/step_4.jsonl"):
        path = resumed / leftover
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (resumed / "summary.json").unlink()
    metrics = resumed / "metrics.jsonl"
    kept = [x for x in metrics.read_text().splitlines(True) if json.loads(x)["step"] <= 2]
    metrics.write_text("".join(kept))
    resumed_argv = _argv(resumed, cache_dir, base_policy_dir, urls, "rollout.max_staleness=1")
    assert main(["--resume", *resumed_argv]) == 0
    again = read_metrics(resumed)[1:]
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert [_steady(r) for r in again] == [_steady(r) for r in recs]
    for step in (1, 2, 3, 4):
        assert _dumps(resumed, step) == _dumps(full, step)


def test_server_killed_mid_run_is_dropped_and_the_run_finishes(
    two_servers: list[ServeProcess],
    base_policy_dir: Path,
    cache_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    keep, victim = two_servers
    run_dir = tmp_path / "run"
    argv = _argv(run_dir, cache_dir, base_policy_dir, [keep.url, victim.url],
                 "rollout.max_staleness=1", "train.steps=3", "checkpoint.every=4")  # fmt: skip
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.update(rc=main(argv)))
    thread.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and thread.is_alive():  # step 1 logged: step 2 in flight
        if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 2:
            break
        time.sleep(0.05)
    assert thread.is_alive(), "the run ended before the server could be killed mid-run"
    victim.kill()
    thread.join(timeout=300)
    assert result.get("rc") == 0
    assert f"rollout server {victim.url} dropped" in caplog.text
    recs = read_metrics(run_dir)[1:]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["rollout/weight_version"] for r in recs] == [0, 0, 1]
    assert [r["rollout/staleness"] for r in recs] == [0, 1, 1]
    assert _version(keep.url) == "step-3"


def test_embedded_engine_samples_ahead_and_starts_as_on_policy(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also `rollout.free_cache_engine` (default on): the on-policy run's engine holds no
    weights while the trainer updates, the engine sampling ahead keeps them, and the two runs'
    first steps (the same rollout, then the same update) still agree."""
    ahead, onpolicy = tmp_path / "ahead", tmp_path / "onpolicy"
    engine_held = []
    real_update = stages.stage_update

    def update(t, *args, **kwargs):
        engine_held.append(t.backend.params is not None)
        return real_update(t, *args, **kwargs)

    monkeypatch.setattr(stages, "stage_update", update)
    common = ("train.eval_every=0", "logging.rollout_samples=16")
    run(load_config(TINY, small(ahead, cache_dir, *common, "rollout.max_staleness=1",
                                "train.stop_after=2")))  # fmt: skip
    assert engine_held == [True, True]
    run(load_config(TINY, small(onpolicy, cache_dir, *common, "train.stop_after=2")))
    assert engine_held == [True, True, False, False]
    recs, base = read_metrics(ahead)[1:], read_metrics(onpolicy)[1:]
    assert [r["rollout/weight_version"] for r in recs] == [0, 0]
    assert [r["rollout/staleness"] for r in recs] == [0, 1]
    assert "rollout/staleness" not in base[0] and "timing/settle_s" not in base[0]
    new_keys = ("rollout/weight_version", "rollout/staleness")
    assert {k: v for k, v in _steady(recs[0]).items() if k not in new_keys} == _steady(base[0])
    assert _dumps(ahead, 1) == _dumps(onpolicy, 1)
    assert {d["weight_version"] for d in _dumps(ahead, 2)} == {"step-0"}
    assert {d["weight_version"] for d in _dumps(onpolicy, 2)} == {"step-1"}
