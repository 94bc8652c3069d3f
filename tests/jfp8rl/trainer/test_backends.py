"""`jfp8rl.trainer.backends`: the API key of `rollout.api_key` or $JFP8RL_ROLLOUT_API_KEY on the
wire, on every request to every server of a pool (a push reaches all; `FakeServer`s record the
headers)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tiny_run import TINY

from jfp8rl.config import load_config
from jfp8rl.config.rollout import API_KEY_ENV
from jfp8rl.trainer.backends import make_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "rollout_bridge"))
from bridge_support import FakeServer  # noqa: E402


@pytest.mark.parametrize("given", ["config", "env", "both"])
def test_api_key_reaches_every_server(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes = [FakeServer(), FakeServer()]
    urls = ",".join(f.url for f in fakes)
    overrides = ["rollout.backend=http", f"rollout.urls=[{urls}]"]
    if given in ("config", "both"):
        overrides.append("rollout.api_key=from-config")
    if given in ("env", "both"):
        monkeypatch.setenv(API_KEY_ENV, "from-env")
    else:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    backend = make_backend(load_config(TINY, overrides), SimpleNamespace(path="m"), tmp_path)
    try:
        backend.push_weights({"model.norm.weight": np.ones(2, np.float32)}, "step-1")
    finally:
        backend.close()
        for f in fakes:
            f.close()
    want = "Bearer from-env" if given == "env" else "Bearer from-config"  # the config wins
    for f in fakes:
        assert f.log and {h.get("Authorization") for _, _, h, _ in f.log} == {want}
