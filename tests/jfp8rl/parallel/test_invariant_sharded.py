"""Exact on-policy under data x fsdp sharding: the batch-invariant policy's log-probs on a 2x2
forced-device mesh equal one device's bit for bit, and the engine's (4 devices, one subprocess
for both recipes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).parent / "invariant_sharded_check.py"
RECIPES = ("bf16", "fp8_block")


@pytest.fixture(scope="module")
def report() -> dict:
    """The check's JSON line: one entry per recipe (one JAX start and one policy for both)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    out = subprocess.run(
        [sys.executable, str(CHECK), *RECIPES], env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("recipe", RECIPES)
def test_mesh_data2_fsdp2_equals_one_device_and_engine(report: dict, recipe: str) -> None:
    got = report[recipe]
    assert got["devices"] == 4
    assert got["engine_vs_one_device"] == 1.0
    assert got["mesh_vs_one_device"] == 1.0, got
