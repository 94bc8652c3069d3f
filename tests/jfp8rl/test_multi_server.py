"""Several rollout servers (`rollout.urls`, `rollout_bridge.pool.ServerPool`) against real
`python -m rollout_bridge.serve` processes on loopback.

- The pool's samples (same seed) equal those of one server answering the whole batch, with 2
  and 3 servers; a push reaches every server (`/weight_info` on each, asked independently).
- A server killed mid-run is dropped with a warning naming its URL; the run finishes and the
  survivor serves the final version.
- All servers killed: the run stops (exit 1, the resume command) with a checkpoint that a
  resumed run on a fresh server loads and continues from.

Three servers start once for the module (in parallel); the tests kill them in order.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_run import TINY, small

from jfp8rl.checkpoint import Checkpointer
from jfp8rl.metrics import read_metrics
from jfp8rl.train import main
from models.hf_io import load_hf, to_hf_state_dict
from rollout_bridge.backend import SamplingParams
from rollout_bridge.http_client import HttpBackend
from rollout_bridge.pool import ServerPool

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "rollout_bridge"))
from serve_proc import ServeProcess  # noqa: E402

PROMPTS = [[49, 43, 50, 61], [72, 101, 108, 108, 111], [7] * 9, [51, 42, 52, 61], [65], [56] * 3]


@pytest.fixture(scope="module")
def servers(base_policy_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("serve_logs")
    procs = [ServeProcess(base_policy_dir, logs / f"serve{k}.log") for k in range(3)]
    try:
        for p in procs:
            p.wait_healthy()
        yield procs
    finally:
        for p in procs:
            p.kill()


def _version(url: str) -> str:
    return HttpBackend(url, max_retries=0).weight_version()


def _same(a, b) -> None:
    """Same tokens, finish reasons and versions; logprobs to 1e-5 (a smaller batch is another
    compiled shape, whose f32 sums XLA orders differently: ~1e-7 apart, measured)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.prompt_index == y.prompt_index and x.prompt_ids == y.prompt_ids
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
        assert x.finish_reason == y.finish_reason and x.weight_version == y.weight_version


def test_url_and_urls_together_are_refused_naming_both_keys() -> None:
    from jfp8rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout\.url=.*rollout\.urls=.*both given"):
        load_config(TINY, ["rollout.url=http://127.0.0.1:1", "rollout.urls=[http://127.0.0.1:2]"])
    cfg = load_config(TINY, ["rollout.urls=[http://127.0.0.1:2,http://127.0.0.1:3]"])
    assert cfg.rollout.server_urls() == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    assert load_config(TINY).rollout.server_urls() == ["http://127.0.0.1:8000"]


def test_pool_samples_equal_one_server_and_pushes_reach_all(
    servers: list[ServeProcess], base_policy_dir: Path, tmp_path: Path
) -> None:
    urls = [s.url for s in servers]
    sp = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=7)
    one = HttpBackend(urls[0], export_root=tmp_path / "one", max_retries=0)
    pools = [ServerPool(urls[:k], export_root=tmp_path / f"p{k}") for k in (2, 3)]
    cfg, _, params = load_hf(base_policy_dir)
    hf = {k: v * 1.5 for k, v in to_hf_state_dict(cfg, params).items()}
    pools[1].push_weights(hf, "pushed-1")
    assert [_version(u) for u in urls] == ["pushed-1"] * 3
    ref = one.generate(PROMPTS, sp)  # server 0 alone answers the whole batch
    assert [c.prompt_index for c in ref] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert {c.weight_version for c in ref} == {"pushed-1"}
    for pool in pools:  # 2 servers x 2 chunks, 3 servers x 2 chunks: other splits, same samples
        _same(pool.generate(PROMPTS, sp), ref)
    for backend in (one, *pools):
        backend.close()


def _run_in_thread(argv: list[str]) -> tuple[threading.Thread, dict[str, int]]:
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.update(rc=main(argv)))
    thread.start()
    return thread, result


def _wait_for_step(run_dir: Path, thread: threading.Thread, step: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and thread.is_alive():
        if (run_dir / "metrics.jsonl").exists():
            if max((r["step"] for r in read_metrics(run_dir)), default=0) >= step:
                return
        time.sleep(0.05)


def _argv(run_dir: Path, cache_dir: Path, policy: Path, urls: list[str], *extra: str) -> list[str]:
    return ["--config", str(TINY), *small(run_dir, cache_dir, "rollout.backend=http",
            f"rollout.urls=[{','.join(urls)}]", "rollout.timeout_s=5",
            f"model.path={policy}", "train.eval_every=0", *extra)]  # fmt: skip


def test_killed_server_is_dropped_and_the_run_finishes(
    servers: list[ServeProcess],
    base_policy_dir: Path,
    cache_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    keep, victim = servers[1], servers[2]
    run_dir = tmp_path / "run"
    argv = _argv(run_dir, cache_dir, base_policy_dir, [keep.url, victim.url])
    thread, result = _run_in_thread(argv)
    _wait_for_step(run_dir, thread, 1)
    assert thread.is_alive(), "the run ended before the server could be killed mid-run"
    victim.kill()
    thread.join(timeout=300)
    assert result.get("rc") == 0
    assert f"rollout server {victim.url} dropped" in caplog.text
    steps = [r["step"] for r in read_metrics(run_dir)[1:]]
    assert steps == [1, 2, 3, 4]
    for r in read_metrics(run_dir)[1:]:
        assert math.isfinite(r["reward/mean"]) and math.isfinite(r["actor/pg_loss"])
    assert _version(keep.url) == "step-4"


def test_all_servers_killed_stop_with_a_loadable_checkpoint(
    servers: list[ServeProcess],
    base_policy_dir: Path,
    cache_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    alive = [s for s in servers if s.proc.poll() is None]
    assert len(alive) == 2
    run_dir = tmp_path / "run"
    urls = [s.url for s in alive]
    thread, result = _run_in_thread(_argv(run_dir, cache_dir, base_policy_dir, urls,
                                          "train.steps=40"))  # fmt: skip
    _wait_for_step(run_dir, thread, 2)
    for s in alive:
        s.kill()
    thread.join(timeout=300)
    assert result.get("rc") == 1
    err = capsys.readouterr().err
    assert "every server failed" in err and "--resume" in err
    assert all(u in err for u in urls)
    ck = Checkpointer(run_dir, keep=2)
    last = ck.latest_step()
    ck.close()
    assert last is not None and last >= 2
    # The checkpoint loads: a resumed run on a fresh server continues from it.
    with ServeProcess(base_policy_dir, tmp_path / "fresh.log") as fresh:
        fresh.wait_healthy()
        stop = last + 1
        argv = _argv(run_dir, cache_dir, base_policy_dir, [fresh.url], "train.steps=40",
                     f"train.stop_after={stop}")  # fmt: skip
        assert main(["--resume", *argv]) == 0
        assert _version(fresh.url) == f"step-{stop}"
    assert max(r["step"] for r in read_metrics(run_dir)) == stop
