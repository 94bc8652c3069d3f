"""DESIGN.md section 9: a run sharded over 2 (forced host) devices matches the 1-device run.

XLA_FLAGS must be set before jax starts, so the 2-device run goes in a fresh subprocess; the
1-device run is in-process (it reuses the other tests' compiled step functions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_run import TINY, small

from jfp8rl.config import load_config
from jfp8rl.loop import run
from jfp8rl.metrics import read_metrics

SCRIPT = """
import json, sys
from jfp8rl.config import load_config
from jfp8rl.metrics import read_metrics
from jfp8rl.loop import run
overrides = json.loads(sys.argv[1]) + [f"run_dir={sys.argv[2]}/d2", "train.mesh.data=2"]
run(load_config(sys.argv[3], overrides))
print(json.dumps(read_metrics(f"{sys.argv[2]}/d2")))
"""


@pytest.mark.slow
def test_two_devices_match_one(base_policy_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    overrides = [
        o for o in small(tmp_path, cache_dir, "train.steps=2", "train.eval_every=0")
        if not o.startswith("run_dir=")
    ]  # fmt: skip
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(overrides), str(tmp_path), str(TINY)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(proc.stdout.strip().splitlines()[-1])
    run(load_config(TINY, [*overrides, f"run_dir={tmp_path / 'd1'}"]))
    one = read_metrics(tmp_path / "d1")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2]
    for ra, rb in zip(one, two, strict=True):
        for k, va in ra.items():
            if k.startswith(("timing/", "throughput/")) or va is None:
                continue
            # Same math, different reduction order across devices: f32 rounding only.
            assert abs(va - rb[k]) <= 1e-4 * max(1.0, abs(va)), (ra["step"], k, va, rb[k])
