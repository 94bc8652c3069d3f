"""`ServerPool` settings against stand-in servers: every server gets the pool's settings and
its one export root; a push is exported once and installed on each server. Balancing, failures
and the trainer's use run against real servers in tests/jfp8rl/trainer/test_multi_server.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from bridge_support import FakeServer

from rollout_bridge.client.pool import ServerPool
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.weights.reader import load_export


def test_servers_share_the_settings_and_one_export(tmp_path: Path) -> None:
    fakes = [FakeServer(), FakeServer()]
    settings = ClientSettings(api_key="t0k", export_format="fp32", export_root=tmp_path / "x")
    pool = ServerPool([f.url + "/" for f in fakes], settings, chunks_per_server=3)
    try:
        assert [s.url for s in pool.servers] == [f.url for f in fakes]
        assert {s.settings for s in pool.servers} == {settings}
        assert {s.export_root for s in pool.servers} == {tmp_path / "x"}
        w = {"model.norm.weight": np.arange(4, dtype=np.float32)}
        pool.push_weights(w, "step-1")
        assert pool.weight_version() == "step-1"
        paths = set()
        for fake in fakes:
            (_, _, headers, body) = next(e for e in fake.log if e[1] == "/update_weights")
            assert headers["Authorization"] == "Bearer t0k"
            paths.add(body["update_info"]["path"])
        (path,) = paths  # one export, installed on both
        tensors, manifest = load_export(path, expected_version="step-1")
        np.testing.assert_array_equal(tensors["model.norm.weight"], w["model.norm.weight"])
        assert manifest["format"] == "fp32"
    finally:
        pool.close()
        for fake in fakes:
            fake.close()
    assert (tmp_path / "x").is_dir()  # a root given in the settings is the caller's


def test_default_root_is_the_pools_and_close_removes_it() -> None:
    fakes = [FakeServer(), FakeServer()]
    pool = ServerPool([f.url for f in fakes])
    try:
        root = pool.export_root
        assert {s.export_root for s in pool.servers} == {root}
        pool.push_weights({"model.norm.weight": np.ones(2, np.float32)}, "v")
        assert (root / "v").is_dir()
    finally:
        pool.close()
        for fake in fakes:
            fake.close()
    assert not root.exists()
